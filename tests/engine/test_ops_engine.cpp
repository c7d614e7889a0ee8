// Ops end to end through InferenceSession (compile, init, execute), against hand-computed results.
#include <cmath>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "kiln/kiln.h"

namespace {

using namespace kiln;
namespace ops = kiln::graph::ops;
using graph::BufferType;
using graph::Dim;
using graph::ops::SliceIndex;
using graph::TensorType;

std::vector<Tensor> run(const graph::Graph& g, const std::vector<Tensor>& inputs) {
  engine::InferenceSession session;
  return session.load(g).execute(inputs);
}

void expect_near(const Tensor& t, const std::vector<double>& want, double tolerance = 1e-6) {
  auto got = t.to_vector<double>();
  ASSERT_EQ(got.size(), want.size()) << t.to_string();
  for (size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], want[i], tolerance) << "element " << i;
}

// ---- matmul with partly broadcast batch dims (attention's [kv, group, seq, hd] x [kv, 1, hd, total]) --

TEST(OpsEngine, MatmulBroadcastsASizeOneBatchDimAgainstAnother) {
  const int64_t A = 2, G = 3, M = 4, K = 5, N = 6;
  graph::Graph g("bmm", {TensorType{DType::f32, {A, G, M, K}}, TensorType{DType::f32, {A, 1, K, N}}});
  g.output({ops::matmul(g.input(0), g.input(1))});
  std::vector<float> x(A * G * M * K), y(A * K * N);
  for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>((i * 7) % 11) - 5.0f;
  for (size_t i = 0; i < y.size(); ++i) y[i] = static_cast<float>((i * 5) % 13) - 6.0f;
  auto out = run(g, {Tensor::from_vector<float>(x, {A, G, M, K}), Tensor::from_vector<float>(y, {A, 1, K, N})});
  std::vector<double> want;
  for (int64_t a = 0; a < A; ++a)
    for (int64_t gi = 0; gi < G; ++gi)
      for (int64_t m = 0; m < M; ++m)
        for (int64_t n = 0; n < N; ++n) {
          double acc = 0;
          for (int64_t k = 0; k < K; ++k) acc += x[((a * G + gi) * M + m) * K + k] * y[(a * K + k) * N + n];
          want.push_back(acc);
        }
  expect_near(out[0], want, 0);
}

// ---- elementwise --------------------------------------------------------------------------------

