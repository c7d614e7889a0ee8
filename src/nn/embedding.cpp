#include "kiln/nn/embedding.h"

#include "kiln/graph/ops.h"
#include "nn/expect_last_dim.h"

namespace kiln::nn {

Embedding::Embedding(int64_t vocab_size, int64_t dim, DType dtype, DeviceRef device)
    : vocab_size_(vocab_size), dim_(dim) {
  if (vocab_size <= 0 || dim <= 0)
    throw ValueError(
        fmt::format("Embedding: vocab_size and dim must be positive, got {} and {}", vocab_size, dim));
  weight_ = register_weight("weight", dtype, {vocab_size, dim}, device);
}

graph::TensorValue Embedding::operator()(const graph::TensorValue& ids) const {
  if (!ids.valid()) throw ValueError(fmt::format("Embedding '{}': ids are an empty value", path()));
  if (ids.dtype() != DType::i32 && ids.dtype() != DType::i64)
    throw DTypeError(
        fmt::format("Embedding '{}': ids must be i32 or i64, got {}", path(), ids.tensor_type().to_string()));
  return graph::ops::gather(table(), ids, 0);  // [..., dim]
}

Values Embedding::forward(const std::vector<Values>& args) {
  return Values((*this)(single_tensor_arg("Embedding", args)));
}

}  // namespace kiln::nn
