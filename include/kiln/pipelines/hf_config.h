// Hugging Face model directories: config.json and generation_config.json of the architectures kiln
// runs, each the one nn::Transformer with a few LlamaConfig fields set (docs/llama.md, Architectures):
//   LlamaForCausalLM    Llama 2/3, TinyLlama, SmolLM (tied embeddings)
//   MistralForCausalLM  sliding-window attention on every layer
//   Qwen2ForCausalLM    q/k/v biases; sliding window from layer max_window_layers on (use_sliding_window)
//   Qwen3ForCausalLM    per-head q/k RMSNorm before RoPE, explicit head_dim; Qwen2's window rule
//   Gemma2ForCausalLM   scaled embeddings, (1 + w) norms, sandwich norms, GeGLU, query_pre_attn_scalar,
//                       attention and final logit soft-capping, alternating sliding/global layers
//   Gemma3ForCausalLM   (model_type gemma3_text) Gemma 2's without soft-capping, q/k norms, local layers
//                       on rope_local_base_freq and every sliding_window_pattern-th layer global
//   Phi3ForCausalLM     fused qkv_proj and gate_up_proj, partial_rotary_factor, sliding window
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "kiln/nn/transformer.h"
#include "kiln/tensor/tensor.h"

namespace kiln::pipelines {

struct ModelInfo {
  nn::LlamaConfig config;
  std::string architecture;  // "LlamaForCausalLM", ...
  std::optional<int64_t> bos_token_id;
  std::vector<int64_t> eos_token_ids;  // config.json's eos_token_id (a number or a list)
};

// Reads DIR/config.json (and DIR/generation_config.json when present, whose ids take precedence).
// LoadError naming the file for a missing/unreadable file or bad JSON; ValueError naming the field for
// an unsupported architecture ("architectures": ["GPT2LMHeadModel"] -> "unsupported architecture
// 'GPT2LMHeadModel' (supported: LlamaForCausalLM, ...)"), a rope_scaling type kiln lacks (Phi-3's
// longrope: "field 'rope_scaling' has rope_type 'longrope', which kiln does not support"), a missing
// required field, or a value of the wrong kind; the torch_dtype field sets config.dtype. Every size is
// range-checked (ValueError "field 'num_hidden_layers' is 1000000000, expected an integer in [1,
// 1024]"), and a key repeated in either file is a LoadError naming it.
ModelInfo load_model_info(const std::filesystem::path& model_dir);

// Checks a checkpoint's tensors (names, shapes, dtypes: no data is read) against the config that
// load_model_info(model_dir) returned, before any graph is built: the embedding, final norm, lm_head
// (unless tied) and every tensor of every layer with the shape the config gives it, and no layer past
// num_hidden_layers. LoadError, one line naming config.json, the key, its value and the tensor:
// "'num_hidden_layers' is 4, but the checkpoint has no tensor 'model.layers.3.mlp.up_proj.weight'".
void check_checkpoint(const ModelInfo& info, const std::filesystem::path& model_dir,
                      const WeightsRegistry& weights);

}  // namespace kiln::pipelines
