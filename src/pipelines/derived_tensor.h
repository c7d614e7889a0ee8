// Private to pipelines: tensors computed at load from a mapped file's bytes alone (a GGUF q/k weight
// with its rows un-permuted, a checkpoint weight converted to another dtype), kept where a file's own
// bytes would be: they name their source (DerivedBytes), so what kernels pack from them is cached as
// a file's bytes are, and with a weight cache they are entries of it themselves.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "kiln/engine/weight_cache.h"
#include "kiln/tensor/tensor.h"

namespace kiln::pipelines {

struct DerivedTensor {
  Tensor tensor;        // write the bytes here unless `filled`
  bool filled = false;  // the cache held them: read only, nothing to compute
  std::function<void()> commit;
  // Once the bytes are written (or found): the entry stored, and the process's pages of it and of
  // `from` (read to compute it) left to the page cache, so a load holds what kernels then read rather
  // than the file and every copy of it. Returns the tensor.
  Tensor finish(const Tensor& from);
};

// `dtype[shape]` computed from `from` by `computation` (its words name the result: "rows unpermuted
// in 8 heads"). Where `from` is no mapped file's bytes, plain memory that names no source.
DerivedTensor derived_tensor(const Tensor& from, const std::string& computation, DType dtype,
                             const std::vector<int64_t>& shape, const engine::WeightCache* cache);

}  // namespace kiln::pipelines
