#include "kiln/nn/tensor_parallel.h"

#include <fmt/format.h>

#include <cmath>
#include <limits>

#include "kiln/graph/ops.h"
#include "kiln/graph/signals.h"
#include "nn/expect_last_dim.h"

namespace kiln::nn {

namespace ops = graph::ops;
using graph::Dim;
using graph::Shape;
using graph::TensorValue;

// ==== Sharding ==================================================================================

void Sharding::validate() const {
  if (devices.empty()) throw ValueError("Sharding: needs at least one device, got none");
  for (size_t i = 0; i < devices.size(); ++i)
    for (size_t j = 0; j < i; ++j)
      if (devices[i] == devices[j])
        throw ValueError(fmt::format("Sharding: device {} is listed twice (devices {} and {})",
                                     devices[i].to_string(), j, i));
  if (processes < 1) throw ValueError(fmt::format("Sharding: processes must be >= 1, got {}", processes));
  if (process_rank < 0 || process_rank >= processes)
    throw ValueError(fmt::format("Sharding: process_rank {} is not in [0, {}) (processes {})", process_rank,
                                 processes, processes));
}

void Sharding::check_divides(const char* who, const char* what, int64_t n) const {
  if (n % num_shards() != 0)
    throw ValueError(fmt::format("{}: {} {} does not split evenly over {} shards ({} process(es) x {} device(s))",
                                 who, what, n, num_shards(), processes, num_local()));
}

namespace {

const Sharding& validated(const Sharding& s) {
  s.validate();
  return s;
}

// One value per local device, each on its device; ValueError naming the layer otherwise.
void check_per_device(const char* layer, const std::string& path, const Sharding& s, const PerDevice& xs,
                      const char* what = "input") {
  if (static_cast<int64_t>(xs.size()) != s.num_local())
    throw ValueError(fmt::format("{} '{}': needs one {} per device ({}), got {}", layer, path, what,
                                 s.num_local(), xs.size()));
  for (size_t j = 0; j < xs.size(); ++j) {
    if (!xs[j].valid()) throw ValueError(fmt::format("{} '{}': {} {} is an empty value", layer, path, what, j));
    if (xs[j].device() != s.devices[j])
      throw ValueError(fmt::format("{} '{}': {} {} is on {}, expected {}", layer, path, what, j,
                                   xs[j].device().to_string(), s.devices[j].to_string()));
  }
}

void check_signal_buffers(const char* layer, const std::string& path, const Sharding& s,
                          const SignalBuffers& signal_buffers) {
  const size_t expected = s.has_signal_buffers() ? s.devices.size() : 0;
  if (signal_buffers.size() != expected)
    throw ValueError(fmt::format("{} '{}': needs {} signal buffer(s) for {} local device(s), got {}", layer, path,
                                 expected, s.num_local(), signal_buffers.size()));
}

// The sum over every shard, on every local device. One shard is its own sum.
PerDevice all_reduce(const Sharding& s, const PerDevice& xs, const SignalBuffers& signal_buffers) {
  if (s.num_shards() == 1) return xs;
  return ops::allreduce_sum(xs, signal_buffers, s.processes);
}

// The shards concatenated along the last axis in shard order, on every local device.
PerDevice all_gather_last(const Sharding& s, const PerDevice& xs, const SignalBuffers& signal_buffers) {
  if (s.num_shards() == 1) return xs;
  return ops::allgather(xs, signal_buffers, xs.front().rank() - 1, s.processes);
}

TensorValue activate(MLPActivation activation, const TensorValue& gate_or_up) {
  switch (activation) {
    case MLPActivation::swiglu: return ops::silu(gate_or_up);
    case MLPActivation::gelu: return ops::gelu(gate_or_up, /*tanh_approximation=*/false);
    case MLPActivation::gelu_tanh:
    case MLPActivation::geglu_tanh: return ops::gelu(gate_or_up, /*tanh_approximation=*/true);
  }
  throw ValueError(fmt::format("TensorParallelMLP: unknown activation {}", static_cast<int>(activation)));
}

}  // namespace

// ==== ColumnParallelLinear ======================================================================

ColumnParallelLinear::ColumnParallelLinear(int64_t in_dim, int64_t out_dim, const Sharding& sharding, DType dtype,
                                           bool has_bias, bool gather_output)
    : sharding_(validated(sharding)), in_dim_(in_dim), out_dim_(out_dim), gather_output_(gather_output) {
  if (in_dim <= 0 || out_dim <= 0)
    throw ValueError(
        fmt::format("ColumnParallelLinear: dims must be positive, got in {} out {}", in_dim, out_dim));
  sharding_.check_divides("ColumnParallelLinear", "out_dim", out_dim);
  const int64_t shards = sharding_.num_shards();
  for (int64_t j = 0; j < sharding_.num_local(); ++j) {
    const ShardSpec rows{0, sharding_.shard_index(j), shards};
    const DeviceRef device = sharding_.devices[j];
    weights_.push_back(register_weight_shard("weight", dtype, {out_dim, in_dim}, rows, device));
    if (has_bias) biases_.push_back(register_weight_shard("bias", dtype, {out_dim}, rows, device));
  }
}

PerDevice ColumnParallelLinear::operator()(const PerDevice& xs, const SignalBuffers& signal_buffers) const {
  check_per_device("ColumnParallelLinear", path(), sharding_, xs);
  if (gather_output_) check_signal_buffers("ColumnParallelLinear", path(), sharding_, signal_buffers);
  PerDevice ys;
  for (size_t j = 0; j < xs.size(); ++j) {
    expect_last_dim("ColumnParallelLinear", path(), xs[j], in_dim_);
    // [out / S, in] -> [in, out / S]; the compiler folds the transpose into the matmul.
    TensorValue y = ops::matmul(xs[j], ops::transpose(weight(weights_[j]), 0, 1));  // [..., out / S]
    if (!biases_.empty()) y = y + weight(biases_[j]);
    ys.push_back(y);
  }
  return gather_output_ ? all_gather_last(sharding_, ys, signal_buffers) : ys;
}

// ==== RowParallelLinear =========================================================================

RowParallelLinear::RowParallelLinear(int64_t in_dim, int64_t out_dim, const Sharding& sharding, DType dtype,
                                     bool has_bias)
    : sharding_(validated(sharding)), in_dim_(in_dim), out_dim_(out_dim) {
  if (in_dim <= 0 || out_dim <= 0)
    throw ValueError(fmt::format("RowParallelLinear: dims must be positive, got in {} out {}", in_dim, out_dim));
  sharding_.check_divides("RowParallelLinear", "in_dim", in_dim);
  const int64_t shards = sharding_.num_shards();
  for (int64_t j = 0; j < sharding_.num_local(); ++j) {
    const int64_t k = sharding_.shard_index(j);
    const DeviceRef device = sharding_.devices[j];
    weights_.push_back(register_weight_shard("weight", dtype, {out_dim, in_dim}, {1, k, shards}, device));
    if (has_bias)
      biases_.push_back(
          register_weight_shard("bias", dtype, {out_dim}, {ShardSpec::kReplicated, k, shards}, device));
  }
}

PerDevice RowParallelLinear::operator()(const PerDevice& xs, const SignalBuffers& signal_buffers) const {
  check_per_device("RowParallelLinear", path(), sharding_, xs);
  check_signal_buffers("RowParallelLinear", path(), sharding_, signal_buffers);
  PerDevice partial;
  for (size_t j = 0; j < xs.size(); ++j) {
    expect_last_dim("RowParallelLinear", path(), xs[j], in_dim_ / sharding_.num_shards());
    partial.push_back(ops::matmul(xs[j], ops::transpose(weight(weights_[j]), 0, 1)));  // [..., out]
  }
  PerDevice ys = all_reduce(sharding_, partial, signal_buffers);
  // After the sum, so the bias counts once.
  if (!biases_.empty())
    for (size_t j = 0; j < ys.size(); ++j) ys[j] = ys[j] + weight(biases_[j]);
  return ys;
}

// ==== VocabParallelEmbedding ====================================================================

VocabParallelEmbedding::VocabParallelEmbedding(int64_t vocab_size, int64_t dim, const Sharding& sharding,
                                               DType dtype)
    : sharding_(validated(sharding)), vocab_size_(vocab_size), dim_(dim) {
  if (vocab_size <= 0 || dim <= 0)
    throw ValueError(fmt::format("VocabParallelEmbedding: vocab_size and dim must be positive, got {} and {}",
                                 vocab_size, dim));
  sharding_.check_divides("VocabParallelEmbedding", "vocab_size", vocab_size);
  for (int64_t j = 0; j < sharding_.num_local(); ++j)
    weights_.push_back(register_weight_shard("weight", dtype, {vocab_size, dim},
                                             {0, sharding_.shard_index(j), sharding_.num_shards()},
                                             sharding_.devices[j]));
}

PerDevice VocabParallelEmbedding::operator()(const PerDevice& ids, const SignalBuffers& signal_buffers) const {
  check_per_device("VocabParallelEmbedding", path(), sharding_, ids, "ids");
  check_signal_buffers("VocabParallelEmbedding", path(), sharding_, signal_buffers);
  const int64_t rows = vocab_size_ / sharding_.num_shards();
  PerDevice looked_up;
  for (size_t j = 0; j < ids.size(); ++j) {
    const TensorValue& id = ids[j];
    if (id.dtype() != DType::i32 && id.dtype() != DType::i64)
      throw DTypeError(fmt::format("VocabParallelEmbedding '{}': ids must be i32 or i64, got {}", path(),
                                   id.tensor_type().to_string()));
    const DeviceRef device = id.device();
    // Ids outside this shard's rows [first, first + rows) look up row 0 and are then zeroed, so the
    // sum over shards holds exactly the one row that owns each id.
    const auto first = static_cast<double>(sharding_.shard_index(static_cast<int64_t>(j)) * rows);
    TensorValue local = id - first;  // [...]
    TensorValue owned = ops::logical_and(ops::greater_equal(local, ops::constant(0.0, id.dtype(), device)),
                                         ops::less(local, ops::constant(static_cast<double>(rows), id.dtype(), device)));
    TensorValue row = ops::where(owned, local, ops::constant(0.0, id.dtype(), device));
    TensorValue found = ops::gather(table(static_cast<int64_t>(j)), row, 0);  // [..., dim]
    std::vector<Dim> mask_dims = id.shape().dims();
    mask_dims.push_back(Dim(1));
    const DType dtype = found.dtype();
    looked_up.push_back(ops::where(ops::reshape(owned, Shape(mask_dims)), found,
                                   ops::constant(0.0, dtype, device)));  // [..., dim]
  }
  return all_reduce(sharding_, looked_up, signal_buffers);
}

// ==== DistributedRMSNorm ========================================================================

DistributedRMSNorm::DistributedRMSNorm(int64_t dim, double eps, const Sharding& sharding, DType dtype)
    : dim_(dim), eps_(eps) {
  sharding.validate();
  if (dim <= 0) throw ValueError(fmt::format("DistributedRMSNorm: dim must be positive, got {}", dim));
  if (!(eps >= 0)) throw ValueError(fmt::format("DistributedRMSNorm: eps must be >= 0, got {}", eps));
  for (int64_t j = 0; j < sharding.num_local(); ++j)
    weights_.push_back(register_weight_shard(
        "weight", dtype, {dim}, {ShardSpec::kReplicated, sharding.shard_index(j), sharding.num_shards()},
        sharding.devices[j]));
}

PerDevice DistributedRMSNorm::operator()(const PerDevice& xs) const {
  if (xs.size() != weights_.size())
    throw ValueError(fmt::format("DistributedRMSNorm '{}': needs one input per device ({}), got {}", path(),
                                 weights_.size(), xs.size()));
  PerDevice ys;
  for (size_t j = 0; j < xs.size(); ++j) {
    expect_last_dim("DistributedRMSNorm", path(), xs[j], dim_);
    ys.push_back(ops::rms_norm(xs[j], weight(weights_[j]), eps_));
  }
  return ys;
}

// ==== TensorParallelMLP =========================================================================

TensorParallelMLP::TensorParallelMLP(int64_t hidden_dim, int64_t intermediate_dim, const Sharding& sharding,
                                     MLPActivation activation, DType dtype, bool has_bias)
    : activation_(activation) {
  if (is_gated(activation))
    gate_proj_ = register_module("gate_proj", std::make_shared<ColumnParallelLinear>(
                                                  hidden_dim, intermediate_dim, sharding, dtype, has_bias));
  up_proj_ = register_module(
      "up_proj", std::make_shared<ColumnParallelLinear>(hidden_dim, intermediate_dim, sharding, dtype, has_bias));
  down_proj_ = register_module(
      "down_proj", std::make_shared<RowParallelLinear>(intermediate_dim, hidden_dim, sharding, dtype, has_bias));
}

PerDevice TensorParallelMLP::operator()(const PerDevice& xs, const SignalBuffers& signal_buffers) const {
  PerDevice up = (*up_proj_)(xs);  // [..., intermediate / S] per device
  PerDevice hidden;
  if (gate_proj_) {
    PerDevice gate = (*gate_proj_)(xs);
    for (size_t j = 0; j < xs.size(); ++j) hidden.push_back(activate(activation_, gate[j]) * up[j]);
  } else {
    for (size_t j = 0; j < xs.size(); ++j) hidden.push_back(activate(activation_, up[j]));
  }
  return (*down_proj_)(hidden, signal_buffers);
}

// ==== TensorParallelAttentionWithRope ===========================================================

TensorParallelAttentionWithRope::TensorParallelAttentionWithRope(int64_t layer_index, int64_t hidden_dim,
                                                                 int64_t n_heads, int64_t n_kv_heads,
                                                                 int64_t head_dim, const Sharding& sharding,
                                                                 DType dtype, bool has_bias)
    : sharding_(validated(sharding)), layer_index_(layer_index), head_dim_(head_dim) {
  if (layer_index < 0 || hidden_dim <= 0 || n_heads <= 0 || n_kv_heads <= 0 || head_dim <= 0 ||
      n_heads % n_kv_heads != 0)
    throw ValueError(fmt::format(
        "TensorParallelAttentionWithRope: need layer_index >= 0, positive dims and n_heads a multiple of "
        "n_kv_heads; got layer_index {}, hidden_dim {}, n_heads {}, n_kv_heads {}, head_dim {}",
        layer_index, hidden_dim, n_heads, n_kv_heads, head_dim));
  sharding_.check_divides("TensorParallelAttentionWithRope", "n_heads", n_heads);
  sharding_.check_divides("TensorParallelAttentionWithRope", "n_kv_heads", n_kv_heads);
  local_heads_ = n_heads / sharding_.num_shards();
  local_kv_heads_ = n_kv_heads / sharding_.num_shards();
  // Row blocks of q/k/v_proj are whole heads, in order, so shard k's query heads read its kv heads.
  q_proj_ = register_module(
      "q_proj", std::make_shared<ColumnParallelLinear>(hidden_dim, n_heads * head_dim, sharding, dtype, has_bias));
  k_proj_ = register_module("k_proj", std::make_shared<ColumnParallelLinear>(hidden_dim, n_kv_heads * head_dim,
                                                                             sharding, dtype, has_bias));
  v_proj_ = register_module("v_proj", std::make_shared<ColumnParallelLinear>(hidden_dim, n_kv_heads * head_dim,
                                                                             sharding, dtype, has_bias));
  o_proj_ = register_module(
      "o_proj", std::make_shared<RowParallelLinear>(n_heads * head_dim, hidden_dim, sharding, dtype, false));
}

PerDevice TensorParallelAttentionWithRope::operator()(const PerDevice& xs, const std::vector<AttentionContext>& ctxs,
                                                      const SignalBuffers& signal_buffers) const {
  check_per_device("TensorParallelAttentionWithRope", path(), sharding_, xs);
  if (ctxs.size() != xs.size())
    throw ValueError(fmt::format("TensorParallelAttentionWithRope '{}': needs one context per device ({}), got {}",
                                 path(), xs.size(), ctxs.size()));
  PerDevice qs = (*q_proj_)(xs);  // [seq, local_heads * head_dim] per device
  PerDevice ks = (*k_proj_)(xs);  // [seq, local_kv_heads * head_dim]
  PerDevice vs = (*v_proj_)(xs);
  PerDevice outs;
  for (size_t j = 0; j < xs.size(); ++j)
    outs.push_back(attend(static_cast<int64_t>(j), xs[j], qs[j], ks[j], vs[j], ctxs[j]));
  return (*o_proj_)(outs, signal_buffers);
}

// One device's heads: AttentionWithRope's computation over local_heads_ / local_kv_heads_ and that
// device's cache (see attention.cpp for the why of each step).
TensorValue TensorParallelAttentionWithRope::attend(int64_t local, const TensorValue& x, const TensorValue& q_rows,
                                                    const TensorValue& k_rows, const TensorValue& v_rows,
                                                    const AttentionContext& ctx) const {
  if (!ctx.cache.k.valid() || !ctx.cache.v.valid())
    throw ValueError(fmt::format("TensorParallelAttentionWithRope '{}': device {}'s cache is not a pair of buffers",
                                 path(), local));
  const graph::BufferType cache_type = ctx.cache.k.buffer_type();  // a copy: adding nodes moves the type table
  const Shape& cs = cache_type.shape;
  auto n_layers = cs.rank() == 4 ? cs[0].try_static() : std::nullopt;
  if (!n_layers || layer_index_ >= *n_layers || !(cs[2] == Dim(local_kv_heads_)) || !(cs[3] == Dim(head_dim_)) ||
      cache_type.device != sharding_.devices[local] || !(ctx.cache.v.buffer_type() == cache_type))
    throw ShapeError(fmt::format(
        "TensorParallelAttentionWithRope '{}': layer {} with {} kv heads of dim {} on {} does not fit device {}'s "
        "cache {} (k) / {} (v)",
        path(), layer_index_, local_kv_heads_, head_dim_, sharding_.devices[local].to_string(), local,
        cache_type.to_string(), ctx.cache.v.buffer_type().to_string()));
  if (x.rank() != 2)
    throw ShapeError(fmt::format("TensorParallelAttentionWithRope '{}': x must be [seq, hidden], got {}", path(),
                                 x.tensor_type().to_string()));
  return attend_with_cache(q_rows, k_rows, v_rows, layer_index_, local_heads_, local_kv_heads_, head_dim_, ctx);
}

// ==== ShardedTransformer ========================================================================

// TransformerBlock, sharded: h = x + attn(norm(x)); out = h + mlp(norm(h)), per device.
class ShardedTransformer::Block : public Module {
 public:
  Block(const LlamaConfig& c, const Sharding& s, int64_t layer_index) {
    input_layernorm_ = register_module("input_layernorm",
                                       std::make_shared<DistributedRMSNorm>(c.hidden_size, c.rms_norm_eps, s, c.dtype));
    self_attn_ = register_module("self_attn", std::make_shared<TensorParallelAttentionWithRope>(
                                                  layer_index, c.hidden_size, c.num_attention_heads,
                                                  c.num_key_value_heads, c.resolved_head_dim(), s, c.dtype,
                                                  c.attention_bias));
    post_attention_layernorm_ = register_module(
        "post_attention_layernorm", std::make_shared<DistributedRMSNorm>(c.hidden_size, c.rms_norm_eps, s, c.dtype));
    mlp_ = register_module("mlp", std::make_shared<TensorParallelMLP>(c.hidden_size, c.intermediate_size, s,
                                                                      MLPActivation::swiglu, c.dtype));
  }

