// What the files of `kiln bench` share beyond bench.h: the clock they time with, name lists for
// messages, and the step that ties a model result to a bandwidth measurement.
#pragma once

#include <chrono>
#include <string>
#include <vector>

#include "bench.h"

namespace kiln::bench {

using Clock = std::chrono::steady_clock;

inline double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// "a, b, c".
inline std::string join(const std::vector<std::string>& names) {
  std::string out;
  for (const auto& n : names) out += (out.empty() ? "" : ", ") + n;
  return out;
}

// Sets the read bandwidth `r` is measured against, and its roofline.
void set_bandwidth(ModelBenchResult& r, double read_bytes_per_s);

}  // namespace kiln::bench
