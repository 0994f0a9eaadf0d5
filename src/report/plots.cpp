#include "plots.hpp"

#include <fcntl.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fmt/format.h>

#include <array>
#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <sstream>
#include <stdexcept>
#include <system_error>

#include "mxscope/errors.hpp"
#include "text.hpp"

extern char** environ;

namespace mxscope::report {

namespace {

constexpr std::array<plot_kind, 9> kinds = {{
    {"rel_err", "Per-step relative error", "replayed step t", "rel_err = ||E_t|| / ||G_t||", false, true,
     "The size of each step's error relative to the reference result. A steady line means a steady error size; "
     "a spike marks a step with outliers (compare the underflow and saturation plots at the same t). This is "
     "the quantity a one-step study looks at; the plots below show what happens when the steps are summed."},
    {"angle", "Direction error per step", "replayed step t", "1 - cosine(Ghat_t, G_t)", false, true,
     "How far the strategy's result turns away from the reference direction. For small errors 1 - cosine is "
     "about orth_err^2 / 2. Steps where the result is exact (1 - cosine = 0) have no point on the log axis."},
    {"bias", "Bias along the reference result", "replayed step t", "bias = <E_t, G_t> / ||G_t||^2", false, false,
     "The part of the error that points along the reference result. Negative values mean the strategy shrinks "
     "the gradient (flushing small values to zero does that); a bias that keeps its sign step after step adds "
     "up coherently, however small it is."},
    {"acc_err", "Error of the summed results", "steps summed T", "acc_err = ||sum E_t|| / ||sum G_t||", true, true,
     "The relative error of the sum of the first T results, which is what a weight update built from T steps "
     "sees. Its trend also depends on how coherently the reference results add up, which is the same for every "
     "strategy, so compare strategies with each other at the same T; the table ranks them by its last value."},
    {"coherence", "Coherence of the errors", "steps summed T", "||sum E_t|| / sqrt(sum ||E_t||^2)", true, true,
     "1 at T = 1. It stays near the line 1 when the step errors are independent of each other (they average "
     "out), and it follows sqrt(T), its upper bound, when the same error repeats every step (they add up). "
     "Below 1: successive errors tend to cancel."},
    {"growth", "Growth of the summed error", "steps summed T", "||sum E_t|| / rms ||E_t||  = coherence * sqrt(T)",
     true, true,
     "The summed error in units of a typical (root-mean-square) step error. A random walk grows like sqrt(T) "
     "(alpha 0.5), an error that repeats every step like T (alpha 1). The slope of a curve on this log-log plot "
     "is the growth exponent alpha when the step errors keep a steady size; the key gives alpha at the last T."},
    {"underflow", "Operand inputs flushed to zero", "replayed step t", "nonzero inputs quantized to 0 (fraction)",
     false, false,
     "The fraction of each operand's nonzero inputs that the quantizer flushed to zero: solid lines for the "
     "GEMM's first operand, dashed for its second, each named by the captured tensor. Flushing removes "
     "small-magnitude information in the same places every step, a typical source of coherent error."},
    {"saturation", "Operand inputs clipped at the max normal", "replayed step t", "inputs clipped (fraction)", false,
     false,
     "The fraction of each operand's inputs that were clipped at the format's largest normal value: solid for "
     "the first operand, dashed for the second. Clipping hits the largest values of a block, which are often "
     "the same channels every step."},
    {"optimizer", "Optimizer displacement error", "steps summed T", "disp_err = ||sum uhat_t - sum u_t|| / ||sum u_t||",
     true, true,
     "How far the weights would move away from the reference path over T steps, replaying the optimizer open "
     "loop from zero state with the strategy's results and with the reference results: SGD with momentum 0.9 "
     "(solid) and AdamW (dashed). This is what the gradient error costs the optimizer."},
}};

// Tableau 10 (distinguishable, and readable for the common colour-vision deficiencies), then ten
// darker or more saturated hues unlike any of them, so that up to 20 strategies (the shipped
// ablation has 16) each get a colour of their own before the marker shapes repeat the palette.
constexpr std::array<std::string_view, 20> colours = {
    "#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7", "#9c755f", "#bab0ac",
    "#08306b", "#b35806", "#00441b", "#54278f", "#252525", "#17becf", "#bcbd22", "#e7298a", "#8c510a", "#01665e"};

const plot_kind& kind_named(std::string_view id) {
  for (const auto& kind : kinds) {
    if (kind.id == id) return kind;
  }
  throw std::logic_error("unknown plot kind");
}

std::string unit_label(const unit_data& unit) { return unit.layer + " " + unit.gemm; }

// Which operand a per-step series describes: none (a GEMM-level metric), or the GEMM's first or
// second operand, drawn dashed and named by its captured tensor.
enum class operand_label { none, first, second };

// One series per strategy from a per-step field.
template <typename Value>
void add_step_series(plot& out, const unit_data& unit, Value value, operand_label operand) {
  for (const auto& series : unit.strategies) {
    plot_series line;
    line.title = series.strategy;
    if (operand == operand_label::first) line.title += ": " + series.a_role;
    if (operand == operand_label::second) line.title += ": " + series.b_role;
    line.strategy_index = series.strategy_index;
    line.dashed = operand == operand_label::second;
    for (const auto& step : series.steps) {
      line.x.push_back(static_cast<double>(step.t));
      line.y.push_back(value(step));
    }
    out.series.push_back(std::move(line));
  }
}

template <typename Value>
void add_accumulation_series(plot& out, const unit_data& unit, Value value, bool dashed, const std::string& suffix) {
  for (const auto& series : unit.strategies) {
    plot_series line;
    line.title = series.strategy + suffix;
    line.strategy_index = series.strategy_index;
    line.dashed = dashed;
    for (const auto& row : series.accumulation) {
      line.x.push_back(static_cast<double>(row.T));
      line.y.push_back(value(row));
    }
    out.series.push_back(std::move(line));
  }
}

// Interleaves two series lists so each strategy's solid and dashed lines sit together in the key.
void interleave(plot& out, std::vector<plot_series> solid, std::vector<plot_series> dashed) {
  out.series.clear();
  for (std::size_t index = 0; index < solid.size(); ++index) {
    out.series.push_back(std::move(solid[index]));
    out.series.push_back(std::move(dashed[index]));
  }
}

// ------------------------------------------------------------------------------------------------
// Running gnuplot.

std::string find_program(const std::string& program) {
  const auto runnable = [](const std::string& candidate) {
    struct stat info {};
    return ::stat(candidate.c_str(), &info) == 0 && S_ISREG(info.st_mode) && ::access(candidate.c_str(), X_OK) == 0;
  };
  const std::string advice =
      "mxscope report draws its plots with gnuplot, a separate program; install it (Debian: apt-get install "
      "gnuplot-nox, or run tools/bootstrap) or name it with --gnuplot PATH";
  if (program.empty()) throw input_error(fmt::format("the gnuplot program name is empty; {}", advice));
  if (program.find('/') != std::string::npos) {
    if (runnable(program)) return program;
    throw input_error(fmt::format("gnuplot program '{}' does not exist or is not executable; {}", program, advice));
  }
  const char* search_path = std::getenv("PATH");
  std::string_view directories = search_path != nullptr ? search_path : "/usr/local/bin:/usr/bin:/bin";
  while (true) {
    const std::size_t colon = directories.find(':');
    const std::string_view directory = directories.substr(0, colon);
    // An empty PATH entry means the current directory.
    const std::string candidate = fmt::format("{}/{}", directory.empty() ? std::string_view(".") : directory, program);
    if (runnable(candidate)) return candidate;
    if (colon == std::string_view::npos) break;
    directories.remove_prefix(colon + 1);
  }
  throw input_error(fmt::format("gnuplot program '{}' not found on PATH; {}", program, advice));
}

std::string read_bytes(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream contents;
  contents << in.rdbuf();
  return contents.str();
}

// The last `limit` bytes of a log, for an error message.
std::string log_tail(const std::string& log, std::size_t limit) {
  const std::string tail = log.size() > limit ? fmt::format("...{}", log.substr(log.size() - limit)) : log;
  return printable(tail, limit + 10);
}

// Runs `program arguments...` with no shell, stdin from /dev/null and stdout + stderr into `log`;
// returns the exit status (128 + signal when killed).
int run_program(const std::string& program, const std::vector<std::string>& arguments,
                const std::filesystem::path& log) {
  posix_spawn_file_actions_t actions;
  if (::posix_spawn_file_actions_init(&actions) != 0) throw std::runtime_error("posix_spawn_file_actions_init failed");
  ::posix_spawn_file_actions_addopen(&actions, 0, "/dev/null", O_RDONLY, 0);
  ::posix_spawn_file_actions_addopen(&actions, 1, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  ::posix_spawn_file_actions_adddup2(&actions, 1, 2);
  std::vector<std::string> words;
  words.push_back(program);
  words.insert(words.end(), arguments.begin(), arguments.end());
  std::vector<char*> argv;
  for (auto& word : words) argv.push_back(word.data());
  argv.push_back(nullptr);
  pid_t child = 0;
  const int spawn_error = ::posix_spawn(&child, program.c_str(), &actions, nullptr, argv.data(), environ);
  ::posix_spawn_file_actions_destroy(&actions);
  if (spawn_error != 0) {
    throw std::runtime_error(
        fmt::format("cannot start {}: {}", program, std::generic_category().message(spawn_error)));
  }
  int status = 0;
  while (::waitpid(child, &status, 0) < 0) {
    if (errno != EINTR) throw std::system_error(errno, std::generic_category(), fmt::format("waitpid {}", program));
  }
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return 255;
}

bool valid_point(double x, double y, const plot_kind& kind) {
  if (!std::isfinite(x) || !std::isfinite(y)) return false;
  if (kind.log_x && x <= 0.0) return false;
  if (kind.log_y && y <= 0.0) return false;
  return true;
}

// Tic marks at 1, 2, 5, 10, 20, ... up to `x_max`: gnuplot's own log tics would show only the
// decades, which leaves a window of a few dozen steps with two labels.
std::string log_tics(double x_max) {
  std::string tics;
  double last = 0.0;
  for (double decade = 1.0; decade <= x_max; decade *= 10.0) {
    for (const double mantissa : {1.0, 2.0, 5.0}) {
      const double value = decade * mantissa;
      if (value > x_max * 1.0000001) break;
      if (!tics.empty()) tics += ", ";
      tics += fmt::format("{:g}", value);
      last = value;
    }
  }
  // The window's length labels the right end, unless a round tic is already close to it.
  if (x_max > last * 1.25) tics += fmt::format(", {:g}", x_max);
  return tics;
}

struct key_layout {
  std::size_t columns = 1;
  std::size_t rows = 0;
};

// How gnuplot will lay out the key under a plot: as many columns as fit the width (three at most;
// two for paired series, so that a strategy's solid and dashed lines stay together), measured
// from gnuplot's own text width estimate at the SVG font size (about 8.5 units per character plus
// 62 for the line sample and gaps, on 680 usable units).
key_layout key_layout_of(const plot& figure) {
  std::size_t entries = figure.series.size();
  std::size_t longest = 0;
  for (const auto& series : figure.series) longest = std::max(longest, series.title.size());
  for (const auto& guide : figure.guides) {
    if (guide.title.empty()) continue;
    ++entries;
    longest = std::max(longest, guide.title.size());
  }
  const bool paired = figure.series.size() >= 2 && figure.series[1].dashed;
  const double column_width = 8.5 * static_cast<double>(longest) + 62.0;
  key_layout layout;
  layout.columns = std::clamp<std::size_t>(static_cast<std::size_t>(680.0 / column_width), 1, paired ? 2 : 3);
  layout.rows = (entries + layout.columns - 1) / layout.columns;
  return layout;
}

// The settings and plot command of one plot; the data blocks are named $p<plot>s<series>.
std::string plot_commands(const plot& figure, std::size_t plot_index, int title_font_size) {
  const plot_kind& kind = *figure.kind;
  std::string out;
  out += "reset\n";
  out += fmt::format("set title {} font ',{}'\n", gnuplot_quoted(figure.title), title_font_size);
  out += fmt::format("set xlabel {}\n", gnuplot_quoted(kind.x_label));
  out += fmt::format("set ylabel {}\n", gnuplot_quoted(kind.y_label));
  out += "set grid lc rgb '#dddddd' lw 1\n";
  out += "set border lc rgb '#555555'\n";
  // The key goes under the plot so the curves get the full width.
  out += fmt::format("set key below center horizontal Left reverse noenhanced samplen 2.5 spacing 1.05 height 1 "
                     "maxcols {}\n",
                     key_layout_of(figure).columns);
  out += "set format y '%g'\n";
  out += "set samples 200\n";
  if (kind.log_x) out += "set logscale x 10\n";
  if (kind.log_y) out += "set logscale y 10\n";
  if (figure.x_max > 1.0) {
    out += fmt::format("set xrange [1:{}]\n", data_number(figure.x_max));
    if (kind.log_x) out += fmt::format("set xtics ({})\n", log_tics(figure.x_max));
  } else {
    out += kind.log_x ? "set xrange [0.8:1.25]\nset xtics (1)\n" : "set xrange [0:2]\nset xtics 1\n";
  }

  std::vector<std::string> items;
  for (std::size_t series_index = 0; series_index < figure.series.size(); ++series_index) {
    const plot_series& series = figure.series[series_index];
    bool any_point = false;
    for (std::size_t point = 0; point < series.x.size(); ++point) any_point |= valid_point(series.x[point], series.y[point], kind);
    if (!any_point) continue;  // gnuplot refuses a data set without one point it can draw
    const strategy_style style = style_of_strategy(series.strategy_index);
    items.push_back(fmt::format("$p{}s{} using 1:2 with linespoints lw 2 pt {} ps 0.5 lc rgb '{}' dt {} title {}",
                                plot_index, series_index, style.gnuplot_point_type, style.colour,
                                series.dashed ? 2 : 1, gnuplot_quoted(series.title)));
  }
  const bool no_data = items.empty();
  std::size_t guide_index = 0;
  for (const auto& guide : figure.guides) {
    items.push_back(fmt::format("{} with lines lw 1.5 lc rgb '{}' dt {} {}", guide.expression,
                                guide_index == 0 ? "#555555" : "#111111", guide_index == 0 ? 3 : 4,
                                guide.title.empty() ? std::string("notitle") : fmt::format("title {}", gnuplot_quoted(guide.title))));
    ++guide_index;
  }
  if (no_data) {
    out += fmt::format("set label 1 {} at graph 0.5, 0.5 center tc rgb '#777777'\n",
                       gnuplot_quoted(kind.log_y ? "no positive values to draw on a log axis" : "no values to draw"));
    if (items.empty()) {
      out += kind.log_y ? "set yrange [0.1:10]\n" : "set yrange [0:1]\n";
      items.push_back("NaN notitle");
    }
  }
  out += "plot ";
  for (std::size_t item = 0; item < items.size(); ++item) {
    if (item > 0) out += ", \\\n     ";
    out += items[item];
  }
  out += "\nunset output\n";
  return out;
}

std::string data_blocks(const plot& figure, std::size_t plot_index) {
  std::string out;
  for (std::size_t series_index = 0; series_index < figure.series.size(); ++series_index) {
    const plot_series& series = figure.series[series_index];
    out += fmt::format("$p{}s{} << EOD\n", plot_index, series_index);
    for (std::size_t point = 0; point < series.x.size(); ++point) {
      const bool valid = valid_point(series.x[point], series.y[point], *figure.kind);
      out += fmt::format("{} {}\n", data_number(series.x[point]), valid ? data_number(series.y[point]) : "NaN");
    }
    out += "EOD\n";
  }
  return out;
}

}  // namespace

std::span<const plot_kind> plot_kinds() { return kinds; }

strategy_style style_of_strategy(std::size_t strategy_index) {
  static_assert(colours.size() == strategy_colour_count);
  constexpr int point_types[strategy_marker_count] = {7, 5, 9, 13};
  constexpr std::string_view markers[strategy_marker_count] = {"o", "s", "^", "D"};
  constexpr std::string_view glyphs[strategy_marker_count] = {"\u25CF", "\u25A0", "\u25B2", "\u25C6"};
  const std::size_t shape = (strategy_index / strategy_colour_count) % strategy_marker_count;
  return {colours[strategy_index % strategy_colour_count], point_types[shape], markers[shape], glyphs[shape]};
}

std::vector<plot> plots_for_unit(const unit_data& unit, const std::string& file_prefix) {
  std::vector<plot> plots;
  double steps_max = 1.0;
  double summed_max = 1.0;
  for (const auto& series : unit.strategies) {
    for (const auto& step : series.steps) steps_max = std::max(steps_max, static_cast<double>(step.t));
    for (const auto& row : series.accumulation) summed_max = std::max(summed_max, static_cast<double>(row.T));
  }
  const auto start = [&](std::string_view id, double x_max) -> plot& {
    plot figure;
    figure.kind = &kind_named(id);
    figure.title = fmt::format("{}: {}", unit_label(unit), figure.kind->title);
    figure.file_stem = fmt::format("{}.{}", file_prefix, id);
    figure.x_max = x_max;
    plots.push_back(std::move(figure));
    return plots.back();
  };

  add_step_series(start("rel_err", steps_max), unit, [](const step_record& step) { return step.rel_err; },
                  operand_label::none);
  add_step_series(start("angle", steps_max), unit, [](const step_record& step) { return 1.0 - step.cosine; },
                  operand_label::none);
  {
    plot& figure = start("bias", steps_max);
    add_step_series(figure, unit, [](const step_record& step) { return step.bias; }, operand_label::none);
    figure.guides.push_back({"0", ""});
  }
  add_accumulation_series(start("acc_err", summed_max), unit,
                          [](const accumulation_record& row) { return row.acc_err; }, false, "");
  {
    plot& figure = start("coherence", summed_max);
    add_accumulation_series(figure, unit, [](const accumulation_record& row) { return row.coherence; }, false, "");
    figure.guides.push_back({"1", "1: independent"});
    figure.guides.push_back({"sqrt(x)", "sqrt(T): identical"});
  }
  {
    plot& figure = start("growth", summed_max);
    for (const auto& series : unit.strategies) {
      plot_series line;
      line.title = fmt::format("{} (alpha {})", series.strategy, short_number(series.accumulation.back().alpha));
      line.strategy_index = series.strategy_index;
      for (const auto& row : series.accumulation) {
        line.x.push_back(static_cast<double>(row.T));
        line.y.push_back(row.coherence * std::sqrt(static_cast<double>(row.T)));
      }
      figure.series.push_back(std::move(line));
    }
    figure.guides.push_back({"sqrt(x)", "sqrt(T): alpha 0.5"});
    figure.guides.push_back({"x", "T: alpha 1"});
  }
  for (const std::string_view id : {std::string_view("underflow"), std::string_view("saturation")}) {
    plot& figure = start(id, steps_max);
    const bool underflow = id == "underflow";
    plot first_operand;
    plot second_operand;
    first_operand.kind = second_operand.kind = figure.kind;
    add_step_series(first_operand, unit,
                    [underflow](const step_record& step) { return underflow ? step.a_underflow_frac : step.a_saturate_frac; },
                    operand_label::first);
    add_step_series(second_operand, unit,
                    [underflow](const step_record& step) { return underflow ? step.b_underflow_frac : step.b_saturate_frac; },
                    operand_label::second);
    interleave(figure, std::move(first_operand.series), std::move(second_operand.series));
  }
  {
    plot& figure = start("optimizer", summed_max);
    plot sgd;
    plot adamw;
    sgd.kind = adamw.kind = figure.kind;
    add_accumulation_series(sgd, unit, [](const accumulation_record& row) { return row.sgd_disp_err; }, false, ": SGD");
    add_accumulation_series(adamw, unit, [](const accumulation_record& row) { return row.adamw_disp_err; }, true,
                            ": AdamW");
    interleave(figure, std::move(sgd.series), std::move(adamw.series));
  }
  // Room for the key: the plotting area keeps its size whatever the number of strategies.
  constexpr int key_row_height = 17;
  constexpr int rows_in_base_height = 3;
  for (auto& figure : plots) {
    const int rows = static_cast<int>(std::min<std::size_t>(key_layout_of(figure).rows, 60));
    figure.height = plot_height_pixels + key_row_height * std::max(0, rows - rows_in_base_height);
  }
  return plots;
}

std::vector<std::string> unit_file_prefixes(const std::vector<unit_data>& units) {
  std::vector<std::string> prefixes;
  std::map<std::string, int> uses;  // by lower-cased prefix: case-insensitive file systems clash too
  for (const auto& unit : units) {
    std::string prefix;
    for (const char c : unit.layer + "." + unit.gemm) {
      const bool safe = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' ||
                        c == '-' || c == '_';
      prefix += safe ? c : '_';
    }
    if (prefix.front() == '.') prefix.front() = '_';  // no hidden files
    if (prefix.size() > 150) prefix.resize(150);
    std::string candidate = prefix;
    for (int attempt = 2;; ++attempt) {
      std::string folded = candidate;
      for (char& c : folded) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
      if (uses.emplace(folded, 1).second) break;
      candidate = fmt::format("{}-{}", prefix, attempt);
    }
    prefixes.push_back(candidate);
  }
  return prefixes;
}

gnuplot_renderer::gnuplot_renderer(std::string program) : program_path_(find_program(program)) {
  static std::atomic<int> counter{0};
  scratch_ = std::filesystem::temp_directory_path() /
             fmt::format("mxscope-report-{}-{}", static_cast<long>(::getpid()), counter.fetch_add(1));
  std::filesystem::remove_all(scratch_);
  std::filesystem::create_directories(scratch_);

  // Which terminals this gnuplot has: the Debian builds differ (gnuplot-nox has pngcairo).
  const auto probe_script = scratch_ / "terminals.gp";
  const auto probe_log = scratch_ / "terminals.log";
  {
    std::ofstream script(probe_script, std::ios::binary);
    script << "print GPVAL_TERMINALS\n";
  }
  const int status = run_program(program_path_, {"-d", probe_script.string()}, probe_log);
  const std::string terminals = fmt::format(" {} ", read_bytes(probe_log));
  if (status != 0) {
    throw std::runtime_error(fmt::format("{} failed to start (exit {}): {}", program_path_, status,
                                         log_tail(terminals, 1500)));
  }
  const auto has = [&](std::string_view name) {
    return terminals.find(fmt::format(" {} ", name)) != std::string::npos ||
           terminals.find(fmt::format(" {}\n", name)) != std::string::npos;
  };
  if (!has("svg")) throw std::runtime_error(fmt::format("{} has no svg terminal", program_path_));
  if (has("pngcairo")) {
    png_terminal_ = "pngcairo";
  } else if (has("png")) {
    png_terminal_ = "png";
  } else {
    throw std::runtime_error(fmt::format("{} has neither the pngcairo nor the png terminal", program_path_));
  }
}

gnuplot_renderer::~gnuplot_renderer() {
  std::error_code ignored;
  std::filesystem::remove_all(scratch_, ignored);
}

std::vector<rendered_plot> gnuplot_renderer::render(const std::vector<plot>& plots) {
  const int batch = batch_++;
  const auto file_for = [&](std::size_t index, const char* extension) {
    return scratch_ / fmt::format("b{}-p{}.{}", batch, index, extension);
  };
  // Font sizes in points; the title a little larger than the rest.
  constexpr int svg_font_size = 13;
  constexpr int svg_title_font_size = 15;
  constexpr int png_font_size = 11;
  constexpr int png_title_font_size = 13;
  const auto svg_terminal = [&](const plot& figure) {
    return fmt::format("set terminal svg size {},{} fixed noenhanced font 'sans,{}' background '#ffffff'\n",
                       plot_width_pixels, figure.height, svg_font_size);
  };
  const auto png_terminal = [&](const plot& figure) {
    return png_terminal_ == "pngcairo"
               ? fmt::format("set terminal pngcairo size {},{} noenhanced font 'sans,{}' background '#ffffff'\n",
                             plot_width_pixels, figure.height, png_font_size)
               : fmt::format("set terminal png size {},{} noenhanced background '#ffffff'\n", plot_width_pixels,
                             figure.height);
  };

  std::string script = "set encoding utf8\n";
  for (std::size_t index = 0; index < plots.size(); ++index) script += data_blocks(plots[index], index);
  for (std::size_t index = 0; index < plots.size(); ++index) {
    script += svg_terminal(plots[index]);
    script += fmt::format("set output {}\n", gnuplot_quoted(file_for(index, "svg").string()));
    script += plot_commands(plots[index], index, svg_title_font_size);
    script += png_terminal(plots[index]);
    script += fmt::format("set output {}\n", gnuplot_quoted(file_for(index, "png").string()));
    script += plot_commands(plots[index], index, png_title_font_size);
  }
  const auto script_path = scratch_ / fmt::format("b{}.gp", batch);
  const auto log_path = scratch_ / fmt::format("b{}.log", batch);
  {
    std::ofstream out(script_path, std::ios::binary);
    out << script;
    if (!out) throw std::runtime_error(fmt::format("cannot write the gnuplot script {}", script_path.string()));
  }
  const int status = run_program(program_path_, {"-d", script_path.string()}, log_path);
  if (status != 0) {
    throw std::runtime_error(fmt::format("{} failed (exit {}) drawing {}: {}", program_path_, status,
                                         plots.empty() ? std::string("plots") : plots.front().title,
                                         log_tail(read_bytes(log_path), 1500)));
  }

  std::vector<rendered_plot> rendered;
  for (std::size_t index = 0; index < plots.size(); ++index) {
    rendered_plot files{read_bytes(file_for(index, "svg")), read_bytes(file_for(index, "png"))};
    if (files.svg.find("<svg") == std::string::npos || files.svg.find("</svg>") == std::string::npos) {
      throw std::runtime_error(fmt::format("{} wrote an incomplete SVG for {}", program_path_, plots[index].title));
    }
    if (files.png.size() < 8 || files.png.compare(0, 8, "\x89PNG\r\n\x1a\n") != 0) {
      throw std::runtime_error(fmt::format("{} wrote no PNG for {}", program_path_, plots[index].title));
    }
    std::filesystem::remove(file_for(index, "svg"));
    std::filesystem::remove(file_for(index, "png"));
    rendered.push_back(std::move(files));
  }
  return rendered;
}

}  // namespace mxscope::report
