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
 *     if (args->host_abi_major != KILN_EXT_ABI_MAJOR) return KILN_EXT_ERROR_UNSUPPORTED;
 *     KilnExtOpDef def = {.struct_size = sizeof(KilnExtOpDef), .name = "scale_add", ...};
 *     return args->register_op(args->registrar, &def);
 *   }
 *
 * Conventions (after the PJRT C API):
 * - Every struct but KilnExtDim starts with `size_t struct_size`, set by whoever fills the struct to
 *   sizeof(the struct) as that party compiled it. KILN_EXT_<STRUCT>_STRUCT_SIZE_V<major>_<minor> is a
 *   struct's size in each version (offsetof its last field in that version + that field's size).
 * - Errors are a returned status: KILN_EXT_OK, or a KilnExtErrorCode saying what kind of failure it
 *   is, plus a message the callee writes, NUL-terminated and truncated to fit, into a buffer the caller
 *   owns (error_message, error_message_size). kiln turns a failure into a C++ exception naming the
 *   library, the op and the code; the code picks the exception (see KilnExtErrorCode).
 * - Lifetimes are written on each field. In short: everything kiln passes in is valid only for the
 *   duration of the call; everything a library registers is copied by kiln during register_op,
 *   except function pointers and user_data, which must stay valid while the library is loaded.
 *   kiln never unloads a library before the process exits.
 *
 * Versioning: KILN_EXT_ABI_MAJOR.KILN_EXT_ABI_MINOR, now 1.1 (1.1 added the KILN_EXT_ERROR_* codes
 * and KilnExtOpDef::description).
 * - MAJOR bumps on any incompatible change: a field removed, reordered or retyped, a changed
 *   meaning, a changed signature. kiln refuses a library whose major differs from its own.
 * - MINOR bumps on compatible additions only: new fields at the end of a struct, new enum values.
 *   kiln loads a library of any minor of its major, older or newer than its own:
 *   - kiln reads a struct the library fills (KilnExtOpDef, KilnExtParamDef, KilnExtKernelDef) as the
 *     version the library declares, capped at kiln's own: its struct_size must be at least that
 *     version's KILN_EXT_*_STRUCT_SIZE_V1_<minor>, kiln reads only the fields of that version, and
 *     newer fields take the defaults written on them (zero, NULL). kiln never compares a
 *     struct_size with its own sizeof, so a newer library's larger structs load.
 *   - Arrays a library hands over (KilnExtOpDef::params, ::kernels) are walked by the stride the
 *     library declares: element 0's struct_size, which every element must repeat.
 *   - Arrays kiln hands over (KilnExtTypeDesc, KilnExtParamValue, KilnExtOutputDesc) and KilnExtDim
 *     never grow within a major, so a library of any minor indexes them as plain C arrays; new
 *     per-element data would come as a new array at the end of the args struct.
 *   - Structs kiln fills (the *Args) may grow: kiln sets struct_size to its own size, and a library
 *     newer than kiln checks struct_size (or host_abi_minor) before reading a field newer than 1.0.
 *   - A library may return an error code newer than kiln knows; kiln reports it as an
 *     ExtensionError with the number.
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
#define KILN_EXT_ABI_MINOR 1

/* The exported entry point's name, for dlsym. */
#define KILN_EXT_INIT_SYMBOL "kiln_extension_init"

#if defined(_WIN32)
#define KILN_EXT_EXPORT __declspec(dllexport)
#else
#define KILN_EXT_EXPORT __attribute__((visibility("default")))
#endif

/* A struct's size up to and including `last_field`: what a version of the struct must at least have. */
#define KILN_EXT_STRUCT_SIZE(type, last_field) (offsetof(type, last_field) + sizeof(((type*)0)->last_field))

/* What every function of the ABI returns: KILN_EXT_OK, or one of the codes below. int32_t rather
 * than the enum, whose size C leaves to the compiler. */
typedef int32_t KilnExtStatus;

