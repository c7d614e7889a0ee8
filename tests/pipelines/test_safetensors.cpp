// safetensors: round trips, sharded checkpoints, zero-copy mapping, and hostile files. Hostile files
// are written byte by byte here (not with save_safetensors), so the tests share no code with the
// reader; expected header text is checked with the test's own JSON parse.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include "test_util.h"
#include <kiln/kiln.h>
#include <kiln/pipelines/safetensors.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>

using namespace kiln;
using namespace kiln::pipelines;
namespace fs = std::filesystem;
using json = nlohmann::json;

using kiln::testing::error_message;

namespace {

// A fresh directory per test, removed at the end.
class Safetensors : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::temp_directory_path() / fmt::format("kiln_safetensors_{}_{}", info->name(), ::getpid());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  fs::path dir_;
};

std::string le64(uint64_t v) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[i] = static_cast<char>(v >> (8 * i));
  return s;
}

// A safetensors file from its parts: the 8-byte length (of `header` unless overridden), header, data.
void write_raw(const fs::path& path, const std::string& header, const std::string& data,
               std::optional<uint64_t> header_len = std::nullopt) {
  std::ofstream out(path, std::ios::binary);
  out << le64(header_len.value_or(header.size())) << header << data;
}

void write_bytes(const fs::path& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary);
  out << bytes;
}

std::string read_bytes(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

uint64_t header_length(const fs::path& path) {
  const std::string bytes = read_bytes(path);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<uint8_t>(bytes[i]);
  return n;
}

json header_of(const fs::path& path) { return json::parse(read_bytes(path).substr(8, header_length(path))); }

std::string raw_bytes(const Tensor& t) {
  Tensor packed = t.contiguous();
  return std::string(static_cast<const char*>(packed.data()), packed.nbytes());
}

// A tensor whose bytes are a deterministic pattern (bool: 0/1 alternating).
Tensor patterned(DType dtype, const std::vector<int64_t>& shape, uint8_t seed) {
  Tensor t = Tensor::empty(dtype, shape);
  auto* p = static_cast<uint8_t*>(t.data());
  for (size_t i = 0; i < t.nbytes(); ++i)
    p[i] =
        dtype == DType::boolean ? static_cast<uint8_t>((i + seed) % 2) : static_cast<uint8_t>(i * 37 + seed);
  return t;
}

// The address ranges of /proc/self/maps lines that map `path`.
std::vector<std::pair<uintptr_t, uintptr_t>> mapped_ranges(const fs::path& path) {
  std::vector<std::pair<uintptr_t, uintptr_t>> out;
  std::ifstream maps("/proc/self/maps");
  const std::string target = fs::canonical(path).string();
  for (std::string line; std::getline(maps, line);) {
    if (line.size() < target.size() || line.compare(line.size() - target.size(), target.size(), target) != 0)
      continue;
    uintptr_t lo = 0, hi = 0;
    std::sscanf(line.c_str(), "%lx-%lx", &lo, &hi);
    out.emplace_back(lo, hi);
  }
  return out;
}

bool inside(const void* p, const std::vector<std::pair<uintptr_t, uintptr_t>>& ranges) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  for (auto [lo, hi] : ranges)
    if (a >= lo && a < hi) return true;
  return false;
}

// ==== round trips ==================================================================================

