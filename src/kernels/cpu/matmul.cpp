// matmul: batched, broadcasting [..., M, K] x [..., K, N] -> [..., M, N], operands of any strides. This
// file checks and normalises the operands, packs a fixed weight once at build, and dispatches.
//
// f32, f16 and bf16 run the SIMD GEMM of gemm.h (AVX2 / AVX-512 / AVX512_BF16, chosen at run time;
// f32 accumulation, one rounding at the end). Where no SIMD level applies, and for f64 and integers,
// the portable GEMM of matmul_portable.cpp. On CPUs with AMX, products with a bf16 rhs (bf16 x bf16,
// and f32 activations x bf16 weights, whose activations are then rounded to bf16) and more than 8
// rows run on the tiles of gemm_amx.h (docs/amx.md).
#include "kernels/cpu/matmul.h"

#include <algorithm>
#include <optional>
#include <string>
#include <vector>

#include "kernels/cpu/gemm.h"
#include "kernels/cpu/gemm_amx.h"
#include "kernels/cpu/kernels.h"

namespace kiln::kernels {

using graph::Op;

MatmulProblem plan_matmul(const TensorView& a, const TensorView& b, const TensorView& out) {
  auto operands = [&] { return " (lhs " + describe(a) + ", rhs " + describe(b) + ")"; };
  const bool narrow_weights = a.dtype == DType::f32 && (b.dtype == DType::f16 || b.dtype == DType::bf16);
  if ((a.dtype != b.dtype && !narrow_weights) || out.dtype != a.dtype)
    throw DTypeError("matmul: lhs, rhs and result must share one dtype (or be f32 with rhs f16/bf16)" + operands() +
                     ", result " + describe(out));
  if (a.shape.empty() || b.shape.empty())
    throw ShapeError("matmul: operands must have rank 1 or more" + operands());
  const size_t ar = a.shape.size(), br = b.shape.size();
  MatmulProblem p;
  // numpy: a rank-1 lhs is a row [1, K], a rank-1 rhs a column [K, 1]; both extra dims are dropped.
  if (ar == 1) {
    p.M = 1;
    p.K = a.shape[0];
    p.a_col = a.strides[0];
  } else {
    p.M = a.shape[ar - 2];
    p.K = a.shape[ar - 1];
    p.a_row = a.strides[ar - 2];
    p.a_col = a.strides[ar - 1];
  }
  const int64_t rhs_k = br == 1 ? b.shape[0] : b.shape[br - 2];
  if (rhs_k != p.K)
    throw ShapeError("matmul: lhs inner dim " + std::to_string(p.K) + " does not match rhs dim " +
                     std::to_string(br == 1 ? 0 : br - 2) + " of " + std::to_string(rhs_k) + operands());
  if (br == 1) {
    p.N = 1;
    p.b_row = b.strides[0];
  } else {
    p.N = b.shape[br - 1];
    p.b_row = b.strides[br - 2];
    p.b_col = b.strides[br - 1];
  }
  const size_t a_batch = ar > 2 ? ar - 2 : 0, b_batch = br > 2 ? br - 2 : 0;
  const size_t nb = std::max(a_batch, b_batch);
  p.batch_shape.assign(nb, 1);
  p.a_batch_strides.assign(nb, 0);
  p.b_batch_strides.assign(nb, 0);
  for (size_t i = 0; i < nb; ++i) {
    // Right-aligned: batch dim i of the result is dim (i - (nb - a_batch)) of lhs when that exists.
    const int64_t ad = i + a_batch >= nb ? a.shape[i + a_batch - nb] : 1;
    const int64_t bd = i + b_batch >= nb ? b.shape[i + b_batch - nb] : 1;
    if (ad != bd && ad != 1 && bd != 1)
      throw ShapeError("matmul: batch dims " + std::to_string(ad) + " and " + std::to_string(bd) +
                       " do not broadcast" + operands());
    p.batch_shape[i] = std::max(ad, bd);
    if (ad != 1) p.a_batch_strides[i] = a.strides[i + a_batch - nb];
    if (bd != 1) p.b_batch_strides[i] = b.strides[i + b_batch - nb];
    p.batch *= p.batch_shape[i];
  }
  std::vector<int64_t> expected = p.batch_shape;
  if (ar > 1) expected.push_back(p.M);
  if (br > 1) expected.push_back(p.N);
  if (out.shape != expected) {
    TensorView want = out;
    want.shape = expected;
    throw ShapeError("matmul: result " + describe(out) + " should be " + describe(want) + operands());
  }
  if (!out.is_contiguous()) throw ValueError("matmul: the result view must be contiguous");
  return p;
}

void fold_batch_into_rows(MatmulProblem& p) {
  if (p.batch == 1) return;
  for (size_t d = 0; d < p.batch_shape.size(); ++d)
    if (p.batch_shape[d] != 1 && p.b_batch_strides[d] != 0) return;
  int64_t row = p.a_row;
  if (p.M == 1) {
    // A size-1 M dim has no meaningful stride: the innermost real batch dim sets the row step.
    for (size_t d = p.batch_shape.size(); d-- > 0;)
      if (p.batch_shape[d] != 1) {
        row = p.a_batch_strides[d];
        break;
      }
  }
  int64_t expected = row * p.M;
  for (size_t d = p.batch_shape.size(); d-- > 0;) {
    if (p.batch_shape[d] == 1) continue;
    if (p.a_batch_strides[d] != expected) return;
    expected *= p.batch_shape[d];
  }
  p.M *= p.batch;
  p.a_row = row;
  p.batch = 1;
  p.batch_shape.clear();
  p.a_batch_strides.clear();
  p.b_batch_strides.clear();
}

namespace {

// ---- f32 / f16 / bf16 on the SIMD GEMM -------------------------------------------------------------

// Batch `bi` of p as a problem of the SIMD GEMM. `b_dtype` differs from `dtype` only for f32
// activations with f16/bf16 weights.
gemm::Problem gemm_problem(const MatmulProblem& p, DType dtype, DType b_dtype, const void* A, const void* Bm, void* C,
                           int64_t bi) {
  const int64_t size = static_cast<int64_t>(dtype_size(dtype)), b_size = static_cast<int64_t>(dtype_size(b_dtype));
  const gemm::BStorage b_storage = b_dtype == dtype         ? gemm::BStorage::same
                                   : b_dtype == DType::f16 ? gemm::BStorage::f16
                                                           : gemm::BStorage::bf16;
  auto [ao, bo] = p.batch_offsets(bi);
  return gemm::Problem{dtype, static_cast<const char*>(A) + ao * size, p.a_row, p.a_col,
                       static_cast<const char*>(Bm) + bo * b_size, p.b_row, p.b_col,
                       static_cast<char*>(C) + bi * p.M * p.N * size, p.N, p.M, p.N, p.K, b_storage};
}

// Points `one` at the weight packed at init when it was packed for this problem on the active level.
void use_packed(gemm::Problem& one, const gemm::PackedB* packed_b) {
  if (!packed_b || packed_b->isa != gemm::active_isa() || packed_b->K != one.K || packed_b->N != one.N) return;
  one.packed_b = packed_b->panels.get();
  one.packed_b_narrow = packed_b->narrow.get();
}

// False when no SIMD level applies (the portable path then runs).
bool matmul_simd(const KernelContext& ctx, MatmulProblem p, DType dtype, DType b_dtype, const void* A, const void* Bm,
                 void* C, const gemm::PackedB* packed_b = nullptr) {
  if (gemm::active_isa() == gemm::Isa::generic) return false;
  fold_batch_into_rows(p);
  auto problem = [&](int64_t bi) { return gemm_problem(p, dtype, b_dtype, A, Bm, C, bi); };
  if (p.batch == 1) {
    gemm::Problem one = problem(0);
    use_packed(one, packed_b);
    return gemm::run(ctx, one);
  }
  // Large matrices: each is split between the threads; small ones (attention's per-head products)
  // go one per thread.
  const int threads = ctx.parallel ? ctx.parallel->num_threads() : 1;
  if (p.batch < threads || p.M * p.N * p.K >= (int64_t{1} << 22)) {
    for (int64_t bi = 0; bi < p.batch; ++bi)
      if (!gemm::run(ctx, problem(bi))) return false;
    return true;
  }
  return gemm::run_batched(ctx, p.batch, problem);
}

// ---- bf16 on AMX tiles (gemm_amx.h) ----------------------------------------------------------------

// A bf16 rhs (bf16 x bf16 -> bf16, or f32 activations x bf16 weights -> f32) with more than
// amx::kMinRows rows (after folding batches) and one rhs matrix, where the CPU has AMX: on the weight
// packed at init, or packed here. False when it did not apply (the SIMD GEMM then runs). A test that
// forces a lower ISA level gets that level.
//
// f32 x bf16 rounds the activations to bf16 (the tiles multiply bf16 only), so it never falls back
// to the exact SIMD path above kMinRows, prepared or not: the result must not depend on whether the
// step was prepared. bf16 x bf16 is exact either way and packs per call only from kMinRowsUnprepared.
bool matmul_bf16_amx(const KernelContext& ctx, MatmulProblem p, const TensorView& a, const TensorView& b,
                     const TensorView& out, const amx::PackedRhs* prepared) {
  const bool f32_lhs = a.dtype == DType::f32;
  if ((a.dtype != DType::bf16 && !f32_lhs) || b.dtype != DType::bf16 || !amx::available() ||
      gemm::active_isa() != gemm::best_isa())
    return false;
  fold_batch_into_rows(p);
  if (p.batch != 1 || p.M <= amx::kMinRows || p.N == 0 || p.K == 0) return false;
  const auto* B = b.as<uint16_t>();
  auto run = [&](const amx::PackedB& packed) {
    if (f32_lhs)
      amx::gemm(ctx, a.as<float>(), p.a_row, p.a_col, p.M, packed, out.as<float>(), p.N);
    else
      amx::gemm(ctx, a.as<uint16_t>(), p.a_row, p.a_col, p.M, packed, out.as<uint16_t>(), p.N);
  };
  if (prepared && prepared->source == b.data && prepared->b_row == p.b_row && prepared->b_col == p.b_col &&
      prepared->packed.K() == p.K && prepared->packed.N() == p.N) {
    run(prepared->packed);
    return true;
  }
  if (!f32_lhs && p.M < amx::kMinRowsUnprepared) return false;
  run(amx::PackedB::pack(ctx, B, p.b_row, p.b_col, p.K, p.N));
  return true;
}


// ---- the kernel ------------------------------------------------------------------------------------

// transpose_b: the rhs is read with its last two dims swapped, a strided view of the stored
// [..., N, K] weight (what the compiler folds `matmul(x, transpose(w))` into), so no copy is made.
TensorView rhs_view(bool transpose_b, const TensorView& b) {
  if (!transpose_b) return b;
  if (b.shape.size() < 2) throw ShapeError("matmul: transpose_b needs a rhs of rank >= 2, got " + describe(b));
  TensorView t = b;
  std::swap(t.shape[t.shape.size() - 1], t.shape[t.shape.size() - 2]);
  std::swap(t.strides[t.strides.size() - 1], t.strides[t.strides.size() - 2]);
  return t;
}

// A fixed rhs (a weight) packed once into the SIMD GEMM's panels, with the view it was packed from:
// a launch uses it only when its rhs is that same view.
struct PackedSimdRhs {
  TensorView rhs;  // after transpose_b, as the launch sees it
  gemm::PackedB packed;
};

// f32 activations times a fixed rank-2 rhs in f32, f16 or bf16. f16 / bf16 panels keep the 16-bit
// elements (widening them to f32 would cost twice their memory again). Without the panels the GEMM
// packs the weight on every call, which for a decode batch of 9-64 rows costs more than the products
// (docs/batching.md). Every launch then reads the panels, decode's single row too, so the weight's
// own bytes are reported to `init` as copied (slice by slice, as packed): a mapped file's pages of
// them are dropped, and the weight is held once.
std::optional<PackedSimdRhs> pack_simd_rhs(const KernelInit& init, const TensorView& a, const TensorView& w,
                                           bool transpose_b) {
  if (a.dtype != DType::f32 || w.shape.size() != 2 ||
      (w.dtype != DType::f32 && w.dtype != DType::f16 && w.dtype != DType::bf16))
    return std::nullopt;
  const TensorView b = rhs_view(transpose_b, w);
  const int64_t K = b.shape[0], N = b.shape[1];
  // An lhs that never has more than kSmallM rows streams the weight in place (the GEMV): panels would
  // only add a copy.
  if (!a.shape.empty()) {
    int64_t rows = 1;
    for (size_t d = 0; d + 1 < a.shape.size(); ++d) rows *= a.shape[d];
    if (rows <= gemm::kSmallM) return std::nullopt;
  }
  const gemm::BStorage storage = w.dtype == DType::f32   ? gemm::BStorage::same
                                 : w.dtype == DType::f16 ? gemm::BStorage::f16
                                                         : gemm::BStorage::bf16;
  const gemm::Problem problem{DType::f32, nullptr, 0, 0, b.data, b.strides[0], b.strides[1], nullptr, 0, 0, N, K, storage};
  // Columns of B are rows of w under transpose_b: each packed slice is then a contiguous range of w.
  // Otherwise w is reported whole once packed.
  const int64_t element = static_cast<int64_t>(dtype_size(w.dtype));
  const bool rows_of_w = b.strides[0] == 1 && w.is_contiguous();
  const PackedCopies copies = init.copies_of(1);
  std::optional<gemm::PackedB> packed = gemm::pack_b(
      problem,
      [&](int64_t n0, int64_t n1) {
        if (rows_of_w)
          init.report_copied(1, static_cast<const char*>(b.data) + n0 * K * element,
                             static_cast<size_t>((n1 - n0) * K * element));
      },
      init.parallel, &copies);
  if (packed && !rows_of_w && w.is_contiguous())
    init.report_copied(1, w.data, static_cast<size_t>(N * K * element));
  if (!packed) return std::nullopt;
  return PackedSimdRhs{b, std::move(*packed)};
}

class MatmulKernel final : public Kernel {
 public:
  // A fixed rhs is packed for the path a launch will take with it: a bf16 weight into AMX tiles where
  // the CPU has them, any other f32 / f16 / bf16 weight into the SIMD GEMM's panels.
  explicit MatmulKernel(const KernelInit& init) : transpose_b_(matmul_transpose_b(init)) {
    if (init.inputs.size() != 2 || !init.is_fixed(1)) return;  // the launch reports bad operands
    const TensorView &a = init.inputs[0], &w = init.inputs[1];
    if (w.dtype == DType::bf16) amx_ = amx::pack_matmul_rhs(a, w, transpose_b_);
    if (!amx_) simd_ = pack_simd_rhs(init, a, w, transpose_b_);
  }

