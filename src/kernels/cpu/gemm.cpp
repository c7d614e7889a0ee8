// The ISA-independent half of the SIMD GEMM: choosing the ISA level, splitting a problem between
// threads, and each thread's scratch memory. The loops themselves are in gemm_x86-inl.h.
#include "kernels/cpu/gemm.h"
#include "kernels/cpu/scratch.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "kernels/cpu/strided.h"
#include "tensor/host_memory.h"

namespace kiln::kernels::gemm {
namespace {

bool cpu_has_avx2() {
#if defined(__x86_64__)
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#else
  return false;
#endif
}
bool cpu_has_avx512() {
#if defined(__x86_64__)
  return cpu_has_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
#else
  return false;
#endif
}
bool cpu_has_avx512_bf16() {
#if defined(__x86_64__)
  return cpu_has_avx512() && __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

const IsaKernels* kernels_of(Isa isa) {
  switch (isa) {
    case Isa::avx2: return avx2_kernels();
    case Isa::avx512: return avx512_kernels();
    case Isa::avx512_bf16: return avx512_bf16_kernels();
    case Isa::generic: break;
  }
  return nullptr;
}

std::atomic<int> g_forced_isa{-1};

// Below this many multiply-adds per thread, waking another thread costs more than it saves.
constexpr int64_t kMinMacsPerThread = 32 * 1024;

// Each thread's scratch (the session's pool threads live as long as the session).
struct ThreadScratch {
  AlignedScratch<float> a, b, c;
};
thread_local ThreadScratch t_scratch;


bool packed_ahead(const Problem& p) { return p.packed_b || p.packed_b_narrow; }

// This thread's scratch for the GEMM over `rows` rows of p: A's row block, or for one row tile on B
// packed ahead the tile over the whole depth (gemm_one_tile; whichever is larger, so either loop
// fits), B's panels unless packed ahead, and the f32 accumulators of a 16-bit C.
Workspace gemm_workspace(const Blocking& b, const Problem& p, int64_t rows) {
  const int64_t one_tile = rows <= b.mr && packed_ahead(p) ? b.mr * p.K : 0;
  const int64_t a_floats = std::max(one_tile, (std::min(b.mc, rows) + b.mr) * b.kc);
  Workspace ws{t_scratch.a.get(static_cast<size_t>(a_floats)),
               packed_ahead(p) ? nullptr : t_scratch.b.get(static_cast<size_t>(b.kc * b.nc)), nullptr};
  if (p.dtype != DType::f32) ws.c_acc = t_scratch.c.get(static_cast<size_t>(rows * b.nc));
  return ws;
}

// Columns [n0, n1) of a small-M problem, on the calling thread. B packed at init runs the GEMM's own
// loops on its panels (n0 a multiple of nr), so every row gets the bits it gets at any M.
void run_small_m(const IsaKernels& k, const Problem& p, int64_t n0, int64_t n1) {
  if (packed_ahead(p)) return k.gemm(p, 0, p.M, n0, n1, gemm_workspace(k.blocking, p, p.M));
  Workspace ws{t_scratch.a.get(static_cast<size_t>(p.M * p.K)), nullptr, nullptr};
  k.small_m(p, n0, n1, ws);
}

// The columns one unit of run_group's split covers: a vector of 16, or a panel of packed B.
int64_t unit_columns(const IsaKernels& k, const Problem& p) { return packed_ahead(p) ? k.blocking.nr : 16; }

// Part `t` of `parts` of problem p, on the calling thread: panels of columns when there are enough
// of them, else groups of rows. A small-M problem (run_group splits those) runs whole.
void run_part(const IsaKernels& k, const Problem& p, int64_t t, int64_t parts) {
  const Blocking& b = k.blocking;
  if (small_m_applies(p)) return run_small_m(k, p, 0, p.N);
  const int64_t panels = (p.N + b.nr - 1) / b.nr, row_tiles = (p.M + b.mr - 1) / b.mr;
  int64_t m0 = 0, m1 = p.M, n0 = 0, n1 = p.N;
  // Columns, when there are enough of them: each thread packs only its own B panels, but all of A.
  // Rows, when B was packed at init and A is at least as large: no thread packs more than its share
  // of A, and B is only read (1024^3 on 2 threads: 94% of peak against 92%; M = 128 prefers columns).
  const bool packed = packed_ahead(p);
  const bool split_rows = (packed && p.M >= p.N && row_tiles >= 4 * parts) ||
                          (panels < 4 * parts && panels < row_tiles);
  if (!split_rows) {
    n0 = std::min(p.N, t * panels / parts * b.nr);
    n1 = std::min(p.N, (t + 1) * panels / parts * b.nr);
  } else {
    m0 = std::min(p.M, t * row_tiles / parts * b.mr);
    m1 = std::min(p.M, (t + 1) * row_tiles / parts * b.mr);
  }
  if (m0 >= m1 || n0 >= n1) return;
  k.gemm(p, m0, m1, n0, n1, gemm_workspace(b, p, m1 - m0));
}

// Handles what needs no kernel; true when nothing is left to do.
bool trivial(const Problem& p) {
  if (p.M == 0 || p.N == 0) return true;
  if (p.K > 0) return false;
  const size_t row_bytes = static_cast<size_t>(p.N) * dtype_size(p.dtype);
  for (int64_t m = 0; m < p.M; ++m)  // every f32/f16/bf16 zero is all-zero bits
    std::memset(static_cast<char*>(p.c) + m * p.ldc * dtype_size(p.dtype), 0, row_bytes);
  return true;
}

bool supported(const Problem& p) {
  if (p.b_storage != BStorage::same) return p.dtype == DType::f32;
  return p.dtype == DType::f32 || p.dtype == DType::f16 || p.dtype == DType::bf16;
}

}  // namespace

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::generic: return "generic";
    case Isa::avx2: return "avx2";
    case Isa::avx512: return "avx512";
    case Isa::avx512_bf16: return "avx512_bf16";
  }
  return "?";
}

