// qmatmul (f32 activations x quantized weight rows) and dequantize. The activations are quantized
// once per call to int8 blocks (quantized.h) on every path, so each result has one definition:
// for Q8_0, y = sum over blocks of (d_x * d_w) * int32 dot(q_x, q_w), up to f32 rounding. Where
// AVX512-VNNI or AVX2 is available a fixed weight runs on its packed panels at every M, one-row
// decode included (the VNNI GEMM, or AVX2's panel kernels: the same bits). Otherwise few rows
// (decode) run the int8 GEMV, reading the weights in place, and more rows (prefill) the VNNI GEMM
// packing as it goes or the AVX2 block GEMM, else the f32 GEMM of gemm.h (BStorage::q8_0) or a
// portable loop on the dequantized activations d_x * q_x. The other encodings (quantized.h's last
// section) run their int8 GEMV up to gemm::kSmallM rows, reading the weights in place (for the
// K-quants' single activation row, its AVX-512 form where VNNI is there, the same bits), and above
// it the block GEMM where VNNI or AVX2 is there (else the GEMV for every M); a fixed Q4_K or Q6_K
// weight runs on its packed panels at every M where VNNI or AVX2 is; the K-quants' activations are
// quantized per 256 instead of 32 (ggml's q8_K).
#include "kernels/cpu/quantized.h"
#include "kernels/cpu/scratch.h"

#include <fmt/format.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "kernels/cpu/gemm.h"
#include "kernels/cpu/kernels.h"
#include "kernels/cpu/strided.h"
#include "kiln/graph/quantization.h"
#include "tensor/host_memory.h"

namespace kiln::kernels {
namespace {

using graph::Op;
using graph::QuantizationEncoding;
using quantized::Q8Activations;

bool cpu_has_avx512_vnni() {
#if defined(__x86_64__)
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
#else
  return false;
#endif
}

// The VNNI kernels are used when the active gemm level is AVX-512 or above (tests force
// `generic` / `avx2` to reach the other paths) and the CPU has VNNI.
bool use_vnni() {
  static const bool vnni = cpu_has_avx512_vnni() && quantized::avx512_vnni_q8_0_gemv() != nullptr;
  const gemm::Isa isa = gemm::active_isa();
  return vnni && (isa == gemm::Isa::avx512 || isa == gemm::Isa::avx512_bf16);
}

// The AVX2 kernels run: the CPU has AVX2 (+FMA, F16C) and the gemm ISA is not forced to generic.
bool use_avx2() {
  static const bool avx2 = gemm::isa_supported(gemm::Isa::avx2);
  return avx2 && gemm::active_isa() != gemm::Isa::generic;
}

// The quantizer of the active ISA level (the same bits at every level).
void quantize_rows(const float* x, int64_t M, int64_t K, bool offset, uint8_t* q, float* d, int32_t* sum) {
  static const quantized::QuantizeRowsFn avx512 = cpu_has_avx512_vnni() ? quantized::avx512_quantize_rows() : nullptr;
  const quantized::QuantizeRowsFn avx2 = quantized::avx2_quantize_rows();
  const quantized::QuantizeRowsFn fn = use_vnni() && avx512 ? avx512
                                       : use_avx2() && avx2 ? avx2
                                                            : quantized::portable_quantize_rows;
  fn(x, M, K, offset, q, d, sum);
}

// Per-thread buffers reused across calls: the hot path allocates only when a call needs more than
// any before it on this thread.
struct Scratch {
  std::vector<float> lhs;     // a strided lhs made contiguous, or the dequantized activations
  std::vector<uint8_t> q;     // [M][K] quantized activations
  std::vector<float> d;       // [M][K / 32]
  std::vector<int32_t> sum;   // [M][K / 32]
  std::vector<int16_t> sum16; // [M][K / 16] (Q6_K)
  std::vector<float> sum_f32;  // [M][K / 32] (Q4_K and Q5_K's block GEMM)
  AlignedScratch<uint8_t> panel;  // the GEMM's packed weight panel
};
thread_local Scratch t_scratch;

template <class T> T* grow(std::vector<T>& v, int64_t n) {
  if (v.size() < static_cast<size_t>(n)) v.resize(static_cast<size_t>(n));
  return v.data();
}

// The portable GEMV: the same int32 block dots and f32 scaling as the SIMD one.
void portable_gemv(const Q8Activations& x, const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1, float* y,
                   int64_t ldy) {
  const int64_t blocks = x.K / 32;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * row_bytes;
    for (int64_t m = 0; m < x.M; ++m) {
      float sum = 0.0f;
      for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* block = row + b * 34;
        const uint8_t* xq = x.x + m * x.K + b * 32;
        int32_t dot = 0;
        for (int i = 0; i < 32; ++i) dot += (static_cast<int32_t>(xq[i]) - 128) * static_cast<int8_t>(block[2 + i]);
        uint16_t dw;
        std::memcpy(&dw, block, 2);
        sum += static_cast<float>(dot) * (f16_to_f32(dw) * x.d[m * blocks + b]);
      }
      y[m * ldy + n] = sum;
    }
  }
}

