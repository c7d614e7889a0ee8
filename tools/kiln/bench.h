// `kiln bench`: how fast kiln runs on this machine, beside what bounds it, measured in the same run.
//   kiln bench --model stories15M,DIR --threads 1,2 [--dtype f32] [--prompt-tokens 128]
//              [--gen-tokens 64] [--repetitions 3] [--concurrency 1,4,16,64] [--json]
//       prefill and decode tokens/s; each (model, threads) first measures the streaming read
//       bandwidth, so decode is also a fraction of its roofline (weight bytes per token / bandwidth)
//   kiln bench gemm --m 1024 --n 1024 --k 1024 [--dtype f32|bf16] [--threads 1,2] [--json]
//       GFLOP/s of a one-matmul kiln graph (weights [N, K], as nn::Linear) beside oneDNN's
//   kiln bench bandwidth [--threads 1,2] [--buffer-mib 1024] [--passes 10] [--json]
// Human output is one table row per result; --json prints one JSON object per line instead.
// docs/bench.md says what each figure means.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kiln/graph/dtype.h"
#include "kiln/nn/transformer.h"
#include "kiln/nn/weight_format.h"

namespace CLI {
class App;
}

namespace kiln::bench {

// ---- weight formats and the bytes a decode step reads ---------------------------------------------

// How a model's weight matrices are stored (nn::WeightFormat: f32, f16, bf16, or ggml's quantized
// blocks: q8_0's 34 bytes per 32 weights, q4_0's 18, q4_k's 144 per 256, q5_k's 176, q6_k's 210).
using nn::WeightFormat;
double bytes_per_weight(WeightFormat format);

// Parameters of a Llama-family model: every weight the model declares (a tied lm_head counted once).
int64_t parameter_count(const nn::LlamaConfig& config);
// Bytes of weights one decode step reads: every matrix and bias in `format`, norm weights in f32
// (they stay f32 in every format, as in ggml), the embedding row of the new token, and the lm_head
// (the embedding table itself when tied). The KV cache is not counted.
// Each matrix in its format: config.weight_formats' entry, else `format` (with its fallback for
// rows that are not whole blocks, nn::model_weight_format).
double decode_weight_bytes(const nn::LlamaConfig& config, WeightFormat format);

// The decode speed at which reading the weights takes all of the read bandwidth.
double roofline_tokens_per_s(double weight_bytes_per_token, double read_bytes_per_s);

// ---- streaming read bandwidth ----------------------------------------------------------------------

struct BandwidthResult {
  int threads = 1;
  int64_t buffer_bytes = 0;
  int streams_per_thread = 0;  // the read pattern of read_bytes_per_s
  int passes = 0;              // per pattern
  double read_bytes_per_s = 0;  // the best pass of the fastest pattern
  std::vector<std::pair<int, double>> read_bytes_per_s_by_streams;  // (streams per thread, its best pass)
  double core_round_trip_ns = 0;  // measure_core_round_trip() right after the reads (threads >= 2; else 0)
};

// Nanoseconds for a cache line to go from one thread to another and back, the two threads pinned to
// the first two CPUs this process may run on; 0 when it may run on fewer than 2. On a VM whose host
// moves its vCPUs, it tells whether they share a last-level cache, and with it the path to memory:
// on the 2-vCPU Zen 4 hosts 66-96 ns on one CCD, where two threads read 31-37 GB/s together, about
// what one reads alone, and 305-341 ns on two CCDs, each with its own link (58-69 GB/s together).
double measure_core_round_trip(int round_trips = 20000);

// A buffer each of `threads` threads reads its own slice of (first touched by that thread, huge pages
// advised), as many times as asked: the reads of measure_read_bandwidth, and the read paired with
// each decode step by ModelBenchOptions::paired_roofline. ValueError for threads < 1 or a buffer too
// small to split into 8 streams of whole 64-byte vectors per thread.
class BandwidthProbe {
 public:
  BandwidthProbe(int threads, int64_t buffer_bytes);
  ~BandwidthProbe();
  BandwidthProbe(const BandwidthProbe&) = delete;
  BandwidthProbe& operator=(const BandwidthProbe&) = delete;
  int64_t bytes() const;  // buffer_bytes rounded down to whole streams
  // One pass over the whole buffer, every thread its slice as 1, 2, 4 or 8 interleaved streams (else
  // ValueError); bytes per second from the first thread starting to the last one done.
  double read(int streams_per_thread);

