// Helpers for tests that run the Python capture tools: a per-test temporary directory and running
// /usr/bin/python3 (Debian's interpreter, where tools/bootstrap installs python3-torch; a python3
// found first on PATH may be a different interpreter without torch).
#pragma once

#include <fmt/format.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "support/temporary_directory.hpp"

namespace python_runner {

inline constexpr const char* interpreter = "/usr/bin/python3";

inline std::string read_text(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

inline void write_text(const std::filesystem::path& path, const std::string& contents) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << contents;
}

// Single-quotes a shell argument.
inline std::string quoted(const std::string& text) {
  std::string out = "'";
  for (const char c : text) {
    if (c == '\'') {
      out += "'\\''";
    } else {
      out += c;
    }
  }
  return out + "'";
}

struct result {
  int exit_code = -1;
  std::string output;  // stdout and stderr together
};

// Runs `interpreter script args...` with stdout and stderr captured into `log`.
inline result run_script(const std::filesystem::path& script, const std::vector<std::string>& args,
                         const std::filesystem::path& log) {
  std::string command = fmt::format("{} {}", interpreter, quoted(script.string()));
  for (const auto& arg : args) command += fmt::format(" {}", quoted(arg));  // (" " + string trips GCC 12's -Wrestrict)
  command += fmt::format(" > {} 2>&1", quoted(log.string()));
  const int status = std::system(command.c_str());
  result out;
  out.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  out.output = read_text(log);
  return out;
}

// Empty when the interpreter imports torch; otherwise the reason, for a failure message.
inline std::string torch_problem(const std::filesystem::path& scratch) {
  const auto log = scratch / "torch-probe.log";
  const std::string command = fmt::format("{} -c 'import torch, numpy' > {} 2>&1", interpreter, quoted(log.string()));
  const int status = std::system(command.c_str());
  if (WIFEXITED(status) && WEXITSTATUS(status) == 0) return {};
  return fmt::format(
      "{} cannot import torch and numpy; run tools/bootstrap, which installs python3-torch and python3-numpy.\n{}",
      interpreter, read_text(log));
}

// A fresh directory removed at the end of the scope.
using temporary_directory = mxscope::testing::temporary_directory;

}  // namespace python_runner
