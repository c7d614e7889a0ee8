// The Q8_0 GEMV and GEMM of quantized.h for AVX-512 + AVX512_VNNI (Ice Lake / Sapphire Rapids,
// Zen 4/5), and the activation quantizer they share. GEMV: two weight blocks (64 quants) per
// vpdpbusd, f32 accumulation of the scaled block sums. GEMM: 16 weight rows per vpdpbusd from a
// packed panel, 6 activation rows x 32 weight rows of accumulators.
// Standard headers first, then the target pragma (see gemm.h for why).
#include <cstdint>
#include <cstring>
#include <vector>
#include <utility>

#include "kernels/cpu/quantized.h"

#if defined(__x86_64__)
// As in gemm_avx512.cpp: GCC 12 flags the undefined upper halves inside _mm512_reduce_add_ps.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>

#ifdef __clang__  // clang has no GCC target pragma; this is its equivalent
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")
#endif
#include "kernels/cpu/quantized_x86_helpers.h"
#include "kernels/cpu/quantized_block_unpack.h"

namespace kiln::kernels::quantized {
namespace {

using graph::QuantizationEncoding;

constexpr int64_t kBlock = 32, kBlockBytes = 34;

// Lanes 0-7 take element 0 of a vector, lanes 8-15 element 1: one scale per block of a pair.
inline __m512 spread_pair(__m128 two) {
  const __m512i pick = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  return _mm512_permutexvar_ps(pick, _mm512_castps128_ps512(two));
}

inline uint16_t scale_bits(const uint8_t* block) {
  uint16_t d;
  std::memcpy(&d, block, 2);
  return d;
}

// Q8_0 scales of blocks 2p and 2p + 1 of a row, spread over the two halves of a vector.
inline __m512 pair_scales(const uint8_t* b0) {
  const uint32_t d01 = scale_bits(b0) | static_cast<uint32_t>(scale_bits(b0 + kBlockBytes)) << 16;
  return spread_pair(_mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(d01))));
}

// The hot loop of decode: R weight rows at a time, each read once and multiplied with all M
// activation rows. [n, n1) is cut into R equal parts and the R rows of a step are the i-th rows of
// the parts: R sequential streams far apart in memory, each in pages of its own, which the L2
// streamer follows as it follows R arrays. With R adjacent rows (streams sharing pages) the same
// kernel streamed 1.2x (M = 1) to 1.35x (M = 2) slower from DRAM (Emerald Rapids, 1 thread). Each
// output's sum is the same either way. Does rows [n, n + R * part) and returns their end; the rest
// (fewer than R) are the caller's.
template <int M, int R>
int64_t gemv_rows(const Q8Activations& x, const uint8_t* w, int64_t row_bytes, int64_t n, int64_t n1, float* y,
                  int64_t ldy) {
  const int64_t K = x.K, blocks = K / kBlock, pairs = blocks / 2;
  const __m512i offset = _mm512_set1_epi8(static_cast<char>(0x80));
  const int64_t part = (n1 - n) / R;
  // Prefetch each stream about 2 KiB ahead, in whole rows so that the offset in the row stays.
  const int64_t ahead = (2048 + row_bytes - 1) / row_bytes * row_bytes;
  for (int64_t i = 0; i < part; ++i) {
    int64_t col[R];
    const uint8_t* row[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      col[r] = n + r * part + i;
      row[r] = w + col[r] * row_bytes;  // [blocks][34]
    }
    __m512 acc[M][R];
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m)
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; ++p) {
      // vpdpbusd multiplies unsigned by signed bytes. The weights go in as unsigned w + 128 (one xor)
      // and the activations as signed q_x (their stored q_x + 128, xor 0x80): sum (w + 128) q_x =
      // sum w q_x + 128 sum q_x, so each activation pair's correction -128 sum q_x is computed once
      // and serves all R rows, where correcting on the weight side would cost a second vpdpbusd per
      // row. Integer sums: the same bits either way.
      __m512i wu[R];
      __m512 dw[R];
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const uint8_t* b0 = row[r] + 2 * p * kBlockBytes;
        _mm_prefetch(reinterpret_cast<const char*>(b0) + ahead, _MM_HINT_T0);
        const __m512i wq =
            _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b0 + 2))),
                               _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b0 + kBlockBytes + 2)), 1);
        wu[r] = _mm512_xor_si512(wq, offset);
        dw[r] = pair_scales(b0);
      }
#pragma GCC unroll 8
      for (int m = 0; m < M; ++m) {
        const __m512i xs = _mm512_xor_si512(_mm512_loadu_si512(x.x + m * K + p * 2 * kBlock), offset);
        const __m512i correction =
            _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_dpbusd_epi32(_mm512_setzero_si512(), offset, xs));
        const __m512 dx = spread_pair(
            _mm_castsi128_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(x.d + m * blocks + 2 * p))));
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const __m512i dot = _mm512_dpbusd_epi32(correction, wu[r], xs);
          acc[m][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(dw[r], dx), acc[m][r]);
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      float tail[M] = {};
      if (blocks % 2 != 0) {  // an odd last block: one 256-bit step
        const uint8_t* b = row[r] + (blocks - 1) * kBlockBytes;
        const __m256i wq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2));
        const __m256i bias = _mm256_sub_epi32(
            _mm256_setzero_si256(),
            _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_set1_epi8(static_cast<char>(0x80)), wq));
        const float dw = _cvtsh_ss(scale_bits(b));
        for (int m = 0; m < M; ++m) {
          const __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.x + m * K + (blocks - 1) * kBlock));
          const __m256i dot = _mm256_dpbusd_epi32(bias, xq, wq);
          tail[m] = static_cast<float>(_mm512_reduce_add_epi32(_mm512_zextsi256_si512(dot))) * dw *
                    x.d[m * blocks + blocks - 1];
        }
      }
      for (int m = 0; m < M; ++m) y[m * ldy + col[r]] = _mm512_reduce_add_ps(acc[m][r]) + tail[m];
    }
  }
  return n + R * part;
}

// R streams while M * R accumulators, R weight vectors and R scale vectors fit the 32 vector
// registers, then the last rows (fewer than R) as one stream. For M <= 2, 6 streams streamed 3%
// (M = 1) and 15% (M = 2) faster than 4, and ahead of 5 and 8.
template <int M>
void gemv_m(const Q8Activations& x, const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1, float* y,
            int64_t ldy) {
  constexpr int R = M <= 2 ? 6 : 2;
  const int64_t n = gemv_rows<M, R>(x, w, row_bytes, n0, n1, y, ldy);
  gemv_rows<M, 1>(x, w, row_bytes, n, n1, y, ldy);
}

void gemv(const Q8Activations& x, const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1, float* y, int64_t ldy) {
  switch (x.M) {
    case 1: return gemv_m<1>(x, w, row_bytes, n0, n1, y, ldy);
    case 2: return gemv_m<2>(x, w, row_bytes, n0, n1, y, ldy);
    case 3: return gemv_m<3>(x, w, row_bytes, n0, n1, y, ldy);
    case 4: return gemv_m<4>(x, w, row_bytes, n0, n1, y, ldy);
    case 5: return gemv_m<5>(x, w, row_bytes, n0, n1, y, ldy);
    case 6: return gemv_m<6>(x, w, row_bytes, n0, n1, y, ldy);
    case 7: return gemv_m<7>(x, w, row_bytes, n0, n1, y, ldy);
    default: return gemv_m<8>(x, w, row_bytes, n0, n1, y, ldy);
  }
}

