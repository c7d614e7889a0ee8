// Type inference of every op, against hand-written expected types, and the errors each class of
// bad input raises.
#include <gtest/gtest.h>

#include "test_util.h"

#include <cstring>
#include <functional>
#include <limits>
#include <set>

#include "kiln/errors.h"
#include "kiln/graph/graph.h"
#include "kiln/graph/ops.h"

using namespace kiln;
using kiln::testing::error_message;
using kiln::testing::expect_error;
using namespace kiln::graph;

namespace {

TensorType T(DType dtype, Shape shape, DeviceRef device = DeviceRef::CPU()) {
  return TensorType{dtype, std::move(shape), device};
}
BufferType B(DType dtype, Shape shape) { return BufferType{dtype, std::move(shape), DeviceRef::CPU()}; }

constexpr DType f32 = DType::f32, f16 = DType::f16, bf16 = DType::bf16, i32 = DType::i32, i64 = DType::i64,
                u8 = DType::u8, boolean = DType::boolean;

void expect_contains(const std::string& text, std::initializer_list<std::string> needles) {
  for (const auto& n : needles) EXPECT_NE(text.find(n), std::string::npos) << "'" << n << "' not in: " << text;
}

using Inputs = std::vector<Value>;

struct Case {
  std::string name;
  std::vector<Type> inputs;
  std::function<std::vector<Value>(Graph&, const Inputs&)> build;
  std::vector<Type> expected;
};

std::vector<Value> one(TensorValue v) { return {v}; }

std::vector<Case> unary_cases() {
  using Fn = TensorValue (*)(const TensorValue&);
  std::vector<std::pair<std::string, Fn>> same_type = {
      {"neg", ops::neg},       {"abs", ops::abs},         {"exp", ops::exp},
      {"log", ops::log},       {"sqrt", ops::sqrt},       {"rsqrt", ops::rsqrt},
      {"sin", ops::sin},       {"cos", ops::cos},         {"tanh", ops::tanh},
      {"sigmoid", ops::sigmoid}, {"silu", ops::silu},     {"relu", ops::relu},
      {"erf", ops::erf},       {"floor", ops::floor},     {"ceil", ops::ceil},
      {"round", ops::round},   {"reciprocal", ops::reciprocal}, {"square", ops::square}};
  std::vector<Case> cases;
  for (auto [name, fn] : same_type)
    cases.push_back({name, {T(f16, {"batch", 8})},
                     [fn](Graph&, const Inputs& in) { return one(fn(in[0])); },
                     {T(f16, {"batch", 8})}});
  cases.push_back({"gelu_tanh", {T(f32, {3})},
                   [](Graph&, const Inputs& in) { return one(ops::gelu(in[0], true)); },
                   {T(f32, {3})}});
  cases.push_back({"logical_not", {T(boolean, {2, 2})},
                   [](Graph&, const Inputs& in) { return one(ops::logical_not(in[0])); },
                   {T(boolean, {2, 2})}});
  cases.push_back({"is_nan_gives_bool", {T(f32, {"n"})},
                   [](Graph&, const Inputs& in) { return one(ops::is_nan(in[0])); },
                   {T(boolean, {"n"})}});
  cases.push_back({"neg_signed_int", {T(i32, {4})},
                   [](Graph&, const Inputs& in) { return one(ops::neg(in[0])); }, {T(i32, {4})}});
  cases.push_back({"abs_unsigned", {T(u8, {4})},
                   [](Graph&, const Inputs& in) { return one(ops::abs(in[0])); }, {T(u8, {4})}});
  return cases;
}

std::vector<Case> binary_cases() {
  using Fn = TensorValue (*)(const TensorValue&, const TensorValue&);
  std::vector<Case> cases;
  std::vector<std::pair<std::string, Fn>> arithmetic = {
      {"add", ops::add}, {"sub", ops::sub}, {"mul", ops::mul}, {"div", ops::div},
      {"mod", ops::mod}, {"pow", ops::pow}, {"maximum", ops::maximum}, {"minimum", ops::minimum}};
  for (auto [name, fn] : arithmetic)
    cases.push_back({name + "_broadcasts_symbolic", {T(f32, {"batch", 1}), T(f32, {1, 64})},
                     [fn](Graph&, const Inputs& in) { return one(fn(in[0], in[1])); },
                     {T(f32, {"batch", 64})}});
  std::vector<std::pair<std::string, Fn>> comparisons = {
      {"equal", ops::equal}, {"not_equal", ops::not_equal}, {"greater", ops::greater},
      {"greater_equal", ops::greater_equal}, {"less", ops::less}, {"less_equal", ops::less_equal}};
  for (auto [name, fn] : comparisons)
    cases.push_back({name + "_gives_bool", {T(i64, {5, 1, 3}), T(i64, {4, 1})},
                     [fn](Graph&, const Inputs& in) { return one(fn(in[0], in[1])); },
                     {T(boolean, {5, 4, 3})}});
  std::vector<std::pair<std::string, Fn>> logical = {
      {"logical_and", ops::logical_and}, {"logical_or", ops::logical_or},
      {"logical_xor", ops::logical_xor}};
  for (auto [name, fn] : logical)
    cases.push_back({name, {T(boolean, {}), T(boolean, {"seq", 2})},
                     [fn](Graph&, const Inputs& in) { return one(fn(in[0], in[1])); },
                     {T(boolean, {"seq", 2})}});
  cases.push_back({"add_rank0_and_matrix", {T(f32, {}), T(f32, {2, 3})},
                   [](Graph&, const Inputs& in) { return one(ops::add(in[0], in[1])); },
                   {T(f32, {2, 3})}});
  cases.push_back({"add_on_gpu_keeps_device",
                   {T(f32, {2}, DeviceRef::GPU(1)), T(f32, {2}, DeviceRef::GPU(1))},
                   [](Graph&, const Inputs& in) { return one(ops::add(in[0], in[1])); },
                   {T(f32, {2}, DeviceRef::GPU(1))}});
  return cases;
}

std::vector<Case> other_cases() {
  std::vector<Case> c;
  // sources
  c.push_back({"constant_vector", {},
               [](Graph&, const Inputs&) { return one(ops::constant(std::vector<int32_t>{1, 2, 3, 4, 5, 6}, {2, 3})); },
               {T(i32, {2, 3})}});
  c.push_back({"constant_scalar", {},
               [](Graph&, const Inputs&) { return one(ops::constant(2.5, f16, DeviceRef::GPU())); },
               {T(f16, {}, DeviceRef::GPU())}});
  c.push_back({"weight", {},
               [](Graph& g, const Inputs&) { return one(g.weight({"w", f16, {64, "n"}})); },
               {T(f16, {64, "n"})}});
  c.push_back({"range_symbolic", {},
               [](Graph&, const Inputs&) { return one(ops::range(0, 1, Dim("seq"), i64)); },
               {T(i64, {"seq"})}});
  // other elementwise
  c.push_back({"where_broadcasts_three", {T(boolean, {"b", 1, 1}), T(f32, {4, 1}), T(f32, {5})},
               [](Graph&, const Inputs& in) { return one(ops::where(in[0], in[1], in[2])); },
               {T(f32, {"b", 4, 5})}});
  c.push_back({"cast", {T(f32, {"b", 3})},
               [](Graph&, const Inputs& in) { return one(ops::cast(in[0], boolean)); },
               {T(boolean, {"b", 3})}});
  // matmul
  auto mm = [](Graph&, const Inputs& in) { return one(ops::matmul(in[0], in[1])); };
  c.push_back({"matmul_2d_symbolic", {T(f32, {"batch", 64}), T(f32, {64, 10})}, mm, {T(f32, {"batch", 10})}});
  c.push_back({"matmul_batch_broadcast", {T(f32, {2, 1, 3, 4}), T(f32, {5, 4, 6})}, mm, {T(f32, {2, 5, 3, 6})}});
  c.push_back({"matmul_vector_vector", {T(f32, {4}), T(f32, {4})}, mm, {T(f32, {})}});
  c.push_back({"matmul_vector_matrix", {T(f32, {4}), T(f32, {7, 4, 3})}, mm, {T(f32, {7, 3})}});
  c.push_back({"matmul_matrix_vector", {T(i32, {"m", 4}), T(i32, {4})}, mm, {T(i32, {"m"})}});
  // reductions
  using Red = TensorValue (*)(const TensorValue&, int64_t);
  std::vector<std::tuple<std::string, Red, DType>> reductions = {
      {"sum", ops::sum, f32}, {"mean", ops::mean, f32}, {"max", ops::max, f32},
      {"min", ops::min, f32}, {"argmax", ops::argmax, i64}, {"argmin", ops::argmin, i64}};
  for (auto [name, fn, dtype] : reductions)
    c.push_back({name + "_keeps_axis", {T(f32, {"b", 7, 3})},
                 [fn](Graph&, const Inputs& in) { return one(fn(in[0], -2)); },
                 {T(dtype, {"b", 1, 3})}});
  c.push_back({"cumsum", {T(i32, {"b", 7})},
               [](Graph&, const Inputs& in) { return one(ops::cumsum(in[0], 0, true, true)); },
               {T(i32, {"b", 7})}});
  c.push_back({"top_k", {T(f32, {"b", 50})},
               [](Graph&, const Inputs& in) {
                 auto r = ops::top_k(in[0], 5);
                 return std::vector<Value>{r[0], r[1]};
               },
               {T(f32, {"b", 5}), T(i64, {"b", 5})}});
  // normalization
  c.push_back({"softmax", {T(f16, {"b", 9})},
               [](Graph&, const Inputs& in) { return one(ops::softmax(in[0])); }, {T(f16, {"b", 9})}});
  c.push_back({"log_softmax", {T(f32, {2, 9})},
               [](Graph&, const Inputs& in) { return one(ops::log_softmax(in[0], 0)); }, {T(f32, {2, 9})}});
  c.push_back({"rms_norm", {T(f32, {"b", "s", 64}), T(f32, {64})},
               [](Graph&, const Inputs& in) { return one(ops::rms_norm(in[0], in[1])); },
               {T(f32, {"b", "s", 64})}});
  c.push_back({"layer_norm", {T(f32, {"b", 8}), T(f32, {8}), T(f32, {8})},
               [](Graph&, const Inputs& in) { return one(ops::layer_norm(in[0], in[1], in[2])); },
               {T(f32, {"b", 8})}});
  // shape and data movement
  c.push_back({"reshape_symbolic", {T(f32, {"batch", 4})},
               [](Graph&, const Inputs& in) { return one(ops::reshape(in[0], Shape{"batch", 2, 2})); },
               {T(f32, {"batch", 2, 2})}});
  c.push_back({"reshape_infers_minus_one", {T(f32, {2, 6})},
               [](Graph&, const Inputs& in) { return one(ops::reshape(in[0], std::vector<int64_t>{-1, 3})); },
               {T(f32, {4, 3})}});
  c.push_back({"reshape_infers_symbolic_minus_one", {T(f32, {"batch", 4})},
               [](Graph&, const Inputs& in) { return one(ops::reshape(in[0], std::vector<int64_t>{-1, 2, 2})); },
               {T(f32, {"batch", 2, 2})}});
  c.push_back({"transpose", {T(f32, {"a", 2, 3})},
               [](Graph&, const Inputs& in) { return one(ops::transpose(in[0], 0, -1)); },
               {T(f32, {3, 2, "a"})}});
  c.push_back({"permute", {T(f32, {"a", 2, 3})},
               [](Graph&, const Inputs& in) { return one(ops::permute(in[0], {1, -1, 0})); },
               {T(f32, {2, 3, "a"})}});
  c.push_back({"broadcast_to", {T(f32, {1, 3})},
               [](Graph&, const Inputs& in) { return one(ops::broadcast_to(in[0], {"b", 4, 3})); },
               {T(f32, {"b", 4, 3})}});
  c.push_back({"concat_sums_axis", {T(f32, {2, "n"}), T(f32, {2, 3}), T(f32, {2, "m"})},
               [](Graph&, const Inputs& in) { return one(ops::concat({in[0], in[1], in[2]}, -1)); },
               {T(f32, {2, Dim("n") + Dim(3) + Dim("m")})}});
  c.push_back({"split", {T(f32, {"b", 10})},
               [](Graph&, const Inputs& in) {
                 auto r = ops::split(in[0], {3, 7}, 1);
                 return std::vector<Value>(r.begin(), r.end());
               },
               {T(f32, {"b", 3}), T(f32, {"b", 7})}});
  c.push_back({"split_symbolic", {T(f32, {Dim("n") * Dim(2)})},
               [](Graph&, const Inputs& in) {
                 auto r = ops::split(in[0], {"n", "n"});
                 return std::vector<Value>(r.begin(), r.end());
               },
               {T(f32, {"n"}), T(f32, {"n"})}});
  c.push_back({"slice_symbolic_stop", {T(f32, {"seq", 4})},
               [](Graph&, const Inputs& in) { return one(ops::slice(in[0], {{0, Dim("n")}})); },
               {T(f32, {"n", 4})}});
  c.push_back({"slice_negative_and_steps", {T(f32, {10, 8, 5})},
               [](Graph&, const Inputs& in) {
                 return one(ops::slice(in[0], {{-3}, {1, 100, 3}, {4, 1}}));
               },
               {T(f32, {3, 3, 0})}});
  c.push_back({"slice_last_of_symbolic", {T(f32, {"seq", 4})},
               [](Graph&, const Inputs& in) { return one(ops::slice(in[0], {{-1}})); },
               {T(f32, {1, 4})}});
  c.push_back({"gather", {T(f16, {5, 6, 7}), T(i32, {"b", 2})},
               [](Graph&, const Inputs& in) { return one(ops::gather(in[0], in[1], 1)); },
               {T(f16, {5, "b", 2, 7})}});
  c.push_back({"scatter", {T(f32, {5, 6}), T(f32, {5, 2}), T(i64, {2})},
               [](Graph&, const Inputs& in) { return one(ops::scatter(in[0], in[1], in[2], -1)); },
               {T(f32, {5, 6})}});
  // buffers, devices, calls, extensions
  c.push_back({"buffer_load_slice", {B(f32, {16, 64})},
               [](Graph&, const Inputs& in) { return one(ops::buffer_load(in[0], {{2, 6}})); },
               {T(f32, {4, 64})}});
  c.push_back({"buffer_store_has_no_results", {B(f32, {16, 64}), T(f32, {1, 64})},
               [](Graph&, const Inputs& in) {
                 ops::buffer_store(in[0], in[1], {{3, 4}});
                 return std::vector<Value>{};
               },
               {}});
  c.push_back({"transfer_to", {T(f32, {"b"})},
               [](Graph&, const Inputs& in) { return one(ops::transfer_to(in[0], DeviceRef::GPU(2))); },
               {T(f32, {"b"}, DeviceRef::GPU(2))}});
  c.push_back({"call_returns_callee_outputs", {T(f32, {"b", 3})},
               [](Graph& g, const Inputs& in) {
                 Graph callee("callee_of_call", {T(f32, {"b", 3})}, &g.module());
                 TensorValue x = callee.input(0);
                 callee.output({x, ops::sum(x)});
                 return ops::call("callee_of_call", {in[0]});
               },
               {T(f32, {"b", 3}), T(f32, {"b", 1})}});
  c.push_back({"custom_declares_results", {T(f32, {4})},
               [](Graph&, const Inputs& in) {
                 return ops::custom("my_op", {in[0]}, {T(i32, {2}), B(u8, {8})}, {{"alpha", 0.5}});
               },
               {T(i32, {2}), B(u8, {8})}});
  c.push_back({"inplace_custom_has_no_results", {B(f32, {4}), T(f32, {4})},
               [](Graph&, const Inputs& in) {
                 ops::inplace_custom("fill", {in[0], in[1]});
                 return std::vector<Value>{};
               },
               {}});
  // paged KV cache: [layers, num_blocks, block_size, kv_heads, head_dim], a ragged batch of "tokens"
  c.push_back({"paged_kv_store_has_no_results",
               {B(DType::bf16, {2, "blocks", 16, 2, 64}), T(f32, {"tokens", 2, 64}), T(i64, {"tokens"})},
               [](Graph&, const Inputs& in) {
                 ops::paged_kv_store(in[0], in[1], in[2], 1);
                 return std::vector<Value>{};
               },
               {}});
  c.push_back({"paged_attention_is_q_shaped",
               {T(f32, {"tokens", 8, 64}), B(f16, {2, "blocks", 16, 2, 64}), B(f16, {2, "blocks", 16, 2, 64}),
                T(i64, {"seqs", "max_blocks"}), T(i64, {"tokens"}), T(i64, {"tokens"})},
               [](Graph&, const Inputs& in) {
                 return one(ops::paged_attention(in[0], in[1], in[2], in[3], in[4], in[5], 0, 0.125));
               },
               {T(f32, {"tokens", 8, 64})}});
  return c;
}

std::vector<Case> all_cases() {
  std::vector<Case> all;
  for (auto* f : {unary_cases, binary_cases, other_cases})
    for (auto& c : f()) all.push_back(std::move(c));
  return all;
}

std::string types_text(const std::vector<Type>& types) {
  std::string s;
  for (const auto& t : types) s += to_string(t) + " ";
  return s;
}

}  // namespace

