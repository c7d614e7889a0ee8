#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <set>

#include "kiln/errors.h"
#include "kiln/graph/ops.h"
#include "kiln/graph/text.h"

using namespace kiln;
using namespace kiln::graph;

namespace {

const std::vector<Op> kEveryOp = {
#define KILN_TEST_OP(e, s) Op::e,
    KILN_OPS(KILN_TEST_OP)
#undef KILN_TEST_OP
};

TensorType f32(Shape s) { return TensorType{DType::f32, std::move(s)}; }

// A module whose graphs together use every op and every attribute kind. `main` is added before its
// callee `helper.v2`, so the text calls a graph defined further down.
Module build_every_op_module() {
  Module m;
  Graph main("main",
             {f32({"batch", 8}), BufferType{DType::f32, Shape{16, 8}}, TensorType{DType::i64, {"batch"}},
              f32({Dim("seq") + 1, 4}),
              BufferType{DType::bf16, Shape{2, "blocks", 4, 1, 4}}, TensorType{DType::i64, {"seqs", "max_blocks"}}},
             &m);
  Graph helper("helper.v2", {f32({"batch", 8})}, &m);
  {
    Graph::Scope scope(helper);
    helper.output({ops::relu(helper.input(0))});
  }

  Graph::Scope scope(main);
  TensorValue x = main.input(0);
  BufferValue cache = main.input(1);
  TensorValue idx = main.input(2);
  TensorValue y = main.input(3);
  BufferValue paged_cache = main.input(4);
  TensorValue block_tables = main.input(5);
  std::vector<Value> outs;

  TensorValue w = main.weight({"w1", DType::f32, Shape{8, 8}});
  TensorValue c = ops::constant(std::vector<float>{1, 2, 3, 4, 5, 6, 7, 8}, Shape{8});
  TensorValue r = ops::range(0.0, 0.5, 8, DType::f32);
  TensorValue t = ops::matmul(x, w);  // [batch, 8]

  // Elementwise unary chain.
  t = ops::abs(ops::neg(t));
  t = ops::rsqrt(ops::sqrt(ops::log(ops::exp(t))));
  t = ops::sigmoid(ops::tanh(ops::cos(ops::sin(t))));
  t = ops::gelu(ops::silu(t), /*tanh_approximation=*/true);
  t = ops::erf(ops::relu(t));
  t = ops::round(ops::ceil(ops::floor(t)));
  t = ops::square(ops::reciprocal(t));
  TensorValue nan_mask = ops::logical_not(ops::is_nan(t));

  // Binary, broadcasting against c [8] and r [8].
  t = ops::sub(ops::add(t, c), r);
  t = ops::div(ops::mul(t, c), c);
  t = ops::pow(ops::mod(t, c), c);
  t = ops::minimum(ops::maximum(t, c), r);
  TensorValue b = ops::logical_and(ops::equal(t, c), ops::not_equal(t, r));
  b = ops::logical_or(b, ops::greater(t, c));
  b = ops::logical_xor(b, ops::greater_equal(t, c));
  b = ops::logical_and(b, ops::less(t, c));
  b = ops::logical_or(b, ops::less_equal(t, r));
  b = ops::logical_and(b, nan_mask);
  t = ops::where(b, t, c);
  outs.push_back(ops::cast(t, DType::f16));

  // Reductions and normalizations.
  outs.push_back(ops::sum(t, 1));
  outs.push_back(ops::mean(t, 1));
  outs.push_back(ops::max(t, 1));
  outs.push_back(ops::min(t, 1));
  outs.push_back(ops::argmax(t, 1));
  outs.push_back(ops::argmin(t, 1));
  outs.push_back(ops::cumsum(t, 1, /*exclusive=*/true, /*reverse=*/true));
  for (const TensorValue& v : ops::top_k(t, 2, 1)) outs.push_back(v);
  outs.push_back(ops::softmax(t));
  outs.push_back(ops::log_softmax(t));
  outs.push_back(ops::rms_norm(t, c, 1e-6));
  outs.push_back(ops::layer_norm(t, c, r, 1e-5));

  // Shapes and data movement.
  TensorValue reshaped = ops::reshape(t, Shape{"batch", 2, 4});
  outs.push_back(ops::permute(reshaped, {0, 2, 1}));
  outs.push_back(ops::broadcast_to(c, Shape{"batch", 8}));
  TensorValue cat = ops::concat({t, x}, 1);  // [batch, 16]
  for (const TensorValue& v : ops::split(cat, {Dim(8), Dim(8)}, 1)) outs.push_back(v);
  outs.push_back(ops::slice(t, {{0, Dim("batch")}, {1, Dim(7), 2}}));
  outs.push_back(ops::slice(y, {{1, std::nullopt}}));  // [seq, 4]
  outs.push_back(ops::reshape(y, Shape{Dim("seq") + 1, 2, 2}));
  outs.push_back(ops::gather(w, idx, 0));  // [batch, 8]
  outs.push_back(ops::scatter(w, ops::gather(w, idx, 0), idx, 0));

  // Buffers, devices, calls, extensions.
  TensorValue head = ops::buffer_load(cache, {{0, 4}});
  ops::buffer_store(cache, ops::neg(head), {{4, 8}});
  outs.push_back(ops::transfer_to(x, DeviceRef::GPU(0)));
  for (const Value& v : ops::call("helper.v2", {x})) outs.push_back(v);
  Attrs params{{"alpha", 0.25}, {"count", int64_t{-3}}, {"label", std::string("a \"quoted\"\n\\ \x01")},
               {"perm", std::vector<int64_t>{}}, {"shape", Shape{}}, {"blob", Bytes{}},
               {"weird name", DType::bf16}, {"where", DeviceRef::CPU(3)}};
  auto custom_results = ops::custom("my_op", {x, cache},
                                    {f32({"batch", 8}), TensorType{DType::i32, Shape{Dim("batch") * 2}}},
                                    params);
  for (const Value& v : custom_results) outs.push_back(v);
  ops::inplace_custom("my_update", {cache, x}, {{"types", std::vector<Type>{}}});

  // Collectives (a single device needs no signal buffers; processes > 1 spans MPI ranks).
  for (const Value& v : ops::allreduce_sum({x}, {})) outs.push_back(v);
  for (const Value& v : ops::allgather({x}, {}, 1, 2)) outs.push_back(v);

  // Fused ops (docs/fusion.md): an elementwise program broadcasting c [8] against x, attention of x
  // read as one query of 8 heads against a history of y's rows, and rope.
  outs.push_back(ops::fused_elementwise(
      {x, c}, "%2 = mul(%0, %1) : f32; %3 = gelu.tanh(%2) : f32; %4 = greater(%3, %1) : bool"));
  TensorValue q = ops::reshape(x, Shape{"batch", 2, 4});            // [batch, heads 2, head_dim 4]
  TensorValue kv = ops::reshape(y, Shape{Dim("seq") + 1, 1, 4});  // [total, kv_heads 1, head_dim 4]
  TensorValue masked = ops::is_nan(ops::matmul(ops::slice(x, {{0, Dim("batch")}, {0, 4}}),
                                               ops::permute(y, {1, 0})));  // [batch, seq + 1]
  outs.push_back(ops::attention(q, kv, kv, masked, 0.5));
  // rope of q (seq = batch) with cos and sin [batch, head_dim 4] cut from x.
  TensorValue angle = ops::slice(x, {{0, Dim("batch")}, {0, 4}});
  outs.push_back(ops::rope(q, ops::cos(angle), ops::sin(angle)));

  // Quantized weights (Q8_0 rows of 34 bytes per 32 weights).
  TensorValue x32 = ops::concat({x, x, x, x}, 1);  // [batch, 32]
  TensorValue wq = ops::constant(Bytes(102, 0), DType::u8, Shape{3, 34});
  outs.push_back(ops::qmatmul(QuantizationEncoding::q8_0, x32, wq));
  outs.push_back(ops::dequantize(QuantizationEncoding::q8_0, wq));
  // The paged KV cache: q's rows stored (f32 into the bf16 cache) at slots idx, then attended with
  // idx as both sequence ids and positions.
  ops::paged_kv_store(paged_cache, ops::slice(q, {{0, Dim("batch")}, {0, 1}}), idx, 1);
  outs.push_back(ops::paged_attention(q, paged_cache, paged_cache, block_tables, idx, idx, 1, 0.125));
  // Sibling products of one lhs (compiler-made, by the group_matmuls pass: no ops:: builder), f32
  // with transpose_b and Q8_0 with its encoding.
  TensorValue w2 = main.weight({"w2", DType::f32, Shape{4, 8}});  // read as [8, 4]
  for (const Value& v : add_node(main.ir(), &m, Op::grouped_matmul, {x, w, w2}, {{"transpose_b", int64_t{1}}}))
    outs.push_back(v);
  for (const Value& v : add_node(main.ir(), &m, Op::grouped_matmul, {x32, wq, wq},
                                 {{"encoding", std::string("q8_0")}}))
    outs.push_back(v);
  main.output(outs);
  return m;
}

std::set<Op> ops_used(const Module& m) {
  std::set<Op> used;
  for (const auto& g : m.graphs())
    for (const Node& n : g->nodes) used.insert(n.op);
  return used;
}

// The message of the ParseError `text` raises, or a failure.
std::string parse_error(std::string_view text) {
  try {
    parse_module(text);
  } catch (const ParseError& e) {
    return e.what();
  }
  ADD_FAILURE() << "parsed without error:\n" << text;
  return "";
}

}  // namespace

