// The graph IR: a Module (compile unit) holds named top-level graphs; a graph is a list of nodes in
// program order over SSA values. Graph is the builder handle; GraphIR is the data passes work on.
//
//   graph::Graph g("mlp", {TensorType{DType::f32, {"batch", 64}}});
//   auto x = g.input(0);
//   auto w = g.weight({"w1", DType::f32, {64, 10}});
//   g.output({ops::relu(ops::matmul(x, w))});
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "kiln/graph/op.h"
#include "kiln/graph/types.h"

namespace kiln::graph {

using ValueId = int32_t;

// A named external constant, bound to data when a compiled model is initialised.
struct Weight {
  std::string name;
  DType dtype = DType::f32;
  Shape shape;
  DeviceRef device = DeviceRef::CPU();
  TensorType type() const { return {dtype, shape, device}; }
  bool operator==(const Weight&) const = default;
};

struct Node {
  Op op;
  std::vector<ValueId> inputs;
  std::vector<ValueId> outputs;
  Attrs attrs;
};

// One graph's data. Values 0..inputs.size()-1 are the graph's inputs, in order; every other value is
// an output of exactly one node, and nodes appear after the producers of their inputs.
struct GraphIR {
  std::string name;
  std::vector<Type> value_types;  // indexed by ValueId
  std::vector<ValueId> inputs;
  std::vector<Node> nodes;
  std::vector<ValueId> outputs;
  std::vector<Weight> weights;    // every weight the graph uses, by first use; names unique

  int64_t num_inputs() const { return static_cast<int64_t>(inputs.size()); }
  const Type& type(ValueId v) const { return value_types.at(static_cast<size_t>(v)); }
  std::vector<Type> input_types() const;
  std::vector<Type> output_types() const;
  const Weight* find_weight(const std::string& name) const;
};

// A compile unit: several top-level graphs with unique names. Copying deep-copies the graphs, so a
// pass can take a Module and return a new one.
class Module {
 public:
  Module() = default;
  Module(const Module&);
  Module& operator=(const Module&);
  Module(Module&&) noexcept = default;
  Module& operator=(Module&&) noexcept = default;

  // Adds an empty graph; ValueError if the name is taken.
  GraphIR& add_graph(const std::string& name, const std::vector<Type>& input_types);
  GraphIR* find(const std::string& name);
  const GraphIR* find(const std::string& name) const;
  const GraphIR& at(const std::string& name) const;  // ValueError naming the graph
  GraphIR& at(const std::string& name);
  std::vector<std::string> graph_names() const;      // in insertion order
  size_t size() const { return graphs_.size(); }
  auto begin() const { return graphs_.begin(); }
  auto end() const { return graphs_.end(); }
  std::vector<std::unique_ptr<GraphIR>>& graphs() { return graphs_; }
  const std::vector<std::unique_ptr<GraphIR>>& graphs() const { return graphs_; }

 private:
  std::vector<std::unique_ptr<GraphIR>> graphs_;
};

class Graph;

// A value in a graph being built. Cheap to copy; valid while its graph lives.
class Value {
 public:
  Value() = default;
  Value(GraphIR* graph, Module* module, ValueId id) : graph_(graph), module_(module), id_(id) {}

  bool valid() const { return graph_ != nullptr; }
  ValueId id() const { return id_; }
  GraphIR* graph() const { return graph_; }
  Module* module() const { return module_; }
  // Returned by value: the graph's type table moves when nodes are added, so a reference held across
  // an op call would dangle.
  Type type() const;
  DType dtype() const;
  Shape shape() const;
  DeviceRef device() const;
  int64_t rank() const;
  bool is_buffer() const;
  TensorType tensor_type() const;  // ValueError if a buffer
  BufferType buffer_type() const;  // ValueError if a tensor

 private:
  GraphIR* graph_ = nullptr;
  Module* module_ = nullptr;
  ValueId id_ = -1;
};

// Same handle; the names say what an API expects.
class TensorValue : public Value {
 public:
  TensorValue() = default;
  TensorValue(Value v);  // ValueError if v is a buffer
};
class BufferValue : public Value {
 public:
  BufferValue() = default;
  BufferValue(Value v);  // ValueError if v is a tensor
};

// Arithmetic and comparison operators build the matching ops.
TensorValue operator+(const TensorValue&, const TensorValue&);
TensorValue operator-(const TensorValue&, const TensorValue&);
TensorValue operator*(const TensorValue&, const TensorValue&);
TensorValue operator/(const TensorValue&, const TensorValue&);
TensorValue operator-(const TensorValue&);
TensorValue operator+(const TensorValue&, double);  // scalar of the value's dtype
TensorValue operator-(const TensorValue&, double);
TensorValue operator*(const TensorValue&, double);
TensorValue operator/(const TensorValue&, double);
TensorValue operator+(double, const TensorValue&);
TensorValue operator-(double, const TensorValue&);
TensorValue operator*(double, const TensorValue&);
TensorValue operator/(double, const TensorValue&);

struct GraphOptions {
  bool verify_each_op = false;  // run the verifier after every op is added (slow; for debugging)
};

// Builder handle for one graph. Constructing it adds the graph to `into` (which must outlive it), or,
// without `into`, to a Module of its own. While a Graph is alive and entered (Graph::Scope), ops
// without operands (ops::constant, ops::range) and Weight uses go to it.
class Graph {
 public:
  Graph(const std::string& name, const std::vector<Type>& input_types, Module* into = nullptr,
        GraphOptions options = {});

  const std::string& name() const { return ir_->name; }
  std::vector<Value> inputs() const;
  Value input(int64_t i) const;  // ValueError naming the index and the count
  // Adds (or reuses, by name) a weight and returns its value; a second weight of the same name with
  // another type is a ValueError naming it and both types.
  TensorValue weight(const Weight& w);
  // Sets the graph's outputs, then verifies the graph; a graph may be outputted once.
  void output(const std::vector<Value>& results);
  bool has_output() const { return output_set_; }

  GraphIR& ir() { return *ir_; }
  const GraphIR& ir() const { return *ir_; }
  Module& module() { return *module_; }
  const Module& module() const { return *module_; }
  std::string to_string() const;  // the graph's text form
  const GraphOptions& options() const { return options_; }

  // The innermost entered graph; ValueError if none.
  static Graph& current();
  // Enters a graph for the lifetime of the scope (nests; thread-local).
  class Scope {
   public:
    explicit Scope(Graph& g);
    ~Scope();
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;

   private:
    Graph* previous_;
  };

 private:
  std::shared_ptr<Module> owned_;
  Module* module_;
  GraphIR* ir_;
  GraphOptions options_;
  bool output_set_ = false;
};

// Adds a node to `graph` after inferring its output types (throws ShapeError/DTypeError naming the op
// and operand). The one place nodes are created; ops.cpp builds every op through it.
std::vector<Value> add_node(GraphIR& graph, Module* module, Op op, const std::vector<Value>& inputs,
                            Attrs attrs);

// Output types of an op applied to operands of the given types. Shared by the builders and the
// verifier. `module` resolves `call` targets (may be null otherwise).
std::vector<Type> infer_types(Op op, const std::vector<Type>& inputs, const Attrs& attrs,
                              const Module* module);

// Checks one graph's invariants (operands defined before use, types equal to infer_types, weight
// nodes declared, outputs set and valid); VerifyError naming the graph, node, op and operand.
// Graph::output runs it; compiler::passes::verify runs it on every graph and checks call cycles.
// `require_outputs` = false checks a graph still being built.
void verify_graph(const GraphIR& graph, const Module* module, bool require_outputs = true);

}  // namespace kiln::graph
