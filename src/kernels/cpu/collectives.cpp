// allreduce_sum and allgather over the devices of one process, synchronised through their signal
// buffers without locks, and across processes through the ProcessGroup. One kernel call runs every
// device's participant at once on the DeviceTeam; each participant touches only its own views and
// what its peers publish in the signal buffers, as if it ran on its own device.
// Layout and protocol: docs/multi-device.md.
#include <algorithm>
#include <atomic>
#include <cstring>
#include <exception>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "kernels/cpu/convert.h"
#include "kernels/cpu/kernels.h"
#include "kernels/cpu/spin.h"
#include "kiln/errors.h"
#include "kiln/graph/signals.h"

namespace kiln::kernels {
namespace {

using graph::MAX_SIGNAL_PEERS;
using graph::Op;
using graph::SIGNAL_BYTES;
using graph::SIGNAL_HEADER_BYTES;
using graph::SIGNAL_SCRATCH_BYTES;

// ==== signal buffers ================================================================================

// Line p of device i's signal buffer. Only participant p writes it, so no two writers share a cache
// line. The flags hold epochs: the number of collectives the writer has taken part in on these
// buffers, counted from 1; a zeroed buffer is epoch 0 everywhere.
struct alignas(64) PeerLine {
  uint64_t arrived;  // p has published its data (its scratch, and `input`/`output`) for this epoch
  uint64_t done;     // p has finished reading everything of this device's for this epoch
  uint64_t reduced;  // p's local part is in its output (cross-process collectives only)
  uint64_t result;   // line 0: participant 0's output holds the cross-process result (kFailed: failed)
  uint64_t input;    // p's input address (large collectives read their peers' tensors directly)
  uint64_t output;   // p's output address
  uint64_t extent;   // p's input size along the allgather axis
  uint64_t epoch;    // own line only: collectives this device has taken part in
};
static_assert(sizeof(PeerLine) == 64);
static_assert(MAX_SIGNAL_PEERS * sizeof(PeerLine) == SIGNAL_HEADER_BYTES);

// Or-ed into `result` when the cross-process step failed (waits on `result` mask it off).
constexpr uint64_t kFailed = uint64_t{1} << 63;

struct Signal {
  uint8_t* base;
  PeerLine& line(int peer) const { return reinterpret_cast<PeerLine*>(base)[peer]; }
  uint8_t* scratch() const { return base + SIGNAL_HEADER_BYTES; }
};

uint64_t load_acquire(uint64_t& field) { return std::atomic_ref<uint64_t>(field).load(std::memory_order_acquire); }
uint64_t load_relaxed(uint64_t& field) { return std::atomic_ref<uint64_t>(field).load(std::memory_order_relaxed); }
void store_release(uint64_t& field, uint64_t v) { std::atomic_ref<uint64_t>(field).store(v, std::memory_order_release); }
void store_relaxed(uint64_t& field, uint64_t v) { std::atomic_ref<uint64_t>(field).store(v, std::memory_order_relaxed); }

// Waits until ready(field) and returns the value that was. Peers usually arrive within microseconds,
// so spin with a pause first; then yield, since with more devices than cores the peer waited for
// needs this core.
template <class Ready> uint64_t wait_until(uint64_t& field, Ready ready) {
  for (int i = 0;; ++i) {
    const uint64_t value = load_acquire(field);
    if (ready(value)) return value;
    if (i < 256)
      cpu_relax();
    else
      std::this_thread::yield();
  }
}
void wait_at_least(uint64_t& field, uint64_t target) {
  wait_until(field, [&](uint64_t value) { return value >= target; });
}

// What every participant of one collective knows before it starts: the signal buffers (the same list
// on every device, in device order), this epoch, and the cross-process setting.
struct Collective {
  Op op;
  int n = 0;
  std::vector<Signal> signals;
  uint64_t epoch = 0;
  int64_t processes = 1;
  ProcessGroup* group = nullptr;
};

// Publishes to every peer that `me` has reached `field` for this epoch.
void signal_all(const Collective& c, int me, uint64_t PeerLine::*field) {
  for (int j = 0; j < c.n; ++j) store_release(c.signals[j].line(me).*field, c.epoch);
}
// Waits (on this device's own buffer) until every peer has reached `field` at `epoch`.
void wait_all(const Collective& c, int me, uint64_t PeerLine::*field, uint64_t epoch) {
  for (int p = 0; p < c.n; ++p) wait_at_least(c.signals[me].line(p).*field, epoch);
}

// Publishes this participant's tensors, then waits for every peer's; from here on, peers' scratch
// and published tensors may be read.
void arrive(const Collective& c, int me, const void* input, void* output, int64_t extent) {
  for (int j = 0; j < c.n; ++j) {
    PeerLine& line = c.signals[j].line(me);
    store_relaxed(line.input, reinterpret_cast<uintptr_t>(input));
    store_relaxed(line.output, reinterpret_cast<uintptr_t>(output));
    store_relaxed(line.extent, static_cast<uint64_t>(extent));
  }
  signal_all(c, me, &PeerLine::arrived);
  wait_all(c, me, &PeerLine::arrived, c.epoch);
}

template <class T = uint8_t> T* published_input(const Collective& c, int me, int peer) {
  return reinterpret_cast<T*>(load_relaxed(c.signals[me].line(peer).input));
}
template <class T = uint8_t> T* published_output(const Collective& c, int me, int peer) {
  return reinterpret_cast<T*>(load_relaxed(c.signals[me].line(peer).output));
}

// The cross-process step, once every participant's output holds the local result: participant 0
// runs `cross(output_0)` (the process group's collective), the others then copy participant 0's
// output. A failure there reaches the others through `result` so no one waits forever; participant 0
// rethrows it after the done barrier.
template <class Cross>
std::exception_ptr cross_process(const Collective& c, int me, void* output, size_t bytes, Cross&& cross) {
  std::exception_ptr error;
  signal_all(c, me, &PeerLine::reduced);
  if (me == 0) {
    wait_all(c, me, &PeerLine::reduced, c.epoch);
    try {
      cross(output);
    } catch (...) {
      error = std::current_exception();
    }
    for (int j = 0; j < c.n; ++j) store_release(c.signals[j].line(0).result, c.epoch | (error ? kFailed : 0));
  } else {
    const uint64_t result =
        wait_until(c.signals[me].line(0).result, [&](uint64_t value) { return (value & ~kFailed) >= c.epoch; });
    if (!(result & kFailed)) std::memcpy(output, published_output(c, me, 0), bytes);
  }
  return error;
}

// Ends participation: peers may reuse what they lent once everyone has said done. `wait` is needed
// when peers read this device's tensors (not just its scratch), since they belong to the caller again
// once the kernel returns; a small allreduce instead waits lazily, before it next writes its scratch.
void finish(const Collective& c, int me, bool wait) {
  signal_all(c, me, &PeerLine::done);
  if (wait) wait_all(c, me, &PeerLine::done, c.epoch);
  store_relaxed(c.signals[me].line(me).epoch, c.epoch);
}

// ==== allreduce_sum =================================================================================

// targets[k][i] = sources[0][i] + ... + sources[n-1][i] for i in [begin, end): summed in device order
// in compute_t<T> (float for f16/bf16) and rounded once, so every device's copy is bit-identical
// whichever participant computed it.
template <class T>
void sum_into(const std::vector<const T*>& sources, const std::vector<T*>& targets, int64_t begin, int64_t end) {
  constexpr int64_t kBlock = 1024;  // accumulators stay in L1
  compute_t<T> acc[kBlock];
  for (int64_t b = begin; b < end; b += kBlock) {
    const int64_t m = std::min(kBlock, end - b);
    const T* first = sources[0] + b;
    for (int64_t k = 0; k < m; ++k) acc[k] = widen(first[k]);
    for (size_t p = 1; p < sources.size(); ++p) {
      const T* s = sources[p] + b;
      for (int64_t k = 0; k < m; ++k) acc[k] += widen(s[k]);
    }
    if constexpr (is_half_v<T>) {
      T rounded[kBlock];
      for (int64_t k = 0; k < m; ++k) rounded[k] = T(acc[k]);
      for (T* t : targets) std::memcpy(t + b, rounded, static_cast<size_t>(m) * sizeof(T));
    } else {
      for (T* t : targets) std::memcpy(t + b, acc, static_cast<size_t>(m) * sizeof(T));
    }
  }
}

template <class T>
std::exception_ptr allreduce_participant(const Collective& c, int me, const TensorView& in, const TensorView& out) {
  const int64_t count = in.numel();
  const size_t bytes = static_cast<size_t>(count) * sizeof(T);
  const bool small = static_cast<int64_t>(bytes) <= SIGNAL_SCRATCH_BYTES;
  const Signal& own = c.signals[me];
  if (small) {
    // Peers still reading this scratch from the previous collective must be done first.
    wait_all(c, me, &PeerLine::done, c.epoch - 1);
    std::memcpy(own.scratch(), in.data, bytes);
  }
  arrive(c, me, in.data, out.data, 0);

  std::vector<const T*> sources(static_cast<size_t>(c.n));
  if (small) {
    // Everyone sums every peer's scratch into its own output: one pass, no second barrier.
    for (int p = 0; p < c.n; ++p) sources[p] = reinterpret_cast<const T*>(c.signals[p].scratch());
    sum_into<T>(sources, {out.as<T>()}, 0, count);
  } else {
    // Reduce-scatter + write-all: this participant sums its 1/n slice of every peer's input and writes
    // it to every peer's output. Slices are whole cache lines, so no two writers share one.
    std::vector<T*> targets(static_cast<size_t>(c.n));
    for (int p = 0; p < c.n; ++p) {
      sources[p] = published_input<const T>(c, me, p);
      targets[p] = published_output<T>(c, me, p);
    }
    constexpr int64_t kLine = 64 / sizeof(T);
    const int64_t per = ((count + c.n - 1) / c.n + kLine - 1) / kLine * kLine;
    const int64_t begin = std::min(count, per * me), end = std::min(count, begin + per);
    sum_into<T>(sources, targets, begin, end);
  }

  std::exception_ptr error;
  if (c.processes > 1)
    error = cross_process(c, me, out.data, bytes,
                          [&](void* data) { c.group->allreduce_sum(data, count, dtype_of<T>()); });
  finish(c, me, /*wait=*/!small || c.processes > 1);
  return error;
}

// ==== allgather =====================================================================================

// A tensor seen as [outer, axis, inner] around the gather axis.
struct AxisSplit {
  int64_t outer = 1, inner = 1;
};
AxisSplit split_at(const std::vector<int64_t>& shape, int64_t axis) {
  AxisSplit s;
  for (int64_t d = 0; d < axis; ++d) s.outer *= shape[static_cast<size_t>(d)];
  for (size_t d = static_cast<size_t>(axis) + 1; d < shape.size(); ++d) s.inner *= shape[d];
  return s;
}

// Copies src [outer, extent, inner] into dst [outer, total, inner] at `offset` along the middle axis.
void copy_along_axis(const uint8_t* src, uint8_t* dst, AxisSplit split, int64_t extent, int64_t total,
                     int64_t offset, size_t element) {
  const size_t row = static_cast<size_t>(extent * split.inner) * element;
  for (int64_t o = 0; o < split.outer; ++o)
    std::memcpy(dst + static_cast<size_t>((o * total + offset) * split.inner) * element,
                src + static_cast<size_t>(o) * row, row);
}

// Every participant copies each peer's input (read in place, published in the signal buffer) into
// its own output at the peer's offset along the axis.
std::exception_ptr allgather_participant(const Collective& c, int me, const TensorView& in, const TensorView& out,
                                         int64_t axis) {
  const size_t element = dtype_size(in.dtype);
  const AxisSplit split = split_at(out.shape, axis);
  const int64_t total = out.shape[static_cast<size_t>(axis)];
  const int64_t local_total = total / c.processes;
  arrive(c, me, in.data, out.data, in.shape[static_cast<size_t>(axis)]);

  std::exception_ptr error;
  if (c.processes == 1) {
    int64_t offset = 0;
    for (int p = 0; p < c.n; ++p) {
      const auto extent = static_cast<int64_t>(load_relaxed(c.signals[me].line(p).extent));
      copy_along_axis(published_input(c, me, p), static_cast<uint8_t*>(out.data), split, extent, total, offset,
                      element);
      offset += extent;
    }
  } else {
    // Participant 0 gathers this process's part, the process group gathers every rank's ([rank, outer,
    // local_total, inner] in rank order), and participant 0 interleaves them along the axis.
    const size_t local_bytes = static_cast<size_t>(split.outer * local_total * split.inner) * element;
    error = cross_process(c, me, out.data, local_bytes * static_cast<size_t>(c.processes), [&](void* data) {
      std::vector<uint8_t> local(local_bytes), all(local_bytes * static_cast<size_t>(c.processes));
      int64_t offset = 0;
      for (int p = 0; p < c.n; ++p) {
        const auto extent = static_cast<int64_t>(load_relaxed(c.signals[me].line(p).extent));
        copy_along_axis(published_input(c, me, p), local.data(), split, extent, local_total, offset, element);
        offset += extent;
      }
      c.group->allgather(local.data(), all.data(), static_cast<int64_t>(local_bytes));
      for (int64_t r = 0; r < c.processes; ++r)
        copy_along_axis(all.data() + static_cast<size_t>(r) * local_bytes, static_cast<uint8_t*>(data), split,
                        local_total, total, r * local_total, element);
    });
  }
  finish(c, me, /*wait=*/true);
  return error;
}

// A single device: the collective is a copy, then the cross-process step if it spans processes.
void single_device(Op op, const TensorView& in, const TensorView& out, int64_t axis, int64_t processes,
                   ProcessGroup* group) {
  const size_t bytes = static_cast<size_t>(in.numel()) * dtype_size(in.dtype);
  if (processes == 1) {
    std::memcpy(out.data, in.data, bytes);
  } else if (op == Op::allreduce_sum) {
    std::memcpy(out.data, in.data, bytes);
    group->allreduce_sum(out.data, out.numel(), out.dtype);
  } else {
    std::vector<uint8_t> all(bytes * static_cast<size_t>(processes));
    group->allgather(in.data, all.data(), static_cast<int64_t>(bytes));
    const AxisSplit split = split_at(out.shape, axis);
    const int64_t extent = in.shape[static_cast<size_t>(axis)];
    for (int64_t r = 0; r < processes; ++r)
      copy_along_axis(all.data() + static_cast<size_t>(r) * bytes, static_cast<uint8_t*>(out.data), split, extent,
                      extent * processes, r * extent, dtype_size(in.dtype));
  }
}

// ==== the kernels ===================================================================================

// The attributes, read once: how many processes the collective spans, and allgather's axis.
struct CollectiveParams {
  explicit CollectiveParams(const KernelInit& init)
      : op(init.op),
        processes(init.attr<int64_t>("processes")),
        axis(op == Op::allgather ? init.attr<int64_t>("axis") : -1) {
    if (processes < 1)
      throw ExecutionError(fmt::format("{}: processes must be >= 1, got {}", graph::op_name(op), processes));
  }
  Op op;
  int64_t processes;
  int64_t axis;
};

// Everything a participant could trip over is checked here, before any starts: a participant that
// threw half-way would leave its peers waiting for it.
Collective check_collective(const KernelContext& ctx, const CollectiveParams& params,
                            std::span<const TensorView> inputs, std::span<const TensorView> outputs) {
  const Op op = params.op;
  const int64_t axis = params.axis;
  const std::string name(graph::op_name(op));
  Collective c;
  c.op = op;
  c.n = static_cast<int>(outputs.size());
  c.processes = params.processes;
  c.group = ctx.process_group;
  const size_t n = outputs.size();
  if (n == 0 || n > static_cast<size_t>(MAX_SIGNAL_PEERS) ||
      !(inputs.size() == 2 * n || (n == 1 && inputs.size() == 1)))
    throw ExecutionError(fmt::format("{}: {} results need as many inputs and signal buffers, got {} operands",
                                     name, n, inputs.size()));
  if (c.processes > 1) {
    if (!c.group)
      throw ExecutionError(fmt::format("{}: spans {} processes but no process group was given (set "
                                       "SessionOptions::process_group)",
                                       name, c.processes));
    if (c.group->size() != c.processes)
      throw ExecutionError(fmt::format("{}: spans {} processes but the process group has {}", name, c.processes,
                                       c.group->size()));
  }
  int64_t extents = 0;
  for (size_t i = 0; i < n; ++i) {
    const TensorView& in = inputs[i];
    const TensorView& out = outputs[i];
    if (!in.is_contiguous() || !out.is_contiguous())
      throw ExecutionError(fmt::format("{}: input {} and result {} must be contiguous", name, i, i));
    if (in.dtype != inputs[0].dtype || out.dtype != in.dtype)
      throw DTypeError(fmt::format("{}: input {} is {} and result {} is {}, expected input 0's {}", name, i,
                                   describe(in), i, describe(out), dtype_name(inputs[0].dtype)));
    if (op == Op::allreduce_sum && (in.shape != inputs[0].shape || out.shape != in.shape))
      throw ShapeError(fmt::format("{}: input {} is {} and result {} is {}, expected input 0's shape {}", name, i,
                                   describe(in), i, describe(out), describe(inputs[0])));
    if (op == Op::allgather) {
      if (axis < 0 || static_cast<size_t>(axis) >= in.shape.size() || out.shape.size() != in.shape.size())
        throw ShapeError(fmt::format("{}: axis {} does not fit input {} {} and result {}", name, axis, i,
                                     describe(in), describe(out)));
      extents += in.shape[static_cast<size_t>(axis)];
      for (size_t d = 0; d < in.shape.size(); ++d)
        if (static_cast<int64_t>(d) != axis && (in.shape[d] != inputs[0].shape[d] || out.shape[d] != in.shape[d]))
          throw ShapeError(fmt::format("{}: input {} {} and result {} {} differ from input 0 {} outside axis {}", name,
                                       i, describe(in), i, describe(out), describe(inputs[0]), axis));
    }
  }
  if (op == Op::allgather)
    for (size_t i = 0; i < n; ++i)
      if (outputs[i].shape[static_cast<size_t>(axis)] != extents * c.processes)
        throw ShapeError(fmt::format("{}: result {} is {}, but the inputs' axis {} sizes add up to {} (x {} "
                                     "processes)",
                                     name, i, describe(outputs[i]), axis, extents, c.processes));
  if (n == 1) return c;

  if (!ctx.team)
    throw ExecutionError(fmt::format("{}: {} devices need a device team to run their participants at once (run "
                                     "the graph through an InferenceSession)",
                                     name, n));
  for (size_t i = 0; i < n; ++i) {
    const TensorView& s = inputs[n + i];
    if (s.dtype != DType::u8 || s.shape != std::vector<int64_t>{SIGNAL_BYTES} || !s.is_contiguous())
      throw ExecutionError(fmt::format("{}: signal buffer {} is {}, expected a contiguous u8[{}]", name, i,
                                       describe(s), SIGNAL_BYTES));
    if (reinterpret_cast<uintptr_t>(s.data) % alignof(PeerLine) != 0)
      throw ExecutionError(fmt::format("{}: signal buffer {} is not 64-byte aligned (allocate it with "
                                       "engine::Signals)",
                                       name, i));
    for (size_t j = 0; j < i; ++j)
      if (inputs[n + j].data == s.data)
        throw ExecutionError(fmt::format("{}: signal buffers {} and {} are the same memory; each device needs "
                                         "its own",
                                         name, j, i));
    c.signals.push_back({static_cast<uint8_t*>(s.data)});
  }
  // No participant is running (the team runs one collective at a time), so the counters are stable.
  const uint64_t epoch = load_relaxed(c.signals[0].line(0).epoch);
  for (int i = 1; i < c.n; ++i)
    if (const uint64_t other = load_relaxed(c.signals[i].line(i).epoch); other != epoch)
      throw ExecutionError(fmt::format(
          "{}: signal buffers are out of step: buffer 0 has taken part in {} collectives, buffer {} in {} "
          "(give every collective over these devices the same engine::Signals buffers)",
          name, epoch, i, other));
  c.epoch = epoch + 1;
  return c;
}

void run_participants(const KernelContext& ctx, const Collective& c,
                      const std::function<std::exception_ptr(int)>& participant) {
  std::vector<std::exception_ptr> errors(static_cast<size_t>(c.n));
  ctx.team->run(c.n, [&](int me) { errors[static_cast<size_t>(me)] = participant(me); });
  for (const std::exception_ptr& e : errors)
    if (e) std::rethrow_exception(e);
}

template <class T>
void allreduce_sum_kernel(const KernelContext& ctx, const CollectiveParams& params, std::span<const TensorView> inputs,
                          std::span<const TensorView> outputs) {
  const Collective c = check_collective(ctx, params, inputs, outputs);
  if (c.n == 1) return single_device(Op::allreduce_sum, inputs[0], outputs[0], -1, c.processes, c.group);
  run_participants(ctx, c, [&](int me) { return allreduce_participant<T>(c, me, inputs[me], outputs[me]); });
}

void allgather_kernel(const KernelContext& ctx, const CollectiveParams& params, std::span<const TensorView> inputs,
                      std::span<const TensorView> outputs) {
  const int64_t axis = params.axis;
  const Collective c = check_collective(ctx, params, inputs, outputs);
  if (c.n == 1) return single_device(Op::allgather, inputs[0], outputs[0], axis, c.processes, c.group);
  run_participants(ctx, c, [&](int me) { return allgather_participant(c, me, inputs[me], outputs[me], axis); });
}

}  // namespace

void register_cpu_collectives(KernelRegistry& r) {
  using D = DType;
  r.add(Op::allreduce_sum, DeviceKind::CPU, {D::f32}, with_params<CollectiveParams, allreduce_sum_kernel<float>>);
  r.add(Op::allreduce_sum, DeviceKind::CPU, {D::f16}, with_params<CollectiveParams, allreduce_sum_kernel<f16_t>>);
  r.add(Op::allreduce_sum, DeviceKind::CPU, {D::bf16}, with_params<CollectiveParams, allreduce_sum_kernel<bf16_t>>);
  r.add(Op::allreduce_sum, DeviceKind::CPU, {D::f64}, with_params<CollectiveParams, allreduce_sum_kernel<double>>);
  // Gathering moves bytes, so one kernel serves every dtype.
  r.add(Op::allgather, DeviceKind::CPU,
        {D::f32, D::f16, D::bf16, D::f64, D::i8, D::i16, D::i32, D::i64, D::u8, D::u16, D::u32, D::u64, D::boolean},
        with_params<CollectiveParams, allgather_kernel>);
}

}  // namespace kiln::kernels
