// Tensor memory and DLPack exchange.
//
// DLPack dtype mapping (both struct kinds): f32/f16/f64 <-> kDLFloat 32/16/64, bf16 <-> kDLBfloat 16,
// iN <-> kDLInt N, uN <-> kDLUInt N, bool <-> code 6 bits 8 (kDLBool of DLPack 1.0; Debian's 0.6
// header has no name for it, and no other code fits). On import, kDLUInt bits 8 is always u8, never
// bool. Only kDLCPU memory is imported; lanes must be 1.
#include "kiln/tensor/tensor.h"

#include <string>

#include "kiln/tensor/device_memory.h"

namespace kiln {

namespace {

constexpr uint8_t kDLBoolCode = 6;  // kDLBool in DLPack 1.0

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) out += (i ? ", " : "") + std::to_string(shape[i]);
  return out + "]";
}

// Element count of a shape; ValueError (naming `what`) on a negative dim or overflow.
int64_t checked_numel(const std::vector<int64_t>& shape, const std::string& what) {
  int64_t n = 1;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] < 0)
      throw ValueError(what + ": dim " + std::to_string(i) + " of shape " + shape_text(shape) +
                       " is negative");
    if (__builtin_mul_overflow(n, shape[i], &n))
      throw ValueError(what + ": element count of shape " + shape_text(shape) + " overflows int64");
  }
  return n;
}

std::vector<int64_t> checked_strides(const std::vector<int64_t>& shape, const std::vector<int64_t>& strides,
                                     const std::string& what) {
  if (strides.empty() && !shape.empty()) return contiguous_strides(shape);
  if (strides.size() != shape.size())
    throw ValueError(what + ": " + std::to_string(strides.size()) + " strides for a rank-" +
                     std::to_string(shape.size()) + " shape " + shape_text(shape));
  return strides;
}

void require_cpu(DeviceRef device, const char* what) {
  if (device.kind != DeviceKind::CPU)
    throw ValueError(std::string(what) + ": device " + device.to_string() +
                     " is not supported (kiln allocates and copies only cpu memory)");
}

// ---- DLPack dtype and device mapping -------------------------------------------------------------

DLDataType to_dl_dtype(DType d) {
  DLDataType t;
  t.lanes = 1;
  t.bits = static_cast<uint8_t>(dtype_size(d) * 8);
  if (d == DType::boolean)
    t.code = kDLBoolCode;
  else if (d == DType::bf16)
    t.code = kDLBfloat;
  else if (is_float(d))
    t.code = kDLFloat;
  else
    t.code = is_signed(d) ? kDLInt : kDLUInt;
  return t;
}

std::string dl_dtype_text(DLDataType t) {
  return "code " + std::to_string(t.code) + " bits " + std::to_string(t.bits) + " lanes " +
         std::to_string(t.lanes);
}

DType from_dl_dtype(DLDataType t, const std::string& what) {
  if (t.lanes != 1)
    throw ValueError(what + ": dtype lanes " + std::to_string(t.lanes) +
                     " is not supported (vector dtypes; expected lanes 1)");
  auto unsupported = [&]() {
    return ValueError(what + ": unsupported DLPack dtype (" + dl_dtype_text(t) +
                      "); expected float 16/32/64, bfloat 16, int or uint 8/16/32/64, or bool 8");
  };
  switch (t.code) {
    case kDLFloat:
      if (t.bits == 16) return DType::f16;
      if (t.bits == 32) return DType::f32;
      if (t.bits == 64) return DType::f64;
      break;
    case kDLBfloat:
      if (t.bits == 16) return DType::bf16;
      break;
    case kDLInt:
      if (t.bits == 8) return DType::i8;
      if (t.bits == 16) return DType::i16;
      if (t.bits == 32) return DType::i32;
      if (t.bits == 64) return DType::i64;
      break;
    case kDLUInt:
      if (t.bits == 8) return DType::u8;
      if (t.bits == 16) return DType::u16;
      if (t.bits == 32) return DType::u32;
      if (t.bits == 64) return DType::u64;
      break;
    case kDLBoolCode:
      if (t.bits == 8) return DType::boolean;
      break;
    default: break;
  }
  throw unsupported();
}

