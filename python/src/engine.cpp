// kiln.engine: InferenceSession (compile, init, load) and Model (execute, input_metadata, capture,
// replay). The GIL is released while kiln compiles, binds weights and runs.
#include <fmt/format.h>

#include "bindings.h"

namespace kiln::python {

namespace {

using namespace pybind11::literals;
using engine::InferenceSession;
using engine::Model;

// What compile and load accept: a Graph (its compile unit) or a compile unit.
const graph::Module& module_of(py::handle obj) {
  if (py::isinstance<GraphHandle>(obj)) return obj.cast<GraphHandle&>().graph.module();
  if (py::isinstance<graph::Module>(obj)) return obj.cast<graph::Module&>();
  throw py::type_error("expected a kiln.graph.Graph or kiln.graph.Module");
}

std::vector<std::filesystem::path> paths_from_python(const py::object& paths) {
  std::vector<std::filesystem::path> out;
  if (paths.is_none()) return out;
  if (py::isinstance<py::str>(paths) || py::hasattr(paths, "__fspath__")) {
    out.push_back(paths.cast<std::filesystem::path>());
    return out;
  }
  for (py::handle p : paths) out.push_back(p.cast<std::filesystem::path>());
  return out;
}

py::list execute(const Model& model, const py::args& args) {
  std::vector<Tensor> inputs = tensors_from_python(args);
  std::vector<Tensor> outputs;
  {
    py::gil_scoped_release release;
    outputs = model.execute(inputs);
  }
  return tensors_to_python(outputs);
}

}  // namespace

py::dict models_to_python(std::map<std::string, Model> models) {
  py::dict out;
  for (auto& [name, model] : models) out[py::str(name)] = py::cast(std::move(model));
  return out;
}

void bind_engine(py::module_& m) {
  py::class_<compiler::CompiledModel>(m, "CompiledModel", "An executable plan; init() binds weights to it.")
      .def("save", &compiler::CompiledModel::save, "path"_a, py::call_guard<py::gil_scoped_release>())
      .def_static("load", &compiler::CompiledModel::load, "path"_a, py::call_guard<py::gil_scoped_release>());

  py::class_<InferenceSession, std::shared_ptr<InferenceSession>>(m, "InferenceSession")
      .def(py::init([](const std::vector<DeviceRef>& devices, std::optional<int> num_threads,
                       const py::object& custom_extensions) {
             engine::SessionOptions options;
             options.num_threads = num_threads.value_or(0);
             std::vector<std::filesystem::path> paths = paths_from_python(custom_extensions);
             py::gil_scoped_release release;
             return std::make_shared<InferenceSession>(devices, paths, options);
           }),
           "devices"_a = std::vector<DeviceRef>{DeviceRef::CPU()}, "num_threads"_a = py::none(),
           "custom_extensions"_a = py::none())
      .def_property_readonly("devices", &InferenceSession::devices)
      .def_property_readonly("custom_extensions", &InferenceSession::custom_extensions)
      .def(
          "compile",
          [](const InferenceSession& s, py::handle graph) {
            const graph::Module& module = module_of(graph);
            py::gil_scoped_release release;
            return s.compile(module);
          },
          "model"_a)
      .def(
          "init",
          [](const InferenceSession& s, const compiler::CompiledModel& compiled, const py::object& weights,
             const std::vector<std::string>& device_graphs) {
            WeightsRegistry registry = registry_from_python(weights);
            std::map<std::string, Model> models;
            {
              py::gil_scoped_release release;
              models = s.init(compiled, registry, device_graphs);
            }
            return models_to_python(std::move(models));
          },
          "compiled_model"_a, "weights_registry"_a = py::none(),
          "device_graphs"_a = std::vector<std::string>{})
      .def(
          "load",
          [](const InferenceSession& s, py::handle graph, const py::object& weights) {
            WeightsRegistry registry = registry_from_python(weights);
            if (py::isinstance<GraphHandle>(graph)) {
              const graph::Graph& g = graph.cast<GraphHandle&>().graph;
              py::gil_scoped_release release;
              return s.load(g, registry);
            }
            const graph::Module& module = module_of(graph);
            py::gil_scoped_release release;
            return s.load(module, registry);
          },
          "model"_a, py::kw_only(), "weights_registry"_a = py::none())
      .def(
          "load_all",
          [](const InferenceSession& s, py::handle graph, const py::object& weights) {
            const graph::Module& module = module_of(graph);
            WeightsRegistry registry = registry_from_python(weights);
            std::map<std::string, Model> models;
            {
              py::gil_scoped_release release;
              models = s.load_all(module, registry);
            }
            return models_to_python(std::move(models));
          },
          "model"_a, py::kw_only(), "weights_registry"_a = py::none())
      .def_property_readonly("compile_count", &InferenceSession::compile_count)
      .def_property_readonly("cache_hits", &InferenceSession::cache_hits);

  py::class_<Model>(m, "Model", "One runnable graph of an initialised compiled model.")
      .def_property_readonly("name", &Model::name)
      .def("execute", &execute,
           "Runs the graph on arrays (kiln, numpy, PyTorch: anything with __dlpack__); "
           "returns kiln tensors, which numpy and PyTorch take through DLPack.")
      .def("__call__", &execute)
      .def_property_readonly("input_metadata", &Model::input_metadata)
      .def_property_readonly("output_metadata", &Model::output_metadata)
      .def(
          "capture",
          [](const Model& model, const py::args& args, const std::string& key) {
            std::vector<Tensor> inputs = tensors_from_python(args);
            std::vector<Tensor> outputs;
            {
              py::gil_scoped_release release;
              outputs = model.capture(key, inputs);
            }
            return tensors_to_python(outputs);
          },
          py::kw_only(), "key"_a = "default")
      .def(
          "replay",
          [](const Model& model, const py::args& args, const std::string& key) {
            std::vector<Tensor> inputs = tensors_from_python(args);
            std::vector<Tensor> outputs;
            {
              py::gil_scoped_release release;
              outputs = model.replay(key, inputs);
            }
            return tensors_to_python(outputs);
          },
          py::kw_only(), "key"_a = "default")
      .def("release", &Model::release, "key"_a = "default")
      .def_property_readonly("is_device_graph", &Model::is_device_graph)
      .def("__repr__", [](const Model& model) { return fmt::format("Model('{}')", model.name()); });
}

}  // namespace kiln::python
