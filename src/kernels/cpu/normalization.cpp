// Normalizations along one axis: softmax and log_softmax (attr axis; max-subtracted so large logits
// do not overflow), rms_norm(x, weight) and layer_norm(x, gamma, beta) over the last axis (attr
// epsilon; layer_norm uses the biased variance, as PyTorch does). The input may be strided; results
// are contiguous. f64 computes in f64; f32, f16 and bf16 in f32, with sums accumulated in f64 for
// f32 (one exp per element dominates, the wider sum is free).
#include <algorithm>
#include <array>
#include <cmath>
#include <type_traits>
#include <vector>

#include "kernels/cpu/kernels.h"
#include "kernels/cpu/strided.h"

namespace kiln::kernels {
namespace {

using graph::Op;

template <class T> using compute_t = std::conditional_t<std::is_same_v<T, double>, double, float>;
template <class T> using sum_t = std::conditional_t<std::is_same_v<T, float>, double, compute_t<T>>;

std::string op_str(Op op) { return std::string(graph::op_name(op)); }

// The lines of `in` along `axis`, in row-major order of the other dims, and their walk.
struct Lines {
  int64_t length = 0;  // elements per line
  int64_t stride = 0;  // input stride along the axis
  int64_t count = 1;   // number of lines
  int64_t inner = 1;   // product of the dims after the axis: a contiguous result's axis stride
  std::vector<int64_t> outer_shape, outer_strides;

  Lines(const TensorView& in, int64_t axis) : length(in.shape[axis]), stride(in.strides[axis]) {
    for (int64_t d = 0; d < static_cast<int64_t>(in.shape.size()); ++d) {
      if (d == axis) continue;
      outer_shape.push_back(in.shape[d]);
      outer_strides.push_back(in.strides[d]);
      count *= in.shape[d];
      if (d > axis) inner *= in.shape[d];
    }
  }

