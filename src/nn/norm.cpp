#include "kiln/nn/norm.h"

#include "kiln/graph/ops.h"
#include "nn/expect_last_dim.h"

namespace kiln::nn {

namespace ops = graph::ops;

RMSNorm::RMSNorm(int64_t dim, double eps, DType dtype, DeviceRef device, bool unit_offset)
    : dim_(dim), eps_(eps), unit_offset_(unit_offset) {
  if (dim <= 0) throw ValueError(fmt::format("RMSNorm: dim must be positive, got {}", dim));
  if (!(eps >= 0)) throw ValueError(fmt::format("RMSNorm: eps must be >= 0, got {}", eps));
  weight_ = register_weight("weight", dtype, {dim}, device);
}

graph::TensorValue RMSNorm::operator()(const graph::TensorValue& x) const {
  expect_last_dim("RMSNorm", path(), x, dim_);
  if (unit_offset_) return ops::rms_norm(x, weight(weight_) + 1.0, eps_);
  return ops::rms_norm(x, weight(weight_), eps_);
}

Values RMSNorm::forward(const std::vector<Values>& args) {
  return Values((*this)(single_tensor_arg("RMSNorm", args)));
}

LayerNorm::LayerNorm(int64_t dim, double eps, DType dtype, DeviceRef device) : dim_(dim), eps_(eps) {
  if (dim <= 0) throw ValueError(fmt::format("LayerNorm: dim must be positive, got {}", dim));
  if (!(eps >= 0)) throw ValueError(fmt::format("LayerNorm: eps must be >= 0, got {}", eps));
  weight_ = register_weight("weight", dtype, {dim}, device);
  bias_ = register_weight("bias", dtype, {dim}, device);
}

graph::TensorValue LayerNorm::operator()(const graph::TensorValue& x) const {
  expect_last_dim("LayerNorm", path(), x, dim_);
  return ops::layer_norm(x, weight(weight_), weight(bias_), eps_);
}

Values LayerNorm::forward(const std::vector<Values>& args) {
  return Values((*this)(single_tensor_arg("LayerNorm", args)));
}

}  // namespace kiln::nn
