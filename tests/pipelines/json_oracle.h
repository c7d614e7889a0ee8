// Private to the tests: running a reference program (a node or Python oracle) whose stdout is one
// JSON object.
#pragma once

#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <string_view>

namespace kiln::testing {

// Runs `command` with its stderr in `stderr_file` (removed afterwards) and returns its stdout parsed
// as a JSON object; null, with a test failure naming the command, its status, its stderr and `hint`,
// when it cannot start, fails or prints anything else.
inline nlohmann::json run_json_oracle(const std::string& command, const std::filesystem::path& stderr_file,
                                      std::string_view hint) {
  const std::string cmd = command + " 2> '" + stderr_file.string() + "'";
  FILE* pipe = ::popen(cmd.c_str(), "r");
  if (pipe == nullptr) {
    ADD_FAILURE() << "could not start `" << cmd << "`";
    return nlohmann::json();
  }
  std::string out;
  char buffer[1 << 16];
  for (size_t n; (n = std::fread(buffer, 1, sizeof buffer, pipe)) > 0;) out.append(buffer, n);
  const int status = ::pclose(pipe);
  std::stringstream stderr_text;
  stderr_text << std::ifstream(stderr_file).rdbuf();
  std::error_code ec;
  std::filesystem::remove(stderr_file, ec);
  nlohmann::json result = nlohmann::json::parse(out, nullptr, false);
  if (status != 0 || result.is_discarded() || !result.is_object()) {
    ADD_FAILURE() << "the oracle failed (status " << status << "): `" << cmd << "`\n"
                  << stderr_text.str() << "\n" << hint;
    return nlohmann::json();
  }
  return result;
}

}  // namespace kiln::testing
