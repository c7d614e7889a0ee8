// Private: the CPU backend's kernel list, and (transitional) the old kernel signature that
// kernel files not yet turned into Kernel objects (kernels/kernel.h) still use.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <tuple>
#include <span>
#include <string>
#include <vector>

#include "kernels/kernel.h"
#include "kernels/registry.h"
#include "kiln/distributed.h"
#include "kiln/graph/op.h"

namespace kiln::kernels {

// What a kernel derives once from operands that never change between runs (weights, constants):
// weights packed into the layout its inner loop reads, for instance. The executor builds it at init
// for each step whose kernel has a prepare function and hands it back on every launch.
struct Prepared {
  virtual ~Prepared() = default;
};


// inputs/outputs follow the node's operand/result order; attrs are the node's (see op.h).
// A kernel reports bad input by throwing (Error subclasses); the executor adds the op and node.
using KernelFn = KernelRegistry::LegacyFn;

// Called at init with the step's operands: those fixed for the model's life (`fixed[i]`) have their
// data; the others have data == nullptr and their static shape, or no shape when it is symbolic.
// Returns nullptr when there is nothing worth preparing. A kernel must give the same results with
// and without its prepared state (a launch list or another engine may run it without).
using PrepareFn = KernelRegistry::LegacyPrepareFn;

// Transitional (the old signature, until every kernel file defines Kernel objects): the dtype a
// kernel is registered under, as graph::kernel_key.
DType kernel_dtype(graph::Op op, const std::vector<DType>& input_dtypes,
                   const std::vector<DType>& output_dtypes);

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
void register_cpu_grouped_matmul(KernelRegistry&);  // looks matmul / qmatmul up in the registry
void register_cpu_quantized(KernelRegistry&);

}  // namespace kiln::kernels
