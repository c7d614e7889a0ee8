// qmatmul and dequantize for Q4_0, Q4_K, Q5_K and Q6_K weights (quantized.h's last section), on every
// ISA level this CPU supports (the portable kernels, the AVX2 ones where the CPU has AVX2, and the
// K-quants' AVX-512 decode GEMV where it has AVX512_VNNI, and every encoding's block GEMM above 8
// rows where it has AVX2 or AVX512_VNNI), against double-precision loops over the weights as
// graph::dequantize_row decodes them (itself checked bit for bit against the layouts in
// tests/graph/test_quantization.cpp).
//
// Tolerances, as for Q8_0 (test_quantized.cpp): the activations are quantized per block of 32 (Q4_0)
// or 256 (the K-quants) with d = max|x| / 127, so each product is off by at most d / 2 * |w|: the
// bound is sum_blocks d_b / 2 * sum_i |w_i| (times 1.0001), plus f32 accumulation in any order,
// K * 2^-23 * sum_k |x_k w_k|. Exactly the integer product when weights and activations are small
// integers (the scales 1, every sum below 2^24).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <utility>
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
using graph::QuantizationEncoding;
using kernel_test::ForcedIsa;
using kernel_test::HostTensor;
using kernel_test::run_kernel;
using kernel_test::supported_isas;
using kernel_test::ThreadedParallel;

constexpr QuantizationEncoding kEncodings[] = {QuantizationEncoding::q4_0, QuantizationEncoding::q4_k,
                                               QuantizationEncoding::q5_k, QuantizationEncoding::q6_k};

graph::Attrs attrs(QuantizationEncoding e) { return {{"encoding", std::string(graph::encoding_name(e))}}; }
std::string name(QuantizationEncoding e) { return std::string(graph::encoding_name(e)); }

std::vector<float> random_floats(int64_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = dist(rng);
  return v;
}

HostTensor quantized_weights(QuantizationEncoding e, int64_t n, int64_t k, uint32_t seed) {
  const std::vector<float> w = random_floats(n * k, seed);
  const int64_t row_bytes = graph::quantized_row_bytes(e, k);
  HostTensor t(DType::u8, {n, row_bytes});
  for (int64_t r = 0; r < n; ++r) graph::quantize_row(e, w.data() + r * k, k, t.bytes.data() + r * row_bytes);
  return t;
}

std::vector<float> decoded(QuantizationEncoding e, const HostTensor& w, int64_t n, int64_t k) {
  std::vector<float> out(static_cast<size_t>(k));
  graph::dequantize_row(e, w.bytes.data() + n * w.shape[1], k, out.data());
  return out;
}

HostTensor qmatmul(QuantizationEncoding e, const std::vector<float>& x, const HostTensor& w, int64_t M, int64_t K,
                   int threads = 1) {
  HostTensor xt = kernel_test::tensor<float>({M, K}, x);
  HostTensor y(DType::f32, {M, w.shape[0]});
  ThreadedParallel pool(threads);
  run_kernel(Op::qmatmul, attrs(e), {xt.view(), w.view()}, {y.view()}, threads > 1 ? &pool : nullptr);
  return y;
}

void expect_close(QuantizationEncoding e, const std::vector<float>& x, const HostTensor& w, const HostTensor& y,
                  int64_t M, int64_t K, const std::string& what) {
  const int64_t N = w.shape[0];
  for (int64_t n = 0; n < N; ++n) {
    const std::vector<float> wr = decoded(e, w, n, K);
    for (int64_t m = 0; m < M; ++m) {
      double ref = 0, abs_sum = 0, act_bound = 0;
      const int64_t block = quantized::activation_block(e);
      for (int64_t b = 0; b < K / block; ++b) {
        double amax = 0, wsum = 0;
        for (int64_t k = b * block; k < b * block + block; ++k) {
          ref += double(x[m * K + k]) * wr[k];
          abs_sum += std::fabs(double(x[m * K + k]) * wr[k]);
          amax = std::max(amax, std::fabs(double(x[m * K + k])));
          wsum += std::fabs(wr[k]);
        }
        act_bound += amax / 127 / 2 * wsum * 1.0001;
      }
      const double tol = K * std::ldexp(abs_sum, -23) + act_bound + 1e-6;
      ASSERT_NEAR(y.at<float>(m * N + n), ref, tol) << what << " m " << m << " n " << n;
    }
  }
}

