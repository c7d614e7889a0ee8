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


// ---- ggml's block formats (docs/quantization.md): little-endian fields, f16 scales ---------------

float load_f16(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return f16_to_f32(bits);
}
void store_f16(uint8_t* p, float v) {
  const uint16_t bits = f32_to_f16(v);
  std::memcpy(p, &bits, 2);
}

// ggml's nearest_int: x + 1.5 * 2^23 rounds to an integer (half to even) in the low mantissa bits.
// Exact for |x| <= 2^22; anything else (inf, NaN) gives some int, never undefined behaviour.
int nearest_int(float x) {
  const float v = x + 12582912.0f;
  int32_t i;
  std::memcpy(&i, &v, 4);
  return (i & 0x007fffff) - 0x00400000;
}

constexpr float kGroupMaxEps = 1e-15f;  // ggml's GROUP_MAX_EPS: below it a group counts as all zero

// The dequantizers: ggml's dequantize_row_* with the same f32 operations in the same order.

void dequantize_q4_0(const uint8_t* row, int64_t k, float* out) {
  for (int64_t b = 0; b < k / 32; ++b, out += 32) {
    const uint8_t* block = row + b * kQ4_0BlockBytes;
    const float d = load_f16(block);
    for (int j = 0; j < 16; ++j) {
      out[j] = static_cast<float>((block[2 + j] & 0xF) - 8) * d;
      out[j + 16] = static_cast<float>((block[2 + j] >> 4) - 8) * d;
    }
  }
}

// Q4_K and Q5_K (five_bits: the high bits of qh added): the same scales, mins and nibble order.
void dequantize_q4_k_q5_k(const uint8_t* row, int64_t k, float* out, bool five_bits) {
  const int64_t bytes = five_bits ? kQ5_KBlockBytes : kQ4_KBlockBytes;
  for (int64_t b = 0; b < k / kKQuantBlockSize; ++b) {
    const uint8_t* block = row + b * bytes;
    const float d = load_f16(block), dmin = load_f16(block + 2);
    uint8_t sc[8], m[8];
    unpack_k_scales(block + 4, sc, m);
    const uint8_t* qh = five_bits ? block + 16 : nullptr;
    const uint8_t* q = block + (five_bits ? 48 : 16);
    for (int pair = 0; pair < 4; ++pair, q += 32) {
      const float d1 = d * static_cast<float>(sc[2 * pair]), m1 = dmin * static_cast<float>(m[2 * pair]);
      const float d2 = d * static_cast<float>(sc[2 * pair + 1]), m2 = dmin * static_cast<float>(m[2 * pair + 1]);
      const int lo_bit = 2 * pair, hi_bit = 2 * pair + 1;
      for (int l = 0; l < 32; ++l) {
        const int high = qh ? ((qh[l] >> lo_bit) & 1) << 4 : 0;
        *out++ = d1 * static_cast<float>((q[l] & 0xF) + high) - m1;
      }
      for (int l = 0; l < 32; ++l) {
        const int high = qh ? ((qh[l] >> hi_bit) & 1) << 4 : 0;
        *out++ = d2 * static_cast<float>((q[l] >> 4) + high) - m2;
      }
    }
  }
}

void dequantize_q6_k(const uint8_t* row, int64_t k, float* out) {
  for (int64_t b = 0; b < k / kKQuantBlockSize; ++b) {
    const uint8_t* block = row + b * kQ6_KBlockBytes;
    const float d = load_f16(block + 208);
    const uint8_t* ql = block;
    const uint8_t* qh = block + 128;
    const auto* sc = reinterpret_cast<const int8_t*>(block + 192);
    for (int half = 0; half < 2; ++half, out += 128, ql += 64, qh += 32, sc += 8) {
      for (int l = 0; l < 32; ++l) {
        const int is = l / 16;
        const int q1 = ((ql[l] & 0xF) | ((qh[l] & 3) << 4)) - 32;
        const int q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
        const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
        const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
        out[l] = d * static_cast<float>(sc[is]) * static_cast<float>(q1);
        out[l + 32] = d * static_cast<float>(sc[is + 2]) * static_cast<float>(q2);
        out[l + 64] = d * static_cast<float>(sc[is + 4]) * static_cast<float>(q3);
        out[l + 96] = d * static_cast<float>(sc[is + 6]) * static_cast<float>(q4);
      }
    }
  }
}

