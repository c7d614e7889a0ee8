// The expression a `fused_elementwise` node computes (its attribute "program"): straight-line code
// over registers. Registers %0 .. %(n-1) are the node's n operands; instruction i defines register
// %(n + i); the last instruction's register is the node's result. The text form, which the attribute
// holds, is one instruction per "; "-separated item, each with its result dtype:
//   "%2 = mul(%0, %1) : f32; %3 = silu(%2) : f32; %4 = cast(%3) : bf16"
// An instruction is an elementwise unary or binary op, where or cast, with the op's own semantics;
// gelu with the tanh approximation is written `gelu.tanh`.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "kiln/graph/op.h"

namespace kiln::graph {

// The ops an elementwise program may contain.
bool is_fusible_elementwise(Op op);

struct ElementwiseInstruction {
  Op op;
  std::vector<int32_t> operands;  // registers, each defined before this instruction
  DType dtype;                    // the result's dtype (cast's target dtype)
  bool gelu_tanh = false;         // gelu only: attribute approximate = "tanh"

  // The attributes the op would carry as a node (approximate for gelu, dtype for cast).
  Attrs attrs() const;
  bool operator==(const ElementwiseInstruction&) const = default;
};

struct ElementwiseProgram {
  int32_t num_inputs = 0;
  std::vector<ElementwiseInstruction> instructions;

  // Parses the text form; ValueError naming the instruction and what is wrong (unknown op, a
  // register used before its definition, out-of-order numbering, a missing dtype).
  static ElementwiseProgram parse(std::string_view text, int32_t num_inputs);
  std::string to_string() const;
  int32_t num_registers() const { return num_inputs + static_cast<int32_t>(instructions.size()); }
  bool operator==(const ElementwiseProgram&) const = default;
};

}  // namespace kiln::graph
