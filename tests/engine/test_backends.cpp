// The device seam: a second device kind registered from the test (an emulated GPU whose memory is the
// host's and whose kernels are the few written below) compiles and runs a graph end to end through the
// unchanged compiler and executor; each backend's kernels and memory serve only its own kind's values.
#include <atomic>
#include <cstring>
#include <memory>
#include <vector>

#include <gtest/gtest.h>

#include "engine/backend.h"
#include "kernels/registry.h"
#include "kiln/engine/session.h"
#include "kiln/errors.h"
#include "kiln/graph/ops.h"
#include "test_util.h"

namespace {

using namespace kiln;
using kiln::testing::expect_error;
namespace ops = kiln::graph::ops;
using kernels::KernelContext;
using kernels::KernelInit;
using kernels::TensorView;

// What the emulated device did, for the test to check.
struct Counters {
  std::atomic<int> launches{0};
  std::atomic<int> allocations{0};
  std::atomic<int> copies{0};
};

// Naive f32 kernels of the emulated device. They see contiguous operands (the executor's slots and
// outputs; the test's inputs are contiguous), so they index rows directly.
void add_f32(const KernelContext&, std::span<const TensorView> in, std::span<const TensorView> out) {
  const int64_t n = out[0].numel();
  for (int64_t i = 0; i < n; ++i) out[0].as<float>()[i] = in[0].as<float>()[i] + in[1].as<float>()[i];
}

void relu_f32(const KernelContext&, std::span<const TensorView> in, std::span<const TensorView> out) {
  const int64_t n = out[0].numel();
  for (int64_t i = 0; i < n; ++i) out[0].as<float>()[i] = std::max(in[0].as<float>()[i], 0.0f);
}

// [M, K] x [K, N]
void matmul_f32(const KernelContext&, std::span<const TensorView> in, std::span<const TensorView> out) {
  const int64_t M = in[0].shape[0], K = in[0].shape[1], N = in[1].shape[1];
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      float acc = 0;
      for (int64_t k = 0; k < K; ++k) acc += in[0].as<float>()[m * K + k] * in[1].as<float>()[k * N + n];
      out[0].as<float>()[m * N + n] = acc;
    }
}

// A kernel factory whose kernels count their launches.
template <kernels::LaunchFn Fn>
kernels::KernelFactory counted(Counters* counters) {
  return [counters](const KernelInit&) -> std::unique_ptr<const kernels::Kernel> {
    struct Counted final : kernels::Kernel {
      explicit Counted(Counters* c) : counters(c) {}
      void run(const KernelContext& ctx, std::span<const TensorView> in, std::span<const TensorView> out) const override {
        counters->launches.fetch_add(1);
        Fn(ctx, in, out);
      }
      Counters* counters;
    };
    return std::make_unique<Counted>(counters);
  };
}

class EmulatedGpu final : public engine::Backend {
 public:
  EmulatedGpu() {
    registry_.add(graph::Op::add, DeviceKind::GPU, {DType::f32}, counted<add_f32>(&counters));
    registry_.add(graph::Op::relu, DeviceKind::GPU, {DType::f32}, counted<relu_f32>(&counters));
    registry_.add(graph::Op::matmul, DeviceKind::GPU, {DType::f32}, counted<matmul_f32>(&counters));
  }
  DeviceKind kind() const override { return DeviceKind::GPU; }
  std::string name() const override { return "emulated-gpu-test"; }
  const kernels::KernelRegistry& kernels() const override { return registry_; }
  bool host_memory() const override { return false; }  // as a real device's: nothing folds on the host
  Tensor allocate(DType dtype, const std::vector<int64_t>& shape, DeviceRef device) const override {
    counters.allocations.fetch_add(1);
    return on_device(Tensor::empty(dtype, shape), device);
  }
  void copy(const Tensor& dst, const Tensor& src) const override {
    counters.copies.fetch_add(1);
    std::memcpy(const_cast<void*>(dst.data()), src.data(), src.nbytes());
  }
  kernels::Parallel* parallel() const override { return &serial_; }
  kernels::DeviceTeam* team() const override { return nullptr; }

  // Host memory labelled as the emulated device's.
  static Tensor on_device(const Tensor& host, DeviceRef device) {
    auto keep = std::make_shared<Tensor>(host);
    return Tensor::view(keep, const_cast<void*>(host.data()), host.dtype(), host.shape(), {}, device);
  }

