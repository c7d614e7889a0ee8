// GGUF reader: valid files round-trip (every value type, arrays, nested arrays, v2 and v3, custom
// alignment, tensor views at the right bytes), hostile files are refused with a LoadError naming the
// file, what is wrong and the byte (one test per llama.cpp GGUF CVE class, and a file cut at every
// byte), and an independent reader (@huggingface/gguf, tests/tools/gguf_dump.mjs) agrees with kiln.
// Files are written byte by byte with tests/pipelines/gguf_writer.h, which shares no code with the
// reader.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "kiln/errors.h"
#include "kiln/pipelines/gguf.h"
#include "pipelines/gguf_writer.h"
#include "pipelines/json_oracle.h"
#include "test_util.h"

using namespace kiln;
using namespace kiln::pipelines;
using namespace kiln::testing::gguf_writer;
namespace fs = std::filesystem;
using json = nlohmann::json;
using kiln::testing::error_message;

namespace {

class GGUF : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::temp_directory_path() / fmt::format("kiln_gguf_{}_{}", info->name(), ::getpid());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  fs::path write(const std::string& bytes, const std::string& name = "model.gguf") {
    const fs::path p = dir_ / name;
    write_file(p, bytes);
    return p;
  }
  GGUFFile open(const std::string& bytes) { return GGUFFile::open(write(bytes)); }

  // open() must refuse `bytes` with "load_gguf: FILE: ..." containing every fragment and, when `at`
  // is given, ending in "(at byte AT)".
  void expect_refused(const std::string& bytes, const std::vector<std::string>& fragments,
                      std::optional<uint64_t> at = std::nullopt) {
    const fs::path p = write(bytes, "bad.gguf");
    const std::string msg = error_message<LoadError>([&] { GGUFFile::open(p); });
    EXPECT_EQ(msg.rfind("load_gguf: " + p.string() + ": ", 0), 0u) << msg;
    for (const std::string& f : fragments) EXPECT_NE(msg.find(f), std::string::npos) << "missing '" << f << "' in: " << msg;
    if (at) {
      const std::string tail = fmt::format("(at byte {})", *at);
      EXPECT_TRUE(msg.size() >= tail.size() && msg.compare(msg.size() - tail.size(), tail.size(), tail) == 0)
          << "expected to end in '" << tail << "': " << msg;
    }
  }

  fs::path dir_;
};

Spec one_key(const std::string& key, Value v) {
  Spec s;
  s.metadata = {{key, std::move(v)}};
  return s;
}

Spec one_tensor(std::vector<uint64_t> dims, uint32_t type, std::string data = "", std::optional<uint64_t> offset = {}) {
  Spec s;
  s.tensors.emplace_back("t", std::move(dims), type, std::move(data), offset);
  return s;
}
Spec one_tensor(std::vector<uint64_t> dims, GGMLType type, std::string data = "") {
  return one_tensor(std::move(dims), static_cast<uint32_t>(type), std::move(data));
}

std::string as_string(std::span<const uint8_t> s) { return {reinterpret_cast<const char*>(s.data()), s.size()}; }

}  // namespace

// ==== valid files ================================================================================

TEST_F(GGUF, BlockSizesMatchGgmlTypeTraits) {
  struct Row {
    GGMLType type;
    const char* name;
    int64_t block, bytes;
  };
  const Row rows[] = {
      {GGMLType::f32, "F32", 1, 4},       {GGMLType::f16, "F16", 1, 2},       {GGMLType::bf16, "BF16", 1, 2},
      {GGMLType::q4_0, "Q4_0", 32, 18},   {GGMLType::q4_1, "Q4_1", 32, 20},   {GGMLType::q5_0, "Q5_0", 32, 22},
      {GGMLType::q5_1, "Q5_1", 32, 24},   {GGMLType::q8_0, "Q8_0", 32, 34},   {GGMLType::q8_1, "Q8_1", 32, 36},
      {GGMLType::q2_k, "Q2_K", 256, 84},  {GGMLType::q3_k, "Q3_K", 256, 110}, {GGMLType::q4_k, "Q4_K", 256, 144},
      {GGMLType::q5_k, "Q5_K", 256, 176}, {GGMLType::q6_k, "Q6_K", 256, 210}, {GGMLType::q8_k, "Q8_K", 256, 292},
  };
  for (const Row& r : rows) {
    const auto id = static_cast<uint32_t>(r.type);
    EXPECT_EQ(ggml_block_size(id), r.block) << r.name;
    EXPECT_EQ(ggml_block_bytes(id), r.bytes) << r.name;
    EXPECT_EQ(ggml_type_name(r.type), r.name);
  }
  for (uint32_t unknown : {4u, 5u, 16u, 29u, 31u, 1000u}) {
    EXPECT_EQ(ggml_block_size(unknown), std::nullopt) << unknown;
    EXPECT_EQ(ggml_block_bytes(unknown), std::nullopt) << unknown;
  }
  EXPECT_EQ(gguf_value_type_name(GGUFValueType::boolean), "bool");
  EXPECT_EQ(gguf_value_type_name(GGUFValueType::string), "string");
  EXPECT_EQ(gguf_value_type_name(GGUFValueType::f64), "f64");
}

