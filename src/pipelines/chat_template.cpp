// ChatTemplate (kiln/pipelines/chat_template.h): where a model keeps its template, and the context
// apply_chat_template renders it with, over kiln's Jinja interpreter (jinja.h).
#include "kiln/pipelines/chat_template.h"
#include "kiln/pipelines/gguf.h"
#include "kiln/pipelines/gguf_model.h"

#include <fmt/format.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "kiln/errors.h"
#include "pipelines/jinja.h"
#include "pipelines/json_input.h"

namespace kiln::pipelines {
namespace fs = std::filesystem;
using ojson = nlohmann::ordered_json;

struct ChatTemplate::Impl {
  std::string source;
  jinja::Template tmpl;
  std::string bos_token, eos_token;
};

namespace {

std::string read_file(const fs::path& file) {
  std::ifstream in(file, std::ios::binary);
  if (!in) throw LoadError(fmt::format("chat template: {}: cannot open", file.string()));
  std::stringstream ss;
  ss << in.rdbuf();
  if (in.bad()) throw LoadError(fmt::format("chat template: {}: cannot read", file.string()));
  return ss.str();
}

// bos_token / eos_token: a string, or an AddedToken object {"content": ...}; absent or null is "".
std::string special_token(const ojson& config, const char* field, const fs::path& file) {
  auto it = config.find(field);
  if (it == config.end() || it->is_null()) return {};
  if (it->is_string()) return it->get<std::string>();
  if (it->is_object()) {
    auto content = it->find("content");
    if (content != it->end() && content->is_string()) return content->get<std::string>();
  }
  throw LoadError(fmt::format("chat template: {}: '{}' is {}, expected a string or {{\"content\": ...}}",
                              file.string(), field, json_input::describe(*it)));
}

}  // namespace

ChatTemplate::ChatTemplate(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
ChatTemplate::ChatTemplate(ChatTemplate&&) noexcept = default;
ChatTemplate& ChatTemplate::operator=(ChatTemplate&&) noexcept = default;
ChatTemplate::~ChatTemplate() = default;

ChatTemplate ChatTemplate::parse(std::string source, std::string origin) {
  jinja::Template tmpl = jinja::Template::parse(source, std::move(origin));
  return ChatTemplate(std::make_unique<Impl>(Impl{std::move(source), std::move(tmpl), {}, {}}));
}

std::optional<ChatTemplate> ChatTemplate::from_model_dir(const fs::path& dir) {
  if (is_gguf_file(dir)) {  // the file's tokenizer.chat_template, with its bos and eos tokens' text
    const GGUFFile file = GGUFFile::open(dir);
    std::optional<std::string> source = file.find_string("tokenizer.chat_template");
    if (!source) return std::nullopt;
    ChatTemplate out = parse(std::move(*source), dir.string() + ": tokenizer.chat_template");
    std::string special[2];
    const char* keys[2] = {"tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id"};
    if (file.contains("tokenizer.ggml.tokens")) {
      const std::vector<std::string_view> tokens = file.get_string_array("tokenizer.ggml.tokens");
      for (int i = 0; i < 2; ++i)
        if (auto id = file.find_u64(keys[i]); id && *id < tokens.size()) special[i] = std::string(tokens[*id]);
    }
    out.set_special_tokens(std::move(special[0]), std::move(special[1]));
    return out;
  }
  const fs::path config_file = dir / "tokenizer_config.json";
  const fs::path jinja_file = dir / "chat_template.jinja";
  std::error_code ec;
  const bool has_config = fs::is_regular_file(config_file, ec);
  const bool has_jinja = fs::is_regular_file(jinja_file, ec);
  if (!has_config && !has_jinja) return std::nullopt;

  ojson config = ojson::object();
  if (has_config) {
    config = json_input::parse_file_ordered(config_file, "chat template: " + config_file.string());
    if (!config.is_object())
      throw LoadError(fmt::format("chat template: {}: not a JSON object", config_file.string()));
  }

  std::string source, origin;
  if (has_jinja) {
    source = read_file(jinja_file);
    origin = jinja_file.string();
  } else {
    auto it = config.find("chat_template");
    if (it == config.end() || it->is_null()) return std::nullopt;
    origin = config_file.string();
    if (it->is_string()) {
      source = it->get<std::string>();
    } else if (it->is_array()) {  // named templates: [{"name": "default", "template": ...}, {"name":
                                  // "tool_use", ...}]
      bool found = false;
      for (const auto& entry : *it) {
        if (!entry.is_object() || !entry.contains("name") || !entry.contains("template") ||
            !entry["name"].is_string() || !entry["template"].is_string())
          throw LoadError(fmt::format(
              "chat template: {}: 'chat_template' entries must be {{\"name\": ..., \"template\": ...}}",
              config_file.string()));
        if (entry["name"] == "default") {
          source = entry["template"].get<std::string>();
          found = true;
        }
      }
      if (!found)
        throw LoadError(fmt::format("chat template: {}: 'chat_template' has no template named \"default\"",
                                    config_file.string()));
      origin += " (chat_template \"default\")";
    } else {
      throw LoadError(fmt::format("chat template: {}: 'chat_template' is {}, expected a string or a list",
                                  config_file.string(), it->type_name()));
    }
  }

  std::string bos = special_token(config, "bos_token", config_file);
  std::string eos = special_token(config, "eos_token", config_file);
  ChatTemplate tmpl = [&] {
    try {
      return parse(std::move(source), origin);
    } catch (const ValueError& e) {
      throw LoadError(fmt::format("chat template: {}", e.what()));
    }
  }();
  tmpl.set_special_tokens(std::move(bos), std::move(eos));
  return tmpl;
}

ChatTemplate ChatTemplate::from_file(const fs::path& file, std::string bos_token, std::string eos_token) {
  ChatTemplate tmpl = parse(read_file(file), file.string());
  tmpl.set_special_tokens(std::move(bos_token), std::move(eos_token));
  return tmpl;
}

std::string ChatTemplate::apply(const std::vector<ChatMessage>& messages, bool add_generation_prompt) const {
  ojson context = ojson::object();
  ojson list = ojson::array();
  for (const ChatMessage& m : messages) list.push_back(ojson{{"role", m.role}, {"content", m.content}});
  context["messages"] = std::move(list);
  context["add_generation_prompt"] = add_generation_prompt;
  context["bos_token"] = impl_->bos_token;
  context["eos_token"] = impl_->eos_token;
  return impl_->tmpl.render(context);
}

std::string ChatTemplate::render(std::string_view context_json) const {
  // The context is the caller's, not a format: a repeated key keeps the last, as Python's json does.
  // Nothing deeper than the interpreter takes is built.
  json_input::Options options;
  options.max_depth = jinja::Limits{}.max_data_depth;
  options.reject_duplicate_keys = false;
  ojson context;
  try {
    context = json_input::parse_ordered(context_json, impl_->tmpl.origin() + ": the context", options);
  } catch (const LoadError& e) {
    throw ValueError(e.what());
  }
  if (!context.is_object())
    throw ValueError(fmt::format("{}: the context must be a JSON object", impl_->tmpl.origin()));
  if (!context.contains("bos_token")) context["bos_token"] = impl_->bos_token;
  if (!context.contains("eos_token")) context["eos_token"] = impl_->eos_token;
  return impl_->tmpl.render(context);
}

const std::string& ChatTemplate::bos_token() const { return impl_->bos_token; }
const std::string& ChatTemplate::eos_token() const { return impl_->eos_token; }
void ChatTemplate::set_special_tokens(std::string bos_token, std::string eos_token) {
  impl_->bos_token = std::move(bos_token);
  impl_->eos_token = std::move(eos_token);
}
const std::string& ChatTemplate::source() const { return impl_->source; }

}  // namespace kiln::pipelines
