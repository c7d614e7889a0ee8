// kiln's Jinja2 interpreter (jinja.h): lexer -> parser -> AST -> tree-walking renderer. The semantics
// follow jinja2 3.1 in an ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
// extensions=[loopcontrols]) with transformers' globals, and values behave like the Python objects
// they stand for (printing, truthiness, int/float arithmetic), because chat templates are tested
// byte for byte against that renderer (tests/pipelines/test_chat_template.cpp).
#include "pipelines/jinja.h"

#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <ctime>
#include <deque>
#include <functional>
#include <nlohmann/json.hpp>
#include <optional>
#include <unordered_map>
#include <utility>
#include <variant>
#include <vector>

#include "kiln/errors.h"

namespace kiln::pipelines::jinja {

// ================================================================================================
// Values: the Python objects a template sees. Lists and dicts are shared (reference semantics, as in
// Python: a namespace assigned to two names is one object).
// ================================================================================================

class Renderer;
struct Value;
struct ListObj;
struct DictObj;
struct FuncObj;
using ListPtr = std::shared_ptr<ListObj>;
using DictPtr = std::shared_ptr<DictObj>;
using FuncPtr = std::shared_ptr<const FuncObj>;

struct Undefined {
  std::string hint;  // the error a misuse reports: "'foo' is undefined"
};
struct None {};

struct Value {
  std::variant<Undefined, None, bool, int64_t, double, std::string, ListPtr, DictPtr, FuncPtr> v;

  Value() : v(Undefined{}) {}
  Value(Undefined u) : v(std::move(u)) {}
  Value(None) : v(None{}) {}
  Value(bool b) : v(b) {}
  Value(int i) : v(int64_t{i}) {}
  Value(int64_t i) : v(i) {}
  Value(double d) : v(d) {}
  Value(std::string s) : v(std::move(s)) {}
  Value(std::string_view s) : v(std::string(s)) {}
  Value(const char* s) : v(std::string(s)) {}
  Value(ListPtr l) : v(std::move(l)) {}
  Value(DictPtr d) : v(std::move(d)) {}
  Value(FuncPtr f) : v(std::move(f)) {}

  bool undefined() const { return std::holds_alternative<Undefined>(v); }
  bool none() const { return std::holds_alternative<None>(v); }
  bool is_bool() const { return std::holds_alternative<bool>(v); }
  bool is_int() const { return std::holds_alternative<int64_t>(v); }
  bool is_float() const { return std::holds_alternative<double>(v); }
  bool is_str() const { return std::holds_alternative<std::string>(v); }
  bool is_list() const { return std::holds_alternative<ListPtr>(v); }
  bool is_dict() const { return std::holds_alternative<DictPtr>(v); }
  bool is_func() const { return std::holds_alternative<FuncPtr>(v); }
  const std::string& str() const { return std::get<std::string>(v); }
  const ListPtr& list() const { return std::get<ListPtr>(v); }
  const DictPtr& dict() const { return std::get<DictPtr>(v); }
  const FuncPtr& func() const { return std::get<FuncPtr>(v); }
  const std::string& hint() const { return std::get<Undefined>(v).hint; }
};

enum class Seq { List, Tuple, Generator };  // a generator is what jinja's map/select/... return
enum class Obj { Dict, Namespace, Loop };

struct ListObj {
  std::vector<Value> items;
  Seq kind = Seq::List;
  ListObj() = default;
  ListObj(std::vector<Value> i, Seq k) : items(std::move(i)), kind(k) {}
  ~ListObj();
};

struct DictObj {
  std::vector<std::pair<std::string, Value>> items;  // insertion order, as Python's dict
  Obj kind = Obj::Dict;

  const Value* find(const std::string& key) const {
    if (index_.empty()) {
      for (const auto& [k, v] : items)
        if (k == key) return &v;
      return nullptr;
    }
    auto it = index_.find(key);
    return it == index_.end() ? nullptr : &items[it->second].second;
  }
  void set(const std::string& key, Value value) {
    if (const Value* old = find(key)) {
      *const_cast<Value*>(old) = std::move(value);
      return;
    }
    items.emplace_back(key, std::move(value));
    // Small dicts (messages, tool calls) are searched in place; big ones get an index.
    if (items.size() == kIndexFrom) {
      for (size_t i = 0; i < items.size(); ++i) index_.emplace(items[i].first, i);
    } else if (items.size() > kIndexFrom) {
      index_.emplace(key, items.size() - 1);
    }
  }
  ~DictObj();

 private:
  // Above the 12 entries of a loop object, which every iteration of a for loop builds anew: an index
  // for it cost 13 allocations per iteration, 2-3x the loop's own time.
  static constexpr size_t kIndexFrom = 16;
  std::unordered_map<std::string, size_t> index_;
};

struct Args {
  std::vector<Value> pos;
  std::vector<std::pair<std::string, Value>> kw;
};

struct FuncObj {
  std::string name;
  std::function<Value(Renderer&, Args&)> call;
};

// Nested lists die one level at a time through this queue, never by recursion, so a value nested
// as deep as the loop limit allows cannot overflow the stack when it is freed.
namespace {
thread_local std::vector<Value>* graveyard = nullptr;

void bury(Value&& v) {
  if (!v.is_list() && !v.is_dict()) return;
  if (graveyard) {
    graveyard->push_back(std::move(v));
    return;
  }
  std::vector<Value> grave;
  graveyard = &grave;
  grave.push_back(std::move(v));
  while (!grave.empty()) {
    Value last = std::move(grave.back());
    grave.pop_back();
  }  // `last` dies here; its children are pushed onto `grave`
  graveyard = nullptr;
}
}  // namespace

ListObj::~ListObj() {
  for (Value& v : items) bury(std::move(v));
}
DictObj::~DictObj() {
  for (auto& kv : items) bury(std::move(kv.second));
}

namespace {

// A fault not yet placed in the source; Renderer::eval adds the line and column of its expression.
struct Fault {
  std::string message;
};
[[noreturn]] void fault(std::string message) { throw Fault{std::move(message)}; }

// A fault with its place.
struct Located {
  int line, col;
  std::string message;
};

ListPtr make_list(std::vector<Value> items = {}, Seq kind = Seq::List) {
  return std::make_shared<ListObj>(std::move(items), kind);
}
DictPtr make_dict(Obj kind = Obj::Dict) {
  auto d = std::make_shared<DictObj>();
  d->kind = kind;
  return d;
}
Value tuple2(Value a, Value b) {
  std::vector<Value> items;
  items.push_back(std::move(a));
  items.push_back(std::move(b));
  return make_list(std::move(items), Seq::Tuple);
}

// Python's type names, for error messages as Python words them.
std::string type_name(const Value& v) {
  if (v.undefined()) return "Undefined";
  if (v.none()) return "NoneType";
  if (v.is_bool()) return "bool";
  if (v.is_int()) return "int";
  if (v.is_float()) return "float";
  if (v.is_str()) return "str";
  if (v.is_list()) {
    switch (v.list()->kind) {
      case Seq::List:
        return "list";
      case Seq::Tuple:
        return "tuple";
      case Seq::Generator:
        return "generator";
    }
  }
  if (v.is_dict()) {
    switch (v.dict()->kind) {
      case Obj::Dict:
        return "dict";
      case Obj::Namespace:
        return "Namespace";
      case Obj::Loop:
        return "LoopContext";
    }
  }
  return "function";
}

bool is_seq(const Value& v, Seq kind) { return v.is_list() && v.list()->kind == kind; }
bool is_plain_dict(const Value& v) { return v.is_dict() && v.dict()->kind == Obj::Dict; }

// ================================================================================================
// UTF-8. Python strings are sequences of code points: len, indexing, slicing and iteration count
// code points. Bytes that are not valid UTF-8 (a template file may hold them) survive a round trip
// as the code points 0xDC80..0xDCFF, like Python's surrogateescape.
// ================================================================================================

std::vector<char32_t> decode(std::string_view s) {
  std::vector<char32_t> out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size();) {
    const auto b = static_cast<unsigned char>(s[i]);
    int len = b < 0x80 ? 1 : (b >> 5) == 6 ? 2 : (b >> 4) == 14 ? 3 : (b >> 3) == 30 ? 4 : 0;
    char32_t cp = len == 1 ? b : len == 2 ? (b & 0x1F) : len == 3 ? (b & 0x0F) : (b & 0x07);
    bool ok = len > 0 && i + len <= s.size();
    for (int k = 1; ok && k < len; ++k) {
      const auto c = static_cast<unsigned char>(s[i + k]);
      if ((c >> 6) != 2) ok = false;
      cp = (cp << 6) | (c & 0x3F);
    }
    if (ok && len > 1 &&
        (cp < (len == 2   ? 0x80u
               : len == 3 ? 0x800u
                          : 0x10000u) ||
         cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)))
      ok = false;
    if (!ok) {
      out.push_back(0xDC00 + b);
      i += 1;
    } else {
      out.push_back(cp);
      i += len;
    }
  }
  return out;
}

void encode(char32_t cp, std::string& out) {
  if (cp >= 0xDC80 && cp <= 0xDCFF) {
    out.push_back(static_cast<char>(cp - 0xDC00));
  } else if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

std::string encode(const std::vector<char32_t>& cps, size_t from = 0, size_t to = std::string::npos) {
  std::string out;
  to = std::min(to, cps.size());
  for (size_t i = from; i < to; ++i) encode(cps[i], out);
  return out;
}

int64_t cp_count(std::string_view s) {
  int64_t n = 0;
  for (char c : s) n += (static_cast<unsigned char>(c) >> 6) != 2;
  return n;
}

// str.isspace()
bool py_isspace(char32_t c) {
  return (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x20) || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F ||
         c == 0x3000;
}
// The line boundaries of str.splitlines() (after \r\n).
bool py_linebreak(char32_t c) {
  return c == '\n' || c == '\r' || c == 0x0B || c == 0x0C || c == 0x1C || c == 0x1D || c == 0x1E ||
         c == 0x85 || c == 0x2028 || c == 0x2029;
}
bool ascii_alpha(char32_t c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'); }
bool ascii_digit(char32_t c) { return c >= '0' && c <= '9'; }
char32_t to_upper(char32_t c) { return c >= 'a' && c <= 'z' ? c - 32 : c; }
char32_t to_lower(char32_t c) { return c >= 'A' && c <= 'Z' ? c + 32 : c; }

std::string upper(std::string s) {
  for (char& c : s)
    if (c >= 'a' && c <= 'z') c = static_cast<char>(c - 32);
  return s;
}
std::string lower(std::string s) {
  for (char& c : s)
    if (c >= 'A' && c <= 'Z') c = static_cast<char>(c + 32);
  return s;
}

std::vector<std::string> splitlines(std::string_view s) {
  std::vector<std::string> lines;
  auto cps = decode(s);
  size_t start = 0;
  for (size_t i = 0; i < cps.size(); ++i) {
    if (!py_linebreak(cps[i])) continue;
    lines.push_back(encode(cps, start, i));
    if (cps[i] == '\r' && i + 1 < cps.size() && cps[i + 1] == '\n') ++i;
    start = i + 1;
  }
  if (start < cps.size()) lines.push_back(encode(cps, start));
  return lines;
}

// str.strip / lstrip / rstrip: whitespace, or the code points of `chars`.
std::string py_strip(std::string_view s, const std::optional<std::string>& chars, bool left, bool right) {
  auto cps = decode(s);
  std::vector<char32_t> set;
  if (chars) set = decode(*chars);
  auto strip_it = [&](char32_t c) {
    return chars ? std::find(set.begin(), set.end(), c) != set.end() : py_isspace(c);
  };
  size_t a = 0, b = cps.size();
  if (left)
    while (a < b && strip_it(cps[a])) ++a;
  if (right)
    while (b > a && strip_it(cps[b - 1])) --b;
  return encode(cps, a, b);
}

// ================================================================================================
// Printing as Python prints: str() for {{ }} and |string, repr() inside containers, json.dumps.
// ================================================================================================

// repr(float): the shortest digits that round-trip, fixed notation for exponents -4..15.
std::string py_float(double x) {
  if (std::isnan(x)) return "nan";
  if (std::isinf(x)) return x > 0 ? "inf" : "-inf";
  char buf[64];
  auto res = std::to_chars(buf, buf + sizeof buf, x, std::chars_format::scientific);
  std::string sci(buf, res.ptr);
  std::string sign;
  if (sci[0] == '-') sign = "-", sci.erase(0, 1);
  const size_t e = sci.find('e');
  std::string digits = sci.substr(0, e);
  digits.erase(std::remove(digits.begin(), digits.end(), '.'), digits.end());
  const int exp = std::stoi(sci.substr(e + 1));
  const int decpt = exp + 1;  // x = 0.DIGITS * 10^decpt
  const int n = static_cast<int>(digits.size());
  std::string out = sign;
  if (decpt > -4 && decpt <= 16) {
    if (decpt <= 0) {
      out += "0." + std::string(-decpt, '0') + digits;
    } else if (decpt >= n) {
      out += digits + std::string(decpt - n, '0') + ".0";
    } else {
      out += digits.substr(0, decpt) + "." + digits.substr(decpt);
    }
  } else {
    out += digits.substr(0, 1);
    if (n > 1) out += "." + digits.substr(1);
    out += fmt::format("e{}{:02d}", exp < 0 ? '-' : '+', std::abs(exp));
  }
  return out;
}

// str.isprintable(), without Unicode's tables: the separators and format characters a chat
// template's text is likely to hold are known; other code points print as themselves.
bool py_printable(char32_t c) {
  if (c < 0x20 || c == 0x7F || (c >= 0x80 && c <= 0xA0) || c == 0xAD) return false;
  if (c == 0x1680 || (c >= 0x2000 && c <= 0x200F) || (c >= 0x2028 && c <= 0x202F) ||
      (c >= 0x205F && c <= 0x2064) || c == 0x3000 || c == 0xFEFF || c == 0x061C || c == 0x180E)
    return false;
  if ((c >= 0xD800 && c <= 0xDFFF) || (c >= 0xE000 && c <= 0xF8FF) || c == 0xFFFE || c == 0xFFFF)
    return false;
  return true;
}

void py_repr_str(std::string_view s, std::string& out) {
  const bool has_single = s.find('\'') != std::string_view::npos;
  const bool has_double = s.find('"') != std::string_view::npos;
  const char quote = has_single && !has_double ? '"' : '\'';
  out.push_back(quote);
  for (char32_t c : decode(s)) {
    if (c == static_cast<char32_t>(quote) || c == '\\') {
      out.push_back('\\');
      out.push_back(static_cast<char>(c));
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\r') {
      out += "\\r";
    } else if (c == '\t') {
      out += "\\t";
    } else if (c >= 0xDC80 && c <= 0xDCFF) {
      out += fmt::format("\\udc{:02x}", static_cast<unsigned>(c - 0xDC00));
    } else if (py_printable(c)) {
      encode(c, out);
    } else if (c < 0x100) {
      out += fmt::format("\\x{:02x}", static_cast<unsigned>(c));
    } else if (c < 0x10000) {
      out += fmt::format("\\u{:04x}", static_cast<unsigned>(c));
    } else {
      out += fmt::format("\\U{:08x}", static_cast<unsigned>(c));
    }
  }
  out.push_back(quote);
}

void check_depth(int depth, int limit) {
  if (depth > limit) fault(fmt::format("value nested deeper than {} levels", limit));
}

void py_repr(const Value& v, std::string& out, int depth, int limit);

void py_str(const Value& v, std::string& out, int depth, int limit) {
  if (v.undefined()) return;
  if (v.is_str()) {
    out += v.str();
    return;
  }
  py_repr(v, out, depth, limit);
}

void py_repr(const Value& v, std::string& out, int depth, int limit) {
  check_depth(depth, limit);
  if (v.undefined()) {
    out += "Undefined";
  } else if (v.none()) {
    out += "None";
  } else if (v.is_bool()) {
    out += std::get<bool>(v.v) ? "True" : "False";
  } else if (v.is_int()) {
    out += std::to_string(std::get<int64_t>(v.v));
  } else if (v.is_float()) {
    out += py_float(std::get<double>(v.v));
  } else if (v.is_str()) {
    py_repr_str(v.str(), out);
  } else if (v.is_list()) {
    const ListObj& l = *v.list();
    if (l.kind == Seq::Generator) {
      out += "<generator object>";
      return;
    }
    out += l.kind == Seq::Tuple ? "(" : "[";
    for (size_t i = 0; i < l.items.size(); ++i) {
      if (i) out += ", ";
      py_repr(l.items[i], out, depth + 1, limit);
    }
    if (l.kind == Seq::Tuple && l.items.size() == 1) out += ",";
    out += l.kind == Seq::Tuple ? ")" : "]";
  } else if (v.is_dict()) {
    const DictObj& d = *v.dict();
    if (d.kind == Obj::Loop) {
      out += "<LoopContext>";
      return;
    }
    if (d.kind == Obj::Namespace) out += "<Namespace ";
    out += "{";
    for (size_t i = 0; i < d.items.size(); ++i) {
      if (i) out += ", ";
      py_repr_str(d.items[i].first, out);
      out += ": ";
      py_repr(d.items[i].second, out, depth + 1, limit);
    }
    out += "}";
    if (d.kind == Obj::Namespace) out += ">";
  } else {
    out += fmt::format("<function {}>", v.func()->name);
  }
}

// json.dumps(x, ensure_ascii=..., indent=..., separators=..., sort_keys=...), as transformers'
// tojson filter calls it.
struct JsonStyle {
  std::optional<std::string> indent;
  std::string item_sep = ", ", key_sep = ": ";
  bool ensure_ascii = false;
  bool sort_keys = false;
  int limit = 256;
};

void json_string(std::string_view s, const JsonStyle& style, std::string& out) {
  out.push_back('"');
  for (char32_t c : decode(s)) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      case '\b':
        out += "\\b";
        break;
      case '\f':
        out += "\\f";
        break;
      default:
        if (c < 0x20 || (style.ensure_ascii && c >= 0x7F)) {
          if (c >= 0x10000) {
            const char32_t u = c - 0x10000;
            out += fmt::format("\\u{:04x}\\u{:04x}", static_cast<unsigned>(0xD800 + (u >> 10)),
                               static_cast<unsigned>(0xDC00 + (u & 0x3FF)));
          } else {
            out += fmt::format("\\u{:04x}", static_cast<unsigned>(c));
          }
        } else {
          encode(c, out);
        }
    }
  }
  out.push_back('"');
}

