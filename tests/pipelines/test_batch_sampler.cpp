// Per-row batched sampling (src/pipelines/batch_sampler.h): the batched sampler graph against
// hand-computed inverse CDFs (min_p included) and against a double-precision reference; rows independent of each other; the batched greedy graph;
// penalties, logprobs and the parameter checks on the host.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "kiln/engine/session.h"
#include "kiln/pipelines/graph_spec.h"
#include "kiln/pipelines/text_generation.h"
#include "pipelines/batch_sampler.h"
#include "test_util.h"

using kiln::testing::error_message;
using kiln::testing::expect_error;

namespace {

using namespace kiln;
using pipelines::RowSampling;
using pipelines::TokenCounts;
using pipelines::TokenLogprob;

constexpr float kInf = std::numeric_limits<float>::infinity();

// One row's sampler inputs.
struct Row {
  std::vector<float> logits;
  float temperature = 1.0f;
  int64_t top_k = 0;
  float top_p = 1.0f;
  float min_p = 0.0f;
  float u = 0.0f;
};

// The batched graphs, compiled as one group (as the engine does).
class Samplers {
 public:
  Samplers(int64_t vocab, int64_t cap) : vocab_(vocab) {
    auto batch = std::make_shared<pipelines::BatchSamplerModule>(vocab, cap);
    auto greedy = std::make_shared<pipelines::BatchGreedyModule>(vocab);
    std::vector<pipelines::GraphSpec> specs(2);
    specs[0].module = batch;
    specs[0].name = "batch_sampler";
    specs[0].input_types = batch->input_types();
    specs[1].module = greedy;
    specs[1].name = "batch_greedy";
    specs[1].input_types = greedy->input_types();
    for (auto& spec : specs) spec.group = "samplers";
    models_ = pipelines::compile_graph_specs(session_, specs);
  }

  std::vector<int64_t> batch(const std::vector<Row>& rows) const {
    const auto n = static_cast<int64_t>(rows.size());
    std::vector<float> logits, temperature, top_p, min_p, u;
    std::vector<int64_t> top_k;
    for (const Row& r : rows) {
      EXPECT_EQ(static_cast<int64_t>(r.logits.size()), vocab_);
      logits.insert(logits.end(), r.logits.begin(), r.logits.end());
      temperature.push_back(r.temperature);
      top_k.push_back(r.top_k);
      top_p.push_back(r.top_p);
      min_p.push_back(r.min_p);
      u.push_back(r.u);
    }
    return models_.at("batch_sampler")
        .execute({Tensor::from_vector(logits, {n, vocab_}), Tensor::from_vector(temperature, {n}),
                  Tensor::from_vector(top_k, {n}), Tensor::from_vector(top_p, {n}),
                  Tensor::from_vector(min_p, {n}), Tensor::from_vector(u, {n})})
        .at(0)
        .to_vector<int64_t>();
  }

  int64_t one(const Row& r) const { return batch({r}).at(0); }

  std::vector<int64_t> greedy(const std::vector<std::vector<float>>& rows) const {
    std::vector<float> logits;
    for (const auto& r : rows) logits.insert(logits.end(), r.begin(), r.end());
    const auto n = static_cast<int64_t>(rows.size());
    return models_.at("batch_greedy")
        .execute({Tensor::from_vector(logits, {n, vocab_})})
        .at(0)
        .to_vector<int64_t>();
  }

