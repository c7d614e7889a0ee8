// The graph text form (what `kiln check` and artifacts parse): parse, and a parsed module must print
// and parse back to the same text.
#include <cstdio>

#include "fuzz_common.h"
#include "kiln/graph/text.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  kiln::fuzz::refusals_only([&] {
    const kiln::graph::Module m = kiln::graph::parse_module(kiln::fuzz::bytes(data, size));
    const std::string text = kiln::graph::print(m);
    if (kiln::graph::print(kiln::graph::parse_module(text)) != text) {
      std::fprintf(stderr, "fuzz: print -> parse -> print differs:\n%s\n", text.c_str());
      std::abort();
    }
  });
  return 0;
}
