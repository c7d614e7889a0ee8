// A loaded custom op: marshalling kiln types and attributes to the C ABI and back, and the checks
// that give every failure the library's path, the op and what was expected.
#include <algorithm>
#include <array>
#include <optional>

#include <fmt/format.h>

#include "kiln/errors.h"
#include "kiln/ext/extensions.h"
#include "kiln/graph/graph.h"

namespace kiln::ext {

DLDeviceType to_dl_device(DeviceKind kind) { return kind == DeviceKind::CPU ? kDLCPU : kDLCUDA; }

// The same mapping as Tensor's DLPack export.
DLDataType dl_dtype(DType d) {
  DLDataType t{kDLFloat, static_cast<uint8_t>(dtype_size(d) * 8), 1};
  if (d == DType::bf16) t.code = kDLBfloat;
  else if (d == DType::boolean) t = {KILN_EXT_DL_BOOL, 8, 1};
  else if (is_integer(d)) t.code = is_signed(d) ? kDLInt : kDLUInt;
  return t;
}

std::string status_name(KilnExtStatus status) {
  switch (status) {
    case KILN_EXT_OK: return "KILN_EXT_OK";
    case KILN_EXT_ERROR: return "KILN_EXT_ERROR";
    case KILN_EXT_ERROR_INVALID_ARGUMENT: return "KILN_EXT_ERROR_INVALID_ARGUMENT";
    case KILN_EXT_ERROR_UNSUPPORTED: return "KILN_EXT_ERROR_UNSUPPORTED";
    case KILN_EXT_ERROR_OUT_OF_MEMORY: return "KILN_EXT_ERROR_OUT_OF_MEMORY";
    case KILN_EXT_ERROR_INTERNAL: return "KILN_EXT_ERROR_INTERNAL";
  }
  return fmt::format("unknown error code {}", status);
}

void throw_library_error(KilnExtStatus status, const std::string& message) {
  // Only a caller's mistake is a ValueError (as MAX raises for bad operands); everything else is the
  // library's, including codes of a newer minor than this kiln knows.
  if (status == KILN_EXT_ERROR_INVALID_ARGUMENT) throw ValueError(message);
  throw ExtensionError(message);
}

namespace {

// Arrays kiln hands a library are indexed as plain C arrays by every minor, so their layout is frozen.
static_assert(sizeof(KilnExtTypeDesc) == KILN_EXT_TYPE_DESC_STRUCT_SIZE_V1_0 &&
              sizeof(KilnExtParamValue) == KILN_EXT_PARAM_VALUE_STRUCT_SIZE_V1_0 &&
              sizeof(KilnExtOutputDesc) == KILN_EXT_OUTPUT_DESC_STRUCT_SIZE_V1_0,
              "an array element struct kiln passes changed: that needs a new ABI major");

using graph::Attrs;
using graph::Type;

constexpr size_t kMessageSize = 1024;

std::optional<DType> from_dl_dtype(DLDataType t) {
  if (t.lanes != 1) return std::nullopt;
  for (DType d : {DType::f32, DType::f16, DType::bf16, DType::f64, DType::i8, DType::i16, DType::i32,
                  DType::i64, DType::u8, DType::u16, DType::u32, DType::u64, DType::boolean}) {
    DLDataType m = dl_dtype(d);
    if (m.code == t.code && m.bits == t.bits) return d;
  }
  return std::nullopt;
}


const char* kind_name(KilnExtParamKind kind) {
  switch (kind) {
    case KILN_EXT_PARAM_INT64: return "int64";
    case KILN_EXT_PARAM_FLOAT64: return "float64";
    case KILN_EXT_PARAM_STRING: return "string";
    case KILN_EXT_PARAM_INT64_ARRAY: return "int64 array";
  }
  return "unknown";
}

std::string types_text(const std::vector<Type>& types) {
  std::string s = "(";
  for (size_t i = 0; i < types.size(); ++i) s += (i ? ", " : "") + graph::to_string(types[i]);
  return s + ")";
}

// The library's message, or a fallback when it wrote none.
std::string library_message(const std::array<char, kMessageSize>& buffer) {
  std::string text(buffer.data(), strnlen(buffer.data(), buffer.size()));
  return text.empty() ? "(the library gave no message)" : text;
}

}  // namespace

const std::filesystem::path& CustomOp::library_path() const { return library_->path(); }

bool CustomOp::has_kernel(DeviceKind device) const {
  return std::any_of(kernels_.begin(), kernels_.end(),
                     [&](const auto& k) { return k.first == to_dl_device(device); });
}

namespace {

// The op's parameters in declared order, read from the node's "param.<name>" attributes. Pointers in
// the result point into `attrs`, which must outlive it.
std::vector<KilnExtParamValue> marshal_params(const CustomOp& op, const Attrs& attrs) {
  const std::string who = fmt::format("custom op '{}' of {}", op.name(), op.library_path().string());
  for (const auto& [key, value] : attrs) {
    if (!key.starts_with("param.")) continue;
    std::string name = key.substr(6);
    bool declared = std::any_of(op.params().begin(), op.params().end(),
                                [&](const CustomOp::Param& p) { return p.name == name; });
    if (!declared) {
      std::string names;
      for (const auto& p : op.params()) names += (names.empty() ? "'" : ", '") + p.name + "'";
      throw ExtensionError(fmt::format("{}: unknown parameter '{}' (declared: {})", who, name,
                                       names.empty() ? "none" : names + "'"));
    }
  }
  std::vector<KilnExtParamValue> values;
  for (const CustomOp::Param& p : op.params()) {
    KilnExtParamValue v{};
    v.struct_size = KILN_EXT_PARAM_VALUE_STRUCT_SIZE;
    v.name = p.name.c_str();
    v.kind = p.kind;
    auto it = attrs.find("param." + p.name);
    if (it == attrs.end()) {
      if (p.required)
        throw ExtensionError(fmt::format("{}: missing required {} parameter '{}'", who, kind_name(p.kind), p.name));
      values.push_back(v);
      continue;
    }
    v.present = 1;
    const graph::Attr& a = it->second;
    bool ok = true;
    switch (p.kind) {
      case KILN_EXT_PARAM_INT64:
        if (const auto* i = std::get_if<int64_t>(&a)) v.int64_value = *i; else ok = false;
        break;
      case KILN_EXT_PARAM_FLOAT64:
        if (const auto* d = std::get_if<double>(&a)) v.float64_value = *d;
        else if (const auto* i = std::get_if<int64_t>(&a)) v.float64_value = static_cast<double>(*i);
        else ok = false;
        break;
      case KILN_EXT_PARAM_STRING:
        if (const auto* s = std::get_if<std::string>(&a)) v.string_value = s->c_str(); else ok = false;
        break;
      case KILN_EXT_PARAM_INT64_ARRAY:
        if (const auto* arr = std::get_if<std::vector<int64_t>>(&a)) {
          v.int64_array = arr->data();
          v.int64_array_size = arr->size();
        } else {
          ok = false;
        }
        break;
    }
    if (!ok)
      throw ExtensionError(fmt::format("{}: parameter '{}' must be {}, got another kind of attribute", who,
                                       p.name, kind_name(p.kind)));
    values.push_back(v);
  }
  return values;
}

}  // namespace

std::vector<Type> CustomOp::output_types(const std::vector<Type>& inputs, const Attrs& attrs) const {
  const std::string who = fmt::format("custom op '{}' of {}", name_, library_path().string());
  std::vector<KilnExtParamValue> params = marshal_params(*this, attrs);

  std::vector<std::vector<int64_t>> shapes(inputs.size());
  std::vector<KilnExtTypeDesc> descs(inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i) {
    const graph::Shape& shape = graph::shape_of(inputs[i]);
    for (const graph::Dim& d : shape) shapes[i].push_back(d.try_static().value_or(KILN_EXT_DYNAMIC_DIM));
    descs[i] = {KILN_EXT_TYPE_DESC_STRUCT_SIZE, dl_dtype(graph::dtype_of(inputs[i])),
                static_cast<int32_t>(shape.rank()), shapes[i].data(),
                to_dl_device(graph::device_of(inputs[i]).kind), graph::is_buffer(inputs[i]) ? 1 : 0};
  }
  std::vector<KilnExtOutputDesc> outs(num_outputs_);
  for (auto& o : outs) o.struct_size = KILN_EXT_OUTPUT_DESC_STRUCT_SIZE;
  std::array<char, kMessageSize> message{};
  KilnExtOutputTypesArgs args{KILN_EXT_OUTPUT_TYPES_ARGS_STRUCT_SIZE, descs.data(), descs.size(), params.data(),
                              params.size(), outs.data(), outs.size(), user_data_, message.data(),
                              message.size()};
  if (KilnExtStatus status = output_types_fn_(&args); status != KILN_EXT_OK)
    throw_library_error(status, fmt::format("{}: rejects operands {} ({}): {}", who, types_text(inputs),
                                            status_name(status), library_message(message)));

  // The library's answer is checked like any other untrusted input.
  const DeviceRef device = inputs.empty() ? DeviceRef::CPU() : graph::device_of(inputs[0]);
  std::vector<Type> results;
  for (size_t r = 0; r < outs.size(); ++r) {
    const KilnExtOutputDesc& o = outs[r];
    std::optional<DType> dtype = from_dl_dtype(o.dtype);
    if (!dtype)
      throw ExtensionError(fmt::format("{}: output-type function gave result {} an unsupported DLPack dtype "
                                       "(code {}, bits {}, lanes {})", who, r, o.dtype.code, o.dtype.bits,
                                       o.dtype.lanes));
    if (o.ndim < 0 || o.ndim > KILN_EXT_MAX_RANK)
      throw ExtensionError(fmt::format("{}: output-type function gave result {} rank {}, expected 0..{}", who,
                                       r, o.ndim, KILN_EXT_MAX_RANK));
    std::vector<graph::Dim> dims;
    for (int32_t d = 0; d < o.ndim; ++d) {
      const KilnExtDim& dim = o.dims[d];
      if (dim.input < 0) {
        if (dim.size < 0)
          throw ExtensionError(fmt::format("{}: output-type function gave result {} dim {} size {}, expected "
                                           ">= 0 or a copy of an operand dim", who, r, d, dim.size));
        dims.emplace_back(dim.size);
        continue;
      }
      auto in = static_cast<size_t>(dim.input);
      if (in >= inputs.size() || dim.input_dim < 0 || dim.input_dim >= graph::shape_of(inputs[in]).rank())
        throw ExtensionError(fmt::format("{}: output-type function gave result {} dim {} as operand {} dim {}, "
                                         "which does not exist {}", who, r, d, dim.input, dim.input_dim,
                                         types_text(inputs)));
      dims.push_back(graph::shape_of(inputs[in])[dim.input_dim]);
    }
    results.push_back(graph::TensorType{*dtype, graph::Shape(std::move(dims)), device});
  }
  return results;
}

void CustomOp::check_call(graph::Op op, const std::vector<Type>& inputs, const Attrs& attrs,
                          const std::string& where) const {
  const bool called_inplace = op == graph::Op::inplace_custom;
  if (called_inplace != inplace_)
    throw ExtensionError(fmt::format(
        "{}: custom op '{}' of {} is {}, so call it with {}", where, name_, library_path().string(),
        inplace_ ? "an in-place op" : "not an in-place op", inplace_ ? "ops::inplace_custom" : "ops::custom"));
  std::vector<Type> computed;
  try {
    computed = output_types(inputs, attrs);
  } catch (const ValueError& e) {  // the same kind of error, placed in the graph
    throw ValueError(fmt::format("{}: {}", where, e.what()));
  } catch (const ExtensionError& e) {
    throw ExtensionError(fmt::format("{}: {}", where, e.what()));
  }
  if (op != graph::Op::custom) return;
  const auto& declared = graph::get_attr<std::vector<Type>>(attrs, "output_types", op);
  if (declared != computed)
    throw ExtensionError(fmt::format(
        "{}: custom op '{}' of {}: declared output types {} but the library gives {} for operands {}", where,
        name_, library_path().string(), types_text(declared), types_text(computed), types_text(inputs)));
}

CustomOp::BoundCall CustomOp::bind(DeviceKind device, const Attrs& attrs) const {
  auto kernel = std::find_if(kernels_.begin(), kernels_.end(),
                             [&](const auto& k) { return k.first == to_dl_device(device); });
  if (kernel == kernels_.end())
    throw ExtensionError(fmt::format("custom op '{}' of {} has no {} kernel", name_, library_path().string(),
                                     device_kind_name(device)));
  return {kernel->second, marshal_params(*this, attrs)};
}

void CustomOp::run(const BoundCall& call, const std::vector<DLTensor>& inputs,
                   const std::vector<DLTensor>& outputs) const {
  std::array<char, kMessageSize> message{};
  KilnExtKernelArgs args{KILN_EXT_KERNEL_ARGS_STRUCT_SIZE, inputs.data(), inputs.size(), outputs.data(),
                         outputs.size(), call.params.data(), call.params.size(), user_data_, message.data(),
                         message.size()};
  if (KilnExtStatus status = call.kernel(&args); status != KILN_EXT_OK)
    throw_library_error(status, fmt::format("custom op '{}' of {}: kernel failed with {}: {}", name_,
                                            library_path().string(), status_name(status),
                                            library_message(message)));
}

void CustomOp::run(DeviceKind device, const std::vector<DLTensor>& inputs, const std::vector<DLTensor>& outputs,
                   const Attrs& attrs) const {
  run(bind(device, attrs), inputs, outputs);
}

}  // namespace kiln::ext
