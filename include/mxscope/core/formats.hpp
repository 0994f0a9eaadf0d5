// Element and scale formats of OCP Microscaling v1.0 plus the NVFP4 scale format.
//
// One constexpr table (format_table) is the single source of truth. Everything else (masks,
// maximum codes, limits, decode and encode) is derived from a row of it, and the derived numbers
// are pinned against the spec with static_asserts at the bottom of this file.
#pragma once

#include "mxscope/core/config.hpp"

namespace mxscope::core {

enum class element_kind : std::uint8_t {
  fp4_e2m1,
  fp6_e2m3,
  fp6_e3m2,
  fp8_e4m3,
  fp8_e5m2,
  int8,   // MXINT8: two's complement k * 2^-6, |k| <= 127 (symmetric)
  e8m0,   // MX shared scale: 2^(code - 127), 0xFF = NaN, unsigned, no zero
  ue4m3,  // NVFP4 block scale: e4m3 with the sign bit fixed at 0
};
inline constexpr int element_kind_count = 8;

// How a format spends its top codes.
enum class special_encoding : std::uint8_t {
  none,          // every code is finite (fp4, fp6, int8)
  nan_all_ones,  // magnitude all ones is NaN, no infinity (OCP e4m3 "fn", ue4m3)
  ieee,          // exponent all ones is inf (mantissa 0) or NaN (e5m2)
  nan_ff,        // 0xFF is NaN (e8m0)
};

struct format_spec {
  element_kind kind;
  const char* name;
  int bits;            // storage width of one code
  int exponent_bits;   // 0 for int8
  int mantissa_bits;   // for int8: bits below the leading one at the top binade (6)
  int bias;            // exponent bias; for int8 the fixed point position (6 => value = k * 2^-6)
  bool has_sign_bit;      // the top bit of the code is a sign bit
  bool allows_negative;   // false for scale formats (ue4m3 keeps the sign bit at 0)
  bool is_integer;
  special_encoding specials;
};

// The rows of the table. A switch rather than an indexed array so that device code (CUDA, HIP),
// which cannot index a host constexpr array at run time, reads the same rows as the host.
MXSCOPE_HD constexpr format_spec format_row(element_kind kind) {
  switch (kind) {
    case element_kind::fp4_e2m1: return {element_kind::fp4_e2m1, "fp4_e2m1", 4, 2, 1, 1, true, true, false, special_encoding::none};
    case element_kind::fp6_e2m3: return {element_kind::fp6_e2m3, "fp6_e2m3", 6, 2, 3, 1, true, true, false, special_encoding::none};
    case element_kind::fp6_e3m2: return {element_kind::fp6_e3m2, "fp6_e3m2", 6, 3, 2, 3, true, true, false, special_encoding::none};
    case element_kind::fp8_e4m3: return {element_kind::fp8_e4m3, "fp8_e4m3", 8, 4, 3, 7, true, true, false, special_encoding::nan_all_ones};
    case element_kind::fp8_e5m2: return {element_kind::fp8_e5m2, "fp8_e5m2", 8, 5, 2, 15, true, true, false, special_encoding::ieee};
    case element_kind::int8: return {element_kind::int8, "int8", 8, 0, 6, 6, true, true, true, special_encoding::none};
    case element_kind::e8m0: return {element_kind::e8m0, "e8m0", 8, 8, 0, 127, false, false, false, special_encoding::nan_ff};
    case element_kind::ue4m3: break;
  }
  return {element_kind::ue4m3, "ue4m3", 8, 4, 3, 7, true, false, false, special_encoding::nan_all_ones};
}

inline constexpr format_spec format_table[element_kind_count] = {
    format_row(element_kind::fp4_e2m1), format_row(element_kind::fp6_e2m3), format_row(element_kind::fp6_e3m2),
    format_row(element_kind::fp8_e4m3), format_row(element_kind::fp8_e5m2), format_row(element_kind::int8),
    format_row(element_kind::e8m0),     format_row(element_kind::ue4m3),
};

// By value: a row is a few bytes, and a copy is what device code can use.
MXSCOPE_HD constexpr format_spec spec(element_kind kind) { return format_row(kind); }

// ---------------------------------------------------------------------------------------------
// Exact power-of-two and binade helpers on doubles (no libm: usable in constexpr and on device).

// 2^e as a double, exact for -1074 <= e <= 1023.
MXSCOPE_HD constexpr double pow2(int e) {
  if (e >= -1022) return bits_double(static_cast<std::uint64_t>(e + 1023) << 52);
  return bits_double(std::uint64_t{1} << (e + 1074));
}

// floor(log2(a)) for finite a > 0, exact, read from the bits (subnormals from the leading bit).
MXSCOPE_HD constexpr int floor_log2(double a) {
  const std::uint64_t bits = double_bits(a) & 0x7fffffffffffffffULL;
  const int exponent_field = static_cast<int>(bits >> 52);
  if (exponent_field != 0) return exponent_field - 1023;
  const std::uint64_t mantissa = bits & 0x000fffffffffffffULL;
  return -1074 + (63 - __builtin_clzll(mantissa));
}

// floor(log2(a)) for a positive finite fp32 value, from its bits.
MXSCOPE_HD constexpr int floor_log2(float a) {
  const std::uint32_t bits = float_bits(a) & 0x7fffffffU;
  const int exponent_field = static_cast<int>(bits >> 23);
  if (exponent_field != 0) return exponent_field - 127;
  return -149 + (31 - __builtin_clz(bits & 0x007fffffU));
}

MXSCOPE_HD constexpr bool is_nan(double v) { return v != v; }
MXSCOPE_HD constexpr double quiet_nan() { return bits_double(0x7ff8000000000000ULL); }
MXSCOPE_HD constexpr double infinity() { return bits_double(0x7ff0000000000000ULL); }
MXSCOPE_HD constexpr bool is_inf(double v) { return v == infinity() || v == -infinity(); }

// ---------------------------------------------------------------------------------------------
// Derived parameters.

MXSCOPE_HD constexpr std::uint32_t magnitude_mask(element_kind kind) {
  const auto& f = spec(kind);
  return f.has_sign_bit ? (1U << (f.bits - 1)) - 1U : (1U << f.bits) - 1U;
}
MXSCOPE_HD constexpr std::uint32_t sign_bit(element_kind kind) {
  const auto& f = spec(kind);
  return f.has_sign_bit ? 1U << (f.bits - 1) : 0U;
}

// The largest finite magnitude code.
MXSCOPE_HD constexpr std::uint32_t max_finite_code(element_kind kind) {
  const auto& f = spec(kind);
  if (f.is_integer) return 127U;
  switch (f.specials) {
    case special_encoding::none: return magnitude_mask(kind);
    case special_encoding::nan_all_ones: return magnitude_mask(kind) - 1U;
    case special_encoding::ieee: return (((1U << f.exponent_bits) - 2U) << f.mantissa_bits) | ((1U << f.mantissa_bits) - 1U);
    case special_encoding::nan_ff: return 0xFEU;
  }
  return 0U;
}

// Smallest exponent of a normal value (1 - bias); for int8 the exponent of its unit (-6). E8M0 has
// no subnormals: its exponent field 0 is the normal value 2^-127.
MXSCOPE_HD constexpr int min_normal_exponent(element_kind kind) {
  const auto& f = spec(kind);
  return (f.is_integer || f.specials == special_encoding::nan_ff) ? -f.bias : 1 - f.bias;
}

// Exponent of the spacing between neighbouring values below the min normal (and of int8's grid).
MXSCOPE_HD constexpr int subnormal_ulp_exponent(element_kind kind) {
  const auto& f = spec(kind);
  return f.is_integer ? -f.bias : min_normal_exponent(kind) - f.mantissa_bits;
}

// Value of a code, exact, as a double. NaN codes give NaN, infinity codes +-inf.
MXSCOPE_HD constexpr double decode(element_kind kind, std::uint32_t code) {
  const auto& f = spec(kind);
  code &= (1U << f.bits) - 1U;
  if (f.is_integer) {
    const int k = code >= 128U ? static_cast<int>(code) - 256 : static_cast<int>(code);
    return static_cast<double>(k) * pow2(-f.bias);
  }
  if (f.specials == special_encoding::nan_ff) {
    return code == 0xFFU ? quiet_nan() : pow2(static_cast<int>(code) - f.bias);
  }
  const bool negative = (code & sign_bit(kind)) != 0;
  if (negative && !f.allows_negative) return quiet_nan();  // a set sign bit is invalid in ue4m3
  const std::uint32_t magnitude = code & magnitude_mask(kind);
  const std::uint32_t exponent_field = magnitude >> f.mantissa_bits;
  const std::uint32_t mantissa = magnitude & ((1U << f.mantissa_bits) - 1U);
  double value = 0.0;
  if (f.specials == special_encoding::nan_all_ones && magnitude == magnitude_mask(kind)) return quiet_nan();
  if (f.specials == special_encoding::ieee && exponent_field == (1U << f.exponent_bits) - 1U) {
    if (mantissa != 0) return quiet_nan();
    value = infinity();
  } else if (exponent_field == 0) {
    value = static_cast<double>(mantissa) * pow2(subnormal_ulp_exponent(kind));
  } else {
    value = static_cast<double>((1U << f.mantissa_bits) | mantissa) *
            pow2(static_cast<int>(exponent_field) - f.bias - f.mantissa_bits);
  }
  return negative ? -value : value;
}

MXSCOPE_HD constexpr double max_normal(element_kind kind) { return decode(kind, max_finite_code(kind)); }
MXSCOPE_HD constexpr double min_subnormal(element_kind kind) { return pow2(subnormal_ulp_exponent(kind)); }
MXSCOPE_HD constexpr double min_normal(element_kind kind) { return pow2(min_normal_exponent(kind)); }

// Exponent of the largest power of two <= max normal (OCP's emax_elem).
MXSCOPE_HD constexpr int emax_elem(element_kind kind) { return floor_log2(max_normal(kind)); }

MXSCOPE_HD constexpr bool has_nan(element_kind kind) { return spec(kind).specials != special_encoding::none; }
MXSCOPE_HD constexpr std::uint32_t nan_code(element_kind kind) {
  switch (spec(kind).specials) {
    case special_encoding::nan_all_ones: return magnitude_mask(kind);
    case special_encoding::ieee: return magnitude_mask(kind);  // S.11111.11
    case special_encoding::nan_ff: return 0xFFU;
    case special_encoding::none: return 0U;
  }
  return 0U;
}

// ---------------------------------------------------------------------------------------------
// Rounding (NUMERICS.md section 3).

enum class rounding_mode : std::uint8_t { rne, rna, rtz, sr };

struct encoded {
  std::uint8_t code;
  bool saturated;  // |input| > max normal: clipped
  bool flushed;    // input nonzero, result zero
};

// Rounds the non-negative value q = I + F (integer I, 0 <= F < 1, both exact in a double) to an
// integer under `mode`. For `sr`, random_word's top sr_bits bits are the uniform draw r and the
// value rounds up iff floor(F * 2^R) + r >= 2^R.
MXSCOPE_HD constexpr std::uint64_t round_to_integer(double q, rounding_mode mode, std::uint32_t random_word,
                                                    int sr_bits) {
  const std::uint64_t integer = static_cast<std::uint64_t>(q);
  const double fraction = q - static_cast<double>(integer);
  bool up = false;
  switch (mode) {
    case rounding_mode::rne: up = fraction > 0.5 || (fraction == 0.5 && (integer & 1U) != 0); break;
    case rounding_mode::rna: up = fraction >= 0.5; break;
    case rounding_mode::rtz: up = false; break;
    case rounding_mode::sr: {
      const std::uint64_t top_fraction = static_cast<std::uint64_t>(fraction * pow2(sr_bits));
      const std::uint64_t draw = static_cast<std::uint64_t>(random_word) >> (32 - sr_bits);
      up = top_fraction + draw >= (std::uint64_t{1} << sr_bits);
      break;
    }
  }
  return integer + (up ? 1U : 0U);
}

// Encodes a value that is already divided by its block scale (exactly, in a double) into `kind`,
// rounding by `mode` and saturating at +-max normal. Never produces inf; NaN input gives the NaN
// code for formats that have one and code 0 otherwise (the MX block marks such a block NaN through
// its scale). Unsigned formats encode |value| of negative inputs as zero.
MXSCOPE_HD constexpr encoded encode(element_kind kind, double value, rounding_mode mode = rounding_mode::rne,
                                    std::uint32_t random_word = 0, int sr_bits = 32) {
  const auto& f = spec(kind);
  if (is_nan(value)) return {static_cast<std::uint8_t>(nan_code(kind)), false, false};
  const bool negative = double_bits(value) >> 63 != 0;
  if (!f.allows_negative && negative) return {0, false, value != 0.0};
  const double magnitude = negative ? -value : value;
  const double maximum = max_normal(kind);
  const bool saturated = magnitude > maximum;

  std::uint32_t result_magnitude = max_finite_code(kind);
  // At or beyond twice the maximum every mode gives the maximum; skipping the arithmetic there also
  // keeps the integer conversions below in range for infinities and huge int8 inputs.
  if (!(magnitude >= 2.0 * maximum)) {
    const int ulp_exponent = (f.is_integer || magnitude < min_normal(kind))
                                 ? subnormal_ulp_exponent(kind)
                                 : floor_log2(magnitude) - f.mantissa_bits;
    // Saturated finite values stay in this path so sr can round them (always to max).
    const double scaled = magnitude * pow2(-ulp_exponent);
    const std::uint64_t steps = round_to_integer(scaled, mode, random_word, sr_bits);
    const double rounded = static_cast<double>(steps) * pow2(ulp_exponent);
    if (rounded > maximum) {
      result_magnitude = max_finite_code(kind);
    } else if (f.is_integer) {
      result_magnitude = static_cast<std::uint32_t>(steps);
    } else if (rounded < min_normal(kind)) {
      result_magnitude = static_cast<std::uint32_t>(rounded * pow2(-subnormal_ulp_exponent(kind)));
    } else {
      const int exponent = floor_log2(rounded);
      const std::uint32_t mantissa = static_cast<std::uint32_t>(rounded * pow2(f.mantissa_bits - exponent)) -
                                     (1U << f.mantissa_bits);
      result_magnitude = (static_cast<std::uint32_t>(exponent + f.bias) << f.mantissa_bits) | mantissa;
    }
  }
  const bool flushed = result_magnitude == 0 && magnitude != 0.0;
  std::uint32_t code = result_magnitude;
  if (f.is_integer) {
    code = negative ? (256U - result_magnitude) & 0xFFU : result_magnitude;
  } else if (negative) {
    code |= sign_bit(kind);
  }
  return {static_cast<std::uint8_t>(code), saturated, flushed};
}

// encode(kind, value, rne) for the signed float element formats (fp4, fp6, fp8), with the format's
// constants taken once rather than per call: the per-tensor quantizer's element loop. Same steps
// as encode; the code of a rounded magnitude steps * 2^u (u >= the subnormal spacing's exponent s)
// is (u - s) 2^m + steps, which also names the next binade's first code when steps reaches
// 2^(m + 1) and exceeds the largest finite code exactly when the rounded value exceeds the maximum.
struct nearest_even_encoder {
  std::uint32_t max_code = 0;
  std::uint32_t nan = 0;
  std::uint32_t sign = 0;
  int mantissa_bits = 0;
  int subnormal_exponent = 0;
  double maximum = 0.0;
  double smallest_normal = 0.0;

