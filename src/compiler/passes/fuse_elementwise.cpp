// Elementwise fusion: a tree of elementwise ops (unary, binary, where, cast) becomes one
// fused_elementwise node whose program computes the whole tree in one pass over the result, so the
// intermediates never reach memory and the engine launches one kernel instead of many.
//
// Starting from the last node, each fusible node not yet taken is the root of a group. The group
// grows through an operand when its producer is fusible, has exactly one result, has the root's shape
// (a smaller producer, broadcast later, stays outside: fusing it would compute it once per element of
// the larger result) and every use of that result lies inside the group (never a graph output). Values
// entering the group from outside become the fused node's operands, broadcast as before. Only dtypes
// the fused kernel computes (f32, f16, bf16, bool) on CPU fuse.
#include <algorithm>
#include <map>
#include <set>
#include <vector>

#include "compiler/passes/rewrite.h"
#include "kiln/compiler/passes.h"
#include "kiln/graph/elementwise_program.h"

namespace kiln::compiler::passes {

namespace {

using graph::GraphIR;
using graph::Node;
using graph::Op;
using graph::ValueId;

// An elementwise node whose operands and result are tensors of dtypes the device's fused kernel
// takes (the fused node's first operand may be any of them).
bool fusible(const GraphIR& g, const KernelCatalog& kernels, const Node& n) {
  if (!graph::is_fusible_elementwise(n.op) || n.outputs.size() != 1) return false;
  const auto* result = std::get_if<graph::TensorType>(&g.type(n.outputs[0]));
  auto has_fused_kernel = [&](DType d) { return kernels.has_kernel({Op::fused_elementwise, result->device.kind, d}); };
  if (!result || !has_fused_kernel(result->dtype)) return false;
  for (ValueId v : n.inputs) {
    const auto* t = std::get_if<graph::TensorType>(&g.type(v));
    if (!t || t->device != result->device || !has_fused_kernel(t->dtype)) return false;
  }
  return true;
}

class Fuser {
 public:
  Fuser(GraphIR& g, const KernelCatalog& kernels) : g_(g), kernels_(kernels), rewrite_(g), taken_(g.nodes.size(), false), consumers_(g.value_types.size()) {
    for (size_t i = 0; i < g.nodes.size(); ++i)
      for (ValueId v : g.nodes[i].inputs) consumers_[static_cast<size_t>(v)].push_back(static_cast<int64_t>(i));
    for (ValueId v : g.outputs) consumers_[static_cast<size_t>(v)].push_back(-1);  // the graph's return
  }

  void run() {
    for (size_t i = g_.nodes.size(); i-- > 0;) {
      if (taken_[i] || !fusible(g_, kernels_, g_.nodes[i])) continue;
      std::set<int64_t> group = grow(i);
      if (group.size() < 2) continue;
      for (int64_t member : group) taken_[static_cast<size_t>(member)] = true;
      replace(i, group);
    }
    rewrite_.apply();
  }

 private:
  // The nodes of the group rooted at `root`, grown to a fixpoint (a producer with two consumers joins
  // once both are members).
  std::set<int64_t> grow(size_t root) {
    const graph::Type& root_type = g_.type(g_.nodes[root].outputs[0]);
    const graph::Shape& shape = std::get<graph::TensorType>(root_type).shape;
    std::set<int64_t> group{static_cast<int64_t>(root)};
    for (bool grew = true; grew;) {
      grew = false;
      for (int64_t member : std::vector<int64_t>(group.begin(), group.end())) {
        for (ValueId v : g_.nodes[static_cast<size_t>(member)].inputs) {
          const int64_t p = rewrite_.producer(v);
          if (p < 0 || group.count(p) || taken_[static_cast<size_t>(p)]) continue;
          const Node& producer = g_.nodes[static_cast<size_t>(p)];
          if (!fusible(g_, kernels_, producer) || !(std::get<graph::TensorType>(g_.type(v)).shape == shape)) continue;
          const auto& users = consumers_[static_cast<size_t>(v)];
          if (!std::all_of(users.begin(), users.end(), [&](int64_t u) { return group.count(u) > 0; })) continue;
          group.insert(p);
          grew = true;
        }
      }
    }
    return group;
  }

  // Replaces the group by one fused_elementwise node at the root's place, defining the root's result.
  void replace(size_t root, const std::set<int64_t>& group) {
    std::vector<ValueId> operands;
    std::map<ValueId, int32_t> reg;  // value -> register
    auto register_of = [&](ValueId v) {
      auto it = reg.find(v);
      if (it != reg.end()) return it->second;
      // Not defined inside the group (members come in program order): an operand of the fused node.
      const auto r = static_cast<int32_t>(operands.size());
      operands.push_back(v);
      reg.emplace(v, r);
      return r;
    };
    // Operands first, so their registers are %0 .. %(n-1).
    std::set<ValueId> defined;
    for (int64_t member : group) defined.insert(g_.nodes[static_cast<size_t>(member)].outputs[0]);
    for (int64_t member : group)
      for (ValueId v : g_.nodes[static_cast<size_t>(member)].inputs)
        if (!defined.count(v)) register_of(v);

    graph::ElementwiseProgram program;
    program.num_inputs = static_cast<int32_t>(operands.size());
    for (int64_t member : group) {
      const Node& n = g_.nodes[static_cast<size_t>(member)];
      graph::ElementwiseInstruction in;
      in.op = n.op;
      in.dtype = graph::dtype_of(g_.type(n.outputs[0]));
      for (ValueId v : n.inputs) in.operands.push_back(register_of(v));
      if (n.op == Op::gelu)
        in.gelu_tanh = graph::get_attr<std::string>(n.attrs, "approximate", n.op) == "tanh";
      reg.emplace(n.outputs[0], program.num_registers());
      program.instructions.push_back(std::move(in));
      rewrite_.erase(static_cast<size_t>(member));
    }
    Node fused{Op::fused_elementwise, operands, {g_.nodes[root].outputs[0]}, {{"program", program.to_string()}}};
    rewrite_.insert_before(root, {std::move(fused)});
  }

  GraphIR& g_;
  const KernelCatalog& kernels_;
  GraphRewrite rewrite_;
  std::vector<bool> taken_;                     // by node: already part of a group
  std::vector<std::vector<int64_t>> consumers_;  // by value: consuming nodes, -1 for the graph's return
};

}  // namespace

graph::Module fuse_elementwise(graph::Module module, const KernelCatalog& kernels) {
  return for_each_graph(std::move(module), [&](GraphIR& g, const graph::Module&) { Fuser(g, kernels).run(); });
}

}  // namespace kiln::compiler::passes
