// Per-row sampling for the batched engine: the batched sampler and greedy graphs, then the host-side
// pieces (parameter checks, penalties, logprobs) in the order a step uses them.
#include "batch_sampler.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "kiln/graph/ops.h"

namespace kiln::pipelines {

namespace ops = graph::ops;
using graph::TensorValue;

namespace {

TensorValue f32(double v) { return ops::constant(v, DType::f32); }
TensorValue i64(double v) { return ops::constant(v, DType::i64); }

// A per-row parameter [rows] as a column [rows, 1], to broadcast against [rows, vocab] or [rows, cap].
TensorValue column(const TensorValue& v, const graph::Dim& rows) {
  return ops::reshape(v, graph::Shape{rows, graph::Dim(1)});
}

}  // namespace

TensorValue inverse_cdf(const TensorValue& w, const TensorValue& u, const TensorValue& last) {
  TensorValue cdf = ops::cumsum(w, -1);                                        // [..., n]
  TensorValue total = ops::slice(cdf, {{0}, {-1}});                            // [..., 1]
  TensorValue below = ops::cast(ops::less_equal(cdf, u * total), DType::i64);  // [..., n]
  return ops::minimum(ops::sum(below, -1), last);                              // [..., 1]
}

// ---- the batched sampler graph ------------------------------------------------------------------

BatchSamplerModule::BatchSamplerModule(int64_t vocab_size, int64_t cap) : vocab_size_(vocab_size), cap_(cap) {
  if (vocab_size < 1)
    throw ValueError(fmt::format("BatchSamplerModule: vocab_size must be >= 1, got {}", vocab_size));
  if (cap < 1 || cap > vocab_size)
    throw ValueError(
        fmt::format("BatchSamplerModule: cap {} must be in [1, vocab_size {}]", cap, vocab_size));
}

std::vector<nn::TypeTree> BatchSamplerModule::input_types() const {
  using graph::TensorType;
  const graph::InputType logits = TensorType{DType::f32, {"rows", vocab_size_}};
  const graph::InputType f32_row = TensorType{DType::f32, {"rows"}};
  const graph::InputType i64_row = TensorType{DType::i64, {"rows"}};
  return {nn::TypeTree(logits),    // logits
          nn::TypeTree(f32_row),   // temperature
          nn::TypeTree(i64_row),   // top_k
          nn::TypeTree(f32_row),   // top_p
          nn::TypeTree(f32_row),   // min_p
          nn::TypeTree(f32_row)};  // u in [0, 1)
}

// Each parameter a column [rows, 1] against the [rows, vocab] or [rows, cap] values.
nn::Values BatchSamplerModule::forward(const std::vector<nn::Values>& args) {
  if (args.size() != 6)
    throw ValueError(fmt::format(
        "BatchSamplerModule: expected 6 inputs (logits, temperature, top_k, top_p, min_p, u), got {}",
        args.size()));
  TensorValue logits = args[0].leaf();  // [rows, vocab]
  const graph::Dim rows = logits.shape()[0];
  TensorValue temperature = column(args[1].leaf(), rows);  // [rows, 1]
  TensorValue top_k = column(args[2].leaf(), rows);        // [rows, 1] i64
  TensorValue top_p = column(args[3].leaf(), rows);        // [rows, 1]
  TensorValue min_p = column(args[4].leaf(), rows);        // [rows, 1]
  TensorValue u = column(args[5].leaf(), rows);            // [rows, 1]

  TensorValue greedy_token = ops::argmax(logits, -1);  // [rows, 1]
  TensorValue is_greedy = ops::less_equal(temperature, f32(0));
  TensorValue safe_t = ops::where(is_greedy, f32(1), temperature);  // keeps the unused paths finite

  // Softmax numerators exp((logit - max) / T): the top token's is exactly 1, so min_p * (the top
  // token's probability) is min_p itself on this scale, whatever the normalisation.
  TensorValue max_logit = ops::max(logits, -1);             // [rows, 1]
  TensorValue w = ops::exp((logits - max_logit) / safe_t);  // [rows, vocab]

  // No top_k, no top_p: every token is a candidate, no sort needed; min_p is a threshold on w, so it
  // needs none either (and is not limited to the cap). min_p 0 keeps every w (all are >= 0).
  TensorValue full_w = ops::where(ops::greater_equal(w, min_p), w, f32(0));  // [rows, vocab]
  TensorValue full_token = inverse_cdf(full_w, u, i64(static_cast<double>(vocab_size_ - 1)));  // [rows, 1]

  // top_k / top_p: the cap largest logits, sorted descending (ties: lower id first, as argmax).
  std::vector<TensorValue> sorted = ops::top_k(logits, cap_, -1);
  TensorValue sorted_ids = sorted[1];                                   // [rows, cap] i64
  TensorValue sorted_w = ops::exp((sorted[0] - max_logit) / safe_t);    // [rows, cap], equals w gathered
  TensorValue rank = ops::range(0, 1, graph::Dim(cap_), DType::i64);    // [cap]
  TensorValue k_off = ops::equal(top_k, i64(0));                        // [rows, 1]
  TensorValue keep_k = ops::logical_or(k_off, ops::less(rank, top_k));  // [rows, cap]
  TensorValue w_k = ops::where(keep_k, sorted_w, f32(0));               // [rows, cap]
  // top_p sees the distribution after top_k (Hugging Face's warper order): renormalised over the
  // top_k when it is on, over the whole vocabulary when it is off. Sums run along each row.
  TensorValue mass = ops::where(k_off, ops::sum(w, -1), ops::sum(w_k, -1));   // [rows, 1]
  TensorValue mass_before = ops::cumsum(w_k / mass, -1, /*exclusive=*/true);  // [rows, cap]
  TensorValue keep_p = ops::logical_or(ops::less(mass_before, top_p), ops::greater_equal(top_p, f32(1)));
  // min_p last, as Hugging Face runs its warpers: a ratio to the top token, which every filter keeps,
  // so it is the same test on the renormalised distribution.
  TensorValue keep_m = ops::greater_equal(sorted_w, min_p);  // [rows, cap]
  TensorValue keep = ops::logical_or(ops::logical_and(ops::logical_and(keep_k, keep_p), keep_m),
                                     ops::equal(rank, i64(0)));  // [rows, cap]
  TensorValue kept_w = ops::where(keep, sorted_w, f32(0));
  // Each filter keeps a prefix of the sorted tokens, so the last kept rank is their count - 1.
  TensorValue last_kept = ops::sum(ops::cast(keep, DType::i64), -1) - 1.0;  // [rows, 1]
  TensorValue pick = inverse_cdf(kept_w, u, last_kept);                     // [rows, 1]
  // sorted_ids[r, pick[r]]: gather takes whole rows, so select by a one-hot mask along each row.
  TensorValue truncated_token =
      ops::sum(ops::where(ops::equal(rank, pick), sorted_ids, i64(0)), -1);  // [rows, 1]

  TensorValue use_full = ops::logical_and(k_off, ops::greater_equal(top_p, f32(1)));
  TensorValue token = ops::where(is_greedy, greedy_token, ops::where(use_full, full_token, truncated_token));
  return nn::Values(ops::reshape(token, graph::Shape{rows}));  // [rows]
}

// ---- the batched greedy graph -------------------------------------------------------------------

BatchGreedyModule::BatchGreedyModule(int64_t vocab_size) : vocab_size_(vocab_size) {
  if (vocab_size < 1)
    throw ValueError(fmt::format("BatchGreedyModule: vocab_size must be >= 1, got {}", vocab_size));
}

std::vector<nn::TypeTree> BatchGreedyModule::input_types() const {
  const graph::InputType logits = graph::TensorType{DType::f32, {"rows", vocab_size_}};
  return {nn::TypeTree(logits)};
}

nn::Values BatchGreedyModule::forward(const std::vector<nn::Values>& args) {
  if (args.size() != 1)
    throw ValueError(fmt::format("BatchGreedyModule: expected 1 input (logits), got {}", args.size()));
  TensorValue logits = args[0].leaf();                                                        // [rows, vocab]
  return nn::Values(ops::reshape(ops::argmax(logits, -1), graph::Shape{logits.shape()[0]}));  // [rows]
}

// ---- parameters -----------------------------------------------------------------------------------

bool is_greedy(const RowSampling& s) { return s.temperature <= 0 || s.top_k == 1; }

bool has_penalties(const RowSampling& s) {
  return s.repetition_penalty != 1.0 || s.frequency_penalty != 0.0 || s.presence_penalty != 0.0;
}

void check_sampling_values(const RowSampling& s, int64_t cap, std::string_view who) {
  if (!std::isfinite(s.temperature) || s.temperature < 0)
    throw ValueError(fmt::format("{}: temperature must be a finite number >= 0, got {}", who, s.temperature));
  if (s.top_k < 0 || s.top_k > cap)
    throw ValueError(fmt::format("{}: top_k must be in [0, {}] (0: off; {} is the sampler's cap), got {}",
                                 who, cap, cap, s.top_k));
  if (!(s.top_p > 0 && s.top_p <= 1))
    throw ValueError(fmt::format("{}: top_p must be in (0, 1], got {}", who, s.top_p));
  if (!(s.min_p >= 0 && s.min_p <= 1))
    throw ValueError(fmt::format("{}: min_p must be in [0, 1], got {}", who, s.min_p));
  if (!std::isfinite(s.repetition_penalty) || s.repetition_penalty <= 0)
    throw ValueError(
        fmt::format("{}: repetition_penalty must be a finite number > 0, got {}", who, s.repetition_penalty));
  if (!(s.frequency_penalty >= -2 && s.frequency_penalty <= 2))
    throw ValueError(
        fmt::format("{}: frequency_penalty must be in [-2, 2], got {}", who, s.frequency_penalty));
  if (!(s.presence_penalty >= -2 && s.presence_penalty <= 2))
    throw ValueError(fmt::format("{}: presence_penalty must be in [-2, 2], got {}", who, s.presence_penalty));
  if (s.top_logprobs < 0 || s.top_logprobs > kMaxTopLogprobs)
    throw ValueError(
        fmt::format("{}: top_logprobs must be in [0, {}], got {}", who, kMaxTopLogprobs, s.top_logprobs));
}

// ---- penalties ------------------------------------------------------------------------------------

void TokenCounts::add_prompt(std::span<const int64_t> ids) {
  for (int64_t id : ids) entries_[id].in_prompt = true;
}

void TokenCounts::add_output(int64_t id) { ++entries_[id].output_count; }

int64_t TokenCounts::output_count(int64_t id) const {
  auto it = entries_.find(id);
  return it == entries_.end() ? 0 : it->second.output_count;
}

bool TokenCounts::in_prompt(int64_t id) const {
  auto it = entries_.find(id);
  return it != entries_.end() && it->second.in_prompt;
}

void apply_penalties(std::span<float> logits, const TokenCounts& counts, double repetition_penalty,
                     double frequency_penalty, double presence_penalty) {
  if (repetition_penalty == 1.0 && frequency_penalty == 0.0 && presence_penalty == 0.0) return;
  // f32 arithmetic in vLLM's order (repetition, then frequency, then presence), so the same logits
  // get the same bits.
  const auto rep = static_cast<float>(repetition_penalty);
  const auto freq = static_cast<float>(frequency_penalty);
  const auto presence = static_cast<float>(presence_penalty);
  const auto vocab = static_cast<int64_t>(logits.size());
  for (const auto& [id, entry] : counts.entries()) {
    if (id < 0 || id >= vocab)
      throw ValueError(
          fmt::format("apply_penalties: seen token id {} is outside the vocabulary [0, {})", id, vocab));
    float& l = logits[static_cast<size_t>(id)];
    l = l > 0 ? l / rep : l * rep;
    if (entry.output_count > 0) {
      l -= freq * static_cast<float>(entry.output_count);
      l -= presence;
    }
  }
}

void apply_penalties(std::span<float> logits, const TokenCounts& counts, const RowSampling& s) {
  apply_penalties(logits, counts, s.repetition_penalty, s.frequency_penalty, s.presence_penalty);
}

// ---- logprobs -------------------------------------------------------------------------------------

RowLogprobs row_logprobs(std::span<const float> logits, int64_t chosen, int64_t n) {
  const auto vocab = static_cast<int64_t>(logits.size());
  if (vocab == 0) throw ValueError("row_logprobs: the row of logits is empty");
  if (chosen < 0 || chosen >= vocab)
    throw ValueError(fmt::format("row_logprobs: chosen token {} is outside the row [0, {})", chosen, vocab));
  if (n < 0 || n > kMaxTopLogprobs)
    throw ValueError(fmt::format("row_logprobs: n must be in [0, {}], got {}", kMaxTopLogprobs, n));
  n = std::min(n, vocab);

  // Descending logit; ties: lower id first. The heap's front is the worst of the n best.
  struct Entry {
    float value;
    int64_t id;
  };
  auto before = [](const Entry& a, const Entry& b) {
    return a.value != b.value ? a.value > b.value : a.id < b.id;
  };
  std::vector<Entry> best;
  best.reserve(static_cast<size_t>(n));

  constexpr double kNegInf = -std::numeric_limits<double>::infinity();
  const float chosen_logit = logits[static_cast<size_t>(chosen)];
  double running_max = kNegInf, scaled_sum = 0;  // sum of exp(x - running_max) so far
  int64_t rank = 0;
  for (int64_t i = 0; i < vocab; ++i) {
    const float value = logits[static_cast<size_t>(i)];
    const double x = value;
    if (x > running_max) {
      scaled_sum = scaled_sum * std::exp(running_max - x) + 1.0;
      running_max = x;
    } else if (x != kNegInf) {  // -inf adds nothing (and -inf - -inf would be NaN)
      scaled_sum += std::exp(x - running_max);
    }
    rank += value >= chosen_logit;
    if (static_cast<int64_t>(best.size()) < n) {
      best.push_back({value, i});
      if (static_cast<int64_t>(best.size()) == n) std::make_heap(best.begin(), best.end(), before);
    } else if (n > 0 && value > best.front().value) {  // a later id loses ties: only a greater value enters
      std::pop_heap(best.begin(), best.end(), before);
      best.back() = {value, i};
      std::push_heap(best.begin(), best.end(), before);
    }
  }
  std::sort(best.begin(), best.end(), before);

  const double log_sum = running_max + std::log(scaled_sum);
  auto logprob = [&](float v) { return static_cast<float>(static_cast<double>(v) - log_sum); };
  RowLogprobs out;
  out.chosen = logprob(chosen_logit);
  out.chosen_rank = rank;
  out.top.reserve(best.size());
  for (const Entry& e : best) out.top.push_back({e.id, logprob(e.value)});
  return out;
}

}  // namespace kiln::pipelines
