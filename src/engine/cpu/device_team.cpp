#include "engine/cpu/device_team.h"
#include "kernels/cpu/spin.h"

#include <chrono>

namespace kiln::engine {

namespace {

// How long a worker waits for the next job (or the caller for stragglers) before it sleeps: long
// enough to bridge the ops between two collectives of one decode step, short enough not to hold a
// core while the session is idle.
constexpr auto kSpinTime = std::chrono::microseconds(100);

// Yielding: with more devices than cores, the thread waited for needs this core.
template <class Pred> bool spin_until(Pred pred) { return kernels::spin_until(pred, kSpinTime, /*yield=*/true); }

}  // namespace

DeviceThreadTeam::~DeviceThreadTeam() {
  {
    std::lock_guard lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  for (std::thread& t : threads_) t.join();
}

int DeviceThreadTeam::num_threads() const {
  std::lock_guard lock(mutex_);
  return static_cast<int>(threads_.size());
}

void DeviceThreadTeam::run(int n, const std::function<void(int)>& fn) {
  if (n <= 0) return;
  std::lock_guard run_lock(run_mutex_);
  if (n == 1) {
    fn(0);
    return;
  }
  {
    std::lock_guard lock(mutex_);
    while (static_cast<int>(threads_.size()) < n - 1) {
      const int participant = static_cast<int>(threads_.size()) + 1;
      threads_.emplace_back([this, participant, seen = generation_.load()] { worker(participant, seen); });
    }
    fn_ = &fn;
    n_ = n;
    errors_.assign(static_cast<size_t>(n), nullptr);
    remaining_.store(n - 1, std::memory_order_relaxed);
    generation_.fetch_add(1, std::memory_order_release);
  }
  wake_.notify_all();

  try {
    fn(0);
  } catch (...) {
    errors_[0] = std::current_exception();
  }
  if (!spin_until([&] { return remaining_.load(std::memory_order_acquire) == 0; })) {
    std::unique_lock lock(mutex_);
    done_.wait(lock, [&] { return remaining_.load(std::memory_order_acquire) == 0; });
  }
  for (const std::exception_ptr& error : errors_)
    if (error) std::rethrow_exception(error);
}

void DeviceThreadTeam::worker(int participant, uint64_t seen_generation) {
  for (;;) {
    if (!spin_until([&] { return generation_.load(std::memory_order_acquire) != seen_generation; })) {
      std::unique_lock lock(mutex_);
      wake_.wait(lock, [&] { return stop_ || generation_.load(std::memory_order_relaxed) != seen_generation; });
      if (stop_) return;
    }
    const std::function<void(int)>* fn;
    int n;
    {
      std::lock_guard lock(mutex_);
      if (stop_) return;
      seen_generation = generation_.load(std::memory_order_relaxed);
      fn = fn_;
      n = n_;
    }
    if (participant >= n) continue;  // a job for fewer devices
    try {
      (*fn)(participant);
    } catch (...) {
      errors_[static_cast<size_t>(participant)] = std::current_exception();
    }
    if (remaining_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
      std::lock_guard lock(mutex_);  // the caller checks remaining_ under mutex_ before sleeping
      done_.notify_all();
    }
  }
}

}  // namespace kiln::engine
