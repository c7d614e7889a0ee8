// Iteration-level scheduling (Orca; vLLM's scheduler) for the generation engine: every step picks
// which tokens of which sequences the model computes, under a per-step token budget, over a paged KV
// cache (KvBlockPool). A step takes, in this order:
//   1. one decode token of every running sequence whose tokens are all computed but the last
//      (oldest first), so running streams never wait behind a prompt;
//   2. chunks of running sequences still in prefill (chunked prefill: at most the budget left);
//   3. new sequences from the waiting queue (FIFO) while there is budget, room in the cache and a
//      free running slot, and no sequence was preempted in this step.
// When a decode token needs a block and none is free, the newest running sequence not yet scheduled
// in this step is preempted: its blocks are released (its full blocks stay in the prefix cache) and it
// goes back to the front of the waiting queue with all its tokens, to be recomputed when it is
// admitted again. The oldest sequence always fits alone (the engine caps a sequence's length at the
// cache's size), so the schedule always progresses.
//
// Not thread-safe: the engine's step thread owns the scheduler.
#pragma once

#include <cstdint>
#include <deque>
#include <vector>

#include "kiln/pipelines/kv_block_pool.h"

namespace kiln::pipelines {

// One request's tokens as the scheduler sees them; the engine owns it.
struct Sequence {
  uint64_t id = 0;
  std::vector<int64_t> tokens;  // the prompt, then every generated token
  int64_t prompt_len = 0;
  int64_t num_computed = 0;          // leading tokens whose KV is in the cache
  int64_t cached_prompt_tokens = 0;  // of the prompt, taken from the prefix cache at first admission
  int64_t preemptions = 0;
  bool admitted_once = false;
  BlockTable table;  // holds num_computed tokens between steps, plus the scheduled ones during one

  int64_t remaining() const { return static_cast<int64_t>(tokens.size()) - num_computed; }
};

struct SchedulerOptions {
  int64_t max_num_seqs = 64;             // running sequences at most
  int64_t max_num_batched_tokens = 256;  // tokens per step at most (>= 1)
  bool enable_prefix_caching = true;
};

// Tokens [start, start + count) of `seq` computed in this step; `samples` when they are its last
// uncomputed tokens, so the step's logits for the last of them give its next token.
struct ScheduledChunk {
  Sequence* seq = nullptr;
  int64_t start = 0;
  int64_t count = 0;
  bool samples = false;
};

struct StepPlan {
  std::vector<ScheduledChunk> chunks;  // decode tokens first, then prefill chunks
  int64_t num_tokens = 0;
  std::vector<Sequence*> preempted;  // sent back to waiting in this step
  bool empty() const { return chunks.empty(); }
};

class Scheduler {
 public:
  // ValueError for a non-positive option.
  Scheduler(KvBlockPool& pool, SchedulerOptions options);

  // Queued at the back of the waiting queue. The sequence must outlive its time in the scheduler.
  void add(Sequence* seq);
  // Out of the scheduler, wherever it is, its blocks released. No-op for an unknown sequence.
  void remove(Sequence* seq);
  // The next step's work; reserves the KV blocks its tokens need.
  StepPlan schedule();
  // The plan was computed: its tokens' KV is in the cache.
  void complete(const StepPlan& plan);

  int64_t num_waiting() const { return static_cast<int64_t>(waiting_.size()); }
  int64_t num_running() const { return static_cast<int64_t>(running_.size()); }
  const SchedulerOptions& options() const { return options_; }
  KvBlockPool& pool() { return pool_; }

 private:
  void preempt(Sequence* seq, StepPlan& plan);
  // Blocks for `count` more tokens of seq; false (nothing reserved) when the pool is short.
  bool reserve(Sequence* seq, int64_t count);
  // How many of `wanted` next tokens of seq the free blocks (and its last block's free rows) hold.
  int64_t fitting(const Sequence* seq, int64_t wanted) const;

  KvBlockPool& pool_;
  SchedulerOptions options_;
  std::deque<Sequence*> waiting_;
  std::vector<Sequence*> running_;  // in admission order: the newest last
};

}  // namespace kiln::pipelines
