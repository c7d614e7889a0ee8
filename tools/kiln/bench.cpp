// `kiln bench`: model tokens/s against the bandwidth roofline, GEMM GFLOP/s against oneDNN, and the
// machine's streaming read bandwidth, all measured in the same run (shared machines drift between runs).
#include "bench.h"

#include <fmt/format.h>
#include <immintrin.h>
#include <sys/mman.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <barrier>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <limits>
#include <map>
#include <random>
#include <thread>

#include "kernels/cpu/gemm.h"
#include "kernels/cpu/gemm_amx.h"
#include "kiln/engine/session.h"
#include "kiln/errors.h"
#include "kiln/graph/graph.h"
#include "kiln/graph/ops.h"
#include "kiln/pipelines/hf_config.h"
#include "kiln/pipelines/text_generation.h"

#ifdef KILN_HAVE_ONEDNN
#include <oneapi/dnnl/dnnl.hpp>
#if DNNL_CPU_THREADING_RUNTIME == DNNL_RUNTIME_OMP
#include <omp.h>
#endif
#endif

namespace kiln::bench {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

int resolve_threads(int threads) {
  if (threads < 0) throw ValueError(fmt::format("kiln bench: --threads must be >= 0, got {}", threads));
  return threads == 0 ? static_cast<int>(std::max(1u, std::thread::hardware_concurrency())) : threads;
}

std::string join(const std::vector<std::string>& names) {
  std::string out;
  for (const auto& n : names) out += (out.empty() ? "" : ", ") + n;
  return out;
}

}  // namespace

// ==== weight formats and the bytes a decode step reads ================================================

double bytes_per_weight(WeightFormat format) {
  switch (format) {
    case WeightFormat::f32:
      return 4.0;
    case WeightFormat::f16:
    case WeightFormat::bf16:
      return 2.0;
    case WeightFormat::q8_0:
      return 34.0 / 32.0;  // 32 int8 + one f16 scale
  }
  return 0;
}

int64_t parameter_count(const nn::LlamaConfig& config) {
  int64_t total = 0;
  for (const auto& [name, decl] : nn::Transformer(config, 1).raw_state_dict())
    total += *decl.shape.static_num_elements();
  return total;
}

double decode_weight_bytes(const nn::LlamaConfig& config, WeightFormat format) {
  const double matrix_bytes = bytes_per_weight(format);
  double total = 0;
  for (const auto& [name, decl] : nn::Transformer(config, 1).raw_state_dict()) {
    const auto numel = static_cast<double>(*decl.shape.static_num_elements());
    if (name.ends_with("norm.weight")) {
      total += 4.0 * numel;
    } else if (name == "model.embed_tokens.weight") {
      const auto hidden = static_cast<double>(config.hidden_size);
      total += matrix_bytes * hidden;                                 // the new token's row
      if (config.tie_word_embeddings) total += matrix_bytes * numel;  // read whole as the lm_head
    } else {
      total += matrix_bytes * numel;
    }
  }
  return total;
}

double roofline_tokens_per_s(double weight_bytes_per_token, double read_bytes_per_s) {
  if (!(weight_bytes_per_token > 0))
    throw ValueError(
        fmt::format("roofline: weight bytes per token must be > 0, got {}", weight_bytes_per_token));
  return read_bytes_per_s / weight_bytes_per_token;
}

// ==== streaming read bandwidth ===========================================================================

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

// ==== f32 multiply-add peak =============================================================================

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
  static const auto kernel = __builtin_cpu_supports("avx512f")                                   ? fma_chains_avx512
                             : __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") ? fma_chains_avx2
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
        case PeakUnit::amx_tiles: flop = kernels::amx::run_tile_chains(kPeakIterations / 16); break;
        case PeakUnit::bf16_dot:
          sink.store(dpbf16_chains_avx512(kPeakIterations), std::memory_order_relaxed);
          flop = 4.0 * 16 * kChains * static_cast<double>(kPeakIterations);
          break;
        case PeakUnit::fma: flop = run_fma_chains(kPeakIterations, sink); break;
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
  if (dtype == DType::bf16 && kernels::amx::available()) return measure_peak(threads, passes, PeakUnit::amx_tiles);
  if (dtype == DType::bf16 && kernels::gemm::best_isa() == kernels::gemm::Isa::avx512_bf16)
    return measure_peak(threads, passes, PeakUnit::bf16_dot);
  return measure_peak(threads, passes, PeakUnit::fma);
}

