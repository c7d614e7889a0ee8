// The random-weight models of known shapes (named_config) and their seeded weights (random_weights).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <set>

#include "kiln/errors.h"
#include "kiln/pipelines/text_generation.h"
#include "test_util.h"

namespace kiln::pipelines {
namespace {

using kiln::testing::expect_error;

nn::LlamaConfig small_config() {
  nn::LlamaConfig c;
  c.vocab_size = 300;
  c.hidden_size = 64;
  c.intermediate_size = 128;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.max_position_embeddings = 32;
  c.tie_word_embeddings = true;
  return c;
}

TEST(NamedShapes, EveryListedNameHasAConfigAndOthersNone) {
  EXPECT_EQ(named_config_names(), (std::vector<std::string>{"stories15M", "stories110M", "llama-1B"}));
  for (const auto& name : named_config_names()) {
    auto c = named_config(name);
    ASSERT_TRUE(c.has_value()) << name;
    EXPECT_NO_THROW(c->validate()) << name;
    EXPECT_TRUE(c->tie_word_embeddings) << name;
  }
  EXPECT_FALSE(named_config("llama-7B").has_value());
}

TEST(NamedShapes, Llama1BIsTheLlama32OneBillionShape) {
  const nn::LlamaConfig c = *named_config("llama-1B");
  EXPECT_EQ(c.hidden_size, 2048);
  EXPECT_EQ(c.num_hidden_layers, 16);
  EXPECT_EQ(c.num_attention_heads, 32);
  EXPECT_EQ(c.num_key_value_heads, 8);
  EXPECT_EQ(c.resolved_head_dim(), 64);
  EXPECT_EQ(c.intermediate_size, 8192);
  EXPECT_EQ(c.vocab_size, 128256);
  EXPECT_EQ(c.rope_theta, 500000.0);
  ASSERT_TRUE(c.rope_scaling.has_value());
  EXPECT_EQ(c.rope_scaling->factor, 32.0);
  EXPECT_EQ(c.rope_scaling->original_max_position_embeddings, 8192);
  EXPECT_EQ(c.rms_norm_eps, 1e-5);
}

TEST(RandomWeights, NormsAreOneAndTheRestUniformInPlusMinus005) {
  const WeightsRegistry w = random_weights(small_config(), 3);
  EXPECT_EQ(w.count("lm_head.weight"), 0u);  // tied
  for (const auto& [name, t] : w) {
    const std::vector<float> v = t.to_vector<float>();
    if (name.ends_with("norm.weight")) {
      for (float x : v) ASSERT_EQ(x, 1.0f) << name;
      continue;
    }
    for (float x : v) {
      ASSERT_GE(x, -0.05f) << name;
      ASSERT_LT(x, 0.05f) << name;
    }
  }
  // The embedding table (300 x 64): a uniform histogram, no repeated neighbours (each hash feeds two
  // values), mean near 0.
  const std::vector<float> e = w.at("model.embed_tokens.weight").to_vector<float>();
  std::vector<int> bins(10, 0);
  double sum = 0;
  int equal_neighbours = 0;
  for (size_t i = 0; i < e.size(); ++i) {
    ++bins[std::min<size_t>(9, static_cast<size_t>(std::floor((e[i] + 0.05) / 0.01)))];
    sum += e[i];
    if (i > 0 && e[i] == e[i - 1]) ++equal_neighbours;
  }
  const double expected = static_cast<double>(e.size()) / 10;  // 1920 per bin
  for (int count : bins) EXPECT_NEAR(count, expected, 0.1 * expected);
  EXPECT_NEAR(sum / static_cast<double>(e.size()), 0.0, 0.002);
  EXPECT_LT(equal_neighbours, 3);
}

TEST(RandomWeights, SeedAndNameChooseTheValues) {
  const nn::LlamaConfig c = small_config();
  const WeightsRegistry a = random_weights(c, 3), b = random_weights(c, 3), other = random_weights(c, 4);
  const std::string q = "model.layers.0.self_attn.q_proj.weight",
                    o = "model.layers.0.self_attn.o_proj.weight";
  EXPECT_EQ(a.at(q).to_vector<float>(), b.at(q).to_vector<float>());
  EXPECT_NE(a.at(q).to_vector<float>(), other.at(q).to_vector<float>());
  EXPECT_NE(a.at(q).to_vector<float>(), a.at(o).to_vector<float>());  // same shape, other name
}

TEST(RandomWeights, HalfDtypesHoldTheF32ValuesRounded) {
  const nn::LlamaConfig c = small_config();
  const WeightsRegistry f32 = random_weights(c, 5);
  for (DType dtype : {DType::f16, DType::bf16}) {
    const WeightsRegistry half = random_weights(c, 5, dtype);
    ASSERT_EQ(half.size(), f32.size());
    for (const auto& [name, t] : half) {
      ASSERT_EQ(t.dtype(), dtype) << name;
      const std::vector<float> want = f32.at(name).to_vector<float>();
      for (size_t i = 0; i < want.size(); ++i) {
        const uint16_t bits = static_cast<const uint16_t*>(t.data())[i];
        const uint16_t expected = dtype == DType::bf16 ? bf16_t(want[i]).bits : f16_t(want[i]).bits;
        ASSERT_EQ(bits, expected) << name << " [" << i << "]";
      }
    }
  }
  expect_error<DTypeError>([&] { random_weights(c, 0, DType::i32); },
                           "dtype must be f32, f16 or bf16, got i32");
}

TEST(RandomWeights, PipelineRunsEveryWeightFormatAndAgreesWithF32Greedily) {
  // Greedy ids of the f32 model, then of each narrower format built from the same f32 weights:
  // the first tokens agree (the formats' logit errors, docs/quantization.md, are far below the gaps
  // between the top logits of these random weights).
  const nn::LlamaConfig c = small_config();
  const WeightsRegistry weights = random_weights(c, 3, DType::f32);
  GenerationOptions greedy{.max_new_tokens = 4, .temperature = 0, .stop_at_eos = false};
  auto ids = [&](nn::WeightFormat format) {
    auto pipe = TextGenerationPipeline::from_config(c, weights, nullptr, {}, {.weight_format = format});
    return pipe.generate_ids({1, 5, 9}, greedy).ids;
  };
  const std::vector<int64_t> reference = ids(nn::WeightFormat::f32);
  ASSERT_EQ(reference.size(), 4u);
  for (nn::WeightFormat format : {nn::WeightFormat::f16, nn::WeightFormat::bf16, nn::WeightFormat::q8_0})
    EXPECT_EQ(ids(format).front(), reference.front()) << nn::weight_format_name(format);
}

// The K-quants and Q4_0 through the pipeline: weights quantized at load in the requested encoding
// (rows of 256, so nothing falls back), and generation runs. Their logit errors (docs/quantization.md)
// can reorder near-tied top tokens of random weights, so tokens are not compared with f32's.
TEST(RandomWeights, FourAndSixBitFormatsQuantizeAtLoadAndGenerate) {
  nn::LlamaConfig c = small_config();
  c.hidden_size = 256;
  c.intermediate_size = 512;
  const WeightsRegistry weights = random_weights(c, 3, DType::f32);
  GenerationOptions greedy{.max_new_tokens = 4, .temperature = 0, .stop_at_eos = false};
  const auto reference = TextGenerationPipeline::from_config(c, weights, nullptr, {}, {.weight_format = nn::WeightFormat::f32})
                             .generate_ids({1, 5, 9}, greedy)
                             .ids;
  for (nn::WeightFormat format : {nn::WeightFormat::q4_0, nn::WeightFormat::q4_k, nn::WeightFormat::q5_k,
                                  nn::WeightFormat::q6_k}) {
    auto pipe = TextGenerationPipeline::from_config(c, weights, nullptr, {}, {.weight_format = format});
    const std::vector<int64_t> ids = pipe.generate_ids({1, 5, 9}, greedy).ids;
    EXPECT_EQ(ids.size(), 4u) << nn::weight_format_name(format);
    std::printf("%s: first token %s f32's\n", std::string(nn::weight_format_name(format)).c_str(),
                ids.front() == reference.front() ? "equals" : "differs from");
  }
}

}  // namespace
}  // namespace kiln::pipelines
