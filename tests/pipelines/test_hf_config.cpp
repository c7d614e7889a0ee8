// load_model_info: config.json files as Hugging Face publishes them (Llama 3.2, TinyLlama, Qwen2),
// written to a temp dir, and the errors for broken or unsupported ones.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <kiln/kiln.h>
#include <kiln/pipelines/generation_engine.h>
#include <kiln/pipelines/hf_config.h>
#include <kiln/pipelines/safetensors.h>
#include <kiln/pipelines/text_generation.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "test_util.h"

using namespace kiln;
using namespace kiln::pipelines;
namespace fs = std::filesystem;

using kiln::testing::error_message;

namespace {

class HfConfig : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::temp_directory_path() / fmt::format("kiln_hf_config_{}_{}", info->name(), ::getpid());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  void write(const std::string& name, const std::string& text) const { std::ofstream(dir_ / name) << text; }
  std::string config_path() const { return (dir_ / "config.json").string(); }
  fs::path dir_;
};

// meta-llama/Llama-3.2-1B-Instruct's config.json.
const char* kLlama32 = R"({
  "architectures": ["LlamaForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
  "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "head_dim": 64,
  "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 8192,
  "max_position_embeddings": 131072, "mlp_bias": false, "model_type": "llama",
  "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8, "pretraining_tp": 1,
  "rms_norm_eps": 1e-05,
  "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                   "original_max_position_embeddings": 8192, "rope_type": "llama3"},
  "rope_theta": 500000.0, "tie_word_embeddings": true, "torch_dtype": "bfloat16",
  "transformers_version": "4.45.0.dev0", "use_cache": true, "vocab_size": 128256})";

// TinyLlama/TinyLlama-1.1B-Chat-v1.0's config.json.
const char* kTinyLlama = R"({
  "architectures": ["LlamaForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
  "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 5632,
  "max_position_embeddings": 2048, "model_type": "llama", "num_attention_heads": 32,
  "num_hidden_layers": 22, "num_key_value_heads": 4, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
  "rope_scaling": null, "rope_theta": 10000.0, "tie_word_embeddings": false, "torch_dtype": "bfloat16",
  "transformers_version": "4.35.0", "use_cache": true, "vocab_size": 32000})";

// Qwen/Qwen2-0.5B-Instruct's config.json (no attention_bias field: Qwen2 always has q/k/v biases).
const char* kQwen2 = R"({
  "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
  "eos_token_id": 151645, "hidden_act": "silu", "hidden_size": 896, "initializer_range": 0.02,
  "intermediate_size": 4864, "max_position_embeddings": 32768, "max_window_layers": 24,
  "model_type": "qwen2", "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2,
  "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": true,
  "torch_dtype": "bfloat16", "transformers_version": "4.40.1", "use_cache": true,
  "use_sliding_window": false, "vocab_size": 151936})";

// The five required fields and nothing else.
const char* kMinimal = R"({"architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 64,
  "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4})";

TEST_F(HfConfig, Llama32ReadsEveryFieldAndLlama3RopeScaling) {
  write("config.json", kLlama32);
  const ModelInfo info = load_model_info(dir_);
  const nn::LlamaConfig& c = info.config;
  EXPECT_EQ(info.architecture, "LlamaForCausalLM");
  EXPECT_EQ(c.vocab_size, 128256);
  EXPECT_EQ(c.hidden_size, 2048);
  EXPECT_EQ(c.intermediate_size, 8192);
  EXPECT_EQ(c.num_hidden_layers, 16);
  EXPECT_EQ(c.num_attention_heads, 32);
  EXPECT_EQ(c.num_key_value_heads, 8);
  EXPECT_EQ(c.head_dim, 64);
  EXPECT_DOUBLE_EQ(c.rms_norm_eps, 1e-5);
  EXPECT_DOUBLE_EQ(c.rope_theta, 500000.0);
  ASSERT_TRUE(c.rope_scaling.has_value());
  EXPECT_DOUBLE_EQ(c.rope_scaling->factor, 32.0);
  EXPECT_DOUBLE_EQ(c.rope_scaling->low_freq_factor, 1.0);
  EXPECT_DOUBLE_EQ(c.rope_scaling->high_freq_factor, 4.0);
  EXPECT_EQ(c.rope_scaling->original_max_position_embeddings, 8192);
  EXPECT_EQ(c.max_position_embeddings, 131072);
  EXPECT_TRUE(c.tie_word_embeddings);
  EXPECT_FALSE(c.attention_bias);
  EXPECT_EQ(c.dtype, DType::bf16);
  EXPECT_EQ(info.bos_token_id, 128000);
  EXPECT_EQ(info.eos_token_ids, (std::vector<int64_t>{128001, 128008, 128009}));
}

