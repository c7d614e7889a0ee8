// nn::Tensor: the value ModuleV3 code computes on. It holds either data (a kiln::Tensor, when code runs
// eagerly) or a graph value (when ModuleV3::stage() traces the same code into a graph). The ops of
// nn/functional.h run at once on eager tensors and record graph ops on traced ones. Each tensor
// carries its own context: a traced one its graph (value().graph()), an eager one the EagerSession
// its ops run in (session(); none: the default one, nn/eager_session.h).
//
//   namespace F = kiln::nn::functional;
//   nn::Tensor x = nn::Tensor::from_vector<float>({1, -2, 3}, {3});
//   nn::Tensor y = F::relu(x) * 2.0;   // runs now: y.to_vector<float>() == {2, 0, 6}
//
// Inside namespace kiln::nn, `Tensor` means this type: write kiln::Tensor for engine data.
#pragma once

#include <memory>
#include <string>
#include <variant>
#include <vector>

#include "kiln/tensor/tensor.h"
#include "kiln/graph/graph.h"
#include "kiln/graph/tree.h"
// nn/module.h names kiln::Tensor unqualified inside namespace kiln::nn; it must be seen before
// nn::Tensor is declared, or its `Tensor` would bind to this type.
#include "kiln/nn/module.h"

namespace kiln::nn {

class EagerSession;
class Parameter;

class Tensor {
 public:
  Tensor() = default;  // undefined: defined() is false
  // Eager; ValueError if `data` is undefined. Its ops run in `session`, or, without one, in the
  // session of the op's other operands, else in default_eager_session().
  Tensor(kiln::Tensor data, std::shared_ptr<EagerSession> session = nullptr);
  Tensor(graph::Value value);  // traced; ValueError if `value` is empty

  template <class T>
  static Tensor from_vector(const std::vector<T>& values, const std::vector<int64_t>& shape,
                            std::shared_ptr<EagerSession> session = nullptr) {
    return Tensor(kiln::Tensor::from_vector<T>(values, shape), std::move(session));
  }
  static Tensor zeros(DType dtype, const std::vector<int64_t>& shape, DeviceRef device = DeviceRef::CPU(),
                      std::shared_ptr<EagerSession> session = nullptr);
  // A rank-0 tensor holding `value` converted to dtype (ValueError if an integer dtype cannot hold it).
  static Tensor scalar(double value, DType dtype, DeviceRef device = DeviceRef::CPU(),
                       std::shared_ptr<EagerSession> session = nullptr);

  bool defined() const { return rep_.index() != 0; }
  bool is_eager() const { return rep_.index() == 1; }
  bool is_traced() const { return rep_.index() == 2; }

  // The data of an eager tensor; ValueError for a traced one (it has data only once compiled and run).
  const kiln::Tensor& data() const;
  // The graph value of a traced tensor; ValueError for an eager one.
  const graph::Value& value() const;

  DType dtype() const;
  graph::Shape shape() const;  // static for eager tensors
  DeviceRef device() const;
  int64_t rank() const;
  bool is_buffer() const;  // a traced buffer value (eager tensors are plain data)
  graph::Type type() const;

  template <class T>
  std::vector<T> to_vector() const {
    return data().to_vector<T>();
  }
  // "nn::Tensor(f32[2, 3], cpu:0)" or "nn::Tensor(traced f32[batch, 3])".
  std::string to_string() const;

  // The session an eager tensor's ops run in; null when it names none (see the constructor).
  const std::shared_ptr<EagerSession>& session() const { return session_; }
  // The name of the parameter an eager tensor is the data of (a Parameter used as a Tensor outside
  // its module's stage()), else null: staging uses it to name a parameter of another module.
  const std::string* parameter_name() const { return parameter_name_.get(); }

 private:
  friend class Parameter;

  std::variant<std::monostate, kiln::Tensor, graph::Value> rep_;
  std::shared_ptr<EagerSession> session_;
  std::shared_ptr<const std::string> parameter_name_;
};

// The arguments and results of a ModuleV3's forward: a leaf, list or named tree of tensors.
using TensorTree = graph::Tree<Tensor>;

}  // namespace kiln::nn
