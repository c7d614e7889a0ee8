// Hugging Face tokenizer.json, model type BPE. The text flows: added tokens are cut out of the raw
// text -> each remaining segment is normalized -> pre-tokenized into words -> each word is BPE-merged
// -> the post-processor adds BOS/EOS. Decoding runs each token through the decoder steps.
#include <fmt/format.h>

#include <array>
#include <nlohmann/json.hpp>
#include <queue>
#include <sstream>
#include <unordered_map>
#include <unordered_set>

#include "kiln/errors.h"
#include "pipelines/json_input.h"
#include "pipelines/tokenizer_formats.h"
#include "pipelines/tokenizer_unicode.h"

namespace kiln::pipelines::detail {

using nlohmann::json;

// ==== Splitting regexes, matched by hand ============================================================

namespace {

// The text as code points, with the byte offset of each (offsets has one extra entry: the end).
struct CodePoints {
  std::vector<char32_t> cp;
  std::vector<size_t> offset;

  explicit CodePoints(std::string_view text) {
    for (size_t i = 0; i < text.size();) {
      const Utf8Char c = decode_utf8(text, i);
      cp.push_back(c.cp);
      offset.push_back(i);
      i += c.len;
    }
    offset.push_back(text.size());
  }
  size_t size() const { return cp.size(); }
};

bool is_other(char32_t c) { return !is_whitespace(c) && !is_letter(c) && !is_number(c); }
bool is_newline(char32_t c) { return c == '\r' || c == '\n'; }
char32_t ascii_lower(char32_t c) { return c >= 'A' && c <= 'Z' ? c + 32 : c; }

template <class Pred>
size_t run_length(const CodePoints& t, size_t i, Pred pred) {
  size_t j = i;
  while (j < t.size() && pred(t.cp[j])) ++j;
  return j - i;
}

// 's|'t|'re|'ve|'m|'ll|'d, optionally case-insensitive; the match length or 0.
size_t contraction_at(const CodePoints& t, size_t i, bool ignore_case) {
  if (t.cp[i] != '\'' || i + 1 >= t.size()) return 0;
  const auto at = [&](size_t k) { return ignore_case ? ascii_lower(t.cp[k]) : t.cp[k]; };
  const char32_t a = at(i + 1);
  if (a == 's' || a == 't' || a == 'm' || a == 'd') return 2;
  if (i + 2 >= t.size()) return 0;
  const char32_t b = at(i + 2);
  if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) return 3;
  return 0;
}

// \s+(?!\S)|\s+ at a whitespace character: a run followed by a non-space leaves its last character
// to start the next piece (so " word" stays together), unless the run is that one character.
size_t trailing_whitespace_at(const CodePoints& t, size_t i) {
  const size_t run = run_length(t, i, is_whitespace);
  if (i + run == t.size() || run == 1) return run;
  return run - 1;
}

size_t gpt2_match(const CodePoints& t, size_t i) {
  if (size_t n = contraction_at(t, i, false)) return n;
  const bool space_first = t.cp[i] == ' ' && i + 1 < t.size();
  for (auto cls : {is_letter, is_number, is_other}) {  // ` ?\p{L}+`, ` ?\p{N}+`, ` ?[^\s\p{L}\p{N}]+`
    if (cls(t.cp[i])) return run_length(t, i, cls);
    if (space_first && cls(t.cp[i + 1])) return 1 + run_length(t, i + 1, cls);
  }
  return trailing_whitespace_at(t, i);
}

size_t llama3_match(const CodePoints& t, size_t i, size_t max_digits) {
  if (size_t n = contraction_at(t, i, true)) return n;
  const char32_t c = t.cp[i];
  // [^\r\n\p{L}\p{N}]?\p{L}+
  if (is_letter(c)) return run_length(t, i, is_letter);
  if (!is_newline(c) && !is_number(c) && i + 1 < t.size() && is_letter(t.cp[i + 1]))
    return 1 + run_length(t, i + 1, is_letter);
  // \p{N}{1,max_digits}
  if (is_number(c)) return std::min(run_length(t, i, is_number), max_digits);
  // ` ?[^\s\p{L}\p{N}]+[\r\n]*`
  size_t j = i;
  if (c == ' ' && i + 1 < t.size() && is_other(t.cp[i + 1])) ++j;
  if (is_other(t.cp[j])) {
    j += run_length(t, j, is_other);
    return j + run_length(t, j, is_newline) - i;
  }
  // \s*[\r\n]+ : the whitespace run up to and including its last newline
  const size_t run = run_length(t, i, is_whitespace);
  for (size_t k = run; k > 0; --k)
    if (is_newline(t.cp[i + k - 1])) return k;
  return trailing_whitespace_at(t, i);
}

}  // namespace

