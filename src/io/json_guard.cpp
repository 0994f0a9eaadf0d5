#include "mxscope/io/json_guard.hpp"

#include <fmt/format.h>

#include <nlohmann/json.hpp>
#include <unordered_set>
#include <vector>

namespace mxscope::io {

namespace {

using json = nlohmann::json;

// A SAX handler that keeps no values: only the open containers and, per open object, its keys.
class guard_handler : public nlohmann::json_sax<json> {
 public:
  explicit guard_handler(int max_depth) : max_depth_(max_depth) {}

  bool null() override { return true; }
  bool boolean(bool) override { return true; }
  bool number_integer(number_integer_t) override { return true; }
  bool number_unsigned(number_unsigned_t) override { return true; }
  bool number_float(number_float_t, const string_t&) override { return true; }
  bool string(string_t&) override { return true; }
  bool binary(binary_t&) override { return true; }
  bool start_object(std::size_t) override {
    keys_.emplace_back();
    return open();
  }
  bool key(string_t& name) override {
    if (keys_.back().insert(name).second) return true;
    issue_ = json_issue{json_issue::kind::duplicate_key, name, "duplicate key"};
    return false;
  }
  bool end_object() override {
    keys_.pop_back();
    --depth_;
    return true;
  }
  bool start_array(std::size_t) override { return open(); }
  bool end_array() override {
    --depth_;
    return true;
  }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception& error) override {
    issue_ = json_issue{json_issue::kind::syntax, "", error.what()};
    return false;
  }

  std::optional<json_issue> issue() const { return issue_; }

 private:
  bool open() {
    if (++depth_ <= max_depth_) return true;
    issue_ = json_issue{json_issue::kind::depth, "", fmt::format("JSON nesting deeper than {} levels", max_depth_)};
    return false;
  }

  int max_depth_;
  int depth_ = 0;  // arrays and objects open
  std::vector<std::unordered_set<std::string>> keys_;
  std::optional<json_issue> issue_;
};

}  // namespace

std::optional<json_issue> find_json_issue(std::string_view text, int max_depth) {
  guard_handler handler(max_depth);
  const bool accepted = json::sax_parse(text, &handler);
  if (!accepted && !handler.issue()) return json_issue{json_issue::kind::syntax, "", "not valid JSON"};
  return handler.issue();
}

}  // namespace mxscope::io
