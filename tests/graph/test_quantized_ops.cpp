// Type inference of the weight-dtype ops: matmul of f32 activations with f16/bf16 weights, and
// qmatmul / dequantize over Q8_0 rows (u8 [N, K / 32 * 34]), with the errors bad operands raise.
#include <gtest/gtest.h>

#include "test_util.h"
#include "kiln/errors.h"
#include "kiln/graph/graph.h"
#include "kiln/graph/ops.h"
#include "kiln/graph/quantization.h"

namespace {

using namespace kiln;
using namespace kiln::graph;
using kiln::testing::expect_error;

TensorType T(DType dtype, Shape shape) { return TensorType{dtype, std::move(shape), DeviceRef::CPU()}; }
constexpr QuantizationEncoding q8_0 = QuantizationEncoding::q8_0;

TEST(MixedMatmul, F32ActivationsTimesBf16OrF16WeightsGiveF32) {
  Graph g("m", {T(DType::f32, {"seq", 64}), T(DType::bf16, {64, 10}), T(DType::f16, {10, 64})});
  Graph::Scope scope(g);
  EXPECT_EQ(ops::matmul(g.input(0), g.input(1)).tensor_type(), T(DType::f32, {"seq", 10}));
  // nn::Linear's form: the weight transposed (the compiler folds it into transpose_b).
  EXPECT_EQ(ops::matmul(g.input(0), ops::transpose(g.input(2), 0, 1)).tensor_type(), T(DType::f32, {"seq", 10}));
}

TEST(MixedMatmul, OtherMixesAreDTypeErrors) {
  Graph g("m", {T(DType::bf16, {2, 64}), T(DType::f32, {64, 10}), T(DType::f16, {64, 10}), T(DType::f64, {2, 64})});
  Graph::Scope scope(g);
  expect_error<DTypeError>([&] { ops::matmul(g.input(0), g.input(1)); }, {"matmul", "bf16[2, 64]", "f32[64, 10]"});
  expect_error<DTypeError>([&] { ops::matmul(g.input(0), g.input(2)); }, {"bf16[2, 64]", "f16[64, 10]"});
  expect_error<DTypeError>([&] { ops::matmul(g.input(3), g.input(2)); }, {"f64[2, 64]", "f16[64, 10]"});
}

TEST(QMatmul, InfersF32RowsOfNFromQ8_0Weight) {
  Graph g("q", {T(DType::f32, {"seq", 64}), T(DType::u8, {100, 68}), T(DType::f32, {2, 3, 64})});
  Graph::Scope scope(g);
  EXPECT_EQ(ops::qmatmul(q8_0, g.input(0), g.input(1)).tensor_type(), T(DType::f32, {"seq", 100}));
  EXPECT_EQ(ops::qmatmul(q8_0, g.input(2), g.input(1)).tensor_type(), T(DType::f32, {2, 3, 100}));
}

TEST(QMatmul, RejectsWrongRowBytesDtypesAndKNotAMultipleOf32) {
  Graph g("q", {T(DType::f32, {2, 64}), T(DType::u8, {100, 64}), T(DType::f32, {2, 48}), T(DType::u8, {100, 51}),
                T(DType::bf16, {2, 64}), T(DType::f32, {2, "k"})});
  Graph::Scope scope(g);
  expect_error<ShapeError>([&] { ops::qmatmul(q8_0, g.input(0), g.input(1)); },
                           {"qmatmul", "68 bytes", "f32[2, 64]", "u8[100, 64]"});
  expect_error<ValueError>([&] { ops::qmatmul(q8_0, g.input(2), g.input(3)); }, {"qmatmul", "multiple of 32", "48"});
  expect_error<DTypeError>([&] { ops::qmatmul(q8_0, g.input(4), g.input(1)); }, {"qmatmul", "lhs must be f32"});
  expect_error<DTypeError>([&] { ops::qmatmul(q8_0, g.input(0), g.input(0)); }, {"qmatmul", "rhs must be the u8"});
  expect_error<ShapeError>([&] { ops::qmatmul(q8_0, g.input(5), g.input(1)); }, {"qmatmul", "static"});
}

TEST(Dequantize, GatheredQ8_0RowsBecomeF32RowsOfK) {
  Graph g("d", {T(DType::u8, {128, 68}), T(DType::i64, {"seq"}), T(DType::u8, {4, 35})});
  Graph::Scope scope(g);
  const TensorValue rows = ops::gather(g.input(0), g.input(1), 0);  // u8 [seq, 68]
  EXPECT_EQ(ops::dequantize(q8_0, rows).tensor_type(), T(DType::f32, {"seq", 64}));
  expect_error<ValueError>([&] { ops::dequantize(q8_0, g.input(2)); }, {"dequantize", "34 bytes", "35"});
  expect_error<DTypeError>([&] { ops::dequantize(q8_0, ops::cast(g.input(0), DType::f32)); },
                           {"dequantize", "u8"});
}

TEST(Quantization, EncodingNamesRoundTripAndUnknownNamesAreValueErrors) {
  EXPECT_EQ(encoding_name(q8_0), "q8_0");
  EXPECT_EQ(parse_encoding("q8_0"), q8_0);
  expect_error<ValueError>([] { parse_encoding("q3_k"); }, {"q3_k", "q8_0", "q4_k"});
  EXPECT_EQ(q8_0_row_bytes(64), 68);
}

}  // namespace
