// Private: the engine's thread pool, shared by all kernels of a session. Workers stay warm (spin
// briefly, then sleep) between ops, since a decode step of a small model is many tiny ops.
#pragma once

#include <memory>

#include "kernels/kernel.h"

namespace kiln::engine {

class ThreadPool final : public kernels::Parallel {
 public:
  explicit ThreadPool(int num_threads);  // 0: hardware_concurrency; the caller is one of the threads
  ~ThreadPool() override;
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  void for_range(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn) override;
  int num_threads() const override;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace kiln::engine
