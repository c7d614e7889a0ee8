// Private: a library's kiln_extension_init run against a fresh Library, every op it registers
// checked (load_library's work after dlopen). Also the entry of fuzz/extension_metadata.cpp, which
// plays a library that registers defs made from its input.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>

#include "kiln/ext/extensions.h"

namespace kiln::ext {

// The library `init` registers, as one at `path` with content `content_hash`. ExtensionError naming
// the path for an ABI major other than KILN_EXT_ABI_MAJOR, a failed init, a malformed op or none.
// Nothing is made known process-wide (load_library does that).
std::shared_ptr<Library> run_extension_init(const std::filesystem::path& path, uint64_t content_hash,
                                            KilnExtInitFn init);

}  // namespace kiln::ext
