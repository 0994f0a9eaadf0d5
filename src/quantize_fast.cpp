// Fast MX quantizer (see include/mxscope/quantize_fast.hpp for what it covers and why it is exact).
//
// Scalar form (tails, odd block sizes, builds without Highway): core/encode_bits.hpp's
// quantize_finite, the same integer encoder the GPU quantizers use. With
// |v| = S * 2^t (S the 24-bit significand with its leading one restored, t the exponent of its
// last bit) and the block's shared exponent e:
//   binade = max(floor(log2 |v / 2^e|), min normal exponent of the element format)
//   ulp    = 2^(binade - mantissa_bits)            (the element format's spacing at |v / 2^e|)
//   steps  = S * 2^(t - e) / ulp = S / 2^shift, shift = binade - mantissa_bits + e - t >= 6
//   code   = ((binade + bias - 1) << mantissa_bits) + round(steps), then clamped to the largest
//            finite code (a carry out of the mantissa lands in the exponent field by itself).
// `round` looks only at the dropped bits of S, so every rounding mode is exact integer arithmetic.
// Vector form for rne, rna and rtz: |v| * 2^-e and the value in ulps are exact fp32 products
// (EncodeMagnitudes below says why), and the fp32 to int32 conversion does the rounding.
// The shared exponent comes from the bits of the block's amax. The dequantized value is the
// element's exact fp32 value times 2^e as an fp32 product, which is exact (or overflows to inf)
// for every code and exponent, as the canonical double product rounded to fp32 is.
//
// The file is compiled once per SIMD target by Highway's foreach_target mechanism: the part inside
// the include guard below is shared, the HWY_NAMESPACE part is per target, and the HWY_ONCE part
// holds the drivers and the public functions.

#ifndef MXSCOPE_SRC_QUANTIZE_FAST_SHARED
#define MXSCOPE_SRC_QUANTIZE_FAST_SHARED

// SSSE3-only CPUs are rare and AVX3_DL adds nothing this code uses over AVX3: skipping both keeps
// the compile time of this file down. The baseline target of GCC 12 (HWY_SCALAR, one lane) lacks
// some of the operations below and uses the portable loops instead.
#ifndef HWY_DISABLED_TARGETS
#define HWY_DISABLED_TARGETS (HWY_SSSE3 | HWY_AVX3_DL)
#endif

#include "mxscope/quantize_fast.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cfenv>
#include <cfloat>
#include <cstdlib>
#include <cstring>
#include <limits>

#include "mxscope/core/encode_bits.hpp"
#include "mxscope/errors.hpp"

namespace mxscope::fast_detail {

namespace core = mxscope::core;

inline constexpr std::uint32_t fp32_magnitude_mask = 0x7fffffffU;
inline constexpr std::int32_t fp32_infinity_bits = 0x7f800000;
inline constexpr std::uint32_t fp32_quiet_nan_bits = 0x7fc00000U;  // std::numeric_limits<float>::quiet_NaN()
// |v / 2^e| has floor(log2) = leading_biased + biased - binade_bias - e, where leading_biased is the
// fp32 biased exponent of the significand S converted to float (127 + its leading bit position),
// biased is v's exponent field (at least 1) and 150 = 127 + 23 is the bias of the last bit.
inline constexpr std::int32_t binade_bias = 127 + 150;
// Rounding shifts at or above this drop all 24 significand bits and leave less than half: they
// round to zero under rne, rna and rtz, so the shift is clamped there.
inline constexpr std::int32_t all_dropped_shift = 25;

// The element format's constants, derived from the core format table.
struct element_params {
  core::element_kind kind;
  int bits;
  int mantissa_bits;
  int bias;
  int min_exponent;  // exponent of the smallest normal value
  int emax;          // exponent of the largest power of two <= max normal
  std::int32_t max_code;          // the largest finite magnitude code
  std::uint32_t sign_bit;         // the sign bit of a code
  std::uint32_t max_significand;  // max normal / 2^emax with its leading one at bit 23 (scale rule ceil)
  double max_normal;
  std::uint32_t max_normal_bits;  // fp32 bits of the max normal
  float magnitude_value[128];  // exact value of each magnitude code 0..max_code
};

inline element_params make_params(core::element_kind kind) {
  const auto& format = core::spec(kind);
  element_params params{};
  params.kind = kind;
  params.bits = format.bits;
  params.mantissa_bits = format.mantissa_bits;
  params.bias = format.bias;
  params.min_exponent = core::min_normal_exponent(kind);
  params.emax = core::emax_elem(kind);
  params.max_code = static_cast<std::int32_t>(core::max_finite_code(kind));
  params.sign_bit = core::sign_bit(kind);
  params.max_normal = core::max_normal(kind);
  params.max_normal_bits = core::float_bits(static_cast<float>(params.max_normal));
  params.max_significand = static_cast<std::uint32_t>(params.max_normal * core::pow2(23 - params.emax));
  for (std::int32_t code = 0; code <= params.max_code; ++code) {
    params.magnitude_value[code] = static_cast<float>(core::decode(kind, static_cast<std::uint32_t>(code)));
  }
  return params;
}

// The block's shared exponent (core::shared_exponent) computed from the bits of a finite amax >= 0.
inline int shared_exponent_from_bits(const element_params& params, core::scale_rule rule, std::uint32_t amax_bits) {
  if (amax_bits == 0) return core::scale_exponent_min;
  const int biased = static_cast<int>(amax_bits >> 23);
  int leading = 0;
  std::uint32_t significand = 0;  // normalized: the leading one at bit 23
  if (biased != 0) {
    leading = biased - 127;
    significand = (amax_bits & 0x007fffffU) | 0x00800000U;
  } else {
    const int top_bit = 31 - __builtin_clz(amax_bits);
    leading = -149 + top_bit;
    significand = amax_bits << (23 - top_bit);
  }
  int exponent = leading - params.emax;
  switch (rule) {
    case core::scale_rule::floor: break;
    case core::scale_rule::ceil:
      if (significand > params.max_significand) ++exponent;
      break;
    case core::scale_rule::even: {
      const int dropped_bits = 23 - params.mantissa_bits;
      const std::uint32_t kept = significand >> dropped_bits;
      const std::uint32_t rounded = (significand + (1U << (dropped_bits - 1)) - 1U + (kept & 1U)) >> dropped_bits;
      if (rounded >= (1U << (params.mantissa_bits + 1))) ++exponent;
      break;
    }
  }
  return std::clamp(exponent, core::scale_exponent_min, core::scale_exponent_max);
}

// 2^e as fp32 for -149 <= e <= 127 (exact; subnormal below -126).
inline float power_of_two_float(int exponent) {
  if (exponent >= -126) return core::bits_float(static_cast<std::uint32_t>(exponent + 127) << 23);
  return core::bits_float(1U << (exponent + 149));
}

// What every element of a block needs from its shared exponent e (-127 <= e <= 127).
struct block_constants {
  int exponent;
  std::int32_t binade_offset;         // binade_bias + e
  std::int32_t saturation_threshold;  // bits of max normal * 2^e: a larger |v| saturates
  float scale_power;                  // 2^e
  float inverse_scale;                // 2^-e (e = 127 cannot occur: it needs amax >= 2^(127 + emax))
};

inline block_constants make_block_constants(const element_params& params, int exponent) {
  block_constants constants{};
  constants.exponent = exponent;
  constants.binade_offset = binade_bias + exponent;
  // max normal * 2^e has few significant bits and its exponent is at least emax - 127 >= -125, so
  // it is the max normal's bits with e added to the exponent field, unless that overflows; then
  // no finite input saturates.
  constants.saturation_threshold =
      127 + params.emax + exponent >= 255
          ? fp32_infinity_bits
          : static_cast<std::int32_t>(params.max_normal_bits + static_cast<std::uint32_t>(exponent * (1 << 23)));
  constants.scale_power = power_of_two_float(exponent);
  constants.inverse_scale = power_of_two_float(std::min(-exponent, 127));
  return constants;
}

inline void store_code(std::uint8_t* code_row, int bits, std::int64_t column, std::uint32_t code) {
  if (bits == 4) {
    // The even element comes first along a row and owns the byte; the odd one adds its nibble.
    std::uint8_t& byte = code_row[column / 2];
    byte = (column % 2 == 0) ? static_cast<std::uint8_t>(code) : static_cast<std::uint8_t>(byte | (code << 4));
  } else {
    code_row[column] = static_cast<std::uint8_t>(code);
  }
}

// Random words of the canonical stream for flat indices first .. first + count - 1.
inline void fill_random_words(const core::random_stream& stream, std::uint64_t first, std::int64_t count,
                              std::uint32_t* words) {
  std::int64_t i = 0;
  while (i < count) {
    const std::uint64_t index = first + static_cast<std::uint64_t>(i);
    const core::philox_block block = stream.block(index / 4);
    for (std::uint64_t lane = index % 4; lane < 4 && i < count; ++lane, ++i) words[i] = block.word[lane];
  }
}

// Everything the per-target kernels need, shared by all rows.
struct kernel_arguments {
  const float* input = nullptr;
  std::int64_t rows = 0;
  std::int64_t cols = 0;
  const element_params* params = nullptr;
  core::rounding_mode rounding = core::rounding_mode::rne;
  core::scale_rule rule = core::scale_rule::floor;
  int sr_bits = 32;
  core::random_stream stream;
  int block = 32;
  int axis = 1;
  mx_destination destination;
  std::int64_t code_row_bytes = 0;
  std::int64_t scale_cols = 0;
  // Fused rotation along axis 1 (size 0: none).
  int rotation_size = 0;
  const float* rotation_signs = nullptr;  // +-1 per column, or null
  float rotation_scale = 1.0f;
};

// Per-thread working memory, sized for one row (or one block of rows for axis 0).
struct thread_scratch {
  std::vector<std::int32_t> binade_offset;  // per column: binade_bias + e of its block
  std::vector<std::int32_t> threshold;      // per column: saturation threshold bits
  std::vector<float> scale_power;           // per column: 2^e
  std::vector<float> inverse_scale;         // per column: 2^-e
  std::vector<std::int32_t> nan_block;      // per column: -1 when its block holds a NaN or Inf
  std::vector<std::int32_t> column_amax;    // axis 0: per column, amax bits of the block of rows
  std::vector<std::uint32_t> words;         // sr: the random words of one row
  std::vector<float> rotated_row;           // fused rotation: the rotated row

