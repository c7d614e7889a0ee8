// Op builders: normalize attributes (non-negative axes, full-rank slices, resolved reshape -1) and
// hand the node to add_node, which infers and checks the types.
#include "kiln/graph/ops.h"

#include <fmt/format.h>

#include <cmath>
#include <limits>
#include <numeric>

#include "kiln/graph/custom_op_check.h"

namespace kiln::graph::ops {

Dim SliceBound::resolve(const Dim& dim) const {
  if (dim_) return *dim_;
  if (auto n = dim.try_static()) return Dim(std::max<int64_t>(*n - from_end_, 0));
  return dim - Dim(from_end_);
}

namespace {

// Adds a node to the graph of its first operand, or to the entered graph when it has none.
std::vector<Value> build(Op op, const std::vector<Value>& inputs, Attrs attrs = {}) {
  if (!inputs.empty() && inputs[0].valid())
    return add_node(*inputs[0].graph(), inputs[0].module(), op, inputs, std::move(attrs));
  if (!inputs.empty())
    throw ValueError(fmt::format("{}: operand 0 is an empty value", op_name(op)));
  Graph& g = Graph::current();
  return add_node(g.ir(), &g.module(), op, inputs, std::move(attrs));
}

TensorValue build1(Op op, const std::vector<Value>& inputs, Attrs attrs = {}) {
  return build(op, inputs, std::move(attrs)).at(0);
}

// An operand's rank for normalizing an axis, with the op named if the operand is empty.
int64_t rank_of(Op op, const Value& v) {
  if (!v.valid()) throw ValueError(fmt::format("{}: operand 0 is an empty value", op_name(op)));
  return v.rank();
}

Attrs axis_attr(Op op, const Value& v, int64_t axis) {
  return {{"axis", normalize_axis(axis, rank_of(op, v), op_name(op))}};
}

// Little-endian bytes of one element of `dtype` holding `value`.
Bytes scalar_bytes(double value, DType dtype) {
  Bytes bytes(dtype_size(dtype));
  try {
    store_scalar(value, dtype, bytes.data());
  } catch (const ValueError& e) {
    throw ValueError(fmt::format("constant: {}", e.what()));
  }
  return bytes;
}

// Python slicing for one axis: negative static bounds count from the end, static bounds are clamped
// to the dim, and an empty range is stored as start == stop so the length stays non-negative.
void normalize_slice_axis(Op op, int64_t axis, const Dim& dim, const SliceIndex& index,
                          Shape& starts, Shape& stops, std::vector<int64_t>& steps) {
  if (index.step < 1)
    throw ValueError(fmt::format("{}: step {} at axis {} must be >= 1", op_name(op), index.step, axis));
  auto n = dim.try_static();
  auto clamp = [&](const SliceBound& bound) -> Dim {
    Dim d = bound.resolve(dim);
    auto value = d.try_static();
    if (value && n) return Dim(std::min(*value, *n));
    return d;
  };
  Dim start = clamp(index.start);
  Dim stop = index.stop ? clamp(*index.stop) : dim;
  auto s0 = start.try_static();
  auto s1 = stop.try_static();
  if (s0 && s1 && *s1 < *s0) stop = start;
  starts[axis] = start;
  stops[axis] = stop;
  steps[static_cast<size_t>(axis)] = index.step;
}

Attrs slice_attrs(Op op, const Shape& shape, const std::vector<SliceIndex>& indices) {
  if (static_cast<int64_t>(indices.size()) > shape.rank())
    throw ValueError(fmt::format("{}: {} indices for a value of rank {}", op_name(op),
                                 indices.size(), shape.rank()));
  Shape starts(std::vector<Dim>(static_cast<size_t>(shape.rank()), Dim(0)));
  Shape stops = shape;
  std::vector<int64_t> steps(static_cast<size_t>(shape.rank()), 1);
  for (size_t a = 0; a < indices.size(); ++a)
    normalize_slice_axis(op, static_cast<int64_t>(a), shape[static_cast<int64_t>(a)], indices[a],
                         starts, stops, steps);
  return {{"starts", starts}, {"stops", stops}, {"steps", steps}};
}

}  // namespace

// ==== sources ===================================================================================

TensorValue constant(const Bytes& data, DType dtype, const Shape& shape, DeviceRef device) {
  return build1(Op::constant, {},
                {{"value", data}, {"dtype", dtype}, {"shape", shape}, {"device", device}});
}

TensorValue constant(double value, DType dtype, DeviceRef device) {
  return constant(scalar_bytes(value, dtype), dtype, Shape{}, device);
}

TensorValue range(double start, double step, const Dim& size, DType dtype, DeviceRef device) {
  return build1(Op::range, {},
                {{"start", start}, {"step", step}, {"size", Shape{size}}, {"dtype", dtype},
                 {"device", device}});
}

// ==== elementwise ===============================================================================

#define KILN_UNARY(name) \
  TensorValue name(const TensorValue& x) { return build1(Op::name, {x}); }
KILN_UNARY(neg)
KILN_UNARY(abs)
KILN_UNARY(exp)
KILN_UNARY(log)
KILN_UNARY(sqrt)
KILN_UNARY(rsqrt)
KILN_UNARY(sin)
KILN_UNARY(cos)
KILN_UNARY(tanh)
KILN_UNARY(sigmoid)
KILN_UNARY(silu)
KILN_UNARY(relu)
KILN_UNARY(erf)
KILN_UNARY(floor)
KILN_UNARY(ceil)
KILN_UNARY(round)
KILN_UNARY(reciprocal)
KILN_UNARY(square)
KILN_UNARY(logical_not)
KILN_UNARY(is_nan)
#undef KILN_UNARY

TensorValue gelu(const TensorValue& x, bool tanh_approximation) {
  return build1(Op::gelu, {x}, {{"approximate", std::string(tanh_approximation ? "tanh" : "none")}});
}

#define KILN_BINARY(name) \
  TensorValue name(const TensorValue& a, const TensorValue& b) { return build1(Op::name, {a, b}); }
KILN_BINARY(add)
KILN_BINARY(sub)
KILN_BINARY(mul)
KILN_BINARY(div)
KILN_BINARY(mod)
KILN_BINARY(pow)
KILN_BINARY(maximum)
KILN_BINARY(minimum)
KILN_BINARY(equal)
KILN_BINARY(not_equal)
KILN_BINARY(greater)
KILN_BINARY(greater_equal)
KILN_BINARY(less)
KILN_BINARY(less_equal)
KILN_BINARY(logical_and)
KILN_BINARY(logical_or)
KILN_BINARY(logical_xor)
#undef KILN_BINARY

TensorValue where(const TensorValue& condition, const TensorValue& x, const TensorValue& y) {
  return build1(Op::where, {condition, x, y});
}

TensorValue cast(const TensorValue& x, DType dtype) {
  return build1(Op::cast, {x}, {{"dtype", dtype}});
}

// ==== linear algebra and reductions =============================================================

TensorValue matmul(const TensorValue& lhs, const TensorValue& rhs) {
  return build1(Op::matmul, {lhs, rhs});
}

#define KILN_REDUCTION(name)                                \
  TensorValue name(const TensorValue& x, int64_t axis) {    \
    return build1(Op::name, {x}, axis_attr(Op::name, x, axis)); \
  }
KILN_REDUCTION(sum)
KILN_REDUCTION(mean)
KILN_REDUCTION(max)
KILN_REDUCTION(min)
KILN_REDUCTION(argmax)
KILN_REDUCTION(argmin)
KILN_REDUCTION(softmax)
KILN_REDUCTION(log_softmax)
#undef KILN_REDUCTION

TensorValue cumsum(const TensorValue& x, int64_t axis, bool exclusive, bool reverse) {
  Attrs attrs = axis_attr(Op::cumsum, x, axis);
  attrs["exclusive"] = int64_t{exclusive};
  attrs["reverse"] = int64_t{reverse};
  return build1(Op::cumsum, {x}, std::move(attrs));
}

std::vector<TensorValue> top_k(const TensorValue& x, int64_t k, int64_t axis) {
  Attrs attrs = axis_attr(Op::top_k, x, axis);
  attrs["k"] = k;
  auto results = build(Op::top_k, {x}, std::move(attrs));
  return {results.at(0), results.at(1)};
}

// ==== normalization =============================================================================

TensorValue rms_norm(const TensorValue& x, const TensorValue& weight, double epsilon) {
  return build1(Op::rms_norm, {x, weight}, {{"epsilon", epsilon}});
}

TensorValue layer_norm(const TensorValue& x, const TensorValue& gamma, const TensorValue& beta,
                       double epsilon) {
  return build1(Op::layer_norm, {x, gamma, beta}, {{"epsilon", epsilon}});
}

// ==== shape and data movement ===================================================================

TensorValue reshape(const TensorValue& x, const Shape& shape) {
  return build1(Op::reshape, {x}, {{"shape", shape}});
}

TensorValue reshape(const TensorValue& x, const std::vector<int64_t>& shape) {
  rank_of(Op::reshape, x);
  std::optional<size_t> inferred;
  Dim known = 1;
  std::vector<Dim> dims;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] == -1) {
      if (inferred) throw ValueError("reshape: more than one -1 in the target shape");
      inferred = i;
      dims.emplace_back(1);
    } else if (shape[i] < 0) {
      throw ValueError(fmt::format("reshape: target dim {} is {}; dims must be >= 0 or -1", i, shape[i]));
    } else {
      dims.emplace_back(shape[i]);
      known = known * Dim(shape[i]);
    }
  }
  if (inferred) {
    Dim total = x.shape().num_elements();
    auto t = total.try_static();
    auto k = known.try_static();
    Dim missing = 0;
    if (t && k && *k != 0 && *t % *k == 0) {
      missing = Dim(*t / *k);
    } else if (!t && k && *k != 0 && total / known * known == total) {
      missing = total / known;  // symbolic totals divide when the static part does: [batch * 4] / 4
    } else {
      throw ValueError(fmt::format("reshape: cannot infer the -1 dim reshaping {} to [{}]",
                                   x.tensor_type().to_string(), fmt::join(shape, ", ")));
    }
    dims[*inferred] = missing;
  }
  return reshape(x, Shape(std::move(dims)));
}

