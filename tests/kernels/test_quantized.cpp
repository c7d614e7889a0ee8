// Weight dtypes in the matmul kernels: f32 activations times f16/bf16 weights (mixed matmul), and
// Q8_0 weight rows (qmatmul, dequantize), on every ISA level this CPU supports, against naive
// double-precision loops written here that decode the GGUF Q8_0 block themselves.
//
// Tolerances. qmatmul quantizes each block of 32 activations to int8 with d = max|x| / 127 on every
// path (GEMV, GEMM, each ISA), so each product is off by at most d / 2 * |w|: the bound is
// sum_blocks d_b / 2 * sum_i |w_i|, plus f32 accumulation in any order, K * 2^-23 * sum_k |x_k w_k|
// (the f32 matmul paths: that alone). A wrong block scale or a dropped block is far above both.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <random>
#include <vector>

#include "../test_util.h"
#include "kernels/cpu/gemm.h"
#include "kernels/cpu/quantized.h"
#include "kernels/forced_isa.h"
#include "kernels/kernel_test_util.h"
#include "kernels/threaded_parallel.h"
#include "kiln/graph/quantization.h"

namespace kiln::kernels {
namespace {

using gemm::Isa;
using graph::Op;
using kernel_test::HostTensor;
using kernel_test::run_kernel;
using kernel_test::ThreadedParallel;

using kernel_test::ForcedIsa;
using kernel_test::supported_isas;

const graph::Attrs kQ8Attrs{{"encoding", std::string("q8_0")}};

std::vector<float> random_floats(int64_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = dist(rng);
  return v;
}

// The test's own reading of one GGUF Q8_0 row: [f16 d][32 x int8] per 32 weights.
std::vector<double> decode_row(const uint8_t* row, int64_t k) {
  std::vector<double> out(static_cast<size_t>(k));
  for (int64_t b = 0; b < k / 32; ++b) {
    const uint16_t bits = static_cast<uint16_t>(row[b * 34] | row[b * 34 + 1] << 8);
    const double d = f16_to_f32(bits);
    for (int i = 0; i < 32; ++i) out[static_cast<size_t>(b * 32 + i)] = d * static_cast<int8_t>(row[b * 34 + 2 + i]);
  }
  return out;
}

HostTensor quantized_weights(int64_t n, int64_t k, uint32_t seed) {
  const std::vector<float> w = random_floats(n * k, seed);
  HostTensor t(DType::u8, {n, k / 32 * 34});
  for (int64_t r = 0; r < n; ++r) graph::quantize_q8_0(w.data() + r * k, k, t.bytes.data() + r * (k / 32 * 34));
  return t;
}

// ---- host quantization ---------------------------------------------------------------------------------

TEST(Q8_0, QuantizeWritesGgufBlockWithRoundHalfAwayFromZero) {
  // max |x| = 63.5 gives d = 0.5 (exact in f16: bits 0x3800); x = 0.25 is q = 0.5, rounded away from 0.
  std::vector<float> x(32, 0.0f);
  x[0] = 63.5f;
  x[1] = -63.5f;
  x[2] = 0.25f;
  x[3] = -0.25f;
  x[4] = 1.0f;
  x[5] = 10.6f;  // 21.2 -> 21
  std::vector<uint8_t> block(34);
  graph::quantize_q8_0(x.data(), 32, block.data());
  EXPECT_EQ(block[0], 0x00);
  EXPECT_EQ(block[1], 0x38);
  const int expected[6] = {127, -127, 1, -1, 2, 21};
  for (int i = 0; i < 6; ++i) EXPECT_EQ(static_cast<int8_t>(block[2 + i]), expected[i]) << "element " << i;
  for (int i = 6; i < 32; ++i) EXPECT_EQ(block[2 + i], 0) << "element " << i;
}

TEST(Q8_0, AllZeroBlockHasZeroScaleAndQuants) {
  std::vector<float> x(64, 0.0f);
  std::vector<uint8_t> row(68, 0xFF);
  graph::quantize_q8_0(x.data(), 64, row.data());
  for (uint8_t b : row) EXPECT_EQ(b, 0);
}

TEST(Q8_0, RoundTripErrorIsAtMostHalfAStep) {
  const std::vector<float> x = random_floats(256, 7, 3.0f);
  std::vector<uint8_t> row(graph::q8_0_row_bytes(256));
  std::vector<float> back(256);
  graph::quantize_q8_0(x.data(), 256, row.data());
  graph::dequantize_q8_0(row.data(), 256, back.data());
  const std::vector<double> mine = decode_row(row.data(), 256);
  for (int b = 0; b < 8; ++b) {
    float amax = 0.0f;
    for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(x[b * 32 + i]));
    const double step = amax / 127.0;
    for (int i = 0; i < 32; ++i) {
      const int j = b * 32 + i;
      EXPECT_EQ(back[j], static_cast<float>(mine[j])) << j;
      // Half a step, plus the f16 rounding of d (2^-11 relative) times |q| <= 127.
      EXPECT_LE(std::fabs(back[j] - x[j]), step / 2 + 127 * step * std::ldexp(1.0, -11) + 1e-7) << j;
    }
  }
}

TEST(Q8_0, RowSizeRejectsKNotAMultipleOf32NamingTheWeight) {
  testing::expect_error<ValueError>([] { graph::quantized_row_bytes(graph::QuantizationEncoding::q8_0, 100, "q_proj.weight"); },
                                    {"q_proj.weight", "multiple of 32", "100"});
  testing::expect_error<ValueError>(
      [] { graph::quantized_row_elements(graph::QuantizationEncoding::q8_0, 35, "embed_tokens.weight"); },
      {"embed_tokens.weight", "34", "35"});
  EXPECT_EQ(graph::quantized_row_bytes(graph::QuantizationEncoding::q8_0, 4096), 4352);
}

// ---- qmatmul -------------------------------------------------------------------------------------

struct QCase {
  int64_t M, K, N;
};

// Checks y = x . W^T against the decoded weights; `quantized_x` adds the activation-rounding bound.
void expect_qmatmul_close(const std::vector<float>& x, const HostTensor& w, const HostTensor& y, int64_t M, int64_t K,
                          int64_t N, bool quantized_x, const std::string& what) {
  const int64_t rb = K / 32 * 34;
  for (int64_t n = 0; n < N; ++n) {
    const std::vector<double> wr = decode_row(w.bytes.data() + n * rb, K);
    for (int64_t m = 0; m < M; ++m) {
      double ref = 0, abs_sum = 0, act_bound = 0;
      for (int64_t b = 0; b < K / 32; ++b) {
        double amax = 0, wsum = 0;
        for (int i = 0; i < 32; ++i) {
          const int64_t k = b * 32 + i;
          ref += x[m * K + k] * wr[k];
          abs_sum += std::fabs(x[m * K + k] * wr[k]);
          amax = std::max(amax, std::fabs(double(x[m * K + k])));
          wsum += std::fabs(wr[k]);
        }
        act_bound += amax / 127 / 2 * wsum * 1.0001;
      }
      const double tol = K * std::ldexp(abs_sum, -23) + (quantized_x ? act_bound : 0.0) + 1e-6;
      ASSERT_NEAR(y.at<float>(m * N + n), ref, tol) << what << " m " << m << " n " << n;
    }
  }
}

// x [M, K] . w^T for a Q8_0 weight [N, K], on the active ISA, with `threads` pool threads.
HostTensor qmatmul(const std::vector<float>& x, const HostTensor& w, int64_t M, int64_t K, int64_t N, int threads = 1) {
  HostTensor xt = kernel_test::tensor<float>({M, K}, x);
  HostTensor y(DType::f32, {M, N});
  if (threads == 1) {
    run_kernel(Op::qmatmul, kQ8Attrs, {xt.view(), w.view()}, {y.view()});
  } else {
    ThreadedParallel pool(threads);
    run_kernel(Op::qmatmul, kQ8Attrs, {xt.view(), w.view()}, {y.view()}, &pool);
  }
  return y;
}

TEST(QMatmul, MatchesDecodedWeightsWithinActivationRoundingOnEveryIsa) {
  // GEMV sizes (M <= 8; {1, 288, 45}: an odd block count, 7 rows in each of the GEMV's 6 streams and 3
  // left over), GEMM sizes with every remainder of its 6-row tiles and 32-row panels, K from one block
  // to 4096, odd N.
  const QCase cases[] = {{1, 32, 1},    {1, 64, 7},    {2, 96, 33},   {3, 1024, 20}, {4, 4096, 9},
                         {5, 160, 17},  {6, 64, 5},    {7, 128, 31},  {8, 256, 40},  {9, 64, 19},
                         {16, 512, 70}, {33, 288, 33}, {128, 96, 37}, {13, 4096, 3}, {40, 32, 65},
                         {1, 288, 45}};
  for (Isa isa : supported_isas()) {
    ForcedIsa forced(isa);
    for (const QCase& c : cases) {
      const std::vector<float> x = random_floats(c.M * c.K, static_cast<uint32_t>(c.M * 131 + c.K));
      const HostTensor w = quantized_weights(c.N, c.K, static_cast<uint32_t>(c.N + 3));
      const HostTensor y = qmatmul(x, w, c.M, c.K, c.N);
      expect_qmatmul_close(x, w, y, c.M, c.K, c.N, true,
                           std::string(gemm::isa_name(isa)) + " M " + std::to_string(c.M) + " K " + std::to_string(c.K));
    }
  }
}

// Integer activations with max |x| = 127 in every block quantize exactly (d = 1), as do integer
// weights with max |w| = 127 (d = 1 in f16), and every partial sum stays below 2^24: the result is
// the exact integer dot product, whatever the path: the weight's rows, and its panels packed at build
// (a fixed weight). A sign or +128 offset slip shows at once. Some quants are then set to -128 (a
// file may hold them though ggml writes -127..127): |q| = 128 must not wrap.
TEST(QMatmul, IntegerBlocksGiveTheExactIntegerProductOnEveryIsa) {
  const int64_t K = 256, N = 35;
  std::mt19937 rng(3);
  std::uniform_int_distribution<int> value(-127, 127);
  auto integer_rows = [&](int64_t rows) {
    std::vector<float> v(static_cast<size_t>(rows * K));
    for (float& e : v) e = static_cast<float>(value(rng));
    for (int64_t i = 0; i < rows * K; i += 32) v[static_cast<size_t>(i + i / 32 % 32)] = (i / 32) % 2 ? 127.0f : -127.0f;
    return v;
  };
  std::vector<float> wf = integer_rows(N);
  HostTensor w(DType::u8, {N, K / 32 * 34});
  for (int64_t n = 0; n < N; ++n) graph::quantize_q8_0(wf.data() + n * K, K, w.bytes.data() + n * (K / 32 * 34));
  for (int64_t n = 0; n < N; n += 3)  // every third row: 5 quants of -128 per block, beside its +-127
    for (int64_t k = 0; k < K; k += 7)
      if (std::fabs(wf[static_cast<size_t>(n * K + k)]) != 127.0f) {
        w.bytes[static_cast<size_t>(n * (K / 32 * 34) + k / 32 * 34 + 2 + k % 32)] = 0x80;
        wf[static_cast<size_t>(n * K + k)] = -128.0f;
      }
  TensorView symbolic_lhs;
  symbolic_lhs.dtype = DType::f32;
  const bool fixed[] = {false, true};
  for (int64_t M : {1, 5, 8, 16, 33}) {
    const std::vector<float> x = integer_rows(M);
    const HostTensor xt = kernel_test::tensor<float>({M, K}, x);
    for (Isa isa : supported_isas()) {
      ForcedIsa forced(isa);
      HostTensor packed(DType::f32, {M, N});
      kernel_test::run_built(*kernel_test::build_kernel(Op::qmatmul, kQ8Attrs, {symbolic_lhs, w.view()}, {}, fixed),
                             {xt.view(), w.view()}, {packed.view()});
      for (const auto& [y, path] : {std::pair{qmatmul(x, w, M, K, N), "rows"}, std::pair{packed, "fixed"}})
        for (int64_t m = 0; m < M; ++m)
          for (int64_t n = 0; n < N; ++n) {
            int64_t ref = 0;
            for (int64_t k = 0; k < K; ++k)
              ref += static_cast<int64_t>(x[m * K + k]) * static_cast<int64_t>(wf[n * K + k]);
            ASSERT_EQ(y.at<float>(m * N + n), static_cast<float>(ref))
                << gemm::isa_name(isa) << " " << path << " M " << M << " m " << m << " n " << n;
          }
    }
  }
}

// The activations round half to even (x * 127 / max|x|, as vcvtps2dq does), on the GEMV and the
// GEMM: weight row n is 127 at k = n and 0 elsewhere (d_w = 1), so y[n] = 127 * d_x * q_x[n].
TEST(QMatmul, ActivationsRoundHalfToEvenOnEveryIsa) {
  const std::vector<float> halves = {127.0f, 0.5f, 1.5f, 2.5f, -2.5f, -0.5f, 3.5f, 126.5f, -126.49f};
  const std::vector<float> expected_q = {127, 0, 2, 2, -2, -0, 4, 126, -126};
  const int64_t K = 32, N = static_cast<int64_t>(halves.size());
  std::vector<float> wf(static_cast<size_t>(N * K), 0.0f);
  for (int64_t n = 0; n < N; ++n) wf[static_cast<size_t>(n * K + n)] = 127.0f;
  HostTensor w(DType::u8, {N, 34});
  for (int64_t n = 0; n < N; ++n) graph::quantize_q8_0(wf.data() + n * K, K, w.bytes.data() + n * 34);
  for (int64_t M : {1, 9}) {
    std::vector<float> x(static_cast<size_t>(M * K), 0.0f);
    for (int64_t m = 0; m < M; ++m) std::copy(halves.begin(), halves.end(), x.begin() + m * K);
    for (Isa isa : supported_isas()) {
      ForcedIsa forced(isa);
      const HostTensor y = qmatmul(x, w, M, K, N);
      for (int64_t m = 0; m < M; ++m)
        for (int64_t n = 0; n < N; ++n)
          ASSERT_EQ(y.at<float>(m * N + n), 127.0f * expected_q[static_cast<size_t>(n)])
              << gemm::isa_name(isa) << " M " << M << " x " << halves[static_cast<size_t>(n)];
    }
  }
}

TEST(QMatmul, OneAndTwoThreadsGiveIdenticalBitsOnEveryIsa) {
  for (Isa isa : supported_isas()) {
    ForcedIsa forced(isa);
    for (const QCase& c : {QCase{1, 512, 301}, QCase{5, 256, 77}, QCase{24, 256, 99}, QCase{64, 128, 200}}) {
      const std::vector<float> x = random_floats(c.M * c.K, 31);
      const HostTensor w = quantized_weights(c.N, c.K, 32);
      EXPECT_EQ(qmatmul(x, w, c.M, c.K, c.N, 1).bytes, qmatmul(x, w, c.M, c.K, c.N, 2).bytes)
          << gemm::isa_name(isa) << " M " << c.M;
    }
  }
}

// The weight's GEMM panels packed at build (the qmatmul kernel of a fixed weight) against packing per
// call (VNNI) or the block GEMM on the rows (AVX2): the same bits on 1 and 2 threads, for row counts
// that are not a multiple of the 32-row panel, a symbolic lhs (empty shape at init) and a static one,
// on every ISA level but the portable one (which packs nothing); decode shapes pack too.
TEST(QMatmul, PreparedPanelsGiveTheSameBitsAsPackingPerCall) {
  for (Isa isa : supported_isas()) {
    ForcedIsa forced(isa);
    const bool packs = isa != Isa::generic;  // VNNI's panels, else AVX2's (the same bytes)
    for (const QCase& c : {QCase{9, 96, 70}, QCase{40, 256, 33}, QCase{13, 64, 64}}) {
      const std::vector<float> x = random_floats(c.M * c.K, 41);
      const HostTensor w = quantized_weights(c.N, c.K, 42);
      const HostTensor xt = kernel_test::tensor<float>({c.M, c.K}, x);
      const bool fixed[] = {false, true};
      for (bool symbolic : {true, false}) {
        TensorView lhs_at_init;  // data unknown at init; shape empty when symbolic
        lhs_at_init.dtype = DType::f32;
        if (!symbolic) {
          lhs_at_init.shape = {c.M, c.K};
          lhs_at_init.strides = {c.K, 1};
        }
        const auto prepared = kernel_test::build_kernel(Op::qmatmul, kQ8Attrs, {lhs_at_init, w.view()}, {}, fixed);
        const std::string what = std::string(gemm::isa_name(isa)) + " M " + std::to_string(c.M);
        EXPECT_EQ(qmatmul_packed_panels(*prepared), packs)
            << what << ": panels are packed exactly where a kernel for them runs";
        if (!qmatmul_packed_panels(*prepared)) continue;
        for (int threads : {1, 2}) {
          const HostTensor want = qmatmul(x, w, c.M, c.K, c.N, threads);
          HostTensor got(DType::f32, {c.M, c.N});
          ThreadedParallel pool(threads);
          kernel_test::run_built(*prepared, {xt.view(), w.view()}, {got.view()}, &pool);
          EXPECT_EQ(got.bytes, want.bytes) << what << " threads " << threads;
        }
      }
      TensorView decode_lhs;
      decode_lhs.dtype = DType::f32;
      decode_lhs.shape = {1, c.K};
      decode_lhs.strides = {c.K, 1};
      EXPECT_EQ(qmatmul_packed_panels(*kernel_test::build_kernel(Op::qmatmul, kQ8Attrs, {decode_lhs, w.view()}, {}, fixed)),
                packs)
          << "a decode-shaped lhs runs on the panels too";
    }
  }
}

TEST(QMatmul, StridedAndBatchedLhsMatchTheReference) {
  const int64_t K = 128, N = 45;
  for (int64_t M : {3, 24}) {
    // lhs [M, K] read as every other column of an [M, 2K] array.
    const std::vector<float> wide = random_floats(M * 2 * K, 11);
    std::vector<float> x(static_cast<size_t>(M * K));
    for (int64_t m = 0; m < M; ++m)
      for (int64_t k = 0; k < K; ++k) x[m * K + k] = wide[m * 2 * K + 2 * k];
    HostTensor xt = kernel_test::tensor<float>({M, 2 * K}, wide);
    TensorView strided = xt.view();
    strided.shape = {M, K};
    strided.strides = {2 * K, 2};
    const HostTensor w = quantized_weights(N, K, 5);
    HostTensor serial(DType::f32, {M, N}), threaded(DType::f32, {M, N});
    run_kernel(Op::qmatmul, kQ8Attrs, {strided, w.view()}, {serial.view()});
    ThreadedParallel two(2);
    run_kernel(Op::qmatmul, kQ8Attrs, {strided, w.view()}, {threaded.view()}, &two);
    expect_qmatmul_close(x, w, serial, M, K, N, true, "strided");
    EXPECT_EQ(serial.bytes, threaded.bytes) << "M " << M;
  }
  // A rank-3 lhs [2, 3, K] is 6 rows; [3, 5, K] is 15.
  for (int64_t batch : {2, 3}) {
    const int64_t rows = batch == 2 ? 3 : 5;
    const std::vector<float> x = random_floats(batch * rows * K, 12);
    const HostTensor w = quantized_weights(N, K, 6);
    HostTensor xt = kernel_test::tensor<float>({batch, rows, K}, x), y(DType::f32, {batch, rows, N});
    run_kernel(Op::qmatmul, kQ8Attrs, {xt.view(), w.view()}, {y.view()});
    expect_qmatmul_close(x, w, y, batch * rows, K, N, true, "rank 3");
  }
}

TEST(QMatmul, BadOperandsAreErrorsNamingTheOpAndOperand) {
  HostTensor x(DType::f32, {2, 100}), w(DType::u8, {4, 102}), y(DType::f32, {2, 4});
  testing::expect_error<ValueError>([&] { run_kernel(Op::qmatmul, kQ8Attrs, {x.view(), w.view()}, {y.view()}); },
                                    {"qmatmul: lhs inner dim", "multiple of 32", "100"});
  HostTensor x64(DType::f32, {2, 64}), wf16(DType::f16, {4, 68});
  testing::expect_error<DTypeError>([&] { run_kernel(Op::qmatmul, kQ8Attrs, {x64.view(), wf16.view()}, {y.view()}); },
                                    {"qmatmul", "rhs u8", "f32[2, 64]", "f16[4, 68]"});
}

TEST(QMatmul, WrongRowBytesIsAShapeErrorNamingBothOperands) {
  HostTensor x(DType::f32, {2, 64}), w(DType::u8, {4, 70}), y(DType::f32, {2, 4});
  testing::expect_error<ShapeError>([&] { run_kernel(Op::qmatmul, kQ8Attrs, {x.view(), w.view()}, {y.view()}); },
                                    {"68 bytes", "f32[2, 64]", "u8[4, 70]"});
}

TEST(Dequantize, DecodesGatheredRowsOfAnyLeadingShape) {
  const HostTensor w = quantized_weights(6, 96, 9);
  HostTensor in = w;
  in.shape = {2, 3, 102};
  HostTensor y(DType::f32, {2, 3, 96});
  run_kernel(Op::dequantize, kQ8Attrs, {in.view()}, {y.view()});
  for (int64_t r = 0; r < 6; ++r) {
    const std::vector<double> ref = decode_row(w.bytes.data() + r * 102, 96);
    for (int64_t k = 0; k < 96; ++k) ASSERT_EQ(y.at<float>(r * 96 + k), static_cast<float>(ref[k])) << r << ", " << k;
  }
}

// ---- mixed matmul: f32 x f16 / bf16 -----------------------------------------------------------------

// Above 8 rows the avx512_bf16 level multiplies bf16 weights in bf16: its reference rounds the
// activations first.
TEST(MixedMatmul, F32TimesNarrowWeightsMatchesWidenedReferenceOnEveryIsa) {
  const QCase cases[] = {{1, 64, 33}, {3, 100, 20}, {8, 256, 17}, {20, 300, 70}};
  for (DType wd : {DType::bf16, DType::f16})
    for (bool transpose_b : {true, false})
      for (Isa isa : supported_isas()) {
        ForcedIsa forced(isa);
        for (const QCase& c : cases) {
          const std::vector<float> x = random_floats(c.M * c.K, 21);
          const std::vector<float> wf = random_floats(c.N * c.K, 22);
          std::vector<double> wd_values(wf.size());
          HostTensor w = kernel_test::tensor_from_doubles(
              wd, transpose_b ? std::vector<int64_t>{c.N, c.K} : std::vector<int64_t>{c.K, c.N},
              std::vector<double>(wf.begin(), wf.end()));
          for (size_t i = 0; i < wf.size(); ++i) wd_values[i] = w.as_double(static_cast<int64_t>(i));
          HostTensor xt = kernel_test::tensor<float>({c.M, c.K}, x), y(DType::f32, {c.M, c.N});
          graph::Attrs attrs;
          if (transpose_b) attrs["transpose_b"] = int64_t{1};
          run_kernel(Op::matmul, attrs, {xt.view(), w.view()}, {y.view()});
          // The bf16 dot GEMM rounds the activations to bf16 above 8 rows (gemm.h).
          const bool rounded = wd == DType::bf16 && isa == Isa::avx512_bf16 && c.M > gemm::kBf16DotMinRows;
          const HostTensor x_used = kernel_test::tensor_from_doubles(rounded ? DType::bf16 : DType::f32, {c.M, c.K},
                                                                     std::vector<double>(x.begin(), x.end()));
          for (int64_t m = 0; m < c.M; ++m)
            for (int64_t n = 0; n < c.N; ++n) {
              double ref = 0, abs_sum = 0;
              for (int64_t k = 0; k < c.K; ++k) {
                const double wv = transpose_b ? wd_values[n * c.K + k] : wd_values[k * c.N + n];
                const double xv = x_used.as_double(m * c.K + k);
                ref += xv * wv;
                abs_sum += std::fabs(xv * wv);
              }
              ASSERT_NEAR(y.at<float>(m * c.N + n), ref, c.K * std::ldexp(abs_sum, -23) + 1e-6)
                  << dtype_name(wd) << (transpose_b ? " transpose_b " : " plain ") << gemm::isa_name(isa) << " M "
                  << c.M << " m " << m << " n " << n;
            }
        }
      }
}

TEST(MixedMatmul, NarrowLhsWithF32RhsIsStillADTypeError) {
  HostTensor x(DType::bf16, {2, 4}), w(DType::f32, {4, 3}), y(DType::bf16, {2, 3});
  testing::expect_error<DTypeError>([&] { run_kernel(Op::matmul, {}, {x.view(), w.view()}, {y.view()}); },
                                    {"bf16[2, 4]", "f32[4, 3]"});
}

}  // namespace
}  // namespace kiln::kernels
