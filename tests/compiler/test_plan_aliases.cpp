// Alias values in a plan (ValueKind::alias): which steps become aliases of their operand's memory,
// which stay copies, and the arena liveness they need.
#include <map>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "kiln/compiler/compiled_model.h"
#include "kiln/errors.h"
#include "kiln/graph/ops.h"
#include "cpu_kernel_catalog.h"
#include "test_util.h"

namespace {

using namespace kiln;
namespace ops = kiln::graph::ops;
using compiler::GraphPlan;
using compiler::PlanValue;
using compiler::ValueKind;
using graph::BufferType;
using graph::Op;
using graph::TensorType;
using kiln::testing::expect_error;

// One step per op (no fusion), so the tests see exactly the steps they build.
const compiler::CompileOptions kOneStepPerOp{.optimize = false};

const PlanValue& value_of(const GraphPlan& plan, const graph::Value& v) {
  return plan.values.at(static_cast<size_t>(v.id()));
}

int count_steps(const GraphPlan& plan, Op op) {
  int n = 0;
  for (const auto& step : plan.steps) n += step.op == op;
  return n;
}

// Replays the plan tracking which value owns each slot: every read of a slot value, or of an alias
// whose root is a slot, must find the root still owning its slot; a graph output's root must own it
// at the end.
void expect_alias_roots_stay_live(const GraphPlan& plan) {
  std::map<int32_t, int32_t> owner;  // slot -> value
  auto root_of = [&](int32_t v) {
    const PlanValue& value = plan.values.at(static_cast<size_t>(v));
    return value.kind == ValueKind::alias ? value.root : v;
  };
  auto expect_owned = [&](int32_t v, const std::string& where) {
    const int32_t root = root_of(v);
    const PlanValue& value = plan.values.at(static_cast<size_t>(root));
    if (value.kind != ValueKind::slot) return;
    EXPECT_EQ(owner.at(value.slot), root) << where << " reads %" << v << " (root %" << root
                                          << ") after its slot was reused";
  };
  for (const auto& step : plan.steps) {
    for (int32_t v : step.inputs) expect_owned(v, "node " + std::to_string(step.node));
    for (int32_t v : step.outputs) {
      const PlanValue& value = plan.values.at(static_cast<size_t>(v));
      if (value.kind == ValueKind::slot) owner[value.slot] = v;
    }
  }
  for (int32_t v : plan.outputs) expect_owned(v, "the end of the run");
}

TEST(PlanAliases, ReshapeLaunchesNothingAndViewsItsOperand) {
  graph::Graph g("g", {TensorType{DType::f32, {2, 3}}});
  auto e = ops::exp(g.input(0));
  auto r = ops::reshape(e, std::vector<int64_t>{6});
  g.output({ops::neg(r)});
  auto compiled = compiler::compile(g.module(), kiln::testing::with_cpu_kernels(kOneStepPerOp));
  const GraphPlan& plan = compiled.plan("g");
  ASSERT_EQ(plan.steps.size(), 2u);
  EXPECT_EQ(plan.steps[0].op, Op::exp);
  EXPECT_EQ(plan.steps[1].op, Op::neg);
  const PlanValue& alias = value_of(plan, r);
  EXPECT_EQ(alias.kind, ValueKind::alias);
  EXPECT_EQ(alias.root, e.id());
  EXPECT_EQ(alias.slot, -1);
  ASSERT_EQ(plan.aliases.size(), 1u);
  EXPECT_EQ(alias.alias, 0);
  EXPECT_EQ(plan.aliases[0].op, Op::reshape);
  EXPECT_EQ(plan.aliases[0].inputs, std::vector<int32_t>{e.id()});
  EXPECT_EQ(plan.aliases[0].outputs, std::vector<int32_t>{r.id()});
}

TEST(PlanAliases, ChainsOfAliasesResolveToTheValueOwningTheMemory) {
  graph::Graph g("g", {TensorType{DType::f32, {4, 6}}});
  auto e = ops::exp(g.input(0));
  auto a = ops::reshape(e, std::vector<int64_t>{2, 2, 6});
  auto b = ops::slice(a, {{1, 2}});  // [1, 2, 6]: one contiguous block
  auto c = ops::reshape(b, std::vector<int64_t>{12});
  g.output({ops::neg(c)});
  auto compiled = compiler::compile(g.module(), kiln::testing::with_cpu_kernels(kOneStepPerOp));
  const GraphPlan& plan = compiled.plan("g");
  ASSERT_EQ(plan.aliases.size(), 3u);
  for (const auto& v : {a, b, c}) {
    EXPECT_EQ(value_of(plan, v).kind, ValueKind::alias);
    EXPECT_EQ(value_of(plan, v).root, e.id());
  }
  // Sources are listed before the aliases made from them.
  EXPECT_EQ(plan.aliases[0].outputs[0], a.id());
  EXPECT_EQ(plan.aliases[2].inputs[0], b.id());
  EXPECT_EQ(plan.steps.size(), 2u);
}

TEST(PlanAliases, ContiguousWindowsOfBuffersAndTensorsAreAliases) {
  // The KV-cache read: a fixed layer, rows [0, total), whole trailing dims.
  graph::Graph g("g", {BufferType{DType::f32, {3, 8, 2}}, TensorType{DType::f32, {"total", 2}}});
  const graph::Dim total = graph::shape_of(g.input(1).type())[0];
  auto history = ops::buffer_load(g.input(0), {{1, 2}, {0, total}});
  auto rows = ops::slice(g.input(1), {{1, total}});  // rows 1.. of a row-major matrix
  g.output({ops::neg(ops::reshape(history, graph::Shape{total, 2})), ops::neg(rows)});
  auto compiled = compiler::compile(g.module(), kiln::testing::with_cpu_kernels(kOneStepPerOp));
  const GraphPlan& plan = compiled.plan("g");
  EXPECT_EQ(count_steps(plan, Op::buffer_load), 0);
  EXPECT_EQ(count_steps(plan, Op::slice), 0);
  EXPECT_EQ(value_of(plan, history).kind, ValueKind::alias);
  EXPECT_EQ(value_of(plan, history).root, g.input(0).id());
  EXPECT_EQ(value_of(plan, rows).kind, ValueKind::alias);
  EXPECT_EQ(value_of(plan, rows).root, g.input(1).id());
}

TEST(PlanAliases, StridedAndPartialWindowsStayCopies) {
  graph::Graph g("g", {TensorType{DType::f32, {4, 6}}, BufferType{DType::f32, {4, 6}}});
  auto columns = ops::slice(g.input(0), {{0, 4}, {1, 3}});   // part of each row: not one block
  auto every_other = ops::slice(g.input(0), {{0, 4, 2}});    // rows 0 and 2
  auto two_rows_part = ops::buffer_load(g.input(1), {{1, 3}, {0, 5}});
  auto one_row_part = ops::slice(g.input(0), {{2, 3}, {1, 4}});  // one block: an alias
  g.output({ops::neg(columns), ops::neg(every_other), ops::neg(two_rows_part), ops::neg(one_row_part)});
  auto compiled = compiler::compile(g.module(), kiln::testing::with_cpu_kernels(kOneStepPerOp));
  const GraphPlan& plan = compiled.plan("g");
  EXPECT_EQ(value_of(plan, columns).kind, ValueKind::slot);
  EXPECT_EQ(value_of(plan, every_other).kind, ValueKind::slot);
  EXPECT_EQ(value_of(plan, two_rows_part).kind, ValueKind::slot);
  EXPECT_EQ(value_of(plan, one_row_part).kind, ValueKind::alias);
  EXPECT_EQ(count_steps(plan, Op::slice), 2);
  EXPECT_EQ(count_steps(plan, Op::buffer_load), 1);
}

TEST(PlanAliases, RootSlotLivesUntilTheLastUseOfItsAliases) {
  // Without the extension, e's slot would be free once the reshape (which reads it) is gone, and
  // the sin/cos chain would take it while `view` is still to be read by the final add.
  graph::Graph g("g", {TensorType{DType::f32, {8}}});
  auto e = ops::exp(g.input(0));
  auto view = ops::reshape(e, std::vector<int64_t>{2, 4});
  graph::TensorValue chain = ops::sin(g.input(0));
  for (int i = 0; i < 4; ++i) chain = ops::cos(chain);
  g.output({ops::add(ops::reshape(chain, std::vector<int64_t>{2, 4}), view)});
  auto compiled = compiler::compile(g.module(), kiln::testing::with_cpu_kernels(kOneStepPerOp));
  const GraphPlan& plan = compiled.plan("g");
  ASSERT_EQ(value_of(plan, view).kind, ValueKind::alias);
  expect_alias_roots_stay_live(plan);
  EXPECT_GE(plan.num_slots, 3);  // e, and two for the chain around it
}

TEST(PlanAliases, AnAliasReturnedAsAnOutputKeepsItsRootSlotToTheEnd) {
  graph::Graph g("g", {TensorType{DType::f32, {8}}});
  auto e = ops::exp(g.input(0));
  auto view = ops::reshape(e, std::vector<int64_t>{2, 4});
  graph::TensorValue chain = ops::sin(g.input(0));
  for (int i = 0; i < 4; ++i) chain = ops::cos(chain);
  g.output({view, chain});
  auto compiled = compiler::compile(g.module(), kiln::testing::with_cpu_kernels(kOneStepPerOp));
  const GraphPlan& plan = compiled.plan("g");
  // The output stays an alias (the engine returns a copy of it), and e's slot is never reused.
  EXPECT_EQ(value_of(plan, view).kind, ValueKind::alias);
  EXPECT_EQ(value_of(plan, e).kind, ValueKind::slot);
  expect_alias_roots_stay_live(plan);
}

TEST(PlanAliases, ABufferReadAfterItsLastWriteIsAnAlias) {
  // Store, then read the history back, as attention does with its cache each step.
  graph::Graph g("g", {BufferType{DType::f32, {2, 8, 4}}, TensorType{DType::f32, {1, 1, 4}}});
  ops::buffer_store(g.input(0), g.input(1), {{0, 1}, {3, 4}});
  auto history = ops::buffer_load(g.input(0), {{0, 1}, {0, 4}});
  auto flat = ops::reshape(history, std::vector<int64_t>{4, 4});
  g.output({ops::neg(flat)});
  auto compiled = compiler::compile(g.module(), kiln::testing::with_cpu_kernels(kOneStepPerOp));
  const GraphPlan& plan = compiled.plan("g");
  EXPECT_EQ(value_of(plan, history).kind, ValueKind::alias);
  EXPECT_EQ(value_of(plan, flat).root, g.input(0).id());
  EXPECT_EQ(count_steps(plan, Op::buffer_load), 0);
  EXPECT_EQ(count_steps(plan, Op::buffer_store), 1);
}

TEST(PlanAliases, PagedAttentionReadsTheBufferAndPagedKvStoreWritesIt) {
  // A load of the cache stays an alias across a paged_attention (a read), not across a paged_kv_store.
  const graph::Shape cache{1, 4, 2, 1, 2};
  graph::Graph g("g", {BufferType{DType::f32, cache}, TensorType{DType::f32, {1, 1, 2}}, TensorType{DType::i64, {1}},
                       TensorType{DType::i64, {1, 4}}});
  auto kept = ops::buffer_load(g.input(0));
  auto attended = ops::paged_attention(g.input(1), g.input(0), g.input(0), g.input(3), g.input(2), g.input(2), 0, 0.5);
  auto kept_used = ops::neg(kept);  // kept's last use: after the attention, before the store
  auto copied = ops::buffer_load(g.input(0));
  ops::paged_kv_store(g.input(0), attended, g.input(2), 0);
  g.output({kept_used, ops::neg(copied)});
  auto compiled = compiler::compile(g.module(), kiln::testing::with_cpu_kernels(kOneStepPerOp));
  const GraphPlan& plan = compiled.plan("g");
  EXPECT_EQ(value_of(plan, kept).kind, ValueKind::alias);
  EXPECT_EQ(value_of(plan, copied).kind, ValueKind::slot);
  EXPECT_EQ(count_steps(plan, Op::buffer_load), 1);
}

TEST(PlanAliases, ABufferReadLiveAcrossAWriteOfTheBufferStaysACopy) {
  graph::Graph g("g", {BufferType{DType::f32, {4}}, BufferType{DType::f32, {4}}});
  auto before = ops::buffer_load(g.input(0));
  auto flat = ops::reshape(before, std::vector<int64_t>{2, 2});      // read through a chain...
  auto other = ops::buffer_load(g.input(1));                          // another buffer: not written
  ops::buffer_store(g.input(0), ops::neg(before));
  g.output({ops::exp(flat), ops::exp(other)});                        // ...after the store
  auto compiled = compiler::compile(g.module(), kiln::testing::with_cpu_kernels(kOneStepPerOp));
  const GraphPlan& plan = compiled.plan("g");
  EXPECT_EQ(value_of(plan, before).kind, ValueKind::slot);  // a copy made before the store
  EXPECT_EQ(count_steps(plan, Op::buffer_load), 1);
  EXPECT_EQ(value_of(plan, flat).kind, ValueKind::alias);   // of the copy, which nothing writes
  EXPECT_EQ(value_of(plan, flat).root, before.id());
  EXPECT_EQ(value_of(plan, other).kind, ValueKind::alias);
  expect_alias_roots_stay_live(plan);
}

TEST(PlanAliases, ABufferReadReturnedAsAnOutputIsACopyIfTheBufferIsWrittenLater) {
  graph::Graph g("g", {BufferType{DType::f32, {4}}, TensorType{DType::f32, {4}}});
  auto before = ops::buffer_load(g.input(0));
  ops::buffer_store(g.input(0), g.input(1));
  g.output({before});
  auto compiled = compiler::compile(g.module(), kiln::testing::with_cpu_kernels(kOneStepPerOp));
  const GraphPlan& plan = compiled.plan("g");
  EXPECT_EQ(value_of(plan, before).kind, ValueKind::output);
  EXPECT_EQ(count_steps(plan, Op::buffer_load), 1);
}

TEST(PlanAliases, AStepReadingAnAliasOfTheBufferItWritesKeepsTheCopy) {
  // The store reads its value and writes the same buffer: an alias would overlap the window written.
  graph::Graph g("g", {BufferType{DType::f32, {2, 4}}});
  auto row0 = ops::buffer_load(g.input(0), {{0, 1}});
  ops::buffer_store(g.input(0), row0, {{1, 2}});
  auto compiled = compiler::compile(g.module(), kiln::testing::with_cpu_kernels(kOneStepPerOp));
  const GraphPlan& plan = compiled.plan("g");
  EXPECT_EQ(value_of(plan, row0).kind, ValueKind::slot);
}

TEST(PlanAliases, KernelsNeverWriteAnAlias) {
  // Aliases are tensors made by no step; kernels write only their results and buffer operands.
  graph::Graph g("g", {BufferType{DType::f32, {2, 4}}, TensorType{DType::f32, {8}}});
  {
    graph::Graph::Scope scope(g);
    auto w = g.weight({"w", DType::f32, {2, 4}});
    auto history = ops::buffer_load(g.input(0), {{1, 2}});  // read after the store: a copy
    ops::buffer_store(g.input(0), ops::reshape(g.input(1), std::vector<int64_t>{2, 4}));
    g.output({ops::neg(history), ops::add(ops::reshape(w, std::vector<int64_t>{8}), g.input(1))});
  }
  auto compiled = compiler::compile(g.module(), kiln::testing::with_cpu_kernels(kOneStepPerOp));
  const GraphPlan& plan = compiled.plan("g");
  for (const auto& step : plan.steps) {
    for (int32_t v : step.outputs) EXPECT_NE(plan.values.at(static_cast<size_t>(v)).kind, ValueKind::alias);
    if (step.op == Op::buffer_store) {
      EXPECT_NE(plan.values.at(static_cast<size_t>(step.inputs[0])).kind, ValueKind::alias);
    }
  }
  int aliases = 0;
  for (const PlanValue& value : plan.values) aliases += value.kind == ValueKind::alias;
  EXPECT_EQ(aliases, 2);  // the reshapes of the input and of the weight
}

TEST(PlanAliases, AReshapedWeightIsAnAliasOfTheWeight) {
  graph::Graph g("g", {TensorType{DType::f32, {2, 3}}});
  graph::TensorValue flat_w;
  {
    graph::Graph::Scope scope(g);
    auto w = g.weight({"w", DType::f32, {6}});
    flat_w = ops::reshape(w, std::vector<int64_t>{3, 2});
    g.output({ops::matmul(g.input(0), flat_w)});
  }
  auto compiled = compiler::compile(g.module(), kiln::testing::with_cpu_kernels(kOneStepPerOp));
  const GraphPlan& plan = compiled.plan("g");
  const PlanValue& alias = value_of(plan, flat_w);
  ASSERT_EQ(alias.kind, ValueKind::alias);
  EXPECT_EQ(plan.values.at(static_cast<size_t>(alias.root)).kind, ValueKind::weight);
}

TEST(PlanAliases, PrintedPlansShowAliasesAndTheirRoots) {
  graph::Graph g("g", {TensorType{DType::f32, {2, 3}}});
  g.output({ops::reshape(ops::exp(g.input(0)), std::vector<int64_t>{6})});
  auto compiled = compiler::compile(g.module(), kiln::testing::with_cpu_kernels(kOneStepPerOp));
  EXPECT_EQ(compiler::to_string(compiled.plan("g")),
            "graph 'g': 1 step, 1 alias, 1 slot\n"
            "%0 f32[2, 3] input 0\n"
            "%1 f32[2, 3] slot 0\n"
            "%2 f32[6] alias of %1\n"
            "step exp %0 -> %1\n"
            "alias reshape %1 -> %2\n");
}

// ---- artifacts -----------------------------------------------------------------------------------

graph::Module chain_module() {
  graph::Graph g("g", {BufferType{DType::f32, {3, 4}}});
  auto row = ops::buffer_load(g.input(0), {{1, 2}});
  auto flat = ops::reshape(row, std::vector<int64_t>{4});
  g.output({ops::neg(flat)});
  return g.module();
}

TEST(PlanAliases, ArtifactsKeepAliases) {
  auto compiled = compiler::compile(chain_module(), kiln::testing::with_cpu_kernels(kOneStepPerOp));
  auto loaded = compiler::CompiledModel::deserialize(compiled.serialize());
  const GraphPlan& a = compiled.plan("g");
  const GraphPlan& b = loaded.plan("g");
  ASSERT_EQ(b.aliases.size(), 2u);
  ASSERT_EQ(a.values.size(), b.values.size());
  for (size_t v = 0; v < a.values.size(); ++v) {
    EXPECT_EQ(a.values[v].kind, b.values[v].kind) << "%" << v;
    EXPECT_EQ(a.values[v].alias, b.values[v].alias) << "%" << v;
    EXPECT_EQ(a.values[v].root, b.values[v].root) << "%" << v;
  }
  for (size_t i = 0; i < a.aliases.size(); ++i) {
    EXPECT_EQ(a.aliases[i].op, b.aliases[i].op);
    EXPECT_EQ(a.aliases[i].inputs, b.aliases[i].inputs);
    EXPECT_EQ(a.aliases[i].attrs, b.aliases[i].attrs);
  }
}

// A plan edited by `edit`, saved and loaded again: a LoadError naming `what`.
template <class F>
void expect_corrupted_plan_refused(F&& edit, const std::string& what) {
  auto compiled = compiler::compile(chain_module(), kiln::testing::with_cpu_kernels(kOneStepPerOp));
  std::map<std::string, GraphPlan> plans = compiled.plans();
  edit(plans.at("g"));
  compiler::CompiledModel edited(compiled.ir(), std::move(plans));
  const std::string bytes = edited.serialize();
  expect_error<LoadError>([&] { compiler::CompiledModel::deserialize(bytes); }, {"graph 'g'", what});
}

TEST(PlanAliases, ArtifactsWithBrokenAliasLinksAreRefused) {
  auto flat_of = [](GraphPlan& plan) -> PlanValue& {
    return plan.values.at(static_cast<size_t>(plan.aliases.at(1).outputs.at(0)));
  };
  expect_corrupted_plan_refused([&](GraphPlan& plan) { flat_of(plan).root = plan.aliases[0].outputs[0]; },
                                "but its chain ends at");
  expect_corrupted_plan_refused([&](GraphPlan& plan) { flat_of(plan).alias = 7; }, "which is not that alias");
  expect_corrupted_plan_refused(
      [&](GraphPlan& plan) {
        std::swap(plan.aliases[0], plan.aliases[1]);
        for (int32_t a = 0; a < 2; ++a) plan.values.at(static_cast<size_t>(plan.aliases[static_cast<size_t>(a)].outputs[0])).alias = a;
      },
      "not listed before it");
  expect_corrupted_plan_refused([&](GraphPlan& plan) { plan.aliases[1].op = Op::transpose; },
                                "cannot be an alias");
  expect_corrupted_plan_refused(
      [&](GraphPlan& plan) { plan.values.at(static_cast<size_t>(plan.outputs[0])).alias = 0; },
      "do not match its kind");
}

}  // namespace
