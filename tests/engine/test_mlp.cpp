// End to end: a 2-layer MLP built with the public API, compiled, initialised with random weights and
// run for two batch sizes, against a naive loop.
#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "kiln/kiln.h"

namespace {

using namespace kiln;
namespace ops = kiln::graph::ops;

constexpr int64_t kIn = 5, kHidden = 7, kOut = 3;

std::vector<float> random_values(std::mt19937& rng, size_t n) {
  std::uniform_real_distribution<float> dist(-1.f, 1.f);
  std::vector<float> v(n);
  for (auto& e : v) e = dist(rng);
  return v;
}

// y = relu(x @ w1 + b1) @ w2, in plain loops with double accumulation.
std::vector<float> reference_mlp(const std::vector<float>& x, int64_t batch, const std::vector<float>& w1,
                                 const std::vector<float>& b1, const std::vector<float>& w2) {
  std::vector<float> y(static_cast<size_t>(batch * kOut));
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t o = 0; o < kOut; ++o) {
      double acc = 0;
      for (int64_t h = 0; h < kHidden; ++h) {
        double pre = b1[h];
        for (int64_t i = 0; i < kIn; ++i) pre += double(x[b * kIn + i]) * w1[i * kHidden + h];
        acc += std::max(pre, 0.0) * w2[h * kOut + o];
      }
      y[b * kOut + o] = static_cast<float>(acc);
    }
  return y;
}

TEST(Mlp, MatchesNaiveLoopForTwoBatchSizes) {
  graph::Graph g("mlp", {graph::TensorType{DType::f32, {"batch", kIn}}});
  {
    graph::Graph::Scope scope(g);
    graph::TensorValue x = g.input(0);                        // [batch, in]
    auto w1 = g.weight({"w1", DType::f32, {kIn, kHidden}});   // [in, hidden]
    auto b1 = g.weight({"b1", DType::f32, {kHidden}});        // [hidden]
    auto w2 = g.weight({"w2", DType::f32, {kHidden, kOut}});  // [hidden, out]
    g.output({ops::matmul(ops::relu(ops::matmul(x, w1) + b1), w2)});
  }
  std::mt19937 rng(7);
  auto w1 = random_values(rng, kIn * kHidden), b1 = random_values(rng, kHidden),
       w2 = random_values(rng, kHidden * kOut);
  WeightsRegistry weights{{"w1", Tensor::from_vector(w1, {kIn, kHidden})},
                          {"b1", Tensor::from_vector(b1, {kHidden})},
                          {"w2", Tensor::from_vector(w2, {kHidden, kOut})}};
  engine::InferenceSession session({DeviceRef::CPU()});
  engine::Model model = session.load(g, weights);
  EXPECT_EQ(model.name(), "mlp");
  ASSERT_EQ(model.output_metadata().size(), 1u);
  EXPECT_EQ(graph::to_string(model.output_metadata()[0]), "f32[batch, 3]");

  for (int64_t batch : {4, 1, 9}) {
    auto x = random_values(rng, static_cast<size_t>(batch * kIn));
    std::vector<Tensor> out = model.execute({Tensor::from_vector(x, {batch, kIn})});
    ASSERT_EQ(out.size(), 1u);
    EXPECT_EQ(out[0].shape(), (std::vector<int64_t>{batch, kOut}));
    auto got = out[0].to_vector<float>();
    auto want = reference_mlp(x, batch, w1, b1, w2);
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], want[i], 1e-5) << "batch " << batch << " i " << i;
  }
}

TEST(Mlp, ManyThreadsGiveTheSameResultAsOne) {
  // Big enough that the kernels split work across the pool.
  constexpr int64_t kBatch = 64, kDim = 96;
  graph::Graph g("wide", {graph::TensorType{DType::f32, {"batch", kDim}}});
  {
    graph::Graph::Scope scope(g);
    auto w = g.weight({"w", DType::f32, {kDim, kDim}});
    g.output({ops::relu(ops::matmul(g.input(0), w))});
  }
  std::mt19937 rng(3);
  auto w = random_values(rng, kDim * kDim), x = random_values(rng, kBatch * kDim);
  WeightsRegistry weights{{"w", Tensor::from_vector(w, {kDim, kDim})}};
  engine::InferenceSession one({DeviceRef::CPU()}, {}, {.num_threads = 1});
  engine::InferenceSession four({DeviceRef::CPU()}, {}, {.num_threads = 4});
  auto a = one.load(g, weights).execute({Tensor::from_vector(x, {kBatch, kDim})})[0].to_vector<float>();
  auto b = four.load(g, weights).execute({Tensor::from_vector(x, {kBatch, kDim})})[0].to_vector<float>();
  ASSERT_EQ(a.size(), static_cast<size_t>(kBatch * kDim));
  for (size_t i = 0; i < a.size(); ++i) {
    int64_t r = static_cast<int64_t>(i) / kDim, c = static_cast<int64_t>(i) % kDim;
    double acc = 0;
    for (int64_t k = 0; k < kDim; ++k) acc += double(x[r * kDim + k]) * w[k * kDim + c];
    EXPECT_NEAR(a[i], std::max(acc, 0.0), 1e-4);
    EXPECT_NEAR(b[i], a[i], 1e-4);
  }
}

}  // namespace
