/* FROZEN: kiln/extension.h exactly as released at ABI 1.0, for the test that a library built against an
 * older minor still loads (tests/ext/libs/v1_0_ops.c). Never edit it; a new minor gets its own copy. */
/* kiln custom-kernel extensions: the stable C ABI a shared library implements to add ops.
 *
 * Plain C99, so a library can be built by any compiler. A library exports one function,
 * kiln_extension_init, which kiln calls once after dlopen. Through the registrar it is given, the
 * library registers named ops: each with its parameters, an output-type function (result dtypes and
 * shapes from the operand types and parameters) and one kernel per device kind. Kernels see tensors
 * as DLPack DLTensor views. A graph calls an op with kiln::graph::ops::custom (or inplace_custom,
 * which mutates its first operand, a buffer). See docs/extensions.md and examples/custom_op/.
 *
 *   int32_t kiln_extension_init(KilnExtInitArgs* args) {
 *     args->library_abi_major = KILN_EXT_ABI_MAJOR;   // what this library was built against
 *     args->library_abi_minor = KILN_EXT_ABI_MINOR;
 *     if (args->host_abi_major != KILN_EXT_ABI_MAJOR) return KILN_EXT_ERROR;
 *     KilnExtOpDef def = {.struct_size = sizeof(KilnExtOpDef), .name = "scale_add", ...};
 *     return args->register_op(args->registrar, &def);
 *   }
 *
 * Conventions (after the PJRT C API):
 * - Every struct starts with `size_t struct_size`, set by whoever fills the struct to
 *   sizeof(the struct) as that party compiled it. A reader touches only fields that lie within
 *   struct_size; fields past it read as zero. This is what lets minor versions add fields.
 * - Errors are a returned status (KILN_EXT_OK or KILN_EXT_ERROR) plus a message the callee writes,
 *   NUL-terminated and truncated to fit, into a buffer the caller owns (error_message,
 *   error_message_size). kiln turns a failure into a C++ exception naming the library and op.
 * - Lifetimes are written on each field. In short: everything kiln passes in is valid only for the
 *   duration of the call; everything a library registers is copied by kiln during register_op,
 *   except function pointers and user_data, which must stay valid while the library is loaded.
 *   kiln never unloads a library before the process exits.
 *
 * Versioning: KILN_EXT_ABI_MAJOR.KILN_EXT_ABI_MINOR.
 * - MAJOR bumps on any incompatible change: a field removed, reordered or retyped, a changed
 *   meaning, a changed signature. kiln refuses a library whose major differs from its own.
 * - MINOR bumps on compatible additions only: new fields at the end of a struct, new enum values,
 *   new function pointers at the end of KilnExtInitArgs. kiln loads a library of any minor of its
 *   major; each side checks struct_size before reading a field newer than the oldest minor.
 */
#ifndef KILN_EXTENSION_H_
#define KILN_EXTENSION_H_

#include <stddef.h>
#include <stdint.h>

#include <dlpack/dlpack.h>

