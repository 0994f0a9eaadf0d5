// Emulated GEMMs of a linear layer (NUMERICS.md sections 6 and 7): each operand is rotated and
// quantized in its captured layout, then the product is summed by an accumulation model that
// stands for a piece of hardware.
//
// Operands (captured per step): x [K, n_in], dy [K, n_out], w [n_out, n_in].
//   fprop  y  = x w^T   A = x  (blocked along n_in, axis 1),  B = w  (along n_in, axis 1)
//   dgrad  dx = dy w    A = dy (blocked along n_out, axis 1), B = w  (along n_out, axis 0)
//   wgrad  dw = dy^T x  A = dy (blocked along K, axis 0),     B = x  (along K, axis 0)
// The product is computed as C = A B^T in a canonical form where both operands have the reduction
// contiguous: A [M, R], B [N, R], C [M, N] = y [K, n_out], dx [K, n_in] or dw [n_out, n_in].
//
// Scales. MX operands carry one power-of-two scale per block. The other formats are summed the way
// block-scaled hardware sums them: K is cut into blocks of the quantization block (16 for NVFP4, 32
// when a format has none); a block's scale factor is the exact product of the two operands' block
// scales (ue4m3 for NVFP4, 1 for fp32, bf16 and per-tensor fp8). Tensor-level scales (the fp32
// scale of per-tensor fp8, the global decode scale of NVFP4) are applied once at the end, as the
// fp32 epilogue of a scaled GEMM: alpha = fl32(sa * sb), out = fl32(acc * alpha). Two exceptions,
// by their definitions: `exact` includes the tensor scales in its exact sum, and `fp32-seq`
// multiplies the fully dequantized fp32 values (tensor scales included) and has no epilogue.
// The two operands' blocks along K must coincide (the same block size), or the GEMM is refused.
#pragma once

#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "mxscope/core/accumulate.hpp"
#include "mxscope/core/philox.hpp"
#include "mxscope/quantize.hpp"
#include "mxscope/tensor.hpp"

