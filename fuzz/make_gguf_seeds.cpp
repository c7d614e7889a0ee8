// fuzz_make_gguf_seeds OUT_DIR: writes the GGUF seed corpus (fuzz/corpus/gguf) with the tests' byte-level
// writer (tests/pipelines/gguf_writer.h): valid files of both versions, every value type, nested
// arrays, custom alignments and every ggml type kiln reads, and a few files each check refuses.
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>
#include <filesystem>

#include "pipelines/gguf_writer.h"

namespace w = kiln::testing::gguf_writer;
using kiln::pipelines::GGMLType;
using kiln::pipelines::GGUFValueType;

// A whole model small enough to fuzz, so inputs reach the config, every tensor check and the
// tokenizer: one layer, hidden 32, 2 heads of 16 over 1 kv head, feed-forward 64, 8 tokens of a
// "llama" (SentencePiece-style) vocabulary, tied embeddings; q8_0 projections, f32 norms and
// embeddings. `arch`: llama, or gemma3 (its four norms, q/k norms and a window).
w::Spec tiny_model(const std::string& arch) {
  w::Spec s;
  const auto key = [&](const std::string& k, w::Value v) { s.metadata.push_back({arch + "." + k, std::move(v)}); };
  s.metadata.push_back({"general.architecture", w::str(arch)});
  key("context_length", w::u32(64));
  key("embedding_length", w::u32(32));
  key("block_count", w::u32(1));
  key("feed_forward_length", w::u32(64));
  key("attention.head_count", w::u32(2));
  key("attention.head_count_kv", w::u32(1));
  key("attention.key_length", w::u32(16));
  key("attention.value_length", w::u32(16));
  key("attention.layer_norm_rms_epsilon", w::f32(1e-5f));
  key("rope.freq_base", w::f32(10000.0f));
  if (arch == "gemma3") {
    key("attention.sliding_window", w::u32(4));
    key("attention.sliding_window_pattern", w::u32(2));
  }
  std::vector<w::Value> tokens, scores, types;
  const char* pieces[] = {"<unk>", "<s>", "</s>", "\xe2\x96\x81", "H", "e", "l", "o"};
  for (int i = 0; i < 8; ++i) {
    tokens.push_back(w::str(pieces[i]));
    scores.push_back(w::f32(-static_cast<float>(i)));
    types.push_back(w::i32(i == 0 ? 2 : i < 3 ? 3 : 1));
  }
  s.metadata.push_back({"tokenizer.ggml.model", w::str("llama")});
  s.metadata.push_back({"tokenizer.ggml.tokens", w::array(GGUFValueType::string, tokens)});
  s.metadata.push_back({"tokenizer.ggml.scores", w::array(GGUFValueType::f32, scores)});
  s.metadata.push_back({"tokenizer.ggml.token_type", w::array(GGUFValueType::i32, types)});
  s.metadata.push_back({"tokenizer.ggml.bos_token_id", w::u32(1)});
  s.metadata.push_back({"tokenizer.ggml.eos_token_id", w::u32(2)});
  uint8_t seed = 0;
  const auto f32 = [&](const std::string& name, std::vector<uint64_t> dims) {
    uint64_t n = 1;
    for (uint64_t d : dims) n *= d;
    std::string bytes(n * 4, '\0');
    for (uint64_t i = 0; i < n; ++i) {  // small finite values
      const float v = static_cast<float>((i * 37 + seed) % 17) / 16.0f - 0.5f;
      std::memcpy(bytes.data() + 4 * i, &v, 4);
    }
    ++seed;
    s.tensors.emplace_back(name, std::move(dims), GGMLType::f32, std::move(bytes));
  };
  const auto q8 = [&](const std::string& name, uint64_t cols, uint64_t rows) {
    std::string bytes = w::pattern(cols / 32 * 34 * rows, ++seed);
    for (uint64_t b = 0; b < cols / 32 * rows; ++b) bytes[b * 34] = 0, bytes[b * 34 + 1] = 0x20;  // f16 scales 2^-7
    s.tensors.emplace_back(name, std::vector<uint64_t>{cols, rows}, GGMLType::q8_0, std::move(bytes));
  };
  f32("token_embd.weight", {32, 8});
  f32("output_norm.weight", {32});
  f32("blk.0.attn_norm.weight", {32});
  f32("blk.0.ffn_norm.weight", {32});
  if (arch == "gemma3") {
    f32("blk.0.post_attention_norm.weight", {32});
    f32("blk.0.post_ffw_norm.weight", {32});
    f32("blk.0.attn_q_norm.weight", {16});
    f32("blk.0.attn_k_norm.weight", {16});
  }
  q8("blk.0.attn_q.weight", 32, 32);
  q8("blk.0.attn_k.weight", 32, 16);
  q8("blk.0.attn_v.weight", 32, 16);
  q8("blk.0.attn_output.weight", 32, 32);
  q8("blk.0.ffn_gate.weight", 32, 64);
  q8("blk.0.ffn_up.weight", 32, 64);
  q8("blk.0.ffn_down.weight", 64, 32);
  return s;
}

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s OUT_DIR\n", argv[0]);
    return 2;
  }
  const std::filesystem::path out = argv[1];
  std::filesystem::create_directories(out);
  auto put = [&](const char* name, const w::Spec& spec) { w::write_file(out / name, w::build(spec).bytes); };

  put("sample_v3.gguf", w::sample_spec(3));
  put("sample_v2.gguf", w::sample_spec(2));
  w::Spec aligned = w::sample_spec(3);
  aligned.alignment = 64;
  aligned.metadata.push_back({"general.alignment", w::u32(64)});
  put("align64.gguf", aligned);
  w::Spec packed = w::sample_spec(3);
  packed.alignment = 1;
  packed.metadata.push_back({"general.alignment", w::u32(1)});
  put("align1.gguf", packed);

  w::Spec meta;
  meta.metadata = {{"general.architecture", w::str("llama")}, {"llama.block_count", w::u32(2)}};
  put("metadata_only.gguf", meta);
  put("tiny_llama.gguf", tiny_model("llama"));
  put("tiny_gemma3.gguf", tiny_model("gemma3"));
  put("empty.gguf", w::Spec{});

  w::Value deep = w::array(GGUFValueType::i8, {w::i8(-1), w::i8(2)});
  for (int i = 0; i < 3; ++i) deep = w::array(GGUFValueType::array, {deep, deep});
  put("nested.gguf", [&] {
    w::Spec s;
    s.metadata = {{"test.deep", deep}};
    return s;
  }());

  // One tensor of each ggml type kiln reads, one block each (a row of 32 for the 32-blocks).
  w::Spec types;
  const std::pair<GGMLType, std::pair<uint64_t, size_t>> all[] = {
      {GGMLType::f32, {2, 8}},      {GGMLType::f16, {2, 4}},      {GGMLType::bf16, {2, 4}},
      {GGMLType::q4_0, {32, 18}},   {GGMLType::q4_1, {32, 20}},   {GGMLType::q5_0, {32, 22}},
      {GGMLType::q5_1, {32, 24}},   {GGMLType::q8_0, {32, 34}},   {GGMLType::q8_1, {32, 36}},
      {GGMLType::q2_k, {256, 84}},  {GGMLType::q3_k, {256, 110}}, {GGMLType::q4_k, {256, 144}},
      {GGMLType::q5_k, {256, 176}}, {GGMLType::q6_k, {256, 210}}, {GGMLType::q8_k, {256, 292}},
  };
  uint8_t i = 0;
  for (const auto& [type, shape] : all) {
    ++i;
    types.tensors.emplace_back("t" + std::to_string(i), std::vector<uint64_t>{shape.first}, type, w::pattern(shape.second, i));
  }
  put("all_types.gguf", types);

  // Refused files, each near the check it trips.
  w::Spec overlap;
  overlap.tensors.emplace_back("a", std::vector<uint64_t>{12}, GGMLType::f32, w::pattern(48), 0);
  overlap.tensors.emplace_back("b", std::vector<uint64_t>{8}, GGMLType::f32, w::pattern(32), 32);
  put("overlap.gguf", overlap);
  w::Spec huge;
  huge.tensors.emplace_back("h", std::vector<uint64_t>{uint64_t{1} << 32, uint64_t{1} << 32}, GGMLType::f32, "");
  put("huge_dims.gguf", huge);
  w::Spec count = w::sample_spec(3);
  count.tensor_count = uint64_t{1} << 19;
  put("huge_count.gguf", count);
  w::Spec align_bad = w::sample_spec(3);
  align_bad.metadata.push_back({"general.alignment", w::u32(48)});
  put("bad_alignment.gguf", align_bad);
  w::Spec dup = w::sample_spec(3);
  dup.metadata.push_back({"test.u8", w::u8(1)});
  put("duplicate_key.gguf", dup);
  const std::string whole = w::build(w::sample_spec(3)).bytes;
  w::write_file(out / "truncated.gguf", whole.substr(0, whole.size() / 2));
  return 0;
}
