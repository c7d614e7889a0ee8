// Grouped-query causal self-attention with rotary embeddings and a KV cache (Llama, Mistral, Qwen 2/3,
// Gemma 2/3, Phi-3: AttentionOptions holds what each adds to Llama's).
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

#include <array>
#include <cstdint>
#include <memory>
#include <optional>

#include "kiln/graph/graph.h"
#include "kiln/nn/linear.h"
#include "kiln/nn/module.h"
#include "kiln/nn/norm.h"
#include "kiln/nn/rotary_embedding.h"

namespace kiln::nn {

// The two cache buffers of a model: [n_layers, max_seq, n_kv_heads, head_dim] each.
struct KVCache {
  graph::BufferValue k;
  graph::BufferValue v;
};

// How one attention layer differs from Llama's; the defaults are Llama's.
struct AttentionOptions {
  bool qk_norm = false;           // Qwen 3, Gemma 3: RMSNorm "q_norm", "k_norm" [head_dim] on each head, before RoPE
  bool norm_unit_offset = false;  // those norms scale by (1 + weight) (Gemma 3)
  double norm_eps = 1e-6;
  bool fused_qkv = false;         // Phi-3: one "qkv_proj" [(heads + 2 * kv_heads) * head_dim, hidden]
  int64_t sliding_window = 0;     // > 0: a query sees only the last sliding_window positions (its own included)
  bool local_rope = false;        // rotate with the context's local tables (Gemma 3's sliding layers)
  double scale = 0;               // 0: 1 / sqrt(head_dim) (Gemma: query_pre_attn_scalar^-1/2)
  double logit_softcap = 0;       // > 0: scores become softcap * tanh(score / softcap) (Gemma 2)
};

// What every attention layer of one forward call shares, built once per graph.
struct AttentionContext {
  KVCache cache;
  graph::Dim start;           // position of the first new token: total - seq
  graph::Dim total;           // past + new tokens
  graph::TensorValue cos;     // [seq, rotary_dim] rope tables for positions start .. total-1
  graph::TensorValue sin;     // [seq, rotary_dim]
  graph::TensorValue masked;  // bool [seq, total]: true where a query must not see a key
  int64_t window = 0;                // the sliding window masked_window applies; 0: none
  graph::TensorValue masked_window;  // masked, and also every key window or more positions before the query
  graph::TensorValue local_cos;      // the local rope's tables, when there is one (else invalid)
  graph::TensorValue local_sin;
};

// positions = [start, total); a key is masked when it lies after the query or its attention_mask
// entry is 0. `seq` is the new tokens' count; attention_mask is integer or bool [total]. window > 0
// adds masked_window for the sliding layers (key j hidden from query i when i - j >= window, as
// Hugging Face's sliding_window_overlay); local_rope adds local_cos / local_sin.
AttentionContext make_attention_context(const KVCache& cache, const graph::TensorValue& attention_mask,
                                        graph::Dim seq, const RotaryEmbedding& rope, int64_t window = 0,
                                        const RotaryEmbedding* local_rope = nullptr);

// The core of one attention layer after its projections, shared by AttentionWithRope and the
// tensor-parallel attention: q_rows [seq, heads * head_dim], k_rows / v_rows [seq, kv_heads * head_dim]
// -> rope on q and k, this call's keys and values appended to row `layer` of ctx.cache, then the
// fused attention over the whole history -> [seq, heads * head_dim] (before o_proj).
graph::TensorValue attend_with_cache(const graph::TensorValue& q_rows, const graph::TensorValue& k_rows,
                                     const graph::TensorValue& v_rows, int64_t layer, int64_t heads,
                                     int64_t kv_heads, int64_t head_dim, const AttentionContext& ctx,
                                     const AttentionOptions& options = {});

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
  graph::TensorValue cos;           // [tokens, rotary_dim] rope tables at each token's position
  graph::TensorValue sin;
  graph::TensorValue local_cos;     // the local rope's, when there is one (else invalid)
  graph::TensorValue local_sin;
};

PagedAttentionContext make_paged_attention_context(const PagedKVCache& cache, const graph::TensorValue& positions,
                                                   const graph::TensorValue& seq_ids, const graph::TensorValue& slots,
                                                   const graph::TensorValue& block_tables,
                                                   const RotaryEmbedding& rope,
                                                   const RotaryEmbedding* local_rope = nullptr);

// attend_with_cache for a paged cache: rope, this call's keys and values stored at their slots of
// layer `layer`, then paged attention -> [tokens, heads * head_dim] (before o_proj).
graph::TensorValue attend_paged(const graph::TensorValue& q_rows, const graph::TensorValue& k_rows,
                                const graph::TensorValue& v_rows, int64_t layer, int64_t heads, int64_t kv_heads,
                                int64_t head_dim, const PagedAttentionContext& ctx,
                                const AttentionOptions& options = {});

class AttentionWithRope : public Module {
 public:
  // Weights "q_proj", "k_proj", "v_proj" (with bias when has_bias, as Qwen2; or one "qkv_proj" with
  // options.fused_qkv) and "o_proj" (no bias); "q_norm", "k_norm" with options.qk_norm.
  // n_heads must be a multiple of n_kv_heads; layer_index selects the cache row. ValueError otherwise.
  // `weight_formats`: how the projections store their weights, a model-wide choice
  // (model_weight_format in weight_format.h) with exceptions by name ("v_proj.weight"); nullopt: in
  // `dtype`.
  AttentionWithRope(int64_t layer_index, int64_t hidden_dim, int64_t n_heads, int64_t n_kv_heads,
                    int64_t head_dim, DType dtype = DType::f32, bool has_bias = false,
                    DeviceRef device = DeviceRef::CPU(),
                    const LayerWeightFormats& weight_formats = std::nullopt, AttentionOptions options = {});

  // x [seq, hidden_dim] -> [seq, hidden_dim]. Writes this layer's keys and values into the cache.
  graph::TensorValue operator()(const graph::TensorValue& x, const AttentionContext& ctx) const;
  // x [tokens, hidden_dim] of a ragged batch -> [tokens, hidden_dim], through the paged cache.
  graph::TensorValue operator()(const graph::TensorValue& x, const PagedAttentionContext& ctx) const;

  int64_t layer_index() const { return layer_index_; }
  int64_t n_heads() const { return n_heads_; }
  int64_t n_kv_heads() const { return n_kv_heads_; }
  int64_t head_dim() const { return head_dim_; }
  const AttentionOptions& options() const { return options_; }

 private:
  // x -> q_rows [seq, heads * head_dim], k_rows and v_rows [seq, kv_heads * head_dim], q/k-normed.
  std::array<graph::TensorValue, 3> project(const graph::TensorValue& x) const;

  int64_t layer_index_;
  int64_t n_heads_;
  int64_t n_kv_heads_;
  int64_t head_dim_;
  AttentionOptions options_;
  std::shared_ptr<Linear> q_proj_;    // null when fused
  std::shared_ptr<Linear> k_proj_;
  std::shared_ptr<Linear> v_proj_;
  std::shared_ptr<Linear> qkv_proj_;  // null unless fused
  std::shared_ptr<Linear> o_proj_;
  std::shared_ptr<RMSNorm> q_norm_;   // null unless qk_norm
  std::shared_ptr<RMSNorm> k_norm_;
};

}  // namespace kiln::nn
