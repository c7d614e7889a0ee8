#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <limits>

#include "kiln/errors.h"
#include "kiln/graph/dtype.h"

using namespace kiln;

namespace {
uint32_t bits_of(float f) { return std::bit_cast<uint32_t>(f); }
float float_of(uint32_t b) { return std::bit_cast<float>(b); }
}  // namespace

TEST(DType, SizesMatchTheElementTypes) {
  EXPECT_EQ(dtype_size(DType::f32), 4u);
  EXPECT_EQ(dtype_size(DType::f16), 2u);
  EXPECT_EQ(dtype_size(DType::bf16), 2u);
  EXPECT_EQ(dtype_size(DType::f64), 8u);
  EXPECT_EQ(dtype_size(DType::i8), 1u);
  EXPECT_EQ(dtype_size(DType::i16), 2u);
  EXPECT_EQ(dtype_size(DType::i32), 4u);
  EXPECT_EQ(dtype_size(DType::i64), 8u);
  EXPECT_EQ(dtype_size(DType::u8), 1u);
  EXPECT_EQ(dtype_size(DType::u16), 2u);
  EXPECT_EQ(dtype_size(DType::u32), 4u);
  EXPECT_EQ(dtype_size(DType::u64), 8u);
  EXPECT_EQ(dtype_size(DType::boolean), 1u);
  // The storage types the traits name have the same size.
  for (DType d : kAllDTypes)
    EXPECT_EQ(visit_dtype(d, []<class T>() { return sizeof(T); }), dtype_size(d)) << dtype_name(d);
}

TEST(DType, NamesRoundTripThroughParse) {
  const char* expected[] = {"f32", "f16", "bf16", "f64", "i8",  "i16", "i32",
                            "i64", "u8",  "u16",  "u32", "u64", "bool"};
  size_t i = 0;
  for (DType d : kAllDTypes) {
    EXPECT_EQ(dtype_name(d), expected[i++]);
    EXPECT_EQ(parse_dtype(dtype_name(d)), d);
  }
}

TEST(DType, ParseRejectsUnknownNamesNamingTheText) {
  try {
    parse_dtype("float32");
    FAIL() << "expected ValueError";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("'float32'"), std::string::npos) << e.what();
  }
  EXPECT_THROW(parse_dtype(""), ValueError);
  EXPECT_THROW(parse_dtype("F32"), ValueError);
}

TEST(DType, ClassifiesFloatsIntegersAndSignedness) {
  EXPECT_TRUE(is_float(DType::bf16));
  EXPECT_FALSE(is_float(DType::i32));
  EXPECT_FALSE(is_float(DType::boolean));
  EXPECT_TRUE(is_integer(DType::u64));
  EXPECT_TRUE(is_integer(DType::i8));
  EXPECT_FALSE(is_integer(DType::boolean));
  EXPECT_FALSE(is_integer(DType::f16));
  EXPECT_TRUE(is_signed(DType::f32));
  EXPECT_TRUE(is_signed(DType::i16));
  EXPECT_FALSE(is_signed(DType::u16));
  EXPECT_FALSE(is_signed(DType::boolean));
}

TEST(DType, DtypeOfMapsElementTypes) {
  static_assert(dtype_of<float>() == DType::f32);
  static_assert(dtype_of<bf16_t>() == DType::bf16);
  static_assert(dtype_of<bool>() == DType::boolean);
  static_assert(std::is_same_v<dtype_traits<DType::u16>::type, uint16_t>);
  EXPECT_EQ(visit_dtype(DType::i64, []<class T>() { return dtype_of<T>(); }), DType::i64);
}

// ---- f16 ----------------------------------------------------------------------------------------