// The quantizers: ggml's quantize_row_*_ref, the same f32 operations in the same order (so, on
// the same inputs, the same bytes as ggml built without FMA contraction).

void quantize_q4_0(const float* x, int64_t k, uint8_t* out) {
  for (int64_t b = 0; b < k / 32; ++b, x += 32) {
    uint8_t* block = out + b * kQ4_0BlockBytes;
    float amax = 0.0f, max = 0.0f;  // the element of largest magnitude, with its sign
    for (int j = 0; j < 32; ++j)
      if (amax < std::fabs(x[j])) {
        amax = std::fabs(x[j]);
        max = x[j];
      }
    const float d = max / -8.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    store_f16(block, d);
    // ggml's MIN(15, (int8_t)(x * id + 8.5f)), with NaN sent to 0 instead of an undefined conversion.
    const auto quant = [&](float v) {
      const float t = v * id + 8.5f;
      return !(t > 0.0f) ? 0 : t >= 15.0f ? 15 : static_cast<int>(t);
    };
    for (int j = 0; j < 16; ++j) block[2 + j] = static_cast<uint8_t>(quant(x[j]) | quant(x[j + 16]) << 4);
  }
}

// ggml's make_qkx2_quants: the scale and min (returned as -min in the_min) of one sub-block of n
// weights with levels 0..nmax, minimising the weighted squared error over nstep + 1 trial scales.
float make_qkx2_quants(int n, int nmax, const float* x, const float* weights, uint8_t* L, float* the_min,
                       uint8_t* Laux, float rmin, float rdelta, int nstep) {
  float min = x[0], max = x[0];
  float sum_w = weights[0];
  float sum_x = sum_w * x[0];
  for (int i = 1; i < n; ++i) {
    if (x[i] < min) min = x[i];
    if (x[i] > max) max = x[i];
    const float w = weights[i];
    sum_w += w;
    sum_x += w * x[i];
  }
  if (min > 0) min = 0;
  if (max == min) {
    for (int i = 0; i < n; ++i) L[i] = 0;
    *the_min = -min;
    return 0.0f;
  }
  float iscale = static_cast<float>(nmax) / (max - min);
  float scale = 1 / iscale;
  float best_error = 0;
  for (int i = 0; i < n; ++i) {
    const int l = nearest_int(iscale * (x[i] - min));
    L[i] = static_cast<uint8_t>(std::max(0, std::min(nmax, l)));
    float diff = scale * static_cast<float>(L[i]) + min - x[i];
    diff = diff * diff;
    best_error += weights[i] * diff;
  }
  if (nstep < 1) {
    *the_min = -min;
    return scale;
  }
  for (int is = 0; is <= nstep; ++is) {
    iscale = (rmin + rdelta * static_cast<float>(is) + static_cast<float>(nmax)) / (max - min);
    float sum_l = 0, sum_l2 = 0, sum_xl = 0;
    for (int i = 0; i < n; ++i) {
      const int l = std::max(0, std::min(nmax, nearest_int(iscale * (x[i] - min))));
      Laux[i] = static_cast<uint8_t>(l);
      const float w = weights[i], fl = static_cast<float>(l);
      sum_l += w * fl;
      sum_l2 += w * fl * fl;
      sum_xl += w * fl * x[i];
    }
    const float D = sum_w * sum_l2 - sum_l * sum_l;
    if (D > 0) {
      float this_scale = (sum_w * sum_xl - sum_x * sum_l) / D;
      float this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D;
      if (this_min > 0) {
        this_min = 0;
        this_scale = sum_xl / sum_l2;
      }
      float cur_error = 0;
      for (int i = 0; i < n; ++i) {
        float diff = this_scale * static_cast<float>(Laux[i]) + this_min - x[i];
        diff = diff * diff;
        cur_error += weights[i] * diff;
      }
      if (cur_error < best_error) {
        for (int i = 0; i < n; ++i) L[i] = Laux[i];
        best_error = cur_error;
        scale = this_scale;
        min = this_min;
      }
    }
  }
  *the_min = -min;
  return scale;
}

