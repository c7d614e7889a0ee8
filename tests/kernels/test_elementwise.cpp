// The CPU elementwise kernels against references computed here in double precision. One table entry
// per op: the dtypes it accepts and a reference; every op runs on every accepted dtype.
#include <cmath>
#include <functional>
#include <limits>
#include <map>
#include <set>
#include <thread>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "kernel_test_util.h"

namespace kiln::kernels {
namespace {

using graph::Op;
using kernel_test::HostTensor;
using kernel_test::permuted;
using kernel_test::run_kernel;
using kernel_test::run_op;
using kernel_test::tensor;
using kernel_test::tensor_from_doubles;

const std::vector<DType> kFloats = {DType::f32, DType::f16, DType::bf16, DType::f64};
const std::vector<DType> kSigned = {DType::f32, DType::f16, DType::bf16, DType::f64,
                                    DType::i8,  DType::i16, DType::i32,  DType::i64};
const std::vector<DType> kNumeric = {DType::f32, DType::f16, DType::bf16, DType::f64, DType::i8,
                                     DType::i16, DType::i32, DType::i64,  DType::u8,  DType::u16,
                                     DType::u32, DType::u64};
const std::vector<DType> kBool = {DType::boolean};
const std::vector<DType> kAll(std::begin(kAllDTypes), std::end(kAllDTypes));

// How far a kernel may be from the double reference once both are in `dtype`: a few units in the
// last place (the kernel computes f16/bf16 in f32 and rounds once; f32 math is within an ulp or two).
double tolerance(DType dtype) {
  switch (dtype) {
    case DType::f16: return 2e-3;
    case DType::bf16: return 1.6e-2;
    case DType::f32: return 1e-5;
    case DType::f64: return 1e-12;
    default: return 0;
  }
}

// The reference value as the kernel's result dtype stores it.
double stored(double value, DType dtype) { return tensor_from_doubles(dtype, {1}, {value}).as_double(0); }

void expect_close(const HostTensor& got, const std::vector<double>& want, const std::string& what) {
  ASSERT_EQ(got.numel(), static_cast<int64_t>(want.size())) << what;
  for (int64_t i = 0; i < got.numel(); ++i) {
    const double g = got.as_double(i);
    const double w = stored(want[static_cast<size_t>(i)], got.dtype);
    if (std::isnan(w)) {
      EXPECT_TRUE(std::isnan(g)) << what << " element " << i;
      continue;
    }
    const double tol = tolerance(got.dtype) * std::max(1.0, std::fabs(w));
    EXPECT_NEAR(g, w, tol) << what << " element " << i;
  }
}

// Inputs for a dtype: unsigned types get magnitudes, bool gets x != 0, integers truncate.
HostTensor input_for(DType dtype, std::vector<int64_t> shape, std::vector<double> values) {
  for (double& v : values) {
    if (dtype == DType::boolean) v = v != 0 ? 1 : 0;
    else if (is_integer(dtype) && !is_signed(dtype)) v = std::fabs(v);
  }
  return tensor_from_doubles(dtype, std::move(shape), values);
}

// ---- unary ---------------------------------------------------------------------------------------

struct UnaryCase {
  Op op;
  std::vector<DType> dtypes;
  std::function<double(double)> reference;
  std::vector<double> inputs;
  graph::Attrs attrs = {};
};

const std::vector<double> kMixed = {-3.25, -1.5, -0.5, 0.0, 0.75, 1.0, 2.5, 7.0};
const std::vector<double> kPositive = {0.125, 0.5, 1.0, 2.0, 3.5, 10.0};

std::vector<UnaryCase> unary_cases() {
  const double pi = 3.14159265358979323846;
  return {
      {Op::neg, kSigned, [](double x) { return -x; }, kMixed},
      {Op::abs, kNumeric, [](double x) { return std::fabs(x); }, kMixed},
      {Op::exp, kFloats, [](double x) { return std::exp(x); }, kMixed},
      {Op::log, kFloats, [](double x) { return std::log(x); }, kPositive},
      {Op::sqrt, kFloats, [](double x) { return std::sqrt(x); }, kPositive},
      {Op::rsqrt, kFloats, [](double x) { return 1 / std::sqrt(x); }, kPositive},
      {Op::sin, kFloats, [](double x) { return std::sin(x); }, kMixed},
      {Op::cos, kFloats, [](double x) { return std::cos(x); }, kMixed},
      {Op::tanh, kFloats, [](double x) { return std::tanh(x); }, kMixed},
      {Op::sigmoid, kFloats, [](double x) { return 1 / (1 + std::exp(-x)); }, kMixed},
      {Op::silu, kFloats, [](double x) { return x / (1 + std::exp(-x)); }, kMixed},
      {Op::gelu, kFloats, [](double x) { return x * 0.5 * std::erfc(-x / std::sqrt(2.0)); }, kMixed,
       {{"approximate", std::string("none")}}},
      {Op::gelu, kFloats,
       [pi](double x) {
         return 0.5 * x * (1 + std::tanh(std::sqrt(2 / pi) * (x + 0.044715 * x * x * x)));
       },
       kMixed, {{"approximate", std::string("tanh")}}},
      {Op::relu, kNumeric, [](double x) { return x > 0 ? x : 0; }, kMixed},
      {Op::erf, kFloats, [](double x) { return std::erf(x); }, kMixed},
      {Op::floor, kFloats, [](double x) { return std::floor(x); }, kMixed},
      {Op::ceil, kFloats, [](double x) { return std::ceil(x); }, kMixed},
      // Half to even, by hand: the inputs' fractions are .25, .5, .75 or 0.
      {Op::round, kFloats,
       [](double x) {
         double f = std::floor(x);
         double frac = x - f;
         if (frac > 0.5) return f + 1;
         if (frac < 0.5) return f;
         return std::fmod(f, 2.0) == 0 ? f : f + 1;
       },
       {-3.5, -2.5, -1.5, -0.5, 0.5, 1.5, 2.5, 3.25, 3.75}},
      {Op::reciprocal, kFloats, [](double x) { return 1 / x; }, kPositive},
      {Op::square, kNumeric, [](double x) { return x * x; }, kMixed},
      {Op::logical_not, kBool, [](double x) { return x == 0 ? 1 : 0; }, {0, 1, 1, 0}},
      {Op::is_nan, kFloats, [](double x) { return std::isnan(x) ? 1 : 0; },
       {std::nan(""), 1.0, std::numeric_limits<double>::infinity(), 0.0}},
  };
}

TEST(ElementwiseKernels, UnaryOpsMatchReferenceOnEveryAcceptedDType) {
  for (const UnaryCase& c : unary_cases()) {
    for (DType dtype : c.dtypes) {
      const std::string what = fmt::format("{} on {}", graph::op_name(c.op), dtype_name(dtype));
      HostTensor in = input_for(dtype, {static_cast<int64_t>(c.inputs.size())}, c.inputs);
      DType out_dtype = c.op == Op::is_nan ? DType::boolean : dtype;
      HostTensor out = run_op(c.op, c.attrs, {in.view()}, out_dtype, in.shape);
      std::vector<double> want;
      for (int64_t i = 0; i < in.numel(); ++i) want.push_back(c.reference(in.as_double(i)));
      expect_close(out, want, what);
    }
  }
}

// ---- binary --------------------------------------------------------------------------------------

struct BinaryCase {
  Op op;
  std::vector<DType> dtypes;
  std::function<double(double, double, DType)> reference;
  std::vector<double> lhs;
  std::vector<double> rhs;
};

bool is_comparison_op(Op op) { return op >= Op::equal && op <= Op::less_equal; }

std::vector<BinaryCase> binary_cases() {
  const std::vector<double> a = {-7, -6.5, -1, 0, 2.5, 3, 7, 9};
  const std::vector<double> b = {3, 2, -4, 5, 1.25, -2, -3, 2};
  const std::vector<double> p = {2, 0.5, 3, 1.5, 2, 0, 4, 1};
  // Python's modulo: the result takes the divisor's sign.
  auto python_mod = [](double x, double y, DType) { return x - y * std::floor(x / y); };
  return {
      {Op::add, kNumeric, [](double x, double y, DType) { return x + y; }, a, b},
      // The subtrahends' magnitudes stay below the minuends' so unsigned results do not wrap.
      {Op::sub, kNumeric, [](double x, double y, DType) { return x - y; }, a, {3, 2, -1, 0, 1.25, -2, -3, 2}},
      {Op::mul, kNumeric, [](double x, double y, DType) { return x * y; }, a, b},
      {Op::div, kNumeric,
       [](double x, double y, DType d) { return is_float(d) ? x / y : std::trunc(x / y); }, a, b},
      {Op::mod, kNumeric, python_mod, a, b},
      {Op::pow, kNumeric, [](double x, double y, DType) { return std::pow(x, y); }, b, p},
      {Op::maximum, kNumeric, [](double x, double y, DType) { return std::max(x, y); }, a, b},
      {Op::minimum, kNumeric, [](double x, double y, DType) { return std::min(x, y); }, a, b},
      {Op::equal, kAll, [](double x, double y, DType) { return double(x == y); }, a, {-7, 0, -1, 0, 1, 3, 0, 9}},
      {Op::not_equal, kAll, [](double x, double y, DType) { return double(x != y); }, a, {-7, 0, -1, 0, 1, 3, 0, 9}},
      {Op::greater, kNumeric, [](double x, double y, DType) { return double(x > y); }, a, b},
      {Op::greater_equal, kNumeric, [](double x, double y, DType) { return double(x >= y); }, a, {-7, 0, -1, 0, 1, 3, 0, 9}},
      {Op::less, kNumeric, [](double x, double y, DType) { return double(x < y); }, a, b},
      {Op::less_equal, kNumeric, [](double x, double y, DType) { return double(x <= y); }, a, {-7, 0, -1, 0, 1, 3, 0, 9}},
      {Op::logical_and, kBool, [](double x, double y, DType) { return double(x != 0 && y != 0); }, {0, 0, 1, 1}, {0, 1, 0, 1}},
      {Op::logical_or, kBool, [](double x, double y, DType) { return double(x != 0 || y != 0); }, {0, 0, 1, 1}, {0, 1, 0, 1}},
      {Op::logical_xor, kBool, [](double x, double y, DType) { return double((x != 0) != (y != 0)); }, {0, 0, 1, 1}, {0, 1, 0, 1}},
  };
}

TEST(ElementwiseKernels, BinaryOpsMatchReferenceOnEveryAcceptedDType) {
  for (const BinaryCase& c : binary_cases()) {
    for (DType dtype : c.dtypes) {
      const std::string what = fmt::format("{} on {}", graph::op_name(c.op), dtype_name(dtype));
      const std::vector<int64_t> shape = {2, static_cast<int64_t>(c.lhs.size()) / 2};
      HostTensor lhs = input_for(dtype, shape, c.lhs);
      HostTensor rhs = input_for(dtype, shape, c.rhs);
      const DType out_dtype = is_comparison_op(c.op) ? DType::boolean : dtype;
      HostTensor out = run_op(c.op, {}, {lhs.view(), rhs.view()}, out_dtype, shape);
      std::vector<double> want;
      for (int64_t i = 0; i < lhs.numel(); ++i)
        want.push_back(c.reference(lhs.as_double(i), rhs.as_double(i), dtype));
      expect_close(out, want, what);
    }
  }
}

// Every elementwise op of op.h has a table entry, and a CPU kernel exactly for the dtypes it accepts.
TEST(ElementwiseKernels, EveryElementwiseOpHasAKernelForEachAcceptedDType) {
  std::map<Op, std::vector<DType>> accepted;
  for (const UnaryCase& c : unary_cases()) accepted[c.op] = c.dtypes;
  for (const BinaryCase& c : binary_cases()) accepted[c.op] = c.dtypes;
  accepted[Op::where] = kBool;  // registered under the condition's dtype
  accepted[Op::cast] = kAll;
  for (auto op = static_cast<uint16_t>(Op::neg); op <= static_cast<uint16_t>(Op::cast); ++op)
    EXPECT_TRUE(accepted.count(static_cast<Op>(op)))
        << graph::op_name(static_cast<Op>(op)) << " has no test entry";
  for (const auto& [op, dtypes] : accepted) {
    const std::set<DType> yes(dtypes.begin(), dtypes.end());
    for (DType d : kAllDTypes) {
      const bool found = cpu_kernels().contains({op, DeviceKind::CPU, d});
      EXPECT_EQ(found, yes.count(d) == 1) << graph::op_name(op) << " on " << dtype_name(d);
    }
  }
}

// ---- broadcasting and strides ----------------------------------------------------------------------

TEST(ElementwiseKernels, AddBroadcastsColumnWithRow) {
  HostTensor col = tensor<float>({3, 1}, {1, 2, 3});
  HostTensor row = tensor<float>({1, 4}, {10, 20, 30, 40});
  HostTensor out = run_op(Op::add, {}, {col.view(), row.view()}, DType::f32, {3, 4});
  EXPECT_EQ(out.values<float>(),
            (std::vector<float>{11, 21, 31, 41, 12, 22, 32, 42, 13, 23, 33, 43}));
}

TEST(ElementwiseKernels, ScalarBroadcastsOnEitherSide) {
  HostTensor scalar = tensor<int32_t>({}, {10});
  HostTensor m = tensor<int32_t>({2, 3}, {1, 2, 3, 4, 5, 6});
  EXPECT_EQ(run_op(Op::sub, {}, {scalar.view(), m.view()}, DType::i32, {2, 3}).values<int32_t>(),
            (std::vector<int32_t>{9, 8, 7, 6, 5, 4}));
  EXPECT_EQ(run_op(Op::sub, {}, {m.view(), scalar.view()}, DType::i32, {2, 3}).values<int32_t>(),
            (std::vector<int32_t>{-9, -8, -7, -6, -5, -4}));
}

TEST(ElementwiseKernels, LowerRankOperandBroadcastsFromTheRight) {
  HostTensor m = tensor<double>({2, 3}, {1, 2, 3, 4, 5, 6});
  HostTensor v = tensor<double>({3}, {1, 10, 100});
  EXPECT_EQ(run_op(Op::mul, {}, {m.view(), v.view()}, DType::f64, {2, 3}).values<double>(),
            (std::vector<double>{1, 20, 300, 4, 50, 600}));
}

TEST(ElementwiseKernels, TransposedOperandsAreReadThroughTheirStrides) {
  // t is [3, 2] in memory; its transpose is the [2, 3] matrix [[0, 2, 4], [1, 3, 5]].
  HostTensor t = tensor<float>({3, 2}, {0, 1, 2, 3, 4, 5});
  HostTensor m = tensor<float>({2, 3}, {10, 20, 30, 40, 50, 60});
  const TensorView tt = permuted(t.view(), {1, 0});
  ASSERT_FALSE(tt.is_contiguous());
  EXPECT_EQ(run_op(Op::add, {}, {tt, m.view()}, DType::f32, {2, 3}).values<float>(),
            (std::vector<float>{10, 22, 34, 41, 53, 65}));
  EXPECT_EQ(run_op(Op::neg, {}, {tt}, DType::f32, {2, 3}).values<float>(),
            (std::vector<float>{-0.f, -2, -4, -1, -3, -5}));
  EXPECT_EQ(run_op(Op::greater, {}, {tt, tt}, DType::boolean, {2, 3}).values<bool>(),
            (std::vector<bool>(6, false)));
}

// Splits work into many uneven chunks, so runs start mid-row.
class ChunkedParallel final : public Parallel {
 public:
  void for_range(int64_t n, int64_t, const std::function<void(int64_t, int64_t)>& fn) override {
    for (int64_t b = 0; b < n; b += 7919) fn(b, std::min(n, b + 7919));
  }
  int num_threads() const override { return 4; }
};

TEST(ElementwiseKernels, LargeBroadcastInChunksMatchesNaiveLoop) {
  const int64_t rows = 300, cols = 211;  // 63300 elements: more than one parallel grain
  std::vector<float> a(static_cast<size_t>(rows * cols)), b(static_cast<size_t>(cols));
  for (size_t i = 0; i < a.size(); ++i) a[i] = static_cast<float>(i % 97) * 0.5f;
  for (size_t j = 0; j < b.size(); ++j) b[j] = static_cast<float>(j);
  HostTensor ta = tensor<float>({rows, cols}, a);
  HostTensor tb = tensor<float>({1, cols}, b);
  HostTensor out(DType::f32, {rows, cols});
  ChunkedParallel chunked;
  run_kernel(Op::mul, {}, {ta.view(), tb.view()}, {out.view()}, &chunked);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c)
      ASSERT_EQ(out.at<float>(r * cols + c), a[static_cast<size_t>(r * cols + c)] * b[static_cast<size_t>(c)])
          << r << "," << c;
  // The flat path in chunks too.
  HostTensor out2(DType::f32, {rows, cols});
  run_kernel(Op::add, {}, {ta.view(), ta.view()}, {out2.view()}, &chunked);
  for (int64_t i = 0; i < rows * cols; ++i) ASSERT_EQ(out2.at<float>(i), 2 * a[static_cast<size_t>(i)]);
}

// ---- integer semantics and errors -------------------------------------------------------------------

TEST(ElementwiseKernels, IntegerDivisionTruncatesAndModFollowsTheDivisorSign) {
  HostTensor a = tensor<int32_t>({4}, {7, -7, 7, -7});
  HostTensor b = tensor<int32_t>({4}, {2, 2, -2, -2});
  EXPECT_EQ(run_op(Op::div, {}, {a.view(), b.view()}, DType::i32, {4}).values<int32_t>(),
            (std::vector<int32_t>{3, -3, -3, 3}));
  EXPECT_EQ(run_op(Op::mod, {}, {a.view(), b.view()}, DType::i32, {4}).values<int32_t>(),
            (std::vector<int32_t>{1, 1, -1, -1}));
  HostTensor fa = tensor<float>({2}, {-7.5f, 7.5f});
  HostTensor fb = tensor<float>({2}, {2, -2});
  EXPECT_EQ(run_op(Op::mod, {}, {fa.view(), fb.view()}, DType::f32, {2}).values<float>(),
            (std::vector<float>{0.5f, -0.5f}));
}

TEST(ElementwiseKernels, IntegerDivisionByZeroThrowsNamingTheOp) {
  HostTensor a = tensor<int64_t>({2}, {1, 2});
  HostTensor b = tensor<int64_t>({2}, {1, 0});
  for (Op op : {Op::div, Op::mod}) {
    try {
      run_op(op, {}, {a.view(), b.view()}, DType::i64, {2});
      ADD_FAILURE() << graph::op_name(op) << " did not throw";
    } catch (const ExecutionError& e) {
      EXPECT_EQ(std::string(e.what()), std::string(graph::op_name(op)) + ": integer division by zero");
    }
  }
  // Floats divide by zero as IEEE says.
  HostTensor fa = tensor<float>({1}, {1});
  HostTensor fz = tensor<float>({1}, {0});
  EXPECT_EQ(run_op(Op::div, {}, {fa.view(), fz.view()}, DType::f32, {1}).at<float>(0),
            std::numeric_limits<float>::infinity());
}

TEST(ElementwiseKernels, SignedIntegerOverflowWraps) {
  HostTensor a = tensor<int8_t>({3}, {127, -128, -128});
  HostTensor b = tensor<int8_t>({3}, {1, -1, -1});
  EXPECT_EQ(run_op(Op::add, {}, {a.view(), b.view()}, DType::i8, {3}).values<int8_t>(),
            (std::vector<int8_t>{-128, 127, 127}));
  EXPECT_EQ(run_op(Op::div, {}, {a.view(), b.view()}, DType::i8, {3}).values<int8_t>(),
            (std::vector<int8_t>{127, -128, -128}));
}

TEST(ElementwiseKernels, IntegerPowRejectsNegativeExponent) {
  HostTensor a = tensor<int32_t>({2}, {2, 3});
  HostTensor b = tensor<int32_t>({2}, {10, -1});
  EXPECT_THROW(run_op(Op::pow, {}, {a.view(), b.view()}, DType::i32, {2}), ExecutionError);
  HostTensor c = tensor<int32_t>({2}, {10, 0});
  EXPECT_EQ(run_op(Op::pow, {}, {a.view(), c.view()}, DType::i32, {2}).values<int32_t>(),
            (std::vector<int32_t>{1024, 1}));
}

TEST(ElementwiseKernels, MaximumAndMinimumPropagateNaN) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  HostTensor a = tensor<float>({3}, {nan, 1, 2});
  HostTensor b = tensor<float>({3}, {1, nan, 3});
  for (Op op : {Op::maximum, Op::minimum}) {
    HostTensor out = run_op(op, {}, {a.view(), b.view()}, DType::f32, {3});
    EXPECT_TRUE(std::isnan(out.at<float>(0))) << graph::op_name(op);
    EXPECT_TRUE(std::isnan(out.at<float>(1))) << graph::op_name(op);
  }
}

