// Model::execute input checks, kernel errors, weight binding at init, and the session's entry points.
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "test_util.h"

#include "kiln/kiln.h"

namespace {

using namespace kiln;
using kiln::testing::error_message;
using kiln::testing::expect_error;
namespace ops = kiln::graph::ops;
using graph::BufferType;
using graph::TensorType;

// add(x, y) over f32[batch, 4] inputs.
engine::Model add_model(engine::InferenceSession& session) {
  graph::Graph g("adder", {TensorType{DType::f32, {"batch", 4}}, TensorType{DType::f32, {"batch", 4}}});
  g.output({ops::add(g.input(0), g.input(1))});
  return session.load(g);
}

Tensor iota(int64_t rows, int64_t cols, float start = 0) {
  std::vector<float> v(static_cast<size_t>(rows * cols));
  for (size_t i = 0; i < v.size(); ++i) v[i] = start + static_cast<float>(i);
  return Tensor::from_vector(v, {rows, cols});
}

// ---- input checks ------------------------------------------------------------------------------

TEST(ExecuteChecks, InputCountIsChecked) {
  engine::InferenceSession session;
  auto model = add_model(session);
  expect_error<ValueError>([&] { model.execute({iota(2, 4)}); },
                           {"execute: graph 'adder' takes 2 inputs, got 1"});
}

TEST(ExecuteChecks, InputDTypeIsChecked) {
  engine::InferenceSession session;
  auto model = add_model(session);
  auto ints = Tensor::from_vector<int32_t>({1, 2, 3, 4, 5, 6, 7, 8}, {2, 4});
  expect_error<ValueError>([&] { model.execute({iota(2, 4), ints}); },
                           {"input 1", "dtype i32", "expected f32"});
}

TEST(ExecuteChecks, InputRankIsChecked) {
  engine::InferenceSession session;
  auto model = add_model(session);
  auto flat = Tensor::from_vector<float>({1, 2, 3, 4}, {4});
  expect_error<ValueError>([&] { model.execute({flat, iota(2, 4)}); },
                           {"input 0", "rank 1", "expected rank 2"});
}

TEST(ExecuteChecks, InputDeviceIsChecked) {
  engine::InferenceSession session;
  auto model = add_model(session);
  auto elsewhere = Tensor::zeros(DType::f32, {2, 4}, DeviceRef::CPU(1));
  expect_error<ValueError>([&] { model.execute({iota(2, 4), elsewhere}); },
                           {"input 1", "cpu:1", "expected cpu:0"});
}

TEST(ExecuteChecks, StaticDimIsChecked) {
  engine::InferenceSession session;
  auto model = add_model(session);
  expect_error<ValueError>([&] { model.execute({iota(2, 4), iota(2, 5)}); },
                           {"input 1 dim 1 is 5, expected 4"});
}

TEST(ExecuteChecks, SymbolBoundInconsistentlyNamesBothInputs) {
  engine::InferenceSession session;
  auto model = add_model(session);
  expect_error<ValueError>(
      [&] { model.execute({iota(2, 4), iota(3, 4)}); },
      {"execute: input 1 dim 0 is 3 but symbol 'batch' was bound to 2 by input 0 dim 0"});
}

TEST(ExecuteChecks, AlgebraicInputDimIsCheckedAfterBinding) {
  engine::InferenceSession session;
  graph::Graph g("shifted", {TensorType{DType::f32, {graph::Dim("seq") + 1}}, TensorType{DType::f32, {"seq"}}});
  g.output({ops::sum(g.input(0)), ops::sum(g.input(1))});
  auto model = session.load(g);
  auto four = Tensor::from_vector<float>({1, 2, 3, 4}, {4});
  auto three = Tensor::from_vector<float>({1, 2, 3}, {3});
  auto out = model.execute({four, three});
  EXPECT_EQ(out[0].to_vector<float>(), std::vector<float>{10});
  EXPECT_EQ(out[1].to_vector<float>(), std::vector<float>{6});
  expect_error<ValueError>([&] { model.execute({three, three}); },
                           {"input 0 dim 0 is 3, expected seq + 1 = 4"});
}

TEST(ExecuteChecks, UndefinedInputIsAnError) {
  engine::InferenceSession session;
  auto model = add_model(session);
  expect_error<ValueError>([&] { model.execute({iota(2, 4), Tensor()}); }, {"input 1", "undefined"});
}

TEST(ExecuteChecks, NonContiguousBufferIsRejected) {
  engine::InferenceSession session;
  graph::Graph g("cache", {BufferType{DType::f32, {3, 2}}});
  g.output({ops::buffer_load(g.input(0))});
  auto model = session.load(g);
  std::vector<float> storage(6, 1.f);
  // A [3, 2] view of a [2, 3] array: transposed, so not contiguous.
  auto transposed = Tensor::borrow(storage.data(), DType::f32, {3, 2}, {1, 3});
  expect_error<ValueError>([&] { model.execute({transposed}); },
                           {"input 0 is a buffer", "contiguous", "strides [1, 3]"});
}

TEST(ExecuteChecks, NonContiguousTensorInputGivesTheSameResultAsItsCopy) {
  engine::InferenceSession session;
  graph::Graph g("scale", {TensorType{DType::f32, {3, 2}}, TensorType{DType::f32, {2}}});
  g.output({ops::mul(g.input(0), g.input(1))});
  auto model = session.load(g);
  // storage is [[0, 1, 2], [3, 4, 5]]; its transpose is [[0, 3], [1, 4], [2, 5]].
  std::vector<float> storage{0, 1, 2, 3, 4, 5};
  auto transposed = Tensor::borrow(storage.data(), DType::f32, {3, 2}, {1, 3});
  ASSERT_FALSE(transposed.is_contiguous());
  auto scale = Tensor::from_vector<float>({10, 100}, {2});
  auto from_view = model.execute({transposed, scale})[0].to_vector<float>();
  auto from_copy = model.execute({transposed.contiguous(), scale})[0].to_vector<float>();
  EXPECT_EQ(from_view, (std::vector<float>{0, 300, 10, 400, 20, 500}));
  EXPECT_EQ(from_view, from_copy);
}

TEST(ExecuteChecks, OutputThatIsAnInputIsACopy) {
  engine::InferenceSession session;
  graph::Graph g("identity", {TensorType{DType::f32, {2, 4}}});
  g.output({g.input(0), g.input(0)});
  auto model = session.load(g);
  auto x = iota(2, 4);
  auto out = model.execute({x});
  ASSERT_EQ(out.size(), 2u);
  EXPECT_NE(out[0].data(), x.data());
  EXPECT_NE(out[1].data(), x.data());
  EXPECT_NE(out[0].data(), out[1].data());
  EXPECT_EQ(out[0].to_vector<float>(), x.to_vector<float>());
  EXPECT_EQ(out[1].to_vector<float>(), x.to_vector<float>());
}

TEST(ExecuteChecks, ConstantAndWeightOutputsAreFreshCopies) {
  // Mutating a returned tensor must not change what the model returns next time.
  engine::InferenceSession session;
  graph::Graph g("state", {TensorType{DType::f32, {2}}});
  {
    graph::Graph::Scope scope(g);
    auto folded = ops::add(ops::constant(std::vector<float>{1, 2}, {2}), ops::constant(std::vector<float>{10, 20}, {2}));
    g.output({folded, g.weight({"w", DType::f32, {2}}), ops::add(g.input(0), folded)});
  }
  auto weight = Tensor::from_vector<float>({7, 8}, {2});
  auto model = session.load(g, {{"w", weight}});
  auto x = Tensor::from_vector<float>({100, 200}, {2});
  for (int run = 0; run < 2; ++run) {
    auto out = model.execute({x});
    EXPECT_EQ(out[0].to_vector<float>(), (std::vector<float>{11, 22}));
    EXPECT_EQ(out[1].to_vector<float>(), (std::vector<float>{7, 8}));
    EXPECT_EQ(out[2].to_vector<float>(), (std::vector<float>{111, 222}));
    EXPECT_NE(out[1].data(), weight.data());
    for (auto& t : out) t.data_as<float>()[0] = -1;
  }
  EXPECT_EQ(weight.to_vector<float>(), (std::vector<float>{7, 8}));
}

TEST(ExecuteChecks, SymbolNoInputBindsIsNamed) {
  engine::InferenceSession session;
  graph::Graph g("unbound", {TensorType{DType::f32, {"n"}}});
  {
    graph::Graph::Scope scope(g);
    g.output({ops::range(0, 1, graph::Dim("m"), DType::i32)});
  }
  auto model = session.load(g);
  expect_error<ValueError>([&] { model.execute({Tensor::zeros(DType::f32, {3})}); }, {"graph 'unbound'", "m"});
}

TEST(ExecuteChecks, ScalarAndEmptyInputsRun) {
  engine::InferenceSession session;
  graph::Graph g("scaled", {TensorType{DType::f32, {}}, TensorType{DType::f32, {"n", 2}}});
  g.output({ops::mul(ops::exp(g.input(1)), g.input(0))});
  auto model = session.load(g);
  auto empty = model.execute({Tensor::scalar<float>(2), Tensor::zeros(DType::f32, {0, 2})});
  EXPECT_EQ(empty[0].shape(), (std::vector<int64_t>{0, 2}));
  auto full = model.execute({Tensor::scalar<float>(2), Tensor::zeros(DType::f32, {1, 2})});
  EXPECT_EQ(full[0].to_vector<float>(), (std::vector<float>{2, 2}));
}

// ---- kernel errors ----------------------------------------------------------------------------

TEST(ExecuteChecks, KernelErrorNamesTheOpAndNode) {
  engine::InferenceSession session;
  graph::Graph g("ratio", {TensorType{DType::i32, {3}}, TensorType{DType::i32, {3}}});
  {
    graph::Graph::Scope scope(g);
    auto shifted = ops::add(g.input(0), ops::constant(std::vector<int32_t>{1, 1, 1}, {3}));
    g.output({ops::div(shifted, g.input(1))});
  }
  auto model = session.load(g);
  auto x = Tensor::from_vector<int32_t>({5, 7, 9}, {3});
  EXPECT_EQ(model.execute({x, Tensor::from_vector<int32_t>({2, 4, -5}, {3})})[0].to_vector<int32_t>(),
            (std::vector<int32_t>{3, 2, -2}));
  expect_error<ExecutionError>(
      [&] { model.execute({x, Tensor::from_vector<int32_t>({2, 0, 1}, {3})}); },
      {"execute: graph 'ratio' op 'div' (node "});
}

// ---- weights ------------------------------------------------------------------------------------

// y = x @ w over f32[2, 3] x f32[3, 2] weight "w".
graph::Module matmul_module() {
  graph::Module module;
  graph::Graph g("proj", {TensorType{DType::f32, {2, 3}}}, &module);
  g.output({ops::matmul(g.input(0), g.weight({"w", DType::f32, {3, 2}}))});
  return module;
}

TEST(WeightBinding, MissingWeightIsNamed) {
  engine::InferenceSession session;
  auto compiled = session.compile(matmul_module());
  expect_error<ValueError>([&] { session.init(compiled, {{"v", Tensor::zeros(DType::f32, {3, 2})}}); },
                           {"weight 'w'", "f32[3, 2]"});
}

TEST(WeightBinding, WrongDTypeIsNamed) {
  engine::InferenceSession session;
  auto compiled = session.compile(matmul_module());
  expect_error<ValueError>([&] { session.init(compiled, {{"w", Tensor::zeros(DType::f16, {3, 2})}}); },
                           {"init: weight 'w' has dtype f16, expected f32"});
}

TEST(WeightBinding, WrongShapeIsNamed) {
  engine::InferenceSession session;
  auto compiled = session.compile(matmul_module());
  expect_error<ValueError>([&] { session.init(compiled, {{"w", Tensor::zeros(DType::f32, {2, 3})}}); },
                           {"init: weight 'w' has shape [2, 3], expected [3, 2]"});
}

TEST(WeightBinding, NonContiguousWeightIsNamed) {
  engine::InferenceSession session;
  auto compiled = session.compile(matmul_module());
  std::vector<float> storage(6);
  auto transposed = Tensor::borrow(storage.data(), DType::f32, {3, 2}, {1, 3});
  expect_error<ValueError>([&] { session.init(compiled, {{"w", transposed}}); },
                           {"init: weight 'w' is not contiguous"});
}

TEST(WeightBinding, ExtraRegistryEntriesAreAllowed) {
  engine::InferenceSession session;
  auto models = session.init(session.compile(matmul_module()),
                             {{"w", Tensor::zeros(DType::f32, {3, 2})}, {"unused", Tensor::zeros(DType::i8, {1})}});
  EXPECT_EQ(models.count("proj"), 1u);
}

TEST(WeightBinding, OneCompiledModelInitialisedTwiceUsesEachRegistry) {
  engine::InferenceSession session;
  auto compiled = session.compile(matmul_module());
  auto identity_like = Tensor::from_vector<float>({1, 0, 0, 1, 0, 0}, {3, 2});   // picks columns 0, 1
  auto sums = Tensor::from_vector<float>({1, 1, 1, 1, 1, 1}, {3, 2});            // row sums twice
  auto first = session.init(compiled, {{"w", identity_like}}).at("proj");
  auto second = session.init(compiled, {{"w", sums}}).at("proj");
  auto x = Tensor::from_vector<float>({1, 2, 3, 4, 5, 6}, {2, 3});
  EXPECT_EQ(first.execute({x})[0].to_vector<float>(), (std::vector<float>{1, 2, 4, 5}));
  EXPECT_EQ(second.execute({x})[0].to_vector<float>(), (std::vector<float>{6, 6, 15, 15}));
  EXPECT_EQ(session.compile_count(), 1);
}

// ---- session entry points ------------------------------------------------------------------------

graph::Module two_graph_module() {
  graph::Module module;
  graph::Graph twice("twice", {TensorType{DType::i64, {"n"}}}, &module);
  twice.output({ops::add(twice.input(0), twice.input(0))});
  graph::Graph square("square", {TensorType{DType::i64, {"n"}}}, &module);
  square.output({ops::mul(square.input(0), square.input(0))});
  return module;
}

TEST(Session, LoadOfATwoGraphModuleIsAValueError) {
  engine::InferenceSession session;
  expect_error<ValueError>([&] { session.load(two_graph_module()); }, {"2 graphs", "exactly one"});
}

TEST(Session, LoadAllReturnsEveryGraph) {
  engine::InferenceSession session;
  auto models = session.load_all(two_graph_module());
  ASSERT_EQ(models.size(), 2u);
  auto x = Tensor::from_vector<int64_t>({1, 2, -3}, {3});
  EXPECT_EQ(models.at("twice").execute({x})[0].to_vector<int64_t>(), (std::vector<int64_t>{2, 4, -6}));
  EXPECT_EQ(models.at("square").execute({x})[0].to_vector<int64_t>(), (std::vector<int64_t>{1, 4, 9}));
  EXPECT_EQ(models.at("square").name(), "square");
}

TEST(Session, CompileCountIncrementsOncePerCompile) {
  engine::InferenceSession session;
  EXPECT_EQ(session.compile_count(), 0);
  session.load_all(two_graph_module());
  EXPECT_EQ(session.compile_count(), 1);
  auto compiled = session.compile(matmul_module());
  session.init(compiled, {{"w", Tensor::zeros(DType::f32, {3, 2})}});
  session.init(compiled, {{"w", Tensor::zeros(DType::f32, {3, 2})}});
  EXPECT_EQ(session.compile_count(), 2);
}

TEST(Session, RejectsNoDevicesGpuDevicesAndMissingExtensions) {
  expect_error<ValueError>([] { engine::InferenceSession s(std::vector<DeviceRef>{}); }, {"at least one device"});
  expect_error<ValueError>([] { engine::InferenceSession s({DeviceRef::GPU(0)}); }, {"gpu:0"});
  expect_error<ExtensionError>([] { engine::InferenceSession s({DeviceRef::CPU()}, {"libops.so"}); },
                               {"'libops.so'", "no such file"});
}

TEST(Session, DefaultModelIsAnErrorNotACrash) {
  engine::Model model;
  expect_error<ValueError>([&] { model.execute({}); }, {"not initialised"});
}

}  // namespace
