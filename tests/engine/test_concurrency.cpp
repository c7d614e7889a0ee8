// Safe from many threads: one Model (or its copies) executed from several threads at once gives, on
// every call, bit for bit what the same call gives single-threaded; profiling counts every launch of
// every thread; captures replay in turn; and compiling, loading and the compile cache work from
// several threads at once. The tsan preset runs these under ThreadSanitizer (.ci/run).
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <functional>
#include <latch>
#include <mutex>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "engine/cpu/thread_pool.h"
#include "kiln/engine/compile_cache.h"
#include "kiln/kiln.h"
#include "test_util.h"

namespace {

using namespace kiln;
using engine::InferenceSession;
using engine::SessionOptions;
using graph::BufferType;
using graph::Dim;
using graph::TensorType;
namespace ops = kiln::graph::ops;
namespace fs = std::filesystem;

// More threads than CI's 2 cores, so runs are preempted midway and interleave.
constexpr int kThreads = 4;
// Executes per thread in the main tests, under TSan too (where one such test takes about 2 s on 2
// cores); the other tests run fewer.
constexpr int kRuns = 1000;

// Runs fn(thread) on `threads` threads, released together so their calls overlap. An exception in a
// thread is a test failure naming it (not std::terminate).
void on_threads(int threads, const std::function<void(int)>& fn) {
  std::latch start(threads);
  std::mutex errors_mutex;
  std::vector<std::string> errors;
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t)
    pool.emplace_back([&, t] {
      start.arrive_and_wait();
      try {
        fn(t);
      } catch (const std::exception& e) {
        std::lock_guard lock(errors_mutex);
        errors.push_back("thread " + std::to_string(t) + ": " + e.what());
      }
    });
  for (auto& thread : pool) thread.join();
  for (const std::string& e : errors) ADD_FAILURE() << e;
}

// Same dtype, shape and bytes.
bool same_bits(const Tensor& a, const Tensor& b) {
  if (a.dtype() != b.dtype() || a.shape() != b.shape()) return false;
  const Tensor pa = a.clone(), pb = b.clone();  // packed
  return std::memcmp(pa.data(), pb.data(), pa.nbytes()) == 0;
}
bool same_bits(const std::vector<Tensor>& a, const std::vector<Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (!same_bits(a[i], b[i])) return false;
  return true;
}

std::vector<float> random_values(std::mt19937& rng, size_t n) {
  std::uniform_real_distribution<float> dist(-1.f, 1.f);
  std::vector<float> v(n);
  for (auto& e : v) e = dist(rng);
  return v;
}

// ---- one MLP, many threads ----------------------------------------------------------------------------

// y = (relu(x @ w1 + b1) * 0.5) @ w2 and its row sums, x f32[batch, in]: matmuls (big enough at the
// larger batches to split over a pool), a fused elementwise tail and a reduction.
constexpr int64_t kIn = 64, kHidden = 96, kOut = 32;
const std::vector<int64_t> kBatches = {1, 3, 8, 17, 32, 5, 24};

struct Mlp {
  graph::Module module;
  WeightsRegistry weights;
  std::vector<float> w1, b1, w2;
};

Mlp mlp() {
  graph::Graph g("mlp", {TensorType{DType::f32, {"batch", kIn}}});
  {
    graph::Graph::Scope scope(g);
    auto w1 = g.weight({"w1", DType::f32, {kIn, kHidden}});
    auto b1 = g.weight({"b1", DType::f32, {kHidden}});
    auto w2 = g.weight({"w2", DType::f32, {kHidden, kOut}});
    auto h = ops::mul(ops::relu(ops::add(ops::matmul(g.input(0), w1), b1)), ops::constant(0.5, DType::f32));
    auto y = ops::matmul(h, w2);
    g.output({y, ops::sum(y, -1)});
  }
  std::mt19937 rng(11);
  Mlp m{g.module(), {}, random_values(rng, kIn * kHidden), random_values(rng, kHidden), random_values(rng, kHidden * kOut)};
  m.weights = {{"w1", Tensor::from_vector(m.w1, {kIn, kHidden})},
               {"b1", Tensor::from_vector(m.b1, {kHidden})},
               {"w2", Tensor::from_vector(m.w2, {kHidden, kOut})}};
  return m;
}

