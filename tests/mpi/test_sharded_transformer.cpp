// nn::ShardedTransformer with one device per MPI rank (shard `rank` of `size`), run by each rank
// through a session whose process group is engine::mpi_world(), against the single-device
// nn::Transformer that each rank also runs on its own, on the same hashed checkpoint (docs/llama.md).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "kiln/engine/distributed.h"
#include "kiln/engine/session.h"
#include "kiln/nn/tensor_parallel.h"
#include "kiln/nn/transformer.h"
#include "nn/hashed_weights.h"

namespace kiln {
namespace {

constexpr int64_t kCacheLen = 16;

nn::LlamaConfig small_config(bool tied) {
  nn::LlamaConfig c;
  c.vocab_size = 128;
  c.hidden_size = 64;
  c.intermediate_size = 160;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.max_position_embeddings = 32;
  c.tie_word_embeddings = tied;
  return c;
}

engine::Model load(nn::Module& model, const engine::InferenceSession& session, const WeightsRegistry& weights) {
  graph::Graph g("llama", model.input_tree()->flatten());
  {
    graph::Graph::Scope scope(g);
    nn::Values inputs = model.input_tree()->unflatten(g.inputs());
    g.output(model.forward({inputs}).flatten());
  }
  return session.load(g, weights);
}

class MpiShardedTransformer : public ::testing::TestWithParam<bool> {};

TEST_P(MpiShardedTransformer, LogitsOnEveryRankMatchTheSingleDeviceTransformer) {
  auto world = engine::mpi_world();
  const nn::LlamaConfig config = small_config(/*tied=*/GetParam());
  const int64_t kv_heads = config.num_key_value_heads, head_dim = config.resolved_head_dim();

  // The reference: the whole model on this rank alone.
  nn::Transformer reference(config, kCacheLen);
  WeightsRegistry checkpoint;
  for (const auto& [name, w] : reference.raw_state_dict())
    checkpoint.emplace(name, nn::hashed_weights::make(name, w.shape.static_dims()));
  engine::InferenceSession local_session({DeviceRef::CPU()});
  engine::Model reference_model = load(reference, local_session, checkpoint);

  // This rank's shard: its heads, feature slices and vocab rows of the same checkpoint.
  nn::ShardedTransformer sharded(config, nn::Sharding{{DeviceRef::CPU(0)}, world->size(), world->rank()},
                                 kCacheLen);
  sharded.load_state_dict(checkpoint);
  engine::SessionOptions options;
  options.process_group = world;
  engine::InferenceSession rank_session({DeviceRef::CPU(0)}, {}, options);
  engine::Model sharded_model = load(sharded, rank_session, sharded.state_dict());

  auto cache = [&](int64_t heads) { return Tensor::zeros(DType::f32, {config.num_hidden_layers, kCacheLen, heads, head_dim}); };
  Tensor ref_k = cache(kv_heads), ref_v = cache(kv_heads);
  Tensor k = cache(kv_heads / world->size()), v = cache(kv_heads / world->size());

  const std::vector<int64_t> prompt{1, 17, 93, 5, 127, 64, 40};
  // Prefill tokens 0..5, then one decode step each: the KV caches of the ranks advance together.
  for (auto [begin, end] : std::vector<std::pair<int64_t, int64_t>>{{0, 5}, {5, 6}, {6, 7}}) {
    Tensor tokens = Tensor::from_vector(std::vector<int64_t>(prompt.begin() + begin, prompt.begin() + end), {end - begin});
    Tensor mask = Tensor::from_vector(std::vector<int64_t>(static_cast<size_t>(end), 1), {end});
    const auto expected = reference_model.execute({tokens, mask, ref_k, ref_v})[0].to_vector<float>();
    auto out = sharded_model.execute({tokens, mask, k, v});
    ASSERT_EQ(out.size(), 1u);
    ASSERT_EQ(out[0].shape(), (std::vector<int64_t>{end - begin, config.vocab_size}));
    const auto got = out[0].to_vector<float>();
    double max_ref = 0, worst = 0;
    for (size_t i = 0; i < got.size(); ++i) {
      max_ref = std::max(max_ref, static_cast<double>(std::abs(expected[i])));
      worst = std::max(worst, static_cast<double>(std::abs(got[i] - expected[i])));
    }
    ASSERT_GT(max_ref, 0.0);
    EXPECT_LE(worst / max_ref, 1e-5) << "rank " << world->rank() << ", tokens " << begin << ".." << end;

    // And every rank holds the very same logits (they come out of one allgather).
    const int64_t bytes = static_cast<int64_t>(got.size() * sizeof(float));
    std::vector<float> all(got.size() * static_cast<size_t>(world->size()));
    world->allgather(got.data(), all.data(), bytes);
    for (int r = 1; r < world->size(); ++r)
      EXPECT_EQ(std::memcmp(all.data(), all.data() + r * got.size(), bytes), 0) << "rank " << r << " differs";
  }
}

INSTANTIATE_TEST_SUITE_P(Heads, MpiShardedTransformer, ::testing::Values(false, true),
                         [](const auto& info) { return info.param ? "tied" : "untied"; });

}  // namespace
}  // namespace kiln
