// Private to the tokenizers: UTF-8 decoding that never fails (the maximal invalid subpart of a
// sequence is one error, as Unicode and Rust's from_utf8_lossy count them) and the Unicode classes
// of characters (from utf8proc) the tokenizers test outside regexes.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include <utf8proc.h>

namespace kiln::pipelines::detail {

inline constexpr char32_t kReplacementChar = 0xFFFD;

struct Utf8Char {
  char32_t cp = kReplacementChar;  // U+FFFD when !valid
  size_t len = 1;                  // bytes consumed: the char, or the maximal invalid subpart
  bool valid = false;
  bool truncated = false;  // invalid only because the text ends inside a well-formed prefix
};

// Decodes the character starting at s[i] (i < s.size()).
inline Utf8Char decode_utf8(std::string_view s, size_t i) {
  const auto b = [&](size_t k) { return static_cast<uint8_t>(s[k]); };
  const uint8_t lead = b(i);
  if (lead < 0x80) return {lead, 1, true, false};
  size_t need;
  uint8_t lo = 0x80, hi = 0xBF;  // range of the second byte (narrower for a few leads)
  char32_t cp;
  if (lead >= 0xC2 && lead <= 0xDF) {
    need = 1, cp = lead & 0x1F;
  } else if (lead >= 0xE0 && lead <= 0xEF) {
    need = 2, cp = lead & 0x0F;
    if (lead == 0xE0) lo = 0xA0;  // no overlong forms
    if (lead == 0xED) hi = 0x9F;  // no surrogates
  } else if (lead >= 0xF0 && lead <= 0xF4) {
    need = 3, cp = lead & 0x07;
    if (lead == 0xF0) lo = 0x90;
    if (lead == 0xF4) hi = 0x8F;  // nothing above U+10FFFF
  } else {
    return {};
  }
  for (size_t k = 1; k <= need; ++k) {
    if (i + k >= s.size()) return {kReplacementChar, k, false, true};
    const uint8_t c = b(i + k);
    const bool ok = k == 1 ? (c >= lo && c <= hi) : (c >= 0x80 && c <= 0xBF);
    if (!ok) return {kReplacementChar, k, false, false};
    cp = (cp << 6) | (c & 0x3F);
  }
  return {cp, need + 1, true, false};
}

inline void append_utf8(std::string& out, char32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

// Valid UTF-8 with every invalid subpart replaced by U+FFFD.
inline std::string to_valid_utf8(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size();) {
    const Utf8Char c = decode_utf8(s, i);
    if (c.valid)
      out.append(s.substr(i, c.len));
    else
      append_utf8(out, kReplacementChar);
    i += c.len;
  }
  return out;
}

// ---- Unicode classes -------------------------------------------------------------------------------
// From utf8proc's tables (Unicode 15), as Rust's char methods and the regexes' \p{..} classes read them.

inline utf8proc_category_t category_of(char32_t cp) {
  return utf8proc_category(static_cast<utf8proc_int32_t>(cp));
}

inline bool is_letter(char32_t cp) {  // \p{L}
  if (cp < 0x80) return (cp | 0x20) >= 'a' && (cp | 0x20) <= 'z';
  const auto c = category_of(cp);
  return c >= UTF8PROC_CATEGORY_LU && c <= UTF8PROC_CATEGORY_LO;
}

inline bool is_number(char32_t cp) {  // \p{N}
  if (cp < 0x80) return cp >= '0' && cp <= '9';
  const auto c = category_of(cp);
  return c >= UTF8PROC_CATEGORY_ND && c <= UTF8PROC_CATEGORY_NO;
}

inline bool is_whitespace(char32_t cp) {  // the White_Space property: Z* and the controls \t..\r, U+0085
  if ((cp >= 0x09 && cp <= 0x0D) || cp == 0x20 || cp == 0x85) return true;
  if (cp < 0x80) return false;
  const auto c = category_of(cp);
  return c >= UTF8PROC_CATEGORY_ZS && c <= UTF8PROC_CATEGORY_ZP;
}

inline bool is_punctuation(char32_t cp) {  // Rust's is_ascii_punctuation || Unicode P*
  if (cp < 0x80) return (cp >= 0x21 && cp <= 0x2F) || (cp >= 0x3A && cp <= 0x40) || (cp >= 0x5B && cp <= 0x60) ||
                        (cp >= 0x7B && cp <= 0x7E);
  const auto c = category_of(cp);
  return c >= UTF8PROC_CATEGORY_PC && c <= UTF8PROC_CATEGORY_PO;
}

}  // namespace kiln::pipelines::detail
