// Element types, their sizes and names, and the f16/bf16 <-> f32 conversions (round to nearest even).
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <string_view>

namespace kiln {

enum class DType : uint8_t { f32, f16, bf16, f64, i8, i16, i32, i64, u8, u16, u32, u64, boolean };

inline constexpr DType kAllDTypes[] = {DType::f32, DType::f16, DType::bf16, DType::f64, DType::i8,
                                       DType::i16, DType::i32, DType::i64,  DType::u8,  DType::u16,
                                       DType::u32, DType::u64, DType::boolean};

size_t dtype_size(DType);              // bytes per element (boolean: 1)
std::string_view dtype_name(DType);    // "f32", "bf16", "bool", ...
DType parse_dtype(std::string_view);   // inverse of dtype_name; throws ValueError naming the text
bool is_float(DType);                  // f32, f16, bf16, f64
bool is_integer(DType);                // signed or unsigned integers (not boolean)
bool is_signed(DType);                 // floats and signed integers

// IEEE half and bfloat16 as raw bits. Conversions from f32 round to nearest even; NaN stays NaN.
// The bfloat16 pair is inline: a few integer operations, called per element by every bf16 loop.
uint16_t f32_to_f16(float);
float f16_to_f32(uint16_t);
inline uint16_t f32_to_bf16(float value) {
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u)  // NaN: truncating could clear every payload bit, so force quiet
    return static_cast<uint16_t>((bits >> 16) | 0x40u);
  const uint32_t rounded = bits + 0x7FFFu + ((bits >> 16) & 1u);  // overflow rounds to inf, as it should
  return static_cast<uint16_t>(rounded >> 16);
}
inline float bf16_to_f32(uint16_t bits) { return std::bit_cast<float>(static_cast<uint32_t>(bits) << 16); }

// Converts `value` to one element of `dtype` and stores it at `out` (dtype_size(dtype) bytes): floats
// round (f16/bf16 to nearest even), bool is value != 0, integers must hold the value exactly in range
// (ValueError naming the value and dtype otherwise, since out-of-range conversion is undefined).
void store_scalar(double value, DType dtype, void* out);

// Storage types for the 16-bit floats, so kernels and tests can hold them in arrays.
struct f16_t {
  uint16_t bits = 0;
  f16_t() = default;
  explicit f16_t(float v) : bits(f32_to_f16(v)) {}
  explicit operator float() const { return f16_to_f32(bits); }
};
struct bf16_t {
  uint16_t bits = 0;
  bf16_t() = default;
  explicit bf16_t(float v) : bits(f32_to_bf16(v)) {}
  explicit operator float() const { return bf16_to_f32(bits); }
};

// The C++ type that holds one element of a DType.
template <DType D> struct dtype_traits;
template <> struct dtype_traits<DType::f32> { using type = float; };
template <> struct dtype_traits<DType::f16> { using type = f16_t; };
template <> struct dtype_traits<DType::bf16> { using type = bf16_t; };
template <> struct dtype_traits<DType::f64> { using type = double; };
template <> struct dtype_traits<DType::i8> { using type = int8_t; };
template <> struct dtype_traits<DType::i16> { using type = int16_t; };
template <> struct dtype_traits<DType::i32> { using type = int32_t; };
template <> struct dtype_traits<DType::i64> { using type = int64_t; };
template <> struct dtype_traits<DType::u8> { using type = uint8_t; };
template <> struct dtype_traits<DType::u16> { using type = uint16_t; };
template <> struct dtype_traits<DType::u32> { using type = uint32_t; };
template <> struct dtype_traits<DType::u64> { using type = uint64_t; };
template <> struct dtype_traits<DType::boolean> { using type = bool; };

// The DType of a C++ element type (float -> f32, bf16_t -> bf16, ...).
template <class T> constexpr DType dtype_of();
template <> constexpr DType dtype_of<float>() { return DType::f32; }
template <> constexpr DType dtype_of<f16_t>() { return DType::f16; }
template <> constexpr DType dtype_of<bf16_t>() { return DType::bf16; }
template <> constexpr DType dtype_of<double>() { return DType::f64; }
template <> constexpr DType dtype_of<int8_t>() { return DType::i8; }
template <> constexpr DType dtype_of<int16_t>() { return DType::i16; }
template <> constexpr DType dtype_of<int32_t>() { return DType::i32; }
template <> constexpr DType dtype_of<int64_t>() { return DType::i64; }
template <> constexpr DType dtype_of<uint8_t>() { return DType::u8; }
template <> constexpr DType dtype_of<uint16_t>() { return DType::u16; }
template <> constexpr DType dtype_of<uint32_t>() { return DType::u32; }
template <> constexpr DType dtype_of<uint64_t>() { return DType::u64; }
template <> constexpr DType dtype_of<bool>() { return DType::boolean; }

// Calls f.template operator()<T>() with T the element type of d: one switch for every dtype dispatch.
template <class F> decltype(auto) visit_dtype(DType d, F&& f) {
  switch (d) {
    case DType::f32: return f.template operator()<float>();
    case DType::f16: return f.template operator()<f16_t>();
    case DType::bf16: return f.template operator()<bf16_t>();
    case DType::f64: return f.template operator()<double>();
    case DType::i8: return f.template operator()<int8_t>();
    case DType::i16: return f.template operator()<int16_t>();
    case DType::i32: return f.template operator()<int32_t>();
    case DType::i64: return f.template operator()<int64_t>();
    case DType::u8: return f.template operator()<uint8_t>();
    case DType::u16: return f.template operator()<uint16_t>();
    case DType::u32: return f.template operator()<uint32_t>();
    case DType::u64: return f.template operator()<uint64_t>();
    case DType::boolean: break;
  }
  return f.template operator()<bool>();
}

}  // namespace kiln