// The 8 sub-blocks of a Q4_K / Q5_K super-block fitted as quantize_row_q4_K_ref / q5_K_ref do:
// weights av_x + |x| (av_x the sub-block's RMS), then make_qkx2_quants.
void fit_k_sub_blocks_portable(const float* x, bool five_bits, uint8_t* L, float* scales, float* mins) {
  uint8_t Laux[32];
  float weights[32];
  for (int j = 0; j < 8; ++j) {
    float sum_x2 = 0;
    for (int l = 0; l < 32; ++l) sum_x2 += x[32 * j + l] * x[32 * j + l];
    const float av_x = std::sqrt(sum_x2 / 32);
    for (int l = 0; l < 32; ++l) weights[l] = av_x + std::fabs(x[32 * j + l]);
    scales[j] = five_bits ? make_qkx2_quants(32, 31, x + 32 * j, weights, L + 32 * j, &mins[j], Laux, -0.5f, 0.1f, 15)
                          : make_qkx2_quants(32, 15, x + 32 * j, weights, L + 32 * j, &mins[j], Laux, -1.0f, 0.1f, 20);
  }
}

#if defined(__x86_64__)
// The same, the 8 sub-blocks in the 8 lanes: every lane runs make_qkx2_quants' f32 operations in
// its order (compares and blends for its branches, no FMA: the target has none to contract into),
// so the results are the portable ones bit for bit, 20x faster. (For NaN inputs the min / max
// blends may differ from the portable branches; the result is some in-range quant either way.)
__attribute__((target("avx2"))) __m256i nearest_int8(__m256 v) {
  const __m256i bits = _mm256_castps_si256(_mm256_add_ps(v, _mm256_set1_ps(12582912.0f)));
  return _mm256_sub_epi32(_mm256_and_si256(bits, _mm256_set1_epi32(0x007fffff)), _mm256_set1_epi32(0x00400000));
}

