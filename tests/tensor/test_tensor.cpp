#include <gtest/gtest.h>

#include "test_util.h"

#include <cstdint>
#include <numeric>

#include "kiln/tensor/tensor.h"

using namespace kiln;
using kiln::testing::error_message;
using kiln::testing::expect_error;

namespace {

// A DLPack producer that owns its buffer, shape and strides, and counts deleter calls.
template <class Managed>
struct Producer {
  Managed managed{};
  std::vector<int64_t> shape, strides;
  std::vector<float> storage;
  int* deleted;

  static Managed* make(std::vector<float> values, std::vector<int64_t> shape, std::vector<int64_t> strides,
                       int* deleted) {
    auto* p = new Producer;
    p->storage = std::move(values);
    p->shape = std::move(shape);
    p->strides = std::move(strides);
    p->deleted = deleted;
    DLTensor& dl = p->managed.dl_tensor;
    dl.data = p->storage.data();
    dl.device = {kDLCPU, 0};
    dl.ndim = static_cast<int32_t>(p->shape.size());
    dl.dtype = {kDLFloat, 32, 1};
    dl.shape = p->shape.data();
    dl.strides = p->strides.empty() ? nullptr : p->strides.data();
    dl.byte_offset = 0;
    p->managed.manager_ctx = p;
    p->managed.deleter = [](Managed* self) {
      auto* owner = static_cast<Producer*>(self->manager_ctx);
      ++*owner->deleted;
      delete owner;
    };
    if constexpr (std::is_same_v<Managed, DLManagedTensorVersioned>) p->managed.version = {1, 0};
    return &p->managed;
  }
};

using Legacy = Producer<DLManagedTensor>;
using Versioned = Producer<DLManagedTensorVersioned>;

}  // namespace

// ---- construction and queries -------------------------------------------------------------------

TEST(Tensor, EmptyIsContiguousAnd64ByteAligned) {
  for (int64_t n : {0, 1, 3, 1000}) {
    Tensor t = Tensor::empty(DType::f32, {n, 2});
    EXPECT_TRUE(t.defined());
    EXPECT_TRUE(t.is_owner());
    EXPECT_EQ(reinterpret_cast<uintptr_t>(t.data()) % 64, 0u);
    EXPECT_EQ(t.numel(), n * 2);
    EXPECT_EQ(t.nbytes(), static_cast<size_t>(n * 2 * 4));
    EXPECT_TRUE(t.is_contiguous());
  }
  EXPECT_FALSE(Tensor().defined());
}

TEST(Tensor, ZerosAreZero) {
  Tensor t = Tensor::zeros(DType::i32, {3, 5});
  for (int32_t v : t.to_vector<int32_t>()) EXPECT_EQ(v, 0);
}

TEST(Tensor, ShapeQueries) {
  Tensor t = Tensor::from_vector<float>({1, 2, 3, 4, 5, 6}, {2, 3});
  EXPECT_EQ(t.rank(), 2);
  EXPECT_EQ(t.dim(0), 2);
  EXPECT_EQ(t.dim(-1), 3);
  EXPECT_EQ(t.strides(), (std::vector<int64_t>{3, 1}));
  expect_error<ValueError>([&] { (void)t.dim(2); }, "index 2 out of range for rank 2");
  EXPECT_EQ(t.to_string(), "Tensor(f32[2, 3], cpu:0)");
  EXPECT_EQ(Tensor::scalar<int64_t>(7).to_string(), "Tensor(i64[], cpu:0)");
  EXPECT_EQ(Tensor::scalar<int64_t>(7).numel(), 1);
}

TEST(Tensor, ContiguousStridesAreRowMajor) {
  EXPECT_EQ(contiguous_strides({2, 3, 4}), (std::vector<int64_t>{12, 4, 1}));
  EXPECT_EQ(contiguous_strides({}), std::vector<int64_t>{});
  EXPECT_EQ(contiguous_strides({5}), std::vector<int64_t>{1});
}

TEST(Tensor, RejectsNegativeAndOverflowingShapes) {
  expect_error<ValueError>([] { Tensor::empty(DType::f32, {2, -1}); }, "dim 1 of shape [2, -1]");
  expect_error<ValueError>([] { Tensor::empty(DType::f32, {INT64_MAX, 4}); }, "overflow");
  expect_error<ValueError>([] { Tensor::empty(DType::f64, {INT64_MAX / 4}); }, "overflow");
  expect_error<ValueError>([] { Tensor::from_vector<float>({1, 2, 3}, {2, 2}); }, "3 values");
}

