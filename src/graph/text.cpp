// The text form of graphs. Printing renumbers values densely in definition order, so the text of a
// graph depends only on its structure. Attribute values have one syntax per kind, so the parser
// rebuilds exactly the variant alternative that was printed:
//
//   int64            3, -2
//   double           1.0, 1e-06, 0.1, inf, -inf, nan   (always a '.', an exponent, inf or nan)
//   string           "text" with \" \\ \n \t \r and \xHH escapes
//   vector<int64>    array<1, 0, 2>
//   Shape            [batch, seq + 1, 4]
//   DType            f32
//   DeviceRef        cpu:0
//   Bytes            0x0000803f   (lowercase hex, element bytes in storage order)
//   vector<Type>     types<f32[2], buffer<f32[3]>>
//
// Names of graphs and attributes are bare when made of [A-Za-z0-9_.-], quoted otherwise.
#include "kiln/graph/text.h"

#include <charconv>
#include <cmath>
#include <optional>
#include <unordered_map>

#include <fmt/format.h>

#include "kiln/errors.h"

namespace kiln::graph {

namespace {

// ============================== printing ==============================

bool is_name_char(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' ||
         c == '.' || c == '-';
}

bool is_bare_name(std::string_view s) {
  if (s.empty()) return false;
  for (char c : s)
    if (!is_name_char(c)) return false;
  return true;
}

std::string quote(std::string_view s) {
  std::string out = "\"";
  for (char c : s) {
    auto u = static_cast<unsigned char>(c);
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\t': out += "\\t"; break;
      case '\r': out += "\\r"; break;
      default:
        if (u < 0x20 || u >= 0x7f)
          out += fmt::format("\\x{:02x}", u);
        else
          out += c;
    }
  }
  out += '"';
  return out;
}

std::string format_name(std::string_view s) { return is_bare_name(s) ? std::string(s) : quote(s); }

// Shortest text that reads back to the same double, marked as a double even when integral.
std::string format_double(double d) {
  if (std::isnan(d)) return "nan";  // the sign and payload of a NaN are not kept
  if (std::isinf(d)) return d < 0 ? "-inf" : "inf";
  std::string s = fmt::format("{}", d);
  if (s.find_first_of(".eE") == std::string::npos) s += ".0";
  return s;
}

std::string format_attr(const Attr& attr) {
  struct Visitor {
    std::string operator()(int64_t v) const { return std::to_string(v); }
    std::string operator()(double v) const { return format_double(v); }
    std::string operator()(const std::string& v) const { return quote(v); }
    std::string operator()(const std::vector<int64_t>& v) const {
      return fmt::format("array<{}>", fmt::join(v, ", "));
    }
    std::string operator()(const Shape& v) const { return v.to_string(); }
    std::string operator()(DType v) const { return std::string(dtype_name(v)); }
    std::string operator()(DeviceRef v) const { return v.to_string(); }
    std::string operator()(const Bytes& v) const {
      std::string s = "0x";
      s.reserve(2 + 2 * v.size());
      static constexpr char kHex[] = "0123456789abcdef";
      for (uint8_t b : v) {
        s += kHex[b >> 4];
        s += kHex[b & 15];
      }
      return s;
    }
    std::string operator()(const std::vector<Type>& v) const {
      std::string s = "types<";
      for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + to_string(v[i]);
      return s + ">";
    }
  };
  return std::visit(Visitor{}, attr);
}

class GraphPrinter {
 public:
  explicit GraphPrinter(const GraphIR& g) : g_(g) {}

  std::string print() {
    std::string out = "graph @" + format_name(g_.name) + "(";
    for (size_t i = 0; i < g_.inputs.size(); ++i) {
      ValueId v = g_.inputs[i];
      define(v);
      out += fmt::format("{}{}: {}", i ? ", " : "", name(v), type_text(v));
    }
    out += ") -> (";
    for (size_t i = 0; i < g_.outputs.size(); ++i)
      out += (i ? ", " : "") + type_text(g_.outputs[i]);
    out += ") {\n";
    for (const Node& n : g_.nodes) out += "  " + node_text(n) + "\n";
    out += "  return";
    for (size_t i = 0; i < g_.outputs.size(); ++i) out += (i ? ", " : " ") + name(g_.outputs[i]);
    out += "\n}\n";
    return out;
  }

