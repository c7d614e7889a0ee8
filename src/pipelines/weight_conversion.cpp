#include "kiln/pipelines/weight_conversion.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <thread>
#include <vector>

#include "kiln/graph/quantization.h"
#include "pipelines/derived_tensor.h"

namespace kiln::pipelines {

namespace {

bool is_weight_float(DType d) { return d == DType::f32 || d == DType::f16 || d == DType::bf16; }

// Calls fn.template operator()<T>() with T the storage type of an f32, f16 or bf16 element.
template <class Fn> void visit_weight_float(DType d, Fn&& fn) {
  switch (d) {
    case DType::f32: return fn.template operator()<float>();
    case DType::f16: return fn.template operator()<f16_t>();
    default: return fn.template operator()<bf16_t>();
  }
}

// dst[i] = src[i] for i in [begin, end), through f32 (f16/bf16 round to nearest even): one tight loop
// per dtype pair, not a dtype switch per element. dst_offset: dst[0] is element dst_offset of dst.
void convert_floats(const void* src, DType from, void* dst, DType to, int64_t begin, int64_t end,
                    int64_t dst_offset = 0) {
  visit_weight_float(from, [&]<class S>() {
    visit_weight_float(to, [&]<class D>() {
      const S* s = static_cast<const S*>(src);
      D* d = static_cast<D*>(dst);
      for (int64_t i = begin; i < end; ++i) d[i - dst_offset] = D(static_cast<float>(s[i]));
    });
  });
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

// The encoding a u8 declaration of rows `row_bytes` long asks for rows of `cols` weights (see the header).
std::optional<graph::QuantizationEncoding> encoding_for(int64_t cols, int64_t row_bytes,
                                                        std::optional<graph::QuantizationEncoding> preferred,
                                                        std::string& fits) {
  const auto fit = [&](graph::QuantizationEncoding e) {
    return cols % graph::block_size(e) == 0 && cols / graph::block_size(e) * graph::block_bytes(e) == row_bytes;
  };
  if (preferred && fit(*preferred)) return preferred;
  std::optional<graph::QuantizationEncoding> found;
  for (graph::QuantizationEncoding e : graph::kAllEncodings) {
    if (!fit(e)) continue;
    fits += fmt::format("{}{}", fits.empty() ? "" : " or ", graph::encoding_name(e));
    if (found) return std::nullopt;  // ambiguous
    found = e;
  }
  return found;
}

Tensor convert_one(const std::string& name, const Tensor& source, const graph::Weight& decl, int threads,
                   std::optional<graph::QuantizationEncoding> preferred, const engine::WeightCache* cache) {
  const std::vector<int64_t> want = decl.shape.static_dims();
  if (source.dtype() == decl.dtype && source.shape() == want) return source;
  const auto fail = [&](std::string_view why) {
    return ValueError(fmt::format("convert_weights: weight '{}': {} (checkpoint {}, graph declares {})", name, why,
                                  describe(source), decl.type().to_string()));
  };
  if (!is_weight_float(source.dtype())) throw fail("only f32, f16 and bf16 tensors are converted");
  const Tensor src = source.contiguous();
  constexpr int64_t kMinElements = 1 << 16;  // per thread
  // In the cache where the checkpoint is a mapped file's. The source's type is in the name: the same
  // bytes read as another shape would quantize into other rows.
  const auto output = [&](const std::string& conversion) {
    return derived_tensor(src, fmt::format("({}) {}", describe(src), conversion), decl.dtype, want, cache);
  };
  if (is_weight_float(decl.dtype)) {
    if (source.shape() != want) throw fail("shapes differ");
    DerivedTensor out = output(fmt::format("as {}", dtype_name(decl.dtype)));
    if (out.filled) return out.finish(src);
    const int64_t n = src.numel();
    parallel_rows(n, kMinElements, threads, [&](int64_t begin, int64_t end) {
      convert_floats(src.data(), src.dtype(), out.tensor.data(), decl.dtype, begin, end);
    });
    return out.finish(src);
  }
  if (decl.dtype != DType::u8 || want.size() != 2 || source.rank() != 2 || source.shape()[0] != want[0])
    throw fail("not a conversion between f32/f16/bf16 or to quantized rows");
  const int64_t rows = want[0], cols = source.shape()[1], row_bytes = want[1];
  std::string fits;
  const std::optional<graph::QuantizationEncoding> encoding = encoding_for(cols, row_bytes, preferred, fits);
  if (!encoding) {
    if (fits.empty()) {
      // Every encoding's blocks are 32 weights or a multiple: say so first, naming the weight.
      const int64_t q8_0 = graph::quantized_row_bytes(graph::QuantizationEncoding::q8_0, cols, name);
      throw fail(fmt::format("no encoding has rows of {} weights in {} bytes (q8_0's are {})", cols, row_bytes, q8_0));
    }
    throw fail(fmt::format("rows of {} weights in {} bytes are {}: pass the encoding", cols, row_bytes, fits));
  }
  DerivedTensor out = output(fmt::format("as {} rows", graph::encoding_name(*encoding)));
  if (out.filled) return out.finish(src);
  parallel_rows(rows, std::max<int64_t>(1, kMinElements / cols), threads, [&](int64_t begin, int64_t end) {
    std::vector<float> row(static_cast<size_t>(cols));
    for (int64_t r = begin; r < end; ++r) {
      convert_floats(src.data(), src.dtype(), row.data(), DType::f32, r * cols, (r + 1) * cols, r * cols);
      graph::quantize_row(*encoding, row.data(), cols, static_cast<uint8_t*>(out.tensor.data()) + r * row_bytes);
    }
  });
  return out.finish(src);
}

}  // namespace

WeightsRegistry convert_weights(const WeightsRegistry& checkpoint, const std::map<std::string, graph::Weight>& declared,
                                int threads, std::optional<graph::QuantizationEncoding> encoding,
                                const std::map<std::string, graph::QuantizationEncoding, std::less<>>& encodings,
                                const engine::WeightCache* cache) {
  if (threads <= 0) threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  WeightsRegistry out = checkpoint;
  for (const auto& [name, decl] : declared) {
    auto it = checkpoint.find(name);
    if (it == checkpoint.end())
      throw ValueError(fmt::format("convert_weights: the checkpoint has no weight '{}' (graph declares {})", name,
                                   decl.type().to_string()));
    const auto own = encodings.find(name);
    out[name] = convert_one(name, it->second, decl, threads, own != encodings.end() ? own->second : encoding, cache);
  }
  return out;
}

}  // namespace kiln::pipelines
