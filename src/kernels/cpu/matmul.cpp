// Batched, broadcasting matmul: [..., M, K] x [..., K, N] -> [..., M, N], operands of any strides.
//
// f32, f16 and bf16 run the SIMD GEMM of gemm.h (AVX2 / AVX-512 / AVX512_BF16, chosen at run time;
// f32 accumulation, one rounding at the end). Where no SIMD level applies, and for f64, a portable
// cache-blocked GEMM (packed A and B panels, a 6 x 2-vector register tile written with GCC vector
// extensions so it vectorizes at the baseline ISA), or a GEMV when M == 1; f16/bf16 then widen to
// f32 and round once at the end. Integers accumulate in their own type with wrap-around, computed
// in unsigned arithmetic so overflow is defined. On CPUs with AMX, products with a bf16 rhs (bf16 x
// bf16, and f32 activations x bf16 weights, whose activations are then rounded to bf16) and more than
// 8 rows run on the tiles of gemm_amx.h (docs/amx.md).
#include <algorithm>
#include <array>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

#include "kernels/cpu/gemm.h"
#include "kernels/cpu/gemm_amx.h"
#include "kernels/cpu/kernels.h"
#include "kernels/cpu/matmul.h"
#include "kernels/cpu/quantized.h"
#include "kernels/cpu/strided.h"

