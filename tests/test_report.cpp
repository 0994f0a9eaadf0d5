// mxscope report and mxscope notebook on a synthetic run written here: 2 layers x 1 GEMM x 4
// strategies x 12 steps with known properties (an error that repeats every step: coherence sqrt(T),
// alpha 1; independent errors: coherence about 1, alpha about 0.5; one in between, named "<b>&" to
// test escaping; independent errors over a bias of one sign every step). The checks are
// independent of the code under test: file names and plot kinds typed from docs/report.md, the
// expected ranking from this file's own acc_err values, verdicts from the bias and alpha rules of
// docs/report.md, PNG and SVG recognised by their magic bytes and root
// element, the notebook validated by Debian's python3-nbformat and its code cells run by Debian's
// python3 with pandas and matplotlib (Agg backend). Bad inputs: exit 2, a message naming the file,
// line and column, and nothing written.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "support/temporary_directory.hpp"
#include "mxscope/cli/cli.hpp"
#include "mxscope/errors.hpp"
#include "mxscope/report/csv.hpp"
#include "../src/report/plots.hpp"

namespace {

using mxscope::testing::temporary_directory;

namespace fs = std::filesystem;

// ---------------------------------------------------------------------------------------------
// Files, processes and the CLI.


std::string read_text(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

void write_text(const fs::path& path, const std::string& contents) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << contents;
}

// Every file under `directory`, relative to it, sorted.
std::vector<std::string> listing(const fs::path& directory) {
  std::vector<std::string> names;
  for (const auto& entry : fs::recursive_directory_iterator(directory)) {
    names.push_back(fs::relative(entry.path(), directory).string());
  }
  std::sort(names.begin(), names.end());
  return names;
}

struct cli_result {
  int code = -1;
  std::string out;
  std::string err;
};

cli_result run_cli(const std::vector<std::string>& arguments) {
  std::vector<const char*> argv{"mxscope"};
  for (const auto& argument : arguments) argv.push_back(argument.c_str());
  std::ostringstream out, err;
  cli_result result;
  result.code = mxscope::cli::run(static_cast<int>(argv.size()), argv.data(), out, err);
  result.out = out.str();
  result.err = err.str();
  return result;
}

std::string shell_quoted(const std::string& text) {
  std::string out = "'";
  for (const char c : text) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

struct process_result {
  int code = -1;
  std::string output;
};

// Debian's interpreter: tools/bootstrap installs python3-nbformat, -pandas and -matplotlib for it;
// a python3 found first on PATH may be another interpreter without them.
constexpr const char* python = "/usr/bin/python3";

process_result run_python(const fs::path& scratch, const std::string& script, const std::vector<std::string>& arguments) {
  const fs::path script_path = scratch / "script.py";
  const fs::path log_path = scratch / "python.log";
  write_text(script_path, script);
  std::string command = fmt::format("MPLBACKEND=Agg {} {}", python, shell_quoted(script_path.string()));
  for (const auto& argument : arguments) command += fmt::format(" {}", shell_quoted(argument));
  command += fmt::format(" > {} 2>&1", shell_quoted(log_path.string()));
  const int status = std::system(command.c_str());
  process_result result;
  result.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  result.output = read_text(log_path);
  return result;
}

// Empty when the interpreter imports `modules`; otherwise why not, for a failure message.
std::string python_import_problem(const fs::path& scratch, const std::string& modules, const std::string& packages) {
  const process_result probe = run_python(scratch, fmt::format("import {}\n", modules), {});
  if (probe.code == 0) return {};
  return fmt::format("{} cannot import {} (Debian packages {}; tools/bootstrap installs them):\n{}", python, modules,
                     packages, probe.output);
}

// ---------------------------------------------------------------------------------------------
// The synthetic run. Column lists typed from docs/metrics.md.

const std::vector<std::string> step_columns = {
    "layer",          "gemm",          "strategy",        "step",           "t",
    "rel_err",        "cosine",        "bias",            "orth_err",       "max_abs_err",
    "ulp_max",        "ulp_mean",      "ulp_exact_frac",  "quant_err",      "accum_err",
    "a_role",         "b_role",        "a_underflow_frac", "b_underflow_frac", "a_saturate_frac",
    "b_saturate_frac", "a_snr_db",     "b_snr_db",        "attr_a_flush",   "attr_a_clip",
    "attr_a_round",   "attr_b_flush",  "attr_b_clip",     "attr_b_round"};

const std::vector<std::string> accumulation_columns = {
    "layer",     "gemm",      "strategy",         "T",           "step",         "acc_err",       "coherence",
    "alpha",     "lag1_corr", "structural_share", "sgd_upd_err", "sgd_disp_err", "adamw_upd_err", "adamw_disp_err"};

// The plot kinds and file names of docs/report.md: RUN/plots/<layer>.<gemm>.<kind>.svg|png.
const std::vector<std::string> plot_kinds = {"rel_err", "angle",     "bias",       "acc_err",  "coherence",
                                             "growth",  "underflow", "saturation", "optimizer"};

constexpr int window = 12;
const std::vector<std::string> layers = {"blocks.0.mlp.fc1", "blocks.1.attn.qkv"};
const std::string gemm = "wgrad";

// shrinking: errors that average out by alpha, but with a one-signed bias every step (the report's
// "coherent (bias)").
enum class behaviour { coherent, random_walk, in_between, shrinking };

struct strategy_case {
  std::string name;
  behaviour kind;
  double final_alpha;
  std::vector<double> final_acc_err;  // per layer
};

// Layer 0 ranks random < in-between < coherent; layer 1 the reverse, so a ranking that ignored
// the values (or sorted one layer's order onto the other) fails.
const std::vector<strategy_case> strategies = {
    {"mxfp4 rne", behaviour::coherent, 1.0, {0.04, 0.005}},
    {"mxfp4 sr per-step", behaviour::random_walk, 0.5 + 0.02 * std::cos(12.0), {0.01, 0.03}},
    {"<b>&", behaviour::in_between, 0.68, {0.02, 0.012}},
    {"mxfp4 shrinks", behaviour::shrinking, 0.5 + 0.02 * std::cos(12.0), {0.015, 0.02}},
};

// The per-step rel_err and bias of a behaviour at step t of the window.
std::pair<double, double> step_error(behaviour kind, int t) {
  switch (kind) {
    case behaviour::random_walk: return {0.08 * (1.0 + 0.1 * std::sin(t)), 0.002 * std::sin(t)};
    case behaviour::in_between: return {0.06 * (1.0 + 0.05 * std::cos(t)), -0.004};
    case behaviour::shrinking: return {0.08 * (1.0 + 0.1 * std::sin(t)), -0.03 + 0.002 * std::sin(t)};
    case behaviour::coherent: break;
  }
  return {0.05, -0.01};
}

std::string number(double value) { return fmt::format("{:.17g}", value); }

std::string row_text(const std::vector<std::string>& fields) { return fmt::format("{}\n", fmt::join(fields, ",")); }

std::string steps_csv() {
  std::string text = row_text(step_columns);
  for (std::size_t layer = 0; layer < layers.size(); ++layer) {
    for (const auto& strategy : strategies) {
      for (int t = 1; t <= window; ++t) {
        const auto [rel_err, bias] = step_error(strategy.kind, t);
        double cosine = 1.0 - 0.00125;
        double a_saturate = 0.001;
        if (strategy.kind == behaviour::random_walk || strategy.kind == behaviour::shrinking) {
          cosine = 1.0 - 0.0032;
          a_saturate = 0.0;
        } else if (strategy.kind == behaviour::in_between) {
          cosine = 1.0;  // 1 - cosine = 0: no point on the log axis
          a_saturate = 0.0005;
        }
        text += row_text({layers[layer], gemm, strategy.name, std::to_string(100 + t), std::to_string(t),
                          number(rel_err), number(cosine), number(bias), number(rel_err * 0.9), number(0.5),
                          "12", number(1.5), number(0.25), number(rel_err * 0.99), number(rel_err * 0.01), "dy", "x",
                          number(0.02 + 0.001 * t), number(0.05), number(a_saturate), "0", "inf", number(31.5),
                          "nan", "nan", "nan", "nan", "nan", "nan"});
      }
    }
  }
  return text;
}

std::string accumulation_csv() {
  std::string text = row_text(accumulation_columns);
  for (std::size_t layer = 0; layer < layers.size(); ++layer) {
    for (const auto& strategy : strategies) {
      for (int T = 1; T <= window; ++T) {
        const double final_acc_err = strategy.final_acc_err[layer];
        const double ratio = static_cast<double>(window) / T;
        double acc_err = final_acc_err;
        double coherence = std::sqrt(static_cast<double>(T));
        double alpha = 1.0;
        double lag1 = 1.0;
        double structural = 1.0;
        if (strategy.kind == behaviour::random_walk || strategy.kind == behaviour::shrinking) {
          acc_err = final_acc_err * std::sqrt(ratio);
          coherence = T == 1 ? 1.0 : 1.0 + 0.05 * std::sin(T);
          alpha = 0.5 + 0.02 * std::cos(T);
          lag1 = 0.01;
          structural = 1.0 / T;
        } else if (strategy.kind == behaviour::in_between) {
          acc_err = final_acc_err * std::pow(ratio, 0.3);
          coherence = std::pow(T, 0.2);
          alpha = 0.68;
          lag1 = 0.4;
          structural = 0.3;
        }
        if (T == 1) alpha = lag1 = std::nan("");
        text += row_text({layers[layer], gemm, strategy.name, std::to_string(T), std::to_string(100 + T),
                          number(acc_err), number(coherence), number(alpha), number(lag1), number(structural),
                          number(acc_err * 0.8), number(acc_err * 0.9), number(acc_err * 1.5), number(acc_err * 1.7)});
      }
    }
  }
  return text;
}

const std::string analysis_text = "[[strategy]]\nname = \"<b>&\"\nformat = \"mxfp4\"\n";
const std::string started_at = "2025-01-02T03:04:05Z";

std::string summary_json() {
  nlohmann::ordered_json summary;
  summary["provenance"] = {
      {"mxscope_version", "0.1.0"},
      {"git_hash", "0123456789ab"},
      {"device", "cpu"},
      {"threads", 2},
      {"consecutive_window", true},
      {"started_at", started_at},
      {"analysis", analysis_text},
      {"inputs", nlohmann::ordered_json::array({{{"file", "manifest.json"}, {"sha256", std::string(64, 'a')}}})},
      {"wall_seconds", {{"replay", 1.5}, {"reference", 0.25}}},
  };
  nlohmann::ordered_json units = nlohmann::ordered_json::array();
  for (const auto& layer : layers) {
    for (const auto& strategy : strategies) units.push_back({{"layer", layer}, {"gemm", gemm}, {"strategy", strategy.name}});
  }
  summary["units"] = units;
  return summary.dump(2);
}

fs::path write_synthetic_run(const fs::path& directory) {
  fs::create_directories(directory);
  write_text(directory / "steps.csv", steps_csv());
  write_text(directory / "accumulation.csv", accumulation_csv());
  write_text(directory / "summary.json", summary_json());
  return directory;
}

// The expected ranking of a layer: strategies by this file's final acc_err, smallest first.
std::vector<std::string> expected_order(std::size_t layer) {
  std::vector<const strategy_case*> order;
  for (const auto& strategy : strategies) order.push_back(&strategy);
  std::stable_sort(order.begin(), order.end(), [layer](const strategy_case* left, const strategy_case* right) {
    return left->final_acc_err[layer] < right->final_acc_err[layer];
  });
  std::vector<std::string> names;
  for (const auto* strategy : order) names.push_back(strategy->name);
  return names;
}

// The verdict rule of docs/report.md, typed here: a bias of one sign at every step with |mean bias|
// >= 0.5 x the final acc_err is "coherent (bias)"; otherwise coherent at alpha >= 0.75, averages out
// at <= 0.6, mixed in between.
std::string expected_verdict(double alpha) {
  if (std::isnan(alpha)) return "n/a";
  if (alpha >= 0.75) return "coherent";
  if (alpha <= 0.6) return "averages out";
  return "mixed";
}

std::string expected_verdict(const strategy_case& strategy, std::size_t layer) {
  double bias_sum = 0.0;
  bool negative = true, positive = true;
  for (int t = 1; t <= window; ++t) {
    const double bias = step_error(strategy.kind, t).second;
    bias_sum += bias;
    negative = negative && bias < 0.0;
    positive = positive && bias > 0.0;
  }
  if ((negative || positive) && std::fabs(bias_sum / window) >= 0.5 * strategy.final_acc_err[layer]) {
    return "coherent (bias)";
  }
  return expected_verdict(strategy.final_alpha);
}

const strategy_case& strategy_named(const std::string& name) {
  for (const auto& strategy : strategies) {
    if (strategy.name == name) return strategy;
  }
  throw std::logic_error("unknown strategy " + name);
}

std::string escaped(const std::string& text) {
  std::string out;
  for (const char c : text) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      case '\'': out += "&#39;"; break;
      default: out += c;
    }
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// File format checks.

// PNG: the 8-byte signature, then the IHDR chunk (length 13) with a nonzero width and height.
std::string png_problem(const std::string& bytes) {
  const std::string signature = "\x89PNG\r\n\x1a\n";
  if (bytes.size() < 33) return fmt::format("only {} bytes", bytes.size());
  if (bytes.compare(0, 8, signature) != 0) return "no PNG signature";
  if (bytes.compare(12, 4, "IHDR") != 0) return "the first chunk is not IHDR";
  const auto be32 = [&](std::size_t at) {
    return (static_cast<std::uint32_t>(static_cast<unsigned char>(bytes[at])) << 24) |
           (static_cast<std::uint32_t>(static_cast<unsigned char>(bytes[at + 1])) << 16) |
           (static_cast<std::uint32_t>(static_cast<unsigned char>(bytes[at + 2])) << 8) |
           static_cast<std::uint32_t>(static_cast<unsigned char>(bytes[at + 3]));
  };
  if (be32(8) != 13) return "IHDR length is not 13";
  if (be32(16) == 0 || be32(20) == 0) return "zero width or height";
  if (bytes.find("IEND") == std::string::npos) return "no IEND chunk";
  return {};
}

// SVG: after an optional XML declaration, doctype, comments and white space, the root element is
// <svg ...>, and the document ends with </svg>.
std::string svg_problem(const std::string& text) {
  std::size_t at = 0;
  const auto skip_space = [&] {
    while (at < text.size() && std::isspace(static_cast<unsigned char>(text[at]))) ++at;
  };
  while (true) {
    skip_space();
    if (text.compare(at, 5, "<?xml") == 0) {
      at = text.find("?>", at);
      if (at == std::string::npos) return "unterminated XML declaration";
      at += 2;
    } else if (text.compare(at, 4, "<!--") == 0) {
      at = text.find("-->", at);
      if (at == std::string::npos) return "unterminated comment";
      at += 3;
    } else if (text.compare(at, 9, "<!DOCTYPE") == 0) {
      at = text.find('>', at);
      if (at == std::string::npos) return "unterminated doctype";
      at += 1;
    } else {
      break;
    }
  }
  if (text.compare(at, 4, "<svg") != 0 || at + 4 >= text.size() ||
      !(std::isspace(static_cast<unsigned char>(text[at + 4])) || text[at + 4] == '>')) {
    return fmt::format("the root element is not <svg>: '{}'", text.substr(at, 40));
  }
  std::size_t end = text.size();
  while (end > 0 && std::isspace(static_cast<unsigned char>(text[end - 1]))) --end;
  if (end < 6 || text.compare(end - 6, 6, "</svg>") != 0) return "does not end with </svg>";
  return {};
}

// ---------------------------------------------------------------------------------------------
// Reading the page back.

std::string between(const std::string& text, const std::string& open, const std::string& close, std::size_t from = 0) {
  const std::size_t start = text.find(open, from);
  if (start == std::string::npos) return {};
  const std::size_t end = text.find(close, start + open.size());
  if (end == std::string::npos) return {};
  return text.substr(start + open.size(), end - start - open.size());
}

struct ranking_line {
  std::string strategy;  // as written in the HTML (escaped)
  std::string verdict;
};

// The rows of the ranking table of <section id="unit-N">.
std::vector<ranking_line> ranking_of_unit(const std::string& html, int unit) {
  const std::string section = between(html, fmt::format("id=\"unit-{}\">", unit), "</section>");
  const std::string body = between(between(section, "<table class=\"ranking\">", "</table>"), "<tbody>", "</tbody>");
  std::vector<ranking_line> lines;
  std::size_t at = 0;
  while ((at = body.find("<tr>", at)) != std::string::npos) {
    const std::string row = between(body, "<tr>", "</tr>", at);
    ranking_line line;
    const std::string strategy_cell = between(row, "<td class=\"strategy\">", "</td>");
    const std::size_t swatch_end = strategy_cell.find("</span>");
    line.strategy = swatch_end == std::string::npos ? strategy_cell : strategy_cell.substr(swatch_end + 7);
    const std::string verdict_cell = between(row, "<td class=\"verdict", "</td>");
    line.verdict = verdict_cell.substr(verdict_cell.find("\">") + 2);
    lines.push_back(line);
    at += 4;
  }
  return lines;
}

std::vector<std::string> attribute_values(const std::string& html, const std::string& attribute) {
  std::vector<std::string> values;
  const std::string open = attribute + "=\"";
  std::size_t at = 0;
  while ((at = html.find(open, at)) != std::string::npos) {
    const std::size_t end = html.find('"', at + open.size());
    values.push_back(html.substr(at + open.size(), end - at - open.size()));
    at = end;
  }
  return values;
}

std::vector<std::string> input_files() { return {"accumulation.csv", "steps.csv", "summary.json"}; }

// ---------------------------------------------------------------------------------------------
// The CSV reader on its own.

TEST(ReportCsv, ReadsQuotedFieldsCrlfAndBlankLines) {
  const auto table = mxscope::report::csv_table::parse(
      "name,value\r\n\"a,b\",1.5\r\n\r\n\"say \"\"hi\"\"\",-nan\n\"two\nlines\",inf\nplain,+2\n", "x.csv");
  ASSERT_EQ(table.row_count(), 4U);
  EXPECT_EQ(table.text(0, 0), "a,b");
  EXPECT_EQ(table.number(0, 1), 1.5);
  EXPECT_EQ(table.text(1, 0), "say \"hi\"");
  EXPECT_TRUE(std::isnan(table.number(1, 1)));
  EXPECT_EQ(table.text(2, 0), "two\nlines");
  EXPECT_EQ(table.number(2, 1), INFINITY);
  EXPECT_EQ(table.number(3, 1), 2.0);
  // Rows start on physical lines 2, 4, 5 and 7 (a blank line, and a field spanning two lines).
  EXPECT_EQ(table.line_of(0), 2U);
  EXPECT_EQ(table.line_of(1), 4U);
  EXPECT_EQ(table.line_of(2), 5U);
  EXPECT_EQ(table.line_of(3), 7U);
}

void expect_csv_error(const std::string& text, const std::string& expected_fragment) {
  try {
    const auto table = mxscope::report::csv_table::parse(text, "bad.csv");
    for (std::size_t row = 0; row < table.row_count(); ++row) table.number(row, table.require_column("value"));
    ADD_FAILURE() << "no error for input:\n" << text << "\nexpected a message with: " << expected_fragment;
  } catch (const mxscope::input_error& error) {
    EXPECT_NE(std::string(error.what()).find(expected_fragment), std::string::npos)
        << "input:\n" << text << "\nexpected a message with: " << expected_fragment << "\nactual: " << error.what();
  }
}

TEST(ReportCsv, NamesFileLineAndColumnOfEveryProblem) {
  expect_csv_error("", "bad.csv: the file is empty");
  expect_csv_error("name,value\na,1\nb,2,3\n", "bad.csv: line 3: 3 fields, but the header has 2 columns");
  expect_csv_error("name,value\na,1\nb,x1\n", "bad.csv: line 3, column 2 (value): 'x1' is not a number");
  expect_csv_error("name,value\na,\n", "bad.csv: line 2, column 2 (value): empty value");
  expect_csv_error("name,value\na,1e999\n", "bad.csv: line 2, column 2 (value): '1e999' is out of the range");
  expect_csv_error("name,value\n\"a,1\n", "bad.csv: line 2: a quoted field is never closed");
  expect_csv_error("name,value\na\"b\",1\n", "bad.csv: line 2, column 1: a quote inside an unquoted field");
  expect_csv_error("name,value,name\na,1,b\n", "bad.csv: line 1: column 'name' appears twice");
  expect_csv_error("name,other\na,1\n", "bad.csv: line 1: missing column 'value'");
}

// ---------------------------------------------------------------------------------------------
// mxscope report.

class ReportCommand : public ::testing::Test {
 protected:
  void SetUp() override { run_ = write_synthetic_run(scratch_.path() / "runs" / "synthetic"); }

  temporary_directory scratch_;
  fs::path run_;
};

// One report of the synthetic run, shared by the tests that only read it.
class ReportOutputs : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    scratch_ = new temporary_directory();
    run_ = write_synthetic_run(scratch_->path() / "runs" / "synthetic");
    result_ = run_cli({"report", run_.string()});
  }
  static void TearDownTestSuite() {
    delete scratch_;
    scratch_ = nullptr;
  }
  void SetUp() override { ASSERT_EQ(result_.code, 0) << result_.err; }

