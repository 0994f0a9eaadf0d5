// Fast CPU path for MX block quantization: the same bits as the canonical quantizer of
// src/quantize.cpp (NUMERICS.md section 2), computed from the fp32 bit patterns with SIMD (Highway,
// dispatched at run time to the best instruction set of the CPU) instead of one double at a time.
//
// Why it is exact: a block's scale is a power of two, so v / 2^e only subtracts e from the exponent
// of v, and the element's rounding only looks at the bits of v's significand below the element
// format's last place. The shared exponent is read from the bits of the block's amax. For rne, rna
// and rtz the lanes scale by 2^-e and by the inverse ulp with fp32 products that are exact, and let
// the fp32 to int32 conversion round (under round-to-nearest, which the driver sets for its threads
// whatever the caller's mode); stochastic rounding compares the dropped significand bits with the
// canonical Philox word as integers. Nothing rounds twice, so every lane computes what the canonical
// path computes in double precision.
//
// Covered: quant_scheme::mx with fp4_e2m1, fp6_e2m3, fp6_e3m2, fp8_e4m3 and fp8_e5m2 elements, every
// rounding mode (rne, rna, rtz, sr with any sr_bits), every scale rule, both axes, any block size
// (the SIMD loop is fastest when the block is a multiple of twice the vector length, e.g. 32).
// Not covered: MXINT8 (quantize() keeps using the canonical path for it).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "mxscope/quantize.hpp"

namespace mxscope {

struct quantize_counts {
  std::int64_t nonzero_inputs = 0;
  std::int64_t flushed = 0;           // nonzero inputs quantized to zero
  std::int64_t saturated = 0;         // inputs clipped at the max normal
  std::int64_t nonfinite_inputs = 0;  // NaN or Inf inputs (their blocks dequantize to NaN)
};

// Where the fast quantizer writes, in quantize()'s storage layout (see quantized_tensor):
// codes [rows, ceil(cols / 2)] for 4-bit elements and [rows, cols] otherwise; scales
// [rows, ceil(cols / block)] for axis 1 and [ceil(rows / block), cols] for axis 0; dequantized
// [rows, cols] fp32, or null when the caller only needs codes and scales.
struct mx_destination {
  std::uint8_t* codes = nullptr;
  std::uint8_t* scales = nullptr;
  float* dequantized = nullptr;
};

// True when quantize_mx_fast reproduces the canonical quantizer for these options.
bool fast_quantize_covers(const quantize_options& options);

// Quantizes the row-major fp32 tensor input[rows x cols] into `destination`. Throws input_error when
// the options are invalid (as quantize() does) or not covered. Uses the OpenMP thread team; the
// result does not depend on the number of threads.
quantize_counts quantize_mx_fast(const float* input, std::int64_t rows, std::int64_t cols,
                                 const quantize_options& options, const mx_destination& destination);

// Rotation fused into the quantizer: the same bits as rotating a copy of the input along axis 1
// with rotate() and quantizing that copy along axis 1, without writing the rotated tensor. Covered
// when fast_quantize_covers(options), options.axis == 1 and the rotation is valid for the row length
// (a power of two in [2, 4096] dividing cols); otherwise throws input_error.
bool fast_rotated_quantize_covers(const quantize_options& options, const rotation_options& rotation,
                                  std::int64_t cols);
quantize_counts quantize_mx_rotated_fast(const float* input, std::int64_t rows, std::int64_t cols,
                                         const quantize_options& options, const rotation_options& rotation,
                                         const mx_destination& destination);

// Fills `out` (shape, options, block and buffers already set up by quantize()) through the fast path.
void quantize_mx_fast_into(const matrix& input, quantized_tensor& out);

// Process-wide switch read by quantize(): when off, quantize() always takes the canonical scalar
// path (tests compare the two; users can rule the fast path out when they chase a discrepancy).
// On by default; the environment variable MXSCOPE_CANONICAL_QUANTIZE=1 turns it off at start-up.
bool fast_quantize_enabled();
void set_fast_quantize_enabled(bool enabled);

// The instruction set the dispatcher picks for the fast path on this CPU ("AVX3", "AVX2", "SSE4",
// ..., or "portable" when the library was built without Highway).
std::string fast_quantize_target();

// For tests: the instruction sets that were compiled in and that this CPU supports, and a way to
// restrict dispatch to one of them (0 restores the normal choice).
std::vector<std::int64_t> fast_quantize_available_targets();
std::string fast_quantize_target_name(std::int64_t target);
void fast_quantize_force_target(std::int64_t target);

}  // namespace mxscope
