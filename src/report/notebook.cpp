// mxscope notebook: a Jupyter notebook (nbformat 4.5, cells not executed) that loads a run with
// pandas and redraws the report's plots and ranking with matplotlib.
#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <string_view>

#include "mxscope/errors.hpp"
#include "mxscope/io/atomic_file.hpp"
#include "mxscope/report/report.hpp"
#include "mxscope/report/run_data.hpp"
#include "plots.hpp"
#include "text.hpp"

namespace mxscope::report {

namespace {

// ------------------------------------------------------------------------------------------------
// Markdown and Python literals.

// Characters that Markdown would read as markup; & and < also start HTML, which Jupyter renders.
std::string markdown_escape(std::string_view text) {
  const std::string repaired = valid_utf8(text);
  std::string out;
  for (const char c : repaired) {
    if (c == '&') {
      out += "&amp;";
    } else if (c == '<') {
      out += "&lt;";
    } else if (c == '>') {
      out += "&gt;";
    } else if (c == '\n' || c == '\r') {
      out += ' ';
    } else if (std::string_view("\\`*_{}[]()#+-.!|~").find(c) != std::string_view::npos) {
      out += '\\';
      out += c;
    } else {
      out += c;
    }
  }
  return out;
}

// Lighter escaping for the project's own prose: only what could start markup or HTML.
std::string markdown_prose(std::string_view text) {
  std::string out;
  for (const char c : text) {
    if (c == '&') {
      out += "&amp;";
    } else if (c == '<') {
      out += "&lt;";
    } else if (std::string_view("\\`*_").find(c) != std::string_view::npos) {
      out += '\\';
      out += c;
    } else {
      out += c;
    }
  }
  return out;
}

std::size_t longest_backtick_run(std::string_view text) {
  std::size_t longest = 0;
  std::size_t current = 0;
  for (const char c : text) {
    current = c == '`' ? current + 1 : 0;
    longest = std::max(longest, current);
  }
  return longest;
}

// An inline code span that shows `text` literally, whatever backticks it holds.
std::string markdown_code_span(std::string_view text) {
  std::string single_line = valid_utf8(text);
  std::replace(single_line.begin(), single_line.end(), '\n', ' ');
  std::replace(single_line.begin(), single_line.end(), '\r', ' ');
  const std::string fence(longest_backtick_run(single_line) + 1, '`');
  const bool pad = single_line.empty() || single_line.front() == '`' || single_line.back() == '`' ||
                   single_line.front() == ' ';
  return fence + (pad ? " " : "") + single_line + (pad ? " " : "") + fence;
}

// A fenced code block, every line prefixed with `indent`.
std::string markdown_code_block(std::string_view text, std::string_view info, const std::string& indent) {
  const std::string body = valid_utf8(text);
  const std::string fence(std::max<std::size_t>(3, longest_backtick_run(body) + 1), '`');
  std::string out = indent + fence + std::string(info) + "\n";
  std::size_t start = 0;
  while (start <= body.size()) {
    const std::size_t end = body.find('\n', start);
    const std::string line = body.substr(start, end == std::string::npos ? std::string::npos : end - start);
    if (!(end == std::string::npos && line.empty())) out += indent + line + "\n";
    if (end == std::string::npos) break;
    start = end + 1;
  }
  return out + indent + fence + "\n";
}

std::string markdown_json_items(const nlohmann::ordered_json& object, const std::string& indent, int depth);

std::string markdown_json_value(const nlohmann::ordered_json& value, const std::string& indent, int depth) {
  const auto scalar_text = [](const nlohmann::ordered_json& scalar) {
    return scalar.is_string() ? scalar.get<std::string>()
                              : scalar.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  };
  if (value.is_string()) {
    const std::string text = value.get<std::string>();
    if (text.find('\n') != std::string::npos || text.size() > 160) {
      return fmt::format("\n\n{}", markdown_code_block(text, "", indent + "  "));
    }
    return fmt::format(" {}\n", markdown_code_span(text));
  }
  if (value.is_primitive()) return fmt::format(" {}\n", markdown_code_span(scalar_text(value)));
  if (value.is_object() && depth <= 3 && !value.empty()) return fmt::format("\n{}", markdown_json_items(value, indent + "  ", depth + 1));
  if (value.is_array() &&
      std::all_of(value.begin(), value.end(), [](const nlohmann::ordered_json& element) { return element.is_primitive(); })) {
    std::string joined;
    for (const auto& element : value) joined += (joined.empty() ? "" : ", ") + scalar_text(element);
    return fmt::format(" {}\n", markdown_code_span(joined));
  }
  return fmt::format("\n\n{}", markdown_code_block(value.dump(2, ' ', false, nlohmann::json::error_handler_t::replace),
                                                   "json", indent + "  "));
}

std::string markdown_json_items(const nlohmann::ordered_json& object, const std::string& indent, int depth) {
  std::string out;
  for (auto member = object.begin(); member != object.end(); ++member) {
    out += indent + "- **" + markdown_escape(member.key()) + "**:" + markdown_json_value(member.value(), indent, depth);
  }
  return out;
}

// A Python string literal: JSON's string syntax is a subset of Python's.
std::string python_string(std::string_view text) {
  return nlohmann::json(valid_utf8(text)).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

// ------------------------------------------------------------------------------------------------
// Cells.

nlohmann::json cell_source(const std::string& text) {
  nlohmann::json lines = nlohmann::json::array();
  std::size_t start = 0;
  while (start < text.size()) {
    const std::size_t end = text.find('\n', start);
    if (end == std::string::npos) {
      lines.push_back(text.substr(start));
      break;
    }
    lines.push_back(text.substr(start, end - start + 1));
    start = end + 1;
  }
  // The last line carries no newline, as Jupyter writes it.
  if (!lines.empty()) {
    std::string last = lines.back().get<std::string>();
    if (!last.empty() && last.back() == '\n') last.pop_back();
    lines.back() = last;
  }
  return lines;
}

nlohmann::json markdown_cell(const std::string& id, const std::string& text) {
  return {{"cell_type", "markdown"}, {"id", id}, {"metadata", nlohmann::json::object()}, {"source", cell_source(text)}};
}

nlohmann::json code_cell(const std::string& id, const std::string& text) {
  return {{"cell_type", "code"},
          {"id", id},
          {"metadata", nlohmann::json::object()},
          {"execution_count", nullptr},
          {"outputs", nlohmann::json::array()},
          {"source", cell_source(text)}};
}

std::string replace_all(std::string text, std::string_view placeholder, std::string_view value) {
  std::size_t position = 0;
  while ((position = text.find(placeholder, position)) != std::string::npos) {
    text.replace(position, placeholder.size(), value);
    position += value.size();
  }
  return text;
}

constexpr std::string_view setup_code = R"python(import json
import math
import pathlib

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

try:
    from IPython.display import display
except ImportError:  # run outside Jupyter: print the tables
    def display(table):
        print(table.to_string())

# The run directory written by `mxscope replay`. A relative path is taken from the folder the
# notebook runs in; Jupyter starts the kernel in the notebook's own folder.
RUN = pathlib.Path(@RUN@))python";

constexpr std::string_view load_code = R"python(# Text columns are kept as written (a strategy may be called "nan"); every other column is a
# number, with "nan" and "inf" where docs/metrics.md says a value is undefined or infinite.
TEXT_COLUMNS = {"layer", "gemm", "strategy", "a_role", "b_role"}
WHOLE_NUMBER_COLUMNS = {"step", "t", "T"}


def load_table(path):
    table = pd.read_csv(path, dtype=str, keep_default_na=False)
    for column in table.columns:
        if column in WHOLE_NUMBER_COLUMNS:
            table[column] = table[column].map(int)
        elif column not in TEXT_COLUMNS:
            table[column] = table[column].map(float).astype("float64")
    return table


steps = load_table(RUN / "steps.csv")
accumulation = load_table(RUN / "accumulation.csv")
summary = json.loads((RUN / "summary.json").read_text(encoding="utf-8"))

# Units (layer x GEMM) and strategies in order of first appearance, as in the report, and the
# report's colours and markers:
UNITS = list(dict.fromkeys(zip(steps["layer"], steps["gemm"])))
STRATEGIES = list(dict.fromkeys(steps["strategy"]))
# past ten strategies, the colours repeat with another marker shape.
COLOURS = @COLOURS@
MARKERS = @MARKERS@


def strategy_style(strategy):
    index = STRATEGIES.index(strategy)
    return dict(color=COLOURS[index % len(COLOURS)], marker=MARKERS[(index // len(COLOURS)) % len(MARKERS)])


def unit_rows(table, layer, gemm):
    return table[(table["layer"] == layer) & (table["gemm"] == gemm)]


print(f"{len(steps)} step rows, {len(accumulation)} accumulation rows, "
      f"{len(UNITS)} layer x GEMM units, {len(STRATEGIES)} strategies"))python";

constexpr std::string_view ranking_code = R"python(COHERENT_ALPHA = @COHERENT@  # alpha at or above: the errors add up
AVERAGING_ALPHA = @AVERAGING@  # alpha at or below: they average out
COHERENT_BIAS = @BIAS@  # a one-signed bias at least this fraction of the final acc_err: coherent


def verdict(alpha, biases, acc_err):
    """The report's verdict: a bias of one sign at every step that is most of the summed error is
    coherent whatever alpha says (the summed update keeps the same shrinkage); else alpha."""
    mean_bias = float(biases.mean()) if len(biases) else float("nan")
    one_sign = len(biases) >= 2 and bool(((biases != 0) & ((biases < 0) == (mean_bias < 0))).all())
    if one_sign and abs(mean_bias) >= COHERENT_BIAS * acc_err:
        return "coherent (bias)"
    if math.isnan(alpha):
        return "n/a"
    if alpha >= COHERENT_ALPHA:
        return "coherent"
    if alpha <= AVERAGING_ALPHA:
        return "averages out"
    return "mixed"


def ranking(layer, gemm):
    """The final (largest T) accumulation row of each strategy, smallest acc_err first; a nan
    acc_err ranks last; ties keep the order of first appearance and share a rank."""
    per_step = unit_rows(steps, layer, gemm)
    summed = unit_rows(accumulation, layer, gemm)
    order = list(dict.fromkeys(per_step["strategy"]))
    final = summed.sort_values("T").groupby("strategy", sort=False).tail(1).set_index("strategy")
    rel_err_mean = per_step.groupby("strategy", sort=False)["rel_err"].mean()
    table = pd.DataFrame({
        "strategy": order,
        "T": [final.loc[name, "T"] for name in order],
        "acc_err": [final.loc[name, "acc_err"] for name in order],
        "rel_err_mean": [rel_err_mean[name] for name in order],
        "coherence": [final.loc[name, "coherence"] for name in order],
        "alpha": [final.loc[name, "alpha"] for name in order],
        "bias_mean": [per_step[per_step["strategy"] == name]["bias"].mean() for name in order],
        "verdict": [verdict(final.loc[name, "alpha"], per_step[per_step["strategy"] == name]["bias"].values,
                            final.loc[name, "acc_err"]) for name in order],
        "lag1_corr": [final.loc[name, "lag1_corr"] for name in order],
        "structural_share": [final.loc[name, "structural_share"] for name in order],
        "sgd_disp_err": [final.loc[name, "sgd_disp_err"] for name in order],
        "adamw_disp_err": [final.loc[name, "adamw_disp_err"] for name in order],
    })
    table = table.sort_values("acc_err", kind="stable", na_position="last")
    # Equal acc_err share a rank (identical strategies tie), as in the report.
    table.index = pd.Index(table["acc_err"].rank(method="min", na_option="bottom").astype(int), name="rank")
    return table


RANKINGS = {}
for layer, gemm in UNITS:
    RANKINGS[(layer, gemm)] = ranking(layer, gemm)
    print(f"{layer} {gemm}")
    display(RANKINGS[(layer, gemm)]))python";

constexpr std::string_view plot_code = R"python(PLOT_KINDS = @KINDS@


def legend_text(text):
    """Labels are plain text: matplotlib reads $...$ as math and hides labels that start with '_'."""
    text = str(text).replace("$", r"\$")
    return " " + text if text.startswith("_") else text


def draw_unit(layer, gemm):
    """The report's plots of one layer x GEMM, one panel per plot kind."""
    per_step = unit_rows(steps, layer, gemm)
    summed = unit_rows(accumulation, layer, gemm)
    figure, axes = plt.subplots(3, 3, figsize=(21, 14), constrained_layout=True)
    figure.suptitle(legend_text(f"{layer} {gemm}"))
    panels = {}
    for kind, axis in zip(PLOT_KINDS, axes.flat):
        panels[kind["id"]] = axis
        axis.set_title(kind["title"])
        axis.set_xlabel(kind["x_label"])
        axis.set_ylabel(kind["y_label"])
        if kind["log_x"]:
            axis.set_xscale("log")
        if kind["log_y"]:
            axis.set_yscale("log")
        axis.grid(True, color="#dddddd")

    last_T = 1
    for strategy in dict.fromkeys(per_step["strategy"]):
        rows = per_step[per_step["strategy"] == strategy].sort_values("t")
        sums = summed[summed["strategy"] == strategy].sort_values("T")
        last_T = max(last_T, int(sums["T"].max()))
        name = legend_text(strategy)
        first, second = legend_text(rows["a_role"].iloc[0]), legend_text(rows["b_role"].iloc[0])
        line = dict(strategy_style(strategy), markersize=3.5, linewidth=1.8)
        panels["rel_err"].plot(rows["t"], rows["rel_err"], label=name, **line)
        panels["angle"].plot(rows["t"], 1.0 - rows["cosine"], label=name, **line)
        panels["bias"].plot(rows["t"], rows["bias"], label=name, **line)
        panels["acc_err"].plot(sums["T"], sums["acc_err"], label=name, **line)
        panels["coherence"].plot(sums["T"], sums["coherence"], label=name, **line)
        alpha = sums["alpha"].iloc[-1]
        panels["growth"].plot(sums["T"], sums["coherence"] * np.sqrt(sums["T"]),
                              label=f"{name} (alpha {alpha:.4g})", **line)
        for kind, field in (("underflow", "underflow_frac"), ("saturation", "saturate_frac")):
            panels[kind].plot(rows["t"], rows["a_" + field], label=f"{name}: {first}", **line)
            panels[kind].plot(rows["t"], rows["b_" + field], label=f"{name}: {second}", linestyle="--", **line)
        panels["optimizer"].plot(sums["T"], sums["sgd_disp_err"], label=f"{name}: SGD", **line)
        panels["optimizer"].plot(sums["T"], sums["adamw_disp_err"], label=f"{name}: AdamW", linestyle="--", **line)

    T = np.geomspace(1, max(last_T, 2), 200)
    first_guide = dict(color="#555555", linestyle=":", linewidth=1.5)
    second_guide = dict(color="#111111", linestyle="-.", linewidth=1.5)
    panels["bias"].axhline(0.0, **first_guide)
    panels["coherence"].plot(T, np.ones_like(T), label="1: independent", **first_guide)
    panels["coherence"].plot(T, np.sqrt(T), label="sqrt(T): identical", **second_guide)
    panels["growth"].plot(T, np.sqrt(T), label="sqrt(T): alpha 0.5", **first_guide)
    panels["growth"].plot(T, T, label="T: alpha 1", **second_guide)
    for axis in panels.values():
        axis.legend(fontsize="small")
    return figure)python";

constexpr std::string_view draw_code = R"python(for layer, gemm in UNITS:
    figure = draw_unit(layer, gemm)
    plt.show()
    plt.close(figure))python";

std::string colours_literal() {
  std::string out = "[";
  for (std::size_t index = 0; index < strategy_colour_count; ++index) {
    out += fmt::format("{}\"{}\"", index == 0 ? "" : ", ", style_of_strategy(index).colour);
  }
  return out + "]";
}

std::string markers_literal() {
  std::string out = "[";
  for (std::size_t shape = 0; shape < strategy_marker_count; ++shape) {
    out += fmt::format("{}\"{}\"", shape == 0 ? "" : ", ",
                       style_of_strategy(shape * strategy_colour_count).matplotlib_marker);
  }
  return out + "]";
}

std::string kinds_literal() {
  std::string out = "[\n";
  for (const auto& kind : plot_kinds()) {
    out += fmt::format("    {{\"id\": {}, \"title\": {}, \"x_label\": {}, \"y_label\": {}, \"log_x\": {}, \"log_y\": {}}},\n",
                       python_string(kind.id), python_string(kind.title), python_string(kind.x_label),
                       python_string(kind.y_label), kind.log_x ? "True" : "False", kind.log_y ? "True" : "False");
  }
  return out + "]";
}

std::string intro_markdown(const run_data& run, const std::string& name) {
  const provenance facts = provenance_of(run.summary);
  std::string out = fmt::format("# mxscope run: {}\n\n", markdown_escape(name));
  out += fmt::format(
      "This notebook loads what `mxscope replay` wrote into the run directory (`steps.csv`, `accumulation.csv`, "
      "`summary.json`; columns in docs/metrics.md) and redraws the ranking and the plots of `mxscope report`. "
      "The run has {} layer x GEMM unit{} and {} strateg{}. Set `RUN` in the first code cell if the run directory "
      "has moved.\n\n",
      run.units.size(), run.units.size() == 1 ? "" : "s", run.strategies.size(),
      run.strategies.size() == 1 ? "y" : "ies");
  out += "## Provenance (from summary.json)\n\n";
  out += facts.fields.empty() ? std::string("(summary.json holds no provenance fields)\n")
                              : markdown_json_items(facts.fields, "", 1);
  if (!facts.analysis_key.empty()) {
    out += fmt::format("\n### Analysis file ({})\n\n", markdown_escape(facts.analysis_key));
    out += markdown_code_block(facts.analysis_text, "toml", "");
  }
  return out;
}

std::string ranking_markdown() {
  return fmt::format(
      "## How the errors add up, and the ranking\n\n"
      "For one layer, GEMM and strategy, `E_t` is the strategy's error at replayed step t. Independent step errors "
      "add like a random walk: `||sum E_t||` grows like sqrt(T), the coherence `||sum E_t|| / sqrt(sum ||E_t||^2)` "
      "stays near 1 and the growth exponent alpha is near 0.5. An error that repeats every step adds coherently: "
      "growth like T, coherence like sqrt(T), alpha near 1.\n\n"
      "The table ranks each unit's strategies by `acc_err = ||sum E_t|| / ||sum G_t||` at the last T (smallest "
      "first). Verdict: **coherent** when alpha >= {}, **averages out** when alpha <= {}, **mixed** in between, "
      "n/a when alpha is undefined.",
      coherent_alpha_threshold, averaging_alpha_threshold);
}

std::string plots_markdown() {
  std::string out = "## Plots\n\nOne figure per layer x GEMM, one panel per plot of the report:\n\n";
  for (const auto& kind : plot_kinds()) {
    out += fmt::format("- **{}** (`{}`): {}\n", markdown_prose(kind.title), kind.id, markdown_prose(kind.explanation));
  }
  return out;
}

// The run directory as the notebook should name it: relative to the notebook's folder when possible.
std::string run_path_for(const std::filesystem::path& run_directory, const std::filesystem::path& notebook_path) {
  std::error_code error;
  const auto run = std::filesystem::weakly_canonical(std::filesystem::absolute(run_directory), error);
  if (error) return std::filesystem::absolute(run_directory).string();
  const auto folder = std::filesystem::weakly_canonical(std::filesystem::absolute(notebook_path).parent_path(), error);
  if (error) return run.string();
  const auto relative = run.lexically_relative(folder);
  if (relative.empty()) return run.string();
  return relative.string();
}

}  // namespace