TensorValue transpose(const TensorValue& x, int64_t axis_a, int64_t axis_b) {
  int64_t rank = rank_of(Op::transpose, x);
  std::vector<int64_t> perm(static_cast<size_t>(rank));
  std::iota(perm.begin(), perm.end(), int64_t{0});
  std::swap(perm[static_cast<size_t>(normalize_axis(axis_a, rank, "transpose"))],
            perm[static_cast<size_t>(normalize_axis(axis_b, rank, "transpose"))]);
  return build1(Op::transpose, {x}, {{"perm", perm}});
}

TensorValue permute(const TensorValue& x, const std::vector<int64_t>& perm) {
  int64_t rank = rank_of(Op::transpose, x);
  std::vector<int64_t> normalized;
  for (int64_t p : perm) normalized.push_back(normalize_axis(p, rank, "permute"));
  return build1(Op::transpose, {x}, {{"perm", normalized}});
}

TensorValue broadcast_to(const TensorValue& x, const Shape& shape) {
  return build1(Op::broadcast_to, {x}, {{"shape", shape}});
}

TensorValue concat(const std::vector<TensorValue>& values, int64_t axis) {
  if (values.empty()) throw ValueError("concat: needs at least one value");
  std::vector<Value> inputs(values.begin(), values.end());
  return build1(Op::concat, inputs, axis_attr(Op::concat, values[0], axis));
}

