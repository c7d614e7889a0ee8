// How a layer stores a weight matrix, independently of its activations' dtype: f32, f16 or bf16
// elements (multiplied by f32 activations without widening the tensor first), or GGUF's quantized
// blocks q8_0, q4_0, q4_k, q5_k, q6_k (a u8 [rows, row_bytes] tensor, kiln/graph/quantization.h).
// Weight names stay Hugging Face's; docs/quantization.md has the accuracy of each format.
//
//   auto proj = std::make_shared<nn::Linear>(4096, 4096, DType::f32, false, DeviceRef::CPU(), nn::WeightFormat::q8_0);
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>

#include "kiln/graph/quantization.h"
#include "kiln/graph/types.h"

namespace kiln::nn {

enum class WeightFormat : uint8_t { f32, f16, bf16, q8_0, q4_0, q4_k, q5_k, q6_k };

std::string_view weight_format_name(WeightFormat);      // "f32", "f16", "bf16", "q8_0", "q4_k", ...
WeightFormat parse_weight_format(std::string_view);     // ValueError naming the text and the choices
std::optional<DType> weight_format_dtype(WeightFormat);  // the element dtype; nullopt when quantized
// The block encoding of a quantized format; nullopt for f32 / f16 / bf16.
std::optional<graph::QuantizationEncoding> weight_format_encoding(WeightFormat);
WeightFormat weight_format_of(DType);                    // f32/f16/bf16; ValueError for other dtypes

// The declared dtype and shape of a [rows, cols] weight stored in `format`; quantized, u8
// [rows, quantized_row_bytes(encoding, cols)], and a ValueError naming `what` when cols is not a
// multiple of the block size (32, or 256 for the K-quants).
graph::TensorType weight_type(WeightFormat format, int64_t rows, int64_t cols, DeviceRef device,
                              std::string_view what);

// The format a layer with `activations` stores its weight in: `requested`, else the activations' own
// (nullopt when no format names that dtype: f64). A format other than the activations' needs f32
// activations: ValueError naming `layer` otherwise.
std::optional<WeightFormat> resolve_weight_format(std::string_view layer, DType activations,
                                                  std::optional<WeightFormat> requested);

// The format a model-wide choice (LlamaConfig::weight_format, the `weight_format` of MLP and
// AttentionWithRope) gives one of its weight matrices, whose rows have `cols` elements:
// `model_format`, except where cols is not a multiple of its block size, as llama.cpp's quantizer
// falls back per tensor: q4_k, q5_k and q6_k give q8_0 (llama.cpp: q5_0, q5_1, q8_0; kiln has
// q8_0 of these, which is at least as precise) where cols is a multiple of 32, and every quantized
// format gives f16 where it is not. Asking one Linear for a format its in_dim does not fit stays an
// error there.
std::optional<WeightFormat> model_weight_format(std::optional<WeightFormat> model_format, int64_t cols);

// Per-weight exceptions to a model-wide format, by weight name: how a GGUF Q4_K_M file keeps some
// matrices in Q6_K (MAX's per-weight quantization_encoding). Keys are full Hugging Face names
// ("model.layers.3.mlp.down_proj.weight") in LlamaConfig, names within the layer ("down_proj.weight")
// in LayerWeightFormats.
using WeightFormatMap = std::map<std::string, WeightFormat, std::less<>>;

// The format of weight `name` (a [rows, cols] matrix): its exception, else model_weight_format.
std::optional<WeightFormat> weight_format_for(std::optional<WeightFormat> model_format,
                                              const WeightFormatMap& exceptions, std::string_view name, int64_t cols);

// The exceptions whose names start with `prefix` ("model.layers.3.mlp."), without the prefix.
WeightFormatMap weight_formats_under(const WeightFormatMap& exceptions, std::string_view prefix);

// How a layer (MLP, AttentionWithRope) stores its weight matrices: one model-wide format, with
// per-weight exceptions. Converts from a single format, so `WeightFormat::q8_0` or `std::nullopt`
// (the layer's dtype) can be passed where a layer takes one.
struct LayerWeightFormats {
  std::optional<WeightFormat> model;
  WeightFormatMap exceptions;  // by the weight's name within the layer

  LayerWeightFormats(std::optional<WeightFormat> model_format = std::nullopt, WeightFormatMap by_name = {})
      : model(model_format), exceptions(std::move(by_name)) {}
  LayerWeightFormats(WeightFormat model_format) : model(model_format) {}   // NOLINT: implicit by design
  LayerWeightFormats(std::nullopt_t) {}                                    // NOLINT: implicit by design
  std::optional<WeightFormat> of(std::string_view name, int64_t cols) const {
    return weight_format_for(model, exceptions, name, cols);
  }
};

}  // namespace kiln::nn