// ---- activation quantizer ----------------------------------------------------------------------

// The portable quantize_rows of quantized.cpp, vectorised: the same f32 divisions, and
// vcvtps2dq rounds half to even as nearbyint does under the default rounding mode.
void quantize_rows(const float* x, int64_t M, int64_t K, bool offset, uint8_t* q, float* d, int32_t* sum) {
  const int64_t blocks = K / kBlock;
  const __m512 sign = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < blocks; ++b) {
      const float* src = x + m * K + b * kBlock;
      const __m512 lo = _mm512_loadu_ps(src), hi = _mm512_loadu_ps(src + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_and_ps(lo, sign), _mm512_and_ps(hi, sign)));
      const float inv = amax != 0.0f ? 127.0f / amax : 0.0f;
      d[m * blocks + b] = amax / 127.0f;
      // |x * inv| <= 127 up to rounding, so the saturating narrow is the clamp to [-127, 127].
      const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, _mm512_set1_ps(inv)));
      const __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, _mm512_set1_ps(inv)));
      if (sum) sum[m * blocks + b] = _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
      __m256i bytes = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm512_cvtsepi32_epi8(qlo)),
                                              _mm512_cvtsepi32_epi8(qhi), 1);
      if (offset) bytes = _mm256_xor_si256(bytes, _mm256_set1_epi8(static_cast<char>(0x80)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + m * K + b * kBlock), bytes);
    }
}

// The K-quants' quantizer (quantized.cpp's quantize_rows_256, ggml's q8_K) vectorised: max|x| over
// 256, the same f32 division and multiply, the clamp, and vcvtps2dq's round half to even; sums per
// 32 and, where asked, per 16.
void quantize_rows_256(const float* x, int64_t M, int64_t K, uint8_t* q, float* d, int32_t* sum, int16_t* sum16) {
  const __m512 sign = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
  const __m512 top = _mm512_set1_ps(127.0f), bottom = _mm512_set1_ps(-127.0f);
  for (int64_t b = 0; b < M * K / 256; ++b) {
    const float* src = x + b * 256;
    __m512 amax = _mm512_setzero_ps();
    // Operands in this order, a NaN goes as in std::fmax / std::fmin: max|x| skips it, the clamp makes it 127.
    for (int i = 0; i < 256; i += 16) amax = _mm512_max_ps(_mm512_and_ps(_mm512_loadu_ps(src + i), sign), amax);
    const float max = _mm512_reduce_max_ps(amax);
    const float inv = max != 0.0f ? 127.0f / max : 0.0f;
    d[b] = max / 127.0f;
    const __m512 scale = _mm512_set1_ps(inv);
    for (int g = 0; g < 16; ++g) {  // 16 values: one sum16, half of a sum
      const __m512 v = _mm512_max_ps(_mm512_min_ps(_mm512_mul_ps(_mm512_loadu_ps(src + 16 * g), scale), top), bottom);
      const __m512i level = _mm512_cvtps_epi32(v);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * 256 + 16 * g), _mm512_cvtepi32_epi8(level));
      const int total = _mm512_reduce_add_epi32(level);
      if (sum16) sum16[b * 16 + g] = static_cast<int16_t>(total);
      if (g % 2 == 0)
        sum[b * 8 + g / 2] = total;
      else
        sum[b * 8 + g / 2] += total;
    }
  }
}

// ---- GEMM ----------------------------------------------------------------------------------------

// Panel of kGemmRows weight rows: kQ8_0PanelBlockBytes per block (quantized.h's layout). The GEMM
// reads a block's bytes in this order, so a pass over the panels is one forward stream: with the two
// halves 512 bytes apart (two interleaved streams) a Zen 4 core read 12 GB/s from DRAM without a
// software prefetch and 15-18 with one.
constexpr int64_t kPanelBlockBytes = kQ8_0PanelBlockBytes;
static_assert(kPanelBlockBytes == 2 * 8 * 64 + 2 * 16 * 2);

// 32 quants of each of 16 rows (`stride` bytes apart) -> [8 dwords][16 rows], each byte xor `flip`:
// an 8 x 8 dword transpose in each 256-bit half (rows r and r + 8 share a vector), as in the AVX
// 8 x 8 float transpose.
inline void transpose_16_rows(const uint8_t* first_row, int64_t stride, uint8_t* dst, __m512i flip) {
  __m512i z[8], t[8], s[8];
#pragma GCC unroll 8
  for (int r = 0; r < 8; ++r) {
    const uint8_t* lo = first_row + r * stride;
    const uint8_t* hi = first_row + (r + 8) * stride;
    z[r] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(lo))),
                              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(hi)), 1);
  }
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(z[2 * i], z[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(z[2 * i], z[2 * i + 1]);
  }
#pragma GCC unroll 2
  for (int h = 0; h < 2; ++h) {  // rows 0-3 (h = 0) and 4-7 of each half
    s[4 * h + 0] = _mm512_unpacklo_epi64(t[4 * h + 0], t[4 * h + 2]);
    s[4 * h + 1] = _mm512_unpackhi_epi64(t[4 * h + 0], t[4 * h + 2]);
    s[4 * h + 2] = _mm512_unpacklo_epi64(t[4 * h + 1], t[4 * h + 3]);
    s[4 * h + 3] = _mm512_unpackhi_epi64(t[4 * h + 1], t[4 * h + 3]);
  }
  // s[j] (j < 4), 128-bit lane l: rows 0-3 (l = 0, 1) or 8-11 (l = 2, 3) at dword j + 4 * (l % 2);
  // s[j + 4] likewise for rows 4-7 / 12-15.
  const __m512i low = _mm512_set_epi64(13, 12, 5, 4, 9, 8, 1, 0), high = _mm512_set_epi64(15, 14, 7, 6, 11, 10, 3, 2);
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j) {
    _mm512_store_si512(dst + j * 64, _mm512_xor_si512(_mm512_permutex2var_epi64(s[j], low, s[j + 4]), flip));
    _mm512_store_si512(dst + (j + 4) * 64, _mm512_xor_si512(_mm512_permutex2var_epi64(s[j], high, s[j + 4]), flip));
  }
}

void pack_panel(const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t rows, int64_t blocks, uint8_t* panel) {
  for (int64_t b = 0; b < blocks; ++b) {
    uint8_t* dst = panel + b * kPanelBlockBytes;
    uint16_t* scales = reinterpret_cast<uint16_t*>(dst + 2 * 8 * 64);
    for (int64_t half = 0; half < 2; ++half)
      if (rows >= 16 * (half + 1)) {  // quants + 128
        alignas(64) uint8_t dwords[8 * 64];
        transpose_16_rows(w + (n0 + 16 * half) * row_bytes + b * kBlockBytes + 2, row_bytes, dwords,
                          _mm512_set1_epi8(static_cast<char>(0x80)));
        for (int j = 0; j < 8; ++j)
          _mm512_store_si512(dst + j * 128 + half * 64, _mm512_load_si512(dwords + j * 64));
      }
    for (int64_t r = 0; r < kGemmRows; ++r) {
      if (r < rows) scales[r] = scale_bits(w + (n0 + r) * row_bytes + b * kBlockBytes);
      if (rows >= 16 * (r / 16 + 1)) continue;  // quants packed above
      uint32_t* quads = reinterpret_cast<uint32_t*>(dst + r / 16 * 64) + r % 16;
      if (r >= rows) {
        for (int j = 0; j < 8; ++j) quads[j * 32] = 0x80808080u;
        scales[r] = 0;
        continue;
      }
      const uint8_t* src = w + (n0 + r) * row_bytes + b * kBlockBytes;
      for (int j = 0; j < 8; ++j) {
        uint32_t v;
        std::memcpy(&v, src + 2 + 4 * j, 4);
        quads[j * 32] = v ^ 0x80808080u;
      }
    }
  }
}

