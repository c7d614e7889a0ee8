// Private to the tokenizers: the file formats behind Tokenizer::load (tokenizer.json, tokenizer.model,
// and the tokenizer_config.json beside either).
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <nlohmann/json_fwd.hpp>
#include <optional>
#include <string>
#include <vector>

#include "kiln/pipelines/tokenizer.h"
#include "pipelines/flat_tables.h"

namespace kiln::pipelines::detail {

// What transformers reads from tokenizer_config.json on top of the tokenizer file itself.
struct TokenizerConfig {
  // A special token's setting: absent (nullopt), set to null (an empty inner optional: "no such token"),
  // or set to a token's content (a string, or an AddedToken object's "content").
  using TokenSetting = std::optional<std::optional<std::string>>;
  TokenSetting bos_token, eos_token, pad_token, unk_token;
  std::optional<bool> add_bos_token, add_eos_token;
  bool clean_up_tokenization_spaces = false;  // transformers' default since 4.45
  std::vector<std::string> additional_special_tokens;
  struct AddedToken {
    int64_t id;
    std::string content;
    bool special, lstrip, rstrip, single_word, normalized;
  };
  std::vector<AddedToken> added_tokens_decoder;  // tokens the tokenizer file may lack
};

// Reads `file` (DIR/tokenizer_config.json); a missing file gives the defaults. LoadError naming the
// file and the key for bad JSON, a repeated key, or a value of the wrong kind.
TokenizerConfig load_tokenizer_config(const std::filesystem::path& file);

// A BPE model's vocabulary and ranked merges as tables, in place of tokenizer.json's model.vocab and
// model.merges (another format's vocabulary, as GGUF's: spelling hundreds of thousands of tokens and
// merges out as JSON only for the loader to read them back took most of its load).
struct BpeTables {
  std::vector<std::string> tokens;  // the token of each id; empty for an id no token has
  FlatStringIndex index;            // token -> id for every token (of two tokens of one id, `tokens` has the later)
  struct Merge {
    int32_t left, right, merged;  // token ids
  };
  std::vector<Merge> merges;  // by rank, the first merged first
};

// Hugging Face tokenizer.json (model type BPE).
std::unique_ptr<Tokenizer> load_hf_tokenizer(const std::filesystem::path& file, const TokenizerConfig& config);
// The same from a parsed tokenizer.json (or one built from another format's vocabulary, as GGUF's,
// whose model.vocab and model.merges are then `tables`); `name` is what the messages call it.
std::unique_ptr<Tokenizer> load_hf_tokenizer_json(const nlohmann::json& root, const std::string& name,
                                                  const TokenizerConfig& config,
                                                  std::optional<BpeTables> tables = std::nullopt);
// SentencePiece tokenizer.model, through libsentencepiece.
std::unique_ptr<Tokenizer> load_sentencepiece_tokenizer(const std::filesystem::path& file,
                                                        const TokenizerConfig& config);

}  // namespace kiln::pipelines::detail