TEST(Tensor, EmptyOnGpuIsRejectedNamingTheDevice) {
  expect_error<ValueError>([] { Tensor::empty(DType::f32, {2}, DeviceRef::GPU(0)); }, "gpu:0");
}

TEST(Tensor, DataAsChecksTheDtype) {
  Tensor t = Tensor::from_vector<int32_t>({1, 2}, {2});
  EXPECT_EQ(t.data_as<int32_t>()[1], 2);
  expect_error<DTypeError>([&] { (void)t.data_as<float>(); }, "tensor is i32, asked for f32");
}

TEST(Tensor, BorrowDoesNotOwnAndSeesWrites) {
  float memory[4] = {1, 2, 3, 4};
  Tensor t = Tensor::borrow(memory, DType::f32, {2, 2});
  EXPECT_FALSE(t.is_owner());
  EXPECT_EQ(t.data(), memory);
  memory[3] = 40;
  EXPECT_EQ(t.to_vector<float>(), (std::vector<float>{1, 2, 3, 40}));
  expect_error<ValueError>([&] { Tensor::borrow(memory, DType::f32, {2, 2}, {1}); }, "1 strides");
  expect_error<ValueError>([] { Tensor::borrow(nullptr, DType::f32, {2}); }, "null");
}

TEST(Tensor, ViewKeepsItsOwnerAlive) {
  auto block = std::make_shared<std::vector<float>>(std::vector<float>{5, 6, 7});
  std::weak_ptr<std::vector<float>> watch = block;
  Tensor t = Tensor::view(block, block->data() + 1, DType::f32, {2});
  block.reset();
  EXPECT_FALSE(watch.expired());
  EXPECT_TRUE(t.is_owner());
  EXPECT_EQ(t.to_vector<float>(), (std::vector<float>{6, 7}));
  t = Tensor();
  EXPECT_TRUE(watch.expired());
}

// ---- strides, contiguous, clone -----------------------------------------------------------------

TEST(Tensor, TransposedViewIsReadInLogicalOrder) {
  // memory holds a [2, 3] matrix row-major; the view is its [3, 2] transpose.
  float memory[6] = {0, 1, 2, 10, 11, 12};
  Tensor t = Tensor::borrow(memory, DType::f32, {3, 2}, {1, 3});
  EXPECT_FALSE(t.is_contiguous());
  Tensor packed = t.contiguous();
  EXPECT_TRUE(packed.is_contiguous());
  EXPECT_NE(packed.data(), t.data());
  EXPECT_EQ(packed.to_vector<float>(), (std::vector<float>{0, 10, 1, 11, 2, 12}));
  EXPECT_EQ(t.to_vector<float>(), (std::vector<float>{0, 10, 1, 11, 2, 12}));
}

TEST(Tensor, StridedCopyMatchesANaiveReference) {
  // A [2, 3, 4] view with permuted, padded strides over a larger block.
  std::vector<int16_t> memory(200);
  std::iota(memory.begin(), memory.end(), 0);
  const std::vector<int64_t> shape = {2, 3, 4}, strides = {1, 40, 7};
  Tensor t = Tensor::borrow(memory.data(), DType::i16, shape, strides);
  std::vector<int16_t> expected;
  for (int64_t i = 0; i < 2; ++i)
    for (int64_t j = 0; j < 3; ++j)
      for (int64_t k = 0; k < 4; ++k) expected.push_back(memory[static_cast<size_t>(i * 1 + j * 40 + k * 7)]);
  EXPECT_EQ(t.clone().to_vector<int16_t>(), expected);
}

TEST(Tensor, NegativeStridesAreHonoured) {
  float memory[4] = {1, 2, 3, 4};
  Tensor reversed = Tensor::borrow(memory + 3, DType::f32, {4}, {-1});
  EXPECT_EQ(reversed.to_vector<float>(), (std::vector<float>{4, 3, 2, 1}));
}

TEST(Tensor, SizeOneDimsIgnoreTheirStrideForContiguity) {
  float memory[3] = {1, 2, 3};
  EXPECT_TRUE(Tensor::borrow(memory, DType::f32, {1, 3}, {99, 1}).is_contiguous());
  EXPECT_FALSE(Tensor::borrow(memory, DType::f32, {3, 1}, {2, 1}).is_contiguous());
}

TEST(Tensor, ContiguousReturnsTheSameMemoryAndCloneCopies) {
  Tensor t = Tensor::from_vector<float>({1, 2, 3}, {3});
  EXPECT_EQ(t.contiguous().data(), t.data());
  Tensor c = t.clone();
  EXPECT_NE(c.data(), t.data());
  c.data_as<float>()[0] = 9;
  EXPECT_EQ(t.to_vector<float>()[0], 1);
  EXPECT_THROW((void)Tensor().clone(), ValueError);
}