  PerDevice operator()(const PerDevice& xs, const std::vector<AttentionContext>& ctxs,
                       const SignalBuffers& signal_buffers) const {
    PerDevice attn = (*self_attn_)((*input_layernorm_)(xs), ctxs, signal_buffers);
    PerDevice hs;
    for (size_t j = 0; j < xs.size(); ++j) hs.push_back(xs[j] + attn[j]);  // [seq, hidden]
    PerDevice mlp = (*mlp_)((*post_attention_layernorm_)(hs), signal_buffers);
    for (size_t j = 0; j < hs.size(); ++j) hs[j] = hs[j] + mlp[j];
    return hs;
  }

 private:
  std::shared_ptr<DistributedRMSNorm> input_layernorm_;
  std::shared_ptr<TensorParallelAttentionWithRope> self_attn_;
  std::shared_ptr<DistributedRMSNorm> post_attention_layernorm_;
  std::shared_ptr<TensorParallelMLP> mlp_;
};

// TransformerModel, sharded (the "model." prefix): embeddings, blocks, final norm.
class ShardedTransformer::Body : public Module {
 public:
  Body(const LlamaConfig& c, const Sharding& s) {
    embed_tokens_ = register_module("embed_tokens",
                                    std::make_shared<VocabParallelEmbedding>(c.vocab_size, c.hidden_size, s, c.dtype));
    layers_ = register_module("layers", std::make_shared<ModuleList<Block>>());
    for (int64_t i = 0; i < c.num_hidden_layers; ++i) layers_->append(std::make_shared<Block>(c, s, i));
    norm_ = register_module("norm", std::make_shared<DistributedRMSNorm>(c.hidden_size, c.rms_norm_eps, s, c.dtype));
  }

