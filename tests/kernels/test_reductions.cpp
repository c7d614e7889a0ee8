// The CPU reduction kernels (sum, mean, max, min, argmax, argmin, cumsum, top_k) against hand-computed
// values and naive reference loops in double, for every dtype, every axis, strided inputs and threads.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
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

constexpr DType kNumeric[] = {DType::f32, DType::f64, DType::f16, DType::bf16, DType::i8,  DType::i16,
                              DType::i32, DType::i64, DType::u8,  DType::u16,  DType::u32, DType::u64};
const double kNaN = std::numeric_limits<double>::quiet_NaN();

Attrs axis(int64_t a) { return {{"axis", a}}; }

std::vector<double> random_values(DType dtype, int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<double> v(static_cast<size_t>(n));
  for (double& x : v) {
    if (is_float(dtype))
      x = std::uniform_real_distribution<double>(-2, 2)(rng);
    else if (is_signed(dtype))
      x = std::uniform_int_distribution<int>(-5, 5)(rng);  // small: many ties, no overflow
    else
      x = std::uniform_int_distribution<int>(0, 9)(rng);
  }
  return v;
}

// A shape split at `axis` into (outer, length, inner), for reference loops over a row-major layout.
struct Split {
  int64_t outer = 1, length = 1, inner = 1;
  Split(const std::vector<int64_t>& shape, int64_t axis) {
    for (int64_t d = 0; d < static_cast<int64_t>(shape.size()); ++d)
      (d < axis ? outer : d == axis ? length : inner) *= shape[static_cast<size_t>(d)];
  }
  int64_t at(int64_t o, int64_t t, int64_t i, int64_t len) const { return (o * len + t) * inner + i; }
};

std::vector<int64_t> with_axis(std::vector<int64_t> shape, int64_t axis, int64_t size) {
  shape[static_cast<size_t>(axis)] = size;
  return shape;
}

// Allowed error of a float result: its own rounding plus the accumulation (in f32 for f16/bf16).
double tolerance(DType dtype, double want, double abs_sum) {
  switch (dtype) {
    case DType::f32: return 1e-6 * std::abs(want) + 1e-12 * abs_sum;
    case DType::f64: return 1e-14 * (std::abs(want) + abs_sum);
    case DType::f16: return std::ldexp(std::abs(want), -10) + 1e-6 * abs_sum + 1e-7;
    case DType::bf16: return std::ldexp(std::abs(want), -7) + 1e-6 * abs_sum;
    default: return 0;
  }
}

void expect_near_all(const HostTensor& got, const std::vector<double>& want, const std::vector<double>& abs_sums,
                     const std::string& what) {
  ASSERT_EQ(got.numel(), static_cast<int64_t>(want.size())) << what;
  for (int64_t i = 0; i < got.numel(); ++i) {
    const double tol = tolerance(got.dtype, want[i], abs_sums[i]);
    ASSERT_LE(std::abs(got.as_double(i) - want[i]), tol) << what << " element " << i;
  }
}

