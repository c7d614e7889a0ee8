// Private: the GEMM / GEMV templates shared by the x86 ISA levels. Not a normal header: each of
// gemm_avx2.cpp, gemm_avx512.cpp and gemm_avx512_bf16.cpp includes it once, inside an anonymous
// namespace and after `#pragma GCC target(...)`, with one of KILN_GEMM_AVX2 / KILN_GEMM_AVX512
// defined (and KILN_GEMM_BF16_DOT for the vdpbf16ps kernels). It includes nothing itself: all
// standard headers come before the pragma in the including file (see gemm.h for why).
//
// Layout of the packed operands (MR x NR register tile, L floats per vector, NR = NV * L):
//   f32 kernel:  A packed [MR][kc] per row tile, B panels [kc][NR]
//   bf16 kernel: A rows of bf16 (or packed [MR][kc even]), B panels [kc / 2][NR][2] (k pairs)

// ---- vector traits --------------------------------------------------------------------------------

#if defined(KILN_GEMM_AVX512)
struct Vec {
  using V = __m512;
  static constexpr int L = 16;
  static V zero() { return _mm512_setzero_ps(); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static V load(const f16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static V load(const bf16_t* p) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
  }
  static V load_q8(const uint8_t* q, float d) {  // 16 int8 quants times their block's scale
    const __m512i wide = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
    return _mm512_mul_ps(_mm512_cvtepi32_ps(wide), _mm512_set1_ps(d));
  }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static float sum(V v) { return _mm512_reduce_add_ps(v); }
  // r[j] <- column j of the 16 x 16 matrix whose rows are r[0..15].
  static void transpose(V* r) { vmath::transpose16_avx512(r); }
};
constexpr int kMR = 6, kNV = 4;  // 6 x 64 tile: 24 zmm accumulators
// kc 512: the C tile is loaded and stored once per depth block, so a deep block halves that traffic
// against 256 (C of a 1024-wide product lives in L3). Each call streams its B micro-panel (kc x 64 =
// 128 KiB) from L2 at 256 bytes a step, which L2 sustains, while the next micro-panel is prefetched
// into L2 (micro_f32's pf). A block mc x kc = 384 KiB stays in the 2 MiB L2 beside the B micro-panel
// and the C tiles passing through. Measured on an Emerald Rapids core against kc 128 (B micro-panel
// inside the 48 KiB L1d), 256 and 384: 1024^3 and M = 128 prefill shapes both best at 384-768.
constexpr int64_t kKC = 512, kMC = 192, kNC = 1024;
#elif defined(KILN_GEMM_AVX2)
struct Vec {
  using V = __m256;
  static constexpr int L = 8;
  static V zero() { return _mm256_setzero_ps(); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static V load(const f16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static V load(const bf16_t* p) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
  }
  static V load_q8(const uint8_t* q, float d) {  // 8 int8 quants times their block's scale
    const __m256i wide = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q)));
    return _mm256_mul_ps(_mm256_cvtepi32_ps(wide), _mm256_set1_ps(d));
  }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static float sum(V v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  static void transpose(V* r) {  // 8 x 8, as the AVX-512 one with 128-bit halves
    V t[8], u[8];
    for (int a = 0; a < 4; ++a) {
      t[2 * a] = _mm256_unpacklo_ps(r[2 * a], r[2 * a + 1]);
      t[2 * a + 1] = _mm256_unpackhi_ps(r[2 * a], r[2 * a + 1]);
    }
    for (int g = 0; g < 2; ++g) {
      u[4 * g + 0] = _mm256_shuffle_ps(t[4 * g], t[4 * g + 2], 0x44);
      u[4 * g + 1] = _mm256_shuffle_ps(t[4 * g], t[4 * g + 2], 0xEE);
      u[4 * g + 2] = _mm256_shuffle_ps(t[4 * g + 1], t[4 * g + 3], 0x44);
      u[4 * g + 3] = _mm256_shuffle_ps(t[4 * g + 1], t[4 * g + 3], 0xEE);
    }
    for (int c = 0; c < 4; ++c) {
      r[c] = _mm256_permute2f128_ps(u[c], u[4 + c], 0x20);
      r[4 + c] = _mm256_permute2f128_ps(u[c], u[4 + c], 0x31);
    }
  }
};
constexpr int kMR = 6, kNV = 2;  // 6 x 16 tile: 12 ymm accumulators
// B micro-panel kc x 16 floats = 16 KiB in a 32 KiB L1d; A block mc x kc = 384 KiB in the L2.
constexpr int64_t kKC = 256, kMC = 384, kNC = 512;
#endif
using V = Vec::V;
constexpr int kL = Vec::L;
constexpr int kNR = kNV * kL;

inline int64_t lo(int64_t a, int64_t b) { return a < b ? a : b; }

inline float to_f32(float v) { return v; }
inline float to_f32(f16_t v) { return f16_to_f32(v.bits); }
inline float to_f32(bf16_t v) { return bf16_to_f32(v.bits); }

// L elements from p, of which the first n (< L) exist; the rest read as zero.
template <class T> V load_partial(const T* p, int64_t n) {
  alignas(64) T tmp[kL] = {};
  std::memcpy(tmp, p, static_cast<size_t>(n) * sizeof(T));
  return Vec::load(tmp);
}

// f32 rows [rows][width] (leading dim ld) -> C of element type T (contiguous rows, ldc).
template <class T> void store_rows(const float* src, int64_t ld, int64_t rows, int64_t width, T* c, int64_t ldc) {
  for (int64_t i = 0; i < rows; ++i) {
    const float* s = src + i * ld;
    T* d = c + i * ldc;
    int64_t j = 0;
#if defined(KILN_GEMM_AVX512)
    if constexpr (!std::is_same_v<T, float>) {
      for (; j + 16 <= width; j += 16) {
        const __m512 v = _mm512_loadu_ps(s + j);
        __m256i h;
        if constexpr (std::is_same_v<T, f16_t>) {
          h = _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        } else {
          // f32 -> bf16, round to nearest even; NaN stays a (quiet) NaN.
          const __m512i bits = _mm512_castps_si512(v);
          const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
          __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
          const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
          rounded = _mm512_mask_or_epi32(rounded, nan, _mm512_srli_epi32(bits, 16), _mm512_set1_epi32(0x40));
          h = _mm512_cvtepi32_epi16(rounded);
        }
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + j), h);
      }
    }
#endif
    for (; j < width; ++j) {
      if constexpr (std::is_same_v<T, float>)
        d[j] = s[j];
      else if constexpr (std::is_same_v<T, f16_t>)
        d[j].bits = f32_to_f16(s[j]);
      else
        d[j].bits = f32_to_bf16(s[j]);
    }
  }
}

// ---- f32 micro-kernel ----------------------------------------------------------------------------

constexpr int64_t kLineFloats = 64 / sizeof(float);  // one cache line

// One step of the hot loop: NV vectors of B row k (f32, or f16 / bf16 panels widened as loaded),
// times each A row's element k broadcast (folded into the FMA's memory operand).
template <int R, class BT>
[[gnu::always_inline]] inline void micro_step(V (&acc)[R][kNV], const float* __restrict a, int64_t lda,
                                              const BT* __restrict b, int64_t k) {
  V bv[kNV];
#pragma GCC unroll 8
  for (int v = 0; v < kNV; ++v) bv[v] = Vec::load(b + k * kNR + v * kL);
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i) {
    const V ai = Vec::set1(a[i * lda + k]);
#pragma GCC unroll 8
    for (int v = 0; v < kNV; ++v) acc[i][v] = Vec::fma(ai, bv[v], acc[i][v]);
  }
}