  static temporary_directory* scratch_;
  static fs::path run_;
  static cli_result result_;
};
temporary_directory* ReportOutputs::scratch_ = nullptr;
fs::path ReportOutputs::run_;
cli_result ReportOutputs::result_;

TEST_F(ReportOutputs, WritesEveryPlotAsValidSvgAndPng) {
  std::set<std::string> expected;
  for (const auto& layer : layers) {
    for (const auto& kind : plot_kinds) {
      expected.insert(fmt::format("{}.{}.{}.svg", layer, gemm, kind));
      expected.insert(fmt::format("{}.{}.{}.png", layer, gemm, kind));
    }
  }
  std::set<std::string> actual;
  for (const auto& name : listing(run_ / "plots")) actual.insert(name);
  EXPECT_EQ(actual, expected);
  for (const auto& name : expected) {
    const std::string bytes = read_text(run_ / "plots" / name);
    const std::string problem = name.ends_with(".png") ? png_problem(bytes) : svg_problem(bytes);
    EXPECT_EQ(problem, "") << name << " (" << bytes.size() << " bytes)";
  }
  // gnuplot wrote the strategy named "<b>&" as XML text, so the SVG stays well-formed.
  const std::string legend = read_text(run_ / "plots" / fmt::format("{}.{}.rel_err.svg", layers[0], gemm));
  EXPECT_NE(legend.find("&lt;b>&amp;"), std::string::npos);
  EXPECT_EQ(legend.find("<b>&"), std::string::npos);
  for (const auto& strategy : {"mxfp4 rne", "mxfp4 sr per-step"}) EXPECT_NE(legend.find(strategy), std::string::npos);
  // No temporary files are left next to the outputs.
  for (const auto& name : listing(run_)) EXPECT_EQ(name.find(".tmp."), std::string::npos) << name;
}

