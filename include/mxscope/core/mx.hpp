// MX block quantization pieces (NUMERICS.md section 2): shared-exponent rules and the per-element
// quantize / dequantize against a block's power-of-two scale. The tensor-level drivers (CPU in
// src/quantize.cpp, GPU in src/gpu) call only these functions, so every backend shares the bits.
#pragma once

#include "mxscope/core/formats.hpp"

namespace mxscope::core {

enum class scale_rule : std::uint8_t {
  floor,  // OCP v1.0: e = floor(log2 amax) - emax_elem (may clip the block's largest elements)
  ceil,   // smallest e with amax / 2^e <= max normal (never clips; cuBLAS / TE "RCEIL")
  even,   // round amax to the element's mantissa width (RNE) first, then floor (AMD Quark "even")
};

inline constexpr int scale_exponent_min = -127;
inline constexpr int scale_exponent_max = 127;
inline constexpr std::uint8_t scale_nan_code = 0xFF;

// The unclamped-then-clamped shared exponent of a block whose largest magnitude is `amax`
// (finite, >= 0). An all-zero block gets the smallest scale, 2^-127 (code 0x00).
MXSCOPE_HD constexpr int shared_exponent(element_kind kind, scale_rule rule, float amax) {
  if (!(amax > 0.0f)) return scale_exponent_min;
  const double magnitude = static_cast<double>(amax);
  int leading = floor_log2(amax);
  const int emax = emax_elem(kind);
  int exponent = leading - emax;
  switch (rule) {
    case scale_rule::floor: break;
    case scale_rule::ceil:
      if (magnitude > max_normal(kind) * pow2(exponent)) ++exponent;
      break;
    case scale_rule::even: {
      const int mantissa_bits = spec(kind).mantissa_bits;
      const std::uint64_t rounded =
          round_to_integer(magnitude * pow2(mantissa_bits - leading), rounding_mode::rne, 0, 32);
      if (rounded >= (std::uint64_t{1} << (mantissa_bits + 1))) ++leading;
      exponent = leading - emax;
      break;
    }
  }
  if (exponent < scale_exponent_min) exponent = scale_exponent_min;
  if (exponent > scale_exponent_max) exponent = scale_exponent_max;
  return exponent;
}

MXSCOPE_HD constexpr std::uint8_t scale_code(int exponent) { return static_cast<std::uint8_t>(exponent + 127); }
MXSCOPE_HD constexpr int scale_exponent(std::uint8_t code) { return static_cast<int>(code) - 127; }

// Element v of a block with shared exponent e: Round(v / 2^e), saturating. v / 2^e is exact in a
// double for every fp32 v and |e| <= 127, so there is no double rounding.
MXSCOPE_HD constexpr encoded quantize_element(element_kind kind, float value, int exponent, rounding_mode mode,
                                              std::uint32_t random_word = 0, int sr_bits = 32) {
  return encode(kind, static_cast<double>(value) * pow2(-exponent), mode, random_word, sr_bits);
}

// q * 2^e, exact in a double; the fp32 conversion is exact except at the far corners of the range.
MXSCOPE_HD constexpr double dequantize_element(element_kind kind, std::uint32_t code, int exponent) {
  return decode(kind, code) * pow2(exponent);
}

static_assert(shared_exponent(element_kind::fp4_e2m1, scale_rule::floor, 6.0f) == 0);
static_assert(shared_exponent(element_kind::fp4_e2m1, scale_rule::floor, 7.9f) == 0);   // 7.9 clips to 6
static_assert(shared_exponent(element_kind::fp4_e2m1, scale_rule::ceil, 7.9f) == 1);    // 3.95 fits
static_assert(shared_exponent(element_kind::fp4_e2m1, scale_rule::ceil, 6.0f) == 0);
static_assert(shared_exponent(element_kind::fp4_e2m1, scale_rule::even, 7.0f) == 1);    // 7 -> 8 (tie to even)
static_assert(shared_exponent(element_kind::fp4_e2m1, scale_rule::even, 6.9f) == 0);
static_assert(shared_exponent(element_kind::fp4_e2m1, scale_rule::floor, 0.0f) == -127);

}  // namespace mxscope::core
