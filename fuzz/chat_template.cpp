// A chat template's Jinja source (`--chat-template FILE`, chat_template.jinja): parsed, then rendered
// over two fixed contexts, those of ChatTemplate::render (what real templates look at: roles, tool
// calls, tools, flags, bos/eos) and ChatTemplate::apply (two plain messages).
//
// The interpreter is fuzzed directly, with the production limits on nesting (parse, render and data
// depth: they keep the stack safe, so the fuzzer must meet them as users do) and lower limits on loop
// iterations and string size (they bound time and memory only; the contexts' loops need a few dozen).
// At the production 100,000 iterations an input that loops to the limit took 1-2 s under the
// sanitizers, and such inputs held the harness to ~300 executions/s; at 500 it runs ~3,300/s (Zen 4,
// one core) and reaches more code in a minute. tests/pipelines/test_jinja.cpp checks the production
// values (JinjaErrors), values nested thousands deep through loops included.
#include <nlohmann/json.hpp>

#include "fuzz_common.h"
#include "pipelines/jinja.h"

namespace {

constexpr const char* kRenderContext = R"({
  "messages": [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi <b>&amp;</b> 42"},
    {"role": "assistant", "content": "", "tool_calls": [
      {"id": "c1", "type": "function", "function": {"name": "get", "arguments": {"city": "Paris", "n": [1, 2.5, null]}}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "{\"t\": 21}"},
    {"role": "user", "content": "Thanks \u00e9\ud83d\ude42"}],
  "tools": [{"type": "function", "function": {"name": "get", "description": "d",
             "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}],
  "add_generation_prompt": true, "enable_thinking": false, "date_string": "26 Jul 2024",
  "bos_token": "<s>", "eos_token": "</s>"})";

constexpr const char* kApplyContext = R"({
  "messages": [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi"}],
  "add_generation_prompt": false, "bos_token": "", "eos_token": ""})";

kiln::pipelines::jinja::Limits fuzz_limits() {
  kiln::pipelines::jinja::Limits limits;
  limits.max_loop_iterations = 500;
  limits.max_output_bytes = size_t{1} << 20;
  return limits;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using kiln::pipelines::jinja::Template;
  static const auto render_context = nlohmann::ordered_json::parse(kRenderContext);
  static const auto apply_context = nlohmann::ordered_json::parse(kApplyContext);
  static const auto limits = fuzz_limits();
  kiln::fuzz::refusals_only([&] {
    const Template tmpl = Template::parse(kiln::fuzz::bytes(data, size), "fuzz.jinja", limits);
    kiln::fuzz::refusals_only([&] { (void)tmpl.render(render_context); });
    kiln::fuzz::refusals_only([&] { (void)tmpl.render(apply_context); });
  });
  return 0;
}
