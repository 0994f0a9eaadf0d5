// The replay's units (one (layer, gemm, strategy) each): their cross-step state and how a step
// becomes their rows of steps.csv and accumulation.csv and, at the end of a layer, their fragment
// of the run directory (docs/metrics.md names every column). Used by the replay's step (step.cpp)
// and run_replay (replay.cpp).
#pragma once

#include <array>
#include <memory>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "mxscope/analysis.hpp"
#include "mxscope/compare.hpp"
#include "mxscope/cross_step.hpp"
#include "mxscope/gemm.hpp"
#include "../backend/backend.hpp"

namespace mxscope::replay_rows {

using json = nlohmann::ordered_json;

inline constexpr const char* steps_header =
    "layer,gemm,strategy,step,t,rel_err,cosine,bias,orth_err,max_abs_err,ulp_max,ulp_mean,ulp_exact_frac,"
    "quant_err,accum_err,a_role,b_role,a_underflow_frac,b_underflow_frac,a_saturate_frac,b_saturate_frac,"
    "a_snr_db,b_snr_db,attr_a_flush,attr_a_clip,attr_a_round,attr_b_flush,attr_b_clip,attr_b_round\n";
inline constexpr const char* accumulation_header =
    "layer,gemm,strategy,T,step,acc_err,coherence,alpha,lag1_corr,structural_share,sgd_upd_err,sgd_disp_err,"
    "adamw_upd_err,adamw_disp_err\n";

// The per-step metrics that summary.json averages, in CSV order (names as in steps.csv).
inline constexpr const char* step_metric_names[] = {"rel_err",          "cosine",           "bias",
                                             "orth_err",         "max_abs_err",      "ulp_max",
                                             "ulp_mean",         "ulp_exact_frac",   "quant_err",
                                             "accum_err",        "a_underflow_frac", "b_underflow_frac",
                                             "a_saturate_frac",  "b_saturate_frac",  "a_snr_db",
                                             "b_snr_db",         "attr_a_flush",     "attr_a_clip",
                                             "attr_a_round",     "attr_b_flush",     "attr_b_clip",
                                             "attr_b_round"};
inline constexpr int step_metric_count = sizeof(step_metric_names) / sizeof(step_metric_names[0]);

// A value as steps.csv, accumulation.csv and summary.json write it: %.17g, "nan", "inf", "-inf"
// (JSON has no NaN or infinity: json_number writes those as strings).
std::string number(double value);
json json_number(double value);

// Cross-step accumulators of one (layer, gemm, strategy) unit.

struct unit_state {
  std::string strategy_name;
  const strategy* chosen = nullptr;
  unit_accumulators accumulators;  // error sum, previous error, optimizer replays
  // With --device gpu the same state in device memory, unless that was short at its first step:
  // then `accumulators` holds it (the results are the same bits either way).
  std::shared_ptr<backend::device_unit_state> device_accumulators;
  double error_energy_sum = 0.0;  // sum_t ||E_t||^2
  double lag1_cosine_sum = 0.0;
  std::vector<double> error_sum_norms;  // ||sum_{t<=s} E_t|| for s = 1..T
  double sgd_disp_err = 0.0;            // of the last step (for the summary)
  double adamw_disp_err = 0.0;
  std::vector<std::array<double, step_metric_count>> step_metrics;  // per step, for the summary
  std::string steps_rows;         // this unit's rows of steps.csv, in step order
  std::string accumulation_rows;  // and of accumulation.csv
  double seconds = 0.0;           // wall time of its steps (for run.json, not for the results)
  // ... split into: rotate + quantize + model and exact products; comparison; the other metrics
  std::array<double, 6> stage_seconds{};  // gemm, compare, metrics; gemm = quantize + product + exact product
};

// The state shared by every strategy of one (layer, gemm): the reference side.
struct gemm_state {
  gemm_kind kind;
  reference_accumulators reference;  // sum_t G_t and the optimizer replays fed G_t
  double reference_sum_norm = 0.0;   // ||sum_t G_t|| after the last step
  std::vector<unit_state> units;
  // With --device gpu the reference state in device memory (as for a unit's). A unit that runs on
  // the host reads `reference`, downloaded from here once per step when such a unit needs it.
  std::shared_ptr<backend::device_reference_state> device_reference;
};

// A unit's fragment of the run directory: its rows of steps.csv and accumulation.csv, its summary
// record (mean and last of each per-step metric and the final cross-step values) and its times.
json unit_fragment(const std::string& unit_text, const std::string& layer_name, const gemm_state& state,
                   const unit_state& unit, bool consecutive);

// The per-step metrics of one unit in steps.csv's column order (docs/metrics.md): the comparison
// with the reference, the quantization / accumulation split, the operands' underflow, saturation
// and SNR, and the attribution (NaN when not asked for).
std::array<double, step_metric_count> step_values(const comparison& metrics, double quant_err, double accum_err,
                                                  const gemm_result& result, const std::array<double, 6>& attributed);

// Step t (1-based) of a unit: its metrics kept for the summary and its row of steps.csv (the
// operand roles after the tenth value).
void add_step_row(unit_state& unit, const std::array<double, step_metric_count>& values, const std::string& layer_name,
                  gemm_kind kind, std::int64_t step, std::int64_t t, const gemm_layout& layout);

// Step t (1-based) of a unit's cross-step metrics: updates its sums and appends its row of
// accumulation.csv (docs/metrics.md: acc_err, coherence, alpha, lag1, structural share and the
// optimizer-replay errors).
void add_cross_step_row(unit_state& unit, const unit_step_norms& norms, const reference_step_norms& reference_norms,
                        std::int64_t t, const std::string& layer_name, gemm_kind kind, std::int64_t step);

}  // namespace mxscope::replay_rows
