// The persistent compile cache: one artifact file per key, written atomically, evicted LRU by mtime.
#include "kiln/engine/compile_cache.h"

#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>

#include "engine/cache_files.h"
#include "graph/hash.h"
#include "kiln/errors.h"
#include "kiln/ext/extensions.h"

namespace kiln::engine {

namespace fs = std::filesystem;

namespace {
constexpr std::string_view kEntrySuffix = ".kiln";
using cache_files::env;
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

uint64_t CompileCache::default_max_bytes() { return cache_files::env_bytes("KILN_CACHE_MAX_BYTES", uint64_t{1} << 30); }

std::string CompileCache::key(const graph::Module& module, const compiler::CompileOptions& options) {
  Fnv1a64 hash;
  hash.field(cache_files::cpu_features());
  hash.field(cache_files::build_id());
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
    cache_files::touch(file);  // another process may have evicted it meanwhile: still a hit
    return compiled;
  } catch (const LoadError&) {
    cache_files::remove_if_unchanged(file, before);  // a bad entry, unless a store replaced it meanwhile
    return std::nullopt;
  }
}

void CompileCache::store(const std::string& key, const compiler::CompiledModel& compiled) const {
  std::error_code ec;
  fs::create_directories(dir_, ec);
  if (ec)
    throw Error(fmt::format("compile cache: cannot create directory '{}': {}", dir_.string(), ec.message()));
  // Concurrent stores never write the same temp file; rename() then replaces the entry atomically
  // (readers see the old or the new file, never half).
  const fs::path temp = cache_files::temp_path(dir_, key);
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

std::vector<CacheEntry> CompileCache::entries() const { return cache_files::entries(dir_, kEntrySuffix); }
uint64_t CompileCache::size_bytes() const { return cache_files::total_bytes(entries()); }
size_t CompileCache::clear() const { return cache_files::clear(dir_, kEntrySuffix); }
void CompileCache::evict() const { cache_files::evict(dir_, kEntrySuffix, max_bytes_); }

}  // namespace kiln::engine
