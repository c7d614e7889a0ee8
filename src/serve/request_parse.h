// The server's request-body parsing, reachable without an HTTP round trip, for fuzz/serve_request.cpp.
// Private to kiln (src/, not include/).
#pragma once

#include <cstdint>
#include <string>

namespace kiln::pipelines {
class ChatTemplate;
class Tokenizer;
}  // namespace kiln::pipelines

namespace kiln::serve::detail {

// Parses a /v1/completions (chat false) or /v1/chat/completions body exactly as the server does;
// returns 200 for a request it would run, else the HTTP status of the client error it answers.
// Anything other than a client error propagates, as it would out of the handler.
int parse_request_status(bool chat, const std::string& body, const std::string& model_name, int64_t vocab,
                         const pipelines::ChatTemplate* chat_template, const pipelines::Tokenizer* tokenizer);

}  // namespace kiln::serve::detail
