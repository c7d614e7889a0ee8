/* A library of a later 1.x minor than this kiln knows: it declares KILN_EXT_ABI_MINOR + 5, and each
 * struct it hands over has trailing fields kiln has never heard of (set to values that would fail
 * loudly if kiln read them as anything), so kiln must read the prefix it knows and walk the arrays by
 * the struct_size the library gives:
 *   future_mix(x; alpha, beta) -> x * alpha + beta   f32 [n]; beta is an optional int64 (0)
 * with a CPU kernel and a CUDA one (never run). */
#include <stdio.h>

#include <kiln/extension.h>

/* Each struct as a later header might have it: today's fields, then new ones at the end. */
typedef struct FutureParamDef {
  KilnExtParamDef known;
  const char* hint; /* read as element 1's struct_size by a walk by sizeof: a huge size, refused */
  int64_t flags;
} FutureParamDef;

typedef struct FutureKernelDef {
  KilnExtKernelDef known;
  const char* arch;
  int64_t priority;
} FutureKernelDef;

typedef struct FutureOpDef {
  KilnExtOpDef known;
  const char* category;
  int64_t cost;
} FutureOpDef;

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

static KilnExtStatus mix_cpu(const KilnExtKernelArgs* args) {
  const double alpha = args->params[0].float64_value;
  const int64_t beta = args->params[1].present ? args->params[1].int64_value : 0;
  const DLTensor* x = &args->inputs[0]; /* [n] f32, contiguous in the tests */
  float* out = (float*)args->outputs[0].data;
  for (int64_t i = 0; i < x->shape[0]; ++i) out[i] = (float)(((const float*)x->data)[i] * alpha + (double)beta);
  return KILN_EXT_OK;
}

static KilnExtStatus mix_cuda(const KilnExtKernelArgs* args) {
  snprintf(args->error_message, args->error_message_size, "the CUDA kernel is a stand-in");
  return KILN_EXT_ERROR_UNSUPPORTED;
}

KILN_EXT_EXPORT KilnExtStatus kiln_extension_init(KilnExtInitArgs* args) {
  args->library_abi_major = KILN_EXT_ABI_MAJOR;
  args->library_abi_minor = KILN_EXT_ABI_MINOR + 5;
  FutureParamDef params[2] = {
      {{sizeof(FutureParamDef), "alpha", KILN_EXT_PARAM_FLOAT64, 1}, "a new field", 7},
      {{sizeof(FutureParamDef), "beta", KILN_EXT_PARAM_INT64, 0}, "another", 9}};
  FutureKernelDef kernels[2] = {{{sizeof(FutureKernelDef), kDLCPU, mix_cpu}, "x86-64", 1},
                                {{sizeof(FutureKernelDef), kDLCUDA, mix_cuda}, "sm_90", 2}};
  FutureOpDef def = {{.struct_size = sizeof(FutureOpDef),
                      .name = "future_mix",
                      .num_outputs = 1,
                      .params = &params[0].known,
                      .num_params = 2,
                      .output_types = same_type,
                      .kernels = &kernels[0].known,
                      .num_kernels = 2,
                      .description = "x * alpha + beta, from a newer minor"},
                     "elementwise", 3};
  return args->register_op(args->registrar, &def.known);
}
