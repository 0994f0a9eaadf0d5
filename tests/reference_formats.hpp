// Test-side oracles for the element and scale formats, written from the OCP Microscaling v1.0 and
// OCP 8-bit floating point specifications (and NUMERICS.md section 1). Nothing here calls mxscope
// code: the tests compare the library against these tables and brute-force searches.
#pragma once

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "mxscope/core/formats.hpp"  // only for the element_kind enumerators that name the formats
#include "support/bits.hpp"

namespace reference {

// How a format lays out its codes, as the specifications describe them.
enum class code_layout {
  minifloat,        // sign | exponent field | mantissa field, subnormals at exponent field 0
  twos_complement,  // MXINT8: the code is a two's complement integer k, value k * 2^-6
  power_of_two,     // E8M0: value 2^(code - 127), no sign, no mantissa
};

// Which codes are not finite numbers.
enum class special_codes {
  none,              // every code is a finite number (fp4, fp6, int8)
  magnitude_all_ones_nan,  // OCP E4M3: S.1111.111 is NaN, there is no infinity
  ieee,              // OCP E5M2: exponent field all ones is infinity (mantissa 0) or NaN
  all_ones_nan,      // E8M0: 0xFF is NaN
  e4m3_unsigned,     // UE4M3 (NVFP4 scale): E4M3 rules, and a set sign bit is invalid (NaN)
};

struct format_description {
  mxscope::core::element_kind kind;
  const char* name;
  int bits;
  int exponent_bits;
  int mantissa_bits;
  int bias;
  code_layout layout;
  special_codes specials;
  bool is_signed;  // negative numbers are representable
  // Limits typed from the specification tables (not derived), used to pin the decoders.
  double max_normal;
  double min_subnormal;
  std::uint32_t max_code;  // the code of +max_normal
  int emax_elem;           // exponent of the largest power of two <= max normal
};

// OCP MX v1.0 section 5.3 (FP8 from the OCP 8-bit FP spec), MXINT8, E8M0, and NVFP4's UE4M3.
inline const std::vector<format_description>& all_formats() {
  using mxscope::core::element_kind;
  static const std::vector<format_description> formats = {
      {element_kind::fp4_e2m1, "fp4_e2m1", 4, 2, 1, 1, code_layout::minifloat, special_codes::none, true, 6.0, 0.5,
       0x7, 2},
      {element_kind::fp6_e2m3, "fp6_e2m3", 6, 2, 3, 1, code_layout::minifloat, special_codes::none, true, 7.5, 0.125,
       0x1F, 2},
      {element_kind::fp6_e3m2, "fp6_e3m2", 6, 3, 2, 3, code_layout::minifloat, special_codes::none, true, 28.0,
       0.0625, 0x1F, 4},
      {element_kind::fp8_e4m3, "fp8_e4m3", 8, 4, 3, 7, code_layout::minifloat, special_codes::magnitude_all_ones_nan,
       true, 448.0, 0x1p-9, 0x7E, 8},
      {element_kind::fp8_e5m2, "fp8_e5m2", 8, 5, 2, 15, code_layout::minifloat, special_codes::ieee, true, 57344.0,
       0x1p-16, 0x7B, 15},
      {element_kind::int8, "int8", 8, 0, 0, 0, code_layout::twos_complement, special_codes::none, true, 127.0 / 64.0,
       1.0 / 64.0, 0x7F, 0},
      {element_kind::e8m0, "e8m0", 8, 8, 0, 127, code_layout::power_of_two, special_codes::all_ones_nan, false,
       0x1p127, 0x1p-127, 0xFE, 127},
      {element_kind::ue4m3, "ue4m3", 8, 4, 3, 7, code_layout::minifloat, special_codes::e4m3_unsigned, false, 448.0,
       0x1p-9, 0x7E, 8},
  };
  return formats;
}

inline const format_description& describe(mxscope::core::element_kind kind) {
  for (const auto& format : all_formats()) {
    if (format.kind == kind) return format;
  }
  throw std::logic_error("unknown format");
}

// The element formats an MX block can use (the scale formats e8m0 and ue4m3 excluded).
inline std::vector<format_description> element_formats() {
  std::vector<format_description> out;
  for (const auto& format : all_formats()) {
    if (format.kind != mxscope::core::element_kind::e8m0 && format.kind != mxscope::core::element_kind::ue4m3) {
      out.push_back(format);
    }
  }
  return out;
}

inline std::uint32_t sign_bit(const format_description& format) { return 1U << (format.bits - 1); }

// Value of a code by the specification's formula:
//   exponent field E == 0: (-1)^S * 2^(1 - bias) * (0 + M / 2^m)      (subnormal)
//   otherwise:             (-1)^S * 2^(E - bias) * (1 + M / 2^m)      (normal)
// plus each format's NaN / infinity codes. std::ldexp and integer arithmetic only.
inline double decode(const format_description& format, std::uint32_t code) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  if (format.layout == code_layout::twos_complement) {
    const int k = code >= 128 ? static_cast<int>(code) - 256 : static_cast<int>(code);
    return std::ldexp(static_cast<double>(k), -6);
  }
  if (format.layout == code_layout::power_of_two) {
    if (code == 0xFF) return nan;
    return std::ldexp(1.0, static_cast<int>(code) - 127);
  }
  const int magnitude_bits = format.bits - 1;
  const bool negative = ((code >> magnitude_bits) & 1U) != 0;
  const std::uint32_t exponent_field = (code >> format.mantissa_bits) & ((1U << format.exponent_bits) - 1U);
  const std::uint32_t mantissa_field = code & ((1U << format.mantissa_bits) - 1U);
  const bool exponent_all_ones = exponent_field == (1U << format.exponent_bits) - 1U;
  const bool mantissa_all_ones = mantissa_field == (1U << format.mantissa_bits) - 1U;
  switch (format.specials) {
    case special_codes::none: break;
    case special_codes::e4m3_unsigned:
      if (negative) return nan;
      [[fallthrough]];
    case special_codes::magnitude_all_ones_nan:
      if (exponent_all_ones && mantissa_all_ones) return nan;
      break;
    case special_codes::ieee:
      if (exponent_all_ones) {
        if (mantissa_field != 0) return nan;
        return negative ? -std::numeric_limits<double>::infinity() : std::numeric_limits<double>::infinity();
      }
      break;
    case special_codes::all_ones_nan: break;
  }
  const double fraction = static_cast<double>(mantissa_field) / static_cast<double>(1U << format.mantissa_bits);
  const double magnitude = exponent_field == 0
                               ? std::ldexp(fraction, 1 - format.bias)
                               : std::ldexp(1.0 + fraction, static_cast<int>(exponent_field) - format.bias);
  return negative ? -magnitude : magnitude;
}