double measure_bf16_dot_peak_gflops(int threads, int passes) {
  if (!kernels::gemm::isa_supported(kernels::gemm::Isa::avx512_bf16))
    throw ValueError("peak: this CPU has no AVX512_BF16 (vdpbf16ps)");
  return measure_peak(threads, passes, PeakUnit::bf16_dot);
}

// ==== model benchmark ======================================================================================

nn::LlamaConfig resolve_model_config(const std::string& model) {
  if (auto named = pipelines::named_config(model)) return *named;
  if (std::filesystem::is_directory(model)) return pipelines::load_model_info(model).config;
  throw ValueError(fmt::format("kiln bench: unknown model '{}': give a model directory or one of {}", model,
                               join(pipelines::named_config_names())));
}

namespace {

void check_model_options(const ModelBenchOptions& o) {
  if (o.prompt_tokens < 1)
    throw ValueError(fmt::format("kiln bench: --prompt-tokens must be >= 1, got {}", o.prompt_tokens));
  if (o.gen_tokens < 1)
    throw ValueError(fmt::format("kiln bench: --gen-tokens must be >= 1, got {}", o.gen_tokens));
  if (o.repetitions < 1)
    throw ValueError(fmt::format("kiln bench: --repetitions must be >= 1, got {}", o.repetitions));
  if (o.threads < 1) throw ValueError(fmt::format("kiln bench: threads must be >= 1, got {}", o.threads));
}

// The dtype random weights are drawn in: the format's own (no conversion at load), f32 for q8_0
// (quantized at load, as a user's checkpoint would be).
DType random_weight_dtype(WeightFormat format) { return nn::weight_format_dtype(format).value_or(DType::f32); }

}  // namespace

namespace {

// The read bandwidth `r` is measured against, and its roofline.
void set_bandwidth(ModelBenchResult& r, double read_bytes_per_s) {
  r.read_bytes_per_s = read_bytes_per_s;
  r.roofline_tokens_per_s = roofline_tokens_per_s(r.weight_bytes_per_token, read_bytes_per_s);
  r.roofline_fraction = r.decode_tokens_per_s / r.roofline_tokens_per_s;
}

// One more generation, every graph profiled from its first new token on: each op's share of a
// decode step, the graphs' own work outside their kernels, and the pipeline's between graphs.
std::vector<DecodeProfileEntry> profile_decode(pipelines::TextGenerationPipeline& pipe,
                                               const std::vector<int64_t>& prompt,
                                               const pipelines::GenerationOptions& gen) {
  const auto& models = pipe.models();
  std::chrono::steady_clock::time_point decode_start;
  int64_t tokens = 0;
  pipe.generate_ids(prompt, gen, [&](int64_t) {
    if (tokens++ == 0) {  // prefill has just sampled the first token
      for (const auto& [name, model] : models) model.start_profiling();
      decode_start = std::chrono::steady_clock::now();
    }
  });
  const double decode_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - decode_start).count();
  const auto steps = static_cast<double>(std::max<int64_t>(1, tokens - 1));
  std::vector<DecodeProfileEntry> entries;
  double in_graphs = 0;
  for (const auto& [name, model] : models) {
    model.stop_profiling();
    const engine::ModelProfile p = model.profile();
    if (p.runs == 0) continue;
    std::map<std::string, std::pair<int64_t, double>> by_op;  // launches, seconds
    double in_kernels = 0;
    for (const engine::StepProfile& step : p.steps) {
      by_op[step.op].first += step.launches;
      by_op[step.op].second += step.seconds;
      in_kernels += step.seconds;
    }
    for (const auto& [op, totals] : by_op)
      entries.push_back({name, op, static_cast<double>(totals.first) / steps, totals.second / steps, 0});
    entries.push_back({name, "(run)", static_cast<double>(p.runs) / steps, (p.seconds - in_kernels) / steps, 0});
    in_graphs += p.seconds;
  }
  entries.push_back({"", "(pipeline)", 0, (decode_seconds - in_graphs) / steps, 0});
  for (DecodeProfileEntry& e : entries) e.fraction = e.seconds_per_token * steps / decode_seconds;
  std::sort(entries.begin(), entries.end(),
            [](const auto& a, const auto& b) { return a.seconds_per_token > b.seconds_per_token; });
  return entries;
}

}  // namespace

