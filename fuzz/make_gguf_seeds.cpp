// fuzz_make_gguf_seeds OUT_DIR: writes the GGUF seed corpus (fuzz/corpus/gguf) with the tests' byte-level
// writer (tests/pipelines/gguf_writer.h): valid files of both versions, every value type, nested
// arrays, custom alignments and every ggml type kiln reads, and a few files each check refuses.
#include <cstdio>
#include <filesystem>

#include "pipelines/gguf_writer.h"

namespace w = kiln::testing::gguf_writer;
using kiln::pipelines::GGMLType;
using kiln::pipelines::GGUFValueType;

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
