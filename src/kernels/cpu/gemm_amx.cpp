// The AMX bf16 GEMM of gemm_amx.h. Standard headers first, then the target pragma for the tile
// code only (see gemm.h on why the pragma follows every standard header).
//
// f32 activations (bf16 weights) take the same path: rounded to bf16 while A is copied into the tile
// layout, and the f32 C tiles stored unrounded.
//
// Blocking: 8 tiles make a 2 x 2 block, 2 A tiles (32 rows x 32 of K) times 2 B tiles (32 of K x 32
// columns) into 4 f32 C tiles (32 x 32), one tile load per tdpbf16ps. A is copied once per call into
// the same tile-row layout (every tile 1 KiB contiguous, zero-padded in M and K), which handles
// every tail and stride in one place and keeps tile loads off the 4 KiB-aliasing row strides of
// power-of-two K. The tile unit is fed at full rate only from L1, so the order of the blocks keeps
// one operand's tiles there (run_part); K beyond 2048 is cut into slices so that a slice of A stays
// in L2 as well. docs/amx.md has the measurements behind these choices.
#include "kernels/cpu/gemm_amx.h"
#include "kernels/cpu/scratch.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <new>
#include <type_traits>

#include "kernels/cpu/strided.h"
#include "kernels/cpu/vector_math.h"
#include "kiln/errors.h"

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace kiln::kernels::amx {
namespace {

constexpr int64_t kTileElems = kTileRows * kTileK;  // bf16 values in one A or B tile
constexpr int64_t kBlockRows = 2 * kTileRows;       // rows of C per 2 x 2 block
// Multiply-adds per part below which a second thread costs more than it saves.
constexpr int64_t kMinMacsPerPart = int64_t{1} << 20;
// Bytes of packed B a column group may take (kept in the 2 MiB L2 beside A's traffic).
constexpr int64_t kGroupBytes = int64_t{1} << 20;
// K tiles per slice: a longer K is cut so that a slice of A's row blocks stays in L2 too, the
// partial f32 C blocks going through memory between slices (exactly: the bits do not change).
constexpr int64_t kSliceKTiles = 64;
// Row blocks per pass over one K slice (bounds the partial C buffer at 256 KiB per group of 8 pairs).
constexpr int64_t kSliceRowBlocks = 8;
// Bytes of packed A a part's K slice may take to run B-major (A kept in L2, B streamed once).
constexpr int64_t kAInL2Bytes = int64_t{1} << 20;
// Bytes of partial f32 C blocks a B-major part with K slices keeps between slices.
constexpr int64_t kPartialBytes = int64_t{1} << 20;

std::atomic<bool> g_disabled{false};

#if defined(__x86_64__)
bool cpu_and_os_allow_amx() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
  const bool amx_bf16 = (edx >> 22) & 1, amx_tile = (edx >> 24) & 1;
  if (!amx_bf16 || !amx_tile) return false;
  // The packing and output rounding use AVX-512 F/BW/VL and BF16 (every AMX CPU has them).
  if (!__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512bw") ||
      !__builtin_cpu_supports("avx512vl") || !__builtin_cpu_supports("avx512bf16"))
    return false;
  // Linux keeps the 8 KiB tile state off until a process asks for it (5.16+).
  constexpr long kArchGetXcompPerm = 0x1022, kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  if (syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) != 0) return false;
  unsigned long permitted = 0;
  if (syscall(SYS_arch_prctl, kArchGetXcompPerm, &permitted) != 0) return false;
  return (permitted >> kXfeatureXtiledata) & 1;
}
#else
bool cpu_and_os_allow_amx() { return false; }
#endif

thread_local AlignedScratch<uint16_t> t_packed_a;
thread_local AlignedScratch<float> t_c_partial;  // f32 C blocks between K slices

// Offset of row block `mb` in the packed A: every block reserves two tiles per K tile.
int64_t packed_a_offset(int64_t mb, int64_t k_tiles) { return mb * k_tiles * 2 * kTileElems; }

}  // namespace

// ---- the tile code -------------------------------------------------------------------------------

