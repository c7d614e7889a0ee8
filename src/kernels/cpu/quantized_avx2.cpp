// The AVX2 GEMVs of Q4_0, Q4_K, Q5_K and Q6_K (quantized.h's last section), and of Q8_0 for CPUs
// without AVX512-VNNI: the quants, unpacked to unsigned bytes in registers, times the signed int8
// activations with vpmaddubsw (pairs summed to int16, exactly: at most 2 * 63 * 127), then vpmaddwd
// to int32. Each weight row is read in place once per 8 activation rows; a group of 256 weights (a
// super-block, or 8 blocks of 32) is decoded once and multiplied into each row's accumulator. One
// activation row (decode) takes every format's `fused` step instead, on kStreams weight rows at once.
// * K-quants (activations per 256): vpmaddwd applies the sub-block scales as it widens, so the whole
//   super-block sums in int32 and one FMA scales it.
// * Q4_0, Q8_0 (activations and weights per 32): the 8 block dots reduce to one vector whose lane j
//   is block j's, scaled with the 8 (d_w * d_x) at once.
// Standard headers first, then the target pragma (see gemm.h for why).
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "kernels/cpu/quantized.h"

#if defined(__x86_64__)
#include <immintrin.h>

#ifdef __clang__  // clang has no GCC target pragma; this is its equivalent
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#endif
#include "kernels/cpu/quantized_x86_helpers.h"
#include "kernels/cpu/quantized_block_unpack.h"

namespace kiln::kernels::quantized {
namespace {

constexpr int64_t kRowsPerPass = 8;  // activation rows sharing one decode of a weight group

// The loops over a group's 8 blocks (or 4 pairs, 2 halves) are unrolled (`#pragma GCC unroll`), so
// the decoded weights stay in registers and the shuffle controls are constants: -O2 alone kept them
// in memory and built the controls with vpinsrb.

// Eight int32 vectors -> one whose lane j is the sum of v[j]'s eight lanes.
inline __m256i sum_lanes8(const __m256i v[8]) {
  const __m256i h01 = _mm256_hadd_epi32(v[0], v[1]), h23 = _mm256_hadd_epi32(v[2], v[3]);
  const __m256i h45 = _mm256_hadd_epi32(v[4], v[5]), h67 = _mm256_hadd_epi32(v[6], v[7]);
  const __m256i h0123 = _mm256_hadd_epi32(h01, h23), h4567 = _mm256_hadd_epi32(h45, h67);
  // h0123 holds blocks 0..3's low-half sums in its low 128 bits and their high-half sums above.
  return _mm256_add_epi32(_mm256_permute2x128_si256(h0123, h4567, 0x20),
                          _mm256_permute2x128_si256(h0123, h4567, 0x31));
}

// One f32 accumulator per activation row (y = its lanes' sum).
// (Constructors written out: an implicit one would be compiled without the target pragma.)
struct RowAcc {
  __m256 v;
  RowAcc() : v(_mm256_setzero_ps()) {}
  float total() const { return hsum(v); }
};

// ---- K-quants: activations per 256 (x.d one scale per super-block) -------------------------------

// Q4_K / Q5_K: (d * d_x) * sum_j sc_j dot_j - (dmin * d_x) * sum_j m_j sum_j.
template <bool kFive> struct Q4KQ5K {
  static constexpr int64_t kBytes = kFive ? graph::kQ5_KBlockBytes : graph::kQ4_KBlockBytes;
  static constexpr bool kPartialGroups = false;
  static constexpr bool kFused = true;
  static constexpr int kStreams = 4;
  static constexpr bool kInterleaveStreams = true;
  struct Acc {
    __m256 v, mins;
    Acc() : v(_mm256_setzero_ps()), mins(_mm256_setzero_ps()) {}
    float total() const { return hsum(v) - hsum(mins); }
  };
  __m256i w[8];       // sub-block j's levels as bytes
  __m256i scale[8];   // sc_j in every int16 lane
  __m256i mins;       // m_j in int32 lane j
  float d = 0, dmin = 0;

  // Bit j of each qh byte moved to bit 4 (16-bit shifts: bit 4 of each byte comes from its own byte).
  template <int J> static __m256i high_bit(__m256i qh) {
    const __m256i b = J < 4 ? _mm256_slli_epi16(qh, 4 - J) : J > 4 ? _mm256_srli_epi16(qh, J - 4) : qh;
    return _mm256_and_si256(b, _mm256_set1_epi8(0x10));
  }

  void decode(const uint8_t* block) {
    const auto [sc03, sc47, m03, m47] = k_scale_words(block);
    const __m256i sc16 = _mm256_broadcastsi128_si256(
        _mm_cvtepu8_epi16(_mm_setr_epi32(static_cast<int>(sc03), static_cast<int>(sc47), 0, 0)));
    #pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {  // word j of each 128-bit lane, everywhere
      const char lo = static_cast<char>(2 * j), hi = static_cast<char>(2 * j + 1);
      scale[j] = _mm256_shuffle_epi8(sc16, _mm256_setr_epi8(lo, hi, lo, hi, lo, hi, lo, hi, lo, hi, lo, hi, lo, hi, lo, hi,
                                                             lo, hi, lo, hi, lo, hi, lo, hi, lo, hi, lo, hi, lo, hi, lo, hi));
    }
    mins = _mm256_cvtepu8_epi32(_mm_setr_epi32(static_cast<int>(m03), static_cast<int>(m47), 0, 0));
    d = load_f16(block);
    dmin = load_f16(block + 2);
    const uint8_t* q = block + (kFive ? 48 : 16);
    const __m256i low = _mm256_set1_epi8(0x0F);
    #pragma GCC unroll 8
    for (int p = 0; p < 4; ++p) {
      const __m256i raw = load256(q + 32 * p);
      w[2 * p] = _mm256_and_si256(raw, low);
      w[2 * p + 1] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
    }
    if constexpr (kFive) {
      const __m256i qh = load256(block + 16);
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

  void update(Acc& acc, const Q8Activations& x, int64_t m, int64_t s) const {
    const int64_t supers = x.K / 256;
    const auto* xq = reinterpret_cast<const int8_t*>(x.x) + m * x.K + s * 256;
    __m256i dots = _mm256_setzero_si256();  // lane sums: sum_j sc_j dot_j, exactly
    #pragma GCC unroll 8
    for (int j = 0; j < 8; ++j)
      dots = _mm256_add_epi32(dots, _mm256_madd_epi16(_mm256_maddubs_epi16(w[j], load256(xq + 32 * j)), scale[j]));
    // m_j * sum_j: the sums (|sum| <= 32 * 127) in the low int16 of each int32 lane, m_j's high half 0.
    const __m256i min_sums = _mm256_madd_epi16(mins, load256(x.sum + (m * supers + s) * 8));
    const float dx = x.d[m * supers + s];
    acc.v = _mm256_fmadd_ps(_mm256_set1_ps(d * dx), _mm256_cvtepi32_ps(dots), acc.v);
    acc.mins = _mm256_fmadd_ps(_mm256_set1_ps(dmin * dx), _mm256_cvtepi32_ps(min_sums), acc.mins);
  }

  // decode then update for one activation row, a pair of sub-blocks at a time so nothing spills
  // (decode's 16 vectors do not fit the 16 registers beside update's). The same int32 sums and f32
  // operations, so the same bits.
  [[gnu::always_inline]] static void fused(Acc& acc, const uint8_t* block, const Q8Activations& x, int64_t m, int64_t s) {
    const auto [sc03, sc47, m03, m47] = k_scale_words(block);
    const __m256i sc16 = _mm256_broadcastsi128_si256(
        _mm_cvtepu8_epi16(_mm_setr_epi32(static_cast<int>(sc03), static_cast<int>(sc47), 0, 0)));
    const __m256i mn = _mm256_cvtepu8_epi32(_mm_setr_epi32(static_cast<int>(m03), static_cast<int>(m47), 0, 0));
    const uint8_t* q = block + (kFive ? 48 : 16);
    const int64_t supers = x.K / 256;
    const auto* xq = reinterpret_cast<const int8_t*>(x.x) + m * x.K + s * 256;
    const __m256i low = _mm256_set1_epi8(0x0F);
    [[maybe_unused]] const __m256i qh = kFive ? load256(block + 16) : _mm256_setzero_si256();
    __m256i dots = _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int p = 0; p < 4; ++p) {
      const __m256i raw = load256(q + 32 * p);
      __m256i lo = _mm256_and_si256(raw, low), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
      if constexpr (kFive) {  // bits 2p and 2p + 1 of qh to bit 4
        const __m256i bit4 = _mm256_set1_epi8(0x10);
        lo = _mm256_or_si256(lo, _mm256_and_si256(p < 2 ? _mm256_slli_epi16(qh, 4 - 2 * p) : _mm256_srli_epi16(qh, 2 * p - 4), bit4));
        hi = _mm256_or_si256(hi, _mm256_and_si256(p < 2 ? _mm256_slli_epi16(qh, 3 - 2 * p) : _mm256_srli_epi16(qh, 2 * p - 3), bit4));
      }
      const char a = static_cast<char>(4 * p), a1 = static_cast<char>(4 * p + 1);
      const char b = static_cast<char>(4 * p + 2), b1 = static_cast<char>(4 * p + 3);
      const __m256i sa = _mm256_shuffle_epi8(sc16, _mm256_setr_epi8(a, a1, a, a1, a, a1, a, a1, a, a1, a, a1, a, a1, a, a1,
                                                                     a, a1, a, a1, a, a1, a, a1, a, a1, a, a1, a, a1, a, a1));
      const __m256i sb = _mm256_shuffle_epi8(sc16, _mm256_setr_epi8(b, b1, b, b1, b, b1, b, b1, b, b1, b, b1, b, b1, b, b1,
                                                                     b, b1, b, b1, b, b1, b, b1, b, b1, b, b1, b, b1, b, b1));
      dots = _mm256_add_epi32(dots, _mm256_madd_epi16(_mm256_maddubs_epi16(lo, load256(xq + 64 * p)), sa));
      dots = _mm256_add_epi32(dots, _mm256_madd_epi16(_mm256_maddubs_epi16(hi, load256(xq + 64 * p + 32)), sb));
    }
    const __m256i min_sums = _mm256_madd_epi16(mn, load256(x.sum + (m * supers + s) * 8));
    const float dx = x.d[m * supers + s];
    acc.v = _mm256_fmadd_ps(_mm256_set1_ps(load_f16(block) * dx), _mm256_cvtepi32_ps(dots), acc.v);
    acc.mins = _mm256_fmadd_ps(_mm256_set1_ps(load_f16(block + 2) * dx), _mm256_cvtepi32_ps(min_sums), acc.mins);
  }
};

// Q6_K: (d * d_x) * sum over the 16 sub-blocks i of sc_i * (dot_i - 32 * sum_i).
struct Q6K {
  static constexpr int64_t kBytes = graph::kQ6_KBlockBytes;
  static constexpr bool kPartialGroups = false;
  static constexpr bool kFused = true;
  static constexpr int kStreams = 2;
  static constexpr bool kInterleaveStreams = false;
  using Acc = RowAcc;
  __m256i w[8];       // 32-weight block j's levels (0..63) as bytes
  __m256i scale[8];   // block j: int16 lanes 0-7 its first 16's scale, 8-15 its second's
  __m256i scale16;    // the 16 scales as int16
  float d = 0;

