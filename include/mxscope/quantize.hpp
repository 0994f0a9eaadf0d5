// Tensor-level quantizers and rotations on the CPU: the MX block quantizer (any block size, either
// axis, short last block), NVFP4 (TransformerEngine's two-level recipe), per-tensor fp8 and bf16.
// They drive the per-element functions of include/mxscope/core, so the GPU backend computes the
// same bits.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "mxscope/core/hadamard.hpp"
#include "mxscope/core/mx.hpp"
#include "mxscope/core/philox.hpp"
#include "mxscope/tensor.hpp"

namespace mxscope {

enum class quant_scheme : std::uint8_t {
  none,        // keep fp32 (the unquantized reference operand)
  bf16,        // round each element to bf16
  mx,          // OCP MX: e8m0 power-of-two scale per block
  nvfp4,       // fp4 e2m1, ue4m3 scale per 16 elements, fp32 tensor scale
  per_tensor,  // one fp32 scale per tensor, fp8 elements (the FP8 baseline)
};

struct format_choice {
  quant_scheme scheme = quant_scheme::none;
  core::element_kind element = core::element_kind::fp4_e2m1;
  int default_block = 0;
};

// CLI / analysis names: mxfp4 mxfp6_e2m3 mxfp6_e3m2 mxfp8_e4m3 mxfp8_e5m2 mxint8 nvfp4
// fp8_e4m3 fp8_e5m2 bf16 fp32.
std::optional<format_choice> parse_format(std::string_view name);
std::string format_name(const format_choice& format);
std::optional<core::rounding_mode> parse_rounding(std::string_view name);
std::string_view rounding_name(core::rounding_mode mode);
std::optional<core::scale_rule> parse_scale_rule(std::string_view name);
std::string_view scale_rule_name(core::scale_rule rule);

struct quantize_options {
  format_choice format;
  int block = 0;  // 0: the format's default (32 for MX, 16 for NVFP4)
  int axis = 1;   // blocks run along this axis of the [rows, cols] tensor
  core::rounding_mode rounding = core::rounding_mode::rne;
  core::scale_rule rule = core::scale_rule::floor;
  int sr_bits = 32;
  core::random_stream stream;  // used by sr only
  bool nvfp4_2d = false;       // NVFP4 16x16 tiles (weights)
};

struct quantized_tensor {
  std::int64_t rows = 0;
  std::int64_t cols = 0;
  quantize_options options;
  int block = 0;  // resolved block size
  // Element codes, row-major. 4-bit codes are packed two per byte within each row (element 2i in
  // the low nibble): [rows, ceil(cols / 2)]. 6- and 8-bit codes: one per byte. bf16: the 16-bit
  // patterns, little-endian, two bytes per element.
  std::vector<std::uint8_t> codes;
  // Block scale codes (e8m0 for MX, ue4m3 for NVFP4): [rows, ceil(cols / block)] for axis 1,
  // [ceil(rows / block), cols] for axis 0, [ceil(rows/16), ceil(cols/16)] for NVFP4 2-D tiles.
  std::vector<std::uint8_t> scales;
  std::int64_t scale_rows = 0;
  std::int64_t scale_cols = 0;
  // NVFP4: the fp32 global decode scale (amax / 2688); per-tensor fp8: the fp32 tensor scale.
  float tensor_scale = 1.0f;
  matrix dequantized;
  // Quantized on the GPU for a product that runs there (run_gemm with device gpu, bf16 operands):
  // the dequantized values in device memory; `dequantized` above is then empty.
  device_matrix_ptr device_dequantized;
  // Quantized on the GPU (run_gemm with device gpu): `codes` and `scales` in device memory, in the
  // layout above; with gemm_options::keep_on_device the host vectors are then left empty.
  device_buffer_ptr device_codes;
  device_buffer_ptr device_scales;
  std::int64_t nonzero_inputs = 0;
  std::int64_t flushed = 0;          // nonzero inputs quantized to zero
  std::int64_t saturated = 0;        // inputs clipped at the max normal
  std::int64_t nonfinite_inputs = 0; // NaN or Inf inputs (their blocks dequantize to NaN)

  std::int64_t code_row_bytes() const;
};

// Validates the options against the shape (block >= 1, axis 0 or 1, sr_bits in 1..32, ...);
// throws input_error naming `what` and the field.
void validate(const quantize_options& options, std::int64_t rows, std::int64_t cols, const std::string& what);

quantized_tensor quantize(const matrix& input, const quantize_options& options);

// Decodes codes + scales back to values (the inverse of the storage layout; used by tests and by
// conformance checks of hardware-produced codes).
matrix dequantize(const quantized_tensor& quantized);

// ------------------------------------------------------------------------------------------------
// Rotations.

enum class sign_policy : std::uint8_t { none, fixed, per_step };
std::optional<sign_policy> parse_sign_policy(std::string_view name);
std::string_view sign_policy_name(sign_policy policy);

struct rotation_options {
  int size = 0;  // 0: no rotation; else a power of two in [2, 4096] dividing the axis length
  sign_policy signs = sign_policy::none;
  std::uint64_t seed = 0;
  std::uint32_t step = 0;        // the true step; the policy decides whether it is used
  std::uint32_t layer_hash = 0;  // fnv1a32 of the layer name
};

// The +-1 sign vector for positions 0..length-1 along the axis (all +1 for `none`).
std::vector<float> rotation_signs(std::int64_t length, const rotation_options& options);

// The checks of rotate() without rotating: throws input_error naming `what` when the axis is not 0
// or 1, or the size is invalid or does not divide the axis length. Size 0 (none) always passes.
void check_rotation(const matrix& values, int axis, const rotation_options& options, const std::string& what);

// Rotates (or, with inverse, un-rotates) `values` in place along `axis`. Throws input_error
// naming `what` when the size is invalid or does not divide the axis length.
void rotate(matrix& values, int axis, const rotation_options& options, const std::string& what, bool inverse = false);

}  // namespace mxscope
