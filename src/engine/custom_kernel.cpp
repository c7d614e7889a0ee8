// Custom ops (ext/) as kernel objects: the extension's op, its kernel and its parameters resolved once
// at init; each launch passes DLTensor views.
#include <fmt/format.h>

#include "engine/executor_util.h"
#include "kiln/errors.h"
#include "kiln/ext/extensions.h"

namespace kiln::engine {

namespace {

class CustomKernel final : public kernels::Kernel {
 public:
  CustomKernel(std::shared_ptr<const ext::Library> library, const ext::CustomOp& op, DeviceKind device,
               graph::Attrs attrs)
      : library_(std::move(library)), op_(op), device_(device), attrs_(std::move(attrs)),
        call_(op_.bind(device_, attrs_)) {}

  void run(const kernels::KernelContext&, std::span<const kernels::TensorView> inputs,
           std::span<const kernels::TensorView> outputs) const override {
    // DLTensor views borrow the shapes and strides of the operand views, which outlive the call.
    op_.run(call_, dl_tensors(inputs), dl_tensors(outputs));
  }

 private:
  std::vector<DLTensor> dl_tensors(std::span<const kernels::TensorView> views) const {
    std::vector<DLTensor> tensors;
    tensors.reserve(views.size());
    for (const kernels::TensorView& v : views) {
      DLTensor t{};
      t.data = v.data;
      t.device = {ext::to_dl_device(device_), 0};
      t.ndim = static_cast<int32_t>(v.shape.size());
      t.dtype = ext::dl_dtype(v.dtype);
      t.shape = const_cast<int64_t*>(v.shape.data());
      t.strides = const_cast<int64_t*>(v.strides.data());
      tensors.push_back(t);
    }
    return tensors;
  }

  std::shared_ptr<const ext::Library> library_;  // keeps op_ loaded
  const ext::CustomOp& op_;
  DeviceKind device_;
  graph::Attrs attrs_;               // call_'s string parameters point into it
  ext::CustomOp::BoundCall call_;    // the kernel and its parameters, resolved once
};

}  // namespace

std::unique_ptr<const kernels::Kernel> make_custom_kernel(const compiler::GraphPlan& plan, const compiler::Step& step) {
  const std::string& symbol = graph::get_attr<std::string>(step.attrs, "symbol", step.op);
  if (step.extension < 0 || static_cast<size_t>(step.extension) >= plan.extensions.size())
    throw ExtensionError(fmt::format("init: graph '{}' node {}: custom op '{}' names no extension library",
                                     plan.name, step.node, symbol));
  const compiler::ExtensionRef& ref = plan.extensions[static_cast<size_t>(step.extension)];
  std::shared_ptr<const ext::Library> library = ext::loaded_library(ref.path, ref.content_hash);
  if (!library) {
    library = ext::load_library(ref.path);
    if (library->content_hash() != ref.content_hash)
      throw ExtensionError(fmt::format(
          "init: graph '{}' node {}: custom op '{}': extension '{}' has content hash {} but the model was "
          "compiled against {:016x} (recompile the model)",
          plan.name, step.node, symbol, ref.path.string(), library->content_hash_hex(), ref.content_hash));
  }
  const ext::CustomOp* op = library->find(symbol);
  if (!op)
    throw ExtensionError(fmt::format("init: graph '{}' node {}: extension '{}' does not define custom op '{}'",
                                     plan.name, step.node, ref.path.string(), symbol));
  return std::make_unique<CustomKernel>(std::move(library), *op, step.kernel.device, step.attrs);
}

}  // namespace kiln::engine