 private:
  int64_t vocab_;
  engine::InferenceSession session_;
  std::map<std::string, engine::Model> models_;
};

std::vector<float> log_of(const std::vector<double>& probs) {
  std::vector<float> v;
  for (double p : probs) v.push_back(p > 0 ? static_cast<float>(std::log(p)) : -kInf);
  return v;
}

int64_t naive_argmax(const std::vector<float>& v) {
  int64_t best = 0;
  for (size_t i = 1; i < v.size(); ++i)
    if (v[i] > v[static_cast<size_t>(best)]) best = static_cast<int64_t>(i);
  return best;
}

// u in [0, 1) on the f32 grid, as the engine draws it.
float draw_u(std::mt19937_64& rng) { return static_cast<float>(rng() >> 40) * 0x1p-24f; }

// ---- hand-computed rows -------------------------------------------------------------------------
//
// Probabilities by id [0.1, 0.4, 0.2, 0.25, 0.05]; sorted: id 1 (0.4), 3 (0.25), 2 (0.2), 0 (0.1),
// 4 (0.05). The whole-vocabulary path walks ids in order: cumulative [0.1, 0.5, 0.7, 0.95, 1].
const std::vector<float> kFive = log_of({0.1, 0.4, 0.2, 0.25, 0.05});

Row five(float u, int64_t top_k = 0, float top_p = 1.0f, float min_p = 0.0f, float temperature = 1.0f) {
  return Row{kFive, temperature, top_k, top_p, min_p, u};
}

struct Case {
  Row row;
  int64_t expected;
  const char* why;
};

std::vector<Case> hand_cases() {
  return {
      // Whole vocabulary, id order.
      {five(0.05f), 0, "full: u below 0.1"},
      {five(0.3f), 1, "full: 0.1 <= u < 0.5"},
      {five(0.6f), 2, "full: 0.5 <= u < 0.7"},
      {five(0.9f), 3, "full: 0.7 <= u < 0.95"},
      {five(0.97f), 4, "full: u >= 0.95"},
      // top_k 2: {1: 0.4, 3: 0.25} / 0.65, cumulative [0.615, 1].
      {five(0.6f, 2), 1, "top_k 2, u < 0.615"},
      {five(0.62f, 2), 3, "top_k 2, u > 0.615"},
      // top_p 0.7: mass before the sorted tokens [0, 0.4, 0.65, 0.85, ...]: ids 1, 3, 2 kept,
      // / 0.85: cumulative [0.4706, 0.7647, 1].
      {five(0.47f, 0, 0.7f), 1, "top_p 0.7, u < 0.4706"},
      {five(0.48f, 0, 0.7f), 3, "top_p 0.7, 0.4706 < u < 0.7647"},
      {five(0.77f, 0, 0.7f), 2, "top_p 0.7, u > 0.7647"},
      {five(0.999f, 0, 0.7f), 2, "top_p 0.7 never reaches id 0"},
      // top_k 3 then top_p 0.75: renormalised over the top 3 (0.85), the mass before id 2 is
      // 0.65 / 0.85 = 0.7647 >= 0.75, so only ids 1 and 3 remain (0.4 / 0.65 = 0.615).
      {five(0.99f, 3, 0.75f), 3, "top_k 3 + top_p 0.75: id 2 is cut"},
      {five(0.6f, 3, 0.75f), 1, "top_k 3 + top_p 0.75, u < 0.615"},
      // min_p 0.55 alone: threshold 0.55 * 0.4 = 0.22 keeps ids 1 and 3, walked in id order:
      // [0.4, 0.25] / 0.65, cumulative [0.615, 1].
      {five(0.0f, 0, 1.0f, 0.55f), 1, "min_p 0.55, u 0"},
      {five(0.6f, 0, 1.0f, 0.55f), 1, "min_p 0.55, u < 0.615"},
      {five(0.63f, 0, 1.0f, 0.55f), 3, "min_p 0.55, u > 0.615"},
      {five(0.999f, 0, 1.0f, 0.55f), 3, "min_p 0.55, u near 1"},
      // min_p 0.2: threshold 0.08 cuts only id 4: ids 0..3 in id order / 0.95,
      // cumulative [0.105, 0.526, 0.737, 1].
      {five(0.1f, 0, 1.0f, 0.2f), 0, "min_p 0.2, u < 0.105"},
      {five(0.99f, 0, 1.0f, 0.2f), 3, "min_p 0.2 cuts id 4"},
      // min_p after top_p (Hugging Face's order): top_p 0.7 keeps ids 1, 3, 2 (measured over the
      // whole distribution), min_p 0.3 (threshold 0.12) keeps them all, so u 0.9 reaches id 2. Had
      // min_p run first (vLLM's order), top_p would see [0.47, 0.29, 0.24] and cut id 2.
      {five(0.9f, 0, 0.7f, 0.3f), 2, "min_p runs after top_p"},
      // min_p with top_k: top_k 4 keeps ids 1, 3, 2, 0; min_p 0.3 cuts id 0 (0.1 < 0.12): / 0.85.
      {five(0.99f, 4, 1.0f, 0.3f), 2, "top_k 4 + min_p 0.3 cuts id 0"},
      // min_p 1 keeps only the top token.
      {five(0.999f, 0, 1.0f, 1.0f), 1, "min_p 1, full path"},
      {five(0.999f, 5, 1.0f, 1.0f), 1, "min_p 1, sorted path"},
      // Temperature 0.5 squares the probabilities: [0.01, 0.16, 0.04, 0.0625, 0.0025] / 0.275 =
      // [0.0364, 0.5818, 0.1455, 0.2273, 0.0091], cumulative [0.0364, 0.6182, 0.7636, 0.9909, 1].
      {five(0.62f, 0, 1.0f, 0.0f, 0.5f), 2, "temperature 0.5, 0.6182 < u < 0.7636"},
      {five(0.99f, 0, 1.0f, 0.0f, 0.5f), 3, "temperature 0.5, u < 0.9909"},
      {five(0.995f, 0, 1.0f, 0.0f, 0.5f), 4, "temperature 0.5, u > 0.9909"},
      // min_p sees the probabilities after temperature: at 0.5, 0.3 * 0.5818 = 0.1745 cuts id 2
      // (0.1455), which it keeps at temperature 1 (0.2 >= 0.12). Kept: ids 1, 3: [0.5818, 0.2273].
      // At temperature 1 min_p 0.3 keeps ids 1, 2, 3: [0.4, 0.2, 0.25] / 0.85, cumulative
      // [0.4706, 0.7059, 1]; at 0.5, ids 1 and 3: [0.5818, 0.2273] / 0.8091, cumulative [0.7191, 1].
      {five(0.99f, 0, 1.0f, 0.3f, 0.5f), 3, "temperature 0.5 + min_p 0.3: id 3 last"},
      {five(0.6f, 0, 1.0f, 0.3f, 0.5f), 1, "temperature 0.5 + min_p 0.3 cuts id 2"},
      {five(0.6f, 0, 1.0f, 0.3f), 2, "temperature 1 + min_p 0.3 keeps id 2"},
      // Greedy: argmax whatever u, top_p and min_p are.
      {five(0.99f, 0, 1.0f, 0.0f, 0.0f), 1, "temperature 0"},
      {five(0.99f, 0, 0.5f, 0.5f, 0.0f), 1, "temperature 0 with top_p and min_p"},
      {five(0.99f, 1, 1.0f, 0.0f, 2.0f), 1, "top_k 1"},
  };
}

TEST(BatchSampler, RowsPickTheTokensComputedByHand) {
  Samplers s(5, 5);
  std::vector<Case> cases = hand_cases();
  std::vector<Row> rows;
  for (const Case& c : cases) rows.push_back(c.row);
  std::vector<int64_t> got = s.batch(rows);
  ASSERT_EQ(got.size(), cases.size());
  for (size_t i = 0; i < cases.size(); ++i) EXPECT_EQ(got[i], cases[i].expected) << cases[i].why;
}

// A cap below the vocabulary limits top_k / top_p to the cap's tokens, but not min_p alone (no sort):
// with 300 equal logits and a cap of 4, min_p 1 keeps all 300, so u picks floor(u * 300).
TEST(BatchSampler, MinPAloneIsNotLimitedToTheCap) {
  Samplers s(300, 4);
  std::vector<float> flat(300, 0.0f);
  std::vector<int64_t> got = s.batch({{flat, 1.0f, 0, 1.0f, 1.0f, 0.999f},
                                      {flat, 1.0f, 0, 1.0f, 0.5f, 0.5f},
                                      {flat, 1.0f, 0, 0.999f, 0.0f, 0.999f}});  // top_p: the cap
  EXPECT_EQ(got, (std::vector<int64_t>{299, 150, 3}));
}

// ---- random rows ------------------------------------------------------------------------------------

std::vector<float> random_logits(std::mt19937_64& rng, int64_t vocab, float scale) {
  std::normal_distribution<float> normal(0.0f, scale);
  std::vector<float> v(static_cast<size_t>(vocab));
  for (auto& x : v) x = normal(rng);
  std::uniform_int_distribution<int64_t> id(0, vocab - 1);
  if (rng() % 3 == 0) v[static_cast<size_t>(id(rng))] = v[static_cast<size_t>(id(rng))] = 4.0f;  // a tie
  if (rng() % 4 == 0) v[static_cast<size_t>(id(rng))] = -kInf;
  return v;
}

Row random_row(std::mt19937_64& rng, int64_t vocab, int64_t cap, bool with_min_p) {
  Row r;
  r.logits = random_logits(rng, vocab, 1.0f + static_cast<float>(rng() % 3));
  const float temperatures[] = {0.0f, 0.3f, 0.7f, 1.0f, 1.5f};
  r.temperature = temperatures[rng() % 5];
  r.top_k = rng() % 3 == 0 ? 0 : static_cast<int64_t>(rng() % static_cast<uint64_t>(cap + 1));
  const float top_ps[] = {1.0f, 1.0f, 0.95f, 0.8f, 0.5f, 0.1f};
  r.top_p = top_ps[rng() % 6];
  if (with_min_p && rng() % 2) r.min_p = static_cast<float>(rng() % 1000) / 1000.0f;
  r.u = draw_u(rng);
  return r;
}

// ---- against a double-precision reference ---------------------------------------------------------

// The token the semantics give for a row, computed in double on the host; nullopt when a threshold
// or the inverse CDF lands within 1e-4 of a boundary, where f32 rounding may go either way.
std::optional<int64_t> reference_token(const Row& r, int64_t cap) {
  const auto vocab = static_cast<int64_t>(r.logits.size());
  if (r.temperature <= 0) return naive_argmax(r.logits);
  const double max = *std::max_element(r.logits.begin(), r.logits.end());
  auto weight = [&](int64_t id) {
    return std::exp((r.logits[static_cast<size_t>(id)] - max) / r.temperature);
  };
  constexpr double kNear = 1e-4;
  auto near = [&](double a, double b) { return std::abs(a - b) < kNear; };
  std::vector<std::pair<int64_t, double>> candidates;  // in the order the inverse CDF walks them
  if (r.top_k == 0 && r.top_p >= 1) {
    for (int64_t id = 0; id < vocab; ++id) {
      const double w = weight(id);
      if (r.min_p > 0 && near(w, r.min_p)) return std::nullopt;
      if (w >= r.min_p) candidates.push_back({id, w});
    }
  } else {
    std::vector<int64_t> order(static_cast<size_t>(vocab));
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
      return r.logits[static_cast<size_t>(a)] > r.logits[static_cast<size_t>(b)];
    });
    double all = 0, top = 0;
    for (int64_t id = 0; id < vocab; ++id) all += weight(id);
    for (int64_t i = 0; i < cap && (r.top_k == 0 || i < r.top_k); ++i)
      top += weight(order[static_cast<size_t>(i)]);
    const double mass = r.top_k == 0 ? all : top;
    double before = 0;
    for (int64_t i = 0; i < cap; ++i) {
      const double w = weight(order[static_cast<size_t>(i)]);
      const bool keep_k = r.top_k == 0 || i < r.top_k;
      if (r.top_p < 1 && near(before / mass, r.top_p)) return std::nullopt;
      if (r.min_p > 0 && near(w, r.min_p)) return std::nullopt;
      const bool keep_p = r.top_p >= 1 || before / mass < r.top_p;
      if (i == 0 || (keep_k && keep_p && w >= r.min_p))
        candidates.push_back({order[static_cast<size_t>(i)], w});
      if (keep_k) before += w;
    }
  }
  double total = 0;
  for (auto& c : candidates) total += c.second;
  const double x = r.u * total;
  double cdf = 0;
  for (auto& [id, w] : candidates) {
    cdf += w;
    if (w > 0 && near(cdf / total, x / total)) return std::nullopt;
    if (cdf > x) return id;
  }
  return candidates.back().first;
}

