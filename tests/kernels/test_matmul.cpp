// The CPU matmul kernel against a naive reference written here in double (numpy's matmul rules
// spelled out index by index), for every dtype it accepts, odd sizes, broadcasting, rank-1 operands,
// strided operands and threaded runs.
#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "kernels/kernel_test_util.h"
#include "kernels/threaded_parallel.h"
#include "kernels/view_values.h"

namespace kiln::kernels {
namespace {

using graph::Op;
using kernel_test::HostTensor;
using kernel_test::logical_values;
using kernel_test::permuted;
using kernel_test::run_kernel;
using kernel_test::tensor;
using kernel_test::tensor_from_doubles;
using kernel_test::ThreadedParallel;

constexpr DType kMatmulDTypes[] = {DType::f32, DType::f64, DType::f16, DType::bf16, DType::i8, DType::i16,
                                   DType::i32, DType::i64, DType::u8,  DType::u16,  DType::u32, DType::u64};

// Values every dtype holds exactly: small integers for integer dtypes, else uniform in [-1, 1].
std::vector<double> random_values(DType dtype, int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<double> v(static_cast<size_t>(n));
  for (double& x : v) {
    if (is_float(dtype))
      x = std::uniform_real_distribution<double>(-1, 1)(rng);
    else if (is_signed(dtype))
      x = std::uniform_int_distribution<int>(-4, 4)(rng);
    else
      x = std::uniform_int_distribution<int>(0, 6)(rng);
  }
  return v;
}

HostTensor random_tensor(DType dtype, std::vector<int64_t> shape, uint32_t seed) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return tensor_from_doubles(dtype, std::move(shape), random_values(dtype, n, seed));
}

std::vector<int64_t> unravel(int64_t i, const std::vector<int64_t>& shape) {
  std::vector<int64_t> index(shape.size());
  for (size_t d = shape.size(); d-- > 0;) {
    index[d] = i % shape[d];
    i /= shape[d];
  }
  return index;
}

struct Reference {
  std::vector<int64_t> shape;
  std::vector<double> values;   // exact sums of products
  std::vector<double> abs_sums;  // sum of |products|: scales the rounding error allowed
  int64_t K = 0;
};

// numpy.matmul, one result element at a time.
Reference reference_matmul(const TensorView& a, const TensorView& b) {
  const bool a_vec = a.shape.size() == 1, b_vec = b.shape.size() == 1;
  std::vector<int64_t> as = a.shape, bs = b.shape;
  if (a_vec) as.insert(as.begin(), 1);
  if (b_vec) bs.push_back(1);
  const int64_t M = as[as.size() - 2], K = as.back(), N = bs.back();
  std::vector<int64_t> abatch(as.begin(), as.end() - 2), bbatch(bs.begin(), bs.end() - 2);
  const size_t nb = std::max(abatch.size(), bbatch.size());
  abatch.insert(abatch.begin(), nb - abatch.size(), 1);
  bbatch.insert(bbatch.begin(), nb - bbatch.size(), 1);
  std::vector<int64_t> batch(nb);
  for (size_t i = 0; i < nb; ++i) batch[i] = std::max(abatch[i], bbatch[i]);
  Reference r;
  r.K = K;
  r.shape = batch;
  if (!a_vec) r.shape.push_back(M);
  if (!b_vec) r.shape.push_back(N);
  const std::vector<double> av = logical_values(a), bv = logical_values(b);
  int64_t batch_count = 1;
  for (int64_t d : batch) batch_count *= d;
  for (int64_t i = 0; i < batch_count; ++i) {
    // The operands' batch numbers: right-aligned, index 0 along their size-1 (broadcast) dims.
    const std::vector<int64_t> idx = unravel(i, batch);
    int64_t a_batch = 0, b_batch = 0;
    for (size_t d = 0; d < nb; ++d) {
      a_batch = a_batch * abatch[d] + (abatch[d] == 1 ? 0 : idx[d]);
      b_batch = b_batch * bbatch[d] + (bbatch[d] == 1 ? 0 : idx[d]);
    }
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < N; ++n) {
        double sum = 0, abs_sum = 0;
        for (int64_t k = 0; k < K; ++k) {
          const double p = av[(a_batch * M + m) * K + k] * bv[(b_batch * K + k) * N + n];
          sum += p;
          abs_sum += std::abs(p);
        }
        r.values.push_back(sum);
        r.abs_sums.push_back(abs_sum);
      }
  }
  return r;
}

