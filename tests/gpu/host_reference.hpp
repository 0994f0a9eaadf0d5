// The CPU side of the GPU bit-exactness test, built from the header-only core alone (no fmt, Eigen,
// Boost or OpenMP), so that it compiles on a GPU machine that has only a compiler and the CUDA
// toolkit. Each function is the definition the library implements, written entry by entry:
//
// - rotate:        src/quantize.cpp rotate() (signs, canonical FWHT, scale) per segment;
// - quantize_mx:   src/quantize.cpp quantize_mx() (amax, shared exponent, per-element encode,
//                  the fp4 packing, the counters); quantize_nvfp4 the same for quantize_nvfp4();
// - product_entry: src/gemm.cpp generic_entry() (exact, fp32-block, fp32-group:G) and the fp32-seq
//                  definition (one fmaf per product in ascending K); plain_product_entry the same
//                  for unscaled (fp32 / bf16) operands;
// - reference_entry: the exact sum of the fp32 products rounded once (long accumulator), or the
//                  IEEE fp64 sum for rows with inf or NaN (src/reference.cpp).
//
// tests/test_gpu_host_reference.cpp checks every function here against the library itself (CPU
// CI), and the GPU test checks the GPU against these functions: together, GPU == library.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <thread>
#include <utility>
#include <vector>

#include "mxscope/core/accumulate.hpp"
#include "mxscope/core/exact_sum.hpp"
#include "mxscope/core/hadamard.hpp"
#include "mxscope/core/mx.hpp"
#include "mxscope/core/philox.hpp"
#include "mxscope/gemm.hpp"
#include "mxscope/quantize.hpp"
#include "mxscope/tensor.hpp"

