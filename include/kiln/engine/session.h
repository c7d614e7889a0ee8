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
#include "kiln/engine/model.h"
#include "kiln/engine/weight_cache.h"
#include "kiln/tensor/tensor.h"
#include "kiln/graph/graph.h"
#include "kiln/logging.h"

namespace kiln::engine {

using compiler::CompiledModel;

class SessionState;  // private: devices, backends, compile cache
class Backend;       // private (engine/backend.h): one kind of device's kernels, memory and threads

struct SessionOptions {
  int num_threads = 0;  // 0: one per core
  // compile() consults the persistent compile cache (kiln/engine/compile_cache.h) in
  // compile_cache_dir (empty: CompileCache::default_dir(), i.e. KILN_CACHE_DIR or ~/.cache/kiln).
  bool compile_cache = true;
  std::filesystem::path compile_cache_dir = {};
  // init() keeps the copies kernels pack of weights mapped from files (GEMM panels, quantized panels)
  // in the packed-weight cache (kiln/engine/weight_cache.h), compile_cache_dir's weights/ (empty:
  // WeightCache::default_dir()), and a later init of the same file maps them instead of packing.
  bool weight_cache = true;
  // For graphs whose collectives span processes (processes > 1): the group that carries them, e.g.
  // engine::mpi_world() (kiln/engine/distributed.h). Its size must equal each collective's processes.
  std::shared_ptr<ProcessGroup> process_group = nullptr;
  // Backends for device kinds beyond the CPU's (one per kind; engine/backend.h, private for now: a
  // test adds an emulated device kind this way). A CPU backend given here replaces the built-in one.
  std::vector<std::shared_ptr<Backend>> backends = {};
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
  // The kernels of this session's backends, as the compiler asks for them: pass it in
  // compiler::CompileOptions::kernels to compile outside the session as the session compiles.
  const compiler::KernelCatalog& kernel_catalog() const;
  // SessionOptions::logger, or default_logger() when none was given.
  Logger& logger() const;

  CompiledModel compile(const graph::Module& module) const;
  // Compiles with the session's extensions plus `extra_extensions` (one compile unit's, e.g. the
  // union of a GraphSpec group's custom_extensions); an op defined by two of them is an ExtensionError.
  CompiledModel compile(const graph::Module& module,
                        const std::vector<std::filesystem::path>& extra_extensions) const;
  const std::vector<std::filesystem::path>& custom_extensions() const;
  // Binds weights: every weight of every graph present, dtype and shape equal, contiguous, on the
  // right kind of device; each failure names the weight. Every value of every graph, and every
  // weight array bound, must be on one of devices() (ValueError naming the value and the device).
  // Returns one Model per graph, by name.
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
  // The packed-weight cache init() uses (SessionOptions::weight_cache), or null when off: its hits()
  // and stores() count packed copies mapped and made.
  const WeightCache* weight_cache() const;

 private:
  std::shared_ptr<SessionState> state_;
};

}  // namespace kiln::engine
