// Hugging Face tokenizer.json, model type BPE, read as the tokenizers library runs it. Encoding:
// added tokens are cut out of the raw text (one pass over it through a trie) -> each remaining section
// is normalized -> pre-tokenized into words -> each word is BPE-merged (through a cache of recent
// words) -> the post-processor adds BOS/EOS. Decoding runs the token strings through the decoder
// chain, then transformers' clean-up of spaces when tokenizer_config.json asks for it.
#include <fmt/format.h>
#include <utf8proc.h>

#include <algorithm>
#include <type_traits>
#include <utility>
#include <limits>
#include <array>
#include <cstdlib>
#include <mutex>
#include <nlohmann/json.hpp>
#include <queue>
#include <unordered_map>
#include <unordered_set>

#include "kiln/errors.h"
#include "pipelines/flat_tables.h"
#include "pipelines/json_input.h"
#include "pipelines/regex.h"
#include "pipelines/tokenizer_formats.h"
#include "pipelines/tokenizer_unicode.h"

namespace kiln::pipelines::detail {

using nlohmann::json;

namespace {

constexpr std::string_view kMetaspace = "\xE2\x96\x81";  // '▁'
constexpr int64_t kMaxTokenId = int64_t{1} << 24;        // far above any real vocabulary; bounds the id table
// The Split regex of ByteLevel with use_regex (GPT-2's).
constexpr std::string_view kGpt2Pattern = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

// GPT-2's byte-level alphabet: every byte maps to a printable character, so BPE never sees spaces or
// control bytes. Printable Latin-1 bytes map to themselves, the rest to U+0100 upwards, in order.
struct ByteLevelAlphabet {
  std::array<std::string, 256> byte_to_char;
  std::array<std::array<char, 2>, 256> utf8;  // byte_to_char as one or two UTF-8 bytes
  std::array<uint8_t, 256> utf8_len;
  std::unordered_map<char32_t, uint8_t> char_to_byte;

  ByteLevelAlphabet() {
    char32_t next = 256;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      const char32_t c = printable ? static_cast<char32_t>(b) : next++;
      append_utf8(byte_to_char[b], c);
      utf8_len[b] = static_cast<uint8_t>(byte_to_char[b].size());
      std::copy(byte_to_char[b].begin(), byte_to_char[b].end(), utf8[b].begin());
      char_to_byte[c] = static_cast<uint8_t>(b);
    }
  }
};

const ByteLevelAlphabet& byte_level_alphabet() {
  static const ByteLevelAlphabet alphabet;
  return alphabet;
}

std::string replace_all(std::string_view s, std::string_view from, std::string_view to) {
  if (from.empty()) return std::string(s);
  std::string out;
  size_t i = 0;
  for (size_t hit = s.find(from); hit != std::string_view::npos; hit = s.find(from, i)) {
    out.append(s, i, hit - i);
    out += to;
    i = hit + from.size();
  }
  out.append(s, i);
  return out;
}

bool starts_with(std::string_view s, std::string_view prefix) { return s.substr(0, prefix.size()) == prefix; }

// "<0x41>" -> 0x41.
std::optional<uint8_t> byte_token_value(std::string_view token) {
  if (token.size() != 6 || !starts_with(token, "<0x") || token[5] != '>') return std::nullopt;
  int value = 0;
  for (char c : token.substr(3, 2)) {
    const int digit = c >= '0' && c <= '9'   ? c - '0'
                      : c >= 'A' && c <= 'F' ? c - 'A' + 10
                      : c >= 'a' && c <= 'f' ? c - 'a' + 10
                                             : -1;
    if (digit < 0) return std::nullopt;
    value = value * 16 + digit;
  }
  return static_cast<uint8_t>(value);
}

// Text with each invalid UTF-8 subpart as U+FFFD, without a copy when it is valid already (it nearly
// always is): the regex engine and the normalizers need valid UTF-8.
std::string_view valid_utf8(std::string_view text, std::string& storage) {
  for (size_t i = 0; i < text.size();) {
    if (static_cast<uint8_t>(text[i]) < 0x80) {
      ++i;
      continue;
    }
    const Utf8Char c = decode_utf8(text, i);
    if (!c.valid) {
      storage = to_valid_utf8(text);
      return storage;
    }
    i += c.len;
  }
  return text;
}

// Rust's char::is_whitespace, as str::trim uses it.
size_t leading_whitespace(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    const Utf8Char c = decode_utf8(s, i);
    if (!is_whitespace(c.cp)) break;
    i += c.len;
  }
  return i;
}
size_t trailing_whitespace(std::string_view s) {
  size_t end = s.size();
  while (end > 0) {
    size_t start = end - 1;
    while (start > 0 && (static_cast<uint8_t>(s[start]) & 0xC0) == 0x80) --start;
    if (!is_whitespace(decode_utf8(s, start).cp)) break;
    end = start;
  }
  return s.size() - end;
}

// Applies utf8proc's options (a normal form) to valid UTF-8. ASCII is in every normal form already.
std::string utf8proc_transform(std::string_view text, utf8proc_option_t options) {
  if (std::all_of(text.begin(), text.end(), [](char c) { return static_cast<uint8_t>(c) < 0x80; }))
    return std::string(text);
  utf8proc_uint8_t* out = nullptr;
  const utf8proc_ssize_t n = utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(text.data()),
                                          static_cast<utf8proc_ssize_t>(text.size()), &out, options);
  if (n < 0) throw Error(fmt::format("tokenizer: normalization failed: {}", utf8proc_errmsg(n)));
  std::string result(reinterpret_cast<const char*>(out), static_cast<size_t>(n));
  std::free(out);
  return result;
}

std::string map_code_points(std::string_view text, char32_t (*f)(char32_t)) {
  std::string out;
  out.reserve(text.size());
  for (size_t i = 0; i < text.size();) {
    const Utf8Char c = decode_utf8(text, i);
    append_utf8(out, f(c.cp));
    i += c.len;
  }
  return out;
}

enum class PrependScheme { Always, First, Never };
// Split's SplitDelimiterBehavior.
enum class Behavior { Removed, Isolated, MergedWithPrevious, MergedWithNext, Contiguous };

// A pattern of a Split, Replace or Punctuation step: a literal string, a regex, or a character class.
struct Pattern {
  std::string literal;
  std::shared_ptr<const Regex> regex;
  bool (*char_class)(char32_t) = nullptr;

  // Match spans covering `text` in order: (begin, end, is_match).
  void find(std::string_view text, std::vector<std::pair<size_t, size_t>>& matches) const {
    if (regex) return regex->find_all(text, matches);
    if (char_class) {
      for (size_t i = 0; i < text.size();) {
        const Utf8Char c = decode_utf8(text, i);
        if (char_class(c.cp)) matches.emplace_back(i, i + c.len);
        i += c.len;
      }
      return;
    }
    if (literal.empty()) return;
    for (size_t hit = text.find(literal); hit != std::string_view::npos; hit = text.find(literal, hit + literal.size()))
      matches.emplace_back(hit, hit + literal.size());
  }
};

struct NormalizerStep {
  enum Kind { Prepend, Replace, NFC, NFD, NFKC, NFKD, Lowercase, Strip, StripAccents } kind;
  std::string text;  // Prepend: what; Replace: the content
  Pattern pattern;   // Replace
  bool left = false, right = false;  // Strip
};

struct PreTokenizerStep {
  enum Kind { Split, Digits, ByteLevel, Metaspace, WhitespaceSplit } kind;
  Pattern pattern;  // Split (and the regexes of ByteLevel, Whitespace and Punctuation, which are Splits)
  Behavior behavior = Behavior::Isolated;
  bool invert = false;
  bool add_prefix_space = false;  // ByteLevel
  bool use_regex = true;          // ByteLevel
  std::string replacement;        // Metaspace
  PrependScheme prepend = PrependScheme::Always;
  bool split = true;  // Metaspace
};