__attribute__((target("avx2"))) void fit_k_sub_blocks_avx2(const float* x, bool five_bits, uint8_t* L_out,
                                                            float* scales, float* mins) {
  const int nmax = five_bits ? 31 : 15, nstep = five_bits ? 15 : 20;
  const float rmin = five_bits ? -0.5f : -1.0f, rdelta = 0.1f;
  __m256 xs[32], ws[32];
  __m256i L[32];
  const __m256i lanes = _mm256_setr_epi32(0, 32, 64, 96, 128, 160, 192, 224);  // sub-block j's element i
  for (int i = 0; i < 32; ++i) xs[i] = _mm256_i32gather_ps(x + i, lanes, 4);
  __m256 sum_x2 = _mm256_setzero_ps();
  for (int i = 0; i < 32; ++i) sum_x2 = _mm256_add_ps(sum_x2, _mm256_mul_ps(xs[i], xs[i]));
  const __m256 av_x = _mm256_sqrt_ps(_mm256_div_ps(sum_x2, _mm256_set1_ps(32.0f)));
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int i = 0; i < 32; ++i) ws[i] = _mm256_add_ps(av_x, _mm256_andnot_ps(sign, xs[i]));
  // make_qkx2_quants
  __m256 min = xs[0], max = xs[0], sum_w = ws[0], sum_x = _mm256_mul_ps(ws[0], xs[0]);
  for (int i = 1; i < 32; ++i) {
    min = _mm256_blendv_ps(min, xs[i], _mm256_cmp_ps(xs[i], min, _CMP_LT_OQ));
    max = _mm256_blendv_ps(max, xs[i], _mm256_cmp_ps(xs[i], max, _CMP_GT_OQ));
    sum_w = _mm256_add_ps(sum_w, ws[i]);
    sum_x = _mm256_add_ps(sum_x, _mm256_mul_ps(ws[i], xs[i]));
  }
  const __m256 zero = _mm256_setzero_ps();
  min = _mm256_blendv_ps(min, zero, _mm256_cmp_ps(min, zero, _CMP_GT_OQ));
  const __m256 flat = _mm256_cmp_ps(max, min, _CMP_EQ_OQ);  // lanes that return early: L 0, scale 0
  const __m256 flat_min = min;
  const __m256i lo = _mm256_setzero_si256(), hi = _mm256_set1_epi32(nmax);
  __m256 iscale = _mm256_div_ps(_mm256_set1_ps(static_cast<float>(nmax)), _mm256_sub_ps(max, min));
  __m256 scale = _mm256_div_ps(_mm256_set1_ps(1.0f), iscale);
  __m256 best_error = zero;
  for (int i = 0; i < 32; ++i) {
    L[i] = _mm256_min_epi32(hi, _mm256_max_epi32(lo, nearest_int8(_mm256_mul_ps(iscale, _mm256_sub_ps(xs[i], min)))));
    __m256 diff = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(scale, _mm256_cvtepi32_ps(L[i])), min), xs[i]);
    diff = _mm256_mul_ps(diff, diff);
    best_error = _mm256_add_ps(best_error, _mm256_mul_ps(ws[i], diff));
  }
  for (int is = 0; is <= nstep; ++is) {
    // max - min with the min of the best trial so far, as make_qkx2_quants reads it.
    iscale = _mm256_div_ps(_mm256_set1_ps(rmin + rdelta * static_cast<float>(is) + static_cast<float>(nmax)),
                           _mm256_sub_ps(max, min));
    __m256 sum_l = zero, sum_l2 = zero, sum_xl = zero;
    __m256i aux[32];
    for (int i = 0; i < 32; ++i) {
      aux[i] = _mm256_min_epi32(hi, _mm256_max_epi32(lo, nearest_int8(_mm256_mul_ps(iscale, _mm256_sub_ps(xs[i], min)))));
      const __m256 fl = _mm256_cvtepi32_ps(aux[i]), wl = _mm256_mul_ps(ws[i], fl);
      sum_l = _mm256_add_ps(sum_l, wl);
      sum_l2 = _mm256_add_ps(sum_l2, _mm256_mul_ps(wl, fl));
      sum_xl = _mm256_add_ps(sum_xl, _mm256_mul_ps(wl, xs[i]));
    }
    const __m256 D = _mm256_sub_ps(_mm256_mul_ps(sum_w, sum_l2), _mm256_mul_ps(sum_l, sum_l));
    __m256 this_scale = _mm256_div_ps(_mm256_sub_ps(_mm256_mul_ps(sum_w, sum_xl), _mm256_mul_ps(sum_x, sum_l)), D);
    __m256 this_min = _mm256_div_ps(_mm256_sub_ps(_mm256_mul_ps(sum_l2, sum_x), _mm256_mul_ps(sum_l, sum_xl)), D);
    const __m256 positive = _mm256_cmp_ps(this_min, zero, _CMP_GT_OQ);
    this_min = _mm256_blendv_ps(this_min, zero, positive);
    this_scale = _mm256_blendv_ps(this_scale, _mm256_div_ps(sum_xl, sum_l2), positive);
    __m256 cur_error = zero;
    for (int i = 0; i < 32; ++i) {
      __m256 diff = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(this_scale, _mm256_cvtepi32_ps(aux[i])), this_min), xs[i]);
      diff = _mm256_mul_ps(diff, diff);
      cur_error = _mm256_add_ps(cur_error, _mm256_mul_ps(ws[i], diff));
    }
    const __m256 take = _mm256_and_ps(_mm256_cmp_ps(D, zero, _CMP_GT_OQ), _mm256_cmp_ps(cur_error, best_error, _CMP_LT_OQ));
    const __m256i take_i = _mm256_castps_si256(take);
    for (int i = 0; i < 32; ++i) L[i] = _mm256_blendv_epi8(L[i], aux[i], take_i);
    best_error = _mm256_blendv_ps(best_error, cur_error, take);
    scale = _mm256_blendv_ps(scale, this_scale, take);
    min = _mm256_blendv_ps(min, this_min, take);
  }
  const __m256i flat_i = _mm256_castps_si256(flat);
  _mm256_storeu_ps(scales, _mm256_blendv_ps(scale, zero, flat));
  _mm256_storeu_ps(mins, _mm256_xor_ps(_mm256_blendv_ps(min, flat_min, flat), sign));  // the portable *the_min
  alignas(32) int32_t lane[8];
  for (int i = 0; i < 32; ++i) {
    _mm256_store_si256(reinterpret_cast<__m256i*>(lane), _mm256_andnot_si256(flat_i, L[i]));
    for (int j = 0; j < 8; ++j) L_out[32 * j + i] = static_cast<uint8_t>(lane[j]);
  }
}
#endif

// simd: the AVX2 fit where the CPU has it (the same bits as the portable loops).
void fit_k_sub_blocks(const float* x, bool five_bits, uint8_t* L, float* scales, float* mins, bool simd) {
#if defined(__x86_64__)
  static const bool avx2 = __builtin_cpu_supports("avx2");
  if (avx2 && simd) return fit_k_sub_blocks_avx2(x, five_bits, L, scales, mins);
#endif
  fit_k_sub_blocks_portable(x, five_bits, L, scales, mins);
}