template <class T>
void check_broadcast_add_over_symbolic_rows() {
  constexpr DType d = dtype_of<T>();
  graph::Graph g("bias", {TensorType{d, {"rows", 3}}, TensorType{d, {3}}});
  g.output({ops::add(g.input(0), g.input(1))});
  engine::InferenceSession session;
  auto model = session.load(g);
  auto bias = Tensor::from_vector<T>({T(10), T(20), T(30)}, {3});
  auto two = model.execute({Tensor::from_vector<T>({T(1), T(2), T(3), T(4), T(5), T(6)}, {2, 3}), bias});
  EXPECT_EQ(two[0].shape(), (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(two[0].template to_vector<T>(), (std::vector<T>{T(11), T(22), T(33), T(14), T(25), T(36)}));
  auto one = model.execute({Tensor::from_vector<T>({T(0), T(1), T(2)}, {1, 3}), bias});
  EXPECT_EQ(one[0].template to_vector<T>(), (std::vector<T>{T(10), T(21), T(32)}));
}

TEST(OpsEngine, AddBroadcastsOverSymbolicRowsForSeveralDTypes) {
  check_broadcast_add_over_symbolic_rows<float>();
  check_broadcast_add_over_symbolic_rows<double>();
  check_broadcast_add_over_symbolic_rows<int32_t>();
  check_broadcast_add_over_symbolic_rows<int64_t>();
  check_broadcast_add_over_symbolic_rows<uint8_t>();
}

TEST(OpsEngine, AddBroadcastsAColumnAgainstARow) {
  graph::Graph g("outer", {TensorType{DType::f32, {"n", 1}}, TensorType{DType::f32, {1, "m"}}});
  g.output({ops::add(g.input(0), g.input(1))});
  auto out = run(g, {Tensor::from_vector<float>({1, 2}, {2, 1}), Tensor::from_vector<float>({10, 20, 30}, {1, 3})});
  EXPECT_EQ(out[0].shape(), (std::vector<int64_t>{2, 3}));
  expect_near(out[0], {11, 21, 31, 12, 22, 32});
}

TEST(OpsEngine, WhereSelectsPerElement) {
  graph::Graph g("select", {TensorType{DType::boolean, {4}}, TensorType{DType::i32, {4}}, TensorType{DType::i32, {4}}});
  g.output({ops::where(g.input(0), g.input(1), g.input(2))});
  auto out = run(g, {Tensor::from_vector<bool>({true, false, false, true}, {4}),
                     Tensor::from_vector<int32_t>({1, 2, 3, 4}, {4}),
                     Tensor::from_vector<int32_t>({-1, -2, -3, -4}, {4})});
  EXPECT_EQ(out[0].to_vector<int32_t>(), (std::vector<int32_t>{1, -2, -3, 4}));
}

TEST(OpsEngine, CastConvertsBetweenDTypes) {
  graph::Graph g("casts", {TensorType{DType::f32, {3}}, TensorType{DType::i32, {3}}});
  g.output({ops::cast(g.input(0), DType::i64), ops::cast(g.input(1), DType::f64),
            ops::cast(g.input(1), DType::boolean)});
  auto out = run(g, {Tensor::from_vector<float>({1.f, -2.f, 300.f}, {3}), Tensor::from_vector<int32_t>({0, 7, -5}, {3})});
  EXPECT_EQ(out[0].dtype(), DType::i64);
  EXPECT_EQ(out[0].to_vector<int64_t>(), (std::vector<int64_t>{1, -2, 300}));
  EXPECT_EQ(out[1].dtype(), DType::f64);
  EXPECT_EQ(out[1].to_vector<double>(), (std::vector<double>{0, 7, -5}));
  EXPECT_EQ(out[2].to_vector<int>(), (std::vector<int>{0, 1, 1}));
}

// ---- linear algebra, reductions, normalization ---------------------------------------------------

TEST(OpsEngine, MatmulOfF32AndF64) {
  for (DType d : {DType::f32, DType::f64}) {
    graph::Graph g("mm", {TensorType{d, {2, 3}}, TensorType{d, {3, 2}}});
    g.output({ops::matmul(g.input(0), g.input(1))});
    auto a = Tensor::from_vector<double>({1, 2, 3, 4, 5, 6}, {2, 3});
    auto b = Tensor::from_vector<double>({7, 8, 9, 10, 11, 12}, {3, 2});
    if (d == DType::f32) {
      a = Tensor::from_vector<float>({1, 2, 3, 4, 5, 6}, {2, 3});
      b = Tensor::from_vector<float>({7, 8, 9, 10, 11, 12}, {3, 2});
    }
    // [[1*7+2*9+3*11, 1*8+2*10+3*12], [4*7+5*9+6*11, 4*8+5*10+6*12]]
    expect_near(run(g, {a, b})[0], {58, 64, 139, 154});
  }
}

TEST(OpsEngine, MatmulWithATransposedWeightReadsItInPlace) {
  // x @ transpose(w): the compiler folds the transpose into the matmul (transpose_b); the result must
  // not change. For M = 1 (decode) and M = 3, and with f16 weights.
  for (int64_t m : {1, 3}) {
    for (DType d : {DType::f32, DType::f16}) {
      graph::Graph g("linear", {TensorType{d, {m, 3}}});
      {
        graph::Graph::Scope scope(g);
        auto w = g.weight({"w", d, {2, 3}});  // [out, in]
        g.output({ops::matmul(g.input(0), ops::transpose(w, 0, 1))});
      }
      std::vector<float> x = {1, 2, 3, 4, 5, 6, 7, 8, 9};
      x.resize(static_cast<size_t>(m * 3));
      auto as = [&](const std::vector<float>& v, std::vector<int64_t> shape) {
        if (d == DType::f32) return Tensor::from_vector<float>(v, shape);
        std::vector<f16_t> h;
        for (float f : v) h.push_back(f16_t(f));
        return Tensor::from_vector<f16_t>(h, shape);
      };
      engine::InferenceSession session;
      auto model = session.load(g, {{"w", as({1, 0, -1, 2, 1, 0}, {2, 3})}});
      // row r: [x0 - x2, 2*x0 + x1]
      std::vector<double> want;
      for (int64_t r = 0; r < m; ++r) {
        double x0 = x[r * 3], x1 = x[r * 3 + 1], x2 = x[r * 3 + 2];
        want.insert(want.end(), {x0 - x2, 2 * x0 + x1});
      }
      expect_near(model.execute({as(x, {m, 3})})[0], want);
    }
  }
}

TEST(OpsEngine, SoftmaxOfEachRow) {
  graph::Graph g("probs", {TensorType{DType::f32, {"rows", 3}}});
  g.output({ops::softmax(g.input(0))});
  auto out = run(g, {Tensor::from_vector<float>({0, 0, 0, 1, 2, 3}, {2, 3})});
  double z = std::exp(1.0) + std::exp(2.0) + std::exp(3.0);
  expect_near(out[0], {1.0 / 3, 1.0 / 3, 1.0 / 3, std::exp(1.0) / z, std::exp(2.0) / z, std::exp(3.0) / z});
}

TEST(OpsEngine, CumsumAndSumOfIntegers) {
  graph::Graph g("prefix", {TensorType{DType::i32, {4}}});
  g.output({ops::cumsum(g.input(0)), ops::cumsum(g.input(0), -1, /*exclusive=*/true), ops::sum(g.input(0))});
  auto out = run(g, {Tensor::from_vector<int32_t>({1, 2, 3, 4}, {4})});
  EXPECT_EQ(out[0].to_vector<int32_t>(), (std::vector<int32_t>{1, 3, 6, 10}));
  EXPECT_EQ(out[1].to_vector<int32_t>(), (std::vector<int32_t>{0, 1, 3, 6}));
  EXPECT_EQ(out[2].shape(), (std::vector<int64_t>{1}));
  EXPECT_EQ(out[2].to_vector<int32_t>(), (std::vector<int32_t>{10}));
}

TEST(OpsEngine, TopKReturnsSortedValuesAndIndices) {
  graph::Graph g("best", {TensorType{DType::f32, {2, 4}}});
  auto top = ops::top_k(g.input(0), 2);
  g.output({top[0], top[1]});
  auto out = run(g, {Tensor::from_vector<float>({3, 9, 1, 5, -1, -7, 4, 2}, {2, 4})});
  EXPECT_EQ(out[0].to_vector<float>(), (std::vector<float>{9, 5, 4, 2}));
  EXPECT_EQ(out[1].dtype(), DType::i64);
  EXPECT_EQ(out[1].to_vector<int64_t>(), (std::vector<int64_t>{1, 3, 2, 3}));
}

// ---- data movement ----------------------------------------------------------------------------

TEST(OpsEngine, SliceWithASymbolicStop) {
  // Drops the first and last row of a [n, 2] input: rows 1 .. n-1.
  graph::Graph g("inner", {TensorType{DType::i64, {"n", 2}}});
  g.output({ops::slice(g.input(0), {SliceIndex{1, Dim("n") - 1}})});
  engine::InferenceSession session;
  auto model = session.load(g);
  auto four = model.execute({Tensor::from_vector<int64_t>({0, 1, 2, 3, 4, 5, 6, 7}, {4, 2})});
  EXPECT_EQ(four[0].shape(), (std::vector<int64_t>{2, 2}));
  EXPECT_EQ(four[0].to_vector<int64_t>(), (std::vector<int64_t>{2, 3, 4, 5}));
  auto three = model.execute({Tensor::from_vector<int64_t>({0, 1, 2, 3, 4, 5}, {3, 2})});
  EXPECT_EQ(three[0].to_vector<int64_t>(), (std::vector<int64_t>{2, 3}));
}

TEST(OpsEngine, ConcatAlongBothAxes) {
  graph::Graph g("join", {TensorType{DType::f32, {2, "a"}}, TensorType{DType::f32, {2, "b"}}});
  g.output({ops::concat({g.input(0), g.input(1)}, 1), ops::concat({g.input(0), g.input(0)}, 0)});
  auto out = run(g, {Tensor::from_vector<float>({1, 2}, {2, 1}), Tensor::from_vector<float>({3, 4, 5, 6}, {2, 2})});
  EXPECT_EQ(out[0].shape(), (std::vector<int64_t>{2, 3}));
  expect_near(out[0], {1, 3, 4, 2, 5, 6});
  EXPECT_EQ(out[1].shape(), (std::vector<int64_t>{4, 1}));
  expect_near(out[1], {1, 2, 1, 2});
}

TEST(OpsEngine, GatherRowsByIndex) {
  graph::Graph g("embed", {TensorType{DType::f32, {4, 2}}, TensorType{DType::i64, {"tokens"}}});
  g.output({ops::gather(g.input(0), g.input(1))});
  auto table = Tensor::from_vector<float>({0, 1, 10, 11, 20, 21, 30, 31}, {4, 2});
  auto out = run(g, {table, Tensor::from_vector<int64_t>({3, 0, 3}, {3})});
  EXPECT_EQ(out[0].shape(), (std::vector<int64_t>{3, 2}));
  expect_near(out[0], {30, 31, 0, 1, 30, 31});
}

TEST(OpsEngine, RangeWithASymbolicSize) {
  // The input only binds "n"; the range has n elements.
  graph::Graph g("positions", {TensorType{DType::f32, {"n"}}});
  {
    graph::Graph::Scope scope(g);
    g.output({ops::range(3, 2, Dim("n"), DType::i64)});
  }
  auto out = run(g, {Tensor::zeros(DType::f32, {4})});
  EXPECT_EQ(out[0].to_vector<int64_t>(), (std::vector<int64_t>{3, 5, 7, 9}));
}

TEST(OpsEngine, BufferStoreWritesTheCallersCacheInPlaceAtASymbolicOffset) {
  // A KV-cache update: cache[offset : offset + seq] = new rows; returns the filled part of the cache.
  // The [offset] input carries no data: its length binds "offset".
  Dim offset("offset"), seq("seq");
  graph::Graph g("kv_update", {BufferType{DType::f32, {6, 2}}, TensorType{DType::f32, {seq, 2}},
                               TensorType{DType::u8, {offset}}});
  graph::BufferValue cache = g.input(0);
  ops::buffer_store(cache, g.input(1), {SliceIndex{offset, offset + seq}});
  g.output({ops::buffer_load(cache, {SliceIndex{0, offset + seq}})});
  engine::InferenceSession session;
  auto model = session.load(g);

  std::vector<float> storage(12, -1.f);
  auto cache_tensor = Tensor::borrow(storage.data(), DType::f32, {6, 2});
  auto first = model.execute({cache_tensor, Tensor::from_vector<float>({1, 2, 3, 4}, {2, 2}),
                              Tensor::zeros(DType::u8, {0})});
  EXPECT_EQ(first[0].shape(), (std::vector<int64_t>{2, 2}));
  expect_near(first[0], {1, 2, 3, 4});
  auto second = model.execute({cache_tensor, Tensor::from_vector<float>({5, 6}, {1, 2}),
                               Tensor::zeros(DType::u8, {2})});
  expect_near(second[0], {1, 2, 3, 4, 5, 6});
  EXPECT_EQ(storage, (std::vector<float>{1, 2, 3, 4, 5, 6, -1, -1, -1, -1, -1, -1}));
}

// ---- calls ------------------------------------------------------------------------------------------

TEST(OpsEngine, CallRunsTheCalleesNodes) {
  graph::Module module;
  graph::Graph affine("affine", {TensorType{DType::f32, {"n"}}}, &module);
  affine.output({ops::add(ops::mul(affine.input(0), affine.input(0)), affine.input(0))});  // x^2 + x
  graph::Graph main("main", {TensorType{DType::f32, {"n"}}}, &module);
  auto once = ops::call("affine", {main.input(0)});
  auto twice = ops::call("affine", {once[0]});
  main.output({twice[0], once[0]});
  engine::InferenceSession session;
  auto models = session.load_all(module);
  auto out = models.at("main").execute({Tensor::from_vector<float>({1, 2, -1}, {3})});
  // once: 2, 6, 0; twice: 6, 42, 0
  expect_near(out[0], {6, 42, 0});
  expect_near(out[1], {2, 6, 0});
  expect_near(models.at("affine").execute({Tensor::from_vector<float>({3}, {1})})[0], {12});
}

}  // namespace
