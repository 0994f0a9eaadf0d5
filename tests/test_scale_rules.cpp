// Shared-exponent rules and tensor quantizers (NUMERICS.md section 2): hand-derived exponents for
// floor / ceil / even on chosen amax values, the special blocks (zero, NaN, Inf, subnormal, e8m0
// clamps), and whole tensors from mxscope::quantize compared element by element with an
// independent re-implementation in the test (MX of every element format, NVFP4 after
// TransformerEngine's fp32 recipe, per-tensor fp8).
#include <gtest/gtest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "mxscope/core/mx.hpp"
#include "mxscope/quantize.hpp"
#include "reference_formats.hpp"

namespace {

namespace core = mxscope::core;
using core::element_kind;
using core::scale_rule;
using reference::format_description;
using reference::show;

const char* rule_label(scale_rule rule) {
  switch (rule) {
    case scale_rule::floor: return "floor";
    case scale_rule::ceil: return "ceil";
    case scale_rule::even: return "even";
  }
  return "?";
}

// ---------------------------------------------------------------------------------------------
// shared_exponent on hand-made amax values.

struct exponent_case {
  float amax;
  int floor_rule;
  int ceil_rule;
  int even_rule;
  const char* derivation;
};

const float float_max = FLT_MAX;                     // (2 - 2^-23) * 2^127
const float largest_subnormal = 0x1.fffffcp-127f;    // 2^-126 - 2^-149
float above(float x) { return std::nextafter(x, INFINITY); }
float below(float x) { return std::nextafter(x, 0.0f); }

// Rules (NUMERICS.md section 2), with E = emax_elem, M = max normal, m = mantissa bits:
//   floor: e = floor(log2 amax) - E;  ceil: smallest e with amax / 2^e <= M;
//   even: round amax to 1 + m significant bits (RNE), then floor. Then clamp to [-127, 127].
// Cases shared by every format: exact powers of two give floor(log2 amax) - E under every rule
// (2^E <= M, and 2^(E+1) > M so one step lower does not fit), and the fp32 extremes clamp.
std::vector<exponent_case> cases_for(element_kind kind) {
  switch (kind) {
    case element_kind::fp4_e2m1:  // E = 2, M = 6 = 1.1b * 2^2, m = 1
      return {
          {1.0f, -2, -2, -2, "2^0: 0 - 2; 1 / 2^-2 = 4 <= 6 but 8 > 6"},
          {4.0f, 0, 0, 0, "2^2"},
          {6.0f, 0, 0, 0, "M itself: 1.1b * 2^2 is exact at m = 1"},
          {above(6.0f), 0, 1, 0, "just above M: floor clips, ceil moves up, even rounds back to 6"},
          {5.0f, 0, 0, 0, "1.01b * 2^2: the even tie goes down to 1.0b"},
          {7.0f, 0, 1, 1, "1.11b * 2^2: the even tie goes up to 10.0b = 8"},
          {below(8.0f), 0, 1, 1, "just below 8: 7.99.. > 6; even rounds to 8"},
          {8.0f, 1, 1, 1, "2^3"},
          {above(8.0f), 1, 1, 1, "just above 2^3: 8.0000005 / 2 = 4.0000002 <= 6"},
          {below(4.0f), -1, 0, 0, "3.9999998: floor log2 = 1; / 2^-1 = 7.99 > 6 so ceil 0; even -> 4"},
          {0x1p-125f, -127, -127, -127, "-125 - 2 = -127 exactly, no clamp"},
          {0x1p-126f, -127, -127, -127, "-126 - 2 = -128, clamped"},
          {float_max, 125, 126, 126, "127 - 2; (2 - 2^-23) * 4 > 6; even rounds to 2^128"},
          {0x1p127f, 125, 125, 125, "2^127"},
      };
    case element_kind::fp6_e2m3:  // E = 2, M = 7.5 = 1.111b * 2^2, m = 3
      return {
          {1.0f, -2, -2, -2, "2^0: 4 <= 7.5, 8 > 7.5"},
          {7.5f, 0, 0, 0, "M: exact at m = 3"},
          {above(7.5f), 0, 1, 0, "just above M: even rounds back to 7.5"},
          {7.75f, 0, 1, 1, "1.1111b * 2^2: tie, 1.111b is odd, up to 8"},
          {7.6f, 0, 1, 0, "7.6 / 4 = 1.9 < 1.9375 (midpoint of 1.875 and 2): even rounds to 7.5"},
          {below(8.0f), 0, 1, 1, "rounds to 8"},
          {8.0f, 1, 1, 1, "2^3"},
          {float_max, 125, 126, 126, "127 - 2; (2 - 2^-23) * 4 > 7.5; even -> 2^128"},
          {0x1p-130f, -127, -127, -127, "-132 clamped"},
      };
    case element_kind::fp6_e3m2:  // E = 4, M = 28 = 1.11b * 2^4, m = 2
      return {
          {1.0f, -4, -4, -4, "2^0: 16 <= 28, 32 > 28"},
          {16.0f, 0, 0, 0, "2^4"},
          {28.0f, 0, 0, 0, "M: exact at m = 2"},
          {above(28.0f), 0, 1, 0, "just above M: even rounds back to 28"},
          {30.0f, 0, 1, 1, "1.111b * 2^4: tie, 1.11b is odd, up to 32"},
          {29.0f, 0, 1, 0, "29 / 16 = 1.8125 < 1.875: even rounds to 28"},
          {32.0f, 1, 1, 1, "2^5"},
          {float_max, 123, 124, 124, "127 - 4; (2 - 2^-23) * 16 > 28; even -> 2^128"},
          {0x1p-123f, -127, -127, -127, "-123 - 4 = -127 exactly"},
      };
    case element_kind::fp8_e4m3:  // E = 8, M = 448 = 1.11b * 2^8, m = 3
      return {
          {1.0f, -8, -8, -8, "2^0: 256 <= 448, 512 > 448"},
          {448.0f, 0, 0, 0, "M: 1.110b * 2^8 exact"},
          {above(448.0f), 0, 1, 0, "just above M: even rounds back to 448"},
          {464.0f, 0, 1, 0, "1.1101b * 2^8: tie, 1.110b is even, down to 448"},
          {480.0f, 0, 1, 0, "1.111b * 2^8 is exact at m = 3 (the element itself saturates)"},
          {496.0f, 0, 1, 1, "1.1111b * 2^8: tie, 1.111b is odd, up to 512"},
          {below(512.0f), 0, 1, 1, "rounds to 512"},
          {512.0f, 1, 1, 1, "2^9"},
          {0x1p-120f, -127, -127, -127, "-120 - 8 = -128, clamped"},
          {0x1p-119f, -127, -127, -127, "-119 - 8 = -127 exactly"},
          {float_max, 119, 120, 120, "127 - 8; (2 - 2^-23) * 256 > 448; even -> 2^128"},
      };
    case element_kind::fp8_e5m2:  // E = 15, M = 57344 = 1.11b * 2^15, m = 2
      return {
          {1.0f, -15, -15, -15, "2^0: 32768 <= 57344, 65536 > 57344"},
          {57344.0f, 0, 0, 0, "M: exact at m = 2"},
          {above(57344.0f), 0, 1, 0, "just above M: even rounds back"},
          {61440.0f, 0, 1, 1, "1.111b * 2^15: tie, 1.11b is odd, up to 2^16"},
          {59392.0f, 0, 1, 0, "1.1101b * 2^15 = 1.8125 * 2^15 < 1.875 * 2^15: even rounds to M"},
          {65536.0f, 1, 1, 1, "2^16"},
          {0x1p-112f, -127, -127, -127, "-112 - 15 = -127 exactly"},
          {0x1p-113f, -127, -127, -127, "-128 clamped"},
          {float_max, 112, 113, 113, "127 - 15; (2 - 2^-23) * 2^15 > 57344; even -> 2^128"},
      };
    case element_kind::int8:  // E = 0, M = 127/64 = 1.111111b, 6 bits below the leading one
      return {
          {1.0f, 0, 0, 0, "2^0: 1 <= 127/64, 2 > 127/64"},
          {0.75f, -1, -1, -1, "1.1b * 2^-1: 1.5 <= 1.98, 3 > 1.98; exact at 6 bits"},
          {127.0f / 64.0f, 0, 0, 0, "M: exact at 6 bits"},
          {above(127.0f / 64.0f), 0, 1, 0, "just above M: even rounds back to 127/64"},
          {255.0f / 128.0f, 0, 1, 1, "1.1111111b: tie, 1.111111b is odd, up to 2"},
          {2.0f, 1, 1, 1, "2^1"},
          {0x1p127f, 127, 127, 127, "2^127: the largest exponent, no clamp"},
          {0x1.8p127f, 127, 127, 127, "1.5 * 2^127: 1.5 <= 127/64"},
          {float_max, 127, 127, 127, "floor 127; ceil would be 128, even 128 (2^128): both clamp to 127"},
          {largest_subnormal, -127, -126, -126,
           "floor log2 = -127; ceil: * 2^127 = 2 - 2^-22 > 127/64 so -126; even rounds to 2^-126"},
          {0x1p-127f, -127, -127, -127, "2^-127 exactly"},
      };
    default: return {};
  }
}

TEST(SharedExponent, HandDerivedCasesForEveryElementFormat) {
  for (const auto& format : reference::element_formats()) {
    auto cases = cases_for(format.kind);
    // Shared by every format: zero, fp32 subnormal amax (all below 2^-127 * 2^E: clamp to -127) and
    // the largest subnormal (floor log2 = -127, clamps for every E > 0; int8 lists it above).
    cases.push_back({0.0f, -127, -127, -127, "all-zero block"});
    cases.push_back({0x1p-149f, -127, -127, -127, "smallest fp32 subnormal"});
    cases.push_back({0x1p-130f, -127, -127, -127, "fp32 subnormal 2^-130"});
    if (format.kind != element_kind::int8) {
      cases.push_back({largest_subnormal, -127, -127, -127, "largest subnormal: -127 - E, -126 - E, clamped"});
    }
    for (const auto& c : cases) {
      const int expected[3] = {c.floor_rule, c.ceil_rule, c.even_rule};
      const scale_rule rules[3] = {scale_rule::floor, scale_rule::ceil, scale_rule::even};
      for (int r = 0; r < 3; ++r) {
        EXPECT_EQ(core::shared_exponent(format.kind, rules[r], c.amax), expected[r])
            << format.name << " rule " << rule_label(rules[r]) << " amax " << show(c.amax) << " (" << c.derivation
            << ")";
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Independent re-implementations used for whole tensors.

// NUMERICS.md section 2 again, written with frexp / ldexp / nearbyint instead of bit reading.
// "Mantissa width" of MXINT8: its values k/64, |k| <= 127, reach 1.111111b, 6 bits below the
// leading one.
int oracle_shared_exponent(const format_description& format, scale_rule rule, float amax) {
  if (amax == 0.0f) return -127;
  const double magnitude = amax;
  int binade = 0;
  const double fraction = std::frexp(magnitude, &binade);  // magnitude = fraction * 2^binade, fraction in [0.5, 1)
  const int floor_log2 = binade - 1;
  const int mantissa_width = format.layout == reference::code_layout::twos_complement ? 6 : format.mantissa_bits;
  int exponent = 0;
  switch (rule) {
    case scale_rule::floor: exponent = floor_log2 - format.emax_elem; break;
    case scale_rule::ceil:
      exponent = floor_log2 - format.emax_elem - 1;  // always too small: amax / 2^e >= 2^(E+1) > M
      while (std::ldexp(magnitude, -exponent) > format.max_normal) ++exponent;
      break;
    case scale_rule::even: {
      const double significand = std::nearbyint(std::ldexp(fraction, mantissa_width + 1));  // RNE (default mode)
      int rounded_binade = 0;
      std::frexp(std::ldexp(significand, binade - mantissa_width - 1), &rounded_binade);
      exponent = rounded_binade - 1 - format.emax_elem;
      break;
    }
  }
  return std::clamp(exponent, -127, 127);
}

reference::rounding reference_mode(core::rounding_mode mode) {
  switch (mode) {
    case core::rounding_mode::rna: return reference::rounding::rna;
    case core::rounding_mode::rtz: return reference::rounding::rtz;
    default: return reference::rounding::rne;
  }
}

// Element code at (row, col) from the storage layout: 4-bit codes two per byte within each row,
// element 2i in the low nibble; wider codes one per byte.
std::uint32_t stored_code(const mxscope::quantized_tensor& q, const format_description& format, std::int64_t row,
                          std::int64_t col) {
  if (format.bits == 4) {
    const std::int64_t row_bytes = (q.cols + 1) / 2;
    const std::uint8_t byte = q.codes.at(static_cast<std::size_t>(row * row_bytes + col / 2));
    return col % 2 == 0 ? (byte & 0x0FU) : (byte >> 4);
  }
  return q.codes.at(static_cast<std::size_t>(row * q.cols + col));
}

// Values of widely varying size with many exact grid ties (small integers times powers of two),
// zeros, negative zeros and fp32 subnormals.
mxscope::matrix varied_matrix(std::int64_t rows, std::int64_t cols, std::uint32_t seed) {
  std::mt19937 generator(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> kind_of_value(0, 9);
  std::uniform_int_distribution<int> small_integer(-24, 24);
  std::uniform_int_distribution<int> exponent(-12, 12);
  mxscope::matrix m(rows, cols);
  for (auto& v : m.values) {
    switch (kind_of_value(generator)) {
      case 0: v = 0.0f; break;
      case 1: v = std::ldexp(static_cast<float>(small_integer(generator)), exponent(generator)); break;
      case 2: v = static_cast<float>(small_integer(generator)) * 0.125f; break;
      case 3: v = std::ldexp(normal(generator), -140); break;  // fp32 subnormal
      case 4: v = -0.0f; break;
      default: v = std::ldexp(normal(generator), exponent(generator)); break;
    }
  }
  return m;
}

mxscope::quantize_options mx_options(element_kind kind, int block, int axis, core::rounding_mode mode,
                                     scale_rule rule) {
  mxscope::quantize_options options;
  options.format = {mxscope::quant_scheme::mx, kind, 32};
  options.block = block;
  options.axis = axis;
  options.rounding = mode;
  options.rule = rule;
  return options;
}

// Compares one MX quantization of `input` with the test's own block-by-block computation.
void expect_mx_matches_oracle(const mxscope::matrix& input, const format_description& format, int block, int axis,
                              core::rounding_mode mode, scale_rule rule) {
  const auto q = mxscope::quantize(input, mx_options(format.kind, block, axis, mode, rule));
  const std::string policy = fmt::format("{} block {} axis {} rounding {} rule {}", format.name, block, axis,
                                         reference::rounding_label(reference_mode(mode)), rule_label(rule));
  const auto table = reference::magnitude_table(format);
  const std::int64_t length = axis == 1 ? input.cols : input.rows;
  const std::int64_t lines = axis == 1 ? input.rows : input.cols;
  const std::int64_t blocks = (length + block - 1) / block;
  ASSERT_EQ(q.scale_rows, axis == 1 ? input.rows : blocks) << policy;
  ASSERT_EQ(q.scale_cols, axis == 1 ? blocks : input.cols) << policy;
  ASSERT_EQ(q.scales.size(), static_cast<std::size_t>(q.scale_rows * q.scale_cols)) << policy;
  const std::int64_t row_bytes = format.bits == 4 ? (input.cols + 1) / 2 : input.cols;
  ASSERT_EQ(q.codes.size(), static_cast<std::size_t>(input.rows * row_bytes)) << policy;
  std::int64_t expected_flushed = 0, expected_saturated = 0, expected_nonzero = 0;
  int failures = 0;
  for (std::int64_t line = 0; line < lines; ++line) {
    for (std::int64_t b = 0; b < blocks; ++b) {
      const std::int64_t begin = b * block;
      const std::int64_t end = std::min(length, begin + block);
      auto at = [&](std::int64_t position) {
        return axis == 1 ? std::pair{line, position} : std::pair{position, line};
      };
      float amax = 0.0f;
      for (std::int64_t p = begin; p < end; ++p) {
        const auto [r, c] = at(p);
        amax = std::max(amax, std::fabs(input(r, c)));
      }
      const int exponent = oracle_shared_exponent(format, rule, amax);
      const std::uint8_t scale = axis == 1 ? q.scales[static_cast<std::size_t>(line * blocks + b)]
                                           : q.scales[static_cast<std::size_t>(b * lines + line)];
      if (scale != exponent + 127 && ++failures <= 10) {
        ADD_FAILURE() << policy << ": line " << line << " block " << b << " amax " << show(amax)
                      << " expected scale code " << exponent + 127 << ", got " << int{scale};
      }
      const double divisor = std::ldexp(1.0, exponent);
      for (std::int64_t p = begin; p < end; ++p) {
        const auto [r, c] = at(p);
        const float v = input(r, c);
        const auto expected = reference::round_to_table(format, table, v, reference_mode(mode), divisor);
        const std::uint32_t code = stored_code(q, format, r, c);
        const float expected_value = static_cast<float>(reference::decode(format, expected.code) * divisor);
        expected_nonzero += v != 0.0f;
        expected_flushed += expected.flushed;
        expected_saturated += expected.saturated;
        if ((code != expected.code || !reference::same_value(q.dequantized(r, c), expected_value)) &&
            ++failures <= 10) {
          ADD_FAILURE() << policy << ": element (" << r << ", " << c << ") input " << show(v) << " scale 2^"
                        << exponent << " expected code " << fmt::format("{:#04x}", expected.code) << " value "
                        << show(expected_value) << ", got code " << fmt::format("{:#04x}", code) << " value "
                        << show(q.dequantized(r, c));
        }
      }
    }
  }
  EXPECT_EQ(failures, 0) << policy;
  EXPECT_EQ(q.flushed, expected_flushed) << policy;
  EXPECT_EQ(q.saturated, expected_saturated) << policy;
  EXPECT_EQ(q.nonzero_inputs, expected_nonzero) << policy;
  EXPECT_EQ(q.nonfinite_inputs, 0) << policy;
  // The storage round trip reproduces the dequantized values bit for bit.
  const auto decoded = mxscope::dequantize(q);
  for (std::size_t i = 0; i < decoded.values.size(); ++i) {
    if (!reference::same_value(decoded.values[i], q.dequantized.values[i])) {
      ADD_FAILURE() << policy << ": dequantize() differs at flat index " << i << ": " << show(decoded.values[i])
                    << " vs " << show(q.dequantized.values[i]);
      break;
    }
  }
}

TEST(QuantizeMx, WholeTensorsMatchTheOracleForEveryFormatAxisBlockRuleAndRounding) {
  const mxscope::matrix input = varied_matrix(37, 45, 7);  // odd column count: fp4 rows end in half a byte
  for (const auto& format : reference::element_formats()) {
    for (const int block : {32, 16, 7}) {
      for (const int axis : {0, 1}) {
        for (const auto rule : {scale_rule::floor, scale_rule::ceil, scale_rule::even}) {
          for (const auto mode : {core::rounding_mode::rne, core::rounding_mode::rna, core::rounding_mode::rtz}) {
            expect_mx_matches_oracle(input, format, block, axis, mode, rule);
          }
        }
      }
    }
  }
}

// Blocks whose amax sits at the extremes: huge values near FLT_MAX and tiny ones near 2^-149.
TEST(QuantizeMx, ExtremeMagnitudesMatchTheOracle) {
  mxscope::matrix input(4, 64);
  std::mt19937 generator(11);
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
  for (std::int64_t c = 0; c < 64; ++c) {
    input(0, c) = unit(generator) * float_max;
    input(1, c) = std::ldexp(unit(generator), -126);
    input(2, c) = std::ldexp(unit(generator), -146);
    input(3, c) = c % 2 == 0 ? std::ldexp(unit(generator), 120) : std::ldexp(unit(generator), -120);
  }
  input(0, 5) = float_max;
  input(1, 3) = largest_subnormal;
  for (const auto& format : reference::element_formats()) {
    for (const auto rule : {scale_rule::floor, scale_rule::ceil, scale_rule::even}) {
      expect_mx_matches_oracle(input, format, 32, 1, core::rounding_mode::rne, rule);
      expect_mx_matches_oracle(input, format, 16, 0, core::rounding_mode::rtz, rule);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Special blocks through mxscope::quantize, with hand-derived expectations.

TEST(QuantizeMx, ZeroNanInfAndSubnormalBlocks) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (const auto& format : reference::element_formats()) {
    SCOPED_TRACE(format.name);
    // Rows of 8, one block of 8 each (axis 1):
    //   0: all zero            -> scale 0x00 (2^-127), every code 0, every value +0
    //   1: a NaN among finite  -> scale 0xFF, the whole block dequantizes to NaN
    //   2: +Inf                -> same
    //   3: -Inf                -> same
    //   4: only 2^-149         -> e = -127 (clamped), 2^-149 / 2^-127 = 2^-22 is below every
    //                             format's half smallest subnormal: code 0, counted flushed
    mxscope::matrix input(5, 8, 0.0f);
    for (std::int64_t c = 0; c < 8; ++c) {
      input(1, c) = 1.0f + static_cast<float>(c);
      input(2, c) = -2.0f;
      input(3, c) = 0.5f;
    }
    input(1, 6) = nan;
    input(2, 0) = INFINITY;
    input(3, 7) = -INFINITY;
    input(4, 2) = 0x1p-149f;
    const auto q = mxscope::quantize(input, mx_options(format.kind, 8, 1, core::rounding_mode::rne, scale_rule::floor));
    ASSERT_EQ(q.scales.size(), 5U);
    EXPECT_EQ(q.scales[0], 0x00);
    EXPECT_EQ(q.scales[1], 0xFF);
    EXPECT_EQ(q.scales[2], 0xFF);
    EXPECT_EQ(q.scales[3], 0xFF);
    EXPECT_EQ(q.scales[4], 0x00);
    for (std::int64_t c = 0; c < 8; ++c) {
      EXPECT_EQ(stored_code(q, format, 0, c), 0U) << "zero block, column " << c;
      EXPECT_TRUE(reference::same_value(q.dequantized(0, c), 0.0f)) << "zero block, column " << c;
      for (std::int64_t r = 1; r <= 3; ++r) {
        EXPECT_TRUE(std::isnan(q.dequantized(r, c))) << "row " << r << " column " << c;
      }
      EXPECT_EQ(stored_code(q, format, 4, c), 0U) << "subnormal block, column " << c;
      EXPECT_EQ(q.dequantized(4, c), 0.0f);
    }
    EXPECT_EQ(q.nonfinite_inputs, 3);
    EXPECT_EQ(q.flushed, 1);
    EXPECT_EQ(q.saturated, 0);
    EXPECT_EQ(q.nonzero_inputs, 8 + 8 + 8 + 1);
    const auto decoded = mxscope::dequantize(q);
    for (std::int64_t c = 0; c < 8; ++c) {
      EXPECT_TRUE(std::isnan(decoded(1, c)) && std::isnan(decoded(2, c)) && std::isnan(decoded(3, c)));
      EXPECT_EQ(decoded(0, c), 0.0f);
    }
  }
}

// Elements at the bottom of the e8m0 range keep their value when the scale clamps at 2^-127:
// a block [3 * 2^-127, 2^-127] has floor(log2 amax) = -126, so e = -126 - E <= -127 for every
// format with E >= 1 and clamps to -127. 3 * 2^-127 / 2^-127 = 3 (fp4 code 0x5, e2m3 0x14,
// e3m2 0x12, e4m3 0x44, e5m2 0x42) and 1 (fp4 0x2, e2m3 0x08, e3m2 0x0C, e4m3 0x38, e5m2 0x3C);
// both products with 2^-127 are exact fp32 subnormals.
TEST(QuantizeMx, ScaleClampedAtTheBottomKeepsElementsExact) {
  struct expected_codes {
    element_kind kind;
    std::uint32_t three;
    std::uint32_t one;
  };
  const expected_codes cases[] = {{element_kind::fp4_e2m1, 0x5, 0x2},
                                  {element_kind::fp6_e2m3, 0x14, 0x08},
                                  {element_kind::fp6_e3m2, 0x12, 0x0C},
                                  {element_kind::fp8_e4m3, 0x44, 0x38},
                                  {element_kind::fp8_e5m2, 0x42, 0x3C}};
  for (const auto& c : cases) {
    const auto& format = reference::describe(c.kind);
    mxscope::matrix input(1, 2);
    input(0, 0) = 3.0f * 0x1p-127f;
    input(0, 1) = 0x1p-127f;
    const auto q = mxscope::quantize(input, mx_options(c.kind, 32, 1, core::rounding_mode::rne, scale_rule::floor));
    EXPECT_EQ(q.scales[0], 0x00) << format.name;
    EXPECT_EQ(stored_code(q, format, 0, 0), c.three) << format.name;
    EXPECT_EQ(stored_code(q, format, 0, 1), c.one) << format.name;
    EXPECT_EQ(q.dequantized(0, 0), 3.0f * 0x1p-127f) << format.name;
    EXPECT_EQ(q.dequantized(0, 1), 0x1p-127f) << format.name;
    EXPECT_EQ(q.flushed, 0) << format.name;
  }
}

// A block holding FLT_MAX: fp4 floor gives e = 125, FLT_MAX / 2^125 = 7.99.. saturates to 6
// (code 0x7), dequantized 6 * 2^125 = 1.5 * 2^127; int8 floor gives e = 127, saturates to 127/64
// (code 0x7F), dequantized 127/64 * 2^127; e4m3 ceil gives e = 120, FLT_MAX / 2^120 = 255.99.. which
// rounds (RNE) to 256 (code 0x78) without saturating.
TEST(QuantizeMx, ScaleNearTheTopOfTheE8m0Range) {
  mxscope::matrix input(1, 1, float_max);
  {
    const auto q =
        mxscope::quantize(input, mx_options(element_kind::fp4_e2m1, 32, 1, core::rounding_mode::rne, scale_rule::floor));
    EXPECT_EQ(q.scales[0], 125 + 127);
    EXPECT_EQ(q.codes[0] & 0x0F, 0x7);
    EXPECT_EQ(q.dequantized(0, 0), 0x1.8p127f);
    EXPECT_EQ(q.saturated, 1);
  }
  {
    const auto q =
        mxscope::quantize(input, mx_options(element_kind::int8, 32, 1, core::rounding_mode::rne, scale_rule::floor));
    EXPECT_EQ(q.scales[0], 127 + 127);
    EXPECT_EQ(q.codes[0], 0x7F);
    EXPECT_EQ(q.dequantized(0, 0), 127.0f / 64.0f * 0x1p127f);
    EXPECT_EQ(q.saturated, 1);
  }
  {
    const auto q =
        mxscope::quantize(input, mx_options(element_kind::fp8_e4m3, 32, 1, core::rounding_mode::rne, scale_rule::ceil));
    EXPECT_EQ(q.scales[0], 120 + 127);
    EXPECT_EQ(q.codes[0], 0x78);
    // 256 * 2^120 = 2^128 is exact in fp64 but overflows fp32: the corner NUMERICS.md section 2 names.
    EXPECT_EQ(q.dequantized(0, 0), INFINITY);
    EXPECT_EQ(q.saturated, 0);
  }
}

// fp4 packing with an odd column count: element 2i in the low nibble of byte i of its row.
TEST(QuantizeMx, Fp4PackingLowNibbleFirst) {
  // Row 0: 0.5, 1, 1.5, 2, 3 (codes 1, 2, 3, 4, 5) with amax 3 -> floor(log2 3) - 2 = -1, so the
  // elements are divided by 2^-1: 1, 2, 3, 4, 6 -> codes 2, 4, 5, 6, 7.
  // Row 1: -6, 0, 4, 0, -0.5 with amax 6 -> e = 0 -> codes 0xF, 0x0, 0x6, 0x0, 0x9.
  mxscope::matrix input(2, 5);
  const float row0[5] = {0.5f, 1.0f, 1.5f, 2.0f, 3.0f};
  const float row1[5] = {-6.0f, 0.0f, 4.0f, 0.0f, -0.5f};
  for (int c = 0; c < 5; ++c) {
    input(0, c) = row0[c];
    input(1, c) = row1[c];
  }
  const auto q = mxscope::quantize(input, mx_options(element_kind::fp4_e2m1, 32, 1, core::rounding_mode::rne,
                                                     scale_rule::floor));
  ASSERT_EQ(q.codes.size(), 6U);  // 2 rows x 3 bytes
  EXPECT_EQ(q.codes[0], 0x42);
  EXPECT_EQ(q.codes[1], 0x65);
  EXPECT_EQ(q.codes[2] & 0x0F, 0x7);
  EXPECT_EQ(q.codes[3], 0x0F);
  EXPECT_EQ(q.codes[4], 0x06);
  EXPECT_EQ(q.codes[5] & 0x0F, 0x9);
  EXPECT_EQ(q.scales[0], 127 - 1);
  EXPECT_EQ(q.scales[1], 127);
}

// ---------------------------------------------------------------------------------------------
// NVFP4: an fp32 re-implementation of TransformerEngine's recipe as the comments of
// src/quantize.cpp state it (TE's core_nvfp4.cuh):
//   S_enc = 448 * 6 / amax_tensor, min FLT_MAX; 1 when amax is 0 or S_enc is 0
//   per tile: d = ue4m3(RNE, saturating)(min(amax_tile * (S_enc * fl32(1/6)), FLT_MAX))
//             encode = min(1 / (fl32(d) * (1 / S_enc)), FLT_MAX)
//   element:  code = e2m1(round)(fl32(x * encode)); value = fl32(fl32(q * d) * (1 / S_enc))

struct nvfp4_expectation {
  std::vector<std::uint32_t> scale_codes;
  std::vector<std::uint32_t> element_codes;
  std::vector<float> values;
  float global_decode = 1.0f;
  std::int64_t flushed = 0;
  std::int64_t saturated = 0;
};

nvfp4_expectation nvfp4_oracle(const mxscope::matrix& input, std::int64_t tile_rows, std::int64_t tile_cols,
                               reference::rounding mode) {
  const auto& fp4 = reference::describe(element_kind::fp4_e2m1);
  const auto& ue4m3 = reference::describe(element_kind::ue4m3);
  const auto fp4_table = reference::magnitude_table(fp4);
  const auto ue4m3_table = reference::magnitude_table(ue4m3);
  float tensor_amax = 0.0f;
  for (const float v : input.values) tensor_amax = std::max(tensor_amax, std::fabs(v));
  float global_encode = std::min(448.0f * 6.0f / tensor_amax, FLT_MAX);
  if (tensor_amax == 0.0f || global_encode == 0.0f) global_encode = 1.0f;
  nvfp4_expectation out;
  out.global_decode = 1.0f / global_encode;
  const float one_sixth = 1.0f / 6.0f;
  const std::int64_t grid_rows = (input.rows + tile_rows - 1) / tile_rows;
  const std::int64_t grid_cols = (input.cols + tile_cols - 1) / tile_cols;
  out.scale_codes.assign(static_cast<std::size_t>(grid_rows * grid_cols), 0);
  out.element_codes.assign(input.values.size(), 0);
  out.values.assign(input.values.size(), 0.0f);
  for (std::int64_t tr = 0; tr < grid_rows; ++tr) {
    for (std::int64_t tc = 0; tc < grid_cols; ++tc) {
      const std::int64_t row_end = std::min(input.rows, (tr + 1) * tile_rows);
      const std::int64_t col_end = std::min(input.cols, (tc + 1) * tile_cols);
      float tile_amax = 0.0f;
      for (std::int64_t r = tr * tile_rows; r < row_end; ++r) {
        for (std::int64_t c = tc * tile_cols; c < col_end; ++c) tile_amax = std::max(tile_amax, std::fabs(input(r, c)));
      }
      const float wide_decode = std::min(tile_amax * (global_encode * one_sixth), FLT_MAX);
      const auto scale = reference::round_to_table(ue4m3, ue4m3_table, wide_decode, reference::rounding::rne);
      out.scale_codes[static_cast<std::size_t>(tr * grid_cols + tc)] = scale.code;
      const float tile_decode = static_cast<float>(scale.value);
      const float tile_encode = std::min(1.0f / (tile_decode * out.global_decode), FLT_MAX);
      for (std::int64_t r = tr * tile_rows; r < row_end; ++r) {
        for (std::int64_t c = tc * tile_cols; c < col_end; ++c) {
          const float scaled = input(r, c) * tile_encode;
          const auto element = reference::round_to_table(fp4, fp4_table, scaled, mode);
          const float value = (static_cast<float>(element.value) * tile_decode) * out.global_decode;
          const auto flat = static_cast<std::size_t>(r * input.cols + c);
          out.element_codes[flat] = element.code;
          out.values[flat] = value;
          out.flushed += input(r, c) != 0.0f && value == 0.0f;
          out.saturated += std::fabs(scaled) > 6.0f;
        }
      }
    }
  }
  return out;
}

// Tiles whose magnitudes differ by up to 2^30 from each other (so small tiles underflow the ue4m3
// scale), a zero tile and short tiles at the edges.
mxscope::matrix nvfp4_input(std::int64_t rows, std::int64_t cols, std::uint32_t seed) {
  mxscope::matrix m = varied_matrix(rows, cols, seed);
  std::mt19937 generator(seed + 1);
  std::uniform_int_distribution<int> tile_exponent(-30, 6);
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t c0 = 0; c0 < cols; c0 += 16) {
      const int shift = tile_exponent(generator);
      for (std::int64_t c = c0; c < std::min(cols, c0 + 16); ++c) m(r, c) = std::ldexp(m(r, c), shift);
    }
  }
  for (std::int64_t c = 0; c < std::min<std::int64_t>(cols, 16); ++c) m(0, c) = 0.0f;
  return m;
}

TEST(QuantizeNvfp4, MatchesTheFp32RecipeFor1x16_16x1And16x16Tiles) {
  const auto& fp4 = reference::describe(element_kind::fp4_e2m1);
  for (const auto& shape : {std::pair<std::int64_t, std::int64_t>{48, 80}, {37, 45}}) {
    const mxscope::matrix input = nvfp4_input(shape.first, shape.second, 5);
    struct layout {
      int axis;
      bool two_dimensional;
      std::int64_t tile_rows, tile_cols;
    };
    for (const layout l : {layout{1, false, 1, 16}, layout{0, false, 16, 1}, layout{1, true, 16, 16}}) {
      for (const auto mode : {core::rounding_mode::rne, core::rounding_mode::rna, core::rounding_mode::rtz}) {
        mxscope::quantize_options options;
        options.format = {mxscope::quant_scheme::nvfp4, element_kind::fp4_e2m1, 16};
        options.axis = l.axis;
        options.nvfp4_2d = l.two_dimensional;
        options.rounding = mode;
        const auto q = mxscope::quantize(input, options);
        const auto expected = nvfp4_oracle(input, l.tile_rows, l.tile_cols, reference_mode(mode));
        const std::string policy = fmt::format("nvfp4 {}x{} tiles, shape {}x{}, rounding {}", l.tile_rows, l.tile_cols,
                                               shape.first, shape.second,
                                               reference::rounding_label(reference_mode(mode)));
        EXPECT_TRUE(reference::same_value(q.tensor_scale, expected.global_decode))
            << policy << ": tensor scale expected " << show(expected.global_decode) << ", got " << show(q.tensor_scale);
        ASSERT_EQ(q.scales.size(), expected.scale_codes.size()) << policy;
        int failures = 0;
        for (std::size_t i = 0; i < q.scales.size(); ++i) {
          if (q.scales[i] != expected.scale_codes[i] && ++failures <= 10) {
            ADD_FAILURE() << policy << ": tile " << i << " expected scale " << fmt::format("{:#04x}", expected.scale_codes[i])
                          << ", got " << fmt::format("{:#04x}", q.scales[i]);
          }
        }
        for (std::int64_t r = 0; r < input.rows; ++r) {
          for (std::int64_t c = 0; c < input.cols; ++c) {
            const auto flat = static_cast<std::size_t>(r * input.cols + c);
            const std::uint32_t code = stored_code(q, fp4, r, c);
            if ((code != expected.element_codes[flat] || !reference::same_value(q.dequantized(r, c), expected.values[flat])) &&
                ++failures <= 10) {
              ADD_FAILURE() << policy << ": element (" << r << ", " << c << ") input " << show(input(r, c))
                            << " expected code " << fmt::format("{:#x}", expected.element_codes[flat]) << " value "
                            << show(expected.values[flat]) << ", got code " << fmt::format("{:#x}", code) << " value "
                            << show(q.dequantized(r, c));
            }
          }
        }
        EXPECT_EQ(failures, 0) << policy;
        EXPECT_EQ(q.flushed, expected.flushed) << policy;
        EXPECT_EQ(q.saturated, expected.saturated) << policy;
        const auto decoded = mxscope::dequantize(q);
        for (std::size_t i = 0; i < decoded.values.size(); ++i) {
          ASSERT_TRUE(reference::same_value(decoded.values[i], expected.values[i]))
              << policy << ": dequantize() at flat index " << i << " expected " << show(expected.values[i]) << ", got "
              << show(decoded.values[i]);
        }
      }
    }
  }
}

// Hand-derived NVFP4 case: a 1x16 tile holding 0..15 * 0.25 with tensor amax 3.75.
//   S_enc = 2688 / 3.75 = 716.8 -> fl32 716.79998779296875; the tile decode scale is
//   fl32(3.75 * fl32(S_enc * fl32(1/6))) ~ 448 -> ue4m3 448 (0x7E); elements x * encode with
//   encode = 1 / (448 / S_enc) ~ 1.6: 3.75 -> 6 (code 0x7), 0 -> 0.
TEST(QuantizeNvfp4, HandCheckedTileUsesTheFullUe4m3Range) {
  mxscope::matrix input(1, 16);
  for (int c = 0; c < 16; ++c) input(0, c) = 0.25f * static_cast<float>(c);
  mxscope::quantize_options options;
  options.format = {mxscope::quant_scheme::nvfp4, element_kind::fp4_e2m1, 16};
  const auto q = mxscope::quantize(input, options);
  EXPECT_EQ(q.scales[0], 0x7E);
  EXPECT_EQ(q.codes[7] >> 4, 0x7);  // element 15 in the high nibble of byte 7
  EXPECT_EQ(q.codes[0] & 0x0F, 0x0);
  EXPECT_NEAR(q.dequantized(0, 15), 3.75f, 1e-6f);
}

// ---------------------------------------------------------------------------------------------
// Per-tensor fp8: scale = fl32(amax / max normal); code = Round(x / scale), the exact quotient
// rounded once (the oracle compares x with midpoints times the scale, exactly, never dividing);
// value = fl32(q * scale).

TEST(QuantizePerTensor, MatchesTheExactQuotientOracle) {
  const mxscope::matrix input = varied_matrix(33, 40, 3);
  for (const element_kind kind : {element_kind::fp8_e4m3, element_kind::fp8_e5m2}) {
    const auto& format = reference::describe(kind);
    const auto table = reference::magnitude_table(format);
    for (const auto mode : {core::rounding_mode::rne, core::rounding_mode::rna, core::rounding_mode::rtz}) {
      mxscope::quantize_options options;
      options.format = {mxscope::quant_scheme::per_tensor, kind, 0};
      options.rounding = mode;
      const auto q = mxscope::quantize(input, options);
      float amax = 0.0f;
      for (const float v : input.values) amax = std::max(amax, std::fabs(v));
      const float scale = amax / static_cast<float>(format.max_normal);
      const std::string policy =
          fmt::format("per-tensor {} rounding {}", format.name, reference::rounding_label(reference_mode(mode)));
      EXPECT_EQ(q.tensor_scale, scale) << policy;
      std::int64_t flushed = 0, saturated = 0;
      int failures = 0;
      for (std::size_t i = 0; i < input.values.size(); ++i) {
        const float v = input.values[i];
        const auto expected = reference::round_to_table(format, table, v, reference_mode(mode), scale);
        const float expected_value = static_cast<float>(expected.value * static_cast<double>(scale));
        flushed += expected.flushed;
        saturated += expected.saturated;
        if ((q.codes[i] != expected.code || !reference::same_value(q.dequantized.values[i], expected_value)) &&
            ++failures <= 10) {
          ADD_FAILURE() << policy << ": flat index " << i << " input " << show(v) << " scale " << show(scale)
                        << " expected code " << fmt::format("{:#04x}", expected.code) << " value "
                        << show(expected_value) << ", got code " << fmt::format("{:#04x}", q.codes[i]) << " value "
                        << show(q.dequantized.values[i]);
        }
      }
      EXPECT_EQ(failures, 0) << policy;
      EXPECT_EQ(q.flushed, flushed) << policy;
      EXPECT_EQ(q.saturated, saturated) << policy;
    }
  }
}

TEST(QuantizePerTensor, NonFiniteInputsStayNanAndAllZeroUsesScaleOne) {
  mxscope::matrix input(1, 4);
  input(0, 0) = 2.0f;
  input(0, 1) = std::numeric_limits<float>::quiet_NaN();
  input(0, 2) = -INFINITY;
  input(0, 3) = -1.0f;
  mxscope::quantize_options options;
  options.format = {mxscope::quant_scheme::per_tensor, element_kind::fp8_e4m3, 0};
  const auto q = mxscope::quantize(input, options);
  // amax over the finite values is 2: scale = 2 / 448; 2 -> 448 (0x7E), -1 -> -224 (0xF6).
  EXPECT_EQ(q.tensor_scale, 2.0f / 448.0f);
  EXPECT_EQ(q.codes[0], 0x7E);
  EXPECT_EQ(q.codes[3], 0xF6);
  EXPECT_TRUE(std::isnan(q.dequantized(0, 1)));
  EXPECT_TRUE(std::isnan(q.dequantized(0, 2)));
  EXPECT_TRUE(std::isnan(reference::decode(reference::describe(element_kind::fp8_e4m3), q.codes[1])));
  EXPECT_TRUE(std::isnan(reference::decode(reference::describe(element_kind::fp8_e4m3), q.codes[2])));
  EXPECT_EQ(q.nonfinite_inputs, 2);
  const mxscope::matrix zeros(3, 3, 0.0f);
  const auto z = mxscope::quantize(zeros, options);
  EXPECT_EQ(z.tensor_scale, 1.0f);
  for (const auto code : z.codes) EXPECT_EQ(code, 0U);
}

}  // namespace