#if defined(KILN_GEMM_BF16_DOT)
// An element of bf16 B panels in k pairs ([kc / 2][NR][2], PackedB's layout on this level).
struct bf16_pair_t {
  uint16_t bits;
};
// One k pair of such panels (k even), f32 products: the low halves (row k) widened and multiplied
// first, then the high halves (row k + 1), so each sum takes its products in the plain layout's
// order. `both` false: row k alone (an odd depth's last row; its pair's other half is padding).
template <int R>
[[gnu::always_inline]] inline void micro_step(V (&acc)[R][kNV], const float* __restrict a, int64_t lda,
                                              const bf16_pair_t* __restrict b, int64_t k, bool both = true) {
  __m512i w[kNV];
#pragma GCC unroll 8
  for (int v = 0; v < kNV; ++v) w[v] = _mm512_loadu_si512(b + (k * kNR + v * kL * 2));
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i) {
    const V ai = Vec::set1(a[i * lda + k]);
#pragma GCC unroll 8
    for (int v = 0; v < kNV; ++v) acc[i][v] = Vec::fma(ai, _mm512_castsi512_ps(_mm512_slli_epi32(w[v], 16)), acc[i][v]);
  }
  if (!both) return;
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i) {
    const V ai = Vec::set1(a[i * lda + k + 1]);
#pragma GCC unroll 8
    for (int v = 0; v < kNV; ++v) acc[i][v] = Vec::fma(ai, _mm512_castsi512_ps(_mm512_and_si512(w[v], high)), acc[i][v]);
  }
}
template <class BT> constexpr bool kPairedB = std::is_same_v<BT, bf16_pair_t>;
#else
template <class BT> constexpr bool kPairedB = false;
#endif

// C[R x nr] (+)= acc: stores the register tile, adding to what C holds when `accumulate`.
template <int R>
[[gnu::always_inline]] inline void store_tile(V (&acc)[R][kNV], float* c, int64_t ldc, int64_t nr, bool accumulate) {
  if (nr == kNR) {
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i)
#pragma GCC unroll 8
      for (int v = 0; v < kNV; ++v) {
        float* dst = c + i * ldc + v * kL;
        Vec::store(dst, accumulate ? Vec::add(acc[i][v], Vec::load(dst)) : acc[i][v]);
      }
    return;
  }
  alignas(64) float tile[R][kNR];
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i)
#pragma GCC unroll 8
    for (int v = 0; v < kNV; ++v) Vec::store(&tile[i][v * kL], acc[i][v]);
  for (int64_t i = 0; i < R; ++i)
    for (int64_t j = 0; j < nr; ++j) c[i * ldc + j] = accumulate ? c[i * ldc + j] + tile[i][j] : tile[i][j];
}

// The register tile's accumulators set to zero, and C's tile fetched: it is read (or written) after
// the loop.
template <int R> [[gnu::always_inline]] inline void start_tile(V (&acc)[R][kNV], const float* c, int64_t ldc) {
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i) {
#pragma GCC unroll 8
    for (int v = 0; v < kNV; ++v) acc[i][v] = Vec::zero();
#pragma GCC unroll 8
    for (int v = 0; v < kNV; ++v) _mm_prefetch(reinterpret_cast<const char*>(c + i * ldc + v * kL), _MM_HINT_T0);
  }
}

// C[R x nr] (+)= A[R rows, lda apart][kc] . Bp[kc][NR] (or bf16 k pairs). Meanwhile fetches
// `pf_lines` cache lines from `pf` into L2 (this call's share of the B micro-panel that comes next),
// one per k.
template <int R, class BT>
void micro_rows(int64_t kc, const float* __restrict a, int64_t lda, const BT* __restrict b, float* c,
                int64_t ldc, int64_t nr, bool accumulate, const BT* pf, int64_t pf_lines) {
  constexpr int64_t kLine = 64 / sizeof(BT);  // elements of B per cache line
  constexpr int64_t kStep = kPairedB<BT> ? 2 : 1;
  V acc[R][kNV];
  start_tile(acc, c, ldc);
  const int64_t steps = kc / kStep, fetching = lo(steps, (pf_lines + kStep - 1) / kStep);
  for (int64_t s = 0; s < fetching; ++s) {
#pragma GCC unroll 2
    for (int64_t j = 0; j < kStep; ++j) _mm_prefetch(reinterpret_cast<const char*>(pf + (s * kStep + j) * kLine), _MM_HINT_T1);
    micro_step(acc, a, lda, b, s * kStep);
  }
  for (int64_t s = fetching; s < steps; ++s) micro_step(acc, a, lda, b, s * kStep);
#if defined(KILN_GEMM_BF16_DOT)
  if constexpr (kPairedB<BT>)
    if (kc % 2) micro_step(acc, a, lda, b, kc - 1, /*both=*/false);
#endif
  store_tile(acc, c, ldc, nr, accumulate);
}

// f.template operator()<R>() with R = mr, 1..MR: a last, partial row tile runs a kernel of its own
// height, not the full one on zero rows.
template <class F> void with_rows(int64_t mr, F&& f) {
  static_assert(kMR == 6, "with_rows dispatches on 1..6 rows");
  switch (mr) {
    case 6: return f.template operator()<6>();
    case 5: return f.template operator()<5>();
    case 4: return f.template operator()<4>();
    case 3: return f.template operator()<3>();
    case 2: return f.template operator()<2>();
    default: return f.template operator()<1>();
  }
}

// C[mr x nr] (+)= A[mr rows, lda apart][kc] . Bp[kc][NR], for mr <= MR.
template <class BT>
void micro_f32(int64_t kc, const float* a, int64_t lda, const BT* b, float* c, int64_t ldc, int64_t mr,
               int64_t nr, bool accumulate, const BT* pf, int64_t pf_lines) {
  with_rows(mr, [&]<int R>() { micro_rows<R>(kc, a, lda, b, c, ldc, nr, accumulate, pf, pf_lines); });
}

// B[k0 + k, n0 + j] for k < kc, j < nc -> panels [ceil(nc / NR)][kc][NR] of f32, zero past nc.
template <class T> void pack_b_f32(const Problem& p, int64_t k0, int64_t kc, int64_t n0, int64_t nc, float* dst) {
  const T* B = static_cast<const T*>(p.b);
  for (int64_t j0 = 0; j0 < nc; j0 += kNR) {
    float* panel = dst + j0 / kNR * kc * kNR;
    const int64_t w = lo(kNR, nc - j0);
    if (p.b_col == 1) {  // rows of B contiguous: copy (and widen) NR-wide row pieces
      for (int64_t k = 0; k < kc; ++k) {
        const T* src = B + (k0 + k) * p.b_row + n0 + j0;
        float* d = panel + k * kNR;
        for (int64_t v = 0; v < kNV; ++v) {
          const int64_t have = w - v * kL;
          Vec::store(d + v * kL, have >= kL ? Vec::load(src + v * kL) : have > 0 ? load_partial(src + v * kL, have) : Vec::zero());
        }
      }
    } else if (p.b_row == 1) {  // columns of B contiguous (transpose_b): L x L register transposes
      int64_t k = 0;
      if (w == kNR) {
        for (; k + kL <= kc; k += kL)
          for (int64_t v = 0; v < kNV; ++v) {
            V r[kL];
            for (int j = 0; j < kL; ++j) r[j] = Vec::load(B + (n0 + j0 + v * kL + j) * p.b_col + k0 + k);
            Vec::transpose(r);
            for (int kk = 0; kk < kL; ++kk) Vec::store(panel + (k + kk) * kNR + v * kL, r[kk]);
          }
      }
      for (int64_t j = 0; j < kNR; ++j) {
        const T* src = B + (n0 + j0 + j) * p.b_col + k0;
        for (int64_t kk = k; kk < kc; ++kk) panel[kk * kNR + j] = j < w ? to_f32(src[kk]) : 0.0f;
      }
    } else {
      for (int64_t k = 0; k < kc; ++k)
        for (int64_t j = 0; j < kNR; ++j)
          panel[k * kNR + j] = j < w ? to_f32(B[(k0 + k) * p.b_row + (n0 + j0 + j) * p.b_col]) : 0.0f;
    }
  }
}

