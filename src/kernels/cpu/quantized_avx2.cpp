// The AVX2 GEMVs of Q4_0, Q4_K, Q5_K and Q6_K (quantized.h's last section): the quants, unpacked to
// unsigned bytes in registers, times the signed int8 activations with vpmaddubsw (pairs summed to
// int16, exactly: at most 2 * 63 * 127), then vpmaddwd to int32. Each weight row is read once per 8
// activation rows, in place from the GGUF blocks; the eight 32-weight blocks of a super-block (or 8
// Q4_0 blocks) reduce to one vector whose lane j is block j's int32 dot, scaled in f32 with the 8
// activation scales at once.
// Standard headers first, then the target pragma (see gemm.h for why).
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kernels/cpu/quantized.h"

#if defined(__x86_64__)
#include <immintrin.h>

#ifdef __clang__  // clang has no GCC target pragma; this is its equivalent
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#endif
namespace kiln::kernels::quantized {
namespace {

using graph::QuantizationEncoding;

constexpr int64_t kRowsPerPass = 8;  // activation rows sharing one decode of a weight super-block

inline float load_f16(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return _cvtsh_ss(bits);
}

inline uint32_t load_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// int32 lanes of the 32 products of unsigned `w` and signed activations at xq, pairs summed.
inline __m256i dot32(__m256i w, const int8_t* xq) {
  const __m256i p = _mm256_maddubs_epi16(w, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq)));
  return _mm256_madd_epi16(p, _mm256_set1_epi16(1));
}

// Eight int32 vectors -> one whose lane j is the sum of v[j]'s eight lanes.
inline __m256i sum_lanes8(const __m256i v[8]) {
  const __m256i h01 = _mm256_hadd_epi32(v[0], v[1]), h23 = _mm256_hadd_epi32(v[2], v[3]);
  const __m256i h45 = _mm256_hadd_epi32(v[4], v[5]), h67 = _mm256_hadd_epi32(v[6], v[7]);
  const __m256i h0123 = _mm256_hadd_epi32(h01, h23), h4567 = _mm256_hadd_epi32(h45, h67);
  // h0123 holds blocks 0..3's low-half sums in its low 128 bits and their high-half sums above.
  return _mm256_add_epi32(_mm256_permute2x128_si256(h0123, h4567, 0x20),
                          _mm256_permute2x128_si256(h0123, h4567, 0x31));
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// ---- the formats: a group of 8 activation blocks (256 weights) of one weight row, decoded once
// into registers, then multiplied into each activation row's 8-lane accumulator. ----

// Q4_K / Q5_K: lane j accumulates d_x,j * ((d * sc_j) * dot_j - (dmin * m_j) * sum_j).
template <bool kFive> struct Q4KQ5K {
  static constexpr int64_t kBytes = kFive ? graph::kQ5_KBlockBytes : graph::kQ4_KBlockBytes;
  __m256i w[8];
  __m256 dsc, dmm;

  // Bit j of each qh byte moved to bit 4 (16-bit shifts: bit 4 of each byte comes from its own byte).
  template <int J> static __m256i high_bit(__m256i qh) {
    const __m256i b = J < 4 ? _mm256_slli_epi16(qh, 4 - J) : J > 4 ? _mm256_srli_epi16(qh, J - 4) : qh;
    return _mm256_and_si256(b, _mm256_set1_epi8(0x10));
  }

  void decode(const uint8_t* block) {
    const uint8_t* packed = block + 4;
    const uint32_t w0 = load_u32(packed), w1 = load_u32(packed + 4), w2 = load_u32(packed + 8);
    // quantization.h's layout of the 12 bytes, four sub-blocks per 32-bit word.
    const uint32_t sc03 = w0 & 0x3f3f3f3fu, m03 = w1 & 0x3f3f3f3fu;
    const uint32_t sc47 = (w2 & 0x0f0f0f0fu) | ((w0 >> 6) & 0x03030303u) << 4;
    const uint32_t m47 = ((w2 >> 4) & 0x0f0f0f0fu) | ((w1 >> 6) & 0x03030303u) << 4;
    const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_setr_epi32(static_cast<int>(sc03), static_cast<int>(sc47), 0, 0)));
    const __m256 mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_setr_epi32(static_cast<int>(m03), static_cast<int>(m47), 0, 0)));
    dsc = _mm256_mul_ps(_mm256_set1_ps(load_f16(block)), sc);
    dmm = _mm256_mul_ps(_mm256_set1_ps(load_f16(block + 2)), mn);
    const uint8_t* q = block + (kFive ? 48 : 16);
    const __m256i low = _mm256_set1_epi8(0x0F);
    for (int p = 0; p < 4; ++p) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32 * p));
      w[2 * p] = _mm256_and_si256(raw, low);
      w[2 * p + 1] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
    }
    if constexpr (kFive) {
      const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 16));
      w[0] = _mm256_or_si256(w[0], high_bit<0>(qh));
      w[1] = _mm256_or_si256(w[1], high_bit<1>(qh));
      w[2] = _mm256_or_si256(w[2], high_bit<2>(qh));
      w[3] = _mm256_or_si256(w[3], high_bit<3>(qh));
      w[4] = _mm256_or_si256(w[4], high_bit<4>(qh));
      w[5] = _mm256_or_si256(w[5], high_bit<5>(qh));
      w[6] = _mm256_or_si256(w[6], high_bit<6>(qh));
      w[7] = _mm256_or_si256(w[7], high_bit<7>(qh));
    }
  }

  // xq: the group's 256 activations; xd, xsum: its 8 block scales and sums.
  __m256 update(__m256 acc, const int8_t* xq, const float* xd, const int32_t* xsum, const int16_t*) const {
    __m256i dots[8];
    for (int j = 0; j < 8; ++j) dots[j] = dot32(w[j], xq + 32 * j);
    const __m256 dx = _mm256_loadu_ps(xd);
    const __m256 sums = _mm256_cvtepi32_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(xsum)));
    acc = _mm256_fmadd_ps(_mm256_mul_ps(dx, dsc), _mm256_cvtepi32_ps(sum_lanes8(dots)), acc);
    return _mm256_fnmadd_ps(_mm256_mul_ps(dx, dmm), sums, acc);
  }
};

