// `kiln bench`: the roofline arithmetic, the weight bytes a decode step reads, the measurements on
// small sizes, and the command's output (JSON parsed back, table rows, errors).
#include <sched.h>
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <CLI/CLI.hpp>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <tuple>

#include "../../tools/kiln/bench.h"
#include "kernels/cpu/gemm.h"
#include "kiln/errors.h"
#include "kiln/pipelines/text_generation.h"
#include "test_util.h"

namespace kiln::bench {
namespace {

using kiln::testing::expect_error;

nn::LlamaConfig named(const char* name) { return *pipelines::named_config(name); }

// ---- parameters and bytes per token, against sums written out from the shapes ----

TEST(BenchWeights, ParameterCountsMatchTheNamedShapes) {
  // stories15M: 6 x (4 x 288^2 + 3 x 288 x 768 + 2 x 288) + 32000 x 288 + 288
  EXPECT_EQ(parameter_count(named("stories15M")),
            6 * (4 * 288 * 288 + 3 * 288 * 768 + 2 * 288) + 32000 * 288 + 288);
  EXPECT_EQ(parameter_count(named("stories15M")), 15191712);
  EXPECT_EQ(parameter_count(named("stories110M")), 109529856);
  // llama-1B: q, o 2048^2; k, v 2048 x 512 (8 kv heads of 64); mlp 3 x 2048 x 8192; tied 128256 x 2048.
  const int64_t layer = 2 * 2048 * 2048 + 2 * 2048 * 512 + 3 * 2048 * 8192 + 2 * 2048;
  EXPECT_EQ(parameter_count(named("llama-1B")), 16 * layer + int64_t{128256} * 2048 + 2048);
  EXPECT_EQ(parameter_count(named("llama-1B")), 1235814400);
}

TEST(BenchWeights, DecodeBytesCountMatricesInTheFormatAndNormsInF32) {
  // stories15M, tied: the 6 layers' matrices, the whole embedding table (as lm_head) and the new
  // token's row in the format; 13 norm vectors of 288 in f32.
  const double matrices = 6.0 * (4 * 288 * 288 + 3 * 288 * 768) + 32000.0 * 288 + 288;
  const double norms = 13.0 * 288 * 4;
  const nn::LlamaConfig c = named("stories15M");
  EXPECT_DOUBLE_EQ(decode_weight_bytes(c, WeightFormat::f32), matrices * 4 + norms);
  EXPECT_DOUBLE_EQ(decode_weight_bytes(c, WeightFormat::f32), 60768000.0);
  EXPECT_DOUBLE_EQ(decode_weight_bytes(c, WeightFormat::f16), matrices * 2 + norms);
  EXPECT_DOUBLE_EQ(decode_weight_bytes(c, WeightFormat::bf16), matrices * 2 + norms);
  EXPECT_DOUBLE_EQ(decode_weight_bytes(c, WeightFormat::q8_0), matrices * 34 / 32 + norms);
}

// Each matrix in the format it runs in: q4_k's fallback (q8_0 for stories15M's 288-column rows) and
// a per-matrix exception (a GGUF file's mix) count at their own bytes per weight.
TEST(BenchWeights, DecodeBytesCountEachMatrixInItsOwnFormat) {
  nn::LlamaConfig c = named("stories15M");
  c.weight_formats = {{"model.layers.0.mlp.down_proj.weight", WeightFormat::q6_k}};
  const double q8_0 = 34.0 / 32, q4_k = 144.0 / 256, q6_k = 210.0 / 256;
  const double cols_288 = 6.0 * (4 * 288 * 288 + 2 * 288 * 768) + 32000.0 * 288 + 288;  // and the embedding
  const double norms = 13.0 * 288 * 4;
  EXPECT_DOUBLE_EQ(decode_weight_bytes(c, WeightFormat::q4_k),
                   cols_288 * q8_0 + 5.0 * 288 * 768 * q4_k + 288.0 * 768 * q6_k + norms);
  EXPECT_EQ(parameter_count(c), parameter_count(named("stories15M")));
}

TEST(BenchWeights, UntiedModelReadsOneEmbeddingRowAndTheLmHead) {
  nn::LlamaConfig c;
  c.vocab_size = 100;
  c.hidden_size = 16;
  c.intermediate_size = 32;
  c.num_hidden_layers = 1;
  c.num_attention_heads = 2;
  c.num_key_value_heads = 1;  // k, v: 16 x 8
  c.tie_word_embeddings = false;
  const double matrices = 2 * 16 * 16 + 2 * 16 * 8 + 3 * 16 * 32 + 16 /* row */ + 100 * 16 /* lm_head */;
  EXPECT_DOUBLE_EQ(decode_weight_bytes(c, WeightFormat::f32), matrices * 4 + 3 * 16 * 4);
  EXPECT_EQ(parameter_count(c), 2 * 16 * 16 + 2 * 16 * 8 + 3 * 16 * 32 + 3 * 16 + 2 * 100 * 16);
}

TEST(BenchWeights, RooflineIsBandwidthOverBytesPerToken) {
  EXPECT_DOUBLE_EQ(roofline_tokens_per_s(1e9, 40e9), 40.0);
  EXPECT_DOUBLE_EQ(roofline_tokens_per_s(60768000.0, 40e9), 40e9 / 60768000.0);
  expect_error<ValueError>([] { roofline_tokens_per_s(0, 40e9); }, "weight bytes per token must be > 0");
}

TEST(BenchWeights, Q8_0StoresThirtyFourBytesPerThirtyTwoWeights) {
  EXPECT_DOUBLE_EQ(bytes_per_weight(WeightFormat::q8_0), 1.0625);
  EXPECT_DOUBLE_EQ(bytes_per_weight(WeightFormat::bf16), 2.0);
}

TEST(BenchWeights, GgufBlocksStoreTheirBytesPerWeight) {
  EXPECT_DOUBLE_EQ(bytes_per_weight(WeightFormat::q4_0), 18.0 / 32);
  EXPECT_DOUBLE_EQ(bytes_per_weight(WeightFormat::q4_k), 144.0 / 256);
  EXPECT_DOUBLE_EQ(bytes_per_weight(WeightFormat::q5_k), 176.0 / 256);
  EXPECT_DOUBLE_EQ(bytes_per_weight(WeightFormat::q6_k), 210.0 / 256);
}

TEST(BenchModel, UnknownModelListsTheKnownNames) {
  expect_error<ValueError>([] { resolve_model_config("stories1B"); },
                           {"'stories1B'", "stories15M", "stories110M", "llama-1B"});
}

// ---- measurements on small sizes ----

TEST(BenchBandwidth, MeasuresTheWholeBufferOfEveryThread) {
  const BandwidthResult r = measure_read_bandwidth(2, 8 << 20, 2);
  EXPECT_EQ(r.threads, 2);
  EXPECT_EQ(r.buffer_bytes, 8 << 20);  // divisible into 2 threads x 8 streams x 64 bytes
  EXPECT_EQ(r.passes, 2);
  // Every pattern measured; the result is the fastest of them, with its stream count (two patterns
  // may time the same to the clock's tick, so the count named is one whose rate is the fastest).
  std::vector<int> streams;
  double fastest = 0;
  double rate_of_named_count = 0;
  for (const auto& [count, rate] : r.read_bytes_per_s_by_streams) {
    streams.push_back(count);
    EXPECT_GT(rate, 1e8) << count << " streams";
    EXPECT_LT(rate, 1e13) << count << " streams";  // a wrong byte count or an optimised-away read shows here
    if (rate > fastest) fastest = rate;
    if (count == r.streams_per_thread) rate_of_named_count = rate;
  }
  EXPECT_EQ(streams, (std::vector<int>{1, 2, 4, 8}));
  EXPECT_EQ(r.read_bytes_per_s, fastest);
  EXPECT_EQ(rate_of_named_count, fastest) << r.streams_per_thread << " streams named";
  // Rounded down to whole vectors in each of the 8 streams of a thread's slice.
  EXPECT_EQ(measure_read_bandwidth(1, 1000, 1).buffer_bytes, 512);
}

// The probe the paired roofline reads after each decode step: the same buffer every time, each read
// timing the whole of it, in any of the stream patterns.
TEST(BenchBandwidth, AProbeReadsItsWholeBufferAsOftenAsAsked) {
  BandwidthProbe probe(2, (8 << 20) + 100);
  EXPECT_EQ(probe.bytes(), 8 << 20);  // rounded down to 2 threads x 8 streams of whole vectors
  for (int streams : {1, 2, 4, 8, 1}) {
    const double rate = probe.read(streams);
    EXPECT_GT(rate, 1e8) << streams << " streams";
    EXPECT_LT(rate, 1e13) << streams << " streams";
  }
  expect_error<ValueError>([&] { probe.read(3); }, "3 streams per thread; 1, 2, 4 or 8");
  expect_error<ValueError>([] { BandwidthProbe(0, 1 << 20); }, "threads must be >= 1, got 0");
  expect_error<ValueError>([] { BandwidthProbe(2, 1000); }, "too small for 2 threads (at least 1024)");
}

// The handover of a line between two threads: a time a cache line's trip can take (a CPU moves one
// core to core in tens to hundreds of ns; a busy host can add a time slice of milliseconds, never
// 0.1 s), measured with the reads whenever there are two threads to measure between.
TEST(BenchBandwidth, TimesALineRoundTripBetweenTwoCpus) {
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  ASSERT_EQ(sched_getaffinity(0, sizeof allowed, &allowed), 0);
  const double round_trip = measure_core_round_trip(2000);
  if (CPU_COUNT(&allowed) < 2) {
    EXPECT_EQ(round_trip, 0);
    GTEST_SKIP() << "this process may run on one CPU only: no round trip to time";
  }
  EXPECT_GT(round_trip, 1.0);
  EXPECT_LT(round_trip, 1e8);
  EXPECT_GT(measure_read_bandwidth(2, 1 << 20, 1).core_round_trip_ns, 0);
  EXPECT_EQ(measure_read_bandwidth(1, 1 << 20, 1).core_round_trip_ns, 0);  // one thread: nothing to hand over
  expect_error<ValueError>([] { measure_core_round_trip(0); }, "round_trips must be >= 1, got 0");
}

TEST(BenchBandwidth, RejectsBadArguments) {
  expect_error<ValueError>([] { measure_read_bandwidth(0, 1 << 20, 1); }, "threads must be >= 1, got 0");
  expect_error<ValueError>([] { measure_read_bandwidth(1, 1 << 20, 0); }, "passes must be >= 1, got 0");
  expect_error<ValueError>([] { measure_read_bandwidth(2, 100, 1); }, "too small for 2 threads");
}

TEST(BenchGemm, TimesACheckedProductBesideOneDNN) {
  for (DType dtype : {DType::f32, DType::bf16}) {
    const GemmBenchResult r =
        bench_gemm({.m = 5, .n = 24, .k = 40, .dtype = dtype, .threads = 1, .min_seconds = 0.001});
    EXPECT_EQ(r.m, 5);
    EXPECT_GE(r.repetitions, 3);
    EXPECT_NEAR(r.gflops, 2.0 * 5 * 24 * 40 / r.seconds * 1e-9, 1e-9 * r.gflops);
    // oneDNN runs the product wherever it is built in, but for bf16 on a CPU without AVX-512, where
    // Debian's oneDNN has no bf16 matmul and the report names its error instead.
    const bool onednn_built = onednn_description() != "oneDNN: not available";
    EXPECT_EQ(r.onednn_gflops.has_value() || !r.onednn_note.empty(), onednn_built);
    if (!r.onednn_note.empty()) {
      EXPECT_EQ(dtype, DType::bf16) << r.onednn_note;
      EXPECT_FALSE(kernels::gemm::isa_supported(kernels::gemm::Isa::avx512)) << r.onednn_note;
    }
    if (r.onednn_gflops) {
      EXPECT_GT(*r.onednn_gflops, 0);
    }
    // The vdpbf16ps peak: measured for bf16 wherever the CPU has the instruction, never for f32.
    const bool has_dot = kernels::gemm::isa_supported(kernels::gemm::Isa::avx512_bf16);
    EXPECT_EQ(r.bf16_dot_peak_gflops.has_value(), dtype == DType::bf16 && has_dot) << dtype_name(dtype);
    if (r.bf16_dot_peak_gflops) {
      EXPECT_GT(*r.bf16_dot_peak_gflops, 0);
    }
  }
  if (kernels::gemm::isa_supported(kernels::gemm::Isa::avx512_bf16)) {
    EXPECT_GT(measure_bf16_dot_peak_gflops(1, 3), 0);
  } else {
    expect_error<ValueError>([] { measure_bf16_dot_peak_gflops(1, 3); }, "no AVX512_BF16");
  }
  expect_error<ValueError>([] { bench_gemm({.m = 0}); }, "M, N, K must be >= 1, got 0 x 1024 x 1024");
  expect_error<ValueError>([] { bench_gemm({.dtype = DType::i32}); }, "dtype must be f32 or bf16, got i32");
}

TEST(BenchModel, ReportsSpeedsAndTheirRooflineFraction) {
  BandwidthResult bandwidth;
  bandwidth.read_bytes_per_s = 30e9;
  const ModelBenchResult r = bench_model(
      {.model = "stories15M", .threads = 1, .prompt_tokens = 4, .gen_tokens = 3, .repetitions = 1},
      bandwidth);
  EXPECT_EQ(r.parameters, 15191712);
  EXPECT_DOUBLE_EQ(r.weight_bytes_per_token, 60768000.0);
  EXPECT_GT(r.prefill_tokens_per_s, 0);
  EXPECT_GT(r.decode_tokens_per_s, 0);
  EXPECT_DOUBLE_EQ(r.roofline_tokens_per_s, 30e9 / 60768000.0);
  EXPECT_DOUBLE_EQ(r.roofline_fraction, r.decode_tokens_per_s / r.roofline_tokens_per_s);
}

// --paired-roofline: every decode step paired with a read after it, the first token (prefill's) not;
// each step's fraction is its weight bytes per second over its read's rate, and it is a fraction.
TEST(BenchModel, PairedRooflineRatesEveryDecodeStepAgainstTheReadAfterIt) {
  const ModelBenchResult plain = bench_model(
      {.model = "stories15M", .threads = 1, .prompt_tokens = 4, .gen_tokens = 5, .repetitions = 1}, BandwidthResult{});
  EXPECT_FALSE(plain.paired.has_value()) << "only when asked";
  BandwidthResult bandwidth;
  bandwidth.streams_per_thread = 4;
  const ModelBenchResult r = bench_model({.model = "stories15M", .threads = 2, .prompt_tokens = 4, .gen_tokens = 5,
                                          .repetitions = 1, .paired_roofline = true},
                                         bandwidth);
  ASSERT_TRUE(r.paired.has_value());
  EXPECT_EQ(r.paired->steps, 5);
  EXPECT_GT(r.paired->read_bytes_per_s_median, 1e8);
  EXPECT_LT(r.paired->read_bytes_per_s_median, 1e13);
  EXPECT_GT(r.paired->fraction_p10, 0);
  EXPECT_LE(r.paired->fraction_p10, r.paired->fraction_median);
  EXPECT_LE(r.paired->fraction_median, r.paired->fraction_p90);
  // A step cannot read its 60.8 MB faster than many times a plain read (each read is 512 MiB, from memory).
  EXPECT_LT(r.paired->fraction_p90, 20);
}

// Every repetition (and the warm-up) runs the same prompt; none may take it from the prefix cache,
// or the prefill figure would time a prefill that did not happen. 40 tokens: two full KV blocks.
TEST(BenchModel, RepeatedPromptsArePrefilledEveryTime) {
  const ModelBenchResult r = bench_model(
      {.model = "stories15M", .threads = 1, .prompt_tokens = 40, .gen_tokens = 2, .repetitions = 3}, BandwidthResult{});
  EXPECT_EQ(r.cached_prompt_tokens, 0);
}

// The decode profile of stories15M (6 layers): per token one model run with one attention per layer
// and two RMS norms per layer plus the final one, one greedy argmax; the parts add up to the step.
TEST(BenchModel, ProfileSplitsTheDecodeStepByOp) {
  const BandwidthResult bandwidth;
  const ModelBenchResult r = bench_model({.model = "stories15M", .threads = 1, .prompt_tokens = 4,
                                          .gen_tokens = 3, .repetitions = 1, .profile = true},
                                         bandwidth);
  auto find = [&](const std::string& graph, const std::string& op) -> const DecodeProfileEntry* {
    for (const DecodeProfileEntry& e : r.decode_profile)
      if (e.graph == graph && e.op == op) return &e;
    return nullptr;
  };
  for (auto [graph, op, launches] : {std::tuple<const char*, const char*, double>{"model", "paged_attention", 6},
                                     {"model", "rms_norm", 13},
                                     {"model", "(run)", 1},
                                     {"greedy", "argmax", 1},
                                     {"greedy", "(run)", 1}}) {
    const DecodeProfileEntry* e = find(graph, op);
    ASSERT_NE(e, nullptr) << graph << ": " << op;
    EXPECT_DOUBLE_EQ(e->launches_per_token, launches) << graph << ": " << op;
  }
  EXPECT_EQ(find("sampler", "(run)"), nullptr) << "greedy decoding never runs the sampler graph";
  ASSERT_NE(find("", "(pipeline)"), nullptr);
  double fractions = 0;
  for (size_t i = 0; i < r.decode_profile.size(); ++i) {
    fractions += r.decode_profile[i].fraction;
    if (i > 0) {
      EXPECT_GE(r.decode_profile[i - 1].seconds_per_token, r.decode_profile[i].seconds_per_token);
    }
  }
  EXPECT_NEAR(fractions, 1.0, 1e-9);
  // stories15M's matrices (dim 288, hidden 768, vocab 32000) in f32: each layer's 4 attention
  // projections share a line, as its 2 w1/w3 and its w2 do; the LM head is one.
  const auto matrix_launches = [&](int64_t bytes) {
    double launches = 0;
    for (const DecodeProfileEntry& e : r.decode_profile)
      if (e.weight_bytes_per_launch == bytes && e.op.find("matmul") != std::string::npos) {
        launches += e.launches_per_token;
        EXPECT_GT(e.weight_bytes_per_s(), 0) << e.op;
      }
    return launches;
  };
  EXPECT_DOUBLE_EQ(matrix_launches(int64_t{288} * 32000 * 4), 1) << "the LM head";
  EXPECT_DOUBLE_EQ(matrix_launches(int64_t{768} * 288 * 4), 6) << "one w2 per layer";
  const std::string table = profile_table(r);
  EXPECT_NE(table.find("model: paged_attention"), std::string::npos) << table;
  EXPECT_NE(table.find("ms per token"), std::string::npos) << table;
}

// Every request of a level is counted once, with its gen_tokens + 1 tokens; the percentiles are
// ordered and the KV blocks it used are within the cache.
TEST(BenchConcurrency, EachLevelRunsThatManyRequestsTogether) {
  const std::vector<ConcurrencyBenchResult> results = bench_concurrency(
      {.model = "stories15M", .threads = 1, .prompt_tokens = 5, .gen_tokens = 3}, {1, 3});
  ASSERT_EQ(results.size(), 2u);
  for (const ConcurrencyBenchResult& r : results) {
    EXPECT_EQ(r.output_tokens, r.concurrency * 4);
    EXPECT_GT(r.aggregate_decode_tokens_per_s, 0);
    // The 5-token prompts fit one step, so every request decodes its 3 later tokens together; the
    // window closes at the first finish, so it holds at least the finisher's 3 and one more per other
    // request before that last step, and at most all of them.
    EXPECT_GE(r.steady_decode_tokens, 3 + 2 * (r.concurrency - 1));
    EXPECT_LE(r.steady_decode_tokens, 3 * r.concurrency);
    EXPECT_GT(r.steady_decode_tokens_per_s, 0);
    EXPECT_NEAR(r.output_tokens_per_s, static_cast<double>(r.output_tokens) / r.seconds, 1e-9);
    EXPECT_GT(r.ttft_p50_s, 0);
    EXPECT_LE(r.ttft_p50_s, r.ttft_p99_s);
    EXPECT_LE(r.tpot_p50_s, r.tpot_p99_s);
    EXPECT_LE(r.ttft_p99_s, r.seconds);
    // 5 + 4 positions in blocks of 16: one block per request.
    EXPECT_EQ(r.kv_blocks_peak, r.concurrency);
    EXPECT_GE(r.kv_blocks_total, r.kv_blocks_peak);
    const nlohmann::json json = to_json(r);
    for (const char* key :
         {"concurrency", "aggregate_decode_tokens_per_s", "output_tokens_per_s", "ttft_p50_s", "tpot_p50_s"})
      EXPECT_TRUE(json.contains(key)) << key;
    EXPECT_EQ(json.at("kind"), "concurrency");
  }
  EXPECT_EQ(results[1].concurrency, 3);
  expect_error<ValueError>([] { bench_concurrency({.model = "stories15M", .threads = 1}, {0}); },
                           "--concurrency levels must be in [1, 4096], got 0");
}

// ---- --compare-llama-cpp, against stand-ins for llama-bench (shell scripts with known output) ----

// Writes an executable script into dir; returns its path.
std::filesystem::path write_script(const std::filesystem::path& dir, const std::string& name, const std::string& body) {
  std::filesystem::create_directories(dir);
  const std::filesystem::path path = dir / name;
  std::ofstream(path) << "#!/bin/sh\n" << body;
  std::filesystem::permissions(path, std::filesystem::perms::owner_all);
  return path;
}

// A stand-in for llama-bench: what `-o json` prints, cut to the fields read, for the tests its
// arguments ask for (-p, -n, -d, -ctk): a pp test or a tg test per load mode, the better load mode
// "none" for pp (100.5 tok/s) and "mmap" for tg (25), each run's arguments appended to $ARGS_FILE.
constexpr const char* kFakeLlamaBench = R"(p=0; n=0; d=0; k=f16; all="$*"
while [ $# -gt 0 ]; do case "$1" in -p) p=$2;; -n) n=$2;; -d) d=$2;; -ctk) k=$2;; esac; shift; done
[ -n "$ARGS_FILE" ] && echo "$all" >> "$ARGS_FILE"
echo progress >&2
c='"build_commit": "3f545becc", "n_threads": 2'
if [ "$n" = 0 ]; then
  echo "[{$c, \"load_mode\": \"none\", \"n_prompt\": $p, \"n_gen\": 0, \"n_depth\": $d, \"type_k\": \"$k\", \"avg_ts\": 100.5},"
  echo " {$c, \"load_mode\": \"mmap\", \"n_prompt\": $p, \"n_gen\": 0, \"n_depth\": $d, \"type_k\": \"$k\", \"avg_ts\": 90.0}]"
else
  echo "[{$c, \"load_mode\": \"none\", \"n_prompt\": $p, \"n_gen\": $n, \"n_depth\": $d, \"type_k\": \"$k\", \"avg_ts\": 20.0},"
  echo " {$c, \"load_mode\": \"mmap\", \"n_prompt\": $p, \"n_gen\": $n, \"n_depth\": $d, \"type_k\": \"$k\", \"avg_ts\": 25.0}]"
fi
)";

TEST(BenchLlamaCpp, RunsLlamaBenchWithKilnsSettingsAndTakesItsBetterLoadMode) {
  kiln::testing::TempDir dir("llama_bench");
  const std::filesystem::path args = dir.path() / "args";
  const std::filesystem::path gguf = dir.path() / "model.gguf";
  const std::filesystem::path fake =
      write_script(dir.path(), "llama-bench", fmt::format("ARGS_FILE='{}'\n{}", args.string(), kFakeLlamaBench));
  std::ofstream(gguf) << "GGUF";
  const LlamaCppBenchResult r = run_llama_bench(
      {.llama_bench = fake, .gguf = gguf, .threads = 2, .prompt_tokens = 5, .gen_tokens = 3, .repetitions = 4});
  // The prompt test from an empty context, the generation test after the prompt's 5 tokens, as kiln
  // decodes; kiln's f32 KV cache is not a type llama-bench has, so it keeps its own.
  std::ifstream in(args);
  std::string prompt_run, generation_run, more;
  std::getline(in, prompt_run);
  std::getline(in, generation_run);
  EXPECT_EQ(prompt_run, fmt::format("-m {} -t 2 -r 4 -mmp 0,1 -p 5 -n 0 -o json", gguf.string()));
  EXPECT_EQ(generation_run, fmt::format("-m {} -t 2 -r 4 -mmp 0,1 -p 0 -n 3 -d 5 -o json", gguf.string()));
  EXPECT_FALSE(std::getline(in, more)) << more;
  EXPECT_EQ(r.prefill_tokens_per_s, 100.5);  // the better load mode of each test
  EXPECT_EQ(r.decode_tokens_per_s, 25.0);
  EXPECT_EQ(r.prompt_tokens, 5);
  EXPECT_EQ(r.gen_tokens, 3);
  EXPECT_EQ(r.decode_depth, 5);
  EXPECT_EQ(r.kv_type, "f16");
  EXPECT_EQ(r.threads, 2);
  EXPECT_EQ(r.build_commit, "3f545becc");

  ModelBenchResult kiln_run;
  kiln_run.prefill_tokens_per_s = 201;
  kiln_run.decode_tokens_per_s = 30;
  const LlamaCppComparison c = compare(kiln_run, r);
  EXPECT_DOUBLE_EQ(c.prefill_ratio, 2.0);
  EXPECT_DOUBLE_EQ(c.decode_ratio, 1.2);
  const nlohmann::json json = to_json(c);
  EXPECT_EQ(json.at("kind"), "llama_cpp");
  EXPECT_DOUBLE_EQ(json.at("decode_ratio").get<double>(), 1.2);
  EXPECT_EQ(json.at("decode_depth"), 5);
  EXPECT_EQ(json.at("kv_type"), "f16");
  EXPECT_EQ(json.at("kiln_kv_dtype"), "f32");
  const std::string row = table_row(c);
  EXPECT_NE(row.find("llama.cpp 3f545becc"), std::string::npos) << row;
  EXPECT_NE(row.find("2.00x"), std::string::npos) << row;
  EXPECT_NE(row.find("1.20x"), std::string::npos) << row;
  EXPECT_NE(row.find("(tg after 5 tokens; KV f16, kiln's f32)"), std::string::npos) << row;

  // A KV dtype llama-bench has goes to both its caches, in both runs.
  std::filesystem::remove(args);
  const LlamaCppBenchResult bf16 = run_llama_bench({.llama_bench = fake, .gguf = gguf, .threads = 1,
                                                    .prompt_tokens = 7, .gen_tokens = 2, .repetitions = 1,
                                                    .kv_dtype = DType::bf16});
  EXPECT_EQ(bf16.kv_type, "bf16");
  std::ifstream in_bf16(args);
  for (const char* run : {"-p 7 -n 0 -o json", "-p 0 -n 2 -d 7 -o json"}) {
    std::string line;
    ASSERT_TRUE(std::getline(in_bf16, line)) << run;
    EXPECT_EQ(line, fmt::format("-m {} -t 1 -r 1 -mmp 0,1 -ctk bf16 -ctv bf16 {}", gguf.string(), run));
  }
  EXPECT_EQ(llama_bench_runs({.llama_bench = fake, .gguf = gguf, .kv_dtype = DType::f16})[1][9], "-ctk");
}

// Only the tests that match kiln's runs are taken: a prompt test after a context is not kiln's
// prefill, and generation tests after two different contexts cannot make one figure.
TEST(BenchLlamaCpp, TakesThePromptTestFromNoContextAndOneGenerationDepth) {
  auto parse = [](const std::string& text) { return parse_llama_bench_json(text, "llama-bench"); };
  const LlamaCppBenchResult r = parse(R"([
    {"n_prompt": 8, "n_gen": 0, "n_depth": 0, "avg_ts": 50},
    {"n_prompt": 8, "n_gen": 0, "n_depth": 8, "avg_ts": 70},
    {"n_prompt": 0, "n_gen": 4, "n_depth": 8, "type_k": "bf16", "avg_ts": 9}])");
  EXPECT_EQ(r.prefill_tokens_per_s, 50);
  EXPECT_EQ(r.decode_tokens_per_s, 9);
  EXPECT_EQ(r.decode_depth, 8);
  EXPECT_EQ(r.kv_type, "bf16");
  // Before llama-bench had -d its tests had no n_depth: from an empty context.
  EXPECT_EQ(parse(R"([{"n_prompt": 8, "n_gen": 0, "avg_ts": 5}, {"n_prompt": 0, "n_gen": 4, "avg_ts": 9}])").decode_depth, 0);
  expect_error<ExecutionError>(
      [&] {
        parse(R"([{"n_prompt": 8, "n_gen": 0, "avg_ts": 5}, {"n_prompt": 0, "n_gen": 4, "n_depth": 0, "avg_ts": 9},
                  {"n_prompt": 0, "n_gen": 4, "n_depth": 8, "avg_ts": 7}])");
      },
      "generation tests after contexts of 0 and 8 tokens");
  expect_error<ExecutionError>(
      [&] { parse(R"([{"n_prompt": 8, "n_gen": 0, "avg_ts": 5}, {"n_prompt": 0, "n_gen": 4, "n_depth": -1, "avg_ts": 9}])"); },
      "test 1 has 'n_depth' -1");
}

