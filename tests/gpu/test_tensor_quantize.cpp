// gpu::quantize_tensor_on_device and its bf16 operands against a reference built from the core's
// per-element functions (docs/numerics.md sections 2 to 4): codes, scales, dequantized values,
// operands and counters, for every MX element format along both axes (axis 0 takes the one-pass
// column kernel), both input types, nearest and stochastic rounding, odd shapes and blocks with
// NaN, infinity, zeros and outliers. Runs on the kernels' CPU simulation (ctest) and on a GPU.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "mxscope/core/mx.hpp"
#include "mxscope/core/operand.hpp"
#include "mxscope/core/philox.hpp"
#include "mxscope/gpu.hpp"

namespace {

namespace core = mxscope::core;
namespace gpu = mxscope::gpu;
using core::element_kind;

struct expected_tensor {
  std::vector<std::uint8_t> codes, scales;
  std::vector<std::uint32_t> dequantized;  // fp32 bit patterns
  std::vector<std::uint16_t> operand;
  unsigned long long counts[4] = {0, 0, 0, 0};  // nonzero, flushed, saturated, nonfinite
};

std::uint32_t bits(float value) {
  std::uint32_t out;
  std::memcpy(&out, &value, 4);
  return out;
}

// The definition, element by element: amax over the block's finite inputs, the scale rule, then
// core::quantize_element with the element's Philox word.
expected_tensor reference(const std::vector<float>& v, std::int64_t rows, std::int64_t cols,
                          const mxscope::quantize_options& options) {
  const element_kind kind = options.format.element;
  const int block = options.block;
  const bool packed = core::spec(kind).bits == 4;
  const std::int64_t row_bytes = packed ? (cols + 1) / 2 : cols;
  const std::int64_t scale_rows = options.axis == 1 ? rows : (rows + block - 1) / block;
  const std::int64_t scale_cols = options.axis == 1 ? (cols + block - 1) / block : cols;
  expected_tensor out;
  out.codes.assign(static_cast<std::size_t>(rows * row_bytes), 0);
  out.scales.assign(static_cast<std::size_t>(scale_rows * scale_cols), 0);
  out.dequantized.assign(static_cast<std::size_t>(rows * cols), 0);
  out.operand.assign(static_cast<std::size_t>(rows * cols), 0);
  for (std::int64_t sr = 0; sr < scale_rows; ++sr) {
    for (std::int64_t sc = 0; sc < scale_cols; ++sc) {
      std::vector<std::int64_t> members;
      for (std::int64_t i = 0; i < block; ++i) {
        const std::int64_t r = options.axis == 1 ? sr : sr * block + i;
        const std::int64_t c = options.axis == 1 ? sc * block + i : sc;
        if (r < rows && c < cols) members.push_back(r * cols + c);
      }
      float amax = 0.0f;
      bool finite = true;
      for (const std::int64_t n : members) {
        finite = finite && std::isfinite(v[n]);
        if (std::isfinite(v[n])) amax = std::max(amax, std::fabs(v[n]));
      }
      const std::uint8_t scale =
          finite ? core::scale_code(core::shared_exponent(kind, options.rule, amax)) : core::scale_nan_code;
      out.scales[static_cast<std::size_t>(sr * scale_cols + sc)] = scale;
      for (const std::int64_t n : members) {
        const std::int64_t r = n / cols, c = n % cols;
        out.counts[0] += v[n] != 0.0f;
        out.counts[3] += !std::isfinite(v[n]);
        std::uint32_t code = 0;
        float value = std::nanf("");
        if (finite) {
          const std::uint32_t word =
              options.rounding == core::rounding_mode::sr ? options.stream.word(static_cast<std::uint64_t>(n)) : 0U;
          const core::encoded e =
              core::quantize_element(kind, v[n], core::scale_exponent(scale), options.rounding, word, options.sr_bits);
          code = e.code;
          value = static_cast<float>(core::dequantize_element(kind, code, core::scale_exponent(scale)));
          out.counts[1] += e.flushed;
          out.counts[2] += e.saturated;
        }
        out.dequantized[static_cast<std::size_t>(n)] = finite ? bits(value) : 0x7FC00000U;
        out.operand[static_cast<std::size_t>(n)] = core::operand_bf16(kind, core::operand_scaling::mx, code, scale);
        std::uint8_t& byte = out.codes[static_cast<std::size_t>(r * row_bytes + (packed ? c / 2 : c))];
        byte = static_cast<std::uint8_t>(packed ? byte | ((code & 0xFU) << (4 * (c & 1))) : code);
      }
    }
  }
  return out;
}

std::vector<float> inputs(std::int64_t rows, std::int64_t cols, unsigned seed, bool specials) {
  std::mt19937 random(seed);
  std::normal_distribution<float> normal;
  std::uniform_int_distribution<int> binade(-20, 8);
  std::vector<float> v(static_cast<std::size_t>(rows * cols));
  for (std::int64_t r = 0; r < rows; ++r) {
    const float row_scale = std::ldexp(1.0f, binade(random));
    for (std::int64_t c = 0; c < cols; ++c) v[r * cols + c] = normal(random) * row_scale;
  }
  for (std::size_t i = 0; i < v.size(); i += 7) v[i] = 0.0f;
  v[1] = 6.0f * 1024.0f;  // an outlier that makes its block's small values flush
  if (specials && v.size() > 200) {
    v[40] = std::nanf("");
    v[150] = -INFINITY;
  }
  return v;
}

std::vector<std::uint16_t> as_bf16(std::vector<float>& v) {  // rounds v to bf16 in place
  std::vector<std::uint16_t> out(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) {
    out[i] = core::float_to_bf16(v[i]);
    v[i] = core::bf16_to_float(out[i]);
  }
  return out;
}

struct case_description {
  element_kind kind;
  int axis;
  core::rounding_mode rounding;
  int sr_bits;
  bool bf16_input;
  std::int64_t rows, cols;
  int block;
  bool dequantized = true;  // also ask for the fp32 values (without: the paths a training layer takes)
};

void check(const case_description& k) {
  SCOPED_TRACE(::testing::Message() << "kind " << static_cast<int>(k.kind) << " axis " << k.axis << " rounding "
                                    << static_cast<int>(k.rounding) << " sr_bits " << k.sr_bits << " bf16 "
                                    << k.bf16_input << " shape " << k.rows << "x" << k.cols << " block " << k.block);
  mxscope::quantize_options options;
  options.format = {mxscope::quant_scheme::mx, k.kind, 32};
  options.block = k.block;
  options.axis = k.axis;
  options.rounding = k.rounding;
  options.sr_bits = k.sr_bits;
  options.stream = core::random_stream{0x1234567890ULL, 17, 0xABCDU};
  std::vector<float> values = inputs(k.rows, k.cols, static_cast<unsigned>(k.rows * 31 + k.cols), true);
  const std::vector<std::uint16_t> halves = as_bf16(values);
  if (!k.bf16_input) values = inputs(k.rows, k.cols, static_cast<unsigned>(k.rows * 31 + k.cols), true);
  const expected_tensor want = reference(values, k.rows, k.cols, options);

  const std::size_t count = values.size();
  gpu::device_buffer input(count * (k.bf16_input ? 2 : 4));
  input.upload(k.bf16_input ? static_cast<const void*>(halves.data()) : values.data(), input.bytes());
  gpu::device_buffer codes(want.codes.size()), scales(want.scales.size()), dequantized(count * 4),
      operand(count * 2), counters(32);
  codes.fill_bytes(0xA5);
  dequantized.fill_bytes(0xA5);
  operand.fill_bytes(0xA5);
  counters.fill_bytes(0);
  gpu::tensor_device_output output;
  output.codes = codes.as<std::uint8_t>();
  output.scales = scales.as<std::uint8_t>();
  output.dequantized = k.dequantized ? dequantized.as<float>() : nullptr;
  output.operand_bf16 = operand.as<std::uint16_t>();
  output.counters = counters.as<unsigned long long>();
  const float scale = gpu::quantize_tensor_on_device(input.get(), k.bf16_input ? gpu::input_format::bf16
                                                                                : gpu::input_format::fp32,
                                                     k.rows, k.cols, options, {}, output);
  gpu::synchronize();
  EXPECT_EQ(scale, 1.0f);
  std::vector<std::uint8_t> got_codes(want.codes.size()), got_scales(want.scales.size());
  std::vector<std::uint32_t> got_values(count);
  std::vector<std::uint16_t> got_operand(count);
  unsigned long long got_counts[4];
  codes.download(got_codes.data(), got_codes.size());
  scales.download(got_scales.data(), got_scales.size());
  dequantized.download(got_values.data(), count * 4);
  operand.download(got_operand.data(), count * 2);
  counters.download(got_counts, sizeof(got_counts));
  EXPECT_EQ(got_scales, want.scales);
  EXPECT_EQ(got_codes, want.codes);
  if (k.dequantized) {
    EXPECT_EQ(got_values, want.dequantized);
  }
  EXPECT_EQ(got_operand, want.operand);
  for (int c = 0; c < 4; ++c) EXPECT_EQ(got_counts[c], want.counts[c]) << "counter " << c;
}

TEST(TensorQuantize, MxMatchesTheCoreOnBothAxes) {
  const element_kind kinds[] = {element_kind::fp4_e2m1, element_kind::fp6_e2m3, element_kind::fp6_e3m2,
                                element_kind::fp8_e4m3, element_kind::fp8_e5m2, element_kind::int8};
  const std::int64_t shapes[][2] = {{64, 96}, {70, 46}, {45, 33}, {33, 64}};
  for (const element_kind kind : kinds) {
    for (const int axis : {0, 1}) {
      for (const auto& shape : shapes) {
        check({kind, axis, core::rounding_mode::rne, 32, true, shape[0], shape[1], 32});
        check({kind, axis, core::rounding_mode::sr, 32, false, shape[0], shape[1], 32});
      }
      check({kind, axis, core::rounding_mode::sr, 7, true, 64, 64, 16});
      // bf16 with stochastic rounding and blocks of 32, on shapes without tails
      check({kind, axis, core::rounding_mode::sr, 32, true, 96, 64, 32});
      check({kind, axis, core::rounding_mode::sr, 9, true, 64, 36, 32});
      check({kind, axis, core::rounding_mode::rtz, 32, false, 40, 36, 8});
    }
  }
}

// The operand alone, as MXLinear asks for it: the fused kernel (axis 1) and the column kernel
// (axis 0) write it themselves, in vectors where the shape allows (cols a multiple of 4) and element
// by element where it does not.
TEST(TensorQuantize, OperandWithoutDequantizedValues) {
  const element_kind kinds[] = {element_kind::fp4_e2m1, element_kind::fp8_e4m3, element_kind::fp6_e3m2,
                                element_kind::int8};
  for (const element_kind kind : kinds) {
    for (const int axis : {0, 1}) {
      for (const bool bf16 : {true, false}) {
        check({kind, axis, core::rounding_mode::rne, 32, bf16, 96, 64, 32, false});
        check({kind, axis, core::rounding_mode::sr, 32, bf16, 64, 128, 32, false});
        check({kind, axis, core::rounding_mode::rne, 32, bf16, 45, 34, 32, false});
      }
    }
  }
}

// Every scheme's operand decodes the codes the quantizer wrote (core::operand_bf16), and the
// operand times the tensor scale is the dequantized value.
TEST(TensorQuantize, OperandsOfEveryScheme) {
  struct scheme_case {
    mxscope::format_choice format;
    int block;
  };
  const scheme_case cases[] = {{{mxscope::quant_scheme::nvfp4, element_kind::fp4_e2m1, 16}, 16},
                               {{mxscope::quant_scheme::per_tensor, element_kind::fp8_e4m3, 0}, 0},
                               {{mxscope::quant_scheme::per_tensor, element_kind::fp8_e5m2, 0}, 0},
                               {{mxscope::quant_scheme::bf16, element_kind::fp4_e2m1, 0}, 0}};
  for (const auto& c : cases) {
    for (const int axis : {0, 1}) {
      SCOPED_TRACE(::testing::Message() << "scheme " << static_cast<int>(c.format.scheme) << " axis " << axis);
      const std::int64_t rows = 48, cols = 64;
      std::vector<float> values = inputs(rows, cols, 5, false);
      mxscope::quantize_options options;
      options.format = c.format;
      options.block = c.block;
      options.axis = axis;
      const std::size_t count = values.size();
      const bool nvfp4 = c.format.scheme == mxscope::quant_scheme::nvfp4;
      const bool bf16 = c.format.scheme == mxscope::quant_scheme::bf16;
      const std::size_t code_bytes = nvfp4 ? count / 2 : (bf16 ? count * 2 : count);
      const std::size_t scale_bytes = nvfp4 ? count / 16 : 0;
      gpu::device_buffer input(count * 4), codes(code_bytes), scales(scale_bytes + 1), dequantized(count * 4),
          operand(count * 2);
      input.upload(values.data(), input.bytes());
      gpu::tensor_device_output output;
      output.codes = codes.as<std::uint8_t>();
      output.scales = scales.as<std::uint8_t>();
      output.dequantized = dequantized.as<float>();
      output.operand_bf16 = operand.as<std::uint16_t>();
      const float tensor_scale =
          gpu::quantize_tensor_on_device(input.get(), gpu::input_format::fp32, rows, cols, options, {}, output);
      gpu::synchronize();
      std::vector<std::uint8_t> got_codes(code_bytes), got_scales(scale_bytes);
      std::vector<float> got_values(count);
      std::vector<std::uint16_t> got_operand(count);
      codes.download(got_codes.data(), code_bytes);
      if (scale_bytes > 0) scales.download(got_scales.data(), scale_bytes);
      dequantized.download(got_values.data(), count * 4);
      operand.download(got_operand.data(), count * 2);
      int wrong_decode = 0, wrong_scale = 0;
      for (std::int64_t r = 0; r < rows; ++r) {
        for (std::int64_t col = 0; col < cols; ++col) {
          const std::size_t n = static_cast<std::size_t>(r * cols + col);
          std::uint16_t expected;
          if (bf16) {
            expected = static_cast<std::uint16_t>(got_codes[2 * n] | (got_codes[2 * n + 1] << 8));
          } else if (nvfp4) {
            const std::uint32_t code = (got_codes[n / 2] >> (4 * (col & 1))) & 0xFU;
            const std::size_t s = axis == 1 ? static_cast<std::size_t>(r * (cols / 16) + col / 16)
                                            : static_cast<std::size_t>((r / 16) * cols + col);
            expected = core::operand_bf16(element_kind::fp4_e2m1, core::operand_scaling::nvfp4, code, got_scales[s]);
          } else {
            expected = core::operand_bf16(c.format.element, core::operand_scaling::none, got_codes[n], 0);
          }
          wrong_decode += got_operand[n] != expected;
          const float scaled = core::bf16_to_float(got_operand[n]) * tensor_scale;
          wrong_scale += bits(scaled) != bits(got_values[n]);
        }
      }
      EXPECT_EQ(wrong_decode, 0);
      EXPECT_EQ(wrong_scale, 0);
    }
  }
}

}  // namespace
