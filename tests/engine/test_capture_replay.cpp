// Capture and replay (Model::capture/replay/release) and device graphs (init with device_graphs):
// both rerun a recorded launch list, and must give what execute() gives.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "kiln/kiln.h"
#include "test_util.h"

namespace {

using namespace kiln;
using engine::InferenceSession;
using graph::BufferType;
using graph::TensorType;
using kiln::testing::expect_error;
namespace ops = kiln::graph::ops;

// y = reshape(relu(x @ w) * 2, [batch * 2]): a weight, a slot, and a symbolic shape attribute.
graph::Module proj_module(graph::Shape x_shape = {"batch", 3}) {
  graph::Graph g("proj", {TensorType{DType::f32, x_shape}});
  graph::Graph::Scope scope(g);
  auto w = g.weight({"w", DType::f32, {3, 2}});
  auto h = ops::mul(ops::relu(ops::matmul(g.input(0), w)), ops::constant(2.0, DType::f32));
  g.output({ops::reshape(h, graph::Shape{graph::shape_of(g.input(0).type())[0] * 2}), g.input(0)});
  return g.module();
}

const WeightsRegistry kWeights = {{"w", Tensor::from_vector<float>({1, -1, 2, 0, -1, 3}, {3, 2})}};

// The reference: relu(x @ w) * 2, flattened, by a naive loop.
std::vector<float> reference(const std::vector<float>& x, int64_t batch) {
  const std::vector<float> w = {1, -1, 2, 0, -1, 3};  // [3, 2]
  std::vector<float> out;
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t n = 0; n < 2; ++n) {
      float acc = 0;
      for (int64_t k = 0; k < 3; ++k)
        acc += x[static_cast<size_t>(b * 3 + k)] * w[static_cast<size_t>(k * 2 + n)];
      out.push_back(std::max(acc, 0.f) * 2);
    }
  return out;
}

Tensor batch_of(const std::vector<float>& values) {
  return Tensor::from_vector(values, {static_cast<int64_t>(values.size() / 3), 3});
}

engine::Model proj_model(const InferenceSession& session) {
  return session.init(session.compile(proj_module()), kWeights).at("proj");
}

TEST(CaptureReplay, ReplayEqualsExecuteForNewInputsOfTheCapturedShape) {
  InferenceSession session;
  auto model = proj_model(session);
  const std::vector<float> x1 = {1, 2, 3, -1, 0, 1}, x2 = {0.5f, -2, 4, 3, 3, -3};
  auto captured = model.capture("b2", {batch_of(x1)});
  ASSERT_EQ(captured.size(), 2u);
  EXPECT_EQ(captured[0].to_vector<float>(), reference(x1, 2));
  EXPECT_EQ(captured[1].to_vector<float>(), x1);  // an input returned as an output: a copy

  auto replayed = model.replay("b2", {batch_of(x2)});
  EXPECT_EQ(replayed[0].to_vector<float>(), reference(x2, 2));
  EXPECT_EQ(replayed[1].to_vector<float>(), x2);
  EXPECT_EQ(replayed[0].to_vector<float>(), model.execute({batch_of(x2)})[0].to_vector<float>());
  // Replays return the captured output tensors: the same memory each time, overwritten.
  EXPECT_EQ(replayed[0].data(), captured[0].data());
  EXPECT_EQ(captured[0].to_vector<float>(), reference(x2, 2));
}

TEST(CaptureReplay, ExecuteBetweenReplaysDoesNotDisturbTheCapture) {
  InferenceSession session;
  auto model = proj_model(session);
  const std::vector<float> x1 = {1, 2, 3, -1, 0, 1}, x3 = {1, 1, 1, 2, 2, 2, 3, 3, 3};
  model.capture("b2", {batch_of(x1)});
  EXPECT_EQ(model.execute({batch_of(x3)})[0].to_vector<float>(), reference(x3, 3));
  EXPECT_EQ(model.replay("b2", {batch_of(x1)})[0].to_vector<float>(), reference(x1, 2));
}

