// InferenceSession: compiles modules and binds weights into runnable Models, on the devices its
// backends run (the CPU's, and any the caller adds).
#include <algorithm>
#include <atomic>
#include <optional>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "engine/backend.h"
#include "engine/model_impl.h"
#include "kiln/engine/compile_cache.h"
#include "kiln/engine/weight_cache.h"
#include "kiln/engine/session.h"
#include "kiln/errors.h"
#include "kiln/ext/extensions.h"

namespace kiln::engine {

class SessionState {
 public:
  SessionState(std::vector<DeviceRef> devices, std::vector<std::shared_ptr<Backend>> backends)
      : devices(std::move(devices)), backends(std::move(backends)) {}

  std::vector<DeviceRef> devices;
  Backends backends;  // shared by every model of the session (the CPU's holds its thread pool)
  std::shared_ptr<ProcessGroup> process_group;  // carries collectives with processes > 1
  std::atomic<int64_t> compile_count{0};
  std::atomic<int64_t> cache_hits{0};
  std::optional<CompileCache> cache;  // nullopt: turned off, or no cache directory can be named
  std::atomic<bool> cache_unwritable{false};  // a store failed: warned once, no more stores
  std::optional<WeightCache> weight_cache;    // nullopt: turned off, or no cache directory can be named
  std::vector<std::filesystem::path> custom_extensions;
  std::shared_ptr<Logger> logger;
};

namespace {

using compiler::GraphPlan;

bool calls_custom_ops(const graph::Module& module) {
  for (const auto& g : module.graphs())
    for (const graph::Node& node : g->nodes)
      if (node.op == graph::Op::custom || node.op == graph::Op::inplace_custom) return true;
  return false;
}

// A collective spanning processes needs the session's process group, of exactly that many ranks;
// one within this process (processes == 1) never touches it.
void check_process_group(const GraphPlan& plan, const ProcessGroup* group) {
  for (const compiler::Step& step : plan.steps) {
    if (!graph::is_collective(step.op)) continue;
    const auto processes = graph::get_attr<int64_t>(step.attrs, "processes", step.op);
    if (processes == 1) continue;
    if (group == nullptr)
      throw ValueError(fmt::format("init: graph '{}' node {}: {} spans {} processes, but the session has no "
                                   "process group (set SessionOptions::process_group)",
                                   plan.name, step.node, graph::op_name(step.op), processes));
    if (group->size() != processes)
      throw ValueError(fmt::format("init: graph '{}' node {}: {} spans {} processes, but the session's "
                                   "process group has {}",
                                   plan.name, step.node, graph::op_name(step.op), processes, group->size()));
  }
}

// A session runs only on the devices it was made with: every value a plan places (inputs, weights,
// constants, op results) and every weight array bound must be on one of them. Backends are chosen
// by device kind, so without this check a graph on cpu:1 would run in a session made for cpu:0.
void check_devices(const GraphPlan& plan, const WeightsRegistry& weights,
                   const std::vector<DeviceRef>& devices) {
  auto held = [&](const DeviceRef& d) {
    return std::find(devices.begin(), devices.end(), d) != devices.end();
  };
  auto refuse = [&](const std::string& what, const DeviceRef& d) {
    std::vector<std::string> names;
    for (const DeviceRef& h : devices) names.push_back(h.to_string());
    throw ValueError(
        fmt::format("init: graph '{}': {} {}, a device this session does not hold (its devices: "
                    "[{}]; create the InferenceSession with {} among them)",
                    plan.name, what, d.to_string(), fmt::join(names, ", "), d.to_string()));
  };
  for (size_t i = 0; i < plan.input_types.size(); ++i)
    if (const DeviceRef d = graph::device_of(plan.input_types[i]); !held(d))
      refuse(fmt::format("input {} is on", i), d);
  for (const graph::Weight& w : plan.weights) {
    if (!held(w.device)) refuse(fmt::format("weight '{}' is declared on", w.name), w.device);
    auto it = weights.find(w.name);
    if (it != weights.end() && it->second.defined() && !held(it->second.device()))
      refuse(fmt::format("weight '{}' is bound to an array on", w.name), it->second.device());
  }
  for (const auto* steps : {&plan.constants, &plan.steps, &plan.aliases})
    for (const compiler::Step& step : *steps)
      for (int32_t v : step.outputs)
        if (const DeviceRef d = graph::device_of(plan.values.at(static_cast<size_t>(v)).type); !held(d))
          refuse(fmt::format("node {} ({}) puts its result on", step.node, graph::op_name(step.op)), d);
}

// The launch list of a device graph, recorded at init on inputs of its (static) input shapes, made by
// their devices' backends.
LaunchList record_device_graph(const Executor& executor, const Backends& backends) {
  std::vector<Tensor> inputs;
  const GraphPlan& plan = executor.plan();
  const auto& types = plan.input_types;
  for (size_t i = 0; i < types.size(); ++i) {
    const graph::Shape& shape = graph::shape_of(types[i]);
    if (!shape.is_static())
      throw ValueError(fmt::format("init: graph '{}' is a device graph, whose shapes are fixed at init, but "
                                   "input {} has symbolic shape {} (give it static dims)",
                                   plan.name, i, graph::to_string(types[i])));
    const DeviceRef device = graph::device_of(types[i]);
    inputs.push_back(backends.at(device.kind).allocate(graph::dtype_of(types[i]), shape.static_dims(), device));
  }
  // Not run now, so the inputs' contents do not matter: the first execute() replays it with real ones.
  return executor.record(inputs, /*run=*/false);
}

}  // namespace

InferenceSession::InferenceSession(std::vector<DeviceRef> devices,
                                   std::vector<std::filesystem::path> custom_extensions,
                                   SessionOptions options) {
  if (devices.empty()) throw ValueError("InferenceSession: needs at least one device, got none");
  if (options.num_threads < 0)
    throw ValueError(fmt::format("InferenceSession: num_threads must be >= 0, got {}", options.num_threads));
  std::vector<std::shared_ptr<Backend>> backends = std::move(options.backends);
  add_cpu_backend_unless_given(backends, options.num_threads);
  for (const DeviceRef& d : devices)
    if (std::none_of(backends.begin(), backends.end(), [&](const auto& b) { return b && b->kind() == d.kind; }))
      throw ValueError(fmt::format("InferenceSession: device {} is not supported (no backend runs {} devices)",
                                   d.to_string(), device_kind_name(d.kind)));
  // Loaded now for early errors (and so ops::custom can check calls as graphs are built).
  ext::ExtensionRegistry check_now(custom_extensions);
  state_ = std::make_shared<SessionState>(std::move(devices), std::move(backends));
  state_->custom_extensions = std::move(custom_extensions);
  state_->process_group = std::move(options.process_group);
  state_->logger = options.logger ? std::move(options.logger) : default_logger();
  if (options.compile_cache) {
    try {
      state_->cache.emplace(options.compile_cache_dir);
    } catch (const ValueError&) {
      // No directory to cache in (no KILN_CACHE_DIR, XDG_CACHE_HOME or HOME): compile every time.
      if (!options.compile_cache_dir.empty()) throw;
    }
  }
  if (options.weight_cache) {
    try {
      state_->weight_cache.emplace(
          options.compile_cache_dir.empty() ? WeightCache::default_dir() : options.compile_cache_dir / "weights", 0,
          state_->logger);
    } catch (const ValueError&) {
      if (!options.compile_cache_dir.empty()) throw;  // no directory to cache in: pack every time
    }
  }
}

InferenceSession::~InferenceSession() = default;
InferenceSession::InferenceSession(InferenceSession&&) noexcept = default;
InferenceSession& InferenceSession::operator=(InferenceSession&&) noexcept = default;

const std::vector<DeviceRef>& InferenceSession::devices() const { return state_->devices; }
Logger& InferenceSession::logger() const { return *state_->logger; }

const compiler::KernelCatalog& InferenceSession::kernel_catalog() const { return state_->backends; }

CompiledModel InferenceSession::compile(const graph::Module& module) const { return compile(module, {}); }

CompiledModel InferenceSession::compile(const graph::Module& module,
                                        const std::vector<std::filesystem::path>& extra_extensions) const {
  compiler::CompileOptions options;
  options.kernels = &state_->backends;
  ext::ExtensionRegistry extensions;
  if (calls_custom_ops(module)) {
    // Read again at each compile: load_library keys on content, so a rebuilt file loads as new code.
    for (const auto& path : state_->custom_extensions) extensions.add(ext::load_library(path));
    for (const auto& path : extra_extensions) extensions.add(ext::load_library(path));
    options.extensions = &extensions;
  }
  std::string key;
  if (state_->cache) {
    key = CompileCache::key(module, options);
    if (std::optional<CompiledModel> hit = state_->cache->find(key)) {
      ++state_->compile_count;
      ++state_->cache_hits;
      return std::move(*hit);
    }
  }
  CompiledModel compiled = compiler::compile(module, options);
  ++state_->compile_count;
  if (state_->cache && !state_->cache_unwritable.load()) {
    try {
      state_->cache->store(key, compiled);
    } catch (const std::exception& e) {
      // A cache that cannot be written (read-only, full disk) only costs compiles: say so once, then
      // stop trying (entries already there are still read).
      if (!state_->cache_unwritable.exchange(true))
        state_->logger->warning(fmt::format(
            "{}; compiled models are not stored in the cache for the rest of this session", e.what()));
    }
  }
  return compiled;
}

const std::vector<std::filesystem::path>& InferenceSession::custom_extensions() const {
  return state_->custom_extensions;
}

std::map<std::string, Model> InferenceSession::init(const CompiledModel& compiled,
                                                    const WeightsRegistry& weights) const {
  return init(compiled, weights, {});
}

std::map<std::string, Model> InferenceSession::init(const CompiledModel& compiled, const WeightsRegistry& weights,
                                                    const std::vector<std::string>& device_graphs) const {
  for (const std::string& name : device_graphs) compiled.plan(name);  // ValueError naming an unknown graph
  std::map<std::string, Model> models;
  for (const auto& [name, plan] : compiled.plans()) {
    check_devices(plan, weights, state_->devices);
    check_weights(plan, weights);
    check_process_group(plan, state_->process_group.get());
  }
  for (const auto& [name, plan] : compiled.plans()) {
    auto impl = std::make_shared<Model::Impl>(state_, plan, weights, state_->backends, state_->process_group.get(),
                                               state_->weight_cache ? &*state_->weight_cache : nullptr);
    if (std::find(device_graphs.begin(), device_graphs.end(), name) != device_graphs.end())
      impl->device_graph = record_device_graph(impl->executor, state_->backends);
    models.emplace(name, Model(std::move(impl)));
  }
  return models;
}

Model InferenceSession::load(const graph::Graph& graph, const WeightsRegistry& weights) const {
  // The graph's module may also hold graphs it calls; the model returned is this graph's.
  return load_all(graph.module(), weights).at(graph.name());
}

Model InferenceSession::load(const graph::Module& module, const WeightsRegistry& weights) const {
  if (module.size() != 1)
    throw ValueError(fmt::format(
        "InferenceSession::load: the module has {} graphs, expected exactly one (use load_all)",
        module.size()));
  auto models = load_all(module, weights);
  return models.begin()->second;
}

std::map<std::string, Model> InferenceSession::load_all(const graph::Module& module,
                                                        const WeightsRegistry& weights) const {
  return init(compile(module), weights);
}

int64_t InferenceSession::compile_count() const { return state_->compile_count.load(); }
int64_t InferenceSession::cache_hits() const { return state_->cache_hits.load(); }
const WeightCache* InferenceSession::weight_cache() const {
  return state_->weight_cache ? &*state_->weight_cache : nullptr;
}

}  // namespace kiln::engine