TEST_F(GGUF, ReadsEveryValueType) {
  const Built built = build(sample_spec());
  const GGUFFile f = open(built.bytes);
  EXPECT_EQ(f.version(), 3u);
  EXPECT_EQ(f.alignment(), 32u);
  EXPECT_EQ(f.metadata().size(), sample_spec().metadata.size());
  EXPECT_EQ(f.get_string("general.architecture"), "llama");
  EXPECT_EQ(f.get_string("general.name"), "kiln test \xff bytes");  // bytes kept as they are
  EXPECT_EQ(f.get_string("test.empty"), "");
  EXPECT_EQ(f.get_u64("test.u8"), 200u);
  EXPECT_EQ(f.get_i64("test.i8"), -100);
  EXPECT_EQ(f.get_u64("test.u16"), 60000u);
  EXPECT_EQ(f.get_i64("test.i16"), -30000);
  EXPECT_EQ(f.get_u64("test.u32"), 4000000000u);
  EXPECT_EQ(f.get_i64("test.u32"), 4000000000);  // an unsigned value that fits int64
  EXPECT_EQ(f.get_i64("test.i32"), -2000000000);
  EXPECT_EQ(f.get_u64("test.u64"), UINT64_MAX);
  EXPECT_EQ(f.get_i64("test.i64"), INT64_MIN);
  EXPECT_EQ(f.get_f64("test.f32"), 1.5);
  EXPECT_EQ(f.get_f64("test.f64"), -0.125);
  EXPECT_TRUE(f.get_bool("test.bool"));
  EXPECT_EQ(f.find_u64("test.u8"), 200u);
  EXPECT_EQ(f.find_u64("absent"), std::nullopt);
  EXPECT_EQ(f.find_f64("absent"), std::nullopt);
  EXPECT_EQ(f.find_bool("absent"), std::nullopt);
  EXPECT_EQ(f.find_string("absent"), std::nullopt);
  EXPECT_EQ(f.find_string("general.architecture"), "llama");
  EXPECT_FALSE(f.contains("absent"));

  // Declared types and offsets are kept.
  const GGUFValue* v = f.find("test.i16");
  ASSERT_NE(v, nullptr);
  EXPECT_EQ(v->type, GGUFValueType::i16);
  EXPECT_EQ(v->offset, built.at.at("value:test.i16") + 4);
  EXPECT_EQ(std::get<int64_t>(v->value), -30000);
  EXPECT_EQ(f.find("test.f32")->type, GGUFValueType::f32);
  EXPECT_EQ(f.find("test.bool")->type, GGUFValueType::boolean);
}

TEST_F(GGUF, ReadsArraysAndNestedArrays) {
  Spec s = sample_spec();
  // Four levels of arrays is the most kiln reads.
  s.metadata.push_back(
      {"test.deep", array(GGUFValueType::array,
                          {array(GGUFValueType::array, {array(GGUFValueType::array, {array(GGUFValueType::i8, {i8(-7)})})})})});
  s.metadata.push_back({"test.f64s", array(GGUFValueType::f64, {f64(0.5), f64(-2.0)})});
  s.metadata.push_back({"test.u64s", array(GGUFValueType::u64, {u64(1), u64(UINT64_MAX)})});
  const GGUFFile f = open(build(s).bytes);

  const std::vector<std::string_view> tokens = f.get_string_array("tokenizer.ggml.tokens");
  EXPECT_EQ(tokens, (std::vector<std::string_view>{"<s>", "</s>", "hello"}));
  EXPECT_EQ(f.get_f64_array("tokenizer.ggml.scores"), (std::vector<double>{0.0, -1.25, 3.0}));
  EXPECT_EQ(f.get_f64_array("tokenizer.ggml.token_type"), (std::vector<double>{3, 3, 1}));  // integers as doubles
  EXPECT_EQ(f.get_i64_array("tokenizer.ggml.token_type"), (std::vector<int64_t>{3, 3, 1}));
  EXPECT_EQ(f.get_f64_array("test.f64s"), (std::vector<double>{0.5, -2.0}));
  EXPECT_TRUE(f.get_i64_array("test.empty_array").empty());

  const GGUFValue* bools = f.find("test.bools");
  ASSERT_NE(bools, nullptr);
  EXPECT_EQ(bools->type, GGUFValueType::array);
  EXPECT_EQ(bools->element_type, GGUFValueType::boolean);
  const auto& b = std::get<std::vector<GGUFValue>>(bools->value);
  ASSERT_EQ(b.size(), 2u);
  EXPECT_FALSE(std::get<bool>(b[0].value));
  EXPECT_TRUE(std::get<bool>(b[1].value));

  const GGUFValue* nested = f.find("test.nested");
  ASSERT_NE(nested, nullptr);
  EXPECT_EQ(nested->element_type, GGUFValueType::array);
  const auto& outer = std::get<std::vector<GGUFValue>>(nested->value);
  ASSERT_EQ(outer.size(), 2u);
  EXPECT_EQ(outer[0].element_type, GGUFValueType::u16);
  const auto& inner = std::get<std::vector<GGUFValue>>(outer[0].value);
  ASSERT_EQ(inner.size(), 2u);
  EXPECT_EQ(std::get<uint64_t>(inner[1].value), 2u);
  EXPECT_EQ(outer[1].element_type, GGUFValueType::string);
  EXPECT_EQ(std::get<std::string>(std::get<std::vector<GGUFValue>>(outer[1].value)[0].value), "x");

  const GGUFValue* deep = f.find("test.deep");
  ASSERT_NE(deep, nullptr);
  const GGUFValue* level = deep;
  for (int i = 0; i < 4; ++i) level = &std::get<std::vector<GGUFValue>>(level->value).at(0);
  EXPECT_EQ(level->type, GGUFValueType::i8);
  EXPECT_EQ(std::get<int64_t>(level->value), -7);

  // get_i64_array refuses a u64 above INT64_MAX, naming the element.
  const std::string msg = error_message<LoadError>([&] { f.get_i64_array("test.u64s"); });
  EXPECT_NE(msg.find("key 'test.u64s'[1] is u64 18446744073709551615, more than INT64_MAX"), std::string::npos) << msg;
}

