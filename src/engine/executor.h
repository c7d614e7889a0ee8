// Private: runs one GraphPlan. Built at init (weights bound, constants materialised, one kernel
// object per step built from the step's recorded kernel key, symbolic dims interned into slots,
// static shapes precomputed); each run checks the inputs, binds symbolic dims, evaluates each
// interned dim once, sizes the arena slots, points aliases into their roots' memory and launches
// the steps in order. run(), record() and profiling are safe from several threads at once: each
// run takes a frame of its own (its arena, views and dim values) from a pool of idle ones.
//
// The executor's work is split by phase: executor_init.cpp (building), executor_shapes.cpp (inputs
// and per-run shapes), executor_aliases.cpp (views into other values' memory), executor_run.cpp
// (one run, its launches), executor_profile.cpp (profiling) and executor_replay.cpp (launch lists).
#pragma once

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "engine/backend.h"
#include "kernels/kernel.h"
#include "kiln/compiler/compiled_model.h"
#include "kiln/engine/model.h"
#include "kiln/engine/weight_cache.h"
#include "kiln/tensor/tensor.h"

namespace kiln::engine {

// A recorded run: the launches of one execution with every buffer and shape fixed, so a replay is a
// loop of kernel calls with no checks, shape evaluation or allocation. Shared by
// Model::capture/replay and device graphs (GraphSpec::is_device_graph).
struct LaunchList {
  struct Launch {
    size_t step;                              // index into plan().steps
    std::vector<kernels::TensorView> views;   // operands, then results
  };
  std::vector<Tensor> inputs;    // owned copies the caller's inputs are copied into
  std::vector<Tensor> results;   // what a replay returns, in output order
  std::vector<Tensor> slots;     // an arena of its own, so execute() never clobbers it
  std::vector<int64_t> dims;     // the symbolic dims' values at capture (KernelContext::dims)
  std::vector<Launch> launches;
  // Results that are not a step's fresh output (an input, weight, constant, or a value returned
  // twice): (source, result index) copied after the launches.
  std::vector<std::pair<Tensor, size_t>> copied_results;
};

class Executor {
 public:
  // `weights` must already be checked against the plan (see check_weights); `backends` (with every
  // device kind the plan's values live on), `process_group` (for collectives spanning processes) and
  // `weight_cache` (where kernels' packed copies of file-mapped weights are kept; null: nowhere)
  // outlive this.
  Executor(compiler::GraphPlan plan, const WeightsRegistry& weights, const Backends& backends,
           ProcessGroup* process_group = nullptr, const WeightCache* weight_cache = nullptr);
  ~Executor();

  std::vector<Tensor> run(const std::vector<Tensor>& inputs) const;
  const compiler::GraphPlan& plan() const { return plan_; }
  const std::vector<std::string>& copied_weights() const { return copied_weights_; }  // Model::copied_weights

  // Profiling (Model::start_profiling): launches time themselves while on; the caller adds each run.
  void start_profiling();
  void stop_profiling() { profiling_ = false; }
  bool profiling() const { return profiling_; }
  void add_profiled_run(double seconds) const;
  ModelProfile profile() const;

  // Records the launch list (see LaunchList) for inputs of these shapes, copying their data into its
  // input buffers; with `run`, also runs it once so its results are filled.
  LaunchList record(const std::vector<Tensor>& inputs, bool run = true) const;
  // Copies `inputs` (which must match the recorded shapes and dtypes; ValueError naming the input
  // otherwise) into the list's input buffers and reruns the launches; buffer inputs are copied back.
  // One list is replayed by one thread at a time (the caller's lock).
  void replay(LaunchList& list, const std::vector<Tensor>& inputs) const;
  // A copy of `source` in fresh memory on its device, through that device's backend.
  Tensor copy_of(const Tensor& source) const;

 private:
  // Every value's memory for one run: checked inputs, bound weights and constants, fresh outputs,
  // arena slots sized for these shapes, aliases into any of them. Frames are reused across runs, so
  // views of static-shape values are set once and a run allocates only its outputs.
  struct Frame {
    graph::SymbolBindings bindings;
    std::vector<Tensor> inputs;                  // per input: checked (contiguous where a copy was due)
    std::vector<Tensor> tensors;                 // per value: weights, constants, this run's outputs
    std::vector<kernels::TensorView> views;      // per value
    std::vector<Tensor> slots;                   // the arena: u8 buffers, grown on demand
    std::vector<size_t> slot_bytes;              // per slot: what this run needs
    // Per interned symbolic dim, for this run's bindings (KernelContext::dims); dim_failed marks the
    // ones that did not evaluate (a value or kernel that needs one reports why).
    std::vector<int64_t> dims;
    std::vector<uint8_t> dim_failed;
    bool any_dim_failed = false;
    std::vector<std::vector<kernels::TensorView>> step_views;  // per step: operands, then results
  };
  class FrameLease;  // a frame taken from the pool for one run, handed back after it

