// json_input: the parser every loader reads outside JSON with. Hostile inputs (deep nesting,
// repeated keys, numbers that overflow a double, broken bytes) are LoadErrors naming the input and
// the byte, never a crash or a raw nlohmann exception; describe() never dumps a whole value.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "kiln/errors.h"
#include "pipelines/json_input.h"
#include "test_util.h"

using namespace kiln;
using namespace kiln::pipelines;
using kiln::testing::error_message;
using kiln::testing::expect_error;
using nlohmann::json;
namespace fs = std::filesystem;

namespace {

std::string nested_arrays(size_t depth) { return std::string(depth, '[') + std::string(depth, ']'); }

// {"a":{"a":...{"a":1}...}}
std::string nested_objects(size_t depth) {
  std::string s;
  for (size_t i = 0; i < depth; ++i) s += R"({"a":)";
  return s + "1" + std::string(depth, '}');
}

TEST(JsonInput, ParsesWhatNlohmannParses) {
  const json v = json_input::parse(R"({"a": [1, 2.5, "x", null, true], "b": {"c": -3}})", "t");
  EXPECT_EQ(v, json::parse(R"({"a": [1, 2.5, "x", null, true], "b": {"c": -3}})"));
  const nlohmann::ordered_json o = json_input::parse_ordered(R"({"z": 1, "a": 2})", "t");
  EXPECT_EQ(o.begin().key(), "z");
}

TEST(JsonInput, NestingUpToTheLimitParses) {
  json_input::Options options;
  options.max_depth = 64;
  EXPECT_NO_THROW(json_input::parse(nested_arrays(64), "t", options));
  EXPECT_NO_THROW(json_input::parse(nested_objects(64), "t", options));
  EXPECT_EQ(error_message<LoadError>([&] { json_input::parse(nested_arrays(65), "t", options); }),
            "t: nested deeper than 64 levels at byte 64");
}

TEST(JsonInput, DeepNestingIsRefusedWhileParsing) {
  // 100k levels (200 KB): the refusal comes at level 65, so the time does not grow with the depth and
  // no deep value is built (which would overflow the stack when dumped or freed recursively).
  for (const std::string& text : {nested_arrays(100'000), nested_objects(100'000),
                                  R"({"ok": 1, "deep": )" + nested_arrays(100'000) + "}"}) {
    const auto start = std::chrono::steady_clock::now();
    expect_error<LoadError>([&] { json_input::parse(text, "deep.json"); },
                            {"deep.json: nested deeper than 64 levels at byte "});
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(1));
  }
}

TEST(JsonInput, DuplicateKeyIsLoadErrorNamingItAndTheByte) {
  const std::string text = R"({"a": 1, "b": {"c": 1, "c": 2}})";
  EXPECT_EQ(error_message<LoadError>([&] { json_input::parse(text, "f.json"); }),
            fmt::format("f.json: duplicate key \"c\" at byte {}", text.find(R"("c": 2)") + 2));
  expect_error<LoadError>([] { json_input::parse(R"({"w": 1, "w": 1})", "f.json"); },
                          {"duplicate key \"w\""});
  expect_error<LoadError>([] { json_input::parse_ordered(R"([{"k": 1, "k": 2}])", "f.json"); },
                          {"duplicate key \"k\""});
}

// A tokenizer_config.json's added_tokens_decoder: thousands of members, each an object (the shape that
// made nlohmann's callback parser walk the whole parent at every member's end). The same value as
// nlohmann's own parser, and a repeated key after them all still named at its byte.
TEST(JsonInput, ObjectOfManyObjectsParsesAsNlohmannAndKeepsCheckingKeys) {
  std::string text = "{";
  for (int i = 0; i < 20000; ++i)
    text += fmt::format(R"({}"{}": {{"content": "<t{}>", "special": {}}})", i ? ", " : "", i, i, i % 2 ? "true" : "false");
  EXPECT_EQ(json_input::parse(text + "}", "t"), json::parse(text + "}"));
  const std::string repeated = text + R"(, "17": {}})";
  EXPECT_EQ(error_message<LoadError>([&] { json_input::parse(repeated, "f.json"); }),
            fmt::format("f.json: duplicate key \"17\" at byte {}", repeated.rfind(R"("17")") + 3));
}

TEST(JsonInput, SameKeyInDifferentObjectsIsNoDuplicate) {
  EXPECT_NO_THROW(json_input::parse(R"([{"a": 1}, {"a": 2}])", "t"));
  EXPECT_NO_THROW(json_input::parse(R"({"a": {"a": {"a": 1}}, "b": {"a": 2}})", "t"));
}

TEST(JsonInput, DuplicateKeysCanBeAllowed) {
  json_input::Options options;
  options.reject_duplicate_keys = false;
  EXPECT_EQ(json_input::parse(R"({"a": 1, "a": 2})", "t", options), json::parse(R"({"a": 2})"));
}

TEST(JsonInput, NumberOverflowIsLoadErrorNotOutOfRange) {
  for (const char* text : {R"({"x": 1e400})", "[-1e400]", "1e99999999999"}) {
    const std::string msg = error_message<LoadError>([&] { json_input::parse(text, "config.json"); });
    EXPECT_NE(msg.find("config.json: not valid JSON at byte "), std::string::npos) << msg;
    EXPECT_NE(msg.find("number overflow"), std::string::npos) << msg;
  }
  // nlohmann quotes the whole number; the message quotes its start.
  const std::string msg =
      error_message<LoadError>([&] { json_input::parse(std::string(1 << 20, '9'), "n"); });
  EXPECT_NE(msg.find("number overflow parsing '999"), std::string::npos) << msg;
  EXPECT_LT(msg.size(), 300u);
  // Integers too big for int64/uint64 are doubles, as in nlohmann; only a double overflow is refused.
  EXPECT_TRUE(json_input::parse("123456789012345678901234567890", "t").is_number_float());
}

TEST(JsonInput, EveryMalformedInputIsLoadError) {
  for (const std::string& text :
       std::vector<std::string>{"", "   ", "{", R"({"a":)", R"({"a" 1})", "[1,]", "\"\xff\"", "\"\xc3\"",
                                "nul", "{} x", std::string("\"a\0b\"", 5), "\"\\ud800\""}) {
    const std::string msg = error_message<LoadError>([&] { json_input::parse(text, "in.json"); });
    EXPECT_NE(msg.find("in.json: not valid JSON at byte "), std::string::npos) << msg;
  }
}

TEST(JsonInput, OffsetsCanBeFileOffsets) {
  json_input::Options options;
  options.base_offset = 8;
  options.offset_unit = "file byte";
  EXPECT_EQ(error_message<LoadError>([&] { json_input::parse(R"({"a":1,"a":2})", "h", options); }),
            "h: duplicate key \"a\" at file byte 17");
  expect_error<LoadError>([&] { json_input::parse("[x]", "h", options); },
                          {"h: not valid JSON at file byte 9"});
}

TEST(JsonInput, FilesAreReadWhole) {
  const fs::path file = fs::temp_directory_path() / fmt::format("kiln_json_input_{}.json", ::getpid());
  std::ofstream(file) << R"({"k": [1, 2]})";
  EXPECT_EQ(json_input::parse_file(file, "x"), json::parse(R"({"k": [1, 2]})"));
  EXPECT_EQ(json_input::parse_file_ordered(file, "x"), nlohmann::ordered_json::parse(R"({"k": [1, 2]})"));
  fs::remove(file);
  EXPECT_EQ(error_message<LoadError>([&] { json_input::parse_file(file, "x: " + file.string()); }),
            "x: " + file.string() + ": cannot open");
  expect_error<LoadError>([&] { json_input::parse_file(fs::temp_directory_path(), "dir"); },
                          {"dir: cannot open"});
}

TEST(JsonInput, DescribeShowsSmallValuesWhole) {
  EXPECT_EQ(json_input::describe(json::parse(R"({"a":[1,{"b":null}],"c":"x"})")),
            R"({"a":[1,{"b":null}],"c":"x"})");
  EXPECT_EQ(json_input::describe(json::array()), "[]");
  EXPECT_EQ(json_input::describe(json::object()), "{}");
  EXPECT_EQ(json_input::describe(json(2.5)), "2.5");
  EXPECT_EQ(json_input::describe(nlohmann::ordered_json::parse(R"({"z":1,"a":[]})")), R"({"z":1,"a":[]})");
}

TEST(JsonInput, DescribeCutsLongValues) {
  json big = json::array();
  for (int i = 0; i < 100'000; ++i) big.push_back(i);
  const std::string d = json_input::describe(big);
  EXPECT_EQ(d.size(), 60u);
  EXPECT_EQ(d.substr(0, 10), "[0,1,2,3,4");
  EXPECT_EQ(d.substr(57), "...");
  EXPECT_EQ(json_input::describe(json(std::string(1'000'000, 'x')), 20), "\"xxxxxxxxxxxxxxxx...");
  // A string cut inside a multi-byte character is not left ending in half of it.
  const std::string cut = json_input::describe(json(std::string(100, 'a') + "\xc3\xa9"), 10);
  EXPECT_EQ(cut, "\"aaaaaa...");
  EXPECT_EQ(json_input::describe(json("caf\xc3\xa9\xc3\xa9\xc3\xa9\xc3\xa9"), 9), "\"caf\xc3\xa9...");
}

TEST(JsonInput, DescribeOfADeepValueDoesNotRecurse) {
  // Built by hand (the parser would refuse it): 200k levels, which a recursive dump() would overflow
  // the stack on.
  json deep = json::array();
  for (int i = 0; i < 200'000; ++i) deep = json::array({std::move(deep)});
  EXPECT_EQ(json_input::describe(deep, 10), "[[[[[[[...");
}

TEST(JsonInput, DescribeReplacesInvalidUtf8) {
  json s = std::string("a\xff") + "b";  // only built by hand: the parser refuses invalid UTF-8
  EXPECT_EQ(json_input::describe(s),
            "\"a\xef\xbf\xbd"
            "b\"");
}

}  // namespace

// Members named by path are handed over element by element (object members with their keys, array
// elements without), and left empty in the DOM; the same key path elsewhere, or a scalar at the path,
// is built as usual; the depth limit counts the streamed levels.
TEST(JsonInput, StreamedMembersAreHandedOverElementByElement) {
  const std::string text =
      R"({"a": {"b": {"x": 1, "y": [2, {"z": 3}]}, "c": [1, {"d": 2}, "s"], "n": 7},)"
      R"( "b": {"a": {"b": {"deep": true}}}, "s": 5})";
  std::vector<std::pair<std::string, json>> members;
  std::vector<json> elements;
  json_input::Options options;
  options.streamed = {
      {{"a", "b"},
       [&](const std::string* key, json& value) {
         EXPECT_NE(key, nullptr);
         members.emplace_back(key ? *key : "", std::move(value));
         return true;
       }},
      {{"a", "c"},
       [&](const std::string* key, json& value) {
         EXPECT_EQ(key, nullptr);
         elements.push_back(std::move(value));
         return true;
       }},
      {{"s"}, [&](const std::string*, json&) -> bool { ADD_FAILURE() << "a scalar is not streamed"; return true; }},
  };
  const json doc = json_input::parse(text, "t", options);
  ASSERT_EQ(members.size(), 2u);
  EXPECT_EQ(members[0], (std::pair<std::string, json>{"x", 1}));
  EXPECT_EQ(members[1].first, "y");
  EXPECT_EQ(members[1].second, json::parse(R"([2, {"z": 3}])"));
  EXPECT_EQ(elements, (std::vector<json>{1, json::parse(R"({"d": 2})"), "s"}));
  json expected = json::parse(text);
  expected["a"]["b"] = json::object();
  expected["a"]["c"] = json::array();
  EXPECT_EQ(doc, expected);

  // A key the handler has had: the duplicate-key error, at the key's closing quote.
  json_input::Options once;
  once.streamed = {{{"v"}, [seen = std::vector<std::string>()](const std::string* key, json&) mutable {
                      if (std::find(seen.begin(), seen.end(), *key) != seen.end()) return false;
                      seen.push_back(*key);
                      return true;
                    }}};
  const std::string dup = R"({"v": {"p": 1, "q": 2, "p": 3}})";
  EXPECT_EQ(error_message<LoadError>([&] { json_input::parse(dup, "t", once); }),
            fmt::format("t: duplicate key \"p\" at byte {}", dup.rfind("\"p\"") + 2));

  // Depth as when built: the root, a, b (streamed) and x's list are four levels.
  for (json_input::Options limit : {options, json_input::Options{}}) {
    limit.max_depth = 3;
    EXPECT_EQ(error_message<LoadError>([&] { json_input::parse(R"({"a": {"b": {"x": [1]}}})", "t", limit); }),
              "t: nested deeper than 3 levels at byte 18");
    EXPECT_NO_THROW(json_input::parse(R"({"a": {"b": {"x": 1}}})", "t", limit));
  }
}
