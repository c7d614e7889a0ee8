// Tensor parallelism: sharded weights (names, shapes, slicing from a full checkpoint), the parallel
// layers against naive reference loops, and ShardedTransformer against the single-device
// nn::Transformer (itself checked against Hugging Face in test_llama_reference.cpp) on 1, 2 and 4
// CPU devices.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <numeric>
#include <ostream>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "../test_util.h"
#include "hashed_weights.h"
#include "kiln/engine/session.h"
#include "kiln/engine/signals.h"
#include "kiln/graph/ops.h"
#include "kiln/nn/tensor_parallel.h"
#include "kiln/nn/transformer.h"

namespace {

using namespace kiln;
using kiln::testing::expect_error;

std::vector<DeviceRef> cpus(int n) {
  std::vector<DeviceRef> out;
  for (int i = 0; i < n; ++i) out.push_back(DeviceRef::CPU(i));
  return out;
}

nn::Sharding on_cpus(int n) { return nn::Sharding{cpus(n)}; }

// `values` as a tensor on `device` (sharing the memory; CPU devices share the host).
Tensor on_device(const Tensor& t, DeviceRef device) {
  return Tensor::view(std::make_shared<Tensor>(t), const_cast<void*>(t.data()), t.dtype(), t.shape(), {}, device);
}

std::vector<float> iota_values(size_t n, float scale) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<float>(i) * scale;
  return v;
}

std::vector<float> random_values(std::mt19937& rng, size_t n) {
  std::uniform_real_distribution<float> dist(-1.f, 1.f);
  std::vector<float> v(n);
  for (auto& e : v) e = dist(rng);
  return v;
}

double max_abs_diff(const std::vector<float>& a, const std::vector<double>& b) {
  EXPECT_EQ(a.size(), b.size());
  double worst = 0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) worst = std::max(worst, std::abs(a[i] - b[i]));
  return worst;
}

// A graph over `devices` taking `data_types` then (with >= 2 devices) one signal buffer per device,
// built by `build`, run once on `data`.
using Build = std::function<std::vector<graph::Value>(const std::vector<graph::Value>&, const nn::SignalBuffers&)>;
std::vector<Tensor> run_on_devices(const std::vector<DeviceRef>& devices, const std::vector<graph::Type>& data_types,
                                   const Build& build, const WeightsRegistry& weights, std::vector<Tensor> data) {
  engine::Signals signals(devices);
  std::vector<graph::Type> types = data_types;
  const bool with_signals = devices.size() >= 2;
  if (with_signals)
    for (const auto& t : signals.input_types()) types.push_back(t);
  graph::Graph g("tp", types);
  {
    graph::Graph::Scope scope(g);
    std::vector<graph::Value> inputs = g.inputs();
    std::vector<graph::Value> data_values(inputs.begin(), inputs.begin() + static_cast<long>(data_types.size()));
    nn::SignalBuffers buffers(inputs.begin() + static_cast<long>(data_types.size()), inputs.end());
    g.output(build(data_values, buffers));
  }
  engine::InferenceSession session(devices);
  engine::Model model = session.load(g, weights);
  if (with_signals) data.insert(data.end(), signals.buffers().begin(), signals.buffers().end());
  return model.execute(data);
}

std::vector<graph::Value> as_values(const nn::PerDevice& xs) { return {xs.begin(), xs.end()}; }
nn::PerDevice as_tensors(const std::vector<graph::Value>& xs) { return {xs.begin(), xs.end()}; }

// ==== Sharding ====================================================================================

TEST(Sharding, ShardIndexCountsThisProcesssDevicesAfterEarlierRanks) {
  nn::Sharding s{cpus(2), /*processes=*/3, /*process_rank=*/2};
  EXPECT_EQ(s.num_shards(), 6);
  EXPECT_EQ(s.shard_index(0), 4);
  EXPECT_EQ(s.shard_index(1), 5);
  EXPECT_TRUE(s.has_signal_buffers());
  EXPECT_FALSE((nn::Sharding{cpus(1), 2, 1}.has_signal_buffers()));
}

