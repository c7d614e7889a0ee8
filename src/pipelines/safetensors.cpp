// safetensors reader and writer. The file is untrusted: every length, offset, shape and dtype in the
// header is checked before any byte of tensor data is touched (see docs/weights.md for the checks).
#include "kiln/pipelines/safetensors.h"

#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <string_view>
#include <utility>

#include "graph/checked.h"
#include "pipelines/json_input.h"
#include "pipelines/mapped_file.h"

namespace kiln::pipelines {
namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

constexpr const char* kMetadataKey = "__metadata__";
constexpr uint64_t kHeaderLengthBytes = 8;
// The safetensors reference implementation refuses headers over 100 MB; so does kiln, so a file
// cannot make it parse (and hold) more than that.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;
constexpr size_t kMaxRank = 64;
// A header nests three levels (header, entry, shape); metadata values are strings.
constexpr int kMaxHeaderDepth = 8;

// safetensors' dtype names and kiln's; anything else (F8_E4M3, C64, ...) is rejected.
constexpr std::pair<std::string_view, DType> kDTypeNames[] = {
    {"F32", DType::f32},      {"F16", DType::f16}, {"BF16", DType::bf16}, {"F64", DType::f64},
    {"I8", DType::i8},        {"I16", DType::i16}, {"I32", DType::i32},   {"I64", DType::i64},
    {"U8", DType::u8},        {"U16", DType::u16}, {"U32", DType::u32},   {"U64", DType::u64},
    {"BOOL", DType::boolean},
};

std::string_view safetensors_dtype_name(DType dtype) {
  for (const auto& [name, d] : kDTypeNames)
    if (d == dtype) return name;
  return "?";
}

[[noreturn]] void fail(const fs::path& path, const std::string& what) {
  throw LoadError(fmt::format("load_safetensors: {}: {}", path.string(), what));
}

std::string errno_text() { return std::strerror(errno); }

// A JSON value that must be a non-negative integer that fits uint64.
bool as_u64(const json& v, uint64_t* out) {
  if (v.is_number_unsigned()) {
    *out = v.get<uint64_t>();
    return true;
  }
  if (v.is_number_integer() && v.get<int64_t>() >= 0) {
    *out = static_cast<uint64_t>(v.get<int64_t>());
    return true;
  }
  return false;
}

std::string json_text(const json& v) { return json_input::describe(v); }

SafetensorsFile::Entry parse_entry(const fs::path& path, const std::string& name, const json& value,
                                   uint64_t data_size, uint64_t data_start) {
  auto bad = [&](const std::string& what) { fail(path, fmt::format("tensor '{}': {}", name, what)); };
  if (!value.is_object()) bad("entry is " + json_text(value) + ", expected an object");

  SafetensorsFile::Entry entry{};
  auto dtype_it = value.find("dtype");
  if (dtype_it == value.end()) bad("missing 'dtype'");
  if (!dtype_it->is_string()) bad("dtype is " + json_text(*dtype_it) + ", expected a string");
  const std::string& dtype_text = dtype_it->get_ref<const std::string&>();
  auto known = std::find_if(std::begin(kDTypeNames), std::end(kDTypeNames),
                            [&](const auto& p) { return p.first == dtype_text; });
  if (known == std::end(kDTypeNames))
    bad(
        fmt::format("unsupported dtype '{}' (supported: F32, F16, BF16, F64, I8, I16, I32, I64, U8, U16, "
                    "U32, U64, BOOL)",
                    dtype_text));
  entry.dtype = known->second;

  auto shape_it = value.find("shape");
  if (shape_it == value.end()) bad("missing 'shape'");
  if (!shape_it->is_array()) bad("shape is " + json_text(*shape_it) + ", expected a list of integers");
  if (shape_it->size() > kMaxRank)
    bad(fmt::format("shape has rank {}, more than the {} kiln reads", shape_it->size(), kMaxRank));
  const std::string what =
      fmt::format("load_safetensors: {}: tensor '{}': shape {}", path.string(), name, json_text(*shape_it));
  int64_t numel = 1;
  for (const json& d : *shape_it) {
    uint64_t dim;
    if (!as_u64(d, &dim))
      bad(fmt::format("shape {} has dim {}, expected non-negative integers", json_text(*shape_it),
                      json_text(d)));
    if (dim > static_cast<uint64_t>(INT64_MAX))
      bad(fmt::format("shape {} has more elements than fit in int64", json_text(*shape_it)));
    numel = checked_mul<LoadError>(numel, static_cast<int64_t>(dim), what + ": element count");
    entry.shape.push_back(static_cast<int64_t>(dim));
  }
  const int64_t nbytes = checked_mul<LoadError>(numel, static_cast<int64_t>(dtype_size(entry.dtype)),
                                                what + " of " + dtype_text + ": bytes");

  auto offsets_it = value.find("data_offsets");
  if (offsets_it == value.end()) bad("missing 'data_offsets'");
  const json& offsets = *offsets_it;
  if (!offsets.is_array() || offsets.size() != 2 || !as_u64(offsets[0], &entry.begin) ||
      !as_u64(offsets[1], &entry.end))
    bad("data_offsets is " + json_text(offsets) + ", expected [begin, end] of non-negative integers");
  // Offsets are relative to the data section; the messages also give file bytes, which is what a hex
  // dump shows.
  const std::string where = fmt::format("data_offsets [{}, {}]", entry.begin, entry.end);
  if (entry.begin > entry.end) bad(where + ": begin is after end");
  if (entry.end > data_size)
    bad(fmt::format(
        "{}: end is past the data section of {} bytes (file bytes {}..{}; the data section is file "
        "bytes {}..{})",
        where, data_size, data_start + entry.begin, data_start + entry.end, data_start,
        data_start + data_size));
  if (entry.end - entry.begin != static_cast<uint64_t>(nbytes))
    bad(fmt::format("{} span {} bytes, but {}{} needs {} bytes ({} elements of {} bytes)", where,
                    entry.end - entry.begin, dtype_text, json_text(*shape_it), nbytes, numel,
                    dtype_size(entry.dtype)));
  return entry;
}

}  // namespace

