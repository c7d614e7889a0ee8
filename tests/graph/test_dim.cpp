#include <gtest/gtest.h>

#include "test_util.h"

#include <map>

#include "kiln/errors.h"
#include "kiln/graph/dim.h"

using namespace kiln;
using kiln::testing::error_message;
using kiln::testing::expect_error;
using namespace kiln::graph;

namespace {
}  // namespace

TEST(Dim, StaticAndSymbolicBasics) {
  Dim four(4);
  EXPECT_TRUE(four.is_static());
  EXPECT_FALSE(four.is_symbolic());
  EXPECT_EQ(four.static_value(), 4);
  EXPECT_EQ(four.to_string(), "4");
  EXPECT_EQ(Dim().static_value(), 0);

  Dim batch("batch");
  EXPECT_TRUE(batch.is_symbolic());
  EXPECT_FALSE(batch.is_static());
  EXPECT_EQ(batch.symbol(), "batch");
  EXPECT_EQ(batch.try_static(), std::nullopt);
  EXPECT_EQ(batch.to_string(), "batch");
  EXPECT_EQ(Dim(std::string("seq_len2")).symbol(), "seq_len2");
}

TEST(Dim, RejectsNegativeStaticAndBadSymbols) {
  expect_error<ValueError>([] { Dim(-1); }, "-1");
  expect_error<ValueError>([] { Dim("2x"); }, "'2x'");
  EXPECT_THROW(Dim(""), ValueError);
  EXPECT_THROW(Dim("a b"), ValueError);
  EXPECT_THROW(Dim("n+1"), ValueError);
}

TEST(Dim, AccessorsRejectTheWrongKind) {
  expect_error<ValueError>([] { (void)Dim("n").static_value(); }, "'n'");
  expect_error<ValueError>([] { (void)Dim(3).symbol(); }, "'3'");
  EXPECT_THROW((void)(Dim("n") + 1).symbol(), ValueError);
  EXPECT_FALSE((Dim("n") * 2).is_symbolic());
}

TEST(Dim, StaticArithmeticFolds) {
  EXPECT_EQ(Dim(3) + Dim(4), Dim(7));
  EXPECT_EQ(Dim(10) - Dim(4), Dim(6));
  EXPECT_EQ(Dim(6) * Dim(7), Dim(42));
  EXPECT_EQ(Dim(7) / Dim(2), Dim(3));  // floor division
  EXPECT_EQ(Dim(8) / Dim(2), Dim(4));
  EXPECT_EQ(Dim(1) / Dim(3), Dim(0));
  EXPECT_TRUE((Dim(7) / Dim(2)).is_static());
}

TEST(Dim, NegativeStaticResultIsAValueError) {
  expect_error<ValueError>([] { (void)(Dim(3) - Dim(5)); }, "-2");
}

TEST(Dim, DivisionByStaticZeroIsAValueError) {
  expect_error<ValueError>([] { (void)(Dim(3) / Dim(0)); }, "zero");
  expect_error<ValueError>([] { (void)(Dim("n") / Dim(0)); }, "zero");
}

TEST(Dim, AlgebraSimplifiesAddThenSubtract) {
  Dim n("n");
  EXPECT_EQ((n + 1) - 1, n);
  EXPECT_TRUE(((n + 1) - 1).is_symbolic());
  EXPECT_EQ(n - n, Dim(0));
  EXPECT_TRUE((n - n).is_static());
}

TEST(Dim, AlgebraCollectsLikeTerms) {
  Dim n("n");
  EXPECT_EQ(n * 2 + n * 3, n * 5);
  EXPECT_EQ(n + n, 2 * n);
  EXPECT_EQ((n + 1) * 2, 2 * n + 2);
  EXPECT_EQ((n + 1) * (n + 1), n * n + 2 * n + 1);
}

TEST(Dim, AlgebraIsCommutativeAndAssociative) {
  Dim a("a"), b("b"), c("c");
  EXPECT_EQ(a + b, b + a);
  EXPECT_EQ(a * b, b * a);
  EXPECT_EQ((a + b) + c, a + (b + c));
  EXPECT_EQ((a * b) * c, c * (b * a));
  EXPECT_EQ(a * (b + c), a * b + a * c);
  EXPECT_NE(a + b, a * b);
  EXPECT_NE(a, b);
}

TEST(Dim, ExactDivisionByAConstantSimplifies) {
  Dim n("n");
  EXPECT_EQ(n * 2 / 2, n);
  EXPECT_EQ((4 * n + 6) / 2, 2 * n + 3);
  EXPECT_EQ(n * 6 / 3, 2 * n);
}