TEST(Sharding, RejectsNoDevicesDuplicatesAndBadRanks) {
  expect_error<ValueError>([] { nn::Sharding{}.validate(); }, "needs at least one device");
  expect_error<ValueError>([] { nn::Sharding{{DeviceRef::CPU(0), DeviceRef::CPU(1), DeviceRef::CPU(0)}}.validate(); },
                           {"device cpu:0 is listed twice", "devices 0 and 2"});
  expect_error<ValueError>([] { nn::Sharding{cpus(1), 0, 0}.validate(); }, "processes must be >= 1, got 0");
  expect_error<ValueError>([] { nn::Sharding{cpus(1), 2, 2}.validate(); }, "process_rank 2 is not in [0, 2)");
  expect_error<ValueError>([] { nn::Sharding{cpus(1), 2, -1}.validate(); }, "process_rank -1");
  expect_error<ValueError>([] { nn::ColumnParallelLinear(4, 4, nn::Sharding{}); }, "needs at least one device");
}

// ==== sharded weights =============================================================================

// A module with one weight split by `spec`-like pieces: the test registers them itself.
class Pieces : public nn::Module {
 public:
  void add(const std::string& name, const graph::Shape& full, nn::ShardSpec spec, DType dtype = DType::f32) {
    register_weight_shard(name, dtype, full, spec, DeviceRef::CPU(static_cast<int>(spec.index)));
  }
};

TEST(ShardedWeights, GraphNameIsLogicalNamePlusShardIndex) {
  nn::ColumnParallelLinear layer(8, 6, on_cpus(2), DType::f32, /*has_bias=*/true);
  auto sd = layer.raw_state_dict();
  std::vector<std::string> names;
  for (const auto& [name, w] : sd) names.push_back(name);
  EXPECT_EQ(names, (std::vector<std::string>{"bias.shard0", "bias.shard1", "weight.shard0", "weight.shard1"}));
  EXPECT_EQ(sd.at("weight.shard1").shape.to_string(), "[3, 8]");
  EXPECT_EQ(sd.at("weight.shard1").device, DeviceRef::CPU(1));
  EXPECT_EQ(sd.at("bias.shard0").shape.to_string(), "[3]");
  auto shards = layer.weight_shards();
  EXPECT_EQ(shards.at("weight.shard1").logical_name, "weight");
  EXPECT_EQ(shards.at("weight.shard1").full_shape.to_string(), "[6, 8]");
  EXPECT_EQ(shards.at("weight.shard1").spec.axis, 0);
  EXPECT_EQ(shards.at("weight.shard1").spec.index, 1);
  EXPECT_EQ(shards.at("weight.shard1").spec.count, 2);
}

TEST(ShardedWeights, LoadStateDictCopiesEachShardsRowsFromTheFullWeight) {
  nn::ColumnParallelLinear layer(4, 6, on_cpus(2), DType::f32, /*has_bias=*/true);
  const std::vector<float> w = iota_values(24, 1.f);  // [6, 4]: w[r][c] = 4r + c
  layer.load_state_dict({{"weight", Tensor::from_vector(w, {6, 4})},
                         {"bias", Tensor::from_vector<float>({10, 11, 12, 13, 14, 15}, {6})}});
  auto sd = layer.state_dict();
  // Rows 3..5 of the full weight, written out.
  EXPECT_EQ(sd.at("weight.shard1").shape(), (std::vector<int64_t>{3, 4}));
  EXPECT_EQ(sd.at("weight.shard1").to_vector<float>(),
            (std::vector<float>{12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23}));
  EXPECT_EQ(sd.at("weight.shard0").to_vector<float>(), (std::vector<float>{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11}));
  EXPECT_EQ(sd.at("bias.shard1").to_vector<float>(), (std::vector<float>{13, 14, 15}));
  EXPECT_TRUE(sd.at("weight.shard1").is_contiguous());
}

