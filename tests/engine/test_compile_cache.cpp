// Compiled artifacts end to end and the persistent compile cache: save -> load -> init -> execute,
// cache hits that skip the compiler, two processes filling one cache directory, LRU eviction, and
// the cache's directory and size settings.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

#include "cpu_kernel_catalog.h"
#include "kiln/engine/compile_cache.h"
#include "kiln/kiln.h"
#include "nn/capturing_logger.h"
#include "test_util.h"

namespace {

using namespace kiln;
using engine::CompileCache;
using engine::InferenceSession;
using engine::SessionOptions;
using graph::TensorType;
using kiln::testing::expect_error;
namespace ops = kiln::graph::ops;
namespace fs = std::filesystem;

using kiln::testing::ScopedEnv;
using kiln::testing::TempDir;

SessionOptions cached_in(const fs::path& dir) {
  SessionOptions options;
  options.compile_cache_dir = dir;
  return options;
}

// y = relu(x @ w) + offset, offset a constant: a weight, a constant and a symbolic batch.
graph::Module relu_proj_module(float offset = 0.5f) {
  graph::Graph g("proj", {TensorType{DType::f32, {"batch", 3}}});
  graph::Graph::Scope scope(g);
  auto w = g.weight({"w", DType::f32, {3, 2}});
  g.output({ops::add(ops::relu(ops::matmul(g.input(0), w)), ops::constant(offset, DType::f32))});
  return g.module();
}

const WeightsRegistry kWeights = {{"w", Tensor::from_vector<float>({1, -1, 2, 0, -1, 3}, {3, 2})}};
const Tensor kX = Tensor::from_vector<float>({1, 2, 3, -1, 0, 1}, {2, 3});
// By hand: row 0: [1+4-3, -1+0+9] = [2, 8]; row 1: [-1+0-1, 1+0+3] = [-2, 4]; relu, + 0.5.
const std::vector<float> kExpected = {2.5f, 8.5f, 0.5f, 4.5f};

TEST(Artifacts, SaveLoadInitExecuteEqualsAFreshCompile) {
  TempDir dir;
  fs::create_directories(dir.path());
  SessionOptions no_cache;
  no_cache.compile_cache = false;
  InferenceSession session({DeviceRef::CPU()}, {}, no_cache);
  auto fresh = session.compile(relu_proj_module());
  fresh.save(dir.path() / "proj.kiln");
  auto loaded = engine::CompiledModel::load(dir.path() / "proj.kiln");
  auto from_file = session.init(loaded, kWeights).at("proj").execute({kX})[0].to_vector<float>();
  auto from_fresh = session.init(fresh, kWeights).at("proj").execute({kX})[0].to_vector<float>();
  EXPECT_EQ(from_file, kExpected);
  EXPECT_EQ(from_fresh, kExpected);
  // The artifact holds no weights: another registry gives other results from the same file.
  WeightsRegistry zeros = {{"w", Tensor::zeros(DType::f32, {3, 2})}};
  EXPECT_EQ(session.init(loaded, zeros).at("proj").execute({kX})[0].to_vector<float>(),
            (std::vector<float>{0.5f, 0.5f, 0.5f, 0.5f}));
  EXPECT_EQ(session.compile_count(), 1);
}

TEST(CompileCache, HitSkipsTheCompiler) {
  TempDir dir;
  InferenceSession first({DeviceRef::CPU()}, {}, cached_in(dir.path()));
  auto cold = first.load(relu_proj_module(), kWeights);
  EXPECT_EQ(first.compile_count(), 1);
  EXPECT_EQ(first.cache_hits(), 0);
  EXPECT_EQ(CompileCache(dir.path()).entries().size(), 1u);

  // A new session (as a new process would) finds the entry: a hit, the compiler does not run.
  InferenceSession second({DeviceRef::CPU()}, {}, cached_in(dir.path()));
  auto warm = second.load(relu_proj_module(), kWeights);
  EXPECT_EQ(second.cache_hits(), 1);
  EXPECT_EQ(second.compile_count() - second.cache_hits(), 0);
  EXPECT_EQ(warm.execute({kX})[0].to_vector<float>(), kExpected);
  EXPECT_EQ(cold.execute({kX})[0].to_vector<float>(), kExpected);

  // Another graph (a different constant) misses.
  second.load(relu_proj_module(2.0f), kWeights);
  EXPECT_EQ(second.cache_hits(), 1);
  EXPECT_EQ(CompileCache(dir.path()).entries().size(), 2u);
}

TEST(CompileCache, TurnedOffItNeverTouchesTheDirectory) {
  TempDir dir;
  SessionOptions options = cached_in(dir.path());
  options.compile_cache = false;
  InferenceSession session({DeviceRef::CPU()}, {}, options);
  session.load(relu_proj_module(), kWeights);
  session.load(relu_proj_module(), kWeights);
  EXPECT_EQ(session.cache_hits(), 0);
  EXPECT_EQ(session.compile_count(), 2);
  EXPECT_FALSE(fs::exists(dir.path()));
}

TEST(CompileCache, CorruptedEntryIsAMissAndIsReplaced) {
  TempDir dir;
  InferenceSession session({DeviceRef::CPU()}, {}, cached_in(dir.path()));
  session.compile(relu_proj_module());
  auto entries = CompileCache(dir.path()).entries();
  ASSERT_EQ(entries.size(), 1u);
  fs::resize_file(entries[0].file, entries[0].bytes / 2);
  auto model = session.load(relu_proj_module(), kWeights);
  EXPECT_EQ(session.cache_hits(), 0);
  EXPECT_EQ(model.execute({kX})[0].to_vector<float>(), kExpected);
  EXPECT_EQ(CompileCache(dir.path()).entries().at(0).bytes, entries[0].bytes);  // rewritten whole
}

// Each child compiles the same modules into one directory at the same time; both must succeed, and
// the directory must end with one whole entry per module (no temp files, nothing torn).
TEST(CompileCache, TwoProcessesFillingOneDirectoryBothSucceed) {
  TempDir dir;
  constexpr int kModules = 12;
  std::vector<pid_t> children;
  for (int child = 0; child < 2; ++child) {
    pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      int status = 0;
      try {
        SessionOptions options = cached_in(dir.path());
        options.num_threads = 1;
        InferenceSession session({DeviceRef::CPU()}, {}, options);
        for (int round = 0; round < 3; ++round)
          for (int m = 0; m < kModules; ++m) {
            auto out = session.load(relu_proj_module(static_cast<float>(m)), kWeights).execute({kX});
            if (out[0].to_vector<float>()[1] != 8.0f + static_cast<float>(m)) status = 2;
          }
      } catch (...) {
        status = 1;
      }
      ::_exit(status);
    }
    children.push_back(pid);
  }
  for (pid_t pid : children) {
    int status = -1;
    ASSERT_EQ(::waitpid(pid, &status, 0), pid);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "child status " << status;
  }
  CompileCache cache(dir.path());
  EXPECT_EQ(cache.entries().size(), static_cast<size_t>(kModules));
  size_t files = 0;
  for ([[maybe_unused]] const auto& f : fs::directory_iterator(dir.path())) ++files;
  EXPECT_EQ(files, static_cast<size_t>(kModules));  // no temp files left behind
  for (const auto& e : cache.entries()) EXPECT_NO_THROW(engine::CompiledModel::load(e.file)) << e.file;
}