bool isa_supported(Isa isa) {
  switch (isa) {
    case Isa::generic: return true;
    case Isa::avx2: return avx2_kernels() && cpu_has_avx2();
    case Isa::avx512: return avx512_kernels() && cpu_has_avx512();
    case Isa::avx512_bf16: return avx512_bf16_kernels() && cpu_has_avx512_bf16();
  }
  return false;
}

Isa best_isa() {
  static const Isa best = [] {
    // vdpbf16ps pays only where it outruns two FMAs: on AMD Zen 4/5 (double the f32 FMA rate per
    // flop). On the Intel Xeon (AMX-era) hosts measured it ran at a quarter of vfmadd231ps's
    // instruction rate, so bf16 widened in registers into the f32 kernel was 1.5x faster there.
    bool prefer_dot = false;
#if defined(__x86_64__)
    prefer_dot = __builtin_cpu_is("amd");
#endif
    for (Isa isa : {Isa::avx512_bf16, Isa::avx512, Isa::avx2})
      if (isa_supported(isa) && (isa != Isa::avx512_bf16 || prefer_dot)) return isa;
    return Isa::generic;
  }();
  return best;
}

Isa active_isa() {
  const int forced = g_forced_isa.load(std::memory_order_relaxed);
  return forced >= 0 ? static_cast<Isa>(forced) : best_isa();
}

void force_isa_for_testing(std::optional<Isa> isa) {
  if (isa && !isa_supported(*isa))
    throw ValueError(std::string("gemm: ISA level ") + isa_name(*isa) + " is not supported on this CPU");
  g_forced_isa.store(isa ? static_cast<int>(*isa) : -1, std::memory_order_relaxed);
}

std::optional<PackedB> pack_b(const Problem& p, const std::function<void(int64_t n0, int64_t n1)>& packed,
                              Parallel* parallel, const PackedCopies* copies) {
  const IsaKernels* k = kernels_of(active_isa());
  if (!k || p.dtype != DType::f32 || p.b_storage == BStorage::q8_0 || p.K <= 0 || p.N <= 0) return std::nullopt;
  const int64_t nr = k->blocking.nr, panels = (p.N + nr - 1) / nr;
  // Whole panels of about 8 MiB of B at a time, each reported once packed.
  const int64_t element = p.b_storage == BStorage::same ? 4 : 2;
  const int64_t slice_panels = std::max<int64_t>(1, (int64_t{8} << 20) / (nr * p.K * element));
  auto report = [&](int64_t q0, int64_t q1) {
    if (packed) packed(q0 * nr, std::min(p.N, q1 * nr));
  };
  // A slice's panels on the given threads, then reported: each thread packs the panels of B's columns
  // [q * nr, ...) as a problem of its own (panels are independent of the rest).
  const KernelContext build{parallel};
  auto slices = [&](auto&& pack_columns) {
    for (int64_t q0 = 0; q0 < panels; q0 += slice_panels) {
      const int64_t q1 = std::min(panels, q0 + slice_panels);
      parallel_for(build, q1 - q0, 1, [&](int64_t a, int64_t b) {
        Problem columns = p;
        columns.b = static_cast<const char*>(p.b) + (q0 + a) * nr * p.b_col * element;
        columns.N = std::min(p.N, (q0 + b) * nr) - (q0 + a) * nr;
        pack_columns(columns, q0 + a);
      });
      report(q0, q1);
    }
  };
  // The 16-bit elements moved as they are: B[k, n] -> panel n / nr, row k, lane n % nr; or in k pairs
  // (bf16 on a bf16_pairs level): row k / 2, lane n % nr, half k % 2, the depth made even.
  const bool narrow = p.b_storage == BStorage::f16 || p.b_storage == BStorage::bf16;
  const bool pairs = p.b_storage == BStorage::bf16 && k->bf16_pairs;
  const int64_t depth = pairs ? (p.K + 1) / 2 * 2 : p.K;
  const auto bytes = static_cast<size_t>(panels * nr * depth * (narrow ? 2 : 4));
  auto packed_b = [&](std::shared_ptr<const void> data) {
    return narrow ? PackedB{k->isa, p.K, p.N, nullptr, std::static_pointer_cast<const uint16_t>(std::move(data))}
                  : PackedB{k->isa, p.K, p.N, std::static_pointer_cast<const float>(std::move(data)), nullptr};
  };
  // Every parameter the panels' bytes depend on (their layout is this build's: the cache key has it).
  const std::string packing = fmt::format("gemm panels {} nr {} storage {} pairs {} K {} N {} b_row {} b_col {}",
                                          isa_name(k->isa), nr, static_cast<int>(p.b_storage), pairs, p.K, p.N,
                                          p.b_row, p.b_col);
  PackedBuffer buffer = copies ? copies->get(packing, bytes) : PackedBuffer{};
  if (buffer.filled) {
    report(0, panels);
    return packed_b(std::move(buffer.data));
  }
  void* memory = buffer.ensure(bytes);
  if (narrow) {
    auto* dst = static_cast<uint16_t*>(memory);
    slices([&](const Problem& columns, int64_t q) { k->pack_b_narrow(columns, pairs, dst + q * nr * depth); });
  } else {
    auto* dst = static_cast<float*>(memory);
    slices([&](const Problem& columns, int64_t q) { k->pack_b(columns, dst + q * nr * p.K); });
  }
  buffer.packed();
  return packed_b(std::move(buffer.data));
}