TEST(BatchSampler, RowsMatchADoublePrecisionReference) {
  constexpr int64_t kVocab = 48, kCap = 12;
  Samplers s(kVocab, kCap);
  std::mt19937_64 rng(5);
  int checked = 0, with_min_p = 0;
  for (int batch = 0; batch < 10; ++batch) {
    std::vector<Row> rows;
    for (int i = 0; i < 20; ++i) rows.push_back(random_row(rng, kVocab, kCap, /*with_min_p=*/true));
    std::vector<int64_t> got = s.batch(rows);
    for (size_t i = 0; i < rows.size(); ++i) {
      std::optional<int64_t> want = reference_token(rows[i], kCap);
      if (!want) continue;
      ++checked;
      with_min_p += rows[i].min_p > 0;
      EXPECT_EQ(got[i], *want) << "batch " << batch << " row " << i << ": T " << rows[i].temperature
                               << " top_k " << rows[i].top_k << " top_p " << rows[i].top_p << " min_p "
                               << rows[i].min_p << " u " << rows[i].u;
    }
  }
  EXPECT_GT(checked, 180);  // few rows land near a boundary
  EXPECT_GT(with_min_p, 60);
}

// ---- batch invariance -----------------------------------------------------------------------------

// A row's token is the same alone, first, last or in the middle of batches of other random rows.
TEST(BatchSampler, ARowsTokenDoesNotDependOnTheOtherRows) {
  constexpr int64_t kVocab = 64, kCap = 16;
  Samplers s(kVocab, kCap);
  std::mt19937_64 rng(99);
  std::vector<Row> rows;
  for (int i = 0; i < 24; ++i) rows.push_back(random_row(rng, kVocab, kCap, /*with_min_p=*/true));
  std::vector<int64_t> alone;
  for (const Row& r : rows) alone.push_back(s.one(r));
  EXPECT_EQ(s.batch(rows), alone);
  std::vector<Row> reversed(rows.rbegin(), rows.rend());
  std::vector<int64_t> got = s.batch(reversed);
  std::reverse(got.begin(), got.end());
  EXPECT_EQ(got, alone);
  for (size_t others : {1u, 3u, 31u}) {
    for (size_t i = 0; i < rows.size(); i += 5) {
      std::vector<Row> batch;
      for (size_t j = 0; j < others; ++j) batch.push_back(random_row(rng, kVocab, kCap, true));
      const size_t at = rng() % (batch.size() + 1);
      batch.insert(batch.begin() + static_cast<std::ptrdiff_t>(at), rows[i]);
      EXPECT_EQ(s.batch(batch).at(at), alone[i]) << "row " << i << " among " << others << " at " << at;
    }
  }
}

