// group_matmuls and the grouped_matmul op, checked by structure: which nodes become one grouped node
// (q/k/v-like and gate/up-like siblings), which stay (different lhs, transpose_b, encoding or rhs
// dtype, a rhs that is not a weight, GPU values), and grouped_matmul's type inference. That the
// grouped graphs compute what the ungrouped ones do, bit for bit, is
// tests/engine/test_group_matmuls_numerics.cpp (this binary cannot link the engine).
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "cpu_kernel_catalog.h"
#include "../test_util.h"
#include "kiln/compiler/compiled_model.h"
#include "kiln/compiler/passes.h"
#include "kiln/graph/ops.h"
#include "kiln/graph/quantization.h"

using namespace kiln;
using namespace kiln::graph;
namespace passes = kiln::compiler::passes;
using kiln::testing::expect_error;

namespace {

TensorType f32(Shape s, DeviceRef device = DeviceRef::CPU()) { return TensorType{DType::f32, std::move(s), device}; }

int count(const GraphIR& g, Op op) {
  return static_cast<int>(std::count_if(g.nodes.begin(), g.nodes.end(), [&](const Node& n) { return n.op == op; }));
}

// Runs the pass and checks what every pass keeps: a valid module with the same interface.
Module group(const Module& before) {
  Module after = passes::group_matmuls(before, kiln::testing::cpu_kernels());
  passes::verify(after);
  for (const auto& g : before.graphs()) {
    EXPECT_EQ(after.at(g->name).input_types(), g->input_types()) << g->name;
    EXPECT_EQ(after.at(g->name).output_types(), g->output_types()) << g->name;
  }
  return after;
}

std::vector<std::string> weight_names(const GraphIR& g, const Node& n) {
  std::vector<std::string> out;
  for (size_t i = 1; i < n.inputs.size(); ++i)
    for (const Node& producer : g.nodes)
      if (producer.outputs.size() == 1 && producer.outputs[0] == n.inputs[i] && producer.op == Op::weight)
        out.push_back(get_attr<std::string>(producer.attrs, "name", Op::weight));
  return out;
}

// x [seq, 64] through q (64), k and v (16 each) projections, and a gate/up/down MLP on norm(x), the way
// nn::Linear writes them: matmul(x, transpose(w)) with w [out, in], or qmatmul of a Q8_0 weight.
Graph llama_like(DType weights, bool q8_0) {
  Graph g("block", {f32({"seq", 64})});
  TensorValue x = g.input(0);
  auto linear = [&](const std::string& name, int64_t out, const TensorValue& in) {
    const int64_t k = 64;
    if (q8_0)
      return ops::qmatmul(QuantizationEncoding::q8_0, in,
                          g.weight({name, DType::u8, Shape{out, q8_0_row_bytes(k)}}));
    return ops::matmul(in, ops::transpose(g.weight({name, weights, Shape{out, k}}), 0, 1));
  };
  TensorValue q = linear("q_proj", 64, x), k = linear("k_proj", 16, x), v = linear("v_proj", 16, x);
  TensorValue h = ops::rms_norm(x, g.weight({"norm", DType::f32, Shape{64}}), 1e-5);
  TensorValue gate = linear("gate_proj", 64, h);  // in this order (operands of * have none)
  TensorValue up = linear("up_proj", 64, h);
  TensorValue mlp = ops::silu(gate) * up;
  g.output({q, k, v, mlp});
  return g;
}

}  // namespace

TEST(GroupMatmuls, QkvAndGateUpBecomeOneGroupedNodeEach) {
  for (bool q8_0 : {false, true}) {
    SCOPED_TRACE(q8_0 ? "q8_0" : "f32");
    Graph g = llama_like(DType::f32, q8_0);
    Module canonical = passes::canonicalize(g.module());  // transpose folded into transpose_b
    const Op single = q8_0 ? Op::qmatmul : Op::matmul;
    ASSERT_EQ(count(canonical.at("block"), single), 5);
    Module after = group(canonical);
    const GraphIR& ir = after.at("block");
    EXPECT_EQ(count(ir, single), 0);
    ASSERT_EQ(count(ir, Op::grouped_matmul), 2);
    std::vector<const Node*> grouped;
    for (const Node& n : ir.nodes)
      if (n.op == Op::grouped_matmul) grouped.push_back(&n);
    // In program order: q/k/v first, reading the input, then gate/up reading the norm.
    EXPECT_EQ(weight_names(ir, *grouped[0]), (std::vector<std::string>{"q_proj", "k_proj", "v_proj"}));
    EXPECT_EQ(grouped[0]->inputs[0], ir.inputs[0]);
    EXPECT_EQ(weight_names(ir, *grouped[1]), (std::vector<std::string>{"gate_proj", "up_proj"}));
    const Attrs want = q8_0 ? Attrs{{"encoding", std::string("q8_0")}} : Attrs{{"transpose_b", int64_t{1}}};
    EXPECT_TRUE(grouped[0]->attrs == want);
    EXPECT_TRUE(grouped[1]->attrs == want);
    // The graph returns q, k and v straight from the grouped node's results, in order.
    EXPECT_EQ((std::vector<ValueId>(ir.outputs.begin(), ir.outputs.begin() + 3)), grouped[0]->outputs);
    EXPECT_EQ(ir.type(grouped[0]->outputs[1]), (Type{f32({"seq", 16})}));
  }
}

