// The persistent compile cache: one artifact file per key, written atomically, evicted LRU by mtime.
#include "kiln/engine/compile_cache.h"

#include <dlfcn.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <random>

#include "graph/hash.h"
#include "kiln/errors.h"
#include "kiln/ext/extensions.h"

namespace kiln::engine {

namespace fs = std::filesystem;

namespace {

constexpr std::string_view kEntrySuffix = ".kiln";

// The ISA extensions the CPU kernels may dispatch on: an entry compiled on another CPU is not reused.
std::string cpu_features() {
  std::string features;
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx")) features += "avx,";
  if (__builtin_cpu_supports("avx2")) features += "avx2,";
  if (__builtin_cpu_supports("fma")) features += "fma,";
  if (__builtin_cpu_supports("f16c")) features += "f16c,";
  if (__builtin_cpu_supports("avx512f")) features += "avx512f,";
  if (__builtin_cpu_supports("avx512bw")) features += "avx512bw,";
  if (__builtin_cpu_supports("avx512vl")) features += "avx512vl,";
#elif defined(__aarch64__)
  features = "aarch64";
#endif
  return features;
}

// Identifies the compiler build beyond the version, which stays the same across development builds:
// the path, size and mtime of the file that holds this code (libkiln.so, or the program kiln is
// linked into), so a relinked library or program (changed passes or kernels) never reuses entries
// an older build made. A deployed binary keeps its entries across runs.
std::string build_id() {
  std::error_code ec;
  fs::path exe;
  Dl_info info{};
  if (dladdr(reinterpret_cast<const void*>(&build_id), &info) != 0 && info.dli_fname && *info.dli_fname)
    exe = fs::canonical(info.dli_fname, ec);
  if (exe.empty() || ec) exe = fs::read_symlink("/proc/self/exe", ec);
  if (ec) return "unknown-build";
  auto size = fs::file_size(exe, ec);
  auto time = fs::last_write_time(exe, ec);
  if (ec) return "unknown-build";
  return fmt::format("{}:{}:{}", exe.string(), size, time.time_since_epoch().count());
}

const char* env(const char* name) {
  const char* value = std::getenv(name);
  return value && *value ? value : nullptr;
}

}  // namespace

CompileCache::CompileCache(fs::path dir, uint64_t max_bytes)
    : dir_(dir.empty() ? default_dir() : std::move(dir)),
      max_bytes_(max_bytes == 0 ? default_max_bytes() : max_bytes) {}

fs::path CompileCache::default_dir() {
  if (const char* dir = env("KILN_CACHE_DIR")) return dir;
  if (const char* xdg = env("XDG_CACHE_HOME")) return fs::path(xdg) / "kiln";
  if (const char* home = env("HOME")) return fs::path(home) / ".cache" / "kiln";
  throw ValueError("CompileCache: no cache directory: set KILN_CACHE_DIR, XDG_CACHE_HOME or HOME");
}

uint64_t CompileCache::default_max_bytes() {
  const char* text = env("KILN_CACHE_MAX_BYTES");
  if (!text) return uint64_t{1} << 30;
  char* end = nullptr;
  errno = 0;
  unsigned long long value = std::strtoull(text, &end, 10);
  if (errno != 0 || *end != '\0' || value == 0 || text[0] == '-')
    throw ValueError(
        fmt::format("KILN_CACHE_MAX_BYTES: expected a positive integer (bytes), got '{}'", text));
  return value;
}

std::string CompileCache::key(const graph::Module& module, const compiler::CompileOptions& options) {
  static const std::string features = cpu_features();
  static const std::string build = build_id();
  Fnv1a64 hash;
  hash.field(features);
  hash.field(build);
  // An artifact names the libraries it calls by path (cache_key covers their content only): an
  // entry made against a library at another path must not be reused.
  for (const auto& g : module.graphs())
    for (const graph::Node& node : g->nodes)
      if ((node.op == graph::Op::custom || node.op == graph::Op::inplace_custom) && options.extensions)
        if (const ext::CustomOp* op =
                options.extensions->find(graph::get_attr<std::string>(node.attrs, "symbol", node.op)))
          hash.field(op->library().path().string());
  return fmt::format("{}-{:016x}", compiler::cache_key(module, options), hash.value);
}

std::optional<compiler::CompiledModel> CompileCache::find(const std::string& key) const {
  fs::path file = dir_ / (key + std::string(kEntrySuffix));
  struct stat before {};
  if (::stat(file.c_str(), &before) != 0) return std::nullopt;
  try {
    compiler::CompiledModel compiled = compiler::CompiledModel::load(file);
    std::error_code ignored;  // another process may have evicted it meanwhile: still a hit
    fs::last_write_time(file, fs::file_time_type::clock::now(), ignored);
    return compiled;
  } catch (const LoadError&) {
    // Remove the bad entry, unless a store has replaced it meanwhile (a store renames a whole new
    // file over the old one, so the path then names another inode): a good entry must stay.
    struct stat now {};
    if (::stat(file.c_str(), &now) == 0 && now.st_ino == before.st_ino && now.st_dev == before.st_dev) {
      std::error_code ignored;
      fs::remove(file, ignored);
    }
    return std::nullopt;
  }
}

void CompileCache::store(const std::string& key, const compiler::CompiledModel& compiled) const {
  std::error_code ec;
  fs::create_directories(dir_, ec);
  if (ec)
    throw Error(fmt::format("compile cache: cannot create directory '{}': {}", dir_.string(), ec.message()));
  // A name no other process or thread uses, so concurrent stores never write the same temp file;
  // rename() then replaces the entry atomically (readers see the old or the new file, never half).
  static std::atomic<uint64_t> counter{0};
  fs::path temp = dir_ / fmt::format(".{}.{}.{}.tmp", key, ::getpid(), counter++);
  try {
    compiled.save(temp);
  } catch (const std::exception& e) {
    fs::remove(temp, ec);  // a full disk leaves a partial file: never keep it
    throw Error(
        fmt::format("compile cache: cannot store entry '{}' in '{}': {}", key, dir_.string(), e.what()));
  }
  fs::rename(temp, dir_ / (key + std::string(kEntrySuffix)), ec);
  if (ec) {
    fs::remove(temp, ec);
    throw Error(fmt::format("compile cache: cannot store entry '{}' in '{}'", key, dir_.string()));
  }
  evict();
}

std::vector<CacheEntry> CompileCache::entries() const {
  std::vector<CacheEntry> result;
  std::error_code ec;
  for (fs::directory_iterator it(dir_, ec), end; !ec && it != end; it.increment(ec)) {
    const fs::path& path = it->path();
    std::string name = path.filename().string();
    if (path.extension() != kEntrySuffix || name.front() == '.') continue;
    std::error_code stat_ec;  // entries may vanish under a concurrent eviction
    uint64_t bytes = fs::file_size(path, stat_ec);
    auto time = fs::last_write_time(path, stat_ec);
    if (stat_ec) continue;
    result.push_back({path.stem().string(), path, bytes, time});
  }
  std::sort(result.begin(), result.end(),
            [](const CacheEntry& a, const CacheEntry& b) { return a.last_used < b.last_used; });
  return result;
}

uint64_t CompileCache::size_bytes() const {
  uint64_t total = 0;
  for (const CacheEntry& e : entries()) total += e.bytes;
  return total;
}

size_t CompileCache::clear() const {
  size_t removed = 0;
  for (const CacheEntry& e : entries()) {
    std::error_code ec;
    removed += fs::remove(e.file, ec);
  }
  return removed;
}

void CompileCache::evict() const {
  std::vector<CacheEntry> all = entries();
  uint64_t total = 0;
  for (const CacheEntry& e : all) total += e.bytes;
  for (const CacheEntry& e : all) {
    if (total <= max_bytes_) break;
    std::error_code ec;
    fs::remove(e.file, ec);
    total -= e.bytes;
  }
}

}  // namespace kiln::engine
