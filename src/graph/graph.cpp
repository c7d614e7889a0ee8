#include "kiln/graph/graph.h"

#include <fmt/format.h>

#include "kiln/errors.h"
#include "kiln/graph/text.h"

namespace kiln::graph {

// ==== GraphIR ===================================================================================

std::vector<Type> GraphIR::input_types() const {
  std::vector<Type> types;
  for (ValueId v : inputs) types.push_back(type(v));
  return types;
}

std::vector<Type> GraphIR::output_types() const {
  std::vector<Type> types;
  for (ValueId v : outputs) types.push_back(type(v));
  return types;
}

const Weight* GraphIR::find_weight(const std::string& weight_name) const {
  for (const Weight& w : weights)
    if (w.name == weight_name) return &w;
  return nullptr;
}

// ==== Module ====================================================================================

Module::Module(const Module& other) {
  graphs_.reserve(other.graphs_.size());
  for (const auto& g : other.graphs_) graphs_.push_back(std::make_unique<GraphIR>(*g));
}

Module& Module::operator=(const Module& other) {
  if (this != &other) {
    Module copy(other);
    graphs_ = std::move(copy.graphs_);
  }
  return *this;
}

GraphIR& Module::add_graph(const std::string& name, const std::vector<Type>& input_types) {
  if (name.empty()) throw ValueError("Module::add_graph: a graph needs a non-empty name");
  if (find(name))
    throw ValueError(fmt::format("Module::add_graph: a graph named '{}' already exists", name));
  auto g = std::make_unique<GraphIR>();
  g->name = name;
  g->value_types = input_types;
  for (size_t i = 0; i < input_types.size(); ++i) g->inputs.push_back(static_cast<ValueId>(i));
  graphs_.push_back(std::move(g));
  return *graphs_.back();
}

GraphIR* Module::find(const std::string& name) {
  for (auto& g : graphs_)
    if (g->name == name) return g.get();
  return nullptr;
}

const GraphIR* Module::find(const std::string& name) const {
  for (const auto& g : graphs_)
    if (g->name == name) return g.get();
  return nullptr;
}

const GraphIR& Module::at(const std::string& name) const {
  if (const GraphIR* g = find(name)) return *g;
  throw ValueError(fmt::format("Module: no graph named '{}'", name));
}

GraphIR& Module::at(const std::string& name) {
  if (GraphIR* g = find(name)) return *g;
  throw ValueError(fmt::format("Module: no graph named '{}'", name));
}

std::vector<std::string> Module::graph_names() const {
  std::vector<std::string> names;
  for (const auto& g : graphs_) names.push_back(g->name);
  return names;
}

// ==== Value =====================================================================================

Type Value::type() const {
  if (!graph_) throw ValueError("Value: use of an empty (default-constructed) value");
  if (id_ < 0 || static_cast<size_t>(id_) >= graph_->value_types.size())
    throw ValueError(fmt::format("Value: %{} is not a value of graph '{}'", id_, graph_->name));
  return graph_->type(id_);
}
DType Value::dtype() const { return dtype_of(type()); }
Shape Value::shape() const { return shape_of(type()); }
DeviceRef Value::device() const { return device_of(type()); }
int64_t Value::rank() const { return shape().rank(); }
bool Value::is_buffer() const { return graph::is_buffer(type()); }

TensorType Value::tensor_type() const {
  Type t = type();
  if (auto* tensor = std::get_if<TensorType>(&t)) return *tensor;
  throw ValueError(fmt::format("Value: %{} is a buffer ({}), expected a tensor", id_,
                               graph::to_string(type())));
}

BufferType Value::buffer_type() const {
  Type t = type();
  if (auto* buffer = std::get_if<BufferType>(&t)) return *buffer;
  throw ValueError(fmt::format("Value: %{} is a tensor ({}), expected a buffer", id_,
                               graph::to_string(type())));
}

// An empty handle stays empty; add_node rejects it with the op's name.
TensorValue::TensorValue(Value v) : Value(v) {
  if (valid()) tensor_type();
}
BufferValue::BufferValue(Value v) : Value(v) {
  if (valid()) buffer_type();
}

// ==== Graph =====================================================================================

namespace {
thread_local Graph* current_graph = nullptr;
}  // namespace

Graph::Graph(const std::string& name, const std::vector<Type>& input_types, Module* into,
             GraphOptions options)
    : options_(options) {
  if (!into) {
    owned_ = std::make_shared<Module>();
    into = owned_.get();
  }
  module_ = into;
  ir_ = &module_->add_graph(name, input_types);
}

std::vector<Value> Graph::inputs() const {
  std::vector<Value> values;
  for (ValueId v : ir_->inputs) values.emplace_back(ir_, module_, v);
  return values;
}

Value Graph::input(int64_t i) const {
  if (i < 0 || i >= ir_->num_inputs())
    throw ValueError(fmt::format("Graph '{}': input index {} out of range ({} inputs)", ir_->name,
                                 i, ir_->num_inputs()));
  return Value(ir_, module_, ir_->inputs[static_cast<size_t>(i)]);
}

TensorValue Graph::weight(const Weight& w) {
  if (const Weight* existing = ir_->find_weight(w.name)) {
    if (!(*existing == w))
      throw ValueError(fmt::format("Graph '{}': weight '{}' is already declared as {}, not {}",
                                   ir_->name, w.name, existing->type().to_string(),
                                   w.type().to_string()));
    for (const Node& n : ir_->nodes)
      if (n.op == Op::weight && get_attr<std::string>(n.attrs, "name", Op::weight) == w.name)
        return Value(ir_, module_, n.outputs.at(0));
  }
  Attrs attrs{{"name", w.name}, {"dtype", w.dtype}, {"shape", w.shape}, {"device", w.device}};
  Value v = add_node(*ir_, module_, Op::weight, {}, std::move(attrs)).at(0);
  // A pass may have removed the node but kept the declaration; declare only once.
  if (!ir_->find_weight(w.name)) ir_->weights.push_back(w);
  return v;
}

void Graph::output(const std::vector<Value>& results) {
  if (output_set_)
    throw ValueError(fmt::format("Graph '{}': output() was already called", ir_->name));
  std::vector<ValueId> ids;
  for (size_t i = 0; i < results.size(); ++i) {
    const Value& r = results[i];
    if (!r.valid())
      throw ValueError(fmt::format("Graph '{}': output {} is an empty value", ir_->name, i));
    if (r.graph() != ir_)
      throw ValueError(fmt::format("Graph '{}': output {} belongs to graph '{}'", ir_->name, i,
                                   r.graph()->name));
    r.type();  // checks the id
    ids.push_back(r.id());
  }
  ir_->outputs = std::move(ids);
  output_set_ = true;
  verify_graph(*ir_, module_);
}

std::string Graph::to_string() const { return print(*ir_); }

Graph& Graph::current() {
  if (!current_graph)
    throw ValueError("Graph::current: no graph is entered (enter one with Graph::Scope)");
  return *current_graph;
}

Graph::Scope::Scope(Graph& g) : previous_(current_graph) { current_graph = &g; }
Graph::Scope::~Scope() { current_graph = previous_; }

// ==== add_node ==================================================================================

std::vector<Value> add_node(GraphIR& graph, Module* module, Op op, const std::vector<Value>& inputs,
                            Attrs attrs) {
  std::vector<Type> input_types;
  std::vector<ValueId> input_ids;
  for (size_t i = 0; i < inputs.size(); ++i) {
    const Value& v = inputs[i];
    if (!v.valid())
      throw ValueError(fmt::format("{}: operand {} is an empty value", op_name(op), i));
    if (v.graph() != &graph)
      throw ValueError(fmt::format("{}: operand {} belongs to graph '{}', not '{}'", op_name(op), i,
                                   v.graph()->name, graph.name));
    if (v.id() < 0 || static_cast<size_t>(v.id()) >= graph.value_types.size())
      throw ValueError(fmt::format("{}: operand {} (%{}) is not a value of graph '{}'",
                                   op_name(op), i, v.id(), graph.name));
    input_types.push_back(graph.type(v.id()));
    input_ids.push_back(v.id());
  }
  std::vector<Type> output_types = infer_types(op, input_types, attrs, module);

  Node node{op, std::move(input_ids), {}, std::move(attrs)};
  std::vector<Value> results;
  for (Type& t : output_types) {
    auto id = static_cast<ValueId>(graph.value_types.size());
    graph.value_types.push_back(std::move(t));
    node.outputs.push_back(id);
    results.emplace_back(&graph, module, id);
  }
  graph.nodes.push_back(std::move(node));

  if (current_graph && &current_graph->ir() == &graph && current_graph->options().verify_each_op)
    verify_graph(graph, module, /*require_outputs=*/false);
  return results;
}

}  // namespace kiln::graph
