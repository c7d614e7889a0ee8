// A model from a GGUF file alone: the config from its `{arch}.*` metadata (read and checked by the
// same code as a config.json), its tensors under Hugging Face's names, un-permuted where llama.cpp's
// converter permuted them. docs/gguf.md.
#include "kiln/pipelines/gguf_model.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <charconv>
#include <cmath>
#include <cstring>
#include <map>
#include <span>
#include <nlohmann/json.hpp>

#include "kiln/errors.h"
#include "kiln/graph/dtype.h"
#include "kiln/graph/quantization.h"
#include "pipelines/hf_config_internal.h"
#include "pipelines/derived_tensor.h"

namespace kiln::pipelines {
namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

struct GGUFArch {
  const char* gguf;          // general.architecture
  const char* architecture;  // config.json's class name
  const char* model_type;
  bool permuted_qk;  // llama.cpp's converter permuted q/k rows for its interleaved RoPE
  // Gemma: four norms a layer (ffn_norm is the pre-feed-forward one), each stored as 1 + w
  // (conversion/gemma.py adds the 1 that Hugging Face's Gemma RMSNorm adds at run time).
  bool gemma;
};
// Mistral's and SmolLM's GGUF files say "llama". llama.cpp runs Qwen and Gemma with the rotate-half
// (NeoX) RoPE that Hugging Face uses, so their q/k rows are stored as they are.
constexpr GGUFArch kArchs[] = {
    {"llama", "LlamaForCausalLM", "llama", true, false},
    {"qwen2", "Qwen2ForCausalLM", "qwen2", false, false},
    {"qwen3", "Qwen3ForCausalLM", "qwen3", false, false},
    {"gemma2", "Gemma2ForCausalLM", "gemma2", false, true},
    {"gemma3", "Gemma3ForCausalLM", "gemma3_text", false, true},
};

[[noreturn]] void fail(const GGUFFile& file, const std::string& what) {
  throw LoadError(fmt::format("load_gguf: {}: {}", file.path().string(), what));
}

const GGUFArch& arch_of(const GGUFFile& file) {
  const std::string& name = file.get_string("general.architecture");
  for (const GGUFArch& a : kArchs)
    if (name == a.gguf) return a;
  fail(file, fmt::format("general.architecture is '{}', which kiln does not run from GGUF (supported: llama, "
                         "qwen2, qwen3, gemma2, gemma3)",
                         name));
}

// GGUF's names and Hugging Face's: the model's own tensors, then each layer's (after "blk.N.").
using NamePair = std::pair<std::string_view, std::string_view>;
constexpr std::array<NamePair, 3> kGlobal{{
    {"token_embd.weight", "model.embed_tokens.weight"},
    {"output_norm.weight", "model.norm.weight"},
    {"output.weight", "lm_head.weight"},
}};
constexpr std::array<NamePair, 16> kLayer{{
    {"attn_norm.weight", "input_layernorm.weight"},
    {"attn_q.weight", "self_attn.q_proj.weight"},
    {"attn_k.weight", "self_attn.k_proj.weight"},
    {"attn_v.weight", "self_attn.v_proj.weight"},
    {"attn_q.bias", "self_attn.q_proj.bias"},
    {"attn_k.bias", "self_attn.k_proj.bias"},
    {"attn_v.bias", "self_attn.v_proj.bias"},
    {"attn_q_norm.weight", "self_attn.q_norm.weight"},
    {"attn_k_norm.weight", "self_attn.k_norm.weight"},
    {"attn_output.weight", "self_attn.o_proj.weight"},
    {"ffn_gate.weight", "mlp.gate_proj.weight"},
    {"ffn_up.weight", "mlp.up_proj.weight"},
    {"ffn_down.weight", "mlp.down_proj.weight"},
    {"attn_qkv.weight", "self_attn.qkv_proj.weight"},
    {"ffn_gate_up.weight", "mlp.gate_up_proj.weight"},
    {"attn_output.bias", "self_attn.o_proj.bias"},
}};
// The layer norms after attention, whose names differ between the families.
constexpr std::array<NamePair, 1> kLlamaNorms{{{"ffn_norm.weight", "post_attention_layernorm.weight"}}};
constexpr std::array<NamePair, 3> kGemmaNorms{{
    {"post_attention_norm.weight", "post_attention_layernorm.weight"},
    {"ffn_norm.weight", "pre_feedforward_layernorm.weight"},
    {"post_ffw_norm.weight", "post_feedforward_layernorm.weight"},
}};
std::span<const NamePair> norms_of(const GGUFArch& arch) {
  if (arch.gemma) return kGemmaNorms;
  return kLlamaNorms;
}

// Hugging Face's name of a tensor ("blk.3.attn_q.weight" -> "model.layers.3.self_attn.q_proj.weight");
// nullopt for a name kiln does not know.
std::optional<std::string> hf_name(std::string_view gguf, const GGUFArch& arch) {
  for (const auto& [g, h] : kGlobal)
    if (gguf == g) return std::string(h);
  constexpr std::string_view kBlock = "blk.";
  if (!gguf.starts_with(kBlock)) return std::nullopt;
  const char* first = gguf.data() + kBlock.size();
  const char* last = gguf.data() + gguf.size();
  uint64_t layer = 0;
  const auto [end, ec] = std::from_chars(first, last, layer);
  if (ec != std::errc() || end == first || end == last || *end != '.') return std::nullopt;
  const std::string_view rest(end + 1, last);
  for (const auto& table : {std::span<const NamePair>(kLayer), norms_of(arch)})
    for (const auto& [g, h] : table)
      if (rest == g) return fmt::format("model.layers.{}.{}", layer, h);
  return std::nullopt;
}

// The reverse: the file's name of a tensor the model needs.
std::string gguf_name(const std::string& hf, const GGUFArch& arch) {
  for (const auto& [g, h] : kGlobal)
    if (hf == h) return std::string(g);
  constexpr std::string_view kLayers = "model.layers.";
  if (!std::string_view(hf).starts_with(kLayers)) return hf;
  const size_t dot = hf.find('.', kLayers.size());
  if (dot == std::string::npos) return hf;
  const std::string_view layer = std::string_view(hf).substr(kLayers.size(), dot - kLayers.size());
  const std::string_view rest = std::string_view(hf).substr(dot + 1);
  for (const auto& table : {std::span<const NamePair>(kLayer), norms_of(arch)})
    for (const auto& [g, h] : table)
      if (rest == h) return fmt::format("blk.{}.{}", layer, g);
  return hf;
}

// The config.json field each GGUF key becomes (for config values and for messages).
struct KeyField {
  const char* key;  // after "{arch}."
  const char* field;
};
constexpr KeyField kIntegerKeys[] = {
    {"embedding_length", "hidden_size"},
    {"feed_forward_length", "intermediate_size"},
    {"block_count", "num_hidden_layers"},
    {"attention.head_count", "num_attention_heads"},
    {"attention.head_count_kv", "num_key_value_heads"},
    {"attention.key_length", "head_dim"},
    {"context_length", "max_position_embeddings"},
    {"vocab_size", "vocab_size"},
};
constexpr KeyField kNumberKeys[] = {
    {"attention.layer_norm_rms_epsilon", "rms_norm_eps"},
    {"rope.freq_base", "rope_theta"},
};

// Llama 3.1+'s rope scaling as llama.cpp's converter writes it (LlamaConfig::rope_freq_factors).
constexpr const char* kRopeFreqs = "rope_freqs.weight";

// The weight format that computes a GGUF type as stored; nullopt for the types kiln does not compute.
std::optional<nn::WeightFormat> computed_format(GGMLType type) {
  switch (type) {
    case GGMLType::f32: return nn::WeightFormat::f32;
    case GGMLType::f16: return nn::WeightFormat::f16;
    case GGMLType::bf16: return nn::WeightFormat::bf16;
    case GGMLType::q8_0: return nn::WeightFormat::q8_0;
    case GGMLType::q4_0: return nn::WeightFormat::q4_0;
    case GGMLType::q4_k: return nn::WeightFormat::q4_k;
    case GGMLType::q5_k: return nn::WeightFormat::q5_k;
    case GGMLType::q6_k: return nn::WeightFormat::q6_k;
    default: return std::nullopt;
  }
}

// kiln's encoding of a ggml block type: the same blocks, byte for byte; nullopt for the others.
std::optional<graph::QuantizationEncoding> encoding_of(GGMLType type) {
  const std::optional<nn::WeightFormat> format = computed_format(type);
  return format ? nn::weight_format_encoding(*format) : std::nullopt;
}

// Gemma's fields as llama.cpp reads them (src/models/gemma2.cpp, gemma3.cpp), into config.json's:
// the window and which layers slide (`attention.sliding_window_pattern`: a period p, layer i sliding
// where i % p < p - 1, default 2 for Gemma 2 and 6 for Gemma 3; or one boolean per layer; Gemma 3
// without a window has none), the soft caps, the local layers' RoPE base. The file does not carry
// query_pre_attn_scalar: llama.cpp scales the queries by 1 / sqrt(head_dim), except in the 27B models
// (46 layers of Gemma 2, 62 of Gemma 3) by 1 / sqrt(hidden / heads), which is what their
// config.json's say.
void gemma_fields(const GGUFFile& file, const std::string& prefix, bool gemma3, json& config) {
  const uint64_t layers = file.find_u64(prefix + "block_count").value_or(0);
  const uint64_t heads = file.find_u64(prefix + "attention.head_count").value_or(0);
  const uint64_t hidden = file.find_u64(prefix + "embedding_length").value_or(0);
  if (heads != 0) {
    const bool large = layers == (gemma3 ? 62u : 46u);
    config["query_pre_attn_scalar"] =
        large || !config.contains("head_dim") ? hidden / heads : config["head_dim"].get<uint64_t>();
  }
  for (const char* key : {"attn_logit_softcapping", "final_logit_softcapping"})
    if (auto v = file.find_f64(prefix + key)) config[key] = *v;
  const std::optional<uint64_t> window = file.find_u64(prefix + "attention.sliding_window");
  if (window) config["sliding_window"] = *window;
  if (gemma3 && (!window || *window == 0)) {
    config["sliding_window"] = nullptr;
    return;
  }
  if (gemma3)
    if (auto base = file.find_f64(prefix + "rope.freq_base_swa")) config["rope_local_base_freq"] = *base;
  // A layer count out of config.json's range is refused by name when the config is read; no list
  // that long is built first.
  if (layers == 0 || layers > static_cast<uint64_t>(detail::kMaxLayers)) return;
  const std::string pattern_key = prefix + "attention.sliding_window_pattern";
  json types = json::array();
  const GGUFValue* pattern = file.find(pattern_key);
  if (pattern && pattern->type == GGUFValueType::array) {
    const auto& items = std::get<std::vector<GGUFValue>>(pattern->value);
    if (pattern->element_type != GGUFValueType::boolean || items.size() != layers)
      fail(file, fmt::format("{} must be one boolean per layer ({}) or a period", pattern_key, layers));
    for (const GGUFValue& item : items) types.push_back(std::get<bool>(item.value) ? "sliding_attention" : "full_attention");
  } else {
    const uint64_t period = pattern ? file.get_u64(pattern_key) : gemma3 ? 6 : 2;
    if (period == 0) fail(file, fmt::format("{} is 0, expected a period of at least 1 layer", pattern_key));
    for (uint64_t i = 0; i < layers; ++i) types.push_back(i % period < period - 1 ? "sliding_attention" : "full_attention");
  }
  config["layer_types"] = std::move(types);
}

}  // namespace

