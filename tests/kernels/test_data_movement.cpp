// The CPU data-movement, buffer and source kernels against hand-written expectations and naive index
// loops written here. Data movement is by element size, so each op also runs on every dtype.
#include <cstring>
#include <string>

#include <gtest/gtest.h>

#include "kernel_test_util.h"

namespace kiln::kernels {
namespace {

using graph::Attrs;
using graph::Op;
using kernel_test::HostTensor;
using kernel_test::permuted;
using kernel_test::run_kernel;
using kernel_test::run_op;
using kernel_test::tensor;
using kernel_test::tensor_from_doubles;

// Elements 0, 1, 2, ... in `dtype` (mod 2 for bool, mod 100 so they fit i8/f16 exactly).
HostTensor iota(DType dtype, std::vector<int64_t> shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  std::vector<double> values;
  for (int64_t i = 0; i < n; ++i) values.push_back(dtype == DType::boolean ? i % 2 : i % 100);
  return tensor_from_doubles(dtype, std::move(shape), values);
}

std::vector<double> doubles(const HostTensor& t) {
  std::vector<double> out;
  for (int64_t i = 0; i < t.numel(); ++i) out.push_back(t.as_double(i));
  return out;
}

Attrs slice_attrs(std::vector<graph::Dim> starts, std::vector<graph::Dim> stops,
                  std::vector<int64_t> steps) {
  return {{"starts", graph::Shape(std::move(starts))},
          {"stops", graph::Shape(std::move(stops))},
          {"steps", std::move(steps)}};
}

template <class Fn> std::string error_of(Fn&& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(DataMovementKernels, EveryOpHasAKernelForEveryDType) {
  for (Op op : {Op::constant, Op::reshape, Op::transpose, Op::broadcast_to, Op::concat, Op::split,
                Op::slice, Op::gather, Op::scatter, Op::buffer_load, Op::buffer_store,
                Op::transfer_to})
    for (DType d : kAllDTypes)
      EXPECT_TRUE(cpu_kernels().contains({op, DeviceKind::CPU, d}))
          << graph::op_name(op) << " on " << dtype_name(d);
  for (DType d : kAllDTypes)
    EXPECT_EQ(cpu_kernels().contains({Op::range, DeviceKind::CPU, d}), d != DType::boolean)
        << "range on " << dtype_name(d);
  // The executor binds weights; there is no kernel to find.
  EXPECT_FALSE(cpu_kernels().contains({Op::weight, DeviceKind::CPU, DType::f32}));
}

// ---- sources --------------------------------------------------------------------------------------

TEST(SourceKernels, ConstantCopiesItsValueBytes) {
  const std::vector<int16_t> values = {1, -2, 300};
  graph::Bytes bytes(values.size() * 2);
  std::memcpy(bytes.data(), values.data(), bytes.size());
  HostTensor out = run_op(Op::constant, {{"value", bytes}}, {}, DType::i16, {3});
  EXPECT_EQ(out.values<int16_t>(), values);
  EXPECT_THROW(run_op(Op::constant, {{"value", bytes}}, {}, DType::i16, {4}), ExecutionError);
}

TEST(SourceKernels, RangeConvertsStartPlusIndexTimesStep) {
  Attrs attrs{{"start", 1.0}, {"step", 0.5}, {"size", graph::Shape{4}}};
  EXPECT_EQ(run_op(Op::range, attrs, {}, DType::f32, {4}).values<float>(),
            (std::vector<float>{1, 1.5, 2, 2.5}));
  // Integers truncate toward zero, like cast: 1, 1.5, 2, 2.5 -> 1, 1, 2, 2.
  EXPECT_EQ(run_op(Op::range, attrs, {}, DType::i32, {4}).values<int32_t>(),
            (std::vector<int32_t>{1, 1, 2, 2}));
  Attrs down{{"start", 10.0}, {"step", -3.0}, {"size", graph::Shape{4}}};
  EXPECT_EQ(run_op(Op::range, down, {}, DType::i64, {4}).values<int64_t>(),
            (std::vector<int64_t>{10, 7, 4, 1}));
  HostTensor half = run_op(Op::range, attrs, {}, DType::bf16, {4});
  EXPECT_EQ(doubles(half), (std::vector<double>{1, 1.5, 2, 2.5}));
}

// ---- reshape, transpose, broadcast_to, transfer_to ----------------------------------------------------

TEST(DataMovementKernels, ReshapeOfTransposedInputReadsInLogicalOrder) {
  HostTensor t = tensor<int32_t>({2, 3}, {0, 1, 2, 3, 4, 5});
  const TensorView tt = permuted(t.view(), {1, 0});  // [3, 2]: [[0, 3], [1, 4], [2, 5]]
  HostTensor out = run_op(Op::reshape, {{"shape", graph::Shape{6}}}, {tt}, DType::i32, {6});
  EXPECT_EQ(out.values<int32_t>(), (std::vector<int32_t>{0, 3, 1, 4, 2, 5}));
  EXPECT_THROW(run_op(Op::reshape, {}, {tt}, DType::i32, {5}), ShapeError);
}

TEST(DataMovementKernels, TransposeMatchesNaiveLoopOnEveryDType) {
  const std::vector<int64_t> perm = {2, 0, 1};
  for (DType d : kAllDTypes) {
    HostTensor in = iota(d, {2, 3, 4});
    HostTensor out = run_op(Op::transpose, {{"perm", perm}}, {in.view()}, d, {4, 2, 3});
    for (int64_t i = 0; i < 4; ++i)
      for (int64_t j = 0; j < 2; ++j)
        for (int64_t k = 0; k < 3; ++k)
          ASSERT_EQ(out.as_double((i * 2 + j) * 3 + k), in.as_double((j * 3 + k) * 4 + i))
              << dtype_name(d) << " at " << i << "," << j << "," << k;
  }
}

TEST(DataMovementKernels, TransposeRejectsAPermThatIsNotOne) {
  HostTensor in = iota(DType::f32, {2, 3});
  EXPECT_THROW(run_op(Op::transpose, {{"perm", std::vector<int64_t>{0, 0}}}, {in.view()}, DType::f32,
                      {2, 2}),
               ShapeError);
}

TEST(DataMovementKernels, BroadcastToRepeatsSizeOneAndMissingDims) {
  HostTensor in = tensor<uint8_t>({3, 1}, {1, 2, 3});
  HostTensor out = run_op(Op::broadcast_to, {}, {in.view()}, DType::u8, {2, 3, 2});
  EXPECT_EQ(out.values<uint8_t>(), (std::vector<uint8_t>{1, 1, 2, 2, 3, 3, 1, 1, 2, 2, 3, 3}));
  EXPECT_THROW(run_op(Op::broadcast_to, {}, {in.view()}, DType::u8, {2, 2}), ShapeError);
}

TEST(DataMovementKernels, TransferToCopiesOnCpuAndRejectsOtherDevices) {
  HostTensor in = tensor<double>({2, 2}, {1, 2, 3, 4});
  HostTensor out = run_op(Op::transfer_to, {{"device", DeviceRef::CPU(1)}},
                          {permuted(in.view(), {1, 0})}, DType::f64, {2, 2});
  EXPECT_EQ(out.values<double>(), (std::vector<double>{1, 3, 2, 4}));
  EXPECT_THROW(
      run_op(Op::transfer_to, {{"device", DeviceRef::GPU(0)}}, {in.view()}, DType::f64, {2, 2}),
      ExecutionError);
}

// ---- concat and split ---------------------------------------------------------------------------------

TEST(DataMovementKernels, ConcatJoinsStridedAndContiguousPartsAlongAnAxis) {
  HostTensor a = tensor<float>({2, 1}, {1, 2});
  HostTensor bt = tensor<float>({3, 2}, {10, 20, 11, 21, 12, 22});  // transposed: [[10,11,12],[20,21,22]]
  HostTensor out = run_op(Op::concat, {{"axis", int64_t{1}}}, {a.view(), permuted(bt.view(), {1, 0})},
                          DType::f32, {2, 4});
  EXPECT_EQ(out.values<float>(), (std::vector<float>{1, 10, 11, 12, 2, 20, 21, 22}));
}

TEST(DataMovementKernels, ConcatOnAxisZeroWorksForEveryDType) {
  for (DType d : kAllDTypes) {
    HostTensor a = iota(d, {1, 3});
    HostTensor b = iota(d, {2, 3});
    HostTensor out = run_op(Op::concat, {{"axis", int64_t{0}}}, {a.view(), b.view()}, d, {3, 3});
    std::vector<double> want = doubles(a);
    for (double v : doubles(b)) want.push_back(v);
    EXPECT_EQ(doubles(out), want) << dtype_name(d);
  }
}

TEST(DataMovementKernels, ConcatRejectsPartsThatDoNotFill) {
  HostTensor a = iota(DType::f32, {2, 1});
  EXPECT_THROW(run_op(Op::concat, {{"axis", int64_t{1}}}, {a.view()}, DType::f32, {2, 3}), ShapeError);
  EXPECT_THROW(run_op(Op::concat, {{"axis", int64_t{2}}}, {a.view()}, DType::f32, {2, 1}),
               ExecutionError);
}

TEST(DataMovementKernels, SplitWritesEachPartFromItsOffset) {
  HostTensor in = tensor<int64_t>({2, 5}, {0, 1, 2, 3, 4, 5, 6, 7, 8, 9});
  HostTensor p0(DType::i64, {2, 2});
  HostTensor p1(DType::i64, {2, 3});
  run_kernel(Op::split, {{"axis", int64_t{1}}, {"sizes", graph::Shape{"n", 3}}}, {in.view()},
             {p0.view(), p1.view()});
  EXPECT_EQ(p0.values<int64_t>(), (std::vector<int64_t>{0, 1, 5, 6}));
  EXPECT_EQ(p1.values<int64_t>(), (std::vector<int64_t>{2, 3, 4, 7, 8, 9}));
}

// ---- slice, buffer_load, buffer_store -------------------------------------------------------------------

TEST(DataMovementKernels, SliceWithStepsMatchesNaiveLoop) {
  for (DType d : kAllDTypes) {
    HostTensor in = iota(d, {5, 7});
    // rows 1, 3; cols 2, 5
    HostTensor out = run_op(Op::slice, slice_attrs({1, 2}, {5, 7}, {2, 3}), {in.view()}, d, {2, 2});
    std::vector<double> want;
    for (int64_t r = 1; r < 5; r += 2)
      for (int64_t c = 2; c < 7; c += 3) want.push_back(in.as_double(r * 7 + c));
    EXPECT_EQ(doubles(out), want) << dtype_name(d);
  }
}

TEST(DataMovementKernels, SliceOutOfBoundsOrSymbolicBoundIsAnError) {
  HostTensor in = iota(DType::f32, {4});
  EXPECT_EQ(error_of([&] { run_op(Op::slice, slice_attrs({2}, {6}, {1}), {in.view()}, DType::f32, {4}); }),
            "slice: slice 2:6 of axis 0 is out of bounds for size 4");
  EXPECT_THROW(run_op(Op::slice, slice_attrs({"n"}, {4}, {1}), {in.view()}, DType::f32, {2}),
               ExecutionError);
  // A result shape that disagrees with the bounds.
  EXPECT_THROW(run_op(Op::slice, slice_attrs({0}, {4}, {1}), {in.view()}, DType::f32, {3}), ShapeError);
}

// A symbolic bound becomes a slot of the run's dims at build, read per launch: one kernel, two runs.
TEST(DataMovementKernels, SymbolicSliceBoundsAreTheRunsDims) {
  struct Slots final : SymbolSlots {
    int32_t slot_of(const graph::Dim& dim) override {
      names.push_back(dim.to_string());
      return static_cast<int32_t>(names.size() - 1);
    }
    std::vector<std::string> names;
  } slots;
  const HostTensor in = iota(DType::f32, {6});
  const Attrs attrs = slice_attrs({"a"}, {"b"}, {2});
  const std::vector<TensorView> inputs{in.view()};
  const KernelInit init{Op::slice, &attrs, inputs, {}, &slots};
  const auto kernel = cpu_kernels().build({Op::slice, DeviceKind::CPU, DType::f32}, init);
  ASSERT_NE(kernel, nullptr);
  EXPECT_EQ(slots.names, (std::vector<std::string>{"a", "b"}));
  SerialParallel serial;
  for (const auto& [start, stop] : {std::pair<int64_t, int64_t>{1, 4}, {0, 6}}) {
    const int64_t dims[] = {start, stop};
    KernelContext ctx{&serial};
    ctx.dims = dims;
    HostTensor out(DType::f32, {(stop - start + 1) / 2});
    const TensorView outputs[] = {out.view()};
    kernel->run(ctx, inputs, outputs);
    std::vector<float> want;
    for (int64_t i = start; i < stop; i += 2) want.push_back(static_cast<float>(i));
    EXPECT_EQ(out.values<float>(), want) << start << ":" << stop;
  }
}

TEST(DataMovementKernels, BufferLoadReadsASliceOrAllOfTheBuffer) {
  HostTensor buffer = tensor<float>({3, 2}, {0, 1, 2, 3, 4, 5});
  EXPECT_EQ(run_op(Op::buffer_load, slice_attrs({1, 0}, {3, 1}, {1, 1}), {buffer.view()}, DType::f32,
                   {2, 1})
                .values<float>(),
            (std::vector<float>{2, 4}));
  EXPECT_EQ(run_op(Op::buffer_load, {}, {buffer.view()}, DType::f32, {3, 2}).values<float>(),
            (std::vector<float>{0, 1, 2, 3, 4, 5}));
}

TEST(DataMovementKernels, BufferStoreWritesTheSliceInPlace) {
  HostTensor buffer = tensor<int32_t>({3, 3}, {0, 0, 0, 0, 0, 0, 0, 0, 0});
  HostTensor value = tensor<int32_t>({2, 2}, {1, 2, 3, 4});
  // The transposed value [[1, 3], [2, 4]] goes to rows 1..2, cols 0 and 2.
  run_kernel(Op::buffer_store, slice_attrs({1, 0}, {3, 3}, {1, 2}),
             {buffer.view(), permuted(value.view(), {1, 0})}, {});
  EXPECT_EQ(buffer.values<int32_t>(), (std::vector<int32_t>{0, 0, 0, 1, 0, 3, 2, 0, 4}));
  HostTensor wrong = tensor<int32_t>({3}, {1, 2, 3});
  EXPECT_THROW(run_kernel(Op::buffer_store, slice_attrs({0, 0}, {1, 2}, {1, 1}),
                          {buffer.view(), wrong.view()}, {}),
               ShapeError);
}

// ---- gather and scatter ------------------------------------------------------------------------------

TEST(DataMovementKernels, GatherRowsLikeAnEmbeddingLookup) {
  HostTensor table = tensor<float>({4, 2}, {0, 1, 10, 11, 20, 21, 30, 31});
  HostTensor ids = tensor<int64_t>({2, 2}, {3, 0, 1, 3});
  HostTensor out = run_op(Op::gather, {{"axis", int64_t{0}}}, {table.view(), ids.view()}, DType::f32,
                          {2, 2, 2});
  EXPECT_EQ(out.values<float>(), (std::vector<float>{30, 31, 0, 1, 10, 11, 30, 31}));
}

TEST(DataMovementKernels, GatherAlongInnerAxisWithI32IndicesAndStridedInput) {
  for (DType d : kAllDTypes) {
    HostTensor stored = iota(d, {3, 2});
    const TensorView in = permuted(stored.view(), {1, 0});  // [2, 3], in[r][c] = stored[c][r]
    HostTensor ids = tensor<int32_t>({2}, {2, 2});
    HostTensor out = run_op(Op::gather, {{"axis", int64_t{1}}}, {in, ids.view()}, d, {2, 2});
    std::vector<double> want = {stored.as_double(4), stored.as_double(4), stored.as_double(5),
                                stored.as_double(5)};
    EXPECT_EQ(doubles(out), want) << dtype_name(d);
  }
}

TEST(DataMovementKernels, GatherOutOfRangeOrNegativeIndexNamesIndexAndDim) {
  HostTensor table = iota(DType::f32, {4, 2});
  HostTensor big = tensor<int32_t>({1}, {4});
  EXPECT_EQ(error_of([&] {
              run_op(Op::gather, {{"axis", int64_t{0}}}, {table.view(), big.view()}, DType::f32, {1, 2});
            }),
            "gather: index 4 is out of range for dim 0 of size 4");
  HostTensor negative = tensor<int64_t>({1}, {-1});
  EXPECT_EQ(error_of([&] {
              run_op(Op::gather, {{"axis", int64_t{1}}}, {table.view(), negative.view()}, DType::f32,
                     {4, 1});
            }),
            "gather: index -1 is out of range for dim 1 of size 2");
}

TEST(DataMovementKernels, ScatterWritesUpdatesAtIndicesAndLastWriteWins) {
  HostTensor in = tensor<int16_t>({2, 4}, {0, 1, 2, 3, 4, 5, 6, 7});
  HostTensor updates = tensor<int16_t>({2, 3}, {-1, -2, -3, -4, -5, -6});
  HostTensor idx = tensor<int64_t>({3}, {3, 0, 3});
  HostTensor out = run_op(Op::scatter, {{"axis", int64_t{1}}}, {in.view(), updates.view(), idx.view()},
                          DType::i16, {2, 4});
  EXPECT_EQ(out.values<int16_t>(), (std::vector<int16_t>{-2, 1, 2, -3, -5, 5, 6, -6}));
  HostTensor bad = tensor<int64_t>({3}, {0, 4, 1});
  EXPECT_THROW(run_op(Op::scatter, {{"axis", int64_t{1}}}, {in.view(), updates.view(), bad.view()},
                      DType::i16, {2, 4}),
               ExecutionError);
}

}  // namespace
}  // namespace kiln::kernels
