// run_replay (include/mxscope/replay.hpp): the start-up shared by every rank, the run directory and
// its resume protocol, this rank's layers step by step, and the final report and assembly. The
// parts it drives are listed in internal.hpp.
#include "mxscope/replay.hpp"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <future>
#include <map>
#include <memory>
#include <optional>
#include <ostream>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "../backend/backend.hpp"
#include "internal.hpp"
#include "mxscope/errors.hpp"
#include "mxscope/io/atomic_file.hpp"
#include "rows.hpp"
#include "run_directory.hpp"
#include "step.hpp"
#include "streamed_upload.hpp"

namespace mxscope {

namespace {

using namespace replay_internal;
using namespace replay_rows;  // the units' state and their rows (rows.hpp)
using clock_type = std::chrono::steady_clock;

double seconds_since(clock_type::time_point from) {
  return std::chrono::duration<double>(clock_type::now() - from).count();
}

// One process's part of a replay. Everything up to the work (start, claim_directory) is the same
// in every process, and a bad input there stops all of them; then each rank replays the layers it
// owns a unit of and reports, and rank 0 assembles the final files when every unit is done.
class replay_run {
 public:
  replay_run(const replay_options& options, std::ostream& log);
  replay_outcome run();

 private:
  void start();
  std::string claim_directory();
  void write_run_key(const std::string& key);
  void settle_run_key();
  void write_state(const std::string& state, const std::vector<std::string>& units) const;
  void report_progress();
  void replay_layer(std::size_t layer_index);
  std::vector<gemm_state> layer_states(const std::vector<std::size_t>& owned,
                                       std::vector<std::vector<std::string>>& unit_texts,
                                       std::vector<std::vector<std::size_t>>& unit_indices) const;
  void replay_steps(const layer_plan& layer, std::vector<gemm_state>& gemms,
                    const std::vector<std::vector<std::string>>& unit_texts, std::string& doing);
  void write_fragments(const layer_plan& layer, const std::vector<gemm_state>& gemms,
                       const std::vector<std::vector<std::size_t>>& unit_indices);
  void ready_gpu();
  io::dump_read_options read_options() const;
  void start_first_read();
  std::vector<json> gather_reports();
  void assemble(const std::vector<json>& per_rank);

  const replay_options& options_;
  std::ostream& log_;
  const clock_type::time_point started_ = clock_type::now();
  process_group alone_;
  process_group& world_;
  const int rank_;
  const int ranks_;
  int threads_ = 1;

  compute_device device_ = compute_device::cpu;
  gemm_options compute_;
  placement_counts placed_;
  std::optional<analysis> parsed_;
  std::optional<io::dump_reader> dump_;
  int gpu_index_ = 0;
  std::future<void> gpu_starting_;
  // Set when that start-up ends: true where it succeeded (device_ and gpu_index_ are set by then).
  std::promise<bool> gpu_started_promise_;
  std::shared_future<bool> gpu_started_ = gpu_started_promise_.get_future().share();
  // The first step's x and dy copied to the GPU while they are read (streamed_upload.hpp), where
  // the run asks for the GPU; declared before first_read_, which is destroyed first (its
  // destructor waits for the read).
  std::unique_ptr<device_upload_target> first_target_;
  std::unique_ptr<streamed_upload> first_upload_;
  // The first step's capture, read on a background thread from the start (start_first_read).
  const io::dump_entry_info* first_read_info_ = nullptr;
  std::future<io::dump_entry> first_read_;
  double seconds_first_read_ = -1.0;  // that read's own duration (-1: none)
  double first_upload_during_read_ = -1.0;  // run_seconds::first_upload_during_read
  // From the start until the GPU's context was made, and until its start-up ended (-1: no GPU);
  // written by the start-up thread, read after ready_gpu.
  double seconds_gpu_context_ = -1.0, seconds_gpu_ready_ = -1.0;
  std::vector<layer_plan> plan_;
  std::optional<unit_catalog> units_;
  bool attribute_ = false;
  bool timeline_started_ = false;  // --kernel-times, from the first step's upload on

