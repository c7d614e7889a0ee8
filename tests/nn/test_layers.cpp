// Each layer built into a graph, run through the engine, and compared with a naive loop written here.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "kiln/graph/ops.h"
#include "kiln/nn/embedding.h"
#include "kiln/nn/linear.h"
#include "kiln/nn/mlp.h"
#include "kiln/nn/norm.h"
#include "layer_test_util.h"

namespace {

using namespace kiln;
using namespace kiln::nn::layer_test;
using graph::TensorType;
using graph::Value;

// y[b, o] = sum_i x[b, i] * w[o, i] + bias[o]  (w in PyTorch's [out, in] layout).
std::vector<double> naive_linear(const std::vector<float>& x, int64_t rows, int64_t in,
                                 const std::vector<float>& w, int64_t out, const std::vector<float>* bias) {
  std::vector<double> y(static_cast<size_t>(rows * out));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t o = 0; o < out; ++o) {
      double acc = bias ? (*bias)[o] : 0.0;
      for (int64_t i = 0; i < in; ++i) acc += double(x[r * in + i]) * w[o * in + i];
      y[r * out + o] = acc;
    }
  return y;
}

template <class A, class B>
void expect_close(const A& got, const B& want, double tol, const char* what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], want[i], tol) << what << " element " << i;
}

// ---- Linear ------------------------------------------------------------------------------------

void check_linear(bool has_bias) {
  constexpr int64_t kIn = 6, kOut = 5, kRows = 3;
  nn::Linear linear(kIn, kOut, DType::f32, has_bias);
  std::mt19937 rng(1);
  auto weights = random_weights(linear, rng);
  auto model = build_model(
      {TensorType{DType::f32, {"rows", kIn}}},
      [&](const std::vector<Value>& in) { return std::vector<Value>{linear(in[0])}; }, weights);
  auto x = random_values(rng, kRows * kIn);
  auto out = model.execute({Tensor::from_vector(x, {kRows, kIn})});
  ASSERT_EQ(out[0].shape(), (std::vector<int64_t>{kRows, kOut}));
  auto w = weights.at("weight").to_vector<float>();
  std::vector<float> b;
  if (has_bias) b = weights.at("bias").to_vector<float>();
  expect_close(floats(out[0]), naive_linear(x, kRows, kIn, w, kOut, has_bias ? &b : nullptr), 1e-5, "linear");
}

TEST(Linear, MatchesNaiveLoopWithBias) { check_linear(true); }
TEST(Linear, MatchesNaiveLoopWithoutBias) { check_linear(false); }

TEST(Linear, DeclaresWeightOutByInAndOptionalBias) {
  nn::Linear with_bias(6, 5, DType::f32, true);
  auto names = with_bias.raw_state_dict();
  ASSERT_EQ(names.size(), 2u);
  EXPECT_EQ(names.at("weight").shape.to_string(), "[5, 6]");
  EXPECT_EQ(names.at("bias").shape.to_string(), "[5]");
  EXPECT_EQ(nn::Linear(6, 5).raw_state_dict().count("bias"), 0u);
}

TEST(Linear, RejectsInputWithWrongLastDim) {
  nn::Linear linear(6, 5);
  graph::Graph g("bad", {TensorType{DType::f32, {3, 7}}});
  graph::Graph::Scope scope(g);
  try {
    linear(g.input(0));
    FAIL() << "expected ShapeError";
  } catch (const ShapeError& e) {
    EXPECT_NE(std::string(e.what()).find("f32[3, 7] must end in dim 6"), std::string::npos) << e.what();
  }
}

// ---- Embedding ---------------------------------------------------------------------------------

