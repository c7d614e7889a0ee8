// InferenceSession compiles graph Modules and initialises them with weights into runnable Models.
//
//   kiln::engine::InferenceSession session({kiln::DeviceRef::CPU()});
//   auto model = session.load(graph, weights);
//   std::vector<kiln::Tensor> out = model.execute({x});
#pragma once

#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "kiln/compiler/compiled_model.h"
#include "kiln/distributed.h"
#include "kiln/tensor/tensor.h"
#include "kiln/graph/graph.h"
#include "kiln/logging.h"

namespace kiln::engine {

using compiler::CompiledModel;

class SessionState;  // private: devices, thread pool, kernel registry

// Where a Model's runs spent their time while it was profiling (Model::start_profiling).
struct StepProfile {
  std::string op;         // the op's name ("matmul", "fused_elementwise"; a custom op's own name)
  int64_t node = 0;       // its node in the compiled graph, as execute errors name it
  int64_t launches = 0;   // kernel launches of this step
  double seconds = 0;     // their wall-clock time, summed
};
struct ModelProfile {
  int64_t runs = 0;       // execute() and replay() calls
  double seconds = 0;     // their wall-clock time, summed: the launches plus each run's own work
                          // (input checks, arena, results)
  std::vector<StepProfile> steps;  // every kernel step, in run order (aliases launch nothing)
};

// A runnable graph: one submodel of an initialised CompiledModel. Copies share state (weights and the
// scratch arena), so execute() calls on one Model or its copies run one at a time; use one Model per
// thread (init the CompiledModel again) to run a graph concurrently. Weights are not copied: borrowed
// registry memory must outlive the Model.
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

  // Profiling: from start_profiling() on, every run times each kernel launch (two clock reads per
  // step; nothing while off). start_profiling() also clears the totals; stop_profiling() keeps them
  // for profile(). Copies of a Model share one profile.
  void start_profiling() const;
  void stop_profiling() const;
  ModelProfile profile() const;

  struct Impl;
  explicit Model(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}

 private:
  std::shared_ptr<Impl> impl_;
};

struct SessionOptions {
  int num_threads = 0;  // 0: one per core
  // compile() consults the persistent compile cache (kiln/engine/compile_cache.h) in
  // compile_cache_dir (empty: CompileCache::default_dir(), i.e. KILN_CACHE_DIR or ~/.cache/kiln).
  bool compile_cache = true;
  std::filesystem::path compile_cache_dir = {};
  // For graphs whose collectives span processes (processes > 1): the group that carries them, e.g.
  // engine::mpi_world() (kiln/engine/distributed.h). Its size must equal each collective's processes.
  std::shared_ptr<ProcessGroup> process_group = nullptr;
  // Where the session's warnings go (kiln/logging.h); nullptr: default_logger(), stderr.
  std::shared_ptr<Logger> logger = nullptr;
};

class InferenceSession {
 public:
  // custom_extensions: custom-kernel libraries (kiln/extension.h) loaded now, so a bad path, a
  // library without the entry point or of another ABI major is an ExtensionError naming the path
  // here. Each compile of a module that calls custom ops reads them again by content hash, so a
  // rebuilt library is picked up; a module without custom ops never touches them.
  explicit InferenceSession(std::vector<DeviceRef> devices = {DeviceRef::CPU()},
                            std::vector<std::filesystem::path> custom_extensions = {},
                            SessionOptions options = {});
  ~InferenceSession();
  InferenceSession(InferenceSession&&) noexcept;
  InferenceSession& operator=(InferenceSession&&) noexcept;

  const std::vector<DeviceRef>& devices() const;
  // SessionOptions::logger, or default_logger() when none was given.
  Logger& logger() const;

  CompiledModel compile(const graph::Module& module) const;
  // Compiles with the session's extensions plus `extra_extensions` (one compile unit's, e.g. the
  // union of a GraphSpec group's custom_extensions); an op defined by two of them is an ExtensionError.
  CompiledModel compile(const graph::Module& module,
                        const std::vector<std::filesystem::path>& extra_extensions) const;
  const std::vector<std::filesystem::path>& custom_extensions() const;
  // Binds weights: every weight of every graph present, dtype and shape equal, contiguous, on the
  // right kind of device; each failure names the weight. Returns one Model per graph, by name.
  std::map<std::string, Model> init(const CompiledModel& compiled, const WeightsRegistry& weights) const;
  // As init, and each graph named in `device_graphs` becomes a device graph: its launch list is built
  // here (all input shapes must be static; ValueError naming the input otherwise) and every execute()
  // replays it. ValueError for a name that is not a graph of `compiled`.
  std::map<std::string, Model> init(const CompiledModel& compiled, const WeightsRegistry& weights,
                                    const std::vector<std::string>& device_graphs) const;
  // Compile + init of a graph's module; returns that graph's model (its module may also hold the
  // graphs it calls).
  Model load(const graph::Graph& graph, const WeightsRegistry& weights = {}) const;
  // Compile + init of a module with exactly one graph (ValueError otherwise).
  Model load(const graph::Module& module, const WeightsRegistry& weights = {}) const;
  std::map<std::string, Model> load_all(const graph::Module& module,
                                        const WeightsRegistry& weights = {}) const;
  // How many compiles this session has done (tests read it to show a group compiles once); a compile
  // served by the compile cache counts too, and also counts in cache_hits(), so
  // compile_count() - cache_hits() is how many times the compiler actually ran.
  int64_t compile_count() const;
  int64_t cache_hits() const;

 private:
  std::shared_ptr<SessionState> state_;
};

}  // namespace kiln::engine
