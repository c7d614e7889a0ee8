// passes::verify: every graph's own invariants (graph::verify_graph), then the module-wide ones:
// call targets exist and graphs do not call themselves, directly or through others.
#include <fmt/format.h>

#include <map>

#include "kiln/compiler/passes.h"
#include "kiln/errors.h"

namespace kiln::compiler::passes {

namespace {

enum class Visit { unseen, active, done };

// Depth-first over call edges; `path` is the chain of active graphs, printed when a cycle closes.
void find_call_cycle(const graph::Module& module, const graph::GraphIR& g,
                     std::map<std::string, Visit>& state, std::vector<std::string>& path) {
  state[g.name] = Visit::active;
  path.push_back(g.name);
  for (size_t k = 0; k < g.nodes.size(); ++k) {
    const graph::Node& n = g.nodes[k];
    if (n.op != graph::Op::call) continue;
    const auto& callee = graph::get_attr<std::string>(n.attrs, "callee", graph::Op::call);
    const graph::GraphIR* target = module.find(callee);
    if (!target)
      throw VerifyError(fmt::format("verify: graph '{}' node {} (call): callee '{}' is not in the module",
                                    g.name, k, callee));
    Visit s = state[callee];
    if (s == Visit::active) {
      path.push_back(callee);
      throw VerifyError(fmt::format("verify: graph '{}' node {} (call): call cycle {}", g.name, k,
                                    fmt::join(path, " -> ")));
    }
    if (s == Visit::unseen) find_call_cycle(module, *target, state, path);
  }
  path.pop_back();
  state[g.name] = Visit::done;
}

}  // namespace

void verify(const graph::Module& module) {
  for (const auto& g : module.graphs()) graph::verify_graph(*g, &module);
  std::map<std::string, Visit> state;
  std::vector<std::string> path;
  for (const auto& g : module.graphs())
    if (state[g->name] == Visit::unseen) find_call_cycle(module, *g, state, path);
}

}  // namespace kiln::compiler::passes
