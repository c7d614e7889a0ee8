// GGUF reader (include/kiln/pipelines/gguf.h; docs/gguf.md has the checks and the limits). The file is
// untrusted: every count, length, dims product, type id, offset and the alignment is checked before it
// is used or anything is allocated for it; a bad file is a LoadError naming the file, the key, tensor
// or index at fault and the byte offset.
#include "kiln/pipelines/gguf.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <bit>
#include <cstring>
#include <fstream>
#include <functional>
#include <numeric>

#include "kiln/errors.h"
#include "pipelines/mapped_file.h"

namespace kiln::pipelines {
namespace fs = std::filesystem;

namespace {

constexpr uint64_t kHeaderBytes = 24;  // magic, version, tensor count, metadata count
constexpr uint64_t kDefaultAlignment = 32;
constexpr std::string_view kAlignmentKey = "general.alignment";

// Limits (docs/gguf.md). Counts are also bounded by the bytes left in the file, so a tiny file
// cannot make kiln reserve memory for a huge count; these absolute limits bound what a large file
// can make kiln hold in parsed form.
constexpr uint64_t kMaxTensors = uint64_t{1} << 20;
constexpr uint64_t kMaxKeys = uint64_t{1} << 20;
constexpr uint64_t kMaxKeyBytes = uint64_t{64} << 10;
constexpr uint64_t kMaxTensorNameBytes = uint64_t{64} << 10;
constexpr uint64_t kMaxStringBytes = uint64_t{64} << 20;
// Scalars plus array elements over all keys. A parsed value takes ~56 bytes (sizeof(GGUFValue)),
// so this bounds the parsed metadata to ~470 MB; the largest vocabularies (262144 tokens, with
// scores, types and merges) need under a million.
constexpr uint64_t kMaxMetadataValues = uint64_t{1} << 23;
constexpr int kMaxArrayDepth = 4;  // an array of arrays of arrays of arrays; no deeper
constexpr uint32_t kMaxDims = 4;   // ggml's GGML_MAX_DIMS
// The fewest bytes one entry can take, for the counts' "could the rest of the file hold it" checks.
constexpr uint64_t kMinKeyValueBytes = 8 + 4 + 1;      // key length, value type, a u8
constexpr uint64_t kMinTensorInfoBytes = 8 + 4 + 4 + 8;  // name length, dims count, type, offset

struct TypeTraits {
  GGMLType type;
  std::string_view name;
  int64_t block_size;
  int64_t block_bytes;
};
// ggml's type_traits (ggml.c): weights per block and bytes per block.
constexpr TypeTraits kTypes[] = {
    {GGMLType::f32, "F32", 1, 4},        {GGMLType::f16, "F16", 1, 2},
    {GGMLType::bf16, "BF16", 1, 2},      {GGMLType::q4_0, "Q4_0", 32, 18},
    {GGMLType::q4_1, "Q4_1", 32, 20},    {GGMLType::q5_0, "Q5_0", 32, 22},
    {GGMLType::q5_1, "Q5_1", 32, 24},    {GGMLType::q8_0, "Q8_0", 32, 34},
    {GGMLType::q8_1, "Q8_1", 32, 36},    {GGMLType::q2_k, "Q2_K", 256, 84},
    {GGMLType::q3_k, "Q3_K", 256, 110},  {GGMLType::q4_k, "Q4_K", 256, 144},
    {GGMLType::q5_k, "Q5_K", 256, 176},  {GGMLType::q6_k, "Q6_K", 256, 210},
    {GGMLType::q8_k, "Q8_K", 256, 292},
};

const TypeTraits* type_traits(uint32_t id) {
  for (const TypeTraits& t : kTypes)
    if (static_cast<uint32_t>(t.type) == id) return &t;
  return nullptr;
}

std::string known_type_names() {
  std::string out;
  for (const TypeTraits& t : kTypes) out += (out.empty() ? "" : ", ") + std::string(t.name);
  return out;
}

bool known_value_type(uint32_t id) { return id <= static_cast<uint32_t>(GGUFValueType::f64); }

// The fewest bytes a value of this type takes in the file (a string: its u64 length; an array: its
// element type and u64 count).
uint64_t min_value_bytes(GGUFValueType type) {
  switch (type) {
    case GGUFValueType::u8:
    case GGUFValueType::i8:
    case GGUFValueType::boolean: return 1;
    case GGUFValueType::u16:
    case GGUFValueType::i16: return 2;
    case GGUFValueType::u32:
    case GGUFValueType::i32:
    case GGUFValueType::f32: return 4;
    case GGUFValueType::u64:
    case GGUFValueType::i64:
    case GGUFValueType::f64:
    case GGUFValueType::string: return 8;
    case GGUFValueType::array: return 4 + 8;
  }
  return 1;
}

bool is_unsigned(GGUFValueType t) {
  return t == GGUFValueType::u8 || t == GGUFValueType::u16 || t == GGUFValueType::u32 || t == GGUFValueType::u64;
}
bool is_signed(GGUFValueType t) {
  return t == GGUFValueType::i8 || t == GGUFValueType::i16 || t == GGUFValueType::i32 || t == GGUFValueType::i64;
}
bool is_integer(GGUFValueType t) { return is_unsigned(t) || is_signed(t); }
bool is_float(GGUFValueType t) { return t == GGUFValueType::f32 || t == GGUFValueType::f64; }

// Strict UTF-8: no overlong forms, no surrogates, nothing above U+10FFFF.
bool valid_utf8(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    const auto c = static_cast<uint8_t>(s[i]);
    if (c < 0x80) {
      ++i;
      continue;
    }
    size_t n = 0;
    uint32_t cp = 0, min = 0;
    if ((c & 0xE0) == 0xC0) n = 1, cp = c & 0x1F, min = 0x80;
    else if ((c & 0xF0) == 0xE0) n = 2, cp = c & 0x0F, min = 0x800;
    else if ((c & 0xF8) == 0xF0) n = 3, cp = c & 0x07, min = 0x10000;
    else return false;
    if (s.size() - i <= n) return false;
    for (size_t k = 1; k <= n; ++k) {
      const auto cc = static_cast<uint8_t>(s[i + k]);
      if ((cc & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (cc & 0x3F);
    }
    if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return false;
    i += n + 1;
  }
  return true;
}

// A name or key for a message: quoted, cut to about 60 bytes (at a character boundary), control
// bytes escaped (a NUL would end the message's C string).
std::string shown(std::string_view s) {
  constexpr size_t kShown = 60;
  size_t cut = s.size();
  if (cut > kShown) {
    cut = kShown;
    while (cut > 0 && (static_cast<uint8_t>(s[cut]) & 0xC0) == 0x80) --cut;
  }
  std::string out = "'";
  for (char c : s.substr(0, cut)) {
    const auto u = static_cast<uint8_t>(c);
    if (u < 0x20 || u == 0x7F) out += fmt::format("\\x{:02x}", u);
    else out += c;
  }
  out += "'";
  if (cut < s.size()) out += fmt::format("... ({} bytes)", s.size());
  return out;
}

std::string value_type_text(GGUFValueType type, GGUFValueType element) {
  if (type == GGUFValueType::array) return fmt::format("array of {}", gguf_value_type_name(element));
  return std::string(gguf_value_type_name(type));
}

// What a value is, for type errors: its type and, for numbers, its value.
std::string describe(const GGUFValue& v) {
  std::string text = value_type_text(v.type, v.element_type);
  if (const auto* i = std::get_if<int64_t>(&v.value)) return text + fmt::format(" {}", *i);
  if (const auto* u = std::get_if<uint64_t>(&v.value)) return text + fmt::format(" {}", *u);
  if (const auto* d = std::get_if<double>(&v.value)) return text + fmt::format(" {}", *d);
  if (const auto* b = std::get_if<bool>(&v.value)) return text + (*b ? " true" : " false");
  if (const auto* s = std::get_if<std::string>(&v.value)) return text + fmt::format(" of {} bytes", s->size());
  const auto& a = std::get<std::vector<GGUFValue>>(v.value);
  return text + fmt::format(" ({} elements)", a.size());
}

[[noreturn]] void fail(const fs::path& path, const std::string& what) {
  throw LoadError(fmt::format("load_gguf: {}: {}", path.string(), what));
}
[[noreturn]] void fail_at(const fs::path& path, const std::string& what, uint64_t at) {
  throw LoadError(fmt::format("load_gguf: {}: {} (at byte {})", path.string(), what, at));
}

// Where a metadata value sits, for messages: its key and, inside arrays, the element indexes.
struct ValuePath {
  std::string_view key;
  uint64_t index[kMaxArrayDepth] = {};
  int depth = 0;
  std::string text() const {
    std::string out = "key " + shown(key);
    for (int i = 0; i < depth; ++i) out += fmt::format("[{}]", index[i]);
    return out;
  }
};

// Little-endian reads from the mapping; every read checks the bytes left first.
class Reader {
 public:
  Reader(const fs::path& path, const uint8_t* data, uint64_t size) : path_(path), data_(data), size_(size) {}

  uint64_t pos() const { return pos_; }
  uint64_t left() const { return size_ - pos_; }
  [[noreturn]] void fail(const std::string& what, uint64_t at) const { fail_at(path_, what, at); }

  void need(uint64_t n, std::string_view what) const {
    if (n > left())
      fail(fmt::format("{} needs {} bytes, the file has {} left (file size {}): the file is truncated", what,
                       n, left(), size_),
           pos_);
  }
  template <class T>
  T read(std::string_view what) {
    need(sizeof(T), what);
    uint64_t bits = 0;
    for (size_t i = 0; i < sizeof(T); ++i) bits |= uint64_t{data_[pos_ + i]} << (8 * i);
    pos_ += sizeof(T);
    if constexpr (std::is_same_v<T, float>) return std::bit_cast<float>(static_cast<uint32_t>(bits));
    else if constexpr (std::is_same_v<T, double>) return std::bit_cast<double>(bits);
    else return static_cast<T>(static_cast<std::make_unsigned_t<T>>(bits));
  }
  // A GGUF string: a u64 length, then that many bytes (not NUL-terminated). `what()` names it in an
  // error (only built then: strings are read by the hundred thousand in a vocabulary).
  template <class What>
  std::string_view string(What&& what, uint64_t max_bytes) {
    const uint64_t at = pos_;
    if (left() < 8) need(8, what() + "'s length");
    const uint64_t n = read<uint64_t>("");
    if (n > max_bytes) fail(fmt::format("{} is {} bytes long, more than the {} kiln reads", what(), n, max_bytes), at);
    if (n > left())
      fail(fmt::format("{} is {} bytes long, more than the {} bytes left in the file: the file is truncated",
                       what(), n, left()),
           at);
    std::string_view s(reinterpret_cast<const char*>(data_ + pos_), n);
    pos_ += n;
    return s;
  }

 private:
  const fs::path& path_;
  const uint8_t* data_;
  uint64_t size_;
  uint64_t pos_ = 0;
};

// A key or tensor name: non-empty valid UTF-8 without NUL (ggml keeps names as C strings, so a NUL
// would make two different names one).
void check_name(const Reader& r, std::string_view name, const std::string& what, uint64_t at) {
  if (name.empty()) r.fail(what + " is empty", at);
  if (!valid_utf8(name)) r.fail(what + " is not valid UTF-8", at);
  if (name.find('\0') != std::string_view::npos) r.fail(what + " " + shown(name) + " contains a NUL byte", at);
}

class MetadataParser {
 public:
  explicit MetadataParser(Reader& r) : r_(r) {}

  GGUFValueType value_type(const ValuePath& where, std::string_view role) {
    const uint64_t at = r_.pos();
    const auto id = r_.read<uint32_t>(fmt::format("{}: {}", where.text(), role));
    if (!known_value_type(id))
      r_.fail(fmt::format("{}: unknown {} id {} (GGUF's are 0..12)", where.text(), role, id), at);
    return static_cast<GGUFValueType>(id);
  }

  GGUFValue value(GGUFValueType type, ValuePath& where) {
    GGUFValue v;
    v.type = type;
    v.offset = r_.pos();
    if (values_ == kMaxMetadataValues)
      r_.fail(fmt::format("{}: more than {} metadata values (scalars and array elements) in the file",
                          where.text(), kMaxMetadataValues),
              v.offset);
    ++values_;
    // One check up front, so the reads below cannot fail and no message is built per value.
    if (r_.left() < min_value_bytes(type))
      r_.fail(fmt::format("{} ({}) needs at least {} bytes, the file has {} left: the file is truncated",
                          where.text(), gguf_value_type_name(type), min_value_bytes(type), r_.left()),
              v.offset);
    switch (type) {
      case GGUFValueType::u8: v.value = uint64_t{r_.read<uint8_t>("")}; break;
      case GGUFValueType::u16: v.value = uint64_t{r_.read<uint16_t>("")}; break;
      case GGUFValueType::u32: v.value = uint64_t{r_.read<uint32_t>("")}; break;
      case GGUFValueType::u64: v.value = r_.read<uint64_t>(""); break;
      case GGUFValueType::i8: v.value = int64_t{r_.read<int8_t>("")}; break;
      case GGUFValueType::i16: v.value = int64_t{r_.read<int16_t>("")}; break;
      case GGUFValueType::i32: v.value = int64_t{r_.read<int32_t>("")}; break;
      case GGUFValueType::i64: v.value = r_.read<int64_t>(""); break;
      case GGUFValueType::f32: v.value = double{r_.read<float>("")}; break;
      case GGUFValueType::f64: v.value = r_.read<double>(""); break;
      case GGUFValueType::boolean: {
        const uint8_t b = r_.read<uint8_t>("");
        // The spec: anything but 0 or 1 is an invalid file.
        if (b > 1) r_.fail(fmt::format("{}: bool byte is {}, expected 0 or 1", where.text(), b), v.offset);
        v.value = b == 1;
        break;
      }
      case GGUFValueType::string:
        v.value = std::string(r_.string([&] { return where.text(); }, kMaxStringBytes));
        break;
      case GGUFValueType::array: v.value = array(v, where); break;
    }
    return v;
  }

 private:
  std::vector<GGUFValue> array(GGUFValue& v, ValuePath& where) {
    if (where.depth == kMaxArrayDepth)
      r_.fail(fmt::format("{}: arrays nest more than {} deep", where.text(), kMaxArrayDepth), v.offset);
    v.element_type = value_type(where, "array element type");
    const uint64_t count_at = r_.pos();
    const uint64_t n = r_.read<uint64_t>(where.text() + ": array length");
    // Both checks come before the reserve: the count is bounded by the values kiln holds and by
    // what the rest of the file could encode (n * min_value_bytes cannot overflow after the first).
    if (n > kMaxMetadataValues - values_)
      r_.fail(fmt::format("{}: array of {} {} elements, more than the {} metadata values kiln reads ({} "
                          "left)",
                          where.text(), n, gguf_value_type_name(v.element_type), kMaxMetadataValues,
                          kMaxMetadataValues - values_),
              count_at);
    const uint64_t min_bytes = n * min_value_bytes(v.element_type);
    if (min_bytes > r_.left())
      r_.fail(fmt::format("{}: array of {} {} elements needs at least {} bytes, the file has {} left: the "
                          "file is truncated",
                          where.text(), n, gguf_value_type_name(v.element_type), min_bytes, r_.left()),
              count_at);
    std::vector<GGUFValue> elements;
    elements.reserve(n);
    ++where.depth;
    for (uint64_t i = 0; i < n; ++i) {
      where.index[where.depth - 1] = i;
      elements.push_back(value(v.element_type, where));
    }
    --where.depth;
    return elements;
  }

  Reader& r_;
  uint64_t values_ = 0;
};

struct TensorInfoAt {  // where a tensor's fields are, for messages after all infos are read
  uint64_t offset_field = 0;
  uint64_t bytes = 0;
};

}  // namespace

// ==== names and type traits ======================================================================

std::string_view ggml_type_name(GGMLType type) {
  const TypeTraits* t = type_traits(static_cast<uint32_t>(type));
  return t ? t->name : "?";
}

std::optional<int64_t> ggml_block_size(uint32_t type_id) {
  const TypeTraits* t = type_traits(type_id);
  if (!t) return std::nullopt;
  return t->block_size;
}

std::optional<int64_t> ggml_block_bytes(uint32_t type_id) {
  const TypeTraits* t = type_traits(type_id);
  if (!t) return std::nullopt;
  return t->block_bytes;
}

std::string_view gguf_value_type_name(GGUFValueType type) {
  switch (type) {
    case GGUFValueType::u8: return "u8";
    case GGUFValueType::i8: return "i8";
    case GGUFValueType::u16: return "u16";
    case GGUFValueType::i16: return "i16";
    case GGUFValueType::u32: return "u32";
    case GGUFValueType::i32: return "i32";
    case GGUFValueType::f32: return "f32";
    case GGUFValueType::boolean: return "bool";
    case GGUFValueType::string: return "string";
    case GGUFValueType::array: return "array";
    case GGUFValueType::u64: return "u64";
    case GGUFValueType::i64: return "i64";
    case GGUFValueType::f64: return "f64";
  }
  return "?";
}

int64_t GGUFTensor::elements() const {
  // open() checked that the product fits int64.
  return std::accumulate(dims.begin(), dims.end(), int64_t{1}, std::multiplies<>());
}

std::vector<int64_t> GGUFTensor::shape() const { return {dims.rbegin(), dims.rend()}; }

// ==== GGUFFile::open =============================================================================

GGUFFile GGUFFile::open(const fs::path& path) {
  GGUFFile file;
  file.path_ = path;
  MappedFile mapping = map_file(path, "load_gguf");
  const uint8_t* bytes = mapping.bytes();
  Reader r(path, bytes, mapping.size);

  // Header.
  if (mapping.size >= 4 && std::memcmp(bytes, "GGUF", 4) != 0)
    r.fail(fmt::format("not a GGUF file: the magic is {:02x} {:02x} {:02x} {:02x}, expected 47 47 55 46 ('GGUF')",
                       bytes[0], bytes[1], bytes[2], bytes[3]),
           0);
  if (mapping.size < kHeaderBytes)
    r.fail(fmt::format("file is {} bytes, shorter than the {}-byte GGUF header", mapping.size, kHeaderBytes), 0);
  r.read<uint32_t>("magic");
  const uint32_t version = r.read<uint32_t>("version");
  if (version == 1)
    r.fail("GGUF version 1 is not supported (kiln reads versions 2 and 3; version 1 files predate "
           "August 2023: convert the model again with a current llama.cpp)",
           4);
  if (version != 2 && version != 3) {
    const uint32_t swapped = __builtin_bswap32(version);
    if (swapped >= 1 && swapped <= 3)
      r.fail(fmt::format("big-endian GGUF file (the version reads as {:#010x}, version {} byte-swapped): kiln "
                         "reads little-endian GGUF files only",
                         version, swapped),
             4);
    r.fail(fmt::format("GGUF version {} is not supported (kiln reads versions 2 and 3)", version), 4);
  }
  file.version_ = version;
  const uint64_t tensor_count = r.read<uint64_t>("tensor count");
  const uint64_t kv_count = r.read<uint64_t>("metadata count");
  if (tensor_count > kMaxTensors)
    r.fail(fmt::format("tensor count {} is more than the {} kiln reads", tensor_count, kMaxTensors), 8);
  if (tensor_count * kMinTensorInfoBytes > r.left())
    r.fail(fmt::format("tensor count {} needs at least {} bytes of tensor infos, the file has {} after the "
                       "header: the file is truncated or the count is wrong",
                       tensor_count, tensor_count * kMinTensorInfoBytes, r.left()),
           8);
  if (kv_count > kMaxKeys)
    r.fail(fmt::format("metadata count {} is more than the {} keys kiln reads", kv_count, kMaxKeys), 16);
  if (kv_count * kMinKeyValueBytes > r.left())
    r.fail(fmt::format("metadata count {} needs at least {} bytes of metadata, the file has {} after the "
                       "header: the file is truncated or the count is wrong",
                       kv_count, kv_count * kMinKeyValueBytes, r.left()),
           16);

  // Metadata.
  MetadataParser parser(r);
  for (uint64_t i = 0; i < kv_count; ++i) {
    const uint64_t key_at = r.pos();
    const std::string_view key = r.string([&] { return fmt::format("metadata key {}", i); }, kMaxKeyBytes);
    check_name(r, key, fmt::format("metadata key {}", i), key_at);
    if (file.metadata_.find(key) != file.metadata_.end())
      r.fail(fmt::format("duplicate metadata key {} (entry {} of {})", shown(key), i, kv_count), key_at);
    ValuePath where{.key = key};
    const GGUFValueType type = parser.value_type(where, "value type");
    GGUFValue value = parser.value(type, where);
    file.metadata_.emplace(std::string(key), std::move(value));
  }

  if (const GGUFValue* a = file.find(kAlignmentKey)) {
    if (a->type != GGUFValueType::u32)
      r.fail(fmt::format("key '{}' is {}, expected u32", kAlignmentKey, describe(*a)), a->offset);
    const uint64_t alignment = std::get<uint64_t>(a->value);
    if (alignment == 0 || !std::has_single_bit(alignment))
      r.fail(fmt::format("key '{}' is {}, expected a power of two", kAlignmentKey, alignment), a->offset);
    file.alignment_ = alignment;
  } else {
    file.alignment_ = kDefaultAlignment;
  }

  // Tensor infos.
  const uint64_t infos_at = r.pos();
  if (tensor_count * kMinTensorInfoBytes > r.left())
    r.fail(fmt::format("tensor count {} (at byte 8) needs at least {} bytes of tensor infos, the file has {} "
                       "after the metadata: the file is truncated or the count is wrong",
                       tensor_count, tensor_count * kMinTensorInfoBytes, r.left()),
           infos_at);
  file.tensors_.reserve(tensor_count);
  std::vector<TensorInfoAt> at;
  at.reserve(tensor_count);
  for (uint64_t i = 0; i < tensor_count; ++i) {
    const uint64_t name_at = r.pos();
    const std::string_view name = r.string([&] { return fmt::format("tensor {} name", i); }, kMaxTensorNameBytes);
    check_name(r, name, fmt::format("tensor {} name", i), name_at);
    if (auto it = file.tensor_index_.find(name); it != file.tensor_index_.end())
      r.fail(fmt::format("duplicate tensor name {} (tensors {} and {})", shown(name), it->second, i), name_at);
    GGUFTensor t;
    t.name = std::string(name);
    const std::string what = "tensor " + shown(name);

    const uint64_t ndims_at = r.pos();
    const uint32_t n_dims = r.read<uint32_t>(what + ": dims count");
    if (n_dims > kMaxDims)
      r.fail(fmt::format("{}: {} dims, GGUF allows at most {}", what, n_dims, kMaxDims), ndims_at);
    int64_t elements = 1;
    for (uint32_t d = 0; d < n_dims; ++d) {
      const uint64_t dim_at = r.pos();
      const uint64_t dim = r.read<uint64_t>(fmt::format("{}: dim {}", what, d));
      if (dim == 0 || dim > static_cast<uint64_t>(INT64_MAX))
        r.fail(fmt::format("{}: dim {} is {}, expected 1..{}", what, d, static_cast<int64_t>(dim), INT64_MAX),
               dim_at);
      t.dims.push_back(static_cast<int64_t>(dim));
      if (__builtin_mul_overflow(elements, static_cast<int64_t>(dim), &elements))
        r.fail(fmt::format("{}: dims {} have more than {} (INT64_MAX) elements", what, fmt::join(t.dims, " x "),
                           INT64_MAX),
               dim_at);
    }

    const uint64_t type_at = r.pos();
    const uint32_t type_id = r.read<uint32_t>(what + ": ggml type");
    const TypeTraits* traits = type_traits(type_id);
    if (!traits)
      r.fail(fmt::format("{}: ggml type id {} is not one kiln reads ({})", what, type_id, known_type_names()),
             type_at);
    t.type = traits->type;
    const int64_t row = t.dims.empty() ? 1 : t.dims[0];
    if (row % traits->block_size != 0)
      r.fail(fmt::format("{} ({}): dims[0] = {} is not a multiple of the block size {}", what, traits->name, row,
                         traits->block_size),
             type_at);
    int64_t nbytes = 0;
    if (__builtin_mul_overflow(elements / traits->block_size, traits->block_bytes, &nbytes))
      r.fail(fmt::format("{} ({}): {} elements are {} blocks of {} bytes, which overflows int64", what,
                         traits->name, elements, elements / traits->block_size, traits->block_bytes),
             type_at);

    const uint64_t offset_at = r.pos();
    t.offset = r.read<uint64_t>(what + ": offset");
    at.push_back({offset_at, static_cast<uint64_t>(nbytes)});
    file.tensor_index_.emplace(t.name, file.tensors_.size());
    file.tensors_.push_back(std::move(t));
  }

  // Tensor data: the data section starts at the next multiple of the alignment.
  const uint64_t infos_end = r.pos();
  uint64_t data_start = 0;
  if (__builtin_add_overflow(infos_end, file.alignment_ - 1, &data_start))
    r.fail(fmt::format("the data section's start (byte {} aligned to {}) overflows uint64", infos_end,
                       file.alignment_),
           infos_end);
  data_start &= ~(file.alignment_ - 1);
  if (tensor_count > 0 && data_start > mapping.size)
    r.fail(fmt::format("the data section starts at byte {} (the tensor infos end at byte {}, aligned to {}), "
                       "past the end of the file ({} bytes): the file is truncated",
                       data_start, infos_end, file.alignment_, mapping.size),
           infos_end);
  const uint64_t data_size = tensor_count > 0 ? mapping.size - data_start : 0;
  for (size_t i = 0; i < file.tensors_.size(); ++i) {
    GGUFTensor& t = file.tensors_[i];
    const std::string what = "tensor " + shown(t.name);
    if (t.offset % file.alignment_ != 0)
      r.fail(fmt::format("{}: offset {} is not a multiple of the alignment {}", what, t.offset, file.alignment_),
             at[i].offset_field);
    // Subtractions, not sums: nothing here can wrap.
    if (t.offset > data_size || at[i].bytes > data_size - t.offset)
      r.fail(fmt::format("{}: its {} bytes at offset {} of the data section (file byte {}) end past the end of "
                         "the file ({} bytes, {} of them data): the file is truncated or the offset is wrong",
                         what, at[i].bytes, t.offset, data_start + std::min(t.offset, data_size), mapping.size,
                         data_size),
             at[i].offset_field);
    t.data = std::span<const uint8_t>(bytes + data_start + t.offset, at[i].bytes);
  }
  // Overlaps: in offset order, each tensor must end before the next begins.
  std::vector<size_t> order(file.tensors_.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::sort(order.begin(), order.end(),
            [&](size_t a, size_t b) { return file.tensors_[a].offset < file.tensors_[b].offset; });
  for (size_t k = 1; k < order.size(); ++k) {
    const GGUFTensor& prev = file.tensors_[order[k - 1]];
    const GGUFTensor& next = file.tensors_[order[k]];
    const uint64_t prev_end = prev.offset + at[order[k - 1]].bytes;
    if (next.offset < prev_end)
      r.fail(fmt::format("tensor {}: data section bytes [{}, {}) overlap the bytes [{}, {}) of tensor {}",
                         shown(next.name), next.offset, next.offset + at[order[k]].bytes, prev.offset, prev_end,
                         shown(prev.name)),
             at[order[k]].offset_field);
  }

  file.mapping_ = std::move(mapping.base);
  return file;
}

// ==== metadata getters ===========================================================================

namespace {

[[noreturn]] void wrong_type(const fs::path& path, std::string_view key, const GGUFValue& v,
                             std::string_view expected) {
  fail_at(path, fmt::format("key {} is {}, expected {}", shown(key), describe(v), expected), v.offset);
}

// An integer value as uint64 / int64, or nullopt when it does not fit.
std::optional<uint64_t> as_u64(const GGUFValue& v) {
  if (const auto* u = std::get_if<uint64_t>(&v.value)) return *u;
  const int64_t i = std::get<int64_t>(v.value);
  if (i < 0) return std::nullopt;
  return static_cast<uint64_t>(i);
}
std::optional<int64_t> as_i64(const GGUFValue& v) {
  if (const auto* i = std::get_if<int64_t>(&v.value)) return *i;
  const uint64_t u = std::get<uint64_t>(v.value);
  if (u > static_cast<uint64_t>(INT64_MAX)) return std::nullopt;
  return static_cast<int64_t>(u);
}
double as_double(const GGUFValue& v) {
  if (const auto* d = std::get_if<double>(&v.value)) return *d;
  if (const auto* u = std::get_if<uint64_t>(&v.value)) return static_cast<double>(*u);
  return static_cast<double>(std::get<int64_t>(v.value));
}

}  // namespace

const GGUFValue* GGUFFile::find(std::string_view key) const {
  auto it = metadata_.find(key);
  return it == metadata_.end() ? nullptr : &it->second;
}

namespace {
const GGUFValue& require(const GGUFFile& file, std::string_view key) {
  const GGUFValue* v = file.find(key);
  if (!v) fail(file.path(), fmt::format("no metadata key {}", shown(key)));
  return *v;
}
const std::vector<GGUFValue>& array_of(const GGUFFile& file, std::string_view key, bool (*accept)(GGUFValueType),
                                       std::string_view expected) {
  const GGUFValue& v = require(file, key);
  if (v.type != GGUFValueType::array || !accept(v.element_type)) wrong_type(file.path(), key, v, expected);
  return std::get<std::vector<GGUFValue>>(v.value);
}
}  // namespace

uint64_t GGUFFile::get_u64(std::string_view key) const {
  const GGUFValue& v = require(*this, key);
  if (!is_integer(v.type)) wrong_type(path_, key, v, "an integer");
  const auto u = as_u64(v);
  if (!u) wrong_type(path_, key, v, "a non-negative integer");
  return *u;
}

int64_t GGUFFile::get_i64(std::string_view key) const {
  const GGUFValue& v = require(*this, key);
  if (!is_integer(v.type)) wrong_type(path_, key, v, "an integer");
  const auto i = as_i64(v);
  if (!i) wrong_type(path_, key, v, "an integer of at most INT64_MAX");
  return *i;
}

double GGUFFile::get_f64(std::string_view key) const {
  const GGUFValue& v = require(*this, key);
  if (!is_float(v.type)) wrong_type(path_, key, v, "f32 or f64");
  return std::get<double>(v.value);
}

bool GGUFFile::get_bool(std::string_view key) const {
  const GGUFValue& v = require(*this, key);
  if (v.type != GGUFValueType::boolean) wrong_type(path_, key, v, "bool");
  return std::get<bool>(v.value);
}

const std::string& GGUFFile::get_string(std::string_view key) const {
  const GGUFValue& v = require(*this, key);
  if (v.type != GGUFValueType::string) wrong_type(path_, key, v, "string");
  return std::get<std::string>(v.value);
}

std::vector<std::string_view> GGUFFile::get_string_array(std::string_view key) const {
  const auto& a = array_of(*this, key, [](GGUFValueType t) { return t == GGUFValueType::string; },
                           "array of string");
  std::vector<std::string_view> out;
  out.reserve(a.size());
  for (const GGUFValue& e : a) out.push_back(std::get<std::string>(e.value));
  return out;
}

std::vector<double> GGUFFile::get_f64_array(std::string_view key) const {
  const auto& a = array_of(*this, key, [](GGUFValueType t) { return is_integer(t) || is_float(t); },
                           "an array of numbers (integers, f32 or f64)");
  std::vector<double> out;
  out.reserve(a.size());
  for (const GGUFValue& e : a) out.push_back(as_double(e));
  return out;
}

std::vector<int64_t> GGUFFile::get_i64_array(std::string_view key) const {
  const auto& a = array_of(*this, key, is_integer, "an array of integers");
  std::vector<int64_t> out;
  out.reserve(a.size());
  for (size_t i = 0; i < a.size(); ++i) {
    const auto v = as_i64(a[i]);
    if (!v)
      fail_at(path_, fmt::format("key {}[{}] is {}, more than INT64_MAX", shown(key), i, describe(a[i])), a[i].offset);
    out.push_back(*v);
  }
  return out;
}

std::optional<uint64_t> GGUFFile::find_u64(std::string_view key) const {
  if (!contains(key)) return std::nullopt;
  return get_u64(key);
}
std::optional<double> GGUFFile::find_f64(std::string_view key) const {
  if (!contains(key)) return std::nullopt;
  return get_f64(key);
}
std::optional<bool> GGUFFile::find_bool(std::string_view key) const {
  if (!contains(key)) return std::nullopt;
  return get_bool(key);
}
std::optional<std::string> GGUFFile::find_string(std::string_view key) const {
  if (!contains(key)) return std::nullopt;
  return get_string(key);
}

// ==== tensors ====================================================================================

const GGUFTensor* GGUFFile::find_tensor(std::string_view name) const {
  auto it = tensor_index_.find(name);
  return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
}

const GGUFTensor& GGUFFile::tensor(std::string_view name) const {
  if (const GGUFTensor* t = find_tensor(name)) return *t;
  std::string some;
  for (size_t i = 0; i < tensors_.size() && i < 5; ++i) some += (i ? ", " : "") + tensors_[i].name;
  if (tensors_.size() > 5) some += ", ...";
  fail(path_, fmt::format("no tensor {} (the file has {} tensors{}{})", shown(name), tensors_.size(),
                          tensors_.empty() ? "" : ": ", some));
}

bool is_gguf_file(const fs::path& path) {
  std::error_code ec;
  if (!fs::is_regular_file(path, ec)) return false;
  std::ifstream in(path, std::ios::binary);
  char magic[4] = {};
  return in.read(magic, 4) && std::memcmp(magic, "GGUF", 4) == 0;
}

}  // namespace kiln::pipelines