TEST_F(Safetensors, RoundTripPreservesEveryDTypeShapeAndByte) {
  const std::map<DType, std::string> on_disk = {
      {DType::f32, "F32"},     {DType::f16, "F16"}, {DType::bf16, "BF16"}, {DType::f64, "F64"},
      {DType::i8, "I8"},       {DType::i16, "I16"}, {DType::i32, "I32"},   {DType::i64, "I64"},
      {DType::u8, "U8"},       {DType::u16, "U16"}, {DType::u32, "U32"},   {DType::u64, "U64"},
      {DType::boolean, "BOOL"}};
  WeightsRegistry weights;
  uint8_t seed = 1;
  for (DType d : kAllDTypes)
    weights.emplace(fmt::format("w.{}", dtype_name(d)), patterned(d, {2, 3}, seed++));
  weights.emplace("scalar", Tensor::scalar<float>(2.5f));
  weights.emplace("empty", Tensor::empty(DType::f32, {0, 4}));
  const fs::path file = dir_ / "all.safetensors";
  save_safetensors(file, weights, {{"format", "pt"}});

  // The file says what the format says, read by the test's own parser.
  const json header = header_of(file);
  EXPECT_EQ(header["__metadata__"], json({{"format", "pt"}}));
  for (DType d : kAllDTypes) {
    const json& e = header[fmt::format("w.{}", dtype_name(d))];
    EXPECT_EQ(e["dtype"], on_disk.at(d));
    EXPECT_EQ(e["shape"], json({2, 3}));
    EXPECT_EQ(e["data_offsets"][1].get<uint64_t>() - e["data_offsets"][0].get<uint64_t>(), 6 * dtype_size(d));
  }
  // The header is padded so the data section starts 8-byte aligned.
  EXPECT_EQ(header_length(file) % 8, 0u);

  WeightsRegistry back = load_safetensors(file);
  ASSERT_EQ(back.size(), weights.size());
  for (const auto& [name, t] : weights) {
    SCOPED_TRACE(name);
    const Tensor& b = back.at(name);
    EXPECT_EQ(b.dtype(), t.dtype());
    EXPECT_EQ(b.shape(), t.shape());
    EXPECT_EQ(raw_bytes(b), raw_bytes(t));
  }
  EXPECT_EQ(back.at("scalar").to_vector<float>(), std::vector<float>{2.5f});
  EXPECT_EQ(SafetensorsFile::open(file).metadata(), (std::map<std::string, std::string>{{"format", "pt"}}));
}

TEST_F(Safetensors, SaveWritesStridedTensorsRowMajor) {
  // [[1, 2, 3], [4, 5, 6]] viewed transposed: [[1, 4], [2, 5], [3, 6]].
  std::vector<float> values = {1, 2, 3, 4, 5, 6};
  Tensor transposed = Tensor::borrow(values.data(), DType::f32, {3, 2}, {1, 3});
  save_safetensors(dir_ / "t.safetensors", {{"t", transposed}});
  Tensor back = load_safetensors(dir_ / "t.safetensors").at("t");
  EXPECT_EQ(back.shape(), (std::vector<int64_t>{3, 2}));
  EXPECT_EQ(back.to_vector<float>(), (std::vector<float>{1, 4, 2, 5, 3, 6}));
}

TEST_F(Safetensors, SaveRefusesUndefinedTensorAndMetadataName) {
  EXPECT_NE(error_message<ValueError>([&] {
              save_safetensors(dir_ / "x.safetensors", {{"w", Tensor()}});
            }).find("tensor 'w' is undefined"),
            std::string::npos);
  EXPECT_NE(error_message<ValueError>([&] {
              save_safetensors(dir_ / "x.safetensors", {{"__metadata__", Tensor::scalar<float>(1)}});
            }).find("'__metadata__' cannot name a tensor"),
            std::string::npos);
}

TEST_F(Safetensors, NamesAreSortedAndContainsAnswers) {
  save_safetensors(dir_ / "m.safetensors",
                   {{"b", Tensor::scalar<float>(1)}, {"a", Tensor::scalar<float>(2)}});
  SafetensorsFile f = SafetensorsFile::open(dir_ / "m.safetensors");
  EXPECT_EQ(f.names(), (std::vector<std::string>{"a", "b"}));
  EXPECT_TRUE(f.contains("a"));
  EXPECT_FALSE(f.contains("c"));
  const std::string msg = error_message<LoadError>([&] { f.tensor("c"); });
  EXPECT_NE(msg.find("m.safetensors"), std::string::npos) << msg;
  EXPECT_NE(msg.find("no tensor 'c' (the file has 2 tensors: a, b)"), std::string::npos) << msg;
}

// ==== sharded checkpoints and directories ==========================================================