struct DecoderStep {
  enum Kind { Replace, ByteFallback, Fuse, ByteLevel, Metaspace, Strip, BpeSuffix } kind;
  Pattern pattern;                                // Replace
  std::string text;                               // Replace: content; Metaspace: replacement; Strip: content; BpeSuffix
  PrependScheme prepend = PrependScheme::Always;  // Metaspace
  size_t strip_start = 0, strip_stop = 0;         // Strip
};

struct AddedToken {
  std::string content;
  int64_t id;
  bool special, lstrip, rstrip, single_word, normalized;
};

// The added tokens' spellings, for the leftmost-longest match at each position of a text (what the
// tokenizers library gets from Aho-Corasick): one trie walk per position, and a table of the bytes
// that can begin a token so most positions cost one lookup.
class AddedTokenTrie {
 public:
  void insert(std::string_view content, int index) {
    int node = 0;
    for (char ch : content) {
      const auto b = static_cast<uint8_t>(ch);
      const uint64_t key = edge_key(node, b);
      auto it = edges_.find(key);
      if (it == edges_.end()) {
        it = edges_.emplace(key, static_cast<int>(token_at_.size())).first;
        token_at_.push_back(-1);
      }
      node = it->second;
    }
    token_at_[node] = index;
    first_byte_[static_cast<uint8_t>(content[0])] = true;
  }
  bool empty() const { return token_at_.size() == 1; }

  // The first position >= from where a token starts, and the longest token there: (position, index), or
  // index -1 when none starts in text[from..].
  std::pair<size_t, int> find(std::string_view text, size_t from) const {
    for (size_t i = from; i < text.size(); ++i) {
      if (!first_byte_[static_cast<uint8_t>(text[i])]) continue;
      if (const int t = longest_at(text, i); t >= 0) return {i, t};
    }
    return {text.size(), -1};
  }

 private:
  static uint64_t edge_key(int node, uint8_t b) { return (static_cast<uint64_t>(node) << 8) | b; }
  int longest_at(std::string_view text, size_t i) const {
    int node = 0, best = -1;
    for (size_t k = i; k < text.size(); ++k) {
      const auto it = edges_.find(edge_key(node, static_cast<uint8_t>(text[k])));
      if (it == edges_.end()) break;
      node = it->second;
      if (token_at_[node] >= 0) best = token_at_[node];
    }
    return best;
  }

  std::unordered_map<uint64_t, int> edges_;  // (node, byte) -> child node
  std::vector<int> token_at_{-1};            // node -> index of the token ending there, or -1
  std::array<bool, 256> first_byte_{};
};

// Reads one JSON field with a message naming the file and the field when it is missing or mistyped.
class JsonReader {
 public:
  explicit JsonReader(std::string file) : file_(std::move(file)) {}

  [[noreturn]] void fail(const std::string& what) const {
    throw LoadError(fmt::format("tokenizer '{}': {}", file_, what));
  }
  const json& field(const json& obj, const char* name, const char* where) const {
    if (!obj.is_object() || !obj.contains(name)) fail(fmt::format("{} has no '{}'", where, name));
    return obj.at(name);
  }
  std::string string(const json& obj, const char* name, const char* where) const {
    const json& v = field(obj, name, where);
    if (!v.is_string()) fail(fmt::format("{}.{} is {}, expected a string", where, name, v.type_name()));
    return v.get<std::string>();
  }
  template <class T>
  T optional(const json& obj, const char* name, T fallback) const {
    if (!obj.is_object() || !obj.contains(name) || obj.at(name).is_null()) return fallback;
    if constexpr (std::is_integral_v<T> && !std::is_same_v<T, bool>) {
      // The JSON library converts any number with a plain cast: a float, or an integer out of T's
      // range, would be undefined behaviour (a fuzzed "stop": 9.2e18), so integers only, in range.
      const json& v = obj.at(name);
      const bool in_range = v.is_number_unsigned()  ? std::in_range<T>(v.get<uint64_t>())
                            : v.is_number_integer() ? std::in_range<T>(v.get<int64_t>())
                                                    : false;
      if (!in_range)
        fail(fmt::format("'{}' is {}, expected an integer in [{}, {}]", name, json_input::describe(v),
                         std::numeric_limits<T>::min(), std::numeric_limits<T>::max()));
      return v.is_number_unsigned() ? static_cast<T>(v.get<uint64_t>()) : static_cast<T>(v.get<int64_t>());
    }
    try {
      return obj.at(name).get<T>();
    } catch (const json::exception&) {
      fail(fmt::format("'{}' is {}, of the wrong type", name, obj.at(name).type_name()));
    }
  }
  // `what` names the id's owner in an error: a string, or a callable making one (formatted only then).
  template <class What>
  int64_t token_id(const json& v, const What& what) const {
    const auto subject = [&]() -> std::string {
      if constexpr (std::is_invocable_v<const What&>) return what();
      else return std::string(what);
    };
    if (!v.is_number_integer())
      fail(fmt::format("{} has id {}, expected an integer", subject(), json_input::describe(v)));
    const int64_t id = v.get<int64_t>();
    if (id < 0 || id >= kMaxTokenId)
      fail(fmt::format("{} has id {}, outside [0, {})", subject(), id, kMaxTokenId));
    return id;
  }
  const std::string& file() const { return file_; }

 private:
  std::string file_;
};

// tokenizer.json's model.vocab members and model.merges elements -> BpeTables, taken one at a time
// (streamed from the parser, or walked in a DOM). Merges are resolved to ids once the vocabulary is
// whole: a file may list them first.
class BpeTablesReader {
 public:
  explicit BpeTablesReader(const JsonReader& in) : in_(in) {}

  // False: the vocabulary has the token already.
  bool vocab_member(const std::string& token, const json& id) {
    const int64_t i = in_.token_id(id, [&] { return fmt::format("vocab token '{}'", token); });
    if (!tables_.index.insert(token, i)) return false;
    if (i >= static_cast<int64_t>(tables_.tokens.size())) tables_.tokens.resize(static_cast<size_t>(i) + 1);
    tables_.tokens[static_cast<size_t>(i)] = token;
    return true;
  }

  // "a b" or ["a", "b"], the next rank.
  void merge(const json& m) {
    const size_t rank = merges_.size();
    std::string_view a, b;
    if (m.is_string()) {
      const std::string_view s = m.get_ref<const std::string&>();
      const size_t space = s.find(' ');
      if (space == std::string::npos || s.find(' ', space + 1) != std::string::npos)
        in_.fail(fmt::format("merge {} '{}' is not two tokens separated by one space", rank, s));
      a = s.substr(0, space), b = s.substr(space + 1);
    } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
      a = m[0].get_ref<const std::string&>(), b = m[1].get_ref<const std::string&>();
    } else {
      in_.fail(fmt::format("merge {} is {}, expected \"a b\" or [\"a\", \"b\"]", rank, json_input::describe(m)));
    }
    merges_.push_back({text_.size(), a.size()});
    text_.append(a).append(b);
  }

  // The tables; `prefix` (continuing_subword_prefix) is dropped from a merge's right token to name
  // the merged one ("##").
  BpeTables finish(std::string_view prefix) && {
    tables_.merges.reserve(merges_.size());
    std::string merged;
    for (size_t rank = 0; rank < merges_.size(); ++rank) {
      const size_t at = merges_[rank].at,
                   end = rank + 1 < merges_.size() ? merges_[rank + 1].at : text_.size();
      const std::string_view a = std::string_view(text_).substr(at, merges_[rank].left_bytes),
                             b = std::string_view(text_).substr(at + a.size(), end - at - a.size());
      merged.assign(a).append(starts_with(b, prefix) ? b.substr(prefix.size()) : b);
      const std::optional<int64_t> ia = tables_.index.find(a), ib = tables_.index.find(b),
                                   iab = tables_.index.find(merged);
      if (!ia || !ib || !iab)
        in_.fail(fmt::format("merge {} ('{}' '{}'): '{}' is not in the vocabulary", rank, a, b,
                             !ia ? a : !ib ? b : std::string_view(merged)));
      tables_.merges.push_back(
          {static_cast<int32_t>(*ia), static_cast<int32_t>(*ib), static_cast<int32_t>(*iab)});
    }
    return std::move(tables_);
  }

 private:
  struct MergeText {
    size_t at, left_bytes;  // in text_: the left token, then the right one up to the next merge's
  };
  const JsonReader& in_;
  BpeTables tables_;
  std::vector<MergeText> merges_;
  std::string text_;
};

