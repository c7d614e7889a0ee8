// Compiler passes: each a function graph::Module -> graph::Module, tested on its own.
#pragma once

#include "kiln/graph/graph.h"

namespace kiln::compiler::passes {

// Throws VerifyError naming the graph, node, op and operand when an invariant is broken: operands
// defined before use, types equal to what infer_types gives, outputs set, call targets present.
void verify(const graph::Module&);
// Rewrites ops into one canonical form (x * 1 -> x, x + 0 -> x, double transpose -> one, reshape to
// the same shape -> x, ...).
graph::Module canonicalize(graph::Module);
// Evaluates nodes whose operands are all constants (and small) into constants.
graph::Module constant_fold(graph::Module);
// Merges nodes with equal op, operands and attributes (never side-effecting ones or buffer_load).
graph::Module cse(graph::Module);
// Removes nodes whose results are unused and that have no side effects; drops unused weights.
graph::Module dce(graph::Module);
// Replaces each maximal tree of elementwise ops of one shape, whose intermediates have no other use,
// by one fused_elementwise node (docs/fusion.md).
graph::Module fuse_elementwise(graph::Module);
// Replaces >= 2 matmuls (or qmatmuls) on the CPU that read the same lhs value, with equal attributes
// and each rhs a rank-2 weight of one dtype (a Llama layer's q/k/v, its MLP's gate/up), by one
// grouped_matmul node with one result per weight, at the first one's place (docs/fusion.md).
graph::Module group_matmuls(graph::Module);

}  // namespace kiln::compiler::passes