// quantize_row_q4_K_ref (five_bits false: levels 0..15) and quantize_row_q5_K_ref (0..31).
void quantize_q4_k_q5_k(const float* x, int64_t k, uint8_t* out, bool five_bits, bool simd) {
  const int nmax = five_bits ? 31 : 15;
  const int64_t bytes = five_bits ? kQ5_KBlockBytes : kQ4_KBlockBytes;
  uint8_t L[kKQuantBlockSize];
  float mins[8], scales[8];
  for (int64_t b = 0; b < k / kKQuantBlockSize; ++b, x += kKQuantBlockSize) {
    uint8_t* block = out + b * bytes;
    uint8_t* packed = block + 4;  // the 12 scale / min bytes
    float max_scale = 0, max_min = 0;
    fit_k_sub_blocks(x, five_bits, L, scales, mins, simd);
    for (int j = 0; j < 8; ++j) {
      if (scales[j] > max_scale) max_scale = scales[j];
      if (mins[j] > max_min) max_min = mins[j];
    }
    const float inv_scale = max_scale > 0 ? 63.0f / max_scale : 0.0f;
    const float inv_min = max_min > 0 ? 63.0f / max_min : 0.0f;
    for (int j = 0; j < 8; ++j) {
      // ggml stores nearest_int into a uint8_t before the clamp: a negative value wraps (to >= 63).
      const auto ls = static_cast<uint8_t>(std::min<int>(63, static_cast<uint8_t>(nearest_int(inv_scale * scales[j]))));
      const auto lm = static_cast<uint8_t>(std::min<int>(63, static_cast<uint8_t>(nearest_int(inv_min * mins[j]))));
      if (j < 4) {
        packed[j] = ls;
        packed[j + 4] = lm;
      } else {
        packed[j + 4] = static_cast<uint8_t>((ls & 0xF) | ((lm & 0xF) << 4));
        packed[j - 4] |= static_cast<uint8_t>((ls >> 4) << 6);
        packed[j] |= static_cast<uint8_t>((lm >> 4) << 6);
      }
    }
    store_f16(block, max_scale / 63.0f);
    store_f16(block + 2, max_min / 63.0f);
    const float d_all = load_f16(block), dmin_all = load_f16(block + 2);
    uint8_t sc[8], m[8];
    unpack_k_scales(packed, sc, m);
    for (int j = 0; j < 8; ++j) {
      const float d = d_all * static_cast<float>(sc[j]);
      if (d == 0.0f) continue;  // as ggml: the sub-block keeps make_qkx2_quants' levels
      const float dm = dmin_all * static_cast<float>(m[j]);
      for (int ii = 0; ii < 32; ++ii)
        L[32 * j + ii] = static_cast<uint8_t>(std::max(0, std::min(nmax, nearest_int((x[32 * j + ii] + dm) / d))));
    }
    if (!five_bits) {
      uint8_t* q = block + 16;
      for (int j = 0; j < kKQuantBlockSize; j += 64, q += 32)
        for (int l = 0; l < 32; ++l) q[l] = static_cast<uint8_t>(L[j + l] | (L[j + l + 32] << 4));
      continue;
    }
    uint8_t* qh = block + 16;
    uint8_t* ql = block + 48;
    std::memset(qh, 0, 32);
    uint8_t m1 = 1, m2 = 2;
    for (int n = 0; n < kKQuantBlockSize; n += 64, ql += 32, m1 = static_cast<uint8_t>(m1 << 2), m2 = static_cast<uint8_t>(m2 << 2))
      for (int j = 0; j < 32; ++j) {
        int l1 = L[n + j], l2 = L[n + j + 32];
        if (l1 > 15) {
          l1 -= 16;
          qh[j] |= m1;
        }
        if (l2 > 15) {
          l2 -= 16;
          qh[j] |= m2;
        }
        ql[j] = static_cast<uint8_t>(l1 | (l2 << 4));
      }
  }
}

