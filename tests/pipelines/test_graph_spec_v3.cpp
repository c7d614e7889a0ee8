// GraphSpec with a ModuleV3: one test per ModuleV3 row of DESIGN.md's contract table (module,
// input_types, weights, group, trace(into), is_device_graph, auto_cast, signal_buffer_index).
#include <gtest/gtest.h>

#include "test_util.h"
#include "nn/capturing_logger.h"
#include <kiln/engine/signals.h>
#include <kiln/kiln.h>
#include <kiln/nn/module_v3.h>

#include <string>
#include <vector>

using namespace kiln;
using graph::BufferType;
using graph::TensorType;
namespace F = kiln::nn::functional;

using kiln::testing::error_message;

namespace {

kiln::Tensor vec(std::vector<float> v) {
  return kiln::Tensor::from_vector(v, {static_cast<int64_t>(v.size())});
}

// y = relu(x * scale + shift): scale f32 [3], shift bf16 [3].
class ScaleShiftV3 : public nn::ModuleV3 {
 public:
  ScaleShiftV3()
      : scale(register_parameter("scale", vec({1, 2, 3}))),
        shift(register_parameter(
            "shift", kiln::Tensor::from_vector<bf16_t>({bf16_t(-1.f), bf16_t(0.f), bf16_t(1.f)}, {3}))) {}
  nn::TensorTree forward(const std::vector<nn::TensorTree>& args) override {
    return F::relu(args.at(0).leaf() * scale + F::cast(shift, DType::f32));
  }
  nn::Parameter scale, shift;
};

// Takes ({"a", "b"}, c) and returns a * b - c; and on several devices, two inputs a + b.
class TreeSum : public nn::ModuleV3 {
 public:
  nn::TensorTree forward(const std::vector<nn::TensorTree>& args) override {
    if (args.size() == 2 && args[0].is_map())
      return args[0]["a"].leaf() * args[0]["b"].leaf() - args[1].leaf();
    return args.at(0).leaf() + args.at(1).leaf();
  }
};

nn::TypeTree f32(int64_t n) { return nn::TypeTree(TensorType{DType::f32, {n}}); }

pipelines::GraphSpec scale_shift_spec(std::shared_ptr<nn::ModuleV3> m) {
  pipelines::GraphSpec spec;
  spec.module = std::move(m);
  spec.name = "scale_shift";
  spec.input_types = std::vector<nn::TypeTree>{f32(3)};
  return spec;
}

// Warnings reach the logger of the session that compiles the spec (or the one weights_registry() is
// given), not a process-wide handler.
struct CapturedWarnings {
  const std::vector<std::string>& warnings() const { return logger->warnings; }
  std::shared_ptr<kiln::testing::CapturingLogger> logger = std::make_shared<kiln::testing::CapturingLogger>();
};

}  // namespace

// Row `module`: a ModuleV3's forward is traced through stage(); the compiled graph computes what the
// eager forward computes.
TEST(GraphSpecV3, ModuleForwardIsTracedThroughStageAndMatchesEager) {
  auto m = std::make_shared<ScaleShiftV3>();
  auto spec = scale_shift_spec(m);
  graph::Graph g = spec.trace();
  EXPECT_EQ(g.name(), "scale_shift");
  ASSERT_EQ(g.ir().weights.size(), 2u);
  EXPECT_NE(g.ir().find_weight("scale"), nullptr);
  EXPECT_EQ(g.ir().find_weight("shift")->dtype, DType::bf16);

  engine::InferenceSession session;
  auto models = pipelines::compile_graph_specs(session, {spec});
  EXPECT_EQ(session.compile_count(), 1);
  kiln::Tensor x = vec({2, -1, 0.5f});
  // relu([2*1 - 1, -1*2 + 0, 0.5*3 + 1]) = [1, 0, 2.5]
  EXPECT_EQ(models.at("scale_shift").execute({x}).at(0).to_vector<float>(), (std::vector<float>{1, 0, 2.5f}));
  EXPECT_EQ(m->forward({nn::Tensor(x)}).leaf().to_vector<float>(), (std::vector<float>{1, 0, 2.5f}));
}