class HfBpeTokenizer final : public Tokenizer {
 public:
  // `tables`: the vocabulary and merges, where root's model has none; else from model.vocab and
  // model.merges, through `streamed` when the parser handed it their elements (leaving them empty).
  HfBpeTokenizer(const json& root, const JsonReader& in, const TokenizerConfig& config,
                 std::optional<BpeTables> tables, BpeTablesReader* streamed)
      : file_(in.file()), clean_up_spaces_(config.clean_up_tokenization_spaces) {
    const json& model = in.field(root, "model", "the file");
    const std::string type = in.optional<std::string>(model, "type", "BPE");
    if (type != "BPE")
      in.fail(fmt::format("model type '{}' is not supported (kiln reads BPE tokenizers only)", type));
    if (tables) load_tables(std::move(*tables), in);
    else load_vocab_and_merges(model, in, streamed);
    load_model(model, in);
    if (root.contains("added_tokens")) load_added_tokens(root.at("added_tokens"), in);
    load_normalizer(root.value("normalizer", json()), in);
    load_pre_tokenizer(root.value("pre_tokenizer", json()), in);
    load_post_processor(root.value("post_processor", json()), in);
    load_decoder(root.value("decoder", json()), in);
    apply_config(config, in);
    build_added_token_tries();
  }

  // ---- encode --------------------------------------------------------------------------------------

  std::vector<int64_t> encode(std::string_view raw_text, bool add_special_tokens) const override {
    std::string storage;
    const std::string_view text = valid_utf8(raw_text, storage);
    std::vector<int64_t> ids;
    if (add_special_tokens) ids = prefix_ids_;
    // Sections between the raw-text added tokens, each normalized, then split again on the added
    // tokens that match normalized text. Only the section at the start of the text is "first"
    // (Metaspace's prepend_scheme).
    split_on_added(text, raw_trie_, [&](std::string_view section, const AddedToken* token) {
      if (token) return ids.push_back(token->id);
      const bool first = section.data() == text.data();
      if (normalizer_.empty()) return encode_section(section, first, ids);
      const std::string normalized = normalize(section);
      split_on_added(normalized, normalized_trie_, [&](std::string_view piece, const AddedToken* t) {
        if (t) return ids.push_back(t->id);
        encode_section(piece, first && piece.data() == normalized.data(), ids);
      });
    });
    if (add_special_tokens) ids.insert(ids.end(), suffix_ids_.begin(), suffix_ids_.end());
    return ids;
  }

  // ---- decode --------------------------------------------------------------------------------------

  std::string decode(const std::vector<int64_t>& ids, bool skip_special_tokens) const override {
    std::vector<std::string> tokens;
    tokens.reserve(ids.size());
    for (int64_t id : ids) {
      if (id < 0) throw ValueError(fmt::format("tokenizer '{}': decode: token id {} is negative", file_, id));
      // The tokenizers library skips ids it has no token for, as transformers' decode does.
      if (id >= vocab_size() || id_to_token_[id].empty()) continue;
      if (skip_special_tokens && is_special(id)) continue;
      tokens.push_back(id_to_token_[id]);
    }
    std::string text;
    if (decoder_.empty()) {
      for (size_t i = 0; i < tokens.size(); ++i) text += (i ? " " : "") + tokens[i];
    } else {
      for (const DecoderStep& step : decoder_) decode_step(step, tokens);
      for (const std::string& t : tokens) text += t;
    }
    text = to_valid_utf8(text);
    return clean_up_spaces_ ? clean_up_tokenization(text) : text;
  }

  std::string token_bytes(int64_t id) const override {
    const std::string& token = token_of(id, "token_bytes");
    if (is_special(id)) return "";
    return raw_token_bytes(token);
  }

  int64_t vocab_size() const override { return static_cast<int64_t>(id_to_token_.size()); }
  std::optional<int64_t> bos_id() const override { return bos_id_; }
  std::optional<int64_t> eos_id() const override { return eos_id_; }
  std::optional<int64_t> token_to_id(std::string_view token) const override {
    if (const auto it = added_ids_.find(std::string(token)); it != added_ids_.end()) return it->second;
    return vocab_.find(token);
  }
  bool is_special(int64_t id) const override { return special_ids_.count(id) != 0; }

 private:
  // ---- loading -------------------------------------------------------------------------------------

  void set_token(int64_t id, const std::string& token) {
    if (id >= static_cast<int64_t>(id_to_token_.size())) id_to_token_.resize(id + 1);
    id_to_token_[id] = token;
  }

  // model.vocab and model.merges of tokenizer.json: walked here, or already read by `streamed`.
  void load_vocab_and_merges(const json& model, const JsonReader& in, BpeTablesReader* streamed) {
    const json& vocab = in.field(model, "vocab", "model");
    if (!vocab.is_object()) in.fail(fmt::format("model.vocab is {}, expected an object", vocab.type_name()));
    const json& merges = in.field(model, "merges", "model");
    if (!merges.is_array()) in.fail(fmt::format("model.merges is {}, expected a list", merges.type_name()));
    BpeTablesReader walked(in);
    BpeTablesReader& reader = streamed ? *streamed : walked;
    for (const auto& [token, id] : vocab.items())
      reader.vocab_member(token, id);  // the JSON's keys are unique (json_input refuses a repeated one)
    for (const json& m : merges) reader.merge(m);
    load_tables(std::move(reader).finish(in.optional<std::string>(model, "continuing_subword_prefix", "")), in);
  }

  // The vocabulary and merges as tables (the merges' ids checked).
  void load_tables(BpeTables tables, const JsonReader& in) {
    const size_t n = tables.tokens.size();
    if (static_cast<int64_t>(n) > kMaxTokenId)
      in.fail(fmt::format("the vocabulary has {} ids, more than kiln's {}", n, kMaxTokenId));
    vocab_ = std::move(tables.index);
    id_to_token_ = std::move(tables.tokens);
    merges_.reserve(tables.merges.size());
    for (size_t rank = 0; rank < tables.merges.size(); ++rank) {
      const BpeTables::Merge& m = tables.merges[rank];
      for (const int32_t id : {m.left, m.right, m.merged})
        if (id < 0 || static_cast<size_t>(id) >= n)
          in.fail(fmt::format("merge {} has token id {}, outside the vocabulary of {}", rank, id, n));
      merges_.insert(pair_key(m.left, m.right), {static_cast<int32_t>(rank), m.merged});
    }
  }

  // The rest of the model, once the vocabulary and merges are in.
  void load_model(const json& model, const JsonReader& in) {
    prefix_ = in.optional<std::string>(model, "continuing_subword_prefix", "");
    suffix_ = in.optional<std::string>(model, "end_of_word_suffix", "");
    if (const json* dropout = model.contains("dropout") ? &model.at("dropout") : nullptr;
        dropout && !dropout->is_null() && !(dropout->is_number() && dropout->get<double>() == 0.0))
      in.fail(fmt::format("BPE dropout {} is not supported (it makes encoding random)",
                          json_input::describe(*dropout)));
    ignore_merges_ = in.optional<bool>(model, "ignore_merges", false);
    byte_fallback_ = in.optional<bool>(model, "byte_fallback", false);
    fuse_unk_ = in.optional<bool>(model, "fuse_unk", false);
    if (const std::string unk = in.optional<std::string>(model, "unk_token", ""); !unk.empty()) {
      const std::optional<int64_t> id = vocab_.find(unk);
      if (!id) in.fail(fmt::format("unk_token '{}' is not in the vocabulary", unk));
      unk_id_ = *id;
    }
    if (byte_fallback_)
      for (int b = 0; b < 256; ++b)
        if (const std::optional<int64_t> id = vocab_.find(fmt::format("<0x{:02X}>", b))) byte_ids_[b] = *id;
  }

