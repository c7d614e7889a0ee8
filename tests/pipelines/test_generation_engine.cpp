// GenerationEngine: continuous batching gives every request the tokens it gets alone (greedy and
// seeded sampling), under chunked prefill, arrivals mid-run, cancellation, preemption in a tiny KV
// cache and prefix-cache hits; finish reasons, stop strings and ids, logprobs, bad requests, a
// throwing callback, and no leaked KV block after many random submits and cancels.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <map>
#include <mutex>
#include <random>
#include <thread>

#include "kiln/pipelines/generation_engine.h"
#include "kiln/pipelines/text_generation.h"
#include "test_util.h"

namespace {

using namespace kiln;
using kiln::testing::expect_error;
using pipelines::EngineOptions;
using pipelines::FinishReason;
using pipelines::GenerationEngine;
using pipelines::GenerationOutput;
using pipelines::GenerationRequest;
using pipelines::RequestUpdate;
using pipelines::SamplingParams;

nn::LlamaConfig small_config() {
  nn::LlamaConfig c;
  c.vocab_size = 96;
  c.hidden_size = 32;
  c.intermediate_size = 64;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.max_position_embeddings = 128;
  return c;
}

std::unique_ptr<GenerationEngine> make_engine(EngineOptions options = {}) {
  nn::LlamaConfig c = small_config();
  if (options.kv_block_size == 16) options.kv_block_size = 4;  // small blocks: many block boundaries
  return std::make_unique<GenerationEngine>(c, pipelines::random_weights(c, 3), nullptr, std::vector<int64_t>{},
                                            std::move(options));
}

std::vector<int64_t> prompt_of(int64_t length, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int64_t> ids(static_cast<size_t>(length));
  for (auto& id : ids) id = static_cast<int64_t>(rng() % 96);
  return ids;
}

GenerationRequest request(std::vector<int64_t> prompt, int64_t new_tokens, double temperature = 0,
                          uint64_t seed = 0) {
  GenerationRequest r;
  r.prompt_ids = std::move(prompt);
  r.sampling.max_new_tokens = new_tokens;
  r.sampling.temperature = temperature;
  r.sampling.top_p = temperature > 0 ? 0.9 : 1.0;
  r.sampling.seed = seed;
  r.sampling.ignore_eos = true;
  return r;
}

std::vector<int64_t> ids_of(const GenerationOutput& out) {
  std::vector<int64_t> ids;
  for (const auto& t : out.tokens) ids.push_back(t.id);
  return ids;
}

// Collects every request's outcome from the engine's thread.
struct Collector {
  std::mutex mutex;
  std::condition_variable done;
  std::map<pipelines::RequestId, std::vector<int64_t>> ids;
  std::map<pipelines::RequestId, FinishReason> finish;