// Splits `units` across the pool's threads, one contiguous chunk each (long runs of weight rows keep
// the hardware prefetchers streaming), unless there is too little work (< `min_units`) to share.
template <class Fn> void for_each_thread_chunk(const KernelContext& ctx, int64_t units, int64_t min_units, Fn&& fn) {
  const int64_t threads = ctx.parallel ? ctx.parallel->num_threads() : 1;
  const int64_t grain = std::max(min_units, units / std::max<int64_t>(threads, 1));
  parallel_for(ctx, units, std::max<int64_t>(grain, 1), fn);
}

// The portable GEMM: each weight row dequantized once, then dotted with every activation row.
void portable_gemm(const KernelContext& ctx, const float* x, int64_t M, int64_t K, const uint8_t* w,
                   int64_t row_bytes, int64_t N, float* y) {
  parallel_for(ctx, N, std::max<int64_t>(1, 65536 / (M * K)), [&](int64_t begin, int64_t end) {
    std::vector<float> row(static_cast<size_t>(K));
    for (int64_t n = begin; n < end; ++n) {
      graph::dequantize_q8_0(w + n * row_bytes, K, row.data());
      for (int64_t m = 0; m < M; ++m) {
        float sum = 0.0f;
        for (int64_t k = 0; k < K; ++k) sum += x[m * K + k] * row[static_cast<size_t>(k)];
        y[m * N + n] = sum;
      }
    }
  });
}

// A view's elements as a contiguous buffer: the view's own memory when it already is.
const void* contiguous(const KernelContext& ctx, const TensorView& v, std::vector<uint8_t>& copy) {
  if (v.is_contiguous()) return v.data;
  copy.resize(static_cast<size_t>(v.numel()) * dtype_size(v.dtype));
  copy_strided(ctx, v.dtype, v.shape, v.data, v.strides, copy.data());
  return copy.data();
}

// The encoding attribute, read (and checked) at build.
QuantizationEncoding encoding_of(const KernelInit& init) { return graph::parse_encoding(init.attr<std::string>("encoding")); }

// The f32 lhs as `elements` contiguous values: its own memory, or a copy in this thread's scratch.
const float* lhs_rows(const KernelContext& ctx, const TensorView& a, int64_t elements) {
  if (a.is_contiguous()) return a.as<float>();
  float* copy = grow(t_scratch.lhs, elements);
  copy_strided(ctx, a.dtype, a.shape, a.data, a.strides, copy);
  return copy;
}

// x * (127 / max|x|) -> round-half-even, clamped to [-127, 127] (NaN: 127, as std::fmin gives). The
// clamped value is below 2^22 in magnitude, so adding 1.5 * 2^23 rounds it half to even as vcvtps2dq
// does, without a library call.
int quantized_level(float scaled) {
  const float v = std::fmax(-127.0f, std::fmin(127.0f, scaled)) + 12582912.0f;
  int32_t bits;
  std::memcpy(&bits, &v, 4);
  return (bits & 0x007fffff) - 0x00400000;
}

// Sums of q_x per 16 (Q6_K's sub-blocks) from the quantized activations [M][K].
void sums_of_16(const uint8_t* q, int64_t elements, int16_t* sum16) {
  for (int64_t g = 0; g < elements / 16; ++g) {
    int total = 0;
    for (int i = 0; i < 16; ++i) total += static_cast<int8_t>(q[g * 16 + i]);
    sum16[g] = static_cast<int16_t>(total);  // |total| <= 16 * 127
  }
}

}  // namespace

