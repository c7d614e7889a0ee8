// Model: a handle on one initialised graph. Copies share the executor (and its arena), so calls on
// one Model, or its copies, run one at a time.
#include <chrono>

#include <fmt/format.h>

#include "engine/executor.h"
#include "kiln/engine/session.h"
#include "kiln/errors.h"

namespace kiln::engine {

namespace {
Model::Impl& require(const std::shared_ptr<Model::Impl>& impl) {
  if (!impl) throw ValueError("Model: not initialised (get one from InferenceSession::init or load)");
  return *impl;
}
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

const std::string& Model::name() const { return require(impl_).executor.plan().name; }

std::vector<Tensor> Model::execute(const std::vector<Tensor>& inputs) const {
  Impl& impl = require(impl_);
  std::lock_guard lock(impl.mutex);
  ProfiledRun profiled(impl.executor);
  if (!impl.device_graph) return impl.executor.run(inputs);
  // A device graph replays its launch list; results are cloned so each call's outputs stay the caller's.
  impl.executor.replay(*impl.device_graph, inputs);
  std::vector<Tensor> results;
  for (const Tensor& t : impl.device_graph->results) results.push_back(t.clone());
  return results;
}

std::vector<Tensor> Model::capture(const std::string& key, const std::vector<Tensor>& inputs) const {
  Impl& impl = require(impl_);
  std::lock_guard lock(impl.mutex);
  if (impl.device_graph)
    throw ValueError(fmt::format("Model::capture: graph '{}' is a device graph (is_device_graph), which "
                                 "already replays one launch list; capture/replay is not available on it",
                                 impl.executor.plan().name));
  if (impl.captures.count(key))
    throw ValueError(fmt::format("Model::capture: graph '{}' already has a capture '{}' (release it first)",
                                 impl.executor.plan().name, key));
  ProfiledRun profiled(impl.executor);
  LaunchList list = impl.executor.record(inputs);
  return impl.captures.emplace(key, std::move(list)).first->second.results;
}

std::vector<Tensor> Model::replay(const std::string& key, const std::vector<Tensor>& inputs) const {
  Impl& impl = require(impl_);
  std::lock_guard lock(impl.mutex);
  auto it = impl.captures.find(key);
  if (it == impl.captures.end())
    throw ValueError(fmt::format("Model::replay: graph '{}' has no capture '{}'", impl.executor.plan().name, key));
  ProfiledRun profiled(impl.executor);
  impl.executor.replay(it->second, inputs);
  return it->second.results;
}

void Model::release(const std::string& key) const {
  Impl& impl = require(impl_);
  std::lock_guard lock(impl.mutex);
  if (!impl.captures.erase(key))
    throw ValueError(fmt::format("Model::release: graph '{}' has no capture '{}'", impl.executor.plan().name, key));
}

bool Model::is_device_graph() const {
  Impl& impl = require(impl_);
  std::lock_guard lock(impl.mutex);
  return impl.device_graph.has_value();
}

void Model::start_profiling() const {
  Impl& impl = require(impl_);
  std::lock_guard lock(impl.mutex);
  impl.executor.start_profiling();
}

void Model::stop_profiling() const {
  Impl& impl = require(impl_);
  std::lock_guard lock(impl.mutex);
  impl.executor.stop_profiling();
}

ModelProfile Model::profile() const {
  Impl& impl = require(impl_);
  std::lock_guard lock(impl.mutex);
  return impl.executor.profile();
}

const std::vector<graph::Type>& Model::input_metadata() const {
  return require(impl_).executor.plan().input_types;
}

const std::vector<graph::Type>& Model::output_metadata() const {
  return require(impl_).executor.plan().output_types;
}

}  // namespace kiln::engine
