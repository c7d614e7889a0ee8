// The compile driver: verify, inline calls, optimize, verify again, then turn each graph into a
// GraphPlan (value table, kernel launches, arena slots) that the engine runs without the IR.
#include <algorithm>
#include <map>
#include <set>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "compiler/passes/plan_passes.h"
#include "graph/hash.h"
#include "kiln/compiler/compiled_model.h"
#include "kiln/compiler/passes.h"
#include "kiln/errors.h"
#include "kiln/ext/extensions.h"
#include "kiln/graph/text.h"
#include "kiln/version.h"

namespace kiln::compiler {

namespace {

using graph::GraphIR;
using graph::Node;
using graph::Op;

// The device whose kernel runs a node: where its results live (or its operands, for ops without any).
DeviceKind step_device(const GraphIR& g, const Node& node) {
  std::vector<graph::Type> inputs, outputs;
  for (auto v : node.inputs) inputs.push_back(g.type(v));
  for (auto v : node.outputs) outputs.push_back(g.type(v));
  return graph::kernel_key(node.op, inputs, outputs).device;
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
  Step step;
  step.op = node.op;
  step.inputs.assign(node.inputs.begin(), node.inputs.end());
  step.outputs.assign(node.outputs.begin(), node.outputs.end());
  step.attrs = node.attrs;
  step.node = static_cast<int32_t>(node_index);
  return step;
}

// The IR of one graph as a plan: its value table and one step per kernel launch, in program order.
GraphPlan lower(const GraphIR& g, const ext::ExtensionRegistry* extensions) {
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
    if (node.op == Op::constant) {
      plan.values.at(static_cast<size_t>(node.outputs.at(0))).kind = ValueKind::constant;
      plan.constants.push_back(make_step(node, n));
    } else {
      plan.steps.push_back(make_step(node, n));
    }
  }

  plan.outputs.assign(g.outputs.begin(), g.outputs.end());
  for (int32_t v : plan.outputs) {
    PlanValue& value = plan.values.at(static_cast<size_t>(v));
    if (value.kind == ValueKind::slot) value.kind = ValueKind::output;
  }
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
  graph::Module ir = passes::inline_calls(module);
  if (options.optimize) {
    ir = passes::canonicalize(std::move(ir));
    if (options.kernels) ir = passes::constant_fold(std::move(ir), *options.kernels);
    ir = passes::cse(std::move(ir));
    ir = passes::dce(std::move(ir));
    if (options.kernels) {
      ir = passes::fuse_elementwise(std::move(ir), *options.kernels);
      ir = passes::group_matmuls(std::move(ir), *options.kernels);
    }
  }
  passes::verify(ir);
  std::map<std::string, GraphPlan> plans;
  for (const auto& g : ir.graphs()) {
    GraphPlan plan = lower(*g, options.extensions);
    passes::plan_aliases(plan);
    passes::select_kernels(plan, options.kernels);
    passes::plan_memory(plan);
    plans.emplace(g->name, std::move(plan));
  }
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
  hash.field(KILN_VERSION_STRING);
  hash.field(options.optimize ? "optimize" : "no-optimize");
  hash.field(options.kernels ? options.kernels->fingerprint() : "no-kernels");
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