// Row 0 of y by plain loops: the reference results are a real MLP's, not just self-consistent.
std::vector<double> mlp_row0(const Mlp& m, const std::vector<float>& x) {
  std::vector<double> y(kOut, 0.0);
  for (int64_t h = 0; h < kHidden; ++h) {
    double pre = m.b1[static_cast<size_t>(h)];
    for (int64_t i = 0; i < kIn; ++i) pre += double(x[static_cast<size_t>(i)]) * m.w1[static_cast<size_t>(i * kHidden + h)];
    const double act = std::max(pre, 0.0) * 0.5;
    for (int64_t o = 0; o < kOut; ++o) y[static_cast<size_t>(o)] += act * m.w2[static_cast<size_t>(h * kOut + o)];
  }
  return y;
}

// Per thread, a few inputs of different batch sizes and values; a thread cycles through its own, so
// consecutive runs (and the threads' runs) differ in shape.
struct Case {
  std::vector<float> x;
  Tensor input;
  std::vector<Tensor> expected;  // what the model gives for it single-threaded
};
constexpr int kCasesPerThread = 5;

std::vector<std::vector<Case>> mlp_cases(const engine::Model& model) {
  std::vector<std::vector<Case>> cases(kThreads);
  for (int t = 0; t < kThreads; ++t)
    for (int i = 0; i < kCasesPerThread; ++i) {
      std::mt19937 rng(static_cast<unsigned>(100 * t + i));
      const int64_t batch = kBatches[static_cast<size_t>(t * kCasesPerThread + i) % kBatches.size()];
      Case c;
      c.x = random_values(rng, static_cast<size_t>(batch * kIn));
      c.input = Tensor::from_vector(c.x, {batch, kIn});
      c.expected = model.execute({c.input});
      cases[static_cast<size_t>(t)].push_back(std::move(c));
    }
  return cases;
}

void check_reference(const Mlp& m, const std::vector<std::vector<Case>>& cases) {
  const Case& c = cases.at(1).at(2);
  const std::vector<float> y = c.expected.at(0).to_vector<float>(), sums = c.expected.at(1).to_vector<float>();
  ASSERT_EQ(c.expected.at(0).shape(), (std::vector<int64_t>{c.input.shape()[0], kOut}));
  const std::vector<double> want = mlp_row0(m, c.x);
  double sum = 0;
  for (int64_t o = 0; o < kOut; ++o) {
    EXPECT_NEAR(y[static_cast<size_t>(o)], want[static_cast<size_t>(o)], 1e-4) << o;
    sum += want[static_cast<size_t>(o)];
  }
  EXPECT_NEAR(sums.at(0), sum, 1e-3);
}

// kThreads threads x kRuns executes of `model` (each thread its own copy with `copies`), every result
// compared with the single-threaded one. Returns the wrong results per thread.
std::vector<int> run_mlp_threads(const engine::Model& model, const std::vector<std::vector<Case>>& cases,
                                 bool copies) {
  std::vector<int> wrong(kThreads, 0);
  on_threads(kThreads, [&](int t) {
    const engine::Model own = copies ? engine::Model(model) : engine::Model();
    const engine::Model& m = copies ? own : model;
    const auto& mine = cases[static_cast<size_t>(t)];
    for (int r = 0; r < kRuns; ++r) {
      const Case& c = mine[static_cast<size_t>(r) % mine.size()];
      wrong[static_cast<size_t>(t)] += !same_bits(m.execute({c.input}), c.expected);
    }
  });
  return wrong;
}