TEST_F(Safetensors, ShardedCheckpointLoadsFromDirectoryAndIndex) {
  save_safetensors(dir_ / "model-00001-of-00002.safetensors",
                   {{"model.embed_tokens.weight", Tensor::from_vector<float>({1, 2, 3, 4}, {2, 2})}});
  save_safetensors(dir_ / "model-00002-of-00002.safetensors",
                   {{"model.norm.weight", Tensor::from_vector<float>({5, 6}, {2})},
                    {"lm_head.weight", Tensor::from_vector<float>({7, 8, 9, 10}, {2, 2})}});
  write_bytes(dir_ / "model.safetensors.index.json", R"({
    "metadata": {"total_size": 40},
    "weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors",
                   "model.norm.weight": "model-00002-of-00002.safetensors",
                   "lm_head.weight": "model-00002-of-00002.safetensors"}})");
  for (const fs::path& p : {dir_, dir_ / "model.safetensors.index.json"}) {
    SCOPED_TRACE(p.string());
    WeightsRegistry w = load_safetensors(p);
    ASSERT_EQ(w.size(), 3u);
    EXPECT_EQ(w.at("model.embed_tokens.weight").to_vector<float>(), (std::vector<float>{1, 2, 3, 4}));
    EXPECT_EQ(w.at("model.norm.weight").to_vector<float>(), (std::vector<float>{5, 6}));
    EXPECT_EQ(w.at("lm_head.weight").to_vector<float>(), (std::vector<float>{7, 8, 9, 10}));
  }
}

TEST_F(Safetensors, DirectoryWithSingleFileLoadsModelSafetensors) {
  save_safetensors(dir_ / "model.safetensors", {{"w", Tensor::from_vector<int32_t>({3, 4}, {2})}});
  EXPECT_EQ(load_safetensors(dir_).at("w").to_vector<int32_t>(), (std::vector<int32_t>{3, 4}));
}

TEST_F(Safetensors, EmptyDirectoryIsLoadErrorSayingWhatWasExpected) {
  const std::string msg = error_message<LoadError>([&] { load_safetensors(dir_); });
  EXPECT_NE(msg.find("neither model.safetensors nor model.safetensors.index.json"), std::string::npos) << msg;
}

TEST_F(Safetensors, MissingFileIsLoadErrorNamingIt) {
  const std::string msg = error_message<LoadError>([&] { load_safetensors(dir_ / "nope.safetensors"); });
  EXPECT_NE(msg.find("nope.safetensors: cannot open"), std::string::npos) << msg;
}

TEST_F(Safetensors, NameInTwoShardsIsLoadError) {
  save_safetensors(dir_ / "a.safetensors", {{"w", Tensor::scalar<float>(1)}});
  save_safetensors(dir_ / "b.safetensors", {{"w", Tensor::scalar<float>(2)}});
  write_bytes(dir_ / "model.safetensors.index.json",
              R"({"weight_map": {"w": "a.safetensors", "v": "b.safetensors"}})");
  const std::string msg = error_message<LoadError>([&] { load_safetensors(dir_); });
  EXPECT_NE(msg.find("tensor 'w' is in two files"), std::string::npos) << msg;
}

TEST_F(Safetensors, IndexNamingAbsentTensorIsLoadError) {
  save_safetensors(dir_ / "a.safetensors", {{"w", Tensor::scalar<float>(1)}});
  write_bytes(dir_ / "model.safetensors.index.json",
              R"({"weight_map": {"w": "a.safetensors", "v": "a.safetensors"}})");
  const std::string msg = error_message<LoadError>([&] { load_safetensors(dir_); });
  EXPECT_NE(
      msg.find("model.safetensors.index.json: weight_map names tensor 'v' in 'a.safetensors', which does "
               "not have it"),
      std::string::npos)
      << msg;
}

