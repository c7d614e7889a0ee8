// GenerationEngine: loading and the graphs (the ragged "model" over the paged cache, and the per-row
// "sampler" and "greedy" graphs, compiled as one group), request intake and cancellation, and the
// step thread: schedule -> run the model over the step's tokens -> sample every finished row ->
// stream each request's tokens and text.
#include "kiln/pipelines/generation_engine.h"

#include <fmt/format.h>

#include <algorithm>
#include <future>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <deque>
#include <fstream>
#include <limits>
#include <mutex>
#include <random>
#include <thread>
#include <unordered_map>
#include <unordered_set>

#include "kiln/engine/session.h"
#include "kiln/pipelines/gguf_model.h"
#include "kiln/pipelines/hf_config.h"
#include "kiln/pipelines/kv_block_pool.h"
#include "kiln/pipelines/safetensors.h"
#include "kiln/pipelines/stop_strings.h"
#include "kiln/pipelines/weight_conversion.h"
#include "pipelines/batch_sampler.h"
#include "pipelines/scheduler.h"
#include "tensor/host_memory.h"

namespace kiln::pipelines {

const char* finish_reason_name(FinishReason reason) {
  switch (reason) {
    case FinishReason::stop:
      return "stop";
    case FinishReason::length:
      return "length";
    case FinishReason::cancelled:
      return "cancelled";
    case FinishReason::error:
      return "error";
  }
  return "?";
}

namespace {

using Clock = std::chrono::steady_clock;

double seconds_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// The model always computes in f32 on the CPU: f16/bf16 checkpoints are converted when loaded.
nn::LlamaConfig compute_config(nn::LlamaConfig config, std::optional<nn::WeightFormat> format) {
  config.dtype = DType::f32;
  config.weight_format = format.value_or(nn::WeightFormat::f32);
  config.validate();
  return config;
}

int64_t resolve_max_seq_len(const nn::LlamaConfig& config, int64_t requested) {
  if (requested < 0)
    throw ValueError(fmt::format("GenerationEngine: max_seq_len must be >= 0, got {}", requested));
  if (requested == 0) return std::min<int64_t>(config.max_position_embeddings, 2048);
  if (requested > config.max_position_embeddings)
    throw ValueError(fmt::format("GenerationEngine: max_seq_len {} exceeds the model's max_position_embeddings {}",
                                 requested, config.max_position_embeddings));
  return requested;
}

int64_t resolve_cap(int64_t vocab_size, int64_t requested) {
  if (requested < 0)
    throw ValueError(fmt::format("GenerationEngine: sampler_max_top_k must be >= 0, got {}", requested));
  return requested == 0 ? vocab_size : std::min(requested, vocab_size);
}

// MemAvailable of /proc/meminfo, or nullopt where there is none.
std::optional<int64_t> available_memory_bytes() {
  std::ifstream meminfo("/proc/meminfo");
  std::string key;
  int64_t kib = 0;
  std::string unit;
  while (meminfo >> key >> kib >> unit)
    if (key == "MemAvailable:") return kib * 1024;
  return std::nullopt;
}

int64_t kv_bytes_per_token(const nn::LlamaConfig& c, DType dtype) {
  return 2 * c.num_hidden_layers * c.num_key_value_heads * c.resolved_head_dim() *
         static_cast<int64_t>(dtype_size(dtype));
}

// Fills in every 0 ("choose for me") of the options and checks the rest.
EngineOptions resolve_options(const nn::LlamaConfig& config, EngineOptions o) {
  if (o.kv_cache_dtype != DType::f32 && o.kv_cache_dtype != DType::bf16 && o.kv_cache_dtype != DType::f16)
    throw ValueError(fmt::format("GenerationEngine: kv_cache_dtype must be f32, bf16 or f16, got {}",
                                 dtype_name(o.kv_cache_dtype)));
  if (o.kv_block_size < 1 || o.kv_block_size > 1024)
    throw ValueError(fmt::format("GenerationEngine: kv_block_size must be in [1, 1024], got {}", o.kv_block_size));
  if (o.kv_cache_bytes < 0)
    throw ValueError(fmt::format("GenerationEngine: kv_cache_bytes must be >= 0, got {}", o.kv_cache_bytes));
  if (o.max_num_seqs < 1)
    throw ValueError(fmt::format("GenerationEngine: max_num_seqs must be >= 1, got {}", o.max_num_seqs));
  if (o.max_num_batched_tokens < 1)
    throw ValueError(
        fmt::format("GenerationEngine: max_num_batched_tokens must be >= 1, got {}", o.max_num_batched_tokens));
  o.max_seq_len = resolve_max_seq_len(config, o.max_seq_len);
  o.sampler_max_top_k = resolve_cap(config.vocab_size, o.sampler_max_top_k);
  const int64_t per_token = kv_bytes_per_token(config, o.kv_cache_dtype);
  const int64_t block_bytes = per_token * o.kv_block_size;
  if (o.kv_cache_bytes == 0) {
    const int64_t one_sequence = (o.max_seq_len + o.kv_block_size - 1) / o.kv_block_size * block_bytes;
    const int64_t wanted = o.max_num_seqs * one_sequence;
    const int64_t quarter = available_memory_bytes().value_or(int64_t{4} << 30) / 4;
    // At least one sequence of max_seq_len, so the default always runs what a request may ask.
    o.kv_cache_bytes = std::max(std::min(wanted, quarter), one_sequence);
  }
  const int64_t blocks = o.kv_cache_bytes / block_bytes;
  if (blocks < 1)
    throw ValueError(fmt::format("GenerationEngine: kv_cache_bytes {} holds no block of the KV cache ({} bytes: "
                                 "{} positions of {} bytes)",
                                 o.kv_cache_bytes, block_bytes, o.kv_block_size, per_token));
  o.kv_cache_bytes = blocks * block_bytes;
  // A sequence never needs more than the whole cache, so the oldest always fits alone.
  o.max_seq_len = std::min(o.max_seq_len, blocks * o.kv_block_size);
  return o;
}

std::vector<GraphSpec> graph_specs(const std::shared_ptr<nn::Transformer>& model,
                                   const std::shared_ptr<BatchSamplerModule>& sampler,
                                   const std::shared_ptr<BatchGreedyModule>& greedy) {
  GraphSpec model_spec;
  model_spec.module = model;
  model_spec.name = "model";
  model_spec.input_types = model->input_tree().value();
  model_spec.group = "generation";
  GraphSpec sampler_spec;
  sampler_spec.module = sampler;
  sampler_spec.name = "sampler";
  sampler_spec.input_types = sampler->input_types();
  sampler_spec.group = "generation";
  GraphSpec greedy_spec;
  greedy_spec.module = greedy;
  greedy_spec.name = "greedy";
  greedy_spec.input_types = greedy->input_types();
  greedy_spec.group = "generation";
  return {model_spec, sampler_spec, greedy_spec};
}

// A checkpoint's tensors in the dtypes and formats the traced model declares (f16/bf16 checkpoints
// widened for f32 layers, narrowed or quantized for the others), minus what the model never reads
// (a tied model's lm_head copy, rotary inv_freq buffers).
WeightsRegistry prepare_weights(const nn::LlamaConfig& config, const nn::Module& model, const WeightsRegistry& loaded,
                                int threads, const engine::WeightCache* cache) {
  WeightsRegistry used;
  for (const auto& [name, tensor] : loaded) {
    if (config.tie_word_embeddings && name == "lm_head.weight") continue;
    if (name.ends_with("rotary_emb.inv_freq")) continue;
    used.emplace(name, tensor);
  }
  std::map<std::string, graph::QuantizationEncoding, std::less<>> encodings;
  for (const auto& [name, format] : config.weight_formats)
    if (const auto e = nn::weight_format_encoding(format)) encodings.emplace(name, *e);
  return convert_weights(used, model.raw_state_dict(), threads,
                         config.weight_format ? nn::weight_format_encoding(*config.weight_format) : std::nullopt,
                         encodings, cache);
}

void report(const EngineOptions& options, std::string_view stage, int index, int total) {
  if (options.on_stage) options.on_stage(stage, index, total);
}

RowSampling to_row_sampling(const SamplingParams& p) {
  RowSampling row;
  row.temperature = p.temperature;
  row.top_k = p.top_k;
  row.top_p = p.top_p;
  row.min_p = p.min_p;
  row.repetition_penalty = p.repetition_penalty;
  row.frequency_penalty = p.frequency_penalty;
  row.presence_penalty = p.presence_penalty;
  row.top_logprobs = p.top_logprobs;
  return row;
}

// u in [0, 1) on the f32 grid: 24 random bits, so it never rounds up to 1.
float draw_uniform(std::mt19937_64& rng) { return static_cast<float>(rng() >> 40) * 0x1p-24f; }

}  // namespace

// ---- the engine's state -----------------------------------------------------------------------------

namespace {

struct Request {
  RequestId id = 0;
  Sequence seq;
  SamplingParams sampling;
  RowSampling row;  // the graph's per-row parameters
  std::function<void(const RequestUpdate&)> on_update;
  std::mt19937_64 rng;
  std::optional<StopStrings> stop_strings;
  Utf8Stream utf8;
  TokenCounts counts;  // for the penalties
  Clock::time_point submitted;
  RequestMetrics metrics;
  bool finished = false;  // its last update was delivered; the step thread erases it
};

}  // namespace

struct GenerationEngine::Impl {
  nn::LlamaConfig config;
  EngineOptions options;
  std::shared_ptr<nn::Transformer> model;
  std::shared_ptr<BatchSamplerModule> sampler;
  std::shared_ptr<BatchGreedyModule> greedy;
  WeightsRegistry weights;  // the models borrow this memory
  engine::InferenceSession session;
  std::map<std::string, engine::Model> models;
  std::shared_ptr<const Tokenizer> tokenizer;
  std::vector<int64_t> eos_token_ids;
  Tensor cache_k, cache_v;  // [layers, num_blocks, block_size, kv_heads, head_dim]
  std::vector<bool> populated;  // per block: its pages faulted in (populate_block)
  KvBlockPool pool;
  Scheduler scheduler;