TEST(CaptureReplay, TwoCapturesOfDifferentShapesLiveSideBySide) {
  InferenceSession session;
  auto model = proj_model(session);
  const std::vector<float> x1 = {1, 2, 3, -1, 0, 1}, x3 = {1, 1, 1, 2, 2, 2, 3, 3, 3};
  model.capture("b2", {batch_of(x1)});
  model.capture("b3", {batch_of(x3)});
  EXPECT_EQ(model.replay("b3", {batch_of(x3)})[0].to_vector<float>(), reference(x3, 3));
  EXPECT_EQ(model.replay("b2", {batch_of(x1)})[0].to_vector<float>(), reference(x1, 2));
}

TEST(CaptureReplay, ReplayWithAnotherShapeIsAValueError) {
  InferenceSession session;
  auto model = proj_model(session);
  model.capture("b2", {batch_of({1, 2, 3, -1, 0, 1})});
  expect_error<ValueError>(
      [&] {
        model.replay("b2", {batch_of({1, 2, 3})});
      },
      {"replay: graph 'proj' input 0 is f32[1, 3]", "captured with f32[2, 3]"});
  expect_error<ValueError>(
      [&] {
        model.replay("b2", {Tensor::zeros(DType::i32, {2, 3})});
      },
      {"input 0 is i32[2, 3]"});
  expect_error<ValueError>([&] { model.replay("b2", {}); }, "takes 1 inputs, got 0");
}

TEST(CaptureReplay, ReleaseFreesAKeyAndUnknownKeysAreErrors) {
  InferenceSession session;
  auto model = proj_model(session);
  auto x = batch_of({1, 2, 3, -1, 0, 1});
  model.capture("k", {x});
  expect_error<ValueError>([&] { model.capture("k", {x}); }, {"already has a capture 'k'"});
  model.release("k");
  expect_error<ValueError>([&] { model.replay("k", {x}); }, {"graph 'proj' has no capture 'k'"});
  expect_error<ValueError>([&] { model.release("k"); }, {"no capture 'k'"});
  model.capture("k", {x});  // the key is free again
  EXPECT_EQ(model.replay("k", {x})[0].to_vector<float>(), reference({1, 2, 3, -1, 0, 1}, 2));
}

TEST(CaptureReplay, ReplayWritesBufferInputsBackToTheCaller) {
  InferenceSession session;
  graph::Graph g("accumulate", {BufferType{DType::f32, {3}}, TensorType{DType::f32, {3}}});
  auto sum = ops::add(ops::buffer_load(g.input(0)), g.input(1));
  ops::buffer_store(g.input(0), sum);
  g.output({sum});
  auto model = session.load(g);
  auto buffer = Tensor::from_vector<float>({1, 2, 3}, {3});
  model.capture("c", {buffer, Tensor::from_vector<float>({10, 10, 10}, {3})});
  EXPECT_EQ(buffer.to_vector<float>(), (std::vector<float>{11, 12, 13}));
  model.replay("c", {buffer, Tensor::from_vector<float>({1, 1, 1}, {3})});
  EXPECT_EQ(buffer.to_vector<float>(), (std::vector<float>{12, 13, 14}));
}

// ---- device graphs -------------------------------------------------------------------------------

TEST(DeviceGraph, RunsItsLaunchListOnEveryCall) {
  InferenceSession session;
  auto compiled = session.compile(proj_module({2, 3}));
  auto model = session.init(compiled, kWeights, {"proj"}).at("proj");
  EXPECT_TRUE(model.is_device_graph());
  const std::vector<float> x1 = {1, 2, 3, -1, 0, 1}, x2 = {0.5f, -2, 4, 3, 3, -3};
  auto first = model.execute({batch_of(x1)});
  auto second = model.execute({batch_of(x2)});
  EXPECT_EQ(first[0].to_vector<float>(), reference(x1, 2));  // not overwritten by the second call
  EXPECT_EQ(second[0].to_vector<float>(), reference(x2, 2));
  EXPECT_EQ(second[1].to_vector<float>(), x2);
  EXPECT_FALSE(session.init(compiled, kWeights).at("proj").is_device_graph());
}

TEST(DeviceGraph, RefusesCaptureAndOtherShapes) {
  InferenceSession session;
  auto model = session.init(session.compile(proj_module({2, 3})), kWeights, {"proj"}).at("proj");
  auto x = batch_of({1, 2, 3, -1, 0, 1});
  expect_error<ValueError>([&] { model.capture("k", {x}); }, {"graph 'proj' is a device graph", "capture"});
  expect_error<ValueError>([&] { model.execute({batch_of({1, 2, 3})}); }, {"input 0 is f32[1, 3]"});
}

