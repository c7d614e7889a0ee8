// kiln.driver: Tensor (kiln::Tensor) with DLPack import and export, zero-copy both ways, and CPU().
#include <fmt/format.h>

#include "bindings.h"

namespace kiln::python {

namespace {

using namespace pybind11::literals;

constexpr const char* kLegacyName = "dltensor";
constexpr const char* kLegacyUsedName = "used_dltensor";
constexpr const char* kVersionedName = "dltensor_versioned";
constexpr const char* kVersionedUsedName = "used_dltensor_versioned";

// A Python producer's deleter drops a reference to its array (numpy's, PyTorch's), and kiln may let go
// of an imported tensor on any thread, with or without the GIL (a Model's weights, the engine's step
// thread): the import wraps the producer's DLManagedTensor in one whose deleter takes the GIL first.
template <class Managed>
struct GilDeleter {
  Managed outer;
  Managed* inner;

  static void destroy(Managed* self) {
    auto* wrapper = static_cast<GilDeleter*>(self->manager_ctx);
    if (wrapper->inner->deleter && Py_IsInitialized()) {
      PyGILState_STATE state = PyGILState_Ensure();
      wrapper->inner->deleter(wrapper->inner);
      PyGILState_Release(state);
    }
    delete wrapper;
  }
};

template <class Managed>
Tensor import_managed(Managed* inner) {
  auto* wrapper = new GilDeleter<Managed>{*inner, inner};
  wrapper->outer.manager_ctx = wrapper;
  wrapper->outer.deleter = &GilDeleter<Managed>::destroy;
  return Tensor::from_dlpack(&wrapper->outer);  // calls the deleter itself if the import fails
}

// Takes the capsule's tensor (renaming the capsule "used_...", as the protocol says a consumer does).
Tensor from_capsule(py::handle capsule) {
  PyObject* cap = capsule.ptr();
  if (PyCapsule_IsValid(cap, kVersionedName)) {
    auto* managed = static_cast<DLManagedTensorVersioned*>(PyCapsule_GetPointer(cap, kVersionedName));
    PyCapsule_SetName(cap, kVersionedUsedName);
    return import_managed(managed);
  }
  if (PyCapsule_IsValid(cap, kLegacyName)) {
    auto* managed = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(cap, kLegacyName));
    PyCapsule_SetName(cap, kLegacyUsedName);
    return import_managed(managed);
  }
  throw ValueError(
      "from_dlpack: not an unused DLPack capsule ('dltensor' or 'dltensor_versioned'; each "
      "capsule can be consumed once)");
}

// The capsule's destructor frees a tensor no consumer took.
void delete_unused_legacy(PyObject* cap) {
  if (!PyCapsule_IsValid(cap, kLegacyName)) return;
  auto* managed = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(cap, kLegacyName));
  if (managed && managed->deleter) managed->deleter(managed);
}
void delete_unused_versioned(PyObject* cap) {
  if (!PyCapsule_IsValid(cap, kVersionedName)) return;
  auto* managed = static_cast<DLManagedTensorVersioned*>(PyCapsule_GetPointer(cap, kVersionedName));
  if (managed && managed->deleter) managed->deleter(managed);
}

// DLPack 1.x consumers pass max_version; older ones (numpy 1.24, PyTorch 1.13) get the legacy struct.
py::capsule to_capsule(const Tensor& t, const py::object& max_version) {
  bool versioned = false;
  if (!max_version.is_none()) versioned = py::cast<py::tuple>(max_version)[0].cast<int>() >= 1;
  if (versioned) return py::capsule(t.to_dlpack_versioned(), kVersionedName, &delete_unused_versioned);
  return py::capsule(t.to_dlpack(), kLegacyName, &delete_unused_legacy);
}

py::tuple dlpack_device(const Tensor& t) {
  const int code = t.device().kind == DeviceKind::CPU ? kDLCPU : kDLCUDA;
  return py::make_tuple(code, t.device().id);
}

py::tuple shape_tuple(const std::vector<int64_t>& shape) {
  py::tuple out(shape.size());
  for (size_t i = 0; i < shape.size(); ++i) out[i] = shape[i];
  return out;
}

// numpy (before 2.0) refuses to export a read-only array through DLPack (np.from_dlpack's results are
// read-only): such an array is taken through its __array_interface__ instead, still without a copy.
Tensor from_array_interface(py::handle obj) {
  py::dict iface = obj.attr("__array_interface__");
  const DType dtype = py::module_::import("kiln._kiln.dtype")
                          .attr("DType")
                          .attr("from_numpy")(obj.attr("dtype"))
                          .cast<DType>();
  auto* data = reinterpret_cast<void*>(py::cast<py::tuple>(iface["data"])[0].cast<uintptr_t>());
  std::vector<int64_t> shape = iface["shape"].cast<std::vector<int64_t>>();
  std::vector<int64_t> strides;
  if (!iface["strides"].is_none())
    for (int64_t bytes : iface["strides"].cast<std::vector<int64_t>>())
      strides.push_back(bytes / static_cast<int64_t>(dtype_size(dtype)));
  // The array stays referenced while the tensor lives; the reference is dropped with the GIL held.
  std::shared_ptr<void> keep(new py::object(py::reinterpret_borrow<py::object>(obj)), [](void* p) {
    if (!Py_IsInitialized()) return;
    PyGILState_STATE state = PyGILState_Ensure();
    delete static_cast<py::object*>(p);
    PyGILState_Release(state);
  });
  return Tensor::view(std::move(keep), data, dtype, shape, strides);
}

}  // namespace

