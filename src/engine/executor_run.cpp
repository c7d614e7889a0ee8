// One run: a frame from the pool, the inputs checked into it, its memory prepared, the steps
// launched in order (timed while profiling), the results handed out.
#include <chrono>

#include <fmt/format.h>

#include "engine/executor.h"
#include "engine/executor_util.h"
#include "kiln/errors.h"

namespace kiln::engine {

using compiler::GraphPlan;
using compiler::Step;
using compiler::ValueKind;

// A frame for one run: an idle one from the pool, else a new one; back to the pool afterwards, so
// concurrent runs each have their own and a steady caller allocates none.
class Executor::FrameLease {
 public:
  explicit FrameLease(const Executor& executor) : executor_(executor) {
    {
      std::lock_guard lock(executor_.frames_mutex_);
      if (!executor_.idle_frames_.empty()) {
        frame_ = std::move(executor_.idle_frames_.back());
        executor_.idle_frames_.pop_back();
      }
    }
    if (!frame_) frame_ = executor_.new_frame();
  }
  ~FrameLease() {
    // An idle frame holds no caller memory (inputs, handed-out outputs), whether the run ended or threw.
    for (size_t v = 0; v < executor_.plan_.values.size(); ++v)
      if (executor_.plan_.values[v].kind == ValueKind::output) frame_->tensors[v] = Tensor();
    for (Tensor& t : frame_->inputs) t = Tensor();
    std::lock_guard lock(executor_.frames_mutex_);
    executor_.idle_frames_.push_back(std::move(frame_));
  }
  FrameLease(const FrameLease&) = delete;
  FrameLease& operator=(const FrameLease&) = delete;
  Frame& operator*() const { return *frame_; }

 private:
  const Executor& executor_;
  std::unique_ptr<Frame> frame_;
};

std::vector<Tensor> Executor::run(const std::vector<Tensor>& given) const {
  const GraphPlan& plan = plan_;
  FrameLease lease(*this);
  Frame& frame = *lease;
  check_inputs(given, frame.inputs);
  prepare(frame);

  for (size_t s = 0; s < plan.steps.size(); ++s) {
    const Step& step = plan.steps[s];
    std::vector<kernels::TensorView>& views = frame.step_views[s];
    const std::vector<StepInfo::Refresh>& refresh = steps_[s].refresh;
    size_t i = 0;
    for (const auto* values : {&step.inputs, &step.outputs})
      for (int32_t v : *values) {
        const kernels::TensorView& view = frame.views[static_cast<size_t>(v)];
        if (refresh[i] == StepInfo::Refresh::view) views[i] = view;
        else if (refresh[i] == StepInfo::Refresh::data) views[i].data = view.data;
        ++i;
      }
    check_dims(step, steps_[s].dim_slots, frame);
    launch(s, context(steps_[s], frame.dims), views);
  }

  // Results: fresh memory, never the caller's inputs, the model's weights and constants or an alias
  // of them, and never the same memory twice.
  std::vector<Tensor> results;
  results.reserve(plan.outputs.size());
  for (size_t i = 0; i < plan.outputs.size(); ++i) {
    const auto v = static_cast<size_t>(plan.outputs[i]);
    results.push_back(fresh_outputs_[i] ? frame.tensors[v] : copy_of(tensor_of(frame, v)));
  }
  return results;
}

void Executor::launch(size_t s, const kernels::KernelContext& ctx, std::span<const kernels::TensorView> views) const {
  const Step& step = plan_.steps[s];
  const StepInfo& info = steps_[s];
  const size_t num_inputs = step.inputs.size();
  const bool timed = profiling_.load(std::memory_order_relaxed);
  const auto start = timed ? std::chrono::steady_clock::now() : std::chrono::steady_clock::time_point{};
  try {
    info.kernel->run(ctx, views.subspan(0, num_inputs), views.subspan(num_inputs));
  } catch (const std::exception& e) {
    const bool custom = step.op == graph::Op::custom || step.op == graph::Op::inplace_custom;
    throw ExecutionError(fmt::format("execute: graph '{}' {}op '{}' (node {}): {}", plan_.name,
                                     custom ? "custom " : "", info.label, step.node, e.what()));
  }
  if (timed) {
    StepCounters& counters = step_counters_[s];
    counters.launches.fetch_add(1, std::memory_order_relaxed);
    counters.nanoseconds.fetch_add(
        std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start).count(),
        std::memory_order_relaxed);
  }
}

Tensor Executor::tensor_of(const Frame& frame, size_t value) const {
  const compiler::PlanValue& plan_value = plan_.values[value];
  if (plan_value.kind == ValueKind::input) return frame.inputs.at(static_cast<size_t>(plan_value.input));
  if (frame.tensors[value].defined()) return frame.tensors[value];
  const kernels::TensorView& view = frame.views[value];
  return Tensor::borrow(view.data, view.dtype, view.shape, {}, graph::device_of(plan_value.type));
}

Tensor Executor::copy_of(const Tensor& source) const {
  const Backend& backend = backends_.at(source.device().kind);
  Tensor copy = backend.allocate(source.dtype(), source.shape(), source.device());
  backend.copy(copy, source);
  return copy;
}

void Executor::copy_into(const Tensor& dst, const Tensor& src) const {
  backends_.at(dst.device().kind).copy(dst, src);
}

}  // namespace kiln::engine