  std::function<void(const RequestUpdate&)> callback() {
    return [this](const RequestUpdate& u) {
      std::lock_guard lock(mutex);
      for (const auto& t : u.tokens) ids[u.id].push_back(t.id);
      if (u.finish) {
        finish[u.id] = *u.finish;
        done.notify_all();
      }
    };
  }
  void wait_for(size_t count) {
    std::unique_lock lock(mutex);
    ASSERT_TRUE(done.wait_for(lock, std::chrono::seconds(120), [&] { return finish.size() >= count; }))
        << "requests did not finish";
  }
};

struct Case {
  int64_t prompt_len;
  int64_t new_tokens;
  double temperature;
  uint64_t seed;
};
const std::vector<Case> kCases{{3, 12, 0, 0},  {37, 9, 0, 0},  {1, 20, 0, 0},   {18, 6, 1.0, 5},
                               {50, 10, 0, 0}, {7, 15, 0.8, 9}, {25, 3, 0, 0},  {11, 14, 1.2, 21}};

// Alone: one request at a time through its own engine (a batch of one).
std::vector<std::vector<int64_t>> solo_outputs(const EngineOptions& options) {
  auto engine = make_engine(options);
  std::vector<std::vector<int64_t>> out;
  for (size_t i = 0; i < kCases.size(); ++i) {
    const Case& c = kCases[i];
    out.push_back(ids_of(engine->generate(request(prompt_of(c.prompt_len, i), c.new_tokens, c.temperature, c.seed))));
    EXPECT_EQ(out.back().size(), static_cast<size_t>(c.new_tokens));
  }
  return out;
}

// Batching tolerance (docs/batching.md): in steps of at most 8 tokens a row's arithmetic does not
// depend on the other rows, so the tokens are exactly those of the solo run.
constexpr int64_t kInvariantBudget = 8;

TEST(GenerationEngine, EveryRequestOfAMixedBatchGetsItsSoloTokens) {
  const EngineOptions options{.max_num_batched_tokens = kInvariantBudget};
  const auto solo = solo_outputs(options);
  auto engine = make_engine(options);
  Collector collector;
  std::map<pipelines::RequestId, size_t> case_of;  // written under collector.mutex
  auto submit = [&](size_t i, std::function<void(const RequestUpdate&)> also = {}) {
    const Case& c = kCases[i];
    GenerationRequest r = request(prompt_of(c.prompt_len, i), c.new_tokens, c.temperature, c.seed);
    auto record = collector.callback();
    r.on_update = [record, also](const RequestUpdate& u) {
      record(u);
      if (also) also(u);
    };
    const pipelines::RequestId id = engine->submit(std::move(r));
    std::lock_guard lock(collector.mutex);
    case_of[id] = i;
  };
  // A long request, cancelled from its own callback after its third token (the step thread's
  // callbacks may call the engine).
  GenerationRequest doomed = request(prompt_of(40, 99), 100);
  auto record = collector.callback();
  std::atomic<int> doomed_tokens{0};
  std::atomic<bool> cancel_accepted{false};
  pipelines::RequestId doomed_id = 0;
  doomed.on_update = [&, record](const RequestUpdate& u) {
    record(u);
    doomed_tokens += static_cast<int>(u.tokens.size());
    if (!u.finish && doomed_tokens == 3) cancel_accepted = engine->cancel(u.id);
  };
  // Half submitted together; the rest arrive mid-run, once the first has its first token.
  std::atomic<bool> second_half{false};
  submit(0, [&](const RequestUpdate& u) {
    if (u.tokens.empty() || second_half.exchange(true)) return;
    for (size_t i = kCases.size() / 2; i < kCases.size(); ++i) submit(i);
  });
  for (size_t i = 1; i < kCases.size() / 2; ++i) submit(i);
  doomed_id = engine->submit(std::move(doomed));
  collector.wait_for(kCases.size() + 1);

  EXPECT_TRUE(cancel_accepted);
  EXPECT_EQ(collector.finish.at(doomed_id), FinishReason::cancelled);
  EXPECT_GE(collector.ids.at(doomed_id).size(), 3u);
  EXPECT_LT(collector.ids.at(doomed_id).size(), 100u);
  for (const auto& [id, i] : case_of) {
    EXPECT_EQ(collector.finish.at(id), FinishReason::length) << "case " << i;
    EXPECT_EQ(collector.ids.at(id), solo[i]) << "case " << i;
  }
  EXPECT_FALSE(engine->cancel(doomed_id)) << "a finished request cannot be cancelled again";
  const pipelines::EngineStats stats = engine->stats();
  EXPECT_EQ(stats.running, 0);
  EXPECT_EQ(stats.waiting, 0);
  EXPECT_EQ(stats.kv_blocks_in_use, 0);
}

TEST(GenerationEngine, SeededSamplingDoesNotDependOnTheBatch) {
  auto engine = make_engine({.max_num_batched_tokens = kInvariantBudget});
  const auto prompt = prompt_of(9, 1);
  const auto alone = ids_of(engine->generate(request(prompt, 16, 1.0, 77)));
  // The same request beside seven others with other seeds and prompts.
  Collector collector;
  pipelines::RequestId target = 0;
  for (uint64_t i = 0; i < 8; ++i) {
    GenerationRequest r = i == 3 ? request(prompt, 16, 1.0, 77) : request(prompt_of(5 + static_cast<int64_t>(i), 50 + i), 16, 1.0, i);
    r.on_update = collector.callback();
    const auto id = engine->submit(std::move(r));
    if (i == 3) target = id;
  }
  collector.wait_for(8);
  EXPECT_EQ(collector.ids.at(target), alone);
  const auto other_seed = ids_of(engine->generate(request(prompt, 16, 1.0, 78)));
  EXPECT_NE(other_seed, alone);
}

TEST(GenerationEngine, PreemptionInATinyCacheLosesNothing) {
  const auto solo = solo_outputs({.max_num_batched_tokens = kInvariantBudget});
  // 20 blocks of 4 positions: fewer than the cases need at once (about 60), more than the longest
  // one alone (15 blocks), so sequences are preempted and recomputed.
  const nn::LlamaConfig c = small_config();
  const int64_t block_bytes = 2 * c.num_hidden_layers * c.num_key_value_heads * c.resolved_head_dim() * 4 * 4;
  auto engine = make_engine({.kv_cache_bytes = 20 * block_bytes, .enable_prefix_caching = false,
                             .max_num_batched_tokens = kInvariantBudget});
  EXPECT_EQ(engine->stats().kv_blocks_total, 20);
  Collector collector;
  std::map<pipelines::RequestId, size_t> case_of;
  for (size_t i = 0; i < kCases.size(); ++i) {
    const Case& k = kCases[i];
    GenerationRequest r = request(prompt_of(k.prompt_len, i), k.new_tokens, k.temperature, k.seed);
    r.on_update = collector.callback();
    case_of[engine->submit(std::move(r))] = i;
  }
  collector.wait_for(kCases.size());
  for (const auto& [id, i] : case_of) EXPECT_EQ(collector.ids.at(id), solo[i]) << "case " << i;
  EXPECT_GT(engine->stats().preemptions, 0) << "the cache was meant to be too small for all at once";
  EXPECT_EQ(engine->stats().kv_blocks_in_use, 0);
}

TEST(GenerationEngine, PrefixCacheHitsSkipPrefillAndChangeNothing) {
  auto cached = make_engine();
  auto uncached = make_engine({.enable_prefix_caching = false});
  const auto system = prompt_of(30, 4);  // a shared "system prompt"
  auto with_suffix = [&](uint64_t seed) {
    auto p = system;
    for (int64_t id : prompt_of(5, seed)) p.push_back(id);
    return p;
  };
  const GenerationOutput first = cached->generate(request(with_suffix(1), 8));
  EXPECT_EQ(first.metrics.cached_prompt_tokens, 0);
  const GenerationOutput second = cached->generate(request(with_suffix(2), 8));
  EXPECT_EQ(second.metrics.cached_prompt_tokens, 28) << "7 full blocks of 4 of the shared 30 tokens";
  EXPECT_EQ(ids_of(second), ids_of(uncached->generate(request(with_suffix(2), 8))));
  const GenerationOutput again = cached->generate(request(with_suffix(1), 8));
  EXPECT_EQ(again.metrics.cached_prompt_tokens, 32) << "the whole prompt but its last block";
  EXPECT_EQ(ids_of(again), ids_of(first));
  EXPECT_EQ(cached->stats().cached_prompt_tokens, 60);
}

TEST(GenerationEngine, NoBlockLeaksAfterAThousandRandomSubmitsAndCancels) {
  auto engine = make_engine({.max_num_seqs = 8, .max_num_batched_tokens = 32});
  std::mt19937_64 rng(5);
  std::vector<pipelines::RequestId> ids;
  Collector collector;
  for (int op = 0; op < 1000; ++op) {
    if (ids.empty() || rng() % 3 != 0) {
      GenerationRequest r = request(prompt_of(1 + static_cast<int64_t>(rng() % 40), rng() % 4),
                                    1 + static_cast<int64_t>(rng() % 6), rng() % 2 ? 1.0 : 0.0, rng());
      r.on_update = collector.callback();
      ids.push_back(engine->submit(std::move(r)));
    } else {
      engine->cancel(ids[rng() % ids.size()]);  // finished or not
    }
  }
  collector.wait_for(ids.size());
  const pipelines::EngineStats stats = engine->stats();
  EXPECT_EQ(stats.kv_blocks_in_use, 0);
  EXPECT_EQ(stats.running, 0);
  EXPECT_EQ(stats.waiting, 0);
  for (pipelines::RequestId id : ids) {
    const FinishReason f = collector.finish.at(id);
    EXPECT_TRUE(f == FinishReason::length || f == FinishReason::cancelled) << pipelines::finish_reason_name(f);
  }
}

// Above 8 rows per step the matmuls take the blocked GEMM, which rounds in another order: the
// chosen tokens' log-probabilities stay within f32 rounding of the solo run's.
TEST(GenerationEngine, LargeStepsStayWithinRoundingOfTheSoloRun) {
  auto engine = make_engine({.max_num_batched_tokens = 256});
  auto with_logprobs = [](GenerationRequest r) {
    r.sampling.logprobs = true;
    return r;
  };
  std::vector<GenerationOutput> solo;
  for (uint64_t i = 0; i < 12; ++i)
    solo.push_back(engine->generate(with_logprobs(request(prompt_of(20 + static_cast<int64_t>(i), i), 8))));
  std::vector<GenerationRequest> batch;
  Collector collector;
  std::map<pipelines::RequestId, std::vector<float>> logprobs;  // under collector.mutex
  for (uint64_t i = 0; i < 12; ++i) {
    GenerationRequest r = with_logprobs(request(prompt_of(20 + static_cast<int64_t>(i), i), 8));
    auto record = collector.callback();
    r.on_update = [&, record](const RequestUpdate& u) {
      {
        std::lock_guard lock(collector.mutex);
        for (const auto& t : u.tokens) logprobs[u.id].push_back(t.logprob);
      }
      record(u);
    };
    batch.push_back(std::move(r));
  }
  const std::vector<pipelines::RequestId> ids = engine->submit(std::move(batch));
  collector.wait_for(12);
  for (size_t i = 0; i < ids.size(); ++i) {
    const std::vector<int64_t>& got = collector.ids.at(ids[i]);
    ASSERT_EQ(got.size(), solo[i].tokens.size());
    for (size_t t = 0; t < got.size(); ++t) {
      if (got[t] != solo[i].tokens[t].id) break;  // a near-tie flipped: the rest may differ
      EXPECT_NEAR(logprobs.at(ids[i])[t], solo[i].tokens[t].logprob, 1e-4) << "request " << i << " token " << t;
    }
  }
}

// A stream taken from other threads holds exactly what generate() returns, ending with one update
// that has the finish reason; after it, next() returns nothing at once.
TEST(GenerationEngine, StreamsAreTakenFromTheCallersThread) {
  auto engine = make_engine();
  const auto expected = ids_of(engine->generate(request(prompt_of(7, 2), 12, 0.9, 4)));
  std::vector<std::thread> readers;
  std::vector<std::vector<int64_t>> got(4);
  std::vector<int> finishes(4, 0);
  for (size_t i = 0; i < 4; ++i)
    readers.emplace_back([&, i] {
      pipelines::RequestStream s = engine->stream(request(prompt_of(7, 2), 12, 0.9, 4));
      while (auto u = s.next(std::chrono::seconds(60))) {
        for (const auto& t : u->tokens) got[i].push_back(t.id);
        if (u->finish) {
          ++finishes[i];
          EXPECT_EQ(*u->finish, FinishReason::length);
        }
      }
      EXPECT_TRUE(s.done());
      EXPECT_FALSE(s.next(std::chrono::milliseconds(0)).has_value());
    });
  for (auto& t : readers) t.join();
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_EQ(got[i], expected) << "reader " << i;
    EXPECT_EQ(finishes[i], 1) << "reader " << i;
  }
}