namespace kiln::kernels {
namespace {

using graph::Op;

// ---- the problem: operands normalised to [batch..., M, K] x [batch..., K, N] ------------------------

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

// When B is the same matrix for every batch and A's batches are rows of one matrix (the usual
// [batch, seq, K] x [K, N] of a linear layer), the batches fold into M: one bigger GEMM.
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

// ---- f32 / f64: blocked GEMM and GEMV ------------------------------------------------------------

// 16-byte vectors (the x86-64 and arm64 baseline); wider ISAs come with runtime dispatch.
template <class T> struct Simd;
template <> struct Simd<float> {
  typedef float V __attribute__((vector_size(16)));
};
template <> struct Simd<double> {
  typedef double V __attribute__((vector_size(16)));
};

template <class T> struct Blocking {
  static constexpr int kLanes = 16 / sizeof(T);
  static constexpr int MR = 6;              // rows of the register tile
  static constexpr int NR = 2 * kLanes;     // columns of the register tile: two vectors
  static constexpr int64_t KC = 256;        // depth of one packed block (B micro-panel fits L1)
  static constexpr int64_t MC = 12 * MR;    // rows of one packed A block (fits L2)
  static constexpr int64_t NC = 32 * NR;    // columns of one parallel task
};

// The hot loop: C[mr x nr] (+)= A_packed[kc x MR]^T . B_packed[kc x NR]. Six rows by two vectors is
// 12 accumulators, which with two B vectors and a broadcast fits the 16 SSE/NEON registers.
template <class T>
void micro_kernel(int64_t kc, const T* __restrict a, const T* __restrict b, T* c, int64_t ldc, int mr,
                  int nr, bool accumulate) {
  using V = typename Simd<T>::V;
  constexpr int MR = Blocking<T>::MR, NR = Blocking<T>::NR, L = Blocking<T>::kLanes;
  V acc[MR][2];
  for (int i = 0; i < MR; ++i) acc[i][0] = acc[i][1] = V{};
  for (int64_t k = 0; k < kc; ++k) {
    V b0, b1;
    std::memcpy(&b0, b + k * NR, sizeof(V));
    std::memcpy(&b1, b + k * NR + L, sizeof(V));
    const T* ak = a + k * MR;
    for (int i = 0; i < MR; ++i) {
      acc[i][0] += ak[i] * b0;
      acc[i][1] += ak[i] * b1;
    }
  }
  if (mr == MR && nr == NR) {
    for (int i = 0; i < MR; ++i) {
      T* row = c + i * ldc;
      for (int h = 0; h < 2; ++h) {
        V v = acc[i][h];
        if (accumulate) {
          V old;
          std::memcpy(&old, row + h * L, sizeof(V));
          v += old;
        }
        std::memcpy(row + h * L, &v, sizeof(V));
      }
    }
    return;
  }
  T tile[MR][NR];
  std::memcpy(tile, acc, sizeof(tile));
  for (int i = 0; i < mr; ++i)
    for (int j = 0; j < nr; ++j) c[i * ldc + j] = accumulate ? c[i * ldc + j] + tile[i][j] : tile[i][j];
}

// B [K, N] (strided) -> panels [ceil(N / NR)][K][NR], zero-padded past N.
template <class T>
void pack_b_panel(const MatmulProblem& p, const T* B, int64_t panel, T* dst) {
  constexpr int NR = Blocking<T>::NR;
  const int64_t j0 = panel * NR;
  const int nr = static_cast<int>(std::min<int64_t>(NR, p.N - j0));
  for (int64_t k = 0; k < p.K; ++k) {
    const T* src = B + k * p.b_row + j0 * p.b_col;
    T* d = dst + k * NR;
    for (int j = 0; j < nr; ++j) d[j] = src[j * p.b_col];
    for (int j = nr; j < NR; ++j) d[j] = T(0);
  }
}

// A rows [m0, m0 + mc), depth [k0, k0 + kc) -> groups of MR rows [mc / MR][kc][MR], zero-padded.
template <class T>
void pack_a_block(const MatmulProblem& p, const T* A, int64_t m0, int64_t mc, int64_t k0, int64_t kc,
                  T* dst) {
  constexpr int MR = Blocking<T>::MR;
  for (int64_t g = 0; g * MR < mc; ++g) {
    const int mr = static_cast<int>(std::min<int64_t>(MR, mc - g * MR));
    T* d = dst + g * kc * MR;
    for (int64_t k = 0; k < kc; ++k) {
      const T* src = A + (m0 + g * MR) * p.a_row + (k0 + k) * p.a_col;
      for (int i = 0; i < mr; ++i) d[k * MR + i] = src[i * p.a_row];
      for (int i = mr; i < MR; ++i) d[k * MR + i] = T(0);
    }
  }
}

// One task of a GEMM: rows [m0, m0 + mc) x panels [p0, p1) of C, over all of K.
template <class T>
void gemm_task(const MatmulProblem& p, const T* A, const T* packed_b, T* C, int64_t m0, int64_t mc,
               int64_t p0, int64_t p1, std::vector<T>& packed_a) {
  using B = Blocking<T>;
  packed_a.resize(static_cast<size_t>(B::MC * B::KC));
  for (int64_t k0 = 0; k0 < p.K; k0 += B::KC) {
    const int64_t kc = std::min(B::KC, p.K - k0);
    pack_a_block(p, A, m0, mc, k0, kc, packed_a.data());
    for (int64_t panel = p0; panel < p1; ++panel) {
      const int nr = static_cast<int>(std::min<int64_t>(B::NR, p.N - panel * B::NR));
      const T* bp = packed_b + panel * p.K * B::NR + k0 * B::NR;
      for (int64_t g = 0; g * B::MR < mc; ++g) {
        const int mr = static_cast<int>(std::min<int64_t>(B::MR, mc - g * B::MR));
        micro_kernel<T>(kc, packed_a.data() + g * kc * B::MR, bp, C + (m0 + g * B::MR) * p.N + panel * B::NR,
                        p.N, mr, nr, k0 > 0);
      }
    }
  }
}

// y[n0:n1] = x . B[:, n0:n1] where B's rows are contiguous (b_col == 1): axpy of four rows at a time
// into an accumulator tile that stays in L1, streaming each row segment once.
template <class T>
void gemv_contiguous_rows(const MatmulProblem& p, const T* x, const T* B, T* y, int64_t n0, int64_t n1) {
  using V = typename Simd<T>::V;
  constexpr int L = Blocking<T>::kLanes;
  constexpr int64_t kTile = 4096 / sizeof(T);
  T acc[kTile];
  for (int64_t j0 = n0; j0 < n1; j0 += kTile) {
    const int64_t w = std::min(kTile, n1 - j0);
    const int64_t wv = w / L * L;
    std::fill(acc, acc + w, T(0));
    int64_t k = 0;
    for (; k + 4 <= p.K; k += 4) {
      const T x0 = x[k * p.a_col], x1 = x[(k + 1) * p.a_col], x2 = x[(k + 2) * p.a_col],
              x3 = x[(k + 3) * p.a_col];
      const T* r0 = B + k * p.b_row + j0;
      const T *r1 = r0 + p.b_row, *r2 = r1 + p.b_row, *r3 = r2 + p.b_row;
      for (int64_t j = 0; j < wv; j += L) {
        V a, b0, b1, b2, b3;
        std::memcpy(&a, acc + j, sizeof(V));
        std::memcpy(&b0, r0 + j, sizeof(V));
        std::memcpy(&b1, r1 + j, sizeof(V));
        std::memcpy(&b2, r2 + j, sizeof(V));
        std::memcpy(&b3, r3 + j, sizeof(V));
        a += (x0 * b0 + x1 * b1) + (x2 * b2 + x3 * b3);
        std::memcpy(acc + j, &a, sizeof(V));
      }
      for (int64_t j = wv; j < w; ++j) acc[j] += (x0 * r0[j] + x1 * r1[j]) + (x2 * r2[j] + x3 * r3[j]);
    }
    for (; k < p.K; ++k) {
      const T xk = x[k * p.a_col];
      const T* row = B + k * p.b_row + j0;
      for (int64_t j = 0; j < w; ++j) acc[j] += xk * row[j];
    }
    std::copy(acc, acc + w, y + j0);
  }
}

// y[n] = dot(x, B[:, n]) where B's columns are contiguous (b_row == 1, a transposed weight) and x
// is contiguous: four independent vector accumulators hide the add latency.
template <class T>
void gemv_contiguous_cols(const MatmulProblem& p, const T* x, const T* B, T* y, int64_t n0, int64_t n1) {
  using V = typename Simd<T>::V;
  constexpr int L = Blocking<T>::kLanes;
  for (int64_t n = n0; n < n1; ++n) {
    const T* col = B + n * p.b_col;
    V acc[4] = {};
    int64_t k = 0;
    for (; k + 4 * L <= p.K; k += 4 * L) {
      for (int u = 0; u < 4; ++u) {
        V xv, bv;
        std::memcpy(&xv, x + k + u * L, sizeof(V));
        std::memcpy(&bv, col + k + u * L, sizeof(V));
        acc[u] += xv * bv;
      }
    }
    V total = (acc[0] + acc[1]) + (acc[2] + acc[3]);
    T sum = 0;
    for (int l = 0; l < L; ++l) sum += total[l];
    for (; k < p.K; ++k) sum += x[k] * col[k];
    y[n] = sum;
  }
}

template <class T>
void gemv_strided(const MatmulProblem& p, const T* x, const T* B, T* y, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    T sum = 0;
    for (int64_t k = 0; k < p.K; ++k) sum += x[k * p.a_col] * B[k * p.b_row + n * p.b_col];
    y[n] = sum;
  }
}

// One batch of M == 1 over columns [n0, n1). `x_contig` is x copied contiguous when B's columns are.
template <class T>
void gemv(const MatmulProblem& p, const T* x, const T* B, T* y, int64_t n0, int64_t n1,
          std::vector<T>& x_contig) {
  if (p.b_col == 1 || (p.N == 1 && p.b_row != 1)) {
    gemv_contiguous_rows(p, x, B, y, n0, n1);
  } else if (p.b_row == 1) {
    if (p.a_col != 1) {
      x_contig.resize(static_cast<size_t>(p.K));
      for (int64_t k = 0; k < p.K; ++k) x_contig[k] = x[k * p.a_col];
      x = x_contig.data();
    }
    gemv_contiguous_cols(p, x, B, y, n0, n1);
  } else {
    gemv_strided(p, x, B, y, n0, n1);
  }
}

// Multiply-adds per parallel chunk: below this, threading costs more than it saves.
constexpr int64_t kFlopGrain = 64 * 1024;

template <class T>
void matmul_float(const KernelContext& ctx, MatmulProblem p, const T* A, const T* Bm, T* C) {
  using B = Blocking<T>;
  fold_batch_into_rows(p);
  const int64_t MN = p.M * p.N;
  if (MN == 0) return;
  if (p.K == 0) {
    std::fill(C, C + p.batch * MN, T(0));
    return;
  }
  const int threads = ctx.parallel ? ctx.parallel->num_threads() : 1;

  if (p.M == 1) {
    // GEMV: each (batch, column block) is independent.
    // Columns per task: enough work to pay for a chunk, and wide enough to stream B rows.
    const int64_t grain = std::max<int64_t>(256, kFlopGrain / p.K);
    const int64_t col_blocks = (p.N + grain - 1) / grain;
    parallel_for(ctx, p.batch * col_blocks, 1, [&](int64_t begin, int64_t end) {
      std::vector<T> x_contig;
      for (int64_t t = begin; t < end; ++t) {
        const int64_t bi = t / col_blocks, cb = t % col_blocks;
        auto [ao, bo] = p.batch_offsets(bi);
        gemv(p, A + ao, Bm + bo, C + bi * MN, cb * grain, std::min(p.N, (cb + 1) * grain), x_contig);
      }
    });
    return;
  }

  const int64_t panels = (p.N + B::NR - 1) / B::NR;
  const int64_t m_blocks = (p.M + B::MC - 1) / B::MC;
  const int64_t panels_per_task = B::NC / B::NR;
  const int64_t n_blocks = (panels + panels_per_task - 1) / panels_per_task;
  const int64_t tasks = m_blocks * n_blocks;
  auto run_task = [&](int64_t bi, int64_t t, const T* packed_b, std::vector<T>& packed_a) {
    auto [ao, bo] = p.batch_offsets(bi);
    (void)bo;
    const int64_t mb = t / n_blocks, nb = t % n_blocks;
    const int64_t m0 = mb * B::MC;
    gemm_task(p, A + ao, packed_b, C + bi * MN, m0, std::min(B::MC, p.M - m0), nb * panels_per_task,
              std::min(panels, (nb + 1) * panels_per_task), packed_a);
  };
  const size_t packed_b_size = static_cast<size_t>(panels * p.K * B::NR);

  if (p.batch > 1 && tasks < 2 * threads) {
    // Many small matrices (attention scores): one batch per chunk, each packing its own B.
    const int64_t flops_per_batch = p.M * p.N * p.K;
    parallel_for(ctx, p.batch, std::max<int64_t>(1, kFlopGrain / flops_per_batch),
                 [&](int64_t begin, int64_t end) {
                   std::vector<T> packed_b(packed_b_size), packed_a;
                   for (int64_t bi = begin; bi < end; ++bi) {
                     const T* Bb = Bm + p.batch_offsets(bi).second;
                     for (int64_t panel = 0; panel < panels; ++panel)
                       pack_b_panel(p, Bb, panel, packed_b.data() + panel * p.K * B::NR);
                     for (int64_t t = 0; t < tasks; ++t) run_task(bi, t, packed_b.data(), packed_a);
                   }
                 });
    return;
  }

  std::vector<T> packed_b(packed_b_size);
  int64_t packed_offset = -1;
  for (int64_t bi = 0; bi < p.batch; ++bi) {
    const int64_t bo = p.batch_offsets(bi).second;
    if (bo != packed_offset) {  // a B shared across batches is packed once
      parallel_for(ctx, panels, std::max<int64_t>(1, kElementwiseGrain / (p.K * B::NR)),
                   [&](int64_t begin, int64_t end) {
                     for (int64_t panel = begin; panel < end; ++panel)
                       pack_b_panel(p, Bm + bo, panel, packed_b.data() + panel * p.K * B::NR);
                   });
      packed_offset = bo;
    }
    const int64_t flops_per_task = std::min(B::MC, p.M) * std::min(B::NC, p.N) * p.K;
    parallel_for(ctx, tasks, std::max<int64_t>(1, kFlopGrain / flops_per_task),
                 [&](int64_t begin, int64_t end) {
                   std::vector<T> packed_a;
                   for (int64_t t = begin; t < end; ++t) run_task(bi, t, packed_b.data(), packed_a);
                 });
  }
}

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

// False when no SIMD level applies (the portable path then runs).
bool matmul_simd(const KernelContext& ctx, MatmulProblem p, DType dtype, DType b_dtype, const void* A, const void* Bm,
                 void* C, const gemm::PackedB* packed_b = nullptr) {
  if (gemm::active_isa() == gemm::Isa::generic) return false;
  fold_batch_into_rows(p);
  auto problem = [&](int64_t bi) { return gemm_problem(p, dtype, b_dtype, A, Bm, C, bi); };
  if (p.batch == 1) {
    gemm::Problem one = problem(0);
    if (packed_b && packed_b->isa == gemm::active_isa() && packed_b->K == p.K && packed_b->N == p.N)
      one.packed_b = packed_b->panels.get();
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
                     const TensorView& out) {
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
  const auto* prepared = dynamic_cast<const amx::PreparedMatmul*>(ctx.prepared);
  if (prepared && prepared->source == b.data && prepared->b_row == p.b_row && prepared->b_col == p.b_col &&
      prepared->packed.K() == p.K && prepared->packed.N() == p.N) {
    run(prepared->packed);
    return true;
  }
  if (!f32_lhs && p.M < amx::kMinRowsUnprepared) return false;
  run(amx::PackedB::pack(ctx, B, p.b_row, p.b_col, p.K, p.N));
  return true;
}

// ---- f16 / bf16: widen to f32 ----------------------------------------------------------------------

// A strided 16-bit float view widened into a contiguous f32 array.
template <class H>
std::vector<float> widen(const KernelContext& ctx, const TensorView& v) {
  std::vector<float> out(static_cast<size_t>(v.numel()));
  const H* in = v.as<H>();
  const std::array<const int64_t*, 1> strides{v.strides.data()};
  parallel_for(ctx, v.numel(), kElementwiseGrain, [&](int64_t begin, int64_t end) {
    for_each_run<1>(v.shape, strides, begin, end,
                    [&](int64_t first, const std::array<int64_t, 1>& off, int64_t count) {
                      const int64_t step = v.strides.empty() ? 1 : v.strides.back();
                      for (int64_t j = 0; j < count; ++j)
                        out[first + j] = static_cast<float>(in[off[0] + j * step]);
                    });
  });
  return out;
}

TensorView contiguous_f32_view(std::vector<float>& data, const TensorView& like) {
  TensorView v{data.data(), DType::f32, like.shape, std::vector<int64_t>(like.shape.size())};
  int64_t s = 1;
  for (size_t i = like.shape.size(); i-- > 0;) {
    v.strides[i] = s;
    s *= like.shape[i];
  }
  return v;
}

template <class H>
void matmul_half(const KernelContext& ctx, const TensorView& a, const TensorView& b, const TensorView& out) {
  std::vector<float> a32 = widen<H>(ctx, a), b32 = widen<H>(ctx, b);
  std::vector<float> out32(static_cast<size_t>(out.numel()));
  TensorView av = contiguous_f32_view(a32, a), bv = contiguous_f32_view(b32, b),
             ov = contiguous_f32_view(out32, out);
  matmul_float<float>(ctx, plan_matmul(av, bv, ov), a32.data(), b32.data(), out32.data());
  H* o = out.as<H>();
  parallel_for(ctx, out.numel(), kElementwiseGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) o[i] = H(out32[i]);
  });
}

