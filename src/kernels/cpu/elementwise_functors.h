// Private: the elementwise ops as small functors over a compute type C (float, double or an
// integer), shared by the elementwise kernels (elementwise.cpp) and the fused_elementwise
// interpreter (fused.cpp), so a fused program computes exactly what the unfused ops do.
// 16-bit floats compute in f32; signed integer arithmetic wraps (two's complement) instead of being
// undefined on overflow.
#pragma once

#include <cmath>
#include <numbers>
#include <type_traits>

#include <fmt/format.h>

#include "kiln/errors.h"
#include "kiln/graph/op.h"

namespace kiln::kernels::elementwise {

using graph::Op;

// ---- which dtypes an op accepts ------------------------------------------------------------------

enum class Accepts { numeric, signed_numeric, floats, booleans, all };

constexpr bool accepts(Accepts a, DType d) {
  switch (a) {
    case Accepts::numeric: return d != DType::boolean;
    case Accepts::signed_numeric:
      return d != DType::boolean && d != DType::u8 && d != DType::u16 && d != DType::u32 &&
             d != DType::u64;
    case Accepts::floats:
      return d == DType::f32 || d == DType::f16 || d == DType::bf16 || d == DType::f64;
    case Accepts::booleans: return d == DType::boolean;
    case Accepts::all: return true;
  }
  return false;
}

// ---- wrapping integer arithmetic -------------------------------------------------------------------

// Unsigned arithmetic is modular; promoting through at least `unsigned` avoids int overflow on
// narrow types (uint16 * uint16 would otherwise multiply as int).
template <class T>
using wrap_t = std::conditional_t<(sizeof(T) < sizeof(unsigned)), unsigned, std::make_unsigned_t<T>>;

template <class T> T wrapping_add(T a, T b) {
  if constexpr (std::is_integral_v<T>)
    return static_cast<T>(static_cast<wrap_t<T>>(a) + static_cast<wrap_t<T>>(b));
  else
    return a + b;
}
template <class T> T wrapping_sub(T a, T b) {
  if constexpr (std::is_integral_v<T>)
    return static_cast<T>(static_cast<wrap_t<T>>(a) - static_cast<wrap_t<T>>(b));
  else
    return a - b;
}
template <class T> T wrapping_mul(T a, T b) {
  if constexpr (std::is_integral_v<T>)
    return static_cast<T>(static_cast<wrap_t<T>>(a) * static_cast<wrap_t<T>>(b));
  else
    return a * b;
}
template <class T> T wrapping_neg(T a) { return wrapping_sub(T(0), a); }

// ---- unary functors: C is the compute type (float, double or an integer) -------------------------

struct Neg {
  static constexpr Accepts kAccepts = Accepts::signed_numeric;
  template <class C> C operator()(C x) const { return wrapping_neg(x); }
};
struct Abs {
  static constexpr Accepts kAccepts = Accepts::numeric;
  template <class C> C operator()(C x) const {
    if constexpr (std::is_floating_point_v<C>)
      return std::fabs(x);
    else if constexpr (std::is_unsigned_v<C>)
      return x;
    else
      return x < 0 ? wrapping_neg(x) : x;
  }
};
struct Relu {
  static constexpr Accepts kAccepts = Accepts::numeric;
  // x < 0 rather than x > 0 so NaN passes through, as in PyTorch.
  template <class C> C operator()(C x) const {
    if constexpr (std::is_unsigned_v<C>)
      return x;
    else
      return x < C(0) ? C(0) : x;
  }
};
struct Square {
  static constexpr Accepts kAccepts = Accepts::numeric;
  template <class C> C operator()(C x) const { return wrapping_mul(x, x); }
};
struct Exp {
  static constexpr Accepts kAccepts = Accepts::floats;
  template <class C> C operator()(C x) const { return std::exp(x); }
};
struct Log {
  static constexpr Accepts kAccepts = Accepts::floats;
  template <class C> C operator()(C x) const { return std::log(x); }
};
struct Sqrt {
  static constexpr Accepts kAccepts = Accepts::floats;
  template <class C> C operator()(C x) const { return std::sqrt(x); }
};
struct Rsqrt {
  static constexpr Accepts kAccepts = Accepts::floats;
  template <class C> C operator()(C x) const { return C(1) / std::sqrt(x); }
};
struct Sin {
  static constexpr Accepts kAccepts = Accepts::floats;
  template <class C> C operator()(C x) const { return std::sin(x); }
};
struct Cos {
  static constexpr Accepts kAccepts = Accepts::floats;
  template <class C> C operator()(C x) const { return std::cos(x); }
};
struct Tanh {
  static constexpr Accepts kAccepts = Accepts::floats;
  template <class C> C operator()(C x) const { return std::tanh(x); }
};
struct Sigmoid {
  static constexpr Accepts kAccepts = Accepts::floats;
  template <class C> C operator()(C x) const { return C(1) / (C(1) + std::exp(-x)); }
};
struct Silu {
  static constexpr Accepts kAccepts = Accepts::floats;
  template <class C> C operator()(C x) const { return x / (C(1) + std::exp(-x)); }
};
struct GeluErf {
  static constexpr Accepts kAccepts = Accepts::floats;
  template <class C> C operator()(C x) const {
    return C(0.5) * x * (C(1) + std::erf(x * C(std::numbers::sqrt2 / 2)));
  }
};
struct GeluTanh {
  static constexpr Accepts kAccepts = Accepts::floats;
  template <class C> C operator()(C x) const {
    const C k = C(std::numbers::sqrt2 * std::numbers::inv_sqrtpi);  // sqrt(2 / pi)
    return C(0.5) * x * (C(1) + std::tanh(k * (x + C(0.044715) * x * x * x)));
  }
};
struct Erf {
  static constexpr Accepts kAccepts = Accepts::floats;
  template <class C> C operator()(C x) const { return std::erf(x); }
};
struct Floor {
  static constexpr Accepts kAccepts = Accepts::floats;
  template <class C> C operator()(C x) const { return std::floor(x); }
};
struct Ceil {
  static constexpr Accepts kAccepts = Accepts::floats;
  template <class C> C operator()(C x) const { return std::ceil(x); }
};
struct RoundHalfEven {
  static constexpr Accepts kAccepts = Accepts::floats;
  // Explicit rather than std::nearbyint, which depends on the thread's rounding mode.
  template <class C> C operator()(C x) const {
    const C r = std::round(x);  // halves away from zero
    if (std::fabs(x - std::trunc(x)) == C(0.5)) return C(2) * std::round(x * C(0.5));
    return r;
  }
};
struct Reciprocal {
  static constexpr Accepts kAccepts = Accepts::floats;
  template <class C> C operator()(C x) const { return C(1) / x; }
};
struct IsNan {
  static constexpr Accepts kAccepts = Accepts::floats;
  static constexpr bool kBoolResult = true;
  template <class C> bool operator()(C x) const { return std::isnan(x); }
};
struct LogicalNot {
  static constexpr Accepts kAccepts = Accepts::booleans;
  bool operator()(bool x) const { return !x; }
};

// ---- binary functors ------------------------------------------------------------------------------

struct Add {
  static constexpr Accepts kAccepts = Accepts::numeric;
  template <class C> C operator()(C a, C b) const { return wrapping_add(a, b); }
};
struct Sub {
  static constexpr Accepts kAccepts = Accepts::numeric;
  template <class C> C operator()(C a, C b) const { return wrapping_sub(a, b); }
};
struct Mul {
  static constexpr Accepts kAccepts = Accepts::numeric;
  template <class C> C operator()(C a, C b) const { return wrapping_mul(a, b); }
};

// Integer divisors are checked for zero before any element is computed (check_rhs), so the loops
// stay branch-free and nothing throws from inside a parallel region.
template <class C> void check_nonzero_divisor(Op op, C b) {
  if constexpr (std::is_integral_v<C>)
    if (b == C(0))
      throw ExecutionError(fmt::format("{}: integer division by zero", graph::op_name(op)));
}

struct Div {
  static constexpr Accepts kAccepts = Accepts::numeric;
  template <class C> static void check_rhs(C b) { check_nonzero_divisor(Op::div, b); }
  // Integers truncate toward zero, as C++ does; MIN / -1 wraps to MIN instead of trapping.
  template <class C> C operator()(C a, C b) const {
    if constexpr (std::is_integral_v<C> && std::is_signed_v<C>)
      if (b == C(-1)) return wrapping_neg(a);
    return static_cast<C>(a / b);
  }
};
struct Mod {
  static constexpr Accepts kAccepts = Accepts::numeric;
  template <class C> static void check_rhs(C b) { check_nonzero_divisor(Op::mod, b); }
  // The result takes the divisor's sign, as Python's %: -7 mod 3 == 2, 7 mod -3 == -2.
  template <class C> C operator()(C a, C b) const {
    if constexpr (std::is_floating_point_v<C>) {
      C r = std::fmod(a, b);
      if (r != C(0) && ((r < C(0)) != (b < C(0)))) r += b;
      if (r == C(0)) r = std::copysign(C(0), b);
      return r;
    } else if constexpr (std::is_signed_v<C>) {
      if (b == C(-1)) return C(0);  // MIN % -1 would trap
      C r = static_cast<C>(a % b);
      if (r != 0 && ((r < 0) != (b < 0))) r = static_cast<C>(r + b);
      return r;
    } else {
      return static_cast<C>(a % b);
    }
  }
};
struct Pow {
  static constexpr Accepts kAccepts = Accepts::numeric;
  template <class C> static void check_rhs(C b) {
    if constexpr (std::is_integral_v<C> && std::is_signed_v<C>)
      if (b < 0)
        throw ExecutionError(fmt::format(
            "pow: negative integer exponent {} (integers to negative powers are not allowed)",
            static_cast<int64_t>(b)));
  }
  template <class C> C operator()(C a, C b) const {
    if constexpr (std::is_floating_point_v<C>) {
      return std::pow(a, b);
    } else {
      // Exponentiation by squaring, wrapping like repeated multiplication.
      C result = 1;
      for (auto e = static_cast<std::make_unsigned_t<C>>(b); e != 0; e >>= 1) {
        if (e & 1) result = wrapping_mul(result, a);
        a = wrapping_mul(a, a);
      }
      return result;
    }
  }
};
// NaN propagates, as PyTorch's maximum/minimum do (b is returned when it is NaN).
template <class C> bool nan_value(C x) {
  if constexpr (std::is_floating_point_v<C>)
    return std::isnan(x);
  else
    return false;
}
struct Maximum {
  static constexpr Accepts kAccepts = Accepts::numeric;
  template <class C> C operator()(C a, C b) const { return (a > b || nan_value(a)) ? a : b; }
};
struct Minimum {
  static constexpr Accepts kAccepts = Accepts::numeric;
  template <class C> C operator()(C a, C b) const { return (a < b || nan_value(a)) ? a : b; }
};
struct Equal {
  static constexpr Accepts kAccepts = Accepts::all;
  static constexpr bool kBoolResult = true;
  template <class C> bool operator()(C a, C b) const { return a == b; }
};
struct NotEqual {
  static constexpr Accepts kAccepts = Accepts::all;
  static constexpr bool kBoolResult = true;
  template <class C> bool operator()(C a, C b) const { return a != b; }
};
struct Greater {
  static constexpr Accepts kAccepts = Accepts::numeric;
  static constexpr bool kBoolResult = true;
  template <class C> bool operator()(C a, C b) const { return a > b; }
};
struct GreaterEqual {
  static constexpr Accepts kAccepts = Accepts::numeric;
  static constexpr bool kBoolResult = true;
  template <class C> bool operator()(C a, C b) const { return a >= b; }
};
struct Less {
  static constexpr Accepts kAccepts = Accepts::numeric;
  static constexpr bool kBoolResult = true;
  template <class C> bool operator()(C a, C b) const { return a < b; }
};
struct LessEqual {
  static constexpr Accepts kAccepts = Accepts::numeric;
  static constexpr bool kBoolResult = true;
  template <class C> bool operator()(C a, C b) const { return a <= b; }
};
struct LogicalAnd {
  static constexpr Accepts kAccepts = Accepts::booleans;
  bool operator()(bool a, bool b) const { return a && b; }
};
struct LogicalOr {
  static constexpr Accepts kAccepts = Accepts::booleans;
  bool operator()(bool a, bool b) const { return a || b; }
};
struct LogicalXor {
  static constexpr Accepts kAccepts = Accepts::booleans;
  bool operator()(bool a, bool b) const { return a != b; }
};

}  // namespace kiln::kernels::elementwise
