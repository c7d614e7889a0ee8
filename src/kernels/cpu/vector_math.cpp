#include "kernels/cpu/vector_math.h"

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
    const __mmask16 tail = static_cast<__mmask16>((1u << (n - i)) - 1);
    _mm512_mask_storeu_ps(y + i, tail, eval<kFn>(_mm512_maskz_loadu_ps(tail, x + i)));
  }
}

#pragma GCC diagnostic pop

}  // namespace

bool available() {
  static const bool cpu = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq");
  const gemm::Isa isa = gemm::active_isa();
  return cpu && (isa == gemm::Isa::avx512 || isa == gemm::Isa::avx512_bf16);
}

void apply(Fn fn, const float* x, float* y, int64_t n) {
  switch (fn) {
    case Fn::exp: return loop_avx512<Fn::exp>(x, y, n);
    case Fn::sigmoid: return loop_avx512<Fn::sigmoid>(x, y, n);
    case Fn::silu: return loop_avx512<Fn::silu>(x, y, n);
  }
}
#else
bool available() { return false; }
void apply(Fn, const float*, float*, int64_t) {}
#endif

}  // namespace kiln::kernels::vmath