  void run(const KernelContext& ctx, std::span<const TensorView> inputs,
           std::span<const TensorView> outputs) const override {
    if (inputs.size() != 2 || outputs.size() != 1)
      throw ValueError("matmul: expected 2 operands and 1 result, got " + std::to_string(inputs.size()) +
                       " and " + std::to_string(outputs.size()));
    const TensorView b = rhs_view(transpose_b_, inputs[1]);
    const TensorView &a = inputs[0], &out = outputs[0];
    const MatmulProblem p = plan_matmul(a, b, out);
    if (matmul_bf16_amx(ctx, p, a, b, out, amx_ ? &*amx_ : nullptr)) return;
    if ((a.dtype == DType::f32 || a.dtype == DType::f16 || a.dtype == DType::bf16) &&
        matmul_simd(ctx, p, a.dtype, b.dtype, a.data, b.data, out.data, simd_panels_for(b)))
      return;
    matmul_portable(ctx, p, a, b, out);
  }

  MatmulPacking packing() const {
    if (simd_) return simd_->packed.narrow ? MatmulPacking::narrow_panels : MatmulPacking::f32_panels;
    return amx_ ? MatmulPacking::amx_tiles : MatmulPacking::none;
  }

  bool transpose_b() const { return transpose_b_; }

  // The weight packed at init, when `b` (the rhs as a launch sees it) is the view it was packed from.
  const gemm::PackedB* simd_panels_for(const TensorView& b) const {
    if (!simd_ || simd_->rhs.data != b.data || simd_->rhs.dtype != b.dtype || simd_->rhs.shape != b.shape ||
        simd_->rhs.strides != b.strides)
      return nullptr;
    return &simd_->packed;
  }

