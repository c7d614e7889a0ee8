// Text generation for many requests at once: continuous batching over a paged KV cache (Orca's
// iteration-level scheduling, vLLM's PagedAttention). Requests are submitted at any time from any
// thread; a step thread runs the model graph once per step over a ragged batch that mixes one decode
// token of every running sequence with chunks of new prompts under a token budget, so the weights are
// read once per step for every sequence in it. docs/batching.md describes the scheduler, the cache
// and the guarantees (a request's tokens do not depend on what else runs beside it).
//
//   auto engine = pipelines::GenerationEngine::from_dir("models/kiln-tiny");
//   pipelines::GenerationRequest request;
//   request.prompt = "Once upon a time";
//   request.sampling.max_new_tokens = 32;
//   request.on_update = [](const pipelines::RequestUpdate& u) { std::cout << u.text << std::flush; };
//   pipelines::RequestId id = engine->submit(std::move(request));   // returns at once
//   ...
//   engine->cancel(id);                                               // or let it finish
//
// or, blocking: GenerationOutput out = engine->generate(std::move(request));
#pragma once

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "kiln/engine/model.h"
#include "kiln/graph/dtype.h"
#include "kiln/nn/transformer.h"
#include "kiln/nn/weight_format.h"
#include "kiln/pipelines/graph_spec.h"
#include "kiln/pipelines/tokenizer.h"

namespace kiln::pipelines {

// How the engine is built (fixed for its lifetime: these shape the compiled graphs and the cache).
struct EngineOptions {
  int64_t max_seq_len = 0;  // prompt + generated tokens per sequence; 0: min(max_position_embeddings, 2048)
  int num_threads = 0;      // engine threads; 0: one per core
  int64_t sampler_max_top_k = 256;  // static cap of the sampler's sorted candidates; 0: vocab
  // How the model keeps its matmul and embedding weights (activations and norms are f32): checkpoint
  // tensors are converted, or quantized to Q8_0, once at load (docs/quantization.md). nullopt: the
  // checkpoint's own (a GGUF file's, gguf_weight_format; f32 for safetensors and given weights).
  std::optional<nn::WeightFormat> weight_format = std::nullopt;
  // The paged KV cache: blocks of kv_block_size positions, KV stored in kv_cache_dtype (f32, bf16 or
  // f16), as many blocks as kv_cache_bytes holds (0: what max_num_seqs sequences of max_seq_len need,
  // at most a quarter of the memory available now). A budget below one max_seq_len sequence lowers
  // max_seq_len to what it holds.
  DType kv_cache_dtype = DType::f32;
  int64_t kv_cache_bytes = 0;
  int64_t kv_block_size = 16;
  bool enable_prefix_caching = true;
  int64_t max_num_seqs = 64;             // sequences running at once
  int64_t max_num_batched_tokens = 256;  // tokens per step (chunked prefill's budget)
  // Called as loading proceeds: stage name ("config", "weights", "tokenizer", "graphs") and its index
  // among `total` stages, before the stage starts.
  std::function<void(std::string_view stage, int index, int total)> on_stage = {};
};

// Per request. Penalties, then temperature, top_k, top_p and min_p, as docs/generation.md describes.
struct SamplingParams {
  int64_t max_new_tokens = 128;
  double temperature = 1.0;  // 0: greedy (argmax of the logits, exactly)
  int64_t top_k = 0;         // 0: off; at most the engine's sampler cap
  double top_p = 1.0;        // nucleus mass in (0, 1]; 1: off
  double min_p = 0.0;        // keep tokens at least min_p times as likely as the top one; 0: off
  double repetition_penalty = 1.0;  // > 0; tokens of the prompt and the output; 1: off
  double frequency_penalty = 0.0;   // [-2, 2]: minus this times the token's count in the output
  double presence_penalty = 0.0;    // [-2, 2]: minus this once a token is in the output
  // Seeds the request's own mt19937_64 (its tokens never depend on the other requests); nullopt:
  // a fresh seed from the engine.
  std::optional<uint64_t> seed = 0;
  std::vector<std::string> stop;        // stop strings: matched across tokens, never emitted
  std::vector<int64_t> stop_token_ids;  // stop after one of these ids (it is in the ids, not the text)
  bool ignore_eos = false;              // keep going past the model's EOS ids
  bool logprobs = false;                // report the chosen token's log-probability
  int64_t top_logprobs = 0;             // and that many of the most likely tokens' (0..20)
};

// The checks of a request's sampling that need no model (ranges, max_new_tokens >= 0, no empty stop
// string), so a command can refuse bad options before it loads anything: ValueError naming the
// field. top_k_cap: the engine's EngineOptions::sampler_max_top_k (0: no cap known yet).
void check_sampling(const SamplingParams& params, int64_t top_k_cap = EngineOptions{}.sampler_max_top_k);

enum class FinishReason { stop, length, cancelled, error };
const char* finish_reason_name(FinishReason);  // "stop", "length", "cancelled", "error"

using RequestId = uint64_t;

struct TokenLogprob {
  int64_t id = 0;
  float logprob = 0;
  bool operator==(const TokenLogprob&) const = default;
};

struct GeneratedToken {
  int64_t id = 0;
  float logprob = 0;                      // with SamplingParams::logprobs
  std::vector<TokenLogprob> top_logprobs;  // the top_logprobs most likely, descending
};

// Counted per request; times are seconds since submit.
struct RequestMetrics {
  int64_t prompt_tokens = 0;
  int64_t cached_prompt_tokens = 0;  // prefill skipped: taken from the prefix cache
  int64_t generated_tokens = 0;
  int64_t preemptions = 0;
  double first_token_s = 0;  // time to first token
  double finish_s = 0;
};

// What a request's callback receives after each step that touched it, on the engine's thread (keep
// it short: the next step waits for it).
struct RequestUpdate {
  RequestId id = 0;
  std::vector<GeneratedToken> tokens;  // new since the last update
  std::string text;                    // new text that can be shown (complete UTF-8, no stop string)
  std::optional<FinishReason> finish;  // set on the last update of the request
  std::string error;                   // with FinishReason::error: what went wrong
  std::optional<std::string> stop_string;  // the stop string that ended it, if one did
  RequestMetrics metrics;              // up to date
};

struct GenerationRequest {
  std::string prompt;              // encoded with the engine's tokenizer (BOS as it adds one) ...
  std::vector<int64_t> prompt_ids;  // ... unless ids are given
  SamplingParams sampling;
  std::function<void(const RequestUpdate&)> on_update;
};

// A finished request, as generate() returns it.
struct GenerationOutput {
  RequestId id = 0;
  std::vector<GeneratedToken> tokens;  // a final EOS or stop id included
  std::string text;
  FinishReason finish = FinishReason::length;
  std::string error;
  std::optional<std::string> stop_string;
  RequestMetrics metrics;
};

// One request's updates as a queue that a thread waits on (an HTTP handler streaming them out),
// instead of a callback on the engine's thread. Thread-safe.
class RequestStream {
 public:
  RequestId id() const { return id_; }
  // The next update, waiting up to `timeout` for one; nullopt when none came in time, or after the
  // last update (the one with `finish` set) was taken.
  std::optional<RequestUpdate> next(std::chrono::milliseconds timeout);
  bool done() const;  // the last update was taken

