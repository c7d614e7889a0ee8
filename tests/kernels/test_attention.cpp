// The attention kernel against a naive loop written here from the definition (scores in double, a
// masked score the lowest float, a plain softmax, the weighted sum), over several shapes: decode and
// prefill, grouped heads, several key tiles and query blocks, padding and rows masked everywhere.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
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

struct Case {
  int64_t seq, total, heads, kv_heads, head_dim;
};

// Causal for queries at the end of the history, plus padding: key t is masked when it lies after query
// s's position, or when padded[t].
std::vector<bool> causal_mask(const Case& c, const std::vector<bool>& padded) {
  std::vector<bool> masked;
  for (int64_t s = 0; s < c.seq; ++s)
    for (int64_t t = 0; t < c.total; ++t) masked.push_back(t > c.total - c.seq + s || padded[static_cast<size_t>(t)]);
  return masked;
}

HostTensor bool_tensor(std::vector<int64_t> shape, const std::vector<bool>& values) {
  HostTensor t(DType::boolean, std::move(shape));
  for (size_t i = 0; i < values.size(); ++i) t.bytes[i] = values[i] ? 1 : 0;
  return t;
}

// out[s, h, :] = sum_t softmax_t(q[s, h] . k[t, h / group] * scale, masked) v[t, h / group]
std::vector<double> naive_attention(const Case& c, const std::vector<double>& q, const std::vector<double>& k,
                                    const std::vector<double>& v, const std::vector<bool>& masked, double scale) {
  const int64_t group = c.heads / c.kv_heads, hd = c.head_dim;
  std::vector<double> out(static_cast<size_t>(c.seq * c.heads * hd), 0.0);
  for (int64_t s = 0; s < c.seq; ++s)
    for (int64_t h = 0; h < c.heads; ++h) {
      const int64_t kv = h / group;
      std::vector<double> scores(static_cast<size_t>(c.total));
      double max = -std::numeric_limits<double>::infinity();
      for (int64_t t = 0; t < c.total; ++t) {
        double dot = 0;
        for (int64_t i = 0; i < hd; ++i)
          dot += q[static_cast<size_t>((s * c.heads + h) * hd + i)] * k[static_cast<size_t>((t * c.kv_heads + kv) * hd + i)];
        scores[static_cast<size_t>(t)] = masked[static_cast<size_t>(s * c.total + t)]
                                             ? static_cast<double>(std::numeric_limits<float>::lowest())
                                             : dot * scale;
        max = std::max(max, scores[static_cast<size_t>(t)]);
      }
      double sum = 0;
      for (double& x : scores) sum += (x = std::exp(x - max));
      for (int64_t t = 0; t < c.total; ++t)
        for (int64_t i = 0; i < hd; ++i)
          out[static_cast<size_t>((s * c.heads + h) * hd + i)] +=
              scores[static_cast<size_t>(t)] / sum * v[static_cast<size_t>((t * c.kv_heads + kv) * hd + i)];
    }
  return out;
}