  struct StepInfo {
    std::unique_ptr<const kernels::Kernel> kernel;
    std::vector<int32_t> dim_slots;  // the interned dims its kernel's parameters read
    // Per operand, then result: what a run must copy from the value's view into the step's list.
    enum class Refresh : uint8_t { none, data, view };
    std::vector<Refresh> refresh;
    std::string label;               // the op's name, or a custom op's symbol: for errors and profiles
    kernels::KernelContext context;  // its backend's threads and the process group; dims set per run
  };
  // Per alias: its window, with symbolic bounds as interned dims.
  struct AliasInfo {
    int64_t static_offset = -1;  // bytes, when the window is fixed for every run
    kernels::DimRefs starts, stops;
    std::vector<int64_t> steps;
    std::vector<int32_t> dim_slots;  // the interned dims its bounds read
  };
  class Interner;  // kernels::SymbolSlots over symbolic_dims_

  // executor_profile.cpp: the bytes of a step's weight operands (StepProfile::weight_bytes).
  int64_t weight_bytes(const compiler::Step& step) const;

  // executor_init.cpp
  void intern_shapes();
  void bind_constants();
  void build_kernels();
  void bind_static_aliases();
  std::unique_ptr<Frame> new_frame() const;  // views of weights, constants and static shapes filled in
  // A launch's context: the step's backend's threads (fixed at init) and this run's dim values.
  static kernels::KernelContext context(const StepInfo& step, std::span<const int64_t> dims);

  // executor_shapes.cpp
  void check_inputs(const std::vector<Tensor>& given, std::vector<Tensor>& inputs) const;
  // Binds the symbols of the input types from the inputs' shapes (into `bindings`, cleared first).
  void bind_inputs(const std::vector<Tensor>& inputs, graph::SymbolBindings& bindings) const;
  void evaluate_symbolic_dims(Frame& frame) const;
  // A value's shape for this run into view (with contiguous strides), from frame.dims.
  void evaluate_shape_into(size_t value, const Frame& frame, kernels::TensorView& view) const;
  // The same through the Dim expressions themselves, throwing an error naming the value.
  void evaluate_shape_checked(size_t value, const graph::SymbolBindings& bindings, kernels::TensorView& view) const;
  // Memory for every value of this run (inputs already checked into frame.inputs).
  void prepare(Frame& frame) const;
  // The first interned dim among `slots` that failed this run, as an error naming the step.
  void check_dims(const compiler::Step& step, const std::vector<int32_t>& slots, const Frame& frame) const;

  // executor_aliases.cpp
  void resolve_alias(size_t alias, Frame& frame) const;  // sets the view of plan().aliases[alias]

  // executor_run.cpp
  void launch(size_t step, const kernels::KernelContext& ctx, std::span<const kernels::TensorView> views) const;
  // A value's memory as a Tensor (aliases and slots borrow theirs), e.g. to copy an output from.
  Tensor tensor_of(const Frame& frame, size_t value) const;
  void copy_into(const Tensor& dst, const Tensor& src) const;

  compiler::GraphPlan plan_;
  const Backends& backends_;
  ProcessGroup* process_group_;
  const WeightCache* weight_cache_;
  std::vector<StepInfo> steps_;
  std::vector<Tensor> bound_;                           // per value: weights, constants, their aliases
  std::vector<std::string> copied_weights_;             // sorted: a kernel runs on its own copy of each
  std::vector<std::optional<std::vector<int64_t>>> static_shapes_;  // per value, when static
  // Symbolic shapes compiled at init: each distinct symbolic dim (by its text) of a value's shape or a
  // kernel's parameters is evaluated once per run. Per value with a symbolic shape, per dim: a static
  // size or a slot of symbolic_dims_.
  std::vector<graph::Dim> symbolic_dims_;
  std::map<std::string, int32_t> dim_slots_;            // a dim's text -> its index in symbolic_dims_
  std::vector<kernels::DimRefs> symbolic_shapes_;
  std::vector<AliasInfo> aliases_;
  std::vector<uint8_t> fresh_outputs_;                   // per output: returned as is (not copied)
  std::vector<DeviceRef> slot_devices_;                  // per arena slot: the device of its values

  mutable std::mutex frames_mutex_;
  mutable std::vector<std::unique_ptr<Frame>> idle_frames_;

  // Profile totals, added to by concurrent runs.
  struct StepCounters {
    std::atomic<int64_t> launches{0};
    std::atomic<int64_t> nanoseconds{0};
  };
  std::atomic<bool> profiling_{false};
  std::atomic<bool> profile_started_{false};
  std::unique_ptr<StepCounters[]> step_counters_;
  mutable std::atomic<int64_t> profiled_runs_{0};
  mutable std::atomic<int64_t> profiled_nanoseconds_{0};
};

// Interns the symbolic dims a kernel asks for into the executor's table, and records which ones
// each step reads (so a run whose dim failed to evaluate names it before launching the step).
class Executor::Interner final : public kernels::SymbolSlots {
 public:
  Interner(Executor& executor, std::vector<int32_t>* used) : executor_(executor), used_(used) {}
  int32_t slot_of(const graph::Dim& dim) override {
    auto [it, fresh] = executor_.dim_slots_.emplace(dim.to_string(), static_cast<int32_t>(executor_.symbolic_dims_.size()));
    if (fresh) executor_.symbolic_dims_.push_back(dim);
    if (used_) used_->push_back(it->second);
    return it->second;
  }

 private:
  Executor& executor_;
  std::vector<int32_t>* used_;
};

// Checks a registry against the plan's weights: present, same dtype, shape equal to the weight's
// static shape, contiguous, on a device of the weight's kind. ValueError naming the weight and
// expected vs got.
void check_weights(const compiler::GraphPlan& plan, const WeightsRegistry& weights);

}  // namespace kiln::engine
