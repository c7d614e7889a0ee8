// CPU kernels of the paged KV cache ops (vLLM's PagedAttention): paged_kv_store(cache, value, slots)
// {layer} and paged_attention(q, k_cache, v_cache, block_tables, seq_ids, positions) {layer, scale,
// and optionally window (sliding-window attention) and softcap (Gemma 2's tanh logit capping)}.
// A cache is [layers, num_blocks, block_size, kv_heads, head_dim] in f32, bf16 or f16.
//
// paged_attention is attention.cpp's online (flash-style) softmax over a block table: the work is
// split into units of (kv heads, run of up to kRunTokens consecutive tokens of one sequence), shared
// out between threads. A unit walks its sequence's blocks once, each block for all its kv heads in
// turn; every query head of the GQA group and every token of the run reuse each K and V block while
// it is in L1. A cache with contiguous elements is read in place (the AVX-512 and AVX2 paths widen
// bf16 / f16 as they load; the scalar path converts half caches to f32 rows per block), and the SIMD
// paths prefetch the next block. Decode (one token per sequence) has one unit per token, or per part of its kv heads
// when there are too few tokens to share out.
//
// Batch invariance: a token's arithmetic is a function of its own sequence and position only. It
// visits its blocks in order, from its window's first (0 without a window) to position / block_size,
// and in each block exactly its visible keys, with loops whose trip counts are those keys' count; the
// other tokens of its unit only share the tiles. So a token gives the same bits alone, in a prefill chunk or in any batch.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include <fmt/format.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "kernels/cpu/convert.h"
#include "kernels/cpu/kernels.h"
#include "kernels/cpu/strided.h"
#include "kernels/cpu/vector_math.h"

namespace kiln::kernels {
namespace {

using graph::Op;

constexpr int64_t kRunTokens = 8;  // tokens of one sequence per unit (a prefill chunk's run); decode has one

// ---- operands ------------------------------------------------------------------------------------

// A cache's shape, checked: rank 5, a float dtype the kernels convert, `layer` one of its layers.
struct CacheDims {
  int64_t layers, blocks, block_size, kv_heads, head_dim;
};

CacheDims check_cache(Op op, const TensorView& cache, const char* name, int64_t layer) {
  if (cache.shape.size() != 5)
    throw ShapeError(fmt::format("{}: {} must be [layers, num_blocks, block_size, kv_heads, head_dim], got {}",
                                 graph::op_name(op), name, describe(cache)));
  if (cache.dtype != DType::f32 && cache.dtype != DType::bf16 && cache.dtype != DType::f16)
    throw DTypeError(fmt::format("{}: {} must be f32, bf16 or f16, got {}", graph::op_name(op), name, describe(cache)));
  const CacheDims d{cache.shape[0], cache.shape[1], cache.shape[2], cache.shape[3], cache.shape[4]};
  if (layer < 0 || layer >= d.layers)
    throw ExecutionError(fmt::format("{}: layer {} is outside the {} layers of {} {}", graph::op_name(op), layer,
                                     d.layers, name, describe(cache)));
  return d;
}

void check_index(Op op, const TensorView& t, const char* name, size_t rank, const char* shape) {
  if (t.dtype != DType::i64 || t.shape.size() != rank)
    throw DTypeError(fmt::format("{}: {} must be i64{}, got {}", graph::op_name(op), name, shape, describe(t)));
}

int64_t at1(const TensorView& t, int64_t i) { return t.as<int64_t>()[i * t.strides[0]]; }
int64_t at2(const TensorView& t, int64_t i, int64_t j) { return t.as<int64_t>()[i * t.strides[0] + j * t.strides[1]]; }

// Element offset of cache[layer, block, row, head, 0].
int64_t cache_row(const TensorView& cache, int64_t layer, int64_t block, int64_t row, int64_t head) {
  return layer * cache.strides[0] + block * cache.strides[1] + row * cache.strides[2] + head * cache.strides[3];
}

// Calls f.template operator()<T>() with T the element type of a cache dtype (f32, bf16, f16).
template <class F> decltype(auto) visit_cache_dtype(DType dtype, F&& f) {
  switch (dtype) {
    case DType::bf16: return f.template operator()<bf16_t>();
    case DType::f16: return f.template operator()<f16_t>();
    default: return f.template operator()<float>();
  }
}

// ---- paged_kv_store --------------------------------------------------------------------------------

struct StoreParams {
  int64_t layer;
  explicit StoreParams(const KernelInit& init) : layer(init.attr<int64_t>("layer")) {}
};

template <class C, class V>
void store_rows(const KernelContext& ctx, const TensorView& cache, const TensorView& value,
                const std::vector<int64_t>& slots, int64_t layer) {
  const int64_t tokens = value.shape[0], kv_heads = value.shape[1], hd = value.shape[2];
  const int64_t block_size = cache.shape[2];
  C* cache_data = cache.as<C>();
  const V* value_data = value.as<V>();
  const int64_t grain = std::max<int64_t>(1, kElementwiseGrain / std::max<int64_t>(1, kv_heads * hd));
  parallel_for(ctx, tokens, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = slots[static_cast<size_t>(t)];
      if (slot < 0) continue;
      for (int64_t h = 0; h < kv_heads; ++h) {
        C* dst = cache_data + cache_row(cache, layer, slot / block_size, slot % block_size, h);
        const V* src = value_data + t * value.strides[0] + h * value.strides[1];
        for (int64_t i = 0; i < hd; ++i) dst[i * cache.strides[4]] = convert<C>(src[i * value.strides[2]]);
      }
    }
  });
}