TEST(GenerationEngine, StopTokenIdsAndLengthFinishes) {
  auto engine = make_engine();
  const auto prompt = prompt_of(6, 8);
  const auto free_run = ids_of(engine->generate(request(prompt, 10)));
  GenerationRequest r = request(prompt, 10);
  r.sampling.stop_token_ids = {free_run[4]};
  const GenerationOutput stopped = engine->generate(std::move(r));
  EXPECT_EQ(stopped.finish, FinishReason::stop);
  // Up to the first occurrence of that id, which is included.
  const auto first = std::find(free_run.begin(), free_run.end(), free_run[4]);
  EXPECT_EQ(ids_of(stopped), std::vector<int64_t>(free_run.begin(), first + 1));
  const GenerationOutput zero = engine->generate(request(prompt, 0));
  EXPECT_EQ(zero.finish, FinishReason::length);
  EXPECT_TRUE(zero.tokens.empty());
}

TEST(GenerationEngine, AReachedMaxSeqLenFinishesWithLength) {
  auto engine = make_engine({.max_seq_len = 12});
  const GenerationOutput out = engine->generate(request(prompt_of(8, 2), 100));
  EXPECT_EQ(out.finish, FinishReason::length);
  EXPECT_EQ(out.tokens.size(), 4u);  // 8 + 4 = 12 positions
}

