// A compiled artifact (CompiledModel::save's bytes, what the compile cache and `kiln compile` write):
// deserialize, print its plans, and parse its IR text (done lazily, on first ir()).
#include "fuzz_common.h"
#include "kiln/compiler/compiled_model.h"
#include "kiln/graph/text.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  kiln::fuzz::refusals_only([&] {
    const auto model = kiln::compiler::CompiledModel::deserialize(kiln::fuzz::bytes(data, size), "fuzz.kiln");
    for (const auto& [name, plan] : model.plans()) (void)kiln::compiler::to_string(plan);
    (void)model.extensions();
    (void)kiln::graph::print(model.ir());
  });
  return 0;
}
