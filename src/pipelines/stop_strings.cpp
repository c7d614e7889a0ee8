#include "kiln/pipelines/stop_strings.h"

#include <algorithm>
#include <utility>

#include <fmt/format.h>

#include "kiln/errors.h"

namespace kiln::pipelines {

StopStrings::StopStrings(std::vector<std::string> stops) : stops_(std::move(stops)) {
  for (size_t i = 0; i < stops_.size(); ++i) {
    if (stops_[i].empty()) throw ValueError(fmt::format("stop strings: stop string {} is empty", i));
    longest_ = std::max(longest_, stops_[i].size());
  }
}

StopStrings::Step StopStrings::push(std::string_view piece) {
  Step step;
  if (stopped_) return step;
  std::string text = pending_;
  text.append(piece);
  pending_.clear();
  // The stop string completed first: the one ending earliest in the text (the longest of those ending
  // there), as generation would have stopped at the token that completed it.
  size_t best_end = std::string::npos, best = 0;
  const std::string* matched = nullptr;
  for (const std::string& stop : stops_) {
    const size_t at = text.find(stop);
    if (at == std::string::npos) continue;
    const size_t end = at + stop.size();
    if (end < best_end || (end == best_end && at < best)) best_end = end, best = at, matched = &stop;
  }
  if (matched) {
    text.resize(best);
    step.text = std::move(text);
    step.stopped = stopped_ = true;
    step.matched = *matched;
    return step;
  }
  // Hold back the longest end of the text that a stop string starts with: the next piece decides it.
  size_t hold = 0;
  for (const std::string& stop : stops_)
    for (size_t k = std::min(stop.size() - 1, text.size()); k > hold; --k)
      if (std::string_view(text).substr(text.size() - k) == std::string_view(stop).substr(0, k)) {
        hold = k;
        break;
      }
  pending_ = text.substr(text.size() - hold);
  text.resize(text.size() - hold);
  step.text = std::move(text);
  return step;
}

std::string StopStrings::finish() {
  if (stopped_) return {};
  return std::exchange(pending_, std::string());
}

}  // namespace kiln::pipelines
