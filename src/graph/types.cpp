#include "kiln/graph/types.h"

#include "kiln/errors.h"

namespace kiln::graph {

namespace {

std::string tensor_text(DType dtype, const Shape& shape, DeviceRef device) {
  std::string out = std::string(dtype_name(dtype)) + shape.to_string();
  if (device != DeviceRef::CPU()) out.append("@").append(device.to_string());
  return out;
}

[[noreturn]] void fail(std::string_view text, const std::string& what) {
  // Cut short: the text may be outside input of any length.
  const std::string shown = text.size() <= 120 ? std::string(text)
                                               : std::string(text.substr(0, 120)) + "... (" +
                                                     std::to_string(text.size()) + " bytes)";
  throw ParseError("parse_type: " + what + " in '" + shown + "'");
}

// "f32[batch, 64]" or "f32[2]@gpu:0".
TensorType parse_tensor_text(std::string_view whole, std::string_view text) {
  const size_t open = text.find('[');
  if (open == std::string_view::npos) fail(whole, "expected '[' after the dtype");
  TensorType t;
  try {
    t.dtype = parse_dtype(text.substr(0, open));
  } catch (const ValueError&) {
    fail(whole, "unknown dtype '" + std::string(text.substr(0, open)) + "'");
  }

  // Split the dims at top-level commas; a dim may hold parenthesised sub-expressions.
  std::vector<Dim> dims;
  size_t pos = open + 1, start = pos;
  int depth = 0;
  bool closed = false;
  for (; pos < text.size(); ++pos) {
    const char c = text[pos];
    if (c == '(') {
      ++depth;
    } else if (c == ')') {
      --depth;
    } else if (depth == 0 && (c == ',' || c == ']')) {
      std::string_view piece = text.substr(start, pos - start);
      const bool blank = piece.find_first_not_of(" \t") == std::string_view::npos;
      if (!(c == ']' && dims.empty() && blank)) {  // "[]" is rank 0
        if (blank) fail(whole, "empty dim");
        if (static_cast<int64_t>(dims.size()) == kMaxRank)
          fail(whole, "more than " + std::to_string(kMaxRank) + " dims");
        dims.push_back(Dim::parse(piece));
      }
      start = pos + 1;
      if (c == ']') {
        closed = true;
        break;
      }
    }
  }
  if (!closed) fail(whole, "expected ']'");
  // The static dims' bytes must fit int64, so sizes computed from the type later cannot overflow.
  int64_t bytes = static_cast<int64_t>(dtype_size(t.dtype));
  for (const Dim& d : dims)
    if (auto v = d.try_static(); v && __builtin_mul_overflow(bytes, *v, &bytes))
      fail(whole, "the static dims' byte size overflows int64");
  t.shape = Shape(std::move(dims));

  std::string_view rest = text.substr(pos + 1);
  if (!rest.empty()) {
    if (rest[0] != '@') fail(whole, "unexpected '" + std::string(rest) + "' after the shape");
    try {
      t.device = DeviceRef::parse(rest.substr(1));
    } catch (const ValueError&) {
      fail(whole, "bad device '" + std::string(rest.substr(1)) + "' (expected cpu:N or gpu:N)");
    }
  }
  return t;
}

}  // namespace

std::string TensorType::to_string() const { return tensor_text(dtype, shape, device); }

std::string BufferType::to_string() const { return "buffer<" + tensor_text(dtype, shape, device) + ">"; }

std::string to_string(const Type& t) {
  return std::visit([](const auto& v) { return v.to_string(); }, t);
}

Type parse_type(std::string_view text) {
  std::string_view body = text;
  while (!body.empty() && body.front() == ' ') body.remove_prefix(1);
  while (!body.empty() && body.back() == ' ') body.remove_suffix(1);
  constexpr std::string_view kBuffer = "buffer<";
  if (body.substr(0, kBuffer.size()) == kBuffer) {
    if (body.back() != '>') fail(text, "expected '>' closing 'buffer<'");
    TensorType t = parse_tensor_text(text, body.substr(kBuffer.size(), body.size() - kBuffer.size() - 1));
    return BufferType{t.dtype, std::move(t.shape), t.device};
  }
  return parse_tensor_text(text, body);
}

DType dtype_of(const Type& t) {
  return std::visit([](const auto& v) { return v.dtype; }, t);
}

const Shape& shape_of(const Type& t) {
  return std::visit([](const auto& v) -> const Shape& { return v.shape; }, t);
}

DeviceRef device_of(const Type& t) {
  return std::visit([](const auto& v) { return v.device; }, t);
}

}  // namespace kiln::graph
