// graph::quantize_q8_0 (its AVX-512 path on CPUs that have it) against the GGUF Q8_0 definition
// written here with the C library (fmax, round):
// d = max|x| / 127 stored as f16, q = clamp(round(x / d), -127, 127), halves away from zero.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

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
