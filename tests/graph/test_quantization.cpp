// graph::quantize_q8_0 (its AVX-512 path on CPUs that have it) against the GGUF Q8_0 definition
// written here with the C library (fmax, round):
// d = max|x| / 127 stored as f16, q = clamp(round(x / d), -127, 127), halves away from zero.
// Then every encoding's dequantize_row against loops written here from quantization.h's layouts,
// hand-computed blocks, and quantize_row's round trip.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "test_util.h"
#include "kiln/errors.h"
#include "kiln/graph/dtype.h"
#include "kiln/graph/quantization.h"

namespace {

using namespace kiln;

std::vector<int8_t> reference_quants(const float* x) {
  float amax = 0.0f;
  for (int i = 0; i < 32; ++i) amax = std::fmax(amax, std::fabs(x[i]));
  const float d = amax / 127.0f;
  const float inv = d != 0.0f ? 1.0f / d : 0.0f;
  std::vector<int8_t> q(32);
  for (int i = 0; i < 32; ++i)
    q[static_cast<size_t>(i)] = static_cast<int8_t>(std::fmax(-127.0f, std::fmin(127.0f, std::round(x[i] * inv))));
  return q;
}

void expect_matches_reference(const std::vector<float>& x) {
  std::vector<uint8_t> block(34);
  graph::quantize_q8_0(x.data(), 32, block.data());
  const std::vector<int8_t> want = reference_quants(x.data());
  for (int i = 0; i < 32; ++i)
    EXPECT_EQ(static_cast<int8_t>(block[static_cast<size_t>(2 + i)]), want[static_cast<size_t>(i)])
        << "element " << i << " = " << x[static_cast<size_t>(i)];
}

TEST(QuantizeQ8_0, MatchesTheDefinitionOnRandomBlocks) {
  uint32_t seed = 7;
  for (int block = 0; block < 2000; ++block) {
    std::vector<float> x(32);
    const float range = std::ldexp(1.0f, block % 40 - 20);
    for (float& v : x) {
      seed = seed * 1664525u + 1013904223u;
      v = (static_cast<float>(seed >> 8) / 8388608.0f - 1.0f) * range;
    }
    expect_matches_reference(x);
  }
}

TEST(QuantizeQ8_0, HalvesRoundAwayFromZero) {
  // max |x| = 127 makes d = 1 exactly, so x / d are the halves themselves.
  std::vector<float> x{127.0f, 0.5f, -0.5f, 1.5f, -1.5f, 2.5f, -2.5f, 126.5f, -126.5f, 0.49999997f, -0.49999997f};
  x.resize(32, 0.25f);
  expect_matches_reference(x);
  std::vector<uint8_t> block(34);
  graph::quantize_q8_0(x.data(), 32, block.data());
  EXPECT_EQ(static_cast<int8_t>(block[2 + 1]), 1);
  EXPECT_EQ(static_cast<int8_t>(block[2 + 2]), -1);
  EXPECT_EQ(static_cast<int8_t>(block[2 + 5]), 3);
  EXPECT_EQ(static_cast<int8_t>(block[2 + 9]), 0);
}

TEST(QuantizeQ8_0, NanAndInfinityStayInsideInt8) {
  std::vector<float> x(32, 1.0f);
  x[3] = std::numeric_limits<float>::quiet_NaN();
  expect_matches_reference(x);
  x[3] = std::numeric_limits<float>::infinity();
  expect_matches_reference(x);
  std::vector<float> zeros(32, 0.0f);
  expect_matches_reference(zeros);
}

}  // namespace

// ==== Q4_0, Q4_K, Q5_K, Q6_K: dequantize_row against loops written here from the layouts of
// quantization.h (one weight at a time, its bits looked up where the layout says), bit for bit ====

