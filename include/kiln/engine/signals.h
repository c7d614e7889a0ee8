// Signal buffers: per-device barrier flags and scratch memory that kiln's collective kernels
// (ops::allreduce_sum, allgather) use to synchronise devices without a central thread. A graph that
// runs on N >= 2 devices takes N of them as inputs, BufferType(u8, [SIGNAL_BYTES], device_i).
#pragma once

#include <cstdint>
#include <vector>

#include "kiln/engine/tensor.h"

namespace kiln::engine {

// One page of flags and counters (one cache line per peer for up to 64 devices), then the scratch
// space a collective stages partial results through. 1 MiB of scratch holds a decode step's hidden
// state many times over; larger reductions run in chunks of it.
inline constexpr int64_t SIGNAL_HEADER_BYTES = 4096;
inline constexpr int64_t SIGNAL_SCRATCH_BYTES = int64_t{1} << 20;
inline constexpr int64_t SIGNAL_BYTES = SIGNAL_HEADER_BYTES + SIGNAL_SCRATCH_BYTES;

// Zeroed signal buffers, one per device in order (zero is the barrier's initial state).
inline std::vector<Tensor> make_signal_buffers(const std::vector<DeviceRef>& devices) {
  std::vector<Tensor> buffers;
  buffers.reserve(devices.size());
  for (const DeviceRef& device : devices) buffers.push_back(Tensor::zeros(DType::u8, {SIGNAL_BYTES}, device));
  return buffers;
}

}  // namespace kiln::engine
