// Replay: stream the (layer, step) entries of a dump, recompute every GEMM of the analysis under
// every strategy against the reference, and measure how the error grows across steps
// (docs/metrics.md). Results go to RUN/steps.csv, RUN/accumulation.csv and RUN/summary.json.
//
// Units of work: one (layer, gemm, strategy) is one unit, replayed over all its steps. A process
// computes the reference of a (layer, gemm) once per step for all the units it owns there.
//
// Determinism: every number depends only on the dump, the analysis and the filters: not on the
// thread count, not on the number of processes, not on whether the run was interrupted. Work is
// checkpointed per unit in RUN/.partial/ (one fragment file per unit, written atomically);
// --resume keeps the finished units and the final files are assembled from the fragments in a
// fixed order (steps.csv rows by layer, step, gemm, strategy), so a resumed or distributed run
// ends with the same bytes as an uninterrupted single-process one. Wall times, thread count,
// ranks and device go to RUN/run.json, the one file that is expected to differ between runs (and
// with kernel_times, RUN/kernel_times.csv).
//
// Several processes (docs/scaling.md): with a process_group of N ranks, the units still to do are
// split into N contiguous runs of nearly equal estimated cost (assign_units); each rank replays
// its own and writes their fragments to the shared RUN/.partial; rank 0 assembles the final files.
#pragma once

#include <cstdint>
#include <filesystem>
#include <iosfwd>
#include <optional>
#include <string>
#include <vector>

namespace mxscope {

class process_group;

struct replay_options {
  std::filesystem::path dump;
  std::filesystem::path analysis_path;
  std::filesystem::path out;
  int threads = 0;  // 0: OpenMP's default
  bool resume = false;
  std::optional<std::string> layers;  // ECMAScript regex, matched against the whole layer name
  std::optional<std::string> steps;   // "3,5-9,12"
  bool attribute = false;             // in addition to the analysis's own `attribute`
  // --device gpu, one process: every kernel, copy and memset of this process's work timed by device
  // events (include/mxscope/timeline.hpp), written to RUN/kernel_times.csv with a summary in
  // run.json's "device_timeline". The other outputs do not change.
  bool kernel_times = false;
  std::string device = "cpu";
  bool progress = false;              // progress line on the log stream, rewritten in place (a terminal)
  // > 0: a progress line on the log stream at most this often, and one at the end (logs that are
  // not a terminal); ignored when `progress` is set.
  double progress_log_seconds = 0.0;
  // Stop after this many layers have been completed in this process (for tests of --resume);
  // 0: no limit.
  int stop_after_layers = 0;
  // The processes of the run (not owned); nullptr: this process alone.
  process_group* processes = nullptr;
  // The GPU this process uses with --device gpu: its rank among the processes of its node
  // (process_group::local_rank), 0 for a single process. A backend takes it modulo the number of
  // devices it sees, which also covers launchers that give each rank one visible device.
  int device_index = 0;
};

struct replay_outcome {
  std::int64_t entries = 0;          // (layer, step) entries replayed by this process
  std::int64_t layers_done = 0;      // layers this process completed its units of
  std::int64_t layers_resumed = 0;   // layers whose units were all found complete in RUN/.partial
  std::int64_t units_done = 0;       // (layer, gemm, strategy) units completed by this process
  std::int64_t units_resumed = 0;    // units found complete in RUN/.partial
  std::int64_t units_total = 0;      // units of the whole run
  bool complete = false;             // the final files were written (by this process or rank 0)
  bool already_finished = false;     // --resume found a finished run of the same key: nothing written
};

// Parses "3,5-9,12" into a sorted list of steps; throws input_error naming `what`.
std::vector<std::int64_t> parse_step_list(const std::string& text, const std::string& what);

// The static assignment of units to `ranks` processes: units in their canonical order (layer,
// gemm, strategy) are cut into contiguous runs of nearly equal total cost. Unit i, of cost c_i
// with c_0 + ... + c_{i-1} = P_i before it and total C, goes to rank floor(ranks (P_i + c_i / 2) / C)
// (every unit to rank 0 when C = 0): a rank's load is within the largest unit's cost of C / ranks; a
// rank touches few (layer, gemm) groups, so it reads few entries and computes few references.
// Replay's cost of a unit is the sum over its steps of M N K (docs/scaling.md).
std::vector<int> assign_units(const std::vector<std::uint64_t>& costs, int ranks);

replay_outcome run_replay(const replay_options& options, std::ostream& log);

}  // namespace mxscope