TEST(OpTypes, EveryOpInfersTheExpectedTypes) {
  std::set<Op> covered;
  for (const Case& c : all_cases()) {
    SCOPED_TRACE(c.name);
    Module module;
    Graph g(c.name, c.inputs, &module);
    Graph::Scope scope(g);
    std::vector<Value> results;
    try {
      results = c.build(g, g.inputs());
    } catch (const std::exception& e) {
      ADD_FAILURE() << c.name << " threw: " << e.what();
      continue;
    }
    std::vector<Type> got;
    for (const Value& v : results) got.push_back(v.type());
    EXPECT_EQ(got, c.expected) << "got " << types_text(got) << "expected " << types_text(c.expected);
    for (const Node& n : g.ir().nodes) covered.insert(n.op);
    // The verifier (run by output) agrees with the builders.
    g.output(results.empty() ? std::vector<Value>{g.input(0)} : results);
  }
  std::vector<std::string> missing;
  for (uint16_t i = 0; i <= static_cast<uint16_t>(Op::inplace_custom); ++i)
    if (!covered.count(static_cast<Op>(i))) missing.emplace_back(op_name(static_cast<Op>(i)));
  EXPECT_TRUE(missing.empty()) << "ops without a case: " << ::testing::PrintToString(missing);
}

// ---- attribute normalization --------------------------------------------------------------------

