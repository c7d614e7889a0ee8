// The MPI process group (kiln/engine/distributed.h). Compiled in every build; without MPI
// (KILN_HAVE_MPI unset) mpi_world() says how to get it.
#include "kiln/engine/distributed.h"

#include "kiln/errors.h"

#if KILN_HAVE_MPI
// The C API only: kiln links MPI::MPI_C, not the deprecated C++ bindings mpi.h would otherwise pull in.
#define OMPI_SKIP_MPICXX 1
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <type_traits>
#include <vector>

#include <fmt/format.h>

#if defined(__SANITIZE_ADDRESS__)
#define KILN_LEAK_CHECKED 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define KILN_LEAK_CHECKED 1
#endif
#endif
#if KILN_LEAK_CHECKED
#include <sanitizer/lsan_interface.h>
#endif
#endif

namespace kiln::engine {

#if KILN_HAVE_MPI

bool mpi_available() { return true; }

namespace {

// Each MPI call moves at most this many bytes of the caller's buffer: it keeps every count and
// displacement within MPI's int, and bounds the scratch memory a collective needs.
constexpr int64_t kSliceBytes = int64_t{16} << 20;

// Open MPI keeps memory from MPI_Init to exit that LeakSanitizer reports as leaked, allocated from
// components it has unloaded by then (so no suppression can name them). Allocations made inside
// MPI_Init_thread and MPI_Finalize are therefore not leak-checked; kiln's own still are.
struct MpiInternalAllocations {
#if KILN_LEAK_CHECKED
  MpiInternalAllocations() { __lsan_disable(); }
  ~MpiInternalAllocations() { __lsan_enable(); }
#endif
};

void check(int code, const char* call) {
  if (code == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  MPI_Error_string(code, text, &length);
  throw Error(fmt::format("{} failed: {}", call, std::string(text, static_cast<size_t>(length))));
}

// The elements of an n-element slice that `rank` sums: the slice split in `size` near-equal parts,
// the first n % size one element longer.
struct Share {
  int64_t begin;
  int64_t count;
};
Share share_of(int64_t n, int size, int rank) {
  const int64_t base = n / size, extra = n % size;
  return {rank * base + std::min<int64_t>(rank, extra), base + (rank < extra ? 1 : 0)};
}

// out[i] = rows[0][i] + rows[1][i] + ... in row (rank) order. 16-bit floats accumulate in float and
// round once; integers wrap (unsigned arithmetic, as signed overflow is undefined).
template <class T> struct Accumulator { using type = T; };
template <> struct Accumulator<f16_t> { using type = float; };
template <> struct Accumulator<bf16_t> { using type = float; };
template <class T> requires std::is_integral_v<T> struct Accumulator<T> { using type = std::make_unsigned_t<T>; };

template <class T>
void sum_rows_in_order(const void* rows_bytes, int num_rows, int64_t n, void* out_bytes) {
  using Acc = typename Accumulator<T>::type;
  const T* rows = static_cast<const T*>(rows_bytes);  // [num_rows, n]
  T* out = static_cast<T*>(out_bytes);                 // [n]
  std::vector<Acc> acc(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) acc[i] = static_cast<Acc>(rows[i]);
  for (int r = 1; r < num_rows; ++r) {
    const T* row = rows + r * n;
    for (int64_t i = 0; i < n; ++i) acc[i] += static_cast<Acc>(row[i]);
  }
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<T>(acc[i]);
}

class MpiProcessGroup final : public ProcessGroup {
 public:
  explicit MpiProcessGroup(MPI_Comm comm) : comm_(comm) {
    check(MPI_Comm_rank(comm_, &rank_), "MPI_Comm_rank");
    check(MPI_Comm_size(comm_, &size_), "MPI_Comm_size");
  }

  // Frees the communicator as MPI finalises; later calls are an Error rather than undefined.
  void release() {
    std::lock_guard lock(mutex_);
    if (comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
    comm_ = MPI_COMM_NULL;
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }

  // A reduce-scatter then an allgather: rank j sums part j of the buffer over all ranks in rank
  // order, then every rank receives every part. Each element is summed once, by one rank, so all
  // ranks get the same bits (MPI_Allreduce promises neither the order nor equal results), and each
  // rank sends and receives about 2 * count elements whatever the number of ranks.
  void allreduce_sum(void* data, int64_t count, DType dtype) override {
    if (count < 0) throw ValueError(fmt::format("ProcessGroup::allreduce_sum: count must be >= 0, got {}", count));
    if (dtype == DType::boolean)
      throw DTypeError("ProcessGroup::allreduce_sum: bool cannot be summed (expected a number dtype)");
    if (count > 0 && data == nullptr) throw ValueError("ProcessGroup::allreduce_sum: data is null");
    std::lock_guard lock(mutex_);
    check_open("allreduce_sum");
    const int64_t element = static_cast<int64_t>(dtype_size(dtype));
    const int64_t slice_elements = std::max<int64_t>(1, kSliceBytes / element);
    std::vector<int> send_counts(size_), send_offsets(size_), recv_counts(size_), recv_offsets(size_);
    for (int64_t start = 0; start < count; start += slice_elements) {
      const int64_t n = std::min(slice_elements, count - start);
      uint8_t* slice = static_cast<uint8_t*>(data) + start * element;
      const Share mine = share_of(n, size_, rank_);
      for (int r = 0; r < size_; ++r) {
        const Share theirs = share_of(n, size_, r);
        send_counts[r] = static_cast<int>(theirs.count * element);   // my values of r's part
        send_offsets[r] = static_cast<int>(theirs.begin * element);
        recv_counts[r] = static_cast<int>(mine.count * element);     // r's values of my part
        recv_offsets[r] = static_cast<int>(r * mine.count * element);
      }
      scratch_.resize(static_cast<size_t>(size_ * mine.count * element));  // [size, mine.count]
      check(MPI_Alltoallv(slice, send_counts.data(), send_offsets.data(), MPI_BYTE, scratch_.data(),
                          recv_counts.data(), recv_offsets.data(), MPI_BYTE, comm_),
            "MPI_Alltoallv (allreduce_sum)");
      visit_dtype(dtype, [&]<class T>() {
        if constexpr (!std::is_same_v<T, bool>)
          sum_rows_in_order<T>(scratch_.data(), size_, mine.count, slice + mine.begin * element);
      });
      // Every rank's part, summed, back into every rank's slice: counts are now the parts' sizes.
      for (int r = 0; r < size_; ++r) {
        recv_counts[r] = send_counts[r];
        recv_offsets[r] = send_offsets[r];
      }
      check(MPI_Allgatherv(MPI_IN_PLACE, 0, MPI_BYTE, slice, recv_counts.data(), recv_offsets.data(),
                           MPI_BYTE, comm_),
            "MPI_Allgatherv (allreduce_sum)");
    }
  }

  void allgather(const void* send, void* recv, int64_t bytes) override {
    if (bytes < 0) throw ValueError(fmt::format("ProcessGroup::allgather: bytes must be >= 0, got {}", bytes));
    if (bytes > 0 && (send == nullptr || recv == nullptr))
      throw ValueError("ProcessGroup::allgather: send or recv is null");
    std::lock_guard lock(mutex_);
    check_open("allgather");
    if (bytes <= kSliceBytes) {
      check(MPI_Allgather(send, static_cast<int>(bytes), MPI_BYTE, recv, static_cast<int>(bytes), MPI_BYTE,
                          comm_),
            "MPI_Allgather");
      return;
    }
    // Larger: slice by slice through scratch, each rank's piece copied to its place in recv.
    const auto* in = static_cast<const uint8_t*>(send);
    auto* out = static_cast<uint8_t*>(recv);  // [size, bytes]
    scratch_.resize(static_cast<size_t>(size_ * kSliceBytes));
    for (int64_t start = 0; start < bytes; start += kSliceBytes) {
      const int64_t n = std::min(kSliceBytes, bytes - start);
      check(MPI_Allgather(in + start, static_cast<int>(n), MPI_BYTE, scratch_.data(), static_cast<int>(n),
                          MPI_BYTE, comm_),
            "MPI_Allgather");
      for (int r = 0; r < size_; ++r) std::memcpy(out + r * bytes + start, scratch_.data() + r * n, n);
    }
  }

  void barrier() override {
    std::lock_guard lock(mutex_);
    check_open("barrier");
    check(MPI_Barrier(comm_), "MPI_Barrier");
  }

 private:
  void check_open(const char* call) const {
    if (comm_ == MPI_COMM_NULL) throw Error(fmt::format("ProcessGroup::{}: MPI was already finalised", call));
  }

  MPI_Comm comm_;  // MPI_COMM_NULL once MPI is finalised
  int rank_ = 0;
  int size_ = 1;
  std::mutex mutex_;
  std::vector<uint8_t> scratch_;
};

// MPI_Finalize deletes MPI_COMM_SELF's attributes before anything else (the MPI standard's hook for
// "user functions at process termination"), so this frees kiln's communicator whoever finalises MPI,
// and whenever. The attribute holds a reference, so the group outlives that moment.
int release_at_finalize(MPI_Comm, int, void* attribute, void*) {
  auto* group = static_cast<std::shared_ptr<MpiProcessGroup>*>(attribute);
  (*group)->release();
  delete group;
  return MPI_SUCCESS;
}

void finalize_at_exit() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized) return;
  [[maybe_unused]] MpiInternalAllocations not_leak_checked;
  MPI_Finalize();
}

const char* thread_level_name(int level) {
  switch (level) {
    case MPI_THREAD_SINGLE: return "MPI_THREAD_SINGLE";
    case MPI_THREAD_FUNNELED: return "MPI_THREAD_FUNNELED";
    case MPI_THREAD_SERIALIZED: return "MPI_THREAD_SERIALIZED";
    default: return "MPI_THREAD_MULTIPLE";
  }
}

}  // namespace

std::shared_ptr<ProcessGroup> mpi_world() {
  static std::mutex mutex;
  static std::shared_ptr<ProcessGroup> world;
  std::lock_guard lock(mutex);
  int initialized = 0, finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized) throw Error("mpi_world: MPI was already finalised; call mpi_world() before MPI_Finalize");
  if (world) return world;

