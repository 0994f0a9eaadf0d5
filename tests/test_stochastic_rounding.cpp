// Stochastic rounding (NUMERICS.md section 3) and its random streams (section 4).
//
// With |x| = (I + F) * ulp, F_R = floor(F * 2^R) and r the top R bits of the element's Philox
// word, x rounds up iff F_R + r >= 2^R. Over uniform r that happens for exactly F_R of the 2^R
// values of r, so P(up) = F_R / 2^R (which is F up to the truncation) and the expected result is
// lo + P(up) * ulp: unbiased for R = 32 up to 2^-32 ulp, biased toward zero by the truncation for
// small R. The statistical checks use a fixed seed; their bounds are six binomial standard
// deviations, 6 * sqrt(p (1 - p) / N).
#include <gtest/gtest.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "mxscope/core/formats.hpp"
#include "mxscope/core/philox.hpp"
#include "mxscope/quantize.hpp"
#include "reference_formats.hpp"
#include "reference_random.hpp"

namespace {

namespace core = mxscope::core;
using core::element_kind;
using reference::show;

// The grid interval [lo, lo + ulp] around |x| in a format, read from the test's value table.
struct grid_interval {
  double lower;
  double ulp;
  double fraction;  // F = (|x| - lower) / ulp, exact (Sterbenz, and ulp is a power of two)
  std::uint32_t lower_code;
  std::uint32_t upper_code;
};

grid_interval interval_of(const reference::format_description& format, double x) {
  const auto table = reference::magnitude_table(format);
  const double magnitude = std::fabs(x);
  for (std::size_t i = 0; i + 1 < table.size(); ++i) {
    if (table[i].value <= magnitude && magnitude < table[i + 1].value) {
      const double ulp = table[i + 1].value - table[i].value;
      return {table[i].value, ulp, (magnitude - table[i].value) / ulp,
              reference::signed_code(format, std::signbit(x), table[i].code),
              reference::signed_code(format, std::signbit(x), table[i + 1].code)};
    }
  }
  throw std::logic_error("value outside the format's finite range");
}

// floor(F * 2^R): F has at most 53 significant bits, so F * 2^R is exact and so is the floor.
std::uint64_t truncated_fraction(double fraction, int random_bits) {
  return static_cast<std::uint64_t>(std::floor(std::ldexp(fraction, random_bits)));
}

struct sr_case {
  element_kind kind;
  double x;
};

// Values strictly between two grid points: normal binades, subnormals, int8, negatives.
const sr_case sr_cases[] = {
    {element_kind::fp4_e2m1, 2.7},            // [2, 3], ulp 1, F = 0.7
    {element_kind::fp4_e2m1, 5.4},            // [4, 6], ulp 2, F = 0.7
    {element_kind::fp4_e2m1, -0.3},           // subnormal [0, 0.5], ulp 0.5, F = 0.6, negative
    {element_kind::fp6_e2m3, 0.2},            // subnormal [0.125, 0.25], ulp 0.125, F = 0.6
    {element_kind::fp6_e3m2, 13.0},           // [12, 14], ulp 2, F = 0.5
    {element_kind::fp8_e4m3, 300.3},          // [288, 320], ulp 32
    {element_kind::fp8_e5m2, -3.3 * 0x1p-16}, // subnormal, ulp 2^-16
    {element_kind::int8, 0.3},                // [19/64, 20/64], ulp 1/64, F = 0.2
    {element_kind::int8, -1.0 / 256.0},       // [0, 1/64], F = 0.25, negative
};

// Exactly F_R of the 2^R draws round up: the decision depends only on the top R bits of the word.
TEST(StochasticRounding, DecisionUsesTheTopRBitsAndTheTruncatedFraction) {
  std::mt19937 generator(99);
  for (const auto& c : sr_cases) {
    const auto& format = reference::describe(c.kind);
    const auto interval = interval_of(format, c.x);
    for (const int random_bits : {1, 2, 3, 4, 8, 12, 16, 24, 31, 32}) {
      const std::uint64_t fraction_top = truncated_fraction(interval.fraction, random_bits);
      const std::uint64_t range = std::uint64_t{1} << random_bits;
      const std::string policy = fmt::format("{} input {} sr_bits {} (F = {}, F_R = {})", format.name, show(c.x),
                                             random_bits, interval.fraction, fraction_top);
      auto decide = [&](std::uint64_t draw) {
        // The R drawn bits on top, noise below them (ignored by the rule).
        const std::uint32_t noise = random_bits == 32 ? 0U : generator() >> random_bits;
        const std::uint32_t word = static_cast<std::uint32_t>(draw << (32 - random_bits)) | noise;
        const auto result = core::encode(c.kind, c.x, core::rounding_mode::sr, word, random_bits);
        if (result.code != interval.lower_code && result.code != interval.upper_code) {
          ADD_FAILURE() << policy << ": word " << fmt::format("{:#010x}", word) << " gave code "
                        << fmt::format("{:#04x}", result.code) << ", neither neighbour";
        }
        return result.code == interval.upper_code;
      };
      if (random_bits <= 12) {
        std::uint64_t ups = 0;
        for (std::uint64_t draw = 0; draw < range; ++draw) {
          const bool up = decide(draw);
          EXPECT_EQ(up, fraction_top + draw >= range) << policy << " r = " << draw;
          ups += up;
        }
        EXPECT_EQ(ups, fraction_top) << policy;
      } else {
        // The threshold: r = 2^R - F_R is the smallest draw that rounds up.
        EXPECT_FALSE(decide(0)) << policy;
        EXPECT_FALSE(decide(range - fraction_top - 1)) << policy;
        EXPECT_TRUE(decide(range - fraction_top)) << policy;
        EXPECT_TRUE(decide(range - 1)) << policy;
      }
    }
  }
}

// Round-up frequency and mean over N words of a real stream.
TEST(StochasticRounding, FrequencyAndMeanMatchTheExactProbability) {
  constexpr std::uint64_t draws = 1 << 20;
  const core::random_stream stream{0xC0FFEE0123456789ULL, 5, reference::fnv1a32("blocks.2.attn.proj") ^ reference::role_dy};
  for (const auto& c : sr_cases) {
    const auto& format = reference::describe(c.kind);
    const auto interval = interval_of(format, c.x);
    for (const int random_bits : {2, 4, 8, 32}) {
      const double p = static_cast<double>(truncated_fraction(interval.fraction, random_bits)) /
                       std::ldexp(1.0, random_bits);
      std::uint64_t ups = 0;
      double value_sum = 0.0;
      for (std::uint64_t block = 0; block < draws / 4; ++block) {
        const core::philox_block words = stream.block(block);  // the words of elements 4 * block + 0..3
        for (const std::uint32_t word : words.word) {
          const auto result = core::encode(c.kind, c.x, core::rounding_mode::sr, word, random_bits);
          ups += result.code == interval.upper_code;
          value_sum += std::fabs(core::decode(c.kind, result.code));
        }
      }
      const double frequency = static_cast<double>(ups) / draws;
      const double sigma = std::sqrt(p * (1.0 - p) / draws);
      const std::string policy =
          fmt::format("{} input {} sr_bits {}: p = {}, frequency {}", format.name, show(c.x), random_bits, p, frequency);
      EXPECT_LE(std::fabs(frequency - p), 6.0 * sigma) << policy;
      // The mean magnitude is lo + p * ulp within six standard deviations of the mean.
      const double mean = value_sum / draws;
      const double expected_mean = interval.lower + p * interval.ulp;
      EXPECT_LE(std::fabs(mean - expected_mean), 6.0 * sigma * interval.ulp + 1e-12 * interval.ulp) << policy;
      if (random_bits == 32) {
        // Unbiased: |x| itself, up to the 2^-32 ulp truncation of F.
        EXPECT_LE(std::fabs(mean - std::fabs(c.x)), 6.0 * sigma * interval.ulp + 0x1p-32 * interval.ulp) << policy;
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Through mxscope::quantize.

mxscope::quantize_options sr_options(element_kind kind, int axis, int random_bits, const core::random_stream& stream) {
  mxscope::quantize_options options;
  options.format = {mxscope::quant_scheme::mx, kind, 32};
  options.axis = axis;
  options.rounding = core::rounding_mode::sr;
  options.sr_bits = random_bits;
  options.stream = stream;
  return options;
}

// A constant tensor of 2.7 in MXFP4: amax 2.7 gives e = floor(log2 2.7) - 2 = -1, so every element
// is 5.4 = (2 + 0.7) * 2 between the fp4 values 4 (code 0x6) and 6 (code 0x7). Each element's
// decision is recomputed from the test's own Philox word for its flat row-major index.
TEST(StochasticRoundingTensor, EveryElementUsesTheWordOfItsFlatIndex) {
  const double scaled = static_cast<double>(2.7f) * 2.0;  // fp32 2.7 divided by 2^-1, exact
  const double fraction = (scaled - 4.0) / 2.0;
  for (const int axis : {0, 1}) {
    for (const int random_bits : {2, 32}) {
      const std::uint64_t seed = 0xA5A5A5A5DEADBEEFULL;
      const std::uint32_t step = 9;
      const std::uint32_t tag = reference::fnv1a32("layers.1.mlp.fc2") ^ reference::role_x;
      const mxscope::matrix input(67, 130, 2.7f);
      const auto q = mxscope::quantize(input, sr_options(element_kind::fp4_e2m1, axis, random_bits,
                                                         core::random_stream{seed, step, tag}));
      const std::uint64_t fraction_top = truncated_fraction(fraction, random_bits);
      const std::uint64_t range = std::uint64_t{1} << random_bits;
      int failures = 0;
      std::int64_t ups = 0;
      for (std::int64_t r = 0; r < input.rows; ++r) {
        for (std::int64_t c = 0; c < input.cols; ++c) {
          const std::uint32_t word = reference::stream_word(seed, step, tag, static_cast<std::uint64_t>(r * input.cols + c));
          const std::uint64_t draw = random_bits == 32 ? word : word >> (32 - random_bits);
          const std::uint32_t expected = fraction_top + draw >= range ? 0x7U : 0x6U;
          const std::uint8_t byte = q.codes[static_cast<std::size_t>(r * ((input.cols + 1) / 2) + c / 2)];
          const std::uint32_t code = c % 2 == 0 ? (byte & 0x0FU) : (byte >> 4);
          ups += code == 0x7U;
          if (code != expected && ++failures <= 10) {
            ADD_FAILURE() << "axis " << axis << " sr_bits " << random_bits << " element (" << r << ", " << c
                          << ") word " << fmt::format("{:#010x}", word) << " expected code " << expected << ", got "
                          << code;
          }
        }
      }
      EXPECT_EQ(failures, 0) << "axis " << axis << " sr_bits " << random_bits;
      EXPECT_GT(ups, 0);
      EXPECT_LT(ups, input.size());
    }
  }
}

// The same tensor, larger, statistically: frequency of 6 and mean of the dequantized values.
TEST(StochasticRoundingTensor, FrequencyAndUnbiasedMeanOverAMillionElements) {
  const mxscope::matrix input(1024, 1024, 2.7f);
  const double scaled = static_cast<double>(2.7f) * 2.0;  // exact: 5.4 in fp32, times 2^1
  const double fraction = (scaled - 4.0) / 2.0;
  for (const int random_bits : {2, 8, 32}) {
    const auto q = mxscope::quantize(input, sr_options(element_kind::fp4_e2m1, 1, random_bits,
                                                       core::random_stream{12345, 1, 0xBEEF}));
    const double p = static_cast<double>(truncated_fraction(fraction, random_bits)) / std::ldexp(1.0, random_bits);
    const double n = static_cast<double>(input.size());
    double ups = 0.0, sum = 0.0;
    for (const float v : q.dequantized.values) {
      ups += v == 3.0f;  // 6 * 2^-1
      sum += v;
    }
    const double sigma = std::sqrt(p * (1.0 - p) / n);
    EXPECT_LE(std::fabs(ups / n - p), 6.0 * sigma) << "sr_bits " << random_bits << " p " << p << " frequency " << ups / n;
    // Dequantized values are 2 or 3 (ulp 1 after the scale): mean = 2 + p.
    EXPECT_LE(std::fabs(sum / n - (2.0 + p)), 6.0 * sigma + 1e-9) << "sr_bits " << random_bits;
    if (random_bits == 32) {
      EXPECT_LE(std::fabs(sum / n - static_cast<double>(2.7f)), 6.0 * sigma + 0x1p-32) << "unbiased mean";
    }
  }
}

// bf16 stochastic rounding follows the same rule with F = the 16 dropped bits / 2^16.
TEST(StochasticRoundingTensor, Bfloat16DecisionMatchesTheRule) {
  std::mt19937 generator(5);
  for (int trial = 0; trial < 20000; ++trial) {
    const std::uint32_t bits = generator() & 0xBF7FFFFFU;  // finite (exponent field below 255)
    const float input = reference::float_from_bits(bits);
    const std::uint32_t word = generator();
    for (const int random_bits : {1, 3, 8, 16, 20, 32}) {
      const std::uint64_t dropped = bits & 0xFFFFU;
      const std::uint64_t fraction_top = truncated_fraction(std::ldexp(static_cast<double>(dropped), -16), random_bits);
      const std::uint64_t draw = random_bits == 32 ? word : word >> (32 - random_bits);
      const bool up = fraction_top + draw >= (std::uint64_t{1} << random_bits);
      const std::uint16_t expected = static_cast<std::uint16_t>((bits >> 16) + (up ? 1U : 0U));
      const std::uint16_t actual = core::float_to_bf16(input, core::rounding_mode::sr, word, random_bits);
      ASSERT_EQ(actual, expected) << "input " << show(input) << " word " << fmt::format("{:#010x}", word)
                                  << " sr_bits " << random_bits;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Seed policies, layers and roles.

std::vector<std::uint8_t> sr_codes(const mxscope::matrix& input, const core::random_stream& stream) {
  return mxscope::quantize(input, sr_options(element_kind::fp4_e2m1, 1, 32, stream)).codes;
}

core::random_stream stream_for(std::uint64_t seed, core::seed_policy policy, std::uint32_t step,
                               const std::string& layer, core::random_role role) {
  return core::random_stream{seed, core::policy_step(policy, step),
                             core::stream_tag(core::fnv1a32(layer.data(), layer.size()), role)};
}

std::size_t differing(const std::vector<std::uint8_t>& a, const std::vector<std::uint8_t>& b) {
  std::size_t count = 0;
  for (std::size_t i = 0; i < a.size(); ++i) count += a[i] != b[i];
  return count;
}

TEST(SeedPolicy, FixedRepeatsAcrossStepsPerStepDoesNot) {
  const mxscope::matrix input(64, 96, 2.7f);  // every element is a 0.7 / 0.3 coin flip
  const std::uint64_t seed = 77;
  const std::string layer = "layers.0.mlp.fc1";
  const auto fixed_3 = sr_codes(input, stream_for(seed, core::seed_policy::fixed, 3, layer, core::random_role::dy));
  const auto fixed_7 = sr_codes(input, stream_for(seed, core::seed_policy::fixed, 7, layer, core::random_role::dy));
  const auto per_step_3 = sr_codes(input, stream_for(seed, core::seed_policy::per_step, 3, layer, core::random_role::dy));
  const auto per_step_7 = sr_codes(input, stream_for(seed, core::seed_policy::per_step, 7, layer, core::random_role::dy));
  const auto per_step_3_again =
      sr_codes(input, stream_for(seed, core::seed_policy::per_step, 3, layer, core::random_role::dy));
  EXPECT_EQ(differing(fixed_3, fixed_7), 0U) << "fixed: same pattern at steps 3 and 7";
  EXPECT_EQ(differing(per_step_3, per_step_3_again), 0U) << "reproducible";
  // Independent patterns disagree on a nibble pair with probability 1 - (0.58)^2 ~ 0.66 per byte.
  EXPECT_GT(differing(per_step_3, per_step_7), per_step_3.size() / 2) << "per-step: new pattern each step";
  EXPECT_GT(differing(fixed_3, per_step_3), per_step_3.size() / 2) << "fixed uses step 0, not the true step";
  // The fixed policy is the per-step pattern of step 0.
  EXPECT_EQ(differing(fixed_3, sr_codes(input, stream_for(seed, core::seed_policy::per_step, 0, layer,
                                                            core::random_role::dy))),
            0U);
}

TEST(SeedPolicy, LayersRolesAndSeedsGiveDifferentStreams) {
  const mxscope::matrix input(64, 96, 2.7f);
  const auto base = sr_codes(input, stream_for(1, core::seed_policy::per_step, 4, "layers.0.mlp.fc1", core::random_role::dy));
  const std::vector<std::vector<std::uint8_t>> others = {
      sr_codes(input, stream_for(1, core::seed_policy::per_step, 4, "layers.1.mlp.fc1", core::random_role::dy)),
      sr_codes(input, stream_for(1, core::seed_policy::per_step, 4, "layers.0.mlp.fc1", core::random_role::x)),
      sr_codes(input, stream_for(1, core::seed_policy::per_step, 4, "layers.0.mlp.fc1", core::random_role::w)),
      sr_codes(input, stream_for(2, core::seed_policy::per_step, 4, "layers.0.mlp.fc1", core::random_role::dy)),
  };
  for (std::size_t i = 0; i < others.size(); ++i) {
    EXPECT_GT(differing(base, others[i]), base.size() / 2) << "variant " << i;
  }
  // The words themselves: the tags differ, so the first words differ.
  const auto dy = stream_for(1, core::seed_policy::per_step, 4, "layers.0.mlp.fc1", core::random_role::dy);
  const auto x = stream_for(1, core::seed_policy::per_step, 4, "layers.0.mlp.fc1", core::random_role::x);
  EXPECT_NE(dy.tag, x.tag);
  EXPECT_NE(dy.word(0), x.word(0));
}

// ---------------------------------------------------------------------------------------------
// Thread-count independence.

TEST(ThreadCount, OneAndTwoThreadsGiveIdenticalBits) {
#ifndef _OPENMP
  GTEST_SKIP() << "built without OpenMP: there is only one thread count";
#else
  std::mt19937 generator(8);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  mxscope::matrix input(257, 300);
  for (auto& v : input.values) v = std::ldexp(normal(generator), static_cast<int>(generator() % 9) - 4);
  const core::random_stream stream{42, 3, 0x1234};
  struct configuration {
    const char* name;
    mxscope::quantize_options options;
  };
  std::vector<configuration> configurations;
  for (const int axis : {0, 1}) {
    auto mx4 = sr_options(element_kind::fp4_e2m1, axis, 32, stream);
    configurations.push_back({axis == 0 ? "mxfp4 sr axis 0" : "mxfp4 sr axis 1", mx4});
    auto mx8 = sr_options(element_kind::fp8_e4m3, axis, 12, stream);
    mx8.rule = core::scale_rule::ceil;
    configurations.push_back({axis == 0 ? "mxfp8 sr axis 0" : "mxfp8 sr axis 1", mx8});
  }
  for (const bool two_dimensional : {false, true}) {
    mxscope::quantize_options nvfp4;
    nvfp4.format = {mxscope::quant_scheme::nvfp4, element_kind::fp4_e2m1, 16};
    nvfp4.rounding = core::rounding_mode::sr;
    nvfp4.stream = stream;
    nvfp4.nvfp4_2d = two_dimensional;
    configurations.push_back({two_dimensional ? "nvfp4 sr 16x16" : "nvfp4 sr 1x16", nvfp4});
  }
  mxscope::quantize_options per_tensor;
  per_tensor.format = {mxscope::quant_scheme::per_tensor, element_kind::fp8_e5m2, 0};
  per_tensor.rounding = core::rounding_mode::sr;
  per_tensor.stream = stream;
  configurations.push_back({"fp8_e5m2 per-tensor sr", per_tensor});
  mxscope::quantize_options bf16;
  bf16.format = {mxscope::quant_scheme::bf16, element_kind::fp4_e2m1, 0};
  bf16.rounding = core::rounding_mode::sr;
  bf16.stream = stream;
  configurations.push_back({"bf16 sr", bf16});

  const int original_threads = omp_get_max_threads();
  for (const auto& configuration : configurations) {
    omp_set_num_threads(1);
    const auto one = mxscope::quantize(input, configuration.options);
    omp_set_num_threads(2);
    int team = 0;
#pragma omp parallel
    {
#pragma omp single
      team = omp_get_num_threads();
    }
    EXPECT_EQ(team, 2) << "the second run must really use two threads";
    const auto two = mxscope::quantize(input, configuration.options);
    EXPECT_EQ(one.codes, two.codes) << configuration.name;
    EXPECT_EQ(one.scales, two.scales) << configuration.name;
    EXPECT_EQ(reference::bits_of(one.tensor_scale), reference::bits_of(two.tensor_scale)) << configuration.name;
    ASSERT_EQ(one.dequantized.values.size(), two.dequantized.values.size());
    for (std::size_t i = 0; i < one.dequantized.values.size(); ++i) {
      ASSERT_EQ(reference::bits_of(one.dequantized.values[i]), reference::bits_of(two.dequantized.values[i]))
          << configuration.name << " flat index " << i;
    }
    EXPECT_EQ(one.flushed, two.flushed) << configuration.name;
    EXPECT_EQ(one.saturated, two.saturated) << configuration.name;
    EXPECT_EQ(one.nonzero_inputs, two.nonzero_inputs) << configuration.name;
  }
  omp_set_num_threads(original_threads);
#endif
}

}  // namespace