TEST(Text, RoundTripUsesEveryOp) {
  Module m = build_every_op_module();
  std::set<Op> used = ops_used(m);
  for (Op op : kEveryOp) EXPECT_TRUE(used.count(op)) << "the round-trip module does not use " << op_name(op);

  std::string text = print(m);
  Module parsed = parse_module(text);
  EXPECT_EQ(print(parsed), text);
  EXPECT_EQ(parsed.graph_names(), (std::vector<std::string>{"main", "helper.v2"}));
}

TEST(Text, RoundTripKeepsNodesAttributesAndTypesExactly) {
  Module m = build_every_op_module();
  Module parsed = parse_module(print(m));
  ASSERT_EQ(parsed.size(), m.size());
  for (size_t gi = 0; gi < m.size(); ++gi) {
    const GraphIR& a = *m.graphs()[gi];
    const GraphIR& b = *parsed.graphs()[gi];
    SCOPED_TRACE(a.name);
    EXPECT_EQ(b.name, a.name);
    // The builder numbers values densely in definition order, as the parser does.
    EXPECT_EQ(b.value_types, a.value_types);
    EXPECT_EQ(b.inputs, a.inputs);
    EXPECT_EQ(b.outputs, a.outputs);
    EXPECT_EQ(b.weights, a.weights);
    ASSERT_EQ(b.nodes.size(), a.nodes.size());
    for (size_t k = 0; k < a.nodes.size(); ++k) {
      SCOPED_TRACE(op_name(a.nodes[k].op));
      EXPECT_EQ(b.nodes[k].op, a.nodes[k].op);
      EXPECT_EQ(b.nodes[k].inputs, a.nodes[k].inputs);
      EXPECT_EQ(b.nodes[k].outputs, a.nodes[k].outputs);
      // Attrs == compares the variant alternative too, so an int read back as a double would fail.
      EXPECT_TRUE(b.nodes[k].attrs == a.nodes[k].attrs);
    }
  }
}