namespace host_reference {

using mxscope::matrix;
using mxscope::matrix64;
namespace core = mxscope::core;

// Runs body(begin, end) over [0, count) on the machine's threads (results never depend on the split:
// every index is computed by one thread in a fixed order).
template <class Body>
void parallel_for(std::int64_t count, Body&& body) {
  const std::int64_t threads =
      std::clamp<std::int64_t>(static_cast<std::int64_t>(std::thread::hardware_concurrency()), 1, 32);
  if (count < 64 || threads == 1) {
    body(std::int64_t{0}, count);
    return;
  }
  const std::int64_t step = (count + threads - 1) / threads;
  std::vector<std::thread> pool;
  for (std::int64_t begin = 0; begin < count; begin += step) {
    pool.emplace_back([&body, begin, step, count] { body(begin, std::min(count, begin + step)); });
  }
  for (auto& thread : pool) thread.join();
}

inline bool finite(float value) { return (core::float_bits(value) & 0x7f800000U) != 0x7f800000U; }

// ------------------------------------------------------------------------------------------------
// Rotation.

inline std::vector<float> sign_vector(std::int64_t length, const mxscope::rotation_options& options) {
  std::vector<float> signs(static_cast<std::size_t>(length), 1.0f);
  if (options.signs == mxscope::sign_policy::none) return signs;
  const core::random_stream stream{
      options.seed,
      core::policy_step(
          options.signs == mxscope::sign_policy::fixed ? core::seed_policy::fixed : core::seed_policy::per_step,
          options.step),
      core::stream_tag(options.layer_hash, core::random_role::signs)};
  for (std::int64_t k = 0; k < length; ++k) {
    signs[static_cast<std::size_t>(k)] = core::sign_from_word(stream.word(static_cast<std::uint64_t>(k)));
  }
  return signs;
}

// In place along `axis`; the size must be valid for the axis length (the caller checks).
inline void rotate(matrix& values, int axis, const mxscope::rotation_options& options) {
  if (options.size == 0) return;
  const std::int64_t length = axis == 1 ? values.cols : values.rows;
  const std::int64_t lines = axis == 1 ? values.rows : values.cols;
  const std::vector<float> signs = host_reference::sign_vector(length, options);
  const bool use_signs = options.signs != mxscope::sign_policy::none;
  parallel_for(lines, [&](std::int64_t first, std::int64_t last) {
    std::vector<float> segment(static_cast<std::size_t>(options.size));
    for (std::int64_t line = first; line < last; ++line) {
      for (std::int64_t begin = 0; begin < length; begin += options.size) {
        for (int i = 0; i < options.size; ++i) {
          segment[static_cast<std::size_t>(i)] = axis == 1 ? values(line, begin + i) : values(begin + i, line);
        }
        core::rotate_segment(segment.data(), options.size, use_signs ? signs.data() + begin : nullptr);
        for (int i = 0; i < options.size; ++i) {
          (axis == 1 ? values(line, begin + i) : values(begin + i, line)) = segment[static_cast<std::size_t>(i)];
        }
      }
    }
  });
}

// ------------------------------------------------------------------------------------------------
// MX quantization.

inline int resolved_block(const mxscope::quantize_options& options) {
  return options.block > 0 ? options.block : (options.format.default_block > 0 ? options.format.default_block : 32);
}

inline mxscope::quantized_tensor quantize_mx(const matrix& input, const mxscope::quantize_options& options) {
  using core::element_kind;
  mxscope::quantized_tensor out;
  const element_kind kind = options.format.element;
  const bool packed = core::spec(kind).bits == 4;
  out.rows = input.rows;
  out.cols = input.cols;
  out.options = options;
  out.block = resolved_block(options);
  const int block = out.block;
  const bool along_rows = options.axis == 1;
  const std::int64_t lines = along_rows ? input.rows : input.cols;
  const std::int64_t length = along_rows ? input.cols : input.rows;
  const std::int64_t blocks_per_line = (length + block - 1) / block;
  const std::int64_t row_bytes = packed ? (input.cols + 1) / 2 : input.cols;
  out.scale_rows = along_rows ? input.rows : blocks_per_line;
  out.scale_cols = along_rows ? blocks_per_line : input.cols;
  out.codes.assign(static_cast<std::size_t>(input.rows * row_bytes), 0);
  out.scales.assign(static_cast<std::size_t>(out.scale_rows * out.scale_cols), 0);
  out.dequantized = matrix(input.rows, input.cols);
  const bool stochastic = options.rounding == core::rounding_mode::sr;

  const auto store_code = [&](std::int64_t r, std::int64_t c, std::uint8_t code) {
    if (packed) {
      std::uint8_t& byte = out.codes[static_cast<std::size_t>(r * row_bytes + c / 2)];
      byte = c % 2 == 0 ? static_cast<std::uint8_t>((byte & 0xF0U) | (code & 0x0FU))
                        : static_cast<std::uint8_t>((byte & 0x0FU) | ((code & 0x0FU) << 4));
    } else {
      out.codes[static_cast<std::size_t>(r * input.cols + c)] = code;
    }
  };

  // Lines are independent; for fp4 along axis 0 two neighbouring columns share code bytes, so the
  // split is over pairs of lines.
  const std::int64_t pairs = (lines + 1) / 2;
  std::vector<std::int64_t> partial(static_cast<std::size_t>(pairs) * 4, 0);
  parallel_for(pairs, [&](std::int64_t first_pair, std::int64_t last_pair) {
    for (std::int64_t pair = first_pair; pair < last_pair; ++pair) {
      std::int64_t* counts = partial.data() + pair * 4;  // nonzero, flushed, saturated, nonfinite
      for (std::int64_t line = 2 * pair; line < std::min(lines, 2 * pair + 2); ++line) {
        for (std::int64_t b = 0; b < blocks_per_line; ++b) {
          const std::int64_t begin = b * block;
          const int count = static_cast<int>(std::min<std::int64_t>(block, length - begin));
          const auto at = [&](int i) { return along_rows ? std::pair{line, begin + i} : std::pair{begin + i, line}; };
          float amax = 0.0f;
          bool nonfinite = false;
          for (int i = 0; i < count; ++i) {
            const auto [r, c] = at(i);
            const float v = input(r, c);
            if (!finite(v)) {
              nonfinite = true;
              ++counts[3];
            } else {
              amax = std::max(amax, std::fabs(v));
            }
            if (v != 0.0f) ++counts[0];
          }
          const std::size_t scale_index = along_rows ? static_cast<std::size_t>(line * blocks_per_line + b)
                                                     : static_cast<std::size_t>(b * lines + line);
          if (nonfinite) {
            out.scales[scale_index] = core::scale_nan_code;
            for (int i = 0; i < count; ++i) {
              const auto [r, c] = at(i);
              store_code(r, c, 0);
              out.dequantized(r, c) = std::numeric_limits<float>::quiet_NaN();
            }
            continue;
          }
          const int exponent = core::shared_exponent(kind, options.rule, amax);
          out.scales[scale_index] = core::scale_code(exponent);
          for (int i = 0; i < count; ++i) {
            const auto [r, c] = at(i);
            const std::uint32_t word =
                stochastic ? options.stream.word(static_cast<std::uint64_t>(r * input.cols + c)) : 0U;
            const auto encoded =
                core::quantize_element(kind, input(r, c), exponent, options.rounding, word, options.sr_bits);
            store_code(r, c, encoded.code);
            out.dequantized(r, c) = static_cast<float>(core::dequantize_element(kind, encoded.code, exponent));
            counts[1] += encoded.flushed;
            counts[2] += encoded.saturated;
          }
        }
      }
    }
  });
  // Axis 1 with fp4: rows are the lines and never share bytes. Axis 0 with fp4: lines 2p and 2p+1
  // share bytes and are handled by one thread above.
  for (std::int64_t pair = 0; pair < pairs; ++pair) {
    out.nonzero_inputs += partial[static_cast<std::size_t>(pair * 4)];
    out.flushed += partial[static_cast<std::size_t>(pair * 4 + 1)];
    out.saturated += partial[static_cast<std::size_t>(pair * 4 + 2)];
    out.nonfinite_inputs += partial[static_cast<std::size_t>(pair * 4 + 3)];
  }
  return out;
}

// ------------------------------------------------------------------------------------------------
// Emulated GEMM entries (MX operands, C = A B^T with each operand's reduction axis = its axis).

struct operand_reader {
  const mxscope::quantized_tensor* q;
  std::int64_t rows;   // canonical rows (M or N side)
  std::int64_t depth;  // reduction length