TEST(QMatmulBlocks, MatchesDecodedWeightsWithinActivationRoundingOnEveryIsa) {
  struct Case {
    int64_t M, K, N;
  };
  // K: one super-block, two, and 17 (4096 + 256); M: decode (1, 3) and prefill (17, one row past two
  // passes of 8; 9 and 40: the block GEMM's partial and whole 6-row tiles); N not a multiple of
  // anything, below one 16-row half of a GEMM panel, between 16 and 32, and over several panels.
  // Q4_0 also at K = 32 and 288 (a partial group of 8 blocks).
  const Case k_cases[] = {{1, 256, 37}, {3, 512, 65}, {17, 4352, 9}, {1, 4352, 33}, {3, 256, 1},
                          {17, 512, 20}, {9, 512, 70}, {40, 256, 33}};
  const Case q4_0_cases[] = {{1, 32, 5}, {3, 288, 37}, {17, 96, 9}};
  for (Isa isa : supported_isas()) {
    ForcedIsa forced(isa);
    for (QuantizationEncoding e : kEncodings) {
      std::vector<Case> cases(std::begin(k_cases), std::end(k_cases));
      if (e == QuantizationEncoding::q4_0) cases.insert(cases.end(), std::begin(q4_0_cases), std::end(q4_0_cases));
      for (const Case& c : cases) {
        const std::vector<float> x = random_floats(c.M * c.K, static_cast<uint32_t>(c.M * 131 + c.K));
        const HostTensor w = quantized_weights(e, c.N, c.K, static_cast<uint32_t>(c.N + 3));
        expect_close(e, x, w, qmatmul(e, x, w, c.M, c.K), c.M, c.K,
                     name(e) + " " + gemm::isa_name(isa) + " M " + std::to_string(c.M) + " K " + std::to_string(c.K));
      }
    }
  }
}

// Weights whose every scale is a small integer (d = dmin = 1, 6-bit scales and mins below 8, Q6_K's
// int8 scales in [-7, 7]) and integer activations with max |x| = 127 per block (d_x = 1): the result is
// the exact integer product, whatever the path. A sign, offset (-8, -32, the mins) or scale slip shows.
// `extreme`: every quant at its largest level and every activation +-127 (a row's sign), so each
// product is the largest its format allows: a kernel summing them in too narrow an integer shows.
TEST(QMatmulBlocks, IntegerBlocksGiveTheExactIntegerProductOnEveryIsa) {
  const int64_t K = 512, N = 19;
  std::mt19937 rng(5);
  std::uniform_int_distribution<int> value(-127, 127);
  const auto put_one = [](uint8_t* p) { p[0] = 0x00, p[1] = 0x3C; };  // f16 1.0
  for (bool extreme : {false, true})
    for (QuantizationEncoding e : kEncodings) {
      const int64_t row_bytes = graph::quantized_row_bytes(e, K), bytes = graph::block_bytes(e);
      HostTensor w(DType::u8, {N, row_bytes});
      for (uint8_t& b : w.bytes) b = extreme ? 0xFF : static_cast<uint8_t>(rng());
      for (int64_t off = 0; off < N * row_bytes; off += bytes) {
        uint8_t* block = w.bytes.data() + off;
        if (e == QuantizationEncoding::q6_k) {
          put_one(block + 208);
          for (int j = 0; j < 16; ++j)
            block[192 + j] = static_cast<uint8_t>(static_cast<int>(rng() % 15) - 7);
        } else {
          put_one(block);
          if (e != QuantizationEncoding::q4_0) {
            put_one(block + 2);
            for (int j = 0; j < 8; ++j) block[4 + j] &= 0x07;  // 6-bit values < 8, high bits 0
            for (int j = 8; j < 12; ++j) block[4 + j] &= 0x77;
          }
        }
      }
      for (int64_t M : {1, 5, 17}) {
        std::vector<float> x(static_cast<size_t>(M * K));
        for (float& v : x) v = static_cast<float>(value(rng));
        for (int64_t i = 0; i < M * K; i += 32)
          x[static_cast<size_t>(i + rng() % 32)] = rng() % 2 ? 127.0f : -127.0f;
        if (extreme)
          for (int64_t i = 0; i < M * K; ++i) x[static_cast<size_t>(i)] = i / K % 2 ? -127.0f : 127.0f;
        for (Isa isa : supported_isas()) {
          ForcedIsa forced(isa);
          const HostTensor y = qmatmul(e, x, w, M, K);
          for (int64_t n = 0; n < N; ++n) {
            const std::vector<float> wr = decoded(e, w, n, K);
            for (int64_t m = 0; m < M; ++m) {
              int64_t ref = 0;
              for (int64_t k = 0; k < K; ++k)
                ref += static_cast<int64_t>(x[m * K + k]) * static_cast<int64_t>(wr[static_cast<size_t>(k)]);
              ASSERT_LT(std::abs(ref), int64_t{1} << 24);
              ASSERT_EQ(y.at<float>(m * N + n), static_cast<float>(ref))
                  << name(e) << " " << gemm::isa_name(isa) << (extreme ? " extreme" : "") << " M " << M
                  << " m " << m << " n " << n;
            }
          }
        }
      }
    }
}