// The definition of the activation quantization (quantized.h).
void quantized::portable_quantize_rows(const float* x, int64_t M, int64_t K, bool offset, uint8_t* q, float* d, int32_t* sum) {
  const int64_t blocks = K / graph::kQ8_0BlockSize;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < blocks; ++b) {
      const float* src = x + m * K + b * 32;
      float amax = 0.0f;
      for (int i = 0; i < 32; ++i) amax = std::fmax(amax, std::fabs(src[i]));
      const float inv = amax != 0.0f ? 127.0f / amax : 0.0f;
      d[m * blocks + b] = amax / 127.0f;
      int32_t total = 0;
      for (int i = 0; i < 32; ++i) {
        const int v = quantized_level(src[i] * inv);
        total += v;
        q[m * K + b * 32 + i] = static_cast<uint8_t>(offset ? v + 128 : v);
      }
      if (sum) sum[m * blocks + b] = total;
    }
}

// The K-quants' activations (ggml's q8_K): quantize_rows' rule over blocks of 256, with sums per 32.
void quantized::portable_quantize_rows_256(const float* x, int64_t M, int64_t K, uint8_t* q, float* d, int32_t* sum,
                                           int16_t* sum16) {
  for (int64_t b = 0; b < M * K / 256; ++b) {
    const float* src = x + b * 256;
    float amax = 0.0f;
    for (int i = 0; i < 256; ++i) amax = std::fmax(amax, std::fabs(src[i]));
    const float inv = amax != 0.0f ? 127.0f / amax : 0.0f;
    d[b] = amax / 127.0f;
    for (int g = 0; g < 8; ++g) {
      int32_t total = 0;
      for (int i = 32 * g; i < 32 * g + 32; ++i) {
        const int level = quantized_level(src[i] * inv);
        total += level;
        q[b * 256 + i] = static_cast<uint8_t>(level);
      }
      sum[b * 8 + g] = total;
    }
  }
  if (sum16) sums_of_16(q, M * K, sum16);
}