// ---- 16-bit floats ---------------------------------------------------------------------------------

TEST(ElementwiseKernels, HalfResultsRoundToNearestEven) {
  // f16 has 10 fraction bits: 1 + 2^-11 is halfway between 1 and 1 + 2^-10 and rounds to 1 (even);
  // 1 + 3 * 2^-11 is halfway between 1 + 2^-10 and 1 + 2^-9 and rounds up to 1 + 2^-9.
  HostTensor one = tensor<f16_t>({2}, {f16_t(1.0f), f16_t(1.0f)});
  HostTensor tiny = tensor<f16_t>({2}, {f16_t(std::ldexp(1.0f, -11)), f16_t(3 * std::ldexp(1.0f, -11))});
  HostTensor out = run_op(Op::add, {}, {one.view(), tiny.view()}, DType::f16, {2});
  EXPECT_EQ(out.as_double(0), 1.0);
  EXPECT_EQ(out.as_double(1), 1.0 + std::ldexp(1.0, -9));
  // bf16 has 7: 1 + 2^-8 ties to 1, 1 + 3 * 2^-8 ties up to 1 + 2^-6.
  HostTensor b1 = tensor<bf16_t>({2}, {bf16_t(1.0f), bf16_t(1.0f)});
  HostTensor bt = tensor<bf16_t>({2}, {bf16_t(std::ldexp(1.0f, -8)), bf16_t(3 * std::ldexp(1.0f, -8))});
  HostTensor bout = run_op(Op::add, {}, {b1.view(), bt.view()}, DType::bf16, {2});
  EXPECT_EQ(bout.as_double(0), 1.0);
  EXPECT_EQ(bout.as_double(1), 1.0 + std::ldexp(1.0, -6));
}

