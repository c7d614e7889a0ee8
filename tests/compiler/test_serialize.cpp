// Compiled artifacts: a CompiledModel round-trips through its file format, and the reader refuses
// foreign, truncated, corrupted and other-version files with a LoadError, never a crash.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "cpu_kernel_catalog.h"
#include "kiln/compiler/compiled_model.h"
#include "kiln/graph/ops.h"
#include "kiln/graph/text.h"
#include "test_util.h"

namespace {

using namespace kiln;
namespace ops = kiln::graph::ops;
using compiler::CompiledModel;
using graph::TensorType;
using kiln::testing::expect_error;

// A graph whose plan holds every kind of attribute a step can carry: ints, floats, strings, int
// lists, symbolic shapes, dtypes, devices, bytes (constants), plus weights, slots and outputs.
CompiledModel compile_rich_model() {
  graph::Graph g("rich", {TensorType{DType::f32, {"batch", 4}}});
  graph::Graph::Scope scope(g);  // constants and ranges are made in the entered graph
  auto x = g.input(0);
  auto w = g.weight({"w", DType::f32, {4, 6}});
  auto h = ops::gelu(ops::matmul(x, w), /*tanh_approximation=*/true);
  h = ops::add(h, ops::constant(std::vector<float>{1, 2, 3, 4, 5, 6}, {6}));
  h = ops::reshape(h, graph::Shape{"batch", 2, 3});
  h = ops::permute(h, {0, 2, 1});
  h = ops::softmax(ops::cast(h, DType::f64), 1);
  auto r = ops::range(0.5, 0.25, 3, DType::f32);
  g.output({h, ops::cumsum(r, 0, true, false)});
  return compiler::compile(g.module(), kiln::testing::with_cpu_kernels());
}

TEST(Serialize, RoundTripKeepsEveryPlanField) {
  CompiledModel original = compile_rich_model();
  std::string bytes = original.serialize();
  CompiledModel loaded = CompiledModel::deserialize(bytes);

  // Field by field against the original, not through the writer.
  const auto& a = original.plan("rich");
  const auto& b = loaded.plan("rich");
  EXPECT_EQ(b.name, "rich");
  EXPECT_EQ(b.input_types, a.input_types);
  EXPECT_EQ(b.output_types, a.output_types);
  EXPECT_EQ(b.weights, a.weights);
  ASSERT_EQ(b.values.size(), a.values.size());
  for (size_t v = 0; v < a.values.size(); ++v) {
    EXPECT_EQ(b.values[v].type, a.values[v].type) << "value " << v;
    EXPECT_EQ(b.values[v].kind, a.values[v].kind) << "value " << v;
    EXPECT_EQ(b.values[v].slot, a.values[v].slot) << "value " << v;
    EXPECT_EQ(b.values[v].weight, a.values[v].weight) << "value " << v;
    EXPECT_EQ(b.values[v].input, a.values[v].input) << "value " << v;
  }
  for (auto [sa, sb] : {std::pair{&a.steps, &b.steps}, std::pair{&a.constants, &b.constants}}) {
    ASSERT_EQ(sb->size(), sa->size());
    for (size_t s = 0; s < sa->size(); ++s) {
      EXPECT_EQ((*sb)[s].op, (*sa)[s].op);
      EXPECT_EQ((*sb)[s].inputs, (*sa)[s].inputs);
      EXPECT_EQ((*sb)[s].outputs, (*sa)[s].outputs);
      EXPECT_EQ((*sb)[s].attrs, (*sa)[s].attrs) << graph::op_name((*sa)[s].op);
      EXPECT_EQ((*sb)[s].node, (*sa)[s].node);
      EXPECT_EQ((*sb)[s].extension, (*sa)[s].extension);
    }
  }
  EXPECT_EQ(b.outputs, a.outputs);
  EXPECT_EQ(b.num_slots, a.num_slots);
  EXPECT_EQ(graph::print(loaded.ir()), graph::print(original.ir()));
  // The rich graph really exercises the attribute kinds the format must carry.
  std::set<size_t> kinds;
  for (const auto* steps : {&a.steps, &a.constants})
    for (const auto& step : *steps)
      for (const auto& [name, attr] : step.attrs) kinds.insert(attr.index());
  EXPECT_GE(kinds.size(), 6u);
}

TEST(Serialize, SaveAndLoadThroughAFile) {
  CompiledModel original = compile_rich_model();
  auto file =
      std::filesystem::temp_directory_path() / ("kiln_serialize_" + std::to_string(::getpid()) + ".kiln");
  original.save(file);
  CompiledModel loaded = CompiledModel::load(file);
  std::filesystem::remove(file);
  EXPECT_EQ(loaded.serialize(), original.serialize());
}

TEST(Serialize, MissingFileIsALoadErrorNamingIt) {
  expect_error<LoadError>([] { CompiledModel::load("/nonexistent/model.kiln"); },
                          {"/nonexistent/model.kiln", "cannot open"});
}

TEST(Serialize, ForeignFileIsRefused) {
  expect_error<LoadError>([] { CompiledModel::deserialize("{\"not\": \"an artifact\"}", "x.json"); },
                          {"x.json", "not a kiln compiled artifact"});
  expect_error<LoadError>([] { CompiledModel::deserialize(""); }, "not a kiln compiled artifact");
}

TEST(Serialize, OtherFormatVersionIsRefused) {
  std::string bytes = compile_rich_model().serialize();
  bytes[8] = 99;  // the u32 format version follows the 8-byte magic
  expect_error<LoadError>([&] { CompiledModel::deserialize(bytes); }, "format version 99, expected 6");
}

TEST(Serialize, OtherKilnVersionIsRefused) {
  std::string bytes = compile_rich_model().serialize();
  // The version string follows magic and format version: u32 length, then its bytes.
  uint32_t length;
  std::memcpy(&length, bytes.data() + 12, 4);
  ASSERT_GT(length, 0u);
  bytes[16] = '9';  // "0.1.0" -> "9.1.0"

  expect_error<LoadError>([&] { CompiledModel::deserialize(bytes); }, {"written by kiln 9", "recompile"});
}

TEST(Serialize, EveryTruncationIsALoadError) {
  std::string bytes = compile_rich_model().serialize();
  for (size_t n = 0; n < bytes.size(); ++n)
    EXPECT_THROW(CompiledModel::deserialize(std::string_view(bytes).substr(0, n)), LoadError) << n;
}

TEST(Serialize, CorruptedIRTextIsALoadErrorOnFirstUse) {
  std::string bytes = compile_rich_model().serialize();
  size_t at = bytes.find("graph @rich");
  ASSERT_NE(at, std::string::npos);
  bytes[at] = 'X';  // same length, so the plans still read
  CompiledModel loaded = CompiledModel::deserialize(bytes, "m.kiln");
  EXPECT_EQ(loaded.plan("rich").name, "rich");
  expect_error<LoadError>([&] { loaded.ir(); }, {"m.kiln", "bad compiled IR"});
}

TEST(Serialize, TrailingBytesAreRefused) {
  std::string bytes = compile_rich_model().serialize() + "xx";
  expect_error<LoadError>([&] { CompiledModel::deserialize(bytes); }, "2 unexpected bytes");
}

// Random corruptions (bit flips, byte overwrites, huge counts, truncations): each must load or throw
// a LoadError. A crash or another exception type fails the test (run it under ASan to see misreads).
TEST(Serialize, FuzzedFilesLoadOrThrowLoadError) {
  const std::string good = compile_rich_model().serialize();
  std::mt19937_64 rng(1234);
  int rejected = 0, loaded = 0;
  for (int trial = 0; trial < 3000; ++trial) {
    std::string bytes = good;
    int edits = 1 + static_cast<int>(rng() % 4);
    for (int e = 0; e < edits; ++e) {
      size_t at = rng() % bytes.size();
      switch (rng() % 4) {
        case 0:
          bytes[at] = static_cast<char>(bytes[at] ^ (1 << (rng() % 8)));
          break;
        case 1:
          bytes[at] = static_cast<char>(rng());
          break;
        case 2:  // a huge little-endian count where a count may be
          if (at + 4 <= bytes.size()) std::memset(bytes.data() + at, 0xff, 4);
          break;
        case 3:
          bytes.resize(at);
          break;
      }
      if (bytes.empty()) break;
    }
    try {
      CompiledModel m = CompiledModel::deserialize(bytes);
      (void)m.ir();  // the IR is parsed on first use: its errors must be LoadErrors too
      ++loaded;
    } catch (const LoadError&) {
      ++rejected;
    } catch (const std::exception& e) {
      ADD_FAILURE() << "trial " << trial << ": not a LoadError: " << e.what();
    }
  }
  EXPECT_GT(rejected, 2000);  // most corruptions must be caught
  EXPECT_EQ(loaded + rejected, 3000);
}

}  // namespace

