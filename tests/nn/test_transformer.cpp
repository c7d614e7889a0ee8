// Transformer structure: Hugging Face weight names, the input tree, config validation.
#include <gtest/gtest.h>

#include <set>
#include <string>

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

}  // namespace
