// mxscope report: gnuplot plots per layer x GEMM and one self-contained HTML page.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <set>
#include <system_error>

#include "mxscope/errors.hpp"
#include "mxscope/io/atomic_file.hpp"
#include "mxscope/report/report.hpp"
#include "mxscope/report/run_data.hpp"
#include "plots.hpp"
#include "text.hpp"

namespace mxscope::report {

namespace {

constexpr std::string_view style_sheet = R"css(
:root { color-scheme: light; }
body { font-family: system-ui, -apple-system, "Segoe UI", "DejaVu Sans", Arial, sans-serif; color: #1f2328;
       background: #ffffff; margin: 0; line-height: 1.45; }
main { max-width: 1800px; margin: 0 auto; padding: 1.5rem 2rem 3rem; }
h1 { font-size: 1.7rem; margin: 0 0 .3rem; }
h2 { font-size: 1.35rem; margin: 2.2rem 0 .6rem; padding-bottom: .25rem; border-bottom: 2px solid #d0d7de; }
h3 { font-size: 1.1rem; margin: 1.4rem 0 .5rem; }
p, li, dd { max-width: 72rem; }
code, pre, .mono { font-family: "DejaVu Sans Mono", Menlo, Consolas, monospace; font-size: .88em; }
pre { background: #f6f8fa; border: 1px solid #d0d7de; border-radius: 4px; padding: .7rem .9rem; overflow-x: auto;
      white-space: pre-wrap; word-break: break-word; max-height: 40rem; }
.lede { color: #57606a; margin-top: 0; }
nav ol { columns: 3 18rem; padding-left: 1.4rem; margin: .3rem 0; }
dl.terms dt { font-weight: 600; margin-top: .5rem; }
dl.terms dd { margin-left: 1.2rem; }
table { border-collapse: collapse; margin: .4rem 0 1rem; font-size: .92rem; }
th, td { border: 1px solid #d0d7de; padding: .3rem .6rem; vertical-align: top; }
th { background: #f6f8fa; text-align: left; font-weight: 600; }
td.number { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
tbody tr:nth-child(even) td { background: #fbfcfd; }
.swatch { display: inline-block; width: 1.1em; margin-right: .25em; text-align: center; }
td.verdict { font-weight: 600; white-space: nowrap; }
p.notice { border-left: 4px solid #8a4600; padding-left: 0.6em; }
td.verdict.coherent, span.verdict.coherent { color: #a40e26; }
td.verdict.averages-out, span.verdict.averages-out { color: #116329; }
td.verdict.mixed, span.verdict.mixed { color: #8a4600; }
td.verdict.undefined, span.verdict.undefined { color: #6e7781; }
.wide { overflow-x: auto; }
table.overview td.cell, table.overview td.strategy { white-space: nowrap; }
table.overview th { font-weight: 600; }
span.verdict { font-weight: 600; }
.unit-facts { color: #57606a; margin: .2rem 0 .6rem; }
.plots { display: grid; grid-template-columns: repeat(auto-fill, minmax(600px, 1fr)); gap: 1.2rem 1.6rem; }
figure { margin: 0; }
figure img { width: 100%; height: auto; border: 1px solid #e1e4e8; border-radius: 4px; }
figcaption { font-size: .88rem; color: #3d444d; margin-top: .35rem; }
figcaption b { color: #1f2328; }
table.provenance > tbody > tr > td:first-child { font-weight: 600; white-space: nowrap; }
table.provenance table { margin: 0; }
footer { color: #6e7781; font-size: .85rem; margin-top: 3rem; }
)css";

std::string verdict_class(verdict value) {
  switch (value) {
    case verdict::coherent:
    case verdict::coherent_bias: return "coherent";
    case verdict::averages_out: return "averages-out";
    case verdict::mixed: return "mixed";
    case verdict::undefined: break;
  }
  return "undefined";
}

// The strategy's colour and marker shape, as in the plots.
std::string swatch(std::size_t strategy_index) {
  const strategy_style style = style_of_strategy(strategy_index);
  return fmt::format("<span class=\"swatch\" style=\"color:{}\">{}</span>", style.colour, style.glyph);
}

std::string run_name(const std::filesystem::path& directory) {
  std::error_code ignored;
  const std::filesystem::path canonical = std::filesystem::weakly_canonical(directory, ignored);
  std::string name = canonical.filename().string();
  if (name.empty()) name = directory.filename().string();
  if (name.empty()) name = "run";
  return name;
}

// ------------------------------------------------------------------------------------------------
// summary.json members as HTML.

std::string json_value_html(const nlohmann::ordered_json& value, int depth);

std::string json_scalar_text(const nlohmann::ordered_json& value) {
  if (value.is_string()) return value.get<std::string>();
  return value.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

std::string pretty_json(const nlohmann::ordered_json& value) {
  return fmt::format("<pre>{}</pre>", html_escape(value.dump(2, ' ', false, nlohmann::json::error_handler_t::replace)));
}

std::string json_object_html(const nlohmann::ordered_json& object, int depth) {
  std::string out = "<table class=\"provenance\"><tbody>\n";
  for (auto member = object.begin(); member != object.end(); ++member) {
    out += fmt::format("<tr><td>{}</td><td>{}</td></tr>\n", html_escape(member.key()),
                       json_value_html(member.value(), depth + 1));
  }
  return out + "</tbody></table>";
}

// An array of flat objects (e.g. one per input file with its sha256) reads best as a table.
bool is_table_of_records(const nlohmann::ordered_json& array) {
  if (!array.is_array() || array.empty()) return false;
  return std::all_of(array.begin(), array.end(), [](const nlohmann::ordered_json& element) {
    return element.is_object() && std::all_of(element.begin(), element.end(),
                                              [](const nlohmann::ordered_json& field) { return field.is_primitive(); });
  });
}

std::string records_html(const nlohmann::ordered_json& array) {
  std::vector<std::string> columns;
  for (const auto& element : array) {
    for (auto field = element.begin(); field != element.end(); ++field) {
      if (std::find(columns.begin(), columns.end(), field.key()) == columns.end()) columns.push_back(field.key());
    }
  }
  std::string out = "<table><thead><tr>";
  for (const auto& column : columns) out += fmt::format("<th>{}</th>", html_escape(column));
  out += "</tr></thead><tbody>\n";
  for (const auto& element : array) {
    out += "<tr>";
    for (const auto& column : columns) {
      const auto field = element.find(column);
      out += fmt::format("<td class=\"mono\">{}</td>",
                         field == element.end() ? std::string() : html_escape(json_scalar_text(*field)));
    }
    out += "</tr>\n";
  }
  return out + "</tbody></table>";
}

std::string json_value_html(const nlohmann::ordered_json& value, int depth) {
  if (value.is_string()) {
    const std::string text = value.get<std::string>();
    if (text.find('\n') != std::string::npos || text.size() > 160) return fmt::format("<pre>{}</pre>", html_escape(text));
    return fmt::format("<span class=\"mono\">{}</span>", html_escape(text));
  }
  if (value.is_primitive()) return fmt::format("<span class=\"mono\">{}</span>", html_escape(json_scalar_text(value)));
  if (depth > 3) return pretty_json(value);
  if (value.is_object()) return value.empty() ? std::string("{}") : json_object_html(value, depth);
  if (std::all_of(value.begin(), value.end(), [](const nlohmann::ordered_json& element) { return element.is_primitive(); })) {
    std::string out = "<span class=\"mono\">";
    bool first = true;
    for (const auto& element : value) {
      if (!first) out += ", ";
      out += html_escape(json_scalar_text(element));
      first = false;
    }
    return out + "</span>";
  }
  if (is_table_of_records(value)) return records_html(value);
  return pretty_json(value);
}

// ------------------------------------------------------------------------------------------------
// The page.

std::string how_to_read_html() {
  std::string out;
  out += "<section id=\"how-to-read\">\n<h2>How to read this report</h2>\n";
  out += fmt::format(
      "<p>For one layer, one GEMM and one strategy, E<sub>t</sub> is the difference between the strategy's result "
      "and the exact reference G<sub>t</sub> at replayed step t. A weight update sums many steps, so what matters "
      "is how the step errors add up. If they are independent from step to step they add like a random walk: the "
      "summed error grows like sqrt(T), the <b>coherence</b> ||&sum; E<sub>t</sub>|| / sqrt(&sum; "
      "||E<sub>t</sub>||<sup>2</sup>) stays near 1 and the growth exponent <b>alpha</b> (slope of log ||&sum; "
      "E<sub>t</sub>|| against log T) is near 0.5. If the same error repeats every step they add coherently: the "
      "summed error grows like T, coherence follows sqrt(T) and alpha is near 1. A coherent error is the dangerous "
      "kind: it does not shrink relative to the gradient signal however many steps are summed.</p>\n"
      "<p>The <b>verdict</b> column reads alpha at the last T: <span class=\"verdict coherent\">coherent</span> "
      "when alpha &ge; {}, <span class=\"verdict averages-out\">averages out</span> when alpha &le; {}, "
      "<span class=\"verdict mixed\">mixed</span> in between (a coherent part under random noise, or a window too "
      "short to tell), n/a when alpha is undefined (fewer than 2 steps, or no error at all). A bias that keeps its "
      "sign at every step and is at least {} of the final acc_err overrides alpha: <span class=\"verdict "
      "coherent\">coherent (bias)</span>, since each step then scales the gradient by a similar factor, the "
      "summed update keeps it, and it is most of the summed error. alpha is a slope over the whole window: on a window whose steps are not consecutive "
      "(summary.json's <span class=\"mono\">consecutive</span>) it mostly measures how the gradient's size changed "
      "between its parts.</p>\n"
      "<p class=\"notice\"><b>What these numbers do not say.</b> The verdicts and the acc_err ranking describe "
      "the replayed window. Whether any of them predicts what a recipe costs in training (the tokens it needs to "
      "reach bf16's loss) is tested in docs/validation.md on trained recipe ladders. On the H200 ladder "
      "(data/ablation/h200: two model sizes, 3 to 5 seeds, 12 quantized recipes, fitted on one size and tested "
      "on the other) no metric computed on shared operands, as here (one capture replayed under every "
      "strategy), predicted the cost, and no metric ranked the MXFP4 recipes among themselves; the one metric "
      "that passed (Fprop bias_coherence on each recipe's own late-training capture) mostly tells fp8, NVFP4 "
      "and MXFP4 apart. So the ranking is not a ranking of recipes by training cost.</p>\n",
      coherent_alpha_threshold, averaging_alpha_threshold, coherent_bias_fraction);
  out += "<h3>Ranking table columns</h3>\n<dl class=\"terms\">\n";
  const std::pair<std::string_view, std::string_view> columns[] = {
      {"rank, acc_err", "Strategies are ranked by acc_err = ||&sum; E<sub>t</sub>|| / ||&sum; G<sub>t</sub>|| at the "
                        "last T, smallest first: the error of the summed update."},
      {"rel_err mean", "The mean over steps of ||E<sub>t</sub>|| / ||G<sub>t</sub>||: the one-step error size. A "
                       "strategy can win on rel_err and lose on acc_err when its errors are coherent."},
      {"bias mean", "The mean over steps of &lt;E<sub>t</sub>, G<sub>t</sub>&gt; / ||G<sub>t</sub>||<sup>2</sup>: "
                    "negative when the strategy shrinks the gradient; \"every step\" when no step has the other sign."},
      {"coherence", "At the last T; compare with 1 (independent errors) and sqrt(T) (identical errors), given in the "
                    "column header."},
      {"alpha", "The least-squares slope of log ||&sum;<sub>t&le;s</sub> E<sub>t</sub>|| against log s over s = 1..T."},
      {"lag1_corr", "The mean cosine between successive step errors: near 0 for independent errors, near 1 when the "
                    "error repeats."},
      {"structural_share", "||mean E<sub>t</sub>||<sup>2</sup> / mean ||E<sub>t</sub>||<sup>2</sup>: the share of the "
                           "error energy that is the same every step."},
      {"SGD / AdamW disp_err", "The relative error of the weights' displacement over the window when the optimizer "
                               "(SGD momentum 0.9, AdamW beta 0.9/0.95) is fed the strategy's results instead of the "
                               "reference."},
      {"not shown: ulp_max, ulp_mean", "steps.csv has them, but for 4- and 8-bit strategies they reach 1e8-1e9 and "
                                       "tell nothing; they mean something for bf16 and accumulation-model studies."},
  };
  for (const auto& [term, definition] : columns) {
    out += fmt::format("<dt>{}</dt><dd>{}</dd>\n", term, definition);
  }
  out += "</dl>\n<p>Every plot is explained under it; one colour per strategy throughout the page. Undefined "
         "values (nan) and, on log axes, zeros are not drawn.</p>\n</section>\n";
  return out;
}

std::string ranking_html(const std::vector<ranking_row>& rows) {
  long long final_T = 0;
  for (const auto& row : rows) final_T = std::max(final_T, row.T);
  std::string out = "<table class=\"ranking\">\n<thead><tr><th>rank</th><th>strategy</th>";
  out += fmt::format("<th>acc_err (T = {})</th><th>rel_err mean</th><th>coherence (sqrt(T) = {})</th>", final_T,
                     short_number(std::sqrt(static_cast<double>(final_T))));
  out += "<th>alpha</th><th>bias mean</th><th>verdict</th><th>lag1_corr</th><th>structural_share</th>"
         "<th>SGD disp_err</th><th>AdamW disp_err</th></tr></thead>\n<tbody>\n";
  for (const ranking_row& row : rows) {
    out += fmt::format("<tr><td class=\"number\">{}</td><td class=\"strategy\">{}{}</td>", row.rank,
                       swatch(row.strategy_index), html_escape(row.strategy));
    for (const double value : {row.acc_err, row.rel_err_mean, row.coherence, row.alpha}) {
      out += fmt::format("<td class=\"number\">{}</td>", short_number(value));
    }
    out += fmt::format("<td class=\"number\">{}{}</td>", short_number(row.bias_mean),
                       row.bias_one_sign ? " (every step)" : "");
    out += fmt::format("<td class=\"verdict {}\">{}</td>", verdict_class(row.verdict), verdict_text(row.verdict));
    for (const double value : {row.lag1_corr, row.structural_share, row.sgd_disp_err, row.adamw_disp_err}) {
      out += fmt::format("<td class=\"number\">{}</td>", short_number(value));
    }
    out += "</tr>\n";
  }
  return out + "</tbody>\n</table>\n";
}

std::string unit_heading(const unit_data& unit) {
  return fmt::format("{} <span class=\"mono\">{}</span>", html_escape(unit.layer), html_escape(unit.gemm));
}

std::string unit_facts(const unit_data& unit) {
  long long first_step = 0;
  long long last_step = 0;
  long long steps = 0;
  bool any = false;
  for (const auto& series : unit.strategies) {
    for (const auto& record : series.steps) {
      first_step = any ? std::min(first_step, record.step) : record.step;
      last_step = any ? std::max(last_step, record.step) : record.step;
      any = true;
    }
    steps = std::max(steps, static_cast<long long>(series.steps.size()));
  }
  const strategy_series& first = unit.strategies.front();
  return fmt::format("<p class=\"unit-facts\">{} replayed steps (training steps {} to {}); operands: "
                     "<span class=\"mono\">{}</span> (solid in the operand plots) and <span class=\"mono\">{}</span> "
                     "(dashed); {} strategies.</p>\n",
                     steps, first_step, last_step, html_escape(first.a_role), html_escape(first.b_role),
                     unit.strategies.size());
}

// Strategies down, layer x GEMM units across: in a run the strategies are few and their names long,
// while a model has many layers (the table scrolls sideways then). Strategies are ordered by their
// mean rank over the units, the run's overall ranking.
std::string overview_html(const run_data& run, const std::vector<std::vector<ranking_row>>& rankings) {
  struct strategy_line {
    std::size_t strategy_index = 0;
    double mean_rank = 0.0;
  };
  std::vector<strategy_line> lines;
  for (std::size_t strategy = 0; strategy < run.strategies.size(); ++strategy) {
    double rank_sum = 0.0;
    int units = 0;
    for (const auto& rows : rankings) {
      for (const ranking_row& row : rows) {
        if (row.strategy_index != strategy) continue;
        rank_sum += static_cast<double>(row.rank);
        ++units;
      }
    }
    lines.push_back({strategy, units == 0 ? std::nan("") : rank_sum / units});
  }
  std::stable_sort(lines.begin(), lines.end(), [](const strategy_line& left, const strategy_line& right) {
    return left.mean_rank < right.mean_rank;
  });

  std::string out = "<section id=\"overview\">\n<h2>Overview</h2>\n<p>Each cell: the strategy's rank by final "
                    "acc_err within the layer x GEMM (1 = smallest summed error), its verdict and, in brackets, "
                    "alpha (see <a href=\"#how-to-read\">How to read this report</a>). Strategies are listed by "
                    "their mean rank.</p>\n";
  out += "<div class=\"wide\"><table class=\"overview\">\n<thead><tr><th>strategy</th><th>mean rank</th>";
  for (std::size_t unit_index = 0; unit_index < run.units.size(); ++unit_index) {
    out += fmt::format("<th><a href=\"#unit-{}\">{}</a></th>", unit_index + 1, unit_heading(run.units[unit_index]));
  }
  out += "</tr></thead>\n<tbody>\n";
  for (const auto& line : lines) {
    out += fmt::format("<tr><td class=\"strategy\">{}{}</td><td class=\"number\">{}</td>", swatch(line.strategy_index),
                       html_escape(run.strategies[line.strategy_index]), short_number(line.mean_rank));
    for (const auto& rows : rankings) {
      const auto found = std::find_if(rows.begin(), rows.end(), [&](const ranking_row& row) {
        return row.strategy_index == line.strategy_index;
      });
      if (found == rows.end()) {
        out += "<td></td>";
      } else {
        out += fmt::format("<td class=\"cell\"><b>{}</b> <span class=\"verdict {}\">{}</span> ({})</td>",
                           found->rank, verdict_class(found->verdict), verdict_text(found->verdict),
                           short_number(found->alpha));
      }
    }
    out += "</tr>\n";
  }
  return out + "</tbody>\n</table></div>\n</section>\n";
}

std::string provenance_html(const provenance& facts) {
  std::string out = "<section id=\"provenance\">\n<h2>Provenance</h2>\n<p>From summary.json.</p>\n";
  out += facts.fields.empty() ? "<p>(summary.json holds no provenance fields)</p>\n"
                              : json_object_html(facts.fields, 1) + "\n";
  if (!facts.analysis_key.empty()) {
    out += fmt::format("<h3>Analysis file <span class=\"mono\">({})</span></h3>\n<pre>{}</pre>\n",
                       html_escape(facts.analysis_key), html_escape(facts.analysis_text));
  }
  return out + "</section>\n";
}

struct unit_plots {
  std::vector<plot> plots;
  std::vector<rendered_plot> files;
};

std::string page_html(const run_data& run, const std::vector<unit_plots>& plots_by_unit, const std::string& name) {
  std::vector<std::vector<ranking_row>> rankings;
  for (const auto& unit : run.units) rankings.push_back(rank_strategies(unit));
  const provenance facts = provenance_of(run.summary);

  std::string out;
  out += "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n";
  out += "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n";
  out += fmt::format("<title>mxscope report: {}</title>\n<style>{}</style>\n</head>\n<body>\n<main>\n",
                     html_escape(name), style_sheet);
  out += fmt::format("<h1>mxscope report: {}</h1>\n", html_escape(name));
  out += fmt::format("<p class=\"lede\">How the quantization error of {} layer x GEMM result{} accumulates over the "
                     "replayed steps, for {} strateg{}.</p>\n",
                     run.units.size(), run.units.size() == 1 ? "" : "s", run.strategies.size(),
                     run.strategies.size() == 1 ? "y" : "ies");

  out += "<nav>\n<h2>Contents</h2>\n<ol>\n<li><a href=\"#overview\">Overview</a></li>\n"
         "<li><a href=\"#how-to-read\">How to read this report</a></li>\n";
  for (std::size_t index = 0; index < run.units.size(); ++index) {
    out += fmt::format("<li><a href=\"#unit-{}\">{}</a></li>\n", index + 1, unit_heading(run.units[index]));
  }
  out += "<li><a href=\"#provenance\">Provenance</a></li>\n</ol>\n</nav>\n";

  out += overview_html(run, rankings);
  out += how_to_read_html();

  for (std::size_t index = 0; index < run.units.size(); ++index) {
    const unit_data& unit = run.units[index];
    out += fmt::format("<section class=\"unit\" id=\"unit-{}\">\n<h2>{}</h2>\n", index + 1, unit_heading(unit));
    out += unit_facts(unit);
    out += ranking_html(rankings[index]);
    out += "<div class=\"plots\">\n";
    const unit_plots& plots = plots_by_unit[index];
    for (std::size_t plot_index = 0; plot_index < plots.plots.size(); ++plot_index) {
      const plot& figure = plots.plots[plot_index];
      out += fmt::format(
          "<figure id=\"unit-{}-{}\"><img alt=\"{}\" width=\"{}\" height=\"{}\" "
          "src=\"data:image/svg+xml;base64,{}\">\n<figcaption><b>{}.</b> {}</figcaption></figure>\n",
          index + 1, figure.kind->id, html_escape(figure.title), plot_width_pixels, figure.height,
          base64_encode(plots.files[plot_index].svg),
          html_escape(figure.kind->title), html_escape(figure.kind->explanation));
    }
    out += "</div>\n</section>\n";
  }

  out += provenance_html(facts);
  out += "<footer>Written by mxscope report from steps.csv, accumulation.csv and summary.json; the plots are "
         "also in the run's plots/ folder as SVG and PNG.</footer>\n</main>\n</body>\n</html>\n";
  return out;
}

}  // namespace

report_outputs write_report(const std::filesystem::path& run_directory, const report_options& options) {
  const run_data run = load_run(run_directory);
  gnuplot_renderer renderer(options.gnuplot_program);

  // Draw everything first; only then write, so a failure leaves the run directory as it was.
  const std::vector<std::string> prefixes = unit_file_prefixes(run.units);
  std::vector<unit_plots> plots_by_unit;
  for (std::size_t index = 0; index < run.units.size(); ++index) {
    unit_plots plots;
    plots.plots = plots_for_unit(run.units[index], prefixes[index]);
    plots.files = renderer.render(plots.plots);
    plots_by_unit.push_back(std::move(plots));
  }
  const std::string page = page_html(run, plots_by_unit, run_name(run_directory));

  report_outputs outputs;
  outputs.png_terminal = renderer.png_terminal();
  const std::filesystem::path plot_directory = run_directory / "plots";
  std::error_code created;
  std::filesystem::create_directories(plot_directory, created);
  if (created) {
    throw input_error(fmt::format("{}: cannot create the plots directory: {}", plot_directory.string(),
                                  created.message()));
  }
  for (const auto& plots : plots_by_unit) {
    for (std::size_t index = 0; index < plots.plots.size(); ++index) {
      const auto svg_path = plot_directory / (plots.plots[index].file_stem + ".svg");
      const auto png_path = plot_directory / (plots.plots[index].file_stem + ".png");
      io::write_file_atomically(svg_path, plots.files[index].svg);
      io::write_file_atomically(png_path, plots.files[index].png);
      outputs.plot_files.push_back(svg_path);
      outputs.plot_files.push_back(png_path);
    }
  }
  outputs.html = run_directory / "report.html";
  io::write_file_atomically(outputs.html, page);
  return outputs;
}

}  // namespace mxscope::report