  // tokens per device -> final hidden states [seq, hidden] per device.
  PerDevice operator()(const PerDevice& tokens, const std::vector<AttentionContext>& ctxs,
                       const SignalBuffers& signal_buffers) const {
    PerDevice hs = (*embed_tokens_)(tokens, signal_buffers);
    for (const auto& layer : *layers_) hs = (*layer)(hs, ctxs, signal_buffers);
    return (*norm_)(hs);
  }
  const VocabParallelEmbedding& embed_tokens() const { return *embed_tokens_; }

 private:
  std::shared_ptr<VocabParallelEmbedding> embed_tokens_;
  std::shared_ptr<ModuleList<Block>> layers_;
  std::shared_ptr<DistributedRMSNorm> norm_;
};

namespace {
const LlamaConfig& validated_for(const LlamaConfig& c, const Sharding& s) {
  c.validate();
  s.validate();
  s.check_divides("ShardedTransformer", "num_attention_heads", c.num_attention_heads);
  s.check_divides("ShardedTransformer", "num_key_value_heads", c.num_key_value_heads);
  s.check_divides("ShardedTransformer", "intermediate_size", c.intermediate_size);
  s.check_divides("ShardedTransformer", "vocab_size", c.vocab_size);
  // The sharded model is Llama's: the other architectures' layer differences are refused, not ignored.
  const char* unsupported = c.qk_norm                       ? "qk_norm (Qwen 3, Gemma 3)"
                            : c.norm_unit_offset || c.sandwich_norms ? "Gemma's norms"
                            : c.hidden_activation != MLPActivation::swiglu ? "a GeGLU MLP (Gemma)"
                            : c.scale_embeddings || c.query_pre_attn_scalar || c.attn_logit_softcapping ||
                                      c.final_logit_softcapping || c.rope_local_theta
                                ? "Gemma's attention"
                            : c.rope_linear_factor != 1.0 ? "linear rope scaling"
                            : c.partial_rotary_factor != 1.0 ? "a partial rotary factor (Phi-3)"
                            : c.fused_projections ? "fused projections (Phi-3)"
                                                  : nullptr;
  if (unsupported)
    throw ValueError(fmt::format("ShardedTransformer: {} is not supported by the tensor-parallel model", unsupported));
  return c;
}
}  // namespace

ShardedTransformer::ShardedTransformer(const LlamaConfig& config, const Sharding& sharding, int64_t max_seq_len)
    : config_(validated_for(config, sharding)),
      sharding_(sharding),
      max_seq_len_(max_seq_len > 0 ? max_seq_len : config.max_position_embeddings),
      rope_(config.resolved_head_dim(), config.rope_theta, max_seq_len_, config.rope_scaling) {
  if (max_seq_len < 0)
    throw ValueError(fmt::format("ShardedTransformer: max_seq_len must be >= 0, got {}", max_seq_len));
  // Its attention is full attention: exact for a sliding-window model only while the window covers
  // the whole cache.
  if (config_.sliding_window && *config_.sliding_window < max_seq_len_)
    throw ValueError(fmt::format("ShardedTransformer: sliding_window {} is shorter than max_seq_len {}; the "
                                 "tensor-parallel model has no sliding-window attention (use max_seq_len <= {})",
                                 *config_.sliding_window, max_seq_len_, *config_.sliding_window));
  model_ = register_module("model", std::make_shared<Body>(config_, sharding_));
  if (!config_.tie_word_embeddings)
    lm_head_ = register_module("lm_head", std::make_shared<ColumnParallelLinear>(
                                              config_.hidden_size, config_.vocab_size, sharding_, config_.dtype,
                                              /*has_bias=*/false, /*gather_output=*/true));
}

std::optional<TypeTree> ShardedTransformer::input_tree() const {
  const int64_t kv_heads = config_.num_key_value_heads / sharding_.num_shards();
  TypeTree::List k, v, signals;
  for (const DeviceRef& device : sharding_.devices) {
    const graph::InputType cache = graph::BufferType{
        DType::f32, {config_.num_hidden_layers, max_seq_len_, kv_heads, config_.resolved_head_dim()}, device};
    k.emplace_back(cache);
    v.emplace_back(cache);
    signals.emplace_back(graph::InputType(graph::BufferType{DType::u8, {graph::SIGNAL_BYTES}, device}));
  }
  const DeviceRef first = sharding_.devices.front();
  TypeTree::Map tree{
      {"tokens", TypeTree(graph::InputType(graph::TensorType{DType::i64, {"seq"}, first}))},
      {"attention_mask", TypeTree(graph::InputType(graph::TensorType{DType::i64, {"total"}, first}))},
      {"cache", TypeTree::map({{"k", TypeTree::list(std::move(k))}, {"v", TypeTree::list(std::move(v))}})},
  };
  if (sharding_.has_signal_buffers()) tree.emplace_back("signals", TypeTree::list(std::move(signals)));
  return TypeTree::map(std::move(tree));
}

Values ShardedTransformer::forward(const std::vector<Values>& args) {
  if (args.size() != 1 || !args[0].is_map())
    throw ValueError(fmt::format(
        "ShardedTransformer: forward takes one named tree (input_tree()), got {} argument(s)", args.size()));
  const Values& in = args[0];
  const Values& cache = in["cache"];
  const auto& ks = cache["k"].items();
  const auto& vs = cache["v"].items();
  if (ks.size() != vs.size())
    throw ValueError(fmt::format("ShardedTransformer: cache has {} k buffers and {} v buffers", ks.size(), vs.size()));
  std::vector<KVCache> caches;
  for (size_t j = 0; j < ks.size(); ++j) caches.push_back(KVCache{ks[j].leaf(), vs[j].leaf()});
  SignalBuffers signal_buffers;
  if (sharding_.has_signal_buffers())
    for (const auto& s : in["signals"].items()) signal_buffers.emplace_back(s.leaf());
  return Values((*this)(in["tokens"].leaf(), in["attention_mask"].leaf(), caches, signal_buffers));
}

TensorValue ShardedTransformer::operator()(const TensorValue& tokens, const TensorValue& attention_mask,
                                           const std::vector<KVCache>& caches,
                                           const SignalBuffers& signal_buffers) const {
  if (!tokens.valid() || tokens.rank() != 1)
    throw ShapeError(fmt::format("ShardedTransformer: tokens must be [seq] (batch 1), got {}",
                                 tokens.valid() ? tokens.tensor_type().to_string() : "an empty value"));
  if (!attention_mask.valid())
    throw ValueError("ShardedTransformer: attention_mask is an empty value");
  if (static_cast<int64_t>(caches.size()) != sharding_.num_local())
    throw ValueError(fmt::format("ShardedTransformer: needs one KV cache per device ({}), got {}",
                                 sharding_.num_local(), caches.size()));
  check_signal_buffers("ShardedTransformer", path(), sharding_, signal_buffers);
  // Every device sees the whole token list and mask; each builds its own positions, rope tables and mask.
  PerDevice device_tokens;
  std::vector<AttentionContext> ctxs;
  for (size_t j = 0; j < caches.size(); ++j) {
    const DeviceRef device = sharding_.devices[j];
    auto on_device = [&](const TensorValue& t) { return t.device() == device ? t : ops::transfer_to(t, device); };
    device_tokens.push_back(on_device(tokens));
    ctxs.push_back(make_attention_context(caches[j], on_device(attention_mask), tokens.shape()[0], rope_));
  }
  PerDevice hs = (*model_)(device_tokens, ctxs, signal_buffers);  // [seq, hidden] per device
  PerDevice logits;
  if (lm_head_) {
    logits = (*lm_head_)(hs, signal_buffers);
  } else {
    // Tied: each device multiplies by its rows of the embedding table, [vocab / S, hidden].
    PerDevice pieces;
    for (size_t j = 0; j < hs.size(); ++j)
      pieces.push_back(
          ops::matmul(hs[j], ops::transpose(model_->embed_tokens().table(static_cast<int64_t>(j)), 0, 1)));
    logits = all_gather_last(sharding_, pieces, signal_buffers);
  }
  TensorValue out = logits.front();  // [seq, vocab] on devices[0]
  if (out.dtype() != DType::f32) out = ops::cast(out, DType::f32);
  return out;
}

}  // namespace kiln::nn