ModelBenchResult bench_model(const ModelBenchOptions& o, const BandwidthResult& bandwidth) {
  check_model_options(o);
  const nn::LlamaConfig config = resolve_model_config(o.model);
  const DType weight_dtype = random_weight_dtype(o.format);
  // The prompt, then gen_tokens decode steps; the +1 is the token prefill samples.
  const int64_t needed = o.prompt_tokens + o.gen_tokens + 1;
  if (needed > config.max_position_embeddings)
    throw ValueError(fmt::format("kiln bench: {} prompt + {} generated tokens exceed {}'s {} positions",
                                 o.prompt_tokens, o.gen_tokens, o.model, config.max_position_embeddings));
  pipelines::PipelineOptions pipeline_options{
      .max_seq_len = std::max<int64_t>(needed, std::min<int64_t>(config.max_position_embeddings, 2048)),
      .num_threads = o.threads,
      .weight_format = o.format};
  auto pipe = pipelines::named_config(o.model)
                  ? pipelines::TextGenerationPipeline::from_config(
                        config, pipelines::random_weights(config, o.seed, weight_dtype), nullptr, {},
                        pipeline_options)
                  : pipelines::TextGenerationPipeline::from_dir(o.model, pipeline_options);

  // BOS (1, as Llama 2) and seeded ids: the speed does not depend on which ids they are.
  std::mt19937_64 rng(o.seed);
  std::vector<int64_t> prompt{1};
  while (static_cast<int64_t>(prompt.size()) < o.prompt_tokens)
    prompt.push_back(static_cast<int64_t>(rng() % static_cast<uint64_t>(config.vocab_size)));
  pipelines::GenerationOptions gen{
      .max_new_tokens = o.gen_tokens + 1, .temperature = 0, .stop_at_eos = false};

  pipe.generate_ids(prompt, {.max_new_tokens = 2, .temperature = 0, .stop_at_eos = false});  // warm-up
  ModelBenchResult r;
  for (int rep = 0; rep < o.repetitions; ++rep) {
    const pipelines::GenerationStats s = pipe.generate_ids(prompt, gen).stats;
    r.prefill_tokens_per_s = std::max(r.prefill_tokens_per_s, s.prefill_tokens_per_s);
    r.decode_tokens_per_s = std::max(r.decode_tokens_per_s, s.decode_tokens_per_s);
  }
  if (o.profile) r.decode_profile = profile_decode(pipe, prompt, gen);
  r.model = o.model;
  r.format = o.format;
  r.threads = o.threads;
  r.parameters = parameter_count(config);
  r.weight_bytes_per_token = decode_weight_bytes(config, o.format);
  r.prompt_tokens = o.prompt_tokens;
  r.gen_tokens = o.gen_tokens;
  r.repetitions = o.repetitions;
  set_bandwidth(r, bandwidth.read_bytes_per_s);
  return r;
}

