// config.json / generation_config.json of Hugging Face Llama-family checkpoints -> nn::LlamaConfig.
// Defaults follow transformers' LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config, Gemma2Config,
// Gemma3TextConfig and Phi3Config; a field kiln's model cannot honour (another rope type, a bias Llama
// puts on o_proj, another activation) is refused rather than ignored, so a config never silently
// builds the wrong model.
#include "kiln/pipelines/hf_config.h"
#include "pipelines/hf_config_internal.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <map>
#include <nlohmann/json.hpp>

#include "pipelines/json_input.h"

namespace kiln::pipelines {
namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

// Each architecture, its model_type, and what it adds to Llama's model (nn::LlamaConfig's fields).
enum class Arch { llama, mistral, qwen2, qwen3, gemma2, gemma3, phi3 };
struct ArchName {
  Arch arch;
  const char* architecture;
  const char* model_type;
};
constexpr ArchName kArchitectures[] = {
    {Arch::llama, "LlamaForCausalLM", "llama"},      {Arch::mistral, "MistralForCausalLM", "mistral"},
    {Arch::qwen2, "Qwen2ForCausalLM", "qwen2"},      {Arch::qwen3, "Qwen3ForCausalLM", "qwen3"},
    {Arch::gemma2, "Gemma2ForCausalLM", "gemma2"},   {Arch::gemma3, "Gemma3ForCausalLM", "gemma3_text"},
    {Arch::phi3, "Phi3ForCausalLM", "phi3"},
};
constexpr const char* kSupported =
    "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, Gemma2ForCausalLM, "
    "Gemma3ForCausalLM, Phi3ForCausalLM";
constexpr const char* kSupportedTypes = "llama, mistral, qwen2, qwen3, gemma2, gemma3_text, phi3";

// Upper bounds on config.json's sizes: far above any published checkpoint (Llama 3.1 405B has 126
// layers, 128 heads, hidden 16384, intermediate 53248; vocabularies reach 256k, contexts 10M), and low
// enough that products of them (KV bytes per token, parameter counts) cannot overflow int64 and a
// config alone cannot make kiln build for minutes before the checkpoint refuses it.
using detail::kMaxLayers;
constexpr int64_t kMaxHeads = 1024;
constexpr int64_t kMaxHiddenSize = int64_t{1} << 17;
constexpr int64_t kMaxIntermediateSize = int64_t{1} << 20;
constexpr int64_t kMaxHeadDim = 4096;
constexpr int64_t kMaxVocabSize = int64_t{1} << 24;  // the tokenizer's id bound too
constexpr int64_t kMaxPositions = int64_t{1} << 24;
constexpr double kMaxRopeTheta = 1e12;
constexpr double kMaxRopeFactor = 1e6;
constexpr double kMaxScalar = 1e6;  // query_pre_attn_scalar, the soft-capping values

json read_json(const fs::path& file) {
  return json_input::parse_file(file, "load_model_info: " + file.string());
}

std::string text(const json& v) { return json_input::describe(v); }

// Typed access to the fields of one JSON file, with errors naming the file and the field.
class Fields {
 public:
  Fields(const fs::path& file, const json& object) : file_(file), object_(object) {}

  [[noreturn]] void fail(const std::string& field, const std::string& what) const {
    throw ValueError(fmt::format("load_model_info: {}: field '{}' {}", file_.string(), field, what));
  }

  // The field's value, or null when absent (HF writes null for "unset").
  const json& get(const std::string& field) const {
    static const json null_value;
    auto it = object_.find(field);
    return it == object_.end() ? null_value : *it;
  }
  bool has(const std::string& field) const { return !get(field).is_null(); }
  // Present, even as null (HF's "none", which differs from a default where the default is not none).
  bool present(const std::string& field) const { return object_.contains(field); }

