#include "compiler/passes/rewrite.h"

#include <functional>
#include <set>
#include <string>

#include <fmt/format.h>

#include "kiln/errors.h"

namespace kiln::compiler::passes {

using graph::GraphIR;
using graph::Node;
using graph::ValueId;

GraphRewrite::GraphRewrite(GraphIR& g)
    : g_(g),
      replacement_(g.value_types.size()),
      erased_(g.nodes.size(), false),
      producer_(g.value_types.size(), -1),
      inserted_(g.nodes.size()) {
  for (size_t v = 0; v < replacement_.size(); ++v) replacement_[v] = static_cast<ValueId>(v);
  for (size_t i = 0; i < g.nodes.size(); ++i)
    for (ValueId v : g.nodes[i].outputs) producer_[static_cast<size_t>(v)] = static_cast<int64_t>(i);
}

ValueId GraphRewrite::resolve(ValueId v) const {
  while (replacement_[static_cast<size_t>(v)] != v) v = replacement_[static_cast<size_t>(v)];
  return v;
}

void GraphRewrite::replace(ValueId from, ValueId to) {
  to = resolve(to);
  if (from == to) return;
  if (!(g_.type(from) == g_.type(to)))
    throw Error(fmt::format("graph '{}': rewrite would replace a {} with a {}", g_.name,
                            graph::to_string(g_.type(from)), graph::to_string(g_.type(to))));
  replacement_[static_cast<size_t>(from)] = to;
  changed_ = true;
}

void GraphRewrite::resolve_operands(size_t index) {
  for (ValueId& v : g_.nodes[index].inputs) v = resolve(v);
}

void GraphRewrite::insert_before(size_t index, std::vector<Node> nodes) {
  for (const Node& n : nodes)
    for (ValueId v : n.outputs) producer_[static_cast<size_t>(v)] = static_cast<int64_t>(index);
  auto& slot = inserted_[index];
  slot.insert(slot.end(), std::make_move_iterator(nodes.begin()), std::make_move_iterator(nodes.end()));
  changed_ = true;
}

bool GraphRewrite::apply() {
  std::vector<Node> nodes;
  nodes.reserve(g_.nodes.size());
  for (size_t i = 0; i < g_.nodes.size(); ++i) {
    for (Node& n : inserted_[i]) nodes.push_back(std::move(n));
    if (erased_[i]) {
      changed_ = true;
      continue;
    }
    nodes.push_back(std::move(g_.nodes[i]));
  }
  for (Node& n : nodes)
    for (ValueId& v : n.inputs) v = resolve(v);
  for (ValueId& v : g_.outputs) v = resolve(v);

  // Renumber densely in definition order: inputs first, then node results.
  std::vector<ValueId> new_id(g_.value_types.size(), -1);
  std::vector<graph::Type> types;
  auto define = [&](ValueId v) {
    new_id[static_cast<size_t>(v)] = static_cast<ValueId>(types.size());
    types.push_back(g_.value_types[static_cast<size_t>(v)]);
  };
  auto renumber = [&](ValueId v, const std::string& where) {
    ValueId id = new_id[static_cast<size_t>(v)];
    if (id < 0)
      throw Error(fmt::format("graph '{}': internal rewrite error: {} uses value {}, which no longer "
                              "has a definition before it",
                              g_.name, where, v));
    return id;
  };
  for (ValueId v : g_.inputs) define(v);
  for (Node& n : nodes) {
    for (ValueId& v : n.inputs) v = renumber(v, std::string(graph::op_name(n.op)));
    for (ValueId v : n.outputs) define(v);
    for (ValueId& v : n.outputs) v = new_id[static_cast<size_t>(v)];
  }
  for (ValueId& v : g_.outputs) v = renumber(v, "the graph's return");
  for (ValueId& v : g_.inputs) v = new_id[static_cast<size_t>(v)];

  // Keep exactly the weights whose nodes are left, in order of first use.
  std::vector<graph::Weight> weights;
  std::set<std::string> seen;
  for (const Node& n : nodes) {
    if (n.op != graph::Op::weight) continue;
    const auto& name = graph::get_attr<std::string>(n.attrs, "name", n.op);
    if (!seen.insert(name).second) continue;
    if (const graph::Weight* w = g_.find_weight(name))
      weights.push_back(*w);
    else
      weights.push_back({name, graph::get_attr<DType>(n.attrs, "dtype", n.op),
                         graph::get_attr<graph::Shape>(n.attrs, "shape", n.op),
                         graph::get_attr<DeviceRef>(n.attrs, "device", n.op)});
  }

  g_.nodes = std::move(nodes);
  g_.value_types = std::move(types);
  g_.weights = std::move(weights);
  return changed_;
}

bool has_effects(const graph::Module& module, const Node& node) {
  if (graph::has_side_effects(node.op)) return true;
  if (node.op != graph::Op::call) return false;
  // A call is as effectful as its callee; a cycle (which the verifier rejects) counts as effectful.
  // Effect-free graphs are remembered, so graphs that call one another many times are walked once each.
  std::set<std::string> visiting, pure;
  std::function<bool(const std::string&)> graph_has_effects = [&](const std::string& name) {
    if (pure.count(name)) return false;
    const GraphIR* callee = module.find(name);
    if (!callee || !visiting.insert(name).second) return true;
    for (const Node& n : callee->nodes) {
      if (graph::has_side_effects(n.op)) return true;
      if (n.op == graph::Op::call &&
          graph_has_effects(graph::get_attr<std::string>(n.attrs, "callee", n.op)))
        return true;
    }
    visiting.erase(name);
    pure.insert(name);
    return false;
  };
  return graph_has_effects(graph::get_attr<std::string>(node.attrs, "callee", node.op));
}

}  // namespace kiln::compiler::passes