  MXSCOPE_HD static constexpr bool covers(element_kind kind) {
    const auto& f = spec(kind);
    return !f.is_integer && f.allows_negative && f.has_sign_bit && f.specials != special_encoding::nan_ff;
  }
  MXSCOPE_HD constexpr explicit nearest_even_encoder(element_kind kind)
      : max_code(max_finite_code(kind)),
        nan(nan_code(kind)),
        sign(sign_bit(kind)),
        mantissa_bits(spec(kind).mantissa_bits),
        subnormal_exponent(subnormal_ulp_exponent(kind)),
        maximum(max_normal(kind)),
        smallest_normal(min_normal(kind)) {}

  MXSCOPE_HD constexpr encoded operator()(double value) const {
    if (is_nan(value)) return {static_cast<std::uint8_t>(nan), false, false};
    const bool negative = double_bits(value) >> 63 != 0;
    const double magnitude = negative ? -value : value;
    std::uint32_t code = max_code;
    if (!(magnitude >= 2.0 * maximum)) {
      const int ulp_exponent =
          magnitude < smallest_normal ? subnormal_exponent : floor_log2(magnitude) - mantissa_bits;
      const std::uint64_t steps = round_to_integer(magnitude * pow2(-ulp_exponent), rounding_mode::rne, 0, 32);
      const std::uint64_t rounded_code =
          (static_cast<std::uint64_t>(ulp_exponent - subnormal_exponent) << mantissa_bits) + steps;
      code = rounded_code > max_code ? max_code : static_cast<std::uint32_t>(rounded_code);
    }
    const bool flushed = code == 0 && magnitude != 0.0;
    return {static_cast<std::uint8_t>(negative ? code | sign : code), magnitude > maximum, flushed};
  }
};

// ---------------------------------------------------------------------------------------------
// IEEE half-width formats for I/O: bf16 and fp16 widen exactly to fp32; narrowing rounds.

MXSCOPE_HD constexpr float bf16_to_float(std::uint16_t bits) { return bits_float(static_cast<std::uint32_t>(bits) << 16); }

// fp32 -> bf16 under a rounding mode (sr draws sr_bits from random_word). NaN stays NaN (quiet).
// Overflow follows IEEE for rne/rna (to inf) and saturates for rtz, as hardware converters do.
MXSCOPE_HD constexpr std::uint16_t float_to_bf16(float value, rounding_mode mode = rounding_mode::rne,
                                                 std::uint32_t random_word = 0, int sr_bits = 32) {
  const std::uint32_t bits = float_bits(value);
  if ((bits & 0x7fffffffU) > 0x7f800000U) return static_cast<std::uint16_t>((bits >> 16) | 0x0040U);
  const std::uint32_t kept = bits >> 16;
  const std::uint32_t dropped = bits & 0xffffU;
  if ((bits & 0x7fffffffU) == 0x7f800000U) return static_cast<std::uint16_t>(kept);
  bool up = false;
  switch (mode) {
    case rounding_mode::rne: up = dropped > 0x8000U || (dropped == 0x8000U && (kept & 1U)); break;
    case rounding_mode::rna: up = dropped >= 0x8000U; break;
    case rounding_mode::rtz: up = false; break;
    case rounding_mode::sr: {
      // F = dropped / 2^16; floor(F * 2^R) for R <= 16 keeps the top bits, for R > 16 it is exact.
      const std::uint64_t top = sr_bits >= 16 ? static_cast<std::uint64_t>(dropped) << (sr_bits - 16)
                                              : static_cast<std::uint64_t>(dropped >> (16 - sr_bits));
      const std::uint64_t draw = static_cast<std::uint64_t>(random_word) >> (32 - sr_bits);
      up = top + draw >= (std::uint64_t{1} << sr_bits);
      break;
    }
  }
  return static_cast<std::uint16_t>(kept + (up ? 1U : 0U));
}

// IEEE binary16 -> fp32, exact.
MXSCOPE_HD constexpr float half_to_float(std::uint16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000U) << 16;
  const std::uint32_t exponent = (h >> 10) & 0x1fU;
  const std::uint32_t mantissa = h & 0x3ffU;
  if (exponent == 0x1fU) return bits_float(sign | 0x7f800000U | (mantissa << 13));
  if (exponent == 0) {
    const float magnitude = static_cast<float>(mantissa) * static_cast<float>(pow2(-24));
    return sign ? -magnitude : magnitude;
  }
  return bits_float(sign | ((exponent + 112U) << 23) | (mantissa << 13));
}