// Q6_K: lane j accumulates (d * d_x,j) * sum over block j's two 16-halves of sc * (dot - 32 * sum).
struct Q6K {
  static constexpr int64_t kBytes = graph::kQ6_KBlockBytes;
  __m256i w[8];
  __m256i scales[8];  // block j: int16 lanes 0-7 its first half's scale, 8-15 its second's
  __m256i scales16;   // the 16 scales as int16
  __m256 d;

  void decode(const uint8_t* block) {
    const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 192));
    scales16 = _mm256_cvtepi8_epi16(sc);
    for (int j = 0; j < 8; ++j) {
      const char a = static_cast<char>(2 * j), b = static_cast<char>(2 * j + 1);
      scales[j] = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(sc, _mm_setr_epi8(a, a, a, a, a, a, a, a, b, b, b, b, b, b, b, b)));
    }
    d = _mm256_set1_ps(load_f16(block + 208));
    const __m256i low = _mm256_set1_epi8(0x0F), two = _mm256_set1_epi8(0x30);
    for (int half = 0; half < 2; ++half) {
      const uint8_t* ql = block + 64 * half;
      const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql));
      const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 32));
      const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 128 + 32 * half));
      // quantization.h's layout: blocks 4h .. 4h + 3 take bits 0-1, 2-3, 4-5, 6-7 of qh as bits 4-5.
      w[4 * half] = _mm256_or_si256(_mm256_and_si256(l0, low), _mm256_and_si256(_mm256_slli_epi16(qh, 4), two));
      w[4 * half + 1] = _mm256_or_si256(_mm256_and_si256(l1, low), _mm256_and_si256(_mm256_slli_epi16(qh, 2), two));
      w[4 * half + 2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), low), _mm256_and_si256(qh, two));
      w[4 * half + 3] =
          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), low), _mm256_and_si256(_mm256_srli_epi16(qh, 2), two));
    }
  }

  __m256 update(__m256 acc, const int8_t* xq, const float* xd, const int32_t*, const int16_t* xsum16) const {
    __m256i dots[8];
    for (int j = 0; j < 8; ++j) {
      const __m256i p = _mm256_maddubs_epi16(w[j], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 32 * j)));
      dots[j] = _mm256_madd_epi16(p, scales[j]);  // |lane| <= 2 * 2 * 63 * 127 * 128
    }
    // Lane j: sc_2j * sum_2j + sc_2j+1 * sum_2j+1, the 32 * sum(q_x) the -32 of the levels takes away.
    const __m256i offsets = _mm256_madd_epi16(scales16, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xsum16)));
    const __m256i dot = _mm256_sub_epi32(sum_lanes8(dots), _mm256_slli_epi32(offsets, 5));
    return _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_loadu_ps(xd)), _mm256_cvtepi32_ps(dot), acc);
  }
};

