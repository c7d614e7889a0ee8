// nn::Module (MAX's v2 module): a module builds ops into the graph being traced. Weights and child
// modules are registered under attribute names, which give fully qualified weight names
// ("layers.3.self_attn.q_proj.weight") by the path from the root module.
//
//   class Scale : public nn::Module {
//    public:
//     explicit Scale(int64_t n) { weight_ = register_weight("weight", DType::f32, {n}); }
//     graph::TensorValue operator()(const graph::TensorValue& x) { return x * weight(weight_); }
//     Values forward(const std::vector<Values>& args) override { return Values((*this)(args[0].leaf())); }
//    private:
//     WeightId weight_;
//   };
#pragma once

#include <cstddef>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "kiln/tensor/tensor.h"
#include "kiln/graph/graph.h"
#include "kiln/graph/tree.h"

namespace kiln::nn {

// The values a module's forward takes and returns: a leaf, list or named tree of graph values.
using Values = graph::Tree<graph::Value>;
using TypeTree = graph::Tree<graph::InputType>;

// Which piece of a logical (unsharded) weight a module holds, for tensor parallelism
// (nn/tensor_parallel.h): slice `index` of `count` equal slices along `axis`, or, with axis
// kReplicated, a whole copy (replica `index` of `count`, one per device).
struct ShardSpec {
  static constexpr int64_t kReplicated = -1;
  int64_t axis = kReplicated;
  int64_t index = 0;
  int64_t count = 1;
};

// What a shard weight is a piece of: its logical (checkpoint) name and full shape, and which piece.
struct WeightShard {
  std::string logical_name;  // "model.layers.0.self_attn.q_proj.weight"
  graph::Shape full_shape;
  ShardSpec spec;
};

class Module {
 public:
  Module() = default;
  virtual ~Module();
  Module(const Module&) = delete;
  Module& operator=(const Module&) = delete;

  // The traced forward pass, called inside the graph being built (graph::Graph::current()). `args`
  // holds one tree per declared input (or the one named tree of input_tree()). The default throws
  // ValueError: layers used only inside other modules need not implement it.
  virtual Values forward(const std::vector<Values>& args);

  // The inputs of a module that declares them as one named tree (e.g. {"tokens", {"cache": ...}}).
  virtual std::optional<TypeTree> input_tree() const { return std::nullopt; }

  // Fully qualified weight name -> declaration, in registration order (depth-first). A shard weight
  // is listed under its graph name ("....q_proj.weight.shard1") with the shard's shape.
  std::map<std::string, graph::Weight> raw_state_dict() const;
  // Fully qualified weight name -> data (shard weights: the shard's data, under the graph name). A
  // weight no registry has set yet gets zeros (as MAX's state_dict does), so it is valid right after
  // a trace.
  WeightsRegistry state_dict() const;
  // Binds data to weights by fully qualified name, checking dtype and shape (error naming the
  // weight). A shard weight is looked up by its logical name in the full, unsharded checkpoint: the
  // tensor must have the full shape, and the shard binds a copy of its slice (a replica binds the
  // tensor itself). strict: every weight must be present and no other name may be; the ValueError
  // lists the missing and unexpected names.
  void load_state_dict(const WeightsRegistry& registry, bool strict = true);
  // Graph name of every shard weight ("....q_proj.weight.shard1") -> what it is a piece of.
  std::map<std::string, WeightShard> weight_shards() const;

  // This module's prefix ("layers.3.self_attn"); empty for a root.
  std::string path() const;
  // The fully qualified name of one of this module's local weight names.
  std::string qualified_name(const std::string& local_name) const;
  const std::vector<std::pair<std::string, std::shared_ptr<Module>>>& children() const {
    return children_;
  }

 protected:
  using WeightId = size_t;

  // Registers a weight under a local name (unique within this module; ValueError otherwise).
  WeightId register_weight(const std::string& name, DType dtype, const graph::Shape& shape,
                           DeviceRef device = DeviceRef::CPU());
  // Registers piece `shard` of a logical weight of `full_shape` under a local name; its graph name
  // is the qualified name plus ".shard<index>". Several pieces of one logical weight share the local
  // name (same dtype, full shape, axis and count; distinct indices). ValueError for an index out of
  // range, an axis out of range, or a dim that does not split evenly into `count` (naming the weight,
  // the axis and the count).
  WeightId register_weight_shard(const std::string& name, DType dtype, const graph::Shape& full_shape,
                                 const ShardSpec& shard, DeviceRef device = DeviceRef::CPU());
  // Registers a child under a name (unique; a module may have one parent). Returns the child.
  template <class M>
  std::shared_ptr<M> register_module(const std::string& name, std::shared_ptr<M> child) {
    attach(name, child);
    return child;
  }
  // The weight as a value of the graph being built (adds it to the graph on first use).
  graph::TensorValue weight(WeightId id) const;
  const graph::Weight& weight_decl(WeightId id) const;  // local name, dtype, shape, device

 private:
  struct WeightSlot {
    graph::Weight decl;  // decl.name is the local name; decl.shape the shard's shape for a shard
    Tensor data;         // empty until a registry is loaded
    std::optional<WeightShard> shard;  // logical_name holds the local name here
    std::string graph_name() const;    // local name, plus ".shard<index>" for a shard
  };
  void attach(const std::string& name, std::shared_ptr<Module> child);
  template <class F> void visit_weights(const std::string& prefix, F&& f);
  template <class F> void visit_weights(const std::string& prefix, F&& f) const;

  const Module* parent_ = nullptr;
  std::string name_in_parent_;
  std::vector<WeightSlot> weights_;
  std::vector<std::pair<std::string, std::shared_ptr<Module>>> children_;
};

// A list of modules named "0", "1", ... (so weights read "layers.3.mlp.up_proj.weight").
template <class M>
class ModuleList : public Module {
 public:
  void append(std::shared_ptr<M> m) { items_.push_back(register_module(std::to_string(items_.size()), std::move(m))); }
  size_t size() const { return items_.size(); }
  M& operator[](size_t i) const { return *items_.at(i); }
  auto begin() const { return items_.begin(); }
  auto end() const { return items_.end(); }

 private:
  std::vector<std::shared_ptr<M>> items_;
};

}  // namespace kiln::nn
