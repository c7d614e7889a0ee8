// The OpenAI-compatible server as clients meet it: started for real on a loopback port, driven over
// HTTP (cpp-httplib's client): the completions it returns equal the engine's own output, streaming
// and not; bad requests get 400s naming the field; a client that disconnects mid-stream has its
// request cancelled and the server keeps serving; concurrent clients all finish.
#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <httplib.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>

#include <filesystem>
#include <map>
#include <sstream>
#include <nlohmann/json.hpp>
#include <thread>

#include "kiln/pipelines/text_generation.h"
#include "kiln/serve/server.h"
#include "test_util.h"

#include <fmt/format.h>

namespace {

using namespace kiln;
using nlohmann::json;

std::filesystem::path kiln_tiny() {
  return std::filesystem::path(__FILE__).parent_path().parent_path().parent_path() / "models" / "kiln-tiny";
}

std::filesystem::path chatml() {
  return std::filesystem::path(__FILE__).parent_path().parent_path() / "data" / "chat" / "chatml.jinja";
}

// Opens a streaming completion on a raw socket and reads until its first event, leaving it open.
int open_stream(int port, const json& body) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return -1;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) return close(fd), -1;
  const std::string text = body.dump();
  const std::string request = "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                              "Content-Length: " + std::to_string(text.size()) + "\r\n\r\n" + text;
  if (send(fd, request.data(), request.size(), 0) != static_cast<ssize_t>(request.size())) return close(fd), -1;
  std::string received;
  char buffer[4096];
  while (received.find("data: ") == std::string::npos) {
    const ssize_t n = recv(fd, buffer, sizeof buffer, 0);
    if (n <= 0) return close(fd), -1;
    received.append(buffer, static_cast<size_t>(n));
  }
  return fd;
}

// Reads what is left of a stream until the server closes it or [DONE] comes.
std::string read_rest(int fd) {
  std::string received;
  char buffer[4096];
  ssize_t n;
  while (received.find("data: [DONE]") == std::string::npos && (n = recv(fd, buffer, sizeof buffer, 0)) > 0)
    received.append(buffer, static_cast<size_t>(n));
  close(fd);
  return received;
}

// One engine and server for the whole suite (loading and compiling once).
class Served : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    engine_ = std::shared_ptr<pipelines::GenerationEngine>(
        pipelines::GenerationEngine::from_dir(kiln_tiny(), {.max_seq_len = 256, .max_num_seqs = 16}));
    serve::ServerOptions options{.port = 0, .model_name = "kiln-tiny"};
    options.chat_template = std::make_shared<const pipelines::ChatTemplate>(pipelines::ChatTemplate::from_file(chatml()));
    server_ = std::make_unique<serve::Server>(engine_, options);
    port_ = server_->start();
  }
  static void TearDownTestSuite() {
    server_.reset();
    engine_.reset();
  }
  httplib::Client client() const {
    httplib::Client c("127.0.0.1", port_);
    c.set_read_timeout(std::chrono::seconds(60));
    return c;
  }
  static json post(httplib::Client& c, const json& body, int expected_status = 200) {
    auto res = c.Post("/v1/completions", body.dump(), "application/json");
    EXPECT_TRUE(res) << "no response";
    if (!res) return {};
    EXPECT_EQ(res->status, expected_status) << res->body;
    return json::parse(res->body);
  }
  // The data lines of an event stream, [DONE] included.
  static std::vector<std::string> events(const std::string& body) {
    std::vector<std::string> out;
    size_t at = 0;
    while ((at = body.find("data: ", at)) != std::string::npos) {
      const size_t end = body.find("\n\n", at);
      out.push_back(body.substr(at + 6, end - at - 6));
      at = end;
    }
    return out;
  }

  static std::shared_ptr<pipelines::GenerationEngine> engine_;
  static std::unique_ptr<serve::Server> server_;
  static int port_;
};
std::shared_ptr<pipelines::GenerationEngine> Served::engine_;
std::unique_ptr<serve::Server> Served::server_;
int Served::port_ = 0;

