// Emulated GEMMs: operand preparation (rotate, quantize in the captured layout, bring to the
// canonical form) and the accumulation models, each in two implementations:
//
// - the generic path follows the definitions of NUMERICS.md section 7 literally, entry by entry:
//   every product of two block-scaled values is formed exactly in a double and every rounding step
//   goes through core::round_exact_sum / core::trunc_align_sum, which round exact values once;
// - the fast path (MX, NVFP4 and per-tensor fp8 operands) computes the exact block dots of a tile
//   of outputs as one small integer GEMM per K-block and then applies the model to the block dots.
//   It is bit-identical to the generic path because every value it forms is exact (the arguments
//   are written next to the code) and every rounding it performs is the model's own rounding.
//
// Results never depend on the thread count: threads split the output entries, and each entry is
// computed by one thread in the model's fixed order.
#include "mxscope/gemm.hpp"

#include <Eigen/Core>
#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <limits>
#include <vector>

#include "mxscope/errors.hpp"

namespace mxscope {

namespace core_ns = mxscope::core;
using core_ns::element_kind;

// ------------------------------------------------------------------------------------------------
// Names.

std::optional<gemm_kind> parse_gemm_kind(std::string_view name) {
  if (name == "fprop") return gemm_kind::fprop;
  if (name == "dgrad") return gemm_kind::dgrad;
  if (name == "wgrad") return gemm_kind::wgrad;
  return std::nullopt;
}

std::string_view gemm_kind_name(gemm_kind kind) {
  switch (kind) {
    case gemm_kind::fprop: return "fprop";
    case gemm_kind::dgrad: return "dgrad";
    case gemm_kind::wgrad: return "wgrad";
  }
  return "?";
}

std::optional<output_rounding> parse_output_rounding(std::string_view name) {
  if (name == "fp32") return output_rounding::fp32;
  if (name == "bf16") return output_rounding::bf16;
  return std::nullopt;
}

std::string_view output_rounding_name(output_rounding rounding) {
  return rounding == output_rounding::bf16 ? "bf16" : "fp32";
}

namespace {

constexpr int max_blocks_per_group = 1 << 20;

[[noreturn]] void bad_model(std::string_view field, std::string_view text, std::string_view why) {
  throw input_error(fmt::format(
      "{}: bad accumulation model '{}': {} (expected exact, fp32-block, fp32-group:G, trunc-align:n,G[,rtz|rne] or "
      "fp32-seq)",
      field, text, why));
}

int parse_bounded_integer(std::string_view digits, int low, int high, std::string_view field, std::string_view text,
                          std::string_view what) {
  int value = 0;
  const auto [end, error] = std::from_chars(digits.data(), digits.data() + digits.size(), value);
  if (digits.empty() || error != std::errc{} || end != digits.data() + digits.size() || value < low || value > high) {
    bad_model(field, text, fmt::format("{} must be an integer in {}..{}, got '{}'", what, low, high, digits));
  }
  return value;
}

}  // namespace

accumulation_model parse_accumulation_model(std::string_view text, std::string_view field) {
  accumulation_model model;
  if (text == "exact") {
    model.kind = accumulation_kind::exact;
    return model;
  }
  if (text == "fp32-block") {
    model.kind = accumulation_kind::fp32_block;
    return model;
  }
  if (text == "fp32-seq") {
    model.kind = accumulation_kind::fp32_seq;
    return model;
  }
  constexpr std::string_view group_prefix = "fp32-group:";
  constexpr std::string_view align_prefix = "trunc-align:";
  if (text.starts_with(group_prefix)) {
    model.kind = accumulation_kind::fp32_group;
    model.blocks_per_group =
        parse_bounded_integer(text.substr(group_prefix.size()), 1, max_blocks_per_group, field, text, "G");
    return model;
  }
  if (text.starts_with(align_prefix)) {
    model.kind = accumulation_kind::trunc_align;
    std::string_view rest = text.substr(align_prefix.size());
    std::vector<std::string_view> parts;
    while (true) {
      const auto comma = rest.find(',');
      parts.push_back(rest.substr(0, comma));
      if (comma == std::string_view::npos) break;
      rest = rest.substr(comma + 1);
    }
    if (parts.size() < 2 || parts.size() > 3) bad_model(field, text, "trunc-align takes n,G or n,G,mode");
    model.fraction_bits =
        parse_bounded_integer(parts[0], 0, core_ns::trunc_align_fraction_bits_max, field, text, "n");
    model.blocks_per_group = parse_bounded_integer(parts[1], 1, max_blocks_per_group, field, text, "G");
    if (parts.size() == 3) {
      if (parts[2] == "rtz") {
        model.rounding = alignment_rounding::rtz;
      } else if (parts[2] == "rne") {
        model.rounding = alignment_rounding::rne;
      } else {
        bad_model(field, text, fmt::format("the rounding must be rtz or rne, got '{}'", parts[2]));
      }
    }
    return model;
  }
  bad_model(field, text, "unknown model");
}

std::string accumulation_model_name(const accumulation_model& model) {
  switch (model.kind) {
    case accumulation_kind::exact: return "exact";
    case accumulation_kind::fp32_block: return "fp32-block";
    case accumulation_kind::fp32_group: return fmt::format("fp32-group:{}", model.blocks_per_group);
    case accumulation_kind::trunc_align:
      return fmt::format("trunc-align:{},{},{}", model.fraction_bits, model.blocks_per_group,
                         model.rounding == alignment_rounding::rne ? "rne" : "rtz");
    case accumulation_kind::fp32_seq: return "fp32-seq";
  }
  return "?";
}

gemm_layout layout_of(gemm_kind kind) {
  switch (kind) {
    case gemm_kind::fprop: return {"x", "w", 1, 1, core_ns::random_role::x, core_ns::random_role::w};
    case gemm_kind::dgrad: return {"dy", "w", 1, 0, core_ns::random_role::dy, core_ns::random_role::w};
    case gemm_kind::wgrad: return {"dy", "x", 0, 0, core_ns::random_role::dy, core_ns::random_role::x};
  }
  return {"dy", "x", 0, 0, core_ns::random_role::dy, core_ns::random_role::x};
}

namespace {

// ------------------------------------------------------------------------------------------------
// Canonical operands: [rows, depth] with the reduction (depth) contiguous.

// Marks the scale exponent of a NaN block (its scale code is the NaN code). Far outside every
// exponent range the fast path accepts, so such blocks always take the per-entry step.
constexpr std::int32_t nan_block_exponent = 1 << 20;

struct canonical_operand {
  std::int64_t rows = 0;
  std::int64_t depth = 0;
  int block = 32;           // K-block size of the accumulation
  std::int64_t blocks = 0;  // blocks per row
  // Element values without any scale, exact (fp32, bf16 and fp8 values can be inf or NaN).
  std::vector<double> elements;  // [rows, depth]
  // Exact block scale factors; NaN for a NaN block. 1 for formats without block scales.
  std::vector<double> block_scales;  // [rows, blocks]
  float tensor_scale = 1.0f;
  // Integer view for the fast path: element * 2^fraction_bits is an integer of magnitude at most
  // integer_max, and block scale = scale_mantissa * 2^scale_exponent with an integer mantissa.
  bool integer_elements = false;
  int fraction_bits = 0;
  std::int64_t integer_max = 0;
  std::int64_t scale_mantissa_max = 1;
  std::vector<std::int32_t> scale_exponents;  // [rows, blocks] (nan_block_exponent for NaN blocks)
  std::vector<std::int32_t> scale_mantissas;  // [rows, blocks]
  matrix dequantized;                         // [rows, depth] fp32 dequantized values (fp32-seq)

