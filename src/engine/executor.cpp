#include "engine/executor.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>
#include <set>
#include <string>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "kiln/errors.h"

namespace kiln::engine {

namespace {

using compiler::GraphPlan;
using compiler::PlanValue;
using compiler::Step;
using compiler::ValueKind;

struct KernelKey {
  DeviceKind device;
  DType dtype;
};

KernelKey kernel_key(const GraphPlan& plan, const Step& step) {
  std::vector<DType> input_dtypes, output_dtypes;
  for (int32_t v : step.inputs) input_dtypes.push_back(graph::dtype_of(plan.values.at(v).type));
  for (int32_t v : step.outputs) output_dtypes.push_back(graph::dtype_of(plan.values.at(v).type));
  DType dtype = kernels::kernel_dtype(step.op, input_dtypes, output_dtypes);
  DeviceKind device = DeviceKind::CPU;
  if (!step.outputs.empty())
    device = graph::device_of(plan.values.at(step.outputs.front()).type).kind;
  else if (!step.inputs.empty())
    device = graph::device_of(plan.values.at(step.inputs.front()).type).kind;
  return {device, dtype};
}

kernels::KernelFn resolve_kernel(const GraphPlan& plan, const Step& step) {
  const KernelKey key = kernel_key(plan, step);
  kernels::KernelFn fn = kernels::cpu_kernels().find(step.op, key.device, key.dtype);
  if (!fn)
    throw Error(fmt::format("init: graph '{}' node {}: no {} kernel for {} on {}", plan.name, step.node,
                            key.device == DeviceKind::CPU ? "cpu" : "gpu", graph::op_name(step.op),
                            dtype_name(key.dtype)));
  return fn;
}

// The custom op a step calls, from the library content it was compiled against: the one loaded in
// this process, else the file at its path if that still has the same content.
const ext::CustomOp* resolve_custom_op(const GraphPlan& plan, const Step& step) {
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
  return op;
}

bool has_symbolic_shape_attr(const graph::Attrs& attrs) {
  for (const auto& [name, attr] : attrs)
    if (const auto* shape = std::get_if<graph::Shape>(&attr); shape && !shape->is_static()) return true;
  return false;
}

kernels::TensorView view_of(const Tensor& t) {
  // Kernels write through views of buffer inputs (in place) and of outputs; both are ours to write.
  return {const_cast<void*>(t.data()), t.dtype(), t.shape(), t.strides()};
}

std::string describe_type(const graph::Type& type) { return graph::to_string(type); }

void set_view(kernels::TensorView& view, const Tensor& t) {
  // Assigning into the existing vectors reuses their capacity: no allocation after the first run.
  view.data = const_cast<void*>(t.data());
  view.dtype = t.dtype();
  view.shape = t.shape();
  view.strides = t.strides();
}

void set_contiguous_strides(kernels::TensorView& view) {
  view.strides.resize(view.shape.size());
  int64_t stride = 1;
  for (size_t d = view.shape.size(); d-- > 0;) {
    view.strides[d] = stride;
    stride *= view.shape[d];
  }
}

int64_t product(const std::vector<int64_t>& dims) {
  int64_t n = 1;
  for (int64_t d : dims) n *= d;
  return n;
}

int64_t evaluate_dim(const graph::Dim& dim, const graph::SymbolBindings& bindings) {
  if (auto value = dim.try_static()) return *value;
  return dim.evaluate(bindings);
}

// Where an alias step's result lies in its source's memory, in elements: checks what the step's
// kernel would have checked (a reshape keeps the element count; a window lies inside the source and
// has the result's shape), and that the window is one contiguous block, which the compiler proved
// for every binding (a plan from elsewhere may not have been).
int64_t alias_element_offset(const Step& step, const std::vector<int64_t>& source,
                             const std::vector<int64_t>& result, const graph::SymbolBindings& bindings) {
  const std::string_view op = graph::op_name(step.op);
  if (step.op == graph::Op::reshape) {
    if (product(source) != product(result))
      throw ShapeError(fmt::format("reshape: input {} has {} elements but the result {} has {}", source,
                                   product(source), result, product(result)));
    return 0;
  }
  const auto* starts = step.attrs.count("starts") ? &graph::get_attr<graph::Shape>(step.attrs, "starts", step.op) : nullptr;
  const auto* stops = starts ? &graph::get_attr<graph::Shape>(step.attrs, "stops", step.op) : nullptr;
  const auto* steps = starts ? &graph::get_attr<std::vector<int64_t>>(step.attrs, "steps", step.op) : nullptr;
  const size_t rank = source.size();
  const size_t bounded = starts ? static_cast<size_t>(starts->rank()) : 0;
  if (starts && (bounded > rank || static_cast<size_t>(stops->rank()) != bounded || steps->size() != bounded))
    throw ExecutionError(fmt::format("{}: {} starts, {} stops and {} steps for a tensor of rank {}", op, bounded,
                                     stops->rank(), steps->size(), rank));
  if (result.size() != rank)
    throw ShapeError(fmt::format("{}: the result {} does not have the source's rank {}", op, result, rank));
  int64_t offset = 0, stride = product(source);
  bool contiguous = true, range_seen = false;
  for (size_t d = 0; d < rank; ++d) {
    const int64_t size = source[d];
    stride = size ? stride / size : 0;
    int64_t start = 0, stop = size, step_size = 1;
    if (d < bounded) {
      start = evaluate_dim((*starts)[static_cast<int64_t>(d)], bindings);
      stop = evaluate_dim((*stops)[static_cast<int64_t>(d)], bindings);
      step_size = (*steps)[d];
    }
    if (step_size < 1)
      throw ExecutionError(fmt::format("{}: step {} of axis {} must be at least 1", op, step_size, d));
    if (start < 0 || start > stop || stop > size)
      throw ExecutionError(
          fmt::format("{}: slice {}:{} of axis {} is out of bounds for size {}", op, start, stop, d, size));
    const int64_t extent = stop > start ? (stop - start + step_size - 1) / step_size : 0;
    if (extent != result[d])
      throw ShapeError(fmt::format("{}: the slice has {} elements on axis {} but the result has shape {}", op,
                                   extent, d, result));
    offset += start * stride;
    if (range_seen)
      contiguous = contiguous && (extent == size && (step_size == 1 || size <= 1));
    else if (extent > 1)
      range_seen = true, contiguous = step_size == 1;
  }
  if (!contiguous && product(result) > 0)
    throw ExecutionError(fmt::format("{}: the window is not one contiguous block of its source {}, so it cannot "
                                     "be an alias (a corrupted plan?)",
                                     op, source));
  return offset;
}

// Both are contiguous tensors of one dtype and shape (checked by the caller).
void copy_bytes(const Tensor& dst, const Tensor& src) {
  std::memcpy(const_cast<void*>(dst.data()), src.data(), src.nbytes());
}

}  // namespace

// ---- init ----------------------------------------------------------------------------------------

void check_weights(const GraphPlan& plan, const WeightsRegistry& weights) {
  for (const graph::Weight& w : plan.weights) {
    auto it = weights.find(w.name);
    if (it == weights.end())
      throw ValueError(fmt::format("init: graph '{}' needs weight '{}' ({}), which the registry lacks",
                                   plan.name, w.name, w.type().to_string()));
    if (!w.shape.is_static())
      throw ValueError(fmt::format("init: weight '{}' has symbolic shape {}; weights need static shapes",
                                   w.name, w.shape.to_string()));
    const Tensor& t = it->second;
    if (!t.defined())
      throw ValueError(fmt::format("init: weight '{}' is an undefined tensor, expected {}", w.name,
                                   w.type().to_string()));
    if (t.dtype() != w.dtype)
      throw ValueError(fmt::format("init: weight '{}' has dtype {}, expected {}", w.name,
                                   dtype_name(t.dtype()), dtype_name(w.dtype)));
    if (t.shape() != w.shape.static_dims())
      throw ValueError(fmt::format("init: weight '{}' has shape {}, expected {}", w.name, t.shape(),
                                   w.shape.static_dims()));
    if (!t.is_contiguous())
      throw ValueError(fmt::format("init: weight '{}' is not contiguous (shape {}, strides {})", w.name,
                                   t.shape(), t.strides()));
    if (t.device().kind != DeviceKind::CPU)
      throw ValueError(fmt::format("init: weight '{}' is on {}, expected a cpu device", w.name,
                                   t.device().to_string()));
  }
  for (const PlanValue& value : plan.values)
    if (value.kind == ValueKind::weight && !weights.count(value.weight))
      throw ValueError(fmt::format("init: graph '{}' needs weight '{}', which the registry lacks",
                                   plan.name, value.weight));
}

Executor::Executor(GraphPlan plan, const WeightsRegistry& weights, kernels::Parallel* parallel,
                   kernels::DeviceTeam* team, ProcessGroup* process_group)
    : plan_(std::move(plan)), parallel_(parallel), team_(team), process_group_(process_group) {
  const size_t num_values = plan_.values.size();
  bound_.resize(num_values);
  static_shapes_.resize(num_values);
  symbolic_shapes_.resize(num_values);
  std::map<std::string, int32_t> interned;  // a symbolic dim's text -> its index in symbolic_dims_
  for (size_t v = 0; v < num_values; ++v) {
    const graph::Shape& shape = graph::shape_of(plan_.values[v].type);
    if (shape.is_static()) {
      static_shapes_[v] = shape.static_dims();
      continue;
    }
    for (const graph::Dim& dim : shape) {
      if (auto size = dim.try_static()) {
        symbolic_shapes_[v].push_back({-1, *size});
        continue;
      }
      auto [it, fresh] = interned.emplace(dim.to_string(), static_cast<int32_t>(symbolic_dims_.size()));
      if (fresh) symbolic_dims_.push_back(dim);
      symbolic_shapes_[v].push_back({it->second, 0});
    }
  }
  for (size_t v = 0; v < num_values; ++v)
    if (plan_.values[v].kind == ValueKind::weight) bound_[v] = weights.at(plan_.values[v].weight);

  for (const Step& step : plan_.steps) {
    if (step.op == graph::Op::custom || step.op == graph::Op::inplace_custom)
      steps_.push_back({nullptr, has_symbolic_shape_attr(step.attrs), resolve_custom_op(plan_, step), nullptr});
    else
      steps_.push_back({resolve_kernel(plan_, step), has_symbolic_shape_attr(step.attrs), nullptr, nullptr});
  }

  for (const Step& step : plan_.constants) {
    StepInfo info{resolve_kernel(plan_, step), false, nullptr, nullptr};
    std::vector<kernels::TensorView> views;
    for (int32_t v : step.outputs) {
      const auto& type = plan_.values.at(v).type;
      if (!static_shapes_.at(v))
        throw ValueError(fmt::format("init: graph '{}' node {}: constant has symbolic shape {}",
                                     plan_.name, step.node, describe_type(type)));
      bound_[v] = Tensor::empty(graph::dtype_of(type), *static_shapes_[v], graph::device_of(type));
      views.push_back(view_of(bound_[v]));
    }
    launch(step, info, step.attrs, views);
  }
  bind_static_aliases();
  prepare_steps();
  slots_.resize(static_cast<size_t>(plan_.num_slots));

  // What run() reuses: one frame, each step's operand views and evaluated attributes.
  std::set<int32_t> returned;
  for (int32_t v : plan_.outputs)
    fresh_outputs_.push_back(plan_.values.at(static_cast<size_t>(v)).kind == ValueKind::output &&
                             returned.insert(v).second);
  frame_ = new_frame();
  inputs_.resize(plan_.input_types.size());
  step_views_.resize(plan_.steps.size());
  step_attrs_.resize(plan_.steps.size());
  for (size_t s = 0; s < plan_.steps.size(); ++s) {
    const Step& step = plan_.steps[s];
    step_views_[s].resize(step.inputs.size() + step.outputs.size());
    if (steps_[s].symbolic_attrs) step_attrs_[s] = step.attrs;
  }
}

void Executor::bind_static_aliases() {
  alias_offsets_.assign(plan_.aliases.size(), -1);
  for (size_t a = 0; a < plan_.aliases.size(); ++a) {
    const Step& step = plan_.aliases[a];
    const auto source = static_cast<size_t>(step.inputs.at(0));
    const auto v = static_cast<size_t>(step.outputs.at(0));
    if (!static_shapes_[source] || !static_shapes_[v] || has_symbolic_shape_attr(step.attrs)) continue;
    try {
      alias_offsets_[a] = alias_element_offset(step, *static_shapes_[source], *static_shapes_[v], {}) *
                          static_cast<int64_t>(dtype_size(graph::dtype_of(plan_.values[v].type)));
    } catch (const std::exception& e) {
      throw Error(fmt::format("init: graph '{}' op '{}' (node {}): {}", plan_.name, graph::op_name(step.op),
                              step.node, e.what()));
    }
    // A fixed window of fixed memory: bound once, so kernels can prepare state from it as from a weight.
    const Tensor& root = bound_[source];
    if (!root.defined()) continue;
    auto* data = static_cast<uint8_t*>(const_cast<void*>(root.data())) + alias_offsets_[a];
    bound_[v] = Tensor::view(std::make_shared<Tensor>(root), data, root.dtype(), *static_shapes_[v], {},
                             root.device());
  }
}

void Executor::prepare_steps() {
  for (size_t s = 0; s < plan_.steps.size(); ++s) {
    const Step& step = plan_.steps[s];
    if (steps_[s].custom) continue;
    const KernelKey key = kernel_key(plan_, step);
    kernels::PrepareFn prepare = kernels::cpu_kernels().find_prepare(step.op, key.device, key.dtype);
    if (!prepare) continue;
    std::vector<kernels::TensorView> views;
    auto fixed = std::make_unique<bool[]>(step.inputs.size());
    for (size_t i = 0; i < step.inputs.size(); ++i) {
      const auto v = static_cast<size_t>(step.inputs[i]);
      fixed[i] = bound_[v].defined();
      if (fixed[i]) {
        views.push_back(view_of(bound_[v]));
      } else {
        kernels::TensorView view;
        view.dtype = graph::dtype_of(plan_.values[v].type);
        if (static_shapes_[v]) {
          view.shape = *static_shapes_[v];
          view.strides = contiguous_strides(view.shape);
        }
        views.push_back(std::move(view));
      }
    }
    try {
      steps_[s].prepared = prepare(step.attrs, views, std::span<const bool>(fixed.get(), step.inputs.size()));
    } catch (const std::exception& e) {
      throw Error(fmt::format("init: graph '{}' op '{}' (node {}): preparing its operands: {}", plan_.name,
                              graph::op_name(step.op), step.node, e.what()));
    }
  }
}

// ---- one run ---------------------------------------------------------------------------------------

graph::SymbolBindings Executor::bind_inputs(const std::vector<Tensor>& inputs) const {
  struct Origin {
    size_t input, dim;
  };
  graph::SymbolBindings bindings;
  std::map<std::string, Origin> origins;
  std::vector<std::pair<size_t, size_t>> algebraic;  // (input, dim) checked once all symbols are bound
  for (size_t i = 0; i < inputs.size(); ++i) {
    const graph::Type& type = plan_.input_types[i];
    const graph::Shape& shape = graph::shape_of(type);
    for (size_t d = 0; d < static_cast<size_t>(shape.rank()); ++d) {
      const graph::Dim& dim = shape[static_cast<int64_t>(d)];
      int64_t actual = inputs[i].shape()[d];
      if (dim.is_static()) {
        if (actual != dim.static_value())
          throw ValueError(fmt::format("execute: input {} dim {} is {}, expected {} ({})", i, d, actual,
                                       dim.static_value(), describe_type(type)));
      } else if (dim.is_symbolic()) {
        auto [it, inserted] = bindings.emplace(dim.symbol(), actual);
        if (inserted) {
          origins[dim.symbol()] = {i, d};
        } else if (it->second != actual) {
          const Origin& o = origins.at(dim.symbol());
          throw ValueError(fmt::format(
              "execute: input {} dim {} is {} but symbol '{}' was bound to {} by input {} dim {}", i, d,
              actual, dim.symbol(), it->second, o.input, o.dim));
        }
      } else {
        algebraic.emplace_back(i, d);
      }
    }
  }
  for (auto [i, d] : algebraic) {
    const graph::Dim& dim = graph::shape_of(plan_.input_types[i])[static_cast<int64_t>(d)];
    for (const std::string& symbol : dim.symbols())
      if (!bindings.count(symbol))
        throw ValueError(fmt::format(
            "execute: input {} dim {} is '{}', but no input binds symbol '{}' by a plain dim", i, d,
            dim.to_string(), symbol));
    int64_t expected = dim.evaluate(bindings);
    int64_t actual = inputs[i].shape()[d];
    if (actual != expected)
      throw ValueError(fmt::format("execute: input {} dim {} is {}, expected {} = {} ({})", i, d, actual,
                                   dim.to_string(), expected, describe_type(plan_.input_types[i])));
  }
  return bindings;
}

void Executor::start_profiling() {
  profile_ = ModelProfile{};
  for (size_t s = 0; s < plan_.steps.size(); ++s) {
    const Step& step = plan_.steps[s];
    profile_.steps.push_back(StepProfile{
        steps_[s].custom ? steps_[s].custom->name() : std::string(graph::op_name(step.op)), step.node, 0, 0.0});
  }
  profiling_ = true;
}

void Executor::add_profiled_run(double seconds) const {
  ++profile_.runs;
  profile_.seconds += seconds;
}

ModelProfile Executor::profile() const { return profile_; }

void Executor::launch(const Step& step, const StepInfo& info, const graph::Attrs& attrs,
                      const std::vector<kernels::TensorView>& views) const {
  if (profiling_) {
    const auto start = std::chrono::steady_clock::now();
    launch_unprofiled(step, info, attrs, views);
    StepProfile& entry = profile_.steps[static_cast<size_t>(&step - plan_.steps.data())];
    ++entry.launches;
    entry.seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    return;
  }
  launch_unprofiled(step, info, attrs, views);
}

void Executor::launch_unprofiled(const Step& step, const StepInfo& info, const graph::Attrs& attrs,
                                 const std::vector<kernels::TensorView>& views) const {
  if (info.custom) return launch_custom(step, *info.custom, attrs, views);
  kernels::SerialParallel serial;
  kernels::KernelContext context{parallel_ ? parallel_ : &serial, team_, process_group_, info.prepared.get()};
  const size_t num_inputs = step.inputs.size();
  std::span<const kernels::TensorView> all(views);
  try {
    info.kernel(context, attrs, all.subspan(0, num_inputs), all.subspan(num_inputs));
  } catch (const std::exception& e) {
    throw ExecutionError(fmt::format("execute: graph '{}' op '{}' (node {}): {}", plan_.name,
                                     graph::op_name(step.op), step.node, e.what()));
  }
}

void Executor::launch_custom(const Step& step, const ext::CustomOp& op, const graph::Attrs& attrs,
                             const std::vector<kernels::TensorView>& views) const {
  // DLTensor views borrow the shapes and strides of `views`, which outlive the call.
  std::vector<DLTensor> tensors;
  for (const kernels::TensorView& v : views) {
    DLTensor t{};
    t.data = v.data;
    t.device = {kDLCPU, 0};
    t.ndim = static_cast<int32_t>(v.shape.size());
    t.dtype = ext::dl_dtype(v.dtype);
    t.shape = const_cast<int64_t*>(v.shape.data());
    t.strides = const_cast<int64_t*>(v.strides.data());
    tensors.push_back(t);
  }
  const auto num_inputs = static_cast<std::ptrdiff_t>(step.inputs.size());
  std::vector<DLTensor> inputs(tensors.begin(), tensors.begin() + num_inputs);
  std::vector<DLTensor> outputs(tensors.begin() + num_inputs, tensors.end());
  try {
    op.run(DeviceKind::CPU, inputs, outputs, attrs);
  } catch (const std::exception& e) {
    throw ExecutionError(fmt::format("execute: graph '{}' custom op '{}' (node {}): {}", plan_.name, op.name(),
                                     step.node, e.what()));
  }
}

void Executor::check_inputs(const std::vector<Tensor>& given, std::vector<Tensor>& inputs) const {
  const GraphPlan& plan = plan_;
  if (given.size() != plan.input_types.size())
    throw ValueError(fmt::format("execute: graph '{}' takes {} inputs, got {}", plan.name,
                                 plan.input_types.size(), given.size()));

  // Check each input against its declared type; pack non-contiguous tensors.
  inputs.resize(given.size());
  for (size_t i = 0; i < given.size(); ++i) {
    const Tensor& t = given[i];
    const graph::Type& type = plan.input_types[i];
    if (!t.defined())
      throw ValueError(fmt::format("execute: input {} is an undefined tensor, expected {}", i,
                                   describe_type(type)));
    if (t.dtype() != graph::dtype_of(type))
      throw ValueError(fmt::format("execute: input {} has dtype {}, expected {} ({})", i,
                                   dtype_name(t.dtype()), dtype_name(graph::dtype_of(type)),
                                   describe_type(type)));
    if (t.rank() != graph::shape_of(type).rank())
      throw ValueError(fmt::format("execute: input {} has rank {} (shape {}), expected rank {} ({})", i,
                                   t.rank(), t.shape(), graph::shape_of(type).rank(),
                                   describe_type(type)));
    if (t.device() != graph::device_of(type))
      throw ValueError(fmt::format("execute: input {} is on {}, expected {} ({})", i,
                                   t.device().to_string(), graph::device_of(type).to_string(),
                                   describe_type(type)));
    if (graph::is_buffer(type)) {
      if (!t.is_contiguous())
        throw ValueError(fmt::format(
            "execute: input {} is a buffer ({}) and must be contiguous to be written in place "
            "(shape {}, strides {})",
            i, describe_type(type), t.shape(), t.strides()));
      inputs[i] = t;
    } else {
      inputs[i] = t.is_contiguous() ? t : t.contiguous();
    }
  }
}

Executor::Frame Executor::new_frame() const {
  const size_t num_values = plan_.values.size();
  Frame frame;
  frame.tensors.resize(num_values);
  frame.views.resize(num_values);
  frame.slot_bytes.resize(static_cast<size_t>(plan_.num_slots));
  frame.dim_values.resize(symbolic_dims_.size());
  for (size_t v = 0; v < num_values; ++v) {
    kernels::TensorView& view = frame.views[v];
    if (bound_[v].defined()) {
      frame.tensors[v] = bound_[v];
      set_view(view, bound_[v]);
    } else if (static_shapes_[v]) {
      view.dtype = graph::dtype_of(plan_.values[v].type);
      view.shape = *static_shapes_[v];
      set_contiguous_strides(view);
    }
  }
  return frame;
}

void Executor::evaluate_symbolic_dims(Frame& frame) const {
  for (size_t i = 0; i < symbolic_dims_.size(); ++i) {
    try {
      frame.dim_values[i] = symbolic_dims_[i].evaluate(frame.bindings);
    } catch (const std::exception&) {
      frame.dim_values[i].reset();  // a value that needs it reports the error (evaluate_shape_checked)
    }
  }
}

void Executor::evaluate_shape_into(size_t value, const Frame& frame, kernels::TensorView& view) const {
  if (static_shapes_[value]) return evaluate_shape_checked(value, frame.bindings, view);
  const std::vector<ShapeDim>& dims = symbolic_shapes_[value];
  view.dtype = graph::dtype_of(plan_.values[value].type);
  view.shape.resize(dims.size());
  for (size_t d = 0; d < dims.size(); ++d) {
    const ShapeDim& dim = dims[d];
    if (dim.symbolic < 0) {
      view.shape[d] = dim.size;
    } else if (const std::optional<int64_t>& size = frame.dim_values[static_cast<size_t>(dim.symbolic)]) {
      view.shape[d] = *size;
    } else {
      return evaluate_shape_checked(value, frame.bindings, view);
    }
  }
  set_contiguous_strides(view);
}

void Executor::evaluate_shape_checked(size_t value, const graph::SymbolBindings& bindings,
                                      kernels::TensorView& view) const {
  view.dtype = graph::dtype_of(plan_.values[value].type);
  if (static_shapes_[value]) {
    if (view.shape != *static_shapes_[value]) view.shape = *static_shapes_[value];
  } else {
    const graph::Shape& shape = graph::shape_of(plan_.values[value].type);
    view.shape.resize(static_cast<size_t>(shape.rank()));
    for (size_t d = 0; d < view.shape.size(); ++d) {
      int64_t n = 0;
      try {
        n = evaluate_dim(shape[static_cast<int64_t>(d)], bindings);
      } catch (const std::exception& e) {
        throw ValueError(fmt::format("execute: graph '{}': cannot evaluate shape {} of value %{}: {}",
                                     plan_.name, shape.to_string(), value, e.what()));
      }
      if (n < 0)
        throw ValueError(fmt::format("execute: graph '{}': value %{} has shape {} = {}, which is negative",
                                     plan_.name, value, shape.to_string(), shape.evaluate(bindings)));
      view.shape[d] = n;
    }
  }
  set_contiguous_strides(view);
}

void Executor::prepare(const std::vector<Tensor>& inputs, std::vector<Tensor>& slots, Frame& frame) const {
  const GraphPlan& plan = plan_;
  frame.bindings = bind_inputs(inputs);
  evaluate_symbolic_dims(frame);

  // Memory for every value: the caller's inputs, bound weights and constants (set in new_frame),
  // fresh outputs, intermediates in arena slots sized for this run, then aliases into those.
  const size_t num_values = plan.values.size();
  auto& views = frame.views;
  std::fill(frame.slot_bytes.begin(), frame.slot_bytes.end(), size_t{0});
  for (size_t v = 0; v < num_values; ++v) {
    const PlanValue& value = plan.values[v];
    switch (value.kind) {
      case ValueKind::input: set_view(views[v], inputs.at(static_cast<size_t>(value.input))); break;
      case ValueKind::weight:
      case ValueKind::constant:
      case ValueKind::alias: break;
      case ValueKind::output:
        evaluate_shape_into(v, frame, views[v]);
        frame.tensors[v] = Tensor::empty(views[v].dtype, views[v].shape, graph::device_of(value.type));
        views[v].data = frame.tensors[v].data();
        break;
      case ValueKind::slot: {
        if (!static_shapes_[v]) evaluate_shape_into(v, frame, views[v]);
        auto bytes = static_cast<size_t>(views[v].numel()) * dtype_size(views[v].dtype);
        auto& needed = frame.slot_bytes.at(static_cast<size_t>(value.slot));
        needed = std::max(needed, bytes);
        break;
      }
    }
  }
  for (size_t s = 0; s < slots.size(); ++s) {
    auto capacity = slots[s].defined() ? slots[s].nbytes() : size_t{0};
    if (frame.slot_bytes[s] > capacity)
      slots[s] = Tensor::empty(DType::u8, {static_cast<int64_t>(std::max(frame.slot_bytes[s], capacity * 3 / 2))});
  }
  for (size_t v = 0; v < num_values; ++v)
    if (plan.values[v].kind == ValueKind::slot)
      views[v].data = slots[static_cast<size_t>(plan.values[v].slot)].data();
  for (size_t a = 0; a < plan.aliases.size(); ++a) resolve_alias(a, frame);
}

void Executor::resolve_alias(size_t alias, Frame& frame) const {
  const Step& step = plan_.aliases[alias];
  const auto v = static_cast<size_t>(step.outputs[0]);
  if (bound_[v].defined()) return;  // a fixed window of a weight or constant, set in new_frame
  const kernels::TensorView& source = frame.views[static_cast<size_t>(step.inputs[0])];
  kernels::TensorView& view = frame.views[v];
  int64_t offset = alias_offsets_[alias];
  if (!static_shapes_[v]) evaluate_shape_into(v, frame, view);
  if (offset < 0) {
    try {
      offset = alias_element_offset(step, source.shape, view.shape, frame.bindings) *
               static_cast<int64_t>(dtype_size(view.dtype));
    } catch (const std::exception& e) {
      throw ExecutionError(fmt::format("execute: graph '{}' op '{}' (node {}): {}", plan_.name,
                                       graph::op_name(step.op), step.node, e.what()));
    }
  }
  view.data = source.data ? static_cast<uint8_t*>(source.data) + offset : nullptr;
}

Tensor Executor::tensor_of(const Frame& frame, const std::vector<Tensor>& inputs, size_t value) const {
  const PlanValue& plan_value = plan_.values[value];
  if (plan_value.kind == ValueKind::input) return inputs.at(static_cast<size_t>(plan_value.input));
  if (frame.tensors[value].defined()) return frame.tensors[value];
  const kernels::TensorView& view = frame.views[value];
  return Tensor::borrow(view.data, view.dtype, view.shape, {}, graph::device_of(plan_value.type));
}

graph::Attrs Executor::evaluated_attrs(const Step& step, const graph::SymbolBindings& bindings) const {
  graph::Attrs attrs = step.attrs;
  for (auto& [name, attr] : attrs)
    if (auto* shape = std::get_if<graph::Shape>(&attr); shape && !shape->is_static()) {
      try {
        *shape = graph::Shape::of(shape->evaluate(bindings));
      } catch (const std::exception& e) {
        throw ValueError(fmt::format("execute: graph '{}' op '{}' (node {}): cannot evaluate {} {}: {}",
                                     plan_.name, graph::op_name(step.op), step.node, name,
                                     shape->to_string(), e.what()));
      }
    }
  return attrs;
}

void Executor::evaluate_attrs_into(const Step& step, const graph::SymbolBindings& bindings,
                                   graph::Attrs& attrs) const {
  // `attrs` is a copy of step.attrs from an earlier run: only dims whose value changed are rebuilt.
  auto out = attrs.begin();
  for (auto it = step.attrs.begin(); it != step.attrs.end(); ++it, ++out) {
    const auto* shape = std::get_if<graph::Shape>(&it->second);
    if (!shape || shape->is_static()) continue;
    auto& evaluated = std::get<graph::Shape>(out->second);
    for (int64_t d = 0; d < shape->rank(); ++d) {
      int64_t value = 0;
      try {
        value = evaluate_dim((*shape)[d], bindings);
      } catch (const std::exception& e) {
        throw ValueError(fmt::format("execute: graph '{}' op '{}' (node {}): cannot evaluate {} {}: {}",
                                     plan_.name, graph::op_name(step.op), step.node, it->first,
                                     shape->to_string(), e.what()));
      }
      if (evaluated[d].try_static() != value) evaluated[d] = graph::Dim(value);
    }
  }
}

std::vector<Tensor> Executor::run(const std::vector<Tensor>& given) {
  const GraphPlan& plan = plan_;
  check_inputs(given, inputs_);
  prepare(inputs_, slots_, frame_);
  const Frame& frame = frame_;

  // The steps, in order.
  for (size_t s = 0; s < plan.steps.size(); ++s) {
    const Step& step = plan.steps[s];
    std::vector<kernels::TensorView>& views = step_views_[s];
    size_t i = 0;
    for (int32_t v : step.inputs) views[i++] = frame.views[static_cast<size_t>(v)];
    for (int32_t v : step.outputs) views[i++] = frame.views[static_cast<size_t>(v)];
    if (!steps_[s].symbolic_attrs) {
      launch(step, steps_[s], step.attrs, views);
    } else {
      evaluate_attrs_into(step, frame.bindings, step_attrs_[s]);
      launch(step, steps_[s], step_attrs_[s], views);
    }
  }

  // Results: fresh memory, never the caller's inputs, the model's weights and constants or an alias
  // of them, and never the same memory twice.
  std::vector<Tensor> results;
  results.reserve(plan.outputs.size());
  for (size_t i = 0; i < plan.outputs.size(); ++i) {
    const auto v = static_cast<size_t>(plan.outputs[i]);
    results.push_back(fresh_outputs_[i] ? frame_.tensors[v] : tensor_of(frame_, inputs_, v).clone());
  }
  // Hold no caller memory between runs.
  for (size_t v = 0; v < plan.values.size(); ++v)
    if (plan.values[v].kind == ValueKind::output) frame_.tensors[v] = Tensor();
  for (Tensor& t : inputs_) t = Tensor();
  return results;
}

// ---- launch lists (capture/replay, device graphs) ------------------------------------------------

LaunchList Executor::record(const std::vector<Tensor>& given, bool run) {
  const GraphPlan& plan = plan_;
  LaunchList list;
  // The list owns its input buffers: replay copies new inputs into them, in place.
  std::vector<Tensor> checked;
  check_inputs(given, checked);
  for (const Tensor& t : checked) list.inputs.push_back(t.clone());
  list.slots.resize(slots_.size());
  Frame frame = new_frame();
  prepare(list.inputs, list.slots, frame);
  for (size_t s = 0; s < plan.steps.size(); ++s) {
    const Step& step = plan.steps[s];
    LaunchList::Launch launch_record{s, {}, {}};
    launch_record.attrs = steps_[s].symbolic_attrs ? evaluated_attrs(step, frame.bindings) : step.attrs;
    for (int32_t v : step.inputs) launch_record.views.push_back(frame.views[static_cast<size_t>(v)]);
    for (int32_t v : step.outputs) launch_record.views.push_back(frame.views[static_cast<size_t>(v)]);
    list.launches.push_back(std::move(launch_record));
  }
  for (size_t i = 0; i < plan.outputs.size(); ++i) {
    const auto v = static_cast<size_t>(plan.outputs[i]);
    if (fresh_outputs_[i]) {
      list.results.push_back(frame.tensors[v]);
    } else {
      // Inputs are the list's own copies, slots its own arena: the source stays valid while it lives.
      Tensor source = tensor_of(frame, list.inputs, v);
      list.results.push_back(Tensor::empty(source.dtype(), source.shape(), source.device()));
      list.copied_results.emplace_back(std::move(source), list.results.size() - 1);
    }
  }
  if (!run) return list;
  // The first run, through the same path every replay takes.
  for (const LaunchList::Launch& l : list.launches) launch(plan.steps[l.step], steps_[l.step], l.attrs, l.views);
  for (const auto& [source, index] : list.copied_results)
    copy_bytes(list.results[index], source);
  for (size_t i = 0; i < given.size(); ++i)
    if (graph::is_buffer(plan.input_types[i])) copy_bytes(given[i], list.inputs[i]);
  return list;
}

void Executor::replay(LaunchList& list, const std::vector<Tensor>& given) const {
  const GraphPlan& plan = plan_;
  if (given.size() != list.inputs.size())
    throw ValueError(fmt::format("replay: graph '{}' takes {} inputs, got {}", plan.name, list.inputs.size(),
                                 given.size()));
  for (size_t i = 0; i < given.size(); ++i) {
    const Tensor& t = given[i];
    const Tensor& captured = list.inputs[i];
    if (!t.defined() || t.dtype() != captured.dtype() || t.shape() != captured.shape() ||
        t.device() != captured.device())
      throw ValueError(fmt::format(
          "replay: graph '{}' input {} is {}{}, but the launch list was captured with {}{} (capture again "
          "for another shape)",
          plan.name, i, t.defined() ? dtype_name(t.dtype()) : "undefined",
          t.defined() ? fmt::format("{}", t.shape()) : "", dtype_name(captured.dtype()), captured.shape()));
    if (graph::is_buffer(plan.input_types[i]) && !t.is_contiguous())
      throw ValueError(fmt::format("replay: graph '{}' input {} is a buffer and must be contiguous", plan.name, i));
  }
  for (size_t i = 0; i < given.size(); ++i)
    copy_bytes(list.inputs[i], given[i].is_contiguous() ? given[i] : given[i].contiguous());
  for (const LaunchList::Launch& l : list.launches) launch(plan.steps[l.step], steps_[l.step], l.attrs, l.views);
  for (const auto& [source, index] : list.copied_results)
    copy_bytes(list.results[index], source);
  // Buffers are written in place: the caller's buffer gets what the graph wrote to the captured copy.
  for (size_t i = 0; i < given.size(); ++i)
    if (graph::is_buffer(plan.input_types[i])) copy_bytes(given[i], list.inputs[i]);
}

}  // namespace kiln::engine
