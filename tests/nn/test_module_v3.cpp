// ModuleV3 and eager nn::Tensor: eager ops against hand-computed values, the eager cache, parameters,
// stage(), compile() (an MLP and an attention block run eagerly and compiled against naive loops
// written here), auto_cast and signal buffers.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "kiln/engine/signals.h"
#include "kiln/graph/text.h"
#include "kiln/nn/functional.h"
#include "kiln/nn/module_v3.h"
#include "nn/capturing_logger.h"
#include "test_util.h"

using kiln::testing::error_message;

namespace {

using namespace kiln;
namespace F = kiln::nn::functional;
using graph::BufferType;
using graph::TensorType;
using nn::TypeTree;

std::vector<float> random_values(std::mt19937& rng, size_t n, float scale = 1.f) {
  std::uniform_real_distribution<float> dist(-scale, scale);
  std::vector<float> v(n);
  for (auto& e : v) e = dist(rng);
  return v;
}

kiln::Tensor random_tensor(std::mt19937& rng, const std::vector<int64_t>& shape, float scale = 1.f) {
  size_t n = 1;
  for (auto d : shape) n *= static_cast<size_t>(d);
  return kiln::Tensor::from_vector(random_values(rng, n, scale), shape);
}

// Fills every parameter of `m` with random data.
void randomize(nn::ModuleV3& m, std::mt19937& rng, float scale = 0.5f) {
  for (const auto& [name, p] : m.parameters()) p.set(random_tensor(rng, p.shape(), scale));
}

// ---- test modules --------------------------------------------------------------------------------

// y = x W^T + b, W [out, in].
class Linear : public nn::ModuleV3 {
 public:
  Linear(int64_t in, int64_t out)
      : weight(register_parameter("weight", kiln::Tensor::zeros(DType::f32, {out, in}))),
        bias(register_parameter("bias", kiln::Tensor::zeros(DType::f32, {out}))) {}
  nn::Tensor operator()(const nn::Tensor& x) { return F::matmul(x, F::transpose(weight, 0, 1)) + bias; }
  nn::TensorTree forward(const std::vector<nn::TensorTree>& args) override {
    return (*this)(args.at(0).leaf());
  }

  nn::Parameter weight, bias;
};

// down(silu(up(x))).
class MLP : public nn::ModuleV3 {
 public:
  MLP(int64_t dim, int64_t hidden)
      : up(register_module("up", std::make_shared<Linear>(dim, hidden))),
        down(register_module("down", std::make_shared<Linear>(hidden, dim))) {}
  nn::Tensor operator()(const nn::Tensor& x) { return (*down)(F::silu((*up)(x))); }
  nn::TensorTree forward(const std::vector<nn::TensorTree>& args) override {
    return (*this)(args.at(0).leaf());
  }

  std::shared_ptr<Linear> up, down;
};

// Causal multi-head self-attention over x [seq, dim]; the mask is eager data made in forward, so a
// staged graph holds it as a constant.
class Attention : public nn::ModuleV3 {
 public:
  Attention(int64_t dim, int64_t heads)
      : heads_(heads),
        head_dim_(dim / heads),
        q(register_module("q_proj", std::make_shared<Linear>(dim, dim))),
        k(register_module("k_proj", std::make_shared<Linear>(dim, dim))),
        v(register_module("v_proj", std::make_shared<Linear>(dim, dim))),
        o(register_module("o_proj", std::make_shared<Linear>(dim, dim))) {}

  nn::Tensor operator()(const nn::Tensor& x) {
    const int64_t seq = x.shape()[0].static_value();
    const int64_t dim = heads_ * head_dim_;
    auto split_heads = [&](const nn::Tensor& t) {  // [seq, dim] -> [heads, seq, head_dim]
      return F::transpose(F::reshape(t, std::vector<int64_t>{seq, heads_, head_dim_}), 0, 1);
    };
    nn::Tensor qh = split_heads((*q)(x)), kh = split_heads((*k)(x)), vh = split_heads((*v)(x));
    nn::Tensor scores = F::matmul(qh, F::transpose(kh, 1, 2)) * (1.0 / std::sqrt(double(head_dim_)));
    std::vector<float> mask(static_cast<size_t>(seq * seq), 0.f);  // [seq, seq]
    for (int64_t i = 0; i < seq; ++i)
      for (int64_t j = i + 1; j < seq; ++j) mask[static_cast<size_t>(i * seq + j)] = -1e9f;
    nn::Tensor probs =
        F::softmax(scores + nn::Tensor::from_vector(mask, {seq, seq}), -1);  // [heads, seq, seq]
    nn::Tensor context = F::transpose(F::matmul(probs, vh), 0, 1);           // [seq, heads, hd]
    return (*o)(F::reshape(context, std::vector<int64_t>{seq, dim}));
  }
  nn::TensorTree forward(const std::vector<nn::TensorTree>& args) override {
    return (*this)(args.at(0).leaf());
  }

