// Private to the tokenizers: the regexes of tokenizer.json (Split pre-tokenizers, Replace normalizers
// and decoders), written for Oniguruma as Hugging Face's tokenizers compiles them, run on PCRE2 with
// its JIT. The two engines agree on the syntax those files use, with two differences handled here:
// Oniguruma's \h is a hex digit (PCRE2's is horizontal space), and PCRE2 10.42's Unicode tables stop at
// Unicode 14, so each \p{..} / \P{..} of a general category is widened with the characters that
// utf8proc (Unicode 15) puts in that category and PCRE2 does not know yet.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace kiln::pipelines::detail {

class Regex {
 public:
  // ValueError naming the pattern and PCRE2's reason, with the offset it failed at.
  explicit Regex(std::string_view pattern);

  // The non-empty matches in `text` (valid UTF-8), left to right, as byte ranges [first, second).
  void find_all(std::string_view text, std::vector<std::pair<size_t, size_t>>& matches) const;
  // The same matches, each passed to on_match(first, second) as it is found.
  template <class F>
  void for_each_match(std::string_view text, F&& on_match) const {
    scan(text, [](void* f, size_t b, size_t e) { (*static_cast<F*>(f))(b, e); }, &on_match);
  }
  const std::string& pattern() const { return pattern_; }

 private:
  void scan(std::string_view text, void (*on_match)(void*, size_t, size_t), void* context) const;

  std::string pattern_;
  std::shared_ptr<void> code_;  // pcre2_code, freed with pcre2_code_free
  bool jit_ = false;            // compiled by PCRE2's JIT
};

// `pattern` as PCRE2 must read it to mean what Oniguruma reads (see above). Exposed for tests.
std::string oniguruma_to_pcre2(std::string_view pattern);

}  // namespace kiln::pipelines::detail