TEST(ShardedWeights, LoadStateDictSlicesColumnsOfAStridedFullWeight) {
  nn::RowParallelLinear layer(4, 2, on_cpus(2), DType::f32, /*has_bias=*/true);
  // The full [2, 4] weight as a transposed view of a [4, 2] array: w[r][c] = storage[c * 2 + r].
  std::vector<float> storage{0, 1, 2, 3, 4, 5, 6, 7};
  Tensor full = Tensor::borrow(storage.data(), DType::f32, {2, 4}, {1, 2});
  Tensor bias = Tensor::from_vector<float>({0.5f, -0.5f}, {2});
  layer.load_state_dict({{"weight", full}, {"bias", bias}});
  auto sd = layer.state_dict();
  // Columns 2..3: w[0][2], w[0][3], w[1][2], w[1][3] = storage[4], storage[6], storage[5], storage[7].
  EXPECT_EQ(sd.at("weight.shard1").to_vector<float>(), (std::vector<float>{4, 6, 5, 7}));
  EXPECT_EQ(sd.at("weight.shard0").to_vector<float>(), (std::vector<float>{0, 2, 1, 3}));
  storage.assign(8, -1.f);  // the shards are copies, not views
  EXPECT_EQ(sd.at("weight.shard0").to_vector<float>(), (std::vector<float>{0, 2, 1, 3}));
  // A replica binds the full tensor itself, one per device.
  EXPECT_EQ(sd.at("bias.shard0").data(), bias.data());
  EXPECT_EQ(sd.at("bias.shard1").data(), bias.data());
}

TEST(ShardedWeights, LoadStateDictChecksTheFullShapeAndNamesTheWeight) {
  nn::ColumnParallelLinear layer(4, 6, on_cpus(2));
  expect_error<ValueError>([&] { layer.load_state_dict({{"weight", Tensor::zeros(DType::f32, {3, 4})}}); },
                           {"weight 'weight' has shape [3, 4], expected [6, 4]", "full, unsharded"});
  expect_error<ValueError>([&] { layer.load_state_dict({{"weight", Tensor::zeros(DType::f64, {6, 4})}}); },
                           "weight 'weight' has dtype f64, expected f32");
  // The strict check lists a missing logical name once, and shard names are not checkpoint names.
  expect_error<ValueError>([&] { layer.load_state_dict({{"weight.shard0", Tensor::zeros(DType::f32, {3, 4})}}); },
                           "missing weights [weight]; unexpected weights [weight.shard0]");
  // A failed load leaves the shards unbound (zeros), not half-sliced.
  EXPECT_EQ(layer.state_dict().at("weight.shard0").to_vector<float>(), std::vector<float>(12, 0.f));
}

TEST(ShardedWeights, UnevenSplitNamesTheWeightAxisAndCount) {
  Pieces m;
  expect_error<ValueError>([&] { m.add("w", {5, 3}, {0, 0, 2}); },
                           {"weight 'w' [5, 3]", "along axis 0", "into 2 shards"});
  expect_error<ValueError>([&] { m.add("w", {5, 3}, {2, 0, 2}); }, "axis 2 is out of range");
  expect_error<ValueError>([&] { m.add("w", {4, 3}, {0, 2, 2}); }, "shard index 2 is not in [0, 2)");
  expect_error<ValueError>([] { nn::ColumnParallelLinear(4, 6, on_cpus(4)); },
                           "ColumnParallelLinear: out_dim 6 does not split evenly over 4 shards");
  expect_error<ValueError>([] { nn::RowParallelLinear(6, 4, on_cpus(4)); }, "in_dim 6 does not split evenly");
  expect_error<ValueError>([] { nn::VocabParallelEmbedding(10, 4, on_cpus(4)); }, "vocab_size 10");
}

