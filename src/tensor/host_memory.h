// Private: host memory for buffers that may be large and live long (tensors on cpu devices, weights
// packed at init, kernel scratch).
#pragma once

#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <optional>
#include <string>
#include <utility>

namespace kiln {

// Memory for buffers that may be large and live long (engine tensors, weights packed at init):
// 64-byte aligned, and from 2 MiB on 2 MiB-aligned with transparent huge pages advised, so that
// streaming through it does not miss the TLB every 4 KiB (the heap, where glibc puts most such
// blocks, gets no huge pages otherwise). nullptr when out of memory; free with std::free.
inline void* allocate_aligned(size_t bytes) {
  constexpr size_t kHugePage = size_t{2} << 20;
  const size_t alignment = bytes >= kHugePage ? kHugePage : 64;
  void* p = std::aligned_alloc(alignment, (bytes + alignment - 1) / alignment * alignment);
  if (p && bytes >= kHugePage) madvise(p, bytes, MADV_HUGEPAGE);  // a hint: failure is harmless
  return p;
}

// The whole pages inside [data, data + bytes), as [lo, hi) (empty when lo >= hi), so that advice given
// to them leaves a neighbour's partial page alone.
inline std::pair<uintptr_t, uintptr_t> whole_pages(const void* data, size_t bytes) {
  const auto first = reinterpret_cast<uintptr_t>(data);
  const auto page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  return {(first + page - 1) / page * page, (first + bytes) / page * page};
}

// Takes back allocate_aligned's huge-page advice for memory that is touched a little at a time over
// a long life, such as the KV cache, whose blocks a sequence fills as it grows: the system zeroes
// each page at its first touch, and a short request would otherwise fault in (and zero) a 2 MiB page
// per layer for K and for V. Call before the first touch; a hint, so failure is harmless.
inline void advise_small_pages(void* p, size_t bytes) {
  const auto [lo, hi] = whole_pages(p, bytes);
  if (hi > lo) madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_NOHUGEPAGE);
}

// Faults in every page that [p, p + bytes) touches, writable, in one call and without writing to them
// (MADV_POPULATE_WRITE, Linux 5.14), so a page shared with bytes in use keeps them: for memory about
// to be written a little at a time, where each first touch of a page would otherwise stop the writer
// for a fault. A hint: where the call fails, the first writes fault as before.
inline void populate_pages(void* p, size_t bytes) {
#ifndef MADV_POPULATE_WRITE
  constexpr int MADV_POPULATE_WRITE = 23;  // linux/mman.h; older C library headers lack it
#endif
  if (bytes == 0) return;
  const auto page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const auto first = reinterpret_cast<uintptr_t>(p) / page * page;
  const auto end = (reinterpret_cast<uintptr_t>(p) + bytes + page - 1) / page * page;
  madvise(reinterpret_cast<void*>(first), end - first, MADV_POPULATE_WRITE);
}

// The deleter of a whole file's read-only mapping (pipelines::map_file), which tensors viewing the
// file keep alive: it knows the mapping's extent, so pages of it can be dropped.
struct FileMapping {
  void* base = nullptr;
  size_t size = 0;
  // The file as it was mapped: "device:inode:size:mtime_ns" (a file replaced or rewritten since has
  // another), what the packed-weight cache keys a weight's bytes by.
  std::string file;
  void operator()(void* p) const { munmap(p, size); }
};

// The deleter of memory holding bytes computed from a mapped file's alone, e.g. a GGUF q/k weight with
// its rows un-permuted or a weight converted to another dtype at load: `source` names those bytes and
// the computation, so the packed-weight cache can key what is packed from them as it keys a file's
// own bytes.
struct DerivedBytes {
  void* base = nullptr;
  size_t size = 0;
  std::string source;
  // What holds the memory: a weight cache entry's mapping of its file (so its pages can be dropped
  // as a file's are); null: allocate_aligned's.
  std::shared_ptr<void> owner;
  void operator()(void* p) const {
    if (!owner) std::free(p);
  }
};

// The offset of [data, data + bytes) within [base, base + size); nullopt when it does not lie inside.
inline std::optional<size_t> offset_within(const void* base, size_t size, const void* data, size_t bytes) {
  const auto lo = reinterpret_cast<uintptr_t>(base), first = reinterpret_cast<uintptr_t>(data);
  if (!base || first < lo || first - lo > size || bytes > size - (first - lo)) return std::nullopt;
  return first - lo;
}

// Where [data, data + bytes) comes from when it lies within a FileMapping or DerivedBytes that
// `keep_alive` holds: "FILE@OFFSET+BYTES" (the file's identity, or the derived bytes' source);
// nullopt for memory of any other kind.
inline std::optional<std::string> mapped_source(const std::shared_ptr<void>& keep_alive, const void* data, size_t bytes) {
  void* base = nullptr;
  size_t size = 0;
  const std::string* source = nullptr;
  if (const FileMapping* mapping = std::get_deleter<FileMapping>(keep_alive)) {
    base = mapping->base, size = mapping->size, source = &mapping->file;
  } else if (const DerivedBytes* derived = std::get_deleter<DerivedBytes>(keep_alive)) {
    base = derived->base, size = derived->size, source = &derived->source;
  }
  const std::optional<size_t> offset = offset_within(base, size, data, bytes);
  if (!offset || source->empty()) return std::nullopt;
  return *source + "@" + std::to_string(*offset) + "+" + std::to_string(bytes);
}

// Drops this process's pages of [data, data + bytes) when `keep_alive` is a FileMapping holding them,
// or DerivedBytes in a weight cache entry's file (else does nothing: anonymous memory would lose its
// bytes): the whole pages inside the range, so a neighbour's partial page stays. They stay in the
// page cache, and a later touch reads them back as the file has them, so a reader sees the same bytes
// and only the resident size changes. The executor does it for a weight kernels run on a copy of
// (Model::copied_weights). Returns the bytes dropped.
inline size_t drop_file_pages(const std::shared_ptr<void>& keep_alive, const void* data, size_t bytes) {
  void* base = nullptr;
  size_t size = 0;
  if (const FileMapping* mapping = std::get_deleter<FileMapping>(keep_alive))
    base = mapping->base, size = mapping->size;
  else if (const DerivedBytes* derived = std::get_deleter<DerivedBytes>(keep_alive); derived && derived->owner)
    base = derived->base, size = derived->size;
  if (!base || !offset_within(base, size, data, bytes)) return 0;
  const auto [lo, hi] = whole_pages(data, bytes);
  if (hi <= lo) return 0;
  // MAP_PRIVATE: a page the process had written (copy-on-write) would go back to the file's bytes.
  // Weights are never written, so each page is the file's already. MAP_SHARED (an entry just made):
  // the written pages are the file's, kept in the page cache until written back.
  if (madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_DONTNEED) != 0) return 0;  // a hint: keep them
  return hi - lo;
}

}  // namespace kiln