  void decode(const uint8_t* block) {
    const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 192));
    scale16 = _mm256_cvtepi8_epi16(sc);
    const __m256i first = _mm256_permute2x128_si256(scale16, scale16, 0x00);   // scales 0-7, twice
    const __m256i second = _mm256_permute2x128_si256(scale16, scale16, 0x11);  // scales 8-15, twice
    #pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {  // words 2j and 2j + 1 (of their 128-bit half) in the low and high lanes
      const char a = static_cast<char>(4 * j % 16), b = static_cast<char>((4 * j + 2) % 16);
      const char a1 = static_cast<char>(a + 1), b1 = static_cast<char>(b + 1);
      scale[j] = _mm256_shuffle_epi8(j < 4 ? first : second,
                                     _mm256_setr_epi8(a, a1, a, a1, a, a1, a, a1, a, a1, a, a1, a, a1, a, a1, b, b1, b, b1,
                                                      b, b1, b, b1, b, b1, b, b1, b, b1, b, b1));
    }
    d = load_f16(block + 208);
    const __m256i low = _mm256_set1_epi8(0x0F), two = _mm256_set1_epi8(0x30);
    #pragma GCC unroll 8
    for (int half = 0; half < 2; ++half) {
      const uint8_t* ql = block + 64 * half;
      const __m256i l0 = load256(ql), l1 = load256(ql + 32), qh = load256(block + 128 + 32 * half);
      // quantization.h's layout: blocks 4h .. 4h + 3 take bits 0-1, 2-3, 4-5, 6-7 of qh as bits 4-5.
      w[4 * half] = _mm256_or_si256(_mm256_and_si256(l0, low), _mm256_and_si256(_mm256_slli_epi16(qh, 4), two));
      w[4 * half + 1] = _mm256_or_si256(_mm256_and_si256(l1, low), _mm256_and_si256(_mm256_slli_epi16(qh, 2), two));
      w[4 * half + 2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), low), _mm256_and_si256(qh, two));
      w[4 * half + 3] =
          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), low), _mm256_and_si256(_mm256_srli_epi16(qh, 2), two));
    }
  }

  void update(Acc& acc, const Q8Activations& x, int64_t m, int64_t s) const {
    const int64_t supers = x.K / 256;
    const auto* xq = reinterpret_cast<const int8_t*>(x.x) + m * x.K + s * 256;
    __m256i dots = _mm256_setzero_si256();  // |lane| <= 2 * 2 * 63 * 127 * 128 per block
    #pragma GCC unroll 8
    for (int j = 0; j < 8; ++j)
      dots = _mm256_add_epi32(dots, _mm256_madd_epi16(_mm256_maddubs_epi16(w[j], load256(xq + 32 * j)), scale[j]));
    // sum_i sc_i * sum_i(q_x): the 32 * sum the -32 of the levels takes away.
    const __m256i offsets = _mm256_madd_epi16(scale16, load256(x.sum16 + (m * supers + s) * 16));
    dots = _mm256_sub_epi32(dots, _mm256_slli_epi32(offsets, 5));
    acc.v = _mm256_fmadd_ps(_mm256_set1_ps(d * x.d[m * supers + s]), _mm256_cvtepi32_ps(dots), acc.v);
  }

  // decode then update for one activation row, a quarter at a time (as Q4KQ5K::fused): the same bits.
  [[gnu::always_inline]] static void fused(Acc& acc, const uint8_t* block, const Q8Activations& x, int64_t m, int64_t s) {
    const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 192));
    const __m256i sc16 = _mm256_cvtepi8_epi16(sc);
    const int64_t supers = x.K / 256;
    const auto* xq = reinterpret_cast<const int8_t*>(x.x) + m * x.K + s * 256;
    const __m256i low = _mm256_set1_epi8(0x0F), two = _mm256_set1_epi8(0x30);
    __m256i dots = _mm256_setzero_si256();
#pragma GCC unroll 2
    for (int half = 0; half < 2; ++half) {
      const uint8_t* ql = block + 64 * half;
      const __m256i l0 = load256(ql), l1 = load256(ql + 32), qh = load256(block + 128 + 32 * half);
      const __m256i src = half == 0 ? _mm256_permute2x128_si256(sc16, sc16, 0x00) : _mm256_permute2x128_si256(sc16, sc16, 0x11);
      const __m256i w[4] = {
          _mm256_or_si256(_mm256_and_si256(l0, low), _mm256_and_si256(_mm256_slli_epi16(qh, 4), two)),
          _mm256_or_si256(_mm256_and_si256(l1, low), _mm256_and_si256(_mm256_slli_epi16(qh, 2), two)),
          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), low), _mm256_and_si256(qh, two)),
          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), low), _mm256_and_si256(_mm256_srli_epi16(qh, 2), two))};
#pragma GCC unroll 4
      for (int t = 0; t < 4; ++t) {
        const char a = static_cast<char>(4 * t), a1 = static_cast<char>(4 * t + 1);
        const char b = static_cast<char>(4 * t + 2), b1 = static_cast<char>(4 * t + 3);
        const __m256i scale = _mm256_shuffle_epi8(src, _mm256_setr_epi8(a, a1, a, a1, a, a1, a, a1, a, a1, a, a1, a, a1, a,
                                                                         a1, b, b1, b, b1, b, b1, b, b1, b, b1, b, b1, b, b1, b, b1));
        const __m256i p16 = _mm256_maddubs_epi16(w[t], load256(xq + 128 * half + 32 * t));
        dots = _mm256_add_epi32(dots, _mm256_madd_epi16(p16, scale));
      }
    }
    const __m256i offsets = _mm256_madd_epi16(sc16, load256(x.sum16 + (m * supers + s) * 16));
    dots = _mm256_sub_epi32(dots, _mm256_slli_epi32(offsets, 5));
    acc.v = _mm256_fmadd_ps(_mm256_set1_ps(load_f16(block + 208) * x.d[m * supers + s]), _mm256_cvtepi32_ps(dots), acc.v);
  }
};

// ---- Q4_0, Q8_0: activations and weights per 32 ---------------------------------------------------

// A row's last group of fewer than 8 blocks, for the formats' fused steps: decode, then update.
template <class Format>
void partial_group(typename Format::Acc& acc, const uint8_t* group, const Q8Activations& x, int64_t m, int64_t g) {
  Format f;
  f.blocks = static_cast<int>(x.K / 32 - 8 * g);
  f.decode(group);
  f.update(acc, x, m, g);
}

// Q4_0: 8 blocks per group (fewer in a row's last); lane j accumulates (d_w,j * d_x,j) * (dot_j - 8 sum_j).
struct Q40 {
  static constexpr int64_t kBytes = 8 * graph::kQ4_0BlockBytes;
  static constexpr bool kPartialGroups = true;
  static constexpr bool kFused = true;
  static constexpr int kStreams = 4;
  static constexpr bool kInterleaveStreams = true;
  using Acc = RowAcc;
  __m256i w[8];
  __m256 dw;
  int blocks = 8;

  void decode(const uint8_t* group) {
    alignas(16) uint16_t d[8] = {};
    const __m128i low = _mm_set1_epi8(0x0F);
    #pragma GCC unroll 8
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

  void update(Acc& acc, const Q8Activations& x, int64_t m, int64_t g) const {
    const int64_t blocks_per_row = x.K / 32, first = m * blocks_per_row + 8 * g;
    const auto* xq = reinterpret_cast<const int8_t*>(x.x) + m * x.K + g * 256;
    __m256i dots[8];
    __m256 dx;
    __m256i sums;
    if (blocks == 8) {  // a whole group: straight loads
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j)
        dots[j] = _mm256_madd_epi16(_mm256_maddubs_epi16(w[j], load256(xq + 32 * j)), _mm256_set1_epi16(1));
      dx = _mm256_loadu_ps(x.d + first);
      sums = load256(x.sum + first);
    } else {  // a row's last, partial group: nothing read past the row
      alignas(32) float d[8] = {};
      alignas(32) int32_t s[8] = {};
      for (int j = 0; j < 8; ++j) {
        dots[j] = _mm256_setzero_si256();
        if (j >= blocks) continue;
        dots[j] = _mm256_madd_epi16(_mm256_maddubs_epi16(w[j], load256(xq + 32 * j)), _mm256_set1_epi16(1));
        d[j] = x.d[first + j];
        s[j] = x.sum[first + j];
      }
      dx = _mm256_load_ps(d);
      sums = _mm256_load_si256(reinterpret_cast<const __m256i*>(s));
    }
    const __m256i dot = _mm256_sub_epi32(sum_lanes8(dots), _mm256_slli_epi32(sums, 3));
    acc.v = _mm256_fmadd_ps(_mm256_mul_ps(dw, dx), _mm256_cvtepi32_ps(dot), acc.v);
  }

  // decode then update for one activation row, a block at a time (as Q80::fused): the same bits.
  [[gnu::always_inline]] static void fused(Acc& acc, const uint8_t* group, const Q8Activations& x, int64_t m, int64_t g) {
    const int64_t blocks_per_row = x.K / 32, first = m * blocks_per_row + 8 * g;
    if (blocks_per_row - 8 * g < 8) return partial_group<Q40>(acc, group, x, m, g);
    const auto* xq = reinterpret_cast<const int8_t*>(x.x) + m * x.K + g * 256;
    const __m128i low = _mm_set1_epi8(0x0F);
    alignas(16) uint16_t d[8];
    __m256i dots[8];
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      const uint8_t* b = group + j * graph::kQ4_0BlockBytes;
      std::memcpy(&d[j], b, 2);
      const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2));
      const __m256i w = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), low), _mm_and_si128(raw, low));
      dots[j] = _mm256_madd_epi16(_mm256_maddubs_epi16(w, load256(xq + 32 * j)), _mm256_set1_epi16(1));
    }
    const __m256 dw = _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(d)));
    const __m256i dot = _mm256_sub_epi32(sum_lanes8(dots), _mm256_slli_epi32(load256(x.sum + first), 3));
    acc.v = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_loadu_ps(x.d + first)), _mm256_cvtepi32_ps(dot), acc.v);
  }
};

