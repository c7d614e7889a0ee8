// Type inference for every built-in op: the single source of truth for what an op accepts and
// produces, shared by the builders (ops.cpp) and the verifier. Attributes arrive normalized (see the
// table in op.h); this file checks them rather than fixing them.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <optional>

#include "kiln/errors.h"
#include "kiln/graph/elementwise_program.h"
#include "kiln/graph/graph.h"
#include "kiln/graph/quantization.h"
#include "kiln/graph/signals.h"

namespace kiln::graph {

namespace {

bool is_static_one(const Dim& d) { return d.try_static() == std::optional<int64_t>(1); }

// The name an operand has in messages ("lhs", "x", "indices", ...), so errors read like the API.
std::string operand_role(Op op, size_t i) {
  auto pick = [&](std::initializer_list<const char*> names) -> std::string {
    if (i < names.size()) return *(names.begin() + i);
    return fmt::format("operand {}", i);
  };
  if (is_elementwise_binary(op) || op == Op::matmul || op == Op::qmatmul) return pick({"lhs", "rhs"});
  switch (op) {
    case Op::where: return pick({"condition", "x", "y"});
    case Op::rms_norm: return pick({"x", "weight"});
    case Op::layer_norm: return pick({"x", "gamma", "beta"});
    case Op::gather: return pick({"input", "indices"});
    case Op::scatter: return pick({"input", "updates", "indices"});
    case Op::buffer_store: return pick({"buffer", "value"});
    case Op::attention: return pick({"q", "k", "v", "masked"});
    case Op::rope: return pick({"x", "cos", "sin"});
    case Op::paged_kv_store: return pick({"cache", "value", "slots"});
    case Op::paged_attention: return pick({"q", "k_cache", "v_cache", "block_tables", "seq_ids", "positions"});
    case Op::fused_elementwise: return fmt::format("%{}", i);
    case Op::grouped_matmul: return i == 0 ? std::string("lhs") : fmt::format("rhs {}", i - 1);
    default: break;
  }
  if (is_elementwise_unary(op) || op == Op::cast || op == Op::transfer_to) return pick({"input"});
  return fmt::format("operand {}", i);
}

// Everything one inference needs, with the helpers that turn a failed check into a message naming
// the op and its operands.
struct Ctx {
  Op op;
  const std::vector<Type>& in;
  const Attrs& attrs;
  const Module* module;

  std::string name() const { return std::string(op_name(op)); }

  // "(lhs f32[batch, 64], rhs f32[128, 10])"
  std::string operands() const {
    std::string s = "(";
    for (size_t i = 0; i < in.size(); ++i) {
      if (i) s += ", ";
      s += operand_role(op, i) + " " + to_string(in[i]);
    }
    return s + ")";
  }

  template <class E = ValueError, class... Args>
  [[noreturn]] void fail(fmt::format_string<Args...> f, Args&&... args) const {
    throw E(name() + ": " + fmt::format(f, std::forward<Args>(args)...));
  }

  void expect_operands(size_t n) const {
    if (in.size() != n) fail("expected {} operand{}, got {}", n, n == 1 ? "" : "s", in.size());
  }
  void expect_at_least(size_t n) const {
    if (in.size() < n) fail("expected at least {} operands, got {}", n, in.size());
  }

  const TensorType& tensor(size_t i) const {
    if (const auto* t = std::get_if<TensorType>(&in.at(i))) return *t;
    fail("{} must be a tensor, got {}", operand_role(op, i), to_string(in[i]));
  }

  template <class T>
  const T& attr(const std::string& key) const { return get_attr<T>(attrs, key, op); }

  // Axes are stored non-negative by the builders.
  int64_t axis_attr(const std::string& key, int64_t rank) const {
    int64_t axis = attr<int64_t>(key);
    if (axis < 0 || axis >= rank) fail("{} {} out of range for rank {} {}", key, axis, rank, operands());
    return axis;
  }

  void same_device(const std::vector<DeviceRef>& devices) const {
    for (const DeviceRef& d : devices)
      if (d != devices.front())
        fail("operands are on different devices {} and {} {}", devices.front().to_string(),
             d.to_string(), operands());
  }
  void same_device_all() const {
    std::vector<DeviceRef> devices;
    for (const Type& t : in) devices.push_back(device_of(t));
    if (!devices.empty()) same_device(devices);
  }

  void same_dtype(DType a, DType b) const {
    if (a != b)
      fail<DTypeError>("operand dtypes {} and {} differ {}", dtype_name(a), dtype_name(b), operands());
  }
  void require_float(size_t i) const {
    DType d = dtype_of(in.at(i));
    if (!is_float(d))
      fail<DTypeError>("{} must have a float dtype, got {}", operand_role(op, i), to_string(in[i]));
  }
  void require_numeric(size_t i) const {
    if (dtype_of(in.at(i)) == DType::boolean)
      fail<DTypeError>("{} must have a numeric dtype, got {}", operand_role(op, i), to_string(in[i]));
  }
  void require_index(size_t i) const {
    DType d = dtype_of(in.at(i));
    if (d != DType::i32 && d != DType::i64)
      fail<DTypeError>("{} must be i32 or i64, got {}", operand_role(op, i), to_string(in[i]));
  }