  explicit operand_reader(const mxscope::quantized_tensor& tensor)
      : q(&tensor),
        rows(tensor.options.axis == 1 ? tensor.rows : tensor.cols),
        depth(tensor.options.axis == 1 ? tensor.cols : tensor.rows) {}

  std::pair<std::int64_t, std::int64_t> stored(std::int64_t row, std::int64_t k) const {
    return q->options.axis == 1 ? std::pair{row, k} : std::pair{k, row};
  }
  std::uint32_t code(std::int64_t row, std::int64_t k) const {
    const auto [r, c] = stored(row, k);
    if (core::spec(q->options.format.element).bits == 4) {
      const std::uint8_t byte = q->codes[static_cast<std::size_t>(r * ((q->cols + 1) / 2) + c / 2)];
      return c % 2 == 0 ? (byte & 0x0FU) : (byte >> 4);
    }
    return q->codes[static_cast<std::size_t>(r * q->cols + c)];
  }
  std::uint8_t scale(std::int64_t row, std::int64_t k) const {
    const auto [r, c] = stored(row, k);
    return q->options.axis == 1 ? q->scales[static_cast<std::size_t>(r * q->scale_cols + c / q->block)]
                                : q->scales[static_cast<std::size_t>((r / q->block) * q->scale_cols + c)];
  }
  // The block-scaled element, exact in a double (NaN for a NaN block).
  double scaled(std::int64_t row, std::int64_t k) const {
    const std::uint8_t s = scale(row, k);
    const double block_scale =
        s == core::scale_nan_code ? std::numeric_limits<double>::quiet_NaN() : core::pow2(core::scale_exponent(s));
    return core::decode(q->options.format.element, code(row, k)) * block_scale;
  }
  float dequantized(std::int64_t row, std::int64_t k) const {
    const auto [r, c] = stored(row, k);
    return q->dequantized(r, c);
  }
};

struct entry_value {
  float value;
  double exact;  // the exact model only
};

// src/quantize.cpp quantize_nvfp4(), TransformerEngine's recipe written out in its fp32 operation
// order with the core's ue4m3 and e2m1 conversions (docs/numerics.md "NVFP4"): S_enc from the
// finite amax, then per tile (1 x 16, 16 x 1 or 16 x 16) the ue4m3 decode scale, the fp32 encode
// scale and each element; NaN scale code, zero codes and NaN values for a tile with inf or NaN.
inline mxscope::quantized_tensor quantize_nvfp4(const matrix& input, const mxscope::quantize_options& options) {
  using core::element_kind;
  constexpr float float_max = std::numeric_limits<float>::max();
  mxscope::quantized_tensor out;
  out.rows = input.rows;
  out.cols = input.cols;
  out.options = options;
  out.block = resolved_block(options);
  const std::int64_t tile_rows = options.nvfp4_2d ? 16 : (options.axis == 0 ? 16 : 1);
  const std::int64_t tile_cols = options.nvfp4_2d ? 16 : (options.axis == 1 ? 16 : 1);
  out.scale_rows = (input.rows + tile_rows - 1) / tile_rows;
  out.scale_cols = (input.cols + tile_cols - 1) / tile_cols;
  const std::int64_t row_bytes = (input.cols + 1) / 2;
  out.codes.assign(static_cast<std::size_t>(input.rows * row_bytes), 0);
  out.scales.assign(static_cast<std::size_t>(out.scale_rows * out.scale_cols), 0);
  out.dequantized = matrix(input.rows, input.cols);
  float amax = 0.0f;
  for (const float v : input.values) {
    if (finite(v)) amax = std::max(amax, std::fabs(v));
  }
  float global_encode = std::min(448.0f * 6.0f / amax, float_max);
  if (amax == 0.0f || global_encode == 0.0f || std::isnan(global_encode)) global_encode = 1.0f;
  const float global_decode = 1.0f / global_encode;
  out.tensor_scale = global_decode;
  const float sixth = 1.0f / 6.0f;
  for (std::int64_t tr = 0; tr < out.scale_rows; ++tr) {
    for (std::int64_t tc = 0; tc < out.scale_cols; ++tc) {
      const std::int64_t r1 = std::min(input.rows, (tr + 1) * tile_rows);
      const std::int64_t c1 = std::min(input.cols, (tc + 1) * tile_cols);
      float tile_amax = 0.0f;
      bool nonfinite = false;
      for (std::int64_t r = tr * tile_rows; r < r1; ++r) {
        for (std::int64_t c = tc * tile_cols; c < c1; ++c) {
          const float v = input(r, c);
          out.nonzero_inputs += v != 0.0f;
          if (!finite(v)) {
            nonfinite = true;
            ++out.nonfinite_inputs;
          } else {
            tile_amax = std::max(tile_amax, std::fabs(v));
          }
        }
      }
      std::uint8_t& scale = out.scales[static_cast<std::size_t>(tr * out.scale_cols + tc)];
      float tile_decode = 0.0f, tile_encode = 0.0f;
      if (nonfinite) {
        scale = static_cast<std::uint8_t>(core::nan_code(element_kind::ue4m3));
      } else {
        scale = core::encode(element_kind::ue4m3, std::min(tile_amax * (global_encode * sixth), float_max)).code;
        tile_decode = static_cast<float>(core::decode(element_kind::ue4m3, scale));
        tile_encode = std::min(1.0f / (tile_decode * global_decode), float_max);
      }
      for (std::int64_t r = tr * tile_rows; r < r1; ++r) {
        for (std::int64_t c = tc * tile_cols; c < c1; ++c) {
          std::uint8_t code = 0;
          if (nonfinite) {
            out.dequantized(r, c) = std::numeric_limits<float>::quiet_NaN();
          } else {
            const std::uint32_t word = options.rounding == core::rounding_mode::sr
                                           ? options.stream.word(static_cast<std::uint64_t>(r * input.cols + c))
                                           : 0U;
            const float scaled = input(r, c) * tile_encode;
            const auto encoded = core::encode(element_kind::fp4_e2m1, static_cast<double>(scaled), options.rounding,
                                              word, options.sr_bits);
            code = encoded.code;
            const float value = (static_cast<float>(core::decode(element_kind::fp4_e2m1, code)) * tile_decode) *
                                global_decode;
            out.dequantized(r, c) = value;
            out.flushed += encoded.flushed || (input(r, c) != 0.0f && value == 0.0f);
            out.saturated += encoded.saturated;
          }
          std::uint8_t& byte = out.codes[static_cast<std::size_t>(r * row_bytes + c / 2)];
          byte = c % 2 == 0 ? static_cast<std::uint8_t>((byte & 0xF0U) | (code & 0x0FU))
                            : static_cast<std::uint8_t>((byte & 0x0FU) | ((code & 0x0FU) << 4));
        }
      }
    }
  }
  return out;
}

inline float round_output(float value, mxscope::output_rounding output) {
  if (output == mxscope::output_rounding::fp32) return value;
  return core::bf16_to_float(core::float_to_bf16(value, core::rounding_mode::rne));
}

// fp32-block / fp32-group: for each group of `group_length` products in ascending K (product(k) an
// exact double), acc = fl32(acc + the group's exact sum); a non-finite product or accumulator takes
// the IEEE sum instead (src/gemm.cpp generic_entry).
template <class Product>
float grouped_accumulation(std::int64_t depth, std::int64_t group_length, Product&& product) {
  float accumulator = 0.0f;
  std::vector<double> products;
  for (std::int64_t begin = 0; begin < depth; begin += group_length) {
    const std::int64_t end = std::min(depth, begin + group_length);
    products.clear();
    double nonfinite_sum = 0.0;
    bool nonfinite = false;
    for (std::int64_t k = begin; k < end; ++k) {
      const double value = product(k);
      if (!std::isfinite(value)) {
        nonfinite = true;
        nonfinite_sum += value;
      }
      products.push_back(value);
    }
    if (nonfinite || !std::isfinite(accumulator)) {
      accumulator = static_cast<float>(static_cast<double>(accumulator) + nonfinite_sum);
      continue;
    }
    accumulator = core::add_exactly_to_float(accumulator, products.data(), static_cast<int>(products.size()));
  }
  return accumulator;
}

// One entry of the emulated product, by the definition (src/gemm.cpp generic_entry).
inline entry_value product_entry(const operand_reader& a, const operand_reader& b, std::int64_t i, std::int64_t j,
                                 const mxscope::accumulation_model& model, mxscope::output_rounding output) {
  using mxscope::accumulation_kind;
  const std::int64_t depth = a.depth;
  if (model.kind == accumulation_kind::fp32_seq) {
    float accumulator = 0.0f;
    for (std::int64_t k = 0; k < depth; ++k)
      accumulator = std::fmaf(a.dequantized(i, k), b.dequantized(j, k), accumulator);
    return {round_output(accumulator, output), 0.0};
  }
  if (model.kind == accumulation_kind::exact) {
    core::long_accumulator total;
    double nonfinite_sum = 0.0;
    bool nonfinite = false;
    for (std::int64_t k = 0; k < depth; ++k) {
      const double product = a.scaled(i, k) * b.scaled(j, k);
      if (!std::isfinite(product)) {
        nonfinite = true;
        nonfinite_sum += product;
      } else {
        total.add(product);
      }
    }
    if (nonfinite) return {round_output(static_cast<float>(nonfinite_sum), output), nonfinite_sum};
    return {round_output(total.round_to_float(), output), total.round_to_double()};
  }
  const std::int64_t group = model.kind == accumulation_kind::fp32_group ? model.blocks_per_group : 1;
  const float accumulator = grouped_accumulation(depth, static_cast<std::int64_t>(a.q->block) * group,
                                                 [&](std::int64_t k) { return a.scaled(i, k) * b.scaled(j, k); });
  return {round_output(accumulator * 1.0f, output), 0.0};
}

// One entry of the product of unscaled operands A [m, k] and B [n, k] (fp32 values, bf16 ones as
// their fp32 values; every block scale 1) under fp32-block, fp32-group:G or fp32-seq with K-blocks of
// `block`: product_entry's definition on the plain values (src/gemm.cpp generic_entry).
inline float plain_product_entry(const matrix& a, const matrix& b, std::int64_t i, std::int64_t j, int block,
                                 const mxscope::accumulation_model& model, mxscope::output_rounding output) {
  using mxscope::accumulation_kind;
  const std::int64_t depth = a.cols;
  if (model.kind == accumulation_kind::fp32_seq) {
    float accumulator = 0.0f;
    for (std::int64_t k = 0; k < depth; ++k) accumulator = std::fmaf(a(i, k), b(j, k), accumulator);
    return round_output(accumulator, output);
  }
  const std::int64_t group = model.kind == accumulation_kind::fp32_group ? model.blocks_per_group : 1;
  const float accumulator =
      grouped_accumulation(depth, static_cast<std::int64_t>(block) * group,
                           [&](std::int64_t k) { return static_cast<double>(a(i, k)) * static_cast<double>(b(j, k)); });
  return round_output(accumulator * 1.0f, output);
}

// Every entry (or the listed (i, j) entries, in that order, as a 1 x count result).
inline mxscope::product_result product(const mxscope::quantized_tensor& qa, const mxscope::quantized_tensor& qb,
                                       const mxscope::accumulation_model& model, mxscope::output_rounding output) {
  const operand_reader a(qa), b(qb);
  mxscope::product_result result;
  result.out = matrix(a.rows, b.rows);
  const bool exact = model.kind == mxscope::accumulation_kind::exact;
  if (exact) result.exact = matrix64(a.rows, b.rows);
  parallel_for(a.rows, [&](std::int64_t first, std::int64_t last) {
    for (std::int64_t i = first; i < last; ++i) {
      for (std::int64_t j = 0; j < b.rows; ++j) {
        const entry_value value = product_entry(a, b, i, j, model, output);
        result.out(i, j) = value.value;
        if (exact) result.exact(i, j) = value.exact;
      }
    }
  });
  return result;
}

// ------------------------------------------------------------------------------------------------
// Exact reference of fp32 operands A [m, k], B [n, k].

struct reference_value {
  double fp64;
  float fp32;
};

inline reference_value reference_entry(const matrix& a, const matrix& b, std::int64_t i, std::int64_t j) {
  const float* a_row = a.data() + i * a.cols;
  const float* b_row = b.data() + j * b.cols;
  bool nonfinite = false;
  for (std::int64_t k = 0; k < a.cols; ++k) nonfinite = nonfinite || !finite(a_row[k]);
  for (std::int64_t k = 0; k < b.cols; ++k) nonfinite = nonfinite || !finite(b_row[k]);
  if (nonfinite) {
    double sum = 0.0;
    for (std::int64_t k = 0; k < a.cols; ++k) sum += static_cast<double>(a_row[k]) * static_cast<double>(b_row[k]);
    return {sum, static_cast<float>(sum)};
  }
  core::long_accumulator total;
  for (std::int64_t k = 0; k < a.cols; ++k) total.add_product(a_row[k], b_row[k]);
  return {total.round_to_double(), total.round_to_float()};
}

}  // namespace host_reference
