// The engine's thread pool: coverage of every index, exceptions, nesting, and many tiny calls.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <set>
#include <stdexcept>
#include <thread>
#include <vector>

#include "engine/cpu/thread_pool.h"

namespace kiln::engine {
namespace {

TEST(ThreadPool, CoversEveryIndexExactlyOnceInChunksOfAtLeastGrain) {
  ThreadPool pool(4);
  EXPECT_EQ(pool.num_threads(), 4);
  for (int64_t n : {1, 2, 3, 7, 16, 100, 1000, 4097}) {
    for (int64_t grain : {1, 2, 5, 64, 1000, 5000}) {
      std::vector<std::atomic<int>> hits(static_cast<size_t>(n));
      std::atomic<int64_t> short_chunks{0};
      pool.for_range(n, grain, [&](int64_t begin, int64_t end) {
        // Only a call that cannot be split (n < grain) may hand out fewer than `grain` items.
        if (end - begin < grain && !(begin == 0 && end == n)) ++short_chunks;
        for (int64_t i = begin; i < end; ++i) hits[static_cast<size_t>(i)]++;
      });
      for (int64_t i = 0; i < n; ++i) ASSERT_EQ(hits[static_cast<size_t>(i)].load(), 1) << "n " << n << " grain " << grain << " index " << i;
      EXPECT_EQ(short_chunks.load(), 0) << "n " << n << " grain " << grain;
    }
  }
}

TEST(ThreadPool, RunsChunksOnSeveralThreads) {
  ThreadPool pool(4);
  std::mutex mutex;
  std::set<std::thread::id> seen;
  // Chunks that take a while, so the caller cannot run them all before the workers wake up.
  pool.for_range(16, 1, [&](int64_t, int64_t) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    std::lock_guard lock(mutex);
    seen.insert(std::this_thread::get_id());
  });
  EXPECT_GT(seen.size(), 1u);
}

TEST(ThreadPool, ZeroOrNegativeSizeRunsNothing) {
  ThreadPool pool(3);
  int calls = 0;
  pool.for_range(0, 1, [&](int64_t, int64_t) { ++calls; });
  pool.for_range(-5, 1, [&](int64_t, int64_t) { ++calls; });
  EXPECT_EQ(calls, 0);
}

TEST(ThreadPool, RethrowsTheFirstExceptionOnTheCaller) {
  ThreadPool pool(4);
  for (int round = 0; round < 20; ++round) {
    EXPECT_THROW(pool.for_range(1000, 1,
                                [&](int64_t begin, int64_t end) {
                                  if (begin <= 500 && 500 < end) throw std::out_of_range("chunk with 500");
                                }),
                 std::out_of_range);
  }
  // The pool still works after a failed call.
  std::atomic<int64_t> total{0};
  pool.for_range(1000, 1, [&](int64_t begin, int64_t end) { total += end - begin; });
  EXPECT_EQ(total.load(), 1000);
}

TEST(ThreadPool, NestedCallsRunSeriallyWithoutDeadlock) {
  ThreadPool pool(4);
  std::vector<std::atomic<int>> hits(64 * 64);
  pool.for_range(64, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      pool.for_range(64, 1, [&](int64_t b, int64_t e) {
        for (int64_t j = b; j < e; ++j) hits[static_cast<size_t>(i * 64 + j)]++;
      });
  });
  for (auto& h : hits) ASSERT_EQ(h.load(), 1);
}

TEST(ThreadPool, ManyTinyCallsInARowComplete) {
  ThreadPool pool(4);
  int64_t total = 0;
  for (int call = 0; call < 20000; ++call) {
    std::atomic<int64_t> sum{0};
    pool.for_range(8, 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) sum += i;
    });
    ASSERT_EQ(sum.load(), 28) << "call " << call;
    total += sum.load();
  }
  EXPECT_EQ(total, 28 * 20000);
}

TEST(ThreadPool, CallsAfterIdleSleepStillComplete) {
  ThreadPool pool(3);
  for (int round = 0; round < 3; ++round) {
    // Long enough for the workers to stop spinning and block.
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    std::atomic<int64_t> count{0};
    pool.for_range(300, 1, [&](int64_t begin, int64_t end) { count += end - begin; });
    EXPECT_EQ(count.load(), 300);
  }
}

TEST(ThreadPool, CallersOnSeveralThreadsShareOnePool) {
  ThreadPool pool(3);
  std::vector<std::thread> callers;
  std::atomic<int64_t> total{0};
  for (int c = 0; c < 4; ++c)
    callers.emplace_back([&] {
      for (int call = 0; call < 500; ++call)
        pool.for_range(100, 1, [&](int64_t begin, int64_t end) { total += end - begin; });
    });
  for (auto& t : callers) t.join();
  EXPECT_EQ(total.load(), 4 * 500 * 100);
}

TEST(ThreadPool, SingleThreadPoolRunsOnTheCaller) {
  ThreadPool pool(1);
  EXPECT_EQ(pool.num_threads(), 1);
  const auto caller = std::this_thread::get_id();
  bool on_caller = true;
  int64_t covered = 0;
  pool.for_range(1000, 1, [&](int64_t begin, int64_t end) {
    on_caller = on_caller && std::this_thread::get_id() == caller;
    covered += end - begin;
  });
  EXPECT_TRUE(on_caller);
  EXPECT_EQ(covered, 1000);
}

TEST(ThreadPool, DefaultSizeIsAtLeastOne) {
  ThreadPool pool(0);
  EXPECT_GE(pool.num_threads(), 1);
}

}  // namespace
}  // namespace kiln::engine
