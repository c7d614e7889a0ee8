// The CPU backend: kernels/cpu/, host memory, the thread pool and the device team.
#include <cstring>

#include "engine/backend.h"
#include "engine/cpu/device_team.h"
#include "engine/cpu/thread_pool.h"
#include "kernels/cpu/kernels.h"
#include "kernels/cpu/strided.h"

namespace kiln::engine {

namespace {

class CpuBackend final : public Backend {
 public:
  explicit CpuBackend(int num_threads) : pool_(num_threads) {}

  DeviceKind kind() const override { return DeviceKind::CPU; }
  std::string name() const override { return "cpu"; }
  const kernels::KernelRegistry& kernels() const override { return kernels::cpu_kernels(); }
  bool host_memory() const override { return true; }
  Tensor allocate(DType dtype, const std::vector<int64_t>& shape, DeviceRef device) const override {
    return Tensor::empty(dtype, shape, device);
  }
  void copy(const Tensor& dst, const Tensor& src) const override {
    if (src.is_contiguous()) {
      std::memcpy(const_cast<void*>(dst.data()), src.data(), src.nbytes());
      return;
    }
    kernels::SerialParallel serial;
    kernels::KernelContext ctx;
    ctx.parallel = &serial;
    kernels::copy_strided(ctx, src.dtype(), src.shape(), src.data(), src.strides(), const_cast<void*>(dst.data()));
  }
  kernels::Parallel* parallel() const override { return &pool_; }
  kernels::DeviceTeam* team() const override { return &team_; }

 private:
  mutable ThreadPool pool_;       // shared by every model of the session
  mutable DeviceThreadTeam team_;  // collectives over several devices: one thread per extra device
};

}  // namespace

std::shared_ptr<Backend> make_cpu_backend(int num_threads) { return std::make_shared<CpuBackend>(num_threads); }

void add_cpu_backend_unless_given(std::vector<std::shared_ptr<Backend>>& backends, int num_threads) {
  for (const auto& b : backends)
    if (b && b->kind() == DeviceKind::CPU) return;
  backends.push_back(make_cpu_backend(num_threads));
}

}  // namespace kiln::engine
