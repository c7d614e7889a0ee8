// The extension ABI's compatibility promise (kiln/extension.h, "Versioning"): a library built against
// the frozen 1.0 header loads and runs; one of a newer minor, with larger structs, loads with the
// prefix kiln knows and its arrays walked by their declared stride; a struct_size too small for the
// declared version is refused naming the path, struct and sizes; and a library's error codes pick
// the exception and appear in its message.
#include <gtest/gtest.h>

#include <dlfcn.h>

#include <string>

#include "ext/float_vec.h"
#include "test_util.h"

#include <kiln/ext/extensions.h>
#include <kiln/graph/graph.h>
#include <kiln/graph/ops.h>

using namespace kiln;
using graph::TensorType;
using kiln::testing::expect_error;
using kiln::testing::FloatVec;
namespace ops = kiln::graph::ops;

namespace {

const std::string kTestOps = KILN_TEST_EXTENSION_OPS;
const std::string kV1_0 = KILN_TEST_EXTENSION_V1_0;
const std::string kFuture = KILN_TEST_EXTENSION_FUTURE;

std::string size_text(size_t n) { return std::to_string(n); }

}  // namespace

// ---- an older minor -------------------------------------------------------------------------------

TEST(ExtensionAbi, SizeConstantsMatchTheFrozen1_0Layout) {
  void* handle = dlopen(kV1_0.c_str(), RTLD_NOW | RTLD_LOCAL);
  ASSERT_NE(handle, nullptr) << dlerror();
  auto sizes = reinterpret_cast<void (*)(size_t*, size_t*)>(dlsym(handle, "kiln_test_v1_0_struct_sizes"));
  ASSERT_NE(sizes, nullptr);
  size_t prefix[9], size[9];
  sizes(prefix, size);
  const size_t expected[9] = {KILN_EXT_PARAM_DEF_STRUCT_SIZE_V1_0,        KILN_EXT_PARAM_VALUE_STRUCT_SIZE_V1_0,
                              KILN_EXT_TYPE_DESC_STRUCT_SIZE_V1_0,        KILN_EXT_OUTPUT_DESC_STRUCT_SIZE_V1_0,
                              KILN_EXT_OUTPUT_TYPES_ARGS_STRUCT_SIZE_V1_0, KILN_EXT_KERNEL_ARGS_STRUCT_SIZE_V1_0,
                              KILN_EXT_KERNEL_DEF_STRUCT_SIZE_V1_0,       KILN_EXT_OP_DEF_STRUCT_SIZE_V1_0,
                              KILN_EXT_INIT_ARGS_STRUCT_SIZE_V1_0};
  for (int i = 0; i < 9; ++i) EXPECT_EQ(prefix[i], expected[i]) << "struct " << i << " in header order";
  // The arrays kiln hands over are indexed by a 1.0 library with its own sizeof: they must not grow.
  EXPECT_EQ(size[1], sizeof(KilnExtParamValue));
  EXPECT_EQ(size[2], sizeof(KilnExtTypeDesc));
  EXPECT_EQ(size[3], sizeof(KilnExtOutputDesc));
  // 1.1 appended KilnExtOpDef::description right after 1.0's last field.
  EXPECT_EQ(offsetof(KilnExtOpDef, description), KILN_EXT_OP_DEF_STRUCT_SIZE_V1_0);
  EXPECT_GT(KILN_EXT_OP_DEF_STRUCT_SIZE_V1_1, KILN_EXT_OP_DEF_STRUCT_SIZE_V1_0);
  dlclose(handle);
}

