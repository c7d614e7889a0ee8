// CPU kernel of fused_elementwise: interprets the node's ElementwiseProgram over blocks of kBlock
// output elements. Each instruction runs as one tight loop over a block (vectorisable, no dispatch per
// element), and blocks are shared out between threads. exp, sigmoid and silu run vector_math.h's
// SIMD loops where the elementwise kernels do. Registers hold f32 (bool as 0 / 1); an
// instruction whose result is f16 or bf16 rounds its block to that dtype, so the result equals the
// unfused ops' bit for bit (the same functors, elementwise_functors.h, in f32).
#include <cmath>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "kernels/cpu/elementwise_functors.h"
#include "kernels/cpu/kernels.h"
#include "kernels/cpu/strided.h"
#include "kernels/cpu/vector_math.h"
#include "kiln/graph/elementwise_program.h"

namespace kiln::kernels {
namespace {

using graph::ElementwiseInstruction;
using graph::ElementwiseProgram;
using graph::Op;

// Output elements per block: a block of every register stays in L1 for programs of a few dozen
// registers.
constexpr int64_t kBlock = 256;

bool is_register_dtype(DType d) {
  return d == DType::f32 || d == DType::f16 || d == DType::bf16 || d == DType::boolean;
}

// The node's program, parsed and checked once when the kernel is built.
struct FusedParams {
  ElementwiseProgram program;