// ---- integers: wrap-around ---------------------------------------------------------------------------

template <class T>
void matmul_integer(const KernelContext& ctx, const MatmulProblem& p, const T* A, const T* Bm, T* C) {
  // Unsigned arithmetic at least as wide as int: wraps like T, without signed-overflow UB or the
  // promotion of narrow unsigned types to (signed) int.
  using U = std::conditional_t<(sizeof(T) > 4), uint64_t, uint32_t>;
  constexpr int64_t kColumns = 256;  // columns per task, so a single row (GEMV) still splits
  const int64_t MN = p.M * p.N;
  const int64_t col_blocks = (p.N + kColumns - 1) / kColumns;
  const int64_t grain = std::max<int64_t>(1, kFlopGrain / std::max<int64_t>(1, kColumns * p.K));
  parallel_for(ctx, p.batch * p.M * col_blocks, grain, [&](int64_t begin, int64_t end) {
    U acc[kColumns];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / col_blocks, n0 = task % col_blocks * kColumns;
      const int64_t width = std::min(kColumns, p.N - n0);
      const int64_t bi = r / p.M, m = r % p.M;
      auto [ao, bo] = p.batch_offsets(bi);
      std::fill(acc, acc + width, U(0));
      for (int64_t k = 0; k < p.K; ++k) {
        const U x = static_cast<U>(A[ao + m * p.a_row + k * p.a_col]);
        const T* brow = Bm + bo + k * p.b_row + n0 * p.b_col;
        for (int64_t n = 0; n < width; ++n) acc[n] += x * static_cast<U>(brow[n * p.b_col]);
      }
      T* crow = C + bi * MN + m * p.N + n0;
      for (int64_t n = 0; n < width; ++n) crow[n] = static_cast<T>(acc[n]);  // modular (C++20)
    }
  });
}