TEST_F(ReportOutputs, PageIsSelfContainedAndEscaped) {
  const std::string html = read_text(run_ / "report.html");
  ASSERT_FALSE(html.empty());
  EXPECT_TRUE(html.starts_with("<!DOCTYPE html>"));
  for (const std::string forbidden : {"src=\"http", "href=\"http", "src='http", "<script", "<link", "@import", "url(",
                                      "<iframe", "<object", "<embed"}) {
    EXPECT_EQ(html.find(forbidden), std::string::npos) << forbidden;
  }
  const auto sources = attribute_values(html, "src");
  EXPECT_EQ(sources.size(), layers.size() * plot_kinds.size());
  for (const auto& source : sources) EXPECT_TRUE(source.starts_with("data:image/")) << source.substr(0, 60);
  for (const auto& link : attribute_values(html, "href")) EXPECT_TRUE(link.starts_with("#")) << link;

  for (const auto& layer : layers) EXPECT_NE(html.find(escaped(layer)), std::string::npos) << layer;
  for (const auto& strategy : strategies) {
    EXPECT_NE(html.find(escaped(strategy.name)), std::string::npos) << strategy.name;
  }
  EXPECT_EQ(html.find("<b>&"), std::string::npos) << "the strategy name <b>& reached the page unescaped";
  // Provenance from summary.json: the analysis text (escaped), the timestamp, the input hash.
  EXPECT_NE(html.find(escaped(analysis_text)), std::string::npos);
  EXPECT_NE(html.find(started_at), std::string::npos);
  EXPECT_NE(html.find(std::string(64, 'a')), std::string::npos);
  EXPECT_NE(html.find("0123456789ab"), std::string::npos);
  // The per-unit results of summary.json are not repeated as provenance.
  EXPECT_EQ(html.find("&quot;units&quot;"), std::string::npos);
}

