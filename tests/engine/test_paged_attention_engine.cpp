// The paged KV cache ops end to end through InferenceSession: a two-layer graph that stores each
// layer's keys and values with paged_kv_store, then attends over them with paged_attention (this
// step's tokens included), over two steps (a ragged prefill, then decode) into the caller's caches.
// Each layer's store feeds its attention and the attention feeds the next layer's store, so any
// reordering of the buffer ops changes the result. The graph also runs after a text round trip and
// after an artifact round trip, with the same bits.
#include <cmath>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "kiln/kiln.h"

namespace {

using namespace kiln;
namespace ops = kiln::graph::ops;
using graph::BufferType;
using graph::Dim;
using graph::TensorType;
using ops::SliceIndex;

constexpr int64_t kLayers = 2, kBlocks = 8, kBlockSize = 2, kKvHeads = 2, kHeads = 4, kHeadDim = 4;
constexpr double kScale = 0.5;

// Per layer: k = h's first two heads, v = -(its last two), both stored; h = paged_attention(h) + x.
graph::Graph paged_step_graph(DType cache_dtype) {
  const graph::Shape cache{kLayers, kBlocks, kBlockSize, kKvHeads, kHeadDim};
  graph::Graph g("paged_step",
                 {BufferType{cache_dtype, cache}, BufferType{cache_dtype, cache},
                  TensorType{DType::f32, {"tokens", kHeads, kHeadDim}}, TensorType{DType::i64, {"tokens"}},
                  TensorType{DType::i64, {"seqs", "max_blocks"}}, TensorType{DType::i64, {"tokens"}},
                  TensorType{DType::i64, {"tokens"}}});
  graph::BufferValue k_cache = g.input(0), v_cache = g.input(1);
  graph::TensorValue x = g.input(2), slots = g.input(3), tables = g.input(4), seq_ids = g.input(5),
                     positions = g.input(6);
  graph::TensorValue h = x;
  for (int64_t layer = 0; layer < kLayers; ++layer) {
    ops::paged_kv_store(k_cache, ops::slice(h, {SliceIndex{}, SliceIndex{0, kKvHeads}}), slots, layer);
    ops::paged_kv_store(v_cache, ops::neg(ops::slice(h, {SliceIndex{}, SliceIndex{kKvHeads, kHeads}})), slots, layer);
    h = ops::add(ops::paged_attention(h, k_cache, v_cache, tables, seq_ids, positions, layer, kScale), x);
  }
  g.output({h});
  return g;
}

double rounded(double x, DType dtype) {
  if (dtype == DType::bf16) return static_cast<float>(bf16_t(static_cast<float>(x)));
  if (dtype == DType::f16) return static_cast<float>(f16_t(static_cast<float>(x)));
  return static_cast<float>(x);
}

// The same computation in double, over a dense history per (layer, sequence) of [position][kv head * head_dim].
struct Reference {
  DType dtype;
  std::vector<std::vector<std::vector<std::vector<double>>>> k, v;  // [layer][seq][position]

