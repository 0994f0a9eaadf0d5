// The element encoders of the GPU's fused quantizer: the integer encoder of
// core/encode_bits.hpp (core::quantize_element on the fp32 bits, for the MX float formats) and,
// below, its fp4 shortcuts, each the same function as the core's on the values it covers.
#pragma once

#include "mxscope/core/encode_bits.hpp"
#include "mxscope/core/mx.hpp"

namespace mxscope::gpu::fast_encode {

using core::encode_bits::constants_of;
using core::encode_bits::covers;
using core::encode_bits::dequantize;
using core::encode_bits::element_constants;
using core::encode_bits::floor_rule_exponent;
using core::encode_bits::power_of_two;
using core::encode_bits::quantize_finite;

// ------------------------------------------------------------------------------------------------
// fp4 e2m1: two shorter encoders for the fused quantizer's inner loop. Both start from
// scaled = fl32(|v| * 2^-e) (power_of_two(-e), one fp32 multiplication): that product is exact
// whenever |v| 2^-e >= 2^-126, and below that every mode gives code 0 from both the exact and the
// rounded value (the largest fraction such a value can carry is 2^-125 of a spacing, far from
// any rounding decision), so the encoders may look at the rounded product. They return the
// magnitude code 0..7; the sign, the saturation flag (|v| 2^-e > 6, i.e. scaled > 6) and the flush
// flag (v != 0, code 0) are the caller's, as in fp4_encode below, which is how the tests compare
// them with core::quantize_element.
//
// The e2m1 grid: spacing 1/2 on [0, 2) (codes 0..4), 1 on [2, 4) (codes 4..6), 2 on [4, 8)
// (codes 6, 7); a value's code is its index on that grid, and codes 8 and up saturate to 7.

// Round to nearest, ties to even, by one fp32 addition. With b the fp32 binade of scaled (clamped
// to [1, 8]: below 1 the spacing stays 1/2, from 8 on everything saturates), magic = 2^22 b has
// ulp b / 2, the grid's spacing on [b, 2 b); scaled + magic rounds scaled to that spacing once,
// nearest-even, and lands in magic's binade (scaled < 2 b is far below magic), so the difference
// of the fp32 bit patterns counts the spacings: steps = round(scaled / spacing). The grid's index
// of b is 2 log2(b), and steps' parity is the code's, so ties go to the even code as the core's do.
MXSCOPE_HD constexpr std::uint32_t fp4_nearest_even(float scaled) {
  constexpr std::uint32_t one = 0x3f800000U;    // fp32 bits of 1
  constexpr std::uint32_t eight = 0x41000000U;  // fp32 bits of 8
  std::uint32_t binade = core::float_bits(scaled) & 0x7f800000U;
  binade = binade < one ? one : binade;
  binade = binade > eight ? eight : binade;
  const float magic = core::bits_float(binade + (22U << 23));
  const std::uint32_t steps = core::float_bits(scaled + magic) - core::float_bits(magic);
  const std::uint32_t code = ((binade - one) >> 22) + steps;
  return code < 7U ? code : 7U;
}

// The same rounding without the scaling, for the fused kernel's common case: round |v| itself to
// the block's grid 2^e {0, 1/2, 1, 3/2, 2, 3, 4, 6}. Rounding commutes with the exact scaling by
// 2^e while every value involved is an fp32 number, which the range below guarantees, so the
// code is fp4_nearest_even's (and core::quantize_element's) for every finite |v|, subnormals
// included. The saturation threshold six = 6 2^e first clamps |v| (a value above it gets code 7
// either way, and 6 2^e itself is code 7), so no final cap is needed and the binade b of the
// clamped value is at most 4 2^e; it is raised to one = 2^e below. magic = 2^22 b has ulp b / 2,
// the grid's spacing on [b, 2 b), the clamped value is below 2 b, so the sum lands in magic's
// binade rounded once to that spacing, ties to even; the difference of the bit patterns counts
// the spacings, and 2 log2(b / 2^e) = (bits(b) - bits(one)) >> 22 is the code of b. Valid for
// -126 <= e <= 102: 2^e is a normal number and magic (at most 2^(e + 24)) and the sum are finite;
// the kernel takes fp4_nearest_even on 2^-e-scaled values outside. With the packing below, seven
// operations per element (a min, a mask, a max, an add for magic, the fp32 addition, a shift, a
// three-way add), against fp4_nearest_even's eleven plus its scaling multiply.
struct fp4_unscaled {
  float six;           // 6 2^e, the saturation threshold
  std::uint32_t one;   // bits of 2^e
};

MXSCOPE_HD constexpr bool fp4_unscaled_covers(int exponent) { return exponent >= -126 && exponent <= 102; }

MXSCOPE_HD constexpr fp4_unscaled fp4_unscaled_constants(int exponent) {
  const std::uint32_t one = static_cast<std::uint32_t>(exponent + 127) << 23;
  return {6.0f * core::bits_float(one), one};
}

// The code less fp4_unscaled_offset(block), modulo 2^32: bits(sum) - bits(b) + (bits(b) >> 22).
// The fused kernel packs these with additions and adds the offsets of a word's 8 codes once
// (fp4_unscaled_word_offset), which saves two operations per element; the sum is exact modulo
// 2^32, so the packed word is the same.
// `clamped` is min(|v|, six) (the kernel takes fminf, one instruction).
//
// The rounding itself, for callers that also want the grid point: sum = magic + the point, whose
// bit pattern gives the biased code, and sum - magic the point m 2^e itself, exactly (both are
// multiples of the spacing b / 2 and the difference is below 2^24 spacings; a subnormal point
// such as 2^-127 included).
struct fp4_unscaled_rounding {
  float sum;
  float magic;
  std::uint32_t binade;
  MXSCOPE_HD constexpr std::uint32_t biased() const { return core::float_bits(sum) - binade + (binade >> 22); }
  MXSCOPE_HD constexpr float point() const { return sum - magic; }
};

MXSCOPE_HD constexpr fp4_unscaled_rounding fp4_nearest_even_unscaled_rounding(float clamped, fp4_unscaled block) {
  std::uint32_t binade = core::float_bits(clamped) & 0x7f800000U;
  binade = binade > block.one ? binade : block.one;
  const float magic = core::bits_float(binade) * 4194304.0f;  // 2^22 b: an fp32 multiply, off the integer pipe
  return {clamped + magic, magic, binade};
}

MXSCOPE_HD constexpr std::uint32_t fp4_nearest_even_unscaled_biased(float clamped, fp4_unscaled block) {
  return fp4_nearest_even_unscaled_rounding(clamped, block).biased();
}

// code = biased + offset: offset = -(22 << 23) - (bits(one) >> 22), modulo 2^32.
MXSCOPE_HD constexpr std::uint32_t fp4_unscaled_offset(fp4_unscaled block) {
  return 0U - (22U << 23) - (block.one >> 22);
}

// The offsets of 8 codes packed at nibbles 0..7: offset * 0x11111111, modulo 2^32.
MXSCOPE_HD constexpr std::uint32_t fp4_unscaled_word_offset(fp4_unscaled block) {
  return fp4_unscaled_offset(block) * 0x11111111U;
}

MXSCOPE_HD constexpr std::uint32_t fp4_nearest_even_unscaled(float magnitude, fp4_unscaled block) {
  const float clamped = magnitude < block.six ? magnitude : block.six;
  return fp4_nearest_even_unscaled_biased(clamped, block) + fp4_unscaled_offset(block);
}

// Stochastic rounding with 32 random bits on the unscaled magnitudes, for the fused kernel's sr
// (NUMERICS.md section 3: with F the fraction of |v| / spacing, round up iff
// floor(F 2^32) + word >= 2^32). As 2^32 and the word are integers, that is exactly
// rest + word 2^-32 spacing >= spacing, with rest = |v| - (the grid point below |v|) = F spacing:
// the word's dither, added to the rest, must reach the next grid point. The grid is that of
// fp4_nearest_even_unscaled (clamp to six, binade b raised to one, spacing s = b / 2,
// magic = 2^22 b with ulp s), and the steps are fp32 operations with directed roundings:
//   floor_sum = rz(clamped + magic)      magic + s floor(clamped / s): the grid point below, exactly
//   rest = clamped - (floor_sum - magic) exact (both differences are of numbers within a factor 2,
//                                        or the subtrahend is 0)
//   low  = 2^-9 + (word & 511) 2^-32     the word's low 9 bits as an fp32 number (bit pattern)
//   high = (word >> 9) 2^-23 - 2^-9      its high 23 bits, less the 2^-9 of low (one exact addition)
//   partial  = rd(rest + low s)          one fma, rounded down
//   dithered = rd(partial + high s)      one fma, rounded down: low s + high s = word 2^-32 s
//   sum = rz(floor_sum + dithered)       floor_sum, or floor_sum + s where dithered >= s
// Why the two rounded-down sums decide exactly: with C = s - high s = s (2 + 2^-9 - H) (H = 1 +
// (word >> 9) 2^-23) an fp32 number (23 significant bits at s 2^-23, s >= 2^-126),
// dithered >= s  <=>  partial + high s >= s  <=>  partial >= C  <=>  rest + low s >= C
// <=>  rest + word 2^-32 s >= s, because a number rounded down reaches an fp32 number exactly when
// the number itself does. dithered lies in [0, 2 s) (low s >= 2^-9 s covers a negative high s),
// so the last sum adds s to floor_sum exactly when the word rounds up, and the code follows from
// sum's bit pattern as in fp4_nearest_even_unscaled_biased (same bias, same word offset). Valid for
// -125 <= e <= 102 (s >= 2^-126; magic and the sums finite). Nine fp32 operations and about six
// integer ones per element, where the scaled encoder (fp4_locate, fp4_round) spends about twenty
// integer ones; on sm_90 the integer pipe takes a warp's instruction every other cycle, the fp32
// pipes one per cycle, and it is the integer pipe that limits the fused kernel.
MXSCOPE_HD constexpr bool fp4_stochastic_covers(int exponent) { return exponent >= -125 && exponent <= 102; }

// Directed roundings of fp32 operations: one instruction each in CUDA device code; elsewhere the
// exact result s + err (fp64 TwoSum; the product of two fp32 numbers is exact in fp64) rounded to
// the fp32 number at or below it. Rounding toward zero is rounding down for the nonnegative sums
// the encoder forms. Finite results below 2^128 only.
namespace detail {
MXSCOPE_HD constexpr float round_down(double sum, double error) {
  float out = static_cast<float>(sum);  // nearest: the wanted number or the one above it
  if (static_cast<double>(out) > sum || (static_cast<double>(out) == sum && error < 0)) {
    const std::uint32_t bits = core::float_bits(out);
    out = (bits & 0x7fffffffU) == 0 ? core::bits_float(0x80000001U)
                                    : core::bits_float((bits >> 31) != 0 ? bits + 1 : bits - 1);
  }
  return out;
}

MXSCOPE_HD constexpr float add_down(double a, double b) {
  const double sum = a + b;
  const double b_part = sum - a;
  return round_down(sum, (a - (sum - b_part)) + (b - b_part));
}
}  // namespace detail

MXSCOPE_HD constexpr float add_toward_zero(float a, float b) {
#if defined(__CUDA_ARCH__) && !defined(__HIP__)
  if (!__builtin_is_constant_evaluated()) return __fadd_rz(a, b);
#endif
  return detail::add_down(a, b);  // nonnegative sums here
}

MXSCOPE_HD constexpr float fma_down(float a, float b, float c) {
#if defined(__CUDA_ARCH__) && !defined(__HIP__)
  if (!__builtin_is_constant_evaluated()) return __fmaf_rd(a, b, c);
#endif
  return detail::add_down(static_cast<double>(a) * static_cast<double>(b), c);
}

// The fp32 number 2^-9 + (word & 511) 2^-32 and the bit pattern of 1 + (word >> 9) 2^-23.
MXSCOPE_HD constexpr float fp4_dither_low(std::uint32_t word) {
#if defined(__CUDA_ARCH__) && !defined(__HIP__)
  if (!__builtin_is_constant_evaluated()) {  // one three-input logic operation, not two
    std::uint32_t bits = 0;
    asm("lop3.b32 %0, %1, 0x1ff, %2, 0xEA;" : "=r"(bits) : "r"(word), "r"(0x3b000000U));
    return core::bits_float(bits);
  }
#endif
  return core::bits_float(0x3b000000U | (word & 0x1ffU));
}

MXSCOPE_HD constexpr std::uint32_t fp4_dither_high_bits(std::uint32_t word) {
#if defined(__CUDA_ARCH__) && !defined(__HIP__)
  if (!__builtin_is_constant_evaluated()) return __funnelshift_r(word, 0x7fU, 9);  // one funnel shift
#endif
  return 0x3f800000U | (word >> 9);
}

// The code less fp4_unscaled_offset(block), modulo 2^32, as fp4_nearest_even_unscaled_biased (and
// the rounding with its grid point, as fp4_nearest_even_unscaled_rounding: sum = magic + the point,
// floor_sum or floor_sum + s). `clamped` is min(|v|, six); `word` the element's Philox word.
MXSCOPE_HD constexpr fp4_unscaled_rounding fp4_stochastic_unscaled_rounding(float clamped, std::uint32_t word,
                                                                            fp4_unscaled block) {
  std::uint32_t binade = core::float_bits(clamped) & 0x7f800000U;
  binade = binade > block.one ? binade : block.one;
  const float b = core::bits_float(binade);
  const float magic = b * 4194304.0f;  // 2^22 b
  const float spacing = b * 0.5f;
  const float floor_sum = add_toward_zero(clamped, magic);
  const float rest = clamped - (floor_sum - magic);
  const float high = core::bits_float(fp4_dither_high_bits(word)) - 1.001953125f;  // - (1 + 2^-9)
  const float partial = fma_down(fp4_dither_low(word), spacing, rest);
  const float dithered = fma_down(high, spacing, partial);
  return {add_toward_zero(floor_sum, dithered), magic, binade};
}

MXSCOPE_HD constexpr std::uint32_t fp4_stochastic_unscaled_biased(float clamped, std::uint32_t word,
                                                                  fp4_unscaled block) {
  return fp4_stochastic_unscaled_rounding(clamped, word, block).biased();
}

MXSCOPE_HD constexpr std::uint32_t fp4_stochastic_unscaled(float magnitude, std::uint32_t word, fp4_unscaled block) {
  const float clamped = magnitude < block.six ? magnitude : block.six;
  return fp4_stochastic_unscaled_biased(clamped, word, block) + fp4_unscaled_offset(block);
}

// A shorter sr encoder (32 random bits), which decides almost every element and says where it does
// not; the fused kernel takes it first and re-encodes a block with fp4_stochastic_unscaled where any
// element is undecided. It anchors the block's grid at fp32's smallest normal number: with c = |v|,
// one = 2^e and F the fraction of c on the grid of spacing s (NUMERICS.md section 3),
//   y = rz(c a), a = 2^(-126 - e)    one fp32 multiplication rounded toward zero: one becomes 2^-126
//   sum = bits(y) + (word >> 10)     one integer addition
//   code = min(sum >> 22, 7)         (fp4_stochastic_anchored_saturate, on 8 packed codes at once)
// Why: below 2^-126 fp32's numbers are the multiples of 2^-149 and above it a binade [2^k, 2^(k+1))
// holds 2^23 numbers, so bits(y) counts grid steps directly. Below one, s = one / 2 and y < 2^-126:
// bits(y) = floor(c a 2^149) = floor((c / s) 2^22), the index (0 or 1) in bit 22 and floor(F 2^22)
// below. From one on, c lies in a binade b = 2^k one (k = 0, 1, 2) with s = b / 2, c a is exact and
// normal, bits(y) = (k + 1) 2^23 + m for c's significand field m, and c / s = 2 + m 2^-22: the index
// is 2 (k + 1) + (m >> 22) and floor(F 2^22) is m's low 22 bits. Either way bits(y) = 2^22 (index) +
// floor(F 2^22), where the index of c in [6, 8) one is 7. Adding word >> 10 carries into bit 22
// exactly when floor(F 2^22) + (word >> 10) >= 2^22. The rule rounds up iff floor(F 2^32) + word >=
// 2^32; with floor(F 2^32) = floor(F 2^22) 2^10 + r10 and word = (word >> 10) 2^10 + w10 (r10, w10 <
// 2^10) the two agree unless floor(F 2^22) + (word >> 10) = 2^22 - 1, where r10 + w10 decides: sum's
// low 22 bits are then all ones (fp4_stochastic_sum_undecided), and only then. A carry out of the
// significand field moves y to the next binade, which is the next grid point's index. So sum >> 22
// is the code up to six (F = 0 at six: it stays 7), and 7 or 8 above six, where the code saturates
// to 7 whatever the word; no offsets, no clamp, no lift. Valid for -127 <= e <= 23 (a an fp32
// number) and c < 8 one, which every scale rule gives the block's largest magnitude (the kernel
// checks). One fp32 operation and one or two integer ones per element.
MXSCOPE_HD constexpr bool fp4_stochastic_anchored_covers(int exponent) { return exponent >= -127 && exponent <= 23; }

MXSCOPE_HD constexpr float fp4_stochastic_anchor(int exponent) { return power_of_two(-126 - exponent); }

MXSCOPE_HD constexpr float multiply_toward_zero(float a, float b) {
#if defined(__CUDA_ARCH__) && !defined(__HIP__)
  if (!__builtin_is_constant_evaluated()) return __fmul_rz(a, b);
#endif
  // Nonnegative operands: the product is exact in fp64. Below 2^-126 the fp32 numbers are the
  // multiples of 2^-149, so the pattern is the product's floor in those units (constant evaluation
  // does not convert there).
  const double product = static_cast<double>(a) * static_cast<double>(b);
  if (product < 0x1p-126) return core::bits_float(static_cast<std::uint32_t>(product * 0x1p149));
  return detail::round_down(product, 0.0);
}

// `magnitude` is |v| (an operand modifier in the kernel), `anchor` fp4_stochastic_anchor(e).
MXSCOPE_HD constexpr std::uint32_t fp4_stochastic_anchored_sum(float magnitude, std::uint32_t word, float anchor) {
  return core::float_bits(multiply_toward_zero(magnitude, anchor)) + (word >> 10);
}

MXSCOPE_HD constexpr bool fp4_stochastic_sum_undecided(std::uint32_t sum) { return (sum & 0x3fffffU) == 0x3fffffU; }

// Eight codes sum >> 22 (0..8) packed at nibbles 0..7, each 8 (1000) turned into 7 (0111): bit 3 of a
// nibble is set only there, and flipping its four bits is the change.
MXSCOPE_HD constexpr std::uint32_t fp4_stochastic_anchored_saturate(std::uint32_t codes) {
  return codes ^ (((codes >> 3) & 0x11111111U) * 15U);
}

// The saturation flag of one magnitude as an fp32 number, 1.0 where |v| > six and 0.0 elsewhere,
// from one fma with saturation to [0, 1]: with six = 6 2^e, two fp32 numbers above and at six
// differ by at least six's spacing 2^(e - 21), so (|v| - six) 2^(21 - e), formed exactly by the fma
// before its one rounding, is at least 1 where |v| > six and at most 0 elsewhere, and the clamp
// leaves exactly 1 or 0. The flags add up exactly in fp32. The fused kernel counts saturations this
// way on the fp32 pipes instead of the integer one; the scale 2^(21 - e) is a normal number for
// fp4_saturation_flag_covers(e).
MXSCOPE_HD constexpr bool fp4_saturation_flag_covers(int exponent) { return exponent >= -105 && exponent <= 102; }

struct fp4_saturation_flag {
  float scale;   // 2^(21 - e)
  float offset;  // -six 2^(21 - e) = -6 2^21
};

MXSCOPE_HD constexpr fp4_saturation_flag fp4_saturation_flag_constants(int exponent) {
  return {power_of_two(21 - exponent), -12582912.0f};
}

MXSCOPE_HD constexpr float fp4_saturated(float magnitude, fp4_saturation_flag flag) {
#if defined(__CUDA_ARCH__) && !defined(__HIP__)
  if (!__builtin_is_constant_evaluated()) {
    float out = 0.0f;
    asm("fma.rn.sat.f32 %0, %1, %2, %3;" : "=f"(out) : "f"(magnitude), "f"(flag.scale), "f"(flag.offset));
    return out;
  }
#endif
  // The sign of the exact (|v| - six) 2^(21 - e) decides; the products and the sum are exact here.
  const double exact = static_cast<double>(magnitude) * static_cast<double>(flag.scale) + flag.offset;
  return exact >= 1.0 ? 1.0f : exact <= 0.0 ? 0.0f : static_cast<float>(exact);
}

// The same encoder on two bf16 magnitudes at once, for bf16 input without rotation: each 32-bit
// word holds two elements (the first in the low half), and every step above has a halfword form,
// so one instruction serves two elements. With m the word's magnitudes (w & 0x7fff7fff, which the
// block's maximum needs too):
//   c = min_u16x2(m, six)             halfword minimum: bf16 bit patterns of magnitudes order as
//                                     their values
//   b = max_u16x2(c & 0x7f807f80, one)
//   magic = b + (6 << 7) per half     bf16 has 7 fraction bits: ulp(2^6 b) = b / 2
//   sum = add_bf16x2(c, magic)        one bf16 addition per half, nearest-even
//   code = sum - b + ((b >> 6) + offset)
// with code per half as above (bf16 magic has exponent b + 6 instead of fp32's b + 22, and the
// shift is 6 instead of 22). The word shifts are per-half exact: b has no bits below 2^7 in
// either half, so b >> 6 moves nothing across the halves, and every per-half result is in
// 0..7, so the 32-bit additions (the offset written modulo 2^32 for both halves) carry and borrow
// nothing across them. Valid for -124 <= e <= 119: 2^e and 6 2^e are normal bf16 numbers, magic
// is at most 2^(e + 8), and a bf16 subnormal c (which the bf16 addition might flush to zero)
// gives code 0 either way, being below 2^-126 <= 2^(e - 2).
struct fp4_unscaled_bf16x2 {
  std::uint32_t six;     // bf16 bits of 6 2^e in both halves
  std::uint32_t one;     // bf16 bits of 2^e in both halves
  std::uint32_t offset;  // -((6 << 7) + (one >> 6)) in both halves, modulo 2^32
};

MXSCOPE_HD constexpr bool fp4_unscaled_bf16x2_covers(int exponent) { return exponent >= -124 && exponent <= 119; }

MXSCOPE_HD constexpr fp4_unscaled_bf16x2 fp4_unscaled_bf16x2_constants(int exponent) {
  const std::uint32_t one = static_cast<std::uint32_t>(exponent + 127) << 7;
  const std::uint32_t six = one + (2U << 7) + 0x40U;  // 1.5 2^(e + 2)
  return {six * 0x10001U, one * 0x10001U, (0U - (6U << 7) - (one >> 6)) * 0x10001U};
}

// Halfword unsigned minimum and maximum, and the nearest-even bf16 addition of the two halves
// (one instruction each on sm_90). The portable addition rounds the fp32 sum to bf16, which is the
// single rounding of the exact sum for this encoder's operands: where c has bits below the fp32
// ulp of magic, c < 2^-14 magic is below half a bf16 ulp of magic and both give magic; otherwise
// the fp32 sum is exact.
// The halfword unsigned maximum (Larger) or minimum: one instruction on sm_90, else per half.
template <bool Larger>
MXSCOPE_HD constexpr std::uint32_t pick_u16x2(std::uint32_t a, std::uint32_t b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && !defined(__HIP__)
  if (!__builtin_is_constant_evaluated()) {
    std::uint32_t r = 0;
    if constexpr (Larger) {
      asm("max.u16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
    } else {
      asm("min.u16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
    }
    return r;
  }
#endif
  std::uint32_t out = 0;
  for (int shift = 0; shift < 32; shift += 16) {
    const std::uint32_t x = (a >> shift) & 0xffffU, y = (b >> shift) & 0xffffU;
    out |= ((x > y) == Larger ? x : y) << shift;
  }
  return out;
}

MXSCOPE_HD constexpr std::uint32_t max_u16x2(std::uint32_t a, std::uint32_t b) { return pick_u16x2<true>(a, b); }
MXSCOPE_HD constexpr std::uint32_t min_u16x2(std::uint32_t a, std::uint32_t b) { return pick_u16x2<false>(a, b); }

MXSCOPE_HD constexpr std::uint32_t add_bf16x2(std::uint32_t a, std::uint32_t b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && !defined(__HIP__)
  if (!__builtin_is_constant_evaluated()) {
    std::uint32_t r = 0;
    asm("add.rn.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
    return r;
  }
#endif
  const float low = core::bits_float(a << 16) + core::bits_float(b << 16);
  const float high = core::bits_float(a & 0xffff0000U) + core::bits_float(b & 0xffff0000U);
  return static_cast<std::uint32_t>(core::float_to_bf16(high)) << 16 | core::float_to_bf16(low);
}

// The two codes (0..7) of a word of bf16 magnitudes, in its two halves.
MXSCOPE_HD constexpr std::uint32_t fp4_nearest_even_bf16x2(std::uint32_t magnitudes, fp4_unscaled_bf16x2 block) {
  const std::uint32_t clamped = min_u16x2(magnitudes, block.six);
  const std::uint32_t binade = max_u16x2(clamped & 0x7f807f80U, block.one);
  const std::uint32_t sum = add_bf16x2(clamped, binade + (6U << 7) * 0x10001U);
  return sum - binade + ((binade >> 6) + block.offset);
}

// Saturated elements of the word (magnitude above six), as one count per half: bit 15 of
// m - c + 0x7fff (and bit 31 for the high half) is set exactly when m > c = min(m, six).
MXSCOPE_HD constexpr std::uint32_t fp4_saturated_bf16x2(std::uint32_t magnitudes, fp4_unscaled_bf16x2 block) {
  const std::uint32_t above = magnitudes - min_u16x2(magnitudes, block.six) + 0x7fff7fffU;
  return (above & 0x80008000U) >> 15;
}

// Every rounding mode, in integers. fp4_locate splits scaled into the grid index of the largest
// grid point <= scaled (floor_code) and the rest as 32 fraction bits of a spacing:
// fraction = floor(F 2^32), F = (scaled - grid point) / spacing. From 1 on, scaled / spacing =
// S 2^-22 (S the 24-bit significand), so the fraction is S's low 22 bits and the index is
// 2 (biased exponent - 127) + S's bit 22, i.e. (bits >> 22) - 252. Below 1, 2 scaled =
// S 2^(biased - 149): the fraction is S shifted by biased - 117 (to the left for scaled >= 2^-10,
// where the integer bit falls out of the 32 bits; to the right below, where F < 2^-8 and the
// dropped bits cannot matter) and the index is 1 on [1/2, 1), 0 below.
struct fp4_position {
  std::uint32_t floor_code;
  std::uint32_t fraction;
};

MXSCOPE_HD constexpr fp4_position fp4_locate(float scaled) {
  const std::uint32_t bits = core::float_bits(scaled);
  const int biased = static_cast<int>(bits >> 23);
  // The hidden bit is set for subnormals too: they shift out entirely (shift <= -117).
  const std::uint32_t significand = (bits & 0x007fffffU) | 0x00800000U;
  const int shift = (biased < 127 ? biased : 127) - 117;
  const std::uint32_t fraction = shift >= 0 ? significand << shift : significand >> (-shift < 31 ? -shift : 31);
  const int from_one = static_cast<int>(bits >> 22) - 252;
  const int below_one = bits >= 0x3f000000U ? 1 : 0;  // scaled >= 1/2
  return {static_cast<std::uint32_t>(from_one > below_one ? from_one : below_one), fraction};
}

// The rounding decision as a carry: round up iff fraction + addend >= 2^32. rne: F > 1/2, or
// F = 1/2 and the floor code odd; rna: F >= 1/2; rtz: never; sr with R bits: floor(F 2^R) + draw
// >= 2^R, draw = word >> (32 - R), which is the carry of fraction + (word with its low 32 - R
// bits cleared) (the fraction's own low bits meet zeros there and cannot carry). `random_mask` is
// ~0 << (32 - R) (fp4_random_mask).
MXSCOPE_HD constexpr std::uint32_t fp4_random_mask(int sr_bits) { return ~0U << (32 - sr_bits); }

MXSCOPE_HD constexpr std::uint32_t fp4_round_addend(core::rounding_mode mode, std::uint32_t floor_code,
                                                    std::uint32_t random_word, std::uint32_t random_mask) {
  switch (mode) {
    case core::rounding_mode::rne: return 0x7fffffffU + (floor_code & 1U);
    case core::rounding_mode::rna: return 0x80000000U;
    case core::rounding_mode::rtz: return 0U;
    case core::rounding_mode::sr: return random_word & random_mask;
  }
  return 0U;
}

MXSCOPE_HD constexpr std::uint32_t fp4_round(fp4_position position, std::uint32_t addend) {
  const std::uint32_t carry = position.fraction + addend < addend ? 1U : 0U;
  const std::uint32_t code = position.floor_code + carry;
  return code < 7U ? code : 7U;
}

// core::quantize_element(fp4_e2m1, value, exponent, mode, random_word, sr_bits) for a finite value,
// -127 <= exponent <= 127 and 1 <= sr_bits <= 32, composed as the fused kernel composes it
// (nearest-even through fp4_nearest_even, the other modes through fp4_locate and fp4_round).
MXSCOPE_HD constexpr core::encoded fp4_encode(float value, int exponent, core::rounding_mode mode,
                                              std::uint32_t random_word, int sr_bits) {
  const float magnitude = core::bits_float(core::float_bits(value) & 0x7fffffffU);  // |value|, -0 included
  const float scaled = magnitude * power_of_two(-exponent);
  std::uint32_t code = 0;
  if (mode == core::rounding_mode::rne) {
    code = fp4_nearest_even(scaled);
  } else {
    const fp4_position position = fp4_locate(scaled);
    code = fp4_round(position, fp4_round_addend(mode, position.floor_code, random_word, fp4_random_mask(sr_bits)));
  }
  const std::uint32_t sign = (core::float_bits(value) >> 31) << 3;
  return {static_cast<std::uint8_t>(code | sign), scaled > 6.0f, code == 0 && magnitude != 0.0f};
}

// fp4_encode's rne code through fp4_nearest_even_unscaled, or with `stochastic` its sr code (32
// random bits, `word`) through fp4_stochastic_unscaled, where they apply (the fused kernel's
// composition), for the tests.
MXSCOPE_HD constexpr core::encoded fp4_encode_unscaled(float value, int exponent, bool stochastic = false,
                                                       std::uint32_t word = 0) {
  const float magnitude = core::bits_float(core::float_bits(value) & 0x7fffffffU);
  const fp4_unscaled block = fp4_unscaled_constants(exponent);
  const std::uint32_t code =
      stochastic ? fp4_stochastic_unscaled(magnitude, word, block) : fp4_nearest_even_unscaled(magnitude, block);
  const std::uint32_t sign = (core::float_bits(value) >> 31) << 3;
  return {static_cast<std::uint8_t>(code | sign), magnitude > block.six, code == 0 && magnitude != 0.0f};
}

// fp4_stochastic_anchored_sum composed as the fused kernel does, for the tests: the encoding (code
// with its sign, flags) and whether the sum decided it; where it did not, the kernel's answer is
// fp4_encode_unscaled's. Only for |value| < 8 2^e (the kernel's blocks).
struct sum_encoded {
  core::encoded encoded;
  bool decided = true;
};

MXSCOPE_HD constexpr sum_encoded fp4_encode_stochastic_anchored(float value, int exponent, std::uint32_t word) {
  const float magnitude = core::bits_float(core::float_bits(value) & 0x7fffffffU);
  const std::uint32_t sum = fp4_stochastic_anchored_sum(magnitude, word, fp4_stochastic_anchor(exponent));
  const std::uint32_t code = fp4_stochastic_anchored_saturate(sum >> 22);
  const std::uint32_t sign = (core::float_bits(value) >> 31) << 3;
  const float six = 6.0f * power_of_two(exponent);
  return {{static_cast<std::uint8_t>(code | sign), magnitude > six, code == 0 && magnitude != 0.0f},
          !fp4_stochastic_sum_undecided(sum)};
}

static_assert(fp4_encode_stochastic_anchored(1.25f, 0, 0x7fffffffU).encoded.code == 2 &&
              fp4_encode_stochastic_anchored(1.25f, 0, 0x80000000U).encoded.code == 3 &&
              fp4_encode_stochastic_anchored(0.0f, 0, 0xffffffffU).encoded.code == 0 &&
              fp4_encode_stochastic_anchored(6.0f, 0, 0xffffffffU).encoded.code == 7 &&
              fp4_encode_stochastic_anchored(7.9f, 0, 0xffffffffU).encoded.code == 7 &&  // sum >> 22 = 8
              fp4_encode_stochastic_anchored(7.9f, 0, 0xffffffffU).encoded.saturated &&
              fp4_encode_stochastic_anchored(-5.0f, 0, 0x7fffffffU).encoded.code == 0xE &&
              fp4_encode_stochastic_anchored(-5.0f, 0, 0x80000000U).encoded.code == 0xF &&
              fp4_encode_stochastic_anchored(1.75f, 0, 0x7fffffffU).encoded.code == 3 &&
              fp4_encode_stochastic_anchored(1.75f, 0, 0x80000000U).encoded.code == 4 &&  // up into the next binade
              fp4_encode_stochastic_anchored(0.75f, 10, 0xffffffffU).encoded.code == 1 &&  // a subnormal anchor
              !fp4_encode_stochastic_anchored(0x1p-33f, 0, 0xfffffffeU).decided &&        // F 2^32 = 1: bits past 22
              fp4_encode_stochastic_anchored(0x1p-33f, 0, 0xfffff7feU).decided &&
              fp4_encode_stochastic_anchored(0x1p-33f, 0, 0xfffff7feU).encoded.code == 0 &&
              fp4_encode_stochastic_anchored(0x1p-149f, -127, 0xffffffffU).encoded.code == 1);
static_assert(fp4_encode_unscaled(1.25f, 0, true, 0x7fffffffU).code == 2 &&   // F = 1/2: stays below...
              fp4_encode_unscaled(1.25f, 0, true, 0x80000000U).code == 3 &&   // ...until the word reaches 2^31
              fp4_encode_unscaled(0.0f, 0, true, 0xffffffffU).code == 0 &&    // F = 0 never rounds up
              fp4_encode_unscaled(6.0f, 0, true, 0xffffffffU).code == 7 &&
              fp4_encode_unscaled(-5.0f, 0, true, 0x7fffffffU).code == 0xE &&  // 5 = 4 + 1/2 of the spacing 2
              fp4_encode_unscaled(-5.0f, 0, true, 0x80000000U).code == 0xF &&
              fp4_encode_unscaled(100.0f, 0, true, 0xffffffffU).saturated &&
              fp4_encode_unscaled(0x1p-40f, 0, true, 0xffffffffU).code == 0 &&  // F 2^32 = 2^-7: floor 0
              fp4_encode_unscaled(0x1p-33f, 0, true, 0xffffffffU).code == 1 &&  // F 2^32 = 1: 1 + word = 2^32
              fp4_encode_unscaled(0x1p-33f, 0, true, 0xfffffffeU).code == 0);
static_assert(fp4_encode_unscaled(0.25f, 0).code == 0 && fp4_encode_unscaled(0.75f, 0).code == 2 &&
              fp4_encode_unscaled(-1.25f, 0).code == 0xA && fp4_encode_unscaled(1.75f, 0).code == 4 &&
              fp4_encode_unscaled(20.0f, 2).code == 6 && fp4_encode_unscaled(14.0f, 1).code == 7 &&
              fp4_encode_unscaled(6.0f, 0).code == 7 && !fp4_encode_unscaled(6.0f, 0).saturated &&
              fp4_encode_unscaled(6.5f, 0).saturated && fp4_encode_unscaled(0.1f, 0).flushed);
// fp4_nearest_even_bf16x2 on one bf16 value placed in the given half (the other half holds
// `other`), composed as the kernel does, for the tests: the code with its sign, and the flags.
MXSCOPE_HD constexpr core::encoded fp4_encode_bf16x2(std::uint16_t value, std::uint16_t other, bool high, int exponent) {
  const fp4_unscaled_bf16x2 block = fp4_unscaled_bf16x2_constants(exponent);
  const std::uint32_t word = high ? static_cast<std::uint32_t>(value) << 16 | other
                                  : static_cast<std::uint32_t>(other) << 16 | value;
  const std::uint32_t magnitudes = word & 0x7fff7fffU;
  const int shift = high ? 16 : 0;
  const std::uint32_t code = (fp4_nearest_even_bf16x2(magnitudes, block) >> shift) & 0xffffU;
  const bool saturated = ((fp4_saturated_bf16x2(magnitudes, block) >> shift) & 0xffffU) != 0;
  const std::uint32_t sign = static_cast<std::uint32_t>(value >> 15) << 3;
  return {static_cast<std::uint8_t>(code | sign), saturated, code == 0 && (value & 0x7fffU) != 0};
}

static_assert(fp4_encode_bf16x2(0x3e80, 0x40c0, false, 0).code == 0 &&  // 0.25: tie to 0
              fp4_encode_bf16x2(0x3f40, 0, true, 0).code == 2 &&         // 0.75: tie to 1
              fp4_encode_bf16x2(0xbfa0, 0x7f7f, false, 0).code == 0xA &&  // -1.25
              fp4_encode_bf16x2(0x41a0, 0x0001, true, 2).code == 6 &&     // 20 at 2^2: 5, tie to 4
              fp4_encode_bf16x2(0x40c0, 0, false, 0).code == 7 && !fp4_encode_bf16x2(0x40c0, 0, false, 0).saturated &&
              fp4_encode_bf16x2(0x40d0, 0, true, 0).saturated && fp4_encode_bf16x2(0x3dcd, 0, false, 0).flushed);
static_assert(fp4_nearest_even(0.25f) == 0 && fp4_nearest_even(0.75f) == 2 && fp4_nearest_even(1.25f) == 2 &&
              fp4_nearest_even(1.75f) == 4 && fp4_nearest_even(2.5f) == 4 && fp4_nearest_even(3.5f) == 6 &&
              fp4_nearest_even(5.0f) == 6 && fp4_nearest_even(5.5f) == 7 && fp4_nearest_even(100.0f) == 7);
static_assert(fp4_encode(0.75f, 0, core::rounding_mode::rna, 0, 32).code == 2 &&
              fp4_encode(-0.74f, 0, core::rounding_mode::rtz, 0, 32).code == 0x9 &&
              fp4_encode(0.1f, 0, core::rounding_mode::rne, 0, 32).flushed &&
              fp4_encode(6.5f, 0, core::rounding_mode::rne, 0, 32).saturated);

}  // namespace mxscope::gpu::fast_encode
