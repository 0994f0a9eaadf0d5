// The exact rounding steps behind the accumulation models (include/mxscope/core/accumulate.hpp),
// against the Boost.Multiprecision fixed-point oracle of exact_oracle.hpp: scaled 128-bit integers
// rounded to fp32 / fp64, exact sums of doubles (the 127-bit window and the long-accumulator
// fallback, to nearest and toward zero), the trunc-align group step, the trunc-promote step and the
// significand split.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "exact_oracle.hpp"
#include "mxscope/core/accumulate.hpp"

namespace {

namespace core = mxscope::core;
using oracle::cpp_int;

std::string show_terms(double initial, const std::vector<double>& terms) {
  std::string text = fmt::format("initial {}", oracle::show(initial));
  for (double term : terms) text += fmt::format(", {}", oracle::show(term));
  return text;
}

cpp_int exact_sum(double initial, const std::vector<double>& terms) {
  cpp_int total = oracle::from_double(initial);
  for (double term : terms) total += oracle::from_double(term);
  return total;
}

// A random double m * 2^e with a `bits`-bit odd significand and e in [low, high].
double random_value(std::mt19937_64& random, int bits, int low, int high) {
  std::uniform_int_distribution<int> exponent(low, high);
  const std::uint64_t significand = (random() >> (64 - bits)) | 1U | (std::uint64_t{1} << (bits - 1));
  const double magnitude = std::ldexp(static_cast<double>(significand), exponent(random) - bits + 1);
  return (random() & 1U) != 0 ? -magnitude : magnitude;
}

TEST(RoundScaledInteger, MatchesTheOracleToNearestAndTowardZero) {
  std::mt19937_64 random(1);
  for (int trial = 0; trial < 20000; ++trial) {
    const int length = 1 + static_cast<int>(random() % 128);
    core::uint128 magnitude = (static_cast<core::uint128>(random()) << 64) | random();
    if (length < 128) magnitude &= (core::uint128{1} << length) - 1U;
    if (trial % 7 == 0 && length > 30) {
      // An exact tie below the fp32 precision: leading bit, then 23 random bits, then 1 and zeros.
      magnitude >>= (length - 25);
      magnitude = (magnitude << (length - 25)) | (core::uint128{1} << (length - 26));
    }
    const bool negative = (random() & 1U) != 0;
    const int exponent = static_cast<int>(random() % 2300) - 1150 - length / 2;
    cpp_int value = 0;
    for (int bit = 127; bit >= 0; --bit) value = (value << 1) | static_cast<unsigned>((magnitude >> bit) & 1U);
    if (exponent + oracle::fraction_bits < 0) continue;  // below the oracle's unit: not representable there
    value <<= (exponent + oracle::fraction_bits);
    if (negative) value = -value;
    for (const bool toward_zero : {false, true}) {
      const double got32 = core::round_scaled_integer(magnitude, negative, exponent, core::binary32, toward_zero);
      const double expected32 = oracle::round_to(value, oracle::fp32, toward_zero);
      ASSERT_TRUE(oracle::same(got32, expected32))
          << "fp32 " << (toward_zero ? "rtz" : "rne") << " of " << value.str() << " * 2^" << exponent
          << " (stored with 2^-1200 units): expected " << oracle::show(expected32) << ", got " << oracle::show(got32);
      const double got64 = core::round_scaled_integer(magnitude, negative, exponent, core::binary64, toward_zero);
      const double expected64 = oracle::round_to(value, oracle::fp64, toward_zero);
      ASSERT_TRUE(oracle::same(got64, expected64))
          << "fp64 " << (toward_zero ? "rtz" : "rne") << " of magnitude*2^" << exponent << ": expected "
          << oracle::show(expected64) << ", got " << oracle::show(got64);
    }
  }
}

struct sum_case {
  std::string name;
  int low;   // exponent range of the terms
  int high;
  int bits;  // significand bits of each term
  bool expect_window;
};

void check_sums(const sum_case& shape, int trials, std::uint64_t seed) {
  std::mt19937_64 random(seed);
  int window_hits = 0;
  for (int trial = 0; trial < trials; ++trial) {
    const int count = 1 + static_cast<int>(random() % 40);
    std::vector<double> terms;
    for (int i = 0; i < count; ++i) terms.push_back(random_value(random, shape.bits, shape.low, shape.high));
    if (trial % 5 == 0 && count > 2) terms[1] = -terms[0];  // cancellation
    if (trial % 11 == 0) terms.push_back(0.0);
    // The accumulator is an fp32 value, as in the models.
    const double initial = trial % 3 == 0 ? 0.0
                                          : static_cast<double>(static_cast<float>(random_value(
                                                random, 24, std::max(shape.low, -140), std::min(shape.high, 120))));
    const cpp_int exact = exact_sum(initial, terms);
    core::int128 window = 0;
    int exponent = 0;
    window_hits += core::window_sum(initial, terms.data(), static_cast<int>(terms.size()), window, exponent) ? 1 : 0;
    for (const bool toward_zero : {false, true}) {
      const double got32 = core::round_exact_sum(initial, terms.data(), static_cast<int>(terms.size()), core::binary32,
                                                 toward_zero);
      const double expected32 = oracle::round_to(exact, oracle::fp32, toward_zero);
      ASSERT_TRUE(oracle::same(got32, expected32))
          << shape.name << " fp32 " << (toward_zero ? "rtz" : "rne") << ": " << show_terms(initial, terms)
          << "\nexpected " << oracle::show(expected32) << ", got " << oracle::show(got32);
      const double got64 = core::round_exact_sum(initial, terms.data(), static_cast<int>(terms.size()), core::binary64,
                                                 toward_zero);
      const double expected64 = oracle::round_to(exact, oracle::fp64, toward_zero);
      ASSERT_TRUE(oracle::same(got64, expected64))
          << shape.name << " fp64 " << (toward_zero ? "rtz" : "rne") << ": " << show_terms(initial, terms)
          << "\nexpected " << oracle::show(expected64) << ", got " << oracle::show(got64);
    }
    const float added = core::add_exactly_to_float(static_cast<float>(initial), terms.data(), static_cast<int>(terms.size()));
    ASSERT_TRUE(oracle::same(added, oracle::round_to_float(exact))) << shape.name << ": " << show_terms(initial, terms);
  }
  // Both the window and the long-accumulator fallback must have been exercised where expected.
  if (shape.expect_window) {
    EXPECT_EQ(window_hits, trials) << shape.name << ": every sum should fit the 127-bit window";
  } else {
    EXPECT_LT(window_hits, trials / 2) << shape.name << ": most sums should need the fallback";
  }
}

TEST(RoundExactSum, NarrowRangeUsesTheWindow) { check_sums({"narrow", -20, 20, 48, true}, 3000, 2); }
TEST(RoundExactSum, BlockDotsOfSmallFormats) { check_sums({"small", -40, 10, 13, true}, 3000, 3); }
TEST(RoundExactSum, WideRangeFallsBackToTheLongAccumulator) { check_sums({"wide", -600, 600, 53, false}, 2000, 4); }
TEST(RoundExactSum, NearTheFp32UnderflowAndOverflow) {
  check_sums({"tiny", -170, -120, 24, true}, 1500, 5);
  check_sums({"huge", 110, 127, 24, true}, 1500, 6);
}

TEST(RoundExactSum, TiesRoundToEven) {
  // 1 + 2^-24 is the midpoint between 1 and 1 + 2^-23: to even (1). 1 + 2^-23 + 2^-24: up.
  const double tie_low[] = {std::ldexp(1.0, -24)};
  EXPECT_EQ(core::add_exactly_to_float(1.0f, tie_low, 1), 1.0f);
  const double tie_high[] = {std::ldexp(1.0, -23), std::ldexp(1.0, -24)};
  EXPECT_EQ(core::add_exactly_to_float(1.0f, tie_high, 2), 1.0f + std::ldexp(1.0f, -22));
  // A tie broken by a far-away sticky term (beyond any double sum of the two): rounds up.
  const double sticky[] = {std::ldexp(1.0, -24), std::ldexp(1.0, -200)};
  EXPECT_EQ(core::add_exactly_to_float(1.0f, sticky, 2), 1.0f + std::ldexp(1.0f, -23));
  const double sticky_below[] = {std::ldexp(1.0, -24), -std::ldexp(1.0, -200)};
  EXPECT_EQ(core::add_exactly_to_float(1.0f, sticky_below, 2), 1.0f);
  // Exact cancellation gives +0, a tiny negative rest keeps its sign.
  const double cancel[] = {-1.0};
  EXPECT_EQ(oracle::bits_of(core::add_exactly_to_float(1.0f, cancel, 1)), 0x00000000U);
  const double tiny[] = {-1.0, -std::ldexp(1.0, -200)};
  EXPECT_EQ(oracle::bits_of(core::add_exactly_to_float(1.0f, tiny, 2)), 0x80000000U);
}

// core::add_to_float (fl32(acc + v) rounded once) against the oracle: random pairs over the
// whole fp32 range and beyond, and pairs whose double sum lands exactly on an fp32 midpoint (the
// case its fast path must leave to the round-to-odd sum), near zero, the subnormal range and the
// overflow threshold.
std::vector<std::pair<float, double>> add_to_float_cases();

TEST(AddToFloat, MatchesTheOracleIncludingDoubleRoundingMidpoints) {
  int midpoints = 0;
  for (const auto& [acc, v] : add_to_float_cases()) {
    const cpp_int exact = oracle::from_double(static_cast<double>(acc)) + oracle::from_double(v);
    const float want = oracle::round_to_float(exact);
    const float got = core::add_to_float(acc, v);
    const double naive = static_cast<double>(acc) + v;
    if (std::isfinite(naive) && static_cast<float>(naive) != want) ++midpoints;
    ASSERT_EQ(oracle::bits_of(got), oracle::bits_of(want))
        << "acc " << oracle::show(static_cast<double>(acc)) << " v " << oracle::show(v);
  }
  EXPECT_GT(midpoints, 500);  // the set does hold cases that rounding twice gets wrong
}

// core::round_to_odd_from_neighbours (the GPU step's round-to-odd from a round-down and a
// round-up) on the same pairs: the neighbours come from the exact sum's place between the doubles
// (the round-to-nearest sum and nextafter on the side of its error), and the odd-neighbour choice
// converted to fp32 must give the oracle's correctly rounded sum, and equal core::round_to_odd_sum.
TEST(RoundToOddFromNeighbours, GivesTheCorrectlyRoundedFloatSum) {
  int inexact = 0;
  int zeros = 0;
  for (const auto& [acc, v] : add_to_float_cases()) {
    const double a = static_cast<double>(acc);
    const cpp_int exact = oracle::from_double(a) + oracle::from_double(v);
    const double nearest = a + v;
    if (!std::isfinite(nearest)) continue;
    const cpp_int error = exact - oracle::from_double(nearest);
    const double inf = std::numeric_limits<double>::infinity();
    double down = nearest;
    double up = nearest;
    if (error > 0) up = std::nextafter(nearest, inf);
    if (error < 0) down = std::nextafter(nearest, -inf);
    if (exact == 0 && (a != 0.0 || v != 0.0)) down = -0.0;  // the round-down of x - x
    inexact += error != 0 ? 1 : 0;
    zeros += exact == 0 ? 1 : 0;
    const double odd = core::round_to_odd_from_neighbours(down, up);
    ASSERT_EQ(oracle::bits_of(static_cast<float>(odd)), oracle::bits_of(oracle::round_to_float(exact)))
        << "acc " << oracle::show(a) << " v " << oracle::show(v);
    ASSERT_EQ(core::double_bits(odd), core::double_bits(core::round_to_odd_sum(a, v)))
        << "acc " << oracle::show(a) << " v " << oracle::show(v);
  }
  EXPECT_GT(inexact, 5000);  // both branches of the choice are taken
  EXPECT_GT(zeros, 0);
}

std::vector<std::pair<float, double>> add_to_float_cases() {
  std::mt19937_64 random(20261129);
  std::vector<std::pair<float, double>> cases;
  for (int i = 0; i < 20000; ++i) {
    const float acc = static_cast<float>(random_value(random, 24, -150, 127));
    cases.emplace_back(i % 7 == 0 ? 0.0f : acc, random_value(random, 1 + static_cast<int>(random() % 53), -160, 130));
  }
  // Midpoints: acc + v = m + tiny, with m halfway between acc and its fp32 neighbour and tiny
  // below the double sum's ulp (so fl64 gives m), on both sides and with exact ties.
  for (int i = 0; i < 4000; ++i) {
    const int e = static_cast<int>(random() % 250) - 125;  // acc in [2^e, 2^(e+1))
    const std::uint32_t significand = static_cast<std::uint32_t>(random() >> 41) | (1U << 23);  // 24 bits
    const float acc = std::ldexp(static_cast<float>(significand), e - 23);
    const double half_ulp = std::ldexp(1.0, e - 24);
    const int side = static_cast<int>(random() % 3);  // 0: just above, 1: just below, 2: exact tie
    const double tiny = side == 2 ? 0.0 : std::ldexp(side == 0 ? 1.0 : -1.0, e - 24 - 40 - static_cast<int>(random() % 20));
    const double v = (random() & 1U) != 0 ? half_ulp + tiny : -(half_ulp + tiny);
    cases.emplace_back((random() & 2U) != 0 ? acc : -acc, v);
  }
  cases.emplace_back(std::ldexp(1.0f, -126), -std::ldexp(1.0, -150));  // into the fp32 subnormals
  cases.emplace_back(std::ldexp(1.5f, -140), std::ldexp(1.0, -150));   // a subnormal tie
  cases.emplace_back(3.0e38f, 4.0e37);                                  // overflow
  cases.emplace_back(std::numeric_limits<float>::max(), std::ldexp(1.0, 103));  // the overflow tie: to inf
  cases.emplace_back(std::numeric_limits<float>::max(), std::ldexp(1.0, 103) - std::ldexp(1.0, 60));
  cases.emplace_back(1.0f, -1.0);  // exact cancellation: +0
  return cases;
}

// Trunc-align semantics written from NUMERICS.md section 7 with the oracle's integers.
float trunc_align_oracle(float accumulator, const std::vector<double>& products, int fraction_bits, bool toward_zero) {
  std::vector<cpp_int> terms{oracle::from_double(accumulator)};
  for (double product : products) terms.push_back(oracle::from_double(product));
  bool any = false;
  int leading = 0;
  for (const cpp_int& term : terms) {
    if (term == 0) continue;
    const int exponent = oracle::leading_exponent(term);
    leading = any ? std::max(leading, exponent) : exponent;
    any = true;
  }
  if (!any) return 0.0f;
  cpp_int total = 0;
  for (const cpp_int& term : terms) total += oracle::truncate_toward_zero(term, leading - fraction_bits);
  return oracle::round_to_float(total, toward_zero);
}

TEST(TruncAlignSum, MatchesTheOracle) {
  std::mt19937_64 random(7);
  for (const int fraction_bits : {0, 1, 3, 13, 14, 23, 24, 26, 60, 100, 110, 125, 200, 600}) {
    for (int trial = 0; trial < 400; ++trial) {
      const int count = 1 + static_cast<int>(random() % 64);
      const int spread = trial % 2 == 0 ? 12 : 80;
      std::vector<double> products;
      for (int i = 0; i < count; ++i) products.push_back(random_value(random, 1 + static_cast<int>(random() % 16), -spread, 4));
      if (trial % 4 == 0 && count > 1) products[1] = -products[0];
      const float accumulator =
          trial % 3 == 0 ? 0.0f : static_cast<float>(random_value(random, 24, -spread, spread / 2 + 4));
      for (const auto mode : {core::alignment_rounding::rtz, core::alignment_rounding::rne}) {
        const bool toward_zero = mode == core::alignment_rounding::rtz;
        const float got = core::trunc_align_sum(accumulator, products.data(), count, fraction_bits, mode);
        const float expected = trunc_align_oracle(accumulator, products, fraction_bits, toward_zero);
        ASSERT_TRUE(oracle::same(got, expected))
            << "trunc-align n=" << fraction_bits << (toward_zero ? " rtz" : " rne") << ": "
            << show_terms(accumulator, products) << "\nexpected " << oracle::show(expected) << ", got "
            << oracle::show(got);
      }
    }
  }
}

TEST(TruncAlignSum, HandComputedGroup) {
  // E = 0 (the product 1.0); n = 3 keeps multiples of 1/8: 0.40625 = 0.01101b -> 0.375,
  // 0.0390625 = 0.0000101b -> 0, -0.40625 -> -0.375 (toward zero). 1 + 0.375 + 0 = 1.375.
  const double products[] = {1.0, 0.40625, 0.0390625};
  EXPECT_EQ(core::trunc_align_sum(0.0f, products, 3, 3, core::alignment_rounding::rtz), 1.375f);
  const double negative[] = {1.0, -0.40625};
  EXPECT_EQ(core::trunc_align_sum(0.0f, negative, 2, 3, core::alignment_rounding::rtz), 0.625f);
  // The accumulator takes part in the alignment: E = 2 from acc = 4, n = 3 keeps multiples of 1/2:
  // 4 + 1.0 + (0.40625 -> 0) + (0.0390625 -> 0) = 5.
  EXPECT_EQ(core::trunc_align_sum(4.0f, products, 3, 3, core::alignment_rounding::rtz), 5.0f);
  // n = 30 keeps every bit here; the sum 1 + 2^-24 + 2^-25 needs rounding to fp32: rtz gives 1,
  // rne gives 1 + 2^-23.
  const double fine[] = {std::ldexp(1.0, -24), std::ldexp(1.0, -25)};
  EXPECT_EQ(core::trunc_align_sum(1.0f, fine, 2, 30, core::alignment_rounding::rtz), 1.0f);
  EXPECT_EQ(core::trunc_align_sum(1.0f, fine, 2, 30, core::alignment_rounding::rne), 1.0f + std::ldexp(1.0f, -23));
  // Nothing nonzero: +0.
  const double zeros[] = {0.0, -0.0};
  EXPECT_EQ(oracle::bits_of(core::trunc_align_sum(0.0f, zeros, 2, 5, core::alignment_rounding::rtz)), 0U);
}

// Trunc-promote step semantics written from docs/numerics.md with the oracle's integers: E is the
// largest of the accumulator's leading exponent and the products' exponent sums; every term is
// truncated toward zero to a multiple of 2^(E - n); the exact sum is truncated to w significant bits
// with fp32's exponent range.
float trunc_promote_oracle(float accumulator, const std::vector<double>& products, const std::vector<int>& exponents,
                           int fraction_bits, int step_bits) {
  bool any = accumulator != 0.0f;
  int leading = any ? oracle::leading_exponent(oracle::from_double(accumulator)) : 0;
  for (std::size_t i = 0; i < products.size(); ++i) {
    if (products[i] == 0.0) continue;
    leading = any ? std::max(leading, exponents[i]) : exponents[i];
    any = true;
  }
  if (!any) return 0.0f;
  cpp_int total = oracle::truncate_toward_zero(oracle::from_double(accumulator), leading - fraction_bits);
  for (const double product : products) {
    total += oracle::truncate_toward_zero(oracle::from_double(product), leading - fraction_bits);
  }
  return static_cast<float>(oracle::round_to(total, {step_bits, -149, 127}, true));
}

TEST(TruncPromoteStep, MatchesTheOracle) {
  std::mt19937_64 random(11);
  for (const int fraction_bits : {0, 2, 13, 14, 25, 60, 124, 200}) {
    for (const int step_bits : {1, 8, 13, 14, 24}) {
      for (int trial = 0; trial < 150; ++trial) {
        const int count = 1 + static_cast<int>(random() % 40);
        const int spread = trial % 2 == 0 ? 10 : 60;
        std::vector<double> products;
        std::vector<int> exponents;
        for (int i = 0; i < count; ++i) {
          // A product of two factors with 1..8 significant bits: its exponent sum is the sum of the
          // factors' leading exponents, one below the product's own leading exponent or equal to it.
          const double x = random_value(random, 1 + static_cast<int>(random() % 8), -spread, 4);
          const double y = random_value(random, 1 + static_cast<int>(random() % 8), -spread, 4);
          products.push_back(i % 7 == 3 ? 0.0 : x * y);
          exponents.push_back(std::ilogb(x) + std::ilogb(y));
        }
        if (trial % 4 == 0 && count > 1 && products[0] != 0.0) {
          products[1] = -products[0];
          exponents[1] = exponents[0];
        }
        const float accumulator = trial % 3 == 0 ? 0.0f
                                                 : static_cast<float>(oracle::round_to(
                                                       oracle::from_double(random_value(random, 24, -spread, spread / 2 + 4)),
                                                       {step_bits, -149, 127}, true));
        const float got = core::trunc_promote_step(accumulator, products.data(), exponents.data(), count,
                                                   fraction_bits, step_bits);
        const float expected = trunc_promote_oracle(accumulator, products, exponents, fraction_bits, step_bits);
        ASSERT_TRUE(oracle::same(got, expected))
            << "trunc-promote n=" << fraction_bits << " w=" << step_bits << ": " << show_terms(accumulator, products)
            << "\nexpected " << oracle::show(expected) << ", got " << oracle::show(got);
      }
    }
  }
}

TEST(TruncPromoteStep, HandComputedSteps) {
  // Products 1.5 * 1.5 = 2.25 (exponent sum 0) and 0.75 * 0.5 = 0.375 (sum -2): E = 0, so with n = 2
  // the terms are multiples of 1/4: 2.25 + 0.25 = 2.5 (2.25 keeps its bits above E: the product of
  // two significands reaches 2^(E+2)).
  const double products[] = {2.25, 0.375};
  const int exponents[] = {0, -2};
  EXPECT_EQ(core::trunc_promote_step(0.0f, products, exponents, 2, 2, 24), 2.5f);
  // Aligning to the product's own leading exponent (1) instead would give multiples of 1/2: 2.0.
  // Keeping w = 2 significant bits of 2.5 = 10.1b gives 2.
  EXPECT_EQ(core::trunc_promote_step(0.0f, products, exponents, 2, 2, 2), 2.0f);
  // The accumulator takes part: acc = -4 (leading exponent 2) makes the unit 2^0: -4 + 2 + 0 = -2.
  EXPECT_EQ(core::trunc_promote_step(-4.0f, products, exponents, 2, 2, 24), -2.0f);
  // Truncation is toward zero for negative terms too: -2.25 -> -2.0 at unit 1/2 (n = 1).
  const double negative[] = {-2.25};
  const int negative_exponents[] = {0};
  EXPECT_EQ(core::trunc_promote_step(0.0f, negative, negative_exponents, 1, 1, 24), -2.0f);
  // Nothing nonzero, or an exact cancellation: +0.
  const double cancel[] = {2.25, -2.25};
  const int cancel_exponents[] = {0, 0};
  EXPECT_EQ(oracle::bits_of(core::trunc_promote_step(0.0f, cancel, cancel_exponents, 2, 5, 14)), 0U);
  EXPECT_EQ(oracle::bits_of(core::trunc_promote_step(0.0f, cancel, cancel_exponents, 0, 5, 14)), 0U);
}

TEST(SplitSignificand, HalvesAreExactAndShort) {
  std::mt19937_64 random(9);
  for (int trial = 0; trial < 5000; ++trial) {
    const double value = random_value(random, 1 + static_cast<int>(random() % 53), -300, 300);
    for (const int high_bits : {24, 27}) {
      const auto split = core::split_significand(value, high_bits);
      ASSERT_EQ(oracle::from_double(split.high) + oracle::from_double(split.low), oracle::from_double(value))
          << oracle::show(value);
      if (split.high != 0.0) {
        int exponent = 0;
        const double fraction = std::frexp(std::fabs(split.high), &exponent);
        const double scaled = std::ldexp(fraction, high_bits);
        ASSERT_EQ(scaled, std::floor(scaled)) << oracle::show(value) << " high part has more than " << high_bits << " bits";
      }
    }
  }
}

}  // namespace