void paged_kv_store_kernel(const KernelContext& ctx, const StoreParams& params, std::span<const TensorView> inputs,
                           std::span<const TensorView> outputs) {
  if (inputs.size() != 3 || !outputs.empty())
    throw ValueError(fmt::format("paged_kv_store: expected 3 operands (cache, value, slots) and no results, got {} "
                                 "and {}",
                                 inputs.size(), outputs.size()));
  const TensorView &cache = inputs[0], &value = inputs[1], &slots = inputs[2];
  const CacheDims d = check_cache(Op::paged_kv_store, cache, "cache", params.layer);
  if (value.shape.size() != 3 || value.shape[1] != d.kv_heads || value.shape[2] != d.head_dim)
    throw ShapeError(fmt::format("paged_kv_store: value must be [tokens, {}, {}] (the cache's kv_heads and "
                                 "head_dim), got {} (cache {})",
                                 d.kv_heads, d.head_dim, describe(value), describe(cache)));
  if (value.dtype != DType::f32 && value.dtype != cache.dtype)
    throw DTypeError(fmt::format("paged_kv_store: value must be f32 or the cache's dtype, got {} (cache {})",
                                 describe(value), describe(cache)));
  check_index(Op::paged_kv_store, slots, "slots", 1, "[tokens]");
  if (slots.shape[0] != value.shape[0])
    throw ShapeError(fmt::format("paged_kv_store: slots {} must have one entry per token of value {}",
                                 describe(slots), describe(value)));

  // Every slot checked before anything is written, so a bad batch leaves the cache as it was.
  const int64_t capacity = d.blocks * d.block_size;
  std::vector<int64_t> slot_values(static_cast<size_t>(value.shape[0]));
  std::vector<std::pair<int64_t, int64_t>> used;  // (slot, token)
  for (int64_t t = 0; t < value.shape[0]; ++t) {
    const int64_t slot = slot_values[static_cast<size_t>(t)] = at1(slots, t);
    if (slot >= capacity)
      throw ExecutionError(fmt::format("paged_kv_store: token {} has slot {}, beyond the cache's {} slots ({} blocks "
                                       "of {})",
                                       t, slot, capacity, d.blocks, d.block_size));
    if (slot >= 0) used.emplace_back(slot, t);
  }
  // Two tokens writing one slot would race between threads: always a caller's bug, never a padding row.
  std::sort(used.begin(), used.end());
  for (size_t i = 1; i < used.size(); ++i)
    if (used[i].first == used[i - 1].first)
      throw ExecutionError(fmt::format("paged_kv_store: tokens {} and {} both have slot {}", used[i - 1].second,
                                       used[i].second, used[i].first));

  visit_cache_dtype(cache.dtype, [&]<class C>() {
    if (value.dtype == DType::f32) store_rows<C, float>(ctx, cache, value, slot_values, params.layer);
    else store_rows<C, C>(ctx, cache, value, slot_values, params.layer);
  });
}

// ---- paged_attention ---------------------------------------------------------------------------------

struct AttentionParams {
  int64_t layer;
  double scale;
  int64_t window = 0;   // 0: every earlier position; else only the last `window` (the token's own included)
  double softcap = 0;   // 0: none; else each scaled score becomes softcap * tanh(score / softcap)
  explicit AttentionParams(const KernelInit& init)
      : layer(init.attr<int64_t>("layer")), scale(init.attr<double>("scale")) {
    if (init.has_attr("window")) window = init.attr<int64_t>("window");
    if (init.has_attr("softcap")) softcap = init.attr<double>("softcap");
    if (window < 0) throw ValueError(fmt::format("paged_attention: window must be >= 0, got {}", window));
    if (!(softcap >= 0)) throw ValueError(fmt::format("paged_attention: softcap must be >= 0, got {}", softcap));
  }
};

// A token at `position` sees positions [first_visible, position].
inline int64_t first_visible(int64_t position, int64_t window) {
  return window > 0 ? std::max<int64_t>(0, position - window + 1) : 0;
}

struct Geometry {
  int64_t tokens, heads, head_dim, kv_heads, group, block_size, blocks, seqs, max_blocks;
};

struct Operands {
  const TensorView &q, &k, &v, &tables;
  const std::vector<int64_t>& seq_ids;
  const std::vector<int64_t>& positions;
  const TensorView& out;
  int64_t layer;
};

Geometry check_attention(const AttentionParams& params, std::span<const TensorView> inputs,
                         std::span<const TensorView> outputs) {
  if (inputs.size() != 6 || outputs.size() != 1)
    throw ValueError(fmt::format("paged_attention: expected 6 operands (q, k_cache, v_cache, block_tables, seq_ids, "
                                 "positions) and 1 result, got {} and {}",
                                 inputs.size(), outputs.size()));
  const TensorView &q = inputs[0], &k = inputs[1], &v = inputs[2], &out = outputs[0];
  const CacheDims c = check_cache(Op::paged_attention, k, "k_cache", params.layer);
  check_cache(Op::paged_attention, v, "v_cache", params.layer);
  if (k.shape != v.shape || k.dtype != v.dtype)
    throw ShapeError(fmt::format("paged_attention: k_cache {} and v_cache {} must have one type", describe(k),
                                 describe(v)));
  if (q.dtype != DType::f32)
    throw DTypeError(fmt::format("paged_attention: q must be f32, got {}", describe(q)));
  if (q.shape.size() != 3 || q.shape[2] != c.head_dim)
    throw ShapeError(fmt::format("paged_attention: q must be [tokens, heads, {}] (the cache's head_dim), got {}",
                                 c.head_dim, describe(q)));
  if (c.kv_heads < 1 || q.shape[1] % c.kv_heads != 0)
    throw ShapeError(fmt::format("paged_attention: q's {} heads are not a multiple of the cache's {} kv heads",
                                 q.shape[1], c.kv_heads));
  check_index(Op::paged_attention, inputs[3], "block_tables", 2, "[seqs, max_blocks_per_seq]");
  check_index(Op::paged_attention, inputs[4], "seq_ids", 1, "[tokens]");
  check_index(Op::paged_attention, inputs[5], "positions", 1, "[tokens]");
  if (inputs[4].shape[0] != q.shape[0] || inputs[5].shape[0] != q.shape[0])
    throw ShapeError(fmt::format("paged_attention: seq_ids {} and positions {} must have one entry per token of q {}",
                                 describe(inputs[4]), describe(inputs[5]), describe(q)));
  if (out.shape != q.shape || out.dtype != q.dtype || !out.is_contiguous())
    throw ShapeError(fmt::format("paged_attention: the result {} must be a contiguous {}", describe(out), describe(q)));
  return Geometry{q.shape[0],   q.shape[1], q.shape[2],          c.kv_heads,
                  q.shape[1] / c.kv_heads, c.block_size, c.blocks, inputs[3].shape[0], inputs[3].shape[1]};
}