// B stored as Q8_0 rows (BStorage::q8_0): column n of B is weight row n, `p.b_col` bytes long.
struct Q8_0Rows {};

// Weight rows [n0, n0 + nc), depth [k0, k0 + kc) (k0 and kc multiples of 32) -> the f32 panels of
// pack_b_f32: L rows x L quants dequantized into registers, then transposed.
void pack_b_q8_0(const Problem& p, int64_t k0, int64_t kc, int64_t n0, int64_t nc, float* dst) {
  const uint8_t* B = static_cast<const uint8_t*>(p.b);
  for (int64_t j0 = 0; j0 < nc; j0 += kNR) {
    float* panel = dst + j0 / kNR * kc * kNR;
    const int64_t w = lo(kNR, nc - j0);
    for (int64_t v = 0; v < kNV; ++v)
      for (int64_t k = 0; k < kc; k += kL) {
        const int64_t block = (k0 + k) / 32, within = (k0 + k) % 32;
        V r[kL];
        for (int j = 0; j < kL; ++j) {
          const int64_t col = v * kL + j;
          if (col >= w) {
            r[j] = Vec::zero();
            continue;
          }
          const uint8_t* b = B + (n0 + j0 + col) * p.b_col + block * 34;
          uint16_t d;
          std::memcpy(&d, b, 2);
          r[j] = Vec::load_q8(b + 2 + within, _cvtsh_ss(d));
        }
        Vec::transpose(r);
        for (int kk = 0; kk < kL; ++kk) Vec::store(panel + (k + kk) * kNR + v * kL, r[kk]);
      }
  }
}

// A rows [m0, m0 + mr), depth [k0, k0 + kc) -> f32 [MR][kc], rows past mr zero.
template <class T> void pack_a_f32(const Problem& p, int64_t m0, int64_t mr, int64_t k0, int64_t kc, float* dst) {
  const T* A = static_cast<const T*>(p.a);
  for (int64_t i = 0; i < kMR; ++i) {
    float* d = dst + i * kc;
    if (i >= mr) {
      for (int64_t k = 0; k < kc; ++k) d[k] = 0.0f;
      continue;
    }
    const T* src = A + (m0 + i) * p.a_row + k0 * p.a_col;
    if (p.a_col == 1) {
      int64_t k = 0;
      for (; k + kL <= kc; k += kL) Vec::store(d + k, Vec::load(src + k));
      for (; k < kc; ++k) d[k] = to_f32(src[k]);
    } else {
      for (int64_t k = 0; k < kc; ++k) d[k] = to_f32(src[k * p.a_col]);
    }
  }
}

// Rows per block of A for a GEMM over `rows` rows: blocks of equal height in whole row tiles, at most
// kMC (a last block of a few rows would stream all of the B block for little work).
inline int64_t row_block(int64_t rows) {
  const int64_t tiles = (rows + kMR - 1) / kMR, blocks = (tiles * kMR + kMC - 1) / kMC;
  return (tiles + blocks - 1) / blocks * kMR;
}

// Panels taken together by one_row_on_panels. With AVX2's 2 vectors a panel, one panel at a time
// bound a Zen 3 core to the FMA's latency (2 chains): 51-53 GB/s from cache, 23 from DRAM
// (bench_quantized BM_f32_packed/1/*/1); 2 panels at once 63-70 and 28, 4 (8 chains, 4 forward
// streams) 74 and 27-30. AVX-512's 4 vectors a panel keep one (session 20's single stream, Zen 4).
constexpr int kRowPanels = kNV >= 4 ? 1 : 8 / kNV;

// One row of A (decode) times B packed ahead (f32 panels, or 16-bit ones widened as loaded), columns
// [n0, n1) of c: micro_rows<1>'s steps and sums (each depth block's from zero, added to the blocks'
// before it, as store_tile adds them to C) with every panel in one pass (kRowPanels of them side by
// side), its sums in registers, in a loop of its own. From DRAM that streams the panels faster than
// the tile machinery does: on Zen 4, stories110M f32 decode steps went from 84% to 89-90% of the same
// second's read bandwidth (medians, slow phase; docs/performance.md, session 27).
template <class BT>
void one_row_on_panels(const float* a, int64_t K, const BT* panels, int64_t panel_stride, int64_t n0, int64_t n1,
                       float* c) {
  constexpr int64_t kStep = kPairedB<BT> ? 2 : 1;
  // P panels from column n (the last may be partial), each summed exactly as alone.
  const auto run = [&]<int P>(int64_t n) {
    const BT* bp[P];
#pragma GCC unroll 4
    for (int q = 0; q < P; ++q) bp[q] = panels + (n / kNR + q) * panel_stride;
    V total[P][1][kNV];
    for (int64_t pc = 0; pc < K; pc += kKC) {
      const int64_t kc = lo(kKC, K - pc);
      V acc[P][1][kNV];
#pragma GCC unroll 4
      for (int q = 0; q < P; ++q)
#pragma GCC unroll 8
        for (int v = 0; v < kNV; ++v) acc[q][0][v] = Vec::zero();
      for (int64_t k = 0; k + kStep <= kc; k += kStep)
#pragma GCC unroll 4
        for (int q = 0; q < P; ++q) micro_step(acc[q], a + pc, K, bp[q] + pc * kNR, k);
#if defined(KILN_GEMM_BF16_DOT)
      if constexpr (kPairedB<BT>)
        if (kc % 2)
          for (int q = 0; q < P; ++q) micro_step(acc[q], a + pc, K, bp[q] + pc * kNR, kc - 1, /*both=*/false);
#endif
#pragma GCC unroll 4
      for (int q = 0; q < P; ++q)
#pragma GCC unroll 8
        for (int v = 0; v < kNV; ++v) total[q][0][v] = pc == 0 ? acc[q][0][v] : Vec::add(acc[q][0][v], total[q][0][v]);
    }
#pragma GCC unroll 4
    for (int q = 0; q < P; ++q) store_tile(total[q], c + n + q * kNR, 0, lo(kNR, n1 - n - q * kNR), /*accumulate=*/false);
  };
  int64_t n = n0;
  if constexpr (kRowPanels > 1)
    for (; n1 - n > (kRowPanels - 1) * kNR; n += kRowPanels * kNR) run.template operator()<kRowPanels>(n);
  for (; n < n1; n += kNR) run.template operator()<1>(n);
}