TEST_F(ReportOutputs, RankingFollowsFinalAccErrAndVerdictsFollowAlpha) {
  const std::string html = read_text(run_ / "report.html");
  for (std::size_t layer = 0; layer < layers.size(); ++layer) {
    const auto rows = ranking_of_unit(html, static_cast<int>(layer) + 1);
    const auto order = expected_order(layer);
    ASSERT_EQ(rows.size(), order.size()) << "layer " << layers[layer];
    for (std::size_t rank = 0; rank < order.size(); ++rank) {
      EXPECT_EQ(rows[rank].strategy, escaped(order[rank])) << "layer " << layers[layer] << " rank " << rank + 1;
      const double alpha = strategy_named(order[rank]).final_alpha;
      EXPECT_EQ(rows[rank].verdict, expected_verdict(strategy_named(order[rank]), layer))
          << "layer " << layers[layer] << " strategy " << order[rank] << " alpha " << alpha;
    }
  }
  // The behaviours give the four verdicts.
  EXPECT_EQ(expected_verdict(strategies[0].final_alpha), "coherent");
  EXPECT_EQ(expected_verdict(strategies[1].final_alpha), "averages out");
  EXPECT_EQ(expected_verdict(strategies[2].final_alpha), "mixed");
  // A one-signed bias overrides an alpha that says the errors average out.
  EXPECT_EQ(expected_verdict(strategies[3].final_alpha), "averages out");
  EXPECT_EQ(expected_verdict(strategies[3], 0), "coherent (bias)");
  EXPECT_EQ(expected_verdict(strategies[0], 0), "coherent");  // its bias is a quarter of its acc_err
}

