// `kiln bench bandwidth`, and the roofline of the model benchmark: the machine's streaming read
// bandwidth, each thread summing its own slice of a buffer with the widest vector loads, as 1, 2, 4
// and 8 interleaved streams; the fastest counts.
#include <fmt/format.h>
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <barrier>
#include <cstdlib>
#include <cstring>
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

struct AlignedBuffer {
  explicit AlignedBuffer(size_t bytes) : bytes(bytes) {
    constexpr size_t kHugePage = size_t{2} << 20;  // aligned to a huge page so THP can back it
    data = std::aligned_alloc(kHugePage, (bytes + kHugePage - 1) / kHugePage * kHugePage);
    if (!data) throw Error(fmt::format("kiln bench: cannot allocate {} bytes", bytes));
    madvise(data, bytes, MADV_HUGEPAGE);  // advice only: failure just means small pages
  }
  ~AlignedBuffer() { std::free(data); }
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  void* data;
  size_t bytes;
};

}  // namespace

BandwidthResult measure_read_bandwidth(int threads, int64_t buffer_bytes, int passes) {
  if (threads < 1) throw ValueError(fmt::format("bandwidth: threads must be >= 1, got {}", threads));
  if (passes < 1) throw ValueError(fmt::format("bandwidth: passes must be >= 1, got {}", passes));
  // Every thread's slice splits into up to kMaxStreams streams of whole vectors.
  const int64_t unit = int64_t{threads} * kMaxStreams * kVectorBytes;
  if (buffer_bytes < unit)
    throw ValueError(fmt::format("bandwidth: buffer of {} bytes is too small for {} threads (at least {})",
                                 buffer_bytes, threads, unit));
  const int64_t slice_bytes = buffer_bytes / unit * kMaxStreams * kVectorBytes;  // one thread's
  const int64_t used_bytes = slice_bytes * threads;
  AlignedBuffer buffer(static_cast<size_t>(used_bytes));
  auto* bytes = static_cast<std::byte*>(buffer.data);

  // pass_seconds[pattern][pass], the pass timed by thread 0 between two barriers.
  std::vector<std::vector<double>> pass_seconds(std::size(kStreamCounts), std::vector<double>(static_cast<size_t>(passes)));
  std::atomic<uint64_t> sink{0};
  std::barrier sync(threads);
  auto worker = [&](int t) {
    std::byte* mine = bytes + t * slice_bytes;
    // First touch: the pages live near this thread. Non-zero so no page can stay a shared zero page.
    std::memset(mine, t + 1, static_cast<size_t>(slice_bytes));
    uint64_t local = 0;
    for (size_t pattern = 0; pattern < std::size(kStreamCounts); ++pattern) {
      const int streams = kStreamCounts[pattern];
      const int64_t stream_bytes = slice_bytes / streams;
      const std::byte* starts[kMaxStreams];
      for (int s = 0; s < streams; ++s) starts[s] = mine + s * stream_bytes;
      for (int p = 0; p < passes; ++p) {
        sync.arrive_and_wait();
        const auto start = Clock::now();
        local += sum_streams(starts, streams, stream_bytes);
        sync.arrive_and_wait();  // the pass ends when the slowest thread is done
        if (t == 0) pass_seconds[pattern][static_cast<size_t>(p)] = seconds_since(start);
      }
    }
    sink += local;  // keeps the sums, so the reads cannot be dropped
  };
  std::vector<std::thread> workers;
  for (int t = 1; t < threads; ++t) workers.emplace_back(worker, t);
  worker(0);
  for (auto& w : workers) w.join();

  BandwidthResult result;
  result.threads = threads;
  result.buffer_bytes = used_bytes;
  result.passes = passes;
  for (size_t pattern = 0; pattern < std::size(kStreamCounts); ++pattern) {
    const double best = *std::min_element(pass_seconds[pattern].begin(), pass_seconds[pattern].end());
    const double rate = static_cast<double>(used_bytes) / best;
    result.read_bytes_per_s_by_streams.emplace_back(kStreamCounts[pattern], rate);
    if (rate > result.read_bytes_per_s) {
      result.read_bytes_per_s = rate;
      result.streams_per_thread = kStreamCounts[pattern];
    }
  }
  return result;
}

}  // namespace kiln::bench