  double scaled(std::int64_t row, std::int64_t k) const {
    return elements[static_cast<std::size_t>(row * depth + k)] *
           block_scales[static_cast<std::size_t>(row * blocks + k / block)];
  }
};

bool is_packed_4bit(const quantized_tensor& q) {
  return (q.options.format.scheme == quant_scheme::mx || q.options.format.scheme == quant_scheme::nvfp4) &&
         core_ns::spec(q.options.format.element).bits == 4;
}

std::uint8_t code_at(const quantized_tensor& q, std::int64_t row, std::int64_t col) {
  if (is_packed_4bit(q)) {
    const std::uint8_t byte = q.codes[static_cast<std::size_t>(row * q.code_row_bytes() + col / 2)];
    return col % 2 == 0 ? (byte & 0x0FU) : static_cast<std::uint8_t>(byte >> 4);
  }
  return q.codes[static_cast<std::size_t>(row * q.cols + col)];
}

// The K-block size of an operand: its quantization block, or 0 when its format has none.
int quantization_block(const quantized_tensor& q) {
  const auto scheme = q.options.format.scheme;
  return (scheme == quant_scheme::mx || scheme == quant_scheme::nvfp4) ? q.block : 0;
}

std::string describe(const quantized_tensor& q) {
  const int block = quantization_block(q);
  return block == 0 ? format_name(q.options.format) : fmt::format("{}, block {}", format_name(q.options.format), block);
}

// Builds the canonical form of a quantized tensor whose reduction axis is its quantization axis.
canonical_operand make_canonical(const quantized_tensor& q, int block) {
  canonical_operand out;
  const bool along_rows = q.options.axis == 1;
  out.rows = along_rows ? q.rows : q.cols;
  out.depth = along_rows ? q.cols : q.rows;
  out.block = block;
  out.blocks = (out.depth + block - 1) / block;
  out.elements.assign(static_cast<std::size_t>(out.rows * out.depth), 0.0);
  out.block_scales.assign(static_cast<std::size_t>(out.rows * out.blocks), 1.0);
  out.scale_exponents.assign(static_cast<std::size_t>(out.rows * out.blocks), 0);
  out.scale_mantissas.assign(static_cast<std::size_t>(out.rows * out.blocks), 1);
  out.dequantized = matrix(out.rows, out.depth);
  out.tensor_scale = 1.0f;

  const auto scheme = q.options.format.scheme;
  const element_kind kind = q.options.format.element;
  const bool integer_format = scheme == quant_scheme::mx || scheme == quant_scheme::nvfp4 || scheme == quant_scheme::per_tensor;
  if (integer_format) {
    // Every finite element value of the small formats is a multiple of the subnormal spacing.
    out.fraction_bits = -core_ns::subnormal_ulp_exponent(kind);
    out.integer_max = static_cast<std::int64_t>(core_ns::max_normal(kind) * core_ns::pow2(out.fraction_bits));
  }
  if (scheme == quant_scheme::nvfp4 || scheme == quant_scheme::per_tensor) out.tensor_scale = q.tensor_scale;

  bool all_finite = true;
#pragma omp parallel for schedule(static) reduction(&& : all_finite)
  for (std::int64_t row = 0; row < out.rows; ++row) {
    for (std::int64_t k = 0; k < out.depth; ++k) {
      const std::int64_t r = along_rows ? row : k;
      const std::int64_t c = along_rows ? k : row;
      double value = 0.0;
      switch (scheme) {
        case quant_scheme::none: value = q.dequantized(r, c); break;
        case quant_scheme::bf16: {
          const auto at = static_cast<std::size_t>(r * q.cols + c) * 2;
          value = core_ns::bf16_to_float(static_cast<std::uint16_t>(q.codes[at] | (q.codes[at + 1] << 8)));
          break;
        }
        case quant_scheme::mx:
        case quant_scheme::nvfp4:
        case quant_scheme::per_tensor: value = core_ns::decode(kind, code_at(q, r, c)); break;
      }
      all_finite = all_finite && std::isfinite(value);
      out.elements[static_cast<std::size_t>(row * out.depth + k)] = value;
      out.dequantized(row, k) = q.dequantized(r, c);
    }
    for (std::int64_t b = 0; b < out.blocks; ++b) {
      const std::int64_t k = b * block;  // the block's first element along the reduction
      const std::int64_t r = along_rows ? row : k;
      const std::int64_t c = along_rows ? k : row;
      const auto at = static_cast<std::size_t>(row * out.blocks + b);
      if (scheme == quant_scheme::mx) {
        const std::uint8_t code = along_rows ? q.scales[static_cast<std::size_t>(r * q.scale_cols + c / q.block)]
                                             : q.scales[static_cast<std::size_t>((r / q.block) * q.scale_cols + c)];
        if (code == core_ns::scale_nan_code) {
          out.block_scales[at] = std::numeric_limits<double>::quiet_NaN();
          out.scale_exponents[at] = nan_block_exponent;
        } else {
          out.block_scales[at] = core_ns::pow2(core_ns::scale_exponent(code));
          out.scale_exponents[at] = core_ns::scale_exponent(code);
        }
      } else if (scheme == quant_scheme::nvfp4) {
        const std::int64_t tile_rows = q.options.nvfp4_2d ? 16 : (q.options.axis == 0 ? 16 : 1);
        const std::int64_t tile_cols = q.options.nvfp4_2d ? 16 : (q.options.axis == 1 ? 16 : 1);
        const std::uint8_t code = q.scales[static_cast<std::size_t>((r / tile_rows) * q.scale_cols + c / tile_cols)];
        const double scale = core_ns::decode(element_kind::ue4m3, code);
        out.block_scales[at] = scale;
        if (std::isnan(scale)) {
          out.scale_exponents[at] = nan_block_exponent;
        } else if (scale == 0.0) {
          out.scale_mantissas[at] = 0;
        } else {
          // scale = odd mantissa * 2^exponent (a ue4m3 value has at most 4 significant bits).
          const auto parts = core_ns::decompose(scale);
          const int trailing = __builtin_ctzll(parts.significand);
          out.scale_mantissas[at] = static_cast<std::int32_t>(parts.significand >> trailing);
          out.scale_exponents[at] = parts.exponent + trailing;
        }
      }
    }
  }
  // An operand with inf or NaN elements (possible for fp32, bf16 and per-tensor fp8) takes the
  // generic path, whose per-product arithmetic gives those values their IEEE meaning.
  out.integer_elements = integer_format && all_finite;
  for (const std::int32_t mantissa : out.scale_mantissas) {
    out.scale_mantissa_max = std::max<std::int64_t>(out.scale_mantissa_max, mantissa);
  }
  return out;
}

// ------------------------------------------------------------------------------------------------
// Shared per-entry steps.

// acc + (a block or group contribution that is NaN or whose accumulator is no longer finite):
// the IEEE meaning of the sum, which is the only thing left to compute.
float nonfinite_step(float accumulator, double nonfinite_sum) {
  return static_cast<float>(static_cast<double>(accumulator) + nonfinite_sum);
}

// fl32(accumulator + value) for an exact double value (a scaled block dot or group sum).
float add_exact_value(float accumulator, double value) {
  if (!std::isfinite(accumulator) || !std::isfinite(value)) return nonfinite_step(accumulator, value);
  // +0.0 turns a -0 value into +0: an exactly zero sum is +0 (core/accumulate.hpp).
  return core_ns::add_to_float(accumulator, value + 0.0);
}

float epilogue(float accumulator, float alpha) { return accumulator * alpha; }

float round_output(float value, output_rounding output) {
  if (output == output_rounding::fp32) return value;
  return core_ns::bf16_to_float(core_ns::float_to_bf16(value, core_ns::rounding_mode::rne));
}

// The exact products of the tensor scales, split so that each half times a short value is exact:
// sa * sb has at most 48 significant bits (two fp32 significands), each half at most 24.
struct tensor_scale_product {
  bool is_one = true;
  double high = 1.0;
  double low = 0.0;
};

tensor_scale_product make_scale_product(float sa, float sb) {
  const double product = static_cast<double>(sa) * static_cast<double>(sb);
  tensor_scale_product out;
  out.is_one = product == 1.0;
  const auto split = core_ns::split_significand(product, 24);
  out.high = split.high;
  out.low = split.low;
  return out;
}

// Adds value * (sa * sb) to an exact accumulator. `value` has at most 53 significant bits: its top
// 27 and its remaining (at most 26) bits times a 24-bit half of the scale product stay within 51
// bits, so all four products are exact.
void add_scaled_exactly(core_ns::long_accumulator& total, double value, const tensor_scale_product& scale) {
  if (scale.is_one) {
    total.add(value);
    return;
  }
  const auto split = core_ns::split_significand(value, 27);
  total.add(split.high * scale.high);
  total.add(split.high * scale.low);
  total.add(split.low * scale.high);
  total.add(split.low * scale.low);
}

// ------------------------------------------------------------------------------------------------
// The generic path: NUMERICS.md section 7 entry by entry.

struct generic_entry_result {
  float value;
  double exact;
};

generic_entry_result generic_entry(const canonical_operand& a, const canonical_operand& b, std::int64_t i,
                                   std::int64_t j, const accumulation_model& model, const tensor_scale_product& scale,
                                   std::vector<double>& products) {
  const std::int64_t depth = a.depth;
  if (model.kind == accumulation_kind::exact) {
    core_ns::long_accumulator total;
    double nonfinite_sum = 0.0;
    bool nonfinite = false;
    for (std::int64_t k = 0; k < depth; ++k) {
      // Block-scaled values are exact doubles, and so is their product: at most 24 + 24
      // significant bits, magnitudes within 2^-300 .. 2^260.
      const double product = a.scaled(i, k) * b.scaled(j, k);
      if (!std::isfinite(product)) {
        nonfinite = true;
        nonfinite_sum += product;
      } else {
        add_scaled_exactly(total, product, scale);
      }
    }
    if (nonfinite) {
      const double ieee = nonfinite_sum * (static_cast<double>(a.tensor_scale) * b.tensor_scale);
      return {static_cast<float>(ieee), ieee};
    }
    return {total.round_to_float(), total.round_to_double()};
  }

  const std::int64_t group_length = static_cast<std::int64_t>(a.block) * model.blocks_per_group;
  float accumulator = 0.0f;
  for (std::int64_t begin = 0; begin < depth; begin += group_length) {
    const std::int64_t end = std::min(depth, begin + group_length);
    products.clear();
    double nonfinite_sum = 0.0;
    bool nonfinite = false;
    for (std::int64_t k = begin; k < end; ++k) {
      const double product = a.scaled(i, k) * b.scaled(j, k);
      if (!std::isfinite(product)) {
        nonfinite = true;
        nonfinite_sum += product;
      }
      products.push_back(product);
    }
    if (nonfinite || !std::isfinite(accumulator)) {
      accumulator = nonfinite_step(accumulator, nonfinite_sum);
      continue;
    }
    const int count = static_cast<int>(products.size());
    if (model.kind == accumulation_kind::trunc_align) {
      accumulator = core_ns::trunc_align_sum(accumulator, products.data(), count, model.fraction_bits, model.rounding);
    } else {
      accumulator = core_ns::add_exactly_to_float(accumulator, products.data(), count);
    }
  }
  return {accumulator, 0.0};
}

void generic_product(const canonical_operand& a, const canonical_operand& b, const accumulation_model& model,
                     float alpha, matrix& out, matrix64* exact) {
  const tensor_scale_product scale = make_scale_product(a.tensor_scale, b.tensor_scale);
#pragma omp parallel
  {
    std::vector<double> products;
#pragma omp for schedule(dynamic, 1)
    for (std::int64_t i = 0; i < a.rows; ++i) {
      for (std::int64_t j = 0; j < b.rows; ++j) {
        const generic_entry_result entry = generic_entry(a, b, i, j, model, scale, products);
        if (model.kind == accumulation_kind::exact) {
          out(i, j) = entry.value;
          if (exact != nullptr) (*exact)(i, j) = entry.exact;
        } else {
          out(i, j) = epilogue(entry.value, alpha);
        }
      }
    }
  }
}

// ------------------------------------------------------------------------------------------------
// fp32-seq: one fused multiply-add per product, ascending K, on the fp32 dequantized values.
// The panel kernel is compiled twice, for the baseline target and for AVX2+FMA; both compute
// fmaf exactly (a fused operation has one correctly rounded result), so they agree bit for bit.

constexpr int seq_panel_rows = 8;
constexpr int seq_panel_width = 256;

__attribute__((always_inline)) inline void sequential_fma_panel_body(const float* a_rows, std::int64_t depth, int rows,
                                                                     const float* b_transposed, std::int64_t b_stride,
                                                                     int width, float* accumulators) {
  for (std::int64_t k = 0; k < depth; ++k) {
    const float* b_row = b_transposed + k * b_stride;
    for (int r = 0; r < rows; ++r) {
      const float a_value = a_rows[r * depth + k];
      float* accumulator_row = accumulators + r * seq_panel_width;
      for (int j = 0; j < width; ++j) accumulator_row[j] = __builtin_fmaf(a_value, b_row[j], accumulator_row[j]);
    }
  }
}

__attribute__((target("avx2,fma"))) void sequential_fma_panel_avx2(const float* a_rows, std::int64_t depth, int rows,
                                                                    const float* b_transposed, std::int64_t b_stride,
                                                                    int width, float* accumulators) {
  sequential_fma_panel_body(a_rows, depth, rows, b_transposed, b_stride, width, accumulators);
}

void sequential_fma_panel_baseline(const float* a_rows, std::int64_t depth, int rows, const float* b_transposed,
                                   std::int64_t b_stride, int width, float* accumulators) {
  sequential_fma_panel_body(a_rows, depth, rows, b_transposed, b_stride, width, accumulators);
}

bool cpu_has_avx2_fma() {
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return has;
}

void sequential_fma_product(const canonical_operand& a, const canonical_operand& b, matrix& out) {
  const std::int64_t depth = a.depth;
  const matrix b_transposed = transposed(b.dequantized);  // [depth, N]
  const std::int64_t n = b.rows;
  const std::int64_t row_panels = (a.rows + seq_panel_rows - 1) / seq_panel_rows;
  const std::int64_t col_panels = (n + seq_panel_width - 1) / seq_panel_width;
  const bool vector_unit = cpu_has_avx2_fma();
#pragma omp parallel
  {
    std::vector<float> accumulators(static_cast<std::size_t>(seq_panel_rows * seq_panel_width));
#pragma omp for schedule(dynamic, 1)
    for (std::int64_t panel = 0; panel < row_panels * col_panels; ++panel) {
      const std::int64_t i0 = (panel / col_panels) * seq_panel_rows;
      const std::int64_t j0 = (panel % col_panels) * seq_panel_width;
      const int rows = static_cast<int>(std::min<std::int64_t>(seq_panel_rows, a.rows - i0));
      const int width = static_cast<int>(std::min<std::int64_t>(seq_panel_width, n - j0));
      std::fill(accumulators.begin(), accumulators.end(), 0.0f);
      const float* a_rows = a.dequantized.data() + i0 * depth;
      const float* b_columns = b_transposed.data() + j0;
      if (vector_unit) {
        sequential_fma_panel_avx2(a_rows, depth, rows, b_columns, n, width, accumulators.data());
      } else {
        sequential_fma_panel_baseline(a_rows, depth, rows, b_columns, n, width, accumulators.data());
      }
      for (int r = 0; r < rows; ++r) {
        for (int j = 0; j < width; ++j) out(i0 + r, j0 + j) = accumulators[static_cast<std::size_t>(r * seq_panel_width + j)];
      }
    }
  }
}

// ------------------------------------------------------------------------------------------------
// The fast path for operands with integer elements (MX, NVFP4, per-tensor fp8).
//
// Block dot of entry (i, j) and K-block b, in integers: D = sum over the block of IA * IB where
// IA = qa * 2^fa and IB = qb * 2^fb are the elements' integer values. |D| < 2^bound_bits with
// bound_bits = bits(block) + bits(max IA) + bits(max IB). Every partial sum of such a dot is an
// integer below 2^bound_bits, so a floating-point GEMM computes D exactly in ANY summation order
// (Eigen's blocking and vectorization included) as long as bound_bits <= 24 in fp32 (fp4, fp6 and
// int8 pairs at block 32) or <= 53 in fp64 (fp8 e4m3 pairs).
// The scaled block dot is c = D * ma * mb * 2^(ea + eb - fa - fb) with integer scale mantissas
// (1 for MX, at most 4 bits for ue4m3): D * ma * mb < 2^53 is exact in a double and the power of
// two keeps it exact (the exponent stays within about +-300).

struct fast_plan {
  bool use_float = false;          // D is computed in fp32 (else fp64)
  bool power_of_two_scales = false;  // every block scale is a power of two: fp32-block can add in fp32
  int bound_bits = 0;
  int fraction_total = 0;
};

int bits_of(std::int64_t value) { return core_ns::bit_length(static_cast<core_ns::uint128>(value)); }

std::optional<fast_plan> plan_fast_path(const canonical_operand& a, const canonical_operand& b,
                                        const accumulation_model& model) {
  if (model.kind != accumulation_kind::exact && model.kind != accumulation_kind::fp32_block &&
      model.kind != accumulation_kind::fp32_group) {
    return std::nullopt;
  }
  if (!a.integer_elements || !b.integer_elements) return std::nullopt;
  fast_plan plan;
  plan.bound_bits = bits_of(a.block) + bits_of(a.integer_max) + bits_of(b.integer_max);
  if (plan.bound_bits > 53) return std::nullopt;
  if (plan.bound_bits + bits_of(a.scale_mantissa_max) + bits_of(b.scale_mantissa_max) > 53) return std::nullopt;
  plan.use_float = plan.bound_bits <= 24;
  plan.power_of_two_scales = plan.use_float && a.scale_mantissa_max <= 1 && b.scale_mantissa_max <= 1;
  plan.fraction_total = a.fraction_bits + b.fraction_bits;
  return plan;
}

template <class T>
using row_major_matrix = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

// D[rows x cols] = A[m0 .. m0+rows, k0 .. k0+length] * B[n0 .. n0+cols, same]^T, integers, exact.
template <class T>
void integer_block_products(const T* a, const T* b, std::int64_t depth, std::int64_t m0, std::int64_t rows,
                            std::int64_t n0, std::int64_t cols, std::int64_t k0, std::int64_t length, T* out) {
  using strided = Eigen::Map<const row_major_matrix<T>, 0, Eigen::OuterStride<>>;
  const strided a_block(a + m0 * depth + k0, rows, length, Eigen::OuterStride<>(depth));
  const strided b_block(b + n0 * depth + k0, cols, length, Eigen::OuterStride<>(depth));
  Eigen::Map<row_major_matrix<T>> products(out, rows, cols);
  products.noalias() = a_block * b_block.transpose();
}

template <class T>
std::vector<T> integer_values(const canonical_operand& operand) {
  std::vector<T> values(operand.elements.size());
  const double scale = core_ns::pow2(operand.fraction_bits);
  for (std::size_t i = 0; i < values.size(); ++i) values[i] = static_cast<T>(operand.elements[i] * scale);
  return values;
}

// The scaled block dot as an exact double (NaN for a NaN block).
double scaled_block_dot(double dot, std::int32_t exponent_a, std::int32_t mantissa_a, std::int32_t exponent_b,
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
};

constexpr std::int64_t tile_rows_block = 64;
constexpr std::int64_t tile_cols_block = 256;
constexpr std::int64_t tile_rows_exact = 32;
constexpr std::int64_t tile_cols_exact = 64;

// fp32-block with power-of-two scales and D exact in fp32: c = D * 2^k is exactly representable
// in fp32 whenever -126 <= k and |D| * 2^k < 2^128 (k <= 128 - bound_bits): D has at most 24 bits,
// and 2^k is a normal fp32 number, so the fp32 product D * 2^k is exact. The fp32 addition
// acc + c then rounds the exact sum once (RNE, the default mode): it IS fl32(acc + c). Rows of a
// tile whose exponents leave that range (or meet a NaN block) take the per-entry exact step.
std::int64_t fp32_block_tile_float(const fast_context& context, const float* a_values, const float* b_values,
                                   std::int64_t m0, std::int64_t rows, std::int64_t n0, std::int64_t cols,
                                   std::vector<float>& dots, std::vector<float>& accumulators) {
  const canonical_operand& a = *context.a;
  const canonical_operand& b = *context.b;
  const std::int64_t n = b.rows;
  const int fraction_total = context.plan.fraction_total;
  const int highest_k = 128 - context.plan.bound_bits;
  std::int64_t fallbacks = 0;
  std::fill(accumulators.begin(), accumulators.begin() + rows * cols, 0.0f);
  for (std::int64_t block = 0; block < a.blocks; ++block) {
    const std::int64_t k0 = block * a.block;
    const std::int64_t length = std::min<std::int64_t>(a.block, a.depth - k0);
    integer_block_products(a_values, b_values, a.depth, m0, rows, n0, cols, k0, length, dots.data());
    const std::int32_t* b_exponents = context.b_exponents.data() + block * n + n0;
    std::int32_t b_lowest = std::numeric_limits<std::int32_t>::max();
    std::int32_t b_highest = std::numeric_limits<std::int32_t>::min();
    for (std::int64_t j = 0; j < cols; ++j) {
      b_lowest = std::min(b_lowest, b_exponents[j]);
      b_highest = std::max(b_highest, b_exponents[j]);
    }
    for (std::int64_t r = 0; r < rows; ++r) {
      const std::int32_t a_exponent = a.scale_exponents[static_cast<std::size_t>((m0 + r) * a.blocks + block)];
      float* accumulator_row = accumulators.data() + r * cols;
      const float* dot_row = dots.data() + r * cols;
      const std::int64_t k_low = static_cast<std::int64_t>(a_exponent) + b_lowest - fraction_total;
      const std::int64_t k_high = static_cast<std::int64_t>(a_exponent) + b_highest - fraction_total;
      if (k_low >= -126 && k_high <= highest_k) {
        const std::int32_t biased = a_exponent - fraction_total + 127;
        for (std::int64_t j = 0; j < cols; ++j) {
          const float power = core_ns::bits_float(static_cast<std::uint32_t>(biased + b_exponents[j]) << 23);
          // dot + 0.0f maps a -0 dot to +0 (an exactly zero sum is +0).
          accumulator_row[j] = accumulator_row[j] + (dot_row[j] + 0.0f) * power;
        }
      } else {
        for (std::int64_t j = 0; j < cols; ++j) {
          const double contribution = scaled_block_dot(dot_row[j], a_exponent, 1, b_exponents[j], 1, fraction_total);
          accumulator_row[j] = add_exact_value(accumulator_row[j], contribution);
        }
        fallbacks += cols;
      }
    }
  }
  return fallbacks;
}

// The general tile: block dots in T, scaled block dots as exact doubles, then the model.
template <class T>
std::int64_t general_tile(const fast_context& context, const T* a_values, const T* b_values, std::int64_t m0,
                          std::int64_t rows, std::int64_t n0, std::int64_t cols, std::vector<T>& dots,
                          std::vector<double>& contributions, std::vector<float>& accumulators,
                          std::vector<core_ns::long_accumulator>& totals, std::vector<std::uint8_t>& nan_entries,
                          matrix& out, matrix64* exact) {
  const canonical_operand& a = *context.a;
  const canonical_operand& b = *context.b;
  const std::int64_t n = b.rows;
  const std::int64_t entries = rows * cols;
  const accumulation_model& model = context.model;
  const bool is_exact = model.kind == accumulation_kind::exact;
  const std::int64_t group = model.kind == accumulation_kind::fp32_group ? model.blocks_per_group : 1;
  std::int64_t fallbacks = 0;

  if (is_exact) {
    for (std::int64_t e = 0; e < entries; ++e) totals[static_cast<std::size_t>(e)].clear();
    std::fill(nan_entries.begin(), nan_entries.begin() + entries, std::uint8_t{0});
  } else {
    std::fill(accumulators.begin(), accumulators.begin() + entries, 0.0f);
  }

  for (std::int64_t group_begin = 0; group_begin < a.blocks; group_begin += group) {
    const std::int64_t group_end = std::min(a.blocks, group_begin + group);
    for (std::int64_t block = group_begin; block < group_end; ++block) {
      const std::int64_t k0 = block * a.block;
      const std::int64_t length = std::min<std::int64_t>(a.block, a.depth - k0);
      integer_block_products(a_values, b_values, a.depth, m0, rows, n0, cols, k0, length, dots.data());
      const std::int32_t* b_exponents = context.b_exponents.data() + block * n + n0;
      const std::int32_t* b_mantissas = context.b_mantissas.data() + block * n + n0;
      double* slot = contributions.data() + (block - group_begin) * entries;
      for (std::int64_t r = 0; r < rows; ++r) {
        const auto a_at = static_cast<std::size_t>((m0 + r) * a.blocks + block);
        const std::int32_t a_exponent = a.scale_exponents[a_at];
        const std::int32_t a_mantissa = a.scale_mantissas[a_at];
        for (std::int64_t j = 0; j < cols; ++j) {
          slot[r * cols + j] = scaled_block_dot(static_cast<double>(dots[static_cast<std::size_t>(r * cols + j)]),
                                                a_exponent, a_mantissa, b_exponents[j], b_mantissas[j],
                                                context.plan.fraction_total);
        }
      }
      if (is_exact) {
        for (std::int64_t e = 0; e < entries; ++e) {
          const double contribution = slot[e];
          if (std::isnan(contribution)) {
            nan_entries[static_cast<std::size_t>(e)] = 1;
          } else {
            add_scaled_exactly(totals[static_cast<std::size_t>(e)], contribution, context.scale);
          }
        }
      }
    }
    if (is_exact) continue;
    const std::int64_t count = group_end - group_begin;
    double terms[64];
    std::vector<double> wide_terms;
    for (std::int64_t e = 0; e < entries; ++e) {
      float& accumulator = accumulators[static_cast<std::size_t>(e)];
      if (count == 1) {
        accumulator = add_exact_value(accumulator, contributions[static_cast<std::size_t>(e)]);
        continue;
      }
      double* gathered = terms;
      if (count > 64) {
        wide_terms.resize(static_cast<std::size_t>(count));
        gathered = wide_terms.data();
      }
      bool nan_term = false;
      for (std::int64_t g = 0; g < count; ++g) {
        gathered[g] = contributions[static_cast<std::size_t>(g * entries + e)];
        nan_term = nan_term || std::isnan(gathered[g]);
      }
      if (nan_term || !std::isfinite(accumulator)) {
        accumulator = nonfinite_step(accumulator, nan_term ? std::numeric_limits<double>::quiet_NaN() : 0.0);
        continue;
      }
      accumulator = core_ns::add_exactly_to_float(accumulator, gathered, static_cast<int>(count));
    }
  }

  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t j = 0; j < cols; ++j) {
      const auto e = static_cast<std::size_t>(r * cols + j);
      if (is_exact) {
        if (nan_entries[e] != 0) {
          out(m0 + r, n0 + j) = std::numeric_limits<float>::quiet_NaN();
          if (exact != nullptr) (*exact)(m0 + r, n0 + j) = std::numeric_limits<double>::quiet_NaN();
        } else {
          out(m0 + r, n0 + j) = totals[e].round_to_float();
          if (exact != nullptr) (*exact)(m0 + r, n0 + j) = totals[e].round_to_double();
        }
      } else {
        out(m0 + r, n0 + j) = epilogue(accumulators[e], context.alpha);
      }
    }
  }
  return fallbacks;
}

