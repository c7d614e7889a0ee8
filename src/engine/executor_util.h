// Private: small helpers the executor's files share.
#pragma once

#include <memory>
#include <vector>

#include "kernels/kernel.h"
#include "kiln/compiler/compiled_model.h"
#include "kiln/tensor/tensor.h"

namespace kiln::engine {

inline kernels::TensorView view_of(const Tensor& t) {
  // Kernels write through views of buffer inputs (in place) and of outputs; both are ours to write.
  return {const_cast<void*>(t.data()), t.dtype(), t.shape(), t.strides()};
}

// Assigning into the view's vectors reuses their capacity: no allocation after the first run.
inline void set_view(kernels::TensorView& view, const Tensor& t) {
  view.data = const_cast<void*>(t.data());
  view.dtype = t.dtype();
  view.shape = t.shape();
  view.strides = t.strides();
}

inline void set_contiguous_strides(kernels::TensorView& view) {
  view.strides.resize(view.shape.size());
  int64_t stride = 1;
  for (size_t d = view.shape.size(); d-- > 0;) {
    view.strides[d] = stride;
    stride *= view.shape[d];
  }
}

inline int64_t product(const std::vector<int64_t>& dims) {
  int64_t n = 1;
  for (int64_t d : dims) n *= d;
  return n;
}

// Where an alias step's result lies in its source's memory, in elements, for resolved window bounds
// (empty for a reshape or a window without bounds): checks what the step's kernel would have checked
// (a reshape keeps the element count; a window lies inside the source and has the result's shape),
// and that the window is one contiguous block, which the compiler proved for every binding (a plan
// from elsewhere may not have been).
int64_t alias_element_offset(graph::Op op, const std::vector<int64_t>& source, const std::vector<int64_t>& result,
                             const std::vector<int64_t>& starts, const std::vector<int64_t>& stops,
                             const std::vector<int64_t>& steps);

// The kernel of a custom op step: the extension's, from the library content it was compiled against
// (the one loaded in this process, else the file at its path if that still has the same content).
std::unique_ptr<const kernels::Kernel> make_custom_kernel(const compiler::GraphPlan& plan, const compiler::Step& step);

}  // namespace kiln::engine
