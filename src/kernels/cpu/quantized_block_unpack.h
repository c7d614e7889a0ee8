// The block GEMM's panels (quantized.h: Q4_0, Q4_K, Q5_K, Q6_K above gemm::kSmallM rows), shared by
// its AVX-512 VNNI kernel (quantized_avx512_vnni.cpp) and its AVX2 one (quantized_avx2.cpp): how each
// encoding's blocks unpack to u8 quants and (a, b), and how the GEMM applies them. Include it after
// the file's target pragma, after quantized_x86_helpers.h: internal linkage, so each file compiles
// its own copy for its own ISA (quantized_x86_helpers.h says why).
#pragma once

#include <cstdint>
#include <cstring>
#include <immintrin.h>

#include "kernels/cpu/quantized.h"
#include "kiln/graph/quantization.h"

namespace kiln::kernels::quantized {
namespace {  // NOLINT(google-build-namespaces): internal linkage per including file, on purpose

using graph::QuantizationEncoding;

// A panel of kGemmRows weight rows per chunk of 32 quants: [2 halves][8 dwords][16 rows][4 u8] as
// the Q8_0 panel's quants (no +128: u is unsigned already), then a [kSub][32 rows] and b [kSub][32
// rows] in f32, kSub = 32 / B weight blocks per chunk (b read only for Q4_K and Q5_K: BlockGemmRule).
template <int kSub> constexpr int64_t kChunkBytes = block_gemm_chunk_bytes(kSub);

// One encoding's blocks -> u8 quants and each weight block's (a, b) (quantized.h's table).
template <QuantizationEncoding E> struct Unpack;

template <> struct Unpack<QuantizationEncoding::q4_0> {
  static constexpr int kSub = 1, kBlockElems = 32;
  static constexpr int64_t kBytes = graph::kQ4_0BlockBytes;
  template <class Put> static void block(const uint8_t* b, uint8_t* u, Put&& put) {
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2)), low = _mm_set1_epi8(0x0F);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(u), _mm_and_si128(q, low));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(u + 16), _mm_and_si128(_mm_srli_epi16(q, 4), low));
    const float d = load_f16(b);
    put(0, d, 8.0f * d);
  }
};

// Q8_0 (the AVX2 block GEMM only: VNNI has its own Q8_0 GEMM): the quants stay signed (u is q as a
// byte, -127..127), a = d, b = 0; the AVX2 kernel multiplies |q| by the activations with q's sign.
template <> struct Unpack<QuantizationEncoding::q8_0> {
  static constexpr int kSub = 1, kBlockElems = 32;
  static constexpr int64_t kBytes = graph::kQ8_0BlockBytes;
  template <class Put> static void block(const uint8_t* b, uint8_t* u, Put&& put) {
    std::memcpy(u, b + 2, 32);
    put(0, load_f16(b), 0.0f);
  }
};

template <bool kFive> struct UnpackQ4KQ5K {
  static constexpr int kSub = 1, kBlockElems = 256;
  static constexpr int64_t kBytes = kFive ? graph::kQ5_KBlockBytes : graph::kQ4_KBlockBytes;
  template <class Put> static void block(const uint8_t* b, uint8_t* u, Put&& put) {
    const float d = load_f16(b), dmin = load_f16(b + 2);
    uint8_t sc[8], mn[8];
    graph::unpack_k_scales(b + 4, sc, mn);
    for (int j = 0; j < 8; ++j) put(j, d * static_cast<float>(sc[j]), dmin * static_cast<float>(mn[j]));
    const uint8_t* q = b + (kFive ? 48 : 16);
    const __m256i low = _mm256_set1_epi8(0x0F);
    [[maybe_unused]] const __m256i qh = kFive ? load256(b + 16) : _mm256_setzero_si256();
    [[maybe_unused]] const __m256i one = _mm256_set1_epi8(1);
    for (int p = 0; p < 4; ++p) {  // the low nibbles of 32 bytes are sub-block 2p, the high ones 2p + 1
      const __m256i raw = load256(q + 32 * p);
      __m256i lo = _mm256_and_si256(raw, low), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
      if constexpr (kFive) {  // qh bit 2p (2p + 1) of byte l is bit 4 of weight l of sub-block 2p (2p + 1)
        lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * p), one), 4));
        hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * p + 1), one), 4));
      }
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(u + 64 * p), lo);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(u + 64 * p + 32), hi);
    }
  }
};
template <> struct Unpack<QuantizationEncoding::q4_k> : UnpackQ4KQ5K<false> {};
template <> struct Unpack<QuantizationEncoding::q5_k> : UnpackQ4KQ5K<true> {};

