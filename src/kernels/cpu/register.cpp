// The CPU backend's one registration list.
#include "kernels/cpu/kernels.h"

namespace kiln::kernels {

const KernelRegistry& cpu_kernels() {
  static const KernelRegistry registry = [] {
    KernelRegistry r;
    register_cpu_sources(r);
    register_cpu_collectives(r);
    register_cpu_elementwise(r);
    register_cpu_reductions(r);
    register_cpu_matmul(r);
    register_cpu_quantized(r);
    register_cpu_normalization(r);
    register_cpu_data_movement(r);
    register_cpu_fused(r);
    register_cpu_attention(r);
    register_cpu_rope(r);
    register_cpu_grouped_matmul(r);
    register_cpu_paged_attention(r);
    return r;
  }();
  return registry;
}

}  // namespace kiln::kernels