TEST(QMatmulBlocks, OneAndTwoThreadsGiveIdenticalBitsOnEveryIsa) {
  for (Isa isa : supported_isas()) {
    ForcedIsa forced(isa);
    for (QuantizationEncoding e : kEncodings)
      for (const auto& [M, K, N] : {std::tuple<int64_t, int64_t, int64_t>{1, 512, 301}, {3, 4352, 77}, {17, 256, 99}}) {
        const std::vector<float> x = random_floats(M * K, 31);
        const HostTensor w = quantized_weights(e, N, K, 32);
        EXPECT_EQ(qmatmul(e, x, w, M, K, 1).bytes, qmatmul(e, x, w, M, K, 2).bytes)
            << name(e) << " " << gemm::isa_name(isa) << " M " << M;
      }
  }
}

// The K-quants' AVX-512 decode GEMV folds its 16 int32 lanes onto the AVX2 kernel's 8, so one
// activation row gives the AVX2 level's bits exactly, and the bits of that row computed with others
// (the AVX2 kernel), on any row count N (the 4-stream split and its remainder).
TEST(QMatmulBlocks, Avx512DecodeGemvGivesTheAvx2BitsExactly) {
  if (!gemm::isa_supported(Isa::avx512) || !__builtin_cpu_supports("avx512vnni"))
    GTEST_SKIP() << "this CPU has no AVX-512 VNNI: the AVX-512 K-quant GEMV was not run";
  for (QuantizationEncoding e : {QuantizationEncoding::q4_k, QuantizationEncoding::q5_k, QuantizationEncoding::q6_k})
    for (const auto& [K, N] : {std::pair<int64_t, int64_t>{256, 1}, {512, 7}, {4352, 37}, {2048, 130}}) {
      const std::vector<float> x = random_floats(3 * K, static_cast<uint32_t>(K + N));
      const std::vector<float> x0(x.begin(), x.begin() + K);
      const HostTensor w = quantized_weights(e, N, K, static_cast<uint32_t>(N));
      HostTensor avx2, avx512, three_rows;
      {
        ForcedIsa forced(Isa::avx2);
        avx2 = qmatmul(e, x0, w, 1, K);
      }
      {
        ForcedIsa forced(Isa::avx512);
        avx512 = qmatmul(e, x0, w, 1, K);
        three_rows = qmatmul(e, x, w, 3, K);
      }
      EXPECT_EQ(avx512.bytes, avx2.bytes) << name(e) << " K " << K << " N " << N;
      const std::vector<uint8_t> first_row(three_rows.bytes.begin(), three_rows.bytes.begin() + N * 4);
      EXPECT_EQ(avx512.bytes, first_row) << name(e) << " K " << K << " N " << N;
    }
}