  void prepare(std::int64_t cols) {
    const auto size = static_cast<std::size_t>(cols);
    binade_offset.resize(size);
    threshold.resize(size);
    scale_power.resize(size);
    inverse_scale.resize(size);
    nan_block.resize(size);
    column_amax.resize(size);
    words.resize(size);
    rotated_row.resize(size);
  }
};

inline void set_lane_constants(thread_scratch& scratch, std::int64_t begin, std::int64_t end,
                               const block_constants& constants, bool nan_block) {
  for (std::int64_t c = begin; c < end; ++c) {
    const auto at = static_cast<std::size_t>(c);
    scratch.binade_offset[at] = constants.binade_offset;
    scratch.threshold[at] = nan_block ? std::numeric_limits<std::int32_t>::max() : constants.saturation_threshold;
    scratch.scale_power[at] = constants.scale_power;
    scratch.inverse_scale[at] = constants.inverse_scale;
    scratch.nan_block[at] = nan_block ? -1 : 0;
  }
}

inline const float* row_input(const kernel_arguments& args, const thread_scratch& scratch, std::int64_t row) {
  return args.rotation_size != 0 ? scratch.rotated_row.data() : args.input + row * args.cols;
}

// Axis 1, any block: amax, counts and scales of each block of the row, and the per-column constants.
inline void prepare_row_axis1(const kernel_arguments& args, const float* row, std::int64_t row_index,
                              thread_scratch& scratch, quantize_counts& counts) {
  const auto& params = *args.params;
  for (std::int64_t begin = 0, b = 0; begin < args.cols; begin += args.block, ++b) {
    const std::int64_t end = std::min(args.cols, begin + args.block);
    std::uint32_t amax = 0;
    for (std::int64_t c = begin; c < end; ++c) {
      const std::uint32_t magnitude = core::float_bits(row[c]) & fp32_magnitude_mask;
      counts.nonzero_inputs += magnitude != 0;
      counts.nonfinite_inputs += magnitude >= static_cast<std::uint32_t>(fp32_infinity_bits);
      amax = std::max(amax, magnitude);
    }
    const bool nan_block = amax >= static_cast<std::uint32_t>(fp32_infinity_bits);
    const int exponent = nan_block ? 0 : shared_exponent_from_bits(params, args.rule, amax);
    args.destination.scales[row_index * args.scale_cols + b] =
        nan_block ? core::scale_nan_code : core::scale_code(exponent);
    set_lane_constants(scratch, begin, end, make_block_constants(params, exponent), nan_block);
  }
}

// Axis 0: the amax bits of each column over rows [first_row, last_row) and their counts.
inline void column_statistics_scalar(const kernel_arguments& args, std::int64_t first_row, std::int64_t last_row,
                                     std::int64_t first_column, thread_scratch& scratch, quantize_counts& counts) {
  for (std::int64_t r = first_row; r < last_row; ++r) {
    const float* row = args.input + r * args.cols;
    for (std::int64_t c = first_column; c < args.cols; ++c) {
      const std::int32_t magnitude = static_cast<std::int32_t>(core::float_bits(row[c]) & fp32_magnitude_mask);
      counts.nonzero_inputs += magnitude != 0;
      counts.nonfinite_inputs += magnitude >= fp32_infinity_bits;
      auto& amax = scratch.column_amax[static_cast<std::size_t>(c)];
      amax = std::max(amax, magnitude);
    }
  }
}

// Axis 0: scales and per-column constants of the block of rows `row_block` from column_amax.
inline void prepare_columns_axis0(const kernel_arguments& args, std::int64_t row_block, thread_scratch& scratch) {
  const auto& params = *args.params;
  for (std::int64_t c = 0; c < args.cols; ++c) {
    const auto amax = static_cast<std::uint32_t>(scratch.column_amax[static_cast<std::size_t>(c)]);
    const bool nan_block = amax >= static_cast<std::uint32_t>(fp32_infinity_bits);
    const int exponent = nan_block ? 0 : shared_exponent_from_bits(params, args.rule, amax);
    args.destination.scales[row_block * args.cols + c] = nan_block ? core::scale_nan_code : core::scale_code(exponent);
    set_lane_constants(scratch, c, c + 1, make_block_constants(params, exponent), nan_block);
  }
}

// Encodes columns [begin, end) of one row with the per-column constants of the scratch.
inline void encode_row_scalar(const kernel_arguments& args, const float* row, std::int64_t row_index,
                              std::int64_t begin, std::int64_t end, const thread_scratch& scratch,
                              quantize_counts& counts) {
  const auto& params = *args.params;
  const core::encode_bits::element_constants element = core::encode_bits::constants_of(params.kind);
  std::uint8_t* code_row = args.destination.codes + row_index * args.code_row_bytes;
  float* dequantized_row = args.destination.dequantized != nullptr ? args.destination.dequantized + row_index * args.cols
                                                                   : nullptr;
  for (std::int64_t c = begin; c < end; ++c) {
    const auto at = static_cast<std::size_t>(c);
    if (scratch.nan_block[at] != 0) {
      store_code(code_row, params.bits, c, 0U);
      if (dequantized_row != nullptr) dequantized_row[c] = core::bits_float(fp32_quiet_nan_bits);
      continue;
    }
    // The one integer encoder (core/encode_bits.hpp), also the GPU's; the SIMD lanes below are its
    // vector form.
    const int exponent = scratch.binade_offset[at] - binade_bias;
    const std::uint32_t word = args.rounding == core::rounding_mode::sr ? scratch.words[at] : 0U;
    const core::encoded code =
        core::encode_bits::quantize_finite(element, row[c], exponent, args.rounding, word, args.sr_bits);
    store_code(code_row, params.bits, c, code.code);
    if (dequantized_row != nullptr) dequantized_row[c] = core::encode_bits::dequantize(element, code.code, exponent);
    counts.flushed += code.flushed;
    counts.saturated += code.saturated;
  }
}

inline void fill_row_words(const kernel_arguments& args, std::int64_t row_index, thread_scratch& scratch) {
  if (args.rounding != core::rounding_mode::sr) return;
  fill_random_words(args.stream, static_cast<std::uint64_t>(row_index * args.cols), args.cols, scratch.words.data());
}

// The rotation of one row, segment by segment, with the core's canonical function.
inline void rotate_row_scalar(const kernel_arguments& args, std::int64_t row_index, thread_scratch& scratch) {
  const float* source = args.input + row_index * args.cols;
  float* rotated = scratch.rotated_row.data();
  std::copy(source, source + args.cols, rotated);
  for (std::int64_t begin = 0; begin < args.cols; begin += args.rotation_size) {
    core::rotate_segment(rotated + begin, args.rotation_size,
                         args.rotation_signs != nullptr ? args.rotation_signs + begin : nullptr);
  }
}

// The portable driver for lines [first, last): rows for axis 1, blocks of rows for axis 0.
inline void quantize_lines_portable(const kernel_arguments& args, std::int64_t first, std::int64_t last,
                                    thread_scratch& scratch, quantize_counts& counts) {
  if (args.axis == 1) {
    for (std::int64_t r = first; r < last; ++r) {
      if (args.rotation_size != 0) rotate_row_scalar(args, r, scratch);
      const float* row = row_input(args, scratch, r);
      prepare_row_axis1(args, row, r, scratch, counts);
      fill_row_words(args, r, scratch);
      encode_row_scalar(args, row, r, 0, args.cols, scratch, counts);
    }
    return;
  }
  for (std::int64_t row_block = first; row_block < last; ++row_block) {
    const std::int64_t first_row = row_block * args.block;
    const std::int64_t last_row = std::min(args.rows, first_row + args.block);
    std::fill(scratch.column_amax.begin(), scratch.column_amax.end(), 0);
    column_statistics_scalar(args, first_row, last_row, 0, scratch, counts);
    prepare_columns_axis0(args, row_block, scratch);
    for (std::int64_t r = first_row; r < last_row; ++r) {
      fill_row_words(args, r, scratch);
      encode_row_scalar(args, args.input + r * args.cols, r, 0, args.cols, scratch, counts);
    }
  }
}

}  // namespace mxscope::fast_detail