namespace {
BandwidthResult moment(double gb_per_s, double round_trip_ns) {
  BandwidthResult r;
  r.read_bytes_per_s = gb_per_s * 1e9;
  r.core_round_trip_ns = round_trip_ns;
  return r;
}
}  // namespace

// Each round's reads and round trips place both runs on the host's memory: llama.cpp's decode against
// the roofline of the read beside it, and whether the round saw one phase of the memory.
TEST(BenchLlamaCpp, ARoundIsOnePhaseWhenItsReadsAndRoundTripsAgree) {
  ModelBenchResult kiln_run;
  kiln_run.prefill_tokens_per_s = 300;
  kiln_run.decode_tokens_per_s = 600;
  kiln_run.weight_bytes_per_token = 50e6;
  kiln_run.read_bytes_per_s = 36e9;  // bench_model's: the better of the reads before and between
  LlamaCppBenchResult llama;
  llama.prefill_tokens_per_s = 200;
  llama.decode_tokens_per_s = 400;

  // One CCD throughout: reads 35, 36, 34 GB/s (36 / 34 < 1.2), round trips 55-60 ns.
  LlamaCppComparison c = compare(kiln_run, llama, {moment(35, 55), moment(36, 60), moment(34, 58)});
  EXPECT_TRUE(c.same_phase);
  EXPECT_DOUBLE_EQ(c.decode_ratio, 1.5);
  EXPECT_DOUBLE_EQ(c.llama_cpp_read_bytes_per_s, 36e9);  // the better of between and after
  EXPECT_DOUBLE_EQ(c.llama_cpp_roofline_fraction, 400 / (36e9 / 50e6));  // 400 of 720 tok/s
  nlohmann::json json = to_json(c);
  EXPECT_EQ(json.at("same_phase"), true);
  EXPECT_DOUBLE_EQ(json.at("read_gb_per_s").get<double>(), 36);
  EXPECT_DOUBLE_EQ(json.at("round_trips_ns").at(2).get<double>(), 58);
  std::string row = table_row(c);
  EXPECT_NE(row.find("55.6%"), std::string::npos) << row;  // llama.cpp's roofline fraction
  EXPECT_NE(row.find("720.0"), std::string::npos) << row;  // its roofline tok/s
  EXPECT_NE(row.find("one phase: reads 35.0, 36.0, 34.0 GB/s; threads' round trips 55, 60, 58 ns"),
            std::string::npos)
      << row;

  // The reads of a round that crossed phases: 35 then 60 GB/s.
  c = compare(kiln_run, llama, {moment(35, 55), moment(60, 56), moment(59, 57)});
  EXPECT_FALSE(c.same_phase);
  EXPECT_NE(table_row(c).find("phases differ"), std::string::npos);
  // Reads alike but the threads moved from one CCD to two (55 -> 330 ns).
  EXPECT_FALSE(compare(kiln_run, llama, {moment(40, 55), moment(42, 330), moment(41, 320)}).same_phase);
  // One thread: no round trips, the reads alone decide.
  EXPECT_TRUE(compare(kiln_run, llama, {moment(40, 0), moment(42, 0), moment(41, 0)}).same_phase);
  // Nothing measured: no phase and no fraction, and the rows say nothing of either.
  c = compare(kiln_run, llama);
  EXPECT_FALSE(c.same_phase);
  EXPECT_EQ(c.llama_cpp_roofline_fraction, 0);
  EXPECT_EQ(table_row(c).find("phase"), std::string::npos);
}

