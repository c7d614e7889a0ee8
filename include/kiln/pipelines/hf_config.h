// Hugging Face model directories: config.json for the Llama family (Llama 2/3, TinyLlama, SmolLM,
// Mistral, Qwen2 with attention biases) and generation_config.json.
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
// 'GPT2LMHeadModel' (supported: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM)"), a missing
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