  void add_token(AddedToken token) {
    set_token(token.id, token.content);
    if (token.special) special_ids_.insert(token.id);
    if (added_ids_.emplace(token.content, token.id).second) added_.push_back(std::move(token));
  }

  void load_added_tokens(const json& list, const JsonReader& in) {
    if (!list.is_array()) in.fail(fmt::format("added_tokens is {}, expected a list", list.type_name()));
    for (const json& t : list) {
      AddedToken token{in.string(t, "content", "an added token"), 0, false, false, false, false, false};
      token.id =
          in.token_id(in.field(t, "id", "an added token"), fmt::format("added token '{}'", token.content));
      if (token.content.empty()) in.fail(fmt::format("added token {} has empty content", token.id));
      token.special = in.optional<bool>(t, "special", false);
      token.lstrip = in.optional<bool>(t, "lstrip", false);
      token.rstrip = in.optional<bool>(t, "rstrip", false);
      token.single_word = in.optional<bool>(t, "single_word", false);
      token.normalized = in.optional<bool>(t, "normalized", !token.special);
      add_token(std::move(token));
    }
  }

  Pattern pattern_of(const json& step, const JsonReader& in, const char* where) const {
    const json& p = in.field(step, "pattern", where);
    Pattern pattern;
    if (p.is_object() && p.contains("String")) {
      pattern.literal = in.string(p, "String", where);
    } else if (p.is_object() && p.contains("Regex")) {
      const std::string regex = in.string(p, "Regex", where);
      try {
        pattern.regex = std::make_shared<Regex>(regex);
      } catch (const ValueError& e) {
        in.fail(fmt::format("{}: {}", where, e.what()));
      }
    } else {
      in.fail(fmt::format("{}: pattern {} is neither {{\"String\": ...}} nor {{\"Regex\": ...}}", where,
                          json_input::describe(p)));
    }
    return pattern;
  }

  void load_normalizer(const json& n, const JsonReader& in) {
    if (n.is_null()) return;
    const std::string type = in.string(n, "type", "the normalizer");
    NormalizerStep step{};
    if (type == "Sequence") {
      for (const json& s : in.field(n, "normalizers", "the Sequence normalizer")) load_normalizer(s, in);
      return;
    } else if (type == "Prepend") {
      step.kind = NormalizerStep::Prepend;
      step.text = in.string(n, "prepend", "the Prepend normalizer");
    } else if (type == "Replace") {
      step.kind = NormalizerStep::Replace;
      step.pattern = pattern_of(n, in, "the Replace normalizer");
      step.text = in.string(n, "content", "the Replace normalizer");
    } else if (type == "NFC" || type == "NFD" || type == "NFKC" || type == "NFKD") {
      step.kind = type == "NFC" ? NormalizerStep::NFC : type == "NFD" ? NormalizerStep::NFD
                  : type == "NFKC"                    ? NormalizerStep::NFKC
                                                      : NormalizerStep::NFKD;
    } else if (type == "Lowercase") {
      step.kind = NormalizerStep::Lowercase;
    } else if (type == "Strip") {
      step.kind = NormalizerStep::Strip;
      step.left = in.optional<bool>(n, "strip_left", true);
      step.right = in.optional<bool>(n, "strip_right", true);
    } else if (type == "StripAccents") {
      step.kind = NormalizerStep::StripAccents;
    } else {
      in.fail(fmt::format("normalizer '{}' is not supported", type));
    }
    normalizer_.push_back(std::move(step));
  }

  static Behavior behavior_of(const json& p, const JsonReader& in, const char* where) {
    const std::string b = in.optional<std::string>(p, "behavior", "Isolated");
    if (b == "Removed") return Behavior::Removed;
    if (b == "Isolated") return Behavior::Isolated;
    if (b == "MergedWithPrevious") return Behavior::MergedWithPrevious;
    if (b == "MergedWithNext") return Behavior::MergedWithNext;
    if (b == "Contiguous") return Behavior::Contiguous;
    in.fail(fmt::format("{}: behavior '{}' is not Removed, Isolated, MergedWithPrevious, MergedWithNext or "
                        "Contiguous",
                        where, b));
  }

  void load_pre_tokenizer(const json& p, const JsonReader& in) {
    if (p.is_null()) return;
    const std::string type = in.string(p, "type", "the pre_tokenizer");
    PreTokenizerStep step{};
    step.kind = PreTokenizerStep::Split;
    if (type == "Sequence") {
      for (const json& s : in.field(p, "pretokenizers", "the Sequence pre_tokenizer")) load_pre_tokenizer(s, in);
      return;
    } else if (type == "ByteLevel") {
      step.kind = PreTokenizerStep::ByteLevel;
      step.add_prefix_space = in.optional<bool>(p, "add_prefix_space", true);
      step.use_regex = in.optional<bool>(p, "use_regex", true);
      if (step.use_regex) step.pattern.regex = gpt2_regex();
    } else if (type == "Split") {
      step.pattern = pattern_of(p, in, "the Split pre_tokenizer");
      step.behavior = behavior_of(p, in, "the Split pre_tokenizer");
      step.invert = in.optional<bool>(p, "invert", false);
    } else if (type == "Digits") {
      step.kind = PreTokenizerStep::Digits;
      step.pattern.char_class = is_number;
      step.behavior = in.optional<bool>(p, "individual_digits", false) ? Behavior::Isolated : Behavior::Contiguous;
    } else if (type == "Punctuation") {
      step.pattern.char_class = is_punctuation;
      step.behavior = behavior_of(p, in, "the Punctuation pre_tokenizer");
    } else if (type == "Whitespace") {  // \w+|[^\w\s]+, keeping only the matches
      step.pattern.regex = std::make_shared<Regex>(R"(\w+|[^\w\s]+)");
      step.behavior = Behavior::Removed;
      step.invert = true;
    } else if (type == "WhitespaceSplit") {
      step.kind = PreTokenizerStep::WhitespaceSplit;
    } else if (type == "Metaspace") {
      step.kind = PreTokenizerStep::Metaspace;
      step.replacement = in.optional<std::string>(p, "replacement", std::string(kMetaspace));
      if (step.replacement.empty() || decode_utf8(step.replacement, 0).len != step.replacement.size())
        in.fail(fmt::format("Metaspace replacement '{}' is not one character", step.replacement));
      step.prepend = prepend_scheme(p, in);
      step.split = in.optional<bool>(p, "split", true);
    } else {
      in.fail(fmt::format("pre_tokenizer '{}' is not supported", type));
    }
    pre_tokenizer_.push_back(std::move(step));
  }

  static std::shared_ptr<const Regex> gpt2_regex() {
    static const auto regex = std::make_shared<const Regex>(kGpt2Pattern);
    return regex;
  }

  static PrependScheme prepend_scheme(const json& p, const JsonReader& in) {
    if (p.contains("prepend_scheme") && !p.at("prepend_scheme").is_null()) {
      const std::string s = in.string(p, "prepend_scheme", "Metaspace");
      if (s == "always") return PrependScheme::Always;
      if (s == "first") return PrependScheme::First;
      if (s == "never") return PrependScheme::Never;
      in.fail(fmt::format("Metaspace prepend_scheme '{}' is not always, first or never", s));
    }
    return in.optional<bool>(p, "add_prefix_space", true) ? PrependScheme::Always : PrependScheme::Never;
  }

