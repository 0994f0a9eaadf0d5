// mxscope replay DUMP --analysis A.toml --out RUN [--device cpu|gpu] [--threads N] [--resume]
//                [--layers RE] [--steps LIST] [--attribute] [--kernel-times]
// Started by an MPI launcher (mpirun -np N mxscope replay ..., srun), the ranks share the work
// (docs/scaling.md); rank 0 alone prints the outcome.
#include <unistd.h>

#include <iostream>
#include <memory>
#include <ostream>

#include "commands.hpp"
#include "mxscope/parallel.hpp"
#include "mxscope/replay.hpp"

namespace mxscope::cli {

namespace {
constexpr int max_threads = 1024;
// How often a replay whose stderr is not a terminal (a batch log) prints its progress line.
constexpr double progress_log_seconds = 30.0;
}  // namespace

void add_replay_command(CLI::App& app, command_list& commands) {
  auto options = std::make_shared<replay_options>();
  auto dump = std::make_shared<std::string>();
  auto analysis_path = std::make_shared<std::string>();
  auto out = std::make_shared<std::string>();
  auto layers = std::make_shared<std::string>();
  auto steps = std::make_shared<std::string>();
  CLI::App* command = app.add_subcommand(
      "replay", "Replay every (layer, step) of a dump under an analysis's strategies; write steps.csv, "
                "accumulation.csv and summary.json");
  command->add_option("dump", *dump, "Dump directory (holding manifest.json)")->required();
  command->add_option("--analysis", *analysis_path, "Analysis file (TOML), e.g. analyses/wgrad-ablation.toml")
      ->required();
  command->add_option("-o,--out", *out, "Run directory to create (or to finish, with --resume)")->required();
  command->add_option("--device", options->device, "cpu (default) or gpu")->default_val("cpu");
  // More threads than max_threads gain nothing on any machine mxscope targets, and OpenMP runtimes
  // fail to create (or crash on) tens of thousands of them.
  command->add_option("--threads", options->threads, "Worker threads, 1 to 1024 (default: all cores)")
      ->check(CLI::Range(0, max_threads));
  command->add_flag("--resume", options->resume, "Finish an interrupted run in --out, keeping its finished layers");
  CLI::Option* layers_option =
      command->add_option("--layers", *layers, "Only layers whose whole name matches this regular expression");
  CLI::Option* steps_option = command->add_option("--steps", *steps, "Only these steps, e.g. 3,5-9,12");
  command->add_flag("--attribute", options->attribute,
                    "Also attribute the error to flushed, clipped and rounded elements of each operand");
  command->add_flag("--kernel-times", options->kernel_times,
                    "With --device gpu: time every kernel, copy and memset with device events; write "
                    "kernel_times.csv and run.json's device_timeline");
  commands.push_back({command, [=](std::ostream& out_stream, std::ostream& err) {
                        replay_options chosen = *options;
                        chosen.dump = *dump;
                        chosen.analysis_path = *analysis_path;
                        chosen.out = *out;
                        if (layers_option->count() > 0) chosen.layers = *layers;
                        if (steps_option->count() > 0) chosen.steps = *steps;
                        const bool real_stderr = &err == &std::cerr;
                        chosen.progress = real_stderr && isatty(STDERR_FILENO) != 0;
                        if (real_stderr && !chosen.progress) chosen.progress_log_seconds = progress_log_seconds;
                        const std::unique_ptr<process_group> processes = join_launched_processes();
                        chosen.processes = processes.get();
                        chosen.device_index = processes->local_rank();
                        const replay_outcome outcome = run_replay(chosen, err);
                        if (processes->rank() != 0 || outcome.already_finished) return 0;
                        if (outcome.complete) {
                          if (processes->size() > 1) {
                            out_stream << "replay: " << outcome.units_total - outcome.units_resumed
                                       << " units replayed by " << processes->size() << " ranks";
                          } else {
                            out_stream << "replay: " << outcome.entries << " entries replayed";
                          }
                          if (outcome.units_resumed > 0) {
                            out_stream << ", " << outcome.units_resumed << " of " << outcome.units_total
                                       << " units kept from the interrupted run";
                          }
                          out_stream << "\nreplay: wrote " << (chosen.out / "steps.csv").string() << ", "
                                     << (chosen.out / "accumulation.csv").string() << ", "
                                     << (chosen.out / "summary.json").string() << "\n";
                          return 0;
                        }
                        out_stream << "replay: stopped with " << outcome.layers_done
                                   << " layers done; finish with --resume\n";
                        return 0;
                      }});
}

}  // namespace mxscope::cli
