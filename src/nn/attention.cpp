#include "kiln/nn/attention.h"

#include <fmt/format.h>

#include <cmath>
#include <tuple>

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

namespace {

// Rope tables as wide as the cache's head dim or narrower (a partial rotary).
void check_rope_width(const Dim& cache_head_dim, const RotaryEmbedding& rope, const std::string& cache, const char* who) {
  const auto hd = cache_head_dim.try_static();
  if (!hd || rope.head_dim() > *hd)
    throw ShapeError(fmt::format("{}: cache {} has head_dim {}, narrower than the rotary embedding's {}", who, cache,
                                 cache_head_dim.to_string(), rope.head_dim()));
}

double scale_of(const AttentionOptions& o, int64_t head_dim) {
  return o.scale > 0 ? o.scale : 1.0 / std::sqrt(static_cast<double>(head_dim));
}

// The tables a layer rotates with: the local rope's for Gemma 3's sliding layers.
std::pair<TensorValue, TensorValue> tables_for(const AttentionOptions& o, const TensorValue& cos, const TensorValue& sin,
                                               const TensorValue& local_cos, const TensorValue& local_sin) {
  if (!o.local_rope) return {cos, sin};
  if (!local_cos.valid())
    throw ValueError("attention: a layer asks for the local rotary embedding, but the context was built without one");
  return {local_cos, local_sin};
}

}  // namespace

AttentionContext make_attention_context(const KVCache& cache, const TensorValue& attention_mask, Dim seq,
                                        const RotaryEmbedding& rope, int64_t window,
                                        const RotaryEmbedding* local_rope) {
  const graph::BufferType cache_type = checked_cache_type(cache, "make_attention_context");
  if (!attention_mask.valid() || attention_mask.rank() != 1)
    throw ShapeError(
        fmt::format("make_attention_context: attention_mask must have rank 1 ([total]), got {}",
                    attention_mask.valid() ? attention_mask.tensor_type().to_string() : "an empty value"));
  check_rope_width(cache_type.shape[3], rope, cache_type.to_string(), "make_attention_context");
  if (local_rope) check_rope_width(cache_type.shape[3], *local_rope, cache_type.to_string(), "make_attention_context");
  if (window < 0) throw ValueError(fmt::format("make_attention_context: window must be >= 0, got {}", window));
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
  AttentionContext ctx{cache, start, total, cos, sin, masked, 0, {}, {}, {}};
  if (window > 0) {
    // Hugging Face's sliding_window_overlay: key j visible from query i iff i - j < window.
    auto distance = ops::reshape(query_positions, Shape{seq, 1}) - ops::reshape(key_positions, Shape{1, total});
    auto old = ops::greater_equal(distance, ops::constant(static_cast<double>(window), DType::i64, device));
    ctx.window = window;
    ctx.masked_window = ops::logical_or(masked, old);  // [seq, total]
  }
  if (local_rope) std::tie(ctx.local_cos, ctx.local_sin) = local_rope->cos_sin(query_positions);
  return ctx;
}

