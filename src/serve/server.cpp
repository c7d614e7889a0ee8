// The OpenAI-compatible server: request JSON -> GenerationRequest (every field checked, errors
// naming it), the engine's RequestStream -> server-sent events or one JSON response.
#include "kiln/serve/server.h"

#include <fmt/format.h>
#include <httplib.h>

#include <atomic>
#include <map>
#include <mutex>
#include <chrono>
#include <nlohmann/json.hpp>
#include <thread>

#include "kiln/errors.h"

namespace kiln::serve {

namespace {

using nlohmann::json;
using pipelines::FinishReason;
using pipelines::GenerationRequest;
using pipelines::RequestUpdate;

// A request the client got wrong: HTTP `status`, OpenAI's error body naming `param`.
struct ClientError : std::runtime_error {
  int status;
  std::string param;
  std::string type;
  ClientError(int status, std::string message, std::string param = {}, std::string type = "invalid_request_error")
      : std::runtime_error(std::move(message)), status(status), param(std::move(param)), type(std::move(type)) {}
};

json error_body(const std::string& message, const std::string& type, const std::string& param) {
  return {{"error",
           {{"message", message}, {"type", type}, {"param", param.empty() ? json(nullptr) : json(param)}, {"code", nullptr}}}};
}

void send_error(httplib::Response& res, const ClientError& e) {
  res.status = e.status;
  res.set_content(error_body(e.what(), e.type, e.param).dump(), "application/json");
}

// ---- request fields ---------------------------------------------------------------------------------

const json* field(const json& body, const char* name) {
  auto it = body.find(name);
  return it == body.end() || it->is_null() ? nullptr : &*it;
}

double number(const json& body, const char* name, double fallback, double lo, double hi) {
  const json* v = field(body, name);
  if (!v) return fallback;
  if (!v->is_number())
    throw ClientError(400, fmt::format("'{}' must be a number, got {}", name, v->dump()), name);
  const double x = v->get<double>();
  if (!(x >= lo && x <= hi))
    throw ClientError(400, fmt::format("'{}' must be in [{}, {}], got {}", name, lo, hi, x), name);
  return x;
}

int64_t integer(const json& body, const char* name, int64_t fallback, int64_t lo, int64_t hi) {
  const json* v = field(body, name);
  if (!v) return fallback;
  if (!v->is_number_integer())
    throw ClientError(400, fmt::format("'{}' must be an integer, got {}", name, v->dump()), name);
  const int64_t x = v->get<int64_t>();
  if (x < lo || x > hi) throw ClientError(400, fmt::format("'{}' must be in [{}, {}], got {}", name, lo, hi, x), name);
  return x;
}

bool boolean(const json& body, const char* name, bool fallback) {
  const json* v = field(body, name);
  if (!v) return fallback;
  if (!v->is_boolean()) throw ClientError(400, fmt::format("'{}' must be true or false, got {}", name, v->dump()), name);
  return v->get<bool>();
}

struct Completion {
  GenerationRequest request;
  int64_t n = 1;  // choices: n requests of the engine
  bool stream = false;
  bool include_usage = false;
  int64_t logprobs = -1;  // -1: none
};

// POST /v1/completions' body, as OpenAI's API reads it (with vLLM's and llama.cpp's extensions
// top_k, min_p, repetition_penalty, ignore_eos).
Completion parse_completion(const std::string& text, const std::string& model_name, int64_t vocab) {
  json body;
  try {
    body = json::parse(text);
  } catch (const json::exception& e) {
    throw ClientError(400, fmt::format("the body is not valid JSON: {}", e.what()));
  }
  if (!body.is_object()) throw ClientError(400, "the body must be a JSON object");
  Completion c;
  if (const json* m = field(body, "model"); m && (!m->is_string() || m->get<std::string>() != model_name))
    throw ClientError(404, fmt::format("model {} does not exist; this server serves '{}'", m->dump(), model_name),
                      "model", "not_found_error");
  const json* prompt = field(body, "prompt");
  if (!prompt) throw ClientError(400, "'prompt' is required", "prompt");
  if (prompt->is_array() && prompt->size() == 1 && (*prompt)[0].is_string()) prompt = &(*prompt)[0];
  if (prompt->is_string()) {
    c.request.prompt = prompt->get<std::string>();
    if (c.request.prompt.empty()) throw ClientError(400, "'prompt' is empty", "prompt");
  } else if (prompt->is_array() && !prompt->empty()) {
    for (const json& id : *prompt) {
      if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() >= vocab)
        throw ClientError(400, fmt::format("'prompt' token ids must be integers in [0, {}), got {}", vocab, id.dump()),
                          "prompt");
      c.request.prompt_ids.push_back(id.get<int64_t>());
    }
  } else {
    throw ClientError(400, "'prompt' must be a string, one string in an array, or an array of token ids", "prompt");
  }
  c.n = integer(body, "n", 1, 1, 32);
  if (boolean(body, "echo", false)) throw ClientError(400, "'echo' is not supported yet", "echo");
  pipelines::SamplingParams& s = c.request.sampling;
  s.max_new_tokens = integer(body, "max_tokens", 16, 0, int64_t{1} << 31);
  s.temperature = number(body, "temperature", 1.0, 0.0, 2.0);
  s.top_p = number(body, "top_p", 1.0, 0.0, 1.0);
  if (s.top_p == 0) throw ClientError(400, "'top_p' must be in (0, 1], got 0", "top_p");
  const int64_t top_k = integer(body, "top_k", 0, -1, int64_t{1} << 31);
  s.top_k = top_k < 0 ? 0 : top_k;  // vLLM: -1 is off
  s.min_p = number(body, "min_p", 0.0, 0.0, 1.0);
  s.presence_penalty = number(body, "presence_penalty", 0.0, -2.0, 2.0);
  s.frequency_penalty = number(body, "frequency_penalty", 0.0, -2.0, 2.0);
  s.repetition_penalty = number(body, "repetition_penalty", 1.0, 1e-6, 1e6);
  s.ignore_eos = boolean(body, "ignore_eos", false);
  if (const json* seed = field(body, "seed")) {
    if (!seed->is_number_integer()) throw ClientError(400, fmt::format("'seed' must be an integer, got {}", seed->dump()), "seed");
    s.seed = static_cast<uint64_t>(seed->get<int64_t>());
  } else {
    s.seed = std::nullopt;  // OpenAI: unseeded requests differ
  }
  if (const json* stop = field(body, "stop")) {
    if (stop->is_string()) {
      s.stop.push_back(stop->get<std::string>());
    } else if (stop->is_array()) {
      for (const json& one : *stop) {
        if (!one.is_string()) throw ClientError(400, "'stop' must be a string or an array of strings", "stop");
        s.stop.push_back(one.get<std::string>());
      }
    } else {
      throw ClientError(400, "'stop' must be a string or an array of strings", "stop");
    }
    for (const std::string& one : s.stop)
      if (one.empty()) throw ClientError(400, "'stop' strings must not be empty", "stop");
  }
  c.logprobs = integer(body, "logprobs", -1, 0, 20);
  if (const json* lp = field(body, "logprobs"); lp && lp->is_boolean())
    throw ClientError(400, "'logprobs' of /v1/completions is a count (0..20)", "logprobs");
  if (c.logprobs >= 0) {
    s.logprobs = true;
    s.top_logprobs = c.logprobs;
  }
  c.stream = boolean(body, "stream", false);
  if (const json* options = field(body, "stream_options")) {
    if (!options->is_object()) throw ClientError(400, "'stream_options' must be an object", "stream_options");
    c.include_usage = boolean(*options, "include_usage", false);
  }
  return c;
}

const char* finish_name(FinishReason f) { return f == FinishReason::stop ? "stop" : "length"; }

// A Prometheus histogram: counts per upper bound (cumulative when printed), sum and count.
struct Histogram {
  std::vector<double> bounds;
  std::vector<int64_t> counts;  // per bound, not cumulative; the last is +Inf
  double sum = 0;
  int64_t count = 0;
  explicit Histogram(std::vector<double> b) : bounds(std::move(b)), counts(bounds.size() + 1, 0) {}
  void observe(double v) {
    size_t i = 0;
    while (i < bounds.size() && v > bounds[i]) ++i;
    ++counts[i];
    sum += v;
    ++count;
  }
  void print(std::string& out, const char* name, const char* help) const {
    out += fmt::format("# HELP {} {}\n# TYPE {} histogram\n", name, help, name);
    int64_t cumulative = 0;
    for (size_t i = 0; i < bounds.size(); ++i) {
      cumulative += counts[i];
      out += fmt::format("{}_bucket{{le=\"{}\"}} {}\n", name, bounds[i], cumulative);
    }
    out += fmt::format("{}_bucket{{le=\"+Inf\"}} {}\n{}_sum {}\n{}_count {}\n", name, count, name, sum, name, count);
  }
};

int64_t unix_time() {
  return std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count();
}

}  // namespace