TEST(OpTypes, BuildersStoreNonNegativeAxes) {
  Graph g("axes", {T(f32, {2, 3, 4})});
  TensorValue x = g.input(0);
  ops::sum(x, -1);
  ops::softmax(x, -3);
  ops::transpose(x, -1, 0);
  const auto& nodes = g.ir().nodes;
  EXPECT_EQ(std::get<int64_t>(nodes[0].attrs.at("axis")), 2);
  EXPECT_EQ(std::get<int64_t>(nodes[1].attrs.at("axis")), 0);
  EXPECT_EQ(std::get<std::vector<int64_t>>(nodes[2].attrs.at("perm")), (std::vector<int64_t>{2, 1, 0}));
  EXPECT_THROW(ops::sum(x, 3), ValueError);
  EXPECT_THROW(ops::sum(x, -4), ValueError);
}

TEST(OpTypes, SliceFollowsPythonIndexing) {
  Graph g("slices", {T(f32, {10}), T(f32, {"seq"})});
  TensorValue x = g.input(0);
  auto bounds = [&](const TensorValue& v) {
    const Node& n = g.ir().nodes.back();
    EXPECT_EQ(n.outputs[0], v.id());
    return std::make_tuple(std::get<Shape>(n.attrs.at("starts")), std::get<Shape>(n.attrs.at("stops")),
                           std::get<std::vector<int64_t>>(n.attrs.at("steps")));
  };
  // x[-3:] -> [7, 10)
  EXPECT_EQ(bounds(ops::slice(x, {{-3}})), std::make_tuple(Shape{7}, Shape{10}, std::vector<int64_t>{1}));
  // x[2:-1:4] -> [2, 9) step 4, 2 elements (2, 6)
  auto y = ops::slice(x, {{2, -1, 4}});
  EXPECT_EQ(y.shape(), Shape{2});
  // x[-100:100] clamps to the whole axis
  EXPECT_EQ(ops::slice(x, {{-100, 100}}).shape(), Shape{10});
  // x[8:3] is empty
  EXPECT_EQ(ops::slice(x, {{8, 3}}).shape(), Shape{0});
  // step 0 is an error
  EXPECT_THROW(ops::slice(x, {{0, 5, 0}}), ValueError);
  // more indices than axes
  EXPECT_THROW(ops::slice(x, {{0}, {0}}), ValueError);
  // On a symbolic axis a negative bound counts from the symbol: s[-2:] is [seq - 2, seq).
  TensorValue s = g.input(1);
  auto tail = ops::slice(s, {{-2}});
  EXPECT_EQ(tail.shape(), Shape{2});
  EXPECT_EQ(std::get<0>(bounds(tail)), Shape{Dim("seq") - Dim(2)});
}