// ---- to_vector conversions -----------------------------------------------------------------------

TEST(Tensor, ToVectorConvertsBetweenDtypes) {
  Tensor ints = Tensor::from_vector<int32_t>({-2, 0, 7}, {3});
  EXPECT_EQ(ints.to_vector<double>(), (std::vector<double>{-2, 0, 7}));
  Tensor floats = Tensor::from_vector<float>({1.75f, -3.5f}, {2});
  EXPECT_EQ(floats.to_vector<int64_t>(), (std::vector<int64_t>{1, -3}));  // static_cast truncates
  Tensor flags = Tensor::from_vector<bool>({true, false, true}, {3});
  EXPECT_EQ(flags.to_vector<int>(), (std::vector<int>{1, 0, 1}));
}

TEST(Tensor, ToVectorReadsF16AndBF16) {
  // 0x3C00 = 1.0, 0xC100 = -2.5 (f16); 0x3F80 = 1.0, 0x4049 = 3.140625 (bf16).
  std::vector<f16_t> halves(2);
  halves[0].bits = 0x3C00;
  halves[1].bits = 0xC100;
  EXPECT_EQ(Tensor::from_vector(halves, {2}).to_vector<float>(), (std::vector<float>{1.0f, -2.5f}));
  std::vector<bf16_t> brains(2);
  brains[0].bits = 0x3F80;
  brains[1].bits = 0x4049;
  EXPECT_EQ(Tensor::from_vector(brains, {2}).to_vector<double>(), (std::vector<double>{1.0, 3.140625}));

  // Into 16-bit floats: rounded to nearest even.
  auto to_half = Tensor::from_vector<float>({1.0f, 65504.0f}, {2}).to_vector<f16_t>();
  EXPECT_EQ(to_half[0].bits, 0x3C00);
  EXPECT_EQ(to_half[1].bits, 0x7BFF);
  auto to_bf = Tensor::from_vector<int32_t>({1, 257}, {2}).to_vector<bf16_t>();
  EXPECT_EQ(to_bf[0].bits, 0x3F80);
  EXPECT_EQ(to_bf[1].bits, 0x4380);  // 257 ties between 256 and 258; 256 (0x4380) is even
}

// ---- DLPack import ------------------------------------------------------------------------------

TEST(DLPack, ImportReadsValuesAndRunsTheDeleterOnceWhenTheLastCopyDies) {
  int deleted = 0;
  {
    Tensor a = Tensor::from_dlpack(Legacy::make({1, 2, 3, 4, 5, 6}, {2, 3}, {}, &deleted));
    EXPECT_EQ(a.shape(), (std::vector<int64_t>{2, 3}));
    EXPECT_EQ(a.strides(), (std::vector<int64_t>{3, 1}));  // NULL strides: contiguous
    EXPECT_EQ(a.to_vector<float>(), (std::vector<float>{1, 2, 3, 4, 5, 6}));
    EXPECT_TRUE(a.is_owner());
    Tensor b = a;
    {
      Tensor c = b;
      Tensor d = std::move(c);
    }
    a = Tensor();
    EXPECT_EQ(deleted, 0);
    EXPECT_EQ(b.to_vector<float>()[5], 6);
  }
  EXPECT_EQ(deleted, 1);
}

TEST(DLPack, VersionedImportRunsTheDeleterOnce) {
  int deleted = 0;
  {
    Tensor a = Tensor::from_dlpack(Versioned::make({1, 2}, {2}, {}, &deleted));
    Tensor b = a.clone();  // an independent copy does not hold the producer's memory
    a = Tensor();
    EXPECT_EQ(deleted, 1);
    EXPECT_EQ(b.to_vector<float>(), (std::vector<float>{1, 2}));
  }
  EXPECT_EQ(deleted, 1);
}

TEST(DLPack, TransposedInputIsReadThroughItsStrides) {
  int deleted = 0;
  // Memory is [[0, 1, 2], [10, 11, 12]]; the producer exports its [3, 2] transpose.
  Tensor t = Tensor::from_dlpack(Legacy::make({0, 1, 2, 10, 11, 12}, {3, 2}, {1, 3}, &deleted));
  EXPECT_FALSE(t.is_contiguous());
  EXPECT_EQ(t.contiguous().to_vector<float>(), (std::vector<float>{0, 10, 1, 11, 2, 12}));
  t = Tensor();
  EXPECT_EQ(deleted, 1);
}

