#include "kiln/nn/weight_format.h"

#include <fmt/format.h>

#include "kiln/errors.h"
#include "kiln/graph/quantization.h"

namespace kiln::nn {

std::string_view weight_format_name(WeightFormat f) {
  switch (f) {
    case WeightFormat::f32: return "f32";
    case WeightFormat::f16: return "f16";
    case WeightFormat::bf16: return "bf16";
    case WeightFormat::q8_0: return "q8_0";
  }
  return "?";
}

WeightFormat parse_weight_format(std::string_view text) {
  for (WeightFormat f : {WeightFormat::f32, WeightFormat::f16, WeightFormat::bf16, WeightFormat::q8_0})
    if (text == weight_format_name(f)) return f;
  throw ValueError(fmt::format("unknown weight format '{}' (expected f32, f16, bf16 or q8_0)", text));
}

std::optional<DType> weight_format_dtype(WeightFormat f) {
  switch (f) {
    case WeightFormat::f32: return DType::f32;
    case WeightFormat::f16: return DType::f16;
    case WeightFormat::bf16: return DType::bf16;
    case WeightFormat::q8_0: return std::nullopt;
  }
  return std::nullopt;
}

WeightFormat weight_format_of(DType d) {
  switch (d) {
    case DType::f32: return WeightFormat::f32;
    case DType::f16: return WeightFormat::f16;
    case DType::bf16: return WeightFormat::bf16;
    default: break;
  }
  throw ValueError(fmt::format("no weight format stores {} weights (expected f32, f16 or bf16)", dtype_name(d)));
}

graph::TensorType weight_type(WeightFormat format, int64_t rows, int64_t cols, DeviceRef device, std::string_view what) {
  if (auto d = weight_format_dtype(format)) return graph::TensorType{*d, {rows, cols}, device};
  const int64_t row_bytes = graph::quantized_row_bytes(graph::QuantizationEncoding::q8_0, cols, what);
  return graph::TensorType{DType::u8, {rows, row_bytes}, device};
}

std::optional<WeightFormat> resolve_weight_format(std::string_view layer, DType activations,
                                                  std::optional<WeightFormat> requested) {
  const bool plain = activations == DType::f32 || activations == DType::f16 || activations == DType::bf16;
  if (!requested || weight_format_dtype(*requested) == activations)
    return plain ? std::optional(weight_format_of(activations)) : std::nullopt;
  if (activations != DType::f32)
    throw ValueError(fmt::format("{}: weight format {} needs f32 activations, got {}", layer,
                                 weight_format_name(*requested), dtype_name(activations)));
  return requested;
}

std::optional<WeightFormat> model_weight_format(std::optional<WeightFormat> model_format, int64_t cols) {
  if (model_format == std::optional(WeightFormat::q8_0) && cols % 32 != 0) return WeightFormat::f16;
  return model_format;
}

}  // namespace kiln::nn