TEST(OpTypes, ReshapeRejectsTwoInferredDims) {
  Graph g("r", {T(f32, {2, 6})});
  EXPECT_THROW(ops::reshape(g.input(0), std::vector<int64_t>{-1, -1}), ValueError);
  auto msg = error_message<ValueError>([&] { ops::reshape(g.input(0), std::vector<int64_t>{-1, 5}); });
  expect_contains(msg, {"reshape", "f32[2, 6]", "-1"});
}

TEST(OpTypes, ScalarConstantHoldsTheConvertedValue) {
  Graph g("c", {});
  Graph::Scope scope(g);
  auto c = ops::constant(-3.0, i32);
  const Bytes& bytes = std::get<Bytes>(g.ir().nodes.back().attrs.at("value"));
  int32_t v;
  ASSERT_EQ(bytes.size(), 4u);
  std::memcpy(&v, bytes.data(), 4);
  EXPECT_EQ(v, -3);
  EXPECT_EQ(c.type(), Type(T(i32, {})));
  EXPECT_THROW(ops::constant(300.0, DType::u8), ValueError);
}

// ---- errors, one per class ----------------------------------------------------------------------

TEST(OpErrors, BroadcastMismatchNamesOpTypesAndAxis) {
  Graph g("e", {T(f32, {"batch", 3}), T(f32, {4})});
  auto msg = error_message<ShapeError>([&] { ops::add(g.input(0), g.input(1)); });
  expect_contains(msg, {"add", "f32[batch, 3]", "f32[4]", "axis 1"});
}

