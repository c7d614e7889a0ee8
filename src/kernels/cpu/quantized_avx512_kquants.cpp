// The decode GEMV (one activation row) of Q4_K, Q5_K and Q6_K for AVX-512 + AVX512_VNNI: the
// AVX2 kernels' algorithm (quantized_avx2.cpp) on 64 weights per instruction. A 32-byte chunk of
// quants unpacks to 64 consecutive weights in one register, vpmaddubsw multiplies them with 64
// activations, and vpdpwssd applies the sub-block scales as it widens and accumulates (vpmaddwd +
// vpaddd in one). Lane l and lane l + 8 of the 16 int32 sums hold the products that the AVX2
// kernel's lane l holds, so folding the halves gives its int32 sums exactly, and the f32 steps after
// are the same: the same bits as the AVX2 kernel (tests/kernels/test_quantized_blocks.cpp). More
// activation rows (prefill) run the AVX2 kernel.
// Standard headers first, then the target pragma (see gemm.h for why).
#include <cstdint>
#include <cstring>

#include "kernels/cpu/quantized.h"

#if defined(__x86_64__)
// As in gemm_avx512.cpp: GCC 12 flags the undefined upper halves of its own cast intrinsics.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>

#ifdef __clang__  // clang has no GCC target pragma; this is its equivalent
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")
#endif
#include "kernels/cpu/quantized_x86_helpers.h"

namespace kiln::kernels::quantized {
namespace {

using graph::QuantizationEncoding;

inline __m512i load512(const void* p) { return _mm512_loadu_si512(p); }

// Lanes l and l + 8 added: the AVX2 kernel's lane l.
inline __m256i fold(__m512i v) {
  return _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1));
}

// int16 lanes 0-15 take element a of `scales` (int16), lanes 16-31 element b.
inline __m512i two_scales(__m512i scales, short a, short b) {
  return _mm512_permutexvar_epi16(
      _mm512_mask_blend_epi16(0xFFFF0000u, _mm512_set1_epi16(a), _mm512_set1_epi16(b)), scales);
}

// The four int16 quarters (8 lanes each) take elements a, b, c, e of `scales`.
inline __m512i four_scales(__m512i scales, short a, short b, short c, short e) {
  const __m512i ab = _mm512_mask_blend_epi16(0xFF00FF00u, _mm512_set1_epi16(a), _mm512_set1_epi16(b));
  const __m512i ce = _mm512_mask_blend_epi16(0xFF00FF00u, _mm512_set1_epi16(c), _mm512_set1_epi16(e));
  return _mm512_permutexvar_epi16(_mm512_mask_blend_epi16(0xFFFF0000u, ab, ce), scales);
}

