// `kiln bench bandwidth`, and the roofline of the model benchmark: the machine's streaming read
// bandwidth, each thread summing its own slice of a buffer with the widest vector loads, as 1, 2, 4
// and 8 interleaved streams; the fastest counts.
#include <fmt/format.h>
#include <pthread.h>
#include <sched.h>
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <barrier>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <iterator>
#include <thread>
#include <utility>
#include <vector>

#include "bench.h"
#include "bench_internal.h"
#include "kiln/errors.h"

namespace kiln::bench {

namespace {

constexpr int64_t kVectorBytes = 64;  // the buffer's unit: a cache line, one AVX-512 load
// Streams per thread tried, the fastest kept: which pattern a core reads fastest differs by CPU (on
// Zen 4 one stream per thread read 20-25 GB/s on a core where four interleaved ones read 11-19), and
// a kernel can be laid out for whichever it is, so the roofline is the best of them.
constexpr int kStreamCounts[] = {1, 2, 4, 8};
constexpr int kMaxStreams = 8;

// Hot: the read the bandwidth figure times. S interleaved streams of vector loads, one integer add
// each, so the loads are the bottleneck. V: the widest vector the ISA loads in one instruction (each
// clone below is compiled for its ISA, so V never lowers to slower code).
template <class V, int S>
[[gnu::always_inline]] inline uint64_t sum_streams(const std::byte* const* streams, int64_t bytes) {
  constexpr int64_t kPerLine = kVectorBytes / static_cast<int64_t>(sizeof(V));
  const V* s[S];
  V acc[S];
#pragma GCC unroll 8
  for (int i = 0; i < S; ++i) {
    s[i] = reinterpret_cast<const V*>(streams[i]);
    acc[i] = V{};
  }
  const int64_t vectors = bytes / static_cast<int64_t>(sizeof(V));
  for (int64_t i = 0; i < vectors; i += kPerLine)
    for (int64_t j = i; j < i + kPerLine; ++j)
#pragma GCC unroll 8
      for (int k = 0; k < S; ++k) acc[k] += s[k][j];
  V a{};
  for (int k = 0; k < S; ++k) a += acc[k];
  uint64_t sum = 0;
  for (size_t lane = 0; lane < sizeof(V) / sizeof(uint64_t); ++lane) sum += a[lane];
  return sum;
}

template <class V> [[gnu::always_inline]] inline uint64_t sum_any(const std::byte* const* s, int streams,
                                                                   int64_t bytes) {
  switch (streams) {
    case 1: return sum_streams<V, 1>(s, bytes);
    case 2: return sum_streams<V, 2>(s, bytes);
    case 4: return sum_streams<V, 4>(s, bytes);
    default: return sum_streams<V, 8>(s, bytes);
  }
}

using u64x8 = uint64_t __attribute__((vector_size(64)));
using u64x4 = uint64_t __attribute__((vector_size(32)));
using u64x2 = uint64_t __attribute__((vector_size(16)));

__attribute__((target("avx512f"))) uint64_t sum_avx512(const std::byte* const* s, int streams, int64_t bytes) {
  return sum_any<u64x8>(s, streams, bytes);
}
__attribute__((target("avx2"))) uint64_t sum_avx2(const std::byte* const* s, int streams, int64_t bytes) {
  return sum_any<u64x4>(s, streams, bytes);
}
uint64_t sum_sse2(const std::byte* const* s, int streams, int64_t bytes) { return sum_any<u64x2>(s, streams, bytes); }

// Sums `bytes` of each of `streams` streams (a multiple of kVectorBytes, 64-byte aligned) with the
// widest loads here.
uint64_t sum_streams(const std::byte* const* s, int streams, int64_t bytes) {
  static const auto kernel = __builtin_cpu_supports("avx512f") ? sum_avx512
                             : __builtin_cpu_supports("avx2")  ? sum_avx2
                                                               : sum_sse2;
  return kernel(s, streams, bytes);
}

}  // namespace

struct BandwidthProbe::Buffer {
  explicit Buffer(size_t bytes) {
    constexpr size_t kHugePage = size_t{2} << 20;  // aligned to a huge page so THP can back it
    data = std::aligned_alloc(kHugePage, (bytes + kHugePage - 1) / kHugePage * kHugePage);
    if (!data) throw Error(fmt::format("kiln bench: cannot allocate {} bytes", bytes));
    madvise(data, bytes, MADV_HUGEPAGE);  // advice only: failure just means small pages
  }
  ~Buffer() { std::free(data); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  void* data;
};

BandwidthProbe::BandwidthProbe(int threads, int64_t buffer_bytes) : threads_(threads) {
  if (threads < 1) throw ValueError(fmt::format("bandwidth: threads must be >= 1, got {}", threads));
  // Every thread's slice splits into up to kMaxStreams streams of whole vectors.
  const int64_t unit = int64_t{threads} * kMaxStreams * kVectorBytes;
  if (buffer_bytes < unit)
    throw ValueError(fmt::format("bandwidth: buffer of {} bytes is too small for {} threads (at least {})",
                                 buffer_bytes, threads, unit));
  slice_bytes_ = buffer_bytes / unit * kMaxStreams * kVectorBytes;
  buffer_ = std::make_unique<Buffer>(static_cast<size_t>(slice_bytes_ * threads));
  // First touch by the thread that reads the slice, so its pages live near it. Non-zero so no page
  // can stay a shared zero page.
  on_each_thread([&](int t, std::byte* slice) { std::memset(slice, t + 1, static_cast<size_t>(slice_bytes_)); });
}

BandwidthProbe::~BandwidthProbe() = default;

int64_t BandwidthProbe::bytes() const { return slice_bytes_ * threads_; }

void BandwidthProbe::on_each_thread(const std::function<void(int, std::byte*)>& fn) {
  auto* bytes = static_cast<std::byte*>(buffer_->data);
  std::vector<std::thread> workers;
  for (int t = 1; t < threads_; ++t) workers.emplace_back(fn, t, bytes + t * slice_bytes_);
  fn(0, bytes);
  for (auto& w : workers) w.join();
}

double BandwidthProbe::read(int streams_per_thread) {
  if (std::find(std::begin(kStreamCounts), std::end(kStreamCounts), streams_per_thread) == std::end(kStreamCounts))
    throw ValueError(fmt::format("bandwidth: {} streams per thread; 1, 2, 4 or 8", streams_per_thread));
  const int64_t stream_bytes = slice_bytes_ / streams_per_thread;
  std::atomic<uint64_t> sink{0};
  std::barrier sync(threads_);
  double seconds = 0;
  on_each_thread([&](int t, std::byte* slice) {
    const std::byte* starts[kMaxStreams];
    for (int s = 0; s < streams_per_thread; ++s) starts[s] = slice + s * stream_bytes;
    sync.arrive_and_wait();  // the threads' starts take different times
    const auto start = Clock::now();
    const uint64_t sum = sum_streams(starts, streams_per_thread, stream_bytes);
    sync.arrive_and_wait();  // the pass ends when the slowest thread is done
    if (t == 0) seconds = seconds_since(start);
    sink += sum;  // keeps the sums, so the reads cannot be dropped
  });
  return static_cast<double>(bytes()) / seconds;
}

BandwidthResult measure_read_bandwidth(int threads, int64_t buffer_bytes, int passes) {
  if (passes < 1) throw ValueError(fmt::format("bandwidth: passes must be >= 1, got {}", passes));
  BandwidthProbe probe(threads, buffer_bytes);
  BandwidthResult result;
  result.threads = threads;
  result.buffer_bytes = probe.bytes();
  result.passes = passes;
  for (const int streams : kStreamCounts) {
    double rate = 0;
    for (int p = 0; p < passes; ++p) rate = std::max(rate, probe.read(streams));
    result.read_bytes_per_s_by_streams.emplace_back(streams, rate);
    if (rate > result.read_bytes_per_s) {
      result.read_bytes_per_s = rate;
      result.streams_per_thread = streams;
    }
  }
  if (threads >= 2) result.core_round_trip_ns = measure_core_round_trip();
  return result;
}

double measure_core_round_trip(int round_trips) {
  if (round_trips < 1) throw ValueError(fmt::format("round trip: round_trips must be >= 1, got {}", round_trips));
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  if (sched_getaffinity(0, sizeof allowed, &allowed) != 0) return 0;
  int cpus[2], found = 0;
  for (int cpu = 0; cpu < CPU_SETSIZE && found < 2; ++cpu)
    if (CPU_ISSET(cpu, &allowed)) cpus[found++] = cpu;
  if (found < 2) return 0;
  // One line, written in turn: the ping thread writes odd counts, the pong thread the next even one
  // (-1 until pong is on its CPU, kStop when ping is done). Plain spins, so the round trip is the
  // line's, not a pause's. At most kBudget of them: on a host whose CPUs are busy with other work
  // each handover can wait for a time slice.
  constexpr int64_t kStop = -2;
  constexpr double kBudget = 0.05;  // seconds
  alignas(64) std::atomic<int64_t> line{-1};
  double seconds = 0;
  int64_t done = 0;
  auto pin_self = [](int cpu) {
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(cpu, &one);
    pthread_setaffinity_np(pthread_self(), sizeof one, &one);  // advice: unpinned threads still measure
  };
  std::thread pong([&] {
    pin_self(cpus[1]);
    line.store(0, std::memory_order_release);
    for (int64_t n = 1;; n += 2) {
      int64_t seen;
      while ((seen = line.load(std::memory_order_acquire)) != n && seen != kStop) {
      }
      if (seen == kStop) return;
      line.store(n + 1, std::memory_order_release);
    }
  });
  std::thread ping([&] {
    pin_self(cpus[0]);
    while (line.load(std::memory_order_acquire) != 0) {
    }
    const auto start = Clock::now();
    for (int64_t n = 1; done < round_trips; n += 2) {
      line.store(n, std::memory_order_release);
      while (line.load(std::memory_order_acquire) != n + 1) {
      }
      if (++done % 64 == 0 && seconds_since(start) > kBudget) break;
    }
    seconds = seconds_since(start);
    line.store(kStop, std::memory_order_release);
  });
  ping.join();
  pong.join();
  return seconds / static_cast<double>(done) * 1e9;
}

}  // namespace kiln::bench
