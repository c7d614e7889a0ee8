// The per-graph verifier. It lives in the graph layer because Graph::output runs it;
// compiler::passes::verify adds the module-wide checks (call cycles) on top.
#include <fmt/format.h>

#include "kiln/errors.h"
#include "kiln/graph/graph.h"

namespace kiln::graph {

namespace {

struct Verifier {
  const GraphIR& g;
  const Module* module;
  std::vector<bool> defined;

  [[noreturn]] void fail(const std::string& what) const {
    throw VerifyError(fmt::format("verify: graph '{}': {}", g.name, what));
  }
  [[noreturn]] void fail_node(size_t k, const Node& n, const std::string& what) const {
    throw VerifyError(fmt::format("verify: graph '{}' node {} ({}): {}", g.name, k, op_name(n.op), what));
  }
  bool exists(ValueId v) const { return v >= 0 && static_cast<size_t>(v) < g.value_types.size(); }

  void check_inputs() {
    for (size_t i = 0; i < g.inputs.size(); ++i) {
      if (g.inputs[i] != static_cast<ValueId>(i))
        fail(fmt::format("input {} is %{}; inputs must be values 0..{}", i, g.inputs[i], g.inputs.size() - 1));
      if (!exists(g.inputs[i])) fail(fmt::format("input {} has no type", i));
      defined[i] = true;
    }
  }

  void check_weight_node(size_t k, const Node& n) const {
    const std::string& name = get_attr<std::string>(n.attrs, "name", Op::weight);
    const Weight* w = g.find_weight(name);
    if (!w) fail_node(k, n, fmt::format("weight '{}' is not declared in the graph's weights", name));
    TensorType node_type{get_attr<DType>(n.attrs, "dtype", Op::weight),
                         get_attr<Shape>(n.attrs, "shape", Op::weight),
                         get_attr<DeviceRef>(n.attrs, "device", Op::weight)};
    if (!(node_type == w->type()))
      fail_node(k, n, fmt::format("weight '{}' has type {} but is declared as {}", name,
                                  node_type.to_string(), w->type().to_string()));
  }

  void check_node(size_t k, const Node& n) {
    std::vector<Type> operand_types;
    for (size_t j = 0; j < n.inputs.size(); ++j) {
      ValueId v = n.inputs[j];
      if (!exists(v))
        fail_node(k, n, fmt::format("operand {} is %{}, which does not exist ({} values)", j, v,
                                    g.value_types.size()));
      if (!defined[static_cast<size_t>(v)])
        fail_node(k, n, fmt::format("operand {} (%{}) is used before it is defined", j, v));
      operand_types.push_back(g.type(v));
    }
    std::vector<Type> expected;
    try {
      expected = infer_types(n.op, operand_types, n.attrs, module);
    } catch (const std::exception& e) {  // any inference failure is a broken invariant here
      fail_node(k, n, e.what());
    }
    if (expected.size() != n.outputs.size())
      fail_node(k, n, fmt::format("has {} results but its operands give {}", n.outputs.size(),
                                  expected.size()));
    for (size_t j = 0; j < n.outputs.size(); ++j) {
      ValueId v = n.outputs[j];
      if (!exists(v))
        fail_node(k, n, fmt::format("result {} is %{}, which has no type ({} values)", j, v,
                                    g.value_types.size()));
      if (defined[static_cast<size_t>(v)])
        fail_node(k, n, fmt::format("result {} (%{}) is already defined", j, v));
      if (!(g.type(v) == expected[j]))
        fail_node(k, n, fmt::format("result {} (%{}) has type {} but its operands give {}", j, v,
                                    to_string(g.type(v)), to_string(expected[j])));
      defined[static_cast<size_t>(v)] = true;
    }
    if (n.op == Op::weight) check_weight_node(k, n);
  }

  void check_weights() const {
    for (size_t i = 0; i < g.weights.size(); ++i)
      for (size_t j = 0; j < i; ++j)
        if (g.weights[i].name == g.weights[j].name)
          fail(fmt::format("weight '{}' is declared twice", g.weights[i].name));
  }

  void check_outputs() const {
    // A graph with no outputs computes nothing unless it writes a buffer.
    if (g.outputs.empty()) {
      bool writes = false;
      for (const Node& n : g.nodes)
        writes |= n.op == Op::buffer_store || n.op == Op::paged_kv_store || n.op == Op::inplace_custom;
      if (!writes) fail("has no outputs (output() was never called)");
    }
    for (size_t i = 0; i < g.outputs.size(); ++i) {
      ValueId v = g.outputs[i];
      if (!exists(v) || !defined[static_cast<size_t>(v)])
        fail(fmt::format("output {} is %{}, which is not defined", i, v));
    }
  }
};

}  // namespace

void verify_graph(const GraphIR& graph, const Module* module, bool require_outputs) {
  Verifier v{graph, module, std::vector<bool>(graph.value_types.size(), false)};
  v.check_inputs();
  v.check_weights();
  for (size_t k = 0; k < graph.nodes.size(); ++k) v.check_node(k, graph.nodes[k]);
  if (require_outputs) v.check_outputs();
}

}  // namespace kiln::graph
