// `kiln generate` runs every supported architecture from a Hugging Face directory: config.json as
// each architecture's checkpoints write it (tiny sizes, windows shorter than prompt + reply), random
// weights saved as model.safetensors, and kiln-tiny's tokenizer. The real binary is run, greedy.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <ostream>
#include <string>

#include "kiln/pipelines/hf_config.h"
#include "kiln/pipelines/safetensors.h"
#include "kiln/pipelines/text_generation.h"

namespace {

namespace fs = std::filesystem;
using namespace kiln;

fs::path source_dir() { return fs::path(__FILE__).parent_path().parent_path().parent_path(); }

// The sizes every config shares; kiln-tiny's vocabulary, so its tokenizer fits.
constexpr const char* kSizes = R"("vocab_size": 2048, "hidden_size": 64, "intermediate_size": 128,
  "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
  "bos_token_id": 2046, "eos_token_id": 2047, "torch_dtype": "float32")";

struct Case {
  const char* name;
  const char* fields;  // the architecture's own config.json fields
};

const Case kCases[] = {
    {"llama", R"("architectures": ["LlamaForCausalLM"], "model_type": "llama")"},
    {"smollm",
     R"("architectures": ["LlamaForCausalLM"], "model_type": "llama", "tie_word_embeddings": true)"},
    {"mistral", R"("architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": 5)"},
    {"qwen2", R"("architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "use_sliding_window": true,
      "sliding_window": 5, "max_window_layers": 1)"},
    {"qwen3", R"("architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "head_dim": 32)"},
    {"gemma2", R"("architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "head_dim": 16,
      "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 16, "sliding_window": 5)"},
    {"gemma3", R"("architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "head_dim": 16,
      "query_pre_attn_scalar": 16, "sliding_window": 5, "sliding_window_pattern": 2,
      "rope_scaling": {"rope_type": "linear", "factor": 8.0})"},
    {"phi3", R"("architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "partial_rotary_factor": 0.5,
      "sliding_window": 5)"},
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

// Runs `command`, returning its exit status and stdout.
std::pair<int, std::string> run(const std::string& command) {
  FILE* pipe = ::popen(command.c_str(), "r");
  if (!pipe) return {-1, ""};
  std::string out;
  char buffer[4096];
  while (size_t n = std::fread(buffer, 1, sizeof buffer, pipe)) out.append(buffer, n);
  const int status = ::pclose(pipe);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
}

class GenerateArchitecture : public ::testing::TestWithParam<Case> {};

TEST_P(GenerateArchitecture, KilnGenerateRunsAnHfDirectory) {
  const Case& c = GetParam();
  const fs::path dir =
      fs::temp_directory_path() / (std::string("kiln_generate_") + c.name + "_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  std::ofstream(dir / "config.json") << "{" << c.fields << ", " << kSizes << "}";
  fs::copy_file(source_dir() / "models" / "kiln-tiny" / "tokenizer.json", dir / "tokenizer.json");
  const pipelines::ModelInfo info = pipelines::load_model_info(dir);
  pipelines::save_safetensors(dir / "model.safetensors", pipelines::random_weights(info.config, 7));

  const auto [status, out] = run(std::string(KILN_TEST_KILN_BINARY) + " generate --model " + dir.string() +
                                 " --prompt 'Once upon a time, in a land far away,' --max-new-tokens 12"
                                 " --temperature 0 --ignore-eos --threads 1 2>" +
                                 (dir / "stderr.txt").string());
  std::ifstream err_file(dir / "stderr.txt");
  const std::string err((std::istreambuf_iterator<char>(err_file)), std::istreambuf_iterator<char>());
  EXPECT_EQ(status, 0) << err;
  EXPECT_FALSE(out.empty()) << err;
  fs::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(Architectures, GenerateArchitecture, ::testing::ValuesIn(kCases),
                         [](const auto& info) { return std::string(info.param.name); });

}  // namespace
