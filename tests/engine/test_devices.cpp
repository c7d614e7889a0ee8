// Several logical CPU devices in one process: per-device memory accounting, the device team that runs
// a collective's participants at once, execute()'s device checks, and the session's devices enforced.
#include <atomic>
#include <chrono>
#include <stdexcept>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "test_util.h"

#include "engine/cpu/device_team.h"
#include "kiln/tensor/device_memory.h"
#include "kiln/engine/signals.h"
#include "kiln/kiln.h"

namespace {

using namespace kiln;
using kiln::testing::expect_error;
namespace ops = kiln::graph::ops;
using graph::TensorType;

// ---- per-device memory -----------------------------------------------------------------------------

TEST(DeviceMemory, ATensorCountsAgainstItsOwnDeviceUntilDestroyed) {
  const DeviceRef cpu0 = DeviceRef::CPU(0), cpu1 = DeviceRef::CPU(1);
  const DeviceMemoryStats before0 = memory_stats(cpu0);
  const DeviceMemoryStats before1 = memory_stats(cpu1);
  {
    Tensor t = Tensor::zeros(DType::f32, {1000}, cpu1);
    const DeviceMemoryStats during1 = memory_stats(cpu1);
    EXPECT_EQ(during1.bytes_in_use - before1.bytes_in_use, 4000);
    EXPECT_EQ(during1.live_allocations - before1.live_allocations, 1);
    EXPECT_EQ(during1.total_allocations - before1.total_allocations, 1);
    EXPECT_GE(during1.peak_bytes_in_use, during1.bytes_in_use);
    const DeviceMemoryStats during0 = memory_stats(cpu0);
    EXPECT_EQ(during0.bytes_in_use, before0.bytes_in_use);
    EXPECT_EQ(during0.total_allocations, before0.total_allocations);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(t.data()) % 64, 0u);
  }
  const DeviceMemoryStats after1 = memory_stats(cpu1);
  EXPECT_EQ(after1.bytes_in_use, before1.bytes_in_use);
  EXPECT_EQ(after1.live_allocations, before1.live_allocations);
  EXPECT_EQ(after1.total_allocations - before1.total_allocations, 1);
}

TEST(DeviceMemory, PeakRecordsTheMostHeldSinceAReset) {
  const DeviceRef cpu = DeviceRef::CPU(7);
  reset_peak_memory(cpu);
  const int64_t base = memory_stats(cpu).bytes_in_use;
  {
    Tensor a = Tensor::empty(DType::u8, {5000}, cpu);
    Tensor b = Tensor::empty(DType::u8, {3000}, cpu);
  }
  Tensor c = Tensor::empty(DType::u8, {100}, cpu);
  EXPECT_EQ(memory_stats(cpu).peak_bytes_in_use, base + 8000);
  reset_peak_memory(cpu);
  EXPECT_EQ(memory_stats(cpu).peak_bytes_in_use, base + 100);
}

TEST(DeviceMemory, ADeviceNeverUsedReadsAsZero) {
  const DeviceMemoryStats stats = memory_stats(DeviceRef::CPU(4000));
  EXPECT_EQ(stats.bytes_in_use, 0);
  EXPECT_EQ(stats.peak_bytes_in_use, 0);
  EXPECT_EQ(stats.total_allocations, 0);
}

TEST(DeviceMemory, CopiesStayOnTheSourceDevice) {
  const DeviceRef cpu = DeviceRef::CPU(2);
  Tensor t = Tensor::zeros(DType::f32, {4, 4}, cpu);
  const int64_t before = memory_stats(cpu).bytes_in_use;
  Tensor copy = t.clone();
  EXPECT_EQ(copy.device(), cpu);
  EXPECT_EQ(memory_stats(cpu).bytes_in_use - before, 64);
}

TEST(DeviceMemory, ACollectivesResultsAreAllocatedOnTheirDevices) {
  engine::InferenceSession session({DeviceRef::CPU(0), DeviceRef::CPU(1)});
  engine::Signals signals({DeviceRef::CPU(0), DeviceRef::CPU(1)});
  graph::Graph g("sum2", {TensorType{DType::f32, {256}, DeviceRef::CPU(0)},
                          TensorType{DType::f32, {256}, DeviceRef::CPU(1)}, signals.input_types()[0],
                          signals.input_types()[1]});
  auto sums = ops::allreduce_sum({g.input(0), g.input(1)}, {g.input(2), g.input(3)});
  g.output({sums[0], sums[1]});
  engine::Model model = session.load(g);
  Tensor x0 = Tensor::zeros(DType::f32, {256}, DeviceRef::CPU(0));
  Tensor x1 = Tensor::zeros(DType::f32, {256}, DeviceRef::CPU(1));
  const int64_t before1 = memory_stats(DeviceRef::CPU(1)).bytes_in_use;
  {
    auto out = model.execute({x0, x1, signals.buffers()[0], signals.buffers()[1]});
    EXPECT_EQ(out[1].device(), DeviceRef::CPU(1));
    EXPECT_EQ(memory_stats(DeviceRef::CPU(1)).bytes_in_use - before1, 256 * 4);
  }
  EXPECT_EQ(memory_stats(DeviceRef::CPU(1)).bytes_in_use, before1);
}