  // Shared with submitting threads, under `mutex`.
  mutable std::mutex mutex;
  std::condition_variable wake;
  std::vector<std::unique_ptr<Request>> submitted;
  std::vector<RequestId> cancels;
  std::unordered_set<RequestId> live;  // every request not finished yet
  EngineStats stats;
  RequestId next_id = 1;
  bool stopping = false;

  // The step thread's own.
  std::unordered_map<RequestId, std::unique_ptr<Request>> requests;
  std::thread thread;

  Impl(const nn::LlamaConfig& c, const EngineOptions& o)
      : config(c),
        options(o),
        session({DeviceRef::CPU()}, {}, engine::SessionOptions{.num_threads = o.num_threads}),
        pool(o.kv_cache_bytes / (kv_bytes_per_token(c, o.kv_cache_dtype) * o.kv_block_size), o.kv_block_size),
        scheduler(pool, SchedulerOptions{o.max_num_seqs, o.max_num_batched_tokens, o.enable_prefix_caching}) {}

  void run();
  bool step();
  void populate_block(int32_t block);
  void publish();
  void publish_locked();
  void intake();
  std::vector<GeneratedToken> sample_rows(Tensor& logits, const std::vector<Request*>& rows);
  void emit(Request& r, GeneratedToken token);
  bool is_eos(int64_t id) const {
    return std::binary_search(eos_token_ids.begin(), eos_token_ids.end(), id);
  }
  void finish(Request& r, FinishReason reason, std::string error = {}, RequestUpdate update = {});
  StopStrings::Step held_back(Request& r);
  void deliver(Request& r, RequestUpdate update);
  void fail_all(std::vector<Request*> victims, const std::string& error);
  void check(const GenerationRequest& request, std::vector<int64_t>& prompt) const;
  std::unique_ptr<Request> prepare(GenerationRequest request) const;
};

namespace {
std::future<std::shared_ptr<const Tokenizer>> ready(std::shared_ptr<const Tokenizer> tokenizer) {
  std::promise<std::shared_ptr<const Tokenizer>> promise;
  promise.set_value(std::move(tokenizer));
  return promise.get_future();
}
}  // namespace

GenerationEngine::GenerationEngine(const nn::LlamaConfig& config, const WeightsRegistry& weights,
                                   std::shared_ptr<const Tokenizer> tokenizer, std::vector<int64_t> eos_token_ids,
                                   EngineOptions options)
    : GenerationEngine(config, weights, ready(std::move(tokenizer)), std::move(eos_token_ids), std::move(options)) {}

GenerationEngine::GenerationEngine(const nn::LlamaConfig& config, const WeightsRegistry& weights,
                                   std::future<std::shared_ptr<const Tokenizer>> pending_tokenizer,
                                   std::vector<int64_t> eos_token_ids, EngineOptions options) {
  const nn::LlamaConfig c = compute_config(config, options.weight_format);
  impl_ = std::make_unique<Impl>(c, resolve_options(c, std::move(options)));
  Impl& s = *impl_;
  const EngineOptions& o = s.options;
  s.model = std::make_shared<nn::Transformer>(c, nn::PagedKVLayout{o.kv_block_size, o.kv_cache_dtype}, o.max_seq_len);
  s.sampler = std::make_shared<BatchSamplerModule>(c.vocab_size, o.sampler_max_top_k);
  s.greedy = std::make_shared<BatchGreedyModule>(c.vocab_size);
  // Converted weights are kept beside their packed copies (none when the session keeps none).
  s.weights = prepare_weights(c, *s.model, weights, o.num_threads, s.session.weight_cache());
  s.model->load_state_dict(s.weights);
  s.models = compile_graph_specs(s.session, graph_specs(s.model, s.sampler, s.greedy));

  std::shared_ptr<const Tokenizer> tokenizer = pending_tokenizer.get();  // rethrows a failed load
  if (tokenizer && tokenizer->vocab_size() > c.vocab_size)
    throw ValueError(fmt::format("GenerationEngine: the tokenizer has {} tokens, more than the model's vocab_size {}",
                                 tokenizer->vocab_size(), c.vocab_size));
  if (tokenizer && tokenizer->eos_id()) eos_token_ids.push_back(*tokenizer->eos_id());
  std::sort(eos_token_ids.begin(), eos_token_ids.end());
  eos_token_ids.erase(std::unique(eos_token_ids.begin(), eos_token_ids.end()), eos_token_ids.end());
  s.tokenizer = std::move(tokenizer);
  s.eos_token_ids = std::move(eos_token_ids);

  // Uninitialised: a position is always written before any token reads it.
  const std::vector<int64_t> cache_shape{c.num_hidden_layers, s.pool.num_blocks(), o.kv_block_size,
                                         c.num_key_value_heads, c.resolved_head_dim()};
  s.cache_k = Tensor::empty(o.kv_cache_dtype, cache_shape);
  s.cache_v = Tensor::empty(o.kv_cache_dtype, cache_shape);
  // 4 KiB pages: a layer's blocks lie together, so on huge pages a short request's first token zeroed
  // 2 MiB per layer for K and for V (64 MiB for a 16-layer model; 15% of a warm llama-1B load's time
  // on a VM). Decode at 16 streams of 800-1000 positions read the cache as fast either way.
  for (Tensor* cache : {&s.cache_k, &s.cache_v}) advise_small_pages(cache->data(), cache->nbytes());
  s.populated.assign(static_cast<size_t>(s.pool.num_blocks()), false);
  s.stats.kv_blocks_total = s.pool.num_blocks();
  s.thread = std::thread([&s] { s.run(); });
}

namespace {
// The tokenizer loaded on a thread of its own while the model is compiled and initialised (a large
// vocabulary takes a tenth of a second; the engine takes it once its graphs are ready).
std::future<std::shared_ptr<const Tokenizer>> load_tokenizer_meanwhile(const std::filesystem::path& model_dir) {
  return std::async(std::launch::async, [model_dir]() -> std::shared_ptr<const Tokenizer> {
    return Tokenizer::load(model_dir);
  });
}
}  // namespace

std::unique_ptr<GenerationEngine> GenerationEngine::from_dir(const std::filesystem::path& model_dir,
                                                             EngineOptions options) {
  constexpr int kStages = 4;
  if (is_gguf_file(model_dir)) {
    report(options, "config", 0, kStages);
    const GGUFFile file = GGUFFile::open(model_dir);
    ModelInfo info = gguf_model_info(file);
    if (!options.weight_format) {  // as stored: the file's main format, and each other matrix in its own
      options.weight_format = gguf_weight_format(file);
      info.config.weight_formats = gguf_weight_formats(file, *options.weight_format);
    }
    report(options, "weights", 1, kStages);
    // The engine's session keeps packed weights in the default cache; the q/k rows un-permuted here go
    // there too (none where no cache directory can be named).
    std::optional<engine::WeightCache> cache;
    try {
      cache.emplace();
    } catch (const ValueError&) {
    }
    const WeightsRegistry weights = gguf_weights(file, info, *options.weight_format, cache ? &*cache : nullptr);
    report(options, "tokenizer", 2, kStages);
    auto tokenizer = load_tokenizer_meanwhile(model_dir);
    report(options, "graphs", 3, kStages);
    return std::unique_ptr<GenerationEngine>(
        new GenerationEngine(info.config, weights, std::move(tokenizer), info.eos_token_ids, std::move(options)));
  }
  std::error_code ec;
  if (!std::filesystem::exists(model_dir, ec))
    throw LoadError(fmt::format("GenerationEngine: '{}' does not exist (expected a model directory or a GGUF file)",
                                model_dir.string()));
  if (!std::filesystem::is_directory(model_dir, ec))
    throw LoadError(fmt::format("GenerationEngine: '{}' is a file but not a GGUF file (no 'GGUF' magic); a "
                                "Hugging Face model is a directory (config.json, model.safetensors, tokenizer)",
                                model_dir.string()));
  report(options, "config", 0, kStages);
  ModelInfo info = load_model_info(model_dir);
  report(options, "weights", 1, kStages);
  // Mapping reads only the headers; the config is checked against them before any graph is built.
  WeightsRegistry weights = load_safetensors(model_dir);
  check_checkpoint(info, model_dir, weights);
  report(options, "tokenizer", 2, kStages);
  auto tokenizer = load_tokenizer_meanwhile(model_dir);
  report(options, "graphs", 3, kStages);
  return std::unique_ptr<GenerationEngine>(
      new GenerationEngine(info.config, weights, std::move(tokenizer), info.eos_token_ids, std::move(options)));
}

GenerationEngine::~GenerationEngine() {
  {
    std::lock_guard lock(impl_->mutex);
    impl_->stopping = true;
  }
  impl_->wake.notify_all();
  impl_->thread.join();
}

graph::Module GenerationEngine::trace_graphs(const nn::LlamaConfig& config, const EngineOptions& options) {
  const nn::LlamaConfig c = compute_config(config, options.weight_format);
  const EngineOptions o = resolve_options(c, options);
  auto model = std::make_shared<nn::Transformer>(c, nn::PagedKVLayout{o.kv_block_size, o.kv_cache_dtype}, o.max_seq_len);
  graph::Module module;
  for (const GraphSpec& spec : graph_specs(model, std::make_shared<BatchSamplerModule>(c.vocab_size, o.sampler_max_top_k),
                                           std::make_shared<BatchGreedyModule>(c.vocab_size)))
    spec.trace(&module);
  return module;
}

// ---- intake -------------------------------------------------------------------------------------------

void check_sampling(const SamplingParams& p, int64_t top_k_cap) {
  check_sampling_values(to_row_sampling(p), top_k_cap > 0 ? top_k_cap : std::numeric_limits<int64_t>::max(),
                        "generate");
  if (p.max_new_tokens < 0)
    throw ValueError(fmt::format("generate: max_new_tokens must be >= 0, got {}", p.max_new_tokens));
  for (const std::string& stop : p.stop)
    if (stop.empty()) throw ValueError("generate: a stop string is empty (it would match before any text)");
}

void GenerationEngine::Impl::check(const GenerationRequest& request, std::vector<int64_t>& prompt) const {
  const SamplingParams& p = request.sampling;
  const int64_t vocab = config.vocab_size;
  // A top_k of the whole vocabulary or more keeps every token (prepare turns it off), so only the
  // sampler's own cap below the vocabulary limits it: a small model takes `--top-k 40` as it is.
  check_sampling(p, p.top_k >= vocab ? 0 : options.sampler_max_top_k);
  for (int64_t id : p.stop_token_ids)
    if (id < 0 || id >= vocab)
      throw ValueError(fmt::format("generate: stop token id {} is outside the vocabulary [0, {})", id, vocab));
  if (request.prompt_ids.empty()) {
    if (!tokenizer) throw ValueError("generate: this engine has no tokenizer (give prompt_ids)");
    prompt = tokenizer->encode(request.prompt);
  } else {
    prompt = request.prompt_ids;
  }
  if (prompt.empty()) throw ValueError("generate: the prompt is empty (at least one token is needed)");
  for (int64_t id : prompt)
    if (id < 0 || id >= vocab)
      throw ValueError(fmt::format("generate: prompt token id {} is outside the vocabulary [0, {})", id, vocab));
  if (static_cast<int64_t>(prompt.size()) > options.max_seq_len)
    throw ValueError(fmt::format("generate: the prompt has {} tokens, longer than max_seq_len {}", prompt.size(),
                                 options.max_seq_len));
}

std::unique_ptr<Request> GenerationEngine::Impl::prepare(GenerationRequest request) const {
  auto r = std::make_unique<Request>();
  check(request, r->seq.tokens);
  r->seq.prompt_len = static_cast<int64_t>(r->seq.tokens.size());
  r->sampling = std::move(request.sampling);
  r->row = to_row_sampling(r->sampling);
  if (r->row.top_k >= config.vocab_size) r->row.top_k = 0;  // every token: off (check)
  r->on_update = std::move(request.on_update);
  r->rng.seed(r->sampling.seed ? *r->sampling.seed : std::random_device{}());
  if (!r->sampling.stop.empty()) r->stop_strings.emplace(r->sampling.stop);
  r->counts.add_prompt(r->seq.tokens);
  r->metrics.prompt_tokens = r->seq.prompt_len;
  return r;
}

RequestId GenerationEngine::submit(GenerationRequest request) {
  std::vector<GenerationRequest> one;
  one.push_back(std::move(request));
  return submit(std::move(one)).at(0);
}

std::vector<RequestId> GenerationEngine::submit(std::vector<GenerationRequest> requests) {
  Impl& s = *impl_;
  std::vector<std::unique_ptr<Request>> prepared;
  for (GenerationRequest& request : requests) prepared.push_back(s.prepare(std::move(request)));
  std::vector<RequestId> ids;
  {
    std::lock_guard lock(s.mutex);
    if (s.stopping) throw ValueError("generate: the engine is shutting down");
    const auto now = Clock::now();
    for (auto& r : prepared) {
      r->id = r->seq.id = s.next_id++;
      r->submitted = now;
      ids.push_back(r->id);
      s.live.insert(r->id);
      s.submitted.push_back(std::move(r));
    }
  }
  s.wake.notify_all();
  return ids;
}

bool GenerationEngine::cancel(RequestId id) {
  Impl& s = *impl_;
  {
    std::lock_guard lock(s.mutex);
    if (!s.live.contains(id)) return false;
    s.cancels.push_back(id);
  }
  s.wake.notify_all();
  return true;
}

GenerationOutput GenerationEngine::generate(GenerationRequest request) {
  struct Wait {
    std::mutex mutex;
    std::condition_variable done;
    bool finished = false;
    GenerationOutput out;
  };
  auto wait = std::make_shared<Wait>();
  auto user = std::move(request.on_update);
  request.on_update = [wait, user](const RequestUpdate& u) {
    {
      std::lock_guard lock(wait->mutex);
      GenerationOutput& o = wait->out;
      o.id = u.id;
      o.tokens.insert(o.tokens.end(), u.tokens.begin(), u.tokens.end());
      o.text += u.text;
      o.metrics = u.metrics;
      if (u.finish) {
        o.finish = *u.finish;
        o.error = u.error;
        o.stop_string = u.stop_string;
      }
    }
    // After the user's callback, even when it throws: generate() returns only once it is done.
    struct Done {
      const RequestUpdate& u;
      Wait& wait;
      ~Done() {
        if (!u.finish) return;
        std::lock_guard lock(wait.mutex);
        wait.finished = true;
        wait.done.notify_all();
      }
    } done{u, *wait};
    if (user) user(u);
  };
  submit(std::move(request));
  std::unique_lock lock(wait->mutex);
  wait->done.wait(lock, [&] { return wait->finished; });
  return std::move(wait->out);
}

struct RequestStream::State {
  std::mutex mutex;
  std::condition_variable ready;
  std::deque<RequestUpdate> updates;
  bool finished = false;  // the last update was queued
  bool taken_last = false;
};

std::optional<RequestUpdate> RequestStream::next(std::chrono::milliseconds timeout) {
  std::unique_lock lock(state_->mutex);
  if (!state_->ready.wait_for(lock, timeout, [&] { return !state_->updates.empty() || state_->taken_last; }) ||
      state_->updates.empty())
    return std::nullopt;
  RequestUpdate u = std::move(state_->updates.front());
  state_->updates.pop_front();
  if (u.finish) state_->taken_last = true;
  return u;
}

bool RequestStream::done() const {
  std::lock_guard lock(state_->mutex);
  return state_->taken_last;
}

RequestStream GenerationEngine::stream(GenerationRequest request) {
  auto state = std::make_shared<RequestStream::State>();
  auto user = std::move(request.on_update);
  request.on_update = [state, user](const RequestUpdate& u) {
    // Queued even when the user's callback throws, so the stream always ends.
    struct Queue {
      const RequestUpdate& u;
      RequestStream::State& s;
      ~Queue() {
        std::lock_guard lock(s.mutex);
        if (s.finished) return;
        s.updates.push_back(u);
        s.finished = u.finish.has_value();
        s.ready.notify_all();
      }
    } queue{u, *state};
    if (user) user(u);
  };
  const RequestId id = submit(std::move(request));
  return RequestStream(id, std::move(state));
}

// ---- the step thread ----------------------------------------------------------------------------------

// A callback that throws loses its request, never the step thread: the request finishes with an
// error, which the callback is told once more (a second throw is ignored).
void GenerationEngine::Impl::deliver(Request& r, RequestUpdate update) {
  update.id = r.id;
  update.metrics = r.metrics;
  if (!r.on_update) return;
  std::string failure;
  try {
    r.on_update(update);
    return;
  } catch (const std::exception& e) {
    failure = fmt::format("the request's on_update threw: {}", e.what());
  } catch (...) {
    failure = "the request's on_update threw";
  }
  if (r.finished) {
    r.on_update = {};
    return;
  }
  finish(r, FinishReason::error, std::move(failure));
}

// What the UTF-8 and stop-string filters still hold once the request ends: shown, up to a stop string
// its last bytes complete (then `matched` names it).
StopStrings::Step GenerationEngine::Impl::held_back(Request& r) {
  StopStrings::Step held;
  held.text = r.utf8.flush();
  if (!r.stop_strings) return held;
  held = r.stop_strings->push(held.text);
  if (!held.stopped) held.text += r.stop_strings->finish();
  return held;
}

// The request's last update (merged into `update`); the caller erases it from `requests`.
void GenerationEngine::Impl::finish(Request& r, FinishReason reason, std::string error, RequestUpdate update) {
  if (reason == FinishReason::length) update.text += held_back(r).text;
  update.finish = reason;
  update.error = std::move(error);
  r.finished = true;
  r.metrics.finish_s = seconds_between(r.submitted, Clock::now());
  r.metrics.cached_prompt_tokens = r.seq.cached_prompt_tokens;
  r.metrics.preemptions = r.seq.preemptions;
  scheduler.remove(&r.seq);
  {
    std::lock_guard lock(mutex);
    live.erase(r.id);
    stats.prompt_tokens += r.metrics.prompt_tokens;
    stats.cached_prompt_tokens += r.metrics.cached_prompt_tokens;
    stats.generated_tokens += r.metrics.generated_tokens;
    publish_locked();  // a caller woken by this last update sees the blocks already freed
  }
  deliver(r, std::move(update));
}

// The new token of one request: ids, text through the UTF-8 and stop-string filters, and whether it
// ends the request.
void GenerationEngine::Impl::emit(Request& r, GeneratedToken token) {
  const int64_t id = token.id;
  r.seq.tokens.push_back(id);
  r.counts.add_output(id);
  if (r.metrics.generated_tokens++ == 0) r.metrics.first_token_s = seconds_between(r.submitted, Clock::now());
  RequestUpdate update;
  update.tokens.push_back(std::move(token));
  const SamplingParams& p = r.sampling;
  const bool stop_id = (!p.ignore_eos && is_eos(id)) ||
                       std::find(p.stop_token_ids.begin(), p.stop_token_ids.end(), id) != p.stop_token_ids.end();
  if (stop_id) {  // its text is never shown; what was held back is
    StopStrings::Step held = held_back(r);
    update.text = std::move(held.text);
    update.stop_string = std::move(held.matched);
    return finish(r, FinishReason::stop, {}, std::move(update));
  }
  if (tokenizer) {
    std::string piece = r.utf8.push(output_bytes(*tokenizer, id));
    if (r.stop_strings) {
      StopStrings::Step s = r.stop_strings->push(piece);
      update.text = std::move(s.text);
      if (s.stopped) {
        update.stop_string = s.matched;
        return finish(r, FinishReason::stop, {}, std::move(update));
      }
    } else {
      update.text = std::move(piece);
    }
  }
  if (r.metrics.generated_tokens >= p.max_new_tokens ||
      static_cast<int64_t>(r.seq.tokens.size()) >= options.max_seq_len)
    return finish(r, FinishReason::length, {}, std::move(update));
  deliver(r, std::move(update));
}

// The next token of every sampled row: penalties on the host, then one run of the sampler graph (or
// of the greedy graph, when every row is greedy). Log-probabilities are of the model's own logits.
std::vector<GeneratedToken> GenerationEngine::Impl::sample_rows(Tensor& logits, const std::vector<Request*>& rows) {
  const int64_t vocab = config.vocab_size;
  const auto n = static_cast<int64_t>(rows.size());
  float* data = logits.data_as<float>();
  std::vector<float> temperature(rows.size()), top_p(rows.size()), min_p(rows.size()), u(rows.size());
  std::vector<int64_t> top_k(rows.size());
  std::vector<std::vector<float>> raw(rows.size());  // the model's own logits, for logprobs
  bool all_greedy = true;
  for (size_t i = 0; i < rows.size(); ++i) {
    Request& r = *rows[i];
    std::span<float> row(data + static_cast<int64_t>(i) * vocab, static_cast<size_t>(vocab));
    const bool wants_logprobs = r.sampling.logprobs || r.sampling.top_logprobs > 0;
    if (wants_logprobs && has_penalties(r.row)) raw[i].assign(row.begin(), row.end());
    if (has_penalties(r.row)) apply_penalties(row, r.counts, r.row);
    temperature[i] = static_cast<float>(r.row.temperature);
    top_k[i] = r.row.top_k;
    top_p[i] = static_cast<float>(r.row.top_p);
    min_p[i] = static_cast<float>(r.row.min_p);
    u[i] = draw_uniform(r.rng);  // drawn for every token, so a request's stream of draws is its own
    all_greedy = all_greedy && is_greedy(r.row);
  }
  std::vector<Tensor> out =
      all_greedy ? models.at("greedy").execute({logits})
                 : models.at("sampler").execute({logits, Tensor::from_vector(temperature, {n}),
                                                 Tensor::from_vector(top_k, {n}), Tensor::from_vector(top_p, {n}),
                                                 Tensor::from_vector(min_p, {n}), Tensor::from_vector(u, {n})});
  const std::vector<int64_t> next = out.at(0).to_vector<int64_t>();
  std::vector<GeneratedToken> generated(rows.size());
  for (size_t i = 0; i < rows.size(); ++i) {
    const Request& r = *rows[i];
    generated[i].id = next[i];
    if (!r.sampling.logprobs && r.sampling.top_logprobs == 0) continue;
    std::span<const float> row = raw[i].empty()
                                     ? std::span<const float>(data + static_cast<int64_t>(i) * vocab,
                                                              static_cast<size_t>(vocab))
                                     : std::span<const float>(raw[i]);
    RowLogprobs lp = row_logprobs(row, next[i], r.sampling.top_logprobs);
    generated[i].logprob = lp.chosen;
    generated[i].top_logprobs = std::move(lp.top);
  }
  return generated;
}

void GenerationEngine::Impl::intake() {
  std::vector<std::unique_ptr<Request>> fresh;
  std::vector<RequestId> cancelled;
  {
    std::lock_guard lock(mutex);
    fresh.swap(submitted);
    cancelled.swap(cancels);
  }
  for (auto& r : fresh) {
    Request* req = r.get();
    requests.emplace(req->id, std::move(r));
    if (req->sampling.max_new_tokens == 0 || req->seq.prompt_len >= options.max_seq_len) {
      finish(*req, FinishReason::length);  // no room to generate
      requests.erase(req->id);
      continue;
    }
    scheduler.add(&req->seq);
  }
  for (RequestId id : cancelled) {
    auto it = requests.find(id);
    if (it == requests.end()) continue;  // finished meanwhile
    finish(*it->second, FinishReason::cancelled);
    requests.erase(it);
  }
}

void GenerationEngine::Impl::fail_all(std::vector<Request*> victims, const std::string& error) {
  for (Request* r : victims) {
    r->seq.table.release(pool, /*keep_cached=*/false);  // its KV of this step may be incomplete
    finish(*r, FinishReason::error, error);
    requests.erase(r->id);
  }
}

// What stats() reports of the scheduler and the cache, after each change.
void GenerationEngine::Impl::publish() {
  std::lock_guard lock(mutex);
  publish_locked();
}

void GenerationEngine::Impl::publish_locked() {
  stats.waiting = scheduler.num_waiting() + static_cast<int64_t>(submitted.size());
  stats.running = scheduler.num_running();
  stats.kv_blocks_in_use = pool.num_in_use();
  stats.kv_blocks_cached = pool.num_cached();
}

void GenerationEngine::Impl::run() {
  for (;;) {
    {
      std::unique_lock lock(mutex);
      if (stopping) break;
    }
    bool worked = true;
    try {
      intake();
      worked = step();
    } catch (const std::exception& e) {
      // A step's model and sampler errors fail only that step's requests (step()); anything else
      // (a broken invariant) fails every request, and the engine goes on with an empty cache.
      std::vector<Request*> all;
      for (auto& [id, r] : requests) all.push_back(r.get());
      fail_all(all, fmt::format("the engine's step failed: {}", e.what()));
    }
    publish();
    if (worked) continue;
    std::unique_lock lock(mutex);
    wake.wait(lock, [&] { return stopping || !submitted.empty() || !cancels.empty(); });
  }
  // Shutting down: whatever is left is cancelled.
  intake();
  std::vector<Request*> left;
  for (auto& [id, r] : requests) left.push_back(r.get());
  for (Request* r : left) finish(*r, FinishReason::cancelled);
  requests.clear();
}

// Faults in a block's pages, every layer's of K and of V, before its first step writes it. The cache
// lives on 4 KiB pages the system zeroes at first touch, and a step whose row starts a page waited for
// that fault inside its KV store (llama-1B, f32 cache: a new page every 2 positions in each of 32
// layer caches, 16 faults a token; a K store that took one ran 20-33 us instead of ~2). Pages stay in
// once faulted, so each block needs it once.
void GenerationEngine::Impl::populate_block(int32_t block) {
  if (populated[static_cast<size_t>(block)]) return;
  populated[static_cast<size_t>(block)] = true;
  for (Tensor* cache : {&cache_k, &cache_v}) {
    const int64_t layers = cache->shape()[0], blocks = cache->shape()[1];
    const size_t block_bytes = cache->nbytes() / static_cast<size_t>(layers * blocks);
    auto* base = static_cast<std::byte*>(cache->data());
    for (int64_t layer = 0; layer < layers; ++layer)
      populate_pages(base + static_cast<size_t>(layer * blocks + block) * block_bytes, block_bytes);
  }
}

// One step: false when there was nothing to do.
bool GenerationEngine::Impl::step() {
  StepPlan plan = scheduler.schedule();
  if (plan.empty()) return false;

  // The ragged batch: every chunk's tokens, sequence after sequence.
  const int64_t block_size = pool.block_size();
  std::vector<int64_t> tokens, positions, seq_ids, slots, logit_rows;
  tokens.reserve(static_cast<size_t>(plan.num_tokens));
  positions.reserve(tokens.capacity());
  seq_ids.reserve(tokens.capacity());
  slots.reserve(tokens.capacity());
  size_t max_blocks = 1;
  for (const ScheduledChunk& c : plan.chunks) max_blocks = std::max(max_blocks, c.seq->table.blocks().size());
  std::vector<int64_t> block_tables(plan.chunks.size() * max_blocks, 0);
  std::vector<Request*> sampled;
  for (size_t i = 0; i < plan.chunks.size(); ++i) {
    const ScheduledChunk& c = plan.chunks[i];
    const std::vector<int32_t>& blocks = c.seq->table.blocks();
    std::copy(blocks.begin(), blocks.end(), block_tables.begin() + static_cast<std::ptrdiff_t>(i * max_blocks));
    for (int64_t b = c.start / block_size; c.count > 0 && b <= (c.start + c.count - 1) / block_size; ++b)
      populate_block(blocks[static_cast<size_t>(b)]);
    for (int64_t p = c.start; p < c.start + c.count; ++p) {
      tokens.push_back(c.seq->tokens[static_cast<size_t>(p)]);
      positions.push_back(p);
      seq_ids.push_back(static_cast<int64_t>(i));
      slots.push_back(blocks[static_cast<size_t>(p / block_size)] * block_size + p % block_size);
    }
    if (c.samples) {
      logit_rows.push_back(static_cast<int64_t>(tokens.size()) - 1);
      sampled.push_back(requests.at(c.seq->id).get());
    }
  }
  const auto n = static_cast<int64_t>(tokens.size());
  const auto num_seqs = static_cast<int64_t>(plan.chunks.size());
  const auto rows = static_cast<int64_t>(logit_rows.size());

  std::vector<GeneratedToken> generated;
  std::vector<Tensor> logits;
  try {
    logits = models.at("model").execute(
        {Tensor::from_vector(tokens, {n}), Tensor::from_vector(positions, {n}), Tensor::from_vector(seq_ids, {n}),
         Tensor::from_vector(slots, {n}),
         Tensor::from_vector(block_tables, {num_seqs, static_cast<int64_t>(max_blocks)}),
         Tensor::from_vector(logit_rows, {rows}), cache_k, cache_v});
    scheduler.complete(plan);
    if (rows > 0) generated = sample_rows(logits.at(0), sampled);
  } catch (const std::exception& e) {
    std::vector<Request*> victims;
    for (const ScheduledChunk& c : plan.chunks) victims.push_back(requests.at(c.seq->id).get());
    fail_all(victims, e.what());
    return true;
  }
  {
    std::lock_guard lock(mutex);
    ++stats.steps;
    stats.preemptions += static_cast<int64_t>(plan.preempted.size());
  }
  for (size_t i = 0; i < sampled.size(); ++i) {
    Request& r = *sampled[i];
    emit(r, std::move(generated[i]));
    if (r.finished) requests.erase(r.id);
  }
  return true;
}

// ---- accessors ------------------------------------------------------------------------------------------

EngineStats GenerationEngine::stats() const {
  const Impl& s = *impl_;
  std::lock_guard lock(s.mutex);
  return s.stats;
}

const nn::LlamaConfig& GenerationEngine::config() const { return impl_->config; }
const EngineOptions& GenerationEngine::options() const { return impl_->options; }
int64_t GenerationEngine::max_seq_len() const { return impl_->options.max_seq_len; }
int64_t GenerationEngine::sampler_cap() const { return impl_->options.sampler_max_top_k; }
const Tokenizer* GenerationEngine::tokenizer() const { return impl_->tokenizer.get(); }
const std::vector<int64_t>& GenerationEngine::eos_token_ids() const { return impl_->eos_token_ids; }
const std::map<std::string, engine::Model>& GenerationEngine::models() const { return impl_->models; }
int64_t GenerationEngine::compile_count() const { return impl_->session.compile_count(); }

}  // namespace kiln::pipelines