std::vector<std::string_view> split_by_pattern(std::string_view text, SplitPattern pattern) {
  const CodePoints t(text);
  std::vector<std::string_view> pieces;
  for (size_t i = 0; i < t.size();) {
    size_t n = pattern == SplitPattern::Gpt2     ? gpt2_match(t, i)
               : pattern == SplitPattern::Llama3 ? llama3_match(t, i, 3)
                                                 : llama3_match(t, i, 1);
    pieces.push_back(text.substr(t.offset[i], t.offset[i + n] - t.offset[i]));
    i += n;
  }
  return pieces;
}

// ==== The tokenizer ==================================================================================

namespace {

constexpr std::string_view kMetaspace = "\xE2\x96\x81";  // '▁'
constexpr int64_t kMaxTokenId = int64_t{1} << 24;        // far above any real vocabulary; bounds the id table

// GPT-2's byte-level alphabet: every byte maps to a printable character, so BPE never sees spaces or
// control bytes. Printable Latin-1 bytes map to themselves, the rest to U+0100 upwards, in order.
struct ByteLevelAlphabet {
  std::array<std::string, 256> byte_to_char;
  std::unordered_map<char32_t, uint8_t> char_to_byte;

  ByteLevelAlphabet() {
    char32_t next = 256;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      const char32_t c = printable ? static_cast<char32_t>(b) : next++;
      append_utf8(byte_to_char[b], c);
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
  for (size_t i = 0; i < s.size();) {
    if (s.compare(i, from.size(), from) == 0) {
      out += to;
      i += from.size();
    } else {
      out += s[i++];
    }
  }
  return out;
}

bool starts_with(std::string_view s, std::string_view prefix) { return s.substr(0, prefix.size()) == prefix; }

// "<0x41>" -> 0x41.
std::optional<uint8_t> byte_token_value(std::string_view token) {
  if (token.size() != 6 || !starts_with(token, "<0x") || token[5] != '>') return std::nullopt;
  int value = 0;
  for (char c : token.substr(3, 2)) {
    const int digit = c >= '0' && c <= '9' ? c - '0' : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
    if (digit < 0) return std::nullopt;
    value = value * 16 + digit;
  }
  return static_cast<uint8_t>(value);
}

enum class PrependScheme { Always, First, Never };

struct NormalizerStep {
  enum Kind { Prepend, Replace } kind;
  std::string text, replacement;  // Prepend: text; Replace: text -> replacement
};

struct PreTokenizerStep {
  enum Kind { Split, Digits, ByteLevel, Metaspace } kind;
  SplitPattern pattern = SplitPattern::Gpt2;  // Split, and ByteLevel with use_regex
  bool individual_digits = false;             // Digits
  bool add_prefix_space = false;              // ByteLevel
  bool use_regex = true;                      // ByteLevel
  std::string replacement;                    // Metaspace
  PrependScheme prepend = PrependScheme::Always;
  bool split = true;
};

struct DecoderStep {
  enum Kind { Replace, ByteFallback, ByteLevel, Metaspace, Strip } kind;
  std::string from, to;                           // Replace; Metaspace: from = replacement
  PrependScheme prepend = PrependScheme::Always;  // Metaspace
  size_t strip_start = 0, strip_stop = 0;         // Strip: characters `from` to cut off the ends
};

struct AddedToken {
  std::string content;
  int64_t id;
  bool special, lstrip, rstrip, single_word;
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
    try {
      return obj.at(name).get<T>();
    } catch (const json::exception&) {
      fail(fmt::format("'{}' is {}, of the wrong type", name, obj.at(name).type_name()));
    }
  }
  int64_t token_id(const json& v, const std::string& what) const {
    if (!v.is_number_integer())
      fail(fmt::format("{} has id {}, expected an integer", what, json_input::describe(v)));
    const int64_t id = v.get<int64_t>();
    if (id < 0 || id >= kMaxTokenId)
      fail(fmt::format("{} has id {}, outside [0, {})", what, id, kMaxTokenId));
    return id;
  }
  const std::string& file() const { return file_; }