// ---- where and cast ------------------------------------------------------------------------------------

TEST(ElementwiseKernels, WhereBroadcastsAllThreeOperands) {
  HostTensor cond = tensor<bool>({2, 1}, {true, false});
  HostTensor x = tensor<int16_t>({1, 3}, {1, 2, 3});
  HostTensor y = tensor<int16_t>({}, {-1});
  HostTensor out = run_op(Op::where, {}, {cond.view(), x.view(), y.view()}, DType::i16, {2, 3});
  EXPECT_EQ(out.values<int16_t>(), (std::vector<int16_t>{1, 2, 3, -1, -1, -1}));
}

TEST(ElementwiseKernels, WhereMovesEveryElementSize) {
  HostTensor cond = tensor<bool>({3}, {true, false, true});
  for (DType d : kAllDTypes) {
    HostTensor x = input_for(d, {3}, {1, 2, 3});
    HostTensor y = input_for(d, {3}, {0, 5, 0});
    HostTensor out = run_op(Op::where, {}, {cond.view(), x.view(), y.view()}, d, {3});
    EXPECT_EQ(out.as_double(0), x.as_double(0)) << dtype_name(d);
    EXPECT_EQ(out.as_double(1), y.as_double(1)) << dtype_name(d);
    EXPECT_EQ(out.as_double(2), x.as_double(2)) << dtype_name(d);
  }
}

