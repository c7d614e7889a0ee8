/* Extension libraries for the loader's error tests, one per -D variant:
 *   (none)                checked_sqrt(x) -> sqrt(x); its kernel reports failure on a negative input
 *   KILN_TEST_WRONG_ABI   reports ABI major 99
 *   KILN_TEST_NO_ENTRY    exports no kiln_extension_init */
#include <math.h>
#include <stdio.h>

#include <kiln/extension.h>

#ifdef KILN_TEST_NO_ENTRY

KILN_EXT_EXPORT int not_the_entry_point(void) { return 0; }

#else

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

static KilnExtStatus checked_sqrt_cpu(const KilnExtKernelArgs* args) {
  const DLTensor* x = &args->inputs[0];    /* [n], contiguous in the tests */
  const DLTensor* out = &args->outputs[0]; /* [n] */
  const float* xd = (const float*)x->data;
  float* od = (float*)out->data;
  for (int64_t i = 0; i < x->shape[0]; ++i) {
    if (xd[i] < 0) {
      snprintf(args->error_message, args->error_message_size, "element %lld is %g, expected >= 0",
               (long long)i, xd[i]);
      return KILN_EXT_ERROR;
    }
    od[i] = sqrtf(xd[i]);
  }
  return KILN_EXT_OK;
}

KILN_EXT_EXPORT KilnExtStatus kiln_extension_init(KilnExtInitArgs* args) {
#ifdef KILN_TEST_WRONG_ABI
  args->library_abi_major = 99;
#else
  args->library_abi_major = KILN_EXT_ABI_MAJOR;
#endif
  args->library_abi_minor = KILN_EXT_ABI_MINOR;
  KilnExtKernelDef kernel = {.struct_size = sizeof(KilnExtKernelDef), .device_type = kDLCPU,
                             .fn = checked_sqrt_cpu};
  KilnExtOpDef def = {.struct_size = sizeof(KilnExtOpDef),
                      .name = "checked_sqrt",
                      .num_outputs = 1,
                      .output_types = same_type,
                      .kernels = &kernel,
                      .num_kernels = 1};
  return args->register_op(args->registrar, &def);
}

#endif
