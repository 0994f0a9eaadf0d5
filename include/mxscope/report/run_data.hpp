// A replay's run directory as the report reads it: steps.csv and accumulation.csv grouped by
// layer x GEMM ("unit") and strategy, summary.json kept as parsed, and the per-unit ranking of
// strategies the report and the notebook show. Column meanings: docs/metrics.md.
#pragma once

#include <nlohmann/json.hpp>

#include <cstddef>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

namespace mxscope::report {

// One row of steps.csv, reduced to what the report draws.
struct step_record {
  long long step = 0;  // true training step
  long long t = 0;     // position in the replayed window, 1..T
  double rel_err = 0.0;
  double cosine = 0.0;
  double bias = 0.0;
  double a_underflow_frac = 0.0;
  double b_underflow_frac = 0.0;
  double a_saturate_frac = 0.0;
  double b_saturate_frac = 0.0;
};

// One row of accumulation.csv, reduced to what the report draws.
struct accumulation_record {
  long long T = 0;
  long long step = 0;
  double acc_err = 0.0;
  double coherence = 0.0;
  double alpha = 0.0;
  double lag1_corr = 0.0;
  double structural_share = 0.0;
  double sgd_disp_err = 0.0;
  double adamw_disp_err = 0.0;
};

// One strategy's rows for one unit, sorted by t and by T.
struct strategy_series {
  std::string strategy;
  std::size_t strategy_index = 0;  // position in run_data::strategies: the same colour in every plot
  std::string a_role;              // which captured tensor operand a is (dy, x or w)
  std::string b_role;
  std::vector<step_record> steps;
  std::vector<accumulation_record> accumulation;
};

struct unit_data {
  std::string layer;
  std::string gemm;
  std::vector<strategy_series> strategies;  // in order of first appearance in steps.csv
};

struct run_data {
  std::filesystem::path directory;
  std::vector<std::string> strategies;  // every strategy, in order of first appearance in steps.csv
  std::vector<unit_data> units;         // every layer x GEMM, in order of first appearance in steps.csv
  nlohmann::ordered_json summary;       // summary.json as written (member order kept)
};

// Reads and checks RUN/steps.csv, RUN/accumulation.csv and RUN/summary.json. Throws input_error
// naming the file, line and column of the first problem: a missing file or column, a field that is
// not a number (every column except the text columns layer, gemm, strategy, a_role, b_role must be
// numeric), t or T below 1, a repeated (unit, strategy, t) or (unit, strategy, T), a unit x strategy
// present in one CSV but not in the other, invalid JSON.
run_data load_run(const std::filesystem::path& directory);

// The columns of the two CSVs that hold text; every other column holds numbers.
inline constexpr std::string_view text_columns[] = {"layer", "gemm", "strategy", "a_role", "b_role"};
bool is_text_column(std::string_view name);

// How the final growth exponent alpha classifies a strategy's error across steps.
inline constexpr double coherent_alpha_threshold = 0.75;   // alpha >= this: the errors add up
inline constexpr double averaging_alpha_threshold = 0.6;   // alpha <= this: they average out
// A bias that keeps its sign at every step and is at least this fraction of the final acc_err is
// a coherent error whatever alpha says: each step shrinks (or inflates) the gradient by a similar
// factor, the summed update carries about that factor too, and it is most of the summed error.
inline constexpr double coherent_bias_fraction = 0.5;
enum class verdict { coherent, coherent_bias, averages_out, mixed, undefined };
verdict verdict_for_alpha(double alpha);
// coherent_bias when every step's bias has one sign and |mean bias| >= coherent_bias_fraction x
// the final acc_err (at least 2 steps), else verdict_for_alpha(alpha).
verdict verdict_for(double alpha, double bias_mean, bool bias_one_sign, double acc_err, long long steps);
// "coherent", "coherent (bias)", "averages out", "mixed", "n/a" (alpha is nan for T < 2).
std::string_view verdict_text(verdict value);

// One line of a unit's ranking: the final (largest T) accumulation row plus the mean per-step error.
struct ranking_row {
  int rank = 0;  // 1 = smallest acc_err; equal acc_err share a rank (1, 2, 2, 4), nan ranks last
  std::string strategy;
  std::size_t strategy_index = 0;
  long long T = 0;
  double acc_err = 0.0;
  double rel_err_mean = 0.0;
  double coherence = 0.0;
  double alpha = 0.0;
  double lag1_corr = 0.0;
  double structural_share = 0.0;
  double sgd_disp_err = 0.0;
  double adamw_disp_err = 0.0;
  double bias_mean = 0.0;      // the mean per-step bias (negative: the strategy shrinks the gradient)
  bool bias_one_sign = false;  // every step's bias has the sign of bias_mean (and is nonzero)
  report::verdict verdict = verdict::undefined;
};

// The unit's strategies ordered by final acc_err, smallest first; a nan acc_err ranks last, and
// equal values keep the order of first appearance and share a rank (identical strategies tie).
std::vector<ranking_row> rank_strategies(const unit_data& unit);

// What the report shows as provenance: summary.json's "provenance" object when it has one,
// otherwise every top-level member except per-unit results (arrays of objects carrying a
// "strategy" or "layer" member, and members named "units" or "results"). The analysis file's text
// is taken out and shown on its own: the first string member, at the top level or one level down,
// named "analysis" or with "analysis" in its name and several lines of text (or "text", "contents"
// or "toml" inside an object named like that).
struct provenance {
  nlohmann::ordered_json fields = nlohmann::ordered_json::object();
  std::string analysis_key;   // empty when there is none
  std::string analysis_text;
};
provenance provenance_of(const nlohmann::ordered_json& summary);

}  // namespace mxscope::report