// transpose_b: the rhs is read with its last two dims swapped, a strided view of the stored
// [..., N, K] weight (what the compiler folds `matmul(x, transpose(w))` into), so no copy is made.
TensorView rhs_view(const graph::Attrs& attrs, const TensorView& b) {
  auto it = attrs.find("transpose_b");
  if (it == attrs.end() || std::get<int64_t>(it->second) == 0) return b;
  if (b.shape.size() < 2) throw ShapeError("matmul: transpose_b needs a rhs of rank >= 2, got " + describe(b));
  TensorView t = b;
  std::swap(t.shape[t.shape.size() - 1], t.shape[t.shape.size() - 2]);
  std::swap(t.strides[t.strides.size() - 1], t.strides[t.strides.size() - 2]);
  return t;
}

// A fixed f32 rhs (a weight) packed once into the SIMD GEMM's panels, with the view it was packed
// from: a launch uses it only when its rhs is that same view.
struct PackedRhs final : Prepared {
  TensorView rhs;  // after transpose_b, as the launch sees it
  gemm::PackedB packed;
};

const gemm::PackedB* packed_rhs_for(const KernelContext& ctx, const TensorView& b) {
  const auto* prepared = dynamic_cast<const PackedRhs*>(ctx.prepared);
  if (!prepared || prepared->rhs.data != b.data || prepared->rhs.dtype != b.dtype ||
      prepared->rhs.shape != b.shape || prepared->rhs.strides != b.strides)
    return nullptr;
  return &prepared->packed;
}

