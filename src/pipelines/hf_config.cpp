// config.json / generation_config.json of Hugging Face Llama-family checkpoints -> nn::LlamaConfig.
// Defaults follow transformers' LlamaConfig, MistralConfig and Qwen2Config; a field kiln's model
// cannot honour (another rope type, a bias Llama puts on o_proj, a non-SiLU activation) is refused
// rather than ignored, so a config never silently builds the wrong model.
#include "kiln/pipelines/hf_config.h"

#include <fmt/format.h>

#include <algorithm>
#include <fstream>
#include <nlohmann/json.hpp>

namespace kiln::pipelines {
namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

constexpr const char* kSupported = "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM";

json read_json(const fs::path& file) {
  std::ifstream in(file, std::ios::binary);
  if (!in) throw LoadError(fmt::format("load_model_info: {}: cannot open", file.string()));
  try {
    return json::parse(in);
  } catch (const json::parse_error& e) {
    throw LoadError(fmt::format("load_model_info: {}: not valid JSON: {}", file.string(), e.what()));
  }
}

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
      fail(field, fmt::format("is {}, which does not fit int64", v.dump()));
    if (!v.is_number_integer()) fail(field, fmt::format("is {}, expected an integer", v.dump()));
    return v.get<int64_t>();
  }
  double number(const std::string& field, double fallback) const {
    const json& v = get(field);
    if (v.is_null()) return fallback;
    if (!v.is_number()) fail(field, fmt::format("is {}, expected a number", v.dump()));
    return v.get<double>();
  }
  bool boolean(const std::string& field, bool fallback) const {
    const json& v = get(field);
    if (v.is_null()) return fallback;
    if (!v.is_boolean()) fail(field, fmt::format("is {}, expected true or false", v.dump()));
    return v.get<bool>();
  }
  std::optional<std::string> string(const std::string& field) const {
    const json& v = get(field);
    if (v.is_null()) return std::nullopt;
    if (!v.is_string()) fail(field, fmt::format("is {}, expected a string", v.dump()));
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
        fail(field, fmt::format("is {}, expected an integer or a list of integers", v.dump()));
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
      f.fail("architectures", fmt::format("is {}, expected a list of class names", archs.dump()));
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
  if (!v.is_object()) f.fail("rope_scaling", fmt::format("is {}, expected an object or null", v.dump()));
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
    if (!x.is_number()) f.fail(field(name), fmt::format("is {}, expected a number", x.dump()));
    return x.get<double>();
  };
  out.factor = number("factor");
  out.low_freq_factor = number("low_freq_factor");
  out.high_freq_factor = number("high_freq_factor");
  const json& original = named.get("original_max_position_embeddings");
  if (!original.is_number_integer())
    f.fail(field("original_max_position_embeddings"),
           fmt::format("is {}, expected an integer", original.dump()));
  out.original_max_position_embeddings =
      named.integer_value(field("original_max_position_embeddings"), original);
  if (!(out.factor > 0) || !(out.low_freq_factor > 0) || !(out.high_freq_factor > out.low_freq_factor) ||
      out.original_max_position_embeddings <= 0)
    f.fail("rope_scaling",
           fmt::format("is {}: expected factor > 0, 0 < low_freq_factor < high_freq_factor and "
                       "original_max_position_embeddings > 0",
                       v.dump()));
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
  c.vocab_size = f.integer("vocab_size");
  c.hidden_size = f.integer("hidden_size");
  c.intermediate_size = f.integer("intermediate_size");
  c.num_hidden_layers = f.integer("num_hidden_layers");
  c.num_attention_heads = f.integer("num_attention_heads");
  c.num_key_value_heads = f.integer("num_key_value_heads", c.num_attention_heads);
  if (f.has("head_dim")) c.head_dim = f.integer("head_dim");
  c.rms_norm_eps = f.number("rms_norm_eps", 1e-6);
  c.rope_theta = f.number("rope_theta", 10000.0);
  c.rope_scaling = rope_scaling_of(f);
  c.max_position_embeddings = f.integer("max_position_embeddings", qwen2 ? 32768 : mistral ? 131072 : 2048);
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
    c.max_position_embeddings = std::min(c.max_position_embeddings, f.integer("sliding_window"));

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

}  // namespace kiln::pipelines
