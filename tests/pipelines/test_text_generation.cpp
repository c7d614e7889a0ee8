// TextGenerationPipeline: the sampler graph against hand-computed inverse CDFs, the generation loop
// (seeds, KV cache against full recomputation, EOS, max_new_tokens, cache length, streaming), and
// greedy generation of the embedded kiln-tiny model against PyTorch's ids.
#include <gtest/gtest.h>

#include "test_util.h"

#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "kiln/pipelines/text_generation.h"

using kiln::testing::error_message;

namespace {

using namespace kiln;
using pipelines::GenerationOptions;
using pipelines::FinishReason;
using pipelines::TextGenerationPipeline;

nn::LlamaConfig small_config(int64_t vocab = 64) {
  nn::LlamaConfig c;
  c.vocab_size = vocab;
  c.hidden_size = 32;
  c.intermediate_size = 64;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.max_position_embeddings = 64;
  return c;
}

TextGenerationPipeline random_pipeline(pipelines::PipelineOptions options = {}, int64_t vocab = 64) {
  nn::LlamaConfig c = small_config(vocab);
  return TextGenerationPipeline::from_config(c, pipelines::random_weights(c, 7), nullptr, {},
                                             std::move(options));
}

Tensor logits_row(const std::vector<float>& values) {
  return Tensor::from_vector(values, {1, static_cast<int64_t>(values.size())});
}

// Logits whose softmax is [0.5, 0.3, 0.2], padded with -inf (probability 0) to the vocabulary.
Tensor three_way(int64_t vocab) {
  std::vector<float> v(static_cast<size_t>(vocab), -std::numeric_limits<float>::infinity());
  v[0] = std::log(0.5f);
  v[1] = std::log(0.3f);
  v[2] = std::log(0.2f);
  return logits_row(v);
}

int64_t naive_argmax(const std::vector<float>& v) {
  int64_t best = 0;
  for (size_t i = 1; i < v.size(); ++i)
    if (v[i] > v[static_cast<size_t>(best)]) best = static_cast<int64_t>(i);
  return best;
}

// The "sampler" graph itself (one row, min_p off), as a user calling it directly would (sample()
// routes greedy options to the "greedy" graph).
int64_t run_sampler_graph(const TextGenerationPipeline& pipe, const std::vector<float>& v, float temperature,
                          int64_t top_k, float top_p, float u) {
  return pipe.models()
      .at("sampler")
      .execute({logits_row(v), Tensor::from_vector<float>({temperature}, {1}),
                Tensor::from_vector<int64_t>({top_k}, {1}), Tensor::from_vector<float>({top_p}, {1}),
                Tensor::from_vector<float>({0.0f}, {1}), Tensor::from_vector<float>({u}, {1})})
      .at(0)
      .to_vector<int64_t>()
      .at(0);
}

// ---- the sampler graph -----------------------------------------------------------------------------

TEST(Sampler, TemperatureZeroIsArgmaxOfTheLogits) {
  auto pipe = random_pipeline();
  std::mt19937 rng(3);
  std::normal_distribution<float> normal;
  for (int trial = 0; trial < 20; ++trial) {
    std::vector<float> v(64);
    for (auto& x : v) x = normal(rng);
    if (trial % 2) v[40] = v[11] = 10.0f;  // a tie: the first index wins, as argmax
    for (float u : {0.0f, 0.5f, 0.999f}) {
      EXPECT_EQ(pipe.sample(logits_row(v), 0.0, 0, 1.0, u), naive_argmax(v)) << "trial " << trial << " u " << u;
      EXPECT_EQ(run_sampler_graph(pipe, v, 0.0f, 0, 1.0f, u), naive_argmax(v)) << "trial " << trial << " u " << u;
    }
  }
}

TEST(Sampler, TopKOneIsArgmaxForAnyU) {
  auto pipe = random_pipeline();
  std::mt19937 rng(5);
  std::normal_distribution<float> normal;
  for (int trial = 0; trial < 10; ++trial) {
    std::vector<float> v(64);
    for (auto& x : v) x = normal(rng);
    if (trial % 2) v[50] = v[7] = 10.0f;
    for (float u : {0.0f, 0.25f, 0.5f, 0.75f, 1.0f - 0x1p-24f}) {
      EXPECT_EQ(pipe.sample(logits_row(v), 1.5, 1, 1.0, u), naive_argmax(v)) << "trial " << trial << " u " << u;
      EXPECT_EQ(run_sampler_graph(pipe, v, 1.5f, 1, 1.0f, u), naive_argmax(v)) << "trial " << trial << " u " << u;
    }
  }
}

// probs [0.5, 0.3, 0.2]: cumulative [0.5, 0.8, 1.0]; the pick is the first index whose cumulative
// mass exceeds u.
TEST(Sampler, InverseCdfPicksTheTokensComputedByHand) {
  auto pipe = random_pipeline();
  const std::vector<std::pair<float, int64_t>> cases{{0.0f, 0},  {0.1f, 0},  {0.49f, 0}, {0.51f, 1},
                                                     {0.79f, 1}, {0.81f, 2}, {0.999f, 2}};
  for (auto [u, expected] : cases) {
    EXPECT_EQ(pipe.sample(three_way(64), 1.0, 0, 1.0, u), expected) << "whole vocabulary, u " << u;
    EXPECT_EQ(pipe.sample(three_way(64), 1.0, 3, 1.0, u), expected) << "top_k 3, u " << u;
    EXPECT_EQ(pipe.sample(three_way(64), 1.0, 0, 0.999, u), expected) << "top_p 0.999, u " << u;
  }
}

// top_k 2 keeps [0.5, 0.3], renormalised to [0.625, 0.375].
TEST(Sampler, TopKRenormalisesOverTheKeptTokens) {
  auto pipe = random_pipeline();
  EXPECT_EQ(pipe.sample(three_way(64), 1.0, 2, 1.0, 0.62f), 0);
  EXPECT_EQ(pipe.sample(three_way(64), 1.0, 2, 1.0, 0.63f), 1);
  EXPECT_EQ(pipe.sample(three_way(64), 1.0, 2, 1.0, 0.99f), 1);
}

// top_p 0.6: mass before each sorted token is [0, 0.5, 0.8], so tokens 0 and 1 are the nucleus
// (0.5 < 0.6 <= 0.8), renormalised to [0.625, 0.375]; token 2 is never picked.
TEST(Sampler, TopPKeepsTheSmallestPrefixReachingTheMass) {
  auto pipe = random_pipeline();
  EXPECT_EQ(pipe.sample(three_way(64), 1.0, 0, 0.6, 0.62f), 0);
  EXPECT_EQ(pipe.sample(three_way(64), 1.0, 0, 0.6, 0.63f), 1);
  for (int i = 0; i < 100; ++i) {
    const float u = static_cast<float>(i) / 100.0f;
    EXPECT_NE(pipe.sample(three_way(64), 1.0, 0, 0.6, u), 2) << "u " << u;
  }
  // A nucleus smaller than the top token still keeps it.
  for (float u : {0.0f, 0.5f, 0.99f}) EXPECT_EQ(pipe.sample(three_way(64), 1.0, 0, 0.1, u), 0);
}

// Temperature 0.5 squares the probabilities: [0.25, 0.09, 0.04] / 0.38, cumulative
// [0.6579, 0.8947, 1].
TEST(Sampler, TemperatureRescalesTheLogits) {
  auto pipe = random_pipeline();
  EXPECT_EQ(pipe.sample(three_way(64), 0.5, 0, 1.0, 0.65f), 0);
  EXPECT_EQ(pipe.sample(three_way(64), 0.5, 0, 1.0, 0.66f), 1);
  EXPECT_EQ(pipe.sample(three_way(64), 0.5, 0, 1.0, 0.89f), 1);
  EXPECT_EQ(pipe.sample(three_way(64), 0.5, 0, 1.0, 0.90f), 2);
}

// Plain temperature sampling is not limited to the sorted cap: with equal logits over 300 tokens
// and a cap of 256, u picks token floor(u * 300).
TEST(Sampler, WithoutTopKOrTopPEveryTokenIsACandidate) {
  auto pipe = random_pipeline({.sampler_max_top_k = 256}, /*vocab=*/300);
  ASSERT_EQ(pipe.sampler_cap(), 256);
  std::vector<float> flat(300, 0.0f);
  EXPECT_EQ(pipe.sample(logits_row(flat), 1.0, 0, 1.0, 0.999f), 299);
  EXPECT_EQ(pipe.sample(logits_row(flat), 1.0, 0, 1.0, 0.5f), 150);
  EXPECT_EQ(pipe.sample(logits_row(flat), 1.0, 0, 1.0, 0.0f), 0);
}

// ---- the pipeline ------------------------------------------------------------------------------

TEST(TextGeneration, ModelAndSamplersCompileOnceAsOneGroup) {
  auto pipe = random_pipeline();
  EXPECT_EQ(pipe.compile_count(), 1);
  EXPECT_EQ(pipe.models().size(), 3u);
  EXPECT_TRUE(pipe.models().count("model"));
  EXPECT_TRUE(pipe.models().count("sampler"));
  EXPECT_TRUE(pipe.models().count("greedy"));
}

TEST(TextGeneration, TraceGraphsHoldsModelThenSamplers) {
  graph::Module m = TextGenerationPipeline::trace_graphs(small_config());
  EXPECT_EQ(m.graph_names(), (std::vector<std::string>{"model", "sampler", "greedy"}));
  EXPECT_EQ(m.at("sampler").output_types().size(), 1u);
  EXPECT_EQ(m.at("greedy").output_types().size(), 1u);
}

TEST(TextGeneration, SameSeedGivesSameTokensAnotherSeedDiffers) {
  auto pipe = random_pipeline();
  GenerationOptions o{.max_new_tokens = 24, .temperature = 1.0, .seed = 11, .stop_at_eos = false};
  const std::vector<int64_t> prompt{1, 2, 3};
  auto a = pipe.generate_ids(prompt, o).ids;
  auto b = pipe.generate_ids(prompt, o).ids;
  o.seed = 12;
  auto c = pipe.generate_ids(prompt, o).ids;
  ASSERT_EQ(a.size(), 24u);
  EXPECT_EQ(a, b);
  EXPECT_NE(a, c);
}

// Greedy decoding through the paged KV cache equals recomputing the whole sequence from scratch at
// each step (a fresh cache, the full sequence as one prefill of the "model" graph) and taking the
// host argmax of its logits.
TEST(TextGeneration, CachedDecodeEqualsFullRecomputation) {
  auto pipe = random_pipeline();
  const std::vector<int64_t> prompt{5, 9, 17, 2};
  GenerationOptions o{.max_new_tokens = 12, .temperature = 0.0, .stop_at_eos = false};
  auto cached = pipe.generate_ids(prompt, o).ids;

  const nn::LlamaConfig& c = pipe.config();
  const int64_t block = pipe.engine().options().kv_block_size;
  std::vector<int64_t> sequence = prompt;
  std::vector<int64_t> recomputed;
  for (int step = 0; step < 12; ++step) {
    const auto n = static_cast<int64_t>(sequence.size());
    const int64_t blocks = (n + block - 1) / block;
    std::vector<int64_t> positions(sequence.size()), table(static_cast<size_t>(blocks));
    for (int64_t i = 0; i < n; ++i) positions[static_cast<size_t>(i)] = i;
    for (int64_t b = 0; b < blocks; ++b) table[static_cast<size_t>(b)] = blocks - 1 - b;  // any order
    std::vector<int64_t> slots(sequence.size());
    for (int64_t i = 0; i < n; ++i) slots[static_cast<size_t>(i)] = table[static_cast<size_t>(i / block)] * block + i % block;
    const std::vector<int64_t> cache_shape{c.num_hidden_layers, blocks, block, c.num_key_value_heads,
                                           c.resolved_head_dim()};
    auto out = pipe.models().at("model").execute(
        {Tensor::from_vector(sequence, {n}), Tensor::from_vector(positions, {n}),
         Tensor::from_vector(std::vector<int64_t>(sequence.size(), 0), {n}), Tensor::from_vector(slots, {n}),
         Tensor::from_vector(table, {1, blocks}), Tensor::from_vector<int64_t>({n - 1}, {1}),
         Tensor::zeros(DType::f32, cache_shape), Tensor::zeros(DType::f32, cache_shape)});
    recomputed.push_back(naive_argmax(out.at(0).to_vector<float>()));
    sequence.push_back(recomputed.back());
  }
  EXPECT_EQ(cached, recomputed);
}

TEST(TextGeneration, MaxNewTokensIsRespected) {
  auto pipe = random_pipeline();
  GenerationOptions o{.max_new_tokens = 7, .temperature = 1.0, .stop_at_eos = false};
  std::vector<int64_t> streamed;
  auto r = pipe.generate_ids({1, 2}, o, [&](int64_t id) { streamed.push_back(id); });
  EXPECT_EQ(r.ids.size(), 7u);
  EXPECT_EQ(streamed, r.ids);
  EXPECT_EQ(r.stats.finish_reason, FinishReason::length);
  EXPECT_EQ(r.stats.prompt_tokens, 2);
  EXPECT_EQ(r.stats.generated_tokens, 7);
  EXPECT_GT(r.stats.prefill_seconds, 0);
  EXPECT_GT(r.stats.decode_tokens_per_s, 0);
  o.max_new_tokens = 0;
  EXPECT_TRUE(pipe.generate_ids({1, 2}, o).ids.empty());
}

TEST(TextGeneration, PromptLongerThanTheCacheIsAValueErrorNamingBothLengths) {
  auto pipe = random_pipeline({.max_seq_len = 8});
  std::vector<int64_t> prompt(9, 1);
  std::string msg = error_message<ValueError>([&] { pipe.generate_ids(prompt, {}); });
  EXPECT_NE(msg.find("9 tokens"), std::string::npos) << msg;
  EXPECT_NE(msg.find("max_seq_len 8"), std::string::npos) << msg;
}

// A top_k of the whole vocabulary (64) or more keeps every token, as top_k 0 does (so a small
// model takes a usual --top-k 40); between the sampler's cap and the vocabulary it is refused.
TEST(TextGeneration, TopKOfTheWholeVocabularyIsOffAndAboveTheCapIsRefused) {
  auto pipe = random_pipeline();
  const pipelines::GenerationOptions off{.max_new_tokens = 12, .top_k = 0, .seed = 7};
  const std::vector<int64_t> want = pipe.generate_ids({1, 2}, off).ids;
  for (int64_t k : {64, 65, 256}) {
    pipelines::GenerationOptions all = off;
    all.top_k = k;
    EXPECT_EQ(pipe.generate_ids({1, 2}, all).ids, want) << "top_k " << k;
  }
  auto capped = random_pipeline({.sampler_max_top_k = 16});
  ASSERT_EQ(capped.sampler_cap(), 16);
  EXPECT_THROW(capped.generate_ids({1}, {.top_k = 17}), ValueError);
  EXPECT_NO_THROW(capped.generate_ids({1}, {.max_new_tokens = 2, .top_k = 64}));
}

TEST(TextGeneration, BadOptionsAndIdsAreValueErrors) {
  auto pipe = random_pipeline();
  EXPECT_THROW(pipe.generate_ids({}, {}), ValueError);
  EXPECT_THROW(pipe.generate_ids({64}, {}), ValueError);
  EXPECT_THROW(pipe.generate_ids({1}, {.top_p = 0.0}), ValueError);
  EXPECT_THROW(pipe.generate_ids({1}, {.temperature = -1.0}), ValueError);
  EXPECT_THROW(pipe.generate("hello", {}), ValueError);            // no tokenizer
  EXPECT_THROW(random_pipeline({.max_seq_len = 65}), ValueError);  // beyond max_position_embeddings
}

TEST(TextGeneration, StopsWhenTheSequenceFillsTheCache) {
  auto pipe = random_pipeline({.max_seq_len = 8});
  auto r = pipe.generate_ids({1, 2, 3, 4, 5}, {.max_new_tokens = 100, .stop_at_eos = false});
  EXPECT_EQ(r.ids.size(), 3u);  // 5 + 3 = 8 tokens
  EXPECT_EQ(r.stats.finish_reason, FinishReason::length);
}

// ---- a model whose greedy output is known: token t is followed by successor(t) ----------------------
//
// All attention and MLP output projections are zero, so the residual stream is the embedding; the
// embedding is the identity and lm_head a permutation, so the logits of token t peak at successor(t).

constexpr int64_t kBos = 0, kEos = 1, kChainVocab = 16;

// Pieces of a byte-level vocabulary; ids 3/4 and 9/10 split one character's UTF-8 bytes in two.
const std::vector<std::string> kPieces{"<bos>", "<eos>",    "He",  "\xC3",     "\xA9",     "llo",
                                       " w",    "\xC3\xB6", "rld", "\xF0\x9F", "\x98\x80", "!",
                                       "x",     "y",        "z",   "q"};

class ChainTokenizer : public pipelines::Tokenizer {
 public:
  std::vector<int64_t> encode(std::string_view text, bool add_special_tokens) const override {
    std::vector<int64_t> ids;
    if (add_special_tokens) ids.push_back(kBos);
    while (!text.empty()) {  // longest piece first
      int64_t best = -1;
      for (int64_t i = 2; i < kChainVocab; ++i)
        if (text.starts_with(kPieces[i]) && (best < 0 || kPieces[i].size() > kPieces[best].size())) best = i;
      if (best < 0) throw ValueError("ChainTokenizer: no piece matches");
      ids.push_back(best);
      text.remove_prefix(kPieces[best].size());
    }
    return ids;
  }
  std::string decode(const std::vector<int64_t>& ids, bool skip_special_tokens) const override {
    std::string out;
    for (int64_t id : ids)
      if (!(skip_special_tokens && is_special(id))) out += kPieces.at(id);
    return out;
  }
  std::string token_bytes(int64_t id) const override { return is_special(id) ? "" : kPieces.at(id); }
  int64_t vocab_size() const override { return kChainVocab; }
  std::optional<int64_t> bos_id() const override { return kBos; }
  std::optional<int64_t> eos_id() const override { return kEos; }
  std::optional<int64_t> token_to_id(std::string_view token) const override {
    for (int64_t i = 0; i < kChainVocab; ++i)
      if (kPieces[i] == token) return i;
    return std::nullopt;
  }
  bool is_special(int64_t id) const override { return id == kBos || id == kEos; }
};

// "He" -> "\xC3" -> "\xA9" -> "llo" -> ... -> "!" -> <eos>; the rest map to themselves.
int64_t successor(int64_t t) {
  if (t >= 2 && t < 11) return t + 1;
  if (t == 11) return kEos;
  return t;
}

TextGenerationPipeline chain_pipeline(pipelines::PipelineOptions options = {}) {
  nn::LlamaConfig c;
  c.vocab_size = kChainVocab;
  c.hidden_size = kChainVocab;
  c.intermediate_size = 8;
  c.num_hidden_layers = 1;
  c.num_attention_heads = 2;
  c.num_key_value_heads = 2;
  c.max_position_embeddings = 32;
  WeightsRegistry weights = pipelines::random_weights(c, 1);
  for (auto& [name, t] : weights)
    if (name.ends_with("o_proj.weight") || name.ends_with("down_proj.weight"))
      t = Tensor::zeros(DType::f32, t.shape());
  std::vector<float> identity(kChainVocab * kChainVocab, 0.0f), permutation(kChainVocab * kChainVocab, 0.0f);
  for (int64_t t = 0; t < kChainVocab; ++t) {
    identity[t * kChainVocab + t] = 1.0f;
    permutation[successor(t) * kChainVocab + t] = 1.0f;  // lm_head row successor(t) reads dim t
  }
  weights["model.embed_tokens.weight"] = Tensor::from_vector(identity, {kChainVocab, kChainVocab});
  weights["lm_head.weight"] = Tensor::from_vector(permutation, {kChainVocab, kChainVocab});
  return TextGenerationPipeline::from_config(c, weights, std::make_shared<ChainTokenizer>(), {},
                                             std::move(options));
}

TEST(TextGeneration, EosStopsGeneration) {
  auto pipe = chain_pipeline();
  auto r = pipe.generate_ids({kBos, 8}, {.max_new_tokens = 20, .temperature = 0.0});
  EXPECT_EQ(r.ids, (std::vector<int64_t>{9, 10, 11, kEos}));
  EXPECT_EQ(r.stats.finish_reason, FinishReason::stop);
  auto ignoring =
      pipe.generate_ids({kBos, 8}, {.max_new_tokens = 6, .temperature = 0.0, .stop_at_eos = false});
  EXPECT_EQ(ignoring.ids.size(), 6u);
  EXPECT_EQ(ignoring.ids[3], kEos);
}

// Streamed pieces are complete UTF-8 characters (a character split over two tokens waits for its
// second half), and they concatenate to the decoded text.
TEST(TextGeneration, StreamedPiecesConcatenateToTheDecodedText) {
  auto pipe = chain_pipeline();
  std::vector<std::string> pieces;
  auto r = pipe.generate("He", {.max_new_tokens = 20, .temperature = 0.0},
                         [&](std::string_view piece) { pieces.emplace_back(piece); });
  EXPECT_EQ(r.stats.prompt_tokens, 2);  // <bos> He
  EXPECT_EQ(r.ids, (std::vector<int64_t>{3, 4, 5, 6, 7, 8, 9, 10, 11, kEos}));
  const std::string expected = "\xC3\xA9llo w\xC3\xB6rld\xF0\x9F\x98\x80!";
  EXPECT_EQ(pipe.tokenizer()->decode(r.ids), expected);
  std::string joined;
  for (const auto& p : pieces) joined += p;
  EXPECT_EQ(joined, expected);
  EXPECT_EQ(r.text, expected);
  EXPECT_EQ(pieces,
            (std::vector<std::string>{"\xC3\xA9", "llo", " w", "\xC3\xB6", "rld", "\xF0\x9F\x98\x80", "!"}));
}

// A stop string that spans two tokens ("llo" + " w") ends generation at the token completing it and
// is never shown; text held back as a possible start of it ("l"...) comes out once it cannot be.
TEST(TextGeneration, EngineStopStringsMatchAcrossTokensAndAreNeverShown) {
  auto pipe = chain_pipeline();
  pipelines::GenerationRequest request;
  request.prompt = "He";
  request.sampling.temperature = 0;
  request.sampling.max_new_tokens = 20;
  request.sampling.stop = {"o w", "zzz"};
  std::string streamed;
  request.on_update = [&](const pipelines::RequestUpdate& u) { streamed += u.text; };
  const pipelines::GenerationOutput out = pipe.engine().generate(std::move(request));
  EXPECT_EQ(out.finish, FinishReason::stop);
  EXPECT_EQ(out.stop_string, std::optional<std::string>("o w"));
  EXPECT_EQ(out.text, "\xC3\xA9ll");
  EXPECT_EQ(streamed, out.text);
  std::vector<int64_t> ids;
  for (const auto& t : out.tokens) ids.push_back(t.id);
  EXPECT_EQ(ids, (std::vector<int64_t>{3, 4, 5, 6})) << "up to the token that completes the stop string";
}

// A model whose embedding is padded past its tokenizer (as Qwen's): a sampled padding id has no
// text, and never fails the request.
TEST(TextGeneration, IdsPastTheTokenizersVocabularyHaveNoText) {
  nn::LlamaConfig c = small_config(48);  // 48 rows, 16 tokens
  auto pipe = TextGenerationPipeline::from_config(c, pipelines::random_weights(c, 5), std::make_shared<ChainTokenizer>());
  const auto r = pipe.generate("He", {.max_new_tokens = 40, .temperature = 1.5, .seed = 3, .stop_at_eos = false});
  EXPECT_EQ(r.ids.size(), 40u);
  pipelines::Utf8Stream utf8;  // as streaming joins the pieces (invalid UTF-8 becomes U+FFFD)
  std::string expected;
  int64_t padding = 0;
  for (int64_t id : r.ids) {
    if (id >= kChainVocab) {
      ++padding;
      continue;
    }
    expected += utf8.push(pipe.tokenizer()->token_bytes(id));
  }
  expected += utf8.flush();
  EXPECT_GT(padding, 0) << "the test wants some padding ids sampled";
  EXPECT_EQ(r.text, expected);
}

// ---- the embedded model against PyTorch ----------------------------------------------------------

// tools/reference/generate_reference.py: greedy ids of plain-torch LlamaForCausalLM, recomputing the
// whole sequence each step; generated_ids ends with EOS when the model emitted it. The streamed text,
// after the prompt, is the reference's decoded text.
TEST(TextGeneration, KilnTinyGreedyMatchesPyTorchReference) {
  const auto root = std::filesystem::path(__FILE__).parent_path().parent_path().parent_path();
  const auto model_dir = root / "models" / "kiln-tiny";
  const auto reference = root / "tests" / "data" / "kiln_tiny_greedy.json";
  if (!std::filesystem::exists(model_dir / "config.json") || !std::filesystem::exists(reference))
    GTEST_SKIP() << "models/kiln-tiny or tests/data/kiln_tiny_greedy.json is absent";
  auto pipe = TextGenerationPipeline::from_dir(model_dir);
  std::ifstream file(reference);
  nlohmann::json doc = nlohmann::json::parse(file);
  EXPECT_EQ(pipe.eos_token_ids(), (std::vector<int64_t>{doc.at("eos_token_id").get<int64_t>()}));
  const GenerationOptions greedy{.max_new_tokens = doc.at("max_new_tokens").get<int64_t>(),
                                 .temperature = 0.0};
  ASSERT_FALSE(doc.at("cases").empty());
  for (const auto& c : doc.at("cases")) {
    const std::string prompt = c.at("prompt");
    const auto prompt_ids = c.at("prompt_ids").get<std::vector<int64_t>>();
    const auto expected = c.at("generated_ids").get<std::vector<int64_t>>();
    EXPECT_EQ(pipe.tokenizer()->encode(prompt), prompt_ids) << prompt;
    EXPECT_EQ(pipe.generate_ids(prompt_ids, greedy).ids, expected) << prompt;
    auto r = pipe.generate(prompt, greedy);
    EXPECT_EQ(r.ids, expected) << prompt;
    EXPECT_EQ(prompt + r.text, c.at("text").get<std::string>()) << prompt;
    EXPECT_EQ(r.stats.finish_reason, expected.back() == doc.at("eos_token_id").get<int64_t>()
                                       ? FinishReason::stop
                                       : FinishReason::length)
        << prompt;
  }
}

}  // namespace
