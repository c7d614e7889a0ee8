// A model directory's config.json, as `kiln generate` reads it.
#include "fuzz_common.h"
#include "kiln/pipelines/hf_config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  kiln::fuzz::write_file("config.json", kiln::fuzz::bytes(data, size));
  kiln::fuzz::refusals_only([&] { (void)kiln::pipelines::load_model_info(kiln::fuzz::scratch_dir()); });
  return 0;
}
