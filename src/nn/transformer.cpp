#include "kiln/nn/transformer.h"

#include <fmt/format.h>

#include <cmath>

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
  if (!(partial_rotary_factor > 0 && partial_rotary_factor <= 1))
    throw ValueError(fmt::format("LlamaConfig: partial_rotary_factor must be in (0, 1], got {}", partial_rotary_factor));
  if (rotary_dim() % 2 != 0 || rotary_dim() < 2)
    throw ValueError(fmt::format("LlamaConfig: the rotary dims (head_dim {} * partial_rotary_factor {}) must be an "
                                 "even number >= 2, got {}",
                                 resolved_head_dim(), partial_rotary_factor, rotary_dim()));
  if (!rope_freq_factors.empty() && rope_scaling)
    throw ValueError("LlamaConfig: rope_freq_factors and rope_scaling both scale the rope frequencies: set one");
  if (!rope_freq_factors.empty() && static_cast<int64_t>(rope_freq_factors.size()) != rotary_dim() / 2)
    throw ValueError(fmt::format("LlamaConfig: rope_freq_factors has {} values, expected one per rotary frequency ({})",
                                 rope_freq_factors.size(), rotary_dim() / 2));
  if (sliding_window) positive("sliding_window", *sliding_window);
  if (!sliding_layers.empty() && static_cast<int64_t>(sliding_layers.size()) != num_hidden_layers)
    throw ValueError(fmt::format("LlamaConfig: sliding_layers has {} entries, expected one per layer ({})",
                                 sliding_layers.size(), num_hidden_layers));
  if (!is_gated(hidden_activation))
    throw ValueError("LlamaConfig: hidden_activation must be swiglu or geglu_tanh (a gated MLP)");
  auto positive_number = [](const char* field, const std::optional<double>& value) {
    if (value && !(*value > 0 && std::isfinite(*value)))
      throw ValueError(fmt::format("LlamaConfig: {} must be a positive number, got {}", field, *value));
  };
  positive_number("query_pre_attn_scalar", query_pre_attn_scalar);
  positive_number("attn_logit_softcapping", attn_logit_softcapping);
  positive_number("final_logit_softcapping", final_logit_softcapping);
  positive_number("rope_local_theta", rope_local_theta);
  positive_number("rope_linear_factor", rope_linear_factor);
}

// ==== TransformerBlock ==========================================================================

TransformerBlock::TransformerBlock(const LlamaConfig& c, int64_t layer_index) {
  const int64_t hd = c.resolved_head_dim();
  auto norm = [&] {
    return std::make_shared<RMSNorm>(c.hidden_size, c.rms_norm_eps, c.dtype, DeviceRef::CPU(), c.norm_unit_offset);
  };
  AttentionOptions options;
  options.qk_norm = c.qk_norm;
  options.norm_unit_offset = c.norm_unit_offset;
  options.norm_eps = c.rms_norm_eps;
  options.fused_qkv = c.fused_projections;
  const bool sliding = c.is_sliding(layer_index);
  options.sliding_window = sliding ? *c.sliding_window : 0;
  options.local_rope = sliding && c.rope_local_theta.has_value();
  if (c.query_pre_attn_scalar) options.scale = 1.0 / std::sqrt(*c.query_pre_attn_scalar);
  options.logit_softcap = c.attn_logit_softcapping.value_or(0.0);
  input_layernorm_ = register_module("input_layernorm", norm());
  const std::string prefix = fmt::format("model.layers.{}.", layer_index);
  self_attn_ = register_module(
      "self_attn",
      std::make_shared<AttentionWithRope>(
          layer_index, c.hidden_size, c.num_attention_heads, c.num_key_value_heads, hd, c.dtype, c.attention_bias,
          DeviceRef::CPU(),
          LayerWeightFormats(c.weight_format, weight_formats_under(c.weight_formats, prefix + "self_attn.")),
          options));
  post_attention_layernorm_ = register_module("post_attention_layernorm", norm());
  if (c.sandwich_norms) {
    pre_feedforward_layernorm_ = register_module("pre_feedforward_layernorm", norm());
    post_feedforward_layernorm_ = register_module("post_feedforward_layernorm", norm());
  }
  mlp_ = register_module(
      "mlp", std::make_shared<MLP>(c.hidden_size, c.intermediate_size, c.hidden_activation, c.dtype, false,
                                   DeviceRef::CPU(),
                                   LayerWeightFormats(c.weight_format, weight_formats_under(c.weight_formats, prefix + "mlp.")),
                                   c.fused_projections));
}

template <class Ctx> TensorValue TransformerBlock::apply(const TensorValue& x, const Ctx& ctx) const {
  if (!pre_feedforward_layernorm_) {
    TensorValue h = x + (*self_attn_)((*input_layernorm_)(x), ctx);  // [seq, hidden]
    return h + (*mlp_)((*post_attention_layernorm_)(h));
  }
  TensorValue h = x + (*post_attention_layernorm_)((*self_attn_)((*input_layernorm_)(x), ctx));
  return h + (*post_feedforward_layernorm_)((*mlp_)((*pre_feedforward_layernorm_)(h)));
}