TEST_F(HfConfig, TinyLlamaHasNoScalingAndDerivedHeadDim) {
  write("config.json", kTinyLlama);
  const ModelInfo info = load_model_info(dir_);
  const nn::LlamaConfig& c = info.config;
  EXPECT_EQ(c.vocab_size, 32000);
  EXPECT_EQ(c.num_hidden_layers, 22);
  EXPECT_EQ(c.num_key_value_heads, 4);
  EXPECT_FALSE(c.head_dim.has_value());
  EXPECT_EQ(c.resolved_head_dim(), 64);  // 2048 / 32
  EXPECT_FALSE(c.rope_scaling.has_value());
  EXPECT_DOUBLE_EQ(c.rope_theta, 10000.0);
  EXPECT_EQ(c.max_position_embeddings, 2048);
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_EQ(info.bos_token_id, 1);
  EXPECT_EQ(info.eos_token_ids, (std::vector<int64_t>{2}));
}

TEST_F(HfConfig, Qwen2HasAttentionBiasAndGenerationConfigOverridesIds) {
  write("config.json", kQwen2);
  write("generation_config.json",
        R"({"bos_token_id": 151643, "pad_token_id": 151643, "do_sample": true,
            "eos_token_id": [151645, 151643], "repetition_penalty": 1.1, "top_p": 0.8})");
  const ModelInfo info = load_model_info(dir_);
  const nn::LlamaConfig& c = info.config;
  EXPECT_EQ(info.architecture, "Qwen2ForCausalLM");
  EXPECT_TRUE(c.attention_bias);
  EXPECT_EQ(c.hidden_size, 896);
  EXPECT_EQ(c.num_attention_heads, 14);
  EXPECT_EQ(c.num_key_value_heads, 2);
  EXPECT_DOUBLE_EQ(c.rope_theta, 1e6);
  EXPECT_EQ(c.max_position_embeddings, 32768);  // use_sliding_window is false
  EXPECT_TRUE(c.tie_word_embeddings);
  EXPECT_EQ(info.bos_token_id, 151643);
  EXPECT_EQ(info.eos_token_ids, (std::vector<int64_t>{151645, 151643}));  // from generation_config.json
}

TEST_F(HfConfig, AbsentOptionalFieldsTakeTransformersDefaults) {
  write("config.json", kMinimal);
  const ModelInfo info = load_model_info(dir_);
  const nn::LlamaConfig& c = info.config;
  EXPECT_EQ(c.num_key_value_heads, 4);  // = num_attention_heads
  EXPECT_FALSE(c.head_dim.has_value());
  EXPECT_DOUBLE_EQ(c.rms_norm_eps, 1e-6);
  EXPECT_DOUBLE_EQ(c.rope_theta, 10000.0);
  EXPECT_FALSE(c.rope_scaling.has_value());
  EXPECT_EQ(c.max_position_embeddings, 2048);
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_FALSE(c.attention_bias);
  EXPECT_EQ(c.dtype, DType::f32);
  EXPECT_FALSE(info.bos_token_id.has_value());
  EXPECT_TRUE(info.eos_token_ids.empty());
}

TEST_F(HfConfig, ModelTypeStandsInForMissingArchitectures) {
  write("config.json", R"({"model_type": "qwen2", "vocab_size": 100, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "torch_dtype": "float16"})");
  const ModelInfo info = load_model_info(dir_);
  EXPECT_EQ(info.architecture, "Qwen2ForCausalLM");
  EXPECT_TRUE(info.config.attention_bias);
  EXPECT_EQ(info.config.max_position_embeddings, 32768);
  EXPECT_EQ(info.config.dtype, DType::f16);
}

TEST_F(HfConfig, MistralSlidingWindowIsEveryLayersWindowNotACap) {
  write("config.json", R"({"architectures": ["MistralForCausalLM"], "vocab_size": 32000, "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "max_position_embeddings": 32768, "sliding_window": 4096, "rope_theta": 10000.0})");
  nn::LlamaConfig c = load_model_info(dir_).config;
  EXPECT_EQ(c.max_position_embeddings, 32768);
  EXPECT_EQ(c.sliding_window, 4096);
  EXPECT_TRUE(c.is_sliding(0) && c.is_sliding(31));
  // null is no window (Mistral 7B v0.2+); absent is MistralConfig's default, 4096.
  write("config.json", R"({"architectures": ["MistralForCausalLM"], "vocab_size": 100, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "sliding_window": null})");
  EXPECT_FALSE(load_model_info(dir_).config.sliding_window.has_value());
  write("config.json", R"({"architectures": ["MistralForCausalLM"], "vocab_size": 100, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4})");
  EXPECT_EQ(load_model_info(dir_).config.sliding_window, 4096);
}