// ==== GEMM benchmark =======================================================================================

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
    } else {
      values[i] = uniform(rng);
      t.data_as<float>()[i] = values[i];
    }
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
  const double rel_tol = o.dtype == DType::bf16 ? 1e-2 : 1e-4;
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
  if (o.threads < 1)
    throw ValueError(fmt::format("kiln bench gemm: threads must be >= 1, got {}", o.threads));

  std::vector<float> a_values, w_values;
  const Tensor a = random_matrix(o.dtype, o.m, o.k, 1, a_values);  // [M, K]
  const Tensor w = random_matrix(o.dtype, o.n, o.k, 2, w_values);  // [N, K], as nn::Linear's weight

  graph::Graph g("gemm", {graph::TensorType{o.dtype, {o.m, o.k}}});
  {
    graph::Graph::Scope scope(g);
    graph::TensorValue x = g.input(0);                                       // [M, K]
    graph::TensorValue weight = g.weight({"w", o.dtype, {o.n, o.k}});        // [N, K]
    g.output({graph::ops::matmul(x, graph::ops::transpose(weight, 0, 1))});  // [M, N]
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
  r.threads = o.threads;
  r.repetitions = t.runs;
  r.seconds = t.best_seconds;
  const double flop = 2.0 * static_cast<double>(o.m) * static_cast<double>(o.n) * static_cast<double>(o.k);
  r.gflops = flop / t.best_seconds * 1e-9;
  // The peak before oneDNN runs and after, the higher counting: oneDNN's OpenMP threads keep spinning
  // for a while after its last call, and a peak measured beside them read half the machine's.
  r.peak_gflops = measure_peak_gflops(o.threads, 200, o.dtype);
#ifdef KILN_HAVE_ONEDNN
  r.onednn_gflops = flop / onednn_gemm_seconds(o, a, w, a_values, w_values) * 1e-9;
  r.peak_gflops = std::max(r.peak_gflops, measure_peak_gflops(o.threads, 200, o.dtype));
#endif
  if (o.dtype == DType::bf16 && kernels::gemm::isa_supported(kernels::gemm::Isa::avx512_bf16))
    r.bf16_dot_peak_gflops = measure_bf16_dot_peak_gflops(o.threads);
  return r;
}

// ==== output
// ==================================================================================================

nlohmann::json to_json(const ModelBenchResult& r) {
  nlohmann::json json = {{"kind", "model"},
          {"model", r.model},
          {"dtype", nn::weight_format_name(r.format)},
          {"threads", r.threads},
          {"params", r.parameters},
          {"weight_bytes_per_token", r.weight_bytes_per_token},
          {"prompt_tokens", r.prompt_tokens},
          {"gen_tokens", r.gen_tokens},
          {"repetitions", r.repetitions},
          {"prefill_tokens_per_s", r.prefill_tokens_per_s},
          {"decode_tokens_per_s", r.decode_tokens_per_s},
          {"read_gb_per_s", r.read_bytes_per_s * 1e-9},
          {"roofline_tokens_per_s", r.roofline_tokens_per_s},
          {"roofline_fraction", r.roofline_fraction}};
  if (!r.decode_profile.empty()) {
    nlohmann::json profile = nlohmann::json::array();
    for (const DecodeProfileEntry& e : r.decode_profile)
      profile.push_back({{"graph", e.graph},
                         {"op", e.op},
                         {"launches_per_token", e.launches_per_token},
                         {"seconds_per_token", e.seconds_per_token},
                         {"fraction", e.fraction}});
    json["decode_profile"] = std::move(profile);
  }
  return json;
}

nlohmann::json to_json(const GemmBenchResult& r) {
  return {{"kind", "gemm"},
          {"m", r.m},
          {"n", r.n},
          {"k", r.k},
          {"dtype", dtype_name(r.dtype)},
          {"threads", r.threads},
          {"repetitions", r.repetitions},
          {"seconds", r.seconds},
          {"gflops", r.gflops},
          {"onednn_gflops", r.onednn_gflops ? nlohmann::json(*r.onednn_gflops) : nlohmann::json(nullptr)},
          {"peak_gflops", r.peak_gflops},
          {"peak_fraction", r.gflops / r.peak_gflops},
          {"onednn_peak_fraction",
           r.onednn_gflops ? nlohmann::json(*r.onednn_gflops / r.peak_gflops) : nlohmann::json(nullptr)},
          {"bf16_dot_peak_gflops",
           r.bf16_dot_peak_gflops ? nlohmann::json(*r.bf16_dot_peak_gflops) : nlohmann::json(nullptr)},
          {"bf16_dot_peak_fraction", r.bf16_dot_peak_gflops ? nlohmann::json(r.gflops / *r.bf16_dot_peak_gflops)
                                                            : nlohmann::json(nullptr)}};
}

