// Canonicalization: local rewrites to one simpler form, written as a table of (op, rewrite). A rewrite
// either forwards the node's result to an existing value of exactly the same type (x * 1 -> x), or
// edits the node in place (transpose(transpose(x)) -> one transpose of x). Producers left unused are
// for dce to remove.
#include <cstring>
#include <type_traits>

#include "compiler/passes/rewrite.h"
#include "kiln/compiler/passes.h"

namespace kiln::compiler::passes {

namespace {

using graph::Node;
using graph::Op;
using graph::ValueId;

class Canonicalizer {
 public:
  Canonicalizer(graph::GraphIR& g) : g(g), rewrite(g) {}

  graph::GraphIR& g;
  GraphRewrite rewrite;
  bool edited = false;  // in-place edits, which GraphRewrite does not see

  // The node producing v, or null for a graph input.
  Node* producer(ValueId v) {
    int64_t i = rewrite.producer(v);
    return i < 0 ? nullptr : &g.nodes[static_cast<size_t>(i)];
  }

  // True if v is a `constant` whose every element equals `value`.
  bool is_constant_filled_with(ValueId v, double value) {
    const Node* n = producer(v);
    if (!n || n->op != Op::constant) return false;
    const auto& bytes = graph::get_attr<graph::Bytes>(n->attrs, "value", n->op);
    DType dtype = graph::get_attr<DType>(n->attrs, "dtype", n->op);
    return visit_dtype(dtype, [&]<class T>() {
      for (size_t offset = 0; offset + sizeof(T) <= bytes.size(); offset += sizeof(T)) {
        T element;
        std::memcpy(&element, bytes.data() + offset, sizeof(T));
        double x;
        if constexpr (std::is_same_v<T, f16_t> || std::is_same_v<T, bf16_t>)
          x = static_cast<float>(element);
        else
          x = static_cast<double>(element);
        if (x != value) return false;
      }
      return true;
    });
  }