// The AVX2 GEMV decodes and multiplies one activation row a block or sub-block pair at a time (in
// each format's kStreams streams of weight rows), several rows a group at a time: the same sums in
// the same order, so one row gives the bits of that row computed with others, whole groups and a
// row's partial last one (K 288: 9 blocks), on any row count N (the streams' split and remainder).
TEST(QMatmulBlocks, Avx2OneRowGivesTheBitsOfThatRowAmongOthers) {
  if (!gemm::isa_supported(Isa::avx2)) GTEST_SKIP() << "this CPU has no AVX2: the AVX2 GEMV was not run";
  ForcedIsa forced(Isa::avx2);
  for (QuantizationEncoding e : {QuantizationEncoding::q8_0, QuantizationEncoding::q4_0, QuantizationEncoding::q4_k,
                                 QuantizationEncoding::q5_k, QuantizationEncoding::q6_k})
    for (const auto& [K, N] : {std::pair<int64_t, int64_t>{288, 5}, {512, 1}, {512, 7}, {4352, 37}, {2048, 130}}) {
      if (K % graph::block_size(e) != 0) continue;
      const std::vector<float> x = random_floats(3 * K, static_cast<uint32_t>(K + N));
      const std::vector<float> x0(x.begin(), x.begin() + K);
      const HostTensor w = quantized_weights(e, N, K, static_cast<uint32_t>(N));
      const HostTensor one_row = qmatmul(e, x0, w, 1, K), three_rows = qmatmul(e, x, w, 3, K);
      const std::vector<uint8_t> first_row(three_rows.bytes.begin(), three_rows.bytes.begin() + N * 4);
      EXPECT_EQ(one_row.bytes, first_row) << name(e) << " K " << K << " N " << N;
    }
}

// Above 8 rows the block GEMM runs (every ISA with one: AVX-512 VNNI, AVX2; Q8_0's on AVX2) in tiles of several
// activation rows, passes of 16 chunks and column vectors of 8 or 16 weight rows; each output's
// operations are its own, so a row's bits do not depend on how many rows share the call (9, 13: a
// one-row last tile; 40), whole and partial passes (K 4352: 136 chunks), and a panel's partial last
// column vector (N 70).
TEST(QMatmulBlocks, BlockGemmRowsDoNotDependOnTheBatchOnEveryIsa) {
  for (Isa isa : supported_isas()) {
    ForcedIsa forced(isa);
    for (QuantizationEncoding e : {QuantizationEncoding::q4_0, QuantizationEncoding::q4_k, QuantizationEncoding::q5_k,
                                   QuantizationEncoding::q6_k, QuantizationEncoding::q8_0})
      for (const auto& [K, N] : {std::pair<int64_t, int64_t>{512, 70}, {4352, 37}}) {
        const std::vector<float> x = random_floats(40 * K, static_cast<uint32_t>(K + 7));
        const HostTensor w = quantized_weights(e, N, K, static_cast<uint32_t>(N + 1));
        const HostTensor all = qmatmul(e, x, w, 40, K);
        for (int64_t M : {9, 13}) {
          const std::vector<float> first(x.begin(), x.begin() + M * K);
          const std::vector<uint8_t> rows(all.bytes.begin(), all.bytes.begin() + M * N * 4);
          EXPECT_EQ(qmatmul(e, first, w, M, K).bytes, rows)
              << name(e) << " " << gemm::isa_name(isa) << " K " << K << " M " << M;
        }
      }
  }
}