TEST(ExtensionAbi, LibraryBuiltAgainstAbi1_0LoadsAndRuns) {
  auto lib = ext::load_library(kV1_0);
  EXPECT_EQ(lib->abi_minor(), 0u);
  const ext::CustomOp* op = lib->find("v1_0_affine");
  ASSERT_NE(op, nullptr);
  EXPECT_EQ(op->description(), "");  // a 1.1 field past 1.0's struct_size takes its default
  ASSERT_EQ(op->params().size(), 2u);
  EXPECT_EQ(op->params()[0].name, "scale");
  EXPECT_TRUE(op->params()[0].required);
  EXPECT_EQ(op->params()[1].name, "shift");
  EXPECT_FALSE(op->params()[1].required);
  EXPECT_EQ(graph::to_string(op->output_types({TensorType{DType::f32, {"n"}}}, {{"param.scale", 2.0}}).at(0)),
            "f32[n]");

  FloatVec x({1, 2, -3}), out({0, 0, 0});
  op->run(DeviceKind::CPU, {x.tensor()}, {out.tensor()}, {{"param.scale", 2.0}, {"param.shift", 0.5}});
  EXPECT_EQ(out.data, (std::vector<float>{2.5f, 4.5f, -5.5f}));
  op->run(DeviceKind::CPU, {x.tensor()}, {out.tensor()}, {{"param.scale", -1.0}});
  EXPECT_EQ(out.data, (std::vector<float>{-1, -2, 3}));
  // 1.0's only code is KILN_EXT_ERROR: an ExtensionError, with the code named.
  expect_error<ExtensionError>([&] { op->run(DeviceKind::CPU, {x.tensor()}, {out.tensor()}, {{"param.scale", 0.0}}); },
                               {"custom op 'v1_0_affine' of " + kV1_0, "failed with KILN_EXT_ERROR: scale must be nonzero"});
}

TEST(ExtensionAbi, OpOfA1_0LibraryIsCheckedWhenTheGraphIsBuilt) {
  ext::load_library(kV1_0);
  graph::Graph g("g", {TensorType{DType::f32, {"n"}}});
  graph::Graph::Scope scope(g);
  graph::Value x = g.inputs()[0];
  EXPECT_EQ(ops::custom("v1_0_affine", {x}, {TensorType{DType::f32, {"n"}}}, {{"scale", 3.0}}).size(), 1u);
  expect_error<ExtensionError>(
      [&] { ops::custom("v1_0_affine", {x}, {TensorType{DType::f32, {"n"}}}, {{"scale", 3.0}, {"bias", 1.0}}); },
      {"'v1_0_affine'", kV1_0, "unknown parameter 'bias'", "declared: 'scale', 'shift'"});
}

// ---- a newer minor ----------------------------------------------------------------------------------

TEST(ExtensionAbi, LibraryOfANewerMinorLoadsWithThePrefixKilnKnows) {
  auto lib = ext::load_library(kFuture);
  EXPECT_EQ(lib->abi_minor(), static_cast<uint32_t>(KILN_EXT_ABI_MINOR + 5));
  const ext::CustomOp* op = lib->find("future_mix");
  ASSERT_NE(op, nullptr);
  EXPECT_EQ(op->description(), "x * alpha + beta, from a newer minor");
  // Its param and kernel defs are larger than kiln's: a walk by kiln's sizeof would find garbage
  // where element 1 is.
  ASSERT_EQ(op->params().size(), 2u);
  EXPECT_EQ(op->params()[0].name, "alpha");
  EXPECT_EQ(op->params()[0].kind, KILN_EXT_PARAM_FLOAT64);
  EXPECT_TRUE(op->params()[0].required);
  EXPECT_EQ(op->params()[1].name, "beta");
  EXPECT_EQ(op->params()[1].kind, KILN_EXT_PARAM_INT64);
  EXPECT_FALSE(op->params()[1].required);
  EXPECT_TRUE(op->has_kernel(DeviceKind::CPU));
  EXPECT_TRUE(op->has_kernel(DeviceKind::GPU));

  FloatVec x({1, 2, 4}), out({0, 0, 0});
  op->run(DeviceKind::CPU, {x.tensor()}, {out.tensor()}, {{"param.alpha", 1.5}, {"param.beta", int64_t{2}}});
  EXPECT_EQ(out.data, (std::vector<float>{3.5f, 5, 8}));
  // The stand-in CUDA kernel, called through its own entry of the walked array, says UNSUPPORTED.
  expect_error<ExtensionError>([&] { op->run(DeviceKind::GPU, {x.tensor()}, {out.tensor()}, {{"param.alpha", 1.0}}); },
                               {"'future_mix'", kFuture, "KILN_EXT_ERROR_UNSUPPORTED", "stand-in"});
}