// ==== SafetensorsFile ============================================================================

SafetensorsFile SafetensorsFile::open(const fs::path& path) {
  SafetensorsFile file;
  file.path_ = path;
  MappedFile mapping = map_file(path, "load_safetensors");
  if (mapping.size < kHeaderLengthBytes)
    fail(path, fmt::format("file is {} bytes, shorter than the 8-byte header length", mapping.size));
  const uint8_t* bytes = mapping.bytes();

  uint64_t header_len = 0;  // little-endian on disk, whatever the host
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | bytes[i];
  if (header_len > mapping.size - kHeaderLengthBytes)
    fail(path, fmt::format("header length {} (file bytes 0..8) is larger than the {} bytes after it (file "
                           "size {}): the file is truncated or not safetensors",
                           header_len, mapping.size - kHeaderLengthBytes, mapping.size));
  if (header_len > kMaxHeaderBytes)
    fail(path, fmt::format("header length {} (file bytes 0..8) is more than the {} bytes kiln reads",
                           header_len, kMaxHeaderBytes));
  const uint64_t data_start = kHeaderLengthBytes + header_len;
  const uint64_t data_size = mapping.size - data_start;

  // Duplicate keys are refused: the format forbids them, and keeping either copy would load a tensor
  // the writer may not have meant.
  json_input::Options options;
  options.max_depth = kMaxHeaderDepth;
  options.base_offset = kHeaderLengthBytes;
  options.offset_unit = "file byte";
  const json header = json_input::parse(
      std::string_view(reinterpret_cast<const char*>(bytes) + kHeaderLengthBytes, header_len),
      fmt::format("load_safetensors: {}: header (file bytes 8..{})", path.string(), data_start), options);
  if (!header.is_object())
    fail(path, fmt::format("header (file bytes 8..{}) is {}, expected a JSON object", data_start,
                           json_text(header)));

  for (const auto& [name, value] : header.items()) {
    if (name == kMetadataKey) {
      if (value.is_null()) continue;
      if (!value.is_object()) fail(path, "__metadata__ is " + json_text(value) + ", expected an object");
      for (const auto& [key, text] : value.items()) {
        if (!text.is_string())
          fail(path, fmt::format("__metadata__ '{}' is {}, expected a string", key, json_text(text)));
        file.metadata_[key] = text.get<std::string>();
      }
      continue;
    }
    file.entries_.emplace(name, parse_entry(path, name, value, data_size, data_start));
  }

  // Overlap check: sorted by begin, each tensor must end before the next starts. Empty tensors
  // occupy no bytes and overlap nothing.
  std::vector<std::pair<const std::string*, const Entry*>> by_begin;
  for (const auto& [name, entry] : file.entries_)
    if (entry.end > entry.begin) by_begin.emplace_back(&name, &entry);
  std::sort(by_begin.begin(), by_begin.end(),
            [](const auto& a, const auto& b) { return a.second->begin < b.second->begin; });
  for (size_t i = 1; i < by_begin.size(); ++i) {
    const auto& [prev_name, prev] = by_begin[i - 1];
    const auto& [name, entry] = by_begin[i];
    if (entry->begin < prev->end)
      fail(path, fmt::format("tensor '{}': data_offsets [{}, {}] overlap tensor '{}' data_offsets [{}, {}] "
                             "(file bytes {}..{})",
                             *name, entry->begin, entry->end, *prev_name, prev->begin, prev->end,
                             data_start + entry->begin, data_start + std::min(entry->end, prev->end)));
  }

  // A bool byte other than 0 or 1 is undefined behaviour to read as bool, so BOOL data (rare and small)
  // is checked here rather than trusted.
  for (const auto& [name, entry] : file.entries_) {
    if (entry.dtype != DType::boolean) continue;
    for (uint64_t i = entry.begin; i < entry.end; ++i)
      if (bytes[data_start + i] > 1)
        fail(path, fmt::format("tensor '{}': BOOL byte {} (file byte {}) is {}, expected 0 or 1", name,
                               i - entry.begin, data_start + i, bytes[data_start + i]));
  }

  file.data_ = bytes + data_start;
  file.mapping_ = std::move(mapping.base);
  return file;
}