// The AVX2 block GEMM adds its int16 pair sums exactly and does the AVX-512 VNNI kernel's f32
// operations in its order (quantized_block_unpack.h's BlockGemmRule), so it gives that kernel's bits.
TEST(QMatmulBlocks, Avx2BlockGemmGivesTheAvx512BlockGemmBitsExactly) {
  if (!gemm::isa_supported(Isa::avx512) || !__builtin_cpu_supports("avx512vnni"))
    GTEST_SKIP() << "this CPU has no AVX-512 VNNI: the AVX2 block GEMM was not compared with it";
  for (QuantizationEncoding e : kEncodings)
    for (const auto& [M, K, N] : {std::tuple<int64_t, int64_t, int64_t>{9, 512, 70}, {40, 4352, 37}, {17, 256, 33}}) {
      const std::vector<float> x = random_floats(M * K, static_cast<uint32_t>(M + K));
      const HostTensor w = quantized_weights(e, N, K, static_cast<uint32_t>(N + 2));
      HostTensor avx2, avx512;
      {
        ForcedIsa forced(Isa::avx2);
        avx2 = qmatmul(e, x, w, M, K);
      }
      {
        ForcedIsa forced(Isa::avx512);
        avx512 = qmatmul(e, x, w, M, K);
      }
      EXPECT_EQ(avx2.bytes, avx512.bytes) << name(e) << " M " << M << " K " << K;
    }
}

// The K-quants' activation quantizers of each ISA level give the portable one's bits: ordinary
// blocks, an all-zero one, halves to round to even (max 127: the scale is 1), a NaN and an infinity.
TEST(QuantizeRows256, SimdQuantizersGiveThePortableBits) {
  constexpr int64_t M = 2, K = 1024;
  std::vector<float> x = random_floats(M * K, 77, 3.0f);
  std::fill(x.begin() + 256, x.begin() + 512, 0.0f);
  for (int i = 0; i < 256; ++i) x[512 + i] = static_cast<float>(i % 2 ? -(i % 9) : i % 7) + 0.5f;
  x[512] = 127.0f;
  x[1024 + 3] = std::nanf("");
  x[1536 + 200] = -INFINITY;
  struct Out {
    std::vector<uint8_t> q = std::vector<uint8_t>(M * K);
    std::vector<float> d = std::vector<float>(M * K / 256);
    std::vector<int32_t> sum = std::vector<int32_t>(M * K / 32);
    std::vector<int16_t> sum16 = std::vector<int16_t>(M * K / 16);
  };
  const auto run = [&](quantized::QuantizeRows256Fn fn) {
    Out o;
    fn(x.data(), M, K, o.q.data(), o.d.data(), o.sum.data(), o.sum16.data());
    return o;
  };
  const Out want = run(quantized::portable_quantize_rows_256);
  const auto bits = [](const std::vector<float>& v) {
    std::vector<uint32_t> b(v.size());
    std::memcpy(b.data(), v.data(), v.size() * 4);
    return b;
  };
  int ran = 0;
  for (const auto& [name, fn] : {std::pair{"avx2", gemm::isa_supported(Isa::avx2) ? quantized::avx2_quantize_rows_256() : nullptr},
                                 std::pair{"avx512", __builtin_cpu_supports("avx512vnni") && gemm::isa_supported(Isa::avx512)
                                                         ? quantized::avx512_quantize_rows_256()
                                                         : nullptr}}) {
    if (!fn) continue;
    ++ran;
    const Out got = run(fn);
    EXPECT_EQ(got.q, want.q) << name;
    EXPECT_EQ(bits(got.d), bits(want.d)) << name;
    EXPECT_EQ(got.sum, want.sum) << name;
    EXPECT_EQ(got.sum16, want.sum16) << name;
  }
  if (ran == 0) GTEST_SKIP() << "this CPU has neither AVX2 nor AVX-512 VNNI: only the portable quantizer exists";
}

