// A run's inputs and shapes: inputs checked against the plan, symbolic dims bound and each interned
// dim evaluated once, every value's memory for this run.
#include <algorithm>
#include <map>
#include <string>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "engine/executor.h"
#include "engine/executor_util.h"
#include "kiln/errors.h"

namespace kiln::engine {

using compiler::GraphPlan;
using compiler::PlanValue;
using compiler::Step;
using compiler::ValueKind;

namespace {

std::string describe_type(const graph::Type& type) { return graph::to_string(type); }

int64_t evaluate_dim(const graph::Dim& dim, const graph::SymbolBindings& bindings) {
  if (auto value = dim.try_static()) return *value;
  return dim.evaluate(bindings);
}

}  // namespace

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

void Executor::bind_inputs(const std::vector<Tensor>& inputs, graph::SymbolBindings& bindings) const {
  // The first input dim that binds `symbol`, for the error naming where its value came from.
  auto origin = [&](const std::string& symbol) {
    for (size_t i = 0; i < inputs.size(); ++i) {
      const graph::Shape& shape = graph::shape_of(plan_.input_types[i]);
      for (int64_t d = 0; d < shape.rank(); ++d)
        if (shape[d].is_symbolic() && shape[d].symbol() == symbol) return std::pair<size_t, int64_t>{i, d};
    }
    return std::pair<size_t, int64_t>{0, 0};
  };
  bindings.clear();
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
        if (!inserted && it->second != actual) {
          const auto [input, input_dim] = origin(dim.symbol());
          throw ValueError(fmt::format(
              "execute: input {} dim {} is {} but symbol '{}' was bound to {} by input {} dim {}", i, d,
              actual, dim.symbol(), it->second, input, input_dim));
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
}

void Executor::evaluate_symbolic_dims(Frame& frame) const {
  frame.any_dim_failed = false;
  for (size_t i = 0; i < symbolic_dims_.size(); ++i) {
    try {
      frame.dims[i] = symbolic_dims_[i].evaluate(frame.bindings);
      frame.dim_failed[i] = 0;
    } catch (const std::exception&) {
      // A value or kernel that needs it reports the error (evaluate_shape_checked, check_dims).
      frame.dims[i] = 0;
      frame.dim_failed[i] = 1;
      frame.any_dim_failed = true;
    }
  }
}

void Executor::check_dims(const Step& step, const std::vector<int32_t>& slots, const Frame& frame) const {
  if (!frame.any_dim_failed) return;
  for (int32_t slot : slots) {
    if (!frame.dim_failed[static_cast<size_t>(slot)]) continue;
    const graph::Dim& dim = symbolic_dims_[static_cast<size_t>(slot)];
    try {
      dim.evaluate(frame.bindings);
    } catch (const std::exception& e) {
      throw ValueError(fmt::format("execute: graph '{}' op '{}' (node {}): cannot evaluate {}: {}", plan_.name,
                                   graph::op_name(step.op), step.node, dim.to_string(), e.what()));
    }
  }
}

void Executor::evaluate_shape_into(size_t value, const Frame& frame, kernels::TensorView& view) const {
  if (static_shapes_[value]) return evaluate_shape_checked(value, frame.bindings, view);
  const kernels::DimRefs& dims = symbolic_shapes_[value];
  view.dtype = graph::dtype_of(plan_.values[value].type);
  view.shape.resize(dims.size());
  for (size_t d = 0; d < dims.size(); ++d) {
    const kernels::DimRef& dim = dims[d];
    if (dim.slot < 0) {
      view.shape[d] = dim.value;
      continue;
    }
    const auto slot = static_cast<size_t>(dim.slot);
    if (frame.dim_failed[slot] || frame.dims[slot] < 0) return evaluate_shape_checked(value, frame.bindings, view);
    view.shape[d] = frame.dims[slot];
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

void Executor::prepare(Frame& frame) const {
  const GraphPlan& plan = plan_;
  bind_inputs(frame.inputs, frame.bindings);
  evaluate_symbolic_dims(frame);

  // Memory for every value: the caller's inputs, bound weights and constants (set in new_frame),
  // fresh outputs, intermediates in arena slots sized for this run, then aliases into those.
  const size_t num_values = plan.values.size();
  auto& views = frame.views;
  std::fill(frame.slot_bytes.begin(), frame.slot_bytes.end(), size_t{0});
  for (size_t v = 0; v < num_values; ++v) {
    const PlanValue& value = plan.values[v];
    switch (value.kind) {
      case ValueKind::input: set_view(views[v], frame.inputs.at(static_cast<size_t>(value.input))); break;
      case ValueKind::weight:
      case ValueKind::constant:
      case ValueKind::alias: break;
      case ValueKind::output: {
        evaluate_shape_into(v, frame, views[v]);
        const DeviceRef device = graph::device_of(value.type);
        frame.tensors[v] = backends_.at(device.kind).allocate(views[v].dtype, views[v].shape, device);
        views[v].data = const_cast<void*>(frame.tensors[v].data());
        break;
      }
      case ValueKind::slot: {
        if (!static_shapes_[v]) evaluate_shape_into(v, frame, views[v]);
        auto bytes = static_cast<size_t>(views[v].numel()) * dtype_size(views[v].dtype);
        auto& needed = frame.slot_bytes.at(static_cast<size_t>(value.slot));
        needed = std::max(needed, bytes);
        break;
      }
    }
  }
  for (size_t s = 0; s < frame.slots.size(); ++s) {
    auto capacity = frame.slots[s].defined() ? frame.slots[s].nbytes() : size_t{0};
    if (frame.slot_bytes[s] > capacity)
      frame.slots[s] = backends_.at(slot_devices_[s].kind)
                           .allocate(DType::u8, {static_cast<int64_t>(std::max(frame.slot_bytes[s], capacity * 3 / 2))},
                                     slot_devices_[s]);
  }
  for (size_t v = 0; v < num_values; ++v)
    if (plan.values[v].kind == ValueKind::slot)
      views[v].data = const_cast<void*>(frame.slots[static_cast<size_t>(plan.values[v].slot)].data());
  for (size_t a = 0; a < plan.aliases.size(); ++a) resolve_alias(a, frame);
}

}  // namespace kiln::engine
