// Tokenizers: hand-made tokenizer.json files whose ids are derived by hand in the comments, the
// splitting regexes against hand-split strings, a tiny SentencePiece model, and malformed files.
#include <gtest/gtest.h>

#include "test_util.h"
#include <sentencepiece_processor.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "kiln/errors.h"
#include "kiln/pipelines/tokenizer.h"
#include "pipelines/regex.h"
#include "pipelines/tokenizer_formats.h"

using namespace kiln;
using pipelines::Tokenizer;
using pipelines::Utf8Stream;
using Ids = std::vector<int64_t>;
namespace fs = std::filesystem;

using kiln::testing::error_message;

namespace {

fs::path data_dir() { return fs::path(__FILE__).parent_path().parent_path() / "data" / "tokenizers"; }

nlohmann::json read_json(const fs::path& file) {
  std::ifstream in(file);
  return nlohmann::json::parse(in);
}

// Writes `text` to a fresh file in the test's temp dir and returns its path.
fs::path write_temp(const std::string& name, const std::string& text) {
  const fs::path dir = fs::path(::testing::TempDir()) / "kiln_tokenizer_tests";
  fs::create_directories(dir);
  const fs::path file = dir / name;
  std::ofstream(file, std::ios::binary) << text;
  return file;
}

// Loads a fixture after `edit` changes its JSON.
template <class Edit>
std::unique_ptr<Tokenizer> load_edited(const std::string& fixture, const std::string& name, Edit edit) {
  nlohmann::json doc = read_json(data_dir() / fixture);
  edit(doc);
  return Tokenizer::load(write_temp(name, doc.dump()));
}

// Streams token_bytes through Utf8Stream, as a text generation loop does.
std::string stream(const Tokenizer& tok, const Ids& ids) {
  Utf8Stream s;
  std::string out;
  for (int64_t id : ids) out += s.push(tok.token_bytes(id));
  return out + s.flush();
}

const std::vector<std::string> kRoundTripTexts = {
    "hello world",
    "Hello, World! It's 2024.",
    "  two leading spaces and a trailing one ",
    "tabs\tand\nnew\r\nlines\n\n",
    "caf\xC3\xA9 na\xC3\xAFve",                               // café naïve
    "\xE6\x97\xA5\xE6\x9C\xAC\xE8\xAA\x9E \xF0\x9F\x99\x82",  // 日本語 🙂
    "\xCE\xB1\xCE\xB2\xCE\xB3 \xD0\xB4\xD0\xB0",              // αβγ да
    "x",
};

}  // namespace

// ==== The splitting regexes ============================================================================

using Pieces = std::vector<std::string_view>;

// The regexes of real tokenizer.json files, run by kiln's regex engine (PCRE2, as the tokenizers
// library's Oniguruma reads them).
constexpr std::string_view kGpt2 = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
constexpr std::string_view kLlama3 =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
constexpr std::string_view kQwen2 =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

// The text's pieces: the matches, and whatever lies between them.
Pieces split_by_pattern(std::string_view text, std::string_view pattern) {
  std::vector<std::pair<size_t, size_t>> matches;
  pipelines::detail::Regex(pattern).find_all(text, matches);
  Pieces pieces;
  size_t at = 0;
  for (const auto& [b, e] : matches) {
    if (b > at) pieces.push_back(text.substr(at, b - at));
    pieces.push_back(text.substr(b, e - b));
    at = e;
  }
  if (at < text.size()) pieces.push_back(text.substr(at));
  return pieces;
}

TEST(TokenizerSplit, Gpt2PatternSplitsContractionsWordsNumbersAndSpaces) {
  // "I" letters; "'m" contraction; two spaces before "here": \s+(?!\S) takes one, " here" takes the
  // other; "!!" punctuation; "\n\n " before "42": the run minus its last space, then " 42"; "abc".
  EXPECT_EQ(split_by_pattern("I'm  here!!\n\n 42abc", kGpt2),
            (Pieces{"I", "'m", " ", " here", "!!", "\n\n", " 42", "abc"}));
  // Case matters for GPT-2 contractions; "'S" is punctuation then letters. "(" is not glued to "x".
  EXPECT_EQ(split_by_pattern("IT'S (x) ", kGpt2), (Pieces{"IT", "'", "S", " (", "x", ")", " "}));
}

TEST(TokenizerSplit, Llama3PatternGroupsDigitsByThreeAndKeepsNewlineRuns) {
  // "'S" is a contraction here (case-insensitive); "12345" -> "123" "45"; "\n\n  x": \s*[\r\n]+ takes
  // the run up to its last newline, then " " and " x".
  EXPECT_EQ(split_by_pattern("I'm  HERE'S 12345\n\n  x", kLlama3),
            (Pieces{"I", "'m", " ", " HERE", "'S", " ", "123", "45", "\n\n", " ", " x"}));
  // One non-letter glues to the letters after it; punctuation keeps its trailing newlines.
  EXPECT_EQ(split_by_pattern("(abc !!\n\nd", kLlama3), (Pieces{"(abc", " !!\n\n", "d"}));
  EXPECT_EQ(split_by_pattern("12345", kQwen2), (Pieces{"1", "2", "3", "4", "5"}));
}

TEST(TokenizerSplit, NonAsciiLettersAndNumbersAreClassified) {
  // é, Greek, Cyrillic and CJK are letters; '٣' (Arabic-Indic three) and '²' are numbers; the emoji
  // is neither, so it splits from the letters around it.
  EXPECT_EQ(split_by_pattern("caf\xC3\xA9 \xCE\xB1\xCE\xB2 \xD0\xB4\xD0\xB0 \xE6\x97\xA5\xE6\x9C\xAC",
                             kGpt2),
            (Pieces{"caf\xC3\xA9", " \xCE\xB1\xCE\xB2", " \xD0\xB4\xD0\xB0", " \xE6\x97\xA5\xE6\x9C\xAC"}));
  EXPECT_EQ(split_by_pattern("a\xD9\xA3\xC2\xB2\xF0\x9F\x99\x82"
                             "b",
                             kGpt2),
            (Pieces{"a", "\xD9\xA3\xC2\xB2", "\xF0\x9F\x99\x82", "b"}));
  // U+3000 (ideographic space) is whitespace.
  EXPECT_EQ(split_by_pattern("a\xE3\x80\x80"
                             "b",
                             kGpt2),
            (Pieces{"a", "\xE3\x80\x80", "b"}));
}