  // Numpy broadcasting, right-aligned; a dim broadcasts when it equals the other or is static 1.
  Shape broadcast(const std::vector<Shape>& shapes, std::string_view what = "shapes") const {
    int64_t rank = 0;
    for (const Shape& s : shapes) rank = std::max(rank, s.rank());
    std::vector<Dim> out(static_cast<size_t>(rank), Dim(1));
    for (int64_t a = 0; a < rank; ++a) {
      Dim& result = out[static_cast<size_t>(a)];
      for (const Shape& s : shapes) {
        int64_t i = a - (rank - s.rank());
        if (i < 0) continue;
        const Dim& d = s[i];
        if (is_static_one(result)) {
          result = d;
        } else if (!is_static_one(d) && !(d == result)) {
          fail<ShapeError>("{} do not broadcast at axis {} ({} vs {}) {}", what, a,
                           result.to_string(), d.to_string(), operands());
        }
      }
    }
    return Shape(std::move(out));
  }
};

// ==== sources ===================================================================================

std::vector<Type> infer_source(const Ctx& c) {
  c.expect_operands(0);
  switch (c.op) {
    case Op::constant: {
      TensorType t{c.attr<DType>("dtype"), c.attr<Shape>("shape"), c.attr<DeviceRef>("device")};
      auto count = t.shape.static_num_elements();
      if (!count) c.fail<ShapeError>("shape {} must be static", t.shape.to_string());
      size_t expected = static_cast<size_t>(*count) * dtype_size(t.dtype);
      size_t got = c.attr<Bytes>("value").size();
      if (got != expected)
        c.fail("{} bytes of data do not match {} ({} bytes)", got, t.to_string(), expected);
      return {t};
    }
    case Op::weight: {
      const std::string& name = c.attr<std::string>("name");
      if (name.empty()) c.fail("a weight needs a non-empty name");
      return {TensorType{c.attr<DType>("dtype"), c.attr<Shape>("shape"), c.attr<DeviceRef>("device")}};
    }
    case Op::range: {
      c.attr<double>("start");
      c.attr<double>("step");
      const Shape& size = c.attr<Shape>("size");
      if (size.rank() != 1) c.fail("size must have one dim, got {}", size.to_string());
      DType dtype = c.attr<DType>("dtype");
      if (dtype == DType::boolean) c.fail<DTypeError>("dtype must be numeric, got bool");
      return {TensorType{dtype, size, c.attr<DeviceRef>("device")}};
    }
    default: break;
  }
  c.fail("not a source op");
}

// ==== elementwise ===============================================================================

bool float_only_unary(Op op) {
  switch (op) {
    case Op::exp: case Op::log: case Op::sqrt: case Op::rsqrt: case Op::sin: case Op::cos:
    case Op::tanh: case Op::sigmoid: case Op::silu: case Op::gelu: case Op::erf:
    case Op::reciprocal: case Op::floor: case Op::ceil: case Op::round: case Op::is_nan:
      return true;
    default: return false;
  }
}

std::vector<Type> infer_unary(const Ctx& c) {
  c.expect_operands(1);
  TensorType t = c.tensor(0);
  if (float_only_unary(c.op)) c.require_float(0);
  if (c.op == Op::logical_not && t.dtype != DType::boolean)
    c.fail<DTypeError>("input must be bool, got {}", t.to_string());
  if (c.op == Op::neg || c.op == Op::abs || c.op == Op::square || c.op == Op::relu)
    c.require_numeric(0);
  if (c.op == Op::neg && !is_signed(t.dtype))
    c.fail<DTypeError>("input must be signed, got {}", t.to_string());
  if (c.op == Op::gelu) {
    const std::string& mode = c.attr<std::string>("approximate");
    if (mode != "none" && mode != "tanh")
      c.fail("attribute 'approximate' must be \"none\" or \"tanh\", got \"{}\"", mode);
  }
  if (c.op == Op::is_nan) t.dtype = DType::boolean;
  return {t};
}

std::vector<Type> infer_binary(const Ctx& c) {
  c.expect_operands(2);
  const TensorType& a = c.tensor(0);
  const TensorType& b = c.tensor(1);
  c.same_device({a.device, b.device});
  c.same_dtype(a.dtype, b.dtype);
  bool logical = c.op == Op::logical_and || c.op == Op::logical_or || c.op == Op::logical_xor;
  if (logical && a.dtype != DType::boolean)
    c.fail<DTypeError>("operands must be bool {}", c.operands());
  if (!logical && !is_comparison(c.op) && a.dtype == DType::boolean)
    c.fail<DTypeError>("bool operands are not supported {}", c.operands());
  Shape shape = c.broadcast({a.shape, b.shape});
  DType dtype = is_comparison(c.op) ? DType::boolean : a.dtype;
  return {TensorType{dtype, std::move(shape), a.device}};
}

std::vector<Type> infer_where(const Ctx& c) {
  c.expect_operands(3);
  const TensorType& cond = c.tensor(0);
  const TensorType& x = c.tensor(1);
  const TensorType& y = c.tensor(2);
  c.same_device({cond.device, x.device, y.device});
  if (cond.dtype != DType::boolean)
    c.fail<DTypeError>("condition must be bool {}", c.operands());
  c.same_dtype(x.dtype, y.dtype);
  return {TensorType{x.dtype, c.broadcast({cond.shape, x.shape, y.shape}), x.device}};
}

std::vector<Type> infer_cast(const Ctx& c) {
  c.expect_operands(1);
  TensorType t = c.tensor(0);
  t.dtype = c.attr<DType>("dtype");
  return {t};
}

// ==== linear algebra and reductions =============================================================

std::vector<Type> infer_matmul(const Ctx& c) {
  c.expect_operands(2);
  const TensorType& lhs = c.tensor(0);
  TensorType rhs = c.tensor(1);
  if (auto it = c.attrs.find("transpose_b"); it != c.attrs.end()) {
    int64_t v = c.attr<int64_t>("transpose_b");
    if (v != 0 && v != 1) c.fail("attribute 'transpose_b' must be 0 or 1, got {}", v);
    if (v == 1) {
      if (rhs.rank() < 2) c.fail<ShapeError>("transpose_b needs a rhs of rank >= 2 {}", c.operands());
      std::vector<Dim> dims = rhs.shape.dims();
      std::swap(dims[dims.size() - 1], dims[dims.size() - 2]);
      rhs.shape = Shape(std::move(dims));
    }
  }
  c.same_device({lhs.device, rhs.device});
  // The one mix: f32 activations times weights kept in f16/bf16 (converted in registers).
  const bool narrow_weights = lhs.dtype == DType::f32 && (rhs.dtype == DType::f16 || rhs.dtype == DType::bf16);
  if (!narrow_weights && lhs.dtype != rhs.dtype)
    c.fail<DTypeError>("operand dtypes {} and {} differ (the only mix allowed is lhs f32 with rhs f16 or bf16) {}",
                       dtype_name(lhs.dtype), dtype_name(rhs.dtype), c.operands());
  if (lhs.dtype == DType::boolean) c.fail<DTypeError>("bool operands are not supported {}", c.operands());
  if (lhs.rank() < 1 || rhs.rank() < 1)
    c.fail<ShapeError>("operands must have rank >= 1 {}", c.operands());

  // A rank-1 lhs is a row [1, K] and a rank-1 rhs a column [K, 1]; those 1s are dropped again.
  const auto& l = lhs.shape.dims();
  const auto& r = rhs.shape.dims();
  const Dim& lhs_k = l.back();
  size_t rhs_k_index = r.size() == 1 ? 0 : r.size() - 2;
  const Dim& rhs_k = r[rhs_k_index];
  if (!(lhs_k == rhs_k))
    c.fail<ShapeError>("lhs inner dim {} does not match rhs dim {} of {} (lhs {}, rhs {})",
                       lhs_k.to_string(), rhs_k_index, rhs_k.to_string(), lhs.to_string(),
                       rhs.to_string());

  Shape lhs_batch(std::vector<Dim>(l.begin(), l.end() - std::min<ptrdiff_t>(2, l.size())));
  Shape rhs_batch(std::vector<Dim>(r.begin(), r.end() - std::min<ptrdiff_t>(2, r.size())));
  std::vector<Dim> out = c.broadcast({lhs_batch, rhs_batch}, "batch dims").dims();
  if (l.size() >= 2) out.push_back(l[l.size() - 2]);
  if (r.size() >= 2) out.push_back(r.back());
  return {TensorType{lhs.dtype, Shape(std::move(out)), lhs.device}};
}

// ==== quantized weights ===========================================================================

QuantizationEncoding encoding_attr(const Ctx& c) {
  const std::string& name = c.attr<std::string>("encoding");
  try {
    return parse_encoding(name);
  } catch (const ValueError& e) {
    c.fail("{}", e.what());
  }
}

std::vector<Type> infer_qmatmul(const Ctx& c) {
  c.expect_operands(2);
  const QuantizationEncoding encoding = encoding_attr(c);
  const TensorType& lhs = c.tensor(0);
  const TensorType& rhs = c.tensor(1);
  c.same_device({lhs.device, rhs.device});
  if (lhs.dtype != DType::f32) c.fail<DTypeError>("lhs must be f32 {}", c.operands());
  if (rhs.dtype != DType::u8) c.fail<DTypeError>("rhs must be the u8 encoded weight {}", c.operands());
  if (lhs.rank() < 1 || rhs.rank() != 2)
    c.fail<ShapeError>("lhs must have rank >= 1 and rhs rank 2 ([N, row_bytes]) {}", c.operands());
  const auto k = lhs.shape[lhs.rank() - 1].try_static();
  if (!k) c.fail<ShapeError>("lhs inner dim must be static {}", c.operands());
  int64_t row_bytes = 0;
  try {
    row_bytes = quantized_row_bytes(encoding, *k, "lhs inner dim");
  } catch (const ValueError& e) {
    c.fail("{} {}", e.what(), c.operands());
  }
  if (rhs.shape[1].try_static() != std::optional<int64_t>(row_bytes))
    c.fail<ShapeError>("rhs rows must be {} bytes ({} {} weights), got {} {}", row_bytes, *k, encoding_name(encoding),
                       rhs.shape[1].to_string(), c.operands());
  std::vector<Dim> out = lhs.shape.dims();
  out.back() = rhs.shape[0];
  return {TensorType{DType::f32, Shape(std::move(out)), lhs.device}};
}

std::vector<Type> infer_dequantize(const Ctx& c) {
  c.expect_operands(1);
  const QuantizationEncoding encoding = encoding_attr(c);
  const TensorType& in = c.tensor(0);
  if (in.dtype != DType::u8) c.fail<DTypeError>("input must be u8 encoded rows {}", c.operands());
  if (in.rank() < 1) c.fail<ShapeError>("input must have rank >= 1 {}", c.operands());
  const auto row_bytes = in.shape[in.rank() - 1].try_static();
  if (!row_bytes) c.fail<ShapeError>("input's last dim (row bytes) must be static {}", c.operands());
  int64_t k = 0;
  try {
    k = quantized_row_elements(encoding, *row_bytes, "input");
  } catch (const ValueError& e) {
    c.fail("{} {}", e.what(), c.operands());
  }
  std::vector<Dim> out = in.shape.dims();
  out.back() = Dim(k);
  return {TensorType{DType::f32, Shape(std::move(out)), in.device}};
}

std::vector<Type> infer_reduction(const Ctx& c) {
  c.expect_operands(1);
  TensorType t = c.tensor(0);
  if (t.rank() < 1) c.fail<ShapeError>("input must have rank >= 1, got {}", t.to_string());
  int64_t axis = c.axis_attr("axis", t.rank());
  switch (c.op) {
    case Op::mean: case Op::softmax: case Op::log_softmax: c.require_float(0); break;
    default: c.require_numeric(0); break;
  }
  switch (c.op) {
    case Op::softmax:
    case Op::log_softmax:
      return {t};
    case Op::cumsum:
      for (const char* flag : {"exclusive", "reverse"}) {
        int64_t v = c.attr<int64_t>(flag);
        if (v != 0 && v != 1) c.fail("attribute '{}' must be 0 or 1, got {}", flag, v);
      }
      return {t};
    case Op::top_k: {
      int64_t k = c.attr<int64_t>("k");
      if (k < 1) c.fail("k must be >= 1, got {}", k);
      auto dim = t.shape[axis].try_static();
      if (dim && k > *dim)
        c.fail<ShapeError>("k {} exceeds dim {} of size {} (input {})", k, axis, *dim, t.to_string());
      t.shape[axis] = Dim(k);
      TensorType indices{DType::i64, t.shape, t.device};
      return {t, indices};
    }
    default: break;
  }
  t.shape[axis] = Dim(1);
  if (c.op == Op::argmax || c.op == Op::argmin) t.dtype = DType::i64;
  return {t};
}

// ==== normalization =============================================================================

std::vector<Type> infer_norm(const Ctx& c) {
  size_t n = c.op == Op::rms_norm ? 2 : 3;
  c.expect_operands(n);
  const TensorType& x = c.tensor(0);
  c.require_float(0);
  if (x.rank() < 1) c.fail<ShapeError>("x must have rank >= 1 {}", c.operands());
  c.attr<double>("epsilon");
  std::vector<DeviceRef> devices{x.device};
  for (size_t i = 1; i < n; ++i) {
    const TensorType& p = c.tensor(i);
    devices.push_back(p.device);
    c.same_dtype(x.dtype, p.dtype);
    if (p.rank() != 1 || !(p.shape[0] == x.shape.dims().back()))
      c.fail<ShapeError>("{} must be [{}] (x's last dim) {}", operand_role(c.op, i),
                         x.shape.dims().back().to_string(), c.operands());
  }
  c.same_device(devices);
  return {x};
}

// ==== shape and data movement ===================================================================

std::vector<Type> infer_reshape(const Ctx& c) {
  c.expect_operands(1);
  TensorType t = c.tensor(0);
  const Shape& target = c.attr<Shape>("shape");
  auto from_count = t.shape.static_num_elements();
  auto to_count = target.static_num_elements();
  bool equal = (from_count && to_count) ? *from_count == *to_count
                                        : t.shape.num_elements() == target.num_elements();
  if (!equal)
    c.fail<ShapeError>("cannot reshape {} to {}: element counts {} and {} differ", t.to_string(),
                       target.to_string(), t.shape.num_elements().to_string(),
                       target.num_elements().to_string());
  t.shape = target;
  return {t};
}

std::vector<Type> infer_transpose(const Ctx& c) {
  c.expect_operands(1);
  TensorType t = c.tensor(0);
  const auto& perm = c.attr<std::vector<int64_t>>("perm");
  std::vector<bool> seen(static_cast<size_t>(t.rank()), false);
  bool ok = static_cast<int64_t>(perm.size()) == t.rank();
  for (int64_t p : perm) {
    if (!ok) break;
    ok = p >= 0 && p < t.rank() && !seen[static_cast<size_t>(p)];
    if (ok) seen[static_cast<size_t>(p)] = true;
  }
  if (!ok)
    c.fail("perm [{}] is not a permutation of the axes of {}", fmt::join(perm, ", "), t.to_string());
  std::vector<Dim> dims;
  for (int64_t p : perm) dims.push_back(t.shape[p]);
  t.shape = Shape(std::move(dims));
  return {t};
}

std::vector<Type> infer_broadcast_to(const Ctx& c) {
  c.expect_operands(1);
  TensorType t = c.tensor(0);
  const Shape& target = c.attr<Shape>("shape");
  if (target.rank() < t.rank())
    c.fail<ShapeError>("cannot broadcast {} to {}: target rank is smaller", t.to_string(),
                       target.to_string());
  int64_t offset = target.rank() - t.rank();
  for (int64_t i = 0; i < t.rank(); ++i) {
    const Dim& d = t.shape[i];
    if (!is_static_one(d) && !(d == target[i + offset]))
      c.fail<ShapeError>("cannot broadcast {} to {}: dim {} ({}) vs target axis {} ({})",
                         t.to_string(), target.to_string(), i, d.to_string(), i + offset,
                         target[i + offset].to_string());
  }
  t.shape = target;
  return {t};
}

std::vector<Type> infer_concat(const Ctx& c) {
  c.expect_at_least(1);
  const TensorType& first = c.tensor(0);
  int64_t axis = c.axis_attr("axis", first.rank());
  Dim total = 0;
  std::vector<DeviceRef> devices;
  for (size_t i = 0; i < c.in.size(); ++i) {
    const TensorType& t = c.tensor(i);
    devices.push_back(t.device);
    c.same_dtype(first.dtype, t.dtype);
    if (t.rank() != first.rank())
      c.fail<ShapeError>("operand {} has rank {}, operand 0 has rank {} {}", i, t.rank(),
                         first.rank(), c.operands());
    for (int64_t a = 0; a < t.rank(); ++a)
      if (a != axis && !(t.shape[a] == first.shape[a]))
        c.fail<ShapeError>("operand {} differs from operand 0 at axis {} ({} vs {}) {}", i, a,
                           t.shape[a].to_string(), first.shape[a].to_string(), c.operands());
    total = total + t.shape[axis];
  }
  c.same_device(devices);
  TensorType out = first;
  out.shape[axis] = total;
  return {out};
}

std::vector<Type> infer_split(const Ctx& c) {
  c.expect_operands(1);
  const TensorType& t = c.tensor(0);
  int64_t axis = c.axis_attr("axis", t.rank());
  const Shape& sizes = c.attr<Shape>("sizes");
  if (sizes.rank() == 0) c.fail("sizes must not be empty");
  Dim total = 0;
  for (const Dim& s : sizes) total = total + s;
  auto a = total.try_static();
  auto b = t.shape[axis].try_static();
  bool equal = (a && b) ? *a == *b : total == t.shape[axis];
  if (!equal)
    c.fail<ShapeError>("sizes {} sum to {}, not to dim {} ({}) of {}", sizes.to_string(),
                       total.to_string(), axis, t.shape[axis].to_string(), t.to_string());
  std::vector<Type> out;
  for (const Dim& s : sizes) {
    TensorType piece = t;
    piece.shape[axis] = s;
    out.push_back(piece);
  }
  return out;
}

// The shape of shape[starts:stops:steps]; the attributes are full-rank and already clamped.
Shape slice_shape(const Ctx& c, const Shape& shape) {
  const Shape& starts = c.attr<Shape>("starts");
  const Shape& stops = c.attr<Shape>("stops");
  const auto& steps = c.attr<std::vector<int64_t>>("steps");
  if (starts.rank() != shape.rank() || stops.rank() != shape.rank() ||
      static_cast<int64_t>(steps.size()) != shape.rank())
    c.fail("starts, stops and steps must each have {} entries (the input's rank), got {}, {}, {}",
           shape.rank(), starts.rank(), stops.rank(), steps.size());
  std::vector<Dim> out;
  for (int64_t a = 0; a < shape.rank(); ++a) {
    int64_t step = steps[static_cast<size_t>(a)];
    if (step < 1) c.fail("step {} at axis {} must be >= 1", step, a);
    const Dim& start = starts[a];
    const Dim& stop = stops[a];
    auto s0 = start.try_static();
    auto s1 = stop.try_static();
    auto n = shape[a].try_static();
    if (s0 && s1) {
      if (*s0 > *s1 || (n && *s1 > *n))
        c.fail<ShapeError>("axis {}: bounds [{}, {}) out of range for dim {} {}", a, *s0, *s1,
                           shape[a].to_string(), c.operands());
      out.emplace_back((*s1 - *s0 + step - 1) / step);
    } else if (step == 1) {
      out.push_back(stop - start);
    } else {
      out.push_back((stop - start + Dim(step - 1)) / Dim(step));
    }
  }
  return Shape(std::move(out));
}

std::vector<Type> infer_slice(const Ctx& c) {
  c.expect_operands(1);
  TensorType t = c.tensor(0);
  t.shape = slice_shape(c, t.shape);
  return {t};
}

std::vector<Type> infer_gather(const Ctx& c) {
  c.expect_operands(2);
  const TensorType& input = c.tensor(0);
  const TensorType& indices = c.tensor(1);
  c.require_index(1);
  c.same_device({input.device, indices.device});
  int64_t axis = c.axis_attr("axis", input.rank());
  std::vector<Dim> dims(input.shape.begin(), input.shape.begin() + axis);
  dims.insert(dims.end(), indices.shape.begin(), indices.shape.end());
  dims.insert(dims.end(), input.shape.begin() + axis + 1, input.shape.end());
  return {TensorType{input.dtype, Shape(std::move(dims)), input.device}};
}

std::vector<Type> infer_scatter(const Ctx& c) {
  c.expect_operands(3);
  const TensorType& input = c.tensor(0);
  const TensorType& updates = c.tensor(1);
  const TensorType& indices = c.tensor(2);
  c.require_index(2);
  c.same_device({input.device, updates.device, indices.device});
  c.same_dtype(input.dtype, updates.dtype);
  int64_t axis = c.axis_attr("axis", input.rank());
  if (indices.rank() != 1) c.fail<ShapeError>("indices must have rank 1 {}", c.operands());
  Shape expected = input.shape;
  expected[axis] = indices.shape[0];
  if (!(updates.shape == expected))
    c.fail<ShapeError>("updates must have shape {} {}", expected.to_string(), c.operands());
  return {input};
}

// ==== buffers, devices, calls, extensions =======================================================

const BufferType& buffer_operand(const Ctx& c, size_t i) {
  if (const auto* b = std::get_if<BufferType>(&c.in.at(i))) return *b;
  c.fail("{} must be a buffer, got {}", operand_role(c.op, i), to_string(c.in[i]));
}

std::vector<Type> infer_buffer(const Ctx& c) {
  if (c.op == Op::buffer_load) {
    c.expect_operands(1);
    const BufferType& b = buffer_operand(c, 0);
    return {TensorType{b.dtype, slice_shape(c, b.shape), b.device}};
  }
  c.expect_operands(2);
  const BufferType& b = buffer_operand(c, 0);
  const TensorType& v = c.tensor(1);
  c.same_device({b.device, v.device});
  c.same_dtype(b.dtype, v.dtype);
  Shape expected = slice_shape(c, b.shape);
  if (!(v.shape == expected))
    c.fail<ShapeError>("value must have the slice's shape {} {}", expected.to_string(), c.operands());
  return {};
}

std::vector<Type> infer_call(const Ctx& c) {
  const std::string& callee = c.attr<std::string>("callee");
  if (!c.module) c.fail("no module to resolve callee '{}'", callee);
  const GraphIR* g = c.module->find(callee);
  if (!g) c.fail("no graph named '{}' in the module", callee);
  if (c.in.size() != g->inputs.size())
    c.fail("'{}' takes {} arguments, got {}", callee, g->inputs.size(), c.in.size());
  for (size_t i = 0; i < c.in.size(); ++i)
    if (!(c.in[i] == g->type(g->inputs[i])))
      c.fail("argument {} has type {}, but '{}' expects {}", i, to_string(c.in[i]), callee,
             to_string(g->type(g->inputs[i])));
  if (g->outputs.empty()) c.fail("'{}' has no outputs (call output() on it first)", callee);
  return g->output_types();
}

std::vector<Type> infer_custom(const Ctx& c) {
  const std::string& symbol = c.attr<std::string>("symbol");
  if (symbol.empty()) c.fail("a custom op needs a non-empty symbol");
  if (c.op == Op::custom) return c.attr<std::vector<Type>>("output_types");
  c.expect_at_least(1);
  if (!is_buffer(c.in[0]))
    c.fail("'{}': operand 0 must be a buffer, got {}", symbol, to_string(c.in[0]));
  return {};
}

// allreduce_sum / allgather: n inputs on n distinct devices, then n signal buffers on the same
// devices (none when n == 1).
std::vector<Type> infer_collective(const Ctx& c) {
  const int64_t processes = c.attr<int64_t>("processes");
  if (processes < 1) c.fail("processes must be >= 1, got {}", processes);
  size_t n = 0;
  while (n < c.in.size() && std::holds_alternative<TensorType>(c.in[n])) ++n;
  if (n == 0) c.fail("needs at least one tensor input {}", c.operands());
  const size_t buffers = c.in.size() - n;
  if (buffers != n && !(n == 1 && buffers == 0))
    c.fail("{} inputs need {} signal buffers (one per device), got {} operands after them {}", n, n,
           buffers, c.operands());
  if (n > static_cast<size_t>(MAX_SIGNAL_PEERS))
    c.fail("at most {} devices can take part, got {}", MAX_SIGNAL_PEERS, n);
  const TensorType& first = c.tensor(0);
  std::optional<int64_t> axis;
  if (c.op == Op::allgather) axis = c.axis_attr("axis", first.rank());
  Dim gathered = 0;
  for (size_t i = 0; i < n; ++i) {
    const TensorType& t = c.tensor(i);
    c.same_dtype(first.dtype, t.dtype);
    for (size_t j = 0; j < i; ++j)
      if (c.tensor(j).device == t.device)
        c.fail("inputs {} and {} are both on {}; each input must be on its own device", j, i,
               t.device.to_string());
    if (t.rank() != first.rank())
      c.fail<ShapeError>("input {} has rank {}, input 0 has rank {} {}", i, t.rank(), first.rank(),
                         c.operands());
    for (int64_t d = 0; d < t.rank(); ++d)
      if (d != axis && !(t.shape[d] == first.shape[d]))
        c.fail<ShapeError>("input {} dim {} is {}, input 0 has {} {}", i, d, t.shape[d].to_string(),
                           first.shape[d].to_string(), c.operands());
    if (axis) gathered = gathered + t.shape[*axis];
    if (buffers) {
      const auto* b = std::get_if<BufferType>(&c.in[n + i]);
      const BufferType expected{DType::u8, Shape{SIGNAL_BYTES}, t.device};
      if (!b || !(*b == expected))
        c.fail("signal buffer {} must be {} (on input {}'s device), got {}", i, expected.to_string(), i,
               to_string(c.in[n + i]));
    }
  }
  std::vector<Type> out;
  for (size_t i = 0; i < n; ++i) {
    TensorType t = first;
    t.device = c.tensor(i).device;
    if (axis) t.shape[*axis] = gathered * Dim(processes);
    out.push_back(t);
  }
  return out;
}

// ==== fused =====================================================================================

// Each instruction is checked as its op would be on scalars of the registers' dtypes; the result takes
// the broadcast shape of every input.
std::vector<Type> infer_fused_elementwise(const Ctx& c) {
  c.expect_at_least(1);
  const auto n = static_cast<int32_t>(c.in.size());
  ElementwiseProgram program;
  try {
    program = ElementwiseProgram::parse(c.attr<std::string>("program"), n);
  } catch (const ValueError& e) {
    c.fail("{}", e.what());
  }
  std::vector<DType> dtypes;
  std::vector<Shape> shapes;
  std::vector<DeviceRef> devices;
  for (size_t i = 0; i < c.in.size(); ++i) {
    const TensorType& t = c.tensor(i);
    dtypes.push_back(t.dtype);
    shapes.push_back(t.shape);
    devices.push_back(t.device);
  }
  c.same_device(devices);
  for (size_t k = 0; k < program.instructions.size(); ++k) {
    const ElementwiseInstruction& in = program.instructions[k];
    std::vector<Type> operands;
    for (int32_t r : in.operands) operands.push_back(TensorType{dtypes[static_cast<size_t>(r)], Shape{}, devices[0]});
    DType result;
    try {
      result = dtype_of(infer_types(in.op, operands, in.attrs(), nullptr).at(0));
    } catch (const DTypeError& e) {
      c.fail<DTypeError>("instruction %{}: {}", n + static_cast<int32_t>(k), e.what());
    } catch (const ValueError& e) {
      c.fail("instruction %{}: {}", n + static_cast<int32_t>(k), e.what());
    }
    if (result != in.dtype)
      c.fail<DTypeError>("instruction %{} declares {}, but {} gives {}", n + static_cast<int32_t>(k),
                         dtype_name(in.dtype), op_name(in.op), dtype_name(result));
    dtypes.push_back(result);
  }
  return {TensorType{dtypes.back(), c.broadcast(shapes), devices[0]}};
}

// The optional attributes of attention and paged_attention: softcap >= 0 and finite, window >= 0.
void check_softcap_window(const Ctx& c) {
  if (c.attrs.count("softcap")) {
    const double softcap = c.attr<double>("softcap");
    if (!(softcap >= 0) || !std::isfinite(softcap)) c.fail("softcap must be finite and >= 0, got {}", softcap);
  }
  if (c.attrs.count("window")) {
    const int64_t window = c.attr<int64_t>("window");
    if (window < 0) c.fail("window must be >= 0, got {}", window);
  }
}

// attention(q [seq, heads, hd], k [total, kv_heads, hd], v [total, kv_heads, hd], masked [seq, total]).
std::vector<Type> infer_attention(const Ctx& c) {
  c.expect_operands(4);
  const TensorType& q = c.tensor(0);
  const TensorType& k = c.tensor(1);
  const TensorType& v = c.tensor(2);
  const TensorType& masked = c.tensor(3);
  c.same_device({q.device, k.device, v.device, masked.device});
  c.require_float(0);
  c.same_dtype(q.dtype, k.dtype);
  c.same_dtype(q.dtype, v.dtype);
  if (masked.dtype != DType::boolean) c.fail<DTypeError>("masked must be bool {}", c.operands());
  if (q.rank() != 3 || k.rank() != 3 || v.rank() != 3 || masked.rank() != 2)
    c.fail<ShapeError>("expected q [seq, heads, head_dim], k and v [total, kv_heads, head_dim] and masked "
                       "[seq, total] {}",
                       c.operands());
  if (!(k.shape == v.shape)) c.fail<ShapeError>("k and v must have one shape {}", c.operands());
  if (!(q.shape[2] == k.shape[2]))
    c.fail<ShapeError>("q's head_dim {} differs from k's {} {}", q.shape[2].to_string(), k.shape[2].to_string(),
                       c.operands());
  if (!(masked.shape[0] == q.shape[0]) || !(masked.shape[1] == k.shape[0]))
    c.fail<ShapeError>("masked must be [{}, {}] (q's seq, k's total) {}", q.shape[0].to_string(),
                       k.shape[0].to_string(), c.operands());
  auto heads = q.shape[1].try_static();
  auto kv_heads = k.shape[1].try_static();
  if (!heads || !kv_heads || *kv_heads < 1 || *heads % *kv_heads != 0)
    c.fail<ShapeError>("q's heads must be a static multiple of k's kv_heads {}", c.operands());
  const double scale = c.attr<double>("scale");
  if (!std::isfinite(scale)) c.fail("scale must be finite, got {}", scale);
  check_softcap_window(c);
  return {q};
}

// rope(x [seq, heads, head_dim], cos [seq, head_dim], sin [seq, head_dim]), head_dim even and static.
std::vector<Type> infer_rope(const Ctx& c) {
  c.expect_operands(3);
  const TensorType& x = c.tensor(0);
  const TensorType& cos = c.tensor(1);
  const TensorType& sin = c.tensor(2);
  c.same_device({x.device, cos.device, sin.device});
  c.require_float(0);
  c.same_dtype(x.dtype, cos.dtype);
  c.same_dtype(x.dtype, sin.dtype);
  if (x.rank() != 3 || cos.rank() != 2 || !(sin.shape == cos.shape))
    c.fail<ShapeError>("expected x [seq, heads, head_dim] and cos, sin [seq, head_dim] {}", c.operands());
  if (!(cos.shape[0] == x.shape[0]) || !(cos.shape[1] == x.shape[2]))
    c.fail<ShapeError>("cos and sin must be [{}, {}] (x's seq and head_dim) {}", x.shape[0].to_string(),
                       x.shape[2].to_string(), c.operands());
  const auto head_dim = x.shape[2].try_static();
  if (!head_dim || *head_dim % 2 != 0) c.fail<ShapeError>("head_dim must be static and even {}", c.operands());
  return {x};
}

// grouped_matmul(lhs, rhs_0 .. rhs_{n-1}): each rhs checked as matmul (or qmatmul, with `encoding`)
// would check it, the error naming the rhs by index.
std::vector<Type> infer_grouped_matmul(const Ctx& c) {
  c.expect_at_least(3);
  const bool quantized = c.attrs.count("encoding") > 0;
  if (quantized && c.attrs.count("transpose_b"))
    c.fail("takes 'transpose_b' (as matmul) or 'encoding' (as qmatmul), not both");
  for (const auto& [key, value] : c.attrs)
    if (key != "encoding" && key != "transpose_b") c.fail("unknown attribute '{}'", key);
  const Op single = quantized ? Op::qmatmul : Op::matmul;
  std::vector<Type> out;
  for (size_t i = 1; i < c.in.size(); ++i) {
    const std::vector<Type> operands{c.in[0], c.in[i]};
    try {
      out.push_back(infer_types(single, operands, c.attrs, c.module).at(0));
    } catch (const ShapeError& e) {
      c.fail<ShapeError>("rhs {}: {}", i - 1, e.what());
    } catch (const DTypeError& e) {
      c.fail<DTypeError>("rhs {}: {}", i - 1, e.what());
    } catch (const ValueError& e) {
      c.fail("rhs {}: {}", i - 1, e.what());
    }
  }
  return out;
}

// ==== paged KV cache ============================================================================

// The cache operand i: a buffer [layers, num_blocks, block_size, kv_heads, head_dim] of f32, bf16 or
// f16, with `layer` (the attribute) one of its layers.
const BufferType& paged_cache(const Ctx& c, size_t i) {
  const BufferType& cache = buffer_operand(c, i);
  if (cache.shape.rank() != 5)
    c.fail<ShapeError>("{} must be [layers, num_blocks, block_size, kv_heads, head_dim] {}", operand_role(c.op, i),
                       c.operands());
  if (cache.dtype != DType::f32 && cache.dtype != DType::bf16 && cache.dtype != DType::f16)
    c.fail<DTypeError>("{} must be f32, bf16 or f16, got {}", operand_role(c.op, i), to_string(c.in[i]));
  const int64_t layer = c.attr<int64_t>("layer");
  const auto layers = cache.shape[0].try_static();
  if (layer < 0 || (layers && layer >= *layers))
    c.fail("layer {} is outside the {} layers of {} {}", layer, cache.shape[0].to_string(), operand_role(c.op, i),
           c.operands());
  return cache;
}

// Operand i: an i64 tensor of `rank`, whose `what` (in messages) is `shape`.
const TensorType& paged_index(const Ctx& c, size_t i, int64_t rank, const char* shape) {
  const TensorType& t = c.tensor(i);
  if (t.dtype != DType::i64) c.fail<DTypeError>("{} must be i64{}, got {}", operand_role(c.op, i), shape, to_string(t));
  if (t.rank() != rank) c.fail<ShapeError>("{} must be i64{} {}", operand_role(c.op, i), shape, c.operands());
  return t;
}

// paged_kv_store(cache [layers, blocks, block_size, kv_heads, hd], value [tokens, kv_heads, hd], slots [tokens]).
std::vector<Type> infer_paged_kv_store(const Ctx& c) {
  c.expect_operands(3);
  const BufferType& cache = paged_cache(c, 0);
  const TensorType& value = c.tensor(1);
  const TensorType& slots = paged_index(c, 2, 1, "[tokens]");
  c.same_device({cache.device, value.device, slots.device});
  if (value.dtype != DType::f32 && value.dtype != cache.dtype)
    c.fail<DTypeError>("value must be f32 or the cache's {} {}", dtype_name(cache.dtype), c.operands());
  if (value.rank() != 3 || !(value.shape[1] == cache.shape[3]) || !(value.shape[2] == cache.shape[4]))
    c.fail<ShapeError>("value must be [tokens, {}, {}] (the cache's kv_heads and head_dim) {}",
                       cache.shape[3].to_string(), cache.shape[4].to_string(), c.operands());
  if (!(slots.shape[0] == value.shape[0]))
    c.fail<ShapeError>("slots must have one entry per token of value ({}) {}", value.shape[0].to_string(),
                       c.operands());
  return {};
}

// paged_attention(q [tokens, heads, hd], k_cache, v_cache [layers, blocks, block_size, kv_heads, hd],
// block_tables [seqs, max_blocks], seq_ids [tokens], positions [tokens]).
std::vector<Type> infer_paged_attention(const Ctx& c) {
  c.expect_operands(6);
  const TensorType& q = c.tensor(0);
  const BufferType& k = paged_cache(c, 1);
  const BufferType& v = paged_cache(c, 2);
  const TensorType& tables = paged_index(c, 3, 2, "[seqs, max_blocks_per_seq]");
  const TensorType& seq_ids = paged_index(c, 4, 1, "[tokens]");
  const TensorType& positions = paged_index(c, 5, 1, "[tokens]");
  c.same_device({q.device, k.device, v.device, tables.device, seq_ids.device, positions.device});
  c.require_float(0);
  if (!(k == v)) c.fail<ShapeError>("k_cache and v_cache must have one type {}", c.operands());
  if (q.rank() != 3) c.fail<ShapeError>("q must be [tokens, heads, head_dim] {}", c.operands());
  if (!(q.shape[2] == k.shape[4]))
    c.fail<ShapeError>("q's head_dim {} differs from the cache's {} {}", q.shape[2].to_string(),
                       k.shape[4].to_string(), c.operands());
  auto heads = q.shape[1].try_static();
  auto kv_heads = k.shape[3].try_static();
  if (!heads || !kv_heads || *kv_heads < 1 || *heads % *kv_heads != 0)
    c.fail<ShapeError>("q's heads must be a static multiple of the cache's kv_heads {}", c.operands());
  if (!(seq_ids.shape[0] == q.shape[0]) || !(positions.shape[0] == q.shape[0]))
    c.fail<ShapeError>("seq_ids and positions must have one entry per token of q ({}) {}", q.shape[0].to_string(),
                       c.operands());
  const double scale = c.attr<double>("scale");
  if (!std::isfinite(scale)) c.fail("scale must be finite, got {}", scale);
  check_softcap_window(c);
  return {q};
}

}  // namespace

std::vector<Type> infer_types(Op op, const std::vector<Type>& inputs, const Attrs& attrs,
                              const Module* module) {
  Ctx c{op, inputs, attrs, module};
  if (is_elementwise_unary(op)) return infer_unary(c);
  if (is_elementwise_binary(op)) return infer_binary(c);
  switch (op) {
    case Op::constant: case Op::weight: case Op::range: return infer_source(c);
    case Op::where: return infer_where(c);
    case Op::cast: return infer_cast(c);
    case Op::matmul: return infer_matmul(c);
    case Op::sum: case Op::mean: case Op::max: case Op::min: case Op::argmax: case Op::argmin:
    case Op::cumsum: case Op::top_k: case Op::softmax: case Op::log_softmax:
      return infer_reduction(c);
    case Op::rms_norm: case Op::layer_norm: return infer_norm(c);
    case Op::reshape: return infer_reshape(c);
    case Op::transpose: return infer_transpose(c);
    case Op::broadcast_to: return infer_broadcast_to(c);
    case Op::concat: return infer_concat(c);
    case Op::split: return infer_split(c);
    case Op::slice: return infer_slice(c);
    case Op::gather: return infer_gather(c);
    case Op::scatter: return infer_scatter(c);
    case Op::buffer_load: case Op::buffer_store: return infer_buffer(c);
    case Op::transfer_to: {
      c.expect_operands(1);
      TensorType t = c.tensor(0);
      t.device = c.attr<DeviceRef>("device");
      return {t};
    }
    case Op::call: return infer_call(c);
    case Op::custom: case Op::inplace_custom: return infer_custom(c);
    case Op::allreduce_sum: case Op::allgather: return infer_collective(c);
    case Op::fused_elementwise: return infer_fused_elementwise(c);
    case Op::attention: return infer_attention(c);
    case Op::rope: return infer_rope(c);
    case Op::qmatmul: return infer_qmatmul(c);
    case Op::grouped_matmul: return infer_grouped_matmul(c);
    case Op::dequantize: return infer_dequantize(c);
    case Op::paged_kv_store: return infer_paged_kv_store(c);
    case Op::paged_attention: return infer_paged_attention(c);
    default: break;
  }
  throw ValueError(fmt::format("infer_types: unknown op {}", static_cast<int>(op)));
}

}  // namespace kiln::graph
