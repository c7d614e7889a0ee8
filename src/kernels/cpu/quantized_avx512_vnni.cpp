// The Q8_0 GEMV of quantized.h for AVX-512 + AVX512_VNNI (Ice Lake / Sapphire Rapids, Zen 4/5): two
// weight blocks (64 quants) per vpdpbusd, f32 accumulation of the scaled block sums.
// Standard headers first, then the target pragma (see gemm.h for why).
#include <cstdint>
#include <cstring>

#include "kernels/cpu/quantized.h"

#if defined(__x86_64__)
// As in gemm_avx512.cpp: GCC 12 flags the undefined upper halves inside _mm512_reduce_add_ps.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")
namespace kiln::kernels::quantized {
namespace {

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

// The hot loop of decode: R weight rows at a time (R streams from memory, which one core's
// prefetchers serve faster than one), each read once and multiplied with all M activation rows.
template <int M, int R>
int64_t gemv_rows(const Q8Activations& x, const uint8_t* w, int64_t row_bytes, int64_t n, int64_t n1, float* y,
                  int64_t ldy) {
  const int64_t K = x.K, blocks = K / kBlock, pairs = blocks / 2;
  const __m512i offset = _mm512_set1_epi8(static_cast<char>(0x80));
  for (; n + R <= n1; n += R) {
    const uint8_t* row[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) row[r] = w + (n + r) * row_bytes;  // [blocks][34]
    __m512 acc[M][R];
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m)
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; ++p) {
      __m512i wq[R], bias[R];
      __m512 dw[R];
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const uint8_t* b0 = row[r] + 2 * p * kBlockBytes;
        _mm_prefetch(reinterpret_cast<const char*>(b0) + 1024, _MM_HINT_T0);
        wq[r] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b0 + 2))),
                                   _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b0 + kBlockBytes + 2)), 1);
        // -128 * sum(w) per group of 4: cancels the +128 the activations carry.
        bias[r] = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_dpbusd_epi32(_mm512_setzero_si512(), offset, wq[r]));
        dw[r] = pair_scales(b0);
      }
#pragma GCC unroll 8
      for (int m = 0; m < M; ++m) {
        const __m512i xq = _mm512_loadu_si512(x.x + m * K + p * 2 * kBlock);
        const __m512 dx = spread_pair(
            _mm_castsi128_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(x.d + m * blocks + 2 * p))));
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const __m512i dot = _mm512_dpbusd_epi32(bias[r], xq, wq[r]);
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
      for (int m = 0; m < M; ++m) y[m * ldy + n + r] = _mm512_reduce_add_ps(acc[m][r]) + tail[m];
    }
  }
  return n;
}

// R rows at a time while M * R accumulators fit the 32 vector registers, then the last rows singly.
template <int M>
void gemv_m(const Q8Activations& x, const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1, float* y,
            int64_t ldy) {
  constexpr int R = M <= 2 ? 4 : 2;
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

}  // namespace
}  // namespace kiln::kernels::quantized
#pragma GCC pop_options

namespace kiln::kernels::quantized {
Q8_0GemvFn avx512_vnni_q8_0_gemv() { return gemv; }
}  // namespace kiln::kernels::quantized
#else
namespace kiln::kernels::quantized {
Q8_0GemvFn avx512_vnni_q8_0_gemv() { return nullptr; }
}  // namespace kiln::kernels::quantized
#endif