TEST(CompileCache, EvictsLeastRecentlyUsedBeyondTheLimit) {
  TempDir dir;
  CompileCache unbounded(dir.path(), 1ull << 30);
  compiler::CompileOptions options;
  std::vector<std::string> keys;
  for (int m = 0; m < 3; ++m) {
    graph::Module module = relu_proj_module(static_cast<float>(m + 1));  // + 0 would be folded away
    keys.push_back(CompileCache::key(module, options));
    unbounded.store(keys.back(), compiler::compile(module, kiln::testing::with_cpu_kernels()));
  }
  // Ages set explicitly (oldest first: 0, 1, 2), then entry 0 is used: 1 becomes the oldest.
  auto now = fs::file_time_type::clock::now();
  for (int m = 0; m < 3; ++m)
    fs::last_write_time(dir.path() / (keys[static_cast<size_t>(m)] + ".kiln"),
                        now - std::chrono::hours(10 - m));
  ASSERT_TRUE(unbounded.find(keys[0]));
  uint64_t entry_bytes = 0;
  for (const auto& e : unbounded.entries()) entry_bytes = std::max(entry_bytes, e.bytes);

  CompileCache bounded(dir.path(), 2 * entry_bytes + entry_bytes / 2);  // room for two entries
  bounded.evict();
  EXPECT_FALSE(bounded.find(keys[1]));
  EXPECT_TRUE(bounded.find(keys[0]));
  EXPECT_TRUE(bounded.find(keys[2]));
  EXPECT_LE(bounded.size_bytes(), bounded.max_bytes());
  EXPECT_EQ(bounded.clear(), 2u);
  EXPECT_EQ(bounded.size_bytes(), 0u);
}

TEST(CompileCache, KeyChangesWithTheGraphButNotWithNothing) {
  compiler::CompileOptions options;
  EXPECT_EQ(CompileCache::key(relu_proj_module(1), options), CompileCache::key(relu_proj_module(1), options));
  EXPECT_NE(CompileCache::key(relu_proj_module(1), options), CompileCache::key(relu_proj_module(2), options));
  compiler::CompileOptions unoptimized;
  unoptimized.optimize = false;
  EXPECT_NE(CompileCache::key(relu_proj_module(1), options),
            CompileCache::key(relu_proj_module(1), unoptimized));
}

// Restores an environment variable when the test ends.

