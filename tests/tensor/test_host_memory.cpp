// Host memory's page-size advice, observed through the pages the system actually faults in.
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdlib>
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

}  // namespace
}  // namespace kiln