namespace {

using kiln::graph::QuantizationEncoding;
using namespace kiln;

float f16_at(const uint8_t* p) { return kiln::f16_to_f32(static_cast<uint16_t>(p[0] | p[1] << 8)); }
void put_f16(uint8_t* p, float v) {
  const uint16_t bits = kiln::f32_to_f16(v);
  p[0] = static_cast<uint8_t>(bits & 0xFF);
  p[1] = static_cast<uint8_t>(bits >> 8);
}

// Weight i of one block, straight from the layout description.
float reference_weight(QuantizationEncoding e, const uint8_t* b, int i) {
  switch (e) {
    case QuantizationEncoding::q8_0: return f16_at(b) * static_cast<float>(static_cast<int8_t>(b[2 + i]));
    case QuantizationEncoding::q4_0: {
      const int nibble = i < 16 ? b[2 + i] & 15 : b[2 + i - 16] >> 4;
      return static_cast<float>(nibble - 8) * f16_at(b);
    }
    case QuantizationEncoding::q4_k:
    case QuantizationEncoding::q5_k: {
      const bool five = e == QuantizationEncoding::q5_k;
      const uint8_t* s = b + 4;
      const int j = i / 32, l = i % 32;
      const int sc = j < 4 ? s[j] & 63 : (s[j + 4] & 15) | (s[j - 4] >> 6) << 4;
      const int m = j < 4 ? s[j + 4] & 63 : (s[j + 4] >> 4) | (s[j] >> 6) << 4;
      const uint8_t byte = b[(five ? 48 : 16) + 32 * (j / 2) + l];
      int q = j % 2 == 0 ? byte & 15 : byte >> 4;
      if (five && (b[16 + l] >> j & 1)) q += 16;
      return f16_at(b) * static_cast<float>(sc) * static_cast<float>(q) - f16_at(b + 2) * static_cast<float>(m);
    }
    case QuantizationEncoding::q6_k: {
      const int h = i / 128, t = i % 128 / 32, l = i % 32;
      const uint8_t* L = b + 64 * h;
      const uint8_t H = b[128 + 32 * h + l];
      int q = 0;
      if (t == 0) q = (L[l] & 15) | (H & 3) << 4;
      if (t == 1) q = (L[l + 32] & 15) | (H >> 2 & 3) << 4;
      if (t == 2) q = (L[l] >> 4) | (H >> 4 & 3) << 4;
      if (t == 3) q = (L[l + 32] >> 4) | (H >> 6 & 3) << 4;
      const auto scale = static_cast<int8_t>(b[192 + i / 16]);
      return f16_at(b + 208) * static_cast<float>(scale) * static_cast<float>(q - 32);
    }
  }
  return 0;
}

std::vector<float> reference_row(QuantizationEncoding e, const std::vector<uint8_t>& row, int64_t k) {
  const int64_t n = graph::block_size(e), bytes = graph::block_bytes(e);
  std::vector<float> out;
  for (int64_t b = 0; b < k / n; ++b)
    for (int i = 0; i < n; ++i) out.push_back(reference_weight(e, row.data() + b * bytes, i));
  return out;
}

// Random bytes, with every f16 field a random finite value (a random exponent within [2^-14, 2^14]).
std::vector<uint8_t> random_blocks(QuantizationEncoding e, int64_t blocks, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint8_t> row(static_cast<size_t>(blocks * graph::block_bytes(e)));
  for (uint8_t& v : row) v = static_cast<uint8_t>(rng());
  std::uniform_real_distribution<float> mantissa(-2.0f, 2.0f);
  std::uniform_int_distribution<int> exponent(-14, 14);
  for (int64_t b = 0; b < blocks; ++b) {
    uint8_t* block = row.data() + b * graph::block_bytes(e);
    const auto scale = [&] { return std::ldexp(mantissa(rng), exponent(rng)); };
    if (e == QuantizationEncoding::q6_k) {
      put_f16(block + 208, scale());
    } else {
      put_f16(block, scale());
      if (e == QuantizationEncoding::q4_k || e == QuantizationEncoding::q5_k) put_f16(block + 2, scale());
    }
  }
  return row;
}

std::string name(QuantizationEncoding e) { return std::string(graph::encoding_name(e)); }

uint32_t bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

TEST(DequantizeRow, MatchesTheLayoutBitForBitOnRandomBlocks) {
  for (QuantizationEncoding e : graph::kAllEncodings)
    for (uint32_t seed = 1; seed <= 20; ++seed) {
      const int64_t blocks = seed % 5 + 1, k = blocks * graph::block_size(e);
      const std::vector<uint8_t> row = random_blocks(e, blocks, seed);
      std::vector<float> got(static_cast<size_t>(k));
      graph::dequantize_row(e, row.data(), k, got.data());
      const std::vector<float> want = reference_row(e, row, k);
      for (int64_t i = 0; i < k; ++i)
        ASSERT_EQ(bits(got[i]), bits(want[i])) << name(e) << " seed " << seed << " weight " << i << ": " << got[i]
                                               << " vs " << want[i];
    }
}

std::vector<float> dequantized(QuantizationEncoding e, const std::vector<uint8_t>& row) {
  const int64_t k = static_cast<int64_t>(row.size()) / graph::block_bytes(e) * graph::block_size(e);
  std::vector<float> out(static_cast<size_t>(k));
  graph::dequantize_row(e, row.data(), k, out.data());
  return out;
}

TEST(DequantizeRow, Q4_0HandComputedBlock) {
  std::vector<uint8_t> block(18, 0x88);  // every nibble 8: weight 0
  put_f16(block.data(), 0.5f);
  block[2] = 0x9F;  // weight 0: (15 - 8) / 2, weight 16: (9 - 8) / 2
  block[3] = 0x08;  // weight 1: 0, weight 17: (0 - 8) / 2
  const std::vector<float> w = dequantized(QuantizationEncoding::q4_0, block);
  EXPECT_EQ(w[0], 3.5f);
  EXPECT_EQ(w[16], 0.5f);
  EXPECT_EQ(w[1], 0.0f);
  EXPECT_EQ(w[17], -4.0f);
  EXPECT_EQ(w[5], 0.0f);
}

// d = 1, dmin = 0.5; sub-block 0: scale 2, min 3; sub-block 5: scale 37 (0b100101), min 17 (0b010001),
// whose high 2 bits sit in bits 6-7 of bytes 1 and 5, low 4 bits in byte 9; every other scale and min 0.
std::vector<uint8_t> k_block(bool five) {
  std::vector<uint8_t> block(five ? 176 : 144, 0);
  put_f16(block.data(), 1.0f);
  put_f16(block.data() + 2, 0.5f);
  uint8_t* s = block.data() + 4;
  s[0] = 2;
  s[4] = 3;
  s[9] = 0x15;         // scale 5's low nibble 5, min 5's low nibble 1
  s[1] = 0x80;         // scale 5's high bits 0b10; scale 1 stays 0
  s[5] = 0x40;         // min 5's high bits 0b01; min 1 stays 0
  uint8_t* q = block.data() + (five ? 48 : 16);
  q[0] = 0x07;         // sub-block 0 (pair 0, low nibble), weight 0: 7
  q[64 + 3] = 0x90;    // sub-block 5 (pair 2, high nibble), weight 3: 9
  if (five) block[16 + 3] = 1 << 5;  // ... plus 16 in Q5_K
  return block;
}

TEST(DequantizeRow, Q4_KAndQ5_KHandComputedBlocks) {
  const std::vector<float> w4 = dequantized(QuantizationEncoding::q4_k, k_block(false));
  EXPECT_EQ(w4[0], 12.5f);                // 1 * 2 * 7 - 0.5 * 3
  EXPECT_EQ(w4[1], -1.5f);                // level 0: - 0.5 * 3
  EXPECT_EQ(w4[5 * 32 + 3], 324.5f);      // 37 * 9 - 0.5 * 17
  EXPECT_EQ(w4[5 * 32 + 4], -8.5f);
  EXPECT_EQ(w4[32], 0.0f);                // sub-block 1: scale 0, min 0
  const std::vector<float> w5 = dequantized(QuantizationEncoding::q5_k, k_block(true));
  EXPECT_EQ(w5[0], 12.5f);
  EXPECT_EQ(w5[5 * 32 + 3], 916.5f);      // 37 * (9 + 16) - 0.5 * 17
  EXPECT_EQ(w5[3], 1.0f * 2 * 0 - 1.5f);  // the high bit of weight 3 belongs to sub-block 5 only
}

TEST(DequantizeRow, Q6_KHandComputedBlock) {
  std::vector<uint8_t> block(210, 0);
  put_f16(block.data() + 208, 0.25f);
  block[192 + 0] = 3;                        // weights 0..15
  block[192 + 5] = static_cast<uint8_t>(-2);  // weights 80..95
  block[0] = 0x05;                           // weight 0: low nibble 5 ...
  block[128] = 0x02;                         // ... and high bits 2: level 37
  block[16] = 0x10;                          // weight 80 (half 0, quarter 2, l 16): high nibble 1, level 1
  const std::vector<float> w = dequantized(QuantizationEncoding::q6_k, block);
  EXPECT_EQ(w[0], 3.75f);   // 0.25 * 3 * (37 - 32)
  EXPECT_EQ(w[1], -24.0f);  // 0.25 * 3 * (0 - 32)
  EXPECT_EQ(w[80], 15.5f);  // 0.25 * -2 * (1 - 32)
  EXPECT_EQ(w[16], 0.0f);   // scale 1 is 0
}

// ==== quantize_row ====

std::vector<uint8_t> quantized(QuantizationEncoding e, const std::vector<float>& x) {
  std::vector<uint8_t> row(static_cast<size_t>(graph::quantized_row_bytes(e, static_cast<int64_t>(x.size()))));
  graph::quantize_row(e, x.data(), static_cast<int64_t>(x.size()), row.data());
  return row;
}

std::vector<float> normal_floats(int64_t n, uint32_t seed, float scale) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = dist(rng);
  return v;
}

