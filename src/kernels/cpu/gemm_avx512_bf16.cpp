// The GEMM / GEMV kernels of gemm_x86-inl.h compiled for AVX-512 + AVX512_BF16 (Zen 4/5, Sapphire
// Rapids): bf16 products with vdpbf16ps.
// Standard headers first, then the target pragma (see gemm.h).
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kernels/cpu/gemm.h"
#include "kernels/cpu/vector_math.h"

#if defined(__x86_64__)
// GCC 12 flags the deliberately undefined upper halves inside some AVX-512 intrinsics (the
// _mm256_undefined_pd of _mm512_reduce_add_ps) as maybe-uninitialized, at the intrinsic header's
// line, so the warning is off for this whole file.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
// The same placeholders (`__m512 __Y = __Y` in _mm512_unpacklo_ps) read as plainly uninitialized
// once pack_b_q8_0's transposes are inlined at -O2.
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>

#ifdef __clang__  // clang has no GCC target pragma; this is its equivalent
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,avx2,fma,f16c")
#endif
namespace kiln::kernels::gemm {
namespace {
#define KILN_GEMM_AVX512 1
#define KILN_GEMM_BF16_DOT 1
#include "kernels/cpu/gemm_x86-inl.h"
}  // namespace
}  // namespace kiln::kernels::gemm
#ifdef __clang__
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

namespace kiln::kernels::gemm {
const IsaKernels* avx512_bf16_kernels() {
  static const IsaKernels kernels{Isa::avx512_bf16, kBlocking, gemm_entry, small_m_entry, pack_b_entry, pack_b_narrow_entry,
                                  /*bf16_pairs=*/true};
  return &kernels;
}
}  // namespace kiln::kernels::gemm
#else
namespace kiln::kernels::gemm {
const IsaKernels* avx512_bf16_kernels() { return nullptr; }
}  // namespace kiln::kernels::gemm
#endif