// f32 activations times a fixed rank-2 rhs that is f32 (f16/bf16 weights stay narrow: packing them as
// f32 would cost twice their memory again). The packed copy costs the weight's size once more.
std::shared_ptr<const Prepared> prepare_matmul_f32(const graph::Attrs& attrs, std::span<const TensorView> inputs,
                                                   std::span<const bool> fixed) {
  if (inputs.size() != 2 || !fixed[1] || inputs[0].dtype != DType::f32 || inputs[1].dtype != DType::f32 ||
      inputs[1].shape.size() != 2)
    return nullptr;
  const TensorView b = rhs_view(attrs, inputs[1]);
  const int64_t K = b.shape[0], N = b.shape[1];
  // Only a GEMM with more than kSmallM rows reads the panels: skip lhs shapes that never have that.
  const TensorView& a = inputs[0];
  if (!a.shape.empty()) {
    int64_t rows = 1;
    for (size_t d = 0; d + 1 < a.shape.size(); ++d) rows *= a.shape[d];
    if (rows <= gemm::kSmallM) return nullptr;
  }
  const gemm::Problem problem{DType::f32, nullptr, 0, 0, b.data, b.strides[0], b.strides[1], nullptr, 0, 0, N, K};
  std::optional<gemm::PackedB> packed = gemm::pack_b(problem);
  if (!packed) return nullptr;
  auto out = std::make_shared<PackedRhs>();
  out->rhs = b;
  out->packed = std::move(*packed);
  return out;
}

