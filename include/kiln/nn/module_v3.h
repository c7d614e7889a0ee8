// nn::ModuleV3 (MAX's second module system): PyTorch-like. A module owns parameters that hold real
// data, and forward() is ordinary code on nn::Tensor. Called on eager tensors it runs at once; stage()
// traces the same forward into a graph (parameters become graph weights named by their qualified
// names), and compile() builds a runnable model in an nn::EagerSession (CompileOptions::session,
// default_eager_session() when none is given), the same kind of session eager ops run in.
//
//   class Affine : public nn::ModuleV3 {
//    public:
//     Affine(int64_t in, int64_t out)
//         : weight_(register_parameter("weight", kiln::Tensor::zeros(DType::f32, {in, out}))),
//           bias_(register_parameter("bias", kiln::Tensor::zeros(DType::f32, {out}))) {}
//     nn::Tensor operator()(const nn::Tensor& x) { return functional::matmul(x, weight_) + bias_; }
//     nn::TensorTree forward(const std::vector<nn::TensorTree>& args) override { return
//     (*this)(args.at(0).leaf()); }
//    private:
//     nn::Parameter weight_, bias_;
//   };
//   Affine m(4, 2);
//   nn::Tensor y = m(nn::Tensor::zeros(DType::f32, {3, 4}));                       // eager
//   auto compiled = m.compile({nn::TypeTree(graph::TensorType{DType::f32, {"batch", 4}})});
//   std::vector<kiln::Tensor> out = compiled({kiln::Tensor::zeros(DType::f32, {3, 4})});
//
// Devices: a module runs on devices() (default {cpu:0}; set_devices() changes it). A graph staged
// for two or more devices takes one signal buffer per device (engine/signals.h) among its inputs, at
// StageOptions::signal_buffer_index (nullopt: after the last input); one device gets none.
//
// Staging state lives on the module, not on the thread: while stage() runs, every module of the
// tree points at that stage's trace, so its parameters are graph weights and signal_buffers() are
// the graph's. One tree is staged by one stage() at a time (a second one is a ValueError); separate
// modules may be staged on separate threads at once.
#pragma once

#include <atomic>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "kiln/engine/session.h"
#include "kiln/logging.h"
#include "kiln/nn/eager_session.h"
#include "kiln/nn/functional.h"
#include "kiln/nn/module.h"
#include "kiln/nn/tensor.h"

namespace kiln::nn {

namespace detail {
struct TraceContext;  // one stage()'s graph, weights and signal buffers (private)
}

// A module's parameter: a handle on its data, shared by the module and the code that registered it.
// Used as an nn::Tensor, it is the data when run eagerly, and the graph weight of its qualified name
// while its module is being staged.
class Parameter {
 public:
  Parameter() = default;

  const std::string& name() const;  // the local name it was registered under
  const kiln::Tensor& data() const;
  DType dtype() const { return data().dtype(); }
  std::vector<int64_t> shape() const { return data().shape(); }
  DeviceRef device() const { return data().device(); }
  // Replaces the data; the dtype and shape must stay the same (ValueError naming the parameter).
  void set(kiln::Tensor data) const;

  Tensor tensor() const;
  operator Tensor() const { return tensor(); }

  struct State;
  explicit Parameter(std::shared_ptr<State> state) : state_(std::move(state)) {}
  const State* state() const { return state_.get(); }

 private:
  friend class ModuleV3;  // detaches its parameters from itself when destroyed
  const State& require() const;
  std::shared_ptr<State> state_;
};

struct StageOptions {
  std::string name = "forward";            // the graph's name
  // See the header comment; 0..num_inputs, else ValueError.
  std::optional<int> signal_buffer_index = std::nullopt;
};

struct CompileOptions {
  std::string name = "forward";
  std::optional<WeightsRegistry> weights = std::nullopt;  // nullopt: the module's own parameters
  bool auto_cast = false;  // cast f32 <-> bf16 weights to their parameters' dtypes
  std::vector<std::filesystem::path> custom_extensions = {};
  // Build a device graph at init (InferenceSession::init's device_graphs): every call replays one
  // launch list, so all input shapes must be static; Model::capture on it is refused.
  bool is_device_graph = false;
  std::optional<int> signal_buffer_index = std::nullopt;
  // Where the graph is compiled and run (its thread pool, model cache and logger); the module's
  // devices() must all be among its devices. nullptr: default_eager_session().
  std::shared_ptr<EagerSession> session = nullptr;
};

class CompiledModuleV3;

class ModuleV3 {
 public:
  ModuleV3() = default;
  virtual ~ModuleV3();
  ModuleV3(const ModuleV3&) = delete;
  ModuleV3& operator=(const ModuleV3&) = delete;

