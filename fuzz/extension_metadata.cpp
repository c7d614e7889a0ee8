// A custom-kernel library's metadata (src/ext/library.cpp): the harness plays a library whose
// kiln_extension_init declares an ABI version and registers op defs made from the input (names,
// struct sizes, array strides, counts, param kinds, kernels' device types, null pointers), and kiln
// must take or refuse each with an ExtensionError. The library is buggy but not lying about its
// memory: every struct and array kiln may read (up to the struct_size it declares) lies in buffers the
// harness owns, and strings are NUL-terminated, since a library that hands kiln wild pointers runs in
// kiln's process anyway (the trust boundary is dlopen, docs/security.md).
#include <cstring>
#include <deque>
#include <string>
#include <vector>

#include "ext/library_init.h"
#include "fuzz_common.h"

namespace {

// The input, read a byte or a string at a time; 0 past its end.
struct Reader {
  const uint8_t* data = nullptr;
  size_t size = 0, at = 0;
  uint8_t byte() { return at < size ? data[at++] : 0; }
  std::string text(size_t most) {
    const size_t n = byte() % (most + 1);
    std::string s;
    for (size_t i = 0; i < n && at < size; ++i) s.push_back(static_cast<char>(data[at++]));
    return s;
  }
};

Reader* input = nullptr;  // the input being run; the init function below reads it

KilnExtStatus output_types(const KilnExtOutputTypesArgs*) { return KILN_EXT_OK; }
KilnExtStatus kernel(const KilnExtKernelArgs*) { return KILN_EXT_OK; }

// Everything one init call hands kiln, kept alive (and in place: deques do not move their elements)
// until kiln has read it.
struct Arena {
  std::deque<std::string> strings;
  std::deque<std::vector<unsigned char>> blocks;
  std::deque<KilnExtOpDef> defs;
  KilnExtOpDef& def() { return defs.emplace_back(); }  // on the heap, so a def kiln kept would be caught
  const char* keep(std::string s) {
    strings.push_back(std::move(s));
    return strings.back().c_str();
  }
  // `count` elements of `stride` bytes (at least the struct's size, so every read kiln makes is in
  // the block), element i's struct_size field set to sizes[i].
  template <class T>
  const T* array(const std::vector<T>& elements, size_t stride, const std::vector<size_t>& sizes) {
    stride = std::max(stride, sizeof(T));
    auto& block = blocks.emplace_back(elements.size() * stride + 1);
    for (size_t i = 0; i < elements.size(); ++i) {
      T e = elements[i];
      e.struct_size = sizes[i];
      std::memcpy(block.data() + i * stride, &e, sizeof(T));
    }
    return elements.empty() ? nullptr : reinterpret_cast<const T*>(block.data());
  }
};

// A struct_size near the right one: exact, older, too small, one more field's worth, or too big.
size_t struct_size(Reader& in, size_t exact, size_t older) {
  switch (in.byte() % 6) {
    case 0: return exact;
    case 1: return older;
    case 2: return exact - sizeof(size_t);
    case 3: return exact + 8;
    case 4: return (size_t{1} << 16) + 8;  // above kiln's limit
    default: return in.byte();
  }
}

const char* name(Reader& in, Arena& arena) {
  switch (in.byte() % 8) {
    case 0: return nullptr;
    case 1: return arena.keep(std::string(257, 'a'));  // one past the longest name
    default: return arena.keep(in.text(40));
  }
}

KilnExtStatus init(KilnExtInitArgs* args) {
  Reader& in = *input;
  Arena arena;
  const uint8_t version = in.byte();
  args->library_abi_major = version % 16 == 0 ? KILN_EXT_ABI_MAJOR + 1 : KILN_EXT_ABI_MAJOR;
  args->library_abi_minor = version / 16 % 4;
  for (int ops = in.byte() % 5; ops > 0; --ops) {
    KilnExtOpDef& def = arena.def();
    def.struct_size = struct_size(in, KILN_EXT_OP_DEF_STRUCT_SIZE, KILN_EXT_OP_DEF_STRUCT_SIZE_V1_0);
    def.name = name(in, arena);
    def.inplace = in.byte() % 4 == 0;
    def.num_outputs = in.byte() % 70;  // some above kiln's 64
    def.output_types = in.byte() % 8 == 0 ? nullptr : &output_types;
    if (in.byte() % 4 == 0) def.description = arena.keep(in.text(80));

    std::vector<KilnExtParamDef> params(in.byte() % 6);
    const size_t param_stride = struct_size(in, KILN_EXT_PARAM_DEF_STRUCT_SIZE, KILN_EXT_PARAM_DEF_STRUCT_SIZE);
    std::vector<size_t> param_sizes(params.size(), param_stride);
    for (size_t i = 0; i < params.size(); ++i) {
      params[i].name = name(in, arena);
      params[i].kind = static_cast<KilnExtParamKind>(in.byte() % 6);
      params[i].required = in.byte() % 2;
      if (i > 0 && in.byte() % 8 == 0) param_sizes[i] += 8;  // elements of one array must agree
    }
    def.params = arena.array(params, param_stride <= (size_t{1} << 16) ? param_stride : 0, param_sizes);
    def.num_params = params.size();
    if (in.byte() % 16 == 0) def.num_params = 300;  // more than kiln takes: refused before any is read

    std::vector<KilnExtKernelDef> kernels(in.byte() % 5);
    const size_t kernel_stride = struct_size(in, KILN_EXT_KERNEL_DEF_STRUCT_SIZE, KILN_EXT_KERNEL_DEF_STRUCT_SIZE);
    for (auto& k : kernels) {
      k.device_type = static_cast<DLDeviceType>(in.byte() % 4);
      k.fn = in.byte() % 8 == 0 ? nullptr : &kernel;
    }
    def.kernels = arena.array(kernels, kernel_stride <= (size_t{1} << 16) ? kernel_stride : 0,
                              std::vector<size_t>(kernels.size(), kernel_stride));
    def.num_kernels = kernels.size();

    const KilnExtStatus status = args->register_op(args->registrar, in.byte() % 32 == 0 ? nullptr : &def);
    if (status != KILN_EXT_OK && in.byte() % 2 == 0) return status;  // most libraries give up here
  }
  if (in.byte() % 16 == 0) {
    std::snprintf(args->error_message, args->error_message_size, "%s", in.text(40).c_str());
    return static_cast<KilnExtStatus>(in.byte());
  }
  return KILN_EXT_OK;
}

}  // namespace

// Most inputs are refused by a throw, and with ASan's detection of stack use after return each throw
// collected its fake stack frames: half the harness's time. Everything kiln is handed lives on the
// heap (Arena), where a pointer kept past init is a use after free that ASan still reports.
extern "C" const char* __asan_default_options() { return "detect_stack_use_after_return=0"; }

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Reader reader{data, size, 0};
  input = &reader;
  kiln::fuzz::refusals_only([&] {
    const auto library = kiln::ext::run_extension_init("fuzz_extension.so", 0, &init);
    for (const auto& op : library->ops()) {
      if (library->find(op->name()) != op.get()) {
        std::fprintf(stderr, "fuzz: op '%s' registered but not found\n", op->name().c_str());
        std::abort();
      }
      (void)op->params();
      (void)op->has_kernel(kiln::DeviceKind::CPU);
    }
  });
  input = nullptr;
  return 0;
}