void check_case_on_isa(const Case& c, const std::vector<bool>& padded, DType dtype, double tolerance) {
  SCOPED_TRACE(::testing::Message() << "seq " << c.seq << " total " << c.total << " heads " << c.heads << "/"
                                  << c.kv_heads << " head_dim " << c.head_dim << " " << dtype_name(dtype));
  const double scale = 1.0 / std::sqrt(static_cast<double>(c.head_dim));
  HostTensor q = tensor_from_doubles(dtype, {c.seq, c.heads, c.head_dim}, pseudo_random(c.seq * c.heads * c.head_dim, 1));
  HostTensor k = tensor_from_doubles(dtype, {c.total, c.kv_heads, c.head_dim},
                                     pseudo_random(c.total * c.kv_heads * c.head_dim, 2));
  HostTensor v = tensor_from_doubles(dtype, {c.total, c.kv_heads, c.head_dim},
                                     pseudo_random(c.total * c.kv_heads * c.head_dim, 3));
  const std::vector<bool> masked = causal_mask(c, padded);
  HostTensor mask = bool_tensor({c.seq, c.total}, masked);

  // The reference sees the inputs as the kernel does (rounded to dtype).
  auto values = [](const HostTensor& t) {
    std::vector<double> out;
    for (int64_t i = 0; i < t.numel(); ++i) out.push_back(t.as_double(i));
    return out;
  };
  const std::vector<double> want = naive_attention(c, values(q), values(k), values(v), masked, scale);
  const graph::Attrs attrs{{"scale", scale}};
  HostTensor got = run_op(graph::Op::attention, attrs, {q.view(), k.view(), v.view(), mask.view()}, dtype,
                          {c.seq, c.heads, c.head_dim});
  for (int64_t i = 0; i < got.numel(); ++i) ASSERT_NEAR(got.as_double(i), want[static_cast<size_t>(i)], tolerance) << i;

  // Threads split the (kv head, query block) units; each unit's arithmetic is the same either way.
  ThreadedParallel threads(3);
  HostTensor threaded(dtype, {c.seq, c.heads, c.head_dim});
  run_kernel(graph::Op::attention, attrs, {q.view(), k.view(), v.view(), mask.view()}, {threaded.view()}, &threads);
  EXPECT_EQ(threaded.bytes, got.bytes);
}

// On every ISA level this CPU supports: f32 takes an AVX-512 path (one query row at a time) where
// the level has it, the general tiled loop elsewhere.
void check_case(const Case& c, const std::vector<bool>& padded, DType dtype = DType::f32, double tolerance = 2e-6) {
  for (gemm::Isa isa : supported_isas()) {
    SCOPED_TRACE(gemm::isa_name(isa));
    ForcedIsa forced(isa);
    check_case_on_isa(c, padded, dtype, tolerance);
  }
}

}  // namespace

TEST(AttentionKernel, DecodeOneQueryAgainstTheWholeHistory) {
  check_case({1, 7, 4, 2, 8}, std::vector<bool>(7, false));
  check_case({1, 1, 1, 1, 4}, {false});
}

// Decode shapes: grouped heads (Llama-3.2-1B's 4 per kv head), head dims that are
// not a multiple of 16, padding, a query masked everywhere, histories of a few hundred keys.
TEST(AttentionKernel, DecodeGroupedHeadsPaddingAndOddHeadDims) {
  check_case({1, 300, 32, 8, 64}, std::vector<bool>(300, false));
  check_case({1, 37, 6, 2, 20}, std::vector<bool>(37, false));
  std::vector<bool> padded(50, false);
  for (int64_t t : {0, 3, 16, 17, 49}) padded[static_cast<size_t>(t)] = true;
  check_case({1, 50, 4, 1, 33}, padded);
  check_case({1, 20, 2, 2, 8}, std::vector<bool>(20, true));
  check_case({1, 0, 2, 1, 8}, {});
}

TEST(AttentionKernel, PrefillIsCausal) {
  check_case({5, 5, 2, 2, 16}, std::vector<bool>(5, false));
  // More queries than a query block (8), with a history before them.
  check_case({19, 23, 4, 1, 12}, std::vector<bool>(23, false));
}

TEST(AttentionKernel, HistoriesLongerThanOneKeyTileAndOddHeadDims) {
  check_case({3, 130, 6, 3, 13}, std::vector<bool>(130, false));
  check_case({1, 200, 6, 6, 48}, std::vector<bool>(200, false));
  check_case({2, 40, 2, 1, 160}, std::vector<bool>(40, false));  // head_dim > 128: sums kept in memory
}

TEST(AttentionKernel, PaddedKeysAreNeverAttended) {
  std::vector<bool> padded(70, false);
  for (int64_t t : {0, 1, 2, 40, 64, 65}) padded[static_cast<size_t>(t)] = true;
  check_case({4, 70, 4, 2, 8}, padded);
}

