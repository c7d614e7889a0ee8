// Tensor: memory on a device with a dtype, shape and strides (in elements), owning or borrowed, and
// DLPack import/export (both DLManagedTensor and DLManagedTensorVersioned).
//
//   auto t = kiln::Tensor::from_vector<float>({1, 2, 3, 4}, {2, 2});
//   DLManagedTensorVersioned* dl = t.to_dlpack_versioned();   // consumer calls dl->deleter(dl)
//   auto back = kiln::Tensor::from_dlpack(dl);                 // takes ownership; deleter runs once
#pragma once

#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <dlpack/dlpack.h>

#include "kiln/errors.h"
#include "kiln/graph/device.h"
#include "kiln/graph/dtype.h"

// Debian 12 ships DLPack 0.6, which predates the versioned struct of DLPack 1.0. kiln declares it with
// the 1.0 layout so it can exchange tensors with producers that speak 1.x.
#ifndef DLPACK_MAJOR_VERSION
extern "C" {
typedef struct {
  uint32_t major;
  uint32_t minor;
} DLPackVersion;

typedef struct DLManagedTensorVersioned {
  DLPackVersion version;
  void* manager_ctx;
  void (*deleter)(struct DLManagedTensorVersioned* self);
  uint64_t flags;
  DLTensor dl_tensor;
} DLManagedTensorVersioned;
}
#define KILN_DLPACK_VERSIONED_MAJOR 1
#define KILN_DLPACK_VERSIONED_MINOR 0
#define KILN_DLPACK_FLAG_READ_ONLY (UINT64_C(1) << 0)
#define KILN_DLPACK_FLAG_IS_COPIED (UINT64_C(1) << 1)
#else
#define KILN_DLPACK_VERSIONED_MAJOR DLPACK_MAJOR_VERSION
#define KILN_DLPACK_VERSIONED_MINOR DLPACK_MINOR_VERSION
#define KILN_DLPACK_FLAG_READ_ONLY DLPACK_FLAG_BITMASK_READ_ONLY
#define KILN_DLPACK_FLAG_IS_COPIED DLPACK_FLAG_BITMASK_IS_COPIED
#endif

namespace kiln {

class Tensor {
 public:
  Tensor() = default;  // undefined: defined() is false

  // New contiguous, 64-byte aligned memory (uninitialised / zeroed) from the device's allocator, which
  // counts it (memory_stats in kiln/tensor/device_memory.h).
  static Tensor empty(DType, const std::vector<int64_t>& shape, DeviceRef = DeviceRef::CPU());
  static Tensor zeros(DType, const std::vector<int64_t>& shape, DeviceRef = DeviceRef::CPU());
  template <class T>
  static Tensor from_vector(const std::vector<T>& values, const std::vector<int64_t>& shape);
  template <class T>
  static Tensor scalar(T value) { return from_vector<T>({value}, {}); }
  // Borrows memory the caller keeps alive; strides in elements (empty: contiguous row-major).
  static Tensor borrow(void* data, DType, const std::vector<int64_t>& shape,
                       const std::vector<int64_t>& strides = {}, DeviceRef = DeviceRef::CPU());
  // Shares memory kept alive by `keep_alive` (e.g. an mmap'd file).
  static Tensor view(std::shared_ptr<void> keep_alive, void* data, DType,
                     const std::vector<int64_t>& shape, const std::vector<int64_t>& strides = {},
                     DeviceRef = DeviceRef::CPU());

  // DLPack import: takes ownership of `managed` and calls its deleter exactly once, when the last
  // Tensor sharing the memory is gone (or at once, if the import fails). Unsupported dtypes, devices,
  // negative shapes and lanes != 1 are ValueErrors naming what is wrong.
  static Tensor from_dlpack(DLManagedTensor* managed);
  static Tensor from_dlpack(DLManagedTensorVersioned* managed);
  // DLPack export: the result shares this tensor's memory and keeps it alive until the consumer calls
  // its deleter (exactly once).
  DLManagedTensor* to_dlpack() const;
  DLManagedTensorVersioned* to_dlpack_versioned() const;