// Integer reference: the exact sum reduced modulo 2^bits, as the dtype's wrap-around gives.
double wrap_to(DType dtype, double exact) {
  const auto v = static_cast<int64_t>(exact);  // test sums are far below 2^53
  return visit_dtype(dtype, [&]<class T>() {
    if constexpr (std::is_integral_v<T>)
      return static_cast<double>(static_cast<T>(static_cast<uint64_t>(v)));
    else
      return exact;
  });
}

// Allowed error: the final rounding to the dtype plus the accumulation error bound (per product,
// K roundings of the accumulator's precision).
double tolerance(DType dtype, double ref, double abs_sum, int64_t K) {
  switch (dtype) {
    case DType::f32: return 2e-7 * K * abs_sum + 1.2e-7 * std::abs(ref) + 1e-30;
    case DType::f64: return 4e-16 * K * abs_sum + 1e-300;
    case DType::f16: return 2e-7 * K * abs_sum + std::ldexp(std::abs(ref), -10) + 1e-7;
    case DType::bf16: return 2e-7 * K * abs_sum + std::ldexp(std::abs(ref), -7) + 1e-30;
    default: return 0;
  }
}

HostTensor run_matmul(const TensorView& a, const TensorView& b, const std::vector<int64_t>& out_shape,
                      Parallel* parallel = nullptr) {
  HostTensor out(a.dtype, out_shape);
  run_kernel(Op::matmul, {}, {a, b}, {out.view()}, parallel);
  return out;
}

// Runs the kernel and checks every element against the reference.
void expect_matches_reference(const TensorView& a, const TensorView& b, const std::string& what) {
  SCOPED_TRACE(what + ": lhs " + describe(a) + " rhs " + describe(b));
  const Reference ref = reference_matmul(a, b);
  const HostTensor out = run_matmul(a, b, ref.shape);
  ASSERT_EQ(out.numel(), static_cast<int64_t>(ref.values.size()));
  int failures = 0;
  for (int64_t i = 0; i < out.numel() && failures < 5; ++i) {
    const double want = is_float(a.dtype) ? ref.values[i] : wrap_to(a.dtype, ref.values[i]);
    const double got = out.as_double(i);
    const double tol = tolerance(a.dtype, want, ref.abs_sums[i], ref.K);
    if (!(std::abs(got - want) <= tol)) {
      ++failures;
      ADD_FAILURE() << "element " << i << ": got " << got << ", want " << want << " (tolerance " << tol << ")";
    }
  }
}

TEST(Matmul, HandComputed2x3Times3x2) {
  const HostTensor a = tensor<float>({2, 3}, {1, 2, 3, 4, 5, 6});
  const HostTensor b = tensor<float>({3, 2}, {7, 8, 9, 10, 11, 12});
  const HostTensor out = run_matmul(a.view(), b.view(), {2, 2});
  // [1*7+2*9+3*11, 1*8+2*10+3*12; 4*7+5*9+6*11, 4*8+5*10+6*12]
  EXPECT_EQ(out.values<float>(), (std::vector<float>{58, 64, 139, 154}));
}

TEST(Matmul, MatchesReferenceForEveryDTypeAndOddSizes) {
  // M x K x N; 9x517x19 spans several K blocks, 65x130x33 several row groups and column panels.
  const std::vector<std::array<int64_t, 3>> sizes = {{1, 1, 1}, {7, 13, 5}, {65, 130, 33}, {9, 517, 19}};
  uint32_t seed = 1;
  for (DType dtype : kMatmulDTypes)
    for (auto [M, K, N] : sizes) {
      const HostTensor a = random_tensor(dtype, {M, K}, seed++);
      const HostTensor b = random_tensor(dtype, {K, N}, seed++);
      expect_matches_reference(a.view(), b.view(), std::string(dtype_name(dtype)));
    }
}

TEST(Matmul, BroadcastsBatchDims) {
  uint32_t seed = 100;
  for (DType dtype : {DType::f32, DType::f64, DType::bf16, DType::i32}) {
    const std::vector<std::pair<std::vector<int64_t>, std::vector<int64_t>>> cases = {
        {{2, 3, 7, 11}, {11, 5}},        // a shared rhs (a linear layer): batches fold into rows
        {{2, 1, 7, 11}, {3, 11, 5}},     // both sides broadcast
        {{7, 11}, {2, 11, 5}},           // shared lhs
        {{4, 2, 9, 8}, {4, 2, 8, 13}},   // equal batch dims (attention)
        {{2, 3, 1, 11}, {11, 30}},       // single rows that fold into one GEMM
    };
    for (const auto& [as, bs] : cases) {
      const HostTensor a = random_tensor(dtype, as, seed++);
      const HostTensor b = random_tensor(dtype, bs, seed++);
      expect_matches_reference(a.view(), b.view(), std::string(dtype_name(dtype)));
    }
  }
}

