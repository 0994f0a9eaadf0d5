// Exact summation: the error-free transforms and the long accumulator that every "exact" result
// of mxscope rests on (accumulation model `exact`, the `exact` reference, trunc-align groups).
//
// - two_sum: s + e == a + b exactly (Knuth), for finite a, b without overflow.
// - add_to_float: fl32(acc + v) correctly rounded for any double v, via round-to-odd: the double
//   sum is made "sticky" in its last bit when inexact, and 53 >= 24 + 2 bits makes the final RNE to
//   fp32 equal to rounding the exact sum (Boldo & Melquiond, "Emulation of FMA and correctly
//   rounded sums: proved algorithms using rounding to odd").
// - long_accumulator: a fixed-point register wide enough for every finite double (2^-1074 ..
//   2^1024), held as signed 32-bit digits in 64-bit limbs so additions carry lazily. It adds any
//   finite double exactly and rounds the total once, correctly, to fp64 or fp32.
#pragma once

#include "mxscope/core/formats.hpp"

namespace mxscope::core {

struct sum_and_error {
  double sum;
  double error;
};

MXSCOPE_HD constexpr sum_and_error two_sum(double a, double b) {
  const double sum = a + b;
  const double b_virtual = sum - a;
  const double a_virtual = sum - b_virtual;
  return {sum, (a - a_virtual) + (b - b_virtual)};
}

// The double nearest to a + b in round-to-odd: exact sums stay; inexact ones get an odd last bit.
MXSCOPE_HD constexpr double round_to_odd_sum(double a, double b) {
  const sum_and_error se = two_sum(a, b);
  if (se.error == 0.0) return se.sum;
  std::uint64_t bits = double_bits(se.sum);
  if ((bits & 1U) == 0U) {
    // Step one ulp toward the exact value: magnitude grows if the error has the sum's sign.
    const bool same_sign = (se.error > 0.0) == (se.sum > 0.0);
    bits = same_sign ? bits + 1U : bits - 1U;
  }
  return bits_double(bits);
}

// Round-to-odd from the two directed roundings of one exact value (round-down `down` and round-up
// `up`, as two fmas on the GPU give them): they are equal where the value is a double, and
// neighbours otherwise, exactly one of them odd, which is the round-to-odd result. So: the
// round-down where its last bit is set, else the round-up. An exact zero gives the round-up
// (+0 for x - x, whose round-down is -0).
MXSCOPE_HD constexpr double round_to_odd_from_neighbours(double down, double up) {
  return (double_bits(down) & 1U) != 0 ? down : up;
}

// Round a double to fp32 with round-to-nearest-even (the hardware conversion; no libm).
MXSCOPE_HD constexpr float double_to_float_rne(double v) { return static_cast<float>(v); }

// fl32(acc + v): the exactly rounded fp32 sum of an fp32 accumulator and any finite double.
//
// Fast path: s = fl64(acc + v), then s rounded to fp32. Rounding twice differs from rounding the
// exact sum x once only when s is exactly a midpoint m of two adjacent fp32 numbers: m is a double
// (25 bits), rounding is monotone, so x < m implies s <= m and x > m implies s >= m; x and s are
// never on opposite sides of m. For |s| >= 2^-126 (fp32's normal range and the overflow threshold
// 2^128 - 2^103) a midpoint has the 29 low significand bits of a double equal to 1 followed by 28
// zeros; s with that pattern, and |s| < 2^-126 (fp32's subnormal grid, exact zeros), take the
// round-to-odd sum, which is correct everywhere.
MXSCOPE_HD constexpr float add_to_float(float acc, double v) {
  const double s = static_cast<double>(acc) + v;
  const std::uint64_t bits = double_bits(s);
  constexpr std::uint64_t below_fp32_ulp = (std::uint64_t{1} << 29) - 1U;
  constexpr std::uint64_t fp32_midpoint = std::uint64_t{1} << 28;
  constexpr std::uint64_t fp32_min_normal = std::uint64_t{1023 - 126} << 52;  // 2^-126
  if ((bits & below_fp32_ulp) != fp32_midpoint && (bits & 0x7fffffffffffffffULL) >= fp32_min_normal) {
    return static_cast<float>(s);
  }
  return static_cast<float>(round_to_odd_sum(static_cast<double>(acc), v));
}

class long_accumulator {
 public:
  // Digit i holds weight 2^(32 * i + lowest_exponent). 2^-1074 .. 2^1024 plus carry room.
  static constexpr int lowest_exponent = -1088;  // multiple of 32 below -1074
  static constexpr int digit_count = 70;         // 70 * 32 = 2240 bits, up to 2^1152

  MXSCOPE_HD constexpr long_accumulator() : digits_{}, pending_(0) {}

  MXSCOPE_HD constexpr void clear() {
    for (int i = 0; i < digit_count; ++i) digits_[i] = 0;
    pending_ = 0;
  }

