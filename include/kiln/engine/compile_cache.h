// A persistent compile cache: CompiledModels stored as artifact files (CompiledModel::save) in a
// directory, keyed by compiler::cache_key (printed module, compiler version, options, custom
// extensions' content hashes) plus the host CPU's features. Safe for several processes at once (an
// entry is written to a temp file and renamed into place) and bounded in size: a hit refreshes the
// entry's mtime, and a store evicts the least recently used entries beyond max_bytes.
//
//   kiln::engine::CompileCache cache;               // KILN_CACHE_DIR, or $XDG_CACHE_HOME/kiln, ~/.cache/kiln
//   if (auto hit = cache.find(key)) ...; else cache.store(key, compiler::compile(module));
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "kiln/compiler/compiled_model.h"

namespace kiln::engine {

struct CacheEntry {
  std::string key;
  std::filesystem::path file;
  uint64_t bytes = 0;
  std::filesystem::file_time_type last_used;  // the file's mtime
};

class CompileCache {
 public:
  // dir empty: default_dir(); max_bytes 0: default_max_bytes(). The directory is created on first store.
  explicit CompileCache(std::filesystem::path dir = {}, uint64_t max_bytes = 0);

  // KILN_CACHE_DIR, else $XDG_CACHE_HOME/kiln, else $HOME/.cache/kiln (ValueError if none is set).
  static std::filesystem::path default_dir();
  // KILN_CACHE_MAX_BYTES (a positive integer; ValueError naming it otherwise), else 1 GiB.
  static uint64_t default_max_bytes();
  // compiler::cache_key plus the CPU features kernels dispatch on, the running executable's build
  // (path, size, mtime: development builds share KILN_VERSION) and the paths of the custom-op
  // libraries called (an artifact refers to them by path): 16 hex digits, '-', 16 hex digits.
  static std::string key(const graph::Module& module, const compiler::CompileOptions& options);

  const std::filesystem::path& dir() const { return dir_; }
  uint64_t max_bytes() const { return max_bytes_; }

  // The entry stored under `key`, marked as just used; nullopt on a miss. An entry that no longer
  // loads (corrupted, or from another kiln version) is removed and counts as a miss.
  std::optional<compiler::CompiledModel> find(const std::string& key) const;
  // Writes the entry atomically (temp file + rename), then evicts the oldest entries beyond max_bytes.
  void store(const std::string& key, const compiler::CompiledModel& compiled) const;

  std::vector<CacheEntry> entries() const;  // least recently used first
  uint64_t size_bytes() const;
  size_t clear() const;  // removes every entry; returns how many
  void evict() const;    // removes least recently used entries until the total fits max_bytes

 private:
  std::filesystem::path dir_;
  uint64_t max_bytes_;
};

}  // namespace kiln::engine
