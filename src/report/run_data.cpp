#include "mxscope/report/run_data.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <map>
#include <optional>
#include <sstream>
#include <utility>

#include "mxscope/errors.hpp"
#include "mxscope/io/json_guard.hpp"
#include "mxscope/io/safetensors.hpp"
#include "mxscope/report/csv.hpp"
#include "text.hpp"

namespace mxscope::report {

namespace {

std::string label_for(const std::filesystem::path& directory, const char* name) {
  return (directory / name).string();
}

// Every column that is not a text column must hold numbers: checked up front, so that a bad value
// in a column the report does not draw is still reported (the notebook reads every column).
void check_numeric_columns(const csv_table& table) {
  for (std::size_t column = 0; column < table.header().size(); ++column) {
    if (is_text_column(table.header()[column])) continue;
    for (std::size_t row = 0; row < table.row_count(); ++row) table.number(row, column);
  }
}

struct series_position {
  std::size_t unit = 0;
  std::size_t series = 0;
  auto operator<=>(const series_position&) const = default;
};

struct unit_key {
  std::string layer;
  std::string gemm;
  auto operator<=>(const unit_key&) const = default;
};

// Groups rows by unit and strategy, creating units and strategies in order of first appearance.
class run_builder {
 public:
  explicit run_builder(run_data& run) : run_(run) {}

  // Where the series of (layer, gemm, strategy) is, by index: the vectors grow while reading, so
  // pointers into them would not stay valid. With `may_create` false an unknown series is nullopt.
  std::optional<series_position> position_of(const std::string& layer, const std::string& gemm,
                                             const std::string& strategy, bool may_create) {
    const unit_key key{layer, gemm};
    auto unit_position = unit_index_.find(key);
    if (unit_position == unit_index_.end()) {
      if (!may_create) return std::nullopt;
      unit_position = unit_index_.emplace(key, run_.units.size()).first;
      run_.units.push_back(unit_data{layer, gemm, {}});
    }
    unit_data& unit = run_.units[unit_position->second];
    for (std::size_t index = 0; index < unit.strategies.size(); ++index) {
      if (unit.strategies[index].strategy == strategy) return series_position{unit_position->second, index};
    }
    if (!may_create) return std::nullopt;
    auto strategy_position = strategy_index_.find(strategy);
    if (strategy_position == strategy_index_.end()) {
      strategy_position = strategy_index_.emplace(strategy, run_.strategies.size()).first;
      run_.strategies.push_back(strategy);
    }
    strategy_series series;
    series.strategy = strategy;
    series.strategy_index = strategy_position->second;
    unit.strategies.push_back(std::move(series));
    return series_position{unit_position->second, unit.strategies.size() - 1};
  }

  strategy_series& at(const series_position& position) {
    return run_.units[position.unit].strategies[position.series];
  }