// Q8_0's activation quantizer by hand: max|x| = 127, so the scale is 1 and each level is x rounded
// half to even; a NaN quantizes to 127 and is skipped by the max; offset adds 128.
TEST(QuantizeRows, PortableQuantizerRoundsHalfToEven) {
  std::vector<float> x(32, 0.0f);
  const float given[] = {127.0f, 0.5f, 1.5f, 2.5f, -0.5f, -1.5f, -2.5f, 3.49f, -127.0f, std::nanf("")};
  std::copy(std::begin(given), std::end(given), x.begin());
  const int want[] = {127, 0, 2, 2, 0, -2, -2, 3, -127, 127};
  for (bool offset : {false, true}) {
    std::vector<uint8_t> q(32);
    float d = 0;
    int32_t sum = 0;
    quantized::portable_quantize_rows(x.data(), 1, 32, offset, q.data(), &d, &sum);
    EXPECT_EQ(d, 1.0f);
    EXPECT_EQ(sum, 127 + 2 + 2 - 2 - 2 + 3 - 127 + 127);
    for (int i = 0; i < 32; ++i)
      EXPECT_EQ(q[i], static_cast<uint8_t>((i < 10 ? want[i] : 0) + (offset ? 128 : 0))) << "offset " << offset << " i " << i;
  }
}

// Q8_0's activation quantizers of each ISA level give the portable one's bits, offset or not, with
// sums or without: ordinary blocks, an all-zero one, halves to round to even, a NaN and an infinity.
TEST(QuantizeRows, SimdQuantizersGiveThePortableBits) {
  constexpr int64_t M = 3, K = 1024;
  std::vector<float> x = random_floats(M * K, 78, 3.0f);
  std::fill(x.begin() + 32, x.begin() + 64, 0.0f);
  for (int i = 0; i < 32; ++i) x[64 + i] = static_cast<float>(i % 2 ? -(i % 9) : i % 7) + 0.5f;
  x[64 + 5] = 127.0f;
  for (int j = 0; j < 32; ++j) x[(8 + j) * 32 + j] = std::nanf("");  // a NaN at each place in a block
  x[2 * K + 255] = INFINITY;
  x[2 * K + 7] = -INFINITY;
  struct Out {
    std::vector<uint8_t> q = std::vector<uint8_t>(M * K);
    std::vector<float> d = std::vector<float>(M * K / 32);
    std::vector<int32_t> sum = std::vector<int32_t>(M * K / 32, -1);
    bool operator==(const Out& o) const {
      return q == o.q && sum == o.sum && std::memcmp(d.data(), o.d.data(), d.size() * 4) == 0;
    }
  };
  const auto run = [&](quantized::QuantizeRowsFn fn, bool offset, bool sums) {
    Out o;
    fn(x.data(), M, K, offset, o.q.data(), o.d.data(), sums ? o.sum.data() : nullptr);
    return o;
  };
  int ran = 0;
  for (const auto& [name, fn] : {std::pair{"avx2", gemm::isa_supported(Isa::avx2) ? quantized::avx2_quantize_rows() : nullptr},
                                 std::pair{"avx512", __builtin_cpu_supports("avx512vnni") && gemm::isa_supported(Isa::avx512)
                                                         ? quantized::avx512_quantize_rows()
                                                         : nullptr}}) {
    if (!fn) continue;
    ++ran;
    for (bool offset : {false, true})
      for (bool sums : {false, true})
        EXPECT_TRUE(run(fn, offset, sums) == run(quantized::portable_quantize_rows, offset, sums))
            << name << " offset " << offset << " sums " << sums;
  }
  if (ran == 0) GTEST_SKIP() << "this CPU has neither AVX2 nor AVX-512 VNNI: only the portable quantizer exists";
}

TEST(QMatmulBlocks, Avx2KernelsRanOnThisCpu) {
  if (!gemm::isa_supported(Isa::avx2)) GTEST_SKIP() << "this CPU has no AVX2: only the portable kernels were tested";
  SUCCEED() << "the tests above ran the AVX2 kernels (and the portable ones, forced)";
}

