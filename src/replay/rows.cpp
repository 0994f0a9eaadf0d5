#include "rows.hpp"

#include <fmt/format.h>

#include <cmath>
#include <limits>

#include "mxscope/core/growth.hpp"

namespace mxscope::replay_rows {

using core::ratio;  // 0/0 = 0, x/0 = inf (core/growth.hpp)

std::string number(double value) {
  if (std::isnan(value)) return "nan";
  if (std::isinf(value)) return value > 0 ? "inf" : "-inf";
  return fmt::format("{:.17g}", value);
}

json json_number(double value) {
  if (std::isfinite(value)) return json(value);
  return json(number(value));  // JSON has no NaN or infinity: write them as strings
}

// A unit's fragment of the run directory: its rows of steps.csv and accumulation.csv, its summary
// record (mean and last of each per-step metric and the final cross-step values) and its times.
json unit_fragment(const std::string& unit_text, const std::string& layer_name, const gemm_state& state,
                   const unit_state& unit, bool consecutive) {
  json fragment;
  fragment["unit"] = unit_text;
  fragment["steps"] = unit.steps_rows;
  fragment["accumulation"] = unit.accumulation_rows;
  json record;
  record["layer"] = layer_name;
  record["gemm"] = gemm_kind_name(state.kind);
  record["strategy"] = unit.strategy_name;
  record["steps"] = unit.step_metrics.size();
  record["consecutive"] = consecutive;
  json mean = json::object(), last = json::object();
  for (int m = 0; m < step_metric_count; ++m) {
    double sum = 0.0;
    for (const auto& row : unit.step_metrics) sum += row[static_cast<std::size_t>(m)];
    mean[step_metric_names[m]] = json_number(sum / static_cast<double>(unit.step_metrics.size()));
    last[step_metric_names[m]] = json_number(unit.step_metrics.back()[static_cast<std::size_t>(m)]);
  }
  record["mean"] = mean;
  record["last"] = last;
  const double error_sum_norm = unit.error_sum_norms.back();
  const double total_steps = static_cast<double>(unit.step_metrics.size());
  record["alpha"] = json_number(core::growth_exponent(unit.error_sum_norms));
  record["acc_err"] = json_number(ratio(error_sum_norm, state.reference_sum_norm));
  record["coherence"] = json_number(core::coherence(error_sum_norm, unit.error_energy_sum));
  record["structural_share"] = json_number(core::structural_share(error_sum_norm, total_steps, unit.error_energy_sum));
  // The values of the last accumulation.csv row (docs/metrics.md).
  record["sgd_disp_err"] = json_number(unit.sgd_disp_err);
  record["adamw_disp_err"] = json_number(unit.adamw_disp_err);
  fragment["summary"] = record;
  fragment["seconds"] = unit.seconds;
  fragment["stage_seconds"] = {{"gemm", unit.stage_seconds[0]},
                               {"compare", unit.stage_seconds[1]},
                               {"metrics", unit.stage_seconds[2]},
                               {"gemm_quantize", unit.stage_seconds[3]},
                               {"gemm_product", unit.stage_seconds[4]},
                               {"gemm_exact_product", unit.stage_seconds[5]}};
  return fragment;
}

// The per-step metrics of one unit in steps.csv's column order (docs/metrics.md): the comparison
// with the reference, the quantization / accumulation split, the operands' underflow, saturation
// and SNR, and the attribution (NaN when not asked for).
std::array<double, step_metric_count> step_values(const comparison& metrics, double quant_err, double accum_err,
                                                  const gemm_result& result, const std::array<double, 6>& attributed) {
  const double ulp_exact_fraction =
      metrics.ulp.compared == 0 ? 0.0
                                : static_cast<double>(metrics.ulp.histogram[0]) / static_cast<double>(metrics.ulp.compared);
  return {metrics.rel_err,
          metrics.cosine,
          metrics.bias,
          metrics.orth_err,
          metrics.max_abs_err,
          static_cast<double>(metrics.ulp.max),
          metrics.ulp.mean,
          ulp_exact_fraction,
          quant_err,
          accum_err,
          underflow_fraction(result.a),
          underflow_fraction(result.b),
          saturate_fraction(result.a),
          saturate_fraction(result.b),
          snr_db(result.a),
          snr_db(result.b),
          attributed[0],
          attributed[1],
          attributed[2],
          attributed[3],
          attributed[4],
          attributed[5]};
}

// Step t (1-based) of a unit: its metrics kept for the summary and its row of steps.csv (the
// operand roles after the tenth value).
void add_step_row(unit_state& unit, const std::array<double, step_metric_count>& values, const std::string& layer_name,
                  gemm_kind kind, std::int64_t step, std::int64_t t, const gemm_layout& layout) {
  unit.step_metrics.push_back(values);
  unit.steps_rows += fmt::format("{},{},{},{},{}", layer_name, gemm_kind_name(kind), unit.strategy_name, step, t);
  for (int m = 0; m < step_metric_count; ++m) {
    unit.steps_rows += ',';
    unit.steps_rows += number(values[static_cast<std::size_t>(m)]);
    if (m == 9) unit.steps_rows += fmt::format(",{},{}", layout.a_name, layout.b_name);
  }
  unit.steps_rows += '\n';
}

// Step t (1-based) of a unit's cross-step metrics: updates its sums and appends its row of
// accumulation.csv (docs/metrics.md: acc_err, coherence, alpha, lag1, structural share and the
// optimizer-replay errors).
void add_cross_step_row(unit_state& unit, const unit_step_norms& norms, const reference_step_norms& reference_norms,
                        std::int64_t t, const std::string& layer_name, gemm_kind kind, std::int64_t step) {
  const double error_energy = norms.error_energy;
  unit.error_energy_sum += error_energy;
  if (t > 1) {
    const double lag1_norms = std::sqrt(norms.previous_error_energy * error_energy);
    unit.lag1_cosine_sum += lag1_norms == 0.0 ? 0.0 : norms.lag1_dot / lag1_norms;
  }
  const double error_sum_norm = norms.error_sum;
  unit.error_sum_norms.push_back(error_sum_norm);
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double acc_err = ratio(error_sum_norm, reference_norms.sum);
  const double coherence = core::coherence(error_sum_norm, unit.error_energy_sum);
  const double alpha = core::growth_exponent(unit.error_sum_norms);
  const double lag1 = t > 1 ? unit.lag1_cosine_sum / static_cast<double>(t - 1) : nan;
  const double structural = core::structural_share(error_sum_norm, static_cast<double>(t), unit.error_energy_sum);
  const double sgd_upd_err = ratio(norms.sgd_update_difference, reference_norms.sgd_update);
  const double sgd_disp_err = ratio(norms.sgd_displacement_difference, reference_norms.sgd_displacement);
  const double adamw_upd_err = ratio(norms.adamw_update_difference, reference_norms.adamw_update);
  const double adamw_disp_err = ratio(norms.adamw_displacement_difference, reference_norms.adamw_displacement);
  unit.sgd_disp_err = sgd_disp_err;
  unit.adamw_disp_err = adamw_disp_err;
  unit.accumulation_rows += fmt::format("{},{},{},{},{},{},{},{},{},{},{},{},{},{}\n", layer_name, gemm_kind_name(kind),
                                        unit.strategy_name, t, step, number(acc_err), number(coherence), number(alpha),
                                        number(lag1), number(structural), number(sgd_upd_err), number(sgd_disp_err),
                                        number(adamw_upd_err), number(adamw_disp_err));
}

}  // namespace mxscope::replay_rows
