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

Module::WeightId Module::register_weight(const std::string& name, DType dtype, const graph::Shape& shape,
                                         DeviceRef device) {
  if (name.empty() || name.find('.') != std::string::npos)
    throw ValueError(fmt::format("register_weight: bad weight name '{}' (non-empty, no '.')", name));
  for (const auto& w : weights_)
    if (w.decl.name == name) throw ValueError(fmt::format("register_weight: '{}' is registered twice", name));
  for (const auto& [child_name, child] : children_)
    if (child_name == name)
      throw ValueError(fmt::format("register_weight: '{}' is already a child module", name));
  if (!shape.is_static())
    throw ValueError(fmt::format("register_weight: weight '{}' needs a static shape, got {}", name,
                                 shape.to_string()));
  weights_.push_back({graph::Weight{name, dtype, shape, device}, Tensor()});
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
  graph::Weight w = weights_.at(id).decl;
  w.name = qualified_name(w.name);
  return graph::Graph::current().weight(w);
}

template <class F>
void Module::visit_weights(const std::string& prefix, F&& f) {
  for (auto& slot : weights_) f(prefix + slot.decl.name, slot);
  for (auto& [name, child] : children_) child->visit_weights(prefix + name + ".", f);
}
template <class F>
void Module::visit_weights(const std::string& prefix, F&& f) const {
  for (const auto& slot : weights_) f(prefix + slot.decl.name, slot);
  for (const auto& [name, child] : children_)
    static_cast<const Module&>(*child).visit_weights(prefix + name + ".", f);
}

std::map<std::string, graph::Weight> Module::raw_state_dict() const {
  std::map<std::string, graph::Weight> out;
  visit_weights("", [&](const std::string& name, const WeightSlot& slot) {
    graph::Weight w = slot.decl;
    w.name = name;
    out.emplace(name, std::move(w));
  });
  return out;
}

WeightsRegistry Module::state_dict() const {
  WeightsRegistry out;
  visit_weights("", [&](const std::string& name, const WeightSlot& slot) {
    out.emplace(name, slot.data.defined()
                          ? slot.data
                          : Tensor::zeros(slot.decl.dtype, slot.decl.shape.static_dims()));
  });
  return out;
}

void Module::load_state_dict(const WeightsRegistry& registry, bool strict) {
  std::vector<std::string> missing;
  std::vector<std::string> seen;
  // Check everything first so a failed load leaves the module unchanged.
  std::vector<std::pair<WeightSlot*, const Tensor*>> bindings;
  visit_weights("", [&](const std::string& name, WeightSlot& slot) {
    auto it = registry.find(name);
    if (it == registry.end()) {
      missing.push_back(name);
      return;
    }
    seen.push_back(name);
    const Tensor& t = it->second;
    if (t.dtype() != slot.decl.dtype)
      throw ValueError(fmt::format("load_state_dict: weight '{}' has dtype {}, expected {}", name,
                                   dtype_name(t.dtype()), dtype_name(slot.decl.dtype)));
    if (t.shape() != slot.decl.shape.static_dims())
      throw ValueError(fmt::format("load_state_dict: weight '{}' has shape {}, expected {}", name,
                                   fmt::format("[{}]", fmt::join(t.shape(), ", ")),
                                   slot.decl.shape.to_string()));
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
  for (auto& [slot, tensor] : bindings) slot->data = *tensor;
}

}  // namespace kiln::nn
