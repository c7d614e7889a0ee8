// The portable matmul GEMM: no SIMD level, any dtype. f32 and f64 run a cache-blocked GEMM (packed
// A and B panels, a 6 x 2-vector register tile written with GCC vector extensions so it vectorizes
// at the baseline ISA), or GEMVs when M <= gemm::kSmallM (kNarrowSmallMMax for f16/bf16 weights; each
// row the M == 1 GEMV, so a row's result does not depend on the batch it is in); f16/bf16 widen to f32 and round once at the end.
// Integers accumulate in their own type with wrap-around, computed in unsigned arithmetic so
// overflow is defined. matmul.cpp runs it where the SIMD GEMM of gemm.h does not apply.
#include <algorithm>
#include <array>
#include <cstring>
#include <type_traits>
#include <vector>

#include "kernels/cpu/gemm.h"
#include "kernels/cpu/matmul.h"
#include "kernels/cpu/strided.h"

namespace kiln::kernels {
namespace {

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

// GEMVs up to `gemv_rows` rows (gemm.h: kSmallM; kNarrowSmallMMax for weights widened from f16 /
// bf16, as the SIMD levels stream those).
template <class T>
void matmul_float(const KernelContext& ctx, MatmulProblem p, const T* A, const T* Bm, T* C,
                  int64_t gemv_rows = gemm::kSmallM) {
  using B = Blocking<T>;
  fold_batch_into_rows(p);
  const int64_t MN = p.M * p.N;
  if (MN == 0) return;
  if (p.K == 0) {
    std::fill(C, C + p.batch * MN, T(0));
    return;
  }
  const int threads = ctx.parallel ? ctx.parallel->num_threads() : 1;

  if (p.M <= gemv_rows) {
    // GEMVs, a row at a time (batch invariance: the blocked GEMM sums in another order), all rows of
    // one column block in turn while it is in cache. Each (batch, column block) is independent.
    // Columns per task: enough work to pay for a chunk, and wide enough to stream B rows.
    const int64_t grain = std::max<int64_t>(256, kFlopGrain / (p.K * p.M));
    const int64_t col_blocks = (p.N + grain - 1) / grain;
    parallel_for(ctx, p.batch * col_blocks, 1, [&](int64_t begin, int64_t end) {
      std::vector<T> x_contig;
      for (int64_t t = begin; t < end; ++t) {
        const int64_t bi = t / col_blocks, cb = t % col_blocks;
        auto [ao, bo] = p.batch_offsets(bi);
        for (int64_t m = 0; m < p.M; ++m)
          gemv(p, A + ao + m * p.a_row, Bm + bo, C + bi * MN + m * p.N, cb * grain, std::min(p.N, (cb + 1) * grain),
               x_contig);
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

}  // namespace

void matmul_portable(const KernelContext& ctx, const MatmulProblem& p, const TensorView& a, const TensorView& b,
                     const TensorView& out) {
  if (a.dtype != b.dtype) {  // f32 x f16/bf16 without SIMD: widen the weights, then the f32 GEMM
    std::vector<float> b32 = b.dtype == DType::f16 ? widen<f16_t>(ctx, b) : widen<bf16_t>(ctx, b);
    const TensorView bv = contiguous_f32_view(b32, b);
    matmul_float<float>(ctx, plan_matmul(a, bv, out), a.as<float>(), b32.data(), out.as<float>(),
                        gemm::kNarrowSmallMMax);
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

}  // namespace kiln::kernels