TEST(DLPack, ByteOffsetIsHonoured) {
  int deleted = 0;
  DLManagedTensor* m = Legacy::make({9, 9, 1, 2, 3}, {3}, {}, &deleted);
  m->dl_tensor.byte_offset = 2 * sizeof(float);
  Tensor t = Tensor::from_dlpack(m);
  EXPECT_EQ(t.to_vector<float>(), (std::vector<float>{1, 2, 3}));
}

TEST(DLPack, FailedImportRunsTheDeleterImmediately) {
  struct Case {
    const char* name;
    void (*corrupt)(DLTensor&);
    const char* message;
  };
  const Case cases[] = {
      {"device", [](DLTensor& t) { t.device.device_type = kDLCUDA; }, "device type 2"},
      {"cuda host", [](DLTensor& t) { t.device.device_type = kDLCUDAHost; }, "device type 3"},
      {"lanes", [](DLTensor& t) { t.dtype.lanes = 4; }, "lanes 4"},
      {"dtype bits", [](DLTensor& t) { t.dtype.bits = 24; }, "code 2 bits 24"},
      {"complex", [](DLTensor& t) { t.dtype = {kDLComplex, 64, 1}; }, "code 5 bits 64"},
      {"negative dim", [](DLTensor& t) { t.shape[0] = -3; }, "negative"},
      {"negative ndim", [](DLTensor& t) { t.ndim = -1; }, "ndim -1"},
      {"overflowing shape", [](DLTensor& t) { t.shape[0] = INT64_MAX; }, "overflow"},
      {"null data", [](DLTensor& t) { t.data = nullptr; }, "NULL"},
      {"misaligned", [](DLTensor& t) { t.byte_offset = 1; }, "aligned"},
  };
  for (const Case& c : cases) {
    for (int versioned = 0; versioned < 2; ++versioned) {
      SCOPED_TRACE(std::string(c.name) + (versioned ? " (versioned)" : ""));
      int deleted = 0;
      if (versioned) {
        auto* m = Versioned::make({1, 2, 3, 4}, {2, 2}, {}, &deleted);
        c.corrupt(m->dl_tensor);
        expect_error<ValueError>([&] { Tensor::from_dlpack(m); }, c.message);
      } else {
        auto* m = Legacy::make({1, 2, 3, 4}, {2, 2}, {}, &deleted);
        c.corrupt(m->dl_tensor);
        expect_error<ValueError>([&] { Tensor::from_dlpack(m); }, c.message);
      }
      EXPECT_EQ(deleted, 1);
    }
  }
}

TEST(DLPack, VersionedImportRejectsANewerMajorVersion) {
  int deleted = 0;
  auto* m = Versioned::make({1}, {1}, {}, &deleted);
  m->version = {2, 0};
  expect_error<ValueError>([&] { Tensor::from_dlpack(m); }, "version 2.0");
  EXPECT_EQ(deleted, 1);
}

TEST(DLPack, NullManagedIsAValueError) {
  EXPECT_THROW(Tensor::from_dlpack(static_cast<DLManagedTensor*>(nullptr)), ValueError);
  EXPECT_THROW(Tensor::from_dlpack(static_cast<DLManagedTensorVersioned*>(nullptr)), ValueError);
}

TEST(DLPack, ImportMapsEveryDtypeCode) {
  struct Case {
    DLDataType dl;
    DType expected;
  };
  const Case cases[] = {{{kDLFloat, 32, 1}, DType::f32}, {{kDLFloat, 16, 1}, DType::f16},
                        {{kDLBfloat, 16, 1}, DType::bf16}, {{kDLFloat, 64, 1}, DType::f64},
                        {{kDLInt, 8, 1}, DType::i8},       {{kDLInt, 64, 1}, DType::i64},
                        {{kDLUInt, 8, 1}, DType::u8},      {{kDLUInt, 32, 1}, DType::u32},
                        {{6, 8, 1}, DType::boolean}};
  for (const Case& c : cases) {
    int deleted = 0;
    auto* m = Legacy::make({0, 0}, {1}, {}, &deleted);
    m->dl_tensor.dtype = c.dl;
    EXPECT_EQ(Tensor::from_dlpack(m).dtype(), c.expected) << dtype_name(c.expected);
    EXPECT_EQ(deleted, 1);
  }
}

// ---- DLPack export ------------------------------------------------------------------------------

