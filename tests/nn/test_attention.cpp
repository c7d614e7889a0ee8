// Rotary embeddings and grouped-query attention with the KV cache, against direct formulas and a naive
// attention loop written here.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <numbers>
#include <random>
#include <vector>

#include "kiln/graph/ops.h"
#include "kiln/nn/attention.h"
#include "kiln/nn/rotary_embedding.h"
#include "layer_test_util.h"

namespace {

using namespace kiln;
using namespace kiln::nn::layer_test;
using graph::BufferType;
using graph::TensorType;
using graph::Value;

// ---- RotaryEmbedding ---------------------------------------------------------------------------

TEST(RotaryEmbedding, InverseFrequenciesArePowersOfTheta) {
  nn::RotaryEmbedding rope(4, 100.0, 16);
  ASSERT_EQ(rope.inv_freq().size(), 2u);
  EXPECT_DOUBLE_EQ(rope.inv_freq()[0], 1.0);
  EXPECT_DOUBLE_EQ(rope.inv_freq()[1], 0.1);  // 100^(-2/4)
}

TEST(RotaryEmbedding, Llama3ScalingKeepsHighDividesLowAndBlendsMiddleFrequencies) {
  // head_dim 16, theta 1e4: wavelengths 2*pi*10^(i/2) = 6.3, 19.9, 62.8, 198.7, 628, ...; with an
  // original context of 256 and factors 1 and 4, wavelengths under 64 are kept, over 256 divided by 8,
  // and 198.7 blended.
  nn::RotaryEmbedding plain(16, 10000.0, 32);
  nn::RotaryEmbedding scaled(16, 10000.0, 32, nn::Llama3RopeScaling{8.0, 1.0, 4.0, 256});
  ASSERT_EQ(scaled.inv_freq().size(), 8u);
  for (int i = 0; i < 8; ++i) EXPECT_NEAR(plain.inv_freq()[i], std::pow(10.0, -i / 2.0), 1e-15) << i;
  for (int i = 0; i < 3; ++i) EXPECT_DOUBLE_EQ(scaled.inv_freq()[i], plain.inv_freq()[i]) << i;
  for (int i = 4; i < 8; ++i) EXPECT_DOUBLE_EQ(scaled.inv_freq()[i], plain.inv_freq()[i] / 8) << i;
  double f = std::pow(10.0, -1.5);
  double wavelength = 2 * std::numbers::pi / f;    // 198.7
  double smooth = (256 / wavelength - 1.0) / 3.0;  // 0.096
  EXPECT_NEAR(scaled.inv_freq()[3], f / 8 * (1 - smooth) + f * smooth, 1e-15);
}

// y[i] = x[i] cos(a_i) - x[i + half] sin(a_i), y[i + half] = x[i + half] cos(a_i) + x[i] sin(a_i),
// a_i = position / theta^(2i / head_dim).
std::vector<double> rotate(const std::vector<float>& x, int64_t seq, int64_t heads, int64_t head_dim,
                           const std::vector<int64_t>& positions, double theta) {
  std::vector<double> y(x.size());
  const int64_t half = head_dim / 2;
  for (int64_t s = 0; s < seq; ++s)
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t i = 0; i < half; ++i) {
        double angle = static_cast<double>(positions[s]) * std::pow(theta, -2.0 * i / head_dim);
        size_t base = static_cast<size_t>((s * heads + h) * head_dim);
        double a = x[base + i], b = x[base + i + half];
        y[base + i] = a * std::cos(angle) - b * std::sin(angle);
        y[base + i + half] = b * std::cos(angle) + a * std::sin(angle);
      }
  return y;
}

TEST(RotaryEmbedding, RotatesHalvesByPositionTimesFrequency) {
  constexpr int64_t kSeq = 3, kHeads = 2, kHeadDim = 8;
  nn::RotaryEmbedding rope(kHeadDim, 10000.0, 64);
  auto model =
      build_model({TensorType{DType::f32, {"seq", kHeads, kHeadDim}}, TensorType{DType::i64, {"seq"}}},
                  [&](const std::vector<Value>& in) { return std::vector<Value>{rope(in[0], in[1])}; }, {});
  std::mt19937 rng(7);
  auto x = random_values(rng, kSeq * kHeads * kHeadDim);
  std::vector<int64_t> positions{0, 5, 31};
  auto out = model.execute(
      {Tensor::from_vector(x, {kSeq, kHeads, kHeadDim}), Tensor::from_vector(positions, {kSeq})});
  auto got = floats(out[0]);
  auto want = rotate(x, kSeq, kHeads, kHeadDim, positions, 10000.0);
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], want[i], 2e-5) << i;
  // Position 0 is the identity.
  for (int64_t i = 0; i < kHeads * kHeadDim; ++i) EXPECT_FLOAT_EQ(got[i], x[i]);
}

