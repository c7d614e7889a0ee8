// The packed-weight cache (kiln/engine/weight_cache.h) under real sessions and model files: a weight
// mapped from a file is packed by one session, mapped from the cache by the next with the same bits,
// and a rewritten file is never served the old file's panels.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <random>
#include <vector>

#include "kiln/engine/weight_cache.h"
#include "kiln/kiln.h"
#include "kiln/pipelines/safetensors.h"
#include "test_util.h"

namespace {

using namespace kiln;
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

}  // namespace