// Row `module`: a null ModuleV3 is a ValueError naming the spec, from each method.
TEST(GraphSpecV3, NullModuleIsAValueErrorNamingTheSpec) {
  auto spec = scale_shift_spec(std::shared_ptr<nn::ModuleV3>());
  kiln::testing::expect_error<ValueError>([&] { spec.trace(); },
                                          "GraphSpec 'scale_shift': trace: module is null");
  kiln::testing::expect_error<ValueError>([&] { spec.weights_registry(); },
                                          "GraphSpec 'scale_shift': weights_registry: module is null");
}

// Row `input_types`: a sequence, one type or tree per forward argument; the named-tree form is rejected.
TEST(GraphSpecV3, InputTypesAreOneTreePerArgumentAndNotANamedTree) {
  pipelines::GraphSpec spec;
  spec.module = std::make_shared<TreeSum>();
  spec.name = "tree";
  spec.input_types = std::vector<nn::TypeTree>{nn::TypeTree::map({{"a", f32(2)}, {"b", f32(2)}}), f32(2)};
  graph::Graph g = spec.trace();
  EXPECT_EQ(g.ir().num_inputs(), 3);
  engine::InferenceSession session;
  auto models = pipelines::compile_graph_specs(session, {spec});
  EXPECT_EQ(models.at("tree").execute({vec({2, 3}), vec({4, 5}), vec({1, 1})}).at(0).to_vector<float>(),
            (std::vector<float>{7, 14}));

  spec.input_types = nn::TypeTree::map({{"a", f32(2)}, {"b", f32(2)}});
  std::string msg = error_message<ValueError>([&] { spec.trace(); });
  EXPECT_NE(msg.find("GraphSpec 'tree': a ModuleV3 graph takes input_types as a sequence"), std::string::npos)
      << msg;
}

// Row `input_types`: fewer trees than forward takes is a ValueError naming the graph.
TEST(GraphSpecV3, WrongArgumentCountIsAValueErrorNamingTheGraph) {
  pipelines::GraphSpec spec;
  spec.module = std::make_shared<TreeSum>();
  spec.name = "sum";
  spec.input_types = std::vector<nn::TypeTree>{f32(2)};  // its forward reads two
  kiln::testing::expect_error<ValueError>(
      [&] { spec.trace(); },
      "ModuleV3::stage 'sum': forward read past its arguments (input_types gives it 1 argument tree; does it "
      "take more?)");
}

// Row `weights`: nullopt binds the module's own parameters; a registry given replaces them.
TEST(GraphSpecV3, WeightsDefaultToTheModulesOwnParameters) {
  auto m = std::make_shared<ScaleShiftV3>();
  auto spec = scale_shift_spec(m);
  WeightsRegistry registry = spec.weights_registry();
  ASSERT_EQ(registry.size(), 2u);
  EXPECT_EQ(registry.at("scale").data(), m->scale.data().data());  // the parameter's own memory
  EXPECT_EQ(registry.at("shift").data(), m->shift.data().data());

  spec.weights = WeightsRegistry{{"scale", vec({10, 10, 10})}, {"shift", m->shift.data()}};
  engine::InferenceSession session;
  auto models = pipelines::compile_graph_specs(session, {spec});
  EXPECT_EQ(models.at("scale_shift").execute({vec({1, 1, 1})}).at(0).to_vector<float>(),
            (std::vector<float>{9, 10, 11}));
}