TEST(DequantizeBlocks, DecodesGatheredRowsOfAnyLeadingShape) {
  for (QuantizationEncoding e : kEncodings) {
    const int64_t K = 512, rb = graph::quantized_row_bytes(e, K);
    const HostTensor w = quantized_weights(e, 6, K, 9);
    HostTensor in = w;
    in.shape = {2, 3, rb};
    HostTensor y(DType::f32, {2, 3, K});
    ThreadedParallel two(2);
    run_kernel(Op::dequantize, attrs(e), {in.view()}, {y.view()}, &two);
    for (int64_t r = 0; r < 6; ++r) {
      const std::vector<float> want = decoded(e, w, r, K);
      for (int64_t k = 0; k < K; ++k) ASSERT_EQ(y.at<float>(r * K + k), want[static_cast<size_t>(k)]) << name(e) << " " << r;
    }
  }
}

// A fixed weight's panels packed at build on two threads (as a model's init does) give the launches
// the bits of panels packed on one: Q8_0, Q4_K and Q6_K, several panels, the last one partial, at a
// decode row, a few rows (Q4_K's panels as stored, AVX2's Q8_0 unpacked) and many (unpacked per call),
// on VNNI and on AVX2.
TEST(QMatmulBlocks, PanelsPackedOnSeveralThreadsGiveTheSameBits) {
  const bool vnni = __builtin_cpu_supports("avx512vnni") && gemm::isa_supported(Isa::avx512);
  if (!vnni && !gemm::isa_supported(Isa::avx2))
    GTEST_SKIP() << "this CPU has neither AVX512-VNNI nor AVX2: no panels are packed";
  std::vector<std::pair<Isa, QuantizationEncoding>> runs;
  if (vnni)
    for (QuantizationEncoding e : {QuantizationEncoding::q8_0, QuantizationEncoding::q4_k, QuantizationEncoding::q6_k})
      runs.emplace_back(Isa::avx512, e);
  if (gemm::isa_supported(Isa::avx2))
    for (QuantizationEncoding e : {QuantizationEncoding::q8_0, QuantizationEncoding::q4_k, QuantizationEncoding::q6_k})
      runs.emplace_back(Isa::avx2, e);
  const int64_t K = 512, N = 101;
  for (const auto& [isa, e] : runs) {
    ForcedIsa forced(isa);
    const HostTensor w = quantized_weights(e, N, K, 77);
    TensorView symbolic_lhs;
    symbolic_lhs.dtype = DType::f32;
    const bool fixed[] = {false, true};
    ThreadedParallel two(2);
    const auto serial = kernel_test::build_kernel(Op::qmatmul, attrs(e), {symbolic_lhs, w.view()}, {}, fixed);
    const auto threaded = kernel_test::build_kernel(Op::qmatmul, attrs(e), {symbolic_lhs, w.view()}, {}, fixed, &two);
    ASSERT_TRUE(qmatmul_packed_panels(*serial)) << name(e) << " " << gemm::isa_name(isa);
    for (int64_t M : {1, 3, 13, 40}) {
      const std::vector<float> x = random_floats(M * K, static_cast<uint32_t>(M));
      const HostTensor xt = kernel_test::tensor<float>({M, K}, x);
      HostTensor want(DType::f32, {M, N}), got(DType::f32, {M, N});
      kernel_test::run_built(*serial, {xt.view(), w.view()}, {want.view()});
      kernel_test::run_built(*threaded, {xt.view(), w.view()}, {got.view()});
      EXPECT_EQ(got.bytes, want.bytes) << name(e) << " " << gemm::isa_name(isa) << " M " << M;
      expect_close(e, x, w, got, M, K,
                   name(e) + " " + gemm::isa_name(isa) + " packed on two threads, M " + std::to_string(M));
    }
  }
}

