// Shared test helpers: asserting on exceptions and their messages; the ChatML rendering by hand.
#pragma once

#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

namespace kiln::testing {

// The message of the E that `fn` throws; a test failure (and "") if it throws nothing or another type.
template <class E, class F>
std::string error_message(F&& fn) {
  try {
    fn();
  } catch (const E& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "wrong exception type: " << e.what();
    return "";
  }
  ADD_FAILURE() << "expected an exception";
  return "";
}

// Asserts that `fn` throws E whose message contains every one of `parts`.
template <class E, class F>
void expect_error(F&& fn, const std::vector<std::string>& parts) {
  std::string message = error_message<E>(fn);
  for (const auto& part : parts)
    EXPECT_NE(message.find(part), std::string::npos) << "message: " << message << "\nmissing: " << part;
}
template <class E, class F>
void expect_error(F&& fn, const char* part) {
  expect_error<E>(fn, std::vector<std::string>{part});
}

// A fresh path under the system's temp directory (not created: a test may need it absent), removed
// with everything in it at the end. Unique per process and object, so parallel tests never share one.
// Sets (or, with nullptr, unsets) an environment variable for a scope, then puts it back.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    value ? ::setenv(name, value, 1) : ::unsetenv(name);
  }
  ~ScopedEnv() { old_ ? ::setenv(name_, old_->c_str(), 1) : ::unsetenv(name_); }

 private:
  const char* name_;
  std::optional<std::string> old_;
};

class TempDir {
 public:
  explicit TempDir(const std::string& name = "test") {
    static std::atomic<int> counter{0};
    path_ = std::filesystem::temp_directory_path() /
            ("kiln_" + name + "_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    std::filesystem::remove_all(path_);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

// What tests/data/chat/chatml.jinja renders for (role, content) messages with
// add_generation_prompt, written out by hand: the truth the chat tests compare with.
inline std::string chatml_prompt(const std::vector<std::pair<std::string, std::string>>& messages) {
  std::string out;
  for (const auto& [role, content] : messages) out += "<|im_start|>" + role + "\n" + content + "<|im_end|>\n";
  return out + "<|im_start|>assistant\n";
}

// This process's resident bytes of its mappings of `path`, or of any file under it when it is a
// directory (the Rss fields of /proc/self/smaps).
inline size_t resident_bytes_of(const std::filesystem::path& path) {
  std::ifstream smaps("/proc/self/smaps");
  const std::string name = std::filesystem::weakly_canonical(path).string();  // as smaps spells it
  const std::string file = " " + name, under = name + "/";
  size_t kb = 0;
  bool in_file = false;
  for (std::string line; std::getline(smaps, line);) {
    const std::string first = line.substr(0, line.find(' '));
    if (!first.ends_with(':')) {  // a mapping's header: "start-end perms offset dev inode path"
      const size_t slash = line.find(" /");
      in_file = line.ends_with(file) || (slash != std::string::npos && line.substr(slash + 1).starts_with(under));
    } else if (in_file && first == "Rss:") {
      kb += std::stoul(line.substr(first.size()));
    }
  }
  return kb * 1024;
}

}  // namespace kiln::testing