  std::vector<int64_t> special_ids(const json& specials, const std::string& name, const JsonReader& in) const {
    const json& entry = in.field(specials, name.c_str(), "TemplateProcessing.special_tokens");
    std::vector<int64_t> ids;
    for (const json& id : in.field(entry, "ids", "a template special token"))
      ids.push_back(in.token_id(id, "template token '" + name + "'"));
    return ids;
  }

  // The token id a post-processor names as [token, id] (Bert/Roberta).
  static int64_t pair_id(const json& p, const char* name, const JsonReader& in) {
    const json& v = in.field(p, name, "the post_processor");
    if (!v.is_array() || v.size() != 2 || !v[0].is_string())
      in.fail(fmt::format("post_processor.{} is {}, expected [token, id]", name, json_input::describe(v)));
    return in.token_id(v[1], fmt::format("post_processor.{}", name));
  }

  void load_post_processor(const json& p, const JsonReader& in) {
    if (p.is_null()) return;
    const std::string type = in.string(p, "type", "the post_processor");
    if (type == "Sequence") {
      for (const json& s : in.field(p, "processors", "the Sequence post_processor")) load_post_processor(s, in);
    } else if (type == "ByteLevel") {
      // Only adjusts offsets, which kiln does not report.
    } else if (type == "TemplateProcessing") {
      const json& single = in.field(p, "single", "TemplateProcessing");
      const json& specials = in.field(p, "special_tokens", "TemplateProcessing");
      if (!single.is_array()) in.fail("TemplateProcessing.single is not a list");
      bool seen_sequence = false;
      for (const json& item : single) {
        if (item.contains("Sequence")) {
          seen_sequence = true;
          continue;
        }
        const std::string name =
            in.string(in.field(item, "SpecialToken", "a template item"), "id", "SpecialToken");
        const std::vector<int64_t> ids = special_ids(specials, name, in);
        auto& side = seen_sequence ? suffix_ids_ : prefix_ids_;
        side.insert(side.end(), ids.begin(), ids.end());
      }
      template_bos_ = !prefix_ids_.empty() ? std::optional(prefix_ids_.front()) : std::nullopt;
      template_eos_ = !suffix_ids_.empty() ? std::optional(suffix_ids_.back()) : std::nullopt;
    } else if (type == "BertProcessing" || type == "RobertaProcessing") {  // [CLS] A [SEP]
      prefix_ids_.push_back(pair_id(p, "cls", in));
      suffix_ids_.push_back(pair_id(p, "sep", in));
      template_bos_ = prefix_ids_.front(), template_eos_ = suffix_ids_.back();
    } else {
      in.fail(fmt::format("post_processor '{}' is not supported", type));
    }
  }

  void load_decoder(const json& d, const JsonReader& in) {
    if (d.is_null()) return;
    const std::string type = in.string(d, "type", "the decoder");
    DecoderStep step{};
    if (type == "Sequence") {
      for (const json& s : in.field(d, "decoders", "the Sequence decoder")) load_decoder(s, in);
      return;
    } else if (type == "Fuse") {
      step.kind = DecoderStep::Fuse;
    } else if (type == "ByteLevel") {
      step.kind = DecoderStep::ByteLevel;
    } else if (type == "ByteFallback") {
      step.kind = DecoderStep::ByteFallback;
    } else if (type == "Replace") {
      step.kind = DecoderStep::Replace;
      step.pattern = pattern_of(d, in, "the Replace decoder");
      step.text = in.string(d, "content", "the Replace decoder");
    } else if (type == "Metaspace") {
      step.kind = DecoderStep::Metaspace;
      step.text = in.optional<std::string>(d, "replacement", std::string(kMetaspace));
      step.prepend = prepend_scheme(d, in);
    } else if (type == "Strip") {
      step.kind = DecoderStep::Strip;
      step.text = in.string(d, "content", "the Strip decoder");
      if (step.text.empty() || decode_utf8(step.text, 0).len != step.text.size())
        in.fail(fmt::format("the Strip decoder's content '{}' is not one character", step.text));
      step.strip_start = in.optional<size_t>(d, "start", 0);
      step.strip_stop = in.optional<size_t>(d, "stop", 0);
    } else if (type == "BPEDecoder") {
      step.kind = DecoderStep::BpeSuffix;
      step.text = in.optional<std::string>(d, "suffix", "</w>");
    } else {
      in.fail(fmt::format("decoder '{}' is not supported", type));
    }
    decoder_.push_back(std::move(step));
  }

  // tokenizer_config.json on top of tokenizer.json, as transformers applies it.
  void apply_config(const TokenizerConfig& config, const JsonReader& in) {
    for (const TokenizerConfig::AddedToken& t : config.added_tokens_decoder) {
      if (t.id < 0 || t.id >= kMaxTokenId)
        in.fail(fmt::format("tokenizer_config.json: added token '{}' has id {}, outside [0, {})", t.content, t.id,
                            kMaxTokenId));
      if (!added_ids_.count(t.content))
        add_token({t.content, t.id, t.special, t.lstrip, t.rstrip, t.single_word, t.normalized});
    }
    for (const std::string& name : config.additional_special_tokens)
      if (const auto id = token_to_id(name)) special_ids_.insert(*id);

    const auto resolve = [&](const TokenizerConfig::TokenSetting& setting, std::optional<int64_t> fallback,
                             const char* key) -> std::optional<int64_t> {
      if (!setting) return fallback;
      if (!*setting) return std::nullopt;  // null: the model has no such token
      const auto id = token_to_id(**setting);
      if (!id)
        in.fail(fmt::format("tokenizer_config.json: {} '{}' is not a token of the vocabulary", key, **setting));
      return id;
    };
    bos_id_ = resolve(config.bos_token, template_bos_ ? template_bos_ : first_known({"<s>", "<|begin_of_text|>", "<bos>", "<|startoftext|>", "<|endoftext|>"}), "bos_token");
    eos_id_ = resolve(config.eos_token, template_eos_ ? template_eos_ : first_known({"</s>", "<|end_of_text|>", "<eos>", "<|endoftext|>", "<|im_end|>"}), "eos_token");
    // add_bos_token / add_eos_token rebuild the template around the text (LlamaTokenizerFast's
    // update_post_processor): only when the file says so, and only with a token to add.
    if (config.add_bos_token || config.add_eos_token) {
      const bool add_bos = config.add_bos_token.value_or(!prefix_ids_.empty());
      const bool add_eos = config.add_eos_token.value_or(!suffix_ids_.empty());
      if (add_bos && !bos_id_) in.fail("tokenizer_config.json: add_bos_token is true, but there is no bos_token");
      if (add_eos && !eos_id_) in.fail("tokenizer_config.json: add_eos_token is true, but there is no eos_token");
      prefix_ids_ = add_bos ? std::vector<int64_t>{*bos_id_} : std::vector<int64_t>{};
      suffix_ids_ = add_eos ? std::vector<int64_t>{*eos_id_} : std::vector<int64_t>{};
    }
  }

  std::optional<int64_t> first_known(std::initializer_list<std::string_view> names) const {
    for (std::string_view n : names)
      if (auto id = token_to_id(n)) return id;
    return std::nullopt;
  }

  void build_added_token_tries() {
    for (size_t i = 0; i < added_.size(); ++i)
      (added_[i].normalized && !normalizer_.empty() ? normalized_trie_ : raw_trie_)
          .insert(added_[i].normalized && !normalizer_.empty() ? normalize(added_[i].content) : added_[i].content,
                  static_cast<int>(i));
  }

  // ---- encoding steps ------------------------------------------------------------------------------

