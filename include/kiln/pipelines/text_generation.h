// Text generation with a Llama-family model (MAX's TextGenerationPipeline): a Hugging Face model
// directory -> tokens streamed as text. A thin, blocking user of GenerationEngine
// (generation_engine.h): each generate() is one request of the engine, so several threads may call
// it at once and are batched together. docs/generation.md describes the sampler and the stats.
//
//   auto pipe = pipelines::TextGenerationPipeline::from_dir("models/kiln-tiny");
//   pipelines::GenerationOptions opts{.max_new_tokens = 32, .temperature = 0};  // greedy
//   auto result = pipe.generate("Once upon a time", opts, [](std::string_view piece) {
//     std::cout << piece << std::flush;
//   });
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "kiln/engine/session.h"
#include "kiln/graph/graph.h"
#include "kiln/nn/module.h"
#include "kiln/nn/transformer.h"
#include "kiln/nn/weight_format.h"
#include "kiln/pipelines/generation_engine.h"
#include "kiln/pipelines/graph_spec.h"
#include "kiln/pipelines/tokenizer.h"

namespace kiln::pipelines {

// How the pipeline is built: the engine's options (max_seq_len, num_threads, weight_format, the KV
// cache, sampler_max_top_k, on_stage).
using PipelineOptions = EngineOptions;

struct GenerationOptions {
  int64_t max_new_tokens = 128;
  double temperature = 1.0;  // 0: greedy (argmax of the logits, exactly)
  int64_t top_k = 0;         // 0: off; at most the pipeline's sampler cap
  double top_p = 1.0;        // nucleus mass in (0, 1]; 1: off
  uint64_t seed = 0;         // seeds the mt19937_64 that draws each token's u
  bool stop_at_eos = true;   // stop after an EOS id (config, generation_config, tokenizer)
};

// GenerationOptions checked as a request's sampling is (check_sampling), before anything loads.
void check_generation_options(const GenerationOptions& options);


struct GenerationStats {
  int64_t prompt_tokens = 0;
  int64_t generated_tokens = 0;  // including a final EOS
  // Prefill: the prompt through the model plus sampling the first new token.
  double prefill_seconds = 0;
  double prefill_tokens_per_s = 0;  // prompt_tokens / prefill_seconds
  // Decode: every later token (one model step + one sampler step each).
  double decode_seconds = 0;
  double decode_tokens_per_s = 0;  // (generated_tokens - 1) / decode_seconds
  // stop: an EOS id; length: max_new_tokens, or the sequence reached max_seq_len.
  FinishReason finish_reason = FinishReason::length;
};

// A request's stats from its metrics (RequestMetrics, as an engine's RequestUpdate carries them).
GenerationStats generation_stats(const RequestMetrics& metrics, FinishReason finish);

struct GenerationResult {
  std::vector<int64_t> ids;  // the new tokens only (a final EOS included)
  std::string text;          // decoded new tokens, special tokens skipped (empty without a tokenizer)
  GenerationStats stats;
};

// Copies share one engine; generate() may be called from several threads at once.
class TextGenerationPipeline {
 public:
  // Loads DIR: config.json (+ generation_config.json), model.safetensors (or sharded), tokenizer.
  // LoadError / ValueError naming the file or field at fault. f16/bf16 weights are converted to f32.
  static TextGenerationPipeline from_dir(const std::filesystem::path& model_dir,
                                         PipelineOptions options = {});
  // A model from a config and its weights (Hugging Face names); the tokenizer is optional (without
  // one, only generate_ids works). eos_token_ids: ids that stop generation.
  static TextGenerationPipeline from_config(const nn::LlamaConfig& config, const WeightsRegistry& weights,
                                            std::shared_ptr<const Tokenizer> tokenizer = nullptr,
                                            std::vector<int64_t> eos_token_ids = {},
                                            PipelineOptions options = {});
  // The engine's graphs traced (not compiled) into one module, for `kiln graph`: needs only the config.
  static graph::Module trace_graphs(const nn::LlamaConfig& config, PipelineOptions options = {});

  // Text in, text out; on_text receives the generated text piece by piece (complete UTF-8 only) as
  // tokens are made. ValueError without a tokenizer.
  GenerationResult generate(std::string_view prompt, const GenerationOptions& options,
                            const std::function<void(std::string_view)>& on_text = {});
  // Ids in, ids out; on_token receives each new id as it is made. ValueError for an empty prompt, a
  // prompt longer than max_seq_len (naming both lengths), an id outside the vocabulary, or bad options.
  GenerationResult generate_ids(const std::vector<int64_t>& prompt_ids, const GenerationOptions& options,
                                const std::function<void(int64_t)>& on_token = {});

  // One sampler step on the host's behalf (for tests): logits f32[1, vocab] -> token id, through the
  // "greedy" graph (argmax) for temperature 0 or top_k 1, else the "sampler" graph (min_p off).
  int64_t sample(const Tensor& logits, double temperature, int64_t top_k, double top_p, float u) const;
  GenerationEngine& engine() const;

  const nn::LlamaConfig& config() const;
  int64_t max_seq_len() const;
  int64_t sampler_cap() const;
  const Tokenizer* tokenizer() const;
  const std::vector<int64_t>& eos_token_ids() const;
  const std::map<std::string, engine::Model>& models() const;  // "model", "sampler", "greedy"
  int64_t compile_count() const;  // times the session ran the compiler (1: one group)


 private:
  explicit TextGenerationPipeline(std::shared_ptr<GenerationEngine> engine) : engine_(std::move(engine)) {}
  std::shared_ptr<GenerationEngine> engine_;
};

// Random-weight models of known shapes, for benchmarks: "stories15M", "stories110M" (llama2.c's
// TinyStories models: Llama 2 architecture, vocab 32000, tied embeddings) and "llama-1B" (Llama 3.2
// 1B's shape: 16 layers, dim 2048, 32/8 heads, ffn 8192, vocab 128256, tied, Llama 3 RoPE with theta
// 500000). nullopt for an unknown name; named_config_names() lists the known ones.
std::optional<nn::LlamaConfig> named_config(std::string_view name);
const std::vector<std::string>& named_config_names();
// Seeded random weights for every weight of the model, in `dtype` (f32, f16 or bf16, as a checkpoint
// of that dtype would hold them): norms 1, the rest uniform in [-0.05, 0.05). Each value is a hash of
// (seed, weight name, index), so the result does not depend on the threads that fill it in parallel.
WeightsRegistry random_weights(const nn::LlamaConfig& config, uint64_t seed, DType dtype = DType::f32);

}  // namespace kiln::pipelines
