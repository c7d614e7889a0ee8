// Private: the device-independent kernel interface. A kernel is an object built once per plan step at
// init (as ONNX Runtime's OpKernel) from the step's typed parameters and whatever it derives from
// operands fixed for the model's life (weights packed into the layout its loop reads); each launch
// then sees only strided views with concrete shapes. The executor allocates outputs (contiguous)
// before a launch. A backend (kernels/cpu/, later kernels/cuda/) registers its kernels in a
// KernelRegistry (kernels/registry.h).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kiln/distributed.h"
#include "kiln/graph/op.h"
#include "tensor/host_memory.h"

namespace kiln::kernels {

struct TensorView {
  void* data = nullptr;
  DType dtype = DType::f32;
  std::vector<int64_t> shape;
  std::vector<int64_t> strides;  // in elements
  int64_t numel() const;
  bool is_contiguous() const;
  template <class T> T* as() const { return static_cast<T*>(data); }
};

// "f32[2, 64]": a view's dtype and shape, for error messages.
std::string describe(const TensorView& v);

// Runs fn(begin, end) over [0, n) in chunks of at least `grain`, possibly in parallel; returns when
// all are done. The engine's thread pool implements it.
class Parallel {
 public:
  virtual ~Parallel() = default;
  virtual void for_range(int64_t n, int64_t grain,
                         const std::function<void(int64_t, int64_t)>& fn) = 0;
  virtual int num_threads() const = 0;
};

// Runs everything on the calling thread.
class SerialParallel final : public Parallel {
 public:
  void for_range(int64_t n, int64_t, const std::function<void(int64_t, int64_t)>& fn) override {
    if (n > 0) fn(0, n);
  }
  int num_threads() const override { return 1; }
};

// Runs fn(0) .. fn(n - 1) at the same time, one thread each, and returns when all are done: the
// participants of a collective wait for each other, so they cannot share threads. The engine keeps
// one persistent thread per device for this (engine/cpu/device_team.h).
class DeviceTeam {
 public:
  virtual ~DeviceTeam() = default;
  virtual void run(int n, const std::function<void(int)>& fn) = 0;
};

// What one launch sees besides its operands. `dims` holds this run's value of every symbolic dim the
// model's kernels asked for at init (DimRef::slot indexes it), evaluated once per run.
struct KernelContext {
  Parallel* parallel = nullptr;
  DeviceTeam* team = nullptr;              // for collectives over several devices
  ProcessGroup* process_group = nullptr;   // for collectives with processes > 1
  std::span<const int64_t> dims = {};
};

// One dim of a kernel parameter: a static size, or the slot of a symbolic dim in KernelContext::dims.
struct DimRef {
  int32_t slot = -1;  // < 0: static
  int64_t value = 0;
  int64_t get(const KernelContext& ctx) const { return slot < 0 ? value : ctx.dims[static_cast<size_t>(slot)]; }
};
using DimRefs = std::vector<DimRef>;
// Every dim of `refs` for this launch, into `out` (reusing its capacity).
void resolve(const KernelContext& ctx, const DimRefs& refs, std::vector<int64_t>& out);

// Hands out slots for the symbolic dims kernels ask for at init (the executor evaluates each slot
// once per run). The same dim (by its text) gets the same slot.
class SymbolSlots {
 public:
  virtual ~SymbolSlots() = default;
  virtual int32_t slot_of(const graph::Dim& dim) = 0;
};

// A kernel's packed copy of a fixed input, where it may be kept across processes (the executor's
// engine::WeightCache, for weights from a file): a stored copy (`filled`: used as it is), or memory to
// pack into that `keep` then stores (the cache file's own pages), or nothing (`data` null: ensure()
// allocates it).
struct PackedBuffer {
  std::shared_ptr<void> data;
  bool filled = false;
  std::function<void()> keep;
  void* ensure(size_t bytes) {
    if (!data) {
      void* memory = allocate_aligned(bytes);
      if (!memory) throw std::bad_alloc();
      data = std::shared_ptr<void>(memory, [](void* p) { std::free(p); });
    }
    return data.get();
  }
  void packed() const {
    if (keep) keep();
  }
};
// `acquire(packing, bytes)`: the PackedBuffer of a copy of `bytes` made by the packing `packing`
// describes (every parameter its bytes depend on). Empty: nothing is kept.
struct PackedCopies {
  std::function<PackedBuffer(std::string_view packing, size_t bytes)> acquire;
  PackedBuffer get(std::string_view packing, size_t bytes) const {
    return acquire ? acquire(packing, bytes) : PackedBuffer{};
  }
};

// What a kernel is built from: the step's op and attributes, and its operands: those fixed for the
// model's life (`fixed[i]`: weights, constants) have their data; the others have data == nullptr and
// their static shape, or no shape when it is symbolic. A kernel must give the same results whatever
// it derived from fixed operands (a launch list, constant folding or a test may build it without).
struct KernelInit {
  graph::Op op = graph::Op::constant;
  const graph::Attrs* attrs = nullptr;
  std::span<const TensorView> inputs;
  std::span<const bool> fixed;         // empty: nothing fixed
  SymbolSlots* symbols = nullptr;      // nullptr: symbolic dims in parameters are an error
  // A kernel that built a copy of fixed input `input` (packed panels) which its launches read instead
  // calls this on the bytes it has copied, as it goes: the executor then drops them where they are
  // pages of a mapped file (Model::copied_weights), so a weight is never held twice. May be empty.
  std::function<void(size_t input, const void* data, size_t bytes)> copied = {};
  // The threads the launches will run on, for work done once at build (packing a fixed weight: its
  // fresh pages are zeroed by the system as they are first written, so one thread alone took most
  // of a load). Null: the building thread alone.
  Parallel* parallel = nullptr;
  // The PackedCopies of fixed input `input`; may be empty (nothing is kept).
  std::function<PackedCopies(size_t input)> packed_copies = {};