 private:
  struct Buffer;
  void on_each_thread(const std::function<void(int, std::byte*)>& fn);
  int threads_;
  int64_t slice_bytes_ = 0;
  std::unique_ptr<Buffer> buffer_;
};

// Each thread sums its own slice of a buffer (first touched by that thread, huge pages advised),
// reading it as 1, 2, 4 and 8 interleaved streams with vector loads in turn; each pattern's best of
// `passes` timed passes, all threads together, and the fastest pattern's figure as the result.
// ValueError for threads < 1, passes < 1 or a buffer too small.
BandwidthResult measure_read_bandwidth(int threads, int64_t buffer_bytes = int64_t{1} << 30, int passes = 5);

// ---- model benchmark ---------------------------------------------------------------------------------

// --kv-dtype (kiln bench, generate, serve, chat): how the paged KV cache stores keys and values.
// ValueError naming the flag for anything but f32, bf16, f16.
DType parse_kv_dtype(const std::string& name);

struct ModelBenchOptions {
  std::string model;  // a named shape (pipelines::named_config_names()), a model directory or a GGUF file
  // nullopt: as the checkpoint stores its weights (a GGUF file's formats, each matrix in its own;
  // f32 for a safetensors directory and for the random weights of a named shape).
  std::optional<WeightFormat> format = std::nullopt;
  int threads = 1;
  int64_t prompt_tokens = 128;
  int64_t gen_tokens = 64;
  int repetitions = 3;
  uint64_t seed = 0;
  DType kv_dtype = DType::f32;  // the paged KV cache's (f32, bf16 or f16), as `kiln generate --kv-dtype`
  bool profile = false;  // after the timed runs, one more generation with its decode profiled
  // After the timed runs, one more generation with a read of the machine's memory after every decode
  // step (ModelBenchResult::paired): the step's speed against the bandwidth of the same second.
  bool paired_roofline = false;
};

// Decode steps each paired with a read of at least the weights' bytes right after it (one stream
// pattern: the one the bandwidth measured before the model read fastest with). Where the memory's
// speed drifts within a run, each step's fraction is of the bandwidth of its own moment. The read
// evicts the caches, so a model small enough to stay partly in them reads less than it would.
struct PairedRoofline {
  int64_t steps = 0;
  double read_bytes_per_s_median = 0;  // of the paired reads
  // Each step's weight bytes per second over its paired read's rate: median, 10th and 90th percentiles.
  double fraction_median = 0;
  double fraction_p10 = 0;
  double fraction_p90 = 0;
};

// One line of a decode profile: an op's kernel launches (or another part of a decode step) per token.
struct DecodeProfileEntry {
  std::string graph;  // "model", "greedy", ...; empty for the pipeline's own work between graphs
  std::string op;     // op name, "(run)" for a graph run's work outside its kernels, "(pipeline)"
  double launches_per_token = 0;
  double seconds_per_token = 0;
  double fraction = 0;  // of the decode step's wall-clock time
  // Each launch's weight operands (StepProfile::weight_bytes): an op's steps are one line per size,
  // so a model's matrices of one kind (every layer's down projection) share a line.
  int64_t weight_bytes_per_launch = 0;
  // The rate those bytes were read at (0 for ops without weights, or that read only some rows).
  double weight_bytes_per_s() const;
};

struct ModelBenchResult {
  std::string model;
  std::string dtype;  // the weight format ("q4_k"), or a file's mix as stored ("q4_k+q6_k")
  std::string kv_dtype = "f32";
  int threads = 1;
  int64_t parameters = 0;
  double weight_bytes_per_token = 0;
  int64_t prompt_tokens = 0;
  int64_t gen_tokens = 0;
  int repetitions = 0;
  double prefill_tokens_per_s = 0;  // best of the repetitions
  double decode_tokens_per_s = 0;   // best of the repetitions
  double read_bytes_per_s = 0;      // measured just before, same threads
  double roofline_tokens_per_s = 0;
  double roofline_fraction = 0;  // decode_tokens_per_s / roofline_tokens_per_s
  std::vector<DecodeProfileEntry> decode_profile;  // with ModelBenchOptions::profile, slowest first
  std::optional<PairedRoofline> paired;            // with ModelBenchOptions::paired_roofline
  // Prompt tokens the engine took from its prefix cache over the runs: 0, since the bench turns the
  // cache off (every repetition repeats the prompt, and a hit would skip the prefill it times).
  int64_t cached_prompt_tokens = 0;
};

// The model's config for a name or a directory; ValueError listing the known names otherwise.
nn::LlamaConfig resolve_model_config(const std::string& model);
// Greedy generation of gen_tokens after a seeded prompt of prompt_tokens ids, after one untimed
// warm-up; `bandwidth` (measured with the same threads) gives the roofline. ValueError for bad
// options; DTypeError for a weight format the model cannot run yet.
ModelBenchResult bench_model(const ModelBenchOptions& options, const BandwidthResult& bandwidth);

// ---- many requests at once (the generation engine) ----------------------------------------------------

// `kiln bench --model M --concurrency 1,4,16,64`: at each level that many requests (seeded prompts of
// prompt_tokens, distinct so no prefix is shared; gen_tokens + 1 greedy tokens each, EOS ignored) are
// submitted together to one engine.
struct ConcurrencyBenchResult {
  std::string model;
  std::string dtype;  // as ModelBenchResult's
  int threads = 1;
  int64_t concurrency = 1;
  int64_t prompt_tokens = 0;
  int64_t gen_tokens = 0;
  double seconds = 0;             // from the submissions to the last token
  int64_t output_tokens = 0;      // over all requests
  double output_tokens_per_s = 0;  // output_tokens / seconds: prefill included
  // The decode phase: every token after each request's first, over the time from the first request's
  // first token to the last request's last (0 when no request made a second token).
  double aggregate_decode_tokens_per_s = 0;
  // Every request decoding: tokens made from the moment the last request had its first token to the
  // moment the first one finished, over that time (0 when the two do not overlap). No prefill of
  // this level falls inside it, so this is the rate of `concurrency` streams decoding together.
  double steady_decode_tokens_per_s = 0;
  int64_t steady_decode_tokens = 0;  // the tokens of that window
  double ttft_p50_s = 0, ttft_p99_s = 0;     // time to first token, over the requests
  double tpot_p50_s = 0, tpot_p99_s = 0;     // time per output token after the first
  int64_t kv_blocks_peak = 0;                // most KV blocks in use at once
  int64_t kv_blocks_total = 0;
  int64_t preemptions = 0;
  int64_t steps = 0;  // engine steps the level took
  std::vector<DecodeProfileEntry> step_profile;  // with ModelBenchOptions::profile: per engine step
};
// One engine for all levels (its max_num_seqs is the highest level). ValueError for bad options.
std::vector<ConcurrencyBenchResult> bench_concurrency(const ModelBenchOptions& options,
                                                      const std::vector<int64_t>& levels);

// ---- llama.cpp beside kiln (--compare-llama-cpp) -------------------------------------------------------

struct LlamaCppBenchOptions {
  std::filesystem::path llama_bench;  // llama.cpp's llama-bench executable
  std::filesystem::path gguf;         // the model file it runs
  int threads = 1;
  int64_t prompt_tokens = 128;
  int64_t gen_tokens = 64;
  int repetitions = 3;
  // kiln's KV cache dtype: llama-bench's cache is given the same where it has it (f16, bf16); for f32,
  // which llama-bench's -ctk does not take, it keeps its default (f16: half kiln's KV bytes).
  DType kv_dtype = DType::f32;
};

struct LlamaCppBenchResult {
  std::string llama_bench, gguf, build_commit;
  int threads = 0;
  int64_t prompt_tokens = 0, gen_tokens = 0;
  // The context its generation test decoded after (llama-bench's n_depth): kiln decodes after its
  // prompt, so llama-bench is asked for the same depth; a test from an empty context attends over
  // fewer keys and reads less of its KV cache than kiln's steps do.
  int64_t decode_depth = 0;
  std::string kv_type;  // its K cache's type ("f16", "bf16"), as it reports it; empty if it did not
  // llama-bench's mean over its repetitions; the better of its two load modes (mmap, and weights
  // read into memory), as shared/anchors/README.md takes llama.cpp's figure.
  double prefill_tokens_per_s = 0;
  double decode_tokens_per_s = 0;
};

// llama-bench's arguments for the comparison: a prompt test (`-p P -n 0`) and a generation test after
// a context of the prompt's length (`-p 0 -n N -d P`), each `-m GGUF -t T -r R -mmp 0,1 -o json`, with
// `-ctk X -ctv X` where kiln's KV dtype is one llama-bench has. Two runs, since one run's depths apply
// to all its tests and kiln's prefill starts from an empty context.
std::vector<std::vector<std::string>> llama_bench_runs(const LlamaCppBenchOptions& options);
// Runs llama_bench_runs (no shell) and reads their figures. ValueError for a path that is not an
// executable or a GGUF file that is not there; ExecutionError when a run fails (its exit status and
// the tail of its stderr), prints no pp and tg speeds, or decoded after another depth than asked.
LlamaCppBenchResult run_llama_bench(const LlamaCppBenchOptions& options);
// The figures of llama-bench's JSON output; `source` names it in errors.
LlamaCppBenchResult parse_llama_bench_json(const std::string& text, const std::string& source);

// Two runs saw the same memory when their reads are within this factor of each other: a shared
// host's bandwidth moves between phases (on the 2-vCPU Zen 4 hosts about 31-37 GB/s and 58-69 GB/s),
// and within a phase by less than this.
inline constexpr double kSamePhaseReadRatio = 1.2;
// ... and their threads' round trips within this factor (measure_core_round_trip: ~6x apart between
// one CCD and two on Zen 4).
inline constexpr double kSamePhaseRoundTripRatio = 2.0;

// kiln's figures over llama.cpp's, both from the same run.
struct LlamaCppComparison {
  ModelBenchResult kiln;
  LlamaCppBenchResult llama_cpp;
  double prefill_ratio = 0;  // kiln / llama.cpp
  double decode_ratio = 0;
  // The round's reads and round trips (RoundReads; 0: not measured); the read bandwidth beside
  // llama-bench's run (the better of the reads just before and just after it, as kiln's), llama.cpp's
  // decode against the roofline it gives (kiln's weight bytes per token), and whether the whole round
  // saw one phase of the memory (its three reads within kSamePhaseReadRatio, its round trips within
  // kSamePhaseRoundTripRatio): a ratio across two phases says more about the host than about either.
  double reads[3] = {0, 0, 0};
  double round_trips_ns[3] = {0, 0, 0};
  double llama_cpp_read_bytes_per_s = 0;
  double llama_cpp_roofline_fraction = 0;
  bool same_phase = false;
};
// A round's measures of the memory (BandwidthResult's read and round trip): just before kiln's run,
// between kiln's and llama-bench's, and just after llama-bench's.
struct RoundReads {
  BandwidthResult before, between, after;
};
LlamaCppComparison compare(const ModelBenchResult& kiln, const LlamaCppBenchResult& llama_cpp,
                           const RoundReads& reads = {});

// The ratios of several rounds of one model, kiln and llama-bench alternated (--rounds): on a shared
// machine whose bandwidth drifts from minute to minute, a range over rounds says what one pair cannot.
struct LlamaCppRounds {
  std::string model, dtype;
  int threads = 0;
  int rounds = 0;
  double prefill_ratio_min = 0, prefill_ratio_max = 0;
  double decode_ratio_min = 0, decode_ratio_max = 0;
  // The same over the rounds whose two runs saw the same memory (LlamaCppComparison::same_phase);
  // 0 when none did.
  int same_phase_rounds = 0;
  double same_phase_prefill_ratio_min = 0, same_phase_prefill_ratio_max = 0;
  double same_phase_decode_ratio_min = 0, same_phase_decode_ratio_max = 0;
};
// ValueError for no rounds.
LlamaCppRounds summarize(const std::vector<LlamaCppComparison>& rounds);

// ---- GEMM benchmark ----------------------------------------------------------------------------------

struct GemmBenchOptions {
  int64_t m = 1024, n = 1024, k = 1024;
  DType dtype = DType::f32;  // f32 or bf16 (both operands and the result)
  // Set: f32 activations and result against a weight in this format (a model's projections;
  // `dtype` is then f32), timed without oneDNN. Decode batches: M = 1..64 reads each weight once.
  std::optional<nn::WeightFormat> weights = std::nullopt;
  int threads = 1;
  double min_seconds = 0.5;  // each side repeats until this much time is spent (at least 3 runs)
};

struct GemmBenchResult {
  int64_t m = 0, n = 0, k = 0;
  DType dtype = DType::f32;
  std::optional<nn::WeightFormat> weights;  // as in the options
  int threads = 1;
  int64_t weight_bytes = 0;             // bytes of W: N x K elements, or N Q8_0 rows
  int repetitions = 0;                  // kiln's timed runs
  double seconds = 0;                   // kiln's best run
  double gflops = 0;                    // 2 m n k / seconds
  double weight_gb_per_s = 0;           // weight_bytes / seconds: W read once per call
  std::optional<double> onednn_gflops;  // nullopt: oneDNN not available in this build, or see onednn_note
  std::string onednn_note;              // why oneDNN has no figure though it is built in (its error)
  double peak_gflops = 0;               // measure_peak_gflops(threads, dtype) in the same run
  // bf16 on a CPU with AVX512_BF16 (and bf16 weights above 8 rows where the GEMM multiplies them in
  // bf16): the vdpbf16ps peak (measure_bf16_dot_peak_gflops) in the same run, ANCHORS.md's "bf16 dot
  // peak". On AMX CPUs kiln's bf16 GEMM runs on the tiles, whose peak is peak_gflops; this one says
  // what the vector bf16 unit could do.
  std::optional<double> bf16_dot_peak_gflops;
};

// The machine's multiply-add peak on `threads` threads for `dtype`'s GEMM, timed in short passes;
// the best pass, all threads together, in GFLOP/s. f32 (and bf16 on CPUs without a bf16 unit, where
// kiln widens bf16 to f32): independent chains of the widest FMA (AVX-512, AVX2 or SSE), 2 FLOPs per
// lane. bf16 with AMX: four independent tdpbf16ps tile chains. bf16 where kiln's GEMM uses
// vdpbf16ps (AMD; measure_bf16_dot_peak_gflops). ValueError for threads < 1.
double measure_peak_gflops(int threads, int passes = 200, DType dtype = DType::f32);
// Independent vdpbf16ps chains (two multiply-adds per f32 lane, 4 FLOPs); ValueError on a CPU
// without AVX512_BF16 or for threads < 1.
double measure_bf16_dot_peak_gflops(int threads, int passes = 200);

// C[M, N] = A[M, K] @ W[N, K]^T through a one-matmul graph compiled by an InferenceSession, then
// through oneDNN's matmul primitive with the same layout and thread count. Both results are checked
// against a double-precision dot product at sampled entries (ExecutionError when off).
GemmBenchResult bench_gemm(const GemmBenchOptions& options);
// "oneDNN 2.6.3 (OpenMP)" or "oneDNN: not available".
std::string onednn_description();

// ---- output --------------------------------------------------------------------------------------------

// One object per result; "kind" is "model", "gemm" or "bandwidth".
nlohmann::json to_json(const ModelBenchResult& r);
nlohmann::json to_json(const GemmBenchResult& r);
nlohmann::json to_json(const BandwidthResult& r);
nlohmann::json to_json(const ConcurrencyBenchResult& r);
std::string concurrency_table_header(int64_t prompt_tokens, int64_t gen_tokens);
std::string table_row(const ConcurrencyBenchResult& r);
std::string profile_table(const ConcurrencyBenchResult& r);  // empty without a profile
// Table rows for people, and the header line each table starts with.
std::string model_table_header(int64_t prompt_tokens, int64_t gen_tokens);
std::string table_row(const ModelBenchResult& r);
// The decode profile of r as an indented table (empty when r has none).
std::string profile_table(const ModelBenchResult& r);
std::string gemm_table_header();
std::string table_row(const GemmBenchResult& r);
nlohmann::json to_json(const LlamaCppComparison& c);
std::string table_row(const LlamaCppComparison& c);  // two lines: llama.cpp's figures, then the ratios
nlohmann::json to_json(const LlamaCppRounds& r);
std::string table_row(const LlamaCppRounds& r);  // the ratios' ranges, under the ratio columns
std::string bandwidth_table_header();
std::string table_row(const BandwidthResult& r);

// ---- the command ---------------------------------------------------------------------------------------

// Registers `bench` (and `bench gemm`, `bench bandwidth`) on the app; after parsing, selected() says
// whether it was chosen and run() runs it. The object must outlive parsing (it holds the options).
class BenchCommand {
 public:
  explicit BenchCommand(CLI::App& app);
  bool selected() const;
  int run() const;

 private:
  CLI::App* bench_ = nullptr;
  CLI::App* gemm_ = nullptr;
  CLI::App* bandwidth_ = nullptr;
  std::vector<std::string> models_;
  std::vector<std::string> dtypes_;  // empty: as stored
  std::vector<int> threads_{0};
  int64_t prompt_tokens_ = 128;
  int64_t gen_tokens_ = 64;
  int repetitions_ = 3;
  int rounds_ = 1;
  uint64_t seed_ = 0;
  std::string kv_dtype_ = "f32";
  bool profile_ = false;
  bool paired_roofline_ = false;
  std::vector<int64_t> concurrency_;
  std::string compare_llama_cpp_;  // llama-bench's path
  std::string llama_cpp_model_;    // the GGUF it runs, when --model is not one
  std::vector<int64_t> m_{1024};
  int64_t n_ = 1024, k_ = 1024;
  std::vector<std::string> weights_;
  double min_seconds_ = 0.5;
  int64_t buffer_mib_ = 1024;
  int passes_ = 10;
  bool json_ = false;
};

}  // namespace kiln::bench
