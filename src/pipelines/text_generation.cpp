// TextGenerationPipeline: load -> build the "model", "sampler" and "greedy" graphs -> compile them as
// one group -> prefill the prompt, then decode one token at a time through the KV cache, the sampler
// graph (or, for greedy options, the argmax of the greedy graph) picking every token.
#include "kiln/pipelines/text_generation.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <random>

#include "greedy_sampler.h"
#include "kiln/pipelines/hf_config.h"
#include "kiln/pipelines/safetensors.h"
#include "kiln/pipelines/weight_conversion.h"

namespace kiln::pipelines {

const char* stop_reason_name(StopReason reason) {
  switch (reason) {
    case StopReason::eos:
      return "eos";
    case StopReason::max_new_tokens:
      return "max_new_tokens";
    case StopReason::cache_full:
      return "cache_full";
  }
  return "?";
}

struct TextGenerationPipeline::State {
  nn::LlamaConfig config;
  int64_t max_seq_len = 0;
  std::shared_ptr<nn::Transformer> model;
  std::shared_ptr<SamplerModule> sampler;
  WeightsRegistry weights;  // the models borrow this memory
  engine::InferenceSession session;
  std::map<std::string, engine::Model> models;
  std::shared_ptr<const Tokenizer> tokenizer;
  std::vector<int64_t> eos_token_ids;
  Tensor cache_k, cache_v;              // [layers, max_seq, kv_heads, head_dim]
  std::vector<int64_t> attention_ones;  // [max_seq], a prefix is each step's attention_mask

