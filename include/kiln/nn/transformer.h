// Llama-family decoder-only transformers (Llama 2/3, SmolLM, Mistral, Qwen 2/3, Gemma 2/3, Phi-3), with
// Hugging Face's weight names so checkpoints load unchanged:
//   model.embed_tokens.weight, model.layers.N.self_attn.{q,k,v,o}_proj.weight,
//   model.layers.N.mlp.{gate,up,down}_proj.weight, model.layers.N.{input,post_attention}_layernorm.weight,
//   model.norm.weight, lm_head.weight (absent when tie_word_embeddings: embed_tokens' table is used).
// Each other architecture is this one model with a few LlamaConfig fields set (see there): q/k norms
// (self_attn.{q,k}_norm.weight), Gemma's extra norms (pre/post_feedforward_layernorm), Phi-3's fused
// self_attn.qkv_proj and mlp.gate_up_proj.
// The graph's inputs are input_tree() (see attention.h for the KV cache convention); its output is the
// logits f32[seq, vocab_size] for every new token.
//
//   auto model = std::make_shared<nn::Transformer>(config);
//   pipelines::GraphSpec spec{.module = model, .name = "llama", .input_types = *model->input_tree()};
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "kiln/nn/attention.h"
#include "kiln/nn/embedding.h"
#include "kiln/nn/linear.h"
#include "kiln/nn/mlp.h"
#include "kiln/nn/module.h"
#include "kiln/nn/norm.h"
#include "kiln/nn/rotary_embedding.h"

namespace kiln::nn {

// The fields of a Hugging Face LlamaConfig (config.json) that shape the model.
struct LlamaConfig {
  int64_t vocab_size = 32000;
  int64_t hidden_size = 4096;
  int64_t intermediate_size = 11008;
  int64_t num_hidden_layers = 32;
  int64_t num_attention_heads = 32;
  int64_t num_key_value_heads = 32;
  std::optional<int64_t> head_dim;  // nullopt: hidden_size / num_attention_heads
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  std::optional<Llama3RopeScaling> rope_scaling;  // "rope_type": "llama3"
  // One divisor per rotary frequency (GGUF's rope_freqs.weight: how llama.cpp's converter writes
  // Llama 3's scaling); empty: none. Not with rope_scaling.
  std::vector<double> rope_freq_factors;
  int64_t max_position_embeddings = 2048;
  bool tie_word_embeddings = false;
  bool attention_bias = false;  // bias on q, k, v projections (Qwen2)
  DType dtype = DType::f32;
  // How the Linear and Embedding weights are stored (nn/weight_format.h); nullopt: in `dtype`. A
  // format other than dtype's needs dtype f32. Not a config.json field: a run-time choice.
  std::optional<WeightFormat> weight_format;
  // Exceptions to weight_format by full weight name, such as {"model.layers.0.mlp.down_proj.weight",
  // q6_k} (a GGUF Q4_K_M file's mix); each must name a matrix of the model (Transformer's ValueError).
  WeightFormatMap weight_formats;

  // What the other architectures add to Llama's; the defaults are Llama's.
  std::optional<int64_t> sliding_window;  // Mistral, Qwen 2/3, Gemma, Phi-3: keys within the last N positions
  std::vector<bool> sliding_layers;       // which layers have the window; empty: every layer
  bool qk_norm = false;                   // Qwen 3, Gemma 3: RMSNorm of each head's q and k before RoPE
  bool norm_unit_offset = false;          // Gemma: every RMSNorm scales by (1 + weight)
  bool sandwich_norms = false;            // Gemma 2/3: post_attention_layernorm on the attention's output,
                                          // pre/post_feedforward_layernorm around the MLP
  MLPActivation hidden_activation = MLPActivation::swiglu;  // or geglu_tanh (Gemma)
  bool scale_embeddings = false;          // Gemma: embeddings times sqrt(hidden_size), in dtype
  std::optional<double> query_pre_attn_scalar;    // Gemma: attention scale query_pre_attn_scalar^-1/2
  std::optional<double> attn_logit_softcapping;   // Gemma 2: scores capped by softcap * tanh(s / softcap)
  std::optional<double> final_logit_softcapping;  // Gemma 2: logits likewise
  std::optional<double> rope_local_theta;  // Gemma 3: the sliding layers' rope base (unscaled); rope_theta the others'
  double rope_linear_factor = 1.0;         // "rope_type": "linear" (Gemma 3): frequencies divided by it
  double partial_rotary_factor = 1.0;      // Phi-3: RoPE on the first head_dim * factor dims of each head
  bool fused_projections = false;          // Phi-3: self_attn.qkv_proj and mlp.gate_up_proj

  int64_t rotary_dim() const {
    return static_cast<int64_t>(static_cast<double>(resolved_head_dim()) * partial_rotary_factor);
  }
  bool is_sliding(int64_t layer) const {
    return sliding_window && (sliding_layers.empty() || sliding_layers[static_cast<size_t>(layer)]);
  }

