// nn::EagerSession: what ModuleV3 code runs in when it is not staged. It owns one
// engine::InferenceSession (and so one thread pool and one logger) and a bounded LRU cache of the
// models it has built: one-op models for eager nn::functional calls, and compiled graphs for
// ModuleV3::compile. Eager tensors made with a session run their ops in it; ModuleV3::compile takes
// one in CompileOptions::session. Code that names none uses default_eager_session().
//
//   auto session = std::make_shared<nn::EagerSession>(nn::EagerSessionOptions{.cache_capacity = 64});
//   nn::Tensor x = nn::Tensor::from_vector<float>({1, 2, 3}, {3}, session);
//   nn::Tensor y = F::exp(x);                       // compiled and cached in `session`
//   auto compiled = module.compile(types, {.session = session});
//
// Thread-safe: several threads may run eager ops and compile() in one session at once (the cache
// is guarded by a mutex, held while a missing model is built, so concurrent first uses of one op
// signature build it once).
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <string_view>
#include <vector>

#include "kiln/engine/session.h"
#include "kiln/logging.h"

namespace kiln::nn {

struct EagerSessionOptions {
  // The devices of its InferenceSession: eager data lives there, and ModuleV3::compile accepts a
  // module whose devices() are all among them.
  std::vector<DeviceRef> devices = {DeviceRef::CPU()};
  // Models kept (one-op models and compiled graphs together); the least recently used is evicted
  // past it. At least 1 (ValueError otherwise).
  size_t cache_capacity = 512;
  // The InferenceSession's options: threads, the persistent compile cache, the logger.
  engine::SessionOptions session = {};
};

// How the model cache has been used: a hit found the model, a miss built it (a build that failed
// counts as a miss and caches nothing), an eviction dropped the least recently used one.
struct EagerCacheStats {
  int64_t hits = 0;
  int64_t misses = 0;
  int64_t evictions = 0;
  size_t size = 0;
  size_t capacity = 0;
};

class EagerSession {
 public:
  explicit EagerSession(EagerSessionOptions options = {});
  ~EagerSession();
  EagerSession(const EagerSession&) = delete;
  EagerSession& operator=(const EagerSession&) = delete;

  const engine::InferenceSession& inference_session() const { return session_; }
  const std::vector<DeviceRef>& devices() const { return session_.devices(); }
  Logger& logger() const { return session_.logger(); }
  size_t cache_capacity() const { return capacity_; }
  EagerCacheStats cache_stats() const;

  // The model cached under `key`, else the one `build` returns, then cached under `key` (evicting the
  // least recently used entry past the capacity). Used by nn::functional's eager ops.
  engine::Model cached_model(std::string_view key, const std::function<engine::Model()>& build);
  // `module` compiled by this session with `extra_extensions`, cached by its text form. A module that
  // calls custom ops is compiled every time, so a rebuilt extension library is picked up as the
  // engine does. Used by ModuleV3::compile.
  std::shared_ptr<const engine::CompiledModel> cached_compile(
      const graph::Module& module, const std::vector<std::filesystem::path>& extra_extensions);

 private:
  struct Cache;
  engine::InferenceSession session_;
  size_t capacity_;
  std::unique_ptr<Cache> cache_;
};

// The session of eager tensors and compile() calls that name none: made on first use with default
// EagerSessionOptions (cpu:0, one thread per core, the stderr logger) and never replaced.
const std::shared_ptr<EagerSession>& default_eager_session();

}  // namespace kiln::nn