// Every token's sequence and position, and every block id some token reads, checked before any work:
// an error names the token or sequence and the value, and the loops below index without checks.
void check_batch(const Geometry& g, const TensorView& tables, const std::vector<int64_t>& seq_ids,
                 const std::vector<int64_t>& positions) {
  const int64_t max_positions = g.max_blocks * g.block_size;
  std::vector<int64_t> last_block(static_cast<size_t>(g.seqs), -1), reader(static_cast<size_t>(g.seqs), -1);
  for (int64_t t = 0; t < g.tokens; ++t) {
    const int64_t s = seq_ids[static_cast<size_t>(t)], p = positions[static_cast<size_t>(t)];
    if (s < 0 || s >= g.seqs)
      throw ExecutionError(fmt::format("paged_attention: token {} has seq_id {}, outside [0, {}) (the block tables' "
                                       "sequences)",
                                       t, s, g.seqs));
    if (p < 0 || p >= max_positions)
      throw ExecutionError(fmt::format("paged_attention: token {} has position {}, outside [0, {}) ({} blocks per "
                                       "sequence of {} positions)",
                                       t, p, max_positions, g.max_blocks, g.block_size));
    if (p / g.block_size > last_block[static_cast<size_t>(s)]) {
      last_block[static_cast<size_t>(s)] = p / g.block_size;
      reader[static_cast<size_t>(s)] = t;
    }
  }
  for (int64_t s = 0; s < g.seqs; ++s)
    for (int64_t j = 0; j <= last_block[static_cast<size_t>(s)]; ++j) {
      const int64_t block = at2(tables, s, j);
      if (block < 0 || block >= g.blocks)
        throw ExecutionError(fmt::format("paged_attention: sequence {} has block {} at block_tables[{}, {}], outside "
                                         "[0, {}) (the cache's blocks; token {} reads it)",
                                         s, block, s, j, g.blocks, reader[static_cast<size_t>(s)]));
    }
}

// One kv head's query rows of a unit, their running max / sum and accumulators, as attend_unit sets
// them up.
struct UnitRows {
  const float* q;   // [rows][hd]
  float* acc;       // [rows][hd]
  float* max;       // [rows]
  float* sum;       // [rows]
  int64_t rows, hd;
};

#if defined(__x86_64__)
// The AVX-512 path, taken where vmath's AVX-512 exp is (vmath::avx512_available()). Keys are taken
// 16 at a time (a chunk of one block), with the keys in the lanes: the chunk's K rows are transposed once into a tile
// [head_dim][16] that every query row of the unit then multiplies (one FMA per head dim gives 16
// scores, no horizontal sums), and the softmax runs on those 16 lanes. The weighted sum over V keeps
// 4 query rows x 4 vectors of head dims in registers while each V row is read once. A bf16 / f16
// cache is widened as it is loaded. Every lane and every row is summed in one fixed order (head dims
// in order; keys in order; a query row's arithmetic never depends on which rows share its unit, rows
// not seeing a key skip it by mask), so the per-token invariance above holds here too.
#define KILN_AVX512 __attribute__((target("avx512f,avx512dq,fma,f16c")))
// GCC 12's AVX-512 intrinsics start from _mm512_undefined_ps(), which -Wmaybe-uninitialized
// misreports once inlined into a target("avx512f") function (GCC bug 105593, fixed in GCC 13).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

// The elements [0, 16) of a row of the cache's type under mask m = vmath::first_lanes(n) (0 past it), as
// f32. 16-bit elements: a partial row is copied out (masked 16-bit loads would need AVX512BW).
KILN_AVX512 inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
KILN_AVX512 inline __m256i load16_bits(const void* p, __mmask16 m) {
  if (m == 0xFFFF) return _mm256_loadu_si256(static_cast<const __m256i*>(p));
  alignas(32) uint16_t part[16] = {};
  std::memcpy(part, p, 2 * static_cast<size_t>(__builtin_popcount(m)));
  return _mm256_load_si256(reinterpret_cast<const __m256i*>(part));
}
KILN_AVX512 inline __m512 load16(const bf16_t* p, __mmask16 m) {
  const __m512i wide = _mm512_cvtepu16_epi32(load16_bits(p, m));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
KILN_AVX512 inline __m512 load16(const f16_t* p, __mmask16 m) { return _mm512_cvtph_ps(load16_bits(p, m)); }

constexpr int kRowTile = 4;  // query rows per register tile

// The next block's K and V rows of the unit's kv head (bytes), fetched into L2 a slice at a time
// while this block's keys are transposed: the block table scatters blocks over the pool, which no
// hardware prefetcher follows. Batched decode from DRAM (bench_paged_attention, 16 x 2048, Zen 4)
// ran 1.9x (f32) and 1.5x (bf16) faster with it than without; fetched into L1 instead, the f32
// cache's prefetches crowded the loads out and made it slower than without.
struct NextRows {
  const char* k = nullptr;  // null: no next block
  const char* v = nullptr;
  int64_t k_stride = 0, v_stride = 0, rows = 0;
};

// Keys [0, n) of one chunk (n <= 16, rows `stride` elements apart, elements contiguous): kt[d][j] =
// key j's element d for d < hd (lanes past n: 0). Meanwhile rows [c0, c0 + 16) of the next block
// are fetched, the part each pass over head dims reads of this chunk.
template <class E>
KILN_AVX512 void transpose_keys(const E* k, int64_t stride, int64_t n, int64_t hd, float* kt, const NextRows& next,
                                int64_t c0) {
  for (int64_t d0 = 0; d0 < hd; d0 += 16) {
    const __mmask16 m = vmath::first_lanes(hd - d0);
    const int64_t offset = d0 * static_cast<int64_t>(sizeof(E));
    // Once per cache line: a bf16 / f16 slice of 16 elements is half of one.
    const bool fetch = next.k != nullptr && offset % 64 == 0;
    __m512 r[16];
    if (n == 16 && d0 + 16 <= hd) {  // a whole slice: unrolled, the tile stays in registers
      // Each row's load beside its prefetches: a burst of 32 prefetches ahead of the loads kept the
      // loads' misses waiting behind them (f32, 16 x 2048 from DRAM).
#pragma GCC unroll 16
      for (int j = 0; j < 16; ++j) {
        if (fetch && c0 + j < next.rows) {
          __builtin_prefetch(next.k + (c0 + j) * next.k_stride + offset, 0, 2);  // locality 2: into L2 (T1)
          __builtin_prefetch(next.v + (c0 + j) * next.v_stride + offset, 0, 2);
        }
        r[j] = load16(k + j * stride + d0, m);
      }
      vmath::transpose16_avx512(r);
#pragma GCC unroll 16
      for (int j = 0; j < 16; ++j) _mm512_storeu_ps(kt + (d0 + j) * 16, r[j]);
      continue;
    }
    if (fetch)
      for (int64_t row = c0; row < std::min(c0 + 16, next.rows); ++row) {
        __builtin_prefetch(next.k + row * next.k_stride + offset, 0, 2);
        __builtin_prefetch(next.v + row * next.v_stride + offset, 0, 2);
      }
    for (int64_t j = 0; j < 16; ++j) r[j] = j < n ? load16(k + j * stride + d0, m) : _mm512_setzero_ps();
    vmath::transpose16_avx512(r);
    for (int64_t j = 0; j < 16 && d0 + j < hd; ++j) _mm512_storeu_ps(kt + (d0 + j) * 16, r[j]);
  }
}

// a[r] += weights[r][t] * V row t (head dims [d0, d0 + 64) under dm) for keys t in [first, last).
// kMasked: a row that does not see key t skips it (its weight is 0, but 0 * v could still turn a -0
// sum into +0, or take a NaN from a slot no token stored).
template <class E, int R, bool kMasked>
[[gnu::always_inline]] KILN_AVX512 inline void weigh_values(__m512 (&a)[R][4], const float (&weights)[R][16],
                                                            const __mmask16* seen, const E* v, int64_t stride,
                                                            int64_t d0, const __mmask16 (&dm)[4], int first, int last) {
  for (int t = first; t < last; ++t) {
    __m512 vt[4];
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) vt[i] = load16(v + t * stride + d0 + 16 * i, dm[i]);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m512 w = _mm512_set1_ps(weights[r][t]);
      if constexpr (kMasked) {
        const auto take = static_cast<__mmask16>(-((seen[r] >> t) & 1));
#pragma GCC unroll 4
        for (int i = 0; i < 4; ++i) a[r][i] = _mm512_mask3_fmadd_ps(w, vt[i], a[r][i], take);
      } else {
#pragma GCC unroll 4
        for (int i = 0; i < 4; ++i) a[r][i] = _mm512_fmadd_ps(w, vt[i], a[r][i]);
      }
    }
  }
}

