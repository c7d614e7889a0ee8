#include "kiln/pipelines/weight_conversion.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <thread>
#include <vector>

#include "kiln/graph/quantization.h"

namespace kiln::pipelines {

namespace {

bool is_weight_float(DType d) { return d == DType::f32 || d == DType::f16 || d == DType::bf16; }

float load_float(const void* base, DType d, int64_t i) {
  switch (d) {
    case DType::f32: return static_cast<const float*>(base)[i];
    case DType::f16: return f16_to_f32(static_cast<const uint16_t*>(base)[i]);
    default: return bf16_to_f32(static_cast<const uint16_t*>(base)[i]);
  }
}

void store_float(void* base, DType d, int64_t i, float v) {
  switch (d) {
    case DType::f32: static_cast<float*>(base)[i] = v; break;
    case DType::f16: static_cast<uint16_t*>(base)[i] = f32_to_f16(v); break;
    default: static_cast<uint16_t*>(base)[i] = f32_to_bf16(v); break;
  }
}

// fn(begin, end) over [0, rows) split between up to `threads` threads, each part >= `min_rows`.
void parallel_rows(int64_t rows, int64_t min_rows, int threads, const std::function<void(int64_t, int64_t)>& fn) {
  const int64_t parts = std::clamp<int64_t>(rows / std::max<int64_t>(min_rows, 1), 1, threads);
  if (parts == 1) return fn(0, rows);
  std::vector<std::thread> workers;
  for (int64_t t = 1; t < parts; ++t) workers.emplace_back(fn, t * rows / parts, (t + 1) * rows / parts);
  fn(0, rows / parts);
  for (std::thread& w : workers) w.join();
}

std::string describe(const Tensor& t) {
  std::string s = fmt::format("{}[", dtype_name(t.dtype()));
  for (int64_t i = 0; i < t.rank(); ++i) s += fmt::format("{}{}", i ? ", " : "", t.shape()[i]);
  return s + "]";
}

Tensor convert_one(const std::string& name, const Tensor& source, const graph::Weight& decl, int threads) {
  const std::vector<int64_t> want = decl.shape.static_dims();
  if (source.dtype() == decl.dtype && source.shape() == want) return source;
  const auto fail = [&](std::string_view why) {
    return ValueError(fmt::format("convert_weights: weight '{}': {} (checkpoint {}, graph declares {})", name, why,
                                  describe(source), decl.type().to_string()));
  };
  if (!is_weight_float(source.dtype())) throw fail("only f32, f16 and bf16 tensors are converted");
  const Tensor src = source.contiguous();
  constexpr int64_t kMinElements = 1 << 16;  // per thread
  if (is_weight_float(decl.dtype)) {
    if (source.shape() != want) throw fail("shapes differ");
    Tensor out = Tensor::empty(decl.dtype, want);
    const int64_t n = src.numel();
    parallel_rows(n, kMinElements, threads, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) store_float(out.data(), decl.dtype, i, load_float(src.data(), src.dtype(), i));
    });
    return out;
  }
  if (decl.dtype != DType::u8 || want.size() != 2 || source.rank() != 2 || source.shape()[0] != want[0])
    throw fail("not a conversion between f32/f16/bf16 or to Q8_0 rows");
  const int64_t rows = want[0], cols = source.shape()[1];
  const int64_t row_bytes = graph::quantized_row_bytes(graph::QuantizationEncoding::q8_0, cols, name);
  if (row_bytes != want[1]) throw fail(fmt::format("q8_0 rows of {} weights are {} bytes", cols, row_bytes));
  Tensor out = Tensor::empty(DType::u8, want);
  parallel_rows(rows, std::max<int64_t>(1, kMinElements / cols), threads, [&](int64_t begin, int64_t end) {
    std::vector<float> row(static_cast<size_t>(cols));
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t c = 0; c < cols; ++c) row[static_cast<size_t>(c)] = load_float(src.data(), src.dtype(), r * cols + c);
      graph::quantize_q8_0(row.data(), cols, static_cast<uint8_t*>(out.data()) + r * row_bytes);
    }
  });
  return out;
}

}  // namespace

WeightsRegistry convert_weights(const WeightsRegistry& checkpoint, const std::map<std::string, graph::Weight>& declared,
                                int threads) {
  if (threads <= 0) threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  WeightsRegistry out = checkpoint;
  for (const auto& [name, decl] : declared) {
    auto it = checkpoint.find(name);
    if (it == checkpoint.end())
      throw ValueError(fmt::format("convert_weights: the checkpoint has no weight '{}' (graph declares {})", name,
                                   decl.type().to_string()));
    out[name] = convert_one(name, it->second, decl, threads);
  }
  return out;
}

}  // namespace kiln::pipelines
