// A fresh directory under the system's temporary directory, removed with everything in it when the
// object goes (tests that write files). One per object; the name carries the label, the process id
// and a counter, so concurrent test processes never share one.
#pragma once

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <filesystem>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

#include <fmt/format.h>

namespace mxscope::testing {

class temporary_directory {
 public:
  explicit temporary_directory(std::string_view label = "test") {
    static std::atomic<int> counter{0};
    path_ = std::filesystem::temp_directory_path() /
            fmt::format("mxscope-{}-{}-{}", label, static_cast<long>(::getpid()), counter.fetch_add(1));
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  temporary_directory(const temporary_directory&) = delete;
  temporary_directory& operator=(const temporary_directory&) = delete;
  ~temporary_directory() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }

  const std::filesystem::path& path() const { return path_; }
  std::filesystem::path operator/(std::string_view name) const { return path_ / name; }
  // The same path as a string, for argument lists.
  std::string file(std::string_view name) const { return (path_ / name).string(); }
  // The names directly inside, sorted.
  std::vector<std::string> listing() const {
    std::vector<std::string> names;
    for (const auto& entry : std::filesystem::directory_iterator(path_)) names.push_back(entry.path().filename().string());
    std::sort(names.begin(), names.end());
    return names;
  }

 private:
  std::filesystem::path path_;
};

}  // namespace mxscope::testing
