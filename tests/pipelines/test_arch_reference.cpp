// Every architecture beside Llama against its Hugging Face model: tools/reference/arch_reference.py ran
// each tiny config (stored as the config.json a checkpoint carries, so load_model_info parses it here)
// in plain torch over hashed weights (tests/nn/hashed_weights.h) and wrote the logits to
// tests/data/arch_reference_<name>.json. The prompt (12 tokens) is longer than every sliding window.
// Checked: the whole prompt at once; a 5-token prefill and single-token decode steps through the
// contiguous KV cache; the same through the paged cache GenerationEngine runs (a scattered block
// table); and that check_checkpoint expects exactly the tensors the model declares. Gemma 2 and 3
// are also written as GGUF files the way llama.cpp's converter writes them and loaded from the file
// alone.
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
#include "kiln/pipelines/gguf.h"
#include "kiln/pipelines/gguf_model.h"
#include "kiln/pipelines/hf_config.h"
#include "nn/hashed_weights.h"
#include "pipelines/gguf_writer.h"

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

// The model's graph loaded with `weights` (default: hashed ones).
engine::Model load_model(nn::Transformer& model, std::optional<WeightsRegistry> weights = std::nullopt) {
  const nn::TypeTree tree = *model.input_tree();
  graph::Graph g("model", tree.flatten());
  {
    graph::Graph::Scope scope(g);
    g.output(model.forward({tree.unflatten(g.inputs())}).flatten());
  }
  engine::InferenceSession session({DeviceRef::CPU()});
  return session.load(g, weights ? std::move(*weights) : hashed(model));
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
  ContiguousRun(nn::Transformer& t, const nn::LlamaConfig& c, std::optional<WeightsRegistry> weights = std::nullopt)
      : model(load_model(t, std::move(weights))) {
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

namespace {

// ---- Gemma from GGUF -------------------------------------------------------------------------------

// llama.cpp's name of a Hugging Face Gemma tensor (gguf-py's tensor map), written out here so the test
// does not share kiln's table.
std::string gguf_tensor_name(const std::string& hf) {
  static const std::map<std::string, std::string> kGlobal{{"model.embed_tokens.weight", "token_embd.weight"},
                                                          {"model.norm.weight", "output_norm.weight"}};
  static const std::map<std::string, std::string> kLayer{
      {"input_layernorm.weight", "attn_norm.weight"},
      {"post_attention_layernorm.weight", "post_attention_norm.weight"},
      {"pre_feedforward_layernorm.weight", "ffn_norm.weight"},
      {"post_feedforward_layernorm.weight", "post_ffw_norm.weight"},
      {"self_attn.q_proj.weight", "attn_q.weight"},
      {"self_attn.k_proj.weight", "attn_k.weight"},
      {"self_attn.v_proj.weight", "attn_v.weight"},
      {"self_attn.o_proj.weight", "attn_output.weight"},
      {"self_attn.q_norm.weight", "attn_q_norm.weight"},
      {"self_attn.k_norm.weight", "attn_k_norm.weight"},
      {"mlp.gate_proj.weight", "ffn_gate.weight"},
      {"mlp.up_proj.weight", "ffn_up.weight"},
      {"mlp.down_proj.weight", "ffn_down.weight"},
  };
  if (auto it = kGlobal.find(hf); it != kGlobal.end()) return it->second;
  const size_t dot = hf.find('.', std::string("model.layers.").size());
  const std::string layer = hf.substr(std::string("model.layers.").size(), dot - std::string("model.layers.").size());
  return "blk." + layer + "." + kLayer.at(hf.substr(dot + 1));
}

// A Gemma 2 or 3 config and its weights as a GGUF file, as conversion/gemma.py writes them: the
// config as `{arch}.*` keys (no query_pre_attn_scalar, which llama.cpp derives), f32 tensors in ggml's
// dim order, and every norm weight stored as 1 + w.
std::filesystem::path write_gemma_gguf(const std::string& arch, const json& cfg, const WeightsRegistry& weights) {
  namespace w = kiln::testing::gguf_writer;
  w::Spec spec;
  const auto u32 = [&](const std::string& key, const char* field) {
    spec.metadata.push_back({arch + "." + key, w::u32(cfg.at(field).get<uint32_t>())});
  };
  const auto f32 = [&](const std::string& key, double v) {
    spec.metadata.push_back({arch + "." + key, w::f32(static_cast<float>(v))});
  };
  spec.metadata.push_back({"general.architecture", w::str(arch)});
  u32("context_length", "max_position_embeddings");
  u32("embedding_length", "hidden_size");
  u32("block_count", "num_hidden_layers");
  u32("feed_forward_length", "intermediate_size");
  u32("attention.head_count", "num_attention_heads");
  u32("attention.head_count_kv", "num_key_value_heads");
  u32("attention.key_length", "head_dim");
  u32("attention.value_length", "head_dim");
  u32("attention.sliding_window", "sliding_window");
  f32("attention.layer_norm_rms_epsilon", cfg.at("rms_norm_eps").get<double>());
  f32("rope.freq_base", cfg.at("rope_theta").get<double>());
  if (arch == "gemma2") {
    f32("attn_logit_softcapping", cfg.at("attn_logit_softcapping").get<double>());
    f32("final_logit_softcapping", cfg.at("final_logit_softcapping").get<double>());
  } else {
    u32("attention.sliding_window_pattern", "sliding_window_pattern");
    f32("rope.freq_base_swa", cfg.at("rope_local_base_freq").get<double>());
    spec.metadata.push_back({arch + ".rope.scaling.type", w::str(cfg.at("rope_scaling").at("rope_type").get<std::string>())});
    f32("rope.scaling.factor", cfg.at("rope_scaling").at("factor").get<double>());
  }
  for (const auto& [name, tensor] : weights) {
    std::vector<float> values = tensor.to_vector<float>();
    if (name.ends_with("norm.weight"))
      for (float& v : values) v += 1.0f;
    std::vector<uint64_t> dims(tensor.shape().rbegin(), tensor.shape().rend());
    spec.tensors.emplace_back(gguf_tensor_name(name), dims, w::GGMLType::f32,
                              std::string(reinterpret_cast<const char*>(values.data()), values.size() * 4));
  }
  const fs::path path = fs::temp_directory_path() / ("kiln_arch_reference_" + arch + ".gguf");
  w::write_file(path, w::build(spec).bytes);
  return path;
}

json config_of(const Reference& ref) {
  std::ifstream in(ref.dir / "config.json");
  return json::parse(in);
}

// Gemma 3's file gives the Hugging Face model's logits: the same tolerance as the checkpoint.
TEST(GGUFGemma, Gemma3FileGivesTheHuggingFaceLogits) {
  Reference ref = load_reference("gemma3");
  nn::Transformer hf_model(ref.info.config, kCacheLen);
  const fs::path path = write_gemma_gguf("gemma3", config_of(ref), hashed(hf_model));
  const pipelines::GGUFFile file = pipelines::GGUFFile::open(path);
  const pipelines::ModelInfo info = pipelines::gguf_model_info(file);
  const nn::LlamaConfig& c = info.config;
  EXPECT_EQ(c.sliding_layers, ref.info.config.sliding_layers);  // pattern 3: layer 2 global
  EXPECT_EQ(c.sliding_window, ref.info.config.sliding_window);
  EXPECT_EQ(c.rope_local_theta, ref.info.config.rope_local_theta);
  EXPECT_EQ(c.query_pre_attn_scalar, ref.info.config.query_pre_attn_scalar);  // head_dim, as llama.cpp
  EXPECT_FALSE(c.final_logit_softcapping.has_value());
  EXPECT_FALSE(c.norm_unit_offset);  // the file's norms hold 1 + w
  nn::Transformer model(c, kCacheLen);
  ContiguousRun run(model, c, pipelines::gguf_weights(file, info, nn::WeightFormat::f32));
  const auto n = static_cast<int64_t>(ref.tokens.size());
  const double error = relative_error(ref, run.run(ref.tokens, 0, n), 0, n);
  std::printf("[ gemma3 GGUF ] whole prompt: relative error %.3g\n", error);
  EXPECT_LE(error, kTolerance);
  fs::remove(path);
}

// Gemma 2's file carries no query_pre_attn_scalar: llama.cpp scales by head_dim^-1/2 (the 2B and 9B
// models' value), so the file gives what the checkpoint gives with that value; everything else as
// the checkpoint says (even layers slide, both soft caps).
TEST(GGUFGemma, Gemma2FileGivesTheCheckpointWithLlamaCppsAttentionScale) {
  Reference ref = load_reference("gemma2");
  nn::Transformer hf_model(ref.info.config, kCacheLen);
  const WeightsRegistry weights = hashed(hf_model);
  const fs::path path = write_gemma_gguf("gemma2", config_of(ref), weights);
  const pipelines::GGUFFile file = pipelines::GGUFFile::open(path);
  const pipelines::ModelInfo info = pipelines::gguf_model_info(file);
  nn::LlamaConfig expected = ref.info.config;
  expected.query_pre_attn_scalar = static_cast<double>(expected.resolved_head_dim());
  EXPECT_EQ(info.config.query_pre_attn_scalar, expected.query_pre_attn_scalar);
  EXPECT_EQ(info.config.sliding_layers, expected.sliding_layers);
  EXPECT_EQ(info.config.attn_logit_softcapping, expected.attn_logit_softcapping);
  EXPECT_EQ(info.config.final_logit_softcapping, expected.final_logit_softcapping);

  nn::Transformer want_model(expected, kCacheLen);
  ContiguousRun want_run(want_model, expected, weights);
  nn::Transformer model(info.config, kCacheLen);
  ContiguousRun run(model, info.config, pipelines::gguf_weights(file, info, nn::WeightFormat::f32));
  const auto n = static_cast<int64_t>(ref.tokens.size());
  const std::vector<float> want = want_run.run(ref.tokens, 0, n), got = run.run(ref.tokens, 0, n);
  ASSERT_EQ(got.size(), want.size());
  double scale = 0, worst = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    scale = std::max(scale, std::abs(double(want[i])));
    worst = std::max(worst, std::abs(double(got[i]) - want[i]));
  }
  EXPECT_LE(worst / scale, 1e-5);  // only the norms' 1 + w rounds differently
  // And the scale is not a no-op here: the checkpoint's own 24 gives other logits.
  double apart = 0;
  ContiguousRun ref_run(hf_model, ref.info.config, weights);
  const std::vector<float> own = ref_run.run(ref.tokens, 0, n);
  for (size_t i = 0; i < want.size(); ++i) apart = std::max(apart, std::abs(double(own[i]) - want[i]));
  EXPECT_GT(apart / scale, 1e-3);
  fs::remove(path);
}

// A pattern the model cannot have is refused naming the key.
TEST(GGUFGemma, BadSlidingWindowPatternIsRefusedNamingTheKey) {
  Reference ref = load_reference("gemma3");
  nn::Transformer hf_model(ref.info.config, kCacheLen);
  json cfg = config_of(ref);
  cfg["sliding_window_pattern"] = 0;
  const fs::path path = write_gemma_gguf("gemma3", cfg, hashed(hf_model));
  const pipelines::GGUFFile file = pipelines::GGUFFile::open(path);
  try {
    pipelines::gguf_model_info(file);
    ADD_FAILURE() << "pattern 0 accepted";
  } catch (const LoadError& e) {
    EXPECT_NE(std::string(e.what()).find("gemma3.attention.sliding_window_pattern"), std::string::npos) << e.what();
  }
  fs::remove(path);
}

}  // namespace
