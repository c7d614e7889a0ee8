// passes::verify on hand-corrupted IR: each broken invariant is rejected with a message naming the
// graph, node, op and operand.
#include <gtest/gtest.h>

#include "kiln/compiler/passes.h"
#include "kiln/errors.h"
#include "kiln/graph/graph.h"
#include "kiln/graph/ops.h"

using namespace kiln;
using namespace kiln::graph;
using kiln::compiler::passes::verify;

namespace {

TensorType F32(Shape shape) { return TensorType{DType::f32, std::move(shape), DeviceRef::CPU()}; }

// mlp(x: f32[batch, 4]) = relu(x @ w1 + b1): nodes 0 weight w1, 1 weight b1, 2 matmul, 3 add, 4 relu.
Module mlp_module() {
  Module m;
  Graph g("mlp", {F32({"batch", 4})}, &m);
  TensorValue w1 = g.weight({"w1", DType::f32, {4, 8}, DeviceRef::CPU()});
  TensorValue b1 = g.weight({"b1", DType::f32, {8}, DeviceRef::CPU()});
  g.output({ops::relu(ops::add(ops::matmul(g.input(0), w1), b1))});
  return m;
}

std::string verify_message(const Module& m) {
  try {
    verify(m);
  } catch (const VerifyError& e) {
    return e.what();
  }
  ADD_FAILURE() << "verify accepted a broken module";
  return "";
}

void expect_contains(const std::string& text, std::initializer_list<std::string> needles) {
  for (const auto& n : needles) EXPECT_NE(text.find(n), std::string::npos) << "'" << n << "' not in: " << text;
}

}  // namespace

TEST(Verify, AcceptsAValidModuleWithCalls) {
  Module m = mlp_module();
  Graph main("main", {F32({"batch", 4})}, &m);
  auto r = ops::call("mlp", {main.input(0)});
  main.output(r);
  EXPECT_NO_THROW(verify(m));
  ASSERT_EQ(main.ir().value_types.size(), 2u);
  EXPECT_EQ(main.ir().type(1), Type(F32({"batch", 8})));
}

TEST(Verify, RejectsAResultTypeThatInferenceDoesNotGive) {
  Module m = mlp_module();
  GraphIR& g = m.at("mlp");
  ValueId sum = g.nodes[3].outputs[0];
  g.value_types[static_cast<size_t>(sum)] = F32({"batch", 9});
  EXPECT_EQ(verify_message(m),
            "verify: graph 'mlp' node 3 (add): result 0 (%" + std::to_string(sum) +
                ") has type f32[batch, 9] but its operands give f32[batch, 8]");
}

TEST(Verify, RejectsOperandsWhoseTypesDoNotFitTheOp) {
  Module m = mlp_module();
  GraphIR& g = m.at("mlp");
  // b1 now claims f32[4]: the add at node 3 sees f32[batch, 8] + f32[4].
  g.weights[1].shape = {4};
  g.nodes[1].attrs["shape"] = Shape{4};
  g.value_types[static_cast<size_t>(g.nodes[1].outputs[0])] = F32({4});
  expect_contains(verify_message(m), {"verify: graph 'mlp' node 3 (add)", "rhs f32[4]",
                                      "lhs f32[batch, 8]"});
}

TEST(Verify, RejectsUseBeforeDefinition) {
  Module m = mlp_module();
  GraphIR& g = m.at("mlp");
  std::swap(g.nodes[2], g.nodes[3]);  // the add now comes before the matmul that feeds it
  ValueId product = g.nodes[3].outputs[0];
  EXPECT_EQ(verify_message(m), "verify: graph 'mlp' node 2 (add): operand 0 (%" +
                                   std::to_string(product) + ") is used before it is defined");
}

TEST(Verify, RejectsAnOperandThatDoesNotExist) {
  Module m = mlp_module();
  m.at("mlp").nodes[4].inputs[0] = 42;
  expect_contains(verify_message(m), {"graph 'mlp' node 4 (relu)", "operand 0 is %42", "does not exist"});
}