TEST(Concurrency, ThreadsExecutingOneModelGetTheSingleThreadedResults) {
  // One pool thread: each caller runs its kernels itself, all at once.
  InferenceSession session({DeviceRef::CPU()}, {}, SessionOptions{.num_threads = 1, .compile_cache = false});
  const Mlp m = mlp();
  auto compiled = session.compile(m.module);
  std::multiset<graph::Op> ops_run;
  for (const auto& step : compiled.plan("mlp").steps) ops_run.insert(step.op);
  EXPECT_EQ(ops_run.count(graph::Op::matmul), 2u);
  EXPECT_EQ(ops_run.count(graph::Op::fused_elementwise), 1u);
  EXPECT_EQ(ops_run.count(graph::Op::sum), 1u);
  const engine::Model model = session.init(compiled, m.weights).at("mlp");
  const auto cases = mlp_cases(model);
  check_reference(m, cases);
  EXPECT_EQ(run_mlp_threads(model, cases, /*copies=*/false), std::vector<int>(kThreads, 0));
}

TEST(Concurrency, ThreadsShareTheSessionsThreadPool) {
  // Two pool threads: the larger batches' matmuls split over the pool, which serves one caller's
  // launch at a time while the others wait or run theirs inline.
  InferenceSession session({DeviceRef::CPU()}, {}, SessionOptions{.num_threads = 2, .compile_cache = false});
  const Mlp m = mlp();
  const engine::Model model = session.load(m.module, m.weights);
  const auto cases = mlp_cases(model);
  check_reference(m, cases);
  EXPECT_EQ(run_mlp_threads(model, cases, /*copies=*/false), std::vector<int>(kThreads, 0));
}

TEST(Concurrency, CopiesOfAModelRunFromSeveralThreads) {
  InferenceSession session({DeviceRef::CPU()}, {}, SessionOptions{.num_threads = 2, .compile_cache = false});
  const Mlp m = mlp();
  const engine::Model model = session.load(m.module, m.weights);
  const auto cases = mlp_cases(model);
  EXPECT_EQ(run_mlp_threads(model, cases, /*copies=*/true), std::vector<int>(kThreads, 0));
}

// Outside threads calling the pool at once take turns, so no more chunks ever run at once than the
// pool has threads (the callers never oversubscribe the cores), and each call covers its range.
TEST(Concurrency, ThePoolServesOneOutsideCallerAtATime) {
  engine::ThreadPool pool(2);
  std::atomic<int> active{0}, most{0};
  std::vector<int> wrong(kThreads, 0);
  on_threads(kThreads, [&](int t) {
    for (int call = 0; call < 200; ++call) {
      const int64_t n = 8 + (t + call) % 5;
      std::vector<std::atomic<int>> hits(static_cast<size_t>(n));
      pool.for_range(n, 1, [&](int64_t begin, int64_t end) {
        const int now = active.fetch_add(1) + 1;
        for (int seen = most.load(); now > seen && !most.compare_exchange_weak(seen, now);) {
        }
        for (int64_t i = begin; i < end; ++i) hits[static_cast<size_t>(i)]++;
        std::this_thread::yield();  // give another caller's chunk the chance to overlap this one
        active.fetch_sub(1);
      });
      for (const auto& h : hits) wrong[static_cast<size_t>(t)] += h.load() != 1;
    }
  });
  EXPECT_EQ(wrong, std::vector<int>(kThreads, 0));
  EXPECT_GE(most.load(), 1);
  EXPECT_LE(most.load(), pool.num_threads());
}

// ---- aliases and buffer inputs ------------------------------------------------------------------------

// A KV-cache pattern: each call appends its rows f32[seq, width] to a layer of the buffer
// f32[layers, max_seq, width] at [total - seq, total) and reads rows [0, total) of that layer back
// through views (buffer_load and reshape are aliases); total is bound by positions i64[total]. Per
// layer: the history's column sums times (layer + 1), and a slice view of the history's last row.
constexpr int64_t kLayers = 2, kMaxSeq = 12, kWidth = 4;