DLDevice to_dl_device(DeviceRef d) {
  return DLDevice{d.kind == DeviceKind::CPU ? kDLCPU : kDLCUDA, d.id};
}

// Fields shared by both DLPack structs, wrapped into a Tensor whose storage is `owner`.
Tensor import_dl_tensor(const DLTensor& dl, std::shared_ptr<void> owner, const std::string& what) {
  if (dl.device.device_type != kDLCPU)
    throw ValueError(what + ": device type " + std::to_string(dl.device.device_type) +
                     " is not supported (expected kDLCPU = 1)");
  if (dl.device.device_id < 0)
    throw ValueError(what + ": negative device id " + std::to_string(dl.device.device_id));
  const DType dtype = from_dl_dtype(dl.dtype, what);
  if (dl.ndim < 0) throw ValueError(what + ": negative ndim " + std::to_string(dl.ndim));
  if (dl.ndim > 0 && dl.shape == nullptr) throw ValueError(what + ": shape is NULL for ndim " + std::to_string(dl.ndim));

  const auto rank = static_cast<size_t>(dl.ndim);
  std::vector<int64_t> shape(dl.shape, dl.shape + rank);
  const int64_t numel = checked_numel(shape, what);
  std::vector<int64_t> strides =
      dl.strides == nullptr ? contiguous_strides(shape) : std::vector<int64_t>(dl.strides, dl.strides + rank);

  // The furthest element must be addressable: |offset| * element size fits in int64.
  const auto element = static_cast<int64_t>(dtype_size(dtype));
  if (numel > 0) {
    int64_t reach = 0;
    for (size_t i = 0; i < rank; ++i) {
      int64_t span;
      if (__builtin_mul_overflow(shape[i] - 1, strides[i] < 0 ? -strides[i] : strides[i], &span) ||
          __builtin_add_overflow(reach, span, &reach))
        throw ValueError(what + ": strides " + shape_text(strides) + " of shape " + shape_text(shape) + " overflow");
    }
    if (__builtin_mul_overflow(reach, element, &reach))
      throw ValueError(what + ": strides " + shape_text(strides) + " of shape " + shape_text(shape) + " overflow");
    if (dl.data == nullptr) throw ValueError(what + ": data is NULL for " + std::to_string(numel) + " elements");
  }
  char* data = static_cast<char*>(dl.data) + dl.byte_offset;
  if (numel > 0 && reinterpret_cast<uintptr_t>(data) % static_cast<uintptr_t>(element) != 0)
    throw ValueError(what + ": data + byte_offset " + std::to_string(dl.byte_offset) + " is not aligned to the " +
                     std::to_string(element) + "-byte " + std::string(dtype_name(dtype)) + " element");

  return Tensor::view(std::move(owner), data, dtype, shape, strides, DeviceRef::CPU(dl.device.device_id));
}

// Owns what an exported DLPack struct points at; freed by the struct's deleter.
template <class Managed>
struct ExportContext {
  Managed managed{};
  std::shared_ptr<void> keep_alive;
  std::vector<int64_t> shape, strides;
};

template <class Managed>
ExportContext<Managed>* export_context(const Tensor& t, std::shared_ptr<void> keep_alive, const char* what) {
  if (!t.defined()) throw ValueError(std::string(what) + ": the tensor is undefined");
  auto* ctx = new ExportContext<Managed>;
  ctx->keep_alive = std::move(keep_alive);
  ctx->shape = t.shape();
  ctx->strides = t.strides();
  DLTensor& dl = ctx->managed.dl_tensor;
  dl.data = const_cast<void*>(t.data());
  dl.device = to_dl_device(t.device());
  dl.ndim = static_cast<int32_t>(t.rank());
  dl.dtype = to_dl_dtype(t.dtype());
  dl.shape = ctx->shape.empty() ? nullptr : ctx->shape.data();
  dl.strides = ctx->strides.empty() ? nullptr : ctx->strides.data();
  dl.byte_offset = 0;
  ctx->managed.manager_ctx = ctx;
  ctx->managed.deleter = [](Managed* self) { delete static_cast<ExportContext<Managed>*>(self->manager_ctx); };
  return ctx;
}