TEST_F(Safetensors, IndexShardOutsideItsDirectoryIsRefused) {
  write_bytes(dir_ / "model.safetensors.index.json", R"({"weight_map": {"w": "../elsewhere.safetensors"}})");
  const std::string msg = error_message<LoadError>([&] { load_safetensors(dir_); });
  EXPECT_NE(msg.find("expected a file in the index's directory"), std::string::npos) << msg;
}

TEST_F(Safetensors, IndexWithoutWeightMapIsLoadError) {
  write_bytes(dir_ / "model.safetensors.index.json", R"({"metadata": {}})");
  const std::string msg = error_message<LoadError>([&] { load_safetensors(dir_); });
  EXPECT_NE(msg.find("\"weight_map\""), std::string::npos) << msg;
}

// ==== zero copy ====================================================================================

TEST_F(Safetensors, TensorsPointIntoTheFileMappingAndKeepItAlive) {
  const fs::path file = dir_ / "z.safetensors";
  save_safetensors(file, {{"a", Tensor::from_vector<float>({1, 2, 3}, {3})},
                          {"b", Tensor::from_vector<int64_t>({7, 8}, {2})}});
  Tensor a, b;
  {
    SafetensorsFile f = SafetensorsFile::open(file);
    a = f.tensor("a");
    b = f.tensor("b");
    EXPECT_EQ(f.tensor("a").data(), a.data());  // no copy: the same bytes every time
    const auto ranges = mapped_ranges(file);
    ASSERT_FALSE(ranges.empty()) << "the file is not mapped";
    EXPECT_TRUE(inside(a.data(), ranges));
    EXPECT_TRUE(inside(b.data(), ranges));
    // The pointers are as far apart as the header's offsets say.
    const json h = header_of(file);
    EXPECT_EQ(static_cast<const char*>(b.data()) - static_cast<const char*>(a.data()),
              h["b"]["data_offsets"][0].get<int64_t>() - h["a"]["data_offsets"][0].get<int64_t>());
  }
  // The file object is gone; the tensors still hold the mapping.
  EXPECT_TRUE(inside(a.data(), mapped_ranges(file)));
  EXPECT_EQ(a.to_vector<float>(), (std::vector<float>{1, 2, 3}));
  EXPECT_EQ(b.to_vector<int64_t>(), (std::vector<int64_t>{7, 8}));
  // Writes go to a private copy of the page, never to the file.
  a.data_as<float>()[0] = 42;
  EXPECT_EQ(load_safetensors(file).at("a").to_vector<float>(), (std::vector<float>{1, 2, 3}));
}

TEST_F(Safetensors, MappingIsReleasedWithTheLastTensor) {
  const fs::path file = dir_ / "r.safetensors";
  save_safetensors(file, {{"a", Tensor::from_vector<float>({1, 2}, {2})}});
  {
    WeightsRegistry w = load_safetensors(file);
    EXPECT_FALSE(mapped_ranges(file).empty());
  }
  EXPECT_TRUE(mapped_ranges(file).empty());
}

TEST_F(Safetensors, MisalignedDataIsCopiedIntoAlignedMemory) {
  // A header whose length leaves the data at a file byte that is not a multiple of 4.
  const float values[2] = {1.5f, -2.0f};
  std::string h = R"({"f":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  if ((8 + h.size()) % 4 == 0) h += " ";
  ASSERT_NE((8 + h.size()) % 4, 0u);
  write_raw(dir_ / "m.safetensors", h, std::string(reinterpret_cast<const char*>(values), 8));
  Tensor t = load_safetensors(dir_ / "m.safetensors").at("f");
  EXPECT_EQ(reinterpret_cast<uintptr_t>(t.data()) % alignof(float), 0u);
  EXPECT_EQ(t.to_vector<float>(), (std::vector<float>{1.5f, -2.0f}));
}

// ==== hostile files ================================================================================

// Loads `path`, expects a LoadError, and checks it names the file and contains every fragment.
void expect_load_error(const fs::path& path, const std::vector<std::string>& fragments) {
  const std::string msg = error_message<LoadError>([&] { load_safetensors(path); });
  EXPECT_NE(msg.find(path.string()), std::string::npos) << msg;
  for (const std::string& f : fragments)
    EXPECT_NE(msg.find(f), std::string::npos) << "missing '" << f << "' in: " << msg;
}

