// Model: a handle on one initialised graph. Copies share the executor (and its arena), so calls on
// one Model, or its copies, run one at a time.
#include "engine/executor.h"
#include "kiln/engine/session.h"
#include "kiln/errors.h"

namespace kiln::engine {

namespace {
Model::Impl& require(const std::shared_ptr<Model::Impl>& impl) {
  if (!impl) throw ValueError("Model: not initialised (get one from InferenceSession::init or load)");
  return *impl;
}
}  // namespace

const std::string& Model::name() const { return require(impl_).executor.plan().name; }

std::vector<Tensor> Model::execute(const std::vector<Tensor>& inputs) const {
  Impl& impl = require(impl_);
  std::lock_guard lock(impl.mutex);
  return impl.executor.run(inputs);
}

const std::vector<graph::Type>& Model::input_metadata() const {
  return require(impl_).executor.plan().input_types;
}

const std::vector<graph::Type>& Model::output_metadata() const {
  return require(impl_).executor.plan().output_types;
}

}  // namespace kiln::engine