  // Calls emit(section, nullptr) for the text between added tokens and emit(spelling, &token) for each
  // added token, in order. A token whose single_word rule fails at its place is not one there; lstrip /
  // rstrip take the whitespace beside a token with it.
  template <class Emit>
  void split_on_added(std::string_view text, const AddedTokenTrie& trie, Emit&& emit) const {
    if (trie.empty()) {
      if (!text.empty()) emit(text, nullptr);
      return;
    }
    size_t section_start = 0;
    for (size_t from = 0; from < text.size();) {
      const auto [pos, index] = trie.find(text, from);
      if (index < 0) break;
      const AddedToken& token = added_[index];
      size_t start = pos, end = pos + token.content.size();
      if (token.single_word && !is_word_boundary(text, start, end)) {
        from = end;
        continue;
      }
      if (token.lstrip) start -= trailing_whitespace(text.substr(section_start, start - section_start));
      if (token.rstrip) end += leading_whitespace(text.substr(end));
      if (start > section_start) emit(text.substr(section_start, start - section_start), nullptr);
      emit(text.substr(start, end - start), &token);
      section_start = from = end;
    }
    if (section_start < text.size()) emit(text.substr(section_start), nullptr);
  }

  static bool is_word_char_at(std::string_view text, size_t i) {
    const char32_t c = decode_utf8(text, i).cp;
    return c == '_' || is_letter(c) || is_number(c);
  }
  static bool is_word_boundary(std::string_view text, size_t start, size_t end) {
    if (end < text.size() && is_word_char_at(text, end)) return false;
    if (start == 0) return true;
    size_t prev = start - 1;  // back to the lead byte of the previous character
    while (prev > 0 && (static_cast<uint8_t>(text[prev]) & 0xC0) == 0x80 && start - prev < 4) --prev;
    return !is_word_char_at(text, prev);
  }

  std::string normalize(std::string_view section) const {
    std::string s(section);
    for (const NormalizerStep& n : normalizer_) {
      switch (n.kind) {
        case NormalizerStep::Prepend:
          if (!s.empty()) s = n.text + s;
          break;
        case NormalizerStep::Replace: {
          std::vector<std::pair<size_t, size_t>> matches;
          n.pattern.find(s, matches);
          if (matches.empty()) break;
          std::string out;
          size_t at = 0;
          for (const auto& [b, e] : matches) out.append(s, at, b - at).append(n.text), at = e;
          s = out.append(s, at);
          break;
        }
        case NormalizerStep::NFC:
          s = utf8proc_transform(s, static_cast<utf8proc_option_t>(UTF8PROC_STABLE | UTF8PROC_COMPOSE));
          break;
        case NormalizerStep::NFD:
          s = utf8proc_transform(s, static_cast<utf8proc_option_t>(UTF8PROC_STABLE | UTF8PROC_DECOMPOSE));
          break;
        case NormalizerStep::NFKC:
          s = utf8proc_transform(s, static_cast<utf8proc_option_t>(UTF8PROC_STABLE | UTF8PROC_COMPOSE | UTF8PROC_COMPAT));
          break;
        case NormalizerStep::NFKD:
          s = utf8proc_transform(s, static_cast<utf8proc_option_t>(UTF8PROC_STABLE | UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT));
          break;
        case NormalizerStep::Lowercase:
          s = map_code_points(s, [](char32_t c) {
            return static_cast<char32_t>(utf8proc_tolower(static_cast<utf8proc_int32_t>(c)));
          });
          break;
        case NormalizerStep::Strip: {
          const size_t left = n.left ? leading_whitespace(s) : 0;
          const size_t right = n.right && left < s.size() ? trailing_whitespace(std::string_view(s).substr(left)) : 0;
          s = s.substr(left, s.size() - left - right);
          break;
        }
        case NormalizerStep::StripAccents: {  // drops the non-spacing marks (after NFD: the accents)
          std::string out;
          for (size_t i = 0; i < s.size();) {
            const Utf8Char c = decode_utf8(s, i);
            if (category_of(c.cp) != UTF8PROC_CATEGORY_MN) out.append(s, i, c.len);
            i += c.len;
          }
          s = std::move(out);
          break;
        }
      }
    }
    return s;
  }

  void encode_section(std::string_view section, bool first, std::vector<int64_t>& ids) const {
    if (!section.empty()) pre_tokenize(0, section, first, ids);
  }

  // A piece of a word as a split leaves it: a byte range, and whether the pattern matched it.
  struct Piece {
    size_t begin, end;
    bool is_match;
  };

  // The pieces of `text` by the pattern's matches, as tokenizers' NormalizedString::split with the
  // step's behaviour.
  static std::vector<Piece> split_pieces(const PreTokenizerStep& step, std::string_view text) {
    std::vector<std::pair<size_t, size_t>> matches;
    step.pattern.find(text, matches);
    std::vector<Piece> pieces;
    pieces.reserve(2 * matches.size() + 1);
    size_t at = 0;
    for (const auto& [b, e] : matches) {
      if (b > at) pieces.push_back({at, b, step.invert});
      pieces.push_back({b, e, !step.invert});
      at = e;
    }
    if (at < text.size()) pieces.push_back({at, text.size(), step.invert});

    std::vector<Piece> kept;
    switch (step.behavior) {
      case Behavior::Isolated:
        return pieces;
      case Behavior::Removed:
        for (const Piece& p : pieces)
          if (!p.is_match) kept.push_back(p);
        return kept;
      case Behavior::MergedWithPrevious: {
        bool previous_match = false;
        for (const Piece& p : pieces) {
          if (p.is_match && !previous_match && !kept.empty())
            kept.back().end = p.end;
          else
            kept.push_back(p);
          previous_match = p.is_match;
        }
        return kept;
      }
      case Behavior::MergedWithNext: {
        bool previous_match = false;
        for (size_t i = pieces.size(); i-- > 0;) {
          const Piece& p = pieces[i];
          if (p.is_match && !previous_match && !kept.empty())
            kept.back().begin = p.begin;
          else
            kept.push_back(p);
          previous_match = p.is_match;
        }
        std::reverse(kept.begin(), kept.end());
        return kept;
      }
      case Behavior::Contiguous: {
        bool previous_match = false;
        for (const Piece& p : pieces) {
          if (p.is_match == previous_match && !kept.empty())
            kept.back().end = p.end;
          else
            kept.push_back(p);
          previous_match = p.is_match;
        }
        return kept;
      }
    }
    return pieces;
  }

  // Calls emit(begin, end) for each piece of split_pieces(step, text), in order; the common Isolated
  // split is streamed from the regex, without a list of pieces.
  template <class Emit>
  static void for_each_piece(const PreTokenizerStep& step, std::string_view text, Emit&& emit) {
    if (step.behavior == Behavior::Isolated && step.pattern.regex) {
      size_t at = 0;
      step.pattern.regex->for_each_match(text, [&](size_t b, size_t e) {
        if (b > at) emit(at, b);
        emit(b, e);
        at = e;
      });
      if (at < text.size()) emit(at, text.size());
      return;
    }
    for (const Piece& p : split_pieces(step, text)) emit(p.begin, p.end);
  }