nlohmann::json to_json(const BandwidthResult& r) {
  return {{"kind", "bandwidth"},
          {"threads", r.threads},
          {"buffer_bytes", r.buffer_bytes},
          {"streams_per_thread", r.streams_per_thread},
          {"passes", r.passes},
          {"read_gb_per_s", r.read_bytes_per_s * 1e-9}};
}

std::string model_table_header(int64_t prompt_tokens, int64_t gen_tokens) {
  return fmt::format("{:<14} {:<5} {:>7} {:>9} {:>12} {:>12} {:>12} {:>10} {:>14} {:>9}", "model", "dtype",
                     "threads", "params", "MB/token", fmt::format("pp{} tok/s", prompt_tokens),
                     fmt::format("tg{} tok/s", gen_tokens), "read GB/s", "roofline tok/s", "roofline");
}

std::string table_row(const ModelBenchResult& r) {
  return fmt::format(
      "{:<14} {:<5} {:>7} {:>8.1f}M {:>12.1f} {:>12.1f} {:>12.1f} {:>10.1f} {:>14.1f} {:>8.1f}%", r.model,
      nn::weight_format_name(r.format), r.threads, static_cast<double>(r.parameters) * 1e-6,
      r.weight_bytes_per_token * 1e-6, r.prefill_tokens_per_s, r.decode_tokens_per_s,
      r.read_bytes_per_s * 1e-9, r.roofline_tokens_per_s, 100.0 * r.roofline_fraction);
}

std::string profile_table(const ModelBenchResult& r) {
  if (r.decode_profile.empty()) return "";
  double step = 0;
  for (const DecodeProfileEntry& e : r.decode_profile) step += e.seconds_per_token;
  std::string out = fmt::format("  decode step profile ({} {}, {} threads): {:.3f} ms per token\n", r.model,
                                nn::weight_format_name(r.format), r.threads, step * 1e3);
  out += fmt::format("  {:<30} {:>14} {:>12} {:>8}\n", "graph: op", "launches/token", "us/token", "share");
  for (const DecodeProfileEntry& e : r.decode_profile)
    out += fmt::format("  {:<30} {:>14.1f} {:>12.1f} {:>7.1f}%\n",
                       e.graph.empty() ? e.op : e.graph + ": " + e.op, e.launches_per_token,
                       e.seconds_per_token * 1e6, 100.0 * e.fraction);
  return out;
}

std::string gemm_table_header() {
  return fmt::format("{:<22} {:<5} {:>7} {:>13} {:>15} {:>12} {:>12} {:>10} {:>12} {:>14} {:>9}", "gemm M x N x K",
                     "dtype", "threads", "kiln GFLOP/s", "oneDNN GFLOP/s", "kiln/oneDNN", "peak GFLOP/s", "kiln/peak",
                     "oneDNN/peak", "bf16 dot peak", "kiln/dot");
}

