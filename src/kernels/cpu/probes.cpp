// The public kiln/kernels/cpu_probes.h over the GEMM's private dispatch (gemm.h, gemm_amx.h).
#include "kiln/kernels/cpu_probes.h"

#include "kernels/cpu/gemm.h"
#include "kernels/cpu/gemm_amx.h"

namespace kiln::kernels {

bool amx_available() { return amx::available(); }

double run_amx_tile_chains(int64_t iterations) { return amx::run_tile_chains(iterations); }

bool bf16_dot_supported() { return gemm::isa_supported(gemm::Isa::avx512_bf16); }

bool gemm_uses_bf16_dot() { return gemm::best_isa() == gemm::Isa::avx512_bf16; }

}  // namespace kiln::kernels