// Row `weights`, default: a ModuleV3's weights are the parameters it has when staging begins, so a
// parameter registered inside forward is refused, and the module is left without it.
TEST(GraphSpecV3, AParameterRegisteredLazilyInForwardIsRefused) {
  class Lazy : public nn::ModuleV3 {
   public:
    nn::TensorTree forward(const std::vector<nn::TensorTree>& args) override {
      return args.at(0).leaf() + register_parameter("bias", vec({1, 2, 3}));
    }
  };
  struct Holder : nn::ModuleV3 {
    Holder() { inner = register_module("inner", std::make_shared<Lazy>()); }
    nn::TensorTree forward(const std::vector<nn::TensorTree>& args) override { return inner->forward(args); }
    std::shared_ptr<Lazy> inner;
  };
  auto m = std::make_shared<Holder>();
  auto spec = scale_shift_spec(m);
  const char* refused =
      "register_parameter: parameter 'inner.bias' is registered while its module is being staged (register "
      "parameters in the constructor)";
  kiln::testing::expect_error<ValueError>([&] { spec.trace(); }, refused);
  EXPECT_TRUE(m->parameters().empty());
  engine::InferenceSession session;
  kiln::testing::expect_error<ValueError>([&] { pipelines::compile_graph_specs(session, {spec}); }, refused);
  // Eagerly, forward may register it (once): it is ordinary code then.
  EXPECT_EQ(m->forward({nn::Tensor(vec({1, 1, 1}))}).leaf().to_vector<float>(),
            (std::vector<float>{2, 3, 4}));
  EXPECT_EQ(m->parameters().size(), 1u);
}

// Row `group`: a ModuleV3 compiles on its own.
TEST(GraphSpecV3, GroupIsRejected) {
  auto spec = scale_shift_spec(std::make_shared<ScaleShiftV3>());
  spec.group = "llm";
  engine::InferenceSession session;
  std::string msg = error_message<ValueError>([&] { pipelines::compile_graph_specs(session, {spec}); });
  EXPECT_NE(msg.find("spec 'scale_shift' is a ModuleV3 graph with group 'llm'"), std::string::npos) << msg;
  EXPECT_EQ(session.compile_count(), 0);
}

// Row `trace(into)`: a ModuleV3 graph cannot join another compile unit.
TEST(GraphSpecV3, TraceIntoIsRejected) {
  auto spec = scale_shift_spec(std::make_shared<ScaleShiftV3>());
  graph::Module unit;
  std::string msg = error_message<ValueError>([&] { spec.trace(&unit); });
  EXPECT_NE(msg.find("GraphSpec 'scale_shift': trace(into): a ModuleV3 graph compiles on its own"),
            std::string::npos)
      << msg;
  EXPECT_EQ(unit.size(), 0u);
}

// Row `is_device_graph`: the model replays a launch list built at init, computing what a plain
// model's execute computes, and refuses capture.
TEST(GraphSpecV3, DeviceGraphReplaysWhatExecuteComputesAndRefusesCapture) {
  auto m = std::make_shared<ScaleShiftV3>();
  auto spec = scale_shift_spec(m);
  spec.is_device_graph = true;
  auto plain = scale_shift_spec(m);
  plain.name = "plain";
  engine::InferenceSession session;
  auto models = pipelines::compile_graph_specs(session, {spec, plain});
  const engine::Model& model = models.at("scale_shift");
  EXPECT_TRUE(model.is_device_graph());
  EXPECT_FALSE(models.at("plain").is_device_graph());
  // relu(x * [1, 2, 3] + [-1, 0, 1])
  const kiln::Tensor x1 = vec({2, -1, 0.5f}), x2 = vec({1, 1, 1});
  auto first = model.execute({x1}).at(0), second = model.execute({x2}).at(0);
  EXPECT_EQ(first.to_vector<float>(), (std::vector<float>{1, 0, 2.5f}));  // not overwritten by the second
  EXPECT_EQ(second.to_vector<float>(), (std::vector<float>{0, 2, 4}));
  EXPECT_EQ(second.to_vector<float>(), models.at("plain").execute({x2}).at(0).to_vector<float>());
  kiln::testing::expect_error<ValueError>([&] { model.capture("k", {x1}); },
                                          {"graph 'scale_shift' is a device graph", "capture"});
}