// Q4_K / Q5_K: (d * d_x) * sum_j sc_j dot_j - (dmin * d_x) * sum_j m_j sum_j.
template <bool kFive> struct Q4KQ5K {
  static constexpr int64_t kBytes = kFive ? graph::kQ5_KBlockBytes : graph::kQ4_KBlockBytes;
  struct Acc {
    __m256 v, mins;
    Acc() : v(_mm256_setzero_ps()), mins(_mm256_setzero_ps()) {}
    float total() const { return hsum(v) - hsum(mins); }
  };

  static void fused(Acc& acc, const uint8_t* block, const Q8Activations& x, int64_t s) {
    const auto [sc03, sc47, m03, m47] = k_scale_words(block);
    const __m512i sc16 = _mm512_castsi128_si512(
        _mm_cvtepu8_epi16(_mm_setr_epi32(static_cast<int>(sc03), static_cast<int>(sc47), 0, 0)));
    const __m256i mn = _mm256_cvtepu8_epi32(_mm_setr_epi32(static_cast<int>(m03), static_cast<int>(m47), 0, 0));
    const uint8_t* q = block + (kFive ? 48 : 16);
    const auto* xq = reinterpret_cast<const int8_t*>(x.x) + s * 256;
    const __m512i low = _mm512_set1_epi8(0x0F);
    [[maybe_unused]] const __m512i qh = kFive ? _mm512_broadcast_i64x4(load256(block + 16)) : _mm512_setzero_si512();
    __m512i dots = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      // Chunk c's 32 bytes: the low nibbles are sub-block 2c (the low half), the high ones 2c + 1.
      const __m512i raw = _mm512_broadcast_i64x4(load256(q + 32 * c));
      __m512i w = _mm512_and_si512(_mm512_mask_srli_epi16(raw, 0xFFFF0000u, raw, 4), low);
      if constexpr (kFive) {  // bit 2c (low half) and 2c + 1 (high half) of each qh byte to bit 4
        const __m512i bit =
            c < 2 ? _mm512_sllv_epi16(qh, _mm512_mask_blend_epi16(0xFFFF0000u, _mm512_set1_epi16(static_cast<short>(4 - 2 * c)),
                                                                  _mm512_set1_epi16(static_cast<short>(3 - 2 * c))))
                  : _mm512_srlv_epi16(qh, _mm512_mask_blend_epi16(0xFFFF0000u, _mm512_set1_epi16(static_cast<short>(2 * c - 4)),
                                                                  _mm512_set1_epi16(static_cast<short>(2 * c - 3))));
        w = _mm512_or_si512(w, _mm512_and_si512(bit, _mm512_set1_epi8(0x10)));
      }
      const __m512i sc = two_scales(sc16, static_cast<short>(2 * c), static_cast<short>(2 * c + 1));
      dots = _mm512_dpwssd_epi32(dots, _mm512_maddubs_epi16(w, load512(xq + 64 * c)), sc);
    }
    const __m256i min_sums = _mm256_madd_epi16(mn, load256(x.sum + s * 8));
    const float dx = x.d[s];
    acc.v = _mm256_fmadd_ps(_mm256_set1_ps(load_f16(block) * dx), _mm256_cvtepi32_ps(fold(dots)), acc.v);
    acc.mins = _mm256_fmadd_ps(_mm256_set1_ps(load_f16(block + 2) * dx), _mm256_cvtepi32_ps(min_sums), acc.mins);
  }
};

// Q6_K: (d * d_x) * sum over the 16 sub-blocks i of sc_i * (dot_i - 32 * sum_i).
struct Q6K {
  static constexpr int64_t kBytes = graph::kQ6_KBlockBytes;
  struct Acc {
    __m256 v;
    Acc() : v(_mm256_setzero_ps()) {}
    float total() const { return hsum(v); }
  };

  static void fused(Acc& acc, const uint8_t* block, const Q8Activations& x, int64_t s) {
    const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 192)));
    const __m512i scales = _mm512_castsi256_si512(sc16);
    const auto* xq = reinterpret_cast<const int8_t*>(x.x) + s * 256;
    const __m512i low = _mm512_set1_epi8(0x0F), two = _mm512_set1_epi8(0x30);
    // qh's shifts per half: weights 0-31 of a 64 take bits 0-1 (<< 4), 32-63 bits 2-3 (<< 2); the
    // next 64 take bits 4-5 (>> 0) and 6-7 (>> 2), all landing on bits 4-5.
    const __m512i first_shift = _mm512_mask_blend_epi16(0xFFFF0000u, _mm512_set1_epi16(4), _mm512_set1_epi16(2));
    const __m512i second_shift = _mm512_mask_blend_epi16(0xFFFF0000u, _mm512_set1_epi16(0), _mm512_set1_epi16(2));
    __m512i dots = _mm512_setzero_si512();
