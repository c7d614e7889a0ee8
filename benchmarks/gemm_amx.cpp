// The bf16 matmul kernel on AMX tiles (kernels/cpu/gemm_amx.h) beside kiln's other bf16 path (the
// AVX-512 GEMM, AMX switched off) and, when linked, oneDNN's bf16 matmul. Counter: FLOP/s (2 M N K
// per call). Weights are [N, K] read with transpose_b (nn::Linear's layout).
//   prepared:   the weight packed once at init (what a compiled model runs)
//   unprepared: no prepared state: packed on every call where M >= amx::kMinRowsUnprepared
//   avx512:     AMX off: the SIMD GEMM of gemm.h
//
//   build/bench_gemm_amx --benchmark_counters_tabular=true
//   args: M / N / K / threads. oneDNN runs with as many OpenMP threads.
#include "kernels/cpu/gemm_amx.h"

#include <benchmark/benchmark.h>

#include <cstdint>
#include <memory>
#include <random>
#include <span>
#include <vector>

#include "engine/cpu/thread_pool.h"
#include "kernels/cpu/kernels.h"

#if defined(KILN_HAVE_DNNL)
#include <omp.h>

#include <dnnl.hpp>
#endif

namespace {

using kiln::DType;
using kiln::kernels::TensorView;
namespace amx = kiln::kernels::amx;

std::vector<uint16_t> random_bf16(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(-1, 1);
  std::vector<uint16_t> out(static_cast<size_t>(n));
  for (uint16_t& v : out) v = kiln::f32_to_bf16(dist(rng));
  return out;
}

void set_flops(benchmark::State& state, int64_t M, int64_t N, int64_t K) {
  state.counters["FLOP/s"] =
      benchmark::Counter(2.0 * M * N * K, benchmark::Counter::kIsIterationInvariantRate);
}

enum class Mode { prepared, unprepared, avx512 };

void run_kiln(benchmark::State& state, Mode mode) {
  if (mode != Mode::avx512 && !amx::available()) {
    state.SkipWithError("AMX-BF16 is not available on this CPU or OS");
    return;
  }
  const int64_t M = state.range(0), N = state.range(1), K = state.range(2);
  kiln::engine::ThreadPool pool(static_cast<int>(state.range(3)));
  std::vector<uint16_t> x = random_bf16(M * K, 1), w = random_bf16(N * K, 2), y(static_cast<size_t>(M * N));
  const TensorView inputs[] = {{x.data(), DType::bf16, {M, K}, {K, 1}},
                               {w.data(), DType::bf16, {N, K}, {K, 1}}};
  const TensorView outputs[] = {{y.data(), DType::bf16, {M, N}, {N, 1}}};
  kiln::graph::Attrs attrs;
  attrs["transpose_b"] = int64_t{1};
  // Prepared: the weight is fixed at build, so the kernel packs it into AMX tiles once.
  const bool fixed[] = {false, mode == Mode::prepared};
  const auto kernel = kiln::kernels::cpu_kernels().build(
      {kiln::graph::Op::matmul, kiln::DeviceKind::CPU, DType::bf16},
      {kiln::graph::Op::matmul, &attrs, inputs, std::span<const bool>(fixed), nullptr});
  amx::disable_for_testing(mode == Mode::avx512);
  kiln::kernels::KernelContext ctx;
  ctx.parallel = &pool;
  for (auto _ : state) {
    kernel->run(ctx, std::span<const TensorView>(inputs), std::span<const TensorView>(outputs));
    benchmark::DoNotOptimize(y.data());
    benchmark::ClobberMemory();
  }
  amx::disable_for_testing(false);
  set_flops(state, M, N, K);
}

void BM_amx_prepared(benchmark::State& s) { run_kiln(s, Mode::prepared); }
void BM_amx_unprepared(benchmark::State& s) { run_kiln(s, Mode::unprepared); }
void BM_avx512_bf16(benchmark::State& s) { run_kiln(s, Mode::avx512); }

#if defined(KILN_HAVE_DNNL)
// oneDNN's matmul primitive on bf16, weights [N, K] seen as [K, N] (tag ba), created once.
void BM_dnnl_matmul_bf16(benchmark::State& state) {
  using dt = dnnl::memory::data_type;
  using tag = dnnl::memory::format_tag;
  const int64_t M = state.range(0), N = state.range(1), K = state.range(2);
  omp_set_num_threads(static_cast<int>(state.range(3)));
  dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  dnnl::stream stream(engine);
  const dnnl::memory::desc a_md({M, K}, dt::bf16, tag::ab), b_md({K, N}, dt::bf16, tag::ba),
      c_md({M, N}, dt::bf16, tag::ab);
  const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(a_md, b_md, c_md), engine);
  dnnl::matmul prim(pd);
  std::vector<uint16_t> a = random_bf16(M * K, 1), b = random_bf16(N * K, 2), c(static_cast<size_t>(M * N));
  dnnl::memory am(a_md, engine, a.data()), bm(b_md, engine, b.data()), cm(c_md, engine, c.data());
  for (auto _ : state) {
    prim.execute(stream, {{DNNL_ARG_SRC, am}, {DNNL_ARG_WEIGHTS, bm}, {DNNL_ARG_DST, cm}});
    stream.wait();
  }
  set_flops(state, M, N, K);
}
#endif

// M, N, K, threads: prefill-sized products of a 1B-class model, and the square reference.
void shapes(benchmark::internal::Benchmark* b) {
  for (int threads : {1, 2}) {
    b->Args({1024, 1024, 1024, threads});
    b->Args({128, 2048, 8192, threads});
    b->Args({128, 8192, 2048, threads});
    b->Args({512, 2048, 2048, threads});
  }
  b->UseRealTime()->Unit(benchmark::kMillisecond);
}
// Small M, one thread: where AMX starts to pay (amx::kMinRows, kMinRowsUnprepared).
void small_m(benchmark::internal::Benchmark* b) {
  for (int64_t M : {9, 16, 32, 64}) b->Args({M, 2048, 2048, 1});
  b->UseRealTime()->Unit(benchmark::kMillisecond);
}

BENCHMARK(BM_amx_prepared)->Apply(shapes);
BENCHMARK(BM_amx_unprepared)->Apply(shapes);
BENCHMARK(BM_avx512_bf16)->Apply(shapes);
BENCHMARK(BM_amx_prepared)->Name("BM_amx_prepared_small_m")->Apply(small_m);
BENCHMARK(BM_amx_unprepared)->Name("BM_amx_unprepared_small_m")->Apply(small_m);
BENCHMARK(BM_avx512_bf16)->Name("BM_avx512_bf16_small_m")->Apply(small_m);
#if defined(KILN_HAVE_DNNL)
BENCHMARK(BM_dnnl_matmul_bf16)->Apply(shapes);
#endif

}  // namespace

BENCHMARK_MAIN();