std::vector<std::string> SafetensorsFile::names() const {
  std::vector<std::string> out;
  out.reserve(entries_.size());
  for (const auto& [name, entry] : entries_) out.push_back(name);
  return out;
}

bool SafetensorsFile::contains(const std::string& name) const { return entries_.count(name) != 0; }

Tensor SafetensorsFile::tensor(const std::string& name) const {
  auto it = entries_.find(name);
  if (it == entries_.end()) {
    std::string some;
    int shown = 0;
    for (const auto& [n, e] : entries_) {
      if (shown == 5) {
        some += ", ...";
        break;
      }
      some += (shown++ ? ", " : "") + n;
    }
    throw LoadError(fmt::format("SafetensorsFile::tensor: {}: no tensor '{}' (the file has {} tensors: {})",
                                path_.string(), name, entries_.size(), some));
  }
  const Entry& e = it->second;
  // const_cast: Tensor's data is mutable, and the mapping is copy-on-write (see map_file in
  // mapped_file.cpp).
  auto* p = const_cast<uint8_t*>(data_ + e.begin);
  if (reinterpret_cast<uintptr_t>(p) % dtype_size(e.dtype) == 0)
    return Tensor::view(mapping_, p, e.dtype, e.shape);
  // Writers other than kiln's and Python's need not align data; kernels read whole elements, so a
  // misaligned tensor is copied into aligned memory rather than refused.
  Tensor copy = Tensor::empty(e.dtype, e.shape);
  if (e.end > e.begin) std::memcpy(copy.data(), p, e.end - e.begin);
  return copy;
}

// ==== load_safetensors ===========================================================================

namespace {

void add_file(const fs::path& path, WeightsRegistry& out, std::map<std::string, fs::path>& source) {
  SafetensorsFile file = SafetensorsFile::open(path);
  for (const std::string& name : file.names()) {
    auto [it, inserted] = source.emplace(name, path);
    if (!inserted)
      throw LoadError(fmt::format("load_safetensors: tensor '{}' is in two files: {} and {}", name,
                                  it->second.string(), path.string()));
    out.emplace(name, file.tensor(name));
  }
}

WeightsRegistry load_index(const fs::path& index_path) {
  auto bad = [&](const std::string& what) { fail(index_path, what); };
  const json index = json_input::parse_file(index_path, "load_safetensors: " + index_path.string());
  if (!index.is_object() || !index.contains("weight_map") || !index["weight_map"].is_object())
    bad("expected an object with a \"weight_map\" object (tensor name -> shard file)");

  // Shards are plain file names next to the index; a path that leaves the directory is refused, as
  // the index is as untrusted as the shards.
  std::map<std::string, std::string> weight_map;
  std::set<std::string> shards;
  for (const auto& [name, shard] : index["weight_map"].items()) {
    if (!shard.is_string())
      bad(fmt::format("weight_map '{}' is {}, expected a file name", name, json_text(shard)));
    const fs::path shard_path(shard.get<std::string>());
    bool escapes = shard_path.empty() || shard_path.is_absolute();
    for (const auto& part : shard_path) escapes = escapes || part == "..";
    if (escapes)
      bad(fmt::format("weight_map '{}' names '{}', expected a file in the index's directory", name,
                      shard_path.string()));
    weight_map.emplace(name, shard_path.string());
    shards.insert(shard_path.string());
  }

  const fs::path dir = index_path.parent_path();
  WeightsRegistry out;
  std::map<std::string, fs::path> source;
  for (const std::string& shard : shards) add_file(dir / shard, out, source);
  for (const auto& [name, shard] : weight_map) {
    auto it = source.find(name);
    if (it == source.end())
      bad(fmt::format("weight_map names tensor '{}' in '{}', which does not have it", name, shard));
    if (it->second != dir / shard)
      bad(fmt::format("weight_map names tensor '{}' in '{}', but it is in {}", name, shard,
                      it->second.string()));
  }
  return out;
}

}  // namespace