TEST(Text, PrintsTheDocumentedForm) {
  Graph g("mlp", {f32({"batch", 64})});
  auto x = g.input(0);
  auto w = g.weight({"w1", DType::f32, Shape{64, 10}});
  g.output({ops::relu(ops::matmul(x, w))});
  EXPECT_EQ(print(g.ir()),
            "graph @mlp(%0: f32[batch, 64]) -> (f32[batch, 10]) {\n"
            "  %1 = weight() {device = cpu:0, dtype = f32, name = \"w1\", shape = [64, 10]} : f32[64, 10]\n"
            "  %2 = matmul(%0, %1) : f32[batch, 10]\n"
            "  %3 = relu(%2) : f32[batch, 10]\n"
            "  return %3\n"
            "}\n");
}

TEST(Text, PrintsEachAttributeKindInItsOwnSyntax) {
  Graph g("attrs", {BufferType{DType::f32, Shape{4}}, f32({"n"})});
  Graph::Scope scope(g);
  Attrs params{{"i", int64_t{3}},
               {"d", 3.0},
               {"small", 1e-06},
               {"s", std::string("x\"y")},
               {"ints", std::vector<int64_t>{1, -2}},
               {"shape", Shape{"n", Dim("n") + 1, 2}},
               {"dt", DType::boolean},
               {"dev", DeviceRef::GPU(1)},
               {"bytes", Bytes{0x00, 0xab, 0x7f}},
               {"types", std::vector<Type>{f32({2}), BufferType{DType::i8, Shape{3}}}},
               {"inf", -std::numeric_limits<double>::infinity()}};
  ops::inplace_custom("k", {g.input(0)}, params);
  g.output({g.input(1)});
  EXPECT_EQ(print(g.ir()),
            "graph @attrs(%0: buffer<f32[4]>, %1: f32[n]) -> (f32[n]) {\n"
            "  inplace_custom(%0) {param.bytes = 0x00ab7f, param.d = 3.0, param.dev = gpu:1, "
            "param.dt = bool, param.i = 3, param.inf = -inf, param.ints = array<1, -2>, "
            "param.s = \"x\\\"y\", param.shape = [n, n + 1, 2], param.small = 1e-06, "
            "param.types = types<f32[2], buffer<i8[3]>>, symbol = \"k\"}\n"
            "  return %1\n"
            "}\n");
}