std::vector<TensorValue> split(const TensorValue& x, const std::vector<Dim>& sizes, int64_t axis) {
  Attrs attrs = axis_attr(Op::split, x, axis);
  attrs["sizes"] = Shape(sizes);
  auto results = build(Op::split, {x}, std::move(attrs));
  return std::vector<TensorValue>(results.begin(), results.end());
}

TensorValue slice(const TensorValue& x, const std::vector<SliceIndex>& indices) {
  rank_of(Op::slice, x);
  return build1(Op::slice, {x}, slice_attrs(Op::slice, x.shape(), indices));
}

TensorValue gather(const TensorValue& input, const TensorValue& indices, int64_t axis) {
  return build1(Op::gather, {input, indices}, axis_attr(Op::gather, input, axis));
}

TensorValue scatter(const TensorValue& input, const TensorValue& updates, const TensorValue& indices,
                    int64_t axis) {
  return build1(Op::scatter, {input, updates, indices}, axis_attr(Op::scatter, input, axis));
}

// ==== buffers, devices, calls, extensions =======================================================

TensorValue buffer_load(const BufferValue& buffer, const std::vector<SliceIndex>& indices) {
  rank_of(Op::buffer_load, buffer);
  return build1(Op::buffer_load, {buffer}, slice_attrs(Op::buffer_load, buffer.shape(), indices));
}