TEST(AttentionKernel, RowMaskedEverywhereAveragesEveryValue) {
  // Query 0 (position 2) sees keys 0..2, which are all padding; queries 1 and 2 see key 3 and 4.
  std::vector<bool> padded{true, true, true, false, false};
  check_case({3, 5, 2, 1, 4}, padded);
  // And the same across key tiles.
  std::vector<bool> long_padding(100, true);
  long_padding[99] = false;
  check_case({2, 100, 2, 2, 4}, long_padding);
}

TEST(AttentionKernel, HalfPrecisionComputesInF32) {
  // Only the result's rounding to 8 (bf16) or 11 (f16) significant bits separates it from the reference.
  check_case({3, 9, 4, 2, 16}, std::vector<bool>(9, false), DType::bf16, 1e-2);
  check_case({3, 9, 4, 2, 16}, std::vector<bool>(9, false), DType::f16, 1e-3);
  check_case({2, 9, 2, 1, 8}, std::vector<bool>(9, false), DType::f64, 1e-12);
}

TEST(AttentionKernel, ReadsStridedQueries) {
  // q stored as [heads, seq, head_dim] and read through a permuted view.
  const Case c{3, 4, 2, 2, 8};
  const std::vector<double> stored = pseudo_random(c.heads * c.seq * c.head_dim, 7);
  HostTensor q_heads_first = tensor_from_doubles(DType::f32, {c.heads, c.seq, c.head_dim}, stored);
  std::vector<double> q(stored.size());
  for (int64_t h = 0; h < c.heads; ++h)
    for (int64_t s = 0; s < c.seq; ++s)
      for (int64_t i = 0; i < c.head_dim; ++i)
        q[static_cast<size_t>((s * c.heads + h) * c.head_dim + i)] =
            stored[static_cast<size_t>((h * c.seq + s) * c.head_dim + i)];
  const std::vector<double> kv = pseudo_random(c.total * c.kv_heads * c.head_dim, 8);
  HostTensor k = tensor_from_doubles(DType::f32, {c.total, c.kv_heads, c.head_dim}, kv);
  const std::vector<bool> masked = causal_mask(c, std::vector<bool>(4, false));
  HostTensor mask = bool_tensor({c.seq, c.total}, masked);
  HostTensor got = run_op(graph::Op::attention, {{"scale", 0.5}},
                          {permuted(q_heads_first.view(), {1, 0, 2}), k.view(), k.view(), mask.view()}, DType::f32,
                          {c.seq, c.heads, c.head_dim});
  const std::vector<double> want = naive_attention(c, q, kv, kv, masked, 0.5);
  for (int64_t i = 0; i < got.numel(); ++i) EXPECT_NEAR(got.as_double(i), want[static_cast<size_t>(i)], 2e-6) << i;
}

TEST(AttentionKernel, RejectsOperandsThatDoNotFit) {
  HostTensor q(DType::f32, {1, 3, 4}), k(DType::f32, {5, 2, 4}), mask(DType::boolean, {1, 5});
  HostTensor out(DType::f32, {1, 3, 4});
  const graph::Attrs attrs{{"scale", 1.0}};
  expect_error<ShapeError>([&] { run_kernel(graph::Op::attention, attrs, {q.view(), k.view(), k.view(), mask.view()}, {out.view()}); },
                           "attention: q's 3 heads are not a multiple of k's 2 kv heads");
  HostTensor k1(DType::f32, {5, 1, 4}), short_mask(DType::boolean, {1, 4});
  expect_error<ShapeError>(
      [&] { run_kernel(graph::Op::attention, attrs, {q.view(), k1.view(), k1.view(), short_mask.view()}, {out.view()}); },
      "masked [seq, total]; got q f32[1, 3, 4], k f32[5, 1, 4], v f32[5, 1, 4], masked bool[1, 4]");
  HostTensor k_f16(DType::f16, {5, 1, 4});
  expect_error<DTypeError>(
      [&] { run_kernel(graph::Op::attention, attrs, {q.view(), k_f16.view(), k_f16.view(), mask.view()}, {out.view()}); },
      "attention: q, k and v must share a float dtype");
}
