// A GGUF file's embedded vocabulary as a kiln Tokenizer. GGUF keeps only the vocabulary (tokens,
// scores or merges, token types, special ids) and names the rest: the model kind and, for byte-level
// BPE, the pre-tokenizer. So each vocabulary is turned into the tokenizer.json the same model ships
// on the Hub and handed to kiln's Hugging Face tokenizer (hf_tokenizer.cpp), which is held to
// Hugging Face's own on real tokenizers (test_tokenizer_oracle.cpp); the vocabulary and merges go
// beside that JSON as tables of ids (BpeTables), not spelled out in it:
//   "gpt2"  -> BPE with the file's merges; the pre-tokenizer (split regex, NFC, ...) of `pre`.
//   "llama" -> BPE with merges derived from the SentencePiece scores as Hugging Face's converter
//              derives them, Llama 2's normalizer (prefix "▁", spaces as "▁") and byte-fallback
//              decoder. (libsentencepiece could take the vocabulary as a ModelProto, but Debian ships
//              no protobuf headers for it, and the HF form is what transformers runs for these models.)
#include "pipelines/gguf_tokenizer.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <nlohmann/json.hpp>
#include <tuple>

#include "kiln/errors.h"
#include "pipelines/flat_tables.h"
#include "pipelines/tokenizer_formats.h"
#include "pipelines/tokenizer_unicode.h"

namespace kiln::pipelines::detail {

using nlohmann::json;

namespace {

constexpr std::string_view kMetaspace = "\xE2\x96\x81";  // '▁'
constexpr size_t kMaxTokens = size_t{1} << 24;           // hf_tokenizer.cpp's bound on ids

// The split regexes of the models' tokenizer.json files (Oniguruma syntax, as there).
constexpr const char* kLlama3Regex =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
constexpr const char* kQwen2Regex =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
constexpr const char* kTekkenRegex =
    R"([^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

// What a `tokenizer.ggml.pre` name stands for: the parts of its models' tokenizer.json around
// ByteLevel, and the two settings llama.cpp ties to the name.
struct PreTokenizer {
  std::array<std::string_view, 3> names;  // the name and llama.cpp's aliases of it
  const char* split_regex;  // Split(Isolated) before ByteLevel; nullptr: ByteLevel's GPT-2 regex
  bool split_digits;        // Digits(individual_digits) before ByteLevel
  bool nfc;                 // an NFC normalizer
  bool ignore_merges;       // a word of the vocabulary is its own token
  bool clean_up_spaces;     // tokenizer_config.json's clean_up_tokenization_spaces
  bool add_bos;             // llama.cpp's default when tokenizer.ggml.add_bos_token is absent
};

constexpr PreTokenizer kPreTokenizers[] = {
    {{"llama-bpe", "llama3", "llama-v3"}, kLlama3Regex, false, false, true, true, true},  // Llama 3
    {{"qwen2"}, kQwen2Regex, false, true, false, false, false},                           // Qwen 2, 2.5, 3
    {{"tekken"}, kTekkenRegex, false, false, true, false, true},                          // Mistral Nemo
    {{"gpt-2"}, nullptr, false, false, false, true, false},                               // GPT-2
    {{"smollm"}, nullptr, true, false, false, false, false},                              // SmolLM 1, 2
};

std::string supported_pre_names() {
  std::string names;
  for (const PreTokenizer& p : kPreTokenizers)
    for (std::string_view n : p.names)
      if (!n.empty()) names += (names.empty() ? "'" : ", '") + std::string(n) + "'";
  return names;
}

class Converter {
 public:
  Converter(const GGUFVocab& vocab, std::string_view what) : v_(vocab), what_(what) {}