// ggml's make_qx_quants with rmse_type 1 and no importance weights (what quantize_row_q6_K_ref
// calls): a signed scale for levels -nmax..nmax-1 (stored + nmax in L), weights x^2, 19 trial scales.
float make_qx_quants(int n, int nmax, const float* x, int8_t* L) {
  float max = 0, amax = 0;
  for (int i = 0; i < n; ++i) {
    const float ax = std::fabs(x[i]);
    if (ax > amax) {
      amax = ax;
      max = x[i];
    }
  }
  if (amax < kGroupMaxEps) {
    for (int i = 0; i < n; ++i) L[i] = 0;
    return 0.0f;
  }
  const auto level = [&](float iscale, int i) { return std::max(-nmax, std::min(nmax - 1, nearest_int(iscale * x[i]))); };
  float iscale = static_cast<float>(-nmax) / max;
  float sumlx = 0, suml2 = 0;
  for (int i = 0; i < n; ++i) {
    const int l = level(iscale, i);
    L[i] = static_cast<int8_t>(l + nmax);
    const float w = x[i] * x[i], fl = static_cast<float>(l);
    sumlx += w * x[i] * fl;
    suml2 += w * fl * fl;
  }
  float scale = suml2 != 0.0f ? sumlx / suml2 : 0.0f;
  float best = scale * sumlx;
  for (int is = -9; is <= 9; ++is) {
    if (is == 0) continue;
    iscale = -(static_cast<float>(nmax) + 0.1f * static_cast<float>(is)) / max;
    sumlx = suml2 = 0;
    for (int i = 0; i < n; ++i) {
      const float w = x[i] * x[i], fl = static_cast<float>(level(iscale, i));
      sumlx += w * x[i] * fl;
      suml2 += w * fl * fl;
    }
    if (suml2 > 0 && sumlx * sumlx > best * suml2) {
      for (int i = 0; i < n; ++i) L[i] = static_cast<int8_t>(nmax + level(iscale, i));
      scale = sumlx / suml2;
      best = scale * sumlx;
    }
  }
  return scale;
}

#if defined(__x86_64__)
// make_qx_quants(16, 32, ..., rmse_type 1) for 8 sub-blocks of 16 in the 8 lanes (sub-block j's
// element i at x[16 j + i]), each lane in the portable function's order: the same bits (as
// fit_k_sub_blocks_avx2).
// make_qx_quants' levels (-32..31) of 16 lane vectors at iscale, and its sums of w x l and w l^2.
__attribute__((target("avx2"))) void qx_levels(const __m256* xs, __m256 iscale, __m256i* out) {
  const __m256i lo = _mm256_set1_epi32(-32), hi = _mm256_set1_epi32(31);
  for (int i = 0; i < 16; ++i)
    out[i] = _mm256_min_epi32(hi, _mm256_max_epi32(lo, nearest_int8(_mm256_mul_ps(iscale, xs[i]))));
}
__attribute__((target("avx2"))) void qx_sums(const __m256* xs, const __m256i* l, __m256& sumlx, __m256& suml2) {
  sumlx = suml2 = _mm256_setzero_ps();
  for (int i = 0; i < 16; ++i) {
    const __m256 w = _mm256_mul_ps(xs[i], xs[i]), fl = _mm256_cvtepi32_ps(l[i]);
    sumlx = _mm256_add_ps(sumlx, _mm256_mul_ps(_mm256_mul_ps(w, xs[i]), fl));
    suml2 = _mm256_add_ps(suml2, _mm256_mul_ps(_mm256_mul_ps(w, fl), fl));
  }
}