TEST_F(HfConfig, Qwen2SlidesFromMaxWindowLayersOnlyWithUseSlidingWindow) {
  const std::string base = R"("architectures": ["Qwen2ForCausalLM"], "vocab_size": 100, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4, "sliding_window": 8, )";
  write("config.json", "{" + base + R"("use_sliding_window": false, "max_window_layers": 2})");
  EXPECT_FALSE(load_model_info(dir_).config.sliding_window.has_value());
  write("config.json", "{" + base + R"("use_sliding_window": true, "max_window_layers": 2})");
  nn::LlamaConfig c = load_model_info(dir_).config;
  EXPECT_EQ(c.sliding_window, 8);
  EXPECT_EQ(c.sliding_layers, (std::vector<bool>{false, false, true, true}));
  // transformers >= 4.53 writes layer_types, which wins.
  write("config.json", "{" + base + R"("use_sliding_window": true, "max_window_layers": 2,
    "layer_types": ["sliding_attention", "full_attention", "full_attention", "sliding_attention"]})");
  EXPECT_EQ(load_model_info(dir_).config.sliding_layers, (std::vector<bool>{true, false, false, true}));
  write("config.json", "{" + base + R"("use_sliding_window": true, "layer_types": ["full_attention"]})");
  EXPECT_NE(error_message<ValueError>([&] { load_model_info(dir_); })
                .find("field 'layer_types' is [\"full_attention\"], expected a list of num_hidden_layers (4)"),
            std::string::npos);
}

// Qwen/Qwen3-0.6B's config.json, trimmed.
TEST_F(HfConfig, Qwen3HasQkNormsAndItsHeadDim) {
  write("config.json", R"({"architectures": ["Qwen3ForCausalLM"], "attention_bias": false, "head_dim": 128,
    "hidden_act": "silu", "hidden_size": 1024, "intermediate_size": 3072, "max_position_embeddings": 40960,
    "max_window_layers": 28, "model_type": "qwen3", "num_attention_heads": 16, "num_hidden_layers": 28,
    "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_scaling": null, "rope_theta": 1000000,
    "sliding_window": null, "tie_word_embeddings": true, "torch_dtype": "bfloat16", "use_sliding_window": false,
    "vocab_size": 151936})");
  const nn::LlamaConfig c = load_model_info(dir_).config;
  EXPECT_TRUE(c.qk_norm);
  EXPECT_EQ(c.resolved_head_dim(), 128);  // not hidden_size / heads = 64
  EXPECT_FALSE(c.attention_bias);
  EXPECT_FALSE(c.sliding_window.has_value());
  EXPECT_TRUE(c.tie_word_embeddings);
  // Qwen 3's attention_bias would bias o_proj too.
  write("config.json", R"({"architectures": ["Qwen3ForCausalLM"], "vocab_size": 100, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "attention_bias": true})");
  EXPECT_NE(error_message<ValueError>([&] { load_model_info(dir_); }).find("field 'attention_bias' is true"),
            std::string::npos);
}

// google/gemma-2-2b-it's config.json, trimmed.
TEST_F(HfConfig, Gemma2AlternatesSlidingLayersAndSoftCaps) {
  write("config.json", R"({"architectures": ["Gemma2ForCausalLM"], "attn_logit_softcapping": 50.0,
    "final_logit_softcapping": 30.0, "head_dim": 256, "hidden_act": "gelu_pytorch_tanh",
    "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 2304, "intermediate_size": 9216,
    "max_position_embeddings": 8192, "model_type": "gemma2", "num_attention_heads": 8, "num_hidden_layers": 26,
    "num_key_value_heads": 4, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_theta": 10000.0,
    "sliding_window": 4096, "torch_dtype": "float32", "vocab_size": 256000})");
  const nn::LlamaConfig c = load_model_info(dir_).config;
  EXPECT_EQ(c.hidden_activation, nn::MLPActivation::geglu_tanh);
  EXPECT_TRUE(c.norm_unit_offset && c.sandwich_norms && c.scale_embeddings && c.tie_word_embeddings);
  EXPECT_FALSE(c.qk_norm);
  EXPECT_EQ(c.query_pre_attn_scalar, 256.0);
  EXPECT_EQ(c.attn_logit_softcapping, 50.0);
  EXPECT_EQ(c.final_logit_softcapping, 30.0);
  EXPECT_EQ(c.sliding_window, 4096);
  EXPECT_TRUE(c.is_sliding(0));
  EXPECT_FALSE(c.is_sliding(1));
  EXPECT_TRUE(c.is_sliding(24));
  EXPECT_FALSE(c.is_sliding(25));
  // null turns a cap off.
  write("config.json", R"({"architectures": ["Gemma2ForCausalLM"], "vocab_size": 100, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "head_dim": 16,
    "attn_logit_softcapping": null})");
  const nn::LlamaConfig d = load_model_info(dir_).config;
  EXPECT_FALSE(d.attn_logit_softcapping.has_value());
  EXPECT_EQ(d.final_logit_softcapping, 30.0);  // Gemma2Config's default
  write("config.json", R"({"architectures": ["Gemma2ForCausalLM"], "vocab_size": 100, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "hidden_activation": "gelu"})");
  EXPECT_NE(error_message<ValueError>([&] { load_model_info(dir_); })
                .find("field 'hidden_activation' is 'gelu', expected 'gelu_pytorch_tanh'"),
            std::string::npos);
}

