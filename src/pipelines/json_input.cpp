// json_input.h: a DOM built from nlohmann's SAX events, which see every object, array and key as it
// is read, so the depth and duplicate-key checks refuse an input before any deeper or later value is
// built. The input is read through an iterator that records how far the parser has got, which is
// the byte offset the builder's errors report.
#include "pipelines/json_input.h"

#include <fmt/format.h>

#include <fstream>
#include <functional>
#include <iterator>
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

// After `read` bytes, the message's offset: the last byte read (the '{' or '[' that goes too deep, a
// key's closing quote, the byte after an overflowing number).
std::string at_byte(const Options& options, size_t read) {
  return fmt::format("{} {}", options.offset_unit, options.base_offset + (read > 0 ? read - 1 : 0));
}

// Builds the DOM from nlohmann's SAX events (as its own DOM parser does), checking each object and
// array's depth before it is built and each key as it is inserted: a key whose insertion leaves its
// object's size unchanged is a repeated one. (nlohmann's callback parser, which could do the same,
// walks the parent object's members at the end of every object: quadratic in a tokenizer config's
// thousands of added tokens.)
template <class Json>
class DomBuilder {
 public:
  using number_integer_t = typename Json::number_integer_t;
  using number_unsigned_t = typename Json::number_unsigned_t;
  using number_float_t = typename Json::number_float_t;
  using string_t = typename Json::string_t;
  using binary_t = typename Json::binary_t;

  // `*cursor`: how far the parser has read from `begin`.
  DomBuilder(const std::string& origin, const Options& options, const char* begin, const char* const* cursor)
      : origin_(origin), options_(options), begin_(begin), cursor_(cursor) {}

  Json take() { return std::move(dom_.root); }

  bool null() { return put(nullptr); }
  bool boolean(bool v) { return put(v); }
  bool number_integer(number_integer_t v) { return put(v); }
  bool number_unsigned(number_unsigned_t v) { return put(v); }
  bool number_float(number_float_t v, const string_t&) { return put(v); }
  bool string(string_t& v) { return put(std::move(v)); }
  bool binary(binary_t& v) { return put(Json::binary(std::move(v))); }
  bool start_object(std::size_t) { return open(Json::value_t::object); }
  bool start_array(std::size_t) { return open(Json::value_t::array); }
  bool end_object() { return close(); }
  bool end_array() { return close(); }
  bool key(string_t& k) {
    if (stream_ && element_.stack.empty()) {  // a member of the streamed object
      element_key_ = std::move(k);
      element_key_read_ = read();
      return true;
    }
    Tree& tree = current();
    Json& object = *tree.stack.back();
    const size_t before = object.size();
    Json& member = object[k];
    if (options_.reject_duplicate_keys && object.size() == before)
      duplicate_key(k, read());
    tree.member = &member;
    if (&tree == &dom_) dom_key_ = std::move(k);
    return true;
  }
  template <class Exception>
  bool parse_error(std::size_t, const std::string&, const Exception& e) {
    throw e;  // as nlohmann's own parser: the caller turns it into a LoadError naming the byte
  }

 private:
  // A value being built: the whole document, or one element of a streamed member.
  struct Tree {
    Json root;
    std::vector<Json*> stack;  // the open objects and arrays, innermost last
    Json* member = nullptr;    // the member the last key made, for the value that follows
  };
  Tree& current() { return stream_ ? element_ : dom_; }

