// Which kernel runs a node: its op, the kind of device it runs on and the dtype it is registered
// under. The compiler records one per plan step (select_kernels); the engine runs what it recorded.
#pragma once

#include <compare>
#include <span>
#include <string>

#include "kiln/graph/device.h"
#include "kiln/graph/dtype.h"
#include "kiln/graph/op.h"
#include "kiln/graph/types.h"

namespace kiln::graph {

struct KernelKey {
  Op op = Op::constant;
  DeviceKind device = DeviceKind::CPU;
  DType dtype = DType::f32;
  auto operator<=>(const KernelKey&) const = default;
  std::string to_string() const;  // "cpu matmul f32"
};

// The key of a node from its operand and result types: the device is where its results live (its
// operands', for an op without results); the dtype is the first operand's (the first result's for an
// op without operands: constant, range). A node with neither runs on the cpu as f32.
KernelKey kernel_key(Op op, std::span<const Type> inputs, std::span<const Type> outputs);

}  // namespace kiln::graph
