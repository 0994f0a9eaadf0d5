// The integer element encoder: core::quantize_element and core::dequantize_element for the MX float
// element formats (fp4, fp6, fp8; not int8), computed on the fp32 bits of the value with integer
// arithmetic instead of the core's fp64 arithmetic. One copy for the GPU quantizers
// (src/gpu/fast_encode.hpp adds their fp4 shortcuts) and the CPU fast quantizer's scalar path.
//
// Why it is the same function. A block scale is a power of two, so x = v / 2^e has v's significand
// S (24 bits, the hidden bit included; fewer for subnormal v) and its last bit at 2^lsb with
// lsb = (v's biased exponent, at least 1) - 150 - e. With L = floor(log2 |x|) and the format's
// smallest normal exponent m, the core rounds |x| / 2^u to an integer, u = max(L, m) -
// mantissa_bits; that quotient is S / 2^shift with shift = u - lsb, whose integer part I is
// S >> shift and whose fraction is F = (S mod 2^shift) / 2^shift, both exact. Each rounding mode's
// decision on (I, F) is restated on the integers (rne: F > 1/2 or F = 1/2 and I odd; rna:
// F >= 1/2; rtz: never up; sr: floor(F 2^R) + (word >> (32 - R)) >= 2^R). The code of
// steps * 2^u is ((max(L, m) + bias - 1) << mantissa_bits) + steps in both the subnormal and the
// normal range (a carry into the next binade lands on the right code), codes grow with values, so
// saturation is "code > max code". tests/test_gpu_host_reference.cpp compares every function here
// with the core over all bf16 bit patterns (with random low bits) x every block exponent x every
// mode, and the GPU test repeats the comparison on the device for about 2 billion fp32 patterns.
#pragma once

#include "mxscope/core/mx.hpp"