ModelInfo gguf_model_info(const GGUFFile& file) {
  const GGUFArch& arch = arch_of(file);
  const std::string prefix = std::string(arch.gguf) + ".";
  json config = json::object();
  config["architectures"] = json::array({arch.architecture});
  config["model_type"] = arch.model_type;
  for (const KeyField& k : kIntegerKeys)
    if (auto v = file.find_u64(prefix + k.key)) config[k.field] = *v;
  for (const KeyField& k : kNumberKeys)
    if (auto v = file.find_f64(prefix + k.key)) config[k.field] = *v;
  if (!config.contains("vocab_size")) {  // older converters leave it to the vocabulary's length
    if (file.contains("tokenizer.ggml.tokens"))
      config["vocab_size"] = file.get_string_array("tokenizer.ggml.tokens").size();
    else if (const GGUFTensor* embed = file.find_tensor("token_embd.weight"); embed && embed->dims.size() == 2)
      config["vocab_size"] = embed->dims[1];
  }
  // The rotated dims: all of head_dim (the partial rotary of Phi and others is not read from GGUF).
  if (auto rotated = file.find_u64(prefix + "rope.dimension_count")) {
    const uint64_t heads = file.find_u64(prefix + "attention.head_count").value_or(0);
    const uint64_t hidden = file.find_u64(prefix + "embedding_length").value_or(0);
    const uint64_t head_dim = file.find_u64(prefix + "attention.key_length")
                                  .value_or(heads ? hidden / heads : 0);
    if (*rotated != head_dim)
      fail(file, fmt::format("{}rope.dimension_count is {}, but the head dimension is {}: kiln rotates whole heads",
                             prefix, *rotated, head_dim));
  }
  if (auto v = file.find_u64(prefix + "attention.value_length"); v && config.contains("head_dim") &&
                                                                  *v != config["head_dim"].get<uint64_t>())
    fail(file, fmt::format("{}attention.value_length is {}, but attention.key_length is {}: kiln needs them equal",
                           prefix, *v, config["head_dim"].get<uint64_t>()));
  if (auto type = file.find_string(prefix + "rope.scaling.type"); type && *type != "none") {
    if (*type != "linear")
      fail(file, fmt::format("{}rope.scaling.type is '{}', which kiln does not read from GGUF (supported: none, "
                             "linear)",
                             prefix, *type));
    config["rope_scaling"] = {{"rope_type", "linear"}, {"factor", file.get_f64(prefix + "rope.scaling.factor")}};
  }
  config["tie_word_embeddings"] = file.find_tensor("output.weight") == nullptr;
  if (arch.gguf == std::string_view("qwen2")) config["attention_bias"] = file.find_tensor("blk.0.attn_q.bias") != nullptr;
  if (arch.gemma) gemma_fields(file, prefix, arch.gguf == std::string_view("gemma3"), config);
  if (auto bos = file.find_u64("tokenizer.ggml.bos_token_id")) config["bos_token_id"] = *bos;
  if (auto eos = file.find_u64("tokenizer.ggml.eos_token_id")) config["eos_token_id"] = *eos;

  ModelInfo info;
  try {
    info = detail::model_info_from_json(config, file.path());
  } catch (const ValueError& e) {
    // Name the GGUF key behind the config field that the message blames.
    std::string message = e.what();
    for (const auto& keys : {std::span<const KeyField>(kIntegerKeys), std::span<const KeyField>(kNumberKeys)})
      for (const KeyField& k : keys)
        if (message.find(fmt::format("field '{}'", k.field)) != std::string::npos) {
          message += fmt::format(" (GGUF key '{}{}')", prefix, k.key);
          throw ValueError(message);
        }
    throw;
  }
  // The file's norm weights already hold the 1 that Gemma's RMSNorm adds.
  if (arch.gemma) info.config.norm_unit_offset = false;
  // Llama 3.1+'s rope scaling, as llama.cpp's converter writes it: a divisor per rotary frequency.
  if (const GGUFTensor* t = file.find_tensor(kRopeFreqs)) {
    const int64_t half = info.config.rotary_dim() / 2;
    if (t->type != GGMLType::f32 || t->dims.size() != 1 || static_cast<int64_t>(t->dims[0]) != half)
      fail(file, fmt::format("tensor '{}' must be f32 [{}] (one factor per rotary frequency), got {} [{}]", kRopeFreqs,
                             half, ggml_type_name(t->type), fmt::join(t->dims, ", ")));
    info.config.rope_freq_factors.resize(static_cast<size_t>(half));
    for (int64_t i = 0; i < half; ++i) {
      float v;
      std::memcpy(&v, t->data.data() + 4 * i, 4);
      if (!(v > 0 && std::isfinite(v)))
        fail(file, fmt::format("tensor '{}': factor {} is {}, expected a positive number", kRopeFreqs, i, v));
      info.config.rope_freq_factors[static_cast<size_t>(i)] = v;
    }
  }
  // llama.cpp stops at every end-of-generation token: end of turn and end of message too (Llama 3's
  // <|eot_id|> and <|eom_id|>).
  for (const char* key : {"tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"})
    if (auto id = file.find_u64(key);
        id && std::find(info.eos_token_ids.begin(), info.eos_token_ids.end(), static_cast<int64_t>(*id)) ==
                  info.eos_token_ids.end())
      info.eos_token_ids.push_back(static_cast<int64_t>(*id));
  return info;
}