// ---- the server ---------------------------------------------------------------------------------------

struct Server::Impl {
  std::shared_ptr<pipelines::GenerationEngine> engine;
  ServerOptions options;
  httplib::Server http;
  std::thread thread;
  int port = 0;

  // /metrics, under metrics_mutex.
  std::mutex metrics_mutex;
  std::map<std::pair<std::string, int>, int64_t> responses;  // (path, status) -> count
  Histogram ttft{{0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60}};
  Histogram tpot{{0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5}};

  // Counted as each handler returns, before the response is written (a client that reads it and
  // scrapes /metrics at once finds it counted).
  struct Counted {
    Impl& impl;
    const char* path;
    const httplib::Response& res;
    ~Counted() {
      std::lock_guard lock(impl.metrics_mutex);
      ++impl.responses[{path, res.status == -1 ? 200 : res.status}];  // -1: unset, which httplib sends as 200
    }
  };

  // A request's timings, once it has finished well.
  void observe(const RequestUpdate& last) {
    if (!last.finish || *last.finish == FinishReason::error || *last.finish == FinishReason::cancelled) return;
    const pipelines::RequestMetrics& m = last.metrics;
    if (m.generated_tokens < 1) return;
    std::lock_guard lock(metrics_mutex);
    ttft.observe(m.first_token_s);
    if (m.generated_tokens > 1)
      tpot.observe((m.finish_s - m.first_token_s) / static_cast<double>(m.generated_tokens - 1));
  }

