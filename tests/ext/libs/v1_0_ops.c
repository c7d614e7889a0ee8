/* A library built against ABI 1.0 (the frozen header beside it), which kiln must keep loading:
 *   v1_0_affine(x; scale, shift) -> x * scale + shift   f32 [n]; shift is optional (0)
 * Its kernel fails on scale 0 with KILN_EXT_ERROR, the only code 1.0 has. Its KilnExtOpDef is 1.0's,
 * without the description 1.1 appends. */
#include <stdio.h>

#include "extension_v1_0.h"

static KilnExtStatus same_type(const KilnExtOutputTypesArgs* args) {
  if (args->num_inputs != 1) {
    snprintf(args->error_message, args->error_message_size, "expected 1 operand, got %zu", args->num_inputs);
    return KILN_EXT_ERROR;
  }
  KilnExtOutputDesc* out = &args->outputs[0];
  out->dtype = args->inputs[0].dtype;
  out->ndim = args->inputs[0].ndim;
  for (int32_t d = 0; d < out->ndim; ++d) {
    out->dims[d].input = 0;
    out->dims[d].input_dim = d;
  }
  return KILN_EXT_OK;
}

static KilnExtStatus affine_cpu(const KilnExtKernelArgs* args) {
  const double scale = args->params[0].float64_value;
  const double shift = args->params[1].present ? args->params[1].float64_value : 0.0;
  if (scale == 0) {
    snprintf(args->error_message, args->error_message_size, "scale must be nonzero");
    return KILN_EXT_ERROR;
  }
  const DLTensor* x = &args->inputs[0]; /* [n] f32, contiguous in the tests */
  float* out = (float*)args->outputs[0].data;
  for (int64_t i = 0; i < x->shape[0]; ++i) out[i] = (float)(((const float*)x->data)[i] * scale + shift);
  return KILN_EXT_OK;
}

KILN_EXT_EXPORT KilnExtStatus kiln_extension_init(KilnExtInitArgs* args) {
  args->library_abi_major = KILN_EXT_ABI_MAJOR; /* 1 */
  args->library_abi_minor = KILN_EXT_ABI_MINOR; /* 0 */
  KilnExtParamDef params[2] = {
      {.struct_size = sizeof(KilnExtParamDef), .name = "scale", .kind = KILN_EXT_PARAM_FLOAT64, .required = 1},
      {.struct_size = sizeof(KilnExtParamDef), .name = "shift", .kind = KILN_EXT_PARAM_FLOAT64}};
  KilnExtKernelDef kernel = {.struct_size = sizeof(KilnExtKernelDef), .device_type = kDLCPU, .fn = affine_cpu};
  KilnExtOpDef def = {.struct_size = sizeof(KilnExtOpDef),
                      .name = "v1_0_affine",
                      .num_outputs = 1,
                      .params = params,
                      .num_params = 2,
                      .output_types = same_type,
                      .kernels = &kernel,
                      .num_kernels = 1};
  return args->register_op(args->registrar, &def);
}

/* Each 1.0 struct's size as 1.0's header lays it out: up to its last field (as kiln's
 * KILN_EXT_*_STRUCT_SIZE_V1_0 constants count) and sizeof, in the order of the header. The test
 * checks kiln's constants against these, so the constants cannot drift from the real 1.0 layout. */
#define PREFIX(type, last) (offsetof(type, last) + sizeof(((type*)0)->last))
KILN_EXT_EXPORT void kiln_test_v1_0_struct_sizes(size_t prefix[9], size_t size[9]) {
  const size_t p[9] = {PREFIX(KilnExtParamDef, required),
                       PREFIX(KilnExtParamValue, int64_array_size),
                       PREFIX(KilnExtTypeDesc, is_buffer),
                       PREFIX(KilnExtOutputDesc, dims),
                       PREFIX(KilnExtOutputTypesArgs, error_message_size),
                       PREFIX(KilnExtKernelArgs, error_message_size),
                       PREFIX(KilnExtKernelDef, fn),
                       PREFIX(KilnExtOpDef, user_data),
                       PREFIX(KilnExtInitArgs, error_message_size)};
  const size_t s[9] = {sizeof(KilnExtParamDef),        sizeof(KilnExtParamValue), sizeof(KilnExtTypeDesc),
                       sizeof(KilnExtOutputDesc),      sizeof(KilnExtOutputTypesArgs),
                       sizeof(KilnExtKernelArgs),      sizeof(KilnExtKernelDef),  sizeof(KilnExtOpDef),
                       sizeof(KilnExtInitArgs)};
  for (int i = 0; i < 9; ++i) {
    prefix[i] = p[i];
    size[i] = s[i];
  }
}