const std::string kValidHeader = R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";

TEST_F(Safetensors, FileShorterThanLengthPrefixIsLoadError) {
  write_bytes(dir_ / "short.safetensors", "abcde");
  expect_load_error(dir_ / "short.safetensors", {"file is 5 bytes, shorter than the 8-byte header length"});
}

TEST_F(Safetensors, FileShorterThanItsHeaderIsLoadError) {
  write_raw(dir_ / "cut.safetensors", kValidHeader.substr(0, 20), "", kValidHeader.size());
  expect_load_error(dir_ / "cut.safetensors",
                    {fmt::format("header length {} (file bytes 0..8) is larger than the 20 bytes after it",
                                 kValidHeader.size())});
}

TEST_F(Safetensors, HugeHeaderLengthIsLoadError) {
  write_raw(dir_ / "huge.safetensors", kValidHeader, std::string(8, '\0'), UINT64_MAX);
  expect_load_error(dir_ / "huge.safetensors", {"header length 18446744073709551615", "is larger than"});
}

TEST_F(Safetensors, NonJsonHeaderIsLoadErrorWithFileByte) {
  write_raw(dir_ / "bad.safetensors", R"({"w": nope})", "");
  // The parser gives up after reading "no" of nope: 'o' is header byte 7, so file byte 15.
  expect_load_error(dir_ / "bad.safetensors", {"header (file bytes 8..19): not valid JSON at file byte 15"});
}

TEST_F(Safetensors, HeaderThatIsNotAnObjectIsLoadError) {
  write_raw(dir_ / "arr.safetensors", "[1, 2]", "");
  expect_load_error(dir_ / "arr.safetensors", {"is [1,2], expected a JSON object"});
}

TEST_F(Safetensors, OverlappingOffsetsAreLoadError) {
  write_raw(dir_ / "o.safetensors",
            R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},)"
            R"("b":{"dtype":"F32","shape":[4],"data_offsets":[8,24]}})",
            std::string(24, '\0'));
  expect_load_error(dir_ / "o.safetensors",
                    {"tensor 'b': data_offsets [8, 24] overlap tensor 'a' data_offsets [0, 16]"});
}

TEST_F(Safetensors, OffsetsPastTheDataAreLoadErrorWithFileBytes) {
  const std::string h = R"({"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})";
  write_raw(dir_ / "oob.safetensors", h, std::string(8, '\0'));
  const uint64_t data_start = 8 + h.size();
  expect_load_error(dir_ / "oob.safetensors",
                    {"tensor 'w': data_offsets [0, 16]: end is past the data section of 8 bytes",
                     fmt::format("file bytes {}..{}", data_start, data_start + 16)});
}

TEST_F(Safetensors, BeginAfterEndIsLoadError) {
  write_raw(dir_ / "rev.safetensors",
            R"({"model.norm.weight":{"dtype":"U8","shape":[10],"data_offsets":[100,90]}})",
            std::string(128, '\0'));
  expect_load_error(dir_ / "rev.safetensors",
                    {"tensor 'model.norm.weight': data_offsets [100, 90]: begin is after end"});
}

TEST_F(Safetensors, SizeNotMatchingShapeIsLoadError) {
  write_raw(dir_ / "sz.safetensors", R"({"w":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})",
            std::string(8, '\0'));
  expect_load_error(dir_ / "sz.safetensors",
                    {"tensor 'w': data_offsets [0, 8] span 8 bytes, but F32[3] needs 12 bytes"});
}

TEST_F(Safetensors, UnknownDTypeIsLoadErrorNamingTensorAndDType) {
  write_raw(dir_ / "dt.safetensors", R"({"w":{"dtype":"F8_E4M3","shape":[8],"data_offsets":[0,8]}})",
            std::string(8, '\0'));
  expect_load_error(dir_ / "dt.safetensors", {"tensor 'w': unsupported dtype 'F8_E4M3'"});
}