  bool defined() const { return data_ != nullptr || storage_ != nullptr; }
  DType dtype() const { return dtype_; }
  DeviceRef device() const { return device_; }
  const std::vector<int64_t>& shape() const { return shape_; }
  const std::vector<int64_t>& strides() const { return strides_; }
  int64_t rank() const { return static_cast<int64_t>(shape_.size()); }
  int64_t dim(int64_t i) const;  // negative counts from the end
  int64_t numel() const;
  size_t nbytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype_); }
  bool is_contiguous() const;
  bool is_owner() const;  // false for borrow()
  // What keeps the memory alive: the allocation, view()'s keep_alive, a DLPack import; null for
  // borrow().
  const std::shared_ptr<void>& keep_alive() const { return storage_; }

  void* data() { return data_; }
  const void* data() const { return data_; }
  template <class T> T* data_as();              // DTypeError if T is not the dtype
  template <class T> const T* data_as() const;

  Tensor contiguous() const;  // this when contiguous, else a packed copy
  Tensor clone() const;       // a packed copy with its own memory
  // Elements in row-major order, converted from the tensor's dtype (any dtype to T by static_cast,
  // f16/bf16 through float).
  template <class T> std::vector<T> to_vector() const;
  std::string to_string() const;  // "Tensor(f32[2, 2], cpu:0)"

 private:
  std::shared_ptr<void> storage_;  // keeps data_ alive; null for borrowed memory
  void* data_ = nullptr;
  DType dtype_ = DType::f32;
  std::vector<int64_t> shape_;
  std::vector<int64_t> strides_;
  DeviceRef device_ = DeviceRef::CPU();
};

using DLPackArray = Tensor;
using WeightsRegistry = std::map<std::string, DLPackArray>;

// Row-major strides (in elements) of a shape.
std::vector<int64_t> contiguous_strides(const std::vector<int64_t>& shape);

// ---- template definitions ----------------------------------------------------------------------
template <class T>
Tensor Tensor::from_vector(const std::vector<T>& values, const std::vector<int64_t>& shape) {
  Tensor t = empty(dtype_of<T>(), shape);
  if (static_cast<size_t>(t.numel()) != values.size())
    throw ValueError("Tensor::from_vector: " + std::to_string(values.size()) +
                     " values for a shape of " + std::to_string(t.numel()) + " elements");
  if constexpr (std::is_same_v<T, bool>) {
    auto* out = static_cast<bool*>(t.data());
    for (size_t i = 0; i < values.size(); ++i) out[i] = values[i];
  } else if (!values.empty()) {
    std::memcpy(t.data(), values.data(), values.size() * sizeof(T));
  }
  return t;
}

template <class T>
T* Tensor::data_as() {
  if (dtype_of<T>() != dtype_)
    throw DTypeError("Tensor::data_as: tensor is " + std::string(dtype_name(dtype_)) + ", asked for " +
                     std::string(dtype_name(dtype_of<T>())));
  return static_cast<T*>(data_);
}
template <class T>
const T* Tensor::data_as() const {
  return const_cast<Tensor*>(this)->data_as<T>();
}

template <class T>
std::vector<T> Tensor::to_vector() const {
  Tensor packed = contiguous();
  std::vector<T> out(static_cast<size_t>(packed.numel()));
  visit_dtype(dtype_, [&]<class S>() {
    const S* src = static_cast<const S*>(packed.data());
    for (size_t i = 0; i < out.size(); ++i) {
      if constexpr (std::is_same_v<S, f16_t> || std::is_same_v<S, bf16_t>)
        out[i] = static_cast<T>(static_cast<float>(src[i]));
      else if constexpr (std::is_same_v<T, f16_t> || std::is_same_v<T, bf16_t>)
        out[i] = T(static_cast<float>(src[i]));
      else
        out[i] = static_cast<T>(src[i]);
    }
  });
  return out;
}

}  // namespace kiln
