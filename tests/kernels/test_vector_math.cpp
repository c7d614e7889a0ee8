// vector_math.h's SIMD exp, sigmoid and silu against double-precision references, at the edges of
// f32's range, and the elementwise kernels on both paths (SIMD and the scalar functors).
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "forced_isa.h"
#include "kernel_test_util.h"
#include "kernels/cpu/vector_math.h"

namespace kiln::kernels {
namespace {

using kernel_test::ForcedIsa;
using kernel_test::HostTensor;
using kernel_test::run_op;
using kernel_test::tensor;

constexpr float kInf = std::numeric_limits<float>::infinity();

// Distance in representable floats (same sign assumed; both finite or equal).
int64_t ulps(float a, float b) {
  if (a == b) return 0;
  const auto ia = static_cast<int64_t>(std::bit_cast<int32_t>(a)), ib = static_cast<int64_t>(std::bit_cast<int32_t>(b));
  return ia > ib ? ia - ib : ib - ia;
}

std::vector<float> run_fn(vmath::Fn fn, const std::vector<float>& x) {
  std::vector<float> y(x.size());
  vmath::apply(fn, x.data(), y.data(), static_cast<int64_t>(x.size()));
  return y;
}

TEST(VectorMath, ExpIsWithinTwoUlpOfTheExactValueAcrossF32) {
  if (!vmath::available()) GTEST_SKIP() << "no AVX-512 here";
  std::vector<float> x;
  for (float v = -104.0f; v <= 89.0f; v += 0.00731f) x.push_back(v);
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> small(-1.0f, 1.0f);
  for (int i = 0; i < 20000; ++i) x.push_back(small(rng));
  const std::vector<float> y = run_fn(vmath::Fn::exp, x);
  int64_t worst = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    const float want = static_cast<float>(std::exp(static_cast<double>(x[i])));
    if (want < std::numeric_limits<float>::min()) {  // subnormal or zero: one subnormal step
      EXPECT_LE(std::fabs(y[i] - want), std::numeric_limits<float>::denorm_min()) << "exp(" << x[i] << ")";
      continue;
    }
    if (std::isinf(want)) {
      EXPECT_EQ(y[i], kInf) << "exp(" << x[i] << ")";
      continue;
    }
    worst = std::max(worst, ulps(y[i], want));
    EXPECT_LE(ulps(y[i], want), 2) << "exp(" << x[i] << ") = " << y[i] << ", exact " << want;
  }
  RecordProperty("worst_ulps", static_cast<int>(worst));
}

TEST(VectorMath, ExpOfSpecialValues) {
  if (!vmath::available()) GTEST_SKIP() << "no AVX-512 here";
  const std::vector<float> y = run_fn(vmath::Fn::exp, {0.0f, -0.0f, -kInf, kInf, 88.8f, -110.0f, -1e30f, 1e30f,
                                                       std::numeric_limits<float>::quiet_NaN(), 1.0f});
  EXPECT_EQ(y[0], 1.0f);
  EXPECT_EQ(y[1], 1.0f);
  EXPECT_EQ(y[2], 0.0f);
  EXPECT_EQ(y[3], kInf);
  EXPECT_EQ(y[4], kInf);  // above log(FLT_MAX) = 88.72
  EXPECT_EQ(y[5], 0.0f);
  EXPECT_EQ(y[6], 0.0f);
  EXPECT_EQ(y[7], kInf);
  EXPECT_TRUE(std::isnan(y[8]));
  EXPECT_LE(ulps(y[9], static_cast<float>(std::exp(1.0))), 1);
}

#if defined(__x86_64__)
bool has_avx2_fma() { return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"); }

// vmath::exp_avx2 over x, 8 at a time (the last vector padded with zeros).
__attribute__((target("avx2,fma"))) std::vector<float> exp_avx2_of(std::vector<float> x) {
  const size_t n = x.size();
  x.resize((n + 7) / 8 * 8, 0.0f);
  std::vector<float> y(x.size());
  for (size_t i = 0; i < x.size(); i += 8) _mm256_storeu_ps(&y[i], vmath::exp_avx2(_mm256_loadu_ps(&x[i])));
  y.resize(n);
  return y;
}

// exp_avx2 (paged attention's AVX2 path) against the exact value, at the edges, and, where the CPU
// has AVX-512, against exp_avx512 bit for bit (its power of two in two exact steps rounds once, as
// vscalefps does).
TEST(VectorMath, Avx2ExpIsWithinTwoUlpAndGivesTheAvx512Bits) {
  if (!has_avx2_fma()) GTEST_SKIP() << "no AVX2 + FMA here: exp_avx2 was not run";
  std::vector<float> x;
  for (float v = -104.0f; v <= 89.0f; v += 0.00731f) x.push_back(v);
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> small(-1.0f, 1.0f);
  for (int i = 0; i < 20000; ++i) x.push_back(small(rng));
  const std::vector<float> y = exp_avx2_of(x);
  for (size_t i = 0; i < x.size(); ++i) {
    const float want = static_cast<float>(std::exp(static_cast<double>(x[i])));
    if (want < std::numeric_limits<float>::min()) {
      EXPECT_LE(std::fabs(y[i] - want), std::numeric_limits<float>::denorm_min()) << "exp(" << x[i] << ")";
    } else if (std::isinf(want)) {
      EXPECT_EQ(y[i], kInf) << "exp(" << x[i] << ")";
    } else {
      EXPECT_LE(ulps(y[i], want), 2) << "exp(" << x[i] << ") = " << y[i] << ", exact " << want;
    }
  }
  const std::vector<float> special = exp_avx2_of({0.0f, -0.0f, -kInf, kInf, 88.8f, -110.0f, -1e30f, 1e30f,
                                                  std::numeric_limits<float>::quiet_NaN(), -103.9f, -87.5f});
  EXPECT_EQ(special[0], 1.0f);
  EXPECT_EQ(special[1], 1.0f);
  EXPECT_EQ(special[2], 0.0f);
  EXPECT_EQ(special[3], kInf);
  EXPECT_EQ(special[4], kInf);
  EXPECT_EQ(special[5], 0.0f);
  EXPECT_EQ(special[6], 0.0f);
  EXPECT_EQ(special[7], kInf);
  EXPECT_TRUE(std::isnan(special[8]));
  EXPECT_LE(std::fabs(special[9] - static_cast<float>(std::exp(-103.9))), std::numeric_limits<float>::denorm_min());
  EXPECT_LE(std::fabs(special[10] - static_cast<float>(std::exp(-87.5))), std::numeric_limits<float>::denorm_min());
  if (!vmath::available()) return;  // no AVX-512 to compare with
  x.insert(x.end(), {-103.9f, -87.5f, -100.0f, 88.7f});
  EXPECT_EQ(exp_avx2_of(x), run_fn(vmath::Fn::exp, x));
}
#endif

TEST(VectorMath, SigmoidAndSiluMatchDoubleReferences) {
  if (!vmath::available()) GTEST_SKIP() << "no AVX-512 here";
  std::vector<float> x;
  for (float v = -30.0f; v <= 30.0f; v += 0.0137f) x.push_back(v);
  x.insert(x.end(), {0.0f, 100.0f, kInf});
  const std::vector<float> sig = run_fn(vmath::Fn::sigmoid, x);
  const std::vector<float> silu = run_fn(vmath::Fn::silu, x);
  for (size_t i = 0; i < x.size(); ++i) {
    const double s = 1.0 / (1.0 + std::exp(-static_cast<double>(x[i])));
    EXPECT_LE(ulps(sig[i], static_cast<float>(s)), 3) << "sigmoid(" << x[i] << ")";
    if (std::isinf(x[i])) {
      EXPECT_EQ(silu[i], kInf);
      continue;
    }
    EXPECT_LE(ulps(silu[i], static_cast<float>(x[i] * s)), 3) << "silu(" << x[i] << ")";
  }
  // exp(-x) overflows f32 below x = -88.7, as std::exp does in the scalar functors: 1 / inf and x / inf.
  EXPECT_EQ(run_fn(vmath::Fn::sigmoid, {-100.0f})[0], 0.0f);
  const float silu_low = run_fn(vmath::Fn::silu, {-100.0f})[0];
  EXPECT_EQ(silu_low, 0.0f);
  EXPECT_TRUE(std::signbit(silu_low));
}

// Every length through the 16-lane loop and its masked tail, in place: an element's result does not
// depend on where it sits or on how many follow it.
TEST(VectorMath, TailsAndInPlaceGiveEachElementTheSameBits) {
  if (!vmath::available()) GTEST_SKIP() << "no AVX-512 here";
  std::vector<float> x(40);
  for (size_t i = 0; i < x.size(); ++i) x[i] = -4.0f + 0.37f * static_cast<float>(i);
  for (vmath::Fn fn : {vmath::Fn::exp, vmath::Fn::sigmoid, vmath::Fn::silu}) {
    const std::vector<float> whole = run_fn(fn, x);
    for (int64_t n = 0; n <= 40; ++n) {
      std::vector<float> part(x.begin(), x.begin() + n);
      part.push_back(12345.0f);  // past the end: must stay untouched
      vmath::apply(fn, part.data(), part.data(), n);
      for (int64_t i = 0; i < n; ++i) EXPECT_EQ(part[static_cast<size_t>(i)], whole[static_cast<size_t>(i)]);
      EXPECT_EQ(part[static_cast<size_t>(n)], 12345.0f) << "wrote past n = " << n;
    }
  }
}

// The exp kernel on every ISA level: the scalar functor (std::exp) below AVX-512, vmath above; both
// close to the double reference on f32 and bf16 operands, strided or not.
TEST(VectorMath, ExpKernelAgreesWithReferenceOnEveryIsaLevel) {
  std::vector<float> values;
  for (int i = 0; i < 300; ++i) values.push_back(-20.0f + 0.13f * static_cast<float>(i));
  const HostTensor f32 = tensor<float>({300}, values);
  const HostTensor f32_2d = tensor<float>({20, 15}, values);
  for (gemm::Isa isa : kernel_test::supported_isas()) {
    ForcedIsa forced(isa);
    const HostTensor flat = run_op(graph::Op::exp, {}, {f32.view()}, DType::f32, {300});
    const HostTensor transposed =
        run_op(graph::Op::exp, {}, {kernel_test::permuted(f32_2d.view(), {1, 0})}, DType::f32, {15, 20});
    for (int64_t i = 0; i < 300; ++i) {
      const double want = std::exp(static_cast<double>(values[static_cast<size_t>(i)]));
      EXPECT_NEAR(flat.as_double(i), want, 2.5e-7 * want) << gemm::isa_name(isa) << " element " << i;
      const int64_t r = i / 20, c = i % 20;  // transposed[r][c] = f32_2d[c][r]
      const double want_t = std::exp(static_cast<double>(values[static_cast<size_t>(c * 15 + r)]));
      EXPECT_NEAR(transposed.as_double(i), want_t, 2.5e-7 * want_t) << gemm::isa_name(isa) << " element " << i;
    }
  }
}

// argmax / argmin / max / min over contiguous f32 lines on every ISA level against a scan written
// here: ties (the first wins), +0 / -0, NaN (its first index), +-inf, every tail length.
TEST(VectorMath, ExtremeReductionsMatchAScalarScanOnEveryIsaLevel) {
  std::mt19937 rng(11);
  std::uniform_int_distribution<int> coarse(-20, 20);  // few distinct values: many ties
  std::vector<std::vector<float>> lines;
  for (int64_t n : {1, 2, 15, 16, 17, 31, 33, 64, 100, 32000}) {
    std::vector<float> v(static_cast<size_t>(n));
    for (float& x : v) x = static_cast<float>(coarse(rng)) * 0.25f;
    lines.push_back(v);
    std::vector<float> zeros(static_cast<size_t>(n), -0.0f);
    zeros[static_cast<size_t>(n / 2)] = 0.0f;
    lines.push_back(zeros);
    if (n > 3) {
      std::vector<float> with_nan = v;
      with_nan[static_cast<size_t>(n - 2)] = std::numeric_limits<float>::quiet_NaN();
      with_nan[static_cast<size_t>(n - 1)] = std::numeric_limits<float>::quiet_NaN();
      lines.push_back(with_nan);
      std::vector<float> infs = v;
      infs[static_cast<size_t>(n - 1)] = kInf;
      infs[1] = -kInf;
      lines.push_back(infs);
    }
  }
  auto scan = [](const std::vector<float>& v, bool largest) {
    int64_t best = 0;
    for (size_t i = 0; i < v.size(); ++i) {
      if (std::isnan(v[i])) return static_cast<int64_t>(i);
      if (largest ? v[i] > v[static_cast<size_t>(best)] : v[i] < v[static_cast<size_t>(best)])
        best = static_cast<int64_t>(i);
    }
    return best;
  };
  for (gemm::Isa isa : kernel_test::supported_isas()) {
    ForcedIsa forced(isa);
    for (const std::vector<float>& v : lines) {
      const auto n = static_cast<int64_t>(v.size());
      const HostTensor in = tensor<float>({1, n}, v);
      const graph::Attrs axis{{"axis", int64_t{1}}};
      for (bool largest : {true, false}) {
        const int64_t want = scan(v, largest);
        const HostTensor index = run_op(largest ? graph::Op::argmax : graph::Op::argmin, axis, {in.view()},
                                        DType::i64, {1, 1});
        EXPECT_EQ(index.as_double(0), static_cast<double>(want))
            << gemm::isa_name(isa) << " n " << n << (largest ? " argmax" : " argmin");
        const HostTensor value =
            run_op(largest ? graph::Op::max : graph::Op::min, axis, {in.view()}, DType::f32, {1, 1});
        const float got = value.view().as<float>()[0], exact = v[static_cast<size_t>(want)];
        EXPECT_EQ(std::bit_cast<uint32_t>(got), std::bit_cast<uint32_t>(exact))
            << gemm::isa_name(isa) << " n " << n << (largest ? " max " : " min ") << got << " vs " << exact;
      }
    }
  }
}

}  // namespace
}  // namespace kiln::kernels