// google/gemma-3-4b's text config (model_type gemma3_text), trimmed.
TEST_F(HfConfig, Gemma3HasLocalAndGlobalLayers) {
  write("config.json", R"({"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 2560, "intermediate_size": 10240,
    "num_attention_heads": 8, "num_hidden_layers": 34, "num_key_value_heads": 4, "query_pre_attn_scalar": 256,
    "rope_local_base_freq": 10000.0, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
    "rope_theta": 1000000.0, "sliding_window": 1024, "sliding_window_pattern": 6, "vocab_size": 262208,
    "final_logit_softcapping": null, "attn_logit_softcapping": null})");
  const nn::LlamaConfig c = load_model_info(dir_).config;
  EXPECT_TRUE(c.qk_norm && c.norm_unit_offset && c.sandwich_norms && c.scale_embeddings);
  EXPECT_EQ(c.rope_local_theta, 10000.0);
  EXPECT_DOUBLE_EQ(c.rope_theta, 1e6);
  EXPECT_DOUBLE_EQ(c.rope_linear_factor, 8.0);
  EXPECT_FALSE(c.attn_logit_softcapping || c.final_logit_softcapping);
  EXPECT_EQ(c.max_position_embeddings, 131072);
  for (int64_t i = 0; i < 34; ++i) EXPECT_EQ(c.is_sliding(i), (i + 1) % 6 != 0) << i;
}

// microsoft/Phi-3-mini-4k-instruct's config.json, trimmed.
TEST_F(HfConfig, Phi3HasFusedProjectionsAndRefusesLongrope) {
  const std::string base = R"("architectures": ["Phi3ForCausalLM"], "hidden_act": "silu", "hidden_size": 3072,
    "intermediate_size": 8192, "max_position_embeddings": 4096, "model_type": "phi3", "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 32, "original_max_position_embeddings": 4096,
    "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "sliding_window": 2047, "vocab_size": 32064)";
  write("config.json", "{" + base + R"(, "rope_scaling": null})");
  const nn::LlamaConfig c = load_model_info(dir_).config;
  EXPECT_TRUE(c.fused_projections);
  EXPECT_EQ(c.sliding_window, 2047);
  EXPECT_DOUBLE_EQ(c.partial_rotary_factor, 1.0);
  write("config.json", "{" + base + R"(, "partial_rotary_factor": 0.75})");
  EXPECT_EQ(load_model_info(dir_).config.rotary_dim(), 72);
  write("config.json", "{" + base + R"(, "rope_scaling": {"type": "longrope", "long_factor": [1.0],
    "short_factor": [1.0]}})");
  EXPECT_NE(error_message<ValueError>([&] { load_model_info(dir_); })
                .find("field 'rope_scaling' has rope_type 'longrope', which kiln does not support"),
            std::string::npos);
}

// ---- errors ----------------------------------------------------------------------------------------

TEST_F(HfConfig, MissingDirectoryIsLoadError) {
  const std::string msg = error_message<LoadError>([&] { load_model_info(dir_ / "absent"); });
  EXPECT_EQ(msg,
            fmt::format("load_model_info: {}: not a directory (expected a model directory with config.json)",
                        (dir_ / "absent").string()));
}

TEST_F(HfConfig, DirectoryWithoutConfigIsLoadErrorNamingTheFile) {
  EXPECT_EQ(error_message<LoadError>([&] { load_model_info(dir_); }),
            fmt::format("load_model_info: {}: cannot open", config_path()));
}

TEST_F(HfConfig, BadJsonIsLoadErrorNamingTheFile) {
  write("config.json", R"({"vocab_size": 10,)");
  const std::string msg = error_message<LoadError>([&] { load_model_info(dir_); });
  EXPECT_NE(msg.find(config_path() + ": not valid JSON"), std::string::npos) << msg;
}

TEST_F(HfConfig, BadGenerationConfigIsLoadErrorNamingIt) {
  write("config.json", kMinimal);
  write("generation_config.json", "{eos");
  const std::string msg = error_message<LoadError>([&] { load_model_info(dir_); });
  EXPECT_NE(msg.find((dir_ / "generation_config.json").string() + ": not valid JSON"), std::string::npos)
      << msg;
}