  // Pre-tokenizer step `k` over one word, each piece it makes passed on to step k + 1, and past the
  // last step to BPE: depth first, so no list of the whole text's words is ever built. `first`: the
  // word begins the text (Metaspace's prepend_scheme "first").
  void pre_tokenize(size_t k, std::string_view word, bool first, std::vector<int64_t>& ids) const {
    if (word.empty()) return;
    if (k == pre_tokenizer_.size()) return bpe_cached(word, ids);
    const PreTokenizerStep& step = pre_tokenizer_[k];
    switch (step.kind) {
      case PreTokenizerStep::Split:
      case PreTokenizerStep::Digits:
        for_each_piece(step, word,
                       [&](size_t b, size_t e) { pre_tokenize(k + 1, word.substr(b, e - b), first && b == 0, ids); });
        return;
      case PreTokenizerStep::WhitespaceSplit: {
        for (size_t i = 0; i < word.size();) {
          i += leading_whitespace(word.substr(i));
          size_t j = i;
          while (j < word.size()) {
            const Utf8Char c = decode_utf8(word, j);
            if (is_whitespace(c.cp)) break;
            j += c.len;
          }
          pre_tokenize(k + 1, word.substr(i, j - i), first && i == 0, ids);
          i = j;
        }
        return;
      }
      case PreTokenizerStep::ByteLevel: {
        std::string prefixed;
        if (step.add_prefix_space && word[0] != ' ') word = prefixed.assign(1, ' ').append(word);
        const auto& alphabet = byte_level_alphabet();
        std::string mapped;
        const auto map_bytes = [&](std::string_view piece, bool piece_first) {
          mapped.resize(2 * piece.size());  // each byte maps to one or two UTF-8 bytes
          char* out = mapped.data();
          for (char c : piece) {
            const auto b = static_cast<uint8_t>(c);
            out[0] = alphabet.utf8[b][0];
            out[1] = alphabet.utf8[b][1];
            out += alphabet.utf8_len[b];
          }
          pre_tokenize(k + 1, std::string_view(mapped.data(), static_cast<size_t>(out - mapped.data())), piece_first,
                       ids);
        };
        if (!step.use_regex) return map_bytes(word, first);
        for_each_piece(step, word, [&](size_t b, size_t e) { map_bytes(word.substr(b, e - b), first && b == 0); });
        return;
      }
      case PreTokenizerStep::Metaspace: {
        std::string text = replace_all(word, " ", step.replacement);
        const bool prepend =
            step.prepend == PrependScheme::Always || (step.prepend == PrependScheme::First && first);
        if (prepend && !starts_with(text, step.replacement)) text = step.replacement + text;
        if (!step.split) return pre_tokenize(k + 1, text, first, ids);
        // Each replacement character starts a new word ("▁a▁b" -> "▁a", "▁b": MergedWithNext).
        const std::string_view t = text;
        size_t start = 0;
        for (size_t pos = t.find(step.replacement, 1); pos != std::string_view::npos;
             pos = t.find(step.replacement, pos + 1)) {
          pre_tokenize(k + 1, t.substr(start, pos - start), first && start == 0, ids);
          start = pos;
        }
        pre_tokenize(k + 1, t.substr(start), first && start == 0, ids);
        return;
      }
    }
  }

  static uint64_t pair_key(int64_t a, int64_t b) {
    return (static_cast<uint64_t>(a) << 32) | static_cast<uint64_t>(b);
  }

  // BPE through a cache of recent words, as the tokenizers library keeps one: real text repeats its
  // words, and a hit skips the merges. Bounded; cleared when full. Long words are not cached.
  void bpe_cached(std::string_view word_view, std::vector<int64_t>& ids) const {
    // A word of the vocabulary is its own token when merges are ignored (Llama 3): no cache needed.
    if (ignore_merges_)
      if (const auto id = vocab_.find(word_view)) return ids.push_back(*id);
    const std::string word(word_view);
    constexpr size_t kMaxCachedWordBytes = 64, kMaxCacheEntries = 1 << 16;
    const bool cacheable = word.size() <= kMaxCachedWordBytes;
    if (cacheable) {
      const std::lock_guard lock(cache_mutex_);
      if (const auto it = cache_.find(word); it != cache_.end()) {
        ids.insert(ids.end(), it->second.begin(), it->second.end());
        return;
      }
    }
    const size_t begin = ids.size();
    bpe(word, ids);
    if (cacheable) {
      const std::lock_guard lock(cache_mutex_);
      if (cache_.size() >= kMaxCacheEntries) cache_.clear();
      cache_.emplace(word, std::vector<int64_t>(ids.begin() + static_cast<std::ptrdiff_t>(begin), ids.end()));
    }
  }

  // BPE over one word: start from its characters (unknown ones as <0xNN> bytes or unk), then merge the
  // adjacent pair of lowest rank, leftmost first, until no pair has a merge. A heap keeps this
  // O(n log n) for the long words Metaspace tokenizers produce (they do not split on spaces).
  void bpe(const std::string& word, std::vector<int64_t>& ids) const {

    struct Symbol {
      int64_t id;
      int prev, next;
      bool alive;
    };
    std::vector<Symbol> symbols;
    const auto push = [&](int64_t id) {
      const int n = static_cast<int>(symbols.size());
      symbols.push_back({id, n - 1, n + 1, true});
    };
    std::string ch;
    for (size_t i = 0; i < word.size();) {
      const size_t len = decode_utf8(word, i).len;
      ch.assign(prefix_.empty() || i == 0 ? "" : prefix_).append(word, i, len);
      i += len;
      if (i == word.size()) ch += suffix_;
      if (const auto id = vocab_.find(ch)) {
        push(*id);
        continue;
      }
      if (byte_fallback_) {
        const size_t from = ch.size() - len - (i == word.size() ? suffix_.size() : 0);
        bool all = true;
        for (size_t k = from; k < from + len && all; ++k) all = byte_ids_[static_cast<uint8_t>(ch[k])] >= 0;
        if (all) {
          for (size_t k = from; k < from + len; ++k) push(byte_ids_[static_cast<uint8_t>(ch[k])]);
          continue;
        }
      }
      if (!unk_id_)
        throw Error(fmt::format("tokenizer '{}': '{}' is not in the vocabulary, which has no unk_token",
                                file_, to_valid_utf8(ch)));
      if (!(fuse_unk_ && !symbols.empty() && symbols.back().id == *unk_id_)) push(*unk_id_);
    }
    if (symbols.empty()) return;
    symbols.back().next = -1;

    struct Candidate {
      int64_t rank;
      int left, right;
      int64_t left_id, right_id, merged_id;
      bool operator>(const Candidate& o) const { return rank != o.rank ? rank > o.rank : left > o.left; }
    };
    std::priority_queue<Candidate, std::vector<Candidate>, std::greater<>> heap;
    const auto consider = [&](int left, int right) {
      if (left < 0 || right < 0) return;
      if (const FlatMergeTable::Merge* m = merges_.find(pair_key(symbols[left].id, symbols[right].id)))
        heap.push({m->rank, left, right, symbols[left].id, symbols[right].id, m->merged_id});
    };
    for (int i = 0; i + 1 < static_cast<int>(symbols.size()); ++i) consider(i, i + 1);
    while (!heap.empty()) {
      const Candidate c = heap.top();
      heap.pop();
      Symbol& l = symbols[c.left];
      Symbol& r = symbols[c.right];
      if (!l.alive || !r.alive || l.next != c.right || l.id != c.left_id || r.id != c.right_id)
        continue;  // stale
      l.id = c.merged_id;
      l.next = r.next;
      r.alive = false;
      if (r.next >= 0) symbols[r.next].prev = c.left;
      consider(l.prev, c.left);
      consider(c.left, l.next);
    }
    for (const Symbol& s : symbols)
      if (s.alive) ids.push_back(s.id);
  }

  // ---- decoding steps ------------------------------------------------------------------------------

  const std::string& token_of(int64_t id, const char* what) const {
    if (id < 0 || id >= vocab_size() || (id_to_token_[id].empty()))
      throw ValueError(fmt::format("tokenizer '{}': {}: token id {} is not in the vocabulary (size {})",
                                   file_, what, id, vocab_size()));
    return id_to_token_[id];
  }

  // The bytes of a byte-level token, or nullopt when a character is outside the alphabet (an added
  // token, kept as written).
  static std::optional<std::string> byte_level_bytes(std::string_view token) {
    const auto& alphabet = byte_level_alphabet();
    std::string bytes;
    for (size_t i = 0; i < token.size();) {
      const Utf8Char c = decode_utf8(token, i);
      const auto it = alphabet.char_to_byte.find(c.cp);
      if (!c.valid || it == alphabet.char_to_byte.end()) return std::nullopt;
      bytes += static_cast<char>(it->second);
      i += c.len;
    }
    return bytes;
  }

  static std::string replace_pattern(const std::string& s, const Pattern& pattern, const std::string& with) {
    std::vector<std::pair<size_t, size_t>> matches;
    pattern.find(s, matches);
    if (matches.empty()) return s;
    std::string out;
    size_t at = 0;
    for (const auto& [b, e] : matches) out.append(s, at, b - at).append(with), at = e;
    return out.append(s, at);
  }

