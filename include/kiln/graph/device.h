// Where a value lives: a device kind and an index. CPU(i) for i > 0 is a logical CPU device.
#pragma once

#include <string>
#include <string_view>

namespace kiln {

enum class DeviceKind : uint8_t { CPU, GPU };

std::string_view device_kind_name(DeviceKind kind);  // "cpu", "gpu"

struct DeviceRef {
  DeviceKind kind = DeviceKind::CPU;
  int id = 0;

  static DeviceRef CPU(int id = 0) { return {DeviceKind::CPU, id}; }
  static DeviceRef GPU(int id = 0) { return {DeviceKind::GPU, id}; }
  bool operator==(const DeviceRef&) const = default;
  auto operator<=>(const DeviceRef&) const = default;
  std::string to_string() const;                  // "cpu:0", "gpu:1"
  static DeviceRef parse(std::string_view text);  // inverse of to_string; ValueError otherwise
};

}  // namespace kiln
