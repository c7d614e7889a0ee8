#include "kiln/nn/attention.h"

#include <fmt/format.h>

#include <cmath>

#include "kiln/graph/ops.h"
#include "nn/expect_last_dim.h"

namespace kiln::nn {

namespace ops = graph::ops;
using graph::Dim;
using graph::Shape;
using graph::TensorValue;

namespace {

// Both buffers valid, rank 4 and of one type; returns that type (a copy: adding nodes moves the
// graph's type table).
graph::BufferType checked_cache_type(const KVCache& cache, const char* who) {
  if (!cache.k.valid() || !cache.v.valid())
    throw ValueError(fmt::format("{}: the cache's k and v must be buffer values of the graph", who));
  const auto& k = cache.k.buffer_type();
  const auto& v = cache.v.buffer_type();
  if (k.rank() != 4 || !(k == v))
    throw ShapeError(
        fmt::format("{}: cache k and v must both be buffer<[n_layers, max_seq, n_kv_heads, head_dim]>, "
                    "got {} and {}",
                    who, k.to_string(), v.to_string()));
  return k;
}

}  // namespace

AttentionContext make_attention_context(const KVCache& cache, const TensorValue& attention_mask, Dim seq,
                                        const RotaryEmbedding& rope) {
  const graph::BufferType cache_type = checked_cache_type(cache, "make_attention_context");
  if (!attention_mask.valid() || attention_mask.rank() != 1)
    throw ShapeError(
        fmt::format("make_attention_context: attention_mask must have rank 1 ([total]), got {}",
                    attention_mask.valid() ? attention_mask.tensor_type().to_string() : "an empty value"));
  if (!(cache_type.shape[3] == Dim(rope.head_dim())))
    throw ShapeError(fmt::format("make_attention_context: cache {} has head_dim {}, the rotary embedding {}",
                                 cache_type.to_string(), cache_type.shape[3].to_string(), rope.head_dim()));
  const Dim total = attention_mask.shape()[0];
  const Dim start = total - seq;
  const DeviceRef device = attention_mask.device();

  auto key_positions = ops::range(0, 1, total, DType::i64, device);    // [total]
  auto query_positions = ops::slice(key_positions, {{start, total}});  // [seq]
  auto [cos, sin] = rope.cos_sin(query_positions);                     // [seq, head_dim]
  auto future = ops::greater(ops::reshape(key_positions, Shape{1, total}),
                             ops::reshape(query_positions, Shape{seq, 1}));  // [seq, total]
  TensorValue padding = attention_mask.dtype() == DType::boolean
                            ? ops::logical_not(attention_mask)
                            : ops::equal(attention_mask, ops::constant(0.0, attention_mask.dtype(), device));
  auto masked = ops::logical_or(future, ops::reshape(padding, Shape{1, total}));  // [seq, total]
  return AttentionContext{cache, start, total, cos, sin, masked};
}

TensorValue attend_with_cache(const TensorValue& q_rows, const TensorValue& k_rows, const TensorValue& v_rows,
                              int64_t layer, int64_t heads, int64_t kv_heads, int64_t head_dim,
                              const AttentionContext& ctx) {
  const DType cache_dtype = ctx.cache.k.buffer_type().dtype;
  const DType dtype = q_rows.dtype();
  const Dim seq = q_rows.shape()[0];
  const Dim& total = ctx.total;

  auto q = ops::reshape(q_rows, Shape{seq, heads, head_dim});     // [seq, heads, head_dim]
  auto k = ops::reshape(k_rows, Shape{seq, kv_heads, head_dim});  // [seq, kv_heads, head_dim]
  auto v = ops::reshape(v_rows, Shape{seq, kv_heads, head_dim});
  q = RotaryEmbedding::apply(q, ctx.cos, ctx.sin);
  k = RotaryEmbedding::apply(k, ctx.cos, ctx.sin);

  // Append this call's keys and values, then read the whole history back (the store comes first in
  // program order, which the executor keeps for buffer ops). The cache may hold another dtype than
  // the model computes in (an f32 cache for a bf16 model).
  auto to_cache = [&](const TensorValue& t) {
    auto rows = ops::reshape(t, Shape{1, seq, kv_heads, head_dim});  // [1, seq, kv_heads, head_dim]
    return t.dtype() == cache_dtype ? rows : ops::cast(rows, cache_dtype);
  };
  auto from_cache = [&](const graph::BufferValue& buffer) {
    auto rows = ops::reshape(ops::buffer_load(buffer, {{layer, layer + 1}, {0, total}}),
                             Shape{total, kv_heads, head_dim});  // [total, kv_heads, head_dim]
    return dtype == cache_dtype ? rows : ops::cast(rows, dtype);
  };
  ops::buffer_store(ctx.cache.k, to_cache(k), {{layer, layer + 1}, {ctx.start, total}});
  ops::buffer_store(ctx.cache.v, to_cache(v), {{layer, layer + 1}, {ctx.start, total}});
  auto k_all = from_cache(ctx.cache.k);
  auto v_all = from_cache(ctx.cache.v);

  // Scores, mask, softmax (in f32, as Hugging Face) and the weighted sum in one kernel, which reads
  // each cached row once per kv head; query head h reads kv head h / (heads / kv_heads), as
  // Hugging Face's repeat_kv.
  auto out = ops::attention(q, k_all, v_all, ctx.masked,
                            1.0 / std::sqrt(static_cast<double>(head_dim)));  // [seq, heads, head_dim]
  return ops::reshape(out, Shape{seq, heads * head_dim});
}

namespace {

graph::BufferType checked_paged_cache_type(const PagedKVCache& cache, const char* who) {
  if (!cache.k.valid() || !cache.v.valid())
    throw ValueError(fmt::format("{}: the paged cache's k and v must be buffer values of the graph", who));
  const auto& k = cache.k.buffer_type();
  const auto& v = cache.v.buffer_type();
  if (k.rank() != 5 || !(k == v))
    throw ShapeError(fmt::format(
        "{}: paged cache k and v must both be buffer<[n_layers, num_blocks, block_size, n_kv_heads, head_dim]>, "
        "got {} and {}",
        who, k.to_string(), v.to_string()));
  return k;
}

void expect_token_vector(const TensorValue& t, const char* name) {
  if (!t.valid() || t.rank() != 1 || t.dtype() != DType::i64)
    throw ShapeError(fmt::format("make_paged_attention_context: {} must be i64[tokens], got {}", name,
                                 t.valid() ? t.tensor_type().to_string() : "an empty value"));
}

}  // namespace

PagedAttentionContext make_paged_attention_context(const PagedKVCache& cache, const TensorValue& positions,
                                                   const TensorValue& seq_ids, const TensorValue& slots,
                                                   const TensorValue& block_tables, const RotaryEmbedding& rope) {
  const graph::BufferType cache_type = checked_paged_cache_type(cache, "make_paged_attention_context");
  if (!(cache_type.shape[4] == Dim(rope.head_dim())))
    throw ShapeError(fmt::format("make_paged_attention_context: cache {} has head_dim {}, the rotary embedding {}",
                                 cache_type.to_string(), cache_type.shape[4].to_string(), rope.head_dim()));
  expect_token_vector(positions, "positions");
  expect_token_vector(seq_ids, "seq_ids");
  expect_token_vector(slots, "slots");
  if (!block_tables.valid() || block_tables.rank() != 2 || block_tables.dtype() != DType::i64)
    throw ShapeError(fmt::format("make_paged_attention_context: block_tables must be i64[seqs, max_blocks], got {}",
                                 block_tables.valid() ? block_tables.tensor_type().to_string() : "an empty value"));
  auto [cos, sin] = rope.cos_sin(positions);  // [tokens, head_dim]
  return PagedAttentionContext{cache, positions, seq_ids, slots, block_tables, cos, sin};
}

TensorValue attend_paged(const TensorValue& q_rows, const TensorValue& k_rows, const TensorValue& v_rows,
                         int64_t layer, int64_t heads, int64_t kv_heads, int64_t head_dim,
                         const PagedAttentionContext& ctx) {
  const Dim tokens = q_rows.shape()[0];
  auto q = ops::reshape(q_rows, Shape{tokens, heads, head_dim});
  auto k = ops::reshape(k_rows, Shape{tokens, kv_heads, head_dim});
  auto v = ops::reshape(v_rows, Shape{tokens, kv_heads, head_dim});
  q = RotaryEmbedding::apply(q, ctx.cos, ctx.sin);
  k = RotaryEmbedding::apply(k, ctx.cos, ctx.sin);
  // Stores first (program order, kept for buffer ops), so each token also sees its own K/V and those
  // of the earlier tokens of its chunk.
  ops::paged_kv_store(ctx.cache.k, k, ctx.slots, layer);
  ops::paged_kv_store(ctx.cache.v, v, ctx.slots, layer);
  auto out = ops::paged_attention(q, ctx.cache.k, ctx.cache.v, ctx.block_tables, ctx.seq_ids, ctx.positions, layer,
                                  1.0 / std::sqrt(static_cast<double>(head_dim)));  // [tokens, heads, head_dim]
  return ops::reshape(out, Shape{tokens, heads * head_dim});
}

AttentionWithRope::AttentionWithRope(int64_t layer_index, int64_t hidden_dim, int64_t n_heads,
                                     int64_t n_kv_heads, int64_t head_dim, DType dtype, bool has_bias,
                                     DeviceRef device, std::optional<WeightFormat> weight_format)
    : layer_index_(layer_index), n_heads_(n_heads), n_kv_heads_(n_kv_heads), head_dim_(head_dim) {
  if (layer_index < 0 || hidden_dim <= 0 || n_heads <= 0 || n_kv_heads <= 0 || head_dim <= 0 ||
      n_heads % n_kv_heads != 0)
    throw ValueError(fmt::format(
        "AttentionWithRope: need layer_index >= 0, positive dims and n_heads a multiple of n_kv_heads; got "
        "layer_index {}, hidden_dim {}, n_heads {}, n_kv_heads {}, head_dim {}",
        layer_index, hidden_dim, n_heads, n_kv_heads, head_dim));
  const std::optional<WeightFormat> in_format = model_weight_format(weight_format, hidden_dim);
  q_proj_ = register_module(
      "q_proj", std::make_shared<Linear>(hidden_dim, n_heads * head_dim, dtype, has_bias, device, in_format));
  k_proj_ = register_module("k_proj", std::make_shared<Linear>(hidden_dim, n_kv_heads * head_dim, dtype,
                                                               has_bias, device, in_format));
  v_proj_ = register_module("v_proj", std::make_shared<Linear>(hidden_dim, n_kv_heads * head_dim, dtype,
                                                               has_bias, device, in_format));
  o_proj_ = register_module("o_proj",
                            std::make_shared<Linear>(n_heads * head_dim, hidden_dim, dtype, false, device,
                                                     model_weight_format(weight_format, n_heads * head_dim)));
}

TensorValue AttentionWithRope::operator()(const TensorValue& x, const AttentionContext& ctx) const {
  const graph::BufferType cache_type = checked_cache_type(ctx.cache, "AttentionWithRope");
  const Shape& cs = cache_type.shape;
  auto n_layers = cs[0].try_static();
  if (!n_layers || layer_index_ >= *n_layers || !(cs[2] == Dim(n_kv_heads_)) || !(cs[3] == Dim(head_dim_)))
    throw ShapeError(
        fmt::format("AttentionWithRope '{}': layer {} with {} kv heads of dim {} does not fit the "
                    "cache {}",
                    path(), layer_index_, n_kv_heads_, head_dim_, cache_type.to_string()));
  if (!x.valid() || x.rank() != 2)
    throw ShapeError(fmt::format("AttentionWithRope '{}': x must be [seq, hidden], got {}", path(),
                                 x.valid() ? x.tensor_type().to_string() : "an empty value"));
  return (*o_proj_)(attend_with_cache((*q_proj_)(x), (*k_proj_)(x), (*v_proj_)(x), layer_index_, n_heads_,
                                       n_kv_heads_, head_dim_, ctx));
}

TensorValue AttentionWithRope::operator()(const TensorValue& x, const PagedAttentionContext& ctx) const {
  const graph::BufferType cache_type = checked_paged_cache_type(ctx.cache, "AttentionWithRope");
  const Shape& cs = cache_type.shape;
  auto n_layers = cs[0].try_static();
  if (!n_layers || layer_index_ >= *n_layers || !(cs[3] == Dim(n_kv_heads_)) || !(cs[4] == Dim(head_dim_)))
    throw ShapeError(fmt::format("AttentionWithRope '{}': layer {} with {} kv heads of dim {} does not fit the "
                                 "paged cache {}",
                                 path(), layer_index_, n_kv_heads_, head_dim_, cache_type.to_string()));
  if (!x.valid() || x.rank() != 2)
    throw ShapeError(fmt::format("AttentionWithRope '{}': x must be [tokens, hidden], got {}", path(),
                                 x.valid() ? x.tensor_type().to_string() : "an empty value"));
  return (*o_proj_)(attend_paged((*q_proj_)(x), (*k_proj_)(x), (*v_proj_)(x), layer_index_, n_heads_, n_kv_heads_,
                                  head_dim_, ctx));
}

}  // namespace kiln::nn