TEST(DeviceGraph, NeedsStaticInputShapesAndAKnownGraph) {
  InferenceSession session;
  auto compiled = session.compile(proj_module());
  expect_error<ValueError>([&] { session.init(compiled, kWeights, {"proj"}); },
                           {"graph 'proj' is a device graph", "input 0 has symbolic shape f32[batch, 3]"});
  expect_error<ValueError>([&] { session.init(compiled, kWeights, {"nope"}); }, {"no graph 'nope'"});
}

// ---- aliases (docs/memory-planning.md) -------------------------------------------------------------

// acc += x, then reads the whole buffer back through an alias: out = -acc, and acc itself (a copy).
graph::Module accumulate_and_read_module() {
  graph::Graph g("acc", {BufferType{DType::f32, {2, 3}}, TensorType{DType::f32, {2, 3}}});
  ops::buffer_store(g.input(0), ops::add(ops::buffer_load(g.input(0)), g.input(1)));
  auto after = ops::buffer_load(g.input(0));
  g.output({ops::neg(ops::reshape(after, std::vector<int64_t>{6})), ops::buffer_load(g.input(0), {{1, 2}})});
  return g.module();
}

TEST(CaptureReplay, ReplayReadsBuffersThroughAliasesAfterEachStore) {
  InferenceSession session;
  auto compiled = session.compile(accumulate_and_read_module());
  int aliases = 0;
  for (const auto& value : compiled.plan("acc").values) aliases += value.kind == compiler::ValueKind::alias;
  EXPECT_EQ(aliases, 4);  // every load (none is live across the store) and the reshape
  auto model = session.init(compiled, {}).at("acc");
  auto buffer = Tensor::from_vector<float>({1, 2, 3, 4, 5, 6}, {2, 3});
  auto ones = Tensor::from_vector<float>(std::vector<float>(6, 1.f), {2, 3});
  auto captured = model.capture("c", {buffer, ones});
  EXPECT_EQ(captured[0].to_vector<float>(), (std::vector<float>{-2, -3, -4, -5, -6, -7}));
  EXPECT_EQ(captured[1].to_vector<float>(), (std::vector<float>{5, 6, 7}));
  auto replayed = model.replay("c", {buffer, ones});
  EXPECT_EQ(replayed[0].to_vector<float>(), (std::vector<float>{-3, -4, -5, -6, -7, -8}));
  EXPECT_EQ(replayed[1].to_vector<float>(), (std::vector<float>{6, 7, 8}));
  EXPECT_EQ(buffer.to_vector<float>(), (std::vector<float>{3, 4, 5, 6, 7, 8}));
  // The same as execute on a buffer in the same state.
  auto copy = buffer.clone();
  auto executed = model.execute({copy, ones});
  auto replayed_again = model.replay("c", {buffer, ones});
  EXPECT_EQ(replayed_again[0].to_vector<float>(), executed[0].to_vector<float>());
  EXPECT_EQ(replayed_again[1].to_vector<float>(), executed[1].to_vector<float>());
  // The alias output is the capture's own memory, not the buffer's.
  EXPECT_EQ(replayed_again[1].data(), captured[1].data());
}

TEST(DeviceGraph, ReadsBuffersThroughAliasesOnEveryCall) {
  InferenceSession session;
  auto model = session.init(session.compile(accumulate_and_read_module()), {}, {"acc"}).at("acc");
  ASSERT_TRUE(model.is_device_graph());
  auto buffer = Tensor::zeros(DType::f32, {2, 3});
  auto x = Tensor::from_vector<float>({1, 2, 3, 4, 5, 6}, {2, 3});
  auto first = model.execute({buffer, x});
  auto second = model.execute({buffer, x});
  EXPECT_EQ(first[0].to_vector<float>(), (std::vector<float>{-1, -2, -3, -4, -5, -6}));
  EXPECT_EQ(second[0].to_vector<float>(), (std::vector<float>{-2, -4, -6, -8, -10, -12}));
  EXPECT_EQ(first[1].to_vector<float>(), (std::vector<float>{4, 5, 6}));  // not overwritten by the second
  EXPECT_EQ(second[1].to_vector<float>(), (std::vector<float>{8, 10, 12}));
}

}  // namespace
