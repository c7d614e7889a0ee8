// Private: runs one GraphPlan on the CPU. Built at init (weights bound, constants materialised,
// kernels resolved, static shapes precomputed); each run checks the inputs, binds symbolic dims,
// sizes the arena slots, points aliases into their roots' memory and launches the steps in order.
#pragma once

#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "kernels/cpu/kernels.h"
#include "kiln/ext/extensions.h"
#include "kiln/compiler/compiled_model.h"
#include "kiln/engine/session.h"
#include "kiln/tensor/tensor.h"

namespace kiln::engine {

// A recorded run: the launches of one execution with every buffer, shape and attribute fixed, so a
// replay is a loop of kernel calls with no checks, shape evaluation or allocation. Shared by
// Model::capture/replay and device graphs (GraphSpec::is_device_graph).
struct LaunchList {
  struct Launch {
    size_t step;                              // index into plan().steps
    graph::Attrs attrs;                       // symbolic Shape attrs evaluated at capture
    std::vector<kernels::TensorView> views;   // operands, then results
  };
  std::vector<Tensor> inputs;    // owned copies the caller's inputs are copied into
  std::vector<Tensor> results;   // what a replay returns, in output order
  std::vector<Tensor> slots;     // an arena of its own, so execute() never clobbers it
  std::vector<Launch> launches;
  // Results that are not a step's fresh output (an input, weight, constant, or a value returned
  // twice): (source, result index) copied after the launches.
  std::vector<std::pair<Tensor, size_t>> copied_results;
};

class Executor {
 public:
  // `weights` must already be checked against the plan (see check_weights); `parallel`, `team` (for
  // collectives over several devices) and `process_group` (for collectives spanning processes)
  // outlive this, and every launch, replays included, gets them.
  Executor(compiler::GraphPlan plan, const WeightsRegistry& weights, kernels::Parallel* parallel,
           kernels::DeviceTeam* team = nullptr, ProcessGroup* process_group = nullptr);

  // Not thread-safe: the arena is reused across runs (Model::Impl serialises calls).
  std::vector<Tensor> run(const std::vector<Tensor>& inputs);
  const compiler::GraphPlan& plan() const { return plan_; }

  // Profiling (Model::start_profiling): launches time themselves while on; the caller adds each run.
  void start_profiling();
  void stop_profiling() { profiling_ = false; }
  bool profiling() const { return profiling_; }
  void add_profiled_run(double seconds) const;
  ModelProfile profile() const;

  // Records the launch list (see LaunchList) for inputs of these shapes, copying their data into its
  // input buffers; with `run`, also runs it once so its results are filled.
  LaunchList record(const std::vector<Tensor>& inputs, bool run = true);
  // Copies `inputs` (which must match the recorded shapes and dtypes; ValueError naming the input
  // otherwise) into the list's input buffers and reruns the launches; buffer inputs are copied back.
  void replay(LaunchList& list, const std::vector<Tensor>& inputs) const;

 private:
  // Every value's memory for one run: checked inputs, bound weights and constants, fresh outputs,
  // arena slots sized for these shapes (from `slots`), aliases into any of them. run() reuses one
  // Frame, so views of static-shape values are set once and a run allocates only its outputs.
  struct Frame {
    graph::SymbolBindings bindings;
    std::vector<Tensor> tensors;                 // per value: weights, constants, this run's outputs
    std::vector<kernels::TensorView> views;      // per value
    std::vector<size_t> slot_bytes;              // per slot: what this run needs
    // Per symbolic_dims_ entry, for this run's bindings; empty where it did not evaluate (the slow
    // path, evaluate_shape_checked, reports why).
    std::vector<std::optional<int64_t>> dim_values;
  };
  void check_inputs(const std::vector<Tensor>& given, std::vector<Tensor>& inputs) const;
  Frame new_frame() const;  // views of weights, constants and static shapes filled in
  void prepare(const std::vector<Tensor>& inputs, std::vector<Tensor>& slots, Frame& frame) const;
  void resolve_alias(size_t alias, Frame& frame) const;  // sets the view of plan().aliases[alias]
  graph::Attrs evaluated_attrs(const compiler::Step& step, const graph::SymbolBindings& bindings) const;
  void evaluate_attrs_into(const compiler::Step& step, const graph::SymbolBindings& bindings,
                           graph::Attrs& attrs) const;
  // A value's memory as a Tensor (aliases and slots borrow theirs), e.g. to copy an output from.
  Tensor tensor_of(const Frame& frame, const std::vector<Tensor>& inputs, size_t value) const;

