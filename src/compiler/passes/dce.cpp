// Dead code elimination: a node stays when one of its results is used (by a live node or the graph's
// return) or when it has effects; everything else goes, and with it weights no node uses any more.
#include "compiler/passes/rewrite.h"
#include "kiln/compiler/passes.h"

namespace kiln::compiler::passes {

namespace {

void dce_graph(graph::GraphIR& g, const graph::Module& module) {
  std::vector<bool> live(g.value_types.size(), false);
  for (graph::ValueId v : g.outputs) live[static_cast<size_t>(v)] = true;
  GraphRewrite rewrite(g);
  // Walking backwards sees every use of a value before its definition.
  for (size_t i = g.nodes.size(); i-- > 0;) {
    const graph::Node& n = g.nodes[i];
    bool used = false;
    for (graph::ValueId v : n.outputs) used = used || live[static_cast<size_t>(v)];
    if (!used && !has_effects(module, n)) {
      rewrite.erase(i);
      continue;
    }
    for (graph::ValueId v : n.inputs) live[static_cast<size_t>(v)] = true;
  }
  rewrite.apply();
}

}  // namespace

graph::Module dce(graph::Module module) { return for_each_graph(std::move(module), dce_graph); }

}  // namespace kiln::compiler::passes
