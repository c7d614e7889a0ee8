#include "kernels/cpu/kernels.h"

namespace kiln::kernels {

void KernelRegistry::add(graph::Op op, DeviceKind device, std::initializer_list<DType> dtypes,
                         KernelFn fn) {
  for (DType d : dtypes) table_[{op, device, d}] = fn;
}

KernelFn KernelRegistry::find(graph::Op op, DeviceKind device, DType dtype) const {
  auto it = table_.find({op, device, dtype});
  return it == table_.end() ? nullptr : it->second;
}

void KernelRegistry::add_prepare(graph::Op op, DeviceKind device, std::initializer_list<DType> dtypes,
                                 PrepareFn fn) {
  for (DType d : dtypes) prepare_table_[{op, device, d}] = fn;
}

PrepareFn KernelRegistry::find_prepare(graph::Op op, DeviceKind device, DType dtype) const {
  auto it = prepare_table_.find({op, device, dtype});
  return it == prepare_table_.end() ? nullptr : it->second;
}

const KernelRegistry& builtin_kernels() {
  static const KernelRegistry registry = [] {
    KernelRegistry r;
    register_cpu_sources(r);
    register_cpu_collectives(r);
    register_cpu_elementwise(r);
    register_cpu_reductions(r);
    register_cpu_matmul(r);
    register_cpu_normalization(r);
    register_cpu_data_movement(r);
    register_cpu_fused(r);
    register_cpu_attention(r);
    register_cpu_rope(r);
    register_cpu_grouped_matmul(r);
    return r;
  }();
  return registry;
}

DType kernel_dtype(graph::Op, const std::vector<DType>& input_dtypes,
                   const std::vector<DType>& output_dtypes) {
  if (!input_dtypes.empty()) return input_dtypes.front();
  if (!output_dtypes.empty()) return output_dtypes.front();
  return DType::f32;
}

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

bool TensorView::is_contiguous() const {
  int64_t expected = 1;
  for (size_t i = shape.size(); i-- > 0;) {
    if (shape[i] != 1 && strides[i] != expected) return false;
    expected *= shape[i];
  }
  return true;
}

}  // namespace kiln::kernels