TEST(DLPack, ExportDescribesTheTensorAndKeepsItAlive) {
  DLManagedTensor* m;
  {
    Tensor t = Tensor::from_vector<int32_t>({1, 2, 3, 4, 5, 6}, {2, 3});
    m = t.to_dlpack();
    EXPECT_EQ(m->dl_tensor.data, t.data());
  }
  const DLTensor& dl = m->dl_tensor;
  EXPECT_EQ(dl.device.device_type, kDLCPU);
  EXPECT_EQ(dl.device.device_id, 0);
  EXPECT_EQ(dl.ndim, 2);
  EXPECT_EQ(dl.dtype.code, kDLInt);
  EXPECT_EQ(dl.dtype.bits, 32);
  EXPECT_EQ(dl.dtype.lanes, 1);
  EXPECT_EQ(dl.shape[0], 2);
  EXPECT_EQ(dl.shape[1], 3);
  EXPECT_EQ(dl.strides[0], 3);
  EXPECT_EQ(dl.strides[1], 1);
  EXPECT_EQ(dl.byte_offset, 0u);
  // The tensor is gone; the export still holds its memory.
  EXPECT_EQ(static_cast<const int32_t*>(dl.data)[5], 6);
  m->deleter(m);
}

TEST(DLPack, ExportDeleterReleasesTheMemoryExactlyOnce) {
  auto block = std::make_shared<std::vector<float>>(std::vector<float>{1, 2});
  std::weak_ptr<std::vector<float>> watch = block;
  Tensor t = Tensor::view(block, block->data(), DType::f32, {2});
  block.reset();
  DLManagedTensor* a = t.to_dlpack();
  DLManagedTensorVersioned* b = t.to_dlpack_versioned();
  t = Tensor();
  EXPECT_FALSE(watch.expired());
  a->deleter(a);
  EXPECT_FALSE(watch.expired());  // the versioned export still holds it
  b->deleter(b);
  EXPECT_TRUE(watch.expired());
}

TEST(DLPack, VersionedExportCarriesVersionAndFlags) {
  Tensor t = Tensor::from_vector<bool>({true, false}, {2});
  DLManagedTensorVersioned* m = t.to_dlpack_versioned();
  EXPECT_EQ(m->version.major, 1u);
  EXPECT_EQ(m->version.minor, 0u);
  EXPECT_EQ(m->flags, 0u);
  EXPECT_EQ(m->dl_tensor.dtype.code, 6);  // kDLBool of DLPack 1.0
  EXPECT_EQ(m->dl_tensor.dtype.bits, 8);
  m->deleter(m);
}

TEST(DLPack, ExportOfATransposedTensorKeepsItsStrides) {
  float memory[6] = {0, 1, 2, 10, 11, 12};
  Tensor t = Tensor::borrow(memory, DType::f32, {3, 2}, {1, 3});
  DLManagedTensor* m = t.to_dlpack();
  EXPECT_EQ(m->dl_tensor.strides[0], 1);
  EXPECT_EQ(m->dl_tensor.strides[1], 3);
  Tensor back = Tensor::from_dlpack(m);
  EXPECT_EQ(back.to_vector<float>(), (std::vector<float>{0, 10, 1, 11, 2, 12}));
}

TEST(DLPack, RoundTripsEveryDtypeThroughBothStructs) {
  for (DType d : kAllDTypes) {
    SCOPED_TRACE(std::string(dtype_name(d)));
    Tensor t = Tensor::zeros(d, {2, 3});
    std::memset(t.data(), 1, t.nbytes());  // 0x01 bytes: a valid bool and a nonzero pattern elsewhere
    Tensor legacy = Tensor::from_dlpack(t.to_dlpack());
    Tensor versioned = Tensor::from_dlpack(t.to_dlpack_versioned());
    for (const Tensor& back : {legacy, versioned}) {
      EXPECT_EQ(back.dtype(), d);
      EXPECT_EQ(back.shape(), t.shape());
      EXPECT_EQ(back.device(), t.device());
      EXPECT_EQ(back.data(), t.data());  // zero copy
      EXPECT_EQ(std::memcmp(back.data(), t.data(), t.nbytes()), 0);
    }
  }
}

TEST(DLPack, ImportThenExportHandsBackTheProducersMemory) {
  int deleted = 0;
  DLManagedTensor* exported;
  {
    Tensor t = Tensor::from_dlpack(Versioned::make({4, 5, 6}, {3}, {}, &deleted));
    exported = t.to_dlpack();
  }
  EXPECT_EQ(deleted, 0);  // the export keeps the imported memory alive
  EXPECT_EQ(static_cast<const float*>(exported->dl_tensor.data)[2], 6);
  exported->deleter(exported);
  EXPECT_EQ(deleted, 1);
}

TEST(DLPack, ExportOfAnUndefinedTensorIsAValueError) {
  EXPECT_THROW((void)Tensor().to_dlpack(), ValueError);
  EXPECT_THROW((void)Tensor().to_dlpack_versioned(), ValueError);
}
