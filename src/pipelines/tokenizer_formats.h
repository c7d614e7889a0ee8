// Private to the tokenizers: the two file formats behind Tokenizer::load, and the pre-tokenizer
// splitting rules (exposed so tests can pin them).
#pragma once

#include <filesystem>
#include <memory>
#include <string_view>
#include <vector>

#include "kiln/pipelines/tokenizer.h"

namespace kiln::pipelines::detail {

// Hugging Face tokenizer.json (model type BPE).
std::unique_ptr<Tokenizer> load_hf_tokenizer(const std::filesystem::path& file);
// SentencePiece tokenizer.model, through libsentencepiece.
std::unique_ptr<Tokenizer> load_sentencepiece_tokenizer(const std::filesystem::path& file);

// The split regexes tokenizer.json files use, each matched by hand (no regex engine):
//   Gpt2:   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
//   Llama3: (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|
//           \s*[\r\n]+|\s+(?!\S)|\s+
//   Qwen2:  Llama3 with \p{N} instead of \p{N}{1,3}
enum class SplitPattern { Gpt2, Llama3, Qwen2 };

// The pieces of `text` (views into it) that the pattern matches, in order; together they cover the
// text. Invalid UTF-8 bytes count as one non-letter, non-number, non-space character each.
std::vector<std::string_view> split_by_pattern(std::string_view text, SplitPattern pattern);

}  // namespace kiln::pipelines::detail