  int64_t resolved_head_dim() const { return head_dim.value_or(hidden_size / num_attention_heads); }
  // ValueError naming the first field that is inconsistent (non-positive sizes, heads not dividing).
  void validate() const;
};

// Pre-norm residual block: h = x + attn(norm(x)); out = h + mlp(norm(h)). With sandwich_norms (Gemma):
// h = x + post_attention_norm(attn(input_norm(x))); out = h + post_feedforward_norm(mlp(pre_feedforward_norm(h))).
class TransformerBlock : public Module {
 public:
  TransformerBlock(const LlamaConfig& config, int64_t layer_index);
  graph::TensorValue operator()(const graph::TensorValue& x,
                                const AttentionContext& ctx) const;  // [seq, hidden]
  graph::TensorValue operator()(const graph::TensorValue& x,
                                const PagedAttentionContext& ctx) const;  // [tokens, hidden]

 private:
  std::shared_ptr<RMSNorm> input_layernorm_;
  std::shared_ptr<AttentionWithRope> self_attn_;
  std::shared_ptr<RMSNorm> post_attention_layernorm_;
  std::shared_ptr<RMSNorm> pre_feedforward_layernorm_;   // null unless sandwich_norms
  std::shared_ptr<RMSNorm> post_feedforward_layernorm_;  // null unless sandwich_norms
  std::shared_ptr<MLP> mlp_;
  template <class Ctx> graph::TensorValue apply(const graph::TensorValue& x, const Ctx& ctx) const;
};

// Hugging Face's LlamaModel (the "model." prefix): embeddings, blocks, final norm.
class TransformerModel : public Module {
 public:
  explicit TransformerModel(const LlamaConfig& config);
  // tokens [seq] -> final hidden states [seq, hidden].
  graph::TensorValue operator()(const graph::TensorValue& tokens, const AttentionContext& ctx) const;
  graph::TensorValue operator()(const graph::TensorValue& tokens, const PagedAttentionContext& ctx) const;
  const Embedding& embed_tokens() const { return *embed_tokens_; }

 private:
  graph::TensorValue embed(const graph::TensorValue& tokens) const;

  bool scale_embeddings_;
  int64_t hidden_size_;
  std::shared_ptr<Embedding> embed_tokens_;
  std::shared_ptr<ModuleList<TransformerBlock>> layers_;
  std::shared_ptr<RMSNorm> norm_;
};

// Hugging Face's LlamaForCausalLM.
// Which positions get logits (MAX's ReturnLogits): every position, or only the last, which is all
// that generation samples from. The last-token head skips the vocabulary projection of every other
// prompt position (for stories15M, 60% of a 128-token prefill's FLOPs).
enum class ReturnLogits { all, last_token };

// The paged KV cache's shape for a ragged-batch model (attention.h): blocks of block_size positions,
// KV stored in dtype (f32, bf16 or f16). The number of blocks is the symbolic dim "num_blocks", so
// one compiled graph serves any cache size.
struct PagedKVLayout {
  int64_t block_size = 16;
  DType dtype = DType::f32;
};

class Transformer : public Module {
 public:
  // max_seq_len: the cache's length (0: max_position_embeddings). ValueError on a bad config.
  explicit Transformer(const LlamaConfig& config, int64_t max_seq_len = 0,
                       ReturnLogits return_logits = ReturnLogits::all);
  // The ragged-batch model over a paged cache (continuous batching): input_tree() is the paged
  // convention of attention.h and the output the logits f32[rows, vocab_size] of the tokens that
  // "logit_rows" names. max_seq_len: the longest sequence (0: max_position_embeddings).
  Transformer(const LlamaConfig& config, PagedKVLayout paged, int64_t max_seq_len = 0);

  // {"tokens": i64[seq], "attention_mask": i64[total],
  //  "cache": {"k": buffer<f32[layers, max_seq, kv_heads, head_dim]>, "v": same}}
  std::optional<TypeTree> input_tree() const override;
  // args: the one tree of input_tree(). Returns the logits f32[seq, vocab_size] (a leaf), or
  // f32[1, vocab_size] for the last position with ReturnLogits::last_token.
  Values forward(const std::vector<Values>& args) override;
  graph::TensorValue operator()(const graph::TensorValue& tokens, const graph::TensorValue& attention_mask,
                                const KVCache& cache) const;
  // The paged form: tokens, positions, seq_ids, slots i64[tokens], block_tables i64[seqs, max_blocks],
  // logit_rows i64[rows] -> logits f32[rows, vocab_size].
  graph::TensorValue operator()(const graph::TensorValue& tokens, const graph::TensorValue& positions,
                                const graph::TensorValue& seq_ids, const graph::TensorValue& slots,
                                const graph::TensorValue& block_tables, const graph::TensorValue& logit_rows,
                                const PagedKVCache& cache) const;

  const LlamaConfig& config() const { return config_; }
  const std::optional<PagedKVLayout>& paged() const { return paged_; }
  int64_t max_seq_len() const { return max_seq_len_; }
  ReturnLogits return_logits() const { return return_logits_; }
  const RotaryEmbedding& rope() const { return rope_; }

 private:
  graph::TensorValue head(const graph::TensorValue& h) const;  // [rows, hidden] -> f32 logits [rows, vocab]

  LlamaConfig config_;
  int64_t max_seq_len_;
  ReturnLogits return_logits_;
  std::optional<PagedKVLayout> paged_;
  RotaryEmbedding rope_;
  std::optional<RotaryEmbedding> local_rope_;  // Gemma 3's sliding layers
  std::shared_ptr<TransformerModel> model_;
  std::shared_ptr<Linear> lm_head_;  // null when tied
};

}  // namespace kiln::nn
