// Private: host memory for buffers that may be large and live long (tensors on cpu devices, weights
// packed at init, kernel scratch).
#pragma once

#include <sys/mman.h>

#include <cstddef>
#include <cstdlib>

namespace kiln {

// Memory for buffers that may be large and live long (engine tensors, weights packed at init):
// 64-byte aligned, and from 2 MiB on 2 MiB-aligned with transparent huge pages advised, so that
// streaming through it does not miss the TLB every 4 KiB (the heap, where glibc puts most such
// blocks, gets no huge pages otherwise). nullptr when out of memory; free with std::free.
inline void* allocate_aligned(size_t bytes) {
  constexpr size_t kHugePage = size_t{2} << 20;
  const size_t alignment = bytes >= kHugePage ? kHugePage : 64;
  void* p = std::aligned_alloc(alignment, (bytes + alignment - 1) / alignment * alignment);
  if (p && bytes >= kHugePage) madvise(p, bytes, MADV_HUGEPAGE);  // a hint: failure is harmless
  return p;
}

}  // namespace kiln
