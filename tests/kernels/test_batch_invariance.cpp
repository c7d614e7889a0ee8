// Batch invariance of the decode products (gemm::kSmallM): for M = 1..8 rows of f32 activations,
// matmul against f32 / f16 / bf16 weights (both rhs layouts), qmatmul against weights of every
// quantized encoding and grouped_matmul give each row bitwise the result that row gets alone (M = 1),
// whatever the other rows and M are, on every ISA level this CPU supports and on 1 or 2 threads: the continuous-batching
// engine gives a request the same tokens alone or in a batch of steps up to 8 rows (docs/batching.md;
// above 8 rows the blocked GEMM rounds in another order, except for f16 / bf16 weights, which stream
// in chunks of 8 rows up to 32). f32 / f16 / bf16 weights fixed at build, as a model's are, run on
// the SIMD GEMM's panels at every M: rows then match at every M. Q8_0 weights fixed at build run on
// their packed panels where VNNI is: rows then match at every M; the other
// encodings' block GEMM (above 8 rows, where VNNI is) likewise at every M above 8. The results alone are checked against a double-precision loop (the tolerance of test_gemm.cpp;
// for Q8_0 also the activations' quantization error, half a step d_x per element).
#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "kernels/cpu/gemm.h"
#include "kernels/cpu/gemm_amx.h"
#include "kernels/cpu/quantized.h"
#include "kernels/forced_isa.h"
#include "kernels/kernel_test_util.h"
#include "kernels/threaded_parallel.h"
#include "kiln/graph/quantization.h"

namespace kiln::kernels {
namespace {

using gemm::Isa;
using graph::Op;
using kernel_test::ForcedIsa;
using kernel_test::HostTensor;
using kernel_test::supported_isas;
using kernel_test::ThreadedParallel;

constexpr int64_t kRows = 8;  // gemm::kSmallM
const int64_t kMs[] = {1, 2, 3, 7, 8};

// K = 1120: several of the row groups' K slabs (512), a partial last vector of the f32 path (K % 16
// = 0 but 1120 % 32 = 0 with an odd block count, 35, for Q8_0's pairs); N = 70 and 40: blocks of
// weight rows that are not whole multiples of the register tiles. Also K = 300 (one slab, K % 16 = 12).
struct Shape {
  int64_t K, N;
};
const Shape kShapes[] = {{1120, 70}, {300, 40}};

std::string label(Isa isa, const std::string& what, int64_t M, int64_t K, int64_t N, int threads) {
  return std::string(gemm::isa_name(isa)) + " " + what + " M " + std::to_string(M) + " K " + std::to_string(K) +
         " N " + std::to_string(N) + " threads " + std::to_string(threads);
}

// The first M rows of x [kRows, K], or row m alone.
TensorView rows_of(const HostTensor& x, int64_t m0, int64_t M) {
  const int64_t K = x.shape[1];
  return TensorView{const_cast<uint8_t*>(x.bytes.data()) + m0 * K * 4, DType::f32, {M, K}, {K, 1}};
}

// One product: the op's result for `M` rows of x starting at m0, through its registered kernel.
struct Product {
  Op op;
  graph::Attrs attrs;
  std::vector<HostTensor> weights;  // one, or several for grouped_matmul
  std::vector<int64_t> widths;      // N of each result
  // The weights fixed at build and the lhs symbolic, as a model's step builds the kernel at init.
  bool fixed_weights = false;

