// Module, Graph, Value and the operators: the builder API of the graph IR.
#include <gtest/gtest.h>

#include "test_util.h"

#include <cstring>
#include <thread>

#include "kiln/errors.h"
#include "kiln/graph/graph.h"
#include "kiln/graph/ops.h"

using namespace kiln;
using kiln::testing::error_message;
using kiln::testing::expect_error;
using namespace kiln::graph;

namespace {

TensorType F32(Shape shape) { return TensorType{DType::f32, std::move(shape), DeviceRef::CPU()}; }

bool contains(const std::string& text, const std::string& needle) {
  return text.find(needle) != std::string::npos;
}

}  // namespace

TEST(Module, GraphNamesAreUniqueAndKeepInsertionOrder) {
  Module m;
  m.add_graph("b", {});
  m.add_graph("a", {F32({2})});
  EXPECT_EQ(m.graph_names(), (std::vector<std::string>{"b", "a"}));
  std::string msg = error_message<ValueError>([&] { m.add_graph("a", {}); });
  EXPECT_TRUE(contains(msg, "'a'")) << msg;
  EXPECT_EQ(m.size(), 2u);
  EXPECT_EQ(m.at("a").num_inputs(), 1);
  EXPECT_EQ(m.find("zzz"), nullptr);
  msg = error_message<ValueError>([&] { m.at("zzz"); });
  EXPECT_TRUE(contains(msg, "'zzz'")) << msg;
}

TEST(Module, CopyIsDeepAndIndependent) {
  Module m;
  Graph g("g", {F32({4})}, &m);
  g.output({ops::exp(g.input(0))});

  Module copy = m;
  EXPECT_NE(&copy.at("g"), &m.at("g"));
  copy.at("g").nodes.clear();
  copy.at("g").name = "renamed";
  EXPECT_EQ(m.at("g").nodes.size(), 1u);
  EXPECT_EQ(m.at("g").nodes[0].op, Op::exp);
  EXPECT_NE(m.find("g"), nullptr);

  Module assigned;
  assigned = m;
  m.at("g").nodes.clear();
  EXPECT_EQ(assigned.at("g").nodes.size(), 1u);
}

TEST(Graph, AddsItselfToTheGivenModuleOrItsOwn) {
  Module m;
  Graph a("a", {F32({"batch", 3})}, &m);
  Graph b("b", {}, &m);
  EXPECT_EQ(&a.module(), &m);
  EXPECT_EQ(m.graph_names(), (std::vector<std::string>{"a", "b"}));
  EXPECT_EQ(&m.at("a"), &a.ir());
  EXPECT_THROW(Graph("a", {}, &m), ValueError);

  Graph alone("alone", {F32({1})});
  EXPECT_EQ(alone.module().size(), 1u);
  EXPECT_EQ(alone.module().graph_names(), (std::vector<std::string>{"alone"}));
}

TEST(Graph, InputsHaveTheDeclaredTypes) {
  BufferType cache{DType::f16, {16, 64}, DeviceRef::CPU()};
  Graph g("g", {F32({"batch", 3}), cache});
  auto inputs = g.inputs();
  ASSERT_EQ(inputs.size(), 2u);
  EXPECT_EQ(inputs[0].id(), 0);
  EXPECT_EQ(inputs[1].id(), 1);
  EXPECT_EQ(inputs[0].tensor_type(), F32({"batch", 3}));
  EXPECT_TRUE(inputs[1].is_buffer());
  EXPECT_EQ(inputs[1].buffer_type(), cache);
  EXPECT_EQ(inputs[1].dtype(), DType::f16);
  EXPECT_EQ(inputs[0].rank(), 2);
  EXPECT_THROW(inputs[1].tensor_type(), ValueError);
  EXPECT_THROW(BufferValue{inputs[0]}, ValueError);
}

TEST(Graph, InputOutOfRangeNamesIndexAndCount) {
  Graph g("g", {F32({1}), F32({2})});
  std::string msg = error_message<ValueError>([&] { g.input(2); });
  EXPECT_TRUE(contains(msg, "2") && contains(msg, "2 inputs")) << msg;
  msg = error_message<ValueError>([&] { g.input(-1); });
  EXPECT_TRUE(contains(msg, "-1")) << msg;
}