TEST_F(ReportCommand, SameInputsGiveTheSameBytes) {
  ASSERT_EQ(run_cli({"report", run_.string()}).code, 0);
  std::map<std::string, std::string> first;
  for (const auto& name : listing(run_)) {
    if (fs::is_regular_file(run_ / name)) first[name] = read_text(run_ / name);
  }
  // A second report, of a copy of the run elsewhere (same directory name), gives the same bytes:
  // nothing depends on the clock, the process or the absolute path.
  const fs::path copy = scratch_.path() / "elsewhere" / "synthetic";
  write_synthetic_run(copy);
  ASSERT_EQ(run_cli({"report", copy.string()}).code, 0);
  EXPECT_EQ(listing(copy), listing(run_));
  for (const auto& [name, bytes] : first) {
    EXPECT_TRUE(read_text(copy / name) == bytes) << name << " differs between two reports of the same inputs";
  }
}

// ---------------------------------------------------------------------------------------------
// Bad inputs: exit 2, the file, line and column named, nothing written.

struct bad_input_case {
  std::string label;
  std::function<void(const fs::path&)> damage;
  std::vector<std::string> message_fragments;
};

std::string replace_line_field(const std::string& text, std::size_t line_number, std::size_t column,
                               const std::string& value) {
  std::vector<std::string> lines;
  std::stringstream stream(text);
  std::string line;
  while (std::getline(stream, line)) lines.push_back(line);
  std::vector<std::string> fields;
  std::stringstream row(lines[line_number - 1]);
  std::string field;
  while (std::getline(row, field, ',')) fields.push_back(field);
  fields[column - 1] = value;
  lines[line_number - 1] = fmt::format("{}", fmt::join(fields, ","));
  return fmt::format("{}\n", fmt::join(lines, "\n"));
}