TensorValue attend_with_cache(const TensorValue& q_rows, const TensorValue& k_rows, const TensorValue& v_rows,
                              int64_t layer, int64_t heads, int64_t kv_heads, int64_t head_dim,
                              const AttentionContext& ctx, const AttentionOptions& options) {
  const DType cache_dtype = ctx.cache.k.buffer_type().dtype;
  const DType dtype = q_rows.dtype();
  const Dim seq = q_rows.shape()[0];
  const Dim& total = ctx.total;

  auto q = ops::reshape(q_rows, Shape{seq, heads, head_dim});     // [seq, heads, head_dim]
  auto k = ops::reshape(k_rows, Shape{seq, kv_heads, head_dim});  // [seq, kv_heads, head_dim]
  auto v = ops::reshape(v_rows, Shape{seq, kv_heads, head_dim});
  const auto [cos, sin] = tables_for(options, ctx.cos, ctx.sin, ctx.local_cos, ctx.local_sin);
  q = RotaryEmbedding::apply(q, cos, sin);
  k = RotaryEmbedding::apply(k, cos, sin);
  if (options.sliding_window > 0 && options.sliding_window != ctx.window)
    throw ValueError(fmt::format("attend_with_cache: layer {} has a sliding window of {}, but the context's mask is "
                                 "for a window of {}",
                                 layer, options.sliding_window, ctx.window));

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
  auto out = ops::attention(q, k_all, v_all, options.sliding_window > 0 ? ctx.masked_window : ctx.masked,
                            scale_of(options, head_dim), options.logit_softcap);  // [seq, heads, head_dim]
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
                                                   const TensorValue& block_tables, const RotaryEmbedding& rope,
                                                   const RotaryEmbedding* local_rope) {
  const graph::BufferType cache_type = checked_paged_cache_type(cache, "make_paged_attention_context");
  check_rope_width(cache_type.shape[4], rope, cache_type.to_string(), "make_paged_attention_context");
  if (local_rope)
    check_rope_width(cache_type.shape[4], *local_rope, cache_type.to_string(), "make_paged_attention_context");
  expect_token_vector(positions, "positions");
  expect_token_vector(seq_ids, "seq_ids");
  expect_token_vector(slots, "slots");
  if (!block_tables.valid() || block_tables.rank() != 2 || block_tables.dtype() != DType::i64)
    throw ShapeError(fmt::format("make_paged_attention_context: block_tables must be i64[seqs, max_blocks], got {}",
                                 block_tables.valid() ? block_tables.tensor_type().to_string() : "an empty value"));
  auto [cos, sin] = rope.cos_sin(positions);  // [tokens, rotary_dim]
  PagedAttentionContext ctx{cache, positions, seq_ids, slots, block_tables, cos, sin, {}, {}};
  if (local_rope) std::tie(ctx.local_cos, ctx.local_sin) = local_rope->cos_sin(positions);
  return ctx;
}

TensorValue attend_paged(const TensorValue& q_rows, const TensorValue& k_rows, const TensorValue& v_rows,
                         int64_t layer, int64_t heads, int64_t kv_heads, int64_t head_dim,
                         const PagedAttentionContext& ctx, const AttentionOptions& options) {
  const Dim tokens = q_rows.shape()[0];
  auto q = ops::reshape(q_rows, Shape{tokens, heads, head_dim});
  auto k = ops::reshape(k_rows, Shape{tokens, kv_heads, head_dim});
  auto v = ops::reshape(v_rows, Shape{tokens, kv_heads, head_dim});
  const auto [cos, sin] = tables_for(options, ctx.cos, ctx.sin, ctx.local_cos, ctx.local_sin);
  q = RotaryEmbedding::apply(q, cos, sin);
  k = RotaryEmbedding::apply(k, cos, sin);
  // Stores first (program order, kept for buffer ops), so each token also sees its own K/V and those
  // of the earlier tokens of its chunk.
  ops::paged_kv_store(ctx.cache.k, k, ctx.slots, layer);
  ops::paged_kv_store(ctx.cache.v, v, ctx.slots, layer);
  auto out = ops::paged_attention(q, ctx.cache.k, ctx.cache.v, ctx.block_tables, ctx.seq_ids, ctx.positions, layer,
                                  scale_of(options, head_dim), options.sliding_window,
                                  options.logit_softcap);  // [tokens, heads, head_dim]
  return ops::reshape(out, Shape{tokens, heads * head_dim});
}

