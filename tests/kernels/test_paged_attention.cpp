// The paged KV cache kernels: paged_kv_store writes the right rows (converting, skipping padding),
// and paged_attention over shuffled block tables equals a naive loop over the same keys and values
// laid out per sequence, and the dense attention kernel on them, for ragged batches of prefill chunks
// and decode tokens, with grouped heads and f32, bf16 and f16 caches. A token's result is bitwise the
// same alone and in any batch, and on any number of threads. With a sliding window and soft-capping
// (Mistral's, Gemma 2's) both kernels must still agree with the loop.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <vector>

#include "forced_isa.h"
#include "kernel_test_util.h"
#include "test_util.h"
#include "threaded_parallel.h"

namespace {

using namespace kiln;
using namespace kiln::kernels;
using namespace kiln::kernels::kernel_test;
using kiln::testing::expect_error;
using graph::Op;

constexpr int64_t kLayers = 2, kLayer = 1;

// A cache's geometry and a ragged batch over it: each sequence's history length, and the batch's
// tokens in order as (sequence, position).
struct PagedBatch {
  int64_t num_blocks, block_size, kv_heads, head_dim, heads;
  std::vector<int64_t> lengths;                          // positions 0 .. length - 1 are stored
  std::vector<std::pair<int64_t, int64_t>> tokens;      // (sequence, position)
  int64_t window = 0;                                    // > 0: keys position - window + 1 .. position only
  double softcap = 0;                                    // > 0: scores softcap * tanh(score / softcap)
  // Whether a token at `position` sees key `j` (j <= position).
  bool sees(int64_t position, int64_t j) const { return j <= position && (window == 0 || position - j < window); }
  double capped(double score) const { return softcap > 0 ? softcap * std::tanh(score / softcap) : score; }
  int64_t seqs() const { return static_cast<int64_t>(lengths.size()); }
  int64_t max_blocks() const {
    int64_t most = 1;
    for (int64_t n : lengths) most = std::max(most, (n + block_size - 1) / block_size);
    return most + 1;  // a spare column, left -1: entries no token reads are never checked
  }
};

// A cache filled with NaN (every byte 0xFF is a NaN in f32, bf16 and f16), so a read of any slot that
// was not stored poisons the result.
HostTensor nan_cache(const PagedBatch& s, DType dtype) {
  HostTensor t(dtype, {kLayers, s.num_blocks, s.block_size, s.kv_heads, s.head_dim});
  std::fill(t.bytes.begin(), t.bytes.end(), uint8_t{0xFF});
  return t;
}

HostTensor i64_tensor(std::vector<int64_t> shape, const std::vector<int64_t>& values) {
  return tensor<int64_t>(std::move(shape), values);
}

// Block tables with every sequence's blocks drawn from a shuffled list of all blocks (so a
// sequence's blocks are neither in order nor adjacent), -1 past the blocks it uses.
std::vector<int64_t> shuffled_tables(const PagedBatch& s, uint32_t seed) {
  std::vector<int64_t> free(static_cast<size_t>(s.num_blocks));
  std::iota(free.begin(), free.end(), 0);
  for (size_t i = free.size(); i > 1; --i) {
    seed = seed * 1664525u + 1013904223u;
    std::swap(free[i - 1], free[(seed >> 8) % i]);
  }
  std::vector<int64_t> tables(static_cast<size_t>(s.seqs() * s.max_blocks()), -1);
  size_t next = 0;
  for (int64_t q = 0; q < s.seqs(); ++q)
    for (int64_t j = 0; j * s.block_size < s.lengths[static_cast<size_t>(q)]; ++j)
      tables[static_cast<size_t>(q * s.max_blocks() + j)] = free.at(next++);
  return tables;
}

// The history: keys[seq][position] and values, [kv_heads, head_dim] each, as the cache's dtype rounds them.
struct History {
  std::vector<std::vector<std::vector<double>>> k, v;
};

double rounded(double x, DType dtype) {
  if (dtype == DType::bf16) return static_cast<float>(bf16_t(static_cast<float>(x)));
  if (dtype == DType::f16) return static_cast<float>(f16_t(static_cast<float>(x)));
  return static_cast<float>(x);
}

// Stores every sequence's history into both caches with paged_kv_store (f32 values, converted),
// one sequence per call; returns it as the reference reads it.
History fill(const PagedBatch& s, const std::vector<int64_t>& tables, HostTensor& k_cache, HostTensor& v_cache) {
  History h;
  const int64_t row = s.kv_heads * s.head_dim;
  for (int64_t q = 0; q < s.seqs(); ++q) {
    const int64_t n = s.lengths[static_cast<size_t>(q)];
    const std::vector<double> k = pseudo_random(n * row, 100 + static_cast<uint32_t>(q));
    const std::vector<double> v = pseudo_random(n * row, 200 + static_cast<uint32_t>(q));
    std::vector<int64_t> slots;
    for (int64_t j = 0; j < n; ++j)
      slots.push_back(tables[static_cast<size_t>(q * s.max_blocks() + j / s.block_size)] * s.block_size +
                      j % s.block_size);
    const HostTensor slot_tensor = i64_tensor({n}, slots);
    const graph::Attrs attrs{{"layer", kLayer}};
    run_kernel(Op::paged_kv_store, attrs,
               {k_cache.view(), tensor_from_doubles(DType::f32, {n, s.kv_heads, s.head_dim}, k).view(),
                slot_tensor.view()},
               {});
    run_kernel(Op::paged_kv_store, attrs,
               {v_cache.view(), tensor_from_doubles(DType::f32, {n, s.kv_heads, s.head_dim}, v).view(),
                slot_tensor.view()},
               {});
    auto rows = [&](const std::vector<double>& x) {
      std::vector<std::vector<double>> out;
      for (int64_t j = 0; j < n; ++j) {
        std::vector<double> r;
        for (int64_t i = 0; i < row; ++i) r.push_back(rounded(x[static_cast<size_t>(j * row + i)], k_cache.dtype));
        out.push_back(r);
      }
      return out;
    };
    h.k.push_back(rows(k));
    h.v.push_back(rows(v));
  }
  return h;
}

// out[t, h] = sum_{j <= position} softmax_j(q[t, h] . k[seq, j, h / group] * scale) v[seq, j, h / group], in double.
std::vector<double> naive_paged(const PagedBatch& s, const History& h, const HostTensor& q, double scale) {
  const int64_t group = s.heads / s.kv_heads, hd = s.head_dim;
  std::vector<double> out;
  for (size_t t = 0; t < s.tokens.size(); ++t) {
    const auto [seq, position] = s.tokens[t];
    for (int64_t head = 0; head < s.heads; ++head) {
      const int64_t kv = head / group;
      std::vector<double> scores;
      double max = -std::numeric_limits<double>::infinity();
      for (int64_t j = 0; j <= position; ++j) {
        if (!s.sees(position, j)) {
          scores.push_back(-std::numeric_limits<double>::infinity());
          continue;
        }
        double dot = 0;
        for (int64_t i = 0; i < hd; ++i)
          dot += q.as_double((static_cast<int64_t>(t) * s.heads + head) * hd + i) *
                 h.k[static_cast<size_t>(seq)][static_cast<size_t>(j)][static_cast<size_t>(kv * hd + i)];
        scores.push_back(s.capped(dot * scale));
        max = std::max(max, scores.back());
      }
      double sum = 0;
      for (double& x : scores) sum += (x = std::exp(x - max));
      for (int64_t i = 0; i < hd; ++i) {
        double acc = 0;
        for (int64_t j = 0; j <= position; ++j)
          acc += scores[static_cast<size_t>(j)] / sum *
                 h.v[static_cast<size_t>(seq)][static_cast<size_t>(j)][static_cast<size_t>(kv * hd + i)];
        out.push_back(acc);
      }
    }
  }
  return out;
}

// The dense attention kernel, per sequence, on its history laid out contiguously (f32, the cache's
// rounding already applied) with a causal mask by position: the same rows as the batch's tokens.
std::vector<float> dense_attention(const PagedBatch& s, const History& h, const HostTensor& q, double scale) {
  const int64_t hd = s.head_dim, row = s.kv_heads * hd;
  std::vector<float> out(static_cast<size_t>(static_cast<int64_t>(s.tokens.size()) * s.heads * hd));
  for (int64_t seq = 0; seq < s.seqs(); ++seq) {
    std::vector<int64_t> mine;
    for (size_t t = 0; t < s.tokens.size(); ++t)
      if (s.tokens[t].first == seq) mine.push_back(static_cast<int64_t>(t));
    if (mine.empty()) continue;
    const int64_t total = s.lengths[static_cast<size_t>(seq)], n = static_cast<int64_t>(mine.size());
    std::vector<double> k, v, qs;
    for (int64_t j = 0; j < total; ++j)
      for (int64_t i = 0; i < row; ++i) {
        k.push_back(h.k[static_cast<size_t>(seq)][static_cast<size_t>(j)][static_cast<size_t>(i)]);
        v.push_back(h.v[static_cast<size_t>(seq)][static_cast<size_t>(j)][static_cast<size_t>(i)]);
      }
    HostTensor masked(DType::boolean, {n, total});
    for (int64_t r = 0; r < n; ++r) {
      const int64_t t = mine[static_cast<size_t>(r)];
      for (int64_t i = 0; i < s.heads * hd; ++i) qs.push_back(q.as_double(t * s.heads * hd + i));
      for (int64_t j = 0; j < total; ++j)
        masked.bytes[static_cast<size_t>(r * total + j)] = s.sees(s.tokens[static_cast<size_t>(t)].second, j) ? 0 : 1;
    }
    graph::Attrs attrs{{"scale", scale}};
    if (s.softcap > 0) attrs.emplace("softcap", s.softcap);
    const HostTensor got = run_op(Op::attention, attrs,
                                  {tensor_from_doubles(DType::f32, {n, s.heads, hd}, qs).view(),
                                   tensor_from_doubles(DType::f32, {total, s.kv_heads, hd}, k).view(),
                                   tensor_from_doubles(DType::f32, {total, s.kv_heads, hd}, v).view(), masked.view()},
                                  DType::f32, {n, s.heads, hd});
    for (int64_t r = 0; r < n; ++r)
      std::memcpy(&out[static_cast<size_t>(mine[static_cast<size_t>(r)] * s.heads * hd)],
                  got.bytes.data() + r * s.heads * hd * 4, static_cast<size_t>(s.heads * hd) * 4);
  }
  return out;
}

// Runs paged_attention over `tokens` (a sub-batch of s.tokens, or all of them).
HostTensor run_paged(const PagedBatch& s, const std::vector<std::pair<int64_t, int64_t>>& tokens, const HostTensor& q_all,
                     const std::vector<size_t>& rows, const TensorView& k_cache, const TensorView& v_cache,
                     const HostTensor& tables, double scale, Parallel* parallel = nullptr) {
  const auto n = static_cast<int64_t>(tokens.size());
  const int64_t row = s.heads * s.head_dim;
  HostTensor q(DType::f32, {n, s.heads, s.head_dim});
  for (int64_t t = 0; t < n; ++t)
    std::memcpy(q.bytes.data() + t * row * 4, q_all.bytes.data() + static_cast<int64_t>(rows[static_cast<size_t>(t)]) * row * 4,
                static_cast<size_t>(row) * 4);
  std::vector<int64_t> seq_ids, positions;
  for (const auto& [seq, position] : tokens) {
    seq_ids.push_back(seq);
    positions.push_back(position);
  }
  HostTensor out(DType::f32, {n, s.heads, s.head_dim});
  graph::Attrs attrs{{"layer", kLayer}, {"scale", scale}};
  if (s.window > 0) attrs.emplace("window", s.window);
  if (s.softcap > 0) attrs.emplace("softcap", s.softcap);
  run_kernel(Op::paged_attention, attrs,
             {q.view(), k_cache, v_cache, tables.view(), i64_tensor({n}, seq_ids).view(), i64_tensor({n}, positions).view()},
             {out.view()}, parallel);
  return out;
}

void check_on_isa(const PagedBatch& s, DType dtype) {
  SCOPED_TRACE(::testing::Message() << dtype_name(dtype) << " block_size " << s.block_size << " heads " << s.heads
                                    << "/" << s.kv_heads << " head_dim " << s.head_dim);
  const double scale = 1.0 / std::sqrt(static_cast<double>(s.head_dim));
  HostTensor k_cache = nan_cache(s, dtype), v_cache = nan_cache(s, dtype);
  const std::vector<int64_t> table_values = shuffled_tables(s, 7);
  const HostTensor tables = i64_tensor({s.seqs(), s.max_blocks()}, table_values);
  const History h = fill(s, table_values, k_cache, v_cache);
  const auto n = static_cast<int64_t>(s.tokens.size());
  const HostTensor q = tensor_from_doubles(DType::f32, {n, s.heads, s.head_dim}, pseudo_random(n * s.heads * s.head_dim, 5));
  std::vector<size_t> all(s.tokens.size());
  std::iota(all.begin(), all.end(), 0);

  const HostTensor got = run_paged(s, s.tokens, q, all, k_cache.view(), v_cache.view(), tables, scale);
  const std::vector<double> want = naive_paged(s, h, q, scale);
  const std::vector<float> dense = dense_attention(s, h, q, scale);
  for (int64_t i = 0; i < got.numel(); ++i) {
    const double w = want[static_cast<size_t>(i)];
    ASSERT_NEAR(got.as_double(i), w, 1e-5 * std::max(1.0, std::abs(w))) << "element " << i;
    ASSERT_NEAR(got.as_double(i), dense[static_cast<size_t>(i)], 1e-5 * std::max(1.0, std::abs(w))) << "element " << i;
  }

  // Threads split the units; each unit's arithmetic is the same either way.
  ThreadedParallel threads(3);
  EXPECT_EQ(run_paged(s, s.tokens, q, all, k_cache.view(), v_cache.view(), tables, scale, &threads).bytes, got.bytes);

  // Batch invariance: each token alone gives the bits it gave in the batch, and so does each
  // sequence's part of the batch without the other sequences.
  const int64_t row_bytes = s.heads * s.head_dim * 4;
  for (size_t t = 0; t < s.tokens.size(); ++t) {
    const HostTensor alone = run_paged(s, {s.tokens[t]}, q, {t}, k_cache.view(), v_cache.view(), tables, scale);
    ASSERT_EQ(std::memcmp(alone.bytes.data(), got.bytes.data() + static_cast<int64_t>(t) * row_bytes,
                          static_cast<size_t>(row_bytes)),
              0)
        << "token " << t << " alone differs from the batch";
  }
  for (int64_t seq = 0; seq < s.seqs(); ++seq) {
    std::vector<std::pair<int64_t, int64_t>> mine;
    std::vector<size_t> rows;
    for (size_t t = 0; t < s.tokens.size(); ++t)
      if (s.tokens[t].first == seq) {
        mine.push_back(s.tokens[t]);
        rows.push_back(t);
      }
    if (mine.empty()) continue;
    const HostTensor part = run_paged(s, mine, q, rows, k_cache.view(), v_cache.view(), tables, scale);
    for (size_t r = 0; r < rows.size(); ++r)
      ASSERT_EQ(std::memcmp(part.bytes.data() + static_cast<int64_t>(r) * row_bytes,
                            got.bytes.data() + static_cast<int64_t>(rows[r]) * row_bytes, static_cast<size_t>(row_bytes)),
                0)
          << "sequence " << seq << "'s token " << rows[r] << " without the other sequences differs";
  }
}

void check(const PagedBatch& s, DType dtype = DType::f32) {
  for (gemm::Isa isa : supported_isas()) {
    SCOPED_TRACE(gemm::isa_name(isa));
    ForcedIsa forced(isa);
    check_on_isa(s, dtype);
  }
}

// A chunk of `count` tokens of `seq` starting at `start`.
std::vector<std::pair<int64_t, int64_t>> chunk(int64_t seq, int64_t start, int64_t count) {
  std::vector<std::pair<int64_t, int64_t>> out;
  for (int64_t p = start; p < start + count; ++p) out.emplace_back(seq, p);
  return out;
}

std::vector<std::pair<int64_t, int64_t>> concat(std::initializer_list<std::vector<std::pair<int64_t, int64_t>>> parts) {
  std::vector<std::pair<int64_t, int64_t>> out;
  for (const auto& p : parts) out.insert(out.end(), p.begin(), p.end());
  return out;
}

// Four sequences of different lengths: decode tokens of two, a prefill chunk of 11 tokens starting
// mid-sequence (more than one run of 8), and a whole short prompt; blocks of 4 positions.
PagedBatch mixed_batch(int64_t heads, int64_t kv_heads, int64_t head_dim) {
  PagedBatch s{24, 4, kv_heads, head_dim, heads, {13, 1, 22, 5}, {}};
  s.tokens = concat({{{0, 12}}, chunk(2, 11, 11), {{1, 0}}, chunk(3, 0, 5)});
  return s;
}

}  // namespace

