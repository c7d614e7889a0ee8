// engine/distributed.h in a single process (tests/mpi runs it across ranks under mpirun).
#include "kiln/engine/distributed.h"

#include <gtest/gtest.h>

#include <atomic>

#include "kiln/errors.h"
#include "test_util.h"

namespace {
// Whether this process started Open MPI's runtime (ctest runs each test in a process of its own).
std::atomic<bool> mpi_started{false};
}  // namespace

// LeakSanitizer's check at exit stops every thread with ptrace to scan its stack and TLS; in a
// process that ran Open MPI's singleton runtime (its thread, components it unloads at finalize) the
// check's tracer intermittently crashes ("Tracer caught signal 11", a known sanitizer failure),
// failing a test that passed: it did in CI. So such a process skips the check (LeakSanitizer's
// hook; unused in builds without it). tests/mpi keeps its check, with suppressions, under mpirun.
extern "C" int __lsan_is_turned_off() { return mpi_started.load() ? 1 : 0; }

namespace kiln::engine {
namespace {

TEST(Distributed, MpiAvailableMatchesTheBuild) {
  // KILN_TEST_BUILT_WITH_MPI comes from CMake (whether it found MPI), not from kiln's own macro.
  EXPECT_EQ(mpi_available(), bool(KILN_TEST_BUILT_WITH_MPI));
}

#if KILN_TEST_BUILT_WITH_MPI
TEST(Distributed, MpiWorldOutsideMpirunIsAGroupOfOne) {
  mpi_started = true;
  auto world = mpi_world();
  ASSERT_NE(world, nullptr);
  EXPECT_EQ(world.get(), mpi_world().get());  // one group per process
  EXPECT_EQ(world->rank(), 0);
  EXPECT_EQ(world->size(), 1);
  float data[3] = {1.5f, -2.0f, 0.25f};
  world->allreduce_sum(data, 3, DType::f32);  // the sum over one rank is the data itself
  EXPECT_EQ(data[0], 1.5f);
  EXPECT_EQ(data[1], -2.0f);
  EXPECT_EQ(data[2], 0.25f);
  const int32_t send[2] = {7, 8};
  int32_t recv[2] = {0, 0};
  world->allgather(send, recv, sizeof send);
  EXPECT_EQ(recv[0], 7);
  EXPECT_EQ(recv[1], 8);
  world->barrier();
}

TEST(Distributed, MpiWorldRejectsBadArguments) {
  mpi_started = true;
  auto world = mpi_world();
  float data[1] = {0};
  testing::expect_error<ValueError>([&] { world->allreduce_sum(data, -1, DType::f32); },
                                    {"allreduce_sum", "count must be >= 0, got -1"});
  testing::expect_error<DTypeError>([&] { world->allreduce_sum(data, 1, DType::boolean); },
                                    {"allreduce_sum", "bool cannot be summed"});
  testing::expect_error<ValueError>([&] { world->allreduce_sum(nullptr, 4, DType::f32); }, "data is null");
  testing::expect_error<ValueError>([&] { world->allgather(data, data, -4); },
                                    {"allgather", "bytes must be >= 0, got -4"});
  testing::expect_error<ValueError>([&] { world->allgather(nullptr, data, 4); }, "send or recv is null");
}
#else
TEST(Distributed, MpiWorldWithoutMpiSaysHowToGetIt) {
  testing::expect_error<Error>([] { mpi_world(); },
                               "kiln was built without MPI (install libopenmpi-dev and reconfigure)");
}
#endif

}  // namespace
}  // namespace kiln::engine
