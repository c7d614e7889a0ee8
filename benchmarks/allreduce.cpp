// kiln's allreduce_sum over logical CPU devices of one process: a model of one allreduce on n devices,
// executed back to back on the same signal buffers, and the kernel alone on fixed outputs. Bytes processed are one input's size per call
// (the "algorithm bandwidth" convention of collective benchmarks). The baseline is one thread summing
// two buffers into two outputs, the memory traffic a 2-device allreduce cannot avoid.
#include <benchmark/benchmark.h>

#include <cstring>
#include <vector>

#include "engine/cpu/device_team.h"
#include "kernels/cpu/kernels.h"
#include "kiln/engine/session.h"
#include "kiln/engine/signals.h"
#include "kiln/graph/ops.h"

namespace {

using namespace kiln;

// range(0): bytes per input (f32), range(1): devices.
void BM_Allreduce(benchmark::State& state) {
  const int64_t count = state.range(0) / 4;
  const int n = static_cast<int>(state.range(1));
  std::vector<DeviceRef> devices;
  for (int i = 0; i < n; ++i) devices.push_back(DeviceRef::CPU(i));
  engine::InferenceSession session(devices);
  engine::Signals signals(devices);
  std::vector<graph::Type> types;
  for (const DeviceRef& d : devices) types.push_back(graph::TensorType{DType::f32, {count}, d});
  for (const graph::Type& t : signals.input_types()) types.push_back(t);
  graph::Graph g("allreduce", types);
  {
    graph::Graph::Scope scope(g);
    std::vector<graph::TensorValue> xs;
    std::vector<graph::BufferValue> buffers;
    for (int i = 0; i < n; ++i) {
      xs.push_back(g.input(i));
      buffers.push_back(g.input(n + i));
    }
    auto sums = graph::ops::allreduce_sum(xs, buffers);
    g.output(std::vector<graph::Value>(sums.begin(), sums.end()));
  }
  engine::Model model = session.load(g);
  std::vector<Tensor> inputs;
  for (const DeviceRef& d : devices) {
    Tensor x = Tensor::empty(DType::f32, {count}, d);
    std::vector<float> ones(static_cast<size_t>(count), 1.0f);
    std::memcpy(x.data(), ones.data(), ones.size() * sizeof(float));
    inputs.push_back(x);
  }
  for (const Tensor& b : signals.buffers()) inputs.push_back(b);
  if (model.execute(inputs)[0].to_vector<float>()[0] != static_cast<float>(n))
    state.SkipWithError("allreduce gave a wrong sum");
  for (auto _ : state) benchmark::DoNotOptimize(model.execute(inputs));
  state.SetBytesProcessed(state.iterations() * count * 4);
}

// The kernel alone, on outputs allocated once: what the collective costs without execute()'s fresh
// output memory (whose page faults dominate large calls).
void BM_AllreduceKernel(benchmark::State& state) {
  const int64_t count = state.range(0) / 4;
  const int n = static_cast<int>(state.range(1));
  std::vector<DeviceRef> devices;
  for (int i = 0; i < n; ++i) devices.push_back(DeviceRef::CPU(i));
  engine::Signals signals(devices);
  std::vector<Tensor> inputs, outputs;
  std::vector<kernels::TensorView> in_views, out_views;
  for (const DeviceRef& d : devices) {
    inputs.push_back(Tensor::zeros(DType::f32, {count}, d));
    outputs.push_back(Tensor::zeros(DType::f32, {count}, d));
    in_views.push_back({inputs.back().data(), DType::f32, {count}, {1}});
    out_views.push_back({outputs.back().data(), DType::f32, {count}, {1}});
  }
  for (const Tensor& b : signals.buffers())
    in_views.push_back({const_cast<void*>(b.data()), DType::u8, {engine::SIGNAL_BYTES}, {1}});
  const graph::Attrs attrs{{"processes", int64_t{1}}};
  const auto allreduce = kernels::cpu_kernels().build({graph::Op::allreduce_sum, DeviceKind::CPU, DType::f32},
                                                      {graph::Op::allreduce_sum, &attrs, in_views, {}, nullptr});
  engine::DeviceThreadTeam team;
  kernels::SerialParallel serial;
  kernels::KernelContext context;
  context.parallel = &serial;
  context.team = &team;
  for (auto _ : state) allreduce->run(context, in_views, out_views);
  state.SetBytesProcessed(state.iterations() * count * 4);
}

// One thread: out_0 = out_1 = a + b, over fresh outputs each time like execute() allocates.
void BM_OneThreadTwoBufferSum(benchmark::State& state) {
  const auto count = static_cast<size_t>(state.range(0) / 4);
  std::vector<float> a(count, 1.0f), b(count, 2.0f);
  for (auto _ : state) {
    std::vector<float> out0(count), out1(count);
    for (size_t i = 0; i < count; ++i) out0[i] = a[i] + b[i];
    std::memcpy(out1.data(), out0.data(), count * sizeof(float));
    benchmark::DoNotOptimize(out0.data());
    benchmark::DoNotOptimize(out1.data());
  }
  state.SetBytesProcessed(state.iterations() * static_cast<int64_t>(count) * 4);
}

constexpr int64_t kMiB = int64_t{1} << 20;
BENCHMARK(BM_Allreduce)->Args({kMiB, 2})->Args({64 * kMiB, 2})->Args({kMiB, 4})->Unit(benchmark::kMicrosecond)->UseRealTime();
BENCHMARK(BM_AllreduceKernel)->Args({kMiB, 2})->Args({64 * kMiB, 2})->Unit(benchmark::kMicrosecond)->UseRealTime();
BENCHMARK(BM_OneThreadTwoBufferSum)->Arg(kMiB)->Arg(64 * kMiB)->Unit(benchmark::kMicrosecond)->UseRealTime();

}  // namespace

BENCHMARK_MAIN();
