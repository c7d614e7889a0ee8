#include "pipelines/derived_tensor.h"

#include <new>

#include "tensor/host_memory.h"

namespace kiln::pipelines {

DerivedTensor derived_tensor(const Tensor& from, const std::string& computation, DType dtype,
                             const std::vector<int64_t>& shape, const engine::WeightCache* cache) {
  const std::optional<std::string> source = mapped_source(from.keep_alive(), from.data(), from.nbytes());
  if (!source) return {Tensor::empty(dtype, shape), false, {}};
  const std::string derived = *source + " " + computation;
  size_t bytes = dtype_size(dtype);
  for (int64_t d : shape) bytes *= static_cast<size_t>(d);
  engine::WeightCache::Entry entry =
      cache ? cache->acquire(engine::WeightCache::key(derived, "derived"), bytes) : engine::WeightCache::Entry{};
  void* memory = entry.data ? entry.data.get() : allocate_aligned(bytes);
  if (!memory) throw std::bad_alloc();
  std::shared_ptr<void> keep_alive(memory, DerivedBytes{memory, bytes, derived, entry.data});
  return {Tensor::view(std::move(keep_alive), memory, dtype, shape), entry.filled, std::move(entry.commit)};
}

Tensor DerivedTensor::finish(const Tensor& from) {
  if (commit) commit();
  if (!filled) drop_file_pages(from.keep_alive(), from.data(), from.nbytes());
  drop_file_pages(tensor.keep_alive(), tensor.data(), tensor.nbytes());
  return tensor;
}

}  // namespace kiln::pipelines
