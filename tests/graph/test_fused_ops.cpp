// The fused ops' builders and type inference (fused_elementwise, attention, rope), and the text form of an
// elementwise program.
#include <gtest/gtest.h>

#include "kiln/errors.h"
#include "kiln/graph/elementwise_program.h"
#include "kiln/graph/ops.h"
#include "test_util.h"

using namespace kiln;
using namespace kiln::graph;
using kiln::testing::expect_error;

namespace {
TensorType f32(Shape s) { return TensorType{DType::f32, std::move(s)}; }
}  // namespace

TEST(ElementwiseProgram, ParsesRegistersOpsAndDtypesAndPrintsBack) {
  const std::string text = "%2 = mul(%0, %1) : f32; %3 = gelu.tanh(%2) : f32; %4 = where(%1, %3, %2) : f16";
  // (not type-correct: where needs a bool condition; parsing does not check types)
  ElementwiseProgram p = ElementwiseProgram::parse(text, 2);
  ASSERT_EQ(p.instructions.size(), 3u);
  EXPECT_EQ(p.num_registers(), 5);
  EXPECT_EQ(p.instructions[0].op, Op::mul);
  EXPECT_EQ(p.instructions[0].operands, (std::vector<int32_t>{0, 1}));
  EXPECT_TRUE(p.instructions[1].gelu_tanh);
  EXPECT_EQ(p.instructions[1].attrs(), (Attrs{{"approximate", std::string("tanh")}}));
  EXPECT_EQ(p.instructions[2].operands, (std::vector<int32_t>{1, 3, 2}));
  EXPECT_EQ(p.instructions[2].dtype, DType::f16);
  EXPECT_EQ(p.to_string(), text);
  // Spaces are free.
  EXPECT_EQ(ElementwiseProgram::parse(" %1=exp( %0 ):f32 ;%2 = cast(%1) : bf16 ", 1).to_string(),
            "%1 = exp(%0) : f32; %2 = cast(%1) : bf16");
}

TEST(ElementwiseProgram, RejectsMalformedInstructionsNamingThem) {
  auto parse = [](std::string text, int32_t inputs) { return [=] { ElementwiseProgram::parse(text, inputs); }; };
  expect_error<ValueError>(parse("%1 = exp(%0) : f32", 2), {"%1 = exp(%0)", "defines %1, but the next register is %2"});
  expect_error<ValueError>(parse("%1 = exp(%1) : f32", 1), "uses %1 before its definition");
  expect_error<ValueError>(parse("%1 = frobnicate(%0) : f32", 1), "unknown op 'frobnicate'");
  expect_error<ValueError>(parse("%1 = matmul(%0, %0) : f32", 1), "'matmul' is not an elementwise op");
  expect_error<ValueError>(parse("%1 = add(%0) : f32", 1), "'add' takes 2 operands, got 1");
  expect_error<ValueError>(parse("%1 = exp(%0)", 1), "expected ':'");
  expect_error<ValueError>(parse("%1 = exp(%0) : f33", 1), "unknown dtype 'f33'");
  expect_error<ValueError>(parse("", 1), "empty instruction");
  expect_error<ValueError>(parse("%1 = exp(%0) : f32;", 1), "empty instruction");
}

TEST(FusedElementwise, ResultHasTheLastDtypeAndTheBroadcastShape) {
  Graph g("g", {f32({"n", 1}), f32({4}), TensorType{DType::boolean, {"n", 4}}});
  auto y = ops::fused_elementwise({g.input(0), g.input(1), g.input(2)},
                                  "%3 = add(%0, %1) : f32; %4 = where(%2, %3, %0) : f32; %5 = cast(%4) : bf16");
  EXPECT_EQ(y.tensor_type(), (TensorType{DType::bf16, {"n", 4}}));
}

TEST(FusedElementwise, ChecksEachInstructionAsItsOpWould) {
  Graph g("g", {f32({4}), TensorType{DType::i32, {4}}, f32({3})});
  auto x = g.input(0);
  auto i = g.input(1);
  expect_error<DTypeError>([&] { ops::fused_elementwise({x, i}, "%2 = add(%0, %1) : f32"); },
                           {"fused_elementwise: instruction %2", "add: operand dtypes f32 and i32 differ"});
  expect_error<DTypeError>([&] { ops::fused_elementwise({x}, "%1 = greater(%0, %0) : f32"); },
                           "instruction %1 declares f32, but greater gives bool");
  expect_error<DTypeError>([&] { ops::fused_elementwise({i}, "%1 = exp(%0) : i32"); },
                           "exp: input must have a float dtype");
  expect_error<ValueError>([&] { ops::fused_elementwise({x}, "%1 = exp(%0)"); },
                           "fused_elementwise: elementwise program: instruction \"%1 = exp(%0)\"");
  expect_error<ShapeError>([&] { ops::fused_elementwise({x, g.input(2)}, "%2 = add(%0, %1) : f32"); },
                           "fused_elementwise: shapes do not broadcast at axis 0 (4 vs 3)");
  expect_error<ValueError>([&] { ops::fused_elementwise({}, "%0 = exp(%0) : f32"); }, "needs at least one input");
}