TEST_F(Served, HealthAndModels) {
  auto c = client();
  auto health = c.Get("/health");
  ASSERT_TRUE(health);
  EXPECT_EQ(health->status, 200);
  EXPECT_EQ(json::parse(health->body).at("status"), "ok");
  auto models = c.Get("/v1/models");
  ASSERT_TRUE(models);
  const json m = json::parse(models->body);
  EXPECT_EQ(m.at("object"), "list");
  EXPECT_EQ(m.at("data").at(0).at("id"), "kiln-tiny");
  auto one = c.Get("/v1/models/kiln-tiny");
  ASSERT_TRUE(one);
  EXPECT_EQ(one->status, 200);
  EXPECT_EQ(json::parse(one->body).at("id"), "kiln-tiny");
  auto other = c.Get("/v1/models/gpt-4");
  ASSERT_TRUE(other);
  EXPECT_EQ(other->status, 404);
  EXPECT_EQ(json::parse(other->body).at("error").at("param"), "model");
  auto missing = c.Get("/v1/nothing");
  ASSERT_TRUE(missing);
  EXPECT_EQ(missing->status, 404);
  EXPECT_TRUE(json::parse(missing->body).contains("error"));
}

// Greedy completions are the engine's own tokens for the same prompt, with OpenAI's response shape.
TEST_F(Served, CompletionEqualsTheEnginesOutput) {
  pipelines::GenerationRequest direct;
  direct.prompt = "You will";
  direct.sampling.temperature = 0;
  direct.sampling.max_new_tokens = 12;
  const pipelines::GenerationOutput expected = engine_->generate(std::move(direct));

  auto c = client();
  const json r = post(c, {{"model", "kiln-tiny"}, {"prompt", "You will"}, {"max_tokens", 12}, {"temperature", 0}});
  EXPECT_EQ(r.at("object"), "text_completion");
  EXPECT_EQ(r.at("model"), "kiln-tiny");
  EXPECT_EQ(r.at("choices").at(0).at("text"), expected.text);
  EXPECT_EQ(r.at("choices").at(0).at("finish_reason"), expected.finish == pipelines::FinishReason::stop ? "stop" : "length");
  EXPECT_EQ(r.at("usage").at("prompt_tokens"), expected.metrics.prompt_tokens);
  EXPECT_EQ(r.at("usage").at("completion_tokens"), static_cast<int64_t>(expected.tokens.size()));
  EXPECT_EQ(r.at("usage").at("total_tokens"), expected.metrics.prompt_tokens + static_cast<int64_t>(expected.tokens.size()));
}

TEST_F(Served, StreamingConcatenatesToTheSameTextThenUsageThenDone) {
  auto c = client();
  const json request = {{"prompt", "The best"}, {"max_tokens", 10}, {"temperature", 0}, {"ignore_eos", true}};
  const json whole = post(c, request);
  json streamed = request;
  streamed["stream"] = true;
  streamed["stream_options"] = {{"include_usage", true}};
  auto res = c.Post("/v1/completions", streamed.dump(), "application/json");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 200);
  EXPECT_NE(res->get_header_value("Content-Type").find("text/event-stream"), std::string::npos);
  const std::vector<std::string> lines = events(res->body);
  ASSERT_GE(lines.size(), 3u);
  EXPECT_EQ(lines.back(), "[DONE]");
  std::string text;
  int finishes = 0;
  for (size_t i = 0; i + 2 < lines.size(); ++i) {
    const json chunk = json::parse(lines[i]);
    text += chunk.at("choices").at(0).at("text").get<std::string>();
    if (!chunk.at("choices").at(0).at("finish_reason").is_null()) ++finishes;
  }
  EXPECT_EQ(text, whole.at("choices").at(0).at("text"));
  EXPECT_EQ(finishes, 1);
  const json usage = json::parse(lines[lines.size() - 2]);
  EXPECT_TRUE(usage.at("choices").empty());
  EXPECT_EQ(usage.at("usage").at("completion_tokens"), 10);
}