// One chunk for the rows [r0, r0 + R) of the unit: row r sees the chunk's lanes `seen[r]` (keys in
// its window and not in its future). Scores q . k * scale (softcapped), the online softmax update of
// each row's max, sum and accumulator, then acc += p v over the chunk's V rows (value rows `stride`
// apart), key by key, 4 x 16 head dims at a time.
template <class E, int R>
KILN_AVX512 void attend_chunk(const UnitRows& u, int64_t r0, const __mmask16* seen, const float* kt, const E* v,
                              int64_t stride, float scale, float softcap) {
  __mmask16 any = 0;
  bool same = true;  // every row sees the same keys (a decode token's GQA group; most of a prefill chunk)
  for (int r = 0; r < R; ++r) {
    any |= seen[r];
    same = same && seen[r] == seen[0];
  }
  if (any == 0) return;  // none of these rows sees the chunk (other rows of the unit do)
  const int64_t hd = u.hd;
  const __m512 minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 p[R];
  {
    __m512 even[R], odd[R];
    for (int r = 0; r < R; ++r) even[r] = odd[r] = _mm512_setzero_ps();
    int64_t d = 0;
    for (; d + 2 <= hd; d += 2) {
      const __m512 k0 = _mm512_loadu_ps(kt + d * 16), k1 = _mm512_loadu_ps(kt + (d + 1) * 16);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const float* q = u.q + (r0 + r) * hd;
        even[r] = _mm512_fmadd_ps(_mm512_set1_ps(q[d]), k0, even[r]);
        odd[r] = _mm512_fmadd_ps(_mm512_set1_ps(q[d + 1]), k1, odd[r]);
      }
    }
    if (d < hd) {
      const __m512 k0 = _mm512_loadu_ps(kt + d * 16);
      for (int r = 0; r < R; ++r) even[r] = _mm512_fmadd_ps(_mm512_set1_ps(u.q[(r0 + r) * hd + d]), k0, even[r]);
    }
    for (int r = 0; r < R; ++r)
      p[r] = _mm512_mask_mov_ps(minus_inf, seen[r], _mm512_mul_ps(_mm512_add_ps(even[r], odd[r]), _mm512_set1_ps(scale)));
  }
  for (int r = 0; r < R; ++r) {
    if (seen[r] == 0) {
      p[r] = _mm512_setzero_ps();
      continue;
    }
    if (softcap > 0) {
      alignas(64) float lanes[16];
      _mm512_store_ps(lanes, p[r]);
      for (int j = 0; j < 16; ++j)
        if (seen[r] >> j & 1) lanes[j] = softcap * std::tanh(lanes[j] / softcap);
      p[r] = _mm512_load_ps(lanes);
    }
    const float chunk_max = _mm512_reduce_max_ps(p[r]);
    float& m = u.max[r0 + r];
    float& l = u.sum[r0 + r];
    if (chunk_max > m) {
      // Rescale what was summed against the old max (exp(-inf) = 0 the first time).
      const float correction = std::exp(m - chunk_max);
      l *= correction;
      float* a = u.acc + (r0 + r) * hd;
      for (int64_t d0 = 0; d0 < hd; d0 += 16) {
        const __mmask16 dm = vmath::first_lanes(hd - d0);
        _mm512_mask_storeu_ps(a + d0, dm, _mm512_mul_ps(_mm512_maskz_loadu_ps(dm, a + d0), _mm512_set1_ps(correction)));
      }
      m = chunk_max;
    }
    p[r] = _mm512_maskz_mov_ps(seen[r], vmath::exp_avx512(_mm512_sub_ps(p[r], _mm512_set1_ps(m))));
    l += _mm512_reduce_add_ps(p[r]);
  }
  alignas(64) float weights[R][16];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) _mm512_store_ps(weights[r], p[r]);
  const int first = __builtin_ctz(any), last = 32 - __builtin_clz(static_cast<unsigned>(any));
  // Head dims 64 at a time: R x 4 accumulators stay in registers (masks past hd load and store
  // nothing).
  for (int64_t d0 = 0; d0 < hd; d0 += 64) {
    __mmask16 dm[4];
    __m512 a[R][4];
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) dm[i] = vmath::first_lanes(hd - d0 - 16 * i);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) a[r][i] = _mm512_maskz_loadu_ps(dm[i], u.acc + (r0 + r) * hd + d0 + 16 * i);
    // Rows that all see keys [first, last) (a contiguous range) take every one of them unmasked.
    if (same)
      weigh_values<E, R, false>(a, weights, seen, v, stride, d0, dm, first, last);
    else
      weigh_values<E, R, true>(a, weights, seen, v, stride, d0, dm, first, last);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) _mm512_mask_storeu_ps(u.acc + (r0 + r) * hd + d0 + 16 * i, dm[i], a[r][i]);
  }
}

template <class E>
KILN_AVX512 void attend_chunk_rows(const UnitRows& u, const __mmask16* seen, const float* kt, const E* v,
                                   int64_t stride, float scale, float softcap) {
  int64_t r0 = 0;
  for (; r0 + kRowTile <= u.rows; r0 += kRowTile)
    attend_chunk<E, kRowTile>(u, r0, seen + r0, kt, v, stride, scale, softcap);
  switch (u.rows - r0) {
    case 1: attend_chunk<E, 1>(u, r0, seen + r0, kt, v, stride, scale, softcap); break;
    case 2: attend_chunk<E, 2>(u, r0, seen + r0, kt, v, stride, scale, softcap); break;
    case 3: attend_chunk<E, 3>(u, r0, seen + r0, kt, v, stride, scale, softcap); break;
    default: break;
  }
}
#pragma GCC diagnostic pop
#undef KILN_AVX512
#endif