namespace {

// The quantizer of the active ISA level, as gemv_for picks the GEMV (the same bits at every level).
void quantize_rows_256(const float* x, int64_t M, int64_t K, uint8_t* q, float* d, int32_t* sum, int16_t* sum16) {
  static const quantized::QuantizeRows256Fn avx512 =
      cpu_has_avx512_vnni() ? quantized::avx512_quantize_rows_256() : nullptr;
  const quantized::QuantizeRows256Fn avx2 = quantized::avx2_quantize_rows_256();
  const quantized::QuantizeRows256Fn fn = use_vnni() && avx512 ? avx512
                                          : use_avx2() && avx2 ? avx2
                                                               : quantized::portable_quantize_rows_256;
  fn(x, M, K, q, d, sum, sum16);
}

// The GEMV of an encoding at the active ISA level, and whether it takes its activations offset
// (Q8_0's VNNI and portable GEMVs) or not (everything else, with block sums).
struct GemvChoice {
  quantized::QGemvFn fn;
  bool offset;
};
GemvChoice gemv_for(QuantizationEncoding e) {
  if (e == QuantizationEncoding::q8_0 && use_vnni()) return {quantized::avx512_vnni_q8_0_gemv(), true};
  if (use_vnni())
    if (const quantized::QGemvFn vnni = quantized::avx512_vnni_block_gemv(e)) return {vnni, false};
  if (use_avx2())
    if (const quantized::QGemvFn simd = quantized::avx2_block_gemv(e)) return {simd, false};
  if (e == QuantizationEncoding::q8_0) return {portable_gemv, true};
  return {quantized::portable_block_gemv(e), false};
}

// The activations of lhs [M, K] quantized into this thread's scratch: q_x + 128 when `offset`, else
// q_x with its block sums (and sums of 16 for Q6_K).
Q8Activations quantize_lhs(const KernelContext& ctx, QuantizationEncoding e, const TensorView& lhs, int64_t M,
                           int64_t K, bool offset) {
  const float* x = lhs_rows(ctx, lhs, M * K);  // [M, K]
  uint8_t* xq = grow(t_scratch.q, M * K);
  float* xd = grow(t_scratch.d, M * K / 32);
  int32_t* xsum = offset ? nullptr : grow(t_scratch.sum, M * K / 32);
  int16_t* sum16 = e == QuantizationEncoding::q6_k ? grow(t_scratch.sum16, M * K / 16) : nullptr;
  if (quantized::activation_block(e) == 256)
    quantize_rows_256(x, M, K, xq, xd, xsum, sum16);
  else
    quantize_rows(x, M, K, offset, xq, xd, xsum);
  return Q8Activations{xq, xd, xsum, sum16, M, K};
}

// Q4_K and Q5_K's block GEMM subtracts b_j sum_j(q_x) in f32 (Q8Activations::sum_f32); the sums
// converted once per call, in this thread's scratch. The other encodings' GEMMs need none.
void add_f32_sums(QuantizationEncoding e, Q8Activations& acts) {
  if (e != QuantizationEncoding::q4_k && e != QuantizationEncoding::q5_k) return;
  const int64_t n = acts.M * acts.K / 32;
  float* sums = grow(t_scratch.sum_f32, n);
  for (int64_t i = 0; i < n; ++i) sums[i] = static_cast<float>(acts.sum[i]);
  acts.sum_f32 = sums;
}

// The block GEMM (quantized.h) of Q4_0 and the K-quants at the active ISA level (the same bits on
// either), and of Q8_0 on AVX2 without VNNI; else nullptr (Q8_0 with VNNI runs its own GEMM; without
// AVX2 the GEMV serves every M, and Q8_0 the f32 GEMM).
quantized::QBlockGemmFn block_gemm_for(QuantizationEncoding e) {
  if (use_vnni()) return quantized::avx512_vnni_block_gemm(e);  // Q8_0: VNNI's own GEMM
  return use_avx2() ? quantized::avx2_block_gemm(e) : nullptr;
}

// The block GEMM `fn` of Q4_0 and the K-quants, lhs [M, K] with M > gemm::kSmallM: the
// activations quantized once, as for the GEMV, then the weight's panels cut into
// gemm::parts_per_thread(M) chunks per thread, each thread unpacking one panel at a time.
void block_gemm(const KernelContext& ctx, quantized::QBlockGemmFn fn, QuantizationEncoding e, const TensorView& lhs,
                const uint8_t* w, int64_t row_bytes, int64_t M, int64_t K, int64_t N, float* y) {
  Q8Activations acts = quantize_lhs(ctx, e, lhs, M, K, /*offset=*/false);
  add_f32_sums(e, acts);
  const int64_t panels = (N + quantized::kGemmRows - 1) / quantized::kGemmRows;
  const int64_t threads = ctx.parallel ? ctx.parallel->num_threads() : 1;
  parallel_for(ctx, panels, std::max<int64_t>(1, panels / (gemm::parts_per_thread(M) * threads)),
               [&](int64_t begin, int64_t end) {
                 uint8_t* scratch = t_scratch.panel.get(static_cast<size_t>(quantized::block_gemm_panel_bytes(e, K)));
                 fn(acts, w, row_bytes, begin * quantized::kGemmRows, std::min(N, end * quantized::kGemmRows), y, N,
                    scratch);
               });
}

// The kernel of packed panels at the active ISA level: VNNI's K-quant panels (nullptr for Q8_0,
// which runs VNNI's Q8_0 GEMM on them), else AVX2's Q8_0 or K-quant panels, else nullptr (no panels).
quantized::KPanelsFn panels_kernel(QuantizationEncoding e) {
  if (use_vnni()) return quantized::avx512_vnni_k_panels(e);
  if (!use_avx2()) return nullptr;
  return e == QuantizationEncoding::q8_0 ? quantized::avx2_q8_0_panels() : quantized::avx2_k_panels(e);
}
// The packer of those panels at the active ISA level (nullptr where none run).
quantized::Q8_0PackFn panels_pack(QuantizationEncoding e) {
  const bool q8_0 = e == QuantizationEncoding::q8_0;
  if (use_vnni()) return q8_0 ? quantized::avx512_vnni_q8_0_pack() : quantized::avx512_vnni_k_pack(e);
  if (!use_avx2()) return nullptr;
  return q8_0 ? quantized::avx2_q8_0_pack() : quantized::avx2_k_pack(e);
}

}  // namespace

