// Accumulation models (NUMERICS.md section 7): the per-element arithmetic that decides how the
// products of two quantized operands are summed into an fp32 result. The CPU GEMM (src/gemm.cpp)
// and any GPU kernel call these functions, so a model means the same bits everywhere.
//
// Everything here rounds exact values exactly once:
// - round_scaled_integer: +-magnitude * 2^exponent (a 128-bit integer) to fp32 or fp64, by
//   round-to-nearest-even or toward zero, with gradual underflow and overflow as IEEE 754 does it.
// - window_sum: the exact sum of a few doubles in a 127-bit fixed-point window placed just below the
//   largest term. It reports failure instead of losing a bit; callers then fall back to the
//   long_accumulator of exact_sum.hpp, which covers the whole double range.
// - round_exact_sum: initial + sum of terms rounded once (the fp32-block / fp32-group / exact step).
// - trunc_align_sum: one group step of the trunc-align model.
// - trunc_promote_step: one step of the trunc-promote model (a narrow inner accumulator that is
//   promoted into an fp32 one at intervals).
//
// Zeros: a sum that is exactly zero rounds to +0 (as IEEE addition does under round-to-nearest for
// operands of mixed signs); a nonzero sum that underflows to zero keeps its sign.
#pragma once

#include "mxscope/core/exact_sum.hpp"