// A unit's working set: each of its kv heads' query rows and accumulators, one head's block of K and
// K and V rows converted to f32 (only for a cache whose elements are not contiguous, or a half cache
// on the scalar path; others are read in place), and the AVX-512 path's transposed key chunk. One per thread,
// kept between launches: a decode step's launch is a few microseconds of work.
struct Scratch {
  std::vector<float> q_rows, acc, running_max, running_sum, k_tile, v_tile, scores, k_chunk;
  std::vector<uint16_t> seen;  // the AVX-512 path's lanes of a chunk each row of one head sees
  // Room for `heads` kv heads of a unit of up to kRunTokens tokens.
  void prepare(const Geometry& g, int64_t heads) {
    const auto rows = static_cast<size_t>(kRunTokens * g.group), all = rows * static_cast<size_t>(heads);
    const auto hd = static_cast<size_t>(g.head_dim), bs = static_cast<size_t>(g.block_size);
    grow(seen, rows);
    grow(q_rows, all * hd);
    grow(acc, all * hd);
    grow(running_max, all);
    grow(running_sum, all);
    grow(k_tile, bs * hd);  // [key, head_dim]
    grow(v_tile, bs * hd);  // [key, head_dim]
    grow(scores, (bs + 7) / 8 * 8);  // the AVX2 path takes a block's scores 8 at a time
    grow(k_chunk, (hd + 15) / 16 * 16 * 16);  // [head_dim][16 keys]
  }
  template <class T> static void grow(std::vector<T>& v, size_t n) {
    if (v.size() < n) v.resize(n);
  }
};
thread_local Scratch t_scratch;

// The scalar path's f16 caches widened a row at a time with F16C where the CPU has it (the CPUs
// without AVX-512 that take this path mostly do): f16_to_f32's values exactly (a NaN quieted the
// same way), where converting element by element cost a stories110M decode with an f16 cache
// 0.65-0.70x of its speed with an f32 one (Zen 3).
#if defined(__x86_64__)
bool has_f16c() {
  static const bool yes = __builtin_cpu_supports("avx") && __builtin_cpu_supports("f16c");
  return yes;
}
__attribute__((target("avx,f16c"))) void widen_f16c(const f16_t* src, int64_t n, float* dst) {
  int64_t d = 0;
  for (; d + 8 <= n; d += 8)
    _mm256_storeu_ps(dst + d, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + d))));
  for (; d < n; ++d) dst[d] = _cvtsh_ss(src[d].bits);
}
#else
bool has_f16c() { return false; }
void widen_f16c(const f16_t*, int64_t, float*) {}
#endif

// A cache row of n elements `stride` apart as f32 (a tile row of the scalar path).
template <class C> void widen_row(const C* src, int64_t stride, int64_t n, float* dst, bool f16c) {
  if constexpr (std::is_same_v<C, f16_t>)
    if (stride == 1 && f16c) return widen_f16c(src, n, dst);
  for (int64_t d = 0; d < n; ++d) dst[d] = static_cast<float>(src[d * stride]);
}

// q . k in 8 partial sums (element d in sum d % 8), added pairwise at the end: 8 independent chains
// of adds instead of one, which bounded the scalar path by the add's latency (the path of CPUs
// without AVX-512: stories110M after 896 tokens, f32 cache, Zen 3, 2 threads: prefill 1.12-1.38x,
// decode 1.03-1.11x). A fixed order, so a token's bits still depend on nothing else.
float dot_in_8_lanes(const float* a, const float* b, int64_t n) {
  float part[8] = {};
  int64_t d = 0;
  for (; d + 8 <= n; d += 8)
    for (int j = 0; j < 8; ++j) part[j] += a[d + j] * b[d + j];
  for (int j = 0; d < n; ++d, ++j) part[j] += a[d] * b[d];
  return ((part[0] + part[4]) + (part[2] + part[6])) + ((part[1] + part[5]) + (part[3] + part[7]));
}

// A row's running max raised to a block's max, what was summed against the old max rescaled
// (exp(-inf) = 0 the first time): the online softmax's step before the block's exps.
void raise_max(const UnitRows& u, int64_t row, float block_max) {
  float& m = u.max[row];
  if (block_max > m) {
    const float correction = std::exp(m - block_max);
    u.sum[row] *= correction;
    float* a = u.acc + row * u.hd;
    for (int64_t d = 0; d < u.hd; ++d) a[d] *= correction;
    m = block_max;
  }
}

// A row's n scores of a block (q . k * scale) softcapped, then raise_max to their max: shared by the
// scalar path and the AVX2 path's soft-capped models.
void cap_and_rescale(const UnitRows& u, int64_t row, float* score, int64_t n, float softcap) {
  if (softcap > 0)
    for (int64_t t = 0; t < n; ++t) score[t] = softcap * std::tanh(score[t] / softcap);
  float block_max = -std::numeric_limits<float>::infinity();
  for (int64_t t = 0; t < n; ++t) block_max = std::max(block_max, score[t]);
  raise_max(u, row, block_max);
}

// The scalar path's work on one block for every row of the unit: keys [lo, lo + visible) of the
// block are row's (token i's) visible ones.
void attend_block_scalar(const Geometry& g, float scale, float softcap, const float* k_rows, int64_t k_stride,
                         const float* v_rows, int64_t v_stride, int64_t count, const int64_t* lo,
                         const int64_t* visible, const UnitRows& u, Scratch& w) {
  const int64_t hd = g.head_dim;
  float* score = w.scores.data();
  for (int64_t i = 0; i < count; ++i) {
    if (visible[i] <= 0) continue;
    const float* k_lo = k_rows + lo[i] * k_stride;
    const float* v_lo = v_rows + lo[i] * v_stride;
    for (int64_t gi = 0; gi < g.group; ++gi) {
      const int64_t row = i * g.group + gi;
      const float* q_row = u.q + row * hd;
      float* a = u.acc + row * hd;
      for (int64_t t = 0; t < visible[i]; ++t) score[t] = dot_in_8_lanes(q_row, k_lo + t * k_stride, hd) * scale;
      cap_and_rescale(u, row, score, visible[i], softcap);
      const float m = u.max[row];
      float& l = u.sum[row];
      for (int64_t t = 0; t < visible[i]; ++t) {
        const float p = std::exp(score[t] - m);
        l += p;
        const float* v_row = v_lo + t * v_stride;
        for (int64_t d = 0; d < hd; ++d) a[d] += p * v_row[d];
      }
    }
  }
}

