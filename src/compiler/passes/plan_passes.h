// Private: the plan steps compile() runs on each graph's plan after lowering it from the IR, in this
// order; each a function on a GraphPlan, tested on its own (tests/compiler).
#pragma once

#include "kiln/compiler/compiled_model.h"

namespace kiln::compiler::passes {

// Turns view steps (reshape, and slice / buffer_load of one contiguous block) into aliases of their
// operand's memory (ValueKind::alias, GraphPlan::aliases), except where that memory may change while
// the alias lives (docs/memory-planning.md).
void plan_aliases(GraphPlan& plan);
// Records in each step (and constant) the kernel that runs it: graph::kernel_key of its operand and
// result types. With a catalog, a step without a kernel is an Error naming the graph, node, device,
// op and dtype. Custom ops are resolved against their extension instead (compile()).
void select_kernels(GraphPlan& plan, const KernelCatalog* kernels);
// Gives each intermediate an arena slot, reusing slots by liveness (docs/memory-planning.md).
void plan_memory(GraphPlan& plan);

// The value owning an alias's memory (the value itself when it is not an alias).
int32_t root_of(const GraphPlan& plan, int32_t v);

}  // namespace kiln::compiler::passes
