// CPU kernels of the elementwise ops: unary, binary (numpy broadcasting of strided operands into a
// contiguous result), where and cast. Each op is a small functor; a few loop templates apply it.
// 16-bit floats compute in f32 and round back; signed integer arithmetic wraps (two's complement)
// instead of being undefined on overflow.
#include <cmath>
#include <numbers>
#include <optional>
#include <type_traits>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "kernels/cpu/convert.h"
#include "kernels/cpu/elementwise_functors.h"
#include "kernels/cpu/kernels.h"
#include "kernels/cpu/strided.h"
#include "kernels/cpu/vector_math.h"

namespace kiln::kernels {
namespace {

using graph::Op;

using namespace elementwise;

// ---- loops -----------------------------------------------------------------------------------------

template <class F> constexpr bool bool_result() {
  if constexpr (requires { F::kBoolResult; })
    return F::kBoolResult;
  else
    return false;
}

// The element type F writes for inputs of type T.
template <class F, class T> using result_t = std::conditional_t<bool_result<F>(), bool, T>;

// Throws ShapeError unless `v` broadcasts to `out_shape` (the executor has checked; this keeps a
// wrong call from reading out of bounds).
void check_broadcastable(Op op, const char* operand, const TensorView& v,
                         const std::vector<int64_t>& out_shape) {
  bool ok = v.shape.size() <= out_shape.size();
  for (size_t i = 0; ok && i < v.shape.size(); ++i) {
    const int64_t d = v.shape[v.shape.size() - 1 - i];
    ok = d == 1 || d == out_shape[out_shape.size() - 1 - i];
  }
  if (!ok)
    throw ShapeError(fmt::format("{}: {} of shape [{}] does not broadcast to the result shape [{}]",
                                 graph::op_name(op), operand, fmt::join(v.shape, ", "),
                                 fmt::join(out_shape, ", ")));
}

// Same shape as the result and contiguous: the loop can read it flat.
bool is_flat(const TensorView& v, const std::vector<int64_t>& out_shape) {
  return v.shape == out_shape && v.is_contiguous();
}

// The vmath loop of functor F, if it has one.
template <class F> constexpr std::optional<vmath::Fn> vmath_fn() {
  if constexpr (std::is_same_v<F, Exp>) return vmath::Fn::exp;
  if constexpr (std::is_same_v<F, Sigmoid>) return vmath::Fn::sigmoid;
  if constexpr (std::is_same_v<F, Silu>) return vmath::Fn::silu;
  return std::nullopt;
}

// F through its SIMD loop (vector_math.h), on f32 or on f16/bf16 widened to f32 a block at a time:
// the arithmetic of fused_elementwise's registers, so fused and unfused give the same bits.
template <class F, class T>
void unary_vmath(const KernelContext& ctx, const TensorView& in, const TensorView& out) {
  constexpr vmath::Fn fn = *vmath_fn<F>();
  const T* x = in.as<T>();
  T* o = out.as<T>();
  if constexpr (std::is_same_v<T, float>)
    if (is_flat(in, out.shape)) {
      parallel_for(ctx, out.numel(), kElementwiseGrain,
                   [&](int64_t begin, int64_t end) { vmath::apply(fn, x + begin, o + begin, end - begin); });
      return;
    }
  const std::vector<int64_t> strides = broadcast_strides(in, out.shape);
  const int64_t step = strides.empty() ? 0 : strides.back();
  parallel_for(ctx, out.numel(), kElementwiseGrain, [&](int64_t begin, int64_t end) {
    for_each_run<1>(out.shape, {strides.data()}, begin, end,
                    [&](int64_t first, const std::array<int64_t, 1>& off, int64_t count) {
                      constexpr int64_t kBlock = 256;
                      float block[kBlock];
                      for (int64_t b = 0; b < count; b += kBlock) {
                        const int64_t m = std::min(kBlock, count - b);
                        for (int64_t j = 0; j < m; ++j) block[j] = widen(x[off[0] + (b + j) * step]);
                        vmath::apply(fn, block, block, m);
                        for (int64_t j = 0; j < m; ++j) o[first + b + j] = convert<T>(block[j]);
                      }
                    });
  });
}

template <class F, class T>
void unary_loop(const KernelContext& ctx, const TensorView& in, const TensorView& out) {
  if constexpr (vmath_fn<F>().has_value() && std::is_same_v<compute_t<T>, float>)
    if (vmath::available()) return unary_vmath<F, T>(ctx, in, out);
  using Out = result_t<F, T>;
  const F f;
  const T* x = in.as<T>();
  Out* o = out.as<Out>();
  if (is_flat(in, out.shape)) {
    parallel_for(ctx, out.numel(), kElementwiseGrain, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) o[i] = convert<Out>(f(widen(x[i])));
    });
    return;
  }
  const std::vector<int64_t> strides = broadcast_strides(in, out.shape);
  const int64_t step = strides.empty() ? 0 : strides.back();
  parallel_for(ctx, out.numel(), kElementwiseGrain, [&](int64_t begin, int64_t end) {
    for_each_run<1>(out.shape, {strides.data()}, begin, end,
                    [&](int64_t first, const std::array<int64_t, 1>& off, int64_t count) {
                      const T* xs = x + off[0];
                      Out* os = o + first;
                      for (int64_t j = 0; j < count; ++j) os[j] = convert<Out>(f(widen(xs[j * step])));
                    });
  });
}

