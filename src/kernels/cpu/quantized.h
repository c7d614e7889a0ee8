// Private: the GEMVs and GEMMs behind the qmatmul kernel (quantized.cpp), one implementation per
// x86 ISA level chosen at run time as gemm.h's are, plus a portable one. Q8_0 as below; the other
// encodings (Q4_0, Q4_K, Q5_K, Q6_K: quantized_blocks.cpp, quantized_avx2.cpp) at the end.
//
// The activations are quantized once per call to int8 blocks of 32 (the weights' block size), as
// ggml's q8_0 x q8_0 dot does: d_x = max|x| / 127 (f32), q_x = round-half-even(x * 127 / max|x|).
// Each block's product is then an exact int32 dot, scaled once by d_x * d_w and summed in f32 in
// block order. vpdpbusd multiplies unsigned by signed bytes, so one side carries +128 and the
// matching 128 * sum cancels it:
// * GEMV (up to kSmallM rows of a weight that is not fixed, or where the GEMM is not): the activations
//   are stored +128 (`offset`) and 128 * sum(w) (one more vpdpbusd per weight block, shared by all
//   rows of x) is subtracted; weights are read in place, several rows at a time.
// * GEMM: 32 weight rows at a time, +128, in a panel whose vectors hold 16 rows x 4 quants, so one
//   activation dword broadcast feeds 16 rows; the correction -128 * sum(q_x) per activation block
//   starts each int32 accumulator. A fixed weight's panels are packed once at init (built with the
//   qmatmul kernel) and serve every M, one-row decode included, in place of the weight's own rows
//   (which a file's loader may then drop: Kernel::copies_fixed_input): a panel is as many bytes as
//   its rows, one row streams them as fast as the GEMV streams the rows (Emerald Rapids, 2 threads:
//   22-25 against 19-24 GB/s), and a tile does 16 weight rows' dots per instruction where the GEMV
//   does one, so 3..8 rows stay memory-bound (on Zen 4 the GEMV's 8 rows cost 5.9x its one row from
//   L3, the GEMM's 2x). Each row's sum runs in the same order whatever M is, so its bits do not
//   depend on the batch. A weight that is not fixed runs the GEMV up to kSmallM rows, and above it
//   each thread packs a panel at a time.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>

#include "kernels/kernel.h"
#include "kiln/graph/quantization.h"