TEST(Text, DoublesReadBackBitForBit) {
  const double values[] = {0.1,  1.0 / 3.0, 1e-300, 5e-324, -0.0, 1e21, 123456789012345678.0,
                           -2.5, std::numeric_limits<double>::max(),
                           std::numeric_limits<double>::infinity()};
  for (double v : values) {
    Graph g("d", {f32({2})});
    Graph::Scope scope(g);
    auto out = ops::custom("k", {g.input(0)}, {f32({2})}, {{"v", v}});
    g.output(out);
    Module parsed = parse_module(print(g.ir()));
    const Attr& a = parsed.at("d").nodes.at(0).attrs.at("param.v");
    ASSERT_TRUE(std::holds_alternative<double>(a)) << print(g.ir());
    EXPECT_EQ(std::bit_cast<uint64_t>(std::get<double>(a)), std::bit_cast<uint64_t>(v)) << v;
  }
  // NaN keeps being NaN (its payload is not kept).
  Graph g("nan", {f32({2})});
  Graph::Scope scope(g);
  g.output(ops::custom("k", {g.input(0)}, {f32({2})}, {{"v", std::nan("")}}));
  std::string text = print(g.ir());
  EXPECT_NE(text.find("param.v = nan"), std::string::npos) << text;
  Module parsed = parse_module(text);
  EXPECT_TRUE(std::isnan(std::get<double>(parsed.at("nan").nodes.at(0).attrs.at("param.v"))));
  EXPECT_EQ(print(parsed), text);
}

TEST(Text, IntegersKeepTheirExtremes) {
  Graph g("ints", {f32({2})});
  Graph::Scope scope(g);
  g.output(ops::custom("k", {g.input(0)}, {f32({2})},
                       {{"lo", std::numeric_limits<int64_t>::min()},
                        {"hi", std::numeric_limits<int64_t>::max()},
                        {"list", std::vector<int64_t>{std::numeric_limits<int64_t>::min(), 0}}}));
  Module parsed = parse_module(print(g.ir()));
  const Attrs& attrs = parsed.at("ints").nodes.at(0).attrs;
  EXPECT_EQ(std::get<int64_t>(attrs.at("param.lo")), std::numeric_limits<int64_t>::min());
  EXPECT_EQ(std::get<int64_t>(attrs.at("param.hi")), std::numeric_limits<int64_t>::max());
  EXPECT_EQ(std::get<std::vector<int64_t>>(attrs.at("param.list")),
            (std::vector<int64_t>{std::numeric_limits<int64_t>::min(), 0}));
}

TEST(Text, RenumbersValuesDenselyInDefinitionOrder) {
  // Ids out of definition order and with a hole (value 2 is unused), as a pass might leave them.
  Module m;
  GraphIR& g = m.add_graph("sparse", {f32({4})});
  g.value_types = {f32({4}), f32({4}), f32({4}), f32({4}), f32({4})};
  g.nodes.push_back(Node{Op::exp, {0}, {4}, {}});
  g.nodes.push_back(Node{Op::neg, {4}, {1}, {}});
  g.nodes.push_back(Node{Op::add, {1, 4}, {3}, {}});
  g.outputs = {3};
  EXPECT_EQ(print(g),
            "graph @sparse(%0: f32[4]) -> (f32[4]) {\n"
            "  %1 = exp(%0) : f32[4]\n"
            "  %2 = neg(%1) : f32[4]\n"
            "  %3 = add(%2, %1) : f32[4]\n"
            "  return %3\n"
            "}\n");
}

