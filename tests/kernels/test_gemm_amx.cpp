// The AMX bf16 GEMM (kernels/cpu/gemm_amx.h) and its use by the bf16 matmul kernel, against a naive
// double-precision loop written here over the exact bf16 inputs: edge sizes around the 16 x 16 tiles,
// the 32 x 32 blocks and K's 32-wide tiles, both rhs layouts, the prepared (packed at init) and
// unprepared paths, and 1 vs 2 threads; and f32 activations x bf16 weights -> f32 (activations
// rounded to bf16 above 8 rows on AMX and on the avx512_bf16 level's vdpbf16ps GEMM, exact on the
// other levels). Skipped where the CPU or OS has no AMX (or AVX512_BF16, for the dot GEMM's tests),
// except the tests that the matmul stays correct without it.
//
// Tolerance, per element: K * 2^-23 * sum_k |a_k b_k| (f32 accumulation in any order; bf16 products
// are exact in f32) plus the final rounding to bf16 (2^-8 of |result|). One wrong or missing product
// moves a result by about sum / K, far above it.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "kernels/cpu/gemm_amx.h"
#include "kernels/forced_isa.h"
#include "kernels/cpu/matmul.h"
#include "kernels/kernel_test_util.h"
#include "kernels/threaded_parallel.h"

