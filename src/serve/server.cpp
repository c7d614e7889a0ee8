// The OpenAI-compatible server: request JSON -> GenerationRequest (every field checked, errors
// naming it), the engine's RequestStream -> server-sent events or one JSON response.
#include "kiln/serve/server.h"

#include <fmt/format.h>
#include <httplib.h>

#include <sys/socket.h>

#include <chrono>
#include <condition_variable>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <set>
#include <thread>

#include "kiln/errors.h"
#include "pipelines/json_input.h"
#include "serve/request_parse.h"

namespace kiln::serve {

namespace {

using json = nlohmann::ordered_json;  // keys in the order sent: templates print them (tojson)
using pipelines::json_input::describe;  // a value in a message, cut short
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

// JSON text; bytes that are not UTF-8 (a token holding part of a character) become U+FFFD.
std::string dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

void send_error(httplib::Response& res, const ClientError& e) {
  res.status = e.status;
  res.set_content(dump(error_body(e.what(), e.type, e.param)), "application/json");
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
    throw ClientError(400, fmt::format("'{}' must be a number, got {}", name, describe(*v)), name);
  const double x = v->get<double>();
  if (!(x >= lo && x <= hi))
    throw ClientError(400, fmt::format("'{}' must be in [{}, {}], got {}", name, lo, hi, x), name);
  return x;
}

int64_t integer(const json& body, const char* name, int64_t fallback, int64_t lo, int64_t hi) {
  const json* v = field(body, name);
  if (!v) return fallback;
  if (!v->is_number_integer())
    throw ClientError(400, fmt::format("'{}' must be an integer, got {}", name, describe(*v)), name);
  const int64_t x = v->get<int64_t>();
  if (x < lo || x > hi) throw ClientError(400, fmt::format("'{}' must be in [{}, {}], got {}", name, lo, hi, x), name);
  return x;
}

bool boolean(const json& body, const char* name, bool fallback) {
  const json* v = field(body, name);
  if (!v) return fallback;
  if (!v->is_boolean()) throw ClientError(400, fmt::format("'{}' must be true or false, got {}", name, describe(*v)), name);
  return v->get<bool>();
}

enum class Api { completions, chat };

// A request of either API, as the engine will run it.
struct Parsed {
  Api api = Api::completions;
  GenerationRequest request;  // choice 0's; choice i is seeded seed + i
  int64_t n = 1;
  bool stream = false;
  bool include_usage = false;
  bool logprobs = false;
  int64_t top_logprobs = 0;
  const char* max_tokens_field = "max_tokens";  // or chat's max_completion_tokens
  bool max_tokens_given = false;
};

// Outside JSON as every loader reads it (pipelines/json_input): nesting past 64 is refused while
// parsing, and invalid UTF-8 is refused; a repeated key keeps the last, as OpenAI's server does.
json parse_body(const std::string& text, const std::string& model_name) {
  json body;
  try {
    body = pipelines::json_input::parse_ordered(text, "the body", {.max_depth = 64, .reject_duplicate_keys = false});
  } catch (const LoadError& e) {
    throw ClientError(400, e.what());
  }
  if (!body.is_object()) throw ClientError(400, "the body must be a JSON object");
  if (const json* m = field(body, "model"); m && (!m->is_string() || m->get<std::string>() != model_name))
    throw ClientError(404, fmt::format("model {} does not exist; this server serves '{}'", describe(*m), model_name),
                      "model", "not_found_error");
  return body;
}

// The fields both APIs share: n, the sampling parameters (OpenAI's, and vLLM's and llama.cpp's
// extensions top_k, min_p, repetition_penalty, ignore_eos), stop, seed, stream.
void parse_common(const json& body, Parsed& p) {
  p.n = integer(body, "n", 1, 1, 32);
  pipelines::SamplingParams& s = p.request.sampling;
  const char* max_name = p.api == Api::chat && field(body, "max_completion_tokens") ? "max_completion_tokens" : "max_tokens";
  p.max_tokens_field = max_name;
  p.max_tokens_given = field(body, max_name) != nullptr;
  s.max_new_tokens = integer(body, max_name, 16, 0, int64_t{1} << 31);
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
    if (!seed->is_number_integer()) throw ClientError(400, fmt::format("'seed' must be an integer, got {}", describe(*seed)), "seed");
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
  p.stream = boolean(body, "stream", false);
  if (const json* options = field(body, "stream_options")) {
    if (!options->is_object()) throw ClientError(400, "'stream_options' must be an object", "stream_options");
    p.include_usage = boolean(*options, "include_usage", false);
  }
  if (const json* format = field(body, "response_format");
      format && !(format->is_object() && format->value("type", json()) == "text"))
    throw ClientError(400, "only 'response_format' {\"type\": \"text\"} is supported", "response_format");
}

// POST /v1/completions' body.
Parsed parse_completion(const std::string& text, const std::string& model_name, int64_t vocab) {
  const json body = parse_body(text, model_name);
  Parsed p;
  p.api = Api::completions;
  const json* prompt = field(body, "prompt");
  if (!prompt) throw ClientError(400, "'prompt' is required", "prompt");
  if (prompt->is_array() && prompt->size() == 1 && (*prompt)[0].is_string()) prompt = &(*prompt)[0];
  if (prompt->is_string()) {
    p.request.prompt = prompt->get<std::string>();
    if (p.request.prompt.empty()) throw ClientError(400, "'prompt' is empty", "prompt");
  } else if (prompt->is_array() && !prompt->empty()) {
    if ((*prompt)[0].is_string() || (*prompt)[0].is_array())
      throw ClientError(400, "'prompt' as several prompts (a batch) is not supported: send one request per prompt",
                        "prompt");
    for (const json& id : *prompt) {
      if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() >= vocab)
        throw ClientError(400, fmt::format("'prompt' token ids must be integers in [0, {}), got {}", vocab, describe(id)),
                          "prompt");
      p.request.prompt_ids.push_back(id.get<int64_t>());
    }
  } else {
    throw ClientError(400, "'prompt' must be a string, one string in an array, or an array of token ids", "prompt");
  }
  if (boolean(body, "echo", false)) throw ClientError(400, "'echo' is not supported yet", "echo");
  parse_common(body, p);
  const int64_t logprobs = integer(body, "logprobs", -1, 0, 20);
  if (const json* lp = field(body, "logprobs"); lp && lp->is_boolean())
    throw ClientError(400, "'logprobs' of /v1/completions is a count (0..20)", "logprobs");
  if (logprobs >= 0) {
    p.logprobs = true;
    p.top_logprobs = logprobs;
  }
  p.request.sampling.logprobs = p.logprobs;
  p.request.sampling.top_logprobs = p.top_logprobs;
  return p;
}

// A message's content as the template gets it: a string, or the text parts of an array joined by
// newlines (as vLLM does for templates that take strings); images and audio are refused.
std::string message_content(const json& content, const std::string& where) {
  if (content.is_string()) return content.get<std::string>();
  if (!content.is_array())
    throw ClientError(400, fmt::format("'{}' must be a string or an array of content parts", where), where);
  std::string out;
  for (size_t j = 0; j < content.size(); ++j) {
    const json& part = content[j];
    const std::string at = fmt::format("{}[{}]", where, j);
    if (!part.is_object() || part.value("type", json()) != "text" || !part.contains("text") || !part["text"].is_string())
      throw ClientError(400, fmt::format("'{}' must be {{\"type\": \"text\", \"text\": \"...\"}} (only text is supported)", at),
                        at);
    if (!out.empty()) out += '\n';
    out += part["text"].get<std::string>();
  }
  return out;
}

// POST /v1/chat/completions' body: the messages rendered with the chat template, then encoded as
// Hugging Face's apply_chat_template does (no special tokens added: the template writes them).
Parsed parse_chat(const std::string& text, const std::string& model_name, const pipelines::ChatTemplate* chat_template,
                  const pipelines::Tokenizer* tokenizer) {
  const json body = parse_body(text, model_name);
  Parsed p;
  p.api = Api::chat;
  const json* messages = field(body, "messages");
  if (!messages) throw ClientError(400, "'messages' is required", "messages");
  if (!messages->is_array() || messages->empty())
    throw ClientError(400, "'messages' must be a non-empty array of messages", "messages");
  json context = {{"messages", json::array()}};
  for (size_t i = 0; i < messages->size(); ++i) {
    const json& m = (*messages)[i];
    const std::string at = fmt::format("messages[{}]", i);
    if (!m.is_object()) throw ClientError(400, fmt::format("'{}' must be an object", at), at);
    const json* role = field(m, "role");
    if (!role || !role->is_string() || role->get<std::string>().empty())
      throw ClientError(400, fmt::format("'{}.role' must be a non-empty string", at), at + ".role");
    json message = m;  // name, tool_calls, tool_call_id, ... as the client sent them
    const json* content = field(m, "content");
    if (content) {
      message["content"] = message_content(*content, at + ".content");
    } else if (!field(m, "tool_calls")) {
      throw ClientError(400, fmt::format("'{}.content' is required", at), at + ".content");
    }
    context["messages"].push_back(std::move(message));
  }
  context["add_generation_prompt"] = boolean(body, "add_generation_prompt", true);
  if (const json* tools = field(body, "tools")) {
    if (!tools->is_array()) throw ClientError(400, "'tools' must be an array", "tools");
    context["tools"] = *tools;
  }
  if (const json* kwargs = field(body, "chat_template_kwargs")) {  // vLLM's: enable_thinking, ...
    if (!kwargs->is_object()) throw ClientError(400, "'chat_template_kwargs' must be an object", "chat_template_kwargs");
    for (const auto& [key, value] : kwargs->items())
      if (!context.contains(key)) context[key] = value;
  }
  parse_common(body, p);
  p.logprobs = boolean(body, "logprobs", false);
  p.top_logprobs = integer(body, "top_logprobs", 0, 0, 20);
  if (p.top_logprobs > 0 && !p.logprobs)
    throw ClientError(400, "'top_logprobs' needs 'logprobs': true", "top_logprobs");
  p.request.sampling.logprobs = p.logprobs;
  p.request.sampling.top_logprobs = p.top_logprobs;
  if (!chat_template)
    throw ClientError(400, "this model has no chat template (start kiln serve with --chat-template FILE)", "messages");
  if (!tokenizer) throw ClientError(400, "this model has no tokenizer, so it cannot chat", "messages");
  std::string prompt;
  try {
    prompt = chat_template->render(context.dump());
  } catch (const ValueError& e) {
    throw ClientError(400, fmt::format("the chat template refused the messages: {}", e.what()), "messages");
  }
  p.request.prompt_ids = tokenizer->encode(prompt, /*add_special_tokens=*/false);
  if (p.request.prompt_ids.empty()) throw ClientError(400, "the rendered chat prompt is empty", "messages");
  return p;
}

}  // namespace

