// load_model_info: config.json files as Hugging Face publishes them (Llama 3.2, TinyLlama, Qwen2),
// written to a temp dir, and the errors for broken or unsupported ones.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include "test_util.h"
#include <kiln/kiln.h>
#include <kiln/pipelines/hf_config.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

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

TEST_F(HfConfig, MistralSlidingWindowCapsTheContext) {
  write("config.json", R"({"architectures": ["MistralForCausalLM"], "vocab_size": 32000, "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "max_position_embeddings": 32768, "sliding_window": 4096, "rope_theta": 10000.0})");
  EXPECT_EQ(load_model_info(dir_).config.max_position_embeddings, 4096);
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
                        "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM)",
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
            fmt::format("load_model_info: {}: LlamaConfig: num_attention_heads 4 is not a multiple of "
                        "num_key_value_heads 3",
                        config_path()));
}

}  // namespace