TEST_F(GGUF, ReadsVersions2And3Alike) {
  for (uint32_t version : {2u, 3u}) {
    const GGUFFile f = open(build(sample_spec(version)).bytes);
    EXPECT_EQ(f.version(), version);
    EXPECT_EQ(f.get_string("general.architecture"), "llama");
    EXPECT_EQ(f.tensors().size(), 4u);
  }
}

TEST_F(GGUF, TensorViewsPointAtTheirBytes) {
  const Spec spec = sample_spec();
  const Built built = build(spec);
  const GGUFFile f = open(built.bytes);
  const auto* base = static_cast<const uint8_t*>(f.mapping().get());
  ASSERT_NE(base, nullptr);
  ASSERT_EQ(f.tensors().size(), spec.tensors.size());
  EXPECT_EQ(built.at.at("data") % 32, 0u);
  for (size_t i = 0; i < spec.tensors.size(); ++i) {
    const auto& want = spec.tensors[i];
    const GGUFTensor& t = f.tensors()[i];  // file order
    EXPECT_EQ(t.name, want.name);
    EXPECT_EQ(&f.tensor(want.name), &t);
    EXPECT_EQ(f.find_tensor(want.name), &t);
    EXPECT_EQ(static_cast<uint32_t>(t.type), want.type);
    EXPECT_EQ(std::vector<uint64_t>(t.dims.begin(), t.dims.end()), want.dims);
    EXPECT_EQ(t.data.data(), base + built.at.at("bytes:" + want.name)) << want.name;
    EXPECT_EQ(t.offset, built.at.at("bytes:" + want.name) - built.at.at("data"));
    EXPECT_EQ(as_string(t.data), want.data) << want.name;
  }
  const GGUFTensor& q = f.tensor("blk.0.attn_q.weight");
  EXPECT_EQ(q.elements(), 64);
  EXPECT_EQ(q.shape(), (std::vector<int64_t>{2, 32}));  // row-major: dims reversed
  EXPECT_EQ(q.data.size(), 2u * 34u);
  EXPECT_EQ(f.tensor("blk.0.ffn_down.weight").data.size(), 144u);
  EXPECT_EQ(f.find_tensor("nope"), nullptr);
  const std::string msg = error_message<LoadError>([&] { f.tensor("nope"); });
  EXPECT_NE(msg.find("no tensor 'nope' (the file has 4 tensors: token_embd.weight, blk.0.attn_q.weight"), std::string::npos)
      << msg;
}

TEST_F(GGUF, ReadsEveryGgmlTypeAtItsBlockSize) {
  // Two rows of two blocks each: the view is 4 blocks long.
  Spec s;
  for (uint32_t id : {0u, 1u, 30u, 2u, 3u, 6u, 7u, 8u, 9u, 10u, 11u, 12u, 13u, 14u, 15u}) {
    const uint64_t block = static_cast<uint64_t>(*ggml_block_size(id));
    const size_t bytes = 4 * static_cast<size_t>(*ggml_block_bytes(id));
    s.tensors.emplace_back(fmt::format("t{}", id), std::vector<uint64_t>{2 * block, 2}, id,
                           pattern(bytes, static_cast<uint8_t>(id)));
  }
  const GGUFFile f = open(build(s).bytes);
  for (const auto& want : s.tensors) {
    const GGUFTensor& t = f.tensor(want.name);
    EXPECT_EQ(static_cast<uint32_t>(t.type), want.type);
    EXPECT_EQ(t.elements(), static_cast<int64_t>(4 * *ggml_block_size(want.type)));
    EXPECT_EQ(as_string(t.data), want.data) << ggml_type_name(t.type);
  }
}

TEST_F(GGUF, TensorViewsOutliveTheFileObject) {
  std::shared_ptr<void> mapping;
  std::span<const uint8_t> data;
  {
    const GGUFFile f = open(build(sample_spec()).bytes);
    mapping = f.mapping();
    data = f.tensor("token_embd.weight").data;
  }
  EXPECT_EQ(as_string(data), pattern(48, 1));
}

TEST_F(GGUF, HonoursACustomAlignment) {
  for (uint32_t alignment : {1u, 8u, 64u, 4096u}) {
    Spec s = sample_spec();
    s.alignment = alignment;
    s.metadata.push_back({"general.alignment", u32(alignment)});
    const Built built = build(s);
    const GGUFFile f = open(built.bytes);
    EXPECT_EQ(f.alignment(), alignment);
    EXPECT_EQ(built.at.at("data") % alignment, 0u);
    if (alignment == 1) {
      EXPECT_EQ(built.at.at("data"), built.at.at("infos_end"));
    }
    for (const auto& want : s.tensors) {
      const GGUFTensor& t = f.tensor(want.name);
      EXPECT_EQ(t.offset % alignment, 0u);
      EXPECT_EQ(as_string(t.data), want.data) << alignment << " " << want.name;
    }
  }
}

