// A packed-weight cache entry (WeightCache's `<key>.kpack` file: header, then the payload it maps):
// find() validates the header against the key and length and the payload against its checksum; an
// entry it hands out must be readable end to end (ASan sees a read past the mapping), and one it
// refuses is removed.
#include <algorithm>

#include "fuzz_common.h"
#include "kiln/engine/weight_cache.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const kiln::engine::WeightCache cache(kiln::fuzz::scratch_dir() / "weights", uint64_t{1} << 30);
  // The key the header names when it is one (so inputs reach the payload's mapping and checksum), else
  // another: a key is 32 lowercase hex digits at byte 32.
  std::string key(reinterpret_cast<const char*>(data) + std::min<size_t>(size, 32), std::min<size_t>(size > 32 ? size - 32 : 0, 32));
  if (key.size() != 32 || key.find_first_not_of("0123456789abcdef") != std::string::npos)
    key = kiln::engine::WeightCache::key("fuzz", "entry");
  std::filesystem::create_directories(cache.dir());
  const std::filesystem::path entry = cache.dir() / (key + ".kpack");
  std::ofstream(entry, std::ios::binary | std::ios::trunc).write(reinterpret_cast<const char*>(data),
                                                                  static_cast<std::streamsize>(size));
  kiln::fuzz::refusals_only([&] {
    // The length the header's place implies, and a few others a caller might ask for.
    for (uint64_t bytes : {uint64_t{size > 4096 ? size - 4096 : 1}, uint64_t{1}, uint64_t{size}}) {
      const std::shared_ptr<const void> found = cache.find(key, bytes);
      if (found) {
        const auto* p = static_cast<const volatile uint8_t*>(found.get());
        (void)(p[0] + p[bytes - 1]);
      }
    }
  });
  return 0;
}
