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
  bool contains(const graph::KernelKey& key) const { return table_.count(key) != 0; }
  // The kernel of `key` built from `init` (init.op is key.op), or nullptr when there is none.
  std::unique_ptr<const Kernel> build(const graph::KernelKey& key, const KernelInit& init) const;
  const KernelFactory* find(const graph::KernelKey& key) const;  // nullptr when there is none

 private:
  std::map<graph::KernelKey, KernelFactory> table_;
};

}  // namespace kiln::kernels
