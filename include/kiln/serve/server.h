// An OpenAI-compatible HTTP server over a GenerationEngine (`kiln serve`, docs/serving.md), on
// cpp-httplib: GET /health, GET /v1/models, POST /v1/completions and POST /v1/chat/completions
// (streaming as server-sent events, or one JSON response), GET /metrics (Prometheus). Every choice
// of a request becomes one request of the engine, so concurrent clients are batched together; a
// client that disconnects mid-stream has its request cancelled; past max_concurrency + max_queue
// requests in flight, more are refused with 429 and Retry-After.
//
//   auto engine = std::shared_ptr(pipelines::GenerationEngine::from_dir("models/kiln-tiny"));
//   serve::Server server(engine, {.port = 8000});
//   int port = server.start();   // serves on its own threads
//   ...
//   server.shutdown(std::chrono::seconds(10));  // or stop()
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "kiln/pipelines/chat_template.h"
#include "kiln/pipelines/generation_engine.h"

namespace kiln::serve {

struct ServerOptions {
  std::string host = "127.0.0.1";
  int port = 8000;                 // 0: any free port (start() returns it)
  std::string model_name = "kiln";  // what /v1/models lists and responses name
  std::optional<std::string> api_key = std::nullopt;  // set: /v1/* needs "Authorization: Bearer <key>"
  int max_concurrency = 64;        // requests generating at once (the engine's max_num_seqs)
  int max_queue = 256;             // requests waiting beyond those; more get 429 with Retry-After
  int64_t max_body_bytes = 1 << 20;  // a larger request body is refused (413)
  // What /v1/chat/completions renders messages with; none: chat requests are refused (400).
  std::shared_ptr<const pipelines::ChatTemplate> chat_template = nullptr;
};

class Server {
 public:
  Server(std::shared_ptr<pipelines::GenerationEngine> engine, ServerOptions options = {});
  ~Server();  // stop()
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  // Binds and starts serving on background threads; returns the port. LoadError when the address
  // cannot be bound.
  int start();
  // Blocks, serving on this thread, until stop() or shutdown() from another thread. ValueError
  // after start().
  void run();
  // Stops at once: requests in flight end as their connections close.
  void stop();
  // Stops gracefully: new requests get 503, those in flight may finish for up to `grace`, then the
  // rest are cancelled (streams end with an error event), then stop().
  void shutdown(std::chrono::milliseconds grace);

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace kiln::serve