// RMS and largest error of the round trip per block, over the block's range (max - min), on normal
// data: the bounds are a little above what ggml's reference quantizers reach.
TEST(QuantizeRow, RoundTripErrorIsWithinEachFormatsBound) {
  struct Bound {
    QuantizationEncoding e;
    double rms_over_range;  // worst block of 64 rows x 4096
    double max_over_range;  // worst element
  };
  // Measured worst (64 rows of 4096, sigma 3 and 0.02): q8_0 0.0019 / 0.0031, q4_0 0.031 / 0.0625
  // (its bound: half a step, max|x| / 16, for a block of one sign), q4_k 0.015 / 0.043,
  // q5_k 0.0077 / 0.025, q6_k 0.0039 / 0.0103.
  const Bound bounds[] = {
      {QuantizationEncoding::q8_0, 0.0025, 0.0045},
      {QuantizationEncoding::q4_0, 0.035, 0.0675},
      {QuantizationEncoding::q4_k, 0.018, 0.050},
      {QuantizationEncoding::q5_k, 0.0095, 0.030},
      {QuantizationEncoding::q6_k, 0.0048, 0.013},
  };
  for (const Bound& bound : bounds) {
    double worst_rms = 0, worst_max = 0;
    for (uint32_t seed = 0; seed < 64; ++seed) {
      const std::vector<float> x = normal_floats(4096, seed, seed % 2 ? 0.02f : 3.0f);
      const std::vector<float> back = dequantized(bound.e, quantized(bound.e, x));
      const int64_t n = graph::block_size(bound.e);
      for (int64_t b = 0; b < 4096 / n; ++b) {
        double lo = x[b * n], hi = x[b * n], sq = 0, mx = 0;
        for (int64_t i = b * n; i < (b + 1) * n; ++i) {
          lo = std::min<double>(lo, x[i]);
          hi = std::max<double>(hi, x[i]);
          const double err = std::fabs(double(back[i]) - x[i]);
          sq += err * err;
          mx = std::max(mx, err);
        }
        worst_rms = std::max(worst_rms, std::sqrt(sq / n) / (hi - lo));
        worst_max = std::max(worst_max, mx / (hi - lo));
      }
    }
    EXPECT_LE(worst_rms, bound.rms_over_range) << name(bound.e);
    EXPECT_LE(worst_max, bound.max_over_range) << name(bound.e);
    std::printf("%s: worst block RMS error / range %.5f, worst element %.5f\n", name(bound.e).c_str(), worst_rms,
                worst_max);
  }
}