TEST(PagedAttentionKernel, MixedBatchEqualsTheReferenceF32) {
  check(mixed_batch(4, 2, 8));   // GQA: 2 query heads per kv head
  check(mixed_batch(2, 2, 13));  // one head per kv head, a head_dim that is no multiple of a vector
  check(mixed_batch(8, 1, 16));  // one kv head for all
}

TEST(PagedAttentionKernel, SlidingWindowAndSoftCapEqualTheReference) {
  for (int64_t window : {1, 3, 4, 6}) {  // under, at and over the block size of 4
    SCOPED_TRACE(::testing::Message() << "window " << window);
    PagedBatch s = mixed_batch(4, 2, 8);
    s.window = window;
    check(s);
    s.softcap = 0.5;
    check(s);
  }
  PagedBatch capped = mixed_batch(8, 1, 16);
  capped.softcap = 0.3;  // no window
  check(capped);
  check(capped, DType::bf16);
}

TEST(PagedAttentionKernel, HalfCachesConvertOnLoad) {
  check(mixed_batch(4, 2, 8), DType::bf16);
  check(mixed_batch(4, 2, 8), DType::f16);
}

TEST(PagedAttentionKernel, DecodeOfManySequencesAndLongHistories) {
  // 12 sequences, one token each at its last position, histories of up to 70 positions in blocks of 16.
  PagedBatch s{64, 16, 2, 32, 8, {}, {}};
  for (int64_t q = 0; q < 12; ++q) {
    s.lengths.push_back(1 + (q * 37) % 70);
    s.tokens.emplace_back(q, s.lengths.back() - 1);
  }
  check(s);
  check(s, DType::bf16);
}

