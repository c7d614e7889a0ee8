// One counting, caching allocator per device. The table is never destroyed: tensors held by static
// objects may be freed after it would have been.
#include "kiln/tensor/device_memory.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <map>
#include <mutex>
#include <utility>

#include <fmt/format.h>

#include "tensor/host_memory.h"
#include "kiln/errors.h"

namespace kiln {

namespace {

constexpr size_t kAlignment = 64;
constexpr size_t kCachedMin = size_t{64} << 10;    // smaller blocks: malloc's own free lists serve them
constexpr size_t kCacheLimit = size_t{1} << 30;    // per device; beyond it freed blocks go back

// The block size an allocation of nbytes gets: small ones rounded to the alignment; cached ones to
// one of 8 steps per power of two (at most 12.5% slack), so a freed block fits later requests of
// nearby sizes (a growing KV length changes a decode step's sizes slightly).
size_t block_size(size_t nbytes) {
  const size_t aligned = std::max<size_t>(kAlignment, (nbytes + kAlignment - 1) / kAlignment * kAlignment);
  if (aligned < kCachedMin) return aligned;
  size_t power = size_t{1} << (63 - __builtin_clzll(aligned));
  size_t step = std::max<size_t>(power / 8, kAlignment);
  return (aligned + step - 1) / step * step;
}

struct DeviceAllocator {
  std::atomic<int64_t> bytes_in_use{0};
  std::atomic<int64_t> peak_bytes_in_use{0};
  std::atomic<int64_t> live_allocations{0};
  std::atomic<int64_t> total_allocations{0};
  std::atomic<int64_t> system_allocations{0};

  std::mutex cache_mutex;
  std::multimap<size_t, void*> cache;  // block size -> free block
  size_t cached_bytes = 0;

  void* take(size_t size) {
    if (size >= kCachedMin) {
      std::lock_guard lock(cache_mutex);
      if (auto it = cache.find(size); it != cache.end()) {
        void* p = it->second;
        cache.erase(it);
        cached_bytes -= size;
        return p;
      }
    }
    system_allocations.fetch_add(1, std::memory_order_relaxed);
    return allocate_aligned(size);
  }
  void give_back(void* p, size_t size) {
    if (size >= kCachedMin) {
      std::lock_guard lock(cache_mutex);
      if (cached_bytes + size <= kCacheLimit) {
        cache.emplace(size, p);
        cached_bytes += size;
        return;
      }
    }
    std::free(p);
  }
  void empty() {
    std::lock_guard lock(cache_mutex);
    for (auto& [size, p] : cache) std::free(p);
    cache.clear();
    cached_bytes = 0;
  }

  void count_allocation(int64_t bytes) {
    const int64_t now = bytes_in_use.fetch_add(bytes, std::memory_order_relaxed) + bytes;
    live_allocations.fetch_add(1, std::memory_order_relaxed);
    total_allocations.fetch_add(1, std::memory_order_relaxed);
    int64_t peak = peak_bytes_in_use.load(std::memory_order_relaxed);
    while (now > peak && !peak_bytes_in_use.compare_exchange_weak(peak, now, std::memory_order_relaxed)) {
    }
  }
  void count_free(int64_t bytes) {
    bytes_in_use.fetch_sub(bytes, std::memory_order_relaxed);
    live_allocations.fetch_sub(1, std::memory_order_relaxed);
  }
};

struct AllocatorTable {
  std::mutex mutex;
  std::map<std::pair<DeviceKind, int>, std::unique_ptr<DeviceAllocator>> allocators;

  // Created on first use; the pointer stays valid for the life of the process.
  DeviceAllocator* get(DeviceRef device, bool create) {
    std::lock_guard lock(mutex);
    auto key = std::make_pair(device.kind, device.id);
    auto it = allocators.find(key);
    if (it != allocators.end()) return it->second.get();
    if (!create) return nullptr;
    return allocators.emplace(key, std::make_unique<DeviceAllocator>()).first->second.get();
  }
};

AllocatorTable& table() {
  static auto* t = new AllocatorTable;
  return *t;
}

}  // namespace

std::shared_ptr<void> allocate(DeviceRef device, size_t nbytes) {
  if (device.kind != DeviceKind::CPU)
    throw ValueError(fmt::format("allocate: device {} is not supported (kiln allocates only cpu memory)",
                                 device.to_string()));
  // One block even for zero bytes keeps data() non-null.
  const size_t size = block_size(nbytes);
  DeviceAllocator* allocator = table().get(device, /*create=*/true);
  void* p = allocator->take(size);
  if (p == nullptr) throw Error(fmt::format("allocate: cannot allocate {} bytes on {}", nbytes, device.to_string()));
  const auto bytes = static_cast<int64_t>(nbytes);
  allocator->count_allocation(bytes);
  return std::shared_ptr<void>(p, [allocator, bytes, size](void* q) {
    allocator->give_back(q, size);
    allocator->count_free(bytes);
  });
}

DeviceMemoryStats memory_stats(DeviceRef device) {
  const DeviceAllocator* a = table().get(device, /*create=*/false);
  if (!a) return {};
  DeviceAllocator& m = const_cast<DeviceAllocator&>(*a);
  std::lock_guard lock(m.cache_mutex);
  return {a->bytes_in_use.load(), a->peak_bytes_in_use.load(), a->live_allocations.load(),
          a->total_allocations.load(), a->system_allocations.load(), static_cast<int64_t>(m.cached_bytes)};
}

void empty_cache(DeviceRef device) {
  if (DeviceAllocator* a = table().get(device, /*create=*/false)) a->empty();
}

void reset_peak_memory(DeviceRef device) {
  if (DeviceAllocator* a = table().get(device, /*create=*/false))
    a->peak_bytes_in_use.store(a->bytes_in_use.load());
}

}  // namespace kiln
