// The run directory of a replay (docs/cli.md): what makes a directory recognisably mxscope's, the
// lock that keeps a second replay out of it, and which of its files the replay may touch.
#pragma once

#include <filesystem>
#include <string>
#include <string_view>

namespace mxscope::run_directory {

// RUN/.mxscope-run marks a run directory and holds the run key (the identity --resume checks).
inline constexpr const char* marker_name = ".mxscope-run";
// The final files a finished run holds (run.json last: it is written after the others).
inline constexpr const char* final_names[] = {"steps.csv", "accumulation.csv", "summary.json", "run.json"};

enum class run_state { empty, interrupted, finished };

// An exclusive lock (flock) on the directory itself, held for the life of the object: a second
// replay on the same --out is refused instead of racing the first over the same files.
class directory_lock {
 public:
  explicit directory_lock(const std::filesystem::path& directory);
  ~directory_lock();
  directory_lock(const directory_lock&) = delete;
  directory_lock& operator=(const directory_lock&) = delete;

 private:
  int descriptor_ = -1;
};

// Creates `out` when it does not exist. Refuses (input_error) an `out` that is not a directory, is
// the dump directory or lies inside it, or holds files without being a run directory of mxscope.
void claim(const std::filesystem::path& out, const std::filesystem::path& dump);

// What `out` (claimed) holds. A directory whose interrupted state (.partial/run-key.json) is
// there is interrupted even when final files exist: the final assembly did not finish.
run_state state_of(const std::filesystem::path& out);

// Removes what earlier processes of this tool left behind and nothing else: temporary files of its
// own outputs (NAME.tmp.<pid>) in `out` and in `out`/.partial, and the MPI ranks' state files
// (rank-<r>.json) and stop file in `out`/.partial.
void remove_stale_files(const std::filesystem::path& out);

// True for the names remove_stale_files removes from `directory_name` ("." for the run directory,
// ".partial" for the checkpoint directory).
bool is_stale_name(std::string_view name, bool in_partial);

}  // namespace mxscope::run_directory