// Blocks of 32 positions (two chunks of 16 keys each for the AVX-512 path) and head dims past 64
// (more than one register tile of head dims, one not a multiple of 16), with prefill runs of 8
// tokens x 4 query heads per kv head, and a window that starts inside a block's second chunk.
TEST(PagedAttentionKernel, BlocksOfMoreThanSixteenKeysAndWideHeads) {
  for (int64_t head_dim : {80, 128}) {
    PagedBatch s{12, 32, 2, head_dim, 8, {75, 33, 9}, {}};
    s.tokens = concat({chunk(0, 60, 15), {{1, 32}}, chunk(2, 0, 9)});
    check(s);
    check(s, DType::bf16);
    check(s, DType::f16);
    s.window = 21;
    check(s);
  }
}

// Seven decode tokens over 3 kv heads: on 3 threads each token's heads are two units, of 2 heads
// and of 1 (one unit of all 3 on one thread; alone, a unit of all 3); every split gives the same bits.
TEST(PagedAttentionKernel, KvHeadsSharedOutUnevenlyBetweenUnits) {
  PagedBatch s{64, 16, 3, 32, 6, {40, 17, 1, 16, 33, 5, 64}, {}};
  for (int64_t q = 0; q < 7; ++q) s.tokens.emplace_back(q, s.lengths[static_cast<size_t>(q)] - 1);
  check(s);
  check(s, DType::bf16);
}

