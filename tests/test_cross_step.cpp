// The cross-step state of replay (include/mxscope/cross_step.hpp) against oracles that do not call it:
// - every returned value is the documented canonical sum (written out again here) of terms that a
//   plain sequential replica of the states computes, bit for bit: fusing the passes changed no value;
// - on integer data, where every sum except the AdamW ones is exact in fp64, each equals the exact
//   sum of its terms (core::long_accumulator) bit for bit;
// - on random data every value lies within the error bound of the canonical order of a long double
//   evaluation of the definitions;
// - 1, 2, 3 and 7 threads give the same bits, on sizes that are not multiples of the 4096-term
//   chunk;
// - misuse (shapes, a unit step without the reference's step) is refused.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "support/bits.hpp"
#include "documented_order.hpp"
#include "mxscope/core/exact_sum.hpp"
#include "mxscope/core/growth.hpp"
#include "mxscope/cross_step.hpp"
#include "mxscope/errors.hpp"

namespace {

using mxscope::testing::bits_of;
using mxscope::testing::hex;

using mxscope::matrix;
using mxscope::matrix64;

void set_threads(int threads) {
#ifdef _OPENMP
  omp_set_num_threads(threads);
#else
  (void)threads;
#endif
}


#define EXPECT_SAME_BITS(actual, expected)                                                           \
  EXPECT_EQ(bits_of(actual), bits_of(expected)) << #actual << ": " << hex(actual) << ", expected " \
                                                << hex(expected)

using test_order::documented_order;

// One step's inputs: G_t, X_t and Ghat_t.
struct step_inputs {
  matrix64 g;
  matrix64 exact;
  matrix estimate;
};

// Normal G times a per-step scale; X and Ghat at relative distances of about 1e-3 (so the unit's
// optimizer states stay well apart from the reference's and every difference is well conditioned).
std::vector<step_inputs> random_steps(std::int64_t rows, std::int64_t cols, int steps, std::uint64_t seed) {
  std::mt19937_64 random(seed);
  std::normal_distribution<double> normal(0.0, 1.0);
  std::vector<step_inputs> out;
  for (int s = 0; s < steps; ++s) {
    step_inputs in{matrix64(rows, cols), matrix64(rows, cols), matrix(rows, cols)};
    const double scale = std::ldexp(1.0, 3 * s - 4);
    for (std::size_t i = 0; i < in.g.values.size(); ++i) {
      in.g.values[i] = scale * normal(random);
      in.exact.values[i] = in.g.values[i] + 1e-3 * scale * normal(random);
      in.estimate.values[i] = static_cast<float>(in.exact.values[i] + 1e-3 * scale * normal(random));
    }
    out.push_back(std::move(in));
  }
  return out;
}

// Integers in [-1000, 1000]: differences, squares and (with SGD momentum 1/2) the SGD states are
// exact, and so is every partial sum of their squares and products.
std::vector<step_inputs> integer_steps(std::int64_t rows, std::int64_t cols, int steps, std::uint64_t seed) {
  std::mt19937_64 random(seed);
  std::uniform_int_distribution<int> integer(-1000, 1000);
  std::vector<step_inputs> out;
  for (int s = 0; s < steps; ++s) {
    step_inputs in{matrix64(rows, cols), matrix64(rows, cols), matrix(rows, cols)};
    for (std::size_t i = 0; i < in.g.values.size(); ++i) {
      in.g.values[i] = integer(random);
      in.exact.values[i] = integer(random);
      in.estimate.values[i] = static_cast<float>(integer(random));
    }
    out.push_back(std::move(in));
  }
  return out;
}

// The terms of every sum of one step, index by index.
template <class Real>
struct step_terms {
  // reference_step: ||G||^2, ||sum G||^2, SGD update and displacement, AdamW update and displacement.
  std::vector<Real> reference[6];
  // unit_step: ||X - G||^2, ||Ghat - X||^2, ||E||^2, <E_{t-1}, E>, ||sum E||^2, and the squared
  // distances of the unit's SGD update, SGD displacement, AdamW update and AdamW displacement from
  // the reference's.
  std::vector<Real> unit[9];
  // For the last four: |unit state| + |reference state|, the scale of the rounding errors of the
  // two states whose difference is taken.
  std::vector<Real> state_scale[4];
};

// The states of one reference and one unit, element by element in plain loops, with the update
// formulas of docs/metrics.md ("Optimizer replay") in the arithmetic replay has always used; in
// `double` it pins that arithmetic, in `long double` it is the high-precision oracle.
template <class Real>
struct replica {
  std::size_t size;
  mxscope::optimizer_settings settings;
  int t = 0;
  std::vector<Real> sum, momentum, sgd_displacement, first, second, direction, adamw_displacement;  // reference
  std::vector<Real> error_sum, previous_error, unit_momentum, unit_sgd_displacement, unit_first, unit_second,
      unit_adamw_displacement;