TEST(Matmul, RankOneOperandsFollowNumpy) {
  const HostTensor v = tensor<float>({3}, {1, 2, 3});
  const HostTensor m = tensor<float>({3, 2}, {1, 0, 0, 1, 1, 1});
  EXPECT_EQ(run_matmul(v.view(), m.view(), {2}).values<float>(), (std::vector<float>{4, 5}));  // [K] x [K, N]
  const HostTensor mt = tensor<float>({2, 3}, {1, 0, 1, 0, 1, 1});
  EXPECT_EQ(run_matmul(mt.view(), v.view(), {2}).values<float>(), (std::vector<float>{4, 5}));  // [M, K] x [K]
  EXPECT_EQ(run_matmul(v.view(), v.view(), {}).values<float>(), (std::vector<float>{14}));      // dot

  uint32_t seed = 200;
  for (DType dtype : {DType::f32, DType::f16, DType::i64}) {
    const std::vector<std::pair<std::vector<int64_t>, std::vector<int64_t>>> cases = {
        {{37}, {37}}, {{37}, {37, 300}}, {{300, 37}, {37}}, {{2, 3, 37}, {37}}, {{37}, {2, 37, 9}}};
    for (const auto& [as, bs] : cases) {
      const HostTensor a = random_tensor(dtype, as, seed++);
      const HostTensor b = random_tensor(dtype, bs, seed++);
      expect_matches_reference(a.view(), b.view(), std::string(dtype_name(dtype)));
    }
  }
}

TEST(Matmul, StridedAndTransposedOperands) {
  uint32_t seed = 300;
  for (DType dtype : {DType::f32, DType::f64, DType::f16, DType::u16}) {
    for (auto [M, K, N] : std::vector<std::array<int64_t, 3>>{{1, 77, 300}, {1, 300, 77}, {23, 45, 67}}) {
      // Stored transposed ([K, M] and [N, K]) and viewed back as [M, K] and [K, N].
      const HostTensor at = random_tensor(dtype, {K, M}, seed++);
      const HostTensor bt = random_tensor(dtype, {N, K}, seed++);
      const HostTensor a = random_tensor(dtype, {M, K}, seed++);
      const HostTensor b = random_tensor(dtype, {K, N}, seed++);
      const TensorView a_t = permuted(at.view(), {1, 0}), b_t = permuted(bt.view(), {1, 0});
      expect_matches_reference(a_t, b.view(), "transposed lhs");
      expect_matches_reference(a.view(), b_t, "transposed rhs (a [N, K] weight)");
      expect_matches_reference(a_t, b_t, "both transposed");
      // Every other column of a wider tensor: no unit stride anywhere.
      const HostTensor wide = random_tensor(dtype, {K, 2 * N}, seed++);
      TensorView every_other = wide.view();
      every_other.shape = {K, N};
      every_other.strides = {2 * N, 2};
      expect_matches_reference(a_t, every_other, "column stride 2");
    }
  }
  // A transposed batch: [B, K, M] viewed as [B, M, K] against a shared [K, N].
  const HostTensor at = random_tensor(DType::f32, {3, 16, 10}, seed++);
  const HostTensor b = random_tensor(DType::f32, {16, 20}, seed++);
  expect_matches_reference(permuted(at.view(), {0, 2, 1}), b.view(), "batched transposed lhs");
}

TEST(Matmul, IntegersWrapAround) {
  // 100*2 + 100*1 = 300 = 44 mod 256; 200*2 + 100*1 = 500 = 244 mod 256.
  EXPECT_EQ(run_matmul(tensor<int8_t>({1, 2}, {100, 100}).view(), tensor<int8_t>({2, 1}, {2, 1}).view(), {1, 1})
                .values<int8_t>(),
            (std::vector<int8_t>{44}));
  EXPECT_EQ(run_matmul(tensor<uint8_t>({1, 2}, {200, 100}).view(), tensor<uint8_t>({2, 1}, {2, 1}).view(), {1, 1})
                .values<uint8_t>(),
            (std::vector<uint8_t>{244}));
  // 65535 * 65535 overflows int if u16 were promoted to int: the kernel must not.
  EXPECT_EQ(run_matmul(tensor<uint16_t>({1, 1}, {65535}).view(), tensor<uint16_t>({1, 1}, {65535}).view(), {1, 1})
                .values<uint16_t>(),
            (std::vector<uint16_t>{1}));
  EXPECT_EQ(run_matmul(tensor<int32_t>({1, 2}, {INT32_MAX, 1}).view(), tensor<int32_t>({2, 1}, {1, 1}).view(),
                       {1, 1})
                .values<int32_t>(),
            (std::vector<int32_t>{INT32_MIN}));
}