// A cache whose head dims are not contiguous (every other element of a wider cache: a view the
// kernels cannot read in place) is widened into f32 rows per block: the same values and the same
// steps as the cache read in place, so bitwise its result, on every ISA and cache dtype.
TEST(PagedAttentionKernel, CachesWhoseElementsAreNotContiguousGiveTheInPlaceBits) {
  PagedBatch s{24, 4, 2, 16, 4, {13, 1, 22, 5}, {}};
  s.tokens = concat({{{0, 12}}, chunk(2, 11, 11), {{1, 0}}, chunk(3, 0, 5)});
  for (DType dtype : {DType::f32, DType::bf16, DType::f16})
    for (gemm::Isa isa : supported_isas()) {
      SCOPED_TRACE(::testing::Message() << gemm::isa_name(isa) << " " << dtype_name(dtype));
      ForcedIsa forced(isa);
      HostTensor k_cache = nan_cache(s, dtype), v_cache = nan_cache(s, dtype);
      const std::vector<int64_t> table_values = shuffled_tables(s, 11);
      const HostTensor tables = i64_tensor({s.seqs(), s.max_blocks()}, table_values);
      fill(s, table_values, k_cache, v_cache);
      const auto n = static_cast<int64_t>(s.tokens.size());
      const HostTensor q =
          tensor_from_doubles(DType::f32, {n, s.heads, s.head_dim}, pseudo_random(n * s.heads * s.head_dim, 13));
      std::vector<size_t> all(s.tokens.size());
      std::iota(all.begin(), all.end(), 0);
      const double scale = 0.25;
      const HostTensor want = run_paged(s, s.tokens, q, all, k_cache.view(), v_cache.view(), tables, scale);

      // The same cache in the even elements of one twice as wide (the odd ones NaN: read, they poison).
      const int64_t elem = dtype_size(dtype);
      auto spread = [&](const HostTensor& cache) {
        HostTensor wide(dtype, {kLayers, s.num_blocks, s.block_size, s.kv_heads, 2 * s.head_dim});
        std::fill(wide.bytes.begin(), wide.bytes.end(), uint8_t{0xFF});
        for (int64_t i = 0; i < cache.numel(); ++i)
          std::memcpy(wide.bytes.data() + 2 * i * elem, cache.bytes.data() + i * elem, static_cast<size_t>(elem));
        return wide;
      };
      const HostTensor k_wide = spread(k_cache), v_wide = spread(v_cache);
      auto strided = [&](const HostTensor& wide) {
        TensorView v = wide.view();
        v.shape.back() = s.head_dim;
        v.strides.back() = 2;
        return v;
      };
      const HostTensor got = run_paged(s, s.tokens, q, all, strided(k_wide), strided(v_wide), tables, scale);
      EXPECT_EQ(got.bytes, want.bytes);
    }
}