template <> struct Unpack<QuantizationEncoding::q6_k> {
  static constexpr int kSub = 2, kBlockElems = 256;
  static constexpr int64_t kBytes = graph::kQ6_KBlockBytes;
  template <class Put> static void block(const uint8_t* b, uint8_t* u, Put&& put) {
    const float d = load_f16(b + 208);
    const auto* sc = reinterpret_cast<const int8_t*>(b + 192);
    for (int i = 0; i < 16; ++i) {
      const float a = d * static_cast<float>(sc[i]);
      put(i, a, 32.0f * a);
    }
    const __m256i low = _mm256_set1_epi8(0x0F), two = _mm256_set1_epi8(0x30);
    for (int half = 0; half < 2; ++half) {  // weight 128 half + l (+ 32, 64, 96): dequantize_q6_k's order
      const __m256i ql0 = load256(b + 64 * half), ql1 = load256(b + 64 * half + 32);
      const __m256i qh = load256(b + 128 + 32 * half);
      uint8_t* out = u + 128 * half;
      const __m256i u0 = _mm256_or_si256(_mm256_and_si256(ql0, low), _mm256_and_si256(_mm256_slli_epi16(qh, 4), two));
      const __m256i u1 = _mm256_or_si256(_mm256_and_si256(ql1, low), _mm256_and_si256(_mm256_slli_epi16(qh, 2), two));
      const __m256i u2 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), low), _mm256_and_si256(qh, two));
      const __m256i u3 =
          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), low), _mm256_and_si256(_mm256_srli_epi16(qh, 2), two));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), u0);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 32), u1);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 64), u2);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 96), u3);
    }
  }
};

// Weight rows [n0, n0 + rows) -> `staged` ([kGemmRows][K] u8: the rows' quants unpacked in order)
// and the panel's (a, b) tables (rows past them: u = 0, a = b = 0); the caller then transposes the
// staged quants into the panel's dword layout (its ISA's transpose).
template <QuantizationEncoding E>
void stage_rows(const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t rows, int64_t K, uint8_t* staged,
                uint8_t* panel) {
  using U = Unpack<E>;
  constexpr int kSub = U::kSub;
  constexpr int64_t kBlock = 32 / kSub;  // weight elements per (a, b)
  for (int64_t r = 0; r < kGemmRows; ++r) {
    uint8_t* u = staged + r * K;
    const auto put_row = [&](int64_t first, int j, float a, float b) {  // weight block `first + j` of row r
      const int64_t block = first + j;
      float* ab = reinterpret_cast<float*>(panel + block / kSub * kChunkBytes<kSub> + 1024);
      ab[block % kSub * kGemmRows + r] = a;
      ab[(kSub + block % kSub) * kGemmRows + r] = b;
    };
    if (r >= rows) {
      std::memset(u, 0, static_cast<size_t>(K));
      for (int64_t block = 0; block < K / kBlock; ++block) put_row(block, 0, 0.0f, 0.0f);
      continue;
    }
    const uint8_t* src = w + (n0 + r) * row_bytes;
    for (int64_t e = 0; e < K; e += U::kBlockElems)
      U::block(src + e / U::kBlockElems * U::kBytes, u + e,
               [&](int j, float a, float b) { put_row(e / kBlock, j, a, b); });
  }
}

