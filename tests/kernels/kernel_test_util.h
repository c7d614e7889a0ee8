// Kernel tests: host tensors over byte vectors, strided views of them, and calling a registered CPU
// kernel directly (serially), without the compiler or the engine.
#pragma once

#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "kernels/cpu/kernels.h"

namespace kiln::kernels::kernel_test {

inline std::vector<int64_t> contiguous_strides(const std::vector<int64_t>& shape) {
  std::vector<int64_t> strides(shape.size());
  int64_t s = 1;
  for (size_t i = shape.size(); i-- > 0;) {
    strides[i] = s;
    s *= shape[i];
  }
  return strides;
}

// A contiguous tensor that owns its bytes. Any dtype, bool included (std::vector<bool> has no data()).
struct HostTensor {
  DType dtype = DType::f32;
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;

  HostTensor() = default;
  HostTensor(DType d, std::vector<int64_t> s) : dtype(d), shape(std::move(s)) {
    bytes.assign(static_cast<size_t>(numel()) * dtype_size(dtype), 0);
  }
  int64_t numel() const {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    return n;
  }
  // A contiguous view. Const so inputs can be passed as temporaries; only kernels that write their
  // operand (outputs, buffer_store's buffer) write through it.
  TensorView view() const {
    return TensorView{const_cast<uint8_t*>(bytes.data()), dtype, shape, contiguous_strides(shape)};
  }
  template <class T> T at(int64_t i) const {
    T v;
    std::memcpy(&v, bytes.data() + i * sizeof(T), sizeof(T));
    return v;
  }
  template <class T> std::vector<T> values() const {
    std::vector<T> out;
    for (int64_t i = 0; i < numel(); ++i) out.push_back(at<T>(i));
    return out;
  }
  // Element i of any dtype, widened to double (f16/bf16 decoded exactly).
  double as_double(int64_t i) const {
    return visit_dtype(dtype, [&]<class T>() {
      if constexpr (std::is_same_v<T, f16_t> || std::is_same_v<T, bf16_t>)
        return static_cast<double>(static_cast<float>(at<T>(i)));
      else
        return static_cast<double>(at<T>(i));
    });
  }
};

template <class T> HostTensor tensor(std::vector<int64_t> shape, const std::vector<T>& values) {
  HostTensor t(dtype_of<T>(), std::move(shape));
  if (static_cast<int64_t>(values.size()) != t.numel())
    throw std::logic_error("tensor: value count does not match the shape");
  for (size_t i = 0; i < values.size(); ++i) {
    T v = values[i];
    std::memcpy(t.bytes.data() + i * sizeof(T), &v, sizeof(T));
  }
  return t;
}

// Values in [-1, 1) from a fixed linear congruential sequence.
inline std::vector<double> pseudo_random(int64_t n, uint32_t seed) {
  std::vector<double> out;
  for (int64_t i = 0; i < n; ++i) {
    seed = seed * 1664525u + 1013904223u;
    out.push_back(static_cast<double>(seed >> 8) / static_cast<double>(1u << 23) - 1.0);
  }
  return out;
}

// Values converted to `dtype` as C++ static_cast does (f16/bf16 through float, rounding to even).
inline HostTensor tensor_from_doubles(DType dtype, std::vector<int64_t> shape,
                                      const std::vector<double>& values) {
  return visit_dtype(dtype, [&]<class T>() {
    std::vector<T> converted;
    for (double v : values) {
      if constexpr (std::is_same_v<T, f16_t> || std::is_same_v<T, bf16_t>)
        converted.push_back(T(static_cast<float>(v)));
      else
        converted.push_back(static_cast<T>(v));
    }
    return tensor<T>(shape, converted);
  });
}

// A view whose axis i is axis perm[i] of `v`: a strided, non-contiguous view of the same memory.
inline TensorView permuted(const TensorView& v, const std::vector<int64_t>& perm) {
  TensorView out = v;
  for (size_t i = 0; i < perm.size(); ++i) {
    out.shape[i] = v.shape[static_cast<size_t>(perm[i])];
    out.strides[i] = v.strides[static_cast<size_t>(perm[i])];
  }
  return out;
}

// Builds the registered CPU kernel for `op` (keyed as graph::kernel_key keys it: the first operand's
// dtype, else the first result's) from `attrs` and these operands (none of them fixed unless
// `fixed` says so), on the calling thread unless a `parallel` is given for its build-time work. A
// missing kernel throws std::logic_error naming the op and dtype.
inline std::unique_ptr<const Kernel> build_kernel(graph::Op op, const graph::Attrs& attrs,
                                                  const std::vector<TensorView>& inputs,
                                                  const std::vector<TensorView>& outputs,
                                                  std::span<const bool> fixed = {}, Parallel* parallel = nullptr) {
  DType key = !inputs.empty() ? inputs.front().dtype : !outputs.empty() ? outputs.front().dtype : DType::f32;
  KernelInit init{op, &attrs, inputs, fixed, nullptr};
  init.parallel = parallel;
  std::unique_ptr<const Kernel> kernel = cpu_kernels().build({op, DeviceKind::CPU, key}, init);
  if (!kernel)
    throw std::logic_error("no CPU kernel for " + std::string(graph::op_name(op)) + " on " +
                           std::string(dtype_name(key)));
  return kernel;
}

// Runs the registered CPU kernel for `op` (see build_kernel), on the calling thread unless a
// `parallel` is given.
inline void run_kernel(graph::Op op, const graph::Attrs& attrs, const std::vector<TensorView>& inputs,
                       const std::vector<TensorView>& outputs, Parallel* parallel = nullptr) {
  std::unique_ptr<const Kernel> kernel = build_kernel(op, attrs, inputs, outputs);
  SerialParallel serial;
  KernelContext ctx;
  ctx.parallel = parallel ? parallel : &serial;
  kernel->run(ctx, inputs, outputs);
}

// Runs a built kernel on these operands, on the calling thread unless a `parallel` is given.
inline void run_built(const Kernel& kernel, const std::vector<TensorView>& inputs,
                      const std::vector<TensorView>& outputs, Parallel* parallel = nullptr) {
  SerialParallel serial;
  KernelContext ctx;
  ctx.parallel = parallel ? parallel : &serial;
  kernel.run(ctx, inputs, outputs);
}

// Runs a single-result op and returns its (contiguous) result.
inline HostTensor run_op(graph::Op op, const graph::Attrs& attrs, const std::vector<TensorView>& inputs,
                         DType out_dtype, std::vector<int64_t> out_shape) {
  HostTensor out(out_dtype, std::move(out_shape));
  run_kernel(op, attrs, inputs, {out.view()});
  return out;
}

}  // namespace kiln::kernels::kernel_test
