// Model: one runnable graph of an initialised CompiledModel (InferenceSession::init / load).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kiln/graph/types.h"
#include "kiln/tensor/tensor.h"

namespace kiln::engine {

class InferenceSession;

// Where a Model's runs spent their time while it was profiling (Model::start_profiling).
struct StepProfile {
  std::string op;         // the op's name ("matmul", "fused_elementwise"; a custom op's own name)
  int64_t node = 0;       // its node in the compiled graph, as execute errors name it
  int64_t launches = 0;   // kernel launches of this step
  double seconds = 0;     // their wall-clock time, summed
  // Bytes of its weight operands as bound (a weight, or a fixed window of one), which a launch that
  // reads them whole (a matmul's) streams once: with `seconds`, the rate its weights were read at.
  int64_t weight_bytes = 0;
};
struct ModelProfile {
  int64_t runs = 0;       // execute() and replay() calls
  double seconds = 0;     // their wall-clock time, summed: the launches plus each run's own work
                          // (input checks, arena, results)
  std::vector<StepProfile> steps;  // every kernel step, in run order (aliases launch nothing)
};

// A runnable graph: one submodel of an initialised CompiledModel. Copies share state (the weights, the
// kernels built at init, the pool of run frames). execute() may be called from several threads at
// once, on one Model or its copies: each call runs in a frame of its own (its arena and views), and
// their kernels share the session's thread pool one launch at a time, so threads never outnumber
// cores. capture/replay and device-graph models replay one recorded launch list, so those calls
// take turns. Weights are not copied: borrowed registry memory must outlive the Model.
class Model {
 public:
  Model() = default;

  const std::string& name() const;
  // Runs the graph. Inputs are checked (count, dtype, rank, device, static dims, and symbolic dims
  // bound consistently across inputs), each failure naming the input index and dim. Non-contiguous
  // tensor inputs are copied; buffer inputs must be contiguous and are written in place.
  std::vector<Tensor> execute(const std::vector<Tensor>& inputs) const;
  const std::vector<graph::Type>& input_metadata() const;
  const std::vector<graph::Type>& output_metadata() const;

  // Capture and replay: capture() runs the graph once and records its launch list with every buffer,
  // shape and kernel fixed, under `key`; replay() copies `inputs` into the captured input buffers,
  // reruns the recorded launches with no per-op dispatch and returns the captured outputs (the same
  // tensors each replay, overwritten by the next one; clone to keep). Buffer inputs are copied back
  // to the caller's buffers after a replay. An input shape or dtype other than the captured one, an
  // unknown key, a key captured twice, or capture on a device-graph model is a ValueError.
  std::vector<Tensor> capture(const std::string& key, const std::vector<Tensor>& inputs) const;
  std::vector<Tensor> replay(const std::string& key, const std::vector<Tensor>& inputs) const;
  void release(const std::string& key) const;  // frees one capture; ValueError for an unknown key
  bool is_device_graph() const;  // see InferenceSession::init(compiled, weights, device_graphs)
  // The weights of which a kernel built a copy at init that its launches read instead (Q8_0's packed
  // GEMM panels, where AVX512-VNNI is), sorted. Where such a weight is a view of a file kiln mapped
  // (GGUF, safetensors), init drops its pages right after the copy is made (a later touch by another
  // reader reads them back from the file), so the process holds it once.
  const std::vector<std::string>& copied_weights() const;

  // Profiling: from start_profiling() on, every run times each kernel launch (two clock reads per
  // step; nothing while off). start_profiling() also clears the totals; stop_profiling() keeps them
  // for profile(). Copies of a Model share one profile.
  void start_profiling() const;
  void stop_profiling() const;
  ModelProfile profile() const;

 private:
  friend class InferenceSession;
  struct Impl;  // engine/model_impl.h
  explicit Model(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}
  Impl& impl() const;  // ValueError for a default-constructed Model
  std::shared_ptr<Impl> impl_;
};

}  // namespace kiln::engine