// ==== Byte-level BPE (GPT-2 style) =====================================================================
// byte_level_bpe.json: ids 0..255 are the byte-level characters of bytes 0..255 (id == byte value),
// then 13 merges in rank order: 256 "Ġt", 257 "he", 258 "Ġthe", 259 "ll", 260 "hell", 261 "hello",
// 262 "Ġw", 263 "or", 264 "Ġwor", 265 "Ġworl", 266 "Ġworld", 267 "Ã©" (é as bytes C3 A9), 268 "er";
// added tokens 269 <|endoftext|> (special), 270 <|startoftext|> (special, the template's BOS),
// 271 <sep> (not special). Pre-tokenizer ByteLevel without prefix space; decoder ByteLevel.

class ByteLevelBpe : public ::testing::Test {
 protected:
  std::unique_ptr<Tokenizer> tok = Tokenizer::load(data_dir() / "byte_level_bpe.json");
};

TEST_F(ByteLevelBpe, MergesByRank) {
  // "hello" -> h e l l o; (h,e) rank 1 -> he l l o; (l,l) rank 3 -> he ll o; (he,ll) 4; (hell,o) 5.
  // " world" -> Ġ w o r l d; (Ġ,w) rank 6, (o,r) 7, (Ġw,or) 8, (Ġwor,l) 9, (Ġworl,d) 10.
  EXPECT_EQ(tok->encode("hello world", false), (Ids{261, 266}));
  // "her": (h,e) rank 1 wins over (e,r) rank 12, then (he,r) has no merge.
  EXPECT_EQ(tok->encode("her", false), (Ids{257, 'r'}));
  // " the": (Ġ,t) rank 0, (h,e) rank 1, (Ġt,he) rank 2. At the start, "the" has no Ġ: t + he.
  EXPECT_EQ(tok->encode("the the", false), (Ids{'t', 257, 258}));
  // "Hello": only (l,l) applies; (e,ll) and (ll,o) are not merges.
  EXPECT_EQ(tok->encode("Hello", false), (Ids{'H', 'e', 259, 'o'}));
}

TEST_F(ByteLevelBpe, MultiByteCharactersBecomeTheirBytes) {
  // é = C3 A9, merged by rank 11 into 267. 日本 = E6 97 A5 E6 9C AC is one letter piece; the space
  // joins the emoji (` ?[^\s\p{L}\p{N}]+`): Ġ F0 9F 99 82, where Ġ is byte 0x20. No merges apply.
  EXPECT_EQ(tok->encode("caf\xC3\xA9", false), (Ids{'c', 'a', 'f', 267}));
  EXPECT_EQ(tok->encode("\xE6\x97\xA5\xE6\x9C\xAC \xF0\x9F\x99\x82", false),
            (Ids{0xE6, 0x97, 0xA5, 0xE6, 0x9C, 0xAC, 0x20, 0xF0, 0x9F, 0x99, 0x82}));
}

TEST_F(ByteLevelBpe, TemplateAddsBos) {
  EXPECT_EQ(tok->bos_id(), 270);
  EXPECT_EQ(tok->eos_id(), 269);  // no template suffix: the usual spelling <|endoftext|>
  EXPECT_EQ(tok->encode("hello world"), (Ids{270, 261, 266}));
  EXPECT_EQ(tok->encode(""), (Ids{270}));
}

TEST_F(ByteLevelBpe, AddedTokensInTextBecomeTheirIds) {
  // The longest match wins, and text around a token is encoded on its own (" world" keeps its Ġ).
  EXPECT_EQ(tok->encode("hello<|endoftext|> world<sep>her", false), (Ids{261, 269, 266, 271, 257, 'r'}));
  EXPECT_EQ(tok->encode("<|startoftext|><|endoftext|>", false), (Ids{270, 269}));
  // A partial spelling is plain text: "<|end" -> < | e n d.
  EXPECT_EQ(tok->encode("<|end", false), (Ids{'<', '|', 'e', 'n', 'd'}));
  EXPECT_TRUE(tok->is_special(269));
  EXPECT_FALSE(tok->is_special(271));
  EXPECT_EQ(tok->token_to_id("<sep>"), 271);
  EXPECT_EQ(tok->token_to_id("Ġworld"), 266);
  EXPECT_EQ(tok->token_to_id("nope"), std::nullopt);
  EXPECT_EQ(tok->vocab_size(), 272);
}

TEST_F(ByteLevelBpe, DecodeSkipsSpecialTokensOnRequest) {
  const Ids ids{270, 261, 266, 271, 269};
  EXPECT_EQ(tok->decode(ids), "hello world<sep>");
  EXPECT_EQ(tok->decode(ids, false), "<|startoftext|>hello world<sep><|endoftext|>");
  EXPECT_EQ(tok->token_bytes(266), " world");
  EXPECT_EQ(tok->token_bytes(269), "");
  EXPECT_EQ(tok->token_bytes(0xE6), "\xE6");  // one byte of a character
}

TEST_F(ByteLevelBpe, DecodeInvertsEncodeAndStreamingMatchesDecode) {
  for (const std::string& text : kRoundTripTexts) {
    const Ids ids = tok->encode(text);
    EXPECT_EQ(tok->decode(ids), text);
    EXPECT_EQ(stream(*tok, ids), text);
  }
  // Text that is not UTF-8 is read as Python's decode(errors="replace") would: U+FFFD (EF BF BD) for
  // the invalid byte. A lone byte token decodes to U+FFFD too.
  EXPECT_EQ(tok->encode("a\xFF", false), (Ids{'a', 0xEF, 0xBF, 0xBD}));
  EXPECT_EQ(tok->decode({'a', 0xFF}), "a\xEF\xBF\xBD");
}

TEST_F(ByteLevelBpe, LongWordsEncodeQuickly) {
  // 50k letters are one pre-token; the merge heap keeps BPE O(n log n): "ll" pairs up left to right.
  const Ids ids = tok->encode(std::string(50000, 'l'), false);
  EXPECT_EQ(ids, Ids(25000, 259));
}

