// Small helpers the x86 quantized kernels share (quantized_avx2.cpp, quantized_avx512_kquants.cpp,
// quantized_avx512_vnni.cpp).
// Include it after the file's target pragma (and the standard headers below before it, as gemm.h
// says): the functions have internal linkage, so each file gets
// its own copy compiled for its own ISA (an inline function with external linkage could be merged
// with another file's copy built for a wider ISA, as gemm.h explains). hsum is the AVX2 kernels'
// horizontal sum step for step: the AVX-512 decode GEMV gives the AVX2 kernels' bits through it.
#pragma once

#include <cstdint>
#include <cstring>
#include <immintrin.h>
#include <utility>

namespace kiln::kernels::quantized {
namespace {  // NOLINT(google-build-namespaces): internal linkage per including file, on purpose

// Not std::min: library templates instantiated under the target pragma could replace the baseline
// copies at link time (gemm.h).
inline int64_t lo(int64_t a, int64_t b) { return a < b ? a : b; }

inline float load_f16(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return _cvtsh_ss(bits);
}

inline uint32_t load_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

inline __m256i load256(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }

// A Q4_K / Q5_K block's eight 6-bit scales and mins, one byte each, four to a word (quantization.h's
// layout of the 12 bytes at block + 4).
struct KScaleWords {
  uint32_t sc03, sc47, m03, m47;
};
inline KScaleWords k_scale_words(const uint8_t* block) {
  const uint32_t w0 = load_u32(block + 4), w1 = load_u32(block + 8), w2 = load_u32(block + 12);
  return {w0 & 0x3f3f3f3fu, (w2 & 0x0f0f0f0fu) | ((w0 >> 6) & 0x03030303u) << 4, w1 & 0x3f3f3f3fu,
          ((w2 >> 4) & 0x0f0f0f0fu) | ((w1 >> 6) & 0x03030303u) << 4};
}

// f.template operator()<R>() with R = rows, 1..kMax: a tile runs the kernel of its own height
// (gemm_x86-inl.h's with_rows, for the quantized kernels' tiles).
template <int kMax, class F> void with_tile_rows(int64_t rows, F&& f) {
  [&]<int... R>(std::integer_sequence<int, R...>) {
    (void)((rows == R + 1 ? (f.template operator()<R + 1>(), true) : false) || ...);
  }(std::make_integer_sequence<int, kMax>{});
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

}  // namespace
}  // namespace kiln::kernels::quantized
