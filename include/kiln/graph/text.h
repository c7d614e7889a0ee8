// The deterministic text form of graphs: print -> parse -> print is identical. Close to MLIR's
// generic syntax:
//
//   graph @mlp(%0: f32[batch, 64]) -> (f32[batch, 10]) {
//     %1 = weight() {device = cpu:0, dtype = f32, name = "w1", shape = [64, 10]} : f32[64, 10]
//     %2 = matmul(%0, %1) : f32[batch, 10]
//     return %2
//   }
#pragma once

#include <string>
#include <string_view>

#include "kiln/graph/graph.h"

namespace kiln::graph {

std::string print(const GraphIR&);
std::string print(const Module&);  // graphs in insertion order, separated by a blank line
// Parses a module's text (one or more graphs); re-infers and checks every node's type. ParseError
// names the line, column and what was expected.
Module parse_module(std::string_view text);

}  // namespace kiln::graph
