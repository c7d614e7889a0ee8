#include "kiln/graph/quantization.h"

#include <fmt/format.h>

#include <cmath>
#include <cstring>

#include "kiln/errors.h"
#include "kiln/graph/dtype.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace kiln::graph {

namespace {

#if defined(__x86_64__)
// The same arithmetic as the portable loop in quantize_q8_0, 16 lanes at a time (quantizing a
// checkpoint at load runs this over every weight). max_ps/min_ps return their second operand when
// either is NaN, which gives the portable loop's NaN rules: skipped by the maximum, clamped to 127.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // GCC 12 on AVX-512 intrinsics (bug 105593)
__attribute__((target("avx512f"))) void quantize_q8_0_avx512(const float* x, int64_t k, uint8_t* out) {
  for (int64_t b = 0; b < k / kQ8_0BlockSize; ++b) {
    const float* src = x + b * kQ8_0BlockSize;
    uint8_t* block = out + b * kQ8_0BlockBytes;
    const __m512 v0 = _mm512_loadu_ps(src), v1 = _mm512_loadu_ps(src + 16);
    __m512 amax = _mm512_max_ps(_mm512_abs_ps(v0), _mm512_setzero_ps());
    amax = _mm512_max_ps(_mm512_abs_ps(v1), amax);
    const float d = _mm512_reduce_max_ps(amax) / 127.0f;
    const float inv = d != 0.0f ? 1.0f / d : 0.0f;
    const uint16_t d_bits = f32_to_f16(d);
    std::memcpy(block, &d_bits, 2);
    for (int half = 0; half < 2; ++half) {
      __m512 v = _mm512_mul_ps(half ? v1 : v0, _mm512_set1_ps(inv));
      v = _mm512_min_ps(v, _mm512_set1_ps(127.0f));
      v = _mm512_max_ps(v, _mm512_set1_ps(-127.0f));
      __m512 q = _mm512_roundscale_ps(v, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
      const __m512 frac = _mm512_sub_ps(v, q);  // exact
      const __m512 one = _mm512_set1_ps(1.0f);
      q = _mm512_mask_add_ps(q, _mm512_cmp_ps_mask(frac, _mm512_set1_ps(0.5f), _CMP_GE_OQ), q, one);
      q = _mm512_mask_sub_ps(q, _mm512_cmp_ps_mask(frac, _mm512_set1_ps(-0.5f), _CMP_LE_OQ), q, one);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(block + 2 + 16 * half),
                       _mm512_cvtsepi32_epi8(_mm512_cvttps_epi32(q)));
    }
  }
}
#pragma GCC diagnostic pop
#endif

}  // namespace

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
#if defined(__x86_64__)
  static const bool avx512 = __builtin_cpu_supports("avx512f");
  if (avx512) return quantize_q8_0_avx512(x, k, out);
#endif
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
