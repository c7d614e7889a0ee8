// Test helper: runs the GEMM / quantized kernels on a chosen ISA level, so every level this CPU
// supports is tested (the fallbacks too, on an AVX-512 machine).
#pragma once

#include <optional>
#include <vector>

#include "kernels/cpu/gemm.h"
#include "kernels/cpu/gemm_amx.h"

namespace kiln::kernels::kernel_test {

// Forces an ISA level for one scope, with AMX tiles off (they have their own tests), so a bf16
// product runs that level's kernel even where AMX would take it.
class ForcedIsa {
 public:
  explicit ForcedIsa(gemm::Isa isa) {
    gemm::force_isa_for_testing(isa);
    amx::disable_for_testing(true);
  }
  ~ForcedIsa() {
    gemm::force_isa_for_testing(std::nullopt);
    amx::disable_for_testing(false);
  }
  ForcedIsa(const ForcedIsa&) = delete;
  ForcedIsa& operator=(const ForcedIsa&) = delete;
};

inline std::vector<gemm::Isa> supported_isas() {
  std::vector<gemm::Isa> out;
  for (gemm::Isa isa : {gemm::Isa::generic, gemm::Isa::avx2, gemm::Isa::avx512, gemm::Isa::avx512_bf16})
    if (gemm::isa_supported(isa)) out.push_back(isa);
  return out;
}

}  // namespace kiln::kernels::kernel_test
