#include "pipelines/scheduler.h"

#include <algorithm>
#include <span>

#include <fmt/format.h>

#include "kiln/errors.h"

namespace kiln::pipelines {

Scheduler::Scheduler(KvBlockPool& pool, SchedulerOptions options) : pool_(pool), options_(options) {
  if (options.max_num_seqs < 1)
    throw ValueError(fmt::format("Scheduler: max_num_seqs must be >= 1, got {}", options.max_num_seqs));
  if (options.max_num_batched_tokens < 1)
    throw ValueError(
        fmt::format("Scheduler: max_num_batched_tokens must be >= 1, got {}", options.max_num_batched_tokens));
}

void Scheduler::add(Sequence* seq) { waiting_.push_back(seq); }

void Scheduler::remove(Sequence* seq) {
  if (auto it = std::find(waiting_.begin(), waiting_.end(), seq); it != waiting_.end()) waiting_.erase(it);
  if (auto it = std::find(running_.begin(), running_.end(), seq); it != running_.end()) running_.erase(it);
  seq->table.release(pool_);
  seq->num_computed = 0;
}

void Scheduler::preempt(Sequence* seq, StepPlan& plan) {
  running_.erase(std::find(running_.begin(), running_.end(), seq));
  seq->table.release(pool_);  // its full blocks stay cached: readmission may share them back
  seq->num_computed = 0;
  ++seq->preemptions;
  waiting_.push_front(seq);
  plan.preempted.push_back(seq);
}

int64_t Scheduler::fitting(const Sequence* seq, int64_t wanted) const {
  const int64_t size = pool_.block_size();
  const int64_t held = seq->table.num_tokens();
  const int64_t rows_left = static_cast<int64_t>(seq->table.blocks().size()) * size - held;
  return std::min(wanted, rows_left + pool_.num_free() * size);
}

bool Scheduler::reserve(Sequence* seq, int64_t count) {
  const auto start = static_cast<size_t>(seq->table.num_tokens());
  return seq->table.append(pool_, std::span<const int64_t>(seq->tokens).subspan(start, static_cast<size_t>(count)));
}

StepPlan Scheduler::schedule() {
  StepPlan plan;
  int64_t budget = options_.max_num_batched_tokens;
  auto scheduled = [&](const Sequence* s) {
    return std::any_of(plan.chunks.begin(), plan.chunks.end(), [&](const ScheduledChunk& c) { return c.seq == s; });
  };
  auto take = [&](Sequence* s, int64_t count) {
    plan.chunks.push_back({s, s->num_computed, count, count == s->remaining()});
    plan.num_tokens += count;
    budget -= count;
  };

  // 1. Decode tokens, oldest first; a block shortage preempts the newest unscheduled sequence.
  for (size_t i = 0; i < running_.size() && budget > 0; ++i) {
    Sequence* s = running_[i];
    if (s->remaining() != 1) continue;
    bool preempted_self = false;
    while (!reserve(s, 1)) {
      auto victim = std::find_if(running_.rbegin(), running_.rend(), [&](Sequence* r) { return !scheduled(r); });
      Sequence* v = *victim;  // s itself is unscheduled, so there is one
      preempt(v, plan);
      if (v == s) {
        preempted_self = true;
        break;
      }
    }
    if (preempted_self) {
      --i;  // running_[i] is now the next sequence
      continue;
    }
    take(s, 1);
  }

  // 2. Prefill chunks of running sequences, as much of each as the budget and the cache hold. When
  // nothing at all could be scheduled, the newest sequence makes room for the others.
  for (;;) {
    for (Sequence* s : running_) {
      if (budget == 0) break;
      if (s->remaining() <= 1 || scheduled(s)) continue;
      const int64_t n = fitting(s, std::min(s->remaining(), budget));
      if (n == 0 || !reserve(s, n)) continue;
      take(s, n);
    }
    if (!plan.empty() || running_.size() <= 1) break;
    preempt(running_.back(), plan);
  }

  // 3. Admissions, while nothing had to be preempted (or nothing runs at all).
  while (budget > 0 && !waiting_.empty() && num_running() < options_.max_num_seqs &&
         (plan.preempted.empty() || running_.empty())) {
    Sequence* s = waiting_.front();
    if (s->table.num_tokens() == 0 && options_.enable_prefix_caching) {
      s->num_computed = s->table.share_prefix(pool_, s->tokens);
      if (!s->admitted_once) s->cached_prompt_tokens = std::min(s->num_computed, s->prompt_len);
    }
    const int64_t n = fitting(s, std::min(s->remaining(), budget));
    if (n == 0 || !reserve(s, n)) {
      s->table.release(pool_);  // holds no shared blocks while it waits
      s->num_computed = 0;
      break;
    }
    waiting_.pop_front();
    running_.push_back(s);
    s->admitted_once = true;
    take(s, n);
  }
  return plan;
}

void Scheduler::complete(const StepPlan& plan) {
  for (const ScheduledChunk& c : plan.chunks) c.seq->num_computed += c.count;
}

}  // namespace kiln::pipelines