 private:
  void define(ValueId v) { numbers_.emplace(v, static_cast<int64_t>(numbers_.size())); }

  // A value used before (or without) its definition prints as %?<id>, which does not parse: print
  // stays total so a broken graph can still be shown in an error message.
  std::string name(ValueId v) const {
    auto it = numbers_.find(v);
    return it == numbers_.end() ? fmt::format("%?{}", v) : fmt::format("%{}", it->second);
  }

  std::string type_text(ValueId v) const {
    if (v < 0 || static_cast<size_t>(v) >= g_.value_types.size()) return "<no type>";
    return to_string(g_.value_types[static_cast<size_t>(v)]);
  }

  std::string node_text(const Node& n) {
    std::string operands;
    for (size_t i = 0; i < n.inputs.size(); ++i) operands += (i ? ", " : "") + name(n.inputs[i]);
    for (ValueId v : n.outputs) define(v);
    std::string out;
    for (size_t i = 0; i < n.outputs.size(); ++i) out += (i ? ", " : "") + name(n.outputs[i]);
    if (!n.outputs.empty()) out += " = ";
    out += fmt::format("{}({})", op_name(n.op), operands);
    if (!n.attrs.empty()) {
      out += " {";
      bool first = true;
      for (const auto& [key, value] : n.attrs) {
        out += fmt::format("{}{} = {}", first ? "" : ", ", format_name(key), format_attr(value));
        first = false;
      }
      out += "}";
    }
    for (size_t i = 0; i < n.outputs.size(); ++i)
      out += (i ? ", " : " : ") + type_text(n.outputs[i]);
    return out;
  }

  const GraphIR& g_;
  std::unordered_map<ValueId, int64_t> numbers_;
};

// ============================== parsing ==============================

struct Pos {
  size_t offset = 0;
  int line = 1;
  int column = 1;
};

[[noreturn]] void fail(Pos p, const std::string& message) {
  throw ParseError(fmt::format("{}:{}: {}", p.line, p.column, message));
}

// Input text quoted in an error, cut short so one bad token of any length gives a one-line message.
std::string excerpt(std::string_view text) {
  constexpr size_t kMax = 80;
  return text.size() <= kMax ? std::string(text)
                             : fmt::format("{}... ({} bytes)", text.substr(0, kMax), text.size());
}

// A call parses its callee's body first (resolve_callee), so a chain of calls recurses: bounded.
constexpr int kMaxCallDepth = 64;

// A cursor over the text with line/column tracking. Whitespace (newlines included) separates tokens
// and is otherwise insignificant.
class Cursor {
 public:
  Cursor(std::string_view text, Pos pos = {}) : text_(text), pos_(pos) {}

  Pos pos() const { return pos_; }
  bool at_end() const { return pos_.offset >= text_.size(); }
  char peek(size_t ahead = 0) const {
    size_t i = pos_.offset + ahead;
    return i < text_.size() ? text_[i] : '\0';
  }
  void advance(size_t n = 1) {
    for (size_t i = 0; i < n && !at_end(); ++i) {
      if (text_[pos_.offset] == '\n') {
        ++pos_.line;
        pos_.column = 1;
      } else {
        ++pos_.column;
      }
      ++pos_.offset;
    }
  }
  void skip_ws() {
    while (!at_end() && (peek() == ' ' || peek() == '\t' || peek() == '\n' || peek() == '\r'))
      advance();
  }
  std::string_view slice(size_t from, size_t to) const { return text_.substr(from, to - from); }

  // What is at the cursor, for "found ..." in error messages.
  std::string found() const {
    if (at_end()) return "end of text";
    size_t end = pos_.offset;
    while (end < text_.size() && is_name_char(text_[end]) && end - pos_.offset < 24) ++end;
    if (end == pos_.offset) return fmt::format("'{}'", text_[pos_.offset]);
    return fmt::format("'{}'", text_.substr(pos_.offset, end - pos_.offset));
  }