 private:
  bool transpose_b_;
  std::optional<PackedSimdRhs> simd_;
  std::optional<amx::PackedRhs> amx_;
};

}  // namespace

bool matmul_transpose_b(const KernelInit& init) {
  return init.has_attr("transpose_b") && init.attr<int64_t>("transpose_b") != 0;
}

std::unique_ptr<const Kernel> make_matmul_kernel(const KernelInit& init) {
  return std::make_unique<MatmulKernel>(init);
}

MatmulPacking matmul_packing(const Kernel& matmul) {
  const auto* kernel = dynamic_cast<const MatmulKernel*>(&matmul);
  return kernel ? kernel->packing() : MatmulPacking::none;
}

std::optional<gemm::Problem> matmul_gemv_problem(const Kernel& matmul, const TensorView& a, const TensorView& rhs,
                                                 const TensorView& out) {
  const auto* kernel = dynamic_cast<const MatmulKernel*>(&matmul);
  if (!kernel) return std::nullopt;
  const TensorView b = rhs_view(kernel->transpose_b(), rhs);
  MatmulProblem p = plan_matmul(a, b, out);
  if (gemm::active_isa() == gemm::Isa::generic || (a.dtype != DType::f32 && a.dtype != DType::f16 && a.dtype != DType::bf16))
    return std::nullopt;
  fold_batch_into_rows(p);
  if (p.batch != 1) return std::nullopt;
  // Above kMinRows a bf16 weight runs on AMX tiles where there are any (matmul_bf16_amx), not here.
  if (p.M > amx::kMinRows && b.dtype == DType::bf16 && amx::available() && gemm::active_isa() == gemm::best_isa())
    return std::nullopt;
  gemm::Problem problem = gemm_problem(p, a.dtype, b.dtype, a.data, b.data, out.data, 0);
  use_packed(problem, kernel->simd_panels_for(b));  // small M then runs the GEMM's loops on the panels
  if (!gemm::small_m_applies(problem)) return std::nullopt;
  return problem;
}

void register_cpu_matmul(KernelRegistry& r) {
  r.add(Op::matmul, DeviceKind::CPU,
        {DType::f32, DType::f64, DType::f16, DType::bf16, DType::i8, DType::i16, DType::i32, DType::i64,
         DType::u8, DType::u16, DType::u32, DType::u64},
        make_matmul_kernel);
}

}  // namespace kiln::kernels
