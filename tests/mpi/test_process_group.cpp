// engine::mpi_world() across the ranks of mpirun: every expected value is computed here, on each rank,
// from what every rank contributes (a deterministic function of rank and index), in rank order.
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "kiln/engine/distributed.h"

namespace kiln::engine {
namespace {

// Rank r's element i: magnitudes from 1e-4 to 1e4, so the f32 sum depends on the order of addition.
float contribution(int rank, int64_t i) {
  static constexpr float kMagnitudes[9] = {1e-4f, 1e-3f, 1e-2f, 1e-1f, 1.0f, 1e1f, 1e2f, 1e3f, 1e4f};
  const float magnitude = kMagnitudes[(i * 7 + rank * 3) % 9];
  return ((i + rank) % 3 == 0 ? -magnitude : magnitude) * (1.0f + 0.001f * static_cast<float>(rank));
}

TEST(MpiProcessGroup, RanksAreDistinctAndCountedOnce) {
  auto world = mpi_world();
  std::vector<int32_t> ranks(world->size(), -1);
  const int32_t mine = world->rank();
  world->allgather(&mine, ranks.data(), sizeof mine);
  for (int r = 0; r < world->size(); ++r) EXPECT_EQ(ranks[r], r);
}

// Sizes: fewer elements than ranks (some ranks sum nothing), odd, and more than one 16 MiB slice.
class MpiProcessGroupAllreduceF32 : public ::testing::TestWithParam<int64_t> {};

TEST_P(MpiProcessGroupAllreduceF32, EqualsTheSumInRankOrderOnEveryRank) {
  auto world = mpi_world();
  const int64_t count = GetParam();
  std::vector<float> buffer(count);
  float* data = buffer.data();  // raw pointers: these loops run over millions of elements in Debug builds
  for (int64_t i = 0; i < count; ++i) data[i] = contribution(world->rank(), i);
  world->allreduce_sum(data, count, DType::f32);
  int64_t mismatches = 0;
  for (int64_t i = 0; i < count; ++i) {
    float expected = contribution(0, i);
    for (int r = 1; r < world->size(); ++r) expected += contribution(r, i);
    // Bitwise: every rank must hold exactly the rank-order sum, not a reassociated one.
    if (std::memcmp(&expected, &data[i], sizeof(float)) != 0 && mismatches++ < 5)
      ADD_FAILURE() << "element " << i << ": got " << data[i] << ", expected " << expected;
  }
  EXPECT_EQ(mismatches, 0);
}
INSTANTIATE_TEST_SUITE_P(Counts, MpiProcessGroupAllreduceF32,
                         ::testing::Values(int64_t{1}, int64_t{1001}, (int64_t{16} << 20) / 4 + 1001));

TEST(MpiProcessGroup, AllreduceBf16AccumulatesInFloatAndRoundsOnce) {
  auto world = mpi_world();
  const int64_t count = 777;
  std::vector<bf16_t> data(count);
  for (int64_t i = 0; i < count; ++i) data[i] = bf16_t(contribution(world->rank(), i));
  world->allreduce_sum(data.data(), count, DType::bf16);
  for (int64_t i = 0; i < count; ++i) {
    float sum = static_cast<float>(bf16_t(contribution(0, i)));
    for (int r = 1; r < world->size(); ++r) sum += static_cast<float>(bf16_t(contribution(r, i)));
    ASSERT_EQ(data[i].bits, bf16_t(sum).bits) << "element " << i;
  }
}

TEST(MpiProcessGroup, AllreduceF16AndIntegers) {
  auto world = mpi_world();
  const int rank = world->rank();
  std::vector<f16_t> halves(65);
  std::vector<int32_t> ints(65);
  std::vector<int64_t> longs(65);
  for (int i = 0; i < 65; ++i) {
    halves[i] = f16_t(0.5f * static_cast<float>(i - rank));
    ints[i] = (i - 30) * (rank + 1);
    longs[i] = (int64_t{1} << 40) * (rank + 1) - i;
  }
  world->allreduce_sum(halves.data(), 65, DType::f16);
  world->allreduce_sum(ints.data(), 65, DType::i32);
  world->allreduce_sum(longs.data(), 65, DType::i64);
  const int n = world->size();
  const int rank_sum = n * (n - 1) / 2, rank_plus_one_sum = n * (n + 1) / 2;
  for (int i = 0; i < 65; ++i) {
    // Small multiples of 0.5 are exact in f16, so the sum is exact too.
    EXPECT_EQ(static_cast<float>(halves[i]), 0.5f * static_cast<float>(n * i - rank_sum)) << i;
    EXPECT_EQ(ints[i], (i - 30) * rank_plus_one_sum) << i;
    EXPECT_EQ(longs[i], (int64_t{1} << 40) * rank_plus_one_sum - int64_t{n} * i) << i;
  }
}

TEST(MpiProcessGroup, AllgatherPlacesEachRanksBytesInRankOrder) {
  auto world = mpi_world();
  // 13 bytes (odd), and more than one 16 MiB slice.
  for (int64_t bytes : {int64_t{13}, (int64_t{16} << 20) + 4099}) {
    auto pattern = [](int rank, int64_t i) { return static_cast<uint8_t>(i * 31 + rank * 101); };
    std::vector<uint8_t> send(bytes), recv(bytes * world->size(), 0);
    for (int64_t i = 0; i < bytes; ++i) send.data()[i] = pattern(world->rank(), i);
    world->allgather(send.data(), recv.data(), bytes);
    int64_t mismatches = 0;
    for (int r = 0; r < world->size(); ++r) {
      const uint8_t* part = recv.data() + r * bytes;
      for (int64_t i = 0; i < bytes; ++i) mismatches += part[i] != pattern(r, i);
    }
    EXPECT_EQ(mismatches, 0) << bytes << " bytes";
  }
}

TEST(MpiProcessGroup, RepeatedCallsOfChangingSizesStayPaired) {
  auto world = mpi_world();
  for (int round = 0; round < 40; ++round) {
    const int64_t count = 1 + (round * 37) % 300;
    std::vector<float> data(count);
    for (int64_t i = 0; i < count; ++i) data[i] = static_cast<float>(round + i * (world->rank() + 1));
    world->allreduce_sum(data.data(), count, DType::f32);
    const int n = world->size();
    for (int64_t i = 0; i < count; ++i)  // small integers: exact in f32
      ASSERT_EQ(data[i], static_cast<float>(n * round + i * n * (n + 1) / 2)) << "round " << round;
    int32_t tag = round * 10 + world->rank();
    std::vector<int32_t> tags(n);
    world->allgather(&tag, tags.data(), sizeof tag);
    for (int r = 0; r < n; ++r) ASSERT_EQ(tags[r], round * 10 + r);
    if (round % 8 == 0) world->barrier();
  }
  world->allreduce_sum(nullptr, 0, DType::f32);  // nothing to sum: no traffic, no error
}

TEST(MpiProcessGroup, CallsFromAnotherThread) {
  // kiln's collective kernels call the group from their device threads, not the main thread.
  auto world = mpi_world();
  std::vector<double> data(10);
  for (int i = 0; i < 10; ++i) data[i] = 0.25 * i + world->rank();
  std::thread([&] { world->allreduce_sum(data.data(), 10, DType::f64); }).join();
  const int n = world->size();
  for (int i = 0; i < 10; ++i) EXPECT_EQ(data[i], 0.25 * i * n + n * (n - 1) / 2) << i;
}

}  // namespace
}  // namespace kiln::engine