  int64_t integer(const std::string& field, std::optional<int64_t> fallback = std::nullopt) const {
    const json& v = get(field);
    if (v.is_null()) {
      if (!fallback) fail(field, "is missing (required)");
      return *fallback;
    }
    return integer_value(field, v);
  }
  int64_t integer_value(const std::string& field, const json& v) const {
    if (v.is_number_unsigned() && v.get<uint64_t>() > static_cast<uint64_t>(INT64_MAX))
      fail(field, fmt::format("is {}, which does not fit int64", text(v)));
    if (!v.is_number_integer()) fail(field, fmt::format("is {}, expected an integer", text(v)));
    return v.get<int64_t>();
  }
  // integer(), and in [lo, hi].
  int64_t integer_in(const std::string& field, int64_t lo, int64_t hi,
                     std::optional<int64_t> fallback = std::nullopt) const {
    const int64_t v = integer(field, fallback);
    if (v < lo || v > hi) fail(field, fmt::format("is {}, expected an integer in [{}, {}]", v, lo, hi));
    return v;
  }
  double number(const std::string& field, double fallback) const {
    const json& v = get(field);
    if (v.is_null()) return fallback;
    if (!v.is_number()) fail(field, fmt::format("is {}, expected a number", text(v)));
    return v.get<double>();
  }
  // number(), and in (lo, hi].
  double number_in(const std::string& field, double lo, double hi, double fallback) const {
    const double v = number(field, fallback);
    if (!(v > lo && v <= hi)) fail(field, fmt::format("is {}, expected a number in ({}, {}]", v, lo, hi));
    return v;
  }
  // A positive number in (0, hi] that null turns off: absent gives `fallback` (itself maybe none).
  std::optional<double> optional_number(const std::string& field, double hi, std::optional<double> fallback) const {
    if (!present(field)) return fallback;
    if (get(field).is_null()) return std::nullopt;
    return number_in(field, 0, hi, 0);
  }
  bool boolean(const std::string& field, bool fallback) const {
    const json& v = get(field);
    if (v.is_null()) return fallback;
    if (!v.is_boolean()) fail(field, fmt::format("is {}, expected true or false", text(v)));
    return v.get<bool>();
  }
  std::optional<std::string> string(const std::string& field) const {
    const json& v = get(field);
    if (v.is_null()) return std::nullopt;
    if (!v.is_string()) fail(field, fmt::format("is {}, expected a string", text(v)));
    return v.get<std::string>();
  }
  // A token id field: an integer or a list of integers (eos_token_id), or null.
  std::vector<int64_t> ids(const std::string& field) const {
    const json& v = get(field);
    if (v.is_null()) return {};
    if (!v.is_array()) return {integer_value(field, v)};
    std::vector<int64_t> out;
    for (const json& id : v) {
      if (!id.is_number_integer())
        fail(field, fmt::format("is {}, expected an integer or a list of integers", text(v)));
      out.push_back(integer_value(field, id));
    }
    return out;
  }

  const json& object() const { return object_; }
  const fs::path& file() const { return file_; }

