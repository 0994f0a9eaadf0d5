// How a unit's error grows over the replayed window (docs/metrics.md, "Across steps"): the window
// metrics of accumulation.csv and summary.json, from the running sums the replay keeps for one
// (layer, GEMM, strategy) unit. After T steps, with E_t the step's error and G_t its reference:
//   acc_err          ||sum_t E_t|| / ||sum_t G_t||
//   coherence        ||sum_t E_t|| / sqrt(sum_t ||E_t||^2)       (1: errors average out; sqrt(T): identical)
//   structural_share ||sum_t E_t||^2 / (T sum_t ||E_t||^2)       (coherence^2 / T, the share of error
//                                                                 energy that is the same every step)
//   lag1_corr        mean over t = 2..T of cos(E_{t-1}, E_t)
//   alpha            least-squares slope of log ||sum_{s<=t} E_s|| against log t, t = 1..T
// One definition for both outputs of the replay; the CLI's `gemm` has no window.
#pragma once

#include <cmath>
#include <cstddef>
#include <limits>
#include <span>

namespace mxscope::core {

// numerator / denominator, with 0/0 = 0 (no error against no signal) and x/0 = inf for x != 0.
inline double ratio(double numerator, double denominator) {
  if (denominator == 0.0) return numerator == 0.0 ? 0.0 : std::numeric_limits<double>::infinity();
  return numerator / denominator;
}

inline double coherence(double error_sum_norm, double error_energy_sum) {
  return ratio(error_sum_norm, std::sqrt(error_energy_sum));
}

inline double structural_share(double error_sum_norm, double steps, double error_energy_sum) {
  return ratio(error_sum_norm * error_sum_norm, steps * error_energy_sum);
}

// alpha: the slope of log(norms[t-1]) against log(t), t = 1..T; NaN for T < 2 or a norm that is
// zero or not finite (its logarithm is undefined).
inline double growth_exponent(std::span<const double> norms) {
  const std::size_t count = norms.size();
  if (count < 2) return std::numeric_limits<double>::quiet_NaN();
  double mean_x = 0.0, mean_y = 0.0;
  for (std::size_t s = 0; s < count; ++s) {
    if (!(norms[s] > 0.0) || !std::isfinite(norms[s])) return std::numeric_limits<double>::quiet_NaN();
    mean_x += std::log(static_cast<double>(s + 1));
    mean_y += std::log(norms[s]);
  }
  mean_x /= static_cast<double>(count);
  mean_y /= static_cast<double>(count);
  double covariance = 0.0, variance = 0.0;
  for (std::size_t s = 0; s < count; ++s) {
    const double dx = std::log(static_cast<double>(s + 1)) - mean_x;
    covariance += dx * (std::log(norms[s]) - mean_y);
    variance += dx * dx;
  }
  return covariance / variance;
}

}  // namespace mxscope::core