TEST(QuantizeRow, ZeroRowsDequantizeToExactZeros) {
  for (QuantizationEncoding e : graph::kAllEncodings) {
    const std::vector<float> zeros(512, 0.0f);
    const std::vector<uint8_t> row = quantized(e, zeros);
    for (float v : dequantized(e, row)) ASSERT_EQ(v, 0.0f) << name(e);
    // Zero scales everywhere; Q4_0's is -0 (ggml's d = max / -8) and its quants 8 (its zero level).
    for (size_t i = 0; i < row.size(); ++i) {
      const uint8_t want = e != QuantizationEncoding::q4_0 ? 0 : i % 18 == 0 ? 0x00 : i % 18 == 1 ? 0x80 : 0x88;
      ASSERT_EQ(row[i], want) << name(e) << " byte " << i;
    }
  }
}

// quantize(dequantize(q)) == q where it holds. Q8_0 and Q4_0 find their own grid again: the block's
// largest magnitude is at an end of the level range (127, or level 0 = -8 d), so d comes back exactly
// and every level rounds to itself. Q4_K's search lands on its own output too on these rows (all 128
// super-blocks); Q6_K's gives back the same weights, though not always the same bytes (about 1 block
// in 5 finds an equivalent pair of scales); Q5_K's search can move (5% of blocks, by up to a step),
// so it is not checked.
TEST(QuantizeRow, QuantizingDequantizedRowsGivesThemBack) {
  for (uint32_t seed = 0; seed < 8; ++seed) {
    const std::vector<float> x = normal_floats(4096, seed, 1.0f);
    for (QuantizationEncoding e : {QuantizationEncoding::q8_0, QuantizationEncoding::q4_0, QuantizationEncoding::q4_k}) {
      const std::vector<uint8_t> once = quantized(e, x);
      EXPECT_EQ(quantized(e, dequantized(e, once)), once) << name(e) << " seed " << seed;
    }
    const std::vector<float> q6 = dequantized(QuantizationEncoding::q6_k, quantized(QuantizationEncoding::q6_k, x));
    EXPECT_EQ(dequantized(QuantizationEncoding::q6_k, quantized(QuantizationEncoding::q6_k, q6)), q6) << "seed " << seed;
  }
}

