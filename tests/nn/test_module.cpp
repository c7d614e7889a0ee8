// nn::Module (v2): registration, fully qualified names, state dicts.
#include <gtest/gtest.h>

#include <kiln/kiln.h>

using namespace kiln;
namespace ops = kiln::graph::ops;

namespace {

class Affine : public nn::Module {
 public:
  Affine(int64_t in, int64_t out) {
    w_ = register_weight("weight", DType::f32, {in, out});
    b_ = register_weight("bias", DType::f32, {out});
  }
  graph::TensorValue operator()(const graph::TensorValue& x) const { return ops::matmul(x, weight(w_)) + weight(b_); }

 private:
  WeightId w_, b_;
};

class Stack : public nn::Module {
 public:
  Stack() {
    layers_ = register_module("layers", std::make_shared<nn::ModuleList<Affine>>());
    layers_->append(std::make_shared<Affine>(2, 3));
    layers_->append(std::make_shared<Affine>(3, 2));
    head_ = register_module("head", std::make_shared<Affine>(2, 1));
  }
  nn::Values forward(const std::vector<nn::Values>& args) override {
    graph::TensorValue x = args.at(0).leaf();
    for (const auto& layer : *layers_) x = (*layer)(x);
    return nn::Values((*head_)(x));
  }

 private:
  std::shared_ptr<nn::ModuleList<Affine>> layers_;
  std::shared_ptr<Affine> head_;
};

std::vector<std::string> keys(const auto& map) {
  std::vector<std::string> out;
  for (const auto& [k, v] : map) out.push_back(k);
  return out;
}

}  // namespace

TEST(Module, QualifiedNamesFollowRegistrationPaths) {
  Stack stack;
  auto raw = stack.raw_state_dict();
  EXPECT_EQ(keys(raw), (std::vector<std::string>{"head.bias", "head.weight", "layers.0.bias", "layers.0.weight",
                                                 "layers.1.bias", "layers.1.weight"}));
  EXPECT_EQ(raw.at("layers.1.weight").shape, graph::Shape({3, 2}));
  EXPECT_EQ(raw.at("layers.1.weight").name, "layers.1.weight");
}

TEST(Module, StateDictIsZerosUntilLoaded) {
  Stack stack;
  auto sd = stack.state_dict();
  ASSERT_EQ(sd.size(), 6u);
  EXPECT_EQ(sd.at("layers.0.weight").shape(), (std::vector<int64_t>{2, 3}));
  for (float v : sd.at("layers.0.weight").to_vector<float>()) EXPECT_EQ(v, 0.f);
}

TEST(Module, LoadStateDictChecksNamesShapesAndDtypes) {
  Stack stack;
  WeightsRegistry reg = stack.state_dict();
  reg["head.bias"] = Tensor::from_vector<float>({5.f}, {1});
  stack.load_state_dict(reg);
  EXPECT_EQ(stack.state_dict().at("head.bias").to_vector<float>(), std::vector<float>{5.f});

  WeightsRegistry wrong_shape = reg;
  wrong_shape["layers.1.weight"] = Tensor::zeros(DType::f32, {2, 3});
  try {
    stack.load_state_dict(wrong_shape);
    FAIL() << "expected ValueError";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("'layers.1.weight' has shape [2, 3], expected [3, 2]"), std::string::npos)
        << e.what();
  }
  WeightsRegistry wrong_dtype = reg;
  wrong_dtype["head.weight"] = Tensor::zeros(DType::f16, {2, 1});
  EXPECT_THROW(stack.load_state_dict(wrong_dtype), ValueError);

  WeightsRegistry missing_and_extra = reg;
  missing_and_extra.erase("head.weight");
  missing_and_extra["head.scale"] = Tensor::zeros(DType::f32, {1});
  try {
    stack.load_state_dict(missing_and_extra);
    FAIL() << "expected ValueError";
  } catch (const ValueError& e) {
    std::string msg = e.what();
    EXPECT_NE(msg.find("missing weights [head.weight]"), std::string::npos) << msg;
    EXPECT_NE(msg.find("unexpected weights [head.scale]"), std::string::npos) << msg;
  }
  // Non-strict loads what matches and ignores the rest.
  stack.load_state_dict(missing_and_extra, /*strict=*/false);
}

TEST(Module, RejectsDuplicateAndReparentedChildren) {
  struct Holder : nn::Module {
    using nn::Module::register_module;
    using nn::Module::register_weight;
  };
  Holder a, b;
  auto child = std::make_shared<Affine>(1, 1);
  a.register_module("x", child);
  EXPECT_THROW(a.register_module("x", std::make_shared<Affine>(1, 1)), ValueError);
  EXPECT_THROW(b.register_module("y", child), ValueError);
  EXPECT_THROW(a.register_weight("x", DType::f32, {1}), ValueError);
  EXPECT_THROW(a.register_weight("dotted.name", DType::f32, {1}), ValueError);
  EXPECT_THROW(a.register_weight("sym", DType::f32, {"n"}), ValueError);
}

TEST(Module, WeightsEnterTheGraphUnderQualifiedNames) {
  Stack stack;
  graph::Graph g("stack", {graph::TensorType{DType::f32, {"batch", 2}}});
  {
    graph::Graph::Scope scope(g);
    g.output(stack.forward({nn::Values(g.input(0))}).flatten());
  }
  std::vector<std::string> names;
  for (const auto& w : g.ir().weights) names.push_back(w.name);
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, keys(stack.raw_state_dict()));
}