TEST(Verify, RejectsAMissingOutput) {
  Module m = mlp_module();
  m.at("mlp").outputs.clear();
  expect_contains(verify_message(m), {"graph 'mlp'", "no outputs"});

  Module dangling = mlp_module();
  dangling.at("mlp").outputs = {77};
  expect_contains(verify_message(dangling), {"graph 'mlp'", "output 0 is %77"});
}

TEST(Verify, AGraphThatOnlyWritesABufferNeedsNoOutputs) {
  Module m;
  Graph g("store", {BufferType{DType::f32, {4}, DeviceRef::CPU()}, F32({4})}, &m);
  ops::buffer_store(g.input(0), g.input(1));
  g.output({});
  EXPECT_NO_THROW(verify(m));
}

TEST(Verify, RejectsABadCallTarget) {
  Module m = mlp_module();
  Graph main("main", {F32({"batch", 4})}, &m);
  main.output(ops::call("mlp", {main.input(0)}));
  m.at("main").nodes[0].attrs["callee"] = std::string("missing");
  expect_contains(verify_message(m), {"graph 'main' node 0 (call)", "'missing'"});
}

TEST(Verify, RejectsCallArgumentsOfTheWrongType) {
  Module m = mlp_module();
  Graph main("main", {F32({"batch", 4})}, &m);
  main.output(ops::call("mlp", {main.input(0)}));
  m.at("main").value_types[0] = F32({2, 5});
  expect_contains(verify_message(m), {"graph 'main' node 0 (call)", "argument 0", "f32[2, 5]",
                                      "f32[batch, 4]"});
}

TEST(Verify, RejectsCallCycles) {
  Module m;
  Graph f("f", {F32({4})}, &m);
  f.output({ops::exp(f.input(0))});
  Graph g("g", {F32({4})}, &m);
  g.output(ops::call("f", {g.input(0)}));
  // Close the loop behind the builder's back: f now calls g.
  add_node(f.ir(), &m, Op::call, {f.input(0)}, {{"callee", std::string("g")}});
  expect_contains(verify_message(m), {"call cycle f -> g -> f"});

  Module self;
  Graph h("h", {F32({4})}, &self);
  h.output({h.input(0)});
  add_node(h.ir(), &self, Op::call, {h.input(0)}, {{"callee", std::string("h")}});
  expect_contains(verify_message(self), {"call cycle h -> h"});
}

TEST(Verify, RejectsWeightNodesThatDisagreeWithTheDeclarations) {
  Module undeclared = mlp_module();
  undeclared.at("mlp").weights.erase(undeclared.at("mlp").weights.begin());
  expect_contains(verify_message(undeclared), {"graph 'mlp' node 0 (weight)", "'w1'", "not declared"});

  Module retyped = mlp_module();
  retyped.at("mlp").weights[0].dtype = DType::f16;
  expect_contains(verify_message(retyped),
                  {"graph 'mlp' node 0 (weight)", "'w1'", "f32[4, 8]", "f16[4, 8]"});

  Module twice = mlp_module();
  twice.at("mlp").weights.push_back(twice.at("mlp").weights[0]);
  expect_contains(verify_message(twice), {"graph 'mlp'", "'w1'", "twice"});
}

TEST(Verify, RejectsAValueDefinedTwice) {
  Module m = mlp_module();
  GraphIR& g = m.at("mlp");
  g.nodes[4].outputs[0] = g.nodes[3].outputs[0];
  expect_contains(verify_message(m), {"node 4 (relu)", "already defined"});
}

TEST(Verify, ChecksEveryGraphOfTheModule) {
  Module m = mlp_module();
  Graph other("other", {F32({3})}, &m);
  other.output({ops::sqrt(other.input(0))});
  m.at("other").nodes[0].op = Op::logical_not;  // f32 is not a valid logical_not operand
  expect_contains(verify_message(m), {"graph 'other' node 0 (logical_not)", "f32[3]"});
}
