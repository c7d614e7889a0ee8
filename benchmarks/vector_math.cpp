// vector_math.h's SIMD loops beside the scalar libm loops they replace (elementwise_functors.h's
// formulas), on L1-resident arrays, as elements per second; and argmax over a 32000-entry vocabulary.
//
//   build-rel/bench_vector_math
#include <benchmark/benchmark.h>

#include <cmath>
#include <random>
#include <vector>

#include "kernels/cpu/vector_math.h"

namespace {

namespace vmath = kiln::kernels::vmath;

std::vector<float> inputs(int64_t n) {
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> dist(-10.0f, 10.0f);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = dist(rng);
  return v;
}

template <vmath::Fn kFn> void BM_simd(benchmark::State& state) {
  if (!vmath::available()) {
    state.SkipWithError("no AVX-512 on this CPU");
    return;
  }
  const std::vector<float> x = inputs(state.range(0));
  std::vector<float> y(x.size());
  for (auto _ : state) {
    vmath::apply(kFn, x.data(), y.data(), state.range(0));
    benchmark::DoNotOptimize(y.data());
  }
  state.SetItemsProcessed(state.iterations() * state.range(0));
}

template <vmath::Fn kFn> void BM_libm(benchmark::State& state) {
  const std::vector<float> x = inputs(state.range(0));
  std::vector<float> y(x.size());
  for (auto _ : state) {
    for (size_t i = 0; i < x.size(); ++i) {
      const float e = std::exp(kFn == vmath::Fn::exp ? x[i] : -x[i]);
      y[i] = kFn == vmath::Fn::exp ? e : kFn == vmath::Fn::sigmoid ? 1.0f / (1.0f + e) : x[i] / (1.0f + e);
    }
    benchmark::DoNotOptimize(y.data());
  }
  state.SetItemsProcessed(state.iterations() * state.range(0));
}

void BM_argmax_simd(benchmark::State& state) {
  if (!vmath::available()) {
    state.SkipWithError("no AVX-512 on this CPU");
    return;
  }
  const std::vector<float> x = inputs(state.range(0));
  for (auto _ : state) benchmark::DoNotOptimize(vmath::extreme_index(x.data(), state.range(0), true));
  state.SetItemsProcessed(state.iterations() * state.range(0));
}

void BM_argmax_scalar(benchmark::State& state) {
  const std::vector<float> x = inputs(state.range(0));
  for (auto _ : state) {
    int64_t best = 0;
    for (size_t i = 1; i < x.size(); ++i)
      if (x[i] > x[static_cast<size_t>(best)]) best = static_cast<int64_t>(i);
    benchmark::DoNotOptimize(best);
  }
  state.SetItemsProcessed(state.iterations() * state.range(0));
}

}  // namespace

BENCHMARK(BM_simd<vmath::Fn::exp>)->Arg(4096);
BENCHMARK(BM_libm<vmath::Fn::exp>)->Arg(4096);
BENCHMARK(BM_simd<vmath::Fn::silu>)->Arg(4096);
BENCHMARK(BM_libm<vmath::Fn::silu>)->Arg(4096);
BENCHMARK(BM_argmax_simd)->Arg(32000);
BENCHMARK(BM_argmax_scalar)->Arg(32000);

BENCHMARK_MAIN();