  replica(std::size_t count, const mxscope::optimizer_settings& s) : size(count), settings(s) {
    for (auto* v : {&sum, &momentum, &sgd_displacement, &first, &second, &direction, &adamw_displacement, &error_sum,
                    &previous_error, &unit_momentum, &unit_sgd_displacement, &unit_first, &unit_second,
                    &unit_adamw_displacement}) {
      v->assign(count, Real(0));
    }
  }

  step_terms<Real> step(const step_inputs& in) {
    ++t;
    const Real beta = settings.sgd_momentum;
    const Real beta1 = settings.adamw_beta1;
    const Real beta2 = settings.adamw_beta2;
    const Real eps = settings.adamw_eps;
    const Real correction1 = Real(1) - std::pow(beta1, static_cast<Real>(t));
    const Real correction2 = Real(1) - std::pow(beta2, static_cast<Real>(t));
    const auto adamw = [&](Real gradient, Real& m, Real& v) {
      m = beta1 * m + (Real(1) - beta1) * gradient;
      v = beta2 * v + (Real(1) - beta2) * gradient * gradient;
      const Real mean = m / correction1;
      const Real variance = v / correction2;
      return mean / (std::sqrt(variance) + eps);
    };
    step_terms<Real> terms;
    for (auto& v : terms.reference) v.resize(size);
    for (auto& v : terms.unit) v.resize(size);
    for (auto& v : terms.state_scale) v.resize(size);
    for (std::size_t i = 0; i < size; ++i) {
      const Real g = in.g.values[i];
      sum[i] = sum[i] + g;
      momentum[i] = beta * momentum[i] + g;
      sgd_displacement[i] = sgd_displacement[i] + momentum[i];
      direction[i] = adamw(g, first[i], second[i]);
      adamw_displacement[i] = adamw_displacement[i] + direction[i];
      const Real reference_values[6] = {g, sum[i], momentum[i], sgd_displacement[i], direction[i],
                                        adamw_displacement[i]};
      for (int k = 0; k < 6; ++k) terms.reference[k][i] = reference_values[k] * reference_values[k];

      const Real x = in.exact.values[i];
      const Real estimate = static_cast<Real>(static_cast<double>(in.estimate.values[i]));
      const Real error = estimate - g;
      const Real previous = previous_error[i];
      previous_error[i] = error;
      error_sum[i] = error_sum[i] + error;
      unit_momentum[i] = beta * unit_momentum[i] + estimate;
      unit_sgd_displacement[i] = unit_sgd_displacement[i] + unit_momentum[i];
      const Real unit_direction = adamw(estimate, unit_first[i], unit_second[i]);
      unit_adamw_displacement[i] = unit_adamw_displacement[i] + unit_direction;
      const Real differences[4] = {unit_momentum[i] - momentum[i], unit_sgd_displacement[i] - sgd_displacement[i],
                                   unit_direction - direction[i], unit_adamw_displacement[i] - adamw_displacement[i]};
      terms.unit[0][i] = (x - g) * (x - g);
      terms.unit[1][i] = (estimate - x) * (estimate - x);
      terms.unit[2][i] = error * error;
      terms.unit[3][i] = previous * error;
      terms.unit[4][i] = error_sum[i] * error_sum[i];
      const Real scales[4] = {std::fabs(unit_momentum[i]) + std::fabs(momentum[i]),
                              std::fabs(unit_sgd_displacement[i]) + std::fabs(sgd_displacement[i]),
                              std::fabs(unit_direction) + std::fabs(direction[i]),
                              std::fabs(unit_adamw_displacement[i]) + std::fabs(adamw_displacement[i])};
      for (int k = 0; k < 4; ++k) {
        terms.unit[5 + k][i] = differences[k] * differences[k];
        terms.state_scale[k][i] = scales[k];
      }
    }
    return terms;
  }
};

std::array<double, 6> reference_values(const mxscope::reference_step_norms& n) {
  return {n.reference, n.sum, n.sgd_update, n.sgd_displacement, n.adamw_update, n.adamw_displacement};
}

// The unit's values as sums (squares of the norms are not taken: the norms are compared as norms).
std::array<double, 9> unit_values(const mxscope::unit_step_norms& n) {
  return {n.quantization,
          n.accumulation,
          n.error_energy,
          n.lag1_dot,
          n.error_sum,
          n.sgd_update_difference,
          n.sgd_displacement_difference,
          n.adamw_update_difference,
          n.adamw_displacement_difference};
}
constexpr bool unit_is_norm[9] = {true, true, false, false, true, true, true, true, true};
const char* const reference_names[6] = {"reference", "sum", "sgd_update", "sgd_displacement", "adamw_update",
                                        "adamw_displacement"};
const char* const unit_names[9] = {"quantization",          "accumulation",
                                   "error_energy",          "lag1_dot",
                                   "error_sum",             "sgd_update_difference",
                                   "sgd_displacement_difference", "adamw_update_difference",
                                   "adamw_displacement_difference"};

struct shape {
  std::int64_t rows, cols;
};
// Sizes around the 4096-term chunk: one short chunk, one chunk and one term, 3 chunks and 9 terms,
// 9 chunks and 136 terms (an odd count of partials at two levels of the tree).
const shape shapes[] = {{1, 5}, {1, 4097}, {3, 4099}, {37, 1000}};

// ---------------------------------------------------------------------------------------------

TEST(CrossStep, EveryValueIsTheDocumentedCanonicalSumOfItsTerms) {
  set_threads(2);
  const mxscope::optimizer_settings settings;
  for (const shape s : shapes) {
    SCOPED_TRACE(std::to_string(s.rows) + " x " + std::to_string(s.cols));
    const auto steps = random_steps(s.rows, s.cols, 3, 11 + static_cast<std::uint64_t>(s.cols));
    mxscope::reference_accumulators reference;
    mxscope::unit_accumulators unit;
    replica<double> plain(static_cast<std::size_t>(s.rows * s.cols), settings);
    double previous_energy = 0.0;
    for (int t = 1; t <= 3; ++t) {
      SCOPED_TRACE("step " + std::to_string(t));
      const step_inputs& in = steps[static_cast<std::size_t>(t - 1)];
      const auto r = reference_values(mxscope::reference_step(reference, in.g, settings));
      const mxscope::unit_step_norms unit_norms =
          mxscope::unit_step(unit, reference, in.estimate, in.exact, in.g, settings);
      const auto u = unit_values(unit_norms);
      const step_terms<double> terms = plain.step(in);
      for (int k = 0; k < 6; ++k) {
        SCOPED_TRACE(reference_names[k]);
        EXPECT_SAME_BITS(r[static_cast<std::size_t>(k)], std::sqrt(documented_order(terms.reference[k])));
      }
      for (int k = 0; k < 9; ++k) {
        SCOPED_TRACE(unit_names[k]);
        if (k == 3 && t == 1) continue;  // no previous error yet: checked below
        const double sum = documented_order(terms.unit[k]);
        EXPECT_SAME_BITS(u[static_cast<std::size_t>(k)], unit_is_norm[k] ? std::sqrt(sum) : sum);
      }
      if (t == 1) {
        EXPECT_EQ(unit_norms.lag1_dot, 0.0);
      }
      EXPECT_SAME_BITS(unit_norms.previous_error_energy, previous_energy);
      previous_energy = unit_norms.error_energy;
    }
    // The states themselves, element by element.
    const auto same = [](const matrix64& m, const std::vector<double>& expected, const char* name) {
      ASSERT_EQ(m.values.size(), expected.size()) << name;
      for (std::size_t i = 0; i < expected.size(); ++i) {
        if (bits_of(m.values[i]) != bits_of(expected[i])) {
          ADD_FAILURE() << name << "[" << i << "] = " << hex(m.values[i]) << ", expected " << hex(expected[i]);
          return;
        }
      }
    };
    same(reference.sum, plain.sum, "reference sum");
    same(reference.adamw_direction, plain.direction, "reference AdamW update");
    same(reference.adamw_displacement, plain.adamw_displacement, "reference AdamW displacement");
    same(unit.error_sum, plain.error_sum, "error sum");
    same(unit.previous_error, plain.previous_error, "previous error");
    same(unit.sgd_displacement, plain.unit_sgd_displacement, "unit SGD displacement");
    same(unit.adamw_second, plain.unit_second, "unit AdamW second moment");
    same(unit.adamw_displacement, plain.unit_adamw_displacement, "unit AdamW displacement");
  }
}

TEST(CrossStep, ExactSumsOnIntegerData) {
  set_threads(2);
  mxscope::optimizer_settings settings;
  settings.sgd_momentum = 0.5;  // keeps the SGD states exact (two more fraction bits per step)
  for (const shape s : shapes) {
    SCOPED_TRACE(std::to_string(s.rows) + " x " + std::to_string(s.cols));
    const auto steps = integer_steps(s.rows, s.cols, 3, 5 + static_cast<std::uint64_t>(s.cols));
    const std::size_t count = static_cast<std::size_t>(s.rows * s.cols);
    mxscope::reference_accumulators reference;
    mxscope::unit_accumulators unit;
    // Exact states: integers and dyadic SGD states, so plain double arithmetic here is exact too.
    std::vector<double> sum(count), momentum(count), displacement(count), error_sum(count), previous(count),
        unit_momentum(count), unit_displacement(count);
    for (int t = 1; t <= 3; ++t) {
      SCOPED_TRACE("step " + std::to_string(t));
      const step_inputs& in = steps[static_cast<std::size_t>(t - 1)];
      const mxscope::reference_step_norms r = mxscope::reference_step(reference, in.g, settings);
      const mxscope::unit_step_norms u = mxscope::unit_step(unit, reference, in.estimate, in.exact, in.g, settings);
      enum { reference_norm, sum_norm, sgd_update, sgd_displacement, quantization, accumulation, energy, lag1,
             error_sum_norm, sgd_update_difference, sgd_displacement_difference, quantity_count };
      mxscope::core::long_accumulator exact[quantity_count];
      for (std::size_t i = 0; i < count; ++i) {
        const double g = in.g.values[i];
        const double x = in.exact.values[i];
        const double e = in.estimate.values[i];
        sum[i] += g;
        momentum[i] = momentum[i] / 2 + g;
        displacement[i] += momentum[i];
        const double error = e - g;
        exact[lag1].add(previous[i] * error);
        previous[i] = error;
        error_sum[i] += error;
        unit_momentum[i] = unit_momentum[i] / 2 + e;
        unit_displacement[i] += unit_momentum[i];
        exact[reference_norm].add(g * g);
        exact[sum_norm].add(sum[i] * sum[i]);
        exact[sgd_update].add(momentum[i] * momentum[i]);
        exact[sgd_displacement].add(displacement[i] * displacement[i]);
        exact[quantization].add((x - g) * (x - g));
        exact[accumulation].add((e - x) * (e - x));
        exact[energy].add(error * error);
        exact[error_sum_norm].add(error_sum[i] * error_sum[i]);
        const double update_difference = unit_momentum[i] - momentum[i];
        const double displacement_difference = unit_displacement[i] - displacement[i];
        exact[sgd_update_difference].add(update_difference * update_difference);
        exact[sgd_displacement_difference].add(displacement_difference * displacement_difference);
      }
      const auto value = [&](int k) { return exact[k].round_to_double(); };
      EXPECT_SAME_BITS(r.reference, std::sqrt(value(reference_norm)));
      EXPECT_SAME_BITS(r.sum, std::sqrt(value(sum_norm)));
      EXPECT_SAME_BITS(r.sgd_update, std::sqrt(value(sgd_update)));
      EXPECT_SAME_BITS(r.sgd_displacement, std::sqrt(value(sgd_displacement)));
      EXPECT_SAME_BITS(u.quantization, std::sqrt(value(quantization)));
      EXPECT_SAME_BITS(u.accumulation, std::sqrt(value(accumulation)));
      EXPECT_SAME_BITS(u.error_energy, value(energy));
      if (t > 1) {
        EXPECT_SAME_BITS(u.lag1_dot, value(lag1));
      }
      EXPECT_SAME_BITS(u.error_sum, std::sqrt(value(error_sum_norm)));
      EXPECT_SAME_BITS(u.sgd_update_difference, std::sqrt(value(sgd_update_difference)));
      EXPECT_SAME_BITS(u.sgd_displacement_difference, std::sqrt(value(sgd_displacement_difference)));
    }
  }
}

TEST(CrossStep, WithinTheCanonicalErrorBoundOfALongDoubleEvaluation) {
  static_assert(sizeof(long double) > sizeof(double), "the oracle needs a wider long double");
  set_threads(2);
  const mxscope::optimizer_settings settings;
  // A canonical sum of n terms with chunks of at most 4096 and a tree of depth d is within
  // (4096 + d) u sum |terms| of the exact sum of its terms (u = 2^-53, so under 5e-13 here); the
  // states carry a few roundings per step. 1e-11 sum |terms| covers both with a margin, while any
  // wrong term (a missed element, a mixed-up state) is off by far more.
  const long double tolerance = 1e-11L;
  // The distance of the unit's optimizer state from the reference's is a difference of two computed
  // states, each within a few dozen roundings (a dozen per AdamW step, three steps) of its exact
  // value, relative to its own size: their rounding errors are not small relative to the distance
  // when the two states nearly agree (AdamW's first update is about sign(g) for both), so the bound
  // of the norm adds 64 u ||(|unit state| + |reference state|)||.
  const long double state_rounding = 64.0L * std::ldexp(1.0L, -53);
  for (const shape s : shapes) {
    SCOPED_TRACE(std::to_string(s.rows) + " x " + std::to_string(s.cols));
    const auto steps = random_steps(s.rows, s.cols, 3, 23 + static_cast<std::uint64_t>(s.cols));
    mxscope::reference_accumulators reference;
    mxscope::unit_accumulators unit;
    replica<long double> oracle(static_cast<std::size_t>(s.rows * s.cols), settings);
    for (int t = 1; t <= 3; ++t) {
      SCOPED_TRACE("step " + std::to_string(t));
      const step_inputs& in = steps[static_cast<std::size_t>(t - 1)];
      const auto r = reference_values(mxscope::reference_step(reference, in.g, settings));
      const auto u = unit_values(mxscope::unit_step(unit, reference, in.estimate, in.exact, in.g, settings));
      const step_terms<long double> terms = oracle.step(in);
      const auto check = [&](double actual, const std::vector<long double>& v, bool norm, const char* name) {
        long double exact = 0.0L, magnitude = 0.0L;
        for (const long double term : v) exact += term, magnitude += std::fabs(term);
        const long double got = norm ? static_cast<long double>(actual) * actual : actual;
        EXPECT_LE(std::fabs(got - exact), tolerance * magnitude)
            << name << ": " << hex(actual) << " against " << static_cast<double>(norm ? std::sqrt(exact) : exact);
      };
      for (int k = 0; k < 6; ++k) check(r[static_cast<std::size_t>(k)], terms.reference[k], true, reference_names[k]);
      for (int k = 0; k < 5; ++k) {
        if (k == 3 && t == 1) continue;
        check(u[static_cast<std::size_t>(k)], terms.unit[k], unit_is_norm[k], unit_names[k]);
      }
      for (int k = 5; k < 9; ++k) {
        long double squares = 0.0L, scale_squares = 0.0L;
        for (std::size_t i = 0; i < terms.unit[k].size(); ++i) {
          squares += terms.unit[k][i];
          scale_squares += terms.state_scale[k - 5][i] * terms.state_scale[k - 5][i];
        }
        const long double exact = std::sqrt(squares);
        const double actual = u[static_cast<std::size_t>(k)];
        EXPECT_LE(std::fabs(actual - exact), tolerance * exact + state_rounding * std::sqrt(scale_squares))
            << unit_names[k] << ": " << hex(actual) << " against " << static_cast<double>(exact);
      }
    }
  }
}

TEST(CrossStep, SameBitsForAnyThreadCount) {
  const mxscope::optimizer_settings settings;
  for (const shape s : shapes) {
    SCOPED_TRACE(std::to_string(s.rows) + " x " + std::to_string(s.cols));
    const auto steps = random_steps(s.rows, s.cols, 3, 31 + static_cast<std::uint64_t>(s.cols));
    std::vector<std::vector<double>> first_run;  // every value of every step, then the states
    for (const int threads : {1, 2, 3, 7}) {
      SCOPED_TRACE(std::to_string(threads) + " threads");
      set_threads(threads);
      mxscope::reference_accumulators reference;
      mxscope::unit_accumulators unit;
      std::vector<std::vector<double>> run;
      for (const step_inputs& in : steps) {
        const auto r = reference_values(mxscope::reference_step(reference, in.g, settings));
        const mxscope::unit_step_norms n = mxscope::unit_step(unit, reference, in.estimate, in.exact, in.g, settings);
        const auto u = unit_values(n);
        std::vector<double> values(r.begin(), r.end());
        values.insert(values.end(), u.begin(), u.end());
        values.push_back(n.previous_error_energy);
        run.push_back(std::move(values));
      }
      for (const matrix64* m : {&reference.sum, &reference.sgd_momentum, &reference.sgd_displacement,
                                &reference.adamw_direction, &reference.adamw_displacement, &unit.error_sum,
                                &unit.previous_error, &unit.sgd_momentum, &unit.adamw_first, &unit.adamw_second,
                                &unit.adamw_displacement}) {
        run.push_back(m->values);
      }
      if (first_run.empty()) {
        first_run = std::move(run);
        continue;
      }
      ASSERT_EQ(run.size(), first_run.size());
      for (std::size_t k = 0; k < run.size(); ++k) {
        ASSERT_EQ(run[k].size(), first_run[k].size());
        for (std::size_t i = 0; i < run[k].size(); ++i) {
          if (bits_of(run[k][i]) != bits_of(first_run[k][i])) {
            ADD_FAILURE() << "item " << k << "[" << i << "]: " << hex(run[k][i]) << " with 1 thread "
                          << hex(first_run[k][i]);
            break;
          }
        }
      }
    }
  }
  set_threads(2);
}

TEST(CrossStep, RefusesMismatchedShapesAndOutOfOrderSteps) {
  const mxscope::optimizer_settings settings;
  const auto steps = random_steps(4, 6, 2, 3);
  const auto other = random_steps(6, 4, 1, 4);
  mxscope::reference_accumulators reference;
  mxscope::unit_accumulators unit;
  // The unit's step 1 needs the reference's step 1 first.
  EXPECT_THROW(mxscope::unit_step(unit, reference, steps[0].estimate, steps[0].exact, steps[0].g, settings),
               std::logic_error);
  mxscope::reference_step(reference, steps[0].g, settings);
  EXPECT_THROW(mxscope::reference_step(reference, other[0].g, settings), mxscope::input_error);
  EXPECT_EQ(reference.steps, 1);
  try {
    mxscope::unit_step(unit, reference, other[0].estimate, steps[0].exact, steps[0].g, settings);
    ADD_FAILURE() << "a [6, 4] estimate against a [4, 6] reference was accepted";
  } catch (const mxscope::input_error& error) {
    EXPECT_NE(std::string(error.what()).find("[6, 4]"), std::string::npos) << error.what();
  }
  EXPECT_EQ(unit.steps, 0);
  mxscope::unit_step(unit, reference, steps[0].estimate, steps[0].exact, steps[0].g, settings);
  // Step 2 of the unit before step 2 of the reference.
  EXPECT_THROW(mxscope::unit_step(unit, reference, steps[1].estimate, steps[1].exact, steps[1].g, settings),
               std::logic_error);
}

}  // namespace