// Calls F::check_rhs on every element of `b`, when F has one.
template <class F, class T> void check_rhs_elements(const TensorView& b) {
  if constexpr (requires(compute_t<T> v) { F::check_rhs(v); }) {
    const T* y = b.as<T>();
    for_each_run<1>(b.shape, {b.strides.data()}, 0, b.numel(),
                    [&](int64_t, const std::array<int64_t, 1>& off, int64_t count) {
                      const int64_t step = b.shape.empty() ? 0 : b.strides.back();
                      for (int64_t j = 0; j < count; ++j) F::check_rhs(widen(y[off[0] + j * step]));
                    });
  }
}

template <class F, class T>
void binary_loop(const KernelContext& ctx, const TensorView& a, const TensorView& b,
                 const TensorView& out) {
  using Out = result_t<F, T>;
  check_rhs_elements<F, T>(b);
  const F f;
  const T* x = a.as<T>();
  const T* y = b.as<T>();
  Out* o = out.as<Out>();
  const int64_t n = out.numel();
  // Fast paths: both flat, or one flat and the other a single element (x * 0.5).
  if (is_flat(a, out.shape) && is_flat(b, out.shape)) {
    parallel_for(ctx, n, kElementwiseGrain, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) o[i] = convert<Out>(f(widen(x[i]), widen(y[i])));
    });
    return;
  }
  if (is_flat(a, out.shape) && b.numel() == 1) {
    const compute_t<T> y0 = widen(y[0]);
    parallel_for(ctx, n, kElementwiseGrain, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) o[i] = convert<Out>(f(widen(x[i]), y0));
    });
    return;
  }
  if (a.numel() == 1 && is_flat(b, out.shape)) {
    const compute_t<T> x0 = widen(x[0]);
    parallel_for(ctx, n, kElementwiseGrain, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) o[i] = convert<Out>(f(x0, widen(y[i])));
    });
    return;
  }
  const std::vector<int64_t> sa = broadcast_strides(a, out.shape);
  const std::vector<int64_t> sb = broadcast_strides(b, out.shape);
  const int64_t step_a = sa.empty() ? 0 : sa.back();
  const int64_t step_b = sb.empty() ? 0 : sb.back();
  parallel_for(ctx, n, kElementwiseGrain, [&](int64_t begin, int64_t end) {
    for_each_run<2>(out.shape, {sa.data(), sb.data()}, begin, end,
                    [&](int64_t first, const std::array<int64_t, 2>& off, int64_t count) {
                      const T* xs = x + off[0];
                      const T* ys = y + off[1];
                      Out* os = o + first;
                      for (int64_t j = 0; j < count; ++j)
                        os[j] = convert<Out>(f(widen(xs[j * step_a]), widen(ys[j * step_b])));
                    });
  });
}

// ---- kernels ---------------------------------------------------------------------------------------

[[noreturn]] void throw_unsupported(Op op, DType d) {
  throw DTypeError(fmt::format("{}: the CPU kernel does not accept {}", graph::op_name(op),
                               dtype_name(d)));
}

