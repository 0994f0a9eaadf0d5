// The GEMM operand of a quantized element as bf16: its value without the tensor-level scale (MX
// q 2^e, NVFP4 q times its ue4m3 block scale, per-tensor fp8 q). A matrix product of two such
// operands, times the two tensor scales, is the product of the dequantized operands; this is the
// form in which a training step hands quantized operands to a bf16 tensor-core GEMM.
#pragma once

#include "mxscope/core/formats.hpp"
#include "mxscope/core/mx.hpp"

namespace mxscope::core {

enum class operand_scaling : std::uint8_t { mx, nvfp4, none };

inline constexpr std::uint16_t bf16_canonical_nan = 0x7FC0;

// `scale` is the block's e8m0 (mx) or ue4m3 (nvfp4) code, ignored for none. NaN blocks and NaN
// codes give bf16_canonical_nan. The value has at most 8 significant bits, so it is exact in fp32
// and, rounded to nearest even, in bf16 wherever bf16's range holds it: everywhere except MX blocks
// of fp8 elements whose scale lies below 2^-117 (e5m2) or 2^-124 (e4m3).
MXSCOPE_HD constexpr std::uint16_t operand_bf16(element_kind kind, operand_scaling scaling, std::uint32_t code,
                                                std::uint8_t scale) {
  double value = 0.0;
  if (scaling == operand_scaling::mx) {
    if (scale == 0xFF) return bf16_canonical_nan;
    value = dequantize_element(kind, code, scale_exponent(scale));
  } else if (scaling == operand_scaling::nvfp4) {
    if (scale == nan_code(element_kind::ue4m3)) return bf16_canonical_nan;
    value = decode(element_kind::fp4_e2m1, code) * decode(element_kind::ue4m3, scale);
  } else {
    value = decode(kind, code);
  }
  if (value != value) return bf16_canonical_nan;
  return float_to_bf16(static_cast<float>(value), rounding_mode::rne, 0U, 32);
}

}  // namespace mxscope::core