// One representable non-negative value and the code that holds it.
struct table_entry {
  double value;
  std::uint32_t code;
};

// Every finite non-negative value of the format, ascending, with its non-negative code. For int8
// the symmetric clamp of MXINT8 limits the magnitudes to 0..127/64 (code 0x80 = -2 is never produced).
inline std::vector<table_entry> magnitude_table(const format_description& format) {
  std::vector<table_entry> table;
  const std::uint32_t code_count = 1U << format.bits;
  for (std::uint32_t code = 0; code < code_count; ++code) {
    if (format.layout == code_layout::twos_complement && code > 127) continue;
    if (format.layout == code_layout::minifloat && (code & sign_bit(format)) != 0) continue;
    const double value = decode(format, code);
    if (std::isnan(value) || std::isinf(value) || value < 0.0) continue;
    table.push_back({value, code});
  }
  std::sort(table.begin(), table.end(), [](const table_entry& a, const table_entry& b) { return a.value < b.value; });
  return table;
}

enum class rounding { rne, rna, rtz };

inline const char* rounding_label(rounding mode) {
  switch (mode) {
    case rounding::rne: return "rne";
    case rounding::rna: return "rna";
    case rounding::rtz: return "rtz";
  }
  return "?";
}

struct expected_encoding {
  std::uint32_t code;
  double value;  // the signed value of `code`
  bool saturated;
  bool flushed;
};

// The sign-and-magnitude (or two's complement) code of a signed result.
inline std::uint32_t signed_code(const format_description& format, bool negative, std::uint32_t magnitude_code) {
  if (!negative) return magnitude_code;
  if (format.layout == code_layout::twos_complement) return (256U - magnitude_code) & 0xFFU;  // no negative zero
  return magnitude_code | sign_bit(format);
}

// Brute-force rounding of |x| / divisor onto the table (divisor > 0; 1 for a plain encode). The
// search never divides: it compares |x| with table values and midpoints multiplied by the divisor,
// which is exact in a double for power-of-two divisors and for fp32 divisors (<= 24 + 9 bits).
//   rtz: the largest table value <= |x| / divisor;  rne / rna: the nearest, ties to the even code
//   (code LSB 0, i.e. even mantissa or even integer) or away from zero; beyond the largest value:
//   the largest value (saturation). Negative inputs keep their sign (a negative zero for floats).
inline expected_encoding round_to_table(const format_description& format, const std::vector<table_entry>& table,
                                        double x, rounding mode, double divisor = 1.0) {
  const bool negative = std::signbit(x);
  const double magnitude = std::fabs(x);
  const double largest = table.back().value * divisor;
  std::size_t chosen = table.size() - 1;
  if (magnitude < largest) {
    // First entry whose scaled value exceeds the magnitude; the one before it is <= magnitude.
    const auto above = std::upper_bound(table.begin(), table.end(), magnitude,
                                        [divisor](double m, const table_entry& e) { return m < e.value * divisor; });
    const std::size_t below_index = static_cast<std::size_t>(above - table.begin()) - 1;
    const std::size_t above_index = below_index + 1;
    if (mode == rounding::rtz) {
      chosen = below_index;
    } else {
      const double midpoint = (table[below_index].value + table[above_index].value) / 2.0 * divisor;
      if (magnitude < midpoint) {
        chosen = below_index;
      } else if (magnitude > midpoint) {
        chosen = above_index;
      } else if (mode == rounding::rna) {
        chosen = above_index;
      } else {
        chosen = (table[below_index].code & 1U) == 0 ? below_index : above_index;
      }
    }
  }
  expected_encoding result{};
  result.code = signed_code(format, negative, table[chosen].code);
  result.value = negative ? -table[chosen].value : table[chosen].value;
  result.saturated = magnitude > largest;
  result.flushed = magnitude != 0.0 && table[chosen].value == 0.0;
  return result;
}

using mxscope::testing::bits_of;  // support/bits.hpp
inline float float_from_bits(std::uint32_t bits) {
  float value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
}

// "1.5 (0x3ff8000000000000)": a value and its bits, for failure messages.
inline std::string show(double value) { return fmt::format("{} ({:#018x})", value, bits_of(value)); }
inline std::string show(float value) { return fmt::format("{}f ({:#010x})", value, bits_of(value)); }

// Same value and same sign (so -0 differs from +0); NaN matches NaN.
inline bool same_value(double a, double b) {
  if (std::isnan(a) || std::isnan(b)) return std::isnan(a) && std::isnan(b);
  return bits_of(a) == bits_of(b);
}
inline bool same_value(float a, float b) {
  if (std::isnan(a) || std::isnan(b)) return std::isnan(a) && std::isnan(b);
  return bits_of(a) == bits_of(b);
}

}  // namespace reference
