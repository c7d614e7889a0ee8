#include "pipelines/regex.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <fmt/format.h>
#include <pcre2.h>
#include <utf8proc.h>

#include <array>
#include <map>
#include <mutex>

#include "kiln/errors.h"

namespace kiln::pipelines::detail {

namespace {

pcre2_code* compile_or_throw(std::string_view pattern, std::string_view shown) {
  int error = 0;
  PCRE2_SIZE offset = 0;
  pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                                   PCRE2_UTF | PCRE2_UCP, &error, &offset, nullptr);
  if (!code) {
    std::array<PCRE2_UCHAR, 256> message{};
    pcre2_get_error_message(error, message.data(), message.size());
    throw ValueError(fmt::format("regex '{}': {} (at offset {})", shown,
                                 reinterpret_cast<const char*>(message.data()), offset));
  }
  pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);  // without JIT (an unsupported CPU), the interpreter runs
  return code;
}

// The general-category names PCRE2 and Oniguruma both accept in \p{..}: one letter (a major class) or
// two (a category).
bool in_category(utf8proc_category_t c, std::string_view name) {
  static constexpr std::string_view kNames[] = {"Cn", "Lu", "Ll", "Lt", "Lm", "Lo", "Mn", "Mc", "Me", "Nd",
                                                "Nl", "No", "Pc", "Pd", "Ps", "Pe", "Pi", "Pf", "Po", "Sm",
                                                "Sc", "Sk", "So", "Zs", "Zl", "Zp", "Cc", "Cf", "Cs", "Co"};
  const std::string_view own = kNames[c];
  return name.size() == 1 ? own[0] == name[0] : own == name;
}

bool is_category_name(std::string_view name) {
  static constexpr std::string_view kMajor = "LMNPSZC";
  if (name.size() == 1) return kMajor.find(name[0]) != std::string_view::npos;
  if (name.size() != 2) return false;
  for (int c = UTF8PROC_CATEGORY_CN; c <= UTF8PROC_CATEGORY_CO; ++c)
    if (in_category(static_cast<utf8proc_category_t>(c), name)) return true;
  return false;
}

// The characters utf8proc assigns a category and PCRE2's tables leave unassigned (\p{Cn}): what
// Unicode added after the version PCRE2 was built with. Found once by asking PCRE2 about every
// assigned character, private use excepted (both know it).
const std::vector<char32_t>& newer_characters() {
  static const std::vector<char32_t> chars = [] {
    std::vector<char32_t> out;
    std::unique_ptr<pcre2_code, decltype(&pcre2_code_free)> cn(compile_or_throw("\\p{Cn}", "\\p{Cn}"),
                                                               pcre2_code_free);
    std::unique_ptr<pcre2_match_data, decltype(&pcre2_match_data_free)> md(
        pcre2_match_data_create_from_pattern(cn.get(), nullptr), pcre2_match_data_free);
    for (char32_t cp = 0x80; cp <= 0x10FFFF; ++cp) {
      const utf8proc_category_t cat = utf8proc_category(static_cast<utf8proc_int32_t>(cp));
      if (cat == UTF8PROC_CATEGORY_CN || cat == UTF8PROC_CATEGORY_CO || cat == UTF8PROC_CATEGORY_CS) continue;
      utf8proc_uint8_t buf[4];
      const auto len = utf8proc_encode_char(static_cast<utf8proc_int32_t>(cp), buf);
      if (pcre2_match(cn.get(), buf, len, 0, PCRE2_ANCHORED, md.get(), nullptr) >= 0) out.push_back(cp);
    }
    return out;
  }();
  return chars;
}

// "\x{a}-\x{b}..." ranges of the newer characters in category `name`, for a character class.
std::string newer_in_category(std::string_view name) {
  static std::mutex mutex;
  static std::map<std::string, std::string, std::less<>> cache;
  const std::lock_guard lock(mutex);
  if (const auto it = cache.find(name); it != cache.end()) return it->second;
  std::string ranges;
  const std::vector<char32_t>& chars = newer_characters();
  for (size_t i = 0; i < chars.size();) {
    if (!in_category(utf8proc_category(static_cast<utf8proc_int32_t>(chars[i])), name)) {
      ++i;
      continue;
    }
    size_t j = i;
    while (j + 1 < chars.size() && chars[j + 1] == chars[j] + 1 &&
           in_category(utf8proc_category(static_cast<utf8proc_int32_t>(chars[j + 1])), name))
      ++j;
    ranges += chars[i] == chars[j] ? fmt::format("\\x{{{:x}}}", static_cast<uint32_t>(chars[i]))
                                   : fmt::format("\\x{{{:x}}}-\\x{{{:x}}}", static_cast<uint32_t>(chars[i]),
                                                 static_cast<uint32_t>(chars[j]));
    i = j + 1;
  }
  return cache.emplace(std::string(name), ranges).first->second;
}

}  // namespace