  MPI_Initialized(&initialized);
  int provided = MPI_THREAD_SINGLE;
  if (initialized) {
    MPI_Query_thread(&provided);
  } else {
    // kiln's collective kernels run on its device threads, not the main one, and the group's lock
    // serialises them: MPI_THREAD_SERIALIZED is the least that works.
    {
      [[maybe_unused]] MpiInternalAllocations not_leak_checked;
      check(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided), "MPI_Init_thread");
    }
    std::atexit(finalize_at_exit);
  }
  if (provided < MPI_THREAD_SERIALIZED)
    throw Error(fmt::format("mpi_world: MPI provides {}, but kiln calls MPI from its device threads and "
                            "needs MPI_THREAD_SERIALIZED or MPI_THREAD_MULTIPLE (initialise MPI with "
                            "MPI_Init_thread, or let kiln do it)",
                            thread_level_name(provided)));
  MPI_Comm comm;
  check(MPI_Comm_dup(MPI_COMM_WORLD, &comm), "MPI_Comm_dup");
  // Failures come back as codes that become kiln::Error, instead of aborting the job.
  check(MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
  auto group = std::make_shared<MpiProcessGroup>(comm);
  int keyval = MPI_KEYVAL_INVALID;
  check(MPI_Comm_create_keyval(MPI_COMM_NULL_COPY_FN, release_at_finalize, &keyval, nullptr),
        "MPI_Comm_create_keyval");
  check(MPI_Comm_set_attr(MPI_COMM_SELF, keyval, new std::shared_ptr<MpiProcessGroup>(group)), "MPI_Comm_set_attr");
  MPI_Comm_free_keyval(&keyval);  // the attribute keeps it until it is deleted
  world = std::move(group);
  return world;
}

#else  // !KILN_HAVE_MPI

bool mpi_available() { return false; }

std::shared_ptr<ProcessGroup> mpi_world() {
  throw Error("kiln was built without MPI (install libopenmpi-dev and reconfigure)");
}

#endif

}  // namespace kiln::engine