 private:
  const fs::path& file_;
  const json& object_;
};

const ArchName& architecture_of(const Fields& f) {
  const json& archs = f.get("architectures");
  if (!archs.is_null()) {
    if (!archs.is_array() || archs.empty() || !archs[0].is_string())
      f.fail("architectures", fmt::format("is {}, expected a list of class names", text(archs)));
    const std::string arch = archs[0].get<std::string>();
    for (const ArchName& a : kArchitectures)
      if (arch == a.architecture) return a;
    throw ValueError(fmt::format("load_model_info: {}: unsupported architecture '{}' (supported: {})",
                                 f.file().string(), arch, kSupported));
  }
  // Older or hand-made configs name only the model_type.
  const std::optional<std::string> type = f.string("model_type");
  if (!type)
    f.fail("architectures", fmt::format("is missing, and so is 'model_type' (supported: {})", kSupported));
  for (const ArchName& a : kArchitectures)
    if (*type == a.model_type) return a;
  throw ValueError(fmt::format("load_model_info: {}: unsupported model_type '{}' (supported: {})",
                               f.file().string(), *type, kSupportedTypes));
}

// Sets c.rope_scaling (llama3) or c.rope_linear_factor (linear).
void rope_scaling_of(const Fields& f, nn::LlamaConfig& c) {
  const json& v = f.get("rope_scaling");
  if (v.is_null()) return;
  if (!v.is_object()) f.fail("rope_scaling", fmt::format("is {}, expected an object or null", text(v)));
  const Fields named(f.file(), v);
  // transformers renamed "type" to "rope_type"; checkpoints carry either.
  std::optional<std::string> type = named.string("rope_type");
  if (!type) type = named.string("type");
  if (!type) f.fail("rope_scaling", "has no 'rope_type'");
  if (*type == "default") return;
  auto field = [&](const char* name) { return std::string("rope_scaling.") + name; };
  if (*type == "linear") {  // transformers' _compute_linear_scaling_rope_parameters
    const json& factor = named.get("factor");
    if (!factor.is_number()) f.fail(field("factor"), fmt::format("is {}, expected a number", text(factor)));
    c.rope_linear_factor = factor.get<double>();
    if (!(c.rope_linear_factor > 0 && c.rope_linear_factor <= kMaxRopeFactor))
      f.fail(field("factor"), fmt::format("is {}, expected a number in (0, {}]", text(factor), kMaxRopeFactor));
    return;
  }
  if (*type != "llama3")
    f.fail("rope_scaling", fmt::format("has rope_type '{}', which kiln does not support (supported: llama3, "
                                       "linear, default)",
                                       *type));
  nn::Llama3RopeScaling out;
  auto number = [&](const char* name) {
    const json& x = named.get(name);
    if (!x.is_number()) f.fail(field(name), fmt::format("is {}, expected a number", text(x)));
    return x.get<double>();
  };
  out.factor = number("factor");
  out.low_freq_factor = number("low_freq_factor");
  out.high_freq_factor = number("high_freq_factor");
  const json& original = named.get("original_max_position_embeddings");
  if (!original.is_number_integer())
    f.fail(field("original_max_position_embeddings"),
           fmt::format("is {}, expected an integer", text(original)));
  out.original_max_position_embeddings =
      named.integer_value(field("original_max_position_embeddings"), original);
  if (!(out.factor > 0 && out.factor <= kMaxRopeFactor) || !(out.low_freq_factor > 0) ||
      !(out.high_freq_factor > out.low_freq_factor && out.high_freq_factor <= kMaxRopeFactor) ||
      out.original_max_position_embeddings <= 0 || out.original_max_position_embeddings > kMaxPositions)
    f.fail("rope_scaling",
           fmt::format("is {}: expected 0 < factor <= {}, 0 < low_freq_factor < high_freq_factor <= {} and "
                       "original_max_position_embeddings in [1, {}]",
                       text(v), kMaxRopeFactor, kMaxRopeFactor, kMaxPositions));
  c.rope_scaling = out;
}

// Which layers are sliding-window layers: config.json's layer_types when given (transformers >= 4.53
// writes it), else `fallback(layer)`, the architecture's rule.
template <class Rule> std::vector<bool> sliding_layers_of(const Fields& f, int64_t layers, Rule fallback) {
  std::vector<bool> out(static_cast<size_t>(layers));
  const json& types = f.get("layer_types");
  if (types.is_null()) {
    for (int64_t i = 0; i < layers; ++i) out[static_cast<size_t>(i)] = fallback(i);
    return out;
  }
  if (!types.is_array() || static_cast<int64_t>(types.size()) != layers)
    f.fail("layer_types", fmt::format("is {}, expected a list of num_hidden_layers ({}) layer types", text(types),
                                      layers));
  for (int64_t i = 0; i < layers; ++i) {
    const json& t = types[static_cast<size_t>(i)];
    if (t == "sliding_attention") out[static_cast<size_t>(i)] = true;
    else if (t != "full_attention")
      f.fail("layer_types", fmt::format("has {} at {}, expected 'sliding_attention' or 'full_attention'", text(t), i));
  }
  return out;
}

DType dtype_of_config(const Fields& f) {
  // transformers >= 4.56 writes "dtype"; earlier versions "torch_dtype".
  const char* field = f.has("torch_dtype") ? "torch_dtype" : "dtype";
  const std::optional<std::string> name = f.string(field);
  if (!name || *name == "float32") return DType::f32;
  if (*name == "float16") return DType::f16;
  if (*name == "bfloat16") return DType::bf16;
  f.fail(field, fmt::format("is '{}', expected float32, float16 or bfloat16", *name));
}

}  // namespace

