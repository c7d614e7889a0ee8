#include "kiln/pipelines/kv_block_pool.h"

#include <algorithm>
#include <string_view>

#include <fmt/format.h>

#include "graph/hash.h"
#include "kiln/errors.h"

namespace kiln::pipelines {

KvBlockPool::KvBlockPool(int64_t num_blocks, int64_t block_size) : block_size_(block_size) {
  if (num_blocks <= 0 || num_blocks > INT32_MAX)
    throw ValueError(fmt::format("KvBlockPool: num_blocks must be in [1, {}], got {}", INT32_MAX, num_blocks));
  if (block_size <= 0) throw ValueError(fmt::format("KvBlockPool: block_size must be positive, got {}", block_size));
  const auto n = static_cast<size_t>(num_blocks);
  refs_.assign(n, 0);
  serials_.assign(n, 0);
  keys_.resize(n);
  key_hashes_.assign(n, 0);
  lru_pos_.resize(n, lru_.end());
  // Handed out from the back: block 0 first.
  for (int64_t b = num_blocks; b-- > 0;) unused_.push_back(static_cast<int32_t>(b));
}

void KvBlockPool::check_in_use(int32_t block, const char* what) const {
  if (block < 0 || block >= num_blocks())
    throw ValueError(fmt::format("KvBlockPool::{}: block {} is out of range ({} blocks)", what, block, num_blocks()));
  if (refs_[static_cast<size_t>(block)] == 0)
    throw ValueError(fmt::format("KvBlockPool::{}: block {} is not in use", what, block));
}

int64_t KvBlockPool::reference_count(int32_t block) const {
  if (block < 0 || block >= num_blocks())
    throw ValueError(fmt::format("KvBlockPool: block {} is out of range ({} blocks)", block, num_blocks()));
  return refs_[static_cast<size_t>(block)];
}

int64_t KvBlockPool::serial(int32_t block) const {
  check_in_use(block, "serial");
  return serials_[static_cast<size_t>(block)];
}

std::optional<int32_t> KvBlockPool::allocate() {
  int32_t block;
  if (!unused_.empty()) {
    block = unused_.back();
    unused_.pop_back();
  } else if (!lru_.empty()) {
    block = lru_.front();  // the cached block released longest ago gives up its KV
    lru_.pop_front();
    lru_pos_[static_cast<size_t>(block)] = lru_.end();
    forget_key(block);
  } else {
    return std::nullopt;
  }
  const auto b = static_cast<size_t>(block);
  refs_[b] = 1;
  serials_[b] = next_serial_++;
  ++in_use_;
  return block;
}

void KvBlockPool::retain(int32_t block) {
  check_in_use(block, "retain");
  ++refs_[static_cast<size_t>(block)];
}

void KvBlockPool::release(int32_t block, bool keep_cached) {
  check_in_use(block, "release");
  const auto b = static_cast<size_t>(block);
  if (--refs_[b] > 0) return;
  --in_use_;
  if (!keep_cached) forget_key(block);
  if (keys_[b]) {
    lru_.push_back(block);
    lru_pos_[b] = std::prev(lru_.end());
  } else {
    unused_.push_back(block);
  }
}

uint64_t KvBlockPool::hash_key(int64_t parent, std::span<const int64_t> tokens) {
  Fnv1a64 hash;
  hash.update(std::string_view(reinterpret_cast<const char*>(&parent), sizeof parent));
  hash.update(std::string_view(reinterpret_cast<const char*>(tokens.data()), tokens.size_bytes()));
  return hash.value;
}

std::optional<int32_t> KvBlockPool::find_key(uint64_t hash, int64_t parent, std::span<const int64_t> tokens) const {
  auto [first, last] = by_hash_.equal_range(hash);
  for (auto it = first; it != last; ++it) {
    const Key& key = *keys_[static_cast<size_t>(it->second)];
    if (key.parent == parent && std::equal(key.tokens.begin(), key.tokens.end(), tokens.begin(), tokens.end()))
      return it->second;
  }
  return std::nullopt;
}

void KvBlockPool::forget_key(int32_t block) {
  const auto b = static_cast<size_t>(block);
  if (!keys_[b]) return;
  auto [first, last] = by_hash_.equal_range(key_hashes_[b]);
  for (auto it = first; it != last; ++it)
    if (it->second == block) {
      by_hash_.erase(it);
      break;
    }
  keys_[b].reset();
}

std::optional<int32_t> KvBlockPool::lookup(int64_t parent, std::span<const int64_t> tokens) {
  if (static_cast<int64_t>(tokens.size()) != block_size_) return std::nullopt;
  std::optional<int32_t> found = find_key(hash_key(parent, tokens), parent, tokens);
  if (!found) return std::nullopt;
  const auto b = static_cast<size_t>(*found);
  if (refs_[b] == 0) {  // cached: back in use
    lru_.erase(lru_pos_[b]);
    lru_pos_[b] = lru_.end();
    ++in_use_;
  }
  ++refs_[b];
  return found;
}

void KvBlockPool::commit(int32_t block, int64_t parent, std::span<const int64_t> tokens) {
  check_in_use(block, "commit");
  const auto b = static_cast<size_t>(block);
  if (static_cast<int64_t>(tokens.size()) != block_size_)
    throw ValueError(fmt::format("KvBlockPool::commit: block {} gets {} tokens, a full block is {}", block,
                                 tokens.size(), block_size_));
  if (keys_[b]) throw ValueError(fmt::format("KvBlockPool::commit: block {} is keyed already", block));
  const uint64_t hash = hash_key(parent, tokens);
  if (find_key(hash, parent, tokens)) return;  // that prefix is cached in another block: share that one
  keys_[b] = Key{parent, std::vector<int64_t>(tokens.begin(), tokens.end())};
  key_hashes_[b] = hash;
  by_hash_.emplace(hash, block);
}

// ---- BlockTable --------------------------------------------------------------------------------------

int64_t BlockTable::share_prefix(KvBlockPool& pool, std::span<const int64_t> prompt) {
  if (!blocks_.empty()) return 0;
  const int64_t size = pool.block_size();
  int64_t parent = KvBlockPool::kNoParent;
  // Whole blocks only, and never the prompt's last token: the model must compute at least one.
  const int64_t shareable = prompt.empty() ? 0 : (static_cast<int64_t>(prompt.size()) - 1) / size;
  for (int64_t i = 0; i < shareable; ++i) {
    std::span<const int64_t> tokens = prompt.subspan(static_cast<size_t>(i * size), static_cast<size_t>(size));
    std::optional<int32_t> block = pool.lookup(parent, tokens);
    if (!block) break;
    blocks_.push_back(*block);
    tokens_.insert(tokens_.end(), tokens.begin(), tokens.end());
    parent = pool.serial(*block);
  }
  keyed_blocks_ = static_cast<int64_t>(blocks_.size());
  return num_tokens();
}

bool BlockTable::append(KvBlockPool& pool, std::span<const int64_t> tokens) {
  const int64_t size = pool.block_size();
  const int64_t total = num_tokens() + static_cast<int64_t>(tokens.size());
  const int64_t needed = (total + size - 1) / size - static_cast<int64_t>(blocks_.size());
  if (needed > pool.num_free()) return false;
  for (int64_t i = 0; i < needed; ++i) blocks_.push_back(*pool.allocate());
  tokens_.insert(tokens_.end(), tokens.begin(), tokens.end());
  // Key every block this filled, each after the one before it.
  for (; (keyed_blocks_ + 1) * size <= num_tokens(); ++keyed_blocks_) {
    const int64_t parent = keyed_blocks_ == 0 ? KvBlockPool::kNoParent
                                              : pool.serial(blocks_[static_cast<size_t>(keyed_blocks_ - 1)]);
    pool.commit(blocks_[static_cast<size_t>(keyed_blocks_)], parent,
                std::span<const int64_t>(tokens_).subspan(static_cast<size_t>(keyed_blocks_ * size), static_cast<size_t>(size)));
  }
  return true;
}

void BlockTable::release(KvBlockPool& pool, bool keep_cached) {
  for (int32_t block : blocks_) pool.release(block, keep_cached);
  blocks_.clear();
  tokens_.clear();
  keyed_blocks_ = 0;
}

}  // namespace kiln::pipelines
