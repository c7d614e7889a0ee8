// `kiln bench bandwidth`, and the roofline of the model benchmark: the machine's streaming read
// bandwidth, each thread summing its own slice of a buffer with the widest vector loads.
#include <fmt/format.h>
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <barrier>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#include "bench.h"
#include "bench_internal.h"
#include "kiln/errors.h"

namespace kiln::bench {

namespace {

constexpr int kStreams = 4;
constexpr int64_t kVectorBytes = 64;  // the buffer's unit: a cache line, one AVX-512 load

// Hot: the read the bandwidth figure times. Four interleaved streams of vector loads, one integer
// add each, so the loads are the bottleneck. V: the widest vector the ISA loads in one instruction
// (each clone below is compiled for its ISA, so V never lowers to slower code).
template <class V>
[[gnu::always_inline]] inline uint64_t sum_streams(const std::byte* const (&streams)[kStreams],
                                                   int64_t bytes) {
  constexpr int64_t kPerLine = kVectorBytes / static_cast<int64_t>(sizeof(V));
  const auto* s0 = reinterpret_cast<const V*>(streams[0]);
  const auto* s1 = reinterpret_cast<const V*>(streams[1]);
  const auto* s2 = reinterpret_cast<const V*>(streams[2]);
  const auto* s3 = reinterpret_cast<const V*>(streams[3]);
  V a0{}, a1{}, a2{}, a3{};
  const int64_t vectors = bytes / static_cast<int64_t>(sizeof(V));
  for (int64_t i = 0; i < vectors; i += kPerLine)
    for (int64_t j = i; j < i + kPerLine; ++j) {
      a0 += s0[j];
      a1 += s1[j];
      a2 += s2[j];
      a3 += s3[j];
    }
  const V a = a0 + a1 + a2 + a3;
  uint64_t sum = 0;
  for (size_t lane = 0; lane < sizeof(V) / sizeof(uint64_t); ++lane) sum += a[lane];
  return sum;
}

using u64x8 = uint64_t __attribute__((vector_size(64)));
using u64x4 = uint64_t __attribute__((vector_size(32)));
using u64x2 = uint64_t __attribute__((vector_size(16)));

__attribute__((target("avx512f"))) uint64_t sum_streams_avx512(const std::byte* const (&s)[kStreams],
                                                               int64_t bytes) {
  return sum_streams<u64x8>(s, bytes);
}
__attribute__((target("avx2"))) uint64_t sum_streams_avx2(const std::byte* const (&s)[kStreams],
                                                          int64_t bytes) {
  return sum_streams<u64x4>(s, bytes);
}
uint64_t sum_streams_sse2(const std::byte* const (&s)[kStreams], int64_t bytes) {
  return sum_streams<u64x2>(s, bytes);
}

// Sums `bytes` of each stream (a multiple of kVectorBytes, 64-byte aligned) with the widest loads here.
uint64_t sum_streams(const std::byte* const (&streams)[kStreams], int64_t bytes) {
  static const auto kernel = __builtin_cpu_supports("avx512f") ? sum_streams_avx512
                             : __builtin_cpu_supports("avx2")  ? sum_streams_avx2
                                                               : sum_streams_sse2;
  return kernel(streams, bytes);
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
  // Every thread's slice splits into kStreams streams of whole vectors.
  const int64_t unit = int64_t{threads} * kStreams * kVectorBytes;
  if (buffer_bytes < unit)
    throw ValueError(fmt::format("bandwidth: buffer of {} bytes is too small for {} threads (at least {})",
                                 buffer_bytes, threads, unit));
  const int64_t stream_bytes = buffer_bytes / unit * kVectorBytes;
  const int64_t used_bytes = stream_bytes * kStreams * threads;
  AlignedBuffer buffer(static_cast<size_t>(used_bytes));
  auto* bytes = static_cast<std::byte*>(buffer.data);

  std::vector<double> pass_seconds(static_cast<size_t>(passes));
  std::atomic<uint64_t> sink{0};
  std::barrier sync(threads);
  auto worker = [&](int t) {
    std::byte* mine = bytes + t * kStreams * stream_bytes;
    // First touch: the pages live near this thread. Non-zero so no page can stay a shared zero page.
    std::memset(mine, t + 1, static_cast<size_t>(kStreams * stream_bytes));
    const std::byte* const streams[kStreams] = {mine, mine + stream_bytes, mine + 2 * stream_bytes,
                                                mine + 3 * stream_bytes};
    uint64_t local = 0;
    for (int p = 0; p < passes; ++p) {
      sync.arrive_and_wait();
      const auto start = Clock::now();
      local += sum_streams(streams, stream_bytes);
      sync.arrive_and_wait();  // the pass ends when the slowest thread is done
      if (t == 0) pass_seconds[static_cast<size_t>(p)] = seconds_since(start);
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
  result.streams_per_thread = kStreams;
  result.passes = passes;
  result.read_bytes_per_s =
      static_cast<double>(used_bytes) / *std::min_element(pass_seconds.begin(), pass_seconds.end());
  return result;
}

}  // namespace kiln::bench
