// nn::functional: one dispatch for every op. Traced operands record graph ops into their graph;
// all-eager operands run a one-op model compiled once per signature and cached by their EagerSession.
#include "kiln/nn/functional.h"

#include <fmt/format.h>

#include <functional>
#include <optional>
#include <string_view>

#include "kiln/nn/eager_session.h"
#include "nn/trace_context.h"

namespace kiln::nn {

namespace ops = graph::ops;

namespace {

using ValueList = std::vector<graph::Value>;
using Build = std::function<ValueList(const ValueList&)>;

// An op call: its name (for messages and the cache key), the attributes that make its signature
// (already formatted), its operands, and which of them are buffers.
struct Call {
  Call(std::string_view op, std::string attrs, std::vector<const Tensor*> operands = {},
       uint32_t buffer_operands = 0)
      : op(op), attrs(std::move(attrs)), operands(std::move(operands)), buffer_operands(buffer_operands) {}

  std::string_view op;
  std::string attrs;
  std::vector<const Tensor*> operands;
  uint32_t buffer_operands;  // bit i: operand i is a buffer
  bool is_buffer(size_t i) const { return (buffer_operands >> i) & 1u; }
};

std::vector<Tensor> wrap(const ValueList& values) {
  std::vector<Tensor> out;
  out.reserve(values.size());
  for (const auto& v : values) out.emplace_back(v);
  return out;
}

std::vector<Tensor> trace(const Call& call, const graph::Value& anchor, const Build& build) {
  ValueList values;
  values.reserve(call.operands.size());
  for (size_t i = 0; i < call.operands.size(); ++i) {
    const Tensor& t = *call.operands[i];
    if (t.is_traced()) {
      if (t.value().graph() != anchor.graph())
        throw ValueError(fmt::format("{}: operand {} belongs to graph '{}', operand 0 to graph '{}'", call.op,
                                     i, t.value().graph()->name, anchor.graph()->name));
      values.push_back(t.value());
    } else if (call.is_buffer(i)) {
      throw ValueError(fmt::format("{}: operand {} must be a buffer value of the graph being traced, got {}",
                                   call.op, i, t.to_string()));
    } else {
      values.push_back(detail::eager_operand_in(*anchor.graph(), anchor.module(), t));
    }
  }
  return wrap(build(values));
}

void append_key(fmt::memory_buffer& key, const kiln::Tensor& t, bool buffer) {
  fmt::format_to(fmt::appender(key), "{}{}[{}]@{}{};", buffer ? "buffer " : "", dtype_name(t.dtype()),
                 fmt::join(t.shape(), ","), t.device().kind == DeviceKind::CPU ? "cpu" : "gpu",
                 t.device().id);
}

std::vector<Tensor> run_eager(const Call& call, const Build& build,
                              const std::shared_ptr<EagerSession>& session) {
  std::vector<kiln::Tensor> inputs;
  inputs.reserve(call.operands.size());
  fmt::memory_buffer key;
  fmt::format_to(fmt::appender(key), "{}({})", call.op, call.attrs);
  for (size_t i = 0; i < call.operands.size(); ++i) {
    inputs.push_back(call.operands[i]->data());
    append_key(key, inputs.back(), call.is_buffer(i));
  }

  EagerSession& eager = session ? *session : *default_eager_session();
  // A failed build (bad shapes) throws before anything is cached.
  auto load = [&] {
    std::vector<graph::Type> types;
    for (size_t i = 0; i < inputs.size(); ++i) {
      graph::Shape shape = graph::Shape::of(inputs[i].shape());
      if (call.is_buffer(i))
        types.push_back(graph::BufferType{inputs[i].dtype(), shape, inputs[i].device()});
      else
        types.push_back(graph::TensorType{inputs[i].dtype(), shape, inputs[i].device()});
    }
    graph::Graph g(fmt::format("eager_{}", call.op), types);
    {
      graph::Graph::Scope scope(g);
      g.output(build(g.inputs()));
    }
    return eager.inference_session().load(g);
  };
  // std::ref: a std::function of a reference allocates nothing, so a cache hit stays allocation-free.
  engine::Model model = eager.cached_model(std::string_view(key.data(), key.size()), std::ref(load));
  std::vector<kiln::Tensor> outputs = model.execute(inputs);
  std::vector<Tensor> out;
  out.reserve(outputs.size());
  for (auto& t : outputs) out.emplace_back(std::move(t), session);
  return out;
}

std::vector<Tensor> dispatch(const Call& call, const Build& build) {
  const Tensor* anchor = nullptr;
  for (size_t i = 0; i < call.operands.size(); ++i) {
    const Tensor* t = call.operands[i];
    if (!t->defined()) throw ValueError(fmt::format("{}: operand {} is an undefined nn::Tensor", call.op, i));
    if (t->is_traced() && !anchor) anchor = t;
  }
  if (anchor) return trace(call, anchor->value(), build);
  // The session an eager op runs in: the one its operands name (they must agree); none named, the
  // default one.
  std::optional<size_t> with_session;
  for (size_t i = 0; i < call.operands.size(); ++i) {
    const auto& session = call.operands[i]->session();
    if (!session) continue;
    if (!with_session)
      with_session = i;
    else if (session != call.operands[*with_session]->session())
      throw ValueError(fmt::format("{}: operand {} belongs to another nn::EagerSession than operand {}",
                                   call.op, i, *with_session));
  }
  return run_eager(call, build, with_session ? call.operands[*with_session]->session() : nullptr);
}

Tensor dispatch1(const Call& call, const Build& build) { return dispatch(call, build).at(0); }

// Builders for the common arities.
Tensor unary(std::string_view op, const Tensor& x, std::string attrs,
             graph::TensorValue (*fn)(const graph::TensorValue&)) {
  return dispatch1({op, std::move(attrs), {&x}}, [fn](const ValueList& v) { return ValueList{fn(v[0])}; });
}
Tensor binary(std::string_view op, const Tensor& a, const Tensor& b,
              graph::TensorValue (*fn)(const graph::TensorValue&, const graph::TensorValue&)) {
  return dispatch1({op, "", {&a, &b}}, [fn](const ValueList& v) { return ValueList{fn(v[0], v[1])}; });
}

std::string slice_key(const std::vector<ops::SliceIndex>& indices) {
  auto bound = [](const ops::SliceBound& b) {
    return b.from_end() > 0 ? fmt::format("-{}", b.from_end()) : b.resolve(graph::Dim(0)).to_string();
  };
  std::string key;
  for (const auto& index : indices)
    key += fmt::format("{}:{}:{},", bound(index.start), index.stop ? bound(*index.stop) : "end", index.step);
  return key;
}

std::string dims_key(const std::vector<graph::Dim>& dims) {
  std::string key;
  for (const auto& d : dims) key += d.to_string() + ",";
  return key;
}

Tensor scalar_like(const Tensor& like, double value) {
  if (!like.defined()) throw ValueError("operator: use of an undefined nn::Tensor");
  return Tensor::scalar(value, like.dtype(), like.device());
}

}  // namespace

graph::Value detail::constant_in(graph::GraphIR& graph, graph::Module* module, const kiln::Tensor& data) {
  kiln::Tensor packed = data.contiguous();
  const auto* bytes = static_cast<const uint8_t*>(packed.data());
  graph::Attrs attrs{{"value", graph::Bytes(bytes, bytes + packed.nbytes())},
                     {"dtype", packed.dtype()},
                     {"shape", graph::Shape::of(packed.shape())},
                     {"device", packed.device()}};
  return graph::add_node(graph, module, graph::Op::constant, {}, std::move(attrs)).at(0);
}

graph::Value detail::eager_operand_in(graph::GraphIR& graph, graph::Module* module, const Tensor& eager) {
  if (const std::string* name = eager.parameter_name())
    throw ValueError(
        fmt::format("nn::Parameter '{}' was used while staging graph '{}' but is not a parameter of "
                    "the module being staged (register its module as a child)",
                    *name, graph.name));
  return constant_in(graph, module, eager.data());
}

int64_t eager_compile_count() { return default_eager_session()->inference_session().compile_count(); }

namespace functional {

// ---- sources -------------------------------------------------------------------------------------

Tensor constant(const kiln::Tensor& data) { return Tensor(data); }

Tensor range(double start, double step, const graph::Dim& size, DType dtype, DeviceRef device,
             std::shared_ptr<EagerSession> session) {
  if (!size.is_static())
    throw ValueError(
        fmt::format("range: size {} must be static when run eagerly (pass a traced tensor as "
                    "`like` to record it in that tensor's graph)",
                    size.to_string()));
  auto build = [&](const ValueList&) { return ValueList{ops::range(start, step, size, dtype, device)}; };
  // No operands to take a session from: the caller names it.
  return run_eager({"range", fmt::format("{},{},{},{},{}", start, step, size.to_string(), dtype_name(dtype),
                                         device.to_string())},
                   build, session)
      .at(0);
}

Tensor range(double start, double step, const graph::Dim& size, DType dtype, const Tensor& like) {
  if (!like.defined()) throw ValueError("range: `like` is an undefined nn::Tensor");
  if (like.is_eager()) return range(start, step, size, dtype, like.device(), like.session());
  // ops::range's node, added to like's graph (ops::range itself adds to the entered graph).
  const graph::Value& anchor = like.value();
  return Tensor(graph::add_node(*anchor.graph(), anchor.module(), graph::Op::range, {},
                                {{"start", start},
                                 {"step", step},
                                 {"size", graph::Shape{size}},
                                 {"dtype", dtype},
                                 {"device", like.device()}})
                    .at(0));
}

// ---- elementwise -------------------------------------------------------------------------------

#define KILN_NN_UNARY(name) \
  Tensor name(const Tensor& x) { return unary(#name, x, "", &ops::name); }
KILN_NN_UNARY(neg)
KILN_NN_UNARY(abs)
KILN_NN_UNARY(exp)
KILN_NN_UNARY(log)
KILN_NN_UNARY(sqrt)
KILN_NN_UNARY(rsqrt)
KILN_NN_UNARY(sin)
KILN_NN_UNARY(cos)
KILN_NN_UNARY(tanh)
KILN_NN_UNARY(sigmoid)
KILN_NN_UNARY(silu)
KILN_NN_UNARY(relu)
KILN_NN_UNARY(erf)
KILN_NN_UNARY(floor)
KILN_NN_UNARY(ceil)
KILN_NN_UNARY(round)
KILN_NN_UNARY(reciprocal)
KILN_NN_UNARY(square)
KILN_NN_UNARY(logical_not)
KILN_NN_UNARY(is_nan)
#undef KILN_NN_UNARY

Tensor gelu(const Tensor& x, bool tanh_approximation) {
  return dispatch1({"gelu", tanh_approximation ? "tanh" : "none", {&x}},
                   [&](const ValueList& v) { return ValueList{ops::gelu(v[0], tanh_approximation)}; });
}

#define KILN_NN_BINARY(name) \
  Tensor name(const Tensor& a, const Tensor& b) { return binary(#name, a, b, &ops::name); }
KILN_NN_BINARY(add)
KILN_NN_BINARY(sub)
KILN_NN_BINARY(mul)
KILN_NN_BINARY(div)
KILN_NN_BINARY(mod)
KILN_NN_BINARY(pow)
KILN_NN_BINARY(maximum)
KILN_NN_BINARY(minimum)
KILN_NN_BINARY(equal)
KILN_NN_BINARY(not_equal)
KILN_NN_BINARY(greater)
KILN_NN_BINARY(greater_equal)
KILN_NN_BINARY(less)
KILN_NN_BINARY(less_equal)
KILN_NN_BINARY(logical_and)
KILN_NN_BINARY(logical_or)
KILN_NN_BINARY(logical_xor)
KILN_NN_BINARY(matmul)
#undef KILN_NN_BINARY

Tensor where(const Tensor& condition, const Tensor& x, const Tensor& y) {
  return dispatch1({"where", "", {&condition, &x, &y}},
                   [](const ValueList& v) { return ValueList{ops::where(v[0], v[1], v[2])}; });
}

Tensor cast(const Tensor& x, DType dtype) {
  return dispatch1({"cast", std::string(dtype_name(dtype)), {&x}},
                   [dtype](const ValueList& v) { return ValueList{ops::cast(v[0], dtype)}; });
}

// ---- linear algebra and reductions ---------------------------------------------------------------

#define KILN_NN_REDUCTION(name)                                                                \
  Tensor name(const Tensor& x, int64_t axis) {                                                 \
    return dispatch1({#name, std::to_string(axis), {&x}},                                      \
                     [axis](const ValueList& v) { return ValueList{ops::name(v[0], axis)}; }); \
  }
KILN_NN_REDUCTION(sum)
KILN_NN_REDUCTION(mean)
KILN_NN_REDUCTION(max)
KILN_NN_REDUCTION(min)
KILN_NN_REDUCTION(argmax)
KILN_NN_REDUCTION(argmin)
KILN_NN_REDUCTION(softmax)
KILN_NN_REDUCTION(log_softmax)
#undef KILN_NN_REDUCTION

Tensor cumsum(const Tensor& x, int64_t axis, bool exclusive, bool reverse) {
  return dispatch1(
      {"cumsum", fmt::format("{},{},{}", axis, exclusive, reverse), {&x}},
      [&](const ValueList& v) { return ValueList{ops::cumsum(v[0], axis, exclusive, reverse)}; });
}

std::vector<Tensor> top_k(const Tensor& x, int64_t k, int64_t axis) {
  return dispatch({"top_k", fmt::format("{},{}", k, axis), {&x}}, [&](const ValueList& v) {
    auto r = ops::top_k(v[0], k, axis);
    return ValueList(r.begin(), r.end());
  });
}

// ---- normalization -----------------------------------------------------------------------------

Tensor rms_norm(const Tensor& x, const Tensor& weight, double epsilon) {
  return dispatch1({"rms_norm", fmt::format("{}", epsilon), {&x, &weight}},
                   [&](const ValueList& v) { return ValueList{ops::rms_norm(v[0], v[1], epsilon)}; });
}

Tensor layer_norm(const Tensor& x, const Tensor& gamma, const Tensor& beta, double epsilon) {
  return dispatch1({"layer_norm", fmt::format("{}", epsilon), {&x, &gamma, &beta}},
                   [&](const ValueList& v) { return ValueList{ops::layer_norm(v[0], v[1], v[2], epsilon)}; });
}

// ---- shape and data movement ---------------------------------------------------------------------

Tensor reshape(const Tensor& x, const graph::Shape& shape) {
  return dispatch1({"reshape", shape.to_string(), {&x}},
                   [&](const ValueList& v) { return ValueList{ops::reshape(v[0], shape)}; });
}

Tensor reshape(const Tensor& x, const std::vector<int64_t>& shape) {
  // A distinct key from the Shape overload: -1 is only meaningful here.
  return dispatch1({"reshape", fmt::format("ints[{}]", fmt::join(shape, ",")), {&x}},
                   [&](const ValueList& v) { return ValueList{ops::reshape(v[0], shape)}; });
}

Tensor transpose(const Tensor& x, int64_t axis_a, int64_t axis_b) {
  return dispatch1({"transpose", fmt::format("{},{}", axis_a, axis_b), {&x}},
                   [&](const ValueList& v) { return ValueList{ops::transpose(v[0], axis_a, axis_b)}; });
}

Tensor permute(const Tensor& x, const std::vector<int64_t>& perm) {
  return dispatch1({"permute", fmt::format("{}", fmt::join(perm, ",")), {&x}},
                   [&](const ValueList& v) { return ValueList{ops::permute(v[0], perm)}; });
}

Tensor broadcast_to(const Tensor& x, const graph::Shape& shape) {
  return dispatch1({"broadcast_to", shape.to_string(), {&x}},
                   [&](const ValueList& v) { return ValueList{ops::broadcast_to(v[0], shape)}; });
}

Tensor concat(const std::vector<Tensor>& xs, int64_t axis) {
  Call call("concat", std::to_string(axis));
  for (const Tensor& x : xs) call.operands.push_back(&x);
  if (xs.empty()) throw ValueError("concat: needs at least one tensor, got none");
  return dispatch1(call, [&](const ValueList& v) {
    return ValueList{ops::concat(std::vector<graph::TensorValue>(v.begin(), v.end()), axis)};
  });
}

std::vector<Tensor> split(const Tensor& x, const std::vector<graph::Dim>& sizes, int64_t axis) {
  return dispatch({"split", fmt::format("{}|{}", dims_key(sizes), axis), {&x}}, [&](const ValueList& v) {
    auto r = ops::split(v[0], sizes, axis);
    return ValueList(r.begin(), r.end());
  });
}

Tensor slice(const Tensor& x, const std::vector<SliceIndex>& indices) {
  return dispatch1({"slice", slice_key(indices), {&x}},
                   [&](const ValueList& v) { return ValueList{ops::slice(v[0], indices)}; });
}

Tensor gather(const Tensor& input, const Tensor& indices, int64_t axis) {
  return dispatch1({"gather", std::to_string(axis), {&input, &indices}},
                   [&](const ValueList& v) { return ValueList{ops::gather(v[0], v[1], axis)}; });
}

Tensor scatter(const Tensor& input, const Tensor& updates, const Tensor& indices, int64_t axis) {
  return dispatch1({"scatter", std::to_string(axis), {&input, &updates, &indices}},
                   [&](const ValueList& v) { return ValueList{ops::scatter(v[0], v[1], v[2], axis)}; });
}

Tensor transfer_to(const Tensor& x, DeviceRef device) {
  return dispatch1({"transfer_to", device.to_string(), {&x}},
                   [&](const ValueList& v) { return ValueList{ops::transfer_to(v[0], device)}; });
}

// ---- buffers -------------------------------------------------------------------------------------

Tensor buffer_load(const Tensor& buffer, const std::vector<SliceIndex>& indices) {
  return dispatch1({"buffer_load", slice_key(indices), {&buffer}, 1u},
                   [&](const ValueList& v) { return ValueList{ops::buffer_load(v[0], indices)}; });
}

void buffer_store(const Tensor& buffer, const Tensor& value, const std::vector<SliceIndex>& indices) {
  dispatch({"buffer_store", slice_key(indices), {&buffer, &value}, 1u}, [&](const ValueList& v) {
    ops::buffer_store(v[0], v[1], indices);
    return ValueList{};
  });
}

}  // namespace functional

// ---- operators -----------------------------------------------------------------------------------

Tensor operator+(const Tensor& a, const Tensor& b) { return functional::add(a, b); }
Tensor operator-(const Tensor& a, const Tensor& b) { return functional::sub(a, b); }
Tensor operator*(const Tensor& a, const Tensor& b) { return functional::mul(a, b); }
Tensor operator/(const Tensor& a, const Tensor& b) { return functional::div(a, b); }
Tensor operator-(const Tensor& a) { return functional::neg(a); }
Tensor operator+(const Tensor& a, double s) { return functional::add(a, scalar_like(a, s)); }
Tensor operator-(const Tensor& a, double s) { return functional::sub(a, scalar_like(a, s)); }
Tensor operator*(const Tensor& a, double s) { return functional::mul(a, scalar_like(a, s)); }
Tensor operator/(const Tensor& a, double s) { return functional::div(a, scalar_like(a, s)); }
Tensor operator+(double s, const Tensor& a) { return functional::add(scalar_like(a, s), a); }
Tensor operator-(double s, const Tensor& a) { return functional::sub(scalar_like(a, s), a); }
Tensor operator*(double s, const Tensor& a) { return functional::mul(scalar_like(a, s), a); }
Tensor operator/(double s, const Tensor& a) { return functional::div(scalar_like(a, s), a); }

}  // namespace kiln::nn