TEST(Text, ParsesHandWrittenTextIntoTheExpectedIR) {
  // Free value names, spacing and line breaks; `decode` calls `embed`, defined after it.
  const char* text = R"(
graph @decode(%tokens: i64[batch], %cache: buffer<f32[16, seq + 1]>) -> (f32[batch, 4], f32[4, seq + 1]) {
  %e = call(%tokens) {callee = "embed"} : f32[batch, 4]
  %rows = buffer_load(%cache) {starts = [0, 0], steps = array<1, 1>,
                               stops = [4, seq + 1]} : f32[4, seq + 1]
  buffer_store(%cache, %rows) {starts = [4, 0], steps = array<1, 1>, stops = [8, seq + 1]}
  return %e, %rows
}

graph @embed(%ids: i64[batch]) -> (f32[batch, 4]) {
  %table = weight() {device = cpu:0, dtype = f32, name = "embedding", shape = [10, 4]} : f32[10, 4]
  %scale = constant() {device = cpu:0, dtype = f32, shape = [], value = 0x0000003f} : f32[]
  %rows = gather(%table, %ids) {axis = 0} : f32[batch, 4]
  %out = mul(%rows, %scale) : f32[batch, 4]
  return %out
}
)";
  Module m = parse_module(text);
  ASSERT_EQ(m.graph_names(), (std::vector<std::string>{"decode", "embed"}));

  const GraphIR& decode = m.at("decode");
  ASSERT_EQ(decode.nodes.size(), 3u);
  EXPECT_EQ(decode.nodes[0].op, Op::call);
  EXPECT_EQ(decode.nodes[1].op, Op::buffer_load);
  EXPECT_EQ(decode.nodes[2].op, Op::buffer_store);
  EXPECT_EQ(decode.nodes[2].inputs, (std::vector<ValueId>{1, 3}));
  EXPECT_TRUE(decode.nodes[2].outputs.empty());
  EXPECT_EQ(std::get<Shape>(decode.nodes[1].attrs.at("stops")), (Shape{4, Dim("seq") + 1}));
  EXPECT_EQ(decode.outputs, (std::vector<ValueId>{2, 3}));
  EXPECT_EQ(decode.type(3), Type(f32({4, Dim("seq") + 1})));

  const GraphIR& embed = m.at("embed");
  ASSERT_EQ(embed.weights.size(), 1u);
  EXPECT_EQ(embed.weights[0], (Weight{"embedding", DType::f32, Shape{10, 4}, DeviceRef::CPU()}));
  const Bytes& scale = std::get<Bytes>(embed.nodes[1].attrs.at("value"));
  float scale_value;
  ASSERT_EQ(scale.size(), sizeof scale_value);
  std::memcpy(&scale_value, scale.data(), sizeof scale_value);
  EXPECT_EQ(scale_value, 0.5f);  // 0x3f000000, little-endian
  EXPECT_EQ(std::get<int64_t>(embed.nodes[2].attrs.at("axis")), 0);

  // Printing gives the canonical form: dense numbers, one node per line.
  EXPECT_EQ(print(m.at("decode")),
            "graph @decode(%0: i64[batch], %1: buffer<f32[16, seq + 1]>) -> (f32[batch, 4], f32[4, seq + 1]) {\n"
            "  %2 = call(%0) {callee = \"embed\"} : f32[batch, 4]\n"
            "  %3 = buffer_load(%1) {starts = [0, 0], steps = array<1, 1>, stops = [4, seq + 1]} : f32[4, seq + 1]\n"
            "  buffer_store(%1, %3) {starts = [4, 0], steps = array<1, 1>, stops = [8, seq + 1]}\n"
            "  return %2, %3\n"
            "}\n");
}

