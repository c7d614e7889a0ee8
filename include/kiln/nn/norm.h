// Normalization layers over the last axis: RMSNorm (Llama) and LayerNorm (GPT-2, BERT).
//
//   auto norm = std::make_shared<nn::RMSNorm>(4096, 1e-5);
//   graph::TensorValue y = (*norm)(x);  // x [..., 4096] -> same shape
#pragma once

#include <cstdint>

#include "kiln/nn/module.h"

namespace kiln::nn {

// x / sqrt(mean(x^2) + eps) * weight. Weight: "weight" [dim]. With unit_offset (Gemma's RMSNorm,
// whose checkpoints store weight - 1) the scale is (1 + weight).
class RMSNorm : public Module {
 public:
  explicit RMSNorm(int64_t dim, double eps = 1e-6, DType dtype = DType::f32,
                   DeviceRef device = DeviceRef::CPU(), bool unit_offset = false);
  // x [..., dim] -> [..., dim]; ShapeError naming the layer if the last dim is not dim.
  graph::TensorValue operator()(const graph::TensorValue& x) const;
  Values forward(const std::vector<Values>& args) override;  // one leaf: x

  int64_t dim() const { return dim_; }
  double eps() const { return eps_; }
  bool unit_offset() const { return unit_offset_; }

 private:
  int64_t dim_;
  double eps_;
  bool unit_offset_;
  WeightId weight_;
};

// (x - mean) / sqrt(var + eps) * weight + bias. Weights: "weight" [dim], "bias" [dim].
class LayerNorm : public Module {
 public:
  explicit LayerNorm(int64_t dim, double eps = 1e-5, DType dtype = DType::f32,
                     DeviceRef device = DeviceRef::CPU());
  graph::TensorValue operator()(const graph::TensorValue& x) const;
  Values forward(const std::vector<Values>& args) override;  // one leaf: x

  int64_t dim() const { return dim_; }
  double eps() const { return eps_; }

 private:
  int64_t dim_;
  double eps_;
  WeightId weight_;
  WeightId bias_;
};

}  // namespace kiln::nn