TEST_F(GGUF, ReadsAFileWithoutTensors) {
  // No tensors, so no data section: the file may end right after the metadata, unpadded.
  Spec s = one_key("general.architecture", str("llama"));
  const std::string bytes = build(s).bytes;
  EXPECT_NE(bytes.size() % 32, 0u);
  const GGUFFile f = open(bytes);
  EXPECT_TRUE(f.tensors().empty());
  EXPECT_EQ(f.get_string("general.architecture"), "llama");
  // And the smallest file: a header saying nothing.
  EXPECT_TRUE(open(build(Spec{}).bytes).metadata().empty());
}

TEST_F(GGUF, TypedGettersRefuseOtherTypes) {
  const Built built = build(sample_spec());
  const GGUFFile f = open(built.bytes);
  const std::string prefix = "load_gguf: " + (dir_ / "model.gguf").string() + ": ";
  auto check = [&](auto&& fn, const std::string& want) {
    const std::string msg = error_message<LoadError>(fn);
    EXPECT_EQ(msg.rfind(prefix, 0), 0u) << msg;
    EXPECT_NE(msg.find(want), std::string::npos) << "missing '" << want << "' in: " << msg;
  };
  check([&] { f.get_string("test.u32"); },
        fmt::format("key 'test.u32' is u32 4000000000, expected string (at byte {})", built.at.at("value:test.u32") + 4));
  check([&] { f.get_u64("general.architecture"); }, "key 'general.architecture' is string of 5 bytes, expected an integer");
  check([&] { f.get_u64("test.i8"); }, "key 'test.i8' is i8 -100, expected a non-negative integer");
  check([&] { f.get_i64("test.u64"); }, "key 'test.u64' is u64 18446744073709551615, expected an integer of at most INT64_MAX");
  check([&] { f.get_u64("test.f32"); }, "key 'test.f32' is f32 1.5, expected an integer");
  check([&] { f.get_f64("test.u8"); }, "key 'test.u8' is u8 200, expected f32 or f64");
  check([&] { f.get_bool("test.u8"); }, "key 'test.u8' is u8 200, expected bool");
  check([&] { f.get_string("test.bool"); }, "key 'test.bool' is bool true, expected string");
  check([&] { f.get_string_array("tokenizer.ggml.scores"); },
        "key 'tokenizer.ggml.scores' is array of f32 (3 elements), expected array of string");
  check([&] { f.get_i64_array("tokenizer.ggml.scores"); }, "expected an array of integers");
  check([&] { f.get_f64_array("tokenizer.ggml.tokens"); }, "expected an array of numbers");
  check([&] { f.get_f64_array("test.bools"); }, "is array of bool (2 elements), expected an array of numbers");
  check([&] { f.get_i64_array("test.u32"); }, "key 'test.u32' is u32 4000000000, expected an array of integers");
  check([&] { f.get_string("absent.key"); }, "no metadata key 'absent.key'");
  // find_* still refuses a present key of another type.
  check([&] { f.find_string("test.u32"); }, "expected string");
  check([&] { f.find_u64("general.architecture"); }, "expected an integer");
}

// ==== hostile files ==============================================================================

TEST_F(GGUF, RefusesBadHeaders) {
  expect_refused("", {"file is 0 bytes, shorter than the 24-byte GGUF header"}, 0);
  expect_refused(std::string("GGUF\x03\0\0\0\0\0", 10), {"file is 10 bytes, shorter than the 24-byte GGUF header"}, 0);
  std::string zip = build(Spec{}).bytes;
  zip.replace(0, 4, "PK\x03\x04");
  expect_refused(zip, {"not a GGUF file: the magic is 50 4b 03 04, expected 47 47 55 46 ('GGUF')"}, 0);

  Spec v1;
  v1.version = 1;
  expect_refused(build(v1).bytes, {"GGUF version 1 is not supported (kiln reads versions 2 and 3"}, 4);
  for (uint32_t v : {0u, 4u, 0x12345678u}) {
    Spec s;
    s.version = v;
    expect_refused(build(s).bytes, {fmt::format("GGUF version {} is not supported", v)}, 4);
  }
  // A big-endian file: its version 3 reads as 0x03000000 little-endian.
  std::string be = build(sample_spec()).bytes;
  be.replace(4, 4, std::string("\0\0\0\x03", 4));
  expect_refused(be, {"big-endian GGUF file (the version reads as 0x03000000, version 3 byte-swapped)",
                      "little-endian GGUF files only"},
                 4);

  const std::string missing = error_message<LoadError>([&] { GGUFFile::open(dir_ / "nope.gguf"); });
  EXPECT_NE(missing.find("load_gguf: " + (dir_ / "nope.gguf").string() + ": cannot open"), std::string::npos) << missing;
  const std::string dir = error_message<LoadError>([&] { GGUFFile::open(dir_); });
  EXPECT_NE(dir.find("not a regular file"), std::string::npos) << dir;
}