  template <class T> const T& attr(const char* name) const { return graph::get_attr<T>(*attrs, name, op); }
  bool has_attr(const char* name) const { return attrs->count(name) != 0; }
  bool is_fixed(size_t input) const { return input < fixed.size() && fixed[input]; }
  void report_copied(size_t input, const void* data, size_t bytes) const {
    if (copied) copied(input, data, bytes);
  }
  PackedCopies copies_of(size_t input) const { return packed_copies ? packed_copies(input) : PackedCopies{}; }
  DimRef dim(const graph::Dim& d) const;       // ValueError for a symbolic dim without `symbols`
  DimRefs dims(const graph::Shape& shape) const;
};

// A kernel reports bad input by throwing (Error subclasses); the executor adds the op and node. `run`
// may be called from several threads at once (concurrent executes of one model): it must not
// change the object.
class Kernel {
 public:
  virtual ~Kernel() = default;
  virtual void run(const KernelContext& ctx, std::span<const TensorView> inputs,
                   std::span<const TensorView> outputs) const = 0;
};

// Builds a step's kernel; throws (naming the attribute) for parameters it cannot run with.
using KernelFactory = std::function<std::unique_ptr<const Kernel>(const KernelInit&)>;

// ---- helpers for defining kernels -----------------------------------------------------------------

using LaunchFn = void (*)(const KernelContext&, std::span<const TensorView>, std::span<const TensorView>);

// A kernel with no parameters: every launch calls Fn.
template <LaunchFn Fn>
std::unique_ptr<const Kernel> stateless(const KernelInit&) {
  struct Impl final : Kernel {
    void run(const KernelContext& ctx, std::span<const TensorView> in, std::span<const TensorView> out) const override {
      Fn(ctx, in, out);
    }
  };
  return std::make_unique<Impl>();
}

// A kernel of typed parameters: Params is built once from the KernelInit (its constructor reads and
// checks the attributes), and every launch calls Fn with it.
template <class Params, void (*Fn)(const KernelContext&, const Params&, std::span<const TensorView>,
                                   std::span<const TensorView>)>
std::unique_ptr<const Kernel> with_params(const KernelInit& init) {
  struct Impl final : Kernel {
    explicit Impl(const KernelInit& i) : params(i) {}
    void run(const KernelContext& ctx, std::span<const TensorView> in, std::span<const TensorView> out) const override {
      Fn(ctx, params, in, out);
    }
    Params params;
  };
  return std::make_unique<Impl>(init);
}

}  // namespace kiln::kernels
