// The per-element arithmetic of the replay's cross-step state (include/mxscope/cross_step.hpp):
// how one element of a state is updated at a step and which terms it adds to which sums. The CPU
// pass (src/cross_step.cpp) and the GPU kernels (src/gpu/kernels.cu) both call these functions, so
// with no contraction of multiplies and adds (host -ffp-contract=off, device --fmad=false) and
// correctly rounded division and square root on both, an element's state and terms have the same
// bits on both. The sums themselves are the caller's: each accumulator takes its terms in index
// order within a canonical chunk (compare.hpp).
//
// Accumulator slots of a reference step (reference_sum_count of them):
//   0 ||G||^2, 1 ||sum G||^2, 2 ||SGD update||^2, 3 ||SGD displacement||^2,
//   4 ||AdamW update||^2, 5 ||AdamW displacement||^2.
// Of a unit step (unit_sum_count):
//   0 ||X - G||^2, 1 ||Ghat - X||^2, 2 ||E||^2, 3 <E_{t-1}, E>, 4 ||sum E||^2,
//   5 ||SGD update - reference's||^2, 6 ||SGD displacement - reference's||^2,
//   7 ||AdamW update - reference's||^2, 8 ||AdamW displacement - reference's||^2.
#pragma once

#include <cmath>
#include <cstdint>

#include "mxscope/core/config.hpp"

