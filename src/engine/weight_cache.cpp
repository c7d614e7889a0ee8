// The packed-weight cache: one file per entry, `<key>.kpack`: a 4096-byte header (magic, version,
// payload length, chunk length, the key, the XXH3-64 of each chunk of the payload), then the payload,
// page aligned so it is mapped in place.
#include "kiln/engine/weight_cache.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/xattr.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <chrono>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <vector>

#include "engine/cache_files.h"
#include "graph/hash.h"
#include "kiln/errors.h"

namespace kiln::engine {

namespace fs = std::filesystem;

namespace {

constexpr std::string_view kEntrySuffix = ".kpack";
constexpr char kMagic[8] = {'K', 'I', 'L', 'N', 'P', 'A', 'C', 'K'};
constexpr uint32_t kVersion = 1;
constexpr uint64_t kHeaderBytes = 4096;  // a page: the payload is mapped from this offset
constexpr uint64_t kMinFreeBytes = uint64_t{1} << 30;

// The header's fields, little-endian as the host (entries are never shared between machines), then
// the key, then the XXH3-64 of each chunk of the payload (checked on as many threads as the caller has).
struct Header {
  char magic[8];
  uint32_t version;
  uint32_t key_bytes;
  uint64_t payload_bytes;
  uint64_t chunk_bytes;
};
static_assert(sizeof(Header) == 32);
constexpr uint64_t kMaxKeyBytes = 32;
constexpr uint64_t kMaxChunks = (kHeaderBytes - sizeof(Header) - kMaxKeyBytes) / sizeof(uint64_t);

// Chunks of 64 MiB, or larger where a payload would need more than the header holds.
uint64_t chunk_bytes_for(uint64_t bytes) {
  const uint64_t least = (bytes + kMaxChunks - 1) / kMaxChunks;
  return std::max<uint64_t>(uint64_t{64} << 20, (least + 4095) / 4096 * 4096);
}

bool is_key(std::string_view key) {
  return key.size() == kMaxKeyBytes && std::all_of(key.begin(), key.end(), [](char c) {
           return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f');
         });
}

// The chunks' checksums of a payload, on `for_each`'s threads.
std::vector<uint64_t> chunk_checksums(const void* payload, uint64_t bytes, uint64_t chunk,
                                      const WeightCache::ForEach& for_each) {
  std::vector<uint64_t> sums(static_cast<size_t>((bytes + chunk - 1) / chunk));
  auto one = [&](size_t i) {
    const uint64_t first = i * chunk;
    sums[i] = XXH3_64bits(static_cast<const uint8_t*>(payload) + first, std::min(chunk, bytes - first));
  };
  if (for_each)
    for_each(sums.size(), one);
  else
    for (size_t i = 0; i < sums.size(); ++i) one(i);
  return sums;
}

// A payload is hashed against its header once per boot: when it is stored, or at the first load after
// a boot or after the file changed. The hashes guard against a torn write (power lost after the
// rename) and a bad disk, and a power loss is a new boot; within one boot the page cache holds what
// was hashed. The mark is an extended attribute: this boot's id and the mtime kiln set with it (a
// write to the file sets another). Where the file system keeps no user attributes every load hashes.
constexpr const char* kCheckedAttribute = "user.kiln.checked";

const std::string& boot_id() {
  static const std::string id = [] {
    std::ifstream in("/proc/sys/kernel/random/boot_id");
    std::string line;
    std::getline(in, line);
    return line;
  }();
  return id;
}

std::string checked_mark(const struct timespec& mtime) {
  return fmt::format("{} {}.{:09}", boot_id(), mtime.tv_sec, mtime.tv_nsec);
}

// Whether the open entry `fd` (its fstat `st`) was hashed in this boot and not written since.
bool checked_this_boot(int fd, const struct stat& st) {
  if (boot_id().empty()) return false;
  char value[128];
  const ssize_t n = ::fgetxattr(fd, kCheckedAttribute, value, sizeof value);
  return n > 0 && std::string_view(value, static_cast<size_t>(n)) == checked_mark(st.st_mtim);
}

// Sets the entry's mtime to now (the cache's LRU order) and marks it hashed in this boot with it.
void touch_and_mark_checked(int fd) {
  struct timespec now {};
  ::clock_gettime(CLOCK_REALTIME, &now);
  const struct timespec times[2] = {{0, UTIME_OMIT}, now};
  if (::futimens(fd, times) != 0 || boot_id().empty()) return;
  const std::string mark = checked_mark(now);
  ::fsetxattr(fd, kCheckedAttribute, mark.data(), mark.size(), 0);  // unmarked: hashed at each load
}

// Whether `page` (kHeaderBytes read from an entry) is the header of `key` with `bytes` of payload;
// its chunks' checksums into `sums`.
bool header_matches(const uint8_t* page, std::string_view key, uint64_t bytes, std::vector<uint64_t>* sums) {
  Header h{};
  std::memcpy(&h, page, sizeof h);
  if (std::memcmp(h.magic, kMagic, sizeof kMagic) != 0 || h.version != kVersion || h.payload_bytes != bytes ||
      h.key_bytes != key.size() || h.chunk_bytes != chunk_bytes_for(bytes))
    return false;
  if (std::memcmp(page + sizeof h, key.data(), key.size()) != 0) return false;
  sums->resize(static_cast<size_t>((bytes + h.chunk_bytes - 1) / h.chunk_bytes));
  std::memcpy(sums->data(), page + sizeof h + kMaxKeyBytes, sums->size() * sizeof(uint64_t));
  return true;
}

}  // namespace

WeightCache::WeightCache(fs::path dir, uint64_t max_bytes, std::shared_ptr<Logger> logger)
    : dir_(dir.empty() ? default_dir() : std::move(dir)),
      max_bytes_(max_bytes == 0 ? default_max_bytes() : max_bytes),
      logger_(logger ? std::move(logger) : default_logger()),
      // A second back: an entry touched just before (its mtime rounded down) counts as this load's.
      created_(fs::file_time_type::clock::now() - std::chrono::seconds(1)) {}

fs::path WeightCache::default_dir() { return CompileCache::default_dir() / "weights"; }

uint64_t WeightCache::default_max_bytes() {
  return cache_files::env_bytes("KILN_WEIGHT_CACHE_MAX_BYTES", uint64_t{32} << 30);
}

std::string WeightCache::key(const std::string& source, std::string_view packing) {
  Fnv1a64 first, second;
  for (std::string_view field : {std::string_view(source), packing, std::string_view(cache_files::cpu_features()),
                                 std::string_view(cache_files::build_id())}) {
    first.field(field);
    second.field(field).field("second");  // a second, differently seeded hash: 128 bits in all
  }
  return fmt::format("{:016x}{:016x}", first.value, second.value);
}

std::shared_ptr<const void> WeightCache::find(const std::string& key, uint64_t bytes, const ForEach& for_each) const {
  if (!is_key(key) || bytes == 0) return nullptr;
  const fs::path file = dir_ / (key + std::string(kEntrySuffix));
  const int fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return nullptr;
  struct stat st {};
  uint8_t page[kHeaderBytes];
  std::vector<uint64_t> sums;
  const bool valid = ::fstat(fd, &st) == 0 && S_ISREG(st.st_mode) &&
                     static_cast<uint64_t>(st.st_size) == kHeaderBytes + bytes &&
                     ::pread(fd, page, kHeaderBytes, 0) == static_cast<ssize_t>(kHeaderBytes) &&
                     header_matches(page, key, bytes, &sums);
  void* payload = valid ? ::mmap(nullptr, bytes, PROT_READ, MAP_PRIVATE, fd, static_cast<off_t>(kHeaderBytes)) : MAP_FAILED;
  if (payload != MAP_FAILED && !checked_this_boot(fd, st) &&
      chunk_checksums(payload, bytes, chunk_bytes_for(bytes), for_each) != sums) {
    ::munmap(payload, bytes);
    payload = MAP_FAILED;
  }
  if (payload == MAP_FAILED) {
    ::close(fd);
    cache_files::remove_if_unchanged(file, st);  // a bad entry, unless a store replaced it meanwhile
    return nullptr;
  }
  touch_and_mark_checked(fd);
  ::close(fd);  // the mapping keeps the file open
  ++hits_;
  return std::shared_ptr<const void>(payload, [bytes](const void* p) { ::munmap(const_cast<void*>(p), bytes); });
}

std::optional<WeightCache::NewEntry> WeightCache::create(const std::string& key, uint64_t bytes,
                                                        const ForEach& for_each) const {
  if (unwritable_.load() || full_.load() || !is_key(key) || bytes == 0 ||
      bytes > max_bytes_ - std::min(max_bytes_, kHeaderBytes))
    return std::nullopt;
  auto fail = [this](const std::string& why) -> std::optional<NewEntry> {
    if (!unwritable_.exchange(true))
      logger_->warning(fmt::format("weight cache: cannot store an entry in '{}': {}; packed weights are not "
                                   "stored for the rest of this session",
                                   dir_.string(), why));
    return std::nullopt;
  };
  std::error_code ec;
  fs::create_directories(dir_, ec);
  if (ec) return fail("cannot create the directory: " + ec.message());
  // Room made by older loads' entries only: when this load's own fill the bound, it makes no more.
  // The disk bounds them too, keeping kMinFreeBytes free: the size bound can be more than the disk
  // has (each rebuilt kiln adds a whole set of entries), and a disk left full would make every later
  // load pack in memory again.
  const fs::space_info space = fs::space(dir_, ec);
  if (ec) return std::nullopt;
  const uint64_t disk_room = space.available > kMinFreeBytes ? space.available - kMinFreeBytes : 0;
  if (!cache_files::evict(dir_, kEntrySuffix, max_bytes_, kHeaderBytes + bytes, created_, disk_room)) {
    const fs::space_info now = fs::space(dir_, ec);
    if (ec || now.available >= kHeaderBytes + bytes + kMinFreeBytes)
      full_ = true;  // this load's own entries fill the size bound
    else if (!disk_short_.exchange(true))
      logger_->warning(fmt::format("weight cache: the disk holding '{}' has {} bytes free, and {} are kept "
                                   "free: packed weights this load cannot store are packed in memory",
                                   dir_.string(), now.available, kMinFreeBytes));
    return std::nullopt;
  }
  const fs::path temp = cache_files::temp_path(dir_, key);
  const int fd = ::open(temp.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) return fail(std::strerror(errno));
  // The blocks reserved first: a write into the mapping that found the disk full would be a SIGBUS.
  const int reserved = ::posix_fallocate(fd, 0, static_cast<off_t>(kHeaderBytes + bytes));
  void* data = reserved == 0 ? ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, static_cast<off_t>(kHeaderBytes))
                             : MAP_FAILED;
  if (data == MAP_FAILED) {
    const int error = reserved != 0 ? reserved : errno;
    ::close(fd);
    fs::remove(temp, ec);
    // A full disk (or a file system without fallocate) only costs this entry.
    if (error == ENOSPC || error == EOPNOTSUPP || error == EINVAL) return std::nullopt;
    return fail(std::strerror(error));
  }
  // The mapping's owner removes the temp file unless commit() has renamed it into place.
  struct Pending {
    int fd;
    fs::path temp;
    bool committed = false;
  };
  auto pending = std::make_shared<Pending>(Pending{fd, temp});
  std::shared_ptr<void> mapping(data, [bytes, pending](void* p) {
    ::munmap(p, bytes);
    if (pending->fd >= 0) ::close(pending->fd);
    std::error_code ignored;
    if (!pending->committed) fs::remove(pending->temp, ignored);
  });
  auto commit = [this, key, bytes, pending, data, fail, for_each]() {
    if (pending->committed || pending->fd < 0) return;
    uint8_t page[kHeaderBytes] = {};
    Header h{};
    std::memcpy(h.magic, kMagic, sizeof kMagic);
    h.version = kVersion;
    h.key_bytes = static_cast<uint32_t>(key.size());
    h.payload_bytes = bytes;
    h.chunk_bytes = chunk_bytes_for(bytes);
    const std::vector<uint64_t> sums = chunk_checksums(data, bytes, h.chunk_bytes, for_each);
    std::memcpy(page, &h, sizeof h);
    std::memcpy(page + sizeof h, key.data(), key.size());
    std::memcpy(page + sizeof h + kMaxKeyBytes, sums.data(), sums.size() * sizeof(uint64_t));
    const bool written = ::pwrite(pending->fd, page, kHeaderBytes, 0) == static_cast<ssize_t>(kHeaderBytes);
    const int error = errno;
    if (written) touch_and_mark_checked(pending->fd);  // just hashed; no write to it follows
    const bool closed = ::close(pending->fd) == 0;
    pending->fd = -1;
    std::error_code ec;
    if (written && closed) fs::rename(pending->temp, dir_ / (key + std::string(kEntrySuffix)), ec);
    if (!written || !closed || ec) {
      fail(!written ? std::strerror(error) : !closed ? "cannot close the file" : "cannot rename the entry into place");
      return;  // the mapping's owner removes the temp file
    }
    pending->committed = true;
    ++stores_;
  };
  return NewEntry{std::move(mapping), std::move(commit)};
}

bool WeightCache::store(const std::string& key, const void* data, uint64_t bytes) const {
  std::optional<NewEntry> entry = create(key, bytes);
  if (!entry) return false;
  std::memcpy(entry->data.get(), data, bytes);
  const int64_t before = stores_.load();
  entry->commit();
  return stores_.load() > before;
}

std::vector<CacheEntry> WeightCache::entries() const { return cache_files::entries(dir_, kEntrySuffix); }
uint64_t WeightCache::size_bytes() const { return cache_files::total_bytes(entries()); }
size_t WeightCache::clear() const { return cache_files::clear(dir_, kEntrySuffix); }
void WeightCache::evict() const { cache_files::evict(dir_, kEntrySuffix, max_bytes_, 0, created_); }

WeightCache::Entry WeightCache::acquire(const std::string& key, uint64_t bytes, const ForEach& for_each) const {
  if (std::shared_ptr<const void> found = find(key, bytes, for_each))
    return {std::const_pointer_cast<void>(std::move(found)), true, {}};  // read only: mapped PROT_READ
  if (std::optional<NewEntry> entry = create(key, bytes, for_each)) return {std::move(entry->data), false, std::move(entry->commit)};
  return {};
}

}  // namespace kiln::engine
