#include "mxscope/cross_step.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <initializer_list>
#include <stdexcept>
#include <string>

#include "mxscope/compare.hpp"
#include "mxscope/core/cross_step.hpp"
#include "mxscope/errors.hpp"

namespace mxscope {

namespace {

template <class T>
void require_shape(const basic_matrix<T>& m, std::int64_t rows, std::int64_t cols, const char* what,
                   const char* where) {
  if (m.rows != rows || m.cols != cols) {
    throw input_error(std::string(where) + ": " + what + " is [" + std::to_string(m.rows) + ", " +
                      std::to_string(m.cols) + "], expected [" + std::to_string(rows) + ", " + std::to_string(cols) +
                      "]");
  }
}

void allocate(std::initializer_list<matrix64*> matrices, std::int64_t rows, std::int64_t cols) {
  for (matrix64* m : matrices) *m = matrix64(rows, cols);
}

core::adamw_step_constants adamw_constants(const optimizer_settings& settings, std::int64_t t) {
  return core::make_adamw_step_constants(settings.adamw_beta1, settings.adamw_beta2, settings.adamw_eps, t);
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

// One pass per step: canonical_chunk_sums hands each chunk of the canonical order to one thread,
// which updates the state of its elements and adds their terms to the step's sums. Within a chunk
// the work goes block by block, each block in a few short loops over a few matrices: the AdamW
// update (divisions and square roots, no sums) then vectorizes, and the sums run in registers (a
// local copy of the accumulators; through the caller's array every add would wait for a store).
// Each sum still takes its terms in index order, one chain per sum, so its value is unchanged.

namespace {

constexpr std::int64_t block = 512;  // elements: the scratch rows of a block stay in L1
static_assert(canonical_chunk % block == 0);

// One AdamW step of `count` elements fed `gradient`: the moments, the update (into `direction`) and
// the displacement. No sums here, so the loop vectorizes.
void adamw_update(const core::adamw_step_constants& constants, const double* __restrict gradient,
                  double* __restrict first, double* __restrict second, double* __restrict direction,
                  double* __restrict displacement, std::size_t count) {
  const core::adamw_step_constants c = constants;
  for (std::size_t i = 0; i < count; ++i) {
    direction[i] = core::adamw_element(c, gradient[i], first[i], second[i], displacement[i]);
  }
}

}  // namespace

reference_step_norms reference_step(reference_accumulators& state, const matrix64& g,
                                    const optimizer_settings& settings) {
  if (state.steps == 0) {
    allocate({&state.sum, &state.sgd_momentum, &state.sgd_displacement, &state.adamw_first, &state.adamw_second,
              &state.adamw_direction, &state.adamw_displacement},
             g.rows, g.cols);
  }
  require_shape(g, state.sum.rows, state.sum.cols, "G", "reference_step");
  const std::int64_t t = ++state.steps;
  const double beta = settings.sgd_momentum;
  const core::adamw_step_constants adamw = adamw_constants(settings, t);
  const double* gradient = g.data();
  double* sum = state.sum.data();
  double* momentum = state.sgd_momentum.data();
  double* sgd_displacement = state.sgd_displacement.data();
  double* first = state.adamw_first.data();
  double* second = state.adamw_second.data();
  double* direction = state.adamw_direction.data();
  double* adamw_displacement = state.adamw_displacement.data();
  // Sums: ||G||^2, ||sum G||^2, SGD update and displacement, AdamW update and displacement.
  const auto sums = canonical_chunk_sums<core::reference_sum_count>(g.size(), [&](std::int64_t begin, std::int64_t end,
                                                         std::array<double, core::reference_sum_count>& partials) {
    std::array<double, core::reference_sum_count> acc = partials;  // in registers: the stores below cannot touch it
    for (std::int64_t low = begin; low < end; low += block) {
      const auto first_index = static_cast<std::size_t>(low);
      const auto last_index = static_cast<std::size_t>(std::min(low + block, end));
      for (std::size_t i = first_index; i < last_index; ++i) core::reference_sum_stage(gradient[i], sum[i], acc.data());
      for (std::size_t i = first_index; i < last_index; ++i) {
        core::reference_sgd_stage(beta, gradient[i], momentum[i], sgd_displacement[i], acc.data());
      }
      adamw_update(adamw, gradient + first_index, first + first_index, second + first_index,
                   direction + first_index, adamw_displacement + first_index, last_index - first_index);
      for (std::size_t i = first_index; i < last_index; ++i) {
        core::reference_adamw_terms(direction[i], adamw_displacement[i], acc.data());
      }
    }
    partials = acc;
  });
  return reference_norms(sums);
}

unit_step_norms unit_step(unit_accumulators& state, const reference_accumulators& reference, const matrix& estimate,
                          const matrix64& exact, const matrix64& g, const optimizer_settings& settings) {
  require_shape(exact, g.rows, g.cols, "the exact product X", "unit_step");
  require_shape(estimate, g.rows, g.cols, "the estimate Ghat", "unit_step");
  if (reference.steps != state.steps + 1) {
    throw std::logic_error("unit_step: step " + std::to_string(state.steps + 1) +
                           " of a unit needs the reference at that step, not at step " + std::to_string(reference.steps));
  }
  require_shape(reference.sum, g.rows, g.cols, "the reference state", "unit_step");
  if (state.steps == 0) {
    allocate({&state.error_sum, &state.previous_error, &state.sgd_momentum, &state.sgd_displacement,
              &state.adamw_first, &state.adamw_second, &state.adamw_displacement},
             g.rows, g.cols);
  }
  require_shape(state.error_sum, g.rows, g.cols, "the unit state", "unit_step");
  const std::int64_t t = ++state.steps;
  const double beta = settings.sgd_momentum;
  const core::adamw_step_constants adamw = adamw_constants(settings, t);
  const float* ghat = estimate.data();
  const double* x = exact.data();
  const double* gradient = g.data();
  double* error_sum = state.error_sum.data();
  double* previous_error = state.previous_error.data();  // E_{t-1} in, E_t out (zero before step 1)
  double* momentum = state.sgd_momentum.data();
  double* sgd_displacement = state.sgd_displacement.data();
  double* first = state.adamw_first.data();
  double* second = state.adamw_second.data();
  double* adamw_displacement = state.adamw_displacement.data();
  const double* reference_momentum = reference.sgd_momentum.data();
  const double* reference_sgd_displacement = reference.sgd_displacement.data();
  const double* reference_direction = reference.adamw_direction.data();
  const double* reference_adamw_displacement = reference.adamw_displacement.data();
  // Sums: ||X - G||^2, ||Ghat - X||^2, ||E||^2, <E_{t-1}, E>, ||sum E||^2, and the squared distances
  // of the SGD update and displacement and of the AdamW update and displacement from the reference's.
  const auto sums = canonical_chunk_sums<core::unit_sum_count>(g.size(), [&](std::int64_t begin, std::int64_t end,
                                                         std::array<double, core::unit_sum_count>& partials) {
    std::array<double, core::unit_sum_count> acc = partials;  // in registers: the stores below cannot touch it
    double widened[block];  // Ghat (fp32 -> fp64 is exact)
    double error[block];    // E = Ghat - G
    double direction[block];  // the AdamW update
    for (std::int64_t low = begin; low < end; low += block) {
      const auto offset = static_cast<std::size_t>(low);
      const auto count = static_cast<std::size_t>(std::min(low + block, end) - low);
      const float* ghat_block = ghat + offset;
      const double* x_block = x + offset;
      const double* g_block = gradient + offset;
      for (std::size_t k = 0; k < count; ++k) {
        error[k] = core::unit_error_stage(ghat_block[k], x_block[k], g_block[k], widened[k], acc.data());
      }
      double* previous_block = previous_error + offset;
      double* error_sum_block = error_sum + offset;
      for (std::size_t k = 0; k < count; ++k) {
        core::unit_error_sum_stage(error[k], previous_block[k], error_sum_block[k], acc.data());
      }
      // The optimizer replays fed Ghat_t, as those of the reference are fed G_t.
      double* momentum_block = momentum + offset;
      double* sgd_displacement_block = sgd_displacement + offset;
      const double* reference_momentum_block = reference_momentum + offset;
      const double* reference_sgd_displacement_block = reference_sgd_displacement + offset;
      for (std::size_t k = 0; k < count; ++k) {
        core::unit_sgd_stage(beta, widened[k], momentum_block[k], sgd_displacement_block[k], reference_momentum_block[k],
                             reference_sgd_displacement_block[k], acc.data());
      }
      double* first_block = first + offset;
      double* second_block = second + offset;
      double* adamw_displacement_block = adamw_displacement + offset;
      const double* reference_direction_block = reference_direction + offset;
      const double* reference_adamw_displacement_block = reference_adamw_displacement + offset;
      adamw_update(adamw, widened, first_block, second_block, direction, adamw_displacement_block, count);
      for (std::size_t k = 0; k < count; ++k) {
        core::unit_adamw_terms(direction[k], adamw_displacement_block[k], reference_direction_block[k],
                               reference_adamw_displacement_block[k], acc.data());
      }
    }
    partials = acc;
  });
  const unit_step_norms out = unit_norms(sums, t, state.previous_error_energy);
  state.previous_error_energy = out.error_energy;
  return out;
}

}  // namespace mxscope
