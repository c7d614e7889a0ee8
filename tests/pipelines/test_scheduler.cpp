// The continuous-batching scheduler on its own (no model): what each step takes, chunked prefill,
// preemption when the KV blocks run out, prefix-cache admission, and that no block leaks.
#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <numeric>
#include <random>

#include "kiln/errors.h"
#include "pipelines/scheduler.h"

namespace kiln::pipelines {
namespace {

std::unique_ptr<Sequence> make_sequence(uint64_t id, int64_t prompt_len, int64_t first_token = 0) {
  auto s = std::make_unique<Sequence>();
  s->id = id;
  s->tokens.resize(static_cast<size_t>(prompt_len));
  std::iota(s->tokens.begin(), s->tokens.end(), first_token);
  s->prompt_len = prompt_len;
  return s;
}

// What the engine does after a step: the computed tokens stay, and a sampled chunk gets one new token.
void finish_step(Scheduler& scheduler, const StepPlan& plan, int64_t next_token = 7) {
  scheduler.complete(plan);
  for (const ScheduledChunk& c : plan.chunks)
    if (c.samples) c.seq->tokens.push_back(next_token);
}

int64_t tokens_of(const StepPlan& plan, const Sequence* s) {
  int64_t n = 0;
  for (const ScheduledChunk& c : plan.chunks)
    if (c.seq == s) n += c.count;
  return n;
}

TEST(Scheduler, RefusesNonPositiveOptions) {
  KvBlockPool pool(4, 4);
  EXPECT_THROW(Scheduler(pool, {.max_num_seqs = 0}), ValueError);
  EXPECT_THROW(Scheduler(pool, {.max_num_batched_tokens = 0}), ValueError);
}

TEST(Scheduler, ChunkedPrefillNeverStallsRunningDecodes) {
  KvBlockPool pool(64, 4);
  Scheduler scheduler(pool, {.max_num_seqs = 8, .max_num_batched_tokens = 8});
  auto a = make_sequence(1, 3);
  scheduler.add(a.get());
  StepPlan first = scheduler.schedule();
  ASSERT_EQ(first.chunks.size(), 1u);
  EXPECT_EQ(first.chunks[0].count, 3);
  EXPECT_TRUE(first.chunks[0].samples);
  finish_step(scheduler, first);

  // A 20-token prompt arrives: each step still gives `a` its decode token, and the prompt takes the
  // rest of the 8-token budget until it is done (7 + 7 + 6 tokens).
  auto b = make_sequence(2, 20, 100);
  scheduler.add(b.get());
  std::vector<int64_t> b_chunks;
  while (b->num_computed < b->prompt_len) {
    StepPlan plan = scheduler.schedule();
    EXPECT_LE(plan.num_tokens, 8);
    ASSERT_FALSE(plan.chunks.empty());
    EXPECT_EQ(plan.chunks[0].seq, a.get()) << "decode tokens come first";
    EXPECT_EQ(plan.chunks[0].count, 1);
    EXPECT_TRUE(plan.chunks[0].samples);
    b_chunks.push_back(tokens_of(plan, b.get()));
    finish_step(scheduler, plan);
  }
  EXPECT_EQ(b_chunks, (std::vector<int64_t>{7, 7, 6}));
  EXPECT_EQ(b->tokens.size(), 21u) << "the last chunk samples b's first token";
  // Now both decode.
  StepPlan both = scheduler.schedule();
  EXPECT_EQ(both.num_tokens, 2);
}

TEST(Scheduler, RespectsMaxNumSeqs) {
  KvBlockPool pool(64, 4);
  Scheduler scheduler(pool, {.max_num_seqs = 2, .max_num_batched_tokens = 64});
  std::vector<std::unique_ptr<Sequence>> seqs;
  for (uint64_t i = 0; i < 4; ++i) {
    seqs.push_back(make_sequence(i, 2));
    scheduler.add(seqs.back().get());
  }
  StepPlan plan = scheduler.schedule();
  EXPECT_EQ(plan.chunks.size(), 2u);
  EXPECT_EQ(scheduler.num_running(), 2);
  EXPECT_EQ(scheduler.num_waiting(), 2);
}

TEST(Scheduler, PreemptsTheNewestWhenBlocksRunOutAndRecomputesItLater) {
  // 4 blocks of 2 positions: two sequences of 3 tokens hold 2 blocks each; the next decode token
  // of the older one needs a third block, so the newer one is preempted.
  KvBlockPool pool(4, 2);
  Scheduler scheduler(pool, {.max_num_seqs = 4, .max_num_batched_tokens = 16, .enable_prefix_caching = false});
  auto old_seq = make_sequence(1, 3);
  auto new_seq = make_sequence(2, 3, 50);
  scheduler.add(old_seq.get());
  scheduler.add(new_seq.get());
  StepPlan prefill = scheduler.schedule();
  ASSERT_EQ(prefill.chunks.size(), 2u);
  finish_step(scheduler, prefill);  // both have 4 tokens, 3 computed; 4 blocks in use
  StepPlan decode = scheduler.schedule();  // positions 3: no new block needed
  EXPECT_EQ(decode.num_tokens, 2);
  finish_step(scheduler, decode);  // 5 tokens each, 4 computed
  EXPECT_EQ(pool.num_free(), 0);

  StepPlan tight = scheduler.schedule();
  ASSERT_EQ(tight.preempted.size(), 1u);
  EXPECT_EQ(tight.preempted[0], new_seq.get());
  EXPECT_EQ(new_seq->num_computed, 0);
  EXPECT_EQ(new_seq->preemptions, 1);
  EXPECT_EQ(new_seq->tokens.size(), 5u) << "a preempted sequence keeps every token";
  EXPECT_EQ(tokens_of(tight, old_seq.get()), 1);
  EXPECT_EQ(tokens_of(tight, new_seq.get()), 0);
  EXPECT_EQ(scheduler.num_waiting(), 1);
  finish_step(scheduler, tight);

  // Once the old one is gone, the preempted one is admitted again and recomputes all 5 tokens.
  scheduler.remove(old_seq.get());
  StepPlan again = scheduler.schedule();
  ASSERT_EQ(again.chunks.size(), 1u);
  EXPECT_EQ(again.chunks[0].seq, new_seq.get());
  EXPECT_EQ(again.chunks[0].start, 0);
  EXPECT_EQ(again.chunks[0].count, 5);
  EXPECT_TRUE(again.chunks[0].samples);
}

TEST(Scheduler, AdmissionSharesACachedPrefix) {
  KvBlockPool pool(16, 4);
  Scheduler scheduler(pool, {.max_num_seqs = 4, .max_num_batched_tokens = 64});
  auto first = make_sequence(1, 10);
  scheduler.add(first.get());
  finish_step(scheduler, scheduler.schedule());
  auto second = make_sequence(2, 10);  // the same 10 tokens: 2 full blocks are shareable
  scheduler.add(second.get());
  StepPlan plan = scheduler.schedule();
  EXPECT_EQ(second->cached_prompt_tokens, 8);
  EXPECT_EQ(tokens_of(plan, second.get()), 2) << "only the tokens after the shared blocks are computed";
  EXPECT_EQ(second->table.blocks()[0], first->table.blocks()[0]);
  EXPECT_EQ(second->table.blocks()[1], first->table.blocks()[1]);
}

TEST(Scheduler, NoBlockLeaksAfterRandomSubmitsCancelsAndSteps) {
  KvBlockPool pool(24, 4);
  Scheduler scheduler(pool, {.max_num_seqs = 6, .max_num_batched_tokens = 12});
  std::mt19937_64 rng(42);
  std::vector<std::unique_ptr<Sequence>> live;
  uint64_t next_id = 0;
  for (int op = 0; op < 1000; ++op) {
    const uint64_t choice = rng() % 4;
    if (choice == 0 && live.size() < 12) {
      // Prompts from a few shared starts, so prefix sharing and eviction happen too.
      live.push_back(make_sequence(next_id++, 1 + static_cast<int64_t>(rng() % 14), static_cast<int64_t>(rng() % 3)));
      scheduler.add(live.back().get());
    } else if (choice == 1 && !live.empty()) {
      const size_t victim = rng() % live.size();
      scheduler.remove(live[victim].get());
      live.erase(live.begin() + static_cast<std::ptrdiff_t>(victim));
    } else {
      StepPlan plan = scheduler.schedule();
      EXPECT_LE(plan.num_tokens, 12);
      finish_step(scheduler, plan, static_cast<int64_t>(rng() % 5));
      // Sequences that reach 20 tokens finish.
      for (size_t i = 0; i < live.size();) {
        if (live[i]->tokens.size() >= 20) {
          scheduler.remove(live[i].get());
          live.erase(live.begin() + static_cast<std::ptrdiff_t>(i));
        } else {
          ++i;
        }
      }
    }
    int64_t held = 0;
    for (const auto& s : live) held += static_cast<int64_t>(s->table.blocks().size());
    EXPECT_GE(held, pool.num_in_use()) << "op " << op;  // shared blocks count once in the pool
  }
  for (auto& s : live) scheduler.remove(s.get());
  EXPECT_EQ(pool.num_in_use(), 0);
  EXPECT_EQ(scheduler.num_running(), 0);
  EXPECT_EQ(scheduler.num_waiting(), 0);
}

}  // namespace
}  // namespace kiln::pipelines
