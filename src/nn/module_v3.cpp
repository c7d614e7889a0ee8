#include "kiln/nn/module_v3.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <stdexcept>

#include "kiln/engine/signals.h"
#include "kiln/ext/extensions.h"
#include "nn/trace_context.h"

namespace kiln::nn {

// ---- Parameter -------------------------------------------------------------------------------------

struct Parameter::State {
  std::string name;
  kiln::Tensor data;
  // The module that registered it, whose trace_ says whether it is being staged; null once that
  // module is gone (a handle may outlive it).
  const ModuleV3* owner;
};

const Parameter::State& Parameter::require() const {
  if (!state_) throw ValueError("nn::Parameter: not registered (get one from ModuleV3::register_parameter)");
  return *state_;
}

const std::string& Parameter::name() const { return require().name; }
const kiln::Tensor& Parameter::data() const { return require().data; }

void Parameter::set(kiln::Tensor data) const {
  const State& s = require();
  if (!data.defined())
    throw ValueError(fmt::format("nn::Parameter '{}': set() got an undefined tensor", s.name));
  if (data.dtype() != s.data.dtype() || data.shape() != s.data.shape())
    throw ValueError(fmt::format("nn::Parameter '{}': set() got {}{}, expected {}{}", s.name,
                                 dtype_name(data.dtype()), graph::Shape::of(data.shape()).to_string(),
                                 dtype_name(s.data.dtype()), graph::Shape::of(s.data.shape()).to_string()));
  state_->data = std::move(data);
}

Tensor Parameter::tensor() const {
  const State& s = require();
  detail::TraceContext* trace = s.owner ? s.owner->trace_.load() : nullptr;
  if (!trace) {
    // Tagged with its name, so traced code that uses it names it (it is no weight of that graph).
    Tensor eager(s.data);
    eager.parameter_name_ = std::shared_ptr<const std::string>(state_, &state_->name);
    return eager;
  }
  if (auto it = trace->weights.find(&s); it != trace->weights.end()) return Tensor(it->second);
  auto name = trace->parameter_names.find(&s);
  if (name == trace->parameter_names.end())
    throw ValueError(
        fmt::format("nn::Parameter '{}' was registered while staging graph '{}' (register "
                    "parameters in the constructor)",
                    s.name, trace->graph->name()));
  graph::Weight w{name->second, s.data.dtype(), graph::Shape::of(s.data.shape()), s.data.device()};
  graph::Value v = trace->graph->weight(w);
  trace->weights.emplace(&s, v);
  return Tensor(v);
}

// ---- ModuleV3: parameters and children ----------------------------------------------------------------

ModuleV3::~ModuleV3() {
  for (Parameter& p : parameters_) p.state_->owner = nullptr;
}

namespace {
std::string device_list(const std::vector<DeviceRef>& devices) {
  std::vector<std::string> names;
  for (const DeviceRef& d : devices) names.push_back(d.to_string());
  return fmt::format("{}", fmt::join(names, ", "));
}

void check_local_name(const char* what, const std::string& name) {
  if (name.empty() || name.find('.') != std::string::npos)
    throw ValueError(fmt::format("{}: bad name '{}' (non-empty, no '.')", what, name));
}
}  // namespace

Parameter ModuleV3::register_parameter(const std::string& name, kiln::Tensor initial) {
  check_local_name("register_parameter", name);
  // The trace's weights are the parameters the tree had when stage() began; refused before anything
  // is registered, so a failed stage leaves the module as it was.
  if (is_staging()) {
    const std::string prefix = path();
    throw ValueError(
        fmt::format("register_parameter: parameter '{}' is registered while its module is being "
                    "staged (register parameters in the constructor)",
                    prefix.empty() ? name : prefix + "." + name));
  }
  for (const Parameter& p : parameters_)
    if (p.name() == name) throw ValueError(fmt::format("register_parameter: '{}' is registered twice", name));
  for (const auto& [child_name, child] : children_)
    if (child_name == name)
      throw ValueError(fmt::format("register_parameter: '{}' is already a child module", name));
  if (!initial.defined())
    throw ValueError(
        fmt::format("register_parameter: parameter '{}' needs initial data (got an undefined tensor)", name));
  parameters_.emplace_back(
      std::make_shared<Parameter::State>(Parameter::State{name, std::move(initial), this}));
  return parameters_.back();
}

void ModuleV3::attach(const std::string& name, std::shared_ptr<ModuleV3> child) {
  check_local_name("register_module", name);
  if (!child) throw ValueError(fmt::format("register_module: child '{}' is null", name));
  if (child->parent_)
    throw ValueError(
        fmt::format("register_module: module '{}' already belongs to '{}'", name, child->path()));
  for (const auto& [n, c] : children_)
    if (n == name) throw ValueError(fmt::format("register_module: '{}' is registered twice", name));
  for (const Parameter& p : parameters_)
    if (p.name() == name) throw ValueError(fmt::format("register_module: '{}' is already a parameter", name));
  for (const ModuleV3* m = this; m; m = m->parent_)
    if (m == child.get()) throw ValueError(fmt::format("register_module: '{}' would make a cycle", name));
  child->parent_ = this;
  child->name_in_parent_ = name;
  children_.emplace_back(name, std::move(child));
}

std::string ModuleV3::path() const {
  if (!parent_) return "";
  std::string prefix = parent_->path();
  return prefix.empty() ? name_in_parent_ : prefix + "." + name_in_parent_;
}

void ModuleV3::collect_parameters(const std::string& prefix,
                                  std::vector<std::pair<std::string, Parameter>>& out) const {
  for (const Parameter& p : parameters_) out.emplace_back(prefix + p.name(), p);
  for (const auto& [name, child] : children_) child->collect_parameters(prefix + name + ".", out);
}

void ModuleV3::collect_modules(std::vector<ModuleV3*>& out) {
  out.push_back(this);
  for (const auto& [name, child] : children_) child->collect_modules(out);
}

std::vector<std::pair<std::string, Parameter>> ModuleV3::parameters() const {
  std::vector<std::pair<std::string, Parameter>> out;
  collect_parameters("", out);
  return out;
}

WeightsRegistry ModuleV3::state_dict() const {
  WeightsRegistry out;
  for (const auto& [name, p] : parameters()) out.emplace(name, p.data());
  return out;
}

void ModuleV3::load_state_dict(const WeightsRegistry& registry, bool strict) {
  auto params = parameters();
  std::vector<std::string> missing, unexpected;
  // Check everything first so a failed load leaves the module unchanged.
  std::vector<std::pair<const Parameter*, const kiln::Tensor*>> bindings;
  for (const auto& [name, p] : params) {
    auto it = registry.find(name);
    if (it == registry.end()) {
      missing.push_back(name);
      continue;
    }
    const kiln::Tensor& t = it->second;
    if (!t.defined() || t.dtype() != p.dtype() || t.shape() != p.shape())
      throw ValueError(fmt::format(
          "load_state_dict: weight '{}' is {}, expected {}{}", name,
          t.defined() ? fmt::format("{}{}", dtype_name(t.dtype()), graph::Shape::of(t.shape()).to_string())
                      : "undefined",
          dtype_name(p.dtype()), graph::Shape::of(p.shape()).to_string()));
    bindings.emplace_back(&p, &t);
  }
  if (strict) {
    for (const auto& [name, t] : registry)
      if (std::none_of(params.begin(), params.end(), [&](const auto& np) { return np.first == name; }))
        unexpected.push_back(name);
    if (!missing.empty() || !unexpected.empty())
      throw ValueError(fmt::format("load_state_dict: missing weights [{}]; unexpected weights [{}]",
                                   fmt::join(missing, ", "), fmt::join(unexpected, ", ")));
  }
  for (auto& [p, t] : bindings) p->set(*t);
}

void ModuleV3::set_devices(std::vector<DeviceRef> devices) {
  if (devices.empty()) throw ValueError("ModuleV3::set_devices: needs at least one device, got none");
  for (size_t i = 0; i < devices.size(); ++i)
    for (size_t j = 0; j < i; ++j)
      if (devices[i] == devices[j])
        throw ValueError(
            fmt::format("ModuleV3::set_devices: device {} is listed twice", devices[i].to_string()));
  devices_ = std::move(devices);
}

// ---- stage -------------------------------------------------------------------------------------------

graph::Graph ModuleV3::stage(const std::vector<TypeTree>& input_types, const StageOptions& options) {
  std::vector<graph::Type> types;
  for (const auto& tree : input_types)
    for (const auto& leaf : tree.flatten()) types.push_back(leaf);
  const size_t num_user_inputs = types.size();

  // Signal buffers only where a collective could need them: two or more devices.
  size_t signal_index = num_user_inputs;
  const size_t num_signals = devices_.size() >= 2 ? devices_.size() : 0;
  if (num_signals > 0) {
    if (options.signal_buffer_index) {
      int index = *options.signal_buffer_index;
      if (index < 0 || static_cast<size_t>(index) > num_user_inputs)
        throw ValueError(
            fmt::format("ModuleV3::stage '{}': signal_buffer_index {} is out of range for a graph with "
                        "{} inputs (expected 0..{})",
                        options.name, index, num_user_inputs, num_user_inputs));
      signal_index = static_cast<size_t>(index);
    }
    std::vector<graph::Type> signals;
    for (const DeviceRef& d : devices_)
      signals.push_back(graph::BufferType{DType::u8, {engine::SIGNAL_BYTES}, d});
    types.insert(types.begin() + static_cast<std::ptrdiff_t>(signal_index), signals.begin(), signals.end());
  }

  graph::Graph g(options.name, types);
  // For graph::ops source ops that forward may call directly.
  graph::Graph::Scope scope(g);
  detail::TraceContext context;
  context.graph = &g;
  for (const auto& [name, p] : parameters()) context.parameter_names.emplace(p.state(), name);

  // Split the inputs back into signal buffers and the forward arguments' trees.
  std::vector<graph::Value> inputs = g.inputs();
  auto signal_begin = inputs.begin() + static_cast<std::ptrdiff_t>(signal_index);
  context.signal_buffers.assign(signal_begin, signal_begin + static_cast<std::ptrdiff_t>(num_signals));
  inputs.erase(signal_begin, signal_begin + static_cast<std::ptrdiff_t>(num_signals));
  std::vector<TensorTree> args;
  size_t next = 0;
  for (const auto& tree : input_types) {
    std::vector<Tensor> leaves;
    for (size_t i = 0; i < tree.num_leaves(); ++i) leaves.emplace_back(inputs[next++]);
    args.push_back(tree.unflatten(leaves));
  }

  // Point every module of the tree at this trace while forward runs; another stage() of any of
  // them meanwhile is an error, not a mix of two graphs.
  struct Marks {
    std::vector<ModuleV3*> modules;
    size_t count = 0;
    ~Marks() {
      for (size_t i = 0; i < count; ++i) modules[i]->trace_.store(nullptr);
    }
  } marks;
  collect_modules(marks.modules);
  for (ModuleV3* m : marks.modules) {
    detail::TraceContext* other = nullptr;
    if (!m->trace_.compare_exchange_strong(other, &context)) {
      const std::string path = m->path();
      // `other` is another stage()'s, which may end at any moment: not read here.
      throw ValueError(
          fmt::format("ModuleV3::stage '{}': {} is already being staged (a module is staged by "
                      "one stage() at a time)",
                      options.name, path.empty() ? "the module" : fmt::format("module '{}'", path)));
    }
    ++marks.count;
  }
  std::optional<TensorTree> results;  // a tree has no empty state
  try {
    results.emplace(forward(args));
  } catch (const std::out_of_range& e) {
    // As GraphSpec::trace does for an nn::Module: input_types gives forward fewer trees than it reads.
    throw ValueError(
        fmt::format("ModuleV3::stage '{}': forward read past its arguments (input_types gives "
                    "it {} argument tree{}; does it take more?): {}",
                    options.name, args.size(), args.size() == 1 ? "" : "s", e.what()));
  }

  std::vector<graph::Value> outputs;
  for (const Tensor& r : results->flatten()) {
    if (!r.defined())
      throw ValueError(
          fmt::format("ModuleV3::stage '{}': forward returned an undefined tensor", options.name));
    // An eager result (a constant computed in forward) is a constant of the graph.
    outputs.push_back(r.is_traced() ? r.value() : detail::eager_operand_in(g.ir(), &g.module(), r));
  }
  g.output(outputs);
  return g;
}

std::vector<Tensor> ModuleV3::signal_buffers() const {
  std::vector<Tensor> out;
  if (detail::TraceContext* trace = trace_.load())
    for (const auto& v : trace->signal_buffers) out.emplace_back(v);
  return out;
}

// ---- compile ---------------------------------------------------------------------------------------

CompiledModuleV3 ModuleV3::compile(const std::vector<TypeTree>& input_types, const CompileOptions& options) {
  std::shared_ptr<EagerSession> session = options.session ? options.session : default_eager_session();
  for (const DeviceRef& d : devices_)
    if (std::find(session->devices().begin(), session->devices().end(), d) == session->devices().end())
      throw ValueError(
          fmt::format("ModuleV3::compile '{}': the module runs on [{}] but its session has only "
                      "[{}] (pass an nn::EagerSession on those devices in CompileOptions::session)",
                      options.name, device_list(devices_), device_list(session->devices())));
  // Loaded now so a bad path is an error here even if no op calls into it.
  const ext::ExtensionRegistry check_extensions(options.custom_extensions);
  graph::Graph g = stage(input_types, {options.name, options.signal_buffer_index});
  WeightsRegistry weights =
      cast_weights_to_parameters(*this, options.weights ? *options.weights : state_dict(), options.auto_cast,
                                 fmt::format("ModuleV3::compile '{}'", options.name), session->logger());
  std::shared_ptr<const engine::CompiledModel> compiled =
      session->cached_compile(g.module(), options.custom_extensions);
  // A device graph is made at init, not at compile, so the cached compile serves both kinds.
  std::vector<std::string> device_graphs;
  if (options.is_device_graph) device_graphs.push_back(g.name());
  engine::Model model = session->inference_session().init(*compiled, weights, device_graphs).at(g.name());

  // Where stage() put the signal buffers: after the first `index` of the forward arguments' leaves.
  size_t num_user_inputs = 0;
  for (const auto& tree : input_types) num_user_inputs += tree.num_leaves();
  std::vector<kiln::Tensor> signals;
  size_t index = num_user_inputs;
  if (devices_.size() >= 2) {
    signals = engine::make_signal_buffers(devices_);
    if (options.signal_buffer_index) index = static_cast<size_t>(*options.signal_buffer_index);
  }
  return CompiledModuleV3(std::move(session), std::move(model), std::move(signals), index);
}

CompiledModuleV3::CompiledModuleV3(std::shared_ptr<EagerSession> session, engine::Model model,
                                   std::vector<kiln::Tensor> signal_buffers, size_t signal_buffer_index)
    : session_(std::move(session)),
      model_(std::move(model)),
      signal_buffers_(std::move(signal_buffers)),
      signal_buffer_index_(signal_buffer_index) {}

std::vector<kiln::Tensor> CompiledModuleV3::operator()(const std::vector<kiln::Tensor>& inputs) const {
  if (signal_buffers_.empty()) return model_.execute(inputs);
  const size_t expected = model_.input_metadata().size() - signal_buffers_.size();
  if (inputs.size() != expected)
    throw ValueError(
        fmt::format("CompiledModuleV3 '{}': takes {} inputs (signal buffers are its own), got {}",
                    model_.name(), expected, inputs.size()));
  std::vector<kiln::Tensor> all(inputs);
  all.insert(all.begin() + static_cast<std::ptrdiff_t>(signal_buffer_index_), signal_buffers_.begin(),
             signal_buffers_.end());
  return model_.execute(all);
}

// ---- auto_cast -------------------------------------------------------------------------------------

namespace {

bool castable(DType d) { return d == DType::f32 || d == DType::bf16; }

kiln::Tensor cast_f32_bf16(const kiln::Tensor& t, DType to) {
  kiln::Tensor out = kiln::Tensor::empty(to, t.shape(), t.device());
  const int64_t n = t.numel();
  if (to == DType::bf16) {
    std::vector<float> values = t.to_vector<float>();
    auto* dst = out.data_as<bf16_t>();
    for (int64_t i = 0; i < n; ++i) dst[i] = bf16_t(values[static_cast<size_t>(i)]);
  } else {
    std::vector<float> values = t.to_vector<float>();  // widening bf16 -> f32 is exact
    std::copy(values.begin(), values.end(), out.data_as<float>());
  }
  return out;
}

}  // namespace

WeightsRegistry cast_weights_to_parameters(const ModuleV3& module, const WeightsRegistry& weights,
                                           bool auto_cast, const std::string& context, Logger& logger) {
  WeightsRegistry out = weights;
  std::vector<std::string> casts;
  for (const auto& [name, p] : module.parameters()) {
    auto it = out.find(name);
    if (it == out.end() || !it->second.defined()) continue;  // missing weights are init's to report
    const kiln::Tensor& given = it->second;
    const DType from = given.dtype(), to = p.dtype();
    if (from == to) continue;
    if (!auto_cast)
      throw ValueError(
          fmt::format("{}: weight '{}' has dtype {} but its parameter is declared {} (auto_cast is "
                      "off; with it, f32 and bf16 weights are cast to their parameter's dtype)",
                      context, name, dtype_name(from), dtype_name(to)));
    if (!castable(from) || !castable(to))
      throw ValueError(
          fmt::format("{}: weight '{}' has dtype {} but its parameter is declared {}; auto_cast "
                      "casts only between f32 and bf16",
                      context, name, dtype_name(from), dtype_name(to)));
    if (given.shape() != p.shape())
      throw ValueError(
          fmt::format("{}: weight '{}' ({}{}) cannot be auto_cast to its parameter's {}{}: the "
                      "shapes differ",
                      context, name, dtype_name(from), graph::Shape::of(given.shape()).to_string(),
                      dtype_name(to), graph::Shape::of(p.shape()).to_string()));
    casts.push_back(fmt::format("'{}' {} -> {}{}", name, dtype_name(from), dtype_name(to),
                                to == DType::bf16 ? " (loses precision)" : ""));
    it->second = cast_f32_bf16(given, to);
  }
  if (!casts.empty())
    logger.warning(fmt::format("{}: auto_cast cast {} weight{} to their parameters' dtypes: {}", context,
                               casts.size(), casts.size() == 1 ? "" : "s", fmt::join(casts, ", ")));
  return out;
}

}  // namespace kiln::nn