// CVE class 1: dims whose products overflow, dims[0] off the block size, dims < 1, more than 4 dims.
TEST_F(GGUF, RefusesOverflowingOrInvalidDims) {
  {
    const Built b = build(one_tensor({uint64_t{1} << 32, uint64_t{1} << 32}, GGMLType::f32));
    expect_refused(b.bytes, {"tensor 't': dims 4294967296 x 4294967296 have more than 9223372036854775807 (INT64_MAX) elements"},
                   b.at.at("dims:t") + 4 + 8);
  }
  {
    // 2^62 elements fit int64; their 2^64 bytes do not.
    const Built b = build(one_tensor({uint64_t{1} << 62}, GGMLType::f32));
    expect_refused(b.bytes, {"tensor 't' (F32): 4611686018427387904 elements are 4611686018427387904 blocks of 4 bytes, "
                             "which overflows int64"},
                   b.at.at("type:t"));
    const Built q = build(one_tensor({uint64_t{INT64_MAX} - 31}, GGMLType::q8_0));
    expect_refused(q.bytes, {"tensor 't' (Q8_0)", "blocks of 34 bytes, which overflows int64"}, q.at.at("type:t"));
  }
  {
    const Built b = build(one_tensor({33, 2}, GGMLType::q4_0, std::string(36, 'x')));
    expect_refused(b.bytes, {"tensor 't' (Q4_0): dims[0] = 33 is not a multiple of the block size 32"}, b.at.at("type:t"));
    const Built k = build(one_tensor({128}, GGMLType::q4_k, std::string(144, 'x')));
    expect_refused(k.bytes, {"tensor 't' (Q4_K): dims[0] = 128 is not a multiple of the block size 256"}, k.at.at("type:t"));
  }
  {
    const Built b = build(one_tensor({4, 0}, GGMLType::f32));
    expect_refused(b.bytes, {"tensor 't': dim 1 is 0, expected 1..9223372036854775807"}, b.at.at("dims:t") + 4 + 8);
    const Built neg = build(one_tensor({UINT64_MAX}, GGMLType::f32));  // -1 as int64
    expect_refused(neg.bytes, {"tensor 't': dim 0 is -1, expected 1.."}, neg.at.at("dims:t") + 4);
    const Built top = build(one_tensor({uint64_t{1} << 63}, GGMLType::f32));
    expect_refused(top.bytes, {"tensor 't': dim 0 is -9223372036854775808"}, top.at.at("dims:t") + 4);
  }
  {
    const Built b = build(one_tensor({1, 1, 1, 1, 1}, GGMLType::f32, "abcd"));
    expect_refused(b.bytes, {"tensor 't': 5 dims, GGUF allows at most 4"}, b.at.at("dims:t"));
    std::string huge = build(one_tensor({1}, GGMLType::f32, "abcd")).bytes;
    const Built ref = build(one_tensor({1}, GGMLType::f32, "abcd"));
    put_le(huge, ref.at.at("dims:t"), 0xFFFFFFFFu, 4);
    expect_refused(huge, {"tensor 't': 4294967295 dims"}, ref.at.at("dims:t"));
  }
}

// CVE class 2: counts and lengths far beyond what the file could hold, refused before any reserve.
TEST_F(GGUF, RefusesHugeCountsBehindATinyFile) {
  {
    Spec s;
    s.tensor_count = uint64_t{1} << 19;
    expect_refused(build(s).bytes, {"tensor count 524288 needs at least 12582912 bytes of tensor infos, the file has 0"}, 8);
    s.tensor_count = (uint64_t{1} << 20) + 1;
    expect_refused(build(s).bytes, {"tensor count 1048577 is more than the 1048576 kiln reads"}, 8);
    s.tensor_count = UINT64_MAX;
    expect_refused(build(s).bytes, {"tensor count 18446744073709551615 is more than"}, 8);
  }
  {
    // A tensor count the header's bytes allow but that the metadata leaves no room for.
    Spec s = one_key("k", str(std::string(100, 'x')));
    s.tensor_count = 4;
    const Built b = build(s);
    expect_refused(b.bytes, {"tensor count 4 (at byte 8) needs at least 96 bytes of tensor infos, the file has 0 after the metadata"},
                   b.at.at("infos_end"));
  }
  {
    Spec s;
    s.kv_count = uint64_t{1} << 40;
    expect_refused(build(s).bytes, {"metadata count 1099511627776 is more than the 1048576 keys kiln reads"}, 16);
    s.kv_count = 1000;
    expect_refused(build(s).bytes, {"metadata count 1000 needs at least 13000 bytes of metadata, the file has 0"}, 16);
  }
  {
    // An array of N u32 needs 4N bytes left...
    const Built b = build(one_key("a", array(GGUFValueType::u32, {u32(1), u32(2)}, uint64_t{1} << 20)));
    expect_refused(b.bytes, {"key 'a': array of 1048576 u32 elements needs at least 4194304 bytes, the file has 8 left"},
                   b.at.at("value:a") + 4 + 4);
    // ... and one of N strings 8N, even where N bytes are left.
    const Built s = build(one_key("a", array(GGUFValueType::string, {str(""), str(""), str(""), str(""), str("")}, 6)));
    expect_refused(s.bytes, {"key 'a': array of 6 string elements needs at least 48 bytes, the file has 40 left"},
                   s.at.at("value:a") + 4 + 4);
    // The absolute limit on values comes before the bytes.
    const Built many = build(one_key("a", array(GGUFValueType::u8, {}, (uint64_t{1} << 23) + 1)));
    expect_refused(many.bytes, {"key 'a': array of 8388609 u8 elements, more than the 8388608 metadata values kiln reads"},
                   many.at.at("value:a") + 4 + 4);
    const Built max = build(one_key("a", array(GGUFValueType::u8, {}, UINT64_MAX)));
    expect_refused(max.bytes, {"array of 18446744073709551615 u8 elements, more than"}, max.at.at("value:a") + 4 + 4);
  }
  {
    // String lengths: over the limit, or over what is left.
    Bytes b;
    b.raw("GGUF").u32(3).u64(0).u64(1).str("k").u32(static_cast<uint32_t>(GGUFValueType::string)).u64(uint64_t{1} << 60);
    expect_refused(b.data, {"key 'k' is 1152921504606846976 bytes long, more than the 67108864 kiln reads"}, 24 + 9 + 4);
    Bytes c;
    c.raw("GGUF").u32(3).u64(0).u64(1).str("k").u32(static_cast<uint32_t>(GGUFValueType::string)).u64(1000).raw("abc");
    expect_refused(c.data, {"key 'k' is 1000 bytes long, more than the 3 bytes left in the file"}, 24 + 9 + 4);
    Bytes key;
    key.raw("GGUF").u32(3).u64(0).u64(1).u64(70000).raw("abcdefghijklm");
    expect_refused(key.data, {"metadata key 0 is 70000 bytes long, more than the 65536 kiln reads"}, 24);
    Bytes name;
    name.raw("GGUF").u32(3).u64(1).u64(0).u64(UINT64_MAX).raw(std::string(20, 'x'));
    expect_refused(name.data, {"tensor 0 name is 18446744073709551615 bytes long, more than the 65536 kiln reads"}, 24);
  }
  {
    // Arrays nest at most 4 deep.
    Value v = array(GGUFValueType::u8, {u8(1)});
    for (int i = 0; i < 4; ++i) v = array(GGUFValueType::array, {v});
    const Built b = build(one_key("deep", v));
    expect_refused(b.bytes, {"key 'deep'[0][0][0][0]: arrays nest more than 4 deep"},
                   b.at.at("value:deep") + 4 + 4 * 12);
  }
}