TEST(CompileCache, DirectoryAndLimitComeFromTheEnvironment) {
  {
    ScopedEnv dir("KILN_CACHE_DIR", "/tmp/kiln-explicit");
    EXPECT_EQ(CompileCache::default_dir(), fs::path("/tmp/kiln-explicit"));
  }
  {
    ScopedEnv dir("KILN_CACHE_DIR", nullptr);
    ScopedEnv xdg("XDG_CACHE_HOME", "/tmp/xdg");
    EXPECT_EQ(CompileCache::default_dir(), fs::path("/tmp/xdg/kiln"));
  }
  {
    ScopedEnv dir("KILN_CACHE_DIR", nullptr);
    ScopedEnv xdg("XDG_CACHE_HOME", nullptr);
    ScopedEnv home("HOME", "/home/someone");
    EXPECT_EQ(CompileCache::default_dir(), fs::path("/home/someone/.cache/kiln"));
  }
  {
    ScopedEnv limit("KILN_CACHE_MAX_BYTES", nullptr);
    EXPECT_EQ(CompileCache::default_max_bytes(), 1ull << 30);
  }
  {
    ScopedEnv limit("KILN_CACHE_MAX_BYTES", "4096");
    EXPECT_EQ(CompileCache::default_max_bytes(), 4096u);
  }
  {
    ScopedEnv limit("KILN_CACHE_MAX_BYTES", "lots");
    expect_error<ValueError>([] { CompileCache::default_max_bytes(); }, {"KILN_CACHE_MAX_BYTES", "'lots'"});
  }
}

}  // namespace

// ---- faults: an unusable cache costs compiles, never a run ---------------------------------------------

// The cache directory cannot be created (a path under a regular file: works as root too, where chmod
// would not stop writes): every compile still succeeds, and the session warns once.
TEST(CompileCacheFaults, UncreatableDirectoryWarnsOnceAndRunsUncached) {
  TempDir dir;
  fs::create_directories(dir.path());
  const fs::path file = dir.path() / "a-file";
  std::ofstream(file) << "not a directory";
  for (const fs::path& cache_dir : {file / "cache", file}) {
    auto logger = std::make_shared<kiln::testing::CapturingLogger>();
    SessionOptions options = cached_in(cache_dir);
    options.logger = logger;
    InferenceSession session({DeviceRef::CPU()}, {}, options);
    auto model = session.load(relu_proj_module(), kWeights);
    EXPECT_EQ(model.execute({kX})[0].to_vector<float>(), kExpected);
    session.load(relu_proj_module(2.0f), kWeights);
    session.load(relu_proj_module(), kWeights);
    EXPECT_EQ(session.compile_count(), 3);
    EXPECT_EQ(session.cache_hits(), 0);
    ASSERT_EQ(logger->warnings.size(), 1u) << cache_dir;
    EXPECT_NE(logger->warnings[0].find(cache_dir.string()), std::string::npos) << logger->warnings[0];
    EXPECT_NE(logger->warnings[0].find("not stored in the cache"), std::string::npos) << logger->warnings[0];
  }
}

TEST(CompileCacheFaults, StoreIntoAnUncreatableDirectoryIsAKilnError) {
  CompileCache cache("/dev/null/kiln-cache");
  InferenceSession session({DeviceRef::CPU()}, {}, {.compile_cache = false});
  const auto compiled = session.compile(relu_proj_module());
  expect_error<Error>([&] { cache.store("k", compiled); },
                      {"/dev/null/kiln-cache", "cannot create directory"});
  EXPECT_FALSE(cache.find("k").has_value());
}

TEST(CompileCacheFaults, AFullDiskIsAKilnErrorNamingTheFile) {
  if (!fs::exists("/dev/full")) GTEST_SKIP() << "no /dev/full";
  InferenceSession session({DeviceRef::CPU()}, {}, {.compile_cache = false});
  expect_error<Error>([&] { session.compile(relu_proj_module()).save("/dev/full"); },
                      {"/dev/full", "cannot write"});
}

// An entry with a count far past its bytes (as a hostile or torn file would have) is a miss: removed,
// recompiled and stored whole again. So is an entry that is a directory.
TEST(CompileCacheFaults, HostileEntriesAreDiscardedAndRecompiled) {
  TempDir dir;
  InferenceSession session({DeviceRef::CPU()}, {}, cached_in(dir.path()));
  session.compile(relu_proj_module());
  const auto entries = CompileCache(dir.path()).entries();
  ASSERT_EQ(entries.size(), 1u);
  std::string bytes;
  {
    std::ifstream in(entries[0].file, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), {});
  }
  {
    std::string hostile = bytes.substr(0, 12) + std::string(4, '\xff') + "tiny";  // a 4 GB version string
    std::ofstream(entries[0].file, std::ios::binary | std::ios::trunc) << hostile;
  }
  auto model = session.load(relu_proj_module(), kWeights);
  EXPECT_EQ(session.cache_hits(), 0);
  EXPECT_EQ(model.execute({kX})[0].to_vector<float>(), kExpected);
  EXPECT_EQ(CompileCache(dir.path()).entries().at(0).bytes, bytes.size());

  fs::remove(entries[0].file);
  fs::create_directories(entries[0].file);  // a directory where the entry should be
  model = session.load(relu_proj_module(), kWeights);
  EXPECT_EQ(model.execute({kX})[0].to_vector<float>(), kExpected);
  EXPECT_EQ(session.cache_hits(), 0);
}
