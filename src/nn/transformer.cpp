#include "kiln/nn/transformer.h"

#include <fmt/format.h>

#include "kiln/graph/ops.h"

namespace kiln::nn {

namespace ops = graph::ops;
using graph::TensorValue;

void LlamaConfig::validate() const {
  auto positive = [](const char* field, int64_t value) {
    if (value <= 0) throw ValueError(fmt::format("LlamaConfig: {} must be positive, got {}", field, value));
  };
  positive("vocab_size", vocab_size);
  positive("hidden_size", hidden_size);
  positive("intermediate_size", intermediate_size);
  positive("num_hidden_layers", num_hidden_layers);
  positive("num_attention_heads", num_attention_heads);
  positive("num_key_value_heads", num_key_value_heads);
  positive("max_position_embeddings", max_position_embeddings);
  if (num_attention_heads % num_key_value_heads != 0)
    throw ValueError(
        fmt::format("LlamaConfig: num_attention_heads {} is not a multiple of num_key_value_heads {}",
                    num_attention_heads, num_key_value_heads));
  if (!head_dim && hidden_size % num_attention_heads != 0)
    throw ValueError(
        fmt::format("LlamaConfig: hidden_size {} is not a multiple of num_attention_heads {} "
                    "(set head_dim explicitly)",
                    hidden_size, num_attention_heads));
  positive("head_dim", resolved_head_dim());
  if (weight_format && dtype != DType::f32 && weight_format_dtype(*weight_format) != dtype)
    throw ValueError(fmt::format("LlamaConfig: weight_format {} needs dtype f32, got {}",
                                 weight_format_name(*weight_format), dtype_name(dtype)));
  if (resolved_head_dim() % 2 != 0)
    throw ValueError(
        fmt::format("LlamaConfig: head_dim must be even for rotary embeddings, got {}", resolved_head_dim()));
}

// ==== TransformerBlock ==========================================================================

TransformerBlock::TransformerBlock(const LlamaConfig& c, int64_t layer_index) {
  const int64_t hd = c.resolved_head_dim();
  input_layernorm_ =
      register_module("input_layernorm", std::make_shared<RMSNorm>(c.hidden_size, c.rms_norm_eps, c.dtype));
  self_attn_ = register_module(
      "self_attn", std::make_shared<AttentionWithRope>(layer_index, c.hidden_size, c.num_attention_heads,
                                                       c.num_key_value_heads, hd, c.dtype, c.attention_bias,
                                                       DeviceRef::CPU(), c.weight_format));
  post_attention_layernorm_ = register_module(
      "post_attention_layernorm", std::make_shared<RMSNorm>(c.hidden_size, c.rms_norm_eps, c.dtype));
  mlp_ =
      register_module("mlp", std::make_shared<MLP>(c.hidden_size, c.intermediate_size, MLPActivation::swiglu,
                                                   c.dtype, false, DeviceRef::CPU(), c.weight_format));
}

TensorValue TransformerBlock::operator()(const TensorValue& x, const AttentionContext& ctx) const {
  TensorValue h = x + (*self_attn_)((*input_layernorm_)(x), ctx);  // [seq, hidden]
  return h + (*mlp_)((*post_attention_layernorm_)(h));
}

TensorValue TransformerBlock::operator()(const TensorValue& x, const PagedAttentionContext& ctx) const {
  TensorValue h = x + (*self_attn_)((*input_layernorm_)(x), ctx);  // [tokens, hidden]
  return h + (*mlp_)((*post_attention_layernorm_)(h));
}

// ==== TransformerModel ==========================================================================

TransformerModel::TransformerModel(const LlamaConfig& c) {
  embed_tokens_ = register_module(
      "embed_tokens", std::make_shared<Embedding>(c.vocab_size, c.hidden_size, c.dtype, DeviceRef::CPU(),
                                                  model_weight_format(c.weight_format, c.hidden_size)));
  layers_ = register_module("layers", std::make_shared<ModuleList<TransformerBlock>>());
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) layers_->append(std::make_shared<TransformerBlock>(c, i));
  norm_ = register_module("norm", std::make_shared<RMSNorm>(c.hidden_size, c.rms_norm_eps, c.dtype));
}

TensorValue TransformerModel::operator()(const TensorValue& tokens, const AttentionContext& ctx) const {
  TensorValue h = (*embed_tokens_)(tokens);  // [seq, hidden]
  for (const auto& layer : *layers_) h = (*layer)(h, ctx);
  return (*norm_)(h);
}

TensorValue TransformerModel::operator()(const TensorValue& tokens, const PagedAttentionContext& ctx) const {
  TensorValue h = (*embed_tokens_)(tokens);  // [tokens, hidden]
  for (const auto& layer : *layers_) h = (*layer)(h, ctx);
  return (*norm_)(h);
}

// ==== Transformer ===============================================================================

namespace {
const LlamaConfig& validated(const LlamaConfig& c) {
  c.validate();
  return c;
}
}  // namespace

Transformer::Transformer(const LlamaConfig& config, int64_t max_seq_len, ReturnLogits return_logits)
    : config_(validated(config)),
      max_seq_len_(max_seq_len > 0 ? max_seq_len : config.max_position_embeddings),
      return_logits_(return_logits),
      rope_(config.resolved_head_dim(), config.rope_theta, max_seq_len_, config.rope_scaling) {
  if (max_seq_len < 0)
    throw ValueError(fmt::format("Transformer: max_seq_len must be >= 0, got {}", max_seq_len));
  // Every Linear and the Embedding store their weights in config.weight_format, passed down to each
  // layer (norms and activations stay in config.dtype).
  model_ = register_module("model", std::make_shared<TransformerModel>(config_));
  if (!config_.tie_word_embeddings)
    lm_head_ = register_module(
        "lm_head", std::make_shared<Linear>(config_.hidden_size, config_.vocab_size, config_.dtype, false,
                                            DeviceRef::CPU(),
                                            model_weight_format(config_.weight_format, config_.hidden_size)));
}