// Q4_0: 8 blocks of 32 per group (fewer in a row's last group); lane j accumulates
// (d_w,j * d_x,j) * (dot_j - 8 * sum_j).
struct Q40 {
  static constexpr int64_t kBytes = 8 * graph::kQ4_0BlockBytes;
  __m256i w[8];
  __m256 dw;
  int blocks = 8;

  void decode(const uint8_t* group) {
    alignas(16) uint16_t d[8] = {};
    const __m128i low = _mm_set1_epi8(0x0F);
    for (int j = 0; j < 8; ++j) {
      if (j >= blocks) {
        w[j] = _mm256_setzero_si256();
        continue;
      }
      const uint8_t* b = group + j * graph::kQ4_0BlockBytes;
      std::memcpy(&d[j], b, 2);
      const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2));
      w[j] = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), low), _mm_and_si128(raw, low));
    }
    dw = _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(d)));
  }

  __m256 update(__m256 acc, const int8_t* xq, const float* xd, const int32_t* xsum, const int16_t*) const {
    __m256i dots[8];
    alignas(32) float dx[8] = {};
    alignas(32) int32_t sums[8] = {};
    for (int j = 0; j < 8; ++j) {
      if (j >= blocks) {  // past the row: nothing read
        dots[j] = _mm256_setzero_si256();
        continue;
      }
      dots[j] = dot32(w[j], xq + 32 * j);
      dx[j] = xd[j];
      sums[j] = xsum[j];
    }
    const __m256i dot = _mm256_sub_epi32(sum_lanes8(dots), _mm256_slli_epi32(_mm256_load_si256(reinterpret_cast<const __m256i*>(sums)), 3));
    return _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_load_ps(dx)), _mm256_cvtepi32_ps(dot), acc);
  }
};

// Rows [n0, n1) of w: for each weight row, activation rows kRowsPerPass at a time; each group of
// 256 weights decoded once per pass and multiplied into every row's accumulator. A row's arithmetic
// is the same whatever M is.
template <class Format>
void gemv(const Q8Activations& x, const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1, float* y, int64_t ldy) {
  const int64_t K = x.K, blocks = K / 32, groups = (blocks + 7) / 8;
  const auto* xq = reinterpret_cast<const int8_t*>(x.x);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * row_bytes;
    for (int64_t m0 = 0; m0 < x.M; m0 += kRowsPerPass) {
      const int64_t rows = x.M - m0 < kRowsPerPass ? x.M - m0 : kRowsPerPass;
      __m256 acc[kRowsPerPass];
      for (int64_t r = 0; r < rows; ++r) acc[r] = _mm256_setzero_ps();
      Format f;
      for (int64_t g = 0; g < groups; ++g) {
        if constexpr (std::is_same_v<Format, Q40>) f.blocks = static_cast<int>(blocks - 8 * g < 8 ? blocks - 8 * g : 8);
        f.decode(row + g * Format::kBytes);
        __builtin_prefetch(row + g * Format::kBytes + 1024);
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t m = m0 + r;
          acc[r] = f.update(acc[r], xq + m * K + g * 256, x.d + m * blocks + g * 8, x.sum ? x.sum + m * blocks + g * 8 : nullptr,
                            x.sum16 ? x.sum16 + m * (K / 16) + g * 16 : nullptr);
        }
      }
      for (int64_t r = 0; r < rows; ++r) y[(m0 + r) * ldy + n] = hsum(acc[r]);
    }
  }
}

// Instantiated here, under the target pragma.
QGemvFn pick(QuantizationEncoding e) {
  switch (e) {
    case QuantizationEncoding::q4_0: return gemv<Q40>;
    case QuantizationEncoding::q4_k: return gemv<Q4KQ5K<false>>;
    case QuantizationEncoding::q5_k: return gemv<Q4KQ5K<true>>;
    case QuantizationEncoding::q6_k: return gemv<Q6K>;
    case QuantizationEncoding::q8_0: break;
  }
  return nullptr;
}

}  // namespace
}  // namespace kiln::kernels::quantized
#ifdef __clang__
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

namespace kiln::kernels::quantized {
QGemvFn avx2_block_gemv(graph::QuantizationEncoding e) { return pick(e); }
}  // namespace kiln::kernels::quantized
#else
namespace kiln::kernels::quantized {
QGemvFn avx2_block_gemv(graph::QuantizationEncoding) { return nullptr; }
}  // namespace kiln::kernels::quantized
#endif
