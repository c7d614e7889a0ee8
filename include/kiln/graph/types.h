// The types of graph values: immutable tensors and mutable buffers (in-place state such as a KV cache).
#pragma once

#include <string>
#include <variant>

#include "kiln/graph/device.h"
#include "kiln/graph/dim.h"
#include "kiln/graph/dtype.h"

namespace kiln::graph {

// The most dims a parsed shape (graph text, artifacts) may have; far above any real tensor's.
inline constexpr int64_t kMaxRank = 64;

struct TensorType {
  DType dtype = DType::f32;
  Shape shape;
  DeviceRef device = DeviceRef::CPU();
  int64_t rank() const { return shape.rank(); }
  std::string to_string() const;  // "f32[batch, 64]" (device shown only when not cpu:0: "f32[2]@gpu:0")
  bool operator==(const TensorType&) const = default;
};

struct BufferType {
  DType dtype = DType::f32;
  Shape shape;
  DeviceRef device = DeviceRef::CPU();
  int64_t rank() const { return shape.rank(); }
  std::string to_string() const;  // "buffer<f32[16, 64]>"
  bool operator==(const BufferType&) const = default;
};

// Any value's type; also what a graph input may be.
using Type = std::variant<TensorType, BufferType>;
using InputType = Type;

std::string to_string(const Type&);
Type parse_type(std::string_view text);  // inverse of to_string; ParseError on bad text
DType dtype_of(const Type&);
const Shape& shape_of(const Type&);
DeviceRef device_of(const Type&);
inline bool is_buffer(const Type& t) { return std::holds_alternative<BufferType>(t); }

}  // namespace kiln::graph
