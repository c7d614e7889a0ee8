// Private: the matmul kernel's decode problem, for kernels that run several matmuls as one job
// (grouped_matmul).
#pragma once

#include <optional>

#include "kernels/cpu/gemm.h"
#include "kernels/cpu/kernels.h"

namespace kiln::kernels {

// The GEMV that matmul(a, rhs) with these attributes (transpose_b) runs, as one problem of the SIMD
// GEMM: f32/f16/bf16 (or f32 with f16/bf16 weights) on a SIMD level, batches folded into at most
// gemm::kSmallM rows. nullopt when matmul runs it some other way. Bad operands throw matmul's errors.
std::optional<gemm::Problem> matmul_gemv_problem(const graph::Attrs& attrs, const TensorView& a, const TensorView& rhs,
                                                 const TensorView& out);

}  // namespace kiln::kernels
