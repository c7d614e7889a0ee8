// Rotary position embedding (RoPE) in Hugging Face Llama's "rotate_half" form: the head dim is two
// halves [x1, x2] rotated as pairs (x1[i], x2[i]) by angle position * inv_freq[i]:
//   y = x * cos + rotate_half(x) * sin,  rotate_half(x) = [-x2, x1],
//   cos = cos([freqs, freqs]), sin = sin([freqs, freqs]), freqs = position * inv_freq  // [seq, head_dim/2]
// The inverse frequencies are computed on the host in double (with Llama 3's scaling if given) and
// enter the graph as a constant; cos and sin are computed in the graph from the positions.
//
//   nn::RotaryEmbedding rope(128, 500000.0, 8192, nn::Llama3RopeScaling{8, 1, 4, 8192});
//   auto [cos, sin] = rope.cos_sin(positions);  // positions i64[seq] -> f32[seq, 128] each
//   q = rope.apply(q, cos, sin);                // q [seq, heads, 128]
#pragma once

#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "kiln/graph/graph.h"

namespace kiln::nn {

// Llama 3.x's frequency scaling ("rope_type": "llama3" in config.json), as Hugging Face's
// _compute_llama3_parameters: wavelengths above original/low_freq_factor are divided by factor, those
// below original/high_freq_factor are kept, and those between are interpolated smoothly.
struct Llama3RopeScaling {
  double factor = 8.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  int64_t original_max_position_embeddings = 8192;
};

// Holds no weights: a plain object the attention layers share.
class RotaryEmbedding {
 public:
  // head_dim (the rotated dims: less than the attention head's with a partial_rotary_factor) must be
  // even and positive; theta > 0; linear_factor > 0 divides every frequency ("rope_type": "linear",
  // Gemma 3's global layers); freq_factors, when given, one positive number per frequency that
  // divides it (GGUF's rope_freqs.weight, llama.cpp's form of Llama 3's scaling). ValueError otherwise.
  RotaryEmbedding(int64_t head_dim, double theta, int64_t max_seq_len,
                  std::optional<Llama3RopeScaling> scaling = std::nullopt, double linear_factor = 1.0,
                  const std::vector<double>& freq_factors = {});

  // [head_dim / 2] inverse frequencies, in double, scaled if scaling is set.
  const std::vector<double>& inv_freq() const { return inv_freq_; }
  int64_t head_dim() const { return head_dim_; }
  int64_t max_seq_len() const { return max_seq_len_; }

  // positions (integer or float) [seq] -> {cos, sin}, each f32 [seq, head_dim].
  std::pair<graph::TensorValue, graph::TensorValue> cos_sin(const graph::TensorValue& positions) const;
  // x [seq, heads, head_dim] with cos, sin [seq, head_dim] -> rotated x (same shape and dtype). Static:
  // the tables carry all it needs, so attention layers apply them without holding the embedding.
  // Tables narrower than x's head_dim rotate its first dims and pass the rest through (Hugging Face's
  // partial rotary, Phi-3's partial_rotary_factor).
  static graph::TensorValue apply(const graph::TensorValue& x, const graph::TensorValue& cos,
                                  const graph::TensorValue& sin);
  // apply(x, cos_sin(positions)).
  graph::TensorValue operator()(const graph::TensorValue& x, const graph::TensorValue& positions) const;

 private:
  int64_t head_dim_;
  int64_t max_seq_len_;
  std::vector<double> inv_freq_;
};

}  // namespace kiln::nn