// n choices are n seeded requests: choice i is what one request seeded seed + i gives, streamed or
// not; usage counts the prompt once and every choice's tokens.
TEST_F(Served, NChoicesAreSeededRequestsOfTheirOwn) {
  auto c = client();
  const json base = {{"prompt", "Choose"}, {"max_tokens", 6}, {"temperature", 0.9}, {"ignore_eos", true}};
  std::vector<std::string> alone;
  for (int i = 0; i < 3; ++i) {
    json one = base;
    one["seed"] = 40 + i;
    alone.push_back(post(c, one).at("choices").at(0).at("text"));
  }
  json three = base;
  three["seed"] = 40;
  three["n"] = 3;
  const json r = post(c, three);
  ASSERT_EQ(r.at("choices").size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(r.at("choices").at(i).at("index"), i);
    EXPECT_EQ(r.at("choices").at(i).at("text"), alone[i]) << "choice " << i;
  }
  EXPECT_EQ(r.at("usage").at("completion_tokens"), 18);
  EXPECT_EQ(r.at("usage").at("total_tokens"),
            r.at("usage").at("prompt_tokens").get<int64_t>() + 18);

  three["stream"] = true;
  three["stream_options"] = {{"include_usage", true}};
  auto res = c.Post("/v1/completions", three.dump(), "application/json");
  ASSERT_TRUE(res);
  const std::vector<std::string> lines = events(res->body);
  ASSERT_GE(lines.size(), 3u);
  EXPECT_EQ(lines.back(), "[DONE]");
  std::vector<std::string> texts(3);
  std::vector<int> finishes(3, 0);
  for (size_t i = 0; i + 2 < lines.size(); ++i) {
    const json chunk = json::parse(lines[i]);
    for (const json& ch : chunk.at("choices")) {
      const size_t index = ch.at("index");
      ASSERT_LT(index, 3u);
      texts[index] += ch.at("text").get<std::string>();
      if (!ch.at("finish_reason").is_null()) ++finishes[index];
    }
  }
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(texts[i], alone[i]) << "streamed choice " << i;
    EXPECT_EQ(finishes[i], 1) << "streamed choice " << i;
  }
  EXPECT_EQ(json::parse(lines[lines.size() - 2]).at("usage").at("completion_tokens"), 18);
}

TEST_F(Served, LogprobsListEveryTokenWithItsTopAlternatives) {
  auto c = client();
  const json r = post(c, {{"prompt", "A"}, {"max_tokens", 5}, {"temperature", 0}, {"logprobs", 3}, {"ignore_eos", true}});
  const json& lp = r.at("choices").at(0).at("logprobs");
  ASSERT_EQ(lp.at("tokens").size(), 5u);
  std::string joined;
  for (size_t i = 0; i < 5; ++i) {
    EXPECT_EQ(lp.at("text_offset").at(i), static_cast<int64_t>(joined.size()));
    joined += lp.at("tokens").at(i).get<std::string>();
    EXPECT_LE(lp.at("token_logprobs").at(i).get<double>(), 0.0);
    EXPECT_LE(lp.at("top_logprobs").at(i).size(), 3u);
    EXPECT_GE(lp.at("top_logprobs").at(i).size(), 1u);
  }
  EXPECT_EQ(joined, r.at("choices").at(0).at("text"));
}

TEST_F(Served, BadRequestsAre400sNamingTheField) {
  auto c = client();
  auto bad = [&](const std::string& body, const std::string& param, int status = 400) {
    auto res = c.Post("/v1/completions", body, "application/json");
    ASSERT_TRUE(res);
    EXPECT_EQ(res->status, status) << body;
    const json e = json::parse(res->body).at("error");
    EXPECT_FALSE(e.at("message").get<std::string>().empty());
    if (!param.empty()) {
      EXPECT_EQ(e.at("param"), param) << body << ": " << e.dump();
      EXPECT_NE(e.at("message").get<std::string>().find(param), std::string::npos) << e.dump();
    }
  };
  bad("{not json", "");
  bad("[1, 2]", "");
  bad(R"({"max_tokens": 4})", "prompt");
  bad(R"({"prompt": ""})", "prompt");
  bad(R"({"prompt": [1, -3]})", "prompt");
  bad(R"({"prompt": "a", "temperature": -1})", "temperature");
  bad(R"({"prompt": "a", "temperature": "hot"})", "temperature");
  bad(R"({"prompt": "a", "max_tokens": "many"})", "max_tokens");
  bad(R"({"prompt": "a", "max_tokens": -1})", "max_tokens");
  bad(R"({"prompt": "a", "max_tokens": 1000})", "max_tokens");  // past the 256-position context
  bad(R"({"prompt": [1, 2], "max_tokens": 99999999999})", "max_tokens");
  bad(json{{"prompt", std::string(3000, 'x')}}.dump(), "prompt");
  bad(R"({"prompt": ["a", "b"]})", "prompt");
  bad(R"({"prompt": "a", "top_p": 0})", "top_p");
  bad(R"({"prompt": "a", "n": 0})", "n");
  bad(R"({"prompt": "a", "n": 33})", "n");
  bad(R"({"prompt": "a", "stop": [""]})", "stop");
  bad(R"({"prompt": "a", "logprobs": 50})", "logprobs");
  bad(R"({"prompt": "a", "frequency_penalty": 3})", "frequency_penalty");
  bad(R"({"prompt": "a", "model": "gpt-4"})", "model", 404);
  bad("{\"prompt\": \"a\", \"x\": " + std::string(100000, '[') + std::string(100000, ']') + "}", "");  // nesting
  // Still serving.
  EXPECT_EQ(post(c, {{"prompt", "a"}, {"max_tokens", 2}}).at("choices").size(), 1u);
}

