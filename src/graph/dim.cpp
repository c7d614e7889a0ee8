// Dim's canonical form. An expression is a polynomial with int64 coefficients over atoms, where an
// atom is a symbol ("batch") or an opaque floor-division term ("(n + 1) // 2") whose parts are
// themselves canonical. Monomials are sorted multisets of atoms and zero coefficients are dropped, so
// two expressions that are equal as polynomials have the same representation and compare equal.
//
// Dims come from outside input (graph text, artifacts), so every expression is bounded (dim.h): its
// terms and printed size are checked as each term is added, a product is refused before it expands
// past kMaxDimTerms, and floor-division atoms nest at most kMaxDimDepth deep, which bounds every
// recursion below.
#include "kiln/graph/dim.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <numeric>
#include <set>

#include "graph/checked.h"
#include "kiln/errors.h"

namespace kiln::graph {

namespace {

struct Atom {
  std::string symbol;                      // empty for a floor-division term
  std::shared_ptr<const Dim::Expr> num;    // floor-division numerator
  std::shared_ptr<const Dim::Expr> den;    // floor-division denominator
  std::string key;                         // canonical text: equal keys <=> equal atoms
  int depth = 0;                           // floor divisions nested in this atom (a symbol: 0)
};

// An expression past kMaxDimTerms or kMaxDimSize; the public entry points rethrow it naming the operands.
class TooLarge : public ValueError {
 public:
  using ValueError::ValueError;
};

// Roughly the characters a term prints as, so a bound on the sum bounds printing and comparing.
size_t term_size(const std::vector<Atom>& m) {
  size_t n = 4;
  for (const Atom& a : m) n += a.key.size() + 3;
  return n;
}

// Text of outside input quoted in an error, cut short: the message of a 100 KB dim stays one line.
std::string excerpt(std::string_view text) {
  constexpr size_t kMax = 80;
  return text.size() <= kMax ? std::string(text)
                             : fmt::format("{}... ({} bytes)", text.substr(0, kMax), text.size());
}

using Monomial = std::vector<Atom>;  // sorted by key; empty is the constant term

struct MonomialLess {
  bool operator()(const Monomial& a, const Monomial& b) const {
    return std::lexicographical_compare(a.begin(), a.end(), b.begin(), b.end(),
                                        [](const Atom& x, const Atom& y) { return x.key < y.key; });
  }
};

using Terms = std::map<Monomial, int64_t, MonomialLess>;

bool same_monomial(const Monomial& a, const Monomial& b) {
  return a.size() == b.size() &&
         std::equal(a.begin(), a.end(), b.begin(), [](const Atom& x, const Atom& y) { return x.key == y.key; });
}

int64_t floor_div(int64_t a, int64_t b) {
  int64_t q = a / b;
  if ((a % b != 0) && ((a < 0) != (b < 0))) --q;
  return q;
}

bool is_identifier(std::string_view s) {
  if (s.empty() || !(std::isalpha(static_cast<unsigned char>(s[0])) || s[0] == '_')) return false;
  return std::all_of(s.begin(), s.end(),
                     [](char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; });
}

}  // namespace

struct Dim::Expr {
  Terms terms;      // no zero coefficients
  size_t size = 0;  // sum of term_size over terms, at most kMaxDimSize