TEST(PagedAttentionKernel, OneSequenceInterruptedByAnotherStartsANewRun) {
  // Sequence 0's tokens are not all adjacent in the batch: each adjacent group is its own run.
  PagedBatch s{16, 2, 1, 4, 2, {9, 3}, {}};
  s.tokens = concat({chunk(0, 4, 3), {{1, 2}}, chunk(0, 7, 2)});
  check(s);
}

TEST(PagedKvStoreKernel, WritesEachTokensRowAtItsSlotAndSkipsPadding) {
  // Cache [2 layers, 3 blocks, 2 rows, 1 kv head, 2]: slot 5 is block 2 row 1, slot 0 block 0 row 0.
  HostTensor cache = tensor<float>({2, 3, 2, 1, 2}, std::vector<float>(24, -1.0f));
  const HostTensor value = tensor<float>({3, 1, 2}, {1, 2, 3, 4, 5, 6});
  run_kernel(Op::paged_kv_store, {{"layer", int64_t{1}}},
             {cache.view(), value.view(), i64_tensor({3}, {5, -1, 0}).view()}, {});
  std::vector<float> want(24, -1.0f);
  want[12 + 10] = 1, want[12 + 11] = 2;  // layer 1, block 2, row 1
  want[12 + 0] = 5, want[12 + 1] = 6;    // layer 1, block 0, row 0; token 1 (slot -1) skipped
  EXPECT_EQ(cache.values<float>(), want);
}