TEST(OpErrors, SymbolicDimsThatDifferDoNotBroadcast) {
  Graph g("e", {T(f32, {"a"}), T(f32, {"b"})});
  auto msg = error_message<ShapeError>([&] { ops::mul(g.input(0), g.input(1)); });
  expect_contains(msg, {"mul", "f32[a]", "f32[b]", "axis 0"});
}

TEST(OpErrors, DTypeMismatchNamesBothTypes) {
  Graph g("e", {T(f32, {2}), T(i32, {2})});
  auto msg = error_message<DTypeError>([&] { ops::sub(g.input(0), g.input(1)); });
  expect_contains(msg, {"sub", "f32[2]", "i32[2]"});
}

TEST(OpErrors, ArithmeticRejectsBoolAndLogicalRequiresBool) {
  Graph g("e", {T(boolean, {2}), T(f32, {2})});
  expect_contains(error_message<DTypeError>([&] { ops::add(g.input(0), g.input(0)); }), {"add", "bool[2]"});
  expect_contains(error_message<DTypeError>([&] { ops::logical_or(g.input(1), g.input(1)); }),
                  {"logical_or", "f32[2]"});
  expect_contains(error_message<DTypeError>([&] { ops::logical_not(g.input(1)); }), {"logical_not", "f32[2]"});
}

