#include "mxscope/quantize.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "mxscope/core/nvfp4.hpp"
#include "mxscope/errors.hpp"
#include "mxscope/quantize_fast.hpp"

namespace mxscope {

namespace core_ns = mxscope::core;
using core_ns::element_kind;

namespace {

struct format_name_entry {
  std::string_view name;
  format_choice choice;
};

constexpr format_name_entry format_names[] = {
    {"mxfp4", {quant_scheme::mx, element_kind::fp4_e2m1, 32}},
    {"mxfp6_e2m3", {quant_scheme::mx, element_kind::fp6_e2m3, 32}},
    {"mxfp6_e3m2", {quant_scheme::mx, element_kind::fp6_e3m2, 32}},
    {"mxfp8_e4m3", {quant_scheme::mx, element_kind::fp8_e4m3, 32}},
    {"mxfp8_e5m2", {quant_scheme::mx, element_kind::fp8_e5m2, 32}},
    {"mxint8", {quant_scheme::mx, element_kind::int8, 32}},
    {"nvfp4", {quant_scheme::nvfp4, element_kind::fp4_e2m1, 16}},
    {"fp8_e4m3", {quant_scheme::per_tensor, element_kind::fp8_e4m3, 0}},
    {"fp8_e5m2", {quant_scheme::per_tensor, element_kind::fp8_e5m2, 0}},
    {"bf16", {quant_scheme::bf16, element_kind::fp4_e2m1, 0}},
    {"fp32", {quant_scheme::none, element_kind::fp4_e2m1, 0}},
};

bool is_packed_4bit(const quantize_options& options) {
  return (options.format.scheme == quant_scheme::mx || options.format.scheme == quant_scheme::nvfp4) &&
         core_ns::spec(options.format.element).bits == 4;
}

int resolved_block(const quantize_options& options) {
  if (options.block > 0) return options.block;
  return options.format.default_block;
}

}  // namespace

std::optional<format_choice> parse_format(std::string_view name) {
  for (const auto& entry : format_names) {
    if (entry.name == name) return entry.choice;
  }
  return std::nullopt;
}

std::string format_name(const format_choice& format) {
  for (const auto& entry : format_names) {
    if (entry.choice.scheme == format.scheme &&
        (format.scheme == quant_scheme::bf16 || format.scheme == quant_scheme::none ||
         entry.choice.element == format.element)) {
      return std::string(entry.name);
    }
  }
  return "unknown";
}

std::optional<core_ns::rounding_mode> parse_rounding(std::string_view name) {
  if (name == "rne") return core_ns::rounding_mode::rne;
  if (name == "rna") return core_ns::rounding_mode::rna;
  if (name == "rtz") return core_ns::rounding_mode::rtz;
  if (name == "sr") return core_ns::rounding_mode::sr;
  return std::nullopt;
}

std::string_view rounding_name(core_ns::rounding_mode mode) {
  switch (mode) {
    case core_ns::rounding_mode::rne: return "rne";
    case core_ns::rounding_mode::rna: return "rna";
    case core_ns::rounding_mode::rtz: return "rtz";
    case core_ns::rounding_mode::sr: return "sr";
  }
  return "?";
}

std::optional<core_ns::scale_rule> parse_scale_rule(std::string_view name) {
  if (name == "floor") return core_ns::scale_rule::floor;
  if (name == "ceil") return core_ns::scale_rule::ceil;
  if (name == "even") return core_ns::scale_rule::even;
  return std::nullopt;
}

std::string_view scale_rule_name(core_ns::scale_rule rule) {
  switch (rule) {
    case core_ns::scale_rule::floor: return "floor";
    case core_ns::scale_rule::ceil: return "ceil";
    case core_ns::scale_rule::even: return "even";
  }
  return "?";
}

std::optional<sign_policy> parse_sign_policy(std::string_view name) {
  if (name == "none") return sign_policy::none;
  if (name == "fixed") return sign_policy::fixed;
  if (name == "per-step") return sign_policy::per_step;
  return std::nullopt;
}

std::string_view sign_policy_name(sign_policy policy) {
  switch (policy) {
    case sign_policy::none: return "none";
    case sign_policy::fixed: return "fixed";
    case sign_policy::per_step: return "per-step";
  }
  return "?";
}

std::int64_t quantized_tensor::code_row_bytes() const {
  if (is_packed_4bit(options)) return (cols + 1) / 2;
  if (options.format.scheme == quant_scheme::bf16) return cols * 2;
  if (options.format.scheme == quant_scheme::none) return 0;
  return cols;
}

void validate(const quantize_options& options, std::int64_t rows, std::int64_t cols, const std::string& what) {
  if (rows < 0 || cols < 0) throw input_error(fmt::format("{}: negative shape [{}, {}]", what, rows, cols));
  if (options.axis != 0 && options.axis != 1) {
    throw input_error(fmt::format("{}: field 'axis' must be 0 or 1, got {}", what, options.axis));
  }
  if (options.block < 0 || options.block > (1 << 20)) {
    throw input_error(fmt::format("{}: field 'block' must be in 1..{}, got {}", what, 1 << 20, options.block));
  }
  if (options.format.scheme == quant_scheme::nvfp4 && options.block != 0 && options.block != 16) {
    throw input_error(fmt::format("{}: field 'block': nvfp4 uses blocks of 16, got {}", what, options.block));
  }
  if (options.sr_bits < 1 || options.sr_bits > 32) {
    throw input_error(fmt::format("{}: field 'sr_bits' must be in 1..32, got {}", what, options.sr_bits));
  }
}

namespace {

// Per-block driver shared by the MX and NVFP4 paths: gathers a block (strided for axis 0), lets
// `encode_block` fill codes and dequantized values, and scatters them back.
struct block_view {
  std::int64_t first;   // flat index of the block's first element
  std::int64_t stride;  // flat distance between consecutive elements of the block
  int count;
};

void store_code(quantized_tensor& out, std::int64_t row, std::int64_t col, std::uint8_t code) {
  if (is_packed_4bit(out.options)) {
    std::uint8_t& byte = out.codes[static_cast<std::size_t>(row * out.code_row_bytes() + col / 2)];
    if (col % 2 == 0) {
      byte = static_cast<std::uint8_t>((byte & 0xF0U) | (code & 0x0FU));
    } else {
      byte = static_cast<std::uint8_t>((byte & 0x0FU) | ((code & 0x0FU) << 4));
    }
  } else {
    out.codes[static_cast<std::size_t>(row * out.cols + col)] = code;
  }
}

std::uint8_t load_code(const quantized_tensor& q, std::int64_t row, std::int64_t col) {
  if (is_packed_4bit(q.options)) {
    const std::uint8_t byte = q.codes[static_cast<std::size_t>(row * q.code_row_bytes() + col / 2)];
    return col % 2 == 0 ? (byte & 0x0FU) : (byte >> 4);
  }
  return q.codes[static_cast<std::size_t>(row * q.cols + col)];
}

// Philox words for a block's elements: one Philox evaluation serves four consecutive flat indices.
class word_cache {
 public:
  explicit word_cache(const core_ns::random_stream& stream) : stream_(stream) {}
  std::uint32_t word(std::int64_t flat_index) {
    const std::uint64_t block_index = static_cast<std::uint64_t>(flat_index) / 4;
    if (block_index != cached_index_) {
      cached_ = stream_.block(block_index);
      cached_index_ = block_index;
    }
    return cached_.word[flat_index % 4];
  }