// Row `auto_cast`: f32 <-> bf16 weights are cast to the parameters' dtypes, with one summary warning.
TEST(GraphSpecV3, AutoCastCastsBothWaysAndWarnsOnce) {
  auto m = std::make_shared<ScaleShiftV3>();
  auto spec = scale_shift_spec(m);
  spec.auto_cast = true;
  // scale declared f32, given bf16; shift declared bf16, given f32 (0.5 + 2^-9 rounds to 0.5 in bf16).
  spec.weights = WeightsRegistry{
      {"scale", kiln::Tensor::from_vector<bf16_t>({bf16_t(2.f), bf16_t(2.f), bf16_t(2.f)}, {3})},
      {"shift", vec({0.5f + 1.f / 512, 0, 0})}};
  CapturedWarnings captured;
  engine::InferenceSession session({DeviceRef::CPU()}, {}, {.logger = captured.logger});
  auto models = pipelines::compile_graph_specs(session, {spec});
  EXPECT_EQ(models.at("scale_shift").execute({vec({1, 2, 3})}).at(0).to_vector<float>(),
            (std::vector<float>{2.5f, 4, 6}));
  ASSERT_EQ(captured.warnings().size(), 1u);
  EXPECT_EQ(captured.warnings()[0],
            "GraphSpec 'scale_shift': auto_cast cast 2 weights to their parameters' dtypes: "
            "'scale' bf16 -> f32, 'shift' f32 -> bf16 (loses precision)");
  // weights_registry() alone reports to the logger it is given, and to no other.
  kiln::testing::CapturingLogger direct;
  spec.weights_registry(direct);
  EXPECT_EQ(direct.warnings.size(), 1u);
  EXPECT_EQ(captured.warnings().size(), 1u);
}

TEST(GraphSpecV3, DtypeMismatchWithoutAutoCastNamesTheWeightAndBothDtypes) {
  auto spec = scale_shift_spec(std::make_shared<ScaleShiftV3>());
  spec.weights = WeightsRegistry{{"scale", kiln::Tensor::zeros(DType::bf16, {3})},
                                 {"shift", kiln::Tensor::zeros(DType::bf16, {3})}};
  engine::InferenceSession session;
  std::string msg = error_message<ValueError>([&] { pipelines::compile_graph_specs(session, {spec}); });
  EXPECT_NE(
      msg.find("GraphSpec 'scale_shift': weight 'scale' has dtype bf16 but its parameter is declared f32"),
      std::string::npos)
      << msg;
}

TEST(GraphSpecV3, AutoCastRejectsOtherDtypePairsAndShapeChanges) {
  auto spec = scale_shift_spec(std::make_shared<ScaleShiftV3>());
  spec.auto_cast = true;
  CapturedWarnings captured;
  spec.weights = WeightsRegistry{{"scale", kiln::Tensor::zeros(DType::f64, {3})},
                                 {"shift", kiln::Tensor::zeros(DType::bf16, {3})}};
  std::string msg = error_message<ValueError>([&] { spec.weights_registry(*captured.logger); });
  EXPECT_NE(
      msg.find("weight 'scale' has dtype f64 but its parameter is declared f32; auto_cast casts only between "
               "f32 and bf16"),
      std::string::npos)
      << msg;
  spec.weights = WeightsRegistry{{"scale", vec({1, 2, 3})}, {"shift", kiln::Tensor::zeros(DType::f16, {3})}};
  msg = error_message<ValueError>([&] { spec.weights_registry(*captured.logger); });
  EXPECT_NE(msg.find("weight 'shift' has dtype f16 but its parameter is declared bf16"), std::string::npos)
      << msg;
  spec.weights = WeightsRegistry{{"scale", kiln::Tensor::zeros(DType::bf16, {1, 3})},
                                 {"shift", kiln::Tensor::zeros(DType::bf16, {3})}};
  msg = error_message<ValueError>([&] { spec.weights_registry(*captured.logger); });
  EXPECT_NE(msg.find("weight 'scale' (bf16[1, 3]) cannot be auto_cast to its parameter's f32[3]"),
            std::string::npos)
      << msg;
  EXPECT_TRUE(captured.warnings().empty());
}