template <class T>
std::int64_t fast_product(fast_context& context, matrix& out, matrix64* exact) {
  const canonical_operand& a = *context.a;
  const canonical_operand& b = *context.b;
  const std::vector<T> a_values = integer_values<T>(a);
  const std::vector<T> b_values = integer_values<T>(b);
  const std::int64_t n = b.rows;
  context.b_exponents.assign(static_cast<std::size_t>(b.blocks * n), 0);
  context.b_mantissas.assign(static_cast<std::size_t>(b.blocks * n), 1);
  for (std::int64_t j = 0; j < n; ++j) {
    for (std::int64_t block = 0; block < b.blocks; ++block) {
      context.b_exponents[static_cast<std::size_t>(block * n + j)] =
          b.scale_exponents[static_cast<std::size_t>(j * b.blocks + block)];
      context.b_mantissas[static_cast<std::size_t>(block * n + j)] =
          b.scale_mantissas[static_cast<std::size_t>(j * b.blocks + block)];
    }
  }
  const bool is_exact = context.model.kind == accumulation_kind::exact;
  const bool float_block =
      std::is_same_v<T, float> && context.plan.power_of_two_scales && context.model.kind == accumulation_kind::fp32_block;
  const std::int64_t tile_rows = is_exact ? tile_rows_exact : tile_rows_block;
  const std::int64_t tile_cols = is_exact ? tile_cols_exact : tile_cols_block;
  const std::int64_t row_tiles = (a.rows + tile_rows - 1) / tile_rows;
  const std::int64_t col_tiles = (n + tile_cols - 1) / tile_cols;
  const std::int64_t group = context.model.kind == accumulation_kind::fp32_group ? context.model.blocks_per_group : 1;
  std::int64_t fallbacks = 0;

#pragma omp parallel reduction(+ : fallbacks)
  {
    std::vector<T> dots(static_cast<std::size_t>(tile_rows * tile_cols));
    std::vector<float> accumulators(static_cast<std::size_t>(tile_rows * tile_cols));
    std::vector<double> contributions;
    std::vector<core_ns::long_accumulator> totals;
    std::vector<std::uint8_t> nan_entries;
    if (!float_block) {
      if (is_exact) {
        contributions.resize(static_cast<std::size_t>(tile_rows * tile_cols));
        totals.resize(static_cast<std::size_t>(tile_rows * tile_cols));
        nan_entries.resize(static_cast<std::size_t>(tile_rows * tile_cols));
      } else {
        contributions.resize(static_cast<std::size_t>(std::min(group, std::max<std::int64_t>(a.blocks, 1)) * tile_rows *
                                                      tile_cols));
      }
    }
#pragma omp for schedule(dynamic, 1)
    for (std::int64_t tile = 0; tile < row_tiles * col_tiles; ++tile) {
      const std::int64_t m0 = (tile / col_tiles) * tile_rows;
      const std::int64_t n0 = (tile % col_tiles) * tile_cols;
      const std::int64_t rows = std::min(tile_rows, a.rows - m0);
      const std::int64_t cols = std::min(tile_cols, n - n0);
      if constexpr (std::is_same_v<T, float>) {
        if (float_block) {
          fallbacks += fp32_block_tile_float(context, a_values.data(), b_values.data(), m0, rows, n0, cols, dots,
                                             accumulators);
          for (std::int64_t r = 0; r < rows; ++r) {
            for (std::int64_t j = 0; j < cols; ++j) {
              out(m0 + r, n0 + j) = epilogue(accumulators[static_cast<std::size_t>(r * cols + j)], context.alpha);
            }
          }
          continue;
        }
      }
      fallbacks += general_tile<T>(context, a_values.data(), b_values.data(), m0, rows, n0, cols, dots, contributions,
                                   accumulators, totals, nan_entries, out, exact);
    }
  }
  return fallbacks;
}