// RotaryEmbedding::apply builds one rope op; it must give the bits of the split / neg / concat /
// elementwise graph it replaced (which the compiler fuses into one fused_elementwise), in f32 and bf16.
TEST(RotaryEmbedding, RopeOpEqualsTheUnfusedRotateHalfGraphBitForBit) {
  namespace ops = graph::ops;
  constexpr int64_t kSeq = 7, kHeads = 3, kHeadDim = 12, kHalf = kHeadDim / 2;
  std::mt19937 rng(9);
  const auto x = random_values(rng, kSeq * kHeads * kHeadDim);
  const auto c = random_values(rng, kSeq * kHeadDim), s = random_values(rng, kSeq * kHeadDim);
  for (DType dtype : {DType::f32, DType::bf16}) {
    const std::vector<graph::Type> types{TensorType{dtype, {"seq", kHeads, kHeadDim}},
                                         TensorType{DType::f32, {"seq", kHeadDim}},
                                         TensorType{DType::f32, {"seq", kHeadDim}}};
    auto fused = build_model(
        types,
        [](const std::vector<Value>& in) {
          return std::vector<Value>{nn::RotaryEmbedding::apply(in[0], in[1], in[2])};
        },
        {});
    auto unfused = build_model(
        types,
        [&](const std::vector<Value>& in) {
          graph::TensorValue xv = in[0];
          auto cv = ops::reshape(graph::TensorValue(in[1]), graph::Shape{xv.shape()[0], 1, kHeadDim});
          auto sv = ops::reshape(graph::TensorValue(in[2]), graph::Shape{xv.shape()[0], 1, kHeadDim});
          if (dtype != DType::f32) {
            cv = ops::cast(cv, dtype);
            sv = ops::cast(sv, dtype);
          }
          auto halves = ops::split(xv, {kHalf, kHalf}, -1);
          auto rotated = ops::concat({-halves[1], halves[0]}, -1);
          return std::vector<Value>{xv * cv + rotated * sv};
        },
        {});
    std::vector<bf16_t> x_bf16;
    for (float v : x) x_bf16.push_back(bf16_t(v));
    const Tensor xt = dtype == DType::f32 ? Tensor::from_vector(x, {kSeq, kHeads, kHeadDim})
                                          : Tensor::from_vector(x_bf16, {kSeq, kHeads, kHeadDim});
    const std::vector<Tensor> inputs{xt, Tensor::from_vector(c, {kSeq, kHeadDim}),
                                     Tensor::from_vector(s, {kSeq, kHeadDim})};
    const Tensor got = fused.execute(inputs).at(0), want = unfused.execute(inputs).at(0);
    ASSERT_EQ(got.nbytes(), want.nbytes());
    EXPECT_EQ(std::memcmp(got.data(), want.data(), got.nbytes()), 0) << dtype_name(dtype);
  }
}

TEST(RotaryEmbedding, RejectsOddHeadDim) { EXPECT_THROW(nn::RotaryEmbedding(7, 10000.0, 16), ValueError); }

// ---- AttentionWithRope -------------------------------------------------------------------------

constexpr int64_t kHidden = 12, kHeads = 4, kKvHeads = 2, kHeadDim = 4, kLayers = 2, kMaxSeq = 8;
constexpr double kTheta = 10000.0;

struct AttentionWeights {
  std::vector<float> q, k, v, o;  // [out, in] each
};

