#include "kiln/graph/kernel_key.h"

#include <fmt/format.h>

namespace kiln::graph {

std::string KernelKey::to_string() const {
  return fmt::format("{} {} {}", device_kind_name(device), op_name(op), dtype_name(dtype));
}

KernelKey kernel_key(Op op, std::span<const Type> inputs, std::span<const Type> outputs) {
  KernelKey key{op, DeviceKind::CPU, DType::f32};
  if (!outputs.empty()) key.device = device_of(outputs.front()).kind;
  else if (!inputs.empty()) key.device = device_of(inputs.front()).kind;
  if (!inputs.empty()) key.dtype = dtype_of(inputs.front());
  else if (!outputs.empty()) key.dtype = dtype_of(outputs.front());
  return key;
}

}  // namespace kiln::graph