namespace mxscope {

enum class gemm_kind : std::uint8_t { fprop, dgrad, wgrad };
std::optional<gemm_kind> parse_gemm_kind(std::string_view name);  // "fprop" | "dgrad" | "wgrad"
std::string_view gemm_kind_name(gemm_kind kind);

using core::accumulation_kind;
using core::accumulation_model;
using core::alignment_rounding;

// "exact", "fp32-block", "fp32-group:G", "trunc-align:n,G[,rtz|rne]" (rtz by default), "fp32-seq".
// Throws input_error naming `field` and the offending text.
accumulation_model parse_accumulation_model(std::string_view text, std::string_view field = "accum");
// The canonical spelling (parse_accumulation_model(accumulation_model_name(m)) == m).
std::string accumulation_model_name(const accumulation_model& model);

enum class output_rounding : std::uint8_t { fp32, bf16 };
std::optional<output_rounding> parse_output_rounding(std::string_view name);  // "fp32" | "bf16"
std::string_view output_rounding_name(output_rounding rounding);

// How one operand of the GEMM is quantized. The GEMM kind sets quantize.axis and quantize.stream.
struct operand_strategy {
  quantize_options quantize;  // format (fp32 and bf16 are the unquantized baselines), block, rounding, ...
  core::seed_policy seeds = core::seed_policy::per_step;  // stochastic rounding stream
};

// A complete way of computing one GEMM.
struct strategy {
  std::string name;
  operand_strategy a;  // first operand of C = A B^T: dy for wgrad and dgrad, x for fprop
  operand_strategy b;  // second operand: x for wgrad, w for fprop and dgrad
  std::uint64_t seed = 0;
  // Block Hadamard rotation along the reduction axis, the same Q (one sign vector) for both
  // operands. Size 0: none.
  int rotation_size = 0;
  sign_policy rotation_signs = sign_policy::none;
  accumulation_model accumulation;
  output_rounding output = output_rounding::fp32;
};

// The captured tensors of one (layer, step); the GEMM kind decides which two it needs.
struct gemm_operands {
  const matrix* x = nullptr;
  const matrix* dy = nullptr;
  const matrix* w = nullptr;
};

// Where the operands come from: the layer name and the true training step enter the random streams.
struct gemm_context {
  std::string layer;
  std::uint32_t step = 0;
};

// Which captured tensor plays A and B, and along which axis each is blocked.
struct gemm_layout {
  std::string_view a_name;
  std::string_view b_name;
  int a_axis;
  int b_axis;
  core::random_role a_role;
  core::random_role b_role;
};
gemm_layout layout_of(gemm_kind kind);

// The unquantized operands in the orientation of the emulated product and of the reference:
// A [M, R], B [N, R], C = A B^T (the captured operands transposed where their axis is 0).
struct canonical_pair {
  matrix a;
  matrix b;
};
canonical_pair canonical_operands(gemm_kind kind, const matrix& a_captured, const matrix& b_captured);

// How each operand fared in quantization (after rotation): the inputs of the per-operand metrics.
struct operand_summary {
  std::string name;  // "x", "dy" or "w"
  int axis = 1;      // the quantization (reduction) axis in the captured layout
  std::int64_t elements = 0;
  std::int64_t nonzero_inputs = 0;
  std::int64_t flushed = 0;    // nonzero inputs quantized to zero
  std::int64_t saturated = 0;  // inputs clipped at the max normal
  std::int64_t nonfinite_inputs = 0;
  double signal_energy = 0.0;  // sum of v^2 over the finite inputs v (after rotation), fp64
  double error_energy = 0.0;   // sum of (v - dequantized)^2 over the same elements, fp64
  bool quantized_on_gpu = false;  // the quantizer ran on the GPU (gemm_options::device)
};

// The operand metrics of `mxscope gemm` and of the replay's steps.csv (docs/metrics.md), defined
// once for both: the share of nonzero inputs flushed to zero, the share of all inputs clipped, and
// the quantization signal-to-noise ratio in dB (inf without error).
inline double underflow_fraction(const operand_summary& s) {
  return s.nonzero_inputs > 0 ? static_cast<double>(s.flushed) / static_cast<double>(s.nonzero_inputs) : 0.0;
}
inline double saturate_fraction(const operand_summary& s) {
  return s.elements > 0 ? static_cast<double>(s.saturated) / static_cast<double>(s.elements) : 0.0;
}
inline double snr_db(const operand_summary& s) {
  if (s.error_energy == 0.0) return std::numeric_limits<double>::infinity();
  return 10.0 * std::log10(s.signal_energy / s.error_energy);
}

// `generic` forces the per-element definition of every model (slow; the oracle of the fast paths).
enum class accumulation_path : std::uint8_t { automatic, generic };

// Where run_gemm and emulate_product compute. `gpu` runs the MX quantizer and the MX products of the
// models the GPU backend has (exact, fp32-block, fp32-group:G, fp32-seq) on the current GPU
// (include/mxscope/gpu.hpp) and everything else on the CPU; the bits are the same either way.
enum class compute_device : std::uint8_t { cpu, gpu };

struct gemm_options {
  accumulation_path path = accumulation_path::automatic;
  // Use the SIMD kernels this CPU offers (AVX2 on x86-64) where they apply; false keeps the
  // portable kernels. The results are identical either way.
  bool vector_kernels = true;
  compute_device device = compute_device::cpu;
  // run_gemm also multiplies the same quantized operands under the `exact` model (fp32 output) and
  // keeps the result in gemm_result::exact_of_quantized: the quantization-only error, without
  // quantizing twice. Ignored when the strategy's model is `exact` (its `exact` field is that).
  bool exact_too = false;
  // With device gpu: a product that runs on the GPU leaves its results in device memory
  // (product_result::device_out and device_exact, gemm_result::device_exact_of_quantized) and the
  // host matrices empty, for a caller that goes on on the GPU (replay). Products on the CPU fill
  // the host matrices as always.
  bool keep_on_device = false;
  // With device gpu: operands the caller has already put in device memory, each beside the host
  // matrix it copies (the caller keeps both unchanged while they are listed here). run_gemm's GPU
  // quantizer reads such an operand there instead of uploading the host matrix again.
  std::vector<std::pair<const matrix*, device_matrix_ptr>> resident_operands;
  // The device copy of `host` among resident_operands (null when there is none).
  device_matrix_ptr resident_copy(const matrix& host) const {
    for (const auto& [pointer, copy] : resident_operands) {
      if (pointer == &host && copy) return copy;
    }
    return nullptr;
  }
  // With device gpu and keep_on_device: an exact product of unscaled operands already computed on
  // the GPU (the replay's reference), with its operands in the canonical orientation ([rows, depth]).
  // An exact product whose unscaled operands have the same bits (a bf16 strategy on a bf16 capture)
  // is that result, since the same kernel on the same inputs gives the same bits: it is shared.
  struct known_exact_product {
    device_matrix_ptr a;
    device_matrix_ptr b;
    device_matrix_ptr fp64;
    device_matrix_ptr fp32;
  };
  std::optional<known_exact_product> known_exact;
  // On the CPU: the exact product of the tensors `a` and `b` as run_gemm's operands of this GEMM
  // kind (the replay's exact reference of the captured tensors, rounded once to fp64). exact_too
  // takes it, instead of multiplying again, where both quantized operands have the values of those
  // tensors bit for bit (a bf16 strategy on a bf16 capture): the exact sum is the same number.
  struct known_exact_on_host {
    const matrix* a = nullptr;
    const matrix* b = nullptr;
    const matrix64* fp64 = nullptr;
  };
  std::optional<known_exact_on_host> known_exact_host;
};

struct product_result {
  matrix out;       // [M, N] fp32 (values of bf16 when the output is rounded to bf16)
  matrix64 exact;   // `exact` model only: the exact result rounded once to fp64; empty otherwise
  std::int64_t fallback_entries = 0;  // entry-blocks the fast path handed to the exact slow step
  bool product_on_gpu = false;        // the product ran on the GPU (gemm_options::device)
  // gemm_options::keep_on_device: `out` and `exact` in device memory instead (null otherwise).
  device_matrix_ptr device_out;
  device_matrix_ptr device_exact;
};

struct gemm_result : product_result {
  gemm_kind kind = gemm_kind::wgrad;
  matrix64 exact_of_quantized;  // gemm_options::exact_too only: the exact product of the quantized operands
  bool exact_of_quantized_on_gpu = false;
  device_matrix_ptr device_exact_of_quantized;  // keep_on_device: exact_of_quantized in device memory
  operand_summary a;
  operand_summary b;
  // Wall seconds of run_gemm's parts: rotating, quantizing and summarizing both operands; the
  // strategy's product; the exact_too product (0 without it, and where the CPU's int16 kernels
  // compute it with an fp32-block product of MX operands: then it is in product_seconds).
  double quantize_seconds = 0.0;
  double product_seconds = 0.0;
  double exact_product_seconds = 0.0;
};

// The emulated product of two quantized operands, C = A B^T, where each operand's reduction axis
// is its quantization axis (a.options.axis, b.options.axis): A is [M, R] when blocked along axis 1
// and [R, M] when blocked along axis 0, likewise B. Hardware-produced codes can come in this way.
// Throws input_error when the reduction lengths or the block sizes along it differ.
product_result emulate_product(const quantized_tensor& a, const quantized_tensor& b, const accumulation_model& model,
                               output_rounding output = output_rounding::fp32, const gemm_options& options = {});

namespace detail {
// Per-tensor fp8 operands multiplied as MX operands with every block scale 2^0 (the same element
// codes, so the same exact block dots and accumulator steps), followed by the tensor scales as the
// CPU applies them: alpha = fl32(sa sb) times the fp32 accumulator (then the output rounding), or,
// for the exact model, the exact unscaled sum times sa sb rounded once to fp32 and fp64. `multiply`
// computes the MX product with fp32 output (the GPU backend with --device gpu; tests use the CPU).
// Applies (per_tensor_by_unit_scales_applies) to fp32-block and fp32-group:G with finite elements
// on both sides (any K), and to exact where moreover K * max|qa| * max|qb| is below 2^53 in units of
// the elements' subnormal spacing, so that the exact unscaled sum is an fp64 value (e4m3 x e4m3: any
// K below 2^17; e5m2 x e4m3: K below 8).
bool per_tensor_by_unit_scales_applies(const quantized_tensor& a, const quantized_tensor& b,
                                       const accumulation_model& model);
quantized_tensor unit_scaled_mx(const quantized_tensor& q, int block);
// sum * sa * sb (sum a finite fp64 value, sa and sb finite fp32) rounded once (RNE) to fp32 and to
// fp64: fma's exact split where it decides the fp32 rounding, the long accumulator where it does not
// (at an fp32 midpoint, near overflow or far below 1).
struct scaled_exact {
  float fp32;
  double fp64;
};
scaled_exact round_scaled_exact(double sum, float sa, float sb);
product_result per_tensor_by_unit_scales(
    const quantized_tensor& a, const quantized_tensor& b, int block, const accumulation_model& model,
    output_rounding output,
    const std::function<product_result(const quantized_tensor&, const quantized_tensor&)>& multiply);

// The exact model of per-tensor operands beyond that bound (an e5m2 operand): the operand of the
// wider range is cut by binade into parts, each multiplied as an MX operand (element format `kind`,
// block scales 2^shift, codes value / 2^shift, the other elements +0) with the other operand
// unit-scaled, so that each part's exact unscaled sum is an fp64 value; the parts' sums then go
// through one scaled rounding (core::round_scaled_exact where their sum is an fp64 value, else the
// long accumulator). The result is the exact model's, bit for bit, with any `multiply` that
// computes the MX exact model.
struct binade_part {
  int low;                 // magnitudes in [2^low, 2^high)
  int high;
  int shift;               // the part's block scale exponent
  core::element_kind kind;  // the part's element format
};
inline constexpr std::size_t max_binade_parts = 16;
// The parts of element format `split` against `other` at reduction length `depth`, from the top
// binade down. Where `other` holds every significand of `split` and K times the two largest
// integers of `other` stays below 2^53, each part is a window of `other`'s normal binades carried in
// `other`'s format (e5m2 against e4m3: three parts of e4m3, the pairing the fast paths know);
// else each part keeps `split`'s format and is as wide as the fp64 bound allows. None where not
// even one binade fits.
std::optional<std::vector<binade_part>> per_tensor_exact_parts(core::element_kind split, core::element_kind other,
                                                              std::int64_t depth);
// Where per_tensor_exact_by_parts takes the exact model: per-tensor operands with finite elements
// whose unscaled sum may exceed fp64 (per_tensor_by_unit_scales does not apply) and whose parts
// exist; `split_a` says which operand is cut.
struct per_tensor_parts_route {
  std::vector<binade_part> parts;
  bool split_a;
};
std::optional<per_tensor_parts_route> per_tensor_exact_parts_route(const quantized_tensor& a,
                                                                   const quantized_tensor& b,
                                                                   const accumulation_model& model);
product_result per_tensor_exact_by_parts(
    const quantized_tensor& a, const quantized_tensor& b, int block, const std::vector<binade_part>& parts,
    bool split_a, output_rounding output,
    const std::function<product_result(const quantized_tensor&, const quantized_tensor&)>& multiply);
}  // namespace detail

// Rotates and quantizes the operands of `kind` as `chosen` says, then emulates the product.
// Throws input_error naming the tensor and field when an operand is missing, the shapes disagree
// (x [K, n_in], dy [K, n_out], w [n_out, n_in]), the blocks along the reduction differ or the
// rotation does not fit.
gemm_result run_gemm(gemm_kind kind, const gemm_operands& operands, const strategy& chosen, const gemm_context& context,
                     const gemm_options& options = {});

// The rotated operand A or B of `kind` in its captured layout (the input of its quantizer): for
// tests and the reference of rotated strategies.
matrix rotated_operand(const matrix& tensor, int axis, const strategy& chosen, const gemm_context& context,
                       const std::string& what);

}  // namespace mxscope
