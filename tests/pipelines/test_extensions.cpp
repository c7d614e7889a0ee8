// Custom-kernel extensions end to end: libraries built by CMake (examples/custom_op and
// tests/ext/libs), loaded through GraphSpec::custom_extensions or InferenceSession, run in graphs
// that mix built-in and custom ops, and compared with values computed here.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <unistd.h>

#include "test_util.h"

#include <kiln/ext/extensions.h>
#include <kiln/kiln.h>

using namespace kiln;
using graph::BufferType;
using graph::TensorType;
using kiln::testing::expect_error;
namespace ops = kiln::graph::ops;
namespace fs = std::filesystem;

namespace {

const std::string kExample = KILN_EXAMPLE_EXTENSION;     // scale_add: x * scale + y; accumulate
const std::string kExampleB = KILN_EXAMPLE_EXTENSION_B;  // the same, rebuilt: scale_add adds 1000
const std::string kTestOps = KILN_TEST_EXTENSION_OPS;    // checked_sqrt: fails on a negative input

// out = (scale_add(relu(x), y; scale) * 2 + 1), and cache += scale_add(...) in place.
class MixedOps : public nn::Module {
 public:
  explicit MixedOps(double scale) : scale_(scale) {}
  nn::Values forward(const std::vector<nn::Values>& args) override {
    graph::TensorValue x = args.at(0).leaf();  // [n]
    graph::TensorValue y = args.at(1).leaf();  // [n]
    graph::Value cache = args.at(2).leaf();    // buffer [n]
    graph::TensorValue s =
        ops::custom("scale_add", {ops::relu(x), y}, {x.type()}, {{"scale", scale_}}).at(0);
    ops::inplace_custom("accumulate", {cache, s});
    return nn::Values(s * 2.0 + 1.0);
  }

 private:
  double scale_;
};

// out = scale_add(x, y; scale)
class ScaleAdd : public nn::Module {
 public:
  nn::Values forward(const std::vector<nn::Values>& args) override {
    graph::TensorValue x = args.at(0).leaf();
    return nn::Values(ops::custom("scale_add", {x, args.at(1).leaf()}, {x.type()}, {{"scale", 2.0}}).at(0));
  }
};

// out = checked_sqrt(x) + 1
class CheckedSqrt : public nn::Module {
 public:
  nn::Values forward(const std::vector<nn::Values>& args) override {
    graph::TensorValue x = args.at(0).leaf();
    return nn::Values(graph::TensorValue(ops::custom("checked_sqrt", {x}, {x.type()}).at(0)) + 1.0);
  }
};

nn::TypeTree f32_n() { return nn::TypeTree(TensorType{DType::f32, {"n"}}); }

pipelines::GraphSpec spec_of(std::shared_ptr<nn::Module> m, std::string name, std::vector<nn::TypeTree> inputs,
                             std::vector<fs::path> extensions) {
  pipelines::GraphSpec spec;
  spec.module = std::move(m);
  spec.name = std::move(name);
  spec.input_types = std::move(inputs);
  spec.custom_extensions = std::move(extensions);
  return spec;
}

Tensor vec(const std::vector<float>& v) { return Tensor::from_vector(v, {static_cast<int64_t>(v.size())}); }

// A private copy of a library at a fresh path, so a test can overwrite or delete it.
fs::path temp_library_path(const std::string& tag) {
  static int counter = 0;
  return fs::temp_directory_path() / ("kiln_test_" + tag + "_" + std::to_string(getpid()) + "_" +
                                      std::to_string(counter++) + ".so");
}

}  // namespace