  struct StepInfo {
    kernels::KernelFn kernel = nullptr;
    bool symbolic_attrs = false;  // some Shape attr must be evaluated per run
    const ext::CustomOp* custom = nullptr;  // custom ops run the extension's kernel instead
    std::shared_ptr<const kernels::Prepared> prepared;  // built at init from fixed operands
  };
  void prepare_steps();  // fills StepInfo::prepared (after weights and constants are bound)
  void bind_static_aliases();  // aliases of weights and constants with static windows: bound_ at init

  graph::SymbolBindings bind_inputs(const std::vector<Tensor>& inputs) const;
  void evaluate_symbolic_dims(Frame& frame) const;  // fills frame.dim_values from frame.bindings
  // A value's shape for this run into view (with contiguous strides), from frame.dim_values.
  void evaluate_shape_into(size_t value, const Frame& frame, kernels::TensorView& view) const;
  // The same through the Dim expressions themselves, throwing an error naming the value.
  void evaluate_shape_checked(size_t value, const graph::SymbolBindings& bindings, kernels::TensorView& view) const;
  void launch(const compiler::Step& step, const StepInfo& info, const graph::Attrs& attrs,
              const std::vector<kernels::TensorView>& views) const;
  void launch_unprofiled(const compiler::Step& step, const StepInfo& info, const graph::Attrs& attrs,
                         const std::vector<kernels::TensorView>& views) const;
  void launch_custom(const compiler::Step& step, const ext::CustomOp& op, const graph::Attrs& attrs,
                     const std::vector<kernels::TensorView>& views) const;

  compiler::GraphPlan plan_;
  kernels::Parallel* parallel_;
  kernels::DeviceTeam* team_;
  ProcessGroup* process_group_;
  std::vector<StepInfo> steps_;
  std::vector<Tensor> bound_;                           // per value: weights, constants, their aliases
  std::vector<std::optional<std::vector<int64_t>>> static_shapes_;  // per value, when static
  // Symbolic shapes compiled at init: each distinct symbolic dim (by its text) is evaluated once per
  // run instead of once per value that has it (a decode step has ~300 such dims and a handful of
  // distinct ones: `seq`, `total`, ...). Per value with a symbolic shape, per dim: an index into
  // symbolic_dims_, or -1 and the static size.
  struct ShapeDim {
    int32_t symbolic = -1;
    int64_t size = 0;
  };
  std::vector<graph::Dim> symbolic_dims_;
  std::vector<std::vector<ShapeDim>> symbolic_shapes_;
  std::vector<int64_t> alias_offsets_;                   // per alias: byte offset when static, else -1
  std::vector<uint8_t> fresh_outputs_;                   // per output: returned as is (not copied)
  std::vector<Tensor> slots_;                            // arena: u8 buffers, grown on demand
  // Reused by run() (see Frame).
  Frame frame_;
  std::vector<Tensor> inputs_;
  std::vector<std::vector<kernels::TensorView>> step_views_;  // per step: operands, then results
  std::vector<graph::Attrs> step_attrs_;                       // per step with symbolic attrs
  // Profile totals: launches only read the flag and add to their own step's entry (runs are
  // serialised by Model::Impl's mutex).
  bool profiling_ = false;
  mutable ModelProfile profile_;
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
  std::map<std::string, LaunchList> captures;  // Model::capture, by key
  std::optional<LaunchList> device_graph;      // built at init for a device-graph model

  Impl(std::shared_ptr<const void> session_state, Executor exec)
      : session(std::move(session_state)), executor(std::move(exec)) {}
};

}  // namespace kiln::engine