  explicit FusedParams(const KernelInit& init)
      : program(ElementwiseProgram::parse(init.attr<std::string>("program"),
                                          static_cast<int32_t>(init.inputs.size()))) {
    for (const ElementwiseInstruction& in : program.instructions)
      if (!is_register_dtype(in.dtype))
        throw DTypeError(fmt::format("fused_elementwise: the CPU kernel has no {} registers (program \"{}\")",
                                     dtype_name(in.dtype), program.to_string()));
  }
};

// ---- one instruction over n elements ------------------------------------------------------------

// Booleans live in registers as 0 / 1 (the functors' bool results convert to that, and a register
// passed to a bool operand is true when nonzero).
template <class F> void unary_loop(const float* a, float* o, int64_t n, F f) {
  for (int64_t i = 0; i < n; ++i) o[i] = static_cast<float>(f(a[i]));
}
template <class F> void binary_loop(const float* a, const float* b, float* o, int64_t n, F f) {
  for (int64_t i = 0; i < n; ++i) o[i] = static_cast<float>(f(a[i], b[i]));
}

float bool_value(bool b) { return b ? 1.0f : 0.0f; }

void run_instruction(const ElementwiseInstruction& in, const float* const* regs, float* o, int64_t n) {
  using namespace elementwise;
  const float* a = regs[in.operands[0]];
  const float* b = in.operands.size() > 1 ? regs[in.operands[1]] : nullptr;
  switch (in.op) {
    case Op::neg: return unary_loop(a, o, n, Neg{});
    case Op::abs: return unary_loop(a, o, n, Abs{});
    case Op::exp:
      if (vmath::available()) return vmath::apply(vmath::Fn::exp, a, o, n);
      return unary_loop(a, o, n, Exp{});
    case Op::log: return unary_loop(a, o, n, Log{});
    case Op::sqrt: return unary_loop(a, o, n, Sqrt{});
    case Op::rsqrt: return unary_loop(a, o, n, Rsqrt{});
    case Op::sin: return unary_loop(a, o, n, Sin{});
    case Op::cos: return unary_loop(a, o, n, Cos{});
    case Op::tanh: return unary_loop(a, o, n, Tanh{});
    case Op::sigmoid:
      if (vmath::available()) return vmath::apply(vmath::Fn::sigmoid, a, o, n);
      return unary_loop(a, o, n, Sigmoid{});
    case Op::silu:
      if (vmath::available()) return vmath::apply(vmath::Fn::silu, a, o, n);
      return unary_loop(a, o, n, Silu{});
    case Op::gelu:
      if (in.gelu_tanh) return unary_loop(a, o, n, GeluTanh{});
      return unary_loop(a, o, n, GeluErf{});
    case Op::relu: return unary_loop(a, o, n, Relu{});
    case Op::erf: return unary_loop(a, o, n, Erf{});
    case Op::floor: return unary_loop(a, o, n, Floor{});
    case Op::ceil: return unary_loop(a, o, n, Ceil{});
    case Op::round: return unary_loop(a, o, n, RoundHalfEven{});
    case Op::reciprocal: return unary_loop(a, o, n, Reciprocal{});
    case Op::square: return unary_loop(a, o, n, Square{});
    case Op::logical_not: return unary_loop(a, o, n, LogicalNot{});
    case Op::is_nan: return unary_loop(a, o, n, IsNan{});

    case Op::add: return binary_loop(a, b, o, n, Add{});
    case Op::sub: return binary_loop(a, b, o, n, Sub{});
    case Op::mul: return binary_loop(a, b, o, n, Mul{});
    case Op::div: return binary_loop(a, b, o, n, Div{});
    case Op::mod: return binary_loop(a, b, o, n, Mod{});
    case Op::pow: return binary_loop(a, b, o, n, Pow{});
    case Op::maximum: return binary_loop(a, b, o, n, Maximum{});
    case Op::minimum: return binary_loop(a, b, o, n, Minimum{});
    case Op::equal: return binary_loop(a, b, o, n, Equal{});
    case Op::not_equal: return binary_loop(a, b, o, n, NotEqual{});
    case Op::greater: return binary_loop(a, b, o, n, Greater{});
    case Op::greater_equal: return binary_loop(a, b, o, n, GreaterEqual{});
    case Op::less: return binary_loop(a, b, o, n, Less{});
    case Op::less_equal: return binary_loop(a, b, o, n, LessEqual{});
    case Op::logical_and: return binary_loop(a, b, o, n, LogicalAnd{});
    case Op::logical_or: return binary_loop(a, b, o, n, LogicalOr{});
    case Op::logical_xor: return binary_loop(a, b, o, n, LogicalXor{});

    case Op::where: {
      const float* c = a;
      const float* x = b;
      const float* y = regs[in.operands[2]];
      for (int64_t i = 0; i < n; ++i) o[i] = c[i] != 0.0f ? x[i] : y[i];
      return;
    }
    case Op::cast:
      // Registers are f32 already; rounding to a 16-bit target happens after every instruction.
      if (in.dtype == DType::boolean)
        return unary_loop(a, o, n, [](float x) { return bool_value(x != 0.0f); });
      return unary_loop(a, o, n, [](float x) { return x; });
    default: break;
  }
  throw ValueError(fmt::format("fused_elementwise: '{}' is not an elementwise op", graph::op_name(in.op)));
}

// Rounds a block to the precision of a 16-bit float result.
void round_to(DType dtype, float* o, int64_t n) {
  if (dtype == DType::f16)
    for (int64_t i = 0; i < n; ++i) o[i] = static_cast<float>(f16_t(o[i]));
  else if (dtype == DType::bf16)
    for (int64_t i = 0; i < n; ++i) o[i] = static_cast<float>(bf16_t(o[i]));
}

// ---- reading operands, writing the result -------------------------------------------------------

template <class T> float to_register(T v) {
  if constexpr (std::is_same_v<T, bool>)
    return bool_value(v);
  else
    return static_cast<float>(v);
}

// Calls f.template operator()<T>() with T the element type of a register dtype.
template <class F> void visit_register_dtype(DType dtype, F&& f) {
  switch (dtype) {
    case DType::f32: return f.template operator()<float>();
    case DType::f16: return f.template operator()<f16_t>();
    case DType::bf16: return f.template operator()<bf16_t>();
    case DType::boolean: return f.template operator()<bool>();
    default: break;
  }
  throw DTypeError(fmt::format("fused_elementwise: the CPU kernel has no {} registers", dtype_name(dtype)));
}

// How one operand is read for the elements [begin, begin + count) of the result.
struct Operand {
  const TensorView* view = nullptr;
  std::vector<int64_t> strides;  // broadcast to the result's shape
  bool flat = false;             // the result's shape, contiguous: block i is elements [begin, end)
  bool scalar = false;           // one element, the same for every block