// ---- hostile artifacts: refused before any work, naming the file and the byte ------------------------

namespace {

std::string u32_bytes(uint32_t v) {
  std::string s(4, '\0');
  std::memcpy(s.data(), &v, 4);
  return s;
}

// The offset of the plan count: magic, format version, then the kiln version and IR strings.
size_t plan_count_offset(const std::string& bytes) {
  size_t at = 12;
  for (int i = 0; i < 2; ++i) {
    uint32_t length;
    std::memcpy(&length, bytes.data() + at, 4);
    at += 4 + length;
  }
  return at;
}

// The serialized dim "batch" of the reshape's shape attribute (rank 3: batch, 2, 3).
size_t reshape_dims_offset(const std::string& bytes) {
  const std::string pattern = u32_bytes(3) + u32_bytes(5) + "batch" + u32_bytes(1) + "2";
  size_t at = bytes.find(pattern);
  EXPECT_NE(at, std::string::npos);
  return at;
}

}  // namespace

TEST(SerializeHostile, HugeCountBehindATinyFileNamesTheOffset) {
  std::string bytes = compile_rich_model().serialize();
  const size_t at = plan_count_offset(bytes);
  bytes.replace(at, 4, u32_bytes(0xffffffffu));
  bytes.resize(at + 4 + 10);  // truncated too: 10 bytes where 4 billion plans should be
  expect_error<LoadError>([&] { CompiledModel::deserialize(bytes, "cache/x.kiln"); },
                          {"cache/x.kiln", "plan count 4294967295 exceeds the 10 bytes left",
                           fmt::format("at byte {} of {}", at + 4, bytes.size())});
}

