// Replay: stream the (layer, step) entries of a dump, recompute every GEMM of the analysis under
// every strategy against the reference, and measure how the error grows across steps
// (docs/metrics.md). Results go to RUN/steps.csv, RUN/accumulation.csv and RUN/summary.json.
//
// Determinism: every number depends only on the dump, the analysis and the filters: not on the
// thread count, not on whether the run was interrupted. Work is checkpointed per layer in
// RUN/.partial/ (each fragment written atomically); --resume keeps the finished layers and the
// final files are assembled from the fragments in a fixed order, so a resumed run ends with the
// same bytes as an uninterrupted one. Wall times, thread count and device go to RUN/run.json,
// the one file that is expected to differ between runs.
#pragma once

#include <cstdint>
#include <filesystem>
#include <iosfwd>
#include <optional>
#include <string>
#include <vector>

namespace mxscope {

struct replay_options {
  std::filesystem::path dump;
  std::filesystem::path analysis_path;
  std::filesystem::path out;
  int threads = 0;  // 0: OpenMP's default
  bool resume = false;
  std::optional<std::string> layers;  // ECMAScript regex, matched against the whole layer name
  std::optional<std::string> steps;   // "3,5-9,12"
  bool attribute = false;             // in addition to the analysis's own `attribute`
  std::string device = "cpu";
  bool progress = false;              // progress line on the log stream
  // Stop after this many layers have been completed in this process (for tests of --resume);
  // 0: no limit.
  int stop_after_layers = 0;
};

struct replay_outcome {
  std::int64_t entries = 0;          // (layer, step) entries replayed by this process
  std::int64_t layers_done = 0;      // layers completed by this process
  std::int64_t layers_resumed = 0;   // layers found complete in RUN/.partial
  bool complete = false;             // the final files were written
};

// Parses "3,5-9,12" into a sorted list of steps; throws input_error naming `what`.
std::vector<std::int64_t> parse_step_list(const std::string& text, const std::string& what);

replay_outcome run_replay(const replay_options& options, std::ostream& log);

}  // namespace mxscope
