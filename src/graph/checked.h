// Checked size arithmetic for sizes that come from outside input (file headers, configs, graph text):
// a product or sum that does not fit its type throws instead of wrapping, so no allocation or offset
// is ever computed from a wrapped value. In graph/, the lowest layer, so every layer can include it.
//
//   const int64_t bytes = checked_mul<LoadError>(numel, int64_t{4}, "tensor 'w': bytes of [..]");
#pragma once

#include <fmt/format.h>

#include <concepts>
#include <string>
#include <string_view>
#include <type_traits>

#include "kiln/errors.h"

namespace kiln {

namespace checked_detail {
template <class T>
std::string type_name() {
  return fmt::format("{}int{}", std::is_signed_v<T> ? "" : "u", sizeof(T) * 8);
}
}  // namespace checked_detail

// a * b, or E "WHAT: A * B overflows int64" (or the type T is).
template <class E = ValueError, std::integral T>
T checked_mul(T a, T b, std::string_view what) {
  T r;
  if (__builtin_mul_overflow(a, b, &r))
    throw E(fmt::format("{}: {} * {} overflows {}", what, a, b, checked_detail::type_name<T>()));
  return r;
}

// a + b, or E "WHAT: A + B overflows int64" (or the type T is).
template <class E = ValueError, std::integral T>
T checked_add(T a, T b, std::string_view what) {
  T r;
  if (__builtin_add_overflow(a, b, &r))
    throw E(fmt::format("{}: {} + {} overflows {}", what, a, b, checked_detail::type_name<T>()));
  return r;
}

}  // namespace kiln