// ---- the batched greedy graph -------------------------------------------------------------------

TEST(BatchGreedy, EachRowIsItsArgmaxAndTheSamplersGreedyToken) {
  constexpr int64_t kVocab = 64, kCap = 8;
  Samplers s(kVocab, kCap);
  std::mt19937_64 rng(3);
  std::vector<std::vector<float>> logits;
  std::vector<Row> at_zero, top_one;
  for (int i = 0; i < 9; ++i) {
    logits.push_back(random_logits(rng, kVocab, 2.0f));
    if (i % 2) logits.back()[40] = logits.back()[11] = 10.0f;  // a tie: the first index wins
    at_zero.push_back({logits.back(), 0.0f, 0, 1.0f, 0.0f, draw_u(rng)});
    top_one.push_back({logits.back(), 1.5f, 1, 0.9f, 0.1f, draw_u(rng)});
  }
  std::vector<int64_t> expected;
  for (const auto& v : logits) expected.push_back(naive_argmax(v));
  EXPECT_EQ(s.greedy(logits), expected);
  EXPECT_EQ(s.batch(at_zero), expected);
  EXPECT_EQ(s.batch(top_one), expected);
  EXPECT_TRUE(pipelines::is_greedy({.temperature = 0.0}));
  EXPECT_TRUE(pipelines::is_greedy({.temperature = 0.8, .top_k = 1}));
  EXPECT_FALSE(pipelines::is_greedy({.temperature = 0.8, .top_k = 2}));
}

