// Memory planning: intermediates share arena slots by liveness.
#include <algorithm>
#include <map>
#include <vector>

#include "compiler/passes/plan_passes.h"

namespace kiln::compiler::passes {

int32_t root_of(const GraphPlan& plan, int32_t v) {
  const PlanValue& value = plan.values[static_cast<size_t>(v)];
  return value.kind == ValueKind::alias ? value.root : v;
}

// Greedy arena assignment by liveness: an intermediate takes a free slot of its dtype and device (or a new one)
// when its step runs and gives it back after the step of its last use. Outputs of a step never share a
// slot with that step's operands, since a slot is freed only after the step that last reads it. A
// value's memory lives as long as any alias of it: its last use is the latest of theirs, and an alias
// returned as a graph output (copied after the last step) keeps its root's slot to the end.
void plan_memory(GraphPlan& plan) {
  const auto num_values = plan.values.size();
  const auto num_steps = static_cast<int32_t>(plan.steps.size());
  std::vector<int32_t> last_use(num_values, -1);
  auto use = [&](int32_t v, int32_t s) {
    for (int32_t u : {v, root_of(plan, v)}) last_use[static_cast<size_t>(u)] = std::max(last_use[static_cast<size_t>(u)], s);
  };
  for (int32_t s = 0; s < num_steps; ++s) {
    for (int32_t v : plan.steps[static_cast<size_t>(s)].inputs) use(v, s);
    for (int32_t v : plan.steps[static_cast<size_t>(s)].outputs) use(v, s);
  }
  for (int32_t v : plan.outputs) use(v, num_steps);  // past every step: never released
  // A slot holds values of one dtype on one device (its memory is that device's).
  using SlotKind = std::pair<DType, DeviceRef>;
  auto kind_of = [](const PlanValue& value) { return SlotKind{graph::dtype_of(value.type), graph::device_of(value.type)}; };
  int32_t num_slots = 0;
  std::multimap<SlotKind, int32_t> free_slots;
  std::vector<int32_t> released;
  for (int32_t s = 0; s < num_steps; ++s) {
    const Step& step = plan.steps[static_cast<size_t>(s)];
    for (int32_t v : step.outputs) {
      PlanValue& value = plan.values[static_cast<size_t>(v)];
      if (value.kind != ValueKind::slot) continue;
      if (auto it = free_slots.find(kind_of(value)); it != free_slots.end()) {
        value.slot = it->second;
        free_slots.erase(it);
      } else {
        value.slot = num_slots++;
      }
    }
    // Release every slot value whose last use is this step, each once (operands may repeat, and
    // several aliases may share a root).
    released.clear();
    for (const auto* list : {&step.inputs, &step.outputs})
      for (int32_t operand : *list) {
        const int32_t v = root_of(plan, operand);
        const PlanValue& value = plan.values[static_cast<size_t>(v)];
        if (value.kind != ValueKind::slot || last_use[static_cast<size_t>(v)] != s) continue;
        if (std::find(released.begin(), released.end(), v) != released.end()) continue;
        released.push_back(v);
        free_slots.emplace(kind_of(value), value.slot);
      }
  }
  plan.num_slots = num_slots;
}

}  // namespace kiln::compiler::passes