#pragma GCC unroll 2
    for (int half = 0; half < 2; ++half) {
      const __m512i ql = load512(block + 64 * half);
      const __m512i qh = _mm512_broadcast_i64x4(load256(block + 128 + 32 * half));
      const __m512i w01 = _mm512_or_si512(_mm512_and_si512(ql, low), _mm512_and_si512(_mm512_sllv_epi16(qh, first_shift), two));
      const __m512i w23 = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), low),
                                          _mm512_and_si512(_mm512_srlv_epi16(qh, second_shift), two));
      const short b = static_cast<short>(8 * half);
      const __m512i s01 = four_scales(scales, b, static_cast<short>(b + 1), static_cast<short>(b + 2), static_cast<short>(b + 3));
      const __m512i s23 = four_scales(scales, static_cast<short>(b + 4), static_cast<short>(b + 5), static_cast<short>(b + 6),
                                      static_cast<short>(b + 7));
      dots = _mm512_dpwssd_epi32(dots, _mm512_maddubs_epi16(w01, load512(xq + 128 * half)), s01);
      dots = _mm512_dpwssd_epi32(dots, _mm512_maddubs_epi16(w23, load512(xq + 128 * half + 64)), s23);
    }
    // sum_i sc_i * sum_i(q_x): the 32 * sum the -32 of the levels takes away.
    const __m256i offsets = _mm256_madd_epi16(sc16, load256(x.sum16 + s * 16));
    const __m256i total = _mm256_sub_epi32(fold(dots), _mm256_slli_epi32(offsets, 5));
    acc.v = _mm256_fmadd_ps(_mm256_set1_ps(load_f16(block + 208) * x.d[s]), _mm256_cvtepi32_ps(total), acc.v);
  }
};

// Rows [n0, n1) of w against one activation row, kStreams rows at once (the i-th rows of kStreams
// equal parts of the range, so the prefetchers follow several sequential streams, as the AVX2 and
// Q8_0 GEMVs do), the rest one at a time. Several activation rows: the AVX2 kernel.
template <class Format, QuantizationEncoding kEncoding>
void gemv(const Q8Activations& x, const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1, float* y, int64_t ldy) {
  if (x.M != 1) return avx2_block_gemv(kEncoding)(x, w, row_bytes, n0, n1, y, ldy);
  const int64_t supers = x.K / 256;
  constexpr int kStreams = 4;
  const int64_t part = (n1 - n0) / kStreams;
  for (int64_t i = 0; i < part; ++i) {
    typename Format::Acc acc[kStreams];
    const uint8_t* rows[kStreams];
#pragma GCC unroll 4
    for (int r = 0; r < kStreams; ++r) rows[r] = w + (n0 + r * part + i) * row_bytes;
    for (int64_t s = 0; s < supers; ++s)
#pragma GCC unroll 4
      for (int r = 0; r < kStreams; ++r) {
        __builtin_prefetch(rows[r] + s * Format::kBytes + 1024);
        Format::fused(acc[r], rows[r] + s * Format::kBytes, x, s);
      }
    for (int r = 0; r < kStreams; ++r) y[n0 + r * part + i] = acc[r].total();
  }
  for (int64_t n = n0 + kStreams * part; n < n1; ++n) {
    const uint8_t* row = w + n * row_bytes;
    typename Format::Acc acc;
    for (int64_t s = 0; s < supers; ++s) {
      __builtin_prefetch(row + s * Format::kBytes + 1024);
      Format::fused(acc, row + s * Format::kBytes, x, s);
    }
    y[n] = acc.total();
  }
}

QGemvFn pick(QuantizationEncoding e) {
  switch (e) {
    case QuantizationEncoding::q4_k: return gemv<Q4KQ5K<false>, QuantizationEncoding::q4_k>;
    case QuantizationEncoding::q5_k: return gemv<Q4KQ5K<true>, QuantizationEncoding::q5_k>;
    case QuantizationEncoding::q6_k: return gemv<Q6K, QuantizationEncoding::q6_k>;
    default: return nullptr;
  }
}

}  // namespace
}  // namespace kiln::kernels::quantized
#ifdef __clang__
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

namespace kiln::kernels::quantized {
QGemvFn avx512_vnni_block_gemv(graph::QuantizationEncoding e) { return pick(e); }
}  // namespace kiln::kernels::quantized
#else
namespace kiln::kernels::quantized {
QGemvFn avx512_vnni_block_gemv(graph::QuantizationEncoding) { return nullptr; }
}  // namespace kiln::kernels::quantized
#endif