Transformer::Transformer(const LlamaConfig& config, PagedKVLayout paged, int64_t max_seq_len)
    : Transformer(config, max_seq_len, ReturnLogits::all) {
  if (paged.block_size < 1)
    throw ValueError(fmt::format("Transformer: the paged cache's block_size must be >= 1, got {}", paged.block_size));
  if (paged.dtype != DType::f32 && paged.dtype != DType::bf16 && paged.dtype != DType::f16)
    throw ValueError(fmt::format("Transformer: the paged cache's dtype must be f32, bf16 or f16, got {}",
                                 dtype_name(paged.dtype)));
  paged_ = paged;
}

std::optional<TypeTree> Transformer::input_tree() const {
  if (paged_) {
    const graph::InputType cache = graph::BufferType{
        paged_->dtype,
        {config_.num_hidden_layers, "num_blocks", paged_->block_size, config_.num_key_value_heads,
         config_.resolved_head_dim()}};
    const graph::InputType per_token = graph::TensorType{DType::i64, {"tokens"}};
    return TypeTree::map({
        {"tokens", TypeTree(per_token)},
        {"positions", TypeTree(per_token)},
        {"seq_ids", TypeTree(per_token)},
        {"slots", TypeTree(per_token)},
        {"block_tables", TypeTree(graph::TensorType{DType::i64, {"seqs", "max_blocks"}})},
        {"logit_rows", TypeTree(graph::TensorType{DType::i64, {"rows"}})},
        {"cache", TypeTree::map({{"k", TypeTree(cache)}, {"v", TypeTree(cache)}})},
    });
  }
  const graph::InputType cache = graph::BufferType{
      DType::f32,
      {config_.num_hidden_layers, max_seq_len_, config_.num_key_value_heads, config_.resolved_head_dim()}};
  const graph::InputType tokens = graph::TensorType{DType::i64, {"seq"}};
  const graph::InputType attention_mask = graph::TensorType{DType::i64, {"total"}};
  return TypeTree::map({
      {"tokens", TypeTree(tokens)},
      {"attention_mask", TypeTree(attention_mask)},
      {"cache", TypeTree::map({{"k", TypeTree(cache)}, {"v", TypeTree(cache)}})},
  });
}

Values Transformer::forward(const std::vector<Values>& args) {
  if (args.size() != 1 || !args[0].is_map())
    throw ValueError(fmt::format(
        "Transformer: forward takes one named tree (input_tree()), got {} argument(s)", args.size()));
  const Values& in = args[0];
  const Values& cache = in["cache"];
  if (paged_)
    return Values((*this)(in["tokens"].leaf(), in["positions"].leaf(), in["seq_ids"].leaf(), in["slots"].leaf(),
                          in["block_tables"].leaf(), in["logit_rows"].leaf(),
                          PagedKVCache{cache["k"].leaf(), cache["v"].leaf()}));
  return Values((*this)(in["tokens"].leaf(), in["attention_mask"].leaf(),
                        KVCache{cache["k"].leaf(), cache["v"].leaf()}));
}

TensorValue Transformer::operator()(const TensorValue& tokens, const TensorValue& attention_mask,
                                    const KVCache& cache) const {
  if (!tokens.valid() || tokens.rank() != 1)
    throw ShapeError(fmt::format("Transformer: tokens must be [seq] (batch 1), got {}",
                                 tokens.valid() ? tokens.tensor_type().to_string() : "an empty value"));
  AttentionContext ctx = make_attention_context(cache, attention_mask, tokens.shape()[0], rope_);
  TensorValue h = (*model_)(tokens, ctx);  // [seq, hidden]
  if (return_logits_ == ReturnLogits::last_token) h = ops::slice(h, {{-1}});  // [1, hidden]
  // A tied head multiplies by the embedding table, [vocab, hidden], laid out as a Linear's weight.
  TensorValue logits = lm_head_ ? (*lm_head_)(h) : model_->embed_tokens().attend(h);
  if (logits.dtype() != DType::f32) logits = ops::cast(logits, DType::f32);
  return logits;  // [seq, vocab]
}

TensorValue Transformer::operator()(const TensorValue& tokens, const TensorValue& positions, const TensorValue& seq_ids,
                                    const TensorValue& slots, const TensorValue& block_tables,
                                    const TensorValue& logit_rows, const PagedKVCache& cache) const {
  if (!tokens.valid() || tokens.rank() != 1)
    throw ShapeError(fmt::format("Transformer: tokens must be [tokens] (a ragged batch), got {}",
                                 tokens.valid() ? tokens.tensor_type().to_string() : "an empty value"));
  if (!logit_rows.valid() || logit_rows.rank() != 1 || logit_rows.dtype() != DType::i64)
    throw ShapeError(fmt::format("Transformer: logit_rows must be i64[rows], got {}",
                                 logit_rows.valid() ? logit_rows.tensor_type().to_string() : "an empty value"));
  PagedAttentionContext ctx = make_paged_attention_context(cache, positions, seq_ids, slots, block_tables, rope_);
  TensorValue h = (*model_)(tokens, ctx);  // [tokens, hidden]
  h = ops::gather(h, logit_rows, 0);       // [rows, hidden]: only the rows that are sampled
  TensorValue logits = lm_head_ ? (*lm_head_)(h) : model_->embed_tokens().attend(h);
  if (logits.dtype() != DType::f32) logits = ops::cast(logits, DType::f32);
  return logits;  // [rows, vocab]
}

}  // namespace kiln::nn
