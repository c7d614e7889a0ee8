// kiln's own collectives (ops::allreduce_sum, ops::allgather) over several CPU devices of one process,
// through engine::Signals buffers; across processes with a stand-in process group. Every result is
// checked against sums and concatenations computed here by plain loops.
#include <cstring>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "test_util.h"

#include "kernels/cpu/kernels.h"
#include "kiln/engine/signals.h"
#include "kiln/kiln.h"

namespace {

using namespace kiln;
using kiln::testing::expect_error;
namespace ops = kiln::graph::ops;
using graph::BufferType;
using graph::TensorType;

std::vector<DeviceRef> cpus(int n) {
  std::vector<DeviceRef> devices;
  for (int i = 0; i < n; ++i) devices.push_back(DeviceRef::CPU(i));
  return devices;
}

// A tensor of `values` (element type T) on `device`.
template <class T>
Tensor on_device(const std::vector<T>& values, const std::vector<int64_t>& shape, DeviceRef device) {
  Tensor t = Tensor::empty(dtype_of<T>(), shape, device);
  EXPECT_EQ(static_cast<size_t>(t.numel()), values.size());
  std::memcpy(t.data(), values.data(), values.size() * sizeof(T));
  return t;
}

template <class T> std::vector<T> elements(const Tensor& t) {
  const T* p = static_cast<const T*>(t.data());
  return std::vector<T>(p, p + t.numel());
}

// Integer-valued floats in [-100, 100]: every sum of a few of them is exact in f32.
float integer_value(int64_t i, int device, int call) {
  return static_cast<float>((i * 7 + device * 13 + call * 31) % 201 - 100);
}

// One allreduce_sum over n devices of dtype[count]: inputs x_0 .. x_{n-1}, then the signal buffers.
struct AllreduceModel {
  engine::InferenceSession session;
  engine::Signals signals;
  engine::Model model;

  AllreduceModel(int n, DType dtype, int64_t count, int64_t processes = 1,
                 engine::SessionOptions options = {})
      : session(cpus(n), {}, std::move(options)), signals(cpus(n)) {
    std::vector<graph::Type> types;
    for (int i = 0; i < n; ++i) types.push_back(TensorType{dtype, {count}, DeviceRef::CPU(i)});
    for (const graph::Type& t : signals.input_types()) types.push_back(t);
    graph::Graph g("allreduce", types);
    std::vector<graph::TensorValue> xs;
    std::vector<graph::BufferValue> buffers;
    for (int i = 0; i < n; ++i) {
      xs.push_back(g.input(i));
      buffers.push_back(g.input(n + i));
    }
    auto sums = ops::allreduce_sum(xs, buffers, processes);
    g.output(std::vector<graph::Value>(sums.begin(), sums.end()));
    model = session.load(g);
  }

