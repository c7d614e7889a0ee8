// Stop strings matched across token boundaries, as a streaming filter: text arrives as each token
// is decoded, and what comes out is the text that can be shown now. A stop string is never shown;
// text that might be the start of one is held back until the next pieces decide.
//
//   StopStrings stop({"\n\nUser:", "###"});
//   for (each decoded piece) {
//     StopStrings::Step s = stop.push(piece);
//     emit(s.text);
//     if (s.stopped) break;          // s.matched says which string ended it
//   }
//   emit(stop.finish());             // what was held back, when generation ends for another reason
//
// Matching is on bytes: a stop string that ends mid-way through a multi-byte character still matches
// the bytes it names.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace kiln::pipelines {

class StopStrings {
 public:
  // ValueError for an empty stop string (it would match before any text).
  explicit StopStrings(std::vector<std::string> stops);

  struct Step {
    std::string text;                   // safe to show: contains no stop string and no start of one
    bool stopped = false;               // a stop string matched; nothing after it is shown
    // Which one: the one completed first (ending earliest in the text; the longest of those ending at
    // one place), as generation stops at the token that completes a stop string.
    std::optional<std::string> matched;
  };
  // Adds the next piece of text. After a stop, further pieces give nothing.
  Step push(std::string_view piece);
  // The text still held back (a possible start of a stop string that the end cut short).
  std::string finish();

  const std::vector<std::string>& stops() const { return stops_; }

 private:
  std::vector<std::string> stops_;
  size_t longest_ = 0;
  std::string pending_;  // held back: its every suffix that is a prefix of a stop string is waited on
  bool stopped_ = false;
};

}  // namespace kiln::pipelines
