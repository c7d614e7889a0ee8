// kiln.nn: Module (MAX's v2 module, subclassable in Python: __call__ is traced into the graph, Weight
// and Module attributes are registered with kiln's nn::Module, so names, state_dict and
// load_state_dict are kiln's own), the built-in layers, ModuleV3 with eager tensors, and functional.
#include <fmt/format.h>

#include "bindings.h"

namespace kiln::python {

namespace {

using namespace pybind11::literals;
using graph::Dim;
using graph::TensorValue;

// Binds the arguments to the signature first, so a forward that takes more than input_types gives
// fails as kiln words it (the caller's out_of_range handler), not with a bare TypeError.
void check_arity(const py::object& fn, const py::tuple& args) {
  try {
    py::module_::import("inspect").attr("signature")(fn).attr("bind")(*args);
  } catch (py::error_already_set& e) {
    if (!e.matches(PyExc_TypeError) && !e.matches(PyExc_ValueError)) throw;
    std::string why = py::str(e.value());
    if (why.find("missing") != std::string::npos) throw std::out_of_range(why);
    // Otherwise (no signature to read, too many arguments) the call itself says what is wrong.
  }
}

}  // namespace

// A signature that takes more arguments than input_types gives becomes the out_of_range that
// GraphSpec::trace reports in the spec's terms, as for a C++ forward that reads past its arguments.
nn::Values call_python_forward(const py::object& fn, const std::vector<nn::Values>& args) {
  py::tuple pyargs(args.size());
  for (size_t i = 0; i < args.size(); ++i) pyargs[i] = values_to_python(args[i]);
  check_arity(fn, pyargs);
  py::object result = fn(*pyargs);
  return values_from_python(result);
}

namespace {

// A GraphSpec's module given as a plain Python callable (a function of the graph's inputs).
class CallableModule : public nn::Module {
 public:
  explicit CallableModule(py::object fn) : fn_(std::move(fn)) {}
  ~CallableModule() override {
    if (!Py_IsInitialized()) {  // at interpreter exit: Python has freed it already
      fn_.release();
      return;
    }
    py::gil_scoped_acquire gil;  // the last reference may go with the GIL released
    fn_ = py::object();
  }
  nn::Values forward(const std::vector<nn::Values>& args) override {
    py::gil_scoped_acquire gil;
    return call_python_forward(fn_, args);
  }