// Q8_0 (activations not offset: the VNNI kernels' q_x + 128 would overflow vpmaddubsw's int16 pair
// sums): |w| times q_x with w's sign, so the unsigned operand is |w| <= 127 and a pair sums to at most
// 2 * 127 * 127. Lane j accumulates (d_w,j * d_x,j) * dot_j.
struct Q80 {
  static constexpr int64_t kBytes = 8 * graph::kQ8_0BlockBytes;
  static constexpr bool kPartialGroups = true;
  static constexpr bool kFused = true;
  static constexpr int kStreams = 4;
  static constexpr bool kInterleaveStreams = true;
  using Acc = RowAcc;
  __m256i w[8];      // the quants as signed bytes (their signs)
  __m256i abs_w[8];  // and their magnitudes
  __m256 dw;
  int blocks = 8;

  void decode(const uint8_t* group) {
    alignas(16) uint16_t d[8] = {};
    #pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      if (j >= blocks) {
        w[j] = abs_w[j] = _mm256_setzero_si256();
        continue;
      }
      const uint8_t* b = group + j * graph::kQ8_0BlockBytes;
      std::memcpy(&d[j], b, 2);
      w[j] = load256(b + 2);
      abs_w[j] = _mm256_abs_epi8(w[j]);
    }
    dw = _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(d)));
  }

  void update(Acc& acc, const Q8Activations& x, int64_t m, int64_t g) const {
    const int64_t first = m * (x.K / 32) + 8 * g;
    const auto* xq = reinterpret_cast<const int8_t*>(x.x) + m * x.K + g * 256;
    __m256i dots[8];
    __m256 dx;
    if (blocks == 8) {  // a whole group: straight loads
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) {
        const __m256i signed_x = _mm256_sign_epi8(load256(xq + 32 * j), w[j]);
        dots[j] = _mm256_madd_epi16(_mm256_maddubs_epi16(abs_w[j], signed_x), _mm256_set1_epi16(1));
      }
      dx = _mm256_loadu_ps(x.d + first);
    } else {  // a row's last, partial group: nothing read past the row
      alignas(32) float d[8] = {};
      for (int j = 0; j < 8; ++j) {
        dots[j] = _mm256_setzero_si256();
        if (j >= blocks) continue;
        const __m256i signed_x = _mm256_sign_epi8(load256(xq + 32 * j), w[j]);
        dots[j] = _mm256_madd_epi16(_mm256_maddubs_epi16(abs_w[j], signed_x), _mm256_set1_epi16(1));
        d[j] = x.d[first + j];
      }
      dx = _mm256_load_ps(d);
    }
    acc.v = _mm256_fmadd_ps(_mm256_mul_ps(dw, dx), _mm256_cvtepi32_ps(sum_lanes8(dots)), acc.v);
  }

  // decode then update for one activation row, a block at a time: 8 dot vectors live instead of
  // decode's 16 quant vectors, so nothing spills. The same int32 sums and f32 operations, so the
  // same bits. A row's last, partial group goes through decode and update.
  [[gnu::always_inline]] static void fused(Acc& acc, const uint8_t* group, const Q8Activations& x, int64_t m, int64_t g) {
    const int64_t blocks_per_row = x.K / 32;
    if (blocks_per_row - 8 * g < 8) return partial_group<Q80>(acc, group, x, m, g);
    const auto* xq = reinterpret_cast<const int8_t*>(x.x) + m * x.K + g * 256;
    alignas(16) uint16_t d[8];
    __m256i dots[8];
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      const uint8_t* b = group + j * graph::kQ8_0BlockBytes;
      std::memcpy(&d[j], b, 2);
      const __m256i w = load256(b + 2);
      const __m256i signed_x = _mm256_sign_epi8(load256(xq + 32 * j), w);
      dots[j] = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(w), signed_x), _mm256_set1_epi16(1));
    }
    const __m256 dw = _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(d)));
    const __m256 dx = _mm256_loadu_ps(x.d + m * blocks_per_row + 8 * g);
    acc.v = _mm256_fmadd_ps(_mm256_mul_ps(dw, dx), _mm256_cvtepi32_ps(sum_lanes8(dots)), acc.v);
  }
};

// How far ahead of its reads a row stream prefetches: 16 KiB (a few rows). From DRAM one Zen 3 core
// read Q8_0 rows at 17.6 -> 20.7 GB/s and Q6_K at 15.0 -> 17.4 with it instead of 1 KiB (two cores
// 27.8 -> 30-33 and 26 -> 30-33; the other formats 2-10% up), bench_quantized BM_*/1/2048/8192; 2-4 KiB
// slowed Q6_K's decode (11-12 GB/s).
constexpr int64_t kRowPrefetchAhead = 16384;

// Rows [n0, n1) of w: for each weight row, activation rows kRowsPerPass at a time; each group of
// 256 weights decoded once per pass and multiplied into every row's accumulator. A row's arithmetic
// is the same whatever M is.
template <class Format>
void gemv(const Q8Activations& x, const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1, float* y, int64_t ldy) {
  const int64_t blocks = x.K / 32, groups = (blocks + 7) / 8;
  if constexpr (Format::kFused)
    if (x.M == 1) {
      // One activation row: kStreams weight rows at once, the i-th of kStreams equal parts of the
      // range, so the hardware prefetchers follow several sequential streams (as the VNNI Q8_0 GEMV
      // does, quantized_avx512_vnni.cpp); one stream left DRAM reads at half the rate. Q6_K's decode
      // holds more registers: 2 of its streams one after the other (each reloading the activations)
      // read 18.6-19.7 GB/s from cache against 16.5-18.3 for 4 interleaved, which spilled; Q8_0's
      // interleaved streams share each activation load, 1.3-1.9x faster than one after the other
      // (Zen 3, 1 thread).
      constexpr int kStreams = Format::kStreams;
      const int64_t part = (n1 - n0) / kStreams;
      for (int64_t i = 0; i < part; ++i) {
        typename Format::Acc acc[kStreams];
        const uint8_t* rows[kStreams];
#pragma GCC unroll 4
        for (int r = 0; r < kStreams; ++r) rows[r] = w + (n0 + r * part + i) * row_bytes;
        const auto step = [&](int r, int64_t g) {
          __builtin_prefetch(rows[r] + g * Format::kBytes + kRowPrefetchAhead);
          Format::fused(acc[r], rows[r] + g * Format::kBytes, x, 0, g);
        };
        for (int64_t g = 0; g < groups; ++g)
          if constexpr (Format::kInterleaveStreams) {
#pragma GCC unroll 4
            for (int r = 0; r < kStreams; ++r) step(r, g);
          } else {
#pragma GCC unroll 1
            for (int r = 0; r < kStreams; ++r) step(r, g);
          }
        for (int r = 0; r < kStreams; ++r) y[n0 + r * part + i] = acc[r].total();
      }
      n0 += kStreams * part;  // the rest, fewer than kStreams rows, below
    }
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * row_bytes;
    for (int64_t m0 = 0; m0 < x.M; m0 += kRowsPerPass) {
      const int64_t rows = x.M - m0 < kRowsPerPass ? x.M - m0 : kRowsPerPass;
      typename Format::Acc acc[kRowsPerPass];
      if constexpr (Format::kFused)
        if (rows == 1) {  // decode's usual case
          for (int64_t g = 0; g < groups; ++g) {
            __builtin_prefetch(row + g * Format::kBytes + kRowPrefetchAhead);
            Format::fused(acc[0], row + g * Format::kBytes, x, m0, g);
          }
          y[m0 * ldy + n] = acc[0].total();
          continue;
        }
      Format f;
      for (int64_t g = 0; g < groups; ++g) {
        if constexpr (Format::kPartialGroups) f.blocks = static_cast<int>(blocks - 8 * g < 8 ? blocks - 8 * g : 8);
        __builtin_prefetch(row + g * Format::kBytes + kRowPrefetchAhead);
        f.decode(row + g * Format::kBytes);
        for (int64_t r = 0; r < rows; ++r) f.update(acc[r], x, m0 + r, g);
      }
      for (int64_t r = 0; r < rows; ++r) y[(m0 + r) * ldy + n] = acc[r].total();
    }
  }
}

// Q8_0 and Q4_0's activations (quantized.h's portable_quantize_rows) 8 floats at a time: the same
// bits, for the reasons given for quantize_rows_256 below. Without it, a decode step's activations
// took ~14 ns a float in the portable loop (a libm call per rounding): 114 us before each llama-1B
// down projection, a quarter of the time its weights take to stream (Zen 3, session 37).
void quantize_rows(const float* x, int64_t M, int64_t K, bool offset, uint8_t* q, float* d, int32_t* sum) {
  const __m256 sign = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256 top = _mm256_set1_ps(127.0f), bottom = _mm256_set1_ps(-127.0f);
  const __m256i bias = _mm256_set1_epi8(static_cast<char>(offset ? 0x80 : 0));
  const int64_t blocks = K / 32;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < blocks; ++b) {
      const float* src = x + m * K + b * 32;
      __m256 v[4];
      for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(src + 8 * i);
      // max_ps returns its second operand where either is NaN: each |x| against 0 first drops NaNs,
      // as std::fmax does.
      __m256 a[4];
      for (int i = 0; i < 4; ++i) a[i] = _mm256_max_ps(_mm256_and_ps(v[i], sign), _mm256_setzero_ps());
      const __m256 amax = _mm256_max_ps(_mm256_max_ps(a[0], a[1]), _mm256_max_ps(a[2], a[3]));
      __m128 h = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
      h = _mm_max_ps(h, _mm_movehl_ps(h, h));
      h = _mm_max_ss(h, _mm_movehdup_ps(h));
      const float max = _mm_cvtss_f32(h);
      const float inv = max != 0.0f ? 127.0f / max : 0.0f;
      d[m * blocks + b] = max / 127.0f;
      const __m256 scale = _mm256_set1_ps(inv);
      __m256i level[4];
      for (int i = 0; i < 4; ++i)
        level[i] = _mm256_cvtps_epi32(_mm256_max_ps(_mm256_min_ps(_mm256_mul_ps(v[i], scale), top), bottom));
      // |level| <= 127: both packs are exact. Each packs within 128-bit halves, so the bytes come out
      // as dwords (0, 4, 1, 5, 2, 6, 3, 7) of the 8 groups of 4; the permute puts them in order.
      const __m256i bytes = _mm256_permutevar8x32_epi32(
          _mm256_packs_epi16(_mm256_packs_epi32(level[0], level[1]), _mm256_packs_epi32(level[2], level[3])),
          _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + m * K + b * 32), _mm256_xor_si256(bytes, bias));
      if (sum) {
        const __m256i total = _mm256_add_epi32(_mm256_add_epi32(level[0], level[1]), _mm256_add_epi32(level[2], level[3]));
        __m128i t = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
        t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
        t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
        sum[m * blocks + b] = _mm_cvtsi128_si32(t);
      }
    }
}

