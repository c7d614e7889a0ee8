// Building an executor at init: weights bound, symbolic dims interned, constants materialised, one
// kernel object per step, fixed alias windows bound.
#include <algorithm>
#include <set>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "engine/executor.h"
#include "engine/executor_util.h"
#include "kiln/errors.h"
#include "tensor/host_memory.h"

namespace kiln::engine {

using compiler::GraphPlan;
using compiler::PlanValue;
using compiler::Step;
using compiler::ValueKind;

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
    if (t.device().kind != w.device.kind)
      throw ValueError(fmt::format("init: weight '{}' is on {}, expected a {} device", w.name,
                                   t.device().to_string(), device_kind_name(w.device.kind)));
  }
  for (const PlanValue& value : plan.values)
    if (value.kind == ValueKind::weight && !weights.count(value.weight))
      throw ValueError(fmt::format("init: graph '{}' needs weight '{}', which the registry lacks",
                                   plan.name, value.weight));
}

Executor::Executor(GraphPlan plan, const WeightsRegistry& weights, const Backends& backends,
                   ProcessGroup* process_group, const WeightCache* weight_cache)
    : plan_(std::move(plan)), backends_(backends), process_group_(process_group), weight_cache_(weight_cache) {
  const size_t num_values = plan_.values.size();
  bound_.resize(num_values);
  for (size_t v = 0; v < num_values; ++v)
    if (plan_.values[v].kind == ValueKind::weight) bound_[v] = weights.at(plan_.values[v].weight);
  intern_shapes();
  bind_constants();
  bind_static_aliases();
  build_kernels();

  std::set<int32_t> returned;
  for (int32_t v : plan_.outputs)
    fresh_outputs_.push_back(plan_.values.at(static_cast<size_t>(v)).kind == ValueKind::output &&
                             returned.insert(v).second);
  step_counters_ = std::make_unique<StepCounters[]>(plan_.steps.size());
  slot_devices_.resize(static_cast<size_t>(plan_.num_slots));
  for (const PlanValue& value : plan_.values)
    if (value.kind == ValueKind::slot) slot_devices_.at(static_cast<size_t>(value.slot)) = graph::device_of(value.type);
}

Executor::~Executor() = default;

void Executor::intern_shapes() {
  const size_t num_values = plan_.values.size();
  static_shapes_.resize(num_values);
  symbolic_shapes_.resize(num_values);
  Interner interner(*this, nullptr);
  for (size_t v = 0; v < num_values; ++v) {
    const graph::Shape& shape = graph::shape_of(plan_.values[v].type);
    if (shape.is_static()) {
      static_shapes_[v] = shape.static_dims();
      continue;
    }
    for (const graph::Dim& dim : shape) {
      if (auto size = dim.try_static())
        symbolic_shapes_[v].push_back({-1, *size});
      else
        symbolic_shapes_[v].push_back({interner.slot_of(dim), 0});
    }
  }
}

// Constants are made once, here, by their own kernels.
void Executor::bind_constants() {
  for (const Step& step : plan_.constants) {
    std::vector<kernels::TensorView> views;
    for (int32_t v : step.outputs) {
      const auto& type = plan_.values.at(v).type;
      if (!static_shapes_.at(v))
        throw ValueError(fmt::format("init: graph '{}' node {}: constant has symbolic shape {}", plan_.name,
                                     step.node, graph::to_string(type)));
      const Backend& backend = backends_.at(graph::device_of(type).kind);
      bound_[v] = backend.allocate(graph::dtype_of(type), *static_shapes_[v], graph::device_of(type));
      views.push_back(view_of(bound_[v]));
    }
    const Backend& backend = backends_.at(step.kernel.device);
    const kernels::KernelInit init{step.op, &step.attrs, {}, {}, nullptr};
    std::unique_ptr<const kernels::Kernel> kernel;
    try {
      kernel = backend.kernels().build(step.kernel, init);
    } catch (const std::exception& e) {
      throw ExecutionError(fmt::format("init: graph '{}' op '{}' (node {}): {}", plan_.name,
                                       graph::op_name(step.op), step.node, e.what()));
    }
    if (!kernel)
      throw Error(fmt::format("init: graph '{}' node {}: no {} kernel", plan_.name, step.node, step.kernel.to_string()));
    StepInfo info{std::move(kernel), {}, {}, std::string(graph::op_name(step.op)), {}};
    info.context.parallel = backend.parallel();
    info.context.team = backend.team();
    try {
      info.kernel->run(info.context, {}, views);
    } catch (const std::exception& e) {
      throw ExecutionError(fmt::format("init: graph '{}' op '{}' (node {}): {}", plan_.name,
                                       graph::op_name(step.op), step.node, e.what()));
    }
  }
}

