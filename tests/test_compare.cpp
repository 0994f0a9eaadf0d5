// Comparison metrics against hand-computed values, the canonical reduction order against a
// re-implementation of its documented definition, and ulp statistics on crafted pairs.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "support/bits.hpp"
#include "documented_order.hpp"
#include "mxscope/compare.hpp"
#include "mxscope/errors.hpp"

namespace {

using mxscope::testing::bits_of;
using mxscope::testing::hex;

using mxscope::matrix;
using mxscope::matrix64;

matrix64 make64(std::int64_t rows, std::int64_t cols, std::vector<double> values) {
  matrix64 m(rows, cols);
  m.values = std::move(values);
  return m;
}
matrix make32(std::int64_t rows, std::int64_t cols, std::vector<float> values) {
  matrix m(rows, cols);
  m.values = std::move(values);
  return m;
}

using test_order::documented_order;

std::vector<double> wide_random(std::size_t count, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> normal(0.0, 1.0);
  std::uniform_int_distribution<int> exponent(-40, 40);
  std::vector<double> values(count);
  for (double& v : values) v = std::ldexp(normal(rng), exponent(rng));
  return values;
}

void set_threads(int threads) {
#ifdef _OPENMP
  omp_set_num_threads(threads);
#else
  (void)threads;
#endif
}

// ------------------------------------------------------------------------------------------
// Canonical sum

TEST(CanonicalSum, FollowsTheDocumentedOrderForAnyThreadCount) {
  for (const std::size_t count : {std::size_t{0}, std::size_t{1}, std::size_t{5}, std::size_t{4095}, std::size_t{4096},
                                  std::size_t{4097}, std::size_t{3 * 4096 + 17}, std::size_t{9 * 4096 + 1}}) {
    const std::vector<double> values = wide_random(count, 100 + count);
    const double expected = documented_order(values);
    for (const int threads : {1, 2}) {
      set_threads(threads);
      const double got = mxscope::canonical_sum(values);
      EXPECT_EQ(bits_of(got), bits_of(expected)) << "count " << count << ", " << threads << " threads: expected "
                                                  << hex(expected) << " got " << hex(got);
    }
  }
  set_threads(2);
}

// The data above are order-sensitive, so the test can tell the canonical order from others.
TEST(CanonicalSum, TheTestDataDistinguishOrders) {
  const std::vector<double> values = wide_random(9 * 4096 + 1, 100 + 9 * 4096 + 1);
  double sequential = 0.0;
  for (const double v : values) sequential += v;
  double backwards = 0.0;
  for (auto it = values.rbegin(); it != values.rend(); ++it) backwards += *it;
  const double canonical = documented_order(values);
  EXPECT_NE(bits_of(sequential), bits_of(canonical));
  EXPECT_NE(bits_of(backwards), bits_of(canonical));
}

TEST(CanonicalSum, EdgeCases) {
  EXPECT_EQ(bits_of(mxscope::canonical_sum(std::vector<double>{})), 0U) << "empty sum is +0";
  EXPECT_EQ(bits_of(mxscope::canonical_sum(std::vector<double>{-0.0, -0.0})), 0U) << "sums start from +0";
  EXPECT_EQ(mxscope::canonical_sum(std::vector<double>{1.0, -1.0, 0x1p-60}), 0x1p-60);
  EXPECT_EQ(mxscope::canonical_sum(std::vector<double>{0x1p-60, 1.0, -1.0}), 0.0) << "sequential within a chunk";
}

TEST(CanonicalSum, InterleavedSumsEqualSeparateSums) {
  const std::vector<double> x = wide_random(20000, 1);
  const std::vector<double> y = wide_random(20000, 2);
  const std::array<double, 2> both = mxscope::canonical_sums<2>(20000, [&](std::int64_t i) {
    return std::array<double, 2>{x[static_cast<std::size_t>(i)], y[static_cast<std::size_t>(i)]};
  });
  EXPECT_EQ(bits_of(both[0]), bits_of(documented_order(x)));
  EXPECT_EQ(bits_of(both[1]), bits_of(documented_order(y)));
}

// ------------------------------------------------------------------------------------------
// Metrics on tiny matrices, expectations computed by hand.

TEST(Compare, HandComputedTwoByTwo) {
  // G = [[1, 2], [3, 4]], Ghat = [[1, 2], [3, 5]]: E = [[0, 0], [0, 1]].
  const matrix64 g = make64(2, 2, {1, 2, 3, 4});
  const matrix hat = make32(2, 2, {1, 2, 3, 5});
  const mxscope::comparison c = mxscope::compare(hat, g);
  EXPECT_DOUBLE_EQ(c.rel_err, 1.0 / std::sqrt(30.0));                 // ||E|| = 1, ||G||^2 = 30
  EXPECT_DOUBLE_EQ(c.cosine, 34.0 / std::sqrt(39.0 * 30.0));          // <Ghat,G> = 34, ||Ghat||^2 = 39
  EXPECT_EQ(c.bias, 4.0 / 30.0);                                      // <E,G> = 4
  EXPECT_DOUBLE_EQ(c.orth_err, std::sqrt(14.0) / 30.0);               // ||E - (2/15) G||^2 = 14/30
  EXPECT_EQ(c.max_abs_err, 1.0);
  EXPECT_EQ(c.error_dot_reference, 4.0);
  EXPECT_EQ(c.estimate_dot_reference, 34.0);
  EXPECT_FALSE(c.zero_reference);
  ASSERT_EQ(c.row_error_norms.size(), 2U);
  ASSERT_EQ(c.column_error_norms.size(), 2U);
  EXPECT_EQ(c.row_error_norms[0], 0.0);
  EXPECT_EQ(c.row_error_norms[1], 1.0);
  EXPECT_EQ(c.column_error_norms[0], 0.0);
  EXPECT_EQ(c.column_error_norms[1], 1.0);
}

TEST(Compare, HandComputedTwoByThreeWithNegativeBias) {
  // G = [[2, -1, 0], [1, 3, -2]], Ghat = [[1.5, -1, 0.25], [1, 2.5, -2]]
  // E = [[-0.5, 0, 0.25], [0, -0.5, 0]]: ||E||^2 = 0.5625, ||G||^2 = 19, <E,G> = -2.5,
  // <Ghat,G> = 16.5, ||Ghat||^2 = 14.5625, ||E - bG||^2 = 0.5625 - 6.25/19 = 4.4375/19.
  const matrix64 g = make64(2, 3, {2, -1, 0, 1, 3, -2});
  const matrix hat = make32(2, 3, {1.5f, -1, 0.25f, 1, 2.5f, -2});
  const mxscope::comparison c = mxscope::compare(hat, g);
  EXPECT_DOUBLE_EQ(c.rel_err, 0.75 / std::sqrt(19.0));
  EXPECT_DOUBLE_EQ(c.cosine, 16.5 / std::sqrt(14.5625 * 19.0));
  EXPECT_EQ(c.bias, -2.5 / 19.0);
  EXPECT_LT(c.bias, 0.0) << "the estimate shrinks the reference";
  EXPECT_DOUBLE_EQ(c.orth_err, std::sqrt(4.4375) / 19.0);
  EXPECT_EQ(c.max_abs_err, 0.5);
  EXPECT_DOUBLE_EQ(c.row_error_norms[0], std::sqrt(0.3125));
  EXPECT_EQ(c.row_error_norms[1], 0.5);
  EXPECT_EQ(c.column_error_norms[0], 0.5);
  EXPECT_EQ(c.column_error_norms[1], 0.5);
  EXPECT_EQ(c.column_error_norms[2], 0.25);
}

TEST(Compare, ZeroNormRules) {
  const matrix64 zero = make64(1, 3, {0, 0, 0});
  const mxscope::comparison both_zero = mxscope::compare(make32(1, 3, {0, -0.0f, 0}), zero);
  EXPECT_TRUE(both_zero.zero_reference);
  EXPECT_EQ(both_zero.rel_err, 0.0);
  EXPECT_EQ(both_zero.orth_err, 0.0);
  EXPECT_EQ(both_zero.bias, 0.0);
  EXPECT_EQ(both_zero.cosine, 1.0);

  const mxscope::comparison zero_reference = mxscope::compare(make32(1, 3, {0, 1e-3f, 0}), zero);
  EXPECT_TRUE(zero_reference.zero_reference);
  EXPECT_EQ(zero_reference.rel_err, std::numeric_limits<double>::infinity());
  EXPECT_EQ(zero_reference.orth_err, std::numeric_limits<double>::infinity());
  EXPECT_EQ(zero_reference.bias, 0.0);
  EXPECT_EQ(zero_reference.cosine, 0.0);

  const mxscope::comparison zero_estimate = mxscope::compare(make32(1, 3, {0, 0, 0}), make64(1, 3, {3, 0, -4}));
  EXPECT_FALSE(zero_estimate.zero_reference);
  EXPECT_EQ(zero_estimate.rel_err, 1.0);
  EXPECT_EQ(zero_estimate.bias, -1.0);
  EXPECT_EQ(zero_estimate.orth_err, 0.0);
  EXPECT_EQ(zero_estimate.cosine, 0.0);
  EXPECT_EQ(zero_estimate.max_abs_err, 4.0);
}

TEST(Compare, NonFiniteEstimates) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const mxscope::comparison c = mxscope::compare(make32(1, 3, {1, nan, std::numeric_limits<float>::infinity()}),
                                                 make64(1, 3, {1, 2, 3}));
  EXPECT_TRUE(std::isnan(c.max_abs_err));
  EXPECT_EQ(c.nonfinite_estimate, 2);
  EXPECT_EQ(c.ulp.nan_pairs, 1);
  EXPECT_EQ(c.ulp.compared, 2);
}

