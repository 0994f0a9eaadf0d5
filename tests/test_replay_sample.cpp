// mxscope replay end to end on the shipped capture data/sample (two layers of a tiny Llama trained
// in MXFP4 on an H200) under the shipped analyses/wgrad-ablation.toml, restricted to steps
// 400-403 to keep the run short.
//
// The checks do not trust the code under test for what the files should hold:
// - the column lists are parsed from the tables of docs/metrics.md (not from the writer's header
//   constant), and the header must list exactly those columns in that order;
// - where a value may be undefined or infinite is what docs/metrics.md says: alpha and lag1_corr
//   are nan only for T < 2, the attr_* columns nan exactly without --attribute, a_snr_db/b_snr_db
//   inf only when the operand is exact (here: the bf16 strategy, since the capture is bf16, which
//   the dump's own dtypes confirm); everything else is finite;
// - identities that follow from the definitions tie columns together (rel_err^2 = bias^2 +
//   orth_err^2, cosine from bias and orth_err, structural_share = coherence^2 / T, at T = 1
//   acc_err = sgd_upd_err = sgd_disp_err = rel_err), and summary.json must agree with the CSVs;
// - properties of the data: bf16 operands reproduce the exact product to fp32 accumulation error
//   only, far below MXFP4's error; MXFP8 beats MXFP4; fractions lie in [0, 1].
// Bytes: the same files for 1 and 2 threads, and after a kill -9 of the CLI and --resume.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "cli_runner.hpp"
#include "mxscope/analysis.hpp"
#include "mxscope/io/dump.hpp"

#include "test_files.hpp"

