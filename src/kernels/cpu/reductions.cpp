// Reductions along one axis: sum, mean, max, min, argmax, argmin (the axis kept with size 1), cumsum
// (same shape) and top_k (the axis cut to k). The input may be strided; results are contiguous.
//
// Accumulation: f16/bf16 in f32, f32 and f64 in f64, integers in their own type with wrap-around
// (computed unsigned so overflow is defined). NaN: max/min/argmax/argmin return the first NaN on the
// axis (as PyTorch does), and top_k ranks NaN above every number.
#include <algorithm>
#include <array>
#include <cmath>
#include <numeric>
#include <type_traits>
#include <vector>

#include "kernels/cpu/kernels.h"
#include "kernels/cpu/strided.h"
#include "kernels/cpu/vector_math.h"

namespace kiln::kernels {
namespace {

using graph::Op;

template <class T> constexpr bool is_half_v = std::is_same_v<T, f16_t> || std::is_same_v<T, bf16_t>;

// The type sums accumulate in (see the file comment).
template <class T>
using accumulator_t = std::conditional_t<
    is_half_v<T>, float,
    std::conditional_t<std::is_floating_point_v<T>, double,
                       std::conditional_t<(sizeof(T) > 4), uint64_t, uint32_t>>>;

// What comparisons see: f16/bf16 decoded to float, other types as they are.
template <class T> auto compare_value(T x) {
  if constexpr (is_half_v<T>)
    return static_cast<float>(x);
  else
    return x;
}

template <class V> bool is_nan_value(V v) {
  if constexpr (std::is_floating_point_v<V>)
    return std::isnan(v);
  else
    return false;
}

// One reduction problem: the lines along `axis`, in row-major order of the other dims.
struct Lines {
  int64_t axis = 0;
  int64_t length = 0;  // elements per line
  int64_t stride = 0;  // input stride along the axis
  int64_t count = 0;   // number of lines
  int64_t inner = 1;   // product of the dims after the axis (a contiguous result's axis stride)
  std::vector<int64_t> outer_shape, outer_strides;  // the input's shape and strides without the axis
};

// The attributes of a reduction: the axis as given (negative counts from the end; the input's rank,
// which may be symbolic at build, is only known at launch), and cumsum's and top_k's own.
struct AxisParams {
  int64_t axis;
  explicit AxisParams(const KernelInit& init) : axis(init.attr<int64_t>("axis")) {}
};
struct CumsumParams : AxisParams {
  bool exclusive, reverse;
  explicit CumsumParams(const KernelInit& init)
      : AxisParams(init),
        exclusive(init.attr<int64_t>("exclusive") != 0),
        reverse(init.attr<int64_t>("reverse") != 0) {}
};
struct TopKParams : AxisParams {
  int64_t k;
  explicit TopKParams(const KernelInit& init) : AxisParams(init), k(init.attr<int64_t>("k")) {}
};

Lines lines_of(Op op, const TensorView& in, int64_t given_axis) {
  const int64_t rank = static_cast<int64_t>(in.shape.size());
  int64_t axis = given_axis;
  if (axis < 0) axis += rank;
  if (rank == 0 || axis < 0 || axis >= rank)
    throw ValueError(std::string(graph::op_name(op)) + ": axis " + std::to_string(given_axis) +
                     " is out of range for " + describe(in));
  Lines l;
  l.axis = axis;
  l.length = in.shape[axis];
  l.stride = in.strides[axis];
  l.count = 1;
  for (int64_t d = 0; d < rank; ++d) {
    if (d == axis) continue;
    l.outer_shape.push_back(in.shape[d]);
    l.outer_strides.push_back(in.strides[d]);
    l.count *= in.shape[d];
    if (d > axis) l.inner *= in.shape[d];
  }
  return l;
}

// Runs fn(line, base) for every line, in parallel chunks: `line` is its row-major index over the
// other dims, `base` the input offset of its first element.
template <class Fn> void for_each_line(const KernelContext& ctx, const Lines& l, Fn&& fn) {
  const int64_t grain = std::max<int64_t>(1, kElementwiseGrain / std::max<int64_t>(1, l.length));
  const std::array<const int64_t*, 1> strides{l.outer_strides.data()};
  const int64_t step = l.outer_strides.empty() ? 0 : l.outer_strides.back();
  parallel_for(ctx, l.count, grain, [&](int64_t begin, int64_t end) {
    for_each_run<1>(l.outer_shape, strides, begin, end,
                    [&](int64_t first, const std::array<int64_t, 1>& off, int64_t n) {
                      for (int64_t j = 0; j < n; ++j) fn(first + j, off[0] + j * step);
                    });
  });
}

// The contiguous result offset of element t of line `line`, for a result whose axis has `length`.
inline int64_t result_offset(const Lines& l, int64_t line, int64_t length, int64_t t) {
  return (line / l.inner) * length * l.inner + line % l.inner + t * l.inner;
}

void check_result(Op op, const TensorView& in, const TensorView& out, const Lines& l, int64_t axis_size,
                  DType dtype) {
  TensorView want = in;
  want.shape[l.axis] = axis_size;
  want.dtype = dtype;
  if (out.shape != want.shape || out.dtype != dtype)
    throw ShapeError(std::string(graph::op_name(op)) + ": result " + describe(out) + " should be " +
                     describe(want) + " (input " + describe(in) + ")");
  if (!out.is_contiguous())
    throw ValueError(std::string(graph::op_name(op)) + ": the result view must be contiguous");
}

void check_arity(Op op, std::span<const TensorView> inputs, std::span<const TensorView> outputs,
                 size_t num_outputs) {
  if (inputs.size() != 1 || outputs.size() != num_outputs)
    throw ValueError(std::string(graph::op_name(op)) + ": expected 1 operand and " +
                     std::to_string(num_outputs) + " result(s), got " + std::to_string(inputs.size()) +
                     " and " + std::to_string(outputs.size()));
}

void reject_bool(Op op, const TensorView& in) {
  if (in.dtype == DType::boolean)
    throw DTypeError(std::string(graph::op_name(op)) + ": bool input is not supported (" + describe(in) +
                     ")");
}

// ---- sum and mean ----------------------------------------------------------------------------------

template <Op kOp>
void sum_kernel(const KernelContext& ctx, const AxisParams& params, std::span<const TensorView> inputs,
                std::span<const TensorView> outputs) {
  check_arity(kOp, inputs, outputs, 1);
  const TensorView &in = inputs[0], &out = outputs[0];
  reject_bool(kOp, in);
  if (kOp == Op::mean && !is_float(in.dtype))
    throw DTypeError("mean: input must be a float dtype, got " + describe(in));
  const Lines l = lines_of(kOp, in, params.axis);
  check_result(kOp, in, out, l, 1, in.dtype);
  visit_dtype(in.dtype, [&]<class T>() {
    if constexpr (!std::is_same_v<T, bool>) {
      using Acc = accumulator_t<T>;
      const T* x = in.as<T>();
      T* y = out.as<T>();
      for_each_line(ctx, l, [&](int64_t line, int64_t base) {
        Acc acc = 0;
        for (int64_t t = 0; t < l.length; ++t) acc += static_cast<Acc>(x[base + t * l.stride]);
        if constexpr (kOp == Op::mean && std::is_floating_point_v<Acc>)
          acc /= static_cast<Acc>(l.length);  // an empty axis gives 0 / 0 = NaN, as numpy does
        y[line] = static_cast<T>(acc);
      });
    }
  });
}

// ---- max, min, argmax, argmin ------------------------------------------------------------------------

// The index of the first largest (kMax) or smallest element of a line; the first NaN if there is one.
template <bool kMax, class T> int64_t extreme_index(const T* x, int64_t stride, int64_t length) {
  if constexpr (std::is_same_v<T, float>)
    if (stride == 1 && vmath::available()) return vmath::extreme_index(x, length, kMax);  // same result
  int64_t best = 0;
  auto best_value = compare_value(x[0]);
  if (is_nan_value(best_value)) return 0;
  for (int64_t t = 1; t < length; ++t) {
    auto v = compare_value(x[t * stride]);
    if (is_nan_value(v)) return t;
    if (kMax ? v > best_value : v < best_value) {
      best_value = v;
      best = t;
    }
  }
  return best;
}

template <Op kOp>
void extreme_kernel(const KernelContext& ctx, const AxisParams& params, std::span<const TensorView> inputs,
                    std::span<const TensorView> outputs) {
  constexpr bool kMax = kOp == Op::max || kOp == Op::argmax;
  constexpr bool kIndex = kOp == Op::argmax || kOp == Op::argmin;
  check_arity(kOp, inputs, outputs, 1);
  const TensorView &in = inputs[0], &out = outputs[0];
  reject_bool(kOp, in);
  const Lines l = lines_of(kOp, in, params.axis);
  check_result(kOp, in, out, l, 1, kIndex ? DType::i64 : in.dtype);
  if (l.length == 0 && l.count > 0)
    throw ShapeError(std::string(graph::op_name(kOp)) + ": cannot reduce dim " + std::to_string(l.axis) +
                     " of size 0 (input " + describe(in) + ")");
  visit_dtype(in.dtype, [&]<class T>() {
    if constexpr (!std::is_same_v<T, bool>) {
      const T* x = in.as<T>();
      for_each_line(ctx, l, [&](int64_t line, int64_t base) {
        const int64_t best = extreme_index<kMax>(x + base, l.stride, l.length);
        if constexpr (kIndex)
          out.as<int64_t>()[line] = best;
        else
          out.as<T>()[line] = x[base + best * l.stride];
      });
    }
  });
}

// ---- cumsum --------------------------------------------------------------------------------------

void cumsum_kernel(const KernelContext& ctx, const CumsumParams& params, std::span<const TensorView> inputs,
                   std::span<const TensorView> outputs) {
  check_arity(Op::cumsum, inputs, outputs, 1);
  const TensorView &in = inputs[0], &out = outputs[0];
  reject_bool(Op::cumsum, in);
  const Lines l = lines_of(Op::cumsum, in, params.axis);
  check_result(Op::cumsum, in, out, l, l.length, in.dtype);
  const bool exclusive = params.exclusive, reverse = params.reverse;
  visit_dtype(in.dtype, [&]<class T>() {
    if constexpr (!std::is_same_v<T, bool>) {
      using Acc = accumulator_t<T>;
      const T* x = in.as<T>();
      T* y = out.as<T>();
      for_each_line(ctx, l, [&](int64_t line, int64_t base) {
        Acc acc = 0;
        for (int64_t i = 0; i < l.length; ++i) {
          const int64_t t = reverse ? l.length - 1 - i : i;
          const Acc v = static_cast<Acc>(x[base + t * l.stride]);
          if (!exclusive) acc += v;
          y[result_offset(l, line, l.length, t)] = static_cast<T>(acc);
          if (exclusive) acc += v;
        }
      });
    }
  });
}

// ---- top_k ---------------------------------------------------------------------------------------

void top_k_kernel(const KernelContext& ctx, const TopKParams& params, std::span<const TensorView> inputs,
                  std::span<const TensorView> outputs) {
  check_arity(Op::top_k, inputs, outputs, 2);
  const TensorView &in = inputs[0], &values = outputs[0], &indices = outputs[1];
  reject_bool(Op::top_k, in);
  const Lines l = lines_of(Op::top_k, in, params.axis);
  const int64_t k = params.k;
  if (k < 1 || k > l.length)
    throw ShapeError("top_k: k " + std::to_string(k) + " must be in [1, " + std::to_string(l.length) +
                     "], the size of dim " + std::to_string(l.axis) + " (input " + describe(in) + ")");
  check_result(Op::top_k, in, values, l, k, in.dtype);
  check_result(Op::top_k, in, indices, l, k, DType::i64);
  visit_dtype(in.dtype, [&]<class T>() {
    if constexpr (!std::is_same_v<T, bool>) {
      const T* x = in.as<T>();
      T* y = values.as<T>();
      int64_t* yi = indices.as<int64_t>();
      for_each_line(ctx, l, [&](int64_t line, int64_t base) {
        using V = decltype(compare_value(x[0]));
        struct Entry {
          V value;
          int64_t index;
        };
        // Descending; NaN above every number; equal values keep the lower index first.
        auto before = [](const Entry& a, const Entry& b) {
          const bool na = is_nan_value(a.value), nb = is_nan_value(b.value);
          if (na || nb) return na && (!nb || a.index < b.index);
          if (a.value != b.value) return a.value > b.value;
          return a.index < b.index;
        };
        // One pass keeping the k best in a heap whose top is the worst of them: most elements of a
        // long line (logits over a vocabulary) lose one comparison with the top and cost nothing more.
        thread_local std::vector<Entry> order;
        order.clear();
        for (int64_t i = 0; i < k; ++i) order.push_back({compare_value(x[base + i * l.stride]), i});
        std::make_heap(order.begin(), order.end(), before);
        V worst = order.front().value;
        for (int64_t i = k; i < l.length; ++i) {
          const V value = compare_value(x[base + i * l.stride]);
          // Later indices lose ties, so only a greater value (or a NaN) can enter: one comparison for
          // most elements. `!(value <= worst)` is also true for a NaN on either side.
          if (value <= worst) continue;
          const Entry e{value, i};
          if (!before(e, order.front())) continue;
          std::pop_heap(order.begin(), order.end(), before);
          order.back() = e;
          std::push_heap(order.begin(), order.end(), before);
          worst = order.front().value;
        }
        std::sort_heap(order.begin(), order.end(), before);
        for (int64_t t = 0; t < k; ++t) {
          const int64_t o = result_offset(l, line, k, t);
          y[o] = x[base + order[t].index * l.stride];
          yi[o] = order[t].index;
        }
      });
    }
  });
}

}  // namespace

void register_cpu_reductions(KernelRegistry& r) {
  const std::initializer_list<DType> kNumeric = {DType::f32, DType::f64, DType::f16, DType::bf16,
                                                     DType::i8,  DType::i16, DType::i32, DType::i64,
                                                     DType::u8,  DType::u16, DType::u32, DType::u64};
  const std::initializer_list<DType> kFloat = {DType::f32, DType::f64, DType::f16, DType::bf16};
  r.add(Op::sum, DeviceKind::CPU, kNumeric, &with_params<AxisParams, sum_kernel<Op::sum>>);
  r.add(Op::mean, DeviceKind::CPU, kFloat, &with_params<AxisParams, sum_kernel<Op::mean>>);
  r.add(Op::max, DeviceKind::CPU, kNumeric, &with_params<AxisParams, extreme_kernel<Op::max>>);
  r.add(Op::min, DeviceKind::CPU, kNumeric, &with_params<AxisParams, extreme_kernel<Op::min>>);
  r.add(Op::argmax, DeviceKind::CPU, kNumeric, &with_params<AxisParams, extreme_kernel<Op::argmax>>);
  r.add(Op::argmin, DeviceKind::CPU, kNumeric, &with_params<AxisParams, extreme_kernel<Op::argmin>>);
  r.add(Op::cumsum, DeviceKind::CPU, kNumeric, &with_params<CumsumParams, cumsum_kernel>);
  r.add(Op::top_k, DeviceKind::CPU, kNumeric, &with_params<TopKParams, top_k_kernel>);
}

}  // namespace kiln::kernels
