// Private: replaces every `call` node by a copy of its callee's nodes (recursively), so each graph of
// the result is one flat list of kernel launches. Graphs without calls are copied unchanged.
#pragma once

#include "kiln/graph/graph.h"

namespace kiln::compiler {

// VerifyError for a missing callee, a recursive call or an argument/result count mismatch.
graph::Module inline_calls(const graph::Module& module);

}  // namespace kiln::compiler
