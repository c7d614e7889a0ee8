// A chat template's Jinja source (`--chat-template FILE`, chat_template.jinja): parse, then render
// over a small fixed context that has what real templates look at (roles, tool calls, tools, flags).
#include "fuzz_common.h"
#include "kiln/pipelines/chat_template.h"

namespace {

constexpr const char* kContext = R"({
  "messages": [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi <b>&amp;</b> 42"},
    {"role": "assistant", "content": "", "tool_calls": [
      {"id": "c1", "type": "function", "function": {"name": "get", "arguments": {"city": "Paris", "n": [1, 2.5, null]}}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "{\"t\": 21}"},
    {"role": "user", "content": "Thanks \u00e9\ud83d\ude42"}],
  "tools": [{"type": "function", "function": {"name": "get", "description": "d",
             "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}],
  "add_generation_prompt": true, "enable_thinking": false, "date_string": "26 Jul 2024"})";

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  kiln::fuzz::refusals_only([&] {
    auto tmpl = kiln::pipelines::ChatTemplate::parse(std::string(kiln::fuzz::bytes(data, size)), "fuzz.jinja");
    tmpl.set_special_tokens("<s>", "</s>");
    (void)tmpl.render(kContext);
  });
  kiln::fuzz::refusals_only([&] {
    auto tmpl = kiln::pipelines::ChatTemplate::parse(std::string(kiln::fuzz::bytes(data, size)), "fuzz.jinja");
    (void)tmpl.apply({{"user", "Hello"}, {"assistant", "Hi"}}, false);
  });
  return 0;
}