// The range over the rounds of one phase beside the range over all of them.
TEST(BenchLlamaCpp, RoundsOfOnePhaseGetTheirOwnRange) {
  ModelBenchResult kiln_run;
  kiln_run.weight_bytes_per_token = 1e6;
  kiln_run.read_bytes_per_s = 35e9;
  LlamaCppBenchResult llama;
  llama.prefill_tokens_per_s = 100;
  llama.decode_tokens_per_s = 100;
  auto round = [&](double prefill, double decode, bool one_phase) {
    kiln_run.prefill_tokens_per_s = prefill;
    kiln_run.decode_tokens_per_s = decode;
    return compare(kiln_run, llama,
                   {moment(35, 55), moment(35, 55), one_phase ? moment(35, 55) : moment(60, 330)});
  };
  LlamaCppRounds r = summarize({round(200, 110, true), round(300, 170, false), round(250, 90, true)});
  EXPECT_EQ(r.rounds, 3);
  EXPECT_DOUBLE_EQ(r.decode_ratio_min, 0.9);
  EXPECT_DOUBLE_EQ(r.decode_ratio_max, 1.7);
  EXPECT_EQ(r.same_phase_rounds, 2);
  EXPECT_DOUBLE_EQ(r.same_phase_decode_ratio_min, 0.9);
  EXPECT_DOUBLE_EQ(r.same_phase_decode_ratio_max, 1.1);
  EXPECT_DOUBLE_EQ(r.same_phase_prefill_ratio_min, 2.0);
  EXPECT_DOUBLE_EQ(r.same_phase_prefill_ratio_max, 2.5);
  EXPECT_NE(table_row(r).find("over 2 of one phase"), std::string::npos) << table_row(r);
  EXPECT_NE(table_row(r).find("0.90-1.10x"), std::string::npos) << table_row(r);
  EXPECT_EQ(to_json(r).at("same_phase_rounds"), 2);
  // No round of one phase: no such row, zeros in the JSON.
  r = summarize({round(200, 110, false), round(300, 170, false)});
  EXPECT_EQ(r.same_phase_rounds, 0);
  EXPECT_EQ(r.same_phase_decode_ratio_max, 0);
  EXPECT_EQ(table_row(r).find("of one phase"), std::string::npos) << table_row(r);
}

