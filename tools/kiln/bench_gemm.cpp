// `kiln bench gemm`: GFLOP/s of a one-matmul kiln graph beside oneDNN's matmul (when built with it),
// both checked against a double-precision reference, and beside the machine's peak. With --weights:
// f32 activations against an f32 / f16 / bf16 / Q8_0 weight (a model's projection), reported as the
// weight bytes read per second, the figure decode (small M, bound by memory) is judged by.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>

#include "bench.h"
#include "bench_internal.h"
#include "kiln/engine/session.h"
#include "kiln/errors.h"
#include "kiln/graph/graph.h"
#include "kiln/graph/ops.h"
#include "kiln/graph/quantization.h"
#include "kiln/kernels/cpu_probes.h"

#ifdef KILN_HAVE_ONEDNN
#include <oneapi/dnnl/dnnl.hpp>
#if DNNL_CPU_THREADING_RUNTIME == DNNL_RUNTIME_OMP
#include <omp.h>
#endif
#endif

namespace kiln::bench {

namespace {

// Repeats fn (after one warm-up) until min_seconds have passed and at least 3 runs; the best run.
struct Timing {
  double best_seconds;
  int runs;
};
template <class F>
Timing time_best(F&& fn, double min_seconds) {
  fn();
  Timing t{std::numeric_limits<double>::infinity(), 0};
  const auto start = Clock::now();
  while (t.runs < 3 || (seconds_since(start) < min_seconds && t.runs < 100000)) {
    const auto run_start = Clock::now();
    fn();
    t.best_seconds = std::min(t.best_seconds, seconds_since(run_start));
    ++t.runs;
  }
  return t;
}

// Row-major values uniform in [-1, 1), rounded to `dtype`; `values` holds them as f32 (exact).
Tensor random_matrix(DType dtype, int64_t rows, int64_t cols, uint64_t seed, std::vector<float>& values) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  values.resize(static_cast<size_t>(rows * cols));
  Tensor t = Tensor::empty(dtype, {rows, cols});
  for (size_t i = 0; i < values.size(); ++i) {
    if (dtype == DType::bf16) {
      const bf16_t v(uniform(rng));
      t.data_as<bf16_t>()[i] = v;
      values[i] = static_cast<float>(v);
    } else if (dtype == DType::f16) {
      const f16_t v(uniform(rng));
      t.data_as<f16_t>()[i] = v;
      values[i] = static_cast<float>(v);
    } else {
      values[i] = uniform(rng);
      t.data_as<float>()[i] = values[i];
    }
  }
  return t;
}

// W [N, K] as quantized rows u8 [N, row bytes]; `values` becomes the dequantized weights.
Tensor quantized_matrix(graph::QuantizationEncoding e, int64_t rows, int64_t cols, uint64_t seed,
                        std::vector<float>& values) {
  random_matrix(DType::f32, rows, cols, seed, values);
  const int64_t row_bytes = graph::quantized_row_bytes(e, cols);
  Tensor t = Tensor::empty(DType::u8, {rows, row_bytes});
  for (int64_t r = 0; r < rows; ++r) {
    uint8_t* row = t.data_as<uint8_t>() + r * row_bytes;
    graph::quantize_row(e, values.data() + r * cols, cols, row);
    graph::dequantize_row(e, row, cols, values.data() + r * cols);
  }
  return t;
}

float element_as_float(const void* data, DType dtype, int64_t i) {
  return dtype == DType::bf16 ? static_cast<float>(static_cast<const bf16_t*>(data)[i])
                              : static_cast<const float*>(data)[i];
}

// C [M, N] against sum_k A[m, k] W[n, k] in double at sampled entries; the tolerance scales with
// sum_k |A W| (f32 accumulation, and for bf16 a result rounded to 8 bits of mantissa).
void check_gemm(std::string_view who, const GemmBenchOptions& o, const std::vector<float>& a,
                const std::vector<float>& w, const void* c) {
  // A quantized format also quantizes the activations (to 8 bits per block of 32 or 256).
  const bool quantized = o.weights && nn::weight_format_encoding(*o.weights);
  // bf16 weights above 8 rows round the activations to bf16 (AMX, the bf16 dot GEMM): 2^-9 each.
  const bool bf16_weights = o.weights && nn::weight_format_dtype(*o.weights) == DType::bf16;
  const double rel_tol = quantized ? 2e-2 : o.dtype == DType::bf16 ? 1e-2 : bf16_weights ? 4e-3 : 1e-4;
  std::mt19937_64 rng(7);
  for (int sample = 0; sample < 64; ++sample) {
    const auto m = static_cast<int64_t>(rng() % static_cast<uint64_t>(o.m));
    const auto n = static_cast<int64_t>(rng() % static_cast<uint64_t>(o.n));
    double expected = 0, magnitude = 0;
    for (int64_t k = 0; k < o.k; ++k) {
      const double p = double(a[static_cast<size_t>(m * o.k + k)]) * w[static_cast<size_t>(n * o.k + k)];
      expected += p;
      magnitude += std::abs(p);
    }
    const double got = element_as_float(c, o.dtype, m * o.n + n);
    if (!(std::abs(got - expected) <= rel_tol * magnitude + 1e-6))
      throw ExecutionError(fmt::format("kiln bench gemm: {}'s result at [{}, {}] is {}, expected {} (+- {})",
                                       who, m, n, got, expected, rel_tol * magnitude));
  }
}

#ifdef KILN_HAVE_ONEDNN
double onednn_gemm_seconds(const GemmBenchOptions& o, const Tensor& a, const Tensor& w,
                           const std::vector<float>& a_values, const std::vector<float>& w_values) {
#if DNNL_CPU_THREADING_RUNTIME == DNNL_RUNTIME_OMP
  omp_set_num_threads(o.threads);  // before the primitive is created: it fixes its thread count then
#endif
  using dnnl::memory;
  const memory::data_type dt = o.dtype == DType::bf16 ? memory::data_type::bf16 : memory::data_type::f32;
  dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  dnnl::stream stream(engine);
  // Logical W^T [K, N] stored as W [N, K] ("ba"): the same bytes kiln's transpose_b reads.
  memory::desc a_md({o.m, o.k}, dt, memory::format_tag::ab);
  memory::desc w_md({o.k, o.n}, dt, memory::format_tag::ba);
  memory::desc c_md({o.m, o.n}, dt, memory::format_tag::ab);
#if DNNL_VERSION_MAJOR >= 3
  dnnl::matmul::primitive_desc pd(engine, a_md, w_md, c_md);
#else
  dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(a_md, w_md, c_md), engine);
#endif
  dnnl::matmul matmul(pd);
  memory a_mem(a_md, engine, const_cast<void*>(a.data()));
  memory w_mem(w_md, engine, const_cast<void*>(w.data()));
  memory c_mem(c_md, engine);
  auto run = [&] {
    matmul.execute(stream, {{DNNL_ARG_SRC, a_mem}, {DNNL_ARG_WEIGHTS, w_mem}, {DNNL_ARG_DST, c_mem}});
    stream.wait();
  };
  const Timing t = time_best(run, o.min_seconds);
  check_gemm("oneDNN", o, a_values, w_values, c_mem.get_data_handle());
  return t.best_seconds;
}
#endif

}  // namespace

