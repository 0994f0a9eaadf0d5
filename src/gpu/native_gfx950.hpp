// The gfx950 (AMD MI355X) native MX path of the GPU backend: the rules, in plain C++.
//
// On gfx950 the backend can quantize MXFP4 with the hardware's scaled conversions
// (v_cvt_scalef32_pk_fp4_f32, and v_cvt_scalef32_sr_pk_fp4_f32 for stochastic rounding) and
// multiply MXFP4 x MXFP4 with the scaled MFMA (v_mfma_scale_f32_16x16x128_f8f6f4). The kernels are
// in native_gfx950_quantize.hpp and native_gfx950_product.hpp (HIP device code for __gfx950__ only;
// every other build has host stubs). This header holds what the host decides with and what the
// tests check on the CPU: which plans, blocks and models the native path takes, and how the
// emulator's stochastic rounding maps onto the hardware's seed operand.
//
// Nothing here has run on an MI355X. The native path equals the CPU emulator only if the hardware
// behaves as the hypotheses below say; docs/gpu.md lists them and `mxscope conform --self-test
// --device gpu` on an MI355X checks them (it compares the native path with the CPU emulator).
//
// H1  v_cvt_scalef32_pk_fp4_f32(old, x0, x1, scale, sel) writes Round(x0 / scale) to bits [3:0]
//     and Round(x1 / scale) to bits [7:4] of byte `sel` of `old`, rounding once (no intermediate
//     fp32 rounding of x / scale: with scale = 2^e that quotient is exact anyway except below the
//     fp32 normal range, where every mode below gives zero), to nearest even, saturating at +-6,
//     and keeping the sign of results that round to zero (code 0x8 for negative inputs).
// H2  v_cvt_scalef32_sr_pk_fp4_f32(old, {x0, x1}, seed, scale, sel) rounds |x0 / scale| up iff
//     D + (seed mod 2^22) >= 2^22, where D holds the 22 bits below the kept fp4 mantissa bit at
//     fp32 alignment (for results below fp4's normal range: after the right shift that aligns the
//     significand to fp4's subnormal spacing, truncating what falls off), i.e. D = floor(F 2^22)
//     for the fraction F of |x0 / scale| in units of the fp4 spacing; otherwise as H1. Only x0's
//     nibble is used (x1 = 0): one conversion per element, because the instruction takes one seed
//     for two elements and how it splits the seed between them is not documented.
// H3  fp32 subnormal inputs may be flushed to zero by the conversions: blocks whose scale is small
//     enough for that to change a code are quantized in software (hardware_block below).
// H4  the scaled MFMA with cbsz = blgp = 4 (fp4 e2m1 operands) computes
//     D = fl32(C + sum over its 128 k of a_k b_k 2^(sa + sb)) with the sum exact and one
//     round-to-nearest-even step, subnormals kept (the emulator's fp32-group:4 preset); a scale
//     byte 0xFF (the MX NaN scale) makes the sum NaN.
// H5  operand layout of the 16x16x128 instruction: lane l holds row (A) or column (B) l mod 16,
//     k = 32 (l / 16) ... + 31 as 16 bytes, two elements per byte, the lower k in the low nibble;
//     lane l's scale byte (op_sel 0) is that row's block l / 16; D's lane l holds column l mod 16,
//     rows 4 (l / 16) ... + 3.
#pragma once

// The native kernels exist in the HIP builds (their device code only for __gfx950__); nvcc and the
// CPU simulation compile the host stubs of native_gfx950_quantize.hpp and native_gfx950_product.hpp.
#if defined(__HIP__) && !defined(MXSCOPE_GPU_SIMULATE)
#define MXSCOPE_NATIVE_GFX950 1
#endif

#include <atomic>  // (atomic, cstdlib, cstring: for native_gfx950_quantize.hpp, included inside a namespace)
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "mxscope/core/formats.hpp"
#include "mxscope/core/mx.hpp"
#include "mxscope/gpu.hpp"