// ------------------------------------------------------------------------------------------------

int common_block(const quantized_tensor& a, const quantized_tensor& b, std::string_view what, std::string_view a_name,
                 std::string_view b_name) {
  const int a_block = quantization_block(a);
  const int b_block = quantization_block(b);
  if (a_block != 0 && b_block != 0 && a_block != b_block) {
    throw input_error(fmt::format(
        "{}: field 'block': operands {} ({}) and {} ({}) must have the same blocks along the reduction axis", what,
        a_name, describe(a), b_name, describe(b)));
  }
  if (a_block != 0) return a_block;
  if (b_block != 0) return b_block;
  return 32;
}

product_result emulate_named(const quantized_tensor& a, const quantized_tensor& b, const accumulation_model& model,
                             output_rounding output, const gemm_options& options, std::string_view what,
                             std::string_view a_name, std::string_view b_name) {
  for (const auto* q : {&a, &b}) {
    if (q->options.axis != 0 && q->options.axis != 1) {
      throw input_error(fmt::format("{}: field 'axis' must be 0 or 1, got {}", what, q->options.axis));
    }
  }
  const std::int64_t a_depth = a.options.axis == 1 ? a.cols : a.rows;
  const std::int64_t b_depth = b.options.axis == 1 ? b.cols : b.rows;
  if (a_depth != b_depth) {
    throw input_error(fmt::format("{}: the reduction lengths differ: {} has {} along axis {}, {} has {} along axis {}",
                                  what, a_name, a_depth, a.options.axis, b_name, b_depth, b.options.axis));
  }
  if (model.kind == accumulation_kind::fp32_group || model.kind == accumulation_kind::trunc_align) {
    if (model.blocks_per_group < 1 || model.blocks_per_group > max_blocks_per_group) {
      throw input_error(fmt::format("{}: field 'accum': G must be in 1..{}, got {}", what, max_blocks_per_group,
                                    model.blocks_per_group));
    }
  }
  if (model.kind == accumulation_kind::trunc_align &&
      (model.fraction_bits < 0 || model.fraction_bits > core_ns::trunc_align_fraction_bits_max)) {
    throw input_error(fmt::format("{}: field 'accum': n must be in 0..{}, got {}", what,
                                  core_ns::trunc_align_fraction_bits_max, model.fraction_bits));
  }
  const int block = common_block(a, b, what, a_name, b_name);
  const canonical_operand left = make_canonical(a, block);
  const canonical_operand right = make_canonical(b, block);

  product_result result;
  result.out = matrix(left.rows, right.rows);
  matrix64* exact = nullptr;
  if (model.kind == accumulation_kind::exact) {
    result.exact = matrix64(left.rows, right.rows);
    exact = &result.exact;
  }
  const float alpha = left.tensor_scale * right.tensor_scale;

  if (model.kind == accumulation_kind::fp32_seq) {
    sequential_fma_product(left, right, result.out);
  } else {
    const auto plan = options.path == accumulation_path::automatic ? plan_fast_path(left, right, model) : std::nullopt;
    if (plan && left.rows > 0 && right.rows > 0) {
      fast_context context{&left, &right, *plan, model, alpha, make_scale_product(left.tensor_scale, right.tensor_scale),
                           {}, {}};
      result.fallback_entries =
          plan->use_float ? fast_product<float>(context, result.out, exact) : fast_product<double>(context, result.out, exact);
    } else {
      generic_product(left, right, model, alpha, result.out, exact);
    }
  }
  if (output == output_rounding::bf16) {
    for (float& value : result.out.values) value = round_output(value, output);
  }
  return result;
}

