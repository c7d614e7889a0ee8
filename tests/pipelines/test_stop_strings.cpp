// StopStrings: stop strings matched across the pieces text arrives in, never shown, with what might
// start one held back; checked piece by piece and against a whole-text reference for every split.
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "kiln/errors.h"
#include "kiln/pipelines/stop_strings.h"
#include "test_util.h"

namespace {

using kiln::pipelines::StopStrings;
using kiln::testing::expect_error;

TEST(StopStrings, AStopSpanningTwoPiecesIsNeverShown) {
  StopStrings stop({"###"});
  StopStrings::Step a = stop.push("hello #");
  EXPECT_EQ(a.text, "hello ");  // "#" might start the stop string: held back
  EXPECT_FALSE(a.stopped);
  StopStrings::Step b = stop.push("## and more");
  EXPECT_EQ(b.text, "");
  EXPECT_TRUE(b.stopped);
  EXPECT_EQ(b.matched, "###");
  EXPECT_EQ(stop.push("later").text, "");  // nothing after a stop
  EXPECT_EQ(stop.finish(), "");
}

TEST(StopStrings, HeldBackTextIsShownOnceItCannotStartAStop) {
  StopStrings stop({"\n\nUser:"});
  EXPECT_EQ(stop.push("one\n").text, "one");
  EXPECT_EQ(stop.push("\nUs").text, "");
  EXPECT_EQ(stop.push("ually").text, "\n\nUsually");
  EXPECT_EQ(stop.push(" done\n").text, " done");
  EXPECT_EQ(stop.finish(), "\n");  // the end of generation releases what was held
}

TEST(StopStrings, TheStopCompletedFirstWinsAndTheLongestAtATie) {
  StopStrings first({"cd", "bcd", "bc"});
  StopStrings::Step s = first.push("abcd");
  EXPECT_EQ(s.text, "a");
  EXPECT_EQ(s.matched, "bc");  // ends at 3; "cd" and "bcd" end at 4
  StopStrings tie({"c", "bc"});
  s = tie.push("abcd");
  EXPECT_EQ(s.text, "a");
  EXPECT_EQ(s.matched, "bc");  // both end at 3: the longer, so none of it is shown
}

TEST(StopStrings, AnEmptyStopStringIsAValueError) {
  expect_error<kiln::ValueError>([] { StopStrings({"ok", ""}); }, {"stop string 1", "empty"});
}

// Every way of cutting a text into pieces gives what a whole-text search gives: the text before the
// stop that ends earliest (the longest at a tie), or all of it (shown as pushed, or at finish()).
TEST(StopStrings, AnySplitOfTheTextGivesTheWholeTextAnswer) {
  const std::vector<std::string> stops = {"aab", "ba", "abab"};
  std::mt19937 rng(3);
  for (int trial = 0; trial < 2000; ++trial) {
    std::string text;
    const int length = static_cast<int>(rng() % 12);
    for (int i = 0; i < length; ++i) text += "ab"[rng() % 2];
    size_t first = std::string::npos, first_end = std::string::npos;
    for (const auto& s : stops) {
      const size_t at = text.find(s);
      if (at == std::string::npos) continue;
      if (at + s.size() < first_end || (at + s.size() == first_end && at < first)) first_end = at + s.size(), first = at;
    }
    const std::string expected = first == std::string::npos ? text : text.substr(0, first);

    StopStrings stop(stops);
    std::string shown;
    bool stopped = false;
    for (size_t at = 0; at < text.size() && !stopped;) {
      const size_t n = std::min<size_t>(1 + rng() % 4, text.size() - at);
      StopStrings::Step step = stop.push(std::string_view(text).substr(at, n));
      shown += step.text;
      stopped = step.stopped;
      at += n;
    }
    if (!stopped) shown += stop.finish();
    ASSERT_EQ(shown, expected) << "text '" << text << "'";
    ASSERT_EQ(stopped, first != std::string::npos) << "text '" << text << "'";
  }
}

}  // namespace
