// Loading custom-kernel libraries (the C ABI of kiln/extension.h) and resolving custom ops.
//
//   auto lib = kiln::ext::load_library("build/libmy_ops.so");   // ExtensionError naming the path
//   kiln::ext::ExtensionRegistry registry;                     // what one compile may use
//   registry.add(lib);                                         // ExtensionError on a duplicate op
//   const kiln::ext::CustomOp* op = registry.find("scale_add");
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "kiln/extension.h"
#include "kiln/graph/op.h"

namespace kiln::ext {

class Library;

// One op a library registered.
class CustomOp {
 public:
  struct Param {
    std::string name;
    KilnExtParamKind kind;
    bool required;
  };

  const std::string& name() const { return name_; }
  const std::string& description() const { return description_; }  // "" when the library gives none
  const Library& library() const { return *library_; }
  const std::filesystem::path& library_path() const;
  bool inplace() const { return inplace_; }
  size_t num_outputs() const { return num_outputs_; }
  const std::vector<Param>& params() const { return params_; }
  bool has_kernel(DeviceKind device) const;

  // The result types the library's output-type function gives for these operands and the
  // node's attributes (parameters are "param.<name>"). ExtensionError naming the library, the op
  // and what was expected for a parameter missing, unknown or of the wrong kind; when the library
  // rejects the operands, the exception its code maps to (see library_error) with its message.
  std::vector<graph::Type> output_types(const std::vector<graph::Type>& inputs,
                                        const graph::Attrs& attrs) const;
  // Checks a whole call as a graph makes it (`op` is custom or inplace_custom; for custom, attrs
  // carry the declared "output_types", which must equal what the library gives). `where` prefixes
  // messages ("compile: graph 'g' node 3").
  void check_call(graph::Op op, const std::vector<graph::Type>& inputs, const graph::Attrs& attrs,
                  const std::string& where) const;
  // Runs the kernel for `device` on DLTensor views (concrete shapes, strides in elements).
  // When the kernel reports failure: the exception its code maps to (see library_error), naming the
  // library, the op and the code, with the library's message.
  void run(DeviceKind device, const std::vector<DLTensor>& inputs, const std::vector<DLTensor>& outputs,
           const graph::Attrs& attrs) const;
  // The same call with the kernel and its parameters resolved once (a plan step's, at init): `attrs`
  // must outlive the BoundCall (string parameters point into it). Errors as run()'s, the missing
  // kernel and bad parameters at bind().
  struct BoundCall {
    KilnExtKernelFn kernel = nullptr;
    std::vector<KilnExtParamValue> params;
  };
  BoundCall bind(DeviceKind device, const graph::Attrs& attrs) const;
  void run(const BoundCall& call, const std::vector<DLTensor>& inputs, const std::vector<DLTensor>& outputs) const;

 private:
  friend class Library;
  friend struct Registration;
  const Library* library_ = nullptr;
  std::string name_;
  std::string description_;
  bool inplace_ = false;
  size_t num_outputs_ = 0;
  std::vector<Param> params_;
  KilnExtOutputTypesFn output_types_fn_ = nullptr;
  std::vector<std::pair<DLDeviceType, KilnExtKernelFn>> kernels_;
  void* user_data_ = nullptr;
};

// A loaded library. Never unloaded: models hold its kernels, and unloading code is not worth the
// risk for a few pages of memory.
class Library {
 public:
  const std::filesystem::path& path() const { return path_; }  // as the user gave it
  uint64_t content_hash() const { return content_hash_; }      // FNV-1a 64 of the file's bytes
  std::string content_hash_hex() const;                        // 16 hex digits
  // The ABI minor the library declares (it may be older or newer than KILN_EXT_ABI_MINOR).
  uint32_t abi_minor() const { return abi_minor_; }
  const std::vector<std::unique_ptr<CustomOp>>& ops() const { return ops_; }
  const CustomOp* find(const std::string& op) const;  // nullptr if it does not define `op`

  Library(std::filesystem::path path, uint64_t content_hash)
      : path_(std::move(path)), content_hash_(content_hash) {}

 private:
  friend struct Registration;
  friend std::shared_ptr<Library> run_extension_init(const std::filesystem::path& path, uint64_t content_hash,
                                                     KilnExtInitFn init);
  std::filesystem::path path_;
  uint64_t content_hash_;
  uint32_t abi_minor_ = 0;
  std::vector<std::unique_ptr<CustomOp>> ops_;
};

// "KILN_EXT_ERROR_INVALID_ARGUMENT", ..., or "unknown error code 42" for one this kiln does not know.
std::string status_name(KilnExtStatus status);
// The exception a library's failure `status` maps to (KilnExtErrorCode): ValueError for
// KILN_EXT_ERROR_INVALID_ARGUMENT, ExtensionError for every other code, known or not.
[[noreturn]] void throw_library_error(KilnExtStatus status, const std::string& message);

// The DLPack dtype of a kiln dtype, and the DLPack device type of a device kind (kernels of
// extensions see DLTensor views).
DLDataType dl_dtype(DType dtype);
DLDeviceType to_dl_device(DeviceKind kind);

// FNV-1a 64 of a file's bytes; ExtensionError naming the path if it cannot be read.
uint64_t content_hash(const std::filesystem::path& path);

// Loads the library at `path`, or returns the one already loaded from that path with the same
// content. A changed file (new content hash) loads as new code: the file is copied to a fresh temp
// path first, because dlopen returns the already-mapped library for a path (or inode) it has seen.
// ExtensionError naming the path for a missing file, a missing kiln_extension_init, an ABI major
// other than KILN_EXT_ABI_MAJOR, a failed init, a malformed op (a struct_size too small for the
// declared version names the struct and both sizes) or an op registered twice. Any minor of the
// major loads: defs are read as the declared version, capped at this kiln's (see kiln/extension.h).
// Loaded ops become known process-wide, so ops::custom checks a call as it is built when exactly
// one loaded library defines the op.
std::shared_ptr<const Library> load_library(const std::filesystem::path& path);
// The library loaded in this process from `path` with this content hash, or nullptr. (A compiled
// plan names the library content it was compiled against; the engine finds its kernels here.)
std::shared_ptr<const Library> loaded_library(const std::filesystem::path& path, uint64_t content_hash);

// The set of libraries one compile resolves custom ops against.
class ExtensionRegistry {
 public:
  ExtensionRegistry() = default;
  // Loads each path (see load_library) and adds it.
  explicit ExtensionRegistry(const std::vector<std::filesystem::path>& paths);

  // Adds a library. The same library (path and content) twice is a no-op; an op that another added
  // library already defines is an ExtensionError naming the op and both paths.
  void add(std::shared_ptr<const Library> library);
  const CustomOp* find(const std::string& op) const;  // nullptr if no added library defines it
  const std::vector<std::shared_ptr<const Library>>& libraries() const { return libraries_; }
  bool empty() const { return libraries_.empty(); }
  // "/a/libx.so, /b/liby.so", or "none": for messages.
  std::string loaded_paths() const;

 private:
  std::vector<std::shared_ptr<const Library>> libraries_;
};

}  // namespace kiln::ext
