// json_input.h: nlohmann's DOM parser driven through its callback, which sees every object, array
// and key as it is read, so the depth and duplicate-key checks refuse an input before any deeper or
// later value is built. The input is read through an iterator that records how far the parser has
// got, which is the byte offset the callback's errors report.
#include "pipelines/json_input.h"

#include <fmt/format.h>

#include <fstream>
#include <iterator>
#include <unordered_set>
#include <vector>

#include "kiln/errors.h"

namespace kiln::pipelines::json_input {
namespace fs = std::filesystem;

namespace {

// A pointer into the input that, when the parser advances it, also updates the shared `*cursor`
// (the end iterator is never advanced). nlohmann reads it one byte at a time.
struct CountingIterator {
  using iterator_category = std::input_iterator_tag;
  using value_type = char;
  using difference_type = std::ptrdiff_t;
  using pointer = const char*;
  using reference = const char&;

  const char* p = nullptr;
  const char** cursor = nullptr;

  reference operator*() const { return *p; }
  CountingIterator& operator++() {
    ++p;
    if (cursor) *cursor = p;
    return *this;
  }
  CountingIterator operator++(int) {
    CountingIterator old = *this;
    ++*this;
    return old;
  }
  bool operator==(const CountingIterator& other) const { return p == other.p; }
};

void trim_partial_utf8(std::string& s);

// nlohmann's messages quote the token they stopped at, which can be the whole input (a million-digit
// number): cut, as describe() cuts values.
std::string cut(std::string_view message) {
  constexpr size_t kMax = 200;
  if (message.size() <= kMax) return std::string(message);
  std::string out(message.substr(0, kMax - 3));
  trim_partial_utf8(out);
  return out + "...";
}

template <class Json>
Json parse_impl(std::string_view bytes, const std::string& origin, const Options& options) {
  const char* const begin = bytes.data();
  const char* cursor = begin;
  // The byte last read, as the message's offset: the '{' or '[' that goes too deep, a key's closing
  // quote, the byte after an overflowing number.
  auto where = [&] {
    const size_t read = static_cast<size_t>(cursor - begin);
    return fmt::format("{} {}", options.offset_unit, options.base_offset + (read > 0 ? read - 1 : 0));
  };
  std::vector<std::unordered_set<std::string>> keys;  // one per open object, when checking duplicates

  auto callback = [&](int depth, nlohmann::detail::parse_event_t event, Json& parsed) -> bool {
    using Event = nlohmann::detail::parse_event_t;
    switch (event) {
      case Event::object_start:
      case Event::array_start:
        if (depth >= options.max_depth)
          throw LoadError(
              fmt::format("{}: nested deeper than {} levels at {}", origin, options.max_depth, where()));
        if (event == Event::object_start && options.reject_duplicate_keys) keys.emplace_back();
        break;
      case Event::object_end:
        if (options.reject_duplicate_keys && !keys.empty()) keys.pop_back();
        break;
      case Event::key:
        if (options.reject_duplicate_keys && !keys.empty() && parsed.is_string() &&
            !keys.back().insert(parsed.template get_ref<const std::string&>()).second)
          throw LoadError(fmt::format("{}: duplicate key {} at {}", origin, describe(parsed), where()));
        break;
      default:
        break;
    }
    return true;
  };

  try {
    return Json::parse(CountingIterator{begin, &cursor}, CountingIterator{begin + bytes.size(), nullptr},
                       callback);
  } catch (const nlohmann::json::parse_error& e) {
    // e.byte counts the bytes read, from 1.
    const size_t at = options.base_offset + (e.byte > 0 ? e.byte - 1 : 0);
    throw LoadError(
        fmt::format("{}: not valid JSON at {} {}: {}", origin, options.offset_unit, at, cut(e.what())));
  } catch (const nlohmann::json::exception& e) {  // out_of_range.406: a number that overflows a double
    throw LoadError(fmt::format("{}: not valid JSON at {}: {}", origin, where(), cut(e.what())));
  }
}

std::string read_file(const fs::path& file, const std::string& origin) {
  std::ifstream in(file, std::ios::binary);
  if (!in) throw LoadError(fmt::format("{}: cannot open", origin));
  std::error_code ec;
  if (!fs::is_regular_file(file, ec))
    throw LoadError(fmt::format("{}: cannot open: not a regular file", origin));
  const uintmax_t size = fs::file_size(file, ec);
  if (ec) throw LoadError(fmt::format("{}: cannot open: {}", origin, ec.message()));
  if (size > kMaxFileBytes)
    throw LoadError(fmt::format("{}: is {} bytes, more than the {} bytes kiln reads as JSON", origin, size,
                                kMaxFileBytes));
  std::string text(static_cast<size_t>(size), '\0');
  in.read(text.data(), static_cast<std::streamsize>(text.size()));
  // A file that shrank since it was sized is read as what is there.
  text.resize(static_cast<size_t>(in.gcount()));
  if (in.bad()) throw LoadError(fmt::format("{}: cannot read", origin));
  return text;
}

// Drops a UTF-8 sequence cut short at the end of `s`.
void trim_partial_utf8(std::string& s) {
  size_t n = 0;  // continuation bytes at the end
  while (n < s.size() && n < 3 && (static_cast<unsigned char>(s[s.size() - 1 - n]) & 0xC0) == 0x80) ++n;
  if (n < s.size() && (static_cast<unsigned char>(s[s.size() - 1 - n]) & 0xC0) == 0xC0) {
    const unsigned char lead = static_cast<unsigned char>(s[s.size() - 1 - n]);
    const size_t len = lead >= 0xF0 ? 4 : lead >= 0xE0 ? 3 : 2;
    if (n + 1 < len) s.resize(s.size() - 1 - n);
  }
}

template <class Json>
std::string scalar_text(const Json& v, size_t max_chars) {
  if (v.is_string()) {
    const auto& s = v.template get_ref<const std::string&>();
    if (s.size() > max_chars)
      return Json(s.substr(0, max_chars)).dump(-1, ' ', false, Json::error_handler_t::replace);
  }
  return v.dump(-1, ' ', false, Json::error_handler_t::replace);
}

template <class Json>
std::string describe_impl(const Json& v, size_t max_chars) {
  struct Frame {
    typename Json::const_iterator it, end;
    bool object, first;
  };
  std::vector<Frame> stack;
  std::string out;
  auto open = [&](const Json& x) {
    if (x.is_array() || x.is_object()) {
      out += x.is_object() ? '{' : '[';
      stack.push_back(Frame{x.cbegin(), x.cend(), x.is_object(), true});
    } else {
      out += scalar_text(x, max_chars);
    }
  };
  open(v);
  while (!stack.empty() && out.size() <= max_chars) {
    Frame& f = stack.back();
    if (f.it == f.end) {
      out += f.object ? '}' : ']';
      stack.pop_back();
      continue;
    }
    if (!f.first) out += ',';
    f.first = false;
    if (f.object) out += scalar_text(Json(f.it.key()), max_chars) + ':';
    const Json& child = *f.it;
    ++f.it;
    open(child);  // may invalidate f
  }
  if (out.size() > max_chars) {
    out.resize(max_chars > 3 ? max_chars - 3 : 0);
    trim_partial_utf8(out);
    out += "...";
  }
  return out;
}

}  // namespace

nlohmann::json parse(std::string_view bytes, const std::string& origin, const Options& options) {
  return parse_impl<nlohmann::json>(bytes, origin, options);
}
nlohmann::ordered_json parse_ordered(std::string_view bytes, const std::string& origin,
                                     const Options& options) {
  return parse_impl<nlohmann::ordered_json>(bytes, origin, options);
}
nlohmann::json parse_file(const fs::path& file, const std::string& origin, const Options& options) {
  return parse(read_file(file, origin), origin, options);
}
nlohmann::ordered_json parse_file_ordered(const fs::path& file, const std::string& origin,
                                          const Options& options) {
  return parse_ordered(read_file(file, origin), origin, options);
}

std::string describe(const nlohmann::json& v, size_t max_chars) { return describe_impl(v, max_chars); }
std::string describe(const nlohmann::ordered_json& v, size_t max_chars) {
  return describe_impl(v, max_chars);
}

}  // namespace kiln::pipelines::json_input