__attribute__((target("avx2"))) void make_qx_quants_x8(const float* x, int8_t* L_out, float* scales) {
  constexpr int nmax = 32;
  __m256 xs[16];
  __m256i L[16];
  const __m256i lanes = _mm256_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112);
  for (int i = 0; i < 16; ++i) xs[i] = _mm256_i32gather_ps(x + i, lanes, 4);
  const __m256 zero = _mm256_setzero_ps(), sign = _mm256_set1_ps(-0.0f);
  __m256 max = zero, amax = zero;
  for (int i = 0; i < 16; ++i) {
    const __m256 ax = _mm256_andnot_ps(sign, xs[i]);
    const __m256 larger = _mm256_cmp_ps(ax, amax, _CMP_GT_OQ);
    amax = _mm256_blendv_ps(amax, ax, larger);
    max = _mm256_blendv_ps(max, xs[i], larger);
  }
  const __m256 zeros = _mm256_cmp_ps(amax, _mm256_set1_ps(kGroupMaxEps), _CMP_LT_OQ);  // L 0, scale 0
  const __m256i offset = _mm256_set1_epi32(nmax);
  qx_levels(xs, _mm256_div_ps(_mm256_set1_ps(static_cast<float>(-nmax)), max), L);
  __m256 sumlx, suml2;
  qx_sums(xs, L, sumlx, suml2);
  __m256 scale = _mm256_blendv_ps(_mm256_div_ps(sumlx, suml2), zero, _mm256_cmp_ps(suml2, zero, _CMP_EQ_OQ));
  __m256 best = _mm256_mul_ps(scale, sumlx);
  for (int is = -9; is <= 9; ++is) {
    if (is == 0) continue;
    __m256i trial[16];
    qx_levels(xs, _mm256_div_ps(_mm256_set1_ps(-(static_cast<float>(nmax) + 0.1f * static_cast<float>(is))), max), trial);
    qx_sums(xs, trial, sumlx, suml2);
    const __m256 take = _mm256_and_ps(_mm256_cmp_ps(suml2, zero, _CMP_GT_OQ),
                                      _mm256_cmp_ps(_mm256_mul_ps(sumlx, sumlx), _mm256_mul_ps(best, suml2), _CMP_GT_OQ));
    for (int i = 0; i < 16; ++i) L[i] = _mm256_blendv_epi8(L[i], trial[i], _mm256_castps_si256(take));
    scale = _mm256_blendv_ps(scale, _mm256_div_ps(sumlx, suml2), take);
    best = _mm256_blendv_ps(best, _mm256_mul_ps(scale, sumlx), take);
  }
  _mm256_storeu_ps(scales, _mm256_blendv_ps(scale, zero, zeros));
  alignas(32) int32_t lane[8];
  for (int i = 0; i < 16; ++i) {
    _mm256_store_si256(reinterpret_cast<__m256i*>(lane),
                       _mm256_andnot_si256(_mm256_castps_si256(zeros), _mm256_add_epi32(L[i], offset)));
    for (int j = 0; j < 8; ++j) L_out[16 * j + i] = static_cast<int8_t>(lane[j]);
  }
}
#endif

// The 16 sub-blocks of a Q6_K super-block fitted as quantize_row_q6_K_ref does.
void fit_q6_k_sub_blocks(const float* x, int8_t* L, float* scales, bool simd) {
#if defined(__x86_64__)
  static const bool avx2 = __builtin_cpu_supports("avx2");
  if (avx2 && simd) {
    make_qx_quants_x8(x, L, scales);
    make_qx_quants_x8(x + 128, L + 128, scales + 8);
    return;
  }
#endif
  for (int ib = 0; ib < 16; ++ib) scales[ib] = make_qx_quants(16, 32, x + 16 * ib, L + 16 * ib);
}

void quantize_q6_k(const float* x, int64_t k, uint8_t* out, bool simd) {
  int8_t L[kKQuantBlockSize];
  float scales[16];
  for (int64_t b = 0; b < k / kKQuantBlockSize; ++b, x += kKQuantBlockSize) {
    uint8_t* block = out + b * kQ6_KBlockBytes;
    auto* block_scales = reinterpret_cast<int8_t*>(block + 192);
    float max_scale = 0, max_abs_scale = 0;
    fit_q6_k_sub_blocks(x, L, scales, simd);
    for (int ib = 0; ib < 16; ++ib) {
      if (std::fabs(scales[ib]) > max_abs_scale) {
        max_abs_scale = std::fabs(scales[ib]);
        max_scale = scales[ib];
      }
    }
    if (max_abs_scale < kGroupMaxEps) {
      std::memset(block, 0, kQ6_KBlockBytes);
      continue;
    }
    const float iscale = -128.0f / max_scale;
    store_f16(block + 208, 1 / iscale);
    for (int ib = 0; ib < 16; ++ib) block_scales[ib] = static_cast<int8_t>(std::min(127, nearest_int(iscale * scales[ib])));
    const float d_all = load_f16(block + 208);
    for (int j = 0; j < 16; ++j) {
      const float d = d_all * static_cast<float>(block_scales[j]);
      if (d == 0.0f) continue;  // as ggml: the sub-block keeps make_qx_quants' levels
      for (int ii = 0; ii < 16; ++ii)
        L[16 * j + ii] = static_cast<int8_t>(std::max(-32, std::min(31, nearest_int(x[16 * j + ii] / d))) + 32);
    }
    uint8_t* ql = block;
    uint8_t* qh = block + 128;
    for (int j = 0; j < kKQuantBlockSize; j += 128, ql += 64, qh += 32)
      for (int l = 0; l < 32; ++l) {
        const int q1 = L[j + l], q2 = L[j + l + 32], q3 = L[j + l + 64], q4 = L[j + l + 96];
        ql[l] = static_cast<uint8_t>((q1 & 0xF) | ((q3 & 0xF) << 4));
        ql[l + 32] = static_cast<uint8_t>((q2 & 0xF) | ((q4 & 0xF) << 4));
        qh[l] = static_cast<uint8_t>((q1 >> 4) | ((q2 >> 4) << 2) | ((q3 >> 4) << 4) | ((q4 >> 4) << 6));
      }
  }
}

}  // namespace