  mutable Counters counters;

 private:
  kernels::KernelRegistry registry_;
  mutable kernels::SerialParallel serial_;
};

// relu(x @ w + b) on gpu:0, with a symbolic batch.
graph::Graph gpu_mlp() {
  const DeviceRef gpu = DeviceRef::GPU(0);
  graph::Graph g("gpu_mlp", {graph::TensorType{DType::f32, {"batch", 3}, gpu}});
  graph::Graph::Scope scope(g);
  auto w = g.weight({"w", DType::f32, {3, 2}, gpu});
  auto b = g.weight({"b", DType::f32, {2}, gpu});
  auto x = g.input(0);
  g.output({ops::relu(ops::add(ops::matmul(x, w), ops::broadcast_to(b, graph::Shape{"batch", 2})))});
  return g;
}

TEST(Backends, ASecondDeviceKindRegisteredFromTheTestRunsAGraphEndToEnd) {
  auto gpu_backend = std::make_shared<EmulatedGpu>();
  const DeviceRef gpu = DeviceRef::GPU(0);
  graph::Graph g("gpu_mlp", {graph::TensorType{DType::f32, {2, 3}, gpu}, graph::TensorType{DType::f32, {2, 2}, gpu}});
  {
    graph::Graph::Scope scope(g);
    auto w = g.weight({"w", DType::f32, {3, 2}, gpu});
    g.output({ops::relu(ops::add(ops::matmul(g.input(0), w), g.input(1)))});
  }
  engine::InferenceSession session({gpu}, {}, {.compile_cache = false, .backends = {gpu_backend}});
  const Tensor w = EmulatedGpu::on_device(Tensor::from_vector<float>({1, 0, 0, 1, 1, -1}, {3, 2}), gpu);
  engine::Model model = session.load(g, {{"w", w}});
  const int launches_at_init = gpu_backend->counters.launches.load();
  EXPECT_EQ(launches_at_init, 0);  // no constants: nothing runs before execute

  const Tensor x = EmulatedGpu::on_device(Tensor::from_vector<float>({1, 2, 3, -4, 5, 6}, {2, 3}), gpu);
  const Tensor bias = EmulatedGpu::on_device(Tensor::from_vector<float>({0.5f, -10, 0, 0}, {2, 2}), gpu);
  std::vector<Tensor> y = model.execute({x, bias});
  ASSERT_EQ(y.size(), 1u);
  EXPECT_EQ(y[0].device(), gpu);
  // x @ w = [[1 + 3, 2 - 3], [-4 + 6, 5 - 6]] = [[4, -1], [2, -1]]; + bias; relu.
  const Tensor host = Tensor::borrow(const_cast<void*>(y[0].data()), DType::f32, {2, 2});
  EXPECT_EQ(host.to_vector<float>(), (std::vector<float>{4.5f, 0, 2, 0}));
  EXPECT_EQ(gpu_backend->counters.launches.load(), 3);  // matmul, add, relu: all on the emulated device
  EXPECT_GE(gpu_backend->counters.allocations.load(), 1);  // its output, at least, from its own memory

  // A second run with other values, same kernels built at init.
  const Tensor x2 = EmulatedGpu::on_device(Tensor::from_vector<float>({0, 0, 1, 1, 1, 1}, {2, 3}), gpu);
  y = model.execute({x2, bias});
  const Tensor host2 = Tensor::borrow(const_cast<void*>(y[0].data()), DType::f32, {2, 2});
  EXPECT_EQ(host2.to_vector<float>(), (std::vector<float>{1.5f, 0, 2, 0}));
  EXPECT_EQ(gpu_backend->counters.launches.load(), 6);
}

