// qmatmul (f32 activations x Q8_0 weight rows) and dequantize. Few rows (decode): the int8 GEMV of
// quantized.h, activations quantized once per call. More rows (prefill): the f32 GEMM of gemm.h,
// which dequantizes each packed block of weights once (BStorage::q8_0), so prefill keeps f32
// activations. Without SIMD, portable loops with the same arithmetic.
#include "kernels/cpu/quantized.h"

#include <cmath>
#include <cstring>
#include <vector>

#include "kernels/cpu/gemm.h"
#include "kernels/cpu/kernels.h"
#include "kernels/cpu/strided.h"
#include "kiln/graph/quantization.h"

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

// The SIMD GEMV when the active gemm level is AVX-512 or above (tests force `generic` to reach the
// portable loops) and the CPU has VNNI.
quantized::Q8_0GemvFn simd_gemv() {
  static const bool vnni = cpu_has_avx512_vnni();
  const gemm::Isa isa = gemm::active_isa();
  if (vnni && (isa == gemm::Isa::avx512 || isa == gemm::Isa::avx512_bf16)) return quantized::avx512_vnni_q8_0_gemv();
  return nullptr;
}

// x [M][K] -> blocks of 32: d = max|x| / 127 (kept in f32), q = round-half-even(x / d) stored + 128.
void quantize_activations(const float* x, int64_t M, int64_t K, uint8_t* q, float* d) {
  const int64_t blocks = K / graph::kQ8_0BlockSize;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < blocks; ++b) {
      const float* src = x + m * K + b * 32;
      float amax = 0.0f;
      for (int i = 0; i < 32; ++i) amax = std::fmax(amax, std::fabs(src[i]));
      const float scale = amax / 127.0f, inv = scale != 0.0f ? 127.0f / amax : 0.0f;
      d[m * blocks + b] = scale;
      for (int i = 0; i < 32; ++i) {
        const float v = std::fmax(-127.0f, std::fmin(127.0f, std::nearbyint(src[i] * inv)));
        q[m * K + b * 32 + i] = static_cast<uint8_t>(static_cast<int>(v) + 128);
      }
    }
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

QuantizationEncoding encoding_of(const graph::Attrs& attrs, Op op) {
  return graph::parse_encoding(graph::get_attr<std::string>(attrs, "encoding", op));
}

void qmatmul_kernel(const KernelContext& ctx, const graph::Attrs& attrs, std::span<const TensorView> inputs,
                    std::span<const TensorView> outputs) {
  if (inputs.size() != 2 || outputs.size() != 1)
    throw ValueError("qmatmul: expected 2 operands and 1 result");
  encoding_of(attrs, Op::qmatmul);  // q8_0 is the only encoding; this rejects anything else
  const TensorView &a = inputs[0], &w = inputs[1], &out = outputs[0];
  const auto operands = [&] { return " (lhs " + describe(a) + ", rhs " + describe(w) + ")"; };
  if (a.dtype != DType::f32 || w.dtype != DType::u8 || out.dtype != DType::f32)
    throw DTypeError("qmatmul: expected lhs f32, rhs u8 and an f32 result" + operands());
  if (a.shape.empty() || w.shape.size() != 2) throw ShapeError("qmatmul: bad operand ranks" + operands());
  const int64_t K = a.shape.back(), N = w.shape[0], row_bytes = w.shape[1];
  if (graph::quantized_row_bytes(QuantizationEncoding::q8_0, K, "qmatmul: lhs inner dim") != row_bytes)
    throw ShapeError("qmatmul: rhs rows must be " + std::to_string(graph::q8_0_row_bytes(K)) + " bytes" + operands());
  if (w.strides[1] != 1) throw ValueError("qmatmul: rhs rows must be contiguous" + operands());
  if (!out.is_contiguous() || out.shape.back() != N) throw ShapeError("qmatmul: bad result " + describe(out));
  const int64_t M = K == 0 ? 0 : a.numel() / K;
  if (M == 0 || N == 0) return;
  std::vector<uint8_t> a_copy;
  const float* x = static_cast<const float*>(contiguous(ctx, a, a_copy));  // [M, K]
  const uint8_t* wq = w.as<uint8_t>();
  const int64_t w_row = w.strides[0];
  float* y = out.as<float>();  // [M, N]

  if (M <= gemm::kSmallM) {
    std::vector<uint8_t> xq(static_cast<size_t>(M * K));
    std::vector<float> d(static_cast<size_t>(M * K / 32));
    quantize_activations(x, M, K, xq.data(), d.data());
    const Q8Activations acts{xq.data(), d.data(), M, K};
    const quantized::Q8_0GemvFn fn = simd_gemv();
    // Rows per chunk: enough bytes (>= 64 KiB) to pay for handing a chunk to a thread.
    parallel_for(ctx, N, std::max<int64_t>(1, 65536 / row_bytes), [&](int64_t begin, int64_t end) {
      (fn ? fn : portable_gemv)(acts, wq, w_row, begin, end, y, N);
    });
    return;
  }
  const gemm::Problem p{DType::f32, x, K, 1, wq, 0, w_row, y, N, M, N, K, gemm::BStorage::q8_0};
  if (!gemm::run(ctx, p)) portable_gemm(ctx, x, M, K, wq, w_row, N, y);
}

void dequantize_kernel(const KernelContext& ctx, const graph::Attrs& attrs, std::span<const TensorView> inputs,
                       std::span<const TensorView> outputs) {
  if (inputs.size() != 1 || outputs.size() != 1) throw ValueError("dequantize: expected 1 operand and 1 result");
  encoding_of(attrs, Op::dequantize);
  const TensorView &in = inputs[0], &out = outputs[0];
  if (in.dtype != DType::u8 || out.dtype != DType::f32 || in.shape.empty())
    throw DTypeError("dequantize: expected u8 rows and an f32 result, got " + describe(in) + " -> " + describe(out));
  const int64_t row_bytes = in.shape.back();
  const int64_t K = graph::quantized_row_elements(QuantizationEncoding::q8_0, row_bytes, "dequantize: input");
  if (!out.is_contiguous() || out.shape.back() != K || out.numel() / K != in.numel() / row_bytes)
    throw ShapeError("dequantize: result " + describe(out) + " does not match input " + describe(in));
  std::vector<uint8_t> copy;
  const uint8_t* rows = static_cast<const uint8_t*>(contiguous(ctx, in, copy));
  float* y = out.as<float>();
  parallel_for(ctx, in.numel() / row_bytes, std::max<int64_t>(1, kElementwiseGrain / K), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) graph::dequantize_q8_0(rows + r * row_bytes, K, y + r * K);
  });
}

}  // namespace

void register_cpu_quantized(KernelRegistry& r) {
  r.add(Op::qmatmul, DeviceKind::CPU, {DType::f32}, qmatmul_kernel);
  r.add(Op::dequantize, DeviceKind::CPU, {DType::u8}, dequantize_kernel);
}

}  // namespace kiln::kernels