  int64_t heads_, head_dim_;
  std::shared_ptr<Linear> q, k, v, o;
};

// ---- naive references ------------------------------------------------------------------------------

using Matrix = std::vector<double>;  // row-major

Matrix linear_ref(const Matrix& x, int64_t rows, const Linear& l) {
  auto w = l.weight.data().to_vector<double>();
  auto b = l.bias.data().to_vector<double>();
  const int64_t out = l.weight.shape()[0], in = l.weight.shape()[1];
  Matrix y(static_cast<size_t>(rows * out));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t o = 0; o < out; ++o) {
      double acc = b[static_cast<size_t>(o)];
      for (int64_t i = 0; i < in; ++i)
        acc += x[static_cast<size_t>(r * in + i)] * w[static_cast<size_t>(o * in + i)];
      y[static_cast<size_t>(r * out + o)] = acc;
    }
  return y;
}

Matrix mlp_ref(const Matrix& x, int64_t rows, const MLP& m) {
  Matrix h = linear_ref(x, rows, *m.up);
  for (double& e : h) e = e / (1.0 + std::exp(-e));
  return linear_ref(h, rows, *m.down);
}

Matrix attention_ref(const Matrix& x, int64_t seq, const Attention& a) {
  Matrix q = linear_ref(x, seq, *a.q), k = linear_ref(x, seq, *a.k), v = linear_ref(x, seq, *a.v);
  const int64_t heads = a.heads_, hd = a.head_dim_, dim = heads * hd;
  Matrix context(static_cast<size_t>(seq * dim), 0.0);
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t i = 0; i < seq; ++i) {
      std::vector<double> p(static_cast<size_t>(i + 1));  // causal: keys 0..i
      double top = -1e300, total = 0;
      for (int64_t j = 0; j <= i; ++j) {
        double s = 0;
        for (int64_t d = 0; d < hd; ++d)
          s += q[static_cast<size_t>(i * dim + h * hd + d)] * k[static_cast<size_t>(j * dim + h * hd + d)];
        p[static_cast<size_t>(j)] = s / std::sqrt(double(hd));
        top = std::max(top, p[static_cast<size_t>(j)]);
      }
      for (double& e : p) total += (e = std::exp(e - top));
      for (int64_t j = 0; j <= i; ++j)
        for (int64_t d = 0; d < hd; ++d)
          context[static_cast<size_t>(i * dim + h * hd + d)] +=
              p[static_cast<size_t>(j)] / total * v[static_cast<size_t>(j * dim + h * hd + d)];
    }
  return linear_ref(context, seq, *a.o);
}

void expect_close(const std::vector<float>& got, const Matrix& want, double tol) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], want[i], tol) << "element " << i;
}

Matrix to_double(const kiln::Tensor& t) { return t.to_vector<double>(); }

// ---- eager tensors -------------------------------------------------------------------------------

TEST(NnTensor, EagerOpsRunAtOnce) {
  nn::Tensor x = nn::Tensor::from_vector<float>({1, -2, 3}, {3});
  nn::Tensor y = F::relu(x) * 2.0 - 1.0;
  ASSERT_TRUE(y.is_eager());
  EXPECT_EQ(y.to_vector<float>(), (std::vector<float>{1, -1, 5}));
  nn::Tensor a = nn::Tensor::from_vector<float>({1, 2, 3, 4, 5, 6}, {2, 3});
  nn::Tensor b = nn::Tensor::from_vector<float>({1, 0, 0, 1, 1, 1}, {3, 2});
  // [[1 2 3], [4 5 6]] x [[1 0], [0 1], [1 1]] = [[4 5], [10 11]]
  EXPECT_EQ(F::matmul(a, b).to_vector<float>(), (std::vector<float>{4, 5, 10, 11}));
  EXPECT_EQ(F::sum(a, 0).to_vector<float>(), (std::vector<float>{5, 7, 9}));
  EXPECT_EQ(F::sum(a, 1).to_vector<float>(), (std::vector<float>{6, 15}));
  EXPECT_EQ(F::sum(a, 1).shape(), (graph::Shape{2, 1}));
  auto parts = F::split(a, {1, 2}, 1);
  ASSERT_EQ(parts.size(), 2u);
  EXPECT_EQ(parts[1].to_vector<float>(), (std::vector<float>{2, 3, 5, 6}));
  EXPECT_EQ(F::slice(a, {{1}, {-2}}).to_vector<float>(), (std::vector<float>{5, 6}));
  EXPECT_EQ((10.0 / nn::Tensor::from_vector<float>({2, 5}, {2})).to_vector<float>(),
            (std::vector<float>{5, 2}));
}

