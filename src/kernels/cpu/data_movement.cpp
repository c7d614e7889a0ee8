// CPU kernels of the shape and data-movement ops and the buffer ops. All move bytes by element size,
// so one instantiation serves every dtype. Operands may be strided; results are contiguous.
#include <algorithm>
#include <cstring>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "kernels/cpu/kernels.h"
#include "kernels/cpu/strided.h"

namespace kiln::kernels {
namespace {

using graph::Op;

std::string shape_text(const std::vector<int64_t>& shape) {
  return fmt::format("[{}]", fmt::join(shape, ", "));
}

int64_t product(std::span<const int64_t> dims) {
  int64_t n = 1;
  for (int64_t d : dims) n *= d;
  return n;
}

// The axis attribute of concat, split, gather and scatter, read once; checked per launch against the
// rank (ExecutionError when outside [0, rank)), which a symbolic operand shows only then.
struct AxisParams {
  explicit AxisParams(const KernelInit& init) : op(init.op), axis(init.attr<int64_t>("axis")) {}
  int64_t checked(int64_t rank) const {
    if (axis < 0 || axis >= rank)
      throw ExecutionError(fmt::format("{}: axis {} is out of range for rank {}", graph::op_name(op), axis, rank));
    return axis;
  }
  Op op;
  int64_t axis;
};

// `view` advanced by `offset` elements.
const void* element_at(const TensorView& view, int64_t offset) {
  return static_cast<const uint8_t*>(view.data) + offset * static_cast<int64_t>(dtype_size(view.dtype));
}
void* element_at(void* data, DType dtype, int64_t offset) {
  return static_cast<uint8_t*>(data) + offset * static_cast<int64_t>(dtype_size(dtype));
}

// ---- reshape, transpose, broadcast_to, transfer_to: one strided copy ------------------------------

void reshape_kernel(const KernelContext& ctx, std::span<const TensorView> inputs, std::span<const TensorView> outputs) {
  const TensorView& in = inputs[0];
  const TensorView& out = outputs[0];
  if (in.numel() != out.numel())
    throw ShapeError(fmt::format("reshape: input {} has {} elements but the result {} has {}",
                                 shape_text(in.shape), in.numel(), shape_text(out.shape),
                                 out.numel()));
  // Read in the input's row-major order; the result is contiguous, so its shape does not matter.
  copy_strided(ctx, in.dtype, in.shape, in.data, in.strides, out.data);
}

struct TransposeParams {
  explicit TransposeParams(const KernelInit& init) : perm(init.attr<std::vector<int64_t>>("perm")) {}
  std::vector<int64_t> perm;
};

void transpose_kernel(const KernelContext& ctx, const TransposeParams& params, std::span<const TensorView> inputs,
                      std::span<const TensorView> outputs) {
  const TensorView& in = inputs[0];
  const TensorView& out = outputs[0];
  const std::vector<int64_t>& perm = params.perm;
  const size_t rank = in.shape.size();
  std::vector<bool> seen(rank, false);
  std::vector<int64_t> shape(rank), strides(rank);
  for (size_t i = 0; i < perm.size() && perm.size() == rank; ++i) {
    const int64_t p = perm[i];
    if (p < 0 || static_cast<size_t>(p) >= rank || seen[static_cast<size_t>(p)]) break;
    seen[static_cast<size_t>(p)] = true;
    shape[i] = in.shape[static_cast<size_t>(p)];
    strides[i] = in.strides[static_cast<size_t>(p)];
  }
  if (perm.size() != rank || std::count(seen.begin(), seen.end(), true) != static_cast<std::ptrdiff_t>(rank) ||
      shape != out.shape)
    throw ShapeError(fmt::format("transpose: perm [{}] is not a permutation taking {} to {}",
                                 fmt::join(perm, ", "), shape_text(in.shape), shape_text(out.shape)));
  copy_strided(ctx, in.dtype, shape, in.data, strides, out.data);
}

// The result's (concrete) shape is the target: the possibly symbolic "shape" attribute is not needed.
void broadcast_to_kernel(const KernelContext& ctx, std::span<const TensorView> inputs,
                         std::span<const TensorView> outputs) {
  const TensorView& in = inputs[0];
  const TensorView& out = outputs[0];
  bool ok = in.shape.size() <= out.shape.size();
  for (size_t i = 0; ok && i < in.shape.size(); ++i) {
    const int64_t d = in.shape[in.shape.size() - 1 - i];
    ok = d == 1 || d == out.shape[out.shape.size() - 1 - i];
  }
  if (!ok)
    throw ShapeError(fmt::format("broadcast_to: input {} does not broadcast to {}",
                                 shape_text(in.shape), shape_text(out.shape)));
  const std::vector<int64_t> strides = broadcast_strides(in, out.shape);
  copy_strided(ctx, in.dtype, out.shape, in.data, strides, out.data);
}

void transfer_to_kernel(const KernelContext& ctx, std::span<const TensorView> inputs,
                        std::span<const TensorView> outputs) {
  const TensorView& in = inputs[0];
  copy_strided(ctx, in.dtype, in.shape, in.data, in.strides, outputs[0].data);
}

// ---- concat and split: copies between a whole tensor and its parts along an axis ----------------

void concat_kernel(const KernelContext& ctx, const AxisParams& params, std::span<const TensorView> inputs,
                   std::span<const TensorView> outputs) {
  const TensorView& out = outputs[0];
  const int64_t axis = params.checked(static_cast<int64_t>(out.shape.size()));
  const std::vector<int64_t> out_strides = row_major_strides(out.shape);
  int64_t at = 0;  // where the next part starts along axis
  for (size_t k = 0; k < inputs.size(); ++k) {
    const TensorView& part = inputs[k];
    std::vector<int64_t> expected = out.shape;
    expected[static_cast<size_t>(axis)] = part.shape.size() == out.shape.size()
                                              ? part.shape[static_cast<size_t>(axis)]
                                              : -1;
    if (part.shape != expected || at + expected[static_cast<size_t>(axis)] > out.shape[static_cast<size_t>(axis)])
      throw ShapeError(fmt::format("concat: input {} of shape {} does not fit the result {} on axis {}",
                                   k, shape_text(part.shape), shape_text(out.shape), axis));
    copy_view(ctx, part.dtype, part.shape, part.data, part.strides,
              element_at(out.data, out.dtype, at * out_strides[static_cast<size_t>(axis)]),
              out_strides);
    at += part.shape[static_cast<size_t>(axis)];
  }
  if (at != out.shape[static_cast<size_t>(axis)])
    throw ShapeError(fmt::format("concat: inputs cover {} of the result's {} along axis {}", at,
                                 out.shape[static_cast<size_t>(axis)], axis));
}

// The result shapes are concrete, so the (possibly symbolic) "sizes" attribute is not needed.
void split_kernel(const KernelContext& ctx, const AxisParams& params, std::span<const TensorView> inputs,
                  std::span<const TensorView> outputs) {
  const TensorView& in = inputs[0];
  const int64_t axis = params.checked(static_cast<int64_t>(in.shape.size()));
  const auto ax = static_cast<size_t>(axis);
  int64_t at = 0;
  for (size_t k = 0; k < outputs.size(); ++k) {
    const TensorView& part = outputs[k];
    std::vector<int64_t> expected = in.shape;
    expected[ax] = part.shape.size() == in.shape.size() ? part.shape[ax] : -1;
    if (part.shape != expected || at + expected[ax] > in.shape[ax])
      throw ShapeError(fmt::format("split: result {} of shape {} does not fit the input {} on axis {}",
                                   k, shape_text(part.shape), shape_text(in.shape), axis));
    copy_strided(ctx, in.dtype, part.shape, element_at(in, at * in.strides[ax]), in.strides,
                 part.data);
    at += part.shape[ax];
  }
  if (at != in.shape[ax])
    throw ShapeError(fmt::format("split: results cover {} of the input's {} along axis {}", at,
                                 in.shape[ax], axis));
}

// ---- slice, buffer_load, buffer_store ------------------------------------------------------------

// A strided window of a tensor: where it starts and, per axis, its size and stride.
struct Window {
  int64_t offset = 0;  // elements from the tensor's data
  std::vector<int64_t> shape;
  std::vector<int64_t> strides;
};

// The window starts/stops/steps select, read once: a symbolic bound becomes the slot of its dim
// evaluated per run (an ExecutionError without symbol slots). No starts at all is the whole tensor.
struct WindowParams {
  explicit WindowParams(const KernelInit& init) : op(init.op), whole(!init.has_attr("starts")) {
    if (whole) return;
    const graph::Shape& start_dims = init.attr<graph::Shape>("starts");
    const graph::Shape& stop_dims = init.attr<graph::Shape>("stops");
    steps = init.attr<std::vector<int64_t>>("steps");
    if (stop_dims.rank() != start_dims.rank() || steps.size() != static_cast<size_t>(start_dims.rank()))
      throw ExecutionError(fmt::format("{}: {} starts, {} stops and {} steps", graph::op_name(op), start_dims.rank(),
                                       stop_dims.rank(), steps.size()));
    for (size_t d = 0; d < steps.size(); ++d)
      if (steps[d] < 1)
        throw ExecutionError(fmt::format("{}: step {} of axis {} must be at least 1", graph::op_name(op), steps[d], d));
    starts = init.dims(start_dims);
    stops = init.dims(stop_dims);
  }
  Op op;
  bool whole;
  DimRefs starts, stops;
  std::vector<int64_t> steps;
};

// The window `params` select in a tensor of `shape` and `strides` for this launch. Nothing is
// clamped: a bound past the dim is an error. Axes past the bounds' length are taken whole.
Window slice_window(const KernelContext& ctx, const WindowParams& params, const std::vector<int64_t>& shape,
                    const std::vector<int64_t>& strides) {
  Window w{0, shape, strides};
  if (params.whole) return w;
  const Op op = params.op;
  const size_t rank = shape.size();
  if (params.starts.size() > rank)
    throw ExecutionError(fmt::format("{}: {} starts, {} stops and {} steps for a tensor of rank {}",
                                     graph::op_name(op), params.starts.size(), params.stops.size(),
                                     params.steps.size(), rank));
  for (size_t d = 0; d < params.starts.size(); ++d) {
    const int64_t start = params.starts[d].get(ctx);
    const int64_t stop = params.stops[d].get(ctx);
    const int64_t step = params.steps[d];
    if (start > stop || stop > shape[d])
      throw ExecutionError(fmt::format("{}: slice {}:{} of axis {} is out of bounds for size {}",
                                       graph::op_name(op), start, stop, d, shape[d]));
    w.offset += start * strides[d];
    w.shape[d] = stop > start ? (stop - start + step - 1) / step : 0;
    w.strides[d] = strides[d] * step;
  }
  return w;
}

void check_window_shape(Op op, const Window& w, const std::vector<int64_t>& shape, const char* what) {
  if (w.shape != shape)
    throw ShapeError(fmt::format("{}: the slice has shape {} but the {} has shape {}",
                                 graph::op_name(op), shape_text(w.shape), what, shape_text(shape)));
}

// slice and buffer_load.
void slice_kernel(const KernelContext& ctx, const WindowParams& params, std::span<const TensorView> inputs,
                  std::span<const TensorView> outputs) {
  const TensorView& in = inputs[0];
  const TensorView& out = outputs[0];
  const Window w = slice_window(ctx, params, in.shape, in.strides);
  check_window_shape(params.op, w, out.shape, "result");
  copy_strided(ctx, in.dtype, w.shape, element_at(in, w.offset), w.strides, out.data);
}

// Writes `value` into a window of the buffer in place; there are no results.
void buffer_store_kernel(const KernelContext& ctx, const WindowParams& params, std::span<const TensorView> inputs,
                         std::span<const TensorView>) {
  const TensorView& buffer = inputs[0];
  const TensorView& value = inputs[1];
  if (buffer.dtype != value.dtype)
    throw DTypeError(fmt::format("buffer_store: value is {} but the buffer is {}",
                                 dtype_name(value.dtype), dtype_name(buffer.dtype)));
  const Window w = slice_window(ctx, params, buffer.shape, buffer.strides);
  check_window_shape(Op::buffer_store, w, value.shape, "value");
  copy_view(ctx, value.dtype, w.shape, value.data, value.strides,
            element_at(buffer.data, buffer.dtype, w.offset), w.strides);
}

// ---- gather and scatter --------------------------------------------------------------------------

// The index tensor's values as int64 in row-major order, each checked against [0, dim): negative
// indices are out of range (they do not count from the end).
std::vector<int64_t> read_indices(Op op, const TensorView& indices, int64_t dim, int64_t axis) {
  if (indices.dtype != DType::i32 && indices.dtype != DType::i64)
    throw DTypeError(fmt::format("{}: indices are {}; expected i32 or i64", graph::op_name(op),
                                 dtype_name(indices.dtype)));
  std::vector<int64_t> values(static_cast<size_t>(indices.numel()));
  visit_dtype(indices.dtype, [&]<class I>() {
    if constexpr (std::is_same_v<I, int32_t> || std::is_same_v<I, int64_t>) {
      std::vector<I> contiguous(values.size());
      SerialParallel serial;
      copy_strided(KernelContext{&serial}, indices.dtype, indices.shape, indices.data,
                   indices.strides, contiguous.data());
      for (size_t i = 0; i < values.size(); ++i) values[i] = contiguous[i];
    }
  });
  for (int64_t v : values)
    if (v < 0 || v >= dim)
      throw ExecutionError(fmt::format("{}: index {} is out of range for dim {} of size {}",
                                       graph::op_name(op), v, axis, dim));
  return values;
}

// `view`'s data, contiguous: the view itself when it already is, else a copy in `storage`.
const uint8_t* contiguous_data(const KernelContext& ctx, const TensorView& view,
                               std::vector<uint8_t>& storage) {
  if (view.is_contiguous()) return static_cast<const uint8_t*>(view.data);
  storage.resize(static_cast<size_t>(view.numel()) * dtype_size(view.dtype));
  copy_strided(ctx, view.dtype, view.shape, view.data, view.strides, storage.data());
  return storage.data();
}

// out = input[:axis] + indices.shape + input[axis+1:]; each selected row is `inner` elements.
void gather_kernel(const KernelContext& ctx, const AxisParams& params, std::span<const TensorView> inputs,
                   std::span<const TensorView> outputs) {
  const TensorView& in = inputs[0];  // [outer..., dim, inner...]
  const TensorView& out = outputs[0];  // [outer..., indices..., inner...]
  const int64_t axis = params.checked(static_cast<int64_t>(in.shape.size()));
  const auto ax = static_cast<size_t>(axis);
  const std::vector<int64_t> index = read_indices(Op::gather, inputs[1], in.shape[ax], axis);
  std::vector<int64_t> expected(in.shape.begin(), in.shape.begin() + axis);
  expected.insert(expected.end(), inputs[1].shape.begin(), inputs[1].shape.end());
  expected.insert(expected.end(), in.shape.begin() + axis + 1, in.shape.end());
  if (out.shape != expected)
    throw ShapeError(fmt::format("gather: result {} should be {} for input {}, indices {}, axis {}",
                                 shape_text(out.shape), shape_text(expected), shape_text(in.shape),
                                 shape_text(inputs[1].shape), axis));
  const int64_t outer = product(std::span(in.shape).first(ax));
  const int64_t dim = in.shape[ax];
  const int64_t inner = product(std::span(in.shape).subspan(ax + 1));
  const int64_t count = static_cast<int64_t>(index.size());
  const size_t row_bytes = static_cast<size_t>(inner) * dtype_size(in.dtype);
  std::vector<uint8_t> storage;
  const uint8_t* src = contiguous_data(ctx, in, storage);
  auto* dst = static_cast<uint8_t*>(out.data);
  const int64_t rows = outer * count;
  parallel_for(ctx, rows, std::max<int64_t>(1, kElementwiseGrain / std::max<int64_t>(inner, 1)),
               [&](int64_t begin, int64_t end) {
                 for (int64_t r = begin; r < end; ++r) {
                   const int64_t o = r / count;
                   const int64_t i = r % count;
                   std::memcpy(dst + static_cast<size_t>(r) * row_bytes,
                               src + static_cast<size_t>(o * dim + index[static_cast<size_t>(i)]) * row_bytes,
                               row_bytes);
                 }
               });
}

// A copy of input with input[..., indices[i], ...] = updates[..., i, ...] along axis; indices are
// rank 1 and applied in order, so the last write to a row wins.
void scatter_kernel(const KernelContext& ctx, const AxisParams& params, std::span<const TensorView> inputs,
                    std::span<const TensorView> outputs) {
  const TensorView& in = inputs[0];       // [outer..., dim, inner...]
  const TensorView& updates = inputs[1];  // [outer..., count, inner...]
  const TensorView& indices = inputs[2];  // [count]
  const TensorView& out = outputs[0];     // like in
  const int64_t axis = params.checked(static_cast<int64_t>(in.shape.size()));
  const auto ax = static_cast<size_t>(axis);
  if (indices.shape.size() != 1)
    throw ShapeError(fmt::format("scatter: indices have shape {}; expected rank 1",
                                 shape_text(indices.shape)));
  std::vector<int64_t> expected = in.shape;
  expected[ax] = indices.shape[0];
  if (updates.shape != expected || out.shape != in.shape || updates.dtype != in.dtype)
    throw ShapeError(fmt::format("scatter: updates {} {} should be {} {} for input {} and {} indices",
                                 dtype_name(updates.dtype), shape_text(updates.shape),
                                 dtype_name(in.dtype), shape_text(expected), shape_text(in.shape),
                                 indices.shape[0]));
  const std::vector<int64_t> index = read_indices(Op::scatter, indices, in.shape[ax], axis);
  copy_strided(ctx, in.dtype, in.shape, in.data, in.strides, out.data);
  const int64_t outer = product(std::span(in.shape).first(ax));
  const int64_t dim = in.shape[ax];
  const int64_t inner = product(std::span(in.shape).subspan(ax + 1));
  const int64_t count = static_cast<int64_t>(index.size());
  const size_t row_bytes = static_cast<size_t>(inner) * dtype_size(in.dtype);
  std::vector<uint8_t> storage;
  const uint8_t* src = contiguous_data(ctx, updates, storage);
  auto* dst = static_cast<uint8_t*>(out.data);
  for (int64_t o = 0; o < outer; ++o)
    for (int64_t i = 0; i < count; ++i)
      std::memcpy(dst + static_cast<size_t>(o * dim + index[static_cast<size_t>(i)]) * row_bytes,
                  src + static_cast<size_t>(o * count + i) * row_bytes, row_bytes);
}

// The target device is checked at build; the copy needs nothing of it.
std::unique_ptr<const Kernel> make_transfer_to_kernel(const KernelInit& init) {
  if (init.has_attr("device")) {
    const DeviceRef target = init.attr<DeviceRef>("device");
    if (target.kind != DeviceKind::CPU)
      throw ExecutionError(fmt::format(
          "transfer_to: the CPU kernel copies only between CPU devices, not to {}", target.to_string()));
  }
  return stateless<transfer_to_kernel>(init);
}

}  // namespace

void register_cpu_data_movement(KernelRegistry& r) {
  for (DType d : kAllDTypes) {
    r.add(Op::reshape, DeviceKind::CPU, {d}, stateless<reshape_kernel>);
    r.add(Op::transpose, DeviceKind::CPU, {d}, with_params<TransposeParams, transpose_kernel>);
    r.add(Op::broadcast_to, DeviceKind::CPU, {d}, stateless<broadcast_to_kernel>);
    r.add(Op::concat, DeviceKind::CPU, {d}, with_params<AxisParams, concat_kernel>);
    r.add(Op::split, DeviceKind::CPU, {d}, with_params<AxisParams, split_kernel>);
    r.add(Op::slice, DeviceKind::CPU, {d}, with_params<WindowParams, slice_kernel>);
    r.add(Op::gather, DeviceKind::CPU, {d}, with_params<AxisParams, gather_kernel>);
    r.add(Op::scatter, DeviceKind::CPU, {d}, with_params<AxisParams, scatter_kernel>);
    r.add(Op::buffer_load, DeviceKind::CPU, {d}, with_params<WindowParams, slice_kernel>);
    r.add(Op::buffer_store, DeviceKind::CPU, {d}, with_params<WindowParams, buffer_store_kernel>);
    r.add(Op::transfer_to, DeviceKind::CPU, {d}, make_transfer_to_kernel);
  }
}

}  // namespace kiln::kernels
