#include "engine/executor.h"

#include <algorithm>
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
  kernels::KernelFn fn = kernels::builtin_kernels().find(step.op, key.device, key.dtype);
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
  for (size_t v = 0; v < num_values; ++v) {
    const graph::Shape& shape = graph::shape_of(plan_.values[v].type);
    if (shape.is_static()) static_shapes_[v] = shape.static_dims();
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
  prepare_steps();
  slots_.resize(static_cast<size_t>(plan_.num_slots));
}

void Executor::prepare_steps() {
  for (size_t s = 0; s < plan_.steps.size(); ++s) {
    const Step& step = plan_.steps[s];
    if (steps_[s].custom) continue;
    const KernelKey key = kernel_key(plan_, step);
    kernels::PrepareFn prepare = kernels::builtin_kernels().find_prepare(step.op, key.device, key.dtype);
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

std::vector<int64_t> Executor::value_shape(size_t value, const graph::SymbolBindings& bindings) const {
  if (static_shapes_[value]) return *static_shapes_[value];
  const graph::Shape& shape = graph::shape_of(plan_.values[value].type);
  std::vector<int64_t> dims;
  try {
    dims = shape.evaluate(bindings);
  } catch (const std::exception& e) {
    throw ValueError(fmt::format("execute: graph '{}': cannot evaluate shape {} of value %{}: {}",
                                 plan_.name, shape.to_string(), value, e.what()));
  }
  for (int64_t d : dims)
    if (d < 0)
      throw ValueError(fmt::format("execute: graph '{}': value %{} has shape {} = {}, which is negative",
                                   plan_.name, value, shape.to_string(), dims));
  return dims;
}

void Executor::launch(const Step& step, const StepInfo& info, const graph::Attrs& attrs,
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

std::vector<Tensor> Executor::check_inputs(const std::vector<Tensor>& given) const {
  const GraphPlan& plan = plan_;
  if (given.size() != plan.input_types.size())
    throw ValueError(fmt::format("execute: graph '{}' takes {} inputs, got {}", plan.name,
                                 plan.input_types.size(), given.size()));

  // Check each input against its declared type; pack non-contiguous tensors.
  std::vector<Tensor> inputs(given.size());
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
  return inputs;
}

Executor::Frame Executor::prepare(const std::vector<Tensor>& inputs, std::vector<Tensor>& slots) const {
  const GraphPlan& plan = plan_;
  Frame frame;
  frame.bindings = bind_inputs(inputs);

  // Memory for every value: the caller's inputs, bound weights and constants, fresh outputs, and
  // intermediates in arena slots sized for this run.
  const size_t num_values = plan.values.size();
  auto& tensors = frame.tensors;
  auto& views = frame.views;
  tensors.resize(num_values);
  views.resize(num_values);
  std::vector<size_t> slot_bytes(slots.size(), 0);
  for (size_t v = 0; v < num_values; ++v) {
    const PlanValue& value = plan.values[v];
    switch (value.kind) {
      case ValueKind::input: tensors[v] = inputs.at(static_cast<size_t>(value.input)); break;
      case ValueKind::weight:
      case ValueKind::constant: tensors[v] = bound_[v]; break;
      case ValueKind::output:
        tensors[v] = Tensor::empty(graph::dtype_of(value.type), value_shape(v, frame.bindings),
                                   graph::device_of(value.type));
        break;
      case ValueKind::slot: {
        views[v].dtype = graph::dtype_of(value.type);
        views[v].shape = value_shape(v, frame.bindings);
        views[v].strides = contiguous_strides(views[v].shape);
        auto bytes = static_cast<size_t>(views[v].numel()) * dtype_size(views[v].dtype);
        auto& needed = slot_bytes.at(static_cast<size_t>(value.slot));
        needed = std::max(needed, bytes);
        continue;
      }
    }
    if (tensors[v].defined()) views[v] = view_of(tensors[v]);
  }
  for (size_t s = 0; s < slots.size(); ++s) {
    auto capacity = slots[s].defined() ? slots[s].nbytes() : size_t{0};
    if (slot_bytes[s] > capacity)
      slots[s] = Tensor::empty(DType::u8, {static_cast<int64_t>(std::max(slot_bytes[s], capacity * 3 / 2))});
  }
  for (size_t v = 0; v < num_values; ++v)
    if (plan.values[v].kind == ValueKind::slot && slots[static_cast<size_t>(plan.values[v].slot)].defined())
      views[v].data = slots[static_cast<size_t>(plan.values[v].slot)].data();
  return frame;
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

std::vector<Tensor> Executor::run(const std::vector<Tensor>& given) {
  const GraphPlan& plan = plan_;
  const Frame frame = prepare(check_inputs(given), slots_);

  // The steps, in order.
  std::vector<kernels::TensorView> step_views;
  for (size_t s = 0; s < plan.steps.size(); ++s) {
    const Step& step = plan.steps[s];
    step_views.clear();
    for (int32_t v : step.inputs) step_views.push_back(frame.views[static_cast<size_t>(v)]);
    for (int32_t v : step.outputs) step_views.push_back(frame.views[static_cast<size_t>(v)]);
    if (!steps_[s].symbolic_attrs)
      launch(step, steps_[s], step.attrs, step_views);
    else
      launch(step, steps_[s], evaluated_attrs(step, frame.bindings), step_views);
  }

  // Results: fresh memory, never the caller's inputs or the model's weights and constants, and never
  // the same memory twice.
  std::vector<Tensor> results;
  std::set<int32_t> returned;
  for (int32_t v : plan.outputs) {
    const Tensor& t = frame.tensors.at(static_cast<size_t>(v));
    bool fresh = plan.values.at(static_cast<size_t>(v)).kind == ValueKind::output;
    results.push_back(fresh && returned.insert(v).second ? t : t.clone());
  }
  return results;
}

// ---- launch lists (capture/replay, device graphs) ------------------------------------------------

LaunchList Executor::record(const std::vector<Tensor>& given, bool run) {
  const GraphPlan& plan = plan_;
  LaunchList list;
  // The list owns its input buffers: replay copies new inputs into them, in place.
  for (const Tensor& t : check_inputs(given)) list.inputs.push_back(t.clone());
  list.slots.resize(slots_.size());
  const Frame frame = prepare(list.inputs, list.slots);
  for (size_t s = 0; s < plan.steps.size(); ++s) {
    const Step& step = plan.steps[s];
    LaunchList::Launch launch_record{s, {}, {}};
    launch_record.attrs = steps_[s].symbolic_attrs ? evaluated_attrs(step, frame.bindings) : step.attrs;
    for (int32_t v : step.inputs) launch_record.views.push_back(frame.views[static_cast<size_t>(v)]);
    for (int32_t v : step.outputs) launch_record.views.push_back(frame.views[static_cast<size_t>(v)]);
    list.launches.push_back(std::move(launch_record));
  }
  std::set<int32_t> returned;
  for (int32_t v : plan.outputs) {
    const Tensor& t = frame.tensors.at(static_cast<size_t>(v));
    bool fresh = plan.values.at(static_cast<size_t>(v)).kind == ValueKind::output;
    if (fresh && returned.insert(v).second) {
      list.results.push_back(t);
    } else {
      list.copied_results.emplace_back(t, list.results.size());
      list.results.push_back(Tensor::empty(t.dtype(), t.shape(), t.device()));
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
