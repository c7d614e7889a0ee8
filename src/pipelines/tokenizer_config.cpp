// tokenizer_config.json: the fields transformers applies on top of tokenizer.json / tokenizer.model.
#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include "kiln/errors.h"
#include "pipelines/json_input.h"
#include "pipelines/tokenizer_formats.h"

namespace kiln::pipelines::detail {

namespace {

using nlohmann::json;

class ConfigReader {
 public:
  explicit ConfigReader(const std::filesystem::path& file) : file_(file.string()) {}

  [[noreturn]] void fail(const std::string& key, const std::string& what) const {
    throw LoadError(fmt::format("tokenizer config '{}': '{}' {}", file_, key, what));
  }

  // A token given as "content" or as an AddedToken object {"content": ...}; null is "no token".
  TokenizerConfig::TokenSetting token(const json& root, const char* key) const {
    if (!root.contains(key)) return std::nullopt;
    const json& v = root.at(key);
    if (v.is_null()) return std::optional<std::string>();
    if (const std::optional<std::string> s = content_of(v)) return s;
    fail(key, fmt::format("is {}, expected a token (a string or {{\"content\": ...}})", json_input::describe(v)));
  }

  std::optional<bool> boolean(const json& root, const char* key) const {
    if (!root.contains(key) || root.at(key).is_null()) return std::nullopt;
    if (!root.at(key).is_boolean()) fail(key, fmt::format("is {}, expected true or false", json_input::describe(root.at(key))));
    return root.at(key).get<bool>();
  }

  static std::optional<std::string> content_of(const json& v) {
    if (v.is_string()) return v.get<std::string>();
    if (v.is_object() && v.contains("content") && v.at("content").is_string()) return v.at("content").get<std::string>();
    return std::nullopt;
  }

 private:
  std::string file_;
};

}  // namespace

TokenizerConfig load_tokenizer_config(const std::filesystem::path& file) {
  TokenizerConfig config;
  std::error_code ec;
  if (!std::filesystem::is_regular_file(file, ec)) return config;
  const json root = json_input::parse_file(file, fmt::format("tokenizer config '{}'", file.string()));
  const ConfigReader in(file);
  if (!root.is_object())
    throw LoadError(fmt::format("tokenizer config '{}': holds {}, expected a JSON object", file.string(),
                                json_input::describe(root)));
  config.bos_token = in.token(root, "bos_token");
  config.eos_token = in.token(root, "eos_token");
  config.pad_token = in.token(root, "pad_token");
  config.unk_token = in.token(root, "unk_token");
  config.add_bos_token = in.boolean(root, "add_bos_token");
  config.add_eos_token = in.boolean(root, "add_eos_token");
  config.clean_up_tokenization_spaces = in.boolean(root, "clean_up_tokenization_spaces").value_or(false);

  if (root.contains("additional_special_tokens") && !root.at("additional_special_tokens").is_null()) {
    const json& list = root.at("additional_special_tokens");
    if (!list.is_array()) in.fail("additional_special_tokens", fmt::format("is {}, expected a list", json_input::describe(list)));
    for (size_t i = 0; i < list.size(); ++i) {
      const auto content = ConfigReader::content_of(list[i]);
      if (!content)
        in.fail(fmt::format("additional_special_tokens[{}]", i),
                fmt::format("is {}, expected a token", json_input::describe(list[i])));
      config.additional_special_tokens.push_back(*content);
    }
  }

  if (root.contains("added_tokens_decoder") && !root.at("added_tokens_decoder").is_null()) {
    const json& tokens = root.at("added_tokens_decoder");
    if (!tokens.is_object())
      in.fail("added_tokens_decoder", fmt::format("is {}, expected an object of id -> token", json_input::describe(tokens)));
    for (const auto& [key, t] : tokens.items()) {
      const std::string where = fmt::format("added_tokens_decoder.{}", key);
      int64_t id = -1;
      size_t used = 0;
      try {
        id = std::stoll(key, &used);
      } catch (const std::exception&) {
        used = 0;
      }
      if (used != key.size() || key.empty() || id < 0) in.fail(where, "is not keyed by a token id (a non-negative integer)");
      const auto content = ConfigReader::content_of(t);
      if (!content || content->empty()) in.fail(where, fmt::format("is {}, expected {{\"content\": ...}}", json_input::describe(t)));
      const auto flag = [&](const char* name, bool fallback) {
        if (!t.contains(name) || t.at(name).is_null()) return fallback;
        if (!t.at(name).is_boolean()) in.fail(where + "." + name, "is not true or false");
        return t.at(name).get<bool>();
      };
      const bool special = flag("special", false);
      config.added_tokens_decoder.push_back({id, *content, special, flag("lstrip", false), flag("rstrip", false),
                                             flag("single_word", false), flag("normalized", !special)});
    }
  }
  return config;
}

}  // namespace kiln::pipelines::detail