namespace detail {

ModelInfo model_info_from_json(const json& config_json, const fs::path& config_path) {
  if (!config_json.is_object())
    throw LoadError(fmt::format("load_model_info: {}: is {}, expected a JSON object", config_path.string(),
                                config_json.type_name()));
  const Fields f(config_path, config_json);

  ModelInfo info;
  const ArchName& arch = architecture_of(f);
  info.architecture = arch.architecture;
  const Arch a = arch.arch;
  const bool qwen = a == Arch::qwen2 || a == Arch::qwen3;
  const bool gemma = a == Arch::gemma2 || a == Arch::gemma3;

  nn::LlamaConfig& c = info.config;
  if (gemma) {
    // transformers' Gemma uses hidden_activation (hidden_act is a legacy copy it ignores).
    const char* field = f.has("hidden_activation") ? "hidden_activation" : "hidden_act";
    if (const auto act = f.string(field); act && *act != "gelu_pytorch_tanh")
      f.fail(field, fmt::format("is '{}', expected 'gelu_pytorch_tanh' (kiln's Gemma MLP is GeGLU, tanh "
                                "approximation)",
                                *act));
    c.hidden_activation = nn::MLPActivation::geglu_tanh;
  } else if (const auto act = f.string("hidden_act"); act && *act != "silu") {
    f.fail("hidden_act", fmt::format("is '{}', expected 'silu' (kiln's {} MLP is SwiGLU)", *act, arch.architecture));
  }

  // Every size is range-checked here, before anything is built from it.
  c.vocab_size = f.integer_in("vocab_size", 1, kMaxVocabSize);
  c.hidden_size = f.integer_in("hidden_size", 1, kMaxHiddenSize);
  c.intermediate_size = f.integer_in("intermediate_size", 1, kMaxIntermediateSize);
  c.num_hidden_layers = f.integer_in("num_hidden_layers", 1, kMaxLayers);
  c.num_attention_heads = f.integer_in("num_attention_heads", 1, kMaxHeads);
  c.num_key_value_heads =
      f.integer_in("num_key_value_heads", 1, c.num_attention_heads, c.num_attention_heads);
  if (c.num_attention_heads % c.num_key_value_heads != 0)
    f.fail("num_key_value_heads", fmt::format("is {}, which does not divide num_attention_heads {}",
                                              c.num_key_value_heads, c.num_attention_heads));
  // Qwen 3 and Gemma configs carry head_dim (their defaults: 128 and 256); the others derive it.
  const int64_t default_head_dim = a == Arch::qwen3 ? 128 : gemma ? 256 : 0;  // 0: derived
  if (f.has("head_dim") || default_head_dim > 0) {
    c.head_dim = f.integer_in("head_dim", 2, kMaxHeadDim, default_head_dim);
  } else if (c.hidden_size % c.num_attention_heads != 0) {
    f.fail("hidden_size", fmt::format("is {}, which num_attention_heads {} does not divide (and there is no "
                                      "head_dim)",
                                      c.hidden_size, c.num_attention_heads));
  }
  if (c.resolved_head_dim() % 2 != 0)
    f.fail(f.has("head_dim") ? "head_dim" : "hidden_size",
           fmt::format("gives head_dim {}, expected an even number (rotary embeddings rotate pairs)",
                       c.resolved_head_dim()));
  c.rms_norm_eps = f.number("rms_norm_eps", a == Arch::phi3 ? 1e-5 : 1e-6);
  if (!(c.rms_norm_eps > 0 && c.rms_norm_eps < 1))
    f.fail("rms_norm_eps", fmt::format("is {}, expected a number in (0, 1)", c.rms_norm_eps));
  c.rope_theta = f.number("rope_theta", a == Arch::gemma3 ? 1e6 : 10000.0);
  if (!(c.rope_theta > 0 && c.rope_theta <= kMaxRopeTheta))
    f.fail("rope_theta", fmt::format("is {}, expected a number in (0, {}]", c.rope_theta, kMaxRopeTheta));
  rope_scaling_of(f, c);
  if (a == Arch::phi3) {
    c.partial_rotary_factor = f.number_in("partial_rotary_factor", 0, 1, 1.0);
    if (c.rotary_dim() < 2 || c.rotary_dim() % 2 != 0)
      f.fail("partial_rotary_factor", fmt::format("is {}, which rotates {} of head_dim {}: expected an even number "
                                                  ">= 2",
                                                  c.partial_rotary_factor, c.rotary_dim(), c.resolved_head_dim()));
  }
  const int64_t default_positions = qwen                ? 32768
                                    : a == Arch::mistral || a == Arch::gemma3 ? 131072
                                    : a == Arch::gemma2 ? 8192
                                    : a == Arch::phi3   ? 4096
                                                        : 2048;
  c.max_position_embeddings = f.integer_in("max_position_embeddings", 1, kMaxPositions, default_positions);
  c.tie_word_embeddings = f.boolean("tie_word_embeddings", gemma);
  c.dtype = dtype_of_config(f);

  // Qwen2 always has q/k/v biases. Llama's attention_bias (and Qwen 3's, Gemma's) also puts a bias on
  // o_proj, and mlp_bias on the MLP, which kiln's layers do not have: refused rather than loading a
  // model without them.
  if (a == Arch::qwen2) {
    c.attention_bias = f.boolean("attention_bias", true);
  } else {
    if (f.boolean("attention_bias", false))
      f.fail("attention_bias", fmt::format("is true, which {} applies to q/k/v and o_proj; kiln supports "
                                           "q/k/v biases only (Qwen2)",
                                           info.architecture));
    c.attention_bias = false;
  }
  if (f.boolean("mlp_bias", false)) f.fail("mlp_bias", "is true; kiln's MLP has no biases");

  // Sliding-window attention, by transformers' rules for each architecture.
  const auto window = [&](std::optional<int64_t> fallback) -> std::optional<int64_t> {
    if (f.present("sliding_window") && f.get("sliding_window").is_null()) return std::nullopt;
    if (!f.has("sliding_window") && !fallback) return std::nullopt;
    return f.integer_in("sliding_window", 1, kMaxPositions, fallback);
  };
  switch (a) {
    case Arch::llama: break;  // LlamaConfig has no window
    case Arch::mistral:       // every layer; MistralConfig's default 4096, null for none
    case Arch::phi3:          // every layer; none by default
      c.sliding_window = window(a == Arch::mistral ? std::optional<int64_t>(4096) : std::nullopt);
      break;
    case Arch::qwen2:
    case Arch::qwen3: {
      // Only with use_sliding_window, and then on layers max_window_layers and up.
      if (!f.boolean("use_sliding_window", false)) break;
      c.sliding_window = window(4096);
      const int64_t max_window_layers = f.integer_in("max_window_layers", 0, kMaxLayers, 28);
      if (c.sliding_window)
        c.sliding_layers = sliding_layers_of(f, c.num_hidden_layers, [&](int64_t i) { return i >= max_window_layers; });
      break;
    }
    case Arch::gemma2:  // even layers slide, odd ones are global
      c.sliding_window = window(4096);
      if (c.sliding_window)
        c.sliding_layers = sliding_layers_of(f, c.num_hidden_layers, [](int64_t i) { return i % 2 == 0; });
      break;
    case Arch::gemma3: {  // every sliding_window_pattern-th layer is global
      c.sliding_window = window(4096);
      const int64_t pattern = f.integer_in("sliding_window_pattern", 1, kMaxLayers, 6);
      if (c.sliding_window)
        c.sliding_layers =
            sliding_layers_of(f, c.num_hidden_layers, [&](int64_t i) { return (i + 1) % pattern != 0; });
      break;
    }
  }

  c.qk_norm = a == Arch::qwen3 || a == Arch::gemma3;
  c.fused_projections = a == Arch::phi3;
  if (gemma) {
    c.norm_unit_offset = true;
    c.sandwich_norms = true;
    c.scale_embeddings = true;
    c.query_pre_attn_scalar = f.number_in("query_pre_attn_scalar", 0, kMaxScalar, 256);
    // Gemma2Config's defaults cap both; Gemma3TextConfig's cap neither; null turns a cap off.
    c.attn_logit_softcapping = f.optional_number("attn_logit_softcapping", kMaxScalar,
                                                 a == Arch::gemma2 ? std::optional<double>(50.0) : std::nullopt);
    c.final_logit_softcapping = f.optional_number("final_logit_softcapping", kMaxScalar,
                                                  a == Arch::gemma2 ? std::optional<double>(30.0) : std::nullopt);
    if (a == Arch::gemma3) c.rope_local_theta = f.number_in("rope_local_base_freq", 0, kMaxRopeTheta, 10000.0);
  }

  info.bos_token_id =
      f.has("bos_token_id") ? std::optional<int64_t>(f.integer("bos_token_id")) : std::nullopt;
  info.eos_token_ids = f.ids("eos_token_id");

  try {
    c.validate();
  } catch (const ValueError& e) {
    throw ValueError(fmt::format("load_model_info: {}: {}", config_path.string(), e.what()));
  }
  return info;
}

}  // namespace detail