TEST(Compare, ShapeMismatchIsAnInputError) {
  EXPECT_THROW(mxscope::compare(matrix(2, 3), matrix64(3, 2)), mxscope::input_error);
  EXPECT_THROW(mxscope::compare(matrix(2, 3), matrix64(2, 3), matrix(2, 2)), mxscope::input_error);
  EXPECT_THROW(mxscope::compare(matrix64(2, 3), matrix64(2, 4)), mxscope::input_error);
}

// The metrics of a large comparison are the documented canonical sums, for 1 and 2 threads.
TEST(Compare, LargeComparisonUsesTheCanonicalOrder) {
  const std::int64_t rows = 150;
  const std::int64_t cols = 301;  // 45150 entries: 12 chunks, rows span chunk boundaries
  std::mt19937_64 rng(9);
  std::normal_distribution<double> normal(0.0, 1.0);
  matrix64 g(rows, cols);
  matrix hat(rows, cols);
  for (std::int64_t i = 0; i < rows * cols; ++i) {
    g.values[static_cast<std::size_t>(i)] = std::ldexp(normal(rng), static_cast<int>(i % 30) - 15);
    hat.values[static_cast<std::size_t>(i)] =
        static_cast<float>(g.values[static_cast<std::size_t>(i)] * (1.0 + 0.01 * normal(rng)));
  }
  std::vector<double> e2;
  std::vector<double> g2;
  std::vector<double> h2;
  std::vector<double> eg;
  std::vector<double> hg;
  for (std::int64_t i = 0; i < rows * cols; ++i) {
    const double h = hat.values[static_cast<std::size_t>(i)];
    const double gi = g.values[static_cast<std::size_t>(i)];
    const double e = h - gi;
    e2.push_back(e * e);
    g2.push_back(gi * gi);
    h2.push_back(h * h);
    eg.push_back(e * gi);
    hg.push_back(h * gi);
  }
  const double bias = documented_order(eg) / documented_order(g2);
  std::vector<double> orthogonal;
  for (std::int64_t i = 0; i < rows * cols; ++i) {
    const double d = (static_cast<double>(hat.values[static_cast<std::size_t>(i)]) - g.values[static_cast<std::size_t>(i)]) -
                     bias * g.values[static_cast<std::size_t>(i)];
    orthogonal.push_back(d * d);
  }
  const double reference_norm = std::sqrt(documented_order(g2));
  const double expected_rel = std::sqrt(documented_order(e2)) / reference_norm;
  const double expected_cos = documented_order(hg) / (std::sqrt(documented_order(h2)) * reference_norm);
  const double expected_orth = std::sqrt(documented_order(orthogonal)) / reference_norm;
  std::vector<mxscope::comparison> runs;
  for (const int threads : {1, 2}) {
    set_threads(threads);
    runs.push_back(mxscope::compare(hat, g));
    const mxscope::comparison& c = runs.back();
    EXPECT_EQ(bits_of(c.rel_err), bits_of(expected_rel)) << threads << " threads";
    EXPECT_EQ(bits_of(c.cosine), bits_of(expected_cos)) << threads << " threads";
    EXPECT_EQ(bits_of(c.bias), bits_of(bias)) << threads << " threads";
    EXPECT_EQ(bits_of(c.orth_err), bits_of(expected_orth)) << threads << " threads";
    // Row 7 and column 11 as their own canonical sums.
    std::vector<double> row;
    for (std::int64_t c2 = 0; c2 < cols; ++c2) row.push_back(e2[static_cast<std::size_t>(7 * cols + c2)]);
    std::vector<double> column;
    for (std::int64_t r = 0; r < rows; ++r) column.push_back(e2[static_cast<std::size_t>(r * cols + 11)]);
    EXPECT_EQ(bits_of(c.row_error_norms[7]), bits_of(std::sqrt(documented_order(row))));
    EXPECT_EQ(bits_of(c.column_error_norms[11]), bits_of(std::sqrt(documented_order(column))));
  }
  EXPECT_EQ(runs[0].ulp.histogram, runs[1].ulp.histogram);
  EXPECT_EQ(bits_of(runs[0].ulp.mean), bits_of(runs[1].ulp.mean));
  EXPECT_EQ(runs[0].row_error_norms, runs[1].row_error_norms);
  EXPECT_EQ(runs[0].column_error_norms, runs[1].column_error_norms);
  set_threads(2);
}