TEST(Rope, ResultHasTheInputsType) {
  Graph g("g", {f32({"seq", 8, 16}), f32({"seq", 16})});
  auto out = ops::rope(g.input(0), g.input(1), g.input(1));
  EXPECT_EQ(out.tensor_type(), f32({"seq", 8, 16}));
  EXPECT_EQ(g.ir().nodes.back().op, graph::Op::rope);
}

TEST(Rope, RejectsOperandsThatDoNotFit) {
  Graph g("g", {f32({3, 2, 8}), f32({3, 8}), f32({4, 8}), f32({3, 6}), f32({3, 2, 7}), f32({3, 7}),
                TensorType{DType::f16, {3, 8}}, TensorType{DType::i32, {3, 2, 8}}, TensorType{DType::i32, {3, 8}}});
  auto x = g.input(0);
  auto cs = g.input(1);
  expect_error<ShapeError>([&] { ops::rope(x, g.input(2), g.input(2)); },
                           "rope: cos and sin must be [3, 8] (x's seq and head_dim)");
  expect_error<ShapeError>([&] { ops::rope(x, g.input(3), g.input(3)); }, "cos and sin must be [3, 8]");
  expect_error<ShapeError>([&] { ops::rope(x, cs, g.input(2)); }, "expected x [seq, heads, head_dim]");
  expect_error<ShapeError>([&] { ops::rope(cs, cs, cs); }, "expected x [seq, heads, head_dim]");
  expect_error<ShapeError>([&] { ops::rope(g.input(4), g.input(5), g.input(5)); }, "head_dim must be static and even");
  expect_error<DTypeError>([&] { ops::rope(x, g.input(6), g.input(6)); }, "operand dtypes f32 and f16 differ");
  expect_error<DTypeError>([&] { ops::rope(g.input(7), g.input(8), g.input(8)); }, "must have a float dtype");
}

TEST(Attention, ResultHasTheQueriesType) {
  Graph g("g", {f32({"seq", 8, 16}), f32({"total", 2, 16}), TensorType{DType::boolean, {"seq", "total"}}});
  auto out = ops::attention(g.input(0), g.input(1), g.input(1), g.input(2), 0.25);
  EXPECT_EQ(out.tensor_type(), f32({"seq", 8, 16}));
  EXPECT_EQ(std::get<double>(g.ir().nodes.back().attrs.at("scale")), 0.25);
}

TEST(Attention, RejectsOperandsThatDoNotFit) {
  Graph g("g", {f32({1, 6, 16}), f32({5, 4, 16}), f32({5, 2, 8}), f32({5, 2, 16}),
                TensorType{DType::boolean, {1, 5}}, TensorType{DType::boolean, {1, 4}},
                TensorType{DType::f16, {5, 2, 16}}, TensorType{DType::i64, {1, 5}}});
  auto q = g.input(0);
  auto mask = g.input(4);
  expect_error<ShapeError>([&] { ops::attention(q, g.input(1), g.input(1), mask, 1.0); },
                           "q's heads must be a static multiple of k's kv_heads");
  expect_error<ShapeError>([&] { ops::attention(q, g.input(2), g.input(2), mask, 1.0); },
                           "q's head_dim 16 differs from k's 8");
  expect_error<ShapeError>([&] { ops::attention(q, g.input(3), g.input(2), mask, 1.0); },
                           "k and v must have one shape");
  expect_error<ShapeError>([&] { ops::attention(q, g.input(3), g.input(3), g.input(5), 1.0); },
                           "masked must be [1, 5] (q's seq, k's total)");
  expect_error<DTypeError>([&] { ops::attention(q, g.input(6), g.input(6), mask, 1.0); },
                           "operand dtypes f32 and f16 differ");
  expect_error<DTypeError>([&] { ops::attention(q, g.input(3), g.input(3), g.input(7), 1.0); },
                           "masked must be bool");
  expect_error<ShapeError>([&] { ops::attention(g.input(3), g.input(3), g.input(3), mask, 1.0); },
                           "masked must be [5, 5]");
}
