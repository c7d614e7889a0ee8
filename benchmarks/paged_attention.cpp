// paged_attention in batched decode: S sequences of L cached positions each, one new token per
// sequence, at llama-1B's geometry (32 query heads over 8 kv heads, head_dim 64, blocks of 16) or
// stories110M's (12 heads, each its own kv head), with an f32, bf16 or f16 cache, from cache or
// (cold: 1) from DRAM. Reports the KV bytes read per second (each sequence's K and V once) and
// tokens per second. At 16 x 2048 the f32 cache is 128 MiB a layer (K and V), so it comes from DRAM.
//
//   build/bench_paged_attention --benchmark_filter='f32/16/'
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <utility>
#include <vector>

#include "engine/cpu/thread_pool.h"
#include "kernels/cpu/kernels.h"
#include "kiln/graph/dtype.h"
#include "tensor/host_memory.h"

namespace {

using kiln::DType;
using kiln::kernels::TensorView;

constexpr int64_t kHeadDim = 64, kBlockSize = 16;

void decode(benchmark::State& state, DType cache_dtype) {
  const int64_t seqs = state.range(0), length = state.range(1), heads = state.range(3), kv_heads = state.range(4);
  kiln::engine::ThreadPool pool(static_cast<int>(state.range(2)));
  const kiln::kernels::KernelContext ctx{&pool};
  const int64_t blocks_per_seq = (length + kBlockSize - 1) / kBlockSize;
  const int64_t elem = kiln::dtype_size(cache_dtype);
  // cold: the sequences' blocks in as many copies as fill 512 MiB, one copy a launch, so K and V
  // come from DRAM as in a model's decode step (the weights streamed since evicted its cache).
  const int64_t copy_bytes = 2 * seqs * blocks_per_seq * kBlockSize * kv_heads * kHeadDim * elem;
  const int64_t copies = state.range(5) ? std::max<int64_t>(1, (int64_t{512} << 20) / copy_bytes) : 1;
  const int64_t blocks = copies * seqs * blocks_per_seq;
  const int64_t cache_elems = blocks * kBlockSize * kv_heads * kHeadDim;
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  // The engine's allocator, as its caches have: huge pages, so the TLB is not what is measured.
  auto random_cache = [&] {
    std::unique_ptr<uint8_t, decltype(&std::free)> bytes(
        static_cast<uint8_t*>(kiln::allocate_aligned(static_cast<size_t>(cache_elems * elem))), &std::free);
    for (int64_t i = 0; i < cache_elems; ++i) {
      const float x = dist(rng);
      if (cache_dtype != DType::f32) {
        const uint16_t h = cache_dtype == DType::bf16 ? kiln::f32_to_bf16(x) : kiln::f32_to_f16(x);
        std::memcpy(bytes.get() + i * 2, &h, 2);
      } else {
        std::memcpy(bytes.get() + i * 4, &x, 4);
      }
    }
    return bytes;
  };
  const auto k = random_cache(), v = random_cache();
  std::vector<float> q(static_cast<size_t>(seqs * heads * kHeadDim)), out(q.size());
  for (float& x : q) x = dist(rng);
  // Sequence s owns blocks [s * blocks_per_seq, (s + 1) * blocks_per_seq), in reverse order.
  // Copy c's tables at c * seqs * blocks_per_seq.
  std::vector<int64_t> tables(static_cast<size_t>(copies * seqs * blocks_per_seq)), seq_ids(static_cast<size_t>(seqs)),
      positions(static_cast<size_t>(seqs), length - 1);
  for (int64_t s = 0; s < seqs; ++s) seq_ids[static_cast<size_t>(s)] = s;
  for (int64_t c = 0; c < copies; ++c)
    for (int64_t s = 0; s < seqs; ++s)
      for (int64_t j = 0; j < blocks_per_seq; ++j)
        tables[static_cast<size_t>((c * seqs + s) * blocks_per_seq + j)] = (c * seqs + s + 1) * blocks_per_seq - 1 - j;
  const std::vector<int64_t> cache_shape{1, blocks, kBlockSize, kv_heads, kHeadDim};
  const std::vector<int64_t> cache_strides{blocks * kBlockSize * kv_heads * kHeadDim, kBlockSize * kv_heads * kHeadDim,
                                           kv_heads * kHeadDim, kHeadDim, 1};
  std::vector<TensorView> inputs{
      TensorView{q.data(), DType::f32, {seqs, heads, kHeadDim}, {heads * kHeadDim, kHeadDim, 1}},
      TensorView{k.get(), cache_dtype, cache_shape, cache_strides},
      TensorView{v.get(), cache_dtype, cache_shape, cache_strides},
      TensorView{tables.data(), DType::i64, {seqs, blocks_per_seq}, {blocks_per_seq, 1}},
      TensorView{seq_ids.data(), DType::i64, {seqs}, {1}},
      TensorView{positions.data(), DType::i64, {seqs}, {1}}};
  const std::vector<TensorView> outputs{
      TensorView{out.data(), DType::f32, {seqs, heads, kHeadDim}, {heads * kHeadDim, kHeadDim, 1}}};
  const kiln::graph::Attrs attrs{{"layer", int64_t{0}}, {"scale", 0.125}};
  const auto op = kiln::graph::Op::paged_attention;
  const auto kernel = kiln::kernels::cpu_kernels().build({op, kiln::DeviceKind::CPU, DType::f32},
                                                         {op, &attrs, inputs, {}, nullptr});
  int64_t copy = 0;
  for (auto _ : state) {
    inputs[3].data = tables.data() + copy * seqs * blocks_per_seq;
    copy = (copy + 1) % copies;
    kernel->run(ctx, inputs, outputs);
    benchmark::DoNotOptimize(out.data());
  }
  state.counters["KV B/s"] = benchmark::Counter(static_cast<double>(2 * seqs * length * kv_heads * kHeadDim * elem),
                                                benchmark::Counter::kIsIterationInvariantRate);
  state.counters["tokens/s"] =
      benchmark::Counter(static_cast<double>(seqs), benchmark::Counter::kIsIterationInvariantRate);
}

void BM_f32(benchmark::State& state) { decode(state, DType::f32); }
void BM_bf16(benchmark::State& state) { decode(state, DType::bf16); }
void BM_f16(benchmark::State& state) { decode(state, DType::f16); }

void shapes(benchmark::internal::Benchmark* b) {
  b->ArgNames({"seqs", "length", "threads", "heads", "kv_heads", "cold"});
  for (int64_t threads : {1, 2})
    for (int64_t length : {64, 512, 2048}) b->Args({16, length, threads, 32, 8, 0});
  b->Args({1, 4096, 1, 32, 8, 0});
  for (int64_t threads : {1, 2}) b->Args({1, 48, threads, 32, 8, 0});  // one stream, a short context: the launch itself
  // kiln bench's decode (128 + 64 positions), llama-1B's and stories110M's heads, from cache and DRAM
  for (const auto& [heads, kv_heads] : {std::pair<int64_t, int64_t>{32, 8}, {12, 12}})
    for (int64_t cold : {0, 1})
      for (int64_t threads : {1, 2}) b->Args({1, 192, threads, heads, kv_heads, cold});
}

}  // namespace

BENCHMARK(BM_f32)->Apply(shapes)->UseRealTime();
BENCHMARK(BM_bf16)->Apply(shapes)->UseRealTime();
BENCHMARK(BM_f16)->Apply(shapes)->UseRealTime();
BENCHMARK_MAIN();
