// Op builders. Each adds one node to the graph of its operands (or Graph::current() when it has none)
// and returns its results; shapes and dtypes are inferred and checked here, with errors that name the
// op, the operand and its type. Binary ops broadcast numpy-style, symbolic dims included.
#pragma once

#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "kiln/graph/graph.h"
#include "kiln/graph/quantization.h"

namespace kiln::graph::ops {

// ---- sources -----------------------------------------------------------------------------------
// A tensor constant from raw little-endian element bytes (size must equal the shape's bytes).
TensorValue constant(const Bytes& data, DType dtype, const Shape& shape,
                     DeviceRef device = DeviceRef::CPU());
// A scalar (rank 0) constant, converted to dtype.
TensorValue constant(double value, DType dtype, DeviceRef device = DeviceRef::CPU());
template <class T>
TensorValue constant(const std::vector<T>& values, const Shape& shape,
                     DeviceRef device = DeviceRef::CPU()) {
  Bytes bytes(values.size() * sizeof(T));
  if (!values.empty()) std::memcpy(bytes.data(), values.data(), bytes.size());
  return constant(bytes, kiln::dtype_of<T>(), shape, device);  // graph::dtype_of(Type) hides it
}
// [start, start + step, ...) with `size` elements: size may be symbolic.
TensorValue range(double start, double step, const Dim& size, DType dtype,
                  DeviceRef device = DeviceRef::CPU());

// ---- elementwise -------------------------------------------------------------------------------
TensorValue neg(const TensorValue&);
TensorValue abs(const TensorValue&);
TensorValue exp(const TensorValue&);
TensorValue log(const TensorValue&);
TensorValue sqrt(const TensorValue&);
TensorValue rsqrt(const TensorValue&);
TensorValue sin(const TensorValue&);
TensorValue cos(const TensorValue&);
TensorValue tanh(const TensorValue&);
TensorValue sigmoid(const TensorValue&);
TensorValue silu(const TensorValue&);
TensorValue gelu(const TensorValue&, bool tanh_approximation = false);  // attr "approximate"
TensorValue relu(const TensorValue&);
TensorValue erf(const TensorValue&);
TensorValue floor(const TensorValue&);
TensorValue ceil(const TensorValue&);
TensorValue round(const TensorValue&);  // half to even
TensorValue reciprocal(const TensorValue&);
TensorValue square(const TensorValue&);
TensorValue logical_not(const TensorValue&);
TensorValue is_nan(const TensorValue&);

TensorValue add(const TensorValue&, const TensorValue&);
TensorValue sub(const TensorValue&, const TensorValue&);
TensorValue mul(const TensorValue&, const TensorValue&);
TensorValue div(const TensorValue&, const TensorValue&);  // integers: truncating, like C++
TensorValue mod(const TensorValue&, const TensorValue&);  // sign follows the divisor, like Python
TensorValue pow(const TensorValue&, const TensorValue&);
TensorValue maximum(const TensorValue&, const TensorValue&);
TensorValue minimum(const TensorValue&, const TensorValue&);
TensorValue equal(const TensorValue&, const TensorValue&);
TensorValue not_equal(const TensorValue&, const TensorValue&);
TensorValue greater(const TensorValue&, const TensorValue&);
TensorValue greater_equal(const TensorValue&, const TensorValue&);
TensorValue less(const TensorValue&, const TensorValue&);
TensorValue less_equal(const TensorValue&, const TensorValue&);
TensorValue logical_and(const TensorValue&, const TensorValue&);
TensorValue logical_or(const TensorValue&, const TensorValue&);
TensorValue logical_xor(const TensorValue&, const TensorValue&);

TensorValue where(const TensorValue& condition, const TensorValue& x, const TensorValue& y);
TensorValue cast(const TensorValue&, DType);

// ---- linear algebra and reductions ---------------------------------------------------------------
// Batched, broadcasting matmul: [..., M, K] x [..., K, N] -> [..., M, N]; a rank-1 operand is
// treated as numpy does (prepended/appended 1 then removed).
TensorValue matmul(const TensorValue& lhs, const TensorValue& rhs);
// Reductions keep the reduced axis with size 1 (as MAX does).
TensorValue sum(const TensorValue&, int64_t axis = -1);
TensorValue mean(const TensorValue&, int64_t axis = -1);
TensorValue max(const TensorValue&, int64_t axis = -1);
TensorValue min(const TensorValue&, int64_t axis = -1);
TensorValue argmax(const TensorValue&, int64_t axis = -1);  // i64 result, first index on ties
TensorValue argmin(const TensorValue&, int64_t axis = -1);
TensorValue cumsum(const TensorValue&, int64_t axis = -1, bool exclusive = false, bool reverse = false);
// Largest k along axis, sorted descending: {values, indices (i64)}.
std::vector<TensorValue> top_k(const TensorValue&, int64_t k, int64_t axis = -1);

// ---- normalization -----------------------------------------------------------------------------
TensorValue softmax(const TensorValue&, int64_t axis = -1);
TensorValue log_softmax(const TensorValue&, int64_t axis = -1);
// x / sqrt(mean(x^2, -1) + eps) * weight; weight has the last dim's shape.
TensorValue rms_norm(const TensorValue& x, const TensorValue& weight, double epsilon = 1e-6);
// (x - mean) / sqrt(var + eps) * gamma + beta over the last axis.
TensorValue layer_norm(const TensorValue& x, const TensorValue& gamma, const TensorValue& beta,
                       double epsilon = 1e-5);

// ---- shape and data movement ---------------------------------------------------------------------
// One target dim may be -1 (inferred, static shapes only); the element counts must match.
TensorValue reshape(const TensorValue&, const Shape& shape);
TensorValue reshape(const TensorValue&, const std::vector<int64_t>& shape);
TensorValue transpose(const TensorValue&, int64_t axis_a, int64_t axis_b);
TensorValue permute(const TensorValue&, const std::vector<int64_t>& perm);  // op transpose, attr perm
TensorValue broadcast_to(const TensorValue&, const Shape& shape);
TensorValue concat(const std::vector<TensorValue>&, int64_t axis = 0);
std::vector<TensorValue> split(const TensorValue&, const std::vector<Dim>& sizes, int64_t axis = 0);
// One entry per leading axis (the rest are kept whole). Negative static start/stop count from the
// end, as in Python; bounds are clamped to the dim when static; step >= 1.
// A slice bound: a Dim, or a negative integer that counts from the end of the axis (x[-2:]).
class SliceBound {
 public:
  SliceBound(int64_t value) {
    if (value < 0) from_end_ = -value; else dim_ = Dim(value);
  }
  SliceBound(int value) : SliceBound(int64_t{value}) {}
  SliceBound(Dim dim) : dim_(std::move(dim)) {}
  SliceBound(const char* symbol) : dim_(Dim(symbol)) {}
  SliceBound(const std::string& symbol) : dim_(Dim(symbol)) {}
  // The bound on an axis of size `dim` (before clamping): `dim - n` for a negative -n.
  Dim resolve(const Dim& dim) const;
  // For a negative bound, n in -n; 0 otherwise.
  int64_t from_end() const { return from_end_; }

