// One linear pass over JSON text before it is turned into a tree: the syntax, the nesting depth
// and keys repeated within one object. nlohmann's parser keeps the last of two equal keys, and the
// code that walks or prints a tree recurses once per level, so every reader of untrusted JSON
// checks the text here first and then parses it without a callback (nlohmann's callback parser
// scans the enclosing container at every closing bracket, which is quadratic in its length).
#pragma once

#include <optional>
#include <string>
#include <string_view>

namespace mxscope::io {

struct json_issue {
  enum class kind { syntax, depth, duplicate_key };
  kind what = kind::syntax;
  std::string key;      // the repeated key (duplicate_key)
  std::string message;  // what is wrong, in words
};

// The first problem of `text`, or nothing when it is valid JSON nested at most `max_depth`
// arrays and objects deep with no key twice in one object.
std::optional<json_issue> find_json_issue(std::string_view text, int max_depth);

}  // namespace mxscope::io