TEST(F16, ExactValuesHaveKnownBitPatterns) {
  EXPECT_EQ(f32_to_f16(1.0f), 0x3C00);
  EXPECT_EQ(f32_to_f16(-2.0f), 0xC000);
  EXPECT_EQ(f32_to_f16(0.5f), 0x3800);
  EXPECT_EQ(f32_to_f16(0.0f), 0x0000);
  EXPECT_EQ(f32_to_f16(-0.0f), 0x8000);
  EXPECT_EQ(f32_to_f16(65504.0f), 0x7BFF);  // largest finite
  EXPECT_EQ(f32_to_f16(std::ldexp(1.0f, -14)), 0x0400);  // smallest normal
  EXPECT_EQ(f32_to_f16(std::ldexp(1.0f, -24)), 0x0001);  // smallest subnormal
  EXPECT_EQ(f32_to_f16(std::ldexp(1023.0f, -24)), 0x03FF);  // largest subnormal
  EXPECT_EQ(f32_to_f16(std::numeric_limits<float>::infinity()), 0x7C00);
  EXPECT_EQ(f32_to_f16(-std::numeric_limits<float>::infinity()), 0xFC00);

  EXPECT_EQ(f16_to_f32(0x3C00), 1.0f);
  EXPECT_EQ(f16_to_f32(0x7BFF), 65504.0f);
  EXPECT_EQ(f16_to_f32(0x0001), std::ldexp(1.0f, -24));
  EXPECT_EQ(f16_to_f32(0x03FF), std::ldexp(1023.0f, -24));
  EXPECT_EQ(f16_to_f32(0x3555), 0.333251953125f);  // 1365/4096
  EXPECT_EQ(bits_of(f16_to_f32(0x8000)), 0x80000000u);
  EXPECT_EQ(f16_to_f32(0xFC00), -std::numeric_limits<float>::infinity());
}

TEST(F16, OverflowRoundsToInfinityFrom65520) {
  EXPECT_EQ(f32_to_f16(65519.996f), 0x7BFF);  // just below the halfway point
  EXPECT_EQ(f32_to_f16(65520.0f), 0x7C00);    // halfway: 0x7BFF is odd, so ties go up to inf
  EXPECT_EQ(f32_to_f16(-65520.0f), 0xFC00);
  EXPECT_EQ(f32_to_f16(1e10f), 0x7C00);
  EXPECT_EQ(f32_to_f16(std::numeric_limits<float>::max()), 0x7C00);
}

TEST(F16, RoundsToNearestTiesToEven) {
  // Near 1.0 the f16 step is 2^-10.
  const float step = std::ldexp(1.0f, -10);
  EXPECT_EQ(f32_to_f16(1.0f + step / 2), 0x3C00);      // tie, 0x3C00 even: down
  EXPECT_EQ(f32_to_f16(1.0f + 3 * step / 2), 0x3C02);  // tie, 0x3C01 odd: up
  EXPECT_EQ(f32_to_f16(1.0f + step / 2 + std::ldexp(1.0f, -20)), 0x3C01);  // above the tie
  EXPECT_EQ(f32_to_f16(1.0f + step / 4), 0x3C00);
  // Rounding carries into the exponent: just under 2.0 -> 2.0.
  EXPECT_EQ(f32_to_f16(2.0f - std::ldexp(1.0f, -12)), 0x4000);
}

TEST(F16, SubnormalsRoundToNearestEven) {
  const float tiny = std::ldexp(1.0f, -24);  // one f16 subnormal step
  EXPECT_EQ(f32_to_f16(tiny / 2), 0x0000);                     // tie to even zero
  EXPECT_EQ(f32_to_f16(-tiny / 2), 0x8000);                    // keeps the sign
  EXPECT_EQ(f32_to_f16(tiny * 0.5000001f), 0x0001);            // above the tie
  EXPECT_EQ(f32_to_f16(tiny * 1.5f), 0x0002);                  // tie, 1 odd: up
  EXPECT_EQ(f32_to_f16(tiny * 2.5f), 0x0002);                  // tie, 2 even: down
  EXPECT_EQ(f32_to_f16(tiny / 4), 0x0000);
  EXPECT_EQ(f32_to_f16(std::numeric_limits<float>::denorm_min()), 0x0000);
  EXPECT_EQ(f32_to_f16(std::ldexp(1023.5f, -24)), 0x0400);     // tie at the top rounds up to normal
}

TEST(F16, NaNStaysNaNAndBecomesQuiet) {
  const uint16_t h = f32_to_f16(std::numeric_limits<float>::quiet_NaN());
  EXPECT_EQ(h & 0x7C00, 0x7C00);
  EXPECT_NE(h & 0x03FF, 0);
  EXPECT_NE(h & 0x0200, 0) << "quiet bit";
  // A signalling NaN whose payload lies only in the low 13 bits must not collapse to inf.
  const uint16_t s = f32_to_f16(float_of(0x7F800001u));
  EXPECT_EQ(s & 0x7E00, 0x7E00);
  EXPECT_EQ(f32_to_f16(float_of(0xFFC00000u)) & 0x8000, 0x8000) << "sign kept";
  EXPECT_TRUE(std::isnan(f16_to_f32(0x7C01)));
  EXPECT_TRUE(std::isnan(f16_to_f32(0xFE00)));
}

