// Test-side exact arithmetic for the GEMM and accumulation tests: values are Boost.Multiprecision
// integers in units of 2^-fraction_bits (a fixed point wide enough for every product of two
// doubles the tests form), and rounding to fp32 / fp64 is written here from the IEEE 754 rules.
// Nothing in this file calls mxscope code.
#pragma once

#include <boost/multiprecision/cpp_int.hpp>
#include <fmt/format.h>

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>

namespace oracle {

using boost::multiprecision::cpp_int;

// Every double is an integer multiple of 2^-1074, and the tests only multiply values of magnitude
// at least 2^-600, so 2^-1200 units hold every value exactly.
inline constexpr int fraction_bits = 1200;

// The exact value of a finite double, in units of 2^-fraction_bits.
inline cpp_int from_double(double value) {
  if (!std::isfinite(value)) throw std::invalid_argument("oracle::from_double: not finite");
  if (value == 0.0) return 0;
  int exponent = 0;
  const double fraction = std::frexp(std::fabs(value), &exponent);  // |value| = fraction * 2^exponent
  const auto significand = static_cast<std::uint64_t>(std::ldexp(fraction, 53));  // exact, 53 bits
  cpp_int magnitude = significand;
  magnitude <<= (exponent - 53 + fraction_bits);
  return value < 0.0 ? cpp_int(-magnitude) : magnitude;
}

// The exact product of two finite doubles, in units of 2^-fraction_bits (throws if it is not a
// multiple of that unit, which the tests never ask for).
inline cpp_int product(double a, double b) {
  const cpp_int left = from_double(std::fabs(a));
  const cpp_int right = from_double(std::fabs(b));
  const cpp_int full = left * right;  // units of 2^-2 fraction_bits
  const cpp_int unit = cpp_int(1) << fraction_bits;
  if (full % unit != 0) throw std::invalid_argument("oracle::product: below the fixed-point unit");
  const cpp_int magnitude = full / unit;
  return ((a < 0.0) != (b < 0.0)) ? cpp_int(-magnitude) : magnitude;
}

struct binary_format {
  int precision;
  int min_exponent;  // exponent of the smallest subnormal
  int max_exponent;  // exponent of the largest binade
};
inline constexpr binary_format fp32{24, -149, 127};
inline constexpr binary_format fp64{53, -1074, 1023};

inline double largest(binary_format format) {
  return std::ldexp(std::ldexp(1.0, format.precision) - 1.0, format.max_exponent - format.precision + 1);
}

// value * 2^-fraction_bits rounded to `format`: to nearest with ties to even, or toward zero.
// Exact zero gives +0; a nonzero value that rounds to zero keeps its sign; overflow gives inf
// (nearest) or the largest finite value (toward zero).
inline double round_to(const cpp_int& value, binary_format format, bool toward_zero = false) {
  if (value == 0) return 0.0;
  const bool negative = value < 0;
  const cpp_int magnitude = negative ? cpp_int(-value) : value;
  const int top = static_cast<int>(boost::multiprecision::msb(magnitude));
  const int leading = top - fraction_bits;
  const double sign = negative ? -1.0 : 1.0;
  if (leading > format.max_exponent) return sign * (toward_zero ? largest(format) : INFINITY);
  int unit = leading - format.precision + 1;
  if (unit < format.min_exponent) unit = format.min_exponent;
  const int dropped = unit + fraction_bits;  // >= 1 for both formats
  cpp_int kept = magnitude >> dropped;
  const cpp_int remainder = magnitude - (kept << dropped);
  if (!toward_zero) {
    const cpp_int half = cpp_int(1) << (dropped - 1);
    if (remainder > half || (remainder == half && (kept & 1) != 0)) kept += 1;
  }
  const double result = std::ldexp(static_cast<double>(kept.convert_to<std::uint64_t>()), unit);
  if (result > largest(format)) return sign * INFINITY;
  return sign * result;
}

inline float round_to_float(const cpp_int& value, bool toward_zero = false) {
  return static_cast<float>(round_to(value, fp32, toward_zero));
}
inline double round_to_double(const cpp_int& value) { return round_to(value, fp64); }

// floor(log2 |value|) of a nonzero fixed-point value.
inline int leading_exponent(const cpp_int& value) {
  const cpp_int magnitude = value < 0 ? cpp_int(-value) : value;
  return static_cast<int>(boost::multiprecision::msb(magnitude)) - fraction_bits;
}

// value truncated toward zero to a multiple of 2^unit.
inline cpp_int truncate_toward_zero(const cpp_int& value, int unit) {
  const int shift = unit + fraction_bits;
  if (shift <= 0) return value;
  const bool negative = value < 0;
  const cpp_int magnitude = negative ? cpp_int(-value) : value;
  const cpp_int truncated = (magnitude >> shift) << shift;
  return negative ? cpp_int(-truncated) : truncated;
}

inline std::uint32_t bits_of(float value) {
  std::uint32_t bits = 0;
  std::memcpy(&bits, &value, sizeof bits);
  return bits;
}
inline std::uint64_t bits_of(double value) {
  std::uint64_t bits = 0;
  std::memcpy(&bits, &value, sizeof bits);
  return bits;
}

inline std::string show(float value) { return fmt::format("{:.9g} ({:#010x})", value, bits_of(value)); }
inline std::string show(double value) { return fmt::format("{:.17g} ({:#018x})", value, bits_of(value)); }

// Bit-identical, where every NaN equals every NaN.
inline bool same(float a, float b) { return (std::isnan(a) && std::isnan(b)) || bits_of(a) == bits_of(b); }
inline bool same(double a, double b) { return (std::isnan(a) && std::isnan(b)) || bits_of(a) == bits_of(b); }

}  // namespace oracle