TEST(ShardedWeights, PiecesOfOneWeightMustAgree) {
  Pieces m;
  m.add("w", {4, 3}, {0, 0, 2});
  expect_error<ValueError>([&] { m.add("w", {4, 3}, {0, 0, 2}); }, "shard 0 of 'w' is registered twice");
  expect_error<ValueError>([&] { m.add("w", {4, 4}, {0, 1, 2}); }, {"shard 1 of 'w'", "[4, 4]", "differs from shard 0"});
  m.add("w", {4, 3}, {0, 1, 2});
  EXPECT_EQ(m.raw_state_dict().size(), 2u);
}

// ==== ShardedTransformer structure =================================================================

nn::LlamaConfig small_config(int64_t kv_heads = 4, bool tied = false) {
  nn::LlamaConfig c;
  c.vocab_size = 128;
  c.hidden_size = 64;
  c.intermediate_size = 160;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = kv_heads;
  c.max_position_embeddings = 32;
  c.tie_word_embeddings = tied;
  return c;
}

constexpr int64_t kCacheLen = 16;

TEST(ShardedTransformer, WeightsAreShardsOfTheHuggingFaceNames) {
  for (bool tied : {false, true}) {
    nn::Transformer reference(small_config(2, tied));
    nn::ShardedTransformer model(small_config(2, tied), on_cpus(2));
    std::set<std::string> expected_names, expected_logical;
    for (const auto& [name, w] : reference.raw_state_dict()) {
      expected_logical.insert(name);
      for (int k = 0; k < 2; ++k) expected_names.insert(name + ".shard" + std::to_string(k));
    }
    std::set<std::string> names, logical;
    for (const auto& [name, w] : model.raw_state_dict()) names.insert(name);
    for (const auto& [name, shard] : model.weight_shards()) logical.insert(shard.logical_name);
    EXPECT_EQ(names, expected_names) << "tied " << tied;
    EXPECT_EQ(logical, expected_logical) << "tied " << tied;
  }
}

TEST(ShardedTransformer, ShardShapesAndAxesFollowMegatronSplits) {
  nn::ShardedTransformer model(small_config(/*kv_heads=*/2), on_cpus(2));
  auto sd = model.raw_state_dict();
  auto shards = model.weight_shards();
  auto shape = [&](const std::string& name) { return sd.at(name).shape.to_string(); };
  auto axis = [&](const std::string& name) { return shards.at(name).spec.axis; };
  const std::string attn = "model.layers.1.self_attn.";
  EXPECT_EQ(shape(attn + "q_proj.weight.shard1"), "[32, 64]");  // 2 of 4 heads of 16
  EXPECT_EQ(shape(attn + "k_proj.weight.shard1"), "[16, 64]");  // 1 of 2 kv heads
  EXPECT_EQ(shape(attn + "o_proj.weight.shard1"), "[64, 32]");
  EXPECT_EQ(axis(attn + "o_proj.weight.shard1"), 1);
  EXPECT_EQ(shape("model.layers.0.mlp.gate_proj.weight.shard0"), "[80, 64]");
  EXPECT_EQ(shape("model.layers.0.mlp.down_proj.weight.shard0"), "[64, 80]");
  EXPECT_EQ(axis("model.layers.0.mlp.down_proj.weight.shard0"), 1);
  EXPECT_EQ(shape("model.embed_tokens.weight.shard1"), "[64, 64]");
  EXPECT_EQ(shape("lm_head.weight.shard1"), "[64, 64]");
  EXPECT_EQ(shape("model.norm.weight.shard1"), "[64]");
  EXPECT_EQ(axis("model.norm.weight.shard1"), nn::ShardSpec::kReplicated);
  EXPECT_EQ(sd.at("model.layers.0.input_layernorm.weight.shard1").device, DeviceRef::CPU(1));
}

TEST(ShardedTransformer, RejectsHeadsAndSizesTheShardsDoNotDivide) {
  expect_error<ValueError>([] { nn::ShardedTransformer(small_config(/*kv_heads=*/2), on_cpus(4)); },
                           "ShardedTransformer: num_key_value_heads 2 does not split evenly over 4 shards");
  auto c = small_config();
  c.intermediate_size = 150;
  expect_error<ValueError>([&] { nn::ShardedTransformer(c, on_cpus(4)); }, "intermediate_size 150");
  c = small_config();
  c.num_key_value_heads = 3;
  expect_error<ValueError>([&] { nn::ShardedTransformer(c, on_cpus(1)); }, "num_key_value_heads 3");
}