TensorValue TransformerBlock::operator()(const TensorValue& x, const AttentionContext& ctx) const {
  return apply(x, ctx);
}

TensorValue TransformerBlock::operator()(const TensorValue& x, const PagedAttentionContext& ctx) const {
  return apply(x, ctx);
}

// ==== TransformerModel ==========================================================================

TransformerModel::TransformerModel(const LlamaConfig& c)
    : scale_embeddings_(c.scale_embeddings), hidden_size_(c.hidden_size) {
  embed_tokens_ = register_module(
      "embed_tokens",
      std::make_shared<Embedding>(
          c.vocab_size, c.hidden_size, c.dtype, DeviceRef::CPU(),
          weight_format_for(c.weight_format, c.weight_formats, "model.embed_tokens.weight", c.hidden_size)));
  layers_ = register_module("layers", std::make_shared<ModuleList<TransformerBlock>>());
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) layers_->append(std::make_shared<TransformerBlock>(c, i));
  norm_ = register_module("norm", std::make_shared<RMSNorm>(c.hidden_size, c.rms_norm_eps, c.dtype, DeviceRef::CPU(),
                                                           c.norm_unit_offset));
}

TensorValue TransformerModel::embed(const TensorValue& tokens) const {
  TensorValue h = (*embed_tokens_)(tokens);  // [tokens, hidden]
  // Gemma's normalizer: sqrt(hidden_size) rounded to the compute dtype, as its torch.tensor(..., dtype).
  if (scale_embeddings_) h = h * std::sqrt(static_cast<double>(hidden_size_));
  return h;
}

TensorValue TransformerModel::operator()(const TensorValue& tokens, const AttentionContext& ctx) const {
  TensorValue h = embed(tokens);  // [seq, hidden]
  for (const auto& layer : *layers_) h = (*layer)(h, ctx);
  return (*norm_)(h);
}

TensorValue TransformerModel::operator()(const TensorValue& tokens, const PagedAttentionContext& ctx) const {
  TensorValue h = embed(tokens);  // [tokens, hidden]
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
      rope_(config.rotary_dim(), config.rope_theta, max_seq_len_, config.rope_scaling, config.rope_linear_factor,
            config.rope_freq_factors) {
  if (max_seq_len < 0)
    throw ValueError(fmt::format("Transformer: max_seq_len must be >= 0, got {}", max_seq_len));
  if (config_.rope_local_theta) local_rope_.emplace(config_.rotary_dim(), *config_.rope_local_theta, max_seq_len_);
  // Every Linear and the Embedding store their weights in config.weight_format, passed down to each
  // layer (norms and activations stay in config.dtype).
  model_ = register_module("model", std::make_shared<TransformerModel>(config_));
  if (!config_.tie_word_embeddings)
    lm_head_ = register_module(
        "lm_head", std::make_shared<Linear>(config_.hidden_size, config_.vocab_size, config_.dtype, false,
                                            DeviceRef::CPU(),
                                            weight_format_for(config_.weight_format, config_.weight_formats,
                                                              "lm_head.weight", config_.hidden_size)));
  if (!config_.weight_formats.empty()) {
    const auto declared = raw_state_dict();
    for (const auto& [name, format] : config_.weight_formats) {
      const auto it = declared.find(name);
      if (it == declared.end() || it->second.shape.rank() != 2)
        throw ValueError(fmt::format("LlamaConfig: weight_formats names '{}' ({}), which is not a weight matrix "
                                     "of this model",
                                     name, weight_format_name(format)));
    }
  }
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
  // One windowed mask serves every sliding layer (they share config.sliding_window).
  AttentionContext ctx = make_attention_context(cache, attention_mask, tokens.shape()[0], rope_,
                                                config_.sliding_window.value_or(0),
                                                local_rope_ ? &*local_rope_ : nullptr);
  TensorValue h = (*model_)(tokens, ctx);  // [seq, hidden]
  if (return_logits_ == ReturnLogits::last_token) h = ops::slice(h, {{-1}});  // [1, hidden]
  return head(h);  // [seq, vocab]
}

TensorValue Transformer::head(const TensorValue& h) const {
  // A tied head multiplies by the embedding table, [vocab, hidden], laid out as a Linear's weight.
  TensorValue logits = lm_head_ ? (*lm_head_)(h) : model_->embed_tokens().attend(h);
  if (config_.final_logit_softcapping) {
    const double cap = *config_.final_logit_softcapping;
    logits = ops::tanh(logits / cap) * cap;  // Gemma 2's final soft-capping, in the compute dtype
  }
  if (logits.dtype() != DType::f32) logits = ops::cast(logits, DType::f32);
  return logits;
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
  PagedAttentionContext ctx = make_paged_attention_context(cache, positions, seq_ids, slots, block_tables, rope_,
                                                           local_rope_ ? &*local_rope_ : nullptr);
  TensorValue h = (*model_)(tokens, ctx);  // [tokens, hidden]
  h = ops::gather(h, logit_rows, 0);       // [rows, hidden]: only the rows that are sampled
  return head(h);                          // [rows, vocab]
}

}  // namespace kiln::nn