void json_dump(const Value& v, const JsonStyle& style, std::string& out, int level) {
  check_depth(level, style.limit);
  auto newline = [&](int lvl) {
    if (!style.indent) return;
    out.push_back('\n');
    for (int i = 0; i < lvl; ++i) out += *style.indent;
  };
  if (v.none()) {
    out += "null";
  } else if (v.is_bool()) {
    out += std::get<bool>(v.v) ? "true" : "false";
  } else if (v.is_int()) {
    out += std::to_string(std::get<int64_t>(v.v));
  } else if (v.is_float()) {
    const double d = std::get<double>(v.v);
    out += std::isnan(d) ? "NaN" : std::isinf(d) ? (d > 0 ? "Infinity" : "-Infinity") : py_float(d);
  } else if (v.is_str()) {
    json_string(v.str(), style, out);
  } else if (v.is_list() && v.list()->kind != Seq::Generator) {
    const auto& items = v.list()->items;
    if (items.empty()) {
      out += "[]";
      return;
    }
    out.push_back('[');
    for (size_t i = 0; i < items.size(); ++i) {
      if (i) out += style.item_sep;
      newline(level + 1);
      json_dump(items[i], style, out, level + 1);
    }
    newline(level);
    out.push_back(']');
  } else if (is_plain_dict(v)) {
    std::vector<const std::pair<std::string, Value>*> items;
    for (const auto& kv : v.dict()->items) items.push_back(&kv);
    if (style.sort_keys)
      std::stable_sort(items.begin(), items.end(), [](auto* a, auto* b) { return a->first < b->first; });
    if (items.empty()) {
      out += "{}";
      return;
    }
    out.push_back('{');
    for (size_t i = 0; i < items.size(); ++i) {
      if (i) out += style.item_sep;
      newline(level + 1);
      json_string(items[i]->first, style, out);
      out += style.key_sep;
      json_dump(items[i]->second, style, out, level + 1);
    }
    newline(level);
    out.push_back('}');
  } else {
    fault(fmt::format("tojson: Object of type {} is not JSON serializable", type_name(v)));
  }
}

Value from_json(const nlohmann::ordered_json& j, int depth, int limit) {
  check_depth(depth, limit);
  switch (j.type()) {
    case nlohmann::ordered_json::value_t::null:
      return None{};
    case nlohmann::ordered_json::value_t::boolean:
      return j.get<bool>();
    case nlohmann::ordered_json::value_t::number_integer:
      return j.get<int64_t>();
    case nlohmann::ordered_json::value_t::number_unsigned: {
      const auto u = j.get<uint64_t>();
      if (u > static_cast<uint64_t>(INT64_MAX)) return static_cast<double>(u);
      return static_cast<int64_t>(u);
    }
    case nlohmann::ordered_json::value_t::number_float:
      return j.get<double>();
    case nlohmann::ordered_json::value_t::string:
      return j.get<std::string>();
    case nlohmann::ordered_json::value_t::array: {
      auto l = make_list();
      l->items.reserve(j.size());
      for (const auto& item : j) l->items.push_back(from_json(item, depth + 1, limit));
      return l;
    }
    case nlohmann::ordered_json::value_t::object: {
      auto d = make_dict();
      for (auto it = j.begin(); it != j.end(); ++it)
        d->set(it.key(), from_json(it.value(), depth + 1, limit));
      return d;
    }
    default:
      fault("context: binary JSON values are not supported");
  }
}

}  // namespace

// ================================================================================================
// Lexer: text, and the tokens inside {{ }} and {% %}; comments are dropped. Whitespace control as
// jinja's lexer does it with trim_blocks and lstrip_blocks on: "-" strips all whitespace on its
// side, "+" keeps it, a block tag eats the newline after it and the indentation before it.
// ================================================================================================

namespace {

enum class Tok { Data, VarBegin, VarEnd, BlockBegin, BlockEnd, Name, String, Int, Float, Op, Eof };

struct Token {
  Tok type;
  std::string text;  // data, name, string value, operator
  int64_t ival = 0;
  double fval = 0;
  int line = 1, col = 1;
};

std::string describe(const Token& t) {
  switch (t.type) {
    case Tok::Data:
      return "template text";
    case Tok::VarBegin:
      return "'{{'";
    case Tok::VarEnd:
      return "end of print statement '}}'";
    case Tok::BlockBegin:
      return "'{%'";
    case Tok::BlockEnd:
      return "end of statement block '%}'";
    case Tok::Name:
      return fmt::format("'{}'", t.text);
    case Tok::String:
      return "string literal";
    case Tok::Int:
    case Tok::Float:
      return "number";
    case Tok::Op:
      return fmt::format("'{}'", t.text);
    case Tok::Eof:
      return "end of template";
  }
  return "token";
}

// Newlines as jinja reads a template: str.splitlines() then "\n".join, so every line break becomes
// "\n" and one trailing line break is dropped (keep_trailing_newline=False).
std::string normalize_newlines(std::string_view source) {
  auto lines = splitlines(source);
  std::string out;
  for (size_t i = 0; i < lines.size(); ++i) {
    if (i) out.push_back('\n');
    out += lines[i];
  }
  return out;
}

bool is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f'; }

class Lexer {
 public:
  Lexer(std::string_view src, const std::string& origin) : src_(src), origin_(origin) {
    line_starts_.push_back(0);
    for (size_t i = 0; i < src_.size(); ++i)
      if (src_[i] == '\n') line_starts_.push_back(i + 1);
  }

  std::vector<Token> run() {
    size_t pos = 0;
    bool line_starting = true;  // the text so far ends a line: lstrip_blocks may strip the next one
    while (true) {
      const size_t at = find_tag(pos);
      std::string text(src_.substr(pos, at == std::string_view::npos ? std::string_view::npos : at - pos));
      if (at == std::string_view::npos) {
        emit_data(std::move(text), pos);
        break;
      }
      const char kind = src_[at + 1];
      size_t p = at + 2;
      char sign = 0;
      if (p < src_.size() && (src_[p] == '-' || src_[p] == '+')) sign = src_[p++];
      strip_before(text, sign, kind != '{', line_starting);
      emit_data(std::move(text), pos);
      if (kind == '#') {
        pos = end_of_comment(at, p, line_starting);
        continue;
      }
      const size_t first = tokens_.size();
      push(kind == '{' ? Tok::VarBegin : Tok::BlockBegin, "", at);
      pos = lex_tag(kind, p, line_starting);
      if (kind == '%' && tokens_.size() == first + 3 && tokens_[first + 1].type == Tok::Name &&
          tokens_[first + 1].text == "raw") {
        tokens_.resize(first);
        pos = lex_raw(at, pos, line_starting);
      }
    }
    push(Tok::Eof, "", src_.size());
    return std::move(tokens_);
  }

 private:
  [[noreturn]] void fail(size_t at, const std::string& what) const {
    auto [line, col] = place(at);
    throw ValueError(fmt::format("{}:{}:{}: {}", origin_, line, col, what));
  }
  std::pair<int, int> place(size_t at) const {
    const auto it = std::upper_bound(line_starts_.begin(), line_starts_.end(), at) - 1;
    const size_t start = *it;
    return {static_cast<int>(it - line_starts_.begin()) + 1,
            static_cast<int>(cp_count(src_.substr(start, at - start))) + 1};
  }
  void push(Tok type, std::string text, size_t at) {
    Token t{type, std::move(text)};
    std::tie(t.line, t.col) = place(at);
    tokens_.push_back(std::move(t));
  }
  void emit_data(std::string text, size_t at) {
    if (!text.empty()) push(Tok::Data, std::move(text), at);
  }
  size_t find_tag(size_t pos) const {
    for (size_t i = src_.find('{', pos); i != std::string_view::npos; i = src_.find('{', i + 1))
      if (i + 1 < src_.size() && (src_[i + 1] == '{' || src_[i + 1] == '%' || src_[i + 1] == '#')) return i;
    return std::string_view::npos;
  }
  // The text before a tag: "-" strips its trailing whitespace; lstrip_blocks strips the indentation
  // of a block or comment tag that starts its line.
  static void strip_before(std::string& text, char sign, bool block_or_comment, bool line_starting) {
    if (sign == '-') {
      text = py_strip(text, std::nullopt, false, true);
    } else if (sign != '+' && block_or_comment) {
      const size_t nl = text.rfind('\n');
      const size_t l_pos = nl == std::string::npos ? 0 : nl + 1;
      if ((l_pos > 0 || line_starting) && l_pos < text.size() &&
          std::all_of(text.begin() + static_cast<std::ptrdiff_t>(l_pos), text.end(),
                      [](char c) { return c == ' ' || c == '\t' || c == '\v' || c == '\f' || c == '\r'; }))
        text.resize(l_pos);
    }
  }
  // After "%}" or "#}": one newline is eaten (trim_blocks); after "-%}" all whitespace.
  size_t after_block_end(size_t p, char sign, bool& line_starting) const {
    if (sign == '-') {
      while (p < src_.size() && is_space(src_[p])) ++p;
    } else if (sign != '+' && p < src_.size() && src_[p] == '\n') {
      ++p;
    }
    line_starting = p > 0 && src_[p - 1] == '\n';
    return p;
  }
  size_t end_of_comment(size_t at, size_t p, bool& line_starting) {
    const size_t end = src_.find("#}", p);
    if (end == std::string_view::npos) fail(at, "unterminated comment: missing '#}'");
    const char sign = end > p && (src_[end - 1] == '-' || src_[end - 1] == '+') ? src_[end - 1] : 0;
    return after_block_end(end + 2, sign, line_starting);
  }
  size_t lex_raw(size_t at, size_t pos, bool& line_starting) {
    for (size_t i = src_.find("{%", pos); i != std::string_view::npos; i = src_.find("{%", i + 1)) {
      size_t p = i + 2;
      char sign = 0;
      if (p < src_.size() && (src_[p] == '-' || src_[p] == '+')) sign = src_[p++];
      while (p < src_.size() && is_space(src_[p])) ++p;
      if (src_.substr(p, 6) != "endraw") continue;
      p += 6;
      while (p < src_.size() && is_space(src_[p])) ++p;
      char end_sign = 0;
      if (p < src_.size() && (src_[p] == '-' || src_[p] == '+')) end_sign = src_[p++];
      if (src_.substr(p, 2) != "%}") continue;
      std::string text(src_.substr(pos, i - pos));
      strip_before(text, sign, true, line_starting);
      emit_data(std::move(text), pos);
      return after_block_end(p + 2, end_sign, line_starting);
    }
    fail(at, "unterminated raw block: missing '{% endraw %}'");
  }

  size_t lex_tag(char kind, size_t p, bool& line_starting) {
    int depth = 0;  // open brackets: "}}" inside {{ {'a': {}} }} closes a dict, not the tag
    const size_t begin = p - 2;
    while (true) {
      while (p < src_.size() && is_space(src_[p])) ++p;
      if (p >= src_.size())
        fail(begin, kind == '{' ? "unexpected end of template: missing '}}'"
                                : "unexpected end of template: missing '%}'");
      const std::string_view rest = src_.substr(p);
      if (depth == 0) {
        const char* close = kind == '{' ? "}}" : "%}";
        for (char sign : {'-', '+', '\0'}) {
          if (sign == '+' && kind == '{') continue;  // "+}}" is not an end: jinja reads '+' then '}}'
          const std::string end = sign ? std::string(1, sign) + close : std::string(close);
          if (rest.substr(0, end.size()) != end) continue;
          push(kind == '{' ? Tok::VarEnd : Tok::BlockEnd, "", p);
          p += end.size();
          if (kind == '{') {  // trim_blocks does not touch print statements
            if (sign == '-') return after_block_end(p, '-', line_starting);
            line_starting = false;
            return p;
          }
          return after_block_end(p, sign, line_starting);
        }
      }
      const char c = src_[p];
      if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
        size_t e = p;
        while (e < src_.size() && (std::isalnum(static_cast<unsigned char>(src_[e])) || src_[e] == '_')) ++e;
        push(Tok::Name, std::string(src_.substr(p, e - p)), p);
        p = e;
      } else if (std::isdigit(static_cast<unsigned char>(c))) {
        p = lex_number(p);
      } else if (c == '\'' || c == '"') {
        p = lex_string(p);
      } else {
        static const char* two[] = {"//", "**", "==", "!=", "<=", ">="};
        std::string op;
        for (const char* t : two)
          if (rest.substr(0, 2) == t) op = t;
        if (op.empty()) {
          if (std::string_view("+-*/%~<>=()[]{},.:|;").find(c) == std::string_view::npos)
            fail(p, fmt::format("unexpected character '{}'", c));
          op = std::string(1, c);
        }
        if (op == "(" || op == "[" || op == "{") ++depth;
        if (op == ")" || op == "]" || op == "}") {
          if (depth == 0) fail(p, fmt::format("unexpected '{}'", op));
          --depth;
        }
        push(Tok::Op, op, p);
        p += op.size();
      }
    }
  }

  size_t lex_number(size_t p) {
    const size_t start = p;
    auto digits = [&] {
      while (p < src_.size() && (std::isdigit(static_cast<unsigned char>(src_[p])) ||
                                 (src_[p] == '_' && p + 1 < src_.size() &&
                                  std::isdigit(static_cast<unsigned char>(src_[p + 1])))))
        ++p;
    };
    digits();
    bool is_float = false;
    if (p + 1 < src_.size() && src_[p] == '.' && std::isdigit(static_cast<unsigned char>(src_[p + 1]))) {
      ++p;
      digits();
      is_float = true;
    }
    if (p < src_.size() && (src_[p] == 'e' || src_[p] == 'E')) {
      size_t q = p + 1;
      if (q < src_.size() && (src_[q] == '+' || src_[q] == '-')) ++q;
      if (q < src_.size() && std::isdigit(static_cast<unsigned char>(src_[q]))) {
        p = q;
        digits();
        is_float = true;
      }
    }
    std::string text(src_.substr(start, p - start));
    text.erase(std::remove(text.begin(), text.end(), '_'), text.end());
    if (!is_float && text.size() > 1 && text[0] == '0' && text.find_first_not_of('0') != std::string::npos)
      fail(start, "leading zeros in integer literals are not permitted");
    Token t{is_float ? Tok::Float : Tok::Int, text};
    std::tie(t.line, t.col) = place(start);
    if (is_float) {
      t.fval = std::strtod(text.c_str(), nullptr);
    } else {
      auto res = std::from_chars(text.data(), text.data() + text.size(), t.ival);
      if (res.ec != std::errc()) fail(start, fmt::format("integer literal {} does not fit 64 bits", text));
    }
    tokens_.push_back(std::move(t));
    return p;
  }

  // A string literal with Python's escapes (jinja decodes them with "unicode-escape").
  size_t lex_string(size_t p) {
    const size_t start = p;
    const char quote = src_[p++];
    std::string out;
    auto hex = [&](size_t at, int n) -> char32_t {
      char32_t v = 0;
      for (int k = 0; k < n; ++k) {
        const char h = at + k < src_.size() ? src_[at + k] : '\0';
        if (!std::isxdigit(static_cast<unsigned char>(h)))
          fail(at, "truncated \\x, \\u or \\U escape in string");
        v = v * 16 + static_cast<char32_t>(
                         std::isdigit(static_cast<unsigned char>(h)) ? h - '0' : (h | 0x20) - 'a' + 10);
      }
      return v;
    };
    while (true) {
      if (p >= src_.size()) fail(start, "unterminated string literal");
      const char c = src_[p];
      if (c == quote) {
        ++p;
        break;
      }
      if (c != '\\') {
        out.push_back(c);
        ++p;
        continue;
      }
      if (p + 1 >= src_.size()) fail(start, "unterminated string literal");
      const char e = src_[p + 1];
      p += 2;
      switch (e) {
        case '\n':
          break;
        case '\\':
          out.push_back('\\');
          break;
        case '\'':
          out.push_back('\'');
          break;
        case '"':
          out.push_back('"');
          break;
        case 'a':
          out.push_back('\a');
          break;
        case 'b':
          out.push_back('\b');
          break;
        case 'f':
          out.push_back('\f');
          break;
        case 'n':
          out.push_back('\n');
          break;
        case 'r':
          out.push_back('\r');
          break;
        case 't':
          out.push_back('\t');
          break;
        case 'v':
          out.push_back('\v');
          break;
        case 'x':
          encode(hex(p, 2), out);
          p += 2;
          break;
        case 'u':
          encode(hex(p, 4), out);
          p += 4;
          break;
        case 'U': {
          const char32_t cp = hex(p, 8);
          if (cp > 0x10FFFF) fail(p - 2, "\\U escape out of range");
          encode(cp, out);
          p += 8;
          break;
        }
        default:
          if (e >= '0' && e <= '7') {
            char32_t v = static_cast<char32_t>(e - '0');
            for (int k = 0; k < 2 && p < src_.size() && src_[p] >= '0' && src_[p] <= '7'; ++k)
              v = v * 8 + static_cast<char32_t>(src_[p++] - '0');
            encode(v, out);
          } else {  // Python keeps unknown escapes as written
            out.push_back('\\');
            out.push_back(e);
          }
      }
    }
    push(Tok::String, std::move(out), start);
    return p;
  }

  std::string_view src_;
  const std::string& origin_;
  std::vector<size_t> line_starts_;
  std::vector<Token> tokens_;
};

}  // namespace

// ================================================================================================
// AST and parser: jinja's grammar (jinja2/parser.py), precedence from loosest to tightest:
// `a if c else b`, or, and, not, comparisons and in, + -, ~, * / // %, **, unary - +, then postfix
// (.attr [index] (call)) and filters/tests (| and is).
// ================================================================================================

enum class Ex {
  Literal,
  Name,
  List,
  Tuple,
  Dict,
  Attr,
  Item,
  Slice,
  Call,
  Filter,
  Test,
  Neg,
  Pos,
  Not,
  And,
  Or,
  Binary,
  Compare,
  Cond,
  BlockValue
};

struct Expr;
using ExprPtr = std::unique_ptr<Expr>;