  // Forwards node i's only result to `to` when the types are exactly equal (so broadcasting or a
  // dtype change never slips through), and drops the node.
  bool forward(size_t i, ValueId to) {
    const Node& n = g.nodes[i];
    if (n.outputs.size() != 1 || !(g.type(n.outputs[0]) == g.type(to))) return false;
    rewrite.replace(n.outputs[0], to);
    rewrite.erase(i);
    return true;
  }
};

using Rewrite = bool (*)(Canonicalizer&, size_t node);

// x op c -> x when c is a constant filled with `identity`.
template <int identity>
bool right_identity(Canonicalizer& c, size_t i) {
  const Node& n = c.g.nodes[i];
  return c.is_constant_filled_with(n.inputs[1], identity) && c.forward(i, n.inputs[0]);
}
// c op x -> x.
template <int identity>
bool left_identity(Canonicalizer& c, size_t i) {
  const Node& n = c.g.nodes[i];
  return c.is_constant_filled_with(n.inputs[0], identity) && c.forward(i, n.inputs[1]);
}

// reshape, cast, broadcast_to and transfer_to to their operand's own type are the identity.
bool same_type_identity(Canonicalizer& c, size_t i) { return c.forward(i, c.g.nodes[i].inputs[0]); }

// A transpose is the identity only by its permutation: transposing [2, 2] keeps the type, not the data.
bool identity_transpose(Canonicalizer& c, size_t i) {
  const auto& perm = graph::get_attr<std::vector<int64_t>>(c.g.nodes[i].attrs, "perm", Op::transpose);
  for (size_t k = 0; k < perm.size(); ++k)
    if (perm[k] != static_cast<int64_t>(k)) return false;
  return same_type_identity(c, i);
}

bool transpose_of_transpose(Canonicalizer& c, size_t i) {
  Node& outer = c.g.nodes[i];
  const Node* inner = c.producer(outer.inputs[0]);
  if (!inner || inner->op != Op::transpose) return false;
  const auto& inner_perm = graph::get_attr<std::vector<int64_t>>(inner->attrs, "perm", inner->op);
  const auto& outer_perm = graph::get_attr<std::vector<int64_t>>(outer.attrs, "perm", outer.op);
  // out[k] = mid[outer[k]] = in[inner[outer[k]]]
  std::vector<int64_t> composed(outer_perm.size());
  for (size_t k = 0; k < outer_perm.size(); ++k)
    composed[k] = inner_perm[static_cast<size_t>(outer_perm[k])];
  outer.inputs[0] = inner->inputs[0];
  outer.attrs["perm"] = composed;
  c.edited = true;
  identity_transpose(c, i);  // an identity permutation leaves just x
  return true;
}

bool reshape_of_reshape(Canonicalizer& c, size_t i) {
  Node& outer = c.g.nodes[i];
  const Node* inner = c.producer(outer.inputs[0]);
  if (!inner || inner->op != Op::reshape) return false;
  outer.inputs[0] = inner->inputs[0];  // the outer target shape alone decides the result
  c.edited = true;
  same_type_identity(c, i);
  return true;
}

// matmul(a, transpose(b)) with a transpose of the last two axes -> matmul(a, b) {transpose_b}: the
// kernel reads b through a strided view, so a Linear's [out, in] weight is never copied per call.
bool fold_rhs_transpose(Canonicalizer& c, size_t i) {
  Node& mm = c.g.nodes[i];
  const Node* t = c.producer(mm.inputs[1]);
  if (!t || t->op != Op::transpose) return false;
  const auto& perm = graph::get_attr<std::vector<int64_t>>(t->attrs, "perm", t->op);
  const size_t rank = perm.size();
  if (rank < 2) return false;
  for (size_t k = 0; k + 2 < rank; ++k)
    if (perm[k] != static_cast<int64_t>(k)) return false;
  if (perm[rank - 2] != static_cast<int64_t>(rank - 1) || perm[rank - 1] != static_cast<int64_t>(rank - 2))
    return false;
  auto it = mm.attrs.find("transpose_b");
  bool already = it != mm.attrs.end() && std::get<int64_t>(it->second) == 1;
  mm.inputs[1] = t->inputs[0];
  mm.attrs["transpose_b"] = int64_t{already ? 0 : 1};
  c.edited = true;
  return true;
}

struct Pattern {
  Op op;
  Rewrite rewrite;
};

// Tried in order for each node; the first that applies wins and the node is looked at again on the
// next sweep.
const Pattern kPatterns[] = {
    {Op::mul, right_identity<1>},   {Op::mul, left_identity<1>},
    {Op::add, right_identity<0>},   {Op::add, left_identity<0>},
    {Op::sub, right_identity<0>},   {Op::div, right_identity<1>},
    {Op::transpose, transpose_of_transpose}, {Op::transpose, identity_transpose},
    {Op::reshape, reshape_of_reshape},       {Op::reshape, same_type_identity},
    {Op::cast, same_type_identity},          {Op::broadcast_to, same_type_identity},
    {Op::transfer_to, same_type_identity},   {Op::matmul, fold_rhs_transpose},
};

// One sweep in program order; true if anything changed.
bool canonicalize_sweep(graph::GraphIR& g) {
  Canonicalizer c(g);
  for (size_t i = 0; i < g.nodes.size(); ++i) {
    c.rewrite.resolve_operands(i);
    for (const Pattern& p : kPatterns)
      if (p.op == g.nodes[i].op && p.rewrite(c, i)) break;
  }
  bool changed = c.rewrite.apply();
  return changed || c.edited;
}

void canonicalize_graph(graph::GraphIR& g, const graph::Module&) {
  // Each sweep rewrites whole chains already (operands are resolved in program order); the bound only
  // guards against a pattern that would undo another.
  for (int sweep = 0; sweep < 16 && canonicalize_sweep(g); ++sweep) {
  }
}

}  // namespace

graph::Module canonicalize(graph::Module module) {
  return for_each_graph(std::move(module), canonicalize_graph);
}

}  // namespace kiln::compiler::passes
