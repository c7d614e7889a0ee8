#include "kiln/graph/elementwise_program.h"

#include <fmt/format.h>

#include <cctype>
#include <charconv>

#include "kiln/errors.h"

namespace kiln::graph {

bool is_fusible_elementwise(Op op) {
  return is_elementwise_unary(op) || is_elementwise_binary(op) || op == Op::where || op == Op::cast;
}

Attrs ElementwiseInstruction::attrs() const {
  if (op == Op::gelu) return {{"approximate", std::string(gelu_tanh ? "tanh" : "none")}};
  if (op == Op::cast) return {{"dtype", dtype}};
  return {};
}

namespace {

// A cursor over one instruction's text; every failure names the instruction.
struct InstructionReader {
  std::string_view text;
  size_t pos = 0;

  [[noreturn]] void fail(std::string_view what) const {
    throw ValueError(fmt::format("elementwise program: instruction \"{}\": {}", text, what));
  }
  void skip_spaces() {
    while (pos < text.size() && std::isspace(static_cast<unsigned char>(text[pos]))) ++pos;
  }
  bool consume(char c) {
    skip_spaces();
    if (pos < text.size() && text[pos] == c) {
      ++pos;
      return true;
    }
    return false;
  }
  void expect(char c) {
    if (!consume(c)) fail(fmt::format("expected '{}' at offset {}", c, pos));
  }
  std::string_view word() {
    skip_spaces();
    size_t start = pos;
    while (pos < text.size() && (std::isalnum(static_cast<unsigned char>(text[pos])) || text[pos] == '_' ||
                                 text[pos] == '.'))
      ++pos;
    if (start == pos) fail(fmt::format("expected a name at offset {}", start));
    return text.substr(start, pos - start);
  }
  int32_t reg() {
    expect('%');
    int32_t r = -1;
    auto [end, ec] = std::from_chars(text.data() + pos, text.data() + text.size(), r);
    if (ec != std::errc() || r < 0) fail(fmt::format("expected a register number at offset {}", pos));
    pos = static_cast<size_t>(end - text.data());
    return r;
  }
};

std::string_view trim(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return s;
}

}  // namespace

ElementwiseProgram ElementwiseProgram::parse(std::string_view text, int32_t num_inputs) {
  if (num_inputs < 0) throw ValueError("elementwise program: negative input count");
  ElementwiseProgram program;
  program.num_inputs = num_inputs;
  while (true) {
    const size_t end = text.find(';');
    std::string_view item = trim(text.substr(0, end));
    InstructionReader r{item};
    if (item.empty()) r.fail("empty instruction");
    const int32_t defined = r.reg();
    if (defined != program.num_registers())
      r.fail(fmt::format("defines %{}, but the next register is %{}", defined, program.num_registers()));
    r.expect('=');
    ElementwiseInstruction in{};
    std::string_view name = r.word();
    if (name == "gelu.tanh") {
      in.gelu_tanh = true;
      name = "gelu";
    }
    try {
      in.op = parse_op(name);
    } catch (const ParseError&) {
      r.fail(fmt::format("unknown op '{}'", name));
    }
    if (!is_fusible_elementwise(in.op))
      r.fail(fmt::format("'{}' is not an elementwise op", name));
    r.expect('(');
    if (!r.consume(')')) {
      do {
        const int32_t operand = r.reg();
        if (operand >= defined) r.fail(fmt::format("uses %{} before its definition", operand));
        in.operands.push_back(operand);
      } while (r.consume(','));
      r.expect(')');
    }
    const size_t arity = is_elementwise_binary(in.op) ? 2 : in.op == Op::where ? 3 : 1;
    if (in.operands.size() != arity)
      r.fail(fmt::format("'{}' takes {} operand{}, got {}", op_name(in.op), arity, arity == 1 ? "" : "s",
                         in.operands.size()));
    r.expect(':');
    const std::string_view dtype = r.word();
    try {
      in.dtype = parse_dtype(dtype);
    } catch (const ValueError&) {
      r.fail(fmt::format("unknown dtype '{}'", dtype));
    }
    r.skip_spaces();
    if (r.pos != item.size()) r.fail(fmt::format("unexpected text at offset {}", r.pos));
    program.instructions.push_back(std::move(in));
    if (end == std::string_view::npos) break;
    text.remove_prefix(end + 1);
  }
  return program;
}

std::string ElementwiseProgram::to_string() const {
  std::string s;
  int32_t next = num_inputs;
  for (const ElementwiseInstruction& in : instructions) {
    if (!s.empty()) s += "; ";
    s += fmt::format("%{} = {}{}(", next++, op_name(in.op), in.gelu_tanh ? ".tanh" : "");
    for (size_t k = 0; k < in.operands.size(); ++k) s += fmt::format("{}%{}", k ? ", " : "", in.operands[k]);
    s += fmt::format(") : {}", dtype_name(in.dtype));
  }
  return s;
}

}  // namespace kiln::graph
