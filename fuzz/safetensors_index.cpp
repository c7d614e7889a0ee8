// model.safetensors.index.json (tensor name -> shard file) beside two small valid shards, a.safetensors
// holding "x" and b.safetensors holding "y", loaded as a model directory.
#include "fuzz_common.h"
#include "kiln/pipelines/safetensors.h"

namespace {

// One f32[2] tensor named `name`, as safetensors bytes.
std::string shard(const std::string& name) {
  const std::string header = "{\"" + name + "\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}";
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((header.size() >> (8 * i)) & 0xff);
  return out + header + std::string(8, '\0');
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const bool shards = [] {
    kiln::fuzz::write_file("a.safetensors", shard("x"));
    kiln::fuzz::write_file("b.safetensors", shard("y"));
    return true;
  }();
  (void)shards;
  kiln::fuzz::write_file("model.safetensors.index.json", kiln::fuzz::bytes(data, size));
  kiln::fuzz::refusals_only([&] { (void)kiln::pipelines::load_safetensors(kiln::fuzz::scratch_dir()); });
  return 0;
}
