// mxscope notebook RUN -o FILE.ipynb: a Jupyter notebook that loads the run with pandas and redraws
// the report's ranking and plots with matplotlib (docs/report.md).
#include <fmt/format.h>

#include <filesystem>
#include <memory>
#include <ostream>

#include "commands.hpp"
#include "mxscope/io/atomic_file.hpp"
#include "mxscope/report/report.hpp"

namespace mxscope::cli {

namespace {

struct notebook_command_options {
  std::string run_directory;
  std::string output;
};

int run_notebook(const notebook_command_options& options, std::ostream& out) {
  for (const char* name : {"steps.csv", "accumulation.csv", "summary.json", "run.json", ".mxscope-run"}) {
    io::refuse_output_over_input(options.output, std::filesystem::path(options.run_directory) / name,
                                 fmt::format("RUN/{}", name));
  }
  report::write_notebook(options.run_directory, options.output);
  out << fmt::format("wrote {}\n", options.output);
  return 0;
}

}  // namespace

void add_notebook_command(CLI::App& app, command_list& commands) {
  auto options = std::make_shared<notebook_command_options>();
  CLI::App* sub = app.add_subcommand("notebook", "Write a Jupyter notebook that loads a run with pandas and redraws "
                                                 "the report's ranking and plots with matplotlib");
  sub->add_option("run", options->run_directory, "Run directory written by mxscope replay")->required();
  sub->add_option("-o,--out", options->output, "The notebook file to write (.ipynb, written atomically)")->required();
  commands.push_back({sub, [options](std::ostream& out, std::ostream&) { return run_notebook(*options, out); }});
}

}  // namespace mxscope::cli
