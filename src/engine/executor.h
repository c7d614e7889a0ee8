// Private: runs one GraphPlan on the CPU. Built at init (weights bound, constants materialised,
// kernels resolved, static shapes precomputed); each run checks the inputs, binds symbolic dims,
// sizes the arena slots and launches the steps in order.
#pragma once

#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "kernels/cpu/kernels.h"
#include "kiln/ext/extensions.h"
#include "kiln/compiler/compiled_model.h"
#include "kiln/engine/session.h"
#include "kiln/engine/tensor.h"

namespace kiln::engine {

class Executor {
 public:
  // `weights` must already be checked against the plan (see check_weights); `parallel` outlives this.
  Executor(compiler::GraphPlan plan, const WeightsRegistry& weights, kernels::Parallel* parallel);

  // Not thread-safe: the arena is reused across runs (Model::Impl serialises calls).
  std::vector<Tensor> run(const std::vector<Tensor>& inputs);
  const compiler::GraphPlan& plan() const { return plan_; }

 private:
  struct StepInfo {
    kernels::KernelFn kernel = nullptr;
    bool symbolic_attrs = false;  // some Shape attr must be evaluated per run
    const ext::CustomOp* custom = nullptr;  // custom ops run the extension's kernel instead
  };

  graph::SymbolBindings bind_inputs(const std::vector<Tensor>& inputs) const;
  std::vector<int64_t> value_shape(size_t value, const graph::SymbolBindings& bindings) const;
  void launch(const compiler::Step& step, const StepInfo& info, const graph::Attrs& attrs,
              const std::vector<kernels::TensorView>& views) const;
  void launch_custom(const compiler::Step& step, const ext::CustomOp& op, const graph::Attrs& attrs,
                     const std::vector<kernels::TensorView>& views) const;

  compiler::GraphPlan plan_;
  kernels::Parallel* parallel_;
  std::vector<StepInfo> steps_;
  std::vector<Tensor> bound_;                           // per value: weights and constants
  std::vector<std::optional<std::vector<int64_t>>> static_shapes_;  // per value, when static
  std::vector<Tensor> slots_;                            // arena: u8 buffers, grown on demand
};

// Checks a registry against the plan's weights: present, same dtype, shape equal to the weight's
// static shape, contiguous, on a CPU device. ValueError naming the weight and expected vs got.
void check_weights(const compiler::GraphPlan& plan, const WeightsRegistry& weights);

}  // namespace kiln::engine

namespace kiln::engine {

// Shared by copies of a Model. The mutex makes concurrent execute() calls on one Model wait for each
// other instead of sharing the arena.
struct Model::Impl {
  std::shared_ptr<const void> session;  // keeps the session's thread pool alive
  Executor executor;
  std::mutex mutex;

  Impl(std::shared_ptr<const void> session_state, Executor exec)
      : session(std::move(session_state)), executor(std::move(exec)) {}
};

}  // namespace kiln::engine