template <class Id>
void check_embedding() {
  constexpr int64_t kVocab = 10, kDim = 4;
  nn::Embedding embed(kVocab, kDim);
  std::mt19937 rng(2);
  auto weights = random_weights(embed, rng);
  auto model = build_model(
      {TensorType{dtype_of<Id>(), {"seq"}}},
      [&](const std::vector<Value>& in) { return std::vector<Value>{embed(in[0])}; }, weights);
  std::vector<Id> ids{3, 0, 9, 3};
  auto out = model.execute({Tensor::from_vector(ids, {4})});
  ASSERT_EQ(out[0].shape(), (std::vector<int64_t>{4, kDim}));
  auto table = weights.at("weight").to_vector<float>();
  std::vector<float> want;
  for (Id id : ids)
    for (int64_t d = 0; d < kDim; ++d) want.push_back(table[static_cast<size_t>(id * kDim + d)]);
  expect_close(floats(out[0]), want, 0, "embedding");
}

TEST(Embedding, GathersRowsByI64Ids) { check_embedding<int64_t>(); }
TEST(Embedding, GathersRowsByI32Ids) { check_embedding<int32_t>(); }

TEST(Embedding, IdPastVocabularyFailsAtExecute) {
  nn::Embedding embed(10, 4);
  std::mt19937 rng(2);
  auto weights = random_weights(embed, rng);
  auto model = build_model(
      {TensorType{DType::i64, {"seq"}}},
      [&](const std::vector<Value>& in) { return std::vector<Value>{embed(in[0])}; }, weights);
  try {
    model.execute({Tensor::from_vector(std::vector<int64_t>{3, 10}, {2})});
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("index 10 is out of range"), std::string::npos) << e.what();
  }
}

TEST(Embedding, RejectsFloatIds) {
  nn::Embedding embed(10, 4);
  graph::Graph g("bad", {TensorType{DType::f32, {3}}});
  graph::Graph::Scope scope(g);
  EXPECT_THROW(embed(g.input(0)), DTypeError);
}

// ---- RMSNorm and LayerNorm ---------------------------------------------------------------------

TEST(RMSNorm, MatchesNaiveLoop) {
  constexpr int64_t kRows = 3, kDim = 8;
  constexpr double kEps = 1e-5;
  nn::RMSNorm norm(kDim, kEps);
  std::mt19937 rng(3);
  auto weights = random_weights(norm, rng);
  auto model = build_model(
      {TensorType{DType::f32, {kRows, kDim}}},
      [&](const std::vector<Value>& in) { return std::vector<Value>{norm(in[0])}; }, weights);
  auto x = random_values(rng, kRows * kDim);
  auto w = weights.at("weight").to_vector<float>();
  std::vector<double> want;
  for (int64_t r = 0; r < kRows; ++r) {
    double ss = 0;
    for (int64_t i = 0; i < kDim; ++i) ss += double(x[r * kDim + i]) * x[r * kDim + i];
    double inv = 1 / std::sqrt(ss / kDim + kEps);
    for (int64_t i = 0; i < kDim; ++i) want.push_back(x[r * kDim + i] * inv * w[i]);
  }
  expect_close(floats(model.execute({Tensor::from_vector(x, {kRows, kDim})})[0]), want, 1e-5, "rms_norm");
}

TEST(LayerNorm, MatchesNaiveLoop) {
  constexpr int64_t kRows = 3, kDim = 8;
  constexpr double kEps = 1e-5;
  nn::LayerNorm norm(kDim, kEps);
  std::mt19937 rng(4);
  auto weights = random_weights(norm, rng);
  auto model = build_model(
      {TensorType{DType::f32, {kRows, kDim}}},
      [&](const std::vector<Value>& in) { return std::vector<Value>{norm(in[0])}; }, weights);
  auto x = random_values(rng, kRows * kDim);
  auto w = weights.at("weight").to_vector<float>();
  auto b = weights.at("bias").to_vector<float>();
  std::vector<double> want;
  for (int64_t r = 0; r < kRows; ++r) {
    double mean = 0, var = 0;
    for (int64_t i = 0; i < kDim; ++i) mean += x[r * kDim + i];
    mean /= kDim;
    for (int64_t i = 0; i < kDim; ++i) var += (x[r * kDim + i] - mean) * (x[r * kDim + i] - mean);
    var /= kDim;
    for (int64_t i = 0; i < kDim; ++i)
      want.push_back((x[r * kDim + i] - mean) / std::sqrt(var + kEps) * w[i] + b[i]);
  }
  expect_close(floats(model.execute({Tensor::from_vector(x, {kRows, kDim})})[0]), want, 1e-5, "layer_norm");
}