// The window metrics of core/growth.hpp on errors whose growth is known in closed form.
TEST(Growth, AlphaIsThePowerOfAPowerLawAndNanWhereUndefined) {
  for (const double power : {0.0, 0.5, 1.0, 1.7}) {
    std::vector<double> norms;
    for (int t = 1; t <= 12; ++t) norms.push_back(3.0 * std::pow(static_cast<double>(t), power));
    EXPECT_NEAR(mxscope::core::growth_exponent(norms), power, 1e-12) << power;
  }
  const double nan = std::numeric_limits<double>::quiet_NaN();
  EXPECT_TRUE(std::isnan(mxscope::core::growth_exponent(std::vector<double>{})));
  EXPECT_TRUE(std::isnan(mxscope::core::growth_exponent(std::vector<double>{2.0})));
  EXPECT_TRUE(std::isnan(mxscope::core::growth_exponent(std::vector<double>{1.0, 0.0, 2.0})));
  EXPECT_TRUE(std::isnan(mxscope::core::growth_exponent(std::vector<double>{1.0, nan})));
  EXPECT_TRUE(std::isnan(mxscope::core::growth_exponent(std::vector<double>{1.0, std::numeric_limits<double>::infinity()})));
  // Two points: the slope through them, log(4 / 1) / log(2) = 2.
  EXPECT_DOUBLE_EQ(mxscope::core::growth_exponent(std::vector<double>{1.0, 4.0}), 2.0);
}