  std::vector<Tensor> run(const std::vector<Tensor>& xs) const {
    std::vector<Tensor> inputs = xs;
    for (const Tensor& b : signals.buffers()) inputs.push_back(b);
    return model.execute(inputs);
  }
};

// x_d[i] = integer_value(i, d, call) on device d, and their sum by a plain loop.
struct F32Case {
  std::vector<Tensor> inputs;
  std::vector<float> expected;
};
F32Case f32_case(int n, int64_t count, int call) {
  F32Case c;
  c.expected.assign(static_cast<size_t>(count), 0.0f);
  for (int d = 0; d < n; ++d) {
    std::vector<float> x(static_cast<size_t>(count));
    for (int64_t i = 0; i < count; ++i) {
      x[static_cast<size_t>(i)] = integer_value(i, d, call);
      c.expected[static_cast<size_t>(i)] += x[static_cast<size_t>(i)];
    }
    c.inputs.push_back(on_device(x, {count}, DeviceRef::CPU(d)));
  }
  return c;
}

void expect_all_equal(const std::vector<Tensor>& results, const std::vector<float>& expected, int n) {
  ASSERT_EQ(results.size(), static_cast<size_t>(n));
  for (int d = 0; d < n; ++d) {
    EXPECT_EQ(results[d].device(), DeviceRef::CPU(d));
    std::vector<float> got = elements<float>(results[d]);
    ASSERT_EQ(got.size(), expected.size());
    size_t mismatches = 0;
    for (size_t i = 0; i < got.size(); ++i) mismatches += got[i] != expected[i];
    EXPECT_EQ(mismatches, 0u) << "device " << d << " of " << n << ", " << expected.size() << " elements";
  }
}

// ---- allreduce_sum ---------------------------------------------------------------------------------

struct AllreduceSize {
  int devices;
  int64_t count;
};

class AllreduceF32 : public ::testing::TestWithParam<AllreduceSize> {};

TEST_P(AllreduceF32, EveryDeviceGetsTheExactSum) {
  const auto [n, count] = GetParam();
  AllreduceModel m(n, DType::f32, count);
  F32Case c = f32_case(n, count, 0);
  expect_all_equal(m.run(c.inputs), c.expected, n);
}

// 1 element; below, at and above the 1 MiB scratch (262144 f32); 3 MiB; an odd count that splits
// unevenly into slices.
INSTANTIATE_TEST_SUITE_P(Sizes, AllreduceF32,
                         ::testing::Values(AllreduceSize{2, 1}, AllreduceSize{4, 1}, AllreduceSize{2, 1001},
                                           AllreduceSize{4, 1001}, AllreduceSize{2, 262144},
                                           AllreduceSize{4, 262145}, AllreduceSize{2, 786432},
                                           AllreduceSize{4, 786432}, AllreduceSize{2, 1000003},
                                           AllreduceSize{4, 1000003}, AllreduceSize{3, 5}),
                         [](const auto& info) {
                           return std::to_string(info.param.devices) + "Devices" +
                                  std::to_string(info.param.count) + "Elements";
                         });

// bf16/f16: the reference sums the inputs' float values in device order and rounds once.
template <class T>
void check_half_allreduce(int n, int64_t count) {
  AllreduceModel m(n, dtype_of<T>(), count);
  std::vector<Tensor> inputs;
  std::vector<float> sums(static_cast<size_t>(count), 0.0f);
  for (int d = 0; d < n; ++d) {
    std::vector<T> x(static_cast<size_t>(count));
    for (int64_t i = 0; i < count; ++i) {
      // Not integers: sums need rounding, so rounding once vs per add shows.
      x[static_cast<size_t>(i)] = T(static_cast<float>((i * 37 + d * 11) % 1000) / 7.0f - 50.0f);
      sums[static_cast<size_t>(i)] += static_cast<float>(x[static_cast<size_t>(i)]);
    }
    inputs.push_back(on_device(x, {count}, DeviceRef::CPU(d)));
  }
  std::vector<Tensor> results = m.run(inputs);
  for (int d = 0; d < n; ++d) {
    std::vector<T> got = elements<T>(results[d]);
    size_t mismatches = 0;
    for (int64_t i = 0; i < count; ++i)
      mismatches += got[static_cast<size_t>(i)].bits != T(sums[static_cast<size_t>(i)]).bits;
    EXPECT_EQ(mismatches, 0u) << dtype_name(dtype_of<T>()) << " device " << d << " of " << n << ", " << count;
  }
}

TEST(Allreduce, Bf16SumsInFloatAndRoundsOnce) {
  check_half_allreduce<bf16_t>(2, 1001);
  check_half_allreduce<bf16_t>(4, 1001);
  check_half_allreduce<bf16_t>(4, 700001);  // 1.4 MB: above the scratch
}

TEST(Allreduce, F16SumsInFloatAndRoundsOnce) {
  check_half_allreduce<f16_t>(2, 3);
  check_half_allreduce<f16_t>(4, 1001);
  check_half_allreduce<f16_t>(2, 700001);
}

TEST(Allreduce, F64IsExact) {
  AllreduceModel m(2, DType::f64, 3);
  auto out = m.run({on_device<double>({0.1, 1e300, -2}, {3}, DeviceRef::CPU(0)),
                    on_device<double>({0.2, 1e300, 2}, {3}, DeviceRef::CPU(1))});
  EXPECT_EQ(elements<double>(out[0]), (std::vector<double>{0.1 + 0.2, 2e300, 0}));
  EXPECT_EQ(elements<double>(out[1]), elements<double>(out[0]));
}

TEST(Allreduce, ThousandCallsOnTheSameSignalBuffersEachSumTheirOwnData) {
  constexpr int kDevices = 4;
  constexpr int64_t kCount = 333;
  AllreduceModel m(kDevices, DType::f32, kCount);
  int wrong_calls = 0;
  for (int call = 0; call < 1000; ++call) {
    F32Case c = f32_case(kDevices, kCount, call);
    std::vector<Tensor> results = m.run(c.inputs);
    for (int d = 0; d < kDevices; ++d)
      if (elements<float>(results[d]) != c.expected) {
        ++wrong_calls;
        break;
      }
  }
  EXPECT_EQ(wrong_calls, 0);
}

// Small (through the scratch) and large (in place) collectives alternate on the same buffers, and
// every call's results are right, so neither protocol leaves the flags wrong for the other.
TEST(Allreduce, SmallAndLargeCollectivesShareSignalBuffers) {
  constexpr int kDevices = 2;
  constexpr int64_t kSmall = 100, kLarge = 300000;  // 1.2 MB: above the scratch
  engine::InferenceSession session(cpus(kDevices));
  engine::Signals signals(cpus(kDevices));
  std::vector<graph::Type> types;
  for (int64_t count : {kSmall, kLarge})
    for (int d = 0; d < kDevices; ++d) types.push_back(TensorType{DType::f32, {count}, DeviceRef::CPU(d)});
  for (const graph::Type& t : signals.input_types()) types.push_back(t);
  graph::Graph g("two_sizes", types);
  std::vector<graph::BufferValue> buffers{g.input(4), g.input(5)};
  auto small = ops::allreduce_sum({g.input(0), g.input(1)}, buffers);
  auto large = ops::allreduce_sum({g.input(2), g.input(3)}, buffers);
  // Built third, so it runs third: (s + 1) + s on every device.
  auto again = ops::allreduce_sum({small[0] + 1.0, small[1]}, buffers);
  g.output({small[0], large[1], again[1]});
  engine::Model model = session.load(g);

  for (int call = 0; call < 5; ++call) {
    F32Case s = f32_case(kDevices, kSmall, call);
    F32Case l = f32_case(kDevices, kLarge, call + 100);
    auto out = model.execute({s.inputs[0], s.inputs[1], l.inputs[0], l.inputs[1], signals.buffers()[0],
                              signals.buffers()[1]});
    EXPECT_EQ(elements<float>(out[0]), s.expected) << "call " << call;
    EXPECT_EQ(elements<float>(out[1]), l.expected) << "call " << call;
    std::vector<float> twice_plus_one;
    for (float v : s.expected) twice_plus_one.push_back(2 * v + 1);
    EXPECT_EQ(elements<float>(out[2]), twice_plus_one) << "call " << call;
  }
}

TEST(Allreduce, ResultsAreBitIdenticalOnEveryDevice) {
  // Values whose sum depends on the order of the additions: every device must still agree.
  constexpr int kDevices = 4;
  constexpr int64_t kCount = 400000;  // the large path: each device sums a different slice
  AllreduceModel m(kDevices, DType::f32, kCount);
  std::vector<Tensor> inputs;
  for (int d = 0; d < kDevices; ++d) {
    std::vector<float> x(kCount);
    for (int64_t i = 0; i < kCount; ++i) x[i] = (d % 2 ? 1e8f : 1.0f) * (1.0f + static_cast<float>(i % 97) / 97.0f);
    inputs.push_back(on_device(x, {kCount}, DeviceRef::CPU(d)));
  }
  std::vector<Tensor> results = m.run(inputs);
  for (int d = 1; d < kDevices; ++d)
    EXPECT_EQ(std::memcmp(results[d].data(), results[0].data(), results[0].nbytes()), 0) << "device " << d;
  // Device order: ((x0 + x1) + x2) + x3, computed here.
  const float* x[kDevices];
  for (int d = 0; d < kDevices; ++d) x[d] = static_cast<const float*>(inputs[d].data());
  const float* got = static_cast<const float*>(results[0].data());
  size_t mismatches = 0;
  for (int64_t i = 0; i < kCount; ++i) mismatches += got[i] != ((x[0][i] + x[1][i]) + x[2][i]) + x[3][i];
  EXPECT_EQ(mismatches, 0u);
}

// ---- allgather -------------------------------------------------------------------------------------

// The concatenation of row-major [outer, extent_d, inner] parts along the middle axis, by plain loops.
template <class T>
std::vector<T> concat_reference(const std::vector<std::vector<T>>& parts, const std::vector<int64_t>& extents,
                                int64_t outer, int64_t inner) {
  std::vector<T> out;
  for (int64_t o = 0; o < outer; ++o)
    for (size_t d = 0; d < parts.size(); ++d)
      for (int64_t j = 0; j < extents[d] * inner; ++j) out.push_back(parts[d][static_cast<size_t>(o * extents[d] * inner + j)]);
  return out;
}

// allgather of i32 parts of shape [rows, extent_d, 3] along axis 1 (or [extent_d, 3] along axis 0).
void check_allgather(const std::vector<int64_t>& extents, int64_t axis) {
  const int n = static_cast<int>(extents.size());
  const int64_t outer = axis == 0 ? 1 : 2, inner = 3;
  engine::InferenceSession session(cpus(n));
  engine::Signals signals(cpus(n));
  std::vector<graph::Type> types;
  std::vector<std::vector<int32_t>> parts;
  std::vector<Tensor> inputs;
  for (int d = 0; d < n; ++d) {
    std::vector<int64_t> shape = axis == 0 ? std::vector<int64_t>{extents[d], inner}
                                           : std::vector<int64_t>{outer, extents[d], inner};
    std::vector<int32_t> part;
    for (int64_t i = 0; i < outer * extents[d] * inner; ++i) part.push_back(static_cast<int32_t>(d * 1000 + i));
    inputs.push_back(on_device(part, shape, DeviceRef::CPU(d)));
    parts.push_back(part);
    std::vector<graph::Dim> dims(shape.begin(), shape.end());
    types.push_back(TensorType{DType::i32, graph::Shape(dims), DeviceRef::CPU(d)});
  }
  for (const graph::Type& t : signals.input_types()) types.push_back(t);
  for (const Tensor& b : signals.buffers()) inputs.push_back(b);
  graph::Graph g("gather", types);
  std::vector<graph::TensorValue> xs;
  std::vector<graph::BufferValue> buffers;
  for (int d = 0; d < n; ++d) {
    xs.push_back(g.input(d));
    buffers.push_back(g.input(n + d));
  }
  auto gathered = ops::allgather(xs, buffers, axis);
  g.output(std::vector<graph::Value>(gathered.begin(), gathered.end()));
  engine::Model model = session.load(g);

  int64_t total = 0;
  for (int64_t e : extents) total += e;
  const std::vector<int32_t> expected = concat_reference(parts, extents, outer, inner);
  for (int call = 0; call < 3; ++call) {  // again on the same buffers
    std::vector<Tensor> out = model.execute(inputs);
    ASSERT_EQ(out.size(), static_cast<size_t>(n));
    for (int d = 0; d < n; ++d) {
      EXPECT_EQ(out[d].device(), DeviceRef::CPU(d));
      EXPECT_EQ(out[d].shape(), axis == 0 ? (std::vector<int64_t>{total, inner})
                                          : (std::vector<int64_t>{outer, total, inner}));
      EXPECT_EQ(elements<int32_t>(out[d]), expected) << "device " << d << " call " << call;
    }
  }
}

TEST(Allgather, ConcatenatesAlongAxis0InDeviceOrder) {
  check_allgather({2, 1}, 0);
  check_allgather({3, 3, 1, 2}, 0);
}

TEST(Allgather, ConcatenatesUnevenPartsAlongAxis1) {
  check_allgather({1, 2}, 1);
  check_allgather({2, 1, 3, 1}, 1);
}

TEST(Allgather, LargePartsAboveTheScratchSize) {
  check_allgather({200000, 150001}, 0);  // 2.4 MB and 1.8 MB of i32
}

// ---- across processes (a stand-in process group) ---------------------------------------------------

// This process is rank 0 of `size`; rank r > 0 holds this rank's f32 data plus 1000 * r (what an
// allreduce adds, and what an allgather returns as rank r's part). Fails once when asked to.
class FakeGroup final : public ProcessGroup {
 public:
  explicit FakeGroup(int size) : size_(size) {}
  int rank() const override { return 0; }
  int size() const override { return size_; }
  void allreduce_sum(void* data, int64_t count, DType dtype) override {
    check(dtype == DType::f32);
    auto* x = static_cast<float*>(data);
    for (int64_t i = 0; i < count; ++i) {
      float sum = x[i];
      for (int r = 1; r < size_; ++r) sum += x[i] + 1000.0f * static_cast<float>(r);
      x[i] = sum;
    }
  }
  void allgather(const void* send, void* recv, int64_t bytes) override {
    check(bytes % 4 == 0);
    for (int r = 0; r < size_; ++r) {
      const auto* in = static_cast<const float*>(send);
      auto* out = static_cast<float*>(recv) + r * bytes / 4;
      for (int64_t i = 0; i < bytes / 4; ++i) out[i] = in[i] + 1000.0f * static_cast<float>(r);
    }
  }
  void barrier() override {}

