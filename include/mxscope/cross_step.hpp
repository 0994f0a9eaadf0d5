// The cross-step state of `mxscope replay` (docs/metrics.md, "Cross-step metrics" and "Optimizer
// replay"): per (layer, GEMM) the reference's running sum and its SGD and AdamW replays fed G_t, and
// per (layer, GEMM, strategy) unit the running error sum, the previous error and the optimizer
// replays fed the strategy's result Ghat_t. One call per step updates a state and returns the norms
// and inner products the accumulation.csv columns are ratios of.
//
// A step is one pass over the output, chunk by chunk in the canonical order of
// include/mxscope/compare.hpp: each element's state is updated and its terms added to every sum of
// the step at once. Each term's arithmetic is that of the definition and each sum is a canonical sum,
// so every returned value is the one a separate canonical_sum would give and does not depend on the
// number of OpenMP threads the chunks run on.
#pragma once

#include <array>
#include <cmath>
#include <cstdint>

#include "mxscope/analysis.hpp"
#include "mxscope/core/cross_step.hpp"
#include "mxscope/tensor.hpp"

namespace mxscope {

// Canonical sums over all elements: sum m_i^2, sum a_i b_i, and sqrt(sum (a_i - b_i)^2).
double squared_norm(const matrix64& m);
double dot(const matrix64& a, const matrix64& b);
double difference_norm(const matrix64& a, const matrix64& b);

// The reference side of one (layer, GEMM). Zero-sized until the first step.
struct reference_accumulators {
  std::int64_t steps = 0;
  matrix64 sum;                 // sum_t G_t
  matrix64 sgd_momentum;        // the SGD update of the last step
  matrix64 sgd_displacement;    // the sum of the SGD updates
  matrix64 adamw_first;         // AdamW moments
  matrix64 adamw_second;
  matrix64 adamw_direction;     // the AdamW update of the last step
  matrix64 adamw_displacement;  // the sum of the AdamW updates
};

struct reference_step_norms {
  double reference = 0.0;           // ||G_t||
  double sum = 0.0;                 // ||sum_{s<=t} G_s||
  double sgd_update = 0.0;          // ||SGD update of step t||
  double sgd_displacement = 0.0;    // ||sum of the SGD updates||
  double adamw_update = 0.0;        // ||AdamW update of step t||
  double adamw_displacement = 0.0;  // ||sum of the AdamW updates||
};

// Step t = state.steps + 1: adds G_t to the sum and feeds it to both optimizer replays. Throws
// input_error when G's shape differs from that of the earlier steps.
reference_step_norms reference_step(reference_accumulators& state, const matrix64& g,
                                    const optimizer_settings& settings);

// One (layer, GEMM, strategy) unit. Zero-sized until the first step.
struct unit_accumulators {
  std::int64_t steps = 0;
  matrix64 error_sum;                  // sum_t E_t, E_t = Ghat_t - G_t
  matrix64 previous_error;             // E_t of the last step
  double previous_error_energy = 0.0;  // ||E_t||^2 of the last step
  matrix64 sgd_momentum;
  matrix64 sgd_displacement;
  matrix64 adamw_first;
  matrix64 adamw_second;
  matrix64 adamw_displacement;  // (the update itself is only compared with the reference's, not kept)
};

struct unit_step_norms {
  double quantization = 0.0;           // ||X_t - G_t||, X_t the exact product of the quantized operands
  double accumulation = 0.0;           // ||Ghat_t - X_t||
  double error_energy = 0.0;           // ||E_t||^2
  double previous_error_energy = 0.0;  // ||E_{t-1}||^2 (0 at the first step)
  double lag1_dot = 0.0;               // <E_{t-1}, E_t> (0 at the first step)
  double error_sum = 0.0;              // ||sum_{s<=t} E_s||
  // Distance of the unit's optimizer replays from the reference's after step t.
  double sgd_update_difference = 0.0;
  double sgd_displacement_difference = 0.0;
  double adamw_update_difference = 0.0;
  double adamw_displacement_difference = 0.0;
};

// Step t = state.steps + 1 of a unit: `estimate` is Ghat_t (fp32), `exact` X_t, `g` G_t, and
// `reference` the state of the same (layer, GEMM) after its step t. Throws input_error on a shape
// mismatch and std::logic_error when `reference` is not at step t.
unit_step_norms unit_step(unit_accumulators& state, const reference_accumulators& reference, const matrix& estimate,
                          const matrix64& exact, const matrix64& g, const optimizer_settings& settings);

// The norms a step returns, formed from its canonical sums (the slots of core/cross_step.hpp); the
// CPU pass and the GPU state (gpu.hpp) share them. `previous_error_energy` is ||E_{t-1}||^2, kept
// from step t - 1.
inline reference_step_norms reference_norms(const std::array<double, core::reference_sum_count>& sums) {
  reference_step_norms out;
  out.reference = std::sqrt(sums[0]);
  out.sum = std::sqrt(sums[1]);
  out.sgd_update = std::sqrt(sums[2]);
  out.sgd_displacement = std::sqrt(sums[3]);
  out.adamw_update = std::sqrt(sums[4]);
  out.adamw_displacement = std::sqrt(sums[5]);
  return out;
}

inline unit_step_norms unit_norms(const std::array<double, core::unit_sum_count>& sums, std::int64_t step,
                                  double previous_error_energy) {
  unit_step_norms out;
  out.quantization = std::sqrt(sums[0]);
  out.accumulation = std::sqrt(sums[1]);
  out.error_energy = sums[2];
  out.previous_error_energy = previous_error_energy;
  out.lag1_dot = step > 1 ? sums[3] : 0.0;
  out.error_sum = std::sqrt(sums[4]);
  out.sgd_update_difference = std::sqrt(sums[5]);
  out.sgd_displacement_difference = std::sqrt(sums[6]);
  out.adamw_update_difference = std::sqrt(sums[7]);
  out.adamw_displacement_difference = std::sqrt(sums[8]);
  return out;
}

}  // namespace mxscope
