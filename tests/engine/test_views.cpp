// Aliases at run time: reshape and contiguous windows read their operand's memory in place (no copy,
// no arena memory), give what a copy would, and never hand out memory the caller or the model owns.
// Also: what a run allocates once it is warm.
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <cstdlib>
#include <new>
#include <vector>

#include "kiln/tensor/device_memory.h"
#include "kiln/kiln.h"
#include "cpu_kernel_catalog.h"
#include "test_util.h"

// Counts heap allocations of the whole test binary, so a test can measure those of one execute().
// The replacement operator new allocates with malloc, so its delete frees; GCC, inlining both, takes
// that for a mismatched pair.
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
namespace {
std::atomic<int64_t> heap_allocations{0};
}  // namespace

void* operator new(std::size_t size) {
  heap_allocations.fetch_add(1, std::memory_order_relaxed);
  if (void* p = std::malloc(size ? size : 1)) return p;
  throw std::bad_alloc();
}
void* operator new[](std::size_t size) { return operator new(size); }
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }

namespace {

using namespace kiln;
using engine::InferenceSession;
using graph::BufferType;
using graph::Dim;
using graph::TensorType;
using kiln::testing::expect_error;
namespace ops = kiln::graph::ops;

int count_steps(const compiler::GraphPlan& plan, graph::Op op) {
  int n = 0;
  for (const auto& step : plan.steps) n += step.op == op;
  return n;
}

// A two-layer KV-cache pattern, as attention uses it: each call appends its rows to a layer of the
// cache ([layers, max_seq, width]) at [start, total), then reads rows [0, total) of that layer back.
// Inputs: the cache, this call's rows f32[seq, width], and positions i64[total] (binding total).
// Output per layer: the column sums of the history, scaled by the layer index + 1.
constexpr int64_t kLayers = 2, kMaxSeq = 8, kWidth = 3;

graph::Module kv_module() {
  graph::Graph g("kv", {BufferType{DType::f32, {kLayers, kMaxSeq, kWidth}}, TensorType{DType::f32, {"seq", kWidth}},
                        TensorType{DType::i64, {"total"}}});
  graph::Graph::Scope scope(g);
  const Dim seq = graph::shape_of(g.input(1).type())[0];
  const Dim total = graph::shape_of(g.input(2).type())[0];
  const Dim start = total - seq;
  std::vector<graph::Value> outputs;
  for (int64_t layer = 0; layer < kLayers; ++layer) {
    auto rows = ops::mul(g.input(1), ops::constant(static_cast<double>(layer + 1), DType::f32));
    ops::buffer_store(g.input(0), ops::reshape(rows, graph::Shape{1, seq, kWidth}),
                      {{layer, layer + 1}, {start, total}});
    auto history = ops::reshape(ops::buffer_load(g.input(0), {{layer, layer + 1}, {0, total}}),
                                graph::Shape{total, kWidth});  // [total, width]
    outputs.push_back(ops::sum(history, 0));
  }
  g.output(outputs);
  return g.module();
}

// The reference: column sums of every row appended so far, times layer + 1.
std::vector<float> kv_reference(const std::vector<std::vector<float>>& appended, int64_t layer) {
  std::vector<float> sums(kWidth, 0.f);
  for (const auto& row : appended)
    for (int64_t c = 0; c < kWidth; ++c) sums[static_cast<size_t>(c)] += row[static_cast<size_t>(c)] * static_cast<float>(layer + 1);
  return sums;
}

Tensor rows_tensor(const std::vector<std::vector<float>>& rows) {
  std::vector<float> flat;
  for (const auto& r : rows) flat.insert(flat.end(), r.begin(), r.end());
  return Tensor::from_vector(flat, {static_cast<int64_t>(rows.size()), kWidth});
}

TEST(Views, CacheReadAfterEachStoreIsAnAliasAndSeesTheWholeHistory) {
  InferenceSession session;
  auto compiled = session.compile(kv_module());
  const auto& plan = compiled.plan("kv");
  EXPECT_EQ(count_steps(plan, graph::Op::buffer_load), 0);
  EXPECT_EQ(count_steps(plan, graph::Op::reshape), 0);
  EXPECT_EQ(count_steps(plan, graph::Op::buffer_store), kLayers);
  auto model = session.init(compiled, {}).at("kv");

  auto cache = Tensor::zeros(DType::f32, {kLayers, kMaxSeq, kWidth});
  std::vector<std::vector<float>> appended;
  const std::vector<std::vector<std::vector<float>>> calls = {
      {{1, 2, 3}, {4, 5, 6}}, {{-1, 0.5f, 2}}, {{10, 20, 30}}, {{0.25f, 0.25f, 0.25f}, {1, 1, 1}, {2, -2, 2}}};
  for (const auto& call : calls) {
    appended.insert(appended.end(), call.begin(), call.end());
    auto positions = Tensor::zeros(DType::i64, {static_cast<int64_t>(appended.size())});
    auto out = model.execute({cache, rows_tensor(call), positions});
    for (int64_t layer = 0; layer < kLayers; ++layer)
      EXPECT_EQ(out.at(static_cast<size_t>(layer)).to_vector<float>(), kv_reference(appended, layer))
          << "layer " << layer << " after " << appended.size() << " rows";
  }
}

TEST(Views, AWindowPastTheBufferIsAnExecutionErrorNamingTheOp) {
  InferenceSession session;
  auto model = session.load(kv_module());
  auto cache = Tensor::zeros(DType::f32, {kLayers, kMaxSeq, kWidth});
  auto positions = Tensor::zeros(DType::i64, {kMaxSeq + 1});
  expect_error<ExecutionError>([&] { model.execute({cache, rows_tensor({{1, 2, 3}}), positions}); },
                               {"execute: graph 'kv' op 'buffer", "of axis 1 is out of bounds for size 8"});
}

TEST(Views, AReadLiveAcrossAStoreStaysACopyOfTheOldContents) {
  graph::Graph g("g", {BufferType{DType::f32, {4}}});
  graph::Graph::Scope scope(g);
  auto before = ops::buffer_load(g.input(0));
  ops::buffer_store(g.input(0), ops::neg(before));
  g.output({ops::mul(before, ops::constant(2.0, DType::f32))});
  InferenceSession session;
  auto model = session.load(g);
  auto buffer = Tensor::from_vector<float>({1, 2, 3, 4}, {4});
  auto out = model.execute({buffer});
  EXPECT_EQ(out[0].to_vector<float>(), (std::vector<float>{2, 4, 6, 8}));  // read before the store
  EXPECT_EQ(buffer.to_vector<float>(), (std::vector<float>{-1, -2, -3, -4}));
}

TEST(Views, AliasOutputsAreFreshMemory) {
  graph::Graph g("g", {TensorType{DType::f32, {2, 3}}, BufferType{DType::f32, {2, 3}}});
  auto e = ops::exp(g.input(0));
  g.output({ops::reshape(g.input(0), std::vector<int64_t>{6}), ops::buffer_load(g.input(1), {{1, 2}}),
            ops::reshape(e, std::vector<int64_t>{3, 2}), e});
  InferenceSession session;
  auto compiled = session.compile(g.module());
  int aliases = 0;
  for (int32_t v : compiled.plan("g").outputs)
    aliases += compiled.plan("g").values.at(static_cast<size_t>(v)).kind == compiler::ValueKind::alias;
  EXPECT_EQ(aliases, 3);
  auto model = session.init(compiled, {}).at("g");

  auto x = Tensor::from_vector<float>({0, 1, 2, 3, 4, 5}, {2, 3});
  auto buffer = Tensor::from_vector<float>({6, 7, 8, 9, 10, 11}, {2, 3});
  auto first = model.execute({x, buffer});
  EXPECT_EQ(first[0].to_vector<float>(), x.to_vector<float>());
  EXPECT_EQ(first[1].to_vector<float>(), (std::vector<float>{9, 10, 11}));
  EXPECT_EQ(first[2].to_vector<float>(), first[3].to_vector<float>());
  EXPECT_NE(first[0].data(), x.data());
  EXPECT_NE(first[2].data(), first[3].data());
  const uint8_t* buffer_begin = static_cast<const uint8_t*>(buffer.data());
  const auto* load_data = static_cast<const uint8_t*>(first[1].data());
  EXPECT_TRUE(load_data < buffer_begin || load_data >= buffer_begin + buffer.nbytes());

  // Writing a result changes nothing else, and a later run leaves earlier results alone.
  first[0].data_as<float>()[0] = 100;
  first[1].data_as<float>()[0] = 100;
  EXPECT_EQ(x.to_vector<float>()[0], 0);
  EXPECT_EQ(buffer.to_vector<float>()[3], 9);
  auto second = model.execute({Tensor::zeros(DType::f32, {2, 3}), Tensor::zeros(DType::f32, {2, 3})});
  EXPECT_EQ(second[1].to_vector<float>(), (std::vector<float>{0, 0, 0}));
  EXPECT_EQ(first[1].to_vector<float>(), (std::vector<float>{100, 10, 11}));
  EXPECT_EQ(first[3].to_vector<float>()[1], std::exp(1.f));
}

TEST(Views, SymbolicWindowOfAnInputReadsTheRightRows) {
  // rows [k, n) of x[n, 4], k bound by the length of a second input.
  graph::Graph g("g", {TensorType{DType::f32, {"n", 4}}, TensorType{DType::i64, {"k"}}});
  const Dim k = graph::shape_of(g.input(1).type())[0];
  g.output({ops::neg(ops::slice(g.input(0), {{k, graph::shape_of(g.input(0).type())[0]}}))});
  InferenceSession session;
  auto model = session.load(g);
  std::vector<float> x(5 * 4);
  for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(i);
  for (int64_t start : {0, 2, 5}) {
    std::vector<float> expected;
    for (size_t i = static_cast<size_t>(start) * 4; i < x.size(); ++i) expected.push_back(-x[i]);
    auto out = model.execute({Tensor::from_vector(x, {5, 4}), Tensor::zeros(DType::i64, {start})});
    EXPECT_EQ(out[0].to_vector<float>(), expected) << "k = " << start;
  }
}

TEST(Views, AReshapedWeightFeedsAMatmul) {
  graph::Graph g("g", {TensorType{DType::f32, {2, 3}}});
  {
    graph::Graph::Scope scope(g);
    auto w = g.weight({"w", DType::f32, {6}});
    g.output({ops::matmul(g.input(0), ops::reshape(w, std::vector<int64_t>{3, 2}))});
  }
  InferenceSession session;
  const std::vector<float> w = {1, 2, 3, 4, 5, 6}, x = {1, 0, -1, 2, 3, 4};
  auto model = session.load(g, {{"w", Tensor::from_vector(w, {6})}});
  std::vector<float> expected(4, 0.f);  // x[2, 3] @ w viewed as [3, 2]
  for (size_t i = 0; i < 2; ++i)
    for (size_t j = 0; j < 2; ++j)
      for (size_t l = 0; l < 3; ++l) expected[i * 2 + j] += x[i * 3 + l] * w[l * 2 + j];
  EXPECT_EQ(model.execute({Tensor::from_vector(x, {2, 3})})[0].to_vector<float>(), expected);
}

TEST(Views, ReadingAWholeBufferTakesNoArenaMemory) {
  constexpr int64_t kRows = 256, kCols = 1024;  // 1 MiB
  graph::Graph g("g", {BufferType{DType::f32, {kRows, kCols}}});
  g.output({ops::sum(ops::reshape(ops::buffer_load(g.input(0)), std::vector<int64_t>{kRows * kCols}), 0)});
  InferenceSession session;
  auto model = session.load(g);
  auto buffer = Tensor::zeros(DType::f32, {kRows, kCols});
  buffer.data_as<float>()[7] = 3;
  auto before = memory_stats(DeviceRef::CPU());
  reset_peak_memory(DeviceRef::CPU());
  auto out = model.execute({buffer});
  auto after = memory_stats(DeviceRef::CPU());
  EXPECT_EQ(out[0].to_vector<float>(), std::vector<float>{3});
  // A copy would have needed an arena slot of the buffer's size; the sum's result is 4 bytes.
  EXPECT_LT(after.peak_bytes_in_use - before.bytes_in_use, 4096);
}

// A chain of `length` elementwise steps with reshapes between them, static shapes.
engine::Model chain_model(const InferenceSession& session, int length) {
  graph::Graph g("chain", {TensorType{DType::f32, {4, 4}}});
  graph::TensorValue y = g.input(0);
  for (int i = 0; i < length; ++i)
    y = ops::reshape(ops::neg(y), std::vector<int64_t>{i % 2 ? 4 : 2, i % 2 ? 4 : 8});
  g.output({y});
  return session.init(compiler::compile(g.module(), kiln::testing::with_cpu_kernels({.optimize = false})), {}).at("chain");
}

int64_t heap_allocations_of_one_run(const engine::Model& model, const Tensor& x) {
  for (int warm = 0; warm < 2; ++warm) model.execute({x});
  const int64_t before = heap_allocations.load();
  auto out = model.execute({x});
  return heap_allocations.load() - before;
}

TEST(Views, AWarmRunAllocatesTheSameWhateverItsNumberOfSteps) {
  InferenceSession session;
  auto x = Tensor::zeros(DType::f32, {4, 4});
  auto short_chain = chain_model(session, 2), long_chain = chain_model(session, 40);
  // Per run: the inputs' check and the result, not a vector or view per step.
  EXPECT_EQ(heap_allocations_of_one_run(long_chain, x), heap_allocations_of_one_run(short_chain, x));
  auto device_before = memory_stats(DeviceRef::CPU()).total_allocations;
  long_chain.execute({x});
  EXPECT_EQ(memory_stats(DeviceRef::CPU()).total_allocations - device_before, 1);  // the output
}

}  // namespace
