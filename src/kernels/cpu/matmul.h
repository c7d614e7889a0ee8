// Private: the matmul kernel (matmul.cpp: the op's dispatch and its kernel object; matmul_portable.cpp:
// the portable GEMM), for the kernels built on it (grouped_matmul runs several matmuls as one job).
#pragma once

#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "kernels/cpu/gemm.h"
#include "kernels/kernel.h"

namespace kiln::kernels {

// The matmul kernel of a step: `transpose_b` read once, and a fixed rhs (a weight) packed at build
// where a launch can read the packed copy (f32 panels of the SIMD GEMM, AMX tiles for bf16). Throws
// the attribute's error.
std::unique_ptr<const Kernel> make_matmul_kernel(const KernelInit& init);

// matmul's transpose_b attribute (0 when absent).
bool matmul_transpose_b(const KernelInit& init);

// The GEMV that the matmul kernel `matmul` (make_matmul_kernel's) runs for (a, rhs), as one problem
// of the SIMD GEMM: f32/f16/bf16 (or f32 with f16/bf16 weights) on a SIMD level, batches folded into
// at most gemm::kSmallM rows (gemm::kNarrowSmallMMax for f16/bf16 weights that were not packed at
// init, unless AMX takes bf16 ones). nullopt when the kernel runs it some other way (or is not a
// matmul kernel). Bad operands throw matmul's errors.
std::optional<gemm::Problem> matmul_gemv_problem(const Kernel& matmul, const TensorView& a, const TensorView& rhs,
                                                 const TensorView& out);

// Tests: what a matmul kernel (make_matmul_kernel) packed at build from its fixed rhs.
// f32_panels: an f32 weight in the SIMD GEMM's panels; narrow_panels: an f16 / bf16 one in that
// layout, 16 bits an element; amx_tiles: a bf16 one in AMX tiles.
enum class MatmulPacking { none, f32_panels, narrow_panels, amx_tiles };
MatmulPacking matmul_packing(const Kernel& matmul);
// Tests: the matmul (qmatmul) kernel a grouped_matmul kernel built for rhs `index`; nullptr if none.
const Kernel* grouped_matmul_part(const Kernel& grouped, size_t index);

// ---- shared by matmul.cpp and matmul_portable.cpp ---------------------------------------------------

// The operands normalised to [batch..., M, K] x [batch..., K, N].
struct MatmulProblem {
  int64_t M = 0, K = 0, N = 0;
  std::vector<int64_t> batch_shape;      // broadcast batch dims
  std::vector<int64_t> a_batch_strides;  // per batch dim, 0 where broadcast
  std::vector<int64_t> b_batch_strides;
  int64_t a_row = 0, a_col = 0;  // A strides along M and K
  int64_t b_row = 0, b_col = 0;  // B strides along K and N
  int64_t batch = 1;             // product of batch_shape

  // Element offsets of batch `index` (row-major over batch_shape) in A and B.
  std::pair<int64_t, int64_t> batch_offsets(int64_t index) const {
    int64_t a = 0, b = 0;
    for (size_t d = batch_shape.size(); d-- > 0;) {
      int64_t i = index % batch_shape[d];
      index /= batch_shape[d];
      a += i * a_batch_strides[d];
      b += i * b_batch_strides[d];
    }
    return {a, b};
  }
};


// a x b -> out checked (matmul's errors) and normalised.
MatmulProblem plan_matmul(const TensorView& a, const TensorView& b, const TensorView& out);

// When B is the same matrix for every batch and A's batches are rows of one matrix (the usual
// [batch, seq, K] x [K, N] of a linear layer), the batches fold into M: one bigger GEMM.
void fold_batch_into_rows(MatmulProblem& p);

// The portable GEMM (no SIMD level, any dtype; bool is a DTypeError): what matmul runs when neither
// AMX nor the SIMD GEMM took the problem. `p` is plan_matmul(a, b, out).
void matmul_portable(const KernelContext& ctx, const MatmulProblem& p, const TensorView& a, const TensorView& b,
                     const TensorView& out);

}  // namespace kiln::kernels