TEST(OpErrors, FloatOnlyUnaryRejectsIntegers) {
  Graph g("e", {T(i32, {4}), T(u8, {4})});
  for (auto fn : {ops::exp, ops::sqrt, ops::sigmoid, ops::is_nan, ops::floor}) {
    auto msg = error_message<DTypeError>([&] { fn(g.input(0)); });
    expect_contains(msg, {"i32[4]"});
  }
  expect_contains(error_message<DTypeError>([&] { ops::exp(g.input(0)); }), {"exp", "float"});
  expect_contains(error_message<DTypeError>([&] { ops::neg(g.input(1)); }), {"neg", "u8[4]"});
  expect_contains(error_message<DTypeError>([&] { ops::mean(g.input(0)); }), {"mean", "i32[4]"});
  expect_contains(error_message<DTypeError>([&] { ops::softmax(g.input(0)); }), {"softmax", "i32[4]"});
}

TEST(OpErrors, MatmulInnerDimMismatchMessage) {
  Graph g("e", {T(f32, {"batch", 64}), T(f32, {128, 10}), T(f32, {2, 3, 64}), T(f32, {2, 128, 10})});
  EXPECT_EQ(error_message<ShapeError>([&] { ops::matmul(g.input(0), g.input(1)); }),
            "matmul: lhs inner dim 64 does not match rhs dim 0 of 128 (lhs f32[batch, 64], rhs f32[128, 10])");
  EXPECT_EQ(error_message<ShapeError>([&] { ops::matmul(g.input(2), g.input(3)); }),
            "matmul: lhs inner dim 64 does not match rhs dim 1 of 128 (lhs f32[2, 3, 64], rhs f32[2, 128, 10])");
}

TEST(OpErrors, MatmulBatchAndDTypeChecks) {
  Graph g("e", {T(f32, {2, 3, 4}), T(f32, {5, 4, 6}), T(boolean, {2, 2}), T(f16, {4, 6})});
  expect_contains(error_message<ShapeError>([&] { ops::matmul(g.input(0), g.input(1)); }),
                  {"matmul", "batch", "f32[2, 3, 4]", "f32[5, 4, 6]"});
  expect_contains(error_message<DTypeError>([&] { ops::matmul(g.input(2), g.input(2)); }), {"matmul", "bool"});
  // f32 activations with f16/bf16 weights is the one allowed mix; the other way round is not.
  expect_contains(error_message<DTypeError>([&] { ops::matmul(g.input(3), g.input(0)); }),
                  {"matmul", "f32[2, 3, 4]", "f16[4, 6]"});
}

TEST(OpErrors, DevicesMustMatch) {
  Graph g("e", {T(f32, {2}), T(f32, {2}, DeviceRef::GPU(0))});
  expect_contains(error_message<ValueError>([&] { ops::add(g.input(0), g.input(1)); }),
                  {"add", "cpu:0", "gpu:0"});
}

TEST(OpErrors, BufferIsNotATensorOperand) {
  Graph g("e", {B(f32, {2}), T(f32, {2})});
  expect_contains(error_message<ValueError>([&] { infer_types(Op::add, {B(f32, {2}), T(f32, {2})}, {}, nullptr); }),
                  {"add", "lhs", "buffer<f32[2]>"});
  // The typed handle itself refuses the conversion.
  EXPECT_THROW(TensorValue(g.input(0)), ValueError);
}

TEST(OpErrors, OperandFromAnotherGraphNamesOpAndIndex) {
  Module m;
  Graph a("a", {T(f32, {2})}, &m);
  Graph b("b", {T(f32, {2})}, &m);
  expect_contains(error_message<ValueError>([&] { ops::add(a.input(0), b.input(0)); }),
                  {"add", "operand 1", "'b'"});
}

TEST(OpErrors, ShapeOpsRejectBadShapes) {
  Graph g("e", {T(f32, {"batch", 4}), T(f32, {2, 3}), T(f32, {2, 4})});
  expect_contains(error_message<ShapeError>([&] { ops::reshape(g.input(0), Shape{"batch", 3}); }),
                  {"reshape", "f32[batch, 4]", "[batch, 3]"});
  expect_contains(error_message<ShapeError>([&] { ops::reshape(g.input(0), Shape{"other", 4}); }),
                  {"reshape", "[other, 4]"});
  expect_contains(error_message<ShapeError>([&] { ops::reshape(g.input(1), Shape{5}); }), {"reshape", "f32[2, 3]"});
  expect_contains(error_message<ValueError>([&] { ops::permute(g.input(1), {0, 0}); }),
                  {"transpose", "perm", "f32[2, 3]"});
  expect_contains(error_message<ShapeError>([&] { ops::broadcast_to(g.input(1), Shape{4, 3}); }),
                  {"broadcast_to", "f32[2, 3]", "[4, 3]"});
  // [2, 3] and [2, 4] join along axis 1 but not along axis 0, where axis 1 differs.
  EXPECT_EQ(ops::concat({g.input(1), g.input(2)}, 1).shape(), (Shape{2, 7}));
  expect_contains(error_message<ShapeError>([&] { ops::concat({g.input(1), g.input(2)}, 0); }),
                  {"concat", "axis 1", "f32[2, 3]", "f32[2, 4]"});
  expect_contains(error_message<ShapeError>([&] { ops::split(g.input(2), {1, 2}, 1); }),
                  {"split", "[1, 2]", "f32[2, 4]"});
  expect_contains(error_message<ShapeError>([&] { ops::top_k(g.input(1), 4); }), {"top_k", "f32[2, 3]"});
}