TEST(Graph, WeightsAreDeclaredOnceAndReused) {
  Graph g("g", {});
  Weight w{"w1", DType::f32, {64, 10}, DeviceRef::CPU()};
  TensorValue a = g.weight(w);
  TensorValue b = g.weight(w);
  EXPECT_EQ(a.id(), b.id());
  EXPECT_EQ(g.ir().weights, std::vector<Weight>{w});
  ASSERT_EQ(g.ir().nodes.size(), 1u);
  const Node& n = g.ir().nodes[0];
  EXPECT_EQ(n.op, Op::weight);
  EXPECT_EQ(std::get<std::string>(n.attrs.at("name")), "w1");
  EXPECT_EQ(std::get<DType>(n.attrs.at("dtype")), DType::f32);
  EXPECT_EQ(std::get<Shape>(n.attrs.at("shape")), (Shape{64, 10}));
  EXPECT_EQ(std::get<DeviceRef>(n.attrs.at("device")), DeviceRef::CPU());
  EXPECT_EQ(a.type(), Type(F32({64, 10})));

  g.weight({"w2", DType::f16, {3}, DeviceRef::CPU()});
  EXPECT_EQ(g.ir().weights.size(), 2u);
  EXPECT_EQ(g.ir().find_weight("w2")->dtype, DType::f16);
}

TEST(Graph, WeightWithConflictingTypeNamesBothTypes) {
  Graph g("g", {});
  g.weight({"w", DType::f32, {4}, DeviceRef::CPU()});
  std::string msg = error_message<ValueError>([&] { g.weight({"w", DType::f16, {4}, DeviceRef::CPU()}); });
  EXPECT_TRUE(contains(msg, "'w'") && contains(msg, "f32[4]") && contains(msg, "f16[4]")) << msg;
  msg = error_message<ValueError>([&] { g.weight({"w", DType::f32, {4}, DeviceRef::GPU()}); });
  EXPECT_TRUE(contains(msg, "f32[4]@gpu:0")) << msg;
  EXPECT_EQ(g.ir().weights.size(), 1u);
  EXPECT_EQ(g.ir().nodes.size(), 1u);
}

TEST(Graph, ScopesNestAndRestore) {
  EXPECT_THROW(Graph::current(), ValueError);
  Module m;
  Graph outer("outer", {}, &m);
  Graph inner("inner", {}, &m);
  {
    Graph::Scope s1(outer);
    EXPECT_EQ(&Graph::current(), &outer);
    {
      Graph::Scope s2(inner);
      EXPECT_EQ(&Graph::current(), &inner);
      ops::constant(1.0, DType::f32);
    }
    EXPECT_EQ(&Graph::current(), &outer);
    ops::constant(2.0, DType::f32);
    ops::constant(3.0, DType::f32);
  }
  EXPECT_THROW(Graph::current(), ValueError);
  EXPECT_EQ(inner.ir().nodes.size(), 1u);
  EXPECT_EQ(outer.ir().nodes.size(), 2u);
}

TEST(Graph, ScopeIsPerThread) {
  Graph g("g", {});
  Graph::Scope s(g);
  bool other_thread_has_none = false;
  std::thread t([&] {
    try {
      Graph::current();
    } catch (const ValueError&) {
      other_thread_has_none = true;
    }
  });
  t.join();
  EXPECT_TRUE(other_thread_has_none);
}

TEST(Graph, OperatorsBuildTheMatchingOps) {
  Graph g("g", {F32({"batch", 4}), F32({4})});
  TensorValue x = g.input(0);
  TensorValue y = g.input(1);
  auto last_op = [&] { return g.ir().nodes.back().op; };
  auto last_inputs = [&] { return g.ir().nodes.back().inputs; };

  TensorValue r = x + y;
  EXPECT_EQ(last_op(), Op::add);
  EXPECT_EQ(last_inputs(), (std::vector<ValueId>{0, 1}));
  EXPECT_EQ(r.shape(), (Shape{"batch", 4}));
  x - y;
  EXPECT_EQ(last_op(), Op::sub);
  x * y;
  EXPECT_EQ(last_op(), Op::mul);
  x / y;
  EXPECT_EQ(last_op(), Op::div);
  -x;
  EXPECT_EQ(last_op(), Op::neg);
  EXPECT_EQ(last_inputs(), (std::vector<ValueId>{0}));
}

TEST(Graph, ScalarOperatorsMakeRankZeroConstantsOfTheValuesType) {
  TensorType half_gpu{DType::f16, {"n"}, DeviceRef::GPU(1)};
  Graph g("g", {half_gpu});
  TensorValue x = g.input(0);

  TensorValue r = 2.0 - x;  // the scalar is the left operand
  const auto& nodes = g.ir().nodes;
  ASSERT_EQ(nodes.size(), 2u);
  EXPECT_EQ(nodes[0].op, Op::constant);
  EXPECT_EQ(g.ir().type(nodes[0].outputs[0]), Type(TensorType{DType::f16, {}, DeviceRef::GPU(1)}));
  // 2.0 in IEEE half is 0x4000.
  EXPECT_EQ(std::get<Bytes>(nodes[0].attrs.at("value")), (Bytes{0x00, 0x40}));
  EXPECT_EQ(nodes[1].op, Op::sub);
  EXPECT_EQ(nodes[1].inputs, (std::vector<ValueId>{nodes[0].outputs[0], 0}));
  EXPECT_EQ(r.type(), Type(half_gpu));

  x * 3.0;
  EXPECT_EQ(g.ir().nodes.back().op, Op::mul);
  EXPECT_EQ(g.ir().nodes.back().inputs[0], 0);
  x + 1.0;
  EXPECT_EQ(g.ir().nodes.back().op, Op::add);
  1.0 / x;
  EXPECT_EQ(g.ir().nodes.back().op, Op::div);
}

