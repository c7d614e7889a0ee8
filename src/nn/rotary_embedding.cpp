#include "kiln/nn/rotary_embedding.h"

#include <fmt/format.h>

#include <cmath>
#include <numbers>

#include "kiln/graph/ops.h"

namespace kiln::nn {

namespace ops = graph::ops;

namespace {

// Hugging Face's _compute_llama3_parameters, element by element.
double llama3_scaled(double inv_freq, const Llama3RopeScaling& s) {
  const double old_context_len = static_cast<double>(s.original_max_position_embeddings);
  const double low_freq_wavelen = old_context_len / s.low_freq_factor;
  const double high_freq_wavelen = old_context_len / s.high_freq_factor;
  const double wavelen = 2 * std::numbers::pi / inv_freq;
  if (wavelen < high_freq_wavelen) return inv_freq;
  if (wavelen > low_freq_wavelen) return inv_freq / s.factor;
  const double smooth =
      (old_context_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
  return (1 - smooth) * inv_freq / s.factor + smooth * inv_freq;
}

}  // namespace

RotaryEmbedding::RotaryEmbedding(int64_t head_dim, double theta, int64_t max_seq_len,
                                 std::optional<Llama3RopeScaling> scaling, double linear_factor,
                                 const std::vector<double>& freq_factors)
    : head_dim_(head_dim), max_seq_len_(max_seq_len) {
  if (!(linear_factor > 0))
    throw ValueError(fmt::format("RotaryEmbedding: linear_factor must be positive, got {}", linear_factor));
  if (head_dim <= 0 || head_dim % 2 != 0)
    throw ValueError(fmt::format("RotaryEmbedding: head_dim must be even and positive, got {}", head_dim));
  if (!(theta > 0)) throw ValueError(fmt::format("RotaryEmbedding: theta must be positive, got {}", theta));
  if (max_seq_len <= 0)
    throw ValueError(fmt::format("RotaryEmbedding: max_seq_len must be positive, got {}", max_seq_len));
  if (scaling) {
    const auto& s = *scaling;
    if (!(s.factor > 0) || !(s.low_freq_factor > 0) || !(s.high_freq_factor > s.low_freq_factor) ||
        s.original_max_position_embeddings <= 0)
      throw ValueError(fmt::format(
          "RotaryEmbedding: llama3 scaling needs factor > 0, 0 < low_freq_factor < high_freq_factor and "
          "original_max_position_embeddings > 0, got factor {}, low {}, high {}, original {}",
          s.factor, s.low_freq_factor, s.high_freq_factor, s.original_max_position_embeddings));
  }
  if (!freq_factors.empty() && static_cast<int64_t>(freq_factors.size()) != head_dim / 2)
    throw ValueError(fmt::format("RotaryEmbedding: freq_factors has {} values, expected one per frequency ({})",
                                 freq_factors.size(), head_dim / 2));
  for (size_t i = 0; i < freq_factors.size(); ++i)
    if (!(freq_factors[i] > 0 && std::isfinite(freq_factors[i])))
      throw ValueError(fmt::format("RotaryEmbedding: freq_factors[{}] must be a positive number, got {}", i,
                                   freq_factors[i]));
  for (int64_t i = 0; i < head_dim / 2; ++i) {
    double f = 1.0 / std::pow(theta, static_cast<double>(2 * i) / static_cast<double>(head_dim));
    if (!freq_factors.empty()) f /= freq_factors[static_cast<size_t>(i)];
    inv_freq_.push_back((scaling ? llama3_scaled(f, *scaling) : f) / linear_factor);
  }
}

std::pair<graph::TensorValue, graph::TensorValue> RotaryEmbedding::cos_sin(
    const graph::TensorValue& positions) const {
  if (!positions.valid() || positions.rank() != 1)
    throw ShapeError(fmt::format("RotaryEmbedding: positions must have rank 1, got {}",
                                 positions.valid() ? positions.tensor_type().to_string() : "an empty value"));
  const int64_t half = head_dim_ / 2;
  std::vector<float> inv_freq(inv_freq_.begin(), inv_freq_.end());
  auto freq = ops::constant(inv_freq, {1, half}, positions.device());  // [1, half]
  auto pos =
      ops::reshape(ops::cast(positions, DType::f32), graph::Shape{positions.shape()[0], 1});  // [seq, 1]
  auto freqs = pos * freq;                                                                    // [seq, half]
  auto emb = ops::concat({freqs, freqs}, -1);  // [seq, head_dim]
  return {ops::cos(emb), ops::sin(emb)};
}

graph::TensorValue RotaryEmbedding::apply(const graph::TensorValue& x, const graph::TensorValue& cos,
                                          const graph::TensorValue& sin) {
  if (!x.valid() || !cos.valid() || !sin.valid())
    throw ValueError("RotaryEmbedding::apply: x, cos and sin must be values of the graph being built");
  auto head_dim = cos.rank() == 2 ? cos.shape()[1].try_static() : std::nullopt;
  if (!head_dim || *head_dim % 2 != 0 || !(sin.shape() == cos.shape()))
    throw ShapeError(
        fmt::format("RotaryEmbedding::apply: cos and sin must be equal [seq, even head_dim], got {} and {}",
                    cos.tensor_type().to_string(), sin.tensor_type().to_string()));
  const int64_t x_head_dim = x.rank() == 3 ? x.shape()[2].try_static().value_or(-1) : -1;
  if (x.rank() != 3 || !(x.shape()[0] == cos.shape()[0]) || x_head_dim < *head_dim)
    throw ShapeError(fmt::format("RotaryEmbedding::apply: x must be [{}, heads, >= {}] to match cos, got {}",
                                 cos.shape()[0].to_string(), *head_dim, x.tensor_type().to_string()));
  if (x_head_dim > *head_dim) {
    auto parts = ops::split(x, {*head_dim, x_head_dim - *head_dim}, 2);  // rotated, passed through
    return ops::concat({apply(parts[0], cos, sin), parts[1]}, 2);
  }
  // x * cos + rotate_half(x) * sin in one op (ops::rope): the same bits as the split, neg, concat and
  // elementwise ops it stands for, in one kernel launch instead of four.
  if (x.dtype() != DType::f32) return ops::rope(x, ops::cast(cos, x.dtype()), ops::cast(sin, x.dtype()));
  return ops::rope(x, cos, sin);
}

graph::TensorValue RotaryEmbedding::operator()(const graph::TensorValue& x,
                                               const graph::TensorValue& positions) const {
  auto [c, s] = cos_sin(positions);
  return apply(x, c, s);
}

}  // namespace kiln::nn
