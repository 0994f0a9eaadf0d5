// Helpers shared by the tests that run replays into temporary directories and start the CLI (or
// mpirun) as child processes.
#pragma once

#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace mxscope::testing {

// An empty directory TMP/mxscope-test-<suite>-<pid>-<name> (removed first if it exists).
inline std::filesystem::path fresh_directory(const std::string& suite, const std::string& name) {
  const std::filesystem::path path = std::filesystem::temp_directory_path() /
                                     ("mxscope-test-" + suite + "-" + std::to_string(::getpid()) + "-" + name);
  std::filesystem::remove_all(path);
  std::filesystem::create_directories(path);
  return path;
}

// The whole file as bytes ("" when it cannot be read).
inline std::string read_text(const std::filesystem::path& path) {
  std::ifstream file(path, std::ios::binary);
  std::ostringstream text;
  text << file.rdbuf();
  return text.str();
}

// Starts arguments[0] with `arguments` as its argv and the given extra environment, stdout and
// stderr going to `log`. Returns the child's pid (-1 when fork fails).
inline pid_t spawn_logged(std::vector<std::string> arguments, const std::filesystem::path& log,
                          const std::vector<std::pair<std::string, std::string>>& environment = {}) {
  const std::string log_path = log.string();
  const pid_t child = ::fork();
  if (child == 0) {
    const int fd = ::open(log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd >= 0) {
      ::dup2(fd, 1);
      ::dup2(fd, 2);
    }
    for (const auto& [name, value] : environment) ::setenv(name.c_str(), value.c_str(), 1);
    std::vector<char*> argv;
    for (auto& argument : arguments) argv.push_back(argument.data());
    argv.push_back(nullptr);
    ::execv(argv[0], argv.data());
    _exit(127);
  }
  return child;
}

// Waits for a child: its exit code, or 128 + the signal that ended it.
inline int wait_for(pid_t child) {
  int status = 0;
  if (::waitpid(child, &status, 0) != child) return -1;
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

}  // namespace mxscope::testing