nn::WeightFormat gguf_weight_format(const GGUFFile& file) {
  // The type of most matrix elements (a Q4_K_M file's Q4_K); types kiln does not compute run as Q8_0.
  std::map<GGMLType, int64_t> elements;
  for (const GGUFTensor& t : file.tensors())
    if (t.dims.size() == 2) elements[t.type] += t.elements();
  if (elements.empty()) return nn::WeightFormat::f32;
  const GGMLType most =
      std::max_element(elements.begin(), elements.end(), [](auto& a, auto& b) { return a.second < b.second; })->first;
  return computed_format(most).value_or(nn::WeightFormat::q8_0);
}

nn::WeightFormatMap gguf_weight_formats(const GGUFFile& file, nn::WeightFormat format) {
  nn::WeightFormatMap out;
  const GGUFArch& arch = arch_of(file);
  for (const GGUFTensor& t : file.tensors()) {
    if (t.dims.size() != 2) continue;
    const std::optional<nn::WeightFormat> own = computed_format(t.type);
    const std::optional<std::string> name = hf_name(t.name, arch);
    if (own && name && own != nn::model_weight_format(format, t.dims[0])) out.emplace(*name, *own);
  }
  return out;
}

namespace {

// One GGUF tensor's bytes as f32 [rows, cols] (row-major), new memory.
Tensor dequantize(const GGUFFile& file, const GGUFTensor& t) {
  const std::vector<int64_t> shape = t.shape();
  Tensor out = Tensor::empty(DType::f32, shape);
  float* y = out.data_as<float>();
  const int64_t n = t.elements();
  const uint8_t* x = t.data.data();
  switch (t.type) {
    case GGMLType::f32: std::memcpy(y, x, static_cast<size_t>(n) * 4); break;
    case GGMLType::f16:
      for (int64_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, x + 2 * i, 2);
        y[i] = f16_to_f32(h);
      }
      break;
    case GGMLType::bf16:
      for (int64_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, x + 2 * i, 2);
        y[i] = bf16_to_f32(h);
      }
      break;
    default: {
      const std::optional<graph::QuantizationEncoding> encoding = encoding_of(t.type);
      if (!encoding)
        fail(file, fmt::format("tensor '{}' is {}, which kiln does not compute yet (supported: F32, F16, BF16, Q8_0, "
                               "Q4_0, Q4_K, Q5_K, Q6_K)",
                               t.name, ggml_type_name(t.type)));
      const int64_t cols = t.dims[0];
      const int64_t rows = n / cols;
      const int64_t row_bytes = graph::quantized_row_bytes(*encoding, cols, t.name);
      for (int64_t r = 0; r < rows; ++r) graph::dequantize_row(*encoding, x + r * row_bytes, cols, y + r * cols);
    }
  }
  return out;
}

