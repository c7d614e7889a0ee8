// llama-bench's JSON output, as `kiln bench --compare-llama-cpp` reads it (another program's output,
// so outside input).
#include "fuzz_common.h"
#include "../tools/kiln/bench.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  kiln::fuzz::refusals_only(
      [&] { (void)kiln::bench::parse_llama_bench_json(std::string(kiln::fuzz::bytes(data, size)), "llama-bench"); });
  return 0;
}