TEST(ElementwiseKernels, CastFloatToIntTruncatesNaNIsZeroAndOutOfRangeSaturates) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  HostTensor in = tensor<float>({6}, {-2.7f, 2.7f, nan, 1e10f, -1e10f, 0.0f});
  graph::Attrs i32{{"dtype", DType::i32}};
  EXPECT_EQ(run_op(Op::cast, i32, {in.view()}, DType::i32, {6}).values<int32_t>(),
            (std::vector<int32_t>{-2, 2, 0, std::numeric_limits<int32_t>::max(),
                                  std::numeric_limits<int32_t>::min(), 0}));
  graph::Attrs u8{{"dtype", DType::u8}};
  EXPECT_EQ(run_op(Op::cast, u8, {in.view()}, DType::u8, {6}).values<uint8_t>(),
            (std::vector<uint8_t>{0, 2, 0, 255, 0, 0}));
  graph::Attrs b{{"dtype", DType::boolean}};
  EXPECT_EQ(run_op(Op::cast, b, {in.view()}, DType::boolean, {6}).values<bool>(),
            (std::vector<bool>{true, true, true, true, true, false}));
}

TEST(ElementwiseKernels, CastBetweenIntegersWrapsAndToHalfRoundsToEven) {
  HostTensor ints = tensor<int32_t>({3}, {300, -1, 127});
  EXPECT_EQ(run_op(Op::cast, {{"dtype", DType::i8}}, {ints.view()}, DType::i8, {3}).values<int8_t>(),
            (std::vector<int8_t>{44, -1, 127}));
  EXPECT_EQ(run_op(Op::cast, {{"dtype", DType::u16}}, {ints.view()}, DType::u16, {3}).values<uint16_t>(),
            (std::vector<uint16_t>{300, 65535, 127}));
  HostTensor f = tensor<float>({2}, {1.0f + std::ldexp(1.0f, -11), 1.0f + 3 * std::ldexp(1.0f, -11)});
  HostTensor h = run_op(Op::cast, {{"dtype", DType::f16}}, {f.view()}, DType::f16, {2});
  EXPECT_EQ(h.as_double(0), 1.0);
  EXPECT_EQ(h.as_double(1), 1.0 + std::ldexp(1.0, -9));
  HostTensor bools = tensor<bool>({2}, {true, false});
  EXPECT_EQ(run_op(Op::cast, {{"dtype", DType::f64}}, {bools.view()}, DType::f64, {2}).values<double>(),
            (std::vector<double>{1, 0}));
}