// CVE class 3: offsets off the alignment, past the end, overlapping; the data section past the end.
TEST_F(GGUF, RefusesOutOfRangeOffsets) {
  {
    const Built b = build(one_tensor({4}, static_cast<uint32_t>(GGMLType::f32), pattern(16), 4));
    expect_refused(b.bytes, {"tensor 't': offset 4 is not a multiple of the alignment 32"}, b.at.at("offset:t"));
  }
  {
    Spec s = one_tensor({4}, static_cast<uint32_t>(GGMLType::f32), pattern(16));
    const Built ok = build(s);
    std::string bytes = ok.bytes;
    put_le(bytes, ok.at.at("offset:t"), uint64_t{1} << 20, 8);
    expect_refused(bytes, {"tensor 't': its 16 bytes at offset 1048576 of the data section", "end past the end of the file"},
                   ok.at.at("offset:t"));
    // Offsets near 2^64 must not wrap around into the file.
    put_le(bytes, ok.at.at("offset:t"), UINT64_MAX - 31, 8);
    expect_refused(bytes, {"at offset 18446744073709551584 of the data section", "end past the end of the file"},
                   ok.at.at("offset:t"));
    // The data one byte short.
    expect_refused(ok.bytes.substr(0, ok.bytes.size() - 1), {"its 16 bytes at offset 0", "end past the end"},
                   ok.at.at("offset:t"));
  }
  {
    Spec s;
    s.tensors.emplace_back("a", std::vector<uint64_t>{12}, GGMLType::f32, pattern(48), 0);
    s.tensors.emplace_back("b", std::vector<uint64_t>{8}, GGMLType::f32, pattern(32), 32);
    const Built b = build(s);
    expect_refused(b.bytes, {"tensor 'b': data section bytes [32, 64) overlap the bytes [0, 48) of tensor 'a'"},
                   b.at.at("offset:b"));
    // The same offset twice, listed in either order.
    Spec same;
    same.tensors.emplace_back("x", std::vector<uint64_t>{8}, GGMLType::f32, pattern(32), 64);
    same.tensors.emplace_back("y", std::vector<uint64_t>{8}, GGMLType::f32, pattern(32), 64);
    same.tensors.emplace_back("z", std::vector<uint64_t>{8}, GGMLType::f32, pattern(32), 0);
    expect_refused(build(same).bytes, {"overlap the bytes [64, 96) of tensor"});
  }
  {
    // The data section would start past the end: the file stops inside the padding after the infos.
    const Built b = build(one_tensor({4}, GGMLType::f32, pattern(16)));
    ASSERT_NE(b.at.at("infos_end"), b.at.at("data"));
    expect_refused(b.bytes.substr(0, b.at.at("infos_end") + 1),
                   {fmt::format("the data section starts at byte {} (the tensor infos end at byte {}, aligned to 32), "
                                "past the end of the file",
                                b.at.at("data"), b.at.at("infos_end"))},
                   b.at.at("infos_end"));
  }
}

