// The size of a signal buffer, the per-device memory kiln's collectives synchronise through (layout:
// docs/multi-device.md). Here, in the graph layer, so collective ops can check their operands'
// types; engine/signals.h allocates them.
#pragma once

#include <cstdint>

namespace kiln::graph {

// One page of flags (one 64-byte line per peer, up to 64 devices), then the scratch space small
// collectives stage data through; larger ones read their peers' tensors directly.
inline constexpr int64_t SIGNAL_HEADER_BYTES = 4096;
inline constexpr int64_t SIGNAL_SCRATCH_BYTES = int64_t{1} << 20;
inline constexpr int64_t SIGNAL_BYTES = SIGNAL_HEADER_BYTES + SIGNAL_SCRATCH_BYTES;
inline constexpr int64_t MAX_SIGNAL_PEERS = SIGNAL_HEADER_BYTES / 64;

}  // namespace kiln::graph