struct Expr {
  Ex kind;
  int line = 0, col = 0;
  Value value;                   // Literal
  std::string name;              // Name, Attr, Filter, Test, Binary's operator
  std::vector<ExprPtr> kids;     // operands; a missing slice bound or else branch is null
  std::vector<std::string> ops;  // Compare: the operator before each kid after the first
  std::vector<std::pair<std::string, ExprPtr>> kwargs;  // Call, Filter, Test
  bool negated = false;                                 // Test: `is not`
};

enum class St {
  Text,
  Print,
  If,
  For,
  Set,
  SetBlock,
  Macro,
  CallBlock,
  FilterBlock,
  With,
  Break,
  Continue,
  Body
};

struct Stmt;
using StmtPtr = std::unique_ptr<Stmt>;
using Body = std::vector<StmtPtr>;

struct Stmt {
  St kind;
  int line = 0, col = 0;
  std::string text;            // Text; Macro's name
  ExprPtr target;              // For, Set, SetBlock: a Name, a Tuple of Names, or ns.attr
  std::vector<ExprPtr> exprs;  // Print [e]; If [cond per branch]; For [iter, filter or null]; Set [value];
                               // SetBlock/FilterBlock [filters applied to BlockValue or null];
                               // CallBlock [call]; With [values]
  std::vector<Body> bodies;    // If: one per branch, then else; For: body, else; others: body
  std::vector<std::string> params;  // Macro, CallBlock: parameter names; With: names
  std::vector<ExprPtr> defaults;    // Macro, CallBlock: default per parameter or null
};

struct Node {
  Body body;
};

namespace {

bool known_filter(const std::string& name);
bool known_test(const std::string& name);

class Parser {
 public:
  Parser(std::vector<Token> tokens, const std::string& origin, const Limits& limits)
      : toks_(std::move(tokens)), origin_(origin), limits_(limits) {}

  Body parse_template() {
    std::string end;
    Body body = parse_body({}, end, nullptr);
    validate(body, false);
    return body;
  }

 private:
  struct DepthGuard {
    Parser& p;
    DepthGuard(Parser& parser) : p(parser) {
      if (++p.depth_ > p.limits_.max_parse_depth)
        p.fail(p.cur(), fmt::format("template nested deeper than {} levels", p.limits_.max_parse_depth));
    }
    ~DepthGuard() { --p.depth_; }
  };

  [[noreturn]] void fail(const Token& at, const std::string& what) const {
    throw ValueError(fmt::format("{}:{}:{}: {}", origin_, at.line, at.col, what));
  }
  const Token& cur() const { return toks_[i_]; }
  const Token& peek(size_t k = 1) const { return toks_[std::min(i_ + k, toks_.size() - 1)]; }
  const Token& next() {
    const Token& t = toks_[i_];
    if (i_ + 1 < toks_.size()) ++i_;
    return t;
  }
  bool is_op(const char* op) const { return cur().type == Tok::Op && cur().text == op; }
  bool is_name(const char* name) const { return cur().type == Tok::Name && cur().text == name; }
  bool skip_op(const char* op) {
    if (!is_op(op)) return false;
    next();
    return true;
  }
  void expect_op(const char* op) {
    if (!is_op(op)) fail(cur(), fmt::format("expected '{}', got {}", op, describe(cur())));
    next();
  }
  std::string expect_name(const char* what = "a name") {
    if (cur().type != Tok::Name) fail(cur(), fmt::format("expected {}, got {}", what, describe(cur())));
    return next().text;
  }
  // jinja takes `{% else: %}`, `{% for x in y: %}`: an optional colon before a block's body.
  void expect_body_start() {
    skip_op(":");
    expect_block_end();
  }
  void expect_block_end() {
    if (cur().type != Tok::BlockEnd)
      fail(cur(), fmt::format("expected end of statement block '%}}', got {}", describe(cur())));
    next();
  }
  ExprPtr make(Ex kind, const Token& t) {
    auto e = std::make_unique<Expr>();
    e->kind = kind;
    e->line = t.line;
    e->col = t.col;
    return e;
  }
  StmtPtr make(St kind, const Token& t) {
    auto s = std::make_unique<Stmt>();
    s->kind = kind;
    s->line = t.line;
    s->col = t.col;
    return s;
  }

  // Statements up to one of the tags in `ends` ({% elif %}, {% endfor %}, ...): that tag's name goes
  // in `found`, with the parser just after it. `opener` is the block being closed, for the error.
  Body parse_body(std::initializer_list<const char*> ends, std::string& found, const Token* opener) {
    Body body;
    while (true) {
      const Token& t = cur();
      if (t.type == Tok::Eof) {
        if (!opener) return body;
        std::string want;
        for (const char* e : ends) want += fmt::format("{}'{}'", want.empty() ? "" : " or ", e);
        fail(t, fmt::format("unexpected end of template: the block at {}:{} needs {}", opener->line,
                            opener->col, want));
      }
      if (t.type == Tok::Data) {
        auto s = make(St::Text, t);
        s->text = next().text;
        body.push_back(std::move(s));
      } else if (t.type == Tok::VarBegin) {
        next();
        auto s = make(St::Print, t);
        s->exprs.push_back(parse_tuple(true, false));
        if (cur().type != Tok::VarEnd)
          fail(cur(), fmt::format("expected end of print statement '}}}}', got {}", describe(cur())));
        next();
        body.push_back(std::move(s));
      } else if (t.type == Tok::BlockBegin) {
        const Token& name = peek();
        if (name.type == Tok::Name)
          for (const char* e : ends)
            if (name.text == e) {
              next();
              found = next().text;
              return body;
            }
        next();
        body.push_back(parse_statement());
      } else {
        fail(t, fmt::format("unexpected {}", describe(t)));
      }
    }
  }

  StmtPtr parse_statement() {
    DepthGuard guard(*this);
    const Token& t = cur();
    if (t.type != Tok::Name) fail(t, fmt::format("expected a statement name, got {}", describe(t)));
    const std::string tag = t.text;
    next();
    std::string end;
    if (tag == "if") {
      auto s = make(St::If, t);
      s->exprs.push_back(parse_tuple(false, false));  // as jinja: `{% if a if b %}` does not parse
      expect_body_start();
      while (true) {
        s->bodies.push_back(parse_body({"elif", "else", "endif"}, end, &t));
        if (end == "elif") {
          s->exprs.push_back(parse_tuple(false, false));
          expect_body_start();
        } else if (end == "else") {
          expect_body_start();
          s->bodies.push_back(parse_body({"endif"}, end, &t));
          expect_block_end();
          return s;
        } else {
          expect_block_end();
          return s;
        }
      }
    }
    if (tag == "for") {
      auto s = make(St::For, t);
      s->target = parse_assign_target(false);
      if (!is_name("in")) fail(cur(), fmt::format("expected 'in', got {}", describe(cur())));
      next();
      s->exprs.push_back(parse_tuple(false, false));
      s->exprs.push_back(nullptr);
      if (is_name("if")) {
        next();
        s->exprs[1] = parse_expression();
      }
      if (is_name("recursive")) fail(cur(), "recursive loops are not supported");
      expect_body_start();
      ++loops_;
      s->bodies.push_back(parse_body({"else", "endfor"}, end, &t));
      --loops_;
      if (end == "else") {
        expect_body_start();
        s->bodies.push_back(parse_body({"endfor"}, end, &t));
      } else {
        s->bodies.emplace_back();
      }
      expect_block_end();
      return s;
    }
    if (tag == "set") {
      ExprPtr target = parse_assign_target(true);
      if (skip_op("=")) {
        auto s = make(St::Set, t);
        s->target = std::move(target);
        s->exprs.push_back(parse_tuple(true, false));
        expect_block_end();
        return s;
      }
      if (target->kind != Ex::Name) fail(cur(), "a block set ({% set x %}...{% endset %}) takes one name");
      auto s = make(St::SetBlock, t);
      s->target = std::move(target);
      s->exprs.push_back(is_op("|") ? parse_filters(make(Ex::BlockValue, cur())) : nullptr);
      expect_body_start();
      s->bodies.push_back(parse_body({"endset"}, end, &t));
      expect_block_end();
      return s;
    }
    if (tag == "macro" || tag == "call") {
      auto s = make(tag == "macro" ? St::Macro : St::CallBlock, t);
      if (tag == "macro") s->text = expect_name("the macro's name");
      if (tag == "macro" || is_op("(")) parse_signature(*s);
      if (tag == "call") {
        ExprPtr call = parse_expression();
        if (call->kind != Ex::Call) fail(t, "{% call %} needs a macro call");
        s->exprs.push_back(std::move(call));
      }
      expect_body_start();
      const int loops = loops_;
      loops_ = 0;  // break and continue do not cross a macro
      s->bodies.push_back(parse_body({tag == "macro" ? "endmacro" : "endcall"}, end, &t));
      loops_ = loops;
      expect_block_end();
      return s;
    }
    if (tag == "filter") {
      auto s = make(St::FilterBlock, t);
      s->exprs.push_back(parse_filters(make(Ex::BlockValue, cur()), false));
      expect_body_start();
      s->bodies.push_back(parse_body({"endfilter"}, end, &t));
      expect_block_end();
      return s;
    }
    if (tag == "with") {
      auto s = make(St::With, t);
      while (cur().type != Tok::BlockEnd) {
        if (!s->params.empty()) expect_op(",");
        s->params.push_back(expect_name());
        expect_op("=");
        s->exprs.push_back(parse_expression());
      }
      expect_body_start();
      s->bodies.push_back(parse_body({"endwith"}, end, &t));
      expect_block_end();
      return s;
    }
    if (tag == "break" || tag == "continue") {
      if (loops_ == 0) fail(t, fmt::format("'{}' outside a loop", tag));
      auto s = make(tag == "break" ? St::Break : St::Continue, t);
      expect_block_end();
      return s;
    }
    if (tag == "generation") {  // transformers' extension: marks the assistant's tokens; renders as is
      auto s = make(St::Body, t);
      expect_body_start();
      s->bodies.push_back(parse_body({"endgeneration"}, end, &t));
      expect_block_end();
      return s;
    }
    if (tag == "include" || tag == "import" || tag == "from" || tag == "extends" || tag == "block")
      fail(t, fmt::format("'{}' is not supported: a chat template is one file", tag));
    fail(t, fmt::format("unknown tag '{}'", tag));
  }

  void parse_signature(Stmt& s) {
    expect_op("(");
    while (!is_op(")")) {
      if (!s.params.empty()) expect_op(",");
      if (is_op(")")) break;
      const Token& at = cur();
      s.params.push_back(expect_name("a parameter name"));
      if (std::count(s.params.begin(), s.params.end(), s.params.back()) > 1)
        fail(at, fmt::format("duplicate argument '{}'", s.params.back()));
      if (skip_op("=")) {
        s.defaults.push_back(parse_expression());
      } else {
        if (!s.defaults.empty() && s.defaults.back())
          fail(cur(), "a parameter without a default follows one with a default");
        s.defaults.push_back(nullptr);
      }
    }
    next();
  }

  // for/set targets: a name, names separated by commas (optionally in parentheses), or, for set,
  // namespace.attribute.
  ExprPtr parse_assign_target(bool allow_attr) {
    const Token& t = cur();
    if (allow_attr && t.type == Tok::Name && peek().type == Tok::Op && peek().text == ".") {
      auto obj = make(Ex::Name, t);
      obj->name = next().text;
      next();
      auto e = make(Ex::Attr, t);
      e->name = expect_name("an attribute name");
      e->kids.push_back(std::move(obj));
      return e;
    }
    const bool parens = skip_op("(");
    auto tuple = make(Ex::Tuple, t);
    while (true) {
      auto n = make(Ex::Name, cur());
      n->name = expect_name("a variable name");
      if (n->name == "true" || n->name == "false" || n->name == "none" || n->name == "True" ||
          n->name == "False" || n->name == "None")
        fail(cur(), fmt::format("cannot assign to '{}'", n->name));
      tuple->kids.push_back(std::move(n));
      if (!skip_op(",")) break;  // jinja refuses a trailing comma here
    }
    if (parens) expect_op(")");
    if (tuple->kids.size() == 1 && !parens) return std::move(tuple->kids[0]);
    return tuple;
  }

  bool tuple_end() const {
    const Token& t = cur();
    return t.type == Tok::VarEnd || t.type == Tok::BlockEnd || t.type == Tok::Eof ||
           (t.type == Tok::Op && t.text == ")");
  }

  // Comma-separated expressions: one is the expression itself, more (or a trailing comma) a tuple.
  ExprPtr parse_tuple(bool with_condexpr, bool explicit_parens) {
    const Token& t = cur();
    std::vector<ExprPtr> items;
    bool is_tuple = false;
    while (true) {
      if (!items.empty()) expect_op(",");
      if (tuple_end()) break;
      items.push_back(with_condexpr ? parse_expression() : parse_or());
      if (is_op(","))
        is_tuple = true;
      else
        break;
    }
    if (!is_tuple) {
      if (items.size() == 1) return std::move(items[0]);
      if (!explicit_parens) fail(cur(), fmt::format("expected an expression, got {}", describe(cur())));
    }
    auto e = make(Ex::Tuple, t);
    e->kids = std::move(items);
    return e;
  }

