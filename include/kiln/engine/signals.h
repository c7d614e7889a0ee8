// Signal buffers: per-device barrier flags and scratch memory that kiln's collective kernels
// (ops::allreduce_sum, ops::allgather) use to synchronise devices without a central thread or lock.
// A graph that runs on N >= 2 devices takes N of them as inputs, BufferType(u8, [SIGNAL_BYTES],
// device_i). Layout and protocol: docs/multi-device.md.
//
//   engine::Signals signals(devices);
//   graph::Graph g("tp", {x0_type, x1_type, signals.input_types()[0], signals.input_types()[1]});
//   model.execute({x0, x1, signals.buffers()[0], signals.buffers()[1]});
#pragma once

#include <cstdint>
#include <vector>

#include "kiln/tensor/tensor.h"
#include "kiln/graph/signals.h"
#include "kiln/graph/types.h"

namespace kiln::engine {

using graph::SIGNAL_BYTES;
using graph::SIGNAL_HEADER_BYTES;
using graph::SIGNAL_SCRATCH_BYTES;

// One zeroed signal buffer per device, in order (zero is the barrier's initial state). Reuse the same
// buffers for every call of a model: their counters advance together. ValueError for no devices or
// a device listed twice.
class Signals {
 public:
  explicit Signals(std::vector<DeviceRef> devices);
  const std::vector<DeviceRef>& devices() const { return devices_; }
  const std::vector<Tensor>& buffers() const { return buffers_; }
  // BufferType(u8, [SIGNAL_BYTES], device_i) per device, for a graph's input types.
  std::vector<graph::Type> input_types() const;

 private:
  std::vector<DeviceRef> devices_;
  std::vector<Tensor> buffers_;
};

// Signals(devices).buffers().
std::vector<Tensor> make_signal_buffers(const std::vector<DeviceRef>& devices);

}  // namespace kiln::engine