namespace kiln::kernels {
namespace {

using kernel_test::ThreadedParallel;

#define SKIP_WITHOUT_AMX()                                       \
  if (!amx::available())                                         \
  GTEST_SKIP() << "AMX-BF16 is not available on this CPU or OS " \
                  "(needs AMX-TILE/AMX-BF16 and Linux 5.16+)"

float bf16_value(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &wide, 4);
  return f;
}

// bf16 bits of values drawn uniformly from [-1, 1).
std::vector<uint16_t> random_bf16(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(-1, 1);
  std::vector<uint16_t> out(static_cast<size_t>(n));
  for (uint16_t& v : out) v = f32_to_bf16(dist(rng));
  return out;
}

// One product's operands: A [M, K] and the weight, stored [N, K] (a Linear's, read with transpose_b)
// or [K, N].
struct Case {
  int64_t M, N, K;
  bool weight_nk = true;
  std::vector<uint16_t> a, w;
  int64_t b_row() const { return weight_nk ? 1 : N; }  // stride along K of B = W^T or W
  int64_t b_col() const { return weight_nk ? K : 1; }  // stride along N
  double a_at(int64_t m, int64_t k) const { return bf16_value(a[m * K + k]); }
  double b_at(int64_t k, int64_t n) const { return bf16_value(w[k * b_row() + n * b_col()]); }
};

Case make_case(int64_t M, int64_t N, int64_t K, bool weight_nk, uint32_t seed) {
  return Case{M, N, K, weight_nk, random_bf16(M * K, seed), random_bf16(N * K, seed + 1000)};
}

std::string label(const Case& c) {
  return std::to_string(c.M) + "x" + std::to_string(c.N) + "x" + std::to_string(c.K) +
         (c.weight_nk ? " weight [N, K]" : " weight [K, N]");
}

// C (bf16 bits, [M, N]) against the naive loop.
void expect_matches_naive(const Case& c, const std::vector<uint16_t>& out, const std::string& what) {
  int bad = 0;
  for (int64_t m = 0; m < c.M; ++m)
    for (int64_t n = 0; n < c.N; ++n) {
      double sum = 0, magnitude = 0;
      for (int64_t k = 0; k < c.K; ++k) {
        const double p = c.a_at(m, k) * c.b_at(k, n);
        sum += p;
        magnitude += std::fabs(p);
      }
      const double tolerance = c.K * std::ldexp(magnitude, -23) + std::ldexp(std::fabs(sum), -8) + 1e-30;
      const double got = bf16_value(out[m * c.N + n]);
      if (!(std::fabs(got - sum) <= tolerance) && ++bad <= 5)
        ADD_FAILURE() << what << ": C[" << m << ", " << n << "] = " << got << ", expected " << sum << " +- "
                      << tolerance;
    }
}

// Through amx::gemm on a weight packed by amx::PackedB::pack.
std::vector<uint16_t> run_amx(const Case& c, Parallel* parallel = nullptr) {
  SerialParallel serial;
  const KernelContext ctx{parallel ? parallel : &serial};
  const amx::PackedB packed = amx::PackedB::pack(ctx, c.w.data(), c.b_row(), c.b_col(), c.K, c.N);
  EXPECT_EQ(packed.K(), c.K);
  EXPECT_EQ(packed.N(), c.N);
  std::vector<uint16_t> out(static_cast<size_t>(c.M * c.N), 0xFFFF);  // NaN where nothing is written
  amx::gemm(ctx, c.a.data(), c.K, 1, c.M, packed, out.data(), c.N);
  return out;
}

// Views of a case as the matmul kernel sees them, and its attrs.
TensorView lhs_view(const Case& c) {
  return {const_cast<uint16_t*>(c.a.data()), DType::bf16, {c.M, c.K}, {c.K, 1}};
}
// For a Case or a MixedCase (bf16 or f32 activations, bf16 weights).
template <class C>
TensorView weight_view(const C& c) {
  return c.weight_nk ? TensorView{const_cast<uint16_t*>(c.w.data()), DType::bf16, {c.N, c.K}, {c.K, 1}}
                     : TensorView{const_cast<uint16_t*>(c.w.data()), DType::bf16, {c.K, c.N}, {c.N, 1}};
}
template <class C>
graph::Attrs attrs_of(const C& c) {
  graph::Attrs attrs;
  if (c.weight_nk) attrs["transpose_b"] = int64_t{1};
  return attrs;
}

// The registered matmul kernel of the case's lhs dtype ((matmul, CPU, bf16) or (matmul, CPU, f32))
// built as a step with the weight fixed, the lhs given its static shape or none (symbolic).
template <class C>
std::unique_ptr<const Kernel> build_prepared(const C& c, bool lhs_shape_known = false) {
  constexpr DType lhs_dtype = std::is_same_v<typename decltype(c.a)::value_type, float> ? DType::f32 : DType::bf16;
  TensorView lhs{nullptr, lhs_dtype, {}, {}};
  if (lhs_shape_known) {
    lhs.shape = {c.M, c.K};
    lhs.strides = {c.K, 1};
  }
  const bool fixed[] = {false, true};
  return kernel_test::build_kernel(graph::Op::matmul, attrs_of(c), {lhs, weight_view(c)}, {}, fixed);
}
// What that kernel packed at build.
template <class C>
MatmulPacking packing(const C& c, bool lhs_shape_known = false) {
  return matmul_packing(*build_prepared(c, lhs_shape_known));
}

// Through `prepared` (build_prepared) or, with nullptr, the registered matmul kernel built without a
// fixed weight.
template <class C, class T>
void run_matmul(const C& c, const Kernel* prepared, Parallel* parallel, TensorView lhs, std::vector<T>& out) {
  const std::vector<TensorView> inputs{lhs, weight_view(c)};
  const std::vector<TensorView> outputs{TensorView{out.data(), lhs.dtype, {c.M, c.N}, {c.N, 1}}};
  if (prepared) return kernel_test::run_built(*prepared, inputs, outputs, parallel);
  kernel_test::run_built(*kernel_test::build_kernel(graph::Op::matmul, attrs_of(c), inputs, outputs), inputs, outputs,
                         parallel);
}
std::vector<uint16_t> run_matmul(const Case& c, const Kernel* prepared, Parallel* parallel = nullptr) {
  std::vector<uint16_t> out(static_cast<size_t>(c.M * c.N), 0xFFFF);
  run_matmul(c, prepared, parallel, lhs_view(c), out);
  return out;
}

TEST(AmxGemm, MatchesNaiveLoopOnEdgeShapesAndBothWeightLayouts) {
  SKIP_WITHOUT_AMX();
  uint32_t seed = 1;
  for (int64_t M : {9, 10, 11, 12, 13, 14, 15, 16, 17, 31, 33, 128})
    for (int64_t N : {1, 15, 16, 17, 100})
      for (int64_t K : {1, 31, 32, 33, 2048})
        for (bool weight_nk : {true, false}) {
          if (K == 2048 && !weight_nk && M < 31) continue;  // the [K, N] packing is covered by the rest
          const Case c = make_case(M, N, K, weight_nk, seed++);
          expect_matches_naive(c, run_amx(c), label(c));
        }
}

TEST(AmxGemm, LongKIsSlicedWithoutChangingTheResult) {
  SKIP_WITHOUT_AMX();
  // K > 2048 runs in K slices with partial f32 C blocks in memory; over 8 row blocks (256 rows) and
  // 8 column-tile pairs (256 columns) the rows and columns are walked in chunks too.
  uint32_t seed = 300;
  for (const auto& [M, N, K] :
       {std::tuple{300, 40, 2081}, std::tuple{70, 600, 2081}, std::tuple{9, 17, 4096}}) {
    const Case c = make_case(M, N, K, true, seed++);
    expect_matches_naive(c, run_amx(c), label(c));
  }
}

TEST(AmxGemm, StridedLhsMatchesNaiveLoop) {
  SKIP_WITHOUT_AMX();
  // A read through a transposed view (a_col = M) and with padded rows (a_row = K + 7).
  const Case c = make_case(33, 40, 45, true, 77);
  SerialParallel serial;
  const KernelContext ctx{&serial};
  const amx::PackedB packed = amx::PackedB::pack(ctx, c.w.data(), c.b_row(), c.b_col(), c.K, c.N);
  std::vector<uint16_t> a_t(static_cast<size_t>(c.K * c.M)),
      a_padded(static_cast<size_t>(c.M * (c.K + 7)), 0x7FC0);
  for (int64_t m = 0; m < c.M; ++m)
    for (int64_t k = 0; k < c.K; ++k) a_t[k * c.M + m] = a_padded[m * (c.K + 7) + k] = c.a[m * c.K + k];
  std::vector<uint16_t> out(static_cast<size_t>(c.M * c.N));
  amx::gemm(ctx, a_t.data(), 1, c.M, c.M, packed, out.data(), c.N);
  expect_matches_naive(c, out, "transposed lhs");
  amx::gemm(ctx, a_padded.data(), c.K + 7, 1, c.M, packed, out.data(), c.N);
  expect_matches_naive(c, out, "padded lhs rows");
}

TEST(AmxGemm, RoundsTheF32SumOnceToNearestEven) {
  SKIP_WITHOUT_AMX();
  // C[m, n] = 1 + w[n, 1] + w[n, 2] (A all ones): the exact f32 sums 1 + 2^-8 and 1 + 3 * 2^-8 are
  // ties between bf16 neighbours (spacing 2^-7 at 1) and round to the even one; 1 + 2^-8 + 2^-20 is
  // just above the tie.
  constexpr uint16_t kOne = 0x3F80, kTwoToMinus8 = 0x3B80, kThreeTimesTwoToMinus8 = 0x3C40,
                     kTwoToMinus20 = 0x3580;
  ASSERT_EQ(bf16_value(kTwoToMinus8), std::ldexp(1.f, -8));
  ASSERT_EQ(bf16_value(kThreeTimesTwoToMinus8), 3 * std::ldexp(1.f, -8));
  ASSERT_EQ(bf16_value(kTwoToMinus20), std::ldexp(1.f, -20));
  const Case c{9,
               3,
               3,
               true,
               std::vector<uint16_t>(27, kOne),
               {kOne, kTwoToMinus8, 0, kOne, kThreeTimesTwoToMinus8, 0, kOne, kTwoToMinus8, kTwoToMinus20}};
  const std::vector<uint16_t> out = run_amx(c);
  for (int64_t m = 0; m < 9; ++m) {
    EXPECT_EQ(out[m * 3 + 0], 0x3F80) << "1 + 2^-8 rounds down to 1 (even), m=" << m;
    EXPECT_EQ(out[m * 3 + 1], 0x3F82) << "1 + 3 * 2^-8 rounds up to 1 + 2^-6 (even), m=" << m;
    EXPECT_EQ(out[m * 3 + 2], 0x3F81) << "above the tie rounds up, m=" << m;
  }
}

TEST(AmxGemm, NanAndInfinityReachExactlyTheirResults) {
  SKIP_WITHOUT_AMX();
  Case c = make_case(20, 40, 30, true, 9);
  c.a[0 * 30 + 3] = 0x7FC0;  // A[0, 3] = NaN
  c.w[5 * 30 + 4] = 0x7F80;  // W[5, 4] = +inf (column 5 of C)
  c.a[1 * 30 + 4] = 0x3F80;  // A[1, 4] = 1: row 1 meets the infinity with a positive sign
  const std::vector<uint16_t> out = run_amx(c);
  for (int64_t n = 0; n < 40; ++n) EXPECT_TRUE(std::isnan(bf16_value(out[n]))) << "n=" << n;
  EXPECT_EQ(out[1 * 40 + 5], 0x7F80);
  for (int64_t m = 1; m < 20; ++m) {
    EXPECT_TRUE(std::isinf(bf16_value(out[m * 40 + 5]))) << "m=" << m;
    EXPECT_TRUE(std::isfinite(bf16_value(out[m * 40 + 6]))) << "m=" << m;
  }
}

TEST(AmxGemm, SumsBelowTheF32NormalRangeFlushToZero) {
  SKIP_WITHOUT_AMX();
  // C[m, n] = A[m, 0] * W[n, 0] with A = 2^-70 and W = 2^-50 (column 0: 2^-120, a normal f32 and bf16,
  // bits 0x0380) or 2^-60 (column 1: 2^-130, an f32 denormal). tdpbf16ps flushes denormal sums to
  // zero, which is what lets the output rounding (vcvtneps2bf16, denormals read as zero) match
  // f32_to_bf16 on every value the tiles produce.
  constexpr uint16_t kTwoToMinus70 = 0x1C80, kTwoToMinus50 = 0x2680, kTwoToMinus60 = 0x2180;
  ASSERT_EQ(bf16_value(kTwoToMinus70), std::ldexp(1.f, -70));
  ASSERT_EQ(bf16_value(kTwoToMinus50), std::ldexp(1.f, -50));
  ASSERT_EQ(bf16_value(kTwoToMinus60), std::ldexp(1.f, -60));
  Case c{40, 2, 2, true, std::vector<uint16_t>(80, 0), {kTwoToMinus50, 0, kTwoToMinus60, 0}};
  for (int64_t m = 0; m < 40; ++m) c.a[m * 2] = kTwoToMinus70;
  const std::vector<uint16_t> out = run_amx(c);
  for (int64_t m = 0; m < 40; ++m) {
    EXPECT_EQ(out[m * 2 + 0], 0x0380) << "2^-120 stays exact, m=" << m;
    EXPECT_EQ(out[m * 2 + 1], 0x0000) << "2^-130 flushes to +0, m=" << m;
  }
}

TEST(AmxGemm, TwoThreadsGiveTheSameBitsAsOne) {
  SKIP_WITHOUT_AMX();
  ThreadedParallel two(2);
  // Split by column pairs (wide N), and by row blocks (N of one column pair).
  for (const auto& [M, N, K] : {std::tuple{64, 512, 256}, std::tuple{300, 32, 200}, std::tuple{17, 1000, 96},
                                std::tuple{40, 600, 2081}}) {
    const Case c = make_case(M, N, K, true, static_cast<uint32_t>(M + N + K));
    const int64_t before = two.chunks_run();
    const std::vector<uint16_t> serial = run_amx(c), threaded = run_amx(c, &two);
    EXPECT_GT(two.chunks_run() - before, 1) << label(c) << ": the work was not split";
    EXPECT_EQ(serial, threaded) << label(c);
    expect_matches_naive(c, threaded, label(c) + ", 2 threads");
  }
}

TEST(AmxMatmul, PreparedAndUnpreparedKernelMatchNaiveLoopAndEachOther) {
  SKIP_WITHOUT_AMX();
  ThreadedParallel two(2);
  uint32_t seed = 500;
  for (int64_t M : {9, 17, 33, 64, 128})
    for (const auto& [N, K] : {std::pair{17, 33}, std::pair{100, 512}, std::pair{96, 64}})
      for (bool weight_nk : {true, false}) {
        const Case c = make_case(M, N, K, weight_nk, seed++);
        const auto prepared = build_prepared(c);
        ASSERT_EQ(matmul_packing(*prepared), MatmulPacking::amx_tiles) << label(c) << ": a fixed bf16 weight is packed";
        const std::vector<uint16_t> with = run_matmul(c, prepared.get());
        expect_matches_naive(c, with, label(c) + " prepared");
        EXPECT_EQ(with, run_amx(c)) << label(c) << ": the prepared kernel is the AMX GEMM";
        EXPECT_EQ(with, run_matmul(c, prepared.get(), &two)) << label(c) << " prepared, 2 threads";
        const std::vector<uint16_t> without = run_matmul(c, nullptr);
        expect_matches_naive(c, without, label(c) + " unprepared");
        EXPECT_EQ(without, run_matmul(c, nullptr, &two)) << label(c) << " unprepared, 2 threads";
        if (M >= amx::kMinRowsUnprepared) {
          EXPECT_EQ(with, without) << label(c) << ": both on AMX";
        }
      }
}

TEST(AmxMatmul, PreparedStateOfAnotherWeightIsIgnored) {
  SKIP_WITHOUT_AMX();
  // A launch of a kernel packed from different data (or a different layout) computes from its rhs.
  Case c = make_case(40, 50, 70, true, 31);
  const Case other{40, 50, 70, true, c.a, random_bf16(50 * 70, 32)};
  const auto prepared = build_prepared(c);
  ASSERT_EQ(matmul_packing(*prepared), MatmulPacking::amx_tiles);
  expect_matches_naive(other, run_matmul(other, prepared.get()), "other weight data");
  // The very buffer it was packed from (moving a vector keeps it), a [K, N] array read as the [N, K]
  // the kernel's transpose_b wants through a transposed view: other strides.
  const Case kn{40, 50, 70, false, random_bf16(40 * 70, 33), std::move(c.w)};
  std::vector<uint16_t> out(static_cast<size_t>(kn.M * kn.N), 0xFFFF);
  kernel_test::run_built(*prepared, {lhs_view(kn), kernel_test::permuted(weight_view(kn), {1, 0})},
                         {TensorView{out.data(), DType::bf16, {kn.M, kn.N}, {kn.N, 1}}});
  expect_matches_naive(kn, out, "same data, other layout");
}

TEST(AmxMatmul, PrepareSkipsDecodeOnlyStepsAndOperandsThatChange) {
  SKIP_WITHOUT_AMX();
  const Case decode = make_case(1, 64, 64, true, 3), prefill = make_case(9, 64, 64, true, 4);
  EXPECT_EQ(packing(decode, /*lhs_shape_known=*/true), MatmulPacking::none) << "a static M of 1 never reaches AMX";
  EXPECT_EQ(packing(make_case(8, 64, 64, true, 5), true), MatmulPacking::none) << "M = 8 keeps the GEMV";
  EXPECT_EQ(packing(prefill, true), MatmulPacking::amx_tiles);
  EXPECT_EQ(packing(decode, /*lhs_shape_known=*/false), MatmulPacking::amx_tiles) << "a symbolic M may be prefill";
  const bool not_fixed[] = {true, false};
  EXPECT_EQ(matmul_packing(*kernel_test::build_kernel(graph::Op::matmul, attrs_of(prefill),
                                                      {lhs_view(prefill), weight_view(prefill)}, {}, not_fixed)),
            MatmulPacking::none)
      << "an rhs that changes is not packed";
}

TEST(AmxMatmul, Bf16MatmulWithoutAmxIsUnchangedAndCorrect) {
  // What every CPU without AMX runs (here forced off): the SIMD GEMM, and no prepared state.
  amx::disable_for_testing(true);
  struct Restore {
    ~Restore() { amx::disable_for_testing(false); }
  } restore;
  EXPECT_FALSE(amx::available());
  uint32_t seed = 900;
  for (int64_t M : {1, 9, 33, 128})
    for (bool weight_nk : {true, false}) {
      const Case c = make_case(M, 70, 130, weight_nk, seed++);
      EXPECT_EQ(packing(c), MatmulPacking::none) << label(c) << ": nothing is packed without AMX";
      expect_matches_naive(c, run_matmul(c, nullptr), label(c) + " without AMX");
    }
}

// ---- f32 activations x bf16 weights -> f32 -------------------------------------------------------

// bf16 nearest to `x`, ties to the even one, found by comparing the two bf16 neighbours in double
// (written here apart from the kernel's integer trick; finite x of bf16 range only).
double round_to_bf16_reference(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  const uint16_t down = static_cast<uint16_t>(bits >> 16);  // toward zero
  if ((bits & 0xFFFF) == 0) return bf16_value(down);
  const uint16_t away = static_cast<uint16_t>(down + 1);  // away from zero
  const double to_down = std::fabs(double(x) - bf16_value(down)), to_away = std::fabs(double(x) - bf16_value(away));
  if (to_down != to_away) return to_down < to_away ? bf16_value(down) : bf16_value(away);
  return (down & 1) == 0 ? bf16_value(down) : bf16_value(away);
}

// f32 activations A [M, K] (uniform in [-1, 1), almost none of them bf16 values) and a bf16 weight.
// Many row blocks over a long K (the part's packed A past 1 MiB) run A-major: per group of column
// pairs whose packed B fits in L2, each row block against every pair of the group, with the next
// row block packed on the way (one part) or all of A packed first (parts sharing rows), and K
// walked forwards or backwards by block. The bits match the naive loop and do not depend on that.
TEST(AmxGemm, ManyRowBlocksOverLongKMatchNaiveLoopOnOneOrTwoThreads) {
  SKIP_WITHOUT_AMX();
  ThreadedParallel two(2);
  // 10 row blocks (the last of 12 rows) x 54 K tiles (the last of 4): 10 column pairs (the last a
  // single tile of 12 columns) in groups of 4, split by columns on 2 threads; then 19 row blocks x 57
  // K tiles on 2 pairs, split by rows.
  for (const auto& [M, N, K] : {std::tuple{300, 300, 1700}, std::tuple{600, 40, 1800}}) {
    const Case c = make_case(M, N, K, true, static_cast<uint32_t>(M + N + K));
    const std::vector<uint16_t> serial = run_amx(c);
    expect_matches_naive(c, serial, label(c));
    const int64_t before = two.chunks_run();
    EXPECT_EQ(run_amx(c, &two), serial) << label(c) << ", 2 threads";
    EXPECT_GT(two.chunks_run() - before, 1) << label(c) << ": the work was not split";
  }
}

struct MixedCase {
  int64_t M, N, K;
  bool weight_nk = true;
  std::vector<float> a;
  std::vector<uint16_t> w;
  int64_t b_row() const { return weight_nk ? 1 : N; }
  int64_t b_col() const { return weight_nk ? K : 1; }
};

MixedCase make_mixed_case(int64_t M, int64_t N, int64_t K, bool weight_nk, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(-1, 1);
  MixedCase c{M, N, K, weight_nk, std::vector<float>(static_cast<size_t>(M * K)), random_bf16(N * K, seed + 1000)};
  for (float& v : c.a) v = dist(rng);
  return c;
}

std::string label(const MixedCase& c) {
  return "f32 x bf16 " + std::to_string(c.M) + "x" + std::to_string(c.N) + "x" + std::to_string(c.K) +
         (c.weight_nk ? " weight [N, K]" : " weight [K, N]");
}

// C (f32, [M, N]) against the naive loop over activations rounded to bf16 (`round_activations`) or
// exact. The f32 sum of K exact products (bf16 x bf16 is exact in f32) is within K * 2^-23 of the
// true one; the result is not rounded further. Without the activation rounding a result moves by
// up to 2^-9 of the magnitude, far outside.
void expect_mixed_matches_naive(const MixedCase& c, const std::vector<float>& out, bool round_activations,
                                const std::string& what) {
  int bad = 0;
  for (int64_t m = 0; m < c.M; ++m)
    for (int64_t n = 0; n < c.N; ++n) {
      double sum = 0, magnitude = 0;
      for (int64_t k = 0; k < c.K; ++k) {
        const float x = c.a[m * c.K + k];
        const double p = (round_activations ? round_to_bf16_reference(x) : double(x)) *
                         bf16_value(c.w[k * c.b_row() + n * c.b_col()]);
        sum += p;
        magnitude += std::fabs(p);
      }
      const double tolerance = (c.K + 1) * std::ldexp(magnitude, -23) + 1e-30;
      const double got = out[m * c.N + n];
      if (!(std::fabs(got - sum) <= tolerance) && ++bad <= 5)
        ADD_FAILURE() << what << ": C[" << m << ", " << n << "] = " << got << ", expected " << sum << " +- "
                      << tolerance;
    }
}

std::vector<float> run_amx(const MixedCase& c, Parallel* parallel = nullptr) {
  SerialParallel serial;
  const KernelContext ctx{parallel ? parallel : &serial};
  const amx::PackedB packed = amx::PackedB::pack(ctx, c.w.data(), c.b_row(), c.b_col(), c.K, c.N);
  std::vector<float> out(static_cast<size_t>(c.M * c.N), std::nanf(""));
  amx::gemm(ctx, c.a.data(), c.K, 1, c.M, packed, out.data(), c.N);
  return out;
}

// Through the registered matmul kernel (dispatched on the f32 lhs), `prepared` or built without a
// fixed weight.
std::vector<float> run_matmul(const MixedCase& c, const Kernel* prepared, Parallel* parallel = nullptr) {
  std::vector<float> out(static_cast<size_t>(c.M * c.N), std::nanf(""));
  run_matmul(c, prepared, parallel, TensorView{const_cast<float*>(c.a.data()), DType::f32, {c.M, c.K}, {c.K, 1}},
             out);
  return out;
}

TEST(AmxMixedMatmul, RoundedActivationsMatchNaiveLoopPreparedOrNotOnAnyThreadCount) {
  SKIP_WITHOUT_AMX();
  ThreadedParallel two(2);
  uint32_t seed = 1100;
  for (int64_t M : {9, 17, 33, 128})
    for (int64_t N : {1, 17, 100})
      for (int64_t K : {1, 33, 2048})
        for (bool weight_nk : {true, false}) {
          const MixedCase c = make_mixed_case(M, N, K, weight_nk, seed++);
          const std::vector<float> direct = run_amx(c);
          expect_mixed_matches_naive(c, direct, /*round_activations=*/true, label(c));
          const auto prepared = build_prepared(c);
          ASSERT_EQ(matmul_packing(*prepared), MatmulPacking::amx_tiles)
              << label(c) << ": a fixed bf16 weight under f32 activations is packed for AMX";
          EXPECT_EQ(run_matmul(c, prepared.get()), direct) << label(c) << " prepared";
          EXPECT_EQ(run_matmul(c, nullptr), direct) << label(c) << " unprepared (packed per call)";
          const int64_t before = two.chunks_run();
          EXPECT_EQ(run_matmul(c, prepared.get(), &two), direct) << label(c) << " prepared, 2 threads";
          if (M * N * K >= (int64_t{1} << 22)) {
            EXPECT_GT(two.chunks_run() - before, 1) << label(c) << ": the work was not split";
          }
          EXPECT_EQ(run_matmul(c, nullptr, &two), direct) << label(c) << " unprepared, 2 threads";
        }
}

TEST(AmxMixedMatmul, ManyRowBlocksMatchNaiveLoopOnOneOrTwoThreads) {
  SKIP_WITHOUT_AMX();
  ThreadedParallel two(2);
  // A-major with f32 rows rounded while packed by the part that owns them (1 thread) or by all
  // threads before the parts split the columns (2 threads).
  const MixedCase c = make_mixed_case(300, 300, 1700, true, 1700);
  const std::vector<float> serial = run_amx(c);
  expect_mixed_matches_naive(c, serial, /*round_activations=*/true, label(c));
  EXPECT_EQ(run_amx(c, &two), serial) << label(c) << ", 2 threads";
}

// C[m] = A[m, 0] * 1 + A[m, 1] * 2^-20 with A[m, 1] = 1, through the matmul kernel: the activation
// A[m, 0] is rounded to bf16 (spacing 2^-7 at 1), the 2^-20 survives because C is not rounded to bf16.
void expect_activations_round_to_nearest_even(const std::string& path) {
  const float tie_down = 1 + std::ldexp(1.f, -8);                           // -> 1 (even)
  const float tie_up = 1 + 3 * std::ldexp(1.f, -8);                         // -> 1 + 2^-6 (even)
  const float above_tie = 1 + std::ldexp(1.f, -8) + std::ldexp(1.f, -20);   // -> 1 + 2^-7
  const float below_tie = 1 + std::ldexp(1.f, -8) - std::ldexp(1.f, -20);   // -> 1
  const std::vector<std::pair<float, float>> rows{{tie_down, 1},  {tie_up, 1},  {above_tie, 1},
                                                  {below_tie, 1}, {-tie_up, 1}, {-tie_down, 1},
                                                  {0.5f, 1},      {0, 1},       {tie_down, 1}};
  const std::vector<float> expected{1,       1 + std::ldexp(1.f, -6), 1 + std::ldexp(1.f, -7), 1, -(1 + std::ldexp(1.f, -6)),
                                    -1,      0.5f,                    0,                       1};
  MixedCase c{9, 1, 2, true, {}, {0x3F80, 0x3580}};  // weight [1, 2] = {1, 2^-20}
  ASSERT_EQ(bf16_value(0x3580), std::ldexp(1.f, -20));
  for (const auto& [x0, x1] : rows) c.a.insert(c.a.end(), {x0, x1});
  const std::vector<float> out = run_matmul(c, nullptr);
  for (int64_t m = 0; m < 9; ++m)
    EXPECT_EQ(out[m], expected[m] + std::ldexp(1.f, -20)) << path << ": row " << m << ", activation " << rows[m].first;
}

TEST(AmxMixedMatmul, ActivationsRoundToNearestEvenAndTheResultStaysF32) {
  SKIP_WITHOUT_AMX();
  expect_activations_round_to_nearest_even("AMX");
}

TEST(AmxMixedMatmul, StridedActivationsGiveTheSameBits) {
  SKIP_WITHOUT_AMX();
  // A read through a transposed view (a_col = M) and with padded rows: the scalar rounding path.
  const MixedCase c = make_mixed_case(33, 40, 45, true, 1300);
  SerialParallel serial;
  const KernelContext ctx{&serial};
  const amx::PackedB packed = amx::PackedB::pack(ctx, c.w.data(), c.b_row(), c.b_col(), c.K, c.N);
  std::vector<float> a_t(static_cast<size_t>(c.K * c.M)), a_padded(static_cast<size_t>(c.M * (c.K + 7)), std::nanf(""));
  for (int64_t m = 0; m < c.M; ++m)
    for (int64_t k = 0; k < c.K; ++k) a_t[k * c.M + m] = a_padded[m * (c.K + 7) + k] = c.a[m * c.K + k];
  const std::vector<float> contiguous = run_amx(c);
  std::vector<float> out(static_cast<size_t>(c.M * c.N));
  amx::gemm(ctx, a_t.data(), 1, c.M, c.M, packed, out.data(), c.N);
  EXPECT_EQ(out, contiguous) << "transposed lhs";
  amx::gemm(ctx, a_padded.data(), c.K + 7, 1, c.M, packed, out.data(), c.N);
  EXPECT_EQ(out, contiguous) << "padded lhs rows";
}

TEST(AmxMixedMatmul, DecodeRowsAndF32WeightsKeepTheExactPaths) {
  SKIP_WITHOUT_AMX();
  // M <= 8 (decode) keeps the GEMV on exact f32 activations, prepared or not.
  for (int64_t M : {1, 8}) {
    const MixedCase c = make_mixed_case(M, 40, 300, true, 1400 + static_cast<uint32_t>(M));
    EXPECT_EQ(packing(c, /*lhs_shape_known=*/true), MatmulPacking::none) << "M = " << M << " never reaches AMX";
    expect_mixed_matches_naive(c, run_matmul(c, build_prepared(c).get()), false, label(c) + " (decode)");
  }
  // An f32 weight is still packed into the SIMD GEMM's panels, not for AMX.
  const std::vector<float> w(64 * 64, 0.5f);
  const bool fixed[] = {false, true};
  const auto prepared = kernel_test::build_kernel(
      graph::Op::matmul, {},
      {TensorView{nullptr, DType::f32, {}, {}}, TensorView{const_cast<float*>(w.data()), DType::f32, {64, 64}, {64, 1}}},
      {}, fixed);
  EXPECT_EQ(matmul_packing(*prepared), MatmulPacking::f32_panels);
}

TEST(AmxMixedMatmul, LevelsWithoutBf16ProductsKeepF32ActivationsExact) {
  // What CPUs without AMX or AVX512_BF16 run (each such level forced here, AMX off): bf16 widened to
  // f32, activations not rounded, at every M.
  uint32_t seed = 1500;
  for (gemm::Isa isa : kernel_test::supported_isas()) {
    if (isa == gemm::Isa::avx512_bf16) continue;  // the dot GEMM's tests below
    kernel_test::ForcedIsa forced(isa);
    for (int64_t M : {1, 9, 33, 128})
      for (bool weight_nk : {true, false}) {
        const MixedCase c = make_mixed_case(M, 70, 130, weight_nk, seed++);
        const std::string what = label(c) + " on " + gemm::isa_name(isa);
        const auto prepared = build_prepared(c);
        if (isa != gemm::Isa::generic) {
          EXPECT_EQ(matmul_packing(*prepared), MatmulPacking::narrow_panels)
              << what << ": without AMX a bf16 weight is packed as bf16 for the SIMD GEMM";
        }
        const std::vector<float> with = run_matmul(c, prepared.get());
        expect_mixed_matches_naive(c, with, /*round_activations=*/false, what);
        // Above the chunked rows both run the GEMM: the panels packed at build as bf16 give the bits of
        // widening per call.
        if (M > gemm::kNarrowSmallMMax) {
          EXPECT_EQ(with, run_matmul(c, nullptr)) << what << " prepared vs per call";
        }
      }
  }
}

// ---- the same on the avx512_bf16 level's vdpbf16ps GEMM (no AMX) -----------------------------------

#define SKIP_WITHOUT_BF16_DOT()                                 \
  if (!gemm::isa_supported(gemm::Isa::avx512_bf16))             \
  GTEST_SKIP() << "the CPU has no AVX512_BF16 (vdpbf16ps): the " \
                  "bf16 dot GEMM is not compiled in or cannot run"

// Above gemm::kBf16DotMinRows rows the activations are rounded to bf16 and multiplied with the weight
// in k pairs: packed at build (the panels are in pairs on this level) or per call, 1 or 2 threads, the
// same bits, and the naive loop over rounded activations; odd K (a padded last pair) and K = 1.
TEST(Bf16DotMixedMatmul, RoundedActivationsMatchNaiveLoopPreparedOrNotOnAnyThreadCount) {
  SKIP_WITHOUT_BF16_DOT();
  kernel_test::ForcedIsa forced(gemm::Isa::avx512_bf16);
  ThreadedParallel two(2);
  uint32_t seed = 1600;
  for (int64_t M : {9, 17, 33, 128})
    for (int64_t N : {1, 17, 100})
      for (int64_t K : {1, 33, 2048})
        for (bool weight_nk : {true, false}) {
          const MixedCase c = make_mixed_case(M, N, K, weight_nk, seed++);
          const auto prepared = build_prepared(c);
          ASSERT_EQ(matmul_packing(*prepared), MatmulPacking::narrow_panels) << label(c);
          const std::vector<float> direct = run_matmul(c, prepared.get());
          expect_mixed_matches_naive(c, direct, /*round_activations=*/true, label(c));
          EXPECT_EQ(run_matmul(c, nullptr), direct) << label(c) << " unprepared (packed per call)";
          EXPECT_EQ(run_matmul(c, prepared.get(), &two), direct) << label(c) << " prepared, 2 threads";
          EXPECT_EQ(run_matmul(c, nullptr, &two), direct) << label(c) << " unprepared, 2 threads";
        }
}

TEST(Bf16DotMixedMatmul, ActivationsRoundToNearestEvenAndTheResultStaysF32) {
  SKIP_WITHOUT_BF16_DOT();
  kernel_test::ForcedIsa forced(gemm::Isa::avx512_bf16);
  expect_activations_round_to_nearest_even("vdpbf16ps");
}

// A row's bits above 8 rows do not depend on M or on the rows around it (the engine's batches), and
// a strided lhs (the rounding's scalar path) gives the same bits. Up to 8 rows the exact f32 path
// runs (test_batch_invariance.cpp checks those rows against each other and the f32 loop).
TEST(Bf16DotMixedMatmul, EveryRowGetsItsBitsAtEveryMAboveEight) {
  SKIP_WITHOUT_BF16_DOT();
  kernel_test::ForcedIsa forced(gemm::Isa::avx512_bf16);
  ThreadedParallel two(2);
  const MixedCase all = make_mixed_case(40, 150, 1120, true, 1700);
  const auto prepared = build_prepared(all);
  const std::vector<float> whole = run_matmul(all, prepared.get());
  expect_mixed_matches_naive(all, whole, /*round_activations=*/true, label(all));
  for (int64_t M : {9, 13, 32})
    for (int64_t m0 : {int64_t{0}, 40 - M})
      for (Parallel* parallel : {static_cast<Parallel*>(nullptr), static_cast<Parallel*>(&two)}) {
        MixedCase part = all;
        part.M = M;
        part.a.assign(all.a.begin() + m0 * all.K, all.a.begin() + (m0 + M) * all.K);
        const std::vector<float> got = run_matmul(part, prepared.get(), parallel);
        EXPECT_TRUE(std::equal(got.begin(), got.end(), whole.begin() + m0 * all.N))
            << "rows " << m0 << ".." << m0 + M << (parallel ? ", 2 threads" : "") << " differ from those rows at M = 40";
      }
  // The lhs read through a transposed view (a_col = M): the same bits.
  std::vector<float> a_t(static_cast<size_t>(all.K * all.M));
  for (int64_t m = 0; m < all.M; ++m)
    for (int64_t k = 0; k < all.K; ++k) a_t[k * all.M + m] = all.a[m * all.K + k];
  std::vector<float> strided(whole.size());
  run_matmul(all, prepared.get(), nullptr, TensorView{a_t.data(), DType::f32, {all.M, all.K}, {1, all.M}}, strided);
  EXPECT_EQ(strided, whole) << "transposed lhs";
}

}  // namespace
}  // namespace kiln::kernels
