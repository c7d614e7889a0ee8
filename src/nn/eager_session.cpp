#include "kiln/nn/eager_session.h"

#include <list>
#include <mutex>
#include <string>
#include <unordered_map>
#include <variant>

#include "kiln/errors.h"
#include "kiln/graph/text.h"

namespace kiln::nn {

// An LRU map from key to model: `order` runs from most to least recently used, and `index` finds a
// key's node (its string_view keys point into the nodes, which a std::list never moves).
struct EagerSession::Cache {
  using Value = std::variant<engine::Model, std::shared_ptr<const engine::CompiledModel>>;
  struct Entry {
    std::string key;
    Value value;
  };

  std::mutex mutex;
  std::list<Entry> order;
  std::unordered_map<std::string_view, std::list<Entry>::iterator> index;
  EagerCacheStats stats;

  // Under `mutex`: the cached value or the built one, counted as a hit or a miss.
  template <class Build>
  Value find_or_build(std::string_view key, size_t capacity, const Build& build) {
    if (auto it = index.find(key); it != index.end()) {
      ++stats.hits;
      order.splice(order.begin(), order, it->second);
      return it->second->value;
    }
    ++stats.misses;
    Value value = build();  // a throw leaves the cache as it was
    order.push_front(Entry{std::string(key), value});
    index.emplace(order.front().key, order.begin());
    while (order.size() > capacity) {
      index.erase(order.back().key);
      order.pop_back();
      ++stats.evictions;
    }
    return value;
  }
};

namespace {

bool calls_custom_ops(const graph::Module& module) {
  for (const auto& g : module.graphs())
    for (const graph::Node& node : g->nodes)
      if (node.op == graph::Op::custom || node.op == graph::Op::inplace_custom) return true;
  return false;
}

size_t checked_capacity(size_t capacity) {
  if (capacity == 0) throw ValueError("EagerSession: cache_capacity must be at least 1, got 0");
  return capacity;
}

}  // namespace

EagerSession::EagerSession(EagerSessionOptions options)
    : session_(std::move(options.devices), {}, std::move(options.session)),
      capacity_(checked_capacity(options.cache_capacity)),
      cache_(std::make_unique<Cache>()) {}

EagerSession::~EagerSession() = default;

EagerCacheStats EagerSession::cache_stats() const {
  std::lock_guard lock(cache_->mutex);
  EagerCacheStats stats = cache_->stats;
  stats.size = cache_->order.size();
  stats.capacity = capacity_;
  return stats;
}

engine::Model EagerSession::cached_model(std::string_view key, const std::function<engine::Model()>& build) {
  std::lock_guard lock(cache_->mutex);
  return std::get<engine::Model>(
      cache_->find_or_build(key, capacity_, [&] { return Cache::Value(build()); }));
}

std::shared_ptr<const engine::CompiledModel> EagerSession::cached_compile(
    const graph::Module& module, const std::vector<std::filesystem::path>& extra_extensions) {
  auto compile = [&] {
    return std::make_shared<const engine::CompiledModel>(session_.compile(module, extra_extensions));
  };
  if (calls_custom_ops(module)) return compile();
  // Without custom ops the extensions play no part. The prefix keeps these keys apart from eager
  // ops' "op(attrs)..." keys.
  const std::string key = "compile:\n" + graph::print(module);
  std::lock_guard lock(cache_->mutex);
  return std::get<std::shared_ptr<const engine::CompiledModel>>(
      cache_->find_or_build(key, capacity_, [&] { return Cache::Value(compile()); }));
}

const std::shared_ptr<EagerSession>& default_eager_session() {
  static const std::shared_ptr<EagerSession> session = std::make_shared<EagerSession>();
  return session;
}

}  // namespace kiln::nn
