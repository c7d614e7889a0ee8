// The packed-weight cache (kiln/engine/weight_cache.h) under real sessions and model files: a weight
// mapped from a file is packed by one session, mapped from the cache by the next with the same bits,
// and a rewritten file is never served the old file's panels; weights converted at load
// (pipelines::convert_weights) are kept there too, and a later load maps them without reading the
// checkpoint.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <random>
#include <vector>

#include "kiln/engine/weight_cache.h"
#include "kiln/kiln.h"
#include "kiln/pipelines/safetensors.h"
#include "kiln/pipelines/weight_conversion.h"
#include "tensor/host_memory.h"
#include "test_util.h"

namespace {

using namespace kiln;
using kiln::testing::resident_bytes_of;
using kiln::testing::TempDir;
namespace fs = std::filesystem;
namespace ops = kiln::graph::ops;

// y = x @ w, w [40, 70] from a safetensors file: on a SIMD CPU the matmul packs w at init (the lhs's
// rows are symbolic). The first session packs it into the cache, the second maps that entry, and both
// give the naive product; after the file is rewritten with other values, the next session packs anew.
TEST(WeightCache, WeightFromAFileIsPackedOnceThenMappedByLaterSessions) {
  if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma"))
    GTEST_SKIP() << "no AVX2: the portable GEMM packs nothing";
  TempDir dir;
  fs::create_directories(dir.path());
  const fs::path file = dir.path() / "model.safetensors";
  const int64_t K = 40, N = 70, M = 5;
  auto weight_values = [&](uint32_t seed) {
    std::mt19937 rng(seed);
    std::vector<float> v(static_cast<size_t>(K * N));
    for (float& x : v) x = std::uniform_real_distribution<float>(-1, 1)(rng);
    return v;
  };
  std::vector<float> x(static_cast<size_t>(M * K));
  for (size_t i = 0; i < x.size(); ++i) x[i] = std::sin(0.37f * static_cast<float>(i));
  graph::Graph g("proj", {graph::TensorType{DType::f32, {"batch", K}}});
  {
    graph::Graph::Scope scope(g);
    g.output({ops::matmul(g.input(0), g.weight({"w", DType::f32, {K, N}}))});
  }
  engine::SessionOptions options;
  options.compile_cache_dir = dir.path() / "cache";
  auto run = [&](int64_t* hits, int64_t* stores) {
    engine::InferenceSession session({DeviceRef::CPU()}, {}, options);
    engine::Model model = session.load(g.module(), pipelines::load_safetensors(file));
    const std::vector<Tensor> out = model.execute({Tensor::from_vector<float>(x, {M, K})});
    *hits = session.weight_cache()->hits();
    *stores = session.weight_cache()->stores();
    const float* y = static_cast<const float*>(out.at(0).data());
    return std::vector<float>(y, y + M * N);
  };
  auto naive = [&](const std::vector<float>& w) {
    std::vector<float> y(static_cast<size_t>(M * N));
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < N; ++n) {
        double s = 0;
        for (int64_t k = 0; k < K; ++k) s += double{x[m * K + k]} * w[k * N + n];
        y[m * N + n] = static_cast<float>(s);
      }
    return y;
  };
  auto expect_near = [&](const std::vector<float>& got, const std::vector<float>& want, const char* what) {
    for (size_t i = 0; i < want.size(); ++i) ASSERT_NEAR(got[i], want[i], 1e-4) << what << " at " << i;
  };
  for (uint32_t seed : {7u, 8u}) {
    SCOPED_TRACE(seed);
    const std::vector<float> w = weight_values(seed);
    fs::remove(file);  // a new file (another inode and mtime), as a converter writes one
    pipelines::save_safetensors(file, {{"w", Tensor::from_vector<float>(w, {K, N})}});
    int64_t hits = 0, stores = 0;
    const std::vector<float> first = run(&hits, &stores);
    EXPECT_EQ(hits, 0) << "a new file is never served another file's panels";
    EXPECT_EQ(stores, 1);
    expect_near(first, naive(w), "packed");
    const std::vector<float> second = run(&hits, &stores);
    EXPECT_EQ(hits, 1);
    EXPECT_EQ(stores, 0);
    EXPECT_EQ(second, first) << "the cached panels are the packed ones, bit for bit";
  }
  options.weight_cache = false;
  engine::InferenceSession off({DeviceRef::CPU()}, {}, options);
  EXPECT_EQ(off.weight_cache(), nullptr);
}

std::vector<uint8_t> bytes_of(const Tensor& t) {
  const auto* p = static_cast<const uint8_t*>(t.data());
  return std::vector<uint8_t>(p, p + t.nbytes());
}

