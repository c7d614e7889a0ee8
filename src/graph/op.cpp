#include "kiln/graph/op.h"

#include <array>
#include <string>

namespace kiln::graph {

namespace {
constexpr std::string_view kOpNames[] = {
#define KILN_OP_NAME(e, s) s,
    KILN_OPS(KILN_OP_NAME)
#undef KILN_OP_NAME
};
constexpr size_t kNumOps = std::size(kOpNames);
}  // namespace

std::string_view op_name(Op op) {
  auto i = static_cast<size_t>(op);
  return i < kNumOps ? kOpNames[i] : std::string_view("<invalid op>");
}

Op parse_op(std::string_view name) {
  for (size_t i = 0; i < kNumOps; ++i)
    if (kOpNames[i] == name) return static_cast<Op>(i);
  throw ParseError("unknown op '" + std::string(name) + "'");
}

bool is_elementwise_unary(Op op) { return op >= Op::neg && op <= Op::is_nan; }
bool is_elementwise_binary(Op op) { return op >= Op::add && op <= Op::logical_xor; }
bool is_comparison(Op op) { return op >= Op::equal && op <= Op::less_equal; }
bool is_collective(Op op) { return op == Op::allreduce_sum || op == Op::allgather; }

bool has_side_effects(Op op) {
  return op == Op::buffer_store || op == Op::paged_kv_store || op == Op::inplace_custom || op == Op::custom ||
         is_collective(op);
}

bool reads_buffers(Op op) { return op == Op::buffer_load || op == Op::paged_attention; }

}  // namespace kiln::graph