namespace kiln::kernels::quantized {

// Activations [M, K] as Q8_0-style blocks (see above).
struct Q8Activations {
  const uint8_t* x = nullptr;   // [M][K]: q_x, or q_x + 128 for the Q8_0 GEMV (stored as u8 either way)
  const float* d = nullptr;     // [M][K / 32]: each block's scale ([M][K / 256] for the K-quants)
  const int32_t* sum = nullptr; // [M][K / 32]: each block's sum of q_x (Q8_0 GEMM, the other encodings)
  const int16_t* sum16 = nullptr;  // [M][K / 16]: sums of q_x per 16 (Q6_K, whose scales cover 16)
  int64_t M = 0, K = 0;
  // [M][K / 32]: sum as f32, for Q4_K and Q5_K's block GEMM (which subtracts b_j sum_j(q_x) in f32).
  const float* sum_f32 = nullptr;
};

// x [M][K] (K a multiple of 32, rows K apart) -> q [M][K], d and sum [M][K / 32] (sum may be null);
// q holds q_x + 128 when `offset`. Every implementation gives the portable one's bits: d = max|x| /
// 127, q_x = round-half-even(x * (127 / max|x|)) clamped to [-127, 127]. The AVX2 and AVX-512 ones
// are nullptr where not compiled for x86-64 (the caller checks the CPU).
using QuantizeRowsFn = void (*)(const float* x, int64_t M, int64_t K, bool offset, uint8_t* q, float* d,
                                int32_t* sum);
void portable_quantize_rows(const float* x, int64_t M, int64_t K, bool offset, uint8_t* q, float* d, int32_t* sum);
QuantizeRowsFn avx2_quantize_rows();

// y[m * ldy + n] for weight rows n in [n0, n1) of w (encoded rows `row_bytes` apart). Q8_0: x offset
// by +128, M <= gemm::kSmallM.
using QGemvFn = void (*)(const Q8Activations& x, const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1,
                         float* y, int64_t ldy);

// The GEMM's packing unit, and the scratch one call needs: kGemmRows rows x K as int8 + f16 scales,
// as many bytes as the rows themselves (so a packed one-row product streams what the GEMV would).
inline constexpr int64_t kGemmRows = 32;
// A panel's bytes per block of 32 quants: [8 dwords][2 halves][16 rows][4 quants + 128], then
// [2 halves][16 rows] f16 scales as stored (the rows' own 32 x 34); rows past the weight are zero
// (quants 128, scale 0). A 256-bit vector at dword j, byte 32 v holds rows 8v .. 8v + 7.
inline constexpr int64_t kQ8_0PanelBlockBytes = kGemmRows * (32 + 2);
inline int64_t gemm_panel_bytes(int64_t K) { return K / 32 * kQ8_0PanelBlockBytes; }

// Same contract as QGemvFn for any M, x not offset (with sums); n0 a multiple of kGemmRows.
// `packed`: all of w's panels (Q8_0PackFn's layout) packed ahead, or nullptr: each panel is then
// packed into `panel` (gemm_panel_bytes(K) bytes, 64-byte aligned) on the way. Same bits either way.
using Q8_0GemmFn = void (*)(const Q8Activations& x, const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1,
                            float* y, int64_t ldy, const uint8_t* packed, uint8_t* panel);
// Weight rows [0, N) of w -> ceil(N / kGemmRows) panels of gemm_panel_bytes(K) bytes at `panels`
// (64-byte aligned): what the GEMM packs per call, done once for a fixed weight.
using Q8_0PackFn = void (*)(const uint8_t* w, int64_t row_bytes, int64_t N, int64_t K, uint8_t* panels);

// nullptr where not compiled in; the caller checks the CPU (avx512f/bw/vl + avx512vnni).
QGemvFn avx512_vnni_q8_0_gemv();
Q8_0GemmFn avx512_vnni_q8_0_gemm();
Q8_0PackFn avx512_vnni_q8_0_pack();
QuantizeRowsFn avx512_quantize_rows();
// Without VNNI (AVX2), a fixed Q8_0 weight is packed at init into the same panels (avx2_q8_0_pack
// writes avx512_vnni_q8_0_pack's bytes) and every M runs on them (avx2_q8_0_panels, a KPanelsFn
// below): one or two activation rows (decode) stream the panels 32 rows at a time with no horizontal
// sums, the VNNI kernels' integer dots (|q| times q_x with q's sign) and f32 steps in their order, so
// their bits; more rows unpack each panel into the AVX2 block GEMM's and run its tiles, whose f32
// steps are the same, so every row has the same bits whatever M is.

// One quantized weight of a GEMV: rows [0, N) of `w`, `row_stride` bytes apart, into y [M][N].
struct QGemvTarget {
  const uint8_t* w = nullptr;
  int64_t row_stride = 0;
  int64_t N = 0;
  float* y = nullptr;
};
// qmatmul's decode path (lhs [..., K] f32, any strides, of M <= gemm::kSmallM rows; of any M for the
// encodings other than Q8_0, whose GEMV is their only kernel): the activations quantized once, then the rows of every target (all of row length K, all in `encoding`) cut into
// chunks as ONE parallel job, so grouped_matmul's q, k and v cost one pool round trip. Each result
// has the bits qmatmul gives for its target alone.
void qmatmul_gemv_group(const KernelContext& ctx, graph::QuantizationEncoding encoding, const TensorView& lhs,
                        std::span<const QGemvTarget> targets);
// qmatmul(lhs, w) -> out checked as qmatmul checks it (its errors); its GEMV target when lhs has at
// most gemm::kSmallM rows, nullopt when qmatmul runs its GEMM instead.
std::optional<QGemvTarget> qmatmul_gemv_target(graph::QuantizationEncoding encoding, const TensorView& lhs,
                                               const TensorView& w, const TensorView& out);

// One fixed weight's panels packed at init (Q8_0PackFn's layout, or avx512_vnni_k_pack's, N rows) and its
// result y [M][N].
struct PackedTarget {
  const uint8_t* panels = nullptr;
  int64_t N = 0;
  float* y = nullptr;
};
// The packed GEMM (Q8_0) or panels kernel (Q4_K, Q6_K) for lhs [..., K] f32 of any M (the caller checked
// VNNI and the operands): the activations quantized once, then the panels of every target cut into
// chunks as ONE parallel job (decode's grouped q/k/v in one pool round trip). Each result has the
// bits qmatmul gives alone.
void packed_gemm_group(const KernelContext& ctx, graph::QuantizationEncoding encoding, const TensorView& lhs,
                       std::span<const PackedTarget> targets);

// ---- Q4_0, Q4_K, Q5_K, Q6_K -----------------------------------------------------------------------
// The activations are quantized to int8 with the rule above (d_x = max|x| / 127, q_x =
// round-half-even(x * 127 / max|x|)), not offset, over blocks of 32 for Q4_0 (as for Q8_0, and as
// ggml's q4_0 dot) and of 256 for the K-quants (as ggml's q8_K), with sums of q_x per 32 (`sum`) and,
// for Q6_K, per 16 (`sum16`). Every weight block's product with them is then an exact int32, and one
// super-block needs a single f32 scaling per term:
//   Q4_0 (block b):        (d_w * d_x) * (dot(q, q_x) - 8 * sum(q_x))
//   Q4_K, Q5_K (block s):  (d * d_x) * sum_j sc_j dot_j(q, q_x) - (dmin * d_x) * sum_j m_j sum_j(q_x)
//   Q6_K (block s):        (d * d_x) * sum over its 16 sub-blocks i of sc_i * (dot_i(q, q_x) - 32 sum_i(q_x))
// summed in f32 over the row (the order differs between the portable and the SIMD kernels). The
// GEMV serves every M up to gemm::kSmallM, so a row's result does not depend on M there; above it
// the block GEMM below (where AVX2 or VNNI is) sums the same products in its own order.
constexpr int64_t activation_block(graph::QuantizationEncoding e) {
  return e == graph::QuantizationEncoding::q8_0 || e == graph::QuantizationEncoding::q4_0 ? 32 : 256;
}
QGemvFn portable_block_gemv(graph::QuantizationEncoding);  // q4_0, q4_k, q5_k, q6_k
// The K-quants' activations: x [M][K] (K a multiple of 256) -> q [M][K], d [M][K / 256], sum
// [M][K / 32] and, unless null, sum16 [M][K / 16]. The AVX-512 and AVX2 ones give the portable
// one's bits; nullptr where not compiled for x86-64 (the caller checks the CPU).
using QuantizeRows256Fn = void (*)(const float* x, int64_t M, int64_t K, uint8_t* q, float* d, int32_t* sum,
                                   int16_t* sum16);
void portable_quantize_rows_256(const float* x, int64_t M, int64_t K, uint8_t* q, float* d, int32_t* sum,
                                int16_t* sum16);
QuantizeRows256Fn avx512_quantize_rows_256();
QuantizeRows256Fn avx2_quantize_rows_256();
// The AVX2 kernels (maddubs: the unsigned quants times the signed activations); nullptr where not
// compiled for x86-64. The caller checks the CPU (gemm::Isa::avx2). Also Q8_0's GEMV where there is
// no AVX512-VNNI, with this section's activations (not offset): y = sum over blocks of
// (d_w * d_x) * dot(q_w, q_x), the definition of Q8_0's GEMV in another order.
QGemvFn avx2_block_gemv(graph::QuantizationEncoding);
// AVX-512 + AVX512_VNNI GEMVs of q4_k, q5_k and q6_k (nullptr for the others, or where not compiled
// for x86-64): one activation row 64 weights per instruction, the AVX2 kernels' bits exactly; more
// rows run the AVX2 kernel. The caller checks the CPU.
QGemvFn avx512_vnni_block_gemv(graph::QuantizationEncoding);

// The GEMM of these encodings (AVX-512 + AVX512_VNNI, or AVX2), for more than gemm::kSmallM rows
// (prefill, large batched steps). Every weight is w = a * u - b per block of 32 (16 for Q6_K) with u an
// unsigned integer and a, b exact f32 products of the block's scales:
//   Q4_0  u = q (0..15),  a = d,         b = 8 d
//   Q4_K  u = q (0..15),  a = d sc_j,    b = dmin m_j     (Q5_K: u = q (0..31))
//   Q6_K  u = q (0..63),  a = d sc_i,    b = 32 d sc_i    (blocks of 16)
// Each thread unpacks a panel of kGemmRows weight rows at a time into u8 quants laid out as the Q8_0
// GEMM's panels (one activation dword broadcast feeds 16 rows in a vpdpbusd) with a and b beside
// them, and multiplies it with all M rows of this section's activations (same quantization as the
// GEMV) while it is in L2:
//   y = sum over activation blocks s of d_x,s * sum over the weight blocks j in s of
//       (a_j * dot_j(u, q_x) - b_j * sum_j(q_x))
// the inner sum in f32 per activation block (Q4_0 and Q6_K: b_j sum_j subtracted in the integer dot,
// as -8 or -32 sum_j(q_x)), then scaled by d_x,s and added to y, in block order whatever M is, so a
// row's bits are the same in every call of more than kSmallM rows; they differ from its GEMV bits by
// f32 rounding.
// `panel`: block_gemm_panel_bytes(e, K) bytes, 64-byte aligned, for this call's panels.
using QBlockGemmFn = void (*)(const Q8Activations& x, const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1,
                              float* y, int64_t ldy, uint8_t* panel);
// nullptr where not compiled for x86-64, and VNNI's for q8_0 (its own GEMM above); the caller checks
// the CPU. The AVX2 one (vpmaddubsw, 8 weight rows per instruction, on the same panels) gives the
// AVX-512 one's bits; its Q8_0 (u = q signed, a = d, b = 0: |q| times q_x with q's sign, pairs at most
// 2 * 128 * 127) replaces the f32 GEMM on dequantized weights where there is no VNNI.
QBlockGemmFn avx512_vnni_block_gemm(graph::QuantizationEncoding);
QBlockGemmFn avx2_block_gemm(graph::QuantizationEncoding);
// ---- Q4_K and Q6_K packed at init (AVX-512 + AVX512_VNNI) -------------------------------------------
// A fixed Q4_K or Q6_K weight (a model's) is repacked once into panels of kGemmRows rows that keep
// its bits a weight, per super-block of 256, in the order decode reads them (one forward stream):
//   Q4_K (4736 bytes, the rows' 4608 + 2.8%): d and dmin [32 rows] f16, then per sub-block j of 32
//   quants sc_j and m_j [32 rows] u8 and the quants' low 4 bits.
//   Q6_K (6720 bytes, the rows' own size): d [32 rows] f16, then per pair of sub-blocks of 16 their
//   sc [2][32 rows] i8 and their 32 quants u = q + 32, 6 bits in a byte: [2 halves][2][3][16 rows][4
//   bytes], three vectors per 4 groups of 4 quants, the fourth group's bits in their bits 6-7
//   (quantized_avx512_vnni.cpp's q6_k_groups).
// Q4_K's low 4 bits of 32 quants are [2 halves][4][16 rows][4 bytes], byte t of vector i holding
// quant 8i + t (low nibble) and 8i + 4 + t (high nibble), so one load and a mask or a shift give a
// vpdpbusd 4 quants of 16 rows.
// Decode (M <= kKPanelGemvRows) runs on them 16 rows per instruction, the scales applied once per
// sub-block in int32 (the row GEMV's integer sums, scaled in f32 once per super-block); more rows
// run the block GEMM's arithmetic (the same quants and (a, b) as from the rows, so the same bits):
// Q4_K up to 32 rows on the panels as stored, else on each panel unpacked into the block GEMM's on
// the way. The file's rows are then not read again.
inline constexpr int64_t kQ4KPanelSuperBytes = 4736, kQ6KPanelSuperBytes = 6720;
inline constexpr int64_t kKPanelGemvRows = 8;  // gemm::kSmallM
inline int64_t k_panel_bytes(graph::QuantizationEncoding e, int64_t K) {
  return K / 256 * (e == graph::QuantizationEncoding::q6_k ? kQ6KPanelSuperBytes : kQ4KPanelSuperBytes);
}
// y[m * ldy + n], n in [n0, n1) (n0 a multiple of kGemmRows), for any M, from the panels; x as for the
// K-quants' GEMV (quantize_rows_256, with sums of 32, and of 16 for Q6_K), plus Q4_K's sum_f32 when
// M > kKPanelGemvRows. `scratch`: block_gemm_panel_bytes(e, K) bytes, 64-byte aligned (read when
// M > kKPanelGemvRows).
using KPanelsFn = void (*)(const Q8Activations& x, const uint8_t* panels, int64_t n0, int64_t n1, float* y,
                           int64_t ldy, uint8_t* scratch);
// Weight rows [0, N) -> ceil(N / kGemmRows) panels of k_panel_bytes(e, K) (Q8_0PackFn's contract);
// nullptr for the other encodings, or where not compiled for x86-64.
Q8_0PackFn avx512_vnni_k_pack(graph::QuantizationEncoding e);
KPanelsFn avx512_vnni_k_panels(graph::QuantizationEncoding e);
// The same for CPUs with AVX2 but not AVX512_VNNI, Q4_K only (nullptr for the others): the AVX-512
// packer's bytes; decode 8 rows per vpmaddubsw with the VNNI kernel's integer sums and f32 steps
// (so its bits), more rows through the AVX2 block GEMM (the bits it gives from the rows).
Q8_0PackFn avx2_k_pack(graph::QuantizationEncoding e);
KPanelsFn avx2_k_panels(graph::QuantizationEncoding e);
// Q8_0's (above, near the VNNI GEMM): its panels are gemm_panel_bytes(K) each, x not offset (with sums).
Q8_0PackFn avx2_q8_0_pack();
KPanelsFn avx2_q8_0_panels();
// The bytes of one packed panel of encoding e (Q8_0, Q4_K or Q6_K) and inner dim K.
inline int64_t packed_panel_bytes(graph::QuantizationEncoding e, int64_t K) {
  return e == graph::QuantizationEncoding::q8_0 ? gemm_panel_bytes(K) : k_panel_bytes(e, K);
}

int64_t block_gemm_panel_bytes(graph::QuantizationEncoding e, int64_t K);
// One chunk of 32 quants of a block GEMM panel: the quants of kGemmRows rows, then their (a, b) per
// weight block (`sub_blocks` = 32 / B of them).
constexpr int64_t block_gemm_chunk_bytes(int sub_blocks) { return 32 * kGemmRows + 2 * sub_blocks * kGemmRows * 4; }

}  // namespace kiln::kernels::quantized

namespace kiln::kernels {
// The qmatmul kernel of a step: its encoding checked once, and a fixed Q8_0 weight's GEMM panels
// (a Q4_K or Q6_K weight's nibble panels) packed at build where VNNI or AVX2 is (they then serve every
// launch, whatever its M).
std::unique_ptr<const Kernel> make_qmatmul_kernel(const KernelInit& init);
// Tests: whether a qmatmul kernel (make_qmatmul_kernel) packed its fixed weight's panels at build.
bool qmatmul_packed_panels(const Kernel& qmatmul);
// qmatmul(lhs, w) -> out checked as qmatmul checks it (its errors); the packed target a qmatmul kernel
// runs it on (its panels are w's and a kernel for them is active), else nullopt.
std::optional<quantized::PackedTarget> qmatmul_packed_target(const Kernel& qmatmul, const TensorView& lhs,
                                                               const TensorView& w, const TensorView& out);
}  // namespace kiln::kernels