void buffer_store(const BufferValue& buffer, const TensorValue& value,
                  const std::vector<SliceIndex>& indices) {
  rank_of(Op::buffer_store, buffer);
  build(Op::buffer_store, {buffer, value}, slice_attrs(Op::buffer_store, buffer.shape(), indices));
}

TensorValue transfer_to(const TensorValue& x, DeviceRef device) {
  return build1(Op::transfer_to, {x}, {{"device", device}});
}

std::vector<Value> call(const std::string& callee, const std::vector<Value>& args) {
  return build(Op::call, args, {{"callee", callee}});
}

namespace {
std::vector<Type> operand_types(const std::vector<Value>& inputs) {
  std::vector<Type> types;
  for (const Value& v : inputs) {
    if (!v.valid()) throw ValueError("custom: an operand is an empty value");
    types.push_back(v.type());
  }
  return types;
}

Attrs custom_attrs(const std::string& name, const Attrs& parameters) {
  Attrs attrs{{"symbol", name}};
  for (const auto& [key, value] : parameters) attrs["param." + key] = value;
  return attrs;
}
}  // namespace

std::vector<Value> custom(const std::string& name, const std::vector<Value>& inputs,
                          const std::vector<Type>& output_types, const Attrs& parameters) {
  Attrs attrs = custom_attrs(name, parameters);
  attrs["output_types"] = output_types;
  check_custom_op(Op::custom, name, operand_types(inputs), attrs);  // when a loaded library defines it
  return build(Op::custom, inputs, std::move(attrs));
}

void inplace_custom(const std::string& name, const std::vector<Value>& inputs,
                    const Attrs& parameters) {
  if (inputs.empty())
    throw ValueError(fmt::format("inplace_custom: '{}' needs a buffer as its first operand", name));
  Attrs attrs = custom_attrs(name, parameters);
  check_custom_op(Op::inplace_custom, name, operand_types(inputs), attrs);
  build(Op::inplace_custom, inputs, std::move(attrs));
}

// ---- collectives ----------------------------------------------------------------------------------

namespace {
std::vector<Value> collective_operands(Op op, const std::vector<TensorValue>& inputs,
                                       const std::vector<BufferValue>& signal_buffers) {
  if (inputs.empty()) throw ValueError(fmt::format("{}: needs at least one input, got none", op_name(op)));
  std::vector<Value> operands(inputs.begin(), inputs.end());
  operands.insert(operands.end(), signal_buffers.begin(), signal_buffers.end());
  return operands;
}
}  // namespace

std::vector<TensorValue> allreduce_sum(const std::vector<TensorValue>& inputs,
                                       const std::vector<BufferValue>& signal_buffers, int64_t processes) {
  auto results = build(Op::allreduce_sum, collective_operands(Op::allreduce_sum, inputs, signal_buffers),
                       {{"processes", processes}});
  return std::vector<TensorValue>(results.begin(), results.end());
}

std::vector<TensorValue> allgather(const std::vector<TensorValue>& inputs,
                                   const std::vector<BufferValue>& signal_buffers, int64_t axis,
                                   int64_t processes) {
  auto operands = collective_operands(Op::allgather, inputs, signal_buffers);
  Attrs attrs = axis_attr(Op::allgather, inputs[0], axis);
  attrs["processes"] = processes;
  auto results = build(Op::allgather, operands, std::move(attrs));
  return std::vector<TensorValue>(results.begin(), results.end());
}

// ---- fused ----------------------------------------------------------------------------------------