  fs::path partial_;
  fs::path stop_file_;
  std::optional<run_directory::directory_lock> lock_;
  std::map<std::string, std::string> input_sha256_;
  std::future<std::string> pending_key_;  // the run key being hashed (claim_directory)
  std::string host_;

  replay_outcome outcome_;
  std::vector<bool> mine_;
  std::int64_t total_entries_ = 0;
  std::int64_t entries_seen_ = 0;
  double seconds_read_ = 0.0, seconds_upload_ = 0.0, seconds_hashing_ = 0.0;
  double seconds_hashing_wait_ = 0.0;  // of a key hashed in the background: the wait for it
  double seconds_setup_ = -1.0;  // from the start to the first read (parsing, planning, resuming)
  step_times step_seconds_;      // reference and strategies
  clock_type::time_point last_logged_ = clock_type::now();
  std::string failure_;       // this rank's failure, with the rank and unit named
  std::string failure_kind_;  // "input" or "other"
  bool stopped_by_other_ = false;
};

replay_run::replay_run(const replay_options& options, std::ostream& log)
    : options_(options),
      log_(log),
      world_(options.processes ? *options.processes : alone_),
      rank_(world_.rank()),
      ranks_(world_.size()),
      partial_(options.out / ".partial"),
      stop_file_(partial_ / "stop"),
      host_(this_host()) {
#ifdef _OPENMP
  threads_ = options.threads > 0 ? options.threads : omp_get_max_threads();
#endif
}

// The device, the analysis, the dump and the plan, in every process.
void replay_run::start() {
  together(world_, [&] {
    // The analysis, the dump and the plan first (host work, milliseconds), so that the first step's
    // read runs while the GPU's driver starts (parse_compute_device's device count, about 0.1 s).
    if (options_.device != "cpu" && options_.device != "gpu") parse_compute_device(options_.device);  // its error
    parsed_.emplace(load_analysis(options_.analysis_path.string()));
    attribute_ = parsed_->attribute || options_.attribute;
    dump_.emplace(options_.dump);
    plan_ = select_entries(options_, *parsed_, *dump_);
    start_first_read();
    device_ = parse_compute_device(options_.device);
    if (options_.kernel_times && device_ != compute_device::gpu) {
      throw input_error("--kernel-times: the device timeline needs --device gpu");
    }
    if (options_.kernel_times && ranks_ > 1) {
      throw input_error("--kernel-times: the device timeline is for one process (this run has " +
                        std::to_string(ranks_) + " ranks)");
    }
    // Under MPI each rank takes the GPU of its node-local rank, modulo the GPUs it sees. The
    // index is checked here; the GPU's context (a few hundred ms) is made on a background thread
    // while the analysis is parsed and the first step read (ready_gpu joins it).
    if (device_ == compute_device::gpu) {
      gpu_index_ = options_.device_index % gpu_count();
      if (gpu_index_ < 0) select_gpu(device_, gpu_index_);  // the error "GPU -1 does not exist"
      // The first read's copies may start once the context is made (they do not use the pinned
      // slots, which are made after it).
      gpu_starting_ = std::async(std::launch::async, [this, device = device_, index = gpu_index_] {
        // The pinned slots' host memory beside the context's creation, which does not need it.
        auto slots_memory = std::async(std::launch::async, [] { backend::reserve_uploads(); });
        try {
          select_gpu(device, index);
        } catch (...) {
          gpu_started_promise_.set_value(false);
          throw;
        }
        seconds_gpu_context_ = seconds_since(started_);
        gpu_started_promise_.set_value(true);
        slots_memory.get();
        backend::prepare_uploads();  // the pinned upload slots, beside the first read too
        seconds_gpu_ready_ = seconds_since(started_);
      });
    }
    compute_.device = device_;
    compute_.exact_too = true;  // quant_err needs the exact product of the same quantized operands
    // The GPU's products stay in device memory for the comparison and the cross-step state.
    compute_.keep_on_device = device_ == compute_device::gpu;
#ifdef _OPENMP
    if (options_.threads > 0) omp_set_num_threads(options_.threads);
#endif
    return std::string();
  });
  units_.emplace(plan_, *parsed_);
}

// The GPU made current on this thread, once its background start-up is done (its error, if any,
// is thrown here).
void replay_run::ready_gpu() {
  if (!gpu_starting_.valid()) return;
  gpu_starting_.get();
  select_gpu(device_, gpu_index_);
}

// What a step reads of its entry: w where a GEMM other than Wgrad needs it; never dw or the
// captured quantized operands.
io::dump_read_options replay_run::read_options() const {
  io::dump_read_options options;
  options.read_weight =
      std::any_of(parsed_->gemms.begin(), parsed_->gemms.end(), [](gemm_kind k) { return k != gemm_kind::wgrad; });
  options.read_weight_gradient = false;
  options.read_quantized = false;
  return options;
}

// The first step of a fresh single-process run is the plan's first entry: its read starts on a
// background thread here, before the GPU's start-up, the run directory and the input hashes, and
// replay_steps takes it (its errors surface there, as they would without it). A resumed run or a
// rank of several may start elsewhere and reads when it gets there, and an --out that already holds
// a run is refused by claim_directory: neither reads ahead. Should the run stop before the first
// step for another reason (no usable GPU), the process waits for this read before it exits.
void replay_run::start_first_read() {
  if (ranks_ > 1 || options_.resume || plan_.empty() || plan_.front().entries.empty()) return;
  // What claim_directory takes for a fresh run: a new or empty --out, or a run directory (its
  // marker) with neither final files nor checkpoints.
  std::error_code ignored;
  const bool fresh = !fs::exists(options_.out) || fs::is_empty(options_.out, ignored) ||
                     (fs::exists(options_.out / run_directory::marker_name) && !fs::exists(partial_) &&
                      run_directory::state_of(options_.out) == run_directory::run_state::empty);
  if (!fresh) return;
  first_read_info_ = plan_.front().entries.front();
  io::dump_read_options options = read_options();
  if (options_.device == "gpu" && backend::built_with_gpu()) {
    first_target_ = std::make_unique<device_upload_target>([this] {
      using namespace std::chrono_literals;
      if (gpu_started_.wait_for(0s) != std::future_status::ready || !gpu_started_.get()) return false;
      select_gpu(device_, gpu_index_);
      return true;
    });
    first_upload_ = std::make_unique<streamed_upload>(*first_target_);
    options.listener = first_upload_.get();
  }
  first_read_ = std::async(std::launch::async, [this, info = first_read_info_, options] {
    const auto reading = clock_type::now();
    io::dump_entry entry = dump_->read(*info, options);
    seconds_first_read_ = seconds_since(reading);
    return entry;
  });
}

// The run directory and its identity (rank 0 alone touches it before the work starts, and holds
// its lock until the end). The key does not hold the number of processes: any number of them may
// resume a run. Returns "finished", or one '0' or '1' per unit for whether it is done.
//
// The key needs the SHA-256 of every input file. A run that must compare keys (a finished or
// interrupted directory) hashes first; a fresh single-process run (no .partial yet) hashes on
// background threads while it works, and the key, .partial and the marker are written by
// settle_run_key before its first fragment: a run killed before then leaves no checkpoint, so the
// directory is still empty for the next run. (With several ranks any rank may write a fragment
// first, so they hash first.)
std::string replay_run::claim_directory() {
  const std::vector<std::string> setup = together(world_, [&]() -> std::string {
    if (rank_ != 0) return "";
    run_directory::claim(options_.out, dump_->directory());
    lock_.emplace(options_.out);
    const run_directory::run_state state = run_directory::state_of(options_.out);
    if (ranks_ == 1 && state == run_directory::run_state::empty && !fs::exists(partial_)) {
      run_directory::remove_stale_files(options_.out);
      pending_key_ = std::async(std::launch::async, [this] {
        const auto hashing_started = clock_type::now();
        input_sha256_ = hash_inputs(plan_, std::min(threads_, 8));
        seconds_hashing_ = seconds_since(hashing_started);
        return run_key(*parsed_, *dump_, options_, attribute_, input_sha256_);
      });
      return std::string(units_->count(), '0');
    }
    const auto hashing_started = clock_type::now();
    input_sha256_ = hash_inputs(plan_, std::min(threads_, 8));
    seconds_hashing_ = seconds_since(hashing_started);
    const std::string key = run_key(*parsed_, *dump_, options_, attribute_, input_sha256_);
    const fs::path marker = options_.out / run_directory::marker_name;
    switch (state) {
      case run_directory::run_state::finished:
        if (!options_.resume) {
          throw input_error(fmt::format("{}: the run directory already holds a finished run; use --resume or another "
                                        "--out",
                                        options_.out.string()));
        }
        if (read_text(marker) != key) {
          throw input_error(fmt::format("{}: --resume: the finished run used another analysis, dump, filter or "
                                        "input files (see {}); use another --out",
                                        options_.out.string(), marker.string()));
        }
        return "finished";
      case run_directory::run_state::interrupted:
        if (!options_.resume) {
          throw input_error(fmt::format("{}: an interrupted run is in this directory; finish it with --resume or "
                                        "use another --out",
                                        options_.out.string()));
        }
        if (read_text(partial_ / "run-key.json") != key) {
          throw input_error(fmt::format("{}: --resume: the interrupted run used another analysis, dump, filter or "
                                        "input files (see {})",
                                        options_.out.string(), (partial_ / "run-key.json").string()));
        }
        break;
      case run_directory::run_state::empty: break;
    }
    write_run_key(key);
    std::string done(units_->count(), '0');
    for (std::size_t index = 0; index < units_->count(); ++index) {
      if (fs::exists(partial_ / units_->fragment_name(index))) done[index] = '1';
    }
    return done;
  });
  return setup[0];
}

// .partial, the marker and .partial/run-key.json for `key`.
void replay_run::write_run_key(const std::string& key) {
  std::error_code ignored;
  fs::create_directories(partial_, ignored);
  if (!fs::is_directory(partial_)) {
    throw input_error(fmt::format("{}: cannot create the run directory", options_.out.string()));
  }
  // Temporary files of a process that was killed while writing (PATH.tmp.<pid>) are garbage, and
  // so are the state files of the processes of an earlier launch.
  run_directory::remove_stale_files(options_.out);
  const fs::path marker = options_.out / run_directory::marker_name;
  if (read_text(marker) != key) io::write_file_atomically(marker, key);
  if (!fs::exists(partial_ / "run-key.json")) io::write_file_atomically(partial_ / "run-key.json", key);
}

// The key hashed in the background (claim_directory), written before anything depends on it.
void replay_run::settle_run_key() {
  if (!pending_key_.valid()) return;
  const auto waiting = clock_type::now();
  const std::string key = pending_key_.get();
  seconds_hashing_wait_ = seconds_since(waiting);
  write_run_key(key);
}

// With several processes, each keeps RUN/.partial/rank-<r>.json saying what it works on (for the
// report of a rank that dies, and for operators).
void replay_run::write_state(const std::string& state, const std::vector<std::string>& units) const {
  if (ranks_ == 1) return;
  json record;
  record["rank"] = rank_;
  record["ranks"] = ranks_;
  record["host"] = host_;
  record["pid"] = static_cast<std::int64_t>(::getpid());
  record["state"] = state;
  record["units"] = units;
  try {
    io::write_file_atomically(partial_ / fmt::format("rank-{:05d}.json", rank_), record.dump(2) + "\n");
  } catch (const std::exception&) {
    // Informational only; a rank that cannot write it still takes part in the final report.
  }
}

// Progress: on a terminal one line rewritten after every entry; in a log (Slurm, CI) a full line at
// most every progress_log_seconds, from rank 0.
void replay_run::report_progress() {
  const std::int64_t done = entries_seen_, total = total_entries_;
  const bool to_log = options_.progress_log_seconds > 0.0 && rank_ == 0 &&
                      (seconds_since(last_logged_) >= options_.progress_log_seconds || done == total);
  if (!options_.progress && !to_log) return;
  const double elapsed = seconds_since(started_);
  const double rate = static_cast<double>(outcome_.entries) / std::max(elapsed, 1e-9);
  const double remaining = static_cast<double>(total - done) / std::max(rate, 1e-9);
  const std::string line = fmt::format("replay: {}/{} entries, {} units done, {:.2f} entries/s, ETA {:.0f} s", done,
                                       total, outcome_.units_resumed + outcome_.units_done, rate, remaining);
  if (options_.progress) {
    log_ << '\r' << line << "   " << std::flush;
  } else {
    log_ << line << '\n' << std::flush;
    last_logged_ = clock_type::now();
  }
}

// The state of each GEMM of a layer for the units this rank owns there (`owned`, canonical
// indices), with each unit's text and canonical index.
std::vector<gemm_state> replay_run::layer_states(const std::vector<std::size_t>& owned,
                                                 std::vector<std::vector<std::string>>& unit_texts,
                                                 std::vector<std::vector<std::size_t>>& unit_indices) const {
  std::vector<gemm_state> gemms;
  for (std::size_t gi = 0; gi < parsed_->gemms.size(); ++gi) {
    gemm_state state{};
    state.kind = parsed_->gemms[gi];
    std::vector<std::size_t> indices;
    std::vector<std::string> texts;
    for (const std::size_t index : owned) {
      const unit_index unit = units_->at(index);
      if (unit.gemm != gi) continue;
      const auto& s = parsed_->strategies[unit.strategy];
      unit_state unit_data;
      unit_data.strategy_name = s.name;
      unit_data.chosen = &s.for_gemm(state.kind);
      state.units.push_back(std::move(unit_data));
      indices.push_back(index);
      texts.push_back(units_->text(index));
    }
    if (state.units.empty()) continue;
    if (device_ == compute_device::gpu) {
      state.device_reference = backend::make_device_reference_state();
      for (auto& unit : state.units) unit.device_accumulators = backend::make_device_unit_state();
    }
    gemms.push_back(std::move(state));
    unit_indices.push_back(std::move(indices));
    unit_texts.push_back(std::move(texts));
  }
  return gemms;
}

// Every step of one layer for this rank's units there. The next step is read on a background
// thread while this one is worked on (its errors surface when its turn comes, as they would
// without the overlap); `read` then times only the wait for it. The entry before the current one
// is handed to that read, which fills its memory again (same shapes step after step: no fresh
// pages to fault in). On the GPU the same thread then uploads the next step's operands on a
// stream of its own, beside the kernels of this step; `upload` times what was not hidden. Should
// that upload fail (device memory held by this step, say), the step uploads its operands itself
// when its turn comes, where any error is reported.
void replay_run::replay_steps(const layer_plan& layer, std::vector<gemm_state>& gemms,
                              const std::vector<std::vector<std::string>>& unit_texts, std::string& doing) {
  const io::dump_read_options read_options = this->read_options();
  const io::dump_reader& dump = *dump_;
  struct read_ahead {
    io::dump_entry entry;
    device_matrix_ptr x, dy, w;  // uploaded beside this step's work (GPU; null where not)
  };
  std::future<read_ahead> next_entry;
  io::dump_entry spare;
  const bool on_gpu = device_ == compute_device::gpu;
  const auto read_in_background = [&](std::size_t e) {
    if (e >= layer.entries.size()) return;
    next_entry = std::async(std::launch::async, [&dump, &read_options, on_gpu, device = device_, index = gpu_index_,
                                                 info = layer.entries[e], recycled = std::move(spare)]() mutable {
      read_ahead next{dump.read(*info, read_options, std::move(recycled)), nullptr, nullptr, nullptr};
      if (!on_gpu || !next.entry.all_finite()) return next;
      try {
        select_gpu(device, index);
        const backend::timeline_label label("upload beside");
        next.x = backend::upload_beside(next.entry.x);
        next.dy = backend::upload_beside(next.entry.dy);
        if (next.entry.w) next.w = backend::upload_beside(*next.entry.w);
      } catch (const std::exception&) {
        next.x = next.dy = next.w = nullptr;  // the step uploads them itself, reporting any error
      }
      return next;
    });
    spare = io::dump_entry{};
  };
  for (std::size_t e = 0; e < layer.entries.size(); ++e) {
    const auto* info = layer.entries[e];
    if (ranks_ > 1 && fs::exists(stop_file_)) {
      stopped_by_other_ = true;
      return;
    }
    doing = fmt::format("reading step {} of layer {}", info->step, layer.name);
    auto mark = clock_type::now();
    if (seconds_setup_ < 0.0) seconds_setup_ = seconds_since(started_);
    read_ahead ahead;
    streamed_upload* streamed = nullptr;  // the first read's copies to the GPU, finished below
    if (next_entry.valid()) {
      ahead = next_entry.get();
    } else if (first_read_.valid() && info == first_read_info_) {
      ahead.entry = first_read_.get();
      streamed = first_upload_.get();
    } else {
      ahead.entry = dump.read(*info, read_options);
    }
    if (on_gpu && options_.kernel_times && !timeline_started_) {
      // Before the next step's upload starts beside this one; the wait for the GPU is not reading.
      const auto starting = clock_type::now();
      ready_gpu();
      backend::start_timeline();
      timeline_started_ = true;
      mark += clock_type::now() - starting;
    }
    io::dump_entry entry = std::move(ahead.entry);
    read_in_background(e + 1);
    if (!entry.all_finite()) {
      throw input_error(fmt::format("{}: non-finite values in the captured tensors ({}); replay refuses to use them",
                                    info->file.string(), entry.nonfinite_summary()));
    }
    seconds_read_ += seconds_since(mark);
    const gemm_operands operands{&entry.x, &entry.dy, entry.w ? &*entry.w : nullptr};
    // The step's operands go to the GPU once, for every strategy's quantizer.
    compute_.resident_operands.clear();
    if (on_gpu) {
      mark = clock_type::now();
      ready_gpu();
      const backend::timeline_label label("upload");
      if (streamed != nullptr) {
        const std::array<bool, 2> whole = streamed->finish();
        const std::array<std::uint64_t, 2> during = streamed->copied_while_reading();
        const double elements = static_cast<double>(entry.x.values.size() + entry.dy.values.size());
        first_upload_during_read_ = elements > 0.0 ? static_cast<double>(during[0] + during[1]) / elements : 0.0;
        if (whole[0]) ahead.x = first_target_->take(0);
        if (whole[1]) ahead.dy = first_target_->take(1);
        first_upload_.reset();  // and the device memory of a copy that was not whole
        first_target_.reset();
      }
      const device_matrix_ptr uploaded[] = {ahead.x, ahead.dy, ahead.w};
      const matrix* const hosts[] = {operands.x, operands.dy, operands.w};
      for (int i = 0; i < 3; ++i) {
        if (hosts[i] == nullptr) continue;
        compute_.resident_operands.emplace_back(hosts[i], uploaded[i] ? uploaded[i] : backend::upload(*hosts[i]));
      }
      seconds_upload_ += seconds_since(mark);
    }
    const step_inputs inputs{entry,    operands,   device_,   compute_, placed_,
                             *parsed_, attribute_, static_cast<std::int64_t>(e + 1), log_};
    for (std::size_t gi = 0; gi < gemms.size(); ++gi) {
      replay_gemm_step(gemms[gi], unit_texts[gi], inputs, doing, step_seconds_);
    }
    compute_.known_exact.reset();
    compute_.resident_operands.clear();  // they copy this entry's operands
    spare = std::move(entry);
    ++entries_seen_;
    ++outcome_.entries;
    report_progress();
  }
}

// One fragment per unit: its steps and accumulation rows and its summary record (mean and last of
// each per-step metric and the final cross-step values).
void replay_run::write_fragments(const layer_plan& layer, const std::vector<gemm_state>& gemms,
                                 const std::vector<std::vector<std::size_t>>& unit_indices) {
  settle_run_key();
  bool consecutive = true;
  for (std::size_t i = 1; i < layer.entries.size(); ++i) {
    consecutive = consecutive && layer.entries[i]->step == layer.entries[i - 1]->step + 1;
  }
  for (std::size_t gi = 0; gi < gemms.size(); ++gi) {
    const auto& state = gemms[gi];
    for (std::size_t u = 0; u < state.units.size(); ++u) {
      const std::size_t index = unit_indices[gi][u];
      const json fragment = unit_fragment(units_->text(index), layer.name, state, state.units[u], consecutive);
      io::write_file_atomically(partial_ / units_->fragment_name(index), fragment.dump() + "\n");
      ++outcome_.units_done;
    }
  }
}

// This rank's units of one layer. With several ranks a failure is recorded (and RUN/.partial/stop
// created, which the others look for before every step) instead of thrown.
void replay_run::replay_layer(std::size_t layer_index) {
  const auto& layer = plan_[layer_index];
  std::vector<std::size_t> owned;
  for (std::size_t u = 0; u < units_->per_layer(); ++u) {
    if (mine_[layer_index * units_->per_layer() + u]) owned.push_back(layer_index * units_->per_layer() + u);
  }
  if (owned.empty()) return;
  std::vector<std::string> owned_text;
  for (const std::size_t index : owned) owned_text.push_back(units_->text(index));
  write_state("working", owned_text);
  std::string doing;  // what this rank is doing, for its failure message
  try {
    std::vector<std::vector<std::string>> unit_texts;
    std::vector<std::vector<std::size_t>> unit_indices;  // per gemm state, per unit: canonical index
    std::vector<gemm_state> gemms = layer_states(owned, unit_texts, unit_indices);
    replay_steps(layer, gemms, unit_texts, doing);
    if (stopped_by_other_) return;
    doing = fmt::format("writing the fragments of layer {}", layer.name);
    write_fragments(layer, gemms, unit_indices);
    ++outcome_.layers_done;
  } catch (const std::exception& error) {
    if (ranks_ == 1) throw;
    failure_kind_ = dynamic_cast<const input_error*>(&error) != nullptr ? "input" : "other";
    failure_ = fmt::format("rank {} of {} (host {}, pid {}) failed on {}: {}", rank_, ranks_, host_, ::getpid(),
                           doing.empty() ? fmt::format("layer {}", layer.name) : doing, error.what());
    try {
      io::write_file_atomically(stop_file_, failure_ + "\n");
    } catch (const std::exception&) {
      // The others then stop at the end of their work instead; the message still reaches rank 0.
    }
  }
}

// Every rank reports; rank 0 names every failed rank (and throws), the others return.
std::vector<json> replay_run::gather_reports() {
  json report;
  report["failure"] = failure_;
  report["failure_kind"] = failure_kind_;
  report["entries"] = outcome_.entries;
  report["units_done"] = outcome_.units_done;
  report["seconds"] = {{"total", seconds_since(started_)},
                       {"read", seconds_read_},
                       {"setup", std::max(seconds_setup_, 0.0)},
                       {"upload", seconds_upload_},
                       {"reference", step_seconds_.reference},
                       {"strategies", step_seconds_.strategies}};
  const std::vector<std::string> reports = world_.all_gather(report.dump());
  std::vector<json> per_rank;
  for (const auto& text : reports) per_rank.push_back(json::parse(text));
  std::string failures;
  bool all_input = true;
  std::int64_t units_done_now = 0;
  for (const auto& item : per_rank) {
    units_done_now += item["units_done"].get<std::int64_t>();
    const std::string text = item["failure"].get<std::string>();
    if (text.empty()) continue;
    failures += (failures.empty() ? "" : "\n") + text;
    all_input = all_input && item["failure_kind"] == "input";
  }
  if (!failures.empty()) {
    if (rank_ != 0) throw reported_elsewhere(0);  // the reporting rank exits 2 (errors.hpp)
    const std::string message = fmt::format(
        "{}\n{} of {} units are complete and kept in {}; finish the run with --resume (with any number of ranks)",
        failures, outcome_.units_resumed + units_done_now, units_->count(), partial_.string());
    if (all_input) throw input_error(message);
    throw std::runtime_error(message);
  }
  outcome_.complete = outcome_.units_resumed + units_done_now == static_cast<std::int64_t>(units_->count());
  return per_rank;
}

// Rank 0, once every unit is done: the final files, interleaving the unit fragments back into the
// order of rows of one process (layer, step, gemm, strategy).
void replay_run::assemble(const std::vector<json>& per_rank) {
  io::atomic_file steps_file(options_.out / "steps.csv");
  io::atomic_file accumulation_file(options_.out / "accumulation.csv");
  steps_file.write(steps_header);
  accumulation_file.write(accumulation_header);
  const merged_fragments merged = merge_fragments(plan_, *units_, partial_, steps_file, accumulation_file);
  json summary;
  summary["provenance"] = summary_provenance(options_, *parsed_, *dump_, input_sha256_, attribute_);
  summary["units"] = merged.units;
  std::string gpu_name;
  if (device_ == compute_device::gpu) {
    ready_gpu();
    gpu_name = device_name(device_);
  }
  std::vector<timeline::operation> operations;
  std::int64_t not_recorded = 0;
  if (timeline_started_) operations = backend::finish_timeline(&not_recorded);
  if (first_read_.valid()) first_read_.wait();  // not taken (no step ran here): its time is still its own
  const run_seconds seconds{seconds_since(started_),
                            seconds_read_,
                            std::max(seconds_setup_, 0.0),
                            seconds_upload_,
                            seconds_hashing_,
                            seconds_hashing_wait_,
                            step_seconds_.reference,
                            step_seconds_.strategies,
                            seconds_first_read_,
                            first_upload_during_read_,
                            seconds_gpu_context_,
                            seconds_gpu_ready_};
  json run = run_record(options_.device, gpu_name, placed_, threads_, outcome_, seconds, merged, *parsed_, per_rank);
  std::optional<std::string> kernel_times;
  if (options_.kernel_times) {
    run["device_timeline"] = timeline_record(timeline::summarize(operations));
    run["device_timeline"]["operations_not_recorded"] = not_recorded;
    kernel_times = timeline::to_csv(operations);
  }
  commit_final_files(options_.out, partial_, steps_file, accumulation_file, summary, run, kernel_times);
  outcome_.complete = true;
}

replay_outcome replay_run::run() {
  start();
  const std::string done_at_start = claim_directory();
  if (done_at_start == "finished") {
    replay_outcome finished;
    finished.complete = true;
    finished.already_finished = true;
    if (rank_ == 0) {
      log_ << "replay: " << options_.out.string() << " already holds a finished run; nothing to resume\n";
    }
    return finished;
  }
  // The static assignment of the units still to do (assign_units).
  outcome_.units_total = static_cast<std::int64_t>(units_->count());
  unit_assignment assigned = assign_pending(plan_, *parsed_, done_at_start, ranks_, rank_);
  outcome_.units_resumed = assigned.units_resumed;
  outcome_.layers_resumed = assigned.layers_resumed;
  mine_ = std::move(assigned.mine);
  total_entries_ = assigned.entries;

  write_state("started", {});
  struct report_guard {
    process_group& world;
    ~report_guard() { world.on_termination({}); }
  } guard{world_};
  if (ranks_ > 1) {
    world_.on_termination([this] { report_termination(partial_, ranks_, rank_, host_, *units_, log_); });
  }
  for (std::size_t layer_index = 0; layer_index < plan_.size() && failure_.empty() && !stopped_by_other_;
       ++layer_index) {
    const bool owns_units = std::any_of(mine_.begin() + static_cast<std::ptrdiff_t>(layer_index * units_->per_layer()),
                                        mine_.begin() + static_cast<std::ptrdiff_t>((layer_index + 1) * units_->per_layer()),
                                        [](bool m) { return m; });
    if (!owns_units) continue;
    if (options_.stop_after_layers > 0 && outcome_.layers_done >= options_.stop_after_layers) break;
    replay_layer(layer_index);
  }
  if (options_.progress) log_ << "\n";
  write_state(!failure_.empty() ? "failed" : stopped_by_other_ ? "stopped" : "finished", {});

  const std::vector<json> per_rank = gather_reports();
  if (rank_ != 0) return outcome_;
  settle_run_key();
  outcome_.complete = false;
  for (std::size_t index = 0; index < units_->count(); ++index) {
    if (!fs::exists(partial_ / units_->fragment_name(index))) return outcome_;
  }
  assemble(per_rank);
  return outcome_;
}

}  // namespace

replay_outcome run_replay(const replay_options& options, std::ostream& log) {
  replay_run run(options, log);
  return run.run();
}

}  // namespace mxscope