TEST(OpErrors, SliceAttrsOutOfRangeAreShapeErrors) {
  Attrs attrs{{"starts", Shape{2}}, {"stops", Shape{6}}, {"steps", std::vector<int64_t>{1}}};
  expect_contains(error_message<ShapeError>([&] { infer_types(Op::slice, {T(f32, {4})}, attrs, nullptr); }),
                  {"slice", "f32[4]", "axis 0"});
  Attrs short_attrs{{"starts", Shape{}}, {"stops", Shape{}}, {"steps", std::vector<int64_t>{}}};
  EXPECT_THROW(infer_types(Op::slice, {T(f32, {4})}, short_attrs, nullptr), ValueError);
}

TEST(OpErrors, IndexedOpsCheckIndicesAndUpdates) {
  Graph g("e", {T(f32, {5, 6}), T(f32, {2}), T(i64, {2}), T(f32, {5, 3})});
  expect_contains(error_message<DTypeError>([&] { ops::gather(g.input(0), g.input(1)); }),
                  {"gather", "indices", "f32[2]"});
  expect_contains(error_message<ShapeError>([&] { ops::scatter(g.input(0), g.input(3), g.input(2), 1); }),
                  {"scatter", "[5, 2]", "f32[5, 3]"});
}

TEST(OpErrors, NormParametersMustMatchLastDim) {
  Graph g("e", {T(f32, {"b", 64}), T(f32, {32}), T(f16, {64}), T(i32, {"b", 64})});
  expect_contains(error_message<ShapeError>([&] { ops::rms_norm(g.input(0), g.input(1)); }),
                  {"rms_norm", "weight", "f32[32]", "f32[b, 64]"});
  expect_contains(error_message<DTypeError>([&] { ops::layer_norm(g.input(0), g.input(2), g.input(2)); }),
                  {"layer_norm", "f16[64]"});
  EXPECT_THROW(ops::rms_norm(g.input(3), g.input(2)), DTypeError);
}

TEST(OpErrors, WhereNeedsBoolCondition) {
  Graph g("e", {T(f32, {2}), T(f32, {2})});
  expect_contains(error_message<DTypeError>([&] { ops::where(g.input(0), g.input(0), g.input(1)); }),
                  {"where", "condition f32[2]"});
}

TEST(OpErrors, BufferStoreValueMustMatchSlice) {
  Graph g("e", {B(f32, {16, 64}), T(f32, {2, 64}), T(f16, {1, 64})});
  expect_contains(error_message<ShapeError>([&] { ops::buffer_store(g.input(0), g.input(1), {{0, 1}}); }),
                  {"buffer_store", "[1, 64]", "f32[2, 64]"});
  EXPECT_THROW(ops::buffer_store(g.input(0), g.input(2), {{0, 1}}), DTypeError);
  expect_contains(error_message<ValueError>([&] { ops::inplace_custom("k", {g.input(1)}); }),
                  {"inplace_custom", "buffer"});
}

TEST(OpErrors, PagedKvStoreChecksCacheValueSlotsAndLayer) {
  Graph g("e", {B(f32, {2, "blocks", 16, 2, 64}), T(f32, {"tokens", 2, 64}), T(i64, {"tokens"}),
                T(f32, {"tokens", 4, 64}), T(i32, {"tokens"}), T(f16, {"tokens", 2, 64}), B(f32, {2, 16, 2, 64}),
                T(i64, {"n"}), B(i32, {2, 4, 16, 2, 64})});
  auto cache = g.input(0), value = g.input(1), slots = g.input(2);
  expect_contains(error_message<ValueError>([&] { ops::paged_kv_store(cache, value, slots, 2); }),
                  {"paged_kv_store", "layer 2", "2 layers"});
  expect_contains(error_message<ValueError>([&] { ops::paged_kv_store(cache, value, slots, -1); }),
                  {"paged_kv_store", "layer -1"});
  expect_contains(error_message<ShapeError>([&] { ops::paged_kv_store(cache, g.input(3), slots, 0); }),
                  {"paged_kv_store", "value must be [tokens, 2, 64]", "value f32[tokens, 4, 64]"});
  expect_contains(error_message<DTypeError>([&] { ops::paged_kv_store(cache, value, g.input(4), 0); }),
                  {"paged_kv_store", "slots must be i64[tokens]", "i32[tokens]"});
  expect_contains(error_message<DTypeError>([&] { ops::paged_kv_store(cache, g.input(5), slots, 0); }),
                  {"paged_kv_store", "value must be f32 or the cache's f32"});
  expect_contains(error_message<ShapeError>([&] { ops::paged_kv_store(g.input(6), value, slots, 0); }),
                  {"paged_kv_store", "cache must be [layers, num_blocks, block_size, kv_heads, head_dim]"});
  expect_contains(error_message<ShapeError>([&] { ops::paged_kv_store(cache, value, g.input(7), 0); }),
                  {"paged_kv_store", "slots must have one entry per token"});
  expect_contains(error_message<DTypeError>([&] { ops::paged_kv_store(g.input(8), value, slots, 0); }),
                  {"paged_kv_store", "cache must be f32, bf16 or f16"});
}