  ExprPtr parse_expression() {
    DepthGuard guard(*this);
    ExprPtr expr = parse_or();
    while (is_name("if")) {
      const Token& t = next();
      auto e = make(Ex::Cond, t);
      ExprPtr cond = parse_or();
      ExprPtr other;
      if (is_name("else")) {
        next();
        other = parse_expression();
      }
      e->kids.push_back(std::move(expr));
      e->kids.push_back(std::move(cond));
      e->kids.push_back(std::move(other));
      expr = std::move(e);
    }
    return expr;
  }
  ExprPtr binary(Ex kind, const Token& t, ExprPtr a, ExprPtr b, std::string op = {}) {
    auto e = make(kind, t);
    e->name = std::move(op);
    e->kids.push_back(std::move(a));
    e->kids.push_back(std::move(b));
    return e;
  }
  ExprPtr parse_or() {
    ExprPtr left = parse_and();
    while (is_name("or")) {
      const Token& t = next();
      left = binary(Ex::Or, t, std::move(left), parse_and());
    }
    return left;
  }
  ExprPtr parse_and() {
    ExprPtr left = parse_not();
    while (is_name("and")) {
      const Token& t = next();
      left = binary(Ex::And, t, std::move(left), parse_not());
    }
    return left;
  }
  ExprPtr parse_not() {
    if (is_name("not")) {
      DepthGuard guard(*this);
      const Token& t = next();
      auto e = make(Ex::Not, t);
      e->kids.push_back(parse_not());
      return e;
    }
    return parse_compare();
  }
  ExprPtr parse_compare() {
    const Token& t = cur();
    ExprPtr first = parse_math1();
    ExprPtr cmp;
    while (true) {
      std::string op;
      if (cur().type == Tok::Op && (cur().text == "==" || cur().text == "!=" || cur().text == "<" ||
                                    cur().text == "<=" || cur().text == ">" || cur().text == ">=")) {
        op = next().text;
      } else if (is_name("in")) {
        next();
        op = "in";
      } else if (is_name("not") && peek().type == Tok::Name && peek().text == "in") {
        next();
        next();
        op = "not in";
      } else {
        break;
      }
      if (!cmp) {
        cmp = make(Ex::Compare, t);
        cmp->kids.push_back(std::move(first));
      }
      cmp->ops.push_back(op);
      cmp->kids.push_back(parse_math1());
    }
    return cmp ? std::move(cmp) : std::move(first);
  }
  ExprPtr parse_math1() {
    ExprPtr left = parse_concat();
    while (is_op("+") || is_op("-")) {
      const Token& t = next();
      left = binary(Ex::Binary, t, std::move(left), parse_concat(), t.text);
    }
    return left;
  }
  ExprPtr parse_concat() {
    ExprPtr left = parse_math2();
    while (is_op("~")) {
      const Token& t = next();
      left = binary(Ex::Binary, t, std::move(left), parse_math2(), "~");
    }
    return left;
  }
  ExprPtr parse_math2() {
    ExprPtr left = parse_pow();
    while (is_op("*") || is_op("/") || is_op("//") || is_op("%")) {
      const Token& t = next();
      left = binary(Ex::Binary, t, std::move(left), parse_pow(), t.text);
    }
    return left;
  }
  ExprPtr parse_pow() {
    ExprPtr left = parse_unary(true);
    while (is_op("**")) {
      const Token& t = next();
      left = binary(Ex::Binary, t, std::move(left), parse_unary(true), "**");
    }
    return left;
  }
  ExprPtr parse_unary(bool with_filter) {
    DepthGuard guard(*this);
    const Token& t = cur();
    ExprPtr node;
    if (is_op("-") || is_op("+")) {
      next();
      node = make(t.text == "-" ? Ex::Neg : Ex::Pos, t);
      node->kids.push_back(parse_unary(false));
    } else {
      node = parse_primary();
    }
    node = parse_postfix(std::move(node));
    if (with_filter) node = parse_filter_expr(std::move(node));
    return node;
  }
  ExprPtr parse_primary() {
    const Token& t = cur();
    if (t.type == Tok::Name) {
      next();
      auto e = make(Ex::Literal, t);
      if (t.text == "true" || t.text == "True") {
        e->value = true;
      } else if (t.text == "false" || t.text == "False") {
        e->value = false;
      } else if (t.text == "none" || t.text == "None") {
        e->value = None{};
      } else {
        e->kind = Ex::Name;
        e->name = t.text;
      }
      return e;
    }
    if (t.type == Tok::String) {
      std::string s;
      while (cur().type == Tok::String) s += next().text;  // adjacent literals concatenate
      auto e = make(Ex::Literal, t);
      e->value = std::move(s);
      return e;
    }
    if (t.type == Tok::Int || t.type == Tok::Float) {
      next();
      auto e = make(Ex::Literal, t);
      if (t.type == Tok::Int)
        e->value = t.ival;
      else
        e->value = t.fval;
      return e;
    }
    if (is_op("(")) {
      next();
      ExprPtr e = parse_tuple(true, true);
      expect_op(")");
      return e;
    }
    if (is_op("[")) {
      next();
      auto e = make(Ex::List, t);
      while (!is_op("]")) {
        if (!e->kids.empty()) expect_op(",");
        if (is_op("]")) break;
        e->kids.push_back(parse_expression());
      }
      next();
      return e;
    }
    if (is_op("{")) {
      next();
      auto e = make(Ex::Dict, t);
      while (!is_op("}")) {
        if (!e->kids.empty()) expect_op(",");
        if (is_op("}")) break;
        e->kids.push_back(parse_expression());
        expect_op(":");
        e->kids.push_back(parse_expression());
      }
      next();
      return e;
    }
    fail(t, fmt::format("unexpected {}", describe(t)));
  }
  ExprPtr parse_postfix(ExprPtr node) {
    while (true) {
      const Token& t = cur();
      if (is_op(".")) {
        next();
        if (cur().type == Tok::Name) {
          auto e = make(Ex::Attr, t);
          e->name = next().text;
          e->kids.push_back(std::move(node));
          node = std::move(e);
        } else if (cur().type == Tok::Int) {
          auto key = make(Ex::Literal, cur());
          key->value = next().ival;
          node = binary(Ex::Item, t, std::move(node), std::move(key));
        } else {
          fail(cur(), fmt::format("expected an attribute name after '.', got {}", describe(cur())));
        }
      } else if (is_op("[")) {
        next();
        node = parse_subscript(std::move(node), t);
        expect_op("]");
      } else if (is_op("(")) {
        node = parse_call(std::move(node));
      } else {
        return node;
      }
    }
  }
  ExprPtr parse_subscript(ExprPtr obj, const Token& t) {
    ExprPtr start, stop, step;
    if (is_op("]"))
      return binary(Ex::Item, t, std::move(obj), make(Ex::Tuple, t));  // x[]: undefined, as in jinja
    if (!is_op(":")) {
      start = parse_expression();
      if (!is_op(":")) {
        if (is_op(",")) {  // x[a, b]: a tuple key, which no JSON value has, so undefined
          auto key = make(Ex::Tuple, t);
          key->kids.push_back(std::move(start));
          while (skip_op(",") && !is_op("]")) key->kids.push_back(parse_expression());
          return binary(Ex::Item, t, std::move(obj), std::move(key));
        }
        return binary(Ex::Item, t, std::move(obj), std::move(start));
      }
    }
    next();  // ':'
    if (!is_op("]") && !is_op(":")) stop = parse_expression();
    if (skip_op(":") && !is_op("]")) step = parse_expression();
    auto e = make(Ex::Slice, t);
    e->kids.push_back(std::move(obj));
    e->kids.push_back(std::move(start));
    e->kids.push_back(std::move(stop));
    e->kids.push_back(std::move(step));
    return e;
  }
  // (args) after a callee, a filter or a test: positional first, then name=value.
  void parse_args(Expr& e) {
    expect_op("(");
    bool first = true;
    while (!is_op(")")) {
      if (!first) expect_op(",");
      first = false;
      if (is_op(")")) break;
      if (is_op("*") || is_op("**")) fail(cur(), "*args and **kwargs in calls are not supported");
      if (cur().type == Tok::Name && peek().type == Tok::Op && peek().text == "=") {
        std::string name = next().text;
        next();
        e.kwargs.emplace_back(std::move(name), parse_expression());
      } else {
        if (!e.kwargs.empty()) fail(cur(), "a positional argument follows a keyword argument");
        e.kids.push_back(parse_expression());
      }
    }
    next();
  }
  ExprPtr parse_call(ExprPtr callee) {
    auto e = make(Ex::Call, cur());
    e->line = callee->line;  // a failing call points at what was called
    e->col = callee->col;
    e->kids.push_back(std::move(callee));
    parse_args(*e);
    return e;
  }
  ExprPtr parse_filter_expr(ExprPtr node) {
    while (true) {
      if (is_op("|")) {
        node = parse_filters(std::move(node), true);
      } else if (is_name("is")) {
        node = parse_test(std::move(node));
      } else if (is_op("(")) {
        node = parse_call(std::move(node));
      } else {
        return node;
      }
    }
  }
  // `| name(args) | name ...`; a filter block's first filter comes without the bar.
  ExprPtr parse_filters(ExprPtr node, bool bar = true) {
    bool first = true;
    while (is_op("|") || (first && !bar)) {
      if (is_op("|")) next();
      first = false;
      const Token& t = cur();
      auto e = make(Ex::Filter, t);
      e->name = expect_name("a filter name");
      while (is_op(".")) {
        next();
        e->name += "." + expect_name();
      }
      e->kids.push_back(std::move(node));
      if (is_op("(")) parse_args(*e);
      node = std::move(e);
    }
    return node;
  }
  ExprPtr parse_test(ExprPtr node) {
    const Token& is = next();
    auto e = make(Ex::Test, is);
    if (is_name("not")) {
      next();
      e->negated = true;
    }
    const Token& t = cur();
    e->line = t.line;  // errors point at the test's name
    e->col = t.col;
    e->name = expect_name("a test name");
    while (is_op(".")) {
      next();
      e->name += "." + expect_name();
    }
    e->kids.push_back(std::move(node));
    const Token& c = cur();
    if (is_op("(")) {
      parse_args(*e);
    } else if ((c.type == Tok::Name || c.type == Tok::String || c.type == Tok::Int || c.type == Tok::Float ||
                (c.type == Tok::Op && (c.text == "[" || c.text == "{"))) &&
               !is_name("else") && !is_name("or") && !is_name("and")) {
      if (is_name("is")) fail(c, "tests cannot be chained with 'is'");
      e->kids.push_back(parse_postfix(parse_primary()));
    }
    return e;
  }

  // An unknown filter or test is an error at parse time, as jinja's compiler makes it, except in
  // the branches of an if or of `a if c else b` (jinja's "soft" frames), where it fails only if it
  // runs: templates guard optional features that way.
  void validate(const Expr& e, bool soft) const {
    if (e.kind == Ex::Cond) soft = true;
    if ((e.kind == Ex::Filter && !known_filter(e.name)) || (e.kind == Ex::Test && !known_test(e.name))) {
      if (!soft)
        throw ValueError(fmt::format("{}:{}:{}: no {} named '{}'", origin_, e.line, e.col,
                                     e.kind == Ex::Filter ? "filter" : "test", e.name));
    }
    for (const auto& k : e.kids)
      if (k) validate(*k, soft);
    for (const auto& kv : e.kwargs) validate(*kv.second, soft);
  }
  void validate(const Body& body, bool soft) const {
    for (const auto& st : body) {
      const bool is_if = st->kind == St::If;
      // Loops, macros and blocks open a new frame, which is not soft; what a statement evaluates in
      // the current frame (a loop's iterable, a set's value) keeps its softness.
      const bool own_frame = st->kind == St::SetBlock || st->kind == St::FilterBlock || st->kind == St::Macro;
      if (st->target) validate(*st->target, soft);
      for (size_t i = 0; i < st->exprs.size(); ++i)
        if (st->exprs[i])
          validate(*st->exprs[i], is_if || (soft && !own_frame && !(st->kind == St::For && i == 1)));
      for (const auto& d : st->defaults)
        if (d) validate(*d, false);
      for (const auto& b : st->bodies) validate(b, is_if);
    }
  }

  std::vector<Token> toks_;
  size_t i_ = 0;
  const std::string& origin_;
  const Limits& limits_;
  int depth_ = 0;
  int loops_ = 0;
};

}  // namespace

// ================================================================================================
// Renderer: evaluates the AST against a context. Scopes live until the render ends (macros keep
// pointers to the scope they were defined in); faults unwind as Located and leave as ValueError.
// ================================================================================================

struct Scope {
  std::unordered_map<std::string, Value> vars;
  Scope* parent = nullptr;
};

namespace {

using FilterFn = Value (*)(Renderer&, const Value&, Args&);
using TestFn = bool (*)(Renderer&, const Value&, Args&);
const std::unordered_map<std::string, FilterFn>& filters();
const std::unordered_map<std::string, TestFn>& tests();

bool known_filter(const std::string& name) { return filters().count(name) > 0; }
bool known_test(const std::string& name) { return tests().count(name) > 0; }

// Parameter `name`, at position `i`, of a filter, test, method or global: given by position, by
// name, or `fallback`.
Value arg(const Args& a, size_t i, std::string_view name, const Value& fallback = Value()) {
  if (i < a.pos.size()) return a.pos[i];
  for (const auto& [k, v] : a.kw)
    if (k == name) return v;
  return fallback;
}
Value need_arg(const Args& a, size_t i, std::string_view name, std::string_view fn) {
  Value v = arg(a, i, name);
  if (v.undefined() && i >= a.pos.size()) {
    bool given = false;
    for (const auto& kv : a.kw) given = given || kv.first == name;
    if (!given) fault(fmt::format("{}() missing required argument '{}'", fn, name));
  }
  return v;
}
void check_args(const Args& a, std::string_view fn, std::initializer_list<std::string_view> names) {
  if (a.pos.size() > names.size())
    fault(fmt::format("{}() takes at most {} argument(s), {} given", fn, names.size(), a.pos.size()));
  for (const auto& kv : a.kw)
    if (std::find(names.begin(), names.end(), kv.first) == names.end())
      fault(fmt::format("{}() got an unexpected keyword argument '{}'", fn, kv.first));
}

bool is_number(const Value& v) { return v.is_bool() || v.is_int() || v.is_float(); }
bool int_of(const Value& v, int64_t& out) {
  if (v.is_int()) return out = std::get<int64_t>(v.v), true;
  if (v.is_bool()) return out = std::get<bool>(v.v), true;
  return false;
}
double float_of(const Value& v) {
  if (v.is_float()) return std::get<double>(v.v);
  if (v.is_int()) return static_cast<double>(std::get<int64_t>(v.v));
  return std::get<bool>(v.v) ? 1.0 : 0.0;
}
int64_t need_int(const Value& v, std::string_view what) {
  int64_t i;
  if (!int_of(v, i)) fault(fmt::format("{} must be an integer, not {}", what, type_name(v)));
  return i;
}
const std::string& need_str(const Value& v, std::string_view what) {
  if (!v.is_str()) fault(fmt::format("{} must be a string, not {}", what, type_name(v)));
  return v.str();
}

FuncPtr make_func(std::string name, std::function<Value(Renderer&, Args&)> call) {
  return std::make_shared<const FuncObj>(FuncObj{std::move(name), std::move(call)});
}

// Python's floor division and modulo, for ints and for floats.
int64_t floor_div(int64_t a, int64_t b) {
  if (a == INT64_MIN && b == -1) fault("integer overflow");
  int64_t q = a / b;
  if ((a % b != 0) && ((a < 0) != (b < 0))) --q;
  return q;
}
int64_t floor_mod(int64_t a, int64_t b) {
  if (b == -1) return 0;
  int64_t m = a % b;
  if (m != 0 && ((m < 0) != (b < 0))) m += b;
  return m;
}
void float_divmod(double vx, double wx, double& div, double& mod) {
  mod = std::fmod(vx, wx);
  div = (vx - mod) / wx;
  if (mod != 0) {
    if ((wx < 0) != (mod < 0)) {
      mod += wx;
      div -= 1.0;
    }
  } else {
    mod = std::copysign(0.0, wx);
  }
  if (div != 0) {
    double floordiv = std::floor(div);
    if (div - floordiv > 0.5) floordiv += 1.0;
    div = floordiv;
  } else {
    div = std::copysign(0.0, vx / wx);
  }
}

}  // namespace

class Renderer {
 public:
  Renderer(const Limits& limits, const std::string& origin) : limits(limits), origin(origin) {}

  const Limits& limits;
  const std::string& origin;

  enum class Flow { Normal, Break, Continue };

  std::string run(const Body& body, const nlohmann::ordered_json& context);

  // ---- values ----
  std::string to_str(const Value& v) const {
    std::string s;
    py_str(v, s, 0, limits.max_data_depth);
    return s;
  }
  std::string to_repr(const Value& v) const {
    std::string s;
    py_repr(v, s, 0, limits.max_data_depth);
    return s;
  }
  static bool truthy(const Value& v) {
    if (v.undefined() || v.none()) return false;
    if (v.is_bool()) return std::get<bool>(v.v);
    if (v.is_int()) return std::get<int64_t>(v.v) != 0;
    if (v.is_float()) return std::get<double>(v.v) != 0;
    if (v.is_str()) return !v.str().empty();
    if (v.is_list()) return v.list()->kind == Seq::Generator || !v.list()->items.empty();
    if (v.is_dict()) return v.dict()->kind != Obj::Dict || !v.dict()->items.empty();
    return true;
  }
  [[noreturn]] static void undefined_fault(const Value& v) {
    fault(v.hint().empty() ? std::string("value is undefined") : v.hint());
  }
  void check_string(size_t bytes) const {
    if (bytes > limits.max_output_bytes)
      fault(fmt::format("string of {} bytes exceeds the output limit of {} bytes", bytes,
                        limits.max_output_bytes));
  }
  void check_items(int64_t n) const {
    if (n > limits.max_loop_iterations)
      fault(fmt::format("a list of {} items exceeds the limit of {}", n, limits.max_loop_iterations));
  }
  void count_iteration() {
    if (++iterations_ > limits.max_loop_iterations)
      fault(fmt::format("loop iterations exceed the limit of {}", limits.max_loop_iterations));
  }
  void emit(std::string& out, std::string_view text) const {
    check_string(out.size() + text.size());
    out += text;
  }

  bool eq(const Value& a, const Value& b, int depth = 0) const {
    check_depth(depth, limits.max_data_depth);
    if (is_number(a) && is_number(b)) {
      int64_t x = 0, y = 0;
      if (int_of(a, x) && int_of(b, y)) return x == y;
      return float_of(a) == float_of(b);
    }
    if (a.v.index() != b.v.index()) return false;
    if (a.is_str()) return a.str() == b.str();
    if (a.undefined() || a.none()) return true;
    if (a.is_list()) {
      const ListObj &x = *a.list(), &y = *b.list();
      if (&x == &y) return true;
      if (x.kind != y.kind || x.kind == Seq::Generator || x.items.size() != y.items.size()) return false;
      for (size_t i = 0; i < x.items.size(); ++i)
        if (!eq(x.items[i], y.items[i], depth + 1)) return false;
      return true;
    }
    if (a.is_dict()) {
      const DictObj &x = *a.dict(), &y = *b.dict();
      if (&x == &y) return true;
      if (x.kind != Obj::Dict || y.kind != Obj::Dict || x.items.size() != y.items.size()) return false;
      for (const auto& [k, v] : x.items) {
        const Value* w = y.find(k);
        if (!w || !eq(v, *w, depth + 1)) return false;
      }
      return true;
    }
    return a.func() == b.func();
  }
  // a < b, where Python allows it.
  bool lt(const Value& a, const Value& b, int depth = 0) const {
    check_depth(depth, limits.max_data_depth);
    if (is_number(a) && is_number(b)) {
      int64_t x = 0, y = 0;
      if (int_of(a, x) && int_of(b, y)) return x < y;
      return float_of(a) < float_of(b);
    }
    if (a.is_str() && b.is_str()) return a.str() < b.str();
    if (a.is_list() && b.is_list() && a.list()->kind == b.list()->kind && a.list()->kind != Seq::Generator) {
      const auto &x = a.list()->items, &y = b.list()->items;
      for (size_t i = 0; i < x.size() && i < y.size(); ++i) {
        if (eq(x[i], y[i], depth + 1)) continue;
        return lt(x[i], y[i], depth + 1);
      }
      return x.size() < y.size();
    }
    if (a.undefined()) undefined_fault(a);
    if (b.undefined()) undefined_fault(b);
    fault(fmt::format("'<' not supported between instances of '{}' and '{}'", type_name(a), type_name(b)));
  }
  int compare(const Value& a, const Value& b) const { return lt(a, b) ? -1 : lt(b, a) ? 1 : 0; }

  bool contains(const Value& seq, const Value& item) const {
    if (seq.is_str()) {
      if (!item.is_str()) {
        if (item.undefined()) undefined_fault(item);
        fault(fmt::format("'in <string>' requires string as left operand, not {}", type_name(item)));
      }
      return seq.str().find(item.str()) != std::string::npos;
    }
    if (is_plain_dict(seq)) return item.is_str() && seq.dict()->find(item.str()) != nullptr;
    for (const Value& v : iterate(seq))
      if (eq(v, item)) return true;
    return false;
  }

  std::vector<Value> iterate(const Value& v) const {
    if (v.undefined()) return {};
    if (v.is_list()) return v.list()->items;
    if (v.is_str()) {
      std::vector<Value> out;
      std::string one;
      for (char32_t c : decode(v.str())) {
        one.clear();
        encode(c, one);
        out.emplace_back(one);
      }
      return out;
    }
    if (is_plain_dict(v)) {
      std::vector<Value> out;
      out.reserve(v.dict()->items.size());
      for (const auto& kv : v.dict()->items) out.emplace_back(kv.first);
      return out;
    }
    fault(fmt::format("'{}' object is not iterable", type_name(v)));
  }

  Value getattr(const Value& obj, const std::string& name) const;
  Value getitem(const Value& obj, const Value& key) const;
  Value call(const Value& fn, Args& args) {
    if (fn.is_func()) return fn.func()->call(*this, args);
    if (fn.undefined()) undefined_fault(fn);
    fault(fmt::format("'{}' object is not callable", type_name(fn)));
  }
  Value call_filter(const std::string& name, const Value& v, Args& args) {
    auto it = filters().find(name);
    if (it == filters().end()) fault(fmt::format("no filter named '{}'", name));
    return it->second(*this, v, args);
  }
  bool call_test(const std::string& name, const Value& v, Args& args) {
    auto it = tests().find(name);
    if (it == tests().end()) fault(fmt::format("no test named '{}'", name));
    return it->second(*this, v, args);
  }
  Value binop(const std::string& op, const Value& a, const Value& b) const;
  // The attribute path "a.b.0" of jinja's attribute= arguments.
  Value attr_path(const Value& item, const std::string& path) const {
    Value cur = item;
    size_t start = 0;
    while (true) {
      const size_t dot = path.find('.', start);
      const std::string part = path.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
      int64_t idx;
      auto res = std::from_chars(part.data(), part.data() + part.size(), idx);
      if (!part.empty() && res.ec == std::errc() && res.ptr == part.data() + part.size())
        cur = getitem(cur, idx);
      else
        cur = getitem(cur, part);
      if (dot == std::string::npos) return cur;
      start = dot + 1;
    }
  }
  Value slice(const Value& obj, const Value& start, const Value& stop, const Value& step) const;
  // A value assigned to a namespace must not hold that namespace: the cycle would never be freed.
  bool reaches(const Value& v, const DictObj* target, int depth) const {
    check_depth(depth, limits.max_data_depth);
    if (v.is_dict()) {
      if (v.dict().get() == target) return true;
      for (const auto& kv : v.dict()->items)
        if (reaches(kv.second, target, depth + 1)) return true;
    } else if (v.is_list()) {
      for (const Value& item : v.list()->items)
        if (reaches(item, target, depth + 1)) return true;
    }
    return false;
  }