// The K-quants' activations (quantized.h's portable_quantize_rows_256) 8 floats at a time, as the
// AVX-512 one 16 at a time: the same bits (NaN and infinities included: max and min return their
// second operand on a NaN as std::fmax / std::fmin skip it, and vcvtps2dq rounds half to even).
void quantize_rows_256(const float* x, int64_t M, int64_t K, uint8_t* q, float* d, int32_t* sum, int16_t* sum16) {
  const __m256 sign = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256 top = _mm256_set1_ps(127.0f), bottom = _mm256_set1_ps(-127.0f);
  for (int64_t b = 0; b < M * K / 256; ++b) {
    const float* src = x + b * 256;
    __m256 amax = _mm256_setzero_ps();
    for (int i = 0; i < 256; i += 8) amax = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(src + i), sign), amax);
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    const float max = _mm_cvtss_f32(m);
    const float inv = max != 0.0f ? 127.0f / max : 0.0f;
    d[b] = max / 127.0f;
    const __m256 scale = _mm256_set1_ps(inv);
    for (int g = 0; g < 16; ++g) {  // 16 values: one sum16, half of a sum
      const float* v = src + 16 * g;
      const __m256i lo = _mm256_cvtps_epi32(_mm256_max_ps(_mm256_min_ps(_mm256_mul_ps(_mm256_loadu_ps(v), scale), top), bottom));
      const __m256i hi =
          _mm256_cvtps_epi32(_mm256_max_ps(_mm256_min_ps(_mm256_mul_ps(_mm256_loadu_ps(v + 8), scale), top), bottom));
      // |level| <= 127: both packs are exact. packs_epi32 interleaves the 128-bit halves; 0xD8 restores the order.
      const __m256i words = _mm256_permute4x64_epi64(_mm256_packs_epi32(lo, hi), 0xD8);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * 256 + 16 * g),
                       _mm_packs_epi16(_mm256_castsi256_si128(words), _mm256_extracti128_si256(words, 1)));
      const __m256i both = _mm256_add_epi32(lo, hi);
      __m128i t = _mm_add_epi32(_mm256_castsi256_si128(both), _mm256_extracti128_si256(both, 1));
      t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
      t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
      const int total = _mm_cvtsi128_si32(t);
      if (sum16) sum16[b * 16 + g] = static_cast<int16_t>(total);
      if (g % 2 == 0)
        sum[b * 8 + g / 2] = total;
      else
        sum[b * 8 + g / 2] += total;
    }
  }
}

// ---- the block GEMM of Q4_0, Q4_K, Q5_K and Q6_K (quantized.h), above gemm::kSmallM rows ----------
// On the AVX-512 kernel's panels (quantized_block_unpack.h): a 256-bit vector of a chunk's dword j
// holds 4 quants of 8 weight rows, so one broadcast activation dword feeds 8 rows. Without VNNI,
// vpmaddubsw multiplies them into int16 pair sums, added in int16 over kInt16Dwords dwords and then
// widened once with vpmaddwd: exact, as vpdpbusd's int32 dots are, and the f32 operations on them
// are BlockGemmRule's in its order, so every row gets the AVX-512 kernel's bits.

// Dwords whose pair sums add in int16 without overflow: kInt16Dwords * 2 * u_max * 127 < 2^15.
// Q8_0's |q| * q_x pairs (at most 2 * 127 * 127) take the whole int16: one dword each.
template <QuantizationEncoding E>
constexpr int kInt16Dwords = E == QuantizationEncoding::q8_0   ? 1
                             : E == QuantizationEncoding::q5_k ? 4
                             : E == QuantizationEncoding::q6_k ? 2
                                                               : 8;
static_assert(8 * 2 * 15 * 127 < 32768 && 4 * 2 * 31 * 127 < 32768 && 2 * 2 * 63 * 127 < 32768);

// Activation rows per tile (a tile is them x 8 weight rows), and chunks of 32 quants per pass over
// the activation rows (16 chunks of a panel, 16-24 KiB, stay in L1 meanwhile).
constexpr int kBlockGemmMR = 4;
constexpr int64_t kBlockGemmChunksPerPass = 16;

// Dword j of each of 8 rows' 32 bytes (z[r]) -> d[j], rows in order: the AVX 8 x 8 float transpose on
// dwords.
inline void transpose_dwords(const __m256i (&z)[8], __m256i (&d)[8]) {
  __m256i t[8], s[8];
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {  // 128-bit lane l: rows 2i, 2i + 1 of dwords 4l, 4l + 1 (lo) or 4l + 2, 4l + 3 (hi)
    t[2 * i] = _mm256_unpacklo_epi32(z[2 * i], z[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_epi32(z[2 * i], z[2 * i + 1]);
  }
#pragma GCC unroll 2
  for (int h = 0; h < 2; ++h) {  // rows 4h .. 4h + 3 of dword j (lane 0) and j + 4 (lane 1) in s[4h + j]
    s[4 * h + 0] = _mm256_unpacklo_epi64(t[4 * h + 0], t[4 * h + 2]);
    s[4 * h + 1] = _mm256_unpackhi_epi64(t[4 * h + 0], t[4 * h + 2]);
    s[4 * h + 2] = _mm256_unpacklo_epi64(t[4 * h + 1], t[4 * h + 3]);
    s[4 * h + 3] = _mm256_unpackhi_epi64(t[4 * h + 1], t[4 * h + 3]);
  }
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j) {
    d[j] = _mm256_permute2x128_si256(s[j], s[j + 4], 0x20);
    d[j + 4] = _mm256_permute2x128_si256(s[j], s[j + 4], 0x31);
  }
}

// 32 quants of each of 8 rows (`stride` bytes apart) -> [8 dwords][8 rows][4], the dwords 64 bytes
// apart (one 256-bit vector of the panel's 16-row layout).
inline void transpose_8_rows(const uint8_t* first_row, int64_t stride, uint8_t* dst) {
  __m256i z[8], d[8];
#pragma GCC unroll 8
  for (int r = 0; r < 8; ++r) z[r] = load256(first_row + r * stride);
  transpose_dwords(z, d);
#pragma GCC unroll 8
  for (int j = 0; j < 8; ++j) _mm256_store_si256(reinterpret_cast<__m256i*>(dst + 64 * j), d[j]);
}

// An empty asm that "changes" v: GCC otherwise reassociates a tile's chains of integer adds into
// trees, computing every product of a block first and spilling most of them (3x slower, Zen 3).
inline void opaque(__m256i& v) { asm("" : "+x"(v)); }

// The mask of a vector's first `cols` lanes (none for cols <= 0, all for cols >= 8): the columns of
// a panel's last, partial column vector.
inline __m256i column_mask(int64_t cols) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(lo(cols < 0 ? 0 : cols, 8))),
                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// y's 8 columns from p, those under `mask` only unless all 8 exist (`full`): vmaskmovps stores are
// microcoded on AMD's cores, and the block GEMM's per-super-block stores of y through them took a
// fifth of its time (Zen 3).
inline __m256 load_columns(const float* p, __m256i mask, bool full) {
  return full ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, mask);
}
inline void store_columns(float* p, __m256i mask, bool full, __m256 v) {
  if (full)
    _mm256_storeu_ps(p, v);
  else
    _mm256_maskstore_ps(p, mask, v);
}
inline bool all_columns(__m256i mask) { return _mm256_movemask_ps(_mm256_castsi256_ps(mask)) == 0xFF; }

// The byte offset of column vector v (weight rows 8v .. 8v + 7) in a chunk's quants.
constexpr int64_t column_vector_at(int64_t v) { return 512 * (v / 2) + 32 * (v % 2); }

// Weight rows [n0, n0 + rows) -> a panel, through `staged` (stage_rows); only the column vectors
// holding rows are transposed (the tiles read no others).
template <QuantizationEncoding E>
void unpack_panel(const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t rows, int64_t K, uint8_t* staged,
                  uint8_t* panel) {
  constexpr int kSub = Unpack<E>::kSub;
  stage_rows<E>(w, row_bytes, n0, rows, K, staged, panel);
  for (int64_t c = 0; c < K / 32; ++c)
    for (int64_t v = 0; v < (rows + 7) / 8; ++v)
      transpose_8_rows(staged + 8 * v * K + 32 * c, K, panel + c * kChunkBytes<kSub> + column_vector_at(v));
}