TEST(NnTensor, EagerBufferStoreWritesInPlace) {
  kiln::Tensor cache = kiln::Tensor::zeros(DType::f32, {4});
  F::buffer_store(nn::Tensor(cache), nn::Tensor::from_vector<float>({7, 8}, {2}), {{1, 3}});
  EXPECT_EQ(cache.to_vector<float>(), (std::vector<float>{0, 7, 8, 0}));
  EXPECT_EQ(F::buffer_load(nn::Tensor(cache), {{2}}).to_vector<float>(), (std::vector<float>{8, 0}));
}

TEST(NnTensor, EagerSignatureCompilesOnceAndIsReused) {
  // A shape no other test uses, so the first call is a new signature.
  nn::Tensor x = nn::Tensor::from_vector<float>(std::vector<float>(7 * 13, 1.f), {7, 13});
  const int64_t before = nn::eager_compile_count();
  nn::Tensor y = F::exp(x);
  EXPECT_EQ(nn::eager_compile_count(), before + 1);
  for (int i = 0; i < 20; ++i) y = F::exp(x);
  EXPECT_EQ(nn::eager_compile_count(), before + 1);
  EXPECT_NEAR(y.to_vector<float>()[0], std::exp(1.0), 1e-6);
  // New data of the same signature reuses the model; a different attribute is a new signature.
  nn::Tensor z = nn::Tensor::from_vector<float>(std::vector<float>(7 * 13, 0.f), {7, 13});
  EXPECT_EQ(F::exp(z).to_vector<float>()[5], 1.f);
  EXPECT_EQ(nn::eager_compile_count(), before + 1);
  EXPECT_EQ(F::sum(x, 0).to_vector<float>().size(), 13u);
  EXPECT_EQ(F::sum(x, 1).to_vector<float>().size(), 7u);
  EXPECT_EQ(nn::eager_compile_count(), before + 3);
}

TEST(NnTensor, EagerErrorsAreGraphOpsErrorsAndAreNotCached) {
  nn::Tensor a = nn::Tensor::zeros(DType::f32, {2, 3});
  nn::Tensor b = nn::Tensor::zeros(DType::f32, {4, 5});
  const int64_t before = nn::eager_compile_count();
  std::string msg = error_message<ShapeError>([&] { F::matmul(a, b); });
  EXPECT_NE(msg.find("matmul"), std::string::npos) << msg;
  error_message<ShapeError>([&] { F::matmul(a, b); });  // still an error the second time: nothing was cached
  EXPECT_EQ(nn::eager_compile_count(), before);
  EXPECT_NE(error_message<ValueError>([] { F::relu(nn::Tensor()); }).find("relu: operand 0 is an undefined"),
            std::string::npos);
}

TEST(NnTensor, TracedTensorHasNoData) {
  graph::Graph g("g", {TensorType{DType::f32, {"n"}}});
  nn::Tensor x(g.input(0));
  EXPECT_TRUE(x.is_traced());
  EXPECT_EQ(x.shape(), (graph::Shape{"n"}));
  std::string msg = error_message<ValueError>([&] { x.data(); });
  EXPECT_NE(msg.find("traced graph value"), std::string::npos) << msg;
  // An op on a traced operand records a node instead of running; eager operands become constants.
  nn::Tensor y = x + nn::Tensor::from_vector<float>({1}, {1});
  EXPECT_TRUE(y.is_traced());
  EXPECT_EQ(g.ir().nodes.back().op, graph::Op::add);
  EXPECT_EQ(g.ir().nodes.front().op, graph::Op::constant);
}

// ---- parameters and modules ----------------------------------------------------------------------

