#include "mxscope/cross_step.hpp"

#include <fmt/format.h>

#include <cmath>
#include <stdexcept>
#include <string>

#include "mxscope/compare.hpp"
#include "mxscope/errors.hpp"

namespace mxscope {

namespace {

// Elementwise loops (each element on its own, so any split over threads gives the same values).
#ifdef _OPENMP
#define MXSCOPE_ELEMENTWISE _Pragma("omp parallel for schedule(static)")
#else
#define MXSCOPE_ELEMENTWISE
#endif

template <class T>
void require_shape(const basic_matrix<T>& m, std::int64_t rows, std::int64_t cols, const char* what,
                   const char* where) {
  if (m.rows != rows || m.cols != cols) {
    throw input_error(fmt::format("{}: {} is [{}, {}], expected [{}, {}]", where, what, m.rows, m.cols, rows, cols));
  }
}

matrix64 widen(const matrix& m) {
  matrix64 out(m.rows, m.cols);
  const std::int64_t count = static_cast<std::int64_t>(m.values.size());
  MXSCOPE_ELEMENTWISE
  for (std::int64_t i = 0; i < count; ++i) {
    out.values[static_cast<std::size_t>(i)] = static_cast<double>(m.values[static_cast<std::size_t>(i)]);
  }
  return out;
}

// sum += term, elementwise.
void add_to(matrix64& sum, const matrix64& term) {
  const std::int64_t count = static_cast<std::int64_t>(term.values.size());
  MXSCOPE_ELEMENTWISE
  for (std::int64_t i = 0; i < count; ++i) sum.values[static_cast<std::size_t>(i)] += term.values[static_cast<std::size_t>(i)];
}

// a - b, elementwise.
matrix64 difference(const matrix64& a, const matrix64& b) {
  matrix64 out(a.rows, a.cols);
  const std::int64_t count = static_cast<std::int64_t>(a.values.size());
  MXSCOPE_ELEMENTWISE
  for (std::int64_t i = 0; i < count; ++i) {
    const auto j = static_cast<std::size_t>(i);
    out.values[j] = a.values[j] - b.values[j];
  }
  return out;
}

void sgd_step(matrix64& momentum, matrix64& displacement, const matrix64& gradient, double beta) {
  const std::int64_t count = static_cast<std::int64_t>(gradient.values.size());
  MXSCOPE_ELEMENTWISE
  for (std::int64_t j = 0; j < count; ++j) {
    const auto i = static_cast<std::size_t>(j);
    momentum.values[i] = beta * momentum.values[i] + gradient.values[i];
    displacement.values[i] += momentum.values[i];
  }
}

void adamw_step(matrix64& first, matrix64& second, matrix64& direction, matrix64& displacement,
                const matrix64& gradient, const optimizer_settings& settings, std::int64_t t) {
  const double beta1 = settings.adamw_beta1;
  const double beta2 = settings.adamw_beta2;
  const double correction1 = 1.0 - std::pow(beta1, static_cast<double>(t));
  const double correction2 = 1.0 - std::pow(beta2, static_cast<double>(t));
  const std::int64_t count = static_cast<std::int64_t>(gradient.values.size());
  MXSCOPE_ELEMENTWISE
  for (std::int64_t j = 0; j < count; ++j) {
    const auto i = static_cast<std::size_t>(j);
    const double g = gradient.values[i];
    first.values[i] = beta1 * first.values[i] + (1.0 - beta1) * g;
    second.values[i] = beta2 * second.values[i] + (1.0 - beta2) * g * g;
    const double mean = first.values[i] / correction1;
    const double variance = second.values[i] / correction2;
    direction.values[i] = mean / (std::sqrt(variance) + settings.adamw_eps);
    displacement.values[i] += direction.values[i];
  }
}

}  // namespace

double squared_norm(const matrix64& m) {
  return canonical_sum(m.size(), [&](std::int64_t i) {
    const double v = m.values[static_cast<std::size_t>(i)];
    return v * v;
  });
}

double dot(const matrix64& a, const matrix64& b) {
  return canonical_sum(a.size(), [&](std::int64_t i) {
    return a.values[static_cast<std::size_t>(i)] * b.values[static_cast<std::size_t>(i)];
  });
}

double difference_norm(const matrix64& a, const matrix64& b) {
  return std::sqrt(canonical_sum(a.size(), [&](std::int64_t i) {
    const double d = a.values[static_cast<std::size_t>(i)] - b.values[static_cast<std::size_t>(i)];
    return d * d;
  }));
}

reference_step_norms reference_step(reference_accumulators& state, const matrix64& g,
                                    const optimizer_settings& settings) {
  if (state.steps == 0) {
    for (matrix64* m : {&state.sum, &state.sgd_momentum, &state.sgd_displacement, &state.adamw_first,
                        &state.adamw_second, &state.adamw_direction, &state.adamw_displacement}) {
      *m = matrix64(g.rows, g.cols);
    }
  }
  require_shape(g, state.sum.rows, state.sum.cols, "G", "reference_step");
  const std::int64_t t = ++state.steps;
  reference_step_norms out;
  out.reference = std::sqrt(squared_norm(g));
  add_to(state.sum, g);
  sgd_step(state.sgd_momentum, state.sgd_displacement, g, settings.sgd_momentum);
  adamw_step(state.adamw_first, state.adamw_second, state.adamw_direction, state.adamw_displacement, g, settings, t);
  out.sum = std::sqrt(squared_norm(state.sum));
  out.sgd_update = std::sqrt(squared_norm(state.sgd_momentum));
  out.sgd_displacement = std::sqrt(squared_norm(state.sgd_displacement));
  out.adamw_update = std::sqrt(squared_norm(state.adamw_direction));
  out.adamw_displacement = std::sqrt(squared_norm(state.adamw_displacement));
  return out;
}

unit_step_norms unit_step(unit_accumulators& state, const reference_accumulators& reference, const matrix& estimate,
                          const matrix64& exact, const matrix64& g, const optimizer_settings& settings) {
  require_shape(exact, g.rows, g.cols, "the exact product X", "unit_step");
  require_shape(estimate, g.rows, g.cols, "the estimate Ghat", "unit_step");
  if (reference.steps != state.steps + 1) {
    throw std::logic_error(fmt::format("unit_step: step {} of a unit needs the reference at that step, not at step {}",
                                       state.steps + 1, reference.steps));
  }
  require_shape(reference.sum, g.rows, g.cols, "the reference state", "unit_step");
  if (state.steps == 0) {
    for (matrix64* m : {&state.error_sum, &state.sgd_momentum, &state.sgd_displacement, &state.adamw_first,
                        &state.adamw_second, &state.adamw_direction, &state.adamw_displacement}) {
      *m = matrix64(g.rows, g.cols);
    }
  }
  const std::int64_t t = ++state.steps;
  unit_step_norms out;
  const matrix64 widened = widen(estimate);
  out.quantization = difference_norm(exact, g);
  out.accumulation = difference_norm(widened, exact);
  matrix64 error = difference(widened, g);
  add_to(state.error_sum, error);
  out.error_energy = squared_norm(error);
  if (t > 1) {
    out.previous_error_energy = squared_norm(state.previous_error);
    out.lag1_dot = dot(state.previous_error, error);
  }
  out.error_sum = std::sqrt(squared_norm(state.error_sum));
  sgd_step(state.sgd_momentum, state.sgd_displacement, widened, settings.sgd_momentum);
  adamw_step(state.adamw_first, state.adamw_second, state.adamw_direction, state.adamw_displacement, widened,
             settings, t);
  out.sgd_update_difference = difference_norm(state.sgd_momentum, reference.sgd_momentum);
  out.sgd_displacement_difference = difference_norm(state.sgd_displacement, reference.sgd_displacement);
  out.adamw_update_difference = difference_norm(state.adamw_direction, reference.adamw_direction);
  out.adamw_displacement_difference = difference_norm(state.adamw_displacement, reference.adamw_displacement);
  state.previous_error = std::move(error);
  state.previous_error_energy = out.error_energy;
  return out;
}

}  // namespace mxscope
