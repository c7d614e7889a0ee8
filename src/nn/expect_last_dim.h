// The input check every layer over a feature axis makes, with an error naming the layer.
#pragma once

#include <fmt/format.h>

#include <cstdint>
#include <string>

#include "kiln/errors.h"
#include "kiln/graph/graph.h"

namespace kiln::nn {

// ShapeError "Linear 'model.layers.0.self_attn.q_proj': input f32[seq, 32] must end in dim 64" unless
// x's last dim is statically `dim`.
inline void expect_last_dim(const char* layer, const std::string& path, const graph::TensorValue& x,
                            int64_t dim) {
  if (!x.valid()) throw ValueError(fmt::format("{} '{}': input is an empty value", layer, path));
  auto last = x.rank() > 0 ? x.shape()[x.rank() - 1].try_static() : std::nullopt;
  if (!last || *last != dim)
    throw ShapeError(fmt::format("{} '{}': input {} must end in dim {}", layer,
                                 path.empty() ? "<root>" : path, x.tensor_type().to_string(), dim));
}

// The single leaf argument of a layer's forward; ValueError naming the layer otherwise.
inline graph::TensorValue single_tensor_arg(const char* layer,
                                            const std::vector<graph::Tree<graph::Value>>& args) {
  if (args.size() != 1 || !args[0].is_leaf())
    throw ValueError(
        fmt::format("{}: forward takes one tensor argument, got {} argument(s)", layer, args.size()));
  return args[0].leaf();
}

}  // namespace kiln::nn
