// How a layer stores a weight matrix, independently of its activations' dtype: f32, f16 or bf16
// elements (multiplied by f32 activations without widening the tensor first), or Q8_0 blocks (a u8
// [rows, cols / 32 * 34] tensor in GGUF's block layout, kiln/graph/quantization.h). Weight names stay
// Hugging Face's; docs/quantization.md has the accuracy of each format.
//
//   auto proj = std::make_shared<nn::Linear>(4096, 4096, DType::f32, false, DeviceRef::CPU(), nn::WeightFormat::q8_0);
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>

#include "kiln/graph/types.h"

namespace kiln::nn {

enum class WeightFormat : uint8_t { f32, f16, bf16, q8_0 };

std::string_view weight_format_name(WeightFormat);      // "f32", "f16", "bf16", "q8_0"
WeightFormat parse_weight_format(std::string_view);     // ValueError naming the text and the choices
std::optional<DType> weight_format_dtype(WeightFormat);  // the element dtype; nullopt for q8_0
WeightFormat weight_format_of(DType);                    // f32/f16/bf16; ValueError for other dtypes

// The declared dtype and shape of a [rows, cols] weight stored in `format`; for q8_0, u8
// [rows, cols / 32 * 34], and a ValueError naming `what` when cols is not a multiple of 32.
graph::TensorType weight_type(WeightFormat format, int64_t rows, int64_t cols, DeviceRef device,
                              std::string_view what);

// The format a layer with `activations` stores its weight in: `requested`, else the activations' own
// (nullopt when no format names that dtype: f64). A format other than the activations' needs f32
// activations: ValueError naming `layer` otherwise.
std::optional<WeightFormat> resolve_weight_format(std::string_view layer, DType activations,
                                                  std::optional<WeightFormat> requested);

// The format a model-wide choice (LlamaConfig::weight_format, the `weight_format` of MLP and
// AttentionWithRope) gives one of its weight matrices, whose rows have `cols` elements:
// `model_format`, except that q8_0 gives f16 where cols is not a multiple of 32 (as llama.cpp's
// quantizer falls back per tensor). Asking one Linear for q8_0 directly stays an error there.
std::optional<WeightFormat> model_weight_format(std::optional<WeightFormat> model_format, int64_t cols);

}  // namespace kiln::nn
