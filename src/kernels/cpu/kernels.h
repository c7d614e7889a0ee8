// Private: the CPU kernel interface and registry. A kernel sees its operands as strided views whose
// shapes are concrete; the executor allocates outputs (contiguous) before calling it.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <tuple>
#include <span>
#include <string>
#include <vector>

#include "kiln/distributed.h"
#include "kiln/graph/op.h"

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
inline std::string describe(const TensorView& v) {
  std::string s(dtype_name(v.dtype));
  s += '[';
  for (size_t i = 0; i < v.shape.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(v.shape[i]);
  }
  return s + ']';
}

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
// one persistent thread per device for this (engine/device_team.h).
class DeviceTeam {
 public:
  virtual ~DeviceTeam() = default;
  virtual void run(int n, const std::function<void(int)>& fn) = 0;
};

// What a kernel derives once from operands that never change between runs (weights, constants):
// weights packed into the layout its inner loop reads, for instance. The executor builds it at init
// for each step whose kernel has a prepare function and hands it back on every launch.
struct Prepared {
  virtual ~Prepared() = default;
};

struct KernelContext {
  Parallel* parallel = nullptr;
  DeviceTeam* team = nullptr;              // for collectives over several devices
  ProcessGroup* process_group = nullptr;   // for collectives with processes > 1
  const Prepared* prepared = nullptr;      // this step's prepared state, or nullptr
};

// inputs/outputs follow the node's operand/result order; attrs are the node's (see op.h).
// A kernel reports bad input by throwing (Error subclasses); the executor adds the op and node.
using KernelFn = void (*)(const KernelContext&, const graph::Attrs&, std::span<const TensorView> inputs,
                          std::span<const TensorView> outputs);

// Called at init with the step's operands: those fixed for the model's life (`fixed[i]`) have their
// data; the others have data == nullptr and their static shape, or no shape when it is symbolic.
// Returns nullptr when there is nothing worth preparing. A kernel must give the same results with
// and without its prepared state (a launch list or another engine may run it without).
using PrepareFn = std::shared_ptr<const Prepared> (*)(const graph::Attrs&, std::span<const TensorView> inputs,
                                                      std::span<const bool> fixed);

// The dtype a kernel is registered under: the first operand's, or the first result's for ops without
// operands (constant, range, weight).
DType kernel_dtype(graph::Op op, const std::vector<DType>& input_dtypes,
                   const std::vector<DType>& output_dtypes);

// (op, device kind, dtype) -> kernel, or nullptr when there is none.
class KernelRegistry {
 public:
  void add(graph::Op op, DeviceKind device, std::initializer_list<DType> dtypes, KernelFn fn);
  KernelFn find(graph::Op op, DeviceKind device, DType dtype) const;
  void add_prepare(graph::Op op, DeviceKind device, std::initializer_list<DType> dtypes, PrepareFn fn);
  PrepareFn find_prepare(graph::Op op, DeviceKind device, DType dtype) const;

 private:
  std::map<std::tuple<graph::Op, DeviceKind, DType>, KernelFn> table_;
  std::map<std::tuple<graph::Op, DeviceKind, DType>, PrepareFn> prepare_table_;
};

// The built-in kernels, registered on first use. Explicit registration (not static initialisers),
// because a static library drops object files nothing references.
const KernelRegistry& builtin_kernels();

// Each kernel file registers its kernels with one line per (op, dtypes) entry; builtin_kernels()
// calls these.
void register_cpu_elementwise(KernelRegistry&);
void register_cpu_reductions(KernelRegistry&);
void register_cpu_matmul(KernelRegistry&);
void register_cpu_normalization(KernelRegistry&);
void register_cpu_data_movement(KernelRegistry&);
void register_cpu_sources(KernelRegistry&);
void register_cpu_collectives(KernelRegistry&);
void register_cpu_fused(KernelRegistry&);
void register_cpu_attention(KernelRegistry&);
void register_cpu_rope(KernelRegistry&);
void register_cpu_grouped_matmul(KernelRegistry&);  // looks matmul / qmatmul up in the registry

}  // namespace kiln::kernels
