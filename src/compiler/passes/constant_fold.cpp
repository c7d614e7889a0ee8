// Constant folding: a pure node whose operands are all `constant`s, with static shapes and small
// results, is evaluated now with the catalog's kernels and becomes constants. Nodes without operands
// (range) are left alone: they are already cheap sources and their constants would only bloat the IR.
#include <map>
#include <optional>
#include <span>

#include "compiler/passes/rewrite.h"
#include "kiln/compiler/passes.h"

namespace kiln::compiler::passes {

namespace {

using graph::Node;
using graph::Op;
using graph::ValueId;

// Larger results stay computed at run time, keeping the IR (and its text, the compile cache key) small.
constexpr size_t kMaxFoldedBytes = 64 * 1024;

bool never_folded(Op op) {
  switch (op) {
    case Op::constant:
    case Op::weight:
    case Op::range:
    case Op::buffer_load:
    case Op::buffer_store:
    case Op::paged_kv_store:
    case Op::paged_attention:
    case Op::transfer_to:
    case Op::call:
    case Op::custom:
    case Op::inplace_custom: return true;
    default: return graph::has_side_effects(op);
  }
}

// A static tensor type, or null.
const graph::TensorType* foldable_type(const graph::Type& t) {
  const auto* tensor = std::get_if<graph::TensorType>(&t);
  if (!tensor || !tensor->shape.is_static()) return nullptr;
  return tensor;
}

graph::Node constant_node(graph::Bytes bytes, const graph::TensorType& type, ValueId output) {
  graph::Attrs attrs{{"value", std::move(bytes)},
                     {"dtype", type.dtype},
                     {"shape", type.shape},
                     {"device", type.device}};
  return Node{Op::constant, {}, {output}, std::move(attrs)};
}

// The folded results of node i, or nothing when it cannot be folded.
// `extra` holds the values of constants inserted by this pass that are not (yet) in g.nodes.
std::optional<std::vector<graph::Bytes>> evaluate(const graph::GraphIR& g, const GraphRewrite& rewrite,
                                                  const KernelCatalog& kernels,
                                                  const std::map<ValueId, graph::Bytes>& extra,
                                                  const Node& n) {
  if (never_folded(n.op) || n.inputs.empty() || n.outputs.empty()) return std::nullopt;
  // Operands: copies of the constants' bytes, so the kernel gets mutable storage of its own.
  std::vector<graph::Bytes> input_storage;
  for (ValueId v : n.inputs) {
    const graph::TensorType* type = foldable_type(g.type(v));
    if (!type) return std::nullopt;
    if (auto it = extra.find(v); it != extra.end()) {
      input_storage.push_back(it->second);
    } else {
      int64_t p = rewrite.producer(v);
      if (p < 0) return std::nullopt;
      const Node& producer = g.nodes[static_cast<size_t>(p)];
      if (producer.op != Op::constant) return std::nullopt;
      input_storage.push_back(graph::get_attr<graph::Bytes>(producer.attrs, "value", Op::constant));
    }
  }
  std::vector<graph::Bytes> output_storage;
  size_t total_bytes = 0;
  for (ValueId v : n.outputs) {
    const graph::TensorType* type = foldable_type(g.type(v));
    if (!type) return std::nullopt;
    size_t bytes = static_cast<size_t>(*type->shape.static_num_elements()) * dtype_size(type->dtype);
    total_bytes += bytes;
    if (total_bytes > kMaxFoldedBytes) return std::nullopt;
    output_storage.emplace_back(bytes);
  }

  std::vector<graph::Type> input_types, output_types;
  for (ValueId v : n.inputs) input_types.push_back(g.type(v));
  for (ValueId v : n.outputs) output_types.push_back(g.type(v));
  const graph::KernelKey key = graph::kernel_key(n.op, input_types, output_types);
  auto array = [&](graph::Bytes& storage, ValueId v) {
    const auto& type = std::get<graph::TensorType>(g.type(v));
    return HostArray{storage.data(), type.dtype, type.shape.static_dims()};
  };
  std::vector<HostArray> inputs, outputs;
  for (size_t k = 0; k < n.inputs.size(); ++k) inputs.push_back(array(input_storage[k], n.inputs[k]));
  for (size_t k = 0; k < n.outputs.size(); ++k) outputs.push_back(array(output_storage[k], n.outputs[k]));
  if (!kernels.evaluate(key, n.attrs, inputs, outputs)) return std::nullopt;
  return output_storage;
}

void constant_fold_graph(graph::GraphIR& g, const KernelCatalog& kernels) {
  GraphRewrite rewrite(g);
  std::map<ValueId, graph::Bytes> inserted_values;
  // In program order, so a node folded here is a constant operand for the nodes after it.
  for (size_t i = 0; i < g.nodes.size(); ++i) {
    rewrite.resolve_operands(i);
    Node& n = g.nodes[i];
    auto results = evaluate(g, rewrite, kernels, inserted_values, n);
    if (!results) continue;
    if (n.outputs.size() == 1) {
      n = constant_node(std::move((*results)[0]), std::get<graph::TensorType>(g.type(n.outputs[0])),
                        n.outputs[0]);
      continue;
    }
    std::vector<Node> constants;
    for (size_t k = 0; k < n.outputs.size(); ++k)
      constants.push_back(constant_node(std::move((*results)[k]),
                                        std::get<graph::TensorType>(g.type(n.outputs[k])), n.outputs[k]));
    // The node's slot keeps the first constant; the others go before it.
    for (size_t k = 1; k < constants.size(); ++k)
      inserted_values[n.outputs[k]] = graph::get_attr<graph::Bytes>(constants[k].attrs, "value", Op::constant);
    rewrite.insert_before(i, std::vector<Node>(constants.begin() + 1, constants.end()));
    n = std::move(constants[0]);
  }
  rewrite.apply();
}

}  // namespace

graph::Module constant_fold(graph::Module module, const KernelCatalog& kernels) {
  return for_each_graph(std::move(module), [&](graph::GraphIR& g, const graph::Module&) { constant_fold_graph(g, kernels); });
}

}  // namespace kiln::compiler::passes