// A client that goes away mid-stream: its request is cancelled (its KV blocks freed) and the
// server answers the next client.
TEST_F(Served, ADisconnectedStreamIsCancelledAndTheServerKeepsServing) {
  {
    // A raw socket: send the request, read the first event, hang up.
    const int fd = open_stream(port_, {{"prompt", "Long"}, {"max_tokens", 200}, {"ignore_eos", true}, {"stream", true}});
    ASSERT_GE(fd, 0) << "no event came before the hang-up";
    close(fd);
  }
  for (int i = 0; i < 200 && engine_->stats().running > 0; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  EXPECT_EQ(engine_->stats().running, 0) << "the abandoned request still runs";
  EXPECT_EQ(engine_->stats().kv_blocks_in_use, 0);
  auto c = client();
  EXPECT_EQ(post(c, {{"prompt", "a"}, {"max_tokens", 3}, {"ignore_eos", true}}).at("usage").at("completion_tokens"), 3);
}

TEST_F(Served, ConcurrentClientsAllFinish) {
  std::vector<std::thread> clients;
  std::vector<int64_t> tokens(8, 0);
  for (int i = 0; i < 8; ++i)
    clients.emplace_back([&, i] {
      auto c = client();
      const json r = post(c, {{"prompt", "Client " + std::to_string(i)}, {"max_tokens", 16}, {"ignore_eos", true},
                              {"temperature", 0.8}, {"seed", i}});
      tokens[static_cast<size_t>(i)] = r.value("usage", json::object()).value("completion_tokens", int64_t{0});
    });
  for (auto& t : clients) t.join();
  for (int i = 0; i < 8; ++i) EXPECT_EQ(tokens[static_cast<size_t>(i)], 16) << "client " << i;
}

// The Prometheus text: metric name (with labels) -> value.
std::map<std::string, double> scrape(httplib::Client& c) {
  auto res = c.Get("/metrics");
  EXPECT_TRUE(res);
  std::map<std::string, double> out;
  if (!res) return out;
  EXPECT_EQ(res->status, 200);
  std::istringstream lines(res->body);
  std::string line;
  while (std::getline(lines, line)) {
    if (line.empty() || line[0] == '#') continue;
    const size_t space = line.rfind(' ');
    out[line.substr(0, space)] = std::stod(line.substr(space + 1));
  }
  return out;
}

TEST_F(Served, MetricsCountResponsesTokensAndTimings) {
  auto c = client();
  const auto before = scrape(c);
  const std::string ok = R"(kiln_http_responses_total{path="/v1/completions",status="200"})";
  const std::string bad = R"(kiln_http_responses_total{path="/v1/completions",status="400"})";
  auto value = [](const std::map<std::string, double>& m, const std::string& k) {
    auto it = m.find(k);
    return it == m.end() ? 0.0 : it->second;
  };
  for (int i = 0; i < 3; ++i) post(c, {{"prompt", "Metrics"}, {"max_tokens", 4}, {"ignore_eos", true}});
  for (int i = 0; i < 2; ++i) post(c, {{"prompt", "a"}, {"temperature", -1}}, 400);
  const auto after = scrape(c);
  EXPECT_EQ(value(after, ok) - value(before, ok), 3);
  EXPECT_EQ(value(after, bad) - value(before, bad), 2);
  EXPECT_EQ(value(after, "kiln_generation_tokens_total") - value(before, "kiln_generation_tokens_total"), 12);
  EXPECT_EQ(value(after, "kiln_time_to_first_token_seconds_count") - value(before, "kiln_time_to_first_token_seconds_count"), 3);
  EXPECT_EQ(value(after, R"(kiln_time_to_first_token_seconds_bucket{le="+Inf"})"),
            value(after, "kiln_time_to_first_token_seconds_count"));
  double previous = 0;
  for (const char* le : {"0.005", "0.01", "0.025", "0.05", "0.1", "0.25", "0.5", "1", "2.5", "+Inf"}) {
    const double v = value(after, fmt::format(R"(kiln_time_per_output_token_seconds_bucket{{le="{}"}})", le));
    EXPECT_GE(v, previous) << le << ": buckets are cumulative";
    previous = v;
  }
  EXPECT_EQ(value(after, "kiln_kv_blocks_used"), 0);
  EXPECT_EQ(value(after, "kiln_requests_running"), 0);
  EXPECT_GT(value(after, "kiln_kv_blocks_free"), 0);
}

// Chat: the messages rendered by the template (here ChatML, its rendering written out by hand), then
// encoded without added special tokens, generate what the engine generates for those ids.
TEST_F(Served, ChatEqualsTheEnginesOutputForTheRenderedPrompt) {
  const std::string prompt = kiln::testing::chatml_prompt({{"system", "Be brief."}, {"user", "Tell me a fortune."}});
  pipelines::GenerationRequest direct;
  direct.prompt_ids = engine_->tokenizer()->encode(prompt, false);
  direct.sampling.temperature = 0;
  direct.sampling.max_new_tokens = 12;
  const pipelines::GenerationOutput expected = engine_->generate(std::move(direct));

  auto c = client();
  const json request = {{"model", "kiln-tiny"},
                        {"messages", {{{"role", "system"}, {"content", "Be brief."}},
                                      {{"role", "user"}, {"content", {{{"type", "text"}, {"text", "Tell me a fortune."}}}}}}},
                        {"max_completion_tokens", 12},
                        {"temperature", 0}};
  auto res = c.Post("/v1/chat/completions", request.dump(), "application/json");
  ASSERT_TRUE(res);
  ASSERT_EQ(res->status, 200) << res->body;
  const json r = json::parse(res->body);
  EXPECT_EQ(r.at("object"), "chat.completion");
  EXPECT_EQ(r.at("id").get<std::string>().rfind("chatcmpl-", 0), 0u);
  const json& choice = r.at("choices").at(0);
  EXPECT_EQ(choice.at("message").at("role"), "assistant");
  EXPECT_EQ(choice.at("message").at("content"), expected.text);
  EXPECT_EQ(choice.at("finish_reason"), expected.finish == pipelines::FinishReason::stop ? "stop" : "length");
  EXPECT_EQ(r.at("usage").at("prompt_tokens"), static_cast<int64_t>(expected.metrics.prompt_tokens));
  EXPECT_EQ(r.at("usage").at("completion_tokens"), static_cast<int64_t>(expected.tokens.size()));

  // Streamed: the role first, then content pieces that concatenate to the same text, one finish.
  json streamed = request;
  streamed["stream"] = true;
  streamed["stream_options"] = {{"include_usage", true}};
  streamed["logprobs"] = true;
  streamed["top_logprobs"] = 2;
  auto sres = c.Post("/v1/chat/completions", streamed.dump(), "application/json");
  ASSERT_TRUE(sres);
  ASSERT_EQ(sres->status, 200) << sres->body;
  const std::vector<std::string> lines = events(sres->body);
  ASSERT_GE(lines.size(), 4u);
  EXPECT_EQ(lines.back(), "[DONE]");
  std::string text;
  int finishes = 0, logprob_entries = 0;
  for (size_t i = 0; i + 2 < lines.size(); ++i) {
    const json chunk = json::parse(lines[i]);
    EXPECT_EQ(chunk.at("object"), "chat.completion.chunk");
    const json& ch = chunk.at("choices").at(0);
    EXPECT_EQ(ch.at("delta").contains("role"), i == 0) << lines[i];
    text += ch.at("delta").value("content", "");
    if (!ch.at("finish_reason").is_null()) ++finishes;
    if (!ch.at("logprobs").is_null())
      for (const json& e : ch.at("logprobs").at("content")) {
        ++logprob_entries;
        EXPECT_LE(e.at("logprob").get<double>(), 0.0);
        EXPECT_EQ(e.at("top_logprobs").size(), 2u);
        const std::string token = e.at("token");
        EXPECT_EQ(e.at("bytes").size(), token.size());
      }
  }
  EXPECT_EQ(text, expected.text);
  EXPECT_EQ(finishes, 1);
  EXPECT_EQ(logprob_entries, static_cast<int>(expected.tokens.size()));
  EXPECT_EQ(json::parse(lines[lines.size() - 2]).at("usage").at("completion_tokens"),
            static_cast<int64_t>(expected.tokens.size()));
}

TEST_F(Served, BadChatRequestsAre400sNamingTheField) {
  auto c = client();
  auto bad = [&](const std::string& body, const std::string& param) {
    auto res = c.Post("/v1/chat/completions", body, "application/json");
    ASSERT_TRUE(res);
    EXPECT_EQ(res->status, 400) << body;
    const json e = json::parse(res->body).at("error");
    EXPECT_EQ(e.at("param"), param) << body << ": " << e.dump();
  };
  bad(R"({"prompt": "a"})", "messages");
  bad(R"({"messages": []})", "messages");
  bad(R"({"messages": "hi"})", "messages");
  bad(R"({"messages": [{"content": "hi"}]})", "messages[0].role");
  bad(R"({"messages": [{"role": "user"}]})", "messages[0].content");
  bad(R"({"messages": [{"role": "user", "content": 7}]})", "messages[0].content");
  bad(R"({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]})",
      "messages[0].content[0]");
  bad(R"({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 3})", "top_logprobs");
  bad(R"({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": -1})", "max_completion_tokens");
  bad(R"({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 1000})", "max_completion_tokens");
  bad(R"({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1000})", "max_tokens");
  bad(R"({"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_object"}})",
      "response_format");
  // A prompt past the context (256 positions here) names the messages.
  bad(json{{"messages", {{{"role", "user"}, {"content", std::string(3000, 'x')}}}}}.dump(), "messages");
  // Bytes that are not UTF-8 are not JSON.
  auto res = c.Post("/v1/chat/completions", "{\"messages\": [{\"role\": \"user\", \"content\": \"\xff\xfe\"}]}",
                    "application/json");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 400);
}

