// Chat templates: a model's Jinja `chat_template` (tokenizer_config.json, chat_template.jinja, or a
// file of the user's), rendered by kiln's own Jinja interpreter the way Hugging Face's
// apply_chat_template renders it (trim_blocks, lstrip_blocks, loop controls, tojson,
// raise_exception, strftime_now). docs/chat-templates.md.
//
//   auto tmpl = pipelines::ChatTemplate::from_model_dir("models/Qwen3-0.6B");  // nullopt: none
//   std::string prompt = tmpl->apply({{"system", "Be brief."}, {"user", "Hi"}});
//   // or any context, as JSON text (messages with tool_calls, tools, enable_thinking, ...):
//   std::string p2 = tmpl->render(R"({"messages": [...], "add_generation_prompt": true})");
#pragma once

#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace kiln::pipelines {

struct ChatMessage {
  std::string role;     // "system", "user", "assistant", "tool", ...
  std::string content;
};

class ChatTemplate {
 public:
  // Parses a template. ValueError naming `origin` (a file name, "tokenizer_config.json", ...) with
  // the line and column of the fault for a template that does not parse.
  static ChatTemplate parse(std::string source, std::string origin = "chat_template");
  // A model directory's template: DIR/chat_template.jinja, else tokenizer_config.json's
  // "chat_template" (a string, or a list of {name, template} of which "default" is taken), with
  // that file's bos_token and eos_token (strings or {"content": ...} objects). nullopt when the
  // directory has none. LoadError naming the file when one exists but cannot be read or parsed.
  // `dir` may also be a GGUF file: its tokenizer.chat_template, with the text of its bos and eos
  // tokens.
  static std::optional<ChatTemplate> from_model_dir(const std::filesystem::path& dir);
  // A template file (`--chat-template FILE`), with the bos and eos tokens given.
  static ChatTemplate from_file(const std::filesystem::path& file, std::string bos_token = {},
                                std::string eos_token = {});

  ChatTemplate(ChatTemplate&&) noexcept;
  ChatTemplate& operator=(ChatTemplate&&) noexcept;
  ~ChatTemplate();

  // Renders with {messages, add_generation_prompt, bos_token, eos_token}.
  std::string apply(const std::vector<ChatMessage>& messages, bool add_generation_prompt = true) const;
  // Renders with a context given as a JSON object's text; bos_token and eos_token are added when the
  // context lacks them. ValueError naming the template, line and column for a render-time fault
  // (raise_exception's message, an undefined call, a type error, a resource limit hit).
  std::string render(std::string_view context_json) const;

  const std::string& bos_token() const;
  const std::string& eos_token() const;
  void set_special_tokens(std::string bos_token, std::string eos_token);
  const std::string& source() const;

 private:
  struct Impl;
  explicit ChatTemplate(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kiln::pipelines