// gemm_f32 for one row tile (m1 - m0 <= kMR: decode, small batches) on B packed ahead: each B
// micro-panel is read over its whole depth before the next, and the panels lie one after another,
// so the weight is one forward stream that the hardware prefetcher follows with no help (the depth
// blocks of gemm_f32's order jump between micro-panels every kc rows). A's tile is packed over the
// whole depth (kMR x K, the workspace's size for one tile). Each sum takes its depth blocks in the
// same order as there, so a row's bits are the same.
template <class T, class TB>
void gemm_one_tile(const Problem& p, int64_t m0, int64_t m1, int64_t n0, int64_t n1, const Workspace& ws) {
  constexpr bool kF32 = std::is_same_v<T, float>;
  const int64_t mr = m1 - m0;
  pack_a_f32<T>(p, m0, mr, 0, p.K, ws.packed_a);
  auto stream = [&]<class BT>(const BT* panels, int64_t panel_stride) {
    if constexpr (kF32)
      if (mr == 1) {
        float* c = static_cast<float*>(p.c) + m0 * p.ldc;
        return one_row_on_panels(ws.packed_a, p.K, panels, panel_stride, n0, n1, c);
      }
    for (int64_t jc = n0; jc < n1; jc += kNC) {
      const int64_t nc = lo(kNC, n1 - jc);
      for (int64_t jr = 0; jr < nc; jr += kNR) {
        const BT* bp = panels + (jc + jr) / kNR * panel_stride;
        const int64_t nr = lo(kNR, nc - jr);
        for (int64_t pc = 0; pc < p.K; pc += kKC) {
          const int64_t kc = lo(kKC, p.K - pc);
          if constexpr (kF32)
            micro_f32(kc, ws.packed_a + pc, p.K, bp + pc * kNR, static_cast<float*>(p.c) + m0 * p.ldc + jc + jr, p.ldc,
                      mr, nr, pc > 0, static_cast<const BT*>(nullptr), 0);
          else
            micro_f32(kc, ws.packed_a + pc, p.K, bp + pc * kNR, ws.c_acc + jr, kNC, mr, nr, pc > 0,
                      static_cast<const BT*>(nullptr), 0);
        }
      }
      if constexpr (!kF32) store_rows(ws.c_acc, kNC, mr, nc, static_cast<T*>(p.c) + m0 * p.ldc + jc, p.ldc);
    }
  };
  if (p.packed_b) return stream(p.packed_b, p.K * kNR);
  if constexpr (std::is_same_v<TB, f16_t> || std::is_same_v<TB, bf16_t>) {  // gemm_f32's choice of layout
#if defined(KILN_GEMM_BF16_DOT)
    if constexpr (std::is_same_v<TB, bf16_t>)  // k pairs, the depth made even
      return stream(reinterpret_cast<const bf16_pair_t*>(p.packed_b_narrow), (p.K + 1) / 2 * 2 * kNR);
#endif
    stream(reinterpret_cast<const TB*>(p.packed_b_narrow), p.K * kNR);
  }
}

// Rows [m0, m1) x columns [n0, n1) of C, in blocks of NC columns, KC depth and MC rows. For each
// B micro-panel (kc x NR, in L2) the micro-kernel sweeps the block's rows, MR at a time, from the
// A block held in L2; B is read from memory once per row block. Every C element sums its
// products in the same order (k blocks in turn, k ascending within one) whether B was packed here
// or ahead (p.packed_b, or p.packed_b_narrow for f16 / bf16), so both give identical bits.
// T: A and C's element type; TB: B's (float, f16_t, bf16_t or Q8_0Rows), converted while packing.
template <class T, class TB = T>
void gemm_f32(const Problem& p, int64_t m0, int64_t m1, int64_t n0, int64_t n1, const Workspace& ws) {
  constexpr bool kF32 = std::is_same_v<T, float>;
  constexpr bool kNarrowB = std::is_same_v<TB, f16_t> || std::is_same_v<TB, bf16_t>;
  if (m1 - m0 <= kMR && (p.packed_b || (kNarrowB && p.packed_b_narrow))) return gemm_one_tile<T, TB>(p, m0, m1, n0, n1, ws);
  // A is packed per row block even when it could be read in place: rows a power of two apart would
  // share a few L2 sets, and the block would not stay in L2.
  const int64_t mc_step = row_block(m1 - m0);
  for (int64_t jc = n0; jc < n1; jc += kNC) {
    const int64_t nc = lo(kNC, n1 - jc);
    for (int64_t pc = 0; pc < p.K; pc += kKC) {
      const int64_t kc = lo(kKC, p.K - pc);
      // The block's micro-panels, `panel_stride` elements apart: packed ahead (f32, or f16 / bf16 as
      // stored, widened as loaded), or packed here. `ahead`: the ahead-packed whole, for the prefetch
      // of the next depth block.
      auto sweep = [&]<class BT>(const BT* b_block, int64_t panel_stride, const BT* ahead) {
        constexpr int64_t kLine = 64 / sizeof(BT);  // elements per cache line
        for (int64_t ic = m0; ic < m1; ic += mc_step) {
          const int64_t mc = lo(mc_step, m1 - ic);
          for (int64_t ir = 0; ir < mc; ir += kMR) pack_a_f32<T>(p, ic + ir, lo(kMR, mc - ir), pc, kc, ws.packed_a + ir * kc);
          for (int64_t jr = 0; jr < nc; jr += kNR) {
            const BT* bp = b_block + jr / kNR * panel_stride;
            const int64_t nr = lo(kNR, nc - jr);
            // The B micro-panel after this one (or the next depth block's first, when ahead-packed),
            // fetched into L2 a share per row tile: its first pass would otherwise wait on memory.
            const BT* next_b = jr + kNR < nc ? bp + panel_stride
                               : ahead && pc + kc < p.K ? ahead + jc / kNR * panel_stride + (pc + kc) * kNR
                                                        : nullptr;
            const int64_t next_lines = next_b ? (jr + kNR < nc ? kc : lo(kKC, p.K - pc - kc)) * kNR / kLine : 0;
            const int64_t tiles = (mc + kMR - 1) / kMR, lines_per_tile = (next_lines + tiles - 1) / tiles;
            for (int64_t ir = 0; ir < mc; ir += kMR) {
              const int64_t mr = lo(kMR, mc - ir);
              const float* a = ws.packed_a + ir * kc;
              const int64_t pf_first = lo(ir / kMR * lines_per_tile, next_lines);
              const BT* pf = next_b ? next_b + pf_first * kLine : nullptr;
              const int64_t pf_lines = lo(lines_per_tile, next_lines - pf_first);
              if constexpr (kF32)
                micro_f32(kc, a, kc, bp, static_cast<float*>(p.c) + (ic + ir) * p.ldc + jc + jr, p.ldc, mr, nr, pc > 0,
                          pf, pf_lines);
              else
                micro_f32(kc, a, kc, bp, ws.c_acc + (ic + ir - m0) * kNC + jr, kNC, mr, nr, pc > 0, pf, pf_lines);
            }
          }
        }
      };
      if (p.packed_b) {
        sweep(p.packed_b + jc / kNR * p.K * kNR + pc * kNR, p.K * kNR, p.packed_b);
      } else if (kNarrowB && p.packed_b_narrow) {
        if constexpr (kNarrowB) {
#if defined(KILN_GEMM_BF16_DOT)
          if constexpr (std::is_same_v<TB, bf16_t>) {  // k pairs, the depth made even
            const auto* pairs = reinterpret_cast<const bf16_pair_t*>(p.packed_b_narrow);
            const int64_t depth = (p.K + 1) / 2 * 2;
            sweep(pairs + jc / kNR * depth * kNR + pc * kNR, depth * kNR, pairs);
          } else
#endif
          {
            const TB* packed = reinterpret_cast<const TB*>(p.packed_b_narrow);
            sweep(packed + jc / kNR * p.K * kNR + pc * kNR, p.K * kNR, packed);
          }
        }
      } else {
        if constexpr (std::is_same_v<TB, Q8_0Rows>)
          pack_b_q8_0(p, pc, kc, jc, nc, ws.packed_b);
        else
          pack_b_f32<TB>(p, pc, kc, jc, nc, ws.packed_b);
        sweep(static_cast<const float*>(ws.packed_b), kc * kNR, static_cast<const float*>(nullptr));
      }
    }
    if constexpr (!kF32) store_rows(ws.c_acc, kNC, m1 - m0, nc, static_cast<T*>(p.c) + m0 * p.ldc + jc, p.ldc);
  }
}