TEST(Server, ChatWithoutATemplateIsRefusedNamingTheFix) {
  auto engine = std::shared_ptr<pipelines::GenerationEngine>(
      pipelines::GenerationEngine::from_dir(kiln_tiny(), {.max_seq_len = 64, .max_num_seqs = 2}));
  serve::Server server(engine, {.port = 0});
  httplib::Client c("127.0.0.1", server.start());
  auto res = c.Post("/v1/chat/completions", R"({"messages": [{"role": "user", "content": "hi"}]})", "application/json");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 400);
  EXPECT_NE(res->body.find("--chat-template"), std::string::npos) << res->body;
}

// Long requests: stories15M's shape with random weights (and a longer context: RoPE takes any
// position) generates 2000 tokens in seconds. Without a tokenizer there is no text, so the requests
// ask for logprobs to have a chunk per token.
std::shared_ptr<pipelines::GenerationEngine> slow_engine(int64_t max_num_seqs) {
  nn::LlamaConfig config = *pipelines::named_config("stories15M");
  config.max_position_embeddings = 2048;
  return std::make_shared<pipelines::GenerationEngine>(
      config, pipelines::random_weights(config, 0), nullptr, std::vector<int64_t>{},
      pipelines::EngineOptions{.max_seq_len = 2048, .max_num_seqs = max_num_seqs});
}