TEST(ShardedTransformer, InputTreeHasPerDeviceCachesAndSignals) {
  nn::ShardedTransformer model(small_config(/*kv_heads=*/2), on_cpus(2), kCacheLen);
  auto tree = *model.input_tree();
  EXPECT_EQ(graph::to_string(tree["tokens"].leaf()), "i64[seq]");
  EXPECT_EQ(graph::device_of(tree["attention_mask"].leaf()), DeviceRef::CPU(0));
  ASSERT_EQ(tree["cache"]["k"].items().size(), 2u);
  for (int j = 0; j < 2; ++j) {
    const auto& k = std::get<graph::BufferType>(tree["cache"]["k"][j].leaf());
    EXPECT_EQ(k.shape.to_string(), "[2, 16, 1, 16]");  // this device's 1 of 2 kv heads
    EXPECT_EQ(k.device, DeviceRef::CPU(j));
    const auto& s = std::get<graph::BufferType>(tree["signals"][j].leaf());
    EXPECT_EQ(s.dtype, DType::u8);
    EXPECT_EQ(s.device, DeviceRef::CPU(j));
  }
  EXPECT_EQ(tree.num_leaves(), 8u);
}

nn::Values trace_into(graph::Graph& g, nn::Module& model) {
  graph::Graph::Scope scope(g);
  nn::Values inputs = model.input_tree()->unflatten(g.inputs());
  nn::Values out = model.forward({inputs});
  g.output(out.flatten());
  return out;
}

size_t count(const std::string& text, const std::string& part) {
  size_t n = 0;
  for (size_t at = text.find(part); at != std::string::npos; at = text.find(part, at + 1)) ++n;
  return n;
}

TEST(ShardedTransformer, OneDevicePerProcessTracesCollectivesWithoutSignalBuffers) {
  // What each rank of `mpirun -n 2` builds: its own device, shard `rank` of 2.
  nn::ShardedTransformer model(small_config(), nn::Sharding{{DeviceRef::CPU(0)}, /*processes=*/2, /*rank=*/1},
                               kCacheLen);
  auto tree = *model.input_tree();
  EXPECT_EQ(tree.num_leaves(), 4u);  // tokens, mask, k, v
  EXPECT_THROW(tree["signals"], ValueError);
  for (const auto& [name, w] : model.raw_state_dict())
    EXPECT_EQ(name.substr(name.size() - 7), ".shard1") << name;
  graph::Graph g("llama_rank1", tree.flatten());
  nn::Values out = trace_into(g, model);
  EXPECT_EQ(graph::to_string(out.leaf().type()), "f32[seq, 128]");  // the full vocab, gathered
  const std::string text = g.to_string();
  // One allreduce for the embedding and two per layer (o_proj, down_proj); one allgather of the logits.
  EXPECT_EQ(count(text, "allreduce_sum("), 5u) << text;
  EXPECT_EQ(count(text, "allgather("), 1u);
  EXPECT_EQ(count(text, "processes = 2"), 6u);
  EXPECT_EQ(count(text, "u8["), 0u);
  // Rank 1's q_proj holds the second half of the heads.
  nn::Transformer reference(small_config());
  WeightsRegistry full;
  for (const auto& [name, w] : reference.raw_state_dict())
    full.emplace(name, nn::hashed_weights::make(name, w.shape.static_dims()));
  model.load_state_dict(full);
  const auto q = full.at("model.layers.0.self_attn.q_proj.weight").to_vector<float>();  // [64, 64]
  EXPECT_EQ(model.state_dict().at("model.layers.0.self_attn.q_proj.weight.shard1").to_vector<float>(),
            std::vector<float>(q.begin() + 32 * 64, q.end()));
}