  // Points `reg` at the operand's values: into the tensor itself for flat f32, else through `scratch`.
  const float* load(std::span<const int64_t> out_shape, int64_t begin, int64_t count, float* scratch) const {
    const TensorView& v = *view;
    if (flat && v.dtype == DType::f32) return v.as<float>() + begin;
    visit_register_dtype(v.dtype, [&]<class T>() {
      const T* data = v.as<T>();
      if (flat) {
        for (int64_t i = 0; i < count; ++i) scratch[i] = to_register(data[begin + i]);
        return;
      }
      const int64_t step = strides.empty() ? 0 : strides.back();
      for_each_run<1>(out_shape, {strides.data()}, begin, begin + count,
                      [&](int64_t first, const std::array<int64_t, 1>& off, int64_t n) {
                        float* dst = scratch + (first - begin);
                        const T* src = data + off[0];
                        for (int64_t j = 0; j < n; ++j) dst[j] = to_register(src[j * step]);
                      });
    });
    return scratch;
  }
};

void fused_elementwise_kernel(const KernelContext& ctx, const FusedParams& params,
                              std::span<const TensorView> inputs, std::span<const TensorView> outputs) {
  const ElementwiseProgram& program = params.program;
  if (outputs.size() != 1)
    throw ValueError(fmt::format("fused_elementwise: expected 1 result, got {}", outputs.size()));
  // The program was parsed for the operands the kernel was built with; its registers index them.
  if (static_cast<int32_t>(inputs.size()) != program.num_inputs)
    throw ValueError(fmt::format("fused_elementwise: built for {} operands, launched with {}",
                                 program.num_inputs, inputs.size()));
  const TensorView& out = outputs[0];
  const auto num_registers = static_cast<size_t>(program.num_registers());

  std::vector<Operand> operands(inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i) {
    const TensorView& v = inputs[i];
    if (!is_register_dtype(v.dtype))
      throw DTypeError(fmt::format("fused_elementwise: operand %{} is {}; the CPU kernel reads f32, f16, bf16 "
                                   "and bool",
                                   i, describe(v)));
    bool fits = v.shape.size() <= out.shape.size();
    for (size_t d = 0; fits && d < v.shape.size(); ++d) {
      const int64_t dim = v.shape[v.shape.size() - 1 - d];
      fits = dim == 1 || dim == out.shape[out.shape.size() - 1 - d];
    }
    if (!fits)
      throw ShapeError(fmt::format("fused_elementwise: operand %{} {} does not broadcast to the result {}", i,
                                   describe(v), describe(out)));
    operands[i] = Operand{&v, broadcast_strides(v, out.shape), v.shape == out.shape && v.is_contiguous(),
                          v.numel() == 1};
  }
  const DType result_dtype = program.instructions.back().dtype;
  if (out.dtype != result_dtype || !out.is_contiguous())
    throw DTypeError(fmt::format("fused_elementwise: the result {} must be a contiguous {} (the program's "
                                 "last dtype)",
                                 describe(out), dtype_name(result_dtype)));

  const int64_t n = out.numel();
  const int64_t num_blocks = (n + kBlock - 1) / kBlock;
  const int64_t grain = std::max<int64_t>(1, kElementwiseGrain / kBlock);
  parallel_for(ctx, num_blocks, grain, [&](int64_t first_block, int64_t end_block) {
    // [register][kBlock]; scalars are read once, into their register, for the whole chunk. Kept per
    // thread: a decode step runs a dozen small programs, each would otherwise allocate.
    thread_local std::vector<float> scratch;
    thread_local std::vector<const float*> regs;
    if (scratch.size() < num_registers * kBlock) scratch.resize(num_registers * kBlock);
    if (regs.size() < num_registers) regs.resize(num_registers);
    auto scratch_of = [&](size_t r) { return scratch.data() + r * kBlock; };
    for (size_t i = 0; i < operands.size(); ++i)
      if (operands[i].scalar) {
        const float value = operands[i].load(out.shape, 0, 1, scratch_of(i))[0];
        std::fill(scratch_of(i), scratch_of(i) + kBlock, value);
        regs[i] = scratch_of(i);
      }
    for (int64_t block = first_block; block < end_block; ++block) {
      const int64_t begin = block * kBlock;
      const int64_t count = std::min(kBlock, n - begin);
      for (size_t i = 0; i < operands.size(); ++i)
        if (!operands[i].scalar) regs[i] = operands[i].load(out.shape, begin, count, scratch_of(i));
      for (size_t k = 0; k < program.instructions.size(); ++k) {
        const ElementwiseInstruction& in = program.instructions[k];
        const size_t r = operands.size() + k;
        // The last instruction of an f32 program writes straight into the result.
        float* dst = (k + 1 == program.instructions.size() && out.dtype == DType::f32)
                         ? out.as<float>() + begin
                         : scratch_of(r);
        run_instruction(in, regs.data(), dst, count);
        round_to(in.dtype, dst, count);
        regs[r] = dst;
      }
      const float* result = regs[num_registers - 1];
      visit_register_dtype(out.dtype, [&]<class T>() {
        T* o = out.as<T>() + begin;
        if constexpr (std::is_same_v<T, bool>) {
          for (int64_t i = 0; i < count; ++i) o[i] = result[i] != 0.0f;
        } else if constexpr (!std::is_same_v<T, float>) {  // f32 results are written in place
          for (int64_t i = 0; i < count; ++i) o[i] = T(result[i]);
        }
      });
    }
  });
}

}  // namespace

void register_cpu_fused(KernelRegistry& r) {
  // Registered under the first operand's dtype (graph::kernel_key); the kernel checks the others.
  r.add(Op::fused_elementwise, DeviceKind::CPU, {DType::f32, DType::f16, DType::bf16, DType::boolean},
        &with_params<FusedParams, fused_elementwise_kernel>);
}

}  // namespace kiln::kernels