void write_notebook(const std::filesystem::path& run_directory, const std::filesystem::path& notebook_path) {
  const run_data run = load_run(run_directory);
  std::error_code ignored;
  const std::string name = std::filesystem::weakly_canonical(run_directory, ignored).filename().string();

  std::string setup = replace_all(std::string(setup_code), "@RUN@", python_string(run_path_for(run_directory, notebook_path)));
  std::string load = replace_all(std::string(load_code), "@COLOURS@", colours_literal());
  load = replace_all(load, "@MARKERS@", markers_literal());
  std::string rank = replace_all(std::string(ranking_code), "@COHERENT@", fmt::format("{}", coherent_alpha_threshold));
  rank = replace_all(rank, "@AVERAGING@", fmt::format("{}", averaging_alpha_threshold));
  rank = replace_all(rank, "@BIAS@", fmt::format("{}", coherent_bias_fraction));
  const std::string plot = replace_all(std::string(plot_code), "@KINDS@", kinds_literal());

  nlohmann::json notebook;
  notebook["nbformat"] = 4;
  notebook["nbformat_minor"] = 5;
  notebook["metadata"] = {
      {"kernelspec", {{"display_name", "Python 3"}, {"language", "python"}, {"name", "python3"}}},
      {"language_info", {{"name", "python"}}},
  };
  notebook["cells"] = nlohmann::json::array({
      markdown_cell("intro", intro_markdown(run, name.empty() ? std::string("run") : name)),
      code_cell("setup", setup),
      code_cell("load", load),
      markdown_cell("ranking-intro", ranking_markdown()),
      code_cell("ranking", rank),
      markdown_cell("plots-intro", plots_markdown()),
      code_cell("plot-functions", plot),
      code_cell("plots", std::string(draw_code)),
  });
  io::write_file_atomically(notebook_path,
                            notebook.dump(1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n");
}

}  // namespace mxscope::report