  std::unique_ptr<Tokenizer> load() {
    const bool llama = v_.model == "llama";
    if (!llama && v_.model != "gpt2")
      fail(v_.model.empty()
               ? "tokenizer.ggml.model is missing"
               : fmt::format("tokenizer.ggml.model '{}' is not supported (kiln reads 'llama' and 'gpt2')",
                             v_.model));
    check_tokens();
    const std::optional<int64_t> bos = id(v_.bos_id, "tokenizer.ggml.bos_token_id", llama ? 1 : -1);
    const std::optional<int64_t> eos = id(v_.eos_id, "tokenizer.ggml.eos_token_id", llama ? 2 : -1);
    const std::optional<int64_t> unk = id(v_.unk_id, "tokenizer.ggml.unknown_token_id", llama ? 0 : -1);
    id(v_.pad_id, "tokenizer.ggml.padding_token_id", -1);
    id(v_.sep_id, "tokenizer.ggml.seperator_token_id", -1);

    json root = {{"added_tokens", added_tokens()}, {"model", {{"type", "BPE"}}}, {"post_processor", nullptr}};
    TokenizerConfig config;
    BpeTables tables;
    const bool add_bos = llama ? sentencepiece_parts(root, unk, tables) : byte_level_parts(root, config, tables);
    // BOS/EOS come from the file's ids and flags alone: an explicit null keeps the HF loader from
    // guessing them by spelling, and explicit flags replace its template. An absent flag takes
    // llama.cpp's default, where the vocabulary has the token.
    config.bos_token = bos ? std::optional(tokens_[*bos]) : std::optional<std::string>();
    config.eos_token = eos ? std::optional(tokens_[*eos]) : std::optional<std::string>();
    config.add_bos_token = v_.add_bos_token.value_or(add_bos && bos);
    config.add_eos_token = v_.add_eos_token.value_or(false);
    if (*config.add_bos_token && !bos)
      fail("tokenizer.ggml.add_bos_token is true, but there is no tokenizer.ggml.bos_token_id");
    if (*config.add_eos_token && !eos)
      fail("tokenizer.ggml.add_eos_token is true, but there is no tokenizer.ggml.eos_token_id");
    tables.tokens = std::move(tokens_);
    tables.index = std::move(index_);
    return load_hf_tokenizer_json(root, std::string(what_), config, std::move(tables));
  }

 private:
  [[noreturn]] void fail(const std::string& message) const {
    throw LoadError(fmt::format("tokenizer '{}': {}", what_, message));
  }

  void check_tokens() {
    const size_t n = v_.tokens.size();
    if (n == 0) fail("tokenizer.ggml.tokens is missing or empty");
    if (n > kMaxTokens)
      fail(fmt::format("tokenizer.ggml.tokens has {} tokens, more than kiln's {}", n, kMaxTokens));
    if (!v_.scores.empty() && v_.scores.size() != n)
      fail(fmt::format("tokenizer.ggml.scores has {} entries for {} tokens", v_.scores.size(), n));
    if (!v_.token_types.empty() && v_.token_types.size() != n)
      fail(fmt::format("tokenizer.ggml.token_type has {} entries for {} tokens", v_.token_types.size(), n));
    for (size_t i = 0; i < v_.scores.size(); ++i)
      if (std::isnan(v_.scores[i])) fail(fmt::format("tokenizer.ggml.scores[{}] is NaN", i));
    for (size_t i = 0; i < v_.token_types.size(); ++i)
      if (v_.token_types[i] < kTokenNormal || v_.token_types[i] > kTokenByte)
        fail(fmt::format("tokenizer.ggml.token_type[{}] is {}, not a token type (1 normal .. 6 byte)", i,
                         v_.token_types[i]));
    tokens_ = v_.tokens;
    index_.reserve(n);
    for (size_t i = 0; i < n; ++i) {
      if (tokens_[i].empty()) tokens_[i] = fmt::format("[EMPTY_{}]", i);  // as llama.cpp names them
      if (!index_.insert(tokens_[i], static_cast<int64_t>(i)))
        fail(fmt::format("tokenizer.ggml.tokens has '{}' twice (ids {} and {})", to_valid_utf8(tokens_[i]),
                         *index_.find(tokens_[i]), i));
    }
  }

  // The id a key names: the file's, else `fallback` (-1: none); LoadError when out of range.
  std::optional<int64_t> id(std::optional<uint64_t> value, const char* key, int64_t fallback) const {
    const size_t n = tokens_.size();
    if (!value)
      return fallback >= 0 && static_cast<size_t>(fallback) < n ? std::optional(fallback) : std::nullopt;
    if (*value >= n) fail(fmt::format("{} is {}, outside the vocabulary of {} tokens", key, *value, n));
    return static_cast<int64_t>(*value);
  }

