// ops::allreduce_sum and ops::allgather with processes = the MPI world's size, in a graph each rank
// runs through its own InferenceSession whose process group is engine::mpi_world(). Expected values
// are computed here from every rank's inputs (a function of rank and index).
#include <cstdint>
#include <cstring>
#include <vector>

#include <gtest/gtest.h>

#include "kiln/engine/distributed.h"
#include "kiln/engine/session.h"
#include "kiln/engine/signals.h"
#include "kiln/graph/ops.h"
#include "test_util.h"

namespace kiln {
namespace {

namespace ops = graph::ops;
using graph::TensorType;

engine::SessionOptions with_world() {
  engine::SessionOptions options;
  options.process_group = engine::mpi_world();
  return options;
}

// Rank r's element i of call `call`: magnitudes from 1e-3 to 1e3, so the f32 sum depends on order.
float input_value(int rank, int64_t i, int call = 0) {
  const float magnitude = static_cast<float>(1 << ((i * 5 + rank * 2 + call) % 11)) * 0.001f;
  return ((i + rank + call) % 4 == 1 ? -magnitude : magnitude) + 0.01f * static_cast<float>(rank);
}

std::vector<float> rank_inputs(int rank, int64_t count, int call = 0) {
  std::vector<float> values(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i) values[i] = input_value(rank, i, call);
  return values;
}

// x f32[rows, cols] on CPU(0) -> (allreduce_sum over ranks, allgather over ranks along axis 1).
engine::Model load_one_device_model(const engine::InferenceSession& session, int64_t rows, int64_t cols,
                                    int64_t processes) {
  graph::Graph g("rank_collectives", {TensorType{DType::f32, {rows, cols}, DeviceRef::CPU(0)}});
  graph::TensorValue x = g.input(0);
  graph::TensorValue sum = ops::allreduce_sum({x}, {}, processes)[0];
  graph::TensorValue gathered = ops::allgather({x}, {}, /*axis=*/1, processes)[0];
  g.output({sum, gathered});
  return session.load(g);
}

TEST(MpiSessionCollectives, OneDevicePerRankSumsAndGathersEveryRanksInput) {
  auto world = engine::mpi_world();
  const int ranks = world->size(), me = world->rank();
  const int64_t rows = 3, cols = 37;
  engine::InferenceSession session({DeviceRef::CPU(0)}, {}, with_world());
  engine::Model model = load_one_device_model(session, rows, cols, ranks);

  // Several calls with new inputs: the collectives of one call never mix with the next one's.
  for (int call = 0; call < 4; ++call) {
    auto outputs = model.execute({Tensor::from_vector(rank_inputs(me, rows * cols, call), {rows, cols})});
    ASSERT_EQ(outputs.size(), 2u);
    ASSERT_EQ(outputs[0].shape(), (std::vector<int64_t>{rows, cols}));
    ASSERT_EQ(outputs[1].shape(), (std::vector<int64_t>{rows, cols * ranks}));
    const auto sum = outputs[0].to_vector<float>();
    const auto gathered = outputs[1].to_vector<float>();
    for (int64_t i = 0; i < rows * cols; ++i) {
      float expected = input_value(0, i, call);
      for (int r = 1; r < ranks; ++r) expected += input_value(r, i, call);  // rank order
      ASSERT_EQ(sum[i], expected) << "call " << call << " element " << i;
    }
    // [rows, ranks * cols]: each row holds rank 0's row, then rank 1's, ...
    for (int64_t row = 0; row < rows; ++row)
      for (int r = 0; r < ranks; ++r)
        for (int64_t col = 0; col < cols; ++col)
          ASSERT_EQ(gathered[row * cols * ranks + r * cols + col], input_value(r, row * cols + col, call))
              << "call " << call << " row " << row << " rank " << r << " col " << col;
  }
}

TEST(MpiSessionCollectives, Bf16AllreduceOverRanks) {
  auto world = engine::mpi_world();
  const int ranks = world->size(), me = world->rank();
  const int64_t count = 129;
  engine::InferenceSession session({DeviceRef::CPU(0)}, {}, with_world());
  graph::Graph g("bf16_sum", {TensorType{DType::bf16, {count}, DeviceRef::CPU(0)}});
  g.output({ops::allreduce_sum({g.input(0)}, {}, ranks)[0]});
  engine::Model model = session.load(g);
  std::vector<bf16_t> mine(count);
  for (int64_t i = 0; i < count; ++i) mine[i] = bf16_t(input_value(me, i));
  Tensor x = Tensor::empty(DType::bf16, {count});
  std::memcpy(x.data(), mine.data(), sizeof(bf16_t) * count);
  Tensor sum = model.execute({x})[0];
  ASSERT_EQ(sum.dtype(), DType::bf16);
  const auto* got = static_cast<const bf16_t*>(sum.data());
  for (int64_t i = 0; i < count; ++i) {
    float expected = static_cast<float>(bf16_t(input_value(0, i)));  // accumulated in float, rounded once
    for (int r = 1; r < ranks; ++r) expected += static_cast<float>(bf16_t(input_value(r, i)));
    ASSERT_EQ(got[i].bits, bf16_t(expected).bits) << "element " << i;
  }
}

TEST(MpiSessionCollectives, TwoDevicesPerRankJoinLocalAndCrossRankSteps) {
  // 2 devices in each of the ranks: 2 * ranks shards. Integer-valued inputs keep every sum exact,
  // whatever the order of the local and cross-rank steps.
  auto world = engine::mpi_world();
  const int ranks = world->size(), me = world->rank();
  const std::vector<DeviceRef> devices{DeviceRef::CPU(0), DeviceRef::CPU(1)};
  const int64_t count = 50;
  auto shard_value = [](int shard, int64_t i) { return static_cast<float>((i * 3 + shard * 17) % 41 - 20); };

  engine::InferenceSession session(devices, {}, with_world());
  engine::Signals signals(devices);
  std::vector<graph::Type> types;
  for (const DeviceRef& d : devices) types.push_back(TensorType{DType::f32, {1, count}, d});
  for (const graph::Type& t : signals.input_types()) types.push_back(t);
  graph::Graph g("two_device_ranks", types);
  const std::vector<graph::TensorValue> xs{g.input(0), g.input(1)};
  const std::vector<graph::BufferValue> buffers{g.input(2), g.input(3)};
  auto sums = ops::allreduce_sum(xs, buffers, ranks);
  auto gathered = ops::allgather(xs, buffers, /*axis=*/0, ranks);
  g.output({sums[0], sums[1], gathered[0], gathered[1]});
  engine::Model model = session.load(g);

  std::vector<Tensor> inputs;
  for (int local = 0; local < 2; ++local) {
    std::vector<float> values(count);
    for (int64_t i = 0; i < count; ++i) values[i] = shard_value(me * 2 + local, i);
    Tensor t = Tensor::empty(DType::f32, {1, count}, devices[local]);
    std::memcpy(t.data(), values.data(), sizeof(float) * count);
    inputs.push_back(t);
  }
  for (const Tensor& b : signals.buffers()) inputs.push_back(b);
  auto outputs = model.execute(inputs);
  ASSERT_EQ(outputs.size(), 4u);
  for (int local = 0; local < 2; ++local) {
    const auto sum = outputs[local].to_vector<float>();
    const auto all = outputs[2 + local].to_vector<float>();  // [2 * ranks, count], shard order
    ASSERT_EQ(all.size(), static_cast<size_t>(2 * ranks * count));
    for (int64_t i = 0; i < count; ++i) {
      float expected = 0;
      for (int shard = 0; shard < 2 * ranks; ++shard) expected += shard_value(shard, i);
      EXPECT_EQ(sum[i], expected) << "device " << local << " element " << i;
      for (int shard = 0; shard < 2 * ranks; ++shard)
        EXPECT_EQ(all[shard * count + i], shard_value(shard, i)) << "device " << local << " shard " << shard;
    }
  }
}

TEST(MpiSessionCollectives, ProcessCountOtherThanTheWorldsIsAnInitError) {
  auto world = engine::mpi_world();
  engine::InferenceSession session({DeviceRef::CPU(0)}, {}, with_world());
  graph::Graph g("too_many_ranks", {TensorType{DType::f32, {4}, DeviceRef::CPU(0)}});
  g.output({ops::allreduce_sum({g.input(0)}, {}, world->size() + 1)[0]});
  testing::expect_error<ValueError>(
      [&] { session.load(g); },
      {"allreduce_sum spans " + std::to_string(world->size() + 1) + " processes",
       "process group has " + std::to_string(world->size())});
}

}  // namespace
}  // namespace kiln