TEST(BatchSampler, ModulesRejectBadShapes) {
  EXPECT_THROW(pipelines::BatchSamplerModule(0, 1), ValueError);
  EXPECT_THROW(pipelines::BatchSamplerModule(10, 11), ValueError);
  EXPECT_THROW(pipelines::BatchSamplerModule(10, 0), ValueError);
  EXPECT_THROW(pipelines::BatchGreedyModule(0), ValueError);
}

// ---- penalties ------------------------------------------------------------------------------------

// logits [2, -1, 0.5, 3, -2, 1]; prompt {0, 1}; output [3, 3, 4, 0]; repetition 2, frequency 0.5,
// presence 0.25 (all exact in binary):
//   id 0 (prompt and output once): 2 / 2 = 1, - 0.5 - 0.25 = 0.25   (repetition applied once)
//   id 1 (prompt):                 -1 * 2 = -2
//   id 2, id 5 (unseen):           unchanged
//   id 3 (output twice):           3 / 2 = 1.5, - 0.5 * 2 = 0.5, - 0.25 = 0.25
//   id 4 (output once):            -2 * 2 = -4, - 0.5 = -4.5, - 0.25 = -4.75
TEST(Penalties, MatchTheHandComputedExample) {
  const std::vector<int64_t> prompt{0, 1, 1, 0};
  TokenCounts counts(prompt);
  for (int64_t id : {3, 3, 4, 0}) counts.add_output(id);
  EXPECT_EQ(counts.distinct(), 4u);
  EXPECT_EQ(counts.output_count(3), 2);
  EXPECT_EQ(counts.output_count(1), 0);
  EXPECT_TRUE(counts.in_prompt(1));
  EXPECT_FALSE(counts.in_prompt(3));
  std::vector<float> logits{2, -1, 0.5f, 3, -2, 1};
  pipelines::apply_penalties(logits, counts, 2.0, 0.5, 0.25);
  EXPECT_EQ(logits, (std::vector<float>{0.25f, -2, 0.5f, 0.25f, -4.75f, 1}));
}