// fp32 -> IEEE binary16 with round-to-nearest-even, overflow to inf, gradual underflow.
MXSCOPE_HD constexpr std::uint16_t float_to_half(float value) {
  const std::uint32_t bits = float_bits(value);
  const std::uint16_t sign = static_cast<std::uint16_t>((bits >> 16) & 0x8000U);
  const std::uint32_t magnitude_bits = bits & 0x7fffffffU;
  if (magnitude_bits > 0x7f800000U) return static_cast<std::uint16_t>(sign | 0x7e00U);
  if (magnitude_bits == 0x7f800000U) return static_cast<std::uint16_t>(sign | 0x7c00U);
  const double magnitude = static_cast<double>(bits_float(magnitude_bits));
  if (magnitude >= 65520.0) return static_cast<std::uint16_t>(sign | 0x7c00U);
  const int ulp_exponent = magnitude < pow2(-14) ? -24 : floor_log2(magnitude) - 10;
  const std::uint64_t steps = round_to_integer(magnitude * pow2(-ulp_exponent), rounding_mode::rne, 0, 32);
  const double rounded = static_cast<double>(steps) * pow2(ulp_exponent);
  if (rounded < pow2(-14)) return static_cast<std::uint16_t>(sign | static_cast<std::uint16_t>(steps));
  const int exponent = floor_log2(rounded);
  const std::uint32_t mantissa = static_cast<std::uint32_t>(rounded * pow2(10 - exponent)) - 1024U;
  return static_cast<std::uint16_t>(sign | (static_cast<std::uint32_t>(exponent + 15) << 10) | mantissa);
}