  // Calls fn(first_result_offset, input_base) for every line, in parallel chunks of lines.
  template <class Fn> void for_each(const KernelContext& ctx, Fn&& fn) const {
    // Normalizations cost a few times a copy per element; this keeps chunks around 4k elements.
    const int64_t grain = std::max<int64_t>(1, kElementwiseGrain / 4 / std::max<int64_t>(1, length));
    const std::array<const int64_t*, 1> strides{outer_strides.data()};
    const int64_t step = outer_strides.empty() ? 0 : outer_strides.back();
    parallel_for(ctx, count, grain, [&](int64_t begin, int64_t end) {
      for_each_run<1>(outer_shape, strides, begin, end,
                      [&](int64_t first, const std::array<int64_t, 1>& off, int64_t n) {
                        for (int64_t j = 0; j < n; ++j) {
                          const int64_t line = first + j;
                          fn((line / inner) * length * inner + line % inner, off[0] + j * step);
                        }
                      });
    });
  }
};

void check_same_result(Op op, const TensorView& x, const TensorView& out) {
  if (out.shape != x.shape || out.dtype != x.dtype)
    throw ShapeError(op_str(op) + ": result " + describe(out) + " should be " + describe(x));
  if (!out.is_contiguous()) throw ValueError(op_str(op) + ": the result view must be contiguous");
}

void check_arity(Op op, std::span<const TensorView> inputs, std::span<const TensorView> outputs,
                 size_t num_inputs) {
  if (inputs.size() != num_inputs || outputs.size() != 1)
    throw ValueError(op_str(op) + ": expected " + std::to_string(num_inputs) + " operand(s) and 1 result, got " +
                     std::to_string(inputs.size()) + " and " + std::to_string(outputs.size()));
}

// ---- softmax, log_softmax -----------------------------------------------------------------------

// The axis as given: negative counts from the end of the input's rank, known only at launch.
struct SoftmaxParams {
  int64_t axis;
  explicit SoftmaxParams(const KernelInit& init) : axis(init.attr<int64_t>("axis")) {}
};

template <Op kOp>
void softmax_kernel(const KernelContext& ctx, const SoftmaxParams& params, std::span<const TensorView> inputs,
                    std::span<const TensorView> outputs) {
  check_arity(kOp, inputs, outputs, 1);
  const TensorView &x = inputs[0], &out = outputs[0];
  const int64_t rank = static_cast<int64_t>(x.shape.size());
  int64_t axis = params.axis;
  if (axis < 0) axis += rank;
  if (axis < 0 || axis >= rank)
    throw ValueError(op_str(kOp) + ": axis " + std::to_string(params.axis) + " is out of range for " +
                     describe(x));
  check_same_result(kOp, x, out);
  const Lines lines(x, axis);
  visit_dtype(x.dtype, [&]<class T>() {
    if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double> || std::is_same_v<T, f16_t> ||
                  std::is_same_v<T, bf16_t>) {
      using C = compute_t<T>;
      using S = sum_t<T>;
      const T* in = x.as<T>();
      T* y = out.as<T>();
      lines.for_each(ctx, [&](int64_t result, int64_t base) {
        thread_local std::vector<C> row;
        row.resize(static_cast<size_t>(lines.length));
        C max = -INFINITY;
        for (int64_t t = 0; t < lines.length; ++t) {
          row[t] = static_cast<C>(in[base + t * lines.stride]);
          if (!(row[t] <= max)) max = row[t];  // a NaN becomes the max, so the whole line is NaN
        }
        // A line of -inf has no finite max; subtracting 0 instead keeps exp(-inf) = 0 (then 0 / 0).
        const C shift = max == -INFINITY ? C(0) : max;
        S sum = 0;
        for (int64_t t = 0; t < lines.length; ++t) sum += static_cast<S>(std::exp(row[t] - shift));
        if constexpr (kOp == Op::softmax) {
          const C scale = static_cast<C>(S(1) / sum);
          for (int64_t t = 0; t < lines.length; ++t)
            y[result + t * lines.inner] = static_cast<T>(std::exp(row[t] - shift) * scale);
        } else {
          const C log_sum = static_cast<C>(std::log(sum));
          for (int64_t t = 0; t < lines.length; ++t)
            y[result + t * lines.inner] = static_cast<T>(row[t] - shift - log_sum);
        }
      });
    } else {
      throw DTypeError(op_str(kOp) + ": input must be a float dtype, got " + describe(x));
    }
  });
}

// ---- rms_norm, layer_norm ----------------------------------------------------------------------------

struct NormParams {
  double epsilon;
  explicit NormParams(const KernelInit& init) : epsilon(init.attr<double>("epsilon")) {}
};

// sum_t row[t]^2 in S, in 8 running sums (t mod 8) added at the end: one chain of dependent adds
// waits 4 cycles per element; 8 chains the compiler keeps in vectors. llama-1B decode's 33 norms of
// 2048 took 181 us per token before, 148-158 after (Zen 4, the rest is the launches' own cost).
template <class S, class C>
S sum_of_squares(const C* row, int64_t n) {
  constexpr int kChains = 8;
  S chains[kChains] = {};
  int64_t t = 0;
  for (; t + kChains <= n; t += kChains)
    for (int c = 0; c < kChains; ++c) chains[c] += static_cast<S>(row[t + c] * row[t + c]);
  for (; t < n; ++t) chains[t % kChains] += static_cast<S>(row[t] * row[t]);
  S total = 0;
  for (const S chain : chains) total += chain;
  return total;
}

template <Op kOp>
void norm_kernel(const KernelContext& ctx, const NormParams& params, std::span<const TensorView> inputs,
                 std::span<const TensorView> outputs) {
  constexpr bool kLayer = kOp == Op::layer_norm;
  check_arity(kOp, inputs, outputs, kLayer ? 3 : 2);
  const TensorView &x = inputs[0], &out = outputs[0];
  if (x.shape.empty()) throw ShapeError(op_str(kOp) + ": x must have rank >= 1, got " + describe(x));
  const int64_t dim = x.shape.back();
  const char* names[] = {"x", kLayer ? "gamma" : "weight", "beta"};
  for (size_t i = 1; i < inputs.size(); ++i) {
    const TensorView& p = inputs[i];
    if (p.dtype != x.dtype)
      throw DTypeError(op_str(kOp) + ": " + names[i] + " " + describe(p) + " must have x's dtype (x " +
                       describe(x) + ")");
    if (p.shape.size() != 1 || p.shape[0] != dim)
      throw ShapeError(op_str(kOp) + ": " + names[i] + " " + describe(p) + " must be [" + std::to_string(dim) +
                       "] (x's last dim; x " + describe(x) + ")");
  }
  check_same_result(kOp, x, out);
  const double epsilon = params.epsilon;
  const Lines lines(x, static_cast<int64_t>(x.shape.size()) - 1);
  visit_dtype(x.dtype, [&]<class T>() {
    if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double> || std::is_same_v<T, f16_t> ||
                  std::is_same_v<T, bf16_t>) {
      using C = compute_t<T>;
      using S = sum_t<T>;
      const T* in = x.as<T>();
      const T* w = inputs[1].as<T>();
      const int64_t ws = inputs[1].strides[0];
      const T* b = kLayer ? inputs[2].as<T>() : nullptr;
      const int64_t bs = kLayer ? inputs[2].strides[0] : 0;
      T* y = out.as<T>();
      lines.for_each(ctx, [&](int64_t result, int64_t base) {
        thread_local std::vector<C> row;
        row.resize(static_cast<size_t>(dim));
        if (lines.stride == 1)  // the common case, in a loop the compiler vectorizes
          for (int64_t t = 0; t < dim; ++t) row[t] = static_cast<C>(in[base + t]);
        else
          for (int64_t t = 0; t < dim; ++t) row[t] = static_cast<C>(in[base + t * lines.stride]);
        if constexpr (kLayer) {
          // Two passes (mean, then squared deviations) stay accurate when |mean| >> stddev.
          S total = 0;
          for (int64_t t = 0; t < dim; ++t) total += row[t];
          const C mean = static_cast<C>(total / static_cast<S>(dim));
          S squares = 0;
          for (int64_t t = 0; t < dim; ++t) squares += static_cast<S>((row[t] - mean) * (row[t] - mean));
          const C inv_std =
              static_cast<C>(S(1) / std::sqrt(squares / static_cast<S>(dim) + static_cast<S>(epsilon)));
          for (int64_t t = 0; t < dim; ++t)
            y[result + t] = static_cast<T>((row[t] - mean) * inv_std * static_cast<C>(w[t * ws]) +
                                           static_cast<C>(b[t * bs]));
        } else {
          const S squares = sum_of_squares<S>(row.data(), dim);
          const C inv_rms =
              static_cast<C>(S(1) / std::sqrt(squares / static_cast<S>(dim) + static_cast<S>(epsilon)));
          if (ws == 1)
            for (int64_t t = 0; t < dim; ++t) y[result + t] = static_cast<T>(row[t] * inv_rms * static_cast<C>(w[t]));
          else
            for (int64_t t = 0; t < dim; ++t)
              y[result + t] = static_cast<T>(row[t] * inv_rms * static_cast<C>(w[t * ws]));
        }
      });
    } else {
      throw DTypeError(op_str(kOp) + ": x must be a float dtype, got " + describe(x));
    }
  });
}

}  // namespace

void register_cpu_normalization(KernelRegistry& r) {
  const std::initializer_list<DType> kFloat = {DType::f32, DType::f64, DType::f16, DType::bf16};
  r.add(Op::softmax, DeviceKind::CPU, kFloat, &with_params<SoftmaxParams, softmax_kernel<Op::softmax>>);
  r.add(Op::log_softmax, DeviceKind::CPU, kFloat,
        &with_params<SoftmaxParams, softmax_kernel<Op::log_softmax>>);
  r.add(Op::rms_norm, DeviceKind::CPU, kFloat, &with_params<NormParams, norm_kernel<Op::rms_norm>>);
  r.add(Op::layer_norm, DeviceKind::CPU, kFloat, &with_params<NormParams, norm_kernel<Op::layer_norm>>);
}

}  // namespace kiln::kernels
