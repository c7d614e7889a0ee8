// The sampler graphs: SamplerModule (temperature, top_k, top_p, inverse-CDF pick) and the greedy
// argmax that replaces it for greedy options.
#include <fmt/format.h>

#include "batch_sampler.h"  // inverse_cdf
#include "greedy_sampler.h"
#include "kiln/graph/ops.h"
#include "kiln/pipelines/text_generation.h"

namespace kiln::pipelines {

namespace ops = graph::ops;
using graph::TensorValue;

// ---- the sampler graph ---------------------------------------------------------------------------

SamplerModule::SamplerModule(int64_t vocab_size, int64_t cap) : vocab_size_(vocab_size), cap_(cap) {
  if (vocab_size < 1)
    throw ValueError(fmt::format("SamplerModule: vocab_size must be >= 1, got {}", vocab_size));
  if (cap < 1 || cap > vocab_size)
    throw ValueError(fmt::format("SamplerModule: cap {} must be in [1, vocab_size {}]", cap, vocab_size));
}

std::vector<nn::TypeTree> SamplerModule::input_types() const {
  using graph::TensorType;
  return {nn::TypeTree(TensorType{DType::f32, {1, vocab_size_}}),  // logits
          nn::TypeTree(TensorType{DType::f32, {}}),                // temperature
          nn::TypeTree(TensorType{DType::i64, {}}),                // top_k
          nn::TypeTree(TensorType{DType::f32, {}}),                // top_p
          nn::TypeTree(TensorType{DType::f32, {}})};               // u in [0, 1)
}

namespace {

TensorValue f32(double v) { return ops::constant(v, DType::f32); }
TensorValue i64(double v) { return ops::constant(v, DType::i64); }

}  // namespace

nn::Values SamplerModule::forward(const std::vector<nn::Values>& args) {
  if (args.size() != 5)
    throw ValueError(fmt::format(
        "SamplerModule: expected 5 inputs (logits, temperature, top_k, top_p, u), got {}", args.size()));
  TensorValue logits = args[0].leaf();       // [1, vocab]
  TensorValue temperature = args[1].leaf();  // []
  TensorValue top_k = args[2].leaf();        // [] i64
  TensorValue top_p = args[3].leaf();        // []
  TensorValue u = args[4].leaf();            // []

  TensorValue greedy_token = ops::reshape(ops::argmax(logits, -1), std::vector<int64_t>{1});  // [1]
  TensorValue is_greedy = ops::less_equal(temperature, f32(0));
  TensorValue safe_t = ops::where(is_greedy, f32(1), temperature);  // keeps the unused paths finite

  // Unnormalised probabilities exp((logit - max) / T), at most 1: softmax without the division,
  // which the inverse CDF does not need.
  TensorValue max_logit = ops::max(logits, -1);             // [1, 1]
  TensorValue w = ops::exp((logits - max_logit) / safe_t);  // [1, vocab]

  // Plain temperature sampling (no top_k, no top_p): every token is a candidate, no sort needed.
  TensorValue full_token =
      ops::reshape(inverse_cdf(w, u, i64(static_cast<double>(vocab_size_ - 1))), std::vector<int64_t>{1});

  // top_k / top_p: the cap largest logits, sorted descending (ties: lower id first, as argmax), so
  // top_k = 1 is exactly argmax. Sorting the raw logits, not w, keeps ties that exp would create apart.
  std::vector<TensorValue> sorted = ops::top_k(logits, cap_, -1);
  TensorValue sorted_ids = sorted[1];                                 // [1, cap] i64
  TensorValue sorted_w = ops::exp((sorted[0] - max_logit) / safe_t);  // [1, cap], equals w gathered
  TensorValue rank = ops::range(0, 1, graph::Dim(cap_), DType::i64);  // [cap]
  TensorValue k_off = ops::equal(top_k, i64(0));
  TensorValue keep_k = ops::logical_or(k_off, ops::less(rank, top_k));  // [cap]
  TensorValue w_k = ops::where(keep_k, sorted_w, f32(0));               // [1, cap]
  // top_p sees the distribution after top_k (as Hugging Face's warpers run): renormalised over the
  // top_k when it is on, over the whole vocabulary when it is off.
  TensorValue mass = ops::where(k_off, ops::sum(w, -1), ops::sum(w_k, -1));   // [1, 1]
  TensorValue mass_before = ops::cumsum(w_k / mass, -1, /*exclusive=*/true);  // [1, cap]
  TensorValue keep_p = ops::logical_or(ops::less(mass_before, top_p), ops::greater_equal(top_p, f32(1)));
  TensorValue keep = ops::logical_or(ops::logical_and(keep_k, keep_p), ops::equal(rank, i64(0)));  // [1, cap]
  TensorValue kept_w = ops::where(keep, sorted_w, f32(0));
  // Kept entries are a prefix, so the last kept rank is their count - 1.
  TensorValue last_kept = ops::sum(ops::cast(keep, DType::i64), -1) - 1.0;                      // [1, 1]
  TensorValue pick = ops::reshape(inverse_cdf(kept_w, u, last_kept), std::vector<int64_t>{1});  // [1]
  TensorValue truncated_token = ops::reshape(ops::gather(sorted_ids, pick, 1), std::vector<int64_t>{1});

  TensorValue use_full = ops::logical_and(k_off, ops::greater_equal(top_p, f32(1)));
  return nn::Values(ops::where(is_greedy, greedy_token, ops::where(use_full, full_token, truncated_token)));
}

// ---- the greedy graph ----------------------------------------------------------------------------

std::vector<nn::TypeTree> GreedySamplerModule::input_types() const {
  return {nn::TypeTree(graph::TensorType{DType::f32, {1, vocab_size_}})};  // logits
}

nn::Values GreedySamplerModule::forward(const std::vector<nn::Values>& args) {
  if (args.size() != 1)
    throw ValueError(fmt::format("greedy sampler: expected 1 input (logits), got {}", args.size()));
  return nn::Values(ops::reshape(ops::argmax(args[0].leaf(), -1), std::vector<int64_t>{1}));  // [1]
}

}  // namespace kiln::pipelines
