// Tensor parallelism (Megatron-style, as MAX's distributed layers): a layer's weights are split across
// devices, each device computes its part, and collectives (ops::allreduce_sum, ops::allgather) join
// the parts. Values go in and come out as one value per local device, in Sharding::devices order.
// Weights are shards of the unsharded ones (Module::register_weight_shard): the graph names them
// "<name>.shard<k>", and load_state_dict slices them from an ordinary (Hugging Face) checkpoint.
//
//   nn::Sharding sharding{{DeviceRef::CPU(0), DeviceRef::CPU(1)}};
//   auto model = std::make_shared<nn::ShardedTransformer>(config, sharding, /*max_seq_len=*/256);
//   model->load_state_dict(hf_checkpoint);                 // model.embed_tokens.weight, ...
//   // trace with model->input_tree(), then bind model->state_dict() at init (docs/tensor-parallel.md)
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "kiln/nn/attention.h"
#include "kiln/nn/mlp.h"
#include "kiln/nn/module.h"
#include "kiln/nn/rotary_embedding.h"
#include "kiln/nn/transformer.h"

namespace kiln::nn {

// Where a model's shards live. `devices` are this process's devices; with processes > 1 the same
// graph runs in every process (MPI rank) and collectives span them. Local device j holds shard
// process_rank * devices.size() + j of num_shards().
struct Sharding {
  std::vector<DeviceRef> devices;
  int64_t processes = 1;
  int64_t process_rank = 0;

  // ValueError for no devices, a device listed twice, processes < 1 or a rank outside [0, processes).
  void validate() const;
  int64_t num_local() const { return static_cast<int64_t>(devices.size()); }
  int64_t num_shards() const { return processes * num_local(); }
  int64_t shard_index(int64_t local) const { return process_rank * num_local() + local; }
  // Collectives within a process synchronise through signal buffers when it has >= 2 devices.
  bool has_signal_buffers() const { return devices.size() >= 2; }
  // ValueError "<who>: <what> <n> does not split evenly over <s> shards" unless num_shards() divides n.
  void check_divides(const char* who, const char* what, int64_t n) const;
};

// One value per local device.
using PerDevice = std::vector<graph::TensorValue>;
// One signal buffer per local device (none for a single local device).
using SignalBuffers = std::vector<graph::BufferValue>;

// y = x @ W^T + b with W [out, in] split by rows (output features): each device gets the full x and
// computes its slice of the features. Weights "weight" (axis 0) and, with has_bias, "bias" (axis 0).
class ColumnParallelLinear : public Module {
 public:
  // gather_output: allgather the slices along the last axis, so every device gets all out features.
  ColumnParallelLinear(int64_t in_dim, int64_t out_dim, const Sharding& sharding, DType dtype = DType::f32,
                       bool has_bias = false, bool gather_output = false);
  // xs: [..., in] per device -> [..., out / num_shards] per device ([..., out] with gather_output).
  PerDevice operator()(const PerDevice& xs, const SignalBuffers& signal_buffers = {}) const;

 private:
  Sharding sharding_;
  int64_t in_dim_;
  int64_t out_dim_;
  bool gather_output_;
  std::vector<WeightId> weights_;
  std::vector<WeightId> biases_;
};

// y = x @ W^T + b with W [out, in] split by columns (input features): device j takes its slice of x's
// features, and the partial products are summed with allreduce_sum; the bias (replicated) is added
// once, after the sum. Weights "weight" (axis 1) and, with has_bias, "bias" (replicated).
class RowParallelLinear : public Module {
 public:
  RowParallelLinear(int64_t in_dim, int64_t out_dim, const Sharding& sharding, DType dtype = DType::f32,
                    bool has_bias = false);
  // xs: [..., in / num_shards] per device -> [..., out] per device (all equal).
  PerDevice operator()(const PerDevice& xs, const SignalBuffers& signal_buffers) const;

 private:
  Sharding sharding_;
  int64_t in_dim_;
  int64_t out_dim_;
  std::vector<WeightId> weights_;
  std::vector<WeightId> biases_;
};

// Embedding with the [vocab, dim] table split by rows: each device looks up the ids in its vocab
// range (others give zero rows) and allreduce_sum joins them. Weight "weight" (axis 0).
class VocabParallelEmbedding : public Module {
 public:
  VocabParallelEmbedding(int64_t vocab_size, int64_t dim, const Sharding& sharding, DType dtype = DType::f32);
  // ids (i32 or i64, the same on each device) [...] -> [..., dim] per device.
  PerDevice operator()(const PerDevice& ids, const SignalBuffers& signal_buffers) const;
  // Local device j's table shard [vocab / num_shards, dim] (a tied lm_head multiplies by it).
  graph::TensorValue table(int64_t local) const { return weight(weights_.at(static_cast<size_t>(local))); }
  int64_t vocab_size() const { return vocab_size_; }

