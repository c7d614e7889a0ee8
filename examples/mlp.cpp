// Builds a 2-layer MLP graph over a symbolic batch, compiles it, binds weights and runs it, then checks
// the result against a plain loop. The main job of kiln until the text-generation pipeline lands.
#include <cmath>
#include <cstdio>
#include <iostream>
#include <random>

#include <kiln/kiln.h>

using namespace kiln;
namespace ops = kiln::graph::ops;

int main() {
  constexpr int64_t kIn = 8, kHidden = 16, kOut = 4, kBatch = 3;

  // 1. The graph: y = relu(x @ w1 + b1) @ w2, for any batch size.
  graph::Graph g("mlp", {graph::TensorType{DType::f32, {"batch", kIn}}});
  {
    graph::Graph::Scope scope(g);
    graph::TensorValue x = g.input(0);                          // [batch, in]
    auto w1 = g.weight({"w1", DType::f32, {kIn, kHidden}});     // [in, hidden]
    auto b1 = g.weight({"b1", DType::f32, {kHidden}});          // [hidden]
    auto w2 = g.weight({"w2", DType::f32, {kHidden, kOut}});    // [hidden, out]
    g.output({ops::matmul(ops::relu(ops::matmul(x, w1) + b1), w2)});
  }
  std::cout << g.to_string() << "\n";

  // 2. Weights (seeded random) and a batch of inputs.
  std::mt19937 rng(42);
  std::normal_distribution<float> normal(0.f, 0.5f);
  auto random_vector = [&](size_t n) {
    std::vector<float> v(n);
    for (auto& e : v) e = normal(rng);
    return v;
  };
  auto w1 = random_vector(kIn * kHidden), b1 = random_vector(kHidden);
  auto w2 = random_vector(kHidden * kOut), x = random_vector(kBatch * kIn);
  WeightsRegistry weights{{"w1", Tensor::from_vector(w1, {kIn, kHidden})},
                          {"b1", Tensor::from_vector(b1, {kHidden})},
                          {"w2", Tensor::from_vector(w2, {kHidden, kOut})}};

  // 3. Compile, bind, run.
  engine::InferenceSession session({DeviceRef::CPU()});
  engine::Model model = session.load(g, weights);
  std::vector<Tensor> out = model.execute({Tensor::from_vector(x, {kBatch, kIn})});
  std::vector<float> y = out.at(0).to_vector<float>();

  // 4. Print, and check against a plain loop.
  double max_error = 0;
  std::cout << "output " << out[0].to_string() << ":\n";
  for (int64_t b = 0; b < kBatch; ++b) {
    for (int64_t o = 0; o < kOut; ++o) {
      double acc = 0;
      for (int64_t h = 0; h < kHidden; ++h) {
        double pre = b1[h];
        for (int64_t i = 0; i < kIn; ++i) pre += double(x[b * kIn + i]) * w1[i * kHidden + h];
        acc += std::max(pre, 0.0) * w2[h * kOut + o];
      }
      max_error = std::max(max_error, std::abs(acc - y[b * kOut + o]));
      std::printf("%10.5f", y[b * kOut + o]);
    }
    std::printf("\n");
  }
  std::printf("max |kiln - reference| = %.2e\n", max_error);
  return max_error < 1e-4 ? 0 : 1;
}