  int32_t type(size_t i) const { return v_.token_types.empty() ? kTokenNormal : v_.token_types[i]; }

  // Control and unknown tokens are special; user-defined ones are added tokens kept in decoded text.
  // All are matched in the raw text, as llama.cpp matches them (GGUF keeps no lstrip/rstrip flags).
  json added_tokens() const {
    json list = json::array();
    for (size_t i = 0; i < tokens_.size(); ++i) {
      const int32_t t = type(i);
      if (t != kTokenControl && t != kTokenUnknown && t != kTokenUserDefined) continue;
      list.push_back({{"id", i},
                      {"content", tokens_[i]},
                      {"special", t != kTokenUserDefined},
                      {"normalized", false},
                      {"lstrip", false},
                      {"rstrip", false},
                      {"single_word", false}});
    }
    return list;
  }

  const PreTokenizer& pre_tokenizer() const {
    for (const PreTokenizer& p : kPreTokenizers)
      if (std::find(p.names.begin(), p.names.end(), v_.pre) != p.names.end() && !v_.pre.empty()) return p;
    fail(fmt::format("{} (the pre-tokenizer of a gpt2 vocabulary); kiln knows {}",
                     v_.pre.empty() ? std::string("tokenizer.ggml.pre is missing")
                                    : fmt::format("tokenizer.ggml.pre '{}' is not supported", v_.pre),
                     supported_pre_names()));
  }

  // SentencePiece as llama.cpp runs it, in the form of Llama 2's tokenizer.json: " " prefixed to each
  // run of text (unless add_space_prefix is false), spaces as "▁", unknown characters as their <0xNN>
  // bytes. Returns llama.cpp's default for adding BOS.
  bool sentencepiece_parts(json& root, std::optional<int64_t> unk, BpeTables& tables) const {
    json& model = root["model"];
    tables.merges = merges_from_scores();
    model["byte_fallback"] = std::any_of(tokens_.begin(), tokens_.end(), [](const std::string& t) {
      return t.size() == 6 && t.rfind("<0x", 0) == 0 && t[5] == '>';
    });
    model["fuse_unk"] = true;
    if (unk) model["unk_token"] = tokens_[*unk];
    const bool prefix = v_.add_space_prefix.value_or(true);
    const json replace_spaces = {
        {"type", "Replace"}, {"pattern", {{"String", " "}}}, {"content", kMetaspace}};
    root["normalizer"] =
        prefix ? json{{"type", "Sequence"},
                      {"normalizers", {{{"type", "Prepend"}, {"prepend", kMetaspace}}, replace_spaces}}}
               : replace_spaces;
    root["pre_tokenizer"] = nullptr;
    json decoders = {{{"type", "Replace"}, {"pattern", {{"String", kMetaspace}}}, {"content", " "}},
                     {{"type", "ByteFallback"}},
                     {{"type", "Fuse"}}};
    if (prefix) decoders.push_back({{"type", "Strip"}, {"content", " "}, {"start", 1}, {"stop", 0}});
    root["decoder"] = {{"type", "Sequence"}, {"decoders", std::move(decoders)}};
    return true;
  }

