// Hugging Face model directories: config.json for the Llama family (Llama 2/3, TinyLlama, SmolLM,
// Mistral, Qwen2 with attention biases) and generation_config.json.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "kiln/nn/transformer.h"

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
// required field, or a value of the wrong kind; the torch_dtype field sets config.dtype.
ModelInfo load_model_info(const std::filesystem::path& model_dir);

}  // namespace kiln::pipelines