// Rows [m0, m0 + MR) of y (y: column vector v0's first column; `mask[i]`: which of vector v0 + i's
// 8 columns exist), chunks [c0, c1) of 32 quants (whole super-blocks for the K-quants); `first`: y
// holds nothing yet. block_gemm_tile of quantized_avx512_vnni.cpp on NV x 8 columns: the same
// operations per output. Each broadcast activation dword feeds NV vectors: one a vpmaddubsw bounded
// Zen 3 by its broadcasts (2.2-2.4 G vpmaddubsw/s a core, 4.3-4.8 G with two per broadcast).
template <int MR, int NV, QuantizationEncoding E>
void block_gemm_tile(const Q8Activations& x, const uint8_t* panel, int64_t v0, int64_t m0, int64_t c0, int64_t c1,
                     float* y, int64_t ldy, const __m256i (&mask)[NV], bool first) {
  using Rule = BlockGemmRule<E>;
  constexpr int kSub = Rule::kSub, kGroup = kInt16Dwords<E>;
  constexpr bool kSignedQuants = E == QuantizationEncoding::q8_0;  // |q| times q_x with q's sign
  const int64_t K = x.K, ablocks = K / activation_block(E), blocks = K / 32 * kSub;
  const auto* xq = reinterpret_cast<const uint8_t*>(x.x) + m0 * K;
  bool full[NV];
  for (int n = 0; n < NV; ++n) full[n] = all_columns(mask[n]);
  // Weight block t of chunk c: its int32 dots for the tile's rows, from -offset * sum(q_x).
  const auto block_dots = [&](int64_t c, int t, __m256i (&dot)[MR][NV]) {
    const uint8_t* pc = panel + c * kChunkBytes<kSub>;
    const int64_t block = kSub * c + t;
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      __m256i init = _mm256_setzero_si256();
      if constexpr (Rule::kOffset != 0) {
        const int32_t sum = kSub == 2 ? x.sum16[(m0 + m) * blocks + block] : x.sum[(m0 + m) * blocks + block];
        init = _mm256_set1_epi32(-Rule::kOffset * sum);
      }
#pragma GCC unroll 4
      for (int n = 0; n < NV; ++n) dot[m][n] = init;
    }
#pragma GCC unroll 8
    for (int g = Rule::kDwords * t; g < Rule::kDwords * (t + 1); g += kGroup) {
      __m256i pairs[MR][NV];
#pragma GCC unroll 8
      for (int j = g; j < g + kGroup; ++j) {
        __m256i w[NV], magnitude[NV];
#pragma GCC unroll 4
        for (int n = 0; n < NV; ++n) {
          w[n] = _mm256_load_si256(reinterpret_cast<const __m256i*>(pc + column_vector_at(v0 + n) + 64 * j));
          magnitude[n] = kSignedQuants ? _mm256_abs_epi8(w[n]) : w[n];
        }
#pragma GCC unroll 8
        for (int m = 0; m < MR; ++m) {
          const __m256i xb = _mm256_set1_epi32(static_cast<int>(load_u32(xq + m * K + 32 * c + 4 * j)));
#pragma GCC unroll 4
          for (int n = 0; n < NV; ++n) {
            const __m256i p = _mm256_maddubs_epi16(magnitude[n], kSignedQuants ? _mm256_sign_epi8(xb, w[n]) : xb);
            pairs[m][n] = j == g ? p : _mm256_add_epi16(pairs[m][n], p);
            opaque(pairs[m][n]);
          }
        }
      }
#pragma GCC unroll 8
      for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
        for (int n = 0; n < NV; ++n)
          dot[m][n] = _mm256_add_epi32(dot[m][n], _mm256_madd_epi16(pairs[m][n], _mm256_set1_epi16(1)));
    }
  };
  // Row i of chunk c's (a, b) table (a_t at i = t, b_t at i = kSub + t), vector v0 + n's 8 columns.
  const auto ab_row = [&](int64_t c, int i, int n) {
    return _mm256_load_ps(reinterpret_cast<const float*>(panel + c * kChunkBytes<kSub> + 1024) + i * kGemmRows +
                          8 * (v0 + n));
  };
  if constexpr (!Rule::kSuper) {  // Q4_0, Q8_0: y += (a d_x) dot per chunk
    static_assert(kSub == 1 && (Rule::kOffset != 0 || kSignedQuants));
    __m256 acc[MR][NV];
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
      for (int n = 0; n < NV; ++n)
        acc[m][n] = first ? _mm256_setzero_ps() : load_columns(y + (m0 + m) * ldy + 8 * n, mask[n], full[n]);
    for (int64_t c = c0; c < c1; ++c) {
      __m256i dot[MR][NV];
      block_dots(c, 0, dot);
#pragma GCC unroll 4
      for (int n = 0; n < NV; ++n) {
        const __m256 a = ab_row(c, 0, n);
#pragma GCC unroll 8
        for (int m = 0; m < MR; ++m) {
          const __m256 dx = _mm256_set1_ps(x.d[(m0 + m) * ablocks + c]);
          acc[m][n] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[m][n]), _mm256_mul_ps(a, dx), acc[m][n]);
        }
      }
    }
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
      for (int n = 0; n < NV; ++n) store_columns(y + (m0 + m) * ldy + 8 * n, mask[n], full[n], acc[m][n]);
    return;
  }
  constexpr int kChunks = Rule::kChunksPerSuper;
  for (int64_t s0 = c0; s0 < c1; s0 += kChunks) {
    __m256 part[MR][NV];  // this super-block's sums, unscaled by d_x
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
      for (int n = 0; n < NV; ++n) part[m][n] = _mm256_setzero_ps();
    for (int64_t c = s0; c < s0 + kChunks; ++c) {
#pragma GCC unroll 2
      for (int t = 0; t < kSub; ++t) {
        __m256i dot[MR][NV];
        block_dots(c, t, dot);
#pragma GCC unroll 4
        for (int n = 0; n < NV; ++n) {
          const __m256 a = ab_row(c, t, n);
#pragma GCC unroll 8
          for (int m = 0; m < MR; ++m) part[m][n] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[m][n]), a, part[m][n]);
        }
        if constexpr (Rule::kOffset == 0) {  // each activation row's sum broadcast once for the NV vectors
          __m256 b[NV];
#pragma GCC unroll 4
          for (int n = 0; n < NV; ++n) b[n] = ab_row(c, kSub + t, n);
#pragma GCC unroll 8
          for (int m = 0; m < MR; ++m) {
            const __m256 sum = _mm256_set1_ps(x.sum_f32[(m0 + m) * blocks + kSub * c + t]);
#pragma GCC unroll 4
            for (int n = 0; n < NV; ++n) part[m][n] = _mm256_fnmadd_ps(b[n], sum, part[m][n]);
          }
        }
      }
    }
    const bool fresh = first && s0 == c0;
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      const __m256 dx = _mm256_set1_ps(x.d[(m0 + m) * ablocks + s0 / kChunks]);
#pragma GCC unroll 4
      for (int n = 0; n < NV; ++n) {
        float* row = y + (m0 + m) * ldy + 8 * n;
        const __m256 y0 = fresh ? _mm256_setzero_ps() : load_columns(row, mask[n], full[n]);
        store_columns(row, mask[n], full[n], _mm256_fmadd_ps(part[m][n], dx, y0));
      }
    }
  }
}

// Every activation row of x against one unpacked panel of `rows` weight rows (y: its first column),
// kBlockGemmChunksPerPass chunks at a time; each tile's activations serve the panel's 16-row halves
// one after the other.
template <QuantizationEncoding E>
void block_gemm_panel(const Q8Activations& x, const uint8_t* panel, int64_t rows, float* y, int64_t ldy) {
  static_assert(kBlockGemmChunksPerPass % BlockGemmRule<E>::kChunksPerSuper == 0);
  constexpr int kVectors = 2;
  const int64_t chunks = x.K / 32, tiles = (rows + 8 * kVectors - 1) / (8 * kVectors);
  for (int64_t c0 = 0; c0 < chunks; c0 += kBlockGemmChunksPerPass) {
    const int64_t c1 = lo(chunks, c0 + kBlockGemmChunksPerPass);
    for (int64_t m = 0; m < x.M; m += kBlockGemmMR)
      for (int64_t t = 0; t < tiles; ++t) {
        __m256i mask[kVectors];
        for (int n = 0; n < kVectors; ++n) mask[n] = column_mask(rows - 8 * (kVectors * t + n));
        with_tile_rows<kBlockGemmMR>(lo(x.M - m, kBlockGemmMR), [&]<int R>() {
          block_gemm_tile<R, kVectors, E>(x, panel, kVectors * t, m, c0, c1, y + 8 * kVectors * t, ldy, mask, c0 == 0);
        });
      }
  }
}

template <QuantizationEncoding E>
void block_gemm(const Q8Activations& x, const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1, float* y,
                int64_t ldy, uint8_t* scratch) {
  uint8_t* panel = scratch;
  uint8_t* staged = scratch + x.K / 32 * kChunkBytes<Unpack<E>::kSub>;
  for (int64_t n = n0; n < n1; n += kGemmRows) {
    const int64_t rows = lo(n1 - n, kGemmRows);
    unpack_panel<E>(w, row_bytes, n, rows, x.K, staged, panel);
    block_gemm_panel<E>(x, panel, rows, y + n, ldy);
  }
}

// ---- Q4_K and Q6_K packed at init: panels (quantized.h), on CPUs without AVX512-VNNI -------------

// Weight rows [0, N) -> Q4_K or Q6_K panels, the AVX-512 packer's bytes (one layout, whichever CPU
// packed them): each group of kGemmRows rows unpacked to u8 quants (Unpack), transposed 8 rows at a
// time, each pair of dwords folded into one vector of nibbles (Q4_K), or the fourth of each 4 groups
// of quants spread over the top bits of the other three (Q6_K); the scales copied as stored.
template <QuantizationEncoding E>
void k_pack(const uint8_t* w, int64_t row_bytes, int64_t N, int64_t K, uint8_t* panels) {
  constexpr bool kQ6 = E == QuantizationEncoding::q6_k;
  using U = Unpack<E>;
  const int64_t supers = K / 256, panel_bytes = k_panel_bytes(E, K);
  const int64_t super_bytes = kQ6 ? kQ6KPanelSuperBytes : kQ4KPanelSuperBytes;
  std::vector<uint8_t> staged(static_cast<size_t>(kGemmRows * K));
  alignas(32) uint8_t dwords[8 * 64];  // one chunk of 32 quants of 8 rows: [8 dwords][8 rows][4], 64 apart
  const __m256i nibble = _mm256_set1_epi8(0x0F), two = _mm256_set1_epi8(0x03);
  for (int64_t n0 = 0; n0 < N; n0 += kGemmRows) {
    uint8_t* panel = panels + n0 / kGemmRows * panel_bytes;
    std::memset(panel, 0, static_cast<size_t>(panel_bytes));  // rows past N: scales and d zero
    for (int64_t r = 0; r < kGemmRows; ++r) {
      uint8_t* u = staged.data() + r * K;
      if (r >= N - n0) {
        std::memset(u, 0, static_cast<size_t>(K));
        continue;
      }
      for (int64_t s = 0; s < supers; ++s) {
        const uint8_t* b = w + (n0 + r) * row_bytes + s * U::kBytes;
        U::block(b, u + 256 * s, [](int, float, float) {});
        if constexpr (kQ6)
          put_q6_k_scales(b, r, panel + s * super_bytes);
        else
          put_q4_k_scales(b, r, panel + s * super_bytes);
      }
    }
    const auto group = [&](int g) { return _mm256_load_si256(reinterpret_cast<const __m256i*>(dwords + 64 * g)); };
    for (int64_t c = 0; c < K / 32; ++c)
      for (int64_t v = 0; v < 4; ++v) {
        transpose_8_rows(staged.data() + 8 * v * K + 32 * c, K, dwords);
        uint8_t* ps = panel + c / 8 * super_bytes;
        if constexpr (kQ6) {
          uint8_t* out = ps + q6_k_quants_at(c % 8) + 384 * (v / 2) + 32 * (v % 2);
          for (int q = 0; q < 2; ++q) {
            const __m256i d = group(4 * q + 3);
            for (int t = 0; t < 3; ++t) {  // D's bits 2t, 2t + 1 -> bits 6-7 (masked first: nothing crosses bytes)
              const __m256i bits = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(d, 2 * t), two), 6);
              _mm256_store_si256(reinterpret_cast<__m256i*>(out + 64 * (3 * q + t)), _mm256_or_si256(group(4 * q + t), bits));
            }
          }
        } else {
          uint8_t* out = ps + q4_k_quants_at(c % 8) + 256 * (v / 2) + 32 * (v % 2);
          for (int i = 0; i < 4; ++i)  // the low 4 bits of quants 8i + t and 8i + 4 + t in one byte
            _mm256_store_si256(reinterpret_cast<__m256i*>(out + 64 * i),
                               _mm256_or_si256(_mm256_and_si256(group(2 * i), nibble),
                                               _mm256_slli_epi16(_mm256_and_si256(group(2 * i + 1), nibble), 4)));
        }
      }
  }
}

// 8 bytes at p as the int16 pairs (b, b) of 8 int32 lanes: a row's sub-block scale for vpmaddwd.
inline __m256i scale_pairs(const uint8_t* p) {
  const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return _mm256_or_si256(b, _mm256_slli_epi32(b, 16));
}

