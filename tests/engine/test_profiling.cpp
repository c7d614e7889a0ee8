// Model profiling (start_profiling / stop_profiling / profile): every launch of every run counted
// and timed while on, nothing while off, and results unchanged.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "kiln/kiln.h"

namespace {

using namespace kiln;
using engine::InferenceSession;
using graph::TensorType;
namespace ops = kiln::graph::ops;

// relu(x @ w) * 2 and its reshape: a matmul, an elementwise tail and an alias (which launches nothing).
engine::Model proj_model(const InferenceSession& session) {
  graph::Graph g("proj", {TensorType{DType::f32, {"batch", 3}}});
  graph::Graph::Scope scope(g);
  auto w = g.weight({"w", DType::f32, {3, 2}});
  auto h = ops::mul(ops::relu(ops::matmul(g.input(0), w)), ops::constant(2.0, DType::f32));
  g.output({ops::reshape(h, graph::Shape{graph::shape_of(g.input(0).type())[0] * 2})});
  const WeightsRegistry weights = {{"w", Tensor::from_vector<float>({1, -1, 2, 0, -1, 3}, {3, 2})}};
  return session.init(session.compile(g.module()), weights).at("proj");
}

const Tensor kX = Tensor::from_vector<float>({1, 2, 3, -1, 0, 1}, {2, 3});
// relu([1, 2, 3] @ w) * 2 = relu([2, 8]) * 2; relu([-1, 0, 1] @ w) * 2 = relu([-2, 4]) * 2.
const std::vector<float> kExpected = {4, 16, 0, 8};

int64_t total_launches(const engine::ModelProfile& p) {
  int64_t n = 0;
  for (const auto& s : p.steps) n += s.launches;
  return n;
}

double total_step_seconds(const engine::ModelProfile& p) {
  double t = 0;
  for (const auto& s : p.steps) t += s.seconds;
  return t;
}

TEST(Profiling, OffByDefaultAndCountsNothing) {
  InferenceSession session;
  auto model = proj_model(session);
  EXPECT_EQ(model.execute({kX}).at(0).to_vector<float>(), kExpected);
  const engine::ModelProfile p = model.profile();
  EXPECT_EQ(p.runs, 0);
  EXPECT_EQ(p.seconds, 0.0);
  EXPECT_TRUE(p.steps.empty());
}

TEST(Profiling, CountsEveryLaunchOfEveryRunAndTheirTime) {
  InferenceSession session;
  auto model = proj_model(session);
  model.start_profiling();
  for (int i = 0; i < 3; ++i) EXPECT_EQ(model.execute({kX}).at(0).to_vector<float>(), kExpected);
  const engine::ModelProfile p = model.profile();
  EXPECT_EQ(p.runs, 3);
  ASSERT_FALSE(p.steps.empty());
  EXPECT_TRUE(std::any_of(p.steps.begin(), p.steps.end(), [](const auto& s) { return s.op == "matmul"; }));
  for (const auto& s : p.steps) {
    EXPECT_EQ(s.launches, 3) << s.op << " (node " << s.node << ")";
    EXPECT_GE(s.seconds, 0.0) << s.op;
    EXPECT_NE(s.op, "reshape") << "an alias launches nothing";
  }
  // The matmul's weight operand is w, f32 [3, 2]: 24 bytes; the elementwise tail reads no weight.
  for (const auto& s : p.steps) EXPECT_EQ(s.weight_bytes, s.op == "matmul" ? 24 : 0) << s.op;
  // Launches are timed inside their run.
  EXPECT_GT(p.seconds, 0.0);
  EXPECT_LE(total_step_seconds(p), p.seconds);
  // Nodes are distinct and name the compiled graph's nodes.
  for (size_t i = 1; i < p.steps.size(); ++i) EXPECT_NE(p.steps[i].node, p.steps[i - 1].node);
}

TEST(Profiling, StopKeepsTheTotalsAndStartClearsThem) {
  InferenceSession session;
  auto model = proj_model(session);
  model.start_profiling();
  model.execute({kX});
  model.execute({kX});
  model.stop_profiling();
  model.execute({kX});  // not counted
  engine::ModelProfile p = model.profile();
  EXPECT_EQ(p.runs, 2);
  EXPECT_EQ(total_launches(p), 2 * static_cast<int64_t>(p.steps.size()));
  model.start_profiling();
  p = model.profile();
  EXPECT_EQ(p.runs, 0);
  EXPECT_EQ(total_launches(p), 0);
  model.execute({kX});
  EXPECT_EQ(model.profile().runs, 1);
}

TEST(Profiling, ReplaysAndCopiesOfTheModelShareOneProfile) {
  InferenceSession session;
  auto model = proj_model(session);
  const engine::Model copy = model;
  copy.start_profiling();
  model.capture("b2", {kX});
  EXPECT_EQ(model.replay("b2", {kX}).at(0).to_vector<float>(), kExpected);
  const engine::ModelProfile p = copy.profile();
  EXPECT_EQ(p.runs, 2) << "capture runs the graph once, then the replay";
  for (const auto& s : p.steps) EXPECT_EQ(s.launches, 2) << s.op;
}

}  // namespace