// How the block GEMM applies an encoding's (a, b) (quantized.h's table). Where b is a fixed multiple
// of a (Q4_0: 8, Q6_K: 32) each weight block's integer dot starts from -offset * sum(q_x), exact, and b
// costs nothing; Q4_K and Q5_K (b = dmin m_j) subtract b sum(q_x) in f32. Where the activations' scale
// covers a super-block of 256 (the K-quants), its weight blocks' sums a_j dot_j - b_j sum_j gather in
// f32 unscaled and d_x multiplies them once per super-block, not once per weight block: vpdpbusd
// shares its two ports with every f32 multiply (Zen 4: each fma or mul beside 16 vpdpbusd costs a
// cycle), so Q6_K's blocks of 16 went from 4 vpdpbusd + 3 f32 operations to 4 + 1. Both ISAs' kernels
// do these f32 operations in this order on exact int32 dots, so they give the same bits.
template <QuantizationEncoding E> struct BlockGemmRule {
  static constexpr int kSub = Unpack<E>::kSub;           // weight blocks per chunk of 32 quants
  static constexpr int kDwords = 8 / kSub;               // vpdpbusd per weight block and 16 rows
  static constexpr bool kSuper = activation_block(E) == 256;
  static constexpr int32_t kOffset = E == QuantizationEncoding::q4_0 ? 8 : E == QuantizationEncoding::q6_k ? 32 : 0;
  static constexpr int kChunksPerSuper = kSuper ? 8 : 1;  // chunks per activation scale
  static_assert(!kSuper || activation_block(E) == 8 * 32);
};

// Offsets within one super-block of a Q4_K panel (kGemmRows rows x 256 weights), in the order decode
// reads them (quantized.h): d and dmin, then per sub-block j its scales and mins, then its quants.
// A row's pass over the panels is then one forward stream, which the hardware prefetcher follows
// with nothing else: with the scales after the quants (a second stream, 4 KiB ahead) and a software
// prefetch, a Zen 4 core read 17-19 GB/s from DRAM; in this order, without prefetch, 25-28. The
// AVX-512 kernels read 16 rows of a vector, the AVX2 ones 8 (rows 8v .. 8v + 7: the 32 bytes at
// 32 * (v % 2) of half v / 2's 64).
constexpr int64_t kQ4KDAt = 0, kQ4KDminAt = 64, kQ4KSubBytes = 64 + 512;
constexpr int64_t q4_k_scales_at(int64_t j) { return 128 + j * kQ4KSubBytes; }
constexpr int64_t q4_k_mins_at(int64_t j) { return 128 + j * kQ4KSubBytes + 32; }
constexpr int64_t q4_k_quants_at(int64_t j) { return 128 + j * kQ4KSubBytes + 64; }
static_assert(q4_k_quants_at(7) + 512 == kQ4KPanelSuperBytes);

// A Q4_K block's d, dmin, scales and mins into row r of its super-block in a panel (`ps`): the parts
// of a panel that both ISAs' packers copy as stored.
inline void put_q4_k_scales(const uint8_t* block, int64_t r, uint8_t* ps) {
  uint8_t sc[8], mn[8];
  graph::unpack_k_scales(block + 4, sc, mn);
  for (int j = 0; j < 8; ++j) {
    ps[q4_k_scales_at(j) + r] = sc[j];
    ps[q4_k_mins_at(j) + r] = mn[j];
  }
  std::memcpy(ps + kQ4KDAt + 2 * r, block, 2);
  std::memcpy(ps + kQ4KDminAt + 2 * r, block + 2, 2);
}

// Offsets within one super-block of a Q6_K panel (kGemmRows rows x 256 weights), in the order decode
// reads them: d, then per pair j of sub-blocks (32 quants) the scales of both and the quants of two
// halves of 16 rows (6 vectors of 64 bytes each: quantized_avx512_vnni.cpp's q6_k_groups; the AVX2
// kernels read rows 8v .. 8v + 7 as the 32 bytes at 32 * (v % 2) of half v / 2's vectors).
constexpr int64_t kQ6KDAt = 0, kQ6KSubBytes = 64 + 2 * 6 * 64;
constexpr int64_t q6_k_scales_at(int64_t j) { return 64 + j * kQ6KSubBytes; }  // sub-block 2j; 2j + 1 32 on
constexpr int64_t q6_k_quants_at(int64_t j) { return 64 + j * kQ6KSubBytes + 64; }
static_assert(q6_k_quants_at(7) + 2 * 6 * 64 == kQ6KPanelSuperBytes);

// A Q6_K block's scales and d into row r of its super-block in a panel (`ps`), as stored.
inline void put_q6_k_scales(const uint8_t* block, int64_t r, uint8_t* ps) {
  for (int i = 0; i < 16; ++i) ps[q6_k_scales_at(i / 2) + i % 2 * kGemmRows + r] = block[192 + i];
  std::memcpy(ps + kQ6KDAt + 2 * r, block + 208, 2);
}

}  // namespace
}  // namespace kiln::kernels::quantized