namespace mxscope::core::encode_bits {

struct element_constants {
  int mantissa_bits;
  int bias;
  int min_exponent;        // exponent of the smallest normal value
  int subnormal_exponent;  // exponent of the subnormal spacing
  int emax;                // floor(log2(max normal))
  std::uint32_t max_code;  // the largest finite magnitude code
  std::uint32_t sign_bit;
  std::uint32_t max_significand;  // max normal * 2^(23 - emax): an integer below 2^24
};

MXSCOPE_HD constexpr bool covers(core::element_kind kind) {
  return kind == core::element_kind::fp4_e2m1 || kind == core::element_kind::fp6_e2m3 ||
         kind == core::element_kind::fp6_e3m2 || kind == core::element_kind::fp8_e4m3 ||
         kind == core::element_kind::fp8_e5m2;
}

MXSCOPE_HD constexpr element_constants constants_of(core::element_kind kind) {
  const core::format_spec format = core::spec(kind);
  element_constants out{};
  out.mantissa_bits = format.mantissa_bits;
  out.bias = format.bias;
  out.min_exponent = core::min_normal_exponent(kind);
  out.subnormal_exponent = core::subnormal_ulp_exponent(kind);
  out.emax = core::emax_elem(kind);
  out.max_code = core::max_finite_code(kind);
  out.sign_bit = core::sign_bit(kind);
  out.max_significand = static_cast<std::uint32_t>(core::max_normal(kind) * core::pow2(23 - out.emax));
  return out;
}

// core::quantize_element(kind, value, exponent, mode, random_word, sr_bits) for a finite value,
// -127 <= exponent <= 127 and 1 <= sr_bits <= 32.
MXSCOPE_HD constexpr core::encoded quantize_finite(const element_constants& c, float value, int exponent,
                                                   core::rounding_mode mode, std::uint32_t random_word, int sr_bits) {
  const std::uint32_t bits = core::float_bits(value);
  const std::uint32_t magnitude = bits & 0x7fffffffU;
  const std::uint32_t sign = (bits >> 31) != 0 ? c.sign_bit : 0U;
  if (magnitude == 0) return {static_cast<std::uint8_t>(sign), false, false};
  const int biased = static_cast<int>(magnitude >> 23);
  const std::uint32_t significand = biased != 0 ? (magnitude & 0x007fffffU) | 0x00800000U : magnitude;
  const int lsb = (biased != 0 ? biased : 1) - 150 - exponent;
  const int top = 31 - __builtin_clz(significand);
  const int leading = lsb + top;
  const int binade = leading > c.min_exponent ? leading : c.min_exponent;
  const int shift = binade - c.mantissa_bits - lsb;
  std::uint32_t code = 0;
  if (shift <= 0) {
    // The last bit of x is at or above the spacing: nothing to round. Not reachable for the MX formats
    // with an fp32 value and |e| <= 127 (shift >= 1 there); kept exact for completeness.
    const std::uint64_t wide_steps = static_cast<std::uint64_t>(significand) << (-shift < 40 ? -shift : 40);
    const std::uint64_t wide_code = (static_cast<std::uint64_t>(binade + c.bias - 1) << c.mantissa_bits) + wide_steps;
    code = wide_code > c.max_code ? c.max_code : static_cast<std::uint32_t>(wide_code);
  } else {
    // 32-bit arithmetic: S < 2^24, so from a shift of 25 on the integer part is 0 and F < 1/2.
    const int clamped = shift < 25 ? shift : 25;
    const std::uint32_t integer = significand >> clamped;
    const std::uint32_t dropped = significand - (integer << clamped);
    const std::uint32_t half = 1U << (clamped - 1);
    bool up = false;
    switch (mode) {
      case core::rounding_mode::rne: up = dropped > half || (dropped == half && (integer & 1U) != 0); break;
      case core::rounding_mode::rna: up = dropped >= half; break;
      case core::rounding_mode::rtz: up = false; break;
      case core::rounding_mode::sr: {
        // floor(F * 2^R) with F = dropped / 2^shift (the true shift: F's bits sit that far down).
        const int scale_up = sr_bits - shift;
        const std::uint64_t top_fraction =
            scale_up >= 0 ? static_cast<std::uint64_t>(dropped) << scale_up
                          : (-scale_up >= 32 ? 0U : static_cast<std::uint64_t>(dropped >> -scale_up));
        const std::uint64_t draw = static_cast<std::uint64_t>(random_word) >> (32 - sr_bits);
        up = top_fraction + draw >= (std::uint64_t{1} << sr_bits);
        break;
      }
    }
    // binade + bias - 1 >= 0 (binade >= the smallest normal exponent 1 - bias) and stays below 2^9.
    code = (static_cast<std::uint32_t>(binade + c.bias - 1) << c.mantissa_bits) + integer + (up ? 1U : 0U);
    if (code > c.max_code) code = c.max_code;
  }
  const bool saturated = leading > c.emax || (leading == c.emax && (significand << (23 - top)) > c.max_significand);
  return {static_cast<std::uint8_t>(code | sign), saturated, code == 0};
}

// 2^e as fp32 for -149 <= e <= 127 (exact; subnormal below -126).
MXSCOPE_HD constexpr float power_of_two(int exponent) {
  return exponent >= -126 ? core::bits_float(static_cast<std::uint32_t>(exponent + 127) << 23)
                          : core::bits_float(1U << (exponent + 149));
}

// core::shared_exponent under the floor rule, from the bits of a finite, nonnegative largest
// magnitude: its fp32 exponent field less 127 and emax, which is floor(log2) - emax for a normal
// number; a subnormal or zero largest gives -127 - emax or less, which the clamp to -127 turns into
// the core's answer (its floor_log2 is -127 or less there too), and no finite number passes 127.
// A few integer operations where the core's function goes through fp64.
MXSCOPE_HD constexpr int floor_rule_exponent(int emax, std::uint32_t largest_bits) {
  const int exponent = static_cast<int>(largest_bits >> 23) - 127 - emax;
  return exponent > core::scale_exponent_min ? exponent : core::scale_exponent_min;
}

// static_cast<float>(core::dequantize_element(kind, code, exponent)) for a code of the format.
// The element value is exact in fp32; one fp32 multiplication by 2^exponent rounds the exact
// product once, as the core's conversion of the exact fp64 product does.
MXSCOPE_HD constexpr float dequantize(const element_constants& c, std::uint32_t code, int exponent) {
  const std::uint32_t magnitude = code & (c.sign_bit - 1U);
  const std::uint32_t mantissa_mask = (1U << c.mantissa_bits) - 1U;
  const std::uint32_t field = magnitude >> c.mantissa_bits;
  const float element = field == 0 ? static_cast<float>(magnitude) * power_of_two(c.subnormal_exponent)
                                   : static_cast<float>((1U << c.mantissa_bits) | (magnitude & mantissa_mask)) *
                                         power_of_two(static_cast<int>(field) - c.bias - c.mantissa_bits);
  const float scaled = element * power_of_two(exponent);
  return (code & c.sign_bit) != 0 ? -scaled : scaled;
}

}  // namespace mxscope::core::encode_bits
