// Private: the state of one ModuleV3::stage() on this thread. Parameters look themselves up here to
// become graph weights; functional source ops and signal_buffers() read it too.
#pragma once

#include <string>
#include <unordered_map>
#include <vector>

#include "kiln/tensor/tensor.h"
#include "kiln/graph/graph.h"

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

// The innermost active trace on this thread, or null.
TraceContext* current_trace();

// Makes `context` the current trace for its lifetime (nests).
class TraceScope {
 public:
  explicit TraceScope(TraceContext& context);
  ~TraceScope();
  TraceScope(const TraceScope&) = delete;
  TraceScope& operator=(const TraceScope&) = delete;

 private:
  TraceContext* previous_;
};

}  // namespace kiln::nn::detail