// ------------------------------------------------------------------------------------------
// Ulp statistics

TEST(UlpDistance, CraftedPairs) {
  const float one = 1.0f;
  const float min_subnormal = std::numeric_limits<float>::denorm_min();
  const float largest = std::numeric_limits<float>::max();
  const float inf = std::numeric_limits<float>::infinity();
  struct pair_case {
    float estimate;
    float reference;
    std::uint64_t distance;
    int bucket;
  };
  const std::uint64_t one_bits = 0x3f800000U;
  const pair_case cases[] = {
      {one, one, 0, 0},
      {0.0f, -0.0f, 0, 0},
      {std::nextafter(one, 2.0f), one, 1, 1},
      {std::nextafter(one, 0.0f), one, 1, 1},
      {min_subnormal, -min_subnormal, 2, 2},
      {-min_subnormal, 0.0f, 1, 1},
      {one + 3 * 0x1p-23f, one, 3, 2},
      {one + 4 * 0x1p-23f, one, 4, 3},
      {one + 7 * 0x1p-23f, one, 7, 3},
      {one + 8 * 0x1p-23f, one, 8, 4},
      {one + 0xfffff * 0x1p-23f, one, 0xfffff, 20},
      {one + 0x100000 * 0x1p-23f, one, 0x100000, 21},
      {2.0f, one, 0x800000, 21},
      {largest, inf, 1, 1},
      {-one, one, 2 * one_bits, 21},
  };
  std::vector<float> estimates;
  std::vector<float> references;
  std::array<std::int64_t, mxscope::ulp_bucket_count> expected_histogram{};
  std::uint64_t distance_sum = 0;
  for (const pair_case& c : cases) {
    EXPECT_EQ(mxscope::ulp_distance(c.estimate, c.reference), c.distance)
        << hex(c.estimate) << " vs " << hex(c.reference);
    EXPECT_EQ(mxscope::ulp_bucket(c.distance), c.bucket) << "distance " << c.distance;
    estimates.push_back(c.estimate);
    references.push_back(c.reference);
    ++expected_histogram[static_cast<std::size_t>(c.bucket)];
    distance_sum += c.distance;
  }
  // One NaN pair on top: counted apart, not in the histogram.
  estimates.push_back(std::numeric_limits<float>::quiet_NaN());
  references.push_back(one);
  const auto count = static_cast<std::int64_t>(estimates.size());
  matrix64 reference64(1, count);
  for (std::int64_t i = 0; i < count; ++i) {
    const float r = references[static_cast<std::size_t>(i)];
    reference64.values[static_cast<std::size_t>(i)] = std::isinf(r) ? 0.0 : static_cast<double>(r);
  }
  const mxscope::comparison c =
      mxscope::compare(make32(1, count, estimates), reference64, make32(1, count, references));
  EXPECT_EQ(c.ulp.histogram, expected_histogram);
  EXPECT_EQ(c.ulp.compared, count - 1);
  EXPECT_EQ(c.ulp.nan_pairs, 1);
  EXPECT_EQ(c.ulp.max, 2 * one_bits);
  EXPECT_DOUBLE_EQ(c.ulp.mean, static_cast<double>(distance_sum) / static_cast<double>(count - 1));
}

