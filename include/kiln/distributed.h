// A group of processes that run the same graphs and carry collectives between them (one rank per
// process). kiln's collective kernels reduce over a process's own devices through signal buffers,
// then across processes through this interface. engine/distributed.h makes an Open MPI one.
#pragma once

#include <cstdint>

#include "kiln/graph/dtype.h"

namespace kiln {

class ProcessGroup {
 public:
  virtual ~ProcessGroup() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // In place: data (count elements of dtype) becomes the elementwise sum over all ranks, summed in
  // rank order, so every rank gets bit-identical results.
  virtual void allreduce_sum(void* data, int64_t count, DType dtype) = 0;
  // recv (size() * bytes) becomes every rank's send (bytes), in rank order.
  virtual void allgather(const void* send, void* recv, int64_t bytes) = 0;
  virtual void barrier() = 0;
};

}  // namespace kiln
