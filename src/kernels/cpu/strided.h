// Private: walking strided, broadcast operands in row-major order of an output shape, and the
// dtype-agnostic strided copy built on it. Shared by the CPU kernels.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <span>
#include <vector>

#include "kernels/cpu/kernels.h"

namespace kiln::kernels {

// Elements per parallel chunk for cheap per-element work (copies, arithmetic).
inline constexpr int64_t kElementwiseGrain = 16 * 1024;

// Runs fn(begin, end) over [0, n) through ctx.parallel when there is one, else on this thread.
template <class Fn>
void parallel_for(const KernelContext& ctx, int64_t n, int64_t grain, Fn&& fn) {
  if (n <= 0) return;
  if (ctx.parallel == nullptr || n <= grain) {
    fn(int64_t{0}, n);
    return;
  }
  ctx.parallel->for_range(n, grain, fn);
}

// The strides of `view` read as if broadcast to `out_shape` (numpy: shapes aligned on the right,
// missing and size-1 dims get stride 0). The caller has checked the shapes are compatible.
inline std::vector<int64_t> broadcast_strides(const TensorView& view,
                                              std::span<const int64_t> out_shape) {
  std::vector<int64_t> strides(out_shape.size(), 0);
  size_t offset = out_shape.size() - view.shape.size();
  for (size_t i = 0; i < view.shape.size(); ++i)
    if (view.shape[i] != 1) strides[offset + i] = view.strides[i];
  return strides;
}

// Visits elements [begin, end) of a row-major walk over `shape` in runs along the last axis: for each
// run, fn(first, offsets, count) gets the run's first row-major position and every operand's element
// offset there; within the run operand k advances by strides[k].back() per element (rank 0: one run
// of one element). Each strides[k] has shape.size() entries.
template <size_t N, class Fn>
void for_each_run(std::span<const int64_t> shape, const std::array<const int64_t*, N>& strides,
                  int64_t begin, int64_t end, Fn&& fn) {
  const size_t rank = shape.size();
  std::array<int64_t, N> offsets{};
  if (rank == 0) {
    if (begin < end) fn(begin, offsets, int64_t{1});
    return;
  }
  // The multi-index of `begin`.
  std::vector<int64_t> index(rank, 0);
  int64_t rest = begin;
  for (size_t d = rank; d-- > 0;) {
    index[d] = rest % shape[d];
    rest /= shape[d];
  }
  const int64_t inner = shape[rank - 1];
  for (int64_t pos = begin; pos < end;) {
    for (size_t k = 0; k < N; ++k) {
      int64_t off = 0;
      for (size_t d = 0; d < rank; ++d) off += index[d] * strides[k][d];
      offsets[k] = off;
    }
    const int64_t count = std::min(inner - index[rank - 1], end - pos);
    fn(pos, offsets, count);
    pos += count;
    index[rank - 1] += count;
    for (size_t d = rank - 1; d > 0 && index[d] == shape[d]; --d) {
      index[d] = 0;
      ++index[d - 1];
    }
  }
}

// Calls f.template operator()<U>() with U the unsigned type as wide as one element of `dtype`.
template <class F> decltype(auto) visit_element_size(DType dtype, F&& f) {
  switch (dtype_size(dtype)) {
    case 1: return f.template operator()<uint8_t>();
    case 2: return f.template operator()<uint16_t>();
    case 4: return f.template operator()<uint32_t>();
    default: return f.template operator()<uint64_t>();
  }
}

// Copies the elements of `shape` between two strided layouts: a broadcast source (stride 0), a
// slice, one part of a concat. Only dtype's element size matters; the views must not overlap.
inline void copy_view(const KernelContext& ctx, DType dtype, std::span<const int64_t> shape,
                      const void* src, std::span<const int64_t> src_strides, void* dst,
                      std::span<const int64_t> dst_strides) {
  // Merge axes laid out back to back in both views (and drop size-1 axes), so runs get long: a
  // contiguous copy becomes one axis, copied by memcpy.
  std::vector<int64_t> dims, s_strides, d_strides;
  int64_t n = 1;
  for (size_t d = 0; d < shape.size(); ++d) {
    n *= shape[d];
    if (shape[d] == 1) continue;
    if (!dims.empty() && s_strides.back() == shape[d] * src_strides[d] &&
        d_strides.back() == shape[d] * dst_strides[d]) {
      dims.back() *= shape[d];
      s_strides.back() = src_strides[d];
      d_strides.back() = dst_strides[d];
    } else {
      dims.push_back(shape[d]);
      s_strides.push_back(src_strides[d]);
      d_strides.push_back(dst_strides[d]);
    }
  }
  if (n == 0) return;
  const int64_t s_step = dims.empty() ? 1 : s_strides.back();
  const int64_t d_step = dims.empty() ? 1 : d_strides.back();
  visit_element_size(dtype, [&]<class U>() {
    const U* in = static_cast<const U*>(src);
    U* out = static_cast<U*>(dst);
    parallel_for(ctx, n, kElementwiseGrain, [&](int64_t begin, int64_t end) {
      for_each_run<2>(dims, {s_strides.data(), d_strides.data()}, begin, end,
                      [&](int64_t, const std::array<int64_t, 2>& off, int64_t count) {
                        const U* i = in + off[0];
                        U* o = out + off[1];
                        if (s_step == 1 && d_step == 1)
                          std::memcpy(o, i, static_cast<size_t>(count) * sizeof(U));
                        else
                          for (int64_t j = 0; j < count; ++j) o[j * d_step] = i[j * s_step];
                      });
    });
  });
}

// Row-major strides of a contiguous tensor of `shape`.
inline std::vector<int64_t> row_major_strides(std::span<const int64_t> shape) {
  std::vector<int64_t> strides(shape.size());
  int64_t s = 1;
  for (size_t i = shape.size(); i-- > 0;) {
    strides[i] = s;
    s *= shape[i];
  }
  return strides;
}

// Copies `src` read through `src_strides` (broadcast strides of 0 included) in row-major order of
// `shape` into contiguous `dst`.
inline void copy_strided(const KernelContext& ctx, DType dtype, std::span<const int64_t> shape,
                         const void* src, std::span<const int64_t> src_strides, void* dst) {
  const std::vector<int64_t> dst_strides = row_major_strides(shape);
  copy_view(ctx, dtype, shape, src, src_strides, dst, dst_strides);
}

}  // namespace kiln::kernels