 private:
  py::object fn_;
};

// The C++ side of a Python kiln.nn.Module: forward calls the Python __call__; weights and children
// registered from Python attributes.
class PyModule : public nn::Module {
 public:
  nn::Values forward(const std::vector<nn::Values>& args) override {
    py::gil_scoped_acquire gil;
    py::function call = py::get_override(static_cast<const nn::Module*>(this), "__call__");
    if (!call) return nn::Module::forward(args);
    return call_python_forward(call, args);
  }
  WeightId add_weight(const std::string& name, const graph::Weight& w) {
    return register_weight(name, w.dtype, w.shape, w.device);
  }
  void add_module(const std::string& name, std::shared_ptr<nn::Module> child) {
    register_module(name, std::move(child));
  }
  TensorValue weight_value(WeightId id) const { return weight(id); }
};

PyModule& py_module(nn::Module& m) {
  auto* p = dynamic_cast<PyModule*>(&m);
  if (!p)
    throw ValueError(
        "nn.Module: only a Module defined in Python registers attributes (this is a built-in layer)");
  return *p;
}

// nn::ModuleV3's Python side: forward calls the Python forward; parameters from Python attributes.
class PyModuleV3 : public nn::ModuleV3 {
 public:
  nn::TensorTree forward(const std::vector<nn::TensorTree>& args) override {
    py::gil_scoped_acquire gil;
    py::function fn = py::get_override(static_cast<const nn::ModuleV3*>(this), "forward");
    if (!fn) throw ValueError("nn.ModuleV3: the module does not define forward()");
    py::tuple pyargs(args.size());
    for (size_t i = 0; i < args.size(); ++i)
      pyargs[i] = tree_to_python(args[i], [](const nn::Tensor& t) { return py::cast(t); });
    check_arity(fn, pyargs);  // as a C++ forward's at(): stage() words it in the graph's terms
    py::object result = fn(*pyargs);
    return tree_from_python<nn::Tensor>(result, [](py::handle leaf) { return leaf.cast<nn::Tensor>(); });
  }
  nn::Parameter add_parameter(const std::string& name, const Tensor& data) {
    return register_parameter(name, data);
  }
  void add_module(const std::string& name, std::shared_ptr<nn::ModuleV3> child) {
    register_module(name, std::move(child));
  }
};

nn::MLPActivation activation_named(const std::string& name) {
  if (name == "silu" || name == "swiglu") return nn::MLPActivation::swiglu;
  if (name == "gelu") return nn::MLPActivation::gelu;
  if (name == "gelu_tanh") return nn::MLPActivation::gelu_tanh;
  if (name == "geglu_tanh") return nn::MLPActivation::geglu_tanh;
  throw ValueError(
      fmt::format("MLP: unknown activation_function '{}' (silu, gelu, gelu_tanh, geglu_tanh)", name));
}

std::vector<nn::TypeTree> type_trees(const py::args& input_types) {
  std::vector<nn::TypeTree> out;
  for (py::handle t : input_types) out.push_back(type_tree_from_python(t));
  return out;
}

}  // namespace

std::shared_ptr<nn::Module> module_from_callable(py::object fn) {
  return std::make_shared<CallableModule>(std::move(fn));
}

void bind_nn(py::module_& m) {
  py::class_<nn::Module, PyModule, std::shared_ptr<nn::Module>>(m, "Module",
                                                                "kiln's nn::Module; subclass kiln.nn.Module.")
      .def(py::init_alias<>())
      .def(
          "_register_weight",
          [](py::object self, const std::string& name, py::object weight) {
            auto id =
                py_module(self.cast<nn::Module&>()).add_weight(name, weight.cast<const graph::Weight&>());
            // The weight resolves to this module's qualified name when used (graph.cpp's weight_value).
            weight.attr("_kiln_owner") = py::module_::import("weakref").attr("ref")(self);
            weight.attr("_kiln_id") = id;
          },
          "name"_a, "weight"_a)
      .def(
          "_register_module",
          [](nn::Module& self, const std::string& name, std::shared_ptr<nn::Module> child) {
            py_module(self).add_module(name, std::move(child));
          },
          "name"_a, "module"_a)
      .def("_weight_value", [](nn::Module& self, size_t id) { return py_module(self).weight_value(id); })
      .def("state_dict", [](const nn::Module& self) { return registry_to_python(self.state_dict()); })
      .def("raw_state_dict", &nn::Module::raw_state_dict)
      .def(
          "load_state_dict",
          [](nn::Module& self, const py::object& state_dict, bool strict) {
            self.load_state_dict(registry_from_python(state_dict), strict);
          },
          "state_dict"_a, py::kw_only(), "strict"_a = true)
      .def_property_readonly("path", &nn::Module::path);

  py::class_<nn::Linear, nn::Module, std::shared_ptr<nn::Linear>>(m, "Linear", "y = x @ weight.T + bias")
      .def(py::init([](int64_t in_dim, int64_t out_dim, DType dtype, DeviceRef device, bool has_bias) {
             return std::make_shared<nn::Linear>(in_dim, out_dim, dtype, has_bias, device);
           }),
           "in_dim"_a, "out_dim"_a, "dtype"_a = DType::f32, "device"_a = DeviceRef::CPU(), py::kw_only(),
           "has_bias"_a = false)
      .def(
          "__call__", [](const nn::Linear& l, const TensorValue& x) { return l(x); }, "x"_a)
      .def_property_readonly("in_dim", &nn::Linear::in_dim)
      .def_property_readonly("out_dim", &nn::Linear::out_dim)
      .def_property_readonly("has_bias", &nn::Linear::has_bias);
  py::class_<nn::Embedding, nn::Module, std::shared_ptr<nn::Embedding>>(m, "Embedding")
      .def(py::init([](int64_t vocab_size, int64_t hidden_dim, DType dtype, DeviceRef device) {
             return std::make_shared<nn::Embedding>(vocab_size, hidden_dim, dtype, device);
           }),
           "vocab_size"_a, "hidden_dim"_a, "dtype"_a = DType::f32, "device"_a = DeviceRef::CPU())
      .def(
          "__call__", [](const nn::Embedding& e, const TensorValue& ids) { return e(ids); }, "indices"_a);
  py::class_<nn::RMSNorm, nn::Module, std::shared_ptr<nn::RMSNorm>>(m, "RMSNorm")
      .def(py::init([](int64_t dim, DType dtype, double eps, DeviceRef device, bool unit_offset) {
             return std::make_shared<nn::RMSNorm>(dim, eps, dtype, device, unit_offset);
           }),
           "dim"_a, "dtype"_a = DType::f32, "eps"_a = 1e-6, "device"_a = DeviceRef::CPU(), py::kw_only(),
           "unit_offset"_a = false)
      .def(
          "__call__", [](const nn::RMSNorm& n, const TensorValue& x) { return n(x); }, "x"_a);
  py::class_<nn::LayerNorm, nn::Module, std::shared_ptr<nn::LayerNorm>>(m, "LayerNorm")
      .def(py::init([](int64_t dims, DType dtype, double eps, DeviceRef device) {
             return std::make_shared<nn::LayerNorm>(dims, eps, dtype, device);
           }),
           "dims"_a, "dtype"_a = DType::f32, "eps"_a = 1e-5, "device"_a = DeviceRef::CPU())
      .def(
          "__call__", [](const nn::LayerNorm& n, const TensorValue& x) { return n(x); }, "x"_a);
  py::class_<nn::MLP, nn::Module, std::shared_ptr<nn::MLP>>(m, "MLP")
      .def(py::init([](int64_t hidden_dim, int64_t feed_forward_length, DType dtype, DeviceRef device,
                       bool has_bias, const std::string& activation_function) {
             return std::make_shared<nn::MLP>(hidden_dim, feed_forward_length,
                                              activation_named(activation_function), dtype, has_bias, device);
           }),
           "hidden_dim"_a, "feed_forward_length"_a, "dtype"_a = DType::f32, "device"_a = DeviceRef::CPU(),
           py::kw_only(), "has_bias"_a = false, "activation_function"_a = "silu")
      .def(
          "__call__", [](const nn::MLP& mlp, const TensorValue& x) { return mlp(x); }, "x"_a);

  // The Llama family's layers and the KV-cache calling convention (docs/llama.md).
  py::class_<nn::LlamaConfig>(m, "LlamaConfig")
      .def(py::init([](const py::kwargs& fields) {
        nn::LlamaConfig config;
        py::object view = py::cast(&config, py::return_value_policy::reference);
        for (auto [name, value] : fields) py::setattr(view, name, value);
        return config;
      }))
      .def_readwrite("vocab_size", &nn::LlamaConfig::vocab_size)
      .def_readwrite("hidden_size", &nn::LlamaConfig::hidden_size)
      .def_readwrite("intermediate_size", &nn::LlamaConfig::intermediate_size)
      .def_readwrite("num_hidden_layers", &nn::LlamaConfig::num_hidden_layers)
      .def_readwrite("num_attention_heads", &nn::LlamaConfig::num_attention_heads)
      .def_readwrite("num_key_value_heads", &nn::LlamaConfig::num_key_value_heads)
      .def_readwrite("head_dim", &nn::LlamaConfig::head_dim)
      .def_readwrite("rms_norm_eps", &nn::LlamaConfig::rms_norm_eps)
      .def_readwrite("rope_theta", &nn::LlamaConfig::rope_theta)
      .def_readwrite("max_position_embeddings", &nn::LlamaConfig::max_position_embeddings)
      .def_readwrite("tie_word_embeddings", &nn::LlamaConfig::tie_word_embeddings)
      .def_readwrite("attention_bias", &nn::LlamaConfig::attention_bias)
      .def_readwrite("dtype", &nn::LlamaConfig::dtype)
      .def("validate", &nn::LlamaConfig::validate);
  py::class_<nn::RotaryEmbedding>(m, "RotaryEmbedding")
      .def(py::init([](int64_t dim, double theta, int64_t max_seq_len) {
             return nn::RotaryEmbedding(dim, theta, max_seq_len);
           }),
           "dim"_a, "theta"_a = 10000.0, "max_seq_len"_a = 2048)
      .def("cos_sin", &nn::RotaryEmbedding::cos_sin, "positions"_a)
      .def_static("apply", &nn::RotaryEmbedding::apply, "x"_a, "cos"_a, "sin"_a)
      .def(
          "__call__",
          [](const nn::RotaryEmbedding& r, const TensorValue& x, const TensorValue& p) { return r(x, p); },
          "x"_a, "positions"_a);
  py::class_<nn::KVCache>(m, "KVCache")
      .def(py::init([](graph::BufferValue k, graph::BufferValue v) {
             return nn::KVCache{k, v};
           }),
           "k"_a, "v"_a);
  py::class_<nn::AttentionContext>(m, "AttentionContext");
  m.def(
      "make_attention_context",
      [](const nn::KVCache& cache, const TensorValue& attention_mask, const Dim& seq,
         const nn::RotaryEmbedding& rope) {
        return nn::make_attention_context(cache, attention_mask, seq, rope);
      },
      "cache"_a, "attention_mask"_a, "seq"_a, "rope"_a);
  py::class_<nn::AttentionWithRope, nn::Module, std::shared_ptr<nn::AttentionWithRope>>(m,
                                                                                        "AttentionWithRope")
      .def(py::init([](int64_t layer_index, int64_t hidden_size, int64_t num_attention_heads,
                       int64_t num_key_value_heads, int64_t head_dim, DType dtype, DeviceRef device,
                       bool has_bias) {
             return std::make_shared<nn::AttentionWithRope>(layer_index, hidden_size, num_attention_heads,
                                                            num_key_value_heads, head_dim, dtype, has_bias,
                                                            device);
           }),
           "layer_index"_a, "hidden_size"_a, "num_attention_heads"_a, "num_key_value_heads"_a, "head_dim"_a,
           "dtype"_a = DType::f32, "device"_a = DeviceRef::CPU(), py::kw_only(), "has_bias"_a = false)
      .def(
          "__call__",
          [](const nn::AttentionWithRope& a, const TensorValue& x, const nn::AttentionContext& ctx) {
            return a(x, ctx);
          },
          "x"_a, "ctx"_a);
  py::class_<nn::TransformerBlock, nn::Module, std::shared_ptr<nn::TransformerBlock>>(m, "TransformerBlock")
      .def(py::init([](const nn::LlamaConfig& c, int64_t layer) {
             return std::make_shared<nn::TransformerBlock>(c, layer);
           }),
           "config"_a, "layer_index"_a)
      .def(
          "__call__",
          [](const nn::TransformerBlock& b, const TensorValue& x, const nn::AttentionContext& ctx) {
            return b(x, ctx);
          },
          "x"_a, "ctx"_a);
  py::class_<nn::Transformer, nn::Module, std::shared_ptr<nn::Transformer>>(m, "Transformer")
      .def(py::init([](const nn::LlamaConfig& c, int64_t max_seq_len) {
             return std::make_shared<nn::Transformer>(c, max_seq_len);
           }),
           "config"_a, "max_seq_len"_a = 0)
      .def("input_tree", [](const nn::Transformer& t) { return type_tree_to_python(*t.input_tree()); })
      .def(
          "__call__",
          [](const nn::Transformer& t, const TensorValue& tokens, const TensorValue& mask,
             const nn::KVCache& cache) { return t(tokens, mask, cache); },
          "tokens"_a, "attention_mask"_a, "cache"_a);

  // ---- ModuleV3: eager tensors, stage(), compile() --------------------------------------------------
  py::class_<nn::Tensor> tensor(m, "Tensor",
                                "ModuleV3's tensor: eager data, or a traced value inside stage().");
  tensor.def(py::init([](py::handle array) { return nn::Tensor(tensor_from_python(array)); }), "array"_a)
      .def_static(
          "zeros",
          [](const std::vector<int64_t>& shape, DType dtype, DeviceRef device) {
            return nn::Tensor::zeros(dtype, shape, device);
          },
          "shape"_a, "dtype"_a = DType::f32, "device"_a = DeviceRef::CPU())
      .def_static(
          "scalar", [](double v, DType dtype) { return nn::Tensor::scalar(v, dtype); }, "value"_a,
          "dtype"_a = DType::f32)
      .def_property_readonly("dtype", &nn::Tensor::dtype)
      .def_property_readonly("shape", [](const nn::Tensor& t) { return t.shape().dims(); })
      .def_property_readonly("device", &nn::Tensor::device)
      .def_property_readonly("rank", &nn::Tensor::rank)
      .def_property_readonly("is_eager", &nn::Tensor::is_eager)
      .def_property_readonly("is_traced", &nn::Tensor::is_traced)
      .def_property_readonly("data", &nn::Tensor::data, "The eager tensor's data (a kiln.driver.Tensor).")
      .def("to_numpy", [](const nn::Tensor& t) { return py::cast(t.data()).attr("to_numpy")(); })
      .def("__dlpack__", [](const nn::Tensor& t,
                            const py::kwargs& kw) { return py::cast(t.data()).attr("__dlpack__")(**kw); })
      .def("__dlpack_device__",
           [](const nn::Tensor& t) { return py::cast(t.data()).attr("__dlpack_device__")(); })
      .def(
          "__array__",
          [](const nn::Tensor& t, const py::object& dtype) {
            return py::cast(t.data()).attr("__array__")(dtype);
          },
          "dtype"_a = py::none())
      .def(
          "__matmul__", [](const nn::Tensor& a, const nn::Tensor& b) { return nn::functional::matmul(a, b); },
          py::is_operator())
      .def(
          "reshape",
          [](const nn::Tensor& x, const std::vector<Dim>& s) {
            return nn::functional::reshape(x, graph::Shape(s));
          },
          "shape"_a)
      .def(
          "transpose",
          [](const nn::Tensor& x, int64_t a, int64_t b) { return nn::functional::transpose(x, a, b); },
          "dim_1"_a, "dim_2"_a)
      .def(
          "cast", [](const nn::Tensor& x, DType d) { return nn::functional::cast(x, d); }, "dtype"_a)
      .def_property_readonly("T", [](const nn::Tensor& x) { return nn::functional::transpose(x, -1, -2); })
      .def("__repr__", &nn::Tensor::to_string);
  bind_arithmetic<nn::Tensor>(tensor);
  py::implicitly_convertible<Tensor, nn::Tensor>();

  py::module_ functional =
      m.def_submodule("functional", "ModuleV3's ops: run at once on eager tensors, traced in stage().");
  {
    using T = nn::Tensor;
    namespace NS = nn::functional;
    KILN_PY_BIND_SHARED_OPS(functional);
  }
  functional.def(
      "constant", [](py::handle array) { return nn::functional::constant(tensor_from_python(array)); },
      "value"_a);

  py::class_<nn::Parameter>(m, "Parameter")
      .def_property_readonly("name", &nn::Parameter::name)
      .def_property_readonly("data", &nn::Parameter::data)
      .def(
          "set", [](const nn::Parameter& p, py::handle array) { p.set(tensor_from_python(array)); },
          "array"_a)
      .def("tensor", &nn::Parameter::tensor);

  py::class_<nn::CompiledModuleV3>(m, "CompiledModuleV3")
      .def("__call__",
           [](const nn::CompiledModuleV3& c, const py::args& args) {
             std::vector<Tensor> inputs = tensors_from_python(args);
             std::vector<Tensor> outputs;
             {
               py::gil_scoped_release release;
               outputs = c(inputs);
             }
             return tensors_to_python(outputs);
           })
      .def_property_readonly("model", &nn::CompiledModuleV3::model);

  py::class_<nn::ModuleV3, PyModuleV3, std::shared_ptr<nn::ModuleV3>>(
      m, "ModuleV3", "kiln's nn::ModuleV3; subclass kiln.nn.ModuleV3.")
      .def(py::init_alias<>())
      .def(
          "_register_parameter",
          [](nn::ModuleV3& self, const std::string& name, py::handle array) {
            return static_cast<PyModuleV3&>(self).add_parameter(name, tensor_from_python(array));
          },
          "name"_a, "array"_a)
      .def(
          "_register_module",
          [](nn::ModuleV3& self, const std::string& name, std::shared_ptr<nn::ModuleV3> child) {
            static_cast<PyModuleV3&>(self).add_module(name, std::move(child));
          },
          "name"_a, "module"_a)
      .def("parameters",
           [](const nn::ModuleV3& self) {
             py::list out;
             for (const auto& [name, p] : self.parameters())
               out.append(py::make_tuple(name, py::cast(p.data())));
             return out;
           })
      .def("state_dict", [](const nn::ModuleV3& self) { return registry_to_python(self.state_dict()); })
      .def(
          "load_state_dict",
          [](nn::ModuleV3& self, const py::object& state_dict, bool strict) {
            self.load_state_dict(registry_from_python(state_dict), strict);
          },
          "state_dict"_a, py::kw_only(), "strict"_a = true)
      .def_property("devices", &nn::ModuleV3::devices, &nn::ModuleV3::set_devices)
      .def(
          "stage",
          [](nn::ModuleV3& self, const py::args& input_types, const std::string& name) {
            std::vector<nn::TypeTree> types = type_trees(input_types);
            nn::StageOptions options;
            options.name = name;
            return graph_to_python(std::make_shared<GraphHandle>(self.stage(types, options)));
          },
          py::kw_only(), "name"_a = "forward")
      .def(
          "compile",
          [](nn::ModuleV3& self, const py::args& input_types, const std::string& name,
             const py::object& weights, bool auto_cast,
             const std::vector<std::filesystem::path>& custom_extensions) {
            std::vector<nn::TypeTree> types = type_trees(input_types);
            nn::CompileOptions options;
            options.name = name;
            if (!weights.is_none()) options.weights = registry_from_python(weights);
            options.auto_cast = auto_cast;
            options.custom_extensions = custom_extensions;
            py::gil_scoped_release release;
            return self.compile(types, options);
          },
          py::kw_only(), "name"_a = "forward", "weights"_a = py::none(), "auto_cast"_a = false,
          "custom_extensions"_a = std::vector<std::filesystem::path>{})
      .def_property_readonly("path", &nn::ModuleV3::path);
}

}  // namespace kiln::python