// Which of a panel's two 16-row halves' columns exist, for a panel of `rows` weight rows.
inline std::pair<__mmask16, __mmask16> panel_masks(int64_t rows) {
  return {static_cast<__mmask16>(rows >= 16 ? 0xffff : (1u << rows) - 1),
          static_cast<__mmask16>(rows >= 32 ? 0xffff : rows <= 16 ? 0 : (1u << (rows - 16)) - 1)};
}

// A tile's accumulators: rows [m0, m0 + MR) of y, 32 columns (the masked ones), zero when `first`.
template <int MR>
inline void load_tile(__m512 (&acc)[MR][2], const float* y, int64_t m0, int64_t ldy, __mmask16 mask0,
                      __mmask16 mask1, bool first) {
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m) {
    const float* row = y + (m0 + m) * ldy;
    acc[m][0] = first ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(mask0, row);
    acc[m][1] = first ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(mask1, row + 16);
  }
}
template <int MR>
inline void store_tile(const __m512 (&acc)[MR][2], float* y, int64_t m0, int64_t ldy, __mmask16 mask0,
                       __mmask16 mask1) {
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m) {
    float* row = y + (m0 + m) * ldy;
    _mm512_mask_storeu_ps(row, mask0, acc[m][0]);
    _mm512_mask_storeu_ps(row + 16, mask1, acc[m][1]);
  }
}

// dot[m][h] += w_h . the 4 activation quants of row m at x + m * K, for a tile's rows m < MR: one
// broadcast dword feeds 16 weight rows per vpdpbusd.
template <int MR>
inline void dot_quads(__m512i (&dot)[MR][2], __m512i w0, __m512i w1, const uint8_t* x, int64_t K) {
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m) {
    int32_t quad;
    std::memcpy(&quad, x + m * K, 4);
    const __m512i xq = _mm512_set1_epi32(quad);
    dot[m][0] = _mm512_dpbusd_epi32(dot[m][0], w0, xq);
    dot[m][1] = _mm512_dpbusd_epi32(dot[m][1], w1, xq);
  }
}

// Rows [m0, m0 + MR) of y, panel columns [n0, n0 + 32) (`mask0`/`mask1`: which of each half exist),
// blocks [b0, b1); `first`: y holds nothing yet. `ahead` (or null): panel bytes a later pass reads,
// of which this tile fetches lines [line0, line1) of each block into L2 meanwhile (gemm passes it
// when a pass has several tiles, whose going back over the pass's blocks breaks the forward stream
// the hardware prefetcher follows); the pass's tiles share the fetching, spread over the pass.
template <int MR>
void gemm_tile(const Q8Activations& x, const uint8_t* panel, int64_t m0, int64_t b0, int64_t b1, float* y,
               int64_t ldy, __mmask16 mask0, __mmask16 mask1, bool first, const uint8_t* ahead, int64_t line0,
               int64_t line1) {
  const int64_t K = x.K, blocks = K / kBlock;
  __m512 acc[MR][2];
  load_tile(acc, y, m0, ldy, mask0, mask1, first);
  for (int64_t b = b0; b < b1; ++b) {
    const uint8_t* pb = panel + b * kPanelBlockBytes;
    if (ahead)
      for (int64_t line = line0; line < line1; ++line)
        _mm_prefetch(reinterpret_cast<const char*>(ahead + (b - b0) * kPanelBlockBytes + line * 64), _MM_HINT_T1);
    // Few rows (decode) leave too few independent vpdpbusd chains to hide their latency, so the
    // block's dwords alternate between two sums per accumulator, added at the end: integer sums,
    // the same bits.
    constexpr int kChains = MR <= 2 ? 2 : 1;
    __m512i dot[kChains][MR][2];
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      // -128 * sum(q_x) cancels the +128 the packed weights carry.
      const __m512i start = _mm512_set1_epi32(-128 * x.sum[(m0 + m) * blocks + b]);
      dot[0][m][0] = start;
      dot[0][m][1] = start;
      if constexpr (kChains == 2) dot[1][m][0] = dot[1][m][1] = _mm512_setzero_si512();
    }
    const uint8_t* xb = x.x + m0 * K + b * kBlock;
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      const __m512i w0 = _mm512_load_si512(pb + j * 128), w1 = _mm512_load_si512(pb + j * 128 + 64);
      dot_quads(dot[j % kChains], w0, w1, xb + 4 * j, K);
    }
    if constexpr (kChains == 2)
#pragma GCC unroll 8
      for (int m = 0; m < MR; ++m) {
        dot[0][m][0] = _mm512_add_epi32(dot[0][m][0], dot[1][m][0]);
        dot[0][m][1] = _mm512_add_epi32(dot[0][m][1], dot[1][m][1]);
      }
    const __m512 dw0 = _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(pb + 1024)));
    const __m512 dw1 = _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(pb + 1024 + 32)));
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      const __m512 dx = _mm512_set1_ps(x.d[(m0 + m) * blocks + b]);
      acc[m][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[0][m][0]), _mm512_mul_ps(dw0, dx), acc[m][0]);
      acc[m][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[0][m][1]), _mm512_mul_ps(dw1, dx), acc[m][1]);
    }
  }
  store_tile(acc, y, m0, ldy, mask0, mask1);
}

// Rows per tile: 6 rows x 32 columns keep 12 accumulators and 12 dots in registers. Tiles of 4 or
// 5 rows measured the same on Zen 4 (one core from cache, Q8_0 at 16 and 128 rows, five alternated
// rounds), and 6 keeps a 6-row decode batch in one tile (one forward stream).
constexpr int kGemmMR = 6;
// Blocks per pass over the activation rows: 16 blocks of a panel (17 KiB) stay in L1 meanwhile.
constexpr int64_t kGemmBlocksPerPass = 16;

void pack(const uint8_t* w, int64_t row_bytes, int64_t N, int64_t K, uint8_t* panels) {
  for (int64_t n = 0; n < N; n += kGemmRows)
    pack_panel(w, row_bytes, n, lo(kGemmRows, N - n), K / kBlock, panels + n / kGemmRows * gemm_panel_bytes(K));
}

