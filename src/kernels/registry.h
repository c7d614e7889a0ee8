// Private: a backend's kernels by (op, device kind, dtype): graph::KernelKey, which the compiler
// records per plan step (select_kernels) and the engine builds at init.
#pragma once

#include <initializer_list>
#include <map>
#include <memory>

#include "kernels/kernel.h"
#include "kiln/graph/kernel_key.h"

namespace kiln::kernels {

class KernelRegistry {
 public:
  void add(graph::Op op, DeviceKind device, std::initializer_list<DType> dtypes, KernelFactory make);
  bool contains(const graph::KernelKey& key) const { return table_.count(key) || legacy_.count(key); }
  // The kernel of `key` built from `init` (init.op is key.op), or nullptr when there is none.
  std::unique_ptr<const Kernel> build(const graph::KernelKey& key, const KernelInit& init) const;
  const KernelFactory* find(const graph::KernelKey& key) const;  // nullptr when there is none

  // Transitional, until every kernel file defines Kernel objects: kernels of the old signature
  // (graph::Attrs read per launch, prepared state through KernelContext::prepared).
  using LegacyFn = void (*)(const KernelContext&, const graph::Attrs&, std::span<const TensorView>,
                            std::span<const TensorView>);
  using LegacyPrepareFn = std::shared_ptr<const struct Prepared> (*)(const graph::Attrs&, std::span<const TensorView>,
                                                                     std::span<const bool>);
  void add(graph::Op op, DeviceKind device, std::initializer_list<DType> dtypes, LegacyFn fn);
  void add_prepare(graph::Op op, DeviceKind device, std::initializer_list<DType> dtypes, LegacyPrepareFn fn);
  LegacyFn find(graph::Op op, DeviceKind device, DType dtype) const;
  LegacyPrepareFn find_prepare(graph::Op op, DeviceKind device, DType dtype) const;

 private:
  std::unique_ptr<const Kernel> build_legacy(const graph::KernelKey& key, const KernelInit& init) const;
  std::map<graph::KernelKey, KernelFactory> table_;
  std::map<graph::KernelKey, std::pair<LegacyFn, LegacyPrepareFn>> legacy_;
};

}  // namespace kiln::kernels