/* The kind of a failure; kiln maps it to the exception it throws (kiln/errors.h). Init failures are
 * always ExtensionError: a library that cannot load is an extension problem, whatever the cause. */
typedef enum KilnExtErrorCode {
  KILN_EXT_OK = 0,
  KILN_EXT_ERROR = 1,                  /* unspecified: all a 1.0 library can say. ExtensionError */
  KILN_EXT_ERROR_INVALID_ARGUMENT = 2, /* 1.1: operands, parameters or values the op does not accept
                                          (a caller's mistake). ValueError */
  KILN_EXT_ERROR_UNSUPPORTED = 3,      /* 1.1: a valid request the library does not implement (a dtype,
                                          a device, a layout). ExtensionError */
  KILN_EXT_ERROR_OUT_OF_MEMORY = 4,    /* 1.1: an allocation of the library failed. ExtensionError */
  KILN_EXT_ERROR_INTERNAL = 5,         /* 1.1: a bug or broken invariant in the library. ExtensionError */
} KilnExtErrorCode;

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
#define KILN_EXT_PARAM_DEF_STRUCT_SIZE_V1_0 KILN_EXT_STRUCT_SIZE(KilnExtParamDef, required)
#define KILN_EXT_PARAM_DEF_STRUCT_SIZE KILN_EXT_PARAM_DEF_STRUCT_SIZE_V1_0

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
/* Frozen within the major (kiln passes an array of them). */
#define KILN_EXT_PARAM_VALUE_STRUCT_SIZE_V1_0 KILN_EXT_STRUCT_SIZE(KilnExtParamValue, int64_array_size)
#define KILN_EXT_PARAM_VALUE_STRUCT_SIZE KILN_EXT_PARAM_VALUE_STRUCT_SIZE_V1_0

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
/* Frozen within the major (kiln passes an array of them). */
#define KILN_EXT_TYPE_DESC_STRUCT_SIZE_V1_0 KILN_EXT_STRUCT_SIZE(KilnExtTypeDesc, is_buffer)
#define KILN_EXT_TYPE_DESC_STRUCT_SIZE KILN_EXT_TYPE_DESC_STRUCT_SIZE_V1_0

/* One result dim: a copy of an operand's dim (input >= 0, symbolic dims stay symbolic), or a static
 * size (input < 0). A fixed array of them sits inside KilnExtOutputDesc, so it has no struct_size and
 * never changes within a major. */
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
/* Frozen within the major (kiln passes an array of them), like KilnExtDim inside it. */
#define KILN_EXT_OUTPUT_DESC_STRUCT_SIZE_V1_0 KILN_EXT_STRUCT_SIZE(KilnExtOutputDesc, dims)
#define KILN_EXT_OUTPUT_DESC_STRUCT_SIZE KILN_EXT_OUTPUT_DESC_STRUCT_SIZE_V1_0

typedef struct KilnExtOutputTypesArgs {
  size_t struct_size;
  const KilnExtTypeDesc* inputs; /* num_inputs operand types */
  size_t num_inputs;
  const KilnExtParamValue* params; /* every declared parameter, in declared order */
  size_t num_params;
  KilnExtOutputDesc* outputs; /* the op's num_outputs results, struct_size preset; fill them */
  size_t num_outputs;
  void* user_data;     /* the op's KilnExtOpDef::user_data */
  char* error_message; /* on failure, say what was expected (e.g. "operand 1 must be f32") and
                          return KILN_EXT_ERROR_INVALID_ARGUMENT */
  size_t error_message_size;
} KilnExtOutputTypesArgs;
#define KILN_EXT_OUTPUT_TYPES_ARGS_STRUCT_SIZE_V1_0 \
  KILN_EXT_STRUCT_SIZE(KilnExtOutputTypesArgs, error_message_size)