  [[noreturn]] void expected(const std::string& what) const {
    fail(pos_, fmt::format("expected {}, found {}", what, found()));
  }

  // Skips whitespace, then consumes `c` or fails naming what was expected.
  void expect(char c, const std::string& context) {
    skip_ws();
    if (peek() != c) expected(fmt::format("'{}' {}", c, context));
    advance();
  }
  bool accept(char c) {
    skip_ws();
    if (peek() != c) return false;
    advance();
    return true;
  }
  bool accept_word(std::string_view word) {
    skip_ws();
    if (text_.substr(pos_.offset, word.size()) != word) return false;
    char after = pos_.offset + word.size() < text_.size() ? text_[pos_.offset + word.size()] : '\0';
    if (is_name_char(after)) return false;
    advance(word.size());
    return true;
  }

  // [A-Za-z0-9_.-]+ ; empty if none.
  std::string_view name_chars() {
    skip_ws();
    size_t start = pos_.offset;
    while (!at_end() && is_name_char(peek())) advance();
    return slice(start, pos_.offset);
  }

  // A bare or quoted name (graph names, attribute names).
  std::string name(const std::string& what) {
    skip_ws();
    if (peek() == '"') return quoted_string();
    std::string_view s = name_chars();
    if (s.empty()) expected(what);
    return std::string(s);
  }

  std::string quoted_string() {
    skip_ws();
    Pos start = pos_;
    if (peek() != '"') expected("a quoted string");
    advance();
    std::string out;
    while (true) {
      if (at_end() || peek() == '\n') fail(start, "unterminated string");
      char c = peek();
      advance();
      if (c == '"') break;
      if (c != '\\') {
        out += c;
        continue;
      }
      Pos escape = pos_;
      char e = peek();
      advance();
      switch (e) {
        case '"': out += '"'; break;
        case '\\': out += '\\'; break;
        case 'n': out += '\n'; break;
        case 't': out += '\t'; break;
        case 'r': out += '\r'; break;
        case 'x': {
          int value = 0;
          for (int i = 0; i < 2; ++i) {
            int digit = hex_digit(peek());
            if (digit < 0) fail(pos_, "expected two hex digits after \\x");
            value = value * 16 + digit;
            advance();
          }
          out += static_cast<char>(value);
          break;
        }
        default: fail(escape, fmt::format("unknown escape '\\{}' in string", e));
      }
    }
    return out;
  }

  static int hex_digit(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  }

  // Consumes up to and including the `close` that balances an already consumed `open`, skipping
  // nested pairs and quoted strings. Returns the offset of that `close`.
  size_t skip_balanced(char open, char close, Pos opened, const std::string& what) {
    int depth = 1;
    while (!at_end()) {
      char c = peek();
      if (c == '"') {
        quoted_string();
        continue;
      }
      if (c == open) ++depth;
      if (c == close && --depth == 0) {
        size_t at = pos_.offset;
        advance();
        return at;
      }
      advance();
    }
    fail(opened, fmt::format("'{}' of {} is never closed", open, what));
  }

