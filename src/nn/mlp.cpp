#include "kiln/nn/mlp.h"

#include "kiln/graph/ops.h"
#include "nn/expect_last_dim.h"

namespace kiln::nn {

namespace ops = graph::ops;

MLP::MLP(int64_t hidden_dim, int64_t intermediate_dim, MLPActivation activation, DType dtype, bool has_bias,
         DeviceRef device, const LayerWeightFormats& formats, bool fused_gate_up)
    : activation_(activation), intermediate_dim_(intermediate_dim) {
  if (fused_gate_up && !is_gated(activation))
    throw ValueError("MLP: fused_gate_up needs a gated activation (swiglu or geglu_tanh)");
  if (fused_gate_up) {
    gate_up_proj_ = register_module(
        "gate_up_proj", std::make_shared<Linear>(hidden_dim, 2 * intermediate_dim, dtype, has_bias, device,
                                                 formats.of("gate_up_proj.weight", hidden_dim)));
  } else {
    if (is_gated(activation))
      gate_proj_ = register_module("gate_proj",
                                   std::make_shared<Linear>(hidden_dim, intermediate_dim, dtype, has_bias, device,
                                                            formats.of("gate_proj.weight", hidden_dim)));
    up_proj_ = register_module("up_proj", std::make_shared<Linear>(hidden_dim, intermediate_dim, dtype, has_bias,
                                                                   device, formats.of("up_proj.weight", hidden_dim)));
  }
  down_proj_ = register_module(
      "down_proj", std::make_shared<Linear>(intermediate_dim, hidden_dim, dtype, has_bias, device,
                                            formats.of("down_proj.weight", intermediate_dim)));
}

graph::TensorValue MLP::operator()(const graph::TensorValue& x) const {
  graph::TensorValue gate, up;  // [..., intermediate]
  if (gate_up_proj_) {
    graph::TensorValue both = (*gate_up_proj_)(x);  // [..., 2 * intermediate]
    auto halves = ops::split(both, {intermediate_dim_, intermediate_dim_}, both.rank() - 1);
    gate = halves[0];
    up = halves[1];
  } else if (gate_proj_) {
    gate = (*gate_proj_)(x);
    up = (*up_proj_)(x);
  }
  switch (activation_) {
    case MLPActivation::swiglu:
      return (*down_proj_)(ops::silu(gate) * up);
    case MLPActivation::geglu_tanh:
      return (*down_proj_)(ops::gelu(gate, /*tanh_approximation=*/true) * up);
    case MLPActivation::gelu:
      return (*down_proj_)(ops::gelu((*up_proj_)(x), /*tanh_approximation=*/false));
    case MLPActivation::gelu_tanh:
      return (*down_proj_)(ops::gelu((*up_proj_)(x), /*tanh_approximation=*/true));
  }
  throw ValueError(fmt::format("MLP '{}': unknown activation {}", path(), static_cast<int>(activation_)));
}

Values MLP::forward(const std::vector<Values>& args) {
  return Values((*this)(single_tensor_arg("MLP", args)));
}

}  // namespace kiln::nn
