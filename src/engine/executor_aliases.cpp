// Aliases: values that are windows of another value's memory (docs/memory-planning.md). A window
// fixed for every run is computed at init (and bound, when its root is fixed memory); the others
// are resolved per run from the interned dims of their bounds.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include "engine/executor.h"
#include "engine/executor_util.h"
#include "kiln/errors.h"

namespace kiln::engine {

using compiler::Step;

int64_t alias_element_offset(graph::Op op, const std::vector<int64_t>& source, const std::vector<int64_t>& result,
                             const std::vector<int64_t>& starts, const std::vector<int64_t>& stops,
                             const std::vector<int64_t>& steps) {
  const std::string_view name = graph::op_name(op);
  if (op == graph::Op::reshape) {
    if (product(source) != product(result))
      throw ShapeError(fmt::format("reshape: input {} has {} elements but the result {} has {}", source,
                                   product(source), result, product(result)));
    return 0;
  }
  const size_t rank = source.size();
  const size_t bounded = starts.size();
  if (bounded > rank || stops.size() != bounded || steps.size() != bounded)
    throw ExecutionError(fmt::format("{}: {} starts, {} stops and {} steps for a tensor of rank {}", name, bounded,
                                     stops.size(), steps.size(), rank));
  if (result.size() != rank)
    throw ShapeError(fmt::format("{}: the result {} does not have the source's rank {}", name, result, rank));
  int64_t offset = 0, stride = product(source);
  bool contiguous = true, range_seen = false;
  for (size_t d = 0; d < rank; ++d) {
    const int64_t size = source[d];
    stride = size ? stride / size : 0;
    int64_t start = 0, stop = size, step_size = 1;
    if (d < bounded) start = starts[d], stop = stops[d], step_size = steps[d];
    if (step_size < 1)
      throw ExecutionError(fmt::format("{}: step {} of axis {} must be at least 1", name, step_size, d));
    if (start < 0 || start > stop || stop > size)
      throw ExecutionError(
          fmt::format("{}: slice {}:{} of axis {} is out of bounds for size {}", name, start, stop, d, size));
    const int64_t extent = stop > start ? (stop - start + step_size - 1) / step_size : 0;
    if (extent != result[d])
      throw ShapeError(fmt::format("{}: the slice has {} elements on axis {} but the result has shape {}", name,
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
                                     name, source));
  return offset;
}

void Executor::bind_static_aliases() {
  aliases_.resize(plan_.aliases.size());
  for (size_t a = 0; a < plan_.aliases.size(); ++a) {
    const Step& step = plan_.aliases[a];
    AliasInfo& info = aliases_[a];
    bool static_bounds = true;
    if (step.op != graph::Op::reshape && step.attrs.count("starts")) {
      const auto& starts = graph::get_attr<graph::Shape>(step.attrs, "starts", step.op);
      const auto& stops = graph::get_attr<graph::Shape>(step.attrs, "stops", step.op);
      info.steps = graph::get_attr<std::vector<int64_t>>(step.attrs, "steps", step.op);
      static_bounds = starts.is_static() && stops.is_static();
      Interner slots(*this, &info.dim_slots);
      const kernels::KernelInit bounds{step.op, &step.attrs, {}, {}, &slots};
      info.starts = bounds.dims(starts);
      info.stops = bounds.dims(stops);
    }
    const auto source = static_cast<size_t>(step.inputs.at(0));
    const auto v = static_cast<size_t>(step.outputs.at(0));
    if (!static_shapes_[source] || !static_shapes_[v] || !static_bounds) continue;
    std::vector<int64_t> starts, stops;
    for (const auto& r : info.starts) starts.push_back(r.value);
    for (const auto& r : info.stops) stops.push_back(r.value);
    try {
      info.static_offset = alias_element_offset(step.op, *static_shapes_[source], *static_shapes_[v], starts, stops,
                                                info.steps) *
                           static_cast<int64_t>(dtype_size(graph::dtype_of(plan_.values[v].type)));
    } catch (const std::exception& e) {
      throw Error(fmt::format("init: graph '{}' op '{}' (node {}): {}", plan_.name, graph::op_name(step.op),
                              step.node, e.what()));
    }
    // A fixed window of fixed memory: bound once, so kernels can prepare state from it as from a weight.
    const Tensor& root = bound_[source];
    if (!root.defined()) continue;
    auto* data = static_cast<uint8_t*>(const_cast<void*>(root.data())) + info.static_offset;
    bound_[v] = Tensor::view(std::make_shared<Tensor>(root), data, root.dtype(), *static_shapes_[v], {},
                             root.device());
  }
}

void Executor::resolve_alias(size_t alias, Frame& frame) const {
  const Step& step = plan_.aliases[alias];
  const AliasInfo& info = aliases_[alias];
  const auto v = static_cast<size_t>(step.outputs[0]);
  if (bound_[v].defined()) return;  // a fixed window of a weight or constant, set in new_frame
  const kernels::TensorView& source = frame.views[static_cast<size_t>(step.inputs[0])];
  kernels::TensorView& view = frame.views[v];
  int64_t offset = info.static_offset;
  if (!static_shapes_[v]) evaluate_shape_into(v, frame, view);
  if (offset < 0) {
    thread_local std::vector<int64_t> starts, stops;  // scratch only: no state survives the call
    check_dims(step, info.dim_slots, frame);
    kernels::KernelContext ctx;
    ctx.dims = frame.dims;
    kernels::resolve(ctx, info.starts, starts);
    kernels::resolve(ctx, info.stops, stops);
    try {
      offset = alias_element_offset(step.op, source.shape, view.shape, starts, stops, info.steps) *
               static_cast<int64_t>(dtype_size(view.dtype));
    } catch (const std::exception& e) {
      throw ExecutionError(fmt::format("execute: graph '{}' op '{}' (node {}): {}", plan_.name,
                                       graph::op_name(step.op), step.node, e.what()));
    }
  }
  view.data = source.data ? static_cast<uint8_t*>(source.data) + offset : nullptr;
}

}  // namespace kiln::engine