std::uint32_t layer_hash(const std::string& layer) { return core_ns::fnv1a32(layer.data(), layer.size()); }

rotation_options rotation_for(const strategy& chosen, const gemm_context& context) {
  rotation_options rotation;
  rotation.size = chosen.rotation_size;
  rotation.signs = chosen.rotation_signs;
  rotation.seed = chosen.seed;
  rotation.step = context.step;
  rotation.layer_hash = layer_hash(context.layer);
  return rotation;
}

operand_summary summarize(std::string_view name, int axis, const matrix& input, const quantized_tensor& q) {
  operand_summary summary;
  summary.name = std::string(name);
  summary.axis = axis;
  summary.elements = input.size();
  summary.nonzero_inputs = q.nonzero_inputs;
  summary.flushed = q.flushed;
  summary.saturated = q.saturated;
  summary.nonfinite_inputs = q.nonfinite_inputs;
  // Sequential fp64 sums in row-major order: the same bits for any thread count.
  for (std::int64_t i = 0; i < input.size(); ++i) {
    const double value = input.values[static_cast<std::size_t>(i)];
    const double dequantized = q.dequantized.values[static_cast<std::size_t>(i)];
    if (!std::isfinite(value) || !std::isfinite(dequantized)) continue;
    summary.signal_energy += value * value;
    summary.error_energy += (value - dequantized) * (value - dequantized);
  }
  return summary;
}