TEST_F(ByteLevelBpe, IdsPastTheVocabularyAreSkippedNegativeOnesRefused) {
  // As transformers' decode (the tokenizers library has no token for them, and skips them); a negative
  // id cannot even be passed to it.
  EXPECT_EQ(tok->decode({'h', 272, 1 << 20, 'i'}), "hi");
  const std::string msg = error_message<ValueError>([&] { tok->decode({'h', -1}); });
  EXPECT_NE(msg.find("token id -1"), std::string::npos) << msg;
  EXPECT_THROW(tok->token_bytes(-1), ValueError);
  EXPECT_THROW(tok->token_bytes(272), ValueError);
}

TEST(ByteLevelBpeVariants, ListFormMergesGiveTheSameIds) {
  auto tok = load_edited("byte_level_bpe.json", "list_merges.json", [](nlohmann::json& doc) {
    for (auto& m : doc["model"]["merges"]) {
      const std::string s = m.get<std::string>();
      m = nlohmann::json::array({s.substr(0, s.find(' ')), s.substr(s.find(' ') + 1)});
    }
  });
  EXPECT_EQ(tok->encode("hello world her", false), (Ids{261, 266, 0x20, 257, 'r'}));
}

TEST(ByteLevelBpeVariants, IgnoreMergesTakesWholeWordsFromTheVocabulary) {
  // Add "her" = 272 to the vocab without a merge producing it: ignore_merges finds it directly,
  // while without ignore_merges BPE stops at he + r.
  auto edit = [](bool ignore) {
    return [ignore](nlohmann::json& doc) {
      doc["model"]["vocab"]["her"] = 272;
      doc["model"]["ignore_merges"] = ignore;
    };
  };
  EXPECT_EQ(load_edited("byte_level_bpe.json", "ignore1.json", edit(true))->encode("her", false), (Ids{272}));
  EXPECT_EQ(load_edited("byte_level_bpe.json", "ignore0.json", edit(false))->encode("her", false),
            (Ids{257, 'r'}));
}