#if defined(__x86_64__)
#ifndef __clang__
#pragma GCC push_options
#endif
// The AVX-512 intrinsics' deliberately undefined placeholders (`__m512i __Y = __Y` in
// _mm512_unpacklo_epi32) read as uninitialized once inlined at -O2 (as in gemm_avx512_bf16.cpp).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#ifdef __clang__  // clang has no GCC target pragma; this is its equivalent
#pragma clang attribute push(__attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma"))), apply_to = function)
#else
#pragma GCC target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma")
#endif
namespace {

// ldtilecfg's 64-byte operand: palette 1, every tile 16 rows x 64 bytes.
struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};
static_assert(sizeof(TileConfig) == 64);

// Tiles 0..3: C (row tile * 2 + column tile); 4, 5: A; 6, 7: B.
void load_tile_config() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = kTileRows;
  }
  // Not _tile_loadconfig: GCC 12 declares its asm operand as 8 bytes of the config, so the stores
  // above may be dropped as dead once inlined (tile_chains got an all-zero config and faulted).
  asm volatile("ldtilecfg %0" : : "m"(cfg));
}

// 16 floats -> bf16, round to nearest even; NaN stays NaN (quiet), as f32_to_bf16 does.
__m256i round_to_bf16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_or_si512(bits, _mm512_set1_epi32(0x400000)));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
}

// One 64-byte row of a packed A tile: 32 values of K from k0 (width of them valid, the rest zero)
// of the A row at src; f32 values rounded to bf16 to nearest even (as f32_to_bf16).
void pack_a_chunk(const uint16_t* src, int64_t a_col, int64_t width, uint16_t* d) {
  if (a_col == 1) {
    const __mmask32 valid = width >= 32 ? ~__mmask32{0} : (__mmask32{1} << width) - 1;
    _mm512_storeu_si512(d, _mm512_maskz_loadu_epi16(valid, src));
  } else {
    for (int64_t k = 0; k < width; ++k) d[k] = src[k * a_col];
    std::fill(d + width, d + kTileK, uint16_t{0});
  }
}
void pack_a_chunk(const float* src, int64_t a_col, int64_t width, uint16_t* d) {
  if (a_col == 1) {
    // The masked-off lanes load as 0.0f, which rounds to bf16 zero: the K padding.
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(d), round_to_bf16(_mm512_maskz_loadu_ps(vmath::first_lanes(width), src)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + 16),
                        round_to_bf16(_mm512_maskz_loadu_ps(vmath::first_lanes(width - 16), src + 16)));
  } else {
    for (int64_t k = 0; k < width; ++k) d[k] = f32_to_bf16(src[k * a_col]);
    std::fill(d + width, d + kTileK, uint16_t{0});
  }
}

// Copies row block `mb` of A (bf16, or f32 rounded to bf16) into the tile layout [k_tiles][a_tiles]
// [16 rows][32 of K], zero-padded in M and K, one 64-byte tile row at a time. All of it before the
// blocks that read it: packing a share per K step beside the tile products (as PendingStore does)
// measured ~5% slower on 1024^3 than packing up front (docs/amx.md).
template <class AT>
void pack_a_block(const AT* a, int64_t a_row, int64_t a_col, int64_t M, int64_t K, int64_t mb, uint16_t* dst) {
  const int64_t m0 = mb * kBlockRows, rows = std::min(kBlockRows, M - m0);
  const int64_t k_tiles = (K + kTileK - 1) / kTileK, tile_rows = (rows + kTileRows - 1) / kTileRows * kTileRows;
  const int64_t tile_step = tile_rows * kTileK;  // from one K tile of the block to the next
  for (int64_t r = 0; r < tile_rows; ++r) {
    uint16_t* d = dst + r * kTileK;
    if (r >= rows) {
      for (int64_t kt = 0; kt < k_tiles; ++kt) _mm512_storeu_si512(d + kt * tile_step, _mm512_setzero_si512());
      continue;
    }
    const AT* src = a + (m0 + r) * a_row;
    for (int64_t kt = 0; kt < k_tiles; ++kt)
      pack_a_chunk(src + kt * kTileK * a_col, a_col, std::min(kTileK, K - kt * kTileK), d + kt * tile_step);
  }
}