  Value eval(const Expr& e, Scope& s);
  Flow exec(const Body& body, Scope& s, std::string& out);

 private:
  struct Depth {
    Renderer& r;
    explicit Depth(Renderer& renderer) : r(renderer) {
      if (r.depth_ >= r.limits.max_render_depth)
        fault(
            fmt::format("render nested deeper than {} levels (recursive macro?)", r.limits.max_render_depth));
      ++r.depth_;
    }
    ~Depth() { --r.depth_; }
  };

  Scope& new_scope(Scope* parent) {
    scopes_.emplace_back();
    scopes_.back().parent = parent;
    return scopes_.back();
  }
  static Value lookup(Scope& s, const std::string& name) {
    for (Scope* p = &s; p; p = p->parent) {
      auto it = p->vars.find(name);
      if (it != p->vars.end()) return it->second;
    }
    return Undefined{fmt::format("'{}' is undefined", name)};
  }
  void assign(const Expr& target, Value v, Scope& s);
  Value eval_inner(const Expr& e, Scope& s);
  Flow exec_stmt(const Stmt& st, Scope& s, std::string& out);
  Args eval_args(const Expr& e, size_t first, Scope& s) {
    Args a;
    for (size_t i = first; i < e.kids.size(); ++i) a.pos.push_back(eval(*e.kids[i], s));
    for (const auto& [k, x] : e.kwargs) a.kw.emplace_back(k, eval(*x, s));
    return a;
  }
  Value call_macro(const Stmt& m, Scope* closure, Args& args, const Value& caller);
  Value make_loop(const std::vector<Value>& items, size_t i);
  void add_globals(Scope& g);

  std::deque<Scope> scopes_;
  int depth_ = 0;
  int64_t iterations_ = 0;
  const std::string* block_value_ = nullptr;  // the rendered body a block's filters apply to
};

namespace {

// ---- string methods (the subset of str that templates call) ----

size_t cp_index(const std::string& s, size_t byte) {
  return static_cast<size_t>(cp_count(std::string_view(s).substr(0, byte)));
}

Value py_split(Renderer& r, const std::string& s, const Value& sep_v, int64_t maxsplit, bool from_right) {
  std::vector<std::string> parts;
  if (sep_v.none() || sep_v.undefined()) {
    auto cps = decode(s);
    std::vector<std::pair<size_t, size_t>> words;  // [from, to) in code points
    size_t i = 0;
    while (i < cps.size()) {
      while (i < cps.size() && py_isspace(cps[i])) ++i;
      if (i == cps.size()) break;
      size_t j = i;
      while (j < cps.size() && !py_isspace(cps[j])) ++j;
      words.emplace_back(i, j);
      i = j;
    }
    if (maxsplit >= 0 && words.size() > static_cast<size_t>(maxsplit) + 0) {
      const size_t keep = static_cast<size_t>(maxsplit);
      std::vector<std::pair<size_t, size_t>> merged;
      if (!from_right) {
        for (size_t k = 0; k < keep; ++k) merged.push_back(words[k]);
        size_t end = cps.size();
        while (end > words[keep].first && py_isspace(cps[end - 1])) --end;
        merged.emplace_back(words[keep].first, end);
      } else {
        const size_t n = words.size();
        size_t begin = 0;
        while (begin < words[n - keep - 1].second && py_isspace(cps[begin])) ++begin;
        merged.emplace_back(begin, words[n - keep - 1].second);
        for (size_t k = n - keep; k < n; ++k) merged.push_back(words[k]);
      }
      words = std::move(merged);
    }
    for (auto [a, b] : words) parts.push_back(encode(cps, a, b));
  } else {
    const std::string& sep = need_str(sep_v, "split separator");
    if (sep.empty()) fault("split: empty separator");
    if (!from_right) {
      size_t start = 0;
      for (int64_t n = 0; maxsplit < 0 || n < maxsplit; ++n) {
        const size_t at = s.find(sep, start);
        if (at == std::string::npos) break;
        parts.push_back(s.substr(start, at - start));
        start = at + sep.size();
      }
      parts.push_back(s.substr(start));
    } else {
      size_t end = s.size();
      std::vector<std::string> rev;
      for (int64_t n = 0; maxsplit < 0 || n < maxsplit; ++n) {
        if (end < sep.size()) break;
        const size_t at = s.rfind(sep, end - sep.size());
        if (at == std::string::npos) break;
        rev.push_back(s.substr(at + sep.size(), end - at - sep.size()));
        end = at;
      }
      rev.push_back(s.substr(0, end));
      parts.assign(rev.rbegin(), rev.rend());
    }
  }
  r.check_items(static_cast<int64_t>(parts.size()));
  auto l = make_list();
  for (auto& p : parts) l->items.emplace_back(std::move(p));
  return l;
}

std::string py_replace(Renderer& r, const std::string& s, const std::string& old, const std::string& with,
                       int64_t count) {
  std::string out;
  if (old.empty()) {
    auto cps = decode(s);
    int64_t n = 0;
    for (size_t i = 0; i <= cps.size(); ++i) {
      if (count < 0 || n < count) {
        out += with;
        ++n;
      }
      if (i < cps.size()) encode(cps[i], out);
      r.check_string(out.size());
    }
    return out;
  }
  size_t start = 0;
  for (int64_t n = 0; count < 0 || n < count; ++n) {
    const size_t at = s.find(old, start);
    if (at == std::string::npos) break;
    out.append(s, start, at - start);
    out += with;
    r.check_string(out.size());
    start = at + old.size();
  }
  out.append(s, start);
  r.check_string(out.size());
  return out;
}

// str.title(): a letter after a non-letter is upper-cased, every other letter lower-cased.
std::string py_title(const std::string& s) {
  std::string out;
  bool prev_cased = false;
  for (char32_t c : decode(s)) {
    const bool cased = ascii_alpha(c);
    encode(cased ? (prev_cased ? to_lower(c) : to_upper(c)) : c, out);
    prev_cased = cased;
  }
  return out;
}
std::string py_capitalize(const std::string& s) {
  std::string out;
  bool first = true;
  for (char32_t c : decode(s)) {
    encode(first ? to_upper(c) : to_lower(c), out);
    first = false;
  }
  return out;
}

Value prefix_test(const std::string& s, const Value& what, bool suffix) {
  auto one = [&](const Value& p) {
    const std::string& x = need_str(p, suffix ? "endswith's argument" : "startswith's argument");
    return s.size() >= x.size() &&
           (suffix ? s.compare(s.size() - x.size(), x.size(), x) == 0 : s.compare(0, x.size(), x) == 0);
  };
  if (what.is_list() && what.list()->kind == Seq::Tuple) {
    for (const Value& p : what.list()->items)
      if (one(p)) return true;
    return false;
  }
  return one(what);
}

std::string pad(const std::string& s, int64_t width, const std::string& fill,
                int where) {  // -1 ljust, 0 center, 1 rjust
  const int64_t len = cp_count(s);
  if (width <= len) return s;
  if (cp_count(fill) != 1) fault("the fill character must be exactly one character long");
  const int64_t total = width - len;
  int64_t left = where < 0 ? 0 : where > 0 ? total : total / 2 + (total & width & 1);
  std::string out;
  for (int64_t i = 0; i < left; ++i) out += fill;
  out += s;
  for (int64_t i = 0; i < total - left; ++i) out += fill;
  return out;
}

// str.format with "{}", "{0}" and "{name}" fields (no format specs or conversions).
std::string py_format(Renderer& r, const std::string& s, const Args& a) {
  std::string out;
  size_t auto_index = 0;
  for (size_t i = 0; i < s.size(); ++i) {
    const char c = s[i];
    if (c == '}') {
      if (i + 1 < s.size() && s[i + 1] == '}')
        ++i;
      else
        fault("format: single '}' encountered in format string");
      out.push_back('}');
      continue;
    }
    if (c != '{') {
      out.push_back(c);
      continue;
    }
    if (i + 1 < s.size() && s[i + 1] == '{') {
      out.push_back('{');
      ++i;
      continue;
    }
    const size_t end = s.find('}', i);
    if (end == std::string::npos) fault("format: single '{' encountered in format string");
    const std::string field = s.substr(i + 1, end - i - 1);
    if (field.find_first_of(":!.[") != std::string::npos)
      fault("format: format specs, conversions and attribute fields are not supported");
    const Value* v = nullptr;
    if (field.empty() ||
        std::all_of(field.begin(), field.end(), [](char d) { return d >= '0' && d <= '9'; })) {
      const size_t idx = field.empty() ? auto_index++ : std::stoul(field);
      if (idx >= a.pos.size()) fault(fmt::format("format: replacement index {} out of range", idx));
      v = &a.pos[idx];
    } else {
      for (const auto& kv : a.kw)
        if (kv.first == field) v = &kv.second;
      if (!v) fault(fmt::format("format: no argument named '{}'", field));
    }
    out += r.to_str(*v);
    r.check_string(out.size());
    i = end;
  }
  return out;
}

Value str_method(Renderer& r, const std::string& s, const std::string& name, Args& a) {
  auto opt_str = [&](size_t i, const char* n) -> std::optional<std::string> {
    const Value v = arg(a, i, n);
    if (v.undefined() || v.none()) return std::nullopt;
    return need_str(v, fmt::format("{}'s argument", name));
  };
  if (name == "strip" || name == "lstrip" || name == "rstrip") {
    check_args(a, name, {"chars"});
    return py_strip(s, opt_str(0, "chars"), name != "rstrip", name != "lstrip");
  }
  if (name == "split" || name == "rsplit") {
    check_args(a, name, {"sep", "maxsplit"});
    return py_split(r, s, arg(a, 0, "sep"), need_int(arg(a, 1, "maxsplit", -1), "maxsplit"),
                    name == "rsplit");
  }
  if (name == "splitlines") {
    check_args(a, name, {});
    auto l = make_list();
    for (auto& line : splitlines(s)) l->items.emplace_back(std::move(line));
    return l;
  }
  if (name == "startswith" || name == "endswith") {
    check_args(a, name, {"prefix"});
    return prefix_test(s, need_arg(a, 0, "prefix", name), name == "endswith");
  }
  if (name == "upper") return upper(s);
  if (name == "lower" || name == "casefold") return lower(s);
  if (name == "title") return py_title(s);
  if (name == "capitalize") return py_capitalize(s);
  if (name == "swapcase") {
    std::string out = s;
    for (char& c : out)
      c = static_cast<char>(std::isupper(static_cast<unsigned char>(c))   ? c + 32
                            : std::islower(static_cast<unsigned char>(c)) ? c - 32
                                                                          : c);
    return out;
  }
  if (name == "replace") {
    check_args(a, name, {"old", "new", "count"});
    return py_replace(r, s, need_str(need_arg(a, 0, "old", name), "replace's old"),
                      need_str(need_arg(a, 1, "new", name), "replace's new"),
                      need_int(arg(a, 2, "count", -1), "count"));
  }
  if (name == "find" || name == "rfind" || name == "index" || name == "rindex") {
    check_args(a, name, {"sub"});
    const std::string sub = need_str(need_arg(a, 0, "sub", name), "the substring");
    const size_t at = name[0] == 'r' ? s.rfind(sub) : s.find(sub);
    if (at == std::string::npos) {
      if (name.find("index") != std::string::npos) fault("substring not found");
      return -1;
    }
    return static_cast<int64_t>(cp_index(s, at));
  }
  if (name == "count") {
    check_args(a, name, {"sub"});
    const std::string sub = need_str(need_arg(a, 0, "sub", name), "the substring");
    if (sub.empty()) return cp_count(s) + 1;
    int64_t n = 0;
    for (size_t at = s.find(sub); at != std::string::npos; at = s.find(sub, at + sub.size())) ++n;
    return n;
  }
  if (name == "join") {
    check_args(a, name, {"iterable"});
    std::string out;
    size_t i = 0;
    for (const Value& item : r.iterate(arg(a, 0, "iterable"))) {
      if (!item.is_str())
        fault(fmt::format("join: sequence item {}: expected str instance, {} found", i, type_name(item)));
      if (i++) out += s;
      out += item.str();
      r.check_string(out.size());
    }
    return out;
  }
  if (name == "format") return py_format(r, s, a);
  if (name == "removeprefix" || name == "removesuffix") {
    const std::string x = need_str(arg(a, 0, "fix"), name);
    if (name == "removeprefix") return s.compare(0, x.size(), x) == 0 ? s.substr(x.size()) : s;
    return s.size() >= x.size() && s.compare(s.size() - x.size(), x.size(), x) == 0
               ? s.substr(0, s.size() - x.size())
               : s;
  }
  if (name == "center" || name == "ljust" || name == "rjust") {
    const int64_t width = need_int(arg(a, 0, "width"), "width");
    r.check_string(static_cast<size_t>(std::max<int64_t>(width, 0)));
    const Value fill = arg(a, 1, "fillchar", " ");
    return pad(s, width, need_str(fill, "fillchar"), name == "center" ? 0 : name == "ljust" ? -1 : 1);
  }
  if (name == "zfill") {
    const int64_t width = need_int(arg(a, 0, "width"), "width");
    r.check_string(static_cast<size_t>(std::max<int64_t>(width, 0)));
    const int64_t len = cp_count(s);
    if (width <= len) return s;
    const bool sign = !s.empty() && (s[0] == '-' || s[0] == '+');
    return (sign ? s.substr(0, 1) : "") + std::string(width - len, '0') + (sign ? s.substr(1) : s);
  }
  if (name == "partition" || name == "rpartition") {
    const std::string sep = need_str(need_arg(a, 0, "sep", name), "sep");
    if (sep.empty()) fault("partition: empty separator");
    const size_t at = name == "partition" ? s.find(sep) : s.rfind(sep);
    std::vector<Value> parts;
    if (at == std::string::npos) {
      parts = name == "partition" ? std::vector<Value>{Value(s), Value(""), Value("")}
                                  : std::vector<Value>{Value(""), Value(""), Value(s)};
    } else {
      parts = {Value(s.substr(0, at)), Value(sep), Value(s.substr(at + sep.size()))};
    }
    return make_list(std::move(parts), Seq::Tuple);
  }
  auto all = [&](auto pred) {
    auto cps = decode(s);
    return !cps.empty() && std::all_of(cps.begin(), cps.end(), pred);
  };
  if (name == "isdigit" || name == "isdecimal" || name == "isnumeric") return all(ascii_digit);
  if (name == "isalpha") return all(ascii_alpha);
  if (name == "isalnum") return all([](char32_t c) { return ascii_alpha(c) || ascii_digit(c); });
  if (name == "isspace") return all(py_isspace);
  if (name == "islower" || name == "isupper") {
    bool cased = false, ok = true;
    for (char32_t c : decode(s)) {
      if (!ascii_alpha(c)) continue;
      cased = true;
      if ((name == "islower") != (c >= 'a' && c <= 'z')) ok = false;
    }
    return cased && ok;
  }
  fault(fmt::format("str.{}() is not supported", name));
}

const char* const kStrMethods[] = {
    "strip",       "lstrip",       "rstrip",       "split",     "rsplit",     "splitlines", "startswith",
    "endswith",    "upper",        "lower",        "casefold",  "title",      "capitalize", "swapcase",
    "replace",     "find",         "rfind",        "index",     "rindex",     "count",      "join",
    "format",      "removeprefix", "removesuffix", "center",    "ljust",      "rjust",      "zfill",
    "partition",   "rpartition",   "isdigit",      "isdecimal", "isnumeric",  "isalpha",    "isalnum",
    "isspace",     "islower",      "isupper",      "encode",    "expandtabs", "format_map", "isidentifier",
    "isprintable", "istitle",      "isascii",      "maketrans", "translate"};

bool is_str_method(const std::string& name) {
  for (const char* m : kStrMethods)
    if (name == m) return true;
  return false;
}

}  // namespace

// ---- attribute and item access, as the sandbox's getattr and getitem ----

Value Renderer::getattr(const Value& obj, const std::string& name) const {
  if (obj.undefined()) undefined_fault(obj);
  auto bound = [&](auto method) -> Value {
    Value self = obj;
    return make_func(name, [self, name, method](Renderer& r, Args& a) { return method(r, self, name, a); });
  };
  if (obj.is_str()) {
    if (is_str_method(name))
      return bound([](Renderer& r, const Value& self, const std::string& n, Args& a) {
        return str_method(r, self.str(), n, a);
      });
    return Undefined{fmt::format("'str object' has no attribute '{}'", name)};
  }
  if (obj.is_dict()) {
    const DictObj& d = *obj.dict();
    if (d.kind == Obj::Dict) {
      if (name == "items" || name == "keys" || name == "values" || name == "get")
        return bound([](Renderer& r, const Value& self, const std::string& n, Args& a) -> Value {
          const DictObj& dict = *self.dict();
          if (n == "get") {
            check_args(a, "get", {"key", "default"});
            const Value key = arg(a, 0, "key");
            const Value* v = key.is_str() ? dict.find(key.str()) : nullptr;
            return v ? *v : arg(a, 1, "default", None{});
          }
          check_args(a, n, {});
          r.check_items(0);
          auto l = make_list();
          for (const auto& [k, v] : dict.items)
            l->items.push_back(n == "items" ? tuple2(k, v) : n == "keys" ? Value(k) : v);
          return l;
        });
      if (name == "pop" || name == "popitem" || name == "setdefault" || name == "update" || name == "clear")
        fault(fmt::format("access to attribute '{}' of 'dict' object is unsafe", name));
    }
    if (const Value* v = d.find(name)) return *v;
    return Undefined{fmt::format("'{} object' has no attribute '{}'", type_name(obj), name)};
  }
  if (obj.is_list() && obj.list()->kind != Seq::Generator) {
    if (name == "index" || name == "count")
      return bound([](Renderer& r, const Value& self, const std::string& n, Args& a) -> Value {
        check_args(a, n, {"value"});
        const Value x = arg(a, 0, "value");
        int64_t i = 0, hits = 0;
        for (const Value& item : self.list()->items) {
          if (r.eq(item, x)) {
            if (n == "index") return i;
            ++hits;
          }
          ++i;
        }
        if (n == "index") fault(fmt::format("{} is not in list", r.to_repr(x)));
        return hits;
      });
    if (name == "append" || name == "extend" || name == "insert" || name == "pop" || name == "remove" ||
        name == "sort" || name == "reverse" || name == "clear")
      fault(fmt::format("access to attribute '{}' of '{}' object is unsafe", name, type_name(obj)));
  }
  return Undefined{fmt::format("'{} object' has no attribute '{}'", type_name(obj), name)};
}

