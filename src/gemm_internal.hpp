// The CPU GEMM's internal types and per-entry steps shared by its translation units (src/gemm.cpp,
// src/gemm_integer.cpp, src/gemm_wide.cpp): not part of the library's interface.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include <optional>
#include <utility>

#include <Eigen/Core>

#include "mxscope/core/accumulate.hpp"
#include "mxscope/core/tensor_scale.hpp"
#include "mxscope/gemm.hpp"
#include "mxscope/tensor.hpp"

namespace mxscope::gemm_internal {

namespace core_ns = mxscope::core;

// Work below these sizes runs on one thread: on a busy machine the fork and barrier of a parallel
// region cost more than such a loop. (Results never depend on the thread count.)
constexpr std::int64_t parallel_elements = std::int64_t{1} << 18;  // element loops
constexpr std::int64_t parallel_products = std::int64_t{1} << 22;  // GEMMs, counted in products

// Marks the scale exponent of a NaN block (its scale code is the NaN code). Far outside every
// exponent range the fast path accepts, so such blocks always take the per-entry step.
constexpr std::int32_t nan_block_exponent = 1 << 20;

struct canonical_operand {
  std::int64_t rows = 0;
  std::int64_t depth = 0;
  int block = 32;           // K-block size of the accumulation
  std::int64_t blocks = 0;  // blocks per row
  // Element values without any scale, exact in fp32 (every value of the small formats, bf16 and
  // fp32 is an fp32 number; fp32, bf16 and fp8 values can be inf or NaN).
  std::vector<float> elements;  // [rows, depth]
  // Exact block scale factors; NaN for a NaN block. 1 for formats without block scales.
  std::vector<double> block_scales;  // [rows, blocks]
  float tensor_scale = 1.0f;
  // The element format's smallest normal exponent (fp32, bf16: -126). trunc-promote aligns a
  // subnormal element as the hardware does, by its exponent field: as if its exponent were this.
  int element_min_exponent = -126;
  // Integer view for the fast path: element * 2^fraction_bits is an integer of magnitude at most
  // integer_max, and block scale = scale_mantissa * 2^scale_exponent with an integer mantissa.
  bool integer_elements = false;
  bool finite = true;  // no inf or NaN element
  int fraction_bits = 0;
  std::int64_t integer_max = 0;
  std::int64_t scale_mantissa_max = 1;
  std::vector<std::int32_t> scale_exponents;  // [rows, blocks] (nan_block_exponent for NaN blocks)
  std::vector<std::int32_t> scale_mantissas;  // [rows, blocks]
  matrix dequantized;                         // [rows, depth] fp32 dequantized values (fp32-seq only)

  // The block-scaled element: exact in a double (a short significand times a scale whose product
  // stays within the double range).
  double scaled(std::int64_t row, std::int64_t k) const {
    return static_cast<double>(elements[static_cast<std::size_t>(row * depth + k)]) *
           block_scales[static_cast<std::size_t>(row * blocks + k / block)];
  }