 private:
  std::string_view text_;
  Pos pos_;
};

// A type's text runs: name, then optionally <...>, then optionally [...], then optionally @kind:id.
// The substring goes to parse_type, so types have exactly one syntax (types.cpp's).
Type parse_type_at(Cursor& c) {
  c.skip_ws();
  Pos start = c.pos();
  if (c.name_chars().empty()) c.expected("a type");
  if (c.peek() == '<') {
    Pos open = c.pos();
    c.advance();
    c.skip_balanced('<', '>', open, "a type");
  }
  if (c.peek() == '[') {
    Pos open = c.pos();
    c.advance();
    c.skip_balanced('[', ']', open, "a shape");
  }
  if (c.peek() == '@') {
    c.advance();
    while (is_name_char(c.peek()) || c.peek() == ':') c.advance();
  }
  std::string_view text = c.slice(start.offset, c.pos().offset);
  try {
    return parse_type(text);
  } catch (const std::exception& e) {
    fail(start, fmt::format("bad type '{}': {}", excerpt(text), e.what()));
  }
}

// "[d0, d1, ...]": each dim through Dim::parse.
Shape parse_shape_at(Cursor& c) {
  c.expect('[', "to open a shape");
  std::vector<Dim> dims;
  if (c.accept(']')) return Shape(std::move(dims));
  while (true) {
    c.skip_ws();
    Pos start = c.pos();
    int depth = 0;
    while (!c.at_end()) {
      char ch = c.peek();
      if (ch == '(') ++depth;
      if (ch == ')') --depth;
      if (depth == 0 && (ch == ',' || ch == ']')) break;
      if (ch == '\n' || ch == '{' || ch == '}') break;
      c.advance();
    }
    std::string_view text = c.slice(start.offset, c.pos().offset);
    while (!text.empty() && (text.back() == ' ' || text.back() == '\t')) text.remove_suffix(1);
    if (text.empty()) c.expected("a dim");
    if (static_cast<int64_t>(dims.size()) == kMaxRank)
      fail(start, fmt::format("a shape of more than {} dims", kMaxRank));
    try {
      dims.push_back(Dim::parse(text));
    } catch (const std::exception& e) {
      fail(start, fmt::format("bad dim '{}': {}", excerpt(text), e.what()));
    }
    if (c.accept(']')) break;
    c.expect(',', "or ']' in a shape");
  }
  return Shape(std::move(dims));
}

// A number: int64 unless it has a '.', an exponent, or is inf/nan. "0x..." is Bytes.
Attr parse_number_at(Cursor& c) {
  c.skip_ws();
  Pos start = c.pos();
  if (c.peek() == '0' && c.peek(1) == 'x') {
    c.advance(2);
    Bytes bytes;
    while (Cursor::hex_digit(c.peek()) >= 0) {
      int hi = Cursor::hex_digit(c.peek());
      c.advance();
      int lo = Cursor::hex_digit(c.peek());
      if (lo < 0) c.expected("a second hex digit (bytes are written as pairs of hex digits)");
      c.advance();
      bytes.push_back(static_cast<uint8_t>(hi * 16 + lo));
    }
    return bytes;
  }
  if (c.peek() == '-' || c.peek() == '+') c.advance();
  while (true) {
    char ch = c.peek();
    bool exponent_sign = (ch == '-' || ch == '+') && (c.pos().offset > start.offset) &&
                         (c.slice(c.pos().offset - 1, c.pos().offset) == "e" ||
                          c.slice(c.pos().offset - 1, c.pos().offset) == "E");
    if (!(is_name_char(ch) && ch != '-') && !exponent_sign) break;
    c.advance();
  }
  std::string_view text = c.slice(start.offset, c.pos().offset);
  std::string_view digits = text.front() == '+' ? text.substr(1) : text;
  bool is_double = text.find_first_of(".eEin") != std::string_view::npos;
  const char* end = digits.data() + digits.size();
  if (is_double) {
    double v = 0;
    auto r = std::from_chars(digits.data(), end, v);
    if (r.ec == std::errc() && r.ptr == end) return v;
    if (r.ec == std::errc::result_out_of_range)
      fail(start, fmt::format("number '{}' is out of range", excerpt(text)));
  } else {
    int64_t v = 0;
    auto r = std::from_chars(digits.data(), end, v);
    if (r.ec == std::errc() && r.ptr == end) return v;
    if (r.ec == std::errc::result_out_of_range)
      fail(start, fmt::format("integer '{}' does not fit in int64", excerpt(text)));
  }
  fail(start, fmt::format("expected a number, found '{}'", excerpt(text)));
}

Attr parse_attr_value(Cursor& c) {
  c.skip_ws();
  char ch = c.peek();
  if (ch == '"') return c.quoted_string();
  if (ch == '[') return parse_shape_at(c);
  if ((ch >= '0' && ch <= '9') || ch == '-' || ch == '+' || ch == '.') return parse_number_at(c);
  Pos start = c.pos();
  Cursor lookahead = c;
  std::string_view word = lookahead.name_chars();
  if (word.empty()) c.expected("an attribute value");
  if (word == "inf" || word == "nan") return parse_number_at(c);
  if (word == "array" && lookahead.peek() == '<') {
    c = lookahead;
    c.advance();
    std::vector<int64_t> values;
    if (c.accept('>')) return values;
    while (true) {
      c.skip_ws();
      Pos at = c.pos();
      Attr v = parse_number_at(c);
      if (!std::holds_alternative<int64_t>(v)) fail(at, "expected an integer in array<...>");
      values.push_back(std::get<int64_t>(v));
      if (c.accept('>')) return values;
      c.expect(',', "or '>' in array<...>");
    }
  }
  if (word == "types" && lookahead.peek() == '<') {
    c = lookahead;
    c.advance();
    std::vector<Type> types;
    if (c.accept('>')) return types;
    while (true) {
      types.push_back(parse_type_at(c));
      if (c.accept('>')) return types;
      c.expect(',', "or '>' in types<...>");
    }
  }
  if (lookahead.peek() == ':') {  // a device: kind:id
    lookahead.advance();
    while (lookahead.peek() >= '0' && lookahead.peek() <= '9') lookahead.advance();
    std::string_view text = c.slice(start.offset, lookahead.pos().offset);
    try {
      DeviceRef d = DeviceRef::parse(text);
      c = lookahead;
      return d;
    } catch (const std::exception& e) {
      fail(start, fmt::format("bad device '{}': {}", excerpt(text), e.what()));
    }
  }
  try {
    DType d = parse_dtype(word);
    c = lookahead;
    return d;
  } catch (const std::exception&) {
    fail(start, fmt::format("expected an attribute value (number, string, [shape], array<...>, "
                            "types<...>, dtype or device), found '{}'",
                            excerpt(word)));
  }
}

Attrs parse_attrs(Cursor& c) {
  Attrs attrs;
  if (!c.accept('{')) return attrs;
  if (c.accept('}')) return attrs;
  while (true) {
    c.skip_ws();
    Pos at = c.pos();
    std::string key = c.name("an attribute name");
    c.expect('=', fmt::format("after attribute name '{}'", key));
    Attr value = parse_attr_value(c);
    if (!attrs.emplace(key, std::move(value)).second)
      fail(at, fmt::format("attribute '{}' given twice", key));
    if (c.accept('}')) return attrs;
    c.expect(',', "or '}' between attributes");
  }
}

// One graph's header, read before any body so `call` can refer to a graph defined later.
struct GraphHeader {
  std::string name;
  Pos at;
  std::vector<std::pair<std::string, Pos>> input_names;
  std::vector<Type> output_types;
  Pos body;
  GraphIR* ir = nullptr;
  enum class State { pending, in_progress, done } state = State::pending;
};

class ModuleParser {
 public:
  explicit ModuleParser(std::string_view text) : text_(text) {}