#if defined(__x86_64__)
// attend_block_scalar on CPUs with AVX2, FMA and F16C but not AVX-512, for head dims a multiple of 8,
// reading the cache in place (a bf16 / f16 row widened as it is loaded). Scores 8 keys at a time:
// each key's q . k in 8 FMA lanes over the head dims in order, the 8 keys' lanes then added in one
// fixed tree (dots8), so a key's score has the same bits whichever lane it lands in; exps 8 at a
// time by vmath::exp_avx2 (exp_avx512's bits); the weighted sum of V rows keeps up to 64 head dims
// of the row in registers while it walks the keys in order. Widening each block into f32 tiles, a
// horizontal sum per key and the accumulator's store-to-load round trip per key had made this path
// twice as slow (bench_paged_attention, llama-1B's geometry, f16 cache, 192 positions, 2 threads,
// Zen 3: 61 -> 30 us).
#define KILN_AVX2 __attribute__((target("avx2,fma,f16c")))

KILN_AVX2 inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
KILN_AVX2 inline __m256 load8(const f16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
KILN_AVX2 inline __m256 load8(const bf16_t* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

// Lane j: q . k[j] over hd elements, hd a multiple of 8.
template <class C> KILN_AVX2 __m256 dots8(const float* q, const C* const (&k)[8], int64_t hd) {
  __m256 acc[8];
#pragma GCC unroll 8
  for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
  for (int64_t d = 0; d < hd; d += 8) {
    const __m256 qv = _mm256_loadu_ps(q + d);
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) acc[j] = _mm256_fmadd_ps(qv, load8(k[j] + d), acc[j]);
  }
  // hadd(a, b) = [a0+a1, a2+a3, b0+b1, b2+b3 | a4+a5, a6+a7, b4+b5, b6+b7]: two rounds leave key j's
  // lanes 0-3 summed in lane j % 4 of the low half (j < 4) or of h4567, and lanes 4-7 in the high half.
  const __m256 h0123 = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3]));
  const __m256 h4567 = _mm256_hadd_ps(_mm256_hadd_ps(acc[4], acc[5]), _mm256_hadd_ps(acc[6], acc[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(h0123, h4567, 0x20), _mm256_permute2f128_ps(h0123, h4567, 0x31));
}

// a[0, 8V) += sum over keys t < n in order of p[t] * v_t[0, 8V) (rows `stride` elements apart).
template <int V, class C>
KILN_AVX2 void weigh_values_avx2(float* a, const float* p, const C* v, int64_t stride, int64_t n) {
  __m256 acc[V];
#pragma GCC unroll 8
  for (int i = 0; i < V; ++i) acc[i] = _mm256_loadu_ps(a + 8 * i);
  for (int64_t t = 0; t < n; ++t) {
    const __m256 pv = _mm256_set1_ps(p[t]);
    const C* row = v + t * stride;
#pragma GCC unroll 8
    for (int i = 0; i < V; ++i) acc[i] = _mm256_fmadd_ps(pv, load8(row + 8 * i), acc[i]);
  }
#pragma GCC unroll 8
  for (int i = 0; i < V; ++i) _mm256_storeu_ps(a + 8 * i, acc[i]);
}

// Calls f.template operator()<V>() for V = vectors in [1, 8].
template <class F> void with_vectors(int64_t vectors, F&& f) {
  switch (vectors) {
    case 1: return f.template operator()<1>();
    case 2: return f.template operator()<2>();
    case 3: return f.template operator()<3>();
    case 4: return f.template operator()<4>();
    case 5: return f.template operator()<5>();
    case 6: return f.template operator()<6>();
    case 7: return f.template operator()<7>();
    default: return f.template operator()<8>();
  }
}

template <class C>
KILN_AVX2 void attend_block_avx2(const Geometry& g, float scale, float softcap, const C* k_rows, int64_t k_stride,
                                 const C* v_rows, int64_t v_stride, int64_t count, const int64_t* lo,
                                 const int64_t* visible, const NextRows& next, const UnitRows& u, Scratch& w) {
  const int64_t hd = g.head_dim;
  // The next block's rows of this kv head into L2 (the block table scatters blocks, which no hardware
  // prefetcher follows), a whole block's work ahead of their use: 8 K rows beside each 8 keys'
  // scores and 8 V rows beside their exps, in the first query row's pass. All at once, a block's
  // prefetches filled the core's miss queue and the loads behind them waited as if the block had
  // been read first (bench_paged_attention, cold: 1, from DRAM: 8-20% slower).
  const int64_t row_bytes = hd * static_cast<int64_t>(sizeof(C));
  int64_t fetched_k = 0, fetched_v = 0;  // no next block: next.rows is 0
  auto fetch = [&](const char* base, int64_t stride, int64_t& fetched, int64_t upto) {
    for (; fetched < std::min(upto, next.rows); ++fetched)
      for (int64_t offset = 0; offset < row_bytes; offset += 64)
        __builtin_prefetch(base + fetched * stride + offset, 0, 2);  // locality 2: into L2 (T1)
  };
  auto fetch_k_rows = [&](int64_t upto) { fetch(next.k, next.k_stride, fetched_k, upto); };
  auto fetch_v_rows = [&](int64_t upto) { fetch(next.v, next.v_stride, fetched_v, upto); };
  float* score = w.scores.data();
  for (int64_t i = 0; i < count; ++i) {
    const int64_t n = visible[i];
    if (n <= 0) continue;
    const C* k_lo = k_rows + lo[i] * k_stride;
    const C* v_lo = v_rows + lo[i] * v_stride;
    for (int64_t gi = 0; gi < g.group; ++gi) {
      const int64_t row = i * g.group + gi;
      const float* q_row = u.q + row * hd;
      // Scores past n up to a multiple of 8 (the last key's again) fill the scratch, never read.
      for (int64_t t = 0; t < n; t += 8) {
        const C* k[8];
        for (int j = 0; j < 8; ++j) k[j] = k_lo + std::min<int64_t>(t + j, n - 1) * k_stride;
        _mm256_storeu_ps(score + t, _mm256_mul_ps(dots8(q_row, k, hd), _mm256_set1_ps(scale)));
        fetch_k_rows(t + 8);
      }
      if (softcap > 0) {
        cap_and_rescale(u, row, score, n, softcap);
      } else {  // the lanes past n repeat key n - 1's score, so they leave the max as it is
        __m256 most = _mm256_loadu_ps(score);
        for (int64_t t = 8; t < n; t += 8) most = _mm256_max_ps(most, _mm256_loadu_ps(score + t));
        raise_max(u, row, vmath::hmax_avx2(most));
      }
      // The exps, and their sum (lanes past n masked off) in lanes, then in one fixed tree.
      const __m256 m = _mm256_set1_ps(u.max[row]);
      __m256 total = _mm256_setzero_ps();
      for (int64_t t = 0; t < n; t += 8) {
        const __m256 e = vmath::exp_avx2(_mm256_sub_ps(_mm256_loadu_ps(score + t), m));
        _mm256_storeu_ps(score + t, e);
        fetch_v_rows(t + 8);
        const __m256i lanes = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(std::min<int64_t>(n - t, 8))),
                                                 _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        total = _mm256_add_ps(total, _mm256_and_ps(e, _mm256_castsi256_ps(lanes)));
      }
      u.sum[row] += vmath::hsum_avx2(total);
      float* a = u.acc + row * hd;
      for (int64_t d0 = 0; d0 < hd; d0 += 64)
        with_vectors(std::min<int64_t>(8, (hd - d0) / 8),
                     [&]<int V>() { weigh_values_avx2<V>(a + d0, score, v_lo + d0, v_stride, n); });
    }
  }
  fetch_k_rows(next.rows);  // rows past every token's keys here
  fetch_v_rows(next.rows);
}