TEST(Dim, InexactDivisionKeepsAFloorTerm) {
  Dim n("n");
  Dim half = n / 2;
  EXPECT_FALSE(half.is_static());
  EXPECT_FALSE(half.is_symbolic());
  EXPECT_EQ(half.to_string(), "n // 2");
  EXPECT_EQ(half, n / 2);      // the opaque term compares by value
  EXPECT_NE(half, n / 3);
  EXPECT_EQ(half + half, 2 * (n / 2));
  EXPECT_EQ(half.symbols(), std::vector<std::string>{"n"});
  // floor((2n + 1) / 2) = n for every integer n: the multiple of the divisor comes out.
  EXPECT_EQ((2 * n + 1) / 2, n);
  // floor((4n + 2) / 4) = n + floor(2 / 4) ... with a symbolic remainder it stays a floor term.
  EXPECT_EQ((4 * n + 2 * Dim("m")) / 4, n + Dim("m") / 2);
}

TEST(Dim, NestedFloorDivisionsByConstantsCombine) {
  Dim n("n");
  EXPECT_EQ(n / 2 / 3, n / 6);
}

TEST(Dim, DivisionBySymbolCancelsExactFactors) {
  Dim n("n"), m("m");
  EXPECT_EQ(n * 2 / n, Dim(2));
  EXPECT_EQ((n * m + n) / n, m + 1);
  EXPECT_EQ(n / n, Dim(1));
  Dim opaque = m / n;
  EXPECT_EQ(opaque.to_string(), "m // n");
  EXPECT_EQ(opaque.symbols(), (std::vector<std::string>{"m", "n"}));
}

TEST(Dim, SymbolicExpressionsMayHaveNegativeCoefficients) {
  Dim total("total"), seq("seq");
  Dim rest = total - seq;
  EXPECT_EQ(rest.to_string(), "total - seq");
  EXPECT_EQ(rest + seq, total);
  EXPECT_EQ(rest.evaluate({{"total", 10}, {"seq", 3}}), 7);
  EXPECT_EQ((Dim(5) - seq).to_string(), "-seq + 5");
}

TEST(Dim, ToStringIsCanonical) {
  Dim n("n"), seq("seq");
  EXPECT_EQ((seq + 1).to_string(), "seq + 1");
  EXPECT_EQ((1 + seq).to_string(), "seq + 1");
  EXPECT_EQ((n * 2).to_string(), "2 * n");
  EXPECT_EQ((n * seq).to_string(), (seq * n).to_string());
  EXPECT_EQ((seq - 1).to_string(), "seq - 1");
  EXPECT_EQ((2 * (n / 2)).to_string(), "2 * (n // 2)");
  EXPECT_EQ(((n + 1) / 2).to_string(), "(n + 1) // 2");
}

TEST(Dim, ParseRoundTripsToString) {
  Dim n("n"), m("m"), seq("seq");
  const std::vector<Dim> dims = {
      Dim(0), Dim(17), n, seq + 1, 2 * n, n / 2, (n + 1) / 2, 2 * (n / 2) + 1, n - m, Dim(3) - n,
      n * m * 4 - 7, m / n, (n + m) / (n - m), ((n + 1) / 2) / m, Dim(0) - (n / 2), n * n * m,
      (n * m + 3) / 2 + (n / 2) * m};
  for (const Dim& d : dims) {
    const std::string text = d.to_string();
    EXPECT_EQ(Dim::parse(text), d) << text;
    EXPECT_EQ(Dim::parse(text).to_string(), text);
  }
}

TEST(Dim, ParseAppliesPrecedenceAndCanonicalises) {
  EXPECT_EQ(Dim::parse("2 + 3 * 4"), Dim(14));
  EXPECT_EQ(Dim::parse("(2 + 3) * 4"), Dim(20));
  EXPECT_EQ(Dim::parse("7 // 2 * 2"), Dim(6));  // left to right
  EXPECT_EQ(Dim::parse("n*2/2"), Dim("n"));
  EXPECT_EQ(Dim::parse("n / 2"), Dim("n") / 2);  // '/' is an alias of '//'
  EXPECT_EQ(Dim::parse("  seq+1 "), Dim("seq") + 1);
  EXPECT_EQ(Dim::parse("-n + n + 3"), Dim(3));
  EXPECT_EQ(Dim::parse("total - seq"), Dim("total") - Dim("seq"));
}

