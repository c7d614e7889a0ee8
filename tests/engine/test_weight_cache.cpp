// The packed-weight cache (kiln/engine/weight_cache.h): entries stored and found byte for byte, every
// kind of damage a miss that removes the entry, a dropped entry leaving nothing, LRU eviction, an
// unwritable directory warned about once. tests/pipelines/test_weight_cache_files.cpp has the cache
// under real sessions and model files.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <sys/xattr.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <thread>
#include <functional>
#include <optional>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "engine/cache_files.h"
#include "kiln/engine/weight_cache.h"
#include "nn/capturing_logger.h"
#include "test_util.h"

namespace {

using namespace kiln;
using engine::WeightCache;
using kiln::testing::TempDir;
namespace fs = std::filesystem;

std::vector<uint8_t> random_bytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint8_t> v(n);
  for (uint8_t& b : v) b = static_cast<uint8_t>(rng());
  return v;
}

std::vector<uint8_t> bytes_at(const std::shared_ptr<const void>& p, size_t n) {
  const auto* b = static_cast<const uint8_t*>(p.get());
  return {b, b + n};
}

fs::path entry_file(const WeightCache& cache, const std::string& key) { return cache.dir() / (key + ".kpack"); }

// Rewrites byte `at` of a file.
void flip_byte(const fs::path& file, uint64_t at) {
  std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(static_cast<std::streamoff>(at));
  char c = 0;
  f.read(&c, 1);
  c = static_cast<char>(c ^ 0x5a);
  f.seekp(static_cast<std::streamoff>(at));
  f.write(&c, 1);
}

TEST(WeightCache, KeysAreHexAndDependOnSourceAndPacking) {
  const std::string k = WeightCache::key("file@0+16", "panels");
  EXPECT_EQ(k.size(), 32u);
  EXPECT_EQ(k.find_first_not_of("0123456789abcdef"), std::string::npos) << k;
  EXPECT_EQ(k, WeightCache::key("file@0+16", "panels"));
  EXPECT_NE(k, WeightCache::key("file@16+16", "panels"));
  EXPECT_NE(k, WeightCache::key("file@0+16", "panels of 16"));
  EXPECT_NE(WeightCache::key("ab", "c"), WeightCache::key("a", "bc"));  // fields stay apart
}

TEST(WeightCache, StoredEntryIsFoundByteForByte) {
  TempDir dir;
  const WeightCache cache(dir.path(), 1 << 30);
  const std::string key = WeightCache::key("file@0+100000", "test");
  const std::vector<uint8_t> payload = random_bytes(100000, 1);
  EXPECT_EQ(cache.find(key, payload.size()), nullptr) << "nothing stored yet";
  ASSERT_TRUE(cache.store(key, payload.data(), payload.size()));
  EXPECT_EQ(cache.stores(), 1);
  const std::shared_ptr<const void> found = cache.find(key, payload.size());
  ASSERT_NE(found, nullptr);
  EXPECT_EQ(bytes_at(found, payload.size()), payload);
  EXPECT_EQ(cache.hits(), 1);
  ASSERT_EQ(cache.entries().size(), 1u);
  EXPECT_EQ(cache.entries()[0].key, key);
  EXPECT_EQ(cache.size_bytes(), 4096 + payload.size());
}

// Each kind of damage: the entry is a miss, and removed (so the next init packs and stores anew).
TEST(WeightCache, DamagedEntriesAreMissesAndAreRemoved) {
  TempDir dir;
  const WeightCache cache(dir.path(), 1 << 30);
  const std::string key = WeightCache::key("file@0+5000", "test"), other = WeightCache::key("file@1+5000", "test");
  const std::vector<uint8_t> payload = random_bytes(5000, 2);
  struct Damage {
    const char* what;
    std::function<void(const fs::path&)> apply;
  };
  const std::vector<Damage> damages = {
      {"a payload byte changed (a torn write, a bad disk)", [](const fs::path& f) { flip_byte(f, 4096 + 1234); }},
      {"the magic changed", [](const fs::path& f) { flip_byte(f, 0); }},
      {"the version changed", [](const fs::path& f) { flip_byte(f, 8); }},
      {"the header's length changed", [](const fs::path& f) { flip_byte(f, 16); }},
      {"the header's key changed", [](const fs::path& f) { flip_byte(f, 40); }},
      {"the header's checksum changed", [](const fs::path& f) { flip_byte(f, 64); }},
      {"cut short", [](const fs::path& f) { fs::resize_file(f, 4096 + 4999); }},
      {"grown", [](const fs::path& f) { fs::resize_file(f, 4096 + 5001); }},
      {"another key's entry under this name",
       [&](const fs::path& f) {
         ASSERT_TRUE(cache.store(other, payload.data(), payload.size()));
         fs::rename(entry_file(cache, other), f);
       }},
  };
  for (const Damage& d : damages) {
    SCOPED_TRACE(d.what);
    ASSERT_TRUE(cache.store(key, payload.data(), payload.size()));
    ASSERT_NE(cache.find(key, payload.size()), nullptr);
    d.apply(entry_file(cache, key));
    EXPECT_EQ(cache.find(key, payload.size()), nullptr);
    EXPECT_FALSE(fs::exists(entry_file(cache, key)));
  }
  // Asked for another length than stored: a miss too.
  ASSERT_TRUE(cache.store(key, payload.data(), payload.size()));
  EXPECT_EQ(cache.find(key, payload.size() + 1), nullptr);
  // Not a key: never a path.
  EXPECT_EQ(cache.find("../../etc/passwd", 10), nullptr);
  EXPECT_FALSE(cache.store("../x", payload.data(), payload.size()));
}