  void add_term(const Monomial& m, int64_t coefficient) {
    if (coefficient == 0) return;
    auto [it, inserted] = terms.emplace(m, coefficient);
    if (inserted) {
      size += term_size(m);
      if (terms.size() > kMaxDimTerms) throw TooLarge(fmt::format("more than {} terms", kMaxDimTerms));
      if (size > kMaxDimSize)
        throw TooLarge(fmt::format("more than {} characters of canonical text", kMaxDimSize));
    } else {
      it->second = checked_add(it->second, coefficient, "Dim: overflow in addition");
      if (it->second == 0) {
        size -= term_size(it->first);
        terms.erase(it);
      }
    }
    // INT64_MIN has no positive counterpart; excluding it keeps negation and printing overflow-free.
    if (auto found = terms.find(m); found != terms.end() && found->second == INT64_MIN)
      throw ValueError("Dim: overflow (coefficient -2^63)");
  }
  std::optional<int64_t> constant() const {
    if (terms.empty()) return 0;
    if (terms.size() == 1 && terms.begin()->first.empty()) return terms.begin()->second;
    return std::nullopt;
  }
  bool is_single_term() const { return terms.size() == 1; }
};

namespace {

using Expr = Dim::Expr;
using ExprPtr = std::shared_ptr<const Expr>;

ExprPtr constant_expr(int64_t v) {
  auto e = std::make_shared<Expr>();
  e->add_term({}, v);
  return e;
}

// ---- printing ------------------------------------------------------------------------------------

std::string print_expr(const Expr& e);

// An expression as an operand of `//` or `*`: bare when it is one number or one atom, else in parens.
std::string print_operand(const Expr& e) {
  if (auto c = e.constant()) return std::to_string(*c);
  if (e.is_single_term()) {
    const auto& [m, coef] = *e.terms.begin();
    if (coef == 1 && m.size() == 1) return m[0].key;
  }
  return "(" + print_expr(e) + ")";
}

std::string atom_key(const Expr& num, const Expr& den) {
  // Numerators that are sums need parens; products parse left to right, so "n * m // 2" is fine.
  std::string num_text = num.is_single_term() ? print_expr(num) : "(" + print_expr(num) + ")";
  return "(" + num_text + " // " + print_operand(den) + ")";
}

// One term without its sign; `bare_ok` says a lone floor-division atom may drop its parens.
std::string print_term(const Monomial& m, int64_t magnitude, bool bare_ok) {
  if (m.empty()) return std::to_string(magnitude);
  std::string out;
  if (magnitude != 1) out = std::to_string(magnitude);
  const bool alone = magnitude == 1 && m.size() == 1;
  for (const Atom& a : m) {
    if (!out.empty()) out += " * ";
    if (a.symbol.empty() && alone && bare_ok)
      out += a.key.substr(1, a.key.size() - 2);
    else
      out += a.key;
  }
  return out;
}

// Positive terms first (so "total - seq", not "-seq + total"), the constant last; else key order.
std::string print_expr(const Expr& e) {
  if (e.terms.empty()) return "0";
  std::vector<std::pair<const Monomial*, int64_t>> order;
  for (int pass = 0; pass < 2; ++pass)
    for (const auto& [m, c] : e.terms)
      if (!m.empty() && ((c > 0) == (pass == 0))) order.emplace_back(&m, c);
  auto constant = e.terms.find(Monomial{});
  if (constant != e.terms.end()) order.emplace_back(&constant->first, constant->second);

  std::string out;
  for (size_t i = 0; i < order.size(); ++i) {
    const auto [m, c] = order[i];
    const std::string term = print_term(*m, c < 0 ? -c : c, i > 0 || c > 0);
    if (i == 0)
      out = (c < 0 ? "-" : "") + term;
    else
      out += (c < 0 ? " - " : " + ") + term;
  }
  return out;
}

// ---- arithmetic on canonical forms ---------------------------------------------------------------

Expr add(const Expr& a, const Expr& b, int64_t b_sign) {
  Expr out = a;
  for (const auto& [m, c] : b.terms) out.add_term(m, checked_mul(c, b_sign, "Dim: overflow in subtraction"));
  return out;
}

Monomial merge(const Monomial& a, const Monomial& b) {
  Monomial out;
  out.reserve(a.size() + b.size());
  std::merge(a.begin(), a.end(), b.begin(), b.end(), std::back_inserter(out),
             [](const Atom& x, const Atom& y) { return x.key < y.key; });
  return out;
}

Expr multiply(const Expr& a, const Expr& b) {
  // Refused before expanding, so a product of sums costs at most kMaxDimTerms term products.
  if (a.terms.size() * b.terms.size() > kMaxDimTerms)
    throw TooLarge(fmt::format("the product of {} and {} terms expands past {} terms", a.terms.size(),
                               b.terms.size(), kMaxDimTerms));
  Expr out;
  for (const auto& [ma, ca] : a.terms)
    for (const auto& [mb, cb] : b.terms) out.add_term(merge(ma, mb), checked_mul(ca, cb, "Dim: overflow in multiplication"));
  return out;
}

Expr atom_expr(Atom atom) {
  Expr e;
  e.add_term(Monomial{std::move(atom)}, 1);
  return e;
}

int max_depth(const Expr& e) {
  int depth = 0;
  for (const auto& [m, c] : e.terms)
    for (const Atom& a : m) depth = std::max(depth, a.depth);
  return depth;
}

Expr opaque_floordiv(const Expr& num, const Expr& den) {
  Atom a;
  a.depth = std::max(max_depth(num), max_depth(den)) + 1;
  if (a.depth > kMaxDimDepth)
    throw TooLarge(fmt::format("floor divisions nest more than {} deep", kMaxDimDepth));
  a.num = std::make_shared<Expr>(num);
  a.den = std::make_shared<Expr>(den);
  a.key = atom_key(num, den);
  return atom_expr(std::move(a));
}

// `monomial / divisor` as a multiset difference, when divisor's atoms are all in monomial.
std::optional<Monomial> divide_monomial(const Monomial& m, const Monomial& divisor) {
  Monomial rest;
  size_t j = 0;
  for (const Atom& a : m) {
    if (j < divisor.size() && divisor[j].key == a.key)
      ++j;
    else
      rest.push_back(a);
  }
  if (j != divisor.size()) return std::nullopt;
  return rest;
}

Expr floordiv(const Expr& num, const Expr& den) {
  const auto den_const = den.constant();
  if (den_const && *den_const == 0)
    throw ValueError("Dim: division by zero in (" + print_expr(num) + ") // 0");
  if (num.terms.empty()) return Expr{};

  if (den_const) {
    const int64_t d = *den_const;
    if (d < 0) return opaque_floordiv(num, den);  // only reachable from parsed text; keep it exact
    // floor((d*Q + R) / d) = Q + floor(R / d) with 0 <= R's coefficients < d, so only R stays opaque.
    Expr quotient, remainder;
    for (const auto& [m, c] : num.terms) {
      // q and r from C's truncating division, then floored: q * d can pass INT64_MIN when c is near it.
      int64_t q = c / d, r = c % d;
      if (r < 0) {
        r += d;
        --q;
      }
      quotient.add_term(m, q);
      remainder.add_term(m, r);
    }
    if (remainder.terms.empty()) return quotient;
    if (auto r = remainder.constant()) return add(quotient, *constant_expr(floor_div(*r, d)), 1);
    // Divide R and d by their gcd, since floor(gR / gd) = floor(R / d).
    int64_t g = d;
    for (const auto& [m, c] : remainder.terms) g = std::gcd(g, c);
    Expr reduced;
    for (const auto& [m, c] : remainder.terms) reduced.add_term(m, c / g);
    const int64_t reduced_d = d / g;
    // floor(floor(X / a) / b) = floor(X / (a * b)) for positive a, b: fold nested divisions.
    if (reduced.is_single_term() && reduced.terms.begin()->second == 1 && reduced.terms.begin()->first.size() == 1) {
      const Atom& inner = reduced.terms.begin()->first[0];
      if (inner.symbol.empty()) {
        if (auto inner_d = inner.den->constant(); inner_d && *inner_d > 0)
          return add(quotient, floordiv(*inner.num, *constant_expr(checked_mul(*inner_d, reduced_d, "Dim: overflow in division"))), 1);
      }
    }
    return add(quotient, opaque_floordiv(reduced, *constant_expr(reduced_d)), 1);
  }

  // Symbolic divisor: exact when it is one term dividing every term of the numerator (n * 2 / n = 2).
  // This assumes the divisor is non-zero at run time, as shape algebra does.
  if (den.is_single_term()) {
    const auto& [dm, dc] = *den.terms.begin();
    Expr out;
    bool exact = true;
    for (const auto& [m, c] : num.terms) {
      auto rest = divide_monomial(m, dm);
      if (!rest || c % dc != 0) {
        exact = false;
        break;
      }
      out.add_term(*rest, c / dc);
    }
    if (exact) return out;
  }
  return opaque_floordiv(num, den);
}

void collect_symbols(const Expr& e, std::set<std::string>& out) {
  for (const auto& [m, c] : e.terms)
    for (const Atom& a : m) {
      if (!a.symbol.empty()) {
        out.insert(a.symbol);
      } else {
        collect_symbols(*a.num, out);
        collect_symbols(*a.den, out);
      }
    }
}

// `whole` is the Dim being evaluated, printed only in an error (evaluation runs on every execute).
int64_t evaluate_expr(const Expr& e, const SymbolBindings& bindings, const Expr& whole) {
  int64_t total = 0;
  for (const auto& [m, c] : e.terms) {
    int64_t term = c;
    for (const Atom& a : m) {
      int64_t v;
      if (!a.symbol.empty()) {
        auto it = bindings.find(a.symbol);
        if (it == bindings.end())
          throw ValueError("Dim::evaluate: symbol '" + a.symbol + "' of '" + print_expr(whole) + "' has no value");
        v = it->second;
      } else {
        const int64_t d = evaluate_expr(*a.den, bindings, whole);
        if (d == 0) throw ValueError("Dim::evaluate: division by zero in '" + print_expr(whole) + "'");
        v = floor_div(evaluate_expr(*a.num, bindings, whole), d);
      }
      term = checked_mul(term, v, "Dim: overflow in evaluation");
    }
    total = checked_add(total, term, "Dim: overflow in evaluation");
  }
  return total;
}

// A Dim may hold any expression except a negative constant (a dimension cannot be negative).
ExprPtr checked(Expr e, const char* op) {
  if (auto c = e.constant(); c && *c < 0)
    throw ValueError(std::string("Dim: ") + op + " gives the negative static dim " + std::to_string(*c));
  return std::make_shared<Expr>(std::move(e));
}

// ---- parsing -------------------------------------------------------------------------------------

class DimParser {
 public:
  explicit DimParser(std::string_view text) : text_(text) {}

