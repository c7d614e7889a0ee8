// Converting checkpoint tensors at init to the weight formats a traced graph declares: f32, f16 and
// bf16 tensors cast to another of those dtypes, or quantized to Q8_0 rows (u8 [rows, cols / 32 * 34],
// kiln/graph/quantization.h) where the graph declares a u8 weight for a float [rows, cols] tensor.
//
//   nn::LlamaConfig config = ...;  config.weight_format = nn::WeightFormat::q8_0;
//   auto model = std::make_shared<nn::Transformer>(config);
//   WeightsRegistry weights = pipelines::convert_weights(checkpoint, model->raw_state_dict());
#pragma once

#include <map>
#include <string>

#include "kiln/tensor/tensor.h"
#include "kiln/graph/graph.h"

namespace kiln::pipelines {

// For each declared weight, the checkpoint tensor of that name converted to the declaration: passed
// through unchanged when dtype and shape already match; cast (round to nearest even) between f32,
// f16 and bf16; quantized row by row to Q8_0 for a u8 declaration [rows, row_bytes] of a float
// [rows, cols] tensor (row_bytes == cols / 32 * 34). Converted tensors are new (anonymous) memory,
// filled by `threads` threads (0: std::thread::hardware_concurrency()). Checkpoint names that nothing
// declares are kept as they are. ValueError naming the weight for a missing tensor, a shape that does
// not match, or a conversion other than these.
WeightsRegistry convert_weights(const WeightsRegistry& checkpoint,
                                const std::map<std::string, graph::Weight>& declared, int threads = 0);

}  // namespace kiln::pipelines