TEST(ModuleV3, ParametersAreOwnFirstThenChildrenPrefixedInDeclarationOrder) {
  MLP mlp(4, 8);
  std::vector<std::string> names;
  for (const auto& [name, p] : mlp.parameters()) names.push_back(name);
  EXPECT_EQ(names, (std::vector<std::string>{"up.weight", "up.bias", "down.weight", "down.bias"}));
  EXPECT_EQ(mlp.up->path(), "up");
  auto params = mlp.parameters();
  EXPECT_EQ(params[2].second.shape(), (std::vector<int64_t>{4, 8}));
  EXPECT_EQ(mlp.state_dict().at("down.weight").data(), mlp.down->weight.data().data());
}

class Scale : public nn::ModuleV3 {
 public:
  Scale() : s(register_parameter("s", kiln::Tensor::from_vector<float>({2}, {1}))) {}
  nn::TensorTree forward(const std::vector<nn::TensorTree>& args) override { return args.at(0).leaf() * s; }
  Scale& add(const std::string& name, std::shared_ptr<nn::ModuleV3> child) {
    register_module(name, std::move(child));
    return *this;
  }
  nn::Parameter again(const std::string& name) {
    return register_parameter(name, kiln::Tensor::zeros(DType::f32, {1}));
  }
  nn::Parameter s;
};

TEST(ModuleV3, RegistrationRejectsBadDuplicateAndReparentedNames) {
  Scale m;
  EXPECT_NE(error_message<ValueError>([&] { m.again("s"); }).find("'s' is registered twice"), std::string::npos);
  EXPECT_NE(error_message<ValueError>([&] { m.again("a.b"); }).find("bad name 'a.b'"), std::string::npos);
  auto child = std::make_shared<Scale>();
  m.add("c", child);
  EXPECT_NE(error_message<ValueError>([&] { m.add("d", child); }).find("already belongs to 'c'"),
            std::string::npos);
  EXPECT_NE(error_message<ValueError>([&] { m.add("s", std::make_shared<Scale>()); }).find("already a parameter"),
            std::string::npos);
}

TEST(ModuleV3, LoadStateDictChecksNamesDtypesAndShapes) {
  Linear l(2, 3);
  std::string msg = error_message<ValueError>([&] {
    l.load_state_dict({{"weight", kiln::Tensor::zeros(DType::f32, {2, 3})},
                       {"bias", kiln::Tensor::zeros(DType::f32, {3})}});
  });
  EXPECT_NE(msg.find("weight 'weight' is f32[2, 3], expected f32[3, 2]"), std::string::npos) << msg;
  msg = error_message<ValueError>([&] {
    l.load_state_dict({{"bias", kiln::Tensor::zeros(DType::f32, {3})}, {"extra", {}}});
  });
  EXPECT_NE(msg.find("missing weights [weight]; unexpected weights [extra]"), std::string::npos) << msg;
  l.load_state_dict({{"bias", kiln::Tensor::from_vector<float>({1, 2, 3}, {3})}}, /*strict=*/false);
  EXPECT_EQ(l.bias.data().to_vector<float>(), (std::vector<float>{1, 2, 3}));
}

// ---- stage ---------------------------------------------------------------------------------------

TEST(ModuleV3, StageMakesParametersWeightsNamedByQualifiedName) {
  MLP mlp(4, 8);
  graph::Graph g = mlp.stage({TypeTree(TensorType{DType::f32, {"batch", 4}})});
  EXPECT_EQ(g.name(), "forward");
  std::vector<std::string> weights;
  for (const auto& w : g.ir().weights) weights.push_back(w.name);
  std::sort(weights.begin(), weights.end());  // the graph lists weights by first use
  EXPECT_EQ(weights, (std::vector<std::string>{"down.bias", "down.weight", "up.bias", "up.weight"}));
  EXPECT_EQ(g.ir().find_weight("up.weight")->shape, (graph::Shape{8, 4}));
  EXPECT_EQ(g.ir().input_types(), (std::vector<graph::Type>{TensorType{DType::f32, {"batch", 4}}}));
  EXPECT_EQ(g.ir().output_types(), (std::vector<graph::Type>{TensorType{DType::f32, {"batch", 4}}}));
  // Outside stage() the same parameters are eager again.
  EXPECT_FALSE(mlp.is_staging());
  EXPECT_FALSE(mlp.up->is_staging());
  EXPECT_TRUE(nn::Tensor(mlp.up->weight).is_eager());
}

