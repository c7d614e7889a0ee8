// Private: AlignedScratch, a growable buffer for one thread's kernel scratch (packed panels, tile blocks)
// kept between calls, so the hot path allocates only when a call needs more than any before it on
// this thread.
#pragma once

#include <cstddef>
#include <cstdlib>
#include <memory>
#include <new>

#include "tensor/host_memory.h"

namespace kiln::kernels {

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