TEST(GroupMatmuls, CompileRunsThePassAfterTheOtherOptimizations) {
  Graph g = llama_like(DType::bf16, false);  // bf16 weights under f32 activations
  const auto compiled = compiler::compile(g.module(), kiln::testing::with_cpu_kernels());
  int grouped = 0, matmuls = 0;
  for (const auto& step : compiled.plan("block").steps) {
    grouped += step.op == Op::grouped_matmul;
    matmuls += step.op == Op::matmul;
  }
  EXPECT_EQ(grouped, 2);
  EXPECT_EQ(matmuls, 0);
  // Unoptimized compiles keep every matmul.
  const auto plain = compiler::compile(g.module(), kiln::testing::with_cpu_kernels(compiler::CompileOptions{.optimize = false}));
  for (const auto& step : plain.plan("block").steps) EXPECT_NE(step.op, Op::grouped_matmul);
}

TEST(GroupMatmuls, LeavesNonSiblingsAlone) {
  Graph g("g", {f32({"seq", 8}), f32({"seq", 8}), f32({8, 4})});
  TensorValue x = g.input(0), y = g.input(1), input_w = g.input(2);
  auto w = [&](const std::string& name, DType dtype = DType::f32) { return g.weight({name, dtype, Shape{8, 4}}); };
  std::vector<Value> outs{
      ops::matmul(x, w("a")), ops::matmul(y, w("b")),                              // different lhs
      ops::matmul(x, ops::neg(w("c"))),                                             // rhs computed
      ops::matmul(x, input_w),                                                      // rhs an input
      ops::matmul(x, ops::transpose(g.weight({"t", DType::f32, Shape{4, 8}}), 0, 1)),  // transpose_b 1
      ops::matmul(x, w("h", DType::bf16)),                                          // another rhs dtype
  };
  g.output(outs);
  Module canonical = passes::canonicalize(g.module());
  const int matmuls = count(canonical.at("g"), Op::matmul);
  Module after = group(canonical);
  EXPECT_EQ(count(after.at("g"), Op::grouped_matmul), 0);
  EXPECT_EQ(count(after.at("g"), Op::matmul), matmuls);
}

TEST(GroupMatmuls, LeavesGpuValuesAndMixedOpsAlone) {
  const DeviceRef gpu = DeviceRef::GPU(0);
  Graph g("g", {f32({2, 64}, gpu), f32({2, 64})});
  TensorValue on_gpu = g.input(0), x = g.input(1);
  std::vector<Value> outs{
      ops::matmul(on_gpu, g.weight({"g1", DType::f32, Shape{64, 4}, gpu})),
      ops::matmul(on_gpu, g.weight({"g2", DType::f32, Shape{64, 4}, gpu})),
      // One matmul and one qmatmul of the same lhs are not siblings.
      ops::matmul(x, g.weight({"f", DType::f32, Shape{64, 4}})),
      ops::qmatmul(QuantizationEncoding::q8_0, x, g.weight({"q", DType::u8, Shape{4, q8_0_row_bytes(64)}})),
  };
  g.output(outs);
  Module after = group(g.module());
  EXPECT_EQ(count(after.at("g"), Op::grouped_matmul), 0);
  EXPECT_EQ(count(after.at("g"), Op::matmul), 3);
}

