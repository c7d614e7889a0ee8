// tokenizer_config.json as a model directory's chat template source (its chat_template, bos_token,
// eos_token), then the template it yields rendered over two messages.
#include "fuzz_common.h"
#include "kiln/pipelines/chat_template.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  kiln::fuzz::write_file("tokenizer_config.json", kiln::fuzz::bytes(data, size));
  kiln::fuzz::refusals_only([&] {
    auto tmpl = kiln::pipelines::ChatTemplate::from_model_dir(kiln::fuzz::scratch_dir());
    if (tmpl) (void)tmpl->apply({{"system", "Be brief."}, {"user", "Hi"}});
  });
  return 0;
}
