// The fast MX quantizer (quantize_fast.hpp) against the canonical scalar quantizer of quantize.cpp:
// codes, scales, the bits of every dequantized value (NaN positions included) and the four counts
// must agree exactly, on random tensors of many kinds, odd shapes and short last blocks, for every
// covered element format, rounding mode, scale rule and axis, with 1 and 2 threads, and on every
// SIMD instruction set that the library compiled in and this CPU supports. A strided sweep over
// fp32 bit patterns, placed into blocks whose amax the test controls, reaches every exponent
// distance between an element and its block's scale. A few blocks are also checked against codes
// derived by hand from the OCP tables, so the comparison does not rest on the canonical path alone.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <algorithm>
#include <cfenv>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "mxscope/errors.hpp"
#include "mxscope/quantize.hpp"
#include "mxscope/quantize_fast.hpp"

namespace {

namespace core = mxscope::core;
using core::element_kind;
using core::rounding_mode;
using core::scale_rule;
using mxscope::matrix;
using mxscope::quantize_options;
using mxscope::quantized_tensor;

std::uint32_t bits_of(float v) {
  std::uint32_t bits = 0;
  std::memcpy(&bits, &v, sizeof bits);
  return bits;
}
float float_of(std::uint32_t bits) {
  float v = 0.0f;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}

constexpr element_kind covered_elements[] = {element_kind::fp4_e2m1, element_kind::fp6_e2m3, element_kind::fp6_e3m2,
                                            element_kind::fp8_e4m3, element_kind::fp8_e5m2};
constexpr scale_rule all_rules[] = {scale_rule::floor, scale_rule::ceil, scale_rule::even};
constexpr rounding_mode all_modes[] = {rounding_mode::rne, rounding_mode::rna, rounding_mode::rtz, rounding_mode::sr};

quantize_options mx_options(element_kind element, int block, int axis, rounding_mode mode, scale_rule rule,
                            int sr_bits = 32) {
  quantize_options options;
  options.format = {mxscope::quant_scheme::mx, element, 32};
  options.block = block;
  options.axis = axis;
  options.rounding = mode;
  options.rule = rule;
  options.sr_bits = sr_bits;
  options.stream = core::random_stream{0x0123456789abcdefULL, 77U, 0xfeedU};
  return options;
}

std::string policy(const quantize_options& options) {
  return fmt::format("{} block {} axis {} rounding {} rule {} sr_bits {} target {}",
                     mxscope::format_name(options.format), options.block, options.axis,
                     mxscope::rounding_name(options.rounding), mxscope::scale_rule_name(options.rule), options.sr_bits,
                     mxscope::fast_quantize_target());
}

// The canonical result: quantize() with the fast path switched off.
quantized_tensor canonical(const matrix& input, const quantize_options& options) {
  mxscope::set_fast_quantize_enabled(false);
  quantized_tensor out = mxscope::quantize(input, options);
  mxscope::set_fast_quantize_enabled(true);
  return out;
}

struct fast_result {
  std::vector<std::uint8_t> codes;
  std::vector<std::uint8_t> scales;
  std::vector<float> dequantized;
  mxscope::quantize_counts counts;
};

// The fast path into buffers filled with garbage first, so that a byte it forgets to write shows.
fast_result fast(const matrix& input, const quantize_options& options, const quantized_tensor& shape_from,
                 bool with_dequantized) {
  fast_result result;
  result.codes.assign(shape_from.codes.size(), 0xA5);
  result.scales.assign(shape_from.scales.size(), 0x5A);
  if (with_dequantized) result.dequantized.assign(static_cast<std::size_t>(input.size()), 1234.5f);
  const mxscope::mx_destination destination{result.codes.data(), result.scales.data(),
                                            with_dequantized ? result.dequantized.data() : nullptr};
  result.counts = mxscope::quantize_mx_fast(input.data(), input.rows, input.cols, options, destination);
  return result;
}

// Compares everything; reports the first few differences with the input, its bits and the policy.
void expect_same(const matrix& input, const quantize_options& options, const quantized_tensor& expected,
                 const fast_result& actual, const std::string& context) {
  const std::string where = context + " | " + policy(options);
  EXPECT_EQ(actual.counts.nonzero_inputs, expected.nonzero_inputs) << "nonzero_inputs, " << where;
  EXPECT_EQ(actual.counts.flushed, expected.flushed) << "flushed, " << where;
  EXPECT_EQ(actual.counts.saturated, expected.saturated) << "saturated, " << where;
  EXPECT_EQ(actual.counts.nonfinite_inputs, expected.nonfinite_inputs) << "nonfinite_inputs, " << where;
  ASSERT_EQ(actual.scales.size(), expected.scales.size()) << where;
  int reported = 0;
  for (std::size_t i = 0; i < expected.scales.size() && reported < 5; ++i) {
    if (actual.scales[i] != expected.scales[i]) {
      ++reported;
      ADD_FAILURE() << "scale " << i << ": expected " << fmt::format("{:#04x}", expected.scales[i]) << ", got "
                    << fmt::format("{:#04x}", actual.scales[i]) << ", " << where;
    }
  }
  const bool packed = core::spec(options.format.element).bits == 4;
  const std::int64_t row_bytes = packed ? (input.cols + 1) / 2 : input.cols;
  for (std::int64_t r = 0; r < input.rows && reported < 10; ++r) {
    for (std::int64_t c = 0; c < input.cols && reported < 10; ++c) {
      const auto byte_at = static_cast<std::size_t>(r * row_bytes + (packed ? c / 2 : c));
      const unsigned shift = packed && c % 2 == 1 ? 4U : 0U;
      const unsigned mask = packed ? 0xFU : 0xFFU;
      const unsigned expected_code = (expected.codes[byte_at] >> shift) & mask;
      const unsigned actual_code = (actual.codes[byte_at] >> shift) & mask;
      const float v = input(r, c);
      const std::uint32_t expected_bits = bits_of(expected.dequantized(r, c));
      const bool dequantized_differs =
          !actual.dequantized.empty() &&
          bits_of(actual.dequantized[static_cast<std::size_t>(r * input.cols + c)]) != expected_bits;
      if (expected_code != actual_code || dequantized_differs) {
        ++reported;
        ADD_FAILURE() << "element [" << r << ", " << c << "] input " << fmt::format("{:.9g}", v) << " ("
                      << fmt::format("{:#010x}", bits_of(v)) << "): expected code " << fmt::format("{:#04x}", expected_code)
                      << " dequantized " << fmt::format("{:#010x}", expected_bits) << ", got code "
                      << fmt::format("{:#04x}", actual_code) << " dequantized "
                      << (actual.dequantized.empty()
                              ? std::string("(not requested)")
                              : fmt::format("{:#010x}", bits_of(actual.dequantized[static_cast<std::size_t>(
                                                            r * input.cols + c)])))
                      << ", " << where;
      }
    }
  }
  // Whole-buffer equality also covers the unused high nibble of an odd row's last byte.
  EXPECT_TRUE(actual.codes == expected.codes) << "code bytes differ, " << where;
}

// Runs `body` once per SIMD target (and restores the normal dispatch afterwards).
template <class Body>
void for_each_target(Body body) {
  std::vector<std::int64_t> targets = mxscope::fast_quantize_available_targets();
  if (targets.empty()) targets.push_back(0);  // built without Highway: the portable loops only
  for (const std::int64_t target : targets) {
    if (target != 0) mxscope::fast_quantize_force_target(target);
    SCOPED_TRACE("target " + mxscope::fast_quantize_target_name(target));
    body();
    if (target != 0) mxscope::fast_quantize_force_target(0);
    if (::testing::Test::HasFailure()) return;
  }
}

// The canonical result once, then the fast path on every target.
void check(const matrix& input, const quantize_options& options, const std::string& context,
           bool also_without_dequantized = false) {
  const quantized_tensor expected = canonical(input, options);
  for_each_target([&] {
    expect_same(input, options, expected, fast(input, options, expected, true), context);
    if (also_without_dequantized) {
      expect_same(input, options, expected, fast(input, options, expected, false), context + " (codes only)");
    }
  });
}

// ---------------------------------------------------------------------------------------------
// Tensor generators.

// Values that exercise every part of the encoder: per-row magnitudes across the fp32 range,
// heavy tails, zeros of both signs, subnormals, values near FLT_MAX, NaN and Inf.
matrix random_tensor(std::int64_t rows, std::int64_t cols, std::uint32_t seed, bool with_specials) {
  std::mt19937 generator(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::cauchy_distribution<float> cauchy(0.0f, 1.0f);
  std::uniform_int_distribution<int> kind_of(0, 99);
  std::uniform_int_distribution<int> exponent_of(-140, 120);
  std::uniform_int_distribution<std::uint32_t> mantissa_of(0, 0x7fffffU);
  matrix m(rows, cols);
  for (std::int64_t r = 0; r < rows; ++r) {
    const float row_scale = std::ldexp(1.0f, exponent_of(generator) / 4);
    for (std::int64_t c = 0; c < cols; ++c) {
      const int kind = kind_of(generator);
      float v = 0.0f;
      if (kind < 45) {
        v = normal(generator) * row_scale;
      } else if (kind < 60) {
        v = cauchy(generator) * row_scale;
      } else if (kind < 68) {
        v = (kind % 2 == 0) ? 0.0f : -0.0f;
      } else if (kind < 76) {
        v = float_of(mantissa_of(generator) | (kind % 2 == 0 ? 0x80000000U : 0U));  // subnormal
      } else if (kind < 84) {
        // Any exponent: blocks mixing binades far apart.
        v = std::ldexp(1.0f + static_cast<float>(mantissa_of(generator)) * 0x1p-23f, exponent_of(generator));
        if (kind % 2 == 0) v = -v;
      } else if (kind < 90) {
        v = float_of(0x7f7fffffU - (mantissa_of(generator) >> 3)) * (kind % 2 == 0 ? -1.0f : 1.0f);  // near FLT_MAX
      } else if (kind < 92 && with_specials) {
        const float specials[] = {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                                  -std::numeric_limits<float>::infinity(), float_of(0xffc00001U)};
        v = specials[kind % 4];
      } else {
        v = normal(generator);
      }
      m(r, c) = v;
    }
  }
  return m;
}

// Rounding ties and their fp32 neighbours: each block holds an element at the top of the format
// (so the block's scale is 2^s under the floor rule) and elements at midpoints between adjacent
// codes times 2^s, exactly and one fp32 ulp either side.
matrix tie_tensor(element_kind kind, std::int64_t rows, std::int64_t cols, int block, std::uint32_t seed) {
  std::mt19937 generator(seed);
  std::vector<float> midpoints;
  const auto max_code = core::max_finite_code(kind);
  for (std::uint32_t code = 0; code < max_code; ++code) {
    const double low = core::decode(kind, code);
    const double high = core::decode(kind, code + 1);
    midpoints.push_back(static_cast<float>((low + high) / 2.0));
  }
  std::uniform_int_distribution<std::size_t> pick(0, midpoints.size() - 1);
  std::uniform_int_distribution<int> scale_of(-135, 110);
  std::uniform_int_distribution<int> variant_of(0, 5);
  const float top = static_cast<float>(core::decode(kind, max_code));
  matrix m(rows, cols);
  for (std::int64_t r = 0; r < rows; ++r) {
    int scale = scale_of(generator);
    for (std::int64_t c = 0; c < cols; ++c) {
      if (c % block == 0) scale = scale_of(generator);
      float v = 0.0f;
      if (c % block == 0) {
        v = std::ldexp(top, scale);
      } else {
        v = std::ldexp(midpoints[pick(generator)], scale);
        switch (variant_of(generator)) {
          case 0: v = std::nextafter(v, 0.0f); break;
          case 1: v = std::nextafter(v, INFINITY); break;
          default: break;
        }
      }
      m(r, c) = (c % 3 == 1) ? -v : v;
    }
  }
  return m;
}

// ---------------------------------------------------------------------------------------------
// Hand-derived codes (OCP MX v1.0 fp4 e2m1: 0, 0.5, 1, 1.5, 2, 3, 4, 6; ties to the even code).

TEST(FastQuantizeHandChecked, Fp4BlockOfMidpointsUnderFloorRne) {
  // amax 6 * 2^3 = 48: floor(log2 48) - 2 = 3, scale 2^3 (code 130). Elements / 8:
  // 6 -> 0x7; 0.25 tie(0, 0.5) -> 0; 0.75 tie(0.5, 1) -> 1.0 (0x2); 1.25 -> 1.0 (0x2);
  // 1.75 -> 2.0 (0x4); 2.5 -> 2.0 (0x4); 3.5 -> 4.0 (0x6); 5 -> 4.0 (0x6); -7 -> -6 (0xF, saturated);
  // 0.2 -> 0 (flushed); -0.0 -> 0x8.
  const float inputs[] = {48.0f, 2.0f, 6.0f, 10.0f, 14.0f, 20.0f, 28.0f, 40.0f, -56.0f, 1.6f, -0.0f};
  const unsigned expected_codes[] = {0x7, 0x0, 0x2, 0x2, 0x4, 0x4, 0x6, 0x6, 0xF, 0x0, 0x8};
  constexpr int count = sizeof(inputs) / sizeof(inputs[0]);
  matrix m(1, count);
  for (int i = 0; i < count; ++i) m(0, i) = inputs[i];
  const auto options = mx_options(element_kind::fp4_e2m1, 32, 1, rounding_mode::rne, scale_rule::floor);
  std::vector<std::uint8_t> codes((count + 1) / 2, 0xFF);
  std::vector<std::uint8_t> scales(1, 0);
  std::vector<float> dequantized(count, 0.0f);
  const auto counts = mxscope::quantize_mx_fast(m.data(), 1, count, options,
                                                {codes.data(), scales.data(), dequantized.data()});
  EXPECT_EQ(scales[0], 130);
  for (int i = 0; i < count; ++i) {
    const unsigned code = (codes[static_cast<std::size_t>(i / 2)] >> (i % 2 == 0 ? 0 : 4)) & 0xFU;
    EXPECT_EQ(code, expected_codes[i]) << "input " << inputs[i] << " (" << fmt::format("{:#010x}", bits_of(inputs[i]))
                                       << "), policy mxfp4 block 32 floor rne";
  }
  const float expected_values[] = {48.0f, 0.0f, 8.0f, 8.0f, 16.0f, 16.0f, 32.0f, 32.0f, -48.0f, 0.0f, -0.0f};
  for (int i = 0; i < count; ++i) {
    EXPECT_EQ(bits_of(dequantized[static_cast<std::size_t>(i)]), bits_of(expected_values[i])) << "element " << i;
  }
  EXPECT_EQ(codes.back() >> 4, 0) << "the unused high nibble of an odd row stays 0";
  EXPECT_EQ(counts.nonzero_inputs, 10);
  EXPECT_EQ(counts.flushed, 2);    // 2 (0.25 * 8, tie to 0) and 1.6
  EXPECT_EQ(counts.saturated, 1);  // -56
  EXPECT_EQ(counts.nonfinite_inputs, 0);
}

TEST(FastQuantizeHandChecked, NanBlockAndZeroBlock) {
  // Block 0 holds an Inf: scale 0xFF, codes 0, all dequantized NaN. Block 1 is all zero: scale
  // 2^-127 (code 0x00), codes 0 except the sign of -0.
  matrix m(1, 8);
  const float values[] = {1.0f, INFINITY, -2.0f, 0.0f, 0.0f, -0.0f, 0.0f, 0.0f};
  for (int i = 0; i < 8; ++i) m(0, i) = values[i];
  const auto options = mx_options(element_kind::fp8_e4m3, 4, 1, rounding_mode::rne, scale_rule::floor);
  std::vector<std::uint8_t> codes(8, 0x77);
  std::vector<std::uint8_t> scales(2, 0x77);
  std::vector<float> dequantized(8, 0.0f);
  const auto counts =
      mxscope::quantize_mx_fast(m.data(), 1, 8, options, {codes.data(), scales.data(), dequantized.data()});
  EXPECT_EQ(scales[0], 0xFF);
  EXPECT_EQ(scales[1], 0x00);
  const std::uint8_t expected_codes[] = {0, 0, 0, 0, 0x00, 0x80, 0x00, 0x00};
  for (int i = 0; i < 8; ++i) EXPECT_EQ(codes[static_cast<std::size_t>(i)], expected_codes[i]) << "element " << i;
  for (int i = 0; i < 4; ++i) EXPECT_TRUE(std::isnan(dequantized[static_cast<std::size_t>(i)])) << "element " << i;
  EXPECT_EQ(bits_of(dequantized[5]), 0x80000000U);
  EXPECT_EQ(counts.nonzero_inputs, 3);
  EXPECT_EQ(counts.nonfinite_inputs, 1);
  EXPECT_EQ(counts.flushed, 0);
  EXPECT_EQ(counts.saturated, 0);
}

// ---------------------------------------------------------------------------------------------
// Against the canonical path.

// Small tensors run on one thread (a parallel region costs more than the work, and more so on a
// busy machine); LargeTensorWithOneAndTwoThreads compares 1 and 2 threads explicitly.
class one_thread_environment : public ::testing::Environment {
 public:
  void SetUp() override {
#ifdef _OPENMP
    omp_set_num_threads(1);
#endif
  }
};
[[maybe_unused]] const auto* const registered_environment =
    ::testing::AddGlobalTestEnvironment(new one_thread_environment);

struct shape {
  std::int64_t rows;
  std::int64_t cols;
};

TEST(FastQuantizeMatchesCanonical, RandomTensorsEveryFormatModeRuleAndAxis) {
  const shape shapes[] = {{4, 96}, {3, 67}, {37, 5}, {1, 1}, {2, 31}};
  const int blocks[] = {32, 16, 7, 1, 64};
  std::uint32_t seed = 1;
  for (const element_kind element : covered_elements) {
    for (const rounding_mode mode : all_modes) {
      for (const scale_rule rule : all_rules) {
        for (int axis = 0; axis < 2; ++axis) {
          for (std::size_t s = 0; s < std::size(shapes); ++s) {
            const int block = blocks[(seed + s) % std::size(blocks)];
            const matrix input = random_tensor(shapes[s].rows, shapes[s].cols, seed, true);
            check(input, mx_options(element, block, axis, mode, rule),
                  fmt::format("random [{}x{}] seed {}", shapes[s].rows, shapes[s].cols, seed), s == 0);
            ++seed;
            if (::testing::Test::HasFailure()) return;
          }
        }
      }
    }
  }
}

TEST(FastQuantizeMatchesCanonical, StochasticRoundingWithFewRandomBits) {
  std::uint32_t seed = 500;
  for (const element_kind element : covered_elements) {
    for (const int sr_bits : {1, 3, 8, 23, 24, 31}) {
      for (int axis = 0; axis < 2; ++axis) {
        const matrix input = random_tensor(6, 70, seed, true);
        check(input, mx_options(element, 32, axis, rounding_mode::sr, scale_rule::floor, sr_bits),
              fmt::format("random [6x70] seed {}", seed));
        ++seed;
        if (::testing::Test::HasFailure()) return;
      }
    }
  }
}

TEST(FastQuantizeMatchesCanonical, ExactTiesAndTheirNeighbours) {
  std::uint32_t seed = 900;
  for (const element_kind element : covered_elements) {
    for (const rounding_mode mode : all_modes) {
      for (const scale_rule rule : all_rules) {
        for (const int block : {32, 16, 5}) {
          const matrix input = tie_tensor(element, 8, 128, block, seed);
          check(input, mx_options(element, block, 1, mode, rule), fmt::format("ties seed {}", seed));
          check(mxscope::transposed(input), mx_options(element, block, 0, mode, rule),
                fmt::format("ties transposed seed {}", seed));
          ++seed;
          if (::testing::Test::HasFailure()) return;
        }
      }
    }
  }
}

TEST(FastQuantizeMatchesCanonical, LargeTensorWithOneAndTwoThreads) {
  const matrix input = random_tensor(96, 544, 4242, true);
  for (const int threads : {1, 2}) {
#ifdef _OPENMP
    omp_set_num_threads(threads);
#endif
    for (const rounding_mode mode : all_modes) {
      for (int axis = 0; axis < 2; ++axis) {
        check(input, mx_options(element_kind::fp4_e2m1, 32, axis, mode, scale_rule::floor),
              fmt::format("random [96x544] threads {}", threads), true);
        check(input, mx_options(element_kind::fp8_e4m3, 32, axis, mode, scale_rule::ceil),
              fmt::format("random [96x544] threads {}", threads));
      }
    }
  }
#ifdef _OPENMP
  omp_set_num_threads(1);
#endif
}

// fp32 bit patterns with a stride of 65599 from four start offsets (both signs, every exponent
// field, NaN and Inf patterns included: about 262k patterns) placed into blocks of 32 whose first
// element sets the amax: 2^k, 1.5 * 2^k, 1.75 * 2^k or the largest value below 2^(k+1), for k
// across the fp32 range, so the patterns meet scales far above and below their own binade.
TEST(FastQuantizeMatchesCanonical, StridedSweepOverFp32PatternsWithControlledAmax) {
  constexpr std::uint64_t stride = 65599;
  const int block = 32;
  const std::int64_t cols = 32 * 64;
  std::vector<float> values;
  std::uint32_t amax_index = 0;
  const int exponents[] = {-149, -140, -127, -126, -100, -20, -3, 0, 2, 9, 40, 100, 125, 127};
  for (const std::uint64_t offset : {0ULL, 1ULL, 32771ULL, 65598ULL}) {
    for (std::uint64_t pattern = offset; pattern < (std::uint64_t{1} << 32); pattern += stride) {
      if (values.size() % block == 0) {
        const int k = exponents[amax_index % std::size(exponents)];
        const float base = std::ldexp(1.0f, k);
        const float amax_choices[] = {base, base * 1.5f, base * 1.75f, std::nextafter(base * 2.0f, 0.0f)};
        values.push_back(amax_choices[(amax_index / std::size(exponents)) % 4]);
        ++amax_index;
      }
      values.push_back(float_of(static_cast<std::uint32_t>(pattern)));
    }
  }
  while (values.size() % cols != 0) values.push_back(0.0f);
  matrix input(static_cast<std::int64_t>(values.size()) / cols, cols);
  std::copy(values.begin(), values.end(), input.values.begin());
  for (const element_kind element : covered_elements) {
    for (const rounding_mode mode : all_modes) {
      const scale_rule rule = all_rules[static_cast<int>(mode) % 3];
      check(input, mx_options(element, block, 1, mode, rule), "strided sweep");
      if (::testing::Test::HasFailure()) return;
    }
  }
  // Along axis 0 the same blocks run down the columns.
  const matrix columns = mxscope::transposed(input);
  check(columns, mx_options(element_kind::fp4_e2m1, block, 0, rounding_mode::rne, scale_rule::floor),
        "strided sweep, transposed");
}

TEST(FastQuantizeMatchesCanonical, QuantizeDispatchesToTheFastPathWithTheSameBits) {
  const matrix input = random_tensor(16, 100, 77, true);
  for (const element_kind element : covered_elements) {
    const auto options = mx_options(element, 32, 1, rounding_mode::rne, scale_rule::floor);
    ASSERT_TRUE(mxscope::fast_quantize_covers(options)) << policy(options);
    const quantized_tensor expected = canonical(input, options);
    const quantized_tensor dispatched = mxscope::quantize(input, options);
    EXPECT_TRUE(dispatched.codes == expected.codes) << policy(options);
    EXPECT_TRUE(dispatched.scales == expected.scales) << policy(options);
    EXPECT_EQ(std::memcmp(dispatched.dequantized.data(), expected.dequantized.data(),
                          sizeof(float) * static_cast<std::size_t>(input.size())),
              0)
        << policy(options);
    EXPECT_EQ(dispatched.flushed, expected.flushed);
    EXPECT_EQ(dispatched.saturated, expected.saturated);
    EXPECT_EQ(dispatched.nonzero_inputs, expected.nonzero_inputs);
    EXPECT_EQ(dispatched.nonfinite_inputs, expected.nonfinite_inputs);
  }
  auto int8 = mx_options(element_kind::int8, 32, 1, rounding_mode::rne, scale_rule::floor);
  EXPECT_FALSE(mxscope::fast_quantize_covers(int8)) << "MXINT8 stays on the canonical path";
}

TEST(FastQuantizeMatchesCanonical, FusedRotationEqualsRotateThenQuantize) {
  for_each_target([&] {
    std::uint32_t seed = 3000;
    for (const int size : {16, 2, 4, 8, 32, 64}) {
      for (const auto signs : {mxscope::sign_policy::none, mxscope::sign_policy::per_step}) {
        for (const element_kind element : {element_kind::fp4_e2m1, element_kind::fp8_e5m2}) {
          for (const rounding_mode mode : {rounding_mode::rne, rounding_mode::sr}) {
            ++seed;
            const matrix input = random_tensor(5, 192, seed, seed % 3 == 0);
            mxscope::rotation_options rotation;
            rotation.size = size;
            rotation.signs = signs;
            rotation.seed = 99;
            rotation.step = 3;
            rotation.layer_hash = 0xabcdU;
            const auto options = mx_options(element, seed % 2 == 0 ? 32 : 48, 1, mode, scale_rule::floor);
            matrix rotated = input;
            mxscope::rotate(rotated, 1, rotation, "test");
            const quantized_tensor expected = canonical(rotated, options);
            fast_result actual;
            actual.codes.assign(expected.codes.size(), 0xA5);
            actual.scales.assign(expected.scales.size(), 0x5A);
            actual.dequantized.assign(static_cast<std::size_t>(input.size()), 0.0f);
            actual.counts = mxscope::quantize_mx_rotated_fast(
                input.data(), input.rows, input.cols, options, rotation,
                {actual.codes.data(), actual.scales.data(), actual.dequantized.data()});
            // Report against the rotated values, which are what the quantizer saw.
            expect_same(rotated, options, expected, actual,
                        fmt::format("rotation {} signs {} seed {}", size, mxscope::sign_policy_name(signs), seed));
            if (::testing::Test::HasFailure()) return;
          }
        }
      }
    }
  });
}

// The vector kernels round through the fp32 to int32 conversion, which follows the FPU rounding
// mode; the fast path sets round-to-nearest-even for itself, so the caller's mode must not matter.
// (The data stays clear of fp32 overflow, where the canonical path's own double to float
// conversion depends on the mode.)
TEST(FastQuantizeMatchesCanonical, CallersFpuRoundingModeDoesNotMatter) {
  std::uint32_t seed = 7000;
  for (const int mode : {FE_UPWARD, FE_DOWNWARD, FE_TOWARDZERO}) {
    ASSERT_EQ(std::fesetround(mode), 0);
    for (const element_kind element : {element_kind::fp4_e2m1, element_kind::fp8_e4m3}) {
      for (const rounding_mode rounding : {rounding_mode::rne, rounding_mode::rna, rounding_mode::rtz}) {
        const matrix input = tie_tensor(element, 8, 128, 32, seed);
        check(input, mx_options(element, 32, 1, rounding, scale_rule::floor),
              fmt::format("ties seed {} under FPU rounding mode {}", seed, mode));
        ++seed;
      }
    }
    EXPECT_EQ(std::fegetround(), mode) << "the caller's rounding mode is restored";
    std::fesetround(FE_TONEAREST);
    if (::testing::Test::HasFailure()) return;
  }
}

TEST(FastQuantizeOptions, UncoveredAndInvalidOptionsAreRejected) {
  const matrix input(2, 8, 1.0f);
  std::vector<std::uint8_t> codes(16), scales(2);
  const mxscope::mx_destination destination{codes.data(), scales.data(), nullptr};
  auto int8 = mx_options(element_kind::int8, 32, 1, rounding_mode::rne, scale_rule::floor);
  EXPECT_THROW(mxscope::quantize_mx_fast(input.data(), 2, 8, int8, destination), mxscope::input_error);
  auto bad_axis = mx_options(element_kind::fp4_e2m1, 32, 2, rounding_mode::rne, scale_rule::floor);
  EXPECT_THROW(mxscope::quantize_mx_fast(input.data(), 2, 8, bad_axis, destination), mxscope::input_error);
  auto fp4 = mx_options(element_kind::fp4_e2m1, 4, 1, rounding_mode::rne, scale_rule::floor);
  mxscope::rotation_options rotation;
  rotation.size = 3;
  EXPECT_THROW(mxscope::quantize_mx_rotated_fast(input.data(), 2, 8, fp4, rotation, destination), mxscope::input_error);
  rotation.size = 16;  // does not divide 8
  EXPECT_THROW(mxscope::quantize_mx_rotated_fast(input.data(), 2, 8, fp4, rotation, destination), mxscope::input_error);
}

}  // namespace
