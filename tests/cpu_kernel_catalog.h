// The CPU kernels as the compiler sees them (CompileOptions::kernels), for tests that call the
// compiler or its passes directly, as an InferenceSession would.
#pragma once

#include "kiln/compiler/compiled_model.h"
#include "kiln/engine/session.h"

namespace kiln::testing {

inline const compiler::KernelCatalog& cpu_kernels() {
  static const engine::InferenceSession session({DeviceRef::CPU()}, {}, {.num_threads = 1, .compile_cache = false});
  return session.kernel_catalog();
}

// `options` with the CPU kernels.
inline compiler::CompileOptions with_cpu_kernels(compiler::CompileOptions options = {}) {
  options.kernels = &cpu_kernels();
  return options;
}

}  // namespace kiln::testing