// The mark of an entry hashed in this boot (weight_cache.cpp), and whether `dir`'s file system keeps it.
constexpr const char* kCheckedAttribute = "user.kiln.checked";
bool keeps_user_attributes(const fs::path& dir) {
  fs::create_directories(dir);
  const fs::path probe = dir / "xattr-probe";
  std::ofstream(probe).put('x');
  const bool kept = ::setxattr(probe.c_str(), "user.kiln.probe", "1", 1, 0) == 0;
  fs::remove(probe);
  return kept;
}

// A payload of several 64 MiB chunks, checksummed and checked on two threads: a change in the last
// chunk is found as one in the first would be.
TEST(WeightCache, ChunksOfALargeEntryAreCheckedOnSeveralThreads) {
  TempDir dir;
  const WeightCache cache(dir.path(), uint64_t{1} << 30);
  const std::string key = WeightCache::key("file@0+large", "test");
  const uint64_t bytes = (uint64_t{64} << 20) * 2 + 12345;
  std::atomic<int> calls{0};
  const WeightCache::ForEach two_threads = [&](size_t count, const std::function<void(size_t)>& body) {
    ++calls;
    std::thread other([&] {
      for (size_t i = 1; i < count; i += 2) body(i);
    });
    for (size_t i = 0; i < count; i += 2) body(i);
    other.join();
  };
  {
    std::optional<WeightCache::NewEntry> entry = cache.create(key, bytes, two_threads);
    ASSERT_TRUE(entry);
    auto* p = static_cast<uint8_t*>(entry->data.get());
    for (uint64_t i = 0; i < bytes; i += 4096) p[i] = static_cast<uint8_t>(i >> 12);
    entry->commit();
  }
  EXPECT_EQ(calls.load(), 1) << "hashed once to commit";
  ::removexattr(entry_file(cache, key).c_str(), kCheckedAttribute);  // as after a reboot: hashed again
  EXPECT_NE(cache.find(key, bytes, two_threads), nullptr);
  EXPECT_EQ(calls.load(), 2);
  flip_byte(entry_file(cache, key), 4096 + bytes - 1);
  EXPECT_EQ(cache.find(key, bytes, two_threads), nullptr);
  EXPECT_EQ(calls.load(), 3);
}

// An entry is hashed when stored and then trusted for the rest of the boot while its file is
// unchanged; a mark from another boot, a write to the file or a mark removed make the next load hash
// it again (and a changed payload is then a miss).
TEST(WeightCache, AnEntryHashedInThisBootIsNotHashedAgainUntilItsFileChanges) {
  TempDir dir;
  if (!keeps_user_attributes(dir.path()))
    GTEST_SKIP() << dir.path() << " keeps no user extended attributes: every load hashes its entries there";
  const WeightCache cache(dir.path(), 1 << 30);
  const std::string key = WeightCache::key("file@0+70000", "test");
  const std::vector<uint8_t> payload = random_bytes(70000, 4);
  int hashes = 0;
  const WeightCache::ForEach counting = [&](size_t count, const std::function<void(size_t)>& body) {
    ++hashes;
    for (size_t i = 0; i < count; ++i) body(i);
  };
  {
    std::optional<WeightCache::NewEntry> entry = cache.create(key, payload.size(), counting);
    ASSERT_TRUE(entry);
    std::memcpy(entry->data.get(), payload.data(), payload.size());
    entry->commit();
  }
  EXPECT_EQ(hashes, 1);
  for (int load = 0; load < 2; ++load) {
    const std::shared_ptr<const void> found = cache.find(key, payload.size(), counting);
    ASSERT_NE(found, nullptr);
    EXPECT_EQ(bytes_at(found, payload.size()), payload);
  }
  EXPECT_EQ(hashes, 1) << "stored in this boot: not hashed again";

  const fs::path file = entry_file(cache, key);
  const std::string other_boot = "00000000-0000-0000-0000-000000000000 1.000000000";
  ASSERT_EQ(::setxattr(file.c_str(), kCheckedAttribute, other_boot.data(), other_boot.size(), 0), 0);
  EXPECT_NE(cache.find(key, payload.size(), counting), nullptr);
  EXPECT_EQ(hashes, 2) << "marked in another boot: hashed";
  EXPECT_NE(cache.find(key, payload.size(), counting), nullptr);
  EXPECT_EQ(hashes, 2) << "hashed, then marked again";

  flip_byte(file, 4096 + 777);  // a write: the mtime kiln marked is gone
  EXPECT_EQ(cache.find(key, payload.size(), counting), nullptr);
  EXPECT_EQ(hashes, 3);
  EXPECT_FALSE(fs::exists(file));
}