// Q8_0's, Q4_K's and Q6_K's panels are one layout each: the AVX2 packer writes the AVX-512 one's bytes
// (N 101: a partial last panel), and the AVX2 panels' decode gives the VNNI one's bits (the same
// integer sums and f32 steps) on them; above (Q8_0: above 1 row) both run the same arithmetic on the
// block GEMM's (Q8_0: VNNI's GEMM tile's), the same bits too.
TEST(QMatmulBlocks, Avx2PanelsAreTheAvx512PanelsAndGiveTheirBits) {
  if (!__builtin_cpu_supports("avx512vnni") || !gemm::isa_supported(Isa::avx512))
    GTEST_SKIP() << "this CPU has no AVX512-VNNI: the AVX2 panels were not compared with its";
  for (const QuantizationEncoding e : {QuantizationEncoding::q8_0, QuantizationEncoding::q4_k, QuantizationEncoding::q6_k}) {
    SCOPED_TRACE(name(e));
    const bool q8_0 = e == QuantizationEncoding::q8_0;
    const int64_t K = q8_0 ? 1120 : 4352, N = 101;
    const HostTensor w = quantized_weights(e, N, K, 91);
    const int64_t bytes = (N + quantized::kGemmRows - 1) / quantized::kGemmRows * quantized::packed_panel_bytes(e, K);
    struct Aligned {
      void operator()(uint8_t* p) const { std::free(p); }
    };
    const auto panels = [&](quantized::Q8_0PackFn pack) {
      std::unique_ptr<uint8_t, Aligned> p(static_cast<uint8_t*>(std::aligned_alloc(64, static_cast<size_t>(bytes))));
      pack(w.bytes.data(), w.shape[1], N, K, p.get());
      return std::vector<uint8_t>(p.get(), p.get() + bytes);
    };
    EXPECT_EQ(panels(q8_0 ? quantized::avx2_q8_0_pack() : quantized::avx2_k_pack(e)),
              panels(q8_0 ? quantized::avx512_vnni_q8_0_pack() : quantized::avx512_vnni_k_pack(e)));
    TensorView symbolic_lhs;
    symbolic_lhs.dtype = DType::f32;
    const bool fixed[] = {false, true};
    for (int64_t M : {1, 3, 8, 13, 40}) {
      const std::vector<float> x = random_floats(M * K, static_cast<uint32_t>(M + 5));
      const HostTensor xt = kernel_test::tensor<float>({M, K}, x);
      HostTensor avx2(DType::f32, {M, N}), avx512(DType::f32, {M, N});
      {
        ForcedIsa forced(Isa::avx2);
        const auto kernel = kernel_test::build_kernel(Op::qmatmul, attrs(e), {symbolic_lhs, w.view()}, {}, fixed);
        kernel_test::run_built(*kernel, {xt.view(), w.view()}, {avx2.view()});
      }
      {
        ForcedIsa forced(Isa::avx512);
        const auto kernel = kernel_test::build_kernel(Op::qmatmul, attrs(e), {symbolic_lhs, w.view()}, {}, fixed);
        kernel_test::run_built(*kernel, {xt.view(), w.view()}, {avx512.view()});
      }
      EXPECT_EQ(avx2.bytes, avx512.bytes) << "M " << M;
    }
  }
}

TEST(QMatmulBlocks, BadShapesAreErrorsNamingTheEncoding) {
  HostTensor x(DType::f32, {2, 288}), w(DType::u8, {4, 162}), y(DType::f32, {2, 4});
  testing::expect_error<ValueError>(
      [&] { run_kernel(Op::qmatmul, attrs(QuantizationEncoding::q4_k), {x.view(), w.view()}, {y.view()}); },
      {"qmatmul: lhs inner dim", "q4_k", "multiple of 256", "288"});
  HostTensor x2(DType::f32, {2, 256}), w2(DType::u8, {4, 144});
  testing::expect_error<ShapeError>(
      [&] { run_kernel(Op::qmatmul, attrs(QuantizationEncoding::q6_k), {x2.view(), w2.view()}, {y.view()}); },
      {"210 bytes", "q6_k", "u8[4, 144]"});
}

}  // namespace
}  // namespace kiln::kernels
