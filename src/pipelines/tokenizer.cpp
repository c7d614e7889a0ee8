#include "kiln/pipelines/tokenizer.h"

#include <fmt/format.h>

#include <fstream>

#include "kiln/errors.h"
#include "kiln/pipelines/gguf.h"
#include "pipelines/gguf_tokenizer.h"
#include "pipelines/tokenizer_formats.h"
#include "pipelines/tokenizer_unicode.h"

namespace kiln::pipelines {

namespace {

// A file whose first non-blank byte is '{' is a tokenizer.json; anything else is tried as a
// SentencePiece model (a protobuf, which never starts with '{').
bool looks_like_json(const std::filesystem::path& file) {
  std::ifstream in(file, std::ios::binary);
  if (!in) throw LoadError(fmt::format("tokenizer: cannot open '{}'", file.string()));
  char c;
  while (in.get(c))
    if (c != ' ' && c != '\t' && c != '\r' && c != '\n') return c == '{';
  return false;
}

}  // namespace

std::unique_ptr<Tokenizer> Tokenizer::load(const std::filesystem::path& path) {
  std::error_code ec;
  // tokenizer_config.json is read from the directory that holds the tokenizer file.
  const auto config_of = [](const std::filesystem::path& dir) {
    return detail::load_tokenizer_config(dir / "tokenizer_config.json");
  };
  if (std::filesystem::is_directory(path, ec)) {
    if (std::filesystem::is_regular_file(path / "tokenizer.json", ec))
      return detail::load_hf_tokenizer(path / "tokenizer.json", config_of(path));
    if (std::filesystem::is_regular_file(path / "tokenizer.model", ec))
      return detail::load_sentencepiece_tokenizer(path / "tokenizer.model", config_of(path));
    throw LoadError(
        fmt::format("tokenizer: '{}' has neither a tokenizer.json nor a tokenizer.model", path.string()));
  }
  if (!std::filesystem::is_regular_file(path, ec))
    throw LoadError(
        fmt::format("tokenizer: '{}' does not exist (expected a tokenizer.json, a "
                    "tokenizer.model or a directory holding one)",
                    path.string()));
  if (is_gguf_file(path))  // the file's embedded vocabulary (docs/gguf.md)
    return detail::load_gguf_tokenizer(detail::read_gguf_vocab(GGUFFile::open(path)), path.string());
  const auto config = config_of(path.parent_path().empty() ? "." : path.parent_path());
  if (path.extension() == ".json" || (path.extension() != ".model" && looks_like_json(path)))
    return detail::load_hf_tokenizer(path, config);
  return detail::load_sentencepiece_tokenizer(path, config);
}

// ---- Utf8Stream ------------------------------------------------------------------------------------

std::string Utf8Stream::push(std::string_view bytes) {
  pending_.append(bytes);
  std::string out;
  size_t i = 0;
  while (i < pending_.size()) {
    const detail::Utf8Char c = detail::decode_utf8(pending_, i);
    if (c.truncated) break;  // the next token may complete it
    if (c.valid)
      out.append(pending_, i, c.len);
    else
      detail::append_utf8(out, detail::kReplacementChar);
    i += c.len;
  }
  pending_.erase(0, i);
  return out;
}

std::string Utf8Stream::flush() {
  std::string out = detail::to_valid_utf8(pending_);
  pending_.clear();
  return out;
}

std::string output_bytes(const Tokenizer& tokenizer, int64_t id) {
  return id >= 0 && id < tokenizer.vocab_size() ? tokenizer.token_bytes(id) : std::string();
}

}  // namespace kiln::pipelines
