// Every architecture beside Llama against its Hugging Face model: tools/reference/arch_reference.py ran
// each tiny config (stored as the config.json a checkpoint carries, so load_model_info parses it here)
// in plain torch over hashed weights (tests/nn/hashed_weights.h) and wrote the logits to
// tests/data/arch_reference_<name>.json. The prompt (12 tokens) is longer than every sliding window.
// Checked: the whole prompt at once; a 5-token prefill and single-token decode steps through the
// contiguous KV cache; the same through the paged cache GenerationEngine runs (a scattered block
// table); and that check_checkpoint expects exactly the tensors the model declares.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "kiln/engine/session.h"
#include "kiln/nn/transformer.h"
#include "kiln/pipelines/hf_config.h"
#include "nn/hashed_weights.h"

namespace {

using namespace kiln;
using nlohmann::json;
namespace fs = std::filesystem;

constexpr int64_t kCacheLen = 16;
constexpr int64_t kBlockSize = 4;
constexpr double kTolerance = 1e-4;  // max |kiln - torch| / max |torch logit|

struct Reference {
  pipelines::ModelInfo info;
  fs::path dir;  // holds the config.json
  std::vector<int64_t> tokens;
  std::vector<std::vector<double>> logits;  // [seq][vocab]
  double max_abs = 0;
};

Reference load_reference(const std::string& name) {
  const fs::path path =
      fs::path(__FILE__).parent_path().parent_path() / "data" / ("arch_reference_" + name + ".json");
  std::ifstream file(path);
  if (!file) throw std::runtime_error("cannot open " + path.string());
  const json doc = json::parse(file);
  Reference r;
  r.dir = fs::temp_directory_path() / ("kiln_arch_reference_" + name);
  fs::create_directories(r.dir);
  std::ofstream(r.dir / "config.json") << doc.at("config").dump();
  r.info = pipelines::load_model_info(r.dir);
  r.tokens = doc.at("tokens").get<std::vector<int64_t>>();
  r.logits = doc.at("logits").get<std::vector<std::vector<double>>>();
  for (const auto& row : r.logits)
    for (double v : row) r.max_abs = std::max(r.max_abs, std::abs(v));
  return r;
}

WeightsRegistry hashed(const nn::Module& model) {
  WeightsRegistry weights;
  for (const auto& [name, w] : model.raw_state_dict())
    weights.emplace(name, nn::hashed_weights::make(name, w.shape.static_dims()));
  return weights;
}

engine::Model load_model(nn::Transformer& model) {
  const nn::TypeTree tree = *model.input_tree();
  graph::Graph g("model", tree.flatten());
  {
    graph::Graph::Scope scope(g);
    g.output(model.forward({tree.unflatten(g.inputs())}).flatten());
  }
  engine::InferenceSession session({DeviceRef::CPU()});
  return session.load(g, hashed(model));
}

// Max |got - reference| over rows [begin, end), relative to the reference's max |logit|.
double relative_error(const Reference& ref, const std::vector<float>& got, int64_t begin, int64_t end) {
  const size_t vocab = ref.logits[0].size();
  EXPECT_EQ(got.size(), static_cast<size_t>(end - begin) * vocab);
  double worst = 0;
  for (int64_t r = begin; r < end; ++r)
    for (size_t i = 0; i < vocab && (r - begin) * vocab + i < got.size(); ++i)
      worst = std::max(worst, std::abs(got[(r - begin) * vocab + i] - ref.logits[r][i]));
  return worst / ref.max_abs;
}

// The contiguous cache: tokens [begin, end) after `begin` already in it.
struct ContiguousRun {
  engine::Model model;
  Tensor k, v;
  ContiguousRun(nn::Transformer& t, const nn::LlamaConfig& c) : model(load_model(t)) {
    const std::vector<int64_t> shape{c.num_hidden_layers, kCacheLen, c.num_key_value_heads,
                                     c.resolved_head_dim()};
    k = Tensor::zeros(DType::f32, shape);
    v = Tensor::zeros(DType::f32, shape);
  }
  std::vector<float> run(const std::vector<int64_t>& prompt, int64_t begin, int64_t end) {
    std::vector<int64_t> tokens(prompt.begin() + begin, prompt.begin() + end);
    auto out =
        model.execute({Tensor::from_vector(tokens, {end - begin}),
                       Tensor::from_vector(std::vector<int64_t>(static_cast<size_t>(end), 1), {end}), k, v});
    return out.at(0).to_vector<float>();
  }
};

// The paged cache, one sequence over blocks 3, 0, 2, 1 of 5 (out of order, so the table matters).
struct PagedRun {
  engine::Model model;
  Tensor k, v;
  std::vector<int64_t> table{3, 0, 2, 1};
  PagedRun(nn::Transformer& t, const nn::LlamaConfig& c) : model(load_model(t)) {
    const std::vector<int64_t> shape{c.num_hidden_layers, 5, kBlockSize, c.num_key_value_heads,
                                     c.resolved_head_dim()};
    k = Tensor::zeros(DType::f32, shape);
    v = Tensor::zeros(DType::f32, shape);
  }
  std::vector<float> run(const std::vector<int64_t>& prompt, int64_t begin, int64_t end) {
    const int64_t n = end - begin;
    std::vector<int64_t> tokens(prompt.begin() + begin, prompt.begin() + end), positions, slots, rows;
    for (int64_t p = begin; p < end; ++p) {
      positions.push_back(p);
      slots.push_back(table[static_cast<size_t>(p / kBlockSize)] * kBlockSize + p % kBlockSize);
      rows.push_back(p - begin);
    }
    auto out = model.execute({Tensor::from_vector(tokens, {n}), Tensor::from_vector(positions, {n}),
                              Tensor::from_vector(std::vector<int64_t>(static_cast<size_t>(n), 0), {n}),
                              Tensor::from_vector(slots, {n}), Tensor::from_vector(table, {1, 4}),
                              Tensor::from_vector(rows, {n}), k, v});
    return out.at(0).to_vector<float>();
  }
};

class ArchReference : public ::testing::TestWithParam<std::string> {};

TEST_P(ArchReference, WholePromptMatchesHuggingFaceLogits) {
  Reference ref = load_reference(GetParam());
  nn::Transformer model(ref.info.config, kCacheLen);
  ContiguousRun run(model, ref.info.config);
  const auto n = static_cast<int64_t>(ref.tokens.size());
  const double error = relative_error(ref, run.run(ref.tokens, 0, n), 0, n);
  std::printf("[ %s ] whole prompt: relative error %.3g\n", GetParam().c_str(), error);
  EXPECT_LE(error, kTolerance);
}

// A 5-token prefill, then one decode step per remaining token, each checked; the worst error.
template <class Run>
double prefill_then_decode(const Reference& ref, Run& run) {
  const auto n = static_cast<int64_t>(ref.tokens.size());
  double worst = relative_error(ref, run.run(ref.tokens, 0, 5), 0, 5);
  EXPECT_LE(worst, kTolerance) << "prefill";
  for (int64_t p = 5; p < n; ++p) {
    const double error = relative_error(ref, run.run(ref.tokens, p, p + 1), p, p + 1);
    EXPECT_LE(error, kTolerance) << "decode at position " << p;
    worst = std::max(worst, error);
  }
  return worst;
}

TEST_P(ArchReference, PrefillThenDecodeThroughCacheMatchesHuggingFaceLogits) {
  Reference ref = load_reference(GetParam());
  nn::Transformer model(ref.info.config, kCacheLen);
  ContiguousRun run(model, ref.info.config);
  const double worst = prefill_then_decode(ref, run);
  std::printf("[ %s ] prefill + decode: relative error %.3g\n", GetParam().c_str(), worst);
}

TEST_P(ArchReference, PagedPrefillThenDecodeMatchesHuggingFaceLogits) {
  Reference ref = load_reference(GetParam());
  nn::Transformer model(ref.info.config, nn::PagedKVLayout{kBlockSize, DType::f32}, kCacheLen);
  PagedRun run(model, ref.info.config);
  const double worst = prefill_then_decode(ref, run);
  std::printf("[ %s ] paged prefill + decode: relative error %.3g\n", GetParam().c_str(), worst);
  const auto n = static_cast<int64_t>(ref.tokens.size());
  // The whole prompt again, as one chunk over the same blocks (rewritten in place).
  EXPECT_LE(relative_error(ref, run.run(ref.tokens, 0, n), 0, n), kTolerance) << "paged whole prompt";
}

TEST_P(ArchReference, CheckCheckpointExpectsExactlyTheModelsTensors) {
  Reference ref = load_reference(GetParam());
  nn::Transformer model(ref.info.config, kCacheLen);
  WeightsRegistry weights = hashed(model);
  EXPECT_NO_THROW(pipelines::check_checkpoint(ref.info, ref.dir, weights));
  // Each tensor is required: dropping any one is refused, naming it.
  for (const auto& [name, tensor] : hashed(model)) {
    WeightsRegistry fewer = weights;
    fewer.erase(name);
    try {
      pipelines::check_checkpoint(ref.info, ref.dir, fewer);
      ADD_FAILURE() << "no error without " << name;
    } catch (const LoadError& e) {
      EXPECT_NE(std::string(e.what()).find("'" + name + "'"), std::string::npos) << e.what();
    }
  }
}

INSTANTIATE_TEST_SUITE_P(TinyConfigs, ArchReference,
                         ::testing::Values("mistral_window", "qwen2_window", "qwen3", "gemma2", "gemma3",
                                           "phi3", "smollm"));

}  // namespace
