// TextGenerationPipeline: load -> build the "model", "sampler" and "greedy" graphs -> compile them as
// one group -> prefill the prompt, then decode one token at a time through the KV cache, the sampler
// graph (or, for greedy options, the argmax of the greedy graph) picking every token.
#include "kiln/pipelines/text_generation.h"
#include "kiln/pipelines/weight_conversion.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <random>
#include <thread>

#include "kiln/graph/ops.h"
#include "kiln/pipelines/hf_config.h"
#include "kiln/pipelines/safetensors.h"

namespace kiln::pipelines {

namespace ops = graph::ops;
using graph::TensorValue;

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

// ---- the sampler graph ---------------------------------------------------------------------------

SamplerModule::SamplerModule(int64_t vocab_size, int64_t cap) : vocab_size_(vocab_size), cap_(cap) {
  if (vocab_size < 1)
    throw ValueError(fmt::format("SamplerModule: vocab_size must be >= 1, got {}", vocab_size));
  if (cap < 1 || cap > vocab_size)
    throw ValueError(fmt::format("SamplerModule: cap {} must be in [1, vocab_size {}]", cap, vocab_size));
}

std::vector<nn::TypeTree> SamplerModule::input_types() const {
  using graph::TensorType;
  return {nn::TypeTree(TensorType{DType::f32, {1, vocab_size_}}),  // logits
          nn::TypeTree(TensorType{DType::f32, {}}),                // temperature
          nn::TypeTree(TensorType{DType::i64, {}}),                // top_k
          nn::TypeTree(TensorType{DType::f32, {}}),                // top_p
          nn::TypeTree(TensorType{DType::f32, {}})};               // u in [0, 1)
}

namespace {

TensorValue f32(double v) { return ops::constant(v, DType::f32); }
TensorValue i64(double v) { return ops::constant(v, DType::i64); }

// Inverse CDF over unnormalised weights w [1, n] (a prefix of which may be non-zero): the first index
// whose cumulative weight exceeds u * total, clamped to `last` (u * total can round up to total).
TensorValue inverse_cdf(const TensorValue& w, const TensorValue& u, const TensorValue& last) {
  TensorValue cdf = ops::cumsum(w, -1);                                        // [1, n]
  TensorValue total = ops::slice(cdf, {{0}, {-1}});                            // [1, 1]
  TensorValue below = ops::cast(ops::less_equal(cdf, u * total), DType::i64);  // [1, n]
  return ops::minimum(ops::sum(below, -1), last);                              // [1, 1]
}

}  // namespace

nn::Values SamplerModule::forward(const std::vector<nn::Values>& args) {
  if (args.size() != 5)
    throw ValueError(fmt::format(
        "SamplerModule: expected 5 inputs (logits, temperature, top_k, top_p, u), got {}", args.size()));
  TensorValue logits = args[0].leaf();       // [1, vocab]
  TensorValue temperature = args[1].leaf();  // []
  TensorValue top_k = args[2].leaf();        // [] i64
  TensorValue top_p = args[3].leaf();        // []
  TensorValue u = args[4].leaf();            // []

  TensorValue greedy_token = ops::reshape(ops::argmax(logits, -1), std::vector<int64_t>{1});  // [1]
  TensorValue is_greedy = ops::less_equal(temperature, f32(0));
  TensorValue safe_t = ops::where(is_greedy, f32(1), temperature);  // keeps the unused paths finite

  // Unnormalised probabilities exp((logit - max) / T), at most 1: softmax without the division,
  // which the inverse CDF does not need.
  TensorValue max_logit = ops::max(logits, -1);             // [1, 1]
  TensorValue w = ops::exp((logits - max_logit) / safe_t);  // [1, vocab]

  // Plain temperature sampling (no top_k, no top_p): every token is a candidate, no sort needed.
  TensorValue full_token =
      ops::reshape(inverse_cdf(w, u, i64(static_cast<double>(vocab_size_ - 1))), std::vector<int64_t>{1});

  // top_k / top_p: the cap largest logits, sorted descending (ties: lower id first, as argmax), so
  // top_k = 1 is exactly argmax. Sorting the raw logits, not w, keeps ties that exp would create apart.
  std::vector<TensorValue> sorted = ops::top_k(logits, cap_, -1);
  TensorValue sorted_ids = sorted[1];                                 // [1, cap] i64
  TensorValue sorted_w = ops::exp((sorted[0] - max_logit) / safe_t);  // [1, cap], equals w gathered
  TensorValue rank = ops::range(0, 1, graph::Dim(cap_), DType::i64);  // [cap]
  TensorValue k_off = ops::equal(top_k, i64(0));
  TensorValue keep_k = ops::logical_or(k_off, ops::less(rank, top_k));  // [cap]
  TensorValue w_k = ops::where(keep_k, sorted_w, f32(0));               // [1, cap]
  // top_p sees the distribution after top_k (as Hugging Face's warpers run): renormalised over the
  // top_k when it is on, over the whole vocabulary when it is off.
  TensorValue mass = ops::where(k_off, ops::sum(w, -1), ops::sum(w_k, -1));   // [1, 1]
  TensorValue mass_before = ops::cumsum(w_k / mass, -1, /*exclusive=*/true);  // [1, cap]
  TensorValue keep_p = ops::logical_or(ops::less(mass_before, top_p), ops::greater_equal(top_p, f32(1)));
  TensorValue keep = ops::logical_or(ops::logical_and(keep_k, keep_p), ops::equal(rank, i64(0)));  // [1, cap]
  TensorValue kept_w = ops::where(keep, sorted_w, f32(0));
  // Kept entries are a prefix, so the last kept rank is their count - 1.
  TensorValue last_kept = ops::sum(ops::cast(keep, DType::i64), -1) - 1.0;                      // [1, 1]
  TensorValue pick = ops::reshape(inverse_cdf(kept_w, u, last_kept), std::vector<int64_t>{1});  // [1]
  TensorValue truncated_token = ops::reshape(ops::gather(sorted_ids, pick, 1), std::vector<int64_t>{1});

  TensorValue use_full = ops::logical_and(k_off, ops::greater_equal(top_p, f32(1)));
  return nn::Values(ops::where(is_greedy, greedy_token, ops::where(use_full, full_token, truncated_token)));
}

namespace {

// What SamplerModule gives at temperature 0 (or top_k 1), without computing its other paths: the
// sampler graph is branchless, so every call pays for the softmax numerators of the whole vocabulary,
// its cumulative sum and the top-k sort, which for a small model cost a fifth of a decode step.
class GreedySamplerModule : public nn::Module {
 public:
  explicit GreedySamplerModule(int64_t vocab_size) : vocab_size_(vocab_size) {}
  std::vector<nn::TypeTree> input_types() const {
    return {nn::TypeTree(graph::TensorType{DType::f32, {1, vocab_size_}})};  // logits
  }
  nn::Values forward(const std::vector<nn::Values>& args) override {
    if (args.size() != 1)
      throw ValueError(fmt::format("greedy sampler: expected 1 input (logits), got {}", args.size()));
    return nn::Values(ops::reshape(ops::argmax(args[0].leaf(), -1), std::vector<int64_t>{1}));  // [1]
  }