// q4_k_panel_super (below) for one activation row m, in another order: each activation dword is
// broadcast once for both vectors of a half (decode's usual case: unpacking one vector at a time,
// as below, read 15.3-15.8 GB/s from DRAM on a Zen 3 core against this order's 19.2-19.8). The same
// integer sums and f32 steps, so the same bits.
[[gnu::always_inline]] inline void q4_k_panel_super_one_row(const Q8Activations& x, const uint8_t* panel, int64_t m,
                                                            int64_t s, __m256 (&acc)[4]) {
  const int64_t K = x.K, supers = K / 256;
  const uint8_t* ps = panel + s * kQ4KPanelSuperBytes;
  const uint8_t* xs = x.x + m * K + s * 256;
  const int32_t* xsums = x.sum + m * (K / 32) + s * 8;
  const __m256i low = _mm256_set1_epi8(0x0F);
  const __m256 dx = _mm256_set1_ps(x.d[m * supers + s]);
  // The super-block's 74 lines half a super-block ahead, 5 at each of its 16 sub-block steps: a Zen 3
  // core's hardware prefetchers alone left these panels at 14.7 GB/s from DRAM (its plain read 23-28),
  // with this 18-20 (bench_quantized BM_q4_k_packed/1/2048/8192/1; two cores 24-26 -> 28-35); a
  // quarter, 1, 2 or 3.5 super-blocks ahead were no better.
  constexpr int kPrefetchLines = 5;
  constexpr int64_t kPrefetchAhead = kQ4KPanelSuperBytes / 2;
  static_assert(16 * kPrefetchLines * 64 >= kQ4KPanelSuperBytes);
  for (int64_t half = 0; half < 2; ++half) {
    __m256i isum[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
    for (int j = 0; j < 8; ++j) {
      for (int l = 0; l < kPrefetchLines; ++l)
        _mm_prefetch(reinterpret_cast<const char*>(ps + kPrefetchAhead + ((half * 8 + j) * kPrefetchLines + l) * 64),
                     _MM_HINT_T1);
      const uint8_t* pj = ps + q4_k_quants_at(j) + 256 * half;
      __m256i pairs[2];
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) {
        const __m256i xa = _mm256_set1_epi32(static_cast<int>(load_u32(xs + 32 * j + 8 * i)));
        const __m256i xb = _mm256_set1_epi32(static_cast<int>(load_u32(xs + 32 * j + 8 * i + 4)));
#pragma GCC unroll 2
        for (int k = 0; k < 2; ++k) {
          const __m256i v = _mm256_load_si256(reinterpret_cast<const __m256i*>(pj + 64 * i + 32 * k));
          const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(_mm256_and_si256(v, low), xa),
                                             _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(v, 4), low), xb));
          pairs[k] = i == 0 ? p : _mm256_add_epi16(pairs[k], p);
          opaque(pairs[k]);
        }
      }
#pragma GCC unroll 2
      for (int k = 0; k < 2; ++k)
        isum[k] = _mm256_add_epi32(isum[k], _mm256_madd_epi16(pairs[k], scale_pairs(ps + q4_k_scales_at(j) + 16 * half + 8 * k)));
    }
    __m256i msum[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
    for (int j = 0; j < 8; ++j) {  // m_j (low int16 of each lane, the high one 0) times sum_j(q_x)
      const __m256i xsum = _mm256_set1_epi32(xsums[j]);
#pragma GCC unroll 2
      for (int k = 0; k < 2; ++k) {
        const __m256i mn =
            _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(ps + q4_k_mins_at(j) + 16 * half + 8 * k)));
        msum[k] = _mm256_add_epi32(msum[k], _mm256_madd_epi16(mn, xsum));
      }
    }
#pragma GCC unroll 2
    for (int k = 0; k < 2; ++k) {
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ps + kQ4KDAt + 32 * half + 16 * k)));
      const __m256 dmin =
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ps + kQ4KDminAt + 32 * half + 16 * k)));
      __m256& a = acc[2 * half + k];
      a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[k]), _mm256_mul_ps(d, dx), a);
      a = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(msum[k]), _mm256_mul_ps(dmin, dx), a);
    }
  }
}

// Super-block s of a Q4_K panel (its 32 rows' 4 vectors of 8) for activation rows [m0, m0 + R),
// added to acc[r]: the AVX-512 q4_k_panel_row's integer sums on 8 rows per vector, each vector's
// nibbles unpacked once for the R rows. Per sub-block j, the 8 vpmaddubsw of a row's 32 quants add
// in int16 (at most 8 * 2 * 15 * 127) and one vpmaddwd applies sc_j, where the row GEMV needs a
// vpmaddwd per vpmaddubsw (the multiplier is what bounds these kernels on Zen 3); then
// sum_j m_j sum_j(q_x) and that kernel's f32 scaling, in its order, so its bits whatever R.
template <int R>
[[gnu::always_inline]] inline void q4_k_panel_super(const Q8Activations& x, const uint8_t* panel, int64_t m0, int64_t s,
                                                    __m256 (&acc)[R][4]) {
  const int64_t K = x.K, supers = K / 256;
  const uint8_t* ps = panel + s * kQ4KPanelSuperBytes;
  const __m256i low = _mm256_set1_epi8(0x0F);
  // As q4_k_panel_super_one_row: half a super-block ahead, here 3 lines at each of 32 steps.
  constexpr int kPrefetchLines = 3;
  constexpr int64_t kPrefetchAhead = kQ4KPanelSuperBytes / 2;
  static_assert(32 * kPrefetchLines * 64 >= kQ4KPanelSuperBytes);
#pragma GCC unroll 1
  for (int v = 0; v < 4; ++v) {
    const int64_t half = v / 2, k = v % 2;
    __m256i isum[R], msum[R];
    for (int r = 0; r < R; ++r) isum[r] = msum[r] = _mm256_setzero_si256();
#pragma GCC unroll 1
    for (int j = 0; j < 8; ++j) {
      for (int l = 0; l < kPrefetchLines; ++l)
        _mm_prefetch(reinterpret_cast<const char*>(ps + kPrefetchAhead + ((v * 8 + j) * kPrefetchLines + l) * 64),
                     _MM_HINT_T1);
      const uint8_t* pj = ps + q4_k_quants_at(j) + 256 * half + 32 * k;
      __m256i lo_q[4], hi_q[4];
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) {
        const __m256i q = _mm256_load_si256(reinterpret_cast<const __m256i*>(pj + 64 * i));
        lo_q[i] = _mm256_and_si256(q, low);
        hi_q[i] = _mm256_and_si256(_mm256_srli_epi16(q, 4), low);
      }
      const __m256i sc = scale_pairs(ps + q4_k_scales_at(j) + 8 * v);
      // m_j (low int16 of each lane, the high one 0), times sum_j(q_x) below
      const __m256i mn = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(ps + q4_k_mins_at(j) + 8 * v)));
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const uint8_t* xs = x.x + (m0 + r) * K + s * 256 + 32 * j;
        __m256i pairs;
#pragma GCC unroll 4
        for (int i = 0; i < 4; ++i) {
          const __m256i xa = _mm256_set1_epi32(static_cast<int>(load_u32(xs + 8 * i)));
          const __m256i xb = _mm256_set1_epi32(static_cast<int>(load_u32(xs + 8 * i + 4)));
          const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo_q[i], xa), _mm256_maddubs_epi16(hi_q[i], xb));
          pairs = i == 0 ? p : _mm256_add_epi16(pairs, p);
          opaque(pairs);
        }
        isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(pairs, sc));
        msum[r] = _mm256_add_epi32(msum[r], _mm256_madd_epi16(mn, _mm256_set1_epi32(x.sum[(m0 + r) * (K / 32) + s * 8 + j])));
      }
    }
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ps + kQ4KDAt + 16 * v)));
    const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ps + kQ4KDminAt + 16 * v)));
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 dx = _mm256_set1_ps(x.d[(m0 + r) * supers + s]);
      __m256& a = acc[r][v];
      a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), _mm256_mul_ps(d, dx), a);
      a = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(msum[r]), _mm256_mul_ps(dmin, dx), a);
    }
  }
}

// Q6_K quants u of 8 rows as 8 groups of 4 per row (group g: quants 4g .. 4g + 3 of 32) from the 6
// vectors at p, 64 bytes apart (the AVX-512 q6_k_groups' bytes, half of each vector): X, Y, Z hold
// groups A, B, C in bits 0-5 and D's bits 0-1, 2-3, 4-5 in their bits 6-7.
[[gnu::always_inline]] inline void q6_k_groups(const uint8_t* p, __m256i (&g)[8]) {
  const __m256i six = _mm256_set1_epi8(0x3F);
#pragma GCC unroll 2
  for (int q = 0; q < 2; ++q) {
    const __m256i x = _mm256_load_si256(reinterpret_cast<const __m256i*>(p + (3 * q) * 64));
    const __m256i y = _mm256_load_si256(reinterpret_cast<const __m256i*>(p + (3 * q + 1) * 64));
    const __m256i z = _mm256_load_si256(reinterpret_cast<const __m256i*>(p + (3 * q + 2) * 64));
    g[4 * q] = _mm256_and_si256(x, six);
    g[4 * q + 1] = _mm256_and_si256(y, six);
    g[4 * q + 2] = _mm256_and_si256(z, six);
    // The 16-bit shifts bring the next byte's bits in beside the two wanted; the masks drop them.
    g[4 * q + 3] = _mm256_or_si256(
        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(x, 6), _mm256_set1_epi8(0x03)),
                        _mm256_and_si256(_mm256_srli_epi16(y, 4), _mm256_set1_epi8(0x0C))),
        _mm256_and_si256(_mm256_srli_epi16(z, 2), _mm256_set1_epi8(0x30)));
  }
}

