// Eager dispatch overhead: an nn::functional op on eager tensors (signature key, cache lookup, model
// execute) against calling the same cached one-op model's execute() directly. The difference is what
// eager mode costs per op on top of running the kernel.
#include <benchmark/benchmark.h>

#include <vector>

#include "kiln/engine/session.h"
#include "kiln/graph/ops.h"
#include "kiln/nn/functional.h"

namespace {

using namespace kiln;
namespace F = kiln::nn::functional;

kiln::Tensor filled(int64_t n, float value) {
  return kiln::Tensor::from_vector(std::vector<float>(static_cast<size_t>(n), value), {n});
}

// nn::functional::add on two eager f32[n] tensors (compiled on the first call, cached after).
void BM_EagerAdd(benchmark::State& state) {
  const int64_t n = state.range(0);
  nn::Tensor a(filled(n, 1.f)), b(filled(n, 2.f));
  benchmark::DoNotOptimize(F::add(a, b));  // compile outside the timed loop
  const int64_t compiles = nn::eager_compile_count();
  for (auto _ : state) benchmark::DoNotOptimize(F::add(a, b));
  if (nn::eager_compile_count() != compiles) state.SkipWithError("eager add recompiled inside the loop");
  state.SetItemsProcessed(state.iterations());
}

// The same one-op graph, compiled once, executed directly: the floor eager dispatch builds on.
void BM_ModelExecuteAdd(benchmark::State& state) {
  const int64_t n = state.range(0);
  graph::Graph g("add", {graph::TensorType{DType::f32, {n}}, graph::TensorType{DType::f32, {n}}});
  {
    graph::Graph::Scope scope(g);
    g.output({graph::ops::add(g.input(0), g.input(1))});
  }
  // range(1): a session with one thread, showing what the thread pool's hand-off costs a tiny op.
  engine::InferenceSession session({DeviceRef::CPU()}, {}, {.num_threads = static_cast<int>(state.range(1))});
  engine::Model model = session.load(g);
  std::vector<kiln::Tensor> inputs{filled(n, 1.f), filled(n, 2.f)};
  for (auto _ : state) benchmark::DoNotOptimize(model.execute(inputs));
  state.SetItemsProcessed(state.iterations());
}

// A chain of four cached eager ops with attributes (the key then includes them): per op, divide by 4.
void BM_EagerChainOfFourOps(benchmark::State& state) {
  const int64_t n = state.range(0);
  nn::Tensor x(kiln::Tensor::from_vector(std::vector<float>(static_cast<size_t>(n * 8), 0.5f), {n, 8}));
  auto chain = [&] { return F::sum(F::softmax(F::silu(x) * 2.0, -1), 0); };
  benchmark::DoNotOptimize(chain());
  for (auto _ : state) benchmark::DoNotOptimize(chain());
  state.SetItemsProcessed(state.iterations() * 4);
}

BENCHMARK(BM_EagerAdd)->Arg(16)->Arg(4096);
BENCHMARK(BM_ModelExecuteAdd)->Args({16, 0})->Args({4096, 0})->Args({16, 1})->Args({4096, 1});
BENCHMARK(BM_EagerChainOfFourOps)->Arg(16);

}  // namespace

BENCHMARK_MAIN();
