// Embedding: rows of a [vocab_size, dim] table picked by integer token ids.
//
//   auto embed = std::make_shared<nn::Embedding>(32000, 4096);
//   graph::TensorValue h = (*embed)(tokens);  // tokens i64[seq] -> f32[seq, 4096]
#pragma once

#include <cstdint>

#include "kiln/nn/module.h"
#include "kiln/nn/weight_format.h"

namespace kiln::nn {

class Embedding : public Module {
 public:
  // Weight: "weight" [vocab_size, dim], stored in `weight_format` as Linear's (linear.h); rows come
  // out in `dtype` (f16/bf16 rows widened, quantized rows dequantized after the gather).
  Embedding(int64_t vocab_size, int64_t dim, DType dtype = DType::f32, DeviceRef device = DeviceRef::CPU(),
            std::optional<WeightFormat> weight_format = std::nullopt);

  // ids (i32 or i64) of any shape [...] -> [..., dim] in `dtype`. Ids must lie in [0, vocab_size).
  graph::TensorValue operator()(const graph::TensorValue& ids) const;
  // One argument, a leaf: the ids.
  Values forward(const std::vector<Values>& args) override;

  // The table as a value of the graph being built (a tied lm_head multiplies by it): as stored, so
  // u8 [vocab_size, row_bytes] when quantized (dim / 32 * 34 for q8_0).
  graph::TensorValue table() const { return weight(weight_); }
  // x [..., dim] times the table's transpose -> [..., vocab_size] (a tied lm_head), in any format.
  graph::TensorValue attend(const graph::TensorValue& x) const;
  std::optional<WeightFormat> weight_format() const { return weight_format_; }
  int64_t vocab_size() const { return vocab_size_; }
  int64_t dim() const { return dim_; }

 private:
  int64_t vocab_size_;
  int64_t dim_;
  DType dtype_;
  std::optional<WeightFormat> weight_format_;
  WeightId weight_;
};

}  // namespace kiln::nn
