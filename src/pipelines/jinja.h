// kiln's Jinja2 interpreter: the subset of Jinja that chat templates use, configured the way Hugging
// Face's apply_chat_template configures jinja2 (trim_blocks, lstrip_blocks, loop controls, an
// immutable sandbox, transformers' tojson, raise_exception, strftime_now). docs/chat-templates.md
// lists what is supported.
//
// Templates and contexts are outside input: every fault is a ValueError "ORIGIN:LINE:COL: ...", and
// recursion, loop iterations and output size are bounded (Limits), so no input crashes or hangs.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <string_view>

namespace kiln::pipelines::jinja {

struct Limits {
  size_t max_output_bytes = size_t{64} << 20;  // any one string built, the output included
  // Over the whole render; also the longest list built. 1,000,000 let a 300-byte template of nested
  // range() loops take 10 s under the sanitizers (fuzz_chat_template); real templates loop over
  // messages, their parts and tools, far below this.
  int64_t max_loop_iterations = 100'000;
  int max_render_depth = 400;  // nested evaluation: expressions, blocks and macro calls together
  int max_parse_depth = 150;   // nested brackets, operators and blocks in the source
  int max_data_depth = 256;    // nesting of lists and dicts, in the context and in values built
};

struct Node;

class Template {
 public:
  // ValueError "ORIGIN:LINE:COL: ..." when the source does not parse.
  static Template parse(std::string_view source, std::string origin = "template", const Limits& limits = {});

  Template(Template&&) noexcept;
  Template& operator=(Template&&) noexcept;
  ~Template();

  // `context` must be a JSON object; its keys become the template's variables (hiding the globals
  // range, namespace, dict, raise_exception, strftime_now of the same name). Ordered, because tojson
  // keeps the keys' order as Python's json does.
  std::string render(const nlohmann::ordered_json& context) const;

  const std::string& origin() const { return origin_; }

 private:
  Template(std::shared_ptr<const Node> root, std::string origin, Limits limits);
  std::shared_ptr<const Node> root_;
  std::string origin_;
  Limits limits_;
};

}  // namespace kiln::pipelines::jinja
