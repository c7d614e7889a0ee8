// Block-quantized weight encodings (MAX's QuantizationEncoding) and their byte layout. A quantized
// weight is a u8 tensor [N, row_bytes]: each of its N rows holds K weights encoded one after another,
// so a row can be gathered like any other (an embedding table) and multiplied in the "transpose_b"
// orientation of a Linear weight ([out, in]) by ops::qmatmul. docs/quantization.md has the details.
//
//   std::vector<uint8_t> row(q8_0_row_bytes(4096));
//   quantize_q8_0(weights_row, 4096, row.data());   // 4352 bytes for 4096 f32 weights
#pragma once

#include <cstdint>
#include <string_view>

namespace kiln::graph {

enum class QuantizationEncoding : uint8_t {
  // GGUF's Q8_0 block, bit for bit: for each 32 consecutive weights of a row, 34 bytes: an IEEE f16
  // scale d (little-endian), then 32 int8 quants q; weight = d * q. Quantizing takes
  // d = max|x| / 127 and q = round(x / d) (half away from zero; d == 0 gives all-zero quants), as
  // ggml does. Rows are K / 32 blocks back to back: K must be a multiple of 32.
  q8_0,
};

inline constexpr int64_t kQ8_0BlockSize = 32;   // weights per block
inline constexpr int64_t kQ8_0BlockBytes = 34;  // f16 scale + 32 int8

std::string_view encoding_name(QuantizationEncoding);         // "q8_0"
QuantizationEncoding parse_encoding(std::string_view);        // ValueError naming the text
int64_t block_size(QuantizationEncoding);                     // weights per block (32)
int64_t block_bytes(QuantizationEncoding);                    // bytes per block (34)

// Bytes of one encoded row of k weights; ValueError naming `what` when k is not a positive multiple
// of the block size ("q_proj.weight: q8_0 needs K to be a multiple of 32, got 100").
int64_t quantized_row_bytes(QuantizationEncoding, int64_t k, std::string_view what = "weight");
// Weights per row of an encoded row of `row_bytes`; ValueError naming `what` when it is not a
// positive multiple of the block bytes.
int64_t quantized_row_elements(QuantizationEncoding, int64_t row_bytes, std::string_view what = "weight");

inline int64_t q8_0_row_bytes(int64_t k) { return k / kQ8_0BlockSize * kQ8_0BlockBytes; }

// One row of k f32 weights (k a multiple of 32) -> q8_0_row_bytes(k) bytes, and back.
void quantize_q8_0(const float* x, int64_t k, uint8_t* out);
void dequantize_q8_0(const uint8_t* row, int64_t k, float* out);

}  // namespace kiln::graph