namespace mxscope::core {

inline constexpr int reference_sum_count = 6;
inline constexpr int unit_sum_count = 9;

// The AdamW constants of step t, bias corrections 1 - beta^t included (computed on the host).
struct adamw_step_constants {
  double beta1 = 0.0, beta2 = 0.0, eps = 0.0, correction1 = 0.0, correction2 = 0.0;
};

inline adamw_step_constants make_adamw_step_constants(double beta1, double beta2, double eps, std::int64_t t) {
  adamw_step_constants c;
  c.beta1 = beta1;
  c.beta2 = beta2;
  c.eps = eps;
  c.correction1 = 1.0 - std::pow(beta1, static_cast<double>(t));
  c.correction2 = 1.0 - std::pow(beta2, static_cast<double>(t));
  return c;
}

// ---------------------------------------------------------------------------------------------
// Stages: the updates of one element, each with the terms it adds. A step runs its stages in the
// order below for every element; the CPU runs each stage over a block of elements at a time, the
// GPU all stages per element, which changes no sum (each accumulator still sees index order).

// One SGD-with-momentum step fed `gradient`: momentum m = beta m + g, displacement d += m. Returns m.
MXSCOPE_HD inline double sgd_element(double beta, double gradient, double& momentum, double& displacement) {
  const double m = beta * momentum + gradient;
  const double d = displacement + m;
  momentum = m;
  displacement = d;
  return m;
}

// One AdamW step fed `gradient`: the moments, the bias-corrected update u (returned) and the
// displacement d += u.
MXSCOPE_HD inline double adamw_element(const adamw_step_constants& c, double gradient, double& first, double& second,
                                       double& displacement) {
  const double f = c.beta1 * first + (1.0 - c.beta1) * gradient;
  const double q = c.beta2 * second + (1.0 - c.beta2) * gradient * gradient;
  first = f;
  second = q;
  const double mean = f / c.correction1;
  const double variance = q / c.correction2;
  const double u = mean / (std::sqrt(variance) + c.eps);
  displacement = displacement + u;
  return u;
}

// Reference, stage 1: the running sum; slots 0, 1.
MXSCOPE_HD inline void reference_sum_stage(double g, double& sum, double* acc) {
  const double s = sum + g;
  sum = s;
  acc[0] = acc[0] + g * g;
  acc[1] = acc[1] + s * s;
}

// Reference, stage 2: the SGD replay; slots 2, 3.
MXSCOPE_HD inline void reference_sgd_stage(double beta, double g, double& momentum, double& displacement,
                                           double* acc) {
  const double m = sgd_element(beta, g, momentum, displacement);
  const double d = displacement;
  acc[2] = acc[2] + m * m;
  acc[3] = acc[3] + d * d;
}

// Reference, stage 3 (terms only; the update is adamw_element, its result kept as the direction):
// slots 4, 5.
MXSCOPE_HD inline void reference_adamw_terms(double direction, double displacement, double* acc) {
  acc[4] = acc[4] + direction * direction;
  acc[5] = acc[5] + displacement * displacement;
}

// Unit, stage 1: the errors of Ghat (fp32, widened exactly) against X and G; slots 0, 1, 2.
// Returns E = Ghat - G; `widened` receives Ghat in fp64.
MXSCOPE_HD inline double unit_error_stage(float estimate, double exact, double g, double& widened, double* acc) {
  const double e = static_cast<double>(estimate);
  const double quantization = exact - g;
  const double accumulation = e - exact;
  const double difference = e - g;
  widened = e;
  acc[0] = acc[0] + quantization * quantization;
  acc[1] = acc[1] + accumulation * accumulation;
  acc[2] = acc[2] + difference * difference;
  return difference;
}

// Unit, stage 2: E_{t-1} -> E_t and the running error sum; slots 3, 4.
MXSCOPE_HD inline void unit_error_sum_stage(double error, double& previous_error, double& error_sum, double* acc) {
  const double previous = previous_error;
  const double s = error_sum + error;
  previous_error = error;
  error_sum = s;
  acc[3] = acc[3] + previous * error;
  acc[4] = acc[4] + s * s;
}

// Unit, stage 3: the SGD replay fed Ghat and its distance from the reference's; slots 5, 6.
MXSCOPE_HD inline void unit_sgd_stage(double beta, double widened, double& momentum, double& displacement,
                                      double reference_momentum, double reference_displacement, double* acc) {
  const double m = sgd_element(beta, widened, momentum, displacement);
  const double update_difference = m - reference_momentum;
  const double displacement_difference = displacement - reference_displacement;
  acc[5] = acc[5] + update_difference * update_difference;
  acc[6] = acc[6] + displacement_difference * displacement_difference;
}

// Unit, stage 4 (terms only; the update is adamw_element fed Ghat): slots 7, 8.
MXSCOPE_HD inline void unit_adamw_terms(double direction, double displacement, double reference_direction,
                                        double reference_displacement, double* acc) {
  const double update_difference = direction - reference_direction;
  const double displacement_difference = displacement - reference_displacement;
  acc[7] = acc[7] + update_difference * update_difference;
  acc[8] = acc[8] + displacement_difference * displacement_difference;
}

// ---------------------------------------------------------------------------------------------
// Whole elements: every stage of element i in order (the GPU's per-thread loop).

struct reference_state_view {
  double* sum;
  double* sgd_momentum;
  double* sgd_displacement;
  double* adamw_first;
  double* adamw_second;
  double* adamw_direction;
  double* adamw_displacement;
};

// One element's reference state values, read and written in place (every one written).
struct reference_element_values {
  double& sum;
  double& sgd_momentum;
  double& sgd_displacement;
  double& adamw_first;
  double& adamw_second;
  double& adamw_direction;
  double& adamw_displacement;
};

MXSCOPE_HD inline void reference_element_of(const reference_element_values& v, double beta,
                                            const adamw_step_constants& adamw, double g, double* acc) {
  reference_sum_stage(g, v.sum, acc);
  reference_sgd_stage(beta, g, v.sgd_momentum, v.sgd_displacement, acc);
  const double u = adamw_element(adamw, g, v.adamw_first, v.adamw_second, v.adamw_displacement);
  v.adamw_direction = u;
  reference_adamw_terms(u, v.adamw_displacement, acc);
}

MXSCOPE_HD inline void reference_element(const reference_state_view& s, double beta, const adamw_step_constants& adamw,
                                         double g, std::int64_t i, double* acc) {
  reference_element_of({s.sum[i], s.sgd_momentum[i], s.sgd_displacement[i], s.adamw_first[i], s.adamw_second[i],
                        s.adamw_direction[i], s.adamw_displacement[i]},
                       beta, adamw, g, acc);
}

struct unit_state_view {
  double* error_sum;
  double* previous_error;
  double* sgd_momentum;
  double* sgd_displacement;
  double* adamw_first;
  double* adamw_second;
  double* adamw_displacement;
};

// The reference's state after the same step, read only.
struct reference_optimizer_view {
  const double* sgd_momentum;
  const double* sgd_displacement;
  const double* adamw_direction;
  const double* adamw_displacement;
};

// One element's unit state values, read and written in place (every one written).
struct unit_element_values {
  double& error_sum;
  double& previous_error;
  double& sgd_momentum;
  double& sgd_displacement;
  double& adamw_first;
  double& adamw_second;
  double& adamw_displacement;
};

MXSCOPE_HD inline void unit_element_of(const unit_element_values& v, const reference_optimizer_view& r, double beta,
                                       const adamw_step_constants& adamw, float estimate, double exact, double g,
                                       std::int64_t i, double* acc) {
  double widened = 0.0;
  const double error = unit_error_stage(estimate, exact, g, widened, acc);
  unit_error_sum_stage(error, v.previous_error, v.error_sum, acc);
  unit_sgd_stage(beta, widened, v.sgd_momentum, v.sgd_displacement, r.sgd_momentum[i], r.sgd_displacement[i], acc);
  const double u = adamw_element(adamw, widened, v.adamw_first, v.adamw_second, v.adamw_displacement);
  unit_adamw_terms(u, v.adamw_displacement, r.adamw_direction[i], r.adamw_displacement[i], acc);
}

MXSCOPE_HD inline void unit_element(const unit_state_view& s, const reference_optimizer_view& r, double beta,
                                    const adamw_step_constants& adamw, float estimate, double exact, double g,
                                    std::int64_t i, double* acc) {
  unit_element_of({s.error_sum[i], s.previous_error[i], s.sgd_momentum[i], s.sgd_displacement[i], s.adamw_first[i],
                   s.adamw_second[i], s.adamw_displacement[i]},
                  r, beta, adamw, estimate, exact, g, i, acc);
}

}  // namespace mxscope::core