TEST(ElementwiseKernels, CastConvertsEveryDTypePairExactlyForSmallValues) {
  for (DType from : kAllDTypes) {
    for (DType to : kAllDTypes) {
      HostTensor in = input_for(from, {3}, {0, 1, 5});
      HostTensor out = run_op(Op::cast, {{"dtype", to}}, {in.view()}, to, {3});
      for (int64_t i = 0; i < 3; ++i) {
        const double want = to == DType::boolean ? double(in.as_double(i) != 0) : in.as_double(i);
        EXPECT_EQ(out.as_double(i), want) << dtype_name(from) << " -> " << dtype_name(to);
      }
    }
  }
}

TEST(ElementwiseKernels, CastReadsStridedInput) {
  HostTensor t = tensor<int64_t>({2, 2}, {1, 2, 3, 4});
  HostTensor out =
      run_op(Op::cast, {{"dtype", DType::f32}}, {permuted(t.view(), {1, 0})}, DType::f32, {2, 2});
  EXPECT_EQ(out.values<float>(), (std::vector<float>{1, 3, 2, 4}));
}

TEST(ElementwiseKernels, GeluRejectsUnknownApproximation) {
  HostTensor x = tensor<float>({1}, {1});
  EXPECT_THROW(run_op(Op::gelu, {{"approximate", std::string("fast")}}, {x.view()}, DType::f32, {1}),
               ValueError);
}