TEST(UlpDistance, DoublePrecision) {
  EXPECT_EQ(mxscope::ulp_distance(1.0, std::nextafter(1.0, 2.0)), 1U);
  EXPECT_EQ(mxscope::ulp_distance(0.0, -0.0), 0U);
  const double tiny = std::numeric_limits<double>::denorm_min();
  EXPECT_EQ(mxscope::ulp_distance(tiny, -tiny), 2U);
  EXPECT_EQ(mxscope::ulp_distance(-1.0, 1.0), 2 * 0x3ff0000000000000ULL);
}

// Without an fp32 reference, G is rounded to fp32 (RNE) entry by entry; an fp64 estimate is rounded
// too.
TEST(Compare, DefaultFp32ReferenceIsTheRoundedReference) {
  const matrix64 g = make64(1, 2, {1.0 + 0x1p-30, 1.0 + 0x1.8p-24});  // RNE: 1.0f and 1 + 2^-23
  const mxscope::comparison c32 = mxscope::compare(make32(1, 2, {1.0f, 1.0f + 0x1p-23f}), g);
  EXPECT_EQ(c32.ulp.histogram[0], 2);
  const mxscope::comparison c64 = mxscope::compare(make64(1, 2, {1.0 - 0x1p-40, 1.0 + 0x1.7p-24}), g);
  EXPECT_EQ(c64.ulp.histogram[0], 2);
  EXPECT_EQ(c64.ulp.max, 0U);
}

}  // namespace
