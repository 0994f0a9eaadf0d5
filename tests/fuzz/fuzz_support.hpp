// Shared by the libFuzzer targets whose readers take a directory: one scratch directory per fuzzing
// process, whose files each input rewrites.
#pragma once

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>
#include <vector>

namespace mxscope::fuzzing {

inline const std::filesystem::path& scratch_directory(const char* target) {
  static const std::filesystem::path directory = [target] {
    const std::filesystem::path path =
        std::filesystem::temp_directory_path() / (std::string(target) + "-" + std::to_string(::getpid()));
    std::filesystem::remove_all(path);
    std::filesystem::create_directories(path);
    return path;
  }();
  return directory;
}

inline void write_file(const std::filesystem::path& path, std::string_view bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// Splits an input at the separator line "\n--8<--\n" into at most `parts` pieces (the rest empty).
inline std::vector<std::string_view> split_parts(std::string_view bytes, std::size_t parts) {
  constexpr std::string_view separator = "\n--8<--\n";
  std::vector<std::string_view> out;
  while (out.size() + 1 < parts) {
    const std::size_t at = bytes.find(separator);
    if (at == std::string_view::npos) break;
    out.push_back(bytes.substr(0, at));
    bytes.remove_prefix(at + separator.size());
  }
  out.push_back(bytes);
  out.resize(parts);
  return out;
}

[[noreturn]] inline void broken(const char* what) {
  std::fprintf(stderr, "invariant broken: %s\n", what);
  std::abort();
}

}  // namespace mxscope::fuzzing
