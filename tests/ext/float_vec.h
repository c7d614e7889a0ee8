// A DLTensor over a contiguous float vector of shape [n], for calling extension kernels directly.
#pragma once

#include <cstdint>
#include <vector>

#include <dlpack/dlpack.h>

namespace kiln::testing {

struct FloatVec {
  std::vector<float> data;
  int64_t shape[1];
  int64_t strides[1] = {1};
  explicit FloatVec(std::vector<float> values) : data(std::move(values)), shape{static_cast<int64_t>(data.size())} {}
  DLTensor tensor() {
    DLTensor t{};
    t.data = data.data();
    t.device = {kDLCPU, 0};
    t.ndim = 1;
    t.dtype = {kDLFloat, 32, 1};
    t.shape = shape;
    t.strides = strides;
    return t;
  }
};

}  // namespace kiln::testing
