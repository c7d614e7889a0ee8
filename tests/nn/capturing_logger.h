// A kiln::Logger that keeps what it is told, so tests read a session's warnings instead of stderr.
#pragma once

#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "kiln/logging.h"

namespace kiln::testing {

class CapturingLogger : public Logger {
 public:
  void log(LogLevel level, std::string_view message) override {
    std::lock_guard lock(mutex_);
    if (level == LogLevel::warning)
      warnings.emplace_back(message);
    else
      others.emplace_back(message);
  }
  std::vector<std::string> warnings;  // read once the session is done with the logger
  std::vector<std::string> others;

 private:
  std::mutex mutex_;
};

}  // namespace kiln::testing