Value Renderer::getitem(const Value& obj, const Value& key) const {
  if (obj.undefined()) undefined_fault(obj);
  int64_t i;
  if (obj.is_list() && obj.list()->kind != Seq::Generator && int_of(key, i)) {
    const auto& items = obj.list()->items;
    const int64_t n = static_cast<int64_t>(items.size());
    if (i < 0) i += n;
    if (i >= 0 && i < n) return items[static_cast<size_t>(i)];
    return Undefined{fmt::format("{} object has no element {}", type_name(obj), to_repr(key))};
  }
  if (obj.is_str() && int_of(key, i)) {
    auto cps = decode(obj.str());
    const int64_t n = static_cast<int64_t>(cps.size());
    if (i < 0) i += n;
    if (i >= 0 && i < n) return encode(cps, static_cast<size_t>(i), static_cast<size_t>(i) + 1);
    return Undefined{fmt::format("str object has no element {}", to_repr(key))};
  }
  if (obj.is_dict() && key.is_str()) {
    if (const Value* v = obj.dict()->find(key.str())) return *v;
  }
  if (key.is_str()) return getattr(obj, key.str());
  return Undefined{fmt::format("{} object has no element {}", type_name(obj), to_repr(key))};
}

Value Renderer::slice(const Value& obj, const Value& start_v, const Value& stop_v,
                      const Value& step_v) const {
  if (obj.undefined()) undefined_fault(obj);
  auto bound = [](const Value& v, const char* what) -> std::optional<int64_t> {
    if (v.undefined()) undefined_fault(v);
    if (v.none()) return std::nullopt;
    return need_int(v, what);
  };
  const int64_t step = bound(step_v, "slice step").value_or(1);
  if (step == 0) fault("slice step cannot be zero");
  auto pick = [&](int64_t n) {
    auto clamp = [&](std::optional<int64_t> b, bool is_start) -> int64_t {
      if (!b) return step > 0 ? (is_start ? 0 : n) : (is_start ? n - 1 : -1);
      int64_t x = *b;
      if (x < 0) x = std::max<int64_t>(x + n, step > 0 ? 0 : -1);
      return std::min<int64_t>(x, step > 0 ? n : n - 1);
    };
    const int64_t a = clamp(bound(start_v, "slice start"), true),
                  b = clamp(bound(stop_v, "slice stop"), false);
    std::vector<size_t> idx;
    if (step > 0)
      for (int64_t k = a; k < b; k += step) idx.push_back(static_cast<size_t>(k));
    else
      for (int64_t k = a; k > b; k += step) idx.push_back(static_cast<size_t>(k));
    return idx;
  };
  if (obj.is_str()) {
    auto cps = decode(obj.str());
    std::string out;
    for (size_t k : pick(static_cast<int64_t>(cps.size()))) encode(cps[k], out);
    return out;
  }
  if (obj.is_list() && obj.list()->kind != Seq::Generator) {
    const auto& items = obj.list()->items;
    auto l = make_list({}, obj.list()->kind);
    for (size_t k : pick(static_cast<int64_t>(items.size()))) l->items.push_back(items[k]);
    return l;
  }
  fault(fmt::format("'{}' object is not subscriptable", type_name(obj)));
}

// ---- operators ----

Value Renderer::binop(const std::string& op, const Value& a, const Value& b) const {
  if (op == "~") {
    std::string s = to_str(a);
    s += to_str(b);
    check_string(s.size());
    return s;
  }
  if (a.undefined()) undefined_fault(a);
  if (b.undefined()) undefined_fault(b);
  auto unsupported = [&]() -> Value {
    fault(fmt::format("unsupported operand type(s) for {}: '{}' and '{}'", op, type_name(a), type_name(b)));
  };
  int64_t x = 0, y = 0;
  const bool ints = int_of(a, x) && int_of(b, y);
  if (is_number(a) && is_number(b)) {
    const double fx = float_of(a), fy = float_of(b);
    int64_t r;
    if (op == "+") {
      if (!ints) return fx + fy;
      if (__builtin_add_overflow(x, y, &r)) fault("integer overflow");
      return r;
    }
    if (op == "-") {
      if (!ints) return fx - fy;
      if (__builtin_sub_overflow(x, y, &r)) fault("integer overflow");
      return r;
    }
    if (op == "*") {
      if (!ints) return fx * fy;
      if (__builtin_mul_overflow(x, y, &r)) fault("integer overflow");
      return r;
    }
    if (op == "/") {
      if (fy == 0) fault("division by zero");
      return fx / fy;
    }
    if (op == "//" || op == "%") {
      if (ints) {
        if (y == 0) fault("integer division or modulo by zero");
        return op == "//" ? floor_div(x, y) : floor_mod(x, y);
      }
      if (fy == 0) fault("float division or modulo by zero");
      double div, mod;
      float_divmod(fx, fy, div, mod);
      return op == "//" ? div : mod;
    }
    if (op == "**") {
      if (ints && y >= 0) {
        int64_t result = 1, base = x;
        for (int64_t e = y; e > 0; e >>= 1) {
          if ((e & 1) && __builtin_mul_overflow(result, base, &result)) fault("integer overflow");
          if (e > 1 && __builtin_mul_overflow(base, base, &base)) fault("integer overflow");
        }
        return result;
      }
      if (fx == 0 && fy < 0) fault("0.0 cannot be raised to a negative power");
      return std::pow(fx, fy);
    }
    return unsupported();
  }
  if (op == "+") {
    if (a.is_str() && b.is_str()) {
      check_string(a.str().size() + b.str().size());
      return a.str() + b.str();
    }
    if (a.is_list() && b.is_list() && a.list()->kind == b.list()->kind && a.list()->kind != Seq::Generator) {
      check_items(static_cast<int64_t>(a.list()->items.size() + b.list()->items.size()));
      auto l = make_list(a.list()->items, a.list()->kind);
      l->items.insert(l->items.end(), b.list()->items.begin(), b.list()->items.end());
      return l;
    }
    return unsupported();
  }
  if (op == "*") {
    const Value& seq = a.is_str() || a.is_list() ? a : b;
    int64_t n;
    if (!int_of(&seq == &a ? b : a, n) ||
        !(seq.is_str() || (seq.is_list() && seq.list()->kind != Seq::Generator)))
      return unsupported();
    n = std::max<int64_t>(n, 0);
    if (seq.is_str()) {
      if (n > 0 && seq.str().size() > limits.max_output_bytes / static_cast<size_t>(n))
        check_string(SIZE_MAX);
      std::string out;
      for (int64_t k = 0; k < n; ++k) out += seq.str();
      return out;
    }
    const auto& items = seq.list()->items;
    if (n > 0 && items.size() > static_cast<size_t>(limits.max_loop_iterations / n)) check_items(INT64_MAX);
    auto l = make_list({}, seq.list()->kind);
    for (int64_t k = 0; k < n; ++k) l->items.insert(l->items.end(), items.begin(), items.end());
    return l;
  }
  if (op == "%" && a.is_str()) fault("printf-style formatting with % is not supported; use ~ or |format");
  return unsupported();
}

// ---- expressions ----

Value Renderer::eval(const Expr& e, Scope& s) {
  try {
    Depth depth(*this);
    return eval_inner(e, s);
  } catch (Fault& f) {
    throw Located{e.line, e.col, std::move(f.message)};
  }
}

Value Renderer::eval_inner(const Expr& e, Scope& s) {
  switch (e.kind) {
    case Ex::Literal:
      return e.value;
    case Ex::Name:
      return lookup(s, e.name);
    case Ex::BlockValue:
      return block_value_ ? Value(*block_value_) : Value();
    case Ex::List:
    case Ex::Tuple: {
      auto l = make_list({}, e.kind == Ex::Tuple ? Seq::Tuple : Seq::List);
      for (const auto& k : e.kids) l->items.push_back(eval(*k, s));
      return l;
    }
    case Ex::Dict: {
      auto d = make_dict();
      for (size_t i = 0; i + 1 < e.kids.size(); i += 2) {
        Value k = eval(*e.kids[i], s);
        if (!k.is_str()) fault(fmt::format("dict keys must be strings here, not {}", type_name(k)));
        d->set(k.str(), eval(*e.kids[i + 1], s));
      }
      return d;
    }
    case Ex::Attr:
      return getattr(eval(*e.kids[0], s), e.name);
    case Ex::Item: {
      Value obj = eval(*e.kids[0], s);
      return getitem(obj, eval(*e.kids[1], s));
    }
    case Ex::Slice: {
      Value obj = eval(*e.kids[0], s);
      auto opt = [&](size_t i) { return e.kids[i] ? eval(*e.kids[i], s) : Value(None{}); };
      Value a = opt(1), b = opt(2), c = opt(3);
      return slice(obj, a, b, c);
    }
    case Ex::Call: {
      Value fn = eval(*e.kids[0], s);
      Args args = eval_args(e, 1, s);
      return call(fn, args);
    }
    case Ex::Filter: {
      Value v = eval(*e.kids[0], s);
      Args args = eval_args(e, 1, s);
      return call_filter(e.name, v, args);
    }
    case Ex::Test: {
      Value v = eval(*e.kids[0], s);
      Args args = eval_args(e, 1, s);
      return call_test(e.name, v, args) != e.negated;
    }
    case Ex::Neg:
    case Ex::Pos: {
      Value v = eval(*e.kids[0], s);
      if (v.undefined()) undefined_fault(v);
      if (!is_number(v))
        fault(
            fmt::format("bad operand type for unary {}: '{}'", e.kind == Ex::Neg ? '-' : '+', type_name(v)));
      if (e.kind == Ex::Pos) return v.is_bool() ? Value(int64_t{std::get<bool>(v.v)}) : v;
      if (v.is_float()) return -std::get<double>(v.v);
      int64_t i;
      int_of(v, i);
      if (i == INT64_MIN) fault("integer overflow");
      return -i;
    }
    case Ex::Not:
      return !truthy(eval(*e.kids[0], s));
    case Ex::And: {
      Value a = eval(*e.kids[0], s);
      return truthy(a) ? eval(*e.kids[1], s) : a;
    }
    case Ex::Or: {
      Value a = eval(*e.kids[0], s);
      return truthy(a) ? a : eval(*e.kids[1], s);
    }
    case Ex::Binary: {
      Value a = eval(*e.kids[0], s);
      Value b = eval(*e.kids[1], s);
      return binop(e.name, a, b);
    }
    case Ex::Compare: {
      Value left = eval(*e.kids[0], s);
      for (size_t i = 0; i < e.ops.size(); ++i) {
        Value right = eval(*e.kids[i + 1], s);
        const std::string& op = e.ops[i];
        bool ok;
        if (op == "==")
          ok = eq(left, right);
        else if (op == "!=")
          ok = !eq(left, right);
        else if (op == "<")
          ok = lt(left, right);
        else if (op == ">")
          ok = lt(right, left);
        else if (op == "<=")
          ok = lt(left, right) || eq(left, right);
        else if (op == ">=")
          ok = lt(right, left) || eq(left, right);
        else if (op == "in")
          ok = contains(right, left);
        else
          ok = !contains(right, left);
        if (!ok) return false;
        left = std::move(right);
      }
      return true;
    }
    case Ex::Cond:
      if (truthy(eval(*e.kids[1], s))) return eval(*e.kids[0], s);
      return e.kids[2] ? eval(*e.kids[2], s)
                       : Value(Undefined{"the condition was false and there is no else"});
  }
  return Value();
}

// ---- statements ----

void Renderer::assign(const Expr& target, Value v, Scope& s) {
  if (target.kind == Ex::Name) {
    s.vars[target.name] = std::move(v);
    return;
  }
  if (target.kind == Ex::Attr) {
    Value ns = lookup(s, target.kids[0]->name);
    if (!ns.is_dict() || ns.dict()->kind != Obj::Namespace)
      fault(fmt::format("cannot assign attribute on non-namespace object '{}'", target.kids[0]->name));
    if (reaches(v, ns.dict().get(), 0)) fault("a namespace cannot hold itself");
    ns.dict()->set(target.name, std::move(v));
    return;
  }
  std::vector<Value> items = iterate(v);
  if (items.size() != target.kids.size())
    fault(fmt::format("{} values to unpack (expected {}, got {})",
                      items.size() < target.kids.size() ? "not enough" : "too many", target.kids.size(),
                      items.size()));
  for (size_t i = 0; i < items.size(); ++i) s.vars[target.kids[i]->name] = std::move(items[i]);
}

Value Renderer::make_loop(const std::vector<Value>& items, size_t i) {
  const auto n = static_cast<int64_t>(items.size());
  const auto k = static_cast<int64_t>(i);
  auto d = make_dict(Obj::Loop);
  d->items.reserve(12);
  d->set("index0", k);
  d->set("index", k + 1);
  d->set("revindex", n - k);
  d->set("revindex0", n - k - 1);
  d->set("first", k == 0);
  d->set("last", k == n - 1);
  d->set("length", n);
  d->set("depth", 1);
  d->set("depth0", 0);
  if (i > 0) d->set("previtem", items[i - 1]);
  if (k + 1 < n) d->set("nextitem", items[i + 1]);
  d->set("cycle", make_func("cycle", [k](Renderer&, Args& a) -> Value {
           if (a.pos.empty()) fault("loop.cycle() needs at least one argument");
           return a.pos[static_cast<size_t>(k) % a.pos.size()];
         }));
  return d;
}

Value Renderer::call_macro(const Stmt& m, Scope* closure, Args& args, const Value& caller) {
  Scope& s = new_scope(closure);
  const std::string what = m.kind == St::Macro ? fmt::format("macro '{}'", m.text) : std::string("caller");
  for (size_t i = 0; i < m.params.size(); ++i) {
    const std::string& p = m.params[i];
    const Value* given = i < args.pos.size() ? &args.pos[i] : nullptr;
    for (const auto& kv : args.kw)
      if (kv.first == p) {
        if (given) fault(fmt::format("{} got multiple values for argument '{}'", what, p));
        given = &kv.second;
      }
    if (given)
      s.vars[p] = *given;
    else if (m.defaults[i])
      s.vars[p] = eval(*m.defaults[i], s);
    else
      s.vars[p] = Undefined{fmt::format("parameter '{}' was not provided", p)};
  }
  auto varargs = make_list({}, Seq::Tuple);
  for (size_t i = m.params.size(); i < args.pos.size(); ++i) varargs->items.push_back(args.pos[i]);
  auto kwargs = make_dict();
  for (const auto& [k, v] : args.kw)
    if (std::find(m.params.begin(), m.params.end(), k) == m.params.end()) kwargs->set(k, v);
  s.vars["varargs"] = varargs;
  s.vars["kwargs"] = kwargs;
  if (!caller.undefined()) s.vars["caller"] = caller;
  std::string out;
  exec(m.bodies[0], s, out);
  return out;
}

Renderer::Flow Renderer::exec(const Body& body, Scope& s, std::string& out) {
  for (const auto& st : body) {
    Flow flow;
    try {
      Depth depth(*this);
      flow = exec_stmt(*st, s, out);
    } catch (Fault& f) {
      throw Located{st->line, st->col, std::move(f.message)};
    }
    if (flow != Flow::Normal) return flow;
  }
  return Flow::Normal;
}

