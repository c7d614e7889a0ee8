// The multiply-add peaks `kiln bench gemm` sets its GFLOP/s beside: FMA chains (f32), vdpbf16ps
// chains (bf16 on AVX512_BF16) and tdpbf16ps tile chains (bf16 on AMX), timed on every thread at once.
#include <fmt/format.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <barrier>
#include <thread>
#include <vector>

#include "bench.h"
#include "bench_internal.h"
#include "kiln/errors.h"
#include "kiln/kernels/cpu_probes.h"

namespace kiln::bench {

namespace {

// Hot: `kChains` independent FMA chains (enough to cover FMA latency x ports), `iterations` rounds.
// V: the ISA's widest float vector; each clone below is compiled for its ISA.
constexpr int kChains = 12;
constexpr int64_t kPeakIterations = 500000;  // about 1 ms a pass at 3 GHz

template <class V>
[[gnu::always_inline]] inline float fma_chains(int64_t iterations) {
  V acc[kChains];
  for (int c = 0; c < kChains; ++c) acc[c] = V{} + static_cast<float>(c);
  const V scale = V{} + 0.999999f, offset = V{} + 1e-7f;  // converges to 0.1: no denormals
  for (int64_t i = 0; i < iterations; ++i)
#pragma GCC unroll 12
    for (int c = 0; c < kChains; ++c) acc[c] = acc[c] * scale + offset;  // contracted to one FMA
  V sum{};
  for (int c = 0; c < kChains; ++c) sum += acc[c];
  float total = 0;
  for (size_t lane = 0; lane < sizeof(V) / sizeof(float); ++lane) total += sum[lane];
  return total;
}

using f32x16 = float __attribute__((vector_size(64)));
using f32x8 = float __attribute__((vector_size(32)));
using f32x4 = float __attribute__((vector_size(16)));

__attribute__((target("avx512f,fma"), optimize("fp-contract=fast"))) float fma_chains_avx512(int64_t n) {
  return fma_chains<f32x16>(n);
}
__attribute__((target("avx2,fma"), optimize("fp-contract=fast"))) float fma_chains_avx2(int64_t n) {
  return fma_chains<f32x8>(n);
}
float fma_chains_sse(int64_t n) { return fma_chains<f32x4>(n); }

// vdpbf16ps chains: each lane adds two products of small bf16 values (2^-10 * 2^-10) per step, so
// the sums stay far from overflow over a pass.
__attribute__((target("avx512f,avx512bf16"))) float dpbf16_chains_avx512(int64_t iterations) {
  __m512 acc[kChains];
  for (int c = 0; c < kChains; ++c) acc[c] = _mm512_set1_ps(static_cast<float>(c));
  const __m512bh a = (__m512bh)_mm512_set1_epi16(0x3a80), b = (__m512bh)_mm512_set1_epi16(0x3a80);  // 2^-10
  for (int64_t i = 0; i < iterations; ++i)
#pragma GCC unroll 12
    for (int c = 0; c < kChains; ++c) acc[c] = _mm512_dpbf16_ps(acc[c], a, b);
  __m512 sum = _mm512_setzero_ps();
  for (int c = 0; c < kChains; ++c) sum = _mm512_add_ps(sum, acc[c]);
  alignas(64) float lanes[16];  // not _mm512_reduce_add_ps: GCC 12 flags its own header at -O3
  _mm512_store_ps(lanes, sum);
  float total = 0;
  for (float lane : lanes) total += lane;
  return total;
}

// Runs the widest kernel; returns the flops it did per iteration count.
double run_fma_chains(int64_t iterations, std::atomic<float>& sink) {
  static const auto kernel = __builtin_cpu_supports("avx512f") ? fma_chains_avx512
                             : __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")
                                 ? fma_chains_avx2
                                 : fma_chains_sse;
  static const int lanes = kernel == fma_chains_avx512 ? 16 : kernel == fma_chains_avx2 ? 8 : 4;
  sink.store(kernel(iterations), std::memory_order_relaxed);
  return 2.0 * lanes * kChains * static_cast<double>(iterations);
}

}  // namespace

namespace {

enum class PeakUnit { fma, bf16_dot, amx_tiles };

double measure_peak(int threads, int passes, PeakUnit unit) {
  if (threads < 1) throw ValueError(fmt::format("peak: threads must be >= 1, got {}", threads));
  if (passes < 1) throw ValueError(fmt::format("peak: passes must be >= 1, got {}", passes));
  std::vector<double> pass_seconds(static_cast<size_t>(passes));
  std::atomic<float> sink{0};
  double flop_per_thread = 0;
  std::barrier sync(threads);
  auto worker = [&](int t) {
    for (int p = 0; p < passes; ++p) {
      sync.arrive_and_wait();
      const auto start = Clock::now();
      // About 1 ms a pass on the tiles and FMAs (a round of 4 tile products takes ~64 cycles).
      double flop = 0;
      switch (unit) {
        case PeakUnit::amx_tiles:
          flop = kernels::run_amx_tile_chains(kPeakIterations / 16);
          break;
        case PeakUnit::bf16_dot:
          sink.store(dpbf16_chains_avx512(kPeakIterations), std::memory_order_relaxed);
          flop = 4.0 * 16 * kChains * static_cast<double>(kPeakIterations);
          break;
        case PeakUnit::fma:
          flop = run_fma_chains(kPeakIterations, sink);
          break;
      }
      sync.arrive_and_wait();  // the pass ends when the slowest thread is done
      if (t == 0) {
        pass_seconds[static_cast<size_t>(p)] = seconds_since(start);
        flop_per_thread = flop;
      }
    }
  };
  std::vector<std::thread> workers;
  for (int t = 1; t < threads; ++t) workers.emplace_back(worker, t);
  worker(0);
  for (auto& w : workers) w.join();
  return flop_per_thread * threads / *std::min_element(pass_seconds.begin(), pass_seconds.end()) * 1e-9;
}

}  // namespace

double measure_peak_gflops(int threads, int passes, DType dtype) {
  if (dtype == DType::bf16 && kernels::amx_available())
    return measure_peak(threads, passes, PeakUnit::amx_tiles);
  if (dtype == DType::bf16 && kernels::gemm_uses_bf16_dot())
    return measure_peak(threads, passes, PeakUnit::bf16_dot);
  return measure_peak(threads, passes, PeakUnit::fma);
}

double measure_bf16_dot_peak_gflops(int threads, int passes) {
  if (!kernels::bf16_dot_supported()) throw ValueError("peak: this CPU has no AVX512_BF16 (vdpbf16ps)");
  return measure_peak(threads, passes, PeakUnit::bf16_dot);
}

}  // namespace kiln::bench
