// The host-side rules of the gfx950 native MX path (src/gpu/native_gfx950.hpp), checked on the CPU
// against a bit-level model of the hardware's stochastic rounding as hypothesis H2 states it. This
// proves the mapping from the emulator's (random word, sr_bits) to the hardware's seed and the
// exponent bounds below which blocks are converted in software; whether the hardware really
// behaves as H2 says is what `mxscope conform --self-test --device gpu` checks on an MI355X.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>

#include "../src/gpu/native_gfx950.hpp"
#include "mxscope/core/mx.hpp"

namespace {

namespace core = mxscope::core;
namespace native = mxscope::gpu::native_gfx950;

// fp4 e2m1 code of a magnitude that is a multiple of 0.5 in [0, 6] (a table, not the core encoder).
std::uint32_t fp4_magnitude_code(double magnitude) {
  const double values[8] = {0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0};
  for (std::uint32_t code = 0; code < 8; ++code)
    if (values[code] == magnitude) return code;
  ADD_FAILURE() << "not an fp4 value: " << magnitude;
  return 0;
}

// H2 on the bits: |q| = M 2^(E - 23) with a 24-bit significand M; in units of fp4's spacing
// s = 2^(max(E, 0) - 1) the value times 2^22 is W = M (E >= 0) or M >> -E (the aligning right
// shift, truncating); the integer part is W >> 22 and D the 22 bits below it. Round up iff
// D + (seed mod 2^22) >= 2^22, then saturate at 6, sign kept.
std::uint32_t hardware_sr_fp4(float x, int exponent, std::uint32_t seed, bool flush_subnormal_input) {
  if (flush_subnormal_input && std::fabs(x) < 0x1p-126f) x = std::copysign(0.0f, x);
  const bool negative = std::signbit(x);
  const double q = std::fabs(static_cast<double>(x)) * std::ldexp(1.0, -exponent);  // exact
  std::uint64_t w = 0;
  int e = 0;
  if (q != 0.0) {
    int binary_exponent = 0;
    const double fraction = std::frexp(q, &binary_exponent);  // q = fraction 2^binary_exponent
    e = binary_exponent - 1;
    const auto m = static_cast<std::uint64_t>(std::ldexp(fraction, 24));  // 24-bit significand, exact
    w = e >= 0 ? m : (-e >= 64 ? 0 : m >> -e);
  }
  const std::uint64_t window = std::uint64_t{1} << native::sr_window_bits;
  std::uint64_t steps = w >> native::sr_window_bits;
  const std::uint64_t d = w & (window - 1);
  if (d + (seed & (window - 1)) >= window) ++steps;
  const double spacing = std::ldexp(1.0, std::max(e, 0) - 1);
  double magnitude = static_cast<double>(steps) * spacing;
  if (magnitude > 6.0) magnitude = 6.0;
  return fp4_magnitude_code(magnitude) | (negative ? 0x8U : 0x0U);
}

float random_float(std::mt19937_64& rng, float low_exponent, float high_exponent) {
  std::uniform_real_distribution<float> exponent(low_exponent, high_exponent);
  std::uniform_real_distribution<float> mantissa(1.0f, 2.0f);
  const float magnitude = std::ldexp(mantissa(rng), static_cast<int>(std::floor(exponent(rng))));
  return (rng() & 1) != 0 ? -magnitude : magnitude;
}

TEST(Gfx950Model, SeedMappingReproducesEmulatorStochasticRounding) {
  std::mt19937_64 rng(0x6f950);
  std::int64_t rounded_up_differently = 0;
  for (const int sr_bits : {1, 2, 8, 9, 16, 21, 22}) {
    for (int trial = 0; trial < 40000; ++trial) {
      const int exponent = static_cast<int>(rng() % 40) - 20;
      // Values across the whole fp4 range and below it (fp4 subnormals and flushes), some beyond 6.
      const float x = random_float(rng, static_cast<float>(exponent - 28), static_cast<float>(exponent + 4));
      const auto word = static_cast<std::uint32_t>(rng());
      const core::encoded want = core::quantize_element(core::element_kind::fp4_e2m1, x, exponent,
                                                        core::rounding_mode::sr, word, sr_bits);
      const std::uint32_t got = hardware_sr_fp4(x, exponent, native::sr_seed(word, sr_bits), false);
      ASSERT_EQ(want.code, got) << "x " << x << " exponent " << exponent << " word " << word << " sr_bits "
                                << sr_bits;
      // The mapping matters: the unmapped word disagrees somewhere.
      rounded_up_differently += hardware_sr_fp4(x, exponent, word, false) != want.code;
    }
  }
  EXPECT_GT(rounded_up_differently, 0);
}

TEST(Gfx950Model, WindowIsTooNarrowForMoreRandomBits) {
  // With sr_bits > 22 the emulator reads fraction bits below the hardware's window: some fp4
  // subnormal result then differs for every seed choice that keeps the top 22 bits. This is why
  // quantize_plan_fits() stops at sr_bits_max.
  // q = x (exponent 0): F = x / 0.5 = 2^-3 + 2^-26, so floor(F 2^22) = 2^19 and the bit at 2^-26
  // lies below the window. With the top 22 bits of the word at 2^22 - 1 - 2^19 the hardware never
  // rounds up; the emulator with 32 bits does when the low 10 bits of the word reach 960.
  const float x = 0x1.000002p-4f;
  bool differs = false;
  for (std::uint32_t low = 0; low < 1024 && !differs; ++low) {
    const std::uint32_t word = (((1U << 22) - 1U - (1U << 19)) << 10) | low;
    const core::encoded want =
        core::quantize_element(core::element_kind::fp4_e2m1, x, 0, core::rounding_mode::sr, word, 32);
    differs = hardware_sr_fp4(x, 0, word >> 10, false) != want.code;
  }
  EXPECT_TRUE(differs);
  mxscope::gpu::mx_plan plan;
  plan.element = core::element_kind::fp4_e2m1;
  plan.rounding = core::rounding_mode::sr;
  plan.sr_bits = 22;
  EXPECT_TRUE(native::quantize_plan_fits(plan, 0, 64));
  plan.sr_bits = 23;
  EXPECT_FALSE(native::quantize_plan_fits(plan, 0, 64));
}

TEST(Gfx950Model, FlushedSubnormalInputsChangeNoCodeAboveTheBounds) {
  std::mt19937_64 rng(0x103);
  const auto subnormal = [&] {
    const float magnitude = std::ldexp(static_cast<float>(rng() % (1U << 23)) + 1.0f, -149);
    return (rng() & 1) != 0 ? -magnitude : magnitude;
  };
  const auto rne_code = [](float x, int exponent) {
    return core::quantize_element(core::element_kind::fp4_e2m1, x, exponent, core::rounding_mode::rne).code;
  };
  bool below_rne_bound_differs = false;
  bool below_sr_bound_differs = false;
  for (int trial = 0; trial < 20000; ++trial) {
    const float x = subnormal();
    const float flushed = std::copysign(0.0f, x);
    const auto word = static_cast<std::uint32_t>(rng());
    const int sr_bits = 1 + static_cast<int>(rng() % 22);
    for (int exponent = -127; exponent <= -90; ++exponent) {
      const bool rne_same = rne_code(x, exponent) == rne_code(flushed, exponent);
      const std::uint32_t seed = native::sr_seed(word, sr_bits);
      const bool sr_same = hardware_sr_fp4(x, exponent, seed, false) == hardware_sr_fp4(x, exponent, seed, true);
      if (native::hardware_block(exponent, core::rounding_mode::rne)) {
        ASSERT_TRUE(rne_same) << "x " << x << " exponent " << exponent;
      } else {
        below_rne_bound_differs = below_rne_bound_differs || !rne_same;
      }
      if (native::hardware_block(exponent, core::rounding_mode::sr)) {
        ASSERT_TRUE(sr_same) << "x " << x << " exponent " << exponent << " seed " << seed;
      } else {
        below_sr_bound_differs = below_sr_bound_differs || !sr_same;
      }
    }
  }
  // The bounds are not vacuous: just below them a flush does change codes.
  EXPECT_TRUE(below_rne_bound_differs);
  EXPECT_TRUE(below_sr_bound_differs);
}

TEST(Gfx950Model, GemmPathTakesOnlyTheInstructionsPreset) {
  using mxscope::accumulation_kind;
  const auto fp4 = core::element_kind::fp4_e2m1;
  const mxscope::accumulation_model group4{accumulation_kind::fp32_group, 4, 0, mxscope::alignment_rounding::rtz};
  const mxscope::accumulation_model group2{accumulation_kind::fp32_group, 2, 0, mxscope::alignment_rounding::rtz};
  const mxscope::accumulation_model block{accumulation_kind::fp32_block, 1, 0, mxscope::alignment_rounding::rtz};
  EXPECT_TRUE(native::gemm_fits(fp4, fp4, 32, group4));
  EXPECT_FALSE(native::gemm_fits(fp4, fp4, 32, group2));
  EXPECT_FALSE(native::gemm_fits(fp4, fp4, 32, block));
  EXPECT_FALSE(native::gemm_fits(fp4, fp4, 16, group4));
  EXPECT_FALSE(native::gemm_fits(fp4, core::element_kind::fp8_e4m3, 32, group4));
}

}  // namespace