  std::string metrics_text() {
    const pipelines::EngineStats st = engine->stats();
    std::string out;
    auto gauge = [&](const char* name, const char* help, const char* type, double value) {
      out += fmt::format("# HELP {} {}\n# TYPE {} {}\n{} {}\n", name, help, name, type, name, value);
    };
    {
      std::lock_guard lock(metrics_mutex);
      out += "# HELP kiln_http_responses_total HTTP responses by path and status.\n"
             "# TYPE kiln_http_responses_total counter\n";
      for (const auto& [key, count] : responses)
        out += fmt::format("kiln_http_responses_total{{path=\"{}\",status=\"{}\"}} {}\n", key.first, key.second, count);
      ttft.print(out, "kiln_time_to_first_token_seconds", "Time from a request's arrival to its first token.");
      tpot.print(out, "kiln_time_per_output_token_seconds", "Time per token after a request's first.");
    }
    gauge("kiln_prompt_tokens_total", "Prompt tokens of finished requests.", "counter", static_cast<double>(st.prompt_tokens));
    gauge("kiln_prompt_tokens_cached_total", "Of those, taken from the prefix cache.", "counter",
          static_cast<double>(st.cached_prompt_tokens));
    gauge("kiln_generation_tokens_total", "Tokens generated by finished requests.", "counter",
          static_cast<double>(st.generated_tokens));
    gauge("kiln_requests_waiting", "Requests queued for admission.", "gauge", static_cast<double>(st.waiting));
    gauge("kiln_requests_running", "Requests in the running batch.", "gauge", static_cast<double>(st.running));
    gauge("kiln_kv_blocks_used", "KV cache blocks in use.", "gauge", static_cast<double>(st.kv_blocks_in_use));
    gauge("kiln_kv_blocks_free", "KV cache blocks free (cached ones included).", "gauge",
          static_cast<double>(st.kv_blocks_total - st.kv_blocks_in_use));
    gauge("kiln_kv_blocks_cached", "Free KV blocks still holding a cached prefix.", "gauge",
          static_cast<double>(st.kv_blocks_cached));
    gauge("kiln_preemptions_total", "Sequences preempted for KV space.", "counter", static_cast<double>(st.preemptions));
    gauge("kiln_engine_steps_total", "Engine steps run.", "counter", static_cast<double>(st.steps));
    return out;
  }