TEST(F16, EveryBitPatternRoundTripsThroughF32) {
  for (uint32_t bits = 0; bits <= 0xFFFF; ++bits) {
    const auto h = static_cast<uint16_t>(bits);
    const float f = f16_to_f32(h);
    const bool is_nan = (h & 0x7C00) == 0x7C00 && (h & 0x03FF) != 0;
    if (is_nan) {
      ASSERT_TRUE(std::isnan(f)) << std::hex << bits;
      ASSERT_TRUE(std::isnan(f16_to_f32(f32_to_f16(f)))) << std::hex << bits;
    } else {
      ASSERT_EQ(f32_to_f16(f), h) << std::hex << bits;
    }
  }
}

TEST(F16, ConversionMatchesAReferenceFromTheValue) {
  // Reference: decode every finite positive f16 by its formula, then check the value's decoding.
  for (uint32_t bits = 0; bits < 0x7C00; ++bits) {
    const uint32_t e = bits >> 10, m = bits & 0x3FF;
    const double value = e == 0 ? std::ldexp(static_cast<double>(m), -24)
                                 : std::ldexp(1.0 + m / 1024.0, static_cast<int>(e) - 15);
    ASSERT_EQ(static_cast<double>(f16_to_f32(static_cast<uint16_t>(bits))), value) << std::hex << bits;
  }
}

TEST(F16, StorageTypeConvertsBothWays) {
  f16_t h(3.0f);
  EXPECT_EQ(h.bits, 0x4200);
  EXPECT_EQ(static_cast<float>(h), 3.0f);
}

// ---- bf16 ---------------------------------------------------------------------------------------

TEST(BF16, ExactValuesHaveKnownBitPatterns) {
  EXPECT_EQ(f32_to_bf16(1.0f), 0x3F80);
  EXPECT_EQ(f32_to_bf16(-2.0f), 0xC000);
  EXPECT_EQ(f32_to_bf16(0.0f), 0x0000);
  EXPECT_EQ(f32_to_bf16(-0.0f), 0x8000);
  EXPECT_EQ(f32_to_bf16(std::numeric_limits<float>::infinity()), 0x7F80);
  EXPECT_EQ(bf16_to_f32(0x3F80), 1.0f);
  EXPECT_EQ(bf16_to_f32(0x4049), 3.140625f);
  EXPECT_EQ(bits_of(bf16_to_f32(0x1234)), 0x12340000u);
}

TEST(BF16, RoundsToNearestTiesToEven) {
  EXPECT_EQ(f32_to_bf16(float_of(0x3F808000u)), 0x3F80);  // tie, 0x3F80 even: down
  EXPECT_EQ(f32_to_bf16(float_of(0x3F818000u)), 0x3F82);  // tie, 0x3F81 odd: up
  EXPECT_EQ(f32_to_bf16(float_of(0x3F808001u)), 0x3F81);  // above the tie
  EXPECT_EQ(f32_to_bf16(float_of(0x3F807FFFu)), 0x3F80);  // below the tie
  EXPECT_EQ(f32_to_bf16(float_of(0xBF818000u)), 0xBF82);  // negative: same on the magnitude
  EXPECT_EQ(f32_to_bf16(float_of(0x3FFFFFFFu)), 0x4000);  // carries into the exponent
}

TEST(BF16, OverflowRoundsToInfinity) {
  EXPECT_EQ(f32_to_bf16(std::numeric_limits<float>::max()), 0x7F80);  // 0x7F7FFFFF rounds up
  EXPECT_EQ(f32_to_bf16(float_of(0x7F7F7FFFu)), 0x7F7F);
}

TEST(BF16, NaNStaysNaN) {
  // Payload only in the low 16 bits: plain truncation would give 0x7F80, which is inf.
  const uint16_t b = f32_to_bf16(float_of(0x7F800001u));
  EXPECT_TRUE(std::isnan(bf16_to_f32(b)));
  EXPECT_EQ(b & 0x40, 0x40) << "quiet bit";
  EXPECT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16(std::numeric_limits<float>::quiet_NaN()))));
  EXPECT_EQ(f32_to_bf16(float_of(0xFFC00000u)), 0xFFC0);
}

TEST(BF16, EveryBitPatternRoundTripsThroughF32) {
  for (uint32_t bits = 0; bits <= 0xFFFF; ++bits) {
    const auto b = static_cast<uint16_t>(bits);
    const float f = bf16_to_f32(b);
    if (std::isnan(f))
      ASSERT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16(f)))) << std::hex << bits;
    else
      ASSERT_EQ(f32_to_bf16(f), b) << std::hex << bits;
  }
}