const matrix* operand_named(const gemm_operands& operands, std::string_view name) {
  if (name == "x") return operands.x;
  if (name == "dy") return operands.dy;
  return operands.w;
}

void check_shapes(gemm_kind kind, const matrix& a, const matrix& b, std::string_view what) {
  // x [K, n_in], dy [K, n_out], w [n_out, n_in].
  const auto shape = [](const matrix& m) { return fmt::format("[{}, {}]", m.rows, m.cols); };
  switch (kind) {
    case gemm_kind::fprop:
      if (a.cols != b.cols) {
        throw input_error(fmt::format("{}: shapes disagree on n_in: x [K, n_in] is {}, w [n_out, n_in] is {} (field 'w')",
                                      what, shape(a), shape(b)));
      }
      break;
    case gemm_kind::dgrad:
      if (a.cols != b.rows) {
        throw input_error(fmt::format(
            "{}: shapes disagree on n_out: dy [K, n_out] is {}, w [n_out, n_in] is {} (field 'w')", what, shape(a),
            shape(b)));
      }
      break;
    case gemm_kind::wgrad:
      if (a.rows != b.rows) {
        throw input_error(fmt::format("{}: shapes disagree on K: dy [K, n_out] is {}, x [K, n_in] is {} (field 'x')",
                                      what, shape(a), shape(b)));
      }
      break;
  }
}

}  // namespace