TEST_F(Safetensors, NegativeShapeIsLoadError) {
  write_raw(dir_ / "neg.safetensors", R"({"w":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})",
            std::string(8, '\0'));
  expect_load_error(dir_ / "neg.safetensors",
                    {"tensor 'w': shape [-2] has dim -2, expected non-negative integers"});
}

TEST_F(Safetensors, ShapeWhoseProductOverflowsIsLoadError) {
  // 2^32 * 2^32 elements wraps to 0 in 64 bits; with offsets [0, 0] a wrapping product would pass.
  write_raw(dir_ / "ovf.safetensors",
            R"({"w":{"dtype":"U8","shape":[4294967296,4294967296],"data_offsets":[0,0]}})", "");
  expect_load_error(dir_ / "ovf.safetensors",
                    {"tensor 'w': shape", "element count: 4294967296 * 4294967296 overflows int64"});
}

TEST_F(Safetensors, ByteSizeOverflowIsLoadError) {
  write_raw(dir_ / "ovf2.safetensors",
            R"({"w":{"dtype":"F64","shape":[4611686018427387904],"data_offsets":[0,0]}})", "");
  expect_load_error(dir_ / "ovf2.safetensors", {"of F64: bytes: 4611686018427387904 * 8 overflows int64"});
}

TEST_F(Safetensors, MissingOrMistypedEntryFieldsAreLoadErrors) {
  write_raw(dir_ / "f1.safetensors", R"({"w":{"dtype":"F32","shape":[2]}})", "");
  expect_load_error(dir_ / "f1.safetensors", {"tensor 'w': missing 'data_offsets'"});
  write_raw(dir_ / "f2.safetensors", R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0]}})", "");
  expect_load_error(dir_ / "f2.safetensors", {"data_offsets is [0], expected [begin, end]"});
  write_raw(dir_ / "f3.safetensors", R"({"w":{"dtype":"F32","shape":[2.5],"data_offsets":[0,8]}})", "");
  expect_load_error(dir_ / "f3.safetensors", {"has dim 2.5"});
  write_raw(dir_ / "f4.safetensors", R"({"w":7})", "");
  expect_load_error(dir_ / "f4.safetensors", {"tensor 'w': entry is 7, expected an object"});
  write_raw(dir_ / "f5.safetensors", R"({"__metadata__":{"k":1}})", "");
  expect_load_error(dir_ / "f5.safetensors", {"__metadata__ 'k' is 1, expected a string"});
}

TEST_F(Safetensors, BoolBytesOtherThanZeroOrOneAreLoadError) {
  const std::string h = R"({"m":{"dtype":"BOOL","shape":[3],"data_offsets":[0,3]}})";
  write_raw(dir_ / "b.safetensors", h, std::string("\x01\x00\x07", 3));
  expect_load_error(
      dir_ / "b.safetensors",
      {fmt::format("tensor 'm': BOOL byte 2 (file byte {}) is 7, expected 0 or 1", 8 + h.size() + 2)});
}

// ---- hostile JSON (issue 19): each is a LoadError naming the file, never a crash or a raw nlohmann
// exception.

TEST_F(Safetensors, NumberOverflowInHeaderIsLoadErrorNamingTheFile) {
  write_raw(dir_ / "ovf.safetensors", R"({"w":{"dtype":"F32","shape":[1e400],"data_offsets":[0,8]}})",
            std::string(8, '\0'));
  expect_load_error(dir_ / "ovf.safetensors", {"header (file bytes 8..", "not valid JSON at file byte",
                                               "number overflow parsing '1e400'"});
}

