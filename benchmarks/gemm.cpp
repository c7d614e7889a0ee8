// kiln's matmul kernel (the SIMD GEMM / GEMV of src/kernels/cpu/gemm.h) beside oneDNN, in one run.
// Counters: FLOP/s (2 M N K per call) and, for small M, the weight bytes streamed per second.
// Weights are [N, K] read with transpose_b (nn::Linear's layout) unless the name says kn.
//
//   build/bench_gemm --benchmark_filter='1024' --benchmark_counters_tabular=true
//   args: M / N / K / threads. oneDNN runs with as many OpenMP threads.
#include <benchmark/benchmark.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "engine/cpu/thread_pool.h"
#include "kernels/cpu/gemm.h"
#include "kernels/cpu/kernels.h"

#if defined(KILN_HAVE_DNNL)
#include <omp.h>

#include <dnnl.h>
#include <dnnl.hpp>
#endif

namespace {

using kiln::DType;
using kiln::kernels::TensorView;

// Random values in [-1, 1), stored as `dtype`.
std::vector<uint8_t> random_bytes(DType dtype, int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(-1, 1);
  std::vector<uint8_t> bytes(static_cast<size_t>(n) * kiln::dtype_size(dtype));
  for (int64_t i = 0; i < n; ++i) {
    const float v = dist(rng);
    if (dtype == DType::f32) {
      reinterpret_cast<float*>(bytes.data())[i] = v;
    } else {
      const uint16_t h = dtype == DType::f16 ? kiln::f32_to_f16(v) : kiln::f32_to_bf16(v);
      reinterpret_cast<uint16_t*>(bytes.data())[i] = h;
    }
  }
  return bytes;
}

void set_counters(benchmark::State& state, int64_t M, int64_t N, int64_t K, size_t weight_bytes) {
  state.counters["FLOP/s"] = benchmark::Counter(2.0 * M * N * K, benchmark::Counter::kIsIterationInvariantRate);
  if (M <= 8)
    state.counters["weight B/s"] =
        benchmark::Counter(static_cast<double>(weight_bytes), benchmark::Counter::kIsIterationInvariantRate);
}

// kiln: x [M, K] . w^T, w stored [N, K] (transpose_b), or w [K, N] when `kn`.
void run_kiln(benchmark::State& state, DType dtype, bool kn, std::optional<kiln::kernels::gemm::Isa> isa = {}) {
  namespace gemm = kiln::kernels::gemm;
  if (isa && !gemm::isa_supported(*isa)) {
    state.SkipWithError("ISA level not supported on this CPU");
    return;
  }
  gemm::force_isa_for_testing(isa);
  const int64_t M = state.range(0), N = state.range(1), K = state.range(2);
  const int threads = static_cast<int>(state.range(3));
  kiln::engine::ThreadPool pool(threads);
  std::vector<uint8_t> x = random_bytes(dtype, M * K, 1), w = random_bytes(dtype, N * K, 2),
                       y(static_cast<size_t>(M * N) * kiln::dtype_size(dtype));
  const TensorView xv{x.data(), dtype, {M, K}, {K, 1}};
  const TensorView wv = kn ? TensorView{w.data(), dtype, {K, N}, {N, 1}} : TensorView{w.data(), dtype, {N, K}, {K, 1}};
  const TensorView yv{y.data(), dtype, {M, N}, {N, 1}};
  kiln::graph::Attrs attrs;
  if (!kn) attrs["transpose_b"] = int64_t{1};
  const TensorView inputs[] = {xv, wv};
  const TensorView outputs[] = {yv};
  const auto kernel = kiln::kernels::cpu_kernels().build({kiln::graph::Op::matmul, kiln::DeviceKind::CPU, dtype},
                                                         {kiln::graph::Op::matmul, &attrs, inputs, {}, nullptr});
  kiln::kernels::KernelContext ctx;
  ctx.parallel = &pool;
  for (auto _ : state) {
    kernel->run(ctx, std::span<const TensorView>(inputs), std::span<const TensorView>(outputs));
    benchmark::DoNotOptimize(y.data());
    benchmark::ClobberMemory();
  }
  set_counters(state, M, N, K, w.size());
  state.SetLabel(gemm::isa_name(gemm::active_isa()));
  gemm::force_isa_for_testing(std::nullopt);
}

void BM_kiln_f32(benchmark::State& s) { run_kiln(s, DType::f32, false); }
void BM_kiln_f32_kn(benchmark::State& s) { run_kiln(s, DType::f32, true); }
void BM_kiln_bf16(benchmark::State& s) { run_kiln(s, DType::bf16, false); }
void BM_kiln_f16(benchmark::State& s) { run_kiln(s, DType::f16, false); }
// bf16 on each AVX-512 kernel: vdpbf16ps products, or widened to f32 in registers and FMA.
void BM_kiln_bf16_dot(benchmark::State& s) { run_kiln(s, DType::bf16, false, kiln::kernels::gemm::Isa::avx512_bf16); }
void BM_kiln_bf16_widened(benchmark::State& s) { run_kiln(s, DType::bf16, false, kiln::kernels::gemm::Isa::avx512); }

#if defined(KILN_HAVE_DNNL)
// oneDNN's BLAS-style sgemm, row-major, B transposed like kiln's weights.
void BM_dnnl_sgemm(benchmark::State& state) {
  const int64_t M = state.range(0), N = state.range(1), K = state.range(2);
  omp_set_num_threads(static_cast<int>(state.range(3)));
  std::vector<uint8_t> a = random_bytes(DType::f32, M * K, 1), b = random_bytes(DType::f32, N * K, 2);
  std::vector<float> c(static_cast<size_t>(M * N));
  for (auto _ : state) {
    dnnl_sgemm('N', 'T', M, N, K, 1.0f, reinterpret_cast<const float*>(a.data()), K,
               reinterpret_cast<const float*>(b.data()), K, 0.0f, c.data(), N);
    benchmark::DoNotOptimize(c.data());
  }
  set_counters(state, M, N, K, b.size());
}

// oneDNN's matmul primitive (what PyTorch calls for bf16), weights [N, K] seen as [K, N] (tag ba),
// created once outside the loop.
void run_dnnl_matmul(benchmark::State& state, DType dtype) {
  using dt = dnnl::memory::data_type;
  using tag = dnnl::memory::format_tag;
  const int64_t M = state.range(0), N = state.range(1), K = state.range(2);
  omp_set_num_threads(static_cast<int>(state.range(3)));
  const dt t = dtype == DType::f32 ? dt::f32 : dt::bf16;
  dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  dnnl::stream stream(engine);
  const dnnl::memory::desc a_md({M, K}, t, tag::ab), b_md({K, N}, t, tag::ba), c_md({M, N}, t, tag::ab);
  const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(a_md, b_md, c_md), engine);
  dnnl::matmul prim(pd);
  std::vector<uint8_t> a = random_bytes(dtype, M * K, 1), b = random_bytes(dtype, N * K, 2),
                       c(static_cast<size_t>(M * N) * kiln::dtype_size(dtype));
  dnnl::memory am(a_md, engine, a.data()), bm(b_md, engine, b.data()), cm(c_md, engine, c.data());
  for (auto _ : state) {
    prim.execute(stream, {{DNNL_ARG_SRC, am}, {DNNL_ARG_WEIGHTS, bm}, {DNNL_ARG_DST, cm}});
    stream.wait();
  }
  set_counters(state, M, N, K, b.size());
}
void BM_dnnl_matmul_f32(benchmark::State& s) { run_dnnl_matmul(s, DType::f32); }
void BM_dnnl_matmul_bf16(benchmark::State& s) { run_dnnl_matmul(s, DType::bf16); }
#endif

