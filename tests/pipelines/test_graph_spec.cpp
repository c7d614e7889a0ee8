// GraphSpec: one test per row of DESIGN.md's contract table (nn::Module rows), and compile_graph_specs.
#include <gtest/gtest.h>

#include "test_util.h"

#include <kiln/kiln.h>

using namespace kiln;
using kiln::testing::error_message;
using kiln::testing::expect_error;
using graph::TensorType;
using graph::BufferType;
namespace ops = kiln::graph::ops;

namespace {

// y = x * scale + offset, with a weight of its own.
class ScaleShift : public nn::Module {
 public:
  explicit ScaleShift(int64_t n) { scale_ = register_weight("scale", DType::f32, {n}); }
  nn::Values forward(const std::vector<nn::Values>& args) override {
    graph::TensorValue x = args.at(0).leaf();
    graph::TensorValue offset = args.at(1).leaf();
    return nn::Values(x * weight(scale_) + offset);
  }

 private:
  WeightId scale_;
};

// Argmax over the last axis: a "sampler" with no weights.
class Greedy : public nn::Module {
 public:
  nn::Values forward(const std::vector<nn::Values>& args) override {
    return nn::Values(ops::argmax(graph::TensorValue(args.at(0).leaf()), -1));
  }
};

// Takes {"tokens", "cache": {"k", "v"}}, records the tree it received, writes tokens into both
// cache buffers and returns the tokens doubled.
class TreeModule : public nn::Module {
 public:
  std::optional<nn::TypeTree> input_tree() const override {
    using T = nn::TypeTree;
    return T::map({{"tokens", T(TensorType{DType::f32, {"seq"}})},
                   {"cache", T::map({{"k", T(BufferType{DType::f32, {8}})},
                                     {"v", T(BufferType{DType::f32, {8}})}})}});
  }
  nn::Values forward(const std::vector<nn::Values>& args) override {
    received = args;
    const nn::Values& tree = args.at(0);
    graph::TensorValue tokens = tree["tokens"].leaf();
    ops::buffer_store(tree["cache"]["k"].leaf(), tokens, {{0, "seq"}});
    ops::buffer_store(tree["cache"]["v"].leaf(), tokens * 2.0, {{0, "seq"}});
    return nn::Values(tokens * 2.0);
  }
  std::vector<nn::Values> received;
};

Tensor vec(std::vector<float> v) { return Tensor::from_vector(v, {static_cast<int64_t>(v.size())}); }

pipelines::GraphSpec scale_shift_spec(std::shared_ptr<nn::Module> m, std::string name = "scale_shift") {
  pipelines::GraphSpec spec;
  spec.module = std::move(m);
  spec.name = std::move(name);
  spec.input_types = std::vector<nn::TypeTree>{nn::TypeTree(TensorType{DType::f32, {3}}),
                                               nn::TypeTree(TensorType{DType::f32, {3}})};
  return spec;
}

}  // namespace

// Row `module`: forward runs inside the graph on its inputs; its results are the outputs.
TEST(GraphSpec, ModuleForwardBecomesTheGraph) {
  auto m = std::make_shared<ScaleShift>(3);
  m->load_state_dict({{"scale", vec({1, 2, 3})}});
  auto spec = scale_shift_spec(m);
  graph::Graph g = spec.trace();
  EXPECT_EQ(g.ir().inputs.size(), 2u);
  EXPECT_EQ(g.ir().outputs.size(), 1u);

  engine::InferenceSession session;
  auto models = pipelines::compile_graph_specs(session, {spec});
  auto out = models.at("scale_shift").execute({vec({1, 1, 1}), vec({10, 20, 30})});
  EXPECT_EQ(out.at(0).to_vector<float>(), (std::vector<float>{11, 22, 33}));
}

// Row `module`: a null module is a ValueError naming the spec, from each method.
TEST(GraphSpec, NullModuleIsAValueErrorNamingTheSpec) {
  auto spec = scale_shift_spec(std::shared_ptr<nn::Module>());
  expect_error<ValueError>([&] { spec.trace(); }, "GraphSpec 'scale_shift': trace: module is null");
  expect_error<ValueError>([&] { spec.weights_registry(); },
                           "GraphSpec 'scale_shift': weights_registry: module is null");
  engine::InferenceSession session;
  expect_error<ValueError>([&] { pipelines::compile_graph_specs(session, {spec}); },
                           "GraphSpec 'scale_shift': trace: module is null");
}

