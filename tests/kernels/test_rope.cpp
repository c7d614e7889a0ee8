// The rope kernel against the rotate-half formula written here in double (f32, f64, f16, bf16; x read
// through strides; threads equal to serial), and its operand checks.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "kernel_test_util.h"
#include "test_util.h"
#include "threaded_parallel.h"

namespace {

using namespace kiln;
using namespace kiln::kernels;
using namespace kiln::kernels::kernel_test;
using kiln::testing::expect_error;

// out[s, h, i] = x[s, h, i] cos[s, i] + r[s, h, i] sin[s, i], r = (-x[.., half:], x[.., :half]).
std::vector<double> naive_rope(const std::vector<double>& x, const std::vector<double>& c, const std::vector<double>& s,
                               int64_t seq, int64_t heads, int64_t hd) {
  std::vector<double> out(x.size());
  const int64_t half = hd / 2;
  for (int64_t t = 0; t < seq; ++t)
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t i = 0; i < hd; ++i) {
        const size_t at = static_cast<size_t>((t * heads + h) * hd);
        const double rotated = i < half ? -x[at + static_cast<size_t>(i + half)] : x[at + static_cast<size_t>(i - half)];
        out[at + static_cast<size_t>(i)] = x[at + static_cast<size_t>(i)] * c[static_cast<size_t>(t * hd + i)] +
                                           rotated * s[static_cast<size_t>(t * hd + i)];
      }
  return out;
}

std::vector<double> values(const HostTensor& t) {
  std::vector<double> out;
  for (int64_t i = 0; i < t.numel(); ++i) out.push_back(t.as_double(i));
  return out;
}

TEST(RopeKernel, MatchesTheRotateHalfFormulaInEveryFloatDType) {
  constexpr int64_t kSeq = 5, kHeads = 3, kHd = 10;
  for (DType dtype : {DType::f32, DType::f64, DType::f16, DType::bf16}) {
    const HostTensor x = tensor_from_doubles(dtype, {kSeq, kHeads, kHd}, pseudo_random(kSeq * kHeads * kHd, 1));
    const HostTensor c = tensor_from_doubles(dtype, {kSeq, kHd}, pseudo_random(kSeq * kHd, 2));
    const HostTensor s = tensor_from_doubles(dtype, {kSeq, kHd}, pseudo_random(kSeq * kHd, 3));
    const std::vector<double> want = naive_rope(values(x), values(c), values(s), kSeq, kHeads, kHd);
    const HostTensor got = run_op(graph::Op::rope, {}, {x.view(), c.view(), s.view()}, dtype, {kSeq, kHeads, kHd});
    // Two products and a sum, each rounded to the dtype.
    const double tolerance = dtype == DType::f64 ? 1e-15 : dtype == DType::f32 ? 1e-6 : dtype == DType::f16 ? 4e-3 : 3e-2;
    for (int64_t i = 0; i < got.numel(); ++i)
      ASSERT_NEAR(got.as_double(i), want[static_cast<size_t>(i)], tolerance) << dtype_name(dtype) << " element " << i;

    ThreadedParallel threads(3);
    HostTensor threaded(dtype, {kSeq, kHeads, kHd});
    run_kernel(graph::Op::rope, {}, {x.view(), c.view(), s.view()}, {threaded.view()}, &threads);
    EXPECT_EQ(threaded.bytes, got.bytes) << dtype_name(dtype);
  }
}

TEST(RopeKernel, ReadsStridedOperands) {
  constexpr int64_t kSeq = 4, kHeads = 2, kHd = 6;
  // x stored [heads, seq, hd] and read as [seq, heads, hd]; cos stored transposed [hd, seq].
  const HostTensor x_stored = tensor_from_doubles(DType::f32, {kHeads, kSeq, kHd}, pseudo_random(kSeq * kHeads * kHd, 4));
  const HostTensor c_stored = tensor_from_doubles(DType::f32, {kHd, kSeq}, pseudo_random(kSeq * kHd, 5));
  const HostTensor s = tensor_from_doubles(DType::f32, {kSeq, kHd}, pseudo_random(kSeq * kHd, 6));
  const TensorView x = permuted(x_stored.view(), {1, 0, 2});
  const TensorView c = permuted(c_stored.view(), {1, 0});
  std::vector<double> xv, cv;
  for (int64_t t = 0; t < kSeq; ++t)
    for (int64_t h = 0; h < kHeads; ++h)
      for (int64_t i = 0; i < kHd; ++i) xv.push_back(x_stored.as_double((h * kSeq + t) * kHd + i));
  for (int64_t t = 0; t < kSeq; ++t)
    for (int64_t i = 0; i < kHd; ++i) cv.push_back(c_stored.as_double(i * kSeq + t));
  const std::vector<double> want = naive_rope(xv, cv, values(s), kSeq, kHeads, kHd);
  const HostTensor got = run_op(graph::Op::rope, {}, {x, c, s.view()}, DType::f32, {kSeq, kHeads, kHd});
  for (int64_t i = 0; i < got.numel(); ++i) EXPECT_NEAR(got.as_double(i), want[static_cast<size_t>(i)], 1e-6) << i;
}

TEST(RopeKernel, RejectsOperandsThatDoNotFit) {
  const HostTensor x = tensor_from_doubles(DType::f32, {2, 1, 4}, pseudo_random(8, 1));
  const HostTensor odd = tensor_from_doubles(DType::f32, {2, 1, 3}, pseudo_random(6, 1));
  const HostTensor c = tensor_from_doubles(DType::f32, {2, 4}, pseudo_random(8, 2));
  const HostTensor c3 = tensor_from_doubles(DType::f32, {2, 3}, pseudo_random(6, 2));
  const HostTensor c_f16 = tensor_from_doubles(DType::f16, {2, 4}, pseudo_random(8, 2));
  HostTensor out(DType::f32, {2, 1, 4});
  HostTensor out3(DType::f32, {2, 1, 3});
  expect_error<ShapeError>([&] { run_kernel(graph::Op::rope, {}, {x.view(), c3.view(), c3.view()}, {out.view()}); },
                           "rope: expected x [seq, heads, head_dim] (head_dim even)");
  expect_error<ShapeError>([&] { run_kernel(graph::Op::rope, {}, {odd.view(), c3.view(), c3.view()}, {out3.view()}); },
                           "head_dim even");
  expect_error<DTypeError>([&] { run_kernel(graph::Op::rope, {}, {x.view(), c_f16.view(), c.view()}, {out.view()}); },
                           "rope: x, cos and sin must share a float dtype");
  expect_error<ShapeError>([&] { run_kernel(graph::Op::rope, {}, {x.view(), c.view(), c.view()}, {out3.view()}); },
                           "rope: the result");
}

}  // namespace