ModelInfo load_model_info(const fs::path& model_dir) {
  std::error_code ec;
  if (!fs::is_directory(model_dir, ec))
    throw LoadError(
        fmt::format("load_model_info: {}: not a directory (expected a model directory with "
                    "config.json)",
                    model_dir.string()));
  const fs::path config_path = model_dir / "config.json";
  ModelInfo info = detail::model_info_from_json(read_json(config_path), config_path);

  const fs::path generation_path = model_dir / "generation_config.json";
  if (fs::exists(generation_path, ec)) {
    const json generation_json = read_json(generation_path);
    if (!generation_json.is_object())
      throw LoadError(fmt::format("load_model_info: {}: is {}, expected a JSON object",
                                  generation_path.string(), generation_json.type_name()));
    const Fields g(generation_path, generation_json);
    if (g.has("bos_token_id")) info.bos_token_id = g.integer("bos_token_id");
    if (g.has("eos_token_id")) info.eos_token_ids = g.ids("eos_token_id");
  }
  return info;
}

std::vector<detail::ExpectedTensor> detail::expected_tensors(const nn::LlamaConfig& c) {
  const int64_t hd = c.resolved_head_dim();
  const std::pair<std::string, int64_t> hidden{"hidden_size", c.hidden_size};
  const std::pair<std::string, int64_t> inter{"intermediate_size", c.intermediate_size};
  // head_dim is whatever resolved_head_dim gives, named after the key that set it.
  const std::string q = c.head_dim ? "num_attention_heads * head_dim"
                                   : "num_attention_heads * (hidden_size / num_attention_heads)";
  const std::string kv = c.head_dim ? "num_key_value_heads * head_dim"
                                    : "num_key_value_heads * (hidden_size / num_attention_heads)";
  const std::pair<std::string, int64_t> q_dim{q, c.num_attention_heads * hd};
  const std::pair<std::string, int64_t> kv_dim{kv, c.num_key_value_heads * hd};

  std::vector<ExpectedTensor> out;
  out.push_back({"model.embed_tokens.weight", "vocab_size", {{"vocab_size", c.vocab_size}, hidden}});
  out.push_back({"model.norm.weight", "hidden_size", {hidden}});
  if (!c.tie_word_embeddings)
    out.push_back({"lm_head.weight", "tie_word_embeddings", {{"vocab_size", c.vocab_size}, hidden}});
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    const std::string p = fmt::format("model.layers.{}.", i);
    const std::string layers = "num_hidden_layers";
    out.push_back({p + "input_layernorm.weight", layers, {hidden}});
    out.push_back({p + "post_attention_layernorm.weight", layers, {hidden}});
    if (c.sandwich_norms) {
      out.push_back({p + "pre_feedforward_layernorm.weight", "architectures", {hidden}});
      out.push_back({p + "post_feedforward_layernorm.weight", "architectures", {hidden}});
    }
    if (c.fused_projections) {
      out.push_back({p + "self_attn.qkv_proj.weight",
                     "architectures",
                     {{q + " + 2 * " + kv, (c.num_attention_heads + 2 * c.num_key_value_heads) * hd}, hidden}});
    } else {
      out.push_back({p + "self_attn.q_proj.weight", layers, {q_dim, hidden}});
      out.push_back({p + "self_attn.k_proj.weight", layers, {kv_dim, hidden}});
      out.push_back({p + "self_attn.v_proj.weight", layers, {kv_dim, hidden}});
    }
    if (c.qk_norm) {
      const std::pair<std::string, int64_t> head{c.head_dim ? "head_dim" : "hidden_size / num_attention_heads", hd};
      out.push_back({p + "self_attn.q_norm.weight", "architectures", {head}});
      out.push_back({p + "self_attn.k_norm.weight", "architectures", {head}});
    }
    out.push_back({p + "self_attn.o_proj.weight", layers, {hidden, q_dim}});
    if (c.attention_bias) {
      out.push_back({p + "self_attn.q_proj.bias", "attention_bias", {q_dim}});
      out.push_back({p + "self_attn.k_proj.bias", "attention_bias", {kv_dim}});
      out.push_back({p + "self_attn.v_proj.bias", "attention_bias", {kv_dim}});
    }
    if (c.fused_projections) {
      out.push_back({p + "mlp.gate_up_proj.weight", "architectures", {{"2 * intermediate_size", 2 * c.intermediate_size},
                                                                      hidden}});
    } else {
      out.push_back({p + "mlp.gate_proj.weight", layers, {inter, hidden}});
      out.push_back({p + "mlp.up_proj.weight", layers, {inter, hidden}});
    }
    out.push_back({p + "mlp.down_proj.weight", layers, {hidden, inter}});
  }
  return out;
}

