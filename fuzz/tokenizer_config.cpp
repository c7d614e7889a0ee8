// tokenizer_config.json as a model directory's chat template source (its chat_template, bos_token,
// eos_token), then the template it yields rendered over two messages; and the same file as the
// tokenizer's config beside a small tokenizer.json (special tokens, flags, added tokens), which then
// encodes and decodes a text.
#include "fuzz_common.h"
#include "kiln/pipelines/chat_template.h"
#include "kiln/pipelines/tokenizer.h"

namespace {

// BPE over a, b and space, two special tokens, and a regex split.
const char* kTokenizerJson = R"({"model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "ab": 2, "<s>": 3, "</s>": 4, " ": 5},
  "merges": ["a b"]}, "added_tokens": [{"id": 3, "content": "<s>", "special": true},
  {"id": 4, "content": "</s>", "special": true}],
  "pre_tokenizer": {"type": "Split", "pattern": {"Regex": "\\p{L}+|\\s+"}, "behavior": "Isolated"}})";

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const bool written = [] {
    kiln::fuzz::write_file("tokenizer.json", kTokenizerJson);
    return true;
  }();
  (void)written;
  kiln::fuzz::write_file("tokenizer_config.json", kiln::fuzz::bytes(data, size));
  kiln::fuzz::refusals_only([&] {
    auto tmpl = kiln::pipelines::ChatTemplate::from_model_dir(kiln::fuzz::scratch_dir());
    if (tmpl) (void)tmpl->apply({{"system", "Be brief."}, {"user", "Hi"}});
  });
  kiln::fuzz::refusals_only([&] {
    auto tok = kiln::pipelines::Tokenizer::load(kiln::fuzz::scratch_dir());
    const auto ids = tok->encode("ab <s>ba</s> a", true);
    (void)tok->decode(ids, false);
    (void)tok->decode(ids, true);
  });
  return 0;
}
