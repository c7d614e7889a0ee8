// The portable GEMVs of Q4_0, Q4_K, Q5_K and Q6_K (quantized.h's last section): the definition the
// SIMD kernels (quantized_avx2.cpp) compute in another order. Plain loops over the GGUF blocks, each
// weight block's product with the int8 activations an exact int32 before the f32 scaling.
#include <cstring>

#include "kernels/cpu/quantized.h"
#include "kiln/graph/dtype.h"

namespace kiln::kernels::quantized {
namespace {

using graph::QuantizationEncoding;

float load_f16(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return f16_to_f32(bits);
}

const int8_t* activations(const Q8Activations& x, int64_t m) {
  return reinterpret_cast<const int8_t*>(x.x) + m * x.K;
}

void gemv_q4_0(const Q8Activations& x, const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1, float* y,
               int64_t ldy) {
  const int64_t blocks = x.K / 32;
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t m = 0; m < x.M; ++m) {
      float sum = 0.0f;
      for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* block = w + n * row_bytes + b * graph::kQ4_0BlockBytes;
        const int8_t* xq = activations(x, m) + b * 32;
        int32_t dot = 0;
        for (int j = 0; j < 16; ++j) dot += (block[2 + j] & 0xF) * xq[j] + (block[2 + j] >> 4) * xq[j + 16];
        dot -= 8 * x.sum[m * blocks + b];
        sum += static_cast<float>(dot) * (load_f16(block) * x.d[m * blocks + b]);
      }
      y[m * ldy + n] = sum;
    }
}

// Q4_K, and Q5_K (kFive: the high bits of qh added, levels 0..31). Activations per 256 (x.d one
// scale per super-block).
template <bool kFive>
void gemv_q4_k_q5_k(const Q8Activations& x, const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1, float* y,
                    int64_t ldy) {
  const int64_t supers = x.K / graph::kKQuantBlockSize;
  const int64_t bytes = kFive ? graph::kQ5_KBlockBytes : graph::kQ4_KBlockBytes;
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t m = 0; m < x.M; ++m) {
      float scaled = 0.0f, mins = 0.0f;
      for (int64_t s = 0; s < supers; ++s) {
        const uint8_t* block = w + n * row_bytes + s * bytes;
        uint8_t sc[8], mn[8];
        graph::unpack_k_scales(block + 4, sc, mn);
        const uint8_t* qh = block + 16;
        const uint8_t* q = block + (kFive ? 48 : 16);
        const int8_t* xq = activations(x, m) + s * 256;
        int32_t dots = 0, min_sums = 0;  // sum_j sc_j dot_j and sum_j m_j sum_j(q_x): exact
        for (int j = 0; j < 8; ++j) {
          int32_t dot = 0;
          for (int l = 0; l < 32; ++l) {
            const uint8_t byte = q[32 * (j / 2) + l];
            int level = j % 2 ? byte >> 4 : byte & 0xF;
            if (kFive) level |= ((qh[l] >> j) & 1) << 4;
            dot += level * xq[32 * j + l];
          }
          dots += sc[j] * dot;
          min_sums += mn[j] * x.sum[(m * supers + s) * 8 + j];
        }
        const float dx = x.d[m * supers + s];
        scaled += load_f16(block) * dx * static_cast<float>(dots);
        mins += load_f16(block + 2) * dx * static_cast<float>(min_sums);
      }
      y[m * ldy + n] = scaled - mins;
    }
}

// Q6_K's level (0..63) of weight i (0..255) of a block: its nibble in ql and 2 bits in qh.
int q6_k_level(const uint8_t* block, int i) {
  const int half = i / 128, t = i % 128 / 32, l = i % 32;
  const uint8_t* ql = block + 64 * half;
  const uint8_t h = block[128 + 32 * half + l];
  const int low = t % 2 ? ql[l + 32] : ql[l];
  return (t < 2 ? low & 0xF : low >> 4) | ((h >> (2 * t)) & 3) << 4;
}

void gemv_q6_k(const Q8Activations& x, const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1, float* y,
               int64_t ldy) {
  const int64_t supers = x.K / graph::kKQuantBlockSize;
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t m = 0; m < x.M; ++m) {
      float sum = 0.0f;
      for (int64_t s = 0; s < supers; ++s) {
        const uint8_t* block = w + n * row_bytes + s * graph::kQ6_KBlockBytes;
        const auto* scales = reinterpret_cast<const int8_t*>(block + 192);
        const int8_t* xq = activations(x, m) + s * 256;
        int32_t dot = 0;  // |dot| <= 256 * 128 * 32 * 127
        for (int i = 0; i < 256; ++i) dot += scales[i / 16] * (q6_k_level(block, i) - 32) * xq[i];
        sum += load_f16(block + 208) * x.d[m * supers + s] * static_cast<float>(dot);
      }
      y[m * ldy + n] = sum;
    }
}

}  // namespace

QGemvFn portable_block_gemv(QuantizationEncoding e) {
  switch (e) {
    case QuantizationEncoding::q4_0: return gemv_q4_0;
    case QuantizationEncoding::q4_k: return gemv_q4_k_q5_k<false>;
    case QuantizationEncoding::q5_k: return gemv_q4_k_q5_k<true>;
    case QuantizationEncoding::q6_k: return gemv_q6_k;
    case QuantizationEncoding::q8_0: break;
  }
  return nullptr;
}

}  // namespace kiln::kernels::quantized