// Naive attention of all `rows` tokens of x at positions 0..rows-1, causal, with keys where
// `key_allowed` is false excluded; kv head of query head h is h / (heads / kv_heads). Returns the
// output [rows, hidden] and the rotated keys [rows, kv_heads, head_dim].
std::pair<std::vector<double>, std::vector<double>> naive_attention(const std::vector<float>& x, int64_t rows,
                                                                    const AttentionWeights& w,
                                                                    const std::vector<bool>& key_allowed) {
  auto project = [&](const std::vector<float>& weight, int64_t out) {
    std::vector<float> y(static_cast<size_t>(rows * out));
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t o = 0; o < out; ++o) {
        double acc = 0;
        for (int64_t i = 0; i < kHidden; ++i) acc += double(x[r * kHidden + i]) * weight[o * kHidden + i];
        y[r * out + o] = static_cast<float>(acc);
      }
    return y;
  };
  std::vector<int64_t> positions(static_cast<size_t>(rows));
  for (int64_t r = 0; r < rows; ++r) positions[r] = r;
  auto q = rotate(project(w.q, kHeads * kHeadDim), rows, kHeads, kHeadDim, positions, kTheta);
  auto k = rotate(project(w.k, kKvHeads * kHeadDim), rows, kKvHeads, kHeadDim, positions, kTheta);
  auto v = project(w.v, kKvHeads * kHeadDim);
  std::vector<double> attn(static_cast<size_t>(rows * kHeads * kHeadDim), 0.0);
  for (int64_t h = 0; h < kHeads; ++h) {
    int64_t kv = h / (kHeads / kKvHeads);
    for (int64_t i = 0; i < rows; ++i) {
      std::vector<double> scores;
      std::vector<int64_t> keys;
      for (int64_t j = 0; j <= i; ++j) {
        if (!key_allowed[j]) continue;
        double dot = 0;
        for (int64_t d = 0; d < kHeadDim; ++d)
          dot += q[(i * kHeads + h) * kHeadDim + d] * k[(j * kKvHeads + kv) * kHeadDim + d];
        scores.push_back(dot / std::sqrt(double(kHeadDim)));
        keys.push_back(j);
      }
      double max = -INFINITY, total = 0;
      for (double s : scores) max = std::max(max, s);
      for (double& s : scores) total += (s = std::exp(s - max));
      for (size_t n = 0; n < keys.size(); ++n)
        for (int64_t d = 0; d < kHeadDim; ++d)
          attn[(i * kHeads + h) * kHeadDim + d] +=
              scores[n] / total * v[(keys[n] * kKvHeads + kv) * kHeadDim + d];
    }
  }
  std::vector<double> out(static_cast<size_t>(rows * kHidden));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t o = 0; o < kHidden; ++o) {
      double acc = 0;
      for (int64_t i = 0; i < kHeads * kHeadDim; ++i)
        acc += attn[r * kHeads * kHeadDim + i] * w.o[o * kHeads * kHeadDim + i];
      out[r * kHidden + o] = acc;
    }
  return {out, k};
}

struct AttentionFixture {
  nn::RotaryEmbedding rope{kHeadDim, kTheta, kMaxSeq};
  nn::AttentionWithRope attn{/*layer_index=*/1, kHidden, kHeads, kKvHeads, kHeadDim};
  WeightsRegistry weights;
  AttentionWeights w;
  engine::Model model;

  AttentionFixture() {
    std::mt19937 rng(8);
    weights = random_weights(attn, rng);
    w = {weights.at("q_proj.weight").to_vector<float>(), weights.at("k_proj.weight").to_vector<float>(),
         weights.at("v_proj.weight").to_vector<float>(), weights.at("o_proj.weight").to_vector<float>()};
    const BufferType cache{DType::f32, {kLayers, kMaxSeq, kKvHeads, kHeadDim}};
    model = build_model(
        {TensorType{DType::f32, {"seq", kHidden}}, TensorType{DType::i64, {"total"}}, cache, cache},
        [&](const std::vector<Value>& in) {
          graph::TensorValue x = in[0];
          auto ctx = nn::make_attention_context({in[2], in[3]}, in[1], x.shape()[0], rope);
          return std::vector<Value>{attn(x, ctx)};
        },
        weights);
  }
};

std::vector<float> rows_of(const std::vector<float>& x, int64_t begin, int64_t end, int64_t width) {
  return std::vector<float>(x.begin() + begin * width, x.begin() + end * width);
}

