// Kernel selection: each step records the kernel the engine builds for it at init, so the engine
// never works the key out again.
#include <vector>

#include <fmt/format.h>

#include "compiler/passes/plan_passes.h"
#include "kiln/errors.h"

namespace kiln::compiler::passes {

namespace {

graph::KernelKey key_of(const GraphPlan& plan, const Step& step) {
  std::vector<graph::Type> inputs, outputs;
  for (int32_t v : step.inputs) inputs.push_back(plan.values.at(static_cast<size_t>(v)).type);
  for (int32_t v : step.outputs) outputs.push_back(plan.values.at(static_cast<size_t>(v)).type);
  return graph::kernel_key(step.op, inputs, outputs);
}

bool is_custom(graph::Op op) { return op == graph::Op::custom || op == graph::Op::inplace_custom; }

}  // namespace

void select_kernels(GraphPlan& plan, const KernelCatalog* kernels) {
  for (auto* steps : {&plan.constants, &plan.steps})
    for (Step& step : *steps) {
      step.kernel = key_of(plan, step);
      if (kernels && !is_custom(step.op) && !kernels->has_kernel(step.kernel))
        throw Error(fmt::format("compile: graph '{}' node {}: no {} kernel for {} on {}", plan.name, step.node,
                                device_kind_name(step.kernel.device), graph::op_name(step.op),
                                dtype_name(step.kernel.dtype)));
    }
}

}  // namespace kiln::compiler::passes
