// A tiny Llama against Hugging Face's LlamaForCausalLM: tools/reference/llama_reference.py runs the
// same checkpoint (generated from weight names by hashed_weights.h's recipe, never stored) in plain
// torch and wrote the logits to tests/data/llama_reference_<name>.json. Checked here: the whole prompt
// at once, and the prompt as a 5-token prefill followed by two single-token decode steps through the
// KV cache.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "hashed_weights.h"
#include "kiln/engine/session.h"
#include "kiln/nn/transformer.h"

namespace {

using namespace kiln;
using nlohmann::json;

constexpr int64_t kCacheLen = 16;

struct Reference {
  nn::LlamaConfig config;
  std::vector<int64_t> tokens;
  std::vector<std::vector<double>> logits;  // [seq][vocab]
  double max_abs = 0;
};

Reference load_reference(const std::string& name) {
  auto path = std::filesystem::path(__FILE__).parent_path().parent_path() / "data" /
              ("llama_reference_" + name + ".json");
  std::ifstream file(path);
  if (!file) throw std::runtime_error("cannot open " + path.string());
  json doc = json::parse(file);
  const json& c = doc.at("config");
  Reference r;
  r.config.vocab_size = c.at("vocab_size");
  r.config.hidden_size = c.at("hidden_size");
  r.config.intermediate_size = c.at("intermediate_size");
  r.config.num_hidden_layers = c.at("num_hidden_layers");
  r.config.num_attention_heads = c.at("num_attention_heads");
  r.config.num_key_value_heads = c.at("num_key_value_heads");
  r.config.rms_norm_eps = c.at("rms_norm_eps");
  r.config.rope_theta = c.at("rope_theta");
  r.config.max_position_embeddings = c.at("max_position_embeddings");
  r.config.tie_word_embeddings = c.at("tie_word_embeddings");
  r.config.attention_bias = c.at("attention_bias");
  if (!c.at("rope_scaling").is_null()) {
    const json& s = c.at("rope_scaling");
    r.config.rope_scaling =
        nn::Llama3RopeScaling{s.at("factor"), s.at("low_freq_factor"), s.at("high_freq_factor"),
                              s.at("original_max_position_embeddings")};
  }
  r.tokens = doc.at("tokens").get<std::vector<int64_t>>();
  r.logits = doc.at("logits").get<std::vector<std::vector<double>>>();
  for (const auto& row : r.logits)
    for (double v : row) r.max_abs = std::max(r.max_abs, std::abs(v));
  return r;
}

// The model traced into a graph with its input tree, compiled, and bound to the hashed weights.
engine::Model load_model(nn::Transformer& model) {
  const nn::TypeTree tree = *model.input_tree();
  std::vector<graph::Type> flat = tree.flatten();
  graph::Graph g("llama", flat);
  {
    graph::Graph::Scope scope(g);
    nn::Values inputs = tree.unflatten(g.inputs());
    g.output(model.forward({inputs}).flatten());
  }
  WeightsRegistry weights;
  for (const auto& [name, w] : model.raw_state_dict())
    weights.emplace(name, nn::hashed_weights::make(name, w.shape.static_dims()));
  engine::InferenceSession session({DeviceRef::CPU()});
  return session.load(g, weights);
}

struct Cache {
  Tensor k, v;
  explicit Cache(const nn::LlamaConfig& c) {
    std::vector<int64_t> shape{c.num_hidden_layers, kCacheLen, c.num_key_value_heads, c.resolved_head_dim()};
    k = Tensor::zeros(DType::f32, shape);
    v = Tensor::zeros(DType::f32, shape);
  }
};

// Runs tokens [begin, end) of the prompt after `begin` tokens already in the cache.
std::vector<float> run(const engine::Model& model, Cache& cache, const std::vector<int64_t>& prompt,
                       int64_t begin, int64_t end) {
  std::vector<int64_t> tokens(prompt.begin() + begin, prompt.begin() + end);
  auto out = model.execute({Tensor::from_vector(tokens, {end - begin}),
                            Tensor::from_vector(std::vector<int64_t>(static_cast<size_t>(end), 1), {end}),
                            cache.k, cache.v});
  EXPECT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0].shape().size(), 2u);
  EXPECT_EQ(out[0].shape()[0], end - begin);
  return out[0].to_vector<float>();
}