// One row of x (decode) on packed panels: gemm_tile<1>'s operations in its order (so its bits), but
// each panel's blocks in one pass, the sums kept in registers, in a loop of its own. From DRAM the
// panels stream faster this way than through gemm's passes and tile dispatch (Zen 4: a harness
// alternating the two over 1 GiB of panels, medians 1.03x on one core, 1.06-1.08x on two; llama-1B
// Q8_0 decode steps 89% -> 94% of the same second's read bandwidth in the memory's slow phase,
// 72-78% -> 88% at 47-55 GB/s; docs/performance.md, session 27).
void gemv_packed(const Q8Activations& x, const uint8_t* packed, int64_t n0, int64_t n1, float* y) {
  const int64_t blocks = x.K / kBlock;
  for (int64_t n = n0; n < n1; n += kGemmRows) {
    const uint8_t* panel = packed + n / kGemmRows * gemm_panel_bytes(x.K);
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* pb = panel + b * kPanelBlockBytes;
      const uint8_t* xb = x.x + b * kBlock;
      // Even dwords into d, odd into e (gemm_tile's two chains); -128 * sum(q_x) cancels the +128.
      __m512i d0 = _mm512_set1_epi32(-128 * x.sum[b]), d1 = d0;
      __m512i e0 = _mm512_setzero_si512(), e1 = _mm512_setzero_si512();
      for (int j = 0; j < 8; j += 2) {
        int32_t q0, q1;
        std::memcpy(&q0, xb + 4 * j, 4);
        std::memcpy(&q1, xb + 4 * j + 4, 4);
        const __m512i x0 = _mm512_set1_epi32(q0), x1 = _mm512_set1_epi32(q1);
        d0 = _mm512_dpbusd_epi32(d0, _mm512_load_si512(pb + j * 128), x0);
        d1 = _mm512_dpbusd_epi32(d1, _mm512_load_si512(pb + j * 128 + 64), x0);
        e0 = _mm512_dpbusd_epi32(e0, _mm512_load_si512(pb + j * 128 + 128), x1);
        e1 = _mm512_dpbusd_epi32(e1, _mm512_load_si512(pb + j * 128 + 192), x1);
      }
      d0 = _mm512_add_epi32(d0, e0);
      d1 = _mm512_add_epi32(d1, e1);
      const __m512 dw0 = _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(pb + 1024)));
      const __m512 dw1 = _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(pb + 1024 + 32)));
      const __m512 dx = _mm512_set1_ps(x.d[b]);
      acc0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d0), _mm512_mul_ps(dw0, dx), acc0);
      acc1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d1), _mm512_mul_ps(dw1, dx), acc1);
    }
    const auto [mask0, mask1] = panel_masks(lo(kGemmRows, n1 - n));
    _mm512_mask_storeu_ps(y + n, mask0, acc0);
    _mm512_mask_storeu_ps(y + n + 16, mask1, acc1);
  }
}

void gemm(const Q8Activations& x, const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1, float* y, int64_t ldy,
          const uint8_t* packed, uint8_t* scratch) {
  if (packed && x.M == 1) return gemv_packed(x, packed, n0, n1, y);
  const int64_t blocks = x.K / kBlock;
  for (int64_t n = n0; n < n1; n += kGemmRows) {
    const int64_t rows = lo(kGemmRows, n1 - n);
    const uint8_t* panel = scratch;
    if (packed)
      panel = packed + n / kGemmRows * gemm_panel_bytes(x.K);
    else
      pack_panel(w, row_bytes, n, rows, blocks, scratch);
    const auto [mask0, mask1] = panel_masks(rows);
    for (int64_t b0 = 0; b0 < blocks; b0 += kGemmBlocksPerPass) {
      const int64_t b1 = lo(blocks, b0 + kGemmBlocksPerPass);
      // Packed panels lie one after the other, so a later pass's bytes follow this pass's (in this
      // panel or the next); a prefetch past the last one is harmless. One tile reads the panels as
      // one forward stream, which the hardware prefetcher follows best alone (Zen 4, one core from
      // DRAM: 23-27 GB/s without, 16-18 with); with several, each tile after the first goes back
      // over the pass's blocks, and the prefetch keeps the stream going (18 GB/s with, 12 without).
      const int64_t tiles = (x.M + kGemmMR - 1) / kGemmMR, lines = kPanelBlockBytes / 64;
      const uint8_t* ahead = packed && tiles > 1 ? panel + (b1 + kGemmBlocksPerPass) * kPanelBlockBytes : nullptr;
      int64_t tile = 0;
      auto line0 = [&] { return tile * lines / tiles; };
      auto line1 = [&] { return (tile + 1) * lines / tiles; };
      // Tiles of equal height (8 rows: 4 + 4, not 6 + 2); a row's sums are its own in any tile.
      const int64_t height = (x.M + tiles - 1) / tiles;
      for (int64_t m = 0; m < x.M; m += height, ++tile) {
        with_tile_rows<kGemmMR>(lo(height, x.M - m), [&]<int R>() {
          gemm_tile<R>(x, panel, m, b0, b1, y + n, ldy, mask0, mask1, b0 == 0, ahead, line0(), line1());
        });
      }
    }
  }
}

// ---- the GEMM of Q4_0, Q4_K, Q5_K and Q6_K (quantized.h) ------------------------------------------

// Weight rows [n0, n0 + rows) -> a panel (rows past them: u = 0, a = b = 0), through `staged`
// (stage_rows), transposed 16 rows at a time.
template <QuantizationEncoding E>
void unpack_panel(const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t rows, int64_t K, uint8_t* staged,
                  uint8_t* panel) {
  constexpr int kSub = Unpack<E>::kSub;
  stage_rows<E>(w, row_bytes, n0, rows, K, staged, panel);
  for (int64_t c = 0; c < K / 32; ++c)
    for (int64_t half = 0; half < 2; ++half)
      transpose_16_rows(staged + 16 * half * K + 32 * c, K, panel + c * kChunkBytes<kSub> + 512 * half,
                        _mm512_setzero_si512());
}

// y[m0 + m] = d_x[m] * part[m] (+ y[m0 + m] unless `fresh`) for a tile's rows m < MR, 32 columns
// (the masked ones); d_x[m] at dx[m * dx_stride]: the running sums' one scaling per activation block.
template <int MR>
inline void add_scaled_tile(const __m512 (&part)[MR][2], const float* dx, int64_t dx_stride, float* y, int64_t m0,
                            int64_t ldy, __mmask16 mask0, __mmask16 mask1, bool fresh) {
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m) {
    float* row = y + (m0 + m) * ldy;
    const __m512 d = _mm512_set1_ps(dx[m * dx_stride]);
    const __m512 y0 = fresh ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(mask0, row);
    const __m512 y1 = fresh ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(mask1, row + 16);
    _mm512_mask_storeu_ps(row, mask0, _mm512_fmadd_ps(part[m][0], d, y0));
    _mm512_mask_storeu_ps(row + 16, mask1, _mm512_fmadd_ps(part[m][1], d, y1));
  }
}