graph::Module kv_module() {
  graph::Graph g("kv", {BufferType{DType::f32, {kLayers, kMaxSeq, kWidth}}, TensorType{DType::f32, {"seq", kWidth}},
                        TensorType{DType::i64, {"total"}}});
  graph::Graph::Scope scope(g);
  const Dim seq = graph::shape_of(g.input(1).type())[0];
  const Dim total = graph::shape_of(g.input(2).type())[0];
  std::vector<graph::Value> outputs;
  for (int64_t layer = 0; layer < kLayers; ++layer) {
    auto rows = ops::mul(g.input(1), ops::constant(static_cast<double>(layer + 1), DType::f32));
    ops::buffer_store(g.input(0), ops::reshape(rows, graph::Shape{1, seq, kWidth}), {{layer, layer + 1}, {total - seq, total}});
    auto history = ops::reshape(ops::buffer_load(g.input(0), {{layer, layer + 1}, {0, total}}), graph::Shape{total, kWidth});
    outputs.push_back(ops::sum(history, 0));
    outputs.push_back(ops::neg(ops::slice(history, {{total - 1, total}})));
  }
  g.output(outputs);
  return g.module();
}

// One thread's calls: rows appended until the buffer is full, then it starts over on zeros.
struct KvCall {
  Tensor rows, positions;
  bool reset = false;          // zero the buffer before this call
  std::vector<Tensor> expected;
  std::vector<float> buffer;   // the buffer's contents after it
};

std::vector<KvCall> kv_calls(int thread, int count) {
  std::mt19937 rng(static_cast<unsigned>(7 + thread));
  std::vector<KvCall> calls;
  int64_t total = 0;
  for (int i = 0; i < count; ++i) {
    const int64_t seq = 1 + (thread + i) % 3;
    KvCall call;
    call.reset = total + seq > kMaxSeq;
    if (call.reset) total = 0;
    total += seq;
    call.rows = Tensor::from_vector(random_values(rng, static_cast<size_t>(seq * kWidth)), {seq, kWidth});
    call.positions = Tensor::zeros(DType::i64, {total});
    calls.push_back(std::move(call));
  }
  return calls;
}

void run_kv_calls(const engine::Model& model, std::vector<KvCall>& calls, bool record, int& wrong) {
  Tensor buffer = Tensor::zeros(DType::f32, {kLayers, kMaxSeq, kWidth});  // this thread's own
  for (KvCall& call : calls) {
    if (call.reset) std::memset(buffer.data(), 0, buffer.nbytes());
    std::vector<Tensor> out = model.execute({buffer, call.rows, call.positions});
    if (record) {
      call.expected = std::move(out);
      call.buffer = buffer.to_vector<float>();
    } else {
      wrong += !same_bits(out, call.expected) || buffer.to_vector<float>() != call.buffer;
    }
  }
}

TEST(Concurrency, AliasesAndBufferInputsFromSeveralThreads) {
  InferenceSession session({DeviceRef::CPU()}, {}, SessionOptions{.num_threads = 2, .compile_cache = false});
  auto compiled = session.compile(kv_module());
  int aliases = 0;
  for (const auto& value : compiled.plan("kv").values) aliases += value.kind == compiler::ValueKind::alias;
  EXPECT_GE(aliases, 2 * kLayers);  // the loads and reshapes at least
  const engine::Model model = session.init(compiled, {}).at("kv");

  const int count = kRuns / 2;
  std::vector<std::vector<KvCall>> calls;
  for (int t = 0; t < kThreads; ++t) {
    calls.push_back(kv_calls(t, count));
    int unused = 0;
    run_kv_calls(model, calls.back(), /*record=*/true, unused);
  }
  // The reference is right: the first call's sums are its rows' column sums times (layer + 1).
  const std::vector<float> rows = calls[0][0].rows.to_vector<float>();
  const std::vector<float> sums = calls[0][0].expected.at(2).to_vector<float>();  // layer 1
  for (int64_t c = 0; c < kWidth; ++c) {
    float want = 0;
    for (size_t r = 0; r * kWidth < rows.size(); ++r) want += rows[r * kWidth + static_cast<size_t>(c)] * 2.f;
    EXPECT_NEAR(sums.at(static_cast<size_t>(c)), want, 1e-5);
  }

  std::vector<int> wrong(kThreads, 0);
  on_threads(kThreads, [&](int t) {
    run_kv_calls(model, calls[static_cast<size_t>(t)], /*record=*/false, wrong[static_cast<size_t>(t)]);
  });
  EXPECT_EQ(wrong, std::vector<int>(kThreads, 0));
}