  int calls = 0;
  bool fail_next = false;

 private:
  void check(bool ok) {
    ++calls;
    if (!ok) throw std::logic_error("FakeGroup: only f32 data");
    if (fail_next) {
      fail_next = false;
      throw std::runtime_error("rank 1 went away");
    }
  }
  int size_;
};

engine::SessionOptions with_group(std::shared_ptr<ProcessGroup> group) {
  engine::SessionOptions options;
  options.process_group = std::move(group);
  return options;
}

TEST(Allreduce, AcrossProcessesAddsEveryRanksSum) {
  for (auto [n, count] : {std::pair{2, int64_t{1001}}, std::pair{2, int64_t{400001}}, std::pair{1, int64_t{7}}}) {
    auto group = std::make_shared<FakeGroup>(3);
    AllreduceModel m(n, DType::f32, count, /*processes=*/3, with_group(group));
    F32Case c = f32_case(n, count, 0);
    std::vector<Tensor> inputs = c.inputs;
    if (n == 1) inputs = {c.inputs[0]};
    // Ranks 1 and 2 hold the local sum + 1000 and + 2000.
    std::vector<float> expected;
    for (float v : c.expected) expected.push_back(v + (v + 1000) + (v + 2000));
    expect_all_equal(m.run(inputs), expected, n);
    EXPECT_EQ(group->calls, 1) << n << " devices";  // participant 0 alone calls the group
  }
}

TEST(Allreduce, AProcessGroupFailureIsReportedAndTheNextCallWorks) {
  auto group = std::make_shared<FakeGroup>(2);
  AllreduceModel m(2, DType::f32, 64, /*processes=*/2, with_group(group));
  F32Case c = f32_case(2, 64, 0);
  group->fail_next = true;
  expect_error<ExecutionError>([&] { m.run(c.inputs); }, {"allreduce_sum", "rank 1 went away"});
  std::vector<float> expected;
  for (float v : c.expected) expected.push_back(v + (v + 1000));
  expect_all_equal(m.run(c.inputs), expected, 2);
}

TEST(Allgather, AcrossProcessesPlacesEachRanksPartAfterThePreviousOnesAlongTheAxis) {
  // Local parts [2, 1] and [2, 2] on two devices gather to [2, 3] per rank; two ranks give [2, 6]:
  // row o is [rank 0's row o, rank 1's row o].
  auto group = std::make_shared<FakeGroup>(2);
  engine::InferenceSession session(cpus(2), {}, with_group(group));
  engine::Signals signals(cpus(2));
  std::vector<graph::Type> types{TensorType{DType::f32, {2, 1}, DeviceRef::CPU(0)},
                                 TensorType{DType::f32, {2, 2}, DeviceRef::CPU(1)}};
  for (const graph::Type& t : signals.input_types()) types.push_back(t);
  graph::Graph g("gather_ranks", types);
  auto gathered = ops::allgather({g.input(0), g.input(1)}, {g.input(2), g.input(3)}, /*axis=*/1, /*processes=*/2);
  g.output({gathered[0], gathered[1]});
  engine::Model model = session.load(g);
  auto out = model.execute({on_device<float>({1, 2}, {2, 1}, DeviceRef::CPU(0)),
                            on_device<float>({3, 4, 5, 6}, {2, 2}, DeviceRef::CPU(1)), signals.buffers()[0],
                            signals.buffers()[1]});
  const std::vector<float> expected{1, 3, 4, 1001, 1003, 1004,  //
                                    2, 5, 6, 1002, 1005, 1006};
  for (int d = 0; d < 2; ++d) {
    EXPECT_EQ(out[d].shape(), (std::vector<int64_t>{2, 6}));
    EXPECT_EQ(elements<float>(out[d]), expected) << "device " << d;
  }
}

TEST(Allgather, OneDeviceAcrossProcesses) {
  auto group = std::make_shared<FakeGroup>(2);
  engine::InferenceSession session(cpus(1), {}, with_group(group));
  graph::Graph g("gather_one", {TensorType{DType::f32, {2, 2}, DeviceRef::CPU(0)}});
  g.output({ops::allgather({g.input(0)}, {}, /*axis=*/1, /*processes=*/2)[0]});
  auto out = session.load(g).execute({on_device<float>({1, 2, 3, 4}, {2, 2}, DeviceRef::CPU(0))});
  EXPECT_EQ(elements<float>(out[0]), (std::vector<float>{1, 2, 1001, 1002, 3, 4, 1003, 1004}));
}

// ---- errors ----------------------------------------------------------------------------------------

TEST(CollectiveErrors, SignalBufferOfTheWrongTypeIsNamed) {
  graph::Graph g("bad_signal", {TensorType{DType::f32, {4}, DeviceRef::CPU(0)},
                                TensorType{DType::f32, {4}, DeviceRef::CPU(1)},
                                BufferType{DType::u8, {engine::SIGNAL_BYTES}, DeviceRef::CPU(0)},
                                BufferType{DType::u8, {100}, DeviceRef::CPU(1)}});
  expect_error<ValueError>([&] { ops::allreduce_sum({g.input(0), g.input(1)}, {g.input(2), g.input(3)}); },
                           {"allreduce_sum", "signal buffer 1 must be", "u8[100]"});
  graph::Graph h("signal_on_wrong_device", {TensorType{DType::f32, {4}, DeviceRef::CPU(0)},
                                            TensorType{DType::f32, {4}, DeviceRef::CPU(1)},
                                            BufferType{DType::u8, {engine::SIGNAL_BYTES}, DeviceRef::CPU(1)},
                                            BufferType{DType::u8, {engine::SIGNAL_BYTES}, DeviceRef::CPU(0)}});
  expect_error<ValueError>([&] { ops::allgather({h.input(0), h.input(1)}, {h.input(2), h.input(3)}); },
                           {"allgather: signal buffer 0 must be buffer<u8[1052672]> (on input 0's device), got "
                            "buffer<u8[1052672]@cpu:1>"});
}

TEST(CollectiveErrors, TwoInputsOnOneDeviceAreNamed) {
  graph::Graph g("same_device", {TensorType{DType::f32, {4}, DeviceRef::CPU(1)},
                                 TensorType{DType::f32, {4}, DeviceRef::CPU(1)},
                                 BufferType{DType::u8, {engine::SIGNAL_BYTES}, DeviceRef::CPU(1)},
                                 BufferType{DType::u8, {engine::SIGNAL_BYTES}, DeviceRef::CPU(1)}});
  expect_error<ValueError>([&] { ops::allreduce_sum({g.input(0), g.input(1)}, {g.input(2), g.input(3)}); },
                           {"allreduce_sum", "inputs 0 and 1 are both on cpu:1"});
}

TEST(CollectiveErrors, ProcessesWithoutAGroupFailAtInit) {
  expect_error<ValueError>([] { AllreduceModel m(2, DType::f32, 4, /*processes=*/2); },
                           {"init: graph 'allreduce' node", "allreduce_sum spans 2 processes",
                            "the session has no process group"});
  expect_error<ValueError>(
      [] { AllreduceModel m(2, DType::f32, 4, /*processes=*/2, with_group(std::make_shared<FakeGroup>(3))); },
      {"init: graph 'allreduce' node", "allreduce_sum spans 2 processes", "process group has 3"});
}

TEST(CollectiveErrors, ASessionGroupIsIgnoredByCollectivesWithinTheProcess) {
  auto group = std::make_shared<FakeGroup>(5);
  AllreduceModel m(2, DType::f32, 10, /*processes=*/1, with_group(group));
  F32Case c = f32_case(2, 10, 0);
  expect_all_equal(m.run(c.inputs), c.expected, 2);
  EXPECT_EQ(group->calls, 0);
}

TEST(CollectiveErrors, SignalBuffersOutOfStepAreReported) {
  AllreduceModel m(2, DType::f32, 10);
  F32Case c = f32_case(2, 10, 0);
  m.run(c.inputs);
  engine::Signals fresh(cpus(2));
  expect_error<ExecutionError>(
      [&] { m.model.execute({c.inputs[0], c.inputs[1], m.signals.buffers()[0], fresh.buffers()[1]}); },
      {"allreduce_sum", "signal buffers are out of step", "buffer 0 has taken part in 1", "buffer 1 in 0"});
}

TEST(CollectiveErrors, OneSignalBufferForTwoDevicesIsReported) {
  AllreduceModel m(2, DType::f32, 10);
  F32Case c = f32_case(2, 10, 0);
  Tensor buffer0 = m.signals.buffers()[0];
  Tensor alias = Tensor::borrow(buffer0.data(), DType::u8, {engine::SIGNAL_BYTES}, {}, DeviceRef::CPU(1));
  expect_error<ExecutionError>([&] { m.model.execute({c.inputs[0], c.inputs[1], buffer0, alias}); },
                               {"allreduce_sum", "signal buffers 0 and 1 are the same memory"});
}

TEST(CollectiveErrors, SeveralDevicesWithoutADeviceTeamIsAnError) {
  // The kernel itself, called without the engine's team.
  const graph::KernelKey key{graph::Op::allreduce_sum, DeviceKind::CPU, DType::f32};
  engine::Signals signals(cpus(2));
  std::vector<float> a{1, 2}, b{3, 4}, out0(2), out1(2);
  auto view = [](void* data, DType dtype, int64_t size) { return kernels::TensorView{data, dtype, {size}, {1}}; };
  std::vector<kernels::TensorView> inputs{view(a.data(), DType::f32, 2), view(b.data(), DType::f32, 2),
                                          view(const_cast<void*>(signals.buffers()[0].data()), DType::u8, engine::SIGNAL_BYTES),
                                          view(const_cast<void*>(signals.buffers()[1].data()), DType::u8, engine::SIGNAL_BYTES)};
  std::vector<kernels::TensorView> outputs{view(out0.data(), DType::f32, 2), view(out1.data(), DType::f32, 2)};
  kernels::SerialParallel serial;
  kernels::KernelContext context{&serial};
  auto allreduce = [&](int64_t processes) {
    const graph::Attrs attrs{{"processes", processes}};
    const kernels::KernelInit init{key.op, &attrs, inputs, {}, nullptr};
    const auto kernel = kernels::cpu_kernels().build(key, init);
    ASSERT_NE(kernel, nullptr);
    kernel->run(context, inputs, outputs);
  };
  expect_error<ExecutionError>([&] { allreduce(1); }, {"allreduce_sum", "2 devices need a device team"});
  expect_error<ExecutionError>([&] { allreduce(2); },
                               {"allreduce_sum", "spans 2 processes but no process group was given"});
}

// ---- in whole graphs -------------------------------------------------------------------------------

TEST(Collectives, MixWithTransfersBetweenDevices) {
  // x on cpu:0 is copied to cpu:1; each device computes its term, the allreduce sums them, and cpu:1's
  // sum comes back to cpu:0 to be added to cpu:0's.
  engine::InferenceSession session(cpus(2));
  engine::Signals signals(cpus(2));
  graph::Graph g("mixed", {TensorType{DType::f32, {3}, DeviceRef::CPU(0)}, signals.input_types()[0],
                           signals.input_types()[1]});
  graph::TensorValue x = g.input(0);
  graph::TensorValue x1 = ops::transfer_to(x, DeviceRef::CPU(1));
  auto sums = ops::allreduce_sum({x + 1.0, x1 * 2.0}, {g.input(1), g.input(2)});
  graph::TensorValue back = ops::transfer_to(sums[1], DeviceRef::CPU(0));
  g.output({sums[0] + back, sums[1]});
  engine::Model model = session.load(g);
  for (int call = 0; call < 3; ++call) {
    const float c = static_cast<float>(call);
    auto out = model.execute({on_device<float>({1 + c, 2, -3}, {3}, DeviceRef::CPU(0)), signals.buffers()[0],
                              signals.buffers()[1]});
    // s = (x + 1) + 2x = 3x + 1
    std::vector<float> s{3 * (1 + c) + 1, 7, -8};
    EXPECT_EQ(out[0].device(), DeviceRef::CPU(0));
    EXPECT_EQ(out[1].device(), DeviceRef::CPU(1));
    EXPECT_EQ(elements<float>(out[0]), (std::vector<float>{2 * s[0], 2 * s[1], 2 * s[2]}));
    EXPECT_EQ(elements<float>(out[1]), s);
  }
}

TEST(Collectives, CaptureAndReplayRunTheCollectiveAgain) {
  AllreduceModel m(2, DType::f32, 500000);  // the large path: pointers published on every replay
  F32Case first = f32_case(2, 500000, 0);
  std::vector<Tensor> inputs = first.inputs;
  for (const Tensor& b : m.signals.buffers()) inputs.push_back(b);
  expect_all_equal(m.model.capture("k", inputs), first.expected, 2);
  for (int call = 1; call < 4; ++call) {
    F32Case c = f32_case(2, 500000, call);
    std::vector<Tensor> again = c.inputs;
    for (const Tensor& b : m.signals.buffers()) again.push_back(b);
    expect_all_equal(m.model.replay("k", again), c.expected, 2);
  }
}

TEST(Collectives, DeviceGraphsRunCollectives) {
  AllreduceModel m(4, DType::f32, 100);
  graph::Module module;
  std::vector<graph::Type> types;
  for (int d = 0; d < 4; ++d) types.push_back(TensorType{DType::f32, {100}, DeviceRef::CPU(d)});
  for (const graph::Type& t : m.signals.input_types()) types.push_back(t);
  graph::Graph g("dg", types, &module);
  auto sums = ops::allreduce_sum({g.input(0), g.input(1), g.input(2), g.input(3)},
                                 {g.input(4), g.input(5), g.input(6), g.input(7)});
  g.output(std::vector<graph::Value>(sums.begin(), sums.end()));
  auto models = m.session.init(m.session.compile(module), {}, {"dg"});
  ASSERT_TRUE(models.at("dg").is_device_graph());
  for (int call = 0; call < 5; ++call) {
    F32Case c = f32_case(4, 100, call);
    std::vector<Tensor> inputs = c.inputs;
    for (const Tensor& b : m.signals.buffers()) inputs.push_back(b);
    expect_all_equal(models.at("dg").execute(inputs), c.expected, 4);
  }
}

}  // namespace