TEST(ShardedTransformer, MissingSignalBuffersAreAnErrorNamingTheLayer) {
  nn::ShardedTransformer model(small_config(), on_cpus(2), kCacheLen);
  auto tree = *model.input_tree();
  graph::Graph g("llama", tree.flatten());
  graph::Graph::Scope scope(g);
  nn::Values in = tree.unflatten(g.inputs());
  std::vector<nn::KVCache> caches{{in["cache"]["k"][0].leaf(), in["cache"]["v"][0].leaf()},
                                  {in["cache"]["k"][1].leaf(), in["cache"]["v"][1].leaf()}};
  expect_error<ValueError>([&] { model(in["tokens"].leaf(), in["attention_mask"].leaf(), caches, {}); },
                           "needs 2 signal buffer(s) for 2 local device(s), got 0");
  expect_error<ValueError>(
      [&] { model(in["tokens"].leaf(), in["attention_mask"].leaf(), {caches[0]}, {}); },
      "needs one KV cache per device (2), got 1");
}

// ==== parallel layers against reference loops ======================================================

class ParallelLayers : public ::testing::TestWithParam<int> {};

TEST_P(ParallelLayers, ColumnParallelLinearGivesEachDeviceItsFeatureSlice) {
  const int n = GetParam();
  const int64_t seq = 3, in = 8, out = 12, per = out / n;
  std::mt19937 rng(7);
  auto w = random_values(rng, out * in), b = random_values(rng, out), x = random_values(rng, seq * in);
  for (bool gather : {false, true}) {
    nn::ColumnParallelLinear layer(in, out, on_cpus(n), DType::f32, /*has_bias=*/true, gather);
    layer.load_state_dict({{"weight", Tensor::from_vector(w, {out, in})}, {"bias", Tensor::from_vector(b, {out})}});
    std::vector<graph::Type> types;
    std::vector<Tensor> data;
    for (int j = 0; j < n; ++j) {
      types.push_back(graph::TensorType{DType::f32, {seq, in}, DeviceRef::CPU(j)});
      data.push_back(on_device(Tensor::from_vector(x, {seq, in}), DeviceRef::CPU(j)));
    }
    auto results = run_on_devices(
        cpus(n), types, [&](const auto& xs, const auto& signals) { return as_values(layer(as_tensors(xs), signals)); },
        layer.state_dict(), data);
    ASSERT_EQ(results.size(), static_cast<size_t>(n));
    for (int j = 0; j < n; ++j) {
      // Features [j * per, (j + 1) * per), or all of them when gathered.
      const int64_t first = gather ? 0 : j * per, count_out = gather ? out : per;
      std::vector<double> expected;
      for (int64_t s = 0; s < seq; ++s)
        for (int64_t o = first; o < first + count_out; ++o) {
          double acc = b[o];
          for (int64_t i = 0; i < in; ++i) acc += static_cast<double>(x[s * in + i]) * w[o * in + i];
          expected.push_back(acc);
        }
      EXPECT_EQ(results[j].device(), DeviceRef::CPU(j));
      EXPECT_LE(max_abs_diff(results[j].to_vector<float>(), expected), 1e-5) << "device " << j << " gather " << gather;
    }
  }
}