// Forward over a tree argument {"x", "y"} and a plain one: returns x * y + z.
class TreeArgs : public nn::ModuleV3 {
 public:
  nn::TensorTree forward(const std::vector<nn::TensorTree>& args) override {
    return args.at(0)["x"].leaf() * args.at(0)["y"].leaf() + args.at(1).leaf();
  }
};

TEST(ModuleV3, StageFlattensTreeArgumentsInOrderAndCompiledRunMatchesEager) {
  TreeArgs m;
  std::vector<TypeTree> types{TypeTree::map({{"x", TypeTree(TensorType{DType::f32, {2}})},
                                             {"y", TypeTree(TensorType{DType::f32, {2}})}}),
                              TypeTree(TensorType{DType::f32, {2}})};
  auto compiled = m.compile(types);
  auto x = kiln::Tensor::from_vector<float>({1, 2}, {2}), y = kiln::Tensor::from_vector<float>({3, 4}, {2}),
       z = kiln::Tensor::from_vector<float>({10, 20}, {2});
  EXPECT_EQ(compiled({x, y, z}).at(0).to_vector<float>(), (std::vector<float>{13, 28}));
  auto eager = m.forward({nn::TensorTree::map({{"x", nn::Tensor(x)}, {"y", nn::Tensor(y)}}), nn::Tensor(z)});
  EXPECT_EQ(eager.leaf().to_vector<float>(), (std::vector<float>{13, 28}));
}

TEST(ModuleV3, ForeignParameterInForwardIsAnError) {
  class UsesForeign : public nn::ModuleV3 {
   public:
    explicit UsesForeign(nn::Parameter p) : p_(std::move(p)) {}
    nn::TensorTree forward(const std::vector<nn::TensorTree>& args) override {
      return args.at(0).leaf() * p_;
    }
    nn::Parameter p_;
  };
  Scale other;
  UsesForeign m(other.s);
  EXPECT_EQ((m.forward({nn::Tensor::from_vector<float>({3}, {1})}).leaf().to_vector<float>()),
            std::vector<float>{6});
  std::string msg = error_message<ValueError>([&] { m.stage({TypeTree(TensorType{DType::f32, {1}})}); });
  EXPECT_NE(msg.find("nn::Parameter 's' was used while staging graph 'forward' but is not a parameter"),
            std::string::npos)
      << msg;
}

// ---- eager == compiled: an MLP and an attention block ----------------------------------------------

TEST(ModuleV3, MlpEagerAndCompiledMatchEachOtherAndANaiveLoop) {
  std::mt19937 rng(7);
  MLP mlp(6, 16);
  randomize(mlp, rng);
  kiln::Tensor x = random_tensor(rng, {3, 6});
  std::vector<float> eager = mlp(nn::Tensor(x)).to_vector<float>();
  auto compiled = mlp.compile({TypeTree(TensorType{DType::f32, {"batch", 6}})});
  std::vector<float> staged = compiled({x}).at(0).to_vector<float>();
  Matrix want = mlp_ref(to_double(x), 3, mlp);
  expect_close(eager, want, 1e-5);
  expect_close(staged, want, 1e-5);
  for (size_t i = 0; i < eager.size(); ++i) EXPECT_NEAR(eager[i], staged[i], 1e-6) << i;
}

TEST(ModuleV3, AttentionEagerAndCompiledMatchEachOtherAndANaiveLoop) {
  std::mt19937 rng(11);
  Attention attn(8, 2);
  randomize(attn, rng);
  kiln::Tensor x = random_tensor(rng, {5, 8});
  std::vector<float> eager = attn(nn::Tensor(x)).to_vector<float>();
  auto compiled = attn.compile({TypeTree(TensorType{DType::f32, {5, 8}})});
  std::vector<float> staged = compiled({x}).at(0).to_vector<float>();
  Matrix want = attention_ref(to_double(x), 5, attn);
  expect_close(eager, want, 1e-5);
  expect_close(staged, want, 1e-5);
  for (size_t i = 0; i < eager.size(); ++i) EXPECT_NEAR(eager[i], staged[i], 1e-6) << i;
  // The eager mask is a constant of the staged graph.
  graph::Graph g = attn.stage({TypeTree(TensorType{DType::f32, {5, 8}})});
  bool has_mask = false;
  for (const auto& node : g.ir().nodes)
    if (node.op == graph::Op::constant && graph::shape_of(g.ir().type(node.outputs[0])) == graph::Shape{5, 5})
      has_mask = true;
  EXPECT_TRUE(has_mask);
}