// Inputs on a grid the format represents exactly: ggml's search ends at that grid, so the scales are
// known in advance and the round trip is exact. Sub-block j of Q4_K / Q5_K holds c * s_j * (l % levels)
// (min 0): scale s_j, d = c (the mins, scaled by a dmin that is 0 or below f16's range, add nothing).
TEST(QuantizeRow, KQuantsFindAnExactGrid) {
  const float c = 0.125f;
  const int s[8] = {63, 10, 1, 33, 17, 50, 2, 40};
  for (bool five : {false, true}) {
    const QuantizationEncoding e = five ? QuantizationEncoding::q5_k : QuantizationEncoding::q4_k;
    const int levels = five ? 32 : 16;
    std::vector<float> x(256);
    for (int j = 0; j < 8; ++j)
      for (int l = 0; l < 32; ++l) x[32 * j + l] = c * static_cast<float>(s[j] * (l % levels));
    const std::vector<uint8_t> row = quantized(e, x);
    EXPECT_EQ(f16_at(row.data()), c) << name(e);
    uint8_t sc[8], mn[8];
    graph::unpack_k_scales(row.data() + 4, sc, mn);
    for (int j = 0; j < 8; ++j) EXPECT_EQ(sc[j], s[j]) << name(e) << " sub-block " << j;
    EXPECT_EQ(dequantized(e, row), x) << name(e);
  }
  // Q6_K: sub-block j (16 weights) holds c * t_j * (4 l - 32), levels -32..28, -32 the largest
  // magnitude; the largest sub-block scale maps to int8 -128, so the scales are -t_j and d = -c.
  const int t[16] = {128, 64, 32, 100, 1, 7, 90, 128, 3, 5, 77, 64, 16, 8, 120, 2};
  std::vector<float> x(256);
  for (int j = 0; j < 16; ++j)
    for (int l = 0; l < 16; ++l) x[16 * j + l] = c * static_cast<float>(t[j] * (4 * l - 32));
  const std::vector<uint8_t> row = quantized(QuantizationEncoding::q6_k, x);
  EXPECT_EQ(f16_at(row.data() + 208), -c);
  for (int j = 0; j < 16; ++j) EXPECT_EQ(static_cast<int8_t>(row[192 + j]), -t[j]) << "sub-block " << j;
  EXPECT_EQ(dequantized(QuantizationEncoding::q6_k, row), x);
}