TEST(Penalties, NeutralValuesLeaveTheLogitsAlone) {
  TokenCounts counts(std::vector<int64_t>{0, 2});
  counts.add_output(1);
  std::vector<float> logits{1.5f, -0.25f, 3, -7};
  const std::vector<float> before = logits;
  pipelines::apply_penalties(logits, counts, RowSampling{});
  EXPECT_EQ(logits, before);
  EXPECT_FALSE(pipelines::has_penalties(RowSampling{}));
  EXPECT_TRUE(pipelines::has_penalties({.presence_penalty = 0.1}));
}

// Random prompts, outputs and penalties against the semantics written out over the token lists
// (vLLM's: repetition on prompt and output tokens, then frequency and presence on output tokens, in
// f32), the counts built incrementally token by token as the engine does.
TEST(Penalties, MatchTheSemanticsOnRandomRequests) {
  constexpr int64_t kVocab = 50;
  std::mt19937_64 rng(8);
  std::uniform_int_distribution<int64_t> id(0, kVocab - 1);
  std::uniform_real_distribution<double> penalty(-2.0, 2.0), repetition(0.5, 2.0);
  for (int trial = 0; trial < 50; ++trial) {
    std::vector<int64_t> prompt(rng() % 12), output(rng() % 20);
    for (auto& t : prompt) t = id(rng);
    for (auto& t : output) t = id(rng);
    const double rep = trial % 5 == 0 ? 1.0 : repetition(rng);
    const double freq = penalty(rng), presence = penalty(rng);
    std::vector<float> logits = random_logits(rng, kVocab, 3.0f);

    std::vector<float> expected = logits;
    for (int64_t v = 0; v < kVocab; ++v) {
      const auto count = std::count(output.begin(), output.end(), v);
      const bool seen = count > 0 || std::find(prompt.begin(), prompt.end(), v) != prompt.end();
      float& l = expected[static_cast<size_t>(v)];
      if (seen) l = l > 0 ? l / static_cast<float>(rep) : l * static_cast<float>(rep);
      l -= static_cast<float>(freq) * static_cast<float>(count);
      l -= static_cast<float>(presence) * static_cast<float>(count > 0);
    }

    TokenCounts counts;
    counts.add_prompt(prompt);
    for (int64_t t : output) counts.add_output(t);
    pipelines::apply_penalties(
        logits, counts, {.repetition_penalty = rep, .frequency_penalty = freq, .presence_penalty = presence});
    for (int64_t v = 0; v < kVocab; ++v)
      ASSERT_EQ(logits[static_cast<size_t>(v)], expected[static_cast<size_t>(v)])
          << "trial " << trial << " id " << v;
  }
}