  // Byte-level BPE with the file's merges and the pre-tokenizer `pre` names. Returns llama.cpp's
  // default for adding BOS.
  bool byte_level_parts(json& root, TokenizerConfig& config, BpeTables& tables) const {
    const PreTokenizer& pre = pre_tokenizer();
    json& model = root["model"];
    tables.merges = merges_from_file();
    model["ignore_merges"] = pre.ignore_merges;
    const auto byte_level = [](bool use_regex) {
      return json{{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", use_regex}};
    };
    root["normalizer"] = pre.nfc ? json{{"type", "NFC"}} : json();
    if (pre.split_regex)
      root["pre_tokenizer"] = {{"type", "Sequence"},
                               {"pretokenizers",
                                {{{"type", "Split"},
                                  {"pattern", {{"Regex", pre.split_regex}}},
                                  {"behavior", "Isolated"},
                                  {"invert", false}},
                                 byte_level(false)}}};
    else if (pre.split_digits)
      root["pre_tokenizer"] = {
          {"type", "Sequence"},
          {"pretokenizers", {{{"type", "Digits"}, {"individual_digits", true}}, byte_level(true)}}};
    else
      root["pre_tokenizer"] = byte_level(true);
    root["decoder"] = byte_level(true);
    config.clean_up_tokenization_spaces = pre.clean_up_spaces;
    return pre.add_bos;
  }

  // "a b" as llama.cpp splits it (at the first space after the first byte); every merge must join
  // two tokens of the vocabulary into a third.
  std::vector<BpeTables::Merge> merges_from_file() const {
    if (v_.merges.empty())
      fail("tokenizer.ggml.merges is missing or empty (a gpt2 vocabulary needs its merges)");
    std::vector<BpeTables::Merge> merges;
    merges.reserve(v_.merges.size());
    std::string joined;
    for (size_t i = 0; i < v_.merges.size(); ++i) {
      const std::string_view m = v_.merges[i];
      const size_t space = m.find(' ', 1);
      if (space == std::string::npos)
        fail(fmt::format("tokenizer.ggml.merges[{}] '{}' is not two tokens separated by a space", i,
                         to_valid_utf8(m)));
      const std::string_view a = m.substr(0, space), b = m.substr(space + 1);
      joined.assign(a).append(b);
      int32_t ids[3];
      for (int k = 0; k < 3; ++k) {
        const std::string_view t = k == 0 ? a : k == 1 ? b : std::string_view(joined);
        const std::optional<int64_t> id = index_.find(t);
        if (!id)
          fail(fmt::format("tokenizer.ggml.merges[{}] '{}': '{}' is not in tokenizer.ggml.tokens", i,
                           to_valid_utf8(m), to_valid_utf8(t)));
        ids[k] = static_cast<int32_t>(*id);
      }
      merges.push_back({ids[0], ids[1], ids[2]});
    }
    return merges;
  }

  // Hugging Face's SentencePieceExtractor, which made Llama 2's tokenizer.json: every token gives each
  // of its splits into two tokens (at character boundaries), ranked by the token's score, highest
  // first, then by token id, then by the halves' ids. BPE by these ranks merges, at every step, the
  // pair whose merge scores highest, as SentencePiece and llama.cpp do (they break ties among equal
  // scores leftmost first, HF by rank; HF's order is the one kept). No scores: all tie, by id.
  std::vector<BpeTables::Merge> merges_from_scores() const {
    struct Candidate {
      float score;
      int32_t id, left, right;
    };
    std::vector<Candidate> candidates;
    for (size_t i = 0; i < tokens_.size(); ++i) {
      const std::string_view token = tokens_[i];
      for (size_t cut = decode_utf8(token, 0).len; cut < token.size(); cut += decode_utf8(token, cut).len) {
        const std::optional<int64_t> l = index_.find(token.substr(0, cut)), r = index_.find(token.substr(cut));
        if (l && r)
          candidates.push_back({v_.scores.empty() ? 0.0f : v_.scores[i], static_cast<int32_t>(i),
                                static_cast<int32_t>(*l), static_cast<int32_t>(*r)});
      }
    }
    std::sort(candidates.begin(), candidates.end(), [](const Candidate& a, const Candidate& b) {
      return std::tie(b.score, a.id, a.left, a.right) < std::tie(a.score, b.id, b.left, b.right);
    });
    std::vector<BpeTables::Merge> merges;
    merges.reserve(candidates.size());
    for (const Candidate& c : candidates) merges.push_back({c.left, c.right, c.id});
    return merges;
  }

  const GGUFVocab& v_;
  std::string_view what_;
  std::vector<std::string> tokens_;  // v_.tokens, empty ones named
  FlatStringIndex index_;            // token -> id
};

}  // namespace

std::unique_ptr<Tokenizer> load_gguf_tokenizer(const GGUFVocab& vocab, std::string_view what) {
  return Converter(vocab, what).load();
}

}  // namespace kiln::pipelines::detail