TEST(OpErrors, PagedAttentionChecksEveryOperand) {
  const Shape cache_shape{2, "blocks", 16, 2, 64};
  Graph g("e", {T(f32, {"tokens", 8, 64}), B(bf16, cache_shape), B(bf16, cache_shape), T(i64, {"seqs", "max_blocks"}),
                T(i64, {"tokens"}), T(i64, {"tokens"}), T(f32, {"tokens", 8, 32}), T(f32, {"tokens", 3, 64}),
                B(f16, cache_shape), T(i64, {"seqs"}), T(i64, {"n"}), T(i32, {"tokens"}), T(i64, {"tokens", 8, 64})});
  auto q = g.input(0), k = g.input(1), v = g.input(2), tables = g.input(3), seq_ids = g.input(4),
       positions = g.input(5);
  auto attend = [&](const Value& q_, const Value& k_, const Value& v_, const Value& tables_, const Value& seq_ids_,
                    const Value& positions_, int64_t layer = 0, double scale = 0.125) {
    ops::paged_attention(q_, k_, v_, tables_, seq_ids_, positions_, layer, scale);
  };
  expect_contains(error_message<ValueError>([&] { attend(q, k, v, tables, seq_ids, positions, 2); }),
                  {"paged_attention", "layer 2", "k_cache"});
  expect_contains(error_message<ShapeError>([&] { attend(g.input(6), k, v, tables, seq_ids, positions); }),
                  {"paged_attention", "q's head_dim 32 differs from the cache's 64"});
  expect_contains(error_message<ShapeError>([&] { attend(g.input(7), k, v, tables, seq_ids, positions); }),
                  {"paged_attention", "static multiple", "q f32[tokens, 3, 64]"});
  expect_contains(error_message<ShapeError>([&] { attend(q, k, g.input(8), tables, seq_ids, positions); }),
                  {"paged_attention", "k_cache and v_cache must have one type"});
  expect_contains(error_message<ShapeError>([&] { attend(q, k, v, g.input(9), seq_ids, positions); }),
                  {"paged_attention", "block_tables must be i64[seqs, max_blocks_per_seq]"});
  expect_contains(error_message<ShapeError>([&] { attend(q, k, v, tables, g.input(10), positions); }),
                  {"paged_attention", "seq_ids and positions must have one entry per token"});
  expect_contains(error_message<DTypeError>([&] { attend(q, k, v, tables, seq_ids, g.input(11)); }),
                  {"paged_attention", "positions must be i64[tokens]", "i32[tokens]"});
  expect_contains(error_message<DTypeError>([&] { attend(g.input(12), k, v, tables, seq_ids, positions); }),
                  {"paged_attention", "q must have a float dtype"});
  expect_contains(error_message<ValueError>([&] {
                    attend(q, k, v, tables, seq_ids, positions, 0, std::numeric_limits<double>::infinity());
                  }),
                  {"paged_attention", "scale must be finite"});
}

TEST(OpErrors, CallChecksCalleeAndArguments) {
  Module m;
  Graph callee("f", {T(f32, {4})}, &m);
  callee.output({ops::exp(callee.input(0))});
  Graph caller("main", {T(f32, {4}), T(f32, {5})}, &m);
  expect_contains(error_message<ValueError>([&] { ops::call("nope", {caller.input(0)}); }), {"call", "'nope'"});
  expect_contains(error_message<ValueError>([&] { ops::call("f", {caller.input(1)}); }),
                  {"call", "argument 0", "f32[5]", "f32[4]"});
  Graph unfinished("g", {T(f32, {4})}, &m);
  expect_contains(error_message<ValueError>([&] { ops::call("g", {caller.input(0)}); }), {"'g'", "no outputs"});
}

TEST(OpErrors, ConstantDataMustFillShape) {
  Graph g("e", {});
  Graph::Scope scope(g);
  expect_contains(error_message<ValueError>([&] { ops::constant(Bytes(7), f32, {2}); }),
                  {"constant", "7 bytes", "f32[2]"});
}

TEST(OpErrors, OpsWithoutOperandsNeedAnEnteredGraph) {
  expect_contains(error_message<ValueError>([&] { ops::constant(1.0, f32); }), {"Graph::current"});
}