TEST(ModuleV3, CompileUsesOwnParametersOrGivenWeights) {
  Scale m;  // y = x * s, s = 2
  auto own = m.compile({TypeTree(TensorType{DType::f32, {1}})});
  auto x = kiln::Tensor::from_vector<float>({3}, {1});
  EXPECT_EQ(own({x}).at(0).to_vector<float>(), std::vector<float>{6});
  nn::CompileOptions options;
  options.weights = WeightsRegistry{{"s", kiln::Tensor::from_vector<float>({5}, {1})}};
  auto given = m.compile({TypeTree(TensorType{DType::f32, {1}})}, options);
  EXPECT_EQ(given({x}).at(0).to_vector<float>(), std::vector<float>{15});
}

// is_device_graph: the compiled module replays one launch list on every call, computing what the
// plain compile's execute computes; capture is refused on it.
TEST(ModuleV3, CompiledDeviceGraphReplaysWhatExecuteComputes) {
  std::mt19937 rng(11);
  MLP mlp(6, 16);
  randomize(mlp, rng);
  const std::vector<TypeTree> types{TypeTree(TensorType{DType::f32, {3, 6}})};
  auto session = std::make_shared<nn::EagerSession>();
  auto plain = mlp.compile(types, {.session = session});
  auto device = mlp.compile(types, {.is_device_graph = true, .session = session});
  EXPECT_TRUE(device.model().is_device_graph());
  EXPECT_FALSE(plain.model().is_device_graph());
  // Device graphs are made at init, so the second compile() is served by the session's cache.
  EXPECT_EQ(session->inference_session().compile_count(), 1);

  kiln::Tensor x1 = random_tensor(rng, {3, 6}), x2 = random_tensor(rng, {3, 6});
  std::vector<float> first = device({x1}).at(0).to_vector<float>();
  std::vector<float> second = device({x2}).at(0).to_vector<float>();
  EXPECT_EQ(first, plain({x1}).at(0).to_vector<float>());  // the same kernels, so the same bits
  EXPECT_EQ(second, plain({x2}).at(0).to_vector<float>());
  expect_close(first, mlp_ref(to_double(x1), 3, mlp), 1e-5);
  expect_close(second, mlp_ref(to_double(x2), 3, mlp), 1e-5);

  kiln::testing::expect_error<ValueError>([&] { device.model().capture("k", {x1}); },
                                          {"graph 'forward' is a device graph", "capture"});
  // Its shapes are fixed at init: a symbolic input dim is a ValueError naming the input.
  kiln::testing::expect_error<ValueError>(
      [&] {
        mlp.compile({TypeTree(TensorType{DType::f32, {"batch", 6}})},
                    {.is_device_graph = true, .session = session});
      },
      {"graph 'forward' is a device graph", "input 0 has symbolic shape f32[batch, 6]"});
}

// ---- auto_cast -------------------------------------------------------------------------------------

// A session whose logger keeps its warnings, for compile() to report auto_cast's summary to.
struct CapturedWarnings {
  CapturedWarnings()
      : logger(std::make_shared<kiln::testing::CapturingLogger>()),
        session(std::make_shared<nn::EagerSession>(nn::EagerSessionOptions{.session = {.logger = logger}})) {}
  const std::vector<std::string>& warnings() const { return logger->warnings; }
  std::shared_ptr<kiln::testing::CapturingLogger> logger;
  std::shared_ptr<nn::EagerSession> session;
};

// Two parameters: "a" f32 [2], "b" bf16 [2]; y = a + cast(b, f32) + x.
class Mixed : public nn::ModuleV3 {
 public:
  Mixed()
      : a(register_parameter("a", kiln::Tensor::zeros(DType::f32, {2}))),
        b(register_parameter("b", kiln::Tensor::zeros(DType::bf16, {2}))) {}
  nn::TensorTree forward(const std::vector<nn::TensorTree>& args) override {
    return args.at(0).leaf() + a + F::cast(b, DType::f32);
  }
  nn::Parameter a, b;
};