 private:
  int64_t vocab_size_;
};

// Temperature 0 and top_k 1 both pick argmax(logits) exactly (docs/generation.md, sampler paths 1, 3).
bool is_greedy(double temperature, int64_t top_k) { return temperature <= 0 || top_k == 1; }

}  // namespace

// ---- named random-weight shapes --------------------------------------------------------------------

std::optional<nn::LlamaConfig> named_config(std::string_view name) {
  // llama2.c's TinyStories models (karpathy/tinyllamas): Llama 2 architecture, tied embeddings.
  auto stories = [](int64_t dim, int64_t layers, int64_t heads, int64_t ffn, int64_t seq) {
    nn::LlamaConfig c;
    c.vocab_size = 32000;
    c.hidden_size = dim;
    c.intermediate_size = ffn;
    c.num_hidden_layers = layers;
    c.num_attention_heads = heads;
    c.num_key_value_heads = heads;
    c.rms_norm_eps = 1e-5;
    c.max_position_embeddings = seq;
    c.tie_word_embeddings = true;
    return c;
  };
  if (name == "stories15M") return stories(288, 6, 6, 768, 256);
  if (name == "stories110M") return stories(768, 12, 12, 2048, 1024);
  if (name == "llama-1B") {  // meta-llama/Llama-3.2-1B's config.json
    nn::LlamaConfig c;
    c.vocab_size = 128256;
    c.hidden_size = 2048;
    c.intermediate_size = 8192;
    c.num_hidden_layers = 16;
    c.num_attention_heads = 32;
    c.num_key_value_heads = 8;
    c.head_dim = 64;
    c.rms_norm_eps = 1e-5;
    c.rope_theta = 500000.0;
    c.rope_scaling = nn::Llama3RopeScaling{.factor = 32.0,
                                           .low_freq_factor = 1.0,
                                           .high_freq_factor = 4.0,
                                           .original_max_position_embeddings = 8192};
    c.max_position_embeddings = 131072;
    c.tie_word_embeddings = true;
    return c;
  }
  return std::nullopt;
}

const std::vector<std::string>& named_config_names() {
  static const std::vector<std::string> names{"stories15M", "stories110M", "llama-1B"};
  return names;
}

namespace {

// splitmix64's finaliser: a counter-based generator, so any element can be drawn independently.
uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

uint64_t hash_name(std::string_view name) {  // FNV-1a
  uint64_t h = 0xcbf29ce484222325ULL;
  for (char c : name) h = (h ^ static_cast<unsigned char>(c)) * 0x100000001b3ULL;
  return h;
}

// Runs fn(begin, end) over [0, n) split across the machine's cores; small ranges stay on this thread.
void parallel_ranges(int64_t n, const std::function<void(int64_t, int64_t)>& fn) {
  constexpr int64_t kMinPerThread = int64_t{1} << 20;
  const int64_t threads =
      std::clamp<int64_t>(n / kMinPerThread, 1, std::max(1u, std::thread::hardware_concurrency()));
  if (threads == 1) return fn(0, n);
  std::vector<std::thread> workers;
  for (int64_t t = 1; t < threads; ++t) workers.emplace_back(fn, n * t / threads, n * (t + 1) / threads);
  fn(0, n / threads);
  for (auto& w : workers) w.join();
}

// Hot for big shapes (llama-1B draws 1.2 G values): out[2p], out[2p + 1] for pairs
// first_pair .. first_pair + pairs - 1, uniform in [-0.05, 0.05) from 24 bits each of one hash.
// Cloned for AVX-512 (64-bit multiplies in vectors) and vectorised (the dynamic cost model allows
// the remainder loop that GCC's -O2 default refuses).
__attribute__((target_clones("arch=x86-64-v4", "default"), optimize("vect-cost-model=dynamic"))) void
uniform_pairs(float* out, int64_t first_pair, int64_t pairs, uint64_t key) {
  constexpr float kScale = 0.1f * 0x1p-24f;
  for (int64_t p = 0; p < pairs; ++p) {
    const uint64_t bits = mix64(key + static_cast<uint64_t>(first_pair + p) * 0x9e3779b97f4a7c15ULL);
    out[2 * p] = static_cast<float>(static_cast<uint32_t>(bits & 0xffffff)) * kScale - 0.05f;
    out[2 * p + 1] = static_cast<float>(static_cast<uint32_t>(bits >> 40)) * kScale - 0.05f;
  }
}

// data[i] for i < n: the value of pair i / 2, its low half for even i. Drawn in chunks that stay in
// L1 and then stored as T, so f16/bf16 get exactly the f32 values rounded.
template <class T>
void fill_uniform(T* data, int64_t n, uint64_t key) {
  parallel_ranges((n + 1) / 2, [=](int64_t begin, int64_t end) {
    constexpr int64_t kChunkPairs = 1024;
    float chunk[2 * kChunkPairs];
    for (int64_t p = begin; p < end; p += kChunkPairs) {
      const int64_t pairs = std::min(kChunkPairs, end - p);
      uniform_pairs(chunk, p, pairs, key);
      const int64_t count = std::min(2 * pairs, n - 2 * p);  // the last pair of an odd n is half used
      if constexpr (std::is_same_v<T, float>)
        std::copy(chunk, chunk + count, data + 2 * p);
      else
        std::transform(chunk, chunk + count, data + 2 * p, [](float v) { return T(v); });
    }
  });
}

}  // namespace

WeightsRegistry random_weights(const nn::LlamaConfig& config, uint64_t seed, DType dtype) {
  if (dtype != DType::f32 && dtype != DType::f16 && dtype != DType::bf16)
    throw DTypeError(
        fmt::format("random_weights: dtype must be f32, f16 or bf16, got {}", dtype_name(dtype)));
  nn::LlamaConfig f32_config = config;
  f32_config.dtype = DType::f32;
  nn::Transformer model(f32_config, 1);
  WeightsRegistry weights;
  for (const auto& [name, decl] : model.raw_state_dict()) {
    Tensor t = Tensor::empty(dtype, decl.shape.static_dims());
    const bool is_norm = name.ends_with("norm.weight");
    const uint64_t key = mix64(seed ^ hash_name(name));
    visit_dtype(dtype, [&]<class T>() {
      if constexpr (std::is_same_v<T, float> || std::is_same_v<T, f16_t> || std::is_same_v<T, bf16_t>) {
        T* data = static_cast<T*>(t.data());
        if (is_norm)
          std::fill(data, data + t.numel(), T(1.0f));
        else
          fill_uniform(data, t.numel(), key);
      }
    });
    weights.emplace(name, std::move(t));
  }
  return weights;
}

// ---- the pipeline --------------------------------------------------------------------------------

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
