// The JSON bodies of kiln serve's POST /v1/completions and /v1/chat/completions, parsed as the
// server parses them (chat rendered with kiln-tiny's template and encoded with its tokenizer). The
// first byte picks the route. A refusal must be a client error (4xx): any exception escaping, kiln's
// too, would leave the request handler as a 500.
#include <cstdio>

#include "fuzz_common.h"
#include "kiln/pipelines/chat_template.h"
#include "kiln/pipelines/tokenizer.h"
#include "serve/request_parse.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kiln::pipelines;
  static const auto tokenizer = Tokenizer::load(KILN_FUZZ_MODEL_DIR);
  static const auto chat_template = ChatTemplate::from_model_dir(KILN_FUZZ_MODEL_DIR);
  if (size == 0) return 0;
  const bool chat = data[0] & 1;
  const std::string body(kiln::fuzz::bytes(data + 1, size - 1));
  const int status = kiln::serve::detail::parse_request_status(
      chat, body, "kiln-tiny", tokenizer->vocab_size(), chat_template ? &*chat_template : nullptr, tokenizer.get());
  if (status != 200 && (status < 400 || status > 499)) {
    std::fprintf(stderr, "fuzz: a request body answered with HTTP %d\n", status);
    std::abort();
  }
  return 0;
}
