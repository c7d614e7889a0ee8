// Linear: y = x @ weight^T + bias, with Hugging Face / PyTorch's weight layout [out, in].
//
//   auto proj = std::make_shared<nn::Linear>(64, 128, DType::f32, /*has_bias=*/true);
//   graph::TensorValue y = (*proj)(x);  // x [..., 64] -> y [..., 128]
#pragma once

#include <cstdint>

#include "kiln/nn/module.h"
#include "kiln/nn/weight_format.h"

namespace kiln::nn {

class Linear : public Module {
 public:
  // Weights: "weight" [out_dim, in_dim] and, with has_bias, "bias" [out_dim] (in `dtype`). The
  // weight is stored in `weight_format` (weight_format.h); without one, in `dtype`. A format other
  // than `dtype`'s needs f32 activations (ValueError otherwise), and a quantized one an in_dim that
  // is a multiple of its block size (32; 256 for q4_k, q5_k, q6_k).
  Linear(int64_t in_dim, int64_t out_dim, DType dtype = DType::f32, bool has_bias = false,
         DeviceRef device = DeviceRef::CPU(), std::optional<WeightFormat> weight_format = std::nullopt);

  // x [..., in_dim] -> [..., out_dim]. ShapeError naming the layer if x's last dim is not in_dim.
  graph::TensorValue operator()(const graph::TensorValue& x) const;
  // One argument, a leaf: x.
  Values forward(const std::vector<Values>& args) override;

  int64_t in_dim() const { return in_dim_; }
  int64_t out_dim() const { return out_dim_; }
  bool has_bias() const { return bias_.has_value(); }
  // nullopt: the weight has the activations' dtype, which no WeightFormat names (f64).
  std::optional<WeightFormat> weight_format() const { return weight_format_; }

 private:
  int64_t in_dim_;
  int64_t out_dim_;
  std::optional<WeightFormat> weight_format_;
  WeightId weight_;
  std::optional<WeightId> bias_;
};

}  // namespace kiln::nn
