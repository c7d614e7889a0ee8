// The grouped_matmul kernel (sibling products of one lhs) against the matmul and qmatmul kernels run
// once per rhs: each result must have the same bits, on every ISA level this CPU supports, for decode
// (M <= 8, one parallel job over all weights) and prefill row counts (one product per rhs with its
// prepared state), prepared or not, on 1 and 2 threads. A naive double loop written here checks that
// the matmul they are both compared with is a product at all. Bad operands name the rhs index.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "../test_util.h"
#include "kernels/cpu/gemm.h"
#include "kernels/cpu/matmul.h"
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
using kernel_test::pseudo_random;
using kernel_test::supported_isas;
using kernel_test::tensor_from_doubles;
using kernel_test::ThreadedParallel;
using kiln::testing::expect_error;

// Counts for_range calls (parallel jobs) and runs them on an inner Parallel.
class CountingParallel final : public Parallel {
 public:
  explicit CountingParallel(Parallel& inner) : inner_(inner) {}
  void for_range(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn) override {
    ++jobs;
    inner_.for_range(n, grain, fn);
  }
  int num_threads() const override { return inner_.num_threads(); }
  int jobs = 0;

 private:
  Parallel& inner_;
};

// Builds `op`'s registered CPU kernel (none of its operands fixed) and runs it with an explicit context.
void launch(Op op, const KernelContext& ctx, const graph::Attrs& attrs, const std::vector<TensorView>& inputs,
            const std::vector<TensorView>& outputs) {
  kernel_test::build_kernel(op, attrs, inputs, outputs)->run(ctx, inputs, outputs);
}

// The grouped op's kernel as the executor builds it at init: the weights fixed, the lhs known by
// its static shape only.
std::unique_ptr<const Kernel> build_group(const graph::Attrs& attrs, const TensorView& lhs,
                                          const std::vector<HostTensor>& weights) {
  TensorView lhs_at_init = lhs;
  lhs_at_init.data = nullptr;
  std::vector<TensorView> inputs{lhs_at_init};
  auto fixed = std::make_unique<bool[]>(weights.size() + 1);
  fixed[0] = false;
  for (size_t i = 0; i < weights.size(); ++i) {
    inputs.push_back(weights[i].view());
    fixed[i + 1] = true;
  }
  return kernel_test::build_kernel(Op::grouped_matmul, attrs, inputs, {},
                                   std::span<const bool>(fixed.get(), weights.size() + 1));
}

// The single op's kernel for one weight, prepared as build_group prepares each part.
std::unique_ptr<const Kernel> build_single(Op op, const graph::Attrs& attrs, const TensorView& lhs,
                                           const HostTensor& weight) {
  TensorView lhs_at_init = lhs;
  lhs_at_init.data = nullptr;
  const bool fixed[2] = {false, true};
  return kernel_test::build_kernel(op, attrs, {lhs_at_init, weight.view()}, {}, fixed);
}

// lhs [rows, K] (as `lhs_shape`) times each weight: the grouped results, then matmul's (qmatmul's)
// own, each prepared as the group was (`prepared`: the weights fixed at build) with the same threads.
struct Results {
  std::vector<HostTensor> grouped, single;
};
Results run_both(const graph::Attrs& attrs, const TensorView& lhs, const std::vector<HostTensor>& weights,
                 const std::vector<std::vector<int64_t>>& out_shapes, DType out_dtype, int threads, bool prepared) {
  const Op single = attrs.count("encoding") ? Op::qmatmul : Op::matmul;
  ThreadedParallel pool(threads);
  Results r;
  std::vector<TensorView> inputs{lhs}, outputs;
  for (size_t i = 0; i < weights.size(); ++i) {
    inputs.push_back(weights[i].view());
    r.grouped.emplace_back(out_dtype, out_shapes[i]);
    r.single.emplace_back(out_dtype, out_shapes[i]);
    outputs.push_back(r.grouped.back().view());
  }
  const auto kernel = prepared ? build_group(attrs, lhs, weights)
                               : kernel_test::build_kernel(Op::grouped_matmul, attrs, inputs, outputs);
  // f32 weights are packed into GEMM panels for a prefill-sized lhs wherever a SIMD level runs.
  if (prepared && lhs.dtype == DType::f32 && weights[0].dtype == DType::f32 && gemm::active_isa() != Isa::generic) {
    for (size_t i = 0; i < weights.size(); ++i)
      EXPECT_EQ(matmul_packing(*grouped_matmul_part(*kernel, i)) == MatmulPacking::f32_panels,
                lhs.numel() / lhs.shape.back() > gemm::kSmallM)
          << "prepared state of rhs " << i;
  }
  kernel->run(KernelContext{&pool}, inputs, outputs);
  for (size_t i = 0; i < weights.size(); ++i) {
    const std::vector<TensorView> operands{lhs, weights[i].view()}, result{r.single[i].view()};
    if (prepared)
      build_single(single, attrs, lhs, weights[i])->run(KernelContext{&pool}, operands, result);
    else
      launch(single, KernelContext{&pool}, attrs, operands, result);
  }
  return r;
}

