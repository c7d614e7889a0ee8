// Private: SIMD exp and the elementwise functions built on it (sigmoid, silu) over f32 arrays, and a
// 16 x 16 register transpose. The elementwise and fused_elementwise kernels both call these loops,
// so a fused op gives the same bits as the ops it replaced; attention's softmax uses the same exp.
//
// exp is Cephes' single-precision polynomial (within 2 ulp of the exact value; 0, 1, inf and NaN
// exact): libm's scalar expf, called once per element, costs more than the rest of a SiLU or a
// sampler's softmax together. AVX-512 loops, or AVX2 ones with the same bits on CPUs without
// AVX-512; where neither runs (no AVX2, or a test forced the generic gemm ISA level), the kernels
// loop over elementwise_functors.h's scalar functors (std::exp).
#pragma once

#include <cstdint>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace kiln::kernels::vmath {

enum class Fn : uint8_t { exp, sigmoid, silu };

// True when apply and extreme_index run SIMD loops here: the CPU has AVX-512 F/DQ and the active
// gemm level is avx512 or above, or it has AVX2 + FMA and the level is not generic (tests force
// generic to reach the scalar path). Both levels give every element the same bits.
bool available();
// True when the AVX-512 loops run (the CPU and the level as above): paged attention's AVX-512 path.
bool avx512_available();
// y[i] = fn(x[i]) for i < n; y may equal x. Only when available().
void apply(Fn fn, const float* x, float* y, int64_t n);
// The index of the first largest (or smallest) of x[0, n), n >= 1, or of the first NaN if there is
// one: the max / argmax reduction over a contiguous line (a greedy sampler's whole step). Only when
// available().
int64_t extreme_index(const float* x, int64_t n, bool largest);

#if defined(__x86_64__)
#define KILN_VMATH_AVX512 __attribute__((target("avx512f,avx512dq,fma")))
// GCC 12's AVX-512 intrinsics start from _mm512_undefined_ps(), which -Wmaybe-uninitialized
// misreports once inlined into a target("avx512f") function (GCC bug 105593, fixed in GCC 13); in
// the shuffles of the transpose as -Wuninitialized.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
// The mask of lanes [0, n) of a 16-lane vector: all for n >= 16, none for n <= 0 (a loop's tail).
inline __mmask16 first_lanes(int64_t n) {
  return n >= 16 ? __mmask16(0xFFFF) : n <= 0 ? __mmask16(0) : __mmask16((1u << n) - 1);
}

// exp(x) for every f32 x: n = round(x / ln 2), r = x - n ln 2 (in two parts, exact for |n| <= 150),
// exp(r) by Cephes' polynomial, times 2^n by vscalefps, which rounds to subnormals, zero and infinity
// as the exact result would. Clamping to [-104, 89] keeps n small (exp(-104) rounds to 0, exp(89) to
// inf); max(c, x) and min(c, x) return x when it is NaN, so NaN stays NaN.
KILN_VMATH_AVX512 inline __m512 exp_avx512(__m512 x) {
  x = _mm512_min_ps(_mm512_set1_ps(89.0f), _mm512_max_ps(_mm512_set1_ps(-104.0f), x));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(y, n);
}

// exp_avx512's steps on 8 lanes for CPUs without AVX-512 (paged attention's AVX2 path): vroundps for
// the rounding, and 2^n as two powers of two 2^(n >> 1) * 2^(n - (n >> 1)), each a normal float
// for n in [-150, 128], so y times the first is exact and only the second multiply rounds, as
// vscalefps rounds once: the same bits as exp_avx512 lane for lane.
#define KILN_VMATH_AVX2 __attribute__((target("avx2,fma")))
KILN_VMATH_AVX2 inline __m256 exp_avx2(__m256 x) {
  x = _mm256_min_ps(_mm256_set1_ps(89.0f), _mm256_max_ps(_mm256_set1_ps(-104.0f), x));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i ni = _mm256_cvtps_epi32(n), half = _mm256_srai_epi32(ni, 1), rest = _mm256_sub_epi32(ni, half);
  const __m256i bias = _mm256_set1_epi32(127);
  const __m256 first = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half, bias), 23));
  const __m256 second = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(rest, bias), 23));
  return _mm256_mul_ps(_mm256_mul_ps(y, first), second);
}

// The sum and the max of v's 8 lanes, in one fixed order: the halves, then pairs, then the last two.
KILN_VMATH_AVX2 inline float hsum_avx2(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
KILN_VMATH_AVX2 inline float hmax_avx2(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

// r[j] <- column j of the 16 x 16 matrix whose rows are r[0..15] (unpack, then 128-bit shuffles):
// the GEMM's packing of transposed operands and paged attention's key tiles.
[[gnu::always_inline]] KILN_VMATH_AVX512 inline void transpose16_avx512(__m512* r) {
  __m512 t[16], u[16];
  // Unrolled, so that t and u live in registers.
#pragma GCC unroll 8
  for (int a = 0; a < 8; ++a) {
    t[2 * a] = _mm512_unpacklo_ps(r[2 * a], r[2 * a + 1]);
    t[2 * a + 1] = _mm512_unpackhi_ps(r[2 * a], r[2 * a + 1]);
  }
#pragma GCC unroll 4
  for (int g = 0; g < 4; ++g) {  // u[4g + c], 128-bit lane l: column 4l + c of rows 4g..4g+3
    u[4 * g + 0] = _mm512_shuffle_ps(t[4 * g], t[4 * g + 2], 0x44);
    u[4 * g + 1] = _mm512_shuffle_ps(t[4 * g], t[4 * g + 2], 0xEE);
    u[4 * g + 2] = _mm512_shuffle_ps(t[4 * g + 1], t[4 * g + 3], 0x44);
    u[4 * g + 3] = _mm512_shuffle_ps(t[4 * g + 1], t[4 * g + 3], 0xEE);
  }
#pragma GCC unroll 4
  for (int c = 0; c < 4; ++c) {
    const __m512 w0 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0x88), w1 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0xDD);
    const __m512 w2 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0x88),
                 w3 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0xDD);
    r[c] = _mm512_shuffle_f32x4(w0, w2, 0x88);
    r[8 + c] = _mm512_shuffle_f32x4(w0, w2, 0xDD);
    r[4 + c] = _mm512_shuffle_f32x4(w1, w3, 0x88);
    r[12 + c] = _mm512_shuffle_f32x4(w1, w3, 0xDD);
  }
}
#pragma GCC diagnostic pop
#endif

}  // namespace kiln::kernels::vmath
