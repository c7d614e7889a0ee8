// Private: SIMD exp and the elementwise functions built on it (sigmoid, silu) over f32 arrays. The
// elementwise and fused_elementwise kernels both call these loops, so a fused op gives the same bits
// as the ops it replaced; attention's softmax uses the same exp.
//
// exp is Cephes' single-precision polynomial (within 2 ulp of the exact value; 0, 1, inf and NaN
// exact): libm's scalar expf, called once per element, costs more than the rest of a SiLU or a
// sampler's softmax together. Where the AVX-512 loops do not run (no AVX-512, or a test forced a
// lower gemm ISA level), the kernels loop over elementwise_functors.h's scalar functors (std::exp).
#pragma once

#include <cstdint>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace kiln::kernels::vmath {

enum class Fn : uint8_t { exp, sigmoid, silu };

// True when apply runs SIMD loops here: the CPU has AVX-512 F/DQ and the active gemm level is
// avx512 or above (tests force lower levels to reach the scalar path).
bool available();
// y[i] = fn(x[i]) for i < n; y may equal x. Only when available().
void apply(Fn fn, const float* x, float* y, int64_t n);
// The index of the first largest (or smallest) of x[0, n), n >= 1, or of the first NaN if there is
// one: the max / argmax reduction over a contiguous line (a greedy sampler's whole step). Only when
// available().
int64_t extreme_index(const float* x, int64_t n, bool largest);

#if defined(__x86_64__)
#define KILN_VMATH_AVX512 __attribute__((target("avx512f,avx512dq,fma")))
// GCC 12's AVX-512 intrinsics start from _mm512_undefined_ps(), which -Wmaybe-uninitialized
// misreports once inlined into a target("avx512f") function (GCC bug 105593, fixed in GCC 13).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
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
#pragma GCC diagnostic pop
#endif

}  // namespace kiln::kernels::vmath