  explicit State(engine::SessionOptions options) : session({DeviceRef::CPU()}, {}, options) {}
};

namespace {

// The model always computes in f32 on the CPU: f16/bf16 checkpoints are converted when loaded.
nn::LlamaConfig compute_config(nn::LlamaConfig config) {
  config.dtype = DType::f32;
  config.validate();
  return config;
}

// Temperature 0 and top_k 1 both pick argmax(logits) exactly (docs/generation.md, sampler paths 1, 3).
bool is_greedy(double temperature, int64_t top_k) { return temperature <= 0 || top_k == 1; }

int64_t resolve_max_seq_len(const nn::LlamaConfig& config, int64_t requested) {
  if (requested < 0)
    throw ValueError(fmt::format("TextGenerationPipeline: max_seq_len must be >= 0, got {}", requested));
  if (requested == 0) return std::min<int64_t>(config.max_position_embeddings, 2048);
  if (requested > config.max_position_embeddings)
    throw ValueError(
        fmt::format("TextGenerationPipeline: max_seq_len {} exceeds the model's max_position_embeddings {}",
                    requested, config.max_position_embeddings));
  return requested;
}

int64_t resolve_cap(int64_t vocab_size, int64_t requested) {
  if (requested < 0)
    throw ValueError(
        fmt::format("TextGenerationPipeline: sampler_max_top_k must be >= 0, got {}", requested));
  return requested == 0 ? vocab_size : std::min(requested, vocab_size);
}

std::vector<GraphSpec> graph_specs(const std::shared_ptr<nn::Transformer>& model,
                                   const std::shared_ptr<SamplerModule>& sampler) {
  auto greedy = std::make_shared<GreedySamplerModule>(sampler->vocab_size());
  GraphSpec model_spec;
  model_spec.module = model;
  model_spec.name = "model";
  model_spec.input_types = model->input_tree().value();
  model_spec.group = "text_generation";
  GraphSpec sampler_spec;
  sampler_spec.module = sampler;
  sampler_spec.name = "sampler";
  sampler_spec.input_types = sampler->input_types();
  sampler_spec.group = "text_generation";
  GraphSpec greedy_spec;
  greedy_spec.module = greedy;
  greedy_spec.name = "greedy";
  greedy_spec.input_types = greedy->input_types();
  greedy_spec.group = "text_generation";
  return {model_spec, sampler_spec, greedy_spec};
}

// A checkpoint's tensors as the model declares them: f32 (converted from f16/bf16), without the
// entries Hugging Face itself ignores (a tied model's lm_head copy, rotary inv_freq buffers).
// The checkpoint's tensors in the dtypes and formats the traced model declares (f16/bf16 checkpoints
// widened for f32 layers, narrowed or quantized for the others), minus what the model never reads.
WeightsRegistry prepare_weights(const nn::LlamaConfig& config, const nn::Module& model,
                                const WeightsRegistry& loaded, int threads) {
  WeightsRegistry used;
  for (const auto& [name, tensor] : loaded) {
    if (config.tie_word_embeddings && name == "lm_head.weight") continue;
    if (name.ends_with("rotary_emb.inv_freq")) continue;
    used.emplace(name, tensor);
  }
  return convert_weights(used, model.raw_state_dict(), threads);
}

void report(const PipelineOptions& options, std::string_view stage, int index, int total) {
  if (options.on_stage) options.on_stage(stage, index, total);
}

}  // namespace

TextGenerationPipeline TextGenerationPipeline::from_config(const nn::LlamaConfig& config,
                                                           const WeightsRegistry& weights,
                                                           std::shared_ptr<const Tokenizer> tokenizer,
                                                           std::vector<int64_t> eos_token_ids,
                                                           PipelineOptions options) {
  auto state = std::make_shared<State>(engine::SessionOptions{.num_threads = options.num_threads});
  state->config = compute_config(config);
  state->config.weight_format = options.weight_format;
  state->max_seq_len = resolve_max_seq_len(state->config, options.max_seq_len);
  state->model =
      std::make_shared<nn::Transformer>(state->config, state->max_seq_len, nn::ReturnLogits::last_token);
  state->sampler = std::make_shared<SamplerModule>(
      state->config.vocab_size, resolve_cap(state->config.vocab_size, options.sampler_max_top_k));
  state->weights = prepare_weights(state->config, *state->model, weights, options.num_threads);
  state->model->load_state_dict(state->weights);
  state->models = compile_graph_specs(state->session, graph_specs(state->model, state->sampler));

  if (tokenizer && tokenizer->vocab_size() > state->config.vocab_size)
    throw ValueError(fmt::format(
        "TextGenerationPipeline: the tokenizer has {} tokens, more than the model's vocab_size {}",
        tokenizer->vocab_size(), state->config.vocab_size));
  if (tokenizer && tokenizer->eos_id()) eos_token_ids.push_back(*tokenizer->eos_id());
  std::sort(eos_token_ids.begin(), eos_token_ids.end());
  eos_token_ids.erase(std::unique(eos_token_ids.begin(), eos_token_ids.end()), eos_token_ids.end());
  state->tokenizer = std::move(tokenizer);
  state->eos_token_ids = std::move(eos_token_ids);

  const nn::LlamaConfig& c = state->config;
  std::vector<int64_t> cache_shape{c.num_hidden_layers, state->max_seq_len, c.num_key_value_heads,
                                   c.resolved_head_dim()};
  state->cache_k = Tensor::zeros(DType::f32, cache_shape);
  state->cache_v = Tensor::zeros(DType::f32, cache_shape);
  state->attention_ones.assign(static_cast<size_t>(state->max_seq_len), 1);
  return TextGenerationPipeline(std::move(state));
}

TextGenerationPipeline TextGenerationPipeline::from_dir(const std::filesystem::path& model_dir,
                                                        PipelineOptions options) {
  constexpr int kStages = 4;
  if (!std::filesystem::is_directory(model_dir))
    throw LoadError(
        fmt::format("TextGenerationPipeline: model directory '{}' does not exist", model_dir.string()));
  report(options, "config", 0, kStages);
  ModelInfo info = load_model_info(model_dir);
  report(options, "weights", 1, kStages);
  WeightsRegistry weights = load_safetensors(model_dir);
  report(options, "tokenizer", 2, kStages);
  std::shared_ptr<const Tokenizer> tokenizer = Tokenizer::load(model_dir);
  report(options, "graphs", 3, kStages);
  return from_config(info.config, weights, std::move(tokenizer), info.eos_token_ids, std::move(options));
}

graph::Module TextGenerationPipeline::trace_graphs(const nn::LlamaConfig& config, PipelineOptions options) {
  nn::LlamaConfig c = compute_config(config);
  auto model = std::make_shared<nn::Transformer>(c, resolve_max_seq_len(c, options.max_seq_len),
                                                nn::ReturnLogits::last_token);
  auto sampler =
      std::make_shared<SamplerModule>(c.vocab_size, resolve_cap(c.vocab_size, options.sampler_max_top_k));
  graph::Module module;
  for (const GraphSpec& spec : graph_specs(model, sampler)) spec.trace(&module);
  return module;
}

int64_t TextGenerationPipeline::sample(const Tensor& logits, double temperature, int64_t top_k, double top_p,
                                       float u) const {
  if (is_greedy(temperature, top_k)) return state_->models.at("greedy").execute({logits}).at(0).data_as<int64_t>()[0];
  std::vector<Tensor> out = state_->models.at("sampler").execute(
      {logits, Tensor::scalar<float>(static_cast<float>(temperature)), Tensor::scalar<int64_t>(top_k),
       Tensor::scalar<float>(static_cast<float>(top_p)), Tensor::scalar<float>(u)});
  return out.at(0).data_as<int64_t>()[0];
}

namespace {

void check_options(const GenerationOptions& o, int64_t cap) {
  if (o.max_new_tokens < 0)
    throw ValueError(fmt::format("generate: max_new_tokens must be >= 0, got {}", o.max_new_tokens));
  if (!std::isfinite(o.temperature) || o.temperature < 0)
    throw ValueError(
        fmt::format("generate: temperature must be a finite number >= 0, got {}", o.temperature));
  if (o.top_k < 0 || o.top_k > cap)
    throw ValueError(fmt::format(
        "generate: top_k must be in [0, {}] (0: off; {} is the sampler's cap), got {}", cap, cap, o.top_k));
  if (!(o.top_p > 0 && o.top_p <= 1))
    throw ValueError(fmt::format("generate: top_p must be in (0, 1], got {}", o.top_p));
}

// u in [0, 1) on the f32 grid: 24 random bits, so it never rounds up to 1.
float draw_uniform(std::mt19937_64& rng) { return static_cast<float>(rng() >> 40) * 0x1p-24f; }

double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

}  // namespace

GenerationResult TextGenerationPipeline::generate_ids(const std::vector<int64_t>& prompt_ids,
                                                      const GenerationOptions& options,
                                                      const std::function<void(int64_t)>& on_token) {
  State& s = *state_;
  check_options(options, s.sampler->cap());
  const int64_t vocab = s.config.vocab_size;
  const auto prompt_len = static_cast<int64_t>(prompt_ids.size());
  if (prompt_ids.empty()) throw ValueError("generate: the prompt is empty (at least one token is needed)");
  for (int64_t id : prompt_ids)
    if (id < 0 || id >= vocab)
      throw ValueError(
          fmt::format("generate: prompt token id {} is outside the vocabulary [0, {})", id, vocab));
  if (prompt_len > s.max_seq_len)
    throw ValueError(
        fmt::format("generate: the prompt has {} tokens, longer than the KV cache of {} tokens "
                    "(max_seq_len)",
                    prompt_len, s.max_seq_len));

  GenerationResult result;
  GenerationStats& stats = result.stats;
  stats.prompt_tokens = prompt_len;
  if (options.max_new_tokens == 0) {
    stats.stop_reason = StopReason::max_new_tokens;
    return result;
  }
  if (prompt_len == s.max_seq_len) {  // no room for one more token
    stats.stop_reason = StopReason::cache_full;
    return result;
  }

  std::mt19937_64 rng(options.seed);
  const engine::Model& model = s.models.at("model");
  // Feeds `tokens` after `total - tokens.size()` cached ones; returns the next token.
  auto step = [&](const std::vector<int64_t>& tokens, int64_t total) {
    const auto seq = static_cast<int64_t>(tokens.size());
    std::vector<Tensor> out =
        model.execute({Tensor::from_vector(tokens, {seq}),
                       Tensor::borrow(s.attention_ones.data(), DType::i64, {total}), s.cache_k, s.cache_v});
    return sample(out.at(0), options.temperature, options.top_k, options.top_p,  // [1, vocab]
                  draw_uniform(rng));
  };
  auto is_eos = [&](int64_t id) {
    return std::find(s.eos_token_ids.begin(), s.eos_token_ids.end(), id) != s.eos_token_ids.end();
  };

  auto start = std::chrono::steady_clock::now();
  int64_t next = step(prompt_ids, prompt_len);
  stats.prefill_seconds = seconds_since(start);
  start = std::chrono::steady_clock::now();
  int64_t length = prompt_len;  // tokens in the sequence so far
  for (;;) {
    result.ids.push_back(next);
    ++length;
    if (on_token) on_token(next);
    if (options.stop_at_eos && is_eos(next)) {
      stats.stop_reason = StopReason::eos;
      break;
    }
    if (static_cast<int64_t>(result.ids.size()) == options.max_new_tokens) {
      stats.stop_reason = StopReason::max_new_tokens;
      break;
    }
    if (length == s.max_seq_len) {  // the sequence fills the cache
      stats.stop_reason = StopReason::cache_full;
      break;
    }
    next = step({next}, length);
  }
  stats.decode_seconds = seconds_since(start);
  stats.generated_tokens = static_cast<int64_t>(result.ids.size());
  if (stats.prefill_seconds > 0)
    stats.prefill_tokens_per_s = static_cast<double>(prompt_len) / stats.prefill_seconds;
  if (stats.decode_seconds > 0 && stats.generated_tokens > 1)
    stats.decode_tokens_per_s = static_cast<double>(stats.generated_tokens - 1) / stats.decode_seconds;
  return result;
}

GenerationResult TextGenerationPipeline::generate(std::string_view prompt, const GenerationOptions& options,
                                                  const std::function<void(std::string_view)>& on_text) {
  const Tokenizer* tok = state_->tokenizer.get();
  if (!tok) throw ValueError("generate: this pipeline has no tokenizer (use generate_ids)");
  std::vector<int64_t> prompt_ids = tok->encode(prompt);
  Utf8Stream stream;
  std::string text;
  auto emit = [&](const std::string& piece) {
    if (piece.empty()) return;
    text += piece;
    if (on_text) on_text(piece);
  };
  GenerationResult result =
      generate_ids(prompt_ids, options, [&](int64_t id) { emit(stream.push(tok->token_bytes(id))); });
  emit(stream.flush());
  result.text = std::move(text);
  return result;
}

const nn::LlamaConfig& TextGenerationPipeline::config() const { return state_->config; }
int64_t TextGenerationPipeline::max_seq_len() const { return state_->max_seq_len; }
int64_t TextGenerationPipeline::sampler_cap() const { return state_->sampler->cap(); }
const Tokenizer* TextGenerationPipeline::tokenizer() const { return state_->tokenizer.get(); }
const std::vector<int64_t>& TextGenerationPipeline::eos_token_ids() const { return state_->eos_token_ids; }
const std::map<std::string, engine::Model>& TextGenerationPipeline::models() const { return state_->models; }
int64_t TextGenerationPipeline::compile_count() const { return state_->session.compile_count(); }

}  // namespace kiln::pipelines
