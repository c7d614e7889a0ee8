// The feed-forward block of a transformer, in its two common forms:
//   swiglu (Llama, Qwen, Mistral): down_proj(silu(gate_proj(x)) * up_proj(x))
//   gelu   (GPT-2, BERT):          down_proj(gelu(up_proj(x)))
// Weight names are Hugging Face's: "gate_proj" (swiglu only), "up_proj", "down_proj", each a Linear.
//
//   auto mlp = std::make_shared<nn::MLP>(4096, 14336, nn::MLPActivation::swiglu);
//   graph::TensorValue y = (*mlp)(x);  // x [..., 4096] -> [..., 4096]
#pragma once

#include <cstdint>
#include <memory>
#include <optional>

#include "kiln/nn/linear.h"
#include "kiln/nn/module.h"

namespace kiln::nn {

enum class MLPActivation {
  swiglu,     // gated SiLU with gate_proj
  gelu,       // exact (erf) GELU
  gelu_tanh,  // tanh-approximated GELU ("gelu_new", "gelu_pytorch_tanh")
};

class MLP : public Module {
 public:
  // `weight_format`: how the projections store their weights, a model-wide choice
  // (model_weight_format in weight_format.h); nullopt: in `dtype`.
  MLP(int64_t hidden_dim, int64_t intermediate_dim, MLPActivation activation = MLPActivation::swiglu,
      DType dtype = DType::f32, bool has_bias = false, DeviceRef device = DeviceRef::CPU(),
      std::optional<WeightFormat> weight_format = std::nullopt);

  // x [..., hidden_dim] -> [..., hidden_dim].
  graph::TensorValue operator()(const graph::TensorValue& x) const;
  Values forward(const std::vector<Values>& args) override;  // one leaf: x

  MLPActivation activation() const { return activation_; }

 private:
  MLPActivation activation_;
  std::shared_ptr<Linear> gate_proj_;  // null unless swiglu
  std::shared_ptr<Linear> up_proj_;
  std::shared_ptr<Linear> down_proj_;
};

}  // namespace kiln::nn
