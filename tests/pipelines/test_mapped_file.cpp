// A mapped file's pages dropped (drop_file_pages): only whole pages inside the range and inside the
// mapping go, the process's resident size of the mapping falls by them (Rss in /proc/self/smaps), and
// a reader still sees the file's bytes.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fmt/format.h>
#include <fstream>
#include <string>
#include <vector>

#include "pipelines/mapped_file.h"
#include "tensor/host_memory.h"
#include "test_util.h"

namespace kiln::pipelines {
namespace {
namespace fs = std::filesystem;
using kiln::testing::resident_bytes_of;

struct TempFile {
  fs::path path = fs::temp_directory_path() / fmt::format("kiln-test-mapped-{}.bin", ::getpid());
  ~TempFile() { fs::remove(path); }
};

TEST(MappedFile, DroppedPagesLeaveTheProcessAndReadBackAsTheFileHasThem) {
  const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE)), size = 5 * page + 100;
  std::vector<uint8_t> bytes(size);
  for (size_t i = 0; i < size; ++i) bytes[i] = static_cast<uint8_t>(i * 131 + i / page);
  TempFile file;
  std::ofstream(file.path, std::ios::binary).write(reinterpret_cast<const char*>(bytes.data()), size);
  const MappedFile mapped = map_file(file.path, "test");
  ASSERT_EQ(mapped.size, size);

  const auto touch_all = [&] {
    uint32_t sum = 0;
    for (size_t i = 0; i < size; i += 64) sum += *static_cast<const volatile uint8_t*>(mapped.bytes() + i);
    return sum;
  };
  touch_all();
  const size_t resident = resident_bytes_of(file.path);
  ASSERT_EQ(resident, 6 * page);  // the whole file, its last part-page included

  // [page/2, 3.5 pages): only pages 1 and 2 lie wholly inside; pages 0 and 3 hold bytes outside it.
  EXPECT_EQ(drop_file_pages(mapped.base, mapped.bytes() + page / 2, 3 * page), 2 * page);
  EXPECT_EQ(resident_bytes_of(file.path), 4 * page);
  EXPECT_TRUE(std::equal(bytes.begin(), bytes.end(), mapped.bytes()));  // read back from the file
  EXPECT_EQ(resident_bytes_of(file.path), 6 * page);

  // Nothing dropped: a range inside one page, a range outside the mapping, or memory not a file's.
  EXPECT_EQ(drop_file_pages(mapped.base, mapped.bytes() + 1, page - 2), 0u);
  EXPECT_EQ(drop_file_pages(mapped.base, mapped.bytes() - page, 2 * page), 0u);
  EXPECT_EQ(drop_file_pages(mapped.base, mapped.bytes() + page, size), 0u);  // runs past the end
  EXPECT_EQ(drop_file_pages(mapped.base, mapped.bytes() + size + page, page), 0u);
  const std::shared_ptr<void> heap(allocate_aligned(2 * page), std::free);
  EXPECT_EQ(drop_file_pages(heap, heap.get(), 2 * page), 0u);
  EXPECT_EQ(drop_file_pages(nullptr, mapped.bytes(), page), 0u);
  EXPECT_EQ(resident_bytes_of(file.path), 6 * page);
  EXPECT_EQ(touch_all(), touch_all());
}

}  // namespace
}  // namespace kiln::pipelines