const json kLong = {{"prompt", {1, 2, 3}}, {"max_tokens", 2000}, {"ignore_eos", true}, {"stream", true}, {"logprobs", 0}};

// Past max_concurrency + max_queue requests in flight, more are refused with 429 and Retry-After at
// once (no unbounded queue), /health and /metrics still answer, and once one ends a new one is taken.
TEST(Server, AFullServerAnswers429WithRetryAfterAndKeepsServing) {
  auto engine = slow_engine(1);
  serve::Server server(engine, {.port = 0, .max_concurrency = 1, .max_queue = 1});
  const int port = server.start();
  const int a = open_stream(port, kLong);
  ASSERT_GE(a, 0);
  // The second waits in the engine's queue behind the first (no event yet): submit it on a thread.
  std::thread second([&] {
    httplib::Client c("127.0.0.1", port);
    c.set_read_timeout(std::chrono::seconds(120));
    json body = kLong;
    body["max_tokens"] = 2;
    body["stream"] = false;
    auto res = c.Post("/v1/completions", body.dump(), "application/json");
    ASSERT_TRUE(res);
    EXPECT_EQ(res->status, 200) << res->body;
  });
  httplib::Client c("127.0.0.1", port);
  for (int i = 0; i < 500 && engine->stats().waiting < 1; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  ASSERT_EQ(engine->stats().waiting, 1);
  auto refused = c.Post("/v1/completions", R"({"prompt": [1], "max_tokens": 1})", "application/json");
  ASSERT_TRUE(refused);
  EXPECT_EQ(refused->status, 429) << refused->body;
  EXPECT_EQ(refused->get_header_value("Retry-After"), "1");
  EXPECT_EQ(json::parse(refused->body).at("error").at("type"), "rate_limit_error");
  EXPECT_EQ(c.Get("/health")->status, 200);
  EXPECT_EQ(c.Get("/metrics")->status, 200);
  close(a);  // the first hangs up: cancelled, and the queued one runs
  second.join();
  json again = kLong;
  again["stream"] = false;
  again["max_tokens"] = 3;
  auto res = c.Post("/v1/completions", again.dump(), "application/json");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 200) << res->body;
}

