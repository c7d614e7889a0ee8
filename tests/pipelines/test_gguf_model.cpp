// A model from a GGUF file: kiln-tiny written as GGUF by tools/reference/hf_to_gguf.py (plain
// Python, llama.cpp's converter conventions: names, the Q/K permutation, ggml's Q8_0 quantizer) must
// be the same model as its safetensors: the same tensors after un-permuting, bit for bit in each
// format, and the greedy ids of PyTorch's reference run.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fmt/format.h>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>

#include "kiln/errors.h"
#include "kiln/graph/dtype.h"
#include "kiln/graph/quantization.h"
#include "kiln/nn/rotary_embedding.h"
#include "kiln/nn/transformer.h"
#include "kiln/pipelines/gguf.h"
#include "kiln/pipelines/gguf_model.h"
#include "kiln/pipelines/hf_config.h"
#include "kiln/pipelines/safetensors.h"
#include "kiln/pipelines/text_generation.h"
#include "kiln/pipelines/tokenizer.h"
#include "test_util.h"

namespace kiln::pipelines {
namespace {
namespace fs = std::filesystem;
using kiln::testing::resident_bytes_of;

const fs::path kRoot = fs::path(__FILE__).parent_path().parent_path().parent_path();
const fs::path kTiny = kRoot / "models" / "kiln-tiny";

// This test program's scratch directory, removed when it exits.
const fs::path& scratch_dir() {
  static const struct Scratch {
    fs::path path = fs::temp_directory_path() / fmt::format("kiln-test-gguf-{}", ::getpid());
    Scratch() { fs::create_directories(path); }
    ~Scratch() {
      std::error_code ec;
      fs::remove_all(path, ec);
    }
  } scratch;
  return scratch.path;
}

// kiln-tiny (or another model directory) as a GGUF file of `type` (f32, f16, q8_0, q4_0,
// q4_0_mixed), written once per test program.
fs::path tiny_gguf(const std::string& type, const fs::path& model_dir = kTiny) {
  const fs::path dir = scratch_dir();
  const fs::path out = dir / fmt::format("{}-{}.gguf", model_dir.filename().string(), type);
  if (!fs::exists(out)) {
    const std::string cmd = fmt::format("'{}' '{}' '{}' '{}' --type {}", KILN_TEST_PYTHON3,
                                        (kRoot / "tools" / "reference" / "hf_to_gguf.py").string(), model_dir.string(),
                                        out.string(), type);
    EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd;
  }
  return out;
}

std::vector<uint8_t> bytes_of(const Tensor& t) {
  const auto* p = static_cast<const uint8_t*>(t.data());
  return {p, p + t.nbytes()};
}

TEST(GGUFModel, KilnTinyConfigIsTheConfigJsonOne) {
  const GGUFFile file = GGUFFile::open(tiny_gguf("f32"));
  const ModelInfo from_gguf = gguf_model_info(file);
  const ModelInfo from_dir = load_model_info(kTiny);
  const nn::LlamaConfig &a = from_gguf.config, &b = from_dir.config;
  EXPECT_EQ(from_gguf.architecture, "LlamaForCausalLM");
  EXPECT_EQ(a.vocab_size, b.vocab_size);
  EXPECT_EQ(a.hidden_size, b.hidden_size);
  EXPECT_EQ(a.intermediate_size, b.intermediate_size);
  EXPECT_EQ(a.num_hidden_layers, b.num_hidden_layers);
  EXPECT_EQ(a.num_attention_heads, b.num_attention_heads);
  EXPECT_EQ(a.num_key_value_heads, b.num_key_value_heads);
  EXPECT_EQ(a.resolved_head_dim(), b.resolved_head_dim());
  EXPECT_EQ(a.max_position_embeddings, b.max_position_embeddings);
  EXPECT_EQ(a.tie_word_embeddings, b.tie_word_embeddings);
  EXPECT_FLOAT_EQ(a.rms_norm_eps, b.rms_norm_eps);  // GGUF keeps it as f32
  EXPECT_EQ(a.rope_theta, b.rope_theta);
  EXPECT_EQ(from_gguf.bos_token_id, from_dir.bos_token_id);
  EXPECT_EQ(from_gguf.eos_token_ids, from_dir.eos_token_ids);
  EXPECT_EQ(gguf_weight_format(file), nn::WeightFormat::f32);
  EXPECT_EQ(gguf_weight_format(GGUFFile::open(tiny_gguf("f16"))), nn::WeightFormat::f16);
  EXPECT_EQ(gguf_weight_format(GGUFFile::open(tiny_gguf("q8_0"))), nn::WeightFormat::q8_0);
  EXPECT_EQ(gguf_weight_format(GGUFFile::open(tiny_gguf("q4_0"))), nn::WeightFormat::q4_0);
}

// Each GGUF tensor, un-permuted, against the safetensors one in the file's own format: f32 as is,
// f16 rounded to nearest even, Q8_0 rows as kiln's quantizer writes them (ggml's algorithm, which the
// Python writer implements separately), and f16 where a row is not whole Q8_0 blocks.
TEST(GGUFModel, TensorsAreTheSafetensorsOnesBitForBitInEachFormat) {
  const WeightsRegistry reference = load_safetensors(kTiny);
  for (const std::string type : {"f32", "f16", "q8_0", "q4_0"}) {
    SCOPED_TRACE(type);
    const GGUFFile file = GGUFFile::open(tiny_gguf(type));
    const ModelInfo info = gguf_model_info(file);
    const WeightsRegistry weights = gguf_weights(file, info, gguf_weight_format(file));
    EXPECT_EQ(weights.size(), reference.size() - (info.config.tie_word_embeddings && reference.contains("lm_head.weight")));
    for (const auto& [name, tensor] : weights) {
      SCOPED_TRACE(name);
      ASSERT_TRUE(reference.contains(name));
      const Tensor& r = reference.at(name);
      ASSERT_EQ(r.dtype(), DType::f32);
      const std::vector<float> x = r.to_vector<float>();
      const int64_t cols = r.shape().back();
      std::vector<uint8_t> want;
      if (type == "f32" || r.shape().size() == 1) {
        want = bytes_of(r);
        EXPECT_EQ(tensor.dtype(), DType::f32);
      } else if (type == "f16" || cols % 32 != 0) {
        EXPECT_EQ(tensor.dtype(), DType::f16);
        for (float v : x) {
          const uint16_t h = f32_to_f16(v);
          want.push_back(static_cast<uint8_t>(h & 0xff));
          want.push_back(static_cast<uint8_t>(h >> 8));
        }
      } else {
        EXPECT_EQ(tensor.dtype(), DType::u8);
        const auto encoding = type == "q8_0" ? graph::QuantizationEncoding::q8_0 : graph::QuantizationEncoding::q4_0;
        const int64_t rows = r.numel() / cols;
        const int64_t row_bytes = graph::quantized_row_bytes(encoding, cols);
        want.resize(static_cast<size_t>(rows * row_bytes));
        for (int64_t i = 0; i < rows; ++i)
          graph::quantize_row(encoding, x.data() + i * cols, cols, want.data() + i * row_bytes);
      }
      EXPECT_TRUE(bytes_of(tensor) == want);
    }
  }
}

// The strongest check of names, un-permuting and config together: PyTorch's greedy ids
// (tests/data/kiln_tiny_greedy.json, as TextGeneration.KilnTinyGreedyMatchesPyTorchReference uses)
// from the f32 GGUF file alone, its embedded vocabulary included.
TEST(GGUFModel, KilnTinyFromGGUFAloneGivesPyTorchGreedyIds) {
  const fs::path reference = kRoot / "tests" / "data" / "kiln_tiny_greedy.json";
  auto pipe = TextGenerationPipeline::from_dir(tiny_gguf("f32"));
  std::ifstream in(reference);
  const nlohmann::json doc = nlohmann::json::parse(in);
  EXPECT_EQ(pipe.eos_token_ids(), (std::vector<int64_t>{doc.at("eos_token_id").get<int64_t>()}));
  const GenerationOptions greedy{.max_new_tokens = doc.at("max_new_tokens").get<int64_t>(), .temperature = 0.0};
  ASSERT_FALSE(doc.at("cases").empty());
  for (const auto& c : doc.at("cases")) {
    const std::string prompt = c.at("prompt");
    EXPECT_EQ(pipe.tokenizer()->encode(prompt), c.at("prompt_ids").get<std::vector<int64_t>>()) << prompt;
    const GenerationResult r = pipe.generate(prompt, greedy);
    EXPECT_EQ(r.ids, c.at("generated_ids").get<std::vector<int64_t>>()) << prompt;
    EXPECT_EQ(prompt + r.text, c.at("text").get<std::string>()) << prompt;
  }
}

// A quantized file computes its own format by default (no option given) and gives the tokens of the
// safetensors model quantized to that format at load (the same bytes, so the same ids).
TEST(GGUFModel, QuantizedFilesGenerateAsTheSafetensorsModelQuantizedAtLoad) {
  for (const auto& [type, format] : {std::pair{"q8_0", nn::WeightFormat::q8_0}, std::pair{"q4_0", nn::WeightFormat::q4_0}}) {
    SCOPED_TRACE(type);
    auto from_gguf = TextGenerationPipeline::from_dir(tiny_gguf(type));
    auto from_dir = TextGenerationPipeline::from_dir(kTiny, {.weight_format = format});
    const GenerationOptions greedy{.max_new_tokens = 24, .temperature = 0.0};
    for (const char* prompt : {"Once upon a time", "The little dog"})
      EXPECT_EQ(from_gguf.generate(prompt, greedy).ids, from_dir.generate(prompt, greedy).ids) << prompt;
  }
}

// Why this CPU's kernels pack no matrix of a `type` file at init; empty when they pack them.
std::string why_nothing_is_packed(const std::string& type) {
  if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) return "no AVX2 (the portable GEMM packs nothing)";
  if (type == "q8_0" && (!__builtin_cpu_supports("avx512vnni") || !__builtin_cpu_supports("avx512bw")))
    return "no AVX512-VNNI (the Q8_0 GEMV reads the file's rows)";
  return "";
}

// Every matrix of the model runs on a copy packed at init where its kernel packs one (f32 and f16:
// the SIMD GEMM's panels, on AVX2 or AVX-512; Q8_0: the VNNI GEMM's), decode's single row included,
// so each is listed by Model::copied_weights and its pages of the file leave the process: the
// file's matrices are held once, as panels. The tokens stay the safetensors model's (the tests above).
TEST(GGUFModel, MatricesPackedAtInitAreNotAlsoHeldAsTheFilesPages) {
  for (const char* type : {"f32", "q8_0"}) {
    SCOPED_TRACE(type);
    if (const std::string why = why_nothing_is_packed(type); !why.empty()) {
      std::cout << "skipped for " << type << ": " << why << "\n";
      continue;
    }
    const fs::path path = tiny_gguf(type);
    const size_t file_bytes = fs::file_size(path);
    size_t matrix_bytes = 0;  // the embedding (tied: also the output projection) and the layers' projections
    {
      const GGUFFile file = GGUFFile::open(path);  // unmapped before the pipeline's mapping is measured
      for (const GGUFTensor& t : file.tensors())
        if (t.dims.size() == 2) matrix_bytes += t.data.size();
    }
    auto pipe = TextGenerationPipeline::from_dir(path);
    const size_t resident = resident_bytes_of(path);
    std::vector<std::string> expected = {"model.embed_tokens.weight"};
    for (int i = 0; i < 4; ++i)
      for (const char* m : {"mlp.down_proj", "mlp.gate_proj", "mlp.up_proj", "self_attn.k_proj", "self_attn.o_proj",
                            "self_attn.q_proj", "self_attn.v_proj"})
        expected.push_back(fmt::format("model.layers.{}.{}.weight", i, m));  // q8_0's down_proj (rows of 344) is f16
    std::sort(expected.begin(), expected.end());
    EXPECT_EQ(pipe.engine().models().at("model").copied_weights(), expected);
    // Packing read every page of them; without the drop the whole file stays resident. With it, the
    // rest of the file (metadata, norms) and the pages a matrix shares with a neighbour stay, and the
    // kernel may map back a few neighbours of a page it faults in (fault-around): half the matrices'
    // bytes is well clear of both. (q8_0: 606 KB of a 1279 KB file whose Q8_0 tensors are 862 KB.)
    EXPECT_LE(resident + matrix_bytes / 2, file_bytes) << "resident " << resident << " of " << file_bytes;
  }
}

// Every packed copy of a file's matrices goes to the packed-weight cache (KILN_CACHE_DIR/weights),
// and the q/k rows un-permuted at load (copies of the file's rows) too, and the next load maps each entry
// (a hit marks it used: its mtime) and generates the same greedy ids.
TEST(GGUFModel, SecondLoadMapsEveryPackedMatrixFromTheWeightCache) {
  for (const char* type : {"f32", "q8_0"}) {
    SCOPED_TRACE(type);
    if (const std::string why = why_nothing_is_packed(type); !why.empty()) {
      std::cout << "skipped for " << type << ": " << why << "\n";
      continue;
    }
    kiln::testing::TempDir cache("weight-cache");
    kiln::testing::ScopedEnv env("KILN_CACHE_DIR", cache.path().c_str());
    const fs::path path = tiny_gguf(type);
    const GenerationOptions greedy{.max_new_tokens = 16, .temperature = 0.0};
    auto entries = [&] {
      std::vector<fs::path> files;
      for (const auto& e : fs::directory_iterator(cache.path() / "weights"))
        if (e.path().extension() == ".kpack") files.push_back(e.path());
      return files;
    };
    std::vector<int64_t> first;
    size_t packed = 0, unpermuted = 0;
    {
      auto pipe = TextGenerationPipeline::from_dir(path);
      first = pipe.generate("Once upon a time", greedy).ids;
      for (const std::string& name : pipe.engine().models().at("model").copied_weights()) {
        ++packed;
        unpermuted += name.ends_with("q_proj.weight") || name.ends_with("k_proj.weight");
      }
    }
    ASSERT_GT(packed, 0u);
    ASSERT_EQ(entries().size(), packed + unpermuted) << "each packed matrix, and each un-permuted q/k copy";
    const auto long_ago = fs::file_time_type::clock::now() - std::chrono::hours(1);
    for (const fs::path& f : entries()) fs::last_write_time(f, long_ago);
    auto pipe = TextGenerationPipeline::from_dir(path);
    EXPECT_EQ(pipe.generate("Once upon a time", greedy).ids, first);
    EXPECT_EQ(entries().size(), packed + unpermuted) << "nothing packed again";
    for (const fs::path& f : entries()) EXPECT_GT(fs::last_write_time(f), long_ago) << f << " was not used";
  }
}

// A file that mixes formats (Q4_0, with token_embd and attn_v in Q8_0, as llama.cpp's _M types
// keep some matrices at more bits) runs as stored: each matrix zero-copy in its own format, no
// matrix requantized, and the tokens of the safetensors model quantized at load to that same mix.
TEST(GGUFModel, MixedFormatFileRunsEachMatrixAsStored) {
  const GGUFFile file = GGUFFile::open(tiny_gguf("q4_0_mixed"));
  const nn::WeightFormat main = gguf_weight_format(file);
  EXPECT_EQ(main, nn::WeightFormat::q4_0);
  const nn::WeightFormatMap mix = gguf_weight_formats(file, main);
  ModelInfo info = gguf_model_info(file);
  const nn::LlamaConfig& c = info.config;
  // The embedding and every layer's v_proj; no other matrix (down_proj's rows of 344 are f16 in the
  // file, which is what q4_0's fallback gives them too).
  ASSERT_EQ(mix.size(), static_cast<size_t>(1 + c.num_hidden_layers));
  EXPECT_EQ(mix.at("model.embed_tokens.weight"), nn::WeightFormat::q8_0);
  for (int64_t i = 0; i < c.num_hidden_layers; ++i)
    EXPECT_EQ(mix.at(fmt::format("model.layers.{}.self_attn.v_proj.weight", i)), nn::WeightFormat::q8_0);

  // Each stored matrix is a view of the file's bytes: none was dequantized and requantized.
  info.config.weight_formats = mix;
  const WeightsRegistry weights = gguf_weights(file, info, main);
  for (const auto& [hf, gguf] : {std::pair{"model.embed_tokens.weight", "token_embd.weight"},
                                 std::pair{"model.layers.0.self_attn.v_proj.weight", "blk.0.attn_v.weight"},
                                 std::pair{"model.layers.1.mlp.up_proj.weight", "blk.1.ffn_up.weight"}})
    EXPECT_EQ(weights.at(hf).data(), static_cast<const void*>(file.find_tensor(gguf)->data.data())) << hf;
  // The model declares each matrix in its own format: v_proj's rows are Q8_0's, up_proj's Q4_0's.
  nn::LlamaConfig as_run = info.config;  // as GenerationEngine::from_dir builds it
  as_run.weight_format = main;
  const auto declared = nn::Transformer(as_run).raw_state_dict();
  EXPECT_EQ(declared.at("model.layers.0.self_attn.v_proj.weight").shape.static_dims().back(),
            graph::quantized_row_bytes(graph::QuantizationEncoding::q8_0, c.hidden_size));
  EXPECT_EQ(declared.at("model.layers.0.mlp.up_proj.weight").shape.static_dims().back(),
            graph::quantized_row_bytes(graph::QuantizationEncoding::q4_0, c.hidden_size));

  // The same mix asked of the safetensors model, quantized at load, gives the same tokens.
  nn::LlamaConfig mixed_config = load_model_info(kTiny).config;
  mixed_config.weight_formats = mix;
  auto from_gguf = TextGenerationPipeline::from_dir(tiny_gguf("q4_0_mixed"));
  auto from_dir = TextGenerationPipeline::from_config(mixed_config, load_safetensors(kTiny), Tokenizer::load(kTiny),
                                                      load_model_info(kTiny).eos_token_ids,
                                                      {.weight_format = nn::WeightFormat::q4_0});
  const GenerationOptions greedy{.max_new_tokens = 24, .temperature = 0.0};
  for (const char* prompt : {"Once upon a time", "The little dog", "She said"})
    EXPECT_EQ(from_gguf.generate(prompt, greedy).ids, from_dir.generate(prompt, greedy).ids) << prompt;

  // Asking for one format requantizes every matrix to it, as before.
  auto as_q8_0 = TextGenerationPipeline::from_dir(tiny_gguf("q4_0_mixed"), {.weight_format = nn::WeightFormat::q8_0});
  EXPECT_EQ(as_q8_0.generate("Once upon a time", greedy).ids.size(), 24u);
}

// Llama 3.1+'s rope scaling, as llama.cpp's converter writes it: a rope_freqs.weight tensor of
// divisors, one per frequency, and no metadata. kiln-tiny with `rope_scaling` llama3 in its
// config.json (original context 64, so the scaling reaches most of its frequencies) and the GGUF
// written from it give the same rope frequencies (within f32's rounding of the factors) and the same
// greedy ids.
TEST(GGUFModel, RopeFreqsTensorIsLlama3RopeScaling) {
  const fs::path dir = scratch_dir() / "kiln-tiny-llama3-rope";
  fs::create_directories(dir);
  fs::copy(kTiny, dir, fs::copy_options::recursive | fs::copy_options::overwrite_existing);
  nlohmann::json config = nlohmann::json::parse(std::ifstream(dir / "config.json"));
  config["rope_scaling"] = {{"rope_type", "llama3"}, {"factor", 8.0}, {"low_freq_factor", 1.0},
                            {"high_freq_factor", 4.0}, {"original_max_position_embeddings", 64}};
  std::ofstream(dir / "config.json") << config.dump(2);

  const fs::path gguf = tiny_gguf("f32", dir);
  const ModelInfo info = gguf_model_info(GGUFFile::open(gguf));
  const ModelInfo reference = load_model_info(dir);
  ASSERT_TRUE(reference.config.rope_scaling.has_value());
  EXPECT_FALSE(info.config.rope_scaling.has_value());
  const int64_t rotary = info.config.rotary_dim();
  ASSERT_EQ(info.config.rope_freq_factors.size(), static_cast<size_t>(rotary / 2));
  const nn::RotaryEmbedding from_factors(rotary, info.config.rope_theta, 64, std::nullopt, 1.0,
                                         info.config.rope_freq_factors);
  const nn::RotaryEmbedding from_scaling(rotary, reference.config.rope_theta, 64, reference.config.rope_scaling);
  int scaled = 0;
  for (int64_t i = 0; i < rotary / 2; ++i) {
    const double want = from_scaling.inv_freq()[static_cast<size_t>(i)];
    EXPECT_NEAR(from_factors.inv_freq()[static_cast<size_t>(i)], want, 1e-6 * want) << "frequency " << i;
    scaled += info.config.rope_freq_factors[static_cast<size_t>(i)] != 1.0;
  }
  EXPECT_GT(scaled, rotary / 4) << "the scaling should reach most frequencies";

  auto from_gguf = TextGenerationPipeline::from_dir(gguf);
  auto from_dir = TextGenerationPipeline::from_dir(dir);
  const GenerationOptions greedy{.max_new_tokens = 24, .temperature = 0.0};
  for (const char* prompt : {"Once upon a time", "The little dog"})
    EXPECT_EQ(from_gguf.generate(prompt, greedy).ids, from_dir.generate(prompt, greedy).ids) << prompt;

  // Bad factors are refused naming the tensor; so is a config that sets both forms of the scaling.
  nn::LlamaConfig both = info.config;
  both.rope_scaling = reference.config.rope_scaling;
  testing::expect_error<ValueError>([&] { both.validate(); }, {"rope_freq_factors", "rope_scaling"});
  nn::LlamaConfig short_factors = info.config;
  short_factors.rope_freq_factors.pop_back();
  testing::expect_error<ValueError>([&] { short_factors.validate(); }, {"rope_freq_factors", "expected one per"});
}

// An exception must name a matrix of the model, and the mix a model is given is checked.
TEST(GGUFModel, WeightFormatExceptionsNameAMatrixOfTheModel) {
  nn::LlamaConfig c = load_model_info(kTiny).config;
  c.weight_formats = {{"model.layers.0.mlp.gate_projj.weight", nn::WeightFormat::q8_0}};
  testing::expect_error<ValueError>([&] { nn::Transformer model(c); }, {"model.layers.0.mlp.gate_projj.weight", "q8_0",
                                                                       "not a weight matrix"});
  c.weight_formats = {{"model.norm.weight", nn::WeightFormat::q8_0}};
  testing::expect_error<ValueError>([&] { nn::Transformer model(c); }, {"model.norm.weight"});
  c.weight_formats = {{"lm_head.weight", nn::WeightFormat::q8_0}};  // tied: kiln-tiny has no lm_head
  if (c.tie_word_embeddings) testing::expect_error<ValueError>([&] { nn::Transformer model(c); }, {"lm_head.weight"});
}

// What the file cannot be is refused before any graph is built, naming the key or the tensor.
TEST(GGUFModel, RefusalsNameTheKeyOrTheTensor) {
  const fs::path dir = tiny_gguf("f32").parent_path();
  const auto rewrite = [&](const std::string& name, const std::string& from, const std::string& to) {
    // Same-length edits of a key's or tensor's bytes keep every offset valid.
    EXPECT_EQ(from.size(), to.size());
    std::ifstream in(tiny_gguf("f32"), std::ios::binary);
    std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    const size_t at = bytes.find(from);
    EXPECT_NE(at, std::string::npos) << from;
    bytes.replace(at, from.size(), to);
    const fs::path out = dir / name;
    std::ofstream(out, std::ios::binary) << bytes;
    return out;
  };
  kiln::testing::expect_error<LoadError>(
      [&] { TextGenerationPipeline::from_dir(rewrite("gpt2.gguf", std::string("\x05\0\0\0\0\0\0\0llama", 13),
                                                     std::string("\x05\0\0\0\0\0\0\0gpt2x", 13))); },
      std::vector<std::string>{"general.architecture is 'gpt2x'", "supported: llama, qwen2, qwen3"});
  kiln::testing::expect_error<LoadError>(
      [&] { TextGenerationPipeline::from_dir(rewrite("no-ffn.gguf", "blk.3.ffn_up.weight", "blk.3.ffn_xx.weight")); },
      std::vector<std::string>{"no tensor 'blk.3.ffn_up.weight'"});
}

}  // namespace
}  // namespace kiln::pipelines
