// mxscope report RUN: plots of every layer x GEMM (gnuplot, SVG and PNG) in RUN/plots and one
// self-contained RUN/report.html that ranks the strategies and tells coherent errors from errors
// that average out (docs/report.md).
#include <fmt/format.h>

#include <memory>
#include <ostream>

#include "commands.hpp"
#include "mxscope/report/report.hpp"

namespace mxscope::cli {

namespace {

struct report_command_options {
  std::string run_directory;
  std::string gnuplot = "gnuplot";
};

int run_report(const report_command_options& options, std::ostream& out) {
  report::report_options settings;
  settings.gnuplot_program = options.gnuplot;
  const report::report_outputs outputs = report::write_report(options.run_directory, settings);
  out << fmt::format("wrote {} and {} plot files in {} (PNG terminal: {})\n", outputs.html.string(),
                     outputs.plot_files.size(), (std::filesystem::path(options.run_directory) / "plots").string(),
                     outputs.png_terminal);
  return 0;
}

}  // namespace

void add_report_command(CLI::App& app, command_list& commands) {
  auto options = std::make_shared<report_command_options>();
  CLI::App* sub = app.add_subcommand("report", "Draw a run's plots (gnuplot) and write RUN/report.html, one "
                                               "self-contained page ranking the strategies per layer x GEMM");
  sub->add_option("run", options->run_directory, "Run directory written by mxscope replay")->required();
  sub->add_option("--gnuplot", options->gnuplot, "The gnuplot program: a name looked up on PATH, or a path")
      ->capture_default_str();
  commands.push_back({sub, [options](std::ostream& out, std::ostream&) { return run_report(*options, out); }});
}

}  // namespace mxscope::cli
