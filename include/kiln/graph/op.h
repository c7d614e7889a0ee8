// The ordered enum of built-in ops and their attributes. An op constructor in ops.h does no work
// beyond inferring types: it stamps the op, its operands and its attributes on a new node.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "kiln/errors.h"
#include "kiln/graph/device.h"
#include "kiln/graph/dim.h"
#include "kiln/graph/dtype.h"
#include "kiln/graph/types.h"

namespace kiln::graph {

// X-macro: (enum name, text name). Order is stable: append new ops at the end of their group.
#define KILN_OPS(X)                                                                         \
  /* sources */                                                                             \
  X(constant, "constant") X(weight, "weight") X(range, "range")                             \
  /* elementwise unary */                                                                   \
  X(neg, "neg") X(abs, "abs") X(exp, "exp") X(log, "log") X(sqrt, "sqrt") X(rsqrt, "rsqrt") \
  X(sin, "sin") X(cos, "cos") X(tanh, "tanh") X(sigmoid, "sigmoid") X(silu, "silu")         \
  X(gelu, "gelu") X(relu, "relu") X(erf, "erf") X(floor, "floor") X(ceil, "ceil")           \
  X(round, "round") X(reciprocal, "reciprocal") X(square, "square")                         \
  X(logical_not, "logical_not") X(is_nan, "is_nan")                                         \
  /* elementwise binary (broadcasting) */                                                   \
  X(add, "add") X(sub, "sub") X(mul, "mul") X(div, "div") X(mod, "mod") X(pow, "pow")       \
  X(maximum, "maximum") X(minimum, "minimum")                                               \
  X(equal, "equal") X(not_equal, "not_equal") X(greater, "greater")                         \
  X(greater_equal, "greater_equal") X(less, "less") X(less_equal, "less_equal")             \
  X(logical_and, "logical_and") X(logical_or, "logical_or") X(logical_xor, "logical_xor")   \
  /* other elementwise */                                                                   \
  X(where, "where") X(cast, "cast")                                                         \
  /* linear algebra and reductions */                                                       \
  X(matmul, "matmul") X(sum, "sum") X(mean, "mean") X(max, "max") X(min, "min")             \
  X(argmax, "argmax") X(argmin, "argmin") X(cumsum, "cumsum") X(top_k, "top_k")             \
  /* normalization */                                                                       \
  X(softmax, "softmax") X(log_softmax, "log_softmax") X(rms_norm, "rms_norm")               \
  X(layer_norm, "layer_norm")                                                               \
  /* shape and data movement */                                                             \
  X(reshape, "reshape") X(transpose, "transpose") X(broadcast_to, "broadcast_to")           \
  X(concat, "concat") X(split, "split") X(slice, "slice") X(gather, "gather")               \
  X(scatter, "scatter")                                                                     \
  /* buffers, devices, calls, extensions */                                                 \
  X(buffer_load, "buffer_load") X(buffer_store, "buffer_store")                             \
  X(transfer_to, "transfer_to") X(call, "call") X(custom, "custom")                         \
  X(inplace_custom, "inplace_custom")                                                       \
  /* collectives */                                                                         \
  X(allreduce_sum, "allreduce_sum") X(allgather, "allgather")                               \
  /* fused (built by compiler passes and nn layers; docs/fusion.md) */                       \
  X(fused_elementwise, "fused_elementwise") X(attention, "attention") X(rope, "rope")       \
  X(grouped_matmul, "grouped_matmul")                                                       \
  /* quantized weights (kiln/graph/quantization.h, docs/quantization.md) */                 \
  X(qmatmul, "qmatmul") X(dequantize, "dequantize")                                         \
  /* paged KV cache (docs/kv-cache.md; last, so no earlier op is renumbered) */             \
  X(paged_kv_store, "paged_kv_store") X(paged_attention, "paged_attention")

enum class Op : uint16_t {
#define KILN_OP_ENUM(e, s) e,
  KILN_OPS(KILN_OP_ENUM)
#undef KILN_OP_ENUM
};

std::string_view op_name(Op);
Op parse_op(std::string_view);  // ParseError for an unknown name
bool is_elementwise_unary(Op);
bool is_elementwise_binary(Op);  // add .. logical_xor
bool is_comparison(Op);          // equal .. less_equal (result is bool)
// buffer_store, paged_kv_store, inplace_custom, custom (may be impure), and collectives (they advance
// their signal buffers' counters, which every participant must do together): never CSE'd or DCE'd.
bool has_side_effects(Op);
// buffer_load and paged_attention: they read their buffer operands and write none. Their results
// depend on the stores before them in program order, so they are never CSE'd either, but a read does
// not end the life of an alias of the buffer (plan_aliases).
bool reads_buffers(Op);
bool is_collective(Op);          // allreduce_sum, allgather

// Attributes each op carries (builders normalize them: axes non-negative, slices full-rank):
//   constant        value: Bytes, dtype, shape, device
//   weight          name: string, dtype, shape, device
//   range           start: double, step: double, size: Shape (one dim), dtype, device
//   gelu            approximate: string ("none" | "tanh")
//   cast            dtype
//   matmul          transpose_b: int64 (0/1; optional): rhs read as [..., K, N] from [..., N, K].
//                   Operands share one dtype, except lhs f32 with rhs f16 or bf16 (weights kept
//                   narrow, widened in registers): the result is then f32.
//   sum mean max min argmax argmin softmax log_softmax     axis: int64
//   cumsum          axis, exclusive: int64 (0/1), reverse: int64 (0/1)
//   top_k           k: int64, axis
//   rms_norm layer_norm                                    epsilon: double
//   reshape broadcast_to                                   shape: Shape
//   transpose       perm: vector<int64>
//   concat gather scatter                                  axis
//   split           sizes: Shape, axis
//   slice buffer_load buffer_store                         starts: Shape, stops: Shape, steps: vector<int64>
//   transfer_to     device
//   call            callee: string
//   custom          symbol: string, output_types: vector<Type>, param.<name>: any
//   inplace_custom  symbol: string, param.<name>: any
//   allreduce_sum   processes: int64 (how many processes the collective spans; 1 = this one)
//   allgather       axis, processes
//   fused_elementwise  program: string (an ElementwiseProgram's text, elementwise_program.h)
//   attention       scale: double (multiplies q . k before the softmax)
//   qmatmul dequantize  encoding: string (quantization.h's encoding_name, "q8_0")
//   paged_kv_store  layer: int64 (which layer of the cache)
//   paged_attention layer: int64, scale: double (multiplies q . k before the softmax)
//   grouped_matmul  transpose_b: int64 (optional), as matmul; or encoding: string, as qmatmul. One op
//                   for both (not a grouped_qmatmul beside it): the attribute picks which op each
//                   result is, so inference, text, the pass and the kernel each have one entry.
// Operand order: where(cond, x, y), rms_norm(x, weight), layer_norm(x, gamma, beta),
// gather(input, indices), scatter(input, updates, indices), buffer_store(buffer, value),
// allreduce_sum / allgather(input_0 .. input_{n-1}, signal_buffer_0 .. signal_buffer_{n-1}): one
// input per device, then one signal buffer per device (none when n == 1); result i is on device i.
// fused_elementwise(register_0 .. register_{n-1}), attention(q, k, v, masked), rope(x, cos, sin),
// qmatmul(lhs, rhs) with rhs the encoded weight u8[N, row_bytes], dequantize(input),
// paged_kv_store(cache, value, slots), paged_attention(q, k_cache, v_cache, block_tables, seq_ids,
// positions),
// grouped_matmul(lhs, rhs_0 .. rhs_{n-1}), n >= 2, with n results: result i is matmul(lhs, rhs_i) (or
// qmatmul(lhs, rhs_i) with `encoding`), built by the group_matmuls pass (docs/fusion.md).
//
// Attribute values. Bytes hold constant data (little-endian elements). Shape holds Dims, so slice
// bounds and reshape targets can be symbolic.
using Bytes = std::vector<uint8_t>;
// std::vector<Type> declares the results of ops whose types cannot be inferred (custom).
using Attr = std::variant<int64_t, double, std::string, std::vector<int64_t>, Shape, DType,
                          DeviceRef, Bytes, std::vector<Type>>;
// Ordered by name so printing is deterministic.
using Attrs = std::map<std::string, Attr>;

// Typed access with an error naming the op and attribute ("matmul: missing attribute 'axis'").
template <class T>
const T& get_attr(const Attrs& attrs, const std::string& name, Op op) {
  auto it = attrs.find(name);
  if (it == attrs.end())
    throw ValueError(std::string(op_name(op)) + ": missing attribute '" + name + "'");
  if (const T* v = std::get_if<T>(&it->second)) return *v;
  throw ValueError(std::string(op_name(op)) + ": attribute '" + name + "' has the wrong kind");
}

}  // namespace kiln::graph
