// The rewriting passes, each on hand-written graphs (in the text form) with hand-computed results.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "cpu_kernel_catalog.h"
#include "kiln/compiler/passes.h"
#include "kiln/graph/ops.h"
#include "kiln/graph/text.h"

using namespace kiln;
using namespace kiln::graph;
namespace passes = kiln::compiler::passes;

namespace {

using Pass = Module (*)(Module);

// Hex for the text form of a constant's bytes (little-endian elements, as the machine stores them).
template <class T>
std::string hex(const std::vector<T>& values) {
  std::string s = "0x";
  const auto* bytes = reinterpret_cast<const unsigned char*>(values.data());
  for (size_t i = 0; i < values.size() * sizeof(T); ++i) {
    static const char digits[] = "0123456789abcdef";
    s += digits[bytes[i] >> 4];
    s += digits[bytes[i] & 15];
  }
  return s;
}

std::string f32_constant(const std::string& result, const std::vector<float>& values, const std::string& shape) {
  return "  " + result + " = constant() {device = cpu:0, dtype = f32, shape = " + shape + ", value = " +
         hex(values) + "} : f32" + shape + "\n";
}

template <class T>
std::vector<T> constant_values(const Node& n) {
  EXPECT_EQ(n.op, Op::constant);
  const Bytes& bytes = std::get<Bytes>(n.attrs.at("value"));
  std::vector<T> values(bytes.size() / sizeof(T));
  std::memcpy(values.data(), bytes.data(), values.size() * sizeof(T));
  return values;
}

std::vector<Op> ops_of(const GraphIR& g) {
  std::vector<Op> out;
  for (const Node& n : g.nodes) out.push_back(n.op);
  return out;
}

// Parses `text`, runs `pass`, and checks what every pass must keep: a valid module with the same
// graphs, each with the same input and output types.
Module constant_fold_cpu(Module m) { return passes::constant_fold(std::move(m), kiln::testing::cpu_kernels()); }

Module run(Pass pass, const std::string& text) {
  Module before = parse_module(text);
  Module after = pass(before);
  passes::verify(after);
  EXPECT_EQ(after.graph_names(), before.graph_names());
  for (const auto& g : before.graphs()) {
    EXPECT_EQ(after.at(g->name).input_types(), g->input_types()) << g->name;
    EXPECT_EQ(after.at(g->name).output_types(), g->output_types()) << g->name;
  }
  return after;
}

}  // namespace

// ==== canonicalize ===============================================================================

TEST(Canonicalize, MultiplyByOnesAndAddZerosForwardTheOperand) {
  Module m = run(passes::canonicalize,
                 "graph @g(%0: f32[2, 3]) -> (f32[2, 3]) {\n" +
                     f32_constant("%1", {1, 1, 1}, "[3]") + f32_constant("%2", {0, 0, 0}, "[3]") +
                     "  %3 = mul(%0, %1) : f32[2, 3]\n"
                     "  %4 = mul(%1, %3) : f32[2, 3]\n"
                     "  %5 = add(%4, %2) : f32[2, 3]\n"
                     "  %6 = add(%2, %5) : f32[2, 3]\n"
                     "  %7 = sub(%6, %2) : f32[2, 3]\n"
                     "  %8 = div(%7, %1) : f32[2, 3]\n"
                     "  return %8\n"
                     "}\n");
  const GraphIR& g = m.at("g");
  EXPECT_EQ(g.outputs, (std::vector<ValueId>{0}));  // the input itself
  EXPECT_EQ(ops_of(g), (std::vector<Op>{Op::constant, Op::constant}));  // left for dce
}

TEST(Canonicalize, IdentityConstantsThatWidenTheResultAreKept) {
  // x [3] * ones [2, 3] is [2, 3], not x; x * twos is not x; x - 0 with 0 on the left is 0 - x.
  std::string text = "graph @g(%0: f32[3]) -> (f32[2, 3], f32[3], f32[3]) {\n" +
                     f32_constant("%1", {1, 1, 1, 1, 1, 1}, "[2, 3]") +
                     f32_constant("%2", {2, 2, 2}, "[3]") + f32_constant("%3", {0, 0, 0}, "[3]") +
                     "  %4 = mul(%0, %1) : f32[2, 3]\n"
                     "  %5 = mul(%0, %2) : f32[3]\n"
                     "  %6 = sub(%3, %0) : f32[3]\n"
                     "  return %4, %5, %6\n"
                     "}\n";
  Module m = run(passes::canonicalize, text);
  EXPECT_EQ(print(m), print(parse_module(text)));
}

