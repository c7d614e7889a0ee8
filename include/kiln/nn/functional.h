// The op vocabulary of ModuleV3 code: graph::ops, on nn::Tensor. Each op either runs at once (all
// operands eager) or records a graph op in its traced operands' graph (eager operands then become
// constants of that graph; operands of two graphs are a ValueError naming the op). Shapes, dtypes
// and errors are graph::ops' own.
//
// Eager ops run in the EagerSession their operands name (nn/eager_session.h; operands naming two
// sessions are a ValueError naming the op), else in default_eager_session(): each distinct op
// signature (op, attributes, operand dtypes, static shapes and devices) is compiled once into a
// one-op model and kept in that session's LRU cache, so a loop of eager calls compiles nothing
// after its first iteration.
//
//   namespace F = kiln::nn::functional;
//   nn::Tensor h = F::silu(F::matmul(x, w)) + b;
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "kiln/graph/ops.h"
#include "kiln/nn/tensor.h"

namespace kiln::nn {

class EagerSession;

// How many models default_eager_session() has compiled (one per distinct eager op signature, plus
// compile() calls it missed in its cache). Tests read it to show that repeated eager calls do not
// recompile; EagerSession::cache_stats() tells the same of any session.
int64_t eager_compile_count();

namespace functional {

using graph::ops::SliceIndex;

// ---- sources -------------------------------------------------------------------------------------
Tensor constant(const kiln::Tensor& data);  // eager data; becomes a graph constant where traced code uses it
// Eager: `size` must be static; runs in `session` (nullptr: the default one).
Tensor range(double start, double step, const graph::Dim& size, DType dtype,
             DeviceRef device = DeviceRef::CPU(), std::shared_ptr<EagerSession> session = nullptr);
// On like's device: recorded in like's graph when `like` is traced (size may then be symbolic), run
// eagerly in like's session otherwise. How forward makes positions: F::range(0, 1, seq, i64, x).
Tensor range(double start, double step, const graph::Dim& size, DType dtype, const Tensor& like);

// ---- elementwise -------------------------------------------------------------------------------
Tensor neg(const Tensor&);
Tensor abs(const Tensor&);
Tensor exp(const Tensor&);
Tensor log(const Tensor&);
Tensor sqrt(const Tensor&);
Tensor rsqrt(const Tensor&);
Tensor sin(const Tensor&);
Tensor cos(const Tensor&);
Tensor tanh(const Tensor&);
Tensor sigmoid(const Tensor&);
Tensor silu(const Tensor&);
Tensor gelu(const Tensor&, bool tanh_approximation = false);
Tensor relu(const Tensor&);
Tensor erf(const Tensor&);
Tensor floor(const Tensor&);
Tensor ceil(const Tensor&);
Tensor round(const Tensor&);
Tensor reciprocal(const Tensor&);
Tensor square(const Tensor&);
Tensor logical_not(const Tensor&);
Tensor is_nan(const Tensor&);

Tensor add(const Tensor&, const Tensor&);
Tensor sub(const Tensor&, const Tensor&);
Tensor mul(const Tensor&, const Tensor&);
Tensor div(const Tensor&, const Tensor&);
Tensor mod(const Tensor&, const Tensor&);
Tensor pow(const Tensor&, const Tensor&);
Tensor maximum(const Tensor&, const Tensor&);
Tensor minimum(const Tensor&, const Tensor&);
Tensor equal(const Tensor&, const Tensor&);
Tensor not_equal(const Tensor&, const Tensor&);
Tensor greater(const Tensor&, const Tensor&);
Tensor greater_equal(const Tensor&, const Tensor&);
Tensor less(const Tensor&, const Tensor&);
Tensor less_equal(const Tensor&, const Tensor&);
Tensor logical_and(const Tensor&, const Tensor&);
Tensor logical_or(const Tensor&, const Tensor&);
Tensor logical_xor(const Tensor&, const Tensor&);

Tensor where(const Tensor& condition, const Tensor& x, const Tensor& y);
Tensor cast(const Tensor&, DType);

// ---- linear algebra and reductions (reduced axes are kept with size 1) ------------------------------
Tensor matmul(const Tensor& lhs, const Tensor& rhs);
Tensor sum(const Tensor&, int64_t axis = -1);
Tensor mean(const Tensor&, int64_t axis = -1);
Tensor max(const Tensor&, int64_t axis = -1);
Tensor min(const Tensor&, int64_t axis = -1);
Tensor argmax(const Tensor&, int64_t axis = -1);
Tensor argmin(const Tensor&, int64_t axis = -1);
Tensor cumsum(const Tensor&, int64_t axis = -1, bool exclusive = false, bool reverse = false);
std::vector<Tensor> top_k(const Tensor&, int64_t k, int64_t axis = -1);  // {values, indices}

// ---- normalization -----------------------------------------------------------------------------
Tensor softmax(const Tensor&, int64_t axis = -1);
Tensor log_softmax(const Tensor&, int64_t axis = -1);
Tensor rms_norm(const Tensor& x, const Tensor& weight, double epsilon = 1e-6);
Tensor layer_norm(const Tensor& x, const Tensor& gamma, const Tensor& beta, double epsilon = 1e-5);

// ---- shape and data movement ---------------------------------------------------------------------
Tensor reshape(const Tensor&, const graph::Shape& shape);
Tensor reshape(const Tensor&, const std::vector<int64_t>& shape);
Tensor transpose(const Tensor&, int64_t axis_a, int64_t axis_b);
Tensor permute(const Tensor&, const std::vector<int64_t>& perm);
Tensor broadcast_to(const Tensor&, const graph::Shape& shape);
Tensor concat(const std::vector<Tensor>&, int64_t axis = 0);
std::vector<Tensor> split(const Tensor&, const std::vector<graph::Dim>& sizes, int64_t axis = 0);
Tensor slice(const Tensor&, const std::vector<SliceIndex>& indices);
Tensor gather(const Tensor& input, const Tensor& indices, int64_t axis = 0);
Tensor scatter(const Tensor& input, const Tensor& updates, const Tensor& indices, int64_t axis = 0);
Tensor transfer_to(const Tensor&, DeviceRef device);

// ---- buffers: a traced buffer value, or eager data written in place --------------------------------
Tensor buffer_load(const Tensor& buffer, const std::vector<SliceIndex>& indices = {});
void buffer_store(const Tensor& buffer, const Tensor& value, const std::vector<SliceIndex>& indices = {});

}  // namespace functional

// Arithmetic operators build the matching ops; a scalar becomes a rank-0 tensor of the other
// operand's dtype and device.
Tensor operator+(const Tensor&, const Tensor&);
Tensor operator-(const Tensor&, const Tensor&);
Tensor operator*(const Tensor&, const Tensor&);
Tensor operator/(const Tensor&, const Tensor&);
Tensor operator-(const Tensor&);
Tensor operator+(const Tensor&, double);
Tensor operator-(const Tensor&, double);
Tensor operator*(const Tensor&, double);
Tensor operator/(const Tensor&, double);
Tensor operator+(double, const Tensor&);
Tensor operator-(double, const Tensor&);
Tensor operator*(double, const Tensor&);
Tensor operator/(double, const Tensor&);

}  // namespace kiln::nn