TEST_F(HfConfig, UnsupportedArchitectureIsValueErrorListingSupported) {
  write("config.json", R"({"architectures": ["GPT2LMHeadModel"], "vocab_size": 50257})");
  EXPECT_EQ(error_message<ValueError>([&] { load_model_info(dir_); }),
            fmt::format("load_model_info: {}: unsupported architecture 'GPT2LMHeadModel' (supported: "
                        "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, "
                        "Gemma2ForCausalLM, Gemma3ForCausalLM, Phi3ForCausalLM)",
                        config_path()));
}

TEST_F(HfConfig, WrongFieldKindIsValueErrorNamingField) {
  write("config.json", R"({"architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": "64",
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4})");
  EXPECT_EQ(
      error_message<ValueError>([&] { load_model_info(dir_); }),
      fmt::format("load_model_info: {}: field 'hidden_size' is \"64\", expected an integer", config_path()));
  write("config.json", R"({"architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "eos_token_id": [2, "x"]})");
  EXPECT_EQ(
      error_message<ValueError>([&] { load_model_info(dir_); }),
      fmt::format("load_model_info: {}: field 'eos_token_id' is [2,\"x\"], expected an integer or a list of "
                  "integers",
                  config_path()));
  write("config.json", R"({"architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "tie_word_embeddings": 1})");
  EXPECT_EQ(error_message<ValueError>([&] { load_model_info(dir_); }),
            fmt::format("load_model_info: {}: field 'tie_word_embeddings' is 1, expected true or false",
                        config_path()));
}

TEST_F(HfConfig, MissingRequiredFieldIsValueError) {
  write("config.json", R"({"architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 64,
    "num_hidden_layers": 2, "num_attention_heads": 4})");
  EXPECT_EQ(
      error_message<ValueError>([&] { load_model_info(dir_); }),
      fmt::format("load_model_info: {}: field 'intermediate_size' is missing (required)", config_path()));
}

TEST_F(HfConfig, OtherRopeTypesAreValueErrorNamingThem) {
  write("config.json", R"({"architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "rope_scaling": {"type": "yarn", "factor": 4.0}})");
  const std::string msg = error_message<ValueError>([&] { load_model_info(dir_); });
  EXPECT_NE(msg.find("field 'rope_scaling' has rope_type 'yarn', which kiln does not support"),
            std::string::npos)
      << msg;
}

TEST_F(HfConfig, Llama3ScalingWithoutFactorIsValueError) {
  write("config.json", R"({"architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "rope_scaling": {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192}})");
  EXPECT_EQ(error_message<ValueError>([&] { load_model_info(dir_); }),
            fmt::format("load_model_info: {}: field 'rope_scaling.factor' is null, expected a number",
                        config_path()));
}

TEST_F(HfConfig, UnsupportedDTypeIsValueError) {
  write("config.json", R"({"architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "torch_dtype": "float8_e4m3fn"})");
  EXPECT_EQ(
      error_message<ValueError>([&] { load_model_info(dir_); }),
      fmt::format("load_model_info: {}: field 'torch_dtype' is 'float8_e4m3fn', expected float32, float16 or "
                  "bfloat16",
                  config_path()));
}

TEST_F(HfConfig, LlamaAttentionBiasIsRefusedBecauseItAlsoBiasesOProj) {
  write("config.json", R"({"architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "attention_bias": true})");
  const std::string msg = error_message<ValueError>([&] { load_model_info(dir_); });
  EXPECT_NE(msg.find("field 'attention_bias' is true"), std::string::npos) << msg;
}

TEST_F(HfConfig, InconsistentSizesAreValueErrorNamingTheFile) {
  write("config.json", R"({"architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 3})");
  EXPECT_EQ(error_message<ValueError>([&] { load_model_info(dir_); }),
            fmt::format("load_model_info: {}: field 'num_key_value_heads' is 3, which does not divide "
                        "num_attention_heads 4",
                        config_path()));
}

// ==== hostile config.json (issue 19) ================================================================

namespace hostile {

// A small valid config; `extra` replaces or adds fields ("\"num_hidden_layers\": 1e9"), as text so
// that it can hold what no JSON library writes (1e400, deep nesting).
std::string config(const std::string& extra = "") {
  const std::vector<std::pair<std::string, std::string>> base = {{"architectures", R"(["LlamaForCausalLM"])"},
                                                                 {"vocab_size", "100"},
                                                                 {"hidden_size", "64"},
                                                                 {"intermediate_size", "128"},
                                                                 {"num_hidden_layers", "2"},
                                                                 {"num_attention_heads", "4"},
                                                                 {"num_key_value_heads", "2"}};
  std::string text = "{";
  for (const auto& [key, value] : base)
    if (extra.find("\"" + key + "\":") == std::string::npos) text += "\"" + key + "\": " + value + ", ";
  return text + (extra.empty() ? "\"model_type\": \"llama\"" : extra) + "}";
}

}  // namespace hostile

