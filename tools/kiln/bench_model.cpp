// `kiln bench --model`: prefill and decode tokens/s of a TextGenerationPipeline (random weights of a
// named shape, or a model directory), and the bytes of weights a decode step reads, for its roofline.
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <map>
#include <random>
#include <set>

#include "bench.h"
#include "bench_internal.h"
#include "kiln/errors.h"
#include "kiln/pipelines/gguf_model.h"
#include "kiln/pipelines/hf_config.h"
#include "kiln/pipelines/text_generation.h"

#include <cmath>
#include <limits>
#include <condition_variable>
#include <mutex>

namespace kiln::bench {

// ==== weight formats and the bytes a decode step reads ================================================

double bytes_per_weight(WeightFormat format) {
  switch (format) {
    case WeightFormat::f32:
      return 4.0;
    case WeightFormat::f16:
    case WeightFormat::bf16:
      return 2.0;
    case WeightFormat::q8_0:
    case WeightFormat::q4_0:
    case WeightFormat::q4_k:
    case WeightFormat::q5_k:
    case WeightFormat::q6_k: {  // the block's bytes over its weights: 34 / 32, 18 / 32, 144 / 256, ...
      const graph::QuantizationEncoding e = *nn::weight_format_encoding(format);
      return static_cast<double>(graph::block_bytes(e)) / static_cast<double>(graph::block_size(e));
    }
  }
  return 0;
}

namespace {

// The config with every weight declared in its logical shape, [rows, cols], whatever its format.
nn::LlamaConfig logical_shapes(nn::LlamaConfig config) {
  config.weight_format.reset();
  config.weight_formats.clear();
  return config;
}

}  // namespace

int64_t parameter_count(const nn::LlamaConfig& config) {
  int64_t total = 0;
  for (const auto& [name, decl] : nn::Transformer(logical_shapes(config), 1).raw_state_dict())
    total += *decl.shape.static_num_elements();
  return total;
}

double decode_weight_bytes(const nn::LlamaConfig& config, WeightFormat format) {
  double total = 0;
  for (const auto& [name, decl] : nn::Transformer(logical_shapes(config), 1).raw_state_dict()) {
    const auto numel = static_cast<double>(*decl.shape.static_num_elements());
    const double bytes =
        bytes_per_weight(decl.shape.rank() == 2 ? nn::weight_format_for(format, config.weight_formats, name,
                                                                        decl.shape.static_dims().back())
                                                      .value_or(format)
                                                : format);
    if (name.ends_with("norm.weight")) {
      total += 4.0 * numel;
    } else if (name == "model.embed_tokens.weight") {
      const auto hidden = static_cast<double>(config.hidden_size);
      total += bytes * hidden;                                 // the new token's row
      if (config.tie_word_embeddings) total += bytes * numel;  // read whole as the lm_head
    } else {
      total += bytes * numel;
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

// ==== model benchmark ======================================================================================

namespace {

// The formats a run computes in: `requested` for every matrix, or (nullopt) the checkpoint's own,
// as config.weight_formats exceptions to the main one.
WeightFormat resolve_formats(const std::string& model, std::optional<WeightFormat> requested,
                             nn::LlamaConfig& config) {
  if (requested) return *requested;
  if (!pipelines::is_gguf_file(model)) return WeightFormat::f32;
  const pipelines::GGUFFile file = pipelines::GGUFFile::open(model);
  const WeightFormat main = pipelines::gguf_weight_format(file);
  config.weight_formats = pipelines::gguf_weight_formats(file, main);
  return main;
}

// "q4_k", or the stored mix, main format first: "q4_k+q6_k".
std::string formats_label(WeightFormat main, const nn::WeightFormatMap& exceptions) {
  std::string label(nn::weight_format_name(main));
  std::set<WeightFormat> others;
  for (const auto& [name, format] : exceptions) others.insert(format);
  for (WeightFormat f : others) label += fmt::format("+{}", nn::weight_format_name(f));
  return label;
}

}  // namespace

nn::LlamaConfig resolve_model_config(const std::string& model) {
  if (auto named = pipelines::named_config(model)) return *named;
  if (std::filesystem::is_directory(model)) return pipelines::load_model_info(model).config;
  if (pipelines::is_gguf_file(model)) return pipelines::gguf_model_info(pipelines::GGUFFile::open(model)).config;
  throw ValueError(fmt::format("kiln bench: unknown model '{}': give a model directory, a GGUF file or one of {}", model,
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

// The dtype random weights are drawn in: the format's own (no conversion at load), f32 for the
// quantized formats (quantized at load, as a user's checkpoint would be).
DType random_weight_dtype(WeightFormat format) {
  return nn::weight_format_dtype(format).value_or(DType::f32);
}

}  // namespace

void set_bandwidth(ModelBenchResult& r, double read_bytes_per_s) {
  r.read_bytes_per_s = read_bytes_per_s;
  r.roofline_tokens_per_s = roofline_tokens_per_s(r.weight_bytes_per_token, read_bytes_per_s);
  r.roofline_fraction = r.decode_tokens_per_s / r.roofline_tokens_per_s;
}

double DecodeProfileEntry::weight_bytes_per_s() const {
  // A gather reads only the rows its indices pick, not its whole table.
  if (weight_bytes_per_launch == 0 || seconds_per_token <= 0 || op == "gather") return 0;
  return static_cast<double>(weight_bytes_per_launch) * launches_per_token / seconds_per_token;
}

namespace {

// Nearest-rank percentile of unsorted values (0 when empty).
double percentile(std::vector<double> values, double p) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  const auto rank = static_cast<size_t>(std::ceil(p / 100.0 * static_cast<double>(values.size())));
  return values[std::clamp<size_t>(rank, 1, values.size()) - 1];
}

// What the profiled graphs spent over `steps` steps of `wall_seconds`: each op's launches and time
// per step, each graph's work outside its kernels ("(run)"), and the rest ("(pipeline)": the
// engine's own work between graphs), slowest first.
std::vector<DecodeProfileEntry> collect_profile(const std::map<std::string, engine::Model>& models,
                                                double wall_seconds, double steps) {
  steps = std::max(1.0, steps);
  std::vector<DecodeProfileEntry> entries;
  double in_graphs = 0;
  for (const auto& [name, model] : models) {
    model.stop_profiling();
    const engine::ModelProfile p = model.profile();
    if (p.runs == 0) continue;
    // (op, weight bytes) -> launches, seconds
    std::map<std::pair<std::string, int64_t>, std::pair<int64_t, double>> by_op;
    double in_kernels = 0;
    for (const engine::StepProfile& step : p.steps) {
      auto& [launches, seconds] = by_op[{step.op, step.weight_bytes}];
      launches += step.launches;
      seconds += step.seconds;
      in_kernels += step.seconds;
    }
    for (const auto& [key, totals] : by_op)
      entries.push_back({.graph = name,
                         .op = key.first,
                         .launches_per_token = static_cast<double>(totals.first) / steps,
                         .seconds_per_token = totals.second / steps,
                         .weight_bytes_per_launch = key.second});
    entries.push_back({.graph = name,
                       .op = "(run)",
                       .launches_per_token = static_cast<double>(p.runs) / steps,
                       .seconds_per_token = (p.seconds - in_kernels) / steps});
    in_graphs += p.seconds;
  }
  entries.push_back({.graph = "", .op = "(pipeline)", .seconds_per_token = (wall_seconds - in_graphs) / steps});
  for (DecodeProfileEntry& e : entries) e.fraction = e.seconds_per_token * steps / wall_seconds;
  std::sort(entries.begin(), entries.end(),
            [](const auto& a, const auto& b) { return a.seconds_per_token > b.seconds_per_token; });
  return entries;
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
  return collect_profile(models, decode_seconds, static_cast<double>(tokens - 1));
}

// One more generation, a read of the memory after every token (PairedRoofline).
PairedRoofline paired_roofline(pipelines::TextGenerationPipeline& pipe, const std::vector<int64_t>& prompt,
                               const pipelines::GenerationOptions& gen, double weight_bytes_per_token,
                               int threads, int streams_per_thread) {
  // At least the weights' bytes, so that the read comes from memory too, not from the caches; at most
  // 2 GiB, which reads no slower per byte than more.
  constexpr double kMiB = 1 << 20;
  BandwidthProbe probe(threads, static_cast<int64_t>(std::clamp(weight_bytes_per_token, 512 * kMiB, 2048 * kMiB)));
  std::vector<double> fractions, reads;
  bool decoding = false;  // the first token is prefill's
  Clock::time_point step_start;
  pipe.generate_ids(prompt, gen, [&](int64_t) {
    // Every step follows a read, the first too: each finds the caches and the pool's threads alike.
    const double step_seconds = seconds_since(step_start);
    const double read = probe.read(streams_per_thread);
    if (decoding) {
      reads.push_back(read);
      fractions.push_back(weight_bytes_per_token / step_seconds / read);
    }
    decoding = true;
    step_start = Clock::now();
  });
  return {.steps = static_cast<int64_t>(fractions.size()),
          .read_bytes_per_s_median = percentile(reads, 50),
          .fraction_median = percentile(fractions, 50),
          .fraction_p10 = percentile(fractions, 10),
          .fraction_p90 = percentile(fractions, 90)};
}

}  // namespace

ModelBenchResult bench_model(const ModelBenchOptions& o, const BandwidthResult& bandwidth) {
  check_model_options(o);
  nn::LlamaConfig config = resolve_model_config(o.model);
  const WeightFormat format = resolve_formats(o.model, o.format, config);
  const DType weight_dtype = random_weight_dtype(format);
  // The prompt, then gen_tokens decode steps; the +1 is the token prefill samples.
  const int64_t needed = o.prompt_tokens + o.gen_tokens + 1;
  if (needed > config.max_position_embeddings)
    throw ValueError(fmt::format("kiln bench: {} prompt + {} generated tokens exceed {}'s {} positions",
                                 o.prompt_tokens, o.gen_tokens, o.model, config.max_position_embeddings));
  pipelines::PipelineOptions pipeline_options{
      .max_seq_len = std::max<int64_t>(needed, std::min<int64_t>(config.max_position_embeddings, 2048)),
      .num_threads = o.threads,
      .weight_format = o.format};
  pipeline_options.kv_cache_dtype = o.kv_dtype;
  // Every repetition runs the same prompt: from the prefix cache it would skip its prefill.
  pipeline_options.enable_prefix_caching = false;
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
  const double weight_bytes_per_token = decode_weight_bytes(config, format);
  if (o.paired_roofline)
    r.paired = paired_roofline(pipe, prompt, gen, weight_bytes_per_token, o.threads,
                               std::max(1, bandwidth.streams_per_thread));
  r.cached_prompt_tokens = pipe.engine().stats().cached_prompt_tokens;
  r.model = o.model;
  r.dtype = formats_label(format, config.weight_formats);
  r.kv_dtype = dtype_name(o.kv_dtype);
  r.threads = o.threads;
  r.parameters = parameter_count(config);
  r.weight_bytes_per_token = weight_bytes_per_token;
  r.prompt_tokens = o.prompt_tokens;
  r.gen_tokens = o.gen_tokens;
  r.repetitions = o.repetitions;
  set_bandwidth(r, bandwidth.read_bytes_per_s);
  return r;
}

// ==== many requests at once ================================================================================

std::vector<ConcurrencyBenchResult> bench_concurrency(const ModelBenchOptions& o, const std::vector<int64_t>& levels) {
  check_model_options(o);
  if (levels.empty()) throw ValueError("kiln bench: --concurrency needs at least one level");
  for (int64_t level : levels)
    if (level < 1 || level > 4096)
      throw ValueError(fmt::format("kiln bench: --concurrency levels must be in [1, 4096], got {}", level));
  nn::LlamaConfig config = resolve_model_config(o.model);
  const WeightFormat format = resolve_formats(o.model, o.format, config);
  const int64_t needed = o.prompt_tokens + o.gen_tokens + 1;
  if (needed > config.max_position_embeddings)
    throw ValueError(fmt::format("kiln bench: {} prompt + {} generated tokens exceed {}'s {} positions",
                                 o.prompt_tokens, o.gen_tokens, o.model, config.max_position_embeddings));
  const int64_t top = *std::max_element(levels.begin(), levels.end());
  pipelines::EngineOptions engine_options{.max_seq_len = needed, .num_threads = o.threads, .weight_format = o.format};
  engine_options.max_num_seqs = top;
  engine_options.kv_cache_dtype = o.kv_dtype;
  std::unique_ptr<pipelines::GenerationEngine> engine =
      pipelines::named_config(o.model)
          ? std::make_unique<pipelines::GenerationEngine>(
                config, pipelines::random_weights(config, o.seed, random_weight_dtype(format)), nullptr,
                std::vector<int64_t>{}, engine_options)
          : pipelines::GenerationEngine::from_dir(o.model, engine_options);

  std::mt19937_64 rng(o.seed);
  auto prompt = [&] {  // BOS (1, as Llama 2), then seeded ids: every request's prompt differs
    std::vector<int64_t> ids{1};
    while (static_cast<int64_t>(ids.size()) < o.prompt_tokens)
      ids.push_back(static_cast<int64_t>(rng() % static_cast<uint64_t>(config.vocab_size)));
    return ids;
  };
  auto request = [&](int64_t new_tokens) {
    pipelines::GenerationRequest r;
    r.prompt_ids = prompt();
    r.sampling.max_new_tokens = new_tokens;
    r.sampling.temperature = 0;
    r.sampling.ignore_eos = true;
    return r;
  };
  engine->generate(request(2));  // warm-up

  std::vector<ConcurrencyBenchResult> results;
  for (int64_t level : levels) {
    std::mutex mutex;
    std::condition_variable done;
    int64_t finished = 0;
    int64_t peak_blocks = 0;
    std::vector<double> ttft, tpot;
    int64_t output_tokens = 0, decode_tokens = 0;
    double first_token = std::numeric_limits<double>::infinity(), last_token = 0;  // since the submission
    // When each update's tokens arrived (seconds since the submission, tokens): the window in which
    // every request is decoding is known only at the end.
    std::vector<std::pair<double, int64_t>> arrivals;
    double all_decoding = 0, first_finish = std::numeric_limits<double>::infinity();
    const pipelines::EngineStats before = engine->stats();
    if (o.profile)
      for (const auto& [name, model] : engine->models()) model.start_profiling();
    std::vector<pipelines::GenerationRequest> batch;
    Clock::time_point start;
    for (int64_t i = 0; i < level; ++i) {
      pipelines::GenerationRequest r = request(o.gen_tokens + 1);
      r.on_update = [&, start = &start, seen_first = false](const pipelines::RequestUpdate& u) mutable {
        const int64_t in_use = engine->stats().kv_blocks_in_use;
        const double now = seconds_since(*start);
        std::lock_guard lock(mutex);
        peak_blocks = std::max(peak_blocks, in_use);
        if (!u.tokens.empty()) {
          arrivals.emplace_back(now, static_cast<int64_t>(u.tokens.size()));
          if (!seen_first) all_decoding = std::max(all_decoding, now);
          seen_first = true;
        }
        if (!u.finish) return;
        first_finish = std::min(first_finish, now);
        const pipelines::RequestMetrics& m = u.metrics;
        ttft.push_back(m.first_token_s);
        if (m.generated_tokens > 1)
          tpot.push_back((m.finish_s - m.first_token_s) / static_cast<double>(m.generated_tokens - 1));
        output_tokens += m.generated_tokens;
        decode_tokens += std::max<int64_t>(0, m.generated_tokens - 1);
        first_token = std::min(first_token, m.first_token_s);
        last_token = std::max(last_token, m.finish_s);
        ++finished;
        done.notify_all();
      };
      batch.push_back(std::move(r));
    }
    start = Clock::now();
    engine->submit(std::move(batch));  // together: the first step can take them all
    std::unique_lock lock(mutex);
    done.wait(lock, [&] { return finished == level; });
    ConcurrencyBenchResult r;
    r.seconds = seconds_since(start);
    r.model = o.model;
    r.dtype = formats_label(format, config.weight_formats);
    r.threads = o.threads;
    r.concurrency = level;
    r.prompt_tokens = o.prompt_tokens;
    r.gen_tokens = o.gen_tokens;
    r.output_tokens = output_tokens;
    r.output_tokens_per_s = static_cast<double>(output_tokens) / r.seconds;
    if (last_token > first_token)
      r.aggregate_decode_tokens_per_s = static_cast<double>(decode_tokens) / (last_token - first_token);
    if (first_finish > all_decoding) {
      for (const auto& [t, n] : arrivals)
        if (t > all_decoding && t <= first_finish) r.steady_decode_tokens += n;
      r.steady_decode_tokens_per_s = static_cast<double>(r.steady_decode_tokens) / (first_finish - all_decoding);
    }
    r.ttft_p50_s = percentile(ttft, 50);
    r.ttft_p99_s = percentile(ttft, 99);
    r.tpot_p50_s = percentile(tpot, 50);
    r.tpot_p99_s = percentile(tpot, 99);
    r.kv_blocks_peak = peak_blocks;
    r.kv_blocks_total = engine->stats().kv_blocks_total;
    const pipelines::EngineStats after = engine->stats();
    r.preemptions = after.preemptions - before.preemptions;
    r.steps = after.steps - before.steps;
    if (o.profile) r.step_profile = collect_profile(engine->models(), r.seconds, static_cast<double>(r.steps));
    results.push_back(r);
  }
  return results;
}

}  // namespace kiln::bench