 private:
  Sharding sharding_;
  int64_t vocab_size_;
  int64_t dim_;
  std::vector<WeightId> weights_;
};

// RMSNorm with its weight replicated on every device ("weight", one copy per device).
class DistributedRMSNorm : public Module {
 public:
  DistributedRMSNorm(int64_t dim, double eps, const Sharding& sharding, DType dtype = DType::f32);
  PerDevice operator()(const PerDevice& xs) const;  // [..., dim] per device

 private:
  int64_t dim_;
  double eps_;
  std::vector<WeightId> weights_;
};

// MLP with gate_proj / up_proj column-parallel and down_proj row-parallel: each device computes its
// slice of the intermediate features, and one allreduce_sum joins the down projection.
class TensorParallelMLP : public Module {
 public:
  TensorParallelMLP(int64_t hidden_dim, int64_t intermediate_dim, const Sharding& sharding,
                    MLPActivation activation = MLPActivation::swiglu, DType dtype = DType::f32,
                    bool has_bias = false);
  PerDevice operator()(const PerDevice& xs, const SignalBuffers& signal_buffers) const;  // [..., hidden]

 private:
  MLPActivation activation_;
  std::shared_ptr<ColumnParallelLinear> gate_proj_;  // null unless swiglu
  std::shared_ptr<ColumnParallelLinear> up_proj_;
  std::shared_ptr<RowParallelLinear> down_proj_;
};

// AttentionWithRope with heads split across devices: device j (shard k) holds query heads
// [k * n_heads / S, (k + 1) * n_heads / S) and kv heads [k * n_kv_heads / S, ...) of S shards, so each
// query head meets its kv head on the same device; q/k/v_proj are column-parallel, o_proj is
// row-parallel. Each device has its own KV cache holding its kv heads,
// [n_layers, max_seq, n_kv_heads / S, head_dim]. ValueError unless S divides both head counts.
class TensorParallelAttentionWithRope : public Module {
 public:
  TensorParallelAttentionWithRope(int64_t layer_index, int64_t hidden_dim, int64_t n_heads, int64_t n_kv_heads,
                                  int64_t head_dim, const Sharding& sharding, DType dtype = DType::f32,
                                  bool has_bias = false);
  // xs [seq, hidden] and ctxs (make_attention_context over device j's cache and mask) per device
  // -> [seq, hidden] per device.
  PerDevice operator()(const PerDevice& xs, const std::vector<AttentionContext>& ctxs,
                       const SignalBuffers& signal_buffers) const;

 private:
  graph::TensorValue attend(int64_t local, const graph::TensorValue& x, const graph::TensorValue& q,
                            const graph::TensorValue& k, const graph::TensorValue& v,
                            const AttentionContext& ctx) const;

  Sharding sharding_;
  int64_t layer_index_;
  int64_t local_heads_;
  int64_t local_kv_heads_;
  int64_t head_dim_;
  std::shared_ptr<ColumnParallelLinear> q_proj_;
  std::shared_ptr<ColumnParallelLinear> k_proj_;
  std::shared_ptr<ColumnParallelLinear> v_proj_;
  std::shared_ptr<RowParallelLinear> o_proj_;
};

// nn::Transformer (Hugging Face's LlamaForCausalLM) sharded over `sharding`: the same forward and the
// same logits, with weights loadable by load_state_dict from the Hugging Face names. Module tree and
// weight names follow Transformer's, each weight a set of shards ("model.norm.weight.shard0", ...):
// embed_tokens vocab-parallel, attention and MLP as above, norms replicated, lm_head column-parallel
// over the vocab (a tied head uses embed_tokens' shards).
class ShardedTransformer : public Module {
 public:
  // ValueError on a bad config, a bad sharding, or sizes the shard count does not divide
  // (num_attention_heads, num_key_value_heads, intermediate_size, vocab_size).
  ShardedTransformer(const LlamaConfig& config, const Sharding& sharding, int64_t max_seq_len = 0);

  // {"tokens": i64[seq], "attention_mask": i64[total]            (both on devices[0])
  //  "cache": {"k": [buffer<f32[layers, max_seq, kv_heads / S, head_dim]> on device j, ...],
  //            "v": [same]},
  //  "signals": [buffer<u8[SIGNAL_BYTES]> on device j, ...]}     (only with >= 2 local devices)
  std::optional<TypeTree> input_tree() const override;
  // args: the one tree of input_tree(). Returns the logits f32[seq, vocab_size] on devices[0] (a leaf).
  Values forward(const std::vector<Values>& args) override;
  // The same with the tree's parts: per-device caches and signal buffers.
  graph::TensorValue operator()(const graph::TensorValue& tokens, const graph::TensorValue& attention_mask,
                                const std::vector<KVCache>& caches,
                                const SignalBuffers& signal_buffers) const;

  const LlamaConfig& config() const { return config_; }
  const Sharding& sharding() const { return sharding_; }
  int64_t max_seq_len() const { return max_seq_len_; }

 private:
  class Block;
  class Body;

  LlamaConfig config_;
  Sharding sharding_;
  int64_t max_seq_len_;
  RotaryEmbedding rope_;
  std::shared_ptr<Body> model_;
  std::shared_ptr<ColumnParallelLinear> lm_head_;  // null when tied
};

}  // namespace kiln::nn
