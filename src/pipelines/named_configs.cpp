// Llama configs of known shapes by name, for benchmarks with random weights.
#include "kiln/pipelines/text_generation.h"

namespace kiln::pipelines {

std::optional<nn::LlamaConfig> named_config(std::string_view name) {
  // llama2.c's TinyStories models (karpathy/tinyllamas): Llama 2 architecture, tied embeddings.
  auto stories = [](int64_t dim, int64_t layers, int64_t heads, int64_t ffn, int64_t seq) {
    nn::LlamaConfig c;
    c.vocab_size = 32000;
    c.hidden_size = dim;
    c.intermediate_size = ffn;
    c.num_hidden_layers = layers;
    c.num_attention_heads = heads;
    c.num_key_value_heads = heads;
    c.rms_norm_eps = 1e-5;
    c.max_position_embeddings = seq;
    c.tie_word_embeddings = true;
    return c;
  };
  if (name == "stories15M") return stories(288, 6, 6, 768, 256);
  if (name == "stories110M") return stories(768, 12, 12, 2048, 1024);
  if (name == "llama-1B") {  // meta-llama/Llama-3.2-1B's config.json
    nn::LlamaConfig c;
    c.vocab_size = 128256;
    c.hidden_size = 2048;
    c.intermediate_size = 8192;
    c.num_hidden_layers = 16;
    c.num_attention_heads = 32;
    c.num_key_value_heads = 8;
    c.head_dim = 64;
    c.rms_norm_eps = 1e-5;
    c.rope_theta = 500000.0;
    c.rope_scaling = nn::Llama3RopeScaling{.factor = 32.0,
                                           .low_freq_factor = 1.0,
                                           .high_freq_factor = 4.0,
                                           .original_max_position_embeddings = 8192};
    c.max_position_embeddings = 131072;
    c.tie_word_embeddings = true;
    return c;
  }
  return std::nullopt;
}

const std::vector<std::string>& named_config_names() {
  static const std::vector<std::string> names{"stories15M", "stories110M", "llama-1B"};
  return names;
}

}  // namespace kiln::pipelines
