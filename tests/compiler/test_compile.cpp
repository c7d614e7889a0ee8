// compile(): the plan it makes (values, steps, arena slots), call inlining and its errors.
#include <map>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "cpu_kernel_catalog.h"
#include "kiln/compiler/compiled_model.h"
#include "kiln/graph/ops.h"

namespace {

using namespace kiln;
namespace ops = kiln::graph::ops;
using compiler::GraphPlan;
using compiler::ValueKind;
using graph::TensorType;

template <class E, class F>
std::string error_message(F&& fn) {
  try {
    fn();
  } catch (const E& e) {
    return e.what();
  } catch (const std::exception& e) {
    return std::string("wrong exception type: ") + e.what();
  }
  return "no exception";
}

// These plans are about slots and steps, so they keep one step per op: no optimizing passes (which
// would fuse the elementwise chains into one step).
const compiler::CompileOptions kOneStepPerOp{.optimize = false};

// Replays the plan, tracking which value holds each slot: a step may only read slot values that
// still own their slot, so no two live values share memory.
void expect_slots_never_clobber_live_values(const GraphPlan& plan) {
  std::map<int32_t, int32_t> owner;  // slot -> value
  for (const auto& step : plan.steps) {
    for (int32_t v : step.inputs) {
      const auto& value = plan.values.at(static_cast<size_t>(v));
      if (value.kind == ValueKind::slot) {
        EXPECT_EQ(owner.at(value.slot), v) << "node " << step.node << " reads %" << v << " after its slot was reused";
      }
    }
    for (int32_t v : step.outputs) {
      const auto& value = plan.values.at(static_cast<size_t>(v));
      if (value.kind != ValueKind::slot) continue;
      ASSERT_GE(value.slot, 0);
      ASSERT_LT(value.slot, plan.num_slots);
      for (int32_t in : step.inputs) {
        const auto& operand = plan.values.at(static_cast<size_t>(in));
        if (operand.kind == ValueKind::slot) {
          EXPECT_NE(operand.slot, value.slot) << "node " << step.node << " writes over its operand";
        }
      }
      owner[value.slot] = v;
    }
  }
}

TEST(Compile, ChainOfElementwiseOpsReusesTwoSlots) {
  graph::Graph g("chain", {TensorType{DType::f32, {"n"}}});
  graph::TensorValue y = g.input(0);
  for (int i = 0; i < 10; ++i) y = ops::add(y, g.input(0));
  g.output({y});
  auto compiled = compiler::compile(g.module(), kiln::testing::with_cpu_kernels(kOneStepPerOp));
  const GraphPlan& plan = compiled.plan("chain");
  ASSERT_EQ(plan.steps.size(), 10u);
  EXPECT_LE(plan.num_slots, 2);
  int slot_values = 0;
  for (const auto& v : plan.values) slot_values += v.kind == ValueKind::slot;
  EXPECT_EQ(slot_values, 9);  // the last add writes the output
  EXPECT_EQ(plan.values.at(static_cast<size_t>(plan.outputs.at(0))).kind, ValueKind::output);
  expect_slots_never_clobber_live_values(plan);
}

TEST(Compile, DiamondKeepsBothBranchesLive) {
  // a and b are both live when c = a * b runs: they need different slots.
  graph::Graph g("diamond", {TensorType{DType::f32, {4}}});
  auto a = ops::exp(g.input(0));
  auto b = ops::sin(g.input(0));
  auto c = ops::mul(a, b);
  auto d = ops::cos(c);
  g.output({ops::add(d, a)});
  auto compiled = compiler::compile(g.module(), kiln::testing::with_cpu_kernels(kOneStepPerOp));
  const GraphPlan& plan = compiled.plan("diamond");
  EXPECT_GE(plan.num_slots, 2);
  EXPECT_LE(plan.num_slots, 3);
  expect_slots_never_clobber_live_values(plan);
}

TEST(Compile, SlotsAreSharedOnlyWithinADType) {
  graph::Graph g("mixed", {TensorType{DType::f32, {4}}});
  auto f = ops::exp(g.input(0));
  auto i = ops::cast(f, DType::i32);
  auto j = ops::add(i, i);
  g.output({ops::cast(j, DType::f32)});
  auto compiled = compiler::compile(g.module(), kiln::testing::with_cpu_kernels());
  const GraphPlan& plan = compiled.plan("mixed");
  std::map<int32_t, DType> slot_dtype;
  for (const auto& v : plan.values) {
    if (v.kind != ValueKind::slot) continue;
    auto [it, inserted] = slot_dtype.emplace(v.slot, graph::dtype_of(v.type));
    EXPECT_EQ(it->second, graph::dtype_of(v.type)) << "slot " << v.slot;
  }
  EXPECT_EQ(slot_dtype.size(), 3u);  // f32 exp, i32 cast, i32 add (live together with the cast)
}

TEST(Compile, OutputsNeverShareMemoryWithInputsOrEachOther) {
  graph::Graph g("passthrough", {TensorType{DType::f32, {3}}, TensorType{DType::f32, {3}}});
  auto sum = ops::add(g.input(0), g.input(1));
  g.output({g.input(1), sum, ops::neg(sum)});
  auto compiled = compiler::compile(g.module(), kiln::testing::with_cpu_kernels());
  const GraphPlan& plan = compiled.plan("passthrough");
  ASSERT_EQ(plan.outputs.size(), 3u);
  // The input stays an input (the engine returns a copy); computed outputs get fresh memory, no slot.
  const auto& passthrough = plan.values.at(static_cast<size_t>(plan.outputs[0]));
  EXPECT_EQ(passthrough.kind, ValueKind::input);
  EXPECT_EQ(passthrough.input, 1);
  for (size_t i = 1; i < 3; ++i) {
    const auto& out = plan.values.at(static_cast<size_t>(plan.outputs[i]));
    EXPECT_EQ(out.kind, ValueKind::output);
    EXPECT_EQ(out.slot, -1);
  }
}

TEST(Compile, WeightsAndConstantsAreNotSteps) {
  graph::Graph g("affine", {TensorType{DType::f32, {2}}});
  {
    graph::Graph::Scope scope(g);
    auto w = g.weight({"scale", DType::f32, {2}});
    auto bias = ops::constant(std::vector<float>{1, 2}, {2});
    g.output({ops::add(ops::mul(g.input(0), w), bias)});
  }
  auto compiled = compiler::compile(g.module(), kiln::testing::with_cpu_kernels(kOneStepPerOp));
  const GraphPlan& plan = compiled.plan("affine");
  ASSERT_EQ(plan.steps.size(), 2u);
  EXPECT_EQ(plan.steps[0].op, graph::Op::mul);
  EXPECT_EQ(plan.steps[1].op, graph::Op::add);
  ASSERT_EQ(plan.constants.size(), 1u);
  EXPECT_EQ(plan.values.at(static_cast<size_t>(plan.constants[0].outputs.at(0))).kind, ValueKind::constant);
  ASSERT_EQ(plan.weights.size(), 1u);
  EXPECT_EQ(plan.weights[0].name, "scale");
  const auto& w = plan.values.at(static_cast<size_t>(plan.steps[0].inputs.at(1)));
  EXPECT_EQ(w.kind, ValueKind::weight);
  EXPECT_EQ(w.weight, "scale");
}

TEST(Compile, MissingKernelNamesGraphNodeOpAndDType) {
  // No GPU kernels exist yet, so an op on a GPU value has none.
  graph::Graph g("on_gpu", {TensorType{DType::f32, {2}, DeviceRef::GPU()}});
  g.output({ops::add(g.input(0), g.input(0))});
  EXPECT_EQ(error_message<Error>([&] { compiler::compile(g.module(), kiln::testing::with_cpu_kernels()); }),
            "compile: graph 'on_gpu' node 0: no gpu kernel for add on f32");
}

TEST(Compile, CustomOpNeedsAnExtension) {
  graph::Graph g("ext", {TensorType{DType::f32, {2}}});
  g.output(ops::custom("my_op", {g.input(0)}, {TensorType{DType::f32, {2}}}));
  auto message = error_message<ExtensionError>([&] { compiler::compile(g.module(), kiln::testing::with_cpu_kernels()); });
  EXPECT_EQ(message, "compile: graph 'ext' node 0: custom op 'my_op' is not defined by any loaded extension "
                     "(loaded: none)");
}

TEST(Compile, CallsAreInlinedRecursively) {
  graph::Module module;
  graph::Graph inner("inner", {TensorType{DType::f32, {"n"}}}, &module);
  inner.output({ops::exp(inner.input(0))});
  graph::Graph middle("middle", {TensorType{DType::f32, {"n"}}}, &module);
  middle.output({ops::sin(ops::call("inner", {middle.input(0)})[0])});
  graph::Graph top("top", {TensorType{DType::f32, {"n"}}}, &module);
  auto once = ops::call("middle", {top.input(0)})[0];
  top.output({ops::call("inner", {once})[0]});

  auto compiled = compiler::compile(module, kiln::testing::with_cpu_kernels(kOneStepPerOp));
  EXPECT_EQ(compiled.graph_names(), (std::vector<std::string>{"inner", "middle", "top"}));
  const GraphPlan& plan = compiled.plan("top");
  std::vector<graph::Op> ops_run;
  for (const auto& step : plan.steps) ops_run.push_back(step.op);
  EXPECT_EQ(ops_run, (std::vector<graph::Op>{graph::Op::exp, graph::Op::sin, graph::Op::exp}));
  for (const auto& node : compiled.ir().at("top").nodes) EXPECT_NE(node.op, graph::Op::call);
  // The steps chain: each reads the previous one's result, the first reads the input.
  EXPECT_EQ(plan.steps[0].inputs, std::vector<int32_t>{0});
  EXPECT_EQ(plan.steps[1].inputs, plan.steps[0].outputs);
  EXPECT_EQ(plan.steps[2].inputs, plan.steps[1].outputs);
  EXPECT_EQ(plan.outputs, plan.steps[2].outputs);
}

// A chain of graphs each calling the next twice is a few lines per graph but 2^40 nodes inlined: refused
// once the inlined nodes pass the bound, not expanded. Graphs that only pass their input on cost the
// same (the bound counts calls too).
TEST(Compile, ExponentialInliningIsRefused) {
  for (bool with_work : {true, false}) {
    graph::Module module;
    graph::Graph leaf("g40", {TensorType{DType::f32, {"n"}}}, &module);
    leaf.output({with_work ? ops::exp(leaf.input(0)) : leaf.input(0)});
    for (int i = 39; i >= 0; --i) {
      graph::Graph g("g" + std::to_string(i), {TensorType{DType::f32, {"n"}}}, &module);
      const std::string callee = "g" + std::to_string(i + 1);
      auto once = ops::call(callee, {g.input(0)})[0];
      g.output({ops::call(callee, {once})[0]});
    }
    const std::string message = error_message<VerifyError>(
        [&] { compiler::compile(module, kiln::testing::with_cpu_kernels(kOneStepPerOp)); });
    EXPECT_NE(message.find("inlines to more than 1048576 nodes (through calls to 'g"), std::string::npos)
        << message;
  }
}

TEST(Compile, InlinedCalleeWeightsBecomeTheCallersWeights) {
  graph::Module module;
  graph::Graph layer("layer", {TensorType{DType::f32, {2}}}, &module);
  layer.output({ops::mul(layer.input(0), layer.weight({"gain", DType::f32, {2}}))});
  graph::Graph model("model", {TensorType{DType::f32, {2}}}, &module);
  model.output({ops::call("layer", {model.input(0)})[0]});
  auto compiled = compiler::compile(module, kiln::testing::with_cpu_kernels());
  const GraphPlan& plan = compiled.plan("model");
  ASSERT_EQ(plan.weights.size(), 1u);
  EXPECT_EQ(plan.weights[0].name, "gain");
}

TEST(Compile, UnknownGraphIsAValueErrorNamingIt) {
  graph::Graph g("only", {TensorType{DType::f32, {2}}});
  g.output({g.input(0)});
  auto compiled = compiler::compile(g.module(), kiln::testing::with_cpu_kernels());
  auto message = error_message<ValueError>([&] { compiled.plan("other"); });
  EXPECT_NE(message.find("'other'"), std::string::npos) << message;
  EXPECT_NE(message.find("'only'"), std::string::npos) << message;
}

}  // namespace
