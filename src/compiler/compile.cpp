// The compile driver: verify, inline calls, optimize, verify again, then turn each graph into a
// GraphPlan (value table, kernel launches, arena slots) that the engine runs without the IR.
#include <algorithm>
#include <map>
#include <set>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "compiler/inline_calls.h"
#include "graph/hash.h"
#include "kernels/cpu/kernels.h"
#include "kiln/compiler/compiled_model.h"
#include "kiln/compiler/passes.h"
#include "kiln/errors.h"
#include "kiln/ext/extensions.h"
#include "kiln/graph/text.h"

namespace kiln::compiler {

namespace {

using graph::GraphIR;
using graph::Node;
using graph::Op;

std::string_view device_kind_name(DeviceKind kind) { return kind == DeviceKind::CPU ? "cpu" : "gpu"; }

// The device whose kernel runs a node: where its results live (or its operands, for ops without any).
DeviceKind step_device(const GraphIR& g, const Node& node) {
  if (!node.outputs.empty()) return graph::device_of(g.type(node.outputs.front())).kind;
  if (!node.inputs.empty()) return graph::device_of(g.type(node.inputs.front())).kind;
  return DeviceKind::CPU;
}

void check_kernel_exists(const GraphIR& g, size_t node_index, const Node& node) {
  std::vector<DType> input_dtypes, output_dtypes;
  for (auto v : node.inputs) input_dtypes.push_back(graph::dtype_of(g.type(v)));
  for (auto v : node.outputs) output_dtypes.push_back(graph::dtype_of(g.type(v)));
  DType dtype = kernels::kernel_dtype(node.op, input_dtypes, output_dtypes);
  DeviceKind device = step_device(g, node);
  if (!kernels::builtin_kernels().find(node.op, device, dtype))
    throw Error(fmt::format("compile: graph '{}' node {}: no {} kernel for {} on {}", g.name,
                            node_index, device_kind_name(device), graph::op_name(node.op),
                            dtype_name(dtype)));
}

// The value owning an alias's memory (the value itself when it is not an alias).
int32_t root_of(const GraphPlan& plan, int32_t v) {
  const PlanValue& value = plan.values[static_cast<size_t>(v)];
  return value.kind == ValueKind::alias ? value.root : v;
}

// Greedy arena assignment by liveness: an intermediate takes a free slot of its dtype (or a new one)
// when its step runs and gives it back after the step of its last use. Outputs of a step never share a
// slot with that step's operands, since a slot is freed only after the step that last reads it. A
// value's memory lives as long as any alias of it: its last use is the latest of theirs, and an alias
// returned as a graph output (copied after the last step) keeps its root's slot to the end.
void assign_slots(GraphPlan& plan) {
  const auto num_values = plan.values.size();
  const auto num_steps = static_cast<int32_t>(plan.steps.size());
  std::vector<int32_t> last_use(num_values, -1);
  auto use = [&](int32_t v, int32_t s) {
    for (int32_t u : {v, root_of(plan, v)}) last_use[static_cast<size_t>(u)] = std::max(last_use[static_cast<size_t>(u)], s);
  };
  for (int32_t s = 0; s < num_steps; ++s) {
    for (int32_t v : plan.steps[static_cast<size_t>(s)].inputs) use(v, s);
    for (int32_t v : plan.steps[static_cast<size_t>(s)].outputs) use(v, s);
  }
  for (int32_t v : plan.outputs) use(v, num_steps);  // past every step: never released
  std::vector<DType> slot_dtypes;
  std::multimap<DType, int32_t> free_slots;
  std::vector<int32_t> released;
  for (int32_t s = 0; s < num_steps; ++s) {
    const Step& step = plan.steps[static_cast<size_t>(s)];
    for (int32_t v : step.outputs) {
      PlanValue& value = plan.values[static_cast<size_t>(v)];
      if (value.kind != ValueKind::slot) continue;
      DType dtype = graph::dtype_of(value.type);
      if (auto it = free_slots.find(dtype); it != free_slots.end()) {
        value.slot = it->second;
        free_slots.erase(it);
      } else {
        value.slot = static_cast<int32_t>(slot_dtypes.size());
        slot_dtypes.push_back(dtype);
      }
    }
    // Release every slot value whose last use is this step, each once (operands may repeat, and
    // several aliases may share a root).
    released.clear();
    for (const auto* list : {&step.inputs, &step.outputs})
      for (int32_t operand : *list) {
        const int32_t v = root_of(plan, operand);
        const PlanValue& value = plan.values[static_cast<size_t>(v)];
        if (value.kind != ValueKind::slot || last_use[static_cast<size_t>(v)] != s) continue;
        if (std::find(released.begin(), released.end(), v) != released.end()) continue;
        released.push_back(v);
        free_slots.emplace(graph::dtype_of(value.type), value.slot);
      }
  }
  plan.num_slots = static_cast<int32_t>(slot_dtypes.size());
}

// Whether `step` (reshape, slice or buffer_load) can be an alias of its operand: same dtype and
// device, a tensor result, and for a window, one contiguous block of the (contiguous) source. Proven
// on the symbolic shapes, so it holds for every binding: after a run of leading axes the window
// takes one element of, at most one axis takes a step-1 range, and every later axis is taken whole.
bool is_view_step(const GraphPlan& plan, const Step& step) {
  if (step.op != Op::reshape && step.op != Op::slice && step.op != Op::buffer_load) return false;
  if (step.inputs.size() != 1 || step.outputs.size() != 1) return false;
  const graph::Type& source = plan.values.at(static_cast<size_t>(step.inputs[0])).type;
  const graph::Type& result = plan.values.at(static_cast<size_t>(step.outputs[0])).type;
  if (graph::is_buffer(result) || graph::dtype_of(source) != graph::dtype_of(result) ||
      graph::device_of(source) != graph::device_of(result))
    return false;
  if (step.op == Op::reshape || !step.attrs.count("starts")) return true;
  const auto* starts = std::get_if<graph::Shape>(&step.attrs.at("starts"));
  const auto* stops = step.attrs.count("stops") ? std::get_if<graph::Shape>(&step.attrs.at("stops")) : nullptr;
  const auto* steps = step.attrs.count("steps") ? std::get_if<std::vector<int64_t>>(&step.attrs.at("steps")) : nullptr;
  const graph::Shape& shape = graph::shape_of(source);
  if (!starts || !stops || !steps || starts->rank() != shape.rank() || stops->rank() != shape.rank() ||
      static_cast<int64_t>(steps->size()) != shape.rank())
    return false;
  int64_t axis = 0;
  auto extent = [&](int64_t a) { return (*stops)[a] - (*starts)[a]; };
  while (axis < shape.rank() && extent(axis) == graph::Dim(1)) ++axis;  // one element: any step
  if (axis < shape.rank() && (*steps)[static_cast<size_t>(axis)] == 1) ++axis;  // the one free range
  for (; axis < shape.rank(); ++axis)
    if (!((*starts)[axis] == graph::Dim(0) && (*stops)[axis] == shape[axis] &&
          (*steps)[static_cast<size_t>(axis)] == 1))
      return false;
  return true;
}

// Turns view steps into aliases (ValueKind::alias, GraphPlan::aliases), keeping as copies those whose
// memory could change under them: an alias of a buffer must not be live across a step that may write
// the buffer (any step taking it other than buffer_load: buffer_store, inplace_custom, collectives'
// signal buffers), counting a graph output as live to the end of the run. Checked for the first
// alias of a chain, whose lifetime covers every alias made from it; if it stays a copy, the aliases
// made from it view that copy, which nothing writes.
void plan_aliases(GraphPlan& plan) {
  const auto num_steps = static_cast<int32_t>(plan.steps.size());
  std::vector<bool> is_view(plan.steps.size());
  std::vector<int32_t> view_step(plan.values.size(), -1);  // alias candidate -> its step
  for (int32_t s = 0; s < num_steps; ++s)
    if (is_view_step(plan, plan.steps[static_cast<size_t>(s)])) {
      is_view[static_cast<size_t>(s)] = true;
      view_step[static_cast<size_t>(plan.steps[static_cast<size_t>(s)].outputs[0])] = s;
    }
  // Lifetime of each candidate, extended over the candidates made from it (later steps first).
  std::vector<int32_t> live_until(plan.values.size(), -1);
  for (int32_t s = 0; s < num_steps; ++s)
    for (int32_t v : plan.steps[static_cast<size_t>(s)].inputs) live_until[static_cast<size_t>(v)] = s;
  for (int32_t v : plan.outputs) live_until[static_cast<size_t>(v)] = num_steps;
  for (int32_t s = num_steps - 1; s >= 0; --s) {
    if (!is_view[static_cast<size_t>(s)]) continue;
    const Step& step = plan.steps[static_cast<size_t>(s)];
    const auto source = static_cast<size_t>(step.inputs[0]);
    if (view_step[source] >= 0)
      live_until[source] = std::max(live_until[source], live_until[static_cast<size_t>(step.outputs[0])]);
  }
  for (int32_t s = 0; s < num_steps; ++s) {
    if (!is_view[static_cast<size_t>(s)]) continue;
    const Step& step = plan.steps[static_cast<size_t>(s)];
    const int32_t source = step.inputs[0];
    if (view_step[static_cast<size_t>(source)] >= 0 || !graph::is_buffer(plan.values[static_cast<size_t>(source)].type))
      continue;
    const int32_t until = std::min(live_until[static_cast<size_t>(step.outputs[0])], num_steps - 1);
    for (int32_t w = s + 1; w <= until && is_view[static_cast<size_t>(s)]; ++w) {
      const Step& other = plan.steps[static_cast<size_t>(w)];
      if (other.op == Op::buffer_load) continue;
      if (std::find(other.inputs.begin(), other.inputs.end(), source) != other.inputs.end())
        is_view[static_cast<size_t>(s)] = false;
    }
    if (!is_view[static_cast<size_t>(s)]) view_step[static_cast<size_t>(step.outputs[0])] = -1;
  }
  std::vector<Step> steps;
  for (int32_t s = 0; s < num_steps; ++s) {
    Step& step = plan.steps[static_cast<size_t>(s)];
    if (!is_view[static_cast<size_t>(s)]) {
      steps.push_back(std::move(step));
      continue;
    }
    PlanValue& value = plan.values[static_cast<size_t>(step.outputs[0])];
    value.kind = ValueKind::alias;
    value.alias = static_cast<int32_t>(plan.aliases.size());
    value.root = root_of(plan, step.inputs[0]);
    plan.aliases.push_back(std::move(step));
  }
  plan.steps = std::move(steps);
}

// Resolves a custom op against the compile's extensions and checks the call; returns the index of
// its library in plan.extensions.
int32_t resolve_custom_op(const GraphIR& g, size_t node_index, const Node& node,
                          const ext::ExtensionRegistry* extensions, GraphPlan& plan) {
  const std::string& symbol = graph::get_attr<std::string>(node.attrs, "symbol", node.op);
  const std::string where = fmt::format("compile: graph '{}' node {}", g.name, node_index);
  const ext::CustomOp* op = extensions ? extensions->find(symbol) : nullptr;
  if (!op)
    throw ExtensionError(fmt::format("{}: custom op '{}' is not defined by any loaded extension (loaded: {})",
                                     where, symbol, extensions ? extensions->loaded_paths() : "none"));
  std::vector<graph::Type> input_types;
  for (auto v : node.inputs) input_types.push_back(g.type(v));
  op->check_call(node.op, input_types, node.attrs, where);
  DeviceKind device = step_device(g, node);
  if (!op->has_kernel(device))
    throw ExtensionError(fmt::format("{}: custom op '{}' of {} has no {} kernel", where, symbol,
                                     op->library_path().string(), device_kind_name(device)));
  compiler::ExtensionRef ref{op->library_path(), op->library().content_hash()};
  auto it = std::find(plan.extensions.begin(), plan.extensions.end(), ref);
  if (it != plan.extensions.end()) return static_cast<int32_t>(it - plan.extensions.begin());
  plan.extensions.push_back(std::move(ref));
  return static_cast<int32_t>(plan.extensions.size() - 1);
}

Step make_step(const Node& node, size_t node_index) {
  return Step{node.op, {node.inputs.begin(), node.inputs.end()},
              {node.outputs.begin(), node.outputs.end()}, node.attrs, static_cast<int32_t>(node_index)};
}

GraphPlan plan_graph(const GraphIR& g, const ext::ExtensionRegistry* extensions) {
  GraphPlan plan;
  plan.name = g.name;
  plan.input_types = g.input_types();
  plan.output_types = g.output_types();
  plan.weights = g.weights;
  plan.values.resize(g.value_types.size());
  for (size_t v = 0; v < g.value_types.size(); ++v) plan.values[v].type = g.value_types[v];
  for (size_t i = 0; i < g.inputs.size(); ++i) {
    PlanValue& value = plan.values.at(static_cast<size_t>(g.inputs[i]));
    value.kind = ValueKind::input;
    value.input = static_cast<int32_t>(i);
  }

  for (size_t n = 0; n < g.nodes.size(); ++n) {
    const Node& node = g.nodes[n];
    switch (node.op) {
      case Op::weight: {
        PlanValue& value = plan.values.at(static_cast<size_t>(node.outputs.at(0)));
        value.kind = ValueKind::weight;
        value.weight = graph::get_attr<std::string>(node.attrs, "name", Op::weight);
        continue;
      }
      case Op::custom:
      case Op::inplace_custom: {
        Step step = make_step(node, n);
        step.extension = resolve_custom_op(g, n, node, extensions, plan);
        plan.steps.push_back(std::move(step));
        continue;
      }
      case Op::call:
        throw Error(fmt::format("compile: graph '{}' node {}: call left after inlining", g.name, n));
      default: break;
    }
    check_kernel_exists(g, n, node);
    if (node.op == Op::constant) {
      plan.values.at(static_cast<size_t>(node.outputs.at(0))).kind = ValueKind::constant;
      plan.constants.push_back(make_step(node, n));
    } else {
      plan.steps.push_back(make_step(node, n));
    }
  }

  plan.outputs.assign(g.outputs.begin(), g.outputs.end());
  plan_aliases(plan);
  for (int32_t v : plan.outputs) {
    PlanValue& value = plan.values.at(static_cast<size_t>(v));
    if (value.kind == ValueKind::slot) value.kind = ValueKind::output;
  }
  assign_slots(plan);
  return plan;
}

}  // namespace

std::string to_string(const GraphPlan& plan) {
  auto count = [](size_t n, const char* one, const char* many) { return fmt::format("{} {}", n, n == 1 ? one : many); };
  std::string text = fmt::format("graph '{}': {}, {}, {}\n", plan.name, count(plan.steps.size(), "step", "steps"),
                                 count(plan.aliases.size(), "alias", "aliases"),
                                 count(static_cast<size_t>(plan.num_slots), "slot", "slots"));
  for (size_t v = 0; v < plan.values.size(); ++v) {
    const PlanValue& value = plan.values[v];
    std::string where;
    switch (value.kind) {
      case ValueKind::input: where = fmt::format("input {}", value.input); break;
      case ValueKind::weight: where = fmt::format("weight '{}'", value.weight); break;
      case ValueKind::constant: where = "constant"; break;
      case ValueKind::slot: where = fmt::format("slot {}", value.slot); break;
      case ValueKind::output: where = "output"; break;
      case ValueKind::alias: where = fmt::format("alias of %{}", value.root); break;
    }
    text += fmt::format("%{} {} {}\n", v, graph::to_string(value.type), where);
  }
  auto operands = [](const std::vector<int32_t>& values) {
    std::string s;
    for (int32_t v : values) s += fmt::format("{}%{}", s.empty() ? "" : ", ", v);
    return s;
  };
  for (const auto* steps : {&plan.steps, &plan.aliases})
    for (const Step& step : *steps)
      text += fmt::format("{} {} {} -> {}\n", steps == &plan.steps ? "step" : "alias", graph::op_name(step.op),
                          operands(step.inputs), operands(step.outputs));
  return text;
}

std::vector<std::string> CompiledModel::graph_names() const {
  return ir_ ? ir_->graph_names() : std::vector<std::string>{};
}

const GraphPlan& CompiledModel::plan(const std::string& graph) const {
  auto it = plans_.find(graph);
  if (it == plans_.end()) {
    std::string known;
    for (const auto& [name, p] : plans_) known += (known.empty() ? "'" : ", '") + name + "'";
    throw ValueError(fmt::format("CompiledModel: no graph '{}' (graphs: {})", graph,
                                 known.empty() ? "none" : known));
  }
  return it->second;
}

CompiledModel compile(const graph::Module& module, const CompileOptions& options) {
  passes::verify(module);
  graph::Module ir = inline_calls(module);
  if (options.optimize) {
    ir = passes::canonicalize(std::move(ir));
    ir = passes::constant_fold(std::move(ir));
    ir = passes::cse(std::move(ir));
    ir = passes::dce(std::move(ir));
    ir = passes::fuse_elementwise(std::move(ir));
    ir = passes::group_matmuls(std::move(ir));
  }
  passes::verify(ir);
  std::map<std::string, GraphPlan> plans;
  for (const auto& g : ir.graphs()) plans.emplace(g->name, plan_graph(*g, options.extensions));
  return CompiledModel(std::move(ir), std::move(plans));
}

std::vector<ExtensionRef> CompiledModel::extensions() const {
  std::vector<ExtensionRef> refs;
  for (const auto& [name, plan] : plans_)
    for (const ExtensionRef& ref : plan.extensions)
      if (std::find(refs.begin(), refs.end(), ref) == refs.end()) refs.push_back(ref);
  return refs;
}

std::string cache_key(const graph::Module& module, const CompileOptions& options) {
  Fnv1a64 hash;
  hash.field(graph::print(module));
  hash.field(KILN_VERSION);
  hash.field(options.optimize ? "optimize" : "no-optimize");
  // Only the libraries this module calls: loading an extension must not invalidate other graphs.
  std::set<std::string> symbols;
  for (const auto& g : module.graphs())
    for (const Node& node : g->nodes)
      if (node.op == Op::custom || node.op == Op::inplace_custom)
        symbols.insert(graph::get_attr<std::string>(node.attrs, "symbol", node.op));
  for (const std::string& symbol : symbols) {
    const ext::CustomOp* op = options.extensions ? options.extensions->find(symbol) : nullptr;
    hash.field(symbol);
    hash.field(op ? op->library().content_hash_hex() : "undefined");
  }
  return fmt::format("{:016x}", hash.value);
}

}  // namespace kiln::compiler