// Counts, thread counts and speeds are checked before they are converted (a float far outside an
// int's range would be undefined behaviour to convert): each refusal names the test and the key.
TEST(BenchLlamaCpp, FiguresOutOfRangeAreRefusedNamingTheTestAndKey) {
  const std::string pp = R"({"n_prompt": 4, "n_gen": 0, "avg_ts": 10})";
  auto parse = [](const std::string& text) { return parse_llama_bench_json(text, "llama-bench"); };
  expect_error<ExecutionError>([&] { parse("[" + pp + R"(, {"n_prompt": 0, "n_gen": 1e300, "avg_ts": 1}])"); },
                               {"llama-bench: test 1 has 'n_gen'", "outside [0, 1073741824]"});
  expect_error<ExecutionError>([&] { parse(R"([{"n_prompt": -4, "n_gen": 0, "avg_ts": 1}])"); },
                               "test 0 has 'n_prompt' -4");
  expect_error<ExecutionError>([&] { parse("[" + pp + R"(, {"n_prompt": 0, "n_gen": 4, "avg_ts": -2.5}])"); },
                               "test 1 has 'avg_ts' -2.5");
  expect_error<ExecutionError>(
      [&] { parse(R"([{"n_prompt": 4, "n_gen": 0, "avg_ts": 10, "n_threads": 1e12}])"); },
      "test 0 has 'n_threads' 1000000000000, outside [0, 65536]");
  const LlamaCppBenchResult r = parse("[" + pp + R"(, {"n_prompt": 0, "n_gen": 4, "avg_ts": 2, "n_threads": 3}])");
  EXPECT_EQ(r.threads, 3);
  EXPECT_EQ(r.prefill_tokens_per_s, 10);
  EXPECT_EQ(r.decode_tokens_per_s, 2);
}