  Impl(std::shared_ptr<pipelines::GenerationEngine> e, ServerOptions o) : engine(std::move(e)), options(std::move(o)) {}

  bool authorized(const httplib::Request& req, httplib::Response& res) const {
    if (!options.api_key) return true;
    if (req.get_header_value("Authorization") == "Bearer " + *options.api_key) return true;
    send_error(res, ClientError(401, "a valid API key is required (Authorization: Bearer <key>)", {},
                                "authentication_error"));
    return false;
  }

  // The text of one token as the completions API's logprobs list it.
  std::string token_text(int64_t id) const {
    const pipelines::Tokenizer* tok = engine->tokenizer();
    return tok ? pipelines::output_bytes(*tok, id) : std::to_string(id);
  }

  json logprobs_json(const std::vector<pipelines::GeneratedToken>& tokens, int64_t& offset) const {
    json out = {{"tokens", json::array()}, {"token_logprobs", json::array()}, {"top_logprobs", json::array()},
                {"text_offset", json::array()}};
    for (const auto& t : tokens) {
      const std::string text = token_text(t.id);
      out["tokens"].push_back(text);
      out["token_logprobs"].push_back(t.logprob);
      json top = json::object();
      for (const auto& [id, lp] : t.top_logprobs) top[token_text(id)] = lp;
      out["top_logprobs"].push_back(top);
      out["text_offset"].push_back(offset);
      offset += static_cast<int64_t>(text.size());
    }
    return out;
  }

  static json choice(size_t index, const std::string& text, const json& logprobs,
                     const std::optional<FinishReason>& finish) {
    return {{"index", index},
            {"text", text},
            {"logprobs", logprobs},
            {"finish_reason", finish ? json(finish_name(*finish)) : json(nullptr)}};
  }

  json chunk(const std::string& id, int64_t created, json choices) const {
    return {{"id", id},
            {"object", "text_completion"},
            {"created", created},
            {"model", options.model_name},
            {"choices", std::move(choices)}};
  }

  // The prompt counted once, the choices' tokens summed.
  static json usage(const std::vector<pipelines::RequestMetrics>& choices) {
    const int64_t prompt = choices.empty() ? 0 : choices[0].prompt_tokens;
    int64_t completion = 0;
    for (const auto& m : choices) completion += m.generated_tokens;
    return {{"prompt_tokens", prompt}, {"completion_tokens", completion}, {"total_tokens", prompt + completion}};
  }

  static bool failed(const RequestUpdate& u) {
    return !u.finish || *u.finish == FinishReason::error || *u.finish == FinishReason::cancelled;
  }