TEST(Text, WeightsAreRebuiltInOrderOfFirstUse) {
  Graph g("w", {f32({2, 2})});
  auto b = g.weight({"b", DType::f32, Shape{2, 2}});
  auto a = g.weight({"a", DType::f32, Shape{2, 2}, DeviceRef::CPU(1)});
  auto a_cpu0 = g.weight({"c", DType::f32, Shape{2, 2}});
  g.output({ops::add(ops::add(g.input(0), b), a_cpu0), ops::neg(a)});
  Module parsed = parse_module(print(g.module()));
  EXPECT_EQ(parsed.at("w").weights, g.ir().weights);
  ASSERT_EQ(parsed.at("w").weights.size(), 3u);
  EXPECT_EQ(parsed.at("w").weights[1].device, DeviceRef::CPU(1));
}

TEST(Text, EmptyTextIsAnEmptyModule) {
  EXPECT_EQ(parse_module("").size(), 0u);
  EXPECT_EQ(parse_module(" \n\t\n").size(), 0u);
  EXPECT_EQ(print(Module{}), "");
}

TEST(Text, NamesThatAreNotBareAreQuoted) {
  Graph g("my graph", {f32({2})});
  g.output({ops::neg(g.input(0))});
  std::string text = print(g.ir());
  EXPECT_EQ(text.substr(0, 17), "graph @\"my graph\"");
  EXPECT_EQ(parse_module(text).graph_names(), (std::vector<std::string>{"my graph"}));
}

// ---- parse errors name line:column and what was expected -----------------------------------------

TEST(TextErrors, UnknownOpNamesLineAndColumn) {
  std::string msg = parse_error(
      "graph @g(%0: f32[2]) -> (f32[2]) {\n"
      "  %1 = frobnicate(%0) : f32[2]\n"
      "  return %1\n"
      "}\n");
  EXPECT_NE(msg.find("2:8:"), std::string::npos) << msg;
  EXPECT_NE(msg.find("unknown op 'frobnicate'"), std::string::npos) << msg;
}

TEST(TextErrors, BadTypeNamesLineAndColumn) {
  std::string msg = parse_error(
      "graph @g(%0: f33[2]) -> (f32[2]) {\n"
      "  return %0\n"
      "}\n");
  EXPECT_NE(msg.find("1:14:"), std::string::npos) << msg;
  EXPECT_NE(msg.find("bad type 'f33[2]'"), std::string::npos) << msg;
}

TEST(TextErrors, TypeDifferentFromInferenceIsRejected) {
  std::string msg = parse_error(
      "graph @g(%0: f32[2, 3], %1: f32[3, 5]) -> (f32[2, 4]) {\n"
      "  %2 = matmul(%0, %1) : f32[2, 4]\n"
      "  return %2\n"
      "}\n");
  EXPECT_NE(msg.find("2:25:"), std::string::npos) << msg;
  EXPECT_NE(msg.find("written as f32[2, 4], but matmul infers f32[2, 5]"), std::string::npos) << msg;
}

TEST(TextErrors, InferenceFailureNamesTheNode) {
  std::string msg = parse_error(
      "graph @g(%0: f32[2, 3], %1: f32[4, 5]) -> (f32[2, 5]) {\n"
      "  %2 = matmul(%0, %1) : f32[2, 5]\n"
      "  return %2\n"
      "}\n");
  EXPECT_NE(msg.find("2:8:"), std::string::npos) << msg;
  EXPECT_NE(msg.find("matmul"), std::string::npos) << msg;
}

TEST(TextErrors, UndefinedValueNamesLineAndColumn) {
  std::string msg = parse_error(
      "graph @g(%0: f32[2]) -> (f32[2]) {\n"
      "  %1 = neg(%0) : f32[2]\n"
      "  %2 = add(%1, %7) : f32[2]\n"
      "  return %2\n"
      "}\n");
  EXPECT_NE(msg.find("3:16: undefined value %7"), std::string::npos) << msg;
}

TEST(TextErrors, MissingTokenSaysWhatWasExpected) {
  std::string msg = parse_error(
      "graph @g(%0: f32[2]) -> (f32[2]) {\n"
      "  %1 = neg(%0 : f32[2]\n"
      "  return %1\n"
      "}\n");
  EXPECT_NE(msg.find("2:15: expected ',' or ')' between the operands of neg, found ':'"), std::string::npos) << msg;
}