// CVE class 4: type confusion in metadata and tensor types; general.alignment.
TEST_F(GGUF, RefusesTypeConfusion) {
  {
    Built b = build(one_key("k", u32(7)));
    put_le(b.bytes, b.at.at("value:k"), 13, 4);
    expect_refused(b.bytes, {"key 'k': unknown value type id 13 (GGUF's are 0..12)"}, b.at.at("value:k"));
    const Built e = build(one_key("k", array(static_cast<GGUFValueType>(99), {})));
    expect_refused(e.bytes, {"key 'k': unknown array element type id 99"}, e.at.at("value:k") + 4);
    const Built nested = build(one_key("k", array(GGUFValueType::array, {array(static_cast<GGUFValueType>(0xFFFFFFFF), {})})));
    expect_refused(nested.bytes, {"key 'k'[0]: unknown array element type id 4294967295"}, nested.at.at("value:k") + 4 + 4 + 8);
  }
  for (uint32_t id : {4u, 16u, 39u, 1000u}) {
    const Built b = build(one_tensor({32}, id, std::string(128, 'x')));
    expect_refused(b.bytes, {fmt::format("tensor 't': ggml type id {} is not one kiln reads (F32, F16, BF16, Q4_0", id)},
                   b.at.at("type:t"));
  }
  {
    const Built b = build(one_key("general.alignment", u64(64)));
    expect_refused(b.bytes, {"key 'general.alignment' is u64 64, expected u32"}, b.at.at("value:general.alignment") + 4);
    const Built s = build(one_key("general.alignment", str("32")));
    expect_refused(s.bytes, {"key 'general.alignment' is string of 2 bytes, expected u32"});
    for (uint32_t bad : {0u, 3u, 48u, 0xFFFFFFFFu}) {
      const Built a = build(one_key("general.alignment", u32(bad)));
      expect_refused(a.bytes, {fmt::format("key 'general.alignment' is {}, expected a power of two", bad)},
                     a.at.at("value:general.alignment") + 4);
    }
  }
  {
    Built b = build(one_key("flag", boolean(true)));
    b.bytes[b.at.at("value:flag") + 4] = 2;
    expect_refused(b.bytes, {"key 'flag': bool byte is 2, expected 0 or 1"}, b.at.at("value:flag") + 4);
  }
}

TEST_F(GGUF, RefusesDuplicateKeysAndTensorNames) {
  Spec s;
  s.metadata = {{"a", u32(1)}, {"b", u32(2)}, {"a", str("again")}};
  const Built b = build(s);
  // The writer's map holds the second "a"'s position.
  expect_refused(b.bytes, {"duplicate metadata key 'a' (entry 2 of 3)"}, b.at.at("key:a"));

  Spec t;
  t.tensors.emplace_back("w", std::vector<uint64_t>{4}, GGMLType::f32, pattern(16));
  t.tensors.emplace_back("v", std::vector<uint64_t>{4}, GGMLType::f32, pattern(16));
  t.tensors.emplace_back("w", std::vector<uint64_t>{4}, GGMLType::f32, pattern(16));
  const Built bt = build(t);
  expect_refused(bt.bytes, {"duplicate tensor name 'w' (tensors 0 and 2)"}, bt.at.at("tensor:w"));
}

TEST_F(GGUF, RefusesKeysAndNamesThatAreNotUtf8) {
  for (const std::string key : {"\xff", "bad\xc3", "\xc0\xaf", "\xed\xa0\x80", "\xf4\x90\x80\x80"}) {
    const Built b = build(one_key(key, u8(1)));
    expect_refused(b.bytes, {"metadata key 0 is not valid UTF-8"}, 24);
  }
  expect_refused(build(one_key("", u8(1))).bytes, {"metadata key 0 is empty"}, 24);
  expect_refused(build(one_key(std::string("a\0b", 3), u8(1))).bytes, {"metadata key 0 'a\\x00b' contains a NUL byte"}, 24);
  // Valid UTF-8 beyond ASCII is a key like any other.
  EXPECT_EQ(open(build(one_key("général.名前", u8(5))).bytes).get_u64("général.名前"), 5u);

  Spec t;
  t.tensors.emplace_back("w\xfe", std::vector<uint64_t>{4}, GGMLType::f32, pattern(16));
  const Built bt = build(t);
  expect_refused(bt.bytes, {"tensor 0 name is not valid UTF-8"}, 24);
}

// A valid file cut at every byte: always a LoadError (ASan would see a read past the mapping).
TEST_F(GGUF, RefusesTheFileCutAtEveryByte) {
  Spec spec = sample_spec(3);
  spec.metadata.push_back({"general.alignment", u32(64)});
  spec.alignment = 64;
  const std::string bytes = build(spec).bytes;
  ASSERT_NO_THROW(open(bytes));
  size_t refused = 0;
  for (size_t cut = 0; cut < bytes.size(); ++cut) {
    const fs::path p = write(bytes.substr(0, cut), "cut.gguf");
    try {
      GGUFFile::open(p);
      ADD_FAILURE() << "the file cut to " << cut << " of " << bytes.size() << " bytes was read";
    } catch (const LoadError& e) {
      ++refused;
      EXPECT_EQ(std::string(e.what()).rfind("load_gguf: " + p.string() + ": ", 0), 0u) << e.what();
    }
  }
  EXPECT_EQ(refused, bytes.size());
}

// ==== the oracle: @huggingface/gguf ==============================================================