std::string onednn_description() {
#ifdef KILN_HAVE_ONEDNN
  const dnnl_version_t* v = dnnl_version();
  const char* runtime = v->cpu_runtime == DNNL_RUNTIME_OMP   ? "OpenMP"
                        : v->cpu_runtime == DNNL_RUNTIME_TBB ? "TBB"
                                                             : "other";
  return fmt::format("oneDNN {}.{}.{} ({})", v->major, v->minor, v->patch, runtime);
#else
  return "oneDNN: not available";
#endif
}

GemmBenchResult bench_gemm(const GemmBenchOptions& o) {
  if (o.m < 1 || o.n < 1 || o.k < 1)
    throw ValueError(fmt::format("kiln bench gemm: M, N, K must be >= 1, got {} x {} x {}", o.m, o.n, o.k));
  if (o.dtype != DType::f32 && o.dtype != DType::bf16)
    throw ValueError(fmt::format("kiln bench gemm: dtype must be f32 or bf16, got {}", dtype_name(o.dtype)));
  if (o.weights && o.dtype != DType::f32)
    throw ValueError("kiln bench gemm: a weight format runs with f32 activations");
  // A plain flag and value, not an optional: GCC 12 warns (maybe-uninitialized) on an optional enum.
  const bool quantized = o.weights && nn::weight_format_encoding(*o.weights);
  const graph::QuantizationEncoding encoding =
      quantized ? *nn::weight_format_encoding(*o.weights) : graph::QuantizationEncoding::q8_0;
  if (quantized && o.k % graph::block_size(encoding) != 0)
    throw ValueError(fmt::format("kiln bench gemm: {} needs K a multiple of {}, got {}", graph::encoding_name(encoding),
                                 graph::block_size(encoding), o.k));
  if (o.threads < 1)
    throw ValueError(fmt::format("kiln bench gemm: threads must be >= 1, got {}", o.threads));

  const DType w_dtype = o.weights ? nn::weight_format_dtype(*o.weights).value_or(DType::u8) : o.dtype;
  // Bytes of one weight row as stored (quantized rows: their blocks).
  const int64_t row_bytes =
      quantized ? graph::quantized_row_bytes(encoding, o.k) : o.k * static_cast<int64_t>(dtype_size(w_dtype));
  std::vector<float> a_values, w_values;
  const Tensor a = random_matrix(o.dtype, o.m, o.k, 1, a_values);  // [M, K]
  // [N, K], as nn::Linear's weight (quantized: [N, row bytes])
  const Tensor w =
      quantized ? quantized_matrix(encoding, o.n, o.k, 2, w_values) : random_matrix(w_dtype, o.n, o.k, 2, w_values);

  graph::Graph g("gemm", {graph::TensorType{o.dtype, {o.m, o.k}}});
  {
    graph::Graph::Scope scope(g);
    graph::TensorValue x = g.input(0);  // [M, K]
    if (quantized) {
      graph::TensorValue weight = g.weight({"w", DType::u8, {o.n, row_bytes}});
      g.output({graph::ops::qmatmul(encoding, x, weight)});  // [M, N]
    } else {
      graph::TensorValue weight = g.weight({"w", w_dtype, {o.n, o.k}});        // [N, K]
      g.output({graph::ops::matmul(x, graph::ops::transpose(weight, 0, 1))});  // [M, N]
    }
  }
  engine::InferenceSession session({DeviceRef::CPU()}, {}, engine::SessionOptions{.num_threads = o.threads});
  engine::Model model = session.load(g, {{"w", w}});
  std::vector<Tensor> out;
  const Timing t = time_best([&] { out = model.execute({a}); }, o.min_seconds);
  check_gemm("kiln", o, a_values, w_values, out.at(0).data());

  GemmBenchResult r;
  r.m = o.m;
  r.n = o.n;
  r.k = o.k;
  r.dtype = o.dtype;
  r.weights = o.weights;
  r.threads = o.threads;
  r.weight_bytes = o.n * row_bytes;
  r.repetitions = t.runs;
  r.seconds = t.best_seconds;
  const double flop = 2.0 * static_cast<double>(o.m) * static_cast<double>(o.n) * static_cast<double>(o.k);
  r.gflops = flop / t.best_seconds * 1e-9;
  r.weight_gb_per_s = static_cast<double>(r.weight_bytes) / t.best_seconds * 1e-9;
  // The peak before oneDNN runs and after, the higher counting: oneDNN's OpenMP threads keep spinning
  // for a while after its last call, and a peak measured beside them read half the machine's.
  r.peak_gflops = measure_peak_gflops(o.threads, 200, o.dtype);
#ifdef KILN_HAVE_ONEDNN
  if (!o.weights) {
    // Debian's oneDNN has no bf16 matmul for a CPU without AVX-512 (it cannot create the primitive):
    // then there is no oneDNN figure to stand beside kiln's, and the report says n/a.
    try {
      r.onednn_gflops = flop / onednn_gemm_seconds(o, a, w, a_values, w_values) * 1e-9;
      r.peak_gflops = std::max(r.peak_gflops, measure_peak_gflops(o.threads, 200, o.dtype));
    } catch (const dnnl::error& e) {
      r.onednn_note = fmt::format("oneDNN cannot run this product here: {}", e.what());
    }
  }
#endif
  // bf16 x bf16, and bf16 weights above 8 rows where the GEMM multiplies them in bf16 (gemm.h).
  const bool dot_weights = o.weights && nn::weight_format_dtype(*o.weights) == DType::bf16 && o.m > 8 &&
                           kernels::gemm_uses_bf16_dot();
  if ((o.dtype == DType::bf16 || dot_weights) && kernels::bf16_dot_supported())
    r.bf16_dot_peak_gflops = measure_bf16_dot_peak_gflops(o.threads);
  return r;
}

}  // namespace kiln::bench
