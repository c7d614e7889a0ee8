// An OpenAI-compatible HTTP server over a GenerationEngine (`kiln serve`, docs/serve.md), on
// cpp-httplib: GET /health, GET /v1/models, POST /v1/completions (streaming as server-sent events,
// or one JSON response), GET /metrics (Prometheus). Every request becomes one request of the engine, so concurrent clients are
// batched together; a client that disconnects mid-stream has its request cancelled.
//
//   auto engine = std::shared_ptr(pipelines::GenerationEngine::from_dir("models/kiln-tiny"));
//   serve::Server server(engine, {.port = 8000});
//   int port = server.start();   // serves on its own threads
//   ...
//   server.stop();
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "kiln/pipelines/generation_engine.h"

namespace kiln::serve {

struct ServerOptions {
  std::string host = "127.0.0.1";
  int port = 8000;                 // 0: any free port (start() returns it)
  std::string model_name = "kiln";  // what /v1/models lists and responses name
  std::optional<std::string> api_key = std::nullopt;  // set: /v1/* needs "Authorization: Bearer <key>"
  int max_concurrency = 64;        // connections served at once (more wait for a free one)
  int64_t max_body_bytes = 1 << 20;  // a larger request body is refused (413)
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
  // Blocks, serving on this thread, until stop() (from another thread or a signal handler's thread).
  void run();
  void stop();

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace kiln::serve