#endif  // MXSCOPE_SRC_QUANTIZE_FAST_SHARED

// ------------------------------------------------------------------------------------------------
// Per-target SIMD kernels.

#if defined(MXSCOPE_HAVE_HWY) && MXSCOPE_HAVE_HWY

#undef HWY_TARGET_INCLUDE
// Highway re-includes this file once per target; the path is relative to the include directory.
#define HWY_TARGET_INCLUDE "../src/quantize_fast.cpp"
#include <hwy/foreach_target.h>  // must come before highway.h
#include <hwy/highway.h>

HWY_BEFORE_NAMESPACE();
namespace mxscope::fast_detail::HWY_NAMESPACE {

#if HWY_TARGET == HWY_SCALAR

void QuantizeLines(const kernel_arguments& args, std::int64_t first, std::int64_t last, thread_scratch& scratch,
                   quantize_counts& counts) {
  quantize_lines_portable(args, first, last, scratch, counts);
}

#else

namespace hn = hwy::HWY_NAMESPACE;
using int_tag = hn::ScalableTag<std::int32_t>;
using float_tag = hn::Rebind<float, int_tag>;
using int_vector = hn::Vec<int_tag>;
using float_vector = hn::Vec<float_tag>;

// Stochastic rounding in lanes: the lane form of core::encode_bits::quantize_finite (sr branch), which needs the
// exact dropped bits. binade_offset = binade_bias + e, shift_offset = binade_offset - 127 -
// mantissa_bits. Returns the clamped magnitude codes.
HWY_INLINE int_vector EncodeMagnitudesStochastic(int_tag di, int_vector magnitude, int_vector binade_offset,
                                                 int_vector shift_offset, const element_params& params, int sr_bits,
                                                 int_vector words) {
  const float_tag df;
  const hn::RebindToUnsigned<int_tag> du;
  const int_vector one = hn::Set(di, 1);
  const int_vector zero = hn::Zero(di);
  const int_vector biased = hn::Max(hn::ShiftRight<23>(magnitude), one);
  const int_vector significand = hn::Sub(magnitude, hn::ShiftLeft<23>(hn::Sub(biased, one)));
  // The leading bit of S from its exact conversion to float (S < 2^24; S = 0 gives 0).
  const int_vector leading_biased = hn::ShiftRight<23>(hn::BitCast(di, hn::ConvertTo(df, significand)));
  const int_vector binade =
      hn::Max(hn::Sub(hn::Add(leading_biased, biased), binade_offset), hn::Set(di, params.min_exponent));
  const int_vector shift = hn::Sub(hn::Add(binade, shift_offset), biased);
  const int_vector clamped = hn::Min(shift, hn::Set(di, 24));
  int_vector steps = hn::operator>>(significand, clamped);
  const int_vector dropped = hn::Sub(significand, hn::operator<<(steps, clamped));
  // floor(F * 2^R) with F = dropped / 2^shift, then up iff it plus the draw reaches 2^R, i.e.
  // top > (2^R - 1) - draw (compared unsigned, all in 32 bits).
  const int_vector scale_up = hn::Sub(hn::Set(di, sr_bits), shift);
  const int_vector top_shifted_up = hn::operator<<(dropped, hn::Max(scale_up, zero));
  const int_vector top_shifted_down = hn::operator>>(dropped, hn::Min(hn::Sub(zero, scale_up), hn::Set(di, 31)));
  const auto top = hn::BitCast(du, hn::IfThenElse(hn::Gt(scale_up, hn::Set(di, -1)), top_shifted_up, top_shifted_down));
  const auto draw = hn::ShiftRightSame(hn::BitCast(du, words), 32 - sr_bits);
  const std::uint32_t all_ones = sr_bits == 32 ? 0xffffffffU : (1U << sr_bits) - 1U;
  const auto up = hn::Gt(top, hn::Sub(hn::Set(du, all_ones), draw));
  steps = hn::Sub(steps, hn::VecFromMask(di, hn::RebindMask(di, up)));
  const int_vector exponent_field =
      hn::ShiftLeftSame(hn::Add(binade, hn::Set(di, params.bias - 1)), params.mantissa_bits);
  return hn::Min(hn::Add(exponent_field, steps), hn::Set(di, params.max_code));
}

// rne, rna and rtz in lanes. |v| * 2^-e is an exact fp32 product: the block's scaled values stay
// below 2^(emax + 1), and a product below the fp32 normal range (where it could round) is far
// below half the element format's smallest subnormal, so it gives code 0 exactly as the exact
// value would. Then units = |v / 2^e| / ulp is exact too (a power-of-two scaling below
// 2^(mantissa_bits + 1)), and the conversion to an integer rounds it: cvtps2dq under
// round-to-nearest-even (the driver sets that mode), truncation for rtz, and a comparison of the
// exact fraction with 1/2 for rna.
template <core::rounding_mode Mode>
HWY_INLINE int_vector EncodeMagnitudes(int_tag di, int_vector magnitude, float_vector inverse_scale,
                                       const element_params& params) {
  const float_tag df;
  const float_vector scaled = hn::Mul(hn::BitCast(df, magnitude), inverse_scale);
  const int_vector binade_biased =
      hn::Max(hn::ShiftRight<23>(hn::BitCast(di, scaled)), hn::Set(di, params.min_exponent + 127));
  // 2^-(binade - mantissa_bits) as fp32: biased exponent 127 - (binade_biased - 127) + mantissa_bits.
  const float_vector inverse_ulp =
      hn::BitCast(df, hn::ShiftLeft<23>(hn::Sub(hn::Set(di, 254 + params.mantissa_bits), binade_biased)));
  const float_vector units = hn::Mul(scaled, inverse_ulp);
  int_vector steps;
  if constexpr (Mode == core::rounding_mode::rne) {
    steps = hn::NearestInt(units);
  } else if constexpr (Mode == core::rounding_mode::rtz) {
    steps = hn::ConvertTo(di, units);
  } else {
    const int_vector truncated = hn::ConvertTo(di, units);
    const float_vector fraction = hn::Sub(units, hn::ConvertTo(df, truncated));
    steps = hn::Sub(truncated, hn::VecFromMask(di, hn::RebindMask(di, hn::Ge(fraction, hn::Set(df, 0.5f)))));
  }
  // code = ((binade + bias - 1) << mantissa_bits) + steps, binade = binade_biased - 127.
  const int_vector exponent_field = hn::Sub(hn::ShiftLeftSame(binade_biased, params.mantissa_bits),
                                            hn::Set(di, (128 - params.bias) << params.mantissa_bits));
  return hn::Min(hn::Add(exponent_field, steps), hn::Set(di, params.max_code));
}

// The exact fp32 value of each magnitude code times 2^e, with the input's sign.
HWY_INLINE float_vector DequantizeMagnitudes(int_tag di, int_vector magnitude_code, int_vector input_bits,
                                             float_vector scale_power, const element_params& params) {
  const float_tag df;
  const int_vector one = hn::Set(di, 1);
  const int_vector field = hn::Max(hn::ShiftRightSame(magnitude_code, params.mantissa_bits), one);
  const int_vector integer = hn::Sub(magnitude_code, hn::ShiftLeftSame(hn::Sub(field, one), params.mantissa_bits));
  const float_vector unit =
      hn::BitCast(df, hn::ShiftLeft<23>(hn::Add(field, hn::Set(di, 127 - params.bias - params.mantissa_bits))));
  const float_vector magnitude = hn::Mul(hn::Mul(hn::ConvertTo(df, integer), unit), scale_power);
  return hn::Or(magnitude, hn::BitCast(df, hn::And(input_bits, hn::Set(di, static_cast<std::int32_t>(0x80000000U)))));
}

// Stores the codes of 2 * Lanes consecutive elements: packed two per byte for 4-bit formats.
HWY_INLINE void StoreCodes(int_tag di, int_vector codes_low, int_vector codes_high, int bits, std::uint8_t* destination) {
  const hn::Rebind<std::uint8_t, int_tag> du8;
  if (bits == 4) {
    // Viewed as 64-bit lanes, (w | w >> 28) puts the odd element's nibble above the even one's.
    const hn::Repartition<std::uint64_t, int_tag> du64;
    const auto wide_low = hn::BitCast(du64, codes_low);
    const auto wide_high = hn::BitCast(du64, codes_high);
    const int_vector pairs_low = hn::BitCast(di, hn::Or(wide_low, hn::ShiftRight<28>(wide_low)));
    const int_vector pairs_high = hn::BitCast(di, hn::Or(wide_high, hn::ShiftRight<28>(wide_high)));
    hn::StoreU(hn::DemoteTo(du8, hn::ConcatEven(di, pairs_high, pairs_low)), du8, destination);
  } else {
    hn::StoreU(hn::DemoteTo(du8, codes_low), du8, destination);
    hn::StoreU(hn::DemoteTo(du8, codes_high), du8, destination + hn::Lanes(di));
  }
}

HWY_INLINE std::int64_t SumLanes(int_tag di, int_vector counter) {
  return static_cast<std::int64_t>(hn::GetLane(hn::SumOfLanes(di, counter)));
}

// The constants of one vector's lanes.
struct lane_constants {
  int_vector binade_offset;  // sr only
  int_vector threshold;
  float_vector scale_power;
  float_vector inverse_scale;
};

// Encodes (and dequantizes) one vector of elements, counts the saturated ones, and returns the
// magnitude codes in `magnitude_code` and the signed codes.
template <core::rounding_mode Mode, bool Dequantize>
HWY_INLINE int_vector EncodeVector(int_tag di, const float* source, const std::uint32_t* words,
                                   const lane_constants& constants, const element_params& params, int sr_bits,
                                   float* dequantized, int_vector& magnitude, int_vector& magnitude_code,
                                   std::int64_t& saturated) {
  const int_vector bits = hn::BitCast(di, hn::LoadU(float_tag(), source));
  magnitude = hn::And(bits, hn::Set(di, static_cast<std::int32_t>(fp32_magnitude_mask)));
  if constexpr (Mode == core::rounding_mode::sr) {
    const int_vector random_words = hn::LoadU(di, reinterpret_cast<const std::int32_t*>(words));
    magnitude_code = EncodeMagnitudesStochastic(
        di, magnitude, constants.binade_offset,
        hn::Sub(constants.binade_offset, hn::Set(di, 127 + params.mantissa_bits)), params, sr_bits, random_words);
  } else {
    (void)words;
    (void)sr_bits;
    magnitude_code = EncodeMagnitudes<Mode>(di, magnitude, constants.inverse_scale, params);
  }
  saturated += static_cast<std::int64_t>(hn::CountTrue(di, hn::Gt(magnitude, constants.threshold)));
  if constexpr (Dequantize) {
    hn::StoreU(DequantizeMagnitudes(di, magnitude_code, bits, constants.scale_power, params), float_tag(),
               dequantized);
  }
  // The sign bit of v moved to the code's sign position.
  const hn::RebindToUnsigned<int_tag> du;
  const int_vector sign = hn::BitCast(di, hn::ShiftRightSame(hn::BitCast(du, bits), 32 - params.bits));
  return hn::OrAnd(magnitude_code, sign, hn::Set(di, static_cast<std::int32_t>(params.sign_bit)));
}

// Axis 1 when the block is a multiple of 2 * Lanes (e.g. 32): one shared exponent per vector.
// Three passes over the row keep the per-block scalar work out of the vector loops' dependency
// chains: block amax (the row is then in L1), block constants, encode. Flushed elements are
// counted as zero codes minus zero inputs (a zero input always gives a zero code).
template <core::rounding_mode Mode, bool Dequantize>
void QuantizeRowUniformBlocks(const kernel_arguments& args, const float* row, std::int64_t row_index,
                              thread_scratch& scratch, quantize_counts& counts) {
  const int_tag di;
  const float_tag df;
  const auto& params = *args.params;
  const std::int64_t lanes = static_cast<std::int64_t>(hn::Lanes(di));
  const int block = args.block;
  const std::int64_t full_blocks = args.cols / block;
  const std::int64_t full_columns = full_blocks * block;
  std::uint8_t* code_row = args.destination.codes + row_index * args.code_row_bytes;
  std::uint8_t* scale_row = args.destination.scales + row_index * args.scale_cols;
  float* dequantized_row = Dequantize ? args.destination.dequantized + row_index * args.cols : nullptr;
  const std::int64_t code_bytes_per_block = params.bits == 4 ? block / 2 : block;
  const int_vector magnitude_mask = hn::Set(di, static_cast<std::int32_t>(fp32_magnitude_mask));
  const int_vector zero = hn::Zero(di);
  std::int32_t* block_amax = scratch.column_amax.data();

  // Pass 1: amax bits of each block, and the zero inputs.
  std::int64_t zero_inputs = 0;
  for (std::int64_t b = 0; b < full_blocks; ++b) {
    const float* source = row + b * block;
    int_vector amax = zero;
    for (std::int64_t i = 0; i < block; i += lanes) {
      const int_vector magnitude = hn::And(hn::BitCast(di, hn::LoadU(df, source + i)), magnitude_mask);
      amax = hn::Max(amax, magnitude);
      zero_inputs += static_cast<std::int64_t>(hn::CountTrue(di, hn::Eq(magnitude, zero)));
    }
    block_amax[b] = hn::GetLane(hn::MaxOfLanes(di, amax));
  }

  // Pass 2: scales and constants per block.
  for (std::int64_t b = 0; b < full_blocks; ++b) {
    const auto amax_bits = static_cast<std::uint32_t>(block_amax[b]);
    const bool nan_block = amax_bits >= static_cast<std::uint32_t>(fp32_infinity_bits);
    const int exponent = nan_block ? 0 : shared_exponent_from_bits(params, args.rule, amax_bits);
    scale_row[b] = nan_block ? core::scale_nan_code : core::scale_code(exponent);
    const block_constants constants = make_block_constants(params, exponent);
    const auto at = static_cast<std::size_t>(b);
    scratch.binade_offset[at] = constants.binade_offset;
    scratch.threshold[at] = constants.saturation_threshold;
    scratch.scale_power[at] = constants.scale_power;
    scratch.inverse_scale[at] = constants.inverse_scale;
    scratch.nan_block[at] = nan_block ? -1 : 0;
  }

  // Pass 3: encode.
  std::int64_t zero_codes = 0;  // over blocks without NaN or Inf
  std::int64_t zero_inputs_of_nan_blocks = 0;
  std::int64_t saturated = 0;
  for (std::int64_t b = 0; b < full_blocks; ++b) {
    const std::int64_t begin = b * block;
    const float* source = row + begin;
    std::uint8_t* codes = code_row + (params.bits == 4 ? begin / 2 : begin);
    const auto at = static_cast<std::size_t>(b);
    if (scratch.nan_block[at] != 0) {
      for (std::int64_t i = 0; i < block; ++i) {
        const std::uint32_t magnitude = core::float_bits(source[i]) & fp32_magnitude_mask;
        counts.nonfinite_inputs += magnitude >= static_cast<std::uint32_t>(fp32_infinity_bits);
        zero_inputs_of_nan_blocks += magnitude == 0;
      }
      std::memset(codes, 0, static_cast<std::size_t>(code_bytes_per_block));
      if constexpr (Dequantize) {
        std::fill(dequantized_row + begin, dequantized_row + begin + block, core::bits_float(fp32_quiet_nan_bits));
      }
      continue;
    }
    const lane_constants constants{hn::Set(di, scratch.binade_offset[at]), hn::Set(di, scratch.threshold[at]),
                                   hn::Set(df, scratch.scale_power[at]), hn::Set(df, scratch.inverse_scale[at])};
    const std::uint32_t* words = scratch.words.data() + begin;
    for (std::int64_t i = 0; i < block; i += 2 * lanes) {
      float* dequantized = Dequantize ? dequantized_row + begin + i : nullptr;
      int_vector magnitude, magnitude_code;
      const int_vector low = EncodeVector<Mode, Dequantize>(di, source + i, words + i, constants, params, args.sr_bits,
                                                            dequantized, magnitude, magnitude_code, saturated);
      zero_codes += static_cast<std::int64_t>(hn::CountTrue(di, hn::Eq(magnitude_code, zero)));
      const int_vector high =
          EncodeVector<Mode, Dequantize>(di, source + i + lanes, words + i + lanes, constants, params, args.sr_bits,
                                         Dequantize ? dequantized + lanes : nullptr, magnitude, magnitude_code,
                                         saturated);
      zero_codes += static_cast<std::int64_t>(hn::CountTrue(di, hn::Eq(magnitude_code, zero)));
      StoreCodes(di, low, high, params.bits, codes + (params.bits == 4 ? i / 2 : i));
    }
  }
  counts.nonzero_inputs += full_columns - zero_inputs;
  counts.flushed += zero_codes - (zero_inputs - zero_inputs_of_nan_blocks);
  counts.saturated += saturated;

  if (full_columns < args.cols) {
    // The short last block, with the scalar kernel.
    std::uint32_t amax = 0;
    for (std::int64_t c = full_columns; c < args.cols; ++c) {
      const std::uint32_t magnitude = core::float_bits(row[c]) & fp32_magnitude_mask;
      counts.nonzero_inputs += magnitude != 0;
      counts.nonfinite_inputs += magnitude >= static_cast<std::uint32_t>(fp32_infinity_bits);
      amax = std::max(amax, magnitude);
    }
    const bool nan_block = amax >= static_cast<std::uint32_t>(fp32_infinity_bits);
    const int exponent = nan_block ? 0 : shared_exponent_from_bits(params, args.rule, amax);
    scale_row[full_blocks] = nan_block ? core::scale_nan_code : core::scale_code(exponent);
    set_lane_constants(scratch, full_columns, args.cols, make_block_constants(params, exponent), nan_block);
    encode_row_scalar(args, row, row_index, full_columns, args.cols, scratch, counts);
  }
}

// Any layout: per-column constants from the scratch (axis 0, and axis 1 with other block sizes).
template <core::rounding_mode Mode, bool Dequantize>
void EncodeRowWithColumnConstants(const kernel_arguments& args, const float* row, std::int64_t row_index,
                                  const thread_scratch& scratch, quantize_counts& counts) {
  const int_tag di;
  const float_tag df;
  const auto& params = *args.params;
  const std::int64_t lanes = static_cast<std::int64_t>(hn::Lanes(di));
  const std::int64_t vector_columns = args.cols - args.cols % (2 * lanes);
  std::uint8_t* code_row = args.destination.codes + row_index * args.code_row_bytes;
  float* dequantized_row = Dequantize ? args.destination.dequantized + row_index * args.cols : nullptr;
  const int_vector zero = hn::Zero(di);
  const float_vector quiet_nan = hn::Set(df, core::bits_float(fp32_quiet_nan_bits));
  int_vector flushed = zero;
  std::int64_t saturated = 0;
  for (std::int64_t c = 0; c < vector_columns; c += 2 * lanes) {
    int_vector codes[2];
    for (int half = 0; half < 2; ++half) {
      const std::int64_t at = c + half * lanes;
      const lane_constants constants{
          hn::LoadU(di, scratch.binade_offset.data() + at), hn::LoadU(di, scratch.threshold.data() + at),
          hn::LoadU(df, scratch.scale_power.data() + at), hn::LoadU(df, scratch.inverse_scale.data() + at)};
      float* dequantized = Dequantize ? dequantized_row + at : nullptr;
      int_vector magnitude, magnitude_code;
      const int_vector code = EncodeVector<Mode, Dequantize>(di, row + at, scratch.words.data() + at, constants,
                                                             params, args.sr_bits, dequantized, magnitude,
                                                             magnitude_code, saturated);
      // Elements of NaN blocks: code 0, dequantized NaN, not flushed (their thresholds are
      // INT32_MAX, so they were not counted as saturated either).
      const auto nan_mask = hn::MaskFromVec(hn::LoadU(di, scratch.nan_block.data() + at));
      codes[half] = hn::IfThenZeroElse(nan_mask, code);
      const auto flushed_mask = hn::AndNot(hn::Eq(magnitude, zero), hn::Eq(magnitude_code, zero));
      flushed = hn::Sub(flushed, hn::VecFromMask(di, hn::AndNot(nan_mask, flushed_mask)));
      if constexpr (Dequantize) {
        hn::StoreU(hn::IfThenElse(hn::RebindMask(df, nan_mask), quiet_nan, hn::LoadU(df, dequantized)), df,
                   dequantized);
      }
    }
    StoreCodes(di, codes[0], codes[1], params.bits, code_row + (params.bits == 4 ? c / 2 : c));
  }
  counts.flushed += SumLanes(di, flushed);
  counts.saturated += saturated;
  encode_row_scalar(args, row, row_index, vector_columns, args.cols, scratch, counts);
}

// Axis 0: the column amax over a block of rows, with counts.
void ColumnStatistics(const kernel_arguments& args, std::int64_t first_row, std::int64_t last_row,
                      thread_scratch& scratch, quantize_counts& counts) {
  const int_tag di;
  const float_tag df;
  const std::int64_t lanes = static_cast<std::int64_t>(hn::Lanes(di));
  const std::int64_t vector_columns = args.cols - args.cols % lanes;
  const int_vector zero = hn::Zero(di);
  const int_vector magnitude_mask = hn::Set(di, static_cast<std::int32_t>(fp32_magnitude_mask));
  const int_vector below_infinity = hn::Set(di, fp32_infinity_bits - 1);
  int_vector nonzero = zero;
  int_vector nonfinite = zero;
  for (std::int64_t r = first_row; r < last_row; ++r) {
    const float* row = args.input + r * args.cols;
    for (std::int64_t c = 0; c < vector_columns; c += lanes) {
      const int_vector magnitude = hn::And(hn::BitCast(di, hn::LoadU(df, row + c)), magnitude_mask);
      std::int32_t* amax = scratch.column_amax.data() + c;
      hn::StoreU(hn::Max(hn::LoadU(di, amax), magnitude), di, amax);
      nonzero = hn::Sub(nonzero, hn::VecFromMask(di, hn::Ne(magnitude, zero)));
      nonfinite = hn::Sub(nonfinite, hn::VecFromMask(di, hn::Gt(magnitude, below_infinity)));
    }
  }
  counts.nonzero_inputs += SumLanes(di, nonzero);
  counts.nonfinite_inputs += SumLanes(di, nonfinite);
  column_statistics_scalar(args, first_row, last_row, vector_columns, scratch, counts);
}

// v <- fl32(1/sqrt(b)) * H_b (s .* v) on consecutive segments of the row, in the canonical order of
// core::fwht: the same fp32 additions on the same pairs, so the same bits.
void RotateRow(const kernel_arguments& args, std::int64_t row_index, thread_scratch& scratch) {
  const float_tag df;
  const int_tag di;
  const std::int64_t lanes = static_cast<std::int64_t>(hn::Lanes(df));
  const int size = args.rotation_size;
  if (args.cols % lanes != 0 || lanes > 16) {
    rotate_row_scalar(args, row_index, scratch);
    return;
  }
  const float* source = args.input + row_index * args.cols;
  float* rotated = scratch.rotated_row.data();
  const float_vector scale = hn::Set(df, args.rotation_scale);
  const std::int64_t in_register = std::min<std::int64_t>(size, lanes);
  // Stages with pair distance h < Lanes work inside a vector: the partner lane is lane ^ h, and
  // (a, c) -> (a + c, a - c) becomes partner + v * (+1 or -1). v * (+-1) is exact, so the fused
  // multiply-add rounds exactly what fl32(a + c) and fl32(a - c) round.
  const int_vector lane_index = hn::Iota(di, 0);
  const auto partner_indices = [&](std::int64_t half) {
    return hn::IndicesFromVec(df, hn::Xor(lane_index, hn::Set(di, static_cast<std::int32_t>(half < lanes ? half : 0))));
  };
  const auto pair_signs = [&](std::int64_t half) {
    const auto second_of_pair = hn::RebindMask(
        df, hn::Ne(hn::And(lane_index, hn::Set(di, static_cast<std::int32_t>(half))), hn::Zero(di)));
    return hn::IfThenElse(second_of_pair, hn::Set(df, -1.0f), hn::Set(df, 1.0f));
  };
  const auto indices_1 = partner_indices(1), indices_2 = partner_indices(2), indices_4 = partner_indices(4),
             indices_8 = partner_indices(8);
  const float_vector signs_1 = pair_signs(1), signs_2 = pair_signs(2), signs_4 = pair_signs(4), signs_8 = pair_signs(8);
  for (std::int64_t c = 0; c < args.cols; c += lanes) {
    float_vector v = hn::LoadU(df, source + c);
    if (args.rotation_signs != nullptr) v = hn::Mul(v, hn::LoadU(df, args.rotation_signs + c));
    if (in_register > 1) v = hn::MulAdd(v, signs_1, hn::TableLookupLanes(v, indices_1));
    if (in_register > 2) v = hn::MulAdd(v, signs_2, hn::TableLookupLanes(v, indices_2));
    if (in_register > 4) v = hn::MulAdd(v, signs_4, hn::TableLookupLanes(v, indices_4));
    if (in_register > 8) v = hn::MulAdd(v, signs_8, hn::TableLookupLanes(v, indices_8));
    if (size <= lanes) v = hn::Mul(v, scale);
    hn::StoreU(v, df, rotated + c);
  }
  for (std::int64_t half = lanes; half < size; half *= 2) {
    const bool last_stage = 2 * half == size;
    for (std::int64_t start = 0; start < args.cols; start += 2 * half) {
      for (std::int64_t j = start; j < start + half; j += lanes) {
        const float_vector a = hn::LoadU(df, rotated + j);
        const float_vector b = hn::LoadU(df, rotated + j + half);
        float_vector sum = hn::Add(a, b);
        float_vector difference = hn::Sub(a, b);
        if (last_stage) {
          sum = hn::Mul(sum, scale);
          difference = hn::Mul(difference, scale);
        }
        hn::StoreU(sum, df, rotated + j);
        hn::StoreU(difference, df, rotated + j + half);
      }
    }
  }
}

// Philox4x32-10 (core/philox.hpp) for Lanes consecutive counters at once, one counter word per
// vector, then the words stored in stream order: element n gets word n % 4 of block n / 4.
HWY_INLINE void MultiplyWide(hn::RebindToUnsigned<int_tag> du, hn::Vec<hn::RebindToUnsigned<int_tag>> a,
                             std::uint32_t multiplier, hn::Vec<hn::RebindToUnsigned<int_tag>>& high,
                             hn::Vec<hn::RebindToUnsigned<int_tag>>& low) {
  const hn::Repartition<std::uint64_t, int_tag> du64;
  const auto factor = hn::Set(du, multiplier);
  const auto even = hn::MulEven(a, factor);  // 64-bit products of the even lanes
  const auto odd = hn::MulEven(hn::BitCast(du, hn::ShiftRight<32>(hn::BitCast(du64, a))), factor);
  low = hn::OddEven(hn::BitCast(du, hn::ShiftLeft<32>(odd)), hn::BitCast(du, even));
  high = hn::OddEven(hn::BitCast(du, odd), hn::BitCast(du, hn::ShiftRight<32>(even)));
}

void FillRandomWords(const core::random_stream& stream, std::uint64_t first, std::int64_t count,
                     std::uint32_t* words) {
  const hn::RebindToUnsigned<int_tag> du;
  const auto lanes = static_cast<std::int64_t>(hn::Lanes(du));
  // Up to the next multiple of 4 (a Philox block boundary) with the scalar generator.
  std::int64_t i = std::min<std::int64_t>(count, static_cast<std::int64_t>((4 - first % 4) % 4));
  fill_random_words(stream, first, i, words);
  const auto step = hn::Set(du, stream.step);
  const auto tag = hn::Set(du, stream.tag);
  const auto lane_index = hn::Iota(du, 0);
  for (; count - i >= 4 * lanes; i += 4 * lanes) {
    const std::uint64_t block = (first + static_cast<std::uint64_t>(i)) / 4;
    const auto block_low = hn::Set(du, static_cast<std::uint32_t>(block));
    auto c0 = hn::Add(block_low, lane_index);
    // Lanes whose low counter word wrapped carry into the high word.
    auto c1 = hn::Sub(hn::Set(du, static_cast<std::uint32_t>(block >> 32)),
                      hn::VecFromMask(du, hn::Gt(block_low, c0)));
    auto c2 = step;
    auto c3 = tag;
    std::uint32_t key0 = static_cast<std::uint32_t>(stream.seed);
    std::uint32_t key1 = static_cast<std::uint32_t>(stream.seed >> 32);
    for (int round = 0; round < 10; ++round) {
      if (round > 0) {
        key0 += core::detail::philox_w0;
        key1 += core::detail::philox_w1;
      }
      hn::Vec<decltype(du)> high0, low0, high1, low1;
      MultiplyWide(du, c0, core::detail::philox_m0, high0, low0);
      MultiplyWide(du, c2, core::detail::philox_m1, high1, low1);
      c0 = hn::Xor(hn::Xor(high1, c1), hn::Set(du, key0));
      c1 = low1;
      c2 = hn::Xor(hn::Xor(high0, c3), hn::Set(du, key1));
      c3 = low0;
    }
    hn::StoreInterleaved4(c0, c1, c2, c3, du, words + i);
  }
  fill_random_words(stream, first + static_cast<std::uint64_t>(i), count - i, words + i);
}

void FillRowWords(const kernel_arguments& args, std::int64_t row_index, thread_scratch& scratch) {
  if (args.rounding != core::rounding_mode::sr) return;
  FillRandomWords(args.stream, static_cast<std::uint64_t>(row_index * args.cols), args.cols, scratch.words.data());
}

template <core::rounding_mode Mode, bool Dequantize>
void QuantizeLinesTyped(const kernel_arguments& args, std::int64_t first, std::int64_t last, thread_scratch& scratch,
                        quantize_counts& counts) {
  const std::int64_t lanes = static_cast<std::int64_t>(hn::Lanes(int_tag()));
  if (args.axis == 1) {
    const bool uniform = args.block % (2 * lanes) == 0;
    for (std::int64_t r = first; r < last; ++r) {
      if (args.rotation_size != 0) RotateRow(args, r, scratch);
      const float* row = row_input(args, scratch, r);
      FillRowWords(args, r, scratch);
      if (uniform) {
        QuantizeRowUniformBlocks<Mode, Dequantize>(args, row, r, scratch, counts);
      } else {
        prepare_row_axis1(args, row, r, scratch, counts);
        EncodeRowWithColumnConstants<Mode, Dequantize>(args, row, r, scratch, counts);
      }
    }
    return;
  }
  for (std::int64_t row_block = first; row_block < last; ++row_block) {
    const std::int64_t first_row = row_block * args.block;
    const std::int64_t last_row = std::min(args.rows, first_row + args.block);
    std::fill(scratch.column_amax.begin(), scratch.column_amax.end(), 0);
    ColumnStatistics(args, first_row, last_row, scratch, counts);
    prepare_columns_axis0(args, row_block, scratch);
    for (std::int64_t r = first_row; r < last_row; ++r) {
      FillRowWords(args, r, scratch);
      EncodeRowWithColumnConstants<Mode, Dequantize>(args, args.input + r * args.cols, r, scratch, counts);
    }
  }
}

template <bool Dequantize>
void QuantizeLinesForMode(const kernel_arguments& args, std::int64_t first, std::int64_t last,
                          thread_scratch& scratch, quantize_counts& counts) {
  switch (args.rounding) {
    case core::rounding_mode::rne: QuantizeLinesTyped<core::rounding_mode::rne, Dequantize>(args, first, last, scratch, counts); break;
    case core::rounding_mode::rna: QuantizeLinesTyped<core::rounding_mode::rna, Dequantize>(args, first, last, scratch, counts); break;
    case core::rounding_mode::rtz: QuantizeLinesTyped<core::rounding_mode::rtz, Dequantize>(args, first, last, scratch, counts); break;
    case core::rounding_mode::sr: QuantizeLinesTyped<core::rounding_mode::sr, Dequantize>(args, first, last, scratch, counts); break;
  }
}

void QuantizeLines(const kernel_arguments& args, std::int64_t first, std::int64_t last, thread_scratch& scratch,
                   quantize_counts& counts) {
  if (args.destination.dequantized != nullptr) {
    QuantizeLinesForMode<true>(args, first, last, scratch, counts);
  } else {
    QuantizeLinesForMode<false>(args, first, last, scratch, counts);
  }
}

#endif  // HWY_TARGET == HWY_SCALAR

}  // namespace mxscope::fast_detail::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // MXSCOPE_HAVE_HWY

