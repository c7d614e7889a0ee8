// Model: a handle on one initialised graph. Copies share the executor; execute() calls run
// concurrently (each in a frame of its own), launch-list calls take turns.
#include <chrono>

#include <fmt/format.h>

#include "engine/model_impl.h"
#include "kiln/engine/session.h"
#include "kiln/errors.h"

namespace kiln::engine {

namespace {
// Adds one run's wall-clock time to the executor's profile when it is profiling (even if the run throws).
class ProfiledRun {
 public:
  explicit ProfiledRun(const Executor& executor) : executor_(executor.profiling() ? &executor : nullptr) {}
  ~ProfiledRun() {
    if (executor_)
      executor_->add_profiled_run(std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count());
  }
  ProfiledRun(const ProfiledRun&) = delete;
  ProfiledRun& operator=(const ProfiledRun&) = delete;

 private:
  const Executor* executor_;
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
};

}  // namespace

Model::Impl& Model::impl() const {
  if (!impl_) throw ValueError("Model: not initialised (get one from InferenceSession::init or load)");
  return *impl_;
}

const std::string& Model::name() const { return impl().executor.plan().name; }

std::vector<Tensor> Model::execute(const std::vector<Tensor>& inputs) const {
  Impl& state = impl();
  if (!state.device_graph) {
    ProfiledRun profiled(state.executor);
    return state.executor.run(inputs);
  }
  // A device graph replays its launch list; results are cloned so each call's outputs stay the caller's.
  std::lock_guard lock(state.mutex);
  ProfiledRun profiled(state.executor);
  state.executor.replay(*state.device_graph, inputs);
  std::vector<Tensor> results;
  for (const Tensor& t : state.device_graph->results) results.push_back(state.executor.copy_of(t));
  return results;
}

std::vector<Tensor> Model::capture(const std::string& key, const std::vector<Tensor>& inputs) const {
  Impl& state = impl();
  std::lock_guard lock(state.mutex);
  if (state.device_graph)
    throw ValueError(fmt::format("Model::capture: graph '{}' is a device graph (is_device_graph), which "
                                 "already replays one launch list; capture/replay is not available on it",
                                 state.executor.plan().name));
  if (state.captures.count(key))
    throw ValueError(fmt::format("Model::capture: graph '{}' already has a capture '{}' (release it first)",
                                 state.executor.plan().name, key));
  ProfiledRun profiled(state.executor);
  LaunchList list = state.executor.record(inputs);
  return state.captures.emplace(key, std::move(list)).first->second.results;
}

std::vector<Tensor> Model::replay(const std::string& key, const std::vector<Tensor>& inputs) const {
  Impl& state = impl();
  std::lock_guard lock(state.mutex);
  auto it = state.captures.find(key);
  if (it == state.captures.end())
    throw ValueError(fmt::format("Model::replay: graph '{}' has no capture '{}'", state.executor.plan().name, key));
  ProfiledRun profiled(state.executor);
  state.executor.replay(it->second, inputs);
  return it->second.results;
}

void Model::release(const std::string& key) const {
  Impl& state = impl();
  std::lock_guard lock(state.mutex);
  if (!state.captures.erase(key))
    throw ValueError(fmt::format("Model::release: graph '{}' has no capture '{}'", state.executor.plan().name, key));
}

bool Model::is_device_graph() const { return impl().device_graph.has_value(); }  // fixed at init
const std::vector<std::string>& Model::copied_weights() const { return impl().executor.copied_weights(); }

void Model::start_profiling() const {
  Impl& state = impl();
  std::lock_guard lock(state.mutex);
  state.executor.start_profiling();
}

void Model::stop_profiling() const {
  Impl& state = impl();
  std::lock_guard lock(state.mutex);
  state.executor.stop_profiling();
}

ModelProfile Model::profile() const { return impl().executor.profile(); }

const std::vector<graph::Type>& Model::input_metadata() const {
  return impl().executor.plan().input_types;
}

const std::vector<graph::Type>& Model::output_metadata() const {
  return impl().executor.plan().output_types;
}

}  // namespace kiln::engine
