// JSON from outside kiln (model files, request contexts), parsed so that no input can crash or
// mislead a loader: nesting deeper than a limit is refused while parsing (no deep value is ever
// built, so nothing later recurses over one), a key repeated in one object is an error naming it
// (nlohmann silently keeps the last), and every nlohmann exception becomes a LoadError naming the
// input and the byte. describe() shows a value in an error message without dumping it whole.
#pragma once

#include <cstddef>
#include <filesystem>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

namespace kiln::pipelines::json_input {

// An object member whose value (an object or an array) is read element by element instead of built:
// each member of the object (its key and value) or element of the array (key null) is handed to
// `element`, which may take the value, and is not kept; the member is left empty in the DOM. For tables
// too large to build as JSON only to copy out again (tokenizer.json's model.vocab and model.merges).
// `element` throws LoadError to refuse one, and returns false for a key it has had already (the
// object's keys are its to keep): the duplicate-key error, at the key's byte. A value at `path` that
// is not an object or array is built as usual.
struct StreamedMember {
  std::vector<std::string> path;  // keys from the root, e.g. {"model", "vocab"}
  std::function<bool(const std::string* key, nlohmann::json& value)> element;
};

struct Options {
  int max_depth = 64;                 // arrays and objects nested inside one another
  bool reject_duplicate_keys = true;  // formats: yes; free-form contexts: no
  size_t base_offset = 0;             // added to byte offsets in messages (a header inside a file)
  const char* offset_unit = "byte";   // "file byte" where base_offset makes them file offsets
  std::vector<StreamedMember> streamed = {};  // parse()/parse_file() only, not the ordered forms
};

// The largest JSON file read whole (tokenizer.json of a 256k vocabulary is about 20 MB).
inline constexpr size_t kMaxFileBytes = size_t{512} << 20;

// Parses `bytes`; LoadError "ORIGIN: not valid JSON at byte N: ...", "ORIGIN: nested deeper than 64
// levels at byte N" or "ORIGIN: duplicate key 'K' at byte N". ORIGIN names the input
// ("load_model_info: /m/config.json").
nlohmann::json parse(std::string_view bytes, const std::string& origin, const Options& options = {});
nlohmann::ordered_json parse_ordered(std::string_view bytes, const std::string& origin,
                                     const Options& options = {});

// Reads `file` (at most kMaxFileBytes) and parses it as above; LoadError "ORIGIN: cannot open".
nlohmann::json parse_file(const std::filesystem::path& file, const std::string& origin,
                          const Options& options = {});
nlohmann::ordered_json parse_file_ordered(const std::filesystem::path& file, const std::string& origin,
                                          const Options& options = {});

// `v` as JSON text cut to about `max_chars` ("[1,2,3,..."), built without recursion and without
// serialising more of `v` than is shown; invalid UTF-8 in strings is replaced.
std::string describe(const nlohmann::json& v, size_t max_chars = 60);
std::string describe(const nlohmann::ordered_json& v, size_t max_chars = 60);

}  // namespace kiln::pipelines::json_input
