// kiln._kiln: the compiled half of the `kiln` package. One submodule per MAX module (dtype, driver,
// graph, engine, nn, pipelines, errors); python/kiln/*.py re-export them under MAX's names.
#include "bindings.h"

namespace kiln::python {

// kiln::ValueError derives from std::invalid_argument, which pybind11 already raises as Python's
// ValueError (where MAX raises it); kiln::Error and its subclasses get classes of their own, with the
// same names and messages.
void bind_errors(py::module_& m) {
  py::object error = py::exception<Error>(m, "Error", PyExc_RuntimeError);
  py::register_exception<ShapeError>(m, "ShapeError", error);
  py::register_exception<DTypeError>(m, "DTypeError", error);
  py::register_exception<LoadError>(m, "LoadError", error);
  py::register_exception<ExtensionError>(m, "ExtensionError", error);
  py::register_exception<ParseError>(m, "ParseError", error);
  py::register_exception<VerifyError>(m, "VerifyError", error);
  py::register_exception<ExecutionError>(m, "ExecutionError", error);
}

}  // namespace kiln::python

PYBIND11_MODULE(_kiln, m) {
  namespace kp = kiln::python;
  m.doc() = "kiln's C++ API for the kiln package (import kiln, not this)";
  m.attr("__version__") = KILN_VERSION_STRING;
  auto errors = m.def_submodule("errors");
  kp::bind_errors(errors);
  auto dtype = m.def_submodule("dtype");
  kp::bind_dtype(dtype);
  auto graph = m.def_submodule("graph");  // before driver: its defaults are DeviceRefs
  kp::bind_graph(graph);
  auto driver = m.def_submodule("driver");
  kp::bind_driver(driver);
  auto engine = m.def_submodule("engine");
  kp::bind_engine(engine);
  auto nn = m.def_submodule("nn");
  kp::bind_nn(nn);
  auto pipelines = m.def_submodule("pipelines");
  kp::bind_pipelines(pipelines);
}
