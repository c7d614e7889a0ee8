// fuse_elementwise on graphs built with ops::, checked by structure: which nodes are left, and the
// fused node's operands, type and program. That the fused graphs compute what the unfused ones do is
// tests/engine/test_fuse_elementwise_numerics.cpp (this binary cannot link the engine).
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "cpu_kernel_catalog.h"
#include "kiln/compiler/compiled_model.h"
#include "kiln/compiler/passes.h"
#include "kiln/graph/ops.h"
#include "kiln/graph/text.h"

using namespace kiln;
using namespace kiln::graph;
namespace passes = kiln::compiler::passes;

namespace {

TensorType f32(Shape s) { return TensorType{DType::f32, std::move(s)}; }

std::vector<Op> ops_of(const GraphIR& g) {
  std::vector<Op> out;
  for (const Node& n : g.nodes) out.push_back(n.op);
  return out;
}

// Runs the pass and checks what every pass keeps: a valid module whose graphs have the same interface.
Module fuse(const Module& before) {
  Module after = passes::fuse_elementwise(before, kiln::testing::cpu_kernels());
  passes::verify(after);
  for (const auto& g : before.graphs()) {
    EXPECT_EQ(after.at(g->name).input_types(), g->input_types()) << g->name;
    EXPECT_EQ(after.at(g->name).output_types(), g->output_types()) << g->name;
  }
  return after;
}

const Node& only_node(const GraphIR& g, Op op) {
  const Node* found = nullptr;
  for (const Node& n : g.nodes)
    if (n.op == op) {
      EXPECT_EQ(found, nullptr) << "more than one " << op_name(op);
      found = &n;
    }
  if (!found) throw std::logic_error("no " + std::string(op_name(op)) + " node");
  return *found;
}

std::string program_of(const Node& n) { return std::get<std::string>(n.attrs.at("program")); }

}  // namespace

TEST(FuseElementwise, ChainOfFiveOpsBecomesOneNode) {
  Graph g("chain", {f32({4, 300}), f32({4, 300})});
  auto x = g.input(0);
  auto y = g.input(1);
  g.output({ops::tanh(ops::silu(ops::exp(x) * y)) - y});
  ASSERT_EQ(g.ir().nodes.size(), 5u);

  Module m = fuse(g.module());
  const GraphIR& ir = m.at("chain");
  EXPECT_EQ(ops_of(ir), std::vector<Op>{Op::fused_elementwise});
  EXPECT_EQ(ir.nodes[0].inputs, (std::vector<ValueId>{0, 1}));
  EXPECT_EQ(program_of(ir.nodes[0]),
            "%2 = exp(%0) : f32; %3 = mul(%2, %1) : f32; %4 = silu(%3) : f32; %5 = tanh(%4) : f32; "
            "%6 = sub(%5, %1) : f32");
  EXPECT_EQ(ir.type(ir.outputs[0]), Type(f32({4, 300})));
}

TEST(FuseElementwise, ValueUsedOutsideTheGroupIsNotFusedAway) {
  Graph g("shared", {f32({8}), f32({8})});
  auto x = g.input(0);
  auto e = ops::exp(x);
  // e is returned as well, so it must stay a value of its own; the ops after it fuse around it.
  g.output({ops::sin(e) + g.input(1), e});
  Module m = fuse(g.module());
  const GraphIR& ir = m.at("shared");
  EXPECT_EQ(ops_of(ir), (std::vector<Op>{Op::exp, Op::fused_elementwise}));
  const Node& fused = only_node(ir, Op::fused_elementwise);
  EXPECT_EQ(fused.inputs, (std::vector<ValueId>{ir.nodes[0].outputs[0], 1}));
  EXPECT_EQ(program_of(fused), "%2 = sin(%0) : f32; %3 = add(%2, %1) : f32");
  EXPECT_EQ(ir.outputs[1], ir.nodes[0].outputs[0]);
}

TEST(FuseElementwise, ValueReadByANonElementwiseOpStaysOutside) {
  Graph g("reduced", {f32({2, 8})});
  auto e = ops::exp(g.input(0));
  g.output({ops::neg(e) * e, ops::sum(e, 1)});
  Module m = fuse(g.module());
  const GraphIR& ir = m.at("reduced");
  EXPECT_EQ(ops_of(ir), (std::vector<Op>{Op::exp, Op::fused_elementwise, Op::sum}));
  EXPECT_EQ(program_of(only_node(ir, Op::fused_elementwise)), "%1 = neg(%0) : f32; %2 = mul(%1, %0) : f32");
}

TEST(FuseElementwise, ValueUsedTwiceInsideTheGroupFusesWithIt) {
  // A diamond: e feeds both sin and cos, which meet again in the add.
  Graph g("diamond", {f32({8})});
  auto e = ops::exp(g.input(0));
  auto s = ops::sin(e);
  auto c = ops::cos(e);
  g.output({s + c});
  Module m = fuse(g.module());
  const GraphIR& ir = m.at("diamond");
  EXPECT_EQ(ops_of(ir), std::vector<Op>{Op::fused_elementwise});
  EXPECT_EQ(program_of(ir.nodes[0]),
            "%1 = exp(%0) : f32; %2 = sin(%1) : f32; %3 = cos(%1) : f32; %4 = add(%2, %3) : f32");
}