// All of B -> [ceil(N / NR)][K][NR] (PackedB's layout): pack_b_f32 over the whole depth.
void pack_b_entry(const Problem& p, float* dst) {
  switch (p.b_storage) {
    case BStorage::f16: return pack_b_f32<f16_t>(p, 0, p.K, 0, p.N, dst);
    case BStorage::bf16: return pack_b_f32<bf16_t>(p, 0, p.K, 0, p.N, dst);
    case BStorage::same: return pack_b_f32<float>(p, 0, p.K, 0, p.N, dst);
    case BStorage::q8_0: return;
  }
}

// All of a 16-bit B (f16 / bf16 storage) -> [ceil(N / NR)][K][NR] of its elements as they are, zero
// past N: PackedB::narrow without k pairs. Weights have contiguous columns (transpose_b): each column's
// k pairs are 32-bit words, transposed 16 x 16, then every pair split into its rows k and k + 1.
void pack_b16_rows(const Problem& p, uint16_t* dst) {
  const auto* B = static_cast<const uint16_t*>(p.b);
  for (int64_t j0 = 0; j0 < p.N; j0 += kNR) {
    uint16_t* panel = dst + j0 / kNR * p.K * kNR;
    const int64_t w = lo(kNR, p.N - j0);
    int64_t k = 0;
#if defined(KILN_GEMM_AVX512)
    if (p.b_row == 1 && w == kNR) {
      // Lane 2j + h of a transposed vector (column j's pair) -> lane 16h + j (row k + h, column j).
      const __m512i split = _mm512_set_epi16(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1, 30, 28, 26, 24,
                                             22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
      for (; k + 2 * kL <= p.K; k += 2 * kL)
        for (int64_t v = 0; v < kNV; ++v) {
          __m512 r[kL];
          for (int j = 0; j < kL; ++j) r[j] = _mm512_loadu_ps(reinterpret_cast<const float*>(B + (j0 + v * kL + j) * p.b_col + k));
          Vec::transpose(r);
          for (int q = 0; q < kL; ++q) {
            const __m512i rows = _mm512_permutexvar_epi16(split, _mm512_castps_si512(r[q]));
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(panel + (k + 2 * q) * kNR + v * kL), _mm512_castsi512_si256(rows));
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(panel + (k + 2 * q + 1) * kNR + v * kL),
                                _mm512_extracti64x4_epi64(rows, 1));
          }
        }
    }
#endif
    for (; k < p.K; ++k) {
      uint16_t* row = panel + k * kNR;
      if (p.b_col == 1) {
        std::memcpy(row, B + k * p.b_row + j0, static_cast<size_t>(w) * sizeof(uint16_t));
      } else {
        for (int64_t j = 0; j < w; ++j) row[j] = B[k * p.b_row + (j0 + j) * p.b_col];
      }
      std::fill(row + w, row + kNR, uint16_t{0});
    }
  }
}

// ---- bf16 x bf16 with vdpbf16ps ---------------------------------------------------------------------

#if defined(KILN_GEMM_BF16_DOT)
// C[R x nr] (+)= A[R rows of bf16, lda apart][kpairs * 2] . Bp[kpairs][NR][2]: each step takes one k
// pair, a 32-bit broadcast of each A row's pair against NV vectors of 16 B pairs. Meanwhile fetches
// `pf_lines` cache lines from `pf` into L2, two per step (as micro_rows).
template <int R>
void micro_dot_rows(int64_t kpairs, const uint16_t* __restrict a, int64_t lda, const uint16_t* __restrict b, float* c,
                    int64_t ldc, int64_t nr, bool accumulate, const uint16_t* pf, int64_t pf_lines) {
  V acc[R][kNV];
  start_tile(acc, c, ldc);
  auto step = [&](int64_t q) {
    __m512i bv[kNV];
#pragma GCC unroll 8
    for (int v = 0; v < kNV; ++v) bv[v] = _mm512_loadu_si512(b + (q * kNR + v * kL) * 2);
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
      uint32_t pair;
      std::memcpy(&pair, a + i * lda + 2 * q, sizeof(pair));
      const __m512i ai = _mm512_set1_epi32(static_cast<int>(pair));
#pragma GCC unroll 8
      for (int v = 0; v < kNV; ++v) acc[i][v] = _mm512_dpbf16_ps(acc[i][v], (__m512bh)ai, (__m512bh)bv[v]);
    }
  };
  const int64_t fetching = lo(kpairs, (pf_lines + 1) / 2);
  for (int64_t q = 0; q < fetching; ++q) {
    _mm_prefetch(reinterpret_cast<const char*>(pf + 2 * q * 32), _MM_HINT_T1);
    _mm_prefetch(reinterpret_cast<const char*>(pf + (2 * q + 1) * 32), _MM_HINT_T1);
    step(q);
  }
  for (int64_t q = fetching; q < kpairs; ++q) step(q);
  store_tile(acc, c, ldc, nr, accumulate);
}

// micro_dot_rows for mr <= MR rows (A holds only those).
void micro_dot(int64_t mr, int64_t kpairs, const uint16_t* a, int64_t lda, const uint16_t* b, float* c, int64_t ldc,
               int64_t nr, bool accumulate, const uint16_t* pf = nullptr, int64_t pf_lines = 0) {
  with_rows(mr, [&]<int R>() { micro_dot_rows<R>(kpairs, a, lda, b, c, ldc, nr, accumulate, pf, pf_lines); });
}

// B[k0 + k, n0 + j] (bf16) -> panels [ceil(nc / NR)][ceil(kc / 2)][NR][2], zero past kc and nc.
void pack_b_bf16(const Problem& p, int64_t k0, int64_t kc, int64_t n0, int64_t nc, uint16_t* dst) {
  const uint16_t* B = static_cast<const uint16_t*>(p.b);
  const int64_t kp = (kc + 1) / 2;
  for (int64_t j0 = 0; j0 < nc; j0 += kNR) {
    uint16_t* panel = dst + j0 / kNR * kp * kNR * 2;
    const int64_t w = lo(kNR, nc - j0);
    int64_t q = 0;
    // transpose_b with even row stride and start: each k pair is one 32-bit word of a B column.
    if (p.b_row == 1 && w == kNR) {
      for (; 2 * q + 2 * kL <= kc; q += kL)
        for (int64_t v = 0; v < kNV; ++v) {
          __m512 r[kL];
          for (int j = 0; j < kL; ++j) r[j] = _mm512_loadu_ps(reinterpret_cast<const float*>(B + (n0 + j0 + v * kL + j) * p.b_col + k0 + 2 * q));
          Vec::transpose(r);
          for (int qq = 0; qq < kL; ++qq) _mm512_storeu_ps(reinterpret_cast<float*>(panel + ((q + qq) * kNR + v * kL) * 2), r[qq]);
        }
    } else if (p.b_col == 1 && w == kNR) {
      // Row-major B: interleave rows k and k + 1 (16-bit lanes from two sources).
      const __m512i lo_idx = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38,
                                              6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
      const __m512i hi_idx = _mm512_add_epi16(lo_idx, _mm512_set1_epi16(16));
      for (; 2 * q + 2 <= kc; ++q) {
        const uint16_t* r0 = B + (k0 + 2 * q) * p.b_row + n0 + j0;
        const uint16_t* r1 = r0 + p.b_row;
        for (int64_t v = 0; v < kNV; v += 2) {  // 32 columns of each row at a time
          const __m512i x0 = _mm512_loadu_si512(r0 + v * kL), x1 = _mm512_loadu_si512(r1 + v * kL);
          _mm512_storeu_si512(panel + (q * kNR + v * kL) * 2, _mm512_permutex2var_epi16(x0, lo_idx, x1));
          _mm512_storeu_si512(panel + (q * kNR + v * kL) * 2 + 32, _mm512_permutex2var_epi16(x0, hi_idx, x1));
        }
      }
    }
    for (; q < kp; ++q)
      for (int64_t j = 0; j < kNR; ++j)
        for (int64_t h = 0; h < 2; ++h) {
          const int64_t k = 2 * q + h;
          panel[(q * kNR + j) * 2 + h] = (j < w && k < kc) ? B[(k0 + k) * p.b_row + (n0 + j0 + j) * p.b_col] : 0;
        }
  }
}

