// CPU kernels of the source ops: constant and range. `weight` has none: the executor binds weights.
#include <cstring>

#include <fmt/format.h>

#include "kernels/cpu/convert.h"
#include "kernels/cpu/kernels.h"
#include "kernels/cpu/strided.h"

namespace kiln::kernels {
namespace {

using graph::Op;

// Attr "value": little-endian element bytes. A copy, as the attribute map need not outlive the kernel.
struct ConstantParams {
  graph::Bytes value;
  explicit ConstantParams(const KernelInit& init) : value(init.attr<graph::Bytes>("value")) {}
};

// Copies the value into the result.
void constant_kernel(const KernelContext&, const ConstantParams& params, std::span<const TensorView>,
                     std::span<const TensorView> outputs) {
  const graph::Bytes& value = params.value;
  const TensorView& out = outputs[0];
  const size_t bytes = static_cast<size_t>(out.numel()) * dtype_size(out.dtype);
  if (value.size() != bytes)
    throw ExecutionError(fmt::format("constant: value has {} bytes but the {} result of {} elements "
                                     "needs {}",
                                     value.size(), dtype_name(out.dtype), out.numel(), bytes));
  if (bytes != 0) std::memcpy(out.data, value.data(), bytes);
}

struct RangeParams {
  double start, step;
  explicit RangeParams(const KernelInit& init)
      : start(init.attr<double>("start")), step(init.attr<double>("step")) {}
};

// Element i is start + i * step, computed in double and converted as `cast` converts.
void range_kernel(const KernelContext& ctx, const RangeParams& params, std::span<const TensorView>,
                  std::span<const TensorView> outputs) {
  const double start = params.start, step = params.step;
  const TensorView& out = outputs[0];  // [size]
  visit_dtype(out.dtype, [&]<class T>() {
    T* o = out.as<T>();
    parallel_for(ctx, out.numel(), kElementwiseGrain, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i)
        o[i] = convert<T>(start + static_cast<double>(i) * step);
    });
  });
}

}  // namespace

void register_cpu_sources(KernelRegistry& r) {
  for (DType d : kAllDTypes) {
    r.add(Op::constant, DeviceKind::CPU, {d}, &with_params<ConstantParams, constant_kernel>);
    if (d != DType::boolean) r.add(Op::range, DeviceKind::CPU, {d}, &with_params<RangeParams, range_kernel>);
  }
}

}  // namespace kiln::kernels
