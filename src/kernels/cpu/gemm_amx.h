// Private: a bf16 GEMM on Intel AMX tiles (AMX-BF16, tdpbf16ps) for prefill-sized products, with
// the weight repacked once into the tiles' VNNI-pair layout. Used by the matmul kernel for bf16 x
// bf16 -> bf16 and for f32 x bf16 -> f32 (bf16 weights, f32 activations rounded to bf16) when
// available() (the CPU has AMX-BF16 and the OS grants this process the tile data state); everything
// else keeps the SIMD GEMM of gemm.h. docs/amx.md has the layout, numerics and figures.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>

#include "kernels/kernel.h"

namespace kiln::kernels::amx {

// The CPU has AMX-TILE + AMX-BF16 + AVX-512 BW/VL/BF16, and arch_prctl(ARCH_REQ_XCOMP_PERM) granted
// XTILEDATA to this process (asked once; Linux refuses it before 5.16). False on every other CPU or
// OS, and while disabled for testing.
bool available();
// Tests only: make available() false (true), or back to what the machine allows (false).
void disable_for_testing(bool disabled);

// Runs `iterations` rounds of tdpbf16ps on four independent accumulator tiles, with no memory
// traffic, and returns the FLOPs done: `kiln bench gemm` times it for the bf16 peak. Requires
// available().
double run_tile_chains(int64_t iterations);

// Tile geometry: a tile is 16 rows of 64 bytes; a bf16 B tile holds 32 values of K (16 VNNI
// pairs) for 16 columns of N.
inline constexpr int64_t kTileRows = 16;
inline constexpr int64_t kTileK = 32;

// B [K, N] packed for tdpbf16ps: n_tiles() column tiles, each the k_tiles() B tiles of its 16
// columns one after another; one tile is [16 pairs of K][16 columns][2] bf16 (1 KiB), that is
// element (k, n) of the tile at ((k / 2) * 16 + n) * 2 + k % 2. K is padded to 32 and N to 16
// with zeros.
class PackedB {
 public:
  int64_t K() const { return K_; }
  int64_t N() const { return N_; }
  int64_t k_tiles() const { return (K_ + kTileK - 1) / kTileK; }
  int64_t n_tiles() const { return (N_ + kTileRows - 1) / kTileRows; }
  const uint16_t* tile(int64_t n_tile, int64_t k_tile) const {
    return data_.get() + (n_tile * k_tiles() + k_tile) * kTileRows * kTileK;
  }
  size_t bytes() const { return static_cast<size_t>(n_tiles() * k_tiles()) * kTileRows * kTileK * 2; }

  // Packs B [K, N], element (k, n) at b[k * b_row + n * b_col] (bf16 bits). A Linear's weight
  // [N, K] read with transpose_b is b_row = 1, b_col = K. Threaded over ctx.parallel.
  static PackedB pack(const KernelContext& ctx, const uint16_t* b, int64_t b_row, int64_t b_col, int64_t K,
                      int64_t N);

 private:
  struct Free {
    void operator()(uint16_t* p) const;
  };
  int64_t K_ = 0, N_ = 0;
  std::unique_ptr<uint16_t[], Free> data_;
};

// C [M, N] = A [M, K] . B, A (bf16, element (m, k) at a[m * a_row + k * a_col]) and C (bf16, rows
// ldc apart) rounded once from f32 accumulators to nearest even. Threaded over ctx.parallel; the
// bits do not depend on the thread count. Requires available().
void gemm(const KernelContext& ctx, const uint16_t* a, int64_t a_row, int64_t a_col, int64_t M,
          const PackedB& b, uint16_t* c, int64_t ldc);

// C [M, N] (f32, rows ldc apart) = bf16(A) [M, K] . B for f32 activations A (element (m, k) at
// a[m * a_row + k * a_col]): each activation is rounded to bf16 (nearest even, as f32_to_bf16) as
// it is copied into the tiles, the products are summed in f32 and stored unrounded. Threaded over
// ctx.parallel; the bits do not depend on the thread count. Requires available().
void gemm(const KernelContext& ctx, const float* a, int64_t a_row, int64_t a_col, int64_t M, const PackedB& b,
          float* c, int64_t ldc);

// A fixed bf16 rhs of a matmul (a weight) packed once, at build, with the view it was packed from:
// the kernel uses it only for that same view.
struct PackedRhs {
  const void* source = nullptr;
  int64_t b_row = 0, b_col = 0;  // the rhs strides along K and N it was read with
  PackedB packed;
};

// The matmul kernel's packing of its fixed 2-D bf16 rhs `w` (read transposed when `transpose_b`) for
// a bf16 or f32 lhs when available(); nullopt when the lhs has a static shape with at most kMinRows
// rows (decode-only steps) or the operands do not fit (the launch reports them).
std::optional<PackedRhs> pack_matmul_rhs(const TensorView& lhs, const TensorView& w, bool transpose_b);

// Products with more rows than this run on AMX with a prepared (packed) weight; at most this many
// (decode) keep the GEMV of gemm.h, which streams the weight's original rows.
inline constexpr int64_t kMinRows = 8;
// Without prepared state a bf16 x bf16 product packs the weight on every call, which pays only for
// larger M. (f32 x bf16 always takes AMX above kMinRows, so that its numerics, activations rounded to
// bf16, do not depend on whether the step was prepared.)
inline constexpr int64_t kMinRowsUnprepared = 16;

}  // namespace kiln::kernels::amx
