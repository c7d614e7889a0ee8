// group_matmuls end to end: a Llama-like block (q/k/v projections of the input, gate/up of its norm,
// down) runs through InferenceSession compiled twice: with every optimizing pass, so q/k/v and gate/up
// are grouped_matmul steps, and with every pass but group_matmuls (applied by hand, then compiled
// unoptimized). Each result must be the same bits, for f32 weights, bf16 weights under f32
// activations, and Q8_0 weights, at decode and prefill row counts, on 1 and 2 threads. One case is
// also checked against a loop written here.
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "cpu_kernel_catalog.h"
#include "kiln/compiler/passes.h"
#include "kiln/graph/quantization.h"
#include "kiln/kiln.h"

namespace {

using namespace kiln;
namespace ops = kiln::graph::ops;
namespace passes = kiln::compiler::passes;
using graph::TensorValue;

constexpr int64_t kDim = 64, kKv = 16, kHidden = 96;

std::vector<float> random_values(int64_t n, uint32_t seed) {
  std::vector<float> out;
  for (int64_t i = 0; i < n; ++i) {
    seed = seed * 1664525u + 1013904223u;
    out.push_back(static_cast<float>(seed >> 8) / static_cast<float>(1u << 23) - 1.0f);
  }
  return out;
}

enum class Weights { f32, bf16, q8_0 };

// The block and the weights it reads, [out, in] as nn::Linear stores them.
struct Block {
  graph::Graph graph{"block", {graph::TensorType{DType::f32, {"seq", kDim}}}};
  WeightsRegistry weights;
  std::map<std::string, std::vector<float>> values;  // the f32 weights before any conversion
};

void build(Block& b, Weights kind) {
  graph::Graph& g = b.graph;
  auto linear = [&](const std::string& name, int64_t out, int64_t in, const TensorValue& x) {
    std::vector<float> w = random_values(out * in, static_cast<uint32_t>(name.size() * 7919 + out));
    b.values[name] = w;
    switch (kind) {
      case Weights::f32:
        b.weights[name] = Tensor::from_vector(w, {out, in});
        return ops::matmul(x, ops::transpose(g.weight({name, DType::f32, graph::Shape{out, in}}), 0, 1));
      case Weights::bf16: {
        std::vector<bf16_t> narrow(w.begin(), w.end());
        b.weights[name] = Tensor::from_vector(narrow, {out, in});
        return ops::matmul(x, ops::transpose(g.weight({name, DType::bf16, graph::Shape{out, in}}), 0, 1));
      }
      case Weights::q8_0: {
        const int64_t row_bytes = graph::q8_0_row_bytes(in);
        std::vector<uint8_t> rows(static_cast<size_t>(out * row_bytes));
        for (int64_t r = 0; r < out; ++r) graph::quantize_q8_0(w.data() + r * in, in, rows.data() + r * row_bytes);
        b.weights[name] = Tensor::from_vector(rows, {out, row_bytes});
        return ops::qmatmul(graph::QuantizationEncoding::q8_0, x,
                            g.weight({name, DType::u8, graph::Shape{out, row_bytes}}));
      }
    }
    throw std::logic_error("unknown weight kind");
  };
  TensorValue x = g.input(0);
  TensorValue q = linear("q_proj", kDim, kDim, x), k = linear("k_proj", kKv, kDim, x), v = linear("v_proj", kKv, kDim, x);
  b.weights["norm"] = Tensor::from_vector(random_values(kDim, 5), {kDim});
  TensorValue h = ops::rms_norm(x, g.weight({"norm", DType::f32, graph::Shape{kDim}}), 1e-5);
  TensorValue gate = linear("gate_proj", kHidden, kDim, h);
  TensorValue up = linear("up_proj", kHidden, kDim, h);
  TensorValue mlp = ops::silu(gate) * up;
  g.output({q, k, v, linear("down_proj", kDim, kHidden, mlp)});
}

int count_steps(const compiler::CompiledModel& compiled, graph::Op op) {
  int n = 0;
  for (const auto& step : compiled.plan("block").steps) n += step.op == op;
  return n;
}

TEST(GroupMatmulsNumerics, GroupedBlockEqualsTheUngroupedOneBitForBit) {
  for (Weights kind : {Weights::f32, Weights::bf16, Weights::q8_0}) {
    Block b;
    build(b, kind);
    const graph::Module ungrouped_ir = passes::fuse_elementwise(
        passes::dce(passes::cse(passes::constant_fold(passes::canonicalize(b.graph.module()), kiln::testing::cpu_kernels()))), kiln::testing::cpu_kernels());
    const auto ungrouped = compiler::compile(ungrouped_ir, kiln::testing::with_cpu_kernels(compiler::CompileOptions{.optimize = false}));
    const auto grouped = compiler::compile(b.graph.module(), kiln::testing::with_cpu_kernels());
    EXPECT_EQ(count_steps(ungrouped, graph::Op::grouped_matmul), 0);
    EXPECT_EQ(count_steps(grouped, graph::Op::grouped_matmul), 2);
    for (int threads : {1, 2}) {
      engine::InferenceSession session({DeviceRef::CPU()}, {}, engine::SessionOptions{.num_threads = threads, .compile_cache = false});
      auto want_model = session.init(ungrouped, b.weights).at("block");
      auto got_model = session.init(grouped, b.weights).at("block");
      for (int64_t seq : {1, 3, 8, 9, 40}) {
        SCOPED_TRACE("weights " + std::to_string(static_cast<int>(kind)) + " threads " + std::to_string(threads) +
                     " seq " + std::to_string(seq));
        const std::vector<Tensor> inputs{Tensor::from_vector(random_values(seq * kDim, static_cast<uint32_t>(seq)), {seq, kDim})};
        const auto want = want_model.execute(inputs);
        const auto got = got_model.execute(inputs);
        ASSERT_EQ(got.size(), 4u);
        for (size_t i = 0; i < got.size(); ++i) {
          ASSERT_EQ(got[i].nbytes(), want[i].nbytes()) << "result " << i;
          EXPECT_EQ(std::memcmp(got[i].data(), want[i].data(), got[i].nbytes()), 0) << "result " << i;
        }
      }
    }
  }
}

// The grouped q/k/v results are the products x . W^T (f32 weights), by a loop written here.
TEST(GroupMatmulsNumerics, GroupedProjectionsAreTheProducts) {
  Block b;
  build(b, Weights::f32);
  engine::InferenceSession session({DeviceRef::CPU()}, {}, engine::SessionOptions{.num_threads = 2, .compile_cache = false});
  auto model = session.init(compiler::compile(b.graph.module(), kiln::testing::with_cpu_kernels()), b.weights).at("block");
  const int64_t seq = 2;
  const std::vector<float> x = random_values(seq * kDim, 77);
  const auto out = model.execute({Tensor::from_vector(x, {seq, kDim})});
  const std::vector<std::pair<std::string, int64_t>> projections{{"q_proj", kDim}, {"k_proj", kKv}, {"v_proj", kKv}};
  for (size_t p = 0; p < projections.size(); ++p) {
    const auto& [name, n_out] = projections[p];
    const std::vector<float> got = out[p].to_vector<float>();
    const std::vector<float>& w = b.values[name];
    for (int64_t s = 0; s < seq; ++s)
      for (int64_t n = 0; n < n_out; ++n) {
        double want = 0;
        for (int64_t k = 0; k < kDim; ++k) want += double(x[s * kDim + k]) * w[n * kDim + k];
        EXPECT_NEAR(got[s * n_out + n], want, 1e-5) << name << " [" << s << ", " << n << "]";
      }
  }
}

}  // namespace