Renderer::Flow Renderer::exec_stmt(const Stmt& st, Scope& s, std::string& out) {
  switch (st.kind) {
    case St::Text:
      emit(out, st.text);
      return Flow::Normal;
    case St::Print: {
      Value v = eval(*st.exprs[0], s);
      if (v.is_str())
        emit(out, v.str());
      else
        emit(out, to_str(v));
      return Flow::Normal;
    }
    case St::If:
      for (size_t i = 0; i < st.exprs.size(); ++i)
        if (truthy(eval(*st.exprs[i], s))) return exec(st.bodies[i], s, out);
      if (st.bodies.size() > st.exprs.size()) return exec(st.bodies.back(), s, out);
      return Flow::Normal;
    case St::For: {
      std::vector<Value> items = iterate(eval(*st.exprs[0], s));
      Scope& scope = new_scope(&s);
      if (st.exprs[1]) {  // `for x in xs if cond`: loop.* counts the items kept
        std::vector<Value> kept;
        for (Value& item : items) {
          count_iteration();
          scope.vars.clear();
          assign(*st.target, item, scope);
          if (truthy(eval(*st.exprs[1], scope))) kept.push_back(std::move(item));
        }
        items = std::move(kept);
      }
      if (items.empty()) {
        scope.vars.clear();
        exec(st.bodies[1], scope, out);
        return Flow::Normal;
      }
      for (size_t i = 0; i < items.size(); ++i) {
        count_iteration();
        scope.vars.clear();  // each iteration starts afresh: a {% set %} inside does not carry over
        assign(*st.target, items[i], scope);
        scope.vars["loop"] = make_loop(items, i);
        if (exec(st.bodies[0], scope, out) == Flow::Break) break;
      }
      return Flow::Normal;
    }
    case St::Set:
      assign(*st.target, eval(*st.exprs[0], s), s);
      return Flow::Normal;
    case St::SetBlock:
    case St::FilterBlock: {
      std::string body;
      Scope& scope = new_scope(&s);
      exec(st.bodies[0], scope, body);
      Value v = body;
      if (st.exprs[0]) {
        const std::string* saved = block_value_;
        block_value_ = &body;
        v = eval(*st.exprs[0], s);
        block_value_ = saved;
      }
      if (st.kind == St::SetBlock)
        assign(*st.target, std::move(v), s);
      else
        emit(out, to_str(v));
      return Flow::Normal;
    }
    case St::Macro: {
      const Stmt* m = &st;
      Scope* closure = &s;
      s.vars[st.text] = make_func(st.text, [m, closure](Renderer& r, Args& a) {
        Value caller;
        for (auto it = a.kw.begin(); it != a.kw.end(); ++it)
          if (it->first == "caller") {
            caller = it->second;
            a.kw.erase(it);
            break;
          }
        return r.call_macro(*m, closure, a, caller);
      });
      return Flow::Normal;
    }
    case St::CallBlock: {
      const Stmt* m = &st;
      Scope* closure = &s;
      Value caller = make_func(
          "caller", [m, closure](Renderer& r, Args& a) { return r.call_macro(*m, closure, a, Value()); });
      const Expr& call_expr = *st.exprs[0];
      Value fn = eval(*call_expr.kids[0], s);
      Args args = eval_args(call_expr, 1, s);
      args.kw.emplace_back("caller", caller);
      emit(out, to_str(call(fn, args)));
      return Flow::Normal;
    }
    case St::With: {
      Scope& scope = new_scope(&s);
      for (size_t i = 0; i < st.params.size(); ++i) scope.vars[st.params[i]] = eval(*st.exprs[i], s);
      return exec(st.bodies[0], scope, out);
    }
    case St::Break:
      return Flow::Break;
    case St::Continue:
      return Flow::Continue;
    case St::Body:
      return exec(st.bodies[0], s, out);
  }
  return Flow::Normal;
}

// ---- globals ----

void Renderer::add_globals(Scope& g) {
  // jinja's sandbox refuses ranges longer than this (MAX_RANGE).
  static constexpr int64_t kMaxRange = 100000;
  g.vars["range"] = make_func("range", [](Renderer&, Args& a) -> Value {
    if (!a.kw.empty()) fault("range() takes no keyword arguments");
    if (a.pos.empty() || a.pos.size() > 3)
      fault(fmt::format("range expected 1 to 3 arguments, got {}", a.pos.size()));
    int64_t start = 0, stop, step = 1;
    if (a.pos.size() == 1) {
      stop = need_int(a.pos[0], "range's argument");
    } else {
      start = need_int(a.pos[0], "range's start");
      stop = need_int(a.pos[1], "range's stop");
      if (a.pos.size() == 3) step = need_int(a.pos[2], "range's step");
    }
    if (step == 0) fault("range() arg 3 must not be zero");
    const double n =
        step > 0
            ? std::ceil((static_cast<double>(stop) - static_cast<double>(start)) / static_cast<double>(step))
            : std::ceil((static_cast<double>(start) - static_cast<double>(stop)) /
                        static_cast<double>(-step));
    if (n > kMaxRange)
      fault(fmt::format("Range too big. The sandbox blocks ranges larger than MAX_RANGE ({}).", kMaxRange));
    auto l = make_list();
    for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) l->items.emplace_back(i);
    return l;
  });
  auto dict_from = [](Renderer& r, Args& a, Obj kind, const char* fn) -> Value {
    if (a.pos.size() > 1) fault(fmt::format("{}() takes at most 1 positional argument", fn));
    auto d = make_dict(kind);
    if (!a.pos.empty()) {
      const Value& init = a.pos[0];
      if (init.undefined()) Renderer::undefined_fault(init);
      if (is_plain_dict(init) || (init.is_dict() && init.dict()->kind == Obj::Namespace)) {
        for (const auto& [k, v] : init.dict()->items) d->set(k, v);
      } else {
        for (const Value& pair : r.iterate(init)) {
          auto kv = r.iterate(pair);
          if (kv.size() != 2 || !kv[0].is_str())
            fault(fmt::format("{}(): expected (str key, value) pairs", fn));
          d->set(kv[0].str(), kv[1]);
        }
      }
    }
    for (const auto& [k, v] : a.kw) d->set(k, v);
    return d;
  };
  g.vars["dict"] =
      make_func("dict", [dict_from](Renderer& r, Args& a) { return dict_from(r, a, Obj::Dict, "dict"); });
  g.vars["namespace"] = make_func("namespace", [dict_from](Renderer& r, Args& a) {
    return dict_from(r, a, Obj::Namespace, "namespace");
  });
  g.vars["raise_exception"] = make_func("raise_exception", [](Renderer& r, Args& a) -> Value {
    check_args(a, "raise_exception", {"message"});
    fault("raise_exception: " + r.to_str(arg(a, 0, "message")));
  });
  g.vars["strftime_now"] = make_func("strftime_now", [](Renderer& r, Args& a) -> Value {
    check_args(a, "strftime_now", {"format"});
    const std::string format = need_str(arg(a, 0, "format"), "strftime_now's format");
    if (format.empty()) return "";
    const std::time_t now = std::time(nullptr);
    std::tm tm{};
    localtime_r(&now, &tm);
    for (size_t size = 256; size <= 65536; size *= 4) {
      std::string buf(size, '\0');
      const size_t n = std::strftime(buf.data(), buf.size(), format.c_str(), &tm);
      if (n > 0) {
        buf.resize(n);
        r.check_string(n);
        return buf;
      }
    }
    return "";
  });
}

std::string Renderer::run(const Body& body, const nlohmann::ordered_json& context) {
  Scope& globals = new_scope(nullptr);
  add_globals(globals);
  Scope& root = new_scope(&globals);
  std::string out;
  try {
    if (!context.is_object()) fault("the context must be a JSON object");
    for (auto it = context.begin(); it != context.end(); ++it)
      root.vars[it.key()] = from_json(it.value(), 0, limits.max_data_depth);
  } catch (Fault& f) {
    throw ValueError(fmt::format("{}: {}", origin, f.message));
  }
  try {
    exec(body, root, out);
  } catch (Located& l) {
    throw ValueError(fmt::format("{}:{}:{}: {}", origin, l.line, l.col, l.message));
  }
  return out;
}

// ================================================================================================
// Filters and tests: jinja2/filters.py and tests.py, with transformers' tojson.
// ================================================================================================

namespace {

Value generator(std::vector<Value> items) { return make_list(std::move(items), Seq::Generator); }

std::function<Value(const Value&)> key_getter(Renderer& r, const Value& attribute, bool ignore_case) {
  std::vector<std::string> paths;
  if (!attribute.undefined() && !attribute.none()) {
    if (attribute.is_int()) {
      paths.push_back(std::to_string(std::get<int64_t>(attribute.v)));
    } else {
      const std::string& a = need_str(attribute, "attribute");
      for (size_t start = 0;;) {  // "a,b": sort by a tuple of attributes
        const size_t comma = a.find(',', start);
        paths.push_back(a.substr(start, comma == std::string::npos ? std::string::npos : comma - start));
        if (comma == std::string::npos) break;
        start = comma + 1;
      }
    }
  }
  return [&r, paths, ignore_case](const Value& item) -> Value {
    auto post = [&](Value v) { return ignore_case && v.is_str() ? Value(lower(v.str())) : v; };
    if (paths.empty()) return post(item);
    if (paths.size() == 1) return post(r.attr_path(item, paths[0]));
    std::vector<Value> key;
    for (const auto& p : paths) key.push_back(post(r.attr_path(item, p)));
    return make_list(std::move(key), Seq::Tuple);
  };
}

std::vector<Value> sorted(Renderer& r, std::vector<Value> items,
                          const std::function<Value(const Value&)>& key, bool reverse) {
  std::vector<std::pair<Value, size_t>> keyed;
  keyed.reserve(items.size());
  for (size_t i = 0; i < items.size(); ++i) keyed.emplace_back(key(items[i]), i);
  std::stable_sort(keyed.begin(), keyed.end(), [&](const auto& a, const auto& b) {
    return reverse ? r.lt(b.first, a.first) : r.lt(a.first, b.first);
  });
  std::vector<Value> out;
  out.reserve(items.size());
  for (const auto& kv : keyed) out.push_back(items[kv.second]);
  return out;
}

// A key for "seen before" in unique(): Python's set equality, where 1 == 1.0 == True.
std::string identity_key(Renderer& r, const Value& v) {
  if (is_number(v)) {
    int64_t i;
    if (int_of(v, i)) return "n" + std::to_string(i);
    const double d = float_of(v);
    if (d == std::floor(d) && std::abs(d) < 9e18) return "n" + std::to_string(static_cast<int64_t>(d));
    return "n" + py_float(d);
  }
  if (v.is_str()) return "s" + v.str();
  return "r" + r.to_repr(v);
}

Value f_default(Renderer&, const Value& v, Args& a) {
  check_args(a, "default", {"default_value", "boolean"});
  const bool boolean = Renderer::truthy(arg(a, 1, "boolean", false));
  if (v.undefined() || (boolean && !Renderer::truthy(v))) return arg(a, 0, "default_value", "");
  return v;
}

Value f_length(Renderer&, const Value& v, Args& a) {
  check_args(a, "length", {});
  if (v.undefined()) return 0;
  if (v.is_str()) return cp_count(v.str());
  if (v.is_list() && v.list()->kind != Seq::Generator) return static_cast<int64_t>(v.list()->items.size());
  if (v.is_dict() && v.dict()->kind != Obj::Namespace) return static_cast<int64_t>(v.dict()->items.size());
  fault(fmt::format("object of type '{}' has no len()", type_name(v)));
}

Value f_tojson(Renderer& r, const Value& v, Args& a) {
  check_args(a, "tojson", {"ensure_ascii", "indent", "separators", "sort_keys"});
  JsonStyle style;
  style.limit = r.limits.max_data_depth;
  style.ensure_ascii = Renderer::truthy(arg(a, 0, "ensure_ascii", false));
  const Value indent = arg(a, 1, "indent", None{});
  if (!indent.none() && !indent.undefined()) {
    if (indent.is_str()) {
      style.indent = indent.str();
    } else {
      const int64_t n = need_int(indent, "tojson's indent");
      style.indent = std::string(static_cast<size_t>(std::clamp<int64_t>(n, 0, 64)), ' ');
    }
    style.item_sep = ",";
  }
  const Value seps = arg(a, 2, "separators", None{});
  if (!seps.none() && !seps.undefined()) {
    auto parts = r.iterate(seps);
    if (parts.size() != 2) fault("tojson: separators must be an (item_separator, key_separator) pair");
    style.item_sep = need_str(parts[0], "item separator");
    style.key_sep = need_str(parts[1], "key separator");
  }
  style.sort_keys = Renderer::truthy(arg(a, 3, "sort_keys", false));
  std::string out;
  json_dump(v, style, out, 0);
  r.check_string(out.size());
  return out;
}

Value f_join(Renderer& r, const Value& v, Args& a) {
  check_args(a, "join", {"d", "attribute"});
  const std::string sep = r.to_str(arg(a, 0, "d", ""));
  auto key = key_getter(r, arg(a, 1, "attribute"), false);
  std::string out;
  bool first = true;
  for (const Value& item : r.iterate(v)) {
    if (!first) out += sep;
    first = false;
    out += r.to_str(key(item));
    r.check_string(out.size());
  }
  return out;
}

Value f_first(Renderer& r, const Value& v, Args& a) {
  check_args(a, "first", {});
  auto items = r.iterate(v);
  if (items.empty()) return Undefined{"No first item, sequence was empty."};
  return items.front();
}
Value f_last(Renderer& r, const Value& v, Args& a) {
  check_args(a, "last", {});
  if (is_seq(v, Seq::Generator)) fault("'generator' object is not reversible");
  auto items = r.iterate(v);
  if (items.empty()) return Undefined{"No last item, sequence was empty."};
  return items.back();
}

Value f_int(Renderer& r, const Value& v, Args& a) {
  check_args(a, "int", {"default", "base"});
  const Value fallback = arg(a, 0, "default", 0);
  const int64_t base = need_int(arg(a, 1, "base", 10), "base");
  int64_t i;
  if (int_of(v, i)) return i;
  if (v.is_float()) {
    const double d = std::get<double>(v.v);
    if (std::isnan(d) || std::isinf(d) || std::abs(d) >= 9.2e18) return fallback;
    return static_cast<int64_t>(d);
  }
  if (v.is_str()) {
    std::string s = py_strip(v.str(), std::nullopt, true, true);
    s.erase(std::remove(s.begin(), s.end(), '_'), s.end());
    const bool negative = !s.empty() && s[0] == '-';
    size_t at = !s.empty() && (s[0] == '+' || s[0] == '-');
    int radix = static_cast<int>(base);
    // Python's int(s, base) takes a 0x / 0o / 0b prefix that matches the base, and base 0 reads it.
    if (s.size() > at + 1 && s[at] == '0') {
      const char p = static_cast<char>(s[at + 1] | 0x20);
      const int prefixed = p == 'x' ? 16 : p == 'o' ? 8 : p == 'b' ? 2 : 0;
      if (prefixed && (radix == 0 || radix == prefixed)) radix = prefixed, at += 2;
    }
    if (radix == 0) radix = 10;
    if (radix >= 2 && radix <= 36 && at < s.size() && s[at] != '-' && s[at] != '+') {
      auto res = std::from_chars(s.data() + at, s.data() + s.size(), i, radix);
      if (res.ec == std::errc() && res.ptr == s.data() + s.size()) return negative ? -i : i;
    }
    char* end = nullptr;
    const double d = std::strtod(s.c_str(), &end);
    if (!s.empty() && end == s.c_str() + s.size() && std::isfinite(d) && std::abs(d) < 9.2e18)
      return static_cast<int64_t>(d);
  }
  (void)r;
  return fallback;
}
Value f_float(Renderer&, const Value& v, Args& a) {
  check_args(a, "float", {"default"});
  if (is_number(v)) return float_of(v);
  if (v.is_str()) {
    const std::string s = py_strip(v.str(), std::nullopt, true, true);
    char* end = nullptr;
    const double d = std::strtod(s.c_str(), &end);
    if (!s.empty() && end == s.c_str() + s.size()) return d;
  }
  return arg(a, 0, "default", 0.0);
}
Value f_abs(Renderer&, const Value& v, Args& a) {
  check_args(a, "abs", {});
  int64_t i;
  if (int_of(v, i)) {
    if (i == INT64_MIN) fault("integer overflow");
    return i < 0 ? -i : i;
  }
  if (v.is_float()) return std::abs(std::get<double>(v.v));
  fault(fmt::format("bad operand type for abs(): '{}'", type_name(v)));
}
Value f_round(Renderer&, const Value& v, Args& a) {
  check_args(a, "round", {"precision", "method"});
  const int64_t precision = need_int(arg(a, 0, "precision", 0), "precision");
  const std::string method = need_str(arg(a, 1, "method", "common"), "method");
  if (!is_number(v)) fault(fmt::format("round: expected a number, not {}", type_name(v)));
  if (method != "common" && method != "floor" && method != "ceil")
    fault("round: method must be 'common', 'ceil' or 'floor'");
  int64_t i;
  if (method == "common" && int_of(v, i) && precision >= 0) return i;  // Python's round(int, n) is the int
  const double x = float_of(v);
  if (method != "common") {
    const double scale = std::pow(10.0, static_cast<double>(precision));
    return (method == "floor" ? std::floor(x * scale) : std::ceil(x * scale)) / scale;
  }
  if (!std::isfinite(x)) return x;
  if (precision > 300) return x;
  if (precision >= 0) {
    // printf rounds the exact binary value half-to-even, as Python's round does.
    const std::string s = fmt::format("{:.{}f}", x, static_cast<int>(precision));
    return std::strtod(s.c_str(), nullptr);
  }
  const double scale = std::pow(10.0, static_cast<double>(-precision));
  return std::nearbyint(x / scale) * scale;
}

Value f_string(Renderer& r, const Value& v, Args& a) {
  check_args(a, "string", {});
  return v.is_str() ? v : Value(r.to_str(v));
}
Value f_list(Renderer& r, const Value& v, Args& a) {
  check_args(a, "list", {});
  return make_list(r.iterate(v));
}
Value f_upper(Renderer& r, const Value& v, Args&) { return upper(r.to_str(v)); }
Value f_lower(Renderer& r, const Value& v, Args&) { return lower(r.to_str(v)); }
Value f_capitalize(Renderer& r, const Value& v, Args&) { return py_capitalize(r.to_str(v)); }
Value f_safe(Renderer&, const Value& v, Args&) { return v; }
Value f_trim(Renderer& r, const Value& v, Args& a) {
  check_args(a, "trim", {"chars"});
  const Value chars = arg(a, 0, "chars", None{});
  std::optional<std::string> set;
  if (!chars.none() && !chars.undefined()) set = need_str(chars, "trim's chars");
  return py_strip(r.to_str(v), set, true, true);
}
// jinja's title: the first letter of each word up, the rest down; words start after - ( [ { < or
// whitespace.
Value f_title(Renderer& r, const Value& v, Args&) {
  std::string out;
  bool start = true;
  for (char32_t c : decode(r.to_str(v))) {
    const bool sep = py_isspace(c) || c == '-' || c == '(' || c == '{' || c == '[' || c == '<';
    encode(sep ? c : start ? to_upper(c) : to_lower(c), out);
    start = sep;
  }
  return out;
}
Value f_replace(Renderer& r, const Value& v, Args& a) {
  check_args(a, "replace", {"old", "new", "count"});
  const Value count = arg(a, 2, "count", None{});
  return py_replace(r, r.to_str(v), r.to_str(need_arg(a, 0, "old", "replace")),
                    r.to_str(need_arg(a, 1, "new", "replace")),
                    count.none() || count.undefined() ? -1 : need_int(count, "count"));
}
Value f_reverse(Renderer& r, const Value& v, Args& a) {
  check_args(a, "reverse", {});
  if (v.is_str()) {
    auto cps = decode(v.str());
    std::reverse(cps.begin(), cps.end());
    return encode(cps);
  }
  if (is_seq(v, Seq::Generator)) fault("'generator' object is not reversible");
  auto items = r.iterate(v);
  std::reverse(items.begin(), items.end());
  return generator(std::move(items));
}
Value f_sort(Renderer& r, const Value& v, Args& a) {
  check_args(a, "sort", {"reverse", "case_sensitive", "attribute"});
  const bool reverse = Renderer::truthy(arg(a, 0, "reverse", false));
  const bool case_sensitive = Renderer::truthy(arg(a, 1, "case_sensitive", false));
  return make_list(sorted(r, r.iterate(v), key_getter(r, arg(a, 2, "attribute"), !case_sensitive), reverse));
}
Value f_unique(Renderer& r, const Value& v, Args& a) {
  check_args(a, "unique", {"case_sensitive", "attribute"});
  auto key = key_getter(r, arg(a, 1, "attribute"), !Renderer::truthy(arg(a, 0, "case_sensitive", false)));
  std::unordered_map<std::string, bool> seen;
  std::vector<Value> out;
  for (const Value& item : r.iterate(v))
    if (seen.emplace(identity_key(r, key(item)), true).second) out.push_back(item);
  return generator(std::move(out));
}
Value minmax(Renderer& r, const Value& v, Args& a, bool want_max) {
  check_args(a, want_max ? "max" : "min", {"case_sensitive", "attribute"});
  auto key = key_getter(r, arg(a, 1, "attribute"), !Renderer::truthy(arg(a, 0, "case_sensitive", false)));
  auto items = r.iterate(v);
  if (items.empty()) return Undefined{"No aggregated item, sequence was empty."};
  size_t best = 0;
  Value best_key = key(items[0]);
  for (size_t i = 1; i < items.size(); ++i) {
    Value k = key(items[i]);
    if (want_max ? r.lt(best_key, k) : r.lt(k, best_key)) best = i, best_key = std::move(k);
  }
  return items[best];
}
Value f_max(Renderer& r, const Value& v, Args& a) { return minmax(r, v, a, true); }
Value f_min(Renderer& r, const Value& v, Args& a) { return minmax(r, v, a, false); }
Value f_sum(Renderer& r, const Value& v, Args& a) {
  check_args(a, "sum", {"attribute", "start"});
  auto key = key_getter(r, arg(a, 0, "attribute"), false);
  Value total = arg(a, 1, "start", 0);
  for (const Value& item : r.iterate(v)) total = r.binop("+", total, key(item));
  return total;
}
Value f_items(Renderer& r, const Value& v, Args& a) {
  check_args(a, "items", {});
  if (v.undefined()) return generator({});
  if (!is_plain_dict(v))
    fault(fmt::format("items: can only get item pairs from a mapping, not {}", type_name(v)));
  std::vector<Value> out;
  for (const auto& [k, x] : v.dict()->items) out.push_back(tuple2(k, x));
  (void)r;
  return generator(std::move(out));
}
Value f_dictsort(Renderer& r, const Value& v, Args& a) {
  check_args(a, "dictsort", {"case_sensitive", "by", "reverse"});
  if (!is_plain_dict(v)) fault(fmt::format("dictsort: expected a mapping, not {}", type_name(v)));
  const bool ignore_case = !Renderer::truthy(arg(a, 0, "case_sensitive", false));
  const std::string by = need_str(arg(a, 1, "by", "key"), "by");
  if (by != "key" && by != "value") fault("dictsort: you can only sort by either 'key' or 'value'");
  std::vector<Value> pairs;
  for (const auto& [k, x] : v.dict()->items) pairs.push_back(tuple2(k, x));
  const size_t pos = by == "key" ? 0 : 1;
  auto key = [&, pos](const Value& pair) -> Value {
    Value k = pair.list()->items[pos];
    return ignore_case && k.is_str() ? Value(lower(k.str())) : k;
  };
  return make_list(sorted(r, std::move(pairs), key, Renderer::truthy(arg(a, 2, "reverse", false))));
}
Value f_map(Renderer& r, const Value& v, Args& a) {
  std::vector<Value> out;
  if (!Renderer::truthy(v)) return generator({});
  if (a.pos.empty()) {
    const Value attribute = arg(a, 99, "attribute");
    if (attribute.undefined()) fault("map: needs a filter name or attribute=");
    for (const auto& kv : a.kw)
      if (kv.first != "attribute" && kv.first != "default")
        fault(fmt::format("map: unexpected keyword argument '{}'", kv.first));
    const Value fallback = arg(a, 99, "default");
    auto key = key_getter(r, attribute, false);
    for (const Value& item : r.iterate(v)) {
      Value x = key(item);
      out.push_back(x.undefined() && !fallback.undefined() ? fallback : x);
    }
    return generator(std::move(out));
  }
  const std::string name = need_str(a.pos[0], "map's filter name");
  Args rest{std::vector<Value>(a.pos.begin() + 1, a.pos.end()), a.kw};
  for (const Value& item : r.iterate(v)) {
    Args each = rest;
    out.push_back(r.call_filter(name, item, each));
  }
  return generator(std::move(out));
}
Value select_or_reject(Renderer& r, const Value& v, Args& a, bool select, bool by_attr) {
  if (!Renderer::truthy(v)) return generator({});
  size_t next = 0;
  std::function<Value(const Value&)> key = [](const Value& x) { return x; };
  if (by_attr) {
    if (a.pos.empty()) fault("selectattr/rejectattr: missing the attribute");
    key = key_getter(r, a.pos[0], false);
    next = 1;
  }
  std::string test;
  if (next < a.pos.size()) test = need_str(a.pos[next++], "test name");
  Args rest{std::vector<Value>(a.pos.begin() + static_cast<std::ptrdiff_t>(std::min(next, a.pos.size())),
                               a.pos.end()),
            a.kw};
  std::vector<Value> out;
  for (const Value& item : r.iterate(v)) {
    Value x = key(item);
    Args each = rest;
    const bool ok = test.empty() ? Renderer::truthy(x) : r.call_test(test, x, each);
    if (ok == select) out.push_back(item);
  }
  return generator(std::move(out));
}
Value f_select(Renderer& r, const Value& v, Args& a) { return select_or_reject(r, v, a, true, false); }
Value f_reject(Renderer& r, const Value& v, Args& a) { return select_or_reject(r, v, a, false, false); }
Value f_selectattr(Renderer& r, const Value& v, Args& a) { return select_or_reject(r, v, a, true, true); }
Value f_rejectattr(Renderer& r, const Value& v, Args& a) { return select_or_reject(r, v, a, false, true); }
Value f_indent(Renderer& r, const Value& v, Args& a) {
  check_args(a, "indent", {"width", "first", "blank"});
  const Value width = arg(a, 0, "width", 4);
  const std::string indention =
      width.is_str()
          ? width.str()
          : std::string(static_cast<size_t>(std::clamp<int64_t>(need_int(width, "width"), 0, 1024)), ' ');
  const bool first = Renderer::truthy(arg(a, 1, "first", false));
  const bool blank = Renderer::truthy(arg(a, 2, "blank", false));
  const auto lines = splitlines(r.to_str(v) + "\n");
  std::string out;
  for (size_t i = 0; i < lines.size(); ++i) {
    if (i) {
      out += "\n";
      if (blank || !lines[i].empty()) out += indention;
    }
    out += lines[i];
    r.check_string(out.size());
  }
  if (first) out = indention + out;
  return out;
}
Value f_escape(Renderer& r, const Value& v, Args&) {
  std::string out;
  for (char c : r.to_str(v)) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&#34;";
        break;
      case '\'':
        out += "&#39;";
        break;
      default:
        out.push_back(c);
    }
  }
  r.check_string(out.size());
  return out;
}
Value f_wordcount(Renderer& r, const Value& v, Args&) {
  int64_t n = 0;
  bool in_word = false;
  for (char32_t c : decode(r.to_str(v))) {
    // \w: letters, digits, underscore; other scripts' letters count as word characters too.
    const bool w =
        ascii_alpha(c) || ascii_digit(c) || c == '_' ||
        (c >= 0xC0 && !py_isspace(c) && !(c >= 0x2000 && c <= 0x206F) && !(c >= 0x3000 && c <= 0x303F));
    if (w && !in_word) ++n;
    in_word = w;
  }
  return n;
}
Value f_center(Renderer& r, const Value& v, Args& a) {
  check_args(a, "center", {"width"});
  const int64_t width = need_int(arg(a, 0, "width", 80), "width");
  r.check_string(static_cast<size_t>(std::max<int64_t>(width, 0)));
  return pad(r.to_str(v), width, " ", 0);
}
Value f_batch(Renderer& r, const Value& v, Args& a) {
  check_args(a, "batch", {"linecount", "fill_with"});
  const int64_t n = need_int(need_arg(a, 0, "linecount", "batch"), "linecount");
  if (n <= 0) fault("batch: linecount must be positive");
  const Value fill = arg(a, 1, "fill_with");
  std::vector<Value> out;
  std::vector<Value> cur;
  for (const Value& item : r.iterate(v)) {
    cur.push_back(item);
    if (static_cast<int64_t>(cur.size()) == n) out.push_back(make_list(std::exchange(cur, {})));
  }
  if (!cur.empty()) {
    if (!fill.undefined() && !fill.none())
      while (static_cast<int64_t>(cur.size()) < n) cur.push_back(fill);
    out.push_back(make_list(std::move(cur)));
  }
  return generator(std::move(out));
}
Value f_attr(Renderer& r, const Value& v, Args& a) {
  check_args(a, "attr", {"name"});
  return r.getattr(v, need_str(need_arg(a, 0, "name", "attr"), "attribute name"));
}
Value f_truncate(Renderer& r, const Value& v, Args& a) {
  check_args(a, "truncate", {"length", "killwords", "end", "leeway"});
  const int64_t length = need_int(arg(a, 0, "length", 255), "length");
  const bool killwords = Renderer::truthy(arg(a, 1, "killwords", false));
  const std::string end = r.to_str(arg(a, 2, "end", "..."));
  const int64_t leeway = need_int(arg(a, 3, "leeway", 5), "leeway");
  const std::string s = r.to_str(v);
  auto cps = decode(s);
  const int64_t n = static_cast<int64_t>(cps.size());
  if (n <= length + leeway) return s;
  const int64_t keep = std::max<int64_t>(length - cp_count(end), 0);
  std::string head = encode(cps, 0, static_cast<size_t>(keep));
  if (killwords) return head + end;
  const size_t space = head.rfind(' ');
  return (space == std::string::npos ? head : head.substr(0, space)) + end;
}