int detail::parse_request_status(bool chat, const std::string& body, const std::string& model_name, int64_t vocab,
                                 const pipelines::ChatTemplate* chat_template, const pipelines::Tokenizer* tokenizer) {
  try {
    if (chat)
      parse_chat(body, model_name, chat_template, tokenizer);
    else
      parse_completion(body, model_name, vocab);
    return 200;
  } catch (const ClientError& e) {
    return e.status;
  }
}

namespace {

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

  // The text of one token as the logprobs list it.
  std::string token_text(int64_t id) const {
    const pipelines::Tokenizer* tok = engine->tokenizer();
    return tok ? pipelines::output_bytes(*tok, id) : std::to_string(id);
  }

  // Completions' logprobs: parallel lists, text offsets counted from the choice's start.
  json completion_logprobs(const std::vector<pipelines::GeneratedToken>& tokens, int64_t& offset) const {
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

  // Chat's logprobs: one entry per token, with its bytes (a token may hold part of a character).
  json chat_logprobs(const std::vector<pipelines::GeneratedToken>& tokens) const {
    auto entry = [&](int64_t id, float logprob) {
      const std::string text = token_text(id);
      return json{{"token", text},
                  {"logprob", logprob},
                  {"bytes", std::vector<int>(reinterpret_cast<const unsigned char*>(text.data()),
                                             reinterpret_cast<const unsigned char*>(text.data()) + text.size())}};
    };
    json content = json::array();
    for (const auto& t : tokens) {
      json one = entry(t.id, t.logprob);
      one["top_logprobs"] = json::array();
      for (const auto& [id, lp] : t.top_logprobs) one["top_logprobs"].push_back(entry(id, lp));
      content.push_back(std::move(one));
    }
    return {{"content", std::move(content)}};
  }

  // The response object around choices (a whole response, or one chunk of a stream).
  json envelope(const Parsed& p, const std::string& id, int64_t created, json choices, bool chunk) const {
    const char* object = p.api == Api::completions ? "text_completion" : chunk ? "chat.completion.chunk" : "chat.completion";
    return {{"id", id},
            {"object", object},
            {"created", created},
            {"model", options.model_name},
            {"choices", std::move(choices)}};
  }

  // One choice, whole or as a stream's delta: text and logprobs new since the last, its finish
  // reason on its last. `first` (chat streams) carries the assistant role.
  json choice(const Parsed& p, size_t index, const std::string& text, const std::vector<pipelines::GeneratedToken>& tokens,
              int64_t& offset, const std::optional<FinishReason>& finish, bool chunk, bool first) const {
    json logprobs = nullptr;
    if (p.logprobs) logprobs = p.api == Api::completions ? completion_logprobs(tokens, offset) : chat_logprobs(tokens);
    json out = {{"index", index}, {"logprobs", std::move(logprobs)},
                {"finish_reason", finish ? json(finish_name(*finish)) : json(nullptr)}};
    if (p.api == Api::completions) {
      out["text"] = text;
    } else if (!chunk) {
      out["message"] = {{"role", "assistant"}, {"content", text}};
    } else {
      json delta = json::object();
      if (first) delta["role"] = "assistant";
      if (!text.empty() || first) delta["content"] = text;
      out["delta"] = std::move(delta);
    }
    return out;
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

  // ---- requests in flight: bounded (429 past the limit), drained by shutdown() ----

  std::mutex flight_mutex;
  std::condition_variable flight_changed;
  std::set<pipelines::RequestId> in_flight;  // engine requests of live HTTP requests
  bool draining = false;

  // An HTTP request's engine requests, released from in_flight when the handler (or, streaming,
  // its content provider) lets go of it.
  struct Flight {
    Impl& impl;
    std::vector<std::shared_ptr<pipelines::RequestStream>> streams;
    explicit Flight(Impl& i) : impl(i) {}
    ~Flight() {
      for (const auto& st : streams) impl.engine->cancel(st->id());  // no-op for finished ones
      std::lock_guard lock(impl.flight_mutex);
      for (const auto& st : streams) impl.in_flight.erase(st->id());
      impl.flight_changed.notify_all();
    }
    void cancel() const {
      for (const auto& st : streams) impl.engine->cancel(st->id());
    }
  };

  // Encodes a text prompt (as the engine would) to check it and max_tokens against the context
  // before any work: a prompt that fills it, or an explicit max_tokens past it, is a 400. Unset,
  // max_tokens is 16 for completions and the rest of the context for chat, either cut to fit.
  void fit_context(Parsed& p) const {
    const char* prompt_field = p.api == Api::chat ? "messages" : "prompt";
    if (!p.request.prompt.empty()) {
      const pipelines::Tokenizer* tokenizer = engine->tokenizer();
      if (!tokenizer) throw ClientError(400, "this model has no tokenizer: give 'prompt' as token ids", "prompt");
      p.request.prompt_ids = tokenizer->encode(p.request.prompt);
      p.request.prompt.clear();
    }
    const int64_t prompt_len = static_cast<int64_t>(p.request.prompt_ids.size());
    const int64_t context = engine->max_seq_len();
    if (prompt_len >= context)
      throw ClientError(400, fmt::format("the prompt ('{}') is {} tokens, which leaves no room in the context of {}",
                                         prompt_field, prompt_len, context),
                        prompt_field);
    int64_t& max_new = p.request.sampling.max_new_tokens;
    if (!p.max_tokens_given) {
      max_new = p.api == Api::chat ? context - prompt_len : std::min(max_new, context - prompt_len);
    } else if (prompt_len + max_new > context) {
      throw ClientError(400, fmt::format("'{}' is {}, but the prompt's {} tokens leave room for {} in the context of {}",
                                         p.max_tokens_field, max_new, prompt_len, context - prompt_len, context),
                        p.max_tokens_field);
    }
  }

  // Submits the n choices (seeded seed + i) unless the server is draining or full.
  std::shared_ptr<Flight> admit(const Parsed& p) {
    auto flight = std::make_shared<Flight>(*this);
    std::lock_guard lock(flight_mutex);
    if (draining) throw ClientError(503, "the server is shutting down", {}, "server_error");
    const size_t limit = static_cast<size_t>(options.max_concurrency) + static_cast<size_t>(std::max(0, options.max_queue));
    if (in_flight.size() + static_cast<size_t>(p.n) > limit)
      throw ClientError(429, fmt::format("the server is busy ({} requests in flight, at most {}); retry later", in_flight.size(), limit),
                        {}, "rate_limit_error");
    try {
      for (int64_t i = 0; i < p.n; ++i) {
        GenerationRequest one = p.request;
        if (one.sampling.seed) *one.sampling.seed += static_cast<uint64_t>(i);
        flight->streams.push_back(std::make_shared<pipelines::RequestStream>(engine->stream(std::move(one))));
        in_flight.insert(flight->streams.back()->id());
      }
    } catch (const ValueError& e) {  // the engine's own checks (fit_context took the prompt's)
      throw ClientError(400, e.what());
    }
    return flight;
  }

  void generate(Api api, const httplib::Request& req, httplib::Response& res) {
    Counted counted{*this, api == Api::completions ? "/v1/completions" : "/v1/chat/completions", res};
    if (!authorized(req, res)) return;
    Parsed p;
    std::shared_ptr<Flight> flight;
    try {
      if (api == Api::completions) {
        p = parse_completion(req.body, options.model_name, engine->config().vocab_size);
      } else {
        p = parse_chat(req.body, options.model_name, options.chat_template.get(), engine->tokenizer());
      }
      fit_context(p);
      flight = admit(p);
    } catch (const ClientError& e) {
      if (e.status == 429 || e.status == 503) res.set_header("Retry-After", "1");
      return send_error(res, e);
    }
    const std::string id = fmt::format("{}-{}", api == Api::completions ? "cmpl" : "chatcmpl", flight->streams[0]->id());
    const int64_t created = unix_time();
    if (!p.stream) {
      json choices = json::array();
      std::vector<pipelines::RequestMetrics> metrics;
      for (size_t i = 0; i < flight->streams.size(); ++i) {
        std::string text;
        std::vector<pipelines::GeneratedToken> tokens;
        RequestUpdate last;
        while (auto u = flight->streams[i]->next(std::chrono::hours(24))) {
          text += u->text;
          tokens.insert(tokens.end(), u->tokens.begin(), u->tokens.end());
          last = std::move(*u);
          if (last.finish) break;
        }
        if (failed(last)) {
          res.status = 500;
          res.set_content(
              dump(error_body(last.error.empty() ? "generation did not finish" : last.error, "server_error", {})),
              "application/json");
          return;
        }
        observe(last);
        int64_t offset = 0;
        choices.push_back(choice(p, i, text, tokens, offset, last.finish, false, false));
        metrics.push_back(last.metrics);
      }
      json body = envelope(p, id, created, std::move(choices), false);
      body["usage"] = usage(metrics);
      res.set_content(dump(body), "application/json");
      return;
    }
    // Server-sent events: one chunk per update of a choice, its finish reason on its last, then
    // (with include_usage) the usage chunk, then [DONE]. A client gone away cancels every choice.
    struct Progress {
      std::vector<int64_t> offsets;
      std::vector<bool> started, finished;
      std::vector<pipelines::RequestMetrics> metrics;
      size_t remaining = 0;
    };
    auto progress = std::make_shared<Progress>();
    const size_t n = flight->streams.size();
    progress->offsets.assign(n, 0);
    progress->started.assign(n, false);
    progress->finished.assign(n, false);
    progress->metrics.resize(n);
    progress->remaining = n;
    res.set_header("Cache-Control", "no-cache");
    res.set_chunked_content_provider(
        "text/event-stream",
        [this, flight, id, created, p, progress](size_t, httplib::DataSink& sink) {
          auto send = [&](const json& j) {
            const std::string event = "data: " + dump(j) + "\n\n";
            return sink.write(event.data(), event.size());
          };
          bool progressed = false;
          for (size_t i = 0; i < flight->streams.size(); ++i) {
            if (progress->finished[i]) continue;
            // Wait a little on the first choice with nothing new, not at all once one had news.
            std::optional<RequestUpdate> u = flight->streams[i]->next(std::chrono::milliseconds(progressed ? 0 : 50));
            if (!u) continue;
            progressed = true;
            if (u->finish && failed(*u)) {
              send(error_body(u->error.empty() ? "the request was cancelled" : u->error, "server_error", {}));
            } else if (!u->text.empty() || (p.logprobs && !u->tokens.empty()) || u->finish) {
              // (Tokens whose bytes wait for the rest of a character make no chunk, unless logprobs list them.)
              const bool first = p.api == Api::chat && !progress->started[i];
              progress->started[i] = true;
              const json one = choice(p, i, u->text, u->tokens, progress->offsets[i], u->finish, true, first);
              if (!send(envelope(p, id, created, json::array({one}), true))) {
                flight->cancel();
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
            flight->cancel();
            return false;
          }
          if (progress->remaining > 0) return true;  // called again
          if (p.include_usage) {
            json usage_chunk = envelope(p, id, created, json::array(), true);
            usage_chunk["usage"] = usage(progress->metrics);
            send(usage_chunk);
          }
          const std::string done = "data: [DONE]\n\n";
          sink.write(done.data(), done.size());
          sink.done();
          return true;
        },
        [flight](bool success) {
          if (!success) flight->cancel();  // the connection ended early
        });
  }

  json model_card() const {
    return {{"id", options.model_name},
            {"object", "model"},
            {"created", unix_time()},
            {"owned_by", "kiln"},
            {"max_model_len", engine->max_seq_len()}};
  }

  void routes() {
    http.set_payload_max_length(static_cast<size_t>(options.max_body_bytes));
    // A connection holds its thread while its request waits and streams, so there is one for every
    // request that may be in flight, and a few more to answer /health, /metrics and 429s when full.
    const size_t threads = static_cast<size_t>(std::max(1, options.max_concurrency)) +
                           static_cast<size_t>(std::max(0, options.max_queue)) + 4;
    http.new_task_queue = [threads] { return new httplib::ThreadPool(threads); };
    http.Get("/health", [this](const httplib::Request&, httplib::Response& res) {
      Counted counted{*this, "/health", res};
      bool is_draining;
      {
        std::lock_guard lock(flight_mutex);
        is_draining = draining;
      }
      if (is_draining) res.status = 503;  // load balancers: send no more
      res.set_content(is_draining ? R"({"status":"draining"})" : R"({"status":"ok"})", "application/json");
    });
    http.Get("/v1/models", [this](const httplib::Request& req, httplib::Response& res) {
      Counted counted{*this, "/v1/models", res};
      if (!authorized(req, res)) return;
      const json body = {{"object", "list"}, {"data", json::array({model_card()})}};
      res.set_content(dump(body), "application/json");
    });
    http.Get(R"(/v1/models/(.+))", [this](const httplib::Request& req, httplib::Response& res) {
      Counted counted{*this, "/v1/models/{model}", res};
      if (!authorized(req, res)) return;
      if (req.matches[1] != options.model_name)
        return send_error(res, ClientError(404, fmt::format("model '{}' does not exist; this server serves '{}'",
                                                            req.matches[1].str(), options.model_name),
                                           "model", "not_found_error"));
      res.set_content(dump(model_card()), "application/json");
    });
    http.Post("/v1/completions",
              [this](const httplib::Request& req, httplib::Response& res) { generate(Api::completions, req, res); });
    http.Post("/v1/chat/completions",
              [this](const httplib::Request& req, httplib::Response& res) { generate(Api::chat, req, res); });
    http.Get("/metrics", [this](const httplib::Request& req, httplib::Response& res) {
      Counted counted{*this, "/metrics", res};
      if (!authorized(req, res)) return;
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
      res.set_content(dump(error_body(message, "invalid_request_error", {})), "application/json");
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
      res.set_content(dump(error_body(message, "server_error", {})), "application/json");
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
  // cpp-httplib 0.11 listens with a backlog of 5 and SO_REUSEPORT. The first makes a burst of
  // clients overflow the accept queue (each waits a SYN retransmit, 1 s or more, or is reset); the
  // second lets a second server bind the same port and take half its connections. So: SO_REUSEADDR
  // only, and the listening socket (the last one httplib set options on) listens again with the
  // system's backlog.
  int listening = -1;
  s.http.set_socket_options([&listening](socket_t sock) {
    int yes = 1;
    setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof yes);
    listening = sock;
  });
  const int port = s.options.port == 0 ? s.http.bind_to_any_port(s.options.host)
                                       : (s.http.bind_to_port(s.options.host, s.options.port) ? s.options.port : -1);
  if (port < 0)
    throw LoadError(fmt::format("kiln serve: cannot listen on {}:{}", s.options.host, s.options.port));
  if (listening >= 0) ::listen(listening, SOMAXCONN);
  s.port = port;
  return port;
}

}  // namespace

int Server::start() {
  Impl& s = *impl_;
  if (s.thread.joinable()) return s.port;
  const int port = bind(s);
  s.thread = std::thread([&s] { s.http.listen_after_bind(); });
  return port;
}

void Server::run() {
  if (impl_->thread.joinable()) throw ValueError("serve::Server::run: already serving (start() was called)");
  bind(*impl_);
  impl_->http.listen_after_bind();
}

void Server::stop() {
  impl_->http.stop();
  if (impl_->thread.joinable()) impl_->thread.join();
}

void Server::shutdown(std::chrono::milliseconds grace) {
  Impl& s = *impl_;
  std::unique_lock lock(s.flight_mutex);
  s.draining = true;
  if (!s.flight_changed.wait_for(lock, grace, [&] { return s.in_flight.empty(); })) {
    const std::vector<pipelines::RequestId> left(s.in_flight.begin(), s.in_flight.end());
    lock.unlock();
    for (pipelines::RequestId id : left) s.engine->cancel(id);  // their streams end with an error event
    lock.lock();
    // Cancelled requests end at the engine's next step; their handlers then let go.
    s.flight_changed.wait_for(lock, std::chrono::seconds(5), [&] { return s.in_flight.empty(); });
  }
  lock.unlock();
  stop();
}

}  // namespace kiln::serve
