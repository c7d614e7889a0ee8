// pipelines::convert_weights: checkpoint tensors converted at init to the dtype/shape a traced graph
// declares (casts between f32/f16/bf16, quantized rows), checked against hand-computed values and
// graph::quantize_row.
#include <gtest/gtest.h>

#include <kiln/pipelines/weight_conversion.h>

#include <cstring>
#include <random>
#include <vector>

#include "kiln/graph/quantization.h"

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

std::vector<uint8_t> quantize_rows(graph::QuantizationEncoding e, const std::vector<float>& x, int64_t rows) {
  const int64_t cols = static_cast<int64_t>(x.size()) / rows, rb = graph::quantized_row_bytes(e, cols);
  std::vector<uint8_t> out(static_cast<size_t>(rows * rb));
  for (int64_t r = 0; r < rows; ++r) graph::quantize_row(e, x.data() + r * cols, cols, out.data() + r * rb);
  return out;
}

// A u8 declaration is quantized in the model's encoding where its rows fit it, else in the one
// encoding that fits (a K-quant model's q8_0 fallback); Q4_0 and Q4_K rows are the same size, so
// without the model's encoding that is an error naming both.
TEST(ConvertWeights, QuantizesInTheModelsEncodingOrTheOneThatFits) {
  std::mt19937 rng(1);
  std::normal_distribution<float> dist;
  std::vector<float> wide(2 * 256), narrow(2 * 160);
  for (float& v : wide) v = dist(rng);
  for (float& v : narrow) v = dist(rng);
  const WeightsRegistry checkpoint{{"wide", Tensor::from_vector(wide, {2, 256})},
                                   {"narrow", Tensor::from_vector(narrow, {2, 160})}};
  using graph::QuantizationEncoding;
  for (QuantizationEncoding e : {QuantizationEncoding::q4_0, QuantizationEncoding::q4_k, QuantizationEncoding::q5_k,
                                 QuantizationEncoding::q6_k}) {
    const std::map<std::string, graph::Weight> declared{
        {"wide", decl("wide", DType::u8, {2, graph::quantized_row_bytes(e, 256)})},
        {"narrow", decl("narrow", DType::u8, {2, graph::quantized_row_bytes(graph::QuantizationEncoding::q8_0, 160)})}};
    const WeightsRegistry out = pipelines::convert_weights(checkpoint, declared, 2, e);
    EXPECT_EQ(out.at("wide").to_vector<uint8_t>(), quantize_rows(e, wide, 2)) << graph::encoding_name(e);
    EXPECT_EQ(out.at("narrow").to_vector<uint8_t>(), quantize_rows(QuantizationEncoding::q8_0, narrow, 2))
        << graph::encoding_name(e) << ": the q8_0 fallback";
  }
  // Unambiguous sizes need no encoding (Q6_K's 210 bytes per 256); Q4_0 / Q4_K's 144 do.
  const WeightsRegistry q6 = pipelines::convert_weights(checkpoint, {{"wide", decl("wide", DType::u8, {2, 210})}});
  EXPECT_EQ(q6.at("wide").to_vector<uint8_t>(), quantize_rows(QuantizationEncoding::q6_k, wide, 2));
  kiln::testing::expect_error<ValueError>(
      [&] { pipelines::convert_weights(checkpoint, {{"wide", decl("wide", DType::u8, {2, 144})}}); },
      {"'wide'", "q4_0 or q4_k", "pass the encoding"});
  kiln::testing::expect_error<ValueError>(
      [&] { pipelines::convert_weights(checkpoint, {{"wide", decl("wide", DType::u8, {2, 100})}}); },
      {"'wide'", "no encoding", "256 weights in 100 bytes"});
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