// q/k/v-like widths: a wide first product and two narrow ones, none a multiple of 16 but the first.
const std::vector<int64_t> kWidths{96, 20, 37};

TEST(GroupedMatmulKernel, EachResultEqualsItsOwnMatmulBitForBit) {
  struct DTypes {
    DType lhs, rhs;
  };
  const int64_t K = 72;
  for (Isa isa : supported_isas()) {
    ForcedIsa forced(isa);
    for (DTypes dt : {DTypes{DType::f32, DType::f32}, DTypes{DType::f32, DType::bf16}, DTypes{DType::f32, DType::f16},
                      DTypes{DType::bf16, DType::bf16}, DTypes{DType::f64, DType::f64}})
      for (int64_t transpose_b : {0, 1}) {
        std::vector<HostTensor> weights;
        for (size_t i = 0; i < kWidths.size(); ++i) {
          const std::vector<int64_t> shape = transpose_b ? std::vector<int64_t>{kWidths[i], K} : std::vector<int64_t>{K, kWidths[i]};
          weights.push_back(tensor_from_doubles(dt.rhs, shape, pseudo_random(K * kWidths[i], 7 + static_cast<uint32_t>(i))));
        }
        const graph::Attrs attrs{{"transpose_b", transpose_b}};
        for (int64_t M : {1, 3, 8, 9, 40}) {
          const HostTensor x = tensor_from_doubles(dt.lhs, {1, M, K}, pseudo_random(M * K, 3));
          std::vector<std::vector<int64_t>> shapes;
          for (int64_t n : kWidths) shapes.push_back({1, M, n});
          for (int threads : {1, 2})
            for (bool prepared : {false, true}) {
              SCOPED_TRACE(std::string(gemm::isa_name(isa)) + " " + std::string(dtype_name(dt.lhs)) + " x " +
                           std::string(dtype_name(dt.rhs)) + " transpose_b " + std::to_string(transpose_b) + " M " +
                           std::to_string(M) + " threads " + std::to_string(threads) + (prepared ? " prepared" : ""));
              const Results r = run_both(attrs, x.view(), weights, shapes, dt.lhs, threads, prepared);
              for (size_t i = 0; i < weights.size(); ++i) EXPECT_EQ(r.grouped[i].bytes, r.single[i].bytes) << "result " << i;
            }
        }
      }
  }
}

// What the bit-for-bit comparisons stand on: matmul, and so each grouped result, is the product.
TEST(GroupedMatmulKernel, ResultsAreTheProductsOfTheirOwnWeight) {
  const int64_t K = 40, M = 2;
  const std::vector<double> xs = pseudo_random(M * K, 5);
  const HostTensor x = tensor_from_doubles(DType::f32, {M, K}, xs);
  std::vector<HostTensor> weights;
  std::vector<std::vector<double>> ws;
  for (size_t i = 0; i < kWidths.size(); ++i) {
    ws.push_back(pseudo_random(kWidths[i] * K, 11 + static_cast<uint32_t>(i)));
    weights.push_back(tensor_from_doubles(DType::f32, {kWidths[i], K}, ws.back()));  // [N, K], transpose_b
  }
  const Results r = run_both({{"transpose_b", int64_t{1}}}, x.view(), weights,
                             {{M, kWidths[0]}, {M, kWidths[1]}, {M, kWidths[2]}}, DType::f32, 2, false);
  for (size_t i = 0; i < weights.size(); ++i)
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < kWidths[i]; ++n) {
        double want = 0;
        for (int64_t k = 0; k < K; ++k)
          want += static_cast<double>(static_cast<float>(xs[m * K + k])) * static_cast<float>(ws[i][n * K + k]);
        EXPECT_NEAR(r.grouped[i].at<float>(m * kWidths[i] + n), want, 1e-5) << "result " << i << " [" << m << ", " << n << "]";
      }
}

