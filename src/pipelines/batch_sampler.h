// Per-row sampling for the batched generation engine: one step's logits f32[rows, vocab] belong to
// several requests, each with its own sampling parameters. The graphs (BatchSamplerModule,
// BatchGreedyModule) pick one token per row; the host functions below prepare a row before them
// (penalties), describe it after (logprobs), and check a request's values when it arrives.
// docs/generation.md ("Per-row batched sampling") has the semantics and their order.
//
//   RowSampling s{.temperature = 0.7, .top_p = 0.9, .min_p = 0.05};
//   check_sampling_values(s, sampler.cap());        // once, when the request arrives
//   counts.add_output(token);                       // each new token of the request
//   apply_penalties(row, counts, s);                // each step, on that request's logits row
//   // ... the "batch_sampler" graph (or "batch_greedy" when every row is_greedy) picks the tokens.
#pragma once

#include <cstdint>
#include <span>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "kiln/graph/graph.h"
#include "kiln/nn/module.h"
#include "kiln/pipelines/generation_engine.h"  // TokenLogprob

namespace kiln::pipelines {

// ---- the graphs -----------------------------------------------------------------------------------

// The sampler graph over a batch. Inputs (one list of leaves), `rows` symbolic:
//   logits f32[rows, vocab], temperature f32[rows], top_k i64[rows], top_p f32[rows],
//   min_p f32[rows], u f32[rows]
// Output: tokens i64[rows]. Per row: temperature <= 0 -> argmax of the logits (first index on ties);
// top_k == 0 and top_p >= 1 -> inverse-CDF pick with u over the whole softmax(logits / temperature);
// otherwise the `cap` largest logits, sorted (ops::top_k), keep the first top_k (if > 0), then the
// smallest prefix of the renormalised probabilities whose mass reaches top_p (at least one token),
// and pick by inverse CDF among those. Tokens outside the cap are never candidates there. min_p
// (0: off): after temperature, top_k and top_p, only tokens whose
// probability is >= min_p * the top token's survive (Hugging Face's warper order). min_p alone needs
// no sort, so it is not limited to the cap. Every op works along a row, so a row's token does not
// depend on the other rows.
class BatchSamplerModule : public nn::Module {
 public:
  BatchSamplerModule(int64_t vocab_size, int64_t cap);  // cap: 1..vocab_size
  std::vector<nn::TypeTree> input_types() const;
  nn::Values forward(const std::vector<nn::Values>& args) override;
  int64_t vocab_size() const { return vocab_size_; }
  int64_t cap() const { return cap_; }

 private:
  int64_t vocab_size_;
  int64_t cap_;
};

// BatchSamplerModule's token for rows that are all greedy (is_greedy), without its other paths:
// logits f32[rows, vocab] -> argmax i64[rows] (the first index on ties).
class BatchGreedyModule : public nn::Module {
 public:
  explicit BatchGreedyModule(int64_t vocab_size);
  std::vector<nn::TypeTree> input_types() const;
  nn::Values forward(const std::vector<nn::Values>& args) override;

 private:
  int64_t vocab_size_;
};

// The first index whose cumulative weight exceeds u * total, for
// unnormalised weights w [..., n] (a prefix of which may be non-zero), clamped to `last`. Returns
// [..., 1] i64. For u in [0, 1) the f32 product u * total is below total, so the pick always has a
// non-zero weight; the clamp is only a guard.
graph::TensorValue inverse_cdf(const graph::TensorValue& w, const graph::TensorValue& u,
                               const graph::TensorValue& last);

// ---- one request's parameters -----------------------------------------------------------------------

// What the engine maps a request's public sampling parameters onto.
struct RowSampling {
  double temperature = 1.0;         // <= 0: greedy (argmax)
  int64_t top_k = 0;                // 0: off; at most the sampler's cap
  double top_p = 1.0;               // (0, 1]; 1: off
  double min_p = 0.0;               // [0, 1]; 0: off
  double repetition_penalty = 1.0;  // > 0; 1: off
  double frequency_penalty = 0.0;   // [-2, 2]; 0: off
  double presence_penalty = 0.0;    // [-2, 2]; 0: off
  int64_t top_logprobs = 0;         // [0, kMaxTopLogprobs]: how many (id, logprob) to return
};

inline constexpr int64_t kMaxTopLogprobs = 20;  // OpenAI's limit

// Temperature 0 and top_k 1 both pick argmax(logits) exactly, whatever top_p, min_p and u are.
bool is_greedy(const RowSampling& s);
// True when apply_penalties would change a logit.
bool has_penalties(const RowSampling& s);
// ValueError naming the first field out of range and its value, prefixed by `who` ("request 7: ...").
// cap: the sampler's cap (the largest top_k).
void check_sampling_values(const RowSampling& s, int64_t cap, std::string_view who = "sampling");

// ---- penalties (host, one row, before the sampler graph) ---------------------------------------

// The tokens one request has seen: its prompt's distinct ids and how often each id occurs in its
// output. The engine adds each new token; memory and apply_penalties' work are O(distinct tokens).
class TokenCounts {
 public:
  TokenCounts() = default;
  explicit TokenCounts(std::span<const int64_t> prompt) { add_prompt(prompt); }
  void add_prompt(std::span<const int64_t> ids);  // more prompt tokens (a chunked prefill)
  void add_output(int64_t id);
  int64_t output_count(int64_t id) const;  // times id was generated
  bool in_prompt(int64_t id) const;
  size_t distinct() const { return entries_.size(); }  // ids seen in the prompt or the output
  void clear() { entries_.clear(); }

  struct Entry {
    int64_t output_count = 0;
    bool in_prompt = false;
  };
  const std::unordered_map<int64_t, Entry>& entries() const { return entries_; }

 private:
  std::unordered_map<int64_t, Entry> entries_;
};

// In place, on one row of raw logits [vocab] (OpenAI / vLLM semantics), for every id seen:
//   repetition (prompt or output): logit > 0 ? logit / repetition_penalty : logit * repetition_penalty
//   then frequency and presence (output only): logit -= frequency * count + presence * (count > 0)
// ValueError for a seen id outside [0, vocab).
void apply_penalties(std::span<float> logits, const TokenCounts& counts, double repetition_penalty,
                     double frequency_penalty, double presence_penalty);
void apply_penalties(std::span<float> logits, const TokenCounts& counts, const RowSampling& s);

// ---- logprobs (host, one row) -----------------------------------------------------------------------

struct RowLogprobs {
  float chosen = 0;               // the chosen token's logprob
  int64_t chosen_rank = 0;        // tokens at least as likely, itself included (vLLM's rank: 1 is the top)
  std::vector<TokenLogprob> top;  // the n most likely, descending; ties: lower id first
};

// log_softmax of the model's raw logits [vocab] (before penalties and temperature, as vLLM returns
// by default), computed in double in one pass (running max and sum of exponentials, and the n best
// in a small heap): the chosen token's and the n most likely. n in [0, kMaxTopLogprobs].
// ValueError for an empty row, chosen outside the row, or n out of range.
RowLogprobs row_logprobs(std::span<const float> logits, int64_t chosen, int64_t n);

}  // namespace kiln::pipelines