  Module parse() {
    Cursor c(text_);
    while (true) {
      c.skip_ws();
      if (c.at_end()) break;
      headers_.push_back(parse_header(c));
    }
    for (size_t i = 0; i < headers_.size(); ++i) by_name_.emplace(headers_[i].name, i);
    for (GraphHeader& h : headers_) parse_body(h);
    return std::move(module_);
  }

 private:
  GraphHeader parse_header(Cursor& c) {
    GraphHeader h;
    c.skip_ws();
    h.at = c.pos();
    if (!c.accept_word("graph")) c.expected("'graph'");
    c.expect('@', "before the graph name");
    h.name = c.name("a graph name");
    c.expect('(', fmt::format("to open the inputs of graph @{}", h.name));
    std::vector<Type> input_types;
    if (!c.accept(')')) {
      while (true) {
        c.skip_ws();
        Pos at = c.pos();
        h.input_names.emplace_back(value_name(c), at);
        c.expect(':', "after an input name");
        input_types.push_back(parse_type_at(c));
        if (c.accept(')')) break;
        c.expect(',', "or ')' between inputs");
      }
    }
    c.skip_ws();
    if (c.peek() != '-' || c.peek(1) != '>') c.expected("'->' before the output types");
    c.advance(2);
    c.expect('(', "to open the output types");
    if (!c.accept(')')) {
      while (true) {
        h.output_types.push_back(parse_type_at(c));
        if (c.accept(')')) break;
        c.expect(',', "or ')' between output types");
      }
    }
    c.skip_ws();
    Pos open = c.pos();
    c.expect('{', fmt::format("to open the body of graph @{}", h.name));
    h.body = c.pos();
    c.skip_balanced('{', '}', open, fmt::format("graph @{}", h.name));
    try {
      h.ir = &module_.add_graph(h.name, input_types);
    } catch (const ValueError& e) {
      fail(h.at, e.what());
    }
    // Set explicitly so the parser does not depend on how add_graph numbers inputs.
    h.ir->value_types = input_types;
    h.ir->inputs.clear();
    for (size_t i = 0; i < input_types.size(); ++i) h.ir->inputs.push_back(static_cast<ValueId>(i));
    return h;
  }

