// Model: a handle on one initialised graph. Copies share the executor (and its arena), so calls on
// one Model, or its copies, run one at a time.
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
}  // namespace

const std::string& Model::name() const { return require(impl_).executor.plan().name; }

std::vector<Tensor> Model::execute(const std::vector<Tensor>& inputs) const {
  Impl& impl = require(impl_);
  std::lock_guard lock(impl.mutex);
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
  LaunchList list = impl.executor.record(inputs);
  return impl.captures.emplace(key, std::move(list)).first->second.results;
}

std::vector<Tensor> Model::replay(const std::string& key, const std::vector<Tensor>& inputs) const {
  Impl& impl = require(impl_);
  std::lock_guard lock(impl.mutex);
  auto it = impl.captures.find(key);
  if (it == impl.captures.end())
    throw ValueError(fmt::format("Model::replay: graph '{}' has no capture '{}'", impl.executor.plan().name, key));
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

const std::vector<graph::Type>& Model::input_metadata() const {
  return require(impl_).executor.plan().input_types;
}

const std::vector<graph::Type>& Model::output_metadata() const {
  return require(impl_).executor.plan().output_types;
}

}  // namespace kiln::engine