TEST(Graph, ScalarOperatorOnIntegerTensorKeepsItsDType) {
  Graph g("g", {TensorType{DType::i64, {3}, DeviceRef::CPU()}});
  TensorValue r = g.input(0) * 2.0;
  EXPECT_EQ(r.dtype(), DType::i64);
  int64_t v = 0;
  const Bytes& bytes = std::get<Bytes>(g.ir().nodes[0].attrs.at("value"));
  ASSERT_EQ(bytes.size(), 8u);
  std::memcpy(&v, bytes.data(), 8);
  EXPECT_EQ(v, 2);
}

TEST(Graph, OutputIsSetOnceAndVerified) {
  Graph g("g", {F32({2})});
  TensorValue y = ops::exp(g.input(0));
  g.output({y});
  EXPECT_TRUE(g.has_output());
  EXPECT_EQ(g.ir().outputs, std::vector<ValueId>{y.id()});
  EXPECT_EQ(g.ir().output_types(), std::vector<Type>{F32({2})});
  std::string msg = error_message<ValueError>([&] { g.output({y}); });
  EXPECT_TRUE(contains(msg, "'g'") && contains(msg, "already")) << msg;
}

TEST(Graph, OutputMustBelongToTheGraph) {
  Module m;
  Graph a("a", {F32({2})}, &m);
  Graph b("b", {F32({2})}, &m);
  std::string msg = error_message<ValueError>([&] { a.output({a.input(0), b.input(0)}); });
  EXPECT_TRUE(contains(msg, "output 1") && contains(msg, "'b'")) << msg;
  EXPECT_FALSE(a.has_output());
  EXPECT_THROW(a.output({Value()}), ValueError);
}

TEST(Graph, OutputRunsTheVerifier) {
  Graph g("g", {F32({2})});
  TensorValue y = ops::exp(g.input(0));
  // Corrupt the recorded type behind the builder's back: output() must notice.
  g.ir().value_types[static_cast<size_t>(y.id())] = F32({3});
  std::string msg = error_message<VerifyError>([&] { g.output({y}); });
  EXPECT_TRUE(contains(msg, "'g'") && contains(msg, "exp") && contains(msg, "f32[3]") &&
              contains(msg, "f32[2]"))
      << msg;
}

TEST(Graph, VerifyEachOpCatchesCorruptionAtTheNextOp) {
  Graph g("g", {F32({2})}, nullptr, GraphOptions{.verify_each_op = true});
  Graph::Scope scope(g);
  TensorValue y = ops::exp(g.input(0));
  g.ir().value_types[static_cast<size_t>(y.id())] = F32({3});
  EXPECT_THROW(ops::constant(1.0, DType::f32), VerifyError);
}

TEST(Graph, EmptyValuesAreRejectedByName) {
  Graph g("g", {F32({2})});
  std::string msg = error_message<ValueError>([&] { ops::add(g.input(0), TensorValue()); });
  EXPECT_TRUE(contains(msg, "add") && contains(msg, "operand 1")) << msg;
  EXPECT_THROW(Value().type(), ValueError);
}

TEST(GraphIR, InputAndOutputTypesAndWeightLookup) {
  Graph g("g", {F32({"b"}), F32({1})});
  TensorValue w = g.weight({"scale", DType::f32, {1}, DeviceRef::CPU()});
  TensorValue s = ops::mul(g.input(0), w);
  g.output({s, g.input(1)});
  EXPECT_EQ(g.ir().input_types(), (std::vector<Type>{F32({"b"}), F32({1})}));
  EXPECT_EQ(g.ir().output_types(), (std::vector<Type>{F32({"b"}), F32({1})}));
  ASSERT_NE(g.ir().find_weight("scale"), nullptr);
  EXPECT_EQ(g.ir().find_weight("scale")->shape, (Shape{1}));
  EXPECT_EQ(g.ir().find_weight("other"), nullptr);
}

TEST(Graph, ToStringPrintsTheGraphsText) {
  Graph g("mlp", {F32({"batch", 4})});
  TensorValue w = g.weight({"w1", DType::f32, {4, 2}, DeviceRef::CPU()});
  g.output({ops::matmul(g.input(0), w)});
  std::string text = g.to_string();
  EXPECT_TRUE(contains(text, "@mlp") && contains(text, "matmul") && contains(text, "\"w1\"")) << text;
}