TEST_F(HfConfig, NumberOverflowIsLoadErrorNamingTheFile) {
  write("config.json", hostile::config(R"("rope_theta": 1e400)"));
  const std::string msg = error_message<LoadError>([&] { load_model_info(dir_); });
  EXPECT_NE(msg.find(config_path() + ": not valid JSON at byte "), std::string::npos) << msg;
  EXPECT_NE(msg.find("number overflow parsing '1e400'"), std::string::npos) << msg;

  write("config.json", hostile::config());
  write("generation_config.json", R"({"temperature": -1e400})");
  const std::string gen = error_message<LoadError>([&] { load_model_info(dir_); });
  EXPECT_NE(gen.find((dir_ / "generation_config.json").string() + ": not valid JSON"), std::string::npos)
      << gen;
}

TEST_F(HfConfig, DeeplyNestedFieldIsLoadErrorNotAStackOverflow) {
  // 100k levels: refused at the 64th, before anything (an error message's dump) could recurse over it.
  const std::string deep = std::string(100'000, '[') + std::string(100'000, ']');
  write("config.json", hostile::config(R"("rope_scaling": )" + deep));
  EXPECT_NE(error_message<LoadError>([&] {
              load_model_info(dir_);
            }).find(config_path() + ": nested deeper than 64 levels at byte "),
            std::string::npos);
  write("config.json", hostile::config(R"("eos_token_id": )" + std::string(100'000, '[')));
  EXPECT_NE(error_message<LoadError>([&] { load_model_info(dir_); }).find("nested deeper than 64 levels"),
            std::string::npos);
}

TEST_F(HfConfig, DuplicateKeyIsLoadErrorNamingIt) {
  write("config.json", hostile::config(R"("hidden_size": 64, "hidden_size": 128)"));
  const std::string msg = error_message<LoadError>([&] { load_model_info(dir_); });
  EXPECT_NE(msg.find(config_path() + ": duplicate key \"hidden_size\" at byte "), std::string::npos) << msg;
  write("config.json", hostile::config(R"("rope_scaling": {"rope_type": "llama3", "rope_type": "default"})"));
  EXPECT_NE(error_message<LoadError>([&] { load_model_info(dir_); }).find("duplicate key \"rope_type\""),
            std::string::npos);
  write("config.json", hostile::config());
  write("generation_config.json", R"({"eos_token_id": 2, "eos_token_id": 3})");
  EXPECT_NE(error_message<LoadError>([&] {
              load_model_info(dir_);
            }).find((dir_ / "generation_config.json").string() + ": duplicate key \"eos_token_id\""),
            std::string::npos);
}

TEST_F(HfConfig, AbsurdSizesAreRefusedNamingKeyAndValue) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {R"("num_hidden_layers": 1000000000)",
       "field 'num_hidden_layers' is 1000000000, expected an integer in [1, 1024]"},
      {R"("num_hidden_layers": 0)", "field 'num_hidden_layers' is 0, expected an integer in [1, 1024]"},
      {R"("hidden_size": 1099511627776)",
       "field 'hidden_size' is 1099511627776, expected an integer in [1, 131072]"},
      {R"("intermediate_size": -5)", "field 'intermediate_size' is -5, expected an integer in [1, 1048576]"},
      {R"("vocab_size": 4294967296)",
       "field 'vocab_size' is 4294967296, expected an integer in [1, 16777216]"},
      {R"("num_attention_heads": 1000000)",
       "field 'num_attention_heads' is 1000000, expected an integer in [1, 1024]"},
      {R"("num_key_value_heads": 8)", "field 'num_key_value_heads' is 8, expected an integer in [1, 4]"},
      {R"("num_attention_heads": 3, "num_key_value_heads": 3)",
       "field 'hidden_size' is 64, which num_attention_heads 3 does not divide (and there is no head_dim)"},
      {R"("head_dim": 100000)", "field 'head_dim' is 100000, expected an integer in [2, 4096]"},
      {R"("head_dim": 15)", "field 'head_dim' gives head_dim 15, expected an even number"},
      {R"("max_position_embeddings": 1e15)", "field 'max_position_embeddings' is 1e+15, expected an integer"},
      {R"("max_position_embeddings": 1000000000000)",
       "field 'max_position_embeddings' is 1000000000000, expected an integer in [1, 16777216]"},
      {R"("rms_norm_eps": 0)", "field 'rms_norm_eps' is 0, expected a number in (0, 1)"},
      {R"("rms_norm_eps": 1e300)", "field 'rms_norm_eps' is 1e+300, expected a number in (0, 1)"},
      {R"("rope_theta": -1)", "field 'rope_theta' is -1, expected a number in (0, 1000000000000]"},
      {R"("rope_theta": 1e200)", "field 'rope_theta' is 1e+200"},
      {R"("rope_scaling": {"rope_type": "llama3", "factor": 1e300, "low_freq_factor": 1, "high_freq_factor": 4,
          "original_max_position_embeddings": 8192})",
       "field 'rope_scaling' is {\"factor\":1e+300,"},
      {R"("architectures": ["MistralForCausalLM"], "sliding_window": 0)",
       "field 'sliding_window' is 0, expected an integer in [1, 16777216]"},
      {R"("architectures": ["Qwen2ForCausalLM"], "use_sliding_window": true, "max_window_layers": -1)",
       "field 'max_window_layers' is -1, expected an integer in [0, 1024]"},
      {R"("architectures": ["Gemma3ForCausalLM"], "head_dim": 16, "sliding_window_pattern": 0)",
       "field 'sliding_window_pattern' is 0, expected an integer in [1, 1024]"},
      {R"("architectures": ["Gemma2ForCausalLM"], "head_dim": 16, "query_pre_attn_scalar": 0)",
       "field 'query_pre_attn_scalar' is 0, expected a number in (0, 1000000]"},
      {R"("architectures": ["Gemma2ForCausalLM"], "head_dim": 16, "attn_logit_softcapping": -1)",
       "field 'attn_logit_softcapping' is -1, expected a number in (0, 1000000]"},
      {R"("architectures": ["Gemma3ForCausalLM"], "head_dim": 16, "rope_local_base_freq": 0)",
       "field 'rope_local_base_freq' is 0, expected a number in (0, 1000000000000]"},
      {R"("architectures": ["Phi3ForCausalLM"], "partial_rotary_factor": 1.5)",
       "field 'partial_rotary_factor' is 1.5, expected a number in (0, 1]"},
      {R"("architectures": ["Phi3ForCausalLM"], "partial_rotary_factor": 0.01)",
       "field 'partial_rotary_factor' is 0.01, which rotates 0 of head_dim 16"},
      {R"("rope_scaling": {"rope_type": "linear", "factor": 0})",
       "field 'rope_scaling.factor' is 0, expected a number in (0, 1000000]"},
  };
  for (const auto& [extra, fragment] : cases) {
    SCOPED_TRACE(extra);
    write("config.json", hostile::config(extra));
    const std::string msg = error_message<ValueError>([&] { load_model_info(dir_); });
    EXPECT_NE(msg.find(config_path() + ": " + fragment), std::string::npos) << msg;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  }
}

TEST_F(HfConfig, LongValuesInMessagesAreCut) {
  std::string list = "[";
  for (int i = 0; i < 100'000; ++i) list += (i ? ",1" : "1");
  write("config.json", R"({"architectures": )" + list + "]}");
  const std::string msg = error_message<ValueError>([&] { load_model_info(dir_); });
  EXPECT_NE(msg.find("field 'architectures' is [1,1,1"), std::string::npos) << msg;
  EXPECT_LT(msg.size(), 300u) << msg;
}

TEST_F(HfConfig, AbsurdConfigIsRefusedBeforeAnyWeightIsRead) {
  // The directory has no weights at all: the config's error, not the missing checkpoint's, shows
  // the check comes first, so nothing is built for a billion layers.
  write("config.json", hostile::config(R"("num_hidden_layers": 1000000000)"));
  std::vector<std::string> stages;
  EngineOptions options;
  options.on_stage = [&](std::string_view stage, int, int) { stages.emplace_back(stage); };
  const std::string msg = error_message<ValueError>([&] { GenerationEngine::from_dir(dir_, options); });
  EXPECT_NE(msg.find("field 'num_hidden_layers' is 1000000000"), std::string::npos) << msg;
  EXPECT_EQ(stages, std::vector<std::string>{"config"});
}

// ---- config.json against the checkpoint -------------------------------------------------------------

class HfCheckpoint : public HfConfig {
 protected:
  ModelInfo info(const std::string& extra = "") {
    write("config.json", hostile::config(extra));
    return load_model_info(dir_);
  }
  std::string check_error(const ModelInfo& i, const WeightsRegistry& w) {
    return error_message<LoadError>([&] { check_checkpoint(i, dir_, w); });
  }
};

TEST_F(HfCheckpoint, TheTensorsTheConfigDescribesPass) {
  for (const std::string extra : {"", R"("tie_word_embeddings": true)", R"("head_dim": 32)"}) {
    SCOPED_TRACE(extra);
    const ModelInfo i = info(extra);
    EXPECT_NO_THROW(check_checkpoint(i, dir_, random_weights(i.config, 1)));
    EXPECT_NO_THROW(check_checkpoint(i, dir_, random_weights(i.config, 1, DType::bf16)));
  }
  write("config.json", R"({"architectures": ["Qwen2ForCausalLM"], "vocab_size": 100, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2})");
  const ModelInfo qwen = load_model_info(dir_);
  EXPECT_NO_THROW(check_checkpoint(qwen, dir_, random_weights(qwen.config, 1)));
}

TEST_F(HfCheckpoint, MissingTensorNamesTheKeyThatImpliesIt) {
  const ModelInfo i = info();
  WeightsRegistry w = random_weights(i.config, 1);
  w.erase("model.layers.1.mlp.up_proj.weight");
  EXPECT_EQ(check_error(i, w),
            fmt::format("load_model_info: {}: 'num_hidden_layers' is 2, but the checkpoint has "
                        "no tensor 'model.layers.1.mlp.up_proj.weight'",
                        config_path()));
  w = random_weights(i.config, 1);
  w.erase("lm_head.weight");
  EXPECT_NE(check_error(i, w).find(
                "'tie_word_embeddings' is false, but the checkpoint has no tensor 'lm_head.weight'"),
            std::string::npos);
}

TEST_F(HfCheckpoint, ConfigWithMoreLayersThanTheCheckpointIsRefused) {
  const ModelInfo small = info();
  const ModelInfo big = info(R"("num_hidden_layers": 1024)");
  EXPECT_NE(check_error(big, random_weights(small.config, 1))
                .find("'num_hidden_layers' is 1024, but the checkpoint has no tensor 'model.layers.2."),
            std::string::npos);
}

TEST_F(HfCheckpoint, CheckpointWithMoreLayersThanTheConfigIsRefused) {
  const ModelInfo i = info();
  WeightsRegistry w = random_weights(i.config, 1);
  w.emplace("model.layers.2.input_layernorm.weight", Tensor::zeros(DType::f32, {64}));
  EXPECT_NE(check_error(i, w).find("'num_hidden_layers' is 2, but the checkpoint has tensor "
                                   "'model.layers.2.input_layernorm.weight' of a layer past it"),
            std::string::npos);
  w.erase("model.layers.2.input_layernorm.weight");
  w.emplace("model.layers.99999999999999999999.x", Tensor::zeros(DType::f32, {1}));
  EXPECT_NE(check_error(i, w).find("of a layer past it"), std::string::npos);
}

TEST_F(HfCheckpoint, WrongShapeNamesTheKeyAndTheTensor) {
  const ModelInfo i = info();
  WeightsRegistry w = random_weights(i.config, 1);
  w["model.embed_tokens.weight"] = Tensor::zeros(DType::f32, {100, 32});
  EXPECT_EQ(check_error(i, w),
            fmt::format("load_model_info: {}: 'hidden_size' gives 64, but tensor "
                        "'model.embed_tokens.weight' has shape [100, 32], expected [100, 64] "
                        "([vocab_size, hidden_size])",
                        config_path()));
  w = random_weights(i.config, 1);
  w["model.layers.0.self_attn.k_proj.weight"] = Tensor::zeros(DType::f32, {64, 64});
  EXPECT_NE(
      check_error(i, w).find("'num_key_value_heads * (hidden_size / num_attention_heads)' gives 32, but "
                             "tensor 'model.layers.0.self_attn.k_proj.weight' has shape [64, 64]"),
      std::string::npos);
  w = random_weights(i.config, 1);
  w["model.norm.weight"] = Tensor::zeros(DType::f32, {64, 1});
  EXPECT_NE(check_error(i, w).find("tensor 'model.norm.weight' has shape [64, 1], expected [64]"),
            std::string::npos);
  w = random_weights(i.config, 1);
  w["model.layers.1.mlp.down_proj.weight"] = Tensor::zeros(DType::i32, {64, 128});
  EXPECT_NE(check_error(i, w).find(
                "tensor 'model.layers.1.mlp.down_proj.weight' is i32, expected f32, f16 or bf16"),
            std::string::npos);
}

TEST_F(HfCheckpoint, InconsistentCheckpointIsRefusedBeforeGraphsAreBuilt) {
  // config.json says 4 layers; the checkpoint has 2.
  const ModelInfo two = info();
  save_safetensors(dir_ / "model.safetensors", random_weights(two.config, 1));
  write("config.json", hostile::config(R"("num_hidden_layers": 4)"));
  std::vector<std::string> stages;
  EngineOptions options;
  options.on_stage = [&](std::string_view stage, int, int) { stages.emplace_back(stage); };
  const std::string msg = error_message<LoadError>([&] { GenerationEngine::from_dir(dir_, options); });
  EXPECT_NE(msg.find(config_path() +
                     ": 'num_hidden_layers' is 4, but the checkpoint has no tensor 'model.layers.2."),
            std::string::npos)
      << msg;
  EXPECT_EQ(stages, (std::vector<std::string>{"config", "weights"}));
}

}  // namespace
