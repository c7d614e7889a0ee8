// The CPU normalization kernels (softmax, log_softmax, rms_norm, layer_norm) against hand-computed
// values and naive reference loops in double, for every float dtype, strided inputs and threads.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "kernels/kernel_test_util.h"
#include "kernels/threaded_parallel.h"
#include "kernels/view_values.h"

namespace kiln::kernels {
namespace {

using graph::Attrs;
using graph::Op;
using kernel_test::HostTensor;
using kernel_test::logical_values;
using kernel_test::permuted;
using kernel_test::run_kernel;
using kernel_test::run_op;
using kernel_test::tensor;
using kernel_test::tensor_from_doubles;
using kernel_test::ThreadedParallel;

constexpr DType kFloats[] = {DType::f32, DType::f64, DType::f16, DType::bf16};

std::vector<double> random_values(int64_t n, uint32_t seed, double lo = -3, double hi = 3) {
  std::mt19937 rng(seed);
  std::vector<double> v(static_cast<size_t>(n));
  for (double& x : v) x = std::uniform_real_distribution<double>(lo, hi)(rng);
  return v;
}

// The result's own rounding plus a little for computing in f32.
double tolerance(DType dtype, double want) {
  switch (dtype) {
    case DType::f32: return 2e-6 * std::abs(want) + 2e-6;
    case DType::f64: return 1e-12 * std::abs(want) + 1e-12;
    case DType::f16: return std::ldexp(std::abs(want), -10) + 1e-4;
    default: return std::ldexp(std::abs(want), -7) + 1e-3;  // bf16
  }
}

void expect_near_all(const HostTensor& got, const std::vector<double>& want, const std::string& what) {
  ASSERT_EQ(got.numel(), static_cast<int64_t>(want.size())) << what;
  for (int64_t i = 0; i < got.numel(); ++i)
    ASSERT_LE(std::abs(got.as_double(i) - want[i]), tolerance(got.dtype, want[i]))
        << what << " element " << i << ": got " << got.as_double(i) << ", want " << want[i];
}

TEST(Softmax, HandComputed) {
  // exp of [0, ln 2, ln 3] is [1, 2, 3]: softmax [1/6, 2/6, 3/6].
  const HostTensor x = tensor<double>({3}, {0, std::log(2.0), std::log(3.0)});
  expect_near_all(run_op(Op::softmax, {{"axis", int64_t{0}}}, {x.view()}, DType::f64, {3}),
                  {1.0 / 6, 2.0 / 6, 3.0 / 6}, "softmax");
  expect_near_all(run_op(Op::log_softmax, {{"axis", int64_t{0}}}, {x.view()}, DType::f64, {3}),
                  {std::log(1.0 / 6), std::log(2.0 / 6), std::log(3.0 / 6)}, "log_softmax");
}

TEST(Softmax, LargeLogitsDoNotOverflow) {
  const HostTensor x = tensor<float>({2, 2}, {1000, 1000, 1000, 0});
  expect_near_all(run_op(Op::softmax, {{"axis", int64_t{1}}}, {x.view()}, DType::f32, {2, 2}),
                  {0.5, 0.5, 1.0, 0.0}, "softmax");
  expect_near_all(run_op(Op::log_softmax, {{"axis", int64_t{1}}}, {x.view()}, DType::f32, {2, 2}),
                  {-std::log(2.0), -std::log(2.0), 0.0, -1000.0}, "log_softmax");
  // A masked-out (-inf) entry gets probability 0.
  const HostTensor masked = tensor<float>({3}, {1, -INFINITY, 1});
  expect_near_all(run_op(Op::softmax, {{"axis", int64_t{0}}}, {masked.view()}, DType::f32, {3}), {0.5, 0.0, 0.5},
                  "masked softmax");
}

// softmax and log_softmax on every axis of a [3, 5, 7] input, contiguous and transposed.
TEST(Softmax, MatchesReferenceForEveryFloatDTypeAxisAndLayout) {
  uint32_t seed = 1;
  for (DType dtype : kFloats) {
    const HostTensor contiguous = tensor_from_doubles(dtype, {3, 5, 7}, random_values(105, seed++));
    const HostTensor stored = tensor_from_doubles(dtype, {7, 5, 3}, random_values(105, seed++));
    for (const TensorView& x : {contiguous.view(), permuted(stored.view(), {2, 1, 0})}) {
      const std::vector<double> xs = logical_values(x);
      for (int64_t ax = 0; ax < 3; ++ax) {
        int64_t outer = 1, length = x.shape[static_cast<size_t>(ax)], inner = 1;
        for (int64_t d = 0; d < ax; ++d) outer *= x.shape[static_cast<size_t>(d)];
        for (int64_t d = ax + 1; d < 3; ++d) inner *= x.shape[static_cast<size_t>(d)];
        std::vector<double> soft(xs.size()), logsoft(xs.size());
        for (int64_t o = 0; o < outer; ++o)
          for (int64_t i = 0; i < inner; ++i) {
            double total = 0;
            for (int64_t t = 0; t < length; ++t) total += std::exp(xs[(o * length + t) * inner + i]);
            for (int64_t t = 0; t < length; ++t) {
              const int64_t at = (o * length + t) * inner + i;
              soft[at] = std::exp(xs[at]) / total;
              logsoft[at] = xs[at] - std::log(total);
            }
          }
        const std::string what = std::string(dtype_name(dtype)) + " axis " + std::to_string(ax) +
                                 (x.is_contiguous() ? "" : " strided");
        expect_near_all(run_op(Op::softmax, {{"axis", ax}}, {x}, dtype, x.shape), soft, "softmax " + what);
        expect_near_all(run_op(Op::log_softmax, {{"axis", ax}}, {x}, dtype, x.shape), logsoft, "log_softmax " + what);
      }
    }
  }
}

TEST(RmsNorm, HandComputed) {
  // Row [2, -2]: mean of squares 4, rms 2. Row [3, 4]: mean of squares 12.5.
  const HostTensor x = tensor<float>({2, 2}, {2, -2, 3, 4});
  const HostTensor w = tensor<float>({2}, {1, 3});
  const double r = std::sqrt(12.5);
  expect_near_all(run_op(Op::rms_norm, {{"epsilon", 0.0}}, {x.view(), w.view()}, DType::f32, {2, 2}),
                  {1, -3, 3 / r, 12 / r}, "rms_norm");
  // epsilon is added to the mean of squares: 4 + 5 = 9, rms 3.
  expect_near_all(run_op(Op::rms_norm, {{"epsilon", 5.0}}, {x.view(), w.view()}, DType::f32, {2, 2}),
                  {2.0 / 3, -2.0, 3 / std::sqrt(17.5), 12 / std::sqrt(17.5)}, "rms_norm with epsilon");
}

TEST(LayerNorm, HandComputedWithBiasedVariance) {
  // [1, 2, 3, 4]: mean 2.5, biased variance 1.25.
  const HostTensor x = tensor<float>({4}, {1, 2, 3, 4});
  const HostTensor gamma = tensor<float>({4}, {2, 2, 2, 2}), beta = tensor<float>({4}, {1, 1, 1, 1});
  const double s = std::sqrt(1.25);
  expect_near_all(run_op(Op::layer_norm, {{"epsilon", 0.0}}, {x.view(), gamma.view(), beta.view()}, DType::f32, {4}),
                  {1 - 3 / s, 1 - 1 / s, 1 + 1 / s, 1 + 3 / s}, "layer_norm");
}

// Both norms on [5, 37] inputs (contiguous and transposed) with strided weights, against references.
TEST(Norms, MatchReferenceForEveryFloatDTypeAndLayout) {
  uint32_t seed = 50;
  const int64_t rows = 5, dim = 37;
  for (DType dtype : kFloats) {
    // An offset makes |mean| large next to the spread, which a one-pass variance would get wrong.
    const HostTensor contiguous = tensor_from_doubles(dtype, {rows, dim}, random_values(rows * dim, seed++, 6, 10));
    const HostTensor stored = tensor_from_doubles(dtype, {dim, rows}, random_values(rows * dim, seed++));
    // Weights read with stride 2 from a [2 * dim] tensor.
    const HostTensor wide_w = tensor_from_doubles(dtype, {2 * dim}, random_values(2 * dim, seed++, 0.5, 1.5));
    const HostTensor beta = tensor_from_doubles(dtype, {dim}, random_values(dim, seed++));
    TensorView w = wide_w.view();
    w.shape = {dim};
    w.strides = {2};
    const std::vector<double> ws = logical_values(w), bs = logical_values(beta.view());
    for (const TensorView& x : {contiguous.view(), permuted(stored.view(), {1, 0})}) {
      const std::vector<double> xs = logical_values(x);
      const double eps = 1e-5;
      std::vector<double> rms(xs.size()), layer(xs.size());
      for (int64_t r = 0; r < rows; ++r) {
        double sq = 0, total = 0;
        for (int64_t t = 0; t < dim; ++t) {
          sq += xs[r * dim + t] * xs[r * dim + t];
          total += xs[r * dim + t];
        }
        const double mean = total / dim;
        double var = 0;
        for (int64_t t = 0; t < dim; ++t) var += (xs[r * dim + t] - mean) * (xs[r * dim + t] - mean);
        var /= dim;
        for (int64_t t = 0; t < dim; ++t) {
          rms[r * dim + t] = xs[r * dim + t] / std::sqrt(sq / dim + eps) * ws[t];
          layer[r * dim + t] = (xs[r * dim + t] - mean) / std::sqrt(var + eps) * ws[t] + bs[t];
        }
      }
      const std::string what = std::string(dtype_name(dtype)) + (x.is_contiguous() ? "" : " strided");
      expect_near_all(run_op(Op::rms_norm, {{"epsilon", eps}}, {x, w}, dtype, x.shape), rms, "rms_norm " + what);
      expect_near_all(run_op(Op::layer_norm, {{"epsilon", eps}}, {x, w, beta.view()}, dtype, x.shape), layer,
                      "layer_norm " + what);
    }
  }
}

TEST(Norms, ThreadedRunEqualsSerial) {
  ThreadedParallel threads(4);
  const int64_t rows = 2048, dim = 64;
  for (DType dtype : {DType::f32, DType::bf16}) {
    const HostTensor x = tensor_from_doubles(dtype, {rows, dim}, random_values(rows * dim, 9));
    const HostTensor w = tensor_from_doubles(dtype, {dim}, random_values(dim, 10));
    const HostTensor b = tensor_from_doubles(dtype, {dim}, random_values(dim, 11));
    const std::vector<std::pair<Op, std::vector<TensorView>>> cases = {
        {Op::softmax, {x.view()}}, {Op::log_softmax, {x.view()}}, {Op::rms_norm, {x.view(), w.view()}},
        {Op::layer_norm, {x.view(), w.view(), b.view()}}};
    for (const auto& [op, inputs] : cases) {
      const Attrs attrs = {{"axis", int64_t{1}}, {"epsilon", 1e-6}};
      HostTensor serial(dtype, {rows, dim}), threaded(dtype, {rows, dim});
      run_kernel(op, attrs, inputs, {serial.view()});
      const int64_t before = threads.chunks_run();
      run_kernel(op, attrs, inputs, {threaded.view()}, &threads);
      EXPECT_GT(threads.chunks_run() - before, 1) << graph::op_name(op);
      EXPECT_EQ(serial.bytes, threaded.bytes) << graph::op_name(op) << " " << dtype_name(dtype);
    }
  }
}

template <class E> std::string error_of(Op op, const Attrs& attrs, const std::vector<TensorView>& inputs,
                                        const HostTensor& out) {
  try {
    run_kernel(op, attrs, inputs, {out.view()});
  } catch (const E& e) {
    return e.what();
  }
  return "no error";
}

TEST(Norms, RejectBadInputWithClearErrors) {
  const HostTensor x(DType::f32, {2, 4}), out(DType::f32, {2, 4});
  EXPECT_EQ(error_of<ShapeError>(Op::rms_norm, {{"epsilon", 1e-6}}, {x.view(), HostTensor(DType::f32, {3}).view()},
                                 out),
            "rms_norm: weight f32[3] must be [4] (x's last dim; x f32[2, 4])");
  EXPECT_EQ(error_of<DTypeError>(Op::layer_norm, {{"epsilon", 1e-6}},
                                 {x.view(), HostTensor(DType::f32, {4}).view(), HostTensor(DType::f16, {4}).view()},
                                 out),
            "layer_norm: beta f16[4] must have x's dtype (x f32[2, 4])");
  EXPECT_EQ(error_of<ValueError>(Op::softmax, {{"axis", int64_t{2}}}, {x.view()}, out),
            "softmax: axis 2 is out of range for f32[2, 4]");
  EXPECT_EQ(error_of<ValueError>(Op::rms_norm, {}, {x.view(), HostTensor(DType::f32, {4}).view()}, out),
            "rms_norm: missing attribute 'epsilon'");
  EXPECT_FALSE(cpu_kernels().contains({Op::softmax, DeviceKind::CPU, DType::i32}));
}

}  // namespace
}  // namespace kiln::kernels
