// The extension loader: what a library registers, every load error (each naming the path), checks of
// a call against the library's output-type function, kernels on DLTensor views, and the graph-build
// check. The libraries are built by CMake (examples/custom_op, tests/ext/libs/test_ops.c).
#include <gtest/gtest.h>
#include <kiln/ext/extensions.h>
#include <kiln/graph/graph.h>
#include <kiln/graph/ops.h>

#include <cmath>
#include <cstdlib>
#include <fstream>
#include <iterator>

#include "ext/float_vec.h"
#include "test_util.h"

using namespace kiln;
using graph::TensorType;
using graph::BufferType;
using kiln::testing::error_message;
using kiln::testing::expect_error;
using kiln::testing::FloatVec;
namespace ops = kiln::graph::ops;

namespace {

const std::string kExample = KILN_EXAMPLE_EXTENSION;
const std::string kExampleB = KILN_EXAMPLE_EXTENSION_B;
const std::string kTestOps = KILN_TEST_EXTENSION_OPS;

}  // namespace

TEST(Extension, ExampleLibraryRegistersItsOps) {
  auto lib = ext::load_library(kExample);
  ASSERT_EQ(lib->ops().size(), 2u);
  EXPECT_EQ(lib->abi_minor(), static_cast<uint32_t>(KILN_EXT_ABI_MINOR));
  const ext::CustomOp* scale_add = lib->find("scale_add");
  ASSERT_NE(scale_add, nullptr);
  EXPECT_EQ(scale_add->description(), "x * scale + y, elementwise (f32)");
  EXPECT_FALSE(scale_add->inplace());
  EXPECT_EQ(scale_add->num_outputs(), 1u);
  ASSERT_EQ(scale_add->params().size(), 1u);
  EXPECT_EQ(scale_add->params()[0].name, "scale");
  EXPECT_EQ(scale_add->params()[0].kind, KILN_EXT_PARAM_FLOAT64);
  EXPECT_TRUE(scale_add->has_kernel(DeviceKind::CPU));
  EXPECT_FALSE(scale_add->has_kernel(DeviceKind::GPU));
  const ext::CustomOp* accumulate = lib->find("accumulate");
  ASSERT_NE(accumulate, nullptr);
  EXPECT_TRUE(accumulate->inplace());
  EXPECT_EQ(accumulate->num_outputs(), 0u);
  EXPECT_EQ(lib->find("nope"), nullptr);
}

