// Test-only GGUF writer, byte by byte and independent of the reader (it shares only the enums), so
// tests can build valid files and hostile ones: counts, lengths, type ids and offsets are whatever the
// test says. Also used by fuzz/make_gguf_seeds.cpp for the seed corpus.
//
//   gguf_writer::Spec spec;
//   spec.metadata.push_back({"general.architecture", gguf_writer::str("llama")});
//   spec.tensors.push_back({"w", {4, 2}, GGMLType::f32, gguf_writer::pattern(32)});
//   gguf_writer::Built file = gguf_writer::build(spec);   // file.bytes; file.at["offset:w"], ...
#pragma once

#include <bit>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kiln/pipelines/gguf.h"

namespace kiln::testing::gguf_writer {

using kiln::pipelines::GGMLType;
using kiln::pipelines::GGUFValueType;

// Little-endian bytes.
class Bytes {
 public:
  template <class T>
  Bytes& le(T v) {
    uint64_t bits = 0;
    if constexpr (std::is_same_v<T, float>) bits = std::bit_cast<uint32_t>(v);
    else if constexpr (std::is_same_v<T, double>) bits = std::bit_cast<uint64_t>(v);
    else bits = static_cast<uint64_t>(v);
    for (size_t i = 0; i < sizeof(T); ++i) data.push_back(static_cast<char>(bits >> (8 * i)));
    return *this;
  }
  Bytes& u32(uint32_t v) { return le(v); }
  Bytes& u64(uint64_t v) { return le(v); }
  Bytes& str(std::string_view s) {  // GGUF v2/v3 string: u64 length, then the bytes
    u64(s.size());
    data += s;
    return *this;
  }
  Bytes& raw(std::string_view s) {
    data += s;
    return *this;
  }
  size_t size() const { return data.size(); }
  std::string data;
};

inline void put_le(std::string& bytes, size_t at, uint64_t v, size_t width) {
  for (size_t i = 0; i < width; ++i) bytes[at + i] = static_cast<char>(v >> (8 * i));
}

// A metadata value: its type id and its encoding after the type id.
struct Value {
  uint32_t type = 0;
  std::string payload;
};

template <class T>
Value scalar(GGUFValueType type, T v) {
  return {static_cast<uint32_t>(type), Bytes().le(v).data};
}
inline Value u8(uint8_t v) { return scalar(GGUFValueType::u8, v); }
inline Value i8(int8_t v) { return scalar(GGUFValueType::i8, v); }
inline Value u16(uint16_t v) { return scalar(GGUFValueType::u16, v); }
inline Value i16(int16_t v) { return scalar(GGUFValueType::i16, v); }
inline Value u32(uint32_t v) { return scalar(GGUFValueType::u32, v); }
inline Value i32(int32_t v) { return scalar(GGUFValueType::i32, v); }
inline Value u64(uint64_t v) { return scalar(GGUFValueType::u64, v); }
inline Value i64(int64_t v) { return scalar(GGUFValueType::i64, v); }
inline Value f32(float v) { return scalar(GGUFValueType::f32, v); }
inline Value f64(double v) { return scalar(GGUFValueType::f64, v); }
inline Value boolean(bool v) { return scalar(GGUFValueType::boolean, uint8_t{v}); }
inline Value str(std::string_view s) { return {static_cast<uint32_t>(GGUFValueType::string), Bytes().str(s).data}; }
// An array of `element` (the items are not checked against it, so tests can lie); `count` overrides
// the written length.
inline Value array(GGUFValueType element, const std::vector<Value>& items, std::optional<uint64_t> count = {}) {
  Bytes b;
  b.u32(static_cast<uint32_t>(element)).u64(count.value_or(items.size()));
  for (const Value& v : items) b.raw(v.payload);
  return {static_cast<uint32_t>(GGUFValueType::array), b.data};
}

struct Tensor {
  std::string name;
  std::vector<uint64_t> dims;  // ggml order
  uint32_t type = 0;
  std::string data;                 // written at the tensor's offset in the data section
  std::optional<uint64_t> offset;   // default: packed after the previous tensor, aligned
  Tensor(std::string n, std::vector<uint64_t> d, GGMLType t, std::string bytes, std::optional<uint64_t> off = {})
      : name(std::move(n)), dims(std::move(d)), type(static_cast<uint32_t>(t)), data(std::move(bytes)), offset(off) {}
  Tensor(std::string n, std::vector<uint64_t> d, uint32_t t, std::string bytes, std::optional<uint64_t> off = {})
      : name(std::move(n)), dims(std::move(d)), type(t), data(std::move(bytes)), offset(off) {}
};

struct Spec {
  uint32_t version = 3;
  std::vector<std::pair<std::string, Value>> metadata;  // in file order; general.alignment is not added
  std::vector<Tensor> tensors;
  uint64_t alignment = 32;  // used to place the data section and the default offsets
  std::optional<uint64_t> tensor_count, kv_count;  // override the header's counts
};

// The file and where its parts are: "version", "tensor_count", "kv_count"; per key K "key:K" (its
// length field) and "value:K" (its type id); per tensor N "tensor:N" (its name's length field),
// "dims:N" (its dims count), "type:N", "offset:N", "bytes:N" (its data's first byte in the file);
// "data" (the data section) and "infos_end".
struct Built {
  std::string bytes;
  std::map<std::string, size_t> at;
};

inline uint64_t align_up(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

inline Built build(const Spec& spec) {
  Built out;
  Bytes b;
  b.raw("GGUF");
  out.at["version"] = b.size();
  b.u32(spec.version);
  out.at["tensor_count"] = b.size();
  b.u64(spec.tensor_count.value_or(spec.tensors.size()));
  out.at["kv_count"] = b.size();
  b.u64(spec.kv_count.value_or(spec.metadata.size()));
  for (const auto& [key, value] : spec.metadata) {
    out.at["key:" + key] = b.size();
    b.str(key);
    out.at["value:" + key] = b.size();
    b.u32(value.type).raw(value.payload);
  }
  std::vector<uint64_t> offsets;
  uint64_t next = 0;
  for (const Tensor& t : spec.tensors) {
    const uint64_t off = t.offset.value_or(align_up(next, spec.alignment));
    offsets.push_back(off);
    next = off + t.data.size();
    out.at["tensor:" + t.name] = b.size();
    b.str(t.name);
    out.at["dims:" + t.name] = b.size();
    b.u32(static_cast<uint32_t>(t.dims.size()));
    for (uint64_t d : t.dims) b.u64(d);
    out.at["type:" + t.name] = b.size();
    b.u32(t.type);
    out.at["offset:" + t.name] = b.size();
    b.u64(off);
  }
  out.at["infos_end"] = b.size();
  if (!spec.tensors.empty()) {
    const uint64_t data_start = align_up(b.size(), spec.alignment);
    out.at["data"] = data_start;
    uint64_t end = data_start;
    for (size_t i = 0; i < spec.tensors.size(); ++i)
      end = std::max<uint64_t>(end, data_start + offsets[i] + spec.tensors[i].data.size());
    b.data.resize(end, '\0');  // no padding after the last tensor: a cut anywhere loses bytes
    for (size_t i = 0; i < spec.tensors.size(); ++i) {
      out.at["bytes:" + spec.tensors[i].name] = data_start + offsets[i];
      b.data.replace(data_start + offsets[i], spec.tensors[i].data.size(), spec.tensors[i].data);
    }
  }
  out.bytes = std::move(b.data);
  return out;
}

// n bytes of a pattern that differs per seed and per position (so a view at the wrong offset shows).
inline std::string pattern(size_t n, uint8_t seed = 1) {
  std::string s(n, '\0');
  for (size_t i = 0; i < n; ++i) s[i] = static_cast<char>((i * 131 + seed * 29 + (i >> 8)) & 0xFF);
  return s;
}

inline void write_file(const std::filesystem::path& path, std::string_view bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// A small valid file with every value type, an array of each kind, a nested array and tensors of
// a few ggml types: the tests' and the seed corpus's base.
inline Spec sample_spec(uint32_t version = 3) {
  Spec s;
  s.version = version;
  s.metadata = {
      {"general.architecture", str("llama")},
      {"general.name", str("kiln test \xff bytes")},  // string values are bytes, not UTF-8
      {"test.u8", u8(200)},
      {"test.i8", i8(-100)},
      {"test.u16", u16(60000)},
      {"test.i16", i16(-30000)},
      {"test.u32", u32(4000000000u)},
      {"test.i32", i32(-2000000000)},
      {"test.u64", u64(UINT64_MAX)},
      {"test.i64", i64(INT64_MIN)},
      {"test.f32", f32(1.5f)},
      {"test.f64", f64(-0.125)},
      {"test.bool", boolean(true)},
      {"test.empty", str("")},
      {"tokenizer.ggml.tokens", array(GGUFValueType::string, {str("<s>"), str("</s>"), str("hello")})},
      {"tokenizer.ggml.scores", array(GGUFValueType::f32, {f32(0.0f), f32(-1.25f), f32(3.0f)})},
      {"tokenizer.ggml.token_type", array(GGUFValueType::i32, {i32(3), i32(3), i32(1)})},
      {"test.bools", array(GGUFValueType::boolean, {boolean(false), boolean(true)})},
      {"test.empty_array", array(GGUFValueType::u64, {})},
      {"test.nested", array(GGUFValueType::array, {array(GGUFValueType::u16, {u16(1), u16(2)}),
                                                   array(GGUFValueType::string, {str("x")})})},
  };
  s.tensors = {
      Tensor("token_embd.weight", {4, 3}, GGMLType::f32, pattern(48, 1)),
      Tensor("blk.0.attn_q.weight", {32, 2}, GGMLType::q8_0, pattern(2 * 34, 2)),
      Tensor("blk.0.ffn_down.weight", {256}, GGMLType::q4_k, pattern(144, 3)),
      Tensor("output_norm.weight", {4}, GGMLType::f16, pattern(8, 4)),
  };
  return s;
}

}  // namespace kiln::testing::gguf_writer