HostTensor q8_0_weights(int64_t n, int64_t k, uint32_t seed) {
  const std::vector<double> w = pseudo_random(n * k, seed);
  HostTensor t(DType::u8, {n, graph::q8_0_row_bytes(k)});
  std::vector<float> row(static_cast<size_t>(k));
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t j = 0; j < k; ++j) row[static_cast<size_t>(j)] = static_cast<float>(w[r * k + j]);
    graph::quantize_q8_0(row.data(), k, t.bytes.data() + r * graph::q8_0_row_bytes(k));
  }
  return t;
}

TEST(GroupedMatmulKernel, Q8_0ResultsEqualEachQMatmulBitForBit) {
  const int64_t K = 96;
  const graph::Attrs attrs{{"encoding", std::string("q8_0")}};
  std::vector<HostTensor> weights;
  for (size_t i = 0; i < kWidths.size(); ++i) weights.push_back(q8_0_weights(kWidths[i], K, 21 + static_cast<uint32_t>(i)));
  for (Isa isa : supported_isas()) {
    ForcedIsa forced(isa);
    for (int64_t M : {1, 3, 8, 9, 40}) {
      const HostTensor x = tensor_from_doubles(DType::f32, {M, K}, pseudo_random(M * K, 4));
      std::vector<std::vector<int64_t>> shapes;
      for (int64_t n : kWidths) shapes.push_back({M, n});
      for (int threads : {1, 2})
        for (bool prepared : {false, true}) {
          SCOPED_TRACE(std::string(gemm::isa_name(isa)) + " M " + std::to_string(M) + " threads " +
                       std::to_string(threads) + (prepared ? " prepared" : ""));
          const Results r = run_both(attrs, x.view(), weights, shapes, DType::f32, threads, prepared);
          for (size_t i = 0; i < weights.size(); ++i) EXPECT_EQ(r.grouped[i].bytes, r.single[i].bytes) << "result " << i;
        }
    }
  }
}

// A lhs whose batches are not rows of one matrix (a permuted view), or a strided one: still each
// matmul's bits.
TEST(GroupedMatmulKernel, StridedAndUnfoldableLhsGiveEachMatmulsBits) {
  const int64_t K = 32;
  const HostTensor base = tensor_from_doubles(DType::f32, {2, 3, K}, pseudo_random(2 * 3 * K, 9));
  std::vector<HostTensor> weights;
  for (size_t i = 0; i < 2; ++i) weights.push_back(tensor_from_doubles(DType::f32, {kWidths[i], K}, pseudo_random(kWidths[i] * K, 30 + static_cast<uint32_t>(i))));
  const graph::Attrs attrs{{"transpose_b", int64_t{1}}};
  const TensorView permuted = kernel_test::permuted(base.view(), {1, 0, 2});  // [3, 2, K]
  const Results r = run_both(attrs, permuted, weights, {{3, 2, kWidths[0]}, {3, 2, kWidths[1]}}, DType::f32, 2, false);
  for (size_t i = 0; i < weights.size(); ++i) EXPECT_EQ(r.grouped[i].bytes, r.single[i].bytes) << "result " << i;
  const HostTensor q = q8_0_weights(16, K, 40), q2 = q8_0_weights(48, K, 41);
  const Results rq = run_both({{"encoding", std::string("q8_0")}}, permuted, {q, q2}, {{3, 2, 16}, {3, 2, 48}},
                              DType::f32, 2, false);
  for (size_t i = 0; i < 2; ++i) EXPECT_EQ(rq.grouped[i].bytes, rq.single[i].bytes) << "q8_0 result " << i;
}