TEST(Extensions, GraphSpecRunsBuiltinAndCustomOpsTogether) {
  auto spec = spec_of(std::make_shared<MixedOps>(3.0), "mixed",
                      {f32_n(), f32_n(), nn::TypeTree(BufferType{DType::f32, {"n"}})}, {kExample});
  engine::InferenceSession session;
  auto models = pipelines::compile_graph_specs(session, {spec});
  std::vector<float> x = {-1.5f, 0.0f, 2.0f, 4.25f}, y = {10, 20, 30, 40}, cache0 = {1, 1, 1, 1};
  Tensor cache = vec(cache0);
  auto out = models.at("mixed").execute({vec(x), vec(y), cache});

  std::vector<float> expected_out, expected_cache;
  for (size_t i = 0; i < x.size(); ++i) {
    float s = std::max(x[i], 0.0f) * 3.0f + y[i];
    expected_out.push_back(s * 2 + 1);
    expected_cache.push_back(cache0[i] + s);
  }
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0].to_vector<float>(), expected_out);
  EXPECT_EQ(cache.to_vector<float>(), expected_cache);  // accumulate wrote the buffer in place
  // A second run accumulates again.
  models.at("mixed").execute({vec(x), vec(y), cache});
  for (size_t i = 0; i < x.size(); ++i) expected_cache[i] += std::max(x[i], 0.0f) * 3.0f + y[i];
  EXPECT_EQ(cache.to_vector<float>(), expected_cache);
}

TEST(Extensions, SessionLoadsItsExtensionsForItsCompiles) {
  engine::InferenceSession session({DeviceRef::CPU()}, {kExample});
  EXPECT_EQ(session.custom_extensions(), std::vector<fs::path>{kExample});
  graph::Graph g("g", {TensorType{DType::f32, {2, 3}}, TensorType{DType::f32, {3, 2}}});
  {
    graph::Graph::Scope scope(g);
    graph::TensorValue a = g.inputs()[0];
    graph::TensorValue bt = ops::transpose(g.inputs()[1], 0, 1);  // [2, 3]
    g.output(ops::custom("scale_add", {a, bt}, {a.type()}, {{"scale", -2.0}}));
  }
  auto model = session.load(g);
  std::vector<float> a = {1, 2, 3, 4, 5, 6}, b = {10, 20, 30, 40, 50, 60};  // b is [3, 2]
  auto out = model.execute({Tensor::from_vector(a, {2, 3}), Tensor::from_vector(b, {3, 2})});
  std::vector<float> expected;
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 3; ++j) expected.push_back(a[i * 3 + j] * -2.0f + b[j * 2 + i]);
  EXPECT_EQ(out.at(0).to_vector<float>(), expected);
}

// ---- errors --------------------------------------------------------------------------------------

TEST(Extensions, SessionWithMissingLibraryIsAnErrorNamingThePath) {
  expect_error<ExtensionError>([] { engine::InferenceSession({DeviceRef::CPU()}, {"/nonexistent/libops.so"}); },
                               {"/nonexistent/libops.so", "no such file"});
}

TEST(Extensions, GraphSpecLibraryWithoutEntryPointIsAnErrorNamingThePath) {
  auto spec = spec_of(std::make_shared<ScaleAdd>(), "g", {f32_n(), f32_n()}, {KILN_TEST_EXTENSION_NO_ENTRY});
  engine::InferenceSession session;
  expect_error<ExtensionError>([&] { pipelines::compile_graph_specs(session, {spec}); },
                               {KILN_TEST_EXTENSION_NO_ENTRY, "kiln_extension_init"});
}

TEST(Extensions, GraphSpecLibraryOfAnotherAbiIsAnErrorNamingThePath) {
  auto spec = spec_of(std::make_shared<ScaleAdd>(), "g", {f32_n(), f32_n()}, {KILN_TEST_EXTENSION_WRONG_ABI});
  engine::InferenceSession session;
  expect_error<ExtensionError>([&] { pipelines::compile_graph_specs(session, {spec}); },
                               {KILN_TEST_EXTENSION_WRONG_ABI, "ABI 99.0", "expected major version 1"});
}

TEST(Extensions, OpUndefinedByTheLoadedLibrariesNamesTheOpNodeAndLoadedPaths) {
  engine::InferenceSession session({DeviceRef::CPU()}, {kTestOps});
  graph::Graph g("calls_unknown", {TensorType{DType::f32, {4}}});
  {
    graph::Graph::Scope scope(g);
    g.output(ops::custom("my_add", {g.inputs()[0]}, {TensorType{DType::f32, {4}}}));
  }
  expect_error<ExtensionError>([&] { session.load(g); },
                               {"graph 'calls_unknown' node", "custom op 'my_add' is not defined by any loaded "
                                                              "extension (loaded: " + kTestOps + ")"});
  expect_error<ExtensionError>([&] { engine::InferenceSession().load(g); }, {"'my_add'", "(loaded: none)"});
}