  std::vector<double> step(const std::vector<double>& x, const std::vector<int64_t>& seq_ids,
                           const std::vector<int64_t>& positions) {
    const size_t tokens = seq_ids.size();
    const int64_t group = kHeads / kKvHeads, row = kHeads * kHeadDim, half = kKvHeads * kHeadDim;
    std::vector<double> h = x;
    for (int64_t layer = 0; layer < kLayers; ++layer) {
      for (size_t t = 0; t < tokens; ++t) {
        auto& ks = k[static_cast<size_t>(layer)][static_cast<size_t>(seq_ids[t])];
        auto& vs = v[static_cast<size_t>(layer)][static_cast<size_t>(seq_ids[t])];
        const auto p = static_cast<size_t>(positions[t]);
        if (ks.size() <= p) ks.resize(p + 1), vs.resize(p + 1);
        ks[p].clear(), vs[p].clear();
        for (int64_t i = 0; i < half; ++i) {
          ks[p].push_back(rounded(h[t * row + static_cast<size_t>(i)], dtype));
          vs[p].push_back(rounded(-h[t * row + static_cast<size_t>(half + i)], dtype));
        }
      }
      std::vector<double> next(h.size());
      for (size_t t = 0; t < tokens; ++t) {
        const auto& ks = k[static_cast<size_t>(layer)][static_cast<size_t>(seq_ids[t])];
        const auto& vs = v[static_cast<size_t>(layer)][static_cast<size_t>(seq_ids[t])];
        for (int64_t head = 0; head < kHeads; ++head) {
          const int64_t kv = head / group;
          std::vector<double> p;
          double max = -INFINITY, sum = 0;
          for (int64_t j = 0; j <= positions[t]; ++j) {
            double dot = 0;
            for (int64_t i = 0; i < kHeadDim; ++i)
              dot += h[t * row + static_cast<size_t>(head * kHeadDim + i)] *
                     ks[static_cast<size_t>(j)][static_cast<size_t>(kv * kHeadDim + i)];
            p.push_back(dot * kScale);
            max = std::max(max, p.back());
          }
          for (double& s : p) sum += (s = std::exp(s - max));
          for (int64_t i = 0; i < kHeadDim; ++i) {
            double acc = 0;
            for (size_t j = 0; j < p.size(); ++j) acc += p[j] / sum * vs[j][static_cast<size_t>(kv * kHeadDim + i)];
            const size_t at = t * row + static_cast<size_t>(head * kHeadDim + i);
            next[at] = acc + x[at];
          }
        }
      }
      h = next;
    }
    return h;
  }
};

struct Step {
  std::vector<int64_t> seq_ids, positions;
};

// Sequence 0's blocks are 5, 2, 7 and sequence 1's are 1, 6 (shuffled, never adjacent); the third
// column of sequence 1 is padding.
const std::vector<int64_t> kTables = {5, 2, 7, 1, 6, -1};

std::vector<Tensor> step_inputs(const Tensor& k, const Tensor& v, const std::vector<double>& x, const Step& s) {
  const auto n = static_cast<int64_t>(s.seq_ids.size());
  std::vector<int64_t> slots;
  for (size_t t = 0; t < s.seq_ids.size(); ++t)
    slots.push_back(kTables[static_cast<size_t>(s.seq_ids[t] * 3 + s.positions[t] / kBlockSize)] * kBlockSize +
                    s.positions[t] % kBlockSize);
  std::vector<float> xf(x.begin(), x.end());
  return {k, v, Tensor::from_vector<float>(xf, {n, kHeads, kHeadDim}), Tensor::from_vector<int64_t>(slots, {n}),
          Tensor::from_vector<int64_t>(kTables, {2, 3}), Tensor::from_vector<int64_t>(s.seq_ids, {n}),
          Tensor::from_vector<int64_t>(s.positions, {n})};
}

// Two steps: a ragged prefill (sequence 0's 5 prompt tokens, sequence 1's 3), then one decode token
// each, in the other order. Each model gets caches of its own; returns every step's output.
std::vector<std::vector<float>> run_steps(engine::Model& model, DType dtype, Reference* reference) {
  const size_t cache_elements = static_cast<size_t>(kLayers * kBlocks * kBlockSize * kKvHeads * kHeadDim);
  std::vector<uint32_t> k_storage(cache_elements, 0xFFFFFFFFu), v_storage(cache_elements, 0xFFFFFFFFu);  // NaN
  const std::vector<int64_t> shape{kLayers, kBlocks, kBlockSize, kKvHeads, kHeadDim};
  Tensor k = Tensor::borrow(k_storage.data(), dtype, shape), v = Tensor::borrow(v_storage.data(), dtype, shape);
  const std::vector<Step> steps = {{{0, 0, 0, 0, 0, 1, 1, 1}, {0, 1, 2, 3, 4, 0, 1, 2}}, {{1, 0}, {3, 5}}};
  std::vector<std::vector<float>> outputs;
  uint32_t seed = 3;
  for (const Step& s : steps) {
    std::vector<double> x;
    for (size_t i = 0; i < s.seq_ids.size() * kHeads * kHeadDim; ++i) {
      seed = seed * 1664525u + 1013904223u;
      x.push_back(static_cast<double>(seed >> 8) / static_cast<double>(1u << 23) - 1.0);
    }
    auto out = model.execute(step_inputs(k, v, x, s));
    outputs.push_back(out.at(0).to_vector<float>());
    if (reference) {
      const std::vector<double> want = reference->step(x, s.seq_ids, s.positions);
      const std::vector<float>& got = outputs.back();
      EXPECT_EQ(got.size(), want.size());
      for (size_t i = 0; i < want.size() && i < got.size(); ++i)
        EXPECT_NEAR(got[i], want[i], 2e-5 * std::max(1.0, std::abs(want[i]))) << "step element " << i;
    }
  }
  return outputs;
}

void check_paged_step(DType dtype) {
  SCOPED_TRACE(dtype_name(dtype));
  graph::Graph g = paged_step_graph(dtype);
  engine::InferenceSession session;
  engine::Model model = session.load(g);
  Reference reference{dtype, std::vector<std::vector<std::vector<std::vector<double>>>>(kLayers, {{}, {}}),
                      std::vector<std::vector<std::vector<std::vector<double>>>>(kLayers, {{}, {}})};
  const auto direct = run_steps(model, dtype, &reference);

  // Printed and parsed back, the graph runs the same bits.
  graph::Module parsed = graph::parse_module(graph::print(g.module()));
  EXPECT_EQ(graph::print(parsed), graph::print(g.module()));
  auto from_text = session.load_all(parsed);
  EXPECT_EQ(run_steps(from_text.at("paged_step"), dtype, nullptr), direct);

  // So does the compiled artifact, serialized and loaded again.
  compiler::CompiledModel loaded = compiler::CompiledModel::deserialize(session.compile(g.module()).serialize());
  auto from_artifact = session.init(loaded, {});
  EXPECT_EQ(run_steps(from_artifact.at("paged_step"), dtype, nullptr), direct);
}

}  // namespace

TEST(PagedAttentionEngine, StoreThenAttendOverTwoLayersAndTwoStepsMatchesTheReference) {
  check_paged_step(DType::f32);
  check_paged_step(DType::bf16);
}

TEST(PagedAttentionEngine, AnOutOfRangeSlotNamesTheOpAndToken) {
  graph::Graph g = paged_step_graph(DType::f32);
  engine::InferenceSession session;
  engine::Model model = session.load(g);
  std::vector<float> k(kLayers * kBlocks * kBlockSize * kKvHeads * kHeadDim), v(k.size());
  const std::vector<int64_t> shape{kLayers, kBlocks, kBlockSize, kKvHeads, kHeadDim};
  auto inputs = step_inputs(Tensor::borrow(k.data(), DType::f32, shape), Tensor::borrow(v.data(), DType::f32, shape),
                            std::vector<double>(2 * kHeads * kHeadDim, 0.5), {{0, 1}, {0, 0}});
  inputs[3] = Tensor::from_vector<int64_t>({0, kBlocks * kBlockSize}, {2});
  try {
    model.execute(inputs);
    ADD_FAILURE() << "expected an ExecutionError";
  } catch (const ExecutionError& e) {
    const std::string message = e.what();
    for (const char* part : {"paged_kv_store", "token 1", "slot 16"})
      EXPECT_NE(message.find(part), std::string::npos) << "'" << part << "' not in: " << message;
  }
}