TensorValue fused_elementwise(const std::vector<TensorValue>& inputs, const std::string& program) {
  if (inputs.empty()) throw ValueError("fused_elementwise: needs at least one input, got none");
  return build1(Op::fused_elementwise, std::vector<Value>(inputs.begin(), inputs.end()),
                {{"program", program}});
}

TensorValue attention(const TensorValue& q, const TensorValue& k, const TensorValue& v,
                      const TensorValue& masked, double scale, double softcap) {
  Attrs attrs{{"scale", scale}};
  if (softcap != 0) attrs.emplace("softcap", softcap);  // absent by default: older graphs print unchanged
  return build1(Op::attention, {q, k, v, masked}, std::move(attrs));
}

TensorValue rope(const TensorValue& x, const TensorValue& cos, const TensorValue& sin) {
  return build1(Op::rope, {x, cos, sin}, {});
}

TensorValue qmatmul(QuantizationEncoding encoding, const TensorValue& lhs, const TensorValue& rhs) {
  return build1(Op::qmatmul, {lhs, rhs}, {{"encoding", std::string(encoding_name(encoding))}});
}

TensorValue dequantize(QuantizationEncoding encoding, const TensorValue& input) {
  return build1(Op::dequantize, {input}, {{"encoding", std::string(encoding_name(encoding))}});
}

// ---- paged KV cache ------------------------------------------------------------------------------

void paged_kv_store(const BufferValue& cache, const TensorValue& value, const TensorValue& slots, int64_t layer) {
  build(Op::paged_kv_store, {cache, value, slots}, {{"layer", layer}});
}

TensorValue paged_attention(const TensorValue& q, const BufferValue& k_cache, const BufferValue& v_cache,
                            const TensorValue& block_tables, const TensorValue& seq_ids,
                            const TensorValue& positions, int64_t layer, double scale, int64_t window,
                            double softcap) {
  Attrs attrs{{"layer", layer}, {"scale", scale}};
  // Absent by default, so graphs without them print and cache as before.
  if (window != 0) attrs.emplace("window", window);
  if (softcap != 0) attrs.emplace("softcap", softcap);
  return build1(Op::paged_attention, {q, k_cache, v_cache, block_tables, seq_ids, positions}, std::move(attrs));
}

}  // namespace kiln::graph::ops

// ==== operators =================================================================================
// Scalars become rank-0 constants of the tensor's dtype on its device, in the tensor's graph, and
// broadcast through the binary op.

namespace kiln::graph {

namespace {
TensorValue scalar_like(const TensorValue& like, double value) {
  if (!like.valid()) throw ValueError("operator: use of an empty value");
  DType dtype = like.dtype();
  Attrs attrs{{"value", ops::scalar_bytes(value, dtype)},
              {"dtype", dtype},
              {"shape", Shape{}},
              {"device", like.device()}};
  return add_node(*like.graph(), like.module(), Op::constant, {}, std::move(attrs)).at(0);
}
}  // namespace

TensorValue operator+(const TensorValue& a, const TensorValue& b) { return ops::add(a, b); }
TensorValue operator-(const TensorValue& a, const TensorValue& b) { return ops::sub(a, b); }
TensorValue operator*(const TensorValue& a, const TensorValue& b) { return ops::mul(a, b); }
TensorValue operator/(const TensorValue& a, const TensorValue& b) { return ops::div(a, b); }
TensorValue operator-(const TensorValue& a) { return ops::neg(a); }
TensorValue operator+(const TensorValue& a, double s) { return ops::add(a, scalar_like(a, s)); }
TensorValue operator-(const TensorValue& a, double s) { return ops::sub(a, scalar_like(a, s)); }
TensorValue operator*(const TensorValue& a, double s) { return ops::mul(a, scalar_like(a, s)); }
TensorValue operator/(const TensorValue& a, double s) { return ops::div(a, scalar_like(a, s)); }
TensorValue operator+(double s, const TensorValue& a) { return ops::add(scalar_like(a, s), a); }
TensorValue operator-(double s, const TensorValue& a) { return ops::sub(scalar_like(a, s), a); }
TensorValue operator*(double s, const TensorValue& a) { return ops::mul(scalar_like(a, s), a); }
TensorValue operator/(double s, const TensorValue& a) { return ops::div(scalar_like(a, s), a); }

}  // namespace kiln::graph