TEST_F(Safetensors, DeeplyNestedHeaderIsLoadErrorNotAStackOverflow) {
  // 100k levels, 200 KB: refused at the 9th level, long before anything recursive could see it.
  const std::string deep = std::string(100'000, '[') + std::string(100'000, ']');
  write_raw(dir_ / "deep.safetensors",
            R"({"w":{"dtype":"F32","shape":)" + deep + R"(,"data_offsets":[0,0]}})", "");
  expect_load_error(dir_ / "deep.safetensors", {"nested deeper than 8 levels at file byte"});
  write_raw(dir_ / "deep2.safetensors", R"({"__metadata__":{"k":)" + deep + "}}", "");
  expect_load_error(dir_ / "deep2.safetensors", {"nested deeper than 8 levels"});
}

TEST_F(Safetensors, RepeatedTensorNameIsLoadErrorNamingIt) {
  // The format forbids duplicate keys; nlohmann alone would keep the second silently.
  write_raw(dir_ / "dup.safetensors",
            R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
            R"("w":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
            std::string(8, '\0'));
  expect_load_error(dir_ / "dup.safetensors", {"duplicate key \"w\" at file byte"});
  write_raw(dir_ / "dupmeta.safetensors", R"({"__metadata__":{"format":"pt","format":"np"}})", "");
  expect_load_error(dir_ / "dupmeta.safetensors", {"duplicate key \"format\""});
  write_raw(dir_ / "dupfield.safetensors",
            R"({"w":{"dtype":"F32","dtype":"I32","shape":[1],"data_offsets":[0,4]}})", std::string(4, '\0'));
  expect_load_error(dir_ / "dupfield.safetensors", {"duplicate key \"dtype\""});
}

TEST_F(Safetensors, HeaderOverTheLimitIsRefusedBeforeParsing) {
  // A sparse file: 100 MB + 1 of header costs no disk.
  const fs::path file = dir_ / "big.safetensors";
  write_bytes(file, le64(100'000'001) + "{");
  fs::resize_file(file, 8 + 100'000'001);
  expect_load_error(file, {"header length 100000001", "more than the 100000000 bytes kiln reads"});
}

TEST_F(Safetensors, RankOverTheLimitIsLoadError) {
  std::string shape = "[1";
  for (int i = 0; i < 64; ++i) shape += ",1";
  write_raw(dir_ / "rank.safetensors",
            R"({"w":{"dtype":"U8","shape":)" + shape + R"(],"data_offsets":[0,1]}})", std::string(1, '\0'));
  expect_load_error(dir_ / "rank.safetensors",
                    {"tensor 'w': shape has rank 65, more than the 64 kiln reads"});
}

TEST_F(Safetensors, FileTruncatedSinceItsHeaderWasWrittenIsLoadErrorAtOpen) {
  // Without the check, reading the last tensor would touch pages past the end of the file: SIGBUS.
  const fs::path file = dir_ / "cut.safetensors";
  save_safetensors(file, {{"a", patterned(DType::f32, {1024}, 1)}, {"b", patterned(DType::f32, {1024}, 2)}});
  fs::resize_file(file, fs::file_size(file) - 4096);
  expect_load_error(file, {"is past the data section"});
}

TEST_F(Safetensors, ValuesInMessagesAreCut) {
  // A 1 MB dtype string is named in the message by its first bytes only.
  write_raw(dir_ / "long.safetensors", R"({"w":{"dtype":[")" + std::string(1 << 20, '7') + "\"]}}", "");
  const std::string msg = error_message<LoadError>([&] { load_safetensors(dir_ / "long.safetensors"); });
  EXPECT_NE(msg.find("dtype is [\"777"), std::string::npos) << msg;
  EXPECT_LT(msg.size(), 400u) << msg;
}

