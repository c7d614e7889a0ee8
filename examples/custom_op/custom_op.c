/* An example kiln extension with two custom ops (see docs/extensions.md):
 *   scale_add(x, y; scale)  -> x * scale + y        f32, same shapes; `scale` is a float64 parameter
 *   accumulate(buffer, x)   buffer += x, in place   f32 buffer and tensor of the same shape
 * Plain C against kiln/extension.h only; build it with this folder's CMakeLists.txt. */
#include <stdio.h>
#include <string.h>

#include <kiln/extension.h>

/* Added to every scale_add result; the tests build a second copy with -DSCALE_ADD_OFFSET=1000 to
 * show a rebuilt library is picked up. */
#ifndef SCALE_ADD_OFFSET
#define SCALE_ADD_OFFSET 0
#endif

/* ---- helpers ---------------------------------------------------------------------------------- */

static int is_f32(DLDataType t) { return t.code == kDLFloat && t.bits == 32 && t.lanes == 1; }

static int64_t num_elements(const DLTensor* t) {
  int64_t n = 1;
  for (int32_t d = 0; d < t->ndim; ++d) n *= t->shape[d];
  return n;
}

/* Offset in elements of the row-major position `flat` in a strided view. */
static int64_t offset_of(const DLTensor* t, int64_t flat) {
  int64_t offset = 0;
  for (int32_t d = t->ndim - 1; d >= 0; --d) {
    offset += (flat % t->shape[d]) * t->strides[d];
    flat /= t->shape[d];
  }
  return offset;
}

/* At run time dynamic dims are concrete: a kernel checks what its output-type function could not.
 * Operands an op does not accept are the caller's mistake: KILN_EXT_ERROR_INVALID_ARGUMENT, which
 * kiln raises as a ValueError. */
static KilnExtStatus check_same_shape(const DLTensor* a, const DLTensor* b, char* message, size_t size) {
  for (int32_t d = 0; d < a->ndim; ++d)
    if (a->shape[d] != b->shape[d]) {
      snprintf(message, size, "operand dims %d differ at run time: %lld vs %lld", d, (long long)a->shape[d],
               (long long)b->shape[d]);
      return KILN_EXT_ERROR_INVALID_ARGUMENT;
    }
  return KILN_EXT_OK;
}

/* Two f32 operands of one shape (a dynamic dim matches anything; the kernel sees concrete ones). */
static KilnExtStatus check_same_f32(const KilnExtTypeDesc* a, const KilnExtTypeDesc* b, char* message,
                                    size_t size) {
  if (!is_f32(a->dtype) || !is_f32(b->dtype)) {
    snprintf(message, size, "operands must be f32");
    return KILN_EXT_ERROR_INVALID_ARGUMENT;
  }
  if (a->ndim != b->ndim) {
    snprintf(message, size, "operands must have the same rank, got %d and %d", a->ndim, b->ndim);
    return KILN_EXT_ERROR_INVALID_ARGUMENT;
  }
  for (int32_t d = 0; d < a->ndim; ++d)
    if (a->shape[d] != b->shape[d] && a->shape[d] != KILN_EXT_DYNAMIC_DIM &&
        b->shape[d] != KILN_EXT_DYNAMIC_DIM) {
      snprintf(message, size, "operand dims %d differ: %lld vs %lld", d, (long long)a->shape[d],
               (long long)b->shape[d]);
      return KILN_EXT_ERROR_INVALID_ARGUMENT;
    }
  return KILN_EXT_OK;
}

/* ---- scale_add ---------------------------------------------------------------------------------- */

static KilnExtStatus scale_add_types(const KilnExtOutputTypesArgs* args) {
  if (args->num_inputs != 2) {
    snprintf(args->error_message, args->error_message_size, "expected 2 operands (x, y), got %zu",
             args->num_inputs);
    return KILN_EXT_ERROR_INVALID_ARGUMENT;
  }
  KilnExtStatus status =
      check_same_f32(&args->inputs[0], &args->inputs[1], args->error_message, args->error_message_size);
  if (status != KILN_EXT_OK) return status;
  KilnExtOutputDesc* out = &args->outputs[0];
  out->dtype = args->inputs[0].dtype;
  out->ndim = args->inputs[0].ndim;
  for (int32_t d = 0; d < out->ndim; ++d) {  /* each result dim is x's (symbolic dims stay symbolic) */
    out->dims[d].input = 0;
    out->dims[d].input_dim = d;
  }
  return KILN_EXT_OK;
}