  // The computation, one tree per argument; the results, flattened, are a staged graph's outputs.
  virtual TensorTree forward(const std::vector<TensorTree>& args) = 0;

  // Qualified name -> parameter: this module's own in registration order, then each child's (in
  // registration order), prefixed by the child's name ("layers.0.weight"), as MAX's parameters.
  std::vector<std::pair<std::string, Parameter>> parameters() const;
  // Qualified name -> data of every parameter.
  WeightsRegistry state_dict() const;
  // Sets parameters by qualified name, checking dtype and shape (ValueError naming the weight);
  // strict: every parameter present and no other name (the ValueError lists both kinds).
  void load_state_dict(const WeightsRegistry& registry, bool strict = true);

  const std::vector<DeviceRef>& devices() const { return devices_; }
  // The devices the module runs on; non-empty and distinct (ValueError otherwise).
  void set_devices(std::vector<DeviceRef> devices);

  // Traces forward into a new graph whose inputs are the leaves of `input_types` (one tree per forward
  // argument, flattened in order), plus signal buffers on two or more devices. Every parameter forward
  // uses becomes a graph weight named by its qualified name.
  graph::Graph stage(const std::vector<TypeTree>& input_types, const StageOptions& options = {});
  // stage(), then compiled in options.session (cached there by the graph's text form) and
  // initialised with the weights bound (auto_cast applied; its warning goes to the session's logger).
  CompiledModuleV3 compile(const std::vector<TypeTree>& input_types, const CompileOptions& options = {});

  std::string path() const;  // the prefix of this module's parameters ("layers.0"); empty for a root

  // True while a stage() of this module or of an ancestor traces forward.
  bool is_staging() const { return trace_.load() != nullptr; }
  // Inside forward, while staged: the graph's signal buffers (traced buffer values, one per device);
  // empty on one device and outside stage().
  std::vector<Tensor> signal_buffers() const;

 protected:
  // Registers a parameter whose initial data fixes its dtype, shape and device. Names are unique
  // among a module's parameters and children and contain no '.'.
  Parameter register_parameter(const std::string& name, kiln::Tensor initial);
  template <class M>
  std::shared_ptr<M> register_module(const std::string& name, std::shared_ptr<M> child) {
    attach(name, child);
    return child;
  }

 private:
  void attach(const std::string& name, std::shared_ptr<ModuleV3> child);
  void collect_parameters(const std::string& prefix,
                          std::vector<std::pair<std::string, Parameter>>& out) const;
  void collect_modules(std::vector<ModuleV3*>& out);
  friend class Parameter;  // reads its module's trace_

  const ModuleV3* parent_ = nullptr;
  std::string name_in_parent_;
  std::vector<Parameter> parameters_;
  std::vector<std::pair<std::string, std::shared_ptr<ModuleV3>>> children_;
  std::vector<DeviceRef> devices_{DeviceRef::CPU()};
  std::atomic<detail::TraceContext*> trace_{nullptr};  // set while a stage() of this tree runs
};

// A staged and initialised ModuleV3: call it with the forward arguments' leaves (flattened, without
// signal buffers: it passes its own, zeroed once at compile).
class CompiledModuleV3 {
 public:
  CompiledModuleV3() = default;
  CompiledModuleV3(std::shared_ptr<EagerSession> session, engine::Model model,
                   std::vector<kiln::Tensor> signal_buffers, size_t signal_buffer_index);

  std::vector<kiln::Tensor> operator()(const std::vector<kiln::Tensor>& inputs) const;
  // The underlying model: its inputs include the signal buffers at their index.
  const engine::Model& model() const { return model_; }
  const engine::InferenceSession& session() const { return session_->inference_session(); }
  const std::shared_ptr<EagerSession>& eager_session() const { return session_; }

 private:
  std::shared_ptr<EagerSession> session_;
  engine::Model model_;
  std::vector<kiln::Tensor> signal_buffers_;
  size_t signal_buffer_index_ = 0;
};

// Returns `weights` ready to bind to `module`'s parameters: an entry whose dtype differs from its
// parameter's is cast when `auto_cast` is set and both dtypes are f32 or bf16 (equal shapes
// required), with one summary warning to `logger` listing every cast; otherwise the mismatch is a
// ValueError naming the weight and both dtypes. `context` prefixes messages.
WeightsRegistry cast_weights_to_parameters(const ModuleV3& module, const WeightsRegistry& weights,
                                           bool auto_cast, const std::string& context, Logger& logger);

}  // namespace kiln::nn