TEST(Dim, ParseRejectsBadTextWithAParseError) {
  expect_error<ParseError>([] { Dim::parse("n +"); }, "column");
  expect_error<ParseError>([] { Dim::parse("(n + 1"); }, "')'");
  expect_error<ParseError>([] { Dim::parse("n $ 2"); }, "'$'");
  expect_error<ParseError>([] { Dim::parse("n // 0"); }, "zero");
  expect_error<ParseError>([] { Dim::parse("2 - 5"); }, "negative");
  expect_error<ParseError>([] { Dim::parse("99999999999999999999"); }, "too large");
  EXPECT_THROW(Dim::parse(""), ParseError);
  EXPECT_THROW(Dim::parse("3 n"), ParseError);
}

TEST(Dim, EvaluateUsesBindings) {
  Dim n("n"), m("m");
  EXPECT_EQ(Dim(5).evaluate({}), 5);
  EXPECT_EQ(n.evaluate({{"n", 9}}), 9);
  EXPECT_EQ((2 * n + m * m - 1).evaluate({{"n", 3}, {"m", 4}}), 21);
  EXPECT_EQ((n / 2).evaluate({{"n", 7}}), 3);
  EXPECT_EQ(((n + 1) / m).evaluate({{"n", 7}, {"m", 3}}), 2);
}

TEST(Dim, EvaluateNamesAMissingSymbol) {
  expect_error<ValueError>([] { (void)(Dim("a") + Dim("batch")).evaluate({{"a", 1}}); },
                                      "'batch'");
}

TEST(Dim, EvaluateRejectsNegativeAndDivisionByZero) {
  Dim n("n"), m("m");
  expect_error<ValueError>([&] { (void)(n - m).evaluate({{"n", 1}, {"m", 2}}); }, "negative");
  expect_error<ValueError>([&] { (void)(n / m).evaluate({{"n", 1}, {"m", 0}}); }, "zero");
}

TEST(Dim, SymbolsListsEverySymbolSorted) {
  Dim d = Dim("z") * Dim("a") + (Dim("m") + 1) / 2;
  EXPECT_EQ(d.symbols(), (std::vector<std::string>{"a", "m", "z"}));
  EXPECT_TRUE(Dim(3).symbols().empty());
}

TEST(Dim, OrderIsTotalAndConsistentWithEquality) {
  Dim n("n");
  std::vector<Dim> dims = {Dim(0), Dim(1), Dim(2), n, n + 1, 2 * n, n / 2, Dim("m"), n * n};
  for (const Dim& a : dims)
    for (const Dim& b : dims) {
      const bool equal = a == b;
      EXPECT_EQ(!(a < b) && !(b < a), equal) << a.to_string() << " vs " << b.to_string();
      if (a < b) {
        EXPECT_FALSE(b < a);
      }
    }
  std::map<Dim, int> by_dim;
  by_dim[(n + 1) - 1] = 1;
  EXPECT_EQ(by_dim.count(n), 1u);
}

TEST(Dim, OverflowIsAValueError) {
  const Dim big(INT64_MAX);
  EXPECT_THROW((void)(big + 1), ValueError);
  EXPECT_THROW((void)(big * 2), ValueError);
  EXPECT_THROW((void)(Dim("n") * big * big), ValueError);
}

// ---- hostile dims: bounded time, memory and stack --------------------------------------------------

TEST(Dim, DeepParenthesesAreAParseErrorNotAStackOverflow) {
  const std::string deep = std::string(100000, '(') + "n" + std::string(100000, ')');
  expect_error<ParseError>([&] { Dim::parse(deep); }, "nesting deeper than 64");
  EXPECT_THROW(Dim::parse(std::string(100000, '-') + "n"), ParseError);
  // Within the bound nesting still parses.
  EXPECT_EQ(Dim::parse(std::string(60, '(') + "n + 1" + std::string(60, ')')), Dim("n") + 1);
}

TEST(Dim, ProductOfSumsIsRefusedBeforeItExpands) {
  // 8 sums of 8 symbols would expand to 8^8 (16.7M) terms; it stops at kMaxDimTerms.
  std::string sum = "(a+b+c+d+e+f+g+h)", text = sum;
  for (int i = 1; i < 8; ++i) text += "*" + sum;
  expect_error<ParseError>([&] { Dim::parse(text); }, {"expands past 1024 terms", "'(a+b+c+d+e+f+g+h)*"});
  // The same through the API names the operands.
  const Dim s = Dim::parse(sum);
  const Dim p = s * s * s;  // 120 terms: fine
  expect_error<ValueError>([&] { (void)(p * p); }, {"is too large", ") * (a * a * a + "});
}