std::string_view encoding_name(QuantizationEncoding e) {
  switch (e) {
    case QuantizationEncoding::q8_0: return "q8_0";
    case QuantizationEncoding::q4_0: return "q4_0";
    case QuantizationEncoding::q4_k: return "q4_k";
    case QuantizationEncoding::q5_k: return "q5_k";
    case QuantizationEncoding::q6_k: return "q6_k";
  }
  return "?";
}

QuantizationEncoding parse_encoding(std::string_view text) {
  for (QuantizationEncoding e : kAllEncodings)
    if (text == encoding_name(e)) return e;
  throw ValueError(fmt::format("unknown quantization encoding '{}' (expected q8_0, q4_0, q4_k, q5_k or q6_k)", text));
}

int64_t block_size(QuantizationEncoding e) {
  return e == QuantizationEncoding::q8_0 || e == QuantizationEncoding::q4_0 ? kQ8_0BlockSize : kKQuantBlockSize;
}

int64_t block_bytes(QuantizationEncoding e) {
  switch (e) {
    case QuantizationEncoding::q8_0: return kQ8_0BlockBytes;
    case QuantizationEncoding::q4_0: return kQ4_0BlockBytes;
    case QuantizationEncoding::q4_k: return kQ4_KBlockBytes;
    case QuantizationEncoding::q5_k: return kQ5_KBlockBytes;
    case QuantizationEncoding::q6_k: return kQ6_KBlockBytes;
  }
  return kQ8_0BlockBytes;
}

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

void unpack_k_scales(const uint8_t* q, uint8_t scales[8], uint8_t mins[8]) {
  for (int j = 0; j < 4; ++j) {
    scales[j] = q[j] & 63;
    mins[j] = q[j + 4] & 63;
  }
  for (int j = 4; j < 8; ++j) {
    scales[j] = static_cast<uint8_t>((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
    mins[j] = static_cast<uint8_t>((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
  }
}

namespace {

void quantize_row_with(QuantizationEncoding e, const float* x, int64_t k, uint8_t* out, bool simd) {
  quantized_row_bytes(e, k, "quantize_row");
  switch (e) {
    case QuantizationEncoding::q8_0: return quantize_q8_0(x, k, out);
    case QuantizationEncoding::q4_0: return quantize_q4_0(x, k, out);
    case QuantizationEncoding::q4_k: return quantize_q4_k_q5_k(x, k, out, false, simd);
    case QuantizationEncoding::q5_k: return quantize_q4_k_q5_k(x, k, out, true, simd);
    case QuantizationEncoding::q6_k: return quantize_q6_k(x, k, out, simd);
  }
}

}  // namespace

void quantize_row(QuantizationEncoding e, const float* x, int64_t k, uint8_t* out) {
  quantize_row_with(e, x, k, out, /*simd=*/true);
}

void quantize_row_portable(QuantizationEncoding e, const float* x, int64_t k, uint8_t* out) {
  quantize_row_with(e, x, k, out, /*simd=*/false);
}

void dequantize_row(QuantizationEncoding e, const uint8_t* row, int64_t k, float* out) {
  quantized_row_bytes(e, k, "dequantize_row");
  switch (e) {
    case QuantizationEncoding::q8_0: return dequantize_q8_0(row, k, out);
    case QuantizationEncoding::q4_0: return dequantize_q4_0(row, k, out);
    case QuantizationEncoding::q4_k: return dequantize_q4_k_q5_k(row, k, out, false);
    case QuantizationEncoding::q5_k: return dequantize_q4_k_q5_k(row, k, out, true);
    case QuantizationEncoding::q6_k: return dequantize_q6_k(row, k, out);
  }
}

}  // namespace kiln::graph
