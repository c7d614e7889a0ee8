// pipelines::convert_weights: checkpoint tensors converted at init to the dtype/shape a traced graph
// declares (casts between f32/f16/bf16, Q8_0 rows), checked against hand-computed values.
#include <gtest/gtest.h>

#include <kiln/pipelines/weight_conversion.h>

#include <cstring>
#include <vector>

#include "test_util.h"

namespace {

using namespace kiln;

graph::Weight decl(const std::string& name, DType dtype, std::vector<int64_t> shape) {
  return graph::Weight{name, dtype, graph::Shape::of(shape), DeviceRef::CPU()};
}

TEST(ConvertWeights, QuantizesFloatRowsToGgufQ8_0Blocks) {
  // Row 0: 0.5 * (i - 16) for i < 32, so max |x| = 8, d = 8 / 127, q_i = round((i - 16) * 127 / 16).
  // Row 1: all zeros, so scale 0 and quants 0.
  std::vector<float> values(2 * 32, 0.0f);
  for (int i = 0; i < 32; ++i) values[i] = 0.5f * static_cast<float>(i - 16);
  WeightsRegistry checkpoint{{"w", Tensor::from_vector(values, {2, 32})}};
  const WeightsRegistry out = pipelines::convert_weights(checkpoint, {{"w", decl("w", DType::u8, {2, 34})}}, 2);
  const std::vector<uint8_t> bytes = out.at("w").to_vector<uint8_t>();
  ASSERT_EQ(bytes.size(), 68u);
  uint16_t d;
  std::memcpy(&d, bytes.data(), 2);
  EXPECT_EQ(d, f32_to_f16(8.0f / 127.0f));
  EXPECT_EQ(static_cast<int8_t>(bytes[2 + 0]), -127);  // -8
  EXPECT_EQ(static_cast<int8_t>(bytes[2 + 17]), 8);    // 0.5 * 127 / 8 = 7.94 -> 8
  EXPECT_EQ(static_cast<int8_t>(bytes[2 + 31]), 119);  // 7.5 * 127 / 8 = 119.06
  for (int i = 34; i < 68; ++i) EXPECT_EQ(bytes[i], 0) << i;
}

TEST(ConvertWeights, CastsBetweenFloatDtypesAndPassesMatchesThrough) {
  Tensor f32 = Tensor::from_vector(std::vector<float>{1.0f, 1.00390625f, -2.5f}, {3});
  Tensor same = Tensor::from_vector(std::vector<float>{4.0f}, {1});
  WeightsRegistry checkpoint{{"a", f32}, {"b", same}, {"unused", same}};
  const WeightsRegistry out = pipelines::convert_weights(
      checkpoint, {{"a", decl("a", DType::bf16, {3})}, {"b", decl("b", DType::f32, {1})}});
  const std::vector<bf16_t> a = out.at("a").to_vector<bf16_t>();
  EXPECT_EQ(a[0].bits, 0x3F80);
  EXPECT_EQ(a[1].bits, 0x3F80);  // 1 + 2^-8 is a tie in bf16: rounds to even (1.0)
  EXPECT_EQ(a[2].bits, 0xC020);
  EXPECT_EQ(out.at("b").data(), same.data()) << "a matching tensor is not copied";
  EXPECT_EQ(out.count("unused"), 1u);
}

TEST(ConvertWeights, RejectsMissingAndImpossibleConversionsNamingTheWeight) {
  WeightsRegistry checkpoint{{"w", Tensor::zeros(DType::f32, {4, 48})}, {"ids", Tensor::zeros(DType::i64, {4})}};
  kiln::testing::expect_error<ValueError>(
      [&] { pipelines::convert_weights(checkpoint, {{"v", decl("v", DType::f32, {4})}}); }, {"'v'", "no weight"});
  kiln::testing::expect_error<ValueError>(
      [&] { pipelines::convert_weights(checkpoint, {{"w", decl("w", DType::u8, {4, 51})}}); }, {"w", "multiple of 32", "48"});
  kiln::testing::expect_error<ValueError>(
      [&] { pipelines::convert_weights(checkpoint, {{"w", decl("w", DType::bf16, {48, 4})}}); }, {"'w'", "shapes differ"});
  kiln::testing::expect_error<ValueError>(
      [&] { pipelines::convert_weights(checkpoint, {{"ids", decl("ids", DType::f32, {4})}}); }, {"'ids'", "i64[4]"});
}

}  // namespace
