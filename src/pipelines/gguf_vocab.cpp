// read_gguf_vocab: a GGUF file's `tokenizer.*` keys as plain data. Kept apart from
// gguf_tokenizer.cpp so that the conversion, and its tests, link without the GGUF reader.
#include <algorithm>
#include <limits>

#include "kiln/pipelines/gguf.h"
#include "pipelines/gguf_tokenizer.h"

namespace kiln::pipelines::detail {

GGUFVocab read_gguf_vocab(const GGUFFile& file) {
  GGUFVocab v;
  v.model = file.get_string("tokenizer.ggml.model");
  v.pre = file.find_string("tokenizer.ggml.pre").value_or("");
  for (std::string_view t : file.get_string_array("tokenizer.ggml.tokens")) v.tokens.emplace_back(t);
  if (file.contains("tokenizer.ggml.scores"))
    for (double s : file.get_f64_array("tokenizer.ggml.scores")) v.scores.push_back(static_cast<float>(s));
  if (file.contains("tokenizer.ggml.token_type"))
    for (int64_t t : file.get_i64_array("tokenizer.ggml.token_type"))  // out of int32 range stays no type
      v.token_types.push_back(static_cast<int32_t>(
          std::clamp<int64_t>(t, std::numeric_limits<int32_t>::min(), std::numeric_limits<int32_t>::max())));
  if (file.contains("tokenizer.ggml.merges"))
    for (std::string_view m : file.get_string_array("tokenizer.ggml.merges")) v.merges.emplace_back(m);
  v.bos_id = file.find_u64("tokenizer.ggml.bos_token_id");
  v.eos_id = file.find_u64("tokenizer.ggml.eos_token_id");
  v.unk_id = file.find_u64("tokenizer.ggml.unknown_token_id");
  v.pad_id = file.find_u64("tokenizer.ggml.padding_token_id");
  v.sep_id = file.find_u64("tokenizer.ggml.seperator_token_id");  // sic: llama.cpp's spelling
  v.add_bos_token = file.find_bool("tokenizer.ggml.add_bos_token");
  v.add_eos_token = file.find_bool("tokenizer.ggml.add_eos_token");
  v.add_space_prefix = file.find_bool("tokenizer.ggml.add_space_prefix");
  v.chat_template = file.find_string("tokenizer.chat_template");
  return v;
}

}  // namespace kiln::pipelines::detail