TEST(BenchLlamaCpp, FailuresNameTheProgramAndWhatWentWrong) {
  kiln::testing::TempDir dir("llama_bench_errors");
  const std::filesystem::path gguf = dir.path() / "model.gguf";
  const auto failing = write_script(dir.path(), "failing", "echo 'error: unknown model architecture' >&2\nexit 3\n");
  std::ofstream(gguf) << "GGUF";
  auto options = [&](const std::filesystem::path& program) {
    return LlamaCppBenchOptions{.llama_bench = program, .gguf = gguf, .threads = 1, .prompt_tokens = 4, .gen_tokens = 2};
  };
  expect_error<ExecutionError>([&] { run_llama_bench(options(failing)); },
                               {failing.string(), "exit status 3", "unknown model architecture"});
  const auto chatty = write_script(dir.path(), "chatty", "echo 'not json'\n");
  expect_error<ExecutionError>([&] { run_llama_bench(options(chatty)); }, {chatty.string(), "not JSON"});
  const auto no_tg = write_script(dir.path(), "no_tg", "echo '[{\"n_prompt\": 4, \"n_gen\": 0, \"avg_ts\": 9}]'\n");
  expect_error<ExecutionError>([&] { run_llama_bench(options(no_tg)); }, "no prompt (pp) and generation (tg) test");
  const auto no_speed = write_script(dir.path(), "no_speed", "echo '[{\"n_prompt\": 4, \"n_gen\": 0}]'\n");
  expect_error<ExecutionError>([&] { run_llama_bench(options(no_speed)); }, "test 0 has no number 'avg_ts'");
  // A llama-bench that ignored -d (its tests say no depth) decoded from an empty context.
  const auto no_depth = write_script(
      dir.path(), "no_depth", "echo '[{\"n_prompt\": 4, \"n_gen\": 0, \"avg_ts\": 9}, {\"n_prompt\": 0, \"n_gen\": 2, \"avg_ts\": 3}]'\n");
  expect_error<ExecutionError>([&] { run_llama_bench(options(no_depth)); },
                               {no_depth.string(), "ran after 0 tokens of context, not the 4 asked"});
  expect_error<ValueError>([&] { run_llama_bench(options(gguf)); }, "is not an executable file");
  expect_error<ValueError>([&] { run_llama_bench(options(dir.path() / "absent")); }, "is not an executable file");
  LlamaCppBenchOptions no_model = options(chatty);
  no_model.gguf = dir.path() / "absent.gguf";
  expect_error<ValueError>([&] { run_llama_bench(no_model); }, "no GGUF file");
}