TEST(Reductions, HandComputedOverEachAxis) {
  // [[1, 5, 3], [4, 2, 6]]
  const HostTensor x = tensor<float>({2, 3}, {1, 5, 3, 4, 2, 6});
  EXPECT_EQ(run_op(Op::sum, axis(0), {x.view()}, DType::f32, {1, 3}).values<float>(), (std::vector<float>{5, 7, 9}));
  EXPECT_EQ(run_op(Op::sum, axis(1), {x.view()}, DType::f32, {2, 1}).values<float>(), (std::vector<float>{9, 12}));
  EXPECT_EQ(run_op(Op::mean, axis(1), {x.view()}, DType::f32, {2, 1}).values<float>(), (std::vector<float>{3, 4}));
  EXPECT_EQ(run_op(Op::max, axis(1), {x.view()}, DType::f32, {2, 1}).values<float>(), (std::vector<float>{5, 6}));
  EXPECT_EQ(run_op(Op::min, axis(0), {x.view()}, DType::f32, {1, 3}).values<float>(), (std::vector<float>{1, 2, 3}));
  EXPECT_EQ(run_op(Op::argmax, axis(1), {x.view()}, DType::i64, {2, 1}).values<int64_t>(),
            (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(run_op(Op::argmin, axis(0), {x.view()}, DType::i64, {1, 3}).values<int64_t>(),
            (std::vector<int64_t>{0, 1, 0}));
  // A negative axis counts from the end.
  EXPECT_EQ(run_op(Op::sum, axis(-1), {x.view()}, DType::f32, {2, 1}).values<float>(), (std::vector<float>{9, 12}));
}

TEST(Reductions, TiesPickTheFirstIndex) {
  const HostTensor x = tensor<int32_t>({5}, {3, 1, 3, 1, 2});
  EXPECT_EQ(run_op(Op::argmax, axis(0), {x.view()}, DType::i64, {1}).values<int64_t>(), (std::vector<int64_t>{0}));
  EXPECT_EQ(run_op(Op::argmin, axis(0), {x.view()}, DType::i64, {1}).values<int64_t>(), (std::vector<int64_t>{1}));
}

TEST(Reductions, NaNWinsMaxMinAndArgLikePyTorch) {
  const HostTensor x = tensor<float>({4}, {1, NAN, 5, NAN});
  EXPECT_TRUE(std::isnan(run_op(Op::max, axis(0), {x.view()}, DType::f32, {1}).at<float>(0)));
  EXPECT_TRUE(std::isnan(run_op(Op::min, axis(0), {x.view()}, DType::f32, {1}).at<float>(0)));
  EXPECT_EQ(run_op(Op::argmax, axis(0), {x.view()}, DType::i64, {1}).at<int64_t>(0), 1);
  EXPECT_EQ(run_op(Op::argmin, axis(0), {x.view()}, DType::i64, {1}).at<int64_t>(0), 1);
}

TEST(Reductions, CumsumFlagsHandComputed) {
  const HostTensor x = tensor<int32_t>({4}, {1, 2, 3, 4});
  auto cumsum = [&](int64_t exclusive, int64_t reverse) {
    return run_op(Op::cumsum, {{"axis", int64_t{0}}, {"exclusive", exclusive}, {"reverse", reverse}}, {x.view()},
                  DType::i32, {4})
        .values<int32_t>();
  };
  EXPECT_EQ(cumsum(0, 0), (std::vector<int32_t>{1, 3, 6, 10}));
  EXPECT_EQ(cumsum(1, 0), (std::vector<int32_t>{0, 1, 3, 6}));
  EXPECT_EQ(cumsum(0, 1), (std::vector<int32_t>{10, 9, 7, 4}));
  EXPECT_EQ(cumsum(1, 1), (std::vector<int32_t>{9, 7, 4, 0}));
}

std::pair<HostTensor, HostTensor> run_top_k(const TensorView& x, int64_t k, int64_t ax, Parallel* parallel = nullptr) {
  HostTensor values(x.dtype, with_axis(x.shape, ax, k)), indices(DType::i64, with_axis(x.shape, ax, k));
  run_kernel(Op::top_k, {{"k", k}, {"axis", ax}}, {x}, {values.view(), indices.view()}, parallel);
  return {std::move(values), std::move(indices)};
}

TEST(Reductions, TopKSortsDescendingWithLowerIndexFirstOnTies) {
  const HostTensor x = tensor<float>({2, 4}, {1, 3, 3, 2, /**/ -1, NAN, 0, 7});
  auto [values, indices] = run_top_k(x.view(), 3, 1);
  const std::vector<float> v = values.values<float>();
  EXPECT_EQ(std::vector<float>(v.begin(), v.begin() + 3), (std::vector<float>{3, 3, 2}));
  EXPECT_TRUE(std::isnan(v[3]));  // NaN ranks above every number
  EXPECT_EQ(std::vector<float>(v.begin() + 4, v.end()), (std::vector<float>{7, 0}));
  EXPECT_EQ(indices.values<int64_t>(), (std::vector<int64_t>{1, 2, 3, 1, 3, 2}));
}

TEST(Reductions, IntegerSumsWrapAround) {
  const HostTensor x = tensor<int8_t>({2}, {100, 100});
  EXPECT_EQ(run_op(Op::sum, axis(0), {x.view()}, DType::i8, {1}).at<int8_t>(0), -56);  // 200 - 256
  const HostTensor u = tensor<uint16_t>({2}, {65535, 2});
  EXPECT_EQ(run_op(Op::sum, axis(0), {u.view()}, DType::u16, {1}).at<uint16_t>(0), 1);
}

TEST(Reductions, HalfSumsAccumulateInF32) {
  // In f16, 2048 + 1 rounds back to 2048: a running f16 sum of 4096 ones would stop at 2048.
  const HostTensor ones = tensor_from_doubles(DType::f16, {4096}, std::vector<double>(4096, 1.0));
  EXPECT_EQ(run_op(Op::sum, axis(0), {ones.view()}, DType::f16, {1}).as_double(0), 4096.0);
  const HostTensor bones = tensor_from_doubles(DType::bf16, {1024}, std::vector<double>(1024, 1.0));
  EXPECT_EQ(run_op(Op::sum, axis(0), {bones.view()}, DType::bf16, {1}).as_double(0), 1024.0);
  EXPECT_EQ(run_op(Op::mean, axis(0), {bones.view()}, DType::bf16, {1}).as_double(0), 1.0);
}

// Every op on every axis of a [3, 5, 7] input, contiguous and as a transposed view.
TEST(Reductions, MatchReferenceForEveryDTypeAxisAndLayout) {
  uint32_t seed = 1;
  for (DType dtype : kNumeric) {
    const HostTensor stored = tensor_from_doubles(dtype, {7, 5, 3}, random_values(dtype, 105, seed++));
    const HostTensor contiguous = tensor_from_doubles(dtype, {3, 5, 7}, random_values(dtype, 105, seed++));
    for (const TensorView& x : {contiguous.view(), permuted(stored.view(), {2, 1, 0})}) {
      const std::vector<double> xs = logical_values(x);
      for (int64_t ax = 0; ax < 3; ++ax) {
        const std::string what = std::string(dtype_name(dtype)) + " " + describe(x) + " axis " + std::to_string(ax) +
                                  (x.is_contiguous() ? "" : " strided");
        SCOPED_TRACE(what);
        const Split s(x.shape, ax);
        const std::vector<int64_t> reduced = with_axis(x.shape, ax, 1);
        std::vector<double> sum, mean, mx, mn, argmx, argmn, abs_sum;
        for (int64_t o = 0; o < s.outer; ++o)
          for (int64_t i = 0; i < s.inner; ++i) {
            double total = 0, a = 0;
            int64_t best_max = 0, best_min = 0;
            for (int64_t t = 0; t < s.length; ++t) {
              const double v = xs[s.at(o, t, i, s.length)];
              total += v;
              a += std::abs(v);
              if (v > xs[s.at(o, best_max, i, s.length)]) best_max = t;
              if (v < xs[s.at(o, best_min, i, s.length)]) best_min = t;
            }
            sum.push_back(total);
            mean.push_back(total / s.length);
            abs_sum.push_back(a);
            mx.push_back(xs[s.at(o, best_max, i, s.length)]);
            mn.push_back(xs[s.at(o, best_min, i, s.length)]);
            argmx.push_back(best_max);
            argmn.push_back(best_min);
          }
        expect_near_all(run_op(Op::sum, axis(ax), {x}, dtype, reduced), sum, abs_sum, "sum");
        if (is_float(dtype)) expect_near_all(run_op(Op::mean, axis(ax), {x}, dtype, reduced), mean, abs_sum, "mean");
        const std::vector<double> zeros(sum.size(), 0.0);
        expect_near_all(run_op(Op::max, axis(ax), {x}, dtype, reduced), mx, zeros, "max");
        expect_near_all(run_op(Op::min, axis(ax), {x}, dtype, reduced), mn, zeros, "min");
        expect_near_all(run_op(Op::argmax, axis(ax), {x}, DType::i64, reduced), argmx, zeros, "argmax");
        expect_near_all(run_op(Op::argmin, axis(ax), {x}, DType::i64, reduced), argmn, zeros, "argmin");

        for (int64_t exclusive : {0, 1})
          for (int64_t reverse : {0, 1}) {
            std::vector<double> want(xs.size()), abs_sums(xs.size());
            for (int64_t o = 0; o < s.outer; ++o)
              for (int64_t i = 0; i < s.inner; ++i) {
                double run = 0, a = 0;
                for (int64_t step = 0; step < s.length; ++step) {
                  const int64_t t = reverse ? s.length - 1 - step : step;
                  const double v = xs[s.at(o, t, i, s.length)];
                  if (!exclusive) run += v, a += std::abs(v);
                  want[s.at(o, t, i, s.length)] = run;
                  abs_sums[s.at(o, t, i, s.length)] = a;
                  if (exclusive) run += v, a += std::abs(v);
                }
              }
            expect_near_all(run_op(Op::cumsum, {{"axis", ax}, {"exclusive", exclusive}, {"reverse", reverse}}, {x},
                                   dtype, x.shape),
                            want, abs_sums,
                            "cumsum exclusive " + std::to_string(exclusive) + " reverse " + std::to_string(reverse));
          }

        for (int64_t k : {int64_t{1}, int64_t{2}, s.length}) {
          std::vector<double> want_values(static_cast<size_t>(s.outer * k * s.inner)), want_indices(want_values.size());
          for (int64_t o = 0; o < s.outer; ++o)
            for (int64_t i = 0; i < s.inner; ++i) {
              std::vector<int64_t> order(static_cast<size_t>(s.length));
              std::iota(order.begin(), order.end(), int64_t{0});
              std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
                return xs[s.at(o, a, i, s.length)] > xs[s.at(o, b, i, s.length)];
              });
              for (int64_t t = 0; t < k; ++t) {
                want_values[s.at(o, t, i, k)] = xs[s.at(o, order[t], i, s.length)];
                want_indices[s.at(o, t, i, k)] = static_cast<double>(order[t]);
              }
            }
          auto [values, indices] = run_top_k(x, k, ax);
          const std::vector<double> none(want_values.size(), 0.0);
          expect_near_all(values, want_values, none, "top_k values k " + std::to_string(k));
          expect_near_all(indices, want_indices, none, "top_k indices k " + std::to_string(k));
        }
      }
    }
  }
}

