#include "run_directory.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <regex>
#include <system_error>

#include "mxscope/errors.hpp"
#include "mxscope/io/safetensors.hpp"

namespace mxscope::run_directory {

namespace fs = std::filesystem;

namespace {

// `inner` is `outer` or lies below it, comparing resolved paths.
bool is_within(const fs::path& inner, const fs::path& outer) {
  std::error_code error;
  const fs::path a = fs::weakly_canonical(inner, error);
  if (error) return false;
  const fs::path b = fs::weakly_canonical(outer, error);
  if (error) return false;
  const auto mismatch = std::mismatch(b.begin(), b.end(), a.begin(), a.end());
  return mismatch.first == b.end();
}

bool is_empty_directory(const fs::path& directory) {
  std::error_code error;
  return fs::directory_iterator(directory, error) == fs::directory_iterator();
}

}  // namespace

directory_lock::directory_lock(const fs::path& directory) {
  descriptor_ = ::open(directory.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (descriptor_ < 0) {
    throw input_error(fmt::format("{}: cannot open the run directory: {}", directory.string(),
                                  std::generic_category().message(errno)));
  }
  if (::flock(descriptor_, LOCK_EX | LOCK_NB) != 0) {
    const int code = errno;
    ::close(descriptor_);
    descriptor_ = -1;
    if (code == EWOULDBLOCK) {
      throw input_error(fmt::format("{}: another mxscope replay is writing to this run directory", directory.string()));
    }
    throw input_error(fmt::format("{}: cannot lock the run directory: {}", directory.string(),
                                  std::generic_category().message(code)));
  }
}

directory_lock::~directory_lock() {
  if (descriptor_ >= 0) ::close(descriptor_);  // closing the descriptor releases the lock
}

void claim(const fs::path& out, const fs::path& dump) {
  const std::string label = out.string();
  if (is_within(out, dump)) {
    throw input_error(fmt::format("{}: --out is the dump directory {} or lies inside it; choose a run directory "
                                  "elsewhere",
                                  label, dump.string()));
  }
  std::error_code error;
  const fs::file_status status = fs::symlink_status(out, error);
  if (fs::exists(status) && !fs::is_directory(fs::status(out, error))) {
    throw input_error(fmt::format("{}: --out exists and is not a directory", label));
  }
  if (!fs::exists(status)) {
    fs::create_directories(out, error);
    if (error) throw input_error(fmt::format("{}: cannot create the run directory: {}", label, error.message()));
    return;
  }
  const bool own = fs::exists(out / marker_name) || fs::exists(out / ".partial" / "run-key.json");
  if (!own && !is_empty_directory(out)) {
    throw input_error(fmt::format("{}: --out holds files and is not a run directory of mxscope (it has no {}); "
                                  "choose an empty or new directory",
                                  label, marker_name));
  }
}

run_state state_of(const fs::path& out) {
  if (fs::exists(out / ".partial" / "run-key.json")) return run_state::interrupted;
  const bool finished = std::all_of(std::begin(final_names), std::end(final_names),
                                    [&](const char* name) { return fs::exists(out / name); });
  return finished && fs::exists(out / marker_name) ? run_state::finished : run_state::empty;
}

bool is_stale_name(std::string_view name, bool in_partial) {
  static const std::regex run_temporary(
      R"((steps\.csv|accumulation\.csv|summary\.json|run\.json|\.mxscope-run)\.tmp\.[0-9]+)");
  static const std::regex partial_stale(
      R"(((rank-[0-9]{5,}\.json|stop)(\.tmp\.[0-9]+)?)|((run-key\.json|[0-9]{5,}-[A-Za-z0-9._-]*\.unit)\.tmp\.[0-9]+))");
  if (name.size() > 200) return false;
  const std::string text(name);
  return std::regex_match(text, in_partial ? partial_stale : run_temporary);
}

void remove_stale_files(const fs::path& out) {
  std::error_code ignored;
  for (const auto& [directory, in_partial] : {std::pair{out, false}, std::pair{out / ".partial", true}}) {
    for (const auto& item : fs::directory_iterator(directory, ignored)) {
      if (is_stale_name(item.path().filename().string(), in_partial)) fs::remove(item.path(), ignored);
    }
  }
}

}  // namespace mxscope::run_directory