TEST(TextErrors, ReturnTypesMustMatchTheHeader) {
  std::string msg = parse_error(
      "graph @g(%0: f32[2]) -> (f32[3]) {\n"
      "  return %0\n"
      "}\n");
  EXPECT_NE(msg.find("2:10: output 0 of graph @g is f32[2], its header declares f32[3]"),
            std::string::npos)
      << msg;
}

TEST(TextErrors, ValueDefinedTwice) {
  std::string msg = parse_error(
      "graph @g(%0: f32[2]) -> (f32[2]) {\n"
      "  %0 = neg(%0) : f32[2]\n"
      "  return %0\n"
      "}\n");
  EXPECT_NE(msg.find("2:3: value %0 defined twice"), std::string::npos) << msg;
}

TEST(TextErrors, CallsToUnknownOrRecursiveGraphs) {
  std::string unknown = parse_error(
      "graph @g(%0: f32[2]) -> (f32[2]) {\n"
      "  %1 = call(%0) {callee = \"nowhere\"} : f32[2]\n"
      "  return %1\n"
      "}\n");
  EXPECT_NE(unknown.find("2:8: call to undefined graph @nowhere"), std::string::npos) << unknown;
  std::string recursive = parse_error(
      "graph @a(%0: f32[2]) -> (f32[2]) {\n"
      "  %1 = call(%0) {callee = \"b\"} : f32[2]\n"
      "  return %1\n"
      "}\n"
      "graph @b(%0: f32[2]) -> (f32[2]) {\n"
      "  %1 = call(%0) {callee = \"a\"} : f32[2]\n"
      "  return %1\n"
      "}\n");
  EXPECT_NE(recursive.find("6:8: recursive call to graph @a"), std::string::npos) << recursive;
}

TEST(TextErrors, DuplicateGraphNameAndUnclosedBody) {
  std::string dup = parse_error(
      "graph @g(%0: f32[2]) -> (f32[2]) {\n  return %0\n}\n"
      "graph @g(%0: f32[2]) -> (f32[2]) {\n  return %0\n}\n");
  EXPECT_NE(dup.find("4:1:"), std::string::npos) << dup;
  EXPECT_NE(dup.find("'g' already exists"), std::string::npos) << dup;
  std::string unclosed = parse_error("graph @g(%0: f32[2]) -> (f32[2]) {\n  return %0\n");
  EXPECT_NE(unclosed.find("1:34: '{' of graph @g is never closed"), std::string::npos) << unclosed;
}

TEST(TextErrors, BadAttributeValues) {
  auto with_attr = [](const std::string& attr) {
    return "graph @g(%0: f32[2]) -> (f32[2]) {\n  %1 = softmax(%0) {axis = " + attr +
           "} : f32[2]\n  return %1\n}\n";
  };
  EXPECT_NE(parse_error(with_attr("99999999999999999999")).find("2:28: integer '99999999999999999999' does not fit in int64"),
            std::string::npos);
  EXPECT_NE(parse_error(with_attr("\"open")).find("2:28: unterminated string"), std::string::npos);
  EXPECT_NE(parse_error(with_attr("0xabc")).find("expected a second hex digit"), std::string::npos);
  EXPECT_NE(parse_error(with_attr("florp")).find("2:28: expected an attribute value"), std::string::npos);
  // The right syntax but the wrong kind: softmax's axis is an int64, not a double.
  EXPECT_NE(parse_error(with_attr("0.0")).find("wrong kind"), std::string::npos);
}

TEST(TextErrors, WeightUsedWithTwoTypes) {
  std::string msg = parse_error(
      "graph @g() -> (f32[2]) {\n"
      "  %0 = weight() {device = cpu:0, dtype = f32, name = \"w\", shape = [2]} : f32[2]\n"
      "  %1 = weight() {device = cpu:0, dtype = f32, name = \"w\", shape = [3]} : f32[3]\n"
      "  return %0\n"
      "}\n");
  EXPECT_NE(msg.find("3:8: weight 'w' is used as f32[2] and as f32[3]"), std::string::npos) << msg;
}

// ---- hostile text: bounded depth and sizes, errors that name the line and column ------------------

