// Compiled artifacts and launch lists: a one-op graph and a 200-op chain compiled cold against loaded
// from the compile cache (warm), and per-call overhead of execute() against replay() on a chain of 200 tiny
// ops.
#include <benchmark/benchmark.h>
#include <unistd.h>

#include <filesystem>
#include <string>
#include <vector>

#include "kiln/engine/compile_cache.h"
#include "kiln/engine/session.h"
#include "kiln/graph/ops.h"

namespace {

using namespace kiln;
namespace fs = std::filesystem;
using graph::TensorType;

graph::Module one_op_module() {
  graph::Graph g("add", {TensorType{DType::f32, {"n"}}, TensorType{DType::f32, {"n"}}});
  g.output({graph::ops::add(g.input(0), g.input(1))});
  return g.module();
}

// y = ((x + x) * x - x ...) alternating, 200 ops on f32[8]: launch overhead dominates.
graph::Module chain_module() {
  graph::Graph g("chain", {TensorType{DType::f32, {8}}});
  graph::TensorValue y = g.input(0);
  for (int i = 0; i < 200; ++i) y = i % 2 ? graph::ops::mul(y, g.input(0)) : graph::ops::add(y, g.input(0));
  g.output({y});
  return g.module();
}

engine::SessionOptions options(bool cache, const fs::path& dir = {}) {
  engine::SessionOptions o;
  o.num_threads = 1;
  o.compile_cache = cache;
  o.compile_cache_dir = dir;
  return o;
}

fs::path bench_cache_dir() {
  return fs::temp_directory_path() / ("kiln_bench_cache_" + std::to_string(::getpid()));
}

// range(0): 0 = the one-op graph, 1 = the 200-op chain.
graph::Module bench_module(const benchmark::State& state) {
  return state.range(0) == 0 ? one_op_module() : chain_module();
}

void BM_CompileCold(benchmark::State& state) {
  engine::InferenceSession session({DeviceRef::CPU()}, {}, options(false));
  graph::Module module = bench_module(state);
  for (auto _ : state) benchmark::DoNotOptimize(session.compile(module));
}

// A cache hit: the key (printing the module), reading the file and deserializing the plan and IR.
void BM_CompileWarmFromCache(benchmark::State& state) {
  const fs::path dir = bench_cache_dir();
  engine::InferenceSession session({DeviceRef::CPU()}, {}, options(true, dir));
  graph::Module module = bench_module(state);
  session.compile(module);  // fills the cache
  const int64_t hits = session.cache_hits();
  for (auto _ : state) benchmark::DoNotOptimize(session.compile(module));
  if (session.cache_hits() - hits != static_cast<int64_t>(state.iterations()))
    state.SkipWithError("a warm compile missed the cache");
  fs::remove_all(dir);
}

void BM_Execute200TinyOps(benchmark::State& state) {
  engine::InferenceSession session({DeviceRef::CPU()}, {}, options(false));
  engine::Model model = session.load(chain_module());
  std::vector<Tensor> inputs = {Tensor::from_vector(std::vector<float>(8, 1.f), {8})};
  for (auto _ : state) benchmark::DoNotOptimize(model.execute(inputs));
}

void BM_Replay200TinyOps(benchmark::State& state) {
  engine::InferenceSession session({DeviceRef::CPU()}, {}, options(false));
  engine::Model model = session.load(chain_module());
  std::vector<Tensor> inputs = {Tensor::from_vector(std::vector<float>(8, 1.f), {8})};
  model.capture("k", inputs);
  for (auto _ : state) benchmark::DoNotOptimize(model.replay("k", inputs));
}

void BM_DeviceGraph200TinyOps(benchmark::State& state) {
  engine::InferenceSession session({DeviceRef::CPU()}, {}, options(false));
  engine::Model model = session.init(session.compile(chain_module()), {}, {"chain"}).at("chain");
  std::vector<Tensor> inputs = {Tensor::from_vector(std::vector<float>(8, 1.f), {8})};
  for (auto _ : state) benchmark::DoNotOptimize(model.execute(inputs));
}

}  // namespace

BENCHMARK(BM_CompileCold)->Arg(0)->Arg(1)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_CompileWarmFromCache)->Arg(0)->Arg(1)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_Execute200TinyOps)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_Replay200TinyOps)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_DeviceGraph200TinyOps)->Unit(benchmark::kMicrosecond);

BENCHMARK_MAIN();
