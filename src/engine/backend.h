// Private: everything device-specific the engine needs for one kind of device: its kernels, its
// memory, its threads. A session holds one backend per device kind it runs on (the CPU's, and any a
// caller adds through SessionOptions::backends); the executor and the compiler reach devices only
// through them, so they name no device kind.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "kernels/kernel.h"
#include "kernels/registry.h"
#include "kiln/compiler/kernel_catalog.h"
#include "kiln/tensor/tensor.h"

namespace kiln::engine {

class Backend {
 public:
  virtual ~Backend() = default;
  virtual DeviceKind kind() const = 0;
  // Names its kernel set in compile cache keys ("cpu"): a backend with other kernels needs another name.
  virtual std::string name() const = 0;
  virtual const kernels::KernelRegistry& kernels() const = 0;
  // Its memory is the host's, so its kernels can also run on host arrays (constant folding).
  virtual bool host_memory() const = 0;
  // Fresh contiguous memory for a tensor on `device` (of this kind); its contents are undefined.
  virtual Tensor allocate(DType dtype, const std::vector<int64_t>& shape, DeviceRef device) const = 0;
  // dst = src: both of this kind, one dtype and shape; src may be strided, dst is contiguous.
  virtual void copy(const Tensor& dst, const Tensor& src) const = 0;
  // The threads this kind's kernels split their work over, and the team its collectives run on.
  virtual kernels::Parallel* parallel() const = 0;
  virtual kernels::DeviceTeam* team() const = 0;
};

// The CPU backend (engine/cpu/backend.cpp): the CPU kernels, the session's thread pool
// (num_threads, 0: one per core) and one team thread per extra device.
std::shared_ptr<Backend> make_cpu_backend(int num_threads);
// Appends make_cpu_backend(num_threads) to `backends` unless one of them already runs cpu devices.
void add_cpu_backend_unless_given(std::vector<std::shared_ptr<Backend>>& backends, int num_threads);

// A session's backends by device kind; as a compiler::KernelCatalog, what the compiler may ask of
// their kernels.
class Backends final : public compiler::KernelCatalog {
 public:
  explicit Backends(std::vector<std::shared_ptr<Backend>> backends);
  const Backend* find(DeviceKind kind) const;  // nullptr when there is none
  const Backend& at(DeviceKind kind) const;    // ValueError naming the kind when there is none

  bool has_kernel(const graph::KernelKey& key) const override;
  bool evaluate(const graph::KernelKey& key, const graph::Attrs& attrs, std::span<const compiler::HostArray> inputs,
                std::span<const compiler::HostArray> outputs) const override;
  std::string fingerprint() const override;

 private:
  std::vector<std::shared_ptr<Backend>> backends_;
};

}  // namespace kiln::engine
