// Deterministic test weights, a pure function of (weight name, element index), so the C++ tests and
// tools/reference/llama_reference.py generate the same checkpoint without storing it (docs/llama.md):
//   seed  = FNV-1a 64 of the name's bytes
//   z     = splitmix64 finalizer of (seed + (index + 1) * 0x9E3779B97F4A7C15) mod 2^64
//   value = ((z >> 40) - 2^23) * 2^-26, in [-0.125, 0.125) and exact in f32; norm weights add 1.0
//   (names ending in "norm.weight"), then round to f32 (nearest even).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kiln/tensor/tensor.h"

namespace kiln::nn::hashed_weights {

inline uint64_t fnv1a64(const std::string& text) {
  uint64_t h = 0xCBF29CE484222325ull;
  for (unsigned char c : text) h = (h ^ c) * 0x100000001B3ull;
  return h;
}

inline uint64_t splitmix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

inline double value(uint64_t seed, uint64_t index, bool is_norm) {
  uint64_t z = splitmix64(seed + (index + 1) * 0x9E3779B97F4A7C15ull);
  double x = static_cast<double>(static_cast<int64_t>(z >> 40) - (int64_t{1} << 23)) * 0x1p-26;
  return is_norm ? 1.0 + x : x;
}

inline Tensor make(const std::string& name, const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (auto d : shape) n *= d;
  const uint64_t seed = fnv1a64(name);
  const bool is_norm = name.size() >= 11 && name.compare(name.size() - 11, 11, "norm.weight") == 0;
  std::vector<float> values(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i)
    values[i] = static_cast<float>(value(seed, static_cast<uint64_t>(i), is_norm));
  return Tensor::from_vector(values, shape);
}

}  // namespace kiln::nn::hashed_weights