// The AVX-512 path's work on one block: chunks of 16 keys, rows of type E `k_stride` / `v_stride`
// elements apart (elements contiguous).
template <class E>
void attend_block_avx512(const Geometry& g, float scale, float softcap, const E* k_rows, int64_t k_stride,
                         const E* v_rows, int64_t v_stride, int64_t rows, int64_t count, const int64_t* lo,
                         const int64_t* visible, const NextRows& next, const UnitRows& u, Scratch& w) {
  __mmask16* row_seen = w.seen.data();
  for (int64_t c0 = 0; c0 < rows; c0 += 16) {
    __mmask16 any = 0;
    for (int64_t i = 0; i < count; ++i) {
      // Token i's keys in this chunk: [max(lo, c0), min(lo + visible, c0 + 16)), as lanes from c0.
      const int64_t from = std::max(lo[i], c0) - c0, to = std::min(lo[i] + visible[i], c0 + 16) - c0;
      const auto mask = static_cast<__mmask16>(to > from ? vmath::first_lanes(to) & ~vmath::first_lanes(from) : 0);
      any |= mask;
      for (int64_t gi = 0; gi < g.group; ++gi) row_seen[i * g.group + gi] = mask;
    }
    if (any == 0) continue;
    transpose_keys(k_rows + c0 * k_stride, k_stride, std::min<int64_t>(16, rows - c0), g.head_dim, w.k_chunk.data(),
                   next, c0);
    attend_chunk_rows(u, row_seen, w.k_chunk.data(), v_rows + c0 * v_stride, v_stride, scale, softcap);
  }
}
#endif

// One unit: kv heads [kv0, kv1), tokens [first, first + count) of one sequence. Every head takes
// each block in turn, so the unit reads a block's rows (all its heads: kv_heads * head_dim elements
// apart) in address order where it covers every head, and the next block's prefetch runs a whole
// block's work ahead.
template <class C>
void attend_unit(const Geometry& g, const AttentionParams& params, bool simd, bool avx2, const Operands& o,
                 int64_t first, int64_t count, int64_t kv0, int64_t kv1, Scratch& w) {
  const int64_t hd = g.head_dim, bs = g.block_size, group = g.group;
  const auto scale = static_cast<float>(params.scale);
  const auto softcap = static_cast<float>(params.softcap);
  const int64_t seq = o.seq_ids[static_cast<size_t>(first)];
  int64_t max_position = 0, min_first = std::numeric_limits<int64_t>::max();
  for (int64_t i = 0; i < count; ++i) {
    const int64_t p = o.positions[static_cast<size_t>(first + i)];
    max_position = std::max(max_position, p);
    min_first = std::min(min_first, first_visible(p, params.window));
  }

  const int64_t rows = count * group, heads = kv1 - kv0;  // rows per head
  w.prepare(g, heads);
  auto head_rows = [&](int64_t kv) {
    const int64_t base = (kv - kv0) * rows;
    return UnitRows{w.q_rows.data() + base * hd, w.acc.data() + base * hd, w.running_max.data() + base,
                    w.running_sum.data() + base, rows, hd};
  };
  const float* q_data = o.q.as<float>();
  for (int64_t kv = kv0; kv < kv1; ++kv) {
    float* q_rows = w.q_rows.data() + (kv - kv0) * rows * hd;  // head_rows(kv).q
    for (int64_t i = 0; i < count; ++i)
      for (int64_t gi = 0; gi < group; ++gi) {
        const float* src = q_data + (first + i) * o.q.strides[0] + (kv * group + gi) * o.q.strides[1];
        float* dst = q_rows + (i * group + gi) * hd;
        for (int64_t d = 0; d < hd; ++d) dst[d] = src[d * o.q.strides[2]];
      }
  }
  std::fill_n(w.acc.data(), heads * rows * hd, 0.0f);
  std::fill_n(w.running_max.data(), heads * rows, -std::numeric_limits<float>::infinity());
  std::fill_n(w.running_sum.data(), heads * rows, 0.0f);

  const C* k_data = o.k.as<C>();
  const C* v_data = o.v.as<C>();
  // A cache whose elements are contiguous is read where it lies (the SIMD paths widen bf16 / f16 as
  // they load; the scalar path reads f32 only): a block's rows of one kv head are cache.strides[2]
  // apart. Otherwise each block's rows are converted to f32 rows of the tiles.
  const bool contiguous = o.k.strides[4] == 1 && o.v.strides[4] == 1;
  const bool in_place = contiguous && (simd || avx2 || std::is_same_v<C, float>);
  const bool f16c = has_f16c();
  // Blocks wholly before every token's window are never read.
  for (int64_t b = min_first / bs; b <= max_position / bs; ++b) {
    const int64_t block = at2(o.tables, seq, b);
    const int64_t block_rows = std::min(bs, max_position + 1 - b * bs);
    // Token i sees this block's keys [lo[i], lo[i] + visible[i]) (none: before or past its window).
    int64_t lo[kRunTokens], visible[kRunTokens];
    for (int64_t i = 0; i < count; ++i) {
      const int64_t position = o.positions[static_cast<size_t>(first + i)];
      lo[i] = std::max<int64_t>(0, first_visible(position, params.window) - b * bs);
      visible[i] = std::min(bs, position + 1 - b * bs) - lo[i];
    }
    const int64_t next_block = b < max_position / bs ? at2(o.tables, seq, b + 1) : -1;
    for (int64_t kv = kv0; kv < kv1; ++kv) {
      const UnitRows u = head_rows(kv);
      const C* k_block = k_data + cache_row(o.k, o.layer, block, 0, kv);
      const C* v_block = v_data + cache_row(o.v, o.layer, block, 0, kv);
      if (!in_place) {
        for (int64_t r = 0; r < block_rows; ++r) {
          widen_row(k_block + r * o.k.strides[2], o.k.strides[4], hd, w.k_tile.data() + r * hd, f16c);
          widen_row(v_block + r * o.v.strides[2], o.v.strides[4], hd, w.v_tile.data() + r * hd, f16c);
        }
      }
#if defined(__x86_64__)
      if (simd || avx2) {
        NextRows next;
        if (in_place && next_block >= 0) {
          const auto elem = static_cast<int64_t>(sizeof(C));
          next = {reinterpret_cast<const char*>(k_data + cache_row(o.k, o.layer, next_block, 0, kv)),
                  reinterpret_cast<const char*>(v_data + cache_row(o.v, o.layer, next_block, 0, kv)),
                  o.k.strides[2] * elem, o.v.strides[2] * elem, std::min(bs, max_position + 1 - (b + 1) * bs)};
        }
        if (simd && in_place)
          attend_block_avx512(g, scale, softcap, k_block, o.k.strides[2], v_block, o.v.strides[2], block_rows, count,
                              lo, visible, next, u, w);
        else if (simd)
          attend_block_avx512(g, scale, softcap, w.k_tile.data(), hd, w.v_tile.data(), hd, block_rows, count, lo,
                              visible, next, u, w);
        else if (in_place)
          attend_block_avx2(g, scale, softcap, k_block, o.k.strides[2], v_block, o.v.strides[2], count, lo, visible,
                            next, u, w);
        else
          attend_block_avx2(g, scale, softcap, w.k_tile.data(), hd, w.v_tile.data(), hd, count, lo, visible, next, u,
                            w);
        continue;
      }
#endif
      if constexpr (std::is_same_v<C, float>) {
        if (in_place) {
          attend_block_scalar(g, scale, softcap, k_block, o.k.strides[2], v_block, o.v.strides[2], count, lo, visible,
                              u, w);
          continue;
        }
      }
      attend_block_scalar(g, scale, softcap, w.k_tile.data(), hd, w.v_tile.data(), hd, count, lo, visible, u, w);
    }
  }

  float* o_data = o.out.as<float>();
  for (int64_t kv = kv0; kv < kv1; ++kv) {
    const UnitRows u = head_rows(kv);
    for (int64_t i = 0; i < count; ++i)
      for (int64_t gi = 0; gi < group; ++gi) {
        const int64_t row = i * group + gi;
        const float inv = 1.0f / u.sum[row];  // sum >= 1: the max key adds 1
        const float* a = u.acc + row * hd;
        float* dst = o_data + ((first + i) * g.heads + kv * group + gi) * hd;
        for (int64_t d = 0; d < hd; ++d) dst[d] = a[d] * inv;
      }
  }
}

