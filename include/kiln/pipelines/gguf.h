// GGUF files (llama.cpp's format, versions 2 and 3): a little-endian header (magic "GGUF", version,
// tensor count, metadata count), typed key/value metadata, tensor infos (name, dims, ggml type,
// offset), then the tensor data at `general.alignment` (default 32). kiln mmaps the file and hands
// out zero-copy views of each tensor's bytes. The file is untrusted: every count, string length,
// array length, dims product, type id, offset and alignment is checked before it is used or
// anything is allocated for it, and a bad file is a LoadError naming the file, what is wrong and the
// byte offset. docs/gguf.md has the format, the limits and how a file becomes a model.
//
//   auto file = pipelines::GGUFFile::open("model-q4_k_m.gguf");
//   int64_t layers = file.get_u64("llama.block_count");
//   const GGUFTensor& t = file.tensor("blk.0.attn_q.weight");   // t.type, t.dims, t.data
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

namespace kiln::pipelines {

// ggml's type ids as GGUF stores them (ggml.h's enum ggml_type). kiln reads the ones listed by
// name; any other id is a LoadError naming the tensor and the id.
enum class GGMLType : uint32_t {
  f32 = 0,
  f16 = 1,
  q4_0 = 2,
  q4_1 = 3,
  q5_0 = 6,
  q5_1 = 7,
  q8_0 = 8,
  q8_1 = 9,
  q2_k = 10,
  q3_k = 11,
  q4_k = 12,
  q5_k = 13,
  q6_k = 14,
  q8_k = 15,
  bf16 = 30,
};

std::string_view ggml_type_name(GGMLType);  // "F32", "F16", "Q4_0", "Q4_K", "BF16", ...
// Weights per block and bytes per block of a type (1 and 4 for f32; 256 and 144 for q4_k); nullopt
// for an id kiln does not know.
std::optional<int64_t> ggml_block_size(uint32_t type_id);
std::optional<int64_t> ggml_block_bytes(uint32_t type_id);

// GGUF's metadata value types (gguf_type).
enum class GGUFValueType : uint32_t {
  u8 = 0, i8 = 1, u16 = 2, i16 = 3, u32 = 4, i32 = 5, f32 = 6, boolean = 7, string = 8, array = 9,
  u64 = 10, i64 = 11, f64 = 12,
};
std::string_view gguf_value_type_name(GGUFValueType);  // "u32", "string", "array", ...

// One metadata value. Scalars keep their declared type (`type`) and are held widened (every integer
// type in `integer` or `unsigned_integer`, f32/f64 in `number`). An array holds its element type and
// its elements; arrays of arrays are allowed up to a small nesting depth.
struct GGUFValue {
  GGUFValueType type = GGUFValueType::u8;
  GGUFValueType element_type = GGUFValueType::u8;  // arrays only
  std::variant<int64_t, uint64_t, double, bool, std::string, std::vector<GGUFValue>> value;
  uint64_t offset = 0;  // where the value starts in the file (for error messages)
};

struct GGUFTensor {
  std::string name;
  std::vector<int64_t> dims;  // ggml order: dims[0] is the innermost (contiguous) dimension
  GGMLType type = GGMLType::f32;
  uint64_t offset = 0;               // from the start of the data section, as the file says
  std::span<const uint8_t> data;     // the tensor's bytes inside the mapping
  int64_t elements() const;          // product of dims
  // The row-major shape (dims reversed: [rows, cols] for a matrix whose rows have dims[0] weights).
  std::vector<int64_t> shape() const;
};

// True when `path` is a regular file that starts with GGUF's magic (it may still be a bad one).
bool is_gguf_file(const std::filesystem::path& path);

class GGUFFile {
 public:
  // mmaps the file and validates the header, all metadata and all tensor infos (LoadError on any
  // problem, naming the file and the byte offset).
  static GGUFFile open(const std::filesystem::path& path);

  const std::filesystem::path& path() const { return path_; }
  uint32_t version() const { return version_; }
  uint64_t alignment() const { return alignment_; }

  // Metadata by key (a sorted map); a duplicate key is refused at open().
  const std::map<std::string, GGUFValue, std::less<>>& metadata() const { return metadata_; }
  const GGUFValue* find(std::string_view key) const;  // nullptr when absent
  bool contains(std::string_view key) const { return find(key) != nullptr; }

  // Typed getters: LoadError naming the file and the key when it is absent or of another type
  // (type confusion is an error, never a reinterpretation). Any integer type is accepted where it
  // fits: get_u64 refuses a negative value, get_i64 one above INT64_MAX; get_f64 takes f32 or f64.
  uint64_t get_u64(std::string_view key) const;
  int64_t get_i64(std::string_view key) const;
  double get_f64(std::string_view key) const;
  bool get_bool(std::string_view key) const;
  const std::string& get_string(std::string_view key) const;
  // Arrays of one element type: strings, numbers (any integer or float type, as double) and integers.
  std::vector<std::string_view> get_string_array(std::string_view key) const;
  std::vector<double> get_f64_array(std::string_view key) const;
  std::vector<int64_t> get_i64_array(std::string_view key) const;
  // The same, with a default when the key is absent (a present key of another type is still an error).
  std::optional<uint64_t> find_u64(std::string_view key) const;
  std::optional<double> find_f64(std::string_view key) const;
  std::optional<bool> find_bool(std::string_view key) const;
  std::optional<std::string> find_string(std::string_view key) const;

  const std::vector<GGUFTensor>& tensors() const { return tensors_; }  // file order
  const GGUFTensor* find_tensor(std::string_view name) const;          // nullptr when absent
  const GGUFTensor& tensor(std::string_view name) const;               // LoadError naming the name

  // Keeps the mapping alive (for zero-copy Tensors built on GGUFTensor::data).
  const std::shared_ptr<void>& mapping() const { return mapping_; }

 private:
  std::filesystem::path path_;
  std::shared_ptr<void> mapping_;
  uint32_t version_ = 0;
  uint64_t alignment_ = 32;
  std::map<std::string, GGUFValue, std::less<>> metadata_;
  std::vector<GGUFTensor> tensors_;
  std::map<std::string, size_t, std::less<>> tensor_index_;
};

}  // namespace kiln::pipelines