// Siblings split by their attributes: two transpose_b groups and two plain ones over one lhs. A weight
// node defined after the group's place (as nn layers create them at first use) moves up before it.
TEST(GroupMatmuls, GroupsByAttributesAndHoistsLaterWeights) {
  Graph g("g", {f32({3, 8})});
  TensorValue x = g.input(0);
  TensorValue p = ops::matmul(x, g.weight({"p1", DType::f32, Shape{8, 5}}));
  TensorValue used = ops::relu(p);  // between the siblings, reading the first one's result
  TensorValue t1 = ops::matmul(x, ops::transpose(g.weight({"t1", DType::f32, Shape{6, 8}}), 0, 1));
  TensorValue p2 = ops::matmul(x, g.weight({"p2", DType::f32, Shape{8, 7}}));
  TensorValue t2 = ops::matmul(x, ops::transpose(g.weight({"t2", DType::f32, Shape{2, 8}}), 0, 1));
  g.output({used, t1, p2, t2});
  Module after = group(passes::canonicalize(g.module()));
  const GraphIR& ir = after.at("g");
  ASSERT_EQ(count(ir, Op::grouped_matmul), 2);
  EXPECT_EQ(count(ir, Op::matmul), 0);
  std::vector<std::vector<std::string>> groups;
  size_t first_group = ir.nodes.size(), relu = 0;
  for (size_t i = 0; i < ir.nodes.size(); ++i) {
    if (ir.nodes[i].op == Op::grouped_matmul) {
      groups.push_back(weight_names(ir, ir.nodes[i]));
      first_group = std::min(first_group, i);
    }
    if (ir.nodes[i].op == Op::relu) relu = i;
  }
  EXPECT_EQ(groups, (std::vector<std::vector<std::string>>{{"p1", "p2"}, {"t1", "t2"}}));
  EXPECT_LT(first_group, relu);  // at the first member's place, before the relu that reads it
  EXPECT_EQ(ir.type(ir.outputs[2]), (Type{f32({3, 7})}));
}

// ---- the op ---------------------------------------------------------------------------------------

TEST(GroupedMatmulOp, ResultIIsWhatMatmulOrQmatmulOfRhsIGives) {
  Graph g("g", {f32({"seq", 64})});
  TensorValue x = g.input(0);
  TensorValue a = g.weight({"a", DType::bf16, Shape{32, 64}}), b = g.weight({"b", DType::bf16, Shape{8, 64}});
  auto results = add_node(g.ir(), &g.module(), Op::grouped_matmul, {x, a, b}, {{"transpose_b", int64_t{1}}});
  ASSERT_EQ(results.size(), 2u);
  EXPECT_EQ(results[0].type(), (Type{f32({"seq", 32})}));
  EXPECT_EQ(results[1].type(), (Type{f32({"seq", 8})}));
  TensorValue qa = g.weight({"qa", DType::u8, Shape{10, q8_0_row_bytes(64)}});
  TensorValue qb = g.weight({"qb", DType::u8, Shape{3, q8_0_row_bytes(64)}});
  auto q = add_node(g.ir(), &g.module(), Op::grouped_matmul, {x, qa, qb}, {{"encoding", std::string("q8_0")}});
  EXPECT_EQ(q[1].type(), (Type{f32({"seq", 3})}));
}

TEST(GroupedMatmulOp, ErrorsNameTheOpAndTheRhsIndex) {
  Graph g("g", {f32({"seq", 64})});
  TensorValue x = g.input(0);
  TensorValue ok = g.weight({"ok", DType::f32, Shape{64, 4}});
  TensorValue short_k = g.weight({"short", DType::f32, Shape{63, 4}});
  TensorValue f64 = g.weight({"f64", DType::f64, Shape{64, 4}});
  auto build = [&](std::vector<Value> in, Attrs attrs = {}) {
    return [&g, in, attrs] { add_node(g.ir(), &g.module(), Op::grouped_matmul, in, attrs); };
  };
  expect_error<ShapeError>(build({x, ok, short_k}), {"grouped_matmul: rhs 1: matmul: lhs inner dim 64 does not match"});
  expect_error<DTypeError>(build({x, f64, ok, ok}), {"grouped_matmul: rhs 0: matmul: operand dtypes f32 and f64"});
  expect_error<ValueError>(build({x, ok}), "grouped_matmul: expected at least 3 operands, got 2");
  expect_error<ValueError>(build({x, ok, ok}, {{"transpose_b", int64_t{2}}}),
                           "grouped_matmul: rhs 0: matmul: attribute 'transpose_b' must be 0 or 1, got 2");
  expect_error<ValueError>(build({x, ok, ok}, {{"transpose_b", int64_t{1}}, {"encoding", std::string("q8_0")}}),
                           "grouped_matmul: takes 'transpose_b' (as matmul) or 'encoding' (as qmatmul), not both");
  TensorValue q = g.weight({"q", DType::u8, Shape{4, q8_0_row_bytes(64)}});
  TensorValue q_wide = g.weight({"q_wide", DType::u8, Shape{4, q8_0_row_bytes(96)}});
  expect_error<ShapeError>(build({x, q, q_wide}, {{"encoding", std::string("q8_0")}}),
                           "grouped_matmul: rhs 1: qmatmul: rhs rows must be 68 bytes");
}