void paged_attention_kernel(const KernelContext& ctx, const AttentionParams& params,
                            std::span<const TensorView> inputs, std::span<const TensorView> outputs) {
  const Geometry g = check_attention(params, inputs, outputs);
  std::vector<int64_t> seq_ids(static_cast<size_t>(g.tokens)), positions(static_cast<size_t>(g.tokens));
  for (int64_t t = 0; t < g.tokens; ++t) {
    seq_ids[static_cast<size_t>(t)] = at1(inputs[4], t);
    positions[static_cast<size_t>(t)] = at1(inputs[5], t);
  }
  check_batch(g, inputs[3], seq_ids, positions);

  // Runs: up to kRunTokens consecutive tokens of one sequence (a prefill chunk's, or a lone decode token).
  std::vector<std::pair<int64_t, int64_t>> runs;  // (first token, count)
  for (int64_t t = 0; t < g.tokens;) {
    int64_t n = 1;
    while (n < kRunTokens && t + n < g.tokens && seq_ids[static_cast<size_t>(t + n)] == seq_ids[static_cast<size_t>(t)])
      ++n;
    runs.emplace_back(t, n);
    t += n;
  }
  const Operands o{inputs[0], inputs[1], inputs[2], inputs[3], seq_ids, positions, outputs[0], params.layer};
  const bool simd = vmath::avx512_available();
  // The AVX2 path (it takes vmath's AVX2 exp) where the AVX-512 one is not, vmath's loops run (tests
  // force the generic level to reach the scalar one) and the head dims fill whole vectors.
  const bool avx2 = !simd && vmath::available() && has_f16c() && g.head_dim % 8 == 0;
  const auto num_runs = static_cast<int64_t>(runs.size());
  // A unit takes `span` of a run's kv heads: all of them while there are units enough to share out
  // (4 a thread, or a whole number a thread: one sequence's heads are equal work), else halved until
  // there are. Taking a block's heads together reads it in address order, where one head alone reads
  // 1 of every kv_heads rows' worth of bytes, and puts a whole block's work between a block's
  // prefetch and its use.
  const int threads = ctx.parallel ? ctx.parallel->num_threads() : 1;
  auto enough = [&](int64_t span) {
    const int64_t units = num_runs * ((g.kv_heads + span - 1) / span);
    return units >= 4 * threads || (units >= threads && units % threads == 0 && g.kv_heads % span == 0);
  };
  int64_t span = g.kv_heads;
  while (span > 1 && !enough(span)) span = (span + 1) / 2;
  const int64_t per_run = (g.kv_heads + span - 1) / span;
  visit_cache_dtype(inputs[1].dtype, [&]<class C>() {
    parallel_for(ctx, num_runs * per_run, 1, [&](int64_t begin, int64_t end) {
      for (int64_t unit = begin; unit < end; ++unit) {
        const auto& [first, count] = runs[static_cast<size_t>(unit / per_run)];
        const int64_t kv0 = unit % per_run * span;
        attend_unit<C>(g, params, simd, avx2, o, first, count, kv0, std::min(kv0 + span, g.kv_heads), t_scratch);
      }
    });
  });
}

}  // namespace

void register_cpu_paged_attention(KernelRegistry& r) {
  r.add(Op::paged_kv_store, DeviceKind::CPU, {DType::f32, DType::bf16, DType::f16},
        &with_params<StoreParams, paged_kv_store_kernel>);
  r.add(Op::paged_attention, DeviceKind::CPU, {DType::f32}, &with_params<AttentionParams, paged_attention_kernel>);
}

}  // namespace kiln::kernels
