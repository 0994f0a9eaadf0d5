// The report's plots, described independently of the program that draws them: one table of plot
// kinds (titles, axes, the explanation printed under each plot), the series of one unit, and the
// gnuplot renderer that turns them into SVG and PNG files. Internal to src/report.
#pragma once

#include <cstddef>
#include <filesystem>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "mxscope/report/run_data.hpp"

namespace mxscope::report {

// The size of a plot, in pixels (PNG) and user units (SVG): every plot has this width, and this
// height when its key fits in three rows.
inline constexpr int plot_width_pixels = 720;
inline constexpr int plot_height_pixels = 520;

struct plot_kind {
  std::string_view id;           // file name part: LAYER.GEMM.<id>.svg
  std::string_view title;
  std::string_view x_label;
  std::string_view y_label;
  bool log_x = false;
  bool log_y = false;
  std::string_view explanation;  // one paragraph, plain text
};

// Every kind, in the order the report shows them.
std::span<const plot_kind> plot_kinds();

// How a strategy is drawn, the same in every plot, in the page's tables and in the notebook: ten
// colours, and past ten strategies a different marker shape with the same colours again.
struct strategy_style {
  std::string_view colour;             // #rrggbb
  int gnuplot_point_type = 7;          // filled circle, square, triangle, diamond
  std::string_view matplotlib_marker;  // the same shapes for matplotlib
  std::string_view glyph;              // the same shapes as text, for the HTML tables
};
strategy_style style_of_strategy(std::size_t strategy_index);
inline constexpr std::size_t strategy_colour_count = 20;
inline constexpr std::size_t strategy_marker_count = 4;

struct plot_series {
  std::string title;
  std::size_t strategy_index = 0;
  bool dashed = false;
  std::vector<double> x;
  std::vector<double> y;
};

// A reference curve drawn as a gnuplot function of x (e.g. "sqrt(x)").
struct plot_guide {
  std::string expression;
  std::string title;  // empty: no key entry
};

struct plot {
  const plot_kind* kind = nullptr;
  std::string title;      // kind title with the unit named
  std::string file_stem;  // without extension; unique within the run
  double x_max = 1.0;
  int height = plot_height_pixels;  // grows with the number of key rows under the plot
  std::vector<plot_series> series;
  std::vector<plot_guide> guides;
};

// The plots of one unit, one per kind. `file_prefix` is the unit's unique, file-name-safe prefix.
std::vector<plot> plots_for_unit(const unit_data& unit, const std::string& file_prefix);

// A file-name-safe, unique prefix per unit: letters, digits, '.', '-' and '_' kept, anything else
// becomes '_', and a clash (after that folding or case folding) gets a "-2", "-3", ... suffix.
std::vector<std::string> unit_file_prefixes(const std::vector<unit_data>& units);

struct rendered_plot {
  std::string svg;  // file contents
  std::string png;
};

// Renders with the gnuplot program (a name looked up on PATH, or a path). Throws input_error when
// the program cannot be found, std::runtime_error when it fails (with the end of its messages).
class gnuplot_renderer {
 public:
  explicit gnuplot_renderer(std::string program);
  ~gnuplot_renderer();
  gnuplot_renderer(const gnuplot_renderer&) = delete;
  gnuplot_renderer& operator=(const gnuplot_renderer&) = delete;

  // The PNG terminal in use: "pngcairo" when gnuplot has it, else "png".
  const std::string& png_terminal() const { return png_terminal_; }

  // Draws every plot to SVG and PNG with one gnuplot process and returns the files' bytes.
  std::vector<rendered_plot> render(const std::vector<plot>& plots);

 private:
  std::string program_path_;
  std::filesystem::path scratch_;
  std::string png_terminal_;
  int batch_ = 0;
};

}  // namespace mxscope::report
