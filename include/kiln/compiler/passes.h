// Compiler passes: each a function graph::Module -> graph::Module, tested on its own.
#pragma once

#include "kiln/compiler/kernel_catalog.h"
#include "kiln/graph/graph.h"

namespace kiln::compiler::passes {

// Throws VerifyError naming the graph, node, op and operand when an invariant is broken: operands
// defined before use, types equal to what infer_types gives, outputs set, call targets present.
void verify(const graph::Module&);
// Rewrites ops into one canonical form (x * 1 -> x, x + 0 -> x, double transpose -> one, reshape to
// the same shape -> x, ...).
graph::Module canonicalize(graph::Module);
// Evaluates nodes whose operands are all constants (and small, with static shapes) into constants,
// with the catalog's kernels.
graph::Module constant_fold(graph::Module, const KernelCatalog& kernels);
// Merges nodes with equal op, operands and attributes (never side-effecting ones or buffer reads:
// buffer_load, paged_attention).
graph::Module cse(graph::Module);
// Removes nodes whose results are unused and that have no side effects; drops unused weights.
graph::Module dce(graph::Module);
// Replaces each maximal tree of elementwise ops of one shape, whose intermediates have no other use,
// by one fused_elementwise node (docs/fusion.md), where the catalog has a fused_elementwise kernel for
// the result's device and dtype.
graph::Module fuse_elementwise(graph::Module, const KernelCatalog& kernels);
// Replaces >= 2 matmuls (or qmatmuls) that read the same lhs value, with equal attributes and each
// rhs a rank-2 weight of one dtype (a Llama layer's q/k/v, its MLP's gate/up), by one grouped_matmul
// node with one result per weight, at the first one's place (docs/fusion.md), where the catalog has a
// grouped_matmul kernel for the device and dtype.
graph::Module group_matmuls(graph::Module, const KernelCatalog& kernels);
// Replaces every `call` node by a copy of its callee's nodes (recursively), so each graph is one flat
// list of kernel launches; graphs without calls are copied unchanged. VerifyError for a missing
// callee, a recursive call or an argument/result count mismatch.
graph::Module inline_calls(const graph::Module&);

}  // namespace kiln::compiler::passes