TEST(DeviceMemory, AFreedLargeBlockIsReusedWithoutAskingTheSystem) {
  const DeviceRef cpu = DeviceRef::CPU(11);  // used by no other test
  { auto warm = Tensor::empty(DType::f32, {300000}, cpu); }
  const DeviceMemoryStats cached = memory_stats(cpu);
  EXPECT_GE(cached.cached_bytes, 1200000);
  EXPECT_EQ(cached.bytes_in_use, 0);
  for (int i = 0; i < 5; ++i) {
    // A slightly smaller request falls in the same size class.
    auto again = Tensor::empty(DType::f32, {299000 + i}, cpu);
    EXPECT_EQ(memory_stats(cpu).bytes_in_use, (299000 + i) * 4);
  }
  EXPECT_EQ(memory_stats(cpu).system_allocations, cached.system_allocations);
  empty_cache(cpu);
  EXPECT_EQ(memory_stats(cpu).cached_bytes, 0);
  { auto fresh = Tensor::empty(DType::f32, {300000}, cpu); }
  EXPECT_EQ(memory_stats(cpu).system_allocations, cached.system_allocations + 1);
}

TEST(DeviceMemory, RepeatedExecutesAskTheSystemForNoMemoryAfterTheFirst) {
  // A decode-like step: its output and intermediates have the same sizes every call.
  graph::Graph g("step", {TensorType{DType::f32, {1, 512}, DeviceRef::CPU(0)},
                          TensorType{DType::f32, {512, 40000}, DeviceRef::CPU(0)}});
  {
    graph::Graph::Scope scope(g);
    g.output({ops::softmax(ops::matmul(ops::tanh(g.input(0)), g.input(1)), -1)});
  }
  engine::InferenceSession session({DeviceRef::CPU(0)}, {}, engine::SessionOptions{.num_threads = 1});
  engine::Model model = session.load(g);
  auto x = Tensor::zeros(DType::f32, {1, 512});
  auto w = Tensor::zeros(DType::f32, {512, 40000});
  model.execute({x, w});
  const int64_t before = memory_stats(DeviceRef::CPU(0)).system_allocations;
  for (int i = 0; i < 10; ++i) model.execute({x, w});
  EXPECT_EQ(memory_stats(DeviceRef::CPU(0)).system_allocations, before);
}

TEST(DeviceMemory, OnlyCpuMemoryIsAllocated) {
  expect_error<ValueError>([] { allocate(DeviceRef::GPU(0), 16); }, {"allocate", "gpu:0", "not supported"});
}

// ---- execute() and devices -------------------------------------------------------------------------

TEST(Devices, ExecuteRejectsAnInputOnTheWrongDeviceNamingIt) {
  engine::InferenceSession session({DeviceRef::CPU(0), DeviceRef::CPU(1)});
  graph::Graph g("two_devices", {TensorType{DType::f32, {2}, DeviceRef::CPU(0)},
                                 TensorType{DType::f32, {2}, DeviceRef::CPU(1)}});
  g.output({ops::transfer_to(g.input(1), DeviceRef::CPU(0)) + g.input(0)});
  engine::Model model = session.load(g);
  Tensor on0 = Tensor::zeros(DType::f32, {2}, DeviceRef::CPU(0));
  Tensor on1 = Tensor::zeros(DType::f32, {2}, DeviceRef::CPU(1));
  expect_error<ValueError>([&] { model.execute({on0, on0}); }, {"execute: input 1 is on cpu:0, expected cpu:1"});
  auto out = model.execute({Tensor::from_vector<float>({1, 2}, {2}), on1});
  EXPECT_EQ(out[0].to_vector<float>(), (std::vector<float>{1, 2}));
}

// ---- the session's devices -------------------------------------------------------------------------