// 8 rows' int8 scales at p -> int32 lanes (the int16 value in the low half, sign-extended).
inline __m256i scales_i32(const uint8_t* p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
// The int32 lanes of scales_i32 as the int16 pairs (sc, sc), for vpmaddwd (scale_pairs for int8).
inline __m256i signed_scale_pairs(__m256i sc) {
  return _mm256_or_si256(_mm256_and_si256(sc, _mm256_set1_epi32(0xFFFF)), _mm256_slli_epi32(sc, 16));
}

// q4_k_panel_super for a Q6_K panel and R activation rows from m0: the AVX-512 q6_k_panel_row's
// integer sums, sum over the sub-blocks i of 16 of sc_i (dot_i - 32 sum_i(q_x)), on 8 weight rows
// per vector, each vector's 6-bit quants unpacked once for the R rows (the unpacking costs as much
// as the products). Two vpmaddubsw of u < 64 add in int16 (at most 2 * 2 * 63 * 128) and a vpmaddwd
// applies sc_i to each such pair; the -32 sum_i(q_x) of both sub-blocks is one vpmaddwd of
// (sc_2j, sc_2j+1) with the two sums. Integers exact in int32, then that kernel's f32 step, so its
// bits, whatever R.
template <int R>
[[gnu::always_inline]] inline void q6_k_panel_super(const Q8Activations& x, const uint8_t* panel, int64_t m0, int64_t s,
                                                    __m256 (&acc)[R][4]) {
  const int64_t K = x.K, supers = K / 256;
  const uint8_t* ps = panel + s * kQ6KPanelSuperBytes;
  // The next super-block's 105 lines, 4 at each of 32 steps (half a super-block ahead left one Zen 3
  // core at 14.6-14.9 GB/s from DRAM, this 17.1-17.6; bench_quantized BM_q6_k_packed/1/2048/8192/1).
  constexpr int kPrefetchLines = 4;
  constexpr int64_t kPrefetchAhead = kQ6KPanelSuperBytes;
  static_assert(32 * kPrefetchLines * 64 >= kQ6KPanelSuperBytes);
#pragma GCC unroll 1
  for (int v = 0; v < 4; ++v) {
    __m256i isum[R];
    for (__m256i& i : isum) i = _mm256_setzero_si256();
#pragma GCC unroll 1
    for (int j = 0; j < 8; ++j) {
      for (int l = 0; l < kPrefetchLines; ++l)
        _mm_prefetch(reinterpret_cast<const char*>(ps + kPrefetchAhead + ((v * 8 + j) * kPrefetchLines + l) * 64),
                     _MM_HINT_T1);
      __m256i u[8];
      q6_k_groups(ps + q6_k_quants_at(j) + 384 * (v / 2) + 32 * (v % 2), u);
      const __m256i sc_a = scales_i32(ps + q6_k_scales_at(j) + 8 * v);
      const __m256i sc_b = scales_i32(ps + q6_k_scales_at(j) + kGemmRows + 8 * v);
      const __m256i a2 = signed_scale_pairs(sc_a), b2 = signed_scale_pairs(sc_b);
      const __m256i ab = _mm256_blend_epi16(sc_a, _mm256_slli_epi32(sc_b, 16), 0xAA);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const uint8_t* xs = x.x + (m0 + r) * K + s * 256 + 32 * j;
        const int16_t* xs16 = x.sum16 + (m0 + r) * (K / 16) + s * 16 + 2 * j;
        __m256i pairs[4];
#pragma GCC unroll 4
        for (int i = 0; i < 4; ++i) {
          const __m256i xa = _mm256_set1_epi32(static_cast<int>(load_u32(xs + 8 * i)));
          const __m256i xb = _mm256_set1_epi32(static_cast<int>(load_u32(xs + 8 * i + 4)));
          pairs[i] = _mm256_add_epi16(_mm256_maddubs_epi16(u[2 * i], xa), _mm256_maddubs_epi16(u[2 * i + 1], xb));
        }
        const __m256i sums = _mm256_set1_epi32(static_cast<int>(load_u32(reinterpret_cast<const uint8_t*>(xs16))));
        const __m256i dots = _mm256_add_epi32(_mm256_add_epi32(_mm256_madd_epi16(pairs[0], a2), _mm256_madd_epi16(pairs[1], a2)),
                                              _mm256_add_epi32(_mm256_madd_epi16(pairs[2], b2), _mm256_madd_epi16(pairs[3], b2)));
        isum[r] = _mm256_add_epi32(isum[r], _mm256_sub_epi32(dots, _mm256_slli_epi32(_mm256_madd_epi16(ab, sums), 5)));
      }
    }
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ps + kQ6KDAt + 16 * v)));
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
      acc[r][v] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), _mm256_mul_ps(d, _mm256_set1_ps(x.d[(m0 + r) * supers + s])),
                                  acc[r][v]);
  }
}

// Activation rows [m0, m0 + R) of x against `count` (at most kPanelStreams) consecutive panels, their
// super-blocks interleaved: y[m][0, rows), `rows` of the panels' weight rows existing, row m at
// y + m * ldy. Each panel is a forward stream; several at once keep the DRAM busy as the row GEMV's
// 4 row streams do (one panel at a time, a Zen 3 core read them slower than the row GEMV reads its
// rows). Q4_K's panels read faster two at a time than four (BM_q4_k_packed/1/2048/8192, Zen 3: one
// core 19.1-20.1 -> 21.8-22.1 GB/s, two 32.4-32.9 -> 34.6-36.0), Q6_K's slower (18.3 -> 14.7, 30.4 -> 27.2).
template <QuantizationEncoding E>
constexpr int64_t kPanelStreams = E == QuantizationEncoding::q4_k ? 2 : 4;
template <QuantizationEncoding E, int R>
void k_panel_rows(const Q8Activations& x, const uint8_t* panels, int64_t count, int64_t m0, float* y, int64_t ldy,
                  int64_t rows) {
  const int64_t supers = x.K / 256, panel_bytes = k_panel_bytes(E, x.K);
  __m256 acc[kPanelStreams<E>][R][4];
  for (auto& a : acc)
    for (auto& r : a)
      for (__m256& v : r) v = _mm256_setzero_ps();
  for (int64_t s = 0; s < supers; ++s)
    for (int64_t p = 0; p < count; ++p)
      if constexpr (E == QuantizationEncoding::q6_k)
        q6_k_panel_super<R>(x, panels + p * panel_bytes, m0, s, acc[p]);
      else if constexpr (R == 1)
        q4_k_panel_super_one_row(x, panels + p * panel_bytes, m0, s, acc[p][0]);
      else
        q4_k_panel_super<R>(x, panels + p * panel_bytes, m0, s, acc[p]);
  for (int r = 0; r < R; ++r)
    for (int64_t v = 0; v < (rows + 7) / 8; ++v)
      store_columns(y + (m0 + r) * ldy + 8 * v, column_mask(rows - 8 * v), rows - 8 * v >= 8, acc[v / 4][r][v % 4]);
}

// A Q4_K panel -> the block GEMM's panel: its quants and (a, b) = (d sc_j, dmin m_j) as unpack_panel
// makes them from the rows (the same f32 products), so the GEMM gives the same bits from either.
void q4_k_panel_to_gemm_panel(const uint8_t* panel, int64_t K, uint8_t* gemm_panel) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  for (int64_t s = 0; s < K / 256; ++s) {
    const uint8_t* ps = panel + s * kQ4KPanelSuperBytes;
    for (int j = 0; j < 8; ++j) {
      uint8_t* chunk = gemm_panel + (s * 8 + j) * kChunkBytes<1>;
      for (int h = 0; h < 2; ++h)
        for (int i = 0; i < 4; ++i)
          for (int k = 0; k < 2; ++k) {
            const __m256i v = _mm256_load_si256(reinterpret_cast<const __m256i*>(ps + q4_k_quants_at(j) + 256 * h + 64 * i + 32 * k));
            _mm256_store_si256(reinterpret_cast<__m256i*>(chunk + 512 * h + 64 * (2 * i) + 32 * k), _mm256_and_si256(v, low));
            _mm256_store_si256(reinterpret_cast<__m256i*>(chunk + 512 * h + 64 * (2 * i + 1) + 32 * k),
                               _mm256_and_si256(_mm256_srli_epi16(v, 4), low));
          }
      auto* ab = reinterpret_cast<float*>(chunk + 1024);
      for (int v = 0; v < 4; ++v) {
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ps + kQ4KDAt + 16 * v)));
        const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ps + kQ4KDminAt + 16 * v)));
        const __m256 sc = _mm256_cvtepi32_ps(
            _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(ps + q4_k_scales_at(j) + 8 * v))));
        const __m256 mn = _mm256_cvtepi32_ps(
            _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(ps + q4_k_mins_at(j) + 8 * v))));
        _mm256_store_ps(ab + 8 * v, _mm256_mul_ps(d, sc));
        _mm256_store_ps(ab + kGemmRows + 8 * v, _mm256_mul_ps(dmin, mn));
      }
    }
  }
}

// A Q6_K panel -> the block GEMM's panel: the quants u and a = d sc_i as Unpack<q6_k> makes them
// from the rows, so the GEMM gives the same bits from either (b = 32 a is not written: the GEMM
// subtracts it in the integer dot).
void q6_k_panel_to_gemm_panel(const uint8_t* panel, int64_t K, uint8_t* gemm_panel) {
  for (int64_t s = 0; s < K / 256; ++s) {
    const uint8_t* ps = panel + s * kQ6KPanelSuperBytes;
    for (int j = 0; j < 8; ++j) {
      uint8_t* chunk = gemm_panel + (s * 8 + j) * kChunkBytes<2>;
      for (int v = 0; v < 4; ++v) {
        __m256i u[8];
        q6_k_groups(ps + q6_k_quants_at(j) + 384 * (v / 2) + 32 * (v % 2), u);
        for (int g = 0; g < 8; ++g)
          _mm256_store_si256(reinterpret_cast<__m256i*>(chunk + 512 * (v / 2) + 64 * g + 32 * (v % 2)), u[g]);
      }
      auto* ab = reinterpret_cast<float*>(chunk + 1024);
      for (int t = 0; t < 2; ++t)
        for (int v = 0; v < 4; ++v) {
          const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ps + kQ6KDAt + 16 * v)));
          const __m256 sc = _mm256_cvtepi32_ps(scales_i32(ps + q6_k_scales_at(j) + t * kGemmRows + 8 * v));
          _mm256_store_ps(ab + t * kGemmRows + 8 * v, _mm256_mul_ps(d, sc));
        }
    }
  }
}

// Any M on Q4_K or Q6_K panels: up to kKPanelGemvRows rows the panels' GEMV, all the rows together,
// kPanelStreams panels at a time; more rows unpack each panel into the block GEMM's in `scratch`
// and run its tiles, as block_gemm does from the rows.
template <QuantizationEncoding E>
void k_panels(const Q8Activations& x, const uint8_t* panels, int64_t n0, int64_t n1, float* y, int64_t ldy,
              uint8_t* scratch) {
  const int64_t panel_bytes = k_panel_bytes(E, x.K);
  if (x.M <= kKPanelGemvRows) {
    for (int64_t n = n0; n < n1; n += kPanelStreams<E> * kGemmRows) {
      const int64_t rows = lo(n1 - n, kPanelStreams<E> * kGemmRows), count = (rows + kGemmRows - 1) / kGemmRows;
      const uint8_t* first = panels + n / kGemmRows * panel_bytes;
      with_tile_rows<kKPanelGemvRows>(x.M, [&]<int R>() { k_panel_rows<E, R>(x, first, count, 0, y + n, ldy, rows); });
    }
    return;
  }
  for (int64_t n = n0; n < n1; n += kGemmRows) {
    if constexpr (E == QuantizationEncoding::q6_k)
      q6_k_panel_to_gemm_panel(panels + n / kGemmRows * panel_bytes, x.K, scratch);
    else
      q4_k_panel_to_gemm_panel(panels + n / kGemmRows * panel_bytes, x.K, scratch);
    block_gemm_panel<E>(x, scratch, lo(n1 - n, kGemmRows), y + n, ldy);
  }
}

// ---- Q8_0 packed at init: the VNNI GEMM's panels (quantized.h), on CPUs without AVX512-VNNI ----------