// Rows [m0, m0 + MR) of y, panel columns [n0, n0 + 32) (mask0/mask1 as gemm_tile's), chunks [c0, c1)
// of 32 quants (whole super-blocks for the K-quants); `first`: y holds nothing yet. The K-quants'
// running sums stay in y (read and written once per super-block), so the registers hold only a
// super-block's dots and sums; Q4_0's (d_x per chunk) stay in registers.
template <int MR, QuantizationEncoding E>
void block_gemm_tile(const Q8Activations& x, const uint8_t* panel, int64_t m0, int64_t c0, int64_t c1, float* y,
                     int64_t ldy, __mmask16 mask0, __mmask16 mask1, bool first) {
  using Rule = BlockGemmRule<E>;
  constexpr int kSub = Rule::kSub;
  const int64_t K = x.K, ablocks = K / activation_block(E), blocks = K / 32 * kSub;
  // Weight block t of chunk c: its integer dots for the tile's rows, from -offset * sum(q_x).
  const auto block_dots = [&](int64_t c, int t, __m512i (&dot)[MR][2]) {
    const uint8_t* pc = panel + c * kChunkBytes<kSub>;
    const int64_t block = kSub * c + t;
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      if constexpr (Rule::kOffset != 0) {
        const int32_t sum = kSub == 2 ? x.sum16[(m0 + m) * blocks + block] : x.sum[(m0 + m) * blocks + block];
        dot[m][0] = dot[m][1] = _mm512_set1_epi32(-Rule::kOffset * sum);
      } else {
        dot[m][0] = dot[m][1] = _mm512_setzero_si512();
      }
    }
#pragma GCC unroll 8
    for (int j = Rule::kDwords * t; j < Rule::kDwords * (t + 1); ++j)
      dot_quads(dot, _mm512_load_si512(pc + j * 64), _mm512_load_si512(pc + 512 + j * 64), x.x + m0 * K + 32 * c + 4 * j,
                K);
  };
  // Row i of chunk c's (a, b) table (a_t at i = t, b_t at i = kSub + t), columns 16h .. 16h + 15.
  const auto ab_row = [&](int64_t c, int i, int h) {
    return _mm512_load_ps(reinterpret_cast<const float*>(panel + c * kChunkBytes<kSub> + 1024) + i * kGemmRows + 16 * h);
  };
  if constexpr (!Rule::kSuper) {  // Q4_0: y += (a d_x) dot per chunk
    static_assert(kSub == 1 && Rule::kOffset != 0);
    __m512 acc[MR][2];
    load_tile(acc, y, m0, ldy, mask0, mask1, first);
    for (int64_t c = c0; c < c1; ++c) {
      __m512i dot[MR][2];
      block_dots(c, 0, dot);
      const __m512 a0 = ab_row(c, 0, 0), a1 = ab_row(c, 0, 1);
#pragma GCC unroll 8
      for (int m = 0; m < MR; ++m) {
        const __m512 dx = _mm512_set1_ps(x.d[(m0 + m) * ablocks + c]);
        acc[m][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[m][0]), _mm512_mul_ps(a0, dx), acc[m][0]);
        acc[m][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[m][1]), _mm512_mul_ps(a1, dx), acc[m][1]);
      }
    }
    store_tile(acc, y, m0, ldy, mask0, mask1);
    return;
  }
  constexpr int kChunks = Rule::kChunksPerSuper;
  for (int64_t s0 = c0; s0 < c1; s0 += kChunks) {
    __m512 part[MR][2];  // this super-block's sums, unscaled by d_x
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) part[m][0] = part[m][1] = _mm512_setzero_ps();
    for (int64_t c = s0; c < s0 + kChunks; ++c) {
#pragma GCC unroll 2
      for (int t = 0; t < kSub; ++t) {
        __m512i dot[MR][2];
        block_dots(c, t, dot);
        const __m512 a0 = ab_row(c, t, 0), a1 = ab_row(c, t, 1);
#pragma GCC unroll 8
        for (int m = 0; m < MR; ++m) {
          part[m][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[m][0]), a0, part[m][0]);
          part[m][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[m][1]), a1, part[m][1]);
        }
        if constexpr (Rule::kOffset == 0) {
          const __m512 b0 = ab_row(c, kSub + t, 0), b1 = ab_row(c, kSub + t, 1);
#pragma GCC unroll 8
          for (int m = 0; m < MR; ++m) {
            const __m512 sum = _mm512_set1_ps(x.sum_f32[(m0 + m) * blocks + kSub * c + t]);
            part[m][0] = _mm512_fnmadd_ps(b0, sum, part[m][0]);
            part[m][1] = _mm512_fnmadd_ps(b1, sum, part[m][1]);
          }
        }
      }
    }
    add_scaled_tile(part, x.d + m0 * ablocks + s0 / kChunks, ablocks, y, m0, ldy, mask0, mask1, first && s0 == c0);
  }
}

// Every activation row of x against one unpacked panel (y: its first column), 16 chunks (20-24 KiB
// of the panel: two super-blocks) at a time, which stay in L1 while every activation row passes
// over them.
template <QuantizationEncoding E>
void block_gemm_panel(const Q8Activations& x, const uint8_t* panel, float* y, int64_t ldy, __mmask16 mask0,
                      __mmask16 mask1) {
  static_assert(kGemmBlocksPerPass % BlockGemmRule<E>::kChunksPerSuper == 0);
  const int64_t chunks = x.K / 32;
  for (int64_t c0 = 0; c0 < chunks; c0 += kGemmBlocksPerPass) {
    const int64_t c1 = lo(chunks, c0 + kGemmBlocksPerPass);
    for (int64_t m = 0; m < x.M; m += kGemmMR)
      with_tile_rows<kGemmMR>(lo(kGemmMR, x.M - m), [&]<int R>() {
        block_gemm_tile<R, E>(x, panel, m, c0, c1, y, ldy, mask0, mask1, c0 == 0);
      });
  }
}

template <QuantizationEncoding E>
void block_gemm(const Q8Activations& x, const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1, float* y,
                int64_t ldy, uint8_t* scratch) {
  constexpr int kSub = Unpack<E>::kSub;
  const int64_t K = x.K, chunks = K / 32;
  uint8_t* panel = scratch;
  uint8_t* staged = scratch + chunks * kChunkBytes<kSub>;
  for (int64_t n = n0; n < n1; n += kGemmRows) {
    const int64_t rows = lo(kGemmRows, n1 - n);
    unpack_panel<E>(w, row_bytes, n, rows, K, staged, panel);
    const auto [mask0, mask1] = panel_masks(rows);
    block_gemm_panel<E>(x, panel, y + n, ldy, mask0, mask1);
  }
}

// ---- Q4_K packed at init: nibble panels (quantized.h) ---------------------------------------------

// One activation row m of x against a Q4_K panel (32 weight rows, `mask0`/`mask1`: which exist):
// y[m, n0 .. n0 + 32). Per super-block and 16 rows, sub-block j's dot is 8 vpdpbusd (the low nibbles
// of a vector are 4 quants of the row, its high nibbles the next 4), then the integer sums
// sum_j sc_j dot_j and sum_j m_j sum_j(q_x) are scaled once in f32: (d d_x) and (dmin d_x), as the
// row GEMV does. Each row's arithmetic is its own, so its bits do not depend on M.
void q4_k_panel_row(const Q8Activations& x, const uint8_t* panel, int64_t m, float* y, __mmask16 mask0,
                    __mmask16 mask1) {
  const int64_t K = x.K, supers = K / 256;
  const __m512i low = _mm512_set1_epi8(0x0F), high = _mm512_set1_epi8(static_cast<char>(0xF0));
  __m512 acc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
  const uint8_t* xrow = x.x + m * K;
  for (int64_t s = 0; s < supers; ++s) {
    const uint8_t* ps = panel + s * kQ4KPanelSuperBytes;
    __m512i isum[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
    __m512i msum[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
    const uint8_t* xs = xrow + s * 256;
#pragma GCC unroll 2
    for (int j = 0; j < 8; ++j) {
      const uint8_t* pj = ps + q4_k_quants_at(j);
      __m512i even[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
      __m512i odd[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) {
        int32_t qa, qb;
        std::memcpy(&qa, xs + 32 * j + 8 * i, 4);
        std::memcpy(&qb, xs + 32 * j + 8 * i + 4, 4);
        const __m512i xa = _mm512_set1_epi32(qa), xb = _mm512_set1_epi32(qb);
#pragma GCC unroll 2
        for (int h = 0; h < 2; ++h) {
          const __m512i v = _mm512_load_si512(pj + h * 256 + i * 64);
          even[h] = _mm512_dpbusd_epi32(even[h], _mm512_and_si512(v, low), xa);
          // The high nibbles in place: 16 times the quants (still u8), so the dot is 16 times theirs,
          // exactly, and one shift of the sum replaces a shift per vector.
          odd[h] = _mm512_dpbusd_epi32(odd[h], _mm512_and_si512(v, high), xb);
        }
      }
      const __m512i xsum = _mm512_set1_epi32(x.sum[m * (K / 32) + s * 8 + j]);
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        const __m512i sc = _mm512_cvtepu8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(ps + q4_k_scales_at(j) + 16 * h)));
        const __m512i mn = _mm512_cvtepu8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(ps + q4_k_mins_at(j) + 16 * h)));
        isum[h] = _mm512_add_epi32(isum[h], _mm512_mullo_epi32(_mm512_add_epi32(even[h], _mm512_srai_epi32(odd[h], 4)), sc));
        msum[h] = _mm512_add_epi32(msum[h], _mm512_mullo_epi32(mn, xsum));
      }
    }
    const __m512 dx = _mm512_set1_ps(x.d[m * supers + s]);
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      const __m512 d = _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(ps + kQ4KDAt + 32 * h)));
      const __m512 dmin = _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(ps + kQ4KDminAt + 32 * h)));
      acc[h] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[h]), _mm512_mul_ps(d, dx), acc[h]);
      acc[h] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(msum[h]), _mm512_mul_ps(dmin, dx), acc[h]);
    }
  }
  _mm512_mask_storeu_ps(y, mask0, acc[0]);
  _mm512_mask_storeu_ps(y + 16, mask1, acc[1]);
}

