// Private: the threads that run the participants of a collective (kernels::DeviceTeam), one
// persistent thread per device beyond the first; the calling thread is participant 0. Owned by the
// session, so every model of a session shares them.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "kernels/cpu/kernels.h"

namespace kiln::engine {

class DeviceThreadTeam final : public kernels::DeviceTeam {
 public:
  DeviceThreadTeam() = default;
  ~DeviceThreadTeam() override;  // stops and joins the threads
  DeviceThreadTeam(const DeviceThreadTeam&) = delete;
  DeviceThreadTeam& operator=(const DeviceThreadTeam&) = delete;

  // Runs fn(0) on this thread and fn(1) .. fn(n - 1) on the team's threads (started on first need),
  // all at once; returns when all are done, rethrowing the lowest-numbered participant's exception.
  // Calls from several threads run one after another. fn must not call run() itself.
  void run(int n, const std::function<void(int)>& fn) override;
  int num_threads() const;  // threads started so far (participants 1 .. num_threads())

 private:
  void worker(int participant, uint64_t seen_generation);

  std::mutex run_mutex_;  // one run at a time: a run owns every thread until it returns

  // The current job, published under mutex_ by bumping generation_; workers spin on generation_ for
  // a moment before sleeping on wake_, since a decode step runs collectives back to back.
  mutable std::mutex mutex_;
  std::condition_variable wake_;
  std::condition_variable done_;
  std::atomic<uint64_t> generation_{0};
  const std::function<void(int)>* fn_ = nullptr;
  int n_ = 0;
  std::atomic<int> remaining_{0};  // workers of the current job still running
  std::vector<std::exception_ptr> errors_;  // per participant of the current job
  bool stop_ = false;
  std::vector<std::thread> threads_;
};

}  // namespace kiln::engine