// Weight rows [0, N) -> Q8_0 panels, avx512_vnni_q8_0_pack's bytes: per block, each 8 rows' quants
// transposed to dwords and stored + 128 (xor 0x80) at byte 32 v of each dword's 128; rows past N
// zero (quants 128, scale 0).
void q8_0_pack(const uint8_t* w, int64_t row_bytes, int64_t N, int64_t K, uint8_t* panels) {
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
  for (int64_t n = 0; n < N; n += kGemmRows) {
    const int64_t rows = lo(kGemmRows, N - n);
    for (int64_t b = 0; b < K / 32; ++b) {
      uint8_t* dst = panels + n / kGemmRows * gemm_panel_bytes(K) + b * kQ8_0PanelBlockBytes;
      auto* scales = reinterpret_cast<uint16_t*>(dst + 1024);
      for (int64_t v = 0; v < 4; ++v) {
        __m256i z[8], d[8];
        for (int64_t r = 0; r < 8; ++r) {
          const int64_t row = 8 * v + r;
          z[r] = _mm256_setzero_si256();
          scales[row] = 0;
          if (row >= rows) continue;
          const uint8_t* block = w + (n + row) * row_bytes + b * graph::kQ8_0BlockBytes;
          z[r] = load256(block + 2);
          std::memcpy(&scales[row], block, 2);
        }
        transpose_dwords(z, d);
#pragma GCC unroll 8
        for (int j = 0; j < 8; ++j)
          _mm256_store_si256(reinterpret_cast<__m256i*>(dst + 128 * j + 32 * v), _mm256_xor_si256(d[j], flip));
      }
    }
  }
}

// Panels read side by side by one activation row. In bench_quantized (BM_q8_0_packed/1/2048/8192,
// from DRAM) 1, 2 and 4 streams, with or without a software prefetch 2-8 blocks ahead, all read
// 20.5-21.5 GB/s on one Zen 3 core (84% of its plain read) and 29-36 on two; in llama-1B Q8_0's
// decode (2 threads, alternated 3 times) 4 ran 24.4-28.3 tok/s, 2 23.8-27.8, 1 21.5-24.1, 8 23.5-24.4.
constexpr int64_t kQ8_0PanelStreams = 4;

// Rows 8v .. 8v + 7's dword j of a Q8_0 panel block as signed bytes (the stored + 128 undone).
inline __m256i q8_0_panel_quants(const uint8_t* block, int j, int v) {
  return _mm256_xor_si256(_mm256_load_si256(reinterpret_cast<const __m256i*>(block + 128 * j + 32 * v)),
                          _mm256_set1_epi8(static_cast<char>(0x80)));
}

// Activation rows [0, R) on `count` (at most S) consecutive Q8_0 panels, their blocks interleaved:
// y[m * ldy + n], n in [0, rows). Per block and 8 weight rows, the 8 dwords' |q| (once for the R
// rows) times q_x with q's sign (vpmaddubsw pairs at most 2 * 128 * 127), widened and added in int32:
// the exact dot VNNI's kernels get, then their f32 step, y += (d_w d_x) dot, in block order: their
// bits, and the block GEMM's (BlockGemmRule for Q8_0: a = d_w). No horizontal sums (the row GEMV's
// 8 blocks at once).
template <int R, int S>
void q8_0_panel_rows(const Q8Activations& x, const uint8_t* panels, int64_t count, float* y, int64_t ldy,
                     int64_t rows) {
  const int64_t K = x.K, blocks = K / 32, panel_bytes = gemm_panel_bytes(K);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[S][R][4];
  for (auto& a : acc)
    for (auto& r : a)
      for (__m256& v : r) v = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* xb = x.x + 32 * b;
    __m256 dx[R];
    for (int m = 0; m < R; ++m) dx[m] = _mm256_set1_ps(x.d[m * blocks + b]);
#pragma GCC unroll 4
    for (int p = 0; p < S; ++p) {
      if (p >= count) break;
      const uint8_t* pb = panels + p * panel_bytes + b * kQ8_0PanelBlockBytes;
      __m256i dot[R][4];
      for (auto& d : dot)
        for (__m256i& v : d) v = _mm256_setzero_si256();
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) {
        __m256i xq[R];
#pragma GCC unroll 4
        for (int m = 0; m < R; ++m) xq[m] = _mm256_set1_epi32(static_cast<int>(load_u32(xb + m * K + 4 * j)));
#pragma GCC unroll 4
        for (int v = 0; v < 4; ++v) {
          const __m256i q = q8_0_panel_quants(pb, j, v);
          const __m256i magnitude = _mm256_abs_epi8(q);
#pragma GCC unroll 4
          for (int m = 0; m < R; ++m) {
            dot[m][v] = _mm256_add_epi32(
                dot[m][v], _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(xq[m], q)), ones));
            opaque(dot[m][v]);  // else GCC computes a block's 32 products first and spills them
          }
        }
      }
#pragma GCC unroll 4
      for (int v = 0; v < 4; ++v) {
        const __m256 dw = _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(pb + 1024 + 16 * v)));
#pragma GCC unroll 4
        for (int m = 0; m < R; ++m)
          acc[p][m][v] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[m][v]), _mm256_mul_ps(dw, dx[m]), acc[p][m][v]);
      }
    }
  }
  for (int m = 0; m < R; ++m)
    for (int64_t v = 0; v < (rows + 7) / 8; ++v)
      store_columns(y + m * ldy + 8 * v, column_mask(rows - 8 * v), rows - 8 * v >= 8, acc[v / 4][m][v % 4]);
}

// A Q8_0 panel -> the AVX2 block GEMM's panel: the quants back to signed bytes (xor 0x80) in its
// column vectors, a = d_w as f32 (Unpack<q8_0>'s), b = 0.
void q8_0_panel_to_gemm_panel(const uint8_t* panel, int64_t K, uint8_t* gemm_panel) {
  for (int64_t c = 0; c < K / 32; ++c) {
    const uint8_t* pb = panel + c * kQ8_0PanelBlockBytes;
    uint8_t* chunk = gemm_panel + c * kChunkBytes<1>;
    for (int j = 0; j < 8; ++j)
      for (int v = 0; v < 4; ++v)
        _mm256_store_si256(reinterpret_cast<__m256i*>(chunk + column_vector_at(v) + 64 * j), q8_0_panel_quants(pb, j, v));
    auto* ab = reinterpret_cast<float*>(chunk + 1024);
    for (int v = 0; v < 4; ++v) {
      _mm256_store_ps(ab + 8 * v, _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(pb + 1024 + 16 * v))));
      _mm256_store_ps(ab + kGemmRows + 8 * v, _mm256_setzero_ps());
    }
  }
}

// Any M on Q8_0 panels (KPanelsFn): one row kQ8_0PanelStreams panels at a time, two rows 2 (from DRAM,
// two Zen 3 cores, BM_q8_0_packed/2/2048/8192: 0.69 ms against the row GEMV's 1.23 and 1.27 through
// the block GEMM); more rows unpack each panel into the block GEMM's in `scratch` and run its tiles
// (8 rows: 2.63 ms against the row GEMV's 3.70).
void q8_0_panels(const Q8Activations& x, const uint8_t* panels, int64_t n0, int64_t n1, float* y, int64_t ldy,
                 uint8_t* scratch) {
  const int64_t panel_bytes = gemm_panel_bytes(x.K);
  const auto on_panels = [&]<int R, int S>() {
    for (int64_t n = n0; n < n1; n += S * kGemmRows) {
      const int64_t rows = lo(n1 - n, S * kGemmRows);
      q8_0_panel_rows<R, S>(x, panels + n / kGemmRows * panel_bytes, (rows + kGemmRows - 1) / kGemmRows, y + n, ldy, rows);
    }
  };
  if (x.M == 1) return on_panels.template operator()<1, kQ8_0PanelStreams>();
  if (x.M == 2) return on_panels.template operator()<2, 2>();
  for (int64_t n = n0; n < n1; n += kGemmRows) {
    q8_0_panel_to_gemm_panel(panels + n / kGemmRows * panel_bytes, x.K, scratch);
    block_gemm_panel<QuantizationEncoding::q8_0>(x, scratch, lo(n1 - n, kGemmRows), y + n, ldy);
  }
}

// Instantiated here, under the target pragma.
QGemvFn pick(QuantizationEncoding e) {
  switch (e) {
    case QuantizationEncoding::q4_0: return gemv<Q40>;
    case QuantizationEncoding::q4_k: return gemv<Q4KQ5K<false>>;
    case QuantizationEncoding::q5_k: return gemv<Q4KQ5K<true>>;
    case QuantizationEncoding::q6_k: return gemv<Q6K>;
    case QuantizationEncoding::q8_0: return gemv<Q80>;
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
QuantizeRowsFn avx2_quantize_rows() { return quantize_rows; }
QuantizeRows256Fn avx2_quantize_rows_256() { return quantize_rows_256; }
Q8_0PackFn avx2_k_pack(graph::QuantizationEncoding e) {
  return e == QuantizationEncoding::q4_k   ? k_pack<QuantizationEncoding::q4_k>
         : e == QuantizationEncoding::q6_k ? k_pack<QuantizationEncoding::q6_k>
                                           : nullptr;
}
KPanelsFn avx2_k_panels(graph::QuantizationEncoding e) {
  return e == QuantizationEncoding::q4_k   ? k_panels<QuantizationEncoding::q4_k>
         : e == QuantizationEncoding::q6_k ? k_panels<QuantizationEncoding::q6_k>
                                           : nullptr;
}
Q8_0PackFn avx2_q8_0_pack() { return q8_0_pack; }
KPanelsFn avx2_q8_0_panels() { return q8_0_panels; }
QBlockGemmFn avx2_block_gemm(graph::QuantizationEncoding e) {
  switch (e) {
    case QuantizationEncoding::q4_0: return block_gemm<QuantizationEncoding::q4_0>;
    case QuantizationEncoding::q4_k: return block_gemm<QuantizationEncoding::q4_k>;
    case QuantizationEncoding::q5_k: return block_gemm<QuantizationEncoding::q5_k>;
    case QuantizationEncoding::q6_k: return block_gemm<QuantizationEncoding::q6_k>;
    case QuantizationEncoding::q8_0: return block_gemm<QuantizationEncoding::q8_0>;
  }
  return nullptr;
}
}  // namespace kiln::kernels::quantized
#else
namespace kiln::kernels::quantized {
QGemvFn avx2_block_gemv(graph::QuantizationEncoding) { return nullptr; }
QuantizeRowsFn avx2_quantize_rows() { return nullptr; }
QuantizeRows256Fn avx2_quantize_rows_256() { return nullptr; }
QBlockGemmFn avx2_block_gemm(graph::QuantizationEncoding) { return nullptr; }
Q8_0PackFn avx2_k_pack(graph::QuantizationEncoding) { return nullptr; }
KPanelsFn avx2_k_panels(graph::QuantizationEncoding) { return nullptr; }
Q8_0PackFn avx2_q8_0_pack() { return nullptr; }
KPanelsFn avx2_q8_0_panels() { return nullptr; }
}  // namespace kiln::kernels::quantized
#endif