  Expr parse_all() {
    Expr e = expr();
    skip_space();
    if (pos_ != text_.size()) fail("unexpected '" + std::string(1, text_[pos_]) + "'");
    return e;
  }

 private:
  [[noreturn]] void fail(const std::string& what) const {
    throw ParseError("Dim::parse: " + what + " at column " + std::to_string(pos_ + 1) + " of '" +
                     excerpt(text_) + "'");
  }
  // Counts the nesting of the recursive descent, which the text decides.
  struct Nested {
    explicit Nested(DimParser& p) : p_(p) {
      if (++p_.depth_ > kMaxDimDepth) p_.fail(fmt::format("nesting deeper than {}", kMaxDimDepth));
    }
    ~Nested() { --p_.depth_; }
    Nested(const Nested&) = delete;
    Nested& operator=(const Nested&) = delete;
    DimParser& p_;
  };
  void skip_space() {
    while (pos_ < text_.size() && std::isspace(static_cast<unsigned char>(text_[pos_]))) ++pos_;
  }
  bool accept(std::string_view token) {
    skip_space();
    if (text_.substr(pos_, token.size()) != token) return false;
    pos_ += token.size();
    return true;
  }

  Expr expr() {
    Expr e = term();
    for (;;) {
      if (accept("+"))
        e = add(e, term(), 1);
      else if (accept("-"))
        e = add(e, term(), -1);
      else
        return e;
    }
  }
  Expr term() {
    Expr e = unary();
    for (;;) {
      if (accept("*")) {
        e = multiply(e, unary());
      } else if (accept("//") || accept("/")) {
        const size_t at = pos_;
        Expr d = unary();
        try {
          e = floordiv(e, d);
        } catch (const ValueError& err) {
          pos_ = at;
          fail(err.what());
        }
      } else {
        return e;
      }
    }
  }
  Expr unary() {
    Nested nested(*this);
    if (accept("-")) return multiply(*constant_expr(-1), unary());
    return primary();
  }
  Expr primary() {
    skip_space();
    if (pos_ >= text_.size()) fail("expected a number, symbol or '('");
    const char c = text_[pos_];
    if (c == '(') {
      ++pos_;
      Expr e = expr();
      if (!accept(")")) fail("expected ')'");
      return e;
    }
    if (std::isdigit(static_cast<unsigned char>(c))) {
      int64_t v = 0;
      while (pos_ < text_.size() && std::isdigit(static_cast<unsigned char>(text_[pos_]))) {
        if (__builtin_mul_overflow(v, 10, &v) || __builtin_add_overflow(v, text_[pos_] - '0', &v))
          fail("number too large");
        ++pos_;
      }
      return *constant_expr(v);
    }
    if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
      const size_t start = pos_;
      while (pos_ < text_.size() && (std::isalnum(static_cast<unsigned char>(text_[pos_])) || text_[pos_] == '_'))
        ++pos_;
      Atom a;
      a.symbol = std::string(text_.substr(start, pos_ - start));
      a.key = a.symbol;
      return atom_expr(std::move(a));
    }
    fail("expected a number, symbol or '(' but found '" + std::string(1, c) + "'");
  }