TEST(Canonicalize, TransposeOfTransposeComposesThePermutations) {
  // [2, 3, 4] -perm [1, 0, 2]-> [3, 2, 4] -perm [0, 2, 1]-> [3, 4, 2]: out dims are x's 1, 2, 0.
  Module m = run(passes::canonicalize,
                 "graph @g(%0: f32[2, 3, 4]) -> (f32[3, 4, 2]) {\n"
                 "  %1 = transpose(%0) {perm = array<1, 0, 2>} : f32[3, 2, 4]\n"
                 "  %2 = transpose(%1) {perm = array<0, 2, 1>} : f32[3, 4, 2]\n"
                 "  return %2\n"
                 "}\n");
  const GraphIR& g = m.at("g");
  ASSERT_EQ(g.nodes.size(), 2u);
  const Node& last = g.nodes[1];
  EXPECT_EQ(last.op, Op::transpose);
  EXPECT_EQ(last.inputs, (std::vector<ValueId>{0}));
  EXPECT_EQ(std::get<std::vector<int64_t>>(last.attrs.at("perm")), (std::vector<int64_t>{1, 2, 0}));
}

TEST(Canonicalize, TransposesThatCancelLeaveTheOperand) {
  Module m = run(passes::canonicalize,
                 "graph @g(%0: f32[batch, 3, 4]) -> (f32[batch, 3, 4]) {\n"
                 "  %1 = transpose(%0) {perm = array<1, 2, 0>} : f32[3, 4, batch]\n"
                 "  %2 = transpose(%1) {perm = array<2, 0, 1>} : f32[batch, 3, 4]\n"
                 "  %3 = transpose(%2) {perm = array<0, 1, 2>} : f32[batch, 3, 4]\n"
                 "  return %3\n"
                 "}\n");
  EXPECT_EQ(m.at("g").outputs, (std::vector<ValueId>{0}));
}

TEST(Canonicalize, TransposedMatmulRhsFoldsIntoTheMatmul) {
  // A Linear: x [batch, 4] @ transpose(w [3, 4]) -> matmul reading w as [4, 3] in place.
  Module m = run(passes::canonicalize,
                 "graph @g(%0: f32[batch, 4], %1: f32[3, 4]) -> (f32[batch, 3]) {\n"
                 "  %2 = transpose(%1) {perm = array<1, 0>} : f32[4, 3]\n"
                 "  %3 = matmul(%0, %2) : f32[batch, 3]\n"
                 "  return %3\n"
                 "}\n");
  const Node& mm = m.at("g").nodes.back();
  EXPECT_EQ(mm.op, Op::matmul);
  EXPECT_EQ(mm.inputs, (std::vector<ValueId>{0, 1}));
  EXPECT_EQ(std::get<int64_t>(mm.attrs.at("transpose_b")), 1);
  // Only the last two axes qualify: a transpose that moves a batch axis stays.
  Module kept = run(passes::canonicalize,
                    "graph @g(%0: f32[2, 5, 4], %1: f32[4, 2, 3]) -> (f32[2, 5, 3]) {\n"
                    "  %2 = transpose(%1) {perm = array<1, 0, 2>} : f32[2, 4, 3]\n"
                    "  %3 = matmul(%0, %2) : f32[2, 5, 3]\n"
                    "  return %3\n"
                    "}\n");
  EXPECT_EQ(kept.at("g").nodes.back().attrs.count("transpose_b"), 0u);
}

TEST(Canonicalize, TransposeThatKeepsTheTypeButMovesDataIsKept) {
  Module m = run(passes::canonicalize,
                 "graph @g(%0: f32[2, 2]) -> (f32[2, 2]) {\n"
                 "  %1 = transpose(%0) {perm = array<1, 0>} : f32[2, 2]\n"
                 "  return %1\n"
                 "}\n");
  EXPECT_EQ(ops_of(m.at("g")), (std::vector<Op>{Op::transpose}));
  EXPECT_EQ(m.at("g").outputs, (std::vector<ValueId>{1}));
}

