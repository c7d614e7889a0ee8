// A hook through which loaded extensions (kiln/ext) check a custom-op call as the graph is built.
// graph depends on nothing else in kiln, so the extension loader installs the check when it loads
// its first library; until then (and for ops no loaded library defines) the check is a no-op and
// the compiler checks the call instead.
#pragma once

#include <string>
#include <vector>

#include "kiln/graph/op.h"

namespace kiln::graph {

// Throws (ExtensionError) when the call does not fit the loaded op; returns normally when it fits
// or when the op is not known here. `op` is Op::custom or Op::inplace_custom.
using CustomOpCheck = void (*)(Op op, const std::string& symbol, const std::vector<Type>& inputs,
                               const Attrs& attrs);

void set_custom_op_check(CustomOpCheck check);
void check_custom_op(Op op, const std::string& symbol, const std::vector<Type>& inputs, const Attrs& attrs);

}  // namespace kiln::graph