// Copies `src` (any strides) into packed row-major `dst`, element by element.
void copy_strided(const Tensor& src, void* dst) {
  const int64_t numel = src.numel();
  if (numel == 0) return;
  const size_t element = dtype_size(src.dtype());
  const auto& shape = src.shape();
  const auto& strides = src.strides();
  const size_t rank = shape.size();
  auto* out = static_cast<char*>(dst);
  const auto* base = static_cast<const char*>(src.data());
  if (rank == 0) {
    std::memcpy(out, base, element);
    return;
  }
  // Walk an index odometer over the outer dims; the innermost dim is a tight loop.
  std::vector<int64_t> index(rank, 0);
  int64_t offset = 0;  // in elements, of index[0..rank-2] with the innermost at 0
  const int64_t inner = shape[rank - 1], inner_stride = strides[rank - 1];
  for (int64_t done = 0; done < numel; done += inner) {
    for (int64_t i = 0; i < inner; ++i, out += element)
      std::memcpy(out, base + (offset + i * inner_stride) * static_cast<int64_t>(element), element);
    for (size_t d = rank - 1; d-- > 0;) {
      if (++index[d] < shape[d]) {
        offset += strides[d];
        break;
      }
      offset -= strides[d] * (shape[d] - 1);
      index[d] = 0;
    }
  }
}

}  // namespace

std::vector<int64_t> contiguous_strides(const std::vector<int64_t>& shape) {
  std::vector<int64_t> strides(shape.size());
  int64_t running = 1;
  for (size_t i = shape.size(); i-- > 0;) {
    strides[i] = running;
    running *= std::max<int64_t>(shape[i], 1);
  }
  return strides;
}

// ---- construction --------------------------------------------------------------------------------

Tensor Tensor::empty(DType dtype, const std::vector<int64_t>& shape, DeviceRef device) {
  require_cpu(device, "Tensor::empty");
  const int64_t numel = checked_numel(shape, "Tensor::empty");
  int64_t nbytes;  // byte offsets are signed, so the size must fit int64
  if (__builtin_mul_overflow(numel, static_cast<int64_t>(dtype_size(dtype)), &nbytes))
    throw ValueError("Tensor::empty: byte size of " + std::string(dtype_name(dtype)) + shape_text(shape) +
                     " overflows int64");
  Tensor t;
  t.storage_ = allocate(device, static_cast<size_t>(nbytes));  // counted against the device
  t.data_ = t.storage_.get();
  t.dtype_ = dtype;
  t.shape_ = shape;
  t.strides_ = contiguous_strides(shape);
  t.device_ = device;
  return t;
}

Tensor Tensor::zeros(DType dtype, const std::vector<int64_t>& shape, DeviceRef device) {
  Tensor t = empty(dtype, shape, device);
  std::memset(t.data_, 0, t.nbytes());
  return t;
}

Tensor Tensor::borrow(void* data, DType dtype, const std::vector<int64_t>& shape,
                      const std::vector<int64_t>& strides, DeviceRef device) {
  return view(nullptr, data, dtype, shape, strides, device);
}

Tensor Tensor::view(std::shared_ptr<void> keep_alive, void* data, DType dtype, const std::vector<int64_t>& shape,
                    const std::vector<int64_t>& strides, DeviceRef device) {
  const std::string what = keep_alive ? "Tensor::view" : "Tensor::borrow";
  const int64_t numel = checked_numel(shape, what);
  if (data == nullptr && numel > 0) throw ValueError(what + ": data is null for shape " + shape_text(shape));
  Tensor t;
  t.storage_ = std::move(keep_alive);
  t.data_ = data;
  t.dtype_ = dtype;
  t.shape_ = shape;
  t.strides_ = checked_strides(shape, strides, what);
  t.device_ = device;
  return t;
}