  // Adds a finite double exactly.
  MXSCOPE_HD constexpr void add(double value) {
    if (value == 0.0) return;
    const std::uint64_t bits = double_bits(value);
    const bool negative = (bits >> 63) != 0;
    const int exponent_field = static_cast<int>((bits >> 52) & 0x7ffU);
    std::uint64_t mantissa = bits & 0x000fffffffffffffULL;
    int exponent = 0;  // value = mantissa * 2^exponent
    if (exponent_field == 0) {
      exponent = -1074;
    } else {
      mantissa |= 0x0010000000000000ULL;
      exponent = exponent_field - 1075;
    }
    const int offset = exponent - lowest_exponent;
    const int digit = offset / 32;
    const int shift = offset % 32;
    // mantissa << shift spans at most 53 + 31 = 84 bits: three 32-bit digits.
    const std::uint64_t low = (mantissa << shift) & 0xffffffffULL;
    const std::uint64_t middle = shift == 0 ? (mantissa >> 32) & 0xffffffffULL
                                            : ((mantissa >> (32 - shift)) & 0xffffffffULL);
    const std::uint64_t high = shift == 0 ? 0 : (mantissa >> (64 - shift));
    const std::int64_t sign = negative ? -1 : 1;
    digits_[digit] += sign * static_cast<std::int64_t>(low);
    digits_[digit + 1] += sign * static_cast<std::int64_t>(middle);
    digits_[digit + 2] += sign * static_cast<std::int64_t>(high);
    if (++pending_ >= (1LL << 30)) normalize();
  }

  // Adds the exact product of two fp32 values (exact in a double: 24 + 24 bits).
  MXSCOPE_HD constexpr void add_product(float a, float b) { add(static_cast<double>(a) * static_cast<double>(b)); }

  MXSCOPE_HD constexpr void add(const long_accumulator& other) {
    for (int i = 0; i < digit_count; ++i) digits_[i] += other.digits_[i];
    pending_ += other.pending_ + 1;
    if (pending_ >= (1LL << 30)) normalize();
  }

  MXSCOPE_HD constexpr bool is_zero() const {
    long_accumulator copy = *this;
    copy.normalize();
    for (int i = 0; i < digit_count; ++i) {
      if (copy.digits_[i] != 0) return false;
    }
    return true;
  }

  // The exact total rounded once to nearest-even in a format with `precision` significand bits
  // and smallest (subnormal) exponent `min_exponent` (value = integer * 2^min_exponent at the
  // bottom). Overflow gives +-inf.
  MXSCOPE_HD constexpr double round(int precision, int min_exponent, int max_exponent) const {
    long_accumulator copy = *this;
    copy.normalize();
    bool negative = copy.digits_[digit_count - 1] < 0;
    if (negative) copy.negate();
    int top = digit_count - 1;
    while (top >= 0 && copy.digits_[top] == 0) --top;
    if (top < 0) return 0.0;
    // Bit position (absolute exponent) of the leading one.
    const std::uint64_t top_digit = static_cast<std::uint64_t>(copy.digits_[top]);
    const int leading_bit = 63 - __builtin_clzll(top_digit);
    const int leading_exponent = lowest_exponent + 32 * top + leading_bit;
    // The last kept bit has exponent max(leading - precision + 1, min_exponent).
    int unit_exponent = leading_exponent - precision + 1;
    if (unit_exponent < min_exponent) unit_exponent = min_exponent;
    if (leading_exponent > max_exponent) return negative ? -infinity() : infinity();
    // Extract kept = floor(total / 2^unit), then the rounding bit and sticky bits below it.
    std::uint64_t kept = 0;
    for (int e = leading_exponent; e >= unit_exponent; --e) kept = (kept << 1) | copy.bit(e);
    const std::uint64_t round_bit = copy.bit(unit_exponent - 1);
    const bool sticky = copy.any_bits_below(unit_exponent - 1);
    if (round_bit != 0 && (sticky || (kept & 1U) != 0)) ++kept;
    double magnitude = static_cast<double>(kept) * pow2(unit_exponent);
    if (leading_exponent + 1 > max_exponent && magnitude >= pow2(max_exponent + 1)) {
      magnitude = infinity();
    }
    return negative ? -magnitude : magnitude;
  }

  MXSCOPE_HD constexpr double round_to_double() const { return round(53, -1074, 1023); }
  MXSCOPE_HD constexpr float round_to_float() const { return static_cast<float>(round(24, -149, 127)); }

 private:
  // Makes every digit but the top one lie in [0, 2^32) (the top one keeps the sign).
  MXSCOPE_HD constexpr void normalize() {
    for (int i = 0; i < digit_count - 1; ++i) {
      const std::int64_t carry = digits_[i] >> 32;  // arithmetic shift: floor division
      digits_[i] -= carry * (1LL << 32);
      digits_[i + 1] += carry;
    }
    pending_ = 0;
  }

  // Two's-complement negation of a normalized value whose top digit is negative.
  MXSCOPE_HD constexpr void negate() {
    for (int i = 0; i < digit_count; ++i) digits_[i] = -digits_[i];
    normalize();
  }

  MXSCOPE_HD constexpr std::uint64_t bit(int exponent) const {
    const int offset = exponent - lowest_exponent;
    if (offset < 0) return 0;
    return (static_cast<std::uint64_t>(digits_[offset / 32]) >> (offset % 32)) & 1U;
  }

  MXSCOPE_HD constexpr bool any_bits_below(int exponent) const {
    const int offset = exponent - lowest_exponent;
    if (offset <= 0) return false;
    const int digit = offset / 32;
    const int shift = offset % 32;
    if (shift != 0 && (static_cast<std::uint64_t>(digits_[digit]) & ((1ULL << shift) - 1U)) != 0) return true;
    for (int i = 0; i < digit; ++i) {
      if (digits_[i] != 0) return true;
    }
    return false;
  }

  std::int64_t digits_[digit_count];
  std::int64_t pending_;
};

}  // namespace mxscope::core
