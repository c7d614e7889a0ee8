// Private: what the rewriting passes (canonicalize, constant_fold, cse, dce) share. A pass records
// which values replace which and which nodes to erase; apply() then rewires every use and compacts the
// graph (dense value ids in definition order, weights kept in sync with the weight nodes left), so the
// graph's interface stays as it was.
#pragma once

#include <vector>

#include "kiln/graph/graph.h"

namespace kiln::compiler::passes {

class GraphRewrite {
 public:
  explicit GraphRewrite(graph::GraphIR& g);

  // Every use of `from` (in later nodes and in the graph's outputs) becomes a use of `to`, which must
  // have the same type. Chains resolve: replace(a, b) then replace(b, c) sends a to c.
  void replace(graph::ValueId from, graph::ValueId to);
  // The value a use of `v` currently stands for.
  graph::ValueId resolve(graph::ValueId v) const;
  // Marks node `index` for removal; its results must have been replaced or be unused.
  void erase(size_t index) { erased_[index] = true; }
  bool erased(size_t index) const { return erased_[index]; }
  // Rewrites node `index`'s operands to their replacements now, so a pass walking in program order
  // sees each node's operands as they will be.
  void resolve_operands(size_t index);

  // The node index producing `v`, or -1 for a graph input.
  int64_t producer(graph::ValueId v) const { return producer_[static_cast<size_t>(v)]; }
  // Inserts nodes before node `index` (they run in its place when it is erased). Their outputs must be
  // existing value ids (for instance the ids of the node they replace).
  void insert_before(size_t index, std::vector<graph::Node> nodes);

  // Applies replacements, erasures and insertions, then compacts the graph. True if anything changed.
  bool apply();

 private:
  graph::GraphIR& g_;
  std::vector<graph::ValueId> replacement_;  // by value id; itself when not replaced
  std::vector<bool> erased_;                 // by node index
  std::vector<int64_t> producer_;            // by value id
  std::vector<std::vector<graph::Node>> inserted_;  // by node index
  bool changed_ = false;
};

// Whether a node must stay even when its results are unused, and must not be merged with an equal
// one: ops with side effects, and calls into graphs that (transitively) have them.
bool has_effects(const graph::Module& module, const graph::Node& node);

// Applies `pass` to every graph of the module.
template <class Pass>
graph::Module for_each_graph(graph::Module module, Pass&& pass) {
  for (auto& g : module.graphs()) pass(*g, module);
  return module;
}

}  // namespace kiln::compiler::passes
