// fuse_elementwise end to end: each graph runs through InferenceSession compiled twice, once without
// the optimizing passes (one kernel per op) and once with them (fused), and the two must agree bit for
// bit, since the fused kernel computes every op with the unfused kernel's f32 formula and rounds 16-bit
// results after each op as the unfused graph stores them. One case also checks a hand-written loop.
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "cpu_kernel_catalog.h"
#include "kiln/kiln.h"

namespace {

using namespace kiln;
namespace ops = kiln::graph::ops;
using graph::TensorType;
using graph::TensorValue;

// Values spread over [-3, 3), with a few exact integers and halves (for floor, round, mod).
std::vector<float> spread(int64_t n, uint32_t seed) {
  std::vector<float> out;
  for (int64_t i = 0; i < n; ++i) {
    seed = seed * 1664525u + 1013904223u;
    float v = static_cast<float>(seed >> 8) / static_cast<float>(1u << 23) * 3.0f - 3.0f;
    if (i % 7 == 0) v = std::round(v * 2.0f) / 2.0f;
    out.push_back(v);
  }
  return out;
}

int count_steps(const compiler::CompiledModel& compiled, const std::string& graph, graph::Op op) {
  int n = 0;
  for (const auto& step : compiled.plan(graph).steps) n += step.op == op;
  return n;
}

// Runs `g` unfused and fused on `inputs`; expects the fused plan to have `fused_steps` fused nodes and
// every result to be equal byte for byte. Returns the fused results.
std::vector<Tensor> expect_fused_equals_unfused(const graph::Graph& g, const std::vector<Tensor>& inputs,
                                                int fused_steps = 1) {
  engine::InferenceSession session;
  const auto unfused = compiler::compile(g.module(), kiln::testing::with_cpu_kernels(compiler::CompileOptions{.optimize = false}));
  const auto fused = compiler::compile(g.module(), kiln::testing::with_cpu_kernels());
  EXPECT_EQ(count_steps(unfused, g.name(), graph::Op::fused_elementwise), 0);
  EXPECT_EQ(count_steps(fused, g.name(), graph::Op::fused_elementwise), fused_steps);
  const auto want = session.init(unfused, {}).at(g.name()).execute(inputs);
  const auto got = session.init(fused, {}).at(g.name()).execute(inputs);
  EXPECT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size() && i < want.size(); ++i) {
    EXPECT_EQ(got[i].shape(), want[i].shape()) << "result " << i;
    EXPECT_EQ(got[i].dtype(), want[i].dtype()) << "result " << i;
    if (got[i].nbytes() != want[i].nbytes()) continue;
    const auto* a = static_cast<const unsigned char*>(got[i].data());
    const auto* b = static_cast<const unsigned char*>(want[i].data());
    const size_t size = dtype_size(got[i].dtype());
    for (size_t e = 0; e < got[i].nbytes() / size; ++e)
      if (std::memcmp(a + e * size, b + e * size, size) != 0) {
        ADD_FAILURE() << "result " << i << " element " << e << " differs: fused "
                      << got[i].to_vector<double>()[e] << ", unfused " << want[i].to_vector<double>()[e];
        break;
      }
  }
  return got;
}

// Every op the fused kernel computes, in one tree over x and y.
TensorValue every_float_op(const TensorValue& x, const TensorValue& y) {
  auto a = ops::exp(ops::neg(ops::abs(x * y)));
  auto b = ops::sigmoid(x) + ops::tanh(y) - ops::silu(x);
  auto c = ops::gelu(b) * ops::gelu(a, /*tanh_approximation=*/true) / (ops::relu(y) + 1.0);
  auto d = ops::rsqrt(ops::square(c) + 1.0) + ops::sqrt(ops::abs(x)) + ops::log(ops::abs(y) + 0.5);
  auto e = ops::sin(d) * ops::cos(x) + ops::erf(y) + ops::reciprocal(ops::abs(x) + 1.0);
  auto f = ops::floor(x) + ops::ceil(y) + ops::round(x * 2.0) + ops::mod(x, y) + ops::pow(ops::abs(y) + 0.25, x);
  auto g = ops::maximum(e, f) - ops::minimum(e, x);
  auto keep = ops::logical_and(ops::logical_or(ops::greater(x, y), ops::less_equal(x, 0.0 * y)),
                               ops::logical_not(ops::is_nan(g)));
  keep = ops::logical_xor(keep, ops::logical_or(ops::equal(x, y), ops::not_equal(y, y)));
  keep = ops::logical_or(keep, ops::logical_and(ops::greater_equal(y, x), ops::less(y, 1.0 + x)));
  return ops::where(keep, g, ops::cast(ops::cast(f, DType::boolean), DType::f32) - a);
}

}  // namespace