TEST(ModuleV3, AutoCastCastsF32AndBf16BothWaysWithOneSummaryWarning) {
  Mixed m;
  CapturedWarnings captured;
  nn::CompileOptions options;
  options.session = captured.session;
  // a given as bf16 (widened exactly), b given as f32 1.00390625 (rounds to 1.0 in bf16).
  options.weights =
      WeightsRegistry{{"a", kiln::Tensor::from_vector<bf16_t>({bf16_t(1.5f), bf16_t(-2.f)}, {2})},
                      {"b", kiln::Tensor::from_vector<float>({1.00390625f, 3.f}, {2})}};
  options.auto_cast = true;
  auto compiled = m.compile({TypeTree(TensorType{DType::f32, {2}})}, options);
  EXPECT_EQ(compiled({kiln::Tensor::from_vector<float>({10, 20}, {2})}).at(0).to_vector<float>(),
            (std::vector<float>{12.5f, 21.f}));
  ASSERT_EQ(captured.warnings().size(), 1u);
  EXPECT_EQ(captured.warnings()[0],
            "ModuleV3::compile 'forward': auto_cast cast 2 weights to their parameters' dtypes: "
            "'a' bf16 -> f32, 'b' f32 -> bf16 (loses precision)");
}

TEST(ModuleV3, DtypeMismatchWithoutAutoCastOrOutsideF32Bf16IsAValueError) {
  Mixed m;
  CapturedWarnings captured;
  nn::CompileOptions options;
  options.session = captured.session;
  options.weights = WeightsRegistry{{"a", kiln::Tensor::zeros(DType::bf16, {2})},
                                    {"b", kiln::Tensor::zeros(DType::bf16, {2})}};
  std::string msg = error_message<ValueError>([&] {
    m.compile({TypeTree(TensorType{DType::f32, {2}})}, options);
  });
  EXPECT_NE(msg.find("weight 'a' has dtype bf16 but its parameter is declared f32 (auto_cast is off"),
            std::string::npos)
      << msg;
  options.auto_cast = true;
  options.weights = WeightsRegistry{{"a", kiln::Tensor::zeros(DType::f16, {2})},
                                    {"b", kiln::Tensor::zeros(DType::bf16, {2})}};
  msg = error_message<ValueError>([&] { m.compile({TypeTree(TensorType{DType::f32, {2}})}, options); });
  EXPECT_NE(
      msg.find("weight 'a' has dtype f16 but its parameter is declared f32; auto_cast casts only between f32 "
               "and bf16"),
      std::string::npos)
      << msg;
  options.weights = WeightsRegistry{{"a", kiln::Tensor::zeros(DType::bf16, {3})},
                                    {"b", kiln::Tensor::zeros(DType::bf16, {2})}};
  msg = error_message<ValueError>([&] { m.compile({TypeTree(TensorType{DType::f32, {2}})}, options); });
  EXPECT_NE(msg.find("weight 'a' (bf16[3]) cannot be auto_cast to its parameter's f32[2]: the shapes differ"),
            std::string::npos)
      << msg;
  EXPECT_TRUE(captured.warnings().empty());
}

// ---- signal buffers --------------------------------------------------------------------------------

// Records how many signal buffers forward saw; returns x + y.
class TwoInputs : public nn::ModuleV3 {
 public:
  nn::TensorTree forward(const std::vector<nn::TensorTree>& args) override {
    seen_signals = signal_buffers().size();
    return args.at(0).leaf() + args.at(1).leaf();
  }
  size_t seen_signals = 0;
};

const std::vector<TypeTree> kTwoInputTypes{TypeTree(TensorType{DType::f32, {2}}),
                                           TypeTree(TensorType{DType::f32, {2}})};
const graph::Type kX = TensorType{DType::f32, {2}};
graph::Type signal(int device) {
  return BufferType{DType::u8, {engine::SIGNAL_BYTES}, DeviceRef::CPU(device)};
}

TEST(ModuleV3, SignalBuffersAreAppendedOnTwoDevices) {
  TwoInputs m;
  m.set_devices({DeviceRef::CPU(0), DeviceRef::CPU(1)});
  graph::Graph g = m.stage(kTwoInputTypes);
  EXPECT_EQ(g.ir().input_types(), (std::vector<graph::Type>{kX, kX, signal(0), signal(1)}));
  EXPECT_EQ(m.seen_signals, 2u);
  EXPECT_EQ(engine::SIGNAL_BYTES, 4096 + (1 << 20));
}

