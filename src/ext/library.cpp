// Loading a custom-kernel library: read and hash the file, dlopen a private copy, call its
// kiln_extension_init, and take what it registers. Libraries are hostile input: every def is checked
// before kiln keeps it, and every failure names the path and what was expected.
#include <dlfcn.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <cstring>
#include <fstream>
#include <map>
#include <mutex>
#include <set>

#include <fmt/format.h>

#include "graph/hash.h"
#include "kiln/errors.h"
#include "kiln/ext/extensions.h"
#include "kiln/graph/custom_op_check.h"
#include "ext/library_init.h"

// The registrar a library registers through during kiln_extension_init (opaque to it).
struct KilnExtRegistrar {
  kiln::ext::Library* library;
  const KilnExtInitArgs* args;  // where the library declares its version, which says how to read its defs
  std::string error;            // the first rejected def, reported with the library's path
};

namespace kiln::ext {

namespace {

namespace fs = std::filesystem;

// Every library loaded in this process, by (canonical path, content hash), and every loaded op by name
// (for the graph-build-time check). Guarded by `mutex`; loading is rare, so one lock serialises it.
struct LoadedLibraries {
  std::mutex mutex;
  std::map<std::pair<std::string, uint64_t>, std::shared_ptr<Library>> by_key;
  std::map<std::string, std::vector<const CustomOp*>> ops_by_name;
  uint64_t next_copy = 0;
};

LoadedLibraries& loaded() {
  static LoadedLibraries* instance = new LoadedLibraries;  // never destroyed: kernels outlive statics
  return *instance;
}

std::string key_path(const fs::path& path) {
  std::error_code ec;
  fs::path canonical = fs::weakly_canonical(path, ec);
  return ec ? path.string() : canonical.string();
}

std::string read_file(const fs::path& path) {
  std::error_code ec;
  if (!fs::exists(path, ec))
    throw ExtensionError(fmt::format("extension '{}': no such file (expected a shared library "
                                     "implementing kiln/extension.h)", path.string()));
  if (!fs::is_regular_file(path, ec))
    throw ExtensionError(fmt::format("extension '{}': not a regular file (expected a shared library)",
                                     path.string()));
  std::ifstream in(path, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (!in.good() && !in.eof())
    throw ExtensionError(fmt::format("extension '{}': cannot read the file", path.string()));
  return bytes;
}

// Bounds on the names a library hands over: no further is read, so a name missing its NUL stops there.
constexpr size_t kMaxNameLength = 256;
constexpr size_t kMaxOps = 4096;  // per library; registering is quadratic in them (duplicate check)

bool valid_op_name(const char* name) {
  if (!name) return false;
  const size_t n = strnlen(name, kMaxNameLength + 1);
  if (n == 0 || n > kMaxNameLength) return false;
  for (size_t i = 0; i < n; ++i)
    if (!(std::isalnum(static_cast<unsigned char>(name[i])) || name[i] == '_' || name[i] == '.'))
      return false;
  return true;
}

// A name as an error shows it, read no further than the bound and cut short.
std::string shown_name(const char* name) {
  if (!name) return "(null)";
  constexpr size_t kShown = 64;
  const size_t n = strnlen(name, kShown + 1);
  return n > kShown ? fmt::format("{}... (longer than {} characters)", std::string_view(name, kShown), kShown)
                    : std::string(name, n);
}

// The graph-build-time check ops::custom calls through graph/custom_op_check.h.
void check_loaded_custom_op(graph::Op op, const std::string& symbol, const std::vector<graph::Type>& inputs,
                            const graph::Attrs& attrs) {
  const CustomOp* found = nullptr;
  {
    LoadedLibraries& state = loaded();
    std::lock_guard lock(state.mutex);
    auto it = state.ops_by_name.find(symbol);
    // With several loaded definitions (e.g. a rebuilt library), the compile's extensions decide.
    if (it == state.ops_by_name.end() || it->second.size() != 1) return;
    found = it->second.front();
  }
  found->check_call(op, inputs, attrs, std::string(graph::op_name(op)));
}

// A struct a library fills, with its size in each minor of this major (index: minor). kiln checks a
// struct_size against these and reads only the fields of the library's version, never its own sizeof:
// an older library's struct is shorter, a newer one's longer.
struct AbiStruct {
  const char* name;
  std::array<size_t, KILN_EXT_ABI_MINOR + 1> size_by_minor;
  // What kiln reads of a library declaring `minor`: a newer minor reads as kiln's own (its prefix).
  size_t size(uint32_t minor) const { return size_by_minor[std::min<uint32_t>(minor, KILN_EXT_ABI_MINOR)]; }
};
constexpr AbiStruct kOpDef{"KilnExtOpDef", {KILN_EXT_OP_DEF_STRUCT_SIZE_V1_0, KILN_EXT_OP_DEF_STRUCT_SIZE_V1_1}};
constexpr AbiStruct kParamDef{"KilnExtParamDef",
                              {KILN_EXT_PARAM_DEF_STRUCT_SIZE_V1_0, KILN_EXT_PARAM_DEF_STRUCT_SIZE_V1_0}};
constexpr AbiStruct kKernelDef{"KilnExtKernelDef",
                               {KILN_EXT_KERNEL_DEF_STRUCT_SIZE_V1_0, KILN_EXT_KERNEL_DEF_STRUCT_SIZE_V1_0}};
// A minor bump must extend each table (a missing entry would be zero and accept anything).
static_assert(kOpDef.size_by_minor.back() == KILN_EXT_OP_DEF_STRUCT_SIZE &&
              kParamDef.size_by_minor.back() == KILN_EXT_PARAM_DEF_STRUCT_SIZE &&
              kKernelDef.size_by_minor.back() == KILN_EXT_KERNEL_DEF_STRUCT_SIZE);

// Bounds on what a hostile library can make kiln walk.
constexpr size_t kMaxStructSize = 1 << 16;
constexpr size_t kMaxParams = 256;

std::string abi_version(uint32_t minor) { return fmt::format("{}.{}", KILN_EXT_ABI_MAJOR, minor); }

// A struct the library filled at `from`, read as version `minor`: its struct_size must hold that
// version, and only that version's fields are copied, so later fields keep T's zero defaults (and
// padding an older version's struct_size may cover is never read as a field).
template <class T>
T read_def(const AbiStruct& layout, const void* from, uint32_t minor, const std::string& what) {
  size_t given;
  std::memcpy(&given, from, sizeof given);
  const size_t expected = layout.size(minor);
  if (given < expected)
    throw ExtensionError(fmt::format(
        "{} struct_size {} is smaller than {}, the size of {} in ABI {} ({}; set struct_size to sizeof({}))",
        what, given, expected, layout.name, abi_version(std::min<uint32_t>(minor, KILN_EXT_ABI_MINOR)),
        minor <= KILN_EXT_ABI_MINOR ? "the version the library declares"
                                    : fmt::format("the newest this kiln reads; the library declares {}",
                                                  abi_version(minor)),
        layout.name));
  if (given > kMaxStructSize)
    throw ExtensionError(fmt::format("{} struct_size {} is more than {} bytes (expected sizeof({}))", what, given,
                                     kMaxStructSize, layout.name));
  T def{};
  std::memcpy(&def, from, expected);
  return def;
}

// The `count` elements of an array the library hands over, walked by the stride it declares:
// element 0's struct_size, which every element must repeat (a C array has one element size).
template <class T>
std::vector<T> read_def_array(const AbiStruct& layout, const T* array, size_t count, uint32_t minor,
                              const std::string& who, const char* element) {
  std::vector<T> defs;
  if (!count) return defs;
  const auto* base = reinterpret_cast<const std::byte*>(array);
  size_t stride = 0;
  for (size_t i = 0; i < count; ++i) {
    T def = read_def<T>(layout, base + i * stride, minor, fmt::format("{}: {} {} ({})", who, element, i, layout.name));
    if (i == 0) stride = def.struct_size;
    else if (def.struct_size != stride)
      throw ExtensionError(fmt::format("{}: {} {} ({}) has struct_size {} but {} 0 has {} (kiln walks the array "
                                       "by element 0's struct_size, so every element must repeat it)",
                                       who, element, i, layout.name, def.struct_size, element, stride));
    defs.push_back(def);
  }
  return defs;
}

// The minor a library's defs are read as: the version it has declared so far (1.0 if none yet).
uint32_t declared_minor(const KilnExtInitArgs& args) {
  if (args.library_abi_major == 0) return 0;
  if (args.library_abi_major != KILN_EXT_ABI_MAJOR)
    throw ExtensionError(fmt::format("register_op: the library declares ABI {}.{}, whose defs this kiln "
                                     "cannot read (expected major version {})",
                                     args.library_abi_major, args.library_abi_minor, KILN_EXT_ABI_MAJOR));
  return args.library_abi_minor;
}

}  // namespace

// Turns a library's KilnExtOpDef into a CustomOp, or records why not.
struct Registration {
  static KilnExtStatus register_op(KilnExtRegistrar* registrar, const KilnExtOpDef* def) {
    if (!registrar) return KILN_EXT_ERROR;
    try {
      if (registrar->library->ops_.size() >= kMaxOps)
        throw ExtensionError(fmt::format("register_op: more than {} ops in one library", kMaxOps));
      registrar->library->ops_.push_back(make_op(*registrar->library, def, declared_minor(*registrar->args)));
      return KILN_EXT_OK;
    } catch (const ExtensionError& e) {
      if (registrar->error.empty()) registrar->error = e.what();
      return KILN_EXT_ERROR;
    }
  }