  std::string_view text_;
  size_t pos_ = 0;
  int depth_ = 0;
};

}  // namespace

// ---- Dim -----------------------------------------------------------------------------------------

Dim::Dim(int64_t value) {
  if (value < 0) throw ValueError("Dim: static dim must be non-negative, got " + std::to_string(value));
  expr_ = constant_expr(value);
}

Dim::Dim(std::string_view symbol) {
  if (!is_identifier(symbol))
    throw ValueError("Dim: symbol '" + std::string(symbol) +
                     "' is not an identifier ([A-Za-z_][A-Za-z0-9_]*)");
  Atom a;
  a.symbol = std::string(symbol);
  a.key = a.symbol;
  expr_ = std::make_shared<Expr>(atom_expr(std::move(a)));
}

bool Dim::is_static() const { return expr_->constant().has_value(); }

bool Dim::is_symbolic() const {
  if (!expr_->is_single_term()) return false;
  const auto& [m, c] = *expr_->terms.begin();
  return c == 1 && m.size() == 1 && !m[0].symbol.empty();
}

int64_t Dim::static_value() const {
  if (auto c = expr_->constant()) return *c;
  throw ValueError("Dim: '" + to_string() + "' is not static");
}

std::optional<int64_t> Dim::try_static() const { return expr_->constant(); }