AttentionWithRope::AttentionWithRope(int64_t layer_index, int64_t hidden_dim, int64_t n_heads,
                                     int64_t n_kv_heads, int64_t head_dim, DType dtype, bool has_bias,
                                     DeviceRef device, const LayerWeightFormats& formats,
                                     AttentionOptions options)
    : layer_index_(layer_index), n_heads_(n_heads), n_kv_heads_(n_kv_heads), head_dim_(head_dim), options_(options) {
  if (layer_index < 0 || hidden_dim <= 0 || n_heads <= 0 || n_kv_heads <= 0 || head_dim <= 0 ||
      n_heads % n_kv_heads != 0)
    throw ValueError(fmt::format(
        "AttentionWithRope: need layer_index >= 0, positive dims and n_heads a multiple of n_kv_heads; got "
        "layer_index {}, hidden_dim {}, n_heads {}, n_kv_heads {}, head_dim {}",
        layer_index, hidden_dim, n_heads, n_kv_heads, head_dim));
  if (options.sliding_window < 0 || options.scale < 0 || !(options.logit_softcap >= 0))
    throw ValueError(fmt::format("AttentionWithRope: need sliding_window >= 0, scale >= 0 and logit_softcap >= 0; "
                                 "got {}, {} and {}",
                                 options.sliding_window, options.scale, options.logit_softcap));
  if (options.fused_qkv) {
    qkv_proj_ = register_module("qkv_proj", std::make_shared<Linear>(hidden_dim, (n_heads + 2 * n_kv_heads) * head_dim,
                                                                     dtype, has_bias, device,
                                                                     formats.of("qkv_proj.weight", hidden_dim)));
  } else {
    q_proj_ = register_module("q_proj", std::make_shared<Linear>(hidden_dim, n_heads * head_dim, dtype, has_bias,
                                                                 device, formats.of("q_proj.weight", hidden_dim)));
    k_proj_ = register_module("k_proj", std::make_shared<Linear>(hidden_dim, n_kv_heads * head_dim, dtype, has_bias,
                                                                 device, formats.of("k_proj.weight", hidden_dim)));
    v_proj_ = register_module("v_proj", std::make_shared<Linear>(hidden_dim, n_kv_heads * head_dim, dtype, has_bias,
                                                                 device, formats.of("v_proj.weight", hidden_dim)));
  }
  if (options.qk_norm) {
    q_norm_ = register_module("q_norm", std::make_shared<RMSNorm>(head_dim, options.norm_eps, dtype, device,
                                                                  options.norm_unit_offset));
    k_norm_ = register_module("k_norm", std::make_shared<RMSNorm>(head_dim, options.norm_eps, dtype, device,
                                                                  options.norm_unit_offset));
  }
  o_proj_ = register_module("o_proj",
                            std::make_shared<Linear>(n_heads * head_dim, hidden_dim, dtype, false, device,
                                                     formats.of("o_proj.weight", n_heads * head_dim)));
}

std::array<TensorValue, 3> AttentionWithRope::project(const TensorValue& x) const {
  std::array<TensorValue, 3> qkv;
  if (qkv_proj_) {
    // Phi-3's fused projection: q, k and v outputs one after the other.
    auto parts = ops::split((*qkv_proj_)(x), {n_heads_ * head_dim_, n_kv_heads_ * head_dim_, n_kv_heads_ * head_dim_},
                            x.rank() - 1);
    qkv = {parts[0], parts[1], parts[2]};
  } else {
    qkv = {(*q_proj_)(x), (*k_proj_)(x), (*v_proj_)(x)};
  }
  if (q_norm_) {
    // Per head: [seq, heads * head_dim] -> [seq, heads, head_dim], normed over head_dim, and back.
    auto per_head = [&](const TensorValue& rows, int64_t heads, const RMSNorm& norm) {
      const Dim seq = rows.shape()[0];
      return ops::reshape(norm(ops::reshape(rows, Shape{seq, heads, head_dim_})), Shape{seq, heads * head_dim_});
    };
    qkv[0] = per_head(qkv[0], n_heads_, *q_norm_);
    qkv[1] = per_head(qkv[1], n_kv_heads_, *k_norm_);
  }
  return qkv;
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
  const auto [q, k, v] = project(x);
  return (*o_proj_)(attend_with_cache(q, k, v, layer_index_, n_heads_, n_kv_heads_, head_dim_, ctx, options_));
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
  const auto [q, k, v] = project(x);
  return (*o_proj_)(attend_paged(q, k, v, layer_index_, n_heads_, n_kv_heads_, head_dim_, ctx, options_));
}

}  // namespace kiln::nn