// shutdown(grace): new requests get 503 (and /health says draining) while those in flight may
// finish; past the grace they are cancelled, their streams end, and shutdown returns.
TEST(Server, ShutdownDrainsThenCancelsWhatIsLeft) {
  auto engine = slow_engine(2);
  serve::Server server(engine, {.port = 0, .max_concurrency = 2});
  const int port = server.start();
  const int a = open_stream(port, kLong);
  ASSERT_GE(a, 0);
  std::thread stopper([&] { server.shutdown(std::chrono::milliseconds(800)); });
  httplib::Client c("127.0.0.1", port);
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  auto refused = c.Post("/v1/completions", R"({"prompt": [1], "max_tokens": 1})", "application/json");
  ASSERT_TRUE(refused);
  EXPECT_EQ(refused->status, 503);
  EXPECT_EQ(refused->get_header_value("Retry-After"), "1");
  EXPECT_EQ(c.Get("/health")->status, 503);
  const std::string rest = read_rest(a);
  stopper.join();
  EXPECT_NE(rest.find("cancelled"), std::string::npos) << "the stream ends with an error event: " << rest.substr(0, 300);
  EXPECT_EQ(engine->stats().running, 0);
  EXPECT_EQ(engine->stats().kv_blocks_in_use, 0);
}

// Without SO_REUSEPORT: a second server on a port in use is refused, not handed half its clients.
TEST(Server, ASecondServerCannotTakeAPortInUse) {
  auto engine = std::shared_ptr<pipelines::GenerationEngine>(
      pipelines::GenerationEngine::from_dir(kiln_tiny(), {.max_seq_len = 64, .max_num_seqs = 2}));
  serve::Server first(engine, {.port = 0});
  const int port = first.start();
  serve::Server second(engine, {.port = port});
  EXPECT_THROW(second.start(), LoadError);
  httplib::Client c("127.0.0.1", port);
  EXPECT_EQ(c.Get("/health")->status, 200);
}

TEST(Server, AnApiKeyIsRequiredWhenSet) {
  auto engine = std::shared_ptr<pipelines::GenerationEngine>(pipelines::GenerationEngine::from_dir(kiln_tiny()));
  serve::Server server(engine, {.port = 0, .api_key = "secret"});
  const int port = server.start();
  httplib::Client c("127.0.0.1", port);
  auto refused = c.Get("/v1/models");
  ASSERT_TRUE(refused);
  EXPECT_EQ(refused->status, 401);
  auto allowed = c.Get("/v1/models", {{"Authorization", "Bearer secret"}});
  ASSERT_TRUE(allowed);
  EXPECT_EQ(allowed->status, 200);
  EXPECT_EQ(c.Get("/metrics")->status, 401);
  EXPECT_EQ(c.Post("/v1/chat/completions", "{}", "application/json")->status, 401);
  EXPECT_EQ(c.Get("/health")->status, 200) << "health needs no key";
}

}  // namespace