 private:
  core_ns::random_stream stream_;
  core_ns::philox_block cached_{};
  std::uint64_t cached_index_ = ~std::uint64_t{0};
};

struct counters {
  std::int64_t nonzero = 0, flushed = 0, saturated = 0, nonfinite = 0;
  void add(const counters& other) {
    nonzero += other.nonzero;
    flushed += other.flushed;
    saturated += other.saturated;
    nonfinite += other.nonfinite;
  }
};

void quantize_mx(const matrix& input, quantized_tensor& out) {
  const auto& options = out.options;
  const element_kind kind = options.format.element;
  const int block = out.block;
  const bool along_rows = options.axis == 1;
  const std::int64_t lines = along_rows ? input.rows : input.cols;       // independent 1-D lines
  const std::int64_t length = along_rows ? input.cols : input.rows;      // elements per line
  const std::int64_t blocks_per_line = (length + block - 1) / block;
  const bool stochastic = options.rounding == core_ns::rounding_mode::sr;
  counters total;

#pragma omp parallel
  {
    counters local;
    word_cache words(options.stream);
#pragma omp for schedule(static)
    for (std::int64_t line = 0; line < lines; ++line) {
      for (std::int64_t b = 0; b < blocks_per_line; ++b) {
        const std::int64_t begin = b * block;
        const int count = static_cast<int>(std::min<std::int64_t>(block, length - begin));
        auto coordinates = [&](int i) {
          const std::int64_t position = begin + i;
          return along_rows ? std::pair{line, position} : std::pair{position, line};
        };
        float amax = 0.0f;
        bool nonfinite = false;
        for (int i = 0; i < count; ++i) {
          const auto [r, c] = coordinates(i);
          const float v = input(r, c);
          if (!std::isfinite(v)) {
            nonfinite = true;
            ++local.nonfinite;
          } else {
            amax = std::max(amax, std::fabs(v));
          }
          if (v != 0.0f) ++local.nonzero;
        }
        const std::size_t scale_index =
            along_rows ? static_cast<std::size_t>(line * blocks_per_line + b) : static_cast<std::size_t>(b * lines + line);
        if (nonfinite) {
          out.scales[scale_index] = core_ns::scale_nan_code;
          for (int i = 0; i < count; ++i) {
            const auto [r, c] = coordinates(i);
            store_code(out, r, c, 0);
            out.dequantized(r, c) = std::numeric_limits<float>::quiet_NaN();
          }
          continue;
        }
        const int exponent = core_ns::shared_exponent(kind, options.rule, amax);
        out.scales[scale_index] = core_ns::scale_code(exponent);
        for (int i = 0; i < count; ++i) {
          const auto [r, c] = coordinates(i);
          const std::uint32_t word = stochastic ? words.word(r * input.cols + c) : 0U;
          const auto encoded =
              core_ns::quantize_element(kind, input(r, c), exponent, options.rounding, word, options.sr_bits);
          store_code(out, r, c, encoded.code);
          out.dequantized(r, c) = static_cast<float>(core_ns::dequantize_element(kind, encoded.code, exponent));
          local.flushed += encoded.flushed;
          local.saturated += encoded.saturated;
        }
      }
    }
#pragma omp critical
    total.add(local);
  }
  out.nonzero_inputs = total.nonzero;
  out.flushed = total.flushed;
  out.saturated = total.saturated;
  out.nonfinite_inputs = total.nonfinite;
}

// TransformerEngine's NVFP4 recipe, in its fp32 operation order (include/mxscope/core/nvfp4.hpp,
// shared with the GPU kernels):
//   S_enc = 448 * 6 / amax_tensor (1 when amax is 0 or S_enc is 0; capped at FLT_MAX)
//   block decode scale d = e4m3(RNE, satfinite)(block_amax * (S_enc * fl32(1/6)))
//   block encode scale  = min(1 / (fl32(d) * (1 / S_enc)), FLT_MAX)
//   element code        = e2m1(round)(x * encode scale)
//   dequantized         = q * fl32(d) * (1 / S_enc)
void quantize_nvfp4(const matrix& input, quantized_tensor& out) {
  const auto& options = out.options;
  float tensor_amax = 0.0f;
  for (float v : input.values) {
    if (std::isfinite(v)) tensor_amax = std::max(tensor_amax, std::fabs(v));
  }
  const float global_encode = core_ns::nvfp4_global_encode_scale(tensor_amax);
  const float global_decode = 1.0f / global_encode;
  out.tensor_scale = global_decode;
  const bool stochastic = options.rounding == core_ns::rounding_mode::sr;

  // A tile is [tile_rows x tile_cols] elements sharing one scale: 1x16 (axis 1), 16x1 (axis 0)
  // or 16x16 (2-D).
  // Under rne the elements take the nearest-even encoder (the same codes as core::encode, with the
  // format's constants hoisted) and a decode table: core::nvfp4_encode's steps, unchanged.
  const bool nearest_even = !stochastic && options.rounding == core_ns::rounding_mode::rne;
  const core_ns::nearest_even_encoder encode_nearest_even(core_ns::element_kind::fp4_e2m1);
  float decoded[16] = {};
  for (std::uint32_t code = 0; code < 16; ++code) {
    decoded[code] = static_cast<float>(core_ns::decode(core_ns::element_kind::fp4_e2m1, code));
  }

  const core_ns::nvfp4_tile tile = core_ns::nvfp4_tile_of(options.axis, options.nvfp4_2d);
  const std::int64_t tile_rows = tile.rows;
  const std::int64_t tile_cols = tile.cols;
  const std::int64_t grid_rows = (input.rows + tile_rows - 1) / tile_rows;
  const std::int64_t grid_cols = (input.cols + tile_cols - 1) / tile_cols;
  counters total;

#pragma omp parallel
  {
    counters local;
    word_cache words(options.stream);
#pragma omp for schedule(static)
    for (std::int64_t tr = 0; tr < grid_rows; ++tr) {
      for (std::int64_t tc = 0; tc < grid_cols; ++tc) {
        const std::int64_t r0 = tr * tile_rows, r1 = std::min(input.rows, r0 + tile_rows);
        const std::int64_t c0 = tc * tile_cols, c1 = std::min(input.cols, c0 + tile_cols);
        float amax = 0.0f;
        bool nonfinite = false;
        for (std::int64_t r = r0; r < r1; ++r) {
          for (std::int64_t c = c0; c < c1; ++c) {
            const float v = input(r, c);
            if (!std::isfinite(v)) {
              nonfinite = true;
              ++local.nonfinite;
            } else {
              amax = std::max(amax, std::fabs(v));
            }
            if (v != 0.0f) ++local.nonzero;
          }
        }
        const std::size_t scale_index = static_cast<std::size_t>(tr * grid_cols + tc);
        if (nonfinite) {
          out.scales[scale_index] = static_cast<std::uint8_t>(core_ns::nan_code(core_ns::element_kind::ue4m3));
          for (std::int64_t r = r0; r < r1; ++r) {
            for (std::int64_t c = c0; c < c1; ++c) {
              store_code(out, r, c, 0);
              out.dequantized(r, c) = std::numeric_limits<float>::quiet_NaN();
            }
          }
          continue;
        }
        const core_ns::nvfp4_block block = core_ns::nvfp4_block_of_amax(amax, global_encode, global_decode);
        out.scales[scale_index] = block.scale;
        for (std::int64_t r = r0; r < r1; ++r) {
          for (std::int64_t c = c0; c < c1; ++c) {
            if (nearest_even) {
              const float value = input(r, c);
              const core_ns::encoded code = encode_nearest_even(static_cast<double>(value * block.encode));
              const float dequantized = (decoded[code.code] * block.decode) * global_decode;
              store_code(out, r, c, code.code);
              out.dequantized(r, c) = dequantized;
              local.flushed += code.flushed || (value != 0.0f && dequantized == 0.0f);
              local.saturated += code.saturated;
              continue;
            }
            const std::uint32_t word = stochastic ? words.word(r * input.cols + c) : 0U;
            const core_ns::nvfp4_element element =
                core_ns::nvfp4_encode(input(r, c), block, global_decode, options.rounding, word, options.sr_bits);
            store_code(out, r, c, element.code.code);
            out.dequantized(r, c) = element.dequantized;
            local.flushed += element.flushed;
            local.saturated += element.code.saturated;
          }
        }
      }
    }
#pragma omp critical
    total.add(local);
  }
  out.nonzero_inputs = total.nonzero;
  out.flushed = total.flushed;
  out.saturated = total.saturated;
  out.nonfinite_inputs = total.nonfinite;
}

// Per-tensor fp8 (the FP8 baseline): scale = fl32(amax / max_normal); q = Round(x / scale) where
// the quotient is computed in a double and then rounded to fp8. For 24-bit operands a 53-bit
// quotient is far from any fp8 midpoint unless it is exactly one, so this rounds the exact quotient.
void quantize_per_tensor(const matrix& input, quantized_tensor& out) {
  const auto& options = out.options;
  const element_kind kind = options.format.element;
  float amax = 0.0f;  // a maximum: the same for any order and thread count
  const auto size = static_cast<std::int64_t>(input.values.size());
#pragma omp parallel for schedule(static) reduction(max : amax)
  for (std::int64_t i = 0; i < size; ++i) {
    const float v = input.values[static_cast<std::size_t>(i)];
    if (std::isfinite(v)) amax = std::max(amax, std::fabs(v));
  }
  const float scale = amax > 0.0f ? amax / static_cast<float>(core_ns::max_normal(kind)) : 1.0f;
  out.tensor_scale = scale;
  const bool stochastic = options.rounding == core_ns::rounding_mode::sr;
  // Round to nearest even (the default) by the encoder with its constants hoisted, the same
  // function as core::encode; the dequantized values from a table of the codes' fp32 values.
  const bool nearest_even = options.rounding == core_ns::rounding_mode::rne && core_ns::nearest_even_encoder::covers(kind);
  const core_ns::nearest_even_encoder encode_nearest_even(nearest_even ? kind : element_kind::fp8_e4m3);
  float decoded[256] = {};
  for (std::uint32_t code = 0; code < (1U << core_ns::spec(kind).bits); ++code) {
    decoded[code] = static_cast<float>(core_ns::decode(kind, code));
  }
  counters total;
#pragma omp parallel
  {
    counters local;
    word_cache words(options.stream);
#pragma omp for schedule(static)
    for (std::int64_t r = 0; r < input.rows; ++r) {
      for (std::int64_t c = 0; c < input.cols; ++c) {
        const float v = input(r, c);
        if (v != 0.0f) ++local.nonzero;
        if (!std::isfinite(v)) {
          ++local.nonfinite;
          out.codes[static_cast<std::size_t>(r * input.cols + c)] =
              static_cast<std::uint8_t>(core_ns::nan_code(kind) | (std::signbit(v) ? core_ns::sign_bit(kind) : 0U));
          out.dequantized(r, c) = std::numeric_limits<float>::quiet_NaN();
          continue;
        }
        const double quotient = static_cast<double>(v) / static_cast<double>(scale);
        const std::uint32_t word = stochastic ? words.word(r * input.cols + c) : 0U;
        const auto encoded = nearest_even ? encode_nearest_even(quotient)
                                          : core_ns::encode(kind, quotient, options.rounding, word, options.sr_bits);
        out.codes[static_cast<std::size_t>(r * input.cols + c)] = encoded.code;
        out.dequantized(r, c) = decoded[encoded.code] * scale;
        local.flushed += encoded.flushed;
        local.saturated += encoded.saturated;
      }
    }
#pragma omp critical
    total.add(local);
  }
  out.nonzero_inputs = total.nonzero;
  out.flushed = total.flushed;
  out.saturated = total.saturated;
  out.nonfinite_inputs = total.nonfinite;
}

void quantize_bf16(const matrix& input, quantized_tensor& out) {
  const auto& options = out.options;
  const bool stochastic = options.rounding == core_ns::rounding_mode::sr;
  counters total;
#pragma omp parallel
  {
    counters local;
    word_cache words(options.stream);
#pragma omp for schedule(static)
    for (std::int64_t r = 0; r < input.rows; ++r) {
      for (std::int64_t c = 0; c < input.cols; ++c) {
        const float v = input(r, c);
        const std::uint32_t word = stochastic ? words.word(r * input.cols + c) : 0U;
        const std::uint16_t bits = core_ns::float_to_bf16(v, options.rounding, word, options.sr_bits);
        const std::size_t at = static_cast<std::size_t>(r * input.cols + c) * 2;
        out.codes[at] = static_cast<std::uint8_t>(bits & 0xFFU);
        out.codes[at + 1] = static_cast<std::uint8_t>(bits >> 8);
        const float rounded = core_ns::bf16_to_float(bits);
        out.dequantized(r, c) = rounded;
        if (v != 0.0f) ++local.nonzero;
        if (!std::isfinite(v)) ++local.nonfinite;
        if (v != 0.0f && rounded == 0.0f) ++local.flushed;
        if (std::isfinite(v) && std::isinf(rounded)) ++local.saturated;
      }
    }
#pragma omp critical
    total.add(local);
  }
  out.nonzero_inputs = total.nonzero;
  out.flushed = total.flushed;
  out.saturated = total.saturated;
  out.nonfinite_inputs = total.nonfinite;
}

}  // namespace

quantized_tensor quantize(const matrix& input, const quantize_options& options) {
  validate(options, input.rows, input.cols, "quantize");
  quantized_tensor out;
  out.rows = input.rows;
  out.cols = input.cols;
  out.options = options;
  out.block = resolved_block(options);
  out.dequantized = matrix(input.rows, input.cols);
  out.codes.assign(static_cast<std::size_t>(out.rows * out.code_row_bytes()), 0);
  switch (options.format.scheme) {
    case quant_scheme::none:
      out.dequantized = input;
      for (float v : input.values) {
        out.nonzero_inputs += v != 0.0f;
        out.nonfinite_inputs += !std::isfinite(v);
      }
      break;
    case quant_scheme::bf16: quantize_bf16(input, out); break;
    case quant_scheme::mx: {
      const std::int64_t length = options.axis == 1 ? input.cols : input.rows;
      const std::int64_t blocks = (length + out.block - 1) / out.block;
      out.scale_rows = options.axis == 1 ? input.rows : blocks;
      out.scale_cols = options.axis == 1 ? blocks : input.cols;
      out.scales.assign(static_cast<std::size_t>(out.scale_rows * out.scale_cols), 0);
      if (fast_quantize_enabled() && fast_quantize_covers(options)) {
        quantize_mx_fast_into(input, out);  // the same bits from the fp32 bit patterns (quantize_fast.hpp)
      } else {
        quantize_mx(input, out);
      }
      break;
    }
    case quant_scheme::nvfp4: {
      const core_ns::nvfp4_tile tile = core_ns::nvfp4_tile_of(options.axis, options.nvfp4_2d);
      const std::int64_t tile_rows = tile.rows;
      const std::int64_t tile_cols = tile.cols;
      out.scale_rows = (input.rows + tile_rows - 1) / tile_rows;
      out.scale_cols = (input.cols + tile_cols - 1) / tile_cols;
      out.scales.assign(static_cast<std::size_t>(out.scale_rows * out.scale_cols), 0);
      quantize_nvfp4(input, out);
      break;
    }
    case quant_scheme::per_tensor: quantize_per_tensor(input, out); break;
  }
  return out;
}

matrix dequantize(const quantized_tensor& q) {
  matrix out(q.rows, q.cols);
  const auto& options = q.options;
  const element_kind kind = options.format.element;
  switch (options.format.scheme) {
    case quant_scheme::none: return q.dequantized;
    case quant_scheme::bf16:
      for (std::int64_t i = 0; i < q.rows * q.cols; ++i) {
        const auto at = static_cast<std::size_t>(i) * 2;
        out.values[static_cast<std::size_t>(i)] =
            core_ns::bf16_to_float(static_cast<std::uint16_t>(q.codes[at] | (q.codes[at + 1] << 8)));
      }
      return out;
    case quant_scheme::mx:
      for (std::int64_t r = 0; r < q.rows; ++r) {
        for (std::int64_t c = 0; c < q.cols; ++c) {
          const std::uint8_t scale = options.axis == 1 ? q.scales[static_cast<std::size_t>(r * q.scale_cols + c / q.block)]
                                                       : q.scales[static_cast<std::size_t>((r / q.block) * q.scale_cols + c)];
          out(r, c) = scale == core_ns::scale_nan_code
                          ? std::numeric_limits<float>::quiet_NaN()
                          : static_cast<float>(core_ns::dequantize_element(kind, load_code(q, r, c),
                                                                           core_ns::scale_exponent(scale)));
        }
      }
      return out;
    case quant_scheme::nvfp4: {
      const core_ns::nvfp4_tile tile = core_ns::nvfp4_tile_of(options.axis, options.nvfp4_2d);
      const std::int64_t tile_rows = tile.rows;
      const std::int64_t tile_cols = tile.cols;
      for (std::int64_t r = 0; r < q.rows; ++r) {
        for (std::int64_t c = 0; c < q.cols; ++c) {
          const std::uint8_t scale = q.scales[static_cast<std::size_t>((r / tile_rows) * q.scale_cols + c / tile_cols)];
          const float block_decode = static_cast<float>(core_ns::decode(core_ns::element_kind::ue4m3, scale));
          const float element = static_cast<float>(core_ns::decode(kind, load_code(q, r, c)));
          out(r, c) = (element * block_decode) * q.tensor_scale;
        }
      }
      return out;
    }
    case quant_scheme::per_tensor:
      for (std::int64_t i = 0; i < q.rows * q.cols; ++i) {
        out.values[static_cast<std::size_t>(i)] =
            static_cast<float>(core_ns::decode(kind, q.codes[static_cast<std::size_t>(i)])) * q.tensor_scale;
      }
      return out;
  }
  return out;
}

// ------------------------------------------------------------------------------------------------

std::vector<float> rotation_signs(std::int64_t length, const rotation_options& options) {
  std::vector<float> signs(static_cast<std::size_t>(length), 1.0f);
  if (options.signs == sign_policy::none) return signs;
  const core_ns::random_stream stream{
      options.seed,
      core_ns::policy_step(options.signs == sign_policy::fixed ? core_ns::seed_policy::fixed
                                                               : core_ns::seed_policy::per_step,
                           options.step),
      core_ns::stream_tag(options.layer_hash, core_ns::random_role::signs)};
  for (std::int64_t k = 0; k < length; ++k) {
    signs[static_cast<std::size_t>(k)] = core_ns::sign_from_word(stream.word(static_cast<std::uint64_t>(k)));
  }
  return signs;
}

void check_rotation(const matrix& values, int axis, const rotation_options& options, const std::string& what) {
  if (options.size == 0) return;
  if (axis != 0 && axis != 1) throw input_error(fmt::format("{}: rotation axis must be 0 or 1, got {}", what, axis));
  const std::int64_t length = axis == 1 ? values.cols : values.rows;
  if (!core_ns::is_valid_rotation_size(options.size)) {
    throw input_error(fmt::format("{}: field 'rotation': size {} is not a power of two in [{}, {}]", what,
                                  options.size, core_ns::rotation_size_min, core_ns::rotation_size_max));
  }
  if (length % options.size != 0) {
    throw input_error(fmt::format("{}: field 'rotation': size {} does not divide the length {} of axis {}", what,
                                  options.size, length, axis));
  }
}

void rotate(matrix& values, int axis, const rotation_options& options, const std::string& what, bool inverse) {
  if (options.size == 0) return;
  check_rotation(values, axis, options, what);
  const std::int64_t length = axis == 1 ? values.cols : values.rows;
  const std::vector<float> signs = rotation_signs(length, options);
  const bool use_signs = options.signs != sign_policy::none;
  const std::int64_t lines = axis == 1 ? values.rows : values.cols;
  const std::int64_t segments = length / options.size;
  // Along axis 0 a segment runs down a column; segments of `width` neighbouring columns are
  // gathered together so that every row access reads a contiguous run (each segment is rotated
  // by itself, as along axis 1, so the grouping does not change any value).
  constexpr std::int64_t width = 16;
  const std::int64_t line_groups = axis == 1 ? lines : (lines + width - 1) / width;
  const auto size = static_cast<std::size_t>(options.size);
#pragma omp parallel
  {
    std::vector<float> segment(size * width);
#pragma omp for schedule(static)
    for (std::int64_t group = 0; group < line_groups; ++group) {
      const std::int64_t first = axis == 1 ? group : group * width;
      const std::int64_t count = axis == 1 ? 1 : std::min(width, lines - first);
      for (std::int64_t s = 0; s < segments; ++s) {
        const std::int64_t begin = s * options.size;
        if (axis == 1) {
          for (int i = 0; i < options.size; ++i) segment[static_cast<std::size_t>(i)] = values(first, begin + i);
        } else {
          for (int i = 0; i < options.size; ++i) {
            for (std::int64_t c = 0; c < count; ++c) {
              segment[static_cast<std::size_t>(c) * size + static_cast<std::size_t>(i)] = values(begin + i, first + c);
            }
          }
        }
        const float* segment_signs = use_signs ? signs.data() + begin : nullptr;
        for (std::int64_t c = 0; c < count; ++c) {
          float* one = segment.data() + static_cast<std::size_t>(c) * size;
          if (inverse) {
            core_ns::unrotate_segment(one, options.size, segment_signs);
          } else {
            core_ns::rotate_segment(one, options.size, segment_signs);
          }
        }
        if (axis == 1) {
          for (int i = 0; i < options.size; ++i) values(first, begin + i) = segment[static_cast<std::size_t>(i)];
        } else {
          for (int i = 0; i < options.size; ++i) {
            for (std::int64_t c = 0; c < count; ++c) {
              values(begin + i, first + c) = segment[static_cast<std::size_t>(c) * size + static_cast<std::size_t>(i)];
            }
          }
        }
      }
    }
  }
}

}  // namespace mxscope
