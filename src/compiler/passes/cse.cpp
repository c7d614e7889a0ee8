// Common subexpression elimination: a node equal to an earlier one (same op, same operands after
// earlier merges, equal attributes) is replaced by it. Nodes with effects never merge, nor do reads
// of buffers (buffer_load, paged_attention), whose state a store in between may change.
#include <map>
#include <utility>

#include "compiler/passes/rewrite.h"
#include "kiln/compiler/passes.h"

namespace kiln::compiler::passes {

namespace {

void cse_graph(graph::GraphIR& g, const graph::Module& module) {
  GraphRewrite rewrite(g);
  // (op, operands) -> indices of the kept nodes with that key; attributes are compared within.
  std::map<std::pair<graph::Op, std::vector<graph::ValueId>>, std::vector<size_t>> seen;
  for (size_t i = 0; i < g.nodes.size(); ++i) {
    rewrite.resolve_operands(i);
    const graph::Node& n = g.nodes[i];
    if (graph::reads_buffers(n.op) || n.outputs.empty() || has_effects(module, n)) continue;
    auto& candidates = seen[{n.op, n.inputs}];
    bool merged = false;
    for (size_t j : candidates) {
      const graph::Node& earlier = g.nodes[j];
      // Attrs compare with ==, so a NaN attribute never merges: conservative and correct.
      if (earlier.attrs != n.attrs || earlier.outputs.size() != n.outputs.size()) continue;
      for (size_t k = 0; k < n.outputs.size(); ++k) rewrite.replace(n.outputs[k], earlier.outputs[k]);
      rewrite.erase(i);
      merged = true;
      break;
    }
    if (!merged) candidates.push_back(i);
  }
  rewrite.apply();
}

}  // namespace

graph::Module cse(graph::Module module) { return for_each_graph(std::move(module), cse_graph); }

}  // namespace kiln::compiler::passes