// ------------------------------------------------------------------------------------------------
// Drivers and the public functions (compiled once).

#if !(defined(MXSCOPE_HAVE_HWY) && MXSCOPE_HAVE_HWY) || HWY_ONCE

namespace mxscope {

namespace fast_detail {

#if defined(MXSCOPE_HAVE_HWY) && MXSCOPE_HAVE_HWY
HWY_EXPORT(QuantizeLines);
#endif

void quantize_lines(const kernel_arguments& args, std::int64_t first, std::int64_t last, thread_scratch& scratch,
                    quantize_counts& counts) {
#if defined(MXSCOPE_HAVE_HWY) && MXSCOPE_HAVE_HWY
  HWY_DYNAMIC_DISPATCH(QuantizeLines)(args, first, last, scratch, counts);
#else
  quantize_lines_portable(args, first, last, scratch, counts);
#endif
}

bool covered_element(core::element_kind kind) {
  switch (kind) {
    case core::element_kind::fp4_e2m1:
    case core::element_kind::fp6_e2m3:
    case core::element_kind::fp6_e3m2:
    case core::element_kind::fp8_e4m3:
    case core::element_kind::fp8_e5m2: return true;
    default: return false;
  }
}

const element_params& params_for(core::element_kind kind) {
  static const element_params table[] = {
      make_params(core::element_kind::fp4_e2m1), make_params(core::element_kind::fp6_e2m3),
      make_params(core::element_kind::fp6_e3m2), make_params(core::element_kind::fp8_e4m3),
      make_params(core::element_kind::fp8_e5m2)};
  for (const auto& params : table) {
    if (params.kind == kind) return params;
  }
  throw input_error("fast quantizer: element format not covered");
}

quantize_counts run(const kernel_arguments& args) {
  const std::int64_t lines = args.axis == 1 ? args.rows : (args.rows + args.block - 1) / args.block;
  quantize_counts total;
  if (args.rows == 0 || args.cols == 0) return total;
  std::int64_t nonzero = 0, flushed = 0, saturated = 0, nonfinite = 0;
#pragma omp parallel reduction(+ : nonzero, flushed, saturated, nonfinite)
  {
    // The vector kernels round with the fp32 to int32 conversion, which follows the thread's
    // rounding mode: make it round-to-nearest-even for the duration, whatever the caller set.
    const int caller_rounding = std::fegetround();
    if (caller_rounding != FE_TONEAREST) std::fesetround(FE_TONEAREST);
    thread_scratch scratch;
    scratch.prepare(args.cols);
    quantize_counts local;
#pragma omp for schedule(static)
    for (std::int64_t line = 0; line < lines; ++line) quantize_lines(args, line, line + 1, scratch, local);
    if (caller_rounding != FE_TONEAREST) std::fesetround(caller_rounding);
    nonzero += local.nonzero_inputs;
    flushed += local.flushed;
    saturated += local.saturated;
    nonfinite += local.nonfinite_inputs;
  }
  total.nonzero_inputs = nonzero;
  total.flushed = flushed;
  total.saturated = saturated;
  total.nonfinite_inputs = nonfinite;
  return total;
}

kernel_arguments make_arguments(const float* input, std::int64_t rows, std::int64_t cols,
                                const quantize_options& options, const mx_destination& destination) {
  validate(options, rows, cols, "quantize");
  if (!fast_quantize_covers(options)) {
    throw input_error("quantize: the fast path does not cover these options (MX with fp4, fp6 or fp8 elements)");
  }
  if (destination.codes == nullptr || destination.scales == nullptr) {
    throw input_error("quantize: the fast path needs code and scale buffers");
  }
  kernel_arguments args;
  args.input = input;
  args.rows = rows;
  args.cols = cols;
  args.params = &params_for(options.format.element);
  args.rounding = options.rounding;
  args.rule = options.rule;
  args.sr_bits = options.sr_bits;
  args.stream = options.stream;
  args.block = options.block > 0 ? options.block : options.format.default_block;
  args.axis = options.axis;
  args.destination = destination;
  args.code_row_bytes = args.params->bits == 4 ? (cols + 1) / 2 : cols;
  args.scale_cols = options.axis == 1 ? (cols + args.block - 1) / args.block : cols;
  return args;
}

std::atomic<bool>& fast_switch() {
  static std::atomic<bool> enabled{[] {
    const char* value = std::getenv("MXSCOPE_CANONICAL_QUANTIZE");
    return !(value != nullptr && value[0] != '\0' && value[0] != '0');
  }()};
  return enabled;
}

}  // namespace fast_detail

bool fast_quantize_covers(const quantize_options& options) {
  if (options.format.scheme != quant_scheme::mx) return false;
  if (!fast_detail::covered_element(options.format.element)) return false;
  const int block = options.block > 0 ? options.block : options.format.default_block;
  return block >= 1 && (options.axis == 0 || options.axis == 1) && options.sr_bits >= 1 && options.sr_bits <= 32;
}

quantize_counts quantize_mx_fast(const float* input, std::int64_t rows, std::int64_t cols,
                                 const quantize_options& options, const mx_destination& destination) {
  return fast_detail::run(fast_detail::make_arguments(input, rows, cols, options, destination));
}

bool fast_rotated_quantize_covers(const quantize_options& options, const rotation_options& rotation,
                                  std::int64_t cols) {
  return fast_quantize_covers(options) && options.axis == 1 && core::is_valid_rotation_size(rotation.size) &&
         cols % rotation.size == 0;
}

quantize_counts quantize_mx_rotated_fast(const float* input, std::int64_t rows, std::int64_t cols,
                                         const quantize_options& options, const rotation_options& rotation,
                                         const mx_destination& destination) {
  if (!fast_rotated_quantize_covers(options, rotation, cols)) {
    throw input_error(fmt::format(
        "quantize: the fused rotation needs axis 1 and a power-of-two rotation size in [{}, {}] dividing {}, got {}",
        core::rotation_size_min, core::rotation_size_max, cols, rotation.size));
  }
  auto args = fast_detail::make_arguments(input, rows, cols, options, destination);
  const std::vector<float> signs = rotation_signs(cols, rotation);
  args.rotation_size = rotation.size;
  args.rotation_signs = rotation.signs == sign_policy::none ? nullptr : signs.data();
  args.rotation_scale = core::hadamard_scale(rotation.size);
  return fast_detail::run(args);
}

void quantize_mx_fast_into(const matrix& input, quantized_tensor& out) {
  const mx_destination destination{out.codes.data(), out.scales.data(), out.dequantized.data()};
  const quantize_counts counts = quantize_mx_fast(input.data(), input.rows, input.cols, out.options, destination);
  out.nonzero_inputs = counts.nonzero_inputs;
  out.flushed = counts.flushed;
  out.saturated = counts.saturated;
  out.nonfinite_inputs = counts.nonfinite_inputs;
}

bool fast_quantize_enabled() { return fast_detail::fast_switch().load(std::memory_order_relaxed); }

void set_fast_quantize_enabled(bool enabled) { fast_detail::fast_switch().store(enabled, std::memory_order_relaxed); }

std::string fast_quantize_target() {
#if defined(MXSCOPE_HAVE_HWY) && MXSCOPE_HAVE_HWY
  const std::int64_t supported = hwy::SupportedTargets() & HWY_TARGETS;
  return hwy::TargetName(supported & ~(supported - 1));  // the best: the lowest bit set
#else
  return "portable";
#endif
}

std::vector<std::int64_t> fast_quantize_available_targets() {
#if defined(MXSCOPE_HAVE_HWY) && MXSCOPE_HAVE_HWY
  return hwy::SupportedAndGeneratedTargets();
#else
  return {};
#endif
}

std::string fast_quantize_target_name(std::int64_t target) {
#if defined(MXSCOPE_HAVE_HWY) && MXSCOPE_HAVE_HWY
  return hwy::TargetName(target);
#else
  return target == 0 ? "portable" : "unknown";
#endif
}

void fast_quantize_force_target(std::int64_t target) {
#if defined(MXSCOPE_HAVE_HWY) && MXSCOPE_HAVE_HWY
  hwy::SetSupportedTargetsForTest(target);
#else
  (void)target;
#endif
}

}  // namespace mxscope

#endif  // HWY_ONCE