namespace {

namespace fs = std::filesystem;
using mxscope::testing::joined;
using mxscope::testing::run_cli;

const fs::path source_dir = MXSCOPE_SOURCE_DIR;
const fs::path sample = source_dir / "data" / "sample";
const fs::path ablation = source_dir / "analyses" / "wgrad-ablation.toml";
const std::vector<std::string> sample_layers = {"layers.1.attn.o_proj", "layers.2.mlp.down_proj"};
const std::vector<std::int64_t> window = {400, 401, 402, 403};
const char* window_text = "400-403";

using mxscope::testing::read_text;

fs::path fresh_directory(const std::string& name) { return mxscope::testing::fresh_directory("replay-sample", name); }

std::vector<std::string> split(const std::string& line, char separator) {
  std::vector<std::string> cells;
  std::string cell;
  std::stringstream stream(line);
  while (std::getline(stream, cell, separator)) cells.push_back(cell);
  if (!line.empty() && line.back() == separator) cells.emplace_back();
  return cells;
}

// The columns a section of docs/metrics.md defines: every `name` in the first cell of each table
// row between "## <section>" and the next "## " heading, in order.
std::vector<std::string> documented_columns(const std::string& section) {
  std::ifstream file(source_dir / "docs" / "metrics.md");
  std::vector<std::string> columns;
  bool inside = false;
  const std::regex quoted("`([^`]+)`");
  for (std::string line; std::getline(file, line);) {
    if (line.rfind("## ", 0) == 0) {
      inside = line == "## " + section;
      continue;
    }
    if (!inside || line.rfind("| `", 0) != 0) continue;
    const std::string first_cell = line.substr(1, line.find('|', 1) - 1);
    for (std::sregex_iterator it(first_cell.begin(), first_cell.end(), quoted), end; it != end; ++it) {
      columns.push_back((*it)[1]);
    }
  }
  return columns;
}

struct csv_table {
  std::vector<std::string> header;
  std::vector<std::map<std::string, std::string>> rows;
};

csv_table read_csv(const fs::path& path) {
  csv_table table;
  std::ifstream file(path);
  std::string line;
  if (!std::getline(file, line)) {
    ADD_FAILURE() << path << " is empty";
    return table;
  }
  table.header = split(line, ',');
  while (std::getline(file, line)) {
    const auto cells = split(line, ',');
    EXPECT_EQ(cells.size(), table.header.size()) << path << ": " << line;
    std::map<std::string, std::string> row;
    for (std::size_t i = 0; i < std::min(cells.size(), table.header.size()); ++i) row[table.header[i]] = cells[i];
    table.rows.push_back(std::move(row));
  }
  return table;
}

// The whole cell as a number ("nan" and "inf" included); a cell that does not parse fails the test.
double number(const std::map<std::string, std::string>& row, const std::string& column) {
  const auto found = row.find(column);
  if (found == row.end()) {
    ADD_FAILURE() << "no column " << column;
    return std::numeric_limits<double>::quiet_NaN();
  }
  const std::string& text = found->second;
  double value = 0.0;
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  EXPECT_TRUE(error == std::errc() && end == text.data() + text.size() && !text.empty())
      << column << " = '" << text << "' is not a number";
  return value;
}

std::int64_t integer(const std::map<std::string, std::string>& row, const std::string& column) {
  const std::string& text = row.at(column);
  std::int64_t value = -1;
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  EXPECT_TRUE(error == std::errc() && end == text.data() + text.size() && !text.empty())
      << column << " = '" << text << "' is not an integer";
  return value;
}

// |a - b| <= tolerance * max(|a|, |b|, floor).
void expect_close(double a, double b, double tolerance, const std::string& what, double floor = 1e-300) {
  EXPECT_LE(std::fabs(a - b), tolerance * std::max({std::fabs(a), std::fabs(b), floor})) << what << ": " << a << " vs " << b;
}

std::vector<std::string> strategy_names(const fs::path& analysis_file) {
  std::vector<std::string> names;
  for (const auto& s : mxscope::load_analysis(analysis_file.string()).strategies) names.push_back(s.name);
  return names;
}

// Starts the CLI binary as a child process, its output going to `log`. OpenMP threads of the
// child wait passively: on a busy two-core machine spinning threads burn CPU time for nothing
// (the results do not depend on it).
pid_t spawn_cli(const std::vector<std::string>& arguments, const fs::path& log) {
  std::vector<std::string> argv{MXSCOPE_CLI_PATH};
  argv.insert(argv.end(), arguments.begin(), arguments.end());
  return mxscope::testing::spawn_logged(argv, log, {{"OMP_WAIT_POLICY", "PASSIVE"}});
}

// Runs the CLI binary to the end; its exit code (128 + signal when a signal ended it).
int run_child(const std::vector<std::string>& arguments, const fs::path& log) {
  const pid_t child = spawn_cli(arguments, log);
  return child < 0 ? -1 : mxscope::testing::wait_for(child);
}

void replay_or_fail(const std::vector<std::string>& arguments) {
  const auto result = run_cli(arguments);
  ASSERT_EQ(result.code, 0) << joined(arguments) << "\n" << result.out << result.err;
}

std::vector<std::string> replay_arguments(const fs::path& analysis_file, const fs::path& out, const std::string& steps,
                                          int threads) {
  return {"replay", sample.string(), "--analysis", analysis_file.string(), "--out", out.string(), "--steps", steps,
          "--threads", std::to_string(threads)};
}

// The columns of steps.csv that are per-step metrics (everything after the key columns).
const std::set<std::string> step_text_columns = {"layer", "gemm", "strategy", "a_role", "b_role"};
const std::set<std::string> step_integer_columns = {"step", "t"};
const std::set<std::string> attribution_columns = {"attr_a_flush", "attr_a_clip", "attr_a_round",
                                                   "attr_b_flush", "attr_b_clip", "attr_b_round"};

// Every steps.csv row: keys as expected, values that parse, finite where docs/metrics.md says so.
void check_step_rows(const csv_table& steps, const std::vector<std::string>& strategies,
                     const std::vector<std::int64_t>& steps_in_window, bool attributed) {
  ASSERT_EQ(steps.rows.size(), sample_layers.size() * steps_in_window.size() * strategies.size());
  std::set<std::tuple<std::string, std::string, std::int64_t>> seen;
  for (const auto& row : steps.rows) {
    const std::string where = row.at("layer") + " " + row.at("strategy") + " step " + row.at("step");
    SCOPED_TRACE(where);
    EXPECT_NE(std::find(sample_layers.begin(), sample_layers.end(), row.at("layer")), sample_layers.end());
    EXPECT_NE(std::find(strategies.begin(), strategies.end(), row.at("strategy")), strategies.end());
    EXPECT_EQ(row.at("gemm"), "wgrad");
    EXPECT_EQ(row.at("a_role"), "dy");
    EXPECT_EQ(row.at("b_role"), "x");
    const std::int64_t step = integer(row, "step");
    const std::int64_t t = integer(row, "t");
    const auto position = std::find(steps_in_window.begin(), steps_in_window.end(), step);
    ASSERT_NE(position, steps_in_window.end());
    EXPECT_EQ(t, position - steps_in_window.begin() + 1) << "t is the position in the replayed window";
    EXPECT_TRUE(seen.insert({row.at("layer"), row.at("strategy"), step}).second) << "duplicate row";

    const bool exact_operands = row.at("strategy") == "bf16";
    for (const auto& column : steps.header) {
      if (step_text_columns.contains(column) || step_integer_columns.contains(column)) continue;
      const double v = number(row, column);
      if (attribution_columns.contains(column)) {
        if (attributed) {
          EXPECT_TRUE(std::isfinite(v) && v >= 0.0) << column << " = " << v;
        } else {
          EXPECT_TRUE(std::isnan(v)) << column << " must be nan without --attribute, is " << v;
        }
      } else if (column == "a_snr_db" || column == "b_snr_db") {
        // inf exactly when the operand is reproduced exactly (error energy 0).
        if (exact_operands) {
          EXPECT_EQ(v, std::numeric_limits<double>::infinity()) << column;
        } else {
          EXPECT_TRUE(std::isfinite(v)) << column << " = " << v;
        }
      } else {
        EXPECT_TRUE(std::isfinite(v)) << column << " = " << v;
      }
    }

    // Ranges.
    const double rel_err = number(row, "rel_err"), bias = number(row, "bias"), orth = number(row, "orth_err");
    const double cosine = number(row, "cosine");
    EXPECT_GE(cosine, -1.0);
    EXPECT_LE(cosine, 1.0);
    for (const char* fraction :
         {"ulp_exact_frac", "a_underflow_frac", "b_underflow_frac", "a_saturate_frac", "b_saturate_frac"}) {
      EXPECT_GE(number(row, fraction), 0.0) << fraction;
      EXPECT_LE(number(row, fraction), 1.0) << fraction;
    }
    for (const char* nonnegative : {"rel_err", "orth_err", "max_abs_err", "quant_err", "accum_err", "ulp_mean"}) {
      EXPECT_GE(number(row, nonnegative), 0.0) << nonnegative;
    }
    const double ulp_max = number(row, "ulp_max");
    EXPECT_EQ(ulp_max, std::floor(ulp_max));
    EXPECT_LE(number(row, "ulp_mean"), ulp_max);

    // Identities of the definitions. E = bias G + (E - bias G) with the second part orthogonal to G:
    // ||E||^2 = bias^2 ||G||^2 + orth^2 ||G||^2, and Ghat = (1 + bias) G + (E - bias G).
    expect_close(rel_err * rel_err, bias * bias + orth * orth, 1e-9, "rel_err^2 = bias^2 + orth_err^2");
    expect_close(cosine, (1.0 + bias) / std::hypot(1.0 + bias, orth), 1e-9, "cosine from bias and orth_err");
    // The error splits into a quantization and an accumulation part: triangle inequality.
    const double quant = number(row, "quant_err"), accum = number(row, "accum_err");
    EXPECT_LE(rel_err, (quant + accum) * (1 + 1e-12));
    EXPECT_GE(rel_err, std::fabs(quant - accum) * (1 - 1e-12));

    if (exact_operands) {
      // The capture is bf16: rounding it to bf16 changes nothing, so the exact model on the
      // quantized operands is the reference itself and all error is accumulation error.
      EXPECT_EQ(quant, 0.0);
      expect_close(accum, rel_err, 1e-12, "bf16: accum_err = rel_err");
      for (const char* zero : {"a_underflow_frac", "b_underflow_frac", "a_saturate_frac", "b_saturate_frac"}) {
        EXPECT_EQ(number(row, zero), 0.0) << zero;
      }
      if (attributed) {
        for (const auto& column : attribution_columns) EXPECT_EQ(number(row, column), 0.0) << column;
      }
    }
  }
}

std::map<std::string, std::string> find_row(const csv_table& table, const std::string& layer,
                                            const std::string& strategy, const std::string& key,
                                            const std::string& key_value) {
  for (const auto& row : table.rows) {
    if (row.at("layer") == layer && row.at("strategy") == strategy && row.at(key) == key_value) return row;
  }
  ADD_FAILURE() << "no row " << layer << " " << strategy << " " << key << "=" << key_value;
  return {};
}

// A summary.json number: JSON numbers, or the strings "nan", "inf", "-inf".
double summary_number(const nlohmann::json& value) {
  if (value.is_number()) return value.get<double>();
  EXPECT_TRUE(value.is_string()) << value.dump();
  const std::string text = value.is_string() ? value.get<std::string>() : "";
  if (text == "nan") return std::numeric_limits<double>::quiet_NaN();
  if (text == "inf") return std::numeric_limits<double>::infinity();
  if (text == "-inf") return -std::numeric_limits<double>::infinity();
  ADD_FAILURE() << "'" << text << "' is not a number";
  return 0.0;
}

void expect_same_number(double a, double b, const std::string& what) {
  if (std::isnan(a) || std::isnan(b)) {
    EXPECT_TRUE(std::isnan(a) && std::isnan(b)) << what << ": " << a << " vs " << b;
  } else {
    EXPECT_EQ(a, b) << what;
  }
}

TEST(ReplaySample, AblationColumnsValuesAndBytesForOneAndTwoThreads) {
  const fs::path root = fresh_directory("ablation");
  replay_or_fail(replay_arguments(ablation, root / "one", window_text, 1));
  const auto two = replay_arguments(ablation, root / "two", window_text, 2);
  ASSERT_EQ(run_child(two, root / "two.log"), 0) << joined(two) << "\n" << read_text(root / "two.log");
  for (const char* file : {"steps.csv", "accumulation.csv", "summary.json"}) {
    SCOPED_TRACE(file);
    const std::string one = read_text(root / "one" / file);
    EXPECT_FALSE(one.empty());
    EXPECT_EQ(one, read_text(root / "two" / file)) << "the bytes depend on the thread count";
  }
  EXPECT_TRUE(fs::exists(root / "one" / "run.json"));
  EXPECT_FALSE(fs::exists(root / "one" / ".partial"));

  // The capture holds bf16 x and dy (what makes the bf16 strategy exact on its operands).
  const mxscope::io::dump_reader dump(sample);
  for (const auto& entry : dump.entries()) {
    EXPECT_EQ(entry.x_type, mxscope::io::dtype::bf16) << entry.relative_file;
    EXPECT_EQ(entry.dy_type, mxscope::io::dtype::bf16) << entry.relative_file;
  }

  const std::vector<std::string> strategies = strategy_names(ablation);
  ASSERT_EQ(strategies.size(), 16u);
  const csv_table steps = read_csv(root / "one" / "steps.csv");
  const csv_table accumulation = read_csv(root / "one" / "accumulation.csv");

  // Every documented column, in the documented order, and nothing else.
  const auto documented_steps = documented_columns("steps.csv");
  const auto documented_accumulation = documented_columns("accumulation.csv");
  ASSERT_GE(documented_steps.size(), 20u) << "docs/metrics.md: the steps.csv table did not parse";
  ASSERT_GE(documented_accumulation.size(), 10u) << "docs/metrics.md: the accumulation.csv table did not parse";
  EXPECT_EQ(steps.header, documented_steps);
  EXPECT_EQ(accumulation.header, documented_accumulation);

  {
    SCOPED_TRACE("steps.csv");
    check_step_rows(steps, strategies, window, /*attributed=*/false);
  }

  // Properties of the data, per (layer, step).
  for (const auto& layer : sample_layers) {
    for (const std::int64_t step : window) {
      SCOPED_TRACE(layer + " step " + std::to_string(step));
      const std::string s = std::to_string(step);
      const double bf16 = number(find_row(steps, layer, "bf16", "step", s), "rel_err");
      const double mxfp8 = number(find_row(steps, layer, "mxfp8-e4m3", "step", s), "rel_err");
      const double mxfp4 = number(find_row(steps, layer, "mxfp4-rne", "step", s), "rel_err");
      EXPECT_LT(bf16, 1e-3 * mxfp4) << "bf16 operands only see fp32 accumulation error";
      EXPECT_LT(mxfp8, mxfp4) << "three mantissa bits against one";
      EXPECT_GT(mxfp4, 0.01) << "MXFP4 on real gradients is not nearly exact";
      for (const auto& strategy : strategies) {
        if (strategy == "bf16") continue;
        EXPECT_GT(number(find_row(steps, layer, strategy, "step", s), "quant_err"), 0.0) << strategy;
      }
    }
  }

  // accumulation.csv.
  ASSERT_EQ(accumulation.rows.size(), sample_layers.size() * window.size() * strategies.size());
  std::set<std::tuple<std::string, std::string, std::int64_t>> seen;
  for (const auto& row : accumulation.rows) {
    SCOPED_TRACE(row.at("layer") + " " + row.at("strategy") + " T " + row.at("T"));
    EXPECT_EQ(row.at("gemm"), "wgrad");
    const std::int64_t T = integer(row, "T");
    ASSERT_GE(T, 1);
    ASSERT_LE(T, static_cast<std::int64_t>(window.size()));
    EXPECT_EQ(integer(row, "step"), window[static_cast<std::size_t>(T - 1)]) << "step is the T-th entry's";
    EXPECT_TRUE(seen.insert({row.at("layer"), row.at("strategy"), T}).second) << "duplicate row";
    for (const auto& column : accumulation.header) {
      if (column == "layer" || column == "gemm" || column == "strategy" || column == "T" || column == "step") continue;
      const double v = number(row, column);
      if (column == "alpha" || column == "lag1_corr") {
        EXPECT_EQ(std::isnan(v), T < 2) << column << " = " << v << ": nan for T < 2 and only there";
        if (T >= 2) {
          EXPECT_TRUE(std::isfinite(v)) << column << " = " << v;
        }
      } else {
        EXPECT_TRUE(std::isfinite(v) && v >= 0.0) << column << " = " << v;
      }
    }
    const double coherence = number(row, "coherence");
    const double structural = number(row, "structural_share");
    // ||sum E|| <= sum ||E|| <= sqrt(T) sqrt(sum ||E||^2); the share is coherence^2 / T.
    EXPECT_LE(coherence, std::sqrt(static_cast<double>(T)) * (1 + 1e-12));
    EXPECT_LE(structural, 1.0 + 1e-12);
    expect_close(structural, coherence * coherence / static_cast<double>(T), 1e-12, "structural_share");
    if (T >= 2) {
      EXPECT_GE(number(row, "lag1_corr"), -1.0 - 1e-12);
      EXPECT_LE(number(row, "lag1_corr"), 1.0 + 1e-12);
    } else {
      // One step: the sums are the step's own error and gradient, and m_1 = g_1 for SGD.
      const double rel_err = number(find_row(steps, row.at("layer"), row.at("strategy"), "t", "1"), "rel_err");
      expect_close(number(row, "acc_err"), rel_err, 1e-12, "T = 1: acc_err = rel_err");
      expect_close(number(row, "sgd_upd_err"), rel_err, 1e-12, "T = 1: sgd_upd_err = rel_err");
      expect_close(number(row, "sgd_disp_err"), rel_err, 1e-12, "T = 1: sgd_disp_err = rel_err");
      expect_close(number(row, "adamw_disp_err"), number(row, "adamw_upd_err"), 1e-12, "T = 1: adamw");
      expect_close(coherence, 1.0, 1e-12, "T = 1: coherence");
    }
  }

  // summary.json: one unit per (layer, gemm, strategy), agreeing with the CSVs.
  const auto summary = nlohmann::json::parse(read_text(root / "one" / "summary.json"));
  ASSERT_TRUE(summary.contains("units") && summary["units"].is_array());
  EXPECT_EQ(summary["units"].size(), sample_layers.size() * strategies.size());
  std::set<std::tuple<std::string, std::string, std::string>> units;
  for (const auto& unit : summary["units"]) {
    const std::string layer = unit.at("layer"), gemm = unit.at("gemm"), strategy = unit.at("strategy");
    SCOPED_TRACE(layer + " " + gemm + " " + strategy);
    EXPECT_TRUE(units.insert({layer, gemm, strategy}).second) << "duplicate unit";
    EXPECT_EQ(gemm, "wgrad");
    EXPECT_EQ(unit.at("steps").get<std::size_t>(), window.size());
    EXPECT_TRUE(unit.at("consecutive").get<bool>()) << "400-403 are consecutive training steps";
    const auto last_step = find_row(steps, layer, strategy, "step", std::to_string(window.back()));
    for (const auto& column : steps.header) {
      if (step_text_columns.contains(column) || step_integer_columns.contains(column)) continue;
      ASSERT_TRUE(unit.at("last").contains(column)) << column;
      ASSERT_TRUE(unit.at("mean").contains(column)) << column;
      expect_same_number(summary_number(unit["last"][column]), number(last_step, column), "last " + column);
      double sum = 0.0;
      for (const std::int64_t step : window) sum += number(find_row(steps, layer, strategy, "step", std::to_string(step)), column);
      const double mean = summary_number(unit["mean"][column]);
      if (std::isfinite(sum)) {
        expect_close(mean, sum / static_cast<double>(window.size()), 1e-12, "mean " + column);
      } else {
        expect_same_number(mean, sum, "mean " + column);
      }
    }
    const auto final_row = find_row(accumulation, layer, strategy, "T", std::to_string(window.size()));
    for (const char* column : {"alpha", "acc_err", "coherence", "structural_share", "sgd_disp_err", "adamw_disp_err"}) {
      ASSERT_TRUE(unit.contains(column)) << column;
      expect_same_number(summary_number(unit[column]), number(final_row, column), column);
    }
  }
  for (const auto& layer : sample_layers) {
    for (const auto& strategy : strategies) EXPECT_TRUE(units.contains({layer, "wgrad", strategy})) << strategy;
  }
  const auto& provenance = summary.at("provenance");
  EXPECT_EQ(provenance.at("analysis_text").get<std::string>(), read_text(ablation));
  EXPECT_EQ(provenance.at("reference").get<std::string>(), "exact");
  EXPECT_FALSE(provenance.at("attribute").get<bool>());
  EXPECT_EQ(provenance.at("filters").at("steps").get<std::string>(), window_text);
  // Hashes of the manifest and of every replayed entry file.
  EXPECT_EQ(provenance.at("input_sha256").size(), 1 + sample_layers.size() * window.size());
  fs::remove_all(root);
}

// A smaller analysis with --attribute over two steps that are not consecutive in training.
TEST(ReplaySample, AttributionIsFiniteAndPerStepMetricsDoNotDependOnTheWindow) {
  const fs::path root = fresh_directory("attribute");
  const fs::path analysis = root / "subset.toml";
  std::ofstream(analysis) << R"(name = "ablation-subset"
gemms = ["wgrad"]
reference = "exact"
[defaults]
accumulation = "fp32-block"
seed = 20241129
[[strategy]]
name = "bf16"
format = "bf16"
[[strategy]]
name = "fp8-e4m3-tensor"
format = "fp8_e4m3"
[[strategy]]
name = "mxfp4-rne"
format = "mxfp4"
rounding = "rne"
[[strategy]]
name = "mxfp4-sr"
format = "mxfp4"
rounding = "sr"
seed_policy = "per-step"
[[strategy]]
name = "mxfp4-h16"
format = "mxfp4"
rotation = "hadamard:16"
signs = "none"
[[strategy]]
name = "nvfp4"
format = "nvfp4"
)";
  const std::vector<std::string> strategies = strategy_names(analysis);
  auto attributed_arguments = replay_arguments(analysis, root / "attributed", "3,400", 1);
  attributed_arguments.push_back("--attribute");
  replay_or_fail(attributed_arguments);
  replay_or_fail(replay_arguments(analysis, root / "plain", "400-401", 1));

