// Sibling matmul grouping: matmuls (or qmatmuls) that read one lhs value with weights of one kind,
// as a Llama layer's q/k/v projections and its MLP's gate/up do, become one grouped_matmul node with a
// result per weight. The CPU kernel then runs all of a decode step's GEMVs as one parallel job (one
// pool round trip instead of three, and the small k/v GEMVs no longer ramp up their memory streams
// alone); prefill runs each product as before (docs/fusion.md).
//
// Members of a group share: the op, the lhs value, the attributes (transpose_b / encoding), the rhs
// dtype, the result dtype, and the CPU device; each rhs is a rank-2 value produced directly by a
// `weight` node. The grouped node takes the first member's place and defines the members' result
// ids, so every use stays as it is. A weight node defined after that place (nn layers create a
// weight's node where it is first used) moves up to it: a weight has no operands, so it may be
// defined anywhere before its uses.
#include <algorithm>
#include <map>
#include <tuple>
#include <vector>

#include "compiler/passes/rewrite.h"
#include "kiln/compiler/passes.h"

namespace kiln::compiler::passes {

namespace {

using graph::GraphIR;
using graph::Node;
using graph::Op;
using graph::ValueId;

const graph::TensorType* tensor_type(const GraphIR& g, ValueId v) { return std::get_if<graph::TensorType>(&g.type(v)); }

// Whether node `n` may join a group, given the producer index of each value.
bool groupable(const GraphIR& g, const GraphRewrite& rewrite, const KernelCatalog& kernels, const Node& n) {
  if ((n.op != Op::matmul && n.op != Op::qmatmul) || n.inputs.size() != 2 || n.outputs.size() != 1) return false;
  for (const auto& [key, value] : n.attrs)
    if (key != "transpose_b" && key != "encoding") return false;  // an attribute the grouped op does not carry
  const int64_t producer = rewrite.producer(n.inputs[1]);
  if (producer < 0 || g.nodes[static_cast<size_t>(producer)].op != Op::weight) return false;
  const auto* lhs = tensor_type(g, n.inputs[0]);
  const auto* rhs = tensor_type(g, n.inputs[1]);
  const auto* result = tensor_type(g, n.outputs[0]);
  return lhs && rhs && result && rhs->rank() == 2 && lhs->device.kind == result->device.kind &&
         kernels.has_kernel({Op::grouped_matmul, result->device.kind, lhs->dtype});
}

struct Group {
  graph::Attrs attrs;
  std::vector<size_t> members;  // node indices, in program order
};

void group_graph(GraphIR& g, const KernelCatalog& kernels) {
  GraphRewrite rewrite(g);
  // (op, lhs, rhs dtype, result dtype) -> groups, told apart by their attributes.
  std::map<std::tuple<Op, ValueId, DType, DType>, std::vector<Group>> candidates;
  for (size_t i = 0; i < g.nodes.size(); ++i) {
    const Node& n = g.nodes[i];
    if (!groupable(g, rewrite, kernels, n)) continue;
    auto& groups = candidates[{n.op, n.inputs[0], graph::dtype_of(g.type(n.inputs[1])),
                               graph::dtype_of(g.type(n.outputs[0]))}];
    auto same_attrs = std::find_if(groups.begin(), groups.end(), [&](const Group& c) { return c.attrs == n.attrs; });
    if (same_attrs == groups.end()) same_attrs = groups.insert(groups.end(), Group{n.attrs, {}});
    same_attrs->members.push_back(i);
  }
  std::vector<const Group*> groups;
  std::map<size_t, size_t> hoist;  // weight node index -> the earliest group place that reads it
  for (const auto& [key, list] : candidates)
    for (const Group& group : list) {
      if (group.members.size() < 2) continue;
      groups.push_back(&group);
      for (size_t member : group.members) {
        const auto weight = static_cast<size_t>(rewrite.producer(g.nodes[member].inputs[1]));
        if (weight < group.members.front()) continue;
        auto [it, fresh] = hoist.emplace(weight, group.members.front());
        if (!fresh) it->second = std::min(it->second, group.members.front());
      }
    }
  if (groups.empty()) return;
  // Weights first, so that at a shared place they come before the grouped node.
  for (const auto& [weight, place] : hoist) {
    rewrite.insert_before(place, {g.nodes[weight]});
    rewrite.erase(weight);
  }
  for (const Group* group : groups) {
    Node grouped{Op::grouped_matmul, {g.nodes[group->members.front()].inputs[0]}, {}, group->attrs};
    for (size_t member : group->members) {
      grouped.inputs.push_back(g.nodes[member].inputs[1]);
      grouped.outputs.push_back(g.nodes[member].outputs[0]);
      rewrite.erase(member);
    }
    rewrite.insert_before(group->members.front(), {std::move(grouped)});
  }
  rewrite.apply();
}

}  // namespace

graph::Module group_matmuls(graph::Module module, const KernelCatalog& kernels) {
  return for_each_graph(std::move(module), [&](GraphIR& g, const graph::Module&) { group_graph(g, kernels); });
}

}  // namespace kiln::compiler::passes