TEST_P(ParallelLayers, RowParallelLinearSumsPartialProductsAndAddsTheBiasOnce) {
  const int n = GetParam();
  const int64_t seq = 3, in = 16, out = 5, per = in / n;
  std::mt19937 rng(11);
  auto w = random_values(rng, out * in), b = random_values(rng, out), x = random_values(rng, seq * in);
  nn::RowParallelLinear layer(in, out, on_cpus(n), DType::f32, /*has_bias=*/true);
  layer.load_state_dict({{"weight", Tensor::from_vector(w, {out, in})}, {"bias", Tensor::from_vector(b, {out})}});
  std::vector<graph::Type> types;
  std::vector<Tensor> data;
  for (int j = 0; j < n; ++j) {
    types.push_back(graph::TensorType{DType::f32, {seq, per}, DeviceRef::CPU(j)});
    std::vector<float> slice;  // x[:, j * per : (j + 1) * per]
    for (int64_t s = 0; s < seq; ++s)
      slice.insert(slice.end(), x.begin() + s * in + j * per, x.begin() + s * in + (j + 1) * per);
    data.push_back(on_device(Tensor::from_vector(slice, {seq, per}), DeviceRef::CPU(j)));
  }
  auto results = run_on_devices(
      cpus(n), types, [&](const auto& xs, const auto& signals) { return as_values(layer(as_tensors(xs), signals)); },
      layer.state_dict(), data);
  std::vector<double> expected;
  for (int64_t s = 0; s < seq; ++s)
    for (int64_t o = 0; o < out; ++o) {
      double acc = b[o];
      for (int64_t i = 0; i < in; ++i) acc += static_cast<double>(x[s * in + i]) * w[o * in + i];
      expected.push_back(acc);
    }
  ASSERT_EQ(results.size(), static_cast<size_t>(n));
  for (int j = 0; j < n; ++j)
    EXPECT_LE(max_abs_diff(results[j].to_vector<float>(), expected), 1e-5) << "device " << j;
}

TEST_P(ParallelLayers, VocabParallelEmbeddingFindsEachRowOnItsOwningDevice) {
  const int n = GetParam();
  const int64_t vocab = 16, dim = 3;
  const std::vector<float> table = iota_values(vocab * dim, 0.25f);
  nn::VocabParallelEmbedding embed(vocab, dim, on_cpus(n));
  embed.load_state_dict({{"weight", Tensor::from_vector(table, {vocab, dim})}});
  const std::vector<int64_t> ids{0, 15, 4, 3, 12, 7, 8, 0};  // first and last rows of several shards
  std::vector<graph::Type> types;
  std::vector<Tensor> data;
  for (int j = 0; j < n; ++j) {
    types.push_back(graph::TensorType{DType::i64, {2, 4}, DeviceRef::CPU(j)});
    data.push_back(on_device(Tensor::from_vector(ids, {2, 4}), DeviceRef::CPU(j)));
  }
  auto results = run_on_devices(
      cpus(n), types, [&](const auto& xs, const auto& signals) { return as_values(embed(as_tensors(xs), signals)); },
      embed.state_dict(), data);
  std::vector<float> expected;
  for (int64_t id : ids) expected.insert(expected.end(), table.begin() + id * dim, table.begin() + (id + 1) * dim);
  ASSERT_EQ(results.size(), static_cast<size_t>(n));
  for (int j = 0; j < n; ++j) {
    EXPECT_EQ(results[j].shape(), (std::vector<int64_t>{2, 4, dim}));
    EXPECT_EQ(results[j].to_vector<float>(), expected) << "device " << j;  // exact: a sum of one row and zeros
  }
}

INSTANTIATE_TEST_SUITE_P(Devices, ParallelLayers, ::testing::Values(1, 2, 4),
                         [](const auto& info) { return std::to_string(info.param) + "cpus"; });

// ==== ShardedTransformer against nn::Transformer ====================================================

struct ModelCase {
  std::string name;
  int devices;
  int64_t kv_heads;
  bool tied;
  bool attention_bias = false;
};

void PrintTo(const ModelCase& c, std::ostream* os) { *os << c.name; }

class ShardedLogits : public ::testing::TestWithParam<ModelCase> {};

// Full-checkpoint weights by the hashed recipe of the Llama reference tests, keyed by Hugging Face name.
WeightsRegistry hashed_checkpoint(const nn::Module& unsharded) {
  WeightsRegistry out;
  for (const auto& [name, w] : unsharded.raw_state_dict())
    out.emplace(name, nn::hashed_weights::make(name, w.shape.static_dims()));
  return out;
}

engine::Model load(nn::Module& model, const std::vector<DeviceRef>& devices, const WeightsRegistry& weights) {
  graph::Graph g("llama", model.input_tree()->flatten());
  trace_into(g, model);
  engine::InferenceSession session(devices);
  return session.load(g, weights);
}