// Row `name`: the graph's name; the result is keyed by it.
TEST(GraphSpec, NameNamesTheGraphAndTheModel) {
  auto spec = scale_shift_spec(std::make_shared<ScaleShift>(3), "affine");
  EXPECT_EQ(spec.trace().name(), "affine");
  engine::InferenceSession session;
  auto models = pipelines::compile_graph_specs(session, {spec});
  ASSERT_EQ(models.count("affine"), 1u);
  EXPECT_EQ(models.at("affine").name(), "affine");
}

TEST(GraphSpec, DuplicateNamesInAGroupNameBoth) {
  auto a = scale_shift_spec(std::make_shared<ScaleShift>(3), "model");
  auto b = scale_shift_spec(std::make_shared<ScaleShift>(3), "model");
  a.group = b.group = "llm";
  engine::InferenceSession session;
  std::string msg = error_message<ValueError>([&] { pipelines::compile_graph_specs(session, {a, b}); });
  EXPECT_NE(msg.find("two specs are named 'model'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("'llm' and 'llm'"), std::string::npos) << msg;
}

// Row `input_types`, sequence form: one tree per forward argument.
TEST(GraphSpec, SequenceInputTypesGiveOneArgumentPerTree) {
  auto m = std::make_shared<ScaleShift>(3);
  auto spec = scale_shift_spec(m);
  graph::Graph g = spec.trace();
  ASSERT_EQ(g.ir().input_types().size(), 2u);
  EXPECT_EQ(graph::to_string(g.ir().input_types()[1]), "f32[3]");
}

// Row `input_types`, named-tree form: the module receives the same tree, leaves in input order.
TEST(GraphSpec, NamedTreeInputTypesReachTheModuleAsTheSameTree) {
  auto m = std::make_shared<TreeModule>();
  pipelines::GraphSpec spec;
  spec.module = m;
  spec.name = "tree";
  spec.input_types = m->input_tree().value();
  graph::Graph g = spec.trace();

  ASSERT_EQ(m->received.size(), 1u);
  const nn::Values& tree = m->received[0];
  ASSERT_TRUE(tree.is_map());
  EXPECT_EQ(tree.entries()[0].first, "tokens");
  EXPECT_EQ(tree.entries()[1].first, "cache");
  EXPECT_EQ(tree["cache"].entries()[0].first, "k");
  EXPECT_EQ(tree["cache"].entries()[1].first, "v");
  EXPECT_EQ(tree["tokens"].leaf().id(), g.ir().inputs[0]);
  EXPECT_EQ(tree["cache"]["k"].leaf().id(), g.ir().inputs[1]);
  EXPECT_EQ(tree["cache"]["v"].leaf().id(), g.ir().inputs[2]);
  EXPECT_TRUE(tree["cache"]["v"].leaf().is_buffer());

  // And it runs: the buffers are written in place.
  engine::InferenceSession session;
  auto model = pipelines::compile_graph_specs(session, {spec}).at("tree");
  Tensor k = Tensor::zeros(DType::f32, {8}), v = Tensor::zeros(DType::f32, {8});
  auto out = model.execute({vec({1, 2, 3}), k, v});
  EXPECT_EQ(out.at(0).to_vector<float>(), (std::vector<float>{2, 4, 6}));
  EXPECT_EQ(k.to_vector<float>(), (std::vector<float>{1, 2, 3, 0, 0, 0, 0, 0}));
  EXPECT_EQ(v.to_vector<float>(), (std::vector<float>{2, 4, 6, 0, 0, 0, 0, 0}));
}

// Row `weights`: an explicit registry wins over the module's state_dict.
TEST(GraphSpec, ExplicitWeightsAreWhatTheGraphBinds) {
  auto m = std::make_shared<ScaleShift>(3);
  m->load_state_dict({{"scale", vec({1, 1, 1})}});
  auto spec = scale_shift_spec(m);
  spec.weights = WeightsRegistry{{"scale", vec({2, 3, 4})}};
  EXPECT_EQ(spec.weights_registry().at("scale").to_vector<float>(), (std::vector<float>{2, 3, 4}));
  engine::InferenceSession session;
  auto out = pipelines::compile_graph_specs(session, {spec}).at("scale_shift").execute({vec({1, 1, 1}), vec({0, 0, 0})});
  EXPECT_EQ(out.at(0).to_vector<float>(), (std::vector<float>{2, 3, 4}));
}

// Row `weights`, default: the module's state_dict(). Its names are fixed when a weight is registered
// (the qualified path from the root), so they are known before any trace; the trace adds only the
// weights forward registers itself (below).
TEST(GraphSpec, DefaultWeightsAreTheStateDictNamedAtRegistration) {
  struct Outer : nn::Module {
    Outer() { inner = register_module("inner", std::make_shared<ScaleShift>(3)); }
    nn::Values forward(const std::vector<nn::Values>& args) override { return inner->forward(args); }
    std::shared_ptr<ScaleShift> inner;
  };
  auto m = std::make_shared<Outer>();
  m->load_state_dict({{"inner.scale", vec({5, 6, 7})}});
  auto spec = scale_shift_spec(m);
  ASSERT_EQ(spec.weights_registry().size(), 1u);  // before any trace
  EXPECT_EQ(spec.weights_registry().at("inner.scale").to_vector<float>(), (std::vector<float>{5, 6, 7}));
  graph::Graph g = spec.trace();
  ASSERT_EQ(g.ir().weights.size(), 1u);
  EXPECT_EQ(g.ir().weights[0].name, "inner.scale");
  auto reg = spec.weights_registry();
  ASSERT_EQ(reg.size(), 1u);
  EXPECT_EQ(reg.at("inner.scale").to_vector<float>(), (std::vector<float>{5, 6, 7}));
}

namespace {

// x + bias, where forward registers the bias on its first trace, shaped like x: a weight whose name
// and shape only the trace fixes.
class LazyBias : public nn::Module {
 public:
  nn::Values forward(const std::vector<nn::Values>& args) override {
    graph::TensorValue x = args.at(0).leaf();
    if (!bias_) bias_ = register_weight("bias", DType::f32, x.shape());
    return nn::Values(x + weight(*bias_));
  }

 private:
  std::optional<WeightId> bias_;
};

struct HoldsLazyBias : nn::Module {
  HoldsLazyBias() { lazy = register_module("lazy", std::make_shared<LazyBias>()); }
  nn::Values forward(const std::vector<nn::Values>& args) override { return lazy->forward(args); }
  std::shared_ptr<LazyBias> lazy;
};

pipelines::GraphSpec lazy_bias_spec(std::shared_ptr<nn::Module> m) {
  pipelines::GraphSpec spec;
  spec.module = std::move(m);
  spec.name = "lazy";
  spec.input_types = std::vector<nn::TypeTree>{nn::TypeTree(TensorType{DType::f32, {3}})};
  return spec;
}

}  // namespace

// Row `weights`, default, read after tracing: a weight forward registers lazily is in it, named by
// its path, with zeros until a registry sets it (as MAX's state_dict does).
TEST(GraphSpec, DefaultWeightsIncludeAWeightRegisteredLazilyInForward) {
  auto m = std::make_shared<HoldsLazyBias>();
  auto spec = lazy_bias_spec(m);
  EXPECT_TRUE(spec.weights_registry().empty());  // not registered before the first trace
  graph::Graph g = spec.trace();
  ASSERT_EQ(g.ir().weights.size(), 1u);
  EXPECT_EQ(g.ir().weights[0].name, "lazy.bias");
  EXPECT_EQ(g.ir().weights[0].shape, (graph::Shape{3}));
  EXPECT_EQ(spec.weights_registry().at("lazy.bias").to_vector<float>(), (std::vector<float>{0, 0, 0}));

  // compile_graph_specs reads the registry after its own trace, so a never-traced module works too.
  engine::InferenceSession session;
  auto fresh = pipelines::compile_graph_specs(session, {lazy_bias_spec(std::make_shared<HoldsLazyBias>())});
  EXPECT_EQ(fresh.at("lazy").execute({vec({1, 2, 3})}).at(0).to_vector<float>(),
            (std::vector<float>{1, 2, 3}));

  // Once registered, it loads like any weight, and tracing again registers nothing new.
  m->load_state_dict({{"lazy.bias", vec({10, 20, 30})}});
  auto models = pipelines::compile_graph_specs(session, {spec});
  EXPECT_EQ(models.at("lazy").execute({vec({1, 2, 3})}).at(0).to_vector<float>(),
            (std::vector<float>{11, 22, 33}));
  EXPECT_EQ(m->state_dict().size(), 1u);
}

// A forward that registers its weight on every call works once; the second trace is refused, naming
// the weight by its path.
TEST(GraphSpec, AWeightRegisteredOnEveryTraceIsRefusedTheSecondTime) {
  class Unguarded : public nn::Module {
   public:
    nn::Values forward(const std::vector<nn::Values>& args) override {
      graph::TensorValue x = args.at(0).leaf();
      return nn::Values(x + weight(register_weight("bias", DType::f32, x.shape())));
    }
  };
  struct Holder : nn::Module {
    Holder() { inner = register_module("inner", std::make_shared<Unguarded>()); }
    nn::Values forward(const std::vector<nn::Values>& args) override { return inner->forward(args); }
    std::shared_ptr<Unguarded> inner;
  };
  auto spec = lazy_bias_spec(std::make_shared<Holder>());
  spec.trace();
  expect_error<ValueError>([&] { spec.trace(); }, "register_weight: 'inner.bias' is registered twice");
}

// Row `group`: one graph::Module, compiled once; each spec a named submodel; one merged registry.
TEST(GraphSpec, GroupCompilesOnceWithANamedSubmodelPerSpec) {
  auto model_module = std::make_shared<ScaleShift>(3);
  model_module->load_state_dict({{"scale", vec({1, -1, 2})}});
  auto model = scale_shift_spec(model_module, "model");
  model.group = "llm";
  pipelines::GraphSpec sampler;
  sampler.module = std::make_shared<Greedy>();
  sampler.name = "sampler";
  sampler.input_types = std::vector<nn::TypeTree>{nn::TypeTree(TensorType{DType::f32, {"batch", 3}})};
  sampler.group = "llm";

  engine::InferenceSession session;
  int64_t before = session.compile_count();
  auto models = pipelines::compile_graph_specs(session, {model, sampler});
  EXPECT_EQ(session.compile_count() - before, 1);
  ASSERT_EQ(models.size(), 2u);

  auto logits = models.at("model").execute({vec({3, 3, 3}), vec({0, 10, 0})}).at(0);  // [3, 7, 6]
  EXPECT_EQ(logits.to_vector<float>(), (std::vector<float>{3, 7, 6}));
  auto token = models.at("sampler").execute({Tensor::from_vector<float>({3, 7, 6}, {1, 3})}).at(0);
  EXPECT_EQ(token.to_vector<int64_t>(), std::vector<int64_t>{1});

  // Ungrouped specs compile alone: two specs, two compiles.
  model.group.reset();
  sampler.group.reset();
  before = session.compile_count();
  pipelines::compile_graph_specs(session, {model, sampler});
  EXPECT_EQ(session.compile_count() - before, 2);
}

TEST(GraphSpec, GroupRegistryConflictNamesBothSpecsAndTheWeight) {
  auto a = scale_shift_spec(std::make_shared<ScaleShift>(3), "a");
  auto b = scale_shift_spec(std::make_shared<ScaleShift>(3), "b");
  a.group = b.group = "g";
  a.weights = WeightsRegistry{{"scale", vec({1, 2, 3})}};
  b.weights = WeightsRegistry{{"scale", vec({1, 2, 4})}};
  engine::InferenceSession session;
  std::string msg = error_message<ValueError>([&] { pipelines::compile_graph_specs(session, {a, b}); });
  EXPECT_NE(msg.find("weight 'scale' is bound to different arrays by specs 'a' and 'b'"), std::string::npos) << msg;

  // Equal arrays (even separately allocated) are not a conflict.
  b.weights = WeightsRegistry{{"scale", vec({1, 2, 3})}};
  EXPECT_EQ(pipelines::compile_graph_specs(session, {a, b}).size(), 2u);
}

// Rows `auto_cast`, `signal_buffer_index`: they mean something only for a ModuleV3 graph, so an
// nn::Module spec that sets one is refused rather than silently ignored.
TEST(GraphSpec, ModuleV3OnlyOptionsOnAModuleSpecAreValueErrors) {
  auto m = std::make_shared<ScaleShift>(3);
  engine::InferenceSession session;
  auto cast = scale_shift_spec(m);
  cast.auto_cast = true;
  const std::string cast_error =
      "GraphSpec 'scale_shift': auto_cast is set, but it applies only to a ModuleV3 graph";
  expect_error<ValueError>([&] { cast.trace(); }, cast_error.c_str());
  expect_error<ValueError>([&] { cast.weights_registry(); }, cast_error.c_str());
  expect_error<ValueError>([&] { pipelines::compile_graph_specs(session, {cast}); }, cast_error.c_str());

  auto signals = scale_shift_spec(m);
  signals.signal_buffer_index = 0;
  const std::string signal_error =
      "GraphSpec 'scale_shift': signal_buffer_index is set (0), but only a ModuleV3 graph gets signal "
      "buffers";
  expect_error<ValueError>([&] { signals.trace(); }, signal_error.c_str());
  expect_error<ValueError>([&] { pipelines::compile_graph_specs(session, {signals}); }, signal_error.c_str());
  EXPECT_EQ(session.compile_count(), 0);
}

// Row `trace(into)`: the graph is added to the given compile unit.
TEST(GraphSpec, TraceIntoAddsToTheModule) {
  graph::Module unit;
  auto a = scale_shift_spec(std::make_shared<ScaleShift>(3), "a");
  auto b = scale_shift_spec(std::make_shared<ScaleShift>(3), "b");
  a.trace(&unit);
  b.trace(&unit);
  EXPECT_EQ(unit.graph_names(), (std::vector<std::string>{"a", "b"}));
  // Tracing a second graph of the same name into the unit is an error naming it.
  std::string msg = error_message<ValueError>([&] { a.trace(&unit); });
  EXPECT_NE(msg.find("'a'"), std::string::npos) << msg;
}

// Row `custom_extensions`: a missing library is an error naming its path (the rest of the row is
// tests/pipelines/test_extensions.cpp).
TEST(GraphSpec, CustomExtensionThatDoesNotExistIsAnErrorNamingThePath) {
  auto spec = scale_shift_spec(std::make_shared<ScaleShift>(3));
  spec.custom_extensions = {"/tmp/kiln_no_such_dir/libmissing.so"};
  engine::InferenceSession session;
  expect_error<ExtensionError>([&] { pipelines::compile_graph_specs(session, {spec}); },
                               {"/tmp/kiln_no_such_dir/libmissing.so", "no such file"});
}

// Row `input_types`: fewer trees than forward takes is a ValueError in the spec's terms.
TEST(GraphSpec, WrongArgumentCountForTheModuleIsAValueErrorNamingTheSpec) {
  auto spec = scale_shift_spec(std::make_shared<ScaleShift>(3));
  spec.input_types = std::vector<nn::TypeTree>{nn::TypeTree(TensorType{DType::f32, {3}})};
  const char* too_few =
      "GraphSpec 'scale_shift': forward read past its arguments (input_types gives it 1 argument tree; does "
      "it take more?)";
  expect_error<ValueError>([&] { spec.trace(); }, too_few);
  engine::InferenceSession session;
  expect_error<ValueError>([&] { pipelines::compile_graph_specs(session, {spec}); }, too_few);
}

// Row `is_device_graph`: the model replays a launch list built at init, and refuses capture.
TEST(GraphSpec, DeviceGraphRunsAndRefusesCapture) {
  auto m = std::make_shared<ScaleShift>(3);
  m->load_state_dict({{"scale", vec({1, 2, 3})}});
  auto spec = scale_shift_spec(m);
  spec.is_device_graph = true;
  auto plain = scale_shift_spec(m, "plain");
  engine::InferenceSession session;
  auto models = pipelines::compile_graph_specs(session, {spec, plain});
  const engine::Model& model = models.at("scale_shift");
  EXPECT_TRUE(model.is_device_graph());
  EXPECT_FALSE(models.at("plain").is_device_graph());
  EXPECT_EQ(model.execute({vec({1, 1, 1}), vec({10, 20, 30})}).at(0).to_vector<float>(),
            (std::vector<float>{11, 22, 33}));
  EXPECT_EQ(model.execute({vec({2, 0, -1}), vec({0, 0, 0})}).at(0).to_vector<float>(),
            (std::vector<float>{2, 0, -3}));
  expect_error<ValueError>([&] { model.capture("k", {vec({1, 1, 1}), vec({0, 0, 0})}); },
                           {"graph 'scale_shift' is a device graph"});
}
