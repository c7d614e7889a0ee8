// `kiln chat`: an interactive chat in the terminal on the server's path: each turn renders the whole
// conversation with the model's chat template, encodes it as Hugging Face's apply_chat_template does
// (no special tokens added), and streams the reply. Lines starting with '/' are commands: /reset
// forgets the conversation, /exit (or end of input) ends it.
#pragma once

#include <cstdint>
#include <iosfwd>
#include <optional>
#include <string>

#include "kiln/pipelines/chat_template.h"
#include "kiln/pipelines/generation_engine.h"

namespace kiln::chat {

struct ChatOptions {
  std::string system;  // a system message first, when not empty
  pipelines::SamplingParams sampling;  // max_new_tokens: per reply (0: the rest of the context)
  bool prompt_marks = false;           // print "> " before each line read (a terminal)
};

// Runs the conversation: user turns from `in`, replies streamed to `out`, notes (a conversation cut
// to fit the context) to `err`. Returns the number of replies. ValueError when the engine has no
// tokenizer.
int64_t run_chat(pipelines::GenerationEngine& engine, const pipelines::ChatTemplate& chat_template,
                 const ChatOptions& options, std::istream& in, std::ostream& out, std::ostream& err);

}  // namespace kiln::chat
