// Dimensions and shapes. A Dim is static (4), symbolic ("batch") or algebraic ("seq" + 1,
// "n" * 2, "n" / 2). Algebraic dims are kept in a canonical form (a polynomial over symbols and
// opaque floor-division terms) so equal expressions compare equal: (n + 1) - 1 == n.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace kiln::graph {

// Bounds that keep the time and memory a dim costs proportional to its text (graph text and compiled
// artifacts are outside input). Real dims are a few terms; going past a bound is a ValueError
// (ParseError from parse) naming the expression.
inline constexpr int kMaxDimDepth = 64;       // nesting of parentheses, unary '-' and floor divisions
inline constexpr size_t kMaxDimTerms = 1024;  // terms of one expression, expanded ((a+b)*(c+d) has 4)
inline constexpr size_t kMaxDimSize = 16384;  // characters of one expression's canonical text, about

// Values of symbols, bound when a Model runs.
using SymbolBindings = std::map<std::string, int64_t>;

class Dim {
 public:
  Dim() : Dim(int64_t{0}) {}
  Dim(int64_t value);              // static; negative is a ValueError
  Dim(int value) : Dim(int64_t{value}) {}
  Dim(const char* symbol) : Dim(std::string_view(symbol)) {}
  Dim(std::string_view symbol);    // symbolic; must be an identifier [A-Za-z_][A-Za-z0-9_]*
  Dim(const std::string& symbol) : Dim(std::string_view(symbol)) {}

  bool is_static() const;          // a constant
  bool is_symbolic() const;        // exactly one symbol, coefficient 1
  int64_t static_value() const;    // ValueError unless is_static()
  std::optional<int64_t> try_static() const;
  const std::string& symbol() const;  // ValueError unless is_symbolic()
  std::vector<std::string> symbols() const;  // every symbol the expression mentions, sorted

  // Evaluates with the given symbol values; ValueError naming a missing symbol.
  int64_t evaluate(const SymbolBindings&) const;

  // Text form: 4, batch, seq + 1, 2 * n, n // 2 (round-trips through parse).
  std::string to_string() const;
  static Dim parse(std::string_view text);  // ParseError on bad text

  friend Dim operator+(const Dim&, const Dim&);
  friend Dim operator-(const Dim&, const Dim&);
  friend Dim operator*(const Dim&, const Dim&);
  friend Dim operator/(const Dim&, const Dim&);  // floor division; by a static 0 is a ValueError
  friend bool operator==(const Dim&, const Dim&);
  friend bool operator<(const Dim&, const Dim&);  // a total order on canonical forms (for maps)

  struct Expr;  // canonical form; see dim.cpp

 private:
  explicit Dim(std::shared_ptr<const Expr> e) : expr_(std::move(e)) {}
  std::shared_ptr<const Expr> expr_;
};

// A tensor shape: a list of dims.
class Shape {
 public:
  Shape() = default;
  Shape(std::initializer_list<Dim> dims) : dims_(dims) {}
  Shape(std::vector<Dim> dims) : dims_(std::move(dims)) {}
  static Shape of(const std::vector<int64_t>& static_dims);

  int64_t rank() const { return static_cast<int64_t>(dims_.size()); }
  const Dim& operator[](int64_t i) const { return dims_.at(static_cast<size_t>(i)); }
  Dim& operator[](int64_t i) { return dims_.at(static_cast<size_t>(i)); }
  const std::vector<Dim>& dims() const { return dims_; }
  auto begin() const { return dims_.begin(); }
  auto end() const { return dims_.end(); }

  bool is_static() const;
  std::vector<int64_t> static_dims() const;  // ValueError unless is_static()
  std::vector<int64_t> evaluate(const SymbolBindings&) const;
  std::optional<int64_t> static_num_elements() const;
  Dim num_elements() const;                  // product of dims
  std::string to_string() const;             // "[batch, 64]"
  bool operator==(const Shape&) const = default;

 private:
  std::vector<Dim> dims_;
};

// Normalizes a possibly negative axis against a rank; ValueError "axis 3 out of range for rank 2".
int64_t normalize_axis(int64_t axis, int64_t rank, std::string_view what);

}  // namespace kiln::graph