TEST(FuseElementwise, BroadcastOperandsBecomeOperandsOfTheFusedNode) {
  Graph g("affine", {f32({3, 5}), f32({5}), f32({3, 1})});
  Graph::Scope scope(g);
  auto scale = ops::constant(0.5, DType::f32);  // rank 0
  g.output({(g.input(0) * g.input(1) + g.input(2)) * scale});
  Module m = fuse(g.module());
  const GraphIR& ir = m.at("affine");
  EXPECT_EQ(ops_of(ir), (std::vector<Op>{Op::constant, Op::fused_elementwise}));
  const Node& fused = ir.nodes[1];
  EXPECT_EQ(fused.inputs, (std::vector<ValueId>{0, 1, 2, ir.nodes[0].outputs[0]}));
  EXPECT_EQ(program_of(fused), "%4 = mul(%0, %1) : f32; %5 = add(%4, %2) : f32; %6 = mul(%5, %3) : f32");
  EXPECT_EQ(ir.type(fused.outputs[0]), Type(f32({3, 5})));
}

TEST(FuseElementwise, SmallerProducerIsNotRecomputedPerElement) {
  // rsqrt(v + eps) is [3, 1]: fusing it into the [3, 5] multiply would compute it five times per row.
  Graph g("norm", {f32({3, 5}), f32({3, 1})});
  Graph::Scope scope(g);
  auto inv = ops::rsqrt(g.input(1) + ops::constant(1e-5, DType::f32));
  g.output({g.input(0) * inv});
  Module m = fuse(g.module());
  const GraphIR& ir = m.at("norm");
  EXPECT_EQ(ops_of(ir), (std::vector<Op>{Op::constant, Op::fused_elementwise, Op::mul}));
  EXPECT_EQ(program_of(ir.nodes[1]), "%2 = add(%0, %1) : f32; %3 = rsqrt(%2) : f32");
  EXPECT_EQ(ir.type(ir.nodes[1].outputs[0]), Type(f32({3, 1})));
}

TEST(FuseElementwise, SymbolicShapesCastsAndBoolRegistersFuse) {
  Graph g("leaky", {f32({"batch", Dim("seq") + 1})});
  Graph::Scope scope(g);
  auto x = g.input(0);
  auto zero = ops::constant(0.0, DType::f32);
  auto slope = ops::constant(0.1, DType::f32);
  auto positive = ops::greater(x, zero);
  auto scaled = x * slope;
  auto leaky = ops::where(positive, x, scaled);
  g.output({ops::cast(ops::gelu(leaky, /*tanh_approximation=*/true), DType::bf16)});
  Module m = fuse(g.module());
  const GraphIR& ir = m.at("leaky");
  const Node& fused = only_node(ir, Op::fused_elementwise);
  EXPECT_EQ(program_of(fused),
            "%3 = greater(%0, %1) : bool; %4 = mul(%0, %2) : f32; %5 = where(%3, %0, %4) : f32; "
            "%6 = gelu.tanh(%5) : f32; %7 = cast(%6) : bf16");
  EXPECT_EQ(ir.type(fused.outputs[0]), Type(TensorType{DType::bf16, {"batch", Dim("seq") + 1}}));
  // The fused graph prints and parses back to itself.
  EXPECT_EQ(print(parse_module(print(m))), print(m));
}

TEST(FuseElementwise, IntegerAndF64OpsAreLeftAlone) {
  // The fused kernel computes in f32 registers: i64 or f64 would lose range or precision.
  Graph g("wide", {TensorType{DType::i64, {4}}, TensorType{DType::f64, {4}}});
  auto i = g.input(0);
  auto d = g.input(1);
  g.output({(i + i) * i, ops::exp(d) * d});
  Module m = fuse(g.module());
  EXPECT_EQ(ops_of(m.at("wide")), (std::vector<Op>{Op::add, Op::mul, Op::exp, Op::mul}));
}

TEST(FuseElementwise, SeparateChainsBecomeSeparateNodes) {
  Graph g("two", {f32({4}), f32({4})});
  auto a = ops::exp(g.input(0)) + g.input(1);
  auto b = ops::sigmoid(g.input(1)) * g.input(0);
  auto row = ops::reshape(a, Shape{1, 4});
  auto column = ops::reshape(b, Shape{4, 1});
  g.output({ops::matmul(row, column)});
  Module m = fuse(g.module());
  const GraphIR& ir = m.at("two");
  EXPECT_EQ(ops_of(ir), (std::vector<Op>{Op::fused_elementwise, Op::fused_elementwise, Op::reshape, Op::reshape,
                                         Op::matmul}));
  EXPECT_EQ(program_of(ir.nodes[0]), "%2 = exp(%0) : f32; %3 = add(%2, %1) : f32");
  EXPECT_EQ(program_of(ir.nodes[1]), "%2 = sigmoid(%0) : f32; %3 = mul(%2, %1) : f32");
}

TEST(FuseElementwise, LoneElementwiseOpsStayAsTheyAre) {
  Graph g("single", {f32({4})});
  g.output({ops::reshape(ops::exp(g.input(0)), Shape{2, 2})});
  Module m = fuse(g.module());
  EXPECT_EQ(ops_of(m.at("single")), (std::vector<Op>{Op::exp, Op::reshape}));
}

TEST(FuseElementwise, CompileRunsItSoTheChainIsOneStep) {
  Graph g("mlp_tail", {f32({"seq", 6}), f32({"seq", 6})});
  g.output({ops::silu(g.input(0)) * g.input(1)});  // Llama's MLP gate
  auto compiled = compiler::compile(g.module(), kiln::testing::with_cpu_kernels());
  const compiler::GraphPlan& plan = compiled.plan("mlp_tail");
  ASSERT_EQ(plan.steps.size(), 1u);
  EXPECT_EQ(plan.steps[0].op, Op::fused_elementwise);
  EXPECT_EQ(std::get<std::string>(plan.steps[0].attrs.at("program")), "%2 = silu(%0) : f32; %3 = mul(%2, %1) : f32");
}