  struct State;
  RequestStream(RequestId id, std::shared_ptr<State> state) : id_(id), state_(std::move(state)) {}

 private:
  RequestId id_;
  std::shared_ptr<State> state_;
};

// What the engine holds now.
struct EngineStats {
  int64_t waiting = 0;
  int64_t running = 0;
  int64_t kv_blocks_total = 0;
  int64_t kv_blocks_in_use = 0;
  int64_t kv_blocks_cached = 0;  // free but still keyed by the prefix cache
  int64_t steps = 0;
  int64_t preemptions = 0;
  int64_t prompt_tokens = 0;         // over all requests so far
  int64_t cached_prompt_tokens = 0;  // of those, taken from the prefix cache
  int64_t generated_tokens = 0;
};

class GenerationEngine {
 public:
  // A model from a config and its weights (Hugging Face names); the tokenizer is optional (without
  // one, only prompt_ids work and no text is produced). eos_token_ids: ids that stop generation.
  GenerationEngine(const nn::LlamaConfig& config, const WeightsRegistry& weights,
                   std::shared_ptr<const Tokenizer> tokenizer = nullptr, std::vector<int64_t> eos_token_ids = {},
                   EngineOptions options = {});
  // Loads DIR: config.json (+ generation_config.json), model.safetensors (or sharded), tokenizer; or
  // one GGUF file (config, weights and tokenizer from the file alone, docs/gguf.md).
  static std::unique_ptr<GenerationEngine> from_dir(const std::filesystem::path& model_dir,
                                                    EngineOptions options = {});
  // Every request still queued or running is cancelled (its callback says so) before this returns.
  ~GenerationEngine();
  GenerationEngine(const GenerationEngine&) = delete;
  GenerationEngine& operator=(const GenerationEngine&) = delete;

 private:
  // The tokenizer taken once the model is compiled and initialised: from_dir loads it meanwhile.
  GenerationEngine(const nn::LlamaConfig& config, const WeightsRegistry& weights,
                   std::future<std::shared_ptr<const Tokenizer>> tokenizer, std::vector<int64_t> eos_token_ids,
                   EngineOptions options);

 public:

  // Queues a request and returns at once. ValueError, before anything is queued, for an empty
  // prompt, an id outside the vocabulary, a prompt longer than max_seq_len, bad sampling values
  // (naming the field), or text without a tokenizer.
  RequestId submit(GenerationRequest request);
  // Several at once: all are checked first (nothing is queued if one is refused), then queued
  // together, so the next step can admit them together.
  std::vector<RequestId> submit(std::vector<GenerationRequest> requests);
  // Stops the request: its blocks are freed before the next step and its callback gets
  // FinishReason::cancelled. false when it is unknown or has finished.
  bool cancel(RequestId id);
  // submit() and wait for the end; on_update (if any) is still called as tokens come.
  GenerationOutput generate(GenerationRequest request);
  // submit(), the updates queued for the caller to take (on_update, if any, is still called first).
  RequestStream stream(GenerationRequest request);

  EngineStats stats() const;
  const nn::LlamaConfig& config() const;
  const EngineOptions& options() const;  // as resolved (max_seq_len, kv_cache_bytes filled in)
  int64_t max_seq_len() const;
  int64_t sampler_cap() const;
  const Tokenizer* tokenizer() const;
  const std::vector<int64_t>& eos_token_ids() const;
  const std::map<std::string, engine::Model>& models() const;  // "model", "sampler", "greedy"
  int64_t compile_count() const;  // times the session ran the compiler (1: one group)

  // The engine's graphs traced (not compiled) into one module, for `kiln graph`: needs only the config.
  static graph::Module trace_graphs(const nn::LlamaConfig& config, const EngineOptions& options = {});

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace kiln::pipelines
