// Private: the CPU backend's kernels (kernels/kernel.h objects) and its one registration list.
#pragma once

#include "kernels/kernel.h"
#include "kernels/registry.h"

namespace kiln::kernels {

// The CPU backend's kernels: the list in register.cpp, built on first use. Explicit registration
// (not static initialisers), because a static library drops object files nothing references.
const KernelRegistry& cpu_kernels();

// Each kernel file registers its kernels with one line per (op, dtypes) entry; cpu_kernels() calls
// these (register.cpp).
void register_cpu_elementwise(KernelRegistry&);
void register_cpu_reductions(KernelRegistry&);
void register_cpu_matmul(KernelRegistry&);
void register_cpu_normalization(KernelRegistry&);
void register_cpu_data_movement(KernelRegistry&);
void register_cpu_sources(KernelRegistry&);
void register_cpu_collectives(KernelRegistry&);
void register_cpu_fused(KernelRegistry&);
void register_cpu_attention(KernelRegistry&);
void register_cpu_rope(KernelRegistry&);
void register_cpu_grouped_matmul(KernelRegistry&);
void register_cpu_quantized(KernelRegistry&);
void register_cpu_paged_attention(KernelRegistry&);

}  // namespace kiln::kernels
