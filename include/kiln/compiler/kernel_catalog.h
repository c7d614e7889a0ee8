// What the compiler may ask of the kernels a model will run with, without depending on them: which
// (op, device kind, dtype) has a kernel, and the value of a small pure node on host arrays (constant
// folding). The engine implements it over its backends (InferenceSession::kernel_catalog()) and
// passes it in CompileOptions; a compile without one checks no kernel and folds nothing.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "kiln/graph/kernel_key.h"
#include "kiln/graph/op.h"

namespace kiln::compiler {

// Contiguous host memory of one operand or result.
struct HostArray {
  void* data = nullptr;
  DType dtype = DType::f32;
  std::vector<int64_t> shape;
};

class KernelCatalog {
 public:
  virtual ~KernelCatalog() = default;
  virtual bool has_kernel(const graph::KernelKey& key) const = 0;
  // Runs the kernel of `key` on host arrays; false when there is none or it refuses the data (bad
  // data is reported when the model runs, with the node named).
  virtual bool evaluate(const graph::KernelKey& key, const graph::Attrs& attrs, std::span<const HostArray> inputs,
                        std::span<const HostArray> outputs) const = 0;
  // Names the kernel set in compile cache keys: two catalogs with one fingerprint compile alike.
  virtual std::string fingerprint() const = 0;
};

}  // namespace kiln::compiler
