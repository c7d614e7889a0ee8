// Private: the Q8_0 GEMV behind the qmatmul kernel (quantized.cpp), one implementation per x86 ISA
// level chosen at run time as gemm.h's are, plus a portable one.
//
// Decode (M <= kSmallM rows) is bound by reading the weights, 34 bytes per 32, so the inner loop must
// be cheap: the activations are quantized once per call to int8 blocks of 32 (the weights' block
// size), and each block's product is an exact int32 dot (vpdpbusd) scaled once by d_x * d_w, as
// ggml's q8_0 x q8_0 dot does. vpdpbusd multiplies unsigned by signed bytes, so the activations are
// stored offset by +128 and 128 * sum(w) (one more vpdpbusd per weight block, shared by all rows of
// x) is subtracted.
#pragma once

#include <cstdint>

namespace kiln::kernels::quantized {

// Activations [M, K] as Q8_0-style blocks: x_q = round(x / d), d = max|x| / 127 per block of 32.
struct Q8Activations {
  const uint8_t* x = nullptr;  // [M][K]: x_q + 128
  const float* d = nullptr;    // [M][K / 32]: each block's scale
  int64_t M = 0, K = 0;
};

// y[m * ldy + n] for weight rows n in [n0, n1) of w (Q8_0 rows `row_bytes` apart).
using Q8_0GemvFn = void (*)(const Q8Activations& x, const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1,
                            float* y, int64_t ldy);

// nullptr where not compiled in; the caller checks the CPU (avx512f/bw/vl + avx512vnni).
Q8_0GemvFn avx512_vnni_q8_0_gemv();

}  // namespace kiln::kernels::quantized

namespace kiln::kernels {
class KernelRegistry;
// qmatmul (f32 x Q8_0 rows) and dequantize; register_cpu_matmul calls it.
void register_cpu_quantized(KernelRegistry&);
}  // namespace kiln::kernels