Tensor tensor_from_python(py::handle obj) {
  if (py::isinstance<Tensor>(obj)) return obj.cast<Tensor>();  // shares the storage
  if (PyCapsule_CheckExact(obj.ptr())) return from_capsule(obj);
  if (!py::hasattr(obj, "__dlpack__"))
    throw ValueError(fmt::format("from_dlpack: a {} is not an array (it has no __dlpack__)",
                                 std::string(py::str(py::type::of(obj).attr("__name__")))));
  py::object capsule;
  try {
    capsule = obj.attr("__dlpack__")("max_version"_a = py::make_tuple(1, 0));
  } catch (py::error_already_set& e) {
    if (e.matches(PyExc_BufferError) && py::hasattr(obj, "__array_interface__"))
      return from_array_interface(obj);
    if (!e.matches(PyExc_TypeError)) throw;  // a producer before DLPack 1.0 has no max_version
    try {
      capsule = obj.attr("__dlpack__")();
    } catch (py::error_already_set& again) {
      if (again.matches(PyExc_BufferError) && py::hasattr(obj, "__array_interface__"))
        return from_array_interface(obj);
      throw;
    }
  }
  return from_capsule(capsule);
}

WeightsRegistry registry_from_python(const py::object& weights) {
  WeightsRegistry out;
  if (weights.is_none()) return out;
  for (auto [name, array] : py::cast<py::dict>(weights))
    out.emplace(py::cast<std::string>(name), tensor_from_python(array));
  return out;
}

py::dict registry_to_python(const WeightsRegistry& registry) {
  py::dict out;
  for (const auto& [name, t] : registry) out[py::str(name)] = py::cast(t);
  return out;
}

py::list tensors_to_python(const std::vector<Tensor>& tensors) {
  py::list out;
  for (const auto& t : tensors) out.append(py::cast(t));
  return out;
}

std::vector<Tensor> tensors_from_python(const py::args& args) {
  std::vector<Tensor> out;
  out.reserve(args.size());
  for (py::handle a : args) out.push_back(tensor_from_python(a));
  return out;
}

void bind_driver(py::module_& m) {
  py::class_<Tensor>(m, "Tensor", "Memory on a device with a dtype, shape and strides; DLPack both ways.")
      .def(py::init([](py::handle array) { return tensor_from_python(array); }), "array"_a,
           "A tensor sharing the memory of any DLPack array (numpy, PyTorch, kiln).")
      .def_static(
          "from_dlpack", [](py::handle array) { return tensor_from_python(array); }, "array"_a)
      .def_static(
          "from_numpy", [](py::handle array) { return tensor_from_python(array); }, "array"_a)
      .def_static(
          "zeros",
          [](const std::vector<int64_t>& shape, DType dtype, DeviceRef device) {
            return Tensor::zeros(dtype, shape, device);
          },
          "shape"_a, "dtype"_a = DType::f32, "device"_a = DeviceRef::CPU())
      .def(
          "__dlpack__",
          [](const Tensor& t, const py::object& /*stream*/, const py::object& max_version,
             const py::object& /*dl_device*/, const py::object& copy) {
            if (!copy.is_none() && copy.cast<bool>())
              throw py::buffer_error(
                  "kiln.driver.Tensor.__dlpack__: copy=True is not supported (exports share memory)");
            return to_capsule(t, max_version);
          },
          py::kw_only(), "stream"_a = py::none(), "max_version"_a = py::none(), "dl_device"_a = py::none(),
          "copy"_a = py::none())
      .def("__dlpack_device__", &dlpack_device)
      .def(
          "to_numpy",
          [](const Tensor& t) { return py::module_::import("numpy").attr("from_dlpack")(py::cast(t)); },
          "A numpy array sharing this tensor's memory.")
      .def(
          "__array__",
          [](const Tensor& t, const py::object& dtype) {
            py::object array = py::module_::import("numpy").attr("from_dlpack")(py::cast(t));
            return dtype.is_none() ? array : array.attr("astype")(dtype);
          },
          "dtype"_a = py::none())
      .def_property_readonly("shape", [](const Tensor& t) { return shape_tuple(t.shape()); })
      .def_property_readonly("strides", [](const Tensor& t) { return shape_tuple(t.strides()); })
      .def_property_readonly("dtype", &Tensor::dtype)
      .def_property_readonly("device", &Tensor::device)
      .def_property_readonly("rank", &Tensor::rank)
      .def_property_readonly("num_elements", &Tensor::numel)
      .def_property_readonly("is_contiguous", &Tensor::is_contiguous)
      .def(
          "data_ptr", [](const Tensor& t) { return reinterpret_cast<uintptr_t>(t.data()); },
          "The address of the first element (what zero-copy exchanges keep).")
      .def("contiguous", &Tensor::contiguous)
      .def("copy", &Tensor::clone, "A packed copy with its own memory.")
      .def("__repr__", &Tensor::to_string);

  m.def(
      "CPU", [](int id) { return DeviceRef::CPU(id); }, "id"_a = 0,
      "The host CPU (id > 0: a logical CPU device).");
  m.def(
      "accelerator_count", [] { return 0; }, "kiln's backends are CPU-only for now.");
  m.def(
      "from_dlpack", [](py::handle array) { return tensor_from_python(array); }, "array"_a);
}

}  // namespace kiln::python
