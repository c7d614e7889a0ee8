// Private to pipelines: a whole file mmapped for the weight readers (safetensors.cpp, gguf.cpp), so
// tensors are zero-copy views of the file's pages.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <string_view>

namespace kiln::pipelines {

// The mapping of a whole regular file; `base`'s deleter (a kiln::FileMapping) unmaps it, so tensors
// kept alive by it can have their pages dropped (drop_file_pages). An empty file maps to a null base
// and size 0 (mmap refuses length 0), so the caller's own size checks report it.
struct MappedFile {
  std::shared_ptr<void> base;
  uint64_t size = 0;
  const uint8_t* bytes() const { return static_cast<const uint8_t*>(base.get()); }
};

// LoadError "WHO: FILE: cannot open: REASON" (or cannot stat, not a regular file, cannot mmap).
MappedFile map_file(const std::filesystem::path& path, std::string_view who);

}  // namespace kiln::pipelines
