// A model from one GGUF file: the config from its `{arch}.*` metadata (llama, qwen2, qwen3), read
// and range-checked as a config.json is, and its tensors under Hugging Face's names, so the same
// GenerationEngine runs it. GenerationEngine::from_dir and `kiln generate --model FILE.gguf` use
// these; docs/gguf.md has the keys read and what is refused.
//
//   auto file = pipelines::GGUFFile::open("llama-1B-q8_0.gguf");
//   ModelInfo info = pipelines::gguf_model_info(file);
//   WeightsRegistry weights = pipelines::gguf_weights(file, info, pipelines::gguf_weight_format(file));
#pragma once

#include <filesystem>

#include "kiln/engine/weight_cache.h"
#include "kiln/nn/weight_format.h"
#include "kiln/pipelines/gguf.h"
#include "kiln/pipelines/hf_config.h"

namespace kiln::pipelines {

// The config of the file's model. LoadError naming the file for a missing key, a key of the wrong
// type or an architecture kiln does not run; ValueError naming the key for a value out of range.
ModelInfo gguf_model_info(const GGUFFile& file);

// The weight format kiln computes the file's matrices in by default: that of most of their
// elements (F32, F16, BF16, Q8_0, Q4_0, Q4_K, Q5_K, Q6_K: a Q4_K_M file's is Q4_K); Q8_0 for the
// quantized types kiln does not compute (dequantized and requantized at load).
nn::WeightFormat gguf_weight_format(const GGUFFile& file);

// The matrices (by Hugging Face name) that `format` would compute in another format than the one
// they are stored in, each with its own format, where kiln computes that one: with these as
// LlamaConfig::weight_formats, every such matrix runs as stored (a Q4_K_M file's Q6_K ones in Q6_K).
// GenerationEngine::from_dir uses them when no weight format is asked for.
nn::WeightFormatMap gguf_weight_formats(const GGUFFile& file, nn::WeightFormat format);

// Every tensor under its Hugging Face name, checked first against what `info` implies (names and
// shapes; LoadError naming the GGUF tensor). F32, F16 and BF16 tensors, and block-quantized ones
// that the model computes in their own encoding (`format`, or its fallback for the matrix's row
// length: nn::model_weight_format; or the matrix's own entry in info.config.weight_formats), are
// zero-copy views of the mapping; the rest are dequantized to
// f32 for convert_weights to convert (a Q4_K_M file's Q6_K matrices, under format q4_k, to Q4_K).
// Llama's q/k rows are un-permuted (llama.cpp's converter interleaves them for its RoPE): into an entry
// of `cache` where given (mapped from it when a load has made it already, so no fresh memory), else
// into memory of their own.
WeightsRegistry gguf_weights(const GGUFFile& file, const ModelInfo& info, nn::WeightFormat format,
                             const engine::WeightCache* cache = nullptr);

}  // namespace kiln::pipelines
