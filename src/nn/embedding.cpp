#include "kiln/nn/embedding.h"

#include "kiln/graph/ops.h"
#include "nn/expect_last_dim.h"

namespace kiln::nn {

Embedding::Embedding(int64_t vocab_size, int64_t dim, DType dtype, DeviceRef device,
                     std::optional<WeightFormat> weight_format)
    : vocab_size_(vocab_size),
      dim_(dim),
      dtype_(dtype),
      weight_format_(resolve_weight_format("Embedding", dtype, weight_format)) {
  if (vocab_size <= 0 || dim <= 0)
    throw ValueError(
        fmt::format("Embedding: vocab_size and dim must be positive, got {} and {}", vocab_size, dim));
  const graph::TensorType w = weight_format_ ? weight_type(*weight_format_, vocab_size, dim, device, "Embedding weight")
                                             : graph::TensorType{dtype, {vocab_size, dim}, device};
  weight_ = register_weight("weight", w.dtype, w.shape, device);
}

graph::TensorValue Embedding::operator()(const graph::TensorValue& ids) const {
  if (!ids.valid()) throw ValueError(fmt::format("Embedding '{}': ids are an empty value", path()));
  if (ids.dtype() != DType::i32 && ids.dtype() != DType::i64)
    throw DTypeError(
        fmt::format("Embedding '{}': ids must be i32 or i64, got {}", path(), ids.tensor_type().to_string()));
  graph::TensorValue rows = graph::ops::gather(table(), ids, 0);  // [..., dim] (quantized: [..., row_bytes])
  if (const auto encoding = weight_format_ ? weight_format_encoding(*weight_format_) : std::nullopt)
    rows = graph::ops::dequantize(*encoding, rows);
  return rows.dtype() == dtype_ ? rows : graph::ops::cast(rows, dtype_);
}

graph::TensorValue Embedding::attend(const graph::TensorValue& x) const {
  if (const auto encoding = weight_format_ ? weight_format_encoding(*weight_format_) : std::nullopt)
    return graph::ops::qmatmul(*encoding, x, table());                 // [..., vocab]
  return graph::ops::matmul(x, graph::ops::transpose(table(), 0, 1));           // [..., vocab]
}

Values Embedding::forward(const std::vector<Values>& args) {
  return Values((*this)(single_tensor_arg("Embedding", args)));
}

}  // namespace kiln::nn
