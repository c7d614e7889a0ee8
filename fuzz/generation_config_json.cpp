// generation_config.json beside a valid config.json (kiln-tiny's), whose ids it overrides.
#include "fuzz_common.h"
#include "kiln/pipelines/hf_config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const bool config = [] {
    kiln::fuzz::write_file("config.json",
                           R"({"architectures": ["LlamaForCausalLM"], "vocab_size": 2048, "hidden_size": 128,
                               "intermediate_size": 344, "num_hidden_layers": 4, "num_attention_heads": 4,
                               "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 256,
                               "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "tie_word_embeddings": true,
                               "torch_dtype": "float32", "bos_token_id": 2046, "eos_token_id": 2047})");
    return true;
  }();
  (void)config;
  kiln::fuzz::write_file("generation_config.json", kiln::fuzz::bytes(data, size));
  kiln::fuzz::refusals_only([&] { (void)kiln::pipelines::load_model_info(kiln::fuzz::scratch_dir()); });
  return 0;
}
