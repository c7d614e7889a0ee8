// Inlining of `call` nodes: the compiler plans one flat list of kernel launches per graph, so every
// call is replaced by a copy of its callee's nodes (recursively), with fresh value ids.
#include "kiln/compiler/passes.h"

#include <algorithm>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "kiln/errors.h"

namespace kiln::compiler::passes {

namespace {

using graph::GraphIR;
using graph::Module;
using graph::Node;
using graph::Op;
using graph::ValueId;

// Nodes one graph may visit while inlining, calls included: a chain of graphs that each call the next
// twice is a few lines of text but 2^chain nodes once inlined, refused here instead of expanded.
constexpr size_t kMaxInlinedNodes = size_t{1} << 20;

bool has_calls(const GraphIR& g) {
  return std::any_of(g.nodes.begin(), g.nodes.end(), [](const Node& n) { return n.op == Op::call; });
}

// Copies `source`'s nodes into `target`. `source` value v becomes `mapping[v]`; its inputs are mapped
// on entry (to the call's arguments). Returns the mapped outputs. `stack` holds the graphs being
// inlined, to reject recursion; `visited` counts the nodes copied or expanded into `target`.
std::vector<ValueId> copy_body(const Module& module, const GraphIR& source, std::vector<ValueId> mapping,
                               GraphIR& target, std::vector<std::string>& stack, size_t& visited) {
  mapping.resize(source.value_types.size(), -1);
  auto mapped = [&](ValueId v) {
    ValueId m = mapping.at(static_cast<size_t>(v));
    if (m < 0)
      throw VerifyError(fmt::format("compile: graph '{}' uses value %{} before it is defined",
                                    source.name, v));
    return m;
  };
  for (const Node& node : source.nodes) {
    if (++visited > kMaxInlinedNodes)
      throw VerifyError(
          fmt::format("compile: graph '{}' inlines to more than {} nodes (through calls to '{}')",
                      stack.front(), kMaxInlinedNodes, source.name));
    std::vector<ValueId> inputs;
    inputs.reserve(node.inputs.size());
    for (ValueId v : node.inputs) inputs.push_back(mapped(v));

    if (node.op == Op::call) {
      const auto& callee_name = graph::get_attr<std::string>(node.attrs, "callee", Op::call);
      const GraphIR* callee = module.find(callee_name);
      if (!callee)
        throw VerifyError(fmt::format("compile: graph '{}' calls '{}', which is not in the module",
                                      source.name, callee_name));
      if (std::find(stack.begin(), stack.end(), callee_name) != stack.end())
        throw VerifyError(fmt::format("compile: graph '{}' calls '{}' recursively", source.name,
                                      callee_name));
      if (callee->inputs.size() != inputs.size() || callee->outputs.size() != node.outputs.size())
        throw VerifyError(fmt::format(
            "compile: graph '{}' calls '{}' with {} arguments and {} results; it takes {} and returns {}",
            source.name, callee_name, inputs.size(), node.outputs.size(), callee->inputs.size(),
            callee->outputs.size()));
      std::vector<ValueId> callee_mapping(callee->value_types.size(), -1);
      for (size_t i = 0; i < inputs.size(); ++i)
        callee_mapping[static_cast<size_t>(callee->inputs[i])] = inputs[i];
      stack.push_back(callee_name);
      std::vector<ValueId> results = copy_body(module, *callee, callee_mapping, target, stack, visited);
      stack.pop_back();
      for (size_t i = 0; i < results.size(); ++i)
        mapping[static_cast<size_t>(node.outputs[i])] = results[i];
      continue;
    }

    Node copy{node.op, std::move(inputs), {}, node.attrs};
    for (ValueId v : node.outputs) {
      auto fresh = static_cast<ValueId>(target.value_types.size());
      target.value_types.push_back(source.type(v));
      copy.outputs.push_back(fresh);
      mapping[static_cast<size_t>(v)] = fresh;
    }
    if (node.op == Op::weight) {
      const auto& name = graph::get_attr<std::string>(node.attrs, "name", Op::weight);
      const graph::Weight* declared = source.find_weight(name);
      graph::Weight weight = declared ? *declared
                                      : graph::Weight{name,
                                                      graph::dtype_of(source.type(node.outputs.at(0))),
                                                      graph::shape_of(source.type(node.outputs.at(0))),
                                                      graph::device_of(source.type(node.outputs.at(0)))};
      if (const graph::Weight* existing = target.find_weight(name)) {
        if (!(*existing == weight))
          throw VerifyError(fmt::format(
              "compile: weight '{}' is {} in graph '{}' but {} in graph '{}' (inlined by a call)", name,
              existing->type().to_string(), target.name, weight.type().to_string(), source.name));
      } else {
        target.weights.push_back(weight);
      }
    }
    target.nodes.push_back(std::move(copy));
  }
  std::vector<ValueId> outputs;
  outputs.reserve(source.outputs.size());
  for (ValueId v : source.outputs) outputs.push_back(mapped(v));
  return outputs;
}

}  // namespace

graph::Module inline_calls(const graph::Module& module) {
  Module result;
  for (const auto& graph : module.graphs()) {
    GraphIR& target = result.add_graph(graph->name, graph->input_types());
    if (!has_calls(*graph)) {
      target = *graph;
      continue;
    }
    target.value_types.clear();
    target.inputs.clear();
    target.nodes.clear();
    target.outputs.clear();
    target.weights.clear();
    std::vector<ValueId> mapping(graph->value_types.size(), -1);
    for (ValueId v : graph->inputs) {
      auto fresh = static_cast<ValueId>(target.value_types.size());
      target.value_types.push_back(graph->type(v));
      target.inputs.push_back(fresh);
      mapping[static_cast<size_t>(v)] = fresh;
    }
    std::vector<std::string> stack{graph->name};
    size_t visited = 0;
    target.outputs = copy_body(module, *graph, mapping, target, stack, visited);
  }
  return result;
}

}  // namespace kiln::compiler::passes
