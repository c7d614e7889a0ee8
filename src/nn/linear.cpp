#include "kiln/nn/linear.h"

#include "kiln/graph/ops.h"
#include "nn/expect_last_dim.h"

namespace kiln::nn {

namespace ops = graph::ops;

Linear::Linear(int64_t in_dim, int64_t out_dim, DType dtype, bool has_bias, DeviceRef device,
               std::optional<WeightFormat> weight_format)
    : in_dim_(in_dim),
      out_dim_(out_dim),
      weight_format_(resolve_weight_format("Linear", dtype, weight_format)) {
  if (in_dim <= 0 || out_dim <= 0)
    throw ValueError(fmt::format("Linear: dims must be positive, got in {} out {}", in_dim, out_dim));
  const graph::TensorType w = weight_format_ ? weight_type(*weight_format_, out_dim, in_dim, device, "Linear weight")
                                             : graph::TensorType{dtype, {out_dim, in_dim}, device};
  weight_ = register_weight("weight", w.dtype, w.shape, device);
  if (has_bias) bias_ = register_weight("bias", dtype, {out_dim}, device);
}

graph::TensorValue Linear::operator()(const graph::TensorValue& x) const {
  expect_last_dim("Linear", path(), x, in_dim_);
  graph::TensorValue y;
  if (const auto encoding = weight_format_ ? weight_format_encoding(*weight_format_) : std::nullopt)
    y = ops::qmatmul(*encoding, x, weight(weight_));  // [..., out]
  else  // [out, in] -> [in, out]; the compiler folds this transpose into the matmul.
    y = ops::matmul(x, ops::transpose(weight(weight_), 0, 1));  // [..., out]
  if (bias_) y = y + weight(*bias_);
  return y;
}

Values Linear::forward(const std::vector<Values>& args) {
  return Values((*this)(single_tensor_arg("Linear", args)));
}

}  // namespace kiln::nn
