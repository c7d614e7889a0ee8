// KvBlockPool and BlockTable: allocation, reference counts, prefix sharing of full blocks keyed
// exactly by their tokens and parent, LRU eviction of cached blocks, and no leaks over random use.
#include <map>
#include <random>
#include <set>
#include <vector>

#include <gtest/gtest.h>

#include "kiln/errors.h"
#include "kiln/pipelines/kv_block_pool.h"
#include "test_util.h"

namespace {

using namespace kiln;
using kiln::pipelines::BlockTable;
using kiln::pipelines::KvBlockPool;
using kiln::testing::expect_error;

std::vector<int64_t> iota(int64_t n, int64_t from = 0) {
  std::vector<int64_t> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[static_cast<size_t>(i)] = from + i;
  return v;
}

TEST(KvBlockPool, AllocatesEveryBlockOnceThenRefuses) {
  KvBlockPool pool(3, 4);
  std::set<int32_t> got;
  for (int i = 0; i < 3; ++i) got.insert(*pool.allocate());
  EXPECT_EQ(got, (std::set<int32_t>{0, 1, 2}));
  EXPECT_FALSE(pool.allocate().has_value());
  EXPECT_EQ(pool.num_in_use(), 3);
  pool.release(1);
  EXPECT_EQ(pool.num_free(), 1);
  EXPECT_EQ(pool.allocate(), 1);
}

TEST(KvBlockPool, ReferenceCountsKeepSharedBlocksInUse) {
  KvBlockPool pool(2, 4);
  const int32_t b = *pool.allocate();
  pool.retain(b);
  EXPECT_EQ(pool.reference_count(b), 2);
  pool.release(b);
  EXPECT_EQ(pool.num_in_use(), 1);
  pool.release(b);
  EXPECT_EQ(pool.num_in_use(), 0);
  expect_error<ValueError>([&] { pool.release(b); }, {"release", "block 0", "not in use"});
  expect_error<ValueError>([&] { pool.retain(7); }, {"retain", "block 7", "out of range"});
  expect_error<ValueError>([] { KvBlockPool(0, 4); }, {"num_blocks"});
  expect_error<ValueError>([] { KvBlockPool(4, 0); }, {"block_size"});
}

TEST(KvBlockPool, AFullKeyedBlockIsFoundByItsExactTokensAndParent) {
  KvBlockPool pool(4, 4);
  const int32_t b = *pool.allocate();
  pool.commit(b, KvBlockPool::kNoParent, iota(4));
  EXPECT_EQ(pool.lookup(KvBlockPool::kNoParent, iota(4)), b);
  EXPECT_EQ(pool.reference_count(b), 2);
  EXPECT_FALSE(pool.lookup(KvBlockPool::kNoParent, iota(4, 1)).has_value());  // other tokens
  EXPECT_FALSE(pool.lookup(pool.serial(b), iota(4)).has_value());             // other parent
  EXPECT_FALSE(pool.lookup(KvBlockPool::kNoParent, iota(3)).has_value());      // not a full block
  expect_error<ValueError>([&] { pool.commit(b, KvBlockPool::kNoParent, iota(4)); }, {"keyed already"});
  const int32_t c = *pool.allocate();
  expect_error<ValueError>([&] { pool.commit(c, KvBlockPool::kNoParent, iota(3)); }, {"3 tokens", "full block is 4"});
}

TEST(KvBlockPool, CachedBlocksAreEvictedLeastRecentlyReleasedFirst) {
  KvBlockPool pool(3, 2);
  std::vector<int32_t> blocks;
  for (int64_t i = 0; i < 3; ++i) {
    blocks.push_back(*pool.allocate());
    pool.commit(blocks.back(), KvBlockPool::kNoParent, iota(2, 10 * i));
  }
  pool.release(blocks[1]);
  pool.release(blocks[0]);
  pool.release(blocks[2]);
  EXPECT_EQ(pool.num_cached(), 3);
  EXPECT_EQ(pool.num_free(), 3);
  // A hit takes block 0's key out of the cache; the next allocation evicts block 1 (released first).
  EXPECT_EQ(pool.lookup(KvBlockPool::kNoParent, iota(2, 0)), blocks[0]);
  EXPECT_EQ(pool.allocate(), blocks[1]);
  EXPECT_FALSE(pool.lookup(KvBlockPool::kNoParent, iota(2, 10)).has_value());  // its KV is gone
  EXPECT_EQ(pool.lookup(KvBlockPool::kNoParent, iota(2, 20)), blocks[2]);       // still cached
}

TEST(BlockTable, APromptSharesTheFullBlocksOfAnEarlierOnesPrefix) {
  KvBlockPool pool(16, 4);
  const std::vector<int64_t> system = iota(8, 100);  // two full blocks
  std::vector<int64_t> first = system, second = system;
  first.insert(first.end(), {1, 2, 3});
  second.insert(second.end(), {7, 8});

  BlockTable a;
  EXPECT_EQ(a.share_prefix(pool, first), 0);  // nothing cached yet
  ASSERT_TRUE(a.append(pool, first));
  EXPECT_EQ(a.blocks().size(), 3u);

  BlockTable b;
  EXPECT_EQ(b.share_prefix(pool, second), 8);  // the two system-prompt blocks
  EXPECT_EQ(std::vector<int32_t>(b.blocks().begin(), b.blocks().end()),
            std::vector<int32_t>(a.blocks().begin(), a.blocks().begin() + 2));
  ASSERT_TRUE(b.append(pool, std::span<const int64_t>(second).subspan(8)));
  EXPECT_EQ(b.num_tokens(), 10);
  EXPECT_EQ(pool.reference_count(a.blocks()[0]), 2);
  EXPECT_EQ(pool.num_in_use(), 4);  // 2 shared + a's last + b's last

  // After both end, the full blocks stay cached; a third prompt with the prefix still shares them.
  a.release(pool);
  b.release(pool);
  EXPECT_EQ(pool.num_in_use(), 0);
  BlockTable c;
  EXPECT_EQ(c.share_prefix(pool, first), 8);
  c.release(pool);
}

TEST(BlockTable, AnExactlyBlockSizedPromptLeavesItsLastTokenToCompute) {
  KvBlockPool pool(4, 4);
  const std::vector<int64_t> prompt = iota(8);
  BlockTable a;
  ASSERT_TRUE(a.append(pool, prompt));
  BlockTable b;
  EXPECT_EQ(b.share_prefix(pool, prompt), 4);  // not 8: the model must see at least one token
  a.release(pool);
  b.release(pool);
}

TEST(BlockTable, AChildBlockIsNeverMatchedAfterItsParentsBlockIsReused) {
  KvBlockPool pool(5, 2);
  BlockTable a;
  ASSERT_TRUE(a.append(pool, iota(4)));  // x0 keyed [0 1], x1 keyed [2 3] after x0
  a.release(pool);                       // both cached, x0 released first
  BlockTable f1, f2, f3, f4;
  ASSERT_TRUE(f1.append(pool, iota(1, 50)));
  ASSERT_TRUE(f2.append(pool, iota(1, 51)));
  ASSERT_TRUE(f3.append(pool, iota(1, 52)));  // the three unused blocks
  ASSERT_TRUE(f4.append(pool, iota(1, 53)));  // evicts x0 (the least recently released)
  f1.release(pool);                           // an unkeyed block, back to unused
  BlockTable c;
  ASSERT_TRUE(c.append(pool, iota(2)));  // [0 1] again, in another block with another serial
  // [0 1] is found in c's block, but x1's key names the old x0 as its parent: [2 3] is not shared.
  BlockTable d;
  EXPECT_EQ(d.share_prefix(pool, std::vector<int64_t>{0, 1, 2, 3, 9}), 2);
  for (BlockTable* t : {&f2, &f3, &f4, &c, &d}) t->release(pool);
  EXPECT_EQ(pool.num_in_use(), 0);
}

TEST(BlockTable, AppendBeyondTheFreeBlocksChangesNothing) {
  KvBlockPool pool(2, 4);
  BlockTable a;
  ASSERT_TRUE(a.append(pool, iota(6)));
  EXPECT_FALSE(a.append(pool, iota(3)));  // 9 tokens need 3 blocks
  EXPECT_EQ(a.num_tokens(), 6);
  EXPECT_EQ(pool.num_in_use(), 2);
  EXPECT_TRUE(a.append(pool, iota(2)));  // 8 fit
  a.release(pool);
  EXPECT_EQ(pool.num_in_use(), 0);
}

// 1000 random operations (admit a prompt, often with a shared prefix; decode a token; cancel) over a
// small pool: every block is in use exactly as often as the live tables hold it, and after the last
// cancel none is in use.
TEST(BlockTable, NoBlockLeaksOverRandomSubmitAndCancel) {
  KvBlockPool pool(24, 4);
  std::mt19937 rng(7);
  std::map<int, BlockTable> live;
  int next_id = 0;
  const std::vector<int64_t> shared = iota(9, 500);
  for (int op = 0; op < 1000; ++op) {
    const int kind = static_cast<int>(rng() % 3);
    if (kind == 0 || live.empty()) {
      std::vector<int64_t> prompt = rng() % 2 ? shared : std::vector<int64_t>{};
      const int64_t extra = 1 + static_cast<int64_t>(rng() % 10);
      for (int64_t i = 0; i < extra; ++i) prompt.push_back(static_cast<int64_t>(rng() % 5));
      BlockTable table;
      const int64_t shared_tokens = table.share_prefix(pool, prompt);
      if (table.append(pool, std::span<const int64_t>(prompt).subspan(static_cast<size_t>(shared_tokens))))
        live.emplace(next_id++, std::move(table));
      else
        table.release(pool);  // no room: give back what was shared
    } else {
      auto it = std::next(live.begin(), static_cast<std::ptrdiff_t>(rng() % live.size()));
      if (kind == 1) {
        const int64_t token = static_cast<int64_t>(rng() % 5);
        if (!it->second.append(pool, std::span<const int64_t>(&token, 1))) {
          it->second.release(pool);  // preempted: its memory back at once
          live.erase(it);
        }
      } else {
        it->second.release(pool);
        live.erase(it);
      }
    }
    std::map<int32_t, int64_t> held;
    for (const auto& [id, table] : live)
      for (int32_t block : table.blocks()) ++held[block];
    int64_t in_use = 0;
    for (int32_t b = 0; b < pool.num_blocks(); ++b) {
      ASSERT_EQ(pool.reference_count(b), held.count(b) ? held[b] : 0) << "block " << b << " after op " << op;
      in_use += pool.reference_count(b) > 0;
    }
    ASSERT_EQ(pool.num_in_use(), in_use);
  }
  for (auto& [id, table] : live) table.release(pool);
  EXPECT_EQ(pool.num_in_use(), 0);
  EXPECT_EQ(pool.num_free(), pool.num_blocks());
}

}  // namespace
