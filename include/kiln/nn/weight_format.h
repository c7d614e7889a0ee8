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

// The format a layer with `activations` stores its weight in: `requested`, else the innermost
// WeightFormatScope's, else the activations' own (nullopt when no format names that dtype: f64).
// A format other than the activations' needs f32 activations: ValueError naming `layer` otherwise.
// A scope's q8_0 for a weight whose rows (`cols` elements) are not a multiple of 32 gives f16.
std::optional<WeightFormat> resolve_weight_format(std::string_view layer, DType activations,
                                                  std::optional<WeightFormat> requested, int64_t cols);

// Linear and Embedding layers constructed while a scope lives (on this thread) and not given a
// format store their weights in `format`: how nn::Transformer sets the format of the projections its
// attention and MLP layers build. Scopes nest; the innermost wins.
class WeightFormatScope {
 public:
  explicit WeightFormatScope(std::optional<WeightFormat> format);
  ~WeightFormatScope();
  WeightFormatScope(const WeightFormatScope&) = delete;
  WeightFormatScope& operator=(const WeightFormatScope&) = delete;
  static std::optional<WeightFormat> current();

 private:
  std::optional<WeightFormat> previous_;
};

}  // namespace kiln::nn