// An entry made in place and dropped before commit (packing threw) leaves no entry and no temp file;
// committed, it is the entry, and its mapping stays the packed bytes.
TEST(WeightCache, EntryMadeInPlaceIsStoredOnlyOnCommit) {
  TempDir dir;
  const WeightCache cache(dir.path(), 1 << 30);
  const std::string key = WeightCache::key("file@0+8192", "test");
  const std::vector<uint8_t> payload = random_bytes(8192, 3);
  {
    std::optional<WeightCache::NewEntry> entry = cache.create(key, payload.size());
    ASSERT_TRUE(entry);
    std::memcpy(entry->data.get(), payload.data(), payload.size());
  }
  EXPECT_TRUE(fs::is_empty(dir.path())) << "a dropped entry leaves nothing behind";
  EXPECT_EQ(cache.find(key, payload.size()), nullptr);
  std::optional<WeightCache::NewEntry> entry = cache.create(key, payload.size());
  ASSERT_TRUE(entry);
  std::memcpy(entry->data.get(), payload.data(), payload.size());
  entry->commit();
  EXPECT_EQ(bytes_at(entry->data, payload.size()), payload);
  EXPECT_EQ(bytes_at(cache.find(key, payload.size()), payload.size()), payload);
  EXPECT_EQ(cache.entries().size(), 1u);
}

// A process killed while packing into a new entry leaves its temp file; the next store removes it
// (its pid no longer runs), and leaves a live process's own.
TEST(WeightCache, TempFilesOfExitedProcessesAreRemoved) {
  TempDir dir;
  const WeightCache cache(dir.path(), 1 << 30);
  const std::string key = WeightCache::key("file", "orphan");
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    std::optional<WeightCache::NewEntry> entry = cache.create(key, 4096);
    ::_exit(entry ? 0 : 1);  // no destructors: as a process killed mid-pack
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  auto temps = [&] {
    size_t n = 0;
    for (const auto& e : fs::directory_iterator(dir.path())) n += e.path().extension() == ".tmp";
    return n;
  };
  ASSERT_EQ(temps(), 1u);
  std::optional<WeightCache::NewEntry> mine = cache.create(WeightCache::key("file", "mine"), 4096);
  ASSERT_TRUE(mine);
  const std::vector<uint8_t> payload = random_bytes(100, 7);
  ASSERT_TRUE(cache.store(WeightCache::key("file", "other"), payload.data(), payload.size()));
  EXPECT_EQ(temps(), 1u) << "the exited process's temp file goes, this one's (still packing) stays";
  mine->commit();
  EXPECT_EQ(temps(), 0u);
}

TEST(WeightCache, EvictsTheLeastRecentlyUsedBeyondMaxBytes) {
  TempDir dir;
  const uint64_t entry_bytes = 4096 + 1000;
  const WeightCache cache(dir.path(), 3 * entry_bytes);
  const std::vector<uint8_t> payload = random_bytes(1000, 4);
  std::vector<std::string> keys;
  for (int i = 0; i < 4; ++i) keys.push_back(WeightCache::key("file", std::to_string(i)));
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(cache.store(keys[i], payload.data(), payload.size()));
    // mtimes a second apart, whatever the file system's timestamp granularity
    fs::last_write_time(entry_file(cache, keys[i]), fs::file_time_type::clock::now() - std::chrono::seconds(10 - i));
  }
  ASSERT_NE(cache.find(keys[0], payload.size()), nullptr);  // used: now the most recent
  ASSERT_TRUE(cache.store(keys[3], payload.data(), payload.size()));
  EXPECT_EQ(cache.size_bytes(), 3 * entry_bytes);
  EXPECT_NE(cache.find(keys[0], payload.size()), nullptr);
  EXPECT_EQ(cache.find(keys[1], payload.size()), nullptr) << "the least recently used goes";
  EXPECT_NE(cache.find(keys[2], payload.size()), nullptr);
  EXPECT_NE(cache.find(keys[3], payload.size()), nullptr);
  // An entry larger than the whole bound is not stored at all.
  const std::vector<uint8_t> large = random_bytes(3 * entry_bytes, 5);
  EXPECT_FALSE(cache.store(WeightCache::key("file", "large"), large.data(), large.size()));
  EXPECT_EQ(cache.clear(), 3u);
  EXPECT_EQ(cache.size_bytes(), 0u);
}

