// Private: element conversions between dtypes, with the semantics of the `cast` op, and the compute
// type of each element type (f16/bf16 compute in f32).
#pragma once

#include <cmath>
#include <limits>
#include <type_traits>

#include "kiln/graph/dtype.h"

namespace kiln::kernels {

template <class T>
inline constexpr bool is_half_v = std::is_same_v<T, f16_t> || std::is_same_v<T, bf16_t>;

// The arithmetic type kernels compute T in: float for the 16-bit floats, T itself otherwise.
template <class T> using compute_t = std::conditional_t<is_half_v<T>, float, T>;

template <class T> inline compute_t<T> widen(T v) {
  if constexpr (is_half_v<T>)
    return static_cast<float>(v);
  else
    return v;
}

// A floating value to an integer: truncates toward zero (as C++ does for in-range values); NaN gives
// 0 and values beyond the integer's range saturate to its min or max (C++ leaves both undefined).
template <class Int, class Float> inline Int float_to_int(Float v) {
  if (std::isnan(v)) return Int{0};
  const Float t = std::trunc(v);
  // min() is 0 or -2^k, both exact in Float; max() + 1 is 2^k, which Float(max()) rounds to or
  // below, so t >= Float(max()) is caught for every t that does not fit.
  constexpr Float lo = static_cast<Float>(std::numeric_limits<Int>::min());
  constexpr Float hi = static_cast<Float>(std::numeric_limits<Int>::max());
  if (t <= lo) return std::numeric_limits<Int>::min();
  if (t >= hi) return std::numeric_limits<Int>::max();
  return static_cast<Int>(t);
}

// One element of type From as type To, with cast's semantics: to bool is v != 0 (NaN is true);
// float to integer as float_to_int; integer to narrower integer wraps (two's complement, as C++20);
// to f16/bf16 rounds to nearest even through f32 (f64 sources round twice).
template <class To, class From> inline To convert(From from) {
  const auto v = widen(from);
  using V = decltype(v);
  if constexpr (std::is_same_v<To, bool>)
    return v != V(0);
  else if constexpr (is_half_v<To>)
    return To(static_cast<float>(v));
  else if constexpr (std::is_floating_point_v<V> && std::is_integral_v<To>)
    return float_to_int<To>(v);
  else
    return static_cast<To>(v);
}

}  // namespace kiln::kernels
