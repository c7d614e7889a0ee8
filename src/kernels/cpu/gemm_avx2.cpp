// The GEMM / GEMV kernels of gemm_x86-inl.h compiled for AVX2 + FMA + F16C (Haswell and later, Zen 1 and
// later).
// Standard headers first, then the target pragma (see gemm.h).
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kernels/cpu/gemm.h"

#if defined(__x86_64__)
// GCC 12 flags the deliberately undefined upper halves inside some AVX-512 intrinsics (the
// _mm256_undefined_pd of _mm512_reduce_add_ps) as maybe-uninitialized, at the intrinsic header's
// line, so the warning is off for this whole file.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#ifdef __clang__  // clang has no GCC target pragma; this is its equivalent
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#endif
namespace kiln::kernels::gemm {
namespace {
#define KILN_GEMM_AVX2 1
#include "kernels/cpu/gemm_x86-inl.h"
}  // namespace
}  // namespace kiln::kernels::gemm
#ifdef __clang__
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

namespace kiln::kernels::gemm {
const IsaKernels* avx2_kernels() {
  static const IsaKernels kernels{Isa::avx2, kBlocking, gemm_entry, small_m_entry, pack_b_entry, pack_b_narrow_entry};
  return &kernels;
}
}  // namespace kiln::kernels::gemm
#else
namespace kiln::kernels::gemm {
const IsaKernels* avx2_kernels() { return nullptr; }
}  // namespace kiln::kernels::gemm
#endif