template <Op kOp, class F>
void unary_kernel(const KernelContext& ctx, std::span<const TensorView> inputs,
                  std::span<const TensorView> outputs) {
  check_broadcastable(kOp, "operand", inputs[0], outputs[0].shape);
  visit_dtype(inputs[0].dtype, [&]<class T>() {
    if constexpr (accepts(F::kAccepts, dtype_of<T>()))
      unary_loop<F, T>(ctx, inputs[0], outputs[0]);
    else
      throw_unsupported(kOp, inputs[0].dtype);
  });
}

struct GeluParams {
  bool tanh = false;  // approximate = "tanh", else "none" (erf)
  explicit GeluParams(const KernelInit& init) {
    const std::string& approximate = init.attr<std::string>("approximate");
    if (approximate != "none" && approximate != "tanh")
      throw ValueError(
          fmt::format("gelu: attribute 'approximate' is '{}'; expected 'none' or 'tanh'", approximate));
    tanh = approximate == "tanh";
  }
};

void gelu_kernel(const KernelContext& ctx, const GeluParams& params, std::span<const TensorView> inputs,
                 std::span<const TensorView> outputs) {
  if (params.tanh)
    unary_kernel<Op::gelu, GeluTanh>(ctx, inputs, outputs);
  else
    unary_kernel<Op::gelu, GeluErf>(ctx, inputs, outputs);
}

template <Op kOp, class F>
void binary_kernel(const KernelContext& ctx, std::span<const TensorView> inputs,
                   std::span<const TensorView> outputs) {
  const TensorView& a = inputs[0];
  const TensorView& b = inputs[1];
  if (a.dtype != b.dtype)
    throw DTypeError(fmt::format("{}: operands are {} and {}; expected the same dtype",
                                 graph::op_name(kOp), dtype_name(a.dtype), dtype_name(b.dtype)));
  check_broadcastable(kOp, "lhs", a, outputs[0].shape);
  check_broadcastable(kOp, "rhs", b, outputs[0].shape);
  visit_dtype(a.dtype, [&]<class T>() {
    if constexpr (accepts(F::kAccepts, dtype_of<T>()))
      binary_loop<F, T>(ctx, a, b, outputs[0]);
    else
      throw_unsupported(kOp, a.dtype);
  });
}

// where(condition, x, y): a byte move by element size; condition is bool.
void where_kernel(const KernelContext& ctx, std::span<const TensorView> inputs,
                  std::span<const TensorView> outputs) {
  const TensorView& cond = inputs[0];
  const TensorView& x = inputs[1];
  const TensorView& y = inputs[2];
  const TensorView& out = outputs[0];
  if (cond.dtype != DType::boolean || x.dtype != y.dtype)
    throw DTypeError(fmt::format("where: got condition {}, x {}, y {}; expected a bool condition "
                                 "and x, y of one dtype",
                                 dtype_name(cond.dtype), dtype_name(x.dtype), dtype_name(y.dtype)));
  check_broadcastable(Op::where, "condition", cond, out.shape);
  check_broadcastable(Op::where, "x", x, out.shape);
  check_broadcastable(Op::where, "y", y, out.shape);
  const std::vector<int64_t> sc = broadcast_strides(cond, out.shape);
  const std::vector<int64_t> sx = broadcast_strides(x, out.shape);
  const std::vector<int64_t> sy = broadcast_strides(y, out.shape);
  const int64_t step_c = sc.empty() ? 0 : sc.back();
  const int64_t step_x = sx.empty() ? 0 : sx.back();
  const int64_t step_y = sy.empty() ? 0 : sy.back();
  const bool* c = cond.as<bool>();
  visit_element_size(x.dtype, [&]<class U>() {
    const U* xs = x.as<U>();
    const U* ys = y.as<U>();
    U* o = out.as<U>();
    parallel_for(ctx, out.numel(), kElementwiseGrain, [&](int64_t begin, int64_t end) {
      for_each_run<3>(out.shape, {sc.data(), sx.data(), sy.data()}, begin, end,
                      [&](int64_t first, const std::array<int64_t, 3>& off, int64_t count) {
                        for (int64_t j = 0; j < count; ++j)
                          o[first + j] = c[off[0] + j * step_c] ? xs[off[1] + j * step_x]
                                                                : ys[off[2] + j * step_y];
                      });
    });
  });
}

