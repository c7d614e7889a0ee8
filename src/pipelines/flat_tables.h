// Private to the tokenizers: open-addressing tables over flat arrays for a vocabulary's lookups
// (string -> id) and a BPE model's merges ((left id, right id) -> rank and result). A lookup costs a
// hash, a slot or two and one compare, and loading hundreds of thousands of entries allocates nothing
// per entry, where std::unordered_map walked and allocated nodes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace kiln::pipelines::detail {

// Slots of an open-addressing table for `count` keys: a power of two, at most half full.
inline size_t flat_table_slots(size_t count) {
  size_t capacity = 16;
  while (capacity < 2 * count) capacity *= 2;
  return capacity;
}

// String -> id for the vocabulary lookups of encoding (one per word, one per character of a word BPE
// merges), probed with a string_view. Ids are below 2^24 (hf_tokenizer.cpp's kMaxTokenId).
class FlatStringIndex {
 public:
  // Room for `count` keys without growing.
  void reserve(size_t count) {
    if (2 * count > slots_.size()) rehash(count);
  }
  // Adds key -> value; false (and nothing changes) when the key is there already.
  bool insert(std::string_view key, int64_t value) {
    if (2 * (size_ + 1) > slots_.size()) rehash(2 * (size_ + 1));
    const uint64_t h = hash(key);
    const size_t mask = slots_.size() - 1;
    size_t i = h & mask;
    for (; slots_[i].id >= 0; i = (i + 1) & mask)
      if (matches(slots_[i], h, key)) return false;
    slots_[i] = {static_cast<uint32_t>(h), static_cast<int32_t>(value), static_cast<uint32_t>(arena_.size()),
                 static_cast<uint32_t>(key.size())};
    arena_ += key;
    ++size_;
    return true;
  }
  std::optional<int64_t> find(std::string_view key) const {
    if (slots_.empty()) return std::nullopt;
    const uint64_t h = hash(key);
    const size_t mask = slots_.size() - 1;
    for (size_t i = h & mask;; i = (i + 1) & mask) {
      const Slot& slot = slots_[i];
      if (slot.id < 0) return std::nullopt;
      if (matches(slot, h, key)) return slot.id;
    }
  }

 private:
  static uint64_t hash(std::string_view key) { return std::hash<std::string_view>{}(key); }
  // One slot holds all a lookup needs but the key's bytes, which lie in one arena: two memory reads.
  struct Slot {
    uint32_t hash = 0;
    int32_t id = -1;  // -1: empty (ids are below kMaxTokenId = 2^24)
    uint32_t offset = 0, length = 0;
  };
  bool matches(const Slot& slot, uint64_t h, std::string_view key) const {
    return slot.hash == static_cast<uint32_t>(h) && slot.length == key.size() &&
           std::string_view(arena_).substr(slot.offset, slot.length) == key;
  }
  // Slots for at least `count` keys; the keys already in are placed again.
  void rehash(size_t count) {
    const size_t capacity = flat_table_slots(count);
    std::vector<Slot> old = std::exchange(slots_, std::vector<Slot>(capacity));
    for (const Slot& slot : old) {
      if (slot.id < 0) continue;
      size_t i = slot.hash & (capacity - 1);  // the low bits of the full hash, as insert() places it
      while (slots_[i].id >= 0) i = (i + 1) & (capacity - 1);
      slots_[i] = slot;
    }
  }
  std::vector<Slot> slots_;
  std::string arena_;
  size_t size_ = 0;
};

// (left id, right id) -> the merge's rank and result: open addressing over one flat array (a lookup
// per adjacent pair as a word is merged; hundreds of thousands of inserts at load, none allocating).
class FlatMergeTable {
 public:
  struct Merge {
    int32_t rank = 0;
    int32_t merged_id = 0;
  };
  // Room for `count` pairs without growing.
  void reserve(size_t count) {
    if (2 * count > slots_.size()) rehash(count);
  }
  // Adds the pair unless it is there already (the first, lowest-ranked merge of a pair stands).
  void insert(uint64_t key, Merge merge) {
    if (2 * (size_ + 1) > slots_.size()) rehash(2 * (size_ + 1));
    size_t i = index(key);
    for (; slots_[i].key != kEmpty; i = (i + 1) & (slots_.size() - 1))
      if (slots_[i].key == key) return;
    slots_[i] = {key, merge};
    ++size_;
  }
  const Merge* find(uint64_t key) const {
    if (slots_.empty()) return nullptr;
    for (size_t i = index(key);; i = (i + 1) & (slots_.size() - 1)) {
      if (slots_[i].key == key) return &slots_[i].merge;
      if (slots_[i].key == kEmpty) return nullptr;
    }
  }

 private:
  static constexpr uint64_t kEmpty = ~uint64_t{0};  // no pair of ids below 2^24 makes it
  struct Slot {
    uint64_t key = kEmpty;
    Merge merge;
  };
  size_t index(uint64_t key) const { return (key * 0x9E3779B97F4A7C15ull) >> 32 & (slots_.size() - 1); }
  void rehash(size_t count) {
    const size_t capacity = flat_table_slots(count);
    std::vector<Slot> old = std::exchange(slots_, std::vector<Slot>(capacity));
    for (const Slot& slot : old) {
      if (slot.key == kEmpty) continue;
      size_t i = index(slot.key);
      while (slots_[i].key != kEmpty) i = (i + 1) & (capacity - 1);
      slots_[i] = slot;
    }
  }
  std::vector<Slot> slots_;
  size_t size_ = 0;
};

}  // namespace kiln::pipelines::detail