#ifdef __cplusplus
extern "C" {
#endif

#define KILN_EXT_ABI_MAJOR 1
#define KILN_EXT_ABI_MINOR 0

/* The exported entry point's name, for dlsym. */
#define KILN_EXT_INIT_SYMBOL "kiln_extension_init"

#if defined(_WIN32)
#define KILN_EXT_EXPORT __declspec(dllexport)
#else
#define KILN_EXT_EXPORT __attribute__((visibility("default")))
#endif

typedef int32_t KilnExtStatus;
#define KILN_EXT_OK 0
#define KILN_EXT_ERROR 1

/* DLDataType code of kiln's bool dtype (8 bits): kDLBool in DLPack >= 0.8, absent from older headers. */
#define KILN_EXT_DL_BOOL 6

/* Most dims a custom op's operand or result may have. */
#define KILN_EXT_MAX_RANK 8
/* A dim that is not known until the graph runs (symbolic, e.g. "batch"). */
#define KILN_EXT_DYNAMIC_DIM (-1)

/* ---- parameters --------------------------------------------------------------------------------
 * A graph passes parameters as attributes (ops::custom(..., {{"scale", 2.0}})). The op declares
 * each one; kiln checks kinds before any library code runs and hands them over in declared order. */
typedef enum KilnExtParamKind {
  KILN_EXT_PARAM_INT64 = 1,
  KILN_EXT_PARAM_FLOAT64 = 2, /* an int64 attribute is accepted and converted */
  KILN_EXT_PARAM_STRING = 3,
  KILN_EXT_PARAM_INT64_ARRAY = 4,
} KilnExtParamKind;

typedef struct KilnExtParamDef {
  size_t struct_size;
  const char* name;      /* copied during register_op */
  KilnExtParamKind kind;
  int32_t required;      /* nonzero: a graph must set it; zero: `present` says whether it did */
} KilnExtParamDef;

typedef struct KilnExtParamValue {
  size_t struct_size;
  const char* name;             /* the declared name */
  KilnExtParamKind kind;
  int32_t present;              /* zero for an optional parameter the graph did not set */
  int64_t int64_value;          /* KILN_EXT_PARAM_INT64 */
  double float64_value;         /* KILN_EXT_PARAM_FLOAT64 */
  const char* string_value;     /* KILN_EXT_PARAM_STRING, NUL-terminated */
  const int64_t* int64_array;   /* KILN_EXT_PARAM_INT64_ARRAY */
  size_t int64_array_size;
} KilnExtParamValue; /* every pointer valid for the duration of the call it is passed to */

/* ---- output types ------------------------------------------------------------------------------ */

/* An operand's type as the output-type function sees it. */
typedef struct KilnExtTypeDesc {
  size_t struct_size;
  DLDataType dtype;
  int32_t ndim;
  const int64_t* shape;     /* ndim dims; KILN_EXT_DYNAMIC_DIM where the dim is symbolic */
  DLDeviceType device_type; /* kDLCPU or kDLCUDA */
  int32_t is_buffer;        /* nonzero for a mutable buffer operand */
} KilnExtTypeDesc;

/* One result dim: a copy of an operand's dim (input >= 0, symbolic dims stay symbolic), or a static
 * size (input < 0). */
typedef struct KilnExtDim {
  int64_t size;
  int32_t input;
  int32_t input_dim;
} KilnExtDim;

/* A result's type, filled by the output-type function. Results live on operand 0's device. */
typedef struct KilnExtOutputDesc {
  size_t struct_size;
  DLDataType dtype;
  int32_t ndim; /* at most KILN_EXT_MAX_RANK */
  KilnExtDim dims[KILN_EXT_MAX_RANK];
} KilnExtOutputDesc;

typedef struct KilnExtOutputTypesArgs {
  size_t struct_size;
  const KilnExtTypeDesc* inputs; /* num_inputs operand types */
  size_t num_inputs;
  const KilnExtParamValue* params; /* every declared parameter, in declared order */
  size_t num_params;
  KilnExtOutputDesc* outputs; /* the op's num_outputs results, struct_size preset; fill them */
  size_t num_outputs;
  void* user_data;     /* the op's KilnExtOpDef::user_data */
  char* error_message; /* on failure, say what was expected (e.g. "operand 1 must be f32") */
  size_t error_message_size;
} KilnExtOutputTypesArgs;

/* Checks the operands and parameters and fills the result types. Called when a graph is built (if
 * the library is already loaded) and when it is compiled; must be pure. */
typedef KilnExtStatus (*KilnExtOutputTypesFn)(const KilnExtOutputTypesArgs* args);

/* ---- kernels ----------------------------------------------------------------------------------- */

typedef struct KilnExtKernelArgs {
  size_t struct_size;
  const DLTensor* inputs; /* operands; an inplace op writes through inputs[0]->data */
  size_t num_inputs;
  const DLTensor* outputs; /* results, allocated (contiguous) by kiln; the kernel fills them */
  size_t num_outputs;
  const KilnExtParamValue* params; /* every declared parameter, in declared order */
  size_t num_params;
  void* user_data;
  char* error_message; /* on failure, say what went wrong; kiln adds the op and node */
  size_t error_message_size;
} KilnExtKernelArgs; /* every pointer valid for the duration of the call only */
/* DLTensor views: strides are in elements (set whenever ndim > 0); byte_offset is 0. Operands may be
 * strided (buffers are contiguous); results are contiguous. Shapes are concrete. */

typedef KilnExtStatus (*KilnExtKernelFn)(const KilnExtKernelArgs* args);

typedef struct KilnExtKernelDef {
  size_t struct_size;
  DLDeviceType device_type; /* kDLCPU, kDLCUDA */
  KilnExtKernelFn fn;       /* valid while the library is loaded */
} KilnExtKernelDef;

/* ---- ops --------------------------------------------------------------------------------------- */

typedef struct KilnExtOpDef {
  size_t struct_size;
  const char* name; /* the symbol graphs call; unique across the libraries a compile uses */
  int32_t inplace;  /* nonzero: called with ops::inplace_custom, mutates operand 0 (a buffer) */
  size_t num_outputs; /* 0 for an inplace op */
  const KilnExtParamDef* params; /* num_params entries, copied */
  size_t num_params;
  KilnExtOutputTypesFn output_types; /* required; valid while the library is loaded */
  const KilnExtKernelDef* kernels;   /* one per device kind, copied */
  size_t num_kernels;
  void* user_data; /* passed back to output_types and kernels; kiln never frees it */
} KilnExtOpDef;

/* ---- the entry point ---------------------------------------------------------------------------- */

typedef struct KilnExtRegistrar KilnExtRegistrar; /* opaque, owned by kiln */

typedef struct KilnExtInitArgs {
  size_t struct_size;
  uint32_t host_abi_major; /* kiln's KILN_EXT_ABI_MAJOR / MINOR */
  uint32_t host_abi_minor;
  uint32_t library_abi_major; /* out: set to the library's KILN_EXT_ABI_MAJOR / MINOR */
  uint32_t library_abi_minor;
  KilnExtRegistrar* registrar; /* valid during kiln_extension_init only */
  /* Registers one op (the def is copied). KILN_EXT_ERROR for a malformed def or a name registered
   * twice; kiln keeps the reason and reports it with the library's path, so just return it. */
  KilnExtStatus (*register_op)(KilnExtRegistrar* registrar, const KilnExtOpDef* def);
  char* error_message; /* on failure of init itself */
  size_t error_message_size;
} KilnExtInitArgs;

typedef KilnExtStatus (*KilnExtInitFn)(KilnExtInitArgs* args);

/* What a library exports (declared here so a library's definition is checked against it). */
KILN_EXT_EXPORT KilnExtStatus kiln_extension_init(KilnExtInitArgs* args);

#ifdef __cplusplus
}
#endif

#endif /* KILN_EXTENSION_H_ */
