// Private: short busy-waits, shared by the thread pool, the device team and the collectives. Threads
// that wait microseconds for each other (the ops of one decode step) spin instead of sleeping, since
// a futex wake-up costs more than the wait.
#pragma once

#include <chrono>
#include <thread>

namespace kiln::kernels {

// Tells the core this is a spin loop (frees pipeline resources for the sibling hyperthread).
inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// Spins until pred() or `budget` has passed; returns pred(). With yield, it also gives the core away
// every 64 checks, for when more threads wait on each other than there are cores.
template <class Pred>
bool spin_until(Pred pred, std::chrono::microseconds budget, bool yield = false) {
  const auto deadline = std::chrono::steady_clock::now() + budget;
  for (int i = 0;; ++i) {
    if (pred()) return true;
    cpu_relax();
    if ((i & 63) == 63) {
      if (std::chrono::steady_clock::now() >= deadline) return pred();
      if (yield) std::this_thread::yield();
    }
  }
}

}  // namespace kiln::kernels