TEST(PagedKvStoreKernel, ConvertsF32ToTheCachesDTypeAndCopiesItsOwn) {
  const std::vector<float> x = {1.00390625f, -3.14159265f, 65504.0f, 1e-3f};
  for (DType dtype : {DType::bf16, DType::f16}) {
    SCOPED_TRACE(dtype_name(dtype));
    HostTensor from_f32(dtype, {1, 2, 2, 1, 2});
    run_kernel(Op::paged_kv_store, {{"layer", int64_t{0}}},
               {from_f32.view(), tensor<float>({2, 1, 2}, x).view(), i64_tensor({2}, {3, 0}).view()}, {});
    // Slot 3 (block 1, row 1) holds token 0, slot 0 token 1; each element rounded as cast rounds it.
    std::vector<double> x_rounded;
    for (float f : x) x_rounded.push_back(rounded(f, dtype));
    EXPECT_EQ(from_f32.as_double(6), x_rounded[0]);
    EXPECT_EQ(from_f32.as_double(7), x_rounded[1]);
    EXPECT_EQ(from_f32.as_double(0), x_rounded[2]);
    EXPECT_EQ(from_f32.as_double(1), x_rounded[3]);

    HostTensor same(dtype, {1, 2, 2, 1, 2});
    const HostTensor value = tensor_from_doubles(dtype, {2, 1, 2}, {0.5, -2, 7, 0.25});
    run_kernel(Op::paged_kv_store, {{"layer", int64_t{0}}}, {same.view(), value.view(), i64_tensor({2}, {1, 2}).view()},
               {});
    EXPECT_EQ(std::vector<uint8_t>(same.bytes.begin() + 4, same.bytes.begin() + 12), value.bytes);
  }
}