void Executor::build_kernels() {
  for (size_t s = 0; s < plan_.steps.size(); ++s) {
    const Step& step = plan_.steps[s];
    StepInfo info;
    const Backend* backend = backends_.find(step.kernel.device);
    if (!backend)
      throw Error(fmt::format("init: graph '{}' node {}: no backend runs {} devices in this session", plan_.name,
                              step.node, device_kind_name(step.kernel.device)));
    info.context.parallel = backend->parallel();
    info.context.team = backend->team();
    info.context.process_group = process_group_;
    const bool custom = step.op == graph::Op::custom || step.op == graph::Op::inplace_custom;
    info.label = custom ? graph::get_attr<std::string>(step.attrs, "symbol", step.op) : std::string(graph::op_name(step.op));
    // Operands fixed for the model's life (weights, constants, fixed windows of them) with their data;
    // the others with their static shape, if any.
    std::vector<kernels::TensorView> views;
    auto fixed = std::make_unique<bool[]>(step.inputs.size());
    for (size_t i = 0; i < step.inputs.size(); ++i) {
      const auto v = static_cast<size_t>(step.inputs[i]);
      fixed[i] = bound_[v].defined();
      if (fixed[i]) {
        views.push_back(view_of(bound_[v]));
        continue;
      }
      kernels::TensorView view;
      view.dtype = graph::dtype_of(plan_.values[v].type);
      if (static_shapes_[v]) {
        view.shape = *static_shapes_[v];
        view.strides = contiguous_strides(view.shape);
      }
      views.push_back(std::move(view));
    }
    Interner interner(*this, &info.dim_slots);
    kernels::KernelInit init{step.op, &step.attrs, views, std::span<const bool>(fixed.get(), step.inputs.size()),
                             &interner};
    init.parallel = info.context.parallel;
    // Bytes of a weight the kernel now runs on a copy of: where they are pages of a mapped file they
    // are dropped at once, so the process never holds the file and the copies together (another
    // reader, e.g. a tied embedding's gather, reads back what it touches).
    init.copied = [&](size_t i, const void* data, size_t bytes) {
      const auto v = static_cast<size_t>(step.inputs.at(i));
      const auto* first = static_cast<const uint8_t*>(bound_[v].data());
      const auto* p = static_cast<const uint8_t*>(data);
      if (!fixed[i] || plan_.values[v].kind != ValueKind::weight || p < first || bytes > bound_[v].nbytes() ||
          static_cast<size_t>(p - first) > bound_[v].nbytes() - bytes)
        return;  // only a weight's own bytes
      copied_weights_.push_back(plan_.values[v].weight);
      drop_file_pages(bound_[v].keep_alive(), data, bytes);
    };
    // A weight mapped from a file (or derived from one): its packed copies are kept in the weight
    // cache, keyed by where it comes from.
    if (weight_cache_)
      init.packed_copies = [&](size_t i) -> kernels::PackedCopies {
        const auto v = static_cast<size_t>(step.inputs.at(i));
        if (!fixed[i] || plan_.values[v].kind != ValueKind::weight) return {};
        std::optional<std::string> source = mapped_source(bound_[v].keep_alive(), bound_[v].data(), bound_[v].nbytes());
        if (!source) return {};
        const WeightCache* cache = weight_cache_;
        WeightCache::ForEach for_each;  // the checksums on the launches' threads
        if (kernels::Parallel* parallel = info.context.parallel)
          for_each = [parallel](size_t count, const std::function<void(size_t)>& body) {
            parallel->for_range(static_cast<int64_t>(count), 1, [&](int64_t begin, int64_t end) {
              for (int64_t i = begin; i < end; ++i) body(static_cast<size_t>(i));
            });
          };
        return {[cache, source = *source, for_each](std::string_view packing, size_t bytes) -> kernels::PackedBuffer {
          WeightCache::Entry e = cache->acquire(WeightCache::key(source, packing), bytes, for_each);
          return {std::move(e.data), e.filled, std::move(e.commit)};
        }};
      };
    try {
      if (custom)
        info.kernel = make_custom_kernel(plan_, step);
      else
        info.kernel = backend->kernels().build(step.kernel, init);
    } catch (const ExtensionError&) {
      throw;  // names the graph, node and library already
    } catch (const std::exception& e) {
      // What a kernel refuses in its parameters, as the launch would have refused it.
      throw ExecutionError(fmt::format("init: graph '{}' op '{}' (node {}): {}", plan_.name,
                                       graph::op_name(step.op), step.node, e.what()));
    }
    if (!info.kernel)
      throw Error(fmt::format("init: graph '{}' node {}: no {} kernel for {} on {}", plan_.name, step.node,
                              device_kind_name(step.kernel.device), graph::op_name(step.op),
                              dtype_name(step.kernel.dtype)));
    // A weight's or constant's view never changes; a static shape's only in its data pointer (a slot
    // grows, an output is fresh each run); an input's and a symbolic shape's wholly.
    auto refresh_of = [&](int32_t value) {
      const auto v = static_cast<size_t>(value);
      if (bound_[v].defined()) return StepInfo::Refresh::none;
      if (plan_.values[v].kind == ValueKind::input || !static_shapes_[v]) return StepInfo::Refresh::view;
      return StepInfo::Refresh::data;
    };
    for (int32_t v : step.inputs) info.refresh.push_back(refresh_of(v));
    for (int32_t v : step.outputs) info.refresh.push_back(refresh_of(v));

    steps_.push_back(std::move(info));
  }
  std::sort(copied_weights_.begin(), copied_weights_.end());
  copied_weights_.erase(std::unique(copied_weights_.begin(), copied_weights_.end()), copied_weights_.end());
}