namespace mxscope::gpu::native_gfx950 {

// The seed bits the sr conversion reads (H2): the fraction below fp4's mantissa, at fp32 alignment.
inline constexpr int sr_window_bits = 22;

// The native quantizer handles sr only when the emulator's sr_bits fits the hardware's window.
inline constexpr int sr_bits_max = sr_window_bits;

// The seed that makes the hardware's sr (H2) round as core::quantize_element does with this random
// word and sr_bits <= 22. The emulator rounds up iff floor(F 2^R) + (word >> (32 - R)) >= 2^R; with
// r = word >> (32 - R) placed at the top of the 22-bit window, seed = r 2^(22 - R), the hardware's
// test D + r 2^(22 - R) >= 2^22 with D = floor(F 2^22) is the same test, because r 2^(22 - R) is a
// multiple of 2^(22 - R) and D mod 2^(22 - R) < 2^(22 - R). (For R > 22 the emulator also reads
// fraction bits below the window, which the hardware never sees, so R > 22 is not mapped.)
MXSCOPE_HD constexpr std::uint32_t sr_seed(std::uint32_t word, int sr_bits) {
  return (word >> (32 - sr_bits)) << (sr_window_bits - sr_bits);
}

// Whether a block with shared exponent e is converted by the hardware (else in software, H3). An
// fp32 subnormal input x (|x| < 2^-126) divided by 2^e is below 2^(-126 - e): for e >= -124 that is
// below 0.25, which rounds to zero under rne; under sr its fraction F in units of fp4's spacing 0.5
// is below 2^(-125 - e), which is below 2^-22 once e >= -103, so D = floor(F 2^22) = 0 and it never
// rounds up. Flushing such an input to zero then changes no code. Above these bounds the scale 2^e is also a
// normal fp32 number (e <= 126 for fp4 under every scale rule).
inline constexpr int min_hardware_exponent_rne = -124;
inline constexpr int min_hardware_exponent_sr = -103;
MXSCOPE_HD constexpr bool hardware_block(int exponent, core::rounding_mode mode) {
  return exponent >= (mode == core::rounding_mode::sr ? min_hardware_exponent_sr : min_hardware_exponent_rne) &&
         exponent <= 126;
}

// The quantizer plans the native path takes: MXFP4, block 32 along axis 1 (cols a multiple of 32),
// rne or sr with sr_bits <= 22, any scale rule, rotation none, 16 or 32 (applied in registers as on
// the fused path).
constexpr bool quantize_plan_fits(const mx_plan& plan, int rotation_size, std::int64_t cols) {
  const bool rounding_fits = plan.rounding == core::rounding_mode::rne ||
                             (plan.rounding == core::rounding_mode::sr && plan.sr_bits <= sr_bits_max);
  return plan.element == core::element_kind::fp4_e2m1 && plan.block == 32 && plan.axis == 1 && cols % 32 == 0 &&
         rounding_fits && (rotation_size == 0 || rotation_size == 16 || rotation_size == 32);
}

// The products the native GEMM takes: MXFP4 x MXFP4, block 32, and the fp32-group:4 model that the
// 16x16x128 scaled MFMA implements by hypothesis H4 (K = 128 = 4 blocks per instruction).
inline constexpr int mfma_blocks_per_instruction = 4;
constexpr bool gemm_fits(core::element_kind a, core::element_kind b, int block, const accumulation_model& model) {
  return a == core::element_kind::fp4_e2m1 && b == core::element_kind::fp4_e2m1 && block == 32 &&
         model.kind == accumulation_kind::fp32_group && model.blocks_per_group == mfma_blocks_per_instruction;
}

// Host side (native_gfx950_quantize.hpp, native_gfx950_product.hpp): whether the current device is
// a gfx950 and this build has the native code (and MXSCOPE_GPU_NATIVE is not "off"); the quantizer
// and the operand preparation and product of gemm_path::native_mfma. Builds without the native code throw gpu_error.
bool present();
void quantize(const void* input, input_format format, std::int64_t rows, std::int64_t cols, const mx_plan& plan,
              const rotation_plan& rotation, const mx_device_output& output);
void prepare(const mx_operand_view& operand, prepared_operand::storage& storage);
void multiply(const prepared_operand::storage& a, const prepared_operand::storage& b, output_rounding output,
              float* out);

}  // namespace mxscope::gpu::native_gfx950
