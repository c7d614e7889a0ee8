// Private to the pipelines: the tokenizer a GGUF file embeds (`tokenizer.ggml.*`, as llama.cpp's
// convert_hf_to_gguf.py writes it), read into plain data and turned into a kiln Tokenizer.
// docs/gguf.md ("Tokenizer from the file") has the keys and how each kind of vocabulary is read.
//
//   GGUFVocab vocab = read_gguf_vocab(GGUFFile::open("model.gguf"));
//   std::unique_ptr<Tokenizer> tok = load_gguf_tokenizer(vocab, "model.gguf");
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "kiln/pipelines/tokenizer.h"

namespace kiln::pipelines {
class GGUFFile;
}

namespace kiln::pipelines::detail {

// llama.cpp's token types (gguf-py's TokenType), one per token in `tokenizer.ggml.token_type`.
enum GGUFTokenType : int32_t {
  kTokenNormal = 1,
  kTokenUnknown = 2,
  kTokenControl = 3,
  kTokenUserDefined = 4,
  kTokenUnused = 5,
  kTokenByte = 6,
};

// The `tokenizer.*` metadata of a GGUF file, as the file holds it (unchecked: load_gguf_tokenizer
// checks it). An absent key is an empty vector, an empty string or nullopt.
struct GGUFVocab {
  std::string model;  // tokenizer.ggml.model: "llama" (SentencePiece) or "gpt2" (byte-level BPE)
  std::string pre;    // tokenizer.ggml.pre: the pre-tokenizer's name ("llama-bpe", "qwen2", ...)
  std::vector<std::string> tokens;   // tokenizer.ggml.tokens: the token of each id
  std::vector<float> scores;         // tokenizer.ggml.scores ("llama": SentencePiece's score of each token)
  std::vector<int32_t> token_types;  // tokenizer.ggml.token_type (GGUFTokenType)
  std::vector<std::string> merges;   // tokenizer.ggml.merges ("gpt2": "a b", rank = position)
  // tokenizer.ggml.{bos,eos,unknown,padding,seperator}_token_id (sic: llama.cpp spells it so)
  std::optional<uint64_t> bos_id, eos_id, unk_id, pad_id, sep_id;
  std::optional<bool> add_bos_token, add_eos_token;  // tokenizer.ggml.add_*_token
  std::optional<bool> add_space_prefix;              // tokenizer.ggml.add_space_prefix
  std::optional<std::string> chat_template;          // tokenizer.chat_template (for the server)
};

// The tokenizer of `vocab`: kiln's Hugging Face BPE tokenizer, given the tokenizer.json that the
// same vocabulary has on the Hub. LoadError naming `what` (the file) and the key for an unknown
// model or pre-tokenizer, arrays of different lengths, an id out of range, a repeated token, a
// merge of tokens that are not in the vocabulary, or an unknown token type.
std::unique_ptr<Tokenizer> load_gguf_tokenizer(const GGUFVocab& vocab, std::string_view what);

// The `tokenizer.*` keys of an open file, through GGUFFile's typed getters (a key of the wrong type
// is their LoadError). Only tokenizer.ggml.model and tokenizer.ggml.tokens are required.
GGUFVocab read_gguf_vocab(const GGUFFile& file);

}  // namespace kiln::pipelines::detail