  void completions(const httplib::Request& req, httplib::Response& res) {
    Counted counted{*this, "/v1/completions", res};
    if (!authorized(req, res)) return;
    Completion c;
    try {
      c = parse_completion(req.body, options.model_name, engine->config().vocab_size);
    } catch (const ClientError& e) {
      return send_error(res, e);
    }
    // n choices are n requests of the engine, submitted together; choice i is seeded seed + i.
    using Stream = std::shared_ptr<pipelines::RequestStream>;
    std::vector<Stream> streams;
    try {
      for (int64_t i = 0; i < c.n; ++i) {
        GenerationRequest one = c.request;
        if (one.sampling.seed) *one.sampling.seed += static_cast<uint64_t>(i);
        streams.push_back(std::make_shared<pipelines::RequestStream>(engine->stream(std::move(one))));
      }
    } catch (const ValueError& e) {  // the engine's own checks (prompt length, top_k cap, ...)
      for (const Stream& st : streams) engine->cancel(st->id());
      return send_error(res, ClientError(400, e.what()));
    }
    const std::string id = fmt::format("cmpl-{}", streams[0]->id());
    const int64_t created = unix_time();
    if (!c.stream) {
      json choices = json::array();
      std::vector<pipelines::RequestMetrics> metrics;
      for (size_t i = 0; i < streams.size(); ++i) {
        std::string text;
        std::vector<pipelines::GeneratedToken> tokens;
        RequestUpdate last;
        while (auto u = streams[i]->next(std::chrono::hours(24))) {
          text += u->text;
          tokens.insert(tokens.end(), u->tokens.begin(), u->tokens.end());
          last = std::move(*u);
          if (last.finish) break;
        }
        if (failed(last)) {
          for (const Stream& st : streams) engine->cancel(st->id());
          res.status = 500;
          res.set_content(
              error_body(last.error.empty() ? "generation did not finish" : last.error, "server_error", {}).dump(),
              "application/json");
          return;
        }
        observe(last);
        int64_t offset = 0;
        choices.push_back(choice(i, text, c.logprobs >= 0 ? logprobs_json(tokens, offset) : json(nullptr), last.finish));
        metrics.push_back(last.metrics);
      }
      json body = chunk(id, created, std::move(choices));
      body["usage"] = usage(metrics);
      res.set_content(body.dump(), "application/json");
      return;
    }
    // Server-sent events: one chunk per update of a choice, its finish reason on its last, then
    // (with include_usage) the usage chunk, then [DONE]. A client gone away cancels every choice.
    struct Progress {
      std::vector<int64_t> offsets;
      std::vector<bool> finished;
      std::vector<pipelines::RequestMetrics> metrics;
      size_t remaining = 0;
    };
    auto progress = std::make_shared<Progress>();
    progress->offsets.assign(streams.size(), 0);
    progress->finished.assign(streams.size(), false);
    progress->metrics.resize(streams.size());
    progress->remaining = streams.size();
    auto engine_ref = engine;
    auto cancel_all = [engine_ref, streams] {
      for (const Stream& st : streams) engine_ref->cancel(st->id());
    };
    res.set_header("Cache-Control", "no-cache");
    res.set_chunked_content_provider(
        "text/event-stream",
        [this, streams, id, created, c, progress, cancel_all](size_t, httplib::DataSink& sink) {
          auto send = [&](const json& j) {
            const std::string event = "data: " + j.dump() + "\n\n";
            return sink.write(event.data(), event.size());
          };
          bool progressed = false;
          for (size_t i = 0; i < streams.size(); ++i) {
            if (progress->finished[i]) continue;
            // Wait a little on the first choice with nothing new, not at all once one had news.
            std::optional<RequestUpdate> u = streams[i]->next(std::chrono::milliseconds(progressed ? 0 : 50));
            if (!u) continue;
            progressed = true;
            if (u->finish && failed(*u)) {
              send(error_body(u->error.empty() ? "the request was cancelled" : u->error, "server_error", {}));
            } else if (!u->text.empty() || !u->tokens.empty() || u->finish) {
              const json lp = c.logprobs >= 0 ? logprobs_json(u->tokens, progress->offsets[i]) : json(nullptr);
              if (!send(chunk(id, created, json::array({choice(i, u->text, lp, u->finish)})))) {
                cancel_all();
                return false;
              }
            }
            if (u->finish) {
              observe(*u);
              progress->finished[i] = true;
              progress->metrics[i] = u->metrics;
              --progress->remaining;
            }
          }
          if (!progressed && sink.is_writable && !sink.is_writable()) {
            cancel_all();
            return false;
          }
          if (progress->remaining > 0) return true;  // called again
          if (c.include_usage) {
            json usage_chunk = chunk(id, created, json::array());
            usage_chunk["usage"] = usage(progress->metrics);
            send(usage_chunk);
          }
          const std::string done = "data: [DONE]\n\n";
          sink.write(done.data(), done.size());
          sink.done();
          return true;
        },
        [cancel_all](bool success) {
          if (!success) cancel_all();  // the connection ended early
        });
  }

