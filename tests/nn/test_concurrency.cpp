// Eager ModuleV3 code on several threads at once in one EagerSession: eager forwards of one shared
// module, nn::functional ops and compile() of a module per thread, every result bit for bit the
// single-threaded one, while the threads evict each other's models from a small cache. The tsan
// preset runs this under ThreadSanitizer (.ci/run).
#include <gtest/gtest.h>

#include <cstring>
#include <latch>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "kiln/nn/eager_session.h"
#include "kiln/nn/functional.h"
#include "kiln/nn/module_v3.h"

namespace {

using namespace kiln;
namespace F = kiln::nn::functional;
using graph::TensorType;
using nn::TypeTree;

constexpr int kRounds = 60;  // about 3 s under TSan on 2 cores
constexpr int kThreads = 4;  // more than CI's 2 cores
constexpr int64_t kIn = 6, kOut = 5;

// y = tanh(relu(x @ w + b)).
class Affine : public nn::ModuleV3 {
 public:
  explicit Affine(unsigned seed)
      : w(register_parameter("w", random_tensor(seed, {kIn, kOut}))),
        b(register_parameter("b", random_tensor(seed + 1, {kOut}))) {}
  nn::Tensor operator()(const nn::Tensor& x) { return F::tanh(F::relu(F::matmul(x, w) + b)); }
  nn::TensorTree forward(const std::vector<nn::TensorTree>& args) override { return (*this)(args.at(0).leaf()); }
  nn::Parameter w, b;

  static kiln::Tensor random_tensor(unsigned seed, const std::vector<int64_t>& shape) {
    std::mt19937 rng(seed);
    std::uniform_real_distribution<float> dist(-1.f, 1.f);
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    std::vector<float> v(static_cast<size_t>(n));
    for (auto& e : v) e = dist(rng);
    return kiln::Tensor::from_vector(v, shape);
  }
};

bool same_bits(const kiln::Tensor& a, const kiln::Tensor& b) {
  if (a.dtype() != b.dtype() || a.shape() != b.shape()) return false;
  const kiln::Tensor pa = a.clone(), pb = b.clone();
  return std::memcmp(pa.data(), pb.data(), pa.nbytes()) == 0;
}

// One thread's work: the shared module's forward, a few functional ops on its result, and its own
// module compiled (staging is per module, so each thread stages its own) and called.
struct Results {
  std::vector<kiln::Tensor> tensors;
};

Results work(Affine& shared, Affine& own, const std::shared_ptr<nn::EagerSession>& session, const nn::Tensor& x) {
  Results r;
  nn::Tensor y = shared(x);
  r.tensors.push_back(y.data());
  r.tensors.push_back(F::sum(F::exp(y) * 2.0, -1).data());
  r.tensors.push_back(F::neg(y + 0.5).data());
  auto compiled = own.compile({TypeTree(TensorType{DType::f32, {"batch", kIn}})}, {.session = session});
  r.tensors.push_back(compiled({x.data()}).at(0));
  return r;
}

TEST(Concurrency, EagerModuleV3FromSeveralThreadsOnOneSession) {
  // Capacity 4 for 9 models (6 eager ops at two batch sizes, the compiled graph): threads evict
  // and rebuild each other's.
  auto session = std::make_shared<nn::EagerSession>(
      nn::EagerSessionOptions{.cache_capacity = 4, .session = {.num_threads = 2, .compile_cache = false}});
  Affine shared(1);
  std::vector<std::unique_ptr<Affine>> own;
  std::vector<nn::Tensor> inputs;
  std::vector<Results> expected;
  for (int t = 0; t < kThreads; ++t) {
    own.push_back(std::make_unique<Affine>(t % 2 ? 3u : 5u));  // two sets of weights, one graph
    const int64_t batch = 1 + t % 2 * 2;
    inputs.push_back(nn::Tensor(Affine::random_tensor(static_cast<unsigned>(20 + t), {batch, kIn}), session));
    expected.push_back(work(shared, *own.back(), session, inputs.back()));
  }
  // The reference is right: row 0 of the shared module's forward by hand.
  {
    const std::vector<float> x = inputs[0].to_vector<float>(), w = shared.w.data().to_vector<float>(),
                             b = shared.b.data().to_vector<float>(), y = expected[0].tensors[0].to_vector<float>();
    for (int64_t o = 0; o < kOut; ++o) {
      double pre = b[static_cast<size_t>(o)];
      for (int64_t i = 0; i < kIn; ++i) pre += double(x[static_cast<size_t>(i)]) * w[static_cast<size_t>(i * kOut + o)];
      EXPECT_NEAR(y[static_cast<size_t>(o)], std::tanh(std::max(pre, 0.0)), 1e-5) << o;
    }
  }

  const nn::EagerCacheStats before = session->cache_stats();
  std::latch start(kThreads);
  std::vector<int> wrong(kThreads, 0);
  std::mutex errors_mutex;
  std::vector<std::string> errors;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back([&, t] {
      start.arrive_and_wait();
      try {
        for (int r = 0; r < kRounds; ++r) {
          const Results got = work(shared, *own[static_cast<size_t>(t)], session, inputs[static_cast<size_t>(t)]);
          const Results& want = expected[static_cast<size_t>(t)];
          for (size_t i = 0; i < want.tensors.size(); ++i)
            wrong[static_cast<size_t>(t)] += !same_bits(got.tensors[i], want.tensors[i]);
        }
      } catch (const std::exception& e) {
        std::lock_guard lock(errors_mutex);
        errors.push_back(e.what());
      }
    });
  for (auto& thread : threads) thread.join();
  EXPECT_EQ(errors, std::vector<std::string>{});
  EXPECT_EQ(wrong, std::vector<int>(kThreads, 0));
  const nn::EagerCacheStats stats = session->cache_stats();
  EXPECT_LE(stats.size, 4u);
  EXPECT_EQ(stats.misses - stats.evictions, static_cast<int64_t>(stats.size));
  EXPECT_GT(stats.evictions, before.evictions);
  // Every compile the session did was a cache miss (each miss builds one model or compiles once).
  EXPECT_EQ(session->inference_session().compile_count(), stats.misses);
}

}  // namespace
