// Per-tensor scales applied exactly (NUMERICS.md, per-tensor scaling): the product of two fp32
// tensor scales, an exact sum times that product, and the exact sum times the scales rounded once
// to fp32 and fp64. Shared by the CPU emulator (src/gemm.cpp) and the GPU kernels
// (src/gpu/kernels.cu), so both round the same way.
#pragma once

#include <cmath>

#include "mxscope/core/accumulate.hpp"
#include "mxscope/core/config.hpp"
#include "mxscope/core/exact_sum.hpp"

namespace mxscope::core {

// a * b + c rounded once (IEEE fma) on the host and on either device compiler.
MXSCOPE_HD inline double fused_multiply_add(double a, double b, double c) {
#if defined(__CUDA_ARCH__)
  return __fma_rn(a, b, c);
#elif defined(__clang__)
  return __builtin_fma(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}

// The exact products of the tensor scales, split so that each half times a short value is exact:
// sa * sb has at most 48 significant bits (two fp32 significands), each half at most 24.
struct tensor_scale_product {
  bool is_one = true;
  double high = 1.0;
  double low = 0.0;
};

MXSCOPE_HD inline tensor_scale_product make_scale_product(float sa, float sb) {
  const double product = static_cast<double>(sa) * static_cast<double>(sb);
  tensor_scale_product out;
  out.is_one = product == 1.0;
  const split_double split = split_significand(product, 24);
  out.high = split.high;
  out.low = split.low;
  return out;
}

// Adds value * (sa * sb) to an exact accumulator. `value` has at most 53 significant bits: its top
// 27 and its remaining (at most 26) bits times a 24-bit half of the scale product stay within 51
// bits, so all four products are exact.
MXSCOPE_HD inline void add_scaled_exactly(long_accumulator& total, double value, const tensor_scale_product& scale) {
  if (scale.is_one) {
    total.add(value);
    return;
  }
  const split_double split = split_significand(value, 27);
  total.add(split.high * scale.high);
  total.add(split.high * scale.low);
  total.add(split.low * scale.high);
  total.add(split.low * scale.low);
}

struct scaled_exact_value {
  float fp32;
  double fp64;
};

// sum * sa * sb (sum a finite fp64 value, sa and sb finite fp32) rounded once (RNE) to fp32 and to
// fp64: fma's exact split where it decides the fp32 rounding, the long accumulator where it does not
// (at an fp32 midpoint, near overflow or far below 1).
MXSCOPE_HD inline scaled_exact_value round_scaled_exact(double sum, float sa, float sb) {
  const double scale = static_cast<double>(sa) * static_cast<double>(sb);  // exact: 48 significant bits
  const double high = sum * scale;
  const double low = fused_multiply_add(sum, scale, -high);  // high + low == sum * scale exactly (no underflow below)
  const float fp32 = static_cast<float>(high);
  const auto finite64 = [](double v) { return (double_bits(v) & 0x7FF0000000000000ULL) != 0x7FF0000000000000ULL; };
  const auto finite32 = [](float v) { return (float_bits(v) & 0x7F800000U) != 0x7F800000U; };
  const double magnitude = high < 0.0 ? -high : high;
  bool ambiguous = !finite64(high) || !finite32(fp32) ||
                   (magnitude < 0x1p-900 && high != 0.0);  // far below: fma's low part may be inexact
  if (!ambiguous && low != 0.0 && static_cast<double>(fp32) != high) {
    // high + low rounds to fp32 unless high lies exactly halfway between fp32 and its neighbour on
    // high's side: every such midpoint is an fp64 value, and |low| <= ulp(high) / 2 cannot carry the
    // sum across one otherwise. At a midpoint the sign of low decides, which the long accumulator
    // below does.
    const bool upward = high > static_cast<double>(fp32);
    float neighbour;  // the next fp32 after fp32 towards high (fp32 is finite; the next may be inf)
    if (fp32 == 0.0f) {
      neighbour = upward ? 0x1p-149f : -0x1p-149f;
    } else {
      const bool away_from_zero = (fp32 > 0.0f) == upward;
      const std::uint32_t bits = float_bits(fp32);
      neighbour = bits_float(away_from_zero ? bits + 1U : bits - 1U);
    }
    const double midpoint = static_cast<double>(fp32) + (static_cast<double>(neighbour) - static_cast<double>(fp32)) * 0.5;
    ambiguous = midpoint == high;
  }
  if (!ambiguous) return {fp32, high};
  long_accumulator total;
  add_scaled_exactly(total, sum, make_scale_product(sa, sb));
  return {total.round_to_float(), total.round_to_double()};
}

}  // namespace mxscope::core
