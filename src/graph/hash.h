// Private: FNV-1a 64, the one hash kiln keys things by (compile-cache keys, extension content hashes,
// the seeds of random weights). Not cryptographic; the same on every build and machine, so keys
// written to disk and weights drawn from a seed stay valid.
#pragma once

#include <cstdint>
#include <string_view>

namespace kiln {

// Incremental: update() with each piece of bytes, then read `value`.
struct Fnv1a64 {
  static constexpr uint64_t kOffsetBasis = 0xcbf29ce484222325ull;
  static constexpr uint64_t kPrime = 0x100000001b3ull;
  uint64_t value = kOffsetBasis;

  Fnv1a64& update(std::string_view bytes) {
    for (unsigned char c : bytes) value = (value ^ c) * kPrime;
    return *this;
  }
  // update(bytes), then a separator byte (0xff), so the fields ("ab", "c") and ("a", "bc") differ.
  Fnv1a64& field(std::string_view bytes) {
    update(bytes);
    value = (value ^ 0xffu) * kPrime;
    return *this;
  }
};

inline uint64_t fnv1a64(std::string_view bytes) { return Fnv1a64().update(bytes).value; }

}  // namespace kiln