TEST_F(Safetensors, HostileIndexJsonIsLoadErrorNamingTheIndex) {
  save_safetensors(dir_ / "a.safetensors", {{"w", Tensor::scalar<float>(1)}});
  const fs::path index = dir_ / "model.safetensors.index.json";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {R"({"metadata": {"total_size": 1e400}, "weight_map": {"w": "a.safetensors"}})",
       "not valid JSON at byte 33: [json.exception.out_of_range.406] number overflow parsing '1e400'"},
      {R"({"weight_map": {"w": "a.safetensors", "w": "b.safetensors"}})", "duplicate key \"w\" at byte"},
      {R"({"weight_map": {"w": "a.safetensors"}, "weight_map": {}})", "duplicate key \"weight_map\""},
      {R"({"metadata": )" + std::string(100'000, '[') + std::string(100'000, ']') + "}",
       "nested deeper than 64 levels at byte 76"},
      {R"({"weight_map": {"w": )" + std::string(100'000, '[') + "}}", "nested deeper than 64 levels"},
  };
  for (const auto& [text, fragment] : cases) {
    write_bytes(index, text);
    const std::string msg = error_message<LoadError>([&] { load_safetensors(dir_); });
    EXPECT_NE(msg.find("load_safetensors: " + index.string() + ": " + fragment), std::string::npos) << msg;
    EXPECT_LT(msg.size(), 600u);
  }
}

// Thousands of random corruptions of a valid file: each one loads or is a LoadError, never a crash,
// a hang or another exception (run under the sanitize preset to catch out-of-bounds reads).
TEST_F(Safetensors, FuzzedFilesLoadOrThrowLoadError) {
  const fs::path valid = dir_ / "valid.safetensors";
  save_safetensors(valid,
                   {{"a", patterned(DType::f32, {2, 3}, 1)},
                    {"b", patterned(DType::bf16, {4}, 2)},
                    {"c", patterned(DType::boolean, {5}, 3)},
                    {"d", patterned(DType::i64, {1, 1}, 4)},
                    {"e", Tensor::empty(DType::u8, {0})}},
                   {{"format", "pt"}});
  const std::string original = read_bytes(valid);
  const size_t header_end = 8 + header_length(valid);
  ASSERT_LT(header_end, original.size());

  std::mt19937 rng(12345);
  auto below = [&](size_t n) { return std::uniform_int_distribution<size_t>(0, n - 1)(rng); };
  const char interesting[] = "0123456789-[]{},:\"e.\x00\xff ";
  // Thousands of rewrites take seconds on a disk and milliseconds in tmpfs.
  const fs::path fuzzed = (fs::is_directory("/dev/shm") ? fs::path("/dev/shm") : dir_) /
                          fmt::format("kiln_fuzzed_{}.safetensors", ::getpid());
  int loaded = 0, rejected = 0;
  for (int iter = 0; iter < 3000; ++iter) {
    std::string bytes = original;
    const int mutations = below(4) == 0 ? 2 + static_cast<int>(below(3)) : 1;
    for (int m = 0; m < mutations && !bytes.empty(); ++m) {
      switch (below(5)) {
        case 0:  // flip a bit anywhere
          bytes[below(bytes.size())] ^= static_cast<char>(1 << below(8));
          break;
        case 1:  // a JSON-significant character in the header, where mutations matter most
          bytes[below(std::min(bytes.size(), header_end))] = interesting[below(sizeof(interesting) - 1)];
          break;
        case 2:  // truncate
          bytes.resize(below(bytes.size() + 1));
          break;
        case 3:  // a random header length byte
          bytes[below(std::min<size_t>(bytes.size(), 8))] = static_cast<char>(below(256));
          break;
        default:  // insert or delete a header byte, shifting everything after it
          if (below(2) == 0)
            bytes.insert(below(std::min(bytes.size(), header_end)), 1,
                         interesting[below(sizeof(interesting) - 1)]);
          else
            bytes.erase(below(std::min(bytes.size(), header_end)), 1);
      }
    }
    write_bytes(fuzzed, bytes);
    try {
      WeightsRegistry w = load_safetensors(fuzzed);
      for (const auto& [name, t] : w) (void)t.to_vector<double>();  // touch every byte
      ++loaded;
    } catch (const LoadError&) {
      ++rejected;
    } catch (const std::exception& e) {
      ADD_FAILURE() << "iteration " << iter << ": not a LoadError: " << e.what();
    }
  }
  fs::remove(fuzzed);
  // Both outcomes occur, so the fuzzer reaches past the first checks.
  EXPECT_GT(loaded, 50);
  EXPECT_GT(rejected, 1000);
}

}  // namespace
