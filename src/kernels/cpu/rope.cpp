// CPU kernel of rope(x, cos, sin): rotary position embedding in its rotate-half form, one pass over
// x instead of the split, neg, concat and elementwise tail it replaces. Each product and the sum is
// rounded to x's dtype, as the unfused ops store them (and in the same order, without contraction
// into an fma), so the results equal the unfused graph's bit for bit.
#include <algorithm>

#include <fmt/format.h>

#include "kernels/cpu/convert.h"
#include "kernels/cpu/kernels.h"
#include "kernels/cpu/strided.h"

namespace kiln::kernels {
namespace {

using graph::Op;

// x [seq, heads, hd] and cos, sin [seq, hd] at any strides; out contiguous.
template <class T>
void rope_loop(const KernelContext& ctx, const TensorView& x, const TensorView& cos, const TensorView& sin,
               const TensorView& out) {
  using C = compute_t<T>;
  const int64_t seq = x.shape[0], heads = x.shape[1], hd = x.shape[2], half = hd / 2;
  const T* xs = x.as<T>();
  const T* cs = cos.as<T>();
  const T* ss = sin.as<T>();
  T* o = out.as<T>();
  // Rounds like a stored intermediate of the unfused graph (a no-op for f32 and f64).
  auto stored = [](C v) { return static_cast<C>(widen(convert<T>(v))); };
  parallel_for(ctx, seq * heads, std::max<int64_t>(1, kElementwiseGrain / hd), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t s = row / heads, h = row % heads;
      const T* xr = xs + s * x.strides[0] + h * x.strides[1];
      const T* cr = cs + s * cos.strides[0];
      const T* sr = ss + s * sin.strides[0];
      T* orow = o + row * hd;
      for (int64_t i = 0; i < hd; ++i) {
        const C xi = widen(xr[i * x.strides[2]]);
        const C partner = widen(xr[(i < half ? i + half : i - half) * x.strides[2]]);
        const C rotated = i < half ? -partner : partner;
        const C a = stored(xi * widen(cr[i * cos.strides[1]]));
        const C b = stored(rotated * widen(sr[i * sin.strides[1]]));
        orow[i] = convert<T>(b + a);
      }
    }
  });
}

void rope_kernel(const KernelContext& ctx, std::span<const TensorView> inputs,
                 std::span<const TensorView> outputs) {
  if (inputs.size() != 3 || outputs.size() != 1)
    throw ValueError(fmt::format("rope: expected 3 operands (x, cos, sin) and 1 result, got {} and {}",
                                 inputs.size(), outputs.size()));
  const TensorView &x = inputs[0], &cos = inputs[1], &sin = inputs[2], &out = outputs[0];
  if (x.shape.size() != 3 || cos.shape.size() != 2 || sin.shape != cos.shape || cos.shape[0] != x.shape[0] ||
      cos.shape[1] != x.shape[2] || x.shape[2] % 2 != 0)
    throw ShapeError(fmt::format("rope: expected x [seq, heads, head_dim] (head_dim even) and cos, sin "
                                 "[seq, head_dim]; got x {}, cos {}, sin {}",
                                 describe(x), describe(cos), describe(sin)));
  if (cos.dtype != x.dtype || sin.dtype != x.dtype)
    throw DTypeError(fmt::format("rope: x, cos and sin must share a float dtype; got x {}, cos {}, sin {}",
                                 describe(x), describe(cos), describe(sin)));
  if (out.shape != x.shape || out.dtype != x.dtype || !out.is_contiguous())
    throw ShapeError(fmt::format("rope: the result {} must be a contiguous {}", describe(out), describe(x)));
  switch (x.dtype) {
    case DType::f32: return rope_loop<float>(ctx, x, cos, sin, out);
    case DType::f64: return rope_loop<double>(ctx, x, cos, sin, out);
    case DType::f16: return rope_loop<f16_t>(ctx, x, cos, sin, out);
    case DType::bf16: return rope_loop<bf16_t>(ctx, x, cos, sin, out);
    default: break;
  }
  throw DTypeError(fmt::format("rope: the CPU kernel does not accept {}", describe(x)));
}

}  // namespace

void register_cpu_rope(KernelRegistry& r) {
  r.add(Op::rope, DeviceKind::CPU, {DType::f32, DType::f64, DType::f16, DType::bf16},
        &stateless<rope_kernel>);
}

}  // namespace kiln::kernels