// The tensor as stored, zero-copy: f32/f16/bf16 elements, or quantized rows as u8 [rows, row_bytes]
// (kiln's encodings are GGUF's blocks).
Tensor view(const GGUFFile& file, const GGUFTensor& t) {
  auto* p = const_cast<uint8_t*>(t.data.data());  // the mapping is copy-on-write, as safetensors'
  switch (t.type) {
    case GGMLType::f32: return Tensor::view(file.mapping(), p, DType::f32, t.shape());
    case GGMLType::f16: return Tensor::view(file.mapping(), p, DType::f16, t.shape());
    case GGMLType::bf16: return Tensor::view(file.mapping(), p, DType::bf16, t.shape());
    default: {
      const std::optional<graph::QuantizationEncoding> encoding = encoding_of(t.type);
      if (!encoding) return dequantize(file, t);
      const int64_t cols = t.dims[0];
      return Tensor::view(file.mapping(), p, DType::u8,
                          {t.elements() / cols, graph::quantized_row_bytes(*encoding, cols, t.name)});
    }
  }
}

// llama.cpp's converter stores q/k rows of each head as (half, 2) instead of (2, half) (HF's
// rotate-half pairs i and i + half; llama.cpp's RoPE pairs 2i and 2i + 1). Undoing it moves whole rows,
// so it works on any element or block format.
// The copy is a DerivedTensor: what kernels pack from it is cached as a file's own bytes are, and it is
// an entry of `cache` itself where given.
Tensor unpermute_rows(const Tensor& t, int64_t heads, const engine::WeightCache* cache) {
  const int64_t rows = t.shape()[0];
  const int64_t row_bytes = t.nbytes() / rows;
  const int64_t half = rows / heads / 2;
  DerivedTensor out = derived_tensor(t, fmt::format("rows unpermuted in {} heads", heads), t.dtype(), t.shape(), cache);
  if (out.filled) return out.finish(t);  // read only: a weight is never written
  const auto* src = static_cast<const uint8_t*>(t.data());
  auto* dst = static_cast<uint8_t*>(out.tensor.data());
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t i = 0; i < half; ++i)
      for (int64_t j = 0; j < 2; ++j) {
        const int64_t hf_row = h * 2 * half + j * half + i;
        const int64_t gguf_row = h * 2 * half + i * 2 + j;
        std::memcpy(dst + hf_row * row_bytes, src + gguf_row * row_bytes, static_cast<size_t>(row_bytes));
      }
  return out.finish(t);
}

}  // namespace

