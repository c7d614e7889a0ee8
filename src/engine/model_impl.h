// Private: what a Model (and its copies) share.
#pragma once

#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

#include "engine/executor.h"
#include "kiln/engine/model.h"

namespace kiln::engine {

struct Model::Impl {
  std::shared_ptr<const void> session;  // keeps the session's backends (threads, kernels) alive
  Executor executor;
  // Guards the launch lists (captures, the device graph) and profiling's start/stop: a list has one
  // set of buffers, so its replays take turns. Plain execute() calls need no lock.
  std::mutex mutex;
  std::map<std::string, LaunchList> captures;  // Model::capture, by key
  std::optional<LaunchList> device_graph;      // built at init for a device-graph model

  template <class... Args>
  Impl(std::shared_ptr<const void> session_state, Args&&... executor_args)
      : session(std::move(session_state)), executor(std::forward<Args>(executor_args)...) {}
};

}  // namespace kiln::engine
