// Tokenizers: Hugging Face tokenizer.json (BPE, byte-level as GPT-2 / Llama 3 / SmolLM use, and the
// Metaspace + byte-fallback form of Llama 2 / TinyLlama), with added and special tokens and the
// post-processor that adds BOS; and SentencePiece tokenizer.model files through libsentencepiece.
//
//   auto tok = pipelines::Tokenizer::load("models/tiny");   // tokenizer.json or tokenizer.model
//   std::vector<int64_t> ids = tok->encode("Hello world");  // with BOS when the model adds one
//   std::string text = tok->decode(ids);
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace kiln::pipelines {

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;

  // Loads DIR/tokenizer.json, else DIR/tokenizer.model (or the file itself). LoadError naming the
  // file for missing files, bad JSON, or an unsupported model type / pre-tokenizer / decoder.
  static std::unique_ptr<Tokenizer> load(const std::filesystem::path& path);

  // Text -> ids. add_special_tokens applies the post-processor (e.g. BOS). Added/special tokens
  // written literally in the text ("<|eot_id|>") become their ids.
  virtual std::vector<int64_t> encode(std::string_view text, bool add_special_tokens = true) const = 0;
  // Ids -> text; special tokens are dropped when skip_special_tokens.
  virtual std::string decode(const std::vector<int64_t>& ids, bool skip_special_tokens = true) const = 0;
  // The raw bytes one token contributes to the output when it follows other tokens (byte-level
  // decoded, byte-fallback <0xNN> resolved, Metaspace '▁' as a space; empty for skipped specials).
  // Streaming output concatenates these and emits only complete UTF-8 sequences.
  virtual std::string token_bytes(int64_t id) const = 0;

  virtual int64_t vocab_size() const = 0;
  virtual std::optional<int64_t> bos_id() const = 0;
  virtual std::optional<int64_t> eos_id() const = 0;
  virtual std::optional<int64_t> token_to_id(std::string_view token) const = 0;
  virtual bool is_special(int64_t id) const = 0;
};

// Tokenizer::token_bytes(id), or "" for an id at or past the tokenizer's vocabulary: a model's
// embedding may be padded past its tokenizer (Qwen's 151936 rows for 151665 tokens), and a sampled
// padding row has no text.
std::string output_bytes(const Tokenizer& tokenizer, int64_t id);

// Buffers the bytes of streamed tokens and returns only complete UTF-8 characters (the rest waits
// for the next token; invalid bytes become U+FFFD).
class Utf8Stream {
 public:
  std::string push(std::string_view bytes);
  std::string flush();  // whatever is left, invalid tails as U+FFFD

 private:
  std::string pending_;
};

}  // namespace kiln::pipelines
