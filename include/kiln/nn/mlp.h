// The feed-forward block of a transformer, in its common forms:
//   swiglu     (Llama, Qwen, Mistral, Phi-3): down_proj(silu(gate_proj(x)) * up_proj(x))
//   geglu_tanh (Gemma 2/3):                    down_proj(gelu_tanh(gate_proj(x)) * up_proj(x))
//   gelu       (GPT-2, BERT):                  down_proj(gelu(up_proj(x)))
// Weight names are Hugging Face's: "gate_proj" (gated forms only), "up_proj", "down_proj", each a
// Linear; with fused_gate_up (Phi-3) one "gate_up_proj" [2 * intermediate, hidden] whose first half
// of outputs is the gate and second the up projection.
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
  swiglu,      // gated SiLU with gate_proj
  gelu,        // exact (erf) GELU
  gelu_tanh,   // tanh-approximated GELU ("gelu_new", "gelu_pytorch_tanh")
  geglu_tanh,  // gated tanh-approximated GELU with gate_proj (Gemma's "gelu_pytorch_tanh")
};

constexpr bool is_gated(MLPActivation a) { return a == MLPActivation::swiglu || a == MLPActivation::geglu_tanh; }

class MLP : public Module {
 public:
  // `weight_formats`: how the projections store their weights, a model-wide choice
  // (model_weight_format in weight_format.h) with exceptions by name ("down_proj.weight"); nullopt:
  // in `dtype`.
  MLP(int64_t hidden_dim, int64_t intermediate_dim, MLPActivation activation = MLPActivation::swiglu,
      DType dtype = DType::f32, bool has_bias = false, DeviceRef device = DeviceRef::CPU(),
      const LayerWeightFormats& weight_formats = std::nullopt, bool fused_gate_up = false);

  // x [..., hidden_dim] -> [..., hidden_dim].
  graph::TensorValue operator()(const graph::TensorValue& x) const;
  Values forward(const std::vector<Values>& args) override;  // one leaf: x

  MLPActivation activation() const { return activation_; }

 private:
  MLPActivation activation_;
  int64_t intermediate_dim_;
  std::shared_ptr<Linear> gate_proj_;     // null unless gated and not fused
  std::shared_ptr<Linear> up_proj_;       // null when fused
  std::shared_ptr<Linear> gate_up_proj_;  // null unless fused
  std::shared_ptr<Linear> down_proj_;
};

}  // namespace kiln::nn