TEST(Extensions, TwoLibrariesOfOneGroupDefiningAnOpIsAnErrorNamingBoth) {
  auto a = spec_of(std::make_shared<ScaleAdd>(), "a", {f32_n(), f32_n()}, {kExample});
  auto b = spec_of(std::make_shared<ScaleAdd>(), "b", {f32_n(), f32_n()}, {kExampleB});
  a.group = b.group = "both";
  engine::InferenceSession session;
  expect_error<ExtensionError>([&] { pipelines::compile_graph_specs(session, {a, b}); },
                               {"'scale_add'", kExample, kExampleB});
  // In separate compile units each resolves against its own library.
  a.group = b.group = std::nullopt;
  auto models = pipelines::compile_graph_specs(session, {a, b});
  EXPECT_EQ(models.at("a").execute({vec({1}), vec({2})}).at(0).to_vector<float>(), std::vector<float>{4});
  EXPECT_EQ(models.at("b").execute({vec({1}), vec({2})}).at(0).to_vector<float>(), std::vector<float>{1004});
}

TEST(Extensions, DeclaredOutputTypesThatDisagreeWithTheLibraryFailTheCompile) {
  graph::Graph g("g", {TensorType{DType::f32, {4}}});
  {
    graph::Graph::Scope scope(g);
    g.output(ops::custom("defined_later", {g.inputs()[0]}, {TensorType{DType::f32, {4}}}));
  }
  // Rename the call to an op that is loaded only afterwards, declaring i32 results where the library
  // gives f32: the build-time check could not see it, so the compiler must.
  for (graph::Node& node : g.ir().nodes)
    if (node.op == graph::Op::custom) {
      node.attrs["symbol"] = std::string("checked_sqrt");
      node.attrs["output_types"] = std::vector<graph::Type>{TensorType{DType::i32, {4}}};
      g.ir().value_types[static_cast<size_t>(node.outputs[0])] = TensorType{DType::i32, {4}};
    }
  engine::InferenceSession session({DeviceRef::CPU()}, {kTestOps});
  expect_error<ExtensionError>([&] { session.load(g); },
                               {"compile: graph 'g' node", "'checked_sqrt'", kTestOps,
                                "declared output types (i32[4])", "gives (f32[4])"});
}

TEST(Extensions, KernelFailureIsAnExecutionErrorNamingTheOpAndNode) {
  auto spec = spec_of(std::make_shared<CheckedSqrt>(), "sqrt", {f32_n()}, {kTestOps});
  engine::InferenceSession session;
  auto models = pipelines::compile_graph_specs(session, {spec});
  EXPECT_EQ(models.at("sqrt").execute({vec({4, 9})}).at(0).to_vector<float>(), (std::vector<float>{3, 4}));
  expect_error<ExecutionError>([&] { models.at("sqrt").execute({vec({4, -4})}); },
                               {"graph 'sqrt'", "custom op 'checked_sqrt' (node", kTestOps,
                                "element 1 is -4, expected >= 0"});
}

// ---- rebuilt libraries and the compile-cache key ---------------------------------------------------

TEST(Extensions, RebuiltLibraryIsPickedUpByTheNextCompile) {
  const fs::path path = temp_library_path("rebuilt");
  fs::copy_file(kExample, path, fs::copy_options::overwrite_existing);
  auto spec = spec_of(std::make_shared<ScaleAdd>(), "g", {f32_n(), f32_n()}, {path});
  engine::InferenceSession session;
  auto before = pipelines::compile_graph_specs(session, {spec}).at("g");
  EXPECT_EQ(before.execute({vec({1, 2}), vec({3, 4})}).at(0).to_vector<float>(), (std::vector<float>{5, 8}));

  fs::copy_file(kExampleB, path, fs::copy_options::overwrite_existing);  // "rebuild" it in place
  auto after = pipelines::compile_graph_specs(session, {spec}).at("g");
  EXPECT_EQ(after.execute({vec({1, 2}), vec({3, 4})}).at(0).to_vector<float>(),
            (std::vector<float>{1005, 1008}));
  // The model compiled earlier keeps the code it was compiled against.
  EXPECT_EQ(before.execute({vec({1, 2}), vec({3, 4})}).at(0).to_vector<float>(), (std::vector<float>{5, 8}));
  fs::remove(path);
}

