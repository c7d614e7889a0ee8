// Private: load_model_info's parts that the GGUF loader shares (a config built from GGUF metadata is
// read and checked as a config.json is, and its tensors are checked against the same expectations).
#pragma once

#include <cstdint>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "kiln/pipelines/hf_config.h"

namespace kiln::pipelines::detail {

// The most layers a config.json may declare (hf_config.cpp's bounds).
inline constexpr int64_t kMaxLayers = 1024;

// config.json's object as load_model_info reads it (without generation_config.json); `file` names
// it in errors.
ModelInfo model_info_from_json(const nlohmann::json& config, const std::filesystem::path& file);

// One tensor the config implies: its Hugging Face name, why it is expected (the key a message blames
// when it is missing), and per dim the key that sets it and its size.
struct ExpectedTensor {
  std::string name;
  std::string because;  // "num_hidden_layers", "tie_word_embeddings", ...
  std::vector<std::pair<std::string, int64_t>> dims;
};
std::vector<ExpectedTensor> expected_tensors(const nn::LlamaConfig& config);

}  // namespace kiln::pipelines::detail