TEST(BenchModel, MoreTokensThanTheModelsPositionsIsAClearError) {
  const BandwidthResult bandwidth;
  expect_error<ValueError>(
      [&] {
        bench_model({.model = "stories15M", .threads = 1, .prompt_tokens = 200, .gen_tokens = 64}, bandwidth);
      },
      "200 prompt + 64 generated tokens exceed stories15M's 256 positions");
}

// ---- the command's output ----

// Runs `kiln bench ARGS...` through BenchCommand and returns what it printed.
std::string run_bench(std::vector<std::string> args) {
  CLI::App app;
  BenchCommand cmd(app);
  args.insert(args.begin(), "bench");
  std::reverse(args.begin(), args.end());  // CLI11 takes the arguments reversed from a vector
  app.parse(args);
  EXPECT_TRUE(cmd.selected());
  std::ostringstream out;
  std::streambuf* old = std::cout.rdbuf(out.rdbuf());
  try {
    cmd.run();
  } catch (...) {
    std::cout.rdbuf(old);
    throw;
  }
  std::cout.rdbuf(old);
  return out.str();
}

std::vector<nlohmann::json> json_lines(const std::string& text) {
  std::vector<nlohmann::json> out;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) out.push_back(nlohmann::json::parse(line));
  return out;
}

