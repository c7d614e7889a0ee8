// What kiln's CPU kernels run on in this process, for benchmarks that set kiln's figures beside the
// machine's peaks (`kiln bench gemm`): which multiply-add units the GEMM uses, and the AMX tiles'
// peak loop. Each answer holds for the process's lifetime.
//
//   if (kiln::kernels::amx_available()) flops = kiln::kernels::run_amx_tile_chains(iterations);  // time it
#pragma once

#include <cstdint>

namespace kiln::kernels {

// bf16 GEMMs with more than a few rows run on Intel AMX tiles (tdpbf16ps): the CPU has AMX-BF16 and
// the OS granted this process the tile data state (docs/amx.md).
bool amx_available();
// Runs `iterations` rounds of tdpbf16ps on four independent accumulator tiles, with no memory
// traffic, and returns the FLOPs done: timed on every thread, the tiles' bf16 peak. ValueError
// unless amx_available().
double run_amx_tile_chains(int64_t iterations);

// kiln's AVX512_BF16 GEMM kernels (vdpbf16ps) are compiled in and this CPU runs them.
bool bf16_dot_supported();
// kiln's SIMD GEMM chooses those vdpbf16ps kernels for bf16 products on this CPU, which it does only
// where vdpbf16ps outruns two FMAs (AMD Zen 4/5); elsewhere bf16 is widened into the f32 FMA kernels.
bool gemm_uses_bf16_dot();

}  // namespace kiln::kernels