WeightsRegistry load_safetensors(const fs::path& path) {
  std::error_code ec;
  if (fs::is_directory(path, ec)) {
    if (fs::exists(path / "model.safetensors.index.json", ec))
      return load_index(path / "model.safetensors.index.json");
    if (fs::exists(path / "model.safetensors", ec)) return load_safetensors(path / "model.safetensors");
    throw LoadError(
        fmt::format("load_safetensors: {}: directory has neither model.safetensors nor "
                    "model.safetensors.index.json",
                    path.string()));
  }
  if (path.filename().string().ends_with(".index.json")) return load_index(path);
  WeightsRegistry out;
  std::map<std::string, fs::path> source;
  add_file(path, out, source);
  return out;
}

// ==== save_safetensors ===========================================================================

void save_safetensors(const fs::path& path, const WeightsRegistry& tensors,
                      const std::map<std::string, std::string>& metadata) {
  // Data is laid out widest element first (as the Python writer does): with the data section 8-byte
  // aligned, every tensor then starts at a multiple of its element size and maps without a copy.
  std::vector<std::pair<const std::string*, Tensor>> order;
  for (const auto& [name, t] : tensors) {
    if (name == kMetadataKey) throw ValueError("save_safetensors: '__metadata__' cannot name a tensor");
    if (!t.defined()) throw ValueError(fmt::format("save_safetensors: tensor '{}' is undefined", name));
    if (t.device().kind != DeviceKind::CPU)
      throw ValueError(
          fmt::format("save_safetensors: tensor '{}' is on {}, expected cpu", name, t.device().to_string()));
    order.emplace_back(&name, t.contiguous());
  }
  std::stable_sort(order.begin(), order.end(), [](const auto& a, const auto& b) {
    return dtype_size(a.second.dtype()) > dtype_size(b.second.dtype());
  });

  json header = json::object();  // keys come out sorted
  if (!metadata.empty()) header[kMetadataKey] = metadata;
  uint64_t offset = 0;
  for (const auto& [name, t] : order) {
    header[*name] = {{"dtype", safetensors_dtype_name(t.dtype())},
                     {"shape", t.shape()},
                     {"data_offsets", {offset, offset + t.nbytes()}}};
    offset += t.nbytes();
  }
  std::string text = header.dump();
  // Padding with spaces (as the Python writer does) starts the data at a multiple of 8, so every
  // tensor of a page-aligned mapping is aligned to its element size.
  text.append((8 - text.size() % 8) % 8, ' ');

  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out)
    throw Error(
        fmt::format("save_safetensors: {}: cannot open for writing: {}", path.string(), errno_text()));
  uint8_t len[8];
  for (int i = 0; i < 8; ++i) len[i] = static_cast<uint8_t>(static_cast<uint64_t>(text.size()) >> (8 * i));
  out.write(reinterpret_cast<const char*>(len), 8);
  out.write(text.data(), static_cast<std::streamsize>(text.size()));
  for (const auto& [name, t] : order)
    out.write(static_cast<const char*>(t.data()), static_cast<std::streamsize>(t.nbytes()));
  out.flush();
  if (!out) throw Error(fmt::format("save_safetensors: {}: write failed: {}", path.string(), errno_text()));
}

}  // namespace kiln::pipelines