// A load larger than the bound: its entries fill the cache and stop there, none evicting another of
// the same load (a later load would find them gone and rewrite the cache every time); the next load
// (another WeightCache, as another session makes) uses them and may make room from older ones.
TEST(WeightCache, ALoadLargerThanTheBoundIsPartlyCachedNeverThrashed) {
  TempDir dir;
  const uint64_t entry_bytes = 4096 + 1000;
  const std::vector<uint8_t> payload = random_bytes(1000, 8);
  auto key = [](int i) { return WeightCache::key("file", std::to_string(i)); };
  {
    const WeightCache first_load(dir.path(), 3 * entry_bytes);
    for (int i = 0; i < 5; ++i) EXPECT_EQ(first_load.store(key(i), payload.data(), payload.size()), i < 3) << i;
    EXPECT_EQ(first_load.size_bytes(), 3 * entry_bytes);
  }
  for (int i = 0; i < 3; ++i)  // the first load's entries, older than the next load
    fs::last_write_time(entry_file(WeightCache(dir.path()), key(i)), fs::file_time_type::clock::now() - std::chrono::hours(1));
  const WeightCache second_load(dir.path(), 3 * entry_bytes);
  for (int i = 0; i < 3; ++i) EXPECT_NE(second_load.find(key(i), payload.size()), nullptr) << i;
  EXPECT_FALSE(second_load.store(key(3), payload.data(), payload.size())) << "all three are this load's now";
  EXPECT_EQ(second_load.size_bytes(), 3 * entry_bytes);
}

TEST(WeightCache, UnwritableDirectoryWarnsOnceAndStoresNothing) {
  TempDir dir;
  fs::create_directories(dir.path());
  std::ofstream(dir.path() / "file") << "x";  // a regular file: no directory can be made under it
  auto logger = std::make_shared<kiln::testing::CapturingLogger>();
  const WeightCache cache(dir.path() / "file" / "weights", 1 << 30, logger);
  const std::vector<uint8_t> payload = random_bytes(100, 6);
  EXPECT_FALSE(cache.store(WeightCache::key("a", "b"), payload.data(), payload.size()));
  EXPECT_FALSE(cache.store(WeightCache::key("a", "c"), payload.data(), payload.size()));
  ASSERT_EQ(logger->warnings.size(), 1u);
  EXPECT_NE(logger->warnings[0].find("weight cache"), std::string::npos) << logger->warnings[0];
  EXPECT_NE(logger->warnings[0].find((dir.path() / "file").string()), std::string::npos) << logger->warnings[0];
}

// The disk bounds the entries as the size bound does: with `disk_room` bytes left to give them, least
// recently used entries of older loads go until the new one fits, never this load's.
TEST(WeightCache, OlderEntriesMakeRoomWhenTheDiskIsShort) {
  TempDir dir;
  fs::create_directories(dir.path());
  const auto now = fs::file_time_type::clock::now();
  std::vector<fs::path> files;
  for (int i = 0; i < 3; ++i) {
    files.push_back(dir.path() / ("entry" + std::to_string(i) + ".kpack"));
    std::ofstream(files.back()) << std::string(1000, 'x');
    fs::last_write_time(files.back(), now - std::chrono::seconds(100 - 10 * i));  // entry0 oldest
  }
  const uint64_t unbounded = uint64_t{1} << 40;
  const auto this_load = now - std::chrono::seconds(10);
  // 3000 held + 500 of room: a 1200-byte entry needs one old entry gone.
  EXPECT_TRUE(engine::cache_files::evict(dir.path(), ".kpack", unbounded, 1200, this_load, 500));
  EXPECT_FALSE(fs::exists(files[0]));
  EXPECT_TRUE(fs::exists(files[1]) && fs::exists(files[2]));
  // No room left, and entry2 used by this load: entry1 goes, entry2 stays, and 1500 more do not fit.
  fs::last_write_time(files[2], now);
  EXPECT_FALSE(engine::cache_files::evict(dir.path(), ".kpack", unbounded, 1500, this_load, 0));
  EXPECT_FALSE(fs::exists(files[1]));
  EXPECT_TRUE(fs::exists(files[2]));
  // Room enough: nothing goes.
  EXPECT_TRUE(engine::cache_files::evict(dir.path(), ".kpack", unbounded, 1500, this_load, 2000));
  EXPECT_TRUE(fs::exists(files[2]));
}

}  // namespace
