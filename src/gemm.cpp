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
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <vector>

#include "mxscope/core/nvfp4.hpp"
#include "mxscope/core/tensor_scale.hpp"
#include "mxscope/compare.hpp"
#include "mxscope/errors.hpp"
#include "mxscope/reference.hpp"
#include "gemm_internal.hpp"
#include "backend/backend.hpp"

#if defined(__x86_64__)
#include <immintrin.h>
#define MXSCOPE_GEMM_X86 1
#endif

namespace mxscope {

namespace core_ns = mxscope::core;
using namespace gemm_internal;  // the types and steps shared with gemm_integer.cpp (gemm_internal.hpp)
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
constexpr int max_products_per_step = 1 << 16;  // trunc-promote's k
constexpr int max_promotion_interval = 1 << 30;  // trunc-promote's c

[[noreturn]] void bad_model(std::string_view field, std::string_view text, std::string_view why) {
  throw input_error(fmt::format(
      "{}: bad accumulation model '{}': {} (expected exact, fp32-block, fp32-group:G, trunc-align:n,G[,rtz|rne], "
      "trunc-promote:n,k,w[,c] or fp32-seq)",
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

namespace {
// "a,b,c" -> {"a", "b", "c"} (empty fields kept, so that the caller's count check sees them).
std::vector<std::string_view> split_commas(std::string_view rest) {
  std::vector<std::string_view> parts;
  while (true) {
    const auto comma = rest.find(',');
    parts.push_back(rest.substr(0, comma));
    if (comma == std::string_view::npos) break;
    rest = rest.substr(comma + 1);
  }
  return parts;
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
    const std::vector<std::string_view> parts = split_commas(text.substr(align_prefix.size()));
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
  constexpr std::string_view promote_prefix = "trunc-promote:";
  if (text.starts_with(promote_prefix)) {
    model.kind = accumulation_kind::trunc_promote;
    model.blocks_per_group = 1;
    model.rounding = alignment_rounding::rtz;
    const std::vector<std::string_view> parts = split_commas(text.substr(promote_prefix.size()));
    if (parts.size() < 3 || parts.size() > 4) bad_model(field, text, "trunc-promote takes n,k,w or n,k,w,c");
    model.fraction_bits =
        parse_bounded_integer(parts[0], 0, core_ns::trunc_align_fraction_bits_max, field, text, "n");
    model.products_per_step = parse_bounded_integer(parts[1], 1, max_products_per_step, field, text, "k");
    model.step_bits = parse_bounded_integer(parts[2], 1, core_ns::trunc_promote_step_bits_max, field, text, "w");
    if (parts.size() == 4) {
      model.promotion_interval = parse_bounded_integer(parts[3], 1, max_promotion_interval, field, text, "c");
      if (model.promotion_interval % model.products_per_step != 0) {
        bad_model(field, text, fmt::format("c must be a multiple of k = {}, got {}", model.products_per_step,
                                           model.promotion_interval));
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
    case accumulation_kind::trunc_promote:
      if (model.promotion_interval == 0) {
        return fmt::format("trunc-promote:{},{},{}", model.fraction_bits, model.products_per_step, model.step_bits);
      }
      return fmt::format("trunc-promote:{},{},{},{}", model.fraction_bits, model.products_per_step, model.step_bits,
                         model.promotion_interval);
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

canonical_pair canonical_operands(gemm_kind kind, const matrix& a_captured, const matrix& b_captured) {
  const gemm_layout layout = layout_of(kind);
  return {layout.a_axis == 1 ? a_captured : transposed(a_captured),
          layout.b_axis == 1 ? b_captured : transposed(b_captured)};
}

namespace {

// ------------------------------------------------------------------------------------------------
// Canonical operands: [rows, depth] with the reduction (depth) contiguous.

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
// Elements are visited in tiles of the captured layout, so an axis-0 operand is transposed with
// both the reads and the writes staying within a few cache lines per row.
canonical_operand make_canonical(const quantized_tensor& q, int block, bool keep_dequantized) {
  canonical_operand out;
  const bool along_rows = q.options.axis == 1;
  out.rows = along_rows ? q.rows : q.cols;
  out.depth = along_rows ? q.cols : q.rows;
  out.block = block;
  out.blocks = (out.depth + block - 1) / block;
  out.elements.assign(static_cast<std::size_t>(out.rows * out.depth), 0.0f);
  out.block_scales.assign(static_cast<std::size_t>(out.rows * out.blocks), 1.0);
  out.scale_exponents.assign(static_cast<std::size_t>(out.rows * out.blocks), 0);
  out.scale_mantissas.assign(static_cast<std::size_t>(out.rows * out.blocks), 1);
  if (keep_dequantized) out.dequantized = matrix(out.rows, out.depth);
  out.tensor_scale = 1.0f;

  const auto scheme = q.options.format.scheme;
  const element_kind kind = q.options.format.element;
  const bool integer_format = scheme == quant_scheme::mx || scheme == quant_scheme::nvfp4 || scheme == quant_scheme::per_tensor;
  float decoded[256] = {};
  if (integer_format) {
    // Every finite element value of the small formats is a multiple of the subnormal spacing.
    out.fraction_bits = -core_ns::subnormal_ulp_exponent(kind);
    out.integer_max = static_cast<std::int64_t>(core_ns::max_normal(kind) * core_ns::pow2(out.fraction_bits));
    const int codes = 1 << core_ns::spec(kind).bits;
    for (int code = 0; code < codes; ++code) decoded[code] = static_cast<float>(core_ns::decode(kind, static_cast<std::uint32_t>(code)));
  }
  if (scheme == quant_scheme::nvfp4 || scheme == quant_scheme::per_tensor) out.tensor_scale = q.tensor_scale;
  if (integer_format) out.element_min_exponent = core_ns::min_normal_exponent(kind);

  const auto element_at = [&](std::int64_t r, std::int64_t c) -> float {
    switch (scheme) {
      case quant_scheme::none: return q.dequantized(r, c);
      case quant_scheme::bf16: {
        const auto at = static_cast<std::size_t>(r * q.cols + c) * 2;
        return core_ns::bf16_to_float(static_cast<std::uint16_t>(q.codes[at] | (q.codes[at + 1] << 8)));
      }
      case quant_scheme::mx:
      case quant_scheme::nvfp4:
      case quant_scheme::per_tensor: return decoded[code_at(q, r, c)];
    }
    return 0.0f;
  };

  constexpr std::int64_t tile = 64;
  const std::int64_t row_tiles = (out.rows + tile - 1) / tile;
  const std::int64_t depth_tiles = (out.depth + tile - 1) / tile;
  bool all_finite = true;
#pragma omp parallel for schedule(static) reduction(&& : all_finite) if (out.rows * out.depth >= parallel_elements)
  for (std::int64_t tile_index = 0; tile_index < row_tiles * depth_tiles; ++tile_index) {
    const std::int64_t row_begin = (tile_index / depth_tiles) * tile;
    const std::int64_t k_begin = (tile_index % depth_tiles) * tile;
    const std::int64_t row_end = std::min(out.rows, row_begin + tile);
    const std::int64_t k_end = std::min(out.depth, k_begin + tile);
    const auto visit = [&](std::int64_t row, std::int64_t k) {
      const std::int64_t r = along_rows ? row : k;
      const std::int64_t c = along_rows ? k : row;
      const float value = element_at(r, c);
      all_finite = all_finite && std::isfinite(value);
      out.elements[static_cast<std::size_t>(row * out.depth + k)] = value;
      if (keep_dequantized) out.dequantized(row, k) = q.dequantized(r, c);
    };
    if (along_rows) {
      for (std::int64_t row = row_begin; row < row_end; ++row) {
        for (std::int64_t k = k_begin; k < k_end; ++k) visit(row, k);
      }
    } else {
      for (std::int64_t k = k_begin; k < k_end; ++k) {
        for (std::int64_t row = row_begin; row < row_end; ++row) visit(row, k);
      }
    }
  }
#pragma omp parallel for schedule(static) if (out.rows * out.blocks * 64 >= parallel_elements)
  for (std::int64_t row = 0; row < out.rows; ++row) {
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
        const core_ns::nvfp4_tile tile = core_ns::nvfp4_tile_of(q.options.axis, q.options.nvfp4_2d);
        const std::uint8_t code = q.scales[static_cast<std::size_t>((r / tile.rows) * q.scale_cols + c / tile.cols)];
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
  out.finite = all_finite;
  for (const std::int32_t mantissa : out.scale_mantissas) {
    out.scale_mantissa_max = std::max<std::int64_t>(out.scale_mantissa_max, mantissa);
  }
  return out;
}

// The tensor scales' exact product and its application: include/mxscope/core/tensor_scale.hpp.
using core_ns::add_scaled_exactly;
using core_ns::make_scale_product;
using core_ns::tensor_scale_product;

// ------------------------------------------------------------------------------------------------
// The generic path: NUMERICS.md section 7 entry by entry.

struct generic_entry_result {
  float value;
  double exact;
};

// The block-scaled values of an operand row by row, with their alignment exponents (trunc-promote
// aligns to the exponent sums of the two factors).
struct scaled_rows {
  std::vector<double> values;  // [rows, depth]
  std::vector<int> exponents;  // [rows, depth]; 0 for zero and non-finite values
};

scaled_rows scale_rows(const canonical_operand& operand) {
  scaled_rows out;
  const auto size = static_cast<std::size_t>(operand.rows * operand.depth);
  out.values.resize(size);
  out.exponents.resize(size);
  for (std::int64_t row = 0; row < operand.rows; ++row) {
    for (std::int64_t k = 0; k < operand.depth; ++k) {
      const auto at = static_cast<std::size_t>(row * operand.depth + k);
      out.values[at] = operand.scaled(row, k);
      out.exponents[at] = operand.alignment_exponent(row, k);
    }
  }
  return out;
}

// trunc-promote (docs/numerics.md) for one entry, from the two rows' block-scaled values x, y and
// their leading exponents: steps of k products in ascending K; each step aligns the inner
// accumulator and its products to the largest exponent (the products' exponent sums), truncates,
// sums and keeps w significant bits (core::trunc_promote_step); every c products and at the end of
// K the inner accumulator is added to the fp32 outer accumulator (one rounding to nearest-even) and
// restarts from +0. A NaN or infinite product, or a non-finite accumulator, turns the entry into the
// IEEE sum of what is left.
float trunc_promote_entry(const double* x, const int* x_exponents, const double* y, const int* y_exponents,
                          std::int64_t depth, const accumulation_model& model, std::vector<double>& products,
                          std::vector<int>& exponents) {
  const std::int64_t step = model.products_per_step;
  const std::int64_t interval = model.promotion_interval == 0 ? depth : model.promotion_interval;
  float outer = 0.0f;
  float inner = 0.0f;
  for (std::int64_t begin = 0; begin < depth; begin += step) {
    const std::int64_t end = std::min(depth, begin + step);
    products.clear();
    exponents.clear();
    double nonfinite_sum = 0.0;
    bool nonfinite = false;
    for (std::int64_t k = begin; k < end; ++k) {
      const double product = x[k] * y[k];
      if (!std::isfinite(product)) {
        nonfinite = true;
        nonfinite_sum += product;
        continue;
      }
      products.push_back(product);
      exponents.push_back(x_exponents[k] + y_exponents[k]);
    }
    if (nonfinite || !std::isfinite(inner) || !std::isfinite(outer)) {
      // From here on the result is the IEEE value of the non-finite terms.
      outer = nonfinite_step(nonfinite_step(outer, static_cast<double>(inner)), nonfinite_sum);
      inner = 0.0f;
      continue;
    }
    inner = core_ns::trunc_promote_step(inner, products.data(), exponents.data(), static_cast<int>(products.size()),
                                        model.fraction_bits, model.step_bits);
    if (end % interval == 0 || end == depth) {
      outer = add_exact_value(outer, static_cast<double>(inner));
      inner = 0.0f;
    }
  }
  return outer;
}

generic_entry_result generic_entry(const canonical_operand& a, const canonical_operand& b, std::int64_t i,
                                   std::int64_t j, const accumulation_model& model, const tensor_scale_product& scale,
                                   std::vector<double>& products, std::vector<int>& exponents) {
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

  if (model.kind == accumulation_kind::trunc_promote) {
    std::vector<double> x(static_cast<std::size_t>(depth));
    std::vector<double> y(static_cast<std::size_t>(depth));
    std::vector<int> x_exponents(static_cast<std::size_t>(depth));
    std::vector<int> y_exponents(static_cast<std::size_t>(depth));
    for (std::int64_t k = 0; k < depth; ++k) {
      const auto at = static_cast<std::size_t>(k);
      x[at] = a.scaled(i, k);
      y[at] = b.scaled(j, k);
      x_exponents[at] = a.alignment_exponent(i, k);
      y_exponents[at] = b.alignment_exponent(j, k);
    }
    return {trunc_promote_entry(x.data(), x_exponents.data(), y.data(), y_exponents.data(), depth, model, products,
                                exponents),
            0.0};
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
  if (model.kind == accumulation_kind::trunc_promote) {
    const scaled_rows x = scale_rows(a);
    const scaled_rows y = scale_rows(b);
    const std::int64_t depth = a.depth;
#pragma omp parallel if (a.rows * b.rows * depth >= parallel_products / 16)
    {
      std::vector<double> products;
      std::vector<int> exponents;
#pragma omp for schedule(dynamic, 1)
      for (std::int64_t i = 0; i < a.rows; ++i) {
        const auto row_a = static_cast<std::size_t>(i * depth);
        for (std::int64_t j = 0; j < b.rows; ++j) {
          const auto row_b = static_cast<std::size_t>(j * depth);
          out(i, j) = epilogue(trunc_promote_entry(x.values.data() + row_a, x.exponents.data() + row_a,
                                                   y.values.data() + row_b, y.exponents.data() + row_b, depth, model,
                                                   products, exponents),
                               alpha);
        }
      }
    }
    return;
  }
#pragma omp parallel if (a.rows * b.rows * a.depth >= parallel_products / 16)
  {
    std::vector<double> products;
    std::vector<int> exponents;
#pragma omp for schedule(dynamic, 1)
    for (std::int64_t i = 0; i < a.rows; ++i) {
      for (std::int64_t j = 0; j < b.rows; ++j) {
        const generic_entry_result entry = generic_entry(a, b, i, j, model, scale, products, exponents);
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
// The micro kernel exists twice, as a portable scalar loop and with AVX2+FMA vectors (chosen at
// run time); both compute fmaf exactly (a fused operation has one correctly rounded result), so
// they agree bit for bit.

// B is packed into panels of 16 columns, [panel, k, 16], so that a micro tile of 4 rows x 16
// columns reads one contiguous 64-byte row of its panel per k; its 8 vector accumulators stay in
// registers for the whole reduction, in ascending k.

constexpr int seq_rows = 4;
constexpr int seq_width = 16;

std::vector<float> pack_panels(const matrix& b, std::int64_t panels) {
  std::vector<float> packed(static_cast<std::size_t>(panels * b.cols * seq_width), 0.0f);
#pragma omp parallel for schedule(static) if (b.rows * b.cols >= parallel_elements)
  for (std::int64_t panel = 0; panel < panels; ++panel) {
    for (int lane = 0; lane < seq_width; ++lane) {
      const std::int64_t column = panel * seq_width + lane;
      if (column >= b.rows) continue;
      for (std::int64_t k = 0; k < b.cols; ++k) {
        packed[static_cast<std::size_t>((panel * b.cols + k) * seq_width + lane)] = b(column, k);
      }
    }
  }
  return packed;
}

// One micro tile: out[r][j] = fma chain over k of a[r][k] * panel[k][j], r < rows.
void sequential_fma_tile_baseline(const float* a_rows, std::int64_t depth, int rows, const float* panel, float* out) {
  for (int r = 0; r < rows; ++r) {
    for (int j = 0; j < seq_width; ++j) {
      float accumulator = 0.0f;
      for (std::int64_t k = 0; k < depth; ++k) {
        accumulator = __builtin_fmaf(a_rows[r * depth + k], panel[k * seq_width + j], accumulator);
      }
      out[r * seq_width + j] = accumulator;
    }
  }
}

#if MXSCOPE_GEMM_X86
__attribute__((target("avx2,fma"))) void sequential_fma_tile_avx2(const float* a_rows, std::int64_t depth, int rows,
                                                                   const float* panel, float* out) {
  if (rows < seq_rows) {
    sequential_fma_tile_baseline(a_rows, depth, rows, panel, out);
    return;
  }
  __m256 low[seq_rows];
  __m256 high[seq_rows];
  for (int r = 0; r < seq_rows; ++r) {
    low[r] = _mm256_setzero_ps();
    high[r] = _mm256_setzero_ps();
  }
  for (std::int64_t k = 0; k < depth; ++k) {
    const __m256 b_low = _mm256_loadu_ps(panel + k * seq_width);
    const __m256 b_high = _mm256_loadu_ps(panel + k * seq_width + 8);
#pragma GCC unroll 4
    for (int r = 0; r < seq_rows; ++r) {
      const __m256 a_value = _mm256_set1_ps(a_rows[r * depth + k]);
      low[r] = _mm256_fmadd_ps(a_value, b_low, low[r]);
      high[r] = _mm256_fmadd_ps(a_value, b_high, high[r]);
    }
  }
  for (int r = 0; r < seq_rows; ++r) {
    _mm256_storeu_ps(out + r * seq_width, low[r]);
    _mm256_storeu_ps(out + r * seq_width + 8, high[r]);
  }
}

bool cpu_has_avx2_fma() {
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return has;
}
#else
bool cpu_has_avx2_fma() { return false; }
void sequential_fma_tile_avx2(const float* a_rows, std::int64_t depth, int rows, const float* panel, float* out) {
  sequential_fma_tile_baseline(a_rows, depth, rows, panel, out);
}
#endif

void sequential_fma_product(const canonical_operand& a, const canonical_operand& b, matrix& out, bool vector_kernels) {
  const std::int64_t depth = a.depth;
  const std::int64_t n = b.rows;
  const std::int64_t panels = (n + seq_width - 1) / seq_width;
  const std::vector<float> packed = pack_panels(b.dequantized, panels);
  const bool vector_unit = vector_kernels && cpu_has_avx2_fma();
  // A task: 64 rows of A against 4 panels (a panel is 256 KiB at K = 4096 and stays in L2).
  constexpr std::int64_t task_rows = 64;
  constexpr std::int64_t task_panels = 4;
  const std::int64_t row_tasks = (a.rows + task_rows - 1) / task_rows;
  const std::int64_t panel_tasks = (panels + task_panels - 1) / task_panels;
#pragma omp parallel for schedule(dynamic, 1) if (a.rows * n * depth >= parallel_products)
  for (std::int64_t task = 0; task < row_tasks * panel_tasks; ++task) {
    const std::int64_t row_begin = (task / panel_tasks) * task_rows;
    const std::int64_t panel_begin = (task % panel_tasks) * task_panels;
    const std::int64_t row_end = std::min(a.rows, row_begin + task_rows);
    const std::int64_t panel_end = std::min(panels, panel_begin + task_panels);
    float tile[seq_rows * seq_width];
    for (std::int64_t panel = panel_begin; panel < panel_end; ++panel) {
      const float* panel_data = packed.data() + panel * depth * seq_width;
      for (std::int64_t row = row_begin; row < row_end; row += seq_rows) {
        const int rows = static_cast<int>(std::min<std::int64_t>(seq_rows, row_end - row));
        const float* a_rows = a.dequantized.data() + row * depth;
        if (vector_unit) {
          sequential_fma_tile_avx2(a_rows, depth, rows, panel_data, tile);
        } else {
          sequential_fma_tile_baseline(a_rows, depth, rows, panel_data, tile);
        }
        for (int r = 0; r < rows; ++r) {
          for (int j = 0; j < seq_width && panel * seq_width + j < n; ++j) out(row + r, panel * seq_width + j) = tile[r * seq_width + j];
        }
      }
    }
  }
}

// ------------------------------------------------------------------------------------------------

// ------------------------------------------------------------------------------------------------
// Unquantized operands (fp32, bf16).
//
// exact: the exact sum of the products of fp32 values rounded once to fp32 and fp64 is precisely
// what the exact reference computes (reference.hpp: correctly rounded results, +0 for an exact
// zero, the IEEE sum where a row holds inf or NaN), so the model is delegated to it.
//
// fp32-block and fp32-group with bf16-like operands: each value is a multiple of 2^(e - s + 1)
// where e = floor(log2 |v|) and s is its significand width (8 for bf16, 24 for fp32). Within a
// block let lo and hi be the smallest and largest e of an operand's nonzero values. Every product
// is then a multiple of 2^(lo_a + lo_b - s_a - s_b + 2) and below 2^(hi_a + hi_b + 2), so every
// partial sum of the block's n products (in any order) is a multiple of that unit below
// 2^(hi_a + hi_b + 2 + bits(n)): exact in fp64 whenever
//     (hi_a - lo_a) + (hi_b - lo_b) <= 53 - bits(n) - s_a - s_b.
// An fp64 GEMM per K-block then yields the exact block dots, and the model applies to them as on
// the integer path. Entries with a block beyond that budget are recomputed by the definition.

bool is_unquantized(const quantized_tensor& q) {
  return q.options.format.scheme == quant_scheme::none || q.options.format.scheme == quant_scheme::bf16;
}

// The significant bits of an operand's values: bf16 8, MX float elements theirs (with unit block
// scales the values are the elements), else fp32's 24.
int significand_bits(const quantized_tensor& q) {
  if (q.options.format.scheme == quant_scheme::bf16) return 8;
  const auto& element = core_ns::spec(q.options.format.element);
  const auto scheme = q.options.format.scheme;
  if ((scheme == quant_scheme::mx || scheme == quant_scheme::per_tensor) && !element.is_integer) {
    return element.mantissa_bits + 1;
  }
  return 24;
}

// Operands whose canonical values are their float elements with every block scale 1: per-tensor
// operands (the tensor scale is alpha, applied to the accumulator) and MX operands whose block
// scales are all 2^0 (per-tensor operands as detail::per_tensor_by_unit_scales multiplies them).
// Their values are short floats, so short_float_product computes fp32-block and fp32-group:G on
// them as on bf16 values.
bool unit_scaled_floats(const quantized_tensor& q) {
  if (core_ns::spec(q.options.format.element).is_integer) return false;
  if (q.options.format.scheme == quant_scheme::per_tensor) return true;
  if (q.options.format.scheme != quant_scheme::mx) return false;
  return std::all_of(q.scales.begin(), q.scales.end(),
                     [](std::uint8_t code) { return code == core_ns::scale_code(0); });
}

matrix as_matrix(const canonical_operand& operand) {
  matrix values(operand.rows, operand.depth);
  values.values = operand.elements;
  return values;
}

// Exponent spread (hi - lo) of the nonzero values of each (row, block); -1 for an all-zero block.
std::vector<std::int32_t> block_spreads(const canonical_operand& operand) {
  std::vector<std::int32_t> spreads(static_cast<std::size_t>(operand.rows * operand.blocks), -1);
#pragma omp parallel for schedule(static) if (operand.rows * operand.depth >= parallel_elements)
  for (std::int64_t row = 0; row < operand.rows; ++row) {
    for (std::int64_t block = 0; block < operand.blocks; ++block) {
      int lowest = std::numeric_limits<int>::max();
      int highest = std::numeric_limits<int>::min();
      const std::int64_t end = std::min(operand.depth, (block + 1) * operand.block);
      for (std::int64_t k = block * operand.block; k < end; ++k) {
        const float value = operand.elements[static_cast<std::size_t>(row * operand.depth + k)];
        if (value == 0.0f) continue;
        const int exponent = core_ns::floor_log2(std::fabs(value));
        lowest = std::min(lowest, exponent);
        highest = std::max(highest, exponent);
      }
      if (highest != std::numeric_limits<int>::min()) {
        spreads[static_cast<std::size_t>(row * operand.blocks + block)] = highest - lowest;
      }
    }
  }
  return spreads;
}

std::int64_t short_float_product(const canonical_operand& a, const canonical_operand& b, int budget,
                                 const accumulation_model& model, matrix& out) {
  const std::vector<double> a_values(a.elements.begin(), a.elements.end());
  const std::vector<double> b_values(b.elements.begin(), b.elements.end());
  const std::vector<std::int32_t> a_spreads = block_spreads(a);
  const std::vector<std::int32_t> b_spreads = block_spreads(b);
  const std::int64_t n = b.rows;
  const std::int64_t group = model.kind == accumulation_kind::fp32_group ? model.blocks_per_group : 1;
  const std::int64_t row_tiles = (a.rows + tile_rows_block - 1) / tile_rows_block;
  const std::int64_t col_tiles = (n + tile_cols_block - 1) / tile_cols_block;
  const tensor_scale_product unit_scale = make_scale_product(1.0f, 1.0f);
  std::int64_t redone = 0;
#pragma omp parallel reduction(+ : redone) if (a.rows * n * a.depth >= parallel_products)
  {
    const std::int64_t entries_per_tile = tile_rows_block * tile_cols_block;
    std::vector<double> dots(static_cast<std::size_t>(entries_per_tile));
    std::vector<double> contributions(static_cast<std::size_t>(std::min(group, std::max<std::int64_t>(a.blocks, 1)) *
                                                               entries_per_tile));
    std::vector<float> accumulators(static_cast<std::size_t>(entries_per_tile));
    std::vector<std::uint8_t> redo(static_cast<std::size_t>(entries_per_tile));
    std::vector<double> products;
    std::vector<int> exponents;
#pragma omp for schedule(dynamic, 1)
    for (std::int64_t tile = 0; tile < row_tiles * col_tiles; ++tile) {
      const std::int64_t m0 = (tile / col_tiles) * tile_rows_block;
      const std::int64_t n0 = (tile % col_tiles) * tile_cols_block;
      const std::int64_t rows = std::min(tile_rows_block, a.rows - m0);
      const std::int64_t cols = std::min(tile_cols_block, n - n0);
      const std::int64_t entries = rows * cols;
      std::fill(accumulators.begin(), accumulators.begin() + entries, 0.0f);
      std::fill(redo.begin(), redo.begin() + entries, std::uint8_t{0});
      for (std::int64_t group_begin = 0; group_begin < a.blocks; group_begin += group) {
        const std::int64_t group_end = std::min(a.blocks, group_begin + group);
        for (std::int64_t block = group_begin; block < group_end; ++block) {
          const std::int64_t k0 = block * a.block;
          const std::int64_t length = std::min<std::int64_t>(a.block, a.depth - k0);
          exact_block_products(a_values.data(), b_values.data(), a.depth, m0, rows, n0, cols, k0, length, dots.data());
          double* slot = contributions.data() + (block - group_begin) * entries;
          for (std::int64_t r = 0; r < rows; ++r) {
            const std::int32_t a_spread = a_spreads[static_cast<std::size_t>((m0 + r) * a.blocks + block)];
            for (std::int64_t j = 0; j < cols; ++j) {
              const std::int32_t b_spread = b_spreads[static_cast<std::size_t>((n0 + j) * b.blocks + block)];
              const auto e = static_cast<std::size_t>(r * cols + j);
              if (a_spread >= 0 && b_spread >= 0 && a_spread + b_spread > budget) redo[e] = 1;
              slot[e] = dots[e] + 0.0;  // exact (or redone); +0.0 maps -0 to +0
            }
          }
        }
        add_groups_exactly(accumulators.data(), contributions.data(), entries, group_end - group_begin, redo.data());
      }
      for (std::int64_t r = 0; r < rows; ++r) {
        for (std::int64_t j = 0; j < cols; ++j) {
          const auto e = static_cast<std::size_t>(r * cols + j);
          if (redo[e] != 0) {
            out(m0 + r, n0 + j) = generic_entry(a, b, m0 + r, n0 + j, model, unit_scale, products, exponents).value;
            ++redone;
          } else {
            out(m0 + r, n0 + j) = accumulators[e];
          }
        }
      }
    }
  }
  return redone;
}

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

// The operands' axes and reduction lengths and the model's parameters, checked before any product.
void check_product(const quantized_tensor& a, const quantized_tensor& b, const accumulation_model& model,
                   std::string_view what, std::string_view a_name, std::string_view b_name) {
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
  if (model.kind == accumulation_kind::trunc_promote) {
    if (model.fraction_bits < 0 || model.fraction_bits > core_ns::trunc_align_fraction_bits_max) {
      throw input_error(fmt::format("{}: field 'accum': n must be in 0..{}, got {}", what,
                                    core_ns::trunc_align_fraction_bits_max, model.fraction_bits));
    }
    if (model.products_per_step < 1 || model.products_per_step > max_products_per_step) {
      throw input_error(fmt::format("{}: field 'accum': k must be in 1..{}, got {}", what, max_products_per_step,
                                    model.products_per_step));
    }
    if (model.step_bits < 1 || model.step_bits > core_ns::trunc_promote_step_bits_max) {
      throw input_error(fmt::format("{}: field 'accum': w must be in 1..{}, got {}", what,
                                    core_ns::trunc_promote_step_bits_max, model.step_bits));
    }
    if (model.promotion_interval < 0 || model.promotion_interval % model.products_per_step != 0) {
      throw input_error(fmt::format("{}: field 'accum': c must be 0 or a positive multiple of k = {}, got {}", what,
                                    model.products_per_step, model.promotion_interval));
    }
  }
}

// With exact_too, a model product that runs on the CPU's int16 or wide kernels under fp32-block
// also leaves the exact model's fp64 product of the same operands there, from the same block dots
// (exact_too stays empty on every other path).
product_result emulate_named(const quantized_tensor& a, const quantized_tensor& b, const accumulation_model& model,
                             output_rounding output, const gemm_options& options, std::string_view what,
                             std::string_view a_name, std::string_view b_name,
                             std::optional<matrix64>* exact_too = nullptr,
                             backend::product_cache* cache = nullptr) {
  check_product(a, b, model, what, a_name, b_name);
  const int block = common_block(a, b, what, a_name, b_name);
  if (auto on_gpu = backend::product(a, b, model, output, options, block, cache)) return std::move(*on_gpu);
  // The CPU's paths read an operand's values on the host.
  if (backend::values_only_on_device(a) || backend::values_only_on_device(b)) {
    std::optional<quantized_tensor> a_host, b_host;
    if (backend::values_only_on_device(a)) a_host = backend::with_host_values(a);
    if (backend::values_only_on_device(b)) b_host = backend::with_host_values(b);
    return emulate_named(a_host ? *a_host : a, b_host ? *b_host : b, model, output, options, what, a_name, b_name,
                         exact_too);
  }
  // Per-tensor exact beyond fp64 (an e5m2 operand): the CPU's MX exact products of the binade
  // parts, whose integers stay small enough for its fast path, instead of the per-entry definition.
  if (options.path == accumulation_path::automatic) {
    if (const auto route = detail::per_tensor_exact_parts_route(a, b, model)) {
      return detail::per_tensor_exact_by_parts(
          a, b, block, route->parts, route->split_a, output, [&](const quantized_tensor& x, const quantized_tensor& y) {
            return emulate_named(x, y, model, output_rounding::fp32, options, what, a_name, b_name);
          });
    }
  }
  const bool keep_dequantized = model.kind == accumulation_kind::fp32_seq;
  const canonical_operand left = make_canonical(a, block, keep_dequantized);
  const canonical_operand right = make_canonical(b, block, keep_dequantized);

  product_result result;
  result.out = matrix(left.rows, right.rows);
  matrix64* exact = nullptr;
  if (model.kind == accumulation_kind::exact) {
    result.exact = matrix64(left.rows, right.rows);
    exact = &result.exact;
  }
  const float alpha = left.tensor_scale * right.tensor_scale;

  if (model.kind == accumulation_kind::fp32_seq) {
    sequential_fma_product(left, right, result.out, options.vector_kernels);
  } else {
    const bool automatic = options.path == accumulation_path::automatic;
    const auto plan = automatic ? plan_fast_path(left, right, model) : std::nullopt;
    bool done = false;
    const bool unquantized = is_unquantized(a) && is_unquantized(b);
    if (automatic && unquantized && model.kind == accumulation_kind::exact && left.depth > 0) {
      reference_result reference = reference_gemm(as_matrix(left), as_matrix(right), reference_kind::exact);
      result.out = std::move(reference.fp32);
      result.exact = std::move(reference.fp64);
      done = true;
    }
    const int short_float_budget = 53 - bits_of(block) - significand_bits(a) - significand_bits(b);
    // Unquantized operands, and per-tensor and unit-scaled MX operands that the integer fast path
    // does not cover (fp8 e5m2 x e4m3: block dots of up to 55 bits), are short floats: under
    // fp32-block and fp32-group:1 they take the certified fp64 kernel where this CPU has it (the
    // bound, not the spread, decides each step); otherwise the short-float product, the block dots
    // exact in fp64 wherever the two rows' exponent spreads leave room, per entry elsewhere. Then
    // alpha, as generic_product's epilogue.
    const bool scaled_floats = !unquantized && !plan && unit_scaled_floats(a) && unit_scaled_floats(b);
    const bool one_block_steps = model.kind == accumulation_kind::fp32_block ||
                                 (model.kind == accumulation_kind::fp32_group && model.blocks_per_group == 1);
    if (!done && automatic && (unquantized || scaled_floats) && one_block_steps && options.vector_kernels &&
        certified_wide_applies(left, right) && left.rows > 0 && right.rows > 0 &&
        certified_wide_product(left, right, result.out, result.fallback_entries)) {
      if (scaled_floats) {
        for (float& value : result.out.values) value = epilogue(value, alpha);
      }
      done = true;
    }
    if (!done && automatic && (unquantized || scaled_floats) && left.finite && right.finite &&
        short_float_budget >= 0 &&
        (model.kind == accumulation_kind::fp32_block || model.kind == accumulation_kind::fp32_group)) {
      result.fallback_entries = short_float_product(left, right, short_float_budget, model, result.out);
      if (scaled_floats) {
        for (float& value : result.out.values) value = epilogue(value, alpha);
      }
      done = true;
    }
    if (!done && plan && left.rows > 0 && right.rows > 0) {
      fast_context context{&left,
                           &right,
                           *plan,
                           model,
                           alpha,
                           make_scale_product(left.tensor_scale, right.tensor_scale),
                           {},
                           {},
                           options.vector_kernels};
      const bool fuse = exact_too != nullptr && (model.kind == accumulation_kind::fp32_block ||
                                                 (model.kind == accumulation_kind::fp32_group && model.blocks_per_group == 1));
      const auto run_kernel = [&](auto&& kernel, const fast_context& on) {
        if (fuse) exact_too->emplace(left.rows, right.rows);
        done = kernel(on, result.out, exact, result.fallback_entries, fuse ? &**exact_too : nullptr);
        if (!done && fuse) exact_too->reset();
      };
      if (options.vector_kernels && int16_kernel_applies(left, right, *plan, model)) {
        run_kernel(int16_kernel_product, context);
      }
      if (!done && options.vector_kernels && !plan->power_of_two_scales) {
        // NVFP4: the block scales' mantissas moved into the elements, for the int16 kernels.
        if (const auto folded = folded_for_int16(left, right)) {
          const auto folded_plan = plan_fast_path(folded->first, folded->second, model);
          if (folded_plan && int16_kernel_applies(folded->first, folded->second, *folded_plan, model)) {
            fast_context on_folded = context;
            on_folded.a = &folded->first;
            on_folded.b = &folded->second;
            on_folded.plan = *folded_plan;
            run_kernel(int16_kernel_product, on_folded);
          }
        }
      }
      if (!done && options.vector_kernels && wide_kernel_applies(left, right, *plan, model)) {
        run_kernel(wide_kernel_product, context);
      }
      // trunc-align has no portable fast path: its products are aligned one by one.
      if (!done && model.kind != accumulation_kind::trunc_align) {
        result.fallback_entries = integer_product(context, result.out, exact);
        done = true;
      }
    }
    if (!done) generic_product(left, right, model, alpha, result.out, exact);
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

operand_summary summarize_counts(std::string_view name, int axis, std::int64_t elements, const quantized_tensor& q) {
  operand_summary summary;
  summary.name = std::string(name);
  summary.axis = axis;
  summary.elements = elements;
  summary.nonzero_inputs = q.nonzero_inputs;
  summary.flushed = q.flushed;
  summary.saturated = q.saturated;
  summary.nonfinite_inputs = q.nonfinite_inputs;
  return summary;
}

operand_summary summarize(std::string_view name, int axis, const matrix& input, const quantized_tensor& q) {
  operand_summary summary = summarize_counts(name, axis, input.size(), q);
  // fp64 sums in the canonical order of compare.hpp (row-major terms, fixed chunks, fixed tree):
  // the same bits for any thread count. Non-finite pairs contribute nothing.
  const auto energies = canonical_sums<2>(input.size(), [&](std::int64_t i) {
    const double value = input.values[static_cast<std::size_t>(i)];
    const double dequantized = q.dequantized.values[static_cast<std::size_t>(i)];
    if (!std::isfinite(value) || !std::isfinite(dequantized)) return std::array<double, 2>{0.0, 0.0};
    return std::array<double, 2>{value * value, (value - dequantized) * (value - dequantized)};
  });
  summary.signal_energy = energies[0];
  summary.error_energy = energies[1];
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

namespace {

// Whether q holds the values of `tensor` bit for bit (an unscaled operand: bf16 or fp32 elements).
bool holds_values_of(const quantized_tensor& q, const matrix& tensor) {
  const auto scheme = q.options.format.scheme;
  if ((scheme != quant_scheme::bf16 && scheme != quant_scheme::none) || q.rows != tensor.rows || q.cols != tensor.cols) {
    return false;
  }
  const std::size_t count = tensor.values.size();
  if (scheme == quant_scheme::none) {
    return q.dequantized.values.size() == count &&
           std::memcmp(q.dequantized.values.data(), tensor.values.data(), count * sizeof(float)) == 0;
  }
  if (q.codes.size() != 2 * count) return false;
  for (std::size_t i = 0; i < count; ++i) {
    const auto code = static_cast<std::uint16_t>(q.codes[2 * i] | (q.codes[2 * i + 1] << 8));
    if ((static_cast<std::uint32_t>(code) << 16) != core_ns::float_bits(tensor.values[i])) return false;
  }
  return true;
}

// The known exact product (gemm_options::known_exact_host) is this one's: the same tensors, and
// quantized operands with their values.
bool known_exact_applies(const gemm_options& options, const matrix* a_tensor, const matrix* b_tensor,
                         const quantized_tensor& a, const quantized_tensor& b) {
  const auto& known = options.known_exact_host;
  return known && known->fp64 != nullptr && known->a == a_tensor && known->b == b_tensor &&
         known->fp64->rows == (a.options.axis == 1 ? a.rows : a.cols) &&
         known->fp64->cols == (b.options.axis == 1 ? b.rows : b.cols) && holds_values_of(a, *a_tensor) &&
         holds_values_of(b, *b_tensor);
}

}  // namespace

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
    if (options.device == compute_device::gpu && backend::prepares(quantize_with)) {
      // The rotation, the quantizer and the operand's energies on the GPU; the dequantized values
      // stay there unless a CPU product needs them (fp32-seq's generic path reads them).
      check_rotation(tensor, axis, rotation_for(chosen, context), operand_what);
      backend::prepared_operand prepared =
          backend::prepare(tensor, quantize_with, rotation_for(chosen, context),
                           chosen.accumulation.kind == accumulation_kind::fp32_seq, options);
      summary = summarize_counts(name, axis, tensor.size(), prepared.quantized);
      summary.signal_energy = prepared.signal_energy;
      summary.error_energy = prepared.error_energy;
      summary.quantized_on_gpu = true;
      return std::move(prepared.quantized);
    }
    // Without a rotation the operand is quantized as captured (no copy).
    std::optional<matrix> rotated_copy;
    if (chosen.rotation_size != 0) rotated_copy = rotated_operand(tensor, axis, chosen, context, operand_what);
    const matrix& rotated = rotated_copy ? *rotated_copy : tensor;
    quantized_tensor quantized = quantize(rotated, quantize_with);
    summary = summarize(name, axis, rotated, quantized);
    return quantized;
  };

  using clock = std::chrono::steady_clock;
  const auto seconds_since = [](clock::time_point start) {
    return std::chrono::duration<double>(clock::now() - start).count();
  };
  gemm_result result;
  result.kind = kind;
  auto mark = clock::now();
  const quantized_tensor a = prepare(*a_tensor, chosen.a, layout.a_axis, layout.a_role, layout.a_name, result.a);
  const quantized_tensor b = prepare(*b_tensor, chosen.b, layout.b_axis, layout.b_role, layout.b_name, result.b);
  const double quantize_seconds = seconds_since(mark);
  mark = clock::now();
  const bool exact_too = options.exact_too && chosen.accumulation.kind != accumulation_kind::exact;
  std::optional<matrix64> fused_exact;
  // The exact_too product of the same operands reuses what the GPU prepared for this one.
  const std::shared_ptr<backend::product_cache> cache =
      exact_too && options.device == compute_device::gpu ? backend::make_product_cache() : nullptr;
  static_cast<product_result&>(result) =
      emulate_named(a, b, chosen.accumulation, chosen.output, options, what, layout.a_name, layout.b_name,
                    exact_too ? &fused_exact : nullptr, cache.get());
  result.quantize_seconds = quantize_seconds;
  result.product_seconds = seconds_since(mark);
  if (fused_exact) {
    // Computed with the product (its time is in product_seconds).
    result.exact_of_quantized = std::move(*fused_exact);
  } else if (exact_too && known_exact_applies(options, a_tensor, b_tensor, a, b)) {
    mark = clock::now();
    result.exact_of_quantized = *options.known_exact_host->fp64;
    result.exact_product_seconds = seconds_since(mark);
  } else if (exact_too) {
    mark = clock::now();
    accumulation_model exact_model;
    exact_model.kind = accumulation_kind::exact;
    product_result exact = emulate_named(a, b, exact_model, output_rounding::fp32, options, what, layout.a_name,
                                         layout.b_name, nullptr, cache.get());
    result.exact_of_quantized = std::move(exact.exact);
    result.device_exact_of_quantized = std::move(exact.device_exact);
    result.exact_of_quantized_on_gpu = exact.product_on_gpu;
    result.exact_product_seconds = seconds_since(mark);
  }
  return result;
}

}  // namespace mxscope
