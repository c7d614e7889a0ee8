// The compile cache and custom extensions: a rebuilt library misses the cache, the original hits it.
#include <gtest/gtest.h>
#include <kiln/engine/compile_cache.h>
#include <kiln/kiln.h>
#include <unistd.h>

#include <filesystem>

using namespace kiln;
using graph::TensorType;
namespace ops = kiln::graph::ops;
namespace fs = std::filesystem;

namespace {

const std::string kExample = KILN_EXAMPLE_EXTENSION;     // scale_add: x * scale + y
const std::string kExampleB = KILN_EXAMPLE_EXTENSION_B;  // the same, rebuilt: scale_add adds 1000

Tensor vec(const std::vector<float>& v) { return Tensor::from_vector(v, {static_cast<int64_t>(v.size())}); }

TEST(CompileCache, RebuiltExtensionMissesTheCache) {
  const fs::path root = fs::temp_directory_path() / ("kiln_cache_ext_" + std::to_string(::getpid()));
  fs::remove_all(root);
  fs::create_directories(root);
  const fs::path library = root / "scale_add.so", cache_dir = root / "cache";
  fs::copy_file(kExample, library);
  engine::SessionOptions options;
  options.compile_cache_dir = cache_dir;

  graph::Graph g("g", {TensorType{DType::f32, {2}}, TensorType{DType::f32, {2}}});
  {
    graph::Graph::Scope scope(g);
    g.output(
        ops::custom("scale_add", {g.inputs()[0], g.inputs()[1]}, {g.inputs()[0].type()}, {{"scale", 2.0}}));
  }
  const std::vector<Tensor> inputs = {vec({1, 2}), vec({3, 4})};
  {
    engine::InferenceSession cold({DeviceRef::CPU()}, {library}, options);
    EXPECT_EQ(cold.load(g).execute(inputs).at(0).to_vector<float>(), (std::vector<float>{5, 8}));
    EXPECT_EQ(cold.cache_hits(), 0);
  }
  {
    engine::InferenceSession warm({DeviceRef::CPU()}, {library}, options);
    EXPECT_EQ(warm.load(g).execute(inputs).at(0).to_vector<float>(), (std::vector<float>{5, 8}));
    EXPECT_EQ(warm.cache_hits(), 1);
  }
  fs::copy_file(kExampleB, library, fs::copy_options::overwrite_existing);  // "rebuild" it in place
  {
    engine::InferenceSession rebuilt({DeviceRef::CPU()}, {library}, options);
    EXPECT_EQ(rebuilt.load(g).execute(inputs).at(0).to_vector<float>(), (std::vector<float>{1005, 1008}));
    EXPECT_EQ(rebuilt.cache_hits(), 0);
    EXPECT_EQ(rebuilt.compile_count(), 1);
  }
  EXPECT_EQ(engine::CompileCache(cache_dir).entries().size(), 2u);  // one per library content
  fs::remove_all(root);
}

}  // namespace