static KilnExtStatus scale_add_cpu(const KilnExtKernelArgs* args) {
  const DLTensor* x = &args->inputs[0]; /* [...] */
  const DLTensor* y = &args->inputs[1]; /* [...] */
  const DLTensor* out = &args->outputs[0]; /* [...], contiguous */
  KilnExtStatus status = check_same_shape(x, y, args->error_message, args->error_message_size);
  if (status != KILN_EXT_OK) return status;
  const float scale = (float)args->params[0].float64_value;
  const float* xd = (const float*)x->data;
  const float* yd = (const float*)y->data;
  float* od = (float*)out->data;
  const int64_t n = num_elements(out);
  for (int64_t i = 0; i < n; ++i)
    od[i] = xd[offset_of(x, i)] * scale + yd[offset_of(y, i)] + (float)SCALE_ADD_OFFSET;
  return KILN_EXT_OK;
}

/* ---- accumulate (in place) ---------------------------------------------------------------------- */

static KilnExtStatus accumulate_types(const KilnExtOutputTypesArgs* args) {
  if (args->num_inputs != 2 || !args->inputs[0].is_buffer) {
    snprintf(args->error_message, args->error_message_size, "expected operands (buffer, x)");
    return KILN_EXT_ERROR_INVALID_ARGUMENT;
  }
  return check_same_f32(&args->inputs[0], &args->inputs[1], args->error_message, args->error_message_size);
}

static KilnExtStatus accumulate_cpu(const KilnExtKernelArgs* args) {
  const DLTensor* buffer = &args->inputs[0]; /* [...], contiguous, written in place */
  const DLTensor* x = &args->inputs[1];      /* [...] */
  KilnExtStatus status = check_same_shape(buffer, x, args->error_message, args->error_message_size);
  if (status != KILN_EXT_OK) return status;
  float* bd = (float*)buffer->data;
  const float* xd = (const float*)x->data;
  const int64_t n = num_elements(buffer);
  for (int64_t i = 0; i < n; ++i) bd[i] += xd[offset_of(x, i)];
  return KILN_EXT_OK;
}

/* ---- registration ------------------------------------------------------------------------------- */

KILN_EXT_EXPORT KilnExtStatus kiln_extension_init(KilnExtInitArgs* args) {
  /* Declared first: kiln reads every def below as this version's layout. */
  args->library_abi_major = KILN_EXT_ABI_MAJOR;
  args->library_abi_minor = KILN_EXT_ABI_MINOR;
  if (args->host_abi_major != KILN_EXT_ABI_MAJOR) {
    snprintf(args->error_message, args->error_message_size, "built for kiln extension ABI %d",
             KILN_EXT_ABI_MAJOR);
    return KILN_EXT_ERROR_UNSUPPORTED;
  }

  /* Defs are copied by register_op, so locals are fine; the functions must stay (they do). */
  KilnExtParamDef scale = {.struct_size = sizeof(KilnExtParamDef), .name = "scale",
                           .kind = KILN_EXT_PARAM_FLOAT64, .required = 1};
  KilnExtKernelDef scale_add_kernel = {.struct_size = sizeof(KilnExtKernelDef), .device_type = kDLCPU,
                                       .fn = scale_add_cpu};
  KilnExtOpDef scale_add = {.struct_size = sizeof(KilnExtOpDef),
                            .name = "scale_add",
                            .num_outputs = 1,
                            .params = &scale,
                            .num_params = 1,
                            .output_types = scale_add_types,
                            .kernels = &scale_add_kernel,
                            .num_kernels = 1,
                            .description = "x * scale + y, elementwise (f32)"};
  if (args->register_op(args->registrar, &scale_add) != KILN_EXT_OK) return KILN_EXT_ERROR;

  KilnExtKernelDef accumulate_kernel = {.struct_size = sizeof(KilnExtKernelDef), .device_type = kDLCPU,
                                        .fn = accumulate_cpu};
  KilnExtOpDef accumulate = {.struct_size = sizeof(KilnExtOpDef),
                             .name = "accumulate",
                             .inplace = 1,
                             .output_types = accumulate_types,
                             .kernels = &accumulate_kernel,
                             .num_kernels = 1,
                             .description = "buffer += x, in place (f32)"};
  return args->register_op(args->registrar, &accumulate);
}
