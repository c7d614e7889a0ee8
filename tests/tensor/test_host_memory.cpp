// Host memory's page-size advice, observed through the pages the system actually faults in.
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdlib>
#include <functional>
#include <memory>
#include <vector>

#include "tensor/host_memory.h"

namespace kiln {
namespace {

// Bytes of [p, p + bytes) resident in memory, from mincore (p page-aligned).
size_t resident_bytes(void* p, size_t bytes) {
  const auto page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  std::vector<unsigned char> pages((bytes + page - 1) / page);
  if (mincore(p, bytes, pages.data()) != 0) return 0;
  size_t resident = 0;
  for (unsigned char in_memory : pages) resident += (in_memory & 1) ? page : 0;
  return resident;
}

TEST(HostMemory, AFirstTouchAfterSmallPagesAdviceFaultsInOnePageNotAHugeOne) {
  constexpr size_t kBytes = size_t{16} << 20, kHugePage = size_t{2} << 20;
  const auto page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  using Block = std::unique_ptr<char, decltype(&std::free)>;
  // allocate_aligned advises huge pages: one byte written faults in a whole 2 MiB page where the
  // system gives them.
  Block huge(static_cast<char*>(allocate_aligned(kBytes)), &std::free);
  ASSERT_TRUE(huge);
  huge.get()[kHugePage + 1] = 1;
  if (resident_bytes(huge.get() + kHugePage, kHugePage) != kHugePage)
    GTEST_SKIP() << "this system gave no transparent huge page to memory advised MADV_HUGEPAGE (THP off or "
                    "no free 2 MiB page), so there is no huge page for the advice to take back";

  Block small(static_cast<char*>(allocate_aligned(kBytes)), &std::free);
  ASSERT_TRUE(small);
  advise_small_pages(small.get(), kBytes);
  small.get()[kHugePage + 1] = 1;
  EXPECT_EQ(resident_bytes(small.get() + kHugePage, kHugePage), page);
  small.get()[kBytes - 1] = 1;  // the advice covers the block to its last page
  EXPECT_EQ(resident_bytes(small.get() + kBytes - kHugePage, kHugePage), page);
}

// populate_pages faults in every page its range touches, the partial ones at both ends too, without
// changing a byte of them; the pages beside the range stay out.
TEST(HostMemory, PopulatingFaultsInTheRangesPagesAndKeepsTheirBytes) {
  const auto page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  const size_t bytes = 8 * page;
  void* mapped = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(mapped, MAP_FAILED);
  std::unique_ptr<void, std::function<void(void*)>> unmap(mapped, [bytes](void* p) { munmap(p, bytes); });
  auto* base = static_cast<char*>(mapped);
  base[page + 10] = 42;  // page 1 in use, as a neighbouring KV block's bytes would be
  ASSERT_EQ(resident_bytes(base, bytes), page);

  // Bytes [page + 100, 4 page + 1): pages 1 to 4.
  populate_pages(base + page + 100, 3 * page - 99);
  if (resident_bytes(base, bytes) == page)
    GTEST_SKIP() << "this kernel lacks MADV_POPULATE_WRITE (Linux 5.14): the hint does nothing, as documented";
  EXPECT_EQ(resident_bytes(base, page), 0u);  // page 0: before the range
  EXPECT_EQ(resident_bytes(base + page, 4 * page), 4 * page);
  EXPECT_EQ(resident_bytes(base + 5 * page, 3 * page), 0u);  // pages 5-7: after it
  EXPECT_EQ(base[page + 10], 42);
  for (size_t i = 2 * page; i < 5 * page; ++i) ASSERT_EQ(base[i], 0) << i;
  populate_pages(base, 0);  // nothing to do
  EXPECT_EQ(resident_bytes(base, page), 0u);
}

}  // namespace
}  // namespace kiln