TEST(BenchCommand, GemmJsonIsOneObjectPerThreadCount) {
  auto lines = json_lines(run_bench(
      {"gemm", "--m", "3", "--n", "8", "--k", "16", "--threads", "1,2", "--min-seconds", "0.001", "--json"}));
  ASSERT_EQ(lines.size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(lines[i]["kind"], "gemm");
    EXPECT_EQ(lines[i]["m"], 3);
    EXPECT_EQ(lines[i]["n"], 8);
    EXPECT_EQ(lines[i]["k"], 16);
    EXPECT_EQ(lines[i]["dtype"], "f32");
    EXPECT_EQ(lines[i]["threads"], static_cast<int>(i + 1));
    EXPECT_GT(lines[i]["gflops"].get<double>(), 0);
    EXPECT_TRUE(lines[i]["onednn_gflops"].is_number() || lines[i]["onednn_gflops"].is_null());
  }
}

// The one-command comparison: a model row, then llama-bench's figures and kiln's over them.
TEST(BenchCommand, CompareLlamaCppPrintsLlamaBenchsFiguresAndTheRatios) {
  kiln::testing::TempDir dir("bench_compare");
  const std::filesystem::path gguf = dir.path() / "stories15M.gguf";
  const auto fake = write_script(dir.path(), "llama-bench", kFakeLlamaBench);
  std::ofstream(gguf) << "GGUF";
  const std::vector<std::string> common = {"--model", "stories15M", "--threads", "1", "--prompt-tokens", "5",
                                           "--gen-tokens", "3", "--repetitions", "1"};
  auto with = [&](std::vector<std::string> extra) {
    std::vector<std::string> args = common;
    args.insert(args.end(), extra.begin(), extra.end());
    return args;
  };
  auto lines = json_lines(run_bench(with({"--compare-llama-cpp", fake.string(), "--llama-cpp-model", gguf.string(), "--json"})));
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_EQ(lines[0]["kind"], "model");
  EXPECT_EQ(lines[1]["kind"], "llama_cpp");
  EXPECT_EQ(lines[1]["gguf"], gguf.string());
  EXPECT_DOUBLE_EQ(lines[1]["decode_ratio"].get<double>(), lines[0]["decode_tokens_per_s"].get<double>() / 25.0);
  EXPECT_DOUBLE_EQ(lines[1]["prefill_ratio"].get<double>(), lines[0]["prefill_tokens_per_s"].get<double>() / 100.5);
  EXPECT_EQ(lines[1]["decode_depth"], 5);  // after the prompt, as kiln's decode
  EXPECT_EQ(lines[0]["kv_dtype"], "f32");
  EXPECT_EQ(lines[1]["kv_type"], "f16");  // llama-bench's own: it has no f32 cache
  // --kv-dtype sets kiln's cache and, being one llama-bench has, llama-bench's.
  lines = json_lines(run_bench(
      with({"--compare-llama-cpp", fake.string(), "--llama-cpp-model", gguf.string(), "--kv-dtype", "bf16", "--json"})));
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_EQ(lines[0]["kv_dtype"], "bf16");
  EXPECT_EQ(lines[1]["kv_type"], "bf16");
  EXPECT_EQ(lines[1]["kiln_kv_dtype"], "bf16");
  expect_error<ValueError>([&] { run_bench(with({"--kv-dtype", "q8_0"})); }, "--kv-dtype must be f32, bf16 or f16, got 'q8_0'");
  expect_error<ValueError>([&] { run_bench(with({"--compare-llama-cpp", fake.string()})); },
                           "--compare-llama-cpp needs a GGUF file: 'stories15M' is not one");
  expect_error<ValueError>([&] { run_bench(with({"--llama-cpp-model", gguf.string()})); },
                           "--llama-cpp-model is the file --compare-llama-cpp runs");
  expect_error<ValueError>(
      [&] {
        run_bench(with({"--compare-llama-cpp", fake.string(), "--llama-cpp-model", gguf.string(), "--concurrency", "2"}));
      },
      "--compare-llama-cpp compares single streams");
}

