#include <algorithm>

#include <fmt/format.h>

#include "engine/backend.h"
#include "kiln/errors.h"

namespace kiln::engine {

Backends::Backends(std::vector<std::shared_ptr<Backend>> backends) : backends_(std::move(backends)) {
  for (size_t i = 0; i < backends_.size(); ++i) {
    if (!backends_[i]) throw ValueError(fmt::format("backends: entry {} is null", i));
    for (size_t j = 0; j < i; ++j)
      if (backends_[j]->kind() == backends_[i]->kind())
        throw ValueError(fmt::format("backends: two backends for device kind {} ('{}' and '{}')",
                                     device_kind_name(backends_[i]->kind()), backends_[j]->name(),
                                     backends_[i]->name()));
  }
}

const Backend* Backends::find(DeviceKind kind) const {
  for (const auto& b : backends_)
    if (b->kind() == kind) return b.get();
  return nullptr;
}

const Backend& Backends::at(DeviceKind kind) const {
  if (const Backend* b = find(kind)) return *b;
  throw ValueError(fmt::format("no backend runs {} devices in this session", device_kind_name(kind)));
}

bool Backends::has_kernel(const graph::KernelKey& key) const {
  const Backend* b = find(key.device);
  return b && b->kernels().contains(key);
}

bool Backends::evaluate(const graph::KernelKey& key, const graph::Attrs& attrs,
                        std::span<const compiler::HostArray> inputs,
                        std::span<const compiler::HostArray> outputs) const {
  const Backend* b = find(key.device);
  if (!b || !b->host_memory() || !b->kernels().contains(key)) return false;
  auto view = [](const compiler::HostArray& a) {
    return kernels::TensorView{a.data, a.dtype, a.shape, contiguous_strides(a.shape)};
  };
  std::vector<kernels::TensorView> in, out;
  for (const auto& a : inputs) in.push_back(view(a));
  for (const auto& a : outputs) out.push_back(view(a));
  auto fixed = std::make_unique<bool[]>(in.size());
  std::fill(fixed.get(), fixed.get() + in.size(), true);
  try {
    const kernels::KernelInit init{key.op, &attrs, in, std::span<const bool>(fixed.get(), in.size()), nullptr};
    std::unique_ptr<const kernels::Kernel> kernel = b->kernels().build(key, init);
    kernels::SerialParallel serial;
    kernels::KernelContext ctx;
    ctx.parallel = &serial;
    kernel->run(ctx, in, out);
  } catch (const Error&) {
    return false;  // bad data (an index out of range, say) is reported when the model runs
  }
  return true;
}

std::string Backends::fingerprint() const {
  std::string names;
  for (const auto& b : backends_) names += (names.empty() ? "" : ",") + b->name();
  return names;
}

}  // namespace kiln::engine