// ---- profiling ----------------------------------------------------------------------------------------

TEST(Concurrency, ProfilingCountsEveryLaunchOfEveryThread) {
  InferenceSession session({DeviceRef::CPU()}, {}, SessionOptions{.num_threads = 2, .compile_cache = false});
  const Mlp m = mlp();
  const engine::Model model = session.load(m.module, m.weights);
  const auto cases = mlp_cases(model);
  const int runs = kRuns / 4;
  model.start_profiling();
  std::vector<int> wrong(kThreads, 0);
  on_threads(kThreads, [&](int t) {
    for (int r = 0; r < runs; ++r) {
      const Case& c = cases[static_cast<size_t>(t)][static_cast<size_t>(r) % kCasesPerThread];
      wrong[static_cast<size_t>(t)] += !same_bits(model.execute({c.input}), c.expected);
    }
  });
  model.stop_profiling();
  EXPECT_EQ(wrong, std::vector<int>(kThreads, 0));
  const engine::ModelProfile profile = model.profile();
  EXPECT_EQ(profile.runs, kThreads * runs);
  ASSERT_EQ(profile.steps.size(), 4u);  // two matmuls, the fused tail, the sum
  int64_t launches = 0;
  for (const auto& step : profile.steps) {
    EXPECT_EQ(step.launches, kThreads * runs) << step.op;
    launches += step.launches;
  }
  EXPECT_EQ(launches, int64_t{kThreads} * runs * 4);

  // Turning profiling on and off and reading it while others execute is safe (the counts are then
  // whatever landed while it was on) and changes no result.
  std::atomic<bool> done{false};
  std::thread toggler([&] {
    for (int i = 0; !done.load(); ++i) {
      if (i % 2) model.start_profiling(); else model.stop_profiling();
      EXPECT_LE(model.profile().runs, int64_t{kThreads} * runs);
      std::this_thread::yield();
    }
  });
  on_threads(kThreads, [&](int t) {
    for (int r = 0; r < runs; ++r) {
      const Case& c = cases[static_cast<size_t>(t)][static_cast<size_t>(r) % kCasesPerThread];
      wrong[static_cast<size_t>(t)] += !same_bits(model.execute({c.input}), c.expected);
    }
  });
  done = true;
  toggler.join();
  EXPECT_EQ(wrong, std::vector<int>(kThreads, 0));
}

// ---- capture/replay and device graphs -------------------------------------------------------------------

// y = relu(x @ w) * 2 on a static x f32[4, 8].
graph::Module static_module() {
  graph::Graph g("fixed", {TensorType{DType::f32, {4, 8}}});
  graph::Graph::Scope scope(g);
  auto w = g.weight({"w", DType::f32, {8, 8}});
  g.output({ops::mul(ops::relu(ops::matmul(g.input(0), w)), ops::constant(2.0, DType::f32))});
  return g.module();
}