TEST(Backends, ADeviceGraphOnTheEmulatedKindHandsOutResultsInItsMemory) {
  auto gpu_backend = std::make_shared<EmulatedGpu>();
  const DeviceRef gpu = DeviceRef::GPU(0);
  graph::Graph g("gpu_relu", {graph::TensorType{DType::f32, {4}, gpu}});
  {
    graph::Graph::Scope scope(g);
    g.output({ops::relu(g.input(0))});
  }
  engine::InferenceSession session({gpu}, {}, {.compile_cache = false, .backends = {gpu_backend}});
  auto models = session.init(session.compile(g.module()), {}, {"gpu_relu"});
  engine::Model model = models.at("gpu_relu");
  ASSERT_TRUE(model.is_device_graph());
  for (float sign : {1.0f, -1.0f}) {
    const Tensor x = EmulatedGpu::on_device(Tensor::from_vector<float>({sign, -2 * sign, 3 * sign, 0}, {4}), gpu);
    const int copies_before = gpu_backend->counters.copies.load();
    std::vector<Tensor> y = model.execute({x});
    EXPECT_EQ(y[0].device(), gpu);
    // The input copied into the launch list, the result copied out: both by the emulated backend.
    EXPECT_EQ(gpu_backend->counters.copies.load() - copies_before, 2);
    const Tensor host = Tensor::borrow(const_cast<void*>(y[0].data()), DType::f32, {4});
    EXPECT_EQ(host.to_vector<float>(), sign > 0 ? (std::vector<float>{1, 0, 3, 0}) : (std::vector<float>{0, 2, 0, 0}));
  }
}

TEST(Backends, EachKindsKernelsRunOnlyItsOwnValues) {
  // One graph per device kind in one session: the cpu graph runs the cpu kernels, the gpu graph the
  // emulated ones.
  auto gpu_backend = std::make_shared<EmulatedGpu>();
  engine::InferenceSession session({DeviceRef::CPU(), DeviceRef::GPU(0)}, {},
                                   {.compile_cache = false, .backends = {gpu_backend}});
  graph::Graph cpu_graph("cpu_add", {graph::TensorType{DType::f32, {3}}, graph::TensorType{DType::f32, {3}}});
  {
    graph::Graph::Scope scope(cpu_graph);
    cpu_graph.output({ops::add(cpu_graph.input(0), cpu_graph.input(1))});
  }
  engine::Model cpu_model = session.load(cpu_graph);
  const auto y = cpu_model.execute({Tensor::from_vector<float>({1, 2, 3}, {3}), Tensor::from_vector<float>({1, 1, 1}, {3})});
  EXPECT_EQ(y[0].to_vector<float>(), (std::vector<float>{2, 3, 4}));
  EXPECT_EQ(gpu_backend->counters.launches.load(), 0);
  EXPECT_EQ(gpu_backend->counters.allocations.load(), 0);
}

TEST(Backends, AnOpTheDeviceKindLacksIsACompileErrorNamingIt) {
  auto gpu_backend = std::make_shared<EmulatedGpu>();
  engine::InferenceSession session({DeviceRef::GPU(0)}, {}, {.compile_cache = false, .backends = {gpu_backend}});
  graph::Graph g = gpu_mlp();  // broadcast_to: no emulated kernel
  expect_error<Error>([&] { session.load(g, {}); }, {"graph 'gpu_mlp'", "no gpu kernel for broadcast_to on f32"});
}

TEST(Backends, ADeviceWithoutABackendOrTwoBackendsOfOneKindAreValueErrors) {
  expect_error<ValueError>([] { engine::InferenceSession s({DeviceRef::GPU(0)}); },
                           {"gpu:0", "not supported", "no backend runs gpu devices"});
  auto a = std::make_shared<EmulatedGpu>();
  auto b = std::make_shared<EmulatedGpu>();
  expect_error<ValueError>([&] { engine::InferenceSession s({DeviceRef::GPU(0)}, {}, {.backends = {a, b}}); },
                           {"two backends for device kind gpu"});
}

TEST(Backends, TheKernelCatalogIsTheSessionsBackends) {
  auto gpu_backend = std::make_shared<EmulatedGpu>();
  engine::InferenceSession session({DeviceRef::GPU(0)}, {}, {.compile_cache = false, .backends = {gpu_backend}});
  const compiler::KernelCatalog& kernels = session.kernel_catalog();
  EXPECT_TRUE(kernels.has_kernel({graph::Op::matmul, DeviceKind::GPU, DType::f32}));
  EXPECT_FALSE(kernels.has_kernel({graph::Op::matmul, DeviceKind::GPU, DType::bf16}));
  EXPECT_TRUE(kernels.has_kernel({graph::Op::matmul, DeviceKind::CPU, DType::bf16}));
  // Cache keys tell kernel sets apart.
  EXPECT_NE(kernels.fingerprint(), engine::InferenceSession().kernel_catalog().fingerprint());
}

}  // namespace