product_result emulate_product(const quantized_tensor& a, const quantized_tensor& b, const accumulation_model& model,
                               output_rounding output, const gemm_options& options) {
  return emulate_named(a, b, model, output, options, "gemm", "A", "B");
}

matrix rotated_operand(const matrix& tensor, int axis, const strategy& chosen, const gemm_context& context,
                       const std::string& what) {
  matrix rotated = tensor;
  rotate(rotated, axis, rotation_for(chosen, context), what);
  return rotated;
}

gemm_result run_gemm(gemm_kind kind, const gemm_operands& operands, const strategy& chosen, const gemm_context& context,
                     const gemm_options& options) {
  const gemm_layout layout = layout_of(kind);
  const std::string what = fmt::format("gemm {}", gemm_kind_name(kind));
  const matrix* a_tensor = operand_named(operands, layout.a_name);
  const matrix* b_tensor = operand_named(operands, layout.b_name);
  for (const auto& [tensor, name] : {std::pair{a_tensor, layout.a_name}, std::pair{b_tensor, layout.b_name}}) {
    if (tensor == nullptr) {
      throw input_error(fmt::format("{}: operand '{}' is missing ({} needs {} and {})", what, name, gemm_kind_name(kind),
                                    layout.a_name, layout.b_name));
    }
  }
  check_shapes(kind, *a_tensor, *b_tensor, what);

  const std::uint32_t hash = layer_hash(context.layer);
  const auto prepare = [&](const matrix& tensor, const operand_strategy& operand, int axis, core_ns::random_role role,
                           std::string_view name, operand_summary& summary) {
    const std::string operand_what = fmt::format("{}: operand {}", what, name);
    quantize_options quantize_with = operand.quantize;
    quantize_with.axis = axis;
    quantize_with.stream = core_ns::random_stream{chosen.seed, core_ns::policy_step(operand.seeds, context.step),
                                                  core_ns::stream_tag(hash, role)};
    validate(quantize_with, tensor.rows, tensor.cols, operand_what);
    const matrix rotated = rotated_operand(tensor, axis, chosen, context, operand_what);
    quantized_tensor quantized = quantize(rotated, quantize_with);
    summary = summarize(name, axis, rotated, quantized);
    return quantized;
  };

  gemm_result result;
  result.kind = kind;
  const quantized_tensor a = prepare(*a_tensor, chosen.a, layout.a_axis, layout.a_role, layout.a_name, result.a);
  const quantized_tensor b = prepare(*b_tensor, chosen.b, layout.b_axis, layout.b_role, layout.b_name, result.b);
  static_cast<product_result&>(result) =
      emulate_named(a, b, chosen.accumulation, chosen.output, options, what, layout.a_name, layout.b_name);
  return result;
}

}  // namespace mxscope
