// grouped_matmul(lhs, rhs_0 .. rhs_{n-1}): n products of one activation, built by the compiler's
// group_matmuls pass from sibling matmuls (q/k/v, gate/up; docs/fusion.md). Result i has the bits
// matmul(lhs, rhs_i) (qmatmul with `encoding`) gives on its own.
//
// Decode (lhs of at most gemm::kSmallM rows, every rhs on the GEMV path), and Q8_0 weights packed
// for the VNNI GEMM at any M: one parallel job over the weight rows of all rhs (gemm::run_group,
// quantized::qmatmul_gemv_group, quantized::packed_gemm_group), so a step costs one pool
// round trip instead of n, and the small k/v products no longer ramp up their memory streams alone.
// Anything else (prefill, f64, integers, a batched lhs that does not fold into rows, bad operands):
// the matmul or qmatmul kernel once per rhs, each built with the step (so with the state it derives
// from a fixed rhs: AMX tiles, f32 panels, Q8_0 panels), and its errors prefixed with the rhs index.
#include <fmt/format.h>

#include <memory>
#include <optional>
#include <vector>

#include "kernels/cpu/gemm.h"
#include "kernels/cpu/kernels.h"
#include "kernels/cpu/matmul.h"
#include "kernels/cpu/quantized.h"

namespace kiln::kernels {
namespace {

using graph::Op;

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

class GroupedMatmulKernel final : public Kernel {
 public:
  // Each rhs gets the kernel matmul (qmatmul, with `encoding`) builds for it as a step of its own.
  explicit GroupedMatmulKernel(const KernelInit& init)
      : quantized_(init.has_attr("encoding")),
        encoding_(quantized_ ? graph::parse_encoding(init.attr<std::string>("encoding"))
                             : graph::QuantizationEncoding::q8_0) {
    for (size_t i = 1; i < init.inputs.size(); ++i) {
      const TensorView operands[2] = {init.inputs[0], init.inputs[i]};
      const bool fixed[2] = {init.is_fixed(0), init.is_fixed(i)};
      KernelInit one{quantized_ ? Op::qmatmul : Op::matmul, init.attrs, operands, fixed, init.symbols};
      // The part's operand 1 is this kernel's input i.
      if (init.copied) one.copied = [&init, i](size_t, const void* data, size_t bytes) { init.copied(i, data, bytes); };
      if (init.packed_copies) one.packed_copies = [&init, i](size_t) { return init.copies_of(i); };
      one.parallel = init.parallel;
      naming_rhs(i - 1, [&] { parts_.push_back(quantized_ ? make_qmatmul_kernel(one) : make_matmul_kernel(one)); });
    }
  }

  void run(const KernelContext& ctx, std::span<const TensorView> inputs,
           std::span<const TensorView> outputs) const override {
    if (inputs.size() < 3 || outputs.size() != inputs.size() - 1)
      throw ValueError(fmt::format("grouped_matmul: expected a lhs and n >= 2 rhs with n results, got {} operands and "
                                   "{} results",
                                   inputs.size(), outputs.size()));
    if (parts_.size() != outputs.size())
      throw ValueError(
          fmt::format("grouped_matmul: built for {} rhs, launched with {}", parts_.size(), outputs.size()));
    const bool done = quantized_ ? run_quantized_group(ctx, inputs, outputs) : run_float_group(ctx, inputs, outputs);
    if (!done) run_each(ctx, inputs, outputs);
  }

  const Kernel* part(size_t index) const { return index < parts_.size() ? parts_[index].get() : nullptr; }

 private:
  // Decode with f32 / f16 / bf16 operands: each product the GEMV problem matmul would run
  // (matmul_gemv_problem), all of them as one job. False when one does not apply (nothing computed).
  bool run_float_group(const KernelContext& ctx, std::span<const TensorView> inputs,
                       std::span<const TensorView> outputs) const {
    std::vector<gemm::Problem> problems;
    for (size_t i = 1; i < inputs.size(); ++i) {
      std::optional<gemm::Problem> problem;
      naming_rhs(i - 1, [&] { problem = matmul_gemv_problem(*parts_[i - 1], inputs[0], inputs[i], outputs[i - 1]); });
      if (!problem) return false;
      problems.push_back(*problem);
    }
    return gemm::run_group(ctx, problems);
  }

  // Quantized weights, packed Q8_0 (any M) or decode: the activations quantized once, every weight's
  // rows in one job.
  bool run_quantized_group(const KernelContext& ctx, std::span<const TensorView> inputs,
                           std::span<const TensorView> outputs) const {
    std::vector<quantized::PackedTarget> packed;
    for (size_t i = 1; i < inputs.size(); ++i) {
      std::optional<quantized::PackedTarget> target;
      naming_rhs(i - 1, [&] { target = qmatmul_packed_target(*parts_[i - 1], inputs[0], inputs[i], outputs[i - 1]); });
      if (!target) break;
      packed.push_back(*target);
    }
    if (packed.size() == parts_.size()) {
      quantized::packed_gemm_group(ctx, encoding_, inputs[0], packed);
      return true;
    }
    std::vector<quantized::QGemvTarget> targets;
    for (size_t i = 1; i < inputs.size(); ++i) {
      std::optional<quantized::QGemvTarget> target;
      naming_rhs(i - 1,
                 [&] { target = quantized::qmatmul_gemv_target(encoding_, inputs[0], inputs[i], outputs[i - 1]); });
      if (!target) return false;
      targets.push_back(*target);
    }
    quantized::qmatmul_gemv_group(ctx, encoding_, inputs[0], targets);
    return true;
  }

  // Each rhs's own kernel, one after another.
  void run_each(const KernelContext& ctx, std::span<const TensorView> inputs,
                std::span<const TensorView> outputs) const {
    for (size_t i = 1; i < inputs.size(); ++i) {
      const TensorView operands[2] = {inputs[0], inputs[i]};
      naming_rhs(i - 1, [&] { parts_[i - 1]->run(ctx, operands, outputs.subspan(i - 1, 1)); });
    }
  }

  bool quantized_;    // qmatmul products (the `encoding` attribute), else matmul
  graph::QuantizationEncoding encoding_;  // qmatmul's
  std::vector<std::unique_ptr<const Kernel>> parts_;  // by rhs
};

std::unique_ptr<const Kernel> make_grouped_matmul_kernel(const KernelInit& init) {
  return std::make_unique<GroupedMatmulKernel>(init);
}

}  // namespace

const Kernel* grouped_matmul_part(const Kernel& grouped, size_t index) {
  const auto* kernel = dynamic_cast<const GroupedMatmulKernel*>(&grouped);
  return kernel ? kernel->part(index) : nullptr;
}

void register_cpu_grouped_matmul(KernelRegistry& r) {
  // The dtypes matmul takes (qmatmul's lhs is f32); the others are rejected by type inference.
  r.add(Op::grouped_matmul, DeviceKind::CPU,
        {DType::f32, DType::f64, DType::f16, DType::bf16, DType::i8, DType::i16, DType::i32, DType::i64,
         DType::u8, DType::u16, DType::u32, DType::u64},
        make_grouped_matmul_kernel);
}

}  // namespace kiln::kernels
