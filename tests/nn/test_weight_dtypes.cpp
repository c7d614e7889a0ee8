// Weight formats in the Llama reference configs (tests/data/llama_reference_*.json), and in a random
// Llama shape whose rows split into the K-quants' 256-blocks: the same hashed checkpoint run with f32
// weights and with bf16, f16 or quantized weights (converted here, by the test's own loops, with
// graph::quantize_row), activations f32 throughout. The logits must stay within the documented tolerance of
// the f32 logits, relative to max |logit| (docs/quantization.md: measured errors and margins), and
// greedy tokens must agree. Also: a Linear / Embedding declares its weight in its format.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "../test_util.h"
#include "hashed_weights.h"
#include "kiln/engine/session.h"
#include "kiln/graph/quantization.h"
#include "kiln/nn/attention.h"
#include "kiln/nn/mlp.h"
#include "kiln/nn/transformer.h"

namespace {

using namespace kiln;
using nlohmann::json;
using nn::WeightFormat;

constexpr int64_t kCacheLen = 16;

nn::LlamaConfig load_config(const std::string& name) {
  auto path = std::filesystem::path(__FILE__).parent_path().parent_path() / "data" /
              ("llama_reference_" + name + ".json");
  std::ifstream file(path);
  if (!file) throw std::runtime_error("cannot open " + path.string());
  const json c = json::parse(file).at("config");
  nn::LlamaConfig r;
  r.vocab_size = c.at("vocab_size");
  r.hidden_size = c.at("hidden_size");
  r.intermediate_size = c.at("intermediate_size");
  r.num_hidden_layers = c.at("num_hidden_layers");
  r.num_attention_heads = c.at("num_attention_heads");
  r.num_key_value_heads = c.at("num_key_value_heads");
  r.rms_norm_eps = c.at("rms_norm_eps");
  r.rope_theta = c.at("rope_theta");
  r.max_position_embeddings = c.at("max_position_embeddings");
  r.tie_word_embeddings = c.at("tie_word_embeddings");
  r.attention_bias = c.at("attention_bias");
  if (!c.at("rope_scaling").is_null()) {
    const json& s = c.at("rope_scaling");
    r.rope_scaling = nn::Llama3RopeScaling{s.at("factor"), s.at("low_freq_factor"), s.at("high_freq_factor"),
                                           s.at("original_max_position_embeddings")};
  }
  return r;
}

// A Llama shape (random, not a real model's) whose every row splits into 256-blocks, so q4_k, q5_k
// and q6_k quantize every matrix (in the reference configs, 64 and 160 wide, they fall back to q8_0).
nn::LlamaConfig k_quant_config() {
  nn::LlamaConfig r = load_config("llama3_tied");
  r.vocab_size = 512;
  r.hidden_size = 256;
  r.intermediate_size = 768;
  r.num_attention_heads = 4;  // head_dim 64: o_proj's rows are 256 too
  r.num_key_value_heads = 2;
  return r;
}

// The hashed f32 checkpoint, converted to what `model` declares: the test's own casts and quantized
// rows (a u8 weight in the config's format, or in the format model_weight_format falls back to).
WeightsRegistry converted_weights(const nn::LlamaConfig& config, const nn::Transformer& model) {
  nn::LlamaConfig f32_config = config;
  f32_config.weight_format = std::nullopt;
  const auto f32_decls = nn::Transformer(f32_config, kCacheLen).raw_state_dict();
  WeightsRegistry weights;
  for (const auto& [name, w] : model.raw_state_dict()) {
    const std::vector<int64_t> shape = w.shape.static_dims();
    if (w.dtype == DType::f32) {
      weights.emplace(name, nn::hashed_weights::make(name, shape));
      continue;
    }
    if (w.dtype == DType::u8) {  // [rows, row bytes of cols]
      const int64_t rows = shape[0], cols = f32_decls.at(name).shape.static_dims()[1];
      const graph::QuantizationEncoding e = *nn::weight_format_encoding(*nn::model_weight_format(config.weight_format, cols));
      EXPECT_EQ(graph::quantized_row_bytes(e, cols), shape[1]) << name;
      const std::vector<float> f = nn::hashed_weights::make(name, {rows, cols}).to_vector<float>();
      std::vector<uint8_t> q(static_cast<size_t>(rows * shape[1]));
      for (int64_t r = 0; r < rows; ++r) graph::quantize_row(e, f.data() + r * cols, cols, q.data() + r * shape[1]);
      weights.emplace(name, Tensor::from_vector(q, shape));
      continue;
    }
    const std::vector<float> f = nn::hashed_weights::make(name, shape).to_vector<float>();
    if (w.dtype == DType::bf16) {
      std::vector<bf16_t> h(f.size());
      for (size_t i = 0; i < f.size(); ++i) h[i] = bf16_t(f[i]);
      weights.emplace(name, Tensor::from_vector(h, shape));
    } else {
      std::vector<f16_t> h(f.size());
      for (size_t i = 0; i < f.size(); ++i) h[i] = f16_t(f[i]);
      weights.emplace(name, Tensor::from_vector(h, shape));
    }
  }
  return weights;
}

engine::Model load_model(const nn::LlamaConfig& config, nn::Transformer& model) {
  const nn::TypeTree tree = *model.input_tree();
  graph::Graph g("llama", tree.flatten());
  {
    graph::Graph::Scope scope(g);
    g.output(model.forward({tree.unflatten(g.inputs())}).flatten());
  }
  engine::InferenceSession session({DeviceRef::CPU()});
  return session.load(g, converted_weights(config, model));
}

// Logits [rows][vocab] of the prompt as a 12-token prefill then two single-token decode steps: more
// than 8 rows take the prefill kernels (AMX tiles for bf16 where the CPU has them, the int8 GEMM for
// Q8_0), one row the decode GEMVs.
std::vector<std::vector<float>> prefill_then_decode(const nn::LlamaConfig& config) {
  nn::Transformer model(config, kCacheLen);
  engine::Model compiled = load_model(config, model);
  const std::vector<int64_t> shape{config.num_hidden_layers, kCacheLen, config.num_key_value_heads,
                                   config.resolved_head_dim()};
  Tensor k = Tensor::zeros(DType::f32, shape), v = Tensor::zeros(DType::f32, shape);
  const std::vector<int64_t> prompt{3, 17, 42, 99, 5, 64, 127, 8, 77, 31, 12, 100, 55, 2};
  std::vector<std::vector<float>> rows;
  for (auto [begin, end] : {std::pair<int64_t, int64_t>{0, 12}, {12, 13}, {13, 14}}) {
    std::vector<int64_t> tokens(prompt.begin() + begin, prompt.begin() + end);
    auto out = compiled.execute({Tensor::from_vector(tokens, {end - begin}),
                                 Tensor::from_vector(std::vector<int64_t>(static_cast<size_t>(end), 1), {end}), k, v});
    const std::vector<float> flat = out.at(0).to_vector<float>();
    for (int64_t r = 0; r < end - begin; ++r)
      rows.emplace_back(flat.begin() + r * config.vocab_size, flat.begin() + (r + 1) * config.vocab_size);
  }
  return rows;
}

struct Case {
  std::string config;
  WeightFormat format;
  double tolerance;  // max |logit - f32 logit| / max |f32 logit|
  // Greedy tokens agree on every row; else only where the f32 top-1 leads the top-2 by more than
  // twice the row's largest logit error (random weights give near-ties that 4 bits reorder).
  bool greedy_everywhere = true;
};

class WeightFormats : public ::testing::TestWithParam<Case> {};

TEST_P(WeightFormats, LogitsStayWithinToleranceOfF32AndGreedyTokensAgree) {
  const Case& c = GetParam();
  nn::LlamaConfig config = c.config == "k_quant_shape" ? k_quant_config() : load_config(c.config);
  const auto f32 = prefill_then_decode(config);
  config.weight_format = c.format;
  const auto narrow = prefill_then_decode(config);
  ASSERT_EQ(f32.size(), narrow.size());
  double max_abs = 0, worst = 0;
  for (const auto& row : f32)
    for (float v : row) max_abs = std::max(max_abs, double(std::fabs(v)));
  int checked = 0, agreed = 0;
  for (size_t r = 0; r < f32.size(); ++r) {
    double row_error = 0;
    for (size_t i = 0; i < f32[r].size(); ++i) row_error = std::max(row_error, double(std::fabs(narrow[r][i] - f32[r][i])));
    worst = std::max(worst, row_error);
    const auto argmax = [](const std::vector<float>& v) { return std::max_element(v.begin(), v.end()) - v.begin(); };
    std::vector<float> sorted = f32[r];
    std::partial_sort(sorted.begin(), sorted.begin() + 2, sorted.end(), std::greater<float>());
    agreed += argmax(narrow[r]) == argmax(f32[r]);
    if (!c.greedy_everywhere && sorted[0] - sorted[1] <= 2 * row_error) continue;
    ++checked;
    EXPECT_EQ(argmax(narrow[r]), argmax(f32[r])) << "greedy token of row " << r;
  }
  std::cout << "[ measured ] " << c.config << " " << nn::weight_format_name(c.format) << ": max |dlogit| / max |logit| = "
            << worst / max_abs << ", greedy tokens agree on " << agreed << " of " << f32.size() << " rows (" << checked
            << " checked)\n";
  EXPECT_LE(worst / max_abs, c.tolerance);
  EXPECT_GT(worst, 0.0) << "the weights were not actually narrowed";
}

INSTANTIATE_TEST_SUITE_P(
    TinyConfigs, WeightFormats,
    ::testing::Values(Case{"llama3_tied", WeightFormat::bf16, 1e-2}, Case{"untied", WeightFormat::bf16, 1e-2},
                      Case{"qkv_bias", WeightFormat::bf16, 1e-2}, Case{"llama3_tied", WeightFormat::f16, 1e-3},
                      Case{"untied", WeightFormat::f16, 1e-3}, Case{"qkv_bias", WeightFormat::f16, 1e-3},
                      Case{"llama3_tied", WeightFormat::q8_0, 3e-2}, Case{"untied", WeightFormat::q8_0, 3e-2},
                      Case{"qkv_bias", WeightFormat::q8_0, 3e-2}, Case{"llama3_tied", WeightFormat::q4_0, 0.25, false},
                      Case{"untied", WeightFormat::q4_0, 0.25, false}, Case{"qkv_bias", WeightFormat::q4_0, 0.25, false},
                      Case{"k_quant_shape", WeightFormat::q8_0, 0.045, false},
                      Case{"k_quant_shape", WeightFormat::q4_0, 0.6, false},
                      Case{"k_quant_shape", WeightFormat::q4_k, 0.4, false},
                      Case{"k_quant_shape", WeightFormat::q5_k, 0.25, false},
                      Case{"k_quant_shape", WeightFormat::q6_k, 0.12, false}),
    [](const auto& info) {
      return info.param.config + "_" + std::string(nn::weight_format_name(info.param.format));
    });

TEST(WeightFormat, LinearAndEmbeddingDeclareTheirWeightInTheirFormat) {
  nn::Linear q8(64, 96, DType::f32, true, DeviceRef::CPU(), WeightFormat::q8_0);
  const auto sd = q8.raw_state_dict();
  EXPECT_EQ(sd.at("weight").type(), (graph::TensorType{DType::u8, {96, 68}}));
  EXPECT_EQ(sd.at("bias").type(), (graph::TensorType{DType::f32, {96}}));
  nn::Embedding e(100, 32, DType::f32, DeviceRef::CPU(), WeightFormat::bf16);
  EXPECT_EQ(e.raw_state_dict().at("weight").type(), (graph::TensorType{DType::bf16, {100, 32}}));
  nn::Linear plain(32, 8);
  EXPECT_EQ(plain.raw_state_dict().at("weight").type(), (graph::TensorType{DType::f32, {8, 32}}));
}

// The format is a constructor argument all the way down: MLP and AttentionWithRope give it to their
// projections, falling back to f16 under a model-wide q8_0 where a row does not split into 32-blocks.
TEST(WeightFormat, MlpAndAttentionPassTheirFormatToTheirProjections) {
  nn::MLP mlp(64, 48, nn::MLPActivation::swiglu, DType::f32, false, DeviceRef::CPU(), WeightFormat::q8_0);
  const auto sd = mlp.raw_state_dict();
  EXPECT_EQ(sd.at("gate_proj.weight").type(), (graph::TensorType{DType::u8, {48, 68}}));
  EXPECT_EQ(sd.at("up_proj.weight").type(), (graph::TensorType{DType::u8, {48, 68}}));
  EXPECT_EQ(sd.at("down_proj.weight").type(), (graph::TensorType{DType::f16, {64, 48}}));  // 48 % 32 != 0
  nn::AttentionWithRope attn(0, 32, 2, 1, 16, DType::f32, false, DeviceRef::CPU(), WeightFormat::bf16);
  for (const char* name : {"q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight"})
    EXPECT_EQ(graph::dtype_of(attn.raw_state_dict().at(name).type()), DType::bf16) << name;
  EXPECT_EQ(nn::model_weight_format(WeightFormat::q8_0, 64), std::optional(WeightFormat::q8_0));
  EXPECT_EQ(nn::model_weight_format(WeightFormat::q8_0, 48), std::optional(WeightFormat::f16));
  EXPECT_EQ(nn::model_weight_format(std::nullopt, 48), std::nullopt);
}

// The K-quants fall back per tensor as llama.cpp's quantizer does: q8_0 where the rows split into
// 32-blocks but not 256-blocks, f16 where they do not split at all; q4_0 as q8_0.
TEST(WeightFormat, KQuantsFallBackToQ8_0ThenF16WhereRowsDoNotSplit) {
  for (WeightFormat k : {WeightFormat::q4_k, WeightFormat::q5_k, WeightFormat::q6_k}) {
    EXPECT_EQ(nn::model_weight_format(k, 512), std::optional(k));
    EXPECT_EQ(nn::model_weight_format(k, 160), std::optional(WeightFormat::q8_0));
    EXPECT_EQ(nn::model_weight_format(k, 344), std::optional(WeightFormat::f16));
  }
  EXPECT_EQ(nn::model_weight_format(WeightFormat::q4_0, 160), std::optional(WeightFormat::q4_0));
  EXPECT_EQ(nn::model_weight_format(WeightFormat::q4_0, 344), std::optional(WeightFormat::f16));
  nn::MLP mlp(256, 160, nn::MLPActivation::swiglu, DType::f32, false, DeviceRef::CPU(), WeightFormat::q4_k);
  const auto sd = mlp.raw_state_dict();
  EXPECT_EQ(sd.at("gate_proj.weight").type(), (graph::TensorType{DType::u8, {160, 144}}));  // q4_k rows of 256
  EXPECT_EQ(sd.at("down_proj.weight").type(), (graph::TensorType{DType::u8, {256, 170}}));  // q8_0 rows of 160
  nn::Embedding table(10, 512, DType::f32, DeviceRef::CPU(), WeightFormat::q6_k);
  EXPECT_EQ(table.raw_state_dict().at("weight").type(), (graph::TensorType{DType::u8, {10, 420}}));
  for (WeightFormat f : {WeightFormat::q4_0, WeightFormat::q4_k, WeightFormat::q5_k, WeightFormat::q6_k}) {
    EXPECT_EQ(nn::parse_weight_format(nn::weight_format_name(f)), f);
    EXPECT_EQ(nn::weight_format_dtype(f), std::nullopt);
  }
}

// No scope carries the format from one construction to the next: two Transformers of different
// formats, built and traced interleaved on one thread, each declare their own weight dtypes.
TEST(WeightFormat, TwoTransformersBuiltAndTracedInterleavedKeepTheirOwnFormats) {
  nn::LlamaConfig f16_config = load_config("untied"), bf16_config = f16_config;
  f16_config.weight_format = WeightFormat::f16;
  bf16_config.weight_format = WeightFormat::bf16;
  nn::Transformer f16_model(f16_config, kCacheLen);
  nn::Transformer bf16_model(bf16_config, kCacheLen);
  nn::Transformer f16_again(f16_config, kCacheLen);
  auto weight_dtypes = [](nn::Transformer& model) {
    graph::Graph g("model", model.input_tree()->flatten());
    graph::Graph::Scope scope(g);
    std::vector<graph::Value> inputs = g.inputs();
    g.output({model(inputs[0], inputs[1], nn::KVCache{inputs[2], inputs[3]})});
    std::map<std::string, DType> dtypes;
    for (const auto& w : g.ir().weights) dtypes.emplace(w.name, w.dtype);
    return dtypes;
  };
  const auto bf16 = weight_dtypes(bf16_model);
  const auto f16 = weight_dtypes(f16_model);
  const auto f16_second = weight_dtypes(f16_again);
  for (const char* name : {"model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
                           "model.layers.1.mlp.down_proj.weight", "lm_head.weight"}) {
    EXPECT_EQ(f16.at(name), DType::f16) << name;
    EXPECT_EQ(f16_second.at(name), DType::f16) << name;
    EXPECT_EQ(bf16.at(name), DType::bf16) << name;
  }
  EXPECT_EQ(bf16.at("model.norm.weight"), DType::f32);  // norms stay in the activations' dtype
}

TEST(WeightFormat, BadCombinationsAreValueErrors) {
  kiln::testing::expect_error<ValueError>(
      [] { nn::Linear(48, 8, DType::f32, false, DeviceRef::CPU(), WeightFormat::q8_0); }, {"multiple of 32", "48"});
  kiln::testing::expect_error<ValueError>(
      [] { nn::Linear(64, 8, DType::bf16, false, DeviceRef::CPU(), WeightFormat::q8_0); },
      {"Linear", "q8_0", "f32 activations", "bf16"});
  kiln::testing::expect_error<ValueError>([] { nn::parse_weight_format("q3_k"); }, {"q3_k", "bf16", "q8_0", "q6_k"});
  kiln::testing::expect_error<ValueError>(
      [] { nn::Linear(288, 8, DType::f32, false, DeviceRef::CPU(), WeightFormat::q4_k); }, {"multiple of 256", "288"});
  nn::LlamaConfig config;
  config.dtype = DType::bf16;
  config.weight_format = WeightFormat::q8_0;
  kiln::testing::expect_error<ValueError>([&] { config.validate(); }, {"weight_format q8_0", "dtype f32"});
}

}  // namespace
