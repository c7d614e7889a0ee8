#include "kiln/pipelines/graph_spec.h"

#include <algorithm>
#include <cstring>
#include <set>
#include <stdexcept>

#include <fmt/format.h>

#include "kiln/ext/extensions.h"
#include "kiln/nn/module_v3.h"

namespace kiln::pipelines {

namespace {

const std::shared_ptr<nn::Module>& v2_module(const GraphSpec& spec, const char* what) {
  const auto* m = std::get_if<std::shared_ptr<nn::Module>>(&spec.module);
  if (!m)
    throw ValueError(
        fmt::format("GraphSpec '{}': {}: expected an nn::Module graph, got a ModuleV3", spec.name, what));
  if (!*m) throw ValueError(fmt::format("GraphSpec '{}': {}: module is null", spec.name, what));
  return *m;
}

bool is_v3(const GraphSpec& spec) { return spec.module.index() == 1; }

// auto_cast and signal_buffer_index mean something only for a ModuleV3 graph; set on an nn::Module
// spec they would be ignored, so they are refused instead.
void check_v2_options(const GraphSpec& spec) {
  if (spec.auto_cast)
    throw ValueError(fmt::format(
        "GraphSpec '{}': auto_cast is set, but it applies only to a ModuleV3 graph (an nn::Module's "
        "weights are bound with the dtypes they have; cast them before binding, or unset auto_cast)",
        spec.name));
  if (spec.signal_buffer_index)
    throw ValueError(fmt::format(
        "GraphSpec '{}': signal_buffer_index is set ({}), but only a ModuleV3 graph gets signal buffers "
        "inserted (an nn::Module graph declares its signal buffers in input_types; unset it)",
        spec.name, *spec.signal_buffer_index));
}

// ---- ModuleV3 specs: traced through stage(), compiled on their own ----------------------------------

const std::shared_ptr<nn::ModuleV3>& v3_module(const GraphSpec& spec, const char* what) {
  const auto& m = std::get<std::shared_ptr<nn::ModuleV3>>(spec.module);
  if (!m) throw ValueError(fmt::format("GraphSpec '{}': {}: module is null", spec.name, what));
  return m;
}

graph::Graph trace_v3(const GraphSpec& spec, graph::Module* into) {
  const auto& module = v3_module(spec, "trace");
  if (into)
    throw ValueError(fmt::format("GraphSpec '{}': trace(into): a ModuleV3 graph compiles on its own and "
                                 "cannot be traced into another compile unit (call trace() without one)",
                                 spec.name));
  const auto* arg_types = std::get_if<std::vector<nn::TypeTree>>(&spec.input_types);
  if (!arg_types)
    throw ValueError(fmt::format("GraphSpec '{}': a ModuleV3 graph takes input_types as a sequence, one "
                                 "type or tree per forward argument, not one named tree",
                                 spec.name));
  return module->stage(*arg_types, {spec.name, spec.signal_buffer_index});
}

// `weights`, or the module's own parameters, cast (auto_cast) or checked against the parameters' dtypes.
WeightsRegistry weights_registry_v3(const GraphSpec& spec, Logger& logger) {
  const auto& module = v3_module(spec, "weights_registry");
  return nn::cast_weights_to_parameters(*module, spec.weights ? *spec.weights : module->state_dict(),
                                        spec.auto_cast, fmt::format("GraphSpec '{}'", spec.name), logger);
}

// Two registry entries are the same array when they view the same memory, or hold equal bytes.
bool same_array(const Tensor& a, const Tensor& b) {
  if (a.dtype() != b.dtype() || a.shape() != b.shape()) return false;
  if (a.data() == b.data() && a.strides() == b.strides()) return true;
  Tensor pa = a.contiguous(), pb = b.contiguous();
  return std::memcmp(pa.data(), pb.data(), pa.nbytes()) == 0;
}

}  // namespace

graph::Graph GraphSpec::trace(graph::Module* into) const {
  if (is_v3(*this)) return trace_v3(*this, into);
  const auto& module_ptr = v2_module(*this, "trace");
  check_v2_options(*this);

  // One tree per forward argument; the graph's inputs are all their leaves, in order.
  std::vector<nn::TypeTree> arg_types;
  if (const auto* seq = std::get_if<std::vector<nn::TypeTree>>(&input_types))
    arg_types = *seq;
  else
    arg_types.push_back(std::get<nn::TypeTree>(input_types));
  std::vector<graph::Type> flat_types;
  for (const auto& t : arg_types)
    for (const auto& leaf : t.flatten()) flat_types.push_back(leaf);

  graph::Graph g(name, flat_types, into);
  graph::Graph::Scope scope(g);
  std::vector<graph::Value> inputs = g.inputs();
  std::vector<nn::Values> args;
  size_t next = 0;
  for (const auto& t : arg_types) {
    std::vector<graph::Value> leaves(inputs.begin() + next, inputs.begin() + next + t.num_leaves());
    next += t.num_leaves();
    args.push_back(t.unflatten(leaves));
  }
  std::optional<nn::Values> results;  // a tree has no empty state
  try {
    results.emplace(module_ptr->forward(args));
  } catch (const std::out_of_range& e) {
    // Forward reads its arguments with at(): reading past them means input_types gives it fewer
    // trees (or a smaller tree) than it takes. Said in the spec's terms, with the original message.
    throw ValueError(
        fmt::format("GraphSpec '{}': forward read past its arguments (input_types gives it {} "
                    "argument tree{}; does it take more?): {}",
                    name, args.size(), args.size() == 1 ? "" : "s", e.what()));
  }
  g.output(results->flatten());
  return g;
}

WeightsRegistry GraphSpec::weights_registry(Logger& logger) const {
  if (is_v3(*this)) return weights_registry_v3(*this, logger);
  check_v2_options(*this);
  if (weights) return *weights;
  return v2_module(*this, "weights_registry")->state_dict();
}

namespace {

// The graphs of a compile unit that init builds as device graphs (is_device_graph).
std::vector<std::string> device_graph_names(const std::vector<const GraphSpec*>& unit) {
  std::vector<std::string> names;
  for (const GraphSpec* spec : unit)
    if (spec->is_device_graph) names.push_back(spec->name);
  return names;
}

}  // namespace

std::map<std::string, engine::Model> compile_graph_specs(engine::InferenceSession& session,
                                                         const std::vector<GraphSpec>& specs) {
  // Names key the result, so they must be unique across all specs, not only within a group.
  std::map<std::string, const GraphSpec*> by_name;
  for (const auto& spec : specs) {
    auto [it, inserted] = by_name.emplace(spec.name, &spec);
    if (!inserted) {
      const GraphSpec& first = *it->second;
      throw ValueError(fmt::format(
          "compile_graph_specs: two specs are named '{}' (groups '{}' and '{}')", spec.name,
          first.group.value_or("<none>"), spec.group.value_or("<none>")));
    }
    if (is_v3(spec) && spec.group)
      throw ValueError(fmt::format("compile_graph_specs: spec '{}' is a ModuleV3 graph with group '{}'; "
                                   "ModuleV3 graphs compile on their own (group must be empty)",
                                   spec.name, *spec.group));
  }

  // Compile units in first-appearance order: one per group, one per ungrouped spec.
  std::vector<std::vector<const GraphSpec*>> units;
  std::map<std::string, size_t> unit_of_group;
  for (const auto& spec : specs) {
    if (!spec.group) {
      units.push_back({&spec});
      continue;
    }
    auto [it, inserted] = unit_of_group.emplace(*spec.group, units.size());
    if (inserted) units.emplace_back();
    units[it->second].push_back(&spec);
  }

  std::map<std::string, engine::Model> models;
  for (const auto& unit : units) {
    // The unit's custom extensions (union over its specs), loaded before tracing so a bad path fails
    // first and ops::custom checks calls as they are built; the compile resolves against them.
    std::vector<std::filesystem::path> extensions;
    for (const GraphSpec* spec : unit)
      for (const auto& path : spec->custom_extensions)
        if (std::find(extensions.begin(), extensions.end(), path) == extensions.end()) extensions.push_back(path);
    for (const auto& path : extensions) ext::load_library(path);
    if (unit.size() == 1 && is_v3(*unit.front())) {  // a ModuleV3 spec never has a group
      const GraphSpec& spec = *unit.front();
      graph::Graph g = spec.trace();
      auto compiled = session.compile(g.module(), extensions);
      auto initialised =
          session.init(compiled, spec.weights_registry(session.logger()), device_graph_names(unit));
      models.emplace(spec.name, initialised.at(spec.name));
      continue;
    }
    graph::Module module;
    WeightsRegistry registry;
    std::map<std::string, std::string> bound_by;  // weight name -> spec that bound it
    for (const GraphSpec* spec : unit) {
      spec->trace(&module);
      for (auto& [weight_name, array] : spec->weights_registry(session.logger())) {
        auto [it, inserted] = registry.emplace(weight_name, array);
        if (!inserted && !same_array(it->second, array))
          throw ValueError(fmt::format(
              "compile_graph_specs: weight '{}' is bound to different arrays by specs '{}' and '{}'",
              weight_name, bound_by[weight_name], spec->name));
        bound_by.emplace(weight_name, spec->name);
      }
    }
    auto unit_models = session.init(session.compile(module, extensions), registry, device_graph_names(unit));
    for (const GraphSpec* spec : unit) models.emplace(spec->name, unit_models.at(spec->name));
  }
  return models;
}

}  // namespace kiln::pipelines