TEST(Concurrency, CapturesAndDeviceGraphsReplayInTurn) {
  InferenceSession session({DeviceRef::CPU()}, {}, SessionOptions{.num_threads = 2, .compile_cache = false});
  std::mt19937 rng(5);
  const WeightsRegistry weights = {{"w", Tensor::from_vector(random_values(rng, 64), {8, 8})}};
  auto compiled = session.compile(static_module());
  const engine::Model model = session.init(compiled, weights).at("fixed");
  const engine::Model device_graph = session.init(compiled, weights, {"fixed"}).at("fixed");
  ASSERT_TRUE(device_graph.is_device_graph());
  std::vector<std::vector<Tensor>> inputs(kThreads), expected(kThreads);
  for (int t = 0; t < kThreads; ++t)
    for (int i = 0; i < 3; ++i) {
      inputs[static_cast<size_t>(t)].push_back(Tensor::from_vector(random_values(rng, 32), {4, 8}));
      expected[static_cast<size_t>(t)].push_back(model.execute({inputs[static_cast<size_t>(t)].back()}).at(0));
    }

  std::vector<int> wrong(kThreads, 0);
  const int runs = kRuns / 4;
  on_threads(kThreads, [&](int t) {
    const auto& in = inputs[static_cast<size_t>(t)];
    const auto& want = expected[static_cast<size_t>(t)];
    int& bad = wrong[static_cast<size_t>(t)];
    const std::string key = "thread " + std::to_string(t);  // each thread its own capture
    bad += !same_bits(model.capture(key, {in[0]}).at(0), want[0]);
    for (int r = 0; r < runs; ++r) {
      const size_t i = static_cast<size_t>(r) % in.size();
      bad += !same_bits(model.replay(key, {in[i]}).at(0), want[i]);      // the capture's own result tensor
      bad += !same_bits(device_graph.execute({in[i]}).at(0), want[i]);   // cloned out of the shared list
      bad += !same_bits(model.execute({in[i]}).at(0), want[i]);
    }
    model.release(key);
  });
  EXPECT_EQ(wrong, std::vector<int>(kThreads, 0));
}

// ---- compiling and loading ----------------------------------------------------------------------------

// y = relu(x @ w) + offset, x f32[batch, 3]: `offset` makes graphs that differ (and so cache keys).
graph::Module proj_module(float offset) {
  graph::Graph g("proj", {TensorType{DType::f32, {"batch", 3}}});
  graph::Graph::Scope scope(g);
  auto w = g.weight({"w", DType::f32, {3, 2}});
  g.output({ops::add(ops::relu(ops::matmul(g.input(0), w)), ops::constant(offset, DType::f32))});
  return g.module();
}
const WeightsRegistry kProjWeights = {{"w", Tensor::from_vector<float>({1, -1, 2, 0, -1, 3}, {3, 2})}};
const Tensor kProjX = Tensor::from_vector<float>({1, 2, 3, -1, 0, 1}, {2, 3});
// relu(x @ w) by hand: [[2, 8], [0, 4]].
std::vector<float> proj_expected(float offset) { return {2 + offset, 8 + offset, 0 + offset, 4 + offset}; }

using kiln::testing::TempDir;

constexpr int kVariants = 3;
float offset_of(int variant) { return 0.25f * static_cast<float>(variant + 1); }

// Every thread compiles and loads: the one shared module (the same graph, from one object), and
// modules it builds itself (different graphs, each also built by other threads), and runs each model.
void compile_from_threads(const InferenceSession& session, int rounds) {
  const graph::Module shared = proj_module(offset_of(0));
  std::vector<int> wrong(kThreads, 0);
  on_threads(kThreads, [&](int t) {
    int& bad = wrong[static_cast<size_t>(t)];
    for (int r = 0; r < rounds; ++r) {
      bad += session.load(shared, kProjWeights).execute({kProjX}).at(0).to_vector<float>() != proj_expected(offset_of(0));
      const int variant = (t + r) % kVariants;
      auto compiled = session.compile(proj_module(offset_of(variant)));
      bad += session.init(compiled, kProjWeights).at("proj").execute({kProjX}).at(0).to_vector<float>() !=
             proj_expected(offset_of(variant));
    }
  });
  EXPECT_EQ(wrong, std::vector<int>(kThreads, 0));
}