std::string oniguruma_to_pcre2(std::string_view p) {
  std::string out;
  bool in_class = false;
  for (size_t i = 0; i < p.size(); ++i) {
    const char c = p[i];
    if (c == '[' && !in_class) {
      in_class = true;
      out += c;
      if (i + 1 < p.size() && p[i + 1] == '^') out += p[++i];
      if (i + 1 < p.size() && p[i + 1] == ']') out += p[++i];  // a leading ']' is literal
      continue;
    }
    if (c == '[' && in_class && i + 1 < p.size() && p[i + 1] == ':') {  // [:alpha:] inside a class
      const size_t end = p.find(":]", i + 2);
      if (end != std::string_view::npos) {
        out.append(p.substr(i, end + 2 - i));
        i = end + 1;
        continue;
      }
    }
    if (c == ']' && in_class) {
      in_class = false;
      out += c;
      continue;
    }
    if (c != '\\' || i + 1 >= p.size()) {
      out += c;
      continue;
    }
    const char e = p[i + 1];
    if (e == 'h' || e == 'H') {  // Oniguruma: a hex digit
      out += in_class ? (e == 'h' ? "0-9a-fA-F" : "\\H") : (e == 'h' ? "[0-9a-fA-F]" : "[^0-9a-fA-F]");
      ++i;
      continue;
    }
    if (e == 'p' || e == 'P') {
      // \pL or \p{L} / \p{^L}
      size_t end = i + 2;
      std::string_view name;
      bool negated = e == 'P';
      if (end < p.size() && p[end] == '{') {
        const size_t close = p.find('}', end);
        if (close != std::string_view::npos) {
          name = p.substr(end + 1, close - end - 1);
          end = close + 1;
        }
      } else if (end < p.size()) {
        name = p.substr(end, 1);
        ++end;
      }
      const std::string_view written = p.substr(i, end - i);
      if (!name.empty() && name[0] == '^') negated = !negated, name.remove_prefix(1);
      const std::string extra = is_category_name(name) ? newer_in_category(name) : std::string();
      const std::string positive = fmt::format("\\p{{{}}}", name);
      if (extra.empty() || (negated && in_class)) {  // a negation inside a class cannot be widened
        out.append(written);
      } else if (in_class) {
        out += positive + extra;
      } else {
        out += (negated ? "[^" : "[") + positive + extra + "]";
      }
      i = end - 1;
      continue;
    }
    out += c;  // any other escape, kept with its character
    out += e;
    ++i;
  }
  return out;
}

Regex::Regex(std::string_view pattern) : pattern_(pattern) {
  code_.reset(compile_or_throw(oniguruma_to_pcre2(pattern), pattern),
              [](void* code) { pcre2_code_free(static_cast<pcre2_code*>(code)); });
  size_t jit_size = 0;
  jit_ = pcre2_pattern_info(static_cast<pcre2_code*>(code_.get()), PCRE2_INFO_JITSIZE, &jit_size) == 0 && jit_size > 0;
}

void Regex::find_all(std::string_view text, std::vector<std::pair<size_t, size_t>>& matches) const {
  for_each_match(text, [&](size_t b, size_t e) { matches.emplace_back(b, e); });
}

void Regex::scan(std::string_view text, void (*on_match)(void*, size_t, size_t), void* context) const {
  auto* code = static_cast<pcre2_code*>(code_.get());
  std::unique_ptr<pcre2_match_data, decltype(&pcre2_match_data_free)> md(
      pcre2_match_data_create_from_pattern(code, nullptr), pcre2_match_data_free);
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  size_t pos = 0;
  while (pos <= text.size()) {
    // The JIT's own entry skips pcre2_match's checks of the options: a few percent of a split.
    const int rc = jit_ ? pcre2_jit_match(code, subject, text.size(), pos, 0, md.get(), nullptr)
                        : pcre2_match(code, subject, text.size(), pos, PCRE2_NO_UTF_CHECK, md.get(), nullptr);
    if (rc == PCRE2_ERROR_NOMATCH) return;
    if (rc < 0) {
      std::array<PCRE2_UCHAR, 256> message{};
      pcre2_get_error_message(rc, message.data(), message.size());
      throw Error(fmt::format("regex '{}': matching failed at byte {}: {}", pattern_, pos,
                              reinterpret_cast<const char*>(message.data())));
    }
    const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(md.get());
    const size_t start = ovector[0], end = ovector[1];
    if (end > start) {
      on_match(context, start, end);
      pos = end;
    } else {  // an empty match: step over one character
      pos = start + 1;
      while (pos < text.size() && (static_cast<uint8_t>(text[pos]) & 0xC0) == 0x80) ++pos;
    }
  }
}

}  // namespace kiln::pipelines::detail