  std::vector<HostTensor> run(const HostTensor& x, int64_t m0, int64_t M, Parallel* parallel) const {
    std::vector<TensorView> inputs{rows_of(x, m0, M)};
    for (const HostTensor& w : weights) inputs.push_back(w.view());
    std::vector<HostTensor> outs;
    for (int64_t n : widths) outs.emplace_back(DType::f32, std::vector<int64_t>{M, n});
    std::vector<TensorView> views;
    for (const HostTensor& o : outs) views.push_back(o.view());
    if (!fixed_weights) {
      kernel_test::run_kernel(op, attrs, inputs, views, parallel);
      return outs;
    }
    std::vector<TensorView> at_init = inputs;
    at_init[0] = TensorView{};
    at_init[0].dtype = DType::f32;
    const std::unique_ptr<bool[]> fixed(new bool[inputs.size()]);
    for (size_t i = 0; i < inputs.size(); ++i) fixed[i] = i > 0;  // the lhs alone is not
    const auto kernel = kernel_test::build_kernel(op, attrs, at_init, {}, std::span<const bool>(fixed.get(), inputs.size()));
    kernel_test::run_built(*kernel, inputs, views, parallel);
    return outs;
  }
};

// Every row of every M (of `Ms`, at most x's rows) is bitwise the row's result alone; the results
// alone match `reference` (per result i, row m, column n: value and tolerance).
template <class Reference>
void expect_batch_invariant(const Product& p, const HostTensor& x, const std::string& what, Isa isa, Reference&& reference,
                            std::span<const int64_t> Ms = kMs) {
  ThreadedParallel two(2);
  const int64_t K = x.shape[1], rows = x.shape[0];
  std::vector<std::vector<HostTensor>> alone;  // [row][result]
  for (int64_t m = 0; m < rows; ++m) alone.push_back(p.run(x, m, 1, nullptr));
  for (size_t i = 0; i < p.widths.size(); ++i)
    for (int64_t m = 0; m < rows; ++m)
      for (int64_t n = 0; n < p.widths[i]; ++n) {
        const auto [want, tolerance] = reference(i, m, n);
        ASSERT_NEAR(alone[static_cast<size_t>(m)][i].at<float>(n), want, tolerance)
            << label(isa, what, 1, K, p.widths[i], 1) << ": row " << m << " result " << i << " column " << n;
      }
  for (int64_t M : Ms)
    for (int threads : {1, 2}) {
      const std::vector<HostTensor> out = p.run(x, 0, M, threads == 2 ? &two : nullptr);
      for (size_t i = 0; i < p.widths.size(); ++i) {
        const int64_t N = p.widths[i];
        for (int64_t m = 0; m < M; ++m) {
          const auto* got = out[i].bytes.data() + m * N * 4;
          const auto& want = alone[static_cast<size_t>(m)][i].bytes;
          ASSERT_TRUE(std::equal(want.begin(), want.end(), got))
              << label(isa, what, M, K, N, threads) << ": row " << m << " of result " << i
              << " differs from that row alone";
        }
      }
    }
}

// bf16 weights whose products round the activations to bf16 above 8 rows: on AMX tiles, or on the
// avx512_bf16 level's dot GEMM (gemm::kBf16DotMinRows). Those are checked here at 8 rows or fewer,
// above 8 in test_gemm_amx.cpp.
bool rounds_above_eight(DType dtype, Isa isa) {
  return dtype == DType::bf16 && ((amx::available() && isa == gemm::best_isa()) || isa == Isa::avx512_bf16);
}

HostTensor activations(int64_t K, uint32_t seed) {
  return kernel_test::tensor_from_doubles(DType::f32, {kRows, K}, kernel_test::pseudo_random(kRows * K, seed));
}

// W as [N, K] (transpose_b) or [K, N], values exact in `dtype`; `w` gets them [N][K] in double.
HostTensor float_weight(DType dtype, int64_t N, int64_t K, bool transpose_b, uint32_t seed, std::vector<double>& w) {
  w = kernel_test::pseudo_random(N * K, seed);
  for (double& v : w) v = kernel_test::tensor_from_doubles(dtype, {1}, {v}).as_double(0);
  if (transpose_b) return kernel_test::tensor_from_doubles(dtype, {N, K}, w);
  std::vector<double> kn(static_cast<size_t>(N * K));
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k) kn[static_cast<size_t>(k * N + n)] = w[static_cast<size_t>(n * K + k)];
  return kernel_test::tensor_from_doubles(dtype, {K, N}, kn);
}

// sum_k x[m, k] w[n, k] in double, with test_gemm.cpp's f32 accumulation bound.
std::pair<double, double> float_reference(const HostTensor& x, const std::vector<double>& w, int64_t m, int64_t n) {
  const int64_t K = x.shape[1];
  double sum = 0, magnitude = 0;
  for (int64_t k = 0; k < K; ++k) {
    const double p = x.as_double(m * K + k) * w[static_cast<size_t>(n * K + k)];
    sum += p;
    magnitude += std::abs(p);
  }
  return {sum, static_cast<double>(K) * 0x1p-23 * magnitude + 0x1p-24 * std::abs(sum) + 1e-30};
}

TEST(BatchInvariance, MatmulRowsMatchTheRowAloneForEveryWeightDtype) {
  uint32_t seed = 10;
  for (Isa isa : supported_isas()) {
    ForcedIsa forced(isa);
    for (const Shape& s : kShapes) {
      const HostTensor x = activations(s.K, seed++);
      for (DType dtype : {DType::f32, DType::f16, DType::bf16})
        for (bool transpose_b : {true, false}) {
          std::vector<double> w;
          Product p{Op::matmul, {{"transpose_b", int64_t{transpose_b}}}, {}, {s.N}};
          p.weights.push_back(float_weight(dtype, s.N, s.K, transpose_b, seed++, w));
          const std::string what = std::string("f32 x ") + std::string(dtype_name(dtype)) + (transpose_b ? " transpose_b" : " plain");
          expect_batch_invariant(p, x, what, isa, [&](size_t, int64_t m, int64_t n) { return float_reference(x, w, m, n); });
        }
    }
  }
}

// f16 / bf16 weights that are not fixed at build stream as chunks of at most 8 rows up to
// gemm::kNarrowSmallMMax (32) rows, so every row of those steps too is bitwise the row alone, both
// layouts, single or grouped. Fixed ones (a model's) run on their panels at every M (the test after
// this one). N = 150 at K = 1120 spans two of the chunks' column blocks.
// bf16 above 8 rows on AMX or the bf16 dot GEMM rounds the activations (rounds_above_eight): checked
// there at 8 rows or fewer only.
TEST(BatchInvariance, NarrowWeightsGiveEveryRowItsBitsAloneUpTo32Rows) {
  static_assert(gemm::kNarrowSmallMMax == 32);
  const int64_t kMany = 32;
  const int64_t many_ms[] = {9, 17, 32};  // uneven chunks (5 + 4, 6 + 6 + 5) and the most
  uint32_t seed = 130;
  for (Isa isa : supported_isas()) {
    ForcedIsa forced(isa);
    for (const Shape& s : {Shape{1120, 150}, Shape{300, 40}}) {
      const HostTensor x =
          kernel_test::tensor_from_doubles(DType::f32, {kMany, s.K}, kernel_test::pseudo_random(kMany * s.K, seed++));
      for (DType dtype : {DType::f16, DType::bf16}) {
        const std::span<const int64_t> ms = rounds_above_eight(dtype, isa) ? std::span<const int64_t>(kMs) : many_ms;
        for (bool transpose_b : {true, false}) {
          std::vector<double> w;
          Product p{Op::matmul, {{"transpose_b", int64_t{transpose_b}}}, {}, {s.N}};
          p.weights.push_back(float_weight(dtype, s.N, s.K, transpose_b, seed++, w));
          const std::string what = "f32 x " + std::string(dtype_name(dtype)) + (transpose_b ? " transpose_b" : " plain");
          expect_batch_invariant(
              p, x, what, isa, [&](size_t, int64_t m, int64_t n) { return float_reference(x, w, m, n); }, ms);
        }
        // Grouped (q/k/v widths): each result's rows, at every M, the single product's row alone.
        const std::vector<int64_t> widths{s.N, 40, 40};
        std::vector<std::vector<double>> w(widths.size());
        Product group{Op::grouped_matmul, {{"transpose_b", int64_t{1}}}, {}, widths};
        for (size_t i = 0; i < widths.size(); ++i)
          group.weights.push_back(float_weight(dtype, widths[i], s.K, true, seed++, w[i]));
        expect_batch_invariant(
            group, x, "grouped f32 x " + std::string(dtype_name(dtype)), isa,
            [&](size_t i, int64_t m, int64_t n) { return float_reference(x, w[i], m, n); }, ms);
      }
    }
  }
}

// f32 / f16 / bf16 weights fixed at build (a model's) are packed into the SIMD GEMM's panels, and every
// M runs on them, decode's single row included (gemm.h): the GEMM sums each output in one order
// whatever the rows, so each row of every M from 1 to 40 (across 6-row tiles, the small-M split into
// panels of columns and the GEMM's row split) is bitwise that row alone, on 1 or 2 threads, both
// layouts, single or grouped, and within the double reference. Without SIMD kernels nothing is packed
// (the portable GEMV, checked above up to 8 rows); bf16 rounds above 8 rows where rounds_above_eight.
TEST(BatchInvariance, FixedFloatWeightsGiveEveryRowTheSameBitsAtEveryM) {
  const int64_t kMany = 40;
  const int64_t ms[] = {1, 2, 3, 7, 8, 9, 13, 32, 33, 40};
  uint32_t seed = 150;
  for (Isa isa : supported_isas()) {
    if (isa == Isa::generic) continue;
    ForcedIsa forced(isa);
    const int64_t K = 1120, N = 150;
    const HostTensor x = kernel_test::tensor_from_doubles(DType::f32, {kMany, K}, kernel_test::pseudo_random(kMany * K, seed++));
    for (DType dtype : {DType::f32, DType::f16, DType::bf16}) {
      const std::span<const int64_t> m_list = rounds_above_eight(dtype, isa) ? std::span<const int64_t>(kMs) : std::span<const int64_t>(ms);
      for (bool transpose_b : {true, false}) {
        std::vector<double> w;
        Product p{Op::matmul, {{"transpose_b", int64_t{transpose_b}}}, {}, {N}, /*fixed_weights=*/true};
        p.weights.push_back(float_weight(dtype, N, K, transpose_b, seed++, w));
        const std::string what = "fixed f32 x " + std::string(dtype_name(dtype)) + (transpose_b ? " transpose_b" : " plain");
        expect_batch_invariant(
            p, x, what, isa, [&](size_t, int64_t m, int64_t n) { return float_reference(x, w, m, n); }, m_list);
      }
      const std::vector<int64_t> widths{N, 40, 70};
      std::vector<std::vector<double>> w(widths.size());
      Product group{Op::grouped_matmul, {{"transpose_b", int64_t{1}}}, {}, widths, /*fixed_weights=*/true};
      for (size_t i = 0; i < widths.size(); ++i) group.weights.push_back(float_weight(dtype, widths[i], K, true, seed++, w[i]));
      expect_batch_invariant(
          group, x, "grouped fixed f32 x " + std::string(dtype_name(dtype)), isa,
          [&](size_t i, int64_t m, int64_t n) { return float_reference(x, w[i], m, n); }, m_list);
    }
  }
}

// Quantized weights [N, row bytes] from random values; `w` gets the decoded weights [N][K].
HostTensor quantized_weight(graph::QuantizationEncoding e, int64_t N, int64_t K, uint32_t seed, std::vector<double>& w) {
  const std::vector<double> values = kernel_test::pseudo_random(N * K, seed);
  std::vector<float> f(values.begin(), values.end()), row(static_cast<size_t>(K));
  const int64_t row_bytes = graph::quantized_row_bytes(e, K);
  HostTensor t(DType::u8, {N, row_bytes});
  w.clear();
  for (int64_t n = 0; n < N; ++n) {
    uint8_t* dst = t.bytes.data() + n * row_bytes;
    graph::quantize_row(e, f.data() + n * K, K, dst);
    graph::dequantize_row(e, dst, K, row.data());
    w.insert(w.end(), row.begin(), row.end());
  }
  return t;
}
HostTensor q8_weight(int64_t N, int64_t K, uint32_t seed, std::vector<double>& w) {
  return quantized_weight(graph::QuantizationEncoding::q8_0, N, K, seed, w);
}

// The float reference, plus the activations' quantization: each x off by at most d_x / 2, d_x =
// max |x| / 127 over its block of 32 (256 for the K-quants: quantized::activation_block).
std::pair<double, double> q8_reference(const HostTensor& x, const std::vector<double>& w, int64_t m, int64_t n,
                                       int64_t block = 32) {
  auto [sum, tolerance] = float_reference(x, w, m, n);
  const int64_t K = x.shape[1];
  for (int64_t b = 0; b < K / block; ++b) {
    double amax = 0, wsum = 0;
    for (int64_t k = b * block; k < b * block + block; ++k) {
      amax = std::max(amax, std::abs(x.as_double(m * K + k)));
      wsum += std::abs(w[static_cast<size_t>(n * K + k)]);
    }
    tolerance += amax / 127 * 0.5 * 1.0001 * wsum;
  }
  return {sum, tolerance};
}

TEST(BatchInvariance, QmatmulRowsMatchTheRowAloneForEveryEncoding) {
  uint32_t seed = 40;
  for (Isa isa : supported_isas()) {
    ForcedIsa forced(isa);
    for (graph::QuantizationEncoding e : graph::kAllEncodings) {
      // K-quants: whole super-blocks of 256 (1280: 5 of them); the others also an odd block count.
      const bool k_quant = graph::block_size(e) == graph::kKQuantBlockSize;
      for (const Shape& s : k_quant ? std::vector<Shape>{{1280, 70}, {256, 45}} : std::vector<Shape>{{1120, 70}, {288, 45}}) {
        const HostTensor x = activations(s.K, seed++);
        std::vector<double> w;
        Product p{Op::qmatmul, {{"encoding", std::string(graph::encoding_name(e))}}, {}, {s.N}};
        p.weights.push_back(quantized_weight(e, s.N, s.K, seed++, w));
        expect_batch_invariant(p, x, "f32 x " + std::string(graph::encoding_name(e)), isa,
                               [&](size_t, int64_t m, int64_t n) {
                                 return q8_reference(x, w, m, n, quantized::activation_block(e));
                               });
      }
    }
  }
}

// A group of `widths` weights of encoding e [width, K] from `seed`, as grouped_matmul (the first
// product) and as qmatmul of each (the others); `w` gets each one's decoded values. Fixed at build
// as a model's weights are, or not.
std::vector<Product> grouped_and_alone(graph::QuantizationEncoding e, const std::vector<int64_t>& widths, int64_t K,
                                       uint32_t seed, bool fixed, std::vector<std::vector<double>>& w) {
  w.assign(widths.size(), {});
  Product group{Op::grouped_matmul, {{"encoding", std::string(graph::encoding_name(e))}}, {}, widths, fixed};
  for (size_t i = 0; i < widths.size(); ++i) group.weights.push_back(quantized_weight(e, widths[i], K, seed++, w[i]));
  std::vector<Product> products{group};
  for (size_t i = 0; i < widths.size(); ++i)
    products.push_back(Product{Op::qmatmul, group.attrs, {group.weights[i]}, {widths[i]}, fixed});
  return products;
}

// Each product (grouped_and_alone's) at M = x's rows is within q8_reference's tolerance (activation
// blocks of `block`), and at every M of `Ms` on 1 or 2 threads each row has bitwise its bits there.
void expect_rows_the_same_at_every_m(const std::vector<Product>& products, const std::vector<std::vector<double>>& w,
                                     const HostTensor& x, std::span<const int64_t> Ms, int64_t block,
                                     const std::string& what) {
  ThreadedParallel two(2);
  const int64_t many = x.shape[0], K = x.shape[1];
  for (size_t p = 0; p < products.size(); ++p) {
    const Product& product = products[p];
    const std::string name = (p == 0 ? "grouped " : "") + what;
    const std::vector<HostTensor> all = product.run(x, 0, many, nullptr);
    for (size_t i = 0; i < product.widths.size(); ++i) {
      const size_t weight = p == 0 ? i : p - 1;
      for (int64_t m = 0; m < many; ++m)
        for (int64_t n = 0; n < product.widths[i]; ++n) {
          const auto [want, tolerance] = q8_reference(x, w[weight], m, n, block);
          ASSERT_NEAR(all[i].at<float>(m * product.widths[i] + n), want, tolerance)
              << name << ": row " << m << " result " << i << " column " << n;
        }
    }
    for (int64_t M : Ms)
      for (int threads : {1, 2}) {
        const std::vector<HostTensor> out = product.run(x, 0, M, threads == 2 ? &two : nullptr);
        for (size_t i = 0; i < product.widths.size(); ++i) {
          const auto& want = all[i].bytes;
          ASSERT_TRUE(std::equal(out[i].bytes.begin(), out[i].bytes.end(), want.begin()))
              << label(Isa::avx512, name, M, K, product.widths[i], threads) << ": result " << i
              << " differs from its rows at M = " << many;
        }
      }
  }
}

// A model's Q8_0 weights (fixed at build) run on their packed panels at every step, one-row decode
// included: VNNI's GEMM, or without VNNI (AVX2) the panels' one-row kernel and above one row the
// block GEMM on each panel unpacked. Their rows never depend on the batch: each row of every M from 1
// to 20 (across tiles and kGemmRows panels) is bitwise that row at M = 20, and within the reference's
// tolerance; grouped too. On AVX2 the rows above 8 are bitwise what the block GEMM gives from the
// file's rows (the same arithmetic), so one-row decode is too.
TEST(BatchInvariance, FixedQ8_0WeightsGiveEveryRowTheSameBitsAtEveryM) {
  const bool vnni = __builtin_cpu_supports("avx512vnni") && gemm::isa_supported(Isa::avx512);
  if (!vnni && !gemm::isa_supported(Isa::avx2))
    GTEST_SKIP() << "this CPU has neither AVX512-VNNI nor AVX2: no packed Q8_0 panels to check";
  std::vector<Isa> isas;
  if (vnni) isas.push_back(Isa::avx512);
  if (gemm::isa_supported(Isa::avx2)) isas.push_back(Isa::avx2);
  for (const Isa isa : isas) {
    ForcedIsa forced(isa);
    const std::string what = std::string("fixed f32 x q8_0 ") + gemm::isa_name(isa);
    const int64_t K = 1120;
    const HostTensor x = kernel_test::tensor_from_doubles(DType::f32, {20, K}, kernel_test::pseudo_random(20 * K, 110));
    std::vector<std::vector<double>> w;
    const std::vector<Product> products =
        grouped_and_alone(graph::QuantizationEncoding::q8_0, {70, 40, 33}, K, 111, /*fixed=*/true, w);
    const int64_t Ms[] = {1, 2, 3, 5, 6, 7, 8, 9, 12, 13, 19};
    expect_rows_the_same_at_every_m(products, w, x, Ms, 32, what);
    if (isa != Isa::avx2) continue;
    ThreadedParallel two(2);
    for (const Product& p : products) {
      Product from_rows = p;
      from_rows.fixed_weights = false;
      const std::vector<HostTensor> want = from_rows.run(x, 0, 20, nullptr), got = p.run(x, 0, 20, &two);
      for (size_t i = 0; i < want.size(); ++i)
        ASSERT_EQ(got[i].bytes, want[i].bytes) << what << " result " << i << " of " << p.widths.size();
    }
  }
}

// Q4_0 and the K-quants on VNNI CPUs: steps of more than 8 rows run the block GEMM (quantized.h),
// whose rows never depend on the batch either: each row of every M from 9 to 40 (6-row tiles,
// kGemmRows panels, passes of 16 chunks over K) is bitwise that row at M = 40, within the
// reference's tolerance; grouped too (its parts then run one after another).
TEST(BatchInvariance, BlockGemmGivesEveryRowTheSameBitsAtEveryMAboveEight) {
  if (!__builtin_cpu_supports("avx512vnni") || !gemm::isa_supported(Isa::avx512))
    GTEST_SKIP() << "this CPU has no AVX512-VNNI: no block GEMM to check";
  ForcedIsa forced(Isa::avx512);
  uint32_t seed = 130;
  for (graph::QuantizationEncoding e : graph::kAllEncodings) {
    if (e == graph::QuantizationEncoding::q8_0) continue;
    const int64_t K = graph::block_size(e) == graph::kKQuantBlockSize ? 4352 : 1120;  // 17 super-blocks; 35 blocks
    const HostTensor x = kernel_test::tensor_from_doubles(DType::f32, {40, K}, kernel_test::pseudo_random(40 * K, seed++));
    std::vector<std::vector<double>> w;
    const std::vector<Product> products = grouped_and_alone(e, {70, 40, 9}, K, seed, /*fixed=*/true, w);
    seed += 3;
    const int64_t Ms[] = {9, 12, 13, 20, 39};
    expect_rows_the_same_at_every_m(products, w, x, Ms, quantized::activation_block(e),
                                    "fixed f32 x " + std::string(graph::encoding_name(e)));
  }
}

// A model's Q4_K and Q6_K weights (fixed at build) on VNNI CPUs run on their nibble panels at every
// M (quantized.h): up to 8 rows the panels' GEMV, whose rows never depend on the batch (each row of
// every M from 1 to 8 bitwise that row at M = 8, within the reference's tolerance, grouped too, and
// within a few roundings of the row GEMV on the file's rows); above 8 rows the block GEMM's
// arithmetic (Q4_K up to 32 rows on the panels as stored, else on the panels unpacked), which gives
// bitwise what it gives from the file's rows.
// Without VNNI (AVX2), Q4_K's and Q6_K's panels run the same way (their own kernels, the same contract).
TEST(BatchInvariance, FixedKQuantWeightsRunTheirPanelsAtEveryM) {
  const bool vnni = __builtin_cpu_supports("avx512vnni") && gemm::isa_supported(Isa::avx512);
  if (!vnni && !gemm::isa_supported(Isa::avx2))
    GTEST_SKIP() << "this CPU has neither AVX512-VNNI nor AVX2: no K-quant panels to check";
  uint32_t seed = 160;
  std::vector<std::pair<Isa, graph::QuantizationEncoding>> runs;
  if (vnni) runs = {{Isa::avx512, graph::QuantizationEncoding::q4_k}, {Isa::avx512, graph::QuantizationEncoding::q6_k}};
  if (gemm::isa_supported(Isa::avx2))
    for (auto e : {graph::QuantizationEncoding::q4_k, graph::QuantizationEncoding::q6_k}) runs.emplace_back(Isa::avx2, e);
  for (const auto& [isa, e] : runs) {
    ForcedIsa forced(isa);
    const std::string what = "fixed f32 x " + std::string(graph::encoding_name(e)) + " " + gemm::isa_name(isa);
    const int64_t K = 4352;  // 17 super-blocks
    const HostTensor x = kernel_test::tensor_from_doubles(DType::f32, {8, K}, kernel_test::pseudo_random(8 * K, seed++));
    std::vector<std::vector<double>> w;
    const std::vector<Product> products = grouped_and_alone(e, {70, 40, 33}, K, seed, /*fixed=*/true, w);
    seed += 3;
    const int64_t Ms[] = {1, 2, 3, 5, 7};
    expect_rows_the_same_at_every_m(products, w, x, Ms, quantized::activation_block(e), what);
    // The same integer sums as the row GEMV's (the file's rows), scaled and added in another f32
    // order: within a few f32 roundings of the largest result (the reference's tolerance is wider).
    for (const Product& p : products) {
      Product from_rows = p;
      from_rows.fixed_weights = false;
      const std::vector<HostTensor> want = from_rows.run(x, 0, 8, nullptr), got = p.run(x, 0, 8, nullptr);
      for (size_t i = 0; i < want.size(); ++i) {
        double largest = 0;
        for (int64_t j = 0; j < want[i].numel(); ++j) largest = std::max(largest, std::abs(want[i].as_double(j)));
        for (int64_t j = 0; j < want[i].numel(); ++j)
          ASSERT_NEAR(got[i].as_double(j), want[i].as_double(j), 1e-5 * largest) << what << " result " << i << " element " << j;
      }
    }
    const HostTensor many = kernel_test::tensor_from_doubles(DType::f32, {40, K}, kernel_test::pseudo_random(40 * K, seed++));
    ThreadedParallel two(2);
    for (int64_t M : {9, 13, 32, 33, 40})
      for (const Product& p : products) {
        Product from_rows = p;
        from_rows.fixed_weights = false;
        const std::vector<HostTensor> want = from_rows.run(many, 0, M, nullptr), got = p.run(many, 0, M, &two);
        for (size_t i = 0; i < want.size(); ++i)
          ASSERT_EQ(got[i].bytes, want[i].bytes) << what << " M " << M << " result " << i << " of " << p.widths.size();
      }
  }
}

// grouped_matmul's one-job path (q/k/v-like widths): each result row bitwise that row alone, and
// alone the matmul / qmatmul result of its rhs.
TEST(BatchInvariance, GroupedMatmulRowsMatchTheRowAlone) {
  uint32_t seed = 70;
  const int64_t K = 1120;
  const std::vector<int64_t> widths{70, 40, 40};
  for (Isa isa : supported_isas()) {
    ForcedIsa forced(isa);
    const HostTensor x = activations(K, seed++);
    for (DType dtype : {DType::f32, DType::f16, DType::bf16, DType::u8}) {
      const bool q8 = dtype == DType::u8;
      std::vector<std::vector<double>> w(widths.size());
      Product group{Op::grouped_matmul, {}, {}, widths};
      if (q8)
        group.attrs = {{"encoding", std::string("q8_0")}};
      else
        group.attrs = {{"transpose_b", int64_t{1}}};
      for (size_t i = 0; i < widths.size(); ++i)
        group.weights.push_back(q8 ? q8_weight(widths[i], K, seed++, w[i])
                                   : float_weight(dtype, widths[i], K, true, seed++, w[i]));
      const std::string what = "grouped f32 x " + std::string(q8 ? "q8_0" : dtype_name(dtype));
      // Alone: the single product's bits.
      std::vector<std::vector<HostTensor>> single(widths.size());
      for (size_t i = 0; i < widths.size(); ++i) {
        const Product one{q8 ? Op::qmatmul : Op::matmul, group.attrs, {group.weights[i]}, {widths[i]}};
        for (int64_t m = 0; m < kRows; ++m) single[i].push_back(one.run(x, m, 1, nullptr)[0]);
      }
      expect_batch_invariant(group, x, what, isa, [&](size_t i, int64_t m, int64_t n) {
        return std::pair<double, double>{single[i][static_cast<size_t>(m)].at<float>(n), 0.0};
      });
    }
  }
}

// The same for grouped qmatmuls of every encoding (K = 1280: whole super-blocks).
TEST(BatchInvariance, GroupedQmatmulRowsMatchTheRowAloneForEveryEncoding) {
  uint32_t seed = 90;
  const int64_t K = 1280;
  const std::vector<int64_t> widths{70, 40, 40};
  for (Isa isa : supported_isas()) {
    ForcedIsa forced(isa);
    const HostTensor x = activations(K, seed++);
    for (graph::QuantizationEncoding e : graph::kAllEncodings) {
      std::vector<std::vector<double>> w(widths.size());
      Product group{Op::grouped_matmul, {{"encoding", std::string(graph::encoding_name(e))}}, {}, widths};
      for (size_t i = 0; i < widths.size(); ++i) group.weights.push_back(quantized_weight(e, widths[i], K, seed++, w[i]));
      std::vector<std::vector<HostTensor>> single(widths.size());
      for (size_t i = 0; i < widths.size(); ++i) {
        const Product one{Op::qmatmul, group.attrs, {group.weights[i]}, {widths[i]}};
        for (int64_t m = 0; m < kRows; ++m) single[i].push_back(one.run(x, m, 1, nullptr)[0]);
      }
      expect_batch_invariant(group, x, "grouped f32 x " + std::string(graph::encoding_name(e)), isa,
                             [&](size_t i, int64_t m, int64_t n) {
                               return std::pair<double, double>{single[i][static_cast<size_t>(m)].at<float>(n), 0.0};
                             });
    }
  }
}

}  // namespace
}  // namespace kiln::kernels
