// config.json / generation_config.json of Hugging Face Llama-family checkpoints -> nn::LlamaConfig.
// Defaults follow transformers' LlamaConfig, MistralConfig and Qwen2Config; a field kiln's model
// cannot honour (another rope type, a bias Llama puts on o_proj, a non-SiLU activation) is refused
// rather than ignored, so a config never silently builds the wrong model.
#include "kiln/pipelines/hf_config.h"

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

constexpr const char* kSupported = "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM";

// Upper bounds on config.json's sizes: far above any published checkpoint (Llama 3.1 405B has 126
// layers, 128 heads, hidden 16384, intermediate 53248; vocabularies reach 256k, contexts 10M), and low
// enough that products of them (KV bytes per token, parameter counts) cannot overflow int64 and a
// config alone cannot make kiln build for minutes before the checkpoint refuses it.
constexpr int64_t kMaxLayers = 1024;
constexpr int64_t kMaxHeads = 1024;
constexpr int64_t kMaxHiddenSize = int64_t{1} << 17;
constexpr int64_t kMaxIntermediateSize = int64_t{1} << 20;
constexpr int64_t kMaxHeadDim = 4096;
constexpr int64_t kMaxVocabSize = int64_t{1} << 24;  // the tokenizer's id bound too
constexpr int64_t kMaxPositions = int64_t{1} << 24;
constexpr double kMaxRopeTheta = 1e12;
constexpr double kMaxRopeFactor = 1e6;

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

std::string architecture_of(const Fields& f) {
  const json& archs = f.get("architectures");
  if (!archs.is_null()) {
    if (!archs.is_array() || archs.empty() || !archs[0].is_string())
      f.fail("architectures", fmt::format("is {}, expected a list of class names", text(archs)));
    const std::string arch = archs[0].get<std::string>();
    if (arch != "LlamaForCausalLM" && arch != "MistralForCausalLM" && arch != "Qwen2ForCausalLM")
      throw ValueError(fmt::format("load_model_info: {}: unsupported architecture '{}' (supported: {})",
                                   f.file().string(), arch, kSupported));
    return arch;
  }
  // Older or hand-made configs name only the model_type.
  const std::optional<std::string> type = f.string("model_type");
  if (!type)
    f.fail("architectures", fmt::format("is missing, and so is 'model_type' (supported: {})", kSupported));
  if (*type == "llama") return "LlamaForCausalLM";
  if (*type == "mistral") return "MistralForCausalLM";
  if (*type == "qwen2") return "Qwen2ForCausalLM";
  throw ValueError(
      fmt::format("load_model_info: {}: unsupported model_type '{}' (supported: llama, mistral, qwen2)",
                  f.file().string(), *type));
}