TEST(Canonicalize, ReshapeChainsBecomeOneReshapeOrNone) {
  Module m = run(passes::canonicalize,
                 "graph @g(%0: f32[2, 6]) -> (f32[12], f32[2, 6]) {\n"
                 "  %1 = reshape(%0) {shape = [3, 4]} : f32[3, 4]\n"
                 "  %2 = reshape(%1) {shape = [12]} : f32[12]\n"
                 "  %3 = reshape(%2) {shape = [2, 6]} : f32[2, 6]\n"
                 "  return %2, %3\n"
                 "}\n");
  const GraphIR& g = m.at("g");
  EXPECT_EQ(g.outputs[1], 0);  // reshaped back to its own shape
  const Node& producer = g.nodes.at(1);
  EXPECT_EQ(producer.outputs, (std::vector<ValueId>{g.outputs[0]}));
  EXPECT_EQ(producer.op, Op::reshape);
  EXPECT_EQ(producer.inputs, (std::vector<ValueId>{0}));  // straight from x, not through [3, 4]
}

TEST(Canonicalize, CastsAndBroadcastsToTheSameTypeDisappear) {
  Module m = run(passes::canonicalize,
                 "graph @g(%0: f32[batch, 4]) -> (f32[batch, 4], f16[batch, 4]) {\n"
                 "  %1 = cast(%0) {dtype = f32} : f32[batch, 4]\n"
                 "  %2 = broadcast_to(%1) {shape = [batch, 4]} : f32[batch, 4]\n"
                 "  %3 = cast(%2) {dtype = f16} : f16[batch, 4]\n"
                 "  return %2, %3\n"
                 "}\n");
  const GraphIR& g = m.at("g");
  EXPECT_EQ(ops_of(g), (std::vector<Op>{Op::cast}));
  EXPECT_EQ(g.nodes[0].inputs, (std::vector<ValueId>{0}));
  EXPECT_EQ(g.outputs[0], 0);
}

// ==== constant_fold ==============================================================================

TEST(ConstantFold, EvaluatesChainsOfConstantOps) {
  // (a + b) * a with a = [1, 2, 3], b = [10, 20, 30]: [11, 44, 99]; then neg.
  Module m = run(constant_fold_cpu,
                 "graph @g() -> (f32[3]) {\n" + f32_constant("%0", {1, 2, 3}, "[3]") +
                     f32_constant("%1", {10, 20, 30}, "[3]") +
                     "  %2 = add(%0, %1) : f32[3]\n"
                     "  %3 = mul(%2, %0) : f32[3]\n"
                     "  %4 = neg(%3) : f32[3]\n"
                     "  return %4\n"
                     "}\n");
  const GraphIR& g = m.at("g");
  EXPECT_EQ(ops_of(g), std::vector<Op>(5, Op::constant));
  const Node& out = g.nodes.at(4);  // folded in place: node k still defines value k
  EXPECT_EQ(constant_values<float>(out), (std::vector<float>{-11, -44, -99}));
  // dce then leaves only the result.
  Module clean = passes::dce(m);
  ASSERT_EQ(clean.at("g").nodes.size(), 1u);
  EXPECT_EQ(constant_values<float>(clean.at("g").nodes[0]), (std::vector<float>{-11, -44, -99}));
}

TEST(ConstantFold, FoldsEveryResultOfAMultiResultNode) {
  // split [1..6] into [2] and [4], then add the first two of the second part to the first.
  Module m = run(constant_fold_cpu,
                 "graph @g() -> (f32[2], f32[4], f32[2]) {\n" +
                     f32_constant("%0", {1, 2, 3, 4, 5, 6}, "[6]") +
                     "  %1, %2 = split(%0) {axis = 0, sizes = [2, 4]} : f32[2], f32[4]\n"
                     "  %3 = slice(%2) {starts = [0], steps = array<1>, stops = [2]} : f32[2]\n"
                     "  %4 = add(%1, %3) : f32[2]\n"
                     "  return %1, %2, %4\n"
                     "}\n");
  const GraphIR& g = m.at("g");
  auto producer_of = [&](ValueId v) -> const Node& {
    for (const Node& n : g.nodes)
      for (ValueId o : n.outputs)
        if (o == v) return n;
    throw std::runtime_error("no producer");
  };
  EXPECT_EQ(constant_values<float>(producer_of(g.outputs[0])), (std::vector<float>{1, 2}));
  EXPECT_EQ(constant_values<float>(producer_of(g.outputs[1])), (std::vector<float>{3, 4, 5, 6}));
  EXPECT_EQ(constant_values<float>(producer_of(g.outputs[2])), (std::vector<float>{4, 6}));
}