 private:
  std::string file_;
};

class HfBpeTokenizer final : public Tokenizer {
 public:
  HfBpeTokenizer(const json& root, const JsonReader& in) : file_(in.file()) {
    const json& model = in.field(root, "model", "the file");
    const std::string type = in.optional<std::string>(model, "type", "BPE");
    if (type != "BPE")
      in.fail(fmt::format("model type '{}' is not supported (kiln reads BPE tokenizers only)", type));
    load_model(model, in);
    if (root.contains("added_tokens")) load_added_tokens(root.at("added_tokens"), in);
    load_normalizer(root.value("normalizer", json()), in);
    load_pre_tokenizer(root.value("pre_tokenizer", json()), in);
    load_post_processor(root.value("post_processor", json()), in);
    load_decoder(root.value("decoder", json()), in);
    find_bos_eos();
  }

  // ---- encode --------------------------------------------------------------------------------------

  std::vector<int64_t> encode(std::string_view text, bool add_special_tokens) const override {
    std::vector<int64_t> ids;
    if (add_special_tokens) ids = prefix_ids_;
    size_t segment_start = 0;
    for (size_t i = 0; i < text.size();) {
      const auto match = added_token_at(text, i, segment_start);
      if (!match) {
        ++i;
        continue;
      }
      encode_segment(text.substr(segment_start, match->start - segment_start), segment_start == 0, ids);
      ids.push_back(match->token->id);
      i = segment_start = match->end;
    }
    encode_segment(text.substr(segment_start), segment_start == 0, ids);
    if (add_special_tokens) ids.insert(ids.end(), suffix_ids_.begin(), suffix_ids_.end());
    return ids;
  }

  // ---- decode --------------------------------------------------------------------------------------

  std::string decode(const std::vector<int64_t>& ids, bool skip_special_tokens) const override {
    std::string bytes;
    bool first = true;
    for (int64_t id : ids) {
      const std::string& token = token_of(id, "decode");
      if (skip_special_tokens && is_special(id)) continue;
      bytes += decode_token(token, first);
      first = false;
    }
    std::string text = to_valid_utf8(bytes);
    for (const DecoderStep& step : decoder_)
      if (step.kind == DecoderStep::Strip) text = strip(text, step);
    return text;
  }

  std::string token_bytes(int64_t id) const override {
    const std::string& token = token_of(id, "token_bytes");
    if (is_special(id)) return "";
    return decode_token(token, false);
  }

  int64_t vocab_size() const override { return static_cast<int64_t>(id_to_token_.size()); }
  std::optional<int64_t> bos_id() const override { return bos_id_; }
  std::optional<int64_t> eos_id() const override { return eos_id_; }
  std::optional<int64_t> token_to_id(std::string_view token) const override {
    for (const AddedToken& t : added_)
      if (t.content == token) return t.id;
    const auto it = vocab_.find(std::string(token));
    if (it == vocab_.end()) return std::nullopt;
    return it->second;
  }
  bool is_special(int64_t id) const override { return special_ids_.count(id) != 0; }

 private:
  // ---- loading -------------------------------------------------------------------------------------

