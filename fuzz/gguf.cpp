// A GGUF file: open validates the header, every metadata value and every tensor info. Then each value
// is walked, the getter that fits its type must accept it and one that does not must refuse it with a
// LoadError (either failing is a finding), and every tensor's first and last byte is read (ASan sees a
// read past the mapping). The bytes go through a file, so the real mmap path is the one fuzzed. Then
// what `kiln generate --model FILE.gguf` reads from it: the config (gguf_model_info), the weights as
// the model would take them (gguf_weights: every tensor checked, some dequantized or un-permuted),
// and the embedded tokenizer, which encodes and decodes a text.
#include <cstdio>
#include <cstdlib>

#include "fuzz_common.h"
#include "kiln/pipelines/gguf.h"
#include "kiln/pipelines/gguf_model.h"
#include "kiln/pipelines/tokenizer.h"
#include "pipelines/gguf_tokenizer.h"

namespace {

using kiln::pipelines::GGUFFile;
using kiln::pipelines::GGUFValue;
using kiln::pipelines::GGUFValueType;

size_t walk(const GGUFValue& v) {
  size_t n = 1;
  if (const auto* a = std::get_if<std::vector<GGUFValue>>(&v.value))
    for (const GGUFValue& e : *a) n += walk(e);  // open() bounds the nesting
  return n;
}

template <class F>
void must_accept(const std::string& key, F&& f) {
  try {
    f();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fuzz: the getter for key '%s' refused its own type: %s\n", key.c_str(), e.what());
    std::abort();
  }
}

template <class F>
void must_refuse(const std::string& key, F&& f) {
  try {
    f();
  } catch (const kiln::LoadError&) {
    return;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fuzz: non-LoadError from a getter on key '%s': %s\n", key.c_str(), e.what());
    std::abort();
  }
  std::fprintf(stderr, "fuzz: a getter of another type accepted key '%s'\n", key.c_str());
  std::abort();
}

void check_getters(const GGUFFile& f, const std::string& key, const GGUFValue& v) {
  switch (v.type) {
    case GGUFValueType::u8:
    case GGUFValueType::u16:
    case GGUFValueType::u32:
    case GGUFValueType::u64:
      must_accept(key, [&] { (void)f.get_u64(key); });
      must_refuse(key, [&] { (void)f.get_string(key); });
      break;
    case GGUFValueType::i8:
    case GGUFValueType::i16:
    case GGUFValueType::i32:
    case GGUFValueType::i64:
      must_accept(key, [&] { (void)f.get_i64(key); });
      must_refuse(key, [&] { (void)f.get_f64(key); });
      break;
    case GGUFValueType::f32:
    case GGUFValueType::f64:
      must_accept(key, [&] { (void)f.get_f64(key); });
      must_refuse(key, [&] { (void)f.get_u64(key); });
      break;
    case GGUFValueType::boolean:
      must_accept(key, [&] { (void)f.get_bool(key); });
      must_refuse(key, [&] { (void)f.get_i64(key); });
      break;
    case GGUFValueType::string:
      must_accept(key, [&] { (void)f.get_string(key); });
      must_refuse(key, [&] { (void)f.get_bool(key); });
      break;
    case GGUFValueType::array:
      if (v.element_type == GGUFValueType::string) {
        must_accept(key, [&] { (void)f.get_string_array(key); });
      } else if (v.element_type == GGUFValueType::boolean || v.element_type == GGUFValueType::array) {
        must_refuse(key, [&] { (void)f.get_f64_array(key); });
      } else {
        must_accept(key, [&] { (void)f.get_f64_array(key); });
        kiln::fuzz::refusals_only([&] { (void)f.get_i64_array(key); });  // a u64 past INT64_MAX is refused
      }
      must_refuse(key, [&] { (void)f.get_string(key); });
      break;
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using kiln::fuzz::refusals_only;
  const auto path = kiln::fuzz::write_file("model.gguf", kiln::fuzz::bytes(data, size));
  refusals_only([&] {
    const auto file = GGUFFile::open(path);
    volatile size_t values = 0;
    for (const auto& [key, value] : file.metadata()) {
      values = values + walk(value);
      check_getters(file, key, value);
    }
    // A key no file holds, unless the input happens to write it (the fuzzer did).
    if (!file.contains("absent.key")) must_refuse("absent.key", [&] { (void)file.get_u64("absent.key"); });
    for (const auto& t : file.tensors()) {
      const volatile uint8_t* p = t.data.data();
      const size_t n = t.data.size();
      if (n > 0) (void)(p[0] + p[n - 1]);
      (void)t.elements();
      (void)t.shape();
      (void)kiln::pipelines::ggml_type_name(t.type);
      (void)file.tensor(t.name);
    }
    must_refuse("absent.tensor", [&] { (void)file.tensor("absent.tensor"); });
    refusals_only([&] {
      const kiln::pipelines::ModelInfo info = kiln::pipelines::gguf_model_info(file);
      const kiln::nn::WeightFormat format = kiln::pipelines::gguf_weight_format(file);
      (void)kiln::pipelines::gguf_weight_formats(file, format);
      (void)kiln::pipelines::gguf_weights(file, info, format);
    });
    refusals_only([&] {
      const auto tokenizer = kiln::pipelines::detail::load_gguf_tokenizer(kiln::pipelines::detail::read_gguf_vocab(file), path.string());
      (void)tokenizer->decode(tokenizer->encode("Hello, w\xc3\xb6rld <s> 12"), false);
    });
  });
  return 0;
}
