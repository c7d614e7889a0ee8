#include "kiln/graph/quantization.h"

#include <fmt/format.h>

#include <cmath>
#include <cstring>

#include "kiln/errors.h"
#include "kiln/graph/dtype.h"

namespace kiln::graph {

std::string_view encoding_name(QuantizationEncoding e) {
  switch (e) {
    case QuantizationEncoding::q8_0: return "q8_0";
  }
  return "?";
}

QuantizationEncoding parse_encoding(std::string_view text) {
  if (text == "q8_0") return QuantizationEncoding::q8_0;
  throw ValueError(fmt::format("unknown quantization encoding '{}' (expected q8_0)", text));
}

int64_t block_size(QuantizationEncoding) { return kQ8_0BlockSize; }
int64_t block_bytes(QuantizationEncoding) { return kQ8_0BlockBytes; }

int64_t quantized_row_bytes(QuantizationEncoding e, int64_t k, std::string_view what) {
  if (k <= 0 || k % block_size(e) != 0)
    throw ValueError(fmt::format("{}: {} needs K to be a positive multiple of {}, got {}", what, encoding_name(e),
                                 block_size(e), k));
  return k / block_size(e) * block_bytes(e);
}

int64_t quantized_row_elements(QuantizationEncoding e, int64_t row_bytes, std::string_view what) {
  if (row_bytes <= 0 || row_bytes % block_bytes(e) != 0)
    throw ValueError(fmt::format("{}: a {} row must be a positive multiple of {} bytes, got {}", what,
                                 encoding_name(e), block_bytes(e), row_bytes));
  return row_bytes / block_bytes(e) * block_size(e);
}

void quantize_q8_0(const float* x, int64_t k, uint8_t* out) {
  for (int64_t b = 0; b < k / kQ8_0BlockSize; ++b) {
    const float* src = x + b * kQ8_0BlockSize;
    uint8_t* block = out + b * kQ8_0BlockBytes;
    // Plain comparisons instead of fmax/round, which are library calls in a build without -march
    // (they made quantizing at load slower than reading the checkpoint); the results are the same:
    // a NaN is skipped by the maximum and clamps to 127, halves round away from zero.
    float amax = 0.0f;
    for (int64_t i = 0; i < kQ8_0BlockSize; ++i) {
      const float a = std::fabs(src[i]);
      amax = a > amax ? a : amax;
    }
    const float d = amax / 127.0f;
    const float inv = d != 0.0f ? 1.0f / d : 0.0f;
    const uint16_t d_bits = f32_to_f16(d);
    std::memcpy(block, &d_bits, 2);
    for (int64_t i = 0; i < kQ8_0BlockSize; ++i) {
      // |x * inv| <= 127 up to rounding; the clamp keeps a NaN-free row inside int8 regardless.
      float v = src[i] * inv;
      v = v < 127.0f ? v : 127.0f;
      v = v > -127.0f ? v : -127.0f;
      auto q = static_cast<int32_t>(v);             // toward zero; exact, |v| <= 127
      const float frac = v - static_cast<float>(q);  // exact
      q += frac >= 0.5f ? 1 : (frac <= -0.5f ? -1 : 0);
      block[2 + i] = static_cast<uint8_t>(static_cast<int8_t>(q));
    }
  }
}

void dequantize_q8_0(const uint8_t* row, int64_t k, float* out) {
  for (int64_t b = 0; b < k / kQ8_0BlockSize; ++b) {
    const uint8_t* block = row + b * kQ8_0BlockBytes;
    uint16_t d_bits;
    std::memcpy(&d_bits, block, 2);
    const float d = f16_to_f32(d_bits);
    for (int64_t i = 0; i < kQ8_0BlockSize; ++i)
      out[b * kQ8_0BlockSize + i] = d * static_cast<float>(static_cast<int8_t>(block[2 + i]));
  }
}

}  // namespace kiln::graph
