// NVFP4 scales and elements (TransformerEngine's recipe in its fp32 operation order; docs/numerics.md
// "NVFP4"): one set of functions for the CPU quantizer and the GPU kernels, so that both give the
// same bits. Every fp32 operation below is one IEEE operation (no contraction: the project builds
// with -ffp-contract=off and nvcc --fmad=false).
#pragma once

#include "mxscope/core/formats.hpp"

namespace mxscope::core {

inline constexpr float nvfp4_float_max = 3.40282347e+38F;

// min(value, FLT_MAX) as std::min computes it (a NaN value stays NaN).
MXSCOPE_HD constexpr float nvfp4_cap(float value) { return nvfp4_float_max < value ? nvfp4_float_max : value; }

// The elements that share one block scale: 1 x 16 along axis 1, 16 x 1 along axis 0, or 16 x 16
// tiles (NVFP4's 2-D weight scaling).
struct nvfp4_tile {
  std::int64_t rows;
  std::int64_t cols;
};

MXSCOPE_HD constexpr nvfp4_tile nvfp4_tile_of(int axis, bool two_d) {
  return {two_d || axis == 0 ? 16 : 1, two_d || axis == 1 ? 16 : 1};
}

// Global encode scale S_enc = fl32(448 * 6 / amax), capped at FLT_MAX; 1 when the tensor's finite
// amax is 0 (or S_enc is 0 or NaN). The decode scale is fl32(1 / S_enc).
MXSCOPE_HD constexpr float nvfp4_global_encode_scale(float tensor_amax) {
  const float encode = nvfp4_cap(448.0f * 6.0f / tensor_amax);
  if (tensor_amax == 0.0f || encode == 0.0f || encode != encode) return 1.0f;
  return encode;
}

struct nvfp4_block {
  std::uint8_t scale = 0;    // ue4m3 code of the block decode scale
  float decode = 0.0f;       // its value
  float encode = 0.0f;       // fl32(1 / fl32(decode * S_dec)), capped at FLT_MAX
};

// The block's scales from its ue4m3 code (a finite block: the code is not the NaN code).
MXSCOPE_HD constexpr nvfp4_block nvfp4_block_of_scale(std::uint8_t scale, float global_decode) {
  const float decode_scale = static_cast<float>(decode(element_kind::ue4m3, scale));
  return {scale, decode_scale, nvfp4_cap(1.0f / (decode_scale * global_decode))};
}

// The block's scales from its largest finite magnitude: d = ue4m3_rne(fl32(amax * fl32(S_enc * fl32(1/6)))).
MXSCOPE_HD constexpr nvfp4_block nvfp4_block_of_amax(float amax, float global_encode, float global_decode) {
  const float wide = nvfp4_cap(amax * (global_encode * (1.0f / 6.0f)));
  return nvfp4_block_of_scale(encode(element_kind::ue4m3, wide).code, global_decode);
}

struct nvfp4_element {
  encoded code;
  float dequantized = 0.0f;  // fl32(fl32(q * d) * S_dec)
  bool flushed = false;      // a zero code from a nonzero input, or a dequantized value that underflowed to 0
};

// One finite element: q = e2m1(fl32(v * encode)) in the given rounding mode.
MXSCOPE_HD constexpr nvfp4_element nvfp4_encode(float value, const nvfp4_block& block, float global_decode,
                                                rounding_mode mode, std::uint32_t random_word, int sr_bits) {
  const float scaled = value * block.encode;
  nvfp4_element out;
  out.code = encode(element_kind::fp4_e2m1, static_cast<double>(scaled), mode, random_word, sr_bits);
  const float element = static_cast<float>(decode(element_kind::fp4_e2m1, out.code.code));
  out.dequantized = (element * block.decode) * global_decode;
  out.flushed = out.code.flushed || (value != 0.0f && out.dequantized == 0.0f);
  return out;
}

}  // namespace mxscope::core
