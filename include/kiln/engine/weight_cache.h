// A persistent cache of packed weights: the copies kernels make at init of weights read from a file
// (GEMM panels, quantized panels), kept as files beside the compile cache (its directory's weights/)
// so a later init of the same file maps them instead of packing again. A load then costs about what
// mapping the model file costs, and the system zeroes no fresh memory for the copies: they are the
// cache file's pages, shared by every process that maps them.
//
// An entry is keyed by what determines its bytes: the weight's file (device, inode, size and mtime),
// its offset and length there, the kernel's description of its packing, the CPU's features and this
// build of kiln (so a rebuilt kiln with another layout never reads an older entry). Entries are
// written atomically (temp file + rename), bounded in total size (least recently used evicted), and
// validated when read: an entry whose header does not match (magic, version, key, length) or whose
// payload does not match the header's XXH3 checksums (one per 64 MiB chunk, checked in parallel: a
// torn write after a crash, a bad disk) is removed and counts as a miss. The payload is hashed once
// per boot (when stored, or at the first read after a boot or a write to the file: docs/artifacts.md).
//
//   kiln::engine::WeightCache cache;               // KILN_CACHE_DIR/weights, or ~/.cache/kiln/weights
//   WeightCache::Entry e = cache.acquire(key, bytes);
//   if (e.filled) use(e.data); else if (e.data) { pack_into(e.data.get()); e.commit(); }
#pragma once

#include <atomic>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "kiln/engine/compile_cache.h"
#include "kiln/logging.h"

namespace kiln::engine {

class WeightCache {
 public:
  // dir empty: default_dir(); max_bytes 0: default_max_bytes(). The directory is created on first
  // store. `logger` (default_logger() when null) hears of a store that failed, once.
  explicit WeightCache(std::filesystem::path dir = {}, uint64_t max_bytes = 0, std::shared_ptr<Logger> logger = nullptr);

  // CompileCache::default_dir() / "weights".
  static std::filesystem::path default_dir();
  // KILN_WEIGHT_CACHE_MAX_BYTES (a positive integer; ValueError naming it otherwise), else 32 GiB.
  static uint64_t default_max_bytes();
  // The key of a packed copy: `source` (the weight's file identity, offset and length; see
  // FileMapping::source_of), the kernel's `packing`, the CPU's features and this build: 32 hex digits.
  static std::string key(const std::string& source, std::string_view packing);

  // Runs body(i) for every i in [0, count), on as many threads as the caller has (an engine's pool):
  // the checksums of an entry's chunks. Empty: on the calling thread.
  using ForEach = std::function<void(size_t count, const std::function<void(size_t)>& body)>;

  const std::filesystem::path& dir() const { return dir_; }
  uint64_t max_bytes() const { return max_bytes_; }

  // The entry's payload, mapped read-only, when an entry of exactly `bytes` is stored under `key`
  // (marked as just used); null on a miss. An entry whose header does not match is removed.
  std::shared_ptr<const void> find(const std::string& key, uint64_t bytes, const ForEach& for_each = {}) const;
  // A new entry being made, room made for it first (evict's rule): `data` is `bytes` of a writable
  // shared mapping of its (temp) file, where the caller packs; commit() then checksums it, writes its
  // header and renames it into place as the entry `key` (atomically: readers see no entry or the
  // whole one). The
  // mapping stays valid either way; dropped without commit, the temp file is removed. So a packed
  // copy is made once, in the pages the cache keeps, with no second copy and no write() of it.
  struct NewEntry {
    std::shared_ptr<void> data;
    std::function<void()> commit;
  };
  // nullopt when no entry can be made: one that does not fit beside this object's own entries in
  // max_bytes (then none is made any more), one that would leave the file system under 1 GiB free,
  // or a cache that cannot be written (read-only; warned once, then no more tries). Never throws.
  std::optional<NewEntry> create(const std::string& key, uint64_t bytes, const ForEach& for_each = {}) const;
  // The one way to find or make an entry: what find() maps (`filled`: used as it is), else what
  // create() makes (pack into `data`, then call `commit`), else nothing (`data` null).
  struct Entry {
    std::shared_ptr<void> data;  // read only when filled
    bool filled = false;
    std::function<void()> commit;
  };
  Entry acquire(const std::string& key, uint64_t bytes, const ForEach& for_each = {}) const;
  // create() and commit() of a copy of `bytes` at `data`; false when not stored.
  bool store(const std::string& key, const void* data, uint64_t bytes) const;

  std::vector<CacheEntry> entries() const;  // least recently used first
  uint64_t size_bytes() const;
  size_t clear() const;  // removes every entry; returns how many
  // Removes the least recently used entries beyond max_bytes, but none used since this object was
  // made (the model being loaded): when those alone fill the bound, no more entries are made, so a
  // model larger than the bound is partly cached instead of rewriting the cache on every load.
  void evict() const;

  int64_t hits() const { return hits_.load(); }
  int64_t stores() const { return stores_.load(); }

 private:
  std::filesystem::path dir_;
  uint64_t max_bytes_;
  std::shared_ptr<Logger> logger_;
  std::filesystem::file_time_type created_;  // entries used since are this object's loads'
  mutable std::atomic<bool> unwritable_{false}, full_{false}, disk_short_{false};
  mutable std::atomic<int64_t> hits_{0}, stores_{0};
};

}  // namespace kiln::engine
