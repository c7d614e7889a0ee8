// A ModuleV3 on two devices whose forward calls kiln's allreduce through signal_buffers(): staged
// with the signal buffers at a chosen input position, compiled, and run with engine::Signals buffers.
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "kiln/engine/signals.h"
#include "kiln/graph/ops.h"
#include "kiln/nn/functional.h"
#include "kiln/nn/module_v3.h"

namespace {

using namespace kiln;
namespace ops = kiln::graph::ops;
using graph::BufferType;
using graph::TensorType;
using nn::TypeTree;

const DeviceRef kCpu0 = DeviceRef::CPU(0), kCpu1 = DeviceRef::CPU(1);

// forward(x0 on cpu:0, x1 on cpu:1) = allreduce_sum(x0 * scale, x1): one result per device.
class ScaledAllreduce : public nn::ModuleV3 {
 public:
  ScaledAllreduce() : scale_(register_parameter("scale", kiln::Tensor::from_vector<float>({1, 2, 3, 4}, {4}))) {
    set_devices({kCpu0, kCpu1});
  }
  nn::TensorTree forward(const std::vector<nn::TensorTree>& args) override {
    const std::vector<nn::Tensor> signals = signal_buffers();
    EXPECT_EQ(signals.size(), 2u);
    nn::Tensor scaled = args.at(0).leaf() * scale_;
    auto sums = ops::allreduce_sum({scaled.value(), args.at(1).leaf().value()},
                                   {signals.at(0).value(), signals.at(1).value()});
    return nn::TensorTree::list({nn::Tensor(sums[0]), nn::Tensor(sums[1])});
  }

 private:
  nn::Parameter scale_;
};

const std::vector<TypeTree> kInputTypes{TypeTree(TensorType{DType::f32, {4}, kCpu0}),
                                        TypeTree(TensorType{DType::f32, {4}, kCpu1})};

kiln::Tensor on_device(const std::vector<float>& values, DeviceRef device) {
  kiln::Tensor t = kiln::Tensor::empty(DType::f32, {static_cast<int64_t>(values.size())}, device);
  std::memcpy(t.data(), values.data(), values.size() * sizeof(float));
  return t;
}

class ModuleV3Signals : public ::testing::TestWithParam<int> {};

TEST_P(ModuleV3Signals, AllreduceRunsWithSignalBuffersAtTheGivenIndex) {
  const int index = GetParam();
  ScaledAllreduce m;
  nn::CompileOptions options;
  options.signal_buffer_index = index;
  options.session = std::make_shared<nn::EagerSession>(nn::EagerSessionOptions{.devices = {kCpu0, kCpu1}});
  nn::CompiledModuleV3 compiled = m.compile(kInputTypes, options);

  // The model takes the two signal buffers at `index` among its inputs.
  const graph::Type x0 = TensorType{DType::f32, {4}, kCpu0}, x1 = TensorType{DType::f32, {4}, kCpu1};
  const graph::Type s0 = BufferType{DType::u8, {engine::SIGNAL_BYTES}, kCpu0};
  const graph::Type s1 = BufferType{DType::u8, {engine::SIGNAL_BYTES}, kCpu1};
  const std::vector<graph::Type> expected_types =
      index == 0 ? std::vector<graph::Type>{s0, s1, x0, x1} : std::vector<graph::Type>{x0, s0, s1, x1};
  EXPECT_EQ(compiled.model().input_metadata(), expected_types);

  // x0 * [1, 2, 3, 4] + x1, on both devices.
  engine::Signals signals({kCpu0, kCpu1});
  for (int call = 0; call < 3; ++call) {
    const float c = static_cast<float>(call);
    kiln::Tensor a = on_device({1 + c, 1, 2, -1}, kCpu0), b = on_device({10, 20, 30, 40 + c}, kCpu1);
    std::vector<kiln::Tensor> inputs =
        index == 0 ? std::vector<kiln::Tensor>{signals.buffers()[0], signals.buffers()[1], a, b}
                   : std::vector<kiln::Tensor>{a, signals.buffers()[0], signals.buffers()[1], b};
    std::vector<kiln::Tensor> out = compiled.model().execute(inputs);
    const std::vector<float> expected{(1 + c) * 1 + 10, 1 * 2 + 20, 2 * 3 + 30, -1 * 4 + 40 + c};
    ASSERT_EQ(out.size(), 2u);
    EXPECT_EQ(out[0].device(), kCpu0);
    EXPECT_EQ(out[1].device(), kCpu1);
    EXPECT_EQ(out[0].to_vector<float>(), expected) << "call " << call;
    EXPECT_EQ(out[1].to_vector<float>(), expected) << "call " << call;

    // Called without signal buffers, the compiled module passes its own.
    std::vector<kiln::Tensor> own = compiled({a, b});
    EXPECT_EQ(own.at(1).to_vector<float>(), expected) << "call " << call;
  }
}

INSTANTIATE_TEST_SUITE_P(Index, ModuleV3Signals, ::testing::Values(0, 1));

}  // namespace