  void routes() {
    http.set_payload_max_length(static_cast<size_t>(options.max_body_bytes));
    const int threads = std::max(1, options.max_concurrency);
    http.new_task_queue = [threads] { return new httplib::ThreadPool(static_cast<size_t>(threads)); };
    http.Get("/health", [this](const httplib::Request&, httplib::Response& res) {
      Counted counted{*this, "/health", res};
      res.set_content(R"({"status":"ok"})", "application/json");
    });
    http.Get("/v1/models", [this](const httplib::Request& req, httplib::Response& res) {
      Counted counted{*this, "/v1/models", res};
      if (!authorized(req, res)) return;
      const json body = {{"object", "list"},
                         {"data", json::array({{{"id", options.model_name},
                                                {"object", "model"},
                                                {"created", unix_time()},
                                                {"owned_by", "kiln"},
                                                {"max_model_len", engine->max_seq_len()}}})}};
      res.set_content(body.dump(), "application/json");
    });
    http.Post("/v1/completions",
              [this](const httplib::Request& req, httplib::Response& res) { completions(req, res); });
    http.Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
      Counted counted{*this, "/metrics", res};
      res.set_content(metrics_text(), "text/plain; version=0.0.4");
    });

    http.set_error_handler([this](const httplib::Request& req, httplib::Response& res) {
      if (!res.body.empty()) return;  // a handler's own error, counted there
      {
        std::lock_guard lock(metrics_mutex);
        ++responses[{"other", res.status}];  // no route (or a body too large): not a label of its own
      }
      const std::string message = res.status == 404   ? fmt::format("no route {} {}", req.method, req.path)
                                  : res.status == 413 ? "the request body is too large"
                                                      : fmt::format("HTTP {}", res.status);
      res.set_content(error_body(message, "invalid_request_error", {}).dump(), "application/json");
    });
    http.set_exception_handler([](const httplib::Request&, httplib::Response& res, std::exception_ptr ep) {
      std::string message = "internal error";
      try {
        std::rethrow_exception(ep);
      } catch (const std::exception& e) {
        message = e.what();
      } catch (...) {
      }
      res.status = 500;
      res.set_content(error_body(message, "server_error", {}).dump(), "application/json");
    });
  }
};

Server::Server(std::shared_ptr<pipelines::GenerationEngine> engine, ServerOptions options)
    : impl_(std::make_unique<Impl>(std::move(engine), std::move(options))) {
  if (!impl_->engine) throw ValueError("serve::Server: no engine");
  impl_->routes();
}

Server::~Server() { stop(); }

namespace {

int bind(Server::Impl& s) {
  if (s.port > 0) return s.port;
  const int port = s.options.port == 0 ? s.http.bind_to_any_port(s.options.host)
                                       : (s.http.bind_to_port(s.options.host, s.options.port) ? s.options.port : -1);
  if (port < 0)
    throw LoadError(fmt::format("kiln serve: cannot listen on {}:{}", s.options.host, s.options.port));
  s.port = port;
  return port;
}

}  // namespace

int Server::start() {
  Impl& s = *impl_;
  const int port = bind(s);
  s.thread = std::thread([&s] { s.http.listen_after_bind(); });
  return port;
}

void Server::run() {
  bind(*impl_);
  impl_->http.listen_after_bind();
}

void Server::stop() {
  impl_->http.stop();
  if (impl_->thread.joinable()) impl_->thread.join();
}

}  // namespace kiln::serve
