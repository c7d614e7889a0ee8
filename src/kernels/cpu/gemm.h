// Private: the SIMD GEMM / GEMV behind the matmul kernel, for f32, f16 and bf16 operands (f32
// accumulation), with one implementation per x86 ISA level chosen at run time.
//
// Why GCC target pragmas and not Highway's foreach_target: the installed Highway (1.0.3) has no
// Zen 4 / Sapphire Rapids target and no vdpbf16ps, and the hot loops here are a handful of
// intrinsics. Each ISA level is one small translation unit (gemm_avx2.cpp, gemm_avx512.cpp,
// gemm_avx512_bf16.cpp) that compiles the shared templates of gemm_x86-inl.h under
// `#pragma GCC target`, after all standard headers, so no inline library code is ever compiled
// for a wider ISA than the baseline (that would break the one-definition rule at link time).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>

#include "kernels/cpu/kernels.h"
#include "kiln/errors.h"

namespace kiln::kernels::gemm {

// Ordered from the portable baseline up; a level is usable when the CPU has all its features.
enum class Isa : int {
  generic,      // no SIMD kernels here: matmul.cpp's portable path runs
  avx2,         // AVX2 + FMA + F16C: 6x16 f32 tile; f16/bf16 widened in registers
  avx512,       // AVX-512 F/BW/DQ/VL: 6x64 f32 tile; f16/bf16 widened in registers
  avx512_bf16,  // avx512 + AVX512_BF16: bf16 x bf16 products with vdpbf16ps
};
const char* isa_name(Isa isa);
bool isa_supported(Isa isa);  // compiled in, and the CPU has the features
Isa best_isa();               // the fastest supported level (avx512_bf16 only on AMD: see gemm.cpp)
// The level matmul uses: best_isa() unless a test forced another.
Isa active_isa();
// Tests only: run matmul on `isa` (which must be supported), or back on best_isa() with nullopt.
void force_isa_for_testing(std::optional<Isa> isa);

// How B is stored when it is not in the problem's dtype (which is then f32): a weight kept narrow
// and converted in registers (f16, bf16), or Q8_0 blocks (quantization.h): B is then the weight
// [N, K] as N rows of K / 32 blocks, `b_col` bytes apart (b_row unused), K a multiple of 32.
enum class BStorage : uint8_t { same, f16, bf16, q8_0 };

// One 2-D product C[M, N] = A[M, K] . B[K, N]; A and B at any element strides, C contiguous rows
// (leading dimension ldc). A, B and C share `dtype` (f32, f16 or bf16), unless b_storage says
// otherwise.
struct Problem {
  DType dtype = DType::f32;
  const void* a = nullptr;
  int64_t a_row = 0, a_col = 0;
  const void* b = nullptr;
  int64_t b_row = 0, b_col = 0;
  void* c = nullptr;
  int64_t ldc = 0;
  int64_t M = 0, N = 0, K = 0;
  BStorage b_storage = BStorage::same;
  // B already in the GEMM's panel layout (PackedB::panels, packed by the active level), or nullptr:
  // the GEMM then skips packing, and small M runs the GEMM's loops on the panels too (`b` is not
  // read). The GEMM's results are the same either way.
  const float* packed_b = nullptr;
  // Or B (f16 / bf16 storage, `b_storage`) packed ahead in that layout but as stored, 16 bits an
  // element (PackedB::narrow): the GEMM widens it in registers. Same results as packing here.
  const uint16_t* packed_b_narrow = nullptr;
};

// A fixed B (a weight) packed once, at init, into the panels the GEMM reads: [ceil(N / nr)][K][nr]
// f32, zero past N, nr the level's register tile width. Every M then runs on them (small M too, on
// the GEMM's own loops: a row's bits do not depend on M), so the original is not read again.
// An f16 / bf16 B keeps its 16-bit elements in the same layout (`narrow`, `panels` empty): the
// copy costs the weight's own size, and the GEMM widens it in registers instead of per call. On a
// level with `bf16_pairs` a bf16 B is packed in k pairs, [ceil(N / nr)][ceil(K / 2)][nr][2] (zero
// past K), the operand layout of vdpbf16ps: above kBf16DotMinRows rows the activations are then
// rounded to bf16 and multiplied with it (twice the f32 FMA's rate on Zen 4), as AMX does; up to
// that the GEMM widens the pairs to f32 and sums in the same order as the plain layout.
struct PackedB {
  Isa isa = Isa::generic;  // the level it was packed for (another level's nr may differ)
  int64_t K = 0, N = 0;
  std::shared_ptr<const float> panels;
  std::shared_ptr<const uint16_t> narrow;
};
// p's B (its a, c and M are not read) packed for the active level; nullopt when that level has no
// SIMD kernels or p's B cannot be packed (Q8_0, dtype not f32 with f32/f16/bf16 storage). `packed`,
// when given, is told each range of B's columns [n0, n1) as soon as it is packed (slices of about
// 8 MiB), so the caller can let go of them as packing goes. Each slice's panels are packed on
// `parallel`'s threads where given (the same bytes either way).
// `copies`, when given, may hold the panels packed already (a packed-weight cache entry: `packed` is
// then told all of B at once), and is handed them when packed here.
std::optional<PackedB> pack_b(const Problem& p, const std::function<void(int64_t n0, int64_t n1)>& packed = {},
                              Parallel* parallel = nullptr, const PackedCopies* copies = nullptr);

// Scratch the driver hands to one thread's call (sizes from Blocking): the ISA code allocates
// nothing itself.
struct Workspace {
  float* packed_a = nullptr;  // >= mc * kc floats
  float* packed_b = nullptr;  // >= kc * nc floats
  float* c_acc = nullptr;     // >= rows * nc floats, for f16/bf16 results (f32 partial sums)
};

// The register tile and cache blocks of one ISA level.
struct Blocking {
  int mr = 0, nr = 0;  // register tile: rows x columns
  int64_t kc = 0;      // depth of a packed block (a kc x nr B micro-panel stays in L1)
  int64_t mc = 0;      // rows of A per block (mc x kc stays in L2)
  int64_t nc = 0;      // columns of a packed B block
};

// What each ISA translation unit exports.
struct IsaKernels {
  Isa isa = Isa::generic;
  Blocking blocking;
  // C rows [m0, m1) x columns [n0, n1) of p, all of K: pack, multiply, store. n0 is a multiple of
  // nr when p.packed_b is set.
  void (*gemm)(const Problem& p, int64_t m0, int64_t m1, int64_t n0, int64_t n1, const Workspace& ws);
  // Small M (small_m_applies), columns [n0, n1): streams B once. False when B's layout has neither unit
  // stride, or B is Q8_0 (the caller then runs gemm; quantized.h has the int8 GEMV). ws.packed_a
  // holds >= M * K floats (A rows converted to f32).
  bool (*small_m)(const Problem& p, int64_t n0, int64_t n1, const Workspace& ws);
  // All of p's B (dtype f32, storage same / f16 / bf16) -> dst, the PackedB layout.
  void (*pack_b)(const Problem& p, float* dst);
  // All of p's 16-bit B (storage f16 / bf16) -> dst, PackedB::narrow's layout, in k pairs if `pairs`.
  void (*pack_b_narrow)(const Problem& p, bool pairs, uint16_t* dst);
  // A bf16 B packed ahead (PackedB::narrow) is in k pairs, and runs vdpbf16ps above kBf16DotMinRows.
  bool bf16_pairs = false;
};
inline constexpr int64_t kSmallM = 8;
// Rows above which a bf16 weight runs the bf16 dot GEMM on a level with IsaKernels::bf16_pairs (its
// activations rounded to bf16), packed ahead or not: the same rule as AMX's tiles (amx::kMinRows).
// Up to this many rows (decode) every row keeps its exact f32 products and its bits at any M; above
// it every row gets the same bits at any M above it (docs/batching.md).
inline constexpr int64_t kBf16DotMinRows = kSmallM;
// f16 / bf16 weights with f32 activations that were not packed at init take the small-M path up to
// this many rows too: the rows in chunks of at most kSmallM, each chunk over a block of weight
// columns that stays in L2, so the weight is read from memory once and every row gets the bits it
// gets at M = 1. Unpacked, the GEMM widens the whole weight into f32 panels on every call: 16 rows of
// 8192 x 2048 bf16 took 11.3 ms that way and 7.8 ms in chunks on one Xeon thread; 32 rows 16.6 and
// 15.3, 64 rows 25.1 and 30.0 (docs/batching.md). A weight packed at init (PackedB::narrow) runs the
// GEMM above kSmallM rows (5.4 ms for 16 rows); CPUs with AMX run bf16 there on the tiles (matmul.cpp).
inline constexpr int64_t kNarrowSmallMMax = 32;
// A GEMV is cut into up to this many parts per thread, claimed by whichever thread is free: it is
// bound by memory, and a thread slowed by its neighbours then does not hold the others up at the end.
// Each part is a new stream for the hardware prefetchers to ramp up: 2 rather than 4 took llama-1B
// Q8_0 decode from 26.7-28.6 to 30.9-32.9 tok/s in the memory's fast phases (Zen 4, 2 threads,
// session 26, docs/performance.md).
inline constexpr int64_t kGemvPartsPerThread = 2;
// Products above kSmallM rows (prefill), bound by arithmetic, keep the 4 parts per thread they were
// measured with.
inline constexpr int64_t kGemmPartsPerThread = 4;
// The parts per thread of a product with an lhs of M rows, by the two rules above.
constexpr int64_t parts_per_thread(int64_t M) { return M > kSmallM ? kGemmPartsPerThread : kGemvPartsPerThread; }

const IsaKernels* avx2_kernels();         // nullptr when not compiled for x86-64
const IsaKernels* avx512_kernels();
const IsaKernels* avx512_bf16_kernels();

// Runs one 2-D problem (the caller loops over batches), threaded over ctx.parallel. False when the
// active level is `generic` or the dtype is not f32/f16/bf16: the caller computes it another way.
bool run(const KernelContext& ctx, const Problem& p);
// Whether p runs on the small-M (streaming) path rather than the GEMM.
bool small_m_applies(const Problem& p);
// Several small-M problems (grouped_matmul's decode: q, k and v reading one activation) as ONE
// parallel job: their columns, in whole vectors of 16, are concatenated and cut into up to
// kGemvPartsPerThread parts per thread, claimed dynamically (run() sends one small-M problem here
// too). Each result is bit-identical to run() on its problem alone. False (nothing computed) unless every problem is
// supported and takes the small-M path (small_m_applies: M <= kSmallM, or <= kNarrowSmallMMax for
// f16 / bf16 storage; B not Q8_0, a unit stride in B).
bool run_group(const KernelContext& ctx, std::span<const Problem> problems);
// Many independent problems of one shape (attention's per-head products): one per thread at a time.
bool run_batched(const KernelContext& ctx, int64_t count, const std::function<Problem(int64_t)>& problem);

}  // namespace kiln::kernels::gemm