std::string table_row(const GemmBenchResult& r) {
  const std::string onednn = r.onednn_gflops ? fmt::format("{:.1f}", *r.onednn_gflops) : "n/a";
  const std::string ratio = r.onednn_gflops ? fmt::format("{:.2f}", r.gflops / *r.onednn_gflops) : "n/a";
  const std::string onednn_peak =
      r.onednn_gflops ? fmt::format("{:.1f}%", 100.0 * *r.onednn_gflops / r.peak_gflops) : "n/a";
  const std::string dot_peak = r.bf16_dot_peak_gflops ? fmt::format("{:.1f}", *r.bf16_dot_peak_gflops) : "-";
  const std::string dot_fraction =
      r.bf16_dot_peak_gflops ? fmt::format("{:.1f}%", 100.0 * r.gflops / *r.bf16_dot_peak_gflops) : "-";
  return fmt::format("{:<22} {:<5} {:>7} {:>13.1f} {:>15} {:>12} {:>12.1f} {:>9.1f}% {:>12} {:>14} {:>9}",
                     fmt::format("{} x {} x {}", r.m, r.n, r.k), dtype_name(r.dtype), r.threads, r.gflops, onednn,
                     ratio, r.peak_gflops, 100.0 * r.gflops / r.peak_gflops, onednn_peak, dot_peak, dot_fraction);
}

std::string bandwidth_table_header() {
  return fmt::format("{:<9} {:>10} {:>16} {:>7} {:>10}", "bandwidth", "buffer MiB", "streams/thread",
                     "passes", "read GB/s");
}

std::string table_row(const BandwidthResult& r) {
  return fmt::format("{:<9} {:>10} {:>16} {:>7} {:>10.1f}", fmt::format("{} thr", r.threads),
                     r.buffer_bytes >> 20, r.streams_per_thread, r.passes, r.read_bytes_per_s * 1e-9);
}

// ==== the command
// ===============================================================================================

namespace {

// The 1-minute load average, so a reader can tell a busy machine's figures apart; -1 if unknown.
double load_average() {
  std::ifstream in("/proc/loadavg");
  double load = -1;
  in >> load;
  return in ? load : -1;
}

void print_preamble(bool json) {
  if (json) return;
  std::cout << fmt::format("{}; {} hardware threads; load average {:.2f}\n", onednn_description(),
                           std::thread::hardware_concurrency(), load_average());
}

}  // namespace

BenchCommand::BenchCommand(CLI::App& app) {
  bench_ =
      app.add_subcommand("bench", "Benchmark models (tokens/s vs the bandwidth roofline), GEMM, bandwidth");
  bench_
      ->add_option("--model", models_,
                   fmt::format("model directory or random-weight shape ({}); comma-separated for several",
                               join(pipelines::named_config_names())))
      ->delimiter(',');
  bench_->add_option("--dtype", dtypes_, "weight dtype: f32, f16, bf16, q8_0; comma-separated for several")
      ->delimiter(',')
      ->capture_default_str();
  bench_->add_option("--prompt-tokens", prompt_tokens_, "prompt length (prefill)")->capture_default_str();
  bench_->add_option("--gen-tokens", gen_tokens_, "decode steps timed")->capture_default_str();
  bench_->add_option("--repetitions", repetitions_, "timed runs; the best is reported")
      ->capture_default_str();
  bench_->add_option("--seed", seed_, "seed of the random weights and the prompt")->capture_default_str();
  bench_->add_flag("--profile", profile_,
                   "after the timed runs, profile one more generation's decode: each op's time per token");

  gemm_ = bench_->add_subcommand("gemm", "GFLOP/s of C = A[M, K] @ W[N, K]^T: kiln beside oneDNN");
  gemm_->add_option("--m", m_, "rows of A and C")->capture_default_str();
  gemm_->add_option("--n", n_, "rows of W, columns of C")->capture_default_str();
  gemm_->add_option("--k", k_, "the inner dimension")->capture_default_str();
  gemm_->add_option("--dtype", dtypes_, "f32 or bf16")->delimiter(',')->capture_default_str();
  gemm_->add_option("--min-seconds", min_seconds_, "time spent per side (best run reported)")
      ->capture_default_str();

  bandwidth_ =
      bench_->add_subcommand("bandwidth", "Streaming read bandwidth (4 interleaved streams per thread)");
  bandwidth_->add_option("--buffer-mib", buffer_mib_, "buffer size in MiB")->capture_default_str();
  bandwidth_->add_option("--passes", passes_, "timed passes; the best is reported")->capture_default_str();

  for (CLI::App* cmd : {bench_, gemm_, bandwidth_}) {
    cmd->add_option("--threads", threads_, "thread counts, comma-separated (0: one per core)")
        ->delimiter(',')
        ->capture_default_str();
    cmd->add_flag("--json", json_, "one JSON object per result, one per line");
  }
}

