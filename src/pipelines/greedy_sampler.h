// The "greedy" graph of TextGenerationPipeline, run instead of the "sampler" graph for greedy options.
#pragma once

#include <cstdint>
#include <vector>

#include "kiln/nn/module.h"

namespace kiln::pipelines {

// What SamplerModule gives at temperature 0 (or top_k 1), without computing its other paths: the
// sampler graph is branchless, so every call pays for the softmax numerators of the whole vocabulary,
// its cumulative sum and the top-k sort, which for a small model cost a fifth of a decode step.
// Input: logits f32[1, vocab]; output: their argmax i64[1].
class GreedySamplerModule : public nn::Module {
 public:
  explicit GreedySamplerModule(int64_t vocab_size) : vocab_size_(vocab_size) {}
  std::vector<nn::TypeTree> input_types() const;
  nn::Values forward(const std::vector<nn::Values>& args) override;

 private:
  int64_t vocab_size_;
};

}  // namespace kiln::pipelines