TEST(Growth, CoherenceAndStructuralShareOfIdenticalAndOrthogonalErrors) {
  using mxscope::core::coherence;
  using mxscope::core::structural_share;
  const double e = 0.25;  // ||E_t|| every step
  for (const int steps : {1, 4, 9}) {
    const double T = static_cast<double>(steps);
    const double energy = T * e * e;
    // The same error every step: ||sum E|| = T e.
    EXPECT_DOUBLE_EQ(coherence(T * e, energy), std::sqrt(T));
    EXPECT_DOUBLE_EQ(structural_share(T * e, T, energy), 1.0);
    // Mutually orthogonal errors: ||sum E|| = sqrt(T) e.
    EXPECT_DOUBLE_EQ(coherence(std::sqrt(T) * e, energy), 1.0);
    EXPECT_NEAR(structural_share(std::sqrt(T) * e, T, energy), 1.0 / T, 1e-15);
  }
  // No error at all: 0 (0/0 is "no error against no signal"), and an error against nothing is inf.
  EXPECT_EQ(coherence(0.0, 0.0), 0.0);
  EXPECT_EQ(structural_share(0.0, 3.0, 0.0), 0.0);
  EXPECT_EQ(mxscope::core::ratio(1.0, 0.0), std::numeric_limits<double>::infinity());
}
