/* Extension libraries for the loader's tests, one per -D variant:
 *   (none)                   checked_sqrt(x) -> sqrt(x), whose kernel rejects a negative input
 *                            (KILN_EXT_ERROR_INVALID_ARGUMENT); fail_with(x; code, note) -> x, whose
 *                            kernel returns `code` (any int64, known to kiln or not) unless it is 0
 *   KILN_TEST_WRONG_ABI      reports ABI 99.0
 *   KILN_TEST_NO_ENTRY       exports no kiln_extension_init
 *   KILN_TEST_SHORT_OP_DEF   declares this header's minor but gives KilnExtOpDef 1.0's struct_size
 *   KILN_TEST_UNEVEN_PARAMS  fail_with's param 1 has another struct_size than param 0
 *   KILN_TEST_INIT_FAILS     kiln_extension_init returns KILN_EXT_ERROR_UNSUPPORTED with a message
 *   KILN_TEST_HOSTILE_DEFS   registers what $KILN_TEST_HOSTILE names: long_name (a 10000-character op
 *                            name), long_param (as long a param name) or many_ops (10000 ops) */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <kiln/extension.h>

#ifdef KILN_TEST_NO_ENTRY

KILN_EXT_EXPORT int not_the_entry_point(void) { return 0; }

#else

static KilnExtStatus same_type(const KilnExtOutputTypesArgs* args) {
  if (args->num_inputs != 1) {
    snprintf(args->error_message, args->error_message_size, "expected 1 operand, got %zu", args->num_inputs);
    return KILN_EXT_ERROR_INVALID_ARGUMENT;
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
      return KILN_EXT_ERROR_INVALID_ARGUMENT;
    }
    od[i] = sqrtf(xd[i]);
  }
  return KILN_EXT_OK;
}

static KilnExtStatus fail_with_cpu(const KilnExtKernelArgs* args) {
  const int64_t code = args->params[0].int64_value;
  if (code != 0) {
    snprintf(args->error_message, args->error_message_size, "failing with code %lld as asked%s%s",
             (long long)code, args->params[1].present ? ": " : "",
             args->params[1].present ? args->params[1].string_value : "");
    return (KilnExtStatus)code;
  }
  const DLTensor* x = &args->inputs[0]; /* [n] f32 */
  for (int64_t i = 0; i < x->shape[0]; ++i) ((float*)args->outputs[0].data)[i] = ((const float*)x->data)[i];
  return KILN_EXT_OK;
}

KILN_EXT_EXPORT KilnExtStatus kiln_extension_init(KilnExtInitArgs* args) {
#ifdef KILN_TEST_WRONG_ABI
  args->library_abi_major = 99;
  args->library_abi_minor = 0;
#else
  args->library_abi_major = KILN_EXT_ABI_MAJOR;
  args->library_abi_minor = KILN_EXT_ABI_MINOR;
#endif
#ifdef KILN_TEST_INIT_FAILS
  snprintf(args->error_message, args->error_message_size, "needs a GPU this machine lacks");
  return KILN_EXT_ERROR_UNSUPPORTED;
#endif
#ifdef KILN_TEST_HOSTILE_DEFS
  {
    static char long_name[10001];
    memset(long_name, 'a', sizeof long_name - 1);
    const char* which = getenv("KILN_TEST_HOSTILE");
    KilnExtKernelDef k = {.struct_size = sizeof(KilnExtKernelDef), .device_type = kDLCPU, .fn = checked_sqrt_cpu};
    KilnExtParamDef p = {.struct_size = sizeof(KilnExtParamDef), .name = long_name, .kind = KILN_EXT_PARAM_INT64};
    KilnExtOpDef d = {.struct_size = sizeof(KilnExtOpDef), .name = "hostile", .num_outputs = 1,
                      .output_types = same_type, .kernels = &k, .num_kernels = 1};
    if (which && strcmp(which, "long_name") == 0) d.name = long_name;
    if (which && strcmp(which, "long_param") == 0) {
      d.params = &p;
      d.num_params = 1;
    }
    if (which && strcmp(which, "many_ops") == 0) {
      char name[32];
      for (int i = 0; i < 10000; ++i) {
        snprintf(name, sizeof name, "op_%d", i);
        d.name = name;
        if (args->register_op(args->registrar, &d) != KILN_EXT_OK) return KILN_EXT_ERROR;
      }
      return KILN_EXT_OK;
    }
    return args->register_op(args->registrar, &d);
  }
#endif
  KilnExtKernelDef kernel = {.struct_size = sizeof(KilnExtKernelDef), .device_type = kDLCPU,
                             .fn = checked_sqrt_cpu};
  KilnExtOpDef def = {.struct_size = sizeof(KilnExtOpDef),
                      .name = "checked_sqrt",
                      .num_outputs = 1,
                      .output_types = same_type,
                      .kernels = &kernel,
                      .num_kernels = 1};
#ifdef KILN_TEST_SHORT_OP_DEF
  def.struct_size = KILN_EXT_OP_DEF_STRUCT_SIZE_V1_0; /* too short for the 1.1 it declares */
#endif
  if (args->register_op(args->registrar, &def) != KILN_EXT_OK) return KILN_EXT_ERROR;

  KilnExtParamDef params[2] = {
      {.struct_size = sizeof(KilnExtParamDef), .name = "code", .kind = KILN_EXT_PARAM_INT64, .required = 1},
      {.struct_size = sizeof(KilnExtParamDef), .name = "note", .kind = KILN_EXT_PARAM_STRING}};
#ifdef KILN_TEST_UNEVEN_PARAMS
  params[1].struct_size = sizeof(KilnExtParamDef) + 8;
#endif
  KilnExtKernelDef fail_kernel = {.struct_size = sizeof(KilnExtKernelDef), .device_type = kDLCPU,
                                  .fn = fail_with_cpu};
  KilnExtOpDef fail_with = {.struct_size = sizeof(KilnExtOpDef),
                            .name = "fail_with",
                            .num_outputs = 1,
                            .params = params,
                            .num_params = 2,
                            .output_types = same_type,
                            .kernels = &fail_kernel,
                            .num_kernels = 1,
                            .description = "x, or the error code it is given"};
  return args->register_op(args->registrar, &fail_with);
}

#endif