TEST(Extensions, SessionExtensionRebuiltBetweenCompilesIsPickedUp) {
  const fs::path path = temp_library_path("session_rebuilt");
  fs::copy_file(kExample, path, fs::copy_options::overwrite_existing);
  engine::InferenceSession session({DeviceRef::CPU()}, {path});
  graph::Graph g("g", {TensorType{DType::f32, {1}}, TensorType{DType::f32, {1}}});
  {
    graph::Graph::Scope scope(g);
    g.output(ops::custom("scale_add", {g.inputs()[0], g.inputs()[1]}, {g.inputs()[0].type()}, {{"scale", 2.0}}));
  }
  EXPECT_EQ(session.load(g).execute({vec({1}), vec({2})}).at(0).to_vector<float>(), std::vector<float>{4});
  fs::copy_file(kExampleB, path, fs::copy_options::overwrite_existing);
  EXPECT_EQ(session.load(g).execute({vec({1}), vec({2})}).at(0).to_vector<float>(), std::vector<float>{1004});
  fs::remove(path);
}

TEST(Extensions, CacheKeyFollowsTheContentOfCalledLibrariesOnly) {
  graph::Module with_custom, without_custom;
  {
    graph::Graph g("g", {TensorType{DType::f32, {2}}, TensorType{DType::f32, {2}}}, &with_custom);
    graph::Graph::Scope scope(g);
    g.output(ops::custom("scale_add", {g.inputs()[0], g.inputs()[1]}, {g.inputs()[0].type()}, {{"scale", 2.0}}));
  }
  {
    graph::Graph g("g", {TensorType{DType::f32, {2}}}, &without_custom);
    graph::Graph::Scope scope(g);
    g.output({ops::relu(g.inputs()[0])});
  }
  ext::ExtensionRegistry a({kExample}), b({kExampleB});
  compiler::CompileOptions none, with_a, with_b;
  with_a.extensions = &a;
  with_b.extensions = &b;
  EXPECT_NE(compiler::cache_key(with_custom, with_a), compiler::cache_key(with_custom, with_b));
  EXPECT_EQ(compiler::cache_key(with_custom, with_a), compiler::cache_key(with_custom, with_a));
  EXPECT_EQ(compiler::cache_key(without_custom, none), compiler::cache_key(without_custom, with_a));
  EXPECT_EQ(compiler::cache_key(without_custom, with_a), compiler::cache_key(without_custom, with_b));

  // The compiled model records the library content it calls; one without custom ops records none.
  auto compiled = compiler::compile(with_custom, with_b);
  ASSERT_EQ(compiled.extensions().size(), 1u);
  EXPECT_EQ(compiled.extensions()[0].path, kExampleB);
  EXPECT_EQ(compiled.extensions()[0].content_hash, ext::content_hash(kExampleB));
  EXPECT_TRUE(compiler::compile(without_custom, with_a).extensions().empty());
}

TEST(Extensions, GraphWithoutCustomOpsNeverReadsTheSessionsLibraries) {
  const fs::path path = temp_library_path("deleted");
  fs::copy_file(kExample, path, fs::copy_options::overwrite_existing);
  engine::InferenceSession session({DeviceRef::CPU()}, {path});
  fs::remove(path);  // a compile that read the library again would fail on the missing file
  graph::Graph g("g", {TensorType{DType::f32, {2}}});
  {
    graph::Graph::Scope scope(g);
    g.output({ops::relu(g.inputs()[0])});
  }
  EXPECT_EQ(session.load(g).execute({vec({-1, 2})}).at(0).to_vector<float>(), (std::vector<float>{0, 2}));
  // A graph that calls a custom op does read them, and says which file is gone.
  graph::Graph c("c", {TensorType{DType::f32, {2}}, TensorType{DType::f32, {2}}});
  {
    graph::Graph::Scope scope(c);
    c.output(ops::custom("scale_add", {c.inputs()[0], c.inputs()[1]}, {c.inputs()[0].type()}, {{"scale", 1.0}}));
  }
  expect_error<ExtensionError>([&] { session.load(c); }, {path.string(), "no such file"});
}