TEST(PagedKvStoreKernel, OutOfRangeOrRepeatedSlotsNameTheTokenAndLeaveTheCache) {
  HostTensor cache = tensor<float>({1, 2, 2, 1, 1}, {0, 0, 0, 0});
  const HostTensor value = tensor<float>({3, 1, 1}, {1, 2, 3});
  const graph::Attrs attrs{{"layer", int64_t{0}}};
  expect_error<ExecutionError>(
      [&] { run_kernel(Op::paged_kv_store, attrs, {cache.view(), value.view(), i64_tensor({3}, {0, 4, 1}).view()}, {}); },
      {"paged_kv_store", "token 1", "slot 4", "4 slots"});
  expect_error<ExecutionError>(
      [&] { run_kernel(Op::paged_kv_store, attrs, {cache.view(), value.view(), i64_tensor({3}, {2, 0, 2}).view()}, {}); },
      {"paged_kv_store", "tokens 0 and 2", "slot 2"});
  EXPECT_EQ(cache.values<float>(), (std::vector<float>{0, 0, 0, 0}));
  expect_error<ExecutionError>(
      [&] {
        run_kernel(Op::paged_kv_store, {{"layer", int64_t{1}}},
                   {cache.view(), value.view(), i64_tensor({3}, {0, 1, 2}).view()}, {});
      },
      {"paged_kv_store", "layer 1"});
}

TEST(PagedAttentionKernel, OutOfRangeIdsPositionsAndBlocksNameTheTokenOrSequence) {
  // Cache [2 layers, 3 blocks of 2]; 2 sequences of at most 2 blocks.
  PagedBatch s{3, 2, 1, 4, 2, {3, 1}, {}};
  HostTensor k = nan_cache(s, DType::f32), v = nan_cache(s, DType::f32);
  const HostTensor q(DType::f32, {1, 2, 4});
  auto attend = [&](std::vector<int64_t> tables, int64_t seq, int64_t position) {
    HostTensor out(DType::f32, {1, 2, 4});
    run_kernel(Op::paged_attention, {{"layer", kLayer}, {"scale", 0.5}},
               {q.view(), k.view(), v.view(), i64_tensor({2, 2}, tables).view(), i64_tensor({1}, {seq}).view(),
                i64_tensor({1}, {position}).view()},
               {out.view()});
  };
  expect_error<ExecutionError>([&] { attend({0, 1, 2, -1}, 2, 0); }, {"paged_attention", "token 0", "seq_id 2"});
  expect_error<ExecutionError>([&] { attend({0, 1, 2, -1}, -1, 0); }, {"paged_attention", "token 0", "seq_id -1"});
  expect_error<ExecutionError>([&] { attend({0, 1, 2, -1}, 0, 4); }, {"paged_attention", "token 0", "position 4"});
  expect_error<ExecutionError>([&] { attend({0, 1, 2, -1}, 0, -1); }, {"paged_attention", "token 0", "position -1"});
  expect_error<ExecutionError>([&] { attend({0, 3, 2, -1}, 0, 2); },
                               {"paged_attention", "sequence 0", "block 3", "block_tables[0, 1]", "token 0"});
  expect_error<ExecutionError>([&] { attend({0, 1, -1, 2}, 1, 0); },
                               {"paged_attention", "sequence 1", "block -1", "block_tables[1, 0]"});
  // An entry past the blocks a token reads is never looked at (block tables are padded with -1).
  attend({0, -1, 2, -1}, 0, 1);
}
