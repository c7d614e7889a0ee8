// Block-quantized weight encodings (MAX's QuantizationEncoding) and their byte layout. A quantized
// weight is a u8 tensor [N, row_bytes]: each of its N rows holds K weights encoded one after another,
// so a row can be gathered like any other (an embedding table) and multiplied in the "transpose_b"
// orientation of a Linear weight ([out, in]) by ops::qmatmul. docs/quantization.md has the details.
//
//   std::vector<uint8_t> row(quantized_row_bytes(QuantizationEncoding::q4_k, 4096));  // 2304 bytes
//   quantize_row(QuantizationEncoding::q4_k, weights_row, 4096, row.data());
//   dequantize_row(QuantizationEncoding::q4_k, row.data(), 4096, back);
#pragma once

#include <cstdint>
#include <string_view>

namespace kiln::graph {

// Each encoding is GGUF's (ggml-common.h) block of the same name, bit for bit, so a GGUF file's
// tensors bind without repacking. All multi-byte fields are little-endian; f16 is IEEE half.
enum class QuantizationEncoding : uint8_t {
  // Q8_0: per 32 weights, 34 bytes: f16 scale d, then 32 int8 quants q; weight = d * q.
  // Quantizing: d = max|x| / 127, q = round(x / d) (half away from zero; d == 0: all-zero quants).
  q8_0,
  // Q4_0: per 32 weights, 18 bytes: f16 d, then 16 bytes whose low nibbles are weights 0..15 and
  // high nibbles weights 16..31; weight = d * (nibble - 8).
  q4_0,
  // Q4_K: per 256 weights (8 sub-blocks of 32), 144 bytes: f16 d, f16 dmin, 12 bytes packing eight
  // 6-bit scales sc and eight 6-bit mins m, then 128 bytes of 4-bit quants q. Byte l of the 32 bytes
  // of pair p (p = 0..3) holds weight l of sub-block 2p in its low nibble, of 2p + 1 in its high one.
  // weight = (d * sc_j) * q - (dmin * m_j). The 12 bytes b: for j < 4, sc_j = b[j] & 63 and
  // m_j = b[j + 4] & 63; for j >= 4, sc_j = (b[j + 4] & 15) | (b[j - 4] >> 6) << 4 and
  // m_j = (b[j + 4] >> 4) | (b[j] >> 6) << 4.
  q4_k,
  // Q5_K: 176 bytes per 256 weights: Q4_K's d, dmin and 12 scale bytes, then 32 bytes qh of high
  // bits, then Q4_K's 128 bytes of low nibbles. Weight l of sub-block j adds 16 when bit j of qh[l]
  // is set: quants 0..31.
  q5_k,
  // Q6_K: 210 bytes per 256 weights (16 sub-blocks of 16): 128 bytes ql of low nibbles, 64 bytes qh
  // of 2-bit high parts, 16 int8 scales, f16 d. In half h (128 weights) and l = 0..31, with
  // L = ql + 64h, H = qh + 32h: weight l is L[l] & 15 | (H[l] & 3) << 4, l + 32 is
  // L[l + 32] & 15 | (H[l] >> 2 & 3) << 4, l + 64 is L[l] >> 4 | (H[l] >> 4 & 3) << 4, l + 96 is
  // L[l + 32] >> 4 | (H[l] >> 6) << 4; weight = (d * scale[i / 16]) * (q - 32), i its index in the block.
  q6_k,
};

inline constexpr QuantizationEncoding kAllEncodings[] = {QuantizationEncoding::q8_0, QuantizationEncoding::q4_0,
                                                         QuantizationEncoding::q4_k, QuantizationEncoding::q5_k,
                                                         QuantizationEncoding::q6_k};

inline constexpr int64_t kQ8_0BlockSize = 32;   // weights per block
inline constexpr int64_t kQ8_0BlockBytes = 34;  // f16 scale + 32 int8
inline constexpr int64_t kQ4_0BlockBytes = 18;  // f16 scale + 16 bytes of nibbles
inline constexpr int64_t kKQuantBlockSize = 256;  // QK_K: the super-block of q4_k, q5_k, q6_k
inline constexpr int64_t kQ4_KBlockBytes = 144;
inline constexpr int64_t kQ5_KBlockBytes = 176;
inline constexpr int64_t kQ6_KBlockBytes = 210;

std::string_view encoding_name(QuantizationEncoding);         // "q8_0", "q4_0", "q4_k", "q5_k", "q6_k"
QuantizationEncoding parse_encoding(std::string_view);        // ValueError naming the text
int64_t block_size(QuantizationEncoding);                     // weights per block (32 or 256)
int64_t block_bytes(QuantizationEncoding);                    // bytes per block (34, 18, 144, 176, 210)

// Bytes of one encoded row of k weights; ValueError naming `what` when k is not a positive multiple
// of the block size ("q_proj.weight: q8_0 needs K to be a multiple of 32, got 100").
int64_t quantized_row_bytes(QuantizationEncoding, int64_t k, std::string_view what = "weight");
// Weights per row of an encoded row of `row_bytes`; ValueError naming `what` when it is not a
// positive multiple of the block bytes.
int64_t quantized_row_elements(QuantizationEncoding, int64_t row_bytes, std::string_view what = "weight");

inline int64_t q8_0_row_bytes(int64_t k) { return k / kQ8_0BlockSize * kQ8_0BlockBytes; }

// One row of k f32 weights (k a multiple of the block size; ValueError otherwise) ->
// quantized_row_bytes(encoding, k) bytes, as ggml's reference quantizers (quantize_row_*_ref)
// compute them: q8_0 as above; q4_0 with d = -max / 8 (max: the element of largest magnitude,
// sign kept); q4_k / q5_k fitting each sub-block's scale and min (make_qkx2_quants) and q6_k each
// sub-block's scale (make_qx_quants), then the 6- or 8-bit scales against one f16 per block.
// NaNs give some in-range quant, never undefined behaviour.
void quantize_row(QuantizationEncoding, const float* x, int64_t k, uint8_t* out);
// An encoded row of k weights -> k f32 values, bit-identical to ggml's dequantize_row_* (the same f32
// operations in the same order: q4_k's (d * sc) * q - (dmin * m), unfused).
void dequantize_row(QuantizationEncoding, const uint8_t* row, int64_t k, float* out);

// quantize_row with its portable loops only, never the SIMD ones it takes where the CPU has them:
// the same bytes (tests compare the two).
void quantize_row_portable(QuantizationEncoding, const float* x, int64_t k, uint8_t* out);

// The eight 6-bit scales and eight 6-bit mins of a Q4_K / Q5_K block from its 12 packed bytes
// (ggml's get_scale_min_k4 for j = 0..7).
void unpack_k_scales(const uint8_t* packed, uint8_t scales[8], uint8_t mins[8]);

// The q8_0 cases of the two above.
void quantize_q8_0(const float* x, int64_t k, uint8_t* out);
void dequantize_q8_0(const uint8_t* row, int64_t k, float* out);

}  // namespace kiln::graph