// Rows [m0, m0 + MR) of y against super-blocks [s0, s1) of a Q4_K panel (mask0/mask1 as
// gemm_tile's; `first`: y holds nothing yet), read as stored: the block GEMM's arithmetic without
// unpacking the panel first. Each nibble vector is masked once for all MR rows (a low and a high
// dot chain per row, the high one 16 times its quants, shifted back before the sum, exactly), and
// a_j = d sc_j, b_j = dmin m_j are the same f32 products q4_k_panel_to_gemm_panel stores, so the
// bits are the block GEMM's. Unpacking each panel per call took a sixth of a 16-row Q4_K_M step.
template <int MR>
void q4_k_panel_tile(const Q8Activations& x, const uint8_t* panel, int64_t m0, int64_t s0, int64_t s1, float* y,
                     int64_t ldy, __mmask16 mask0, __mmask16 mask1, bool first) {
  const int64_t K = x.K, supers = K / 256, blocks = K / 32;
  const __m512i low = _mm512_set1_epi8(0x0F), high = _mm512_set1_epi8(static_cast<char>(0xF0));
  for (int64_t s = s0; s < s1; ++s) {
    const uint8_t* ps = panel + s * kQ4KPanelSuperBytes;
    __m512 part[MR][2];
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) part[m][0] = part[m][1] = _mm512_setzero_ps();
    for (int j = 0; j < 8; ++j) {
      const uint8_t* pj = ps + q4_k_quants_at(j);
      __m512i even[MR][2], odd[MR][2];
#pragma GCC unroll 8
      for (int m = 0; m < MR; ++m) even[m][0] = even[m][1] = odd[m][0] = odd[m][1] = _mm512_setzero_si512();
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i)
#pragma GCC unroll 2
        for (int h = 0; h < 2; ++h) {
          const __m512i v = _mm512_load_si512(pj + h * 256 + i * 64);
          const __m512i lo = _mm512_and_si512(v, low), hi = _mm512_and_si512(v, high);
#pragma GCC unroll 8
          for (int m = 0; m < MR; ++m) {
            const uint8_t* xq = x.x + (m0 + m) * K + s * 256 + 32 * j + 8 * i;
            int32_t qa, qb;
            std::memcpy(&qa, xq, 4);
            std::memcpy(&qb, xq + 4, 4);
            even[m][h] = _mm512_dpbusd_epi32(even[m][h], lo, _mm512_set1_epi32(qa));
            odd[m][h] = _mm512_dpbusd_epi32(odd[m][h], hi, _mm512_set1_epi32(qb));
          }
        }
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        const __m512 d = _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(ps + kQ4KDAt + 32 * h)));
        const __m512 dmin = _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(ps + kQ4KDminAt + 32 * h)));
        const __m512 sc = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(ps + q4_k_scales_at(j) + 16 * h))));
        const __m512 mn = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(ps + q4_k_mins_at(j) + 16 * h))));
        const __m512 a = _mm512_mul_ps(d, sc), b = _mm512_mul_ps(dmin, mn);
#pragma GCC unroll 8
        for (int m = 0; m < MR; ++m) {
          const __m512i dot = _mm512_add_epi32(even[m][h], _mm512_srai_epi32(odd[m][h], 4));
          const __m512 sum = _mm512_set1_ps(x.sum_f32[(m0 + m) * blocks + s * 8 + j]);
          part[m][h] = _mm512_fnmadd_ps(b, sum, _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), a, part[m][h]));
        }
      }
    }
    add_scaled_tile(part, x.d + m0 * supers + s, supers, y, m0, ldy, mask0, mask1, first && s == s0);
  }
}

// Every activation row of x against one Q4_K panel, two super-blocks (9.5 KiB, L1) at a time, in
// row tiles of equal height (at most 4: two dot chains per row and half, and the sums, fill the
// registers). Up to kQ4KPanelGemmRows rows; above, unpacking the panel once pays for the block
// GEMM's 6-row tiles (Zen 4, one core from cache, 2048 x 8192: 16 rows 222-260 GFLOP/s unpacked,
// 286-301 here; 32 rows 288 and 294-301; 64 rows 303-318 and 291-296).
constexpr int64_t kQ4KPanelGemmRows = 32;
void q4_k_panel_gemm(const Q8Activations& x, const uint8_t* panel, float* y, int64_t ldy, __mmask16 mask0,
                     __mmask16 mask1) {
  constexpr int kRows = 4;
  const int64_t supers = x.K / 256, tiles = (x.M + kRows - 1) / kRows, height = (x.M + tiles - 1) / tiles;
  for (int64_t s0 = 0; s0 < supers; s0 += 2) {
    const int64_t s1 = lo(supers, s0 + 2);
    for (int64_t m = 0; m < x.M; m += height) {
      with_tile_rows<kRows>(lo(height, x.M - m), [&]<int R>() {
        q4_k_panel_tile<R>(x, panel, m, s0, s1, y, ldy, mask0, mask1, s0 == 0);
      });
    }
  }
}