// ---- DLPack --------------------------------------------------------------------------------------

Tensor Tensor::from_dlpack(DLManagedTensor* managed) {
  if (managed == nullptr) throw ValueError("Tensor::from_dlpack: DLManagedTensor is null");
  // Owning the struct first means any failure below still runs its deleter, exactly once.
  std::shared_ptr<void> owner(managed, [](void* p) {
    auto* m = static_cast<DLManagedTensor*>(p);
    if (m->deleter) m->deleter(m);
  });
  return import_dl_tensor(managed->dl_tensor, std::move(owner), "Tensor::from_dlpack");
}

Tensor Tensor::from_dlpack(DLManagedTensorVersioned* managed) {
  if (managed == nullptr) throw ValueError("Tensor::from_dlpack: DLManagedTensorVersioned is null");
  std::shared_ptr<void> owner(managed, [](void* p) {
    auto* m = static_cast<DLManagedTensorVersioned*>(p);
    if (m->deleter) m->deleter(m);
  });
  if (managed->version.major > KILN_DLPACK_VERSIONED_MAJOR)
    throw ValueError("Tensor::from_dlpack: DLPack version " + std::to_string(managed->version.major) + "." +
                     std::to_string(managed->version.minor) + " is not supported (expected major <= " +
                     std::to_string(KILN_DLPACK_VERSIONED_MAJOR) + ")");
  return import_dl_tensor(managed->dl_tensor, std::move(owner), "Tensor::from_dlpack");
}

// A borrowed tensor's export keeps nothing alive: the borrower's promise extends to the consumer.
DLManagedTensor* Tensor::to_dlpack() const {
  return &export_context<DLManagedTensor>(*this, storage_, "Tensor::to_dlpack")->managed;
}

DLManagedTensorVersioned* Tensor::to_dlpack_versioned() const {
  auto* ctx = export_context<DLManagedTensorVersioned>(*this, storage_, "Tensor::to_dlpack_versioned");
  ctx->managed.version = {KILN_DLPACK_VERSIONED_MAJOR, KILN_DLPACK_VERSIONED_MINOR};
  ctx->managed.flags = 0;
  return &ctx->managed;
}

// ---- queries and copies --------------------------------------------------------------------------

int64_t Tensor::dim(int64_t i) const {
  const int64_t r = rank();
  if (i < -r || i >= r)
    throw ValueError("Tensor::dim: index " + std::to_string(i) + " out of range for rank " + std::to_string(r));
  return shape_[static_cast<size_t>(i < 0 ? i + r : i)];
}

int64_t Tensor::numel() const {
  int64_t n = 1;
  for (int64_t d : shape_) n *= d;  // checked when the tensor was made
  return n;
}

bool Tensor::is_contiguous() const {
  // Strides of size-1 dims never matter, and an empty tensor has no elements to misplace.
  int64_t expected = 1;
  for (size_t i = shape_.size(); i-- > 0;) {
    if (shape_[i] == 0) return true;
    if (shape_[i] != 1 && strides_[i] != expected) return false;
    expected *= shape_[i];
  }
  return true;
}

bool Tensor::is_owner() const { return storage_ != nullptr; }

Tensor Tensor::contiguous() const {
  if (is_contiguous()) return *this;
  return clone();
}

Tensor Tensor::clone() const {
  if (!defined()) throw ValueError("Tensor::clone: the tensor is undefined");
  require_cpu(device_, "Tensor::clone");
  Tensor out = empty(dtype_, shape_, device_);
  copy_strided(*this, out.data_);
  return out;
}

std::string Tensor::to_string() const {
  if (!defined()) return "Tensor(undefined)";
  return "Tensor(" + std::string(dtype_name(dtype_)) + shape_text(shape_) + ", " + device_.to_string() + ")";
}

}  // namespace kiln
