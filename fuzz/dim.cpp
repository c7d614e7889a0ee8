// Dim::parse, the symbolic dims of graph text and of compiled artifacts' types: a parsed dim prints
// as text that parses back to an equal dim.
#include <cstdio>

#include "fuzz_common.h"
#include "kiln/graph/dim.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  kiln::fuzz::refusals_only([&] {
    const kiln::graph::Dim d = kiln::graph::Dim::parse(kiln::fuzz::bytes(data, size));
    const std::string text = d.to_string();
    if (!(kiln::graph::Dim::parse(text) == d)) {
      std::fprintf(stderr, "fuzz: '%s' does not parse back to the same dim\n", text.c_str());
      std::abort();
    }
    (void)d.symbols();
  });
  return 0;
}