TEST(RMSNorm, RejectsInputWithWrongLastDim) {
  nn::RMSNorm norm(8);
  graph::Graph g("bad", {TensorType{DType::f32, {3, 4}}});
  graph::Graph::Scope scope(g);
  EXPECT_THROW(norm(g.input(0)), ShapeError);
}

// ---- MLP ---------------------------------------------------------------------------------------

TEST(MLP, SwiGLUMatchesNaiveLoop) {
  constexpr int64_t kRows = 2, kHidden = 6, kInter = 10;
  nn::MLP mlp(kHidden, kInter, nn::MLPActivation::swiglu);
  std::mt19937 rng(5);
  auto weights = random_weights(mlp, rng);
  ASSERT_EQ(weights.size(), 3u);
  auto model = build_model(
      {TensorType{DType::f32, {"rows", kHidden}}},
      [&](const std::vector<Value>& in) { return std::vector<Value>{mlp(in[0])}; }, weights);
  auto x = random_values(rng, kRows * kHidden);
  auto gate =
      naive_linear(x, kRows, kHidden, weights.at("gate_proj.weight").to_vector<float>(), kInter, nullptr);
  auto up = naive_linear(x, kRows, kHidden, weights.at("up_proj.weight").to_vector<float>(), kInter, nullptr);
  std::vector<float> act(gate.size());
  for (size_t i = 0; i < act.size(); ++i)
    act[i] = static_cast<float>(gate[i] / (1 + std::exp(-gate[i])) * up[i]);
  auto want =
      naive_linear(act, kRows, kInter, weights.at("down_proj.weight").to_vector<float>(), kHidden, nullptr);
  expect_close(floats(model.execute({Tensor::from_vector(x, {kRows, kHidden})})[0]), want, 1e-5, "swiglu");
}

TEST(MLP, GeluWithBiasMatchesNaiveLoop) {
  constexpr int64_t kRows = 2, kHidden = 6, kInter = 10;
  nn::MLP mlp(kHidden, kInter, nn::MLPActivation::gelu, DType::f32, /*has_bias=*/true);
  std::mt19937 rng(6);
  auto weights = random_weights(mlp, rng);
  EXPECT_EQ(weights.count("gate_proj.weight"), 0u);
  ASSERT_EQ(weights.size(), 4u);  // up and down, weight and bias each
  auto model = build_model(
      {TensorType{DType::f32, {"rows", kHidden}}},
      [&](const std::vector<Value>& in) { return std::vector<Value>{mlp(in[0])}; }, weights);
  auto x = random_values(rng, kRows * kHidden);
  auto up_b = weights.at("up_proj.bias").to_vector<float>();
  auto down_b = weights.at("down_proj.bias").to_vector<float>();
  auto up = naive_linear(x, kRows, kHidden, weights.at("up_proj.weight").to_vector<float>(), kInter, &up_b);
  std::vector<float> act(up.size());
  for (size_t i = 0; i < act.size(); ++i)
    act[i] = static_cast<float>(0.5 * up[i] * (1 + std::erf(up[i] / std::sqrt(2.0))));
  auto want =
      naive_linear(act, kRows, kInter, weights.at("down_proj.weight").to_vector<float>(), kHidden, &down_b);
  expect_close(floats(model.execute({Tensor::from_vector(x, {kRows, kHidden})})[0]), want, 1e-5, "gelu");
}

}  // namespace
