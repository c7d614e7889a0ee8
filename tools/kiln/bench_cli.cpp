// The `kiln bench` command: its options, and the runs they select, each result printed as it comes.
// What a figure is set beside (bandwidth, peak) is measured in the same run: shared machines drift.
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <fstream>
#include <iostream>
#include <thread>

#include "bench.h"
#include "bench_internal.h"
#include "kiln/errors.h"
#include "kiln/pipelines/gguf.h"
#include "kiln/pipelines/text_generation.h"

namespace kiln::bench {

namespace {

int resolve_threads(int threads) {
  if (threads < 0) throw ValueError(fmt::format("kiln bench: --threads must be >= 0, got {}", threads));
  return threads == 0 ? static_cast<int>(std::max(1u, std::thread::hardware_concurrency())) : threads;
}

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

DType parse_kv_dtype(const std::string& name) {
  if (name == "f32") return DType::f32;
  if (name == "bf16") return DType::bf16;
  if (name == "f16") return DType::f16;
  throw ValueError(fmt::format("--kv-dtype must be f32, bf16 or f16, got '{}'", name));
}

BenchCommand::BenchCommand(CLI::App& app) {
  bench_ =
      app.add_subcommand("bench", "Benchmark models (tokens/s vs the bandwidth roofline), GEMM, bandwidth");
  bench_
      ->add_option("--model", models_,
                   fmt::format("model directory or random-weight shape ({}); comma-separated for several",
                               join(pipelines::named_config_names())))
      ->delimiter(',');
  bench_
      ->add_option("--dtype", dtypes_,
                   "weight dtype: f32, f16, bf16, q8_0, q4_0, q4_k, q5_k, q6_k, or stored (the checkpoint's own: "
                   "a GGUF file's formats; f32 otherwise, the default); comma-separated for several")
      ->delimiter(',');
  bench_->add_option("--prompt-tokens", prompt_tokens_, "prompt length (prefill)")->capture_default_str();
  bench_->add_option("--gen-tokens", gen_tokens_, "decode steps timed")->capture_default_str();
  bench_->add_option("--repetitions", repetitions_, "timed runs; the best is reported")
      ->capture_default_str();
  bench_
      ->add_option("--rounds", rounds_,
                   "measure each model this many times, one after another; with --compare-llama-cpp each round "
                   "is kiln then llama-bench, and a last line gives the range of the ratios")
      ->capture_default_str();
  bench_->add_option("--seed", seed_, "seed of the random weights and the prompt")->capture_default_str();
  bench_
      ->add_option("--kv-dtype", kv_dtype_,
                   "KV cache dtype: f32, bf16 or f16 (with --compare-llama-cpp, llama-bench's too where it has "
                   "it: bf16, f16)")
      ->capture_default_str();
  bench_
      ->add_option("--concurrency", concurrency_,
                   "requests submitted together to the generation engine, comma-separated levels (e.g. "
                   "1,4,16,64): aggregate tokens/s, TTFT and TPOT per level")
      ->delimiter(',');
  bench_
      ->add_option("--compare-llama-cpp", compare_llama_cpp_,
                   "llama.cpp's llama-bench: after each kiln run, run it on the same GGUF file (--model, or "
                   "--llama-cpp-model for a named shape), threads and token counts, and print kiln / llama.cpp")
      ->check(CLI::ExistingFile);
  bench_->add_option("--llama-cpp-model", llama_cpp_model_,
                     "the GGUF file llama-bench runs when --model is a named shape or a directory")
      ->check(CLI::ExistingFile);
  bench_->add_flag("--paired-roofline", paired_roofline_,
                   "after the timed runs, one more generation with a read of the memory after every decode step: "
                   "each step's speed against the bandwidth of its own moment");
  bench_->add_flag("--profile", profile_,
                   "after the timed runs, profile one more generation's decode: each op's time per token");

  gemm_ = bench_->add_subcommand("gemm", "GFLOP/s of C = A[M, K] @ W[N, K]^T: kiln beside oneDNN");
  gemm_->add_option("--m", m_, "rows of A and C; comma-separated for several")->delimiter(',')->capture_default_str();
  gemm_->add_option("--n", n_, "rows of W, columns of C")->capture_default_str();
  gemm_->add_option("--k", k_, "the inner dimension")->capture_default_str();
  gemm_->add_option("--dtype", dtypes_, "f32 (the default) or bf16")->delimiter(',');
  gemm_->add_option("--weights", weights_,
                    "f32 activations against weights in f32, f16, bf16, q8_0, q4_0, q4_k, q5_k, q6_k (comma-separated); no oneDNN")
      ->delimiter(',');
  gemm_->add_option("--min-seconds", min_seconds_, "time spent per side (best run reported)")
      ->capture_default_str();

  bandwidth_ =
      bench_->add_subcommand("bandwidth", "Streaming read bandwidth (1, 2, 4 and 8 interleaved streams per thread; the fastest)");
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
    if (dtypes_.empty()) dtypes.push_back(DType::f32);
    for (const auto& name : dtypes_) {
      if (name != "f32" && name != "bf16")
        throw ValueError(fmt::format("kiln bench gemm: unknown dtype '{}' (choose f32 or bf16)", name));
      dtypes.push_back(parse_dtype(name));
    }
    std::vector<std::optional<WeightFormat>> weights;
    for (const auto& name : weights_) weights.push_back(nn::parse_weight_format(name));
    if (weights.empty()) weights.push_back(std::nullopt);
    if (!weights_.empty()) dtypes = {DType::f32};
    print_preamble(json_);
    if (!json_) std::cout << gemm_table_header() << "\n";
    for (DType dtype : dtypes)
      for (const std::optional<WeightFormat>& w : weights)
        for (int64_t m : m_)
          for (int t : threads) {
            GemmBenchResult r = bench_gemm({.m = m, .n = n_, .k = k_, .dtype = dtype, .weights = w, .threads = t,
                                            .min_seconds = min_seconds_});
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
  std::vector<std::optional<WeightFormat>> formats;  // nullopt: as stored
  for (const auto& name : dtypes_)
    formats.push_back(name == "stored" ? std::nullopt : std::optional(nn::parse_weight_format(name)));
  if (formats.empty()) formats.push_back(std::nullopt);
  for (const auto& model : models_) resolve_model_config(model);
  if (rounds_ < 1) throw ValueError(fmt::format("kiln bench: --rounds must be >= 1, got {}", rounds_));
  if (rounds_ > 1 && !concurrency_.empty())
    throw ValueError("kiln bench: --rounds repeats the single-stream runs; leave out --concurrency");
  if (paired_roofline_ && !concurrency_.empty())
    throw ValueError("kiln bench: --paired-roofline pairs single-stream decode steps; leave out --concurrency");
  const DType kv_dtype = parse_kv_dtype(kv_dtype_);
  if (!llama_cpp_model_.empty() && compare_llama_cpp_.empty())
    throw ValueError("kiln bench: --llama-cpp-model is the file --compare-llama-cpp runs; give both");
  // The GGUF llama-bench runs for a --model: that very file, or --llama-cpp-model's.
  auto llama_cpp_file = [&](const std::string& model) -> std::string {
    if (!llama_cpp_model_.empty()) return llama_cpp_model_;
    if (pipelines::is_gguf_file(model)) return model;
    throw ValueError(fmt::format("kiln bench: --compare-llama-cpp needs a GGUF file: '{}' is not one; give "
                                 "--llama-cpp-model FILE.gguf (the same shape)",
                                 model));
  };
  if (!compare_llama_cpp_.empty()) {
    if (!concurrency_.empty())
      throw ValueError("kiln bench: --compare-llama-cpp compares single streams; leave out --concurrency");
    if (models_.size() > 1 && !llama_cpp_model_.empty())
      throw ValueError("kiln bench: --llama-cpp-model is one file; give one --model with it");
    for (const auto& model : models_) llama_cpp_file(model);
  }
  print_preamble(json_);
  auto options_for = [&](const std::string& model, std::optional<WeightFormat> format, int t) {
    return ModelBenchOptions{.model = model,
                             .format = format,
                             .threads = t,
                             .prompt_tokens = prompt_tokens_,
                             .gen_tokens = gen_tokens_,
                             .repetitions = repetitions_,
                             .seed = seed_,
                             .kv_dtype = kv_dtype,
                             .profile = profile_,
                             .paired_roofline = paired_roofline_};
  };
  if (!concurrency_.empty()) {
    if (!json_) std::cout << concurrency_table_header(prompt_tokens_, gen_tokens_) << "\n";
    for (const auto& model : models_)
      for (std::optional<WeightFormat> format : formats)
        for (int t : threads)
          for (const ConcurrencyBenchResult& r : bench_concurrency(options_for(model, format, t), concurrency_)) {
            emit(to_json(r), table_row(r));
            if (!json_ && !r.step_profile.empty()) std::cout << profile_table(r) << std::flush;
          }
    return 0;
  }
  if (!json_) std::cout << model_table_header(prompt_tokens_, gen_tokens_) << "\n";
  for (const auto& model : models_)
    for (std::optional<WeightFormat> format : formats)
      for (int t : threads) {
        std::vector<LlamaCppComparison> comparisons;
        for (int round = 0; round < rounds_; ++round) {
          // Bandwidth just before and just after the model, with its thread count: the roofline of
          // this very run. The better of the two counts, so a dip in the machine's bandwidth while it
          // was measured cannot flatter the decode's fraction of it.
          const BandwidthResult before = measure_read_bandwidth(t);
          ModelBenchResult r = bench_model(options_for(model, format, t), before);
          const BandwidthResult after = measure_read_bandwidth(t);
          if (after.read_bytes_per_s > r.read_bytes_per_s) set_bandwidth(r, after.read_bytes_per_s);
          emit(to_json(r), table_row(r));
          if (!json_ && !r.decode_profile.empty()) std::cout << profile_table(r) << std::flush;
          if (compare_llama_cpp_.empty()) continue;
          const LlamaCppBenchResult l = run_llama_bench({.llama_bench = compare_llama_cpp_,
                                                         .gguf = llama_cpp_file(model),
                                                         .threads = t,
                                                         .prompt_tokens = prompt_tokens_,
                                                         .gen_tokens = gen_tokens_,
                                                         .repetitions = repetitions_,
                                                         .kv_dtype = kv_dtype});
          comparisons.push_back(compare(r, l, {.before = before, .between = after, .after = measure_read_bandwidth(t)}));
          emit(to_json(comparisons.back()), table_row(comparisons.back()));
        }
        if (comparisons.size() > 1) {
          const LlamaCppRounds summary = summarize(comparisons);
          emit(to_json(summary), table_row(summary));
        }
      }
  return 0;
}

}  // namespace kiln::bench