TEST(Matmul, EmptyInnerDimGivesZeros) {
  HostTensor out(DType::f32, {2, 3});
  out.bytes.assign(out.bytes.size(), 0xff);  // garbage the kernel must overwrite
  run_kernel(Op::matmul, {}, {HostTensor(DType::f32, {2, 0}).view(), HostTensor(DType::f32, {0, 3}).view()},
             {out.view()});
  EXPECT_EQ(out.values<float>(), std::vector<float>(6, 0.0f));
}

TEST(Matmul, ThreadedRunEqualsSerial) {
  ThreadedParallel threads(4);
  uint32_t seed = 400;
  const std::vector<std::pair<std::vector<int64_t>, std::vector<int64_t>>> cases = {
      {{200, 70}, {70, 600}},       // GEMM tiles over rows and columns
      {{1, 64}, {64, 5000}},        // GEMV over column blocks
      {{8, 48, 48}, {8, 48, 48}},   // many small matrices: one batch per chunk
  };
  for (DType dtype : {DType::f32, DType::f64, DType::bf16, DType::i32}) {
    for (const auto& [as, bs] : cases) {
      const HostTensor a = random_tensor(dtype, as, seed++);
      const HostTensor b = random_tensor(dtype, bs, seed++);
      const Reference ref = reference_matmul(a.view(), b.view());
      const int64_t before = threads.chunks_run();
      const HostTensor serial = run_matmul(a.view(), b.view(), ref.shape);
      const HostTensor threaded = run_matmul(a.view(), b.view(), ref.shape, &threads);
      EXPECT_GT(threads.chunks_run() - before, 1) << "the work was not split";
      EXPECT_EQ(serial.bytes, threaded.bytes) << dtype_name(dtype) << " " << describe(a.view());
    }
  }
  // And against the reference, not only against itself.
  const HostTensor a = random_tensor(DType::f32, {200, 70}, 1);
  const HostTensor b = random_tensor(DType::f32, {70, 600}, 2);
  const Reference ref = reference_matmul(a.view(), b.view());
  const HostTensor threaded = run_matmul(a.view(), b.view(), ref.shape, &threads);
  for (int64_t i = 0; i < threaded.numel(); ++i)
    ASSERT_NEAR(threaded.as_double(i), ref.values[i], tolerance(DType::f32, ref.values[i], ref.abs_sums[i], 70));
}

template <class E>
std::string error_of(const TensorView& a, const TensorView& b, const std::vector<int64_t>& out_shape,
                     DType out_dtype) {
  HostTensor out(out_dtype, out_shape);
  try {
    run_kernel(Op::matmul, {}, {a, b}, {out.view()});
  } catch (const E& e) {
    return e.what();
  }
  return "no error";
}

TEST(Matmul, RejectsBadOperandsWithClearErrors) {
  const HostTensor a = HostTensor(DType::f32, {2, 4}), b = HostTensor(DType::f32, {5, 3});
  EXPECT_EQ(error_of<ShapeError>(a.view(), b.view(), {2, 3}, DType::f32),
            "matmul: lhs inner dim 4 does not match rhs dim 0 of 5 (lhs f32[2, 4], rhs f32[5, 3])");
  const HostTensor a3 = HostTensor(DType::f32, {2, 3, 4}), b3 = HostTensor(DType::f32, {4, 4, 5});
  EXPECT_EQ(error_of<ShapeError>(a3.view(), b3.view(), {2, 3, 5}, DType::f32),
            "matmul: batch dims 2 and 4 do not broadcast (lhs f32[2, 3, 4], rhs f32[4, 4, 5])");
  // f32 x f16/bf16 weights is the one allowed mix; an f16 lhs with an f32 rhs is not.
  const HostTensor ah = HostTensor(DType::f16, {2, 4});
  const HostTensor b4 = HostTensor(DType::f32, {4, 3});
  EXPECT_NE(error_of<DTypeError>(ah.view(), b4.view(), {2, 3}, DType::f16).find("share one dtype"),
            std::string::npos);
  EXPECT_EQ(error_of<ShapeError>(a.view(), b4.view(), {3, 2}, DType::f32),
            "matmul: result f32[3, 2] should be f32[2, 3] (lhs f32[2, 4], rhs f32[4, 3])");
  EXPECT_FALSE(cpu_kernels().contains({Op::matmul, DeviceKind::CPU, DType::boolean}));
}

}  // namespace
}  // namespace kiln::kernels
