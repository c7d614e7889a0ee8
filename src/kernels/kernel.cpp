#include "kernels/kernel.h"

#include <fmt/format.h>

#include "kernels/registry.h"
#include "kiln/errors.h"

namespace kiln::kernels {

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

bool TensorView::is_contiguous() const {
  int64_t expected = 1;
  for (size_t i = shape.size(); i-- > 0;) {
    if (shape[i] != 1 && strides[i] != expected) return false;
    expected *= shape[i];
  }
  return true;
}

std::string describe(const TensorView& v) {
  std::string s(dtype_name(v.dtype));
  s += '[';
  for (size_t i = 0; i < v.shape.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(v.shape[i]);
  }
  return s + ']';
}

void resolve(const KernelContext& ctx, const DimRefs& refs, std::vector<int64_t>& out) {
  out.resize(refs.size());
  for (size_t i = 0; i < refs.size(); ++i) out[i] = refs[i].get(ctx);
}

DimRef KernelInit::dim(const graph::Dim& d) const {
  if (auto value = d.try_static()) return {-1, *value};
  if (!symbols)
    throw ExecutionError(fmt::format("{}: parameter dim {} is symbolic, which needs a model run to evaluate",
                                 graph::op_name(op), d.to_string()));
  return {symbols->slot_of(d), 0};
}

DimRefs KernelInit::dims(const graph::Shape& shape) const {
  DimRefs refs;
  refs.reserve(static_cast<size_t>(shape.rank()));
  for (const graph::Dim& d : shape) refs.push_back(dim(d));
  return refs;
}

void KernelRegistry::add(graph::Op op, DeviceKind device, std::initializer_list<DType> dtypes, KernelFactory make) {
  for (DType d : dtypes) table_[{op, device, d}] = make;
}

const KernelFactory* KernelRegistry::find(const graph::KernelKey& key) const {
  auto it = table_.find(key);
  return it == table_.end() ? nullptr : &it->second;
}

std::unique_ptr<const Kernel> KernelRegistry::build(const graph::KernelKey& key, const KernelInit& init) const {
  const KernelFactory* make = find(key);
  return make ? (*make)(init) : nullptr;
}

}  // namespace kiln::kernels