// cast: any dtype to any (see convert() for the semantics); the result's dtype is the target.
void cast_kernel(const KernelContext& ctx, std::span<const TensorView> inputs,
                 std::span<const TensorView> outputs) {
  const TensorView& in = inputs[0];
  const TensorView& out = outputs[0];
  check_broadcastable(Op::cast, "operand", in, out.shape);
  if (in.dtype == out.dtype && in.shape == out.shape) {
    copy_strided(ctx, in.dtype, in.shape, in.data, in.strides, out.data);
    return;
  }
  const std::vector<int64_t> strides = broadcast_strides(in, out.shape);
  const int64_t step = strides.empty() ? 0 : strides.back();
  visit_dtype(in.dtype, [&]<class From>() {
    visit_dtype(out.dtype, [&]<class To>() {
      const From* x = in.as<From>();
      To* o = out.as<To>();
      parallel_for(ctx, out.numel(), kElementwiseGrain, [&](int64_t begin, int64_t end) {
        for_each_run<1>(out.shape, {strides.data()}, begin, end,
                        [&](int64_t first, const std::array<int64_t, 1>& off, int64_t count) {
                          for (int64_t j = 0; j < count; ++j)
                            o[first + j] = convert<To>(x[off[0] + j * step]);
                        });
      });
    });
  });
}

// Registers `make` for op on every dtype `accepted` allows.
void add_for(KernelRegistry& r, Op op, Accepts accepted, const KernelFactory& make) {
  for (DType d : kAllDTypes)
    if (accepts(accepted, d)) r.add(op, DeviceKind::CPU, {d}, make);
}

template <Op kOp, class F> void add_unary(KernelRegistry& r) {
  add_for(r, kOp, F::kAccepts, &stateless<unary_kernel<kOp, F>>);
}
template <Op kOp, class F> void add_binary(KernelRegistry& r) {
  add_for(r, kOp, F::kAccepts, &stateless<binary_kernel<kOp, F>>);
}

}  // namespace

void register_cpu_elementwise(KernelRegistry& r) {
  add_unary<Op::neg, Neg>(r);
  add_unary<Op::abs, Abs>(r);
  add_unary<Op::exp, Exp>(r);
  add_unary<Op::log, Log>(r);
  add_unary<Op::sqrt, Sqrt>(r);
  add_unary<Op::rsqrt, Rsqrt>(r);
  add_unary<Op::sin, Sin>(r);
  add_unary<Op::cos, Cos>(r);
  add_unary<Op::tanh, Tanh>(r);
  add_unary<Op::sigmoid, Sigmoid>(r);
  add_unary<Op::silu, Silu>(r);
  add_for(r, Op::gelu, Accepts::floats, &with_params<GeluParams, gelu_kernel>);
  add_unary<Op::relu, Relu>(r);
  add_unary<Op::erf, Erf>(r);
  add_unary<Op::floor, Floor>(r);
  add_unary<Op::ceil, Ceil>(r);
  add_unary<Op::round, RoundHalfEven>(r);
  add_unary<Op::reciprocal, Reciprocal>(r);
  add_unary<Op::square, Square>(r);
  add_unary<Op::logical_not, LogicalNot>(r);
  add_unary<Op::is_nan, IsNan>(r);

  add_binary<Op::add, Add>(r);
  add_binary<Op::sub, Sub>(r);
  add_binary<Op::mul, Mul>(r);
  add_binary<Op::div, Div>(r);
  add_binary<Op::mod, Mod>(r);
  add_binary<Op::pow, Pow>(r);
  add_binary<Op::maximum, Maximum>(r);
  add_binary<Op::minimum, Minimum>(r);
  add_binary<Op::equal, Equal>(r);
  add_binary<Op::not_equal, NotEqual>(r);
  add_binary<Op::greater, Greater>(r);
  add_binary<Op::greater_equal, GreaterEqual>(r);
  add_binary<Op::less, Less>(r);
  add_binary<Op::less_equal, LessEqual>(r);
  add_binary<Op::logical_and, LogicalAnd>(r);
  add_binary<Op::logical_or, LogicalOr>(r);
  add_binary<Op::logical_xor, LogicalXor>(r);

  // Registered under the condition's dtype (graph::kernel_key takes the first operand's).
  r.add(Op::where, DeviceKind::CPU, {DType::boolean}, &stateless<where_kernel>);
  add_for(r, Op::cast, Accepts::all, &stateless<cast_kernel>);
}

}  // namespace kiln::kernels