namespace {

using detail::ExpectedTensor;

std::string shape_text(const std::vector<int64_t>& shape) {
  return fmt::format("[{}]", fmt::join(shape, ", "));
}

// The value of a config key as a message shows it ("4", "false").
std::string key_value(const ModelInfo& info, const std::string& key) {
  const nn::LlamaConfig& c = info.config;
  if (key == "architectures") return "'" + info.architecture + "'";
  if (key == "vocab_size") return std::to_string(c.vocab_size);
  if (key == "hidden_size") return std::to_string(c.hidden_size);
  if (key == "intermediate_size") return std::to_string(c.intermediate_size);
  if (key == "num_hidden_layers") return std::to_string(c.num_hidden_layers);
  if (key == "tie_word_embeddings") return c.tie_word_embeddings ? "true" : "false";
  if (key == "attention_bias") return c.attention_bias ? "true" : "false";
  return "?";
}

}  // namespace

void check_checkpoint(const ModelInfo& info, const fs::path& model_dir, const WeightsRegistry& weights) {
  const nn::LlamaConfig& c = info.config;
  const std::string config = (model_dir / "config.json").string();
  auto fail = [&](const std::string& what) {
    throw LoadError(fmt::format("load_model_info: {}: {}", config, what));
  };
  for (const ExpectedTensor& e : detail::expected_tensors(c)) {
    auto it = weights.find(e.name);
    if (it == weights.end())
      fail(fmt::format("'{}' is {}, but the checkpoint has no tensor '{}'", e.because,
                       key_value(info, e.because), e.name));
    const Tensor& t = it->second;
    if (t.dtype() != DType::f32 && t.dtype() != DType::f16 && t.dtype() != DType::bf16)
      fail(fmt::format("tensor '{}' is {}, expected f32, f16 or bf16", e.name, dtype_name(t.dtype())));
    std::vector<int64_t> want;
    for (const auto& [key, size] : e.dims) want.push_back(size);
    if (t.shape() == want) continue;
    // Blame the first dim that differs (or the rank).
    size_t d = 0;
    while (d < want.size() && d < t.shape().size() && t.shape()[d] == want[d]) ++d;
    const auto& [key, size] = e.dims[std::min(d, e.dims.size() - 1)];
    std::vector<std::string> keys;
    for (const auto& [k, n] : e.dims) keys.push_back(k);
    fail(fmt::format("'{}' gives {}, but tensor '{}' has shape {}, expected {} ([{}])", key, size, e.name,
                     shape_text(t.shape()), shape_text(want), fmt::join(keys, ", ")));
  }
  // A layer past the config's count is a checkpoint of another (bigger) model.
  constexpr std::string_view kLayers = "model.layers.";
  for (const auto& [name, tensor] : weights) {
    if (!name.starts_with(kLayers)) continue;
    const char* first = name.data() + kLayers.size();
    const char* last = name.data() + name.size();
    int64_t layer = 0;
    const auto [end, ec] = std::from_chars(first, last, layer);
    if (end == first || end == last || *end != '.') continue;  // not "model.layers.N."
    if (ec != std::errc() || layer >= c.num_hidden_layers)
      fail(fmt::format("'num_hidden_layers' is {}, but the checkpoint has tensor '{}' of a layer past it",
                       c.num_hidden_layers, name));
  }
}

}  // namespace kiln::pipelines