TEST(ConstantFold, IntegerArithmeticFollowsTheOpSemantics) {
  // div truncates like C++; mod takes the divisor's sign like Python.
  std::string a = hex(std::vector<int32_t>{-7, 7, -7});
  std::string b = hex(std::vector<int32_t>{2, -2, 3});
  Module m = run(constant_fold_cpu,
                 "graph @g() -> (i32[3], i32[3]) {\n"
                 "  %0 = constant() {device = cpu:0, dtype = i32, shape = [3], value = " + a + "} : i32[3]\n"
                 "  %1 = constant() {device = cpu:0, dtype = i32, shape = [3], value = " + b + "} : i32[3]\n"
                 "  %2 = div(%0, %1) : i32[3]\n"
                 "  %3 = mod(%0, %1) : i32[3]\n"
                 "  return %2, %3\n"
                 "}\n");
  const GraphIR& g = m.at("g");
  EXPECT_EQ(constant_values<int32_t>(g.nodes.at(2)), (std::vector<int32_t>{-3, -3, -2}));
  EXPECT_EQ(constant_values<int32_t>(g.nodes.at(3)), (std::vector<int32_t>{1, -1, 2}));
}

TEST(ConstantFold, LeavesNodesWithNonConstantOperands) {
  std::string text = "graph @g(%0: f32[3]) -> (f32[3], f32[3]) {\n" +
                     f32_constant("%1", {1, 2, 3}, "[3]") +
                     "  %2 = weight() {device = cpu:0, dtype = f32, name = \"w\", shape = [3]} : f32[3]\n"
                     "  %3 = add(%0, %1) : f32[3]\n"
                     "  %4 = mul(%2, %1) : f32[3]\n"
                     "  return %3, %4\n"
                     "}\n";
  Module m = run(constant_fold_cpu, text);
  EXPECT_EQ(print(m), print(parse_module(text)));
}

TEST(ConstantFold, FoldsUpTo64KiBAndNoMore) {
  auto text = [](int64_t n) {
    std::string shape = "[" + std::to_string(n) + "]";
    return "graph @g() -> (f32" + shape + ") {\n" + f32_constant("%0", {2}, "[]") +
           "  %1 = broadcast_to(%0) {shape = " + shape + "} : f32" + shape + "\n  return %1\n}\n";
  };
  Module fits = run(constant_fold_cpu, text(16384));  // 64 KiB exactly
  EXPECT_EQ(ops_of(fits.at("g")), (std::vector<Op>{Op::constant, Op::constant}));
  std::vector<float> all_twos = constant_values<float>(fits.at("g").nodes[1]);
  EXPECT_EQ(all_twos, std::vector<float>(16384, 2.0f));
  Module too_big = run(constant_fold_cpu, text(16385));
  EXPECT_EQ(ops_of(too_big.at("g")), (std::vector<Op>{Op::constant, Op::broadcast_to}));
}

TEST(ConstantFold, LeavesDivisionByZeroToRunTime) {
  std::string a = hex(std::vector<int32_t>{1});
  std::string zero = hex(std::vector<int32_t>{0});
  Module m = run(constant_fold_cpu,
                 "graph @g() -> (i32[1]) {\n"
                 "  %0 = constant() {device = cpu:0, dtype = i32, shape = [1], value = " + a + "} : i32[1]\n"
                 "  %1 = constant() {device = cpu:0, dtype = i32, shape = [1], value = " + zero + "} : i32[1]\n"
                 "  %2 = div(%0, %1) : i32[1]\n"
                 "  return %2\n"
                 "}\n");
  EXPECT_EQ(ops_of(m.at("g")), (std::vector<Op>{Op::constant, Op::constant, Op::div}));
}

TEST(ConstantFold, NeverFoldsSourcesOrTransfers) {
  std::string text = "graph @g() -> (f32[4], f32[3]@gpu:0) {\n" + f32_constant("%0", {1, 2, 3}, "[3]") +
                     "  %1 = range() {device = cpu:0, dtype = f32, size = [4], start = 0.0, step = 1.0} : f32[4]\n"
                     "  %2 = transfer_to(%0) {device = gpu:0} : f32[3]@gpu:0\n"
                     "  return %1, %2\n"
                     "}\n";
  Module m = run(constant_fold_cpu, text);
  EXPECT_EQ(print(m), print(parse_module(text)));
}