  void set_token(int64_t id, const std::string& token) {
    if (id >= static_cast<int64_t>(id_to_token_.size())) id_to_token_.resize(id + 1);
    id_to_token_[id] = token;
  }

  void load_model(const json& model, const JsonReader& in) {
    const std::string prefix = in.optional<std::string>(model, "continuing_subword_prefix", "");
    const std::string suffix = in.optional<std::string>(model, "end_of_word_suffix", "");
    if (!prefix.empty() || !suffix.empty())
      in.fail("BPE continuing_subword_prefix / end_of_word_suffix are not supported");
    const json& vocab = in.field(model, "vocab", "model");
    if (!vocab.is_object()) in.fail(fmt::format("model.vocab is {}, expected an object", vocab.type_name()));
    for (const auto& [token, id] : vocab.items()) {
      const int64_t i = in.token_id(id, fmt::format("vocab token '{}'", token));
      vocab_[token] = i;
      set_token(i, token);
    }
    ignore_merges_ = in.optional<bool>(model, "ignore_merges", false);
    byte_fallback_ = in.optional<bool>(model, "byte_fallback", false);
    fuse_unk_ = in.optional<bool>(model, "fuse_unk", false);
    if (const std::string unk = in.optional<std::string>(model, "unk_token", ""); !unk.empty()) {
      const auto it = vocab_.find(unk);
      if (it == vocab_.end()) in.fail(fmt::format("unk_token '{}' is not in the vocabulary", unk));
      unk_id_ = it->second;
    }

    const json& merges = in.field(model, "merges", "model");
    if (!merges.is_array()) in.fail(fmt::format("model.merges is {}, expected a list", merges.type_name()));
    for (size_t rank = 0; rank < merges.size(); ++rank) {
      const json& m = merges[rank];
      std::string a, b;
      if (m.is_string()) {  // "a b"
        const std::string s = m.get<std::string>();
        const size_t space = s.find(' ');
        if (space == std::string::npos || s.find(' ', space + 1) != std::string::npos)
          in.fail(fmt::format("merge {} '{}' is not two tokens separated by one space", rank, s));
        a = s.substr(0, space), b = s.substr(space + 1);
      } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {  // ["a", "b"]
        a = m[0].get<std::string>(), b = m[1].get<std::string>();
      } else {
        in.fail(
            fmt::format("merge {} is {}, expected \"a b\" or [\"a\", \"b\"]", rank, json_input::describe(m)));
      }
      const auto ia = vocab_.find(a), ib = vocab_.find(b), iab = vocab_.find(a + b);
      if (ia == vocab_.end() || ib == vocab_.end() || iab == vocab_.end())
        in.fail(fmt::format("merge {} ('{}' '{}'): '{}' is not in the vocabulary", rank, a, b,
                            ia == vocab_.end()   ? a
                            : ib == vocab_.end() ? b
                                                 : a + b));
      merges_.emplace(pair_key(ia->second, ib->second), Merge{static_cast<int64_t>(rank), iab->second});
    }
  }

  void load_added_tokens(const json& list, const JsonReader& in) {
    if (!list.is_array()) in.fail(fmt::format("added_tokens is {}, expected a list", list.type_name()));
    for (const json& t : list) {
      AddedToken token{in.string(t, "content", "an added token"), 0, false, false, false, false};
      token.id =
          in.token_id(in.field(t, "id", "an added token"), fmt::format("added token '{}'", token.content));
      if (token.content.empty()) in.fail(fmt::format("added token {} has empty content", token.id));
      token.special = in.optional<bool>(t, "special", false);
      token.lstrip = in.optional<bool>(t, "lstrip", false);
      token.rstrip = in.optional<bool>(t, "rstrip", false);
      token.single_word = in.optional<bool>(t, "single_word", false);
      set_token(token.id, token.content);
      if (token.special) special_ids_.insert(token.id);
      added_.push_back(std::move(token));
    }
  }

