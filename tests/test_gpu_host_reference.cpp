// The CPU side of the GPU bit-exactness test (tests/gpu/host_reference.hpp, built from the core
// headers alone so that it compiles on a GPU machine without fmt, Eigen or Boost) against the
// library itself: quantize, rotate, emulate_product and reference_gemm, bit for bit, over every MX
// format, rounding mode, scale rule, axis, sign policy and accumulation model the GPU test sweeps.
// With tools/gpu-test (GPU == host_reference) this makes GPU == library.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "../src/gpu/fast_encode.hpp"
#include "gpu/host_reference.hpp"
#include "gpu/test_inputs.hpp"
#include "mxscope/gemm.hpp"
#include "mxscope/quantize.hpp"
#include "mxscope/quantize_fast.hpp"
#include "mxscope/reference.hpp"

namespace {

namespace core = mxscope::core;
using mxscope::matrix;
using test_inputs::value_kind;

const core::element_kind kinds[] = {core::element_kind::fp4_e2m1, core::element_kind::fp6_e2m3,
                                    core::element_kind::fp6_e3m2, core::element_kind::fp8_e4m3,
                                    core::element_kind::fp8_e5m2, core::element_kind::int8};

std::string hex(std::uint32_t bits) {
  char text[16];
  std::snprintf(text, sizeof(text), "0x%08x", bits);
  return text;
}

// Bitwise equality, any NaN equal to any NaN (both sides are CPU code; payloads are not the point).
bool same_bits(float a, float b) {
  return (std::isnan(a) && std::isnan(b)) || core::float_bits(a) == core::float_bits(b);
}
bool same_bits(double a, double b) {
  return (std::isnan(a) && std::isnan(b)) || core::double_bits(a) == core::double_bits(b);
}

mxscope::quantize_options options_for(int kind, int block, int axis, int rounding, int rule, int sr_bits,
                                      std::uint64_t seed) {
  mxscope::quantize_options options;
  options.format = {mxscope::quant_scheme::mx, kinds[kind], 32};
  options.block = block;
  options.axis = axis;
  options.rounding = static_cast<core::rounding_mode>(rounding);
  options.rule = static_cast<core::scale_rule>(rule);
  options.sr_bits = sr_bits;
  options.stream = core::random_stream{seed * 7919 + 1, static_cast<std::uint32_t>(seed % 97),
                                       0xC0FFEEU + static_cast<std::uint32_t>(seed)};
  return options;
}

std::string policy(const mxscope::quantize_options& o) {
  return std::string(core::spec(o.format.element).name) + " block " + std::to_string(o.block) + " axis " +
         std::to_string(o.axis) + " rounding " + std::to_string(static_cast<int>(o.rounding)) + " rule " +
         std::to_string(static_cast<int>(o.rule)) + " sr_bits " + std::to_string(o.sr_bits);
}

void expect_same_quantized(const matrix& input, const mxscope::quantized_tensor& want,
                           const mxscope::quantized_tensor& got, const std::string& what) {
  ASSERT_EQ(want.codes.size(), got.codes.size()) << what;
  for (std::size_t i = 0; i < want.codes.size(); ++i) {
    ASSERT_EQ(want.codes[i], got.codes[i])
        << what << ": code byte " << i << " expected " << hex(want.codes[i]) << " got " << hex(got.codes[i]);
  }
  ASSERT_EQ(want.scales, got.scales) << what;
  for (std::int64_t i = 0; i < input.size(); ++i) {
    const float a = want.dequantized.values[static_cast<std::size_t>(i)];
    const float b = got.dequantized.values[static_cast<std::size_t>(i)];
    ASSERT_TRUE(same_bits(a, b)) << what << ": element " << i << " input " << input.values[static_cast<std::size_t>(i)]
                                 << " (" << hex(core::float_bits(input.values[static_cast<std::size_t>(i)]))
                                 << ") expected " << a << " (" << hex(core::float_bits(a)) << ") got " << b << " ("
                                 << hex(core::float_bits(b)) << ")";
  }
  EXPECT_EQ(want.nonzero_inputs, got.nonzero_inputs) << what;
  EXPECT_EQ(want.flushed, got.flushed) << what;
  EXPECT_EQ(want.saturated, got.saturated) << what;
  EXPECT_EQ(want.nonfinite_inputs, got.nonfinite_inputs) << what;
  EXPECT_EQ(want.scale_rows, got.scale_rows) << what;
  EXPECT_EQ(want.scale_cols, got.scale_cols) << what;
  EXPECT_EQ(want.block, got.block) << what;
}

TEST(GpuHostReference, QuantizeMatchesLibraryForEveryPolicy) {
  const int blocks[] = {32, 16, 7, 64, 1, 33};
  int index = 0;
  for (int kind = 0; kind < 6; ++kind) {
    for (int rounding = 0; rounding < 4; ++rounding) {
      for (int rule = 0; rule < 3; ++rule) {
        for (int axis = 0; axis < 2; ++axis) {
          ++index;
          const int block = blocks[index % 6];
          const value_kind values = static_cast<value_kind>(index % test_inputs::value_kind_count);
          const matrix input = test_inputs::make_matrix(29 + index % 4, 67 + index % 3, values, 1000 + index);
          const auto options =
              options_for(kind, block, axis, rounding, rule, rounding == 3 && index % 4 == 0 ? 7 : 32, index);
          const std::string what = policy(options) + " input " + std::string(test_inputs::value_kind_name(values));
          const auto want = host_reference::quantize_mx(input, options);
          expect_same_quantized(input, want, mxscope::quantize(input, options), what + " (library default path)");
          mxscope::set_fast_quantize_enabled(false);
          expect_same_quantized(input, want, mxscope::quantize(input, options), what + " (library canonical path)");
          mxscope::set_fast_quantize_enabled(true);
          if (HasFatalFailure()) return;
        }
      }
    }
  }
}

// host_reference::quantize_nvfp4 (what the GPU's NVFP4 kernels are checked against) against the
// library's quantize(): 1-D tiles along either axis and 2-D tiles, every rounding mode (sr with 32
// and 9 bits), every input kind, shapes that are not multiples of 16.
TEST(GpuHostReference, Nvfp4QuantizeMatchesLibrary) {
  int index = 0;
  for (int layout = 0; layout < 3; ++layout) {
    for (int rounding = 0; rounding < 4; ++rounding) {
      for (int values_index = 0; values_index < test_inputs::value_kind_count; ++values_index) {
        ++index;
        const value_kind values = static_cast<value_kind>(values_index);
        const matrix input = test_inputs::make_matrix(33 + index % 5, 45 + index % 7, values, 2000 + index);
        auto options = options_for(0, 16, layout == 0 ? 0 : 1, rounding, 0, rounding == 3 && index % 2 == 0 ? 9 : 32,
                                   index);
        options.format = {mxscope::quant_scheme::nvfp4, core::element_kind::fp4_e2m1, 16};
        options.nvfp4_2d = layout == 2;
        const std::string what = "nvfp4 layout " + std::to_string(layout) + " rounding " + std::to_string(rounding) +
                                 " input " + std::string(test_inputs::value_kind_name(values));
        const auto want = host_reference::quantize_nvfp4(input, options);
        const auto got = mxscope::quantize(input, options);
        expect_same_quantized(input, want, got, what);
        EXPECT_TRUE(same_bits(want.tensor_scale, got.tensor_scale)) << what;
        if (HasFatalFailure()) return;
      }
    }
  }
}

namespace {

// Encoder probes at block exponent `exponent`: signed zeros, the smallest and largest fp32
// subnormal magnitudes, then for each scaled binade b (v = +-S * 2^(b + exponent - 23), fp32 range
// permitting) `per_binade` random significands and the exact ties between neighbours of every
// spacing the binade can meet with their two neighbours, both signs; then 8 random fp32 subnormals.
std::vector<float> probe_values(std::mt19937_64& random, int exponent, int lowest_scaled_binade,
                                int highest_scaled_binade, int per_binade) {
  std::vector<float> values = {0.0f, -0.0f, core::bits_float(1U), core::bits_float(0x807fffffU)};
  for (int scaled_binade = lowest_scaled_binade; scaled_binade <= highest_scaled_binade; ++scaled_binade) {
    const int binade = scaled_binade + exponent;
    if (binade < -126 || binade > 127) continue;
    const std::uint32_t field = static_cast<std::uint32_t>(binade + 127) << 23;
    for (int k = 0; k < per_binade; ++k) values.push_back(core::bits_float(field | (random() & 0x807fffffU)));
    for (int dropped = 1; dropped <= 23; ++dropped) {
      const std::uint32_t kept = static_cast<std::uint32_t>(random()) & (0x7fffffU >> dropped << dropped);
      const std::uint32_t tie = field | kept | (1U << (dropped - 1));
      for (const std::uint32_t bits : {tie, tie - 1U, tie + 1U}) {
        values.push_back(core::bits_float(bits));
        values.push_back(-core::bits_float(bits));
      }
    }
  }
  for (int k = 0; k < 8; ++k) values.push_back(core::bits_float(static_cast<std::uint32_t>(random()) & 0x807fffffU));
  return values;
}

// Every finite bf16 pattern as an fp32 value with random low bits (infinities and NaNs are left
// out: the kernels never encode them, their blocks take the NaN path).
std::vector<float> finite_bf16_patterns(std::mt19937_64& random) {
  std::vector<float> values;
  for (std::uint32_t pattern = 0; pattern < 0x10000U; ++pattern) {
    if ((pattern & 0x7f80U) == 0x7f80U) continue;
    values.push_back(core::bits_float((pattern << 16) | (static_cast<std::uint32_t>(random()) & 0xffffU)));
  }
  return values;
}

// The sweep of the fp4 encoder tests: every finite bf16 pattern at each of `exponents`, then at
// every exponent first..last the probe values of scaled binades 2^-30 to 2^5 (below the smallest
// spacing 2^-1 to beyond saturation). check(values, exponent) asserts; the sweep stops at the first
// fatal failure.
template <class Check>
void sweep_fp4_encoder(std::mt19937_64& random, std::initializer_list<int> exponents, int first, int last,
                       const Check& check) {
  const std::vector<float> bf16_values = finite_bf16_patterns(random);
  for (const int exponent : exponents) {
    check(bf16_values, exponent);
    if (::testing::Test::HasFatalFailure()) return;
  }
  for (int exponent = first; exponent <= last; ++exponent) {
    check(probe_values(random, exponent, -30, 5, 8), exponent);
    if (::testing::Test::HasFatalFailure()) return;
  }
}

// The rounding modes both encoder tests run: every mode, sr with 32, 9 and 1 random bits.
struct mode_case {
  core::rounding_mode mode;
  int sr_bits;
};
constexpr mode_case encoder_modes[] = {{core::rounding_mode::rne, 32}, {core::rounding_mode::rna, 32},
                                       {core::rounding_mode::rtz, 32}, {core::rounding_mode::sr, 32},
                                       {core::rounding_mode::sr, 9},   {core::rounding_mode::sr, 1}};

// Whether a fast encoder's result is the core's (code, saturation and flush flags), both printed
// where not; the caller adds the input.
::testing::AssertionResult same_encoding(const core::encoded& want, const core::encoded& got) {
  if (want.code == got.code && want.saturated == got.saturated && want.flushed == got.flushed) {
    return ::testing::AssertionSuccess();
  }
  return ::testing::AssertionFailure() << "core code " << hex(want.code) << " saturated " << want.saturated
                                       << " flushed " << want.flushed << ", fast code " << hex(got.code)
                                       << " saturated " << got.saturated << " flushed " << got.flushed;
}

// sweep_fp4_encoder over the block exponents an encoder covers (first..last, as `covers` says; the
// given ones must be among them and the two next to the range must not).
template <class Covers, class Check>
void sweep_covered_exponents(std::mt19937_64& random, const Covers& covers, std::initializer_list<int> exponents,
                             int first, int last, const Check& check) {
  EXPECT_FALSE(covers(first - 1));
  EXPECT_FALSE(covers(last + 1));
  for (const int exponent : exponents) ASSERT_TRUE(covers(exponent)) << "exponent " << exponent;
  sweep_fp4_encoder(random, exponents, first, last, check);
}

}  // namespace

// The fused GPU quantizer's element encoder (src/gpu/fast_encode.hpp, integer arithmetic on the fp32
// bits) against core::quantize_element / core::dequantize_element: every float element format x
// every rounding mode (sr with 32, 9 and 1 random bits) x every block exponent -127..127, on values
// whose scaled magnitude spans the format's whole range and beyond (flush to zero, subnormals,
// every binade, saturation), with random significands plus exact rounding ties and their
// neighbours, subnormal fp32 inputs and signed zeros.
TEST(GpuHostReference, FastElementEncoderMatchesCore) {
  const core::element_kind float_kinds[] = {core::element_kind::fp4_e2m1, core::element_kind::fp6_e2m3,
                                            core::element_kind::fp6_e3m2, core::element_kind::fp8_e4m3,
                                            core::element_kind::fp8_e5m2};
  std::mt19937_64 random(20240601);
  std::int64_t checked = 0;
  for (const auto kind : float_kinds) {
    const auto constants = mxscope::gpu::fast_encode::constants_of(kind);
    for (int exponent = -127; exponent <= 127; ++exponent) {
      // Scaled binades from 4 below the subnormal spacing to 3 above the largest binade.
      const std::vector<float> values =
          probe_values(random, exponent, constants.subnormal_exponent - 4, constants.emax + 3, 12);
      for (const mode_case& m : encoder_modes) {
        for (const float value : values) {
          const std::uint32_t word = static_cast<std::uint32_t>(random());
          const auto want = core::quantize_element(kind, value, exponent, m.mode, word, m.sr_bits);
          const auto got =
              mxscope::gpu::fast_encode::quantize_finite(constants, value, exponent, m.mode, word, m.sr_bits);
          ++checked;
          ASSERT_TRUE(same_encoding(want, got))
              << core::spec(kind).name << " mode " << static_cast<int>(m.mode) << " sr_bits " << m.sr_bits
              << " exponent " << exponent << " value " << value << " (" << hex(core::float_bits(value)) << ") word "
              << hex(word);
        }
      }
    }
    // Dequantization: every code of the format at every exponent.
    for (int exponent = -127; exponent <= 127; ++exponent) {
      for (std::uint32_t code = 0; code < (1U << core::spec(kind).bits); ++code) {
        const std::uint32_t magnitude = code & ~constants.sign_bit;
        if (magnitude > constants.max_code) continue;  // NaN and infinity codes are never produced
        const float want = static_cast<float>(core::dequantize_element(kind, code, exponent));
        const float got = mxscope::gpu::fast_encode::dequantize(constants, code, exponent);
        ASSERT_EQ(core::float_bits(want), core::float_bits(got))
            << core::spec(kind).name << " code " << hex(code) << " exponent " << exponent << ": core " << want
            << " fast " << got;
      }
    }
  }
  EXPECT_GT(checked, 1000000);
}

// The fused quantizer's two fp4 encoders (fast_encode::fp4_nearest_even for rne, fp4_locate and
// fp4_round for the other modes, composed by fast_encode::fp4_encode as the kernel composes them)
// against core::quantize_element: every finite bf16 pattern with random low bits at the extreme and
// moderate block exponents, then at every exponent -127..127 scaled values across the whole grid
// with exact ties (and their fp32 neighbours) at every spacing, fp32 subnormals and signed zeros;
// every mode, sr with 32, 9 and 1 random bits.
TEST(GpuHostReference, Fp4EncodersMatchCore) {
  constexpr auto kind = core::element_kind::fp4_e2m1;
  std::mt19937_64 random(20250317);
  std::int64_t checked = 0;
  const auto check = [&](const std::vector<float>& values, int exponent) {
    for (const mode_case& m : encoder_modes) {
      for (const float value : values) {
        const std::uint32_t word = static_cast<std::uint32_t>(random());
        const auto want = core::quantize_element(kind, value, exponent, m.mode, word, m.sr_bits);
        const auto got = mxscope::gpu::fast_encode::fp4_encode(value, exponent, m.mode, word, m.sr_bits);
        ++checked;
        ASSERT_TRUE(same_encoding(want, got)) << "mode " << static_cast<int>(m.mode) << " sr_bits " << m.sr_bits
                                              << " exponent " << exponent << " value " << value << " ("
                                              << hex(core::float_bits(value)) << ") word " << hex(word);
      }
    }
  };
  sweep_fp4_encoder(random, {-127, -126, -125, -124, -100, -3, -2, 0, 1, 2, 60, 124, 125, 126, 127}, -127, 127, check);
  if (HasFatalFailure()) return;
  EXPECT_GT(checked, 5000000);
}

// The fused kernel's rne encoder on unscaled magnitudes (fast_encode::fp4_nearest_even_unscaled,
// composed by fp4_encode_unscaled) against core::quantize_element over the block exponents it
// covers (-126..102, as fp4_unscaled_covers says; the edges and a spread between): every finite bf16
// pattern with random low bits, then values across the whole scaled grid with exact ties and their
// fp32 neighbours, fp32 subnormals and signed zeros.
TEST(GpuHostReference, UnscaledFp4EncoderMatchesCore) {
  namespace fast = mxscope::gpu::fast_encode;
  constexpr auto kind = core::element_kind::fp4_e2m1;
  std::mt19937_64 random(20261129);
  std::int64_t checked = 0;
  const auto check = [&](const std::vector<float>& values, int exponent) {
    for (const float value : values) {
      const auto want = core::quantize_element(kind, value, exponent, core::rounding_mode::rne, 0, 32);
      const auto got = fast::fp4_encode_unscaled(value, exponent);
      ++checked;
      ASSERT_TRUE(same_encoding(want, got))
          << "exponent " << exponent << " value " << value << " (" << hex(core::float_bits(value)) << ")";
    }
  };
  sweep_covered_exponents(random, fast::fp4_unscaled_covers,
                          {-126, -125, -124, -123, -100, -3, -2, -1, 0, 1, 2, 60, 100, 101, 102}, -126, 102, check);
  if (HasFatalFailure()) return;
  EXPECT_GT(checked, 2000000);
}

// The fused kernel's two sr encoders (32 random bits) against core::quantize_element over the
// block exponents each covers, on the sweep of the other fp4 encoder tests. Each value gets a random
// word, the extreme words, the two words on either side of its rounding threshold (where floor(F
// 2^32) + word reaches 2^32; the core decides what either must give) and words that leave the
// anchored sum undecided (floor(F 2^22) + (word >> 10) = 2^22 - 1) with random low bits.
//   - fast_encode::fp4_stochastic_unscaled (composed by fp4_encode_unscaled, exponents -125..102)
//     must give the core's code and flags for every word.
//   - fast_encode::fp4_stochastic_anchored_sum (composed by fp4_encode_stochastic_anchored,
//     exponents -127..23, magnitudes below 8 2^e as in the kernel's blocks, the saturating ones in
//     (6, 8) 2^e included) must call undecided exactly the words with that sum; where it decided,
//     and where F has no bits past 2^-22 even where it did not, its code and flags must be the core's.
TEST(GpuHostReference, StochasticFp4EncodersMatchCore) {
  namespace fast = mxscope::gpu::fast_encode;
  constexpr auto kind = core::element_kind::fp4_e2m1;
  std::mt19937_64 random(20261201);
  std::int64_t checked = 0, undecided = 0, saturating = 0;
  std::int64_t threshold_ups = 0;  // threshold words that rounded up: the boundary was met
  const auto check = [&](const std::vector<float>& values, int exponent, bool anchored) {
    for (const float value : values) {
      // floor(F 2^32) in fp64, exactly: |value| 2^-e, its quotient by the spacing and that
      // quotient's fraction all fit 53 bits.
      const double scaled = std::ldexp(std::fabs(static_cast<double>(value)), -exponent);
      if (anchored && scaled >= 8.0) continue;  // outside the anchored encoder's blocks
      saturating += anchored && scaled > 6.0;
      const double spacing = scaled < 2.0 ? 0.5 : scaled < 4.0 ? 1.0 : 2.0;
      const double units = scaled / spacing;
      const auto fraction = static_cast<std::uint32_t>(std::floor(std::ldexp(units - std::floor(units), 32)));
      const std::uint32_t threshold = 0U - fraction;  // 2^32 - fraction (0: never up)
      const std::uint32_t open = ((0x3fffffU - (fraction >> 10)) << 10) | static_cast<std::uint32_t>(random() & 0x3ffU);
      const std::uint32_t words[] = {static_cast<std::uint32_t>(random()), 0U, 0xffffffffU, 0x80000000U,
                                     threshold - 1U, threshold, open, open | 0x3ffU, open & ~0x3ffU};
      for (const std::uint32_t word : words) {
        const auto want = core::quantize_element(kind, value, exponent, core::rounding_mode::sr, word, 32);
        ++checked;
        if (word == threshold && fraction != 0 && scaled < 6.0) {
          threshold_ups += (want.code & 7U) !=
                           (core::quantize_element(kind, value, exponent, core::rounding_mode::rtz, 0, 32).code & 7U);
        }
        if (!anchored) {
          const auto unscaled = fast::fp4_encode_unscaled(value, exponent, true, word);
          ASSERT_TRUE(same_encoding(want, unscaled)) << "fp4_stochastic_unscaled: exponent " << exponent << " value "
                                                     << value << " (" << hex(core::float_bits(value)) << ") word "
                                                     << hex(word);
          continue;
        }
        const auto summed = fast::fp4_encode_stochastic_anchored(value, exponent, word);
        const bool open_word = (fraction >> 10) + (word >> 10) == 0x3fffffU;
        ASSERT_EQ(summed.decided, !open_word) << "fp4_stochastic_anchored_sum: exponent " << exponent << " value "
                                              << value << " word " << hex(word);
        if (!summed.decided) {
          ++undecided;
          if ((fraction & 0x3ffU) != 0) continue;
        }
        ASSERT_TRUE(same_encoding(want, summed.encoded)) << "fp4_stochastic_anchored_sum: exponent " << exponent
                                                         << " value " << value << " ("
                                                         << hex(core::float_bits(value)) << ") word " << hex(word);
      }
    }
  };
  sweep_covered_exponents(random, fast::fp4_stochastic_covers,
                          {-125, -124, -123, -100, -3, -2, -1, 0, 1, 2, 60, 100, 101, 102}, -125, 102,
                          [&](const std::vector<float>& values, int exponent) { check(values, exponent, false); });
  if (HasFatalFailure()) return;
  sweep_covered_exponents(random, fast::fp4_stochastic_anchored_covers,
                          {-127, -126, -125, -124, -100, -3, -2, -1, 0, 1, 2, 20, 21, 22, 23}, -127, 23,
                          [&](const std::vector<float>& values, int exponent) { check(values, exponent, true); });
  if (HasFatalFailure()) return;
  EXPECT_GT(checked, 10000000);
  EXPECT_GT(undecided, 500000);
  EXPECT_GT(threshold_ups, 100000);
  EXPECT_GT(saturating, 10000);
}

// The halfword encoder of bf16 blocks (fast_encode::fp4_nearest_even_bf16x2 and
// fp4_saturated_bf16x2, composed by fp4_encode_bf16x2) against core::quantize_element: every bf16
// pattern, finite or not in the other half, in either half of the word, at the block exponents it
// covers (-124..119: the edges and a spread between); the codes of one half must not depend on the
// other.
TEST(GpuHostReference, HalfwordFp4EncoderMatchesCore) {
  namespace fast = mxscope::gpu::fast_encode;
  constexpr auto kind = core::element_kind::fp4_e2m1;
  std::mt19937_64 random(20261130);
  std::int64_t checked = 0;
  EXPECT_FALSE(fast::fp4_unscaled_bf16x2_covers(-125));
  EXPECT_FALSE(fast::fp4_unscaled_bf16x2_covers(120));
  std::vector<int> exponents = {-124, -123, -122, -121, -120, -3, -2, -1, 0, 1, 2, 3, 60, 117, 118, 119};
  for (int k = 0; k < 16; ++k) exponents.push_back(static_cast<int>(random() % 244) - 124);
  for (const int exponent : exponents) {
    ASSERT_TRUE(fast::fp4_unscaled_bf16x2_covers(exponent));
    for (std::uint32_t pattern = 0; pattern < 0x10000U; ++pattern) {
      if ((pattern & 0x7f80U) == 0x7f80U) continue;  // a block with inf or NaN takes the NaN path
      const auto value = static_cast<std::uint16_t>(pattern);
      const auto want = core::quantize_element(kind, core::bf16_to_float(value), exponent, core::rounding_mode::rne, 0, 32);
      for (const bool high : {false, true}) {
        // The other half: any finite magnitude of the block, including the largest and zero.
        std::uint16_t other = static_cast<std::uint16_t>(random());
        if ((other & 0x7f80U) == 0x7f80U) other &= 0x807fU;
        const auto got = fast::fp4_encode_bf16x2(value, other, high, exponent);
        ++checked;
        ASSERT_TRUE(same_encoding(want, got)) << "exponent " << exponent << " bf16 " << hex(value)
                                              << (high ? " (high half" : " (low half") << ", other " << hex(other)
                                              << ")";
      }
    }
  }
  EXPECT_GT(checked, 3000000);
}

// fast_encode::floor_rule_exponent against core::shared_exponent under the floor rule, for every
// element format, on every fp32 exponent field (subnormals and zero included) with the smallest,
// the largest and random significand fields.
TEST(GpuHostReference, FloorRuleExponentMatchesCore) {
  namespace fast = mxscope::gpu::fast_encode;
  const core::element_kind kinds[] = {core::element_kind::fp4_e2m1, core::element_kind::fp6_e2m3,
                                      core::element_kind::fp6_e3m2, core::element_kind::fp8_e4m3,
                                      core::element_kind::fp8_e5m2, core::element_kind::int8};
  std::mt19937_64 random(20261202);
  std::int64_t checked = 0, clamped = 0;
  for (const auto kind : kinds) {
    for (std::uint32_t field = 0; field < 255; ++field) {
      for (const std::uint32_t significand : {0U, 1U, 0x7fffffU, static_cast<std::uint32_t>(random()) & 0x7fffffU}) {
        const std::uint32_t bits = field << 23 | significand;
        const int want = core::shared_exponent(kind, core::scale_rule::floor, core::bits_float(bits));
        ASSERT_EQ(fast::floor_rule_exponent(core::emax_elem(kind), bits), want)
            << "kind " << static_cast<int>(kind) << " largest " << hex(bits);
        ++checked;
        clamped += want == core::scale_exponent_min;
      }
    }
  }
  EXPECT_EQ(checked, 6 * 255 * 4);
  EXPECT_GT(clamped, 6 * 4);  // zero and the subnormals at least
}

// fast_encode::fp4_saturated against the core's saturation flag (a magnitude above the largest
// element 6 2^e) for every exponent it covers, on six itself, the fp32 numbers on either side of
// it, zero, the smallest subnormal and random magnitudes below 2^(e + 3); also the flags' sums.
TEST(GpuHostReference, Fp4SaturationFlagMatchesCore) {
  namespace fast = mxscope::gpu::fast_encode;
  constexpr auto kind = core::element_kind::fp4_e2m1;
  EXPECT_FALSE(fast::fp4_saturation_flag_covers(-106));
  EXPECT_FALSE(fast::fp4_saturation_flag_covers(103));
  std::mt19937_64 random(20261130);
  std::int64_t checked = 0;
  for (int exponent = -105; exponent <= 102; ++exponent) {
    ASSERT_TRUE(fast::fp4_saturation_flag_covers(exponent));
    const fast::fp4_saturation_flag flag = fast::fp4_saturation_flag_constants(exponent);
    const float six = std::ldexp(6.0f, exponent);
    std::vector<float> magnitudes = {six, std::nextafter(six, 0.0f), std::nextafter(six, 1e38f), 0.0f,
                                     std::numeric_limits<float>::denorm_min(), std::ldexp(7.99f, exponent)};
    for (int k = 0; k < 64; ++k) {
      const float fraction = static_cast<float>(random() % (1U << 24)) / 16777216.0f;
      magnitudes.push_back(std::ldexp(fraction, exponent + 3));
    }
    float sum = 0.0f;
    int count = 0;
    for (const float magnitude : magnitudes) {
      const bool want = core::quantize_element(kind, magnitude, exponent, core::rounding_mode::rne, 0, 32).saturated;
      const float got = fast::fp4_saturated(magnitude, flag);
      ++checked;
      ASSERT_EQ(got, want ? 1.0f : 0.0f) << "exponent " << exponent << " magnitude " << magnitude;
      sum += got;
      count += want ? 1 : 0;
    }
    EXPECT_EQ(static_cast<int>(sum), count);
  }
  EXPECT_GT(checked, 10000);
}

TEST(GpuHostReference, RotationMatchesLibrary) {
  int index = 0;
  for (const int size : {2, 16, 64, 512}) {
    for (int axis = 0; axis < 2; ++axis) {
      for (int signs = 0; signs < 3; ++signs) {
        ++index;
        const std::int64_t rows = axis == 1 ? 9 : 2 * size, cols = axis == 1 ? 2 * size : 9;
        const matrix input = test_inputs::make_matrix(rows, cols, static_cast<value_kind>(index % 3), 50 + index);
        mxscope::rotation_options rotation;
        rotation.size = size;
        rotation.signs = static_cast<mxscope::sign_policy>(signs);
        rotation.seed = 99 + index;
        rotation.step = 5;
        rotation.layer_hash = 0xABCD1234U;
        matrix want = input;
        host_reference::rotate(want, axis, rotation);
        matrix got = input;
        mxscope::rotate(got, axis, rotation, "test");
        for (std::int64_t i = 0; i < input.size(); ++i) {
          ASSERT_TRUE(same_bits(want.values[static_cast<std::size_t>(i)], got.values[static_cast<std::size_t>(i)]))
              << "H" << size << " axis " << axis << " signs " << signs << " element " << i;
        }
      }
    }
  }
}

TEST(GpuHostReference, ProductMatchesLibraryForEveryModel) {
  struct layout {
    int a_axis, b_axis;
  };
  const layout layouts[] = {{1, 1}, {1, 0}, {0, 0}};
  const mxscope::accumulation_kind models[] = {mxscope::accumulation_kind::fp32_block,
                                               mxscope::accumulation_kind::fp32_group,
                                               mxscope::accumulation_kind::exact, mxscope::accumulation_kind::fp32_seq};
  int index = 0;
  for (int kind = 0; kind < 6; ++kind) {
    for (const auto model_kind : models) {
      for (const layout& l : layouts) {
        ++index;
        const std::int64_t m = 11 + index % 3, n = 7 + index % 4, k = 70 + 32 * (index % 2);
        const int block = index % 5 == 0 ? 16 : 32;
        const value_kind values = static_cast<value_kind>(index % test_inputs::value_kind_count);
        const matrix a = l.a_axis == 1 ? test_inputs::make_matrix(m, k, values, 300 + index)
                                       : test_inputs::make_matrix(k, m, values, 300 + index);
        const matrix b = l.b_axis == 1 ? test_inputs::make_matrix(n, k, values, 400 + index)
                                       : test_inputs::make_matrix(k, n, values, 400 + index);
        const auto qa = host_reference::quantize_mx(a, options_for(kind, block, l.a_axis, index % 4, 0, 32, index));
        const auto qb = host_reference::quantize_mx(
            b, options_for((kind + index) % 6, block, l.b_axis, 0, index % 3, 32, index + 1));
        mxscope::accumulation_model model;
        model.kind = model_kind;
        model.blocks_per_group = model_kind == mxscope::accumulation_kind::fp32_group ? 2 + index % 4 : 1;
        const auto output = index % 3 == 0 ? mxscope::output_rounding::bf16 : mxscope::output_rounding::fp32;
        const auto want = host_reference::product(qa, qb, model, output);
        for (const auto path : {mxscope::accumulation_path::automatic, mxscope::accumulation_path::generic}) {
          mxscope::gemm_options options;
          options.path = path;
          const auto got = mxscope::emulate_product(qa, qb, model, output, options);
          const std::string what = mxscope::accumulation_model_name(model) + " A " + policy(qa.options) + " B " +
                                   policy(qb.options) +
                                   (path == mxscope::accumulation_path::generic ? " generic" : " automatic");
          ASSERT_EQ(want.out.rows, got.out.rows) << what;
          ASSERT_EQ(want.out.cols, got.out.cols) << what;
          for (std::int64_t i = 0; i < want.out.size(); ++i) {
            const float x = want.out.values[static_cast<std::size_t>(i)],
                        y = got.out.values[static_cast<std::size_t>(i)];
            ASSERT_TRUE(same_bits(x, y)) << what << ": entry " << i << " expected " << x << " ("
                                         << hex(core::float_bits(x)) << ") got " << y << " ("
                                         << hex(core::float_bits(y)) << ")";
          }
          if (model_kind == mxscope::accumulation_kind::exact) {
            for (std::int64_t i = 0; i < want.exact.size(); ++i) {
              ASSERT_TRUE(same_bits(want.exact.values[static_cast<std::size_t>(i)],
                                    got.exact.values[static_cast<std::size_t>(i)]))
                  << what << ": exact entry " << i;
            }
          }
        }
      }
    }
  }
}

// Unscaled operands (fp32, bf16): plain_product_entry on the dequantized values is what the
// library's emulate_product computes (its K-block is 32 for such operands).
TEST(GpuHostReference, PlainProductMatchesLibrary) {
  struct input {
    const char* name;
    matrix a, b;
  };
  const input inputs[] = {
      {"bf16 narrow", test_inputs::make_bf16_matrix(9, 101, 2, 901), test_inputs::make_bf16_matrix(7, 101, 2, 902)},
      {"bf16 wide", test_inputs::make_bf16_matrix(9, 101, 24, 903), test_inputs::make_bf16_matrix(7, 101, 24, 904)},
      {"banded", test_inputs::make_matrix(9, 70, value_kind::banded, 905),
       test_inputs::make_matrix(7, 70, value_kind::banded, 906)},
      {"extreme", test_inputs::make_matrix(9, 70, value_kind::extreme, 907),
       test_inputs::make_matrix(7, 70, value_kind::extreme, 908)},
  };
  const mxscope::quant_scheme schemes[] = {mxscope::quant_scheme::bf16, mxscope::quant_scheme::none};
  int index = 0;
  for (const input& in : inputs) {
    for (const auto a_scheme : schemes) {
      for (const auto b_scheme : schemes) {
        for (const auto kind : {mxscope::accumulation_kind::fp32_block, mxscope::accumulation_kind::fp32_group,
                                mxscope::accumulation_kind::fp32_seq}) {
          ++index;
          mxscope::quantize_options a_options, b_options;
          a_options.format.scheme = a_scheme;
          b_options.format.scheme = b_scheme;
          a_options.axis = 1;
          b_options.axis = 1;
          const auto qa = mxscope::quantize(in.a, a_options);
          const auto qb = mxscope::quantize(in.b, b_options);
          mxscope::accumulation_model model;
          model.kind = kind;
          model.blocks_per_group = kind == mxscope::accumulation_kind::fp32_group ? 2 + index % 2 : 1;
          const auto output = index % 3 == 0 ? mxscope::output_rounding::bf16 : mxscope::output_rounding::fp32;
          const auto got = mxscope::emulate_product(qa, qb, model, output, mxscope::gemm_options{});
          for (std::int64_t i = 0; i < in.a.rows; ++i) {
            for (std::int64_t j = 0; j < in.b.rows; ++j) {
              const float want =
                  host_reference::plain_product_entry(qa.dequantized, qb.dequantized, i, j, 32, model, output);
              ASSERT_TRUE(same_bits(want, got.out(i, j)))
                  << in.name << " " << mxscope::accumulation_model_name(model) << " entry (" << i << ", " << j
                  << ") expected " << want << " (" << hex(core::float_bits(want)) << ") got " << got.out(i, j);
            }
          }
        }
      }
    }
  }
}

TEST(GpuHostReference, ReferenceEntriesMatchLibrary) {
  int index = 0;
  for (const value_kind values : {value_kind::banded, value_kind::extreme, value_kind::ties, value_kind::nonfinite}) {
    ++index;
    matrix a = test_inputs::make_matrix(13, 150, values, 700 + index);
    matrix b = test_inputs::make_matrix(9, 150, values, 800 + index);
    a(0, 0) = 1.0f;  // an exact fp32 tie in entry (0, 0): 1 + 2^-24
    a(0, 1) = 0x1p-24f;
    b(0, 0) = 1.0f;
    b(0, 1) = 1.0f;
    for (std::int64_t kk = 2; kk < 150; ++kk) a(0, kk) = 0.0f;
    const auto got = mxscope::reference_gemm(a, b, mxscope::reference_kind::exact);
    for (std::int64_t i = 0; i < a.rows; ++i) {
      for (std::int64_t j = 0; j < b.rows; ++j) {
        const auto want = host_reference::reference_entry(a, b, i, j);
        ASSERT_TRUE(same_bits(want.fp64, got.fp64(i, j)))
            << test_inputs::value_kind_name(values) << " entry (" << i << ", " << j << ") fp64 expected " << want.fp64
            << " got " << got.fp64(i, j);
        ASSERT_TRUE(same_bits(want.fp32, got.fp32(i, j)))
            << test_inputs::value_kind_name(values) << " entry (" << i << ", " << j << ") fp32 expected " << want.fp32
            << " got " << got.fp32(i, j);
      }
    }
  }
}

}  // namespace
