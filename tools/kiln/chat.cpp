#include "chat.h"

#include <fmt/format.h>

#include <istream>
#include <ostream>
#include <vector>

#include "kiln/errors.h"

namespace kiln::chat {

int64_t run_chat(pipelines::GenerationEngine& engine, const pipelines::ChatTemplate& chat_template,
                 const ChatOptions& options, std::istream& in, std::ostream& out, std::ostream& err) {
  const pipelines::Tokenizer* tokenizer = engine.tokenizer();
  if (!tokenizer) throw ValueError("kiln chat: the model has no tokenizer");
  std::vector<pipelines::ChatMessage> conversation;
  auto reset = [&] {
    conversation.clear();
    if (!options.system.empty()) conversation.push_back({"system", options.system});
  };
  reset();
  int64_t replies = 0;
  std::string line;
  while (true) {
    if (options.prompt_marks) out << "> " << std::flush;
    if (!std::getline(in, line)) break;
    if (line == "/exit" || line == "/quit") break;
    if (line == "/reset") {
      reset();
      err << "(conversation reset)\n";
      continue;
    }
    if (line.empty()) continue;
    conversation.push_back({"user", line});
    // The oldest turns go (the system message stays) until the prompt leaves room for a reply.
    std::vector<int64_t> ids;
    while (true) {
      ids = tokenizer->encode(chat_template.apply(conversation, true), /*add_special_tokens=*/false);
      const size_t first_turn = options.system.empty() ? 0 : 1;
      if (static_cast<int64_t>(ids.size()) < engine.max_seq_len() || conversation.size() <= first_turn + 1) break;
      conversation.erase(conversation.begin() + static_cast<std::ptrdiff_t>(first_turn));
      err << "(the conversation is longer than the context: its oldest turn was dropped)\n";
    }
    if (static_cast<int64_t>(ids.size()) >= engine.max_seq_len()) {
      err << fmt::format("(that message is {} tokens: longer than the context of {}; not sent)\n", ids.size(),
                         engine.max_seq_len());
      conversation.pop_back();
      continue;
    }
    pipelines::GenerationRequest request;
    request.prompt_ids = std::move(ids);
    request.sampling = options.sampling;
    const int64_t room = engine.max_seq_len() - static_cast<int64_t>(request.prompt_ids.size());
    if (request.sampling.max_new_tokens <= 0 || request.sampling.max_new_tokens > room)
      request.sampling.max_new_tokens = room;
    request.on_update = [&out](const pipelines::RequestUpdate& u) { out << u.text << std::flush; };
    const pipelines::GenerationOutput reply = engine.generate(std::move(request));
    out << "\n" << std::flush;
    if (reply.finish == pipelines::FinishReason::error) throw ValueError(fmt::format("kiln chat: {}", reply.error));
    conversation.push_back({"assistant", reply.text});
    ++replies;
  }
  return replies;
}

}  // namespace kiln::chat