TEST(Concurrency, CompileAndLoadFromSeveralThreadsWithoutTheCache) {
  InferenceSession session({DeviceRef::CPU()}, {}, SessionOptions{.num_threads = 2, .compile_cache = false});
  const int rounds = 10;
  compile_from_threads(session, rounds);
  EXPECT_EQ(session.compile_count(), int64_t{kThreads} * rounds * 2);
  EXPECT_EQ(session.cache_hits(), 0);
}

TEST(Concurrency, CompileAndLoadFromSeveralThreadsThroughTheCache) {
  TempDir dir("compile");
  InferenceSession session({DeviceRef::CPU()}, {},
                           SessionOptions{.num_threads = 2, .compile_cache = true, .compile_cache_dir = dir.path()});
  const int rounds = 10;
  compile_from_threads(session, rounds);
  const int64_t compiles = int64_t{kThreads} * rounds * 2;
  EXPECT_EQ(session.compile_count(), compiles);
  EXPECT_LE(session.cache_hits(), compiles - kVariants);  // each graph was compiled at least once
  // One entry per distinct graph, each whole: compiling them all again is all hits.
  engine::CompileCache cache(dir.path());
  EXPECT_EQ(cache.entries().size(), static_cast<size_t>(kVariants));
  const int64_t hits = session.cache_hits();
  for (int v = 0; v < kVariants; ++v)
    EXPECT_EQ(session.init(session.compile(proj_module(offset_of(v))), kProjWeights).at("proj").execute({kProjX}).at(0)
                  .to_vector<float>(),
              proj_expected(offset_of(v)));
  EXPECT_EQ(session.cache_hits(), hits + kVariants);
}

TEST(Concurrency, CompileCacheStoreAndFindFromSeveralThreads) {
  TempDir dir("cache");
  InferenceSession session({DeviceRef::CPU()}, {}, SessionOptions{.num_threads = 1, .compile_cache = false});
  constexpr int kKeys = 4;
  std::vector<compiler::CompiledModel> compiled;
  std::vector<std::string> keys;
  for (int k = 0; k < kKeys; ++k) {
    compiled.push_back(session.compile(proj_module(offset_of(k))));
    keys.push_back("entry" + std::to_string(k));
  }
  const engine::CompileCache cache(dir.path());  // one object, shared by all threads
  const int rounds = 40;
  std::vector<int> wrong(kThreads, 0), hits(kThreads, 0);
  on_threads(kThreads, [&](int t) {
    for (int r = 0; r < rounds; ++r) {
      const int k = (t + r) % kKeys;  // threads store the same keys, and others', at once
      cache.store(keys[static_cast<size_t>(k)], compiled[static_cast<size_t>(k)]);
      const int other = (k + 1) % kKeys;
      // A find sees nothing yet or a whole entry, never a half-written one.
      if (auto hit = cache.find(keys[static_cast<size_t>(other)])) {
        ++hits[static_cast<size_t>(t)];
        wrong[static_cast<size_t>(t)] +=
            session.init(*hit, kProjWeights).at("proj").execute({kProjX}).at(0).to_vector<float>() != proj_expected(offset_of(other));
      }
    }
  });
  EXPECT_EQ(wrong, std::vector<int>(kThreads, 0));
  int total_hits = 0;
  for (int h : hits) total_hits += h;
  EXPECT_GT(total_hits, 0);
  // Every key stored, each entry whole, and no temp file left behind.
  std::vector<engine::CacheEntry> entries = cache.entries();
  ASSERT_EQ(entries.size(), static_cast<size_t>(kKeys));
  for (int k = 0; k < kKeys; ++k) {
    auto hit = cache.find(keys[static_cast<size_t>(k)]);
    ASSERT_TRUE(hit.has_value()) << keys[static_cast<size_t>(k)];
    EXPECT_EQ(session.init(*hit, kProjWeights).at("proj").execute({kProjX}).at(0).to_vector<float>(), proj_expected(offset_of(k)));
  }
  int files = 0;
  for (const auto& entry : fs::directory_iterator(dir.path())) files += entry.is_regular_file();
  EXPECT_EQ(files, kKeys);
}

}  // namespace