TEST(Reductions, ThreadedRunEqualsSerial) {
  ThreadedParallel threads(4);
  const HostTensor x = tensor_from_doubles(DType::f32, {1024, 96}, random_values(DType::f32, 1024 * 96, 7));
  const HostTensor xi = tensor_from_doubles(DType::i32, {1024, 96}, random_values(DType::i32, 1024 * 96, 8));
  for (int64_t ax : {0, 1}) {
    for (Op op : {Op::sum, Op::mean, Op::max, Op::argmin, Op::cumsum}) {
      for (const HostTensor* in : {&x, &xi}) {
        if (op == Op::mean && in->dtype == DType::i32) continue;
        const DType out_dtype = op == Op::argmin ? DType::i64 : in->dtype;
        const std::vector<int64_t> shape = op == Op::cumsum ? in->shape : with_axis(in->shape, ax, 1);
        const Attrs attrs = {{"axis", ax}, {"exclusive", int64_t{0}}, {"reverse", int64_t{1}}};
        HostTensor serial(out_dtype, shape), threaded(out_dtype, shape);
        run_kernel(op, attrs, {in->view()}, {serial.view()});
        const int64_t before = threads.chunks_run();
        run_kernel(op, attrs, {in->view()}, {threaded.view()}, &threads);
        EXPECT_GT(threads.chunks_run() - before, 1) << graph::op_name(op) << " axis " << ax;
        EXPECT_EQ(serial.bytes, threaded.bytes) << graph::op_name(op) << " axis " << ax;
      }
    }
    auto [sv, si] = run_top_k(x.view(), 5, ax);
    auto [tv, ti] = run_top_k(x.view(), 5, ax, &threads);
    EXPECT_EQ(sv.bytes, tv.bytes);
    EXPECT_EQ(si.bytes, ti.bytes);
  }
}