// ---- struct sizes the host refuses ---------------------------------------------------------------

TEST(ExtensionAbi, StructSizeSmallerThanTheDeclaredVersionIsRefused) {
  const std::string path = KILN_TEST_EXTENSION_SHORT_OP_DEF;
  expect_error<ExtensionError>(
      [&] { ext::load_library(path); },
      {"extension '" + path + "'", "KilnExtOpDef struct_size " + size_text(KILN_EXT_OP_DEF_STRUCT_SIZE_V1_0),
       "smaller than " + size_text(KILN_EXT_OP_DEF_STRUCT_SIZE_V1_1),
       "KilnExtOpDef in ABI 1." + std::to_string(KILN_EXT_ABI_MINOR), "the version the library declares"});
}

TEST(ExtensionAbi, ArrayWhoseElementsDisagreeOnTheirStructSizeIsRefused) {
  const std::string path = KILN_TEST_EXTENSION_UNEVEN_PARAMS;
  expect_error<ExtensionError>(
      [&] { ext::load_library(path); },
      {"extension '" + path + "'", "register_op 'fail_with'",
       "param 1 (KilnExtParamDef) has struct_size " + size_text(sizeof(KilnExtParamDef) + 8),
       "param 0 has " + size_text(sizeof(KilnExtParamDef))});
}

// ---- error codes ------------------------------------------------------------------------------------

TEST(ExtensionAbi, KernelErrorCodePicksTheExceptionAndIsNamed) {
  const ext::CustomOp* op = ext::load_library(kTestOps)->find("fail_with");
  ASSERT_NE(op, nullptr);
  FloatVec x({1, 2}), out({0, 0});
  auto run = [&](int64_t code) {
    op->run(DeviceKind::CPU, {x.tensor()}, {out.tensor()}, {{"param.code", code}, {"param.note", std::string("bad")}});
  };
  run(0);
  EXPECT_EQ(out.data, x.data);
  const std::string who = "custom op 'fail_with' of " + kTestOps + ": kernel failed with ";
  expect_error<ValueError>([&] { run(KILN_EXT_ERROR_INVALID_ARGUMENT); },
                           {who + "KILN_EXT_ERROR_INVALID_ARGUMENT: failing with code 2 as asked: bad"});
  expect_error<ExtensionError>([&] { run(KILN_EXT_ERROR); }, {who + "KILN_EXT_ERROR: failing with code 1"});
  expect_error<ExtensionError>([&] { run(KILN_EXT_ERROR_UNSUPPORTED); }, {who + "KILN_EXT_ERROR_UNSUPPORTED: "});
  expect_error<ExtensionError>([&] { run(KILN_EXT_ERROR_OUT_OF_MEMORY); }, {who + "KILN_EXT_ERROR_OUT_OF_MEMORY: "});
  expect_error<ExtensionError>([&] { run(KILN_EXT_ERROR_INTERNAL); }, {who + "KILN_EXT_ERROR_INTERNAL: "});
  // A code of a newer minor than this kiln knows is still an error, reported by number.
  expect_error<ExtensionError>([&] { run(42); }, {who + "unknown error code 42: failing with code 42 as asked"});
}

TEST(ExtensionAbi, InitFailureNamesThePathAndCode) {
  const std::string path = KILN_TEST_EXTENSION_INIT_FAILS;
  // UNSUPPORTED from init is still a load failure: an ExtensionError.
  expect_error<ExtensionError>([&] { ext::load_library(path); },
                               {"extension '" + path + "'",
                                "kiln_extension_init failed with KILN_EXT_ERROR_UNSUPPORTED: needs a GPU this machine lacks"});
}