const std::string& Dim::symbol() const {
  if (!is_symbolic()) throw ValueError("Dim: '" + to_string() + "' is not a single symbol");
  return expr_->terms.begin()->first[0].symbol;
}

std::vector<std::string> Dim::symbols() const {
  std::set<std::string> names;
  collect_symbols(*expr_, names);
  return {names.begin(), names.end()};
}

int64_t Dim::evaluate(const SymbolBindings& bindings) const {
  const int64_t v = evaluate_expr(*expr_, bindings, *expr_);
  if (v < 0)
    throw ValueError("Dim::evaluate: '" + to_string() + "' evaluates to the negative value " + std::to_string(v));
  return v;
}

std::string Dim::to_string() const { return print_expr(*expr_); }

Dim Dim::parse(std::string_view text) {
  Expr e;
  try {
    e = DimParser(text).parse_all();
  } catch (const ValueError& err) {  // overflow or a bound passed while folding the text's arithmetic
    throw ParseError("Dim::parse: '" + excerpt(text) + "': " + err.what());
  }
  if (auto c = e.constant(); c && *c < 0)
    throw ParseError("Dim::parse: '" + excerpt(text) + "' is the negative static dim " + std::to_string(*c));
  return Dim(std::make_shared<const Expr>(std::move(e)));
}

namespace {

// Runs one operation of the public API; an expression past a bound becomes an error naming the operands.
template <class F>
Dim bounded(const Dim& a, const Dim& b, const char* op, F&& f) {
  try {
    return f();
  } catch (const TooLarge& e) {
    throw ValueError(fmt::format("Dim: ({}) {} ({}) is too large: {}", excerpt(a.to_string()), op,
                                 excerpt(b.to_string()), e.what()));
  }
}

}  // namespace