  static std::string value_name(Cursor& c) {
    c.skip_ws();
    if (c.peek() != '%') c.expected("a value name like %3");
    c.advance();
    std::string_view s = c.name_chars();
    if (s.empty()) c.expected("a value name after '%'");
    return std::string("%").append(s);  // not "%" + string: GCC 12 -O3 warns (-Wrestrict, bug 105651)
  }

  void parse_body(GraphHeader& h) {
    if (h.state == GraphHeader::State::done) return;
    h.state = GraphHeader::State::in_progress;
    GraphIR& g = *h.ir;
    std::unordered_map<std::string, ValueId> values;
    for (size_t i = 0; i < h.input_names.size(); ++i)
      if (!values.emplace(h.input_names[i].first, static_cast<ValueId>(i)).second)
        fail(h.input_names[i].second, fmt::format("value {} defined twice", h.input_names[i].first));

    Cursor c(text_, h.body);
    while (true) {
      c.skip_ws();
      Pos at = c.pos();
      if (c.accept_word("return")) {
        std::vector<std::pair<ValueId, Pos>> results;
        c.skip_ws();
        if (c.peek() == '%') {
          while (true) {
            c.skip_ws();
            Pos vat = c.pos();
            results.emplace_back(use(c, values), vat);
            if (!c.accept(',')) break;
          }
        }
        c.expect('}', fmt::format("to close graph @{} after return", h.name));
        if (results.size() != h.output_types.size())
          fail(at, fmt::format("graph @{} returns {} value(s), its header declares {}", h.name,
                               results.size(), h.output_types.size()));
        for (size_t i = 0; i < results.size(); ++i) {
          const Type& t = g.type(results[i].first);
          if (!(t == h.output_types[i]))
            fail(results[i].second,
                 fmt::format("output {} of graph @{} is {}, its header declares {}", i, h.name,
                             to_string(t), to_string(h.output_types[i])));
          g.outputs.push_back(results[i].first);
        }
        break;
      }
      if (c.peek() == '}') c.expected(fmt::format("'return' before the end of graph @{}", h.name));
      parse_node(c, h, values);
    }
    h.state = GraphHeader::State::done;
  }

  static ValueId use(Cursor& c, const std::unordered_map<std::string, ValueId>& values) {
    c.skip_ws();
    Pos at = c.pos();
    std::string name = value_name(c);
    auto it = values.find(name);
    if (it == values.end()) fail(at, fmt::format("undefined value {}", name));
    return it->second;
  }