// A rows [m0, m0 + mr), depth [k0, k0 + kc) -> bf16 [MR][kc rounded up to even], zero padded.
void pack_a_bf16(const Problem& p, int64_t m0, int64_t mr, int64_t k0, int64_t kc, uint16_t* dst) {
  const uint16_t* A = static_cast<const uint16_t*>(p.a);
  const int64_t ld = (kc + 1) / 2 * 2;
  for (int64_t i = 0; i < kMR; ++i) {
    uint16_t* d = dst + i * ld;
    for (int64_t k = 0; k < ld; ++k) d[k] = (i < mr && k < kc) ? A[(m0 + i) * p.a_row + (k0 + k) * p.a_col] : 0;
  }
}

void gemm_bf16(const Problem& p, int64_t m0, int64_t m1, int64_t n0, int64_t n1, const Workspace& ws) {
  constexpr int64_t kKCPairs = 2 * kKC;  // same bytes per packed B row as f32
  const uint16_t* A = static_cast<const uint16_t*>(p.a);
  uint16_t* packed_b = reinterpret_cast<uint16_t*>(ws.packed_b);
  uint16_t* packed_a = reinterpret_cast<uint16_t*>(ws.packed_a);
  for (int64_t jc = n0; jc < n1; jc += kNC) {
    const int64_t nc = lo(kNC, n1 - jc);
    for (int64_t pc = 0; pc < p.K; pc += kKCPairs) {
      const int64_t kc = lo(kKCPairs, p.K - pc);
      const int64_t kp = (kc + 1) / 2;
      pack_b_bf16(p, pc, kc, jc, nc, packed_b);
      for (int64_t ir = m0; ir < m1; ir += kMR) {
        const int64_t mr = lo(kMR, m1 - ir);
        const uint16_t* a;
        int64_t lda;
        if (p.a_col == 1 && kc % 2 == 0 && p.a_row % 2 == 0) {  // pairs read in place
          a = A + ir * p.a_row + pc;
          lda = p.a_row;
        } else {
          pack_a_bf16(p, ir, mr, pc, kc, packed_a);
          a = packed_a;
          lda = kp * 2;
        }
        for (int64_t jr = 0; jr < nc; jr += kNR)
          micro_dot(mr, kp, a, lda, packed_b + jr / kNR * kp * kNR * 2, ws.c_acc + (ir - m0) * kNC + jr, kNC,
                    lo(kNR, nc - jr), pc > 0);
      }
    }
    store_rows(ws.c_acc, kNC, m1 - m0, nc, static_cast<bf16_t*>(p.c) + m0 * p.ldc + jc, p.ldc);
  }
}

// f32 A rows [m0, m0 + mc), depth [k0, k0 + kc) -> bf16 rows of kc rounded up to even (zero
// padded), rounded to nearest even as vcvtneps2bf16 does (denormals to zero).
void pack_a_rounded_bf16(const Problem& p, int64_t m0, int64_t mc, int64_t k0, int64_t kc, uint16_t* dst) {
  const float* A = static_cast<const float*>(p.a);
  const int64_t ld = (kc + 1) / 2 * 2;
  for (int64_t i = 0; i < mc; ++i) {
    uint16_t* d = dst + i * ld;
    const float* row = A + (m0 + i) * p.a_row + k0 * p.a_col;
    if (p.a_col == 1) {
      for (int64_t k = 0; k < ld; k += kL) {
        const __mmask16 in = static_cast<__mmask16>(k + kL <= kc ? 0xFFFF : k < kc ? (1u << (kc - k)) - 1 : 0);
        const __mmask16 out = static_cast<__mmask16>(k + kL <= ld ? 0xFFFF : (1u << (ld - k)) - 1);
        const __m256bh h = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(in, row + k));
        _mm256_mask_storeu_epi16(d + k, out, (__m256i)h);
      }
      continue;
    }
    alignas(64) float column[kL];
    for (int64_t k = 0; k < ld; k += kL) {
      for (int64_t j = 0; j < kL; ++j) column[j] = k + j < kc ? row[(k + j) * p.a_col] : 0.0f;
      const __mmask16 out = static_cast<__mmask16>(k + kL <= ld ? 0xFFFF : (1u << (ld - k)) - 1);
      _mm256_mask_storeu_epi16(d + k, out, (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(column)));
    }
  }
}

// f32 A x bf16 B -> f32 C, above kBf16DotMinRows rows: each A block rounded to bf16 once, then
// vdpbf16ps against B in k pairs, packed ahead (PackedB's layout here) or per block here. Loops and
// prefetch as gemm_f32's (depth blocks of the same bytes: 2 * kKC k of bf16); every row's sums are
// taken in one order whatever M, the rows around it, and whether B was packed ahead.
void gemm_dot_bf16(const Problem& p, int64_t m0, int64_t m1, int64_t n0, int64_t n1, const Workspace& ws) {
  constexpr int64_t kKCDot = 2 * kKC;
  const uint16_t* ahead = p.packed_b_narrow;
  const int64_t depth = (p.K + 1) / 2 * 2;
  uint16_t* packed_a = reinterpret_cast<uint16_t*>(ws.packed_a);
  const int64_t mc_step = row_block(m1 - m0);
  float* C = static_cast<float*>(p.c);
  for (int64_t jc = n0; jc < n1; jc += kNC) {
    const int64_t nc = lo(kNC, n1 - jc);
    for (int64_t pc = 0; pc < p.K; pc += kKCDot) {
      const int64_t kc = lo(kKCDot, p.K - pc), kp = (kc + 1) / 2;
      // The block's micro-panels, panel_stride elements apart.
      const uint16_t* block = ahead ? ahead + jc / kNR * depth * kNR + pc * kNR : reinterpret_cast<uint16_t*>(ws.packed_b);
      const int64_t panel_stride = ahead ? depth * kNR : kp * kNR * 2;
      if (!ahead) pack_b_bf16(p, pc, kc, jc, nc, reinterpret_cast<uint16_t*>(ws.packed_b));
      for (int64_t ic = m0; ic < m1; ic += mc_step) {
        const int64_t mc = lo(mc_step, m1 - ic);
        pack_a_rounded_bf16(p, ic, mc, pc, kc, packed_a);
        for (int64_t jr = 0; jr < nc; jr += kNR) {
          const uint16_t* bp = block + jr / kNR * panel_stride;
          // The next B micro-panel (or, packed ahead, the next depth block's first), fetched into L2
          // a share per row tile.
          const uint16_t* next_b = jr + kNR < nc           ? bp + panel_stride
                                   : ahead && pc + kc < p.K ? ahead + jc / kNR * depth * kNR + (pc + kc) * kNR
                                                            : nullptr;
          const int64_t next_pairs = jr + kNR < nc ? kp : (lo(kKCDot, p.K - pc - kc) + 1) / 2;
          const int64_t next_lines = next_b ? next_pairs * kNR * 2 / 32 : 0;
          const int64_t tiles = (mc + kMR - 1) / kMR, lines_per_tile = (next_lines + tiles - 1) / tiles;
          for (int64_t ir = 0; ir < mc; ir += kMR) {
            const int64_t pf_first = lo(ir / kMR * lines_per_tile, next_lines);
            micro_dot(lo(kMR, mc - ir), kp, packed_a + ir * kp * 2, kp * 2, bp, C + (ic + ir) * p.ldc + jc + jr, p.ldc,
                      lo(kNR, nc - jr), pc > 0, next_b ? next_b + pf_first * 32 : nullptr,
                      lo(lines_per_tile, next_lines - pf_first));
          }
        }
      }
    }
  }
}
#endif

