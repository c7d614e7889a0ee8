// fuzz_make_artifact_seeds OUT_DIR GRAPH_TEXT...: compiles each module (with the CPU kernels, as a
// session would, so plans carry fused and grouped steps) and writes its artifact to OUT_DIR.
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "kiln/compiler/compiled_model.h"
#include "kiln/engine/session.h"
#include "kiln/graph/text.h"

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: %s OUT_DIR GRAPH_TEXT...\n", argv[0]);
    return 2;
  }
  const kiln::engine::InferenceSession session({kiln::DeviceRef::CPU()}, {}, {.num_threads = 1, .compile_cache = false});
  kiln::compiler::CompileOptions options;
  options.kernels = &session.kernel_catalog();
  for (int i = 2; i < argc; ++i) {
    std::ifstream in(argv[i]);
    std::stringstream text;
    text << in.rdbuf();
    try {
      const auto model = kiln::compiler::compile(kiln::graph::parse_module(text.str()), options);
      const auto out = std::filesystem::path(argv[1]) / (std::filesystem::path(argv[i]).stem().string() + ".kiln");
      model.save(out);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "%s: %s (skipped)\n", argv[i], e.what());
    }
  }
  return 0;
}