// A finished f32 C block (rows from m0, columns from n0) still to be written to C, rounded to bf16
// (uint16_t C) or as accumulated (float C). The next block writes it a few rows per K step, so the
// vector work overlaps that block's tile products instead of waiting between blocks.
template <class CT>
struct PendingStore {
  const float* block = nullptr;  // [2][2][16][16], null when nothing is pending
  int mt_count = 0, nt_count = 0;
  int64_t m0 = 0, n0 = 0, M = 0, N = 0, ldc = 0;
  CT* c = nullptr;
  int done_rows = 0;  // rows of the block written so far

  int rows() const { return block ? mt_count * kTileRows : 0; }
  // Writes the block's rows up to (not including) `end`.
  void write_rows(int end) {
    for (; done_rows < std::min(end, rows()); ++done_rows) {
      const int mt = done_rows / kTileRows, r = done_rows % kTileRows;
      const int64_t m = m0 + done_rows;
      if (m >= M) continue;
      const float* row = block + (mt * 2 * kTileRows + r) * kTileRows;  // + nt * 256: column tile nt
      for (int nt = 0; nt < nt_count; ++nt) {
        const int64_t n = n0 + nt * kTileRows;
        const int64_t cols = std::min<int64_t>(kTileRows, N - n);
        if (cols <= 0) break;
        const __mmask16 valid = vmath::first_lanes(cols);
        const __m512 v = _mm512_loadu_ps(row + nt * kTileRows * kTileRows);
        // vcvtneps2bf16 rounds to nearest even and keeps NaN quiet, as f32_to_bf16 (and round_to_bf16,
        // in ~8 fewer instructions beside the tile products); it reads denormals as zero, but
        // tdpbf16ps never produces one. (One 64-byte store per row after vcvtne2ps2bf16 measured
        // slower for a prefill's C, rows 16 KiB apart.)
        if constexpr (std::is_same_v<CT, float>)
          _mm512_mask_storeu_ps(c + m * ldc + n, valid, v);
        else
          _mm256_mask_storeu_epi16(c + m * ldc + n, valid, reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
      }
    }
  }
  void finish() {
    write_rows(rows());
    block = nullptr;
  }
};

// Which operand a block loads with the streaming hint (tileloaddt1): the one the next block does
// not reuse, so that its lines do not push the reused operand's tiles out of L1. A tile load that
// hits L1 is free beside tdpbf16ps; when both operands come from L2 the kernel runs at ~73% of the
// tile peak, when one of them stays in L1 at ~90% (docs/amx.md).
enum class Streamed { a, b };

// Cache lines of the next block's operand to pull into L2 while this block runs: `lines` lines from
// each of `from[0]` and (when not null) `from[1]`, spread over the block's K steps.
struct NextPanel {
  const char* from[2] = {nullptr, nullptr};
  int64_t lines = 0;
};

// Work a block does a share of per K step, beside its tile products (which the tile unit runs on
// its own, so this vector work overlaps them instead of waiting between blocks): prefetching the
// next block's panel into L2, writing the previous block's C.
template <class CT>
struct Background {
  NextPanel next;
  PendingStore<CT> store;
};

// C block [MT * 16, NT * 16] (+)= A block . B tiles over k_tiles K tiles, in c [MT][NT][16][16]
// floats: added to what c holds when `accumulate`, else overwriting it. `backwards` walks K from the
// last tile down: a block that follows one sharing its A (or B) then starts on the tiles that block
// used last, still in L1. The caller fixes the direction per C block from its indices, so the bits
// do not depend on the thread split. `bg`'s work is done on the way (all of it by the return).
template <int MT, int NT, Streamed S, class CT>
void multiply_block(const uint16_t* a, int64_t a_step, const uint16_t* b0, const uint16_t* b1, int64_t k_tiles,
                    bool backwards, float* c, bool accumulate, Background<CT>& bg) {
  if (accumulate) {
    _tile_loadd(0, c, 64);
    if constexpr (NT == 2) _tile_loadd(1, c + 256, 64);
    if constexpr (MT == 2) _tile_loadd(2, c + 512, 64);
    if constexpr (MT == 2 && NT == 2) _tile_loadd(3, c + 768, 64);
  } else {
    _tile_zero(0);
    if constexpr (NT == 2) _tile_zero(1);
    if constexpr (MT == 2) _tile_zero(2);
    if constexpr (MT == 2 && NT == 2) _tile_zero(3);
  }
  const NextPanel& next = bg.next;
  const int64_t prefetch_per_step = (next.lines + k_tiles - 1) / k_tiles;
  const int store_per_step = static_cast<int>((bg.store.rows() + k_tiles - 1) / k_tiles);
  for (int64_t step = 0; step < k_tiles; ++step) {
    const int64_t kt = backwards ? k_tiles - 1 - step : step;
    const uint16_t* ak = a + kt * a_step;
    // GCC's tile intrinsics paste the tile number into the asm text, so it must be a literal here.
    if constexpr (S == Streamed::a)
      _tile_stream_loadd(4, ak, 64);
    else
      _tile_loadd(4, ak, 64);
    if constexpr (S == Streamed::b)
      _tile_stream_loadd(6, b0 + kt * kTileElems, 64);
    else
      _tile_loadd(6, b0 + kt * kTileElems, 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (NT == 2) {
      if constexpr (S == Streamed::b)
        _tile_stream_loadd(7, b1 + kt * kTileElems, 64);
      else
        _tile_loadd(7, b1 + kt * kTileElems, 64);
      _tile_dpbf16ps(1, 4, 7);
    }
    if constexpr (MT == 2) {
      if constexpr (S == Streamed::a)
        _tile_stream_loadd(5, ak + kTileElems, 64);
      else
        _tile_loadd(5, ak + kTileElems, 64);
      _tile_dpbf16ps(2, 5, 6);
      if constexpr (NT == 2) _tile_dpbf16ps(3, 5, 7);
    }
    for (int64_t l = step * prefetch_per_step, end = std::min(next.lines, l + prefetch_per_step); l < end; ++l) {
      _mm_prefetch(next.from[0] + l * 64, _MM_HINT_T1);
      if (next.from[1]) _mm_prefetch(next.from[1] + l * 64, _MM_HINT_T1);
    }
    if (bg.store.block) bg.store.write_rows(static_cast<int>(step + 1) * store_per_step);
  }
  bg.store.finish();
  _tile_stored(0, c, 64);
  if constexpr (NT == 2) _tile_stored(1, c + 256, 64);
  if constexpr (MT == 2) _tile_stored(2, c + 512, 64);
  if constexpr (MT == 2 && NT == 2) _tile_stored(3, c + 768, 64);
}

// Row blocks [mb0, mb1) x column-tile pairs [np0, np1) of C (bf16 or f32), on the calling thread.
// `a` (A as given, element (m, k) at a[m * a_row + k * a_col]) is not null when this part packs its
// own rows of A into packed_a (no other part reads them); else packed_a is ready.
//
// Each 2 x 2 block keeps its C tiles over a whole K slice (reloading C costs ~16 tdpbf16ps slots of
// drain, zeroing ~6). Consecutive blocks share one operand, loaded normally and walked in alternating
// K directions so the next block starts on its tiles still in L1; the other operand is streamed
// (tileloaddt1) and the next block's panel of it is brought into L2 meanwhile:
//  - B-major (the part's A slice fits in L2: few rows, e.g. a prefill): for each column pair, every
//    row block; B shared, A streamed, the next column pair's B prefetched.
//  - A-major (more rows): per group of column pairs whose B stays in L2, for each row block, every
//    pair of the group; A shared, B streamed, the next row block's A prefetched.
template <class AT, class CT>
void run_part(const AT* a_source, int64_t a_row, int64_t a_col, uint16_t* packed_a, int64_t M, const PackedB& b,
              int64_t mb0, int64_t mb1, int64_t np0, int64_t np1, CT* c, int64_t ldc) {
  const int64_t K = b.K(), k_tiles = b.k_tiles(), n_tiles = b.n_tiles();
  const int64_t slice = std::min(k_tiles, kSliceKTiles), slices = (k_tiles + slice - 1) / slice;
  const int64_t panel_bytes = slice * 2 * kTileElems * 2;  // one row block's (or column pair's) K slice
  const int64_t row_chunk = slices == 1 ? mb1 - mb0 : kSliceRowBlocks;
  const bool b_major = std::min(row_chunk, mb1 - mb0) * panel_bytes <= kAInL2Bytes;
  constexpr int64_t kBlockFloats = 4 * kTileRows * kTileRows;
  const int64_t group = b_major ? (slices == 1 ? np1 - np0
                                               : std::max<int64_t>(1, kPartialBytes / (row_chunk * kBlockFloats * 4)))
                                : std::max<int64_t>(1, kGroupBytes / panel_bytes);
  if (a_source)
    for (int64_t mb = mb0; mb < mb1; ++mb)
      pack_a_block(a_source, a_row, a_col, M, K, mb, packed_a + packed_a_offset(mb, k_tiles));
  float* partial = t_c_partial.get(static_cast<size_t>((slices == 1 ? 2 : row_chunk * group) * kBlockFloats));
  int c_buffer = 0;  // with one K slice: which of the two block buffers the next block fills
  load_tile_config();
  Background<CT> bg;
  bg.store.M = M;
  bg.store.N = b.N();
  bg.store.c = c;
  bg.store.ldc = ldc;
  constexpr int64_t kLine = 64;
  for (int64_t g0 = np0; g0 < np1; g0 += group) {
    const int64_t g1 = std::min(np1, g0 + group);
    for (int64_t r0 = mb0; r0 < mb1; r0 += row_chunk) {
      const int64_t r1 = std::min(mb1, r0 + row_chunk);
      for (int64_t s = 0; s < slices; ++s) {
        const int64_t kt0 = s * slice, depth = std::min(slice, k_tiles - kt0);
        const bool last = s + 1 == slices;
        const auto block = [&](int64_t mb, int64_t np) {
          const int64_t rows = std::min(kBlockRows, M - mb * kBlockRows);
          const int mt_count = rows > kTileRows ? 2 : 1;
          const int64_t a_step = mt_count * kTileElems;
          const uint16_t* a = packed_a + packed_a_offset(mb, k_tiles) + kt0 * a_step;
          const int64_t nt = 2 * np;
          const int nt_count = nt + 1 < n_tiles ? 2 : 1;
          const uint16_t* b0 = b.tile(nt, kt0);
          const uint16_t* b1 = nt_count == 2 ? b.tile(nt + 1, kt0) : b0;
          float* c_block = slices == 1 ? partial + c_buffer * kBlockFloats
                                       : partial + ((mb - r0) * group + (np - g0)) * kBlockFloats;
          const bool backwards = ((mb + np) & 1) != 0, accumulate = s > 0;
          // The block's tile counts and streamed operand as template arguments.
          const auto multiply = [&]<Streamed kS>() {
            if (mt_count == 2 && nt_count == 2)
              multiply_block<2, 2, kS>(a, a_step, b0, b1, depth, backwards, c_block, accumulate, bg);
            else if (mt_count == 2)
              multiply_block<2, 1, kS>(a, a_step, b0, b1, depth, backwards, c_block, accumulate, bg);
            else if (nt_count == 2)
              multiply_block<1, 2, kS>(a, a_step, b0, b1, depth, backwards, c_block, accumulate, bg);
            else
              multiply_block<1, 1, kS>(a, a_step, b0, b1, depth, backwards, c_block, accumulate, bg);
          };
          if (b_major)
            multiply.template operator()<Streamed::a>();
          else
            multiply.template operator()<Streamed::b>();
          if (last) {  // written during the next block (or at the end)
            bg.store.block = c_block;
            bg.store.mt_count = mt_count;
            bg.store.nt_count = nt_count;
            bg.store.m0 = mb * kBlockRows;
            bg.store.n0 = nt * kTileRows;
            bg.store.done_rows = 0;
            if (slices == 1) c_buffer ^= 1;  // the pending block keeps its buffer until the next one is done
          }
        };
        if (b_major) {
          // The next pair's B slice (two column tiles of `depth` tiles each), a share per row block.
          const int64_t tile_lines = depth * kTileElems * 2 / kLine, share = (tile_lines + (r1 - r0) - 1) / (r1 - r0);
          for (int64_t np = g0; np < g1; ++np)
            for (int64_t mb = r0; mb < r1; ++mb) {
              bg.next = NextPanel{};
              const int64_t first = (mb - r0) * share;
              if (np + 1 < g1 && first < tile_lines) {
                const int64_t nt = 2 * (np + 1);
                bg.next.from[0] = reinterpret_cast<const char*>(b.tile(nt, kt0)) + first * kLine;
                if (nt + 1 < n_tiles)
                  bg.next.from[1] = reinterpret_cast<const char*>(b.tile(nt + 1, kt0)) + first * kLine;
                bg.next.lines = std::min(share, tile_lines - first);
              }
              block(mb, np);
            }
        } else {
          // The next row block's A slice, prefetched a share per column pair.
          for (int64_t mb = r0; mb < r1; ++mb) {
            const bool has_next = mb + 1 < r1;
            const int64_t next_rows = has_next ? std::min(kBlockRows, M - (mb + 1) * kBlockRows) : 0;
            const int64_t next_step = next_rows > kTileRows ? 2 * kTileElems : kTileElems;
            const int64_t panel_lines = depth * next_step * 2 / kLine,
                          share = (panel_lines + (g1 - g0) - 1) / (g1 - g0);
            for (int64_t np = g0; np < g1; ++np) {
              bg.next = NextPanel{};
              const int64_t first = (np - g0) * share;
              if (has_next && first < panel_lines) {
                bg.next.from[0] = reinterpret_cast<const char*>(packed_a + packed_a_offset(mb + 1, k_tiles) +
                                                                kt0 * next_step) +
                                  first * kLine;
                bg.next.lines = std::min(share, panel_lines - first);
              }
              block(mb, np);
            }
          }
        }
      }
    }
  }
  bg.store.finish();
  _tile_release();
}

// One full B tile from a weight whose K runs along memory (b_row == 1): rows n of 32 bf16 = 16
// dwords (K pairs) become rows kp of the tile, a 16 x 16 transpose of dwords.
void pack_full_tile_k_contiguous(const uint16_t* w, int64_t w_row, uint16_t* tile) {
  __m512i r[16], t[16], c[16];
  for (int n = 0; n < 16; ++n) r[n] = _mm512_loadu_si512(w + n * w_row);
  for (int i = 0; i < 8; ++i) {  // lane L of t[2i]: pairs 4L, 4L+1 of rows 2i, 2i+1; t[2i+1]: 4L+2, 4L+3
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int g = 0; g < 4; ++g) {  // c[4g + j], lane L: pair 4L + j of rows 4g .. 4g + 3
    c[4 * g + 0] = _mm512_unpacklo_epi64(t[4 * g], t[4 * g + 2]);
    c[4 * g + 1] = _mm512_unpackhi_epi64(t[4 * g], t[4 * g + 2]);
    c[4 * g + 2] = _mm512_unpacklo_epi64(t[4 * g + 1], t[4 * g + 3]);
    c[4 * g + 3] = _mm512_unpackhi_epi64(t[4 * g + 1], t[4 * g + 3]);
  }
  for (int j = 0; j < 4; ++j) {  // a 4 x 4 transpose of 128-bit lanes: tile row 4L + j
    const __m512i x0 = _mm512_shuffle_i32x4(c[j], c[4 + j], 0x44),
                  x1 = _mm512_shuffle_i32x4(c[j], c[4 + j], 0xEE);
    const __m512i x2 = _mm512_shuffle_i32x4(c[8 + j], c[12 + j], 0x44),
                  x3 = _mm512_shuffle_i32x4(c[8 + j], c[12 + j], 0xEE);
    _mm512_storeu_si512(tile + (0 + j) * 32, _mm512_shuffle_i32x4(x0, x2, 0x88));
    _mm512_storeu_si512(tile + (4 + j) * 32, _mm512_shuffle_i32x4(x0, x2, 0xDD));
    _mm512_storeu_si512(tile + (8 + j) * 32, _mm512_shuffle_i32x4(x1, x3, 0x88));
    _mm512_storeu_si512(tile + (12 + j) * 32, _mm512_shuffle_i32x4(x1, x3, 0xDD));
  }
}


// `iterations` rounds of 4 independent tdpbf16ps on tiles that never leave the unit (no memory
// traffic): the tile unit's peak, for `kiln bench gemm`. Returns the FLOPs done.
double tile_chains(int64_t iterations) {
  alignas(64) static const uint16_t zeros[kTileRows * kTileK] = {};
  load_tile_config();
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  _tile_loadd(4, zeros, 64);
  _tile_loadd(5, zeros, 64);
  _tile_loadd(6, zeros, 64);
  _tile_loadd(7, zeros, 64);
  for (int64_t i = 0; i < iterations; ++i) {
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  _tile_release();
  return static_cast<double>(iterations) * 4 * 2 * kTileRows * kTileRows * kTileK;
}

}  // namespace
#pragma GCC diagnostic pop
#ifdef __clang__
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#endif

// ---- public ----------------------------------------------------------------------------------------

bool available() {
  static const bool allowed = cpu_and_os_allow_amx();
  return allowed && !g_disabled.load(std::memory_order_relaxed);
}

void disable_for_testing(bool disabled) { g_disabled.store(disabled, std::memory_order_relaxed); }

void PackedB::Free::operator()(uint16_t* p) const { std::free(p); }

PackedB PackedB::pack(const KernelContext& ctx, const uint16_t* b, int64_t b_row, int64_t b_col, int64_t K,
                      int64_t N) {
  PackedB packed;
  packed.K_ = K;
  packed.N_ = N;
  const size_t bytes = std::max<size_t>(64, packed.bytes());
  void* memory = allocate_aligned(bytes);
  if (!memory) throw std::bad_alloc();
  packed.data_.reset(static_cast<uint16_t*>(memory));
  const int64_t k_tiles = packed.k_tiles();
  parallel_for(ctx, packed.n_tiles(), 1, [&](int64_t begin, int64_t end) {
    for (int64_t nt = begin; nt < end; ++nt) {
      const int64_t n0 = nt * kTileRows, cols = std::min(kTileRows, N - n0);
      for (int64_t kt = 0; kt < k_tiles; ++kt) {
        uint16_t* tile = const_cast<uint16_t*>(packed.tile(nt, kt));  // [16 pairs][16 columns][2]
        const int64_t k0 = kt * kTileK, depth = std::min(kTileK, K - k0);
        const uint16_t* src = b + k0 * b_row + n0 * b_col;
#if defined(__x86_64__)
        if (b_row == 1 && cols == kTileRows && depth == kTileK) {  // a Linear's weight [N, K]
          pack_full_tile_k_contiguous(src, b_col, tile);
          continue;
        }
#endif
        if (cols < kTileRows || depth < kTileK) std::fill(tile, tile + kTileElems, uint16_t{0});
        for (int64_t k = 0; k < depth; ++k) {
          uint16_t* row = tile + (k / 2) * kTileK + k % 2;
          for (int64_t n = 0; n < cols; ++n) row[n * 2] = src[k * b_row + n * b_col];
        }
      }
    }
  });
  return packed;
}

namespace {

// C = A . B for A bf16 or f32 (rounded to bf16 while packed) and C bf16 or f32.
template <class AT, class CT>
void gemm_on_tiles(const KernelContext& ctx, const AT* a, int64_t a_row, int64_t a_col, int64_t M, const PackedB& b,
                   CT* c, int64_t ldc) {
#if defined(__x86_64__)
  if (!available()) throw ValueError("amx::gemm: AMX-BF16 is not available on this CPU or OS");
  if (M <= 0 || b.N() <= 0) return;
  const int64_t K = b.K(), k_tiles = b.k_tiles();
  const int64_t m_blocks = (M + kBlockRows - 1) / kBlockRows;
  uint16_t* packed_a = t_packed_a.get(static_cast<size_t>(packed_a_offset(m_blocks, k_tiles)));
  // One part per thread, over column-tile pairs when there are enough, else over row blocks: every
  // C block is computed the same way whichever part holds it, so the bits do not depend on threads.
  const int64_t n_pairs = (b.n_tiles() + 1) / 2;
  const int threads = ctx.parallel ? ctx.parallel->num_threads() : 1;
  const int64_t parts = std::clamp<int64_t>(M * b.N() * std::max<int64_t>(K, 1) / kMinMacsPerPart, 1,
                                            std::min<int64_t>(threads, std::max(n_pairs, m_blocks)));
  const bool split_columns = parts > 1 && (n_pairs >= parts * 2 || n_pairs >= m_blocks);
  // Parts that share rows of A need it packed first; a part that owns its rows packs them itself.
  if (split_columns)
    parallel_for(ctx, m_blocks,
                 std::max<int64_t>(1, kElementwiseGrain / (kBlockRows * std::max<int64_t>(K, 1))),
                 [&](int64_t begin, int64_t end) {
                   for (int64_t mb = begin; mb < end; ++mb)
                     pack_a_block(a, a_row, a_col, M, K, mb, packed_a + packed_a_offset(mb, k_tiles));
                 });
  const AT* own_rows = split_columns ? nullptr : a;
  auto part = [&](int64_t t) {
    if (split_columns)
      run_part(own_rows, a_row, a_col, packed_a, M, b, 0, m_blocks, t * n_pairs / parts, (t + 1) * n_pairs / parts,
               c, ldc);
    else
      run_part(own_rows, a_row, a_col, packed_a, M, b, t * m_blocks / parts, (t + 1) * m_blocks / parts, 0, n_pairs,
               c, ldc);
  };
  if (parts == 1) {
    part(0);
    return;
  }
  ctx.parallel->for_range(parts, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) part(t);
  });
#else
  (void)ctx, (void)a, (void)a_row, (void)a_col, (void)M, (void)b, (void)c, (void)ldc;
  throw ValueError("amx::gemm: AMX-BF16 is not available on this CPU");
#endif
}

}  // namespace