// ---- small M (decode): stream B once ---------------------------------------------------------------

// The M rows of A as contiguous f32 [M][K]: in place when already so, else converted into `buf`.
template <class T> const float* rows_f32(const Problem& p, float* buf) {
  if constexpr (std::is_same_v<T, float>)
    if (p.a_col == 1 && (p.M == 1 || p.a_row == p.K)) return static_cast<const float*>(p.a);
  const T* A = static_cast<const T*>(p.a);
  for (int64_t m = 0; m < p.M; ++m)
    for (int64_t k = 0; k < p.K; ++k) buf[m * p.K + k] = to_f32(A[m * p.a_row + k * p.a_col]);
  return buf;
}

template <class T> void store_one(const Problem& p, int64_t m, int64_t n, float v) {
  T* c = static_cast<T*>(p.c) + m * p.ldc + n;
  if constexpr (std::is_same_v<T, float>)
    *c = v;
  else if constexpr (std::is_same_v<T, f16_t>)
    c->bits = f32_to_f16(v);
  else
    c->bits = f32_to_bf16(v);
}

// The weight rows `cols` (B with contiguous columns, transpose_b), each dotted with all M rows of x:
// every weight byte is read once; x stays in L1/L2. `ahead` is the software prefetch distance in
// elements, the same position of a later row.
template <class T, int M, int R, class TB = T>
void dot_rows(const Problem& p, const float* x, const int64_t (&cols)[R], int64_t ahead) {
  const TB* B = static_cast<const TB*>(p.b);
  const int64_t K = p.K, kv = K / kL * kL;
  V acc[M][R];
#pragma GCC unroll 8
  for (int m = 0; m < M; ++m)
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) acc[m][r] = Vec::zero();
  const TB* row[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) row[r] = B + cols[r] * p.b_col;
  for (int64_t k = 0; k < kv; k += kL) {
    V w[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      _mm_prefetch(reinterpret_cast<const char*>(row[r] + k + ahead), _MM_HINT_T0);
      w[r] = Vec::load(row[r] + k);
    }
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      const V xv = Vec::load(x + m * K + k);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) acc[m][r] = Vec::fma(xv, w[r], acc[m][r]);
    }
  }
  if (kv < K) {
    V w[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) w[r] = load_partial(row[r] + kv, K - kv);
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      const V xv = load_partial(x + m * K + kv, K - kv);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) acc[m][r] = Vec::fma(xv, w[r], acc[m][r]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) store_one<T>(p, m, cols[r], Vec::sum(acc[m][r]));
}

// Prefetch distance for groups of `rows` adjacent weight rows: the same position of a later group,
// at least 4 KiB ahead (about what one core needs in flight to keep DRAM streaming). With short rows
// (K of a few hundred) a fixed distance within a row would land in rows the group already loads.
template <class TB> int64_t rows_ahead(const Problem& p, int64_t rows) {
  const int64_t group_bytes = rows * p.b_col * static_cast<int64_t>(sizeof(TB)) + 1;  // b_col is 0 when N == 1
  return rows * p.b_col * ((4096 + group_bytes - 1) / group_bytes);
}

// Weight rows n..n_end, R adjacent rows at a time.
template <class T, int M, int R, class TB = T>
void dot_columns(const Problem& p, const float* x, int64_t n, int64_t n_end) {
  const int64_t ahead = rows_ahead<TB>(p, R);
  for (; n + R <= n_end; n += R) {
    int64_t cols[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) cols[r] = n + r;
    dot_rows<T, M, R, TB>(p, x, cols, ahead);
  }
  if constexpr (R > 1) dot_columns<T, M, 1, TB>(p, x, n, n_end);
}

// Weight rows n..n_end as S far-apart streams: the range cut into S equal parts, one row of each per
// group. Each stream is its own run of addresses for the hardware prefetcher, so more lines are in
// flight than with S adjacent rows, whose one run moves a page at a time (llama-1B GEMVs on 2
// threads: 2-8% faster from DRAM). The rows left over go R at a time; the sums are the same either way.
template <class T, int M, int S, class TB = T>
void dot_streams(const Problem& p, const float* x, int64_t n, int64_t n_end) {
  const int64_t part = (n_end - n) / S, ahead = rows_ahead<TB>(p, 1);
  for (int64_t i = 0; i < part; ++i) {
    int64_t cols[S];
#pragma GCC unroll 8
    for (int s = 0; s < S; ++s) cols[s] = n + s * part + i;
    dot_rows<T, M, S, TB>(p, x, cols, ahead);
  }
  dot_columns<T, M, 4, TB>(p, x, n + S * part, n_end);
}

#if defined(KILN_GEMM_BF16_DOT)
// bf16 x bf16 dot products with vdpbf16ps: adjacent k are the pairs it multiplies, so neither side
// is converted. `x` is the M rows of A as bf16 [M][K].
template <int M, int R>
void dot_columns_bf16(const Problem& p, const uint16_t* x, int64_t n, int64_t n_end) {
  const uint16_t* B = static_cast<const uint16_t*>(p.b);
  const int64_t K = p.K, kv = K / 32 * 32;
  const __mmask32 tail = static_cast<__mmask32>((uint64_t{1} << (K - kv)) - 1);
  for (; n + R <= n_end; n += R) {
    __m512 acc[M][R];
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m)
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();
    const uint16_t* row[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) row[r] = B + (n + r) * p.b_col;
    for (int64_t k = 0; k < kv; k += 32) {
      __m512i w[R];
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        _mm_prefetch(reinterpret_cast<const char*>(row[r] + k) + 1024, _MM_HINT_T0);
        w[r] = _mm512_loadu_si512(row[r] + k);
      }
#pragma GCC unroll 8
      for (int m = 0; m < M; ++m) {
        const __m512i xv = _mm512_loadu_si512(x + m * K + k);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], (__m512bh)xv, (__m512bh)w[r]);
      }
    }
    if (kv < K) {
      __m512i w[R];
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) w[r] = _mm512_maskz_loadu_epi16(tail, row[r] + kv);
#pragma GCC unroll 8
      for (int m = 0; m < M; ++m) {
        const __m512i xv = _mm512_maskz_loadu_epi16(tail, x + m * K + kv);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], (__m512bh)xv, (__m512bh)w[r]);
      }
    }
    for (int m = 0; m < M; ++m)
      for (int r = 0; r < R; ++r) store_one<bf16_t>(p, m, n + r, _mm512_reduce_add_ps(acc[m][r]));
  }
  if constexpr (R > 1) dot_columns_bf16<M, 1>(p, x, n, n_end);
}
#endif

// B with contiguous rows ([K, N]): NV vectors of columns at a time, accumulating x[m, k] * B[k, :]
// over k in registers, so each B row piece is read once for all M rows.
template <class T, int M, int NV, class TB = T>
int64_t axpy_columns(const Problem& p, const float* x, int64_t n, int64_t n_end) {
  const TB* B = static_cast<const TB*>(p.b);
  for (; n + NV * kL <= n_end; n += NV * kL) {
    V acc[M][NV];
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m)
#pragma GCC unroll 8
      for (int v = 0; v < NV; ++v) acc[m][v] = Vec::zero();
    for (int64_t k = 0; k < p.K; ++k) {
      const TB* src = B + k * p.b_row + n;
      V w[NV];
#pragma GCC unroll 8
      for (int v = 0; v < NV; ++v) w[v] = Vec::load(src + v * kL);
#pragma GCC unroll 8
      for (int m = 0; m < M; ++m) {
        const V xv = Vec::set1(x[m * p.K + k]);
#pragma GCC unroll 8
        for (int v = 0; v < NV; ++v) acc[m][v] = Vec::fma(xv, w[v], acc[m][v]);
      }
    }
    alignas(64) float out[NV * kL];
    for (int m = 0; m < M; ++m) {
#pragma GCC unroll 8
      for (int v = 0; v < NV; ++v) Vec::store(out + v * kL, acc[m][v]);
      for (int j = 0; j < NV * kL; ++j) store_one<T>(p, m, n + j, out[j]);
    }
  }
  return n;
}