// The K-quants' SIMD quantizers (the sub-blocks in lanes, each in the portable order) give the
// portable loops' bytes: normal and uniform rows at several scales, with sub-blocks that are all
// zero, constant, of one sign, or a single spike.
TEST(QuantizeRow, SimdAndPortableKQuantizersGiveTheSameBytes) {
  std::mt19937 rng(11);
  std::vector<std::vector<float>> rows;
  for (float scale : {1e-6f, 0.02f, 1.0f, 300.0f}) {
    rows.push_back(normal_floats(2048, static_cast<uint32_t>(rows.size()), scale));
    std::uniform_real_distribution<float> uniform(-scale, scale);
    std::vector<float> u(2048);
    for (float& v : u) v = uniform(rng);
    for (int i = 0; i < 16; ++i) u[i] = 0.0f;           // a Q6_K sub-block of zeros
    for (int i = 256; i < 288; ++i) u[i] = 0.0f;        // a Q4_K sub-block of zeros
    for (int i = 512; i < 544; ++i) u[i] = scale / 3;   // constant, positive
    for (int i = 768; i < 800; ++i) u[i] = -scale / 3;  // constant, negative
    for (int i = 1024; i < 1056; ++i) u[i] = std::fabs(u[i]);
    for (int i = 1280; i < 1312; ++i) u[i] = i == 1290 ? scale : 0.0f;
    rows.push_back(u);
  }
  for (QuantizationEncoding e : {QuantizationEncoding::q4_k, QuantizationEncoding::q5_k, QuantizationEncoding::q6_k})
    for (size_t r = 0; r < rows.size(); ++r) {
      std::vector<uint8_t> portable(static_cast<size_t>(graph::quantized_row_bytes(e, 2048)));
      graph::quantize_row_portable(e, rows[r].data(), 2048, portable.data());
      EXPECT_EQ(quantized(e, rows[r]), portable) << name(e) << " row " << r;
    }
}

TEST(QuantizeRow, RowSizeErrorsNameTheEncodingAndItsBlock) {
  kiln::testing::expect_error<ValueError>(
      [] { graph::quantized_row_bytes(QuantizationEncoding::q4_k, 288, "w1.weight"); },
      {"w1.weight", "q4_k", "multiple of 256", "288"});
  kiln::testing::expect_error<ValueError>([] { graph::quantized_row_elements(QuantizationEncoding::q6_k, 200); },
                                          {"q6_k", "210", "200"});
  EXPECT_EQ(graph::quantized_row_bytes(QuantizationEncoding::q4_0, 4096), 2304);
  EXPECT_EQ(graph::quantized_row_bytes(QuantizationEncoding::q4_k, 4096), 2304);
  EXPECT_EQ(graph::quantized_row_bytes(QuantizationEncoding::q5_k, 4096), 2816);
  EXPECT_EQ(graph::quantized_row_bytes(QuantizationEncoding::q6_k, 4096), 3360);
  for (QuantizationEncoding e : graph::kAllEncodings) EXPECT_EQ(graph::parse_encoding(graph::encoding_name(e)), e);
}

}  // namespace