// ==== cse ========================================================================================

TEST(Cse, MergesEqualNodesAndWhatDependsOnThem) {
  Module m = run(passes::cse,
                 "graph @g(%0: f32[4]) -> (f32[4]) {\n"
                 "  %1 = exp(%0) : f32[4]\n"
                 "  %2 = exp(%0) : f32[4]\n"
                 "  %3 = neg(%1) : f32[4]\n"
                 "  %4 = neg(%2) : f32[4]\n"
                 "  %5 = add(%3, %4) : f32[4]\n"
                 "  return %5\n"
                 "}\n");
  EXPECT_EQ(print(m),
            "graph @g(%0: f32[4]) -> (f32[4]) {\n"
            "  %1 = exp(%0) : f32[4]\n"
            "  %2 = neg(%1) : f32[4]\n"
            "  %3 = add(%2, %2) : f32[4]\n"
            "  return %3\n"
            "}\n");
}

TEST(Cse, MergesEqualConstantsAndWeightsByName) {
  Module m = run(passes::cse,
                 "graph @g(%0: f32[3]) -> (f32[3], f32[3]) {\n" +
                     f32_constant("%1", {1, 2, 3}, "[3]") + f32_constant("%2", {1, 2, 3}, "[3]") +
                     f32_constant("%3", {1, 2, 4}, "[3]") +
                     "  %4 = weight() {device = cpu:0, dtype = f32, name = \"w\", shape = [3]} : f32[3]\n"
                     "  %5 = weight() {device = cpu:0, dtype = f32, name = \"w\", shape = [3]} : f32[3]\n"
                     "  %6 = weight() {device = cpu:0, dtype = f32, name = \"v\", shape = [3]} : f32[3]\n"
                     "  %7 = add(%1, %2) : f32[3]\n"
                     "  %8 = add(%3, %4) : f32[3]\n"
                     "  %9 = add(%5, %6) : f32[3]\n"
                     "  %10 = add(%7, %8) : f32[3]\n"
                     "  return %10, %9\n"
                     "}\n");
  const GraphIR& g = m.at("g");
  EXPECT_EQ(ops_of(g), (std::vector<Op>{Op::constant, Op::constant, Op::weight, Op::weight, Op::add,
                                        Op::add, Op::add, Op::add}));
  EXPECT_EQ(g.nodes[4].inputs, (std::vector<ValueId>{1, 1}));  // the two equal constants are one
  EXPECT_EQ(g.nodes[6].inputs, (std::vector<ValueId>{3, 4}));  // w (merged), v
  EXPECT_EQ(g.weights.size(), 2u);
}

TEST(Cse, DifferentAttributesAreNotMerged) {
  std::string text =
      "graph @g(%0: f32[4, 4]) -> (f32[4, 4], f32[4, 4]) {\n"
      "  %1 = softmax(%0) {axis = 0} : f32[4, 4]\n"
      "  %2 = softmax(%0) {axis = 1} : f32[4, 4]\n"
      "  return %1, %2\n"
      "}\n";
  EXPECT_EQ(print(run(passes::cse, text)), print(parse_module(text)));
}

TEST(Cse, SideEffectsAndBufferLoadsAreNeverMerged) {
  // Two equal stores both happen; the load after a store must not be served by the load before it.
  std::string text =
      "graph @g(%0: buffer<f32[4]>, %1: f32[2]) -> (f32[2], f32[2], f32[2]) {\n"
      "  %2 = buffer_load(%0) {starts = [0], steps = array<1>, stops = [2]} : f32[2]\n"
      "  buffer_store(%0, %1) {starts = [0], steps = array<1>, stops = [2]}\n"
      "  buffer_store(%0, %1) {starts = [0], steps = array<1>, stops = [2]}\n"
      "  %3 = buffer_load(%0) {starts = [0], steps = array<1>, stops = [2]} : f32[2]\n"
      "  %4 = custom(%1) {output_types = types<f32[2]>, symbol = \"rand\"} : f32[2]\n"
      "  %5 = custom(%1) {output_types = types<f32[2]>, symbol = \"rand\"} : f32[2]\n"
      "  %6 = add(%4, %5) : f32[2]\n"
      "  return %2, %3, %6\n"
      "}\n";
  EXPECT_EQ(print(run(passes::cse, text)), print(parse_module(text)));
}

