// The block bookkeeping of a paged KV cache (vLLM's PagedAttention): the cache is num_blocks blocks of
// block_size token positions each, a sequence owns a table of block ids, and blocks are reference
// counted so sequences that share a prompt prefix share its full blocks (prefix caching). A full
// block is keyed by its tokens and the block before it (by that block's serial, which changes
// whenever a block is allocated again), so a key names a whole prefix exactly: a match is compared
// token by token, and no crafted prompt can collide into another's KV. When its last reference goes a
// keyed block stays cached (its KV still valid) until an allocation needs the space, least recently
// released first. This is bookkeeping only: the KV memory itself is the model graph's cache
// buffers, indexed by block id.
//
//   KvBlockPool pool(/*num_blocks=*/64, /*block_size=*/16);
//   BlockTable seq;
//   seq.append(pool, prompt_ids);          // false when the pool cannot hold them (nothing changes)
//   ... run the model over seq.blocks() ...
//   seq.release(pool);                     // its blocks back to the pool (full ones stay cached)
//
// Not thread-safe: one scheduler owns a pool.
#pragma once

#include <cstdint>
#include <list>
#include <optional>
#include <span>
#include <unordered_map>
#include <vector>

namespace kiln::pipelines {

class KvBlockPool {
 public:
  // ValueError unless both are positive.
  KvBlockPool(int64_t num_blocks, int64_t block_size);

  int64_t num_blocks() const { return static_cast<int64_t>(refs_.size()); }
  int64_t block_size() const { return block_size_; }
  int64_t num_in_use() const { return in_use_; }              // referenced by at least one sequence
  int64_t num_free() const { return num_blocks() - in_use_; }  // allocatable: unused or cached
  int64_t num_cached() const { return static_cast<int64_t>(lru_.size()); }  // free but still keyed

  // A block for new KV, referenced once: an unused one, else the least recently released cached
  // block (its key forgotten). nullopt when every block is in use.
  std::optional<int32_t> allocate();
  void retain(int32_t block);   // one more reference; ValueError naming a block that is not in use
  // One reference less; ValueError naming a block that is not in use. keep_cached false: when this
  // was the last reference its key is forgotten too (its KV is not to be trusted).
  void release(int32_t block, bool keep_cached = true);

  // What identifies a block's current content as the parent of the next block's key; it changes
  // each time the block is allocated. kNoParent stands before a sequence's first block.
  static constexpr int64_t kNoParent = -1;
  int64_t serial(int32_t block) const;
  // The block keyed (parent, tokens), referenced once more (taken out of the cache if it was free),
  // or nullopt. `tokens` is a full block's worth.
  std::optional<int32_t> lookup(int64_t parent, std::span<const int64_t> tokens);
  // Keys a full block in use by (parent, tokens), so later prompts with the same prefix can share
  // it. When another block already has that key this one stays unkeyed (the first is shared).
  // ValueError for a block not in use, a block keyed already, or tokens not a full block.
  void commit(int32_t block, int64_t parent, std::span<const int64_t> tokens);
  int64_t reference_count(int32_t block) const;  // ValueError for an id out of range

 private:
  struct Key {
    int64_t parent = kNoParent;
    std::vector<int64_t> tokens;
  };
  void check_in_use(int32_t block, const char* what) const;
  static uint64_t hash_key(int64_t parent, std::span<const int64_t> tokens);
  std::optional<int32_t> find_key(uint64_t hash, int64_t parent, std::span<const int64_t> tokens) const;
  void forget_key(int32_t block);

  int64_t block_size_;
  std::vector<int32_t> refs_;                         // per block
  std::vector<int64_t> serials_;                      // per block
  std::vector<std::optional<Key>> keys_;              // per block: its key, while it has one
  std::vector<uint64_t> key_hashes_;                  // per keyed block: hash_key of its key
  std::vector<int32_t> unused_;                       // free and unkeyed: a stack
  std::list<int32_t> lru_;                            // free but keyed, least recently released first
  std::vector<std::list<int32_t>::iterator> lru_pos_;  // per block in lru_
  std::unordered_multimap<uint64_t, int32_t> by_hash_;  // keyed blocks by hash_key (compared exactly)
  int64_t next_serial_ = 0;
  int64_t in_use_ = 0;
};

// One sequence's blocks and how many token positions it holds. Full blocks are keyed in the pool as
// they fill, so a later prompt with the same prefix can share them.
class BlockTable {
 public:
  const std::vector<int32_t>& blocks() const { return blocks_; }
  int64_t num_tokens() const { return static_cast<int64_t>(tokens_.size()); }
  // Takes the longest run of full cached blocks matching the start of `prompt` (only while the table
  // is empty) and returns how many tokens it covers (a multiple of block_size, never all of the
  // prompt, so the model always computes at least its last token).
  int64_t share_prefix(KvBlockPool& pool, std::span<const int64_t> prompt);
  // Room for `tokens` more positions (allocating blocks as needed), recorded as held. false, with
  // nothing changed, when the pool has too few free blocks.
  bool append(KvBlockPool& pool, std::span<const int64_t> tokens);
  // Every block back to the pool; the table is empty afterwards. keep_cached false: the blocks leave
  // the prefix cache too (after a failed step, whose KV may be incomplete).
  void release(KvBlockPool& pool, bool keep_cached = true);

 private:
  std::vector<int32_t> blocks_;
  std::vector<int64_t> tokens_;
  int64_t keyed_blocks_ = 0;  // leading full blocks committed to the pool (or shared from it)
};

}  // namespace kiln::pipelines
