#include "kernels/cpu/vector_math.h"

#include <cmath>
#include <limits>

#include "kernels/cpu/gemm.h"

namespace kiln::kernels::vmath {

#if defined(__x86_64__)
namespace {

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

// The scalar functors' formulas (elementwise_functors.h) with exp_avx512 for std::exp.
template <Fn kFn> KILN_VMATH_AVX512 inline __m512 eval(__m512 x) {
  if constexpr (kFn == Fn::exp) {
    return exp_avx512(x);
  } else {
    const __m512 one = _mm512_set1_ps(1.0f);
    const __m512 denominator = _mm512_add_ps(one, exp_avx512(_mm512_sub_ps(_mm512_setzero_ps(), x)));
    return _mm512_div_ps(kFn == Fn::sigmoid ? one : x, denominator);
  }
}

template <Fn kFn> KILN_VMATH_AVX512 void loop_avx512(const float* x, float* y, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(y + i, eval<kFn>(_mm512_loadu_ps(x + i)));
  if (i < n) {
    const __mmask16 tail = first_lanes(n - i);
    _mm512_mask_storeu_ps(y + i, tail, eval<kFn>(_mm512_maskz_loadu_ps(tail, x + i)));
  }
}

// Two passes over data that fits in L2: the extreme by lanes (NaN noted), then the first index
// holding it (+0 and -0 compare equal, so the first of them wins, as a scalar scan's > does).
template <bool kLargest> KILN_VMATH_AVX512 int64_t extreme_index_avx512(const float* x, int64_t n) {
  const __m512 fill = _mm512_set1_ps(kLargest ? -std::numeric_limits<float>::infinity()
                                              : std::numeric_limits<float>::infinity());
  __m512 best = fill;
  __mmask16 nan = 0;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    best = kLargest ? _mm512_max_ps(best, v) : _mm512_min_ps(best, v);
  }
  const __mmask16 tail = first_lanes(n - i);
  if (i < n) {
    const __m512 v = _mm512_mask_loadu_ps(fill, tail, x + i);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    best = kLargest ? _mm512_max_ps(best, v) : _mm512_min_ps(best, v);
  }
  if (nan) {
    for (int64_t j = 0;; ++j)
      if (std::isnan(x[j])) return j;
  }
  const __m512 target = _mm512_set1_ps(kLargest ? _mm512_reduce_max_ps(best) : _mm512_reduce_min_ps(best));
  for (i = 0; i + 16 <= n; i += 16)
    if (const __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + i), target, _CMP_EQ_OQ))
      return i + __builtin_ctz(hit);
  const __mmask16 hit = _mm512_mask_cmp_ps_mask(tail, _mm512_maskz_loadu_ps(tail, x + i), target, _CMP_EQ_OQ);
  return i + __builtin_ctz(hit);  // the extreme is somewhere: if not before, then here
}

#pragma GCC diagnostic pop

// The AVX2 level (CPUs without AVX-512): eval's formulas on 8 lanes with exp_avx2, which gives
// exp_avx512's bits, and IEEE division, so every element gets the AVX-512 loop's bits. A tail of
// fewer than 8 goes through a padded vector.
template <Fn kFn> KILN_VMATH_AVX2 inline __m256 eval_avx2(__m256 x) {
  if constexpr (kFn == Fn::exp) {
    return exp_avx2(x);
  } else {
    const __m256 one = _mm256_set1_ps(1.0f);
    const __m256 denominator = _mm256_add_ps(one, exp_avx2(_mm256_sub_ps(_mm256_setzero_ps(), x)));
    return _mm256_div_ps(kFn == Fn::sigmoid ? one : x, denominator);
  }
}

template <Fn kFn> KILN_VMATH_AVX2 void loop_avx2(const float* x, float* y, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, eval_avx2<kFn>(_mm256_loadu_ps(x + i)));
  if (i < n) {
    alignas(32) float tail[8] = {};
    for (int64_t j = i; j < n; ++j) tail[j - i] = x[j];
    _mm256_store_ps(tail, eval_avx2<kFn>(_mm256_load_ps(tail)));
    for (int64_t j = i; j < n; ++j) y[j] = tail[j - i];
  }
}

// extreme_index_avx512's two passes on 8 lanes; the tail scanned as a scalar loop would.
template <bool kLargest> KILN_VMATH_AVX2 int64_t extreme_index_avx2(const float* x, int64_t n) {
  const float fill = kLargest ? -std::numeric_limits<float>::infinity() : std::numeric_limits<float>::infinity();
  __m256 best = _mm256_set1_ps(fill);
  __m256 nan = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    best = kLargest ? _mm256_max_ps(best, v) : _mm256_min_ps(best, v);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, best);
  bool any_nan = _mm256_movemask_ps(nan) != 0;
  float extreme = fill;
  for (float lane : lanes) extreme = kLargest ? (lane > extreme ? lane : extreme) : (lane < extreme ? lane : extreme);
  for (int64_t j = i; j < n; ++j) {
    any_nan = any_nan || std::isnan(x[j]);
    if (kLargest ? x[j] > extreme : x[j] < extreme) extreme = x[j];
  }
  if (any_nan) {
    for (int64_t j = 0;; ++j)
      if (std::isnan(x[j])) return j;
  }
  const __m256 target = _mm256_set1_ps(extreme);
  for (i = 0; i + 8 <= n; i += 8)
    if (const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), target, _CMP_EQ_OQ)))
      return i + __builtin_ctz(static_cast<unsigned>(hit));
  for (;; ++i)
    if (x[i] == extreme) return i;  // the extreme is somewhere: if not before, then here
}

}  // namespace

bool avx512_available() {
  static const bool cpu = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq");
  const gemm::Isa isa = gemm::active_isa();
  return cpu && (isa == gemm::Isa::avx512 || isa == gemm::Isa::avx512_bf16);
}

bool available() {
  static const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return avx512_available() || (avx2 && gemm::active_isa() != gemm::Isa::generic);
}

void apply(Fn fn, const float* x, float* y, int64_t n) {
  if (!avx512_available()) {
    switch (fn) {
      case Fn::exp: return loop_avx2<Fn::exp>(x, y, n);
      case Fn::sigmoid: return loop_avx2<Fn::sigmoid>(x, y, n);
      case Fn::silu: return loop_avx2<Fn::silu>(x, y, n);
    }
  }
  switch (fn) {
    case Fn::exp: return loop_avx512<Fn::exp>(x, y, n);
    case Fn::sigmoid: return loop_avx512<Fn::sigmoid>(x, y, n);
    case Fn::silu: return loop_avx512<Fn::silu>(x, y, n);
  }
}
int64_t extreme_index(const float* x, int64_t n, bool largest) {
  if (!avx512_available()) return largest ? extreme_index_avx2<true>(x, n) : extreme_index_avx2<false>(x, n);
  return largest ? extreme_index_avx512<true>(x, n) : extreme_index_avx512<false>(x, n);
}
#else
bool avx512_available() { return false; }
bool available() { return false; }
void apply(Fn, const float*, float*, int64_t) {}
int64_t extreme_index(const float*, int64_t, bool) { return 0; }
#endif

}  // namespace kiln::kernels::vmath
