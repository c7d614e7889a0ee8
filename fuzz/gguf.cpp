// A GGUF file: open validates the header, every metadata value and every tensor info; then every
// value is walked and read through every typed getter (refusing another type is fine), and every
// tensor's first and last byte is read (ASan sees a read past the mapping). The bytes go through a
// file so the real mmap path is the one fuzzed.
#include "fuzz_common.h"
#include "kiln/pipelines/gguf.h"

namespace {

using kiln::pipelines::GGUFValue;

size_t walk(const GGUFValue& v) {
  size_t n = 1;
  if (const auto* a = std::get_if<std::vector<GGUFValue>>(&v.value))
    for (const GGUFValue& e : *a) n += walk(e);  // open() bounds the nesting
  return n;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using kiln::fuzz::refusals_only;
  const auto path = kiln::fuzz::write_file("model.gguf", kiln::fuzz::bytes(data, size));
  refusals_only([&] {
    const auto file = kiln::pipelines::GGUFFile::open(path);
    volatile size_t values = 0;
    for (const auto& [key, value] : file.metadata()) {
      values = values + walk(value);
      refusals_only([&] { (void)file.get_u64(key); });
      refusals_only([&] { (void)file.get_i64(key); });
      refusals_only([&] { (void)file.get_f64(key); });
      refusals_only([&] { (void)file.get_bool(key); });
      refusals_only([&] { (void)file.get_string(key); });
      refusals_only([&] { (void)file.get_string_array(key); });
      refusals_only([&] { (void)file.get_f64_array(key); });
      refusals_only([&] { (void)file.get_i64_array(key); });
    }
    refusals_only([&] { (void)file.get_u64("absent.key"); });
    for (const auto& t : file.tensors()) {
      const volatile uint8_t* p = t.data.data();
      const size_t n = t.data.size();
      if (n > 0) (void)(p[0] + p[n - 1]);
      (void)t.elements();
      (void)t.shape();
      (void)kiln::pipelines::ggml_type_name(t.type);
      (void)file.tensor(t.name);
    }
    refusals_only([&] { (void)file.tensor("absent.tensor"); });
  });
  return 0;
}
