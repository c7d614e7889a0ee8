#include "kiln/nn/module.h"

#include <algorithm>
#include <cstring>

#include <fmt/format.h>

namespace kiln::nn {

Module::~Module() = default;

Values Module::forward(const std::vector<Values>&) {
  throw ValueError("nn::Module: this module does not implement forward(); call it from a module that does");
}

std::string Module::path() const {
  if (!parent_) return "";
  std::string prefix = parent_->path();
  return prefix.empty() ? name_in_parent_ : prefix + "." + name_in_parent_;
}

std::string Module::qualified_name(const std::string& local_name) const {
  std::string prefix = path();
  return prefix.empty() ? local_name : prefix + "." + local_name;
}

namespace {
// Local weight names are single path components: the '.' joins module names.
void check_weight_name(const char* who, const std::string& name) {
  if (name.empty() || name.find('.') != std::string::npos)
    throw ValueError(fmt::format("{}: bad weight name '{}' (non-empty, no '.')", who, name));
}

std::string shape_string(const std::vector<int64_t>& dims) { return fmt::format("[{}]", fmt::join(dims, ", ")); }

// Copy of piece `spec.index` of `full` along `spec.axis` (a strided view of it, packed).
Tensor slice_shard(const Tensor& full, const ShardSpec& spec) {
  std::vector<int64_t> shape = full.shape();
  const int64_t piece = shape[spec.axis] / spec.count;
  shape[spec.axis] = piece;
  const int64_t offset = spec.index * piece * full.strides()[spec.axis];  // in elements
  auto* base = static_cast<char*>(const_cast<void*>(full.data())) +
               offset * static_cast<int64_t>(dtype_size(full.dtype()));
  // The view keeps `full` alive only until clone() has copied the piece out.
  Tensor view = Tensor::view(std::make_shared<Tensor>(full), base, full.dtype(), shape, full.strides(),
                             full.device());
  return view.clone();
}
}  // namespace

std::string Module::WeightSlot::graph_name() const {
  return shard ? fmt::format("{}.shard{}", decl.name, shard->spec.index) : decl.name;
}

Module::WeightId Module::register_weight(const std::string& name, DType dtype, const graph::Shape& shape,
                                         DeviceRef device) {
  check_weight_name("register_weight", name);
  for (const auto& w : weights_)
    if (w.decl.name == name)
      throw ValueError(fmt::format("register_weight: '{}' is registered twice", qualified_name(name)));
  for (const auto& [child_name, child] : children_)
    if (child_name == name)
      throw ValueError(fmt::format("register_weight: '{}' is already a child module", name));
  if (!shape.is_static())
    throw ValueError(fmt::format("register_weight: weight '{}' needs a static shape, got {}", name,
                                 shape.to_string()));
  weights_.push_back({graph::Weight{name, dtype, shape, device}, Tensor(), std::nullopt});
  return weights_.size() - 1;
}

Module::WeightId Module::register_weight_shard(const std::string& name, DType dtype,
                                               const graph::Shape& full_shape, const ShardSpec& shard,
                                               DeviceRef device) {
  check_weight_name("register_weight_shard", name);
  if (!full_shape.is_static())
    throw ValueError(fmt::format("register_weight_shard: weight '{}' needs a static shape, got {}", name,
                                 full_shape.to_string()));
  std::vector<int64_t> dims = full_shape.static_dims();
  const auto rank = static_cast<int64_t>(dims.size());
  if (shard.count < 1 || shard.index < 0 || shard.index >= shard.count)
    throw ValueError(fmt::format("register_weight_shard: weight '{}' shard index {} is not in [0, {})", name,
                                 shard.index, shard.count));
  if (shard.axis != ShardSpec::kReplicated) {
    if (shard.axis < 0 || shard.axis >= rank)
      throw ValueError(fmt::format(
          "register_weight_shard: weight '{}' axis {} is out of range for shape {} (-1 replicates)", name,
          shard.axis, full_shape.to_string()));
    if (dims[shard.axis] % shard.count != 0)
      throw ValueError(fmt::format(
          "register_weight_shard: weight '{}' {} does not split evenly along axis {} into {} shards", name,
          full_shape.to_string(), shard.axis, shard.count));
    dims[shard.axis] /= shard.count;
  }
  for (const auto& w : weights_) {
    if (w.decl.name != name) continue;
    if (!w.shard)
      throw ValueError(fmt::format("register_weight_shard: '{}' is already an unsharded weight", name));
    const ShardSpec& other = w.shard->spec;
    if (w.decl.dtype != dtype || !(w.shard->full_shape == full_shape) || other.axis != shard.axis ||
        other.count != shard.count)
      throw ValueError(fmt::format(
          "register_weight_shard: shard {} of '{}' ({} {}, axis {}, {} shards) differs from shard {} ({} {}, "
          "axis {}, {} shards)",
          shard.index, name, dtype_name(dtype), full_shape.to_string(), shard.axis, shard.count, other.index,
          dtype_name(w.decl.dtype), w.shard->full_shape.to_string(), other.axis, other.count));
    if (other.index == shard.index)
      throw ValueError(fmt::format("register_weight_shard: shard {} of '{}' is registered twice", shard.index,
                                   name));
  }
  for (const auto& [child_name, child] : children_)
    if (child_name == name)
      throw ValueError(fmt::format("register_weight_shard: '{}' is already a child module", name));
  weights_.push_back({graph::Weight{name, dtype, graph::Shape::of(dims), device}, Tensor(),
                      WeightShard{name, full_shape, shard}});
  return weights_.size() - 1;
}

void Module::attach(const std::string& name, std::shared_ptr<Module> child) {
  if (!child) throw ValueError(fmt::format("register_module: child '{}' is null", name));
  if (name.empty() || name.find('.') != std::string::npos)
    throw ValueError(fmt::format("register_module: bad module name '{}' (non-empty, no '.')", name));
  if (child->parent_)
    throw ValueError(fmt::format("register_module: module '{}' already belongs to '{}'", name,
                                 child->path()));
  for (const auto& [n, c] : children_)
    if (n == name) throw ValueError(fmt::format("register_module: '{}' is registered twice", name));
  for (const auto& w : weights_)
    if (w.decl.name == name) throw ValueError(fmt::format("register_module: '{}' is already a weight", name));
  for (const Module* m = this; m; m = m->parent_)
    if (m == child.get()) throw ValueError(fmt::format("register_module: '{}' would make a cycle", name));
  child->parent_ = this;
  child->name_in_parent_ = name;
  children_.emplace_back(name, std::move(child));
}

const graph::Weight& Module::weight_decl(WeightId id) const { return weights_.at(id).decl; }

graph::TensorValue Module::weight(WeightId id) const {
  const WeightSlot& slot = weights_.at(id);
  graph::Weight w = slot.decl;
  w.name = qualified_name(slot.graph_name());
  return graph::Graph::current().weight(w);
}

// f(prefix, slot): the slot's qualified names are prefix + graph_name() and, for a shard, its logical
// name prefix + decl.name.
template <class F>
void Module::visit_weights(const std::string& prefix, F&& f) {
  for (auto& slot : weights_) f(prefix, slot);
  for (auto& [name, child] : children_) child->visit_weights(prefix + name + ".", f);
}
template <class F>
void Module::visit_weights(const std::string& prefix, F&& f) const {
  for (const auto& slot : weights_) f(prefix, slot);
  for (const auto& [name, child] : children_)
    static_cast<const Module&>(*child).visit_weights(prefix + name + ".", f);
}

std::map<std::string, graph::Weight> Module::raw_state_dict() const {
  std::map<std::string, graph::Weight> out;
  visit_weights("", [&](const std::string& prefix, const WeightSlot& slot) {
    graph::Weight w = slot.decl;
    w.name = prefix + slot.graph_name();
    out.emplace(w.name, std::move(w));
  });
  return out;
}

std::map<std::string, WeightShard> Module::weight_shards() const {
  std::map<std::string, WeightShard> out;
  visit_weights("", [&](const std::string& prefix, const WeightSlot& slot) {
    if (!slot.shard) return;
    WeightShard shard = *slot.shard;
    shard.logical_name = prefix + slot.decl.name;
    out.emplace(prefix + slot.graph_name(), std::move(shard));
  });
  return out;
}

WeightsRegistry Module::state_dict() const {
  WeightsRegistry out;
  visit_weights("", [&](const std::string& prefix, const WeightSlot& slot) {
    out.emplace(prefix + slot.graph_name(),
                slot.data.defined() ? slot.data
                                    : Tensor::zeros(slot.decl.dtype, slot.decl.shape.static_dims()));
  });
  return out;
}

void Module::load_state_dict(const WeightsRegistry& registry, bool strict) {
  std::vector<std::string> missing;
  std::vector<std::string> seen;
  // Check everything first so a failed load leaves the module unchanged.
  std::vector<std::pair<WeightSlot*, const Tensor*>> bindings;
  visit_weights("", [&](const std::string& prefix, WeightSlot& slot) {
    // A shard is looked up by its logical name; several shards (and replicas) share it.
    const std::string name = prefix + slot.decl.name;
    auto it = registry.find(name);
    if (it == registry.end()) {
      if (std::find(missing.begin(), missing.end(), name) == missing.end()) missing.push_back(name);
      return;
    }
    if (std::find(seen.begin(), seen.end(), name) == seen.end()) seen.push_back(name);
    const Tensor& t = it->second;
    const graph::Shape& expected = slot.shard ? slot.shard->full_shape : slot.decl.shape;
    if (t.dtype() != slot.decl.dtype)
      throw ValueError(fmt::format("load_state_dict: weight '{}' has dtype {}, expected {}", name,
                                   dtype_name(t.dtype()), dtype_name(slot.decl.dtype)));
    if (t.shape() != expected.static_dims())
      throw ValueError(fmt::format("load_state_dict: weight '{}' has shape {}, expected {}{}", name,
                                   shape_string(t.shape()), expected.to_string(),
                                   slot.shard ? " (the full, unsharded weight)" : ""));
    bindings.emplace_back(&slot, &t);
  });
  if (strict) {
    std::vector<std::string> unexpected;
    for (const auto& [name, t] : registry)
      if (std::find(seen.begin(), seen.end(), name) == seen.end()) unexpected.push_back(name);
    if (!missing.empty() || !unexpected.empty())
      throw ValueError(fmt::format("load_state_dict: missing weights [{}]; unexpected weights [{}]",
                                   fmt::join(missing, ", "), fmt::join(unexpected, ", ")));
  }
  for (auto& [slot, tensor] : bindings) {
    const bool sliced = slot->shard && slot->shard->spec.axis != ShardSpec::kReplicated;
    slot->data = sliced ? slice_shard(*tensor, slot->shard->spec) : *tensor;  // a replica shares the data
  }
}

}  // namespace kiln::nn
