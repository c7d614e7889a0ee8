// Launch lists: a run recorded with every buffer and shape fixed (Model::capture, device graphs),
// and its replay, a loop of kernel calls.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include "engine/executor.h"
#include "engine/executor_util.h"
#include "kiln/errors.h"

namespace kiln::engine {

using compiler::GraphPlan;
using compiler::Step;

LaunchList Executor::record(const std::vector<Tensor>& given, bool run) const {
  const GraphPlan& plan = plan_;
  LaunchList list;
  // The list owns its input buffers and its arena (a frame of its own): replay copies new inputs
  // into them, in place.
  std::unique_ptr<Frame> frame = new_frame();
  std::vector<Tensor> checked;
  check_inputs(given, checked);
  for (size_t i = 0; i < checked.size(); ++i) frame->inputs[i] = copy_of(checked[i]);
  prepare(*frame);
  for (size_t s = 0; s < plan.steps.size(); ++s) {
    const Step& step = plan.steps[s];
    check_dims(step, steps_[s].dim_slots, *frame);
    LaunchList::Launch launch_record{s, {}};
    for (int32_t v : step.inputs) launch_record.views.push_back(frame->views[static_cast<size_t>(v)]);
    for (int32_t v : step.outputs) launch_record.views.push_back(frame->views[static_cast<size_t>(v)]);
    list.launches.push_back(std::move(launch_record));
  }
  list.dims = frame->dims;
  for (size_t i = 0; i < plan.outputs.size(); ++i) {
    const auto v = static_cast<size_t>(plan.outputs[i]);
    if (fresh_outputs_[i]) {
      list.results.push_back(frame->tensors[v]);
    } else {
      // Inputs are the list's own copies, slots its own arena: the source stays valid while it lives.
      Tensor source = tensor_of(*frame, v);
      list.results.push_back(backends_.at(source.device().kind).allocate(source.dtype(), source.shape(), source.device()));
      list.copied_results.emplace_back(std::move(source), list.results.size() - 1);
    }
  }
  list.inputs = std::move(frame->inputs);
  list.slots = std::move(frame->slots);
  if (!run) return list;
  // The first run, through the same path every replay takes.
  for (const LaunchList::Launch& l : list.launches) launch(l.step, context(steps_[l.step], list.dims), l.views);
  for (const auto& [source, index] : list.copied_results) copy_into(list.results[index], source);
  for (size_t i = 0; i < given.size(); ++i)
    if (graph::is_buffer(plan.input_types[i])) copy_into(given[i], list.inputs[i]);
  return list;
}

void Executor::replay(LaunchList& list, const std::vector<Tensor>& given) const {
  const GraphPlan& plan = plan_;
  if (given.size() != list.inputs.size())
    throw ValueError(fmt::format("replay: graph '{}' takes {} inputs, got {}", plan.name, list.inputs.size(),
                                 given.size()));
  for (size_t i = 0; i < given.size(); ++i) {
    const Tensor& t = given[i];
    const Tensor& captured = list.inputs[i];
    if (!t.defined() || t.dtype() != captured.dtype() || t.shape() != captured.shape() ||
        t.device() != captured.device())
      throw ValueError(fmt::format(
          "replay: graph '{}' input {} is {}{}, but the launch list was captured with {}{} (capture again "
          "for another shape)",
          plan.name, i, t.defined() ? dtype_name(t.dtype()) : "undefined",
          t.defined() ? fmt::format("{}", t.shape()) : "", dtype_name(captured.dtype()), captured.shape()));
    if (graph::is_buffer(plan.input_types[i]) && !t.is_contiguous())
      throw ValueError(fmt::format("replay: graph '{}' input {} is a buffer and must be contiguous", plan.name, i));
  }
  for (size_t i = 0; i < given.size(); ++i) copy_into(list.inputs[i], given[i]);
  for (const LaunchList::Launch& l : list.launches) launch(l.step, context(steps_[l.step], list.dims), l.views);
  for (const auto& [source, index] : list.copied_results) copy_into(list.results[index], source);
  // Buffers are written in place: the caller's buffer gets what the graph wrote to the captured copy.
  for (size_t i = 0; i < given.size(); ++i)
    if (graph::is_buffer(plan.input_types[i])) copy_into(given[i], list.inputs[i]);
}

}  // namespace kiln::engine