// A session made with cpu:0 alone runs nothing placed on cpu:1: not a graph input, a weight, an op's
// result, nor a weight array bound at init (init, and so load, refuses each, naming it and the device).
TEST(Devices, ASessionRefusesValuesOnADeviceItDoesNotHold) {
  const DeviceRef cpu0 = DeviceRef::CPU(0), cpu1 = DeviceRef::CPU(1);
  engine::InferenceSession only0({cpu0});
  const std::string not_held = "a device this session does not hold (its devices: [cpu:0]";

  graph::Graph input_on1("input_on1", {TensorType{DType::f32, {2}, cpu1}});
  input_on1.output({ops::neg(input_on1.input(0))});
  expect_error<ValueError>([&] { only0.load(input_on1); },
                           {"init: graph 'input_on1': input 0 is on cpu:1", not_held});
  // The same graph runs in a session that holds cpu:1: the session's devices decide.
  engine::InferenceSession both({cpu0, cpu1});
  Tensor x1 = Tensor::zeros(DType::f32, {2}, cpu1);
  x1.data_as<float>()[0] = 3;
  EXPECT_EQ(both.load(input_on1).execute({x1}).at(0).to_vector<float>(), (std::vector<float>{-3, 0}));
  // Compiled where cpu:1 is held, initialised where it is not: init checks, so artifacts are covered.
  expect_error<ValueError>([&] { only0.init(both.compile(input_on1.module()), {}); },
                           {"input 0 is on cpu:1", not_held});

  graph::Graph moves("moves", {TensorType{DType::f32, {2}, cpu0}});
  moves.output({ops::transfer_to(moves.input(0), cpu1)});
  expect_error<ValueError>([&] { only0.load(moves); },
                           {"init: graph 'moves': node", "(transfer_to) puts its result on cpu:1", not_held});

  graph::Graph weight_on1("weight_on1", {});
  weight_on1.output({ops::neg(weight_on1.weight({"w", DType::f32, {2}, cpu1}))});
  const WeightsRegistry w_on1{{"w", Tensor::zeros(DType::f32, {2}, cpu1)}};
  expect_error<ValueError>([&] { only0.load(weight_on1, w_on1); },
                           {"init: graph 'weight_on1': weight 'w' is declared on cpu:1", not_held});

  graph::Graph scaled("scaled", {TensorType{DType::f32, {2}, cpu0}});
  scaled.output({scaled.input(0) * scaled.weight({"w", DType::f32, {2}, cpu0})});
  expect_error<ValueError>([&] { only0.load(scaled, w_on1); },
                           {"init: graph 'scaled': weight 'w' is bound to an array on cpu:1", not_held});
  // And an input: a graph on cpu:0 takes only cpu:0 tensors, so one on cpu:1 is refused too.
  engine::Model model = only0.load(scaled, {{"w", Tensor::from_vector<float>({2, 5}, {2})}});
  expect_error<ValueError>([&] { model.execute({Tensor::zeros(DType::f32, {2}, cpu1)}); },
                           {"execute: input 0 is on cpu:1, expected cpu:0"});
  EXPECT_EQ(model.execute({Tensor::from_vector<float>({1, -1}, {2})}).at(0).to_vector<float>(),
            (std::vector<float>{2, -5}));
}

// ---- the device team -------------------------------------------------------------------------------

// Every participant waits (up to a deadline) for all to arrive: only concurrent participants pass.
TEST(DeviceTeam, RunsEveryParticipantAtOnce) {
  engine::DeviceThreadTeam team;
  EXPECT_EQ(team.num_threads(), 0);
  for (int n : {2, 4, 3}) {
    std::atomic<int> arrived{0};
    std::vector<int> met(static_cast<size_t>(n), 0);
    team.run(n, [&](int me) {
      arrived.fetch_add(1);
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
      while (arrived.load() < n && std::chrono::steady_clock::now() < deadline) std::this_thread::yield();
      met[static_cast<size_t>(me)] = arrived.load() == n;
    });
    EXPECT_EQ(met, std::vector<int>(static_cast<size_t>(n), 1)) << n << " participants";
  }
  EXPECT_EQ(team.num_threads(), 3);  // grown to the largest n - 1, never more
}

TEST(DeviceTeam, RethrowsAParticipantsErrorAndStaysUsable) {
  engine::DeviceThreadTeam team;
  try {
    team.run(3, [](int me) {
      if (me == 2) throw std::runtime_error("participant 2 failed");
    });
    ADD_FAILURE() << "expected an exception";
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "participant 2 failed");
  }
  std::atomic<int> ran{0};
  team.run(3, [&](int) { ran.fetch_add(1); });
  EXPECT_EQ(ran.load(), 3);
}

TEST(DeviceTeam, ParticipantZeroRunsOnTheCallingThread) {
  engine::DeviceThreadTeam team;
  std::vector<std::thread::id> ids(2);
  team.run(2, [&](int me) { ids[static_cast<size_t>(me)] = std::this_thread::get_id(); });
  EXPECT_EQ(ids[0], std::this_thread::get_id());
  EXPECT_NE(ids[1], std::this_thread::get_id());
}

}  // namespace