WeightsRegistry gguf_weights(const GGUFFile& file, const ModelInfo& info, nn::WeightFormat format,
                             const engine::WeightCache* cache) {
  const GGUFArch& arch = arch_of(file);
  const nn::LlamaConfig& c = info.config;
  // Every tensor the config implies, with the shape it implies (before any data is touched).
  std::map<std::string, std::vector<int64_t>> expected;
  for (const detail::ExpectedTensor& e : detail::expected_tensors(c)) {
    std::vector<int64_t> dims;
    for (const auto& [key, size] : e.dims) dims.push_back(size);
    const std::string name = gguf_name(e.name, arch);
    const GGUFTensor* t = file.find_tensor(name);
    if (!t) fail(file, fmt::format("'{}' is set, but the file has no tensor '{}'", e.because, name));
    if (t->shape() != dims)
      fail(file, fmt::format("tensor '{}' has shape [{}], expected [{}] from the metadata", name,
                             fmt::join(t->shape(), ", "), fmt::join(dims, ", ")));
    expected.emplace(e.name, std::move(dims));
  }
  WeightsRegistry out;
  for (const GGUFTensor& t : file.tensors()) {
    if (t.name == kRopeFreqs) continue;  // read into the config (gguf_model_info)
    const std::optional<std::string> name = hf_name(t.name, arch);
    if (!name || !expected.contains(*name))
      fail(file, fmt::format("tensor '{}' is not part of a {} model with this metadata (kiln would ignore "
                             "what it does)",
                             t.name, arch.gguf));
    // A block-quantized matrix stays as it is where the model computes it in that very encoding (the
    // format, its per-matrix fallback, or the matrix's own entry in c.weight_formats); anything else
    // becomes f32 for convert_weights to convert.
    const std::optional<graph::QuantizationEncoding> encoding = encoding_of(t.type);
    const std::optional<nn::WeightFormat> declared =
        t.dims.size() == 2 ? nn::weight_format_for(format, c.weight_formats, *name, t.dims[0]) : std::nullopt;
    const bool keep = t.type == GGMLType::f32 || t.type == GGMLType::f16 || t.type == GGMLType::bf16 ||
                      (encoding && declared && nn::weight_format_encoding(*declared) == encoding);
    Tensor tensor = keep ? view(file, t) : dequantize(file, t);
    if (arch.permuted_qk && t.dims.size() == 2) {
      const int64_t heads = name->ends_with("self_attn.q_proj.weight")   ? c.num_attention_heads
                            : name->ends_with("self_attn.k_proj.weight") ? c.num_key_value_heads
                                                                          : 0;
      if (heads != 0) tensor = unpermute_rows(tensor, heads, cache);  // the file's pages of them dropped
    }
    out.emplace(*name, std::move(tensor));
  }
  return out;
}

}  // namespace kiln::pipelines