  static std::unique_ptr<CustomOp> make_op(const Library& library, const KilnExtOpDef* given, uint32_t minor) {
    if (!given) throw ExtensionError("register_op: got a null KilnExtOpDef");
    const KilnExtOpDef def = read_def<KilnExtOpDef>(kOpDef, given, minor, "register_op: KilnExtOpDef");
    if (!valid_op_name(def.name))
      throw ExtensionError(
          fmt::format("register_op: op name '{}' is not a non-empty identifier "
                      "([A-Za-z0-9_.]+, at most {} characters)",
                      shown_name(def.name), kMaxNameLength));
    auto op = std::make_unique<CustomOp>();
    op->library_ = &library;
    op->name_ = def.name;
    const std::string who = fmt::format("register_op '{}'", op->name_);
    if (library.find(op->name_)) throw ExtensionError(fmt::format("{}: the library registers it twice", who));
    if (def.description) op->description_.assign(def.description, strnlen(def.description, 1024));
    op->inplace_ = def.inplace != 0;
    op->num_outputs_ = def.num_outputs;
    if (op->inplace_ && def.num_outputs != 0)
      throw ExtensionError(fmt::format("{}: an in-place op has no results, got num_outputs {}", who,
                                       def.num_outputs));
    if (def.num_outputs > 64)
      throw ExtensionError(fmt::format("{}: num_outputs {} is more than 64", who, def.num_outputs));
    if (!def.output_types) throw ExtensionError(fmt::format("{}: output_types function is null", who));
    op->output_types_fn_ = def.output_types;
    op->user_data_ = def.user_data;

    if (def.num_params && !def.params)
      throw ExtensionError(fmt::format("{}: num_params is {} but params is null", who, def.num_params));
    if (def.num_params > kMaxParams)
      throw ExtensionError(fmt::format("{}: num_params {} is more than {}", who, def.num_params, kMaxParams));
    for (const KilnExtParamDef& p : read_def_array(kParamDef, def.params, def.num_params, minor, who, "param")) {
      const size_t i = op->params_.size();
      if (!valid_op_name(p.name))
        throw ExtensionError(
            fmt::format("{}: param {} has no valid name ('{}'; expected [A-Za-z0-9_.]+, at most "
                        "{} characters)",
                        who, i, shown_name(p.name), kMaxNameLength));
      if (p.kind < KILN_EXT_PARAM_INT64 || p.kind > KILN_EXT_PARAM_INT64_ARRAY)
        throw ExtensionError(fmt::format("{}: param '{}' has unknown kind {}", who, p.name,
                                         static_cast<int>(p.kind)));
      for (const auto& seen : op->params_)
        if (seen.name == p.name) throw ExtensionError(fmt::format("{}: param '{}' is declared twice", who, p.name));
      op->params_.push_back({p.name, p.kind, p.required != 0});
    }

    if (!def.num_kernels || !def.kernels)
      throw ExtensionError(fmt::format("{}: registers no kernels (expected one per device kind)", who));
    // Two device kinds exist and each may have one kernel, so a longer array fails within 3 elements.
    const size_t num_kernels = std::min<size_t>(def.num_kernels, 3);
    for (const KilnExtKernelDef& k : read_def_array(kKernelDef, def.kernels, num_kernels, minor, who, "kernel")) {
      const size_t i = op->kernels_.size();
      if (!k.fn) throw ExtensionError(fmt::format("{}: kernel {} (KilnExtKernelDef) has a null fn", who, i));
      if (k.device_type != kDLCPU && k.device_type != kDLCUDA)
        throw ExtensionError(fmt::format("{}: kernel {} has device type {}, expected kDLCPU or kDLCUDA", who,
                                         i, static_cast<int>(k.device_type)));
      for (const auto& seen : op->kernels_)
        if (seen.first == k.device_type)
          throw ExtensionError(fmt::format("{}: two kernels for device type {}", who, static_cast<int>(k.device_type)));
      op->kernels_.emplace_back(k.device_type, k.fn);
    }
    return op;
  }
};

uint64_t content_hash(const fs::path& path) { return fnv1a64(read_file(path)); }

std::string Library::content_hash_hex() const { return fmt::format("{:016x}", content_hash_); }

const CustomOp* Library::find(const std::string& op) const {
  for (const auto& o : ops_)
    if (o->name() == op) return o.get();
  return nullptr;
}

namespace {

// dlopen of a private copy of `bytes`: dlopen hands back the already-loaded library for a path or
// inode it has seen, so a rebuilt library at the same path would silently keep running the old code.
// The copy is unlinked once mapped (the mapping keeps it alive), so nothing is left behind.
void* open_private_copy(const fs::path& path, const std::string& bytes, uint64_t hash, uint64_t copy) {
  fs::path dir = fs::temp_directory_path() / fmt::format("kiln-ext-{}", getpid());
  std::error_code ec;
  fs::create_directories(dir, ec);
  fs::path tmp = dir / fmt::format("{}-{:016x}-{}", copy, hash, path.filename().string());
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    if (!out)
      throw ExtensionError(fmt::format("extension '{}': cannot write its private copy {}", path.string(),
                                       tmp.string()));
  }
  void* handle = dlopen(tmp.c_str(), RTLD_NOW | RTLD_LOCAL);
  std::string error = handle ? "" : dlerror();
  fs::remove(tmp, ec);
  fs::remove(dir, ec);  // only when empty
  if (!handle)
    throw ExtensionError(fmt::format("extension '{}': dlopen failed (expected a shared library for this "
                                     "platform): {}", path.string(), error));
  return handle;
}

}  // namespace

std::shared_ptr<Library> run_extension_init(const fs::path& path, uint64_t hash, KilnExtInitFn init) {
  auto library = std::make_shared<Library>(path, hash);
  std::array<char, 1024> message{};
  KilnExtInitArgs args{};
  KilnExtRegistrar registrar{library.get(), &args, {}};
  args.struct_size = KILN_EXT_INIT_ARGS_STRUCT_SIZE;
  args.host_abi_major = KILN_EXT_ABI_MAJOR;
  args.host_abi_minor = KILN_EXT_ABI_MINOR;
  args.registrar = &registrar;
  args.register_op = &Registration::register_op;
  args.error_message = message.data();
  args.error_message_size = message.size();
  KilnExtStatus status = init(&args);

  if (args.library_abi_major != KILN_EXT_ABI_MAJOR)
    throw ExtensionError(fmt::format(
        "extension '{}': built against kiln extension ABI {}.{}, expected major version {} (this kiln "
        "implements {}.{}; rebuild the library against this kiln's kiln/extension.h)",
        path.string(), args.library_abi_major, args.library_abi_minor, KILN_EXT_ABI_MAJOR,
        KILN_EXT_ABI_MAJOR, KILN_EXT_ABI_MINOR));
  if (!registrar.error.empty())
    throw ExtensionError(fmt::format("extension '{}': {}", path.string(), registrar.error));
  if (status != KILN_EXT_OK) {
    std::string text(message.data(), strnlen(message.data(), message.size()));
    throw ExtensionError(fmt::format("extension '{}': {} failed with {}: {}", path.string(), KILN_EXT_INIT_SYMBOL,
                                     status_name(status), text.empty() ? "(the library gave no message)" : text));
  }
  library->abi_minor_ = args.library_abi_minor;
  if (library->ops().empty())
    throw ExtensionError(fmt::format("extension '{}': registers no ops (expected at least one register_op "
                                     "call in {})", path.string(), KILN_EXT_INIT_SYMBOL));

  return library;
}

std::shared_ptr<const Library> load_library(const fs::path& path) {
  const std::string bytes = read_file(path);
  const uint64_t hash = fnv1a64(bytes);
  LoadedLibraries& state = loaded();
  std::lock_guard lock(state.mutex);
  const auto key = std::make_pair(key_path(path), hash);
  if (auto it = state.by_key.find(key); it != state.by_key.end()) return it->second;

  void* handle = open_private_copy(path, bytes, hash, state.next_copy++);
  auto init = reinterpret_cast<KilnExtInitFn>(dlsym(handle, KILN_EXT_INIT_SYMBOL));
  if (!init)
    throw ExtensionError(fmt::format("extension '{}': does not export {} (expected the entry point of "
                                     "kiln/extension.h, declared extern \"C\" with default visibility)",
                                     path.string(), KILN_EXT_INIT_SYMBOL));

  std::shared_ptr<Library> library = run_extension_init(path, hash, init);
  state.by_key.emplace(key, library);
  for (const auto& op : library->ops()) state.ops_by_name[op->name()].push_back(op.get());
  static std::once_flag install_check;
  std::call_once(install_check, [] { graph::set_custom_op_check(&check_loaded_custom_op); });
  return library;
}

std::shared_ptr<const Library> loaded_library(const fs::path& path, uint64_t hash) {
  LoadedLibraries& state = loaded();
  std::lock_guard lock(state.mutex);
  auto it = state.by_key.find({key_path(path), hash});
  return it == state.by_key.end() ? nullptr : it->second;
}

// ---- the set one compile uses --------------------------------------------------------------------

ExtensionRegistry::ExtensionRegistry(const std::vector<fs::path>& paths) {
  for (const auto& path : paths) add(load_library(path));
}

void ExtensionRegistry::add(std::shared_ptr<const Library> library) {
  if (std::find(libraries_.begin(), libraries_.end(), library) != libraries_.end()) return;
  for (const auto& op : library->ops())
    if (const CustomOp* other = find(op->name()))
      throw ExtensionError(fmt::format(
          "custom op '{}' is defined by two extensions: {} and {} (expected each op in one library of a "
          "compile)", op->name(), other->library_path().string(), library->path().string()));
  libraries_.push_back(std::move(library));
}

const CustomOp* ExtensionRegistry::find(const std::string& op) const {
  for (const auto& library : libraries_)
    if (const CustomOp* found = library->find(op)) return found;
  return nullptr;
}

std::string ExtensionRegistry::loaded_paths() const {
  std::string paths;
  for (const auto& library : libraries_) paths += (paths.empty() ? "" : ", ") + library->path().string();
  return paths.empty() ? "none" : paths;
}

}  // namespace kiln::ext