TEST(Dim, RepeatedSquaringOfASumIsBounded) {
  Dim d = Dim("a") + Dim("b");
  bool refused = false;
  for (int i = 0; i < 20 && !refused; ++i) {
    try {
      d = d * d;
    } catch (const ValueError&) {
      refused = true;
    }
  }
  EXPECT_TRUE(refused);
}

TEST(Dim, NestedFloorDivisionsAreBounded) {
  // Each level doubles the canonical text ((x*a + x*b) // 2 holds x twice) while the text adds a constant.
  std::string text = "n";
  for (int i = 0; i < 40; ++i) text = "((" + text + ")*(a+b))//2";
  EXPECT_THROW(Dim::parse(text), ParseError);
  Dim d("n");
  bool refused = false;
  for (int i = 0; i < 200 && !refused; ++i) {
    try {
      d = (d + 1) / 2 * Dim("m") / 3;
    } catch (const ValueError&) {
      refused = true;
    }
  }
  EXPECT_TRUE(refused);
}

TEST(Dim, HugeTextIsQuotedShortInErrors) {
  const std::string text = std::string(100000, 'a') + " +";
  const std::string message = error_message<ParseError>([&] { Dim::parse(text); });
  EXPECT_LT(message.size(), 400u);
}

// Found by fuzz_dim: a coefficient near INT64_MIN divided by a constant overflowed computing the
// remainder (q * d passed INT64_MIN).
TEST(Dim, FloorDivisionOfACoefficientNearTheMinimumIsExact) {
  // -9223372036854775807 = 44 * -209622091746699451 + 37: the quotient leaves the division.
  const Dim d = Dim::parse("(-9223372036854775807 * x + 1) // 44");
  EXPECT_EQ(d.to_string(), "(37 * x + 1) // 44 - 209622091746699451 * x");
  EXPECT_EQ(Dim::parse(d.to_string()), d);
}

TEST(Dim, LongSumsAreRefusedPastTheTermBound) {
  std::string text = "x0";
  for (int i = 1; i < 2000; ++i) text += "+x" + std::to_string(i);
  expect_error<ParseError>([&] { Dim::parse(text); }, "more than 1024 terms");
}

// ---- Shape --------------------------------------------------------------------------------------

TEST(Shape, StaticHelpers) {
  Shape s = Shape::of({2, 3, 4});
  EXPECT_EQ(s.rank(), 3);
  EXPECT_TRUE(s.is_static());
  EXPECT_EQ(s.static_dims(), (std::vector<int64_t>{2, 3, 4}));
  EXPECT_EQ(s.static_num_elements(), 24);
  EXPECT_EQ(s.num_elements(), Dim(24));
  EXPECT_EQ(s.to_string(), "[2, 3, 4]");
  EXPECT_EQ(Shape().to_string(), "[]");
  EXPECT_EQ(Shape().static_num_elements(), 1);
}

TEST(Shape, SymbolicHelpers) {
  Shape s{"batch", 64, Dim("seq") + 1};
  EXPECT_FALSE(s.is_static());
  EXPECT_EQ(s.to_string(), "[batch, 64, seq + 1]");
  EXPECT_EQ(s.static_num_elements(), std::nullopt);
  EXPECT_EQ(s.num_elements(), Dim("batch") * 64 * (Dim("seq") + 1));
  EXPECT_EQ(s.evaluate({{"batch", 2}, {"seq", 3}}), (std::vector<int64_t>{2, 64, 4}));
  expect_error<ValueError>([&] { (void)s.static_dims(); }, "'batch'");
  EXPECT_EQ(s, (Shape{Dim("batch"), Dim(64), Dim("seq") + 1}));
  EXPECT_NE(s, Shape::of({2, 64, 4}));
}

TEST(Shape, StaticElementCountOverflowIsAValueError) {
  EXPECT_THROW((void)Shape::of({INT64_MAX, 2}).static_num_elements(), ValueError);
}

TEST(NormalizeAxis, WrapsNegativeAxesAndRejectsOutOfRange) {
  EXPECT_EQ(normalize_axis(0, 3, "softmax"), 0);
  EXPECT_EQ(normalize_axis(2, 3, "softmax"), 2);
  EXPECT_EQ(normalize_axis(-1, 3, "softmax"), 2);
  EXPECT_EQ(normalize_axis(-3, 3, "softmax"), 0);
  expect_error<ValueError>([] { normalize_axis(3, 2, "concat"); },
                                      "concat: axis 3 out of range for rank 2");
  EXPECT_THROW(normalize_axis(-3, 2, "x"), ValueError);
  EXPECT_THROW(normalize_axis(0, 0, "x"), ValueError);
}