TEST(Extension, ContentHashIsFnv1aOfTheFileBytes) {
  std::ifstream in(kExample, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  ASSERT_FALSE(bytes.empty());
  uint64_t expected = 14695981039346656037ull;  // FNV-1a 64, written out here as the reference
  for (unsigned char c : bytes) expected = (expected ^ c) * 1099511628211ull;
  EXPECT_EQ(ext::content_hash(kExample), expected);
  EXPECT_EQ(ext::load_library(kExample)->content_hash(), expected);
  EXPECT_NE(ext::content_hash(kExampleB), expected);  // the variant with a changed kernel
}

TEST(Extension, LoadingTheSameFileTwiceReusesTheLibrary) {
  EXPECT_EQ(ext::load_library(kExample), ext::load_library(kExample));
  auto lib = ext::load_library(kExample);
  EXPECT_EQ(ext::loaded_library(kExample, lib->content_hash()), lib);
  EXPECT_EQ(ext::loaded_library(kExample, lib->content_hash() + 1), nullptr);
}

// ---- load errors: each names the path and what was expected ----------------------------------------

TEST(Extension, MissingFileIsAnErrorNamingThePath) {
  expect_error<ExtensionError>([] { ext::load_library("/nonexistent/libmissing_ops.so"); },
                               {"/nonexistent/libmissing_ops.so", "no such file", "shared library"});
}

TEST(Extension, LibraryWithoutEntryPointIsAnErrorNamingThePathAndSymbol) {
  expect_error<ExtensionError>([] { ext::load_library(KILN_TEST_EXTENSION_NO_ENTRY); },
                               {KILN_TEST_EXTENSION_NO_ENTRY, "does not export kiln_extension_init"});
}

TEST(Extension, WrongAbiMajorIsAnErrorNamingThePathAndBothVersions) {
  expect_error<ExtensionError>([] { ext::load_library(KILN_TEST_EXTENSION_WRONG_ABI); },
                               {KILN_TEST_EXTENSION_WRONG_ABI, "ABI 99.0", "expected major version 1"});
}

TEST(Extension, FileThatIsNotALibraryIsAnErrorNamingThePath) {
  auto path = std::filesystem::temp_directory_path() / "kiln_test_not_a_library.so";
  std::ofstream(path) << "not an ELF file";
  expect_error<ExtensionError>([&] { ext::load_library(path); }, {path.string(), "dlopen failed"});
  std::filesystem::remove(path);
}

TEST(Extension, TwoLibrariesDefiningOneOpIsAnErrorNamingTheOpAndBothPaths) {
  ext::ExtensionRegistry registry;
  registry.add(ext::load_library(kExample));
  registry.add(ext::load_library(kExample));  // the same library again is no conflict
  expect_error<ExtensionError>([&] { registry.add(ext::load_library(kExampleB)); },
                               {"'scale_add'", kExample, kExampleB});
  EXPECT_EQ(registry.loaded_paths(), kExample);
}

// ---- calls checked against the library -----------------------------------------------------------

TEST(Extension, OutputTypesKeepSymbolicDims) {
  const ext::CustomOp* op = ext::load_library(kExample)->find("scale_add");
  TensorType x{DType::f32, {"batch", 4}};
  auto types = op->output_types({x, x}, {{"param.scale", 2.0}});
  ASSERT_EQ(types.size(), 1u);
  EXPECT_EQ(graph::to_string(types[0]), "f32[batch, 4]");
}

TEST(Extension, RejectedOperandsCarryTheLibrarysMessageAndCode) {
  const ext::CustomOp* op = ext::load_library(kExample)->find("scale_add");
  // The example says KILN_EXT_ERROR_INVALID_ARGUMENT: the caller's mistake, a ValueError.
  expect_error<ValueError>(
      [&] { op->output_types({TensorType{DType::f32, {4}}, TensorType{DType::i32, {4}}}, {{"param.scale", 2.0}}); },
      {"'scale_add'", kExample, "KILN_EXT_ERROR_INVALID_ARGUMENT", "operands must be f32", "i32[4]"});
}

TEST(Extension, ParametersAreCheckedByName) {
  const ext::CustomOp* op = ext::load_library(kExample)->find("scale_add");
  TensorType x{DType::f32, {4}};
  expect_error<ExtensionError>([&] { op->output_types({x, x}, {}); },
                               {"'scale_add'", kExample, "missing required float64 parameter 'scale'"});
  expect_error<ExtensionError>([&] { op->output_types({x, x}, {{"param.scale", 1.0}, {"param.bias", 1.0}}); },
                               {"unknown parameter 'bias'", "declared: 'scale'"});
  expect_error<ExtensionError>([&] { op->output_types({x, x}, {{"param.scale", std::string("two")}}); },
                               {"parameter 'scale' must be float64"});
  // An int64 attribute is accepted for a float64 parameter.
  EXPECT_EQ(op->output_types({x, x}, {{"param.scale", int64_t{2}}}).size(), 1u);
}

TEST(Extension, KernelRunsOnDLTensorViews) {
  const ext::CustomOp* op = ext::load_library(kExample)->find("scale_add");
  FloatVec x({1, 2, 3}), y({10, 20, 30}), out({0, 0, 0});
  op->run(DeviceKind::CPU, {x.tensor(), y.tensor()}, {out.tensor()}, {{"param.scale", 0.5}});
  EXPECT_EQ(out.data, (std::vector<float>{1 * 0.5f + 10, 2 * 0.5f + 20, 3 * 0.5f + 30}));
}

TEST(Extension, KernelFailureIsAnErrorWithTheLibrarysMessageAndCode) {
  const ext::CustomOp* op = ext::load_library(kTestOps)->find("checked_sqrt");
  FloatVec x({4, -4}), out({0, 0});
  expect_error<ValueError>([&] { op->run(DeviceKind::CPU, {x.tensor()}, {out.tensor()}, {}); },
                           {"custom op 'checked_sqrt' of " + kTestOps,
                            "kernel failed with KILN_EXT_ERROR_INVALID_ARGUMENT: element 1 is -4, expected >= 0"});
}

// ---- graph-build-time check ------------------------------------------------------------------------

TEST(Extension, LoadedOpIsCheckedWhenTheGraphIsBuilt) {
  ext::load_library(kTestOps);  // the only library defining checked_sqrt
  graph::Graph g("g", {TensorType{DType::f32, {"n"}}});
  graph::Graph::Scope scope(g);
  graph::Value x = g.inputs()[0];
  auto ok = ops::custom("checked_sqrt", {x}, {TensorType{DType::f32, {"n"}}});
  EXPECT_EQ(ok.size(), 1u);
  expect_error<ExtensionError>([&] { ops::custom("checked_sqrt", {x}, {TensorType{DType::f32, {3}}}); },
                               {"custom", "'checked_sqrt'", kTestOps, "declared output types (f32[3])",
                                "gives (f32[n])"});
  // The library rejects the operands with KILN_EXT_ERROR_INVALID_ARGUMENT, so the graph gets a ValueError.
  expect_error<ValueError>([&] { ops::custom("checked_sqrt", {x, x}, {TensorType{DType::f32, {"n"}}}); },
                           {"custom", "'checked_sqrt'", kTestOps, "KILN_EXT_ERROR_INVALID_ARGUMENT",
                            "expected 1 operand, got 2"});
}

TEST(Extension, InplaceOpCalledAsCustomIsAnError) {
  ext::load_library(kTestOps);
  graph::Graph g("g", {BufferType{DType::f32, {4}}, TensorType{DType::f32, {4}}});
  graph::Graph::Scope scope(g);
  expect_error<ExtensionError>([&] { ops::inplace_custom("checked_sqrt", {g.inputs()[0], g.inputs()[1]}); },
                               {"'checked_sqrt'", kTestOps, "not an in-place op", "ops::custom"});
}

TEST(Extension, OpNoLoadedLibraryDefinesIsLeftToTheCompiler) {
  graph::Graph g("g", {TensorType{DType::f32, {4}}});
  graph::Graph::Scope scope(g);
  auto results = ops::custom("defined_nowhere", {g.inputs()[0]}, {TensorType{DType::i64, {2}}});
  EXPECT_EQ(graph::to_string(results.at(0).type()), "i64[2]");
}

// ---- hostile metadata: bounded names and counts, errors naming the library and the op --------------

namespace {

// Loads the hostile test library registering what `which` names (see tests/ext/libs/test_ops.c).
std::string hostile_load_error(const char* which) {
  ::setenv("KILN_TEST_HOSTILE", which, 1);
  std::string message = error_message<ExtensionError>([] { ext::load_library(KILN_TEST_EXTENSION_HOSTILE); });
  ::unsetenv("KILN_TEST_HOSTILE");
  return message;
}

}  // namespace

TEST(ExtensionHostile, OverlongOpNameIsRefusedAndShownCutShort) {
  const std::string message = hostile_load_error("long_name");
  EXPECT_NE(message.find(KILN_TEST_EXTENSION_HOSTILE), std::string::npos) << message;
  EXPECT_NE(message.find("at most 256 characters"), std::string::npos) << message;
  EXPECT_LT(message.size(), 600u) << message;
}

TEST(ExtensionHostile, OverlongParamNameIsRefusedNamingTheOp) {
  const std::string message = hostile_load_error("long_param");
  EXPECT_NE(message.find(KILN_TEST_EXTENSION_HOSTILE), std::string::npos) << message;
  EXPECT_NE(message.find("register_op 'hostile': param 0 has no valid name"), std::string::npos) << message;
  EXPECT_LT(message.size(), 600u) << message;
}

TEST(ExtensionHostile, TooManyOpsAreRefused) {
  const std::string message = hostile_load_error("many_ops");
  EXPECT_NE(message.find(KILN_TEST_EXTENSION_HOSTILE), std::string::npos) << message;
  EXPECT_NE(message.find("more than 4096 ops"), std::string::npos) << message;
}