  // One decoder of the chain over the token strings, as the tokenizers library's decode_chain.
  static void decode_step(const DecoderStep& step, std::vector<std::string>& tokens) {
    switch (step.kind) {
      case DecoderStep::Replace:
        for (std::string& t : tokens) t = replace_pattern(t, step.pattern, step.text);
        return;
      case DecoderStep::ByteFallback: {
        // Runs of <0xNN> tokens become their bytes when those are valid UTF-8, else one U+FFFD each.
        std::vector<std::string> out;
        std::string run;
        size_t run_tokens = 0;
        const auto flush = [&] {
          if (run_tokens == 0) return;
          if (to_valid_utf8(run) == run) {
            out.push_back(run);
          } else {
            for (size_t k = 0; k < run_tokens; ++k) out.emplace_back("\xEF\xBF\xBD");
          }
          run.clear(), run_tokens = 0;
        };
        for (std::string& t : tokens) {
          if (const auto b = byte_token_value(t)) {
            run += static_cast<char>(*b), ++run_tokens;
            continue;
          }
          flush();
          out.push_back(std::move(t));
        }
        flush();
        tokens = std::move(out);
        return;
      }
      case DecoderStep::Fuse: {
        std::string all;
        for (const std::string& t : tokens) all += t;
        tokens.assign(1, std::move(all));
        return;
      }
      case DecoderStep::ByteLevel: {
        std::string bytes;
        for (const std::string& t : tokens) {
          if (auto b = byte_level_bytes(t))
            bytes += *b;
          else
            bytes += t;
        }
        tokens.assign(1, to_valid_utf8(bytes));
        return;
      }
      case DecoderStep::Metaspace:
        // The first token's markers are the prefix the pre-tokenizer added; they are not text.
        for (size_t i = 0; i < tokens.size(); ++i)
          tokens[i] = replace_all(tokens[i], step.text, i == 0 && step.prepend != PrependScheme::Never ? "" : " ");
        return;
      case DecoderStep::Strip:
        for (std::string& t : tokens) {
          size_t begin = 0, end = t.size();
          for (size_t n = 0; n < step.strip_start && t.compare(begin, step.text.size(), step.text) == 0; ++n)
            begin += step.text.size();
          for (size_t n = 0; n < step.strip_stop && end - begin >= step.text.size() &&
                             t.compare(end - step.text.size(), step.text.size(), step.text) == 0;
               ++n)
            end -= step.text.size();
          t = t.substr(begin, end - begin);
        }
        return;
      case DecoderStep::BpeSuffix:
        for (size_t i = 0; i < tokens.size(); ++i)
          tokens[i] = replace_all(tokens[i], step.text, i + 1 == tokens.size() ? "" : " ");
        return;
    }
  }

  // The raw bytes a token adds to a stream when it follows others: the per-token decoders, with
  // bytes kept as bytes (Utf8Stream joins the characters they split).
  std::string raw_token_bytes(const std::string& token) const {
    std::string s = token;
    for (const DecoderStep& step : decoder_) {
      switch (step.kind) {
        case DecoderStep::Replace:
          s = replace_pattern(s, step.pattern, step.text);
          break;
        case DecoderStep::ByteFallback:
          if (auto b = byte_token_value(s)) s = std::string(1, static_cast<char>(*b));
          break;
        case DecoderStep::ByteLevel:
          if (auto b = byte_level_bytes(s)) s = std::move(*b);
          break;
        case DecoderStep::Metaspace:
          s = replace_all(s, step.text, " ");
          break;
        case DecoderStep::BpeSuffix:
          s = replace_all(s, step.text, " ");
          break;
        case DecoderStep::Fuse:
        case DecoderStep::Strip:
          break;  // act on the whole text's ends
      }
    }
    return s;
  }

  // transformers' clean_up_tokenization: no space before punctuation and English contractions.
  static std::string clean_up_tokenization(std::string text) {
    static const std::pair<std::string_view, std::string_view> kRules[] = {
        {" .", "."},   {" ?", "?"},     {" !", "!"},   {" ,", ","},   {" ' ", "'"},
        {" n't", "n't"}, {" 'm", "'m"}, {" 's", "'s"}, {" 've", "'ve"}, {" 're", "'re"}};
    for (const auto& [from, to] : kRules) text = replace_all(text, from, to);
    return text;
  }

  std::string file_;
  bool clean_up_spaces_;
  // Token -> id: open addressing probed with a string_view (one lookup per word, one per character
  // of a word BPE merges, three per merge at load).
  FlatStringIndex vocab_;
  std::vector<std::string> id_to_token_;
  FlatMergeTable merges_;  // pair_key(left, right) -> rank and result
  std::string prefix_, suffix_;  // continuing_subword_prefix, end_of_word_suffix
  bool ignore_merges_ = false, byte_fallback_ = false, fuse_unk_ = false;
  std::array<int64_t, 256> byte_ids_ = [] {
    std::array<int64_t, 256> a{};
    a.fill(-1);
    return a;
  }();
  std::optional<int64_t> unk_id_;
  std::vector<AddedToken> added_;
  std::unordered_map<std::string, int64_t> added_ids_;
  AddedTokenTrie raw_trie_, normalized_trie_;  // added tokens matched before / after normalizing
  std::unordered_set<int64_t> special_ids_;
  std::vector<NormalizerStep> normalizer_;
  std::vector<PreTokenizerStep> pre_tokenizer_;
  std::vector<DecoderStep> decoder_;
  std::vector<int64_t> prefix_ids_, suffix_ids_;  // what the post-processor adds around the text
  std::optional<int64_t> template_bos_, template_eos_;
  std::optional<int64_t> bos_id_, eos_id_;
  mutable std::mutex cache_mutex_;
  mutable std::unordered_map<std::string, std::vector<int64_t>> cache_;
};

std::unique_ptr<Tokenizer> load(const json& root, const JsonReader& in, const TokenizerConfig& config,
                                std::optional<BpeTables> tables, BpeTablesReader* streamed) {
  if (!root.is_object()) in.fail(fmt::format("the file holds {}, expected a JSON object", root.type_name()));
  try {
    return std::make_unique<HfBpeTokenizer>(root, in, config, std::move(tables), streamed);
  } catch (const json::exception& e) {  // a field of an unexpected type deep inside
    in.fail(fmt::format("malformed: {}", e.what()));
  }
}

}  // namespace

std::unique_ptr<Tokenizer> load_hf_tokenizer(const std::filesystem::path& file, const TokenizerConfig& config) {
  // A vocabulary or added token repeated with another id would silently change which id a piece of
  // text gets: duplicate keys are refused. Sequence steps nest, and are loaded recursively, so the
  // depth limit also bounds that recursion.
  // model.vocab and model.merges (most of the file: Llama 3's 128K tokens and 280K merges) are read
  // into tables as the parser meets them, not built as JSON first.
  const JsonReader in(file.string());
  BpeTablesReader streamed(in);
  json_input::Options options;
  options.streamed = {
      {{"model", "vocab"},
       [&](const std::string* token, json& id) {
         if (!token) in.fail("model.vocab is array, expected an object");
         return streamed.vocab_member(*token, id);
       }},
      {{"model", "merges"},
       [&](const std::string* key, json& merge) {
         if (key) in.fail("model.merges is object, expected a list");
         streamed.merge(merge);
         return true;
       }},
  };
  const json root = json_input::parse_file(file, fmt::format("tokenizer '{}'", file.string()), options);
  return load(root, in, config, std::nullopt, &streamed);
}

std::unique_ptr<Tokenizer> load_hf_tokenizer_json(const json& root, const std::string& name,
                                                  const TokenizerConfig& config, std::optional<BpeTables> tables) {
  return load(root, JsonReader(name), config, std::move(tables), nullptr);
}

}  // namespace kiln::pipelines::detail
