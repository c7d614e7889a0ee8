// kiln::Logger: where kiln's warnings go. Each session takes its own (engine::SessionOptions::logger;
// nn::EagerSessionOptions passes one through), so two sessions can report to different places and a
// test can capture what one session says; a session given none uses default_logger().
//
//   struct Collect : kiln::Logger {
//     void log(kiln::LogLevel, std::string_view message) override { lines.emplace_back(message); }
//     std::vector<std::string> lines;
//   };
//   engine::InferenceSession session({DeviceRef::CPU()}, {}, {.logger = std::make_shared<Collect>()});
#pragma once

#include <iostream>
#include <memory>
#include <string>
#include <string_view>

namespace kiln {

enum class LogLevel { info, warning, error };

inline std::string_view log_level_name(LogLevel level) {
  switch (level) {
    case LogLevel::info: return "info";
    case LogLevel::warning: return "warning";
    case LogLevel::error: return "error";
  }
  return "?";
}

class Logger {
 public:
  virtual ~Logger() = default;
  // Called from whichever thread uses the session: a logger shared by threads must be thread-safe.
  virtual void log(LogLevel level, std::string_view message) = 0;
  void warning(std::string_view message) { log(LogLevel::warning, message); }
};

// Writes "kiln: <level>: <message>" to stderr, one line per call.
class StderrLogger final : public Logger {
 public:
  void log(LogLevel level, std::string_view message) override {
    // One write per line, so lines from several threads do not interleave mid-line.
    std::cerr << ("kiln: " + std::string(log_level_name(level)) + ": " + std::string(message) + "\n");
  }
};

// The logger of sessions given none: one StderrLogger, made on first use and never replaced.
inline const std::shared_ptr<Logger>& default_logger() {
  static const std::shared_ptr<Logger> logger = std::make_shared<StderrLogger>();
  return logger;
}

}  // namespace kiln