namespace {

const char* const kBootstrap =
    "the GGUF oracle test needs node and @huggingface/gguf: run tools/bootstrap.sh (it installs nodejs and "
    "runs `npm ci --prefix tools/test-deps`)";

// A value as gguf_dump.mjs writes it: 64-bit integers as decimal strings, other numbers as numbers.
json oracle_form(const GGUFValue& v) {
  switch (v.type) {
    case GGUFValueType::u64: return std::to_string(std::get<uint64_t>(v.value));
    case GGUFValueType::i64: return std::to_string(std::get<int64_t>(v.value));
    case GGUFValueType::u8:
    case GGUFValueType::u16:
    case GGUFValueType::u32: return std::get<uint64_t>(v.value);
    case GGUFValueType::i8:
    case GGUFValueType::i16:
    case GGUFValueType::i32: return std::get<int64_t>(v.value);
    case GGUFValueType::f32:
    case GGUFValueType::f64: return std::get<double>(v.value);
    case GGUFValueType::boolean: return std::get<bool>(v.value);
    case GGUFValueType::string: return std::get<std::string>(v.value);
    case GGUFValueType::array: {
      json a = json::array();
      for (const GGUFValue& e : std::get<std::vector<GGUFValue>>(v.value)) a.push_back(oracle_form(e));
      return a;
    }
  }
  return nullptr;
}

json run_oracle(const fs::path& file) {
  return kiln::testing::run_json_oracle(fmt::format("node '{}' '{}'", KILN_TEST_GGUF_ORACLE, file.string()),
                                        file.string() + ".err", kBootstrap);
}

}  // namespace

TEST_F(GGUF, AgreesWithHuggingFaceGgufReader) {
  if (std::system("command -v node > /dev/null 2>&1") != 0) GTEST_SKIP() << "node is not on PATH: " << kBootstrap;
  if (!fs::exists(fs::path(KILN_TEST_DEPS_DIR) / "node_modules" / "@huggingface" / "gguf" / "package.json"))
    GTEST_SKIP() << "@huggingface/gguf is not installed in " << KILN_TEST_DEPS_DIR << ": " << kBootstrap;

  struct Case {
    uint32_t version;
    uint32_t alignment;
  };
  for (const Case c : {Case{3, 32}, Case{2, 32}, Case{3, 64}, Case{3, 1}}) {
    SCOPED_TRACE(fmt::format("v{}, alignment {}", c.version, c.alignment));
    Spec spec = sample_spec(c.version);
    // The JS reader decodes strings as UTF-8 (an invalid byte becomes U+FFFD): valid strings only here.
    spec.metadata[1].second = str("kiln test é bytes");
    spec.metadata.push_back({"test.deep", array(GGUFValueType::array, {array(GGUFValueType::array, {array(GGUFValueType::i64, {i64(-1)})})})});
    spec.tensors.emplace_back("blk.1.ffn_up.weight", std::vector<uint64_t>{256, 2, 1, 3}, GGMLType::q6_k, pattern(6 * 210, 9));
    spec.tensors.emplace_back("rope_freqs.weight", std::vector<uint64_t>{64}, GGMLType::bf16, pattern(128, 7));
    if (c.alignment != 32) {
      spec.alignment = c.alignment;
      spec.metadata.push_back({"general.alignment", u32(c.alignment)});
    }
    const fs::path path = write(build(spec).bytes, fmt::format("oracle_v{}_{}.gguf", c.version, c.alignment));
    const GGUFFile f = GGUFFile::open(path);
    json o = run_oracle(path);
    if (o.is_null()) return;

    EXPECT_EQ(o["version"], f.version());
    EXPECT_EQ(o["tensor_count"], std::to_string(f.tensors().size()));
    EXPECT_EQ(o["kv_count"], std::to_string(f.metadata().size()));
    ASSERT_EQ(o["metadata"].size(), f.metadata().size());
    for (const auto& [key, value] : f.metadata()) {
      ASSERT_TRUE(o["metadata"].contains(key)) << key;
      json theirs = o["metadata"][key];
      EXPECT_EQ(theirs["type"], static_cast<uint32_t>(value.type)) << key;
      if (value.type == GGUFValueType::array) {
        EXPECT_EQ(theirs["sub_type"], static_cast<uint32_t>(value.element_type)) << key;
      }
      EXPECT_EQ(theirs["value"], oracle_form(value)) << key;
    }
    const auto* base = static_cast<const uint8_t*>(f.mapping().get());
    ASSERT_EQ(o["tensors"].size(), f.tensors().size());
    for (size_t i = 0; i < f.tensors().size(); ++i) {
      const GGUFTensor& t = f.tensors()[i];
      json theirs = o["tensors"][i];
      EXPECT_EQ(theirs["name"], t.name);
      EXPECT_EQ(theirs["n_dims"], t.dims.size()) << t.name;
      json dims = json::array();
      for (int64_t d : t.dims) dims.push_back(std::to_string(d));
      EXPECT_EQ(theirs["shape"], dims) << t.name;
      EXPECT_EQ(theirs["dtype"], static_cast<uint32_t>(t.type)) << t.name;
      EXPECT_EQ(theirs["offset"], std::to_string(t.offset)) << t.name;
      // Their data section start plus the offset is where kiln's view begins.
      EXPECT_EQ(std::stoull(o["tensor_data_offset"].get<std::string>()) + t.offset,
                static_cast<uint64_t>(t.data.data() - base))
          << t.name;
    }
  }
}