Dim operator+(const Dim& a, const Dim& b) {
  return bounded(a, b, "+", [&] { return Dim(checked(add(*a.expr_, *b.expr_, 1), "addition")); });
}
Dim operator-(const Dim& a, const Dim& b) {
  return bounded(a, b, "-", [&] { return Dim(checked(add(*a.expr_, *b.expr_, -1), "subtraction")); });
}
Dim operator*(const Dim& a, const Dim& b) {
  return bounded(a, b, "*", [&] { return Dim(checked(multiply(*a.expr_, *b.expr_), "multiplication")); });
}
Dim operator/(const Dim& a, const Dim& b) {
  return bounded(a, b, "//", [&] { return Dim(checked(floordiv(*a.expr_, *b.expr_), "division")); });
}

bool operator==(const Dim& a, const Dim& b) {
  if (a.expr_ == b.expr_) return true;
  const Terms& x = a.expr_->terms;
  const Terms& y = b.expr_->terms;
  if (x.size() != y.size()) return false;
  for (auto i = x.begin(), j = y.begin(); i != x.end(); ++i, ++j)
    if (i->second != j->second || !same_monomial(i->first, j->first)) return false;
  return true;
}

bool operator<(const Dim& a, const Dim& b) {
  const Terms& x = a.expr_->terms;
  const Terms& y = b.expr_->terms;
  MonomialLess less;
  return std::lexicographical_compare(x.begin(), x.end(), y.begin(), y.end(), [&](const auto& p, const auto& q) {
    if (less(p.first, q.first)) return true;
    if (less(q.first, p.first)) return false;
    return p.second < q.second;
  });
}

// ---- Shape ---------------------------------------------------------------------------------------

Shape Shape::of(const std::vector<int64_t>& static_dims) {
  std::vector<Dim> dims;
  dims.reserve(static_dims.size());
  for (int64_t d : static_dims) dims.emplace_back(d);
  return Shape(std::move(dims));
}

bool Shape::is_static() const {
  return std::all_of(dims_.begin(), dims_.end(), [](const Dim& d) { return d.is_static(); });
}

std::vector<int64_t> Shape::static_dims() const {
  std::vector<int64_t> out;
  out.reserve(dims_.size());
  for (const Dim& d : dims_) {
    auto v = d.try_static();
    if (!v) throw ValueError("Shape: " + to_string() + " is not static (dim '" + d.to_string() + "')");
    out.push_back(*v);
  }
  return out;
}

std::vector<int64_t> Shape::evaluate(const SymbolBindings& bindings) const {
  std::vector<int64_t> out;
  out.reserve(dims_.size());
  for (const Dim& d : dims_) out.push_back(d.evaluate(bindings));
  return out;
}

std::optional<int64_t> Shape::static_num_elements() const {
  int64_t n = 1;
  for (const Dim& d : dims_) {
    auto v = d.try_static();
    if (!v) return std::nullopt;
    if (__builtin_mul_overflow(n, *v, &n))
      throw ValueError("Shape: element count of " + to_string() + " overflows int64");
  }
  return n;
}

Dim Shape::num_elements() const {
  Dim n(1);
  for (const Dim& d : dims_) n = n * d;
  return n;
}

std::string Shape::to_string() const {
  std::string out = "[";
  for (size_t i = 0; i < dims_.size(); ++i) {
    if (i) out += ", ";
    out += dims_[i].to_string();
  }
  return out + "]";
}

int64_t normalize_axis(int64_t axis, int64_t rank, std::string_view what) {
  if (axis < -rank || axis >= rank)
    throw ValueError(std::string(what) + ": axis " + std::to_string(axis) + " out of range for rank " +
                     std::to_string(rank) + " (expected " + std::to_string(-rank) + " <= axis < " +
                     std::to_string(rank) + ")");
  return axis < 0 ? axis + rank : axis;
}

}  // namespace kiln::graph
