// random_weights: seeded weights for a model of any config, each value a hash of (seed, weight name,
// index), filled in parallel.
#include <fmt/format.h>

#include <algorithm>
#include <functional>
#include <thread>
#include <type_traits>

#include "graph/hash.h"
#include "kiln/pipelines/text_generation.h"

namespace kiln::pipelines {

namespace {

// splitmix64's finaliser: a counter-based generator, so any element can be drawn independently.
uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

// Runs fn(begin, end) over [0, n) split across the machine's cores; small ranges stay on this thread.
void parallel_ranges(int64_t n, const std::function<void(int64_t, int64_t)>& fn) {
  constexpr int64_t kMinPerThread = int64_t{1} << 20;
  const int64_t threads =
      std::clamp<int64_t>(n / kMinPerThread, 1, std::max(1u, std::thread::hardware_concurrency()));
  if (threads == 1) return fn(0, n);
  std::vector<std::thread> workers;
  for (int64_t t = 1; t < threads; ++t) workers.emplace_back(fn, n * t / threads, n * (t + 1) / threads);
  fn(0, n / threads);
  for (auto& w : workers) w.join();
}

// Hot for big shapes (llama-1B draws 1.2 G values): out[2p], out[2p + 1] for pairs
// first_pair .. first_pair + pairs - 1, uniform in [-0.05, 0.05) from 24 bits each of one hash.
// Cloned for AVX-512 (64-bit multiplies in vectors) and vectorised (the dynamic cost model allows
// the remainder loop that GCC's -O2 default refuses). Not cloned under ThreadSanitizer: the clones'
// resolver runs during relocation, before the TSan runtime it is instrumented for exists.
#if defined(__SANITIZE_THREAD__)
#define KILN_UNIFORM_PAIRS_CLONES
#else
#define KILN_UNIFORM_PAIRS_CLONES target_clones("arch=x86-64-v4", "default"),
#endif
__attribute__((KILN_UNIFORM_PAIRS_CLONES optimize("vect-cost-model=dynamic"))) void
uniform_pairs(float* out, int64_t first_pair, int64_t pairs, uint64_t key) {
  constexpr float kScale = 0.1f * 0x1p-24f;
  for (int64_t p = 0; p < pairs; ++p) {
    const uint64_t bits = mix64(key + static_cast<uint64_t>(first_pair + p) * 0x9e3779b97f4a7c15ULL);
    out[2 * p] = static_cast<float>(static_cast<uint32_t>(bits & 0xffffff)) * kScale - 0.05f;
    out[2 * p + 1] = static_cast<float>(static_cast<uint32_t>(bits >> 40)) * kScale - 0.05f;
  }
}

// data[i] for i < n: the value of pair i / 2, its low half for even i. Drawn in chunks that stay in
// L1 and then stored as T, so f16/bf16 get exactly the f32 values rounded.
template <class T>
void fill_uniform(T* data, int64_t n, uint64_t key) {
  parallel_ranges((n + 1) / 2, [=](int64_t begin, int64_t end) {
    constexpr int64_t kChunkPairs = 1024;
    float chunk[2 * kChunkPairs];
    for (int64_t p = begin; p < end; p += kChunkPairs) {
      const int64_t pairs = std::min(kChunkPairs, end - p);
      uniform_pairs(chunk, p, pairs, key);
      const int64_t count = std::min(2 * pairs, n - 2 * p);  // the last pair of an odd n is half used
      if constexpr (std::is_same_v<T, float>)
        std::copy(chunk, chunk + count, data + 2 * p);
      else
        std::transform(chunk, chunk + count, data + 2 * p, [](float v) { return T(v); });
    }
  });
}

}  // namespace

WeightsRegistry random_weights(const nn::LlamaConfig& config, uint64_t seed, DType dtype) {
  if (dtype != DType::f32 && dtype != DType::f16 && dtype != DType::bf16)
    throw DTypeError(
        fmt::format("random_weights: dtype must be f32, f16 or bf16, got {}", dtype_name(dtype)));
  nn::LlamaConfig f32_config = config;
  f32_config.dtype = DType::f32;
  nn::Transformer model(f32_config, 1);
  WeightsRegistry weights;
  for (const auto& [name, decl] : model.raw_state_dict()) {
    Tensor t = Tensor::empty(dtype, decl.shape.static_dims());
    const bool is_norm = name.ends_with("norm.weight");
    const uint64_t key = mix64(seed ^ fnv1a64(name));
    visit_dtype(dtype, [&]<class T>() {
      if constexpr (std::is_same_v<T, float> || std::is_same_v<T, f16_t> || std::is_same_v<T, bf16_t>) {
        T* data = static_cast<T*>(t.data());
        if (is_norm)  // a scale of 1: Gemma's norms store it as weight - 1
          std::fill(data, data + t.numel(), T(config.norm_unit_offset ? 0.0f : 1.0f));
        else
          fill_uniform(data, t.numel(), key);
      }
    });
    weights.emplace(name, std::move(t));
  }
  return weights;
}

}  // namespace kiln::pipelines