// ---------------------------------------------------------------------------------------------
// Spec pins (OCP MX v1.0 tables; OCP 8-bit FP spec for e4m3/e5m2).
static_assert(max_normal(element_kind::fp4_e2m1) == 6.0);
static_assert(min_subnormal(element_kind::fp4_e2m1) == 0.5);
static_assert(max_normal(element_kind::fp6_e2m3) == 7.5);
static_assert(min_subnormal(element_kind::fp6_e2m3) == 0.125);
static_assert(max_normal(element_kind::fp6_e3m2) == 28.0);
static_assert(min_subnormal(element_kind::fp6_e3m2) == 0.0625);
static_assert(max_finite_code(element_kind::fp8_e4m3) == 0x7E && max_normal(element_kind::fp8_e4m3) == 448.0);
static_assert(min_subnormal(element_kind::fp8_e4m3) == 1.0 / 512.0);
static_assert(max_finite_code(element_kind::fp8_e5m2) == 0x7B && max_normal(element_kind::fp8_e5m2) == 57344.0);
static_assert(min_subnormal(element_kind::fp8_e5m2) == 1.0 / 65536.0);
static_assert(max_normal(element_kind::int8) == 127.0 / 64.0 && min_subnormal(element_kind::int8) == 1.0 / 64.0);
static_assert(decode(element_kind::e8m0, 127) == 1.0 && decode(element_kind::e8m0, 0) == pow2(-127));
static_assert(decode(element_kind::e8m0, 0xFE) == pow2(127));
static_assert(min_subnormal(element_kind::e8m0) == pow2(-127) && min_normal(element_kind::e8m0) == pow2(-127));
static_assert(max_normal(element_kind::ue4m3) == 448.0);
static_assert(emax_elem(element_kind::fp4_e2m1) == 2 && emax_elem(element_kind::fp6_e2m3) == 2);
static_assert(emax_elem(element_kind::fp6_e3m2) == 4 && emax_elem(element_kind::fp8_e4m3) == 8);
static_assert(emax_elem(element_kind::fp8_e5m2) == 15 && emax_elem(element_kind::int8) == 0);
static_assert(encode(element_kind::fp4_e2m1, 5.0).code == 0x6);   // tie 4|6 -> even mantissa (4)
static_assert(encode(element_kind::fp4_e2m1, 2.5).code == 0x4);   // tie 2|3 -> 2
static_assert(encode(element_kind::fp4_e2m1, 0.25).code == 0x0);  // tie 0|0.5 -> 0
static_assert(encode(element_kind::fp4_e2m1, 7.0).code == 0x7 && encode(element_kind::fp4_e2m1, 7.0).saturated);
static_assert(encode(element_kind::fp4_e2m1, -0.0).code == 0x8);
static_assert(encode(element_kind::fp8_e4m3, 464.0).code == 0x7E);  // would be 480: saturates
static_assert(encode(element_kind::int8, -1.0).code == 0xC0);

}  // namespace mxscope::core