template <class T, int M, class TB = T>
void small_m_rows(const Problem& p, const float* x, int64_t n0, int64_t n1) {
  if (p.b_row == 1) {
    if constexpr (M == 1)
      dot_streams<T, M, 8, TB>(p, x, n0, n1);
    else
      dot_columns<T, M, (M <= 2 ? 4 : 2), TB>(p, x, n0, n1);
    return;
  }
  int64_t n = axpy_columns<T, M, (M <= 4 ? 4 : 2), TB>(p, x, n0, n1);
  n = axpy_columns<T, M, 1, TB>(p, x, n, n1);
  const TB* B = static_cast<const TB*>(p.b);
  for (; n < n1; ++n)  // the last columns one at a time, with the same fused multiply-add as above
    for (int m = 0; m < M; ++m) {
      float s = 0.0f;
      for (int64_t k = 0; k < p.K; ++k) s = __builtin_fmaf(x[m * p.K + k], to_f32(B[k * p.b_row + n]), s);
      store_one<T>(p, m, n, s);
    }
}

template <class T, int M, class TB = T>
void small_m_dispatch(const Problem& p, const float* x, int64_t n0, int64_t n1) {
  if constexpr (M <= kSmallM) {
    if (p.M == M) return small_m_rows<T, M, TB>(p, x, n0, n1);
    small_m_dispatch<T, M + 1, TB>(p, x, n0, n1);
  }
}

template <class T, class TB = T> bool small_m_typed(const Problem& p, int64_t n0, int64_t n1, const Workspace& ws) {
  if (p.b_row != 1 && p.b_col != 1) return false;
#if defined(KILN_GEMM_BF16_DOT)
  if constexpr (std::is_same_v<T, bf16_t> && std::is_same_v<TB, bf16_t>) {
    if (p.b_row == 1) {
      const uint16_t* x = static_cast<const uint16_t*>(p.a);
      if (!(p.a_col == 1 && (p.M == 1 || p.a_row == p.K))) {
        uint16_t* buf = reinterpret_cast<uint16_t*>(ws.packed_a);
        for (int64_t m = 0; m < p.M; ++m)
          for (int64_t k = 0; k < p.K; ++k) buf[m * p.K + k] = x[m * p.a_row + k * p.a_col];
        x = buf;
      }
      switch (p.M) {
        case 1: dot_columns_bf16<1, 4>(p, x, n0, n1); break;
        case 2: dot_columns_bf16<2, 4>(p, x, n0, n1); break;
        case 3: dot_columns_bf16<3, 2>(p, x, n0, n1); break;
        case 4: dot_columns_bf16<4, 2>(p, x, n0, n1); break;
        case 5: dot_columns_bf16<5, 2>(p, x, n0, n1); break;
        case 6: dot_columns_bf16<6, 2>(p, x, n0, n1); break;
        case 7: dot_columns_bf16<7, 2>(p, x, n0, n1); break;
        default: dot_columns_bf16<8, 2>(p, x, n0, n1); break;
      }
      return true;
    }
  }
#endif
  const float* x = rows_f32<T>(p, ws.packed_a);
  if (p.M <= kSmallM) {
    small_m_dispatch<T, 1, TB>(p, x, n0, n1);
    return true;
  }
  // More rows (f16 / bf16 weights, gemm.h's kNarrowSmallMMax): chunks of at most kSmallM rows, as
  // even as possible, each over a block of columns whose weights (kNarrowBlockBytes) stay in L2
  // while every chunk reads them, so the weight comes from memory once. Each row's sums are the
  // chunk kernel's, which are the M = 1 kernel's.
  constexpr int64_t kNarrowBlockBytes = 256 << 10;
  const int64_t chunks = (p.M + kSmallM - 1) / kSmallM;
  const int64_t column_bytes = p.K * static_cast<int64_t>(sizeof(TB));
  const int64_t fit = kNarrowBlockBytes / (column_bytes + 1) / 16 * 16;  // whole vectors of 16 columns
  const int64_t block = fit > 16 ? fit : 16;
  for (int64_t nb = n0; nb < n1; nb += block) {
    const int64_t ne = lo(n1, nb + block);
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t m0 = c * p.M / chunks, m1 = (c + 1) * p.M / chunks;
      Problem rows = p;
      rows.M = m1 - m0;
      rows.c = static_cast<T*>(p.c) + m0 * p.ldc;
      small_m_dispatch<T, 1, TB>(rows, x + m0 * p.K, nb, ne);
    }
  }
  return true;
}

// ---- entry points -------------------------------------------------------------------------------------

void gemm_entry(const Problem& p, int64_t m0, int64_t m1, int64_t n0, int64_t n1, const Workspace& ws) {
  switch (p.b_storage) {  // f32 activations with narrow or quantized weights
    case BStorage::f16: return gemm_f32<float, f16_t>(p, m0, m1, n0, n1, ws);
    case BStorage::bf16:
#if defined(KILN_GEMM_BF16_DOT)
      if (p.M > kBf16DotMinRows) return gemm_dot_bf16(p, m0, m1, n0, n1, ws);
#endif
      return gemm_f32<float, bf16_t>(p, m0, m1, n0, n1, ws);
    case BStorage::q8_0: return gemm_f32<float, Q8_0Rows>(p, m0, m1, n0, n1, ws);
    case BStorage::same: break;
  }
  switch (p.dtype) {
    case DType::f32: return gemm_f32<float>(p, m0, m1, n0, n1, ws);
    case DType::f16: return gemm_f32<f16_t>(p, m0, m1, n0, n1, ws);
#if defined(KILN_GEMM_BF16_DOT)
    case DType::bf16: return gemm_bf16(p, m0, m1, n0, n1, ws);
#else
    case DType::bf16: return gemm_f32<bf16_t>(p, m0, m1, n0, n1, ws);
#endif
    default: return;
  }
}

bool small_m_entry(const Problem& p, int64_t n0, int64_t n1, const Workspace& ws) {
  switch (p.b_storage) {
    case BStorage::f16: return small_m_typed<float, f16_t>(p, n0, n1, ws);
    case BStorage::bf16: return small_m_typed<float, bf16_t>(p, n0, n1, ws);
    case BStorage::q8_0: return false;
    case BStorage::same: break;
  }
  switch (p.dtype) {
    case DType::f32: return small_m_typed<float>(p, n0, n1, ws);
    case DType::f16: return small_m_typed<f16_t>(p, n0, n1, ws);
    case DType::bf16: return small_m_typed<bf16_t>(p, n0, n1, ws);
    default: return false;
  }
}

// All of a 16-bit B -> PackedB::narrow's layout: in k pairs (`pairs`, bf16 on a vdpbf16ps level) or not.
void pack_b_narrow_entry(const Problem& p, bool pairs, uint16_t* dst) {
#if defined(KILN_GEMM_BF16_DOT)
  if (pairs) return pack_b_bf16(p, 0, p.K, 0, p.N, dst);
#endif
  (void)pairs;  // only a vdpbf16ps level packs in pairs (IsaKernels::bf16_pairs)
  pack_b16_rows(p, dst);
}

constexpr Blocking kBlocking{kMR, kNR, kKC, kMC, kNC};
