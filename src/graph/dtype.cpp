#include "kiln/graph/dtype.h"

#include <bit>
#include <cmath>
#include <cstring>
#include <limits>

#include <fmt/format.h>
#include <string>

#include "kiln/errors.h"

namespace kiln {

size_t dtype_size(DType d) {
  switch (d) {
    case DType::f32: return 4;
    case DType::f16: return 2;
    case DType::bf16: return 2;
    case DType::f64: return 8;
    case DType::i8: return 1;
    case DType::i16: return 2;
    case DType::i32: return 4;
    case DType::i64: return 8;
    case DType::u8: return 1;
    case DType::u16: return 2;
    case DType::u32: return 4;
    case DType::u64: return 8;
    case DType::boolean: return 1;
  }
  throw ValueError("dtype_size: invalid dtype value " + std::to_string(static_cast<int>(d)));
}

std::string_view dtype_name(DType d) {
  switch (d) {
    case DType::f32: return "f32";
    case DType::f16: return "f16";
    case DType::bf16: return "bf16";
    case DType::f64: return "f64";
    case DType::i8: return "i8";
    case DType::i16: return "i16";
    case DType::i32: return "i32";
    case DType::i64: return "i64";
    case DType::u8: return "u8";
    case DType::u16: return "u16";
    case DType::u32: return "u32";
    case DType::u64: return "u64";
    case DType::boolean: return "bool";
  }
  return "<invalid dtype>";
}

DType parse_dtype(std::string_view text) {
  for (DType d : kAllDTypes)
    if (dtype_name(d) == text) return d;
  throw ValueError("parse_dtype: unknown dtype '" + std::string(text) +
                   "' (expected one of f32, f16, bf16, f64, i8, i16, i32, i64, u8, u16, u32, u64, bool)");
}

bool is_float(DType d) {
  return d == DType::f32 || d == DType::f16 || d == DType::bf16 || d == DType::f64;
}

bool is_integer(DType d) {
  switch (d) {
    case DType::i8:
    case DType::i16:
    case DType::i32:
    case DType::i64:
    case DType::u8:
    case DType::u16:
    case DType::u32:
    case DType::u64: return true;
    default: return false;
  }
}

bool is_signed(DType d) {
  return is_float(d) || d == DType::i8 || d == DType::i16 || d == DType::i32 || d == DType::i64;
}

// ---- 16-bit floats -------------------------------------------------------------------------------
// Bit-level conversions so results do not depend on the host FPU's rounding mode or F16C support.

uint16_t f32_to_f16(float value) {
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t magnitude = bits & 0x7FFFFFFFu;

  if (magnitude > 0x7F800000u)  // NaN: keep the top payload bits, force quiet so it cannot become inf
    return static_cast<uint16_t>(sign | 0x7E00u | ((magnitude >> 13) & 0x3FFu));
  if (magnitude >= 0x477FF000u)  // >= 65520, halfway between 65504 and 2^16: rounds (to even) to inf
    return static_cast<uint16_t>(sign | 0x7C00u);
  if (magnitude >= 0x38800000u) {  // normal in f16 (>= 2^-14): rebias exponent 127 -> 15, round 13 bits
    const uint32_t rebiased = magnitude - (112u << 23);
    const uint32_t rounded = rebiased + 0xFFFu + ((rebiased >> 13) & 1u);  // carry may bump the exponent
    return static_cast<uint16_t>(sign | (rounded >> 13));
  }
  // Subnormal or zero in f16: the result is round(value / 2^-24).
  const uint32_t exponent = magnitude >> 23;
  if (exponent < 102) return sign;  // below 2^-25: rounds to zero (2^-25 itself ties to even zero)
  const uint32_t mantissa = (magnitude & 0x7FFFFFu) | 0x800000u;  // value = mantissa * 2^(exponent-150)
  const uint32_t shift = 126 - exponent;                            // 14..24
  uint32_t quotient = mantissa >> shift;
  const uint32_t remainder = mantissa & ((1u << shift) - 1);
  const uint32_t half = 1u << (shift - 1);
  if (remainder > half || (remainder == half && (quotient & 1u))) ++quotient;  // may reach 0x400: normal
  return static_cast<uint16_t>(sign | quotient);
}

float f16_to_f32(uint16_t half) {
  const uint32_t sign = static_cast<uint32_t>(half & 0x8000u) << 16;
  const uint32_t exponent = (half >> 10) & 0x1Fu;
  uint32_t mantissa = half & 0x3FFu;
  uint32_t bits;
  if (exponent == 0x1F) {
    bits = sign | 0x7F800000u | (mantissa << 13);
    if (mantissa != 0) bits |= 0x400000u;  // quiet NaN
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    bits = sign;
  } else {  // subnormal: normalise so the leading 1 becomes the implicit bit
    uint32_t e = 113;
    while ((mantissa & 0x400u) == 0) {
      mantissa <<= 1;
      --e;
    }
    bits = sign | (e << 23) | ((mantissa & 0x3FFu) << 13);
  }
  return std::bit_cast<float>(bits);
}

void store_scalar(double value, DType dtype, void* out) {
  visit_dtype(dtype, [&]<class T>() {
    T element{};
    if constexpr (std::is_same_v<T, f16_t> || std::is_same_v<T, bf16_t>) {
      element = T(static_cast<float>(value));
    } else if constexpr (std::is_same_v<T, bool>) {
      element = value != 0.0;
    } else if constexpr (std::is_integral_v<T>) {
      if (!std::isfinite(value) || value < static_cast<double>(std::numeric_limits<T>::lowest()) ||
          value > static_cast<double>(std::numeric_limits<T>::max()))
        throw ValueError(fmt::format("{} does not fit in {}", value, dtype_name(dtype)));
      element = static_cast<T>(value);
    } else {
      element = static_cast<T>(value);
    }
    std::memcpy(out, &element, sizeof(T));
  });
}

}  // namespace kiln
