// Private: aligned memory for kernels and the engine: allocate_aligned for large long-lived buffers,
// and AlignedScratch, a growable buffer for one thread's kernel scratch (packed panels, tile blocks)
// kept between calls, so the hot path allocates only when a call needs more than any before it on
// this thread.
#pragma once

#include <sys/mman.h>

#include <cstddef>
#include <cstdlib>
#include <memory>
#include <new>

namespace kiln::kernels {

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

template <class T>
class AlignedScratch {
 public:
  const T* data() const { return data_.get(); }
  // At least `elements` elements, 64-byte aligned; the contents are not kept when it grows.
  T* get(size_t elements) {
    if (elements > size_) {
      void* p = allocate_aligned(elements * sizeof(T));
      if (!p) throw std::bad_alloc();
      data_.reset(static_cast<T*>(p));
      size_ = elements;
    }
    return data_.get();
  }

 private:
  struct Free {
    void operator()(T* p) const { std::free(p); }
  };
  std::unique_ptr<T, Free> data_;
  size_t size_ = 0;
};

}  // namespace kiln::kernels