namespace mxscope::core {

__extension__ typedef __int128 int128;
__extension__ typedef unsigned __int128 uint128;

enum class accumulation_kind : std::uint8_t {
  exact,        // the exact sum of all scaled products, rounded once
  fp32_block,   // acc = fl32(acc + exact scaled block dot), block by block in ascending K
  fp32_group,   // as fp32_block with `blocks_per_group` blocks summed exactly before each add
  trunc_align,  // group products and accumulator aligned to the largest exponent, truncated
  fp32_seq,     // dequantize to fp32, then one fused multiply-add per product in ascending K
  trunc_promote,  // steps of k products truncated into a narrow inner accumulator, promoted to fp32 every c
};

// How trunc_align rounds the normalized group sum into the fp32 accumulator.
enum class alignment_rounding : std::uint8_t { rtz, rne };

struct accumulation_model {
  accumulation_kind kind = accumulation_kind::fp32_block;
  int blocks_per_group = 1;  // fp32_group, trunc_align (1 for fp32_block)
  int fraction_bits = 0;     // trunc_align: bits kept below the leading exponent E
  alignment_rounding rounding = alignment_rounding::rtz;
  // trunc_promote (fraction_bits is its n): products per step, significant bits the inner
  // accumulator keeps after each step, products between promotions (0: only at the end of K).
  int products_per_step = 0;
  int step_bits = 0;
  int promotion_interval = 0;
};

// trunc-promote keeps at most this many significant bits in its inner accumulator (an fp32 value).
inline constexpr int trunc_promote_step_bits_max = 24;

// trunc-align keeps at most this many bits below the leading exponent: every truncated term is then
// still a double (the wide path truncates in double arithmetic), and far more bits than any
// accumulator has.
inline constexpr int trunc_align_fraction_bits_max = 900;

// A binary floating-point target of a rounding: `precision` significand bits, smallest subnormal
// 2^min_exponent, largest finite binade 2^max_exponent.
struct binary_format {
  int precision;
  int min_exponent;
  int max_exponent;
};
inline constexpr binary_format binary32{24, -149, 127};
inline constexpr binary_format binary64{53, -1074, 1023};

MXSCOPE_HD constexpr int bit_length(uint128 value) {
  const auto high = static_cast<std::uint64_t>(value >> 64);
  if (high != 0) return 128 - __builtin_clzll(high);
  const auto low = static_cast<std::uint64_t>(value);
  return low == 0 ? 0 : 64 - __builtin_clzll(low);
}

// The largest finite value of `format`, as a double.
MXSCOPE_HD constexpr double largest_finite(binary_format format) {
  return (pow2(format.precision) - 1.0) * pow2(format.max_exponent - format.precision + 1);
}

// +-magnitude * 2^exponent rounded to `format` by round-to-nearest-even (overflow to infinity) or
// toward zero (overflow to the largest finite value). The result is a double holding a value of
// `format` (converting it to float for binary32 is exact).
MXSCOPE_HD constexpr double round_scaled_integer(uint128 magnitude, bool negative, int exponent, binary_format format,
                                                 bool toward_zero) {
  if (magnitude == 0) return 0.0;
  const int leading = exponent + bit_length(magnitude) - 1;  // exponent of the leading one bit
  const double sign = negative ? -1.0 : 1.0;
  if (leading > format.max_exponent) return toward_zero ? sign * largest_finite(format) : sign * infinity();
  // The last kept bit has exponent `unit`: precision bits below the leading one, or the subnormal
  // spacing.
  int unit = leading - format.precision + 1;
  if (unit < format.min_exponent) unit = format.min_exponent;
  std::uint64_t kept = 0;  // below 2^precision <= 2^53
  if (unit <= exponent) {
    kept = static_cast<std::uint64_t>(magnitude << (exponent - unit));
  } else {
    const int dropped = unit - exponent;  // >= 1
    kept = dropped >= 128 ? 0 : static_cast<std::uint64_t>(magnitude >> dropped);
    const int round_position = dropped - 1;
    const bool round_bit = round_position < 128 && ((magnitude >> round_position) & 1U) != 0;
    const uint128 below_mask = round_position >= 128 ? ~uint128{0} : (uint128{1} << round_position) - 1U;
    const bool sticky = (magnitude & below_mask) != 0;
    if (!toward_zero && round_bit && (sticky || (kept & 1U) != 0)) ++kept;
  }
  // A carry can reach 2^precision: still exact in a double, and possibly past the largest binade.
  if (kept == (std::uint64_t{1} << format.precision) && unit + format.precision > format.max_exponent) {
    return sign * infinity();
  }
  return sign * (static_cast<double>(kept) * pow2(unit));
}

// A finite nonzero double as significand * 2^exponent (significand < 2^53, the hidden bit included
// for normal numbers).
struct double_parts {
  std::uint64_t significand;
  int exponent;
  bool negative;
};

MXSCOPE_HD constexpr double_parts decompose(double value) {
  const std::uint64_t bits = double_bits(value);
  const int exponent_field = static_cast<int>((bits >> 52) & 0x7ffU);
  const std::uint64_t fraction = bits & 0x000fffffffffffffULL;
  if (exponent_field == 0) return {fraction, -1074, (bits >> 63) != 0};
  return {fraction | 0x0010000000000000ULL, exponent_field - 1075, (bits >> 63) != 0};
}

// The exact sum initial + terms[0] + ... + terms[count - 1] (all finite) as sum * 2^exponent.
// The window is the 127 bits below the largest term's leading bit plus room for the carries of
// `count + 1` terms; a term with a set bit below it makes the function return false (nothing is
// ever rounded here).
MXSCOPE_HD constexpr bool window_sum(double initial, const double* terms, int count, int128& sum, int& exponent) {
  int leading = -2000;
  if (initial != 0.0) leading = floor_log2(initial < 0.0 ? -initial : initial);
  for (int i = 0; i < count; ++i) {
    const double term = terms[i];
    if (term != 0.0) {
      const int term_leading = floor_log2(term < 0.0 ? -term : term);
      if (term_leading > leading) leading = term_leading;
    }
  }
  sum = 0;
  exponent = 0;
  if (leading == -2000) return true;
  // Every |term| < 2^(leading + 1); count + 1 of them stay below 2^(leading + 1 + carry_bits).
  const int carry_bits = bit_length(static_cast<uint128>(count) + 1U);
  exponent = leading + 1 + carry_bits - 127;
  const auto add = [&](double value) {
    if (value == 0.0) return true;
    const double_parts parts = decompose(value);
    const int shift = parts.exponent - exponent;
    uint128 magnitude = 0;
    if (shift >= 0) {
      magnitude = static_cast<uint128>(parts.significand) << shift;
    } else {
      if (-shift >= 64 || (parts.significand & ((std::uint64_t{1} << -shift) - 1U)) != 0) return false;
      magnitude = parts.significand >> -shift;
    }
    sum += parts.negative ? -static_cast<int128>(magnitude) : static_cast<int128>(magnitude);
    return true;
  };
  if (!add(initial)) return false;
  for (int i = 0; i < count; ++i) {
    if (!add(terms[i])) return false;
  }
  return true;
}

// The value of a long accumulator rounded once to `format`, to nearest-even or toward zero.
MXSCOPE_HD constexpr double round_long_accumulator(const long_accumulator& total, binary_format format,
                                                   bool toward_zero) {
  const double nearest = total.round(format.precision, format.min_exponent, format.max_exponent);
  if (!toward_zero) return nearest;
  if (is_inf(nearest)) return nearest > 0.0 ? largest_finite(format) : -largest_finite(format);
  if (nearest == 0.0) return nearest;  // |exact| below half the smallest subnormal: rtz gives zero too
  // Round-to-nearest gives the rtz value or its neighbour away from zero: the residual tells which.
  long_accumulator residual = total;
  residual.add(-nearest);
  const double residual_value = residual.round_to_double();  // nonzero whenever the residual is
  const bool beyond = residual_value != 0.0 && ((residual_value > 0.0) != (nearest > 0.0));
  if (!beyond) return nearest;
  // Step one unit toward zero; below a power of two the spacing halves (down to the subnormal one).
  const double magnitude = nearest < 0.0 ? -nearest : nearest;
  const int leading = floor_log2(magnitude);
  const std::uint64_t significand = decompose(magnitude).significand;
  const bool power_of_two = (significand & (significand - 1U)) == 0;
  int gap = power_of_two ? leading - format.precision : leading - format.precision + 1;
  if (gap < format.min_exponent) gap = format.min_exponent;
  const double stepped = magnitude - pow2(gap);
  return nearest < 0.0 ? -stepped : stepped;
}

// initial + sum of terms (all finite), exact, rounded once to `format`.
MXSCOPE_HD constexpr double round_exact_sum(double initial, const double* terms, int count, binary_format format,
                                            bool toward_zero = false) {
  int128 sum = 0;
  int exponent = 0;
  if (window_sum(initial, terms, count, sum, exponent)) {
    const bool negative = sum < 0;
    const uint128 magnitude = negative ? -static_cast<uint128>(sum) : static_cast<uint128>(sum);
    return round_scaled_integer(magnitude, negative, exponent, format, toward_zero);
  }
  long_accumulator total;
  total.add(initial);
  for (int i = 0; i < count; ++i) total.add(terms[i]);
  return round_long_accumulator(total, format, toward_zero);
}

// fl32(accumulator + sum of terms): the fp32-block (one block dot) and fp32-group (G of them) step.
MXSCOPE_HD constexpr float add_exactly_to_float(float accumulator, const double* terms, int count) {
  return static_cast<float>(round_exact_sum(static_cast<double>(accumulator), terms, count, binary32));
}

// `value` truncated toward zero to a multiple of 2^unit (exact in a double).
MXSCOPE_HD constexpr double truncate_to_multiple(double value, int unit) {
  if (value == 0.0) return value;
  const double_parts parts = decompose(value);
  if (parts.exponent >= unit) return value;
  const int shift = unit - parts.exponent;
  if (shift >= 64) return parts.negative ? -0.0 : 0.0;
  const std::uint64_t significand = (parts.significand >> shift) << shift;
  const double magnitude = static_cast<double>(significand) * pow2(parts.exponent);
  return parts.negative ? -magnitude : magnitude;
}

// The exact sum of the accumulator and the products, each truncated toward zero to a multiple of
// 2^unit, rounded once to `target` (toward zero, or to nearest even). Every truncated term is below
// 2^term_bits units in magnitude: the sum then fits 128-bit integers when term_bits plus the carry
// bits of count + 1 terms stay within 126, and goes through a long accumulator otherwise.
MXSCOPE_HD constexpr double sum_truncated_terms(float accumulator, const double* products, int count, int unit,
                                                int term_bits, binary_format target, bool toward_zero) {
  const int carry_bits = bit_length(static_cast<uint128>(count) + 1U);
  if (term_bits + carry_bits <= 126) {
    int128 sum = 0;
    const auto add = [&](double value) {
      if (value == 0.0) return;
      const double_parts parts = decompose(value);
      const int shift = parts.exponent - unit;
      uint128 magnitude = 0;
      if (shift >= 0) {
        magnitude = static_cast<uint128>(parts.significand) << shift;
      } else if (-shift < 64) {
        magnitude = parts.significand >> -shift;
      }
      sum += parts.negative ? -static_cast<int128>(magnitude) : static_cast<int128>(magnitude);
    };
    add(static_cast<double>(accumulator));
    for (int i = 0; i < count; ++i) add(products[i]);
    const bool negative = sum < 0;
    const uint128 magnitude = negative ? -static_cast<uint128>(sum) : static_cast<uint128>(sum);
    return round_scaled_integer(magnitude, negative, unit, target, toward_zero);
  }
  long_accumulator total;
  total.add(truncate_to_multiple(static_cast<double>(accumulator), unit));
  for (int i = 0; i < count; ++i) total.add(truncate_to_multiple(products[i], unit));
  return round_long_accumulator(total, target, toward_zero);
}

// One group of the trunc-align model: the accumulator and the group's products (all finite) are
// aligned to the largest exponent E among the nonzero ones, each is truncated toward zero to a
// multiple of 2^(E - fraction_bits), the truncated terms are summed exactly, and the sum is
// rounded to fp32 by `mode`.
MXSCOPE_HD constexpr float trunc_align_sum(float accumulator, const double* products, int count, int fraction_bits,
                                           alignment_rounding mode) {
  int leading = -2000;
  if (accumulator != 0.0f) leading = floor_log2(accumulator < 0.0f ? -accumulator : accumulator);
  for (int i = 0; i < count; ++i) {
    const double product = products[i];
    if (product != 0.0) {
      const int product_leading = floor_log2(product < 0.0 ? -product : product);
      if (product_leading > leading) leading = product_leading;
    }
  }
  if (leading == -2000) return 0.0f;
  const int unit = leading - fraction_bits;
  // Each truncated term is an integer multiple of 2^unit below 2^(fraction_bits + 1) in magnitude.
  return static_cast<float>(sum_truncated_terms(accumulator, products, count, unit, fraction_bits + 1, binary32,
                                                mode == alignment_rounding::rtz));
}

// One step of the trunc-promote model. The inner accumulator and the step's products (all finite)
// are aligned to E, the largest of the accumulator's leading exponent and the products' exponent
// sums (exponents[i] = floor(log2 |x|) + floor(log2 |y|) for the product x y; the product itself
// lies in [2^e, 2^(e+2))); each is truncated toward zero to a multiple of 2^(E - fraction_bits),
// the truncated terms are summed exactly, and the sum is truncated toward zero to `step_bits`
// significant bits within fp32's exponent range (subnormal spacing 2^-149; past the largest binade
// it stays at the largest finite value of that width). Zero terms and zero products take no part
// in E; an exactly zero sum is +0.
MXSCOPE_HD constexpr float trunc_promote_step(float accumulator, const double* products, const int* exponents,
                                              int count, int fraction_bits, int step_bits) {
  int leading = -2000;
  if (accumulator != 0.0f) leading = floor_log2(accumulator < 0.0f ? -accumulator : accumulator);
  for (int i = 0; i < count; ++i) {
    if (products[i] != 0.0 && exponents[i] > leading) leading = exponents[i];
  }
  if (leading == -2000) return 0.0f;
  const int unit = leading - fraction_bits;
  const binary_format narrow{step_bits, binary32.min_exponent, binary32.max_exponent};
  // Each truncated term is below 2^(fraction_bits + 2) units of 2^unit (a product is below
  // 2^(e + 2), the accumulator below 2^(E + 1)).
  return static_cast<float>(
      sum_truncated_terms(accumulator, products, count, unit, fraction_bits + 2, narrow, /*toward_zero=*/true));
}

// Splits a finite double into high + low (exact) where high keeps the top `high_bits` bits of the
// significand: products of the halves with another short number stay exact in a double.
struct split_double {
  double high;
  double low;
};

MXSCOPE_HD constexpr split_double split_significand(double value, int high_bits) {
  if (value == 0.0) return {value, 0.0};
  const double_parts parts = decompose(value);
  const int length = 64 - __builtin_clzll(parts.significand);
  if (length <= high_bits) return {value, 0.0};
  const int dropped = length - high_bits;
  const std::uint64_t high_significand = (parts.significand >> dropped) << dropped;
  const double high = static_cast<double>(high_significand) * pow2(parts.exponent);
  const double signed_high = parts.negative ? -high : high;
  return {signed_high, value - signed_high};  // the difference is exact: it is the dropped bits
}

// Compile-time pins of the rounding helpers against values worked out by hand.
static_assert(round_scaled_integer(3, false, -1, binary32, false) == 1.5);
static_assert(round_scaled_integer((uint128{1} << 24) + 1, false, 0, binary32, false) == 16777216.0);  // tie to even
static_assert(round_scaled_integer((uint128{1} << 24) + 3, false, 0, binary32, false) == 16777220.0);  // tie to even (up)
static_assert(round_scaled_integer((uint128{1} << 24) + 3, false, 0, binary32, true) == 16777218.0);
static_assert(round_scaled_integer(1, true, -150, binary32, false) == 0.0);        // half the smallest subnormal: to even (0)
static_assert(round_scaled_integer(3, false, -151, binary32, false) == pow2(-149));  // 0.75 ulp rounds up
static_assert(round_scaled_integer(1, false, 128, binary32, false) == infinity());
static_assert(round_scaled_integer(1, false, 128, binary32, true) == largest_finite(binary32));
static_assert(truncate_to_multiple(-7.75, 0) == -7.0 && truncate_to_multiple(7.75, 1) == 6.0);
// trunc-promote, worked by hand: E = 3 (exponent sums of 1.875 * 4 and 0.0625 * 1 are 2 and -4; the
// accumulator 8 has leading exponent 3), unit 2^(3-4) = 0.5: 8 + 7.5 + 0 = 15.5 -> 4 bits: 15.
inline constexpr double trunc_promote_pin_products[2] = {7.5, 0.0625};
inline constexpr int trunc_promote_pin_exponents[2] = {2, -4};
static_assert(trunc_promote_step(8.0f, trunc_promote_pin_products, trunc_promote_pin_exponents, 2, 4, 4) == 15.0f);
static_assert(trunc_promote_step(-8.0f, trunc_promote_pin_products, trunc_promote_pin_exponents, 2, 4, 24) == -0.5f);

}  // namespace mxscope::core