// A Q4_K panel -> the block GEMM's panel (its quants and (a, b) exactly as unpack_panel makes them
// from the rows: a = d sc_j, b = dmin m_j, the same f32 products), so the GEMM gives the same bits
// from either.
void q4_k_panel_to_gemm_panel(const uint8_t* panel, int64_t K, uint8_t* gemm_panel) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int64_t s = 0; s < K / 256; ++s) {
    const uint8_t* ps = panel + s * kQ4KPanelSuperBytes;
    for (int j = 0; j < 8; ++j) {
      uint8_t* chunk = gemm_panel + (s * 8 + j) * kChunkBytes<1>;
      for (int h = 0; h < 2; ++h)
        for (int i = 0; i < 4; ++i) {
          const __m512i v = _mm512_load_si512(ps + q4_k_quants_at(j) + h * 256 + i * 64);
          _mm512_store_si512(chunk + 512 * h + 64 * (2 * i), _mm512_and_si512(v, low));
          _mm512_store_si512(chunk + 512 * h + 64 * (2 * i + 1), _mm512_and_si512(_mm512_srli_epi16(v, 4), low));
        }
      auto* ab = reinterpret_cast<float*>(chunk + 1024);
      for (int h = 0; h < 2; ++h) {
        const __m512 d = _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(ps + kQ4KDAt + 32 * h)));
        const __m512 dmin = _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(ps + kQ4KDminAt + 32 * h)));
        const __m512 sc = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(ps + q4_k_scales_at(j) + 16 * h))));
        const __m512 mn = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(ps + q4_k_mins_at(j) + 16 * h))));
        _mm512_store_ps(ab + 16 * h, _mm512_mul_ps(d, sc));
        _mm512_store_ps(ab + kGemmRows + 16 * h, _mm512_mul_ps(dmin, mn));
      }
    }
  }
}

// Q6_K quants of 16 rows as 6 bits in a byte: for groups A, B, C, D (quants 4g .. 4g + 3 of 32, for
// g = 4q .. 4q + 3) three vectors X, Y, Z hold A, B, C in bits 0-5 and D's bits 0-1, 2-3, 4-5 in
// their bits 6-7, so a group costs 2.25 instructions on average beside its vpdpbusd (it was 4.25 with
// the low nibbles and top bits in separate vectors). Select by mask: vpternlogd 0xE4 is c ? a : b.
constexpr int kSelect = 0xE4;
inline void q6_k_groups(const uint8_t* p, __m512i (&g)[8]) {
  const __m512i six = _mm512_set1_epi8(0x3F), two = _mm512_set1_epi8(0x03), four = _mm512_set1_epi8(0x0F);
#pragma GCC unroll 2
  for (int q = 0; q < 2; ++q) {
    const __m512i x = _mm512_load_si512(p + (3 * q) * 64), y = _mm512_load_si512(p + (3 * q + 1) * 64),
                  z = _mm512_load_si512(p + (3 * q + 2) * 64);
    g[4 * q] = _mm512_and_si512(x, six);
    g[4 * q + 1] = _mm512_and_si512(y, six);
    g[4 * q + 2] = _mm512_and_si512(z, six);
    // The 16-bit shifts bring the next byte's bits in above the two wanted; the masks drop them.
    const __m512i xy = _mm512_ternarylogic_epi32(_mm512_srli_epi16(x, 6), _mm512_srli_epi16(y, 4), two, kSelect);
    g[4 * q + 3] = _mm512_and_si512(_mm512_ternarylogic_epi32(xy, _mm512_srli_epi16(z, 2), four, kSelect), six);
  }
}
// The inverse, for packing: groups g[0..7] (u8 quants < 64) -> the 6 vectors at p.
inline void q6_k_store_groups(const __m512i (&g)[8], uint8_t* p) {
  const __m512i two = _mm512_set1_epi8(0x03);
  for (int q = 0; q < 2; ++q) {
    const __m512i d = g[4 * q + 3];
    for (int t = 0; t < 3; ++t) {  // D's bits 2t, 2t + 1 -> bits 6-7 (masked first: nothing crosses bytes)
      const __m512i bits = _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(d, 2 * t), two), 6);
      _mm512_store_si512(p + (3 * q + t) * 64, _mm512_or_si512(g[4 * q + t], bits));
    }
  }
}

// q4_k_panel_row for Q6_K: per sub-block of 16 the dot of u = q + 32, then
// (d d_x) * sum_i sc_i (dot_i - 32 sum_i(q_x)), the row GEMV's integer sums (exact in int32, so
// each dot starting from -32 sum_i(q_x) gives the same sum).
void q6_k_panel_row(const Q8Activations& x, const uint8_t* panel, int64_t m, float* y, __mmask16 mask0,
                    __mmask16 mask1) {
  const int64_t K = x.K, supers = K / 256;
  __m512 acc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
  const uint8_t* xrow = x.x + m * K;
  for (int64_t s = 0; s < supers; ++s) {
    const uint8_t* ps = panel + s * kQ6KPanelSuperBytes;
    __m512i isum[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
    const uint8_t* xs = xrow + s * 256;
    const int16_t* xs16 = x.sum16 + m * (K / 16) + s * 16;
#pragma GCC unroll 2
    for (int j = 0; j < 8; ++j) {
      int32_t quads[8];
      std::memcpy(quads, xs + 32 * j, 32);
      const __m512i start_a = _mm512_set1_epi32(-32 * xs16[2 * j]), start_b = _mm512_set1_epi32(-32 * xs16[2 * j + 1]);
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        __m512i u[8];
        q6_k_groups(ps + q6_k_quants_at(j) + h * 384, u);
        __m512i dot[2] = {start_a, start_b};
#pragma GCC unroll 8
        for (int g = 0; g < 8; ++g) dot[g / 4] = _mm512_dpbusd_epi32(dot[g / 4], u[g], _mm512_set1_epi32(quads[g]));
        const __m512i sc_a = _mm512_cvtepi8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(ps + q6_k_scales_at(j) + 16 * h)));
        const __m512i sc_b = _mm512_cvtepi8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(ps + q6_k_scales_at(j) + 32 + 16 * h)));
        isum[h] = _mm512_add_epi32(isum[h], _mm512_add_epi32(_mm512_mullo_epi32(dot[0], sc_a), _mm512_mullo_epi32(dot[1], sc_b)));
      }
    }
    const __m512 dx = _mm512_set1_ps(x.d[m * supers + s]);
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      const __m512 d = _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(ps + kQ6KDAt + 32 * h)));
      acc[h] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[h]), _mm512_mul_ps(d, dx), acc[h]);
    }
  }
  _mm512_mask_storeu_ps(y, mask0, acc[0]);
  _mm512_mask_storeu_ps(y + 16, mask1, acc[1]);
}

// A Q6_K panel -> the block GEMM's panel: the quants u and a = d sc_i as Unpack<q6_k> makes them
// from the rows, so the GEMM gives the same bits from either (b = 32 a is not written: the GEMM
// subtracts it in the integer dot).
void q6_k_panel_to_gemm_panel(const uint8_t* panel, int64_t K, uint8_t* gemm_panel) {
  for (int64_t s = 0; s < K / 256; ++s) {
    const uint8_t* ps = panel + s * kQ6KPanelSuperBytes;
    for (int j = 0; j < 8; ++j) {
      uint8_t* chunk = gemm_panel + (s * 8 + j) * kChunkBytes<2>;
      for (int h = 0; h < 2; ++h) {
        __m512i u[8];
        q6_k_groups(ps + q6_k_quants_at(j) + h * 384, u);
        for (int g = 0; g < 8; ++g) _mm512_store_si512(chunk + 512 * h + 64 * g, u[g]);
      }
      auto* ab = reinterpret_cast<float*>(chunk + 1024);
      for (int t = 0; t < 2; ++t)
        for (int h = 0; h < 2; ++h) {
          const __m512 d = _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(ps + kQ6KDAt + 32 * h)));
          const __m512 sc = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
              _mm_load_si128(reinterpret_cast<const __m128i*>(ps + q6_k_scales_at(j) + t * 32 + 16 * h))));
          _mm512_store_ps(ab + t * kGemmRows + 16 * h, _mm512_mul_ps(d, sc));
        }
    }
  }
}