TEST(Penalties, ASeenIdOutsideTheRowIsAValueError) {
  TokenCounts counts;
  counts.add_output(7);
  std::vector<float> logits(5, 0.0f);
  expect_error<ValueError>([&] { pipelines::apply_penalties(logits, counts, 1.1, 0, 0); }, {"7", "[0, 5)"});
}

// ---- logprobs -------------------------------------------------------------------------------------

// -inf (an impossible token) exactly, anything else within f32 rounding of a double computation.
void expect_logprob(float got, double want, const std::string& where) {
  if (std::isinf(want))
    EXPECT_EQ(got, want) << where;
  else
    EXPECT_NEAR(got, want, 1e-5) << where;
}

TEST(Logprobs, MatchADoublePrecisionLogSoftmax) {
  std::mt19937_64 rng(17);
  for (int trial = 0; trial < 30; ++trial) {
    const int64_t vocab = trial % 3 == 0 ? 7 : 1000;
    std::vector<float> logits = random_logits(rng, vocab, trial % 2 ? 8.0f : 1.0f);
    if (trial % 4 == 1) logits[3] = logits[5] = logits[1] = 30.0f;  // tied at the top
    const int64_t chosen = static_cast<int64_t>(rng() % static_cast<uint64_t>(vocab));
    const int64_t n = std::vector<int64_t>{0, 1, 5, 20}[static_cast<size_t>(trial % 4)];

    // Two passes in double: max, then log(sum(exp(x - max))).
    double max = -kInf, sum = 0;
    for (float x : logits) max = std::max<double>(max, x);
    for (float x : logits) sum += std::exp(static_cast<double>(x) - max);
    const double log_sum = max + std::log(sum);
    std::vector<int64_t> order(static_cast<size_t>(vocab));
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
      return logits[static_cast<size_t>(a)] > logits[static_cast<size_t>(b)];
    });

    pipelines::RowLogprobs got = pipelines::row_logprobs(logits, chosen, n);
    expect_logprob(got.chosen, logits[static_cast<size_t>(chosen)] - log_sum,
                   "trial " + std::to_string(trial));
    const auto rank = std::count_if(logits.begin(), logits.end(),
                                    [&](float x) { return x >= logits[static_cast<size_t>(chosen)]; });
    EXPECT_EQ(got.chosen_rank, rank) << "trial " << trial;
    ASSERT_EQ(static_cast<int64_t>(got.top.size()), std::min(n, vocab)) << "trial " << trial;
    for (size_t i = 0; i < got.top.size(); ++i) {
      EXPECT_EQ(got.top[i].id, order[i]) << "trial " << trial << " rank " << i;
      expect_logprob(got.top[i].logprob, logits[static_cast<size_t>(order[i])] - log_sum,
                     "trial " + std::to_string(trial) + " rank " + std::to_string(i));
    }
    double total = 0;  // the probabilities sum to 1
    for (float x : logits) total += std::exp(static_cast<double>(x) - log_sum);
    EXPECT_NEAR(total, 1.0, 1e-9);
  }
}

