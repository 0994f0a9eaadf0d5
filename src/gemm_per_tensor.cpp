// Per-tensor fp8 products (gemm.hpp, namespace detail): per-tensor operands multiplied as MX
// operands with unit block scales and the tensor scales applied as the hardware's epilogue does, and
// the exact model by binade parts where the exact unscaled sum is not an fp64 value. Used by
// emulate_product (src/gemm.cpp) on the CPU and, through its `multiply` argument, on the GPU.
#include <algorithm>
#include <cmath>
#include <functional>
#include <optional>
#include <vector>

#include "mxscope/core/tensor_scale.hpp"
#include "mxscope/gemm.hpp"
#include "gemm_internal.hpp"
#include "backend/backend.hpp"

namespace mxscope {

namespace core_ns = mxscope::core;
using core_ns::element_kind;
using namespace gemm_internal;

namespace detail {

namespace {

bool both_per_tensor(const quantized_tensor& a, const quantized_tensor& b) {
  return a.options.format.scheme == quant_scheme::per_tensor && b.options.format.scheme == quant_scheme::per_tensor;
}

// Per-tensor operands with finite elements only.
bool finite_elements(const quantized_tensor& a, const quantized_tensor& b) {
  const auto finite = [](const quantized_tensor& q) {
    const element_kind kind = q.options.format.element;
    bool table[256] = {};
    const int codes = 1 << core_ns::spec(kind).bits;
    for (int code = 0; code < codes; ++code) {
      table[code] = std::isfinite(core_ns::decode(kind, static_cast<std::uint32_t>(code)));
    }
    // Codes left in device memory by the GPU's quantizer are checked there.
    if (const auto on_device = backend::nonfinite_codes_on_device(q, kind)) return *on_device == 0;
    bool all = true;
    const auto size = static_cast<std::int64_t>(q.codes.size());
#pragma omp parallel for schedule(static) reduction(&& : all) if (size >= parallel_elements)
    for (std::int64_t i = 0; i < size; ++i) all = all && table[q.codes[static_cast<std::size_t>(i)]];
    return all;
  };
  return finite(a) && finite(b);
}

double integer_max(element_kind kind) {
  return core_ns::max_normal(kind) * core_ns::pow2(-core_ns::subnormal_ulp_exponent(kind));
}

std::int64_t depth_of(const quantized_tensor& q) { return q.options.axis == 1 ? q.cols : q.rows; }

// K max|qa| max|qb| below 2^53 in units of the elements' subnormal spacing: the exact unscaled sum
// is an fp64 value.
bool unscaled_sum_is_fp64(const quantized_tensor& a, const quantized_tensor& b) {
  return static_cast<double>(depth_of(a)) * integer_max(a.options.format.element) *
             integer_max(b.options.format.element) < 0x1p53;
}

}  // namespace

bool per_tensor_by_unit_scales_applies(const quantized_tensor& a, const quantized_tensor& b,
                                       const accumulation_model& model) {
  const bool models = model.kind == accumulation_kind::exact || model.kind == accumulation_kind::fp32_block ||
                      model.kind == accumulation_kind::fp32_group;
  if (!models || !both_per_tensor(a, b)) return false;
  // Only the exact model needs the unscaled sum as an fp64 value; fp32-block and fp32-group apply
  // alpha to the fp32 accumulator, which the MX product computes for any K.
  if (model.kind == accumulation_kind::exact && !unscaled_sum_is_fp64(a, b)) return false;
  return finite_elements(a, b);
}

std::optional<per_tensor_parts_route> per_tensor_exact_parts_route(const quantized_tensor& a,
                                                                   const quantized_tensor& b,
                                                                   const accumulation_model& model) {
  if (model.kind != accumulation_kind::exact || !both_per_tensor(a, b)) return std::nullopt;
  if (unscaled_sum_is_fp64(a, b)) return std::nullopt;  // per_tensor_by_unit_scales takes it whole
  const element_kind ka = a.options.format.element, kb = b.options.format.element;
  const bool split_a = integer_max(ka) >= integer_max(kb);  // cut the operand of the wider range
  std::optional<std::vector<binade_part>> parts =
      per_tensor_exact_parts(split_a ? ka : kb, split_a ? kb : ka, depth_of(a));
  if (!parts || !finite_elements(a, b)) return std::nullopt;
  return per_tensor_parts_route{std::move(*parts), split_a};
}

scaled_exact round_scaled_exact(double sum, float sa, float sb) {
  const core_ns::scaled_exact_value rounded = core_ns::round_scaled_exact(sum, sa, sb);
  return {rounded.fp32, rounded.fp64};
}

quantized_tensor unit_scaled_mx(const quantized_tensor& q, int block) {
  quantized_tensor out;
  out.options = q.options;
  out.options.format.scheme = quant_scheme::mx;
  out.options.format.default_block = block;
  out.options.block = block;
  out.block = block;
  out.rows = q.rows;
  out.cols = q.cols;
  out.codes = q.codes;
  if (q.options.axis == 1) {
    out.scale_rows = q.rows;
    out.scale_cols = (q.cols + block - 1) / block;
  } else {
    out.scale_rows = (q.rows + block - 1) / block;
    out.scale_cols = q.cols;
  }
  out.scales.assign(static_cast<std::size_t>(out.scale_rows * out.scale_cols), core_ns::scale_code(0));  // 2^0
  return out;
}

product_result per_tensor_by_unit_scales(
    const quantized_tensor& a, const quantized_tensor& b, int block, const accumulation_model& model,
    output_rounding output,
    const std::function<product_result(const quantized_tensor&, const quantized_tensor&)>& multiply) {
  product_result result = multiply(unit_scaled_mx(a, block), unit_scaled_mx(b, block));
  const auto size = static_cast<std::int64_t>(result.out.values.size());
  if (model.kind == accumulation_kind::exact) {
#pragma omp parallel for schedule(static) if (size >= parallel_elements / 8)
    for (std::int64_t e = 0; e < size; ++e) {
      const auto at = static_cast<std::size_t>(e);
      // The unscaled sum is exact here (the bound of per_tensor_by_unit_scales_applies).
      const scaled_exact rounded = round_scaled_exact(result.exact.values[at], a.tensor_scale, b.tensor_scale);
      result.out.values[at] = round_output(rounded.fp32, output);
      result.exact.values[at] = rounded.fp64;
    }
  } else {
    const float alpha = a.tensor_scale * b.tensor_scale;
#pragma omp parallel for schedule(static) if (size >= parallel_elements)
    for (std::int64_t e = 0; e < size; ++e) {
      const auto at = static_cast<std::size_t>(e);
      result.out.values[at] = round_output(epilogue(result.out.values[at], alpha), output);
    }
  }
  return result;
}

std::optional<std::vector<binade_part>> per_tensor_exact_parts(element_kind split, element_kind other,
                                                              std::int64_t depth) {
  const auto& f = core_ns::spec(split);
  const int mantissa = f.mantissa_bits;
  const int lowest = core_ns::subnormal_ulp_exponent(split);  // the binade of the least subnormal
  const int normal = core_ns::min_normal_exponent(split);
  const int top = core_ns::emax_elem(split) + 1;              // magnitudes below 2^top
  const double other_max = integer_max(other);
  // Carried in `other`'s format: windows as wide as `other`'s normal binades, each shifted onto
  // them. Where `other` holds `split`'s significands every value of a window lands on a normal
  // number of `other` (the lowest window's subnormals too, being multiples of 2^lowest); the loop
  // checks each code anyway. The parts' integers are then `other`'s, so the fp64 bound is K times
  // its largest integer squared.
  const auto carried = [&]() -> std::optional<std::vector<binade_part>> {
    const auto& g = core_ns::spec(other);
    const int carrier_low = core_ns::min_normal_exponent(other);
    const int carrier_width = core_ns::emax_elem(other) + 1 - carrier_low;
    if (f.is_integer || g.is_integer || g.mantissa_bits < mantissa || carrier_width < 1 ||
        !(static_cast<double>(depth) * other_max * other_max < 0x1p53)) {
      return std::nullopt;
    }
    std::vector<binade_part> parts;
    for (int low = lowest; low < top; low += carrier_width) {
      const binade_part part{low, std::min(low + carrier_width, top), low - carrier_low, other};
      for (std::uint32_t code = 0; code < (1U << f.bits); ++code) {
        const double value = std::fabs(core_ns::decode(split, code));
        if (!std::isfinite(value) || value < core_ns::pow2(part.low) || value >= core_ns::pow2(part.high)) continue;
        const double shifted = value * core_ns::pow2(-part.shift);
        if (core_ns::decode(other, core_ns::encode(other, shifted).code) != shifted) return std::nullopt;
      }
      parts.push_back(part);
    }
    if (parts.size() > max_binade_parts) return std::nullopt;
    return parts;
  };
  if (auto parts = carried()) return parts;
  // In `split`'s own format: a part [2^low, 2^high) is fp64-exact when depth * 2^high /
  // 2^(max(low, normal) - mantissa) * other_max < 2^53 (fl of the product is monotone, so a
  // rounded product at or above 2^53 never hides one below it).
  const auto exact = [&](int low, int high) {
    return static_cast<double>(depth) * other_max * core_ns::pow2(high - std::max(low, normal) + mantissa) < 0x1p53;
  };
  std::vector<binade_part> parts;
  for (int high = top; high > lowest;) {
    int low = high - 1;
    if (!exact(low, high)) return std::nullopt;  // not even one binade fits
    while (low > lowest && exact(low - 1, high)) --low;
    // The part's codes hold value / 2^shift, all normal there (shift 0 for the part that reaches
    // the subnormals), so that its integers in units of the format's subnormal spacing stay small.
    parts.push_back({low, high, low > normal ? low - normal : 0, split});
    high = low;
    if (parts.size() > max_binade_parts) return std::nullopt;
  }
  return parts;
}

// The elements of per-tensor operand `q` whose magnitudes lie in `part`, as an MX operand of
// element format part.kind whose block scales are all 2^part.shift and whose codes hold
// value / 2^shift (exact: per_tensor_exact_parts checked that they are that format's numbers);
// every other element is +0.
quantized_tensor binade_part_operand(const quantized_tensor& q, int block, const binade_part& part) {
  quantized_tensor out = unit_scaled_mx(q, block);
  const element_kind kind = q.options.format.element;
  out.options.format.element = part.kind;
  std::uint8_t code_of[256] = {};
  for (int code = 0; code < (1 << core_ns::spec(kind).bits); ++code) {
    const double value = core_ns::decode(kind, static_cast<std::uint32_t>(code));
    const double magnitude = std::fabs(value);
    const bool inside = std::isfinite(value) && magnitude >= core_ns::pow2(part.low) &&
                        magnitude < core_ns::pow2(part.high);
    code_of[code] = inside ? static_cast<std::uint8_t>(
                                 core_ns::encode(part.kind, value * core_ns::pow2(-part.shift)).code)
                           : std::uint8_t{0};
  }
  const auto size = static_cast<std::int64_t>(out.codes.size());
#pragma omp parallel for schedule(static) if (size >= parallel_elements)
  for (std::int64_t i = 0; i < size; ++i) {
    const auto at = static_cast<std::size_t>(i);
    out.codes[at] = code_of[out.codes[at]];
  }
  std::fill(out.scales.begin(), out.scales.end(), core_ns::scale_code(part.shift));
  return out;
}


product_result per_tensor_exact_by_parts(
    const quantized_tensor& a, const quantized_tensor& b, int block, const std::vector<binade_part>& parts,
    bool split_a, output_rounding output,
    const std::function<product_result(const quantized_tensor&, const quantized_tensor&)>& multiply) {
  const quantized_tensor whole = unit_scaled_mx(split_a ? b : a, block);
  std::vector<matrix64> sums;
  sums.reserve(parts.size());
  for (const binade_part& part : parts) {
    const quantized_tensor piece = binade_part_operand(split_a ? a : b, block, part);
    product_result partial = split_a ? multiply(piece, whole) : multiply(whole, piece);
    sums.push_back(std::move(partial.exact));
  }
  product_result result;
  result.out = matrix(sums.front().rows, sums.front().cols);
  result.exact = matrix64(sums.front().rows, sums.front().cols);
  const core_ns::tensor_scale_product scale = core_ns::make_scale_product(a.tensor_scale, b.tensor_scale);
  const auto size = static_cast<std::int64_t>(result.out.values.size());
#pragma omp parallel for schedule(static) if (size >= parallel_elements / 8)
  for (std::int64_t e = 0; e < size; ++e) {
    const auto at = static_cast<std::size_t>(e);
    // The parts' sums are exact fp64 values; where their sum is one too, the single-sum rounding
    // applies, else the long accumulator takes each part times the scales exactly.
    double sum = 0.0;
    bool single = true;
    for (const matrix64& part : sums) {
      const core_ns::sum_and_error se = core_ns::two_sum(sum, part.values[at]);
      sum = se.sum;
      single = single && se.error == 0.0;
    }
    core_ns::scaled_exact_value rounded{};
    if (single) {
      rounded = core_ns::round_scaled_exact(sum, a.tensor_scale, b.tensor_scale);
    } else {
      core_ns::long_accumulator total;
      for (const matrix64& part : sums) core_ns::add_scaled_exactly(total, part.values[at], scale);
      rounded = {total.round_to_float(), total.round_to_double()};
    }
    result.out.values[at] = round_output(rounded.fp32, output);
    result.exact.values[at] = rounded.fp64;
  }
  return result;
}

}  // namespace detail

}  // namespace mxscope
