#include "pipelines/mapped_file.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>

#include "kiln/errors.h"
#include "tensor/host_memory.h"

namespace kiln::pipelines {

MappedFile map_file(const std::filesystem::path& path, std::string_view who) {
  auto fail = [&](const std::string& what) -> void {
    throw LoadError(fmt::format("{}: {}: {}", who, path.string(), what));
  };
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail(std::string("cannot open: ") + std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const std::string err = std::strerror(errno);
    ::close(fd);
    fail("cannot stat: " + err);
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    fail("not a regular file");
  }
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  if (size == 0) {
    ::close(fd);
    return MappedFile{};
  }
  // What is checked is the file as it is now: a file cut short since its header was written (a tensor
  // ending past the file's end) is a LoadError in the readers. A file truncated by someone else after
  // it is mapped cannot be detected: touching a page past its new end raises SIGBUS, which kiln does
  // not catch (no handler can make the missing bytes valid). Bytes rewritten in place while mapped are
  // read as rewritten, until copy-on-write has given the process its own page.
  // MAP_PRIVATE with PROT_WRITE is copy-on-write: the file (opened read-only) is never changed, and a
  // kernel that writes into a weight gets a private page instead of a SIGSEGV.
  void* p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, 0);
  const std::string err = std::strerror(errno);
  ::close(fd);  // the mapping keeps the file open
  if (p == MAP_FAILED) fail("cannot mmap " + std::to_string(size) + " bytes: " + err);
  const std::string identity = std::to_string(st.st_dev) + ":" + std::to_string(st.st_ino) + ":" + std::to_string(size) + ":" +
                               std::to_string(int64_t{st.st_mtim.tv_sec} * 1000000000 + st.st_mtim.tv_nsec);
  return MappedFile{std::shared_ptr<void>(p, FileMapping{p, size, identity}), size};
}

}  // namespace kiln::pipelines