TEST(ByteLevelBpeVariants, PrefixSpaceAndLlama3SplitSequence) {
  // add_prefix_space: "hello" becomes " hello" -> Ġ h e l l o: (Ġ,h) is no merge, so Ġ + hello.
  auto prefixed = load_edited("byte_level_bpe.json", "prefix.json",
                              [](nlohmann::json& doc) { doc["pre_tokenizer"]["add_prefix_space"] = true; });
  EXPECT_EQ(prefixed->encode("hello", false), (Ids{0x20, 261}));
  // Llama 3: Split by its pattern, then ByteLevel without its own regex. "123456" -> "123" "456".
  auto llama3 = load_edited("byte_level_bpe.json", "llama3.json", [](nlohmann::json& doc) {
    doc["pre_tokenizer"] = {
        {"type", "Sequence"},
        {"pretokenizers",
         {{{"type", "Split"},
           {"pattern",
            {{"Regex",
              R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)"}}},
           {"behavior", "Isolated"},
           {"invert", false}},
          {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", false}}}}};
    doc["post_processor"] = {{"type", "Sequence"},
                             {"processors", {{{"type", "ByteLevel"}}, doc["post_processor"]}}};
  });
  EXPECT_EQ(llama3->encode("hello world"), (Ids{270, 261, 266}));
  EXPECT_EQ(llama3->encode("123456", false), (Ids{'1', '2', '3', '4', '5', '6'}));
  for (const std::string& text : kRoundTripTexts) EXPECT_EQ(llama3->decode(llama3->encode(text)), text);
}

TEST(ByteLevelBpeVariants, AddedTokenStripAndSingleWordRules) {
  auto tok = load_edited("byte_level_bpe.json", "strip.json", [](nlohmann::json& doc) {
    doc["added_tokens"][2]["lstrip"] = true;  // <sep>
    doc["added_tokens"][2]["rstrip"] = true;
    doc["added_tokens"][0]["single_word"] = true;  // <|endoftext|>
  });
  // lstrip/rstrip swallow the spaces around <sep>; " world" would otherwise keep its Ġ.
  EXPECT_EQ(tok->encode("hello <sep> world", false), (Ids{261, 271, 'w', 263, 'l', 'd'}));
  // single_word: inside a word it is not the token, so "x<|endoftext|>" is plain text.
  EXPECT_EQ(tok->encode("x <|endoftext|>", false), (Ids{'x', ' ', 269}));
  EXPECT_EQ(tok->encode("x<|endoftext|>", false),
            (Ids{'x', '<', '|', 'e', 'n', 'd', 'o', 'f', 't', 'e', 'x', 't', '|', '>'}));
}

// ==== Normalizers, Split behaviours, tokenizer_config.json ===========================================

// The byte-level fixture with another normalizer / pre-tokenizer (ids as in ByteLevelBpe's comment).
std::unique_ptr<Tokenizer> with_steps(const std::string& name, nlohmann::json normalizer, nlohmann::json split) {
  return load_edited("byte_level_bpe.json", name, [&](nlohmann::json& doc) {
    doc["normalizer"] = normalizer;
    if (!split.is_null())
      doc["pre_tokenizer"] = {{"type", "Sequence"},
                              {"pretokenizers",
                               {split, {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", false}}}}};
  });
}

TEST(TokenizerNormalizers, UnicodeNormalFormsComeFromUtf8proc) {
  // "e" + U+0301 (combining acute) composes to é (C3 A9, merged into 267) under NFC; without a
  // normalizer it stays e + CC 81.
  const std::string decomposed = "caf\x65\xCC\x81";
  EXPECT_EQ(with_steps("nfc.json", {{"type", "NFC"}}, nullptr)->encode(decomposed, false), (Ids{'c', 'a', 'f', 267}));
  EXPECT_EQ(Tokenizer::load(data_dir() / "byte_level_bpe.json")->encode(decomposed, false),
            (Ids{'c', 'a', 'f', 'e', 0xCC, 0x81}));
  // NFD takes é apart; NFKC also folds compatibility characters: the ligature U+FB01 is "fi", and
  // U+2460 (circled one) is "1".
  EXPECT_EQ(with_steps("nfd.json", {{"type", "NFD"}}, nullptr)->encode("\xC3\xA9", false), (Ids{'e', 0xCC, 0x81}));
  EXPECT_EQ(with_steps("nfkc.json", {{"type", "NFKC"}}, nullptr)->encode("\xEF\xAC\x81 \xE2\x91\xA0", false),
            (Ids{'f', 'i', ' ', '1'}));
  // Strip, NFD, StripAccents and Lowercase in sequence: "  HÉ\t" -> "HÉ" -> "HE" + U+0301 -> "HE" ->
  // "he", merged into 257.
  auto chain = with_steps("chain.json",
                          {{"type", "Sequence"},
                           {"normalizers",
                            {{{"type", "Strip"}, {"strip_left", true}, {"strip_right", true}},
                             {{"type", "NFD"}},
                             {{"type", "StripAccents"}},
                             {{"type", "Lowercase"}}}}},
                          nullptr);
  EXPECT_EQ(chain->encode("  H\xC3\x89\t", false), (Ids{257}));
  // Replace with a regex: runs of digits become "#".
  auto replace = with_steps("replace.json",
                            {{"type", "Replace"}, {"pattern", {{"Regex", "[0-9]+"}}}, {"content", "#"}}, nullptr);
  EXPECT_EQ(replace->encode("a123b4", false), (Ids{'a', '#', 'b', '#'}));
}

TEST(TokenizerSplitBehaviors, EachBehaviorGroupsTheDelimiterAsTheTokenizersLibraryDoes) {
  // Merges visible in ids: "he" = 257, "ll" = 259, "hell" = 260, "hello" = 261. Each split piece is a
  // word of its own, so a merge appears only when its letters stay together.
  const auto split = [](const std::string& delimiter, const std::string& behavior, bool invert) {
    return nlohmann::json{{"type", "Split"},
                          {"pattern", {{"String", delimiter}}},
                          {"behavior", behavior},
                          {"invert", invert}};
  };
  const auto ids = [&](const std::string& text, const std::string& delimiter, const std::string& behavior,
                       bool invert = false) {
    return with_steps("split_" + behavior + (invert ? "_inv" : "") + ".json", nullptr,
                      split(delimiter, behavior, invert))
        ->encode(text, false);
  };
  EXPECT_EQ(ids("he", "e", "Isolated"), (Ids{'h', 'e'}));
  EXPECT_EQ(ids("he", "e", "Removed"), (Ids{'h'}));
  EXPECT_EQ(ids("he", "e", "MergedWithPrevious"), (Ids{257}));
  EXPECT_EQ(ids("he", "e", "MergedWithNext"), (Ids{'h', 'e'}));
  EXPECT_EQ(ids("he", "h", "MergedWithNext"), (Ids{257}));
  EXPECT_EQ(ids("he", "h", "MergedWithPrevious"), (Ids{'h', 'e'}));
  // "hello" split on "l": Isolated "he" "l" "l" "o"; Contiguous joins the two "l" matches.
  EXPECT_EQ(ids("hello", "l", "Isolated"), (Ids{257, 'l', 'l', 'o'}));
  EXPECT_EQ(ids("hello", "l", "Contiguous"), (Ids{257, 259, 'o'}));
  // invert: the delimiter is everything but "l"; Removed then keeps only the "l"s.
  EXPECT_EQ(ids("hello", "l", "Removed", true), (Ids{'l', 'l'}));
  // Gemma's Split on " " merged with the previous piece: "hello hello" -> "hello " "hello".
  EXPECT_EQ(ids("hello hello", " ", "MergedWithPrevious"), (Ids{261, ' ', 261}));
  // Digits: each digit alone, or runs of digits together.
  const auto digits = [&](bool individual) {
    return with_steps(individual ? "digits1.json" : "digits0.json", nullptr,
                      {{"type", "Digits"}, {"individual_digits", individual}});
  };
  EXPECT_EQ(digits(true)->encode("he12", false), (Ids{257, '1', '2'}));
  EXPECT_EQ(digits(false)->encode("he12", false), (Ids{257, '1', '2'}));
}

TEST(TokenizerRegex, UnicodeCategoriesReachUnicode15AndOnigurumaEscapesAreKept) {
  using pipelines::detail::Regex;
  const auto matches = [](std::string_view pattern, std::string_view text) {
    std::vector<std::pair<size_t, size_t>> m;
    Regex(pattern).find_all(text, m);
    std::vector<std::string_view> out;
    for (const auto& [b, e] : m) out.push_back(text.substr(b, e - b));
    return out;
  };
  // U+1E4D0 (NAG MUNDARI LETTER O, Unicode 15.0) is a letter, inside and outside a class.
  const std::string nag = "a\xF0\x9E\x93\x90" "b";
  EXPECT_EQ(matches(R"(\p{L}+)", nag), (std::vector<std::string_view>{nag}));
  EXPECT_EQ(matches(R"([\p{L}\p{N}]+)", nag), (std::vector<std::string_view>{nag}));
  EXPECT_TRUE(matches(R"(\P{L})", nag).empty());
  EXPECT_TRUE(matches(R"([^\p{L}])", nag).empty());
  // Oniguruma's \h is a hex digit.
  EXPECT_EQ(matches(R"(\h+)", "zz0fA9 g"), (std::vector<std::string_view>{"0fA9"}));
  EXPECT_EQ(pipelines::detail::oniguruma_to_pcre2(R"([\h]\H)"), R"([0-9a-fA-F][^0-9a-fA-F])");
}

TEST(TokenizerAddedTokens, LongestMatchAtTheLeftmostPosition) {
  // Two added tokens where one is a prefix of the other: the longer wins where both match; the scan
  // finds the leftmost start first.
  auto tok = load_edited("byte_level_bpe.json", "overlap.json", [](nlohmann::json& doc) {
    doc["added_tokens"].push_back({{"id", 272}, {"content", "<x>"}, {"special", true}});
    doc["added_tokens"].push_back({{"id", 273}, {"content", "<x>he"}, {"special", false}});
  });
  EXPECT_EQ(tok->encode("<x>hel<x>", false), (Ids{273, 'l', 272}));
  EXPECT_EQ(tok->encode("a<x><x>he", false), (Ids{'a', 272, 273}));
}

// A directory with the byte-level fixture's tokenizer.json and the given tokenizer_config.json.
fs::path config_dir(const std::string& name, const std::string& config) {
  const fs::path dir = fs::path(::testing::TempDir()) / ("kiln_tokconfig_" + name);
  fs::create_directories(dir);
  fs::copy_file(data_dir() / "byte_level_bpe.json", dir / "tokenizer.json", fs::copy_options::overwrite_existing);
  std::ofstream(dir / "tokenizer_config.json") << config;
  return dir;
}

TEST(TokenizerConfigJson, SpecialTokensFlagsAndCleanUpAsTransformersReadsThem) {
  // Qwen 3's case: the config's eos_token is not the vocabulary's usual spelling; bos_token null.
  auto tok = Tokenizer::load(config_dir("eos", R"({"eos_token": "<sep>", "bos_token": null})"));
  EXPECT_EQ(tok->eos_id(), 271);
  EXPECT_EQ(tok->bos_id(), std::nullopt);
  EXPECT_EQ(tok->encode("he"), (Ids{270, 257}));  // no add_bos_token: the file's template stands

  // add_bos_token / add_eos_token rebuild the template; tokens as AddedToken objects.
  tok = Tokenizer::load(config_dir("flags", R"({"bos_token": {"content": "<|startoftext|>", "__type": "AddedToken"},
      "eos_token": "<|endoftext|>", "add_bos_token": false, "add_eos_token": true})"));
  EXPECT_EQ(tok->encode("he"), (Ids{257, 269}));

  // clean_up_tokenization_spaces: " ." -> "." and " 's" -> "'s" on decode (transformers' rules).
  const Ids spaced = Tokenizer::load(data_dir() / "byte_level_bpe.json")->encode("he . he 's", false);
  EXPECT_EQ(Tokenizer::load(config_dir("clean1", R"({"clean_up_tokenization_spaces": true})"))->decode(spaced),
            "he. he's");
  EXPECT_EQ(Tokenizer::load(config_dir("clean0", R"({"clean_up_tokenization_spaces": false})"))->decode(spaced),
            "he . he 's");

  // additional_special_tokens makes <sep> special (skipped on decode); added_tokens_decoder adds a token
  // the tokenizer file lacks.
  tok = Tokenizer::load(config_dir("added", R"({"additional_special_tokens": ["<sep>"],
      "added_tokens_decoder": {"272": {"content": "<new>", "special": true}}})"));
  EXPECT_TRUE(tok->is_special(271));
  EXPECT_EQ(tok->decode({257, 271, 257}), "hehe");
  EXPECT_EQ(tok->encode("he<new>", false), (Ids{257, 272}));
  EXPECT_EQ(tok->vocab_size(), 273);
}

TEST(TokenizerConfigJson, BadValuesNameTheFileAndTheKey) {
  const auto msg_for = [](const std::string& name, const std::string& config) {
    const fs::path dir = config_dir(name, config);
    const std::string msg = error_message<LoadError>([&] { Tokenizer::load(dir); });
    EXPECT_NE(msg.find("tokenizer_config.json"), std::string::npos) << msg;
    return msg;
  };
  EXPECT_NE(msg_for("unknown", R"({"eos_token": "<nope>"})").find("eos_token '<nope>'"), std::string::npos);
  EXPECT_NE(msg_for("badflag", R"({"add_bos_token": "yes"})").find("'add_bos_token' is \"yes\""), std::string::npos);
  EXPECT_NE(msg_for("badkey", R"({"added_tokens_decoder": {"x1": {"content": "a"}}})").find("added_tokens_decoder.x1"),
            std::string::npos);
  EXPECT_NE(msg_for("dup", R"({"eos_token": "a", "eos_token": "b"})").find("duplicate key"), std::string::npos);
  EXPECT_NE(msg_for("noeos", R"({"eos_token": null, "add_eos_token": true})").find("no eos_token"), std::string::npos);
}

// ==== Metaspace + byte fallback (Llama 2 style) =======================================================
// llama2_metaspace_bpe.json: 0 <unk>, 1 <s>, 2 </s>, 3..258 <0x00>..<0xFF> (id = 3 + byte), then
// 259 ▁, 260 h, 261 e, 262 l, 263 o, 264 w, 265 r, 266 d, 267 é, and merges in rank order 268 ▁h,
// 269 ll, 270 ▁he, 271 ▁hell, 272 ▁hello, 273 ▁w, 274 or, 275 ▁wor. Normalizer Prepend('▁') +
// Replace(' ', '▁') with no pre-tokenizer (the whole text is one BPE word); decoder Replace('▁', ' '),
// ByteFallback, Fuse, Strip(1 leading space); template BOS <s>.

class Llama2Bpe : public ::testing::Test {
 protected:
  std::unique_ptr<Tokenizer> tok = Tokenizer::load(data_dir() / "llama2_metaspace_bpe.json");
};

TEST_F(Llama2Bpe, EncodesOneWordWithMergesAcrossTheMarker) {
  // "▁hello▁world": ▁ h e l l o ▁ w o r l d. Rank 0 (▁,h); rank 1 (l,l); rank 2 (▁h,e); rank 3
  // (▁he,ll); rank 4 (▁hell,o); rank 5 (▁,w); rank 6 (o,r); rank 7 (▁w,or). "l" "d" stay.
  EXPECT_EQ(tok->encode("hello world"), (Ids{1, 272, 275, 262, 266}));
  EXPECT_EQ(tok->bos_id(), 1);
  EXPECT_EQ(tok->eos_id(), 2);
}

TEST_F(Llama2Bpe, UnknownCharactersFallBackToBytes) {
  // "hé日🙂" -> "▁hé日🙂": ▁h (rank 0), é 267, 日 = E6 97 A5, 🙂 = F0 9F 99 82, each byte b as 3 +
  // b.
  EXPECT_EQ(tok->encode("h\xC3\xA9\xE6\x97\xA5\xF0\x9F\x99\x82", false),
            (Ids{268, 267, 3 + 0xE6, 3 + 0x97, 3 + 0xA5, 3 + 0xF0, 3 + 0x9F, 3 + 0x99, 3 + 0x82}));
  // 'z' is not in the vocabulary either: <0x7A>.
  EXPECT_EQ(tok->encode("z", false), (Ids{259, 3 + 'z'}));
}

TEST_F(Llama2Bpe, DecodeStripsThePrefixSpaceAndResolvesBytes) {
  EXPECT_EQ(tok->decode({1, 272, 275, 262, 266}), "hello world");
  EXPECT_EQ(tok->decode({1, 272, 275, 262, 266}, false), "<s> hello world");
  EXPECT_EQ(tok->decode({268, 267, 3 + 0xE6, 3 + 0x97, 3 + 0xA5}), "h\xC3\xA9\xE6\x97\xA5");
  EXPECT_EQ(tok->token_bytes(272), " hello");
  EXPECT_EQ(tok->token_bytes(3 + 0xE6), "\xE6");
  for (const std::string& text : kRoundTripTexts) {
    const Ids ids = tok->encode(text);
    EXPECT_EQ(tok->decode(ids), text);
    // Streamed tokens follow a prompt, so the prefix space is not stripped there.
    EXPECT_EQ(stream(*tok, ids), " " + text);
  }
}

TEST_F(Llama2Bpe, StreamingHoldsPartialCharacters) {
  Utf8Stream s;
  EXPECT_EQ(s.push(tok->token_bytes(268)), " h");
  EXPECT_EQ(s.push(tok->token_bytes(3 + 0xE6)), "");  // 日 is E6 97 A5: wait for the rest
  EXPECT_EQ(s.push(tok->token_bytes(3 + 0x97)), "");
  EXPECT_EQ(s.push(tok->token_bytes(3 + 0xA5)), "\xE6\x97\xA5");
  EXPECT_EQ(s.flush(), "");
}

TEST(Llama2BpeVariants, MetaspacePreTokenizerGivesTheSameIds) {
  // The newer form: no normalizer, Metaspace(prepend_scheme first, split) and a Metaspace decoder.
  // Split at ▁ gives "▁hello" "▁world"; BPE on each gives the same ids as the one-word form.
  const auto edit = [](const char* scheme) {
    return [scheme](nlohmann::json& doc) {
      doc["normalizer"] = nullptr;
      doc["pre_tokenizer"] = {{"type", "Metaspace"},
                              {"replacement", "\xE2\x96\x81"},
                              {"prepend_scheme", scheme},
                              {"split", true}};
      doc["decoder"] = {
          {"type", "Sequence"},
          {"decoders",
           {{{"type", "Metaspace"}, {"replacement", "\xE2\x96\x81"}, {"prepend_scheme", scheme}},
            {{"type", "ByteFallback"}},
            {{"type", "Fuse"}}}}};
    };
  };
  auto first = load_edited("llama2_metaspace_bpe.json", "metaspace_first.json", edit("first"));
  EXPECT_EQ(first->encode("hello world"), (Ids{1, 272, 275, 262, 266}));
  EXPECT_EQ(first->decode({1, 272, 275, 262, 266}), "hello world");
  // "first" prepends ▁ only at the start of the text, "always" after a special token too:
  // "hello" alone is h e ll o; "▁hello" is one token.
  EXPECT_EQ(first->encode("<s>hello", false), (Ids{1, 260, 261, 269, 263}));
  auto always = load_edited("llama2_metaspace_bpe.json", "metaspace_always.json", edit("always"));
  EXPECT_EQ(always->encode("<s>hello", false), (Ids{1, 272}));
  for (const std::string& text : kRoundTripTexts) {
    if (text[0] != ' ') {
      EXPECT_EQ(first->decode(first->encode(text)), text);
    }
  }
  // As in Hugging Face: "  x" is already marked ("▁▁x", split "▁" "▁x"), and the Metaspace decoder
  // drops every marker of the first token, so one leading space is lost.
  EXPECT_EQ(first->decode(first->encode("  x")), " x");
}

TEST(Llama2BpeVariants, UnknownCharactersWithoutByteFallbackFuseIntoOneUnk) {
  auto fused = load_edited("llama2_metaspace_bpe.json", "unk_fused.json",
                           [](nlohmann::json& doc) { doc["model"]["byte_fallback"] = false; });
  EXPECT_EQ(fused->encode("hzzh", false), (Ids{268, 0, 260}));  // ▁h, <unk> for "zz", h
  auto unfused = load_edited("llama2_metaspace_bpe.json", "unk_unfused.json", [](nlohmann::json& doc) {
    doc["model"]["byte_fallback"] = false;
    doc["model"]["fuse_unk"] = false;
  });
  EXPECT_EQ(unfused->encode("hzzh", false), (Ids{268, 0, 0, 260}));
}

// ==== Utf8Stream =====================================================================================

TEST(Utf8Stream, EmitsOnlyCompleteCharacters) {
  Utf8Stream s;
  EXPECT_EQ(s.push("a\xF0\x9F"), "a");
  EXPECT_EQ(s.push("\x99"), "");
  EXPECT_EQ(s.push("\x82"
                   "b"),
            "\xF0\x9F\x99\x82"
            "b");
  EXPECT_EQ(s.push("\xE6\x97"), "");
  EXPECT_EQ(s.flush(), "\xEF\xBF\xBD");  // a truncated character at the end is one U+FFFD
}

TEST(Utf8Stream, InvalidBytesBecomeReplacementCharacters) {
  Utf8Stream s;
  // 0xFF never starts a character; 0xE6 followed by 'x' cannot be completed; a stray continuation.
  EXPECT_EQ(s.push("\xFF"
                   "a\xE6x\x80"),
            "\xEF\xBF\xBD"
            "a\xEF\xBF\xBD"
            "x\xEF\xBF\xBD");
  // An overlong encoding of '/' (C0 AF) and a surrogate (ED A0 80) are invalid too.
  EXPECT_EQ(s.push("\xC0\xAF"), "\xEF\xBF\xBD\xEF\xBF\xBD");
  EXPECT_EQ(s.push("\xED\xA0\x80"), "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD");
  EXPECT_EQ(s.flush(), "");
}

// ==== SentencePiece ==================================================================================
// spm_bpe_tiny.model was trained on spm_corpus.txt with Debian's spm_train 0.1.97:
//   spm_train --input=spm_corpus.txt --model_prefix=spm_bpe_tiny --vocab_size=400 --model_type=bpe
//     --byte_fallback=true --character_coverage=1.0 --normalization_rule_name=identity
//     --remove_extra_whitespaces=false
// Ids: 0 <unk>, 1 <s>, 2 </s>, 3..258 <0x00>..<0xFF>, then the merged pieces.

class SentencePieceModel : public ::testing::Test {
 protected:
  std::unique_ptr<Tokenizer> tok = Tokenizer::load(data_dir() / "spm_bpe_tiny.model");
};

TEST_F(SentencePieceModel, RoundTripsAndAddsBos) {
  EXPECT_EQ(tok->bos_id(), 1);
  EXPECT_EQ(tok->eos_id(), 2);
  EXPECT_EQ(tok->vocab_size(), 400);
  for (const std::string& text : kRoundTripTexts) {
    const Ids ids = tok->encode(text);
    ASSERT_FALSE(ids.empty());
    EXPECT_EQ(ids.front(), 1);
    EXPECT_EQ(tok->decode(ids), text);
    EXPECT_EQ(stream(*tok, ids), " " + text);  // the dummy prefix, which decode() removes
  }
  EXPECT_NE(tok->encode("hello", false).front(), 1);
}

TEST_F(SentencePieceModel, CharactersOutsideTheTrainingTextFallBackToBytes) {
  // 日 (E6 97 A5) never occurs in the corpus: after the "▁" piece come its three byte pieces.
  const Ids ids = tok->encode("\xE6\x97\xA5", false);
  ASSERT_EQ(ids.size(), 4u);
  EXPECT_EQ(tok->token_bytes(ids[0]), " ");
  EXPECT_EQ((Ids{ids[1], ids[2], ids[3]}), (Ids{3 + 0xE6, 3 + 0x97, 3 + 0xA5}));
  EXPECT_EQ(tok->token_bytes(ids[1]), "\xE6");
  EXPECT_EQ(tok->token_to_id("<0xE6>"), 3 + 0xE6);
}

TEST_F(SentencePieceModel, SpecialTokensInTextAndDecoding) {
  const Ids ids = tok->encode("hello</s>", false);
  EXPECT_EQ(ids.back(), 2);
  EXPECT_TRUE(tok->is_special(2));
  EXPECT_EQ(tok->decode(ids), "hello");
  EXPECT_EQ(tok->decode(ids, false), "hello</s>");
  EXPECT_EQ(tok->token_bytes(2), "");
  EXPECT_EQ(tok->token_to_id("no such piece"), std::nullopt);
  EXPECT_THROW(tok->decode({400}), ValueError);
}

// The same vocabulary read two ways: a tokenizer.json built from the SentencePiece model the way
// Hugging Face's converter does (merges = every split of a piece into two pieces, ordered by the
// piece's score) must give libsentencepiece's ids.
TEST_F(SentencePieceModel, TokenizerJsonFromTheSameVocabularyAgrees) {
  sentencepiece::SentencePieceProcessor sp;
  ASSERT_TRUE(sp.Load((data_dir() / "spm_bpe_tiny.model").string()).ok());
  nlohmann::json vocab = nlohmann::json::object();
  std::vector<std::tuple<float, int, std::string, std::string>> merges;  // (-score, id, a, b)
  for (int id = 0; id < sp.GetPieceSize(); ++id) vocab[sp.IdToPiece(id)] = id;
  for (int id = 0; id < sp.GetPieceSize(); ++id) {
    const std::string piece = sp.IdToPiece(id);
    if (sp.IsUnknown(id) || sp.IsControl(id) || sp.IsUnused(id) || sp.IsByte(id)) continue;
    for (size_t cut = 1; cut < piece.size(); ++cut) {
      const std::string a = piece.substr(0, cut), b = piece.substr(cut);
      if (vocab.contains(a) && vocab.contains(b)) merges.emplace_back(-sp.GetScore(id), id, a, b);
    }
  }
  std::sort(merges.begin(), merges.end());
  nlohmann::json merge_list = nlohmann::json::array();
  for (const auto& m : merges) merge_list.push_back({std::get<2>(m), std::get<3>(m)});
  nlohmann::json doc = read_json(data_dir() / "llama2_metaspace_bpe.json");
  doc["added_tokens"] = nlohmann::json::array();
  doc["model"]["vocab"] = vocab;
  doc["model"]["merges"] = merge_list;
  auto hf = Tokenizer::load(write_temp("from_spm.json", doc.dump()));
  for (const std::string& text : kRoundTripTexts) {
    std::vector<int> expected;
    ASSERT_TRUE(sp.Encode(text, &expected).ok());
    EXPECT_EQ(hf->encode(text, false), Ids(expected.begin(), expected.end())) << text;
  }
}

// ==== Malformed files ================================================================================

TEST(TokenizerLoad, MalformedFilesNameTheFile) {
  const fs::path bad_json = write_temp("bad.json", "{\"model\": {\"type\": \"BPE\", ");
  std::string msg = error_message<LoadError>([&] { Tokenizer::load(bad_json); });
  EXPECT_NE(msg.find(bad_json.string()), std::string::npos) << msg;
  EXPECT_NE(msg.find("not valid JSON"), std::string::npos) << msg;

  const fs::path no_model = write_temp("no_model.json", "{\"version\": \"1.0\"}");
  msg = error_message<LoadError>([&] { Tokenizer::load(no_model); });
  EXPECT_NE(msg.find(no_model.string()), std::string::npos) << msg;
  EXPECT_NE(msg.find("'model'"), std::string::npos) << msg;

  for (const char* type : {"WordPiece", "Unigram"}) {
    const fs::path file = write_temp(std::string(type) + ".json",
                                     std::string("{\"model\": {\"type\": \"") + type + "\", \"vocab\": {}}}");
    msg = error_message<LoadError>([&] { Tokenizer::load(file); });
    EXPECT_NE(msg.find(file.string()), std::string::npos) << msg;
    EXPECT_NE(msg.find(type), std::string::npos) << msg;
  }

  const fs::path not_spm = write_temp("tokenizer.model", "definitely not a protobuf");
  msg = error_message<LoadError>([&] { Tokenizer::load(not_spm); });
  EXPECT_NE(msg.find(not_spm.string()), std::string::npos) << msg;

  msg = error_message<LoadError>([&] { Tokenizer::load("/nonexistent/kiln/tokenizer.json"); });
  EXPECT_NE(msg.find("/nonexistent/kiln/tokenizer.json"), std::string::npos) << msg;
}

TEST(TokenizerLoad, UnsupportedPartsAreNamed) {
  const auto error_for = [](const std::string& name, auto edit) {
    return error_message<LoadError>([&] { load_edited("byte_level_bpe.json", name, edit); });
  };
  // A regex PCRE2 cannot compile: the pattern and PCRE2's reason with its offset.
  std::string msg = error_for("regex.json", [](nlohmann::json& doc) {
    doc["pre_tokenizer"] = {{"type", "Split"}, {"pattern", {{"Regex", "(\\w+"}}}, {"behavior", "Isolated"}};
  });
  EXPECT_NE(msg.find("regex '(\\w+'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("missing closing parenthesis"), std::string::npos) << msg;
  msg = error_for("bertpre.json", [](nlohmann::json& doc) { doc["pre_tokenizer"] = {{"type", "BertPreTokenizer"}}; });
  EXPECT_NE(msg.find("pre_tokenizer 'BertPreTokenizer'"), std::string::npos) << msg;
  msg = error_for("behavior.json", [](nlohmann::json& doc) {
    doc["pre_tokenizer"] = {{"type", "Split"}, {"pattern", {{"String", " "}}}, {"behavior", "Sideways"}};
  });
  EXPECT_NE(msg.find("behavior 'Sideways'"), std::string::npos) << msg;
  msg = error_for("dropout.json", [](nlohmann::json& doc) { doc["model"]["dropout"] = 0.1; });
  EXPECT_NE(msg.find("dropout 0.1"), std::string::npos) << msg;
  msg = error_for("badmerge.json", [](nlohmann::json& doc) { doc["model"]["merges"].push_back("he zz"); });
  EXPECT_NE(msg.find("'zz' is not in the vocabulary"), std::string::npos) << msg;
  msg = error_for("badid.json", [](nlohmann::json& doc) { doc["model"]["vocab"]["big"] = 1LL << 40; });
  EXPECT_NE(msg.find("'big'"), std::string::npos) << msg;
  msg = error_for("badtype.json", [](nlohmann::json& doc) { doc["model"]["vocab"]["str"] = "seven"; });
  EXPECT_NE(msg.find("'str'"), std::string::npos) << msg;
}

// Hostile tokenizer.json files (issue 19): each a LoadError naming the file, never a crash.
// An integer field given as a float or out of its type's range is refused by name (the JSON
// library's own conversion would be undefined behaviour: a fuzzed decoder "stop": 9.2e18).
TEST(TokenizerLoad, IntegerFieldsMustBeIntegersInRange) {
  for (const nlohmann::json& stop : {nlohmann::json(9.22e18), nlohmann::json(1.5), nlohmann::json(-1)}) {
    SCOPED_TRACE(stop.dump());
    EXPECT_THROW(
        {
          try {
            load_edited("byte_level_bpe.json", "strip_stop.json", [&](nlohmann::json& doc) {
              doc["decoder"] = {{"type", "Strip"}, {"content", " "}, {"start", 0}, {"stop", stop}};
            });
          } catch (const LoadError& e) {
            EXPECT_NE(std::string(e.what()).find("'stop' is"), std::string::npos) << e.what();
            EXPECT_NE(std::string(e.what()).find("expected an integer"), std::string::npos) << e.what();
            throw;
          }
        },
        LoadError);
  }
}

TEST(TokenizerLoad, HostileJsonIsLoadErrorNamingTheFile) {
  const std::string deep = std::string(100'000, '[') + std::string(100'000, ']');
  const std::vector<std::pair<std::string, std::string>> cases = {
      {R"({"model": {"type": "BPE", "vocab": {"a": 1e400}, "merges": []}})",
       "number overflow parsing '1e400'"},
      // A token id nested 100k levels (200 KB): refused at the 64th level, before any value is built.
      {R"({"model": {"type": "BPE", "vocab": {"a": )" + deep + R"(}, "merges": []}})",
       "nested deeper than 64 levels at byte"},
      {R"({"model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "a": 2}, "merges": []}})",
       "duplicate key \"a\" at byte 54"},
      {R"({"model": {"type": "BPE", "vocab": {}, "merges": []}, "model": {}})", "duplicate key \"model\""},
      {R"({"added_tokens": [{"id": 0, "content": "x", "id": 1}], "model": {}})", "duplicate key \"id\""},
      {[] {
         std::string s = R"({"decoder": )";
         for (int i = 0; i < 100'000; ++i) s += R"({"type": "Sequence", "decoders": [)";
         return s;
       }(),
       "nested deeper than 64 levels"},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    const auto& [text, fragment] = cases[i];
    const fs::path file = write_temp("hostile" + std::to_string(i) + ".json", text);
    const std::string msg = error_message<LoadError>([&] { Tokenizer::load(file); });
    EXPECT_NE(msg.find("tokenizer '" + file.string() + "': "), std::string::npos) << msg;
    EXPECT_NE(msg.find(fragment), std::string::npos) << msg;
    EXPECT_LT(msg.size(), 600u) << msg;
  }
}

TEST(TokenizerLoad, ValuesInMessagesAreCut) {
  const std::string msg = error_message<LoadError>([&] {
    load_edited("byte_level_bpe.json", "longid.json", [](nlohmann::json& doc) {
      nlohmann::json list = nlohmann::json::array();
      for (int i = 0; i < 100'000; ++i) list.push_back(i);
      doc["post_processor"] = {{"type", "TemplateProcessing"},
                               {"single", nlohmann::json::array({{{"SpecialToken", {{"id", "x"}}}}})},
                               {"special_tokens", {{"x", {{"ids", {list}}}}}}};
    });
  });
  EXPECT_LT(msg.size(), 400u) << msg;
}

TEST(TokenizerLoad, DirectoryPrefersTokenizerJson) {
  const fs::path dir = fs::path(::testing::TempDir()) / "kiln_tokenizer_dir";
  fs::create_directories(dir);
  fs::copy_file(data_dir() / "spm_bpe_tiny.model", dir / "tokenizer.model",
                fs::copy_options::overwrite_existing);
  EXPECT_EQ(Tokenizer::load(dir)->vocab_size(), 400);
  fs::copy_file(data_dir() / "byte_level_bpe.json", dir / "tokenizer.json",
                fs::copy_options::overwrite_existing);
  EXPECT_EQ(Tokenizer::load(dir)->vocab_size(), 272);
  fs::remove_all(dir);
  EXPECT_THROW(Tokenizer::load(dir), LoadError);
}