  // The exponent trunc-promote aligns by (docs/numerics.md): floor(log2 |scaled value|), where a
  // subnormal element counts as having the format's smallest normal exponent (what a hardware
  // adder reads from the exponent field). 0 for zero and non-finite values.
  int alignment_exponent(std::int64_t row, std::int64_t k) const {
    const double value = scaled(row, k);
    if (value == 0.0 || !std::isfinite(value)) return 0;
    const int leading = core_ns::floor_log2(std::fabs(value));
    const float element = elements[static_cast<std::size_t>(row * depth + k)];
    const int element_leading = core_ns::floor_log2(std::fabs(static_cast<double>(element)));
    return element_leading < element_min_exponent ? leading + (element_min_exponent - element_leading) : leading;
  }
};

// ------------------------------------------------------------------------------------------------
// Shared per-entry steps.

// acc + (a block or group contribution that is NaN or whose accumulator is no longer finite):
// the IEEE meaning of the sum, which is the only thing left to compute.
inline float nonfinite_step(float accumulator, double nonfinite_sum) {
  return static_cast<float>(static_cast<double>(accumulator) + nonfinite_sum);
}

// fl32(accumulator + value) for an exact double value (a scaled block dot or group sum).
inline float add_exact_value(float accumulator, double value) {
  if (!std::isfinite(accumulator) || !std::isfinite(value)) return nonfinite_step(accumulator, value);
  // +0.0 turns a -0 value into +0: an exactly zero sum is +0 (core/accumulate.hpp).
  return core_ns::add_to_float(accumulator, value + 0.0);
}

// One group step of the block models for every entry of a tile: entry e's `count` block
// contributions (contributions[g * entries + e], exact doubles) go into its fp32 accumulator
// exactly (core::add_exactly_to_float of the group). Entries with skip[e] != 0 are left alone (skip
// may be null); a NaN contribution or a non-finite accumulator takes nonfinite_step.
inline void add_groups_exactly(float* accumulators, const double* contributions, std::int64_t entries,
                               std::int64_t count, const std::uint8_t* skip) {
  double terms[64];
  std::vector<double> wide_terms;
  for (std::int64_t e = 0; e < entries; ++e) {
    if (skip != nullptr && skip[e] != 0) continue;
    float& accumulator = accumulators[e];
    if (count == 1) {
      accumulator = add_exact_value(accumulator, contributions[e]);
      continue;
    }
    double* gathered = terms;
    if (count > 64) {
      wide_terms.resize(static_cast<std::size_t>(count));
      gathered = wide_terms.data();
    }
    bool nan_term = false;
    for (std::int64_t g = 0; g < count; ++g) {
      gathered[g] = contributions[g * entries + e];
      nan_term = nan_term || std::isnan(gathered[g]);
    }
    if (nan_term || !std::isfinite(accumulator)) {
      accumulator = nonfinite_step(accumulator, nan_term ? std::numeric_limits<double>::quiet_NaN() : 0.0);
      continue;
    }
    accumulator = core_ns::add_exactly_to_float(accumulator, gathered, static_cast<int>(count));
  }
}

inline float epilogue(float accumulator, float alpha) { return accumulator * alpha; }

inline float round_output(float value, output_rounding output) {
  if (output == output_rounding::fp32) return value;
  return core_ns::bf16_to_float(core_ns::float_to_bf16(value, core_ns::rounding_mode::rne));
}

using core_ns::tensor_scale_product;

struct fast_plan {
  bool use_float = false;          // D is computed in fp32 (else fp64)
  bool power_of_two_scales = false;  // every block scale is a power of two: fp32-block can add in fp32
  int bound_bits = 0;
  int fraction_total = 0;
};

inline int bits_of(std::int64_t value) { return core_ns::bit_length(static_cast<core_ns::uint128>(value)); }

// The scaled block dot as an exact double (NaN for a NaN block).
inline double scaled_block_dot(double dot, std::int32_t exponent_a, std::int32_t mantissa_a, std::int32_t exponent_b,
                        std::int32_t mantissa_b, int fraction_total) {
  if (exponent_a == nan_block_exponent || exponent_b == nan_block_exponent) {
    return std::numeric_limits<double>::quiet_NaN();
  }
  const double mantissa = static_cast<double>(static_cast<std::int64_t>(mantissa_a) * mantissa_b);
  return (dot + 0.0) * mantissa * core_ns::pow2(exponent_a + exponent_b - fraction_total);
}

struct fast_context {
  const canonical_operand* a;
  const canonical_operand* b;
  fast_plan plan;
  accumulation_model model;
  float alpha;
  tensor_scale_product scale;
  // B's scale data transposed to [blocks, N] so that a row of a tile reads it contiguously.
  std::vector<std::int32_t> b_exponents;
  std::vector<std::int32_t> b_mantissas;
  bool vector_kernels = true;
};

template <class T>
using row_major_matrix = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

// D[rows x cols] = A[m0 .. m0+rows, k0 .. k0+length] * B[n0 .. n0+cols, same]^T. Exact because the
// callers only pass operands whose partial sums are all representable in T, whatever the order
// (integers below 2^24 in fp32 or 2^53 in fp64; short floats of a bounded exponent spread).
template <class T>
inline void exact_block_products(const T* a, const T* b, std::int64_t depth, std::int64_t m0, std::int64_t rows,
                            std::int64_t n0, std::int64_t cols, std::int64_t k0, std::int64_t length, T* out) {
  using strided = Eigen::Map<const row_major_matrix<T>, 0, Eigen::OuterStride<>>;
  const strided a_block(a + m0 * depth + k0, rows, length, Eigen::OuterStride<>(depth));
  const strided b_block(b + n0 * depth + k0, cols, length, Eigen::OuterStride<>(depth));
  Eigen::Map<row_major_matrix<T>> products(out, rows, cols);
  products.noalias() = a_block * b_block.transpose();
}

// Output tiles of the integer path and of the unquantized operands' block products.
constexpr std::int64_t tile_rows_block = 64;
constexpr std::int64_t tile_cols_block = 256;
constexpr std::int64_t tile_rows_exact = 32;
constexpr std::int64_t tile_cols_exact = 64;

// The integer path (src/gemm_integer.cpp): whether it applies to these operands under this model
// (its plan), and the product by it; returns the entries that took the exact per-entry step.
std::optional<fast_plan> plan_fast_path(const canonical_operand& a, const canonical_operand& b,
                                        const accumulation_model& model);
std::int64_t integer_product(fast_context& context, matrix& out, matrix64* exact);

// The AVX2 int16 kernels (src/gemm_integer.cpp): whether they cover these operands and this model,
// and the product over all micro tiles (false when this CPU has no AVX2).
bool int16_kernel_applies(const canonical_operand& a, const canonical_operand& b, const fast_plan& plan,
                          const accumulation_model& model);
// NVFP4 operands (ue4m3 block scales) for the int16 kernels: copies with each scale's mantissa
// folded into the elements (e2m1 x 2 times an odd mantissa up to 15: below 2^8), leaving power-of-
// two scales; nullopt where the elements would not fit int16 or no scale has a mantissa.
std::optional<std::pair<canonical_operand, canonical_operand>> folded_for_int16(const canonical_operand& a,
                                                                                const canonical_operand& b);
// With exact_too (fp32-block products only) also the exact model's fp64 product from the same block
// dots. Tensor scales (NVFP4) go into the epilogue and the exact values' single rounding.
bool int16_kernel_product(const fast_context& context, matrix& out, matrix64* exact, std::int64_t& fallbacks,
                          matrix64* exact_too = nullptr);

// The AVX2 + FMA fp64 kernel for wider integer elements (src/gemm_wide.cpp: fp8 e4m3 pairs, MX or
// per-tensor) under fp32-block and exact; with exact_too (fp32-block) both from the same block dots.
// False when this CPU has no AVX2 and FMA.
bool wide_kernel_applies(const canonical_operand& a, const canonical_operand& b, const fast_plan& plan,
                         const accumulation_model& model);
bool wide_kernel_product(const fast_context& context, matrix& out, matrix64* exact, std::int64_t& fallbacks,
                         matrix64* exact_too = nullptr);

// fp32-block (or fp32-group:1) of finite float operands without block scales (bf16, fp32, or the
// elements of per-tensor and unit-scaled operands) on the same tiles (src/gemm_wide.cpp): block
// dots by fp64 FMAs, each step certified by their error bound, the uncertain entry-blocks summed
// exactly. No alpha. Counts those in `fallbacks`; false when this CPU has no AVX2 and FMA.
bool certified_wide_applies(const canonical_operand& a, const canonical_operand& b);
bool certified_wide_product(const canonical_operand& a, const canonical_operand& b, matrix& out,
                            std::int64_t& fallbacks);

}  // namespace mxscope::gemm_internal

namespace mxscope::detail {

// The elements of per-tensor operand `q` whose magnitudes lie in `part`, as an MX operand of
// element format part.kind (src/gemm_per_tensor.cpp; src/backend/gpu_products.cpp multiplies the parts on the GPU).
quantized_tensor binade_part_operand(const quantized_tensor& q, int block, const binade_part& part);

}  // namespace mxscope::detail