// Greedy picks the most likely token, so it heads its own top list; the list is descending and
// its probabilities sum to at most 1.
TEST(GenerationEngine, LogprobsOfTheChosenAndTheTopTokens) {
  auto engine = make_engine();
  GenerationRequest r = request(prompt_of(5, 3), 6);
  r.sampling.logprobs = true;
  r.sampling.top_logprobs = 5;
  const GenerationOutput out = engine->generate(std::move(r));
  ASSERT_EQ(out.tokens.size(), 6u);
  for (const auto& t : out.tokens) {
    ASSERT_EQ(t.top_logprobs.size(), 5u);
    EXPECT_EQ(t.top_logprobs[0].id, t.id);
    EXPECT_FLOAT_EQ(t.top_logprobs[0].logprob, t.logprob);
    EXPECT_LE(t.logprob, 0.0f);
    double mass = 0;
    for (size_t i = 0; i < t.top_logprobs.size(); ++i) {
      mass += std::exp(static_cast<double>(t.top_logprobs[i].logprob));
      if (i > 0) {
        EXPECT_GE(t.top_logprobs[i - 1].logprob, t.top_logprobs[i].logprob);
      }
    }
    EXPECT_LE(mass, 1.0 + 1e-5);
  }
}

TEST(GenerationEngine, BadRequestsAreRefusedBeforeQueueingNamingTheField) {
  auto engine = make_engine({.max_seq_len = 16});
  auto with = [&](auto edit) {
    GenerationRequest r = request({1, 2, 3}, 4);
    edit(r);
    return [r, &engine]() mutable { engine->submit(std::move(r)); };
  };
  expect_error<ValueError>(with([](GenerationRequest& r) { r.prompt_ids.clear(); }), "no tokenizer");
  expect_error<ValueError>(with([](GenerationRequest& r) { r.prompt_ids = {96}; }), "96");
  expect_error<ValueError>(with([](GenerationRequest& r) { r.prompt_ids.assign(17, 1); }), "max_seq_len 16");
  expect_error<ValueError>(with([](GenerationRequest& r) { r.sampling.temperature = -1; }), "temperature");
  expect_error<ValueError>(with([](GenerationRequest& r) { r.sampling.top_p = 0; }), "top_p");
  expect_error<ValueError>(with([](GenerationRequest& r) { r.sampling.min_p = 2; }), "min_p");
  expect_error<ValueError>(with([](GenerationRequest& r) { r.sampling.frequency_penalty = 3; }), "frequency_penalty");
  expect_error<ValueError>(with([](GenerationRequest& r) { r.sampling.top_logprobs = 21; }), "top_logprobs");
  expect_error<ValueError>(with([](GenerationRequest& r) { r.sampling.max_new_tokens = -1; }), "max_new_tokens");
  expect_error<ValueError>(with([](GenerationRequest& r) { r.sampling.stop = {""}; }), "stop string");
  expect_error<ValueError>(with([](GenerationRequest& r) { r.sampling.stop_token_ids = {-1}; }), "stop token id");
  EXPECT_EQ(engine->stats().waiting, 0);
}