TEST(BenchCommand, BandwidthJsonAndTable) {
  auto lines =
      json_lines(run_bench({"bandwidth", "--threads", "1", "--buffer-mib", "4", "--passes", "2", "--json"}));
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_EQ(lines[0]["kind"], "bandwidth");
  EXPECT_EQ(lines[0]["buffer_bytes"], 4 << 20);
  EXPECT_GT(lines[0]["read_gb_per_s"].get<double>(), 0);
  // Every pattern's figure, keyed by its streams per thread; the result is the fastest one's.
  const nlohmann::json& by_streams = lines[0]["read_gb_per_s_by_streams"];
  ASSERT_EQ(by_streams.size(), 4u) << by_streams.dump();
  const std::string best = std::to_string(lines[0]["streams_per_thread"].get<int>());
  ASSERT_TRUE(by_streams.contains(best)) << by_streams.dump();
  EXPECT_EQ(by_streams[best].get<double>(), lines[0]["read_gb_per_s"].get<double>());
  for (const char* streams : {"1", "2", "4", "8"})
    EXPECT_LE(by_streams[streams].get<double>(), lines[0]["read_gb_per_s"].get<double>()) << streams;
  EXPECT_EQ(lines[0]["core_round_trip_ns"].get<double>(), 0);  // one thread

  const std::string table = run_bench({"bandwidth", "--threads", "1", "--buffer-mib", "4", "--passes", "1"});
  EXPECT_NE(table.find("read GB/s"), std::string::npos) << table;
  EXPECT_NE(table.find("oneDNN"), std::string::npos) << table;  // the preamble says which oneDNN, or none
}

TEST(BenchCommand, ModelJsonCarriesTheFiguresTheIssueAsksFor) {
  auto lines = json_lines(run_bench({"--model", "stories15M", "--threads", "1", "--prompt-tokens", "4",
                                     "--gen-tokens", "2", "--repetitions", "1", "--json"}));
  ASSERT_EQ(lines.size(), 1u);
  const nlohmann::json& j = lines[0];
  EXPECT_EQ(j["kind"], "model");
  EXPECT_EQ(j["model"], "stories15M");
  EXPECT_EQ(j["dtype"], "f32");
  EXPECT_EQ(j["params"], 15191712);
  for (const char* key : {"prefill_tokens_per_s", "decode_tokens_per_s", "roofline_fraction", "read_gb_per_s",
                          "roofline_tokens_per_s"})
    EXPECT_GT(j[key].get<double>(), 0) << key;
  EXPECT_NEAR(j["roofline_fraction"].get<double>(),
              j["decode_tokens_per_s"].get<double>() * 60768000.0 / (j["read_gb_per_s"].get<double>() * 1e9),
              1e-9);
  EXPECT_FALSE(j.contains("decode_profile")) << "only with --profile";
  EXPECT_FALSE(j.contains("paired_roofline")) << "only with --paired-roofline";
}

TEST(BenchCommand, PairedRooflineJsonAndTable) {
  auto lines = json_lines(run_bench({"--model", "stories15M", "--threads", "1", "--prompt-tokens", "4",
                                     "--gen-tokens", "3", "--repetitions", "1", "--paired-roofline", "--json"}));
  ASSERT_EQ(lines.size(), 1u);
  const nlohmann::json& paired = lines[0]["paired_roofline"];
  EXPECT_EQ(paired["steps"], 3);
  for (const char* key : {"read_gb_per_s_median", "fraction_median", "fraction_p10", "fraction_p90"})
    EXPECT_GT(paired[key].get<double>(), 0) << key;
  ModelBenchResult r;
  r.paired = PairedRoofline{.steps = 64, .read_bytes_per_s_median = 55.04e9, .fraction_median = 0.8123,
                            .fraction_p10 = 0.7512, .fraction_p90 = 0.8834};
  const std::string row = table_row(r);
  for (const char* part : {"81.2% of its bandwidth", "75.1-88.3%", "64 steps", "55.0 GB/s"})
    EXPECT_NE(row.find(part), std::string::npos) << "row: " << row << "\nmissing: " << part;
  expect_error<ValueError>([] { run_bench({"--model", "stories15M", "--paired-roofline", "--concurrency", "2"}); },
                           "--paired-roofline pairs single-stream decode steps; leave out --concurrency");
}

TEST(BenchCommand, ProfileJsonListsEachOpsShare) {
  auto lines = json_lines(run_bench({"--model", "stories15M", "--threads", "1", "--prompt-tokens", "4",
                                     "--gen-tokens", "2", "--repetitions", "1", "--profile", "--json"}));
  ASSERT_EQ(lines.size(), 1u);
  const nlohmann::json& profile = lines[0]["decode_profile"];
  ASSERT_TRUE(profile.is_array());
  ASSERT_FALSE(profile.empty());
  for (const auto& e : profile)
    for (const char* key : {"graph", "op", "launches_per_token", "seconds_per_token", "fraction"})
      EXPECT_TRUE(e.contains(key)) << key << " in " << e.dump();
}

TEST(BenchCommand, TableRowsShowEachFigure) {
  ModelBenchResult r;
  r.model = "stories15M";
  r.dtype = "q4_k+q6_k";
  r.threads = 2;
  r.parameters = 15191712;
  r.weight_bytes_per_token = 60768000.0;
  r.prefill_tokens_per_s = 5512.34;
  r.decode_tokens_per_s = 380.0;
  r.read_bytes_per_s = 40e9;
  r.roofline_tokens_per_s = 658.2;
  r.roofline_fraction = 0.5773;
  const std::string row = table_row(r);
  for (const char* part : {"stories15M", "q4_k+q6_k", "15.2M", "60.8", "5512.3", "380.0", "40.0", "658.2", "57.7%"})
    EXPECT_NE(row.find(part), std::string::npos) << "row: " << row << "\nmissing: " << part;
  GemmBenchResult g;
  g.m = g.n = g.k = 1024;
  g.gflops = 150;
  g.onednn_gflops = 200;
  EXPECT_NE(table_row(g).find("0.75"), std::string::npos) << table_row(g);
  g.onednn_gflops.reset();
  EXPECT_NE(table_row(g).find("n/a"), std::string::npos) << table_row(g);
}

TEST(BenchCommand, BadArgumentsNameTheChoices) {
  expect_error<ValueError>([] { run_bench({"--model", "nope"}); }, {"unknown model 'nope'", "llama-1B"});
  expect_error<ValueError>(
      [] {
        run_bench({"--model", "stories15M", "--dtype", "f8"});
      },
      {"'f8'", "f32, f16, bf16, q8_0, q4_0, q4_k, q5_k or q6_k"});
  expect_error<ValueError>(
      [] {
        run_bench({"gemm", "--dtype", "f16"});
      },
      "unknown dtype 'f16' (choose f32 or bf16)");
  expect_error<ValueError>([] { run_bench({}); }, "give --model");
}

}  // namespace
}  // namespace kiln::bench