// The PrepareFn of (matmul, CPU, f32), keyed by the lhs dtype: an f32 weight goes into the SIMD GEMM's
// panels, a bf16 weight into AMX tiles (where the CPU has them; f16 weights are not prepared).
std::shared_ptr<const Prepared> prepare_matmul_f32_lhs(const graph::Attrs& attrs, std::span<const TensorView> inputs,
                                                       std::span<const bool> fixed) {
  if (inputs.size() == 2 && inputs[1].dtype == DType::bf16) return amx::prepare_matmul(attrs, inputs, fixed);
  return prepare_matmul_f32(attrs, inputs, fixed);
}

void matmul_kernel(const KernelContext& ctx, const graph::Attrs& attrs, std::span<const TensorView> inputs,
                   std::span<const TensorView> outputs) {
  if (inputs.size() != 2 || outputs.size() != 1)
    throw ValueError("matmul: expected 2 operands and 1 result, got " + std::to_string(inputs.size()) +
                     " and " + std::to_string(outputs.size()));
  const TensorView b = rhs_view(attrs, inputs[1]);
  const TensorView &a = inputs[0], &out = outputs[0];
  const MatmulProblem p = plan_matmul(a, b, out);
  if (matmul_bf16_amx(ctx, p, a, b, out)) return;
  if ((a.dtype == DType::f32 || a.dtype == DType::f16 || a.dtype == DType::bf16) &&
      matmul_simd(ctx, p, a.dtype, b.dtype, a.data, b.data, out.data, packed_rhs_for(ctx, b)))
    return;
  if (a.dtype != b.dtype) {  // f32 x f16/bf16 without SIMD: widen the weights, then the f32 GEMM
    std::vector<float> b32 = b.dtype == DType::f16 ? widen<f16_t>(ctx, b) : widen<bf16_t>(ctx, b);
    const TensorView bv = contiguous_f32_view(b32, b);
    matmul_float<float>(ctx, plan_matmul(a, bv, out), a.as<float>(), b32.data(), out.as<float>());
    return;
  }
  visit_dtype(a.dtype, [&]<class T>() {
    if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) {
      matmul_float<T>(ctx, p, a.as<T>(), b.as<T>(), out.as<T>());
    } else if constexpr (std::is_same_v<T, f16_t> || std::is_same_v<T, bf16_t>) {
      matmul_half<T>(ctx, a, b, out);
    } else if constexpr (std::is_same_v<T, bool>) {
      throw DTypeError("matmul: bool operands are not supported (lhs " + describe(a) + ")");
    } else {
      matmul_integer<T>(ctx, p, a.as<T>(), b.as<T>(), out.as<T>());
    }
  });
}

}  // namespace

