// Per-device memory: each logical device has its own allocator (64-byte aligned), and Tensor::empty /
// zeros on a device allocate from it, so what a device holds can be read per device. Blocks of 64 KiB
// and more are cached when freed and handed out again (as PyTorch's caching allocator does): a fresh
// block from the OS costs a page fault per 4 KiB page on first touch, which on this class of VM is
// slower than the kernel that fills it, and a decode step allocates the same sizes every time. Blocks
// of 2 MiB and more ask for transparent huge pages.
//
//   auto before = kiln::memory_stats(kiln::DeviceRef::CPU(1));
//   auto t = kiln::Tensor::zeros(kiln::DType::f32, {1024}, kiln::DeviceRef::CPU(1));
//   // memory_stats(CPU(1)).bytes_in_use == before.bytes_in_use + 4096, until t is destroyed
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "kiln/graph/device.h"

namespace kiln {

// Counters of one device's allocator since the process started. Bytes are the sizes asked for (not
// rounded up to the alignment).
struct DeviceMemoryStats {
  int64_t bytes_in_use = 0;       // held by live allocations
  int64_t peak_bytes_in_use = 0;  // the most bytes_in_use has been (since reset_peak_memory)
  int64_t live_allocations = 0;   // allocations not yet freed
  int64_t total_allocations = 0;  // allocations ever made
  int64_t system_allocations = 0; // allocations that needed new memory from the system (cache misses)
  int64_t cached_bytes = 0;       // freed blocks kept for reuse (not in bytes_in_use)
};

// A device no tensor has been allocated on reads as all zeros.
DeviceMemoryStats memory_stats(DeviceRef device);
// Sets the device's peak to what it holds now (to measure the peak of one phase, e.g. one execute).
void reset_peak_memory(DeviceRef device);
// Returns the device's cached free blocks to the system.
void empty_cache(DeviceRef device);

// nbytes of 64-byte aligned memory counted against `device`, freed (and uncounted) when the last
// owner goes. Never null, even for 0 bytes. Error if the memory cannot be allocated; ValueError for a
// non-cpu device (kiln allocates only cpu memory).
std::shared_ptr<void> allocate(DeviceRef device, size_t nbytes);

}  // namespace kiln