TEST(ModuleV3, SignalBuffersAreInsertedAtTheGivenIndex) {
  TwoInputs m;
  m.set_devices({DeviceRef::CPU(0), DeviceRef::CPU(1)});
  EXPECT_EQ(m.stage(kTwoInputTypes, {"f", 0}).ir().input_types(),
            (std::vector<graph::Type>{signal(0), signal(1), kX, kX}));
  EXPECT_EQ(m.stage(kTwoInputTypes, {"f", 1}).ir().input_types(),
            (std::vector<graph::Type>{kX, signal(0), signal(1), kX}));
  EXPECT_EQ(m.stage(kTwoInputTypes, {"f", 2}).ir().input_types(),
            (std::vector<graph::Type>{kX, kX, signal(0), signal(1)}));
}

TEST(ModuleV3, OneDeviceGetsNoSignalBuffers) {
  TwoInputs m;
  EXPECT_EQ(m.stage(kTwoInputTypes, {"f", 0}).ir().input_types(), (std::vector<graph::Type>{kX, kX}));
  EXPECT_EQ(m.seen_signals, 0u);
}

TEST(ModuleV3, SignalBufferIndexOutOfRangeIsAValueError) {
  TwoInputs m;
  m.set_devices({DeviceRef::CPU(0), DeviceRef::CPU(1)});
  for (int index : {-1, 3}) {
    std::string msg = error_message<ValueError>([&] { m.stage(kTwoInputTypes, {"f", index}); });
    EXPECT_NE(msg.find(fmt::format(
                  "signal_buffer_index {} is out of range for a graph with 2 inputs (expected 0..2)", index)),
              std::string::npos)
        << msg;
  }
}

TEST(ModuleV3, CompiledTwoDeviceModuleSuppliesItsOwnSignalBuffers) {
  TwoInputs m;
  m.set_devices({DeviceRef::CPU(0), DeviceRef::CPU(1)});
  nn::CompileOptions options;
  options.signal_buffer_index = 1;
  options.session = std::make_shared<nn::EagerSession>(
      nn::EagerSessionOptions{.devices = {DeviceRef::CPU(0), DeviceRef::CPU(1)}});
  auto compiled = m.compile(kTwoInputTypes, options);
  EXPECT_EQ(compiled.model().input_metadata().size(), 4u);
  EXPECT_EQ(compiled.session().devices().size(), 2u);
  auto out = compiled(
      {kiln::Tensor::from_vector<float>({1, 2}, {2}), kiln::Tensor::from_vector<float>({3, 5}, {2})});
  EXPECT_EQ(out.at(0).to_vector<float>(), (std::vector<float>{4, 7}));
  // The raw model takes them at their index.
  auto signals = engine::make_signal_buffers({DeviceRef::CPU(0), DeviceRef::CPU(1)});
  auto raw = compiled.model().execute({kiln::Tensor::from_vector<float>({1, 1}, {2}), signals[0], signals[1],
                                       kiln::Tensor::from_vector<float>({2, 2}, {2})});
  EXPECT_EQ(raw.at(0).to_vector<float>(), (std::vector<float>{3, 3}));
}

// A device graph on two devices replays with the module's own signal buffers at their index.
TEST(ModuleV3, CompiledTwoDeviceDeviceGraphSuppliesItsOwnSignalBuffers) {
  TwoInputs m;
  m.set_devices({DeviceRef::CPU(0), DeviceRef::CPU(1)});
  auto compiled = m.compile(
      kTwoInputTypes, {.is_device_graph = true,
                       .signal_buffer_index = 0,
                       .session = std::make_shared<nn::EagerSession>(
                           nn::EagerSessionOptions{.devices = {DeviceRef::CPU(0), DeviceRef::CPU(1)}})});
  ASSERT_TRUE(compiled.model().is_device_graph());
  EXPECT_EQ(compiled.model().input_metadata().size(), 4u);
  auto a = kiln::Tensor::from_vector<float>({1, 2}, {2}), b = kiln::Tensor::from_vector<float>({3, 5}, {2});
  EXPECT_EQ(compiled({a, b}).at(0).to_vector<float>(), (std::vector<float>{4, 7}));
  EXPECT_EQ(compiled({b, b}).at(0).to_vector<float>(), (std::vector<float>{6, 10}));
}

TEST(ModuleV3, SetDevicesRejectsEmptyAndRepeatedDevices) {
  TwoInputs m;
  EXPECT_THROW(m.set_devices({}), ValueError);
  EXPECT_NE(error_message<ValueError>([&] {
              m.set_devices({DeviceRef::CPU(1), DeviceRef::CPU(1)});
            }).find("device cpu:1 is listed twice"),
            std::string::npos);
}

}  // namespace
