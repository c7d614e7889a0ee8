// Private: what the persistent caches (CompileCache, WeightCache) share: a directory of entry files
// named by key, written atomically (temp file + rename), listed and evicted least recently used first
// by mtime, and the identity of this build and CPU that their keys include.
#pragma once

#include <sys/stat.h>

#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include "kiln/engine/compile_cache.h"

namespace kiln::engine::cache_files {

// The entries `<key><suffix>` of dir (temp files, which start with '.', excluded), least recently used
// first. A missing directory has none.
std::vector<CacheEntry> entries(const std::filesystem::path& dir, std::string_view suffix);
uint64_t total_bytes(const std::vector<CacheEntry>& entries);
size_t clear(const std::filesystem::path& dir, std::string_view suffix);  // returns how many were removed
// Removes the orphan temps, then least recently used entries until the rest and `entry_bytes` more
// total at most max_bytes, and at most what the entries hold now plus `disk_room` (the bytes the disk
// can still give them), but none used since `keep_since`; whether they then fit.
bool evict(const std::filesystem::path& dir, std::string_view suffix, uint64_t max_bytes, uint64_t entry_bytes = 0,
           std::filesystem::file_time_type keep_since = std::filesystem::file_time_type::max(),
           uint64_t disk_room = UINT64_MAX);
// Removes the temp files of processes that no longer run (one killed while writing an entry).
void remove_orphan_temps(const std::filesystem::path& dir);
// A temp file name in dir no other process or thread uses for `key`; rename() it over the entry.
std::filesystem::path temp_path(const std::filesystem::path& dir, std::string_view key);
// Removes `file` unless it is no longer the inode `before` describes (a store has renamed a new entry
// over it meanwhile, which must stay).
void remove_if_unchanged(const std::filesystem::path& file, const struct stat& before);
// Marks an entry just used (its mtime), for eviction; an entry evicted meanwhile is no error.
void touch(const std::filesystem::path& file);

// The ISA extensions CPU kernels may dispatch on.
const std::string& cpu_features();
// This build beyond its version (development builds share it): the path, size and mtime of the file
// that holds this code (libkiln.so, or the program kiln is linked into).
const std::string& build_id();
// An environment variable's value, nullptr when unset or empty.
const char* env(const char* name);
// A positive byte count from environment variable `name` (ValueError naming it otherwise), or fallback.
uint64_t env_bytes(const char* name, uint64_t fallback);

}  // namespace kiln::engine::cache_files