  void parse_node(Cursor& c, GraphHeader& h, std::unordered_map<std::string, ValueId>& values) {
    GraphIR& g = *h.ir;
    c.skip_ws();
    Pos at = c.pos();
    std::vector<std::pair<std::string, Pos>> result_names;
    if (c.peek() == '%') {
      while (true) {
        c.skip_ws();
        Pos vat = c.pos();
        result_names.emplace_back(value_name(c), vat);
        if (!c.accept(',')) break;
      }
      c.expect('=', "after the result names");
      c.skip_ws();
      at = c.pos();
    }
    std::string_view op_text = c.name_chars();
    if (op_text.empty()) c.expected("an op name, a result like %3 or 'return'");
    Op op;
    try {
      op = parse_op(op_text);
    } catch (const ParseError&) {
      fail(at, fmt::format("unknown op '{}'", excerpt(op_text)));
    }
    Node node{op, {}, {}, {}};
    c.expect('(', fmt::format("to open the operands of {}", op_text));
    if (!c.accept(')')) {
      while (true) {
        node.inputs.push_back(use(c, values));
        if (c.accept(')')) break;
        c.expect(',', fmt::format("or ')' between the operands of {}", op_text));
      }
    }
    node.attrs = parse_attrs(c);

    std::vector<std::pair<Type, Pos>> printed;
    if (!result_names.empty()) {
      c.expect(':', fmt::format("and the result types of {}", op_text));
      while (true) {
        c.skip_ws();
        Pos tat = c.pos();
        printed.emplace_back(parse_type_at(c), tat);
        if (printed.size() == result_names.size()) break;
        c.expect(',', fmt::format("and {} result type(s) for {}", result_names.size(), op_text));
      }
    }

    if (op == Op::call) resolve_callee(node, at);
    std::vector<Type> operand_types;
    for (ValueId v : node.inputs) operand_types.push_back(g.type(v));
    std::vector<Type> inferred;
    try {
      inferred = infer_types(op, operand_types, node.attrs, &module_);
    } catch (const std::exception& e) {
      fail(at, e.what());
    }
    if (inferred.size() != result_names.size())
      fail(at, fmt::format("{} has {} result(s), the text names {}", op_text, inferred.size(),
                           result_names.size()));
    for (size_t i = 0; i < inferred.size(); ++i) {
      if (!(inferred[i] == printed[i].first))
        fail(printed[i].second,
             fmt::format("result {} of {} is written as {}, but {} infers {}", result_names[i].first,
                         op_text, to_string(printed[i].first), op_text, to_string(inferred[i])));
      auto id = static_cast<ValueId>(g.value_types.size());
      if (!values.emplace(result_names[i].first, id).second)
        fail(result_names[i].second, fmt::format("value {} defined twice", result_names[i].first));
      g.value_types.push_back(inferred[i]);
      node.outputs.push_back(id);
    }
    if (op == Op::weight) add_weight(g, node.attrs, at);
    g.nodes.push_back(std::move(node));
  }

  // A callee's body must be parsed before the call's types can be inferred from it.
  void resolve_callee(const Node& node, Pos at) {
    auto it = node.attrs.find("callee");
    if (it == node.attrs.end() || !std::holds_alternative<std::string>(it->second)) return;
    const auto& callee = std::get<std::string>(it->second);
    auto h = by_name_.find(callee);
    if (h == by_name_.end()) fail(at, fmt::format("call to undefined graph @{}", callee));
    GraphHeader& target = headers_[h->second];
    if (target.state == GraphHeader::State::in_progress)
      fail(at, fmt::format("recursive call to graph @{}", callee));
    if (target.state == GraphHeader::State::done) return;
    if (call_depth_ == kMaxCallDepth)
      fail(at, fmt::format("call to graph @{} nests calls more than {} deep", callee, kMaxCallDepth));
    ++call_depth_;
    parse_body(target);
    --call_depth_;
  }

  static void add_weight(GraphIR& g, const Attrs& attrs, Pos at) {
    Weight w{get_attr<std::string>(attrs, "name", Op::weight), get_attr<DType>(attrs, "dtype", Op::weight),
             get_attr<Shape>(attrs, "shape", Op::weight), get_attr<DeviceRef>(attrs, "device", Op::weight)};
    if (const Weight* existing = g.find_weight(w.name)) {
      if (!(*existing == w))
        fail(at, fmt::format("weight '{}' is used as {} and as {}", w.name,
                             to_string(Type(existing->type())), to_string(Type(w.type()))));
      return;
    }
    g.weights.push_back(std::move(w));
  }

  std::string_view text_;
  Module module_;
  std::vector<GraphHeader> headers_;
  std::unordered_map<std::string, size_t> by_name_;
  int call_depth_ = 0;  // bodies being parsed for calls, below the one at the top
};

}  // namespace

std::string print(const GraphIR& graph) { return GraphPrinter(graph).print(); }

std::string print(const Module& module) {
  std::string out;
  for (const auto& g : module.graphs()) {
    if (!out.empty()) out += "\n";
    out += print(*g);
  }
  return out;
}

Module parse_module(std::string_view text) { return ModuleParser(text).parse(); }

}  // namespace kiln::graph
