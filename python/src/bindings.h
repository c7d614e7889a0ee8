// The pieces of the `kiln._kiln` extension shared by its source files: how Python objects become
// kiln values (arrays through DLPack, graph values, trees) and the bind_* function of each submodule.
// The bindings use kiln's public headers only.
#pragma once

#include <kiln/kiln.h>
#include <pybind11/functional.h>
#include <pybind11/operators.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <pybind11/stl/filesystem.h>

namespace kiln::python {

namespace py = pybind11;

// ---- arrays (dlpack.cpp) -------------------------------------------------------------------------
// A kiln Tensor sharing the memory of `obj`: a kiln Tensor itself, a DLPack capsule, or anything
// with __dlpack__ (numpy, PyTorch). Zero-copy; the producer's array lives as long as the tensor.
Tensor tensor_from_python(py::handle obj);
WeightsRegistry registry_from_python(const py::object& weights);  // None -> empty
py::dict registry_to_python(const WeightsRegistry& registry);
py::list tensors_to_python(const std::vector<Tensor>& tensors);
std::vector<Tensor> tensors_from_python(const py::args& args);

// ---- models (engine.cpp) -----------------------------------------------------------------------------
py::dict models_to_python(std::map<std::string, engine::Model> models);  // name -> Model

// ---- graph values (graph.cpp) --------------------------------------------------------------------
// A TensorValue or BufferValue Python object for a graph value.
py::object value_to_python(const graph::Value& value);
// A graph value from a TensorValue / BufferValue, or a Weight (added to the current graph).
graph::Value value_from_python(py::handle obj);
// Trees as Python sees them: a leaf, a list (or tuple), or a dict (insertion order).
template <class T, class Leaf>
graph::Tree<T> tree_from_python(py::handle obj, const Leaf& leaf) {
  using Tree = graph::Tree<T>;
  if (py::isinstance<py::list>(obj) || py::isinstance<py::tuple>(obj)) {
    typename Tree::List items;
    for (py::handle item : obj) items.push_back(tree_from_python<T>(item, leaf));
    return Tree::list(std::move(items));
  }
  if (py::isinstance<py::dict>(obj)) {
    typename Tree::Map items;
    for (auto [k, v] : py::reinterpret_borrow<py::dict>(obj))
      items.emplace_back(py::cast<std::string>(k), tree_from_python<T>(v, leaf));
    return Tree::map(std::move(items));
  }
  return Tree(leaf(obj));
}
template <class T, class Leaf>
py::object tree_to_python(const graph::Tree<T>& tree, const Leaf& leaf) {
  if (tree.is_leaf()) return leaf(tree.leaf());
  if (tree.is_list()) {
    py::list out;
    for (const auto& item : tree.items()) out.append(tree_to_python(item, leaf));
    return out;
  }
  py::dict out;
  for (const auto& [k, v] : tree.entries()) out[py::str(k)] = tree_to_python(v, leaf);
  return out;
}
graph::Tree<graph::Value> values_from_python(py::handle obj);
py::object values_to_python(const graph::Tree<graph::Value>& tree);
graph::Tree<graph::InputType> type_tree_from_python(py::handle obj);
py::object type_tree_to_python(const graph::Tree<graph::InputType>& tree);

// ---- modules (nn.cpp) ------------------------------------------------------------------------------
// Calls a Python forward on a graph's argument trees (the GIL held).
nn::Values call_python_forward(const py::object& fn, const std::vector<nn::Values>& args);
// An nn::Module whose forward is a Python callable (a GraphSpec's module given as a function).
std::shared_ptr<nn::Module> module_from_callable(py::object fn);

// A Graph as Python holds it: the graph, what it must keep alive (the compile unit it was traced
// into), and the scopes `with graph:` entered.
struct GraphHandle {
  explicit GraphHandle(graph::Graph g, py::object keep_alive = py::none())
      : graph(std::move(g)), keep_alive(std::move(keep_alive)) {}
  graph::Graph graph;
  py::object keep_alive;
  std::vector<std::unique_ptr<graph::Graph::Scope>> scopes;
};

// A graph compile unit (graph::Module) shared with the graphs traced into it.
using ModuleHandle = std::shared_ptr<graph::Module>;

// Graph values point into their graph (as in C++), so each Python value keeps the Python object that
// owns its compile unit alive: a Graph, or the Module a graph was traced into. note_graph_owner records
// that object (weakly) for its unit; value_owner finds it (None when the unit has no Python owner, as
// inside GraphSpec.trace before its Graph is returned).
void note_graph_owner(const graph::Module* unit, py::handle owner);
py::object value_owner(const graph::Value& value);
// A Graph's Python object, noted as its unit's owner.
py::object graph_to_python(std::shared_ptr<GraphHandle> handle);

}  // namespace kiln::python

