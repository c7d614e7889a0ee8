// A safetensors file (8-byte header length, JSON header, data): open validates the header; every
// tensor it then hands out must lie inside the mapping (ASan sees a read past it).
#include <numeric>

#include "fuzz_common.h"
#include "kiln/pipelines/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto path = kiln::fuzz::write_file("model.safetensors", kiln::fuzz::bytes(data, size));
  kiln::fuzz::refusals_only([&] {
    const auto file = kiln::pipelines::SafetensorsFile::open(path);
    for (const std::string& name : file.names()) {
      const kiln::Tensor t = file.tensor(name);
      const auto* p = static_cast<const volatile uint8_t*>(t.data());
      const size_t n = t.nbytes();
      if (n > 0) (void)(p[0] + p[n - 1]);
    }
  });
  return 0;
}
