// The outputs built from a replay's run directory (steps.csv, accumulation.csv, summary.json; see
// docs/metrics.md and docs/report.md):
//   write_report:   RUN/plots/<layer>.<gemm>.<kind>.svg and .png, drawn by gnuplot, and
//                   RUN/report.html, one self-contained page (plots inlined, inline CSS, no scripts);
//   write_notebook: a Jupyter notebook (nbformat 4.5, not executed) that loads the same files with
//                   pandas and redraws the plots and the ranking with matplotlib.
// Every input is read and checked before anything is written, and every file is written through
// io::atomic_file, so a bad input leaves no partial output. The bytes written depend only on the
// inputs (no clock, no host name, no absolute paths in the report).
#pragma once

#include <filesystem>
#include <string>
#include <vector>

namespace mxscope::report {

struct report_options {
  // The gnuplot program: a name looked up on PATH, or a path.
  std::string gnuplot_program = "gnuplot";
};

struct report_outputs {
  std::filesystem::path html;
  std::vector<std::filesystem::path> plot_files;  // .svg and .png, in the order of the page
  std::string png_terminal;                       // "pngcairo" or "png"
};

report_outputs write_report(const std::filesystem::path& run_directory, const report_options& options);

// The notebook's RUN variable is the run directory relative to the notebook's folder (Jupyter runs
// a notebook there), or absolute when no relative path exists.
void write_notebook(const std::filesystem::path& run_directory, const std::filesystem::path& notebook_path);

}  // namespace mxscope::report