bool run_group(const KernelContext& ctx, std::span<const Problem> problems) {
  const IsaKernels* k = kernels_of(active_isa());
  if (!k) return false;
  for (const Problem& p : problems)
    if (!supported(p) || !small_m_applies(p)) return false;
  // unit_end[i]: the end of problem i's units of columns (unit_columns) in the concatenated list.
  std::vector<int64_t> unit_end;
  int64_t units = 0, macs = 0;
  for (const Problem& p : problems) {
    if (!trivial(p)) {
      const int64_t width = unit_columns(*k, p);
      units += (p.N + width - 1) / width;
      macs += p.M * p.N * p.K;
    }
    unit_end.push_back(units);
  }
  if (units == 0) return true;
  const int threads = ctx.parallel ? ctx.parallel->num_threads() : 1;
  const int64_t parts = std::clamp<int64_t>(macs / kMinMacsPerThread, 1, threads * kGemvPartsPerThread);
  // Part t: units [t * units / parts, (t + 1) * units / parts), which may span problems. Column
  // ranges start on a unit within each problem.
  auto run_units = [&](int64_t u0, int64_t u1) {
    int64_t first = 0;
    for (size_t i = 0; i < problems.size() && u0 < u1; first = unit_end[i++]) {
      if (u0 >= unit_end[i]) continue;
      const Problem& p = problems[i];
      const int64_t end = std::min(u1, unit_end[i]), width = unit_columns(*k, p);
      run_small_m(*k, p, (u0 - first) * width, std::min(p.N, (end - first) * width));
      u0 = end;
    }
  };
  if (parts == 1) {
    run_units(0, units);
    return true;
  }
  ctx.parallel->for_range(parts, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) run_units(t * units / parts, (t + 1) * units / parts);
  });
  return true;
}

bool small_m_applies(const Problem& p) {
  // f16 / bf16 above kSmallM rows: the chunks unless B was packed ahead (the GEMM is faster then), or
  // bf16 on a level that multiplies in bf16 above kBf16DotMinRows (packed ahead or not, so that the
  // rounding of the activations does not depend on it).
  const IsaKernels* k = kernels_of(active_isa());
  const bool bf16_dot = p.b_storage == BStorage::bf16 && k && k->bf16_pairs;
  const bool narrow = (p.b_storage == BStorage::f16 || (p.b_storage == BStorage::bf16 && !bf16_dot)) && !p.packed_b_narrow;
  return (p.M <= kSmallM || (narrow && p.M <= kNarrowSmallMMax)) && p.b_storage != BStorage::q8_0 &&
         (p.b_row == 1 || p.b_col == 1);
}

bool run(const KernelContext& ctx, const Problem& p) {
  const IsaKernels* k = kernels_of(active_isa());
  if (!k || !supported(p)) return false;
  if (small_m_applies(p)) return run_group(ctx, std::span(&p, 1));
  if (trivial(p)) return true;
  const int threads = ctx.parallel ? ctx.parallel->num_threads() : 1;
  // One part per thread: each packs its own blocks.
  const int64_t parts = std::clamp<int64_t>(p.M * p.N * p.K / kMinMacsPerThread, 1, threads);
  if (parts == 1) {
    run_part(*k, p, 0, 1);
    return true;
  }
  ctx.parallel->for_range(parts, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) run_part(*k, p, t, parts);
  });
  return true;
}

bool run_batched(const KernelContext& ctx, int64_t count, const std::function<Problem(int64_t)>& problem) {
  const IsaKernels* k = kernels_of(active_isa());
  if (count <= 0) return true;
  const Problem first = problem(0);
  if (!k || !supported(first)) return false;
  const int64_t macs = std::max<int64_t>(1, first.M * first.N * first.K);
  parallel_for(ctx, count, std::max<int64_t>(1, kMinMacsPerThread / macs), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const Problem p = problem(i);
      if (!trivial(p)) run_part(*k, p, 0, 1);
    }
  });
  return true;
}

}  // namespace kiln::kernels::gemm
