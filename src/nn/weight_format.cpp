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
    case WeightFormat::q4_0: return "q4_0";
    case WeightFormat::q4_k: return "q4_k";
    case WeightFormat::q5_k: return "q5_k";
    case WeightFormat::q6_k: return "q6_k";
  }
  return "?";
}

WeightFormat parse_weight_format(std::string_view text) {
  for (WeightFormat f : {WeightFormat::f32, WeightFormat::f16, WeightFormat::bf16, WeightFormat::q8_0,
                         WeightFormat::q4_0, WeightFormat::q4_k, WeightFormat::q5_k, WeightFormat::q6_k})
    if (text == weight_format_name(f)) return f;
  throw ValueError(fmt::format(
      "unknown weight format '{}' (expected f32, f16, bf16, q8_0, q4_0, q4_k, q5_k or q6_k)", text));
}

std::optional<DType> weight_format_dtype(WeightFormat f) {
  switch (f) {
    case WeightFormat::f32: return DType::f32;
    case WeightFormat::f16: return DType::f16;
    case WeightFormat::bf16: return DType::bf16;
    default: return std::nullopt;
  }
}

std::optional<graph::QuantizationEncoding> weight_format_encoding(WeightFormat f) {
  switch (f) {
    case WeightFormat::q8_0: return graph::QuantizationEncoding::q8_0;
    case WeightFormat::q4_0: return graph::QuantizationEncoding::q4_0;
    case WeightFormat::q4_k: return graph::QuantizationEncoding::q4_k;
    case WeightFormat::q5_k: return graph::QuantizationEncoding::q5_k;
    case WeightFormat::q6_k: return graph::QuantizationEncoding::q6_k;
    default: return std::nullopt;
  }
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
  const int64_t row_bytes = graph::quantized_row_bytes(*weight_format_encoding(format), cols, what);
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
  const auto encoding = model_format ? weight_format_encoding(*model_format) : std::nullopt;
  if (!encoding || cols % graph::block_size(*encoding) == 0) return model_format;
  return cols % graph::kQ8_0BlockSize == 0 ? WeightFormat::q8_0 : WeightFormat::f16;
}

std::optional<WeightFormat> weight_format_for(std::optional<WeightFormat> model_format,
                                              const WeightFormatMap& exceptions, std::string_view name, int64_t cols) {
  if (auto it = exceptions.find(name); it != exceptions.end()) return it->second;
  return model_weight_format(model_format, cols);
}

WeightFormatMap weight_formats_under(const WeightFormatMap& exceptions, std::string_view prefix) {
  WeightFormatMap out;
  for (auto it = exceptions.lower_bound(prefix); it != exceptions.end() && it->first.starts_with(prefix); ++it)
    out.emplace(it->first.substr(prefix.size()), it->second);
  return out;
}

}  // namespace kiln::nn