TEST(Cse, PagedStoresAndAttentionsAreNeverMerged) {
  // The attention after the second store reads what it wrote: it must not be served by the first.
  std::string text =
      "graph @g(%0: buffer<f32[1, 4, 2, 1, 2]>, %1: f32[1, 1, 2], %2: i64[1], %3: i64[1, 4])"
      " -> (f32[1, 1, 2], f32[1, 1, 2]) {\n"
      "  paged_kv_store(%0, %1, %2) {layer = 0}\n"
      "  %4 = paged_attention(%1, %0, %0, %3, %2, %2) {layer = 0, scale = 0.5} : f32[1, 1, 2]\n"
      "  paged_kv_store(%0, %1, %2) {layer = 0}\n"
      "  %5 = paged_attention(%1, %0, %0, %3, %2, %2) {layer = 0, scale = 0.5} : f32[1, 1, 2]\n"
      "  return %4, %5\n"
      "}\n";
  EXPECT_EQ(print(run(passes::cse, text)), print(parse_module(text)));
}

TEST(Cse, CallsMergeOnlyWhenTheCalleeIsPure) {
  Module m = run(passes::cse,
                 "graph @g(%0: f32[2], %1: buffer<f32[2]>) -> (f32[2], f32[2]) {\n"
                 "  %2 = call(%0) {callee = \"pure\"} : f32[2]\n"
                 "  %3 = call(%0) {callee = \"pure\"} : f32[2]\n"
                 "  %4 = call(%0, %1) {callee = \"writes\"} : f32[2]\n"
                 "  %5 = call(%0, %1) {callee = \"writes\"} : f32[2]\n"
                 "  %6 = add(%2, %3) : f32[2]\n"
                 "  %7 = add(%4, %5) : f32[2]\n"
                 "  return %6, %7\n"
                 "}\n\n"
                 "graph @pure(%0: f32[2]) -> (f32[2]) {\n"
                 "  %1 = neg(%0) : f32[2]\n"
                 "  return %1\n"
                 "}\n\n"
                 "graph @writes(%0: f32[2], %1: buffer<f32[2]>) -> (f32[2]) {\n"
                 "  buffer_store(%1, %0) {starts = [0], steps = array<1>, stops = [2]}\n"
                 "  return %0\n"
                 "}\n");
  EXPECT_EQ(ops_of(m.at("g")), (std::vector<Op>{Op::call, Op::call, Op::call, Op::add, Op::add}));
  EXPECT_EQ(m.at("g").nodes[3].inputs, (std::vector<ValueId>{2, 2}));
}

// ==== dce ========================================================================================

TEST(Dce, RemovesUnusedNodesAndTheirWeights) {
  Module m = run(passes::dce,
                 "graph @g(%0: f32[3]) -> (f32[3]) {\n"
                 "  %1 = weight() {device = cpu:0, dtype = f32, name = \"used\", shape = [3]} : f32[3]\n"
                 "  %2 = weight() {device = cpu:0, dtype = f32, name = \"unused\", shape = [3]} : f32[3]\n"
                 "  %3 = exp(%2) : f32[3]\n"
                 "  %4 = neg(%3) : f32[3]\n"
                 "  %5 = add(%0, %1) : f32[3]\n"
                 "  return %5\n"
                 "}\n");
  EXPECT_EQ(print(m),
            "graph @g(%0: f32[3]) -> (f32[3]) {\n"
            "  %1 = weight() {device = cpu:0, dtype = f32, name = \"used\", shape = [3]} : f32[3]\n"
            "  %2 = add(%0, %1) : f32[3]\n"
            "  return %2\n"
            "}\n");
  ASSERT_EQ(m.at("g").weights.size(), 1u);
  EXPECT_EQ(m.at("g").weights[0].name, "used");
}