// Weight rows [0, N) -> Q4_K or Q6_K panels (quantized.h): each group of kGemmRows rows decoded to
// u8 quants as the block GEMM does (Unpack), transposed 16 rows at a time into its dword layout,
// then each pair of dwords folded into one vector of nibbles (and Q6_K's top bits into another);
// the scales copied as stored.
template <QuantizationEncoding E>
void k_pack(const uint8_t* w, int64_t row_bytes, int64_t N, int64_t K, uint8_t* panels) {
  constexpr bool kQ6 = E == QuantizationEncoding::q6_k;
  using U = Unpack<E>;
  const int64_t supers = K / 256, super_bytes = kQ6 ? kQ6KPanelSuperBytes : kQ4KPanelSuperBytes;
  std::vector<uint8_t> staged(static_cast<size_t>(kGemmRows * K));
  alignas(64) uint8_t groups[8 * 64];  // one chunk of 32 quants of 16 rows: [8 dwords][16 rows][4]
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  for (int64_t n0 = 0; n0 < N; n0 += kGemmRows) {
    uint8_t* panel = panels + n0 / kGemmRows * k_panel_bytes(E, K);
    std::memset(panel, 0, static_cast<size_t>(k_panel_bytes(E, K)));  // rows past N: scales and d zero
    for (int64_t r = 0; r < kGemmRows; ++r) {
      uint8_t* u = staged.data() + r * K;
      if (r >= N - n0) {
        std::memset(u, 0, static_cast<size_t>(K));
        continue;
      }
      for (int64_t s = 0; s < supers; ++s) {
        const uint8_t* b = w + (n0 + r) * row_bytes + s * U::kBytes;
        U::block(b, u + 256 * s, [](int, float, float) {});
        uint8_t* ps = panel + s * super_bytes;
        if constexpr (kQ6) {
          put_q6_k_scales(b, r, ps);
        } else {
          put_q4_k_scales(b, r, ps);
        }
      }
    }
    for (int64_t c = 0; c < K / 32; ++c)
      for (int h = 0; h < 2; ++h) {
        transpose_16_rows(staged.data() + 16 * h * K + 32 * c, K, groups, _mm512_setzero_si512());
        uint8_t* ps = panel + c / 8 * super_bytes;
        const int64_t j = c % 8;
        __m512i g[8];
        for (int i = 0; i < 8; ++i) g[i] = _mm512_load_si512(groups + 64 * i);
        if constexpr (kQ6) {
          q6_k_store_groups(g, ps + q6_k_quants_at(j) + h * 384);
        } else {
          for (int i = 0; i < 4; ++i)  // low 4 bits of quants 8i + t and 8i + 4 + t in one byte
            _mm512_store_si512(ps + q4_k_quants_at(j) + h * 256 + i * 64,
                               _mm512_or_si512(_mm512_and_si512(g[2 * i], nibble),
                                               _mm512_slli_epi16(_mm512_and_si512(g[2 * i + 1], nibble), 4)));
        }
      }
  }
}

// Any M on the panels of a K-quant (q4_k or q6_k): up to kKPanelGemvRows rows the panels' GEMV, row by
// row (the panel stays in L2 for the rows after the first); Q4_K up to kQ4KPanelGemmRows rows the
// GEMM on the panels as stored; more rows (and Q6_K) unpack each panel into the block GEMM's in
// `scratch` and run its tiles, as block_gemm does.
template <QuantizationEncoding E>
void k_panels(const Q8Activations& x, const uint8_t* panels, int64_t n0, int64_t n1, float* y, int64_t ldy,
              uint8_t* scratch) {
  constexpr bool kQ6 = E == QuantizationEncoding::q6_k;
  const int64_t K = x.K;
  for (int64_t n = n0; n < n1; n += kGemmRows) {
    const uint8_t* panel = panels + n / kGemmRows * k_panel_bytes(E, K);
    const auto [mask0, mask1] = panel_masks(lo(kGemmRows, n1 - n));
    if (x.M <= kKPanelGemvRows) {
      for (int64_t m = 0; m < x.M; ++m)
        (kQ6 ? q6_k_panel_row : q4_k_panel_row)(x, panel, m, y + m * ldy + n, mask0, mask1);
      continue;
    }
    if (!kQ6 && x.M <= kQ4KPanelGemmRows) {
      q4_k_panel_gemm(x, panel, y + n, ldy, mask0, mask1);
      continue;
    }
    (kQ6 ? q6_k_panel_to_gemm_panel : q4_k_panel_to_gemm_panel)(panel, K, scratch);
    block_gemm_panel<E>(x, scratch, y + n, ldy, mask0, mask1);
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
QGemvFn avx512_vnni_q8_0_gemv() { return gemv; }
Q8_0PackFn avx512_vnni_k_pack(QuantizationEncoding e) {
  return e == QuantizationEncoding::q4_k   ? k_pack<QuantizationEncoding::q4_k>
         : e == QuantizationEncoding::q6_k ? k_pack<QuantizationEncoding::q6_k>
                                           : nullptr;
}
KPanelsFn avx512_vnni_k_panels(QuantizationEncoding e) {
  return e == QuantizationEncoding::q4_k   ? k_panels<QuantizationEncoding::q4_k>
         : e == QuantizationEncoding::q6_k ? k_panels<QuantizationEncoding::q6_k>
                                           : nullptr;
}
Q8_0GemmFn avx512_vnni_q8_0_gemm() { return gemm; }
Q8_0PackFn avx512_vnni_q8_0_pack() { return pack; }
QuantizeRowsFn avx512_quantize_rows() { return quantize_rows; }
QuantizeRows256Fn avx512_quantize_rows_256() { return quantize_rows_256; }
QBlockGemmFn avx512_vnni_block_gemm(QuantizationEncoding e) {
  switch (e) {
    case QuantizationEncoding::q4_0: return block_gemm<QuantizationEncoding::q4_0>;
    case QuantizationEncoding::q4_k: return block_gemm<QuantizationEncoding::q4_k>;
    case QuantizationEncoding::q5_k: return block_gemm<QuantizationEncoding::q5_k>;
    case QuantizationEncoding::q6_k: return block_gemm<QuantizationEncoding::q6_k>;
    default: return nullptr;
  }
}
}  // namespace kiln::kernels::quantized
#else
namespace kiln::kernels::quantized {
QGemvFn avx512_vnni_q8_0_gemv() { return nullptr; }
Q8_0PackFn avx512_vnni_k_pack(graph::QuantizationEncoding) { return nullptr; }
KPanelsFn avx512_vnni_k_panels(graph::QuantizationEncoding) { return nullptr; }
Q8_0GemmFn avx512_vnni_q8_0_gemm() { return nullptr; }
Q8_0PackFn avx512_vnni_q8_0_pack() { return nullptr; }
QuantizeRowsFn avx512_quantize_rows() { return nullptr; }
QuantizeRows256Fn avx512_quantize_rows_256() { return nullptr; }
QBlockGemmFn avx512_vnni_block_gemm(graph::QuantizationEncoding) { return nullptr; }
}  // namespace kiln::kernels::quantized
#endif

namespace kiln::kernels::quantized {
int64_t block_gemm_panel_bytes(graph::QuantizationEncoding e, int64_t K) {
  const int sub_blocks = e == graph::QuantizationEncoding::q6_k ? 2 : 1;
  return K / 32 * block_gemm_chunk_bytes(sub_blocks) + kGemmRows * K;  // the panel, then the staged rows
}
}  // namespace kiln::kernels::quantized
