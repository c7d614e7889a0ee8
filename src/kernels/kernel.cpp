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
  if (const KernelFactory* make = find(key)) return (*make)(init);
  return build_legacy(key, init);
}

// ---- transitional: legacy kernels ------------------------------------------------------------------

namespace {

// Reads the attributes per launch, as the old signature wants; a symbolic Shape attribute is
// evaluated into a copy of them per launch (so concurrent launches share nothing mutable).
class LegacyKernel final : public Kernel {
 public:
  LegacyKernel(KernelRegistry::LegacyFn fn, const KernelInit& init, std::shared_ptr<const Prepared> prepared)
      : fn_(fn), attrs_(*init.attrs), prepared_(std::move(prepared)) {
    for (const auto& [name, attr] : attrs_)
      if (const auto* shape = std::get_if<graph::Shape>(&attr); shape && !shape->is_static() && init.symbols)
        symbolic_.emplace_back(name, init.dims(*shape));
  }
  void run(const KernelContext& ctx, std::span<const TensorView> in, std::span<const TensorView> out) const override {
    KernelContext context = ctx;
    context.prepared = prepared_.get();
    if (symbolic_.empty()) return fn_(context, attrs_, in, out);
    graph::Attrs attrs = attrs_;
    std::vector<int64_t> dims;
    for (const auto& [name, refs] : symbolic_) {
      resolve(ctx, refs, dims);
      attrs[name] = graph::Shape::of(dims);
    }
    fn_(context, attrs, in, out);
  }

 private:
  KernelRegistry::LegacyFn fn_;
  graph::Attrs attrs_;
  std::shared_ptr<const Prepared> prepared_;
  std::vector<std::pair<std::string, DimRefs>> symbolic_;
};

}  // namespace

void KernelRegistry::add(graph::Op op, DeviceKind device, std::initializer_list<DType> dtypes, LegacyFn fn) {
  for (DType d : dtypes) legacy_[{op, device, d}].first = fn;
}

std::unique_ptr<const Kernel> KernelRegistry::build_legacy(const graph::KernelKey& key, const KernelInit& init) const {
  auto it = legacy_.find(key);
  if (it == legacy_.end() || !it->second.first) return nullptr;
  std::shared_ptr<const Prepared> prepared;
  if (it->second.second) {
    auto fixed = std::make_unique<bool[]>(init.inputs.size());
    for (size_t i = 0; i < init.inputs.size(); ++i) fixed[i] = init.is_fixed(i);
    prepared = it->second.second(*init.attrs, init.inputs, std::span<const bool>(fixed.get(), init.inputs.size()));
  }
  return std::make_unique<LegacyKernel>(it->second.first, init, std::move(prepared));
}

void KernelRegistry::add_prepare(graph::Op op, DeviceKind device, std::initializer_list<DType> dtypes,
                                 LegacyPrepareFn fn) {
  for (DType d : dtypes) legacy_[{op, device, d}].second = fn;
}

KernelRegistry::LegacyFn KernelRegistry::find(graph::Op op, DeviceKind device, DType dtype) const {
  auto it = legacy_.find({op, device, dtype});
  return it == legacy_.end() ? nullptr : it->second.first;
}

KernelRegistry::LegacyPrepareFn KernelRegistry::find_prepare(graph::Op op, DeviceKind device, DType dtype) const {
  auto it = legacy_.find({op, device, dtype});
  return it == legacy_.end() ? nullptr : it->second.second;
}

}  // namespace kiln::kernels
