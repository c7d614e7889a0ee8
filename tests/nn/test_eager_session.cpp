// No hidden state in ModuleV3 code: eager ops run in the EagerSession their tensors name (a bounded
// LRU cache each, sessions independent), compile() uses the session it is given, warnings go to the
// session's logger, and staging lives on the module, so two threads stage two modules at once.
#include <gtest/gtest.h>

#include <latch>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "kiln/nn/eager_session.h"
#include "kiln/nn/functional.h"
#include "kiln/nn/module_v3.h"
#include "nn/capturing_logger.h"
#include "test_util.h"

namespace {

using namespace kiln;
namespace F = kiln::nn::functional;
using graph::TensorType;
using kiln::testing::CapturingLogger;
using kiln::testing::error_message;
using nn::TypeTree;

std::shared_ptr<nn::EagerSession> session_with(size_t capacity, std::shared_ptr<Logger> logger = nullptr) {
  return std::make_shared<nn::EagerSession>(
      nn::EagerSessionOptions{.cache_capacity = capacity, .session = {.logger = std::move(logger)}});
}

// y = x * s, s = [2, 3].
class Scale : public nn::ModuleV3 {
 public:
  Scale() : s(register_parameter("s", kiln::Tensor::from_vector<float>({2, 3}, {2}))) {}
  nn::TensorTree forward(const std::vector<nn::TensorTree>& args) override { return args.at(0).leaf() * s; }
  nn::Parameter s;
};

const std::vector<TypeTree> kX{TypeTree(TensorType{DType::f32, {2}})};

// ---- the cache ---------------------------------------------------------------------------------------

TEST(EagerSession, CacheIsBoundedAndEvictsTheLeastRecentlyUsedModel) {
  auto session = session_with(2);
  nn::Tensor x = nn::Tensor::from_vector<float>({1, 4}, {2}, session);
  EXPECT_EQ(F::sqrt(x).to_vector<float>(), (std::vector<float>{1, 2}));  // miss
  F::neg(x);                                                             // miss
  F::sqrt(x);                                                            // hit: sqrt is now the most recent
  F::exp(x);                                                             // miss: evicts neg, not sqrt
  nn::EagerCacheStats stats = session->cache_stats();
  EXPECT_EQ(stats.hits, 1);
  EXPECT_EQ(stats.misses, 3);
  EXPECT_EQ(stats.evictions, 1);
  EXPECT_EQ(stats.size, 2u);
  EXPECT_EQ(stats.capacity, 2u);
  F::sqrt(x);  // still cached
  EXPECT_EQ(session->cache_stats().hits, 2);
  EXPECT_EQ(F::neg(x).to_vector<float>(), (std::vector<float>{-1, -4}));  // evicted: built again
  stats = session->cache_stats();
  EXPECT_EQ(stats.misses, 4);
  EXPECT_EQ(stats.evictions, 2);
  EXPECT_EQ(session->inference_session().compile_count(), 4);  // one compile per miss
}

TEST(EagerSession, SeveralThreadsShareOneSessionAndItsCache) {
  auto session = session_with(2);  // three ops over two slots: threads evict each other's models
  constexpr int kThreads = 4, kRounds = 25;
  std::vector<int> wrong(kThreads, 0);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back([&, t] {
      nn::Tensor x = nn::Tensor::from_vector<float>({4, 9}, {2}, session);
      for (int r = 0; r < kRounds; ++r) {
        wrong[t] += F::sqrt(x).to_vector<float>() != std::vector<float>{2, 3};
        wrong[t] += F::neg(x).to_vector<float>() != std::vector<float>{-4, -9};
        wrong[t] += (x + x).to_vector<float>() != std::vector<float>{8, 18};
      }
    });
  for (auto& thread : threads) thread.join();
  EXPECT_EQ(wrong, std::vector<int>(kThreads, 0));
  const nn::EagerCacheStats stats = session->cache_stats();
  EXPECT_EQ(stats.hits + stats.misses, kThreads * kRounds * 3);
  EXPECT_EQ(stats.misses - stats.evictions, static_cast<int64_t>(stats.size));
  EXPECT_EQ(stats.size, 2u);
}

TEST(EagerSession, ACapacityOfZeroIsAValueError) {
  EXPECT_NE(
      error_message<ValueError>([] { session_with(0); }).find("cache_capacity must be at least 1, got 0"),
      std::string::npos);
}

TEST(EagerSession, TwoSessionsDoNotShareACache) {
  auto a = session_with(8), b = session_with(8);
  nn::Tensor xa = nn::Tensor::from_vector<float>({1, 2}, {2}, a);
  nn::Tensor xb = nn::Tensor::from_vector<float>({1, 2}, {2}, b);
  nn::Tensor ya = F::exp(xa);
  F::exp(xa);
  nn::Tensor yb = F::exp(xb);  // the same signature, but b has not seen it
  EXPECT_EQ(ya.session(), a);
  EXPECT_EQ(yb.session(), b);
  EXPECT_EQ(a->cache_stats().misses, 1);
  EXPECT_EQ(a->cache_stats().hits, 1);
  EXPECT_EQ(b->cache_stats().misses, 1);
  EXPECT_EQ(b->cache_stats().hits, 0);
  EXPECT_EQ(ya.to_vector<float>(), yb.to_vector<float>());
}

TEST(EagerSession, AnOperandWithoutASessionJoinsTheOtherOperandsAndTwoSessionsAreAnError) {
  auto a = session_with(8), b = session_with(8);
  nn::Tensor xa = nn::Tensor::from_vector<float>({1, 2}, {2}, a);
  nn::Tensor plain = nn::Tensor::from_vector<float>({10, 20}, {2});
  nn::Tensor sum = plain + xa;
  EXPECT_EQ(sum.session(), a);
  EXPECT_EQ(sum.to_vector<float>(), (std::vector<float>{11, 22}));
  EXPECT_EQ((xa * 2.0).session(), a);  // the scalar names no session
  EXPECT_EQ(a->cache_stats().misses, 2);
  EXPECT_EQ(F::relu(plain).session(), nullptr);  // ran in the default session
  nn::Tensor xb = nn::Tensor::from_vector<float>({1, 2}, {2}, b);
  EXPECT_NE(error_message<ValueError>([&] {
              F::add(xa, xb);
            }).find("add: operand 1 belongs to another nn::EagerSession than operand 0"),
            std::string::npos);
}

// An eager op runs in its session's engine::InferenceSession, so only on that session's devices.
TEST(EagerSession, RunsOpsOnlyOnItsDevices) {
  kiln::Tensor on1 = kiln::Tensor::zeros(DType::f32, {2}, DeviceRef::CPU(1));
  on1.data_as<float>()[1] = -4;
  std::string msg = error_message<ValueError>([&] { F::neg(nn::Tensor(on1, session_with(8))); });
  EXPECT_NE(msg.find("input 0 is on cpu:1, a device this session does not hold (its devices: [cpu:0]"),
            std::string::npos)
      << msg;
  auto both = std::make_shared<nn::EagerSession>(
      nn::EagerSessionOptions{.devices = {DeviceRef::CPU(0), DeviceRef::CPU(1)}});
  nn::Tensor y = F::neg(nn::Tensor(on1, both));
  EXPECT_EQ(y.data().device(), DeviceRef::CPU(1));
  EXPECT_EQ(y.to_vector<float>(), (std::vector<float>{0, 4}));
}

TEST(EagerSession, TheDefaultSessionIsOneObjectThatRunsSessionlessOps) {
  const std::shared_ptr<nn::EagerSession>& session = nn::default_eager_session();
  EXPECT_EQ(session.get(), nn::default_eager_session().get());
  EXPECT_EQ(&session->logger(), kiln::default_logger().get());
  const nn::EagerCacheStats before = session->cache_stats();
  nn::Tensor x = nn::Tensor::from_vector<float>({1, 2}, {2});
  F::exp(x);  // a hit or a miss, as other tests may have run exp on f32[2] already
  const nn::EagerCacheStats once = session->cache_stats();
  EXPECT_EQ(once.hits + once.misses, before.hits + before.misses + 1);
  F::exp(x);
  EXPECT_EQ(session->cache_stats().hits, once.hits + 1);
}

TEST(EagerSession, RangeRecordsInItsLikeTensorsGraphOrRunsInItsSession) {
  graph::Graph g("g", {TensorType{DType::f32, {"n"}}});
  nn::Tensor x(g.input(0));
  nn::Tensor positions = F::range(0, 1, graph::Dim("n"), DType::i64, x);
  ASSERT_TRUE(positions.is_traced());
  EXPECT_EQ(positions.value().graph(), &g.ir());
  EXPECT_EQ(positions.shape(), (graph::Shape{"n"}));
  EXPECT_EQ(g.ir().nodes.back().op, graph::Op::range);

  auto session = session_with(4);
  nn::Tensor like = nn::Tensor::zeros(DType::f32, {1}, DeviceRef::CPU(), session);
  nn::Tensor eager = F::range(2, 3, graph::Dim(3), DType::i64, like);
  EXPECT_EQ(eager.to_vector<int64_t>(), (std::vector<int64_t>{2, 5, 8}));
  EXPECT_EQ(eager.session(), session);
  EXPECT_EQ(session->cache_stats().misses, 1);
  EXPECT_NE(error_message<ValueError>([&] {
              F::range(0, 1, graph::Dim("n"), DType::i64);
            }).find("range: size n must be static when run eagerly"),
            std::string::npos);
}

// ---- compile() ---------------------------------------------------------------------------------------

TEST(EagerSession, CompileRunsInTheGivenSessionAndCachesTheCompiledGraph) {
  Scale m;
  auto session = session_with(4);
  const nn::EagerCacheStats default_before = nn::default_eager_session()->cache_stats();
  auto first = m.compile(kX, {.session = session});
  auto second = m.compile(
      kX,
      {.weights = WeightsRegistry{{"s", kiln::Tensor::from_vector<float>({5, 7}, {2})}}, .session = session});
  EXPECT_EQ(first.eager_session(), session);
  EXPECT_EQ(session->cache_stats().misses, 1);
  EXPECT_EQ(session->cache_stats().hits, 1);  // the same graph: compiled once, initialised twice
  EXPECT_EQ(session->inference_session().compile_count(), 1);
  const kiln::Tensor x = kiln::Tensor::from_vector<float>({1, 1}, {2});
  EXPECT_EQ(first({x}).at(0).to_vector<float>(), (std::vector<float>{2, 3}));
  EXPECT_EQ(second({x}).at(0).to_vector<float>(), (std::vector<float>{5, 7}));
  EXPECT_EQ(nn::default_eager_session()->cache_stats().misses, default_before.misses);
  EXPECT_EQ(nn::default_eager_session()->cache_stats().hits, default_before.hits);
}

TEST(EagerSession, CompileOnDevicesTheSessionLacksIsAValueError) {
  Scale m;
  m.set_devices({DeviceRef::CPU(0), DeviceRef::CPU(1)});
  std::string msg = error_message<ValueError>([&] { m.compile(kX); });
  EXPECT_NE(
      msg.find("ModuleV3::compile 'forward': the module runs on [cpu:0, cpu:1] but its session has only "
               "[cpu:0]"),
      std::string::npos)
      << msg;
}

// ---- the logger --------------------------------------------------------------------------------------

// One f32 parameter given as bf16: compile() with auto_cast casts it and warns once.
void compile_with_cast(const std::shared_ptr<nn::EagerSession>& session) {
  Scale m;
  m.compile(
      kX,
      {.weights = WeightsRegistry{{"s", kiln::Tensor::from_vector<bf16_t>({bf16_t(1.f), bf16_t(2.f)}, {2})}},
       .auto_cast = true,
       .session = session});
}

TEST(Logging, EachSessionsLoggerGetsItsOwnWarningsAndNoOther) {
  auto first = std::make_shared<CapturingLogger>(), second = std::make_shared<CapturingLogger>();
  compile_with_cast(session_with(4, first));
  ASSERT_EQ(first->warnings.size(), 1u);
  EXPECT_EQ(
      first->warnings[0],
      "ModuleV3::compile 'forward': auto_cast cast 1 weight to their parameters' dtypes: 's' bf16 -> f32");
  EXPECT_TRUE(second->warnings.empty());
  compile_with_cast(session_with(4, second));
  EXPECT_EQ(first->warnings.size(), 1u);
  EXPECT_EQ(second->warnings.size(), 1u);
}

TEST(Logging, ASessionWithoutALoggerUsesTheDefaultOneOnStderr) {
  engine::InferenceSession plain;
  EXPECT_EQ(&plain.logger(), kiln::default_logger().get());
  auto logger = std::make_shared<CapturingLogger>();
  engine::InferenceSession with_logger({DeviceRef::CPU()}, {}, {.logger = logger});
  EXPECT_EQ(&with_logger.logger(), logger.get());

  ::testing::internal::CaptureStderr();
  compile_with_cast(session_with(4));
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(err,
            "kiln: warning: ModuleV3::compile 'forward': auto_cast cast 1 weight to their parameters' "
            "dtypes: 's' bf16 -> f32\n");
}

// ---- staging on several threads ------------------------------------------------------------------------

// forward waits at `inside` (when set) so a test can hold a stage() open while another thread acts.
class Gated : public nn::ModuleV3 {
 public:
  explicit Gated(float s) : s(register_parameter("s", kiln::Tensor::from_vector<float>({s}, {1}))) {}
  nn::TensorTree forward(const std::vector<nn::TensorTree>& args) override {
    if (inside) inside->arrive_and_wait();
    return args.at(0).leaf() * s;
  }
  nn::Parameter s;
  std::latch* inside = nullptr;
};

const std::vector<TypeTree> kOne{TypeTree(TensorType{DType::f32, {1}})};

TEST(ModuleV3, TwoModulesStagedOnTwoThreadsAtOnceEachGetTheirOwnTrace) {
  Gated a(2), b(3);
  std::latch both_inside(2);  // neither forward returns before both have started
  a.inside = b.inside = &both_inside;
  std::optional<graph::Graph> ga, gb;
  std::thread other([&] { gb = b.stage(kOne, {"b"}); });
  ga = a.stage(kOne, {"a"});
  other.join();
  for (graph::Graph* g : {&*ga, &*gb}) {
    ASSERT_EQ(g->ir().weights.size(), 1u) << g->name();
    EXPECT_EQ(g->ir().weights[0].name, "s");
  }
  a.inside = b.inside = nullptr;
  auto session = session_with(4);
  const kiln::Tensor x = kiln::Tensor::from_vector<float>({1}, {1});
  EXPECT_EQ(a.compile(kOne, {.session = session})({x}).at(0).to_vector<float>(), std::vector<float>{2});
  EXPECT_EQ(b.compile(kOne, {.session = session})({x}).at(0).to_vector<float>(), std::vector<float>{3});
}

TEST(ModuleV3, StagingOneModuleLeavesAnotherThreadsEagerCodeEagerAndASecondStageIsAnError) {
  Gated staged(2), eager(5);
  std::latch inside(2), release(1);
  struct Hold : nn::ModuleV3 {  // stage()d on the other thread until `release`
    Hold(Gated& child, std::latch& inside, std::latch& release) : inside(inside), release(release) {
      register_module("child", std::shared_ptr<Gated>(&child, [](Gated*) {}));
    }
    nn::TensorTree forward(const std::vector<nn::TensorTree>& args) override {
      inside.arrive_and_wait();
      release.wait();
      return args.at(0).leaf();
    }
    std::latch &inside, &release;
  } holder(staged, inside, release);
  std::thread other([&] { holder.stage(kOne); });
  inside.arrive_and_wait();  // the other thread is inside holder's forward now
  EXPECT_TRUE(staged.is_staging());
  EXPECT_FALSE(eager.is_staging());
  nn::Tensor y = eager.forward({nn::Tensor::from_vector<float>({1}, {1})}).leaf();
  EXPECT_TRUE(y.is_eager());
  EXPECT_EQ(y.to_vector<float>(), std::vector<float>{5});
  std::string msg = error_message<ValueError>([&] { staged.stage(kOne, {"again"}); });
  release.count_down();
  other.join();
  EXPECT_NE(msg.find("ModuleV3::stage 'again': module 'child' is already being staged"), std::string::npos)
      << msg;
  EXPECT_FALSE(staged.is_staging());
  EXPECT_EQ(staged.stage(kOne).ir().weights.size(), 1u);  // free again once that stage() returned
}

// A parameter knows its module to find out whether it is being staged; a handle that outlives the
// module is plain data.
TEST(ModuleV3, AParameterThatOutlivesItsModuleIsItsData) {
  nn::Parameter s;
  {
    Scale m;
    s = m.s;
  }
  nn::Tensor t = s;
  ASSERT_TRUE(t.is_eager());
  EXPECT_EQ(t.to_vector<float>(), (std::vector<float>{2, 3}));
  EXPECT_EQ(*t.parameter_name(), "s");
}

}  // namespace
