// The plan steps on their own (src/compiler/passes/plan_passes.h), on plans built by hand: memory
// planning (slots by liveness, per dtype and device), kernel selection (the key each step records, a
// missing kernel named) and alias planning (views instead of copies, unless a buffer changes under
// them).
#include <set>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "compiler/passes/plan_passes.h"
#include "kiln/errors.h"
#include "test_util.h"

namespace {

using namespace kiln;
using compiler::GraphPlan;
using compiler::PlanValue;
using compiler::Step;
using compiler::ValueKind;
using graph::Op;
using kiln::testing::expect_error;

graph::Type f32(std::vector<int64_t> shape, DeviceRef device = DeviceRef::CPU()) {
  return graph::TensorType{DType::f32, graph::Shape::of(shape), device};
}

// A plan of the given value types (every value a slot until marked otherwise) and steps.
struct PlanBuilder {
  GraphPlan plan;
  explicit PlanBuilder(std::vector<graph::Type> types) {
    plan.name = "g";
    for (auto& t : types) {
      PlanValue value;
      value.type = std::move(t);
      plan.values.push_back(std::move(value));
    }
  }
  PlanBuilder& input(int32_t v, int32_t index) {
    plan.values[static_cast<size_t>(v)].kind = ValueKind::input;
    plan.values[static_cast<size_t>(v)].input = index;
    plan.input_types.push_back(plan.values[static_cast<size_t>(v)].type);
    return *this;
  }
  PlanBuilder& step(Op op, std::vector<int32_t> inputs, std::vector<int32_t> outputs, graph::Attrs attrs = {}) {
    Step s;
    s.op = op;
    s.inputs = std::move(inputs);
    s.outputs = std::move(outputs);
    s.attrs = std::move(attrs);
    s.node = static_cast<int32_t>(plan.steps.size());
    plan.steps.push_back(std::move(s));
    return *this;
  }
  PlanBuilder& output(int32_t v) {
    plan.outputs.push_back(v);
    plan.values[static_cast<size_t>(v)].kind = ValueKind::output;
    return *this;
  }
};

int32_t slot(const GraphPlan& plan, int32_t v) { return plan.values.at(static_cast<size_t>(v)).slot; }

// ---- plan_memory ---------------------------------------------------------------------------------

TEST(PlanMemory, AChainReusesTwoSlots) {
  // %0 input -> exp -> %1 -> exp -> %2 -> exp -> %3 -> exp -> %4 output
  PlanBuilder b({f32({8}), f32({8}), f32({8}), f32({8}), f32({8})});
  b.input(0, 0).step(Op::exp, {0}, {1}).step(Op::exp, {1}, {2}).step(Op::exp, {2}, {3}).step(Op::exp, {3}, {4}).output(4);
  compiler::passes::plan_memory(b.plan);
  EXPECT_EQ(b.plan.num_slots, 2);
  EXPECT_NE(slot(b.plan, 1), slot(b.plan, 2));  // a step's result never shares its operand's slot
  EXPECT_EQ(slot(b.plan, 1), slot(b.plan, 3));  // %1 is dead once %2 is made
  EXPECT_EQ(slot(b.plan, 4), -1);               // outputs get fresh memory, not a slot
}

TEST(PlanMemory, ValuesOfOtherDtypesOrDevicesNeverShareASlot) {
  // %1 (cpu:0 f32) dies at step 1; %2 is cpu:1 f32 and %3 is cpu:0 i32 (both could reuse %1's slot by
  // liveness alone); %4 is cpu:0 f32 and does reuse it.
  PlanBuilder b({f32({4}), f32({4}), f32({4}, DeviceRef::CPU(1)),
                 graph::TensorType{DType::i32, graph::Shape::of({4}), DeviceRef::CPU()}, f32({4}), f32({4})});
  b.input(0, 0)
      .step(Op::exp, {0}, {1})
      .step(Op::transfer_to, {1}, {2})
      .step(Op::cast, {2}, {3})
      .step(Op::cast, {3}, {4})
      .step(Op::exp, {4}, {5})
      .output(5);
  compiler::passes::plan_memory(b.plan);
  EXPECT_NE(slot(b.plan, 2), slot(b.plan, 1));
  EXPECT_NE(slot(b.plan, 3), slot(b.plan, 1));
  EXPECT_NE(slot(b.plan, 3), slot(b.plan, 2));
  EXPECT_EQ(slot(b.plan, 4), slot(b.plan, 1));
  EXPECT_EQ(b.plan.num_slots, 3);
}

// ---- select_kernels ------------------------------------------------------------------------------

// A catalog of exactly the keys it is given.
class KeysCatalog final : public compiler::KernelCatalog {
 public:
  explicit KeysCatalog(std::set<graph::KernelKey> keys) : keys_(std::move(keys)) {}
  bool has_kernel(const graph::KernelKey& key) const override { return keys_.count(key) != 0; }
  bool evaluate(const graph::KernelKey&, const graph::Attrs&, std::span<const compiler::HostArray>,
                std::span<const compiler::HostArray>) const override {
    return false;
  }
  std::string fingerprint() const override { return "keys"; }

