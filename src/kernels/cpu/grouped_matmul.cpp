// grouped_matmul(lhs, rhs_0 .. rhs_{n-1}): n products of one activation, built by the compiler's
// group_matmuls pass from sibling matmuls (q/k/v, gate/up; docs/fusion.md). Result i has the bits
// matmul(lhs, rhs_i) (qmatmul with `encoding`) gives on its own.
//
// Decode (lhs of at most gemm::kSmallM rows, every rhs on the GEMV path): one parallel job over the
// weight rows of all rhs (gemm::run_group, quantized::q8_0_gemv_group), so a step costs one pool
// round trip instead of n, and the small k/v GEMVs no longer ramp up their memory streams alone.
// Anything else (prefill, f64, integers, a batched lhs that does not fold into rows, bad operands):
// the matmul or qmatmul kernel once per rhs, each with the state its prepare function built at init
// (AMX tiles, f32 panels, Q8_0 panels), and its errors prefixed with the rhs index.
#include <fmt/format.h>

#include <optional>
#include <vector>

#include "kernels/cpu/gemm.h"
#include "kernels/cpu/kernels.h"
#include "kernels/cpu/matmul.h"
#include "kernels/cpu/quantized.h"

namespace kiln::kernels {
namespace {

using graph::Op;

// The matmul's (or qmatmul's) prepared state of each rhs, built once at init.
struct GroupPrepared final : Prepared {
  std::vector<std::shared_ptr<const Prepared>> parts;  // by rhs; nullptr where it prepared nothing
};

Op single_op(const graph::Attrs& attrs) { return attrs.count("encoding") ? Op::qmatmul : Op::matmul; }

// Runs fn(), naming rhs `index` in the error it throws (keeping the error's kind).
template <class Fn> void naming_rhs(size_t index, Fn&& fn) {
  const auto message = [&](const std::exception& e) { return fmt::format("grouped_matmul: rhs {}: {}", index, e.what()); };
  try {
    fn();
  } catch (const ShapeError& e) {
    throw ShapeError(message(e));
  } catch (const DTypeError& e) {
    throw DTypeError(message(e));
  } catch (const ValueError& e) {
    throw ValueError(message(e));
  }
}

// Decode with f32 / f16 / bf16 operands: each product the GEMV problem matmul would run
// (matmul_gemv_problem), all of them as one job. False when one does not apply (nothing computed).
bool run_float_group(const KernelContext& ctx, const graph::Attrs& attrs, std::span<const TensorView> inputs,
                     std::span<const TensorView> outputs) {
  std::vector<gemm::Problem> problems;
  for (size_t i = 1; i < inputs.size(); ++i) {
    std::optional<gemm::Problem> problem;
    naming_rhs(i - 1, [&] { problem = matmul_gemv_problem(attrs, inputs[0], inputs[i], outputs[i - 1]); });
    if (!problem) return false;
    problems.push_back(*problem);
  }
  return gemm::run_group(ctx, problems);
}

// Decode with Q8_0 weights: the activations quantized once, every weight's rows in one job.
bool run_quantized_group(const KernelContext& ctx, const graph::Attrs& attrs, std::span<const TensorView> inputs,
                         std::span<const TensorView> outputs) {
  std::vector<quantized::Q8_0GemvTarget> targets;
  for (size_t i = 1; i < inputs.size(); ++i) {
    std::optional<quantized::Q8_0GemvTarget> target;
    naming_rhs(i - 1, [&] { target = quantized::qmatmul_gemv_target(attrs, inputs[0], inputs[i], outputs[i - 1]); });
    if (!target) return false;
    targets.push_back(*target);
  }
  quantized::q8_0_gemv_group(ctx, inputs[0], targets);
  return true;
}

// The matmul (qmatmul) kernel once per rhs, each with its own prepared state.
void run_each(const KernelContext& ctx, const graph::Attrs& attrs, std::span<const TensorView> inputs,
              std::span<const TensorView> outputs) {
  const Op op = single_op(attrs);
  const KernelFn fn = cpu_kernels().find(op, DeviceKind::CPU, inputs[0].dtype);
  if (!fn)
    throw DTypeError(fmt::format("grouped_matmul: no CPU {} kernel for lhs {}", graph::op_name(op), describe(inputs[0])));
  const auto* prepared = dynamic_cast<const GroupPrepared*>(ctx.prepared);
  for (size_t i = 1; i < inputs.size(); ++i) {
    KernelContext one = ctx;
    one.prepared = prepared && i - 1 < prepared->parts.size() ? prepared->parts[i - 1].get() : nullptr;
    const TensorView operands[2] = {inputs[0], inputs[i]};
    naming_rhs(i - 1, [&] { fn(one, attrs, std::span<const TensorView>(operands), outputs.subspan(i - 1, 1)); });
  }
}

void grouped_matmul_kernel(const KernelContext& ctx, const graph::Attrs& attrs, std::span<const TensorView> inputs,
                           std::span<const TensorView> outputs) {
  if (inputs.size() < 3 || outputs.size() != inputs.size() - 1)
    throw ValueError(fmt::format("grouped_matmul: expected a lhs and n >= 2 rhs with n results, got {} operands and "
                                 "{} results",
                                 inputs.size(), outputs.size()));
  const bool done = single_op(attrs) == Op::qmatmul ? run_quantized_group(ctx, attrs, inputs, outputs)
                                                    : run_float_group(ctx, attrs, inputs, outputs);
  if (!done) run_each(ctx, attrs, inputs, outputs);
}

// Each rhs prepared by matmul's (qmatmul's) own prepare function, as if it were its own step.
std::shared_ptr<const Prepared> prepare_grouped_matmul(const graph::Attrs& attrs, std::span<const TensorView> inputs,
                                                       std::span<const bool> fixed) {
  if (inputs.size() < 3) return nullptr;  // the launch reports it
  const PrepareFn prepare = cpu_kernels().find_prepare(single_op(attrs), DeviceKind::CPU, inputs[0].dtype);
  if (!prepare) return nullptr;
  auto group = std::make_shared<GroupPrepared>();
  bool any = false;
  for (size_t i = 1; i < inputs.size(); ++i) {
    const TensorView operands[2] = {inputs[0], inputs[i]};
    const bool operands_fixed[2] = {fixed[0], fixed[i]};
    std::shared_ptr<const Prepared> part;
    naming_rhs(i - 1, [&] { part = prepare(attrs, std::span<const TensorView>(operands), std::span<const bool>(operands_fixed)); });
    any = any || part != nullptr;
    group->parts.push_back(std::move(part));
  }
  if (!any) return nullptr;
  return group;
}

}  // namespace

void register_cpu_grouped_matmul(KernelRegistry& r) {
  // The dtypes matmul takes (qmatmul's lhs is f32); the others are rejected by type inference.
  r.add(Op::grouped_matmul, DeviceKind::CPU,
        {DType::f32, DType::f64, DType::f16, DType::bf16, DType::i8, DType::i16, DType::i32, DType::i64,
         DType::u8, DType::u16, DType::u32, DType::u64},
        grouped_matmul_kernel);
  r.add_prepare(Op::grouped_matmul, DeviceKind::CPU, {DType::f32, DType::bf16}, prepare_grouped_matmul);
}

}  // namespace kiln::kernels