namespace pybind11::detail {

// Casting a graph value to Python ties the new object to its graph's owner (above).
template <class V>
struct graph_value_caster : type_caster_base<V> {
  static handle cast(const V& src, return_value_policy policy, handle parent) {
    return tie(type_caster_base<V>::cast(src, policy, parent), src);
  }
  static handle cast(V&& src, return_value_policy policy, handle parent) {
    const V copy = src;
    return tie(type_caster_base<V>::cast(std::move(src), policy, parent), copy);
  }
  static handle tie(handle result, const V& value) {
    if (result) {
      object owner = kiln::python::value_owner(value);
      if (!owner.is_none()) keep_alive_impl(result, owner);
    }
    return result;
  }
};
template <>
struct type_caster<kiln::graph::Value> : graph_value_caster<kiln::graph::Value> {};
template <>
struct type_caster<kiln::graph::TensorValue> : graph_value_caster<kiln::graph::TensorValue> {};
template <>
struct type_caster<kiln::graph::BufferValue> : graph_value_caster<kiln::graph::BufferValue> {};

}  // namespace pybind11::detail

namespace kiln::python {

void bind_errors(py::module_& m);
void bind_dtype(py::module_& m);
void bind_driver(py::module_& m);
void bind_graph(py::module_& m);
void bind_engine(py::module_& m);
void bind_nn(py::module_& m);
void bind_pipelines(py::module_& m);

// The op lists graph::ops and nn::functional share (same names, same signatures), bound once each
// for graph values and for ModuleV3 tensors.
#define KILN_PY_UNARY_OPS(X)                                                                              \
  X(neg)                                                                                                  \
  X(abs)                                                                                                  \
  X(exp) X(log) X(sqrt) X(rsqrt) X(sin) X(cos) X(tanh) X(sigmoid) X(silu) X(relu) X(erf) X(floor) X(ceil) \
      X(round) X(reciprocal) X(square) X(logical_not) X(is_nan)
#define KILN_PY_BINARY_OPS(X)                                                                         \
  X(add)                                                                                              \
  X(sub)                                                                                              \
  X(mul) X(div) X(mod) X(pow) X(maximum) X(minimum) X(equal) X(not_equal) X(greater) X(greater_equal) \
      X(less) X(less_equal) X(logical_and) X(logical_or) X(logical_xor) X(matmul)
#define KILN_PY_AXIS_OPS(X) X(sum) X(mean) X(max) X(min) X(argmax) X(argmin) X(softmax) X(log_softmax)

// Binds the shared ops into py::module_ `m`, for the value type `T` from the namespace `NS` (both
// aliases the caller declares: `using T = graph::TensorValue; namespace NS = graph::ops;`).
#define KILN_PY_DEF_UNARY_(name) \
  kiln_py_ops_.def(              \
      #name, [](const T& x) { return NS::name(x); }, "x"_a);
#define KILN_PY_DEF_BINARY_(name) \
  kiln_py_ops_.def(               \
      #name, [](const T& a, const T& b) { return NS::name(a, b); }, "lhs"_a, "rhs"_a);
#define KILN_PY_DEF_AXIS_(name) \
  kiln_py_ops_.def(             \
      #name, [](const T& x, int64_t axis) { return NS::name(x, axis); }, "x"_a, "axis"_a = -1);
#define KILN_PY_BIND_SHARED_OPS(m)                                                                           \
  do {                                                                                                       \
    py::module_& kiln_py_ops_ = (m);                                                                         \
    KILN_PY_UNARY_OPS(KILN_PY_DEF_UNARY_)                                                                    \
    KILN_PY_BINARY_OPS(KILN_PY_DEF_BINARY_)                                                                  \
    KILN_PY_AXIS_OPS(KILN_PY_DEF_AXIS_)                                                                      \
    kiln_py_ops_.def(                                                                                        \
        "gelu",                                                                                              \
        [](const T& x, const std::string& approximate) {                                                     \
          if (approximate != "none" && approximate != "tanh")                                                \
            throw ValueError("gelu: approximate must be 'none' or 'tanh', got '" + approximate + "'");       \
          return NS::gelu(x, approximate == "tanh");                                                         \
        },                                                                                                   \
        "x"_a, "approximate"_a = "none");                                                                    \
    kiln_py_ops_.def(                                                                                        \
        "where", [](const T& c, const T& x, const T& y) { return NS::where(c, x, y); }, "condition"_a,       \
        "x"_a, "y"_a);                                                                                       \
    kiln_py_ops_.def(                                                                                        \
        "cast", [](const T& x, DType d) { return NS::cast(x, d); }, "x"_a, "dtype"_a);                       \
    kiln_py_ops_.def(                                                                                        \
        "cumsum", [](const T& x, int64_t a, bool e, bool r) { return NS::cumsum(x, a, e, r); }, "x"_a,       \
        "axis"_a = -1, "exclusive"_a = false, "reverse"_a = false);                                          \
    kiln_py_ops_.def(                                                                                        \
        "top_k", [](const T& x, int64_t k, int64_t a) { return NS::top_k(x, k, a); }, "input"_a, "k"_a,      \
        "axis"_a = -1);                                                                                      \
    kiln_py_ops_.def(                                                                                        \
        "rms_norm", [](const T& x, const T& w, double e) { return NS::rms_norm(x, w, e); }, "input"_a,       \
        "weight"_a, "epsilon"_a = 1e-6);                                                                     \
    kiln_py_ops_.def(                                                                                        \
        "layer_norm",                                                                                        \
        [](const T& x, const T& g, const T& b, double e) { return NS::layer_norm(x, g, b, e); }, "input"_a,  \
        "gamma"_a, "beta"_a, "epsilon"_a = 1e-5);                                                            \
    kiln_py_ops_.def(                                                                                        \
        "reshape",                                                                                           \
        [](const T& x, const std::vector<graph::Dim>& s) { return NS::reshape(x, graph::Shape(s)); }, "x"_a, \
        "shape"_a);                                                                                          \
    kiln_py_ops_.def(                                                                                        \
        "transpose", [](const T& x, int64_t a, int64_t b) { return NS::transpose(x, a, b); }, "x"_a,         \
        "axis_1"_a, "axis_2"_a);                                                                             \
    kiln_py_ops_.def(                                                                                        \
        "permute", [](const T& x, const std::vector<int64_t>& p) { return NS::permute(x, p); }, "x"_a,       \
        "dims"_a);                                                                                           \
    kiln_py_ops_.def(                                                                                        \
        "broadcast_to",                                                                                      \
        [](const T& x, const std::vector<graph::Dim>& s) { return NS::broadcast_to(x, graph::Shape(s)); },   \
        "x"_a, "shape"_a);                                                                                   \
    kiln_py_ops_.def(                                                                                        \
        "concat", [](const std::vector<T>& xs, int64_t a) { return NS::concat(xs, a); }, "original_vals"_a,  \
        "axis"_a = 0);                                                                                       \
    kiln_py_ops_.def(                                                                                        \
        "split", [](const T& x, const std::vector<graph::Dim>& s, int64_t a) { return NS::split(x, s, a); }, \
        "x"_a, "split_sizes"_a, "axis"_a = 0);                                                               \
    kiln_py_ops_.def(                                                                                        \
        "gather", [](const T& x, const T& i, int64_t a) { return NS::gather(x, i, a); }, "input"_a,          \
        "indices"_a, "axis"_a = 0);                                                                          \
    kiln_py_ops_.def(                                                                                        \
        "scatter", [](const T& x, const T& u, const T& i, int64_t a) { return NS::scatter(x, u, i, a); },    \
        "input"_a, "updates"_a, "indices"_a, "axis"_a = 0);                                                  \
    kiln_py_ops_.def(                                                                                        \
        "transfer_to", [](const T& x, DeviceRef d) { return NS::transfer_to(x, d); }, "x"_a, "device"_a);    \
  } while (0)

// Python's arithmetic operators on a value class `cls` of type `T` (TensorValue, nn::Tensor): the
// types' own C++ operators, with Python scalars on either side.
template <class T, class Class>
void bind_arithmetic(Class& cls) {
  cls.def(
         "__add__", [](const T& a, const T& b) { return a + b; }, py::is_operator())
      .def(
          "__add__", [](const T& a, double b) { return a + b; }, py::is_operator())
      .def(
          "__radd__", [](const T& a, double b) { return b + a; }, py::is_operator())
      .def(
          "__sub__", [](const T& a, const T& b) { return a - b; }, py::is_operator())
      .def(
          "__sub__", [](const T& a, double b) { return a - b; }, py::is_operator())
      .def(
          "__rsub__", [](const T& a, double b) { return b - a; }, py::is_operator())
      .def(
          "__mul__", [](const T& a, const T& b) { return a * b; }, py::is_operator())
      .def(
          "__mul__", [](const T& a, double b) { return a * b; }, py::is_operator())
      .def(
          "__rmul__", [](const T& a, double b) { return b * a; }, py::is_operator())
      .def(
          "__truediv__", [](const T& a, const T& b) { return a / b; }, py::is_operator())
      .def(
          "__truediv__", [](const T& a, double b) { return a / b; }, py::is_operator())
      .def(
          "__rtruediv__", [](const T& a, double b) { return b / a; }, py::is_operator())
      .def(
          "__neg__", [](const T& a) { return -a; }, py::is_operator());
}

}  // namespace kiln::python
