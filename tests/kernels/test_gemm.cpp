// The SIMD GEMM / GEMV behind matmul (kernels/cpu/gemm.h), on every ISA level this CPU supports
// (forced one at a time, so the AVX2 and generic fallbacks run on an AVX-512 machine too), against a
// naive double-precision loop written here: edge sizes around the register tile and cache blocks,
// both rhs layouts (plain [K, N] and transpose_b's [N, K]), strided operands, batches, f32 / f16 /
// bf16, and 1 vs 2 threads.
//
// Tolerance, per element: the accumulation bound K * 2^-23 * sum_k |a_k b_k| (f32 accumulators,
// whatever the summation order; vdpbf16ps rounds no more often than an FMA chain), plus the final
// rounding to the result dtype (2^-24, 2^-11, 2^-8 of |result| for f32, f16, bf16; 2^-25 absolute for
// f16's subnormals). Inputs are
// drawn in the operand dtype, so the reference sees exactly the values the kernel sees. One wrong
// product changes a result by about sum / K, far above this bound.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "kernels/cpu/gemm.h"
#include "kernels/cpu/matmul.h"
#include "kernels/forced_isa.h"
#include "kernels/kernel_test_util.h"
#include "kernels/threaded_parallel.h"

namespace kiln::kernels {
namespace {

using gemm::BStorage;
using gemm::Isa;
using graph::Op;
using kernel_test::build_kernel;
using kernel_test::HostTensor;
using kernel_test::run_built;
using kernel_test::run_kernel;
using kernel_test::tensor_from_doubles;
using kernel_test::ThreadedParallel;

using kernel_test::ForcedIsa;
using kernel_test::supported_isas;

// How the rhs is stored and handed to the kernel.
enum class Rhs {
  plain,        // [K, N] contiguous
  transposed,   // stored [N, K], attr transpose_b (nn::Linear's weights)
  strided,      // [K, N] view of every other column of a [K, 2N] array: no unit stride
};
const char* rhs_name(Rhs r) { return r == Rhs::plain ? "plain" : r == Rhs::transposed ? "transpose_b" : "strided"; }

struct Operands {
  HostTensor a, b;                     // as stored
  TensorView a_view, b_view;           // as passed to the kernel
  graph::Attrs attrs;
  std::vector<double> a_vals, b_vals;  // logical [batch_a, M, K] and [batch_b, K, N], exact values
};

std::vector<double> random_doubles(int64_t n, std::mt19937& rng) {
  std::vector<double> v(static_cast<size_t>(n));
  for (double& x : v) x = std::uniform_real_distribution<double>(-1, 1)(rng);
  return v;
}

// lhs [batch_a, M, K], rhs [batch_b, K, N] (batch dims dropped when 0), values representable in dtype.
Operands make_operands(DType dtype, int64_t batch_a, int64_t batch_b, int64_t M, int64_t N, int64_t K, Rhs rhs,
                       uint32_t seed) {
  std::mt19937 rng(seed);
  Operands o;
  const int64_t ba = std::max<int64_t>(batch_a, 1), bb = std::max<int64_t>(batch_b, 1);
  auto with_batch = [](int64_t batch, std::vector<int64_t> s) {
    if (batch > 0) s.insert(s.begin(), batch);
    return s;
  };
  o.a = tensor_from_doubles(dtype, with_batch(batch_a, {M, K}), random_doubles(ba * M * K, rng));
  o.a_view = o.a.view();
  for (int64_t i = 0; i < o.a.numel(); ++i) o.a_vals.push_back(o.a.as_double(i));
  o.b_vals.assign(static_cast<size_t>(bb * K * N), 0.0);
  switch (rhs) {
    case Rhs::plain:
      o.b = tensor_from_doubles(dtype, with_batch(batch_b, {K, N}), random_doubles(bb * K * N, rng));
      o.b_view = o.b.view();
      for (int64_t i = 0; i < o.b.numel(); ++i) o.b_vals[i] = o.b.as_double(i);
      break;
    case Rhs::transposed:
      o.b = tensor_from_doubles(dtype, with_batch(batch_b, {N, K}), random_doubles(bb * K * N, rng));
      o.b_view = o.b.view();
      o.attrs["transpose_b"] = int64_t{1};
      for (int64_t z = 0; z < bb; ++z)
        for (int64_t n = 0; n < N; ++n)
          for (int64_t k = 0; k < K; ++k) o.b_vals[(z * K + k) * N + n] = o.b.as_double((z * N + n) * K + k);
      break;
    case Rhs::strided:
      o.b = tensor_from_doubles(dtype, with_batch(batch_b, {K, 2 * N}), random_doubles(bb * K * 2 * N, rng));
      o.b_view = o.b.view();
      o.b_view.shape.back() = N;
      o.b_view.strides.back() = 2;
      for (int64_t z = 0; z < bb; ++z)
        for (int64_t k = 0; k < K; ++k)
          for (int64_t n = 0; n < N; ++n) o.b_vals[(z * K + k) * N + n] = o.b.as_double((z * K + k) * 2 * N + 2 * n);
      break;
  }
  return o;
}

double rounding_of(DType dtype) { return dtype == DType::f32 ? 0x1p-24 : dtype == DType::f16 ? 0x1p-11 : 0x1p-8; }
// Half the spacing of the result dtype's subnormals: the absolute rounding error of tiny results.
double subnormal_step(DType dtype) { return dtype == DType::f16 ? 0x1p-25 : 0x1p-150; }

HostTensor run(const Operands& o, const std::vector<int64_t>& out_shape, Parallel* parallel = nullptr) {
  HostTensor out(o.a.dtype, out_shape);
  run_kernel(Op::matmul, o.attrs, {o.a_view, o.b_view}, {out.view()}, parallel);
  return out;
}

// Checks `out`, matmul of `o`, against the naive loop (batch broadcast: a size-1 batch repeats).
void expect_matches_naive(const Operands& o, int64_t batch, int64_t M, int64_t N, int64_t K, const HostTensor& out,
                          const std::string& what) {
  SCOPED_TRACE(what);
  const int64_t ba = o.a_vals.size() / static_cast<size_t>(M * K), bb = o.b_vals.size() / static_cast<size_t>(K * N);
  const DType dtype = o.a.dtype;
  int failures = 0;
  for (int64_t z = 0; z < std::max<int64_t>(batch, 1); ++z)
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < N; ++n) {
        double sum = 0, abs_sum = 0;
        const int64_t za = ba == 1 ? 0 : z, zb = bb == 1 ? 0 : z;
        for (int64_t k = 0; k < K; ++k) {
          const double p = o.a_vals[(za * M + m) * K + k] * o.b_vals[(zb * K + k) * N + n];
          sum += p;
          abs_sum += std::abs(p);
        }
        const double got = out.as_double((z * M + m) * N + n);
        const double tol = K * 0x1p-23 * abs_sum + rounding_of(dtype) * std::abs(sum) + subnormal_step(dtype);
        if (!(std::abs(got - sum) <= tol) && ++failures <= 5)
          ADD_FAILURE() << "[" << z << ", " << m << ", " << n << "]: got " << got << ", want " << sum
                        << " (tolerance " << tol << ")";
      }
}

// Runs matmul of `o` and checks it against the naive loop.
void expect_correct(const Operands& o, int64_t batch, int64_t M, int64_t N, int64_t K, const std::string& what,
                    Parallel* parallel = nullptr) {
  std::vector<int64_t> shape = {M, N};
  if (batch > 0) shape.insert(shape.begin(), batch);
  expect_matches_naive(o, batch, M, N, K, run(o, shape, parallel), what);
}

std::string label(Isa isa, DType dtype, Rhs rhs, int64_t M, int64_t N, int64_t K) {
  return std::string(gemm::isa_name(isa)) + " " + std::string(dtype_name(dtype)) + " " + rhs_name(rhs) + " M=" +
         std::to_string(M) + " N=" + std::to_string(N) + " K=" + std::to_string(K);
}

// Sizes around the register tiles (6 x 16, 6 x 64; every row count mod 6), the small-M limit (8), the
// vector width and the cache blocks (KC 512 / 256 f32, 1024 / 512 bf16 pairs; MC 192 / 384, split
// into equal row blocks; NC 1024 / 512).
struct Shape {
  int64_t M, N, K;
};
const Shape kShapes[] = {
    {1, 1, 1},    {1, 7, 17},    {1, 129, 65},  {1, 33, 600},  {2, 65, 33},    {3, 17, 129}, {7, 33, 7},
    {8, 129, 17}, {9, 7, 65},    {17, 65, 33},  {33, 17, 129}, {65, 129, 1},   {6, 64, 256}, {12, 128, 512},
    {13, 65, 257}, {20, 600, 40}, {19, 70, 1100}, {129, 33, 65}, {5, 1000, 70}, {10, 1030, 257},
    {520, 17, 33}, {390, 70, 300},
};

TEST(Gemm, MatchesNaiveLoopOnEveryIsaDtypeAndRhsLayout) {
  uint32_t seed = 1;
  for (Isa isa : supported_isas()) {
    ForcedIsa forced(isa);
    for (DType dtype : {DType::f32, DType::f16, DType::bf16})
      for (Rhs rhs : {Rhs::plain, Rhs::transposed, Rhs::strided})
        for (const Shape& s : kShapes) {
          if (rhs == Rhs::strided && s.M * s.N * s.K > 200000) continue;  // the slow generic packing path
          const Operands o = make_operands(dtype, 0, 0, s.M, s.N, s.K, rhs, seed++);
          expect_correct(o, 0, s.M, s.N, s.K, label(isa, dtype, rhs, s.M, s.N, s.K));
        }
  }
}

TEST(Gemm, BatchedAndBroadcastBatchesMatchNaiveLoop) {
  uint32_t seed = 100;
  for (Isa isa : supported_isas()) {
    ForcedIsa forced(isa);
    for (DType dtype : {DType::f32, DType::bf16})
      for (Rhs rhs : {Rhs::plain, Rhs::transposed}) {
        // Per-batch rhs (attention-like), small and large M.
        for (const Shape& s : {Shape{1, 37, 64}, Shape{4, 20, 33}, Shape{30, 45, 70}}) {
          const Operands o = make_operands(dtype, 5, 5, s.M, s.N, s.K, rhs, seed++);
          expect_correct(o, 5, s.M, s.N, s.K, "batched " + label(isa, dtype, rhs, s.M, s.N, s.K));
        }
        // One rhs shared by every batch (a linear layer): batches fold into rows.
        const Operands shared = make_operands(dtype, 3, 0, 5, 70, 40, rhs, seed++);
        expect_correct(shared, 3, 5, 70, 40, "shared rhs " + label(isa, dtype, rhs, 5, 70, 40));
      }
  }
}

TEST(Gemm, StridedLhsMatchesNaiveLoop) {
  // lhs [M, K] read through a [K, M] array's transpose: no unit stride along K.
  for (Isa isa : supported_isas()) {
    ForcedIsa forced(isa);
    for (DType dtype : {DType::f32, DType::f16, DType::bf16})
      for (const Shape& s : {Shape{3, 70, 33}, Shape{20, 40, 300}}) {
        Operands o = make_operands(dtype, 0, 0, s.M, s.N, s.K, Rhs::transposed, 7);
        std::mt19937 rng(8);
        o.a = tensor_from_doubles(dtype, {s.K, s.M}, random_doubles(s.K * s.M, rng));
        o.a_view = kernel_test::permuted(o.a.view(), {1, 0});
        for (int64_t m = 0; m < s.M; ++m)
          for (int64_t k = 0; k < s.K; ++k) o.a_vals[m * s.K + k] = o.a.as_double(k * s.M + m);
        expect_correct(o, 0, s.M, s.N, s.K, "strided lhs " + label(isa, dtype, Rhs::transposed, s.M, s.N, s.K));
      }
  }
}

TEST(Gemm, TwoThreadsGiveTheSameBitsAsOne) {
  ThreadedParallel two(2);
  uint32_t seed = 200;
  for (Isa isa : supported_isas()) {
    ForcedIsa forced(isa);
    for (DType dtype : {DType::f32, DType::f16, DType::bf16})
      for (Rhs rhs : {Rhs::plain, Rhs::transposed})
        // {1, 3000, 700}: a GEMV cut into more parts than threads.
        for (const Shape& s : {Shape{1, 1000, 130}, Shape{1, 3000, 700}, Shape{5, 333, 200}, Shape{100, 300, 300},
                               Shape{300, 40, 100}}) {
          const Operands o = make_operands(dtype, 0, 0, s.M, s.N, s.K, rhs, seed++);
          const int64_t before = two.chunks_run();
          const HostTensor serial = run(o, {s.M, s.N});
          const HostTensor threaded = run(o, {s.M, s.N}, &two);
          const std::string what = label(isa, dtype, rhs, s.M, s.N, s.K);
          EXPECT_GT(two.chunks_run() - before, 1) << what << ": the work was not split";
          EXPECT_EQ(serial.bytes, threaded.bytes) << what;
          expect_correct(o, 0, s.M, s.N, s.K, what, &two);
        }
  }
}

// The f32 weight packed at build (the matmul kernel of a fixed rhs) against packing per call: the
// same bits, on every ISA level, both rhs layouts, 1 and 2 threads, shapes around the blocks.
TEST(Gemm, PreparedWeightGivesTheSameBitsAsPackingPerCall) {
  ThreadedParallel two(2);
  SerialParallel serial;
  uint32_t seed = 300;
  for (Isa isa : supported_isas()) {
    ForcedIsa forced(isa);
    for (Rhs rhs : {Rhs::plain, Rhs::transposed})
      // {200, 70, 1100}: three depth blocks (the next block's panels prefetched from the init-packed
      // weight) and two row blocks of 102 rows, the last row tile 2 high.
      for (const Shape& s : {Shape{9, 70, 33}, Shape{100, 300, 300}, Shape{520, 65, 257}, Shape{13, 1100, 257},
                             Shape{200, 70, 1100}}) {
        const Operands o = make_operands(DType::f32, 0, 0, s.M, s.N, s.K, rhs, seed++);
        const bool fixed[] = {false, true};
        TensorView lhs_at_init;  // data unknown at init, static shape
        lhs_at_init.dtype = DType::f32;
        lhs_at_init.shape = {s.M, s.K};
        lhs_at_init.strides = {s.K, 1};
        HostTensor with(DType::f32, {s.M, s.N});
        const auto kernel = build_kernel(Op::matmul, o.attrs, {lhs_at_init, o.b_view}, {with.view()}, fixed);
        const std::string what = label(isa, DType::f32, rhs, s.M, s.N, s.K);
        if (isa == Isa::generic) {
          EXPECT_EQ(matmul_packing(*kernel), MatmulPacking::none) << what << ": nothing to pack without SIMD kernels";
          continue;
        }
        ASSERT_EQ(matmul_packing(*kernel), MatmulPacking::f32_panels) << what;
        for (Parallel* parallel : {static_cast<Parallel*>(&serial), static_cast<Parallel*>(&two)}) {
          const HostTensor unprepared = run(o, {s.M, s.N}, parallel);
          run_built(*kernel, {o.a_view, o.b_view}, {with.view()}, parallel);
          EXPECT_EQ(unprepared.bytes, with.bytes) << what << " threads " << parallel->num_threads();
          expect_matches_naive(o, 0, s.M, s.N, s.K, with, what + " prepared");
        }
      }
  }
}

// The panels packed at build are what a launch of that kernel reads: changing the weight's bytes
// afterwards (which a fixed weight never does) leaves its result at the packed values. A kernel
// built without the weight fixed, or launched with another rhs, reads the rhs it is given.
TEST(Gemm, PreparedLaunchReadsThePanelsPackedAtInit) {
  if (gemm::best_isa() == Isa::generic) GTEST_SKIP() << "no SIMD level on this CPU";
  const int64_t M = 20, N = 70, K = 40;
  Operands o = make_operands(DType::f32, 0, 0, M, N, K, Rhs::transposed, 11);
  const Operands other = make_operands(DType::f32, 0, 0, M, N, K, Rhs::transposed, 12);
  const bool fixed[] = {false, true};
  HostTensor shape_only(DType::f32, {M, N});
  const auto prepared = build_kernel(Op::matmul, o.attrs, {o.a_view, o.b_view}, {shape_only.view()}, fixed);
  const auto unprepared = build_kernel(Op::matmul, o.attrs, {o.a_view, o.b_view}, {shape_only.view()});
  ASSERT_EQ(matmul_packing(*prepared), MatmulPacking::f32_panels);
  const HostTensor before = run(o, {M, N});
  std::memcpy(o.b.bytes.data(), other.b.bytes.data(), o.b.bytes.size());  // same buffer, new values
  auto launch = [&](const Operands& x, const Kernel& kernel) {
    HostTensor out(DType::f32, {M, N});
    run_built(kernel, {x.a_view, x.b_view}, {out.view()});
    return out;
  };
  EXPECT_EQ(launch(o, *prepared).bytes, before.bytes);
  Operands changed = o;
  changed.b_vals = other.b_vals;
  changed.b_view.data = changed.b.bytes.data();
  expect_matches_naive(changed, 0, M, N, K, launch(changed, *unprepared), "without the state");
  expect_matches_naive(other, 0, M, N, K, launch(other, *prepared), "another rhs");
}

// A fixed weight packed at build on two threads (each slice's panels split between them, as a
// model's init does) gives the launches the bits it gives packed on one: f32 and bf16 panels.
TEST(Gemm, PanelsPackedOnSeveralThreadsGiveTheSameBits) {
  if (gemm::best_isa() == Isa::generic) GTEST_SKIP() << "no SIMD level on this CPU";
  const int64_t M = 20, N = 333, K = 72;  // several panels, the last one partial
  for (DType dtype : {DType::f32, DType::bf16}) {
    const Operands o = make_operands(DType::f32, 0, 0, M, N, K, Rhs::transposed, 21);
    HostTensor w(dtype, {N, K});
    for (int64_t i = 0; i < N * K; ++i) {
      const float v = o.b.at<float>(i);
      const uint16_t narrow = f32_to_bf16(v);
      if (dtype == DType::f32)
        std::memcpy(w.bytes.data() + i * 4, &v, 4);
      else
        std::memcpy(w.bytes.data() + i * 2, &narrow, 2);
    }
    const bool fixed[] = {false, true};
    HostTensor shape_only(DType::f32, {M, N});
    ThreadedParallel two(2);
    const auto serial = build_kernel(Op::matmul, o.attrs, {o.a_view, w.view()}, {shape_only.view()}, fixed);
    const auto threaded = build_kernel(Op::matmul, o.attrs, {o.a_view, w.view()}, {shape_only.view()}, fixed, &two);
    EXPECT_NE(matmul_packing(*threaded), MatmulPacking::none) << dtype_name(dtype);
    HostTensor want(DType::f32, {M, N}), got(DType::f32, {M, N});
    run_built(*serial, {o.a_view, w.view()}, {want.view()});
    run_built(*threaded, {o.a_view, w.view()}, {got.view()});
    EXPECT_EQ(got.bytes, want.bytes) << dtype_name(dtype);
  }
}

// A 16-bit weight packed at init keeps its elements as stored, each where PackedB's layout says:
// panel n / nr, row k, lane n % nr; or, bf16 on a vdpbf16ps level, row k / 2, lane n % nr, half
// k % 2 (depth made even); zero past N and K. Every level, both weight layouts, depths that end
// inside and on a 32-deep transpose block, one and two packing threads.
TEST(Gemm, NarrowPanelsHoldEachElementWhereTheLayoutSays) {
  ThreadedParallel two(2);
  for (Isa isa : supported_isas()) {
    if (isa == Isa::generic) continue;  // nothing is packed without SIMD kernels
    ForcedIsa forced(isa);
    const gemm::IsaKernels* kernels = isa == Isa::avx2     ? gemm::avx2_kernels()
                                      : isa == Isa::avx512 ? gemm::avx512_kernels()
                                                           : gemm::avx512_bf16_kernels();
    const int64_t nr = kernels->blocking.nr;
    for (BStorage storage : {BStorage::f16, BStorage::bf16})
      for (bool transposed : {true, false})
        for (int64_t K : {int64_t{75}, int64_t{64}})
          for (Parallel* parallel : {static_cast<Parallel*>(nullptr), static_cast<Parallel*>(&two)}) {
            const int64_t N = 333;  // several panels, the last one partial
            std::vector<uint16_t> b(static_cast<size_t>(N * K));
            std::mt19937 rng(static_cast<uint32_t>(K * 7 + N));
            for (uint16_t& x : b) x = static_cast<uint16_t>(rng() | 1);  // never 0, unlike the padding
            gemm::Problem p;
            p.b = b.data();
            p.b_row = transposed ? 1 : N;  // B[k, n] at k * b_row + n * b_col
            p.b_col = transposed ? K : 1;
            p.N = N;
            p.K = K;
            p.b_storage = storage;
            const std::optional<gemm::PackedB> packed = gemm::pack_b(p, {}, parallel);
            ASSERT_TRUE(packed && packed->narrow);
            const bool pairs = storage == BStorage::bf16 && kernels->bf16_pairs;
            const int64_t depth = pairs ? (K + 1) / 2 * 2 : K, panels = (N + nr - 1) / nr;
            const std::string what = std::string(gemm::isa_name(isa)) + (storage == BStorage::f16 ? " f16" : " bf16") +
                                     (transposed ? " transpose_b" : " plain") + " K " + std::to_string(K) +
                                     (parallel ? " two threads" : " one thread");
            int wrong = 0;
            for (int64_t n = 0; n < panels * nr; ++n)
              for (int64_t k = 0; k < depth; ++k) {
                const int64_t q = n / nr, j = n % nr;
                const int64_t at = q * depth * nr + (pairs ? (k / 2 * nr + j) * 2 + k % 2 : k * nr + j);
                const uint16_t want = n < N && k < K ? b[static_cast<size_t>(k * p.b_row + n * p.b_col)] : 0;
                if (packed->narrow.get()[at] != want && ++wrong <= 3)
                  ADD_FAILURE() << what << ": element k " << k << " n " << n << " is " << packed->narrow.get()[at]
                                << ", not " << want;
              }
            EXPECT_EQ(wrong, 0) << what;
          }
  }
}

// Only a GEMM reads the panels: a lhs whose rows are statically <= 8 (decode) gets no packed copy.
TEST(Gemm, PrepareSkipsWeightsOnlyEverUsedForSmallM) {
  if (gemm::best_isa() == Isa::generic) GTEST_SKIP() << "no SIMD level on this CPU";
  const Operands o = make_operands(DType::f32, 0, 0, 8, 70, 40, Rhs::transposed, 13);
  const bool fixed[] = {false, true}, none_fixed[] = {false, false};
  HostTensor out(DType::f32, {8, 70});
  auto packing = [&](const TensorView& lhs, std::span<const bool> which) {
    return matmul_packing(*build_kernel(Op::matmul, o.attrs, {lhs, o.b_view}, {out.view()}, which));
  };
  EXPECT_EQ(packing(o.a_view, fixed), MatmulPacking::none);
  TensorView symbolic_lhs;  // a symbolic shape: could be a prefill
  symbolic_lhs.dtype = DType::f32;
  EXPECT_EQ(packing(symbolic_lhs, fixed), MatmulPacking::f32_panels);
  EXPECT_EQ(packing(symbolic_lhs, none_fixed), MatmulPacking::none);
}

TEST(Gemm, SpecialValuesPropagate) {
  // A NaN or infinity in one operand reaches exactly the results it contributes to.
  for (Isa isa : supported_isas()) {
    ForcedIsa forced(isa);
    for (DType dtype : {DType::f32, DType::bf16})
      for (int64_t M : {1, 20}) {
        Operands o = make_operands(dtype, 0, 0, M, 40, 30, Rhs::transposed, 9);
        const HostTensor nan = tensor_from_doubles(dtype, {1}, {std::nan("")});
        const HostTensor inf = tensor_from_doubles(dtype, {1}, {INFINITY});
        const size_t size = dtype_size(dtype);
        std::memcpy(o.a.bytes.data() + (0 * 30 + 3) * size, nan.bytes.data(), size);  // a[0, 3]
        std::memcpy(o.b.bytes.data() + (5 * 30 + 4) * size, inf.bytes.data(), size);  // b^T[5, 4]
        const HostTensor out = run(o, {M, 40});
        const std::string what = label(isa, dtype, Rhs::transposed, M, 40, 30);
        for (int64_t n = 0; n < 40; ++n) EXPECT_TRUE(std::isnan(out.as_double(n))) << what << " n=" << n;
        for (int64_t m = 1; m < M; ++m) {
          EXPECT_TRUE(std::isinf(out.as_double(m * 40 + 5))) << what << " m=" << m;
          EXPECT_TRUE(std::isfinite(out.as_double(m * 40 + 6))) << what << " m=" << m;
        }
      }
  }
}

TEST(Gemm, SelectsAvx512WhereAvailableAndObeysForcing) {
  const Isa best = gemm::best_isa();
  EXPECT_TRUE(gemm::isa_supported(best));
  EXPECT_TRUE(gemm::isa_supported(Isa::generic));
  EXPECT_EQ(gemm::active_isa(), best);
  for (Isa isa : supported_isas()) {
    ForcedIsa forced(isa);
    EXPECT_EQ(gemm::active_isa(), isa);
  }
  EXPECT_EQ(gemm::active_isa(), best);
#if defined(__x86_64__)
  // What this x86-64 CPU reports must be what is selected: AVX-512 kernels wherever AVX-512 is there
  // (vdpbf16ps ones on AMD only, where they are faster).
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  if (avx512 && __builtin_cpu_supports("avx512bf16") && __builtin_cpu_is("amd")) {
    EXPECT_EQ(best, Isa::avx512_bf16);
  } else if (avx512) {
    EXPECT_EQ(best, Isa::avx512);
  } else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && !__builtin_cpu_supports("avx512f")) {
    EXPECT_EQ(best, Isa::avx2);
  }
#endif
}

TEST(Gemm, ForcingAnUnsupportedLevelIsAnError) {
  for (Isa isa : {Isa::avx2, Isa::avx512, Isa::avx512_bf16}) {
    if (gemm::isa_supported(isa)) continue;
    try {
      gemm::force_isa_for_testing(isa);
      ADD_FAILURE() << "forcing " << gemm::isa_name(isa) << " did not throw";
    } catch (const ValueError& e) {
      EXPECT_NE(std::string(e.what()).find(gemm::isa_name(isa)), std::string::npos) << e.what();
    }
  }
  EXPECT_EQ(gemm::active_isa(), gemm::best_isa());
}

}  // namespace
}  // namespace kiln::kernels
