// A Hugging Face tokenizer.json: load, then encode a short string (plain text, a special-looking
// token, non-ASCII) and decode the ids back, with and without special tokens.
#include "fuzz_common.h"
#include "kiln/pipelines/tokenizer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto path = kiln::fuzz::write_file("tokenizer.json", kiln::fuzz::bytes(data, size));
  kiln::fuzz::refusals_only([&] {
    const auto tok = kiln::pipelines::Tokenizer::load(path);
    for (bool special : {true, false}) {
      const std::vector<int64_t> ids = tok->encode("Hello wörld <s><|endoftext|> 12 \xf0\x9f\x99\x82\n\t ", special);
      (void)tok->decode(ids, special);
      for (int64_t id : ids) (void)kiln::pipelines::output_bytes(*tok, id);
    }
    for (int64_t id : {int64_t{-1}, int64_t{0}, tok->vocab_size() - 1, tok->vocab_size()})
      (void)kiln::pipelines::output_bytes(*tok, id);
    (void)tok->bos_id();
    (void)tok->eos_id();
  });
  return 0;
}