 private:
  run_data& run_;
  std::map<unit_key, std::size_t> unit_index_;
  std::map<std::string, std::size_t> strategy_index_;
};

std::string unit_text(const std::string& layer, const std::string& gemm, const std::string& strategy) {
  return fmt::format("layer '{}', gemm '{}', strategy '{}'", printable(layer, 120), printable(gemm, 40),
                     printable(strategy, 120));
}

void read_steps(const csv_table& table, run_builder& builder) {
  const std::size_t layer = table.require_column("layer");
  const std::size_t gemm = table.require_column("gemm");
  const std::size_t strategy = table.require_column("strategy");
  const std::size_t step = table.require_column("step");
  const std::size_t t = table.require_column("t");
  const std::size_t rel_err = table.require_column("rel_err");
  const std::size_t cosine = table.require_column("cosine");
  const std::size_t bias = table.require_column("bias");
  const std::size_t a_role = table.require_column("a_role");
  const std::size_t b_role = table.require_column("b_role");
  const std::size_t a_underflow = table.require_column("a_underflow_frac");
  const std::size_t b_underflow = table.require_column("b_underflow_frac");
  const std::size_t a_saturate = table.require_column("a_saturate_frac");
  const std::size_t b_saturate = table.require_column("b_saturate_frac");
  if (table.row_count() == 0) throw input_error(fmt::format("{}: no data rows after the header", table.label()));
  check_numeric_columns(table);

  // Where each (series, t) was first seen, to name both lines of a duplicate.
  std::map<std::pair<series_position, long long>, std::size_t> first_line;
  for (std::size_t row = 0; row < table.row_count(); ++row) {
    const series_position where =
        *builder.position_of(table.text(row, layer), table.text(row, gemm), table.text(row, strategy), true);
    strategy_series* series = &builder.at(where);
    step_record record;
    record.step = table.integer(row, step);
    record.t = table.integer(row, t);
    if (record.t < 1) throw input_error(fmt::format("{}: t must be 1 or more, got {}", table.where(row, t), record.t));
    const auto [position, inserted] = first_line.emplace(std::make_pair(where, record.t), table.line_of(row));
    if (!inserted) {
      throw input_error(fmt::format("{}: t = {} repeats line {} for {}", table.where(row, t), record.t,
                                    position->second,
                                    unit_text(table.text(row, layer), table.text(row, gemm), table.text(row, strategy))));
    }
    record.rel_err = table.number(row, rel_err);
    record.cosine = table.number(row, cosine);
    record.bias = table.number(row, bias);
    record.a_underflow_frac = table.number(row, a_underflow);
    record.b_underflow_frac = table.number(row, b_underflow);
    record.a_saturate_frac = table.number(row, a_saturate);
    record.b_saturate_frac = table.number(row, b_saturate);
    if (series->steps.empty()) {
      series->a_role = table.text(row, a_role);
      series->b_role = table.text(row, b_role);
    }
    series->steps.push_back(record);
  }
}

void read_accumulation(const csv_table& table, run_builder& builder) {
  const std::size_t layer = table.require_column("layer");
  const std::size_t gemm = table.require_column("gemm");
  const std::size_t strategy = table.require_column("strategy");
  const std::size_t T = table.require_column("T");
  const std::size_t step = table.require_column("step");
  const std::size_t acc_err = table.require_column("acc_err");
  const std::size_t coherence = table.require_column("coherence");
  const std::size_t alpha = table.require_column("alpha");
  const std::size_t lag1_corr = table.require_column("lag1_corr");
  const std::size_t structural_share = table.require_column("structural_share");
  const std::size_t sgd_disp_err = table.require_column("sgd_disp_err");
  const std::size_t adamw_disp_err = table.require_column("adamw_disp_err");
  if (table.row_count() == 0) throw input_error(fmt::format("{}: no data rows after the header", table.label()));
  check_numeric_columns(table);

  std::map<std::pair<series_position, long long>, std::size_t> first_line;
  for (std::size_t row = 0; row < table.row_count(); ++row) {
    const std::optional<series_position> where =
        builder.position_of(table.text(row, layer), table.text(row, gemm), table.text(row, strategy), false);
    if (!where) {
      throw input_error(fmt::format("{}: line {}: {} has no rows in steps.csv", table.label(), table.line_of(row),
                                    unit_text(table.text(row, layer), table.text(row, gemm), table.text(row, strategy))));
    }
    strategy_series* series = &builder.at(*where);
    accumulation_record record;
    record.T = table.integer(row, T);
    if (record.T < 1) throw input_error(fmt::format("{}: T must be 1 or more, got {}", table.where(row, T), record.T));
    const auto [position, inserted] = first_line.emplace(std::make_pair(*where, record.T), table.line_of(row));
    if (!inserted) {
      throw input_error(fmt::format("{}: T = {} repeats line {} for {}", table.where(row, T), record.T,
                                    position->second,
                                    unit_text(table.text(row, layer), table.text(row, gemm), table.text(row, strategy))));
    }
    record.step = table.integer(row, step);
    record.acc_err = table.number(row, acc_err);
    record.coherence = table.number(row, coherence);
    record.alpha = table.number(row, alpha);
    record.lag1_corr = table.number(row, lag1_corr);
    record.structural_share = table.number(row, structural_share);
    record.sgd_disp_err = table.number(row, sgd_disp_err);
    record.adamw_disp_err = table.number(row, adamw_disp_err);
    series->accumulation.push_back(record);
  }
}

nlohmann::ordered_json read_summary(const std::filesystem::path& path, const std::string& label) {
  std::error_code status_error;
  if (!std::filesystem::is_regular_file(path, status_error)) {
    throw input_error(fmt::format("{}: no such file (mxscope replay writes it next to steps.csv)", label));
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) throw input_error(fmt::format("{}: cannot open the file for reading", label));
  std::ostringstream contents;
  contents << in.rdbuf();
  if (const auto issue = io::find_json_issue(contents.str(), io::max_json_depth)) {
    const std::string field = issue->what == io::json_issue::kind::duplicate_key ? io::printable_name(issue->key)
                                                                                  : std::string("summary");
    throw input_error(fmt::format("{}: field '{}': {}", label, field, (issue->what == io::json_issue::kind::syntax ? "not valid JSON: " : "") +
                                      io::printable_name(issue->message, 300)));
  }
  nlohmann::ordered_json summary;
  try {
    summary = nlohmann::ordered_json::parse(contents.str());
  } catch (const nlohmann::json::parse_error& error) {
    throw input_error(fmt::format("{}: not valid JSON: {}", label, error.what()));
  }
  if (!summary.is_object()) throw input_error(fmt::format("{}: expected a JSON object at the top level", label));
  return summary;
}

bool looks_like_per_unit_results(const std::string& key, const nlohmann::ordered_json& value) {
  if (key == "units" || key == "results") return true;
  if (!value.is_array() || value.empty()) return false;
  return std::any_of(value.begin(), value.end(), [](const nlohmann::ordered_json& element) {
    return element.is_object() && (element.contains("strategy") || element.contains("layer"));
  });
}

bool names_analysis(const std::string& key) { return key.find("analysis") != std::string::npos; }

// The analysis file's text rather than, say, its path: a member named exactly "analysis", or one
// whose name contains "analysis" and whose value runs over several lines.
bool holds_analysis_text(const std::string& key, const nlohmann::ordered_json& value) {
  if (!value.is_string()) return false;
  if (key == "analysis") return true;
  return names_analysis(key) && value.get_ref<const std::string&>().find('\n') != std::string::npos;
}

// Takes the analysis text out of `fields` (top level or one level down); true when found.
bool take_analysis(nlohmann::ordered_json& fields, provenance& out) {
  for (auto member = fields.begin(); member != fields.end(); ++member) {
    if (holds_analysis_text(member.key(), member.value())) {
      out.analysis_key = member.key();
      out.analysis_text = member->get<std::string>();
      fields.erase(member);
      return true;
    }
  }
  for (auto member = fields.begin(); member != fields.end(); ++member) {
    if (!member->is_object()) continue;
    for (auto inner = member->begin(); inner != member->end(); ++inner) {
      const bool analysis_text_member =
          holds_analysis_text(inner.key(), inner.value()) ||
          (names_analysis(member.key()) && inner->is_string() &&
           (inner.key() == "text" || inner.key() == "contents" || inner.key() == "toml"));
      if (analysis_text_member) {
        out.analysis_key = member.key() + "." + inner.key();
        out.analysis_text = inner->get<std::string>();
        member->erase(inner);
        return true;
      }
    }
  }
  return false;
}

}  // namespace

bool is_text_column(std::string_view name) {
  return std::find(std::begin(text_columns), std::end(text_columns), name) != std::end(text_columns);
}

run_data load_run(const std::filesystem::path& directory) {
  std::error_code status_error;
  if (!std::filesystem::is_directory(directory, status_error)) {
    throw input_error(fmt::format("{}: not a directory (expected a run directory written by mxscope replay)",
                                  directory.string()));
  }
  run_data run;
  run.directory = directory;
  run_builder builder(run);
  const csv_table steps = csv_table::read_file(directory / "steps.csv", label_for(directory, "steps.csv"));
  const csv_table accumulation =
      csv_table::read_file(directory / "accumulation.csv", label_for(directory, "accumulation.csv"));
  run.summary = read_summary(directory / "summary.json", label_for(directory, "summary.json"));
  read_steps(steps, builder);
  read_accumulation(accumulation, builder);

  for (auto& unit : run.units) {
    for (auto& series : unit.strategies) {
      if (series.accumulation.empty()) {
        throw input_error(fmt::format("{}: {} has rows in steps.csv but none here", accumulation.label(),
                                      unit_text(unit.layer, unit.gemm, series.strategy)));
      }
      std::sort(series.steps.begin(), series.steps.end(),
                [](const step_record& left, const step_record& right) { return left.t < right.t; });
      std::sort(series.accumulation.begin(), series.accumulation.end(),
                [](const accumulation_record& left, const accumulation_record& right) { return left.T < right.T; });
    }
  }
  return run;
}

verdict verdict_for_alpha(double alpha) {
  if (std::isnan(alpha)) return verdict::undefined;
  if (alpha >= coherent_alpha_threshold) return verdict::coherent;
  if (alpha <= averaging_alpha_threshold) return verdict::averages_out;
  return verdict::mixed;
}

verdict verdict_for(double alpha, double bias_mean, bool bias_one_sign, double acc_err, long long steps) {
  if (steps >= 2 && bias_one_sign && std::fabs(bias_mean) >= coherent_bias_fraction * acc_err) {
    return verdict::coherent_bias;
  }
  return verdict_for_alpha(alpha);
}

std::string_view verdict_text(verdict value) {
  switch (value) {
    case verdict::coherent: return "coherent";
    case verdict::coherent_bias: return "coherent (bias)";
    case verdict::averages_out: return "averages out";
    case verdict::mixed: return "mixed";
    case verdict::undefined: break;
  }
  return "n/a";
}

std::vector<ranking_row> rank_strategies(const unit_data& unit) {
  std::vector<ranking_row> rows;
  for (const auto& series : unit.strategies) {
    const accumulation_record& final_row = series.accumulation.back();
    ranking_row row;
    row.strategy = series.strategy;
    row.strategy_index = series.strategy_index;
    row.T = final_row.T;
    row.acc_err = final_row.acc_err;
    double sum = 0.0, bias_sum = 0.0;
    for (const auto& step : series.steps) {
      sum += step.rel_err;
      bias_sum += step.bias;
    }
    const double count = static_cast<double>(series.steps.size());
    row.rel_err_mean = series.steps.empty() ? std::nan("") : sum / count;
    row.bias_mean = series.steps.empty() ? std::nan("") : bias_sum / count;
    row.bias_one_sign = !series.steps.empty();
    for (const auto& step : series.steps) {
      row.bias_one_sign = row.bias_one_sign && step.bias != 0.0 && (step.bias < 0.0) == (row.bias_mean < 0.0);
    }
    row.coherence = final_row.coherence;
    row.alpha = final_row.alpha;
    row.lag1_corr = final_row.lag1_corr;
    row.structural_share = final_row.structural_share;
    row.sgd_disp_err = final_row.sgd_disp_err;
    row.adamw_disp_err = final_row.adamw_disp_err;
    row.verdict = verdict_for(final_row.alpha, row.bias_mean, row.bias_one_sign, row.acc_err,
                              static_cast<long long>(series.steps.size()));
    rows.push_back(std::move(row));
  }
  std::stable_sort(rows.begin(), rows.end(), [](const ranking_row& left, const ranking_row& right) {
    if (std::isnan(left.acc_err)) return false;
    if (std::isnan(right.acc_err)) return true;
    return left.acc_err < right.acc_err;
  });
  const auto same = [](double a, double b) { return a == b || (std::isnan(a) && std::isnan(b)); };
  for (std::size_t i = 0; i < rows.size(); ++i) {
    rows[i].rank = i > 0 && same(rows[i].acc_err, rows[i - 1].acc_err) ? rows[i - 1].rank : static_cast<int>(i + 1);
  }
  return rows;
}

provenance provenance_of(const nlohmann::ordered_json& summary) {
  provenance out;
  const auto explicit_provenance = summary.find("provenance");
  if (explicit_provenance != summary.end() && explicit_provenance->is_object()) {
    out.fields = *explicit_provenance;
    if (!take_analysis(out.fields, out)) {
      nlohmann::ordered_json top_level = summary;
      top_level.erase("provenance");
      provenance from_top;
      if (take_analysis(top_level, from_top)) {
        out.analysis_key = from_top.analysis_key;
        out.analysis_text = from_top.analysis_text;
      }
    }
    return out;
  }
  for (auto member = summary.begin(); member != summary.end(); ++member) {
    if (!looks_like_per_unit_results(member.key(), member.value())) out.fields[member.key()] = member.value();
  }
  take_analysis(out.fields, out);
  return out;
}

}  // namespace mxscope::report
