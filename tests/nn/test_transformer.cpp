// Transformer structure: Hugging Face weight names, the input tree, config validation.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <set>
#include <string>

#include "hashed_weights.h"
#include "kiln/engine/session.h"
#include "kiln/nn/transformer.h"

namespace {

using namespace kiln;

nn::LlamaConfig tiny_config() {
  nn::LlamaConfig c;
  c.vocab_size = 128;
  c.hidden_size = 64;
  c.intermediate_size = 160;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.max_position_embeddings = 32;
  return c;
}

// Hugging Face's LlamaForCausalLM state_dict keys, written out.
std::set<std::string> hugging_face_names(bool tied, bool attention_bias) {
  std::set<std::string> names{"model.embed_tokens.weight", "model.norm.weight"};
  for (std::string layer : {"0", "1"}) {
    std::string p = "model.layers." + layer + ".";
    for (std::string proj : {"q_proj", "k_proj", "v_proj", "o_proj"})
      names.insert(p + "self_attn." + proj + ".weight");
    if (attention_bias)
      for (std::string proj : {"q_proj", "k_proj", "v_proj"}) names.insert(p + "self_attn." + proj + ".bias");
    for (std::string proj : {"gate_proj", "up_proj", "down_proj"})
      names.insert(p + "mlp." + proj + ".weight");
    names.insert(p + "input_layernorm.weight");
    names.insert(p + "post_attention_layernorm.weight");
  }
  if (!tied) names.insert("lm_head.weight");
  return names;
}

std::set<std::string> names_of(const nn::Module& m) {
  std::set<std::string> out;
  for (const auto& [name, w] : m.raw_state_dict()) out.insert(name);
  return out;
}

TEST(Transformer, UntiedWeightNamesAreHuggingFaces) {
  nn::Transformer model(tiny_config());
  EXPECT_EQ(names_of(model), hugging_face_names(/*tied=*/false, false));
}

TEST(Transformer, TiedModelHasNoLmHead) {
  auto c = tiny_config();
  c.tie_word_embeddings = true;
  nn::Transformer model(c);
  EXPECT_EQ(names_of(model), hugging_face_names(/*tied=*/true, false));
}

TEST(Transformer, AttentionBiasAddsQkvBiases) {
  auto c = tiny_config();
  c.attention_bias = true;
  nn::Transformer model(c);
  EXPECT_EQ(names_of(model), hugging_face_names(false, /*attention_bias=*/true));
}

TEST(Transformer, WeightShapesFollowHuggingFaceLayout) {
  nn::Transformer model(tiny_config());
  auto sd = model.raw_state_dict();
  EXPECT_EQ(sd.at("model.embed_tokens.weight").shape.to_string(), "[128, 64]");
  EXPECT_EQ(sd.at("model.layers.1.self_attn.q_proj.weight").shape.to_string(), "[64, 64]");
  EXPECT_EQ(sd.at("model.layers.1.self_attn.k_proj.weight").shape.to_string(),
            "[32, 64]");  // 2 kv heads of 16
  EXPECT_EQ(sd.at("model.layers.0.mlp.gate_proj.weight").shape.to_string(), "[160, 64]");
  EXPECT_EQ(sd.at("model.layers.0.mlp.down_proj.weight").shape.to_string(), "[64, 160]");
  EXPECT_EQ(sd.at("lm_head.weight").shape.to_string(), "[128, 64]");
}

TEST(Transformer, InputTreeIsTokensMaskAndCache) {
  nn::Transformer model(tiny_config(), /*max_seq_len=*/16);
  auto tree = model.input_tree();
  ASSERT_TRUE(tree.has_value());
  EXPECT_EQ(graph::to_string((*tree)["tokens"].leaf()), "i64[seq]");
  EXPECT_EQ(graph::to_string((*tree)["attention_mask"].leaf()), "i64[total]");
  EXPECT_EQ(graph::to_string((*tree)["cache"]["k"].leaf()), "buffer<f32[2, 16, 2, 16]>");
  EXPECT_EQ(graph::to_string((*tree)["cache"]["v"].leaf()), "buffer<f32[2, 16, 2, 16]>");
  EXPECT_EQ(tree->num_leaves(), 4u);
}

TEST(LlamaConfig, RejectsHeadsThatDoNotDivide) {
  auto c = tiny_config();
  c.num_key_value_heads = 3;
  try {
    nn::Transformer model(c);
    FAIL() << "expected ValueError";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("num_key_value_heads 3"), std::string::npos) << e.what();
  }
}