void quantized::qmatmul_gemv_group(const KernelContext& ctx, QuantizationEncoding encoding, const TensorView& lhs,
                                   std::span<const QGemvTarget> targets) {
  const int64_t K = lhs.shape.back(), M = K == 0 ? 0 : lhs.numel() / K;
  int64_t rows = 0;  // weight rows of all targets: the concatenated N
  for (const QGemvTarget& t : targets) rows += t.N;
  if (M == 0 || rows == 0) return;
  const GemvChoice gemv = gemv_for(encoding);
  const Q8Activations acts = quantize_lhs(ctx, encoding, lhs, M, K, gemv.offset);
  const quantized::QGemvFn fn = gemv.fn;
  // A chunk must be worth waking a thread for: >= 32 KiB of weights times rows of x (~32K
  // multiply-adds, the f32 GEMM's threshold), so a small model's 288 x 288 projections still use
  // both cores; larger GEMVs are cut into gemm::kGemvPartsPerThread chunks per thread. A chunk of
  // the concatenated rows may span targets: each row's sum is the same however the rows are cut.
  const int64_t threads = ctx.parallel ? ctx.parallel->num_threads() : 1;
  const int64_t row_bytes = graph::quantized_row_bytes(encoding, K);
  parallel_for(ctx, rows,
               std::max<int64_t>({1, 32768 / (row_bytes * M), rows / (gemm::kGemvPartsPerThread * threads)}),
               [&](int64_t begin, int64_t end) {
                 int64_t first = 0;  // the target's first row in the concatenation
                 for (const QGemvTarget& t : targets) {
                   const int64_t n0 = std::max(begin, first) - first, n1 = std::min(end, first + t.N) - first;
                   if (n0 < n1) fn(acts, t.w, t.row_stride, n0, n1, t.y, t.N);
                   first += t.N;
                 }
               });
}

void quantized::packed_gemm_group(const KernelContext& ctx, QuantizationEncoding encoding, const TensorView& lhs,
                                  std::span<const PackedTarget> targets) {
  const int64_t K = lhs.shape.back(), M = K == 0 ? 0 : lhs.numel() / K;
  const auto panels_of = [](const PackedTarget& t) { return (t.N + kGemmRows - 1) / kGemmRows; };
  int64_t panels = 0;  // of all targets, concatenated
  for (const PackedTarget& t : targets) panels += panels_of(t);
  if (M == 0 || panels == 0) return;
  const KPanelsFn panels_fn = panels_kernel(encoding);  // else VNNI's Q8_0 GEMM
  Q8Activations acts = quantize_lhs(ctx, encoding, lhs, M, K, /*offset=*/false);
  if (panels_fn && M > kKPanelGemvRows) add_f32_sums(encoding, acts);
  const Q8_0GemmFn q8_0 = avx512_vnni_q8_0_gemm();
  const int64_t panel_bytes = packed_panel_bytes(encoding, K);
  // The panels cut into gemm::parts_per_thread(M) chunks per thread, claimed as
  // threads come free (a core slowed by another job hands its share on), each at least 32 KiB of
  // weights times rows of x. Each row's sum is the same however the panels are cut.
  const int64_t threads = ctx.parallel ? ctx.parallel->num_threads() : 1;
  const int64_t parts = gemm::parts_per_thread(M) * threads;
  parallel_for(ctx, panels, std::max<int64_t>({1, 32768 / (panel_bytes * M), panels / parts}),
               [&](int64_t begin, int64_t end) {
                 // (AVX2's Q8_0 panels unpack from M = 3, the K-quants' above kKPanelGemvRows.)
                 uint8_t* scratch = panels_fn && M > 1
                                        ? t_scratch.panel.get(static_cast<size_t>(block_gemm_panel_bytes(encoding, K)))
                                        : nullptr;
                 int64_t first = 0;  // the target's first panel in the concatenation
                 for (const PackedTarget& t : targets) {
                   const int64_t p0 = std::max(begin, first) - first, p1 = std::min(end, first + panels_of(t)) - first;
                   if (p0 < p1) {
                     const int64_t n0 = p0 * kGemmRows, n1 = std::min(t.N, p1 * kGemmRows);
                     if (panels_fn)
                       panels_fn(acts, t.panels, n0, n1, t.y, t.N, scratch);
                     else
                       q8_0(acts, nullptr, 0, n0, n1, t.y, t.N, t.panels, nullptr);
                   }
                   first += panels_of(t);
                 }
               });
}