std::size_t column_number(const std::vector<std::string>& columns, const std::string& name) {
  return static_cast<std::size_t>(std::find(columns.begin(), columns.end(), name) - columns.begin()) + 1;
}

std::vector<bad_input_case> bad_inputs() {
  const std::size_t rel_err_column = column_number(step_columns, "rel_err");
  const std::size_t coherence_column = column_number(accumulation_columns, "coherence");
  return {
      {"missing steps.csv", [](const fs::path& run) { fs::remove(run / "steps.csv"); }, {"steps.csv", "no such file"}},
      {"missing summary.json", [](const fs::path& run) { fs::remove(run / "summary.json"); }, {"summary.json"}},
      {"summary.json nested 200,000 deep",
       [](const fs::path& run) {
         write_text(run / "summary.json", R"({"provenance":{"x":)" + std::string(200000, '[') +
                                              std::string(200000, ']') + "}}");
       },
       {"summary.json", "nesting deeper than 64"}},
      {"summary.json with a key twice",
       [](const fs::path& run) { write_text(run / "summary.json", R"({"units":[],"units":[]})"); },
       {"summary.json", "'units'", "duplicate key"}},
      {"accumulation.csv cut inside its last number",
       [](const fs::path& run) {
         const std::string text = accumulation_csv();
         write_text(run / "accumulation.csv", text.substr(0, text.size() - 4));  // "\n" and 3 digits gone
       },
       {"accumulation.csv", "ends inside a line"}},
      {"missing column",
       [coherence_column](const fs::path& run) {
         // Drop the coherence column from every line.
         std::string out;
         std::stringstream stream(accumulation_csv());
         std::string line;
         while (std::getline(stream, line)) {
           std::vector<std::string> fields;
           std::stringstream row(line);
           std::string field;
           while (std::getline(row, field, ',')) fields.push_back(field);
           fields.erase(fields.begin() + static_cast<long>(coherence_column - 1));
           out += fmt::format("{}\n", fmt::join(fields, ","));
         }
         write_text(run / "accumulation.csv", out);
       },
       {"accumulation.csv", "line 1", "missing column 'coherence'"}},
      {"non-numeric value",
       [rel_err_column](const fs::path& run) {
         write_text(run / "steps.csv", replace_line_field(steps_csv(), 5, rel_err_column, "0.0x5"));
       },
       {"steps.csv", fmt::format("line 5, column {} (rel_err)", rel_err_column), "'0.0x5' is not a number"}},
      {"non-numeric value in a column the report does not draw",
       [](const fs::path& run) {
         write_text(run / "accumulation.csv",
                    replace_line_field(accumulation_csv(), 9, column_number(accumulation_columns, "sgd_upd_err"), "fast"));
       },
       {"accumulation.csv", fmt::format("line 9, column {} (sgd_upd_err)", column_number(accumulation_columns, "sgd_upd_err")),
        "'fast' is not a number"}},
      {"row with a missing field",
       [](const fs::path& run) {
         std::string text = steps_csv();
         text += "blocks.0.mlp.fc1,wgrad,mxfp4 rne,200\n";
         write_text(run / "steps.csv", text);
       },
       {"steps.csv", fmt::format("line {}", layers.size() * strategies.size() * window + 2), "4 fields"}},
      {"strategy only in accumulation.csv",
       [](const fs::path& run) {
         std::string text = accumulation_csv();
         text += row_text({layers[0], gemm, "ghost", "1", "101", "0.1", "1", "nan", "nan", "1", "0.1", "0.1", "0.1",
                           "0.1"});
         write_text(run / "accumulation.csv", text);
       },
       {"accumulation.csv", "ghost", "has no rows in steps.csv"}},
      {"summary.json not JSON", [](const fs::path& run) { write_text(run / "summary.json", "{\"provenance\": "); },
       {"summary.json", "not valid JSON"}},
  };
}

TEST_F(ReportCommand, BadInputsExitTwoNamingWhereAndWriteNothing) {
  for (const auto& bad : bad_inputs()) {
    temporary_directory scratch;
    const fs::path run = write_synthetic_run(scratch.path() / "run");
    bad.damage(run);
    const auto before = listing(run);
    const fs::path notebook = scratch.path() / "out.ipynb";
    for (const std::vector<std::string>& arguments :
         {std::vector<std::string>{"report", run.string()},
          std::vector<std::string>{"notebook", run.string(), "-o", notebook.string()}}) {
      const cli_result result = run_cli(arguments);
      EXPECT_EQ(result.code, 2) << bad.label << ": " << arguments[0] << "\n" << result.err;
      for (const auto& fragment : bad.message_fragments) {
        EXPECT_NE(result.err.find(fragment), std::string::npos)
            << bad.label << ": " << arguments[0] << ": expected '" << fragment << "' in:\n" << result.err;
      }
      EXPECT_EQ(listing(run), before) << bad.label << ": " << arguments[0] << " left output behind";
      EXPECT_FALSE(fs::exists(notebook)) << bad.label;
    }
  }
}

