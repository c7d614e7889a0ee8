// SentencePiece tokenizer.model files (Llama 2 and its family), through libsentencepiece.
#include <fmt/format.h>
#include <sentencepiece_processor.h>

#include "kiln/errors.h"
#include "pipelines/tokenizer_formats.h"

namespace kiln::pipelines::detail {

namespace {

constexpr std::string_view kSpaceMarker = "\xE2\x96\x81";       // '▁', SentencePiece's space
constexpr std::string_view kUnknownSurface = " \xE2\x81\x87 ";  // " ⁇ ", how SentencePiece decodes <unk>

class SentencePieceTokenizer final : public Tokenizer {
 public:
  SentencePieceTokenizer(const std::filesystem::path& file, const TokenizerConfig& config) : file_(file.string()) {
    const auto status = sp_.Load(file_);
    if (!status.ok())
      throw LoadError(
          fmt::format("tokenizer: '{}' is not a SentencePiece model: {}", file_, status.ToString()));
    for (int id = 0; id < sp_.GetPieceSize(); ++id)
      if (sp_.IsControl(id) || sp_.IsUnknown(id)) literal_specials_.emplace_back(sp_.IdToPiece(id), id);
    // tokenizer_config.json's tokens and flags, as transformers' LlamaTokenizer applies them.
    const auto resolve = [&](const TokenizerConfig::TokenSetting& setting, int fallback,
                             const char* key) -> std::optional<int64_t> {
      if (!setting) return optional_id(fallback);
      if (!*setting) return std::nullopt;
      const auto id = token_to_id(**setting);
      if (!id)
        throw LoadError(fmt::format("tokenizer '{}': tokenizer_config.json's {} '{}' is not a piece of the model",
                                    file_, key, **setting));
      return id;
    };
    bos_id_ = resolve(config.bos_token, sp_.bos_id(), "bos_token");
    eos_id_ = resolve(config.eos_token, sp_.eos_id(), "eos_token");
    add_bos_ = config.add_bos_token.value_or(true) && bos_id_;
    add_eos_ = config.add_eos_token.value_or(false) && eos_id_;
  }

  std::vector<int64_t> encode(std::string_view text, bool add_special_tokens) const override {
    std::vector<int64_t> ids;
    if (add_special_tokens && add_bos_) ids.push_back(*bos_id_);
    // SentencePiece never produces control pieces from text; split on their literal spelling so
    // "<s>" written in a prompt is the BOS token, as Hugging Face's Llama tokenizers do.
    size_t start = 0;
    for (size_t i = 0; i < text.size();) {
      const auto match = special_at(text, i);
      if (!match) {
        ++i;
        continue;
      }
      encode_plain(text.substr(start, i - start), ids);
      ids.push_back(match->second);
      i += match->first.size();
      start = i;
    }
    encode_plain(text.substr(start), ids);
    if (add_special_tokens && add_eos_) ids.push_back(*eos_id_);
    return ids;
  }

  std::string decode(const std::vector<int64_t>& ids, bool skip_special_tokens) const override {
    std::string out;
    std::vector<int> run;
    const auto flush = [&] {
      if (run.empty()) return;
      std::string text;
      const auto status = sp_.Decode(run, &text);
      if (!status.ok())
        throw Error(fmt::format("tokenizer '{}': decode failed: {}", file_, status.ToString()));
      out += text;
      run.clear();
    };
    for (int64_t id : ids) {
      check_id(id, "decode");
      if (sp_.IsControl(static_cast<int>(id))) {
        flush();
        if (!skip_special_tokens) out += sp_.IdToPiece(static_cast<int>(id));
        continue;
      }
      run.push_back(static_cast<int>(id));
    }
    flush();
    return out;
  }

  std::string token_bytes(int64_t id) const override {
    check_id(id, "token_bytes");
    const int i = static_cast<int>(id);
    if (sp_.IsControl(i)) return "";
    if (sp_.IsUnknown(i)) return std::string(kUnknownSurface);
    const std::string& piece = sp_.IdToPiece(i);
    if (sp_.IsByte(i)) return std::string(1, static_cast<char>(std::stoi(piece.substr(3, 2), nullptr, 16)));
    std::string out;
    for (size_t k = 0; k < piece.size();) {
      if (piece.compare(k, kSpaceMarker.size(), kSpaceMarker) == 0) {
        out += ' ';
        k += kSpaceMarker.size();
      } else {
        out += piece[k++];
      }
    }
    return out;
  }

  int64_t vocab_size() const override { return sp_.GetPieceSize(); }
  std::optional<int64_t> bos_id() const override { return bos_id_; }
  std::optional<int64_t> eos_id() const override { return eos_id_; }
  std::optional<int64_t> token_to_id(std::string_view token) const override {
    const int id = sp_.PieceToId(token);
    if (id < 0 || sp_.IdToPiece(id) != token) return std::nullopt;  // unknown pieces map to <unk>
    return id;
  }
  bool is_special(int64_t id) const override {
    return id >= 0 && id < vocab_size() && sp_.IsControl(static_cast<int>(id));
  }

 private:
  static std::optional<int64_t> optional_id(int id) {
    return id >= 0 ? std::optional<int64_t>(id) : std::nullopt;
  }

  void check_id(int64_t id, const char* what) const {
    if (id < 0 || id >= vocab_size())
      throw ValueError(fmt::format("tokenizer '{}': {}: token id {} is outside the vocabulary [0, {})", file_,
                                   what, id, vocab_size()));
  }

  // The longest control/unknown piece spelled at text[i], if any.
  const std::pair<std::string, int>* special_at(std::string_view text, size_t i) const {
    const std::pair<std::string, int>* best = nullptr;
    for (const auto& s : literal_specials_)
      if (!s.first.empty() && text.compare(i, s.first.size(), s.first) == 0 &&
          (!best || s.first.size() > best->first.size()))
        best = &s;
    return best;
  }

  void encode_plain(std::string_view text, std::vector<int64_t>& ids) const {
    if (text.empty()) return;
    std::vector<int> piece_ids;
    const auto status = sp_.Encode(text, &piece_ids);
    if (!status.ok()) throw Error(fmt::format("tokenizer '{}': encode failed: {}", file_, status.ToString()));
    ids.insert(ids.end(), piece_ids.begin(), piece_ids.end());
  }

  std::string file_;
  sentencepiece::SentencePieceProcessor sp_;
  std::vector<std::pair<std::string, int>> literal_specials_;
  std::optional<int64_t> bos_id_, eos_id_;
  bool add_bos_ = true, add_eos_ = false;
};

}  // namespace

std::unique_ptr<Tokenizer> load_sentencepiece_tokenizer(const std::filesystem::path& file,
                                                        const TokenizerConfig& config) {
  return std::make_unique<SentencePieceTokenizer>(file, config);
}

}  // namespace kiln::pipelines::detail
