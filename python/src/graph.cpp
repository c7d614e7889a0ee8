// kiln.dtype and kiln.graph: DType, DeviceRef, Dim, TensorType / BufferType, Weight, Graph (a context
// manager, as MAX's), its values with Python operators, and graph.ops.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <unordered_map>

#include "bindings.h"

namespace kiln::python {

namespace {

using namespace pybind11::literals;
using graph::BufferValue;
using graph::Dim;
using graph::TensorValue;

std::vector<Dim> dims_of(const graph::Shape& shape) { return shape.dims(); }

std::string type_name(py::handle obj) { return py::str(py::type::of(obj).attr("__name__")); }

// A Weight as a graph value: a module's weight by its qualified name (the module knows it; nn.cpp
// sets _kiln_owner), any other under its own name, in the graph being built.
TensorValue weight_value(py::handle weight) {
  if (py::hasattr(weight, "_kiln_owner")) {
    py::object owner = weight.attr("_kiln_owner")();
    if (owner.is_none())
      throw ValueError(fmt::format("Weight '{}': the module it belongs to is gone",
                                   weight.cast<const graph::Weight&>().name));
    return owner.attr("_weight_value")(weight.attr("_kiln_id")).cast<TensorValue>();
  }
  return graph::Graph::current().weight(weight.cast<const graph::Weight&>());
}

// x[...] with ints, slices (start, stop: ints, Dims or symbol names; step >= 1) and one Ellipsis,
// as slice indices and the axes an int index drops (as numpy's and MAX's do).
struct Indexing {
  std::vector<graph::ops::SliceIndex> indices;
  std::vector<int64_t> dropped;
};
Indexing parse_indexing(int64_t rank, py::handle key) {
  py::tuple keys =
      py::isinstance<py::tuple>(key) ? py::reinterpret_borrow<py::tuple>(key) : py::make_tuple(key);
  Indexing out;
  auto bound = [](py::handle b) -> graph::ops::SliceBound {
    if (py::isinstance<py::int_>(b)) return graph::ops::SliceBound(b.cast<int64_t>());
    return graph::ops::SliceBound(b.cast<Dim>());
  };
  for (size_t i = 0; i < keys.size(); ++i) {
    py::handle k = keys[i];
    if (k.is(py::ellipsis())) {
      const int64_t rest = rank - static_cast<int64_t>(keys.size() - 1);
      for (int64_t j = 0; j < rest; ++j) out.indices.emplace_back();
    } else if (py::isinstance<py::slice>(k)) {
      py::object start = k.attr("start"), stop = k.attr("stop"), step = k.attr("step");
      out.indices.emplace_back(start.is_none() ? graph::ops::SliceBound(0) : bound(start),
                               stop.is_none() ? std::nullopt : std::optional(bound(stop)),
                               step.is_none() ? 1 : step.cast<int64_t>());
    } else {
      const int64_t at = k.cast<int64_t>();
      out.dropped.push_back(static_cast<int64_t>(out.indices.size()));
      out.indices.emplace_back(at, at == -1 ? std::nullopt : std::optional<graph::ops::SliceBound>(at + 1));
    }
  }
  return out;
}
TensorValue drop_axes(const TensorValue& x, const std::vector<int64_t>& dropped) {
  if (dropped.empty()) return x;
  std::vector<Dim> kept;
  const graph::Shape shape = x.shape();
  for (int64_t d = 0; d < shape.rank(); ++d)
    if (std::find(dropped.begin(), dropped.end(), d) == dropped.end()) kept.push_back(shape[d]);
  return graph::ops::reshape(x, graph::Shape(kept));
}
TensorValue getitem(const TensorValue& x, py::handle key) {
  Indexing ix = parse_indexing(x.rank(), key);
  return drop_axes(graph::ops::slice(x, ix.indices), ix.dropped);
}

// Python parameters of a custom op -> attributes (bool and int: int64, float: double, str, DType).
graph::Attrs attrs_from_python(const py::object& parameters) {
  graph::Attrs out;
  if (parameters.is_none()) return out;
  for (auto [key, value] : py::cast<py::dict>(parameters)) {
    const std::string name = py::cast<std::string>(key);
    if (py::isinstance<py::bool_>(value) || py::isinstance<py::int_>(value))
      out[name] = value.cast<int64_t>();
    else if (py::isinstance<py::float_>(value))
      out[name] = value.cast<double>();
    else if (py::isinstance<py::str>(value))
      out[name] = value.cast<std::string>();
    else if (py::isinstance<DType>(value))
      out[name] = value.cast<DType>();
    else
      throw ValueError(
          fmt::format("custom: parameter '{}' is a {}; parameters are bool, int, float, str or DType", name,
                      type_name(value)));
  }
  return out;
}

py::list values_list(const std::vector<graph::Value>& values) {
  py::list out;
  for (const auto& v : values) out.append(value_to_python(v));
  return out;
}

}  // namespace

// Weak references, so a graph's Python object dies when its last value and name do; under the GIL.
// Never freed: its references must not be dropped after the interpreter is gone.
std::unordered_map<const graph::Module*, py::object>& graph_owners() {
  static auto* owners = new std::unordered_map<const graph::Module*, py::object>();
  return *owners;
}

void note_graph_owner(const graph::Module* unit, py::handle owner) {
  auto& owners = graph_owners();
  auto it = owners.find(unit);
  // A unit's first live owner stays (a Module outlives the Graphs traced into it); a dead one is
  // replaced, since its address may be a new unit's.
  if (it != owners.end() && !it->second().is_none()) return;
  owners[unit] = py::weakref(owner);
}

py::object value_owner(const graph::Value& value) {
  auto& owners = graph_owners();
  auto it = owners.find(value.module());
  if (it == owners.end()) return py::none();
  return it->second();
}

py::object graph_to_python(std::shared_ptr<GraphHandle> handle) {
  const graph::Module* unit = &handle->graph.module();
  if (!handle->keep_alive.is_none()) note_graph_owner(unit, handle->keep_alive);  // traced into a Module
  py::object obj = py::cast(std::move(handle));
  note_graph_owner(unit, obj);
  return obj;
}

py::object value_to_python(const graph::Value& value) {
  return value.is_buffer() ? py::cast(BufferValue(value)) : py::cast(TensorValue(value));
}

graph::Value value_from_python(py::handle obj) {
  if (py::isinstance<graph::Value>(obj)) return obj.cast<graph::Value>();
  if (py::isinstance<graph::Weight>(obj)) return weight_value(obj);
  throw py::type_error(
      fmt::format("expected a graph value (TensorValue, BufferValue or Weight), got a {}", type_name(obj)));
}

graph::Tree<graph::Value> values_from_python(py::handle obj) {
  return tree_from_python<graph::Value>(obj, [](py::handle leaf) { return value_from_python(leaf); });
}

py::object values_to_python(const graph::Tree<graph::Value>& tree) {
  return tree_to_python(tree, [](const graph::Value& v) { return value_to_python(v); });
}

graph::Tree<graph::InputType> type_tree_from_python(py::handle obj) {
  return tree_from_python<graph::InputType>(obj, [](py::handle leaf) -> graph::InputType {
    if (py::isinstance<graph::TensorType>(leaf)) return leaf.cast<graph::TensorType>();
    if (py::isinstance<graph::BufferType>(leaf)) return leaf.cast<graph::BufferType>();
    throw ValueError(fmt::format("input_types: expected a TensorType, BufferType, list or dict, got a {}",
                                 type_name(leaf)));
  });
}

py::object type_tree_to_python(const graph::Tree<graph::InputType>& tree) {
  return tree_to_python(tree, [](const graph::InputType& t) { return py::cast(t); });
}

void bind_dtype(py::module_& m) {
  py::enum_<DType>(m, "DType", "Element types, with MAX's names.")
      .value("float32", DType::f32)
      .value("float16", DType::f16)
      .value("bfloat16", DType::bf16)
      .value("float64", DType::f64)
      .value("int8", DType::i8)
      .value("int16", DType::i16)
      .value("int32", DType::i32)
      .value("int64", DType::i64)
      .value("uint8", DType::u8)
      .value("uint16", DType::u16)
      .value("uint32", DType::u32)
      .value("uint64", DType::u64)
      .value("bool", DType::boolean)
      .def_property_readonly("size_in_bytes", [](DType d) { return dtype_size(d); })
      .def("is_float", [](DType d) { return is_float(d); })
      .def("is_integral", [](DType d) { return is_integer(d); })
      .def_property_readonly("short_name", [](DType d) { return std::string(dtype_name(d)); })
      .def("to_numpy",
           [](DType d) {
             if (d == DType::bf16) throw ValueError("DType.bfloat16 has no numpy dtype");
             static constexpr const char* names[] = {"float32", "float16", "",      "float64", "int8",
                                                     "int16",   "int32",   "int64", "uint8",   "uint16",
                                                     "uint32",  "uint64",  "bool"};
             return py::module_::import("numpy").attr("dtype")(names[static_cast<int>(d)]);
           })
      .def_static(
          "from_numpy",
          [](py::handle dtype) {
            const std::string name = py::str(py::module_::import("numpy").attr("dtype")(dtype).attr("name"));
            for (DType d : kAllDTypes)
              if (d != DType::bf16 && py::str(py::cast(d).attr("name")).cast<std::string>() == name) return d;
            throw ValueError(fmt::format("DType.from_numpy: numpy dtype '{}' has no kiln DType", name));
          },
          "dtype"_a);
}

void bind_graph(py::module_& m) {
  py::enum_<DeviceKind>(m, "DeviceKind").value("CPU", DeviceKind::CPU).value("GPU", DeviceKind::GPU);
  py::class_<DeviceRef>(m, "DeviceRef", "Where a value lives: a device kind and an index.")
      .def(py::init([](const std::string& kind, int id) {
             if (kind == "cpu" || kind == "CPU") return DeviceRef::CPU(id);
             if (kind == "gpu" || kind == "GPU") return DeviceRef::GPU(id);
             throw ValueError(fmt::format("DeviceRef: unknown device type '{}' (cpu or gpu)", kind));
           }),
           "device_type"_a, "id"_a = 0)
      .def_static("CPU", &DeviceRef::CPU, "id"_a = 0)
      .def_static("GPU", &DeviceRef::GPU, "id"_a = 0)
      .def_static(
          "from_device", [](const DeviceRef& d) { return d; }, "device"_a)
      .def_property_readonly("device_type", [](const DeviceRef& d) { return d.kind; })
      .def_readonly("id", &DeviceRef::id)
      .def("is_cpu", [](const DeviceRef& d) { return d.kind == DeviceKind::CPU; })
      .def(py::self == py::self)
      .def("__hash__", [](const DeviceRef& d) { return std::hash<std::string>()(d.to_string()); })
      .def("__repr__", [](const DeviceRef& d) {
        return fmt::format("DeviceRef.{}({})", d.kind == DeviceKind::CPU ? "CPU" : "GPU", d.id);
      });

  py::class_<Dim>(m, "Dim", "A dimension: static (4), symbolic ('batch') or algebraic ('seq' + 1).")
      .def(py::init<int64_t>(), "value"_a)
      .def(py::init<std::string>(), "name"_a)
      .def(py::init([](const Dim& d) { return d; }), "dim"_a)
      .def_static("parse", &Dim::parse, "text"_a)
      .def_property_readonly("is_static", &Dim::is_static)
      .def_property_readonly("is_symbolic", &Dim::is_symbolic)
      .def_property_readonly("symbols", &Dim::symbols)
      .def("evaluate", &Dim::evaluate, "bindings"_a)
      .def("__int__", &Dim::static_value)
      .def("__index__", &Dim::static_value)
      .def_property_readonly("name", &Dim::symbol)
      .def(
          "__add__", [](const Dim& a, const Dim& b) { return a + b; }, py::is_operator())
      .def(
          "__radd__", [](const Dim& a, const Dim& b) { return b + a; }, py::is_operator())
      .def(
          "__sub__", [](const Dim& a, const Dim& b) { return a - b; }, py::is_operator())
      .def(
          "__rsub__", [](const Dim& a, const Dim& b) { return b - a; }, py::is_operator())
      .def(
          "__mul__", [](const Dim& a, const Dim& b) { return a * b; }, py::is_operator())
      .def(
          "__rmul__", [](const Dim& a, const Dim& b) { return b * a; }, py::is_operator())
      .def(
          "__floordiv__", [](const Dim& a, const Dim& b) { return a / b; }, py::is_operator())
      .def(
          "__rfloordiv__", [](const Dim& a, const Dim& b) { return b / a; }, py::is_operator())
      .def(
          "__eq__", [](const Dim& a, const Dim& b) { return a == b; }, py::is_operator())
      .def(
          "__ne__", [](const Dim& a, const Dim& b) { return !(a == b); }, py::is_operator())
      .def("__hash__", [](const Dim& d) { return std::hash<std::string>()(d.to_string()); })
      .def("__str__", &Dim::to_string)
      .def("__repr__", [](const Dim& d) { return fmt::format("Dim({})", d.to_string()); });
  py::implicitly_convertible<int64_t, Dim>();
  py::implicitly_convertible<std::string, Dim>();

  py::class_<graph::TensorType>(m, "TensorType", "An immutable tensor's type: dtype, shape, device.")
      .def(py::init([](DType dtype, const std::vector<Dim>& shape, DeviceRef device) {
             return graph::TensorType{dtype, graph::Shape(shape), device};
           }),
           "dtype"_a, "shape"_a, "device"_a = DeviceRef::CPU())
      .def_readwrite("dtype", &graph::TensorType::dtype)
      .def_property(
          "shape", [](const graph::TensorType& t) { return dims_of(t.shape); },
          [](graph::TensorType& t, const std::vector<Dim>& s) { t.shape = graph::Shape(s); })
      .def_readwrite("device", &graph::TensorType::device)
      .def_property_readonly("rank", &graph::TensorType::rank)
      .def(py::self == py::self)
      .def("__repr__", &graph::TensorType::to_string);
  py::class_<graph::BufferType>(m, "BufferType",
                                "A mutable buffer's type (in-place state such as a KV cache).")
      .def(py::init([](DType dtype, const std::vector<Dim>& shape, DeviceRef device) {
             return graph::BufferType{dtype, graph::Shape(shape), device};
           }),
           "dtype"_a, "shape"_a, "device"_a = DeviceRef::CPU())
      .def_readwrite("dtype", &graph::BufferType::dtype)
      .def_property(
          "shape", [](const graph::BufferType& t) { return dims_of(t.shape); },
          [](graph::BufferType& t, const std::vector<Dim>& s) { t.shape = graph::Shape(s); })
      .def_readwrite("device", &graph::BufferType::device)
      .def_property_readonly("rank", &graph::BufferType::rank)
      .def(py::self == py::self)
      .def("__repr__", &graph::BufferType::to_string);

  // dynamic_attr: a module that owns a weight marks it (_kiln_owner, _kiln_id; see nn.cpp).
  py::class_<graph::Weight>(m, "Weight", py::dynamic_attr(), "A named external constant, bound at init.")
      .def(py::init([](std::string name, DType dtype, const std::vector<Dim>& shape, DeviceRef device) {
             return graph::Weight{std::move(name), dtype, graph::Shape(shape), device};
           }),
           "name"_a, "dtype"_a, "shape"_a, "device"_a = DeviceRef::CPU())
      .def_readwrite("name", &graph::Weight::name)
      .def_readwrite("dtype", &graph::Weight::dtype)
      .def_property(
          "shape", [](const graph::Weight& w) { return dims_of(w.shape); },
          [](graph::Weight& w, const std::vector<Dim>& s) { w.shape = graph::Shape(s); })
      .def_readwrite("device", &graph::Weight::device)
      .def_property_readonly("type", &graph::Weight::type)
      .def("__repr__", [](const graph::Weight& w) {
        return fmt::format("Weight('{}', {})", w.name, w.type().to_string());
      });

  py::class_<graph::Value> value(m, "Value",
                                 "A value of the graph being built (valid while its graph lives).");
  value.def_property_readonly("type", &graph::Value::type)
      .def_property_readonly("dtype", &graph::Value::dtype)
      .def_property_readonly("shape", [](const graph::Value& v) { return dims_of(v.shape()); })
      .def_property_readonly("device", &graph::Value::device)
      .def_property_readonly("rank", &graph::Value::rank)
      .def("__repr__", [](const graph::Value& v) {
        return fmt::format("{}(%{}: {})", v.is_buffer() ? "BufferValue" : "TensorValue", v.id(),
                           graph::to_string(v.type()));
      });
  py::class_<TensorValue, graph::Value> tensor_value(m, "TensorValue");
  tensor_value.def(py::init([](py::handle obj) -> TensorValue { return value_from_python(obj); }), "value"_a);
  bind_arithmetic<TensorValue>(tensor_value);
  tensor_value
      .def(
          "__matmul__", [](const TensorValue& a, const TensorValue& b) { return graph::ops::matmul(a, b); },
          py::is_operator())
      .def(
          "__rmatmul__", [](const TensorValue& a, const TensorValue& b) { return graph::ops::matmul(b, a); },
          py::is_operator())
      .def(
          "__pow__", [](const TensorValue& a, const TensorValue& b) { return graph::ops::pow(a, b); },
          py::is_operator())
      .def(
          "__pow__",
          [](const TensorValue& a, double b) {
            return graph::ops::pow(a, graph::ops::constant(b, a.dtype(), a.device()));
          },
          py::is_operator())
      .def("__abs__", [](const TensorValue& a) { return graph::ops::abs(a); })
      .def(
          "__lt__", [](const TensorValue& a, const TensorValue& b) { return graph::ops::less(a, b); },
          py::is_operator())
      .def(
          "__le__", [](const TensorValue& a, const TensorValue& b) { return graph::ops::less_equal(a, b); },
          py::is_operator())
      .def(
          "__gt__", [](const TensorValue& a, const TensorValue& b) { return graph::ops::greater(a, b); },
          py::is_operator())
      .def(
          "__ge__",
          [](const TensorValue& a, const TensorValue& b) { return graph::ops::greater_equal(a, b); },
          py::is_operator())
      .def("__getitem__", &getitem)
      .def(
          "reshape",
          [](const TensorValue& x, const std::vector<Dim>& s) {
            return graph::ops::reshape(x, graph::Shape(s));
          },
          "shape"_a)
      .def(
          "transpose",
          [](const TensorValue& x, int64_t a, int64_t b) { return graph::ops::transpose(x, a, b); },
          "dim_1"_a, "dim_2"_a)
      .def(
          "permute",
          [](const TensorValue& x, const std::vector<int64_t>& p) { return graph::ops::permute(x, p); },
          "dims"_a)
      .def(
          "cast", [](const TensorValue& x, DType d) { return graph::ops::cast(x, d); }, "dtype"_a)
      .def(
          "to", [](const TensorValue& x, DeviceRef d) { return graph::ops::transfer_to(x, d); }, "device"_a)
      .def_property_readonly("T", [](const TensorValue& x) { return graph::ops::transpose(x, -1, -2); });
  py::implicitly_convertible<graph::Weight, TensorValue>();
  py::class_<BufferValue, graph::Value>(m, "BufferValue")
      .def("__getitem__",
           [](const BufferValue& b, py::handle key) {
             Indexing ix = parse_indexing(b.rank(), key);
             return drop_axes(graph::ops::buffer_load(b, ix.indices), ix.dropped);
           })
      .def("__setitem__", [](const BufferValue& b, py::handle key, const TensorValue& v) {
        graph::ops::buffer_store(b, v, parse_indexing(b.rank(), key).indices);
      });

  py::class_<graph::Module, ModuleHandle>(m, "Module", "A compile unit: graphs compiled together.")
      .def(py::init<>())
      .def_property_readonly("graph_names", &graph::Module::graph_names)
      .def("__len__", &graph::Module::size);

  py::class_<GraphHandle, std::shared_ptr<GraphHandle>>(
      m, "Graph", "A graph being built; `with graph:` makes ops go to it.")
      .def(py::init([](const std::string& name, const py::object& forward,
                       const std::vector<graph::Type>& input_types, const std::optional<ModuleHandle>& into) {
             auto handle =
                 std::make_shared<GraphHandle>(graph::Graph(name, input_types, into ? into->get() : nullptr),
                                               into ? py::cast(*into) : py::none());
             if (into) note_graph_owner(into->get(), handle->keep_alive);
             if (!forward.is_none()) {
               graph::Graph::Scope scope(handle->graph);
               py::list inputs = values_list(handle->graph.inputs());
               py::object results = forward(*inputs);
               std::vector<graph::Value> outputs;
               if (py::isinstance<py::list>(results) || py::isinstance<py::tuple>(results))
                 outputs = values_from_python(results).flatten();
               else if (!results.is_none())
                 outputs.push_back(value_from_python(results));
               handle->graph.output(outputs);
             }
             return handle;
           }),
           "name"_a, "forward"_a = py::none(), "input_types"_a = std::vector<graph::Type>{}, py::kw_only(),
           "into"_a = py::none())
      .def("__enter__",
           [](py::object self) {
             GraphHandle& g = self.cast<GraphHandle&>();
             note_graph_owner(&g.graph.module(), self);
             g.scopes.push_back(std::make_unique<graph::Graph::Scope>(g.graph));
             return self;
           })
      .def("__exit__",
           [](GraphHandle& g, py::args) {
             if (!g.scopes.empty()) g.scopes.pop_back();
           })
      .def_property_readonly("name", [](const GraphHandle& g) { return g.graph.name(); })
      .def_property_readonly("inputs",
                             [](py::object self) {
                               GraphHandle& g = self.cast<GraphHandle&>();
                               note_graph_owner(&g.graph.module(), self);
                               return values_list(g.graph.inputs());
                             })
      .def("output",
           [](GraphHandle& g, const py::args& results) {
             std::vector<graph::Value> outputs;
             for (py::handle r : results) outputs.push_back(value_from_python(r));
             g.graph.output(outputs);
           })
      .def(
          "add_weight", [](GraphHandle& g, const graph::Weight& w) { return g.graph.weight(w); }, "weight"_a)
      .def_property_readonly("has_output", [](const GraphHandle& g) { return g.graph.has_output(); })
      .def_property_readonly("input_types", [](const GraphHandle& g) { return g.graph.ir().input_types(); })
      .def_property_readonly("output_types", [](const GraphHandle& g) { return g.graph.ir().output_types(); })
      .def_property_readonly("weights", [](const GraphHandle& g) { return g.graph.ir().weights; })
      .def("__str__", [](const GraphHandle& g) { return g.graph.to_string(); })
      .def("__repr__", [](const GraphHandle& g) { return fmt::format("Graph('{}')", g.graph.name()); });

  py::module_ ops = m.def_submodule("ops", "Op builders: each adds a node to the graph of its operands.");
  {
    using T = TensorValue;
    namespace NS = graph::ops;
    KILN_PY_BIND_SHARED_OPS(ops);
  }
  ops.def(
      "constant",
      [](py::handle value, std::optional<DType> dtype, DeviceRef device) {
        if (py::isinstance<py::float_>(value) || py::isinstance<py::int_>(value) ||
            py::isinstance<py::bool_>(value))
          return graph::ops::constant(value.cast<double>(), dtype.value_or(DType::f32), device);
        // An array: its bytes, converted to dtype first when one is given (through numpy).
        py::object array = py::module_::import("numpy").attr("ascontiguousarray")(value);
        if (dtype) array = array.attr("astype")(py::cast(*dtype).attr("to_numpy")());
        Tensor t = tensor_from_python(array);
        graph::Bytes bytes(t.nbytes());
        if (!bytes.empty()) std::memcpy(bytes.data(), t.data(), bytes.size());
        return graph::ops::constant(bytes, t.dtype(), graph::Shape::of(t.shape()), device);
      },
      "value"_a, "dtype"_a = py::none(), "device"_a = DeviceRef::CPU());
  ops.def(
      "range",
      [](double start, double stop, double step, std::optional<Dim> out_dim, DType dtype, DeviceRef device) {
        if (step == 0) throw ValueError("range: step must not be 0");
        Dim size =
            out_dim ? *out_dim : Dim(static_cast<int64_t>(std::max(0.0, std::ceil((stop - start) / step))));
        return graph::ops::range(start, step, size, dtype, device);
      },
      "start"_a, "stop"_a, "step"_a = 1.0, "out_dim"_a = py::none(), "dtype"_a = DType::i64,
      "device"_a = DeviceRef::CPU());
  ops.def(
      "slice_tensor", [](const TensorValue& x, py::handle indices) { return getitem(x, indices); }, "x"_a,
      "indices"_a);
  ops.def(
      "buffer_load", [](const BufferValue& b) { return graph::ops::buffer_load(b); }, "buffer"_a);
  ops.def(
      "buffer_store", [](const BufferValue& b, const TensorValue& v) { graph::ops::buffer_store(b, v); },
      "destination"_a, "source"_a);
  ops.def(
      "custom",
      [](const std::string& name, const py::object& values, const std::vector<graph::Type>& out_types,
         const py::object& parameters, const py::object& /*device*/) {
        std::vector<graph::Value> inputs;
        for (py::handle v : values) inputs.push_back(value_from_python(v));
        return values_list(graph::ops::custom(name, inputs, out_types, attrs_from_python(parameters)));
      },
      "name"_a, "values"_a, "out_types"_a, "parameters"_a = py::none(), "device"_a = py::none());
  ops.def(
      "inplace_custom",
      [](const std::string& name, const py::object& values, const py::object& parameters,
         const py::object& /*device*/) {
        std::vector<graph::Value> inputs;
        for (py::handle v : values) inputs.push_back(value_from_python(v));
        graph::ops::inplace_custom(name, inputs, attrs_from_python(parameters));
      },
      "name"_a, "values"_a, "parameters"_a = py::none(), "device"_a = py::none());
  ops.def(
      "call",
      [](const std::string& callee, const py::args& args) {
        std::vector<graph::Value> inputs;
        for (py::handle v : args) inputs.push_back(value_from_python(v));
        return values_list(graph::ops::call(callee, inputs));
      },
      "callee"_a);
  ops.def(
      "attention",
      [](const TensorValue& q, const TensorValue& k, const TensorValue& v, const TensorValue& masked,
         double scale, double softcap) { return graph::ops::attention(q, k, v, masked, scale, softcap); },
      "q"_a, "k"_a, "v"_a, "masked"_a, "scale"_a, "softcap"_a = 0.0);
  ops.def(
      "rope",
      [](const TensorValue& x, const TensorValue& c, const TensorValue& s) {
        return graph::ops::rope(x, c, s);
      },
      "x"_a, "cos"_a, "sin"_a);
  ops.def(
      "allreduce_sum",
      [](const std::vector<TensorValue>& inputs, const std::vector<BufferValue>& signals, int64_t processes) {
        return graph::ops::allreduce_sum(inputs, signals, processes);
      },
      "inputs"_a, "signal_buffers"_a, "processes"_a = 1);
}

}  // namespace kiln::python