TEST(AttentionWithRope, PrefillThenDecodeMatchesNaiveGroupedQueryAttention) {
  AttentionFixture f;
  std::mt19937 rng(9);
  constexpr int64_t kPrompt = 5, kTotal = 6;
  auto x = random_values(rng, kTotal * kHidden);
  auto [want, want_keys] = naive_attention(x, kTotal, f.w, std::vector<bool>(kTotal, true));

  Tensor k_cache = Tensor::zeros(DType::f32, {kLayers, kMaxSeq, kKvHeads, kHeadDim});
  Tensor v_cache = Tensor::zeros(DType::f32, {kLayers, kMaxSeq, kKvHeads, kHeadDim});
  auto prefill =
      f.model.execute({Tensor::from_vector(rows_of(x, 0, kPrompt, kHidden), {kPrompt, kHidden}),
                       Tensor::from_vector(std::vector<int64_t>(kPrompt, 1), {kPrompt}), k_cache, v_cache});
  ASSERT_EQ(prefill[0].shape(), (std::vector<int64_t>{kPrompt, kHidden}));
  auto got = floats(prefill[0]);
  for (int64_t i = 0; i < kPrompt * kHidden; ++i) EXPECT_NEAR(got[i], want[i], 1e-5) << "prefill " << i;

  auto decode =
      f.model.execute({Tensor::from_vector(rows_of(x, kPrompt, kTotal, kHidden), {1, kHidden}),
                       Tensor::from_vector(std::vector<int64_t>(kTotal, 1), {kTotal}), k_cache, v_cache});
  ASSERT_EQ(decode[0].shape(), (std::vector<int64_t>{1, kHidden}));
  got = floats(decode[0]);
  for (int64_t i = 0; i < kHidden; ++i)
    EXPECT_NEAR(got[i], want[kPrompt * kHidden + i], 1e-5) << "decode " << i;

  // The cache holds the rotated keys of layer 1 at rows 0..5; layer 0 and rows past 5 are untouched.
  auto cache = floats(k_cache);
  const int64_t layer_size = kMaxSeq * kKvHeads * kHeadDim, row = kKvHeads * kHeadDim;
  for (int64_t i = 0; i < layer_size; ++i) EXPECT_EQ(cache[i], 0.f) << "layer 0 element " << i;
  for (int64_t i = 0; i < kTotal * row; ++i)
    EXPECT_NEAR(cache[layer_size + i], want_keys[i], 1e-5) << "key " << i;
  for (int64_t i = kTotal * row; i < layer_size; ++i)
    EXPECT_EQ(cache[layer_size + i], 0.f) << "row past total " << i;
}

TEST(AttentionWithRope, ZeroInAttentionMaskHidesThatKey) {
  AttentionFixture f;
  std::mt19937 rng(10);
  constexpr int64_t kSeq = 5;
  auto x = random_values(rng, kSeq * kHidden);
  std::vector<bool> allowed{true, false, true, true, true};
  auto [want, keys] = naive_attention(x, kSeq, f.w, allowed);
  Tensor k_cache = Tensor::zeros(DType::f32, {kLayers, kMaxSeq, kKvHeads, kHeadDim});
  Tensor v_cache = Tensor::zeros(DType::f32, {kLayers, kMaxSeq, kKvHeads, kHeadDim});
  auto out =
      f.model.execute({Tensor::from_vector(x, {kSeq, kHidden}),
                       Tensor::from_vector(std::vector<int64_t>{1, 0, 1, 1, 1}, {kSeq}), k_cache, v_cache});
  auto got = floats(out[0]);
  // Every row skips key 1; row 1 itself attends to key 0 alone.
  for (int64_t i = 0; i < kSeq * kHidden; ++i) EXPECT_NEAR(got[i], want[i], 1e-5) << i;
}

TEST(AttentionWithRope, TotalPastCacheLengthFailsAtExecute) {
  AttentionFixture f;
  Tensor k_cache = Tensor::zeros(DType::f32, {kLayers, kMaxSeq, kKvHeads, kHeadDim});
  Tensor v_cache = Tensor::zeros(DType::f32, {kLayers, kMaxSeq, kKvHeads, kHeadDim});
  EXPECT_ANY_THROW(f.model.execute({Tensor::zeros(DType::f32, {1, kHidden}),
                                    Tensor::from_vector(std::vector<int64_t>(kMaxSeq + 1, 1), {kMaxSeq + 1}),
                                    k_cache, v_cache}));
}

TEST(AttentionWithRope, RejectsLayerIndexOutsideTheCache) {
  nn::RotaryEmbedding rope(kHeadDim, kTheta, kMaxSeq);
  nn::AttentionWithRope attn(/*layer_index=*/kLayers, kHidden, kHeads, kKvHeads, kHeadDim);
  const BufferType cache{DType::f32, {kLayers, kMaxSeq, kKvHeads, kHeadDim}};
  graph::Graph g("bad",
                 {TensorType{DType::f32, {"seq", kHidden}}, TensorType{DType::i64, {"total"}}, cache, cache});
  graph::Graph::Scope scope(g);
  graph::TensorValue x = g.input(0);
  auto ctx = nn::make_attention_context({g.input(2), g.input(3)}, g.input(1), x.shape()[0], rope);
  try {
    attn(x, ctx);
    FAIL() << "expected ShapeError";
  } catch (const ShapeError& e) {
    EXPECT_NE(std::string(e.what()).find("layer 2"), std::string::npos) << e.what();
  }
}

TEST(AttentionWithRope, RejectsHeadsNotAMultipleOfKvHeads) {
  EXPECT_THROW(nn::AttentionWithRope(0, kHidden, 3, 2, kHeadDim), ValueError);
}

}  // namespace
