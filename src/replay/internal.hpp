// The parts of the replay (include/mxscope/replay.hpp) and what they share. run_replay (replay.cpp)
// drives them:
//   plan.cpp        which entries a run replays, and its identity for --resume (run key, input hashes)
//   units.cpp       the units of a run in canonical order, their fragment names; their assignment to ranks
//   processes.cpp   work done together by every rank, and the report when the launcher kills some
//   step.cpp        one step of one (layer, GEMM): the reference, each unit's product, comparison,
//                   cross-step state and attribution, wherever the data lives (src/backend)
//   rows.cpp        the units' cross-step state and their rows of steps.csv and accumulation.csv
//   summary.cpp     the fragments merged into the final files, summary.json's provenance, run.json
//   run_directory.cpp  the run directory's states, lock and stale files
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "mxscope/analysis.hpp"
#include "mxscope/device.hpp"
#include "mxscope/io/atomic_file.hpp"
#include "mxscope/io/dump.hpp"
#include "mxscope/parallel.hpp"
#include "mxscope/replay.hpp"
#include "mxscope/timeline.hpp"

namespace mxscope::replay_internal {

namespace fs = std::filesystem;
using json = nlohmann::ordered_json;

// ---- plan.cpp

// The entries of one layer that the run replays, in step order.
struct layer_plan {
  std::string name;
  std::vector<const io::dump_entry_info*> entries;
};

// The entries the replay selects (--layers, --steps), grouped by layer in dump order, checked
// against the analysis before any work starts: the GEMMs other than Wgrad need w, and every
// strategy's rotation must divide every reduction length it is applied to.
std::vector<layer_plan> select_entries(const replay_options& options, const analysis& parsed,
                                       const io::dump_reader& dump);

// The SHA-256 of every entry file of the plan, by its path relative to the dump, hashed on
// `threads` threads.
std::map<std::string, std::string> hash_inputs(const std::vector<layer_plan>& plan, int threads);

// What must match for --resume to reuse fragments: every input (the analysis text, the manifest
// and each selected entry file by its SHA-256), the filters and the version.
std::string run_key(const analysis& parsed, const io::dump_reader& dump, const replay_options& options,
                    bool attribute, const std::map<std::string, std::string>& input_sha256);

// A file's bytes ("" when it cannot be read).
std::string read_text(const fs::path& path);

// ---- units.cpp

// One (layer, gemm, strategy) unit, by its indices into the plan, the analysis's gemms and its
// strategies. Its canonical index is (layer * gemms + gemm) * strategies + strategy.
struct unit_index {
  std::size_t layer = 0;
  std::size_t gemm = 0;
  std::size_t strategy = 0;
};

// The units of a run in canonical order.
class unit_catalog {
 public:
  unit_catalog(const std::vector<layer_plan>& plan, const analysis& parsed);
  std::size_t count() const { return plan_->size() * per_layer(); }
  std::size_t per_layer() const { return gemms_ * strategies_; }
  std::size_t strategies() const { return strategies_; }
  unit_index at(std::size_t index) const;
  // Its fragment's file name in RUN/.partial.
  std::string fragment_name(std::size_t index) const;
  // "(layer, gemm, strategy)", as messages and fragments name it.
  std::string text(std::size_t index) const;

 private:
  const std::vector<layer_plan>* plan_;
  const analysis* parsed_;
  std::size_t gemms_, strategies_;
};

// This rank's share of the units not finished at the start (done_at_start[i] == '1' for a finished
// unit i): each pending unit weighs the M N K of its layer's entries times its strategy's weight,
// and assign_units cuts the pending units into contiguous runs of nearly equal weight, one per rank.
struct unit_assignment {
  std::vector<bool> mine;           // by unit index: this rank computes it
  std::int64_t units_resumed = 0;   // units finished before this run
  std::int64_t layers_resumed = 0;  // layers whose units were all finished before this run
  std::int64_t entries = 0;         // entries this rank reads: those of the layers it owns a unit of
};
unit_assignment assign_pending(const std::vector<layer_plan>& plan, const analysis& parsed,
                               const std::string& done_at_start, int ranks, int rank);

// ---- processes.cpp

std::string this_host();

// Runs `work` in every process. With one process this is a plain call. With several, when `work`
// throws anywhere every process stops: the lowest failing rank rethrows its exception (so the
// message is printed once) and the others throw reported_elsewhere. Returns every rank's text.
std::vector<std::string> together(process_group& world, const std::function<std::string()>& work);

// When a rank dies (killed, out of memory, its node lost), the launcher terminates the others.
// The lowest rank still alive then names the ranks that are gone and the units they were on,
// from their state files (a process on another host is listed with what it was working on).
void report_termination(const fs::path& partial, int ranks, int rank, const std::string& host,
                        const unit_catalog& units, std::ostream& log);

// ---- summary.cpp

// The unit fragments of RUN/.partial merged back into the order of rows of one process (layer,
// step, gemm, strategy): their steps.csv and accumulation.csv lines go into the two files; their
// summaries and the seconds each strategy took (as measured by whichever rank ran the unit) come
// back. A fragment with the wrong number of lines, no summary or another unit's name is damaged:
// the assembly stops and names it.
struct merged_fragments {
  json units = json::array();
  std::vector<double> strategy_seconds;
  std::vector<json> strategy_stage_seconds;
};
merged_fragments merge_fragments(const std::vector<layer_plan>& plan, const unit_catalog& units,
                                 const fs::path& partial, io::atomic_file& steps_file,
                                 io::atomic_file& accumulation_file);

// summary.json's provenance: the tool, the analysis, the dump and its source, the inputs' hashes,
// the filters, the reference and whether attribution ran.
json summary_provenance(const replay_options& options, const analysis& parsed, const io::dump_reader& dump,
                        const std::map<std::string, std::string>& input_sha256, bool attribute);

// The stage times of run.json's "seconds".
struct run_seconds {
  double total, read, setup, upload, hashing, hashing_wait, reference, strategies;
  double first_read;  // the first step's read on its own (-1: not read ahead; run.json null)
  // The share of the first step's x and dy elements copied to the GPU while they were read
  // (streamed_upload; -1: not streamed; run.json null).
  double first_upload_during_read = -1.0;
  // From the start until the GPU's context was made and until its start-up (the pinned upload
  // slots too) ended, on the background thread (-1: no GPU; run.json null).
  double gpu_context = -1.0, gpu_ready = -1.0;
};

// run.json: where each stage ran, threads and ranks, what was resumed, the stage times, the time
// of every strategy (and of its stages), and with several ranks each rank's share.
json run_record(const std::string& device_option, const std::string& gpu_name, const placement_counts& placed,
                int threads, const replay_outcome& outcome, const run_seconds& seconds, const merged_fragments& merged,
                const analysis& parsed, const std::vector<json>& per_rank);

// run.json's "device_timeline" (replay --kernel-times): the totals of timeline::summary, each
// label's operations, busy and span seconds, and the `top` names with the most seconds.
json timeline_record(const timeline::summary& summary, std::size_t top = 30);

// The four final files, and kernel_times.csv when given, all or none: when one cannot be written (a
// full disk), those already renamed are removed again and .partial stays, so --resume assembles them
// once there is room. Then .partial goes (its run key first: without it the directory is a finished
// run).
void commit_final_files(const fs::path& out, const fs::path& partial, io::atomic_file& steps_file,
                        io::atomic_file& accumulation_file, const json& summary, const json& run,
                        const std::optional<std::string>& kernel_times_csv = std::nullopt);

}  // namespace mxscope::replay_internal
