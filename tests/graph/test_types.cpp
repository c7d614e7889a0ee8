#include <gtest/gtest.h>

#include "kiln/errors.h"
#include "kiln/graph/types.h"

using namespace kiln;
using namespace kiln::graph;

TEST(DeviceRef, ToStringAndParse) {
  EXPECT_EQ(DeviceRef::CPU().to_string(), "cpu:0");
  EXPECT_EQ(DeviceRef::GPU(1).to_string(), "gpu:1");
  EXPECT_EQ(DeviceRef::parse("gpu:1"), DeviceRef::GPU(1));
  EXPECT_EQ(DeviceRef::parse("cpu:12"), DeviceRef::CPU(12));
  EXPECT_LT(DeviceRef::CPU(5), DeviceRef::GPU(0));
}

TEST(DeviceRef, ParseRejectsBadText) {
  for (const char* bad : {"cpu", "tpu:0", "cpu:", "cpu:-1", "cpu:1x", "CPU:0", "gpu: 1", "cpu:99999999999"}) {
    try {
      DeviceRef::parse(bad);
      ADD_FAILURE() << "accepted '" << bad << "'";
    } catch (const ValueError& e) {
      EXPECT_NE(std::string(e.what()).find(std::string("'") + bad + "'"), std::string::npos) << e.what();
    }
  }
}

TEST(TensorType, ToStringShowsDeviceOnlyWhenNotCpu0) {
  TensorType t{DType::f32, Shape{"batch", 64}, DeviceRef::CPU()};
  EXPECT_EQ(t.to_string(), "f32[batch, 64]");
  EXPECT_EQ(t.rank(), 2);
  EXPECT_EQ((TensorType{DType::bf16, Shape::of({2}), DeviceRef::GPU(0)}).to_string(), "bf16[2]@gpu:0");
  EXPECT_EQ((TensorType{DType::i64, Shape{}, DeviceRef::CPU(1)}).to_string(), "i64[]@cpu:1");
  EXPECT_EQ((TensorType{DType::boolean, Shape{Dim("s") + 1}}).to_string(), "bool[s + 1]");
}

TEST(BufferType, ToStringWrapsTheTensorForm) {
  BufferType b{DType::f32, Shape::of({16, 64})};
  EXPECT_EQ(b.to_string(), "buffer<f32[16, 64]>");
  EXPECT_EQ((BufferType{DType::u8, Shape::of({4}), DeviceRef::GPU(2)}).to_string(), "buffer<u8[4]@gpu:2>");
}

TEST(Type, VariantAccessorsAndToString) {
  Type t = TensorType{DType::f16, Shape{"n", 3}, DeviceRef::GPU(1)};
  Type b = BufferType{DType::i32, Shape::of({8}), DeviceRef::CPU()};
  EXPECT_EQ(to_string(t), "f16[n, 3]@gpu:1");
  EXPECT_EQ(to_string(b), "buffer<i32[8]>");
  EXPECT_EQ(dtype_of(t), DType::f16);
  EXPECT_EQ(dtype_of(b), DType::i32);
  EXPECT_EQ(shape_of(t), (Shape{"n", 3}));
  EXPECT_EQ(shape_of(b), Shape::of({8}));
  EXPECT_EQ(device_of(t), DeviceRef::GPU(1));
  EXPECT_EQ(device_of(b), DeviceRef::CPU());
  EXPECT_FALSE(is_buffer(t));
  EXPECT_TRUE(is_buffer(b));
}

TEST(Type, ParseIsTheInverseOfToString) {
  const std::vector<Type> types = {
      TensorType{DType::f32, Shape{"batch", 64}},
      TensorType{DType::bf16, Shape::of({2}), DeviceRef::GPU(0)},
      TensorType{DType::i64, Shape{}},
      TensorType{DType::boolean, Shape{Dim("seq") + 1, (Dim("n") + 1) / 2, 2 * (Dim("n") / 2)}},
      TensorType{DType::u16, Shape{Dim("total") - Dim("seq"), Dim("a") / Dim("b")}, DeviceRef::CPU(3)},
      BufferType{DType::f32, Shape::of({16, 64})},
      BufferType{DType::f16, Shape{"pages", 8}, DeviceRef::GPU(1)},
  };
  for (const Type& t : types) {
    const std::string text = to_string(t);
    EXPECT_EQ(parse_type(text), t) << text;
    EXPECT_EQ(to_string(parse_type(text)), text);
  }
}

TEST(Type, ParseAcceptsLooseSpacing) {
  EXPECT_EQ(parse_type("f32[batch,64]"), Type(TensorType{DType::f32, Shape{"batch", 64}}));
  EXPECT_EQ(parse_type(" buffer<u8[ 4 ]> "), Type(BufferType{DType::u8, Shape::of({4})}));
}

TEST(Type, ParseRejectsBadTextNamingIt) {
  for (const char* bad : {"f32", "f31[2]", "f32[2", "f32[2,]", "f32[,2]", "f32[2]gpu:0", "f32[2]@tpu:0",
                          "buffer<f32[2]", "f32[n +]", "f32[-1]", ""}) {
    try {
      parse_type(bad);
      ADD_FAILURE() << "accepted '" << bad << "'";
    } catch (const ParseError& e) {
      EXPECT_NE(std::string(e.what()).find("parse"), std::string::npos) << e.what();
    }
  }
}

TEST(Type, EqualityComparesCanonicalDims) {
  TensorType a{DType::f32, Shape{(Dim("n") + 1) - 1}};
  TensorType b{DType::f32, Shape{"n"}};
  EXPECT_EQ(a, b);
  EXPECT_NE(a, (TensorType{DType::f16, Shape{"n"}}));
  EXPECT_NE(a, (TensorType{DType::f32, Shape{"n"}, DeviceRef::GPU(0)}));
}
