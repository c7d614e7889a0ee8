// Kernel tests: the elements of any (strided) view, read in row-major order of its shape as doubles,
// for reference loops that must not share code with the kernels.
#pragma once

#include <type_traits>
#include <vector>

#include "kernels/cpu/kernels.h"

namespace kiln::kernels::kernel_test {

inline std::vector<double> logical_values(const TensorView& v) {
  std::vector<double> out;
  const int64_t n = v.numel();
  std::vector<int64_t> index(v.shape.size(), 0);
  for (int64_t i = 0; i < n; ++i) {
    int64_t offset = 0;
    for (size_t d = 0; d < index.size(); ++d) offset += index[d] * v.strides[d];
    out.push_back(visit_dtype(v.dtype, [&]<class T>() {
      const T x = v.as<T>()[offset];
      if constexpr (std::is_same_v<T, f16_t> || std::is_same_v<T, bf16_t>)
        return static_cast<double>(static_cast<float>(x));
      else
        return static_cast<double>(x);
    }));
    for (size_t d = index.size(); d-- > 0;) {  // odometer step
      if (++index[d] < v.shape[d]) break;
      index[d] = 0;
    }
  }
  return out;
}

}  // namespace kiln::kernels::kernel_test