  void load_normalizer(const json& n, const JsonReader& in) {
    if (n.is_null()) return;
    const std::string type = in.string(n, "type", "the normalizer");
    if (type == "Sequence") {
      for (const json& step : in.field(n, "normalizers", "the Sequence normalizer"))
        load_normalizer(step, in);
    } else if (type == "Prepend") {
      normalizer_.push_back({NormalizerStep::Prepend, in.string(n, "prepend", "the Prepend normalizer"), ""});
    } else if (type == "Replace") {
      normalizer_.push_back({NormalizerStep::Replace, string_pattern(n, in, "the Replace normalizer"),
                             in.string(n, "content", "the Replace normalizer")});
    } else if (type == "NFC") {
      // Passed through: text is taken to be NFC already (see docs/tokenizers.md).
    } else {
      in.fail(fmt::format("normalizer '{}' is not supported", type));
    }
  }

  static std::string string_pattern(const json& step, const JsonReader& in, const char* where) {
    const json& pattern = in.field(step, "pattern", where);
    if (!pattern.contains("String"))
      in.fail(fmt::format("{}: pattern {} is not supported (only {{\"String\": ...}})", where,
                          json_input::describe(pattern)));
    return in.string(pattern, "String", where);
  }

  void load_pre_tokenizer(const json& p, const JsonReader& in) {
    if (p.is_null()) return;
    const std::string type = in.string(p, "type", "the pre_tokenizer");
    PreTokenizerStep step{};
    if (type == "Sequence") {
      for (const json& s : in.field(p, "pretokenizers", "the Sequence pre_tokenizer"))
        load_pre_tokenizer(s, in);
      return;
    } else if (type == "ByteLevel") {
      step.kind = PreTokenizerStep::ByteLevel;
      step.add_prefix_space = in.optional<bool>(p, "add_prefix_space", true);
      step.use_regex = in.optional<bool>(p, "use_regex", true);
    } else if (type == "Split") {
      step.kind = PreTokenizerStep::Split;
      const json& pattern = in.field(p, "pattern", "the Split pre_tokenizer");
      const std::string regex = in.optional<std::string>(pattern, "Regex", "");
      step.pattern = known_pattern(regex, pattern, in);
      const std::string behavior = in.optional<std::string>(p, "behavior", "Isolated");
      if (behavior != "Isolated" || in.optional<bool>(p, "invert", false))
        in.fail(fmt::format("Split pre_tokenizer behavior '{}' (invert {}) is not supported (only Isolated)",
                            behavior, in.optional<bool>(p, "invert", false)));
    } else if (type == "Digits") {
      step.kind = PreTokenizerStep::Digits;
      step.individual_digits = in.optional<bool>(p, "individual_digits", false);
    } else if (type == "Metaspace") {
      step.kind = PreTokenizerStep::Metaspace;
      step.replacement = in.optional<std::string>(p, "replacement", std::string(kMetaspace));
      step.prepend = prepend_scheme(p, in);
      step.split = in.optional<bool>(p, "split", true);
    } else {
      in.fail(fmt::format("pre_tokenizer '{}' is not supported", type));
    }
    pre_tokenizer_.push_back(step);
  }

  static SplitPattern known_pattern(const std::string& regex, const json& pattern, const JsonReader& in) {
    static const std::pair<std::string_view, SplitPattern> known[] = {
        {R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)", SplitPattern::Gpt2},
        {R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)",
         SplitPattern::Llama3},
        {R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)",
         SplitPattern::Qwen2},
    };
    for (const auto& [text, kind] : known)
      if (regex == text) return kind;
    in.fail(fmt::format("Split pre_tokenizer pattern {} is not one kiln knows (GPT-2, Llama 3, Qwen2)",
                        json_input::describe(pattern)));
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

