// Profiling (Model::start_profiling): per-step launch counts and times, added to by concurrent runs.
#include "engine/executor.h"

namespace kiln::engine {

void Executor::start_profiling() {
  for (size_t s = 0; s < plan_.steps.size(); ++s) {
    step_counters_[s].launches = 0;
    step_counters_[s].nanoseconds = 0;
  }
  profiled_runs_ = 0;
  profiled_nanoseconds_ = 0;
  profile_started_ = true;
  profiling_ = true;
}

void Executor::add_profiled_run(double seconds) const {
  profiled_runs_.fetch_add(1, std::memory_order_relaxed);
  profiled_nanoseconds_.fetch_add(static_cast<int64_t>(seconds * 1e9), std::memory_order_relaxed);
}

int64_t Executor::weight_bytes(const compiler::Step& step) const {
  int64_t bytes = 0;
  for (int32_t v : step.inputs) {
    const compiler::PlanValue& value = plan_.values[v];
    const bool of_weight = value.kind == compiler::ValueKind::weight ||
                           (value.kind == compiler::ValueKind::alias && plan_.values[value.root].kind == compiler::ValueKind::weight);
    // An alias whose window moves with the run's dims is bound per run: not counted.
    if (of_weight && bound_[v].defined()) bytes += static_cast<int64_t>(bound_[v].nbytes());
  }
  return bytes;
}

ModelProfile Executor::profile() const {
  ModelProfile profile;
  profile.runs = profiled_runs_.load();
  profile.seconds = static_cast<double>(profiled_nanoseconds_.load()) * 1e-9;
  if (!profile_started_) return profile;  // no steps until profiling has been started
  for (size_t s = 0; s < plan_.steps.size(); ++s)
    profile.steps.push_back(StepProfile{steps_[s].label, plan_.steps[s].node, step_counters_[s].launches.load(),
                                        static_cast<double>(step_counters_[s].nanoseconds.load()) * 1e-9,
                                        weight_bytes(plan_.steps[s])});
  return profile;
}

}  // namespace kiln::engine