void gemm(const KernelContext& ctx, const uint16_t* a, int64_t a_row, int64_t a_col, int64_t M,
          const PackedB& b, uint16_t* c, int64_t ldc) {
  gemm_on_tiles(ctx, a, a_row, a_col, M, b, c, ldc);
}

void gemm(const KernelContext& ctx, const float* a, int64_t a_row, int64_t a_col, int64_t M, const PackedB& b,
          float* c, int64_t ldc) {
  gemm_on_tiles(ctx, a, a_row, a_col, M, b, c, ldc);
}

std::optional<PackedRhs> pack_matmul_rhs(const TensorView& lhs, const TensorView& w, bool transpose_b) {
  if (!available()) return std::nullopt;
  if ((lhs.dtype != DType::bf16 && lhs.dtype != DType::f32) || w.dtype != DType::bf16 || w.shape.size() != 2 ||
      w.data == nullptr)
    return std::nullopt;
  const int64_t K = transpose_b ? w.shape[1] : w.shape[0], N = transpose_b ? w.shape[0] : w.shape[1];
  const int64_t b_row = transpose_b ? w.strides[1] : w.strides[0],
                b_col = transpose_b ? w.strides[0] : w.strides[1];
  if (K == 0 || N == 0) return std::nullopt;
  if (!lhs.shape.empty()) {  // a static lhs: skip decode-only steps and mismatches (the kernel reports those)
    int64_t rows = 1;
    for (size_t d = 0; d + 1 < lhs.shape.size(); ++d) rows *= lhs.shape[d];
    if (rows <= kMinRows || lhs.shape.back() != K) return std::nullopt;
  }
  SerialParallel serial;
  return PackedRhs{w.data, b_row, b_col,
                   PackedB::pack(KernelContext{&serial}, static_cast<const uint16_t*>(w.data), b_row, b_col, K, N)};
}

double run_tile_chains(int64_t iterations) {
  if (!available()) throw ValueError("amx::run_tile_chains: AMX-BF16 is not available on this CPU");
#if defined(__x86_64__)
  return tile_chains(iterations);
#else
  (void)iterations;
  return 0;
#endif
}

}  // namespace kiln::kernels::amx