TEST(TextHostile, DeeplyNestedDimIsAParseErrorNamingTheLine) {
  const std::string dim = std::string(100000, '(') + "n" + std::string(100000, ')');
  std::string msg = parse_error("graph @g(%0: f32[" + dim + "]) -> (f32[2]) {\n  return %0\n}\n");
  EXPECT_NE(msg.find("1:14: bad type"), std::string::npos) << msg.substr(0, 300);
  EXPECT_NE(msg.find("nesting deeper than 64"), std::string::npos) << msg.substr(0, 300);
  EXPECT_LT(msg.size(), 1000u);  // the 200 KB type is quoted cut short
}

TEST(TextHostile, ProductOfSumsDimIsRefused) {
  std::string sum = "(a+b+c+d+e+f+g+h)", dim = sum;
  for (int i = 1; i < 8; ++i) dim += "*" + sum;
  std::string msg = parse_error("graph @g(%0: f32[" + dim + "]) -> (f32[2]) {\n  return %0\n}\n");
  EXPECT_NE(msg.find("1:14:"), std::string::npos) << msg;
  EXPECT_NE(msg.find("expands past 1024 terms"), std::string::npos) << msg;
}

TEST(TextHostile, RankAndStaticSizeAreBounded) {
  std::string dims = "1";
  for (int i = 0; i < 64; ++i) dims += ", 1";  // 65 dims
  std::string msg = parse_error("graph @g(%0: f32[" + dims + "]) -> (f32[2]) {\n  return %0\n}\n");
  EXPECT_NE(msg.find("1:14:"), std::string::npos) << msg;
  EXPECT_NE(msg.find("more than 64 dims"), std::string::npos) << msg;
  // 2^31 * 2^31 elements of 4 bytes: 2^64 bytes.
  msg = parse_error("graph @g(%0: f32[2147483648, 2147483648]) -> (f32[2]) {\n  return %0\n}\n");
  EXPECT_NE(msg.find("byte size overflows int64"), std::string::npos) << msg;
  std::string attr = "graph @g(%0: f32[2]) -> (f32[2]) {\n  %1 = reshape(%0) {shape = [" + dims +
                     "]} : f32[2]\n  return %1\n}\n";
  msg = parse_error(attr);
  EXPECT_NE(msg.find("2:"), std::string::npos) << msg;
  EXPECT_NE(msg.find("more than 64 dims"), std::string::npos) << msg;
}

TEST(TextHostile, LongCallChainsAreBounded) {
  // Graph i calls graph i+1, defined after it: parsing each call parses its callee's body first.
  auto chain = [](int n) {
    std::string text;
    for (int i = 0; i < n; ++i) {
      text += "graph @g" + std::to_string(i) + "(%0: f32[2]) -> (f32[2]) {\n";
      if (i + 1 < n) {
        text += "  %1 = call(%0) {callee = \"g" + std::to_string(i + 1) + "\"} : f32[2]\n  return %1\n}\n";
      } else {
        text += "  return %0\n}\n";
      }
    }
    return text;
  };
  EXPECT_NO_THROW(parse_module(chain(40)));
  std::string msg = parse_error(chain(10000));
  EXPECT_NE(msg.find("nests calls more than 64 deep"), std::string::npos) << msg;
  EXPECT_NE(msg.find(":8: call to graph"), std::string::npos) << msg;
}

TEST(TextHostile, HugeNumbersAndNamesAreQuotedCutShort) {
  auto with_attr = [](const std::string& attr) {
    return "graph @g(%0: f32[2]) -> (f32[2]) {\n  %1 = softmax(%0) {axis = " + attr +
           "} : f32[2]\n  return %1\n}\n";
  };
  std::string msg = parse_error(with_attr(std::string(100000, '9')));
  EXPECT_NE(msg.find("2:28: integer '9999"), std::string::npos) << msg.substr(0, 200);
  EXPECT_LT(msg.size(), 400u);
  msg = parse_error(with_attr("1e" + std::string(10000, '9')));
  EXPECT_NE(msg.find("out of range"), std::string::npos) << msg.substr(0, 200);
  EXPECT_LT(msg.size(), 400u);
  msg = parse_error("graph @g(%0: f32[2]) -> (f32[2]) {\n  %1 = " + std::string(100000, 'x') +
                    "(%0) : f32[2]\n  return %1\n}\n");
  EXPECT_NE(msg.find("unknown op"), std::string::npos) << msg.substr(0, 200);
  EXPECT_LT(msg.size(), 400u);
}