template <class E> std::string error_of(Op op, const Attrs& attrs, const TensorView& x, std::vector<HostTensor> outs) {
  std::vector<TensorView> views;
  for (const HostTensor& o : outs) views.push_back(o.view());
  try {
    run_kernel(op, attrs, {x}, views);
  } catch (const E& e) {
    return e.what();
  }
  return "no error";
}

TEST(Reductions, RejectBadInputWithClearErrors) {
  const HostTensor x(DType::f32, {2, 3});
  EXPECT_EQ(error_of<ValueError>(Op::sum, axis(2), x.view(), {HostTensor(DType::f32, {2, 1})}),
            "sum: axis 2 is out of range for f32[2, 3]");
  EXPECT_EQ(error_of<ShapeError>(Op::sum, axis(1), x.view(), {HostTensor(DType::f32, {2})}),
            "sum: result f32[2] should be f32[2, 1] (input f32[2, 3])");
  EXPECT_EQ(error_of<ShapeError>(Op::top_k, {{"k", int64_t{4}}, {"axis", int64_t{1}}}, x.view(),
                                 {HostTensor(DType::f32, {2, 4}), HostTensor(DType::i64, {2, 4})}),
            "top_k: k 4 must be in [1, 3], the size of dim 1 (input f32[2, 3])");
  const HostTensor empty(DType::f32, {2, 0});
  EXPECT_EQ(error_of<ShapeError>(Op::argmax, axis(1), empty.view(), {HostTensor(DType::i64, {2, 1})}),
            "argmax: cannot reduce dim 1 of size 0 (input f32[2, 0])");
  EXPECT_EQ(error_of<ValueError>(Op::cumsum, axis(0), x.view(), {HostTensor(DType::f32, {2, 3})}),
            "cumsum: missing attribute 'exclusive'");
  // mean is float-only and nothing accepts bool: no kernel is registered for them.
  EXPECT_FALSE(cpu_kernels().contains({Op::mean, DeviceKind::CPU, DType::i32}));
  EXPECT_FALSE(cpu_kernels().contains({Op::sum, DeviceKind::CPU, DType::boolean}));
}

}  // namespace
}  // namespace kiln::kernels
