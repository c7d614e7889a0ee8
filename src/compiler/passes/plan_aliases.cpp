// Alias planning: view steps become windows of their operand's memory instead of copies.
#include <algorithm>
#include <vector>

#include "compiler/passes/plan_passes.h"

namespace kiln::compiler::passes {

namespace {

using graph::Op;

// Whether `step` (reshape, slice or buffer_load) can be an alias of its operand: same dtype and
// device, a tensor result, and for a window, one contiguous block of the (contiguous) source. Proven
// on the symbolic shapes, so it holds for every binding: after a run of leading axes the window
// takes one element of, at most one axis takes a step-1 range, and every later axis is taken whole.
bool is_view_step(const GraphPlan& plan, const Step& step) {
  if (step.op != Op::reshape && step.op != Op::slice && step.op != Op::buffer_load) return false;
  if (step.inputs.size() != 1 || step.outputs.size() != 1) return false;
  const graph::Type& source = plan.values.at(static_cast<size_t>(step.inputs[0])).type;
  const graph::Type& result = plan.values.at(static_cast<size_t>(step.outputs[0])).type;
  if (graph::is_buffer(result) || graph::dtype_of(source) != graph::dtype_of(result) ||
      graph::device_of(source) != graph::device_of(result))
    return false;
  if (step.op == Op::reshape || !step.attrs.count("starts")) return true;
  const auto* starts = std::get_if<graph::Shape>(&step.attrs.at("starts"));
  const auto* stops = step.attrs.count("stops") ? std::get_if<graph::Shape>(&step.attrs.at("stops")) : nullptr;
  const auto* steps = step.attrs.count("steps") ? std::get_if<std::vector<int64_t>>(&step.attrs.at("steps")) : nullptr;
  const graph::Shape& shape = graph::shape_of(source);
  if (!starts || !stops || !steps || starts->rank() != shape.rank() || stops->rank() != shape.rank() ||
      static_cast<int64_t>(steps->size()) != shape.rank())
    return false;
  int64_t axis = 0;
  auto extent = [&](int64_t a) { return (*stops)[a] - (*starts)[a]; };
  while (axis < shape.rank() && extent(axis) == graph::Dim(1)) ++axis;  // one element: any step
  if (axis < shape.rank() && (*steps)[static_cast<size_t>(axis)] == 1) ++axis;  // the one free range
  for (; axis < shape.rank(); ++axis)
    if (!((*starts)[axis] == graph::Dim(0) && (*stops)[axis] == shape[axis] &&
          (*steps)[static_cast<size_t>(axis)] == 1))
      return false;
  return true;
}

// Turns view steps into aliases (ValueKind::alias, GraphPlan::aliases), keeping as copies those whose
// memory could change under them: an alias of a buffer must not be live across a step that may write
// the buffer (any step taking it other than a read, buffer_load or paged_attention: buffer_store,
// paged_kv_store, inplace_custom, collectives' signal buffers), counting a graph output as live to the end of the run. Checked for the first
// alias of a chain, whose lifetime covers every alias made from it; if it stays a copy, the aliases
// made from it view that copy, which nothing writes.
}  // namespace

void plan_aliases(GraphPlan& plan) {
  const auto num_steps = static_cast<int32_t>(plan.steps.size());
  std::vector<bool> is_view(plan.steps.size());
  std::vector<int32_t> view_step(plan.values.size(), -1);  // alias candidate -> its step
  for (int32_t s = 0; s < num_steps; ++s)
    if (is_view_step(plan, plan.steps[static_cast<size_t>(s)])) {
      is_view[static_cast<size_t>(s)] = true;
      view_step[static_cast<size_t>(plan.steps[static_cast<size_t>(s)].outputs[0])] = s;
    }
  // Lifetime of each candidate, extended over the candidates made from it (later steps first).
  std::vector<int32_t> live_until(plan.values.size(), -1);
  for (int32_t s = 0; s < num_steps; ++s)
    for (int32_t v : plan.steps[static_cast<size_t>(s)].inputs) live_until[static_cast<size_t>(v)] = s;
  for (int32_t v : plan.outputs) live_until[static_cast<size_t>(v)] = num_steps;
  for (int32_t s = num_steps - 1; s >= 0; --s) {
    if (!is_view[static_cast<size_t>(s)]) continue;
    const Step& step = plan.steps[static_cast<size_t>(s)];
    const auto source = static_cast<size_t>(step.inputs[0]);
    if (view_step[source] >= 0)
      live_until[source] = std::max(live_until[source], live_until[static_cast<size_t>(step.outputs[0])]);
  }
  for (int32_t s = 0; s < num_steps; ++s) {
    if (!is_view[static_cast<size_t>(s)]) continue;
    const Step& step = plan.steps[static_cast<size_t>(s)];
    const int32_t source = step.inputs[0];
    if (view_step[static_cast<size_t>(source)] >= 0 || !graph::is_buffer(plan.values[static_cast<size_t>(source)].type))
      continue;
    const int32_t until = std::min(live_until[static_cast<size_t>(step.outputs[0])], num_steps - 1);
    for (int32_t w = s + 1; w <= until && is_view[static_cast<size_t>(s)]; ++w) {
      const Step& other = plan.steps[static_cast<size_t>(w)];
      if (graph::reads_buffers(other.op)) continue;
      if (std::find(other.inputs.begin(), other.inputs.end(), source) != other.inputs.end())
        is_view[static_cast<size_t>(s)] = false;
    }
    if (!is_view[static_cast<size_t>(s)]) view_step[static_cast<size_t>(step.outputs[0])] = -1;
  }
  std::vector<Step> steps;
  for (int32_t s = 0; s < num_steps; ++s) {
    Step& step = plan.steps[static_cast<size_t>(s)];
    if (!is_view[static_cast<size_t>(s)]) {
      steps.push_back(std::move(step));
      continue;
    }
    PlanValue& value = plan.values[static_cast<size_t>(step.outputs[0])];
    value.kind = ValueKind::alias;
    value.alias = static_cast<int32_t>(plan.aliases.size());
    value.root = root_of(plan, step.inputs[0]);
    plan.aliases.push_back(std::move(step));
  }
  plan.steps = std::move(steps);
}

}  // namespace kiln::compiler::passes