// Row `signal_buffer_index`: per-device signal buffers on two or more devices, appended or inserted.
namespace {

pipelines::GraphSpec two_device_spec(std::optional<int> index, bool two_devices = true) {
  auto m = std::make_shared<TreeSum>();
  if (two_devices) m->set_devices({DeviceRef::CPU(0), DeviceRef::CPU(1)});
  pipelines::GraphSpec spec;
  spec.module = m;
  spec.name = "sum";
  spec.input_types = std::vector<nn::TypeTree>{f32(2), f32(2)};
  spec.signal_buffer_index = index;
  return spec;
}

const graph::Type kX = TensorType{DType::f32, {2}};
graph::Type signal(int device) {
  return BufferType{DType::u8, {engine::SIGNAL_BYTES}, DeviceRef::CPU(device)};
}

}  // namespace

TEST(GraphSpecV3, SignalBuffersAreAppendedWhenNoIndexIsGiven) {
  EXPECT_EQ(two_device_spec(std::nullopt).trace().ir().input_types(),
            (std::vector<graph::Type>{kX, kX, signal(0), signal(1)}));
}

TEST(GraphSpecV3, SignalBuffersAreInsertedAtTheIndex) {
  EXPECT_EQ(two_device_spec(0).trace().ir().input_types(),
            (std::vector<graph::Type>{signal(0), signal(1), kX, kX}));
  EXPECT_EQ(two_device_spec(1).trace().ir().input_types(),
            (std::vector<graph::Type>{kX, signal(0), signal(1), kX}));
}

TEST(GraphSpecV3, SingleDeviceGraphGetsNoSignalBuffers) {
  EXPECT_EQ(two_device_spec(std::nullopt, false).trace().ir().input_types(),
            (std::vector<graph::Type>{kX, kX}));
  EXPECT_EQ(two_device_spec(1, false).trace().ir().input_types(), (std::vector<graph::Type>{kX, kX}));
}

TEST(GraphSpecV3, SignalBufferIndexOutOfRangeIsAValueError) {
  std::string msg = error_message<ValueError>([] { two_device_spec(3).trace(); });
  EXPECT_NE(msg.find("signal_buffer_index 3 is out of range for a graph with 2 inputs (expected 0..2)"),
            std::string::npos)
      << msg;
  msg = error_message<ValueError>([] { two_device_spec(-1).trace(); });
  EXPECT_NE(msg.find("signal_buffer_index -1 is out of range for a graph with 2 inputs (expected 0..2)"),
            std::string::npos)
      << msg;
}

TEST(GraphSpecV3, TwoDeviceSessionCompilesAndRunsAGraphTakingSignalBuffers) {
  engine::InferenceSession session({DeviceRef::CPU(0), DeviceRef::CPU(1)});
  auto models = pipelines::compile_graph_specs(session, {two_device_spec(1)});
  const engine::Model& model = models.at("sum");
  ASSERT_EQ(model.input_metadata().size(), 4u);
  auto signals = engine::make_signal_buffers(session.devices());
  EXPECT_EQ(signals[1].device(), DeviceRef::CPU(1));
  EXPECT_EQ(signals[0].nbytes(), static_cast<size_t>(engine::SIGNAL_BYTES));
  auto out = model.execute({vec({1, 2}), signals[0], signals[1], vec({10, 20})});
  EXPECT_EQ(out.at(0).to_vector<float>(), (std::vector<float>{11, 22}));
  // Buffers in the wrong slots are caught by the input checks.
  std::string msg = error_message<ValueError>([&] {
    model.execute({vec({1, 2}), vec({1, 2}), signals[1], vec({1, 2})});
  });
  EXPECT_NE(msg.find("input 1"), std::string::npos) << msg;
  // A session without cpu:1 refuses the graph (its signal buffer 1, input 2, is on cpu:1).
  engine::InferenceSession only0;
  kiln::testing::expect_error<ValueError>(
      [&] { pipelines::compile_graph_specs(only0, {two_device_spec(1)}); },
      {"init: graph 'sum': input 2 is on cpu:1, a device this session does not hold (its devices: [cpu:0]"});
}
