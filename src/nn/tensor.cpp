#include "kiln/nn/tensor.h"

#include <fmt/format.h>

#include <cmath>
#include <limits>

namespace kiln::nn {

Tensor::Tensor(kiln::Tensor data, std::shared_ptr<EagerSession> session) : session_(std::move(session)) {
  if (!data.defined()) throw ValueError("nn::Tensor: cannot wrap an undefined kiln::Tensor");
  rep_.emplace<1>(std::move(data));
}

Tensor::Tensor(graph::Value value) {
  if (!value.valid()) throw ValueError("nn::Tensor: cannot wrap an empty graph value");
  rep_.emplace<2>(std::move(value));
}

Tensor Tensor::zeros(DType dtype, const std::vector<int64_t>& shape, DeviceRef device,
                     std::shared_ptr<EagerSession> session) {
  return Tensor(kiln::Tensor::zeros(dtype, shape, device), std::move(session));
}

Tensor Tensor::scalar(double value, DType dtype, DeviceRef device, std::shared_ptr<EagerSession> session) {
  kiln::Tensor t = kiln::Tensor::empty(dtype, {}, device);
  try {
    store_scalar(value, dtype, t.data());
  } catch (const ValueError& e) {
    throw ValueError(fmt::format("nn::Tensor::scalar: {}", e.what()));
  }
  return Tensor(std::move(t), std::move(session));
}

const kiln::Tensor& Tensor::data() const {
  if (const auto* t = std::get_if<kiln::Tensor>(&rep_)) return *t;
  if (is_traced())
    throw ValueError(
        fmt::format("nn::Tensor::data: {} is a traced graph value; it has data only when "
                    "run eagerly (or once the staged graph is compiled and run)",
                    to_string()));
  throw ValueError("nn::Tensor::data: the tensor is undefined");
}

const graph::Value& Tensor::value() const {
  if (const auto* v = std::get_if<graph::Value>(&rep_)) return *v;
  if (is_eager())
    throw ValueError(fmt::format("nn::Tensor::value: {} is eager data, not a graph value", to_string()));
  throw ValueError("nn::Tensor::value: the tensor is undefined");
}

graph::Type Tensor::type() const {
  if (is_traced()) return value().type();
  const kiln::Tensor& t = data();
  return graph::TensorType{t.dtype(), graph::Shape::of(t.shape()), t.device()};
}

DType Tensor::dtype() const { return is_traced() ? value().dtype() : data().dtype(); }
graph::Shape Tensor::shape() const {
  return is_traced() ? value().shape() : graph::Shape::of(data().shape());
}
DeviceRef Tensor::device() const { return is_traced() ? value().device() : data().device(); }
int64_t Tensor::rank() const { return is_traced() ? value().rank() : data().rank(); }
bool Tensor::is_buffer() const { return is_traced() && value().is_buffer(); }

std::string Tensor::to_string() const {
  if (is_eager()) {
    const kiln::Tensor& t = data();
    return fmt::format("nn::Tensor({}{}, {})", dtype_name(t.dtype()), graph::Shape::of(t.shape()).to_string(),
                       t.device().to_string());
  }
  if (is_traced()) return fmt::format("nn::Tensor(traced {})", graph::to_string(value().type()));
  return "nn::Tensor(undefined)";
}

}  // namespace kiln::nn
