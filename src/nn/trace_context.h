// Private: the state of one ModuleV3::stage(). The staged modules point at it (ModuleV3::trace_), so
// their parameters become graph weights and signal_buffers() finds the graph's buffers; nothing
// about it is per thread.
#pragma once

#include <string>
#include <unordered_map>
#include <vector>

#include "kiln/tensor/tensor.h"
#include "kiln/graph/graph.h"
#include "kiln/nn/tensor.h"

namespace kiln::nn::detail {

struct TraceContext {
  graph::Graph* graph = nullptr;
  // Parameter::State* of the staged module's parameters -> qualified name; weights made on first use.
  std::unordered_map<const void*, std::string> parameter_names;
  std::unordered_map<const void*, graph::Value> weights;
  std::vector<graph::Value> signal_buffers;
};

// Eager data as a constant node of `graph` (where traced code uses an eager tensor).
graph::Value constant_in(graph::GraphIR& graph, graph::Module* module, const kiln::Tensor& data);

// An eager tensor used by traced code, as a constant of `graph`; ValueError naming the parameter if
// it is a parameter's data (a parameter of a module that is not being staged into this graph).
graph::Value eager_operand_in(graph::GraphIR& graph, graph::Module* module, const Tensor& eager);

}  // namespace kiln::nn::detail