  const csv_table attributed = read_csv(root / "attributed" / "steps.csv");
  EXPECT_EQ(attributed.header, documented_columns("steps.csv"));
  {
    SCOPED_TRACE("--attribute");
    check_step_rows(attributed, strategies, {3, 400}, /*attributed=*/true);
  }
  const csv_table plain = read_csv(root / "plain" / "steps.csv");
  {
    SCOPED_TRACE("without --attribute");
    check_step_rows(plain, strategies, {400, 401}, /*attributed=*/false);
  }
  for (const auto& layer : sample_layers) {
    for (const auto& strategy : strategies) {
      SCOPED_TRACE(layer + " " + strategy);
      // Step 400 is t = 2 in one window and t = 1 in the other: its per-step metrics (stochastic
      // rounding seeded by the true step included) must not change.
      const auto a = find_row(attributed, layer, strategy, "step", "400");
      const auto b = find_row(plain, layer, strategy, "step", "400");
      EXPECT_EQ(a.at("t"), "2");
      EXPECT_EQ(b.at("t"), "1");
      for (const auto& column : attributed.header) {
        if (column == "t" || attribution_columns.contains(column)) continue;
        EXPECT_EQ(a.at(column), b.at(column)) << column;
      }
      if (strategy.rfind("mxfp4", 0) == 0) {
        // Rounding error is always there for 4-bit elements of real gradients.
        for (const auto& row : {a, find_row(attributed, layer, strategy, "step", "3")}) {
          EXPECT_GT(number(row, "attr_a_round"), 0.0);
          EXPECT_GT(number(row, "attr_b_round"), 0.0);
        }
      }
    }
  }
  const auto summary = nlohmann::json::parse(read_text(root / "attributed" / "summary.json"));
  EXPECT_TRUE(summary.at("provenance").at("attribute").get<bool>());
  for (const auto& unit : summary.at("units")) {
    EXPECT_FALSE(unit.at("consecutive").get<bool>()) << "steps 3 and 400 are not consecutive";
  }
  fs::remove_all(root);
}