// ---- fused_elementwise ---------------------------------------------------------------------------

const graph::Attrs kMulSiluToBf16{
    {"program", std::string("%2 = mul(%0, %1) : f32; %3 = silu(%2) : f32; %4 = cast(%3) : bf16")}};

// The same functors, in f32, rounded where the unfused ops store: the same bits.
TEST(FusedElementwiseKernel, MatchesTheUnfusedOpsBitForBit) {
  const HostTensor a = tensor_from_doubles(DType::f32, {3, 300}, kernel_test::pseudo_random(900, 1));
  const HostTensor b = tensor_from_doubles(DType::f32, {300}, kernel_test::pseudo_random(300, 2));
  const HostTensor product = run_op(Op::mul, {}, {a.view(), b.view()}, DType::f32, {3, 300});
  const HostTensor silu = run_op(Op::silu, {}, {product.view()}, DType::f32, {3, 300});
  const HostTensor want = run_op(Op::cast, {{"dtype", DType::bf16}}, {silu.view()}, DType::bf16, {3, 300});
  const HostTensor got =
      run_op(Op::fused_elementwise, kMulSiluToBf16, {a.view(), b.view()}, DType::bf16, {3, 300});
  EXPECT_EQ(got.bytes, want.bytes);
}

// The program is parsed when the kernel is built (a bad one fails there), and the kernel keeps what it
// needs: it runs after its attributes are gone, from several threads at once.
TEST(FusedElementwiseKernel, ParsesItsProgramOnceAtBuild) {
  const HostTensor a = tensor_from_doubles(DType::f32, {2, 500}, kernel_test::pseudo_random(1000, 3));
  const HostTensor b = tensor_from_doubles(DType::f32, {500}, kernel_test::pseudo_random(500, 4));
  EXPECT_THROW(kernel_test::build_kernel(Op::fused_elementwise, {{"program", std::string("%1 = exp(%0)")}},
                                         {a.view()}, {}),
               ValueError);
  std::unique_ptr<const Kernel> kernel = kernel_test::build_kernel(
      Op::fused_elementwise, graph::Attrs(kMulSiluToBf16), {a.view(), b.view()}, {});
  const HostTensor want =
      run_op(Op::fused_elementwise, kMulSiluToBf16, {a.view(), b.view()}, DType::bf16, {2, 500});
  std::vector<HostTensor> outs(4, HostTensor(DType::bf16, {2, 500}));
  std::vector<std::thread> threads;
  for (HostTensor& out : outs)
    threads.emplace_back([&] {
      SerialParallel serial;
      KernelContext ctx;
      ctx.parallel = &serial;
      const std::vector<TensorView> inputs{a.view(), b.view()}, outputs{out.view()};
      kernel->run(ctx, inputs, outputs);
    });
  for (std::thread& t : threads) t.join();
  for (const HostTensor& out : outs) EXPECT_EQ(out.bytes, want.bytes);
}

}  // namespace
}  // namespace kiln::kernels
