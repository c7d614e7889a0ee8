#include "engine/cache_files.h"

#include <dlfcn.h>
#include <signal.h>
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>

#include "kiln/errors.h"

namespace kiln::engine::cache_files {

namespace fs = std::filesystem;

std::vector<CacheEntry> entries(const fs::path& dir, std::string_view suffix) {
  std::vector<CacheEntry> result;
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const fs::path& path = it->path();
    const std::string name = path.filename().string();
    if (path.extension() != suffix || name.front() == '.') continue;
    std::error_code stat_ec;  // entries may vanish under a concurrent eviction
    const uint64_t bytes = fs::file_size(path, stat_ec);
    const auto time = fs::last_write_time(path, stat_ec);
    if (stat_ec) continue;
    result.push_back({path.stem().string(), path, bytes, time});
  }
  std::sort(result.begin(), result.end(),
            [](const CacheEntry& a, const CacheEntry& b) { return a.last_used < b.last_used; });
  return result;
}

uint64_t total_bytes(const std::vector<CacheEntry>& entries) {
  uint64_t total = 0;
  for (const CacheEntry& e : entries) total += e.bytes;
  return total;
}

size_t clear(const fs::path& dir, std::string_view suffix) {
  size_t removed = 0;
  for (const CacheEntry& e : entries(dir, suffix)) {
    std::error_code ec;
    removed += fs::remove(e.file, ec);
  }
  return removed;
}

// The temp files are temp_path's ".KEY.PID.N.tmp".
void remove_orphan_temps(const fs::path& dir) {
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name.front() != '.' || it->path().extension() != ".tmp") continue;
    const std::string stem = it->path().stem().string();  // ".KEY.PID.N"
    const size_t counter = stem.rfind('.'), pid_at = counter == std::string::npos ? counter : stem.rfind('.', counter - 1);
    if (pid_at == std::string::npos || pid_at == 0) continue;
    char* end_of_pid = nullptr;
    const long pid = std::strtol(stem.c_str() + pid_at + 1, &end_of_pid, 10);
    if (end_of_pid != stem.c_str() + counter || pid <= 0) continue;
    if (::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) {
      std::error_code ignored;
      fs::remove(it->path(), ignored);
    }
  }
}

bool evict(const fs::path& dir, std::string_view suffix, uint64_t max_bytes, uint64_t entry_bytes,
           fs::file_time_type keep_since, uint64_t disk_room) {
  remove_orphan_temps(dir);
  const std::vector<CacheEntry> all = entries(dir, suffix);
  const uint64_t held = total_bytes(all);
  const uint64_t bound = std::min(max_bytes, disk_room > UINT64_MAX - held ? UINT64_MAX : held + disk_room);
  uint64_t total = held + entry_bytes;
  for (const CacheEntry& e : all) {
    if (total <= bound || e.last_used >= keep_since) break;
    std::error_code ec;
    fs::remove(e.file, ec);
    total -= e.bytes;
  }
  return total <= bound;
}

fs::path temp_path(const fs::path& dir, std::string_view key) {
  static std::atomic<uint64_t> counter{0};
  return dir / fmt::format(".{}.{}.{}.tmp", key, ::getpid(), counter++);
}

void remove_if_unchanged(const fs::path& file, const struct stat& before) {
  struct stat now {};
  if (::stat(file.c_str(), &now) == 0 && now.st_ino == before.st_ino && now.st_dev == before.st_dev) {
    std::error_code ignored;
    fs::remove(file, ignored);
  }
}

void touch(const fs::path& file) {
  std::error_code ignored;
  fs::last_write_time(file, fs::file_time_type::clock::now(), ignored);
}

const std::string& cpu_features() {
  static const std::string features = [] {
    std::string f;
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
#define KILN_FEATURE(name) \
  if (__builtin_cpu_supports(name)) f += name ",";
    KILN_FEATURE("avx") KILN_FEATURE("avx2") KILN_FEATURE("fma") KILN_FEATURE("f16c") KILN_FEATURE("avx512f")
    KILN_FEATURE("avx512bw") KILN_FEATURE("avx512vl") KILN_FEATURE("avx512vnni") KILN_FEATURE("avx512bf16")
#undef KILN_FEATURE
#elif defined(__aarch64__)
    f = "aarch64";
#endif
    return f;
  }();
  return features;
}

const std::string& build_id() {
  static const std::string id = [] {
    std::error_code ec;
    fs::path exe;
    Dl_info info{};
    if (dladdr(reinterpret_cast<const void*>(&build_id), &info) != 0 && info.dli_fname && *info.dli_fname)
      exe = fs::canonical(info.dli_fname, ec);
    if (exe.empty() || ec) exe = fs::read_symlink("/proc/self/exe", ec);
    if (ec) return std::string("unknown-build");
    const auto size = fs::file_size(exe, ec);
    const auto time = fs::last_write_time(exe, ec);
    if (ec) return std::string("unknown-build");
    return fmt::format("{}:{}:{}", exe.string(), size, time.time_since_epoch().count());
  }();
  return id;
}

const char* env(const char* name) {
  const char* value = std::getenv(name);
  return value && *value ? value : nullptr;
}

uint64_t env_bytes(const char* name, uint64_t fallback) {
  const char* text = env(name);
  if (!text) return fallback;
  char* end = nullptr;
  errno = 0;
  const unsigned long long value = std::strtoull(text, &end, 10);
  if (errno != 0 || *end != '\0' || value == 0 || text[0] == '-')
    throw ValueError(fmt::format("{}: expected a positive integer (bytes), got '{}'", name, text));
  return value;
}

}  // namespace kiln::engine::cache_files
