// Layer tests: build a graph around a layer, fill its weights, run it through the engine.
#pragma once

#include <functional>
#include <random>
#include <string>
#include <vector>

#include "kiln/engine/session.h"
#include "kiln/graph/graph.h"
#include "kiln/nn/module.h"

namespace kiln::nn::layer_test {

// Uniform values in [-1, 1).
inline std::vector<float> random_values(std::mt19937& rng, size_t n, float scale = 1.f) {
  std::uniform_real_distribution<float> dist(-scale, scale);
  std::vector<float> v(n);
  for (auto& e : v) e = dist(rng);
  return v;
}

// Random data for every weight of `module`, by fully qualified name.
inline WeightsRegistry random_weights(const Module& module, std::mt19937& rng, float scale = 0.5f) {
  WeightsRegistry out;
  for (const auto& [name, w] : module.raw_state_dict()) {
    auto shape = w.shape.static_dims();
    size_t n = 1;
    for (auto d : shape) n *= static_cast<size_t>(d);
    out.emplace(name, Tensor::from_vector(random_values(rng, n, scale), shape));
  }
  return out;
}

// A graph with `input_types` whose outputs are what `build` returns from its inputs, compiled and
// initialised with `weights`.
inline engine::Model build_model(
    const std::vector<graph::Type>& input_types,
    const std::function<std::vector<graph::Value>(const std::vector<graph::Value>&)>& build,
    const WeightsRegistry& weights) {
  graph::Graph g("layer", input_types);
  {
    graph::Graph::Scope scope(g);
    g.output(build(g.inputs()));
  }
  engine::InferenceSession session({DeviceRef::CPU()});
  return session.load(g, weights);
}

inline std::vector<float> floats(const Tensor& t) { return t.to_vector<float>(); }

}  // namespace kiln::nn::layer_test
