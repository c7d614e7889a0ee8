// Decode GEMV per weight dtype: x f32 [M, K] times a weight [N, K] stored f32, bf16, f16 (matmul with
// transpose_b) or quantized (qmatmul: q8_0, q4_0, q4_k, q5_k, q6_k), as weight bytes streamed per second, beside a plain streaming read
// of the same footprint in the same run (the roofline). Each benchmark cycles through copies of its
// weight totalling >= 1 GiB, so the weights come from DRAM, not the (300 MiB on the Xeon measured) L3;
// KILN_BENCH_WEIGHT_MIB sets that total (1: a single copy, which stays in cache).
// BM_gemm_*: prefill-sized products (M = 128) as GFLOP/s (2 M N K per call).
//
//   build-rel/bench_quantized --benchmark_counters_tabular=true
//   args: M / N / K / threads.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <span>
#include <vector>

#include "engine/cpu/thread_pool.h"
#include "kernels/cpu/kernels.h"
#include "kernels/cpu/quantized.h"
#include "kernels/cpu/scratch.h"
#include "kiln/graph/quantization.h"

namespace {

using kiln::DType;
using kiln::kernels::TensorView;

// KILN_BENCH_WEIGHT_MIB=1 runs each benchmark on one copy (from cache: the kernels' compute rate).
const size_t kFootprint = [] {
  const char* mib = std::getenv("KILN_BENCH_WEIGHT_MIB");
  return mib ? static_cast<size_t>(std::max(1, std::atoi(mib))) << 20 : size_t{1} << 30;
}();

std::vector<float> random_floats(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(-1, 1);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = dist(rng);
  return v;
}

bool quantized(const std::string& format) { return format[0] == 'q'; }

// One weight [N, K] in `format` ("f32", "bf16", "f16", or an encoding: "q8_0", "q4_k", ...) as bytes.
std::vector<uint8_t> weight_bytes(const std::string& format, int64_t N, int64_t K) {
  const std::vector<float> w = random_floats(N * K, 2);
  std::vector<uint8_t> out;
  if (quantized(format)) {
    const kiln::graph::QuantizationEncoding e = kiln::graph::parse_encoding(format);
    const int64_t rb = kiln::graph::quantized_row_bytes(e, K);
    out.resize(static_cast<size_t>(N * rb));
    for (int64_t n = 0; n < N; ++n) kiln::graph::quantize_row(e, w.data() + n * K, K, out.data() + n * rb);
  } else if (format == "f32") {
    out.resize(w.size() * 4);
    std::memcpy(out.data(), w.data(), out.size());
  } else {
    out.resize(w.size() * 2);
    auto* h = reinterpret_cast<uint16_t*>(out.data());
    for (size_t i = 0; i < w.size(); ++i) h[i] = format == "f16" ? kiln::f32_to_f16(w[i]) : kiln::f32_to_bf16(w[i]);
  }
  return out;
}

void gemv(benchmark::State& state, const std::string& format) {
  const int64_t M = state.range(0), N = state.range(1), K = state.range(2);
  kiln::engine::ThreadPool pool(static_cast<int>(state.range(3)));
  const kiln::kernels::KernelContext ctx{&pool};
  const std::vector<uint8_t> one = weight_bytes(format, N, K);
  const size_t copies = std::max<size_t>(1, kFootprint / one.size());
  std::vector<uint8_t> weights(one.size() * copies);
  for (size_t c = 0; c < copies; ++c) std::memcpy(weights.data() + c * one.size(), one.data(), one.size());
  std::vector<float> x = random_floats(M * K, 1), y(static_cast<size_t>(M * N));
  const bool q = quantized(format);
  const DType wd = q ? DType::u8 : kiln::parse_dtype(format);
  kiln::graph::Attrs attrs;
  if (q)
    attrs["encoding"] = format;
  else
    attrs["transpose_b"] = int64_t{1};
  const kiln::graph::Op op = q ? kiln::graph::Op::qmatmul : kiln::graph::Op::matmul;
  const int64_t cols = q ? kiln::graph::quantized_row_bytes(kiln::graph::parse_encoding(format), K) : K;
  std::vector<TensorView> inputs{TensorView{x.data(), DType::f32, {M, K}, {K, 1}},
                                 TensorView{weights.data(), wd, {N, cols}, {cols, 1}}};
  // Built with nothing fixed: the weight copies rotate, so nothing is packed at build.
  const auto kernel = kiln::kernels::cpu_kernels().build({op, kiln::DeviceKind::CPU, DType::f32},
                                                         {op, &attrs, inputs, {}, nullptr});
  const std::vector<TensorView> outputs{TensorView{y.data(), DType::f32, {M, N}, {N, 1}}};
  size_t c = 0;
  for (auto _ : state) {
    inputs[1].data = weights.data() + c * one.size();
    kernel->run(ctx, inputs, outputs);
    benchmark::DoNotOptimize(y.data());
    c = (c + 1) % copies;
  }
  state.counters["weight B/s"] =
      benchmark::Counter(static_cast<double>(one.size()), benchmark::Counter::kIsIterationInvariantRate);
  state.counters["FLOP/s"] =
      benchmark::Counter(2.0 * static_cast<double>(M * N * K), benchmark::Counter::kIsIterationInvariantRate);
}

// f32 / bf16 / f16 weights packed at init into the SIMD GEMM's panels, as every fixed model weight is
// (decode's single row runs the GEMM's loops on them): one kernel per copy, each built with its copy
// fixed, so the panels rotate through >= 1 GiB as the copies do above.
void gemv_packed(benchmark::State& state, const std::string& format) {
  const int64_t M = state.range(0), N = state.range(1), K = state.range(2);
  kiln::engine::ThreadPool pool(static_cast<int>(state.range(3)));
  const kiln::kernels::KernelContext ctx{&pool};
  std::vector<uint8_t> one = weight_bytes(format, N, K);
  const size_t copies = std::max<size_t>(1, kFootprint / one.size());
  std::vector<float> x = random_floats(std::max<int64_t>(M, 64) * K, 1), y(static_cast<size_t>(M * N));
  kiln::graph::Attrs attrs;
  attrs["transpose_b"] = int64_t{1};
  const TensorView w{one.data(), kiln::parse_dtype(format), {N, K}, {K, 1}};
  // Built for a lhs of 64 rows (a shape that packs), run with M.
  const std::vector<TensorView> build_inputs{TensorView{x.data(), DType::f32, {64, K}, {K, 1}}, w};
  const bool fixed[2] = {false, true};
  std::vector<std::unique_ptr<const kiln::kernels::Kernel>> kernels;
  for (size_t c = 0; c < copies; ++c)
    kernels.push_back(kiln::kernels::cpu_kernels().build({kiln::graph::Op::matmul, kiln::DeviceKind::CPU, DType::f32},
                                                         {kiln::graph::Op::matmul, &attrs, build_inputs, fixed, nullptr}));
  const std::vector<TensorView> inputs{TensorView{x.data(), DType::f32, {M, K}, {K, 1}}, w};
  const std::vector<TensorView> outputs{TensorView{y.data(), DType::f32, {M, N}, {N, 1}}};
  size_t c = 0;
  for (auto _ : state) {
    kernels[c]->run(ctx, inputs, outputs);
    benchmark::DoNotOptimize(y.data());
    c = (c + 1) % copies;
  }
  state.counters["weight B/s"] =
      benchmark::Counter(static_cast<double>(one.size()), benchmark::Counter::kIsIterationInvariantRate);
}

void BM_f32(benchmark::State& s) { gemv(s, "f32"); }
void BM_f32_packed(benchmark::State& s) { gemv_packed(s, "f32"); }
void BM_bf16_packed(benchmark::State& s) { gemv_packed(s, "bf16"); }
void BM_bf16(benchmark::State& s) { gemv(s, "bf16"); }
void BM_f16(benchmark::State& s) { gemv(s, "f16"); }
void BM_q8_0(benchmark::State& s) { gemv(s, "q8_0"); }
void BM_q4_0(benchmark::State& s) { gemv(s, "q4_0"); }
void BM_q4_k(benchmark::State& s) { gemv(s, "q4_k"); }
void BM_q5_k(benchmark::State& s) { gemv(s, "q5_k"); }
void BM_q6_k(benchmark::State& s) { gemv(s, "q6_k"); }

// Q8_0 on its packed GEMM panels, Q4_K and Q6_K on their nibble panels (what a fixed weight runs on where VNNI
// or AVX2 is), every copy packed ahead; skipped without the kernels.
void packed(benchmark::State& state, kiln::graph::QuantizationEncoding e) {
  namespace q = kiln::kernels::quantized;
  const bool k_quant = e != kiln::graph::QuantizationEncoding::q8_0;
  const bool vnni = __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw");
  const q::Q8_0PackFn pack = !vnni   ? (!__builtin_cpu_supports("avx2") ? nullptr
                                        : k_quant                         ? q::avx2_k_pack(e)
                                                                          : q::avx2_q8_0_pack())
                             : k_quant ? q::avx512_vnni_k_pack(e)
                                       : q::avx512_vnni_q8_0_pack();
  if (!pack) {
    state.SkipWithError("no panels for this format on this CPU");
    return;
  }
  const int64_t M = state.range(0), N = state.range(1), K = state.range(2);
  kiln::engine::ThreadPool pool(static_cast<int>(state.range(3)));
  const kiln::kernels::KernelContext ctx{&pool};
  const std::vector<uint8_t> one = weight_bytes(std::string(kiln::graph::encoding_name(e)), N, K);
  const int64_t panel_bytes =
      (N + q::kGemmRows - 1) / q::kGemmRows * q::packed_panel_bytes(e, K);
  const size_t copies = std::max<size_t>(1, kFootprint / static_cast<size_t>(panel_bytes));
  kiln::kernels::AlignedScratch<uint8_t> panels;
  uint8_t* base = panels.get(copies * static_cast<size_t>(panel_bytes));
  for (size_t c = 0; c < copies; ++c)
    pack(one.data(), kiln::graph::quantized_row_bytes(e, K), N, K, base + c * static_cast<size_t>(panel_bytes));
  std::vector<float> x = random_floats(M * K, 1), y(static_cast<size_t>(M * N));
  const TensorView lhs{x.data(), DType::f32, {M, K}, {K, 1}};
  size_t c = 0;
  for (auto _ : state) {
    const q::PackedTarget target{base + c * static_cast<size_t>(panel_bytes), N, y.data()};
    q::packed_gemm_group(ctx, e, lhs, std::span(&target, 1));
    benchmark::DoNotOptimize(y.data());
    c = (c + 1) % copies;
  }
  state.counters["weight B/s"] =
      benchmark::Counter(static_cast<double>(panel_bytes), benchmark::Counter::kIsIterationInvariantRate);
  state.counters["FLOP/s"] =
      benchmark::Counter(2.0 * static_cast<double>(M * N * K), benchmark::Counter::kIsIterationInvariantRate);
}
void BM_q8_0_packed(benchmark::State& s) { packed(s, kiln::graph::QuantizationEncoding::q8_0); }
void BM_q4_k_packed(benchmark::State& s) { packed(s, kiln::graph::QuantizationEncoding::q4_k); }
void BM_q6_k_packed(benchmark::State& s) { packed(s, kiln::graph::QuantizationEncoding::q6_k); }

// The roofline: each thread reads its share of a chunk (16 MiB per iteration, cycling through 1 GiB)
// as 4 interleaved streams (as the GEMVs read 2-4 weight rows at once), summing 64-byte vectors;
// args: threads.
void BM_stream_read(benchmark::State& state) {
  typedef uint64_t V __attribute__((vector_size(64)));
  kiln::engine::ThreadPool pool(static_cast<int>(state.range(0)));
  std::vector<uint64_t> data(kFootprint / 8, 1);
  constexpr size_t kChunk = size_t{16} << 20, kPiece = 64 << 10;  // bytes; each task reads one piece
  size_t offset = 0;
  for (auto _ : state) {
    const char* base = reinterpret_cast<const char*>(data.data()) + offset;
    pool.for_range(static_cast<int64_t>(kChunk / kPiece), 1, [&](int64_t begin, int64_t end) {
      V acc[4] = {};
      for (int64_t t = begin; t < end; ++t) {
        const char* piece = base + t * kPiece;
        for (size_t i = 0; i < kPiece / 4; i += 64)
          for (int s = 0; s < 4; ++s) {
            V v;
            std::memcpy(&v, piece + s * (kPiece / 4) + i, sizeof(V));
            acc[s] += v;
          }
      }
      benchmark::DoNotOptimize(acc);
    });
    offset = (offset + kChunk) % kFootprint;
  }
  state.counters["B/s"] = benchmark::Counter(static_cast<double>(kChunk), benchmark::Counter::kIsIterationInvariantRate);
}

// llama-1B's projections (down 2048 x 8192, gate/up 8192 x 2048, q/o 2048 x 2048) and stories110M's
// (768 x 768); M = 8 is a small batch of decode rows.
void shapes(benchmark::internal::Benchmark* b) {
  for (int threads : {1, 2}) {
    b->Args({1, 2048, 8192, threads});
    b->Args({1, 8192, 2048, threads});
    b->Args({1, 2048, 2048, threads});
    b->Args({1, 768, 768, threads});
    b->Args({2, 2048, 8192, threads});
    b->Args({8, 2048, 8192, threads});
    b->Args({16, 2048, 8192, threads});
  }
  b->UseRealTime();
}

void gemm_shapes(benchmark::internal::Benchmark* b) {
  for (int threads : {1, 2}) b->Args({128, 2048, 8192, threads});
  b->UseRealTime();
}

BENCHMARK(BM_stream_read)->Arg(1)->Arg(2)->UseRealTime();
BENCHMARK(BM_f32)->Apply(shapes);
BENCHMARK(BM_bf16)->Apply(shapes);
BENCHMARK(BM_f32_packed)->Apply(shapes);
BENCHMARK(BM_bf16_packed)->Apply(shapes);
BENCHMARK(BM_f16)->Apply(shapes);
BENCHMARK(BM_q8_0)->Apply(shapes);
BENCHMARK(BM_q8_0_packed)->Apply(shapes);
BENCHMARK(BM_q4_0)->Apply(shapes);
BENCHMARK(BM_q4_k)->Apply(shapes);
BENCHMARK(BM_q4_k_packed)->Apply(shapes);
BENCHMARK(BM_q5_k)->Apply(shapes);
BENCHMARK(BM_q6_k)->Apply(shapes);
BENCHMARK(BM_q6_k_packed)->Apply(shapes);
BENCHMARK(BM_f32)->Name("BM_gemm_f32")->Apply(gemm_shapes);
BENCHMARK(BM_q8_0)->Name("BM_gemm_q8_0")->Apply(gemm_shapes);
BENCHMARK(BM_q4_k)->Name("BM_gemm_q4_k")->Apply(gemm_shapes);
BENCHMARK(BM_q6_k)->Name("BM_gemm_q6_k")->Apply(gemm_shapes);
BENCHMARK(BM_q8_0_packed)->Name("BM_gemm_q8_0_packed")->Apply(gemm_shapes);
BENCHMARK(BM_q4_k_packed)->Name("BM_gemm_q4_k_packed")->Apply(gemm_shapes);
BENCHMARK(BM_q6_k_packed)->Name("BM_gemm_q6_k_packed")->Apply(gemm_shapes);

}  // namespace

BENCHMARK_MAIN();
