// Grouped-query causal self-attention with rotary embeddings and a KV cache (Llama, Mistral, Qwen2).
//
// KV cache calling convention (batch 1). A model graph takes, as one named tree:
//   {"tokens":         i64[seq]                  the new tokens
//    "attention_mask": i64[total]                as Hugging Face passes it: past + new tokens, 1 = attend,
//                                                0 = padding (masked as a key); its length binds "total"
//    "cache": {"k": buffer<f32[n_layers, max_seq, n_kv_heads, head_dim]>,
//              "v": buffer<same>}}                written in place
// The new tokens sit at positions start .. total-1 with start = total - seq, a symbolic Dim; there
// are no data-dependent shapes. Layer L stores its new keys and values at cache[L, start:total] and
// then attends over cache[L, 0:total]. Rows past `total` are never read, so a fresh (or reused)
// cache needs no clearing; a caller running a new sequence simply starts again with total = seq.
// total > max_seq fails at execute with an out-of-bounds slice error naming buffer_store.
//
//   KVCache cache{inputs["cache"]["k"], inputs["cache"]["v"]};
//   AttentionContext ctx = make_attention_context(cache, attention_mask, seq, rope);  // once per graph
//   h = h + (*attn)(x, ctx);                                                         // per layer
//
// Paged KV cache calling convention (a ragged batch of several sequences: continuous batching,
// docs/batching.md). A model graph takes:
//   {"tokens":       i64[tokens]              the batch's new tokens, sequence after sequence
//    "positions":    i64[tokens]              each token's position in its sequence
//    "seq_ids":      i64[tokens]              each token's row of block_tables
//    "slots":        i64[tokens]              where its K/V go: block * block_size + position % block_size
//    "block_tables": i64[seqs, max_blocks]    each sequence's blocks, in position order
//    "logit_rows":   i64[rows]                the tokens whose logits the graph returns
//    "cache": {"k": buffer<dtype[n_layers, num_blocks, block_size, n_kv_heads, head_dim]>,
//              "v": buffer<same>}}             written in place
// Layer L stores the new keys and values at their slots (ops::paged_kv_store), then each token
// attends to positions 0..its own of its sequence through the block table (ops::paged_attention).
//
//   PagedAttentionContext ctx = make_paged_attention_context(cache, positions, seq_ids, slots,
//                                                            block_tables, rope);
//   h = h + (*attn)(x, ctx);
#pragma once

#include <cstdint>
#include <memory>
#include <optional>

#include "kiln/graph/graph.h"
#include "kiln/nn/linear.h"
#include "kiln/nn/module.h"
#include "kiln/nn/rotary_embedding.h"

namespace kiln::nn {

// The two cache buffers of a model: [n_layers, max_seq, n_kv_heads, head_dim] each.
struct KVCache {
  graph::BufferValue k;
  graph::BufferValue v;
};

// What every attention layer of one forward call shares, built once per graph.
struct AttentionContext {
  KVCache cache;
  graph::Dim start;           // position of the first new token: total - seq
  graph::Dim total;           // past + new tokens
  graph::TensorValue cos;     // [seq, head_dim] rope tables for positions start .. total-1
  graph::TensorValue sin;     // [seq, head_dim]
  graph::TensorValue masked;  // bool [seq, total]: true where a query must not see a key
};

// positions = [start, total); a key is masked when it lies after the query or its attention_mask
// entry is 0. `seq` is the new tokens' count; attention_mask is integer or bool [total].
AttentionContext make_attention_context(const KVCache& cache, const graph::TensorValue& attention_mask,
                                        graph::Dim seq, const RotaryEmbedding& rope);

// The core of one attention layer after its projections, shared by AttentionWithRope and the
// tensor-parallel attention: q_rows [seq, heads * head_dim], k_rows / v_rows [seq, kv_heads * head_dim]
// -> rope on q and k, this call's keys and values appended to row `layer` of ctx.cache, then the
// fused attention over the whole history -> [seq, heads * head_dim] (before o_proj).
graph::TensorValue attend_with_cache(const graph::TensorValue& q_rows, const graph::TensorValue& k_rows,
                                     const graph::TensorValue& v_rows, int64_t layer, int64_t heads,
                                     int64_t kv_heads, int64_t head_dim, const AttentionContext& ctx);

// The two paged cache buffers of a model: [n_layers, num_blocks, block_size, n_kv_heads, head_dim] each.
struct PagedKVCache {
  graph::BufferValue k;
  graph::BufferValue v;
};

// What every attention layer of one ragged forward call shares.
struct PagedAttentionContext {
  PagedKVCache cache;
  graph::TensorValue positions;     // i64[tokens]
  graph::TensorValue seq_ids;       // i64[tokens]
  graph::TensorValue slots;         // i64[tokens]
  graph::TensorValue block_tables;  // i64[seqs, max_blocks]
  graph::TensorValue cos;           // [tokens, head_dim] rope tables at each token's position
  graph::TensorValue sin;
};

PagedAttentionContext make_paged_attention_context(const PagedKVCache& cache, const graph::TensorValue& positions,
                                                   const graph::TensorValue& seq_ids, const graph::TensorValue& slots,
                                                   const graph::TensorValue& block_tables,
                                                   const RotaryEmbedding& rope);

// attend_with_cache for a paged cache: rope, this call's keys and values stored at their slots of
// layer `layer`, then paged attention -> [tokens, heads * head_dim] (before o_proj).
graph::TensorValue attend_paged(const graph::TensorValue& q_rows, const graph::TensorValue& k_rows,
                                const graph::TensorValue& v_rows, int64_t layer, int64_t heads, int64_t kv_heads,
                                int64_t head_dim, const PagedAttentionContext& ctx);

class AttentionWithRope : public Module {
 public:
  // Weights "q_proj", "k_proj", "v_proj" (with bias when has_bias, as Qwen2) and "o_proj" (no bias).
  // n_heads must be a multiple of n_kv_heads; layer_index selects the cache row. ValueError otherwise.
  // `weight_format`: how the projections store their weights, a model-wide choice
  // (model_weight_format in weight_format.h); nullopt: in `dtype`.
  AttentionWithRope(int64_t layer_index, int64_t hidden_dim, int64_t n_heads, int64_t n_kv_heads,
                    int64_t head_dim, DType dtype = DType::f32, bool has_bias = false,
                    DeviceRef device = DeviceRef::CPU(),
                    std::optional<WeightFormat> weight_format = std::nullopt);

  // x [seq, hidden_dim] -> [seq, hidden_dim]. Writes this layer's keys and values into the cache.
  graph::TensorValue operator()(const graph::TensorValue& x, const AttentionContext& ctx) const;
  // x [tokens, hidden_dim] of a ragged batch -> [tokens, hidden_dim], through the paged cache.
  graph::TensorValue operator()(const graph::TensorValue& x, const PagedAttentionContext& ctx) const;

  int64_t layer_index() const { return layer_index_; }
  int64_t n_heads() const { return n_heads_; }
  int64_t n_kv_heads() const { return n_kv_heads_; }
  int64_t head_dim() const { return head_dim_; }

 private:
  int64_t layer_index_;
  int64_t n_heads_;
  int64_t n_kv_heads_;
  int64_t head_dim_;
  std::shared_ptr<Linear> q_proj_;
  std::shared_ptr<Linear> k_proj_;
  std::shared_ptr<Linear> v_proj_;
  std::shared_ptr<Linear> o_proj_;
};

}  // namespace kiln::nn