 private:
  std::optional<Dim> dim_;
  int64_t from_end_ = 0;
};
struct SliceIndex {
  SliceIndex(SliceBound start = 0, std::optional<SliceBound> stop = std::nullopt, int64_t step = 1)
      : start(std::move(start)), stop(std::move(stop)), step(step) {}
  SliceBound start;
  std::optional<SliceBound> stop;  // nullopt: to the end
  int64_t step;
};
TensorValue slice(const TensorValue&, const std::vector<SliceIndex>& indices);
// Rows of `input` along axis, selected by integer `indices`: out.shape = in[:axis] + idx + in[axis+1:].
TensorValue gather(const TensorValue& input, const TensorValue& indices, int64_t axis = 0);
// Copy of `input` with input[..., indices[i], ...] = updates[..., i, ...] along axis (last write wins).
TensorValue scatter(const TensorValue& input, const TensorValue& updates, const TensorValue& indices,
                    int64_t axis = 0);

// ---- buffers, devices, calls, extensions ---------------------------------------------------------
// A tensor copy of a slice of a buffer (all of it with no indices).
TensorValue buffer_load(const BufferValue&, const std::vector<SliceIndex>& indices = {});
// Writes `value` into a slice of the buffer in place; shapes must match the slice.
void buffer_store(const BufferValue&, const TensorValue& value,
                  const std::vector<SliceIndex>& indices = {});
TensorValue transfer_to(const TensorValue&, DeviceRef device);
// Calls graph `callee` of the same Module with `args`; returns its outputs.
std::vector<Value> call(const std::string& callee, const std::vector<Value>& args);
// A custom op resolved against loaded extensions at compile time (or at build time when loaded).
// Parameters are attributes named "param.<name>".
std::vector<Value> custom(const std::string& name, const std::vector<Value>& inputs,
                          const std::vector<Type>& output_types, const Attrs& parameters = {});
// Like custom, mutating its first input, which must be a buffer; it has no results.
void inplace_custom(const std::string& name, const std::vector<Value>& inputs,
                    const Attrs& parameters = {});

// ---- collectives (docs/multi-device.md) ------------------------------------------------------------
// One input per device (distinct devices, equal dtype and shape), and one signal buffer per device
// (BufferType(u8, [SIGNAL_BYTES], device_i), from engine::Signals; none for a single device). With
// processes > 1 the collective also spans that many processes (MPI ranks, each running this graph
// on its own devices): the session's process group carries it between them.
// Result i, on device i: the elementwise sum of every input of every process.
std::vector<TensorValue> allreduce_sum(const std::vector<TensorValue>& inputs,
                                       const std::vector<BufferValue>& signal_buffers,
                                       int64_t processes = 1);
// Result i, on device i: the inputs concatenated along `axis` in device order (process 0's devices
// first); inputs may differ in that dim only (across processes they must be equal in every dim).
std::vector<TensorValue> allgather(const std::vector<TensorValue>& inputs,
                                   const std::vector<BufferValue>& signal_buffers, int64_t axis = 0,
                                   int64_t processes = 1);

// ---- fused (docs/fusion.md) ------------------------------------------------------------------------
// One elementwise expression over `inputs` in a single pass (what the fuse_elementwise compiler pass
// builds). `program` is an ElementwiseProgram's text (kiln/graph/elementwise_program.h) whose
// registers %0 .. %(n-1) are the inputs; the result has the last instruction's dtype and the
// broadcast shape of all inputs.
TensorValue fused_elementwise(const std::vector<TensorValue>& inputs, const std::string& program);
// Grouped-query attention over a KV history, softmax in f32:
//   out[s, h] = sum_t softmax_t(q[s, h] . k[t, h / g] * scale, masked) v[t, h / g],  g = heads / kv_heads
// q [seq, heads, head_dim]; k, v [total, kv_heads, head_dim] (q's dtype); masked bool [seq, total],
// true where query s must not see key t (a masked score counts as the lowest float, so a row that
// is masked everywhere averages every v). Result [seq, heads, head_dim] in q's dtype. softcap > 0
// caps each scaled score as softcap * tanh(score / softcap) before the mask (Gemma 2); 0: none.
TensorValue attention(const TensorValue& q, const TensorValue& k, const TensorValue& v,
                      const TensorValue& masked, double scale, double softcap = 0);
// Rotary position embedding, rotate-half form (Llama's, Hugging Face's `apply_rotary_pos_emb`):
//   out = x * cos + rotate_half(x) * sin,  rotate_half(x) = concat(-x[..., half:], x[..., :half])
// with cos and sin broadcast over the heads, each product and the sum rounded to x's dtype as the
// unfused ops round them. x [seq, heads, head_dim] (head_dim static and even); cos, sin
// [seq, head_dim] in x's dtype. One kernel instead of split, neg, concat and the elementwise tail.
TensorValue rope(const TensorValue& x, const TensorValue& cos, const TensorValue& sin);

// ---- quantized weights (quantization.h, docs/quantization.md) ------------------------------------
// lhs f32[..., K] times a quantized weight rhs u8[N, row_bytes] (N rows of K encoded weights, a
// Linear weight's [out, in] orientation) -> f32[..., N]. K must be static and a multiple of the
// encoding's block size, and row_bytes must be quantized_row_bytes(encoding, K).
TensorValue qmatmul(QuantizationEncoding encoding, const TensorValue& lhs, const TensorValue& rhs);
// Encoded rows u8[..., row_bytes] -> f32[..., K] (e.g. the rows a gather took from a quantized
// embedding table). row_bytes must be static and a whole number of blocks.
TensorValue dequantize(QuantizationEncoding encoding, const TensorValue& input);

// ---- paged KV cache (vLLM's PagedAttention; docs/kv-cache.md) -------------------------------------
// A ragged batch: `tokens` rows from several sequences concatenated. A paged KV cache is a buffer
// [layers, num_blocks, block_size, kv_heads, head_dim] (f32, bf16 or f16) of fixed-size blocks; slot
// block * block_size + offset is one token position.
//
// Writes value [tokens, kv_heads, head_dim] (f32, or the cache's dtype; converted to the cache's) into
// layer `layer` at slot slots[t] (i64[tokens]) for each token t. A slot < 0 is skipped (a padding
// row); a slot >= num_blocks * block_size, or one given to two tokens, is an error at execute.
void paged_kv_store(const BufferValue& cache, const TensorValue& value, const TensorValue& slots, int64_t layer);
// Causal grouped-query attention of each token over its own sequence's cached keys and values (which
// paged_kv_store wrote earlier in program order, this step's tokens included): q [tokens, heads,
// head_dim]; token t is of sequence seq_ids[t] at position positions[t] (both i64[tokens]) and attends
// to positions 0 .. positions[t] of it; position j of sequence s is row j % block_size of block
// block_tables[s, j / block_size] (i64[seqs, max_blocks_per_seq]). Softmax in f32, scores scaled by
// `scale`; query head h reads kv head h / (heads / kv_heads). -> [tokens, heads, head_dim] in q's
// dtype. Out-of-range seq ids, positions and block ids are errors at execute naming the token or
// sequence. A token's result does not depend on the rest of the batch (bitwise). window > 0 is
// sliding-window attention: the token attends only to positions max(0, positions[t] - window + 1) ..
// positions[t] (Hugging Face's window: key j visible iff positions[t] - j < window); 0: all. softcap
// as attention's.
TensorValue paged_attention(const TensorValue& q, const BufferValue& k_cache, const BufferValue& v_cache,
                            const TensorValue& block_tables, const TensorValue& seq_ids,
                            const TensorValue& positions, int64_t layer, double scale, int64_t window = 0,
                            double softcap = 0);

}  // namespace kiln::graph::ops