TEST(FuseElementwiseNumerics, EveryOpMatchesTheUnfusedKernelsBitForBit) {
  graph::Graph g("every", {TensorType{DType::f32, {"n"}}, TensorType{DType::f32, {"n"}}});
  g.output({every_float_op(g.input(0), g.input(1))});
  // Around the 256-element block, and past a threaded chunk (16k elements) several times.
  for (int64_t n : {1, 255, 256, 257, 1000, 70001}) {
    SCOPED_TRACE(n);
    expect_fused_equals_unfused(g, {Tensor::from_vector<float>(spread(n, 1), {n}),
                                    Tensor::from_vector<float>(spread(n, 2), {n})});
  }
}

TEST(FuseElementwiseNumerics, BroadcastOperandsOverSymbolicRows) {
  graph::Graph g("affine", {TensorType{DType::f32, {"rows", 5}}, TensorType{DType::f32, {5}},
                            TensorType{DType::f32, {"rows", 1}}});
  {
    graph::Graph::Scope scope(g);
    g.output({ops::silu(g.input(0) * g.input(1) + g.input(2)) * ops::constant(0.5, DType::f32)});
  }
  for (int64_t rows : {1, 3, 120}) {
    const auto x = spread(rows * 5, 3), w = spread(5, 4), b = spread(rows, 5);
    auto got = expect_fused_equals_unfused(
        g, {Tensor::from_vector<float>(x, {rows, 5}), Tensor::from_vector<float>(w, {5}),
            Tensor::from_vector<float>(b, {rows, 1})})[0].to_vector<float>();
    // And against the formula, written out here.
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < 5; ++c) {
        const double t = double(x[static_cast<size_t>(r * 5 + c)]) * w[static_cast<size_t>(c)] + b[static_cast<size_t>(r)];
        EXPECT_NEAR(got[static_cast<size_t>(r * 5 + c)], t / (1 + std::exp(-t)) * 0.5, 1e-5) << r << ", " << c;
      }
  }
}

TEST(FuseElementwiseNumerics, SixteenBitResultsRoundAfterEveryOpAsUnfused) {
  for (DType half : {DType::bf16, DType::f16}) {
    SCOPED_TRACE(dtype_name(half));
    graph::Graph g("half", {TensorType{DType::f32, {"n"}}, TensorType{DType::f32, {"n"}}});
    auto x = ops::cast(g.input(0), half);
    auto y = ops::cast(g.input(1), half);
    // Without rounding between ops, x * y + x and silu(...) * y would differ in the last bit often.
    auto h = ops::silu(x * y + x) * y;
    g.output({ops::cast(h, DType::f32), ops::greater(h, x)});
    const int64_t n = 3000;
    auto got = expect_fused_equals_unfused(g, {Tensor::from_vector<float>(spread(n, 6), {n}),
                                               Tensor::from_vector<float>(spread(n, 7), {n})},
                                           /*fused_steps=*/1);
    EXPECT_EQ(got[1].dtype(), DType::boolean);
  }
}

TEST(FuseElementwiseNumerics, ValueAlsoReturnedIsComputedOnceAndReturnedIntact) {
  graph::Graph g("shared", {TensorType{DType::f32, {6}}});
  auto e = ops::exp(g.input(0));
  g.output({ops::sin(e) * e + 1.0, e});
  const std::vector<float> x{-2, -1, 0, 0.5f, 1, 2};
  auto got = expect_fused_equals_unfused(g, {Tensor::from_vector<float>(x, {6})});
  for (size_t i = 0; i < x.size(); ++i) EXPECT_EQ(got[1].to_vector<float>()[i], std::exp(x[i])) << i;
}
