// Converting checkpoint tensors at init to the weight formats a traced graph declares: f32, f16 and
// bf16 tensors cast to another of those dtypes, or quantized to GGUF block rows (u8 [rows, row_bytes],
// kiln/graph/quantization.h) where the graph declares a u8 weight for a float [rows, cols] tensor.
//
//   nn::LlamaConfig config = ...;  config.weight_format = nn::WeightFormat::q4_k;
//   auto model = std::make_shared<nn::Transformer>(config);
//   WeightsRegistry weights = pipelines::convert_weights(checkpoint, model->raw_state_dict(), 0,
//                                                        graph::QuantizationEncoding::q4_k);
#pragma once

#include <map>
#include <optional>
#include <string>

#include "kiln/engine/weight_cache.h"
#include "kiln/tensor/tensor.h"
#include "kiln/graph/graph.h"
#include "kiln/graph/quantization.h"

namespace kiln::pipelines {

// For each declared weight, the checkpoint tensor of that name converted to the declaration: passed
// through unchanged when dtype and shape already match; cast (round to nearest even) between f32,
// f16 and bf16; quantized row by row (graph::quantize_row) for a u8 declaration [rows, row_bytes] of
// a float [rows, cols] tensor, in the encoding whose rows of cols weights are row_bytes long:
// `encoding` where it fits (the model's format), else the only one that does (a fallback tensor's
// q8_0). Q4_0 and Q4_K rows have the same size, so a declaration both fit needs `encoding`.
// `encodings` overrides `encoding` per weight, by name (a model whose matrices mix encodings,
// LlamaConfig::weight_formats).
// Converted tensors are new memory, filled by `threads` threads (0: std::thread::hardware_concurrency()).
// Checkpoint names that nothing declares are kept as they are.
// A tensor mapped from a file converts to bytes that name their source (the file's bytes and the
// conversion), so the copies kernels pack from them are kept in the packed-weight cache as a file's
// own bytes are; with `cache`, the converted bytes are an entry of it too: a later load of the same
// file maps them instead of converting (or reading the file) again. Pages of the file read to convert
// and of the entries written or checked are dropped from the process at once (they stay in the page
// cache): what a load holds is what kernels then read, not the checkpoint and every copy of it.
// ValueError naming the weight for a missing tensor, a shape that does not match, an ambiguous or
// unfitting u8 declaration, or a conversion other than these.
WeightsRegistry convert_weights(const WeightsRegistry& checkpoint,
                                const std::map<std::string, graph::Weight>& declared, int threads = 0,
                                std::optional<graph::QuantizationEncoding> encoding = std::nullopt,
                                const std::map<std::string, graph::QuantizationEncoding, std::less<>>& encodings = {},
                                const engine::WeightCache* cache = nullptr);

}  // namespace kiln::pipelines