TEST(SerializeHostile, RankBeyondTheBoundIsRefused) {
  std::string bytes = compile_rich_model().serialize();
  const size_t at = reshape_dims_offset(bytes);
  bytes.replace(at, 4, u32_bytes(100));  // 100 dims: past kMaxRank, and padded to fit the bytes left
  bytes += std::string(1000, '\0');
  expect_error<LoadError>([&] { CompiledModel::deserialize(bytes, "m.kiln"); },
                          {"m.kiln", "shape rank 100 is more than 64", fmt::format("at byte {}", at + 4)});
}

TEST(SerializeHostile, HostileDimTextIsALoadError) {
  const std::string good = compile_rich_model().serialize();
  std::string sum = "(a+b+c+d+e+f+g+h)", product = sum;
  for (int i = 1; i < 8; ++i) product += "*" + sum;
  for (const std::string& dim : {std::string(100000, '(') + "n" + std::string(100000, ')'), product}) {
    std::string bytes = good;
    const size_t at = reshape_dims_offset(bytes) + 4;
    bytes.replace(at, 4 + 5, u32_bytes(static_cast<uint32_t>(dim.size())) + dim);
    expect_error<LoadError>([&] { CompiledModel::deserialize(bytes, "m.kiln"); }, {"m.kiln", "bad dim"});
  }
}

TEST(SerializeHostile, ADirectoryIsALoadError) {
  const auto dir = std::filesystem::temp_directory_path();
  expect_error<LoadError>([&] { CompiledModel::load(dir); }, {dir.string(), "compiled artifact"});
}