// Max |got - reference| over rows [begin, end), relative to the reference's max |logit|.
double relative_error(const Reference& ref, const std::vector<float>& got, int64_t begin, int64_t end) {
  const size_t vocab = ref.logits[0].size();
  EXPECT_EQ(got.size(), static_cast<size_t>(end - begin) * vocab);
  double worst = 0;
  for (int64_t r = begin; r < end; ++r)
    for (size_t i = 0; i < vocab && (r - begin) * vocab + i < got.size(); ++i)
      worst = std::max(worst, std::abs(got[(r - begin) * vocab + i] - ref.logits[r][i]));
  return worst / ref.max_abs;
}

class LlamaReference : public ::testing::TestWithParam<std::string> {};

TEST_P(LlamaReference, WholePromptMatchesHuggingFaceLogits) {
  Reference ref = load_reference(GetParam());
  nn::Transformer model(ref.config, kCacheLen);
  auto compiled = load_model(model);
  Cache cache(ref.config);
  const auto n = static_cast<int64_t>(ref.tokens.size());
  EXPECT_LE(relative_error(ref, run(compiled, cache, ref.tokens, 0, n), 0, n), 1e-4);
}

TEST_P(LlamaReference, PrefillThenDecodeThroughCacheMatchesHuggingFaceLogits) {
  Reference ref = load_reference(GetParam());
  nn::Transformer model(ref.config, kCacheLen);
  auto compiled = load_model(model);
  Cache cache(ref.config);
  ASSERT_EQ(ref.tokens.size(), 7u);
  EXPECT_LE(relative_error(ref, run(compiled, cache, ref.tokens, 0, 5), 0, 5), 1e-4) << "prefill";
  EXPECT_LE(relative_error(ref, run(compiled, cache, ref.tokens, 5, 6), 5, 6), 1e-4) << "decode step 1";
  EXPECT_LE(relative_error(ref, run(compiled, cache, ref.tokens, 6, 7), 6, 7), 1e-4) << "decode step 2";
  // A new, shorter sequence reuses the cache without clearing it: rows past `total` are never read.
  EXPECT_LE(relative_error(ref, run(compiled, cache, ref.tokens, 0, 4), 0, 4), 1e-4) << "reused cache";
}

INSTANTIATE_TEST_SUITE_P(TinyConfigs, LlamaReference, ::testing::Values("llama3_tied", "untied", "qkv_bias"));

TEST(LlamaReferenceWeights, HashRecipeIsPinned) {
  // Pinned values of the recipe, so a change on either side (C++ or Python) is caught here.
  EXPECT_EQ(nn::hashed_weights::fnv1a64(""), 0xCBF29CE484222325ull);
  EXPECT_EQ(nn::hashed_weights::fnv1a64("a"), 0xAF63DC4C8601EC8Cull);
  // Values the Python side computes (llama_reference.weight_value), as multiples of 2^-26.
  EXPECT_EQ(nn::hashed_weights::value(nn::hashed_weights::fnv1a64("model.embed_tokens.weight"), 0, false),
            -2159388 * 0x1p-26);
  EXPECT_EQ(nn::hashed_weights::value(nn::hashed_weights::fnv1a64("model.embed_tokens.weight"), 1000, false),
            4646384 * 0x1p-26);
  EXPECT_EQ(nn::hashed_weights::value(nn::hashed_weights::fnv1a64("model.norm.weight"), 3, true),
            1.0 + (69467860 - 67108864) * 0x1p-26);
  // The output stays in [-0.125, 0.125) and on the 2^-26 grid.
  for (uint64_t i = 0; i < 1000; ++i) {
    double v = nn::hashed_weights::value(12345, i, false);
    EXPECT_GE(v, -0.125);
    EXPECT_LT(v, 0.125);
    EXPECT_EQ(std::ldexp(v, 26), std::round(std::ldexp(v, 26)));
  }
}

}  // namespace
