// safetensors weights: a file is an 8-byte little-endian header length, a JSON header mapping tensor
// names to {dtype, shape, data_offsets}, then the data. kiln mmaps the file and hands out zero-copy
// Tensors that keep the mapping alive. The file is untrusted: every length, offset, shape and dtype is
// checked before use, and a bad file is a LoadError naming the file and what is wrong (with the byte
// offset where it applies).
//
//   auto weights = pipelines::load_safetensors("models/tiny");   // model.safetensors, or sharded
//   Tensor w = weights.at("model.embed_tokens.weight");
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "kiln/tensor/tensor.h"

namespace kiln::pipelines {

class SafetensorsFile {
 public:
  // mmaps and validates the whole header (LoadError on any problem).
  static SafetensorsFile open(const std::filesystem::path& path);

  const std::filesystem::path& path() const { return path_; }
  std::vector<std::string> names() const;  // sorted
  bool contains(const std::string& name) const;
  Tensor tensor(const std::string& name) const;  // zero-copy; LoadError naming an unknown name
  const std::map<std::string, std::string>& metadata() const { return metadata_; }  // "__metadata__"

  struct Entry {
    DType dtype;
    std::vector<int64_t> shape;
    uint64_t begin;  // byte offsets into the data section
    uint64_t end;
  };

 private:
  std::filesystem::path path_;
  std::shared_ptr<void> mapping_;  // the mmap'd file; unmapped when the last tensor is gone
  const uint8_t* data_ = nullptr;  // start of the data section
  std::map<std::string, Entry> entries_;
  std::map<std::string, std::string> metadata_;
};

// Every tensor of a model: `path` is a .safetensors file, a model.safetensors.index.json, or a
// directory holding either (model.safetensors, or model.safetensors.index.json with its shards).
// Supports f32, f16, bf16 (and the integer dtypes); a name in two shards is a LoadError.
WeightsRegistry load_safetensors(const std::filesystem::path& path);

// Writes tensors as one safetensors file (row-major copies; header keys sorted; data widest dtype
// first, so every tensor is aligned and loads zero-copy): for tests and tools. ValueError for an
// undefined or non-cpu tensor; Error naming the file if it cannot be written.
void save_safetensors(const std::filesystem::path& path, const WeightsRegistry& tensors,
                      const std::map<std::string, std::string>& metadata = {});

}  // namespace kiln::pipelines
