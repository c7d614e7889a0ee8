#include "kiln/graph/custom_op_check.h"

#include <atomic>

namespace kiln::graph {

namespace {
std::atomic<CustomOpCheck> installed_check{nullptr};
}  // namespace

void set_custom_op_check(CustomOpCheck check) { installed_check.store(check); }

void check_custom_op(Op op, const std::string& symbol, const std::vector<Type>& inputs, const Attrs& attrs) {
  if (CustomOpCheck check = installed_check.load()) check(op, symbol, inputs, attrs);
}

}  // namespace kiln::graph