#define KILN_EXT_OUTPUT_TYPES_ARGS_STRUCT_SIZE KILN_EXT_OUTPUT_TYPES_ARGS_STRUCT_SIZE_V1_0

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
  char* error_message; /* on failure, say what went wrong and return a code; kiln adds the op and node */
  size_t error_message_size;
} KilnExtKernelArgs; /* every pointer valid for the duration of the call only */
#define KILN_EXT_KERNEL_ARGS_STRUCT_SIZE_V1_0 KILN_EXT_STRUCT_SIZE(KilnExtKernelArgs, error_message_size)
#define KILN_EXT_KERNEL_ARGS_STRUCT_SIZE KILN_EXT_KERNEL_ARGS_STRUCT_SIZE_V1_0
/* DLTensor views: strides are in elements (set whenever ndim > 0); byte_offset is 0. Operands may be
 * strided (buffers are contiguous); results are contiguous. Shapes are concrete. */

typedef KilnExtStatus (*KilnExtKernelFn)(const KilnExtKernelArgs* args);

typedef struct KilnExtKernelDef {
  size_t struct_size;
  DLDeviceType device_type; /* kDLCPU, kDLCUDA */
  KilnExtKernelFn fn;       /* valid while the library is loaded */
} KilnExtKernelDef;
#define KILN_EXT_KERNEL_DEF_STRUCT_SIZE_V1_0 KILN_EXT_STRUCT_SIZE(KilnExtKernelDef, fn)
#define KILN_EXT_KERNEL_DEF_STRUCT_SIZE KILN_EXT_KERNEL_DEF_STRUCT_SIZE_V1_0

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
  /* 1.1 */
  const char* description; /* one line saying what the op computes, copied; NULL (the default): none */
} KilnExtOpDef;
#define KILN_EXT_OP_DEF_STRUCT_SIZE_V1_0 KILN_EXT_STRUCT_SIZE(KilnExtOpDef, user_data)
#define KILN_EXT_OP_DEF_STRUCT_SIZE_V1_1 KILN_EXT_STRUCT_SIZE(KilnExtOpDef, description)
#define KILN_EXT_OP_DEF_STRUCT_SIZE KILN_EXT_OP_DEF_STRUCT_SIZE_V1_1

/* ---- the entry point ---------------------------------------------------------------------------- */

typedef struct KilnExtRegistrar KilnExtRegistrar; /* opaque, owned by kiln */

typedef struct KilnExtInitArgs {
  size_t struct_size;
  uint32_t host_abi_major; /* kiln's KILN_EXT_ABI_MAJOR / MINOR */
  uint32_t host_abi_minor;
  /* out: set to the library's KILN_EXT_ABI_MAJOR / MINOR before calling register_op: kiln reads each
   * def as the version declared when it is registered (1.0 if none is declared yet). */
  uint32_t library_abi_major;
  uint32_t library_abi_minor;
  KilnExtRegistrar* registrar; /* valid during kiln_extension_init only */
  /* Registers one op (the def is copied). KILN_EXT_ERROR for a malformed def (a struct_size too small
   * for the declared version, say) or a name registered twice; kiln keeps the reason and reports it
   * with the library's path, so just return it. */
  KilnExtStatus (*register_op)(KilnExtRegistrar* registrar, const KilnExtOpDef* def);
  char* error_message; /* on failure of init itself */
  size_t error_message_size;
} KilnExtInitArgs;
#define KILN_EXT_INIT_ARGS_STRUCT_SIZE_V1_0 KILN_EXT_STRUCT_SIZE(KilnExtInitArgs, error_message_size)
#define KILN_EXT_INIT_ARGS_STRUCT_SIZE KILN_EXT_INIT_ARGS_STRUCT_SIZE_V1_0

typedef KilnExtStatus (*KilnExtInitFn)(KilnExtInitArgs* args);

/* What a library exports (declared here so a library's definition is checked against it). */
KILN_EXT_EXPORT KilnExtStatus kiln_extension_init(KilnExtInitArgs* args);

#ifdef __cplusplus
}
#endif

#endif /* KILN_EXTENSION_H_ */