  void load_post_processor(const json& p, const JsonReader& in) {
    if (p.is_null()) return;
    const std::string type = in.string(p, "type", "the post_processor");
    if (type == "Sequence") {
      for (const json& s : in.field(p, "processors", "the Sequence post_processor"))
        load_post_processor(s, in);
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
        const json& entry = in.field(specials, name.c_str(), "TemplateProcessing.special_tokens");
        for (const json& id : in.field(entry, "ids", "a template special token"))
          (seen_sequence ? suffix_ids_ : prefix_ids_)
              .push_back(in.token_id(id, "template token '" + name + "'"));
      }
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
      return;  // tokens are always concatenated
    } else if (type == "ByteLevel") {
      step.kind = DecoderStep::ByteLevel;
    } else if (type == "ByteFallback") {
      step.kind = DecoderStep::ByteFallback;
    } else if (type == "Replace") {
      step.kind = DecoderStep::Replace;
      step.from = string_pattern(d, in, "the Replace decoder");
      step.to = in.string(d, "content", "the Replace decoder");
    } else if (type == "Metaspace") {
      step.kind = DecoderStep::Metaspace;
      step.from = in.optional<std::string>(d, "replacement", std::string(kMetaspace));
      step.prepend = prepend_scheme(d, in);
    } else if (type == "Strip") {
      step.kind = DecoderStep::Strip;
      step.from = in.string(d, "content", "the Strip decoder");
      step.strip_start = in.optional<size_t>(d, "start", 0);
      step.strip_stop = in.optional<size_t>(d, "stop", 0);
    } else {
      in.fail(fmt::format("decoder '{}' is not supported", type));
    }
    decoder_.push_back(step);
  }

  // BOS/EOS from the template when it adds them, else from the usual spellings.
  void find_bos_eos() {
    const auto first_known = [&](std::initializer_list<std::string_view> names) -> std::optional<int64_t> {
      for (std::string_view n : names)
        if (auto id = token_to_id(n)) return id;
      return std::nullopt;
    };
    bos_id_ = !prefix_ids_.empty()
                  ? std::optional(prefix_ids_.front())
                  : first_known({"<s>", "<|begin_of_text|>", "<bos>", "<|startoftext|>", "<|endoftext|>"});
    eos_id_ = !suffix_ids_.empty()
                  ? std::optional(suffix_ids_.back())
                  : first_known({"</s>", "<|end_of_text|>", "<eos>", "<|endoftext|>", "<|im_end|>"});
  }

  // ---- encoding steps ------------------------------------------------------------------------------

  struct AddedMatch {
    const AddedToken* token;
    size_t start, end;  // the bytes it replaces, with any lstrip/rstrip whitespace
  };

  // The longest added token spelled at text[i], if its single_word rule allows it there.
  std::optional<AddedMatch> added_token_at(std::string_view text, size_t i, size_t segment_start) const {
    const AddedToken* best = nullptr;
    for (const AddedToken& t : added_)
      if (text.compare(i, t.content.size(), t.content) == 0 &&
          (!best || t.content.size() > best->content.size()) &&
          (!t.single_word || is_word_boundary(text, i, i + t.content.size())))
        best = &t;
    if (!best) return std::nullopt;
    AddedMatch m{best, i, i + best->content.size()};
    if (best->lstrip)
      while (m.start > segment_start && is_ascii_space(text[m.start - 1])) --m.start;
    if (best->rstrip)
      while (m.end < text.size() && is_ascii_space(text[m.end])) ++m.end;
    return m;
  }

  static bool is_ascii_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

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

  void encode_segment(std::string_view segment, bool at_text_start, std::vector<int64_t>& ids) const {
    if (segment.empty()) return;
    std::string normalized(segment);
    for (const NormalizerStep& n : normalizer_)
      normalized = n.kind == NormalizerStep::Prepend ? n.text + normalized
                                                     : replace_all(normalized, n.text, n.replacement);
    std::vector<std::string> words{std::move(normalized)};
    for (const PreTokenizerStep& step : pre_tokenizer_) {
      std::vector<std::string> next;
      for (size_t w = 0; w < words.size(); ++w) pre_tokenize(step, words[w], at_text_start && w == 0, next);
      words = std::move(next);
    }
    for (const std::string& w : words) bpe(w, ids);
  }

  static void pre_tokenize(const PreTokenizerStep& step, const std::string& word, bool first,
                           std::vector<std::string>& out) {
    switch (step.kind) {
      case PreTokenizerStep::Split:
        for (std::string_view piece : split_by_pattern(word, step.pattern)) out.emplace_back(piece);
        return;
      case PreTokenizerStep::Digits: {
        const CodePoints t(word);
        for (size_t i = 0; i < t.size();) {
          size_t n = is_number(t.cp[i]) ? (step.individual_digits ? 1 : run_length(t, i, is_number))
                                        : run_length(t, i, [](char32_t c) { return !is_number(c); });
          out.push_back(word.substr(t.offset[i], t.offset[i + n] - t.offset[i]));
          i += n;
        }
        return;
      }
      case PreTokenizerStep::ByteLevel: {
        const std::string text = step.add_prefix_space && !starts_with(word, " ") ? " " + word : word;
        const auto& alphabet = byte_level_alphabet();
        const auto map_bytes = [&](std::string_view piece) {
          std::string mapped;
          for (char c : piece) mapped += alphabet.byte_to_char[static_cast<uint8_t>(c)];
          out.push_back(std::move(mapped));
        };
        if (!step.use_regex) return map_bytes(text);
        for (std::string_view piece : split_by_pattern(text, SplitPattern::Gpt2)) map_bytes(piece);
        return;
      }
      case PreTokenizerStep::Metaspace: {
        std::string text = replace_all(word, " ", step.replacement);
        const bool prepend =
            step.prepend == PrependScheme::Always || (step.prepend == PrependScheme::First && first);
        if (prepend && !starts_with(text, step.replacement)) text = step.replacement + text;
        if (!step.split) return out.push_back(std::move(text));
        // Each replacement character starts a new word ("▁a▁b" -> "▁a", "▁b").
        size_t start = 0;
        for (size_t pos = text.find(step.replacement, 1); pos != std::string::npos;
             pos = text.find(step.replacement, pos + 1)) {
          out.push_back(text.substr(start, pos - start));
          start = pos;
        }
        out.push_back(text.substr(start));
        return;
      }
    }
  }

  static uint64_t pair_key(int64_t a, int64_t b) {
    return (static_cast<uint64_t>(a) << 32) | static_cast<uint64_t>(b);
  }

  // BPE over one word: start from its characters (unknown ones as <0xNN> bytes or unk), then merge the
  // adjacent pair of lowest rank, leftmost first, until no pair has a merge. A heap keeps this
  // O(n log n) for the long words Metaspace tokenizers produce (they do not split on spaces).
  void bpe(const std::string& word, std::vector<int64_t>& ids) const {
    if (word.empty()) return;
    if (ignore_merges_)
      if (const auto it = vocab_.find(word); it != vocab_.end()) return ids.push_back(it->second);

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
    for (size_t i = 0; i < word.size();) {
      const size_t len = decode_utf8(word, i).len;
      const std::string ch = word.substr(i, len);
      i += len;
      if (const auto it = vocab_.find(ch); it != vocab_.end()) {
        push(it->second);
        continue;
      }
      if (byte_fallback_) {
        std::vector<int64_t> bytes;
        for (char c : ch) {
          const auto it = vocab_.find(fmt::format("<0x{:02X}>", static_cast<uint8_t>(c)));
          if (it == vocab_.end()) break;
          bytes.push_back(it->second);
        }
        if (bytes.size() == ch.size()) {
          for (int64_t b : bytes) push(b);
          continue;
        }
      }
      if (!unk_id_)
        throw Error(fmt::format("tokenizer '{}': '{}' is not in the vocabulary, which has no unk_token",
                                file_, to_valid_utf8(ch)));
      if (!(fuse_unk_ && !symbols.empty() && symbols.back().id == *unk_id_)) push(*unk_id_);
    }
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
      const auto it = merges_.find(pair_key(symbols[left].id, symbols[right].id));
      if (it != merges_.end())
        heap.push({it->second.rank, left, right, symbols[left].id, symbols[right].id, it->second.merged_id});
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

  // The bytes one token decodes to; `first` is the first token of a decode() call.
  std::string decode_token(const std::string& token, bool first) const {
    std::string s = token;
    for (const DecoderStep& step : decoder_) {
      switch (step.kind) {
        case DecoderStep::Replace:
          s = replace_all(s, step.from, step.to);
          break;
        case DecoderStep::ByteFallback:
          if (auto b = byte_token_value(s)) s = std::string(1, static_cast<char>(*b));
          break;
        case DecoderStep::ByteLevel: {
          // A token with a character outside the alphabet (an added token) is kept as written.
          const auto& alphabet = byte_level_alphabet();
          std::string bytes;
          bool all_mapped = true;
          for (size_t i = 0; i < s.size() && all_mapped;) {
            const Utf8Char c = decode_utf8(s, i);
            const auto it = alphabet.char_to_byte.find(c.cp);
            all_mapped = c.valid && it != alphabet.char_to_byte.end();
            if (all_mapped) bytes += static_cast<char>(it->second);
            i += c.len;
          }
          if (all_mapped) s = std::move(bytes);
          break;
        }
        case DecoderStep::Metaspace:
          // The first token's marker is the prefix the pre-tokenizer added; it is not text.
          s = replace_all(s, step.from, first && step.prepend != PrependScheme::Never ? "" : " ");
          break;
        case DecoderStep::Strip:
          break;  // applies to the whole text, in decode()
      }
    }
    return s;
  }

  static std::string strip(const std::string& text, const DecoderStep& step) {
    size_t begin = 0, end = text.size();
    for (size_t n = 0; n < step.strip_start && text.compare(begin, step.from.size(), step.from) == 0; ++n)
      begin += step.from.size();
    for (size_t n = 0; n < step.strip_stop && end - begin >= step.from.size() &&
                       text.compare(end - step.from.size(), step.from.size(), step.from) == 0;
         ++n)
      end -= step.from.size();
    return text.substr(begin, end - begin);
  }

  struct Merge {
    int64_t rank;
    int64_t merged_id;
  };

  std::string file_;
  std::unordered_map<std::string, int64_t> vocab_;
  std::vector<std::string> id_to_token_;
  std::unordered_map<uint64_t, Merge> merges_;  // pair_key(left, right) -> rank and result
  bool ignore_merges_ = false, byte_fallback_ = false, fuse_unk_ = false;
  std::optional<int64_t> unk_id_;
  std::vector<AddedToken> added_;
  std::unordered_set<int64_t> special_ids_;
  std::vector<NormalizerStep> normalizer_;
  std::vector<PreTokenizerStep> pre_tokenizer_;
  std::vector<DecoderStep> decoder_;
  std::vector<int64_t> prefix_ids_, suffix_ids_;  // what the post-processor adds around the text
  std::optional<int64_t> bos_id_, eos_id_;
};

}  // namespace

std::unique_ptr<Tokenizer> load_hf_tokenizer(const std::filesystem::path& file) {
  const JsonReader in(file.string());
  // A vocabulary or added token repeated with another id would silently change which id a piece of
  // text gets: duplicate keys are refused. Sequence steps nest, and are loaded recursively, so the
  // depth limit also bounds that recursion.
  const json root = json_input::parse_file(file, fmt::format("tokenizer '{}'", file.string()));
  if (!root.is_object()) in.fail(fmt::format("the file holds {}, expected a JSON object", root.type_name()));
  try {
    return std::make_unique<HfBpeTokenizer>(root, in);
  } catch (const json::exception& e) {  // a field of an unexpected type deep inside
    in.fail(fmt::format("malformed: {}", e.what()));
  }
}

}  // namespace kiln::pipelines::detail