namespace {

struct QmatmulShape {
  int64_t M = 0, K = 0, N = 0;
};

// qmatmul's operands checked: lhs f32 [..., K], rhs u8 [N, row_bytes of K], result f32 [..., N].
QmatmulShape check_qmatmul(QuantizationEncoding e, const TensorView& a, const TensorView& w, const TensorView& out) {
  const auto operands = [&] { return " (lhs " + describe(a) + ", rhs " + describe(w) + ")"; };
  if (a.dtype != DType::f32 || w.dtype != DType::u8 || out.dtype != DType::f32)
    throw DTypeError("qmatmul: expected lhs f32, rhs u8 and an f32 result" + operands());
  if (a.shape.empty() || w.shape.size() != 2) throw ShapeError("qmatmul: bad operand ranks" + operands());
  const int64_t K = a.shape.back(), N = w.shape[0], row_bytes = w.shape[1];
  const int64_t want = graph::quantized_row_bytes(e, K, "qmatmul: lhs inner dim");
  if (want != row_bytes)
    throw ShapeError("qmatmul: rhs rows must be " + std::to_string(want) + " bytes (" + std::string(encoding_name(e)) +
                     ")" + operands());
  if (w.strides[1] != 1) throw ValueError("qmatmul: rhs rows must be contiguous" + operands());
  const int64_t M = K == 0 ? 0 : a.numel() / K;
  if (!out.is_contiguous() || out.shape.back() != N || out.numel() != M * N)
    throw ShapeError("qmatmul: bad result " + describe(out) + operands());
  return {M, K, N};
}

}  // namespace

std::optional<quantized::QGemvTarget> quantized::qmatmul_gemv_target(QuantizationEncoding e, const TensorView& a,
                                                                      const TensorView& w, const TensorView& out) {
  const QmatmulShape s = check_qmatmul(e, a, w, out);
  if (s.M > gemm::kSmallM) return std::nullopt;
  return QGemvTarget{w.as<uint8_t>(), w.strides[0], s.N, out.as<float>()};
}

namespace {

// A fixed Q8_0 weight's GEMM panels (quantized.h), packed once at build, with the view they came from:
// a launch uses them only for that same weight.
struct PackedPanels {
  const void* source = nullptr;
  int64_t N = 0, K = 0, row_stride = 0;
  std::shared_ptr<const uint8_t> panels;  // packed here, or a packed-weight cache entry's mapping
};

class QmatmulKernel final : public Kernel {
 public:
  explicit QmatmulKernel(const KernelInit& init);
  void run(const KernelContext& ctx, std::span<const TensorView> inputs,
           std::span<const TensorView> outputs) const override;
  bool packed() const { return panels_.has_value(); }
  QuantizationEncoding encoding() const { return encoding_; }
  // The panels packed from w that a launch (lhs inner dim K) runs on, where a kernel for them is
  // active (VNNI's, or AVX2's for Q8_0, Q4_K and Q6_K); else nullptr.
  const uint8_t* panels_for(const TensorView& w, int64_t K) const {
    if (!panels_ || panels_->source != w.data || panels_->N != w.shape[0] || panels_->K != K ||
        panels_->row_stride != w.strides[0] || !panels_run(encoding_))
      return nullptr;
    return panels_->panels.get();
  }
  // Whether this CPU (at the active level) has a kernel for the encoding's packed panels.
  static bool panels_run(QuantizationEncoding e) { return use_vnni() || panels_kernel(e) != nullptr; }

