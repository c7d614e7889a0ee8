// The MPI test program: every rank runs every test, and the collectives in them pair up across ranks
// (so every rank must reach the same collectives in the same order). Run under mpirun with 2 or more
// ranks; ctest's `mpi_2_ranks` does (CMakeLists.txt). Rank 0 prints the usual report, the other
// ranks only their failures, prefixed with their rank; mpirun fails if any rank fails.
#include <cstdio>

#include <gtest/gtest.h>

#include "kiln/engine/distributed.h"

namespace {

class RankFailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit RankFailurePrinter(int rank) : rank_(rank) {}
  void OnTestPartResult(const ::testing::TestPartResult& result) override {
    if (result.failed())
      std::fprintf(stderr, "[rank %d] %s:%d: failure\n%s\n", rank_, result.file_name() ? result.file_name() : "?",
                   result.line_number(), result.summary());
  }

 private:
  int rank_;
};

}  // namespace

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  auto world = kiln::engine::mpi_world();  // initialises MPI on the main thread, before any test
  if (world->size() < 2) {
    std::fprintf(stderr, "test_mpi: run me as 2 or more ranks, e.g. mpirun -np 2 %s\n", argv[0]);
    return 1;
  }
  if (world->rank() != 0) {
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new RankFailurePrinter(world->rank()));
  }
  return RUN_ALL_TESTS();
}