TEST_P(ShardedLogits, PrefillAndDecodeMatchTheSingleDeviceTransformer) {
  const ModelCase& mc = GetParam();
  nn::LlamaConfig config = small_config(mc.kv_heads, mc.tied);
  config.attention_bias = mc.attention_bias;
  const int64_t head_dim = config.resolved_head_dim();

  nn::Transformer reference(config, kCacheLen);
  const WeightsRegistry checkpoint = hashed_checkpoint(reference);
  engine::Model reference_model = load(reference, {DeviceRef::CPU()}, checkpoint);

  const std::vector<DeviceRef> devices = cpus(mc.devices);
  nn::ShardedTransformer sharded(config, nn::Sharding{devices}, kCacheLen);
  sharded.load_state_dict(checkpoint);
  engine::Model sharded_model = load(sharded, devices, sharded.state_dict());

  auto cache_of = [&](int64_t kv_heads, DeviceRef device) {
    return Tensor::zeros(DType::f32, {config.num_hidden_layers, kCacheLen, kv_heads, head_dim}, device);
  };
  Tensor ref_k = cache_of(mc.kv_heads, DeviceRef::CPU()), ref_v = cache_of(mc.kv_heads, DeviceRef::CPU());
  std::vector<Tensor> ks, vs;
  for (const DeviceRef& d : devices) {
    ks.push_back(cache_of(mc.kv_heads / mc.devices, d));
    vs.push_back(cache_of(mc.kv_heads / mc.devices, d));
  }
  engine::Signals signals(devices);

  const std::vector<int64_t> prompt{1, 17, 93, 5, 127, 64, 40};
  // Tokens [begin, end) after `begin` already cached: prefill 0..5, then one decode step each.
  for (auto [begin, end] : std::vector<std::pair<int64_t, int64_t>>{{0, 5}, {5, 6}, {6, 7}}) {
    Tensor tokens = Tensor::from_vector(std::vector<int64_t>(prompt.begin() + begin, prompt.begin() + end), {end - begin});
    Tensor mask = Tensor::from_vector(std::vector<int64_t>(static_cast<size_t>(end), 1), {end});
    auto expected = reference_model.execute({tokens, mask, ref_k, ref_v})[0].to_vector<float>();
    std::vector<Tensor> inputs{tokens, mask};
    inputs.insert(inputs.end(), ks.begin(), ks.end());
    inputs.insert(inputs.end(), vs.begin(), vs.end());
    if (devices.size() >= 2) inputs.insert(inputs.end(), signals.buffers().begin(), signals.buffers().end());
    auto out = sharded_model.execute(inputs);
    ASSERT_EQ(out.size(), 1u);
    EXPECT_EQ(out[0].shape(), (std::vector<int64_t>{end - begin, config.vocab_size}));
    EXPECT_EQ(out[0].device(), devices[0]);
    auto got = out[0].to_vector<float>();
    ASSERT_EQ(got.size(), expected.size());
    double max_ref = 0, worst = 0;
    for (size_t i = 0; i < got.size(); ++i) {
      max_ref = std::max(max_ref, static_cast<double>(std::abs(expected[i])));
      worst = std::max(worst, static_cast<double>(std::abs(got[i] - expected[i])));
    }
    ASSERT_GT(max_ref, 0.0);
    EXPECT_LE(worst / max_ref, 1e-5) << "tokens " << begin << ".." << end;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Configs, ShardedLogits,
    ::testing::Values(ModelCase{"one_device", 1, 2, false}, ModelCase{"two_devices_untied", 2, 4, false},
                      ModelCase{"two_devices_tied", 2, 4, true}, ModelCase{"two_devices_gqa", 2, 2, false},
                      ModelCase{"two_devices_qkv_bias", 2, 2, true, true},
                      ModelCase{"four_devices_untied", 4, 4, false}, ModelCase{"four_devices_tied", 4, 4, true}),
    [](const auto& info) { return info.param.name; });

}  // namespace