 private:
  QuantizationEncoding encoding_;
  std::optional<PackedPanels> panels_;
};

// A fixed Q8_0 weight's GEMM panels, or a fixed Q4_K or Q6_K weight's nibble panels, where VNNI or AVX2 is: every
// launch then runs on them, and the file's rows are not read again, so they are reported as copied
// (a mapped file's pages of them are dropped: the weight is held once). Packing Q8_0 per call was a
// fifth of a stories110M q8_0 prefill's GEMM time; the K-quants' decode reads 16 rows per instruction
// from their panels (quantized.h).
QmatmulKernel::QmatmulKernel(const KernelInit& init) : encoding_(encoding_of(init)) {
  const quantized::Q8_0PackFn pack = panels_pack(encoding_);
  if (init.inputs.size() != 2 || !init.is_fixed(1) || !pack) return;
  const TensorView &a = init.inputs[0], &w = init.inputs[1];  // a's shape is empty when symbolic
  const int64_t block_bytes = graph::quantized_row_bytes(encoding_, graph::block_size(encoding_));
  const int64_t block_size = graph::block_size(encoding_);
  if (a.dtype != DType::f32 || w.dtype != DType::u8 || w.shape.size() != 2 || w.strides[1] != 1 || w.shape[0] == 0 ||
      w.shape[1] == 0 || w.shape[1] % block_bytes != 0)
    return;  // the launch reports what is wrong
  const int64_t N = w.shape[0], K = w.shape[1] / block_bytes * block_size;
  if (!a.shape.empty() && a.shape.back() != K) return;  // a static lhs of another K: the launch says so
  const int64_t panel_bytes = quantized::packed_panel_bytes(encoding_, K);
  PackedPanels& p = panels_.emplace();
  p.source = w.data;
  p.N = N;
  p.K = K;
  p.row_stride = w.strides[0];
  const int64_t panels = (N + quantized::kGemmRows - 1) / quantized::kGemmRows;
  const auto bytes = static_cast<size_t>(panels * panel_bytes);
  // Kept across processes where the weight is a file's (PackedCopies): every parameter the panels'
  // bytes depend on; the layouts themselves are this build's (the cache's key has the build).
  const std::string packing = fmt::format("qmatmul {} panels of {} rows, N {} K {} row stride {}",
                                          encoding_name(encoding_), quantized::kGemmRows, N, K,
                                          w.strides[0]);
  PackedBuffer buffer = init.copies_of(1).get(packing, bytes);
  if (buffer.filled) {
    p.panels = std::static_pointer_cast<const uint8_t>(buffer.data);
    init.report_copied(1, w.data, static_cast<size_t>(N * w.strides[0]));
    return;
  }
  uint8_t* dst = static_cast<uint8_t*>(buffer.ensure(bytes));
  p.panels = std::static_pointer_cast<const uint8_t>(buffer.data);
  // In slices of about 8 MiB, each reported as copied once packed: a mapped file's pages of it are
  // dropped as packing goes, so even the largest weight (an output projection) is not held twice.
  const int64_t slice = std::max<int64_t>(1, (int64_t{8} << 20) / (quantized::kGemmRows * w.strides[0])) *
                        quantized::kGemmRows;
  // Each slice's panels are packed on the launches' threads (panels are independent).
  const KernelContext build{init.parallel};
  for (int64_t n = 0; n < N; n += slice) {
    const int64_t rows = std::min(slice, N - n);
    const uint8_t* src = w.as<uint8_t>() + n * w.strides[0];
    parallel_for(build, (rows + quantized::kGemmRows - 1) / quantized::kGemmRows, 1, [&](int64_t p0, int64_t p1) {
      const int64_t r0 = p0 * quantized::kGemmRows, r1 = std::min(rows, p1 * quantized::kGemmRows);
      pack(src + r0 * w.strides[0], w.strides[0], r1 - r0, K, dst + (n + r0) / quantized::kGemmRows * panel_bytes);
    });
    init.report_copied(1, src, static_cast<size_t>(rows * w.strides[0]));
  }
  buffer.packed();
}

void QmatmulKernel::run(const KernelContext& ctx, std::span<const TensorView> inputs,
                        std::span<const TensorView> outputs) const {
  if (inputs.size() != 2 || outputs.size() != 1)
    throw ValueError("qmatmul: expected 2 operands and 1 result");
  const TensorView &a = inputs[0], &w = inputs[1], &out = outputs[0];
  const auto [M, K, N] = check_qmatmul(encoding_, a, w, out);
  const uint8_t* wq = w.as<uint8_t>();
  const int64_t w_row = w.strides[0];
  float* y = out.as<float>();  // [M, N]
  if (const uint8_t* packed = panels_for(w, K)) {
    const quantized::PackedTarget target{packed, N, y};
    quantized::packed_gemm_group(ctx, encoding_, a, std::span(&target, 1));
    return;
  }
  if (M > gemm::kSmallM)
    if (const quantized::QBlockGemmFn fn = block_gemm_for(encoding_)) {
      block_gemm(ctx, fn, encoding_, a, wq, w_row, M, K, N, y);
      return;
    }
  if (M <= gemm::kSmallM || encoding_ != QuantizationEncoding::q8_0) {
    const quantized::QGemvTarget target{wq, w_row, N, y};
    quantized::qmatmul_gemv_group(ctx, encoding_, a, std::span(&target, 1));
    return;
  }
  if (N == 0) return;
  const float* x = lhs_rows(ctx, a, M * K);  // [M, K]
  const bool vnni = use_vnni();
  uint8_t* xq = grow(t_scratch.q, M * K);
  float* xd = grow(t_scratch.d, M * K / 32);
  int32_t* xsum = grow(t_scratch.sum, M * K / 32);
  quantize_rows(x, M, K, /*offset=*/false, xq, xd, xsum);
  const Q8Activations acts{xq, xd, xsum, nullptr, M, K};

  if (vnni) {  // a weight that is not fixed: each thread packs a panel at a time
    const quantized::Q8_0GemmFn fn = quantized::avx512_vnni_q8_0_gemm();
    const int64_t panels = (N + quantized::kGemmRows - 1) / quantized::kGemmRows;
    for_each_thread_chunk(ctx, panels, 1, [&](int64_t begin, int64_t end) {
      uint8_t* panel = t_scratch.panel.get(static_cast<size_t>(quantized::gemm_panel_bytes(K)));
      fn(acts, wq, w_row, begin * quantized::kGemmRows, std::min(N, end * quantized::kGemmRows), y, N, nullptr,
         panel);
    });
    return;
  }
  // Without AVX2 (or VNNI): the f32 GEMM on the quantized activations' values d_x * q_x.
  float* xhat = grow(t_scratch.lhs, M * K);
  for (int64_t i = 0; i < M * K; ++i) xhat[i] = xd[i / 32] * static_cast<float>(static_cast<int8_t>(xq[i]));
  const gemm::Problem p{DType::f32, xhat, K, 1, wq, 0, w_row, y, N, M, N, K, gemm::BStorage::q8_0};
  if (!gemm::run(ctx, p)) portable_gemm(ctx, xhat, M, K, wq, w_row, N, y);
}

void dequantize_kernel(const KernelContext& ctx, QuantizationEncoding e, std::span<const TensorView> inputs,
                       std::span<const TensorView> outputs) {
  if (inputs.size() != 1 || outputs.size() != 1) throw ValueError("dequantize: expected 1 operand and 1 result");
  const TensorView &in = inputs[0], &out = outputs[0];
  if (in.dtype != DType::u8 || out.dtype != DType::f32 || in.shape.empty())
    throw DTypeError("dequantize: expected u8 rows and an f32 result, got " + describe(in) + " -> " + describe(out));
  const int64_t row_bytes = in.shape.back();
  const int64_t K = graph::quantized_row_elements(e, row_bytes, "dequantize: input");
  if (!out.is_contiguous() || out.shape.back() != K || out.numel() / K != in.numel() / row_bytes)
    throw ShapeError("dequantize: result " + describe(out) + " does not match input " + describe(in));
  std::vector<uint8_t> copy;
  const uint8_t* rows = static_cast<const uint8_t*>(contiguous(ctx, in, copy));
  float* y = out.as<float>();
  parallel_for(ctx, in.numel() / row_bytes, std::max<int64_t>(1, kElementwiseGrain / K), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) graph::dequantize_row(e, rows + r * row_bytes, K, y + r * K);
  });
}

