#include "kiln/engine/signals.h"

#include <fmt/format.h>

#include "kiln/errors.h"

namespace kiln::engine {

Signals::Signals(std::vector<DeviceRef> devices) : devices_(std::move(devices)) {
  if (devices_.empty()) throw ValueError("Signals: needs at least one device, got none");
  for (size_t i = 0; i < devices_.size(); ++i)
    for (size_t j = 0; j < i; ++j)
      if (devices_[i] == devices_[j])
        throw ValueError(fmt::format("Signals: device {} is listed twice (positions {} and {})",
                                     devices_[i].to_string(), j, i));
  if (static_cast<int64_t>(devices_.size()) > graph::MAX_SIGNAL_PEERS)
    throw ValueError(fmt::format("Signals: at most {} devices, got {}", graph::MAX_SIGNAL_PEERS, devices_.size()));
  buffers_.reserve(devices_.size());
  for (const DeviceRef& device : devices_) buffers_.push_back(Tensor::zeros(DType::u8, {SIGNAL_BYTES}, device));
}

std::vector<graph::Type> Signals::input_types() const {
  std::vector<graph::Type> types;
  for (const DeviceRef& device : devices_) types.push_back(graph::BufferType{DType::u8, {SIGNAL_BYTES}, device});
  return types;
}

std::vector<Tensor> make_signal_buffers(const std::vector<DeviceRef>& devices) { return Signals(devices).buffers(); }

}  // namespace kiln::engine