TEST(LlamaConfig, ExplicitHeadDimOverridesHiddenOverHeads) {
  auto c = tiny_config();
  c.head_dim = 8;
  EXPECT_EQ(c.resolved_head_dim(), 8);
  nn::Transformer model(c);
  EXPECT_EQ(model.raw_state_dict().at("model.layers.0.self_attn.q_proj.weight").shape.to_string(),
            "[32, 64]");
  EXPECT_EQ(model.raw_state_dict().at("model.layers.0.self_attn.o_proj.weight").shape.to_string(),
            "[64, 32]");
}

// Logits of a 5-token prefill then a 1-token decode step, from a model built with `mode`.
std::vector<Tensor> prefill_and_step(nn::ReturnLogits mode) {
  constexpr int64_t kCacheLen = 16;
  auto config = tiny_config();
  nn::Transformer model(config, kCacheLen, mode);
  const nn::TypeTree tree = *model.input_tree();
  graph::Graph g("llama", tree.flatten());
  {
    graph::Graph::Scope scope(g);
    g.output(model.forward({tree.unflatten(g.inputs())}).flatten());
  }
  WeightsRegistry weights;
  for (const auto& [name, w] : model.raw_state_dict())
    weights.emplace(name, nn::hashed_weights::make(name, w.shape.static_dims()));
  engine::InferenceSession session({DeviceRef::CPU()});
  engine::Model compiled = session.load(g, weights);
  const std::vector<int64_t> cache_shape{2, kCacheLen, 2, 16};
  Tensor k = Tensor::zeros(DType::f32, cache_shape), v = Tensor::zeros(DType::f32, cache_shape);
  auto ones = [](int64_t n) { return Tensor::from_vector(std::vector<int64_t>(static_cast<size_t>(n), 1), {n}); };
  std::vector<Tensor> out;
  out.push_back(compiled.execute({Tensor::from_vector<int64_t>({3, 17, 42, 99, 5}, {5}), ones(5), k, v}).at(0));
  out.push_back(compiled.execute({Tensor::from_vector<int64_t>({64}, {1}), ones(6), k, v}).at(0));
  return out;
}

TEST(Transformer, LastTokenLogitsAreTheLastRowOfAllLogits) {
  const auto all = prefill_and_step(nn::ReturnLogits::all);
  const auto last = prefill_and_step(nn::ReturnLogits::last_token);
  ASSERT_EQ(all[0].shape(), (std::vector<int64_t>{5, 128}));
  ASSERT_EQ(last[0].shape(), (std::vector<int64_t>{1, 128}));
  ASSERT_EQ(last[1].shape(), (std::vector<int64_t>{1, 128}));
  const std::vector<float> all_prefill = all[0].to_vector<float>();
  const std::vector<float> expected_prefill(all_prefill.end() - 128, all_prefill.end());
  // The projection of one row may take another kernel path (GEMV) than that of five (GEMM): equal up
  // to float summation order.
  for (auto [got, expected] : {std::pair{last[0].to_vector<float>(), expected_prefill},
                               std::pair{last[1].to_vector<float>(), all[1].to_vector<float>()}}) {
    double max_abs = 0;
    for (float x : expected) max_abs = std::max(max_abs, double(std::fabs(x)));
    ASSERT_GT(max_abs, 0.0);
    for (size_t i = 0; i < expected.size(); ++i) EXPECT_NEAR(got[i], expected[i], 1e-5 * max_abs) << "logit " << i;
  }
}

}  // namespace
