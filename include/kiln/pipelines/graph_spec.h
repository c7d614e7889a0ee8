// GraphSpec: a graph a pipeline compiles, as the module that traces it (MAX's
// max.pipelines.lib.graph_specs.GraphSpec). compile_graph_specs compiles a pipeline's specs: specs
// of one group into one model with a named submodel each, the others alone.
//
//   pipelines::GraphSpec spec{.module = model, .name = "model", .input_types = model->input_tree().value(),
//                             .group = "llm"};
//   auto models = pipelines::compile_graph_specs(session, {spec, sampler_spec});
//   models.at("model").execute(...);
#pragma once

#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "kiln/engine/session.h"
#include "kiln/logging.h"
#include "kiln/nn/module.h"

namespace kiln::nn {
class ModuleV3;  // the eager, PyTorch-like module system (nn/module_v3.h)
}

namespace kiln::pipelines {

// A sequence of trees (one per forward argument), or one named tree whose leaves, in order, are the
// graph's inputs (e.g. a module's input_tree()).
using InputTypes = std::variant<std::vector<nn::TypeTree>, nn::TypeTree>;

struct GraphSpec {
  std::variant<std::shared_ptr<nn::Module>, std::shared_ptr<nn::ModuleV3>> module;
  std::string name;
  InputTypes input_types;
  std::optional<WeightsRegistry> weights;  // nullopt: the module's state_dict(), read after tracing
  std::optional<std::string> group;        // same group: one compile, a named submodel each
  std::vector<std::filesystem::path> custom_extensions;
  bool is_device_graph = false;
  // auto_cast and signal_buffer_index are ModuleV3 only: set on an nn::Module spec, either makes
  // trace() and weights_registry() throw a ValueError naming it.
  bool auto_cast = false;
  std::optional<int> signal_buffer_index;  // where a ModuleV3 on several devices takes its signal buffers

  // Builds the graph: the module's forward is called inside it on its inputs (unflattened into
  // input_types' trees); its results, flattened, are the outputs. With `into`, the graph is added to
  // that compile unit (which must outlive the returned handle). ValueError for a ModuleV3 with `into`.
  graph::Graph trace(graph::Module* into = nullptr) const;
  // The arrays the graph binds, by weight name: `weights` if set, else the module's state_dict().
  // Names are fixed when weights are registered; call it after trace() (compile_graph_specs does) so
  // it also holds any weight forward registers on its first trace. A ModuleV3's auto_cast warning
  // goes to `logger` (compile_graph_specs passes its session's).
  WeightsRegistry weights_registry(Logger& logger = *default_logger()) const;
};

// Compiles the specs and returns one runnable model per spec name. Specs sharing a group are traced
// into one graph::Module and compiled once; their registries are merged (a name bound to two different
// arrays is a ValueError naming both specs and the weight). Duplicate names in a group, and a ModuleV3
// with a group, are ValueErrors naming the specs.
std::map<std::string, engine::Model> compile_graph_specs(engine::InferenceSession& session,
                                                         const std::vector<GraphSpec>& specs);

}  // namespace kiln::pipelines