class DequantizeKernel final : public Kernel {
 public:
  explicit DequantizeKernel(const KernelInit& init) : encoding_(encoding_of(init)) {}
  void run(const KernelContext& ctx, std::span<const TensorView> inputs,
           std::span<const TensorView> outputs) const override {
    dequantize_kernel(ctx, encoding_, inputs, outputs);
  }

 private:
  QuantizationEncoding encoding_;
};

std::unique_ptr<const Kernel> make_dequantize_kernel(const KernelInit& init) {
  return std::make_unique<DequantizeKernel>(init);
}

}  // namespace

std::unique_ptr<const Kernel> make_qmatmul_kernel(const KernelInit& init) {
  return std::make_unique<QmatmulKernel>(init);
}

bool qmatmul_packed_panels(const Kernel& qmatmul) {
  const auto* kernel = dynamic_cast<const QmatmulKernel*>(&qmatmul);
  return kernel && kernel->packed();
}

std::optional<quantized::PackedTarget> qmatmul_packed_target(const Kernel& qmatmul, const TensorView& lhs,
                                                               const TensorView& w, const TensorView& out) {
  const auto* kernel = dynamic_cast<const QmatmulKernel*>(&qmatmul);
  if (!kernel || !kernel->packed()) return std::nullopt;  // packed: a Q8_0, Q4_K or Q6_K kernel
  const QmatmulShape s = check_qmatmul(kernel->encoding(), lhs, w, out);
  const uint8_t* panels = kernel->panels_for(w, s.K);
  if (!panels) return std::nullopt;
  return quantized::PackedTarget{panels, s.N, out.as<float>()};
}

void register_cpu_quantized(KernelRegistry& r) {
  r.add(Op::qmatmul, DeviceKind::CPU, {DType::f32}, make_qmatmul_kernel);
  r.add(Op::dequantize, DeviceKind::CPU, {DType::u8}, make_dequantize_kernel);
}

}  // namespace kiln::kernels