// M, N, K, threads.
void shapes(benchmark::internal::Benchmark* b) {
  for (int threads : {1, 2}) {
    b->Args({1024, 1024, 1024, threads});
    b->Args({128, 4096, 4096, threads});
    b->Args({8, 4096, 4096, threads});
    b->Args({1, 4096, 4096, threads});
  }
  b->UseRealTime()->Unit(benchmark::kMillisecond);
}
// 4096^3 takes a second per call: only with --benchmark_filter=4096x4096x4096 style filters.
void large(benchmark::internal::Benchmark* b) {
  for (int threads : {1, 2}) b->Args({4096, 4096, 4096, threads});
  b->UseRealTime()->Unit(benchmark::kMillisecond)->Iterations(3);
}

BENCHMARK(BM_kiln_f32)->Apply(shapes);
BENCHMARK(BM_kiln_f32_kn)->Args({1024, 1024, 1024, 1})->Args({1024, 1024, 1024, 2})->Args({1, 4096, 4096, 2})
    ->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_kiln_bf16)->Apply(shapes);
BENCHMARK(BM_kiln_f16)->Apply(shapes);
BENCHMARK(BM_kiln_bf16_dot)->Apply(shapes);
BENCHMARK(BM_kiln_bf16_widened)->Apply(shapes);
BENCHMARK(BM_kiln_f32)->Name("BM_kiln_f32_large")->Apply(large);
BENCHMARK(BM_kiln_bf16)->Name("BM_kiln_bf16_large")->Apply(large);
#if defined(KILN_HAVE_DNNL)
BENCHMARK(BM_dnnl_sgemm)->Apply(shapes);
BENCHMARK(BM_dnnl_matmul_f32)->Apply(shapes);
BENCHMARK(BM_dnnl_matmul_bf16)->Apply(shapes);
BENCHMARK(BM_dnnl_sgemm)->Name("BM_dnnl_sgemm_large")->Apply(large);
BENCHMARK(BM_dnnl_matmul_bf16)->Name("BM_dnnl_matmul_bf16_large")->Apply(large);
#endif

}  // namespace

BENCHMARK_MAIN();
