// Kernel tests: a Parallel that really runs chunks on several std::threads, so a test can check that
// a kernel's threaded result equals its serial one. Independent of the engine's ThreadPool (tests of
// the kernels layer cannot link the engine).
#pragma once

#include <algorithm>
#include <atomic>
#include <exception>
#include <thread>
#include <vector>

#include "kernels/cpu/kernels.h"

namespace kiln::kernels::kernel_test {

class ThreadedParallel final : public Parallel {
 public:
  explicit ThreadedParallel(int threads) : threads_(threads) {}

  // Splits [0, n) into up to `threads` chunks of at least `grain`, one std::thread each.
  void for_range(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn) override {
    if (n <= 0) return;
    const int64_t chunks = std::clamp<int64_t>(n / std::max<int64_t>(grain, 1), 1, threads_);
    chunks_run_ += chunks;
    std::vector<std::thread> workers;
    std::vector<std::exception_ptr> errors(static_cast<size_t>(chunks));
    for (int64_t c = 0; c < chunks; ++c)
      workers.emplace_back([&, c] {
        try {
          fn(c * n / chunks, (c + 1) * n / chunks);
        } catch (...) {
          errors[static_cast<size_t>(c)] = std::current_exception();
        }
      });
    for (auto& w : workers) w.join();
    for (auto& e : errors)
      if (e) std::rethrow_exception(e);
  }
  int num_threads() const override { return threads_; }

  // Total chunks handed out so far: more than the number of calls means work was really split.
  int64_t chunks_run() const { return chunks_run_; }

 private:
  int threads_;
  std::atomic<int64_t> chunks_run_{0};
};

}  // namespace kiln::kernels::kernel_test
