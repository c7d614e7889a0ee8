#include "engine/cpu/thread_pool.h"
#include "kernels/cpu/spin.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <thread>
#include <memory>
#include <vector>

namespace kiln::engine {

namespace {

// Set on pool workers for their whole life, and on a caller while it runs a for_range: a for_range
// issued from such a thread runs serially, because the pool is already busy with the outer call and
// waiting for it from inside would deadlock.
thread_local bool t_inside_pool = false;

// How long an idle worker (or a caller waiting for stragglers) spins before it blocks. Long enough to
// bridge the gap between the small ops of one decode step, short enough not to hold a core when idle.
constexpr auto kSpinTime = std::chrono::microseconds(200);

template <class Pred> bool spin_until(Pred pred) { return kernels::spin_until(pred, kSpinTime); }

}  // namespace

// One for_range call. Shared (not on the caller's stack) because a worker that wakes late may still
// look at a job the caller has finished with: it then finds no chunk left and never touches `fn`.
struct Job {
  const std::function<void(int64_t, int64_t)>* fn = nullptr;
  int64_t n = 0;
  int64_t num_chunks = 0;
  std::atomic<int64_t> next_chunk{0};
  std::atomic<int64_t> done_chunks{0};
  std::atomic<bool> failed{false};
  std::mutex error_mutex;
  std::exception_ptr first_error;
};

struct ThreadPool::State {
  int num_workers = 0;
  std::vector<std::thread> workers;

  // Guards `current`, `sleepers` and the wake-up; `generation` changes (under it) with each new job.
  std::mutex mutex;
  std::condition_variable wake_cv;
  std::shared_ptr<Job> current;
  std::atomic<uint64_t> generation{0};
  int sleepers = 0;
  std::atomic<bool> stop{false};

  std::mutex done_mutex;
  std::condition_variable done_cv;

  std::mutex call_mutex;  // serialises for_range calls from different outside threads

  // Runs chunks of `job` until none is left. After a chunk has failed, the rest are skipped (but
  // still counted, so the caller's wait ends).
  void run_chunks(Job& job) {
    for (;;) {
      const int64_t chunk = job.next_chunk.fetch_add(1, std::memory_order_relaxed);
      if (chunk >= job.num_chunks) return;
      if (!job.failed.load(std::memory_order_relaxed)) {
        // Even split: every chunk has floor or ceil of n / num_chunks items, hence at least `grain`.
        const int64_t begin = chunk * job.n / job.num_chunks;
        const int64_t end = (chunk + 1) * job.n / job.num_chunks;
        try {
          (*job.fn)(begin, end);
        } catch (...) {
          std::lock_guard lock(job.error_mutex);
          if (!job.first_error) job.first_error = std::current_exception();
          job.failed.store(true, std::memory_order_relaxed);
        }
      }
      if (job.done_chunks.fetch_add(1, std::memory_order_acq_rel) + 1 == job.num_chunks) {
        std::lock_guard lock(done_mutex);
        done_cv.notify_all();
      }
    }
  }

  void worker_loop() {
    t_inside_pool = true;
    uint64_t seen_generation = 0;
    auto has_news = [&] {
      return generation.load(std::memory_order_acquire) != seen_generation ||
             stop.load(std::memory_order_acquire);
    };
    for (;;) {
      std::shared_ptr<Job> job;
      {
        bool news = spin_until(has_news);
        std::unique_lock lock(mutex);
        if (!news) {
          ++sleepers;
          wake_cv.wait(lock, has_news);
          --sleepers;
        }
        if (stop.load(std::memory_order_acquire)) return;
        seen_generation = generation.load(std::memory_order_relaxed);
        job = current;
      }
      if (job) run_chunks(*job);
    }
  }
};

ThreadPool::ThreadPool(int num_threads) : state_(std::make_unique<State>()) {
  if (num_threads <= 0) num_threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  state_->num_workers = num_threads - 1;
  state_->workers.reserve(state_->num_workers);
  for (int i = 0; i < state_->num_workers; ++i)
    state_->workers.emplace_back([s = state_.get()] { s->worker_loop(); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard lock(state_->mutex);
    state_->stop.store(true, std::memory_order_release);
  }
  state_->wake_cv.notify_all();
  for (auto& w : state_->workers) w.join();
}

int ThreadPool::num_threads() const { return state_->num_workers + 1; }

void ThreadPool::for_range(int64_t n, int64_t grain,
                           const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  grain = std::max<int64_t>(grain, 1);
  State& s = *state_;
  // A few chunks per thread balance uneven chunk costs; never fewer than `grain` items per chunk.
  const int64_t num_chunks = std::min<int64_t>(n / grain, int64_t{4} * (s.num_workers + 1));
  if (t_inside_pool || s.num_workers == 0 || num_chunks <= 1) {
    fn(0, n);
    return;
  }

  std::lock_guard call_lock(s.call_mutex);
  auto job = std::make_shared<Job>();
  job->fn = &fn;
  job->n = n;
  job->num_chunks = num_chunks;
  bool wake;
  {
    std::lock_guard lock(s.mutex);
    s.current = job;
    s.generation.fetch_add(1, std::memory_order_release);
    wake = s.sleepers > 0;
  }
  if (wake) s.wake_cv.notify_all();

  t_inside_pool = true;
  s.run_chunks(*job);
  t_inside_pool = false;

  // Wait for chunks other threads took; a worker that never got to this job is not waited for.
  auto all_done = [&] { return job->done_chunks.load(std::memory_order_acquire) == num_chunks; };
  if (!spin_until(all_done)) {
    std::unique_lock lock(s.done_mutex);
    s.done_cv.wait(lock, all_done);
  }
  {
    std::lock_guard lock(s.mutex);
    if (s.current == job) s.current.reset();
  }
  if (job->first_error) std::rethrow_exception(job->first_error);
}

}  // namespace kiln::engine