// Decode: all the weights' rows in one parallel job, where separate launches take one each. The
// widths are cut into parts that span two weights, and still give each launch's bits.
TEST(GroupedMatmulKernel, DecodeRunsAllWeightsAsOneParallelJob) {
  const int64_t K = 512;
  const HostTensor x = tensor_from_doubles(DType::f32, {1, K}, pseudo_random(K, 2));
  std::vector<HostTensor> f32_weights, q_weights;
  if (gemm::active_isa() == Isa::generic) GTEST_SKIP() << "no SIMD GEMV here: f32 groups run matmul per rhs";
  for (int64_t n : {500, 260, 250}) {  // each big enough for matmul alone to use both threads
    f32_weights.push_back(tensor_from_doubles(DType::f32, {n, K}, pseudo_random(n * K, static_cast<uint32_t>(n))));
    q_weights.push_back(q8_0_weights(n, K, static_cast<uint32_t>(n)));
  }
  for (const auto& [attrs, weights] :
       {std::pair{graph::Attrs{{"transpose_b", int64_t{1}}}, f32_weights},
        std::pair{graph::Attrs{{"encoding", std::string("q8_0")}}, q_weights}}) {
    ThreadedParallel pool(2);
    CountingParallel grouped_jobs(pool), single_jobs(pool);
    std::vector<HostTensor> outs, single_outs;
    std::vector<TensorView> inputs{x.view()}, outputs;
    for (const HostTensor& w : weights) {
      inputs.push_back(w.view());
      outs.emplace_back(DType::f32, std::vector<int64_t>{1, w.shape[0]});
      single_outs.emplace_back(DType::f32, std::vector<int64_t>{1, w.shape[0]});
    }
    for (const HostTensor& o : outs) outputs.push_back(o.view());
    launch(Op::grouped_matmul, KernelContext{&grouped_jobs}, attrs, inputs, outputs);
    const Op single = attrs.count("encoding") ? Op::qmatmul : Op::matmul;
    for (size_t i = 0; i < weights.size(); ++i)
      launch(single, KernelContext{&single_jobs}, attrs, {x.view(), weights[i].view()}, {single_outs[i].view()});
    EXPECT_EQ(grouped_jobs.jobs, 1) << graph::op_name(single);
    EXPECT_EQ(single_jobs.jobs, 3) << graph::op_name(single);
    for (size_t i = 0; i < weights.size(); ++i)
      EXPECT_EQ(outs[i].bytes, single_outs[i].bytes) << graph::op_name(single) << " result " << i;
  }
}

TEST(GroupedMatmulKernel, BadOperandsNameTheRhsIndex) {
  const int64_t K = 32;
  const HostTensor x = tensor_from_doubles(DType::f32, {1, K}, pseudo_random(K, 1));
  const HostTensor good = tensor_from_doubles(DType::f32, {K, 8}, pseudo_random(K * 8, 2));
  const HostTensor short_k = tensor_from_doubles(DType::f32, {K - 1, 8}, pseudo_random((K - 1) * 8, 3));
  const HostTensor f64 = tensor_from_doubles(DType::f64, {K, 8}, pseudo_random(K * 8, 4));
  HostTensor o0(DType::f32, {1, 8}), o1(DType::f32, {1, 8}), o2(DType::f32, {1, 8});
  SerialParallel serial;
  const KernelContext ctx{&serial};
  for (int64_t M : {1, 9}) {  // the decode path hands a bad rhs to the per-rhs kernels as well
    const HostTensor xm = tensor_from_doubles(DType::f32, {M, K}, pseudo_random(M * K, 1));
    HostTensor m0(DType::f32, {M, 8}), m1(DType::f32, {M, 8}), m2(DType::f32, {M, 8});
    expect_error<ShapeError>(
        [&] { launch(Op::grouped_matmul, ctx, {}, {xm.view(), good.view(), short_k.view()}, {m0.view(), m1.view()}); },
        {"grouped_matmul: rhs 1: matmul: lhs inner dim 32 does not match rhs dim 0 of 31"});
    expect_error<DTypeError>([&] {
      launch(Op::grouped_matmul, ctx, {}, {xm.view(), good.view(), good.view(), f64.view()},
             {m0.view(), m1.view(), m2.view()});
    }, {"grouped_matmul: rhs 2: matmul:", "f64"});
  }
  expect_error<ValueError>([&] { launch(Op::grouped_matmul, ctx, {}, {x.view(), good.view()}, {o0.view()}); },
                           "expected a lhs and n >= 2 rhs with n results, got 2 operands and 1 results");
  expect_error<ValueError>(
      [&] { launch(Op::grouped_matmul, ctx, {}, {x.view(), good.view(), good.view()}, {o0.view()}); },
      "got 3 operands and 1 results");
  // Q8_0: rows of the wrong length.
  const HostTensor q = q8_0_weights(8, K, 5), q_long = q8_0_weights(8, 2 * K, 6);
  expect_error<ShapeError>([&] {
    launch(Op::grouped_matmul, ctx, {{"encoding", std::string("q8_0")}}, {x.view(), q.view(), q_long.view()},
           {o0.view(), o1.view()});
  }, {"grouped_matmul: rhs 1: qmatmul: rhs rows must be 34 bytes"});
}

}  // namespace
}  // namespace kiln::kernels