std::unique_ptr<Executor::Frame> Executor::new_frame() const {
  const size_t num_values = plan_.values.size();
  auto frame = std::make_unique<Frame>();
  frame->inputs.resize(plan_.input_types.size());
  frame->tensors.resize(num_values);
  frame->views.resize(num_values);
  frame->slots.resize(static_cast<size_t>(plan_.num_slots));
  frame->slot_bytes.resize(static_cast<size_t>(plan_.num_slots));
  frame->dims.resize(symbolic_dims_.size());
  frame->dim_failed.resize(symbolic_dims_.size());
  for (size_t v = 0; v < num_values; ++v) {
    kernels::TensorView& view = frame->views[v];
    if (bound_[v].defined()) {
      frame->tensors[v] = bound_[v];
      set_view(view, bound_[v]);
    } else if (static_shapes_[v]) {
      view.dtype = graph::dtype_of(plan_.values[v].type);
      view.shape = *static_shapes_[v];
      set_contiguous_strides(view);
    }
  }
  // Each step's list starts as its values' views: what never changes (weights, static shapes) is
  // set once here, and a run copies only what it changes (StepInfo::refresh).
  frame->step_views.resize(plan_.steps.size());
  for (size_t s = 0; s < plan_.steps.size(); ++s) {
    for (int32_t v : plan_.steps[s].inputs) frame->step_views[s].push_back(frame->views[static_cast<size_t>(v)]);
    for (int32_t v : plan_.steps[s].outputs) frame->step_views[s].push_back(frame->views[static_cast<size_t>(v)]);
  }
  return frame;
}

kernels::KernelContext Executor::context(const StepInfo& step, std::span<const int64_t> dims) {
  kernels::KernelContext ctx = step.context;
  ctx.dims = dims;
  return ctx;
}

}  // namespace kiln::engine