std::optional<nn::Llama3RopeScaling> rope_scaling_of(const Fields& f) {
  const json& v = f.get("rope_scaling");
  if (v.is_null()) return std::nullopt;
  if (!v.is_object()) f.fail("rope_scaling", fmt::format("is {}, expected an object or null", text(v)));
  const Fields named(f.file(), v);
  // transformers renamed "type" to "rope_type"; checkpoints carry either.
  std::optional<std::string> type = named.string("rope_type");
  if (!type) type = named.string("type");
  if (!type) f.fail("rope_scaling", "has no 'rope_type'");
  if (*type == "default") return std::nullopt;
  if (*type != "llama3")
    f.fail("rope_scaling", fmt::format("has rope_type '{}', which kiln does not support (supported: llama3, "
                                       "default)",
                                       *type));
  nn::Llama3RopeScaling out;
  auto field = [&](const char* name) { return std::string("rope_scaling.") + name; };
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

ModelInfo load_model_info(const fs::path& model_dir) {
  std::error_code ec;
  if (!fs::is_directory(model_dir, ec))
    throw LoadError(
        fmt::format("load_model_info: {}: not a directory (expected a model directory with "
                    "config.json)",
                    model_dir.string()));
  const fs::path config_path = model_dir / "config.json";
  const json config_json = read_json(config_path);
  if (!config_json.is_object())
    throw LoadError(fmt::format("load_model_info: {}: is {}, expected a JSON object", config_path.string(),
                                config_json.type_name()));
  const Fields f(config_path, config_json);

  ModelInfo info;
  info.architecture = architecture_of(f);
  const bool qwen2 = info.architecture == "Qwen2ForCausalLM";
  const bool mistral = info.architecture == "MistralForCausalLM";

  if (const auto act = f.string("hidden_act"); act && *act != "silu")
    f.fail("hidden_act", fmt::format("is '{}', expected 'silu' (kiln's Llama MLP is SwiGLU)", *act));

  nn::LlamaConfig& c = info.config;
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
  if (f.has("head_dim")) {
    c.head_dim = f.integer_in("head_dim", 2, kMaxHeadDim);
  } else if (c.hidden_size % c.num_attention_heads != 0) {
    f.fail("hidden_size", fmt::format("is {}, which num_attention_heads {} does not divide (and there is no "
                                      "head_dim)",
                                      c.hidden_size, c.num_attention_heads));
  }
  if (c.resolved_head_dim() % 2 != 0)
    f.fail(f.has("head_dim") ? "head_dim" : "hidden_size",
           fmt::format("gives head_dim {}, expected an even number (rotary embeddings rotate pairs)",
                       c.resolved_head_dim()));
  c.rms_norm_eps = f.number("rms_norm_eps", 1e-6);
  if (!(c.rms_norm_eps > 0 && c.rms_norm_eps < 1))
    f.fail("rms_norm_eps", fmt::format("is {}, expected a number in (0, 1)", c.rms_norm_eps));
  c.rope_theta = f.number("rope_theta", 10000.0);
  if (!(c.rope_theta > 0 && c.rope_theta <= kMaxRopeTheta))
    f.fail("rope_theta", fmt::format("is {}, expected a number in (0, {}]", c.rope_theta, kMaxRopeTheta));
  c.rope_scaling = rope_scaling_of(f);
  const int64_t default_positions = qwen2 ? 32768 : mistral ? 131072 : 2048;
  c.max_position_embeddings = f.integer_in("max_position_embeddings", 1, kMaxPositions, default_positions);
  c.tie_word_embeddings = f.boolean("tie_word_embeddings", false);
  c.dtype = dtype_of_config(f);

  // Qwen2 always has q/k/v biases. Llama's attention_bias also puts a bias on o_proj, and mlp_bias on
  // the MLP, which kiln's layers do not have: refused rather than loading a model without them.
  if (qwen2) {
    c.attention_bias = f.boolean("attention_bias", true);
  } else {
    if (f.boolean("attention_bias", false))
      f.fail("attention_bias", fmt::format("is true, which {} applies to q/k/v and o_proj; kiln supports "
                                           "q/k/v biases only (Qwen2)",
                                           info.architecture));
    c.attention_bias = false;
  }
  if (f.boolean("mlp_bias", false)) f.fail("mlp_bias", "is true; kiln's MLP has no biases");

  // kiln's attention is full attention: with a sliding window it is exact only up to the window, so
  // the window caps the context.
  const bool windowed = qwen2 ? f.boolean("use_sliding_window", false) : f.has("sliding_window");
  if (windowed && f.has("sliding_window"))
    c.max_position_embeddings =
        std::min(c.max_position_embeddings, f.integer_in("sliding_window", 1, kMaxPositions));

  info.bos_token_id =
      f.has("bos_token_id") ? std::optional<int64_t>(f.integer("bos_token_id")) : std::nullopt;
  info.eos_token_ids = f.ids("eos_token_id");

  try {
    c.validate();
  } catch (const ValueError& e) {
    throw ValueError(fmt::format("load_model_info: {}: {}", config_path.string(), e.what()));
  }

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

namespace {

std::string shape_text(const std::vector<int64_t>& shape) {
  return fmt::format("[{}]", fmt::join(shape, ", "));
}

// One tensor the config implies: its name, why it is expected (the key a message blames when it is
// missing), and per dim the key that sets it and its size.
struct ExpectedTensor {
  std::string name;
  std::string because;  // "num_hidden_layers", "tie_word_embeddings", ...
  std::vector<std::pair<std::string, int64_t>> dims;
};

std::vector<ExpectedTensor> expected_tensors(const nn::LlamaConfig& c) {
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
    out.push_back({p + "self_attn.q_proj.weight", layers, {q_dim, hidden}});
    out.push_back({p + "self_attn.k_proj.weight", layers, {kv_dim, hidden}});
    out.push_back({p + "self_attn.v_proj.weight", layers, {kv_dim, hidden}});
    out.push_back({p + "self_attn.o_proj.weight", layers, {hidden, q_dim}});
    if (c.attention_bias) {
      out.push_back({p + "self_attn.q_proj.bias", "attention_bias", {q_dim}});
      out.push_back({p + "self_attn.k_proj.bias", "attention_bias", {kv_dim}});
      out.push_back({p + "self_attn.v_proj.bias", "attention_bias", {kv_dim}});
    }
    out.push_back({p + "mlp.gate_proj.weight", layers, {inter, hidden}});
    out.push_back({p + "mlp.up_proj.weight", layers, {inter, hidden}});
    out.push_back({p + "mlp.down_proj.weight", layers, {hidden, inter}});
  }
  return out;
}

// The value of a config key as a message shows it ("4", "false").
std::string key_value(const nn::LlamaConfig& c, const std::string& key) {
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
  for (const ExpectedTensor& e : expected_tensors(c)) {
    auto it = weights.find(e.name);
    if (it == weights.end())
      fail(fmt::format("'{}' is {}, but the checkpoint has no tensor '{}'", e.because,
                       key_value(c, e.because), e.name));
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