 private:
  std::set<graph::KernelKey> keys_;
};

TEST(SelectKernels, EachStepRecordsItsResultsDeviceAndItsFirstOperandsDtype) {
  // cast i32 -> f32 on gpu:0: the key is (cast, gpu, i32); exp on the result: (exp, gpu, f32).
  const DeviceRef gpu = DeviceRef::GPU(0);
  PlanBuilder b({graph::TensorType{DType::i32, graph::Shape::of({4}), gpu}, f32({4}, gpu), f32({4}, gpu)});
  b.input(0, 0).step(Op::cast, {0}, {1}).step(Op::exp, {1}, {2}).output(2);
  compiler::passes::select_kernels(b.plan, nullptr);  // no catalog: keys recorded, nothing checked
  EXPECT_EQ(b.plan.steps[0].kernel, (graph::KernelKey{Op::cast, DeviceKind::GPU, DType::i32}));
  EXPECT_EQ(b.plan.steps[1].kernel, (graph::KernelKey{Op::exp, DeviceKind::GPU, DType::f32}));

  const KeysCatalog both({{Op::cast, DeviceKind::GPU, DType::i32}, {Op::exp, DeviceKind::GPU, DType::f32}});
  EXPECT_NO_THROW(compiler::passes::select_kernels(b.plan, &both));
}

TEST(SelectKernels, AStepWithoutAKernelInTheCatalogIsAnErrorNamingIt) {
  PlanBuilder b({f32({4}), f32({4}), f32({4})});
  b.input(0, 0).step(Op::exp, {0}, {1}).step(Op::tanh, {1}, {2}).output(2);
  const KeysCatalog only_exp({{Op::exp, DeviceKind::CPU, DType::f32}});
  expect_error<Error>([&] { compiler::passes::select_kernels(b.plan, &only_exp); },
                      "compile: graph 'g' node 1: no cpu kernel for tanh on f32");
}

TEST(SelectKernels, CustomOpsAreLeftToTheirExtension) {
  PlanBuilder b({f32({4}), f32({4})});
  b.input(0, 0).step(Op::custom, {0}, {1}, {{"symbol", std::string("my_op")}}).output(1);
  const KeysCatalog none({});
  compiler::passes::select_kernels(b.plan, &none);
  EXPECT_EQ(b.plan.steps[0].kernel, (graph::KernelKey{Op::custom, DeviceKind::CPU, DType::f32}));
}

// ---- plan_aliases --------------------------------------------------------------------------------

TEST(PlanAliasesStep, AReshapeBecomesAnAliasOfItsOperand) {
  PlanBuilder b({f32({2, 3}), f32({2, 3}), f32({6}), f32({6})});
  b.input(0, 0)
      .step(Op::exp, {0}, {1})
      .step(Op::reshape, {1}, {2}, {{"shape", graph::Shape::of({6})}})
      .step(Op::exp, {2}, {3})
      .output(3);
  compiler::passes::plan_aliases(b.plan);
  ASSERT_EQ(b.plan.aliases.size(), 1u);
  EXPECT_EQ(b.plan.steps.size(), 2u);  // exp, exp: the reshape launches nothing
  EXPECT_EQ(b.plan.values[2].kind, ValueKind::alias);
  EXPECT_EQ(b.plan.values[2].root, 1);
  EXPECT_EQ(compiler::passes::root_of(b.plan, 2), 1);
}

TEST(PlanAliasesStep, AWindowOfABufferWrittenWhileTheWindowLivesStaysACopy) {
  // buffer_load of rows [0, 1) of a buffer, then buffer_store into the buffer, then the loaded value
  // is read: an alias would see the store, so the load stays a copy.
  const graph::Type buffer = graph::BufferType{DType::f32, graph::Shape::of({2, 4}), DeviceRef::CPU()};
  PlanBuilder b({buffer, f32({1, 4}), f32({1, 4}), f32({1, 4})});
  b.input(0, 0).input(1, 1);
  const graph::Attrs window{{"starts", graph::Shape::of({0, 0})}, {"stops", graph::Shape::of({1, 4})},
                            {"steps", std::vector<int64_t>{1, 1}}};
  b.step(Op::buffer_load, {0}, {2}, window)
      .step(Op::buffer_store, {0, 1}, {}, window)
      .step(Op::exp, {2}, {3})
      .output(3);
  compiler::passes::plan_aliases(b.plan);
  EXPECT_TRUE(b.plan.aliases.empty());
  EXPECT_EQ(b.plan.values[2].kind, ValueKind::slot);

  // Without the store in between, the same load is an alias.
  PlanBuilder c({buffer, f32({1, 4}), f32({1, 4})});
  c.input(0, 0).step(Op::buffer_load, {0}, {1}, window).step(Op::exp, {1}, {2}).output(2);
  compiler::passes::plan_aliases(c.plan);
  EXPECT_EQ(c.plan.aliases.size(), 1u);
  EXPECT_EQ(c.plan.values[1].kind, ValueKind::alias);
}

}  // namespace