TEST_F(ReportCommand, MissingGnuplotIsAClearErrorAndWritesNothing) {
  const auto before = listing(run_);
  const cli_result result = run_cli({"report", run_.string(), "--gnuplot", (scratch_.path() / "no-gnuplot").string()});
  EXPECT_EQ(result.code, 2);
  EXPECT_NE(result.err.find("gnuplot"), std::string::npos) << result.err;
  EXPECT_NE(result.err.find("does not exist"), std::string::npos) << result.err;
  EXPECT_EQ(listing(run_), before);

  const cli_result by_name = run_cli({"report", run_.string(), "--gnuplot", "mxscope-no-such-gnuplot"});
  EXPECT_EQ(by_name.code, 2);
  EXPECT_NE(by_name.err.find("not found on PATH"), std::string::npos) << by_name.err;
  EXPECT_EQ(listing(run_), before);
}

// A plots directory that cannot be made (here a file of that name; on a read-only or immutable
// run directory the same path) is an error naming it, and the file is left as it was.
TEST_F(ReportCommand, PlotsDirectoryThatCannotBeMadeIsAClearError) {
  write_text(run_ / "plots", "not a directory");
  const auto before = listing(run_);
  const cli_result result = run_cli({"report", run_.string()});
  EXPECT_EQ(result.code, 2);
  EXPECT_NE(result.err.find("plots: cannot create the plots directory"), std::string::npos) << result.err;
  EXPECT_EQ(listing(run_), before);
  EXPECT_EQ(read_text(run_ / "plots"), "not a directory");
}

// ---------------------------------------------------------------------------------------------
// mxscope notebook.

TEST_F(ReportCommand, NotebookIsValidNbformatWithDeterministicIds) {
  const fs::path notebook = scratch_.path() / "notebooks" / "synthetic.ipynb";
  fs::create_directories(notebook.parent_path());
  const cli_result result = run_cli({"notebook", run_.string(), "-o", notebook.string()});
  ASSERT_EQ(result.code, 0) << result.err;
  const std::string first_bytes = read_text(notebook);
  ASSERT_EQ(run_cli({"notebook", run_.string(), "-o", notebook.string()}).code, 0);
  EXPECT_TRUE(read_text(notebook) == first_bytes) << "the notebook changed between two runs";

  const nlohmann::json parsed = nlohmann::json::parse(first_bytes);
  EXPECT_EQ(parsed.at("nbformat"), 4);
  EXPECT_EQ(parsed.at("nbformat_minor"), 5);
  std::set<std::string> ids;
  std::string code_text;
  std::string markdown_text;
  for (const auto& cell : parsed.at("cells")) {
    EXPECT_TRUE(ids.insert(cell.at("id").get<std::string>()).second) << "repeated cell id " << cell.at("id");
    std::string source;
    for (const auto& line : cell.at("source")) source += line.get<std::string>();
    if (cell.at("cell_type") == "code") {
      EXPECT_TRUE(cell.at("outputs").empty()) << cell.at("id");
      EXPECT_TRUE(cell.at("execution_count").is_null()) << cell.at("id");
      code_text += source;
    } else {
      markdown_text += source;
    }
  }
  // The first code cell sets RUN, relative to the notebook's folder.
  std::string first_code;
  for (const auto& cell : parsed.at("cells")) {
    if (cell.at("cell_type") == "code") {
      for (const auto& line : cell.at("source")) first_code += line.get<std::string>();
      break;
    }
  }
  EXPECT_NE(first_code.find("RUN = pathlib.Path(\"../runs/synthetic\")"), std::string::npos) << first_code;
  for (const auto& file : input_files()) EXPECT_NE(code_text.find(file), std::string::npos) << file;
  EXPECT_NE(code_text.find("pd.read_csv"), std::string::npos);
  EXPECT_NE(code_text.find("matplotlib"), std::string::npos);
  // Provenance in the introduction; the strategy-like text in it cannot turn into HTML.
  EXPECT_NE(markdown_text.find("0123456789ab"), std::string::npos);
  EXPECT_NE(markdown_text.find(started_at), std::string::npos);
  EXPECT_NE(markdown_text.find(analysis_text), std::string::npos) << "the analysis text belongs in a code block";

  const std::string problem = python_import_problem(scratch_.path(), "nbformat", "python3-nbformat");
  ASSERT_EQ(problem, "") << problem;
  const process_result validation = run_python(
      scratch_.path(),
      "import sys, nbformat\nnbformat.validate(nbformat.read(sys.argv[1], as_version=4))\nprint('valid')\n",
      {notebook.string()});
  EXPECT_EQ(validation.code, 0) << validation.output;
  EXPECT_NE(validation.output.find("valid"), std::string::npos) << validation.output;
}

// Runs every code cell in order in one namespace, from the notebook's folder (as Jupyter does),
// then reports the rankings and the lines drawn in each panel of the first unit's figure.
constexpr const char* execute_notebook_script = R"python(
import json, os, sys, warnings
import matplotlib
matplotlib.use("Agg")
warnings.simplefilter("ignore")  # Agg's "cannot show the figure" from plt.show()
path = os.path.abspath(sys.argv[1])
with open(path, encoding="utf-8") as source:
    notebook = json.load(source)
os.chdir(os.path.dirname(path))
namespace = {"__name__": "__main__"}
for cell in notebook["cells"]:
    if cell["cell_type"] == "code":
        exec(compile("".join(cell["source"]), "cell " + cell["id"], "exec"), namespace)