const std::unordered_map<std::string, FilterFn>& filters() {
  static const std::unordered_map<std::string, FilterFn> table = {
      {"abs", f_abs},
      {"attr", f_attr},
      {"batch", f_batch},
      {"capitalize", f_capitalize},
      {"center", f_center},
      {"count", f_length},
      {"d", f_default},
      {"default", f_default},
      {"dictsort", f_dictsort},
      {"e", f_escape},
      {"escape", f_escape},
      {"first", f_first},
      {"float", f_float},
      {"forceescape", f_escape},
      {"indent", f_indent},
      {"int", f_int},
      {"items", f_items},
      {"join", f_join},
      {"last", f_last},
      {"length", f_length},
      {"list", f_list},
      {"lower", f_lower},
      {"map", f_map},
      {"max", f_max},
      {"min", f_min},
      {"reject", f_reject},
      {"rejectattr", f_rejectattr},
      {"replace", f_replace},
      {"reverse", f_reverse},
      {"round", f_round},
      {"safe", f_safe},
      {"select", f_select},
      {"selectattr", f_selectattr},
      {"sort", f_sort},
      {"string", f_string},
      {"sum", f_sum},
      {"title", f_title},
      {"tojson", f_tojson},
      {"trim", f_trim},
      {"truncate", f_truncate},
      {"unique", f_unique},
      {"upper", f_upper},
      {"wordcount", f_wordcount},
  };
  return table;
}

bool t_defined(Renderer&, const Value& v, Args&) { return !v.undefined(); }
bool t_undefined(Renderer&, const Value& v, Args&) { return v.undefined(); }
bool t_none(Renderer&, const Value& v, Args&) { return v.none(); }
bool t_boolean(Renderer&, const Value& v, Args&) { return v.is_bool(); }
bool t_true(Renderer&, const Value& v, Args&) { return v.is_bool() && std::get<bool>(v.v); }
bool t_false(Renderer&, const Value& v, Args&) { return v.is_bool() && !std::get<bool>(v.v); }
bool t_integer(Renderer&, const Value& v, Args&) { return v.is_int(); }
bool t_float(Renderer&, const Value& v, Args&) { return v.is_float(); }
bool t_number(Renderer&, const Value& v, Args&) { return is_number(v); }
bool t_string(Renderer&, const Value& v, Args&) { return v.is_str(); }
bool t_mapping(Renderer&, const Value& v, Args&) { return is_plain_dict(v); }
bool t_iterable(Renderer&, const Value& v, Args&) {
  return v.undefined() || v.is_str() || v.is_list() || is_plain_dict(v);
}
bool t_sequence(Renderer&, const Value& v, Args&) {
  return v.undefined() || v.is_str() || (v.is_list() && v.list()->kind != Seq::Generator) || is_plain_dict(v);
}
bool t_callable(Renderer&, const Value& v, Args&) { return v.is_func() || v.undefined(); }
int64_t int_operand(const Value& v, const char* test) {
  int64_t i;
  if (int_of(v, i)) return i;
  if (v.undefined()) Renderer::undefined_fault(v);
  fault(fmt::format("'{}' test: expected an integer, not {}", test, type_name(v)));
}
bool t_odd(Renderer&, const Value& v, Args&) { return floor_mod(int_operand(v, "odd"), 2) == 1; }
bool t_even(Renderer&, const Value& v, Args&) { return floor_mod(int_operand(v, "even"), 2) == 0; }
bool t_divisibleby(Renderer&, const Value& v, Args& a) {
  const int64_t n = int_operand(need_arg(a, 0, "num", "divisibleby"), "divisibleby");
  if (n == 0) fault("integer division or modulo by zero");
  return floor_mod(int_operand(v, "divisibleby"), n) == 0;
}
bool t_eq(Renderer& r, const Value& v, Args& a) { return r.eq(v, need_arg(a, 0, "other", "test")); }
bool t_ne(Renderer& r, const Value& v, Args& a) { return !r.eq(v, need_arg(a, 0, "other", "test")); }
bool t_lt(Renderer& r, const Value& v, Args& a) { return r.lt(v, need_arg(a, 0, "other", "test")); }
bool t_le(Renderer& r, const Value& v, Args& a) {
  return r.lt(v, need_arg(a, 0, "other", "test")) || r.eq(v, need_arg(a, 0, "other", "test"));
}
bool t_gt(Renderer& r, const Value& v, Args& a) { return r.lt(need_arg(a, 0, "other", "test"), v); }
bool t_ge(Renderer& r, const Value& v, Args& a) {
  return r.lt(need_arg(a, 0, "other", "test"), v) || r.eq(v, need_arg(a, 0, "other", "test"));
}
bool t_in(Renderer& r, const Value& v, Args& a) { return r.contains(need_arg(a, 0, "seq", "in"), v); }
bool t_lower(Renderer& r, const Value& v, Args&) {
  Args none;
  return Renderer::truthy(str_method(r, r.to_str(v), "islower", none));
}
bool t_upper(Renderer& r, const Value& v, Args&) {
  Args none;
  return Renderer::truthy(str_method(r, r.to_str(v), "isupper", none));
}
bool t_sameas(Renderer& r, const Value& v, Args& a) {
  const Value other = need_arg(a, 0, "other", "test");
  if (v.v.index() != other.v.index()) return false;
  if (v.is_list()) return v.list() == other.list();
  if (v.is_dict()) return v.dict() == other.dict();
  return r.eq(v, other);
}
bool t_escaped(Renderer&, const Value&, Args&) { return false; }
bool t_filter(Renderer&, const Value& v, Args&) { return v.is_str() && known_filter(v.str()); }
bool t_test(Renderer&, const Value& v, Args&) { return v.is_str() && known_test(v.str()); }

const std::unordered_map<std::string, TestFn>& tests() {
  static const std::unordered_map<std::string, TestFn> table = {
      {"defined", t_defined},
      {"undefined", t_undefined},
      {"none", t_none},
      {"boolean", t_boolean},
      {"true", t_true},
      {"false", t_false},
      {"integer", t_integer},
      {"float", t_float},
      {"number", t_number},
      {"string", t_string},
      {"mapping", t_mapping},
      {"iterable", t_iterable},
      {"sequence", t_sequence},
      {"callable", t_callable},
      {"odd", t_odd},
      {"even", t_even},
      {"divisibleby", t_divisibleby},
      {"eq", t_eq},
      {"equalto", t_eq},
      {"==", t_eq},
      {"ne", t_ne},
      {"!=", t_ne},
      {"lt", t_lt},
      {"lessthan", t_lt},
      {"<", t_lt},
      {"le", t_le},
      {"<=", t_le},
      {"gt", t_gt},
      {"greaterthan", t_gt},
      {">", t_gt},
      {"ge", t_ge},
      {">=", t_ge},
      {"in", t_in},
      {"lower", t_lower},
      {"upper", t_upper},
      {"sameas", t_sameas},
      {"escaped", t_escaped},
      {"filter", t_filter},
      {"test", t_test},
  };
  return table;
}

}  // namespace

// ================================================================================================
// Template
// ================================================================================================

Template::Template(std::shared_ptr<const Node> root, std::string origin, Limits limits)
    : root_(std::move(root)), origin_(std::move(origin)), limits_(limits) {}
Template::Template(Template&&) noexcept = default;
Template& Template::operator=(Template&&) noexcept = default;
Template::~Template() = default;

Template Template::parse(std::string_view source, std::string origin, const Limits& limits) {
  const std::string text = normalize_newlines(source);
  auto root = std::make_shared<Node>();
  root->body = Parser(Lexer(text, origin).run(), origin, limits).parse_template();
  return Template(std::move(root), std::move(origin), limits);
}

std::string Template::render(const nlohmann::ordered_json& context) const {
  Renderer r(limits_, origin_);
  return r.run(root_->body, context);
}

}  // namespace kiln::pipelines::jinja