std::optional<gemm::Problem> matmul_gemv_problem(const graph::Attrs& attrs, const TensorView& a, const TensorView& rhs,
                                                 const TensorView& out) {
  const TensorView b = rhs_view(attrs, rhs);
  MatmulProblem p = plan_matmul(a, b, out);
  if (gemm::active_isa() == gemm::Isa::generic || (a.dtype != DType::f32 && a.dtype != DType::f16 && a.dtype != DType::bf16))
    return std::nullopt;
  fold_batch_into_rows(p);
  if (p.batch != 1 || p.M > gemm::kSmallM) return std::nullopt;
  return gemm_problem(p, a.dtype, b.dtype, a.data, b.data, out.data, 0);
}

void register_cpu_matmul(KernelRegistry& r) {
  r.add(Op::matmul, DeviceKind::CPU,
        {DType::f32, DType::f64, DType::f16, DType::bf16, DType::i8, DType::i16, DType::i32, DType::i64,
         DType::u8, DType::u16, DType::u32, DType::u64},
        matmul_kernel);
  // f32 weights packed for the GEMM, bf16 weights under f32 activations for AMX
  r.add_prepare(Op::matmul, DeviceKind::CPU, {DType::f32}, prepare_matmul_f32_lhs);
  r.add_prepare(Op::matmul, DeviceKind::CPU, {DType::bf16}, amx::prepare_matmul);  // weights packed for AMX
}

}  // namespace kiln::kernels