result = {"units": []}
for (layer, gemm), table in namespace["RANKINGS"].items():
    result["units"].append({"layer": layer, "gemm": gemm, "strategies": list(table["strategy"]),
                            "verdicts": list(table["verdict"]), "ranks": [int(rank) for rank in table.index]})
layer, gemm = namespace["UNITS"][0]
figure = namespace["draw_unit"](layer, gemm)
result["lines"] = {axis.get_title(): len(axis.get_lines()) for axis in figure.axes}
print("RESULT " + json.dumps(result))
)python";

TEST_F(ReportCommand, NotebookCellsRunOnTheSyntheticRun) {
  const fs::path notebook = scratch_.path() / "notebooks" / "synthetic.ipynb";
  fs::create_directories(notebook.parent_path());
  ASSERT_EQ(run_cli({"notebook", run_.string(), "-o", notebook.string()}).code, 0);
  const std::string problem =
      python_import_problem(scratch_.path(), "pandas, matplotlib", "python3-pandas python3-matplotlib");
  ASSERT_EQ(problem, "") << problem;

  const process_result run = run_python(scratch_.path(), execute_notebook_script, {notebook.string()});
  ASSERT_EQ(run.code, 0) << run.output;
  const std::size_t marker = run.output.rfind("RESULT ");
  ASSERT_NE(marker, std::string::npos) << run.output;
  const nlohmann::json result = nlohmann::json::parse(run.output.substr(marker + 7));

  ASSERT_EQ(result.at("units").size(), layers.size()) << run.output;
  for (std::size_t layer = 0; layer < layers.size(); ++layer) {
    const auto& unit = result.at("units")[layer];
    EXPECT_EQ(unit.at("layer"), layers[layer]);
    EXPECT_EQ(unit.at("gemm"), gemm);
    EXPECT_EQ(unit.at("strategies").get<std::vector<std::string>>(), expected_order(layer)) << layers[layer];
    EXPECT_EQ(unit.at("ranks").get<std::vector<int>>(), (std::vector<int>{1, 2, 3, 4}));
    const auto verdicts = unit.at("verdicts").get<std::vector<std::string>>();
    const auto order = expected_order(layer);
    for (std::size_t rank = 0; rank < order.size(); ++rank) {
      EXPECT_EQ(verdicts[rank], expected_verdict(strategy_named(order[rank]), layer)) << order[rank];
    }
  }
  // One line per strategy in each panel, two per strategy in the two-operand and two-optimizer
  // panels, plus the guides (zero on bias; 1 and sqrt(T) on coherence; sqrt(T) and T on growth).
  const std::size_t count = strategies.size();
  const std::map<std::string, std::size_t> expected_lines = {
      {"Per-step relative error", count},
      {"Direction error per step", count},
      {"Bias along the reference result", count + 1},
      {"Error of the summed results", count},
      {"Coherence of the errors", count + 2},
      {"Growth of the summed error", count + 2},
      {"Operand inputs flushed to zero", 2 * count},
      {"Operand inputs clipped at the max normal", 2 * count},
      {"Optimizer displacement error", 2 * count},
  };
  const auto lines = result.at("lines").get<std::map<std::string, std::size_t>>();
  EXPECT_EQ(lines, expected_lines) << run.output;
}

TEST_F(ReportCommand, NotebookNeedsAnOutputPath) {
  const cli_result result = run_cli({"notebook", run_.string()});
  EXPECT_EQ(result.code, 2);
  EXPECT_NE(result.err.find("-o"), std::string::npos) << result.err;
}

// The notebook's output may not be one of the run's own files.
TEST_F(ReportCommand, NotebookNeverOverwritesTheRun) {
  const std::string steps_before = read_text(run_ / "steps.csv");
  const cli_result result = run_cli({"notebook", run_.string(), "-o", (run_ / "steps.csv").string()});
  EXPECT_EQ(result.code, 2);
  EXPECT_NE(result.err.find("RUN/steps.csv"), std::string::npos) << result.err;
  EXPECT_EQ(read_text(run_ / "steps.csv"), steps_before);
}

// Identical strategies tie: equal final acc_err share a rank (1, 2, 2, 4), nan ranks last; and up
// to 20 strategies get 20 different colours.
TEST(ReportRanking, EqualAccErrShareARankAndColoursAreDistinct) {
  mxscope::report::unit_data unit;
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const std::vector<std::pair<std::string, double>> finals = {{"c", 0.3}, {"a", 0.1}, {"b", 0.3}, {"n", nan}, {"d", 0.5}};
  for (std::size_t i = 0; i < finals.size(); ++i) {
    mxscope::report::strategy_series series;
    series.strategy = finals[i].first;
    series.strategy_index = i;
    mxscope::report::accumulation_record record;
    record.T = 1;
    record.acc_err = finals[i].second;
    series.accumulation.push_back(record);
    series.steps.push_back({});
    unit.strategies.push_back(series);
  }
  std::vector<std::string> names;
  std::vector<int> ranks;
  for (const auto& row : mxscope::report::rank_strategies(unit)) {
    names.push_back(row.strategy);
    ranks.push_back(row.rank);
  }
  EXPECT_EQ(names, (std::vector<std::string>{"a", "c", "b", "d", "n"}));
  EXPECT_EQ(ranks, (std::vector<int>{1, 2, 2, 4, 5}));
  std::set<std::string> colours;
  for (std::size_t index = 0; index < 20; ++index) {
    colours.insert(std::string(mxscope::report::style_of_strategy(index).colour));
  }
  EXPECT_EQ(colours.size(), 20U);
}

}  // namespace
