// Embedding: rows of a [vocab_size, dim] table picked by integer token ids.
//
//   auto embed = std::make_shared<nn::Embedding>(32000, 4096);
//   graph::TensorValue h = (*embed)(tokens);  // tokens i64[seq] -> f32[seq, 4096]
#pragma once

#include <cstdint>

#include "kiln/nn/module.h"

namespace kiln::nn {

class Embedding : public Module {
 public:
  // Weight: "weight" [vocab_size, dim].
  Embedding(int64_t vocab_size, int64_t dim, DType dtype = DType::f32, DeviceRef device = DeviceRef::CPU());

  // ids (i32 or i64) of any shape [...] -> [..., dim]. Ids must lie in [0, vocab_size).
  graph::TensorValue operator()(const graph::TensorValue& ids) const;
  // One argument, a leaf: the ids.
  Values forward(const std::vector<Values>& args) override;

  // The table as a value of the graph being built (a tied lm_head multiplies by it).
  graph::TensorValue table() const { return weight(weight_); }
  int64_t vocab_size() const { return vocab_size_; }
  int64_t dim() const { return dim_; }

 private:
  int64_t vocab_size_;
  int64_t dim_;
  WeightId weight_;
};

}  // namespace kiln::nn