bool BenchCommand::selected() const { return bench_->parsed(); }

int BenchCommand::run() const {
  std::vector<int> threads;
  for (int t : threads_) threads.push_back(resolve_threads(t));
  auto emit = [&](const nlohmann::json& json, const std::string& row) {
    std::cout << (json_ ? json.dump() : row) << std::endl;
  };

  if (bandwidth_->parsed() || gemm_->parsed()) {
    if (!models_.empty())
      throw ValueError(
          fmt::format("kiln bench {}: --model is for the model benchmark (kiln bench --model ...)",
                      gemm_->parsed() ? "gemm" : "bandwidth"));
  }
  if (bandwidth_->parsed()) {
    if (buffer_mib_ < 1)
      throw ValueError(fmt::format("kiln bench bandwidth: --buffer-mib must be >= 1, got {}", buffer_mib_));
    print_preamble(json_);
    if (!json_) std::cout << bandwidth_table_header() << "\n";
    for (int t : threads) {
      BandwidthResult r = measure_read_bandwidth(t, buffer_mib_ << 20, passes_);
      emit(to_json(r), table_row(r));
    }
    return 0;
  }
  if (gemm_->parsed()) {
    std::vector<DType> dtypes;
    for (const auto& name : dtypes_) {
      if (name != "f32" && name != "bf16")
        throw ValueError(fmt::format("kiln bench gemm: unknown dtype '{}' (choose f32 or bf16)", name));
      dtypes.push_back(parse_dtype(name));
    }
    print_preamble(json_);
    if (!json_) std::cout << gemm_table_header() << "\n";
    for (DType dtype : dtypes)
      for (int t : threads) {
        GemmBenchResult r = bench_gemm(
            {.m = m_, .n = n_, .k = k_, .dtype = dtype, .threads = t, .min_seconds = min_seconds_});
        emit(to_json(r), table_row(r));
      }
    return 0;
  }

  if (models_.empty())
    throw ValueError(
        fmt::format("kiln bench: give --model ({} or a model directory), or `kiln bench gemm` / "
                    "`kiln bench bandwidth`",
                    join(pipelines::named_config_names())));
  // Every name checked before the first (slow) run.
  std::vector<WeightFormat> formats;
  for (const auto& name : dtypes_) formats.push_back(nn::parse_weight_format(name));
  for (const auto& model : models_) resolve_model_config(model);
  print_preamble(json_);
  if (!json_) std::cout << model_table_header(prompt_tokens_, gen_tokens_) << "\n";
  for (const auto& model : models_)
    for (WeightFormat format : formats)
      for (int t : threads) {
        // Bandwidth just before and just after the model, with its thread count: the roofline of
        // this very run. The better of the two counts, so a dip in the machine's bandwidth while it
        // was measured cannot flatter the decode's fraction of it.
        const BandwidthResult before = measure_read_bandwidth(t);
        ModelBenchResult r = bench_model({.model = model,
                                          .format = format,
                                          .threads = t,
                                          .prompt_tokens = prompt_tokens_,
                                          .gen_tokens = gen_tokens_,
                                          .repetitions = repetitions_,
                                          .seed = seed_,
                                          .profile = profile_},
                                         before);
        const BandwidthResult after = measure_read_bandwidth(t);
        if (after.read_bytes_per_s > r.read_bytes_per_s) set_bandwidth(r, after.read_bytes_per_s);
        emit(to_json(r), table_row(r));
        if (!json_ && !r.decode_profile.empty()) std::cout << profile_table(r) << std::flush;
      }
  return 0;
}

}  // namespace kiln::bench
