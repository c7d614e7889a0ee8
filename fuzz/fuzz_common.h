// What every harness shares: kiln's own exceptions are the parser refusing input (fine); anything
// else escaping is a finding, so it aborts and libFuzzer saves the input.
#pragma once

#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>
#include <typeinfo>

#include "kiln/errors.h"

namespace kiln::fuzz {

template <class F>
void refusals_only(F&& f) {
  try {
    f();
  } catch (const kiln::Error&) {
  } catch (const kiln::ValueError&) {
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fuzz: non-kiln exception %s: %s\n", typeid(e).name(), e.what());
    std::abort();
  } catch (...) {
    std::fprintf(stderr, "fuzz: non-std exception\n");
    std::abort();
  }
}

inline std::string_view bytes(const uint8_t* data, size_t size) {
  return {reinterpret_cast<const char*>(data), size};
}

// A directory of this process's own (the loaders take paths), under $TMPDIR, removed at exit.
inline const std::filesystem::path& scratch_dir() {
  static const std::filesystem::path dir = [] {
    auto d = std::filesystem::temp_directory_path() / ("kiln-fuzz-" + std::to_string(getpid()));
    std::filesystem::create_directories(d);
    std::atexit([] { std::error_code ec; std::filesystem::remove_all(scratch_dir(), ec); });
    return d;
  }();
  return dir;
}

inline std::filesystem::path write_file(const std::string& name, std::string_view content) {
  auto path = scratch_dir() / name;
  std::ofstream(path, std::ios::binary | std::ios::trunc).write(content.data(), static_cast<std::streamsize>(content.size()));
  return path;
}

}  // namespace kiln::fuzz