// The real CLI binary (2 threads) killed with SIGKILL once its first layer is checkpointed, then
// --resume (1 thread): the same bytes as an uninterrupted run.
TEST(ReplaySample, KillNineThenResumeGivesTheSameBytes) {
  const fs::path root = fresh_directory("kill");
  replay_or_fail(replay_arguments(ablation, root / "clean", window_text, 1));

  const fs::path killed = root / "killed";
  const pid_t child = spawn_cli(replay_arguments(ablation, killed, window_text, 2), root / "killed.log");
  ASSERT_GE(child, 0);
  const auto first_fragment_done = [&] {
    std::error_code ignored;
    for (const auto& item : fs::directory_iterator(killed / ".partial", ignored)) {
      if (item.path().extension() == ".unit") return true;  // a finished (layer, gemm, strategy) unit
    }
    return false;
  };
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(300);
  bool killed_midway = false;
  int status = 0;
  bool exited = false;
  while (std::chrono::steady_clock::now() < deadline) {
    if (first_fragment_done()) {
      kill(child, SIGKILL);
      waitpid(child, &status, 0);
      exited = true;
      killed_midway = WIFSIGNALED(status) && !fs::exists(killed / "steps.csv");
      break;
    }
    if (waitpid(child, &status, WNOHANG) == child) {
      exited = true;
      ADD_FAILURE() << "the CLI exited (status " << status << ") before its first layer was checkpointed";
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  if (!exited) {
    kill(child, SIGKILL);
    waitpid(child, &status, 0);
  }
  ASSERT_TRUE(exited) << "no layer was checkpointed in 300 s";
  ASSERT_TRUE(killed_midway) << "the run finished before it could be killed; the test proves less";
  EXPECT_FALSE(fs::exists(killed / "steps.csv"));

  auto resume = replay_arguments(ablation, killed, window_text, 1);
  resume.push_back("--resume");
  const auto resumed = run_cli(resume);
  ASSERT_EQ(resumed.code, 0) << joined(resume) << "\n" << resumed.out << resumed.err;
  // Some finished units were kept (not all: the kill came before the end).
  const std::regex kept(R"(, ([0-9]+) of ([0-9]+) units kept from the interrupted run)");
  std::smatch match;
  ASSERT_TRUE(std::regex_search(resumed.out, match, kept)) << resumed.out;
  EXPECT_GT(std::stoi(match[1].str()), 0) << resumed.out;
  EXPECT_LT(std::stoi(match[1].str()), std::stoi(match[2].str())) << resumed.out;
  for (const char* file : {"steps.csv", "accumulation.csv", "summary.json"}) {
    SCOPED_TRACE(file);
    const std::string clean = read_text(root / "clean" / file);
    EXPECT_FALSE(clean.empty());
    EXPECT_EQ(clean, read_text(killed / file));
  }
  EXPECT_FALSE(fs::exists(killed / ".partial"));
  for (const auto& item : fs::directory_iterator(killed)) {
    EXPECT_EQ(item.path().filename().string().find(".tmp."), std::string::npos) << item.path();
  }
  fs::remove_all(root);
}

}  // namespace