  // Places a value: the tree's root, the next element of its open array, or the member the last key
  // made. Returns where it went.
  template <class Value>
  Json* place(Tree& tree, Value&& v) {
    Json* at = tree.stack.empty() ? &tree.root
               : tree.stack.back()->is_array() ? &tree.stack.back()->emplace_back()
                                                : tree.member;
    *at = Json(std::forward<Value>(v));
    return at;
  }
  template <class Value>
  bool put(Value&& v) {
    if (stream_ && element_.stack.empty()) {  // a scalar element of the streamed member
      element_.root = Json(std::forward<Value>(v));
      return hand_over();
    }
    place(current(), std::forward<Value>(v));
    return true;
  }
  bool open(typename Json::value_t type) {
    if (depth() >= static_cast<size_t>(options_.max_depth))
      throw LoadError(fmt::format("{}: nested deeper than {} levels at {}", origin_, options_.max_depth, at(read())));
    if (!stream_) {
      if ((stream_ = streamed_here())) {  // its member is left an empty object or array
        place(dom_, type);
        stream_is_object_ = type == Json::value_t::object;
        return true;
      }
    }
    Tree& tree = current();
    if (&tree == &dom_)  // the key of the member it is, when it is one
      dom_path_.push_back(!dom_.stack.empty() && dom_.stack.back()->is_object() ? std::move(dom_key_) : std::string());
    tree.stack.push_back(place(tree, type));
    return true;
  }
  bool close() {
    if (stream_ && element_.stack.empty()) {  // the streamed member ends
      stream_ = nullptr;
      return true;
    }
    Tree& tree = current();
    tree.stack.pop_back();
    if (&tree == &dom_) dom_path_.pop_back();
    return stream_ && element_.stack.empty() ? hand_over() : true;
  }
  size_t depth() const { return dom_.stack.size() + (stream_ ? 1 + element_.stack.size() : 0); }

  // The streamed member the container about to open is the value of, if any.
  const StreamedMember* streamed_here() const {
    if constexpr (std::is_same_v<Json, nlohmann::json>) {
      if (dom_.stack.empty() || !dom_.stack.back()->is_object()) return nullptr;
      for (const StreamedMember& m : options_.streamed) {
        // dom_path_[0] is the root's (empty); then the keys of the open members, then this one.
        if (m.path.size() != dom_path_.size() || m.path.back() != dom_key_) continue;
        if (std::equal(m.path.begin(), m.path.end() - 1, dom_path_.begin() + 1)) return &m;
      }
    }
    return nullptr;
  }
  // One element of the streamed member is complete: to its handler, then dropped.
  bool hand_over() {
    if constexpr (std::is_same_v<Json, nlohmann::json>) {
      if (!stream_->element(stream_is_object_ ? &element_key_ : nullptr, element_.root))
        duplicate_key(element_key_, element_key_read_);
    }
    element_.root = Json();
    return true;
  }

  size_t read() const { return static_cast<size_t>(*cursor_ - begin_); }
  std::string at(size_t read) const { return at_byte(options_, read); }
  [[noreturn]] void duplicate_key(const std::string& k, size_t read) const {
    throw LoadError(fmt::format("{}: duplicate key {} at {}", origin_, describe(Json(k)), at(read)));
  }

  const std::string& origin_;
  const Options& options_;
  const char* begin_;
  const char* const* cursor_;
  Tree dom_;
  std::vector<std::string> dom_path_;  // per open container of the DOM, the key of the member it is
  std::string dom_key_;                // the last key read in the DOM
  const StreamedMember* stream_ = nullptr;  // the member being streamed, if any
  bool stream_is_object_ = false;
  Tree element_;             // the element of the streamed member being built
  std::string element_key_;  // its key (a streamed object's member)
  size_t element_key_read_ = 0;
};

template <class Json>
Json parse_impl(std::string_view bytes, const std::string& origin, const Options& options) {
  const char* const begin = bytes.data();
  const char* cursor = begin;
  try {
    DomBuilder<Json> builder(origin, options, begin, &cursor);
    Json::sax_parse(CountingIterator{begin, &cursor}, CountingIterator{begin + bytes.size(), nullptr}, &builder);
    return builder.take();
  } catch (const nlohmann::json::parse_error& e) {
    // e.byte counts the bytes read, from 1.
    const size_t at = options.base_offset + (e.byte > 0 ? e.byte - 1 : 0);
    throw LoadError(
        fmt::format("{}: not valid JSON at {} {}: {}", origin, options.offset_unit, at, cut(e.what())));
  } catch (const nlohmann::json::exception& e) {  // out_of_range.406: a number that overflows a double
    throw LoadError(fmt::format("{}: not valid JSON at {}: {}", origin,
                                at_byte(options, static_cast<size_t>(cursor - begin)), cut(e.what())));
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