// A checkpoint's f32 matrices converted at load, one to Q8_0 rows and one to bf16 for a matmul: the
// first load converts them into cache entries (and the matmul's panels of the bf16 one into another),
// the next maps all three and converts nothing. Either way the bytes are what converting the same
// values in memory gives, and the process keeps none of the checkpoint's pages nor the converted
// entries' (they stay in the page cache; a reader reads them back).
TEST(WeightCache, WeightsConvertedAtLoadAreKeptAndMappedWithoutReadingTheCheckpoint) {
  TempDir dir;
  fs::create_directories(dir.path());
  const fs::path file = dir.path() / "model.safetensors", cache_dir = dir.path() / "cache";
  const int64_t rows = 64, cols = 256, M = 3;  // entries of 4.25 and 8 pages
  std::mt19937 rng(11);
  std::vector<float> q(static_cast<size_t>(rows * cols)), w(static_cast<size_t>(cols * rows));
  for (float& x : q) x = std::uniform_real_distribution<float>(-2, 2)(rng);
  for (float& x : w) x = std::uniform_real_distribution<float>(-1, 1)(rng);
  const WeightsRegistry in_memory{{"q", Tensor::from_vector<float>(q, {rows, cols})},
                                  {"w", Tensor::from_vector<float>(w, {cols, rows})}};
  pipelines::save_safetensors(file, in_memory);
  const int64_t q8_0_row = graph::quantized_row_bytes(graph::QuantizationEncoding::q8_0, cols, "q");
  const std::map<std::string, graph::Weight> declared{
      {"q", graph::Weight{"q", DType::u8, graph::Shape::of({rows, q8_0_row}), DeviceRef::CPU()}},
      {"w", graph::Weight{"w", DType::bf16, graph::Shape::of({cols, rows}), DeviceRef::CPU()}}};
  const WeightsRegistry want = pipelines::convert_weights(in_memory, declared, 2, graph::QuantizationEncoding::q8_0);

  graph::Graph g("proj", {graph::TensorType{DType::f32, {"batch", cols}}});
  {
    graph::Graph::Scope scope(g);
    g.output({ops::matmul(g.input(0), ops::cast(g.weight({"w", DType::bf16, {cols, rows}}), DType::f32))});
  }
  std::vector<float> x(static_cast<size_t>(M * cols));
  for (size_t i = 0; i < x.size(); ++i) x[i] = std::cos(0.11f * static_cast<float>(i));
  engine::SessionOptions options;
  options.compile_cache_dir = cache_dir;

  std::vector<float> first_y;
  for (int load = 0; load < 2; ++load) {
    SCOPED_TRACE(load);
    const WeightsRegistry checkpoint = pipelines::load_safetensors(file);
    // The kernel may map neighbours of the header's page in (fault-around), and conversion keeps the
    // pages q and w share with a neighbour: beyond those, none of the checkpoint's pages may stay.
    const size_t header_pages = resident_bytes_of(file);
    const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
    size_t may_stay = (fs::file_size(file) + page - 1) / page * page;
    for (const char* name : {"q", "w"}) {
      const auto [lo, hi] = whole_pages(checkpoint.at(name).data(), checkpoint.at(name).nbytes());
      if (hi > lo) may_stay -= hi - lo;
    }
    ASSERT_LT(may_stay, fs::file_size(file) / 4) << "the bound must say something";
    const engine::WeightCache cache(cache_dir / "weights");
    const WeightsRegistry converted =
        pipelines::convert_weights(checkpoint, declared, 2, graph::QuantizationEncoding::q8_0, {}, &cache);
    EXPECT_EQ(cache.hits(), load == 0 ? 0 : 2);
    EXPECT_EQ(cache.stores(), load == 0 ? 2 : 0);
    EXPECT_LE(resident_bytes_of(file), std::max(header_pages, may_stay)) << "the checkpoint's pages read to convert are dropped";
    // The entries' pages are dropped once written or checked: all but the Q8_0 entry's last, partial page.
    EXPECT_LE(resident_bytes_of(cache_dir), static_cast<size_t>(::sysconf(_SC_PAGESIZE)));
    for (const char* name : {"q", "w"}) {
      SCOPED_TRACE(name);
      const Tensor& t = converted.at(name);
      const std::optional<std::string> source = mapped_source(t.keep_alive(), t.data(), t.nbytes());
      ASSERT_TRUE(source) << "converted bytes name their file and conversion";
      EXPECT_NE(source->find(name[0] == 'q' ? "as q8_0 rows" : "as bf16"), std::string::npos) << *source;
      EXPECT_EQ(bytes_of(t), bytes_of(want.at(name)));
    }
    EXPECT_GT(resident_bytes_of(cache_dir), 0u);  // read back to compare

    engine::InferenceSession session({DeviceRef::CPU()}, {}, options);
    engine::Model model = session.load(g.module(), converted);
    const Tensor y = model.execute({Tensor::from_vector<float>(x, {M, cols})}).at(0);
    const float* p = static_cast<const float*>(y.data());
    const std::vector<float> got(p, p + M * rows);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < rows; ++n) {
        double sum = 0;
        for (int64_t k = 0; k < cols; ++k)
          sum += double{x[m * cols + k]} * static_cast<float>(static_cast<const bf16_t*>(want.at("w").data())[k * rows + n]);
        ASSERT_NEAR(got[m * rows + n], sum, 1e-3) << m << ", " << n;
      }
    if (load == 0) first_y = got;
    else EXPECT_EQ(got, first_y) << "the same bits from the cached panels";
  }
}

}  // namespace