TEST(Dce, KeepsSideEffectsAndWhatTheyUse) {
  std::string text =
      "graph @g(%0: buffer<f32[4]>, %1: f32[2]) -> (f32[2]) {\n"
      "  %2 = exp(%1) : f32[2]\n"
      "  buffer_store(%0, %2) {starts = [0], steps = array<1>, stops = [2]}\n"
      "  inplace_custom(%0) {symbol = \"update\"}\n"
      "  %3 = custom(%1) {output_types = types<f32[2]>, symbol = \"log_to_disk\"} : f32[2]\n"
      "  %4 = call(%1, %0) {callee = \"writes\"} : f32[2]\n"
      "  %5 = call(%1) {callee = \"pure\"} : f32[2]\n"
      "  %6 = neg(%1) : f32[2]\n"
      "  return %1\n"
      "}\n\n"
      "graph @pure(%0: f32[2]) -> (f32[2]) {\n"
      "  %1 = neg(%0) : f32[2]\n"
      "  return %1\n"
      "}\n\n"
      "graph @writes(%0: f32[2], %1: buffer<f32[4]>) -> (f32[2]) {\n"
      "  buffer_store(%1, %0) {starts = [2], steps = array<1>, stops = [4]}\n"
      "  return %0\n"
      "}\n";
  Module m = run(passes::dce, text);
  EXPECT_EQ(ops_of(m.at("g")), (std::vector<Op>{Op::exp, Op::buffer_store, Op::inplace_custom,
                                                Op::custom, Op::call}));
  EXPECT_EQ(std::get<std::string>(m.at("g").nodes[4].attrs.at("callee")), "writes");
  // A graph with only side effects and no outputs keeps them too.
  Module only_store = run(passes::dce,
                          "graph @s(%0: buffer<f32[2]>, %1: f32[2]) -> () {\n"
                          "  %2 = neg(%1) : f32[2]\n"
                          "  buffer_store(%0, %2) {starts = [0], steps = array<1>, stops = [2]}\n"
                          "  return\n"
                          "}\n");
  EXPECT_EQ(ops_of(only_store.at("s")), (std::vector<Op>{Op::neg, Op::buffer_store}));
}

TEST(Dce, KeepsPagedStoresAndDropsUnusedPagedAttention) {
  Module m = run(passes::dce,
                 "graph @g(%0: buffer<f32[1, 4, 2, 1, 2]>, %1: f32[1, 1, 2], %2: i64[1], %3: i64[1, 4])"
                 " -> (f32[1, 1, 2]) {\n"
                 "  paged_kv_store(%0, %1, %2) {layer = 0}\n"
                 "  %4 = paged_attention(%1, %0, %0, %3, %2, %2) {layer = 0, scale = 0.5} : f32[1, 1, 2]\n"
                 "  return %1\n"
                 "}\n");
  EXPECT_EQ(ops_of(m.at("g")), (std::vector<Op>{Op::paged_kv_store}));
}

TEST(Dce, OutputsThatAreInputsStayValid) {
  Module m = run(passes::dce,
                 "graph @g(%0: f32[3], %1: f32[3]) -> (f32[3], f32[3]) {\n"
                 "  %2 = add(%0, %1) : f32[3]\n"
                 "  return %1, %0\n"
                 "}\n");
  EXPECT_TRUE(m.at("g").nodes.empty());
  EXPECT_EQ(m.at("g").outputs, (std::vector<ValueId>{1, 0}));
}

// ==== passes together ===========================================================================

TEST(Passes, PipelineOnABuiltGraphKeepsItsInterface) {
  Graph g("mlp", {TensorType{DType::f32, Shape{"batch", 4}}});
  Graph::Scope scope(g);
  auto x = g.input(0);
  auto w = g.weight({"w", DType::f32, Shape{4, 4}});
  auto bias = ops::add(ops::constant(std::vector<float>{1, 1, 1, 1}, Shape{4}),
                       ops::constant(std::vector<float>{-1, -1, -1, -1}, Shape{4}));  // folds to zeros
  auto h = ops::add(ops::matmul(x, w), bias);
  auto t = ops::permute(ops::permute(h, {1, 0}), {1, 0});
  g.output({ops::relu(ops::add(t, ops::matmul(x, w)))});

  Module m = passes::dce(passes::cse(passes::canonicalize(passes::constant_fold(g.module(), kiln::testing::cpu_kernels()))));
  passes::verify(m);
  EXPECT_EQ(print(m),
            "graph @mlp(%0: f32[batch, 4]) -> (f32[batch, 4]) {\n"
            "  %1 = weight() {device = cpu:0, dtype = f32, name = \"w\", shape = [4, 4]} : f32[4, 4]\n"
            "  %2 = matmul(%0, %1) : f32[batch, 4]\n"
            "  %3 = add(%2, %2) : f32[batch, 4]\n"
            "  %4 = relu(%3) : f32[batch, 4]\n"
            "  return %4\n"
            "}\n");
}