TEST(GenerationEngine, AThrowingCallbackFailsOnlyItsRequest) {
  auto engine = make_engine();
  GenerationRequest bad = request(prompt_of(4, 1), 8);
  bad.on_update = [](const RequestUpdate&) { throw std::runtime_error("client went away"); };
  std::atomic<bool> done{false};
  const GenerationOutput out = engine->generate(std::move(bad));  // generate's own wrapper still finishes
  done = true;
  EXPECT_EQ(out.finish, FinishReason::error);
  EXPECT_NE(out.error.find("client went away"), std::string::npos) << out.error;
  EXPECT_EQ(engine->generate(request(prompt_of(4, 1), 3)).tokens.size(), 3u) << "the engine keeps serving";
  EXPECT_EQ(engine->stats().kv_blocks_in_use, 0);
}

TEST(GenerationEngine, DestroyingTheEngineCancelsWhatIsLeft) {
  Collector collector;
  {
    auto engine = make_engine();
    for (int i = 0; i < 4; ++i) {
      GenerationRequest r = request(prompt_of(20, static_cast<uint64_t>(i)), 100);
      // Slow clients: 100 tokens take at least 0.4 s, so none can finish before the engine goes,
      // however late this thread gets there on a loaded machine.
      auto record = collector.callback();
      r.on_update = [record](const RequestUpdate& u) {
        std::this_thread::sleep_for(std::chrono::milliseconds(4));
        record(u);
      };
      engine->submit(std::move(r));
    }
  }
  ASSERT_EQ(collector.finish.size(), 4u);
  for (const auto& [id, f] : collector.finish) EXPECT_EQ(f, FinishReason::cancelled);
}

TEST(GenerationEngine, TheGroupCompilesOnceAndTracesModelThenSamplers) {
  auto engine = make_engine();
  EXPECT_EQ(engine->compile_count(), 1);
  graph::Module m = GenerationEngine::trace_graphs(small_config());
  EXPECT_EQ(m.graph_names(), (std::vector<std::string>{"model", "sampler", "greedy"}));
}

TEST(GenerationEngine, KvCacheInBf16AndF16Runs) {
  for (DType dtype : {DType::bf16, DType::f16}) {
    auto engine = make_engine({.kv_cache_dtype = dtype});
    const GenerationOutput out = engine->generate(request(prompt_of(10, 1), 6));
    EXPECT_EQ(out.tokens.size(), 6u) << dtype_name(dtype);
  }
  EXPECT_THROW(make_engine({.kv_cache_dtype = DType::i64}), ValueError);
}

}  // namespace