// [log 0.5, log 0.25, -inf, log 0.25]: ln 0.5 and ln 0.25 exactly; the -inf token is last.
TEST(Logprobs, HandComputedRowWithAnImpossibleToken) {
  const std::vector<float> logits{0.0f, -std::log(2.0f), -kInf, -std::log(2.0f)};  // probs 0.5, 0.25, 0, 0.25
  pipelines::RowLogprobs got = pipelines::row_logprobs(logits, 3, 20);
  EXPECT_NEAR(got.chosen, std::log(0.25), 1e-6);
  EXPECT_EQ(got.chosen_rank, 3);  // 0, 1 and 3 are at least as likely
  ASSERT_EQ(got.top.size(), 4u);
  EXPECT_EQ(got.top[0].id, 0);
  EXPECT_NEAR(got.top[0].logprob, std::log(0.5), 1e-6);
  EXPECT_EQ(got.top[1].id, 1);  // tied with 3: the lower id first
  EXPECT_EQ(got.top[2].id, 3);
  EXPECT_EQ(got.top[3].id, 2);
  EXPECT_EQ(got.top[3].logprob, -kInf);
}

TEST(Logprobs, BadArgumentsAreValueErrors) {
  const std::vector<float> logits{1, 2, 3};
  expect_error<ValueError>([&] { pipelines::row_logprobs(logits, 3, 1); }, {"chosen", "3"});
  expect_error<ValueError>([&] { pipelines::row_logprobs(logits, 0, 21); }, {"21"});
  expect_error<ValueError>([&] { pipelines::row_logprobs(logits, 0, -1); }, {"-1"});
  EXPECT_THROW(pipelines::row_logprobs(std::vector<float>{}, 0, 0), ValueError);
}

// ---- parameter checks -----------------------------------------------------------------------------

TEST(SamplingValues, EachFieldOutOfRangeIsAValueErrorNamingIt) {
  constexpr int64_t kCap = 40;
  pipelines::check_sampling_values(RowSampling{}, kCap);
  pipelines::check_sampling_values({.temperature = 0,
                                    .top_k = kCap,
                                    .top_p = 1e-6,
                                    .min_p = 1,
                                    .repetition_penalty = 1e-3,
                                    .frequency_penalty = -2,
                                    .presence_penalty = 2,
                                    .top_logprobs = 20},
                                   kCap);
  const double nan = std::nan("");
  struct Bad {
    RowSampling s;
    std::vector<std::string> parts;
  };
  const std::vector<Bad> bad{
      {{.temperature = -0.5}, {"temperature", "-0.5"}},
      {{.temperature = kInf}, {"temperature", "inf"}},
      {{.temperature = nan}, {"temperature", "nan"}},
      {{.top_k = -1}, {"top_k", "[0, 40]", "-1"}},
      {{.top_k = 41}, {"top_k", "41"}},
      {{.top_p = 0}, {"top_p", "(0, 1]", "0"}},
      {{.top_p = 1.5}, {"top_p", "1.5"}},
      {{.top_p = nan}, {"top_p", "nan"}},
      {{.min_p = -0.1}, {"min_p", "[0, 1]", "-0.1"}},
      {{.min_p = 1.01}, {"min_p", "1.01"}},
      {{.repetition_penalty = 0}, {"repetition_penalty", "> 0", "0"}},
      {{.repetition_penalty = kInf}, {"repetition_penalty", "inf"}},
      {{.frequency_penalty = 2.5}, {"frequency_penalty", "[-2, 2]", "2.5"}},
      {{.frequency_penalty = nan}, {"frequency_penalty", "nan"}},
      {{.presence_penalty = -3}, {"presence_penalty", "-3"}},
      {{.top_logprobs = 21}, {"top_logprobs", "[0, 20]", "21"}},
      {{.top_logprobs = -1}, {"top_logprobs", "-1"}},
  };
  for (const Bad& b : bad) {
    std::vector<std::string> parts = b.parts;
    parts.push_back("request 3: ");
    expect_error<ValueError>([&] { pipelines::check_sampling_values(b.s, kCap, "request 3"); }, parts);
  }
}

}  // namespace
