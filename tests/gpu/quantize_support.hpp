// What the GPU test's quantizer suites share: one GPU quantization into poisoned buffers checked
// against the host definition.
#pragma once

#include "support.hpp"

namespace gpu_test {

// The GPU run of one quantization into poisoned buffers; returns the first mismatch or "". Without
// `with_dequantized` the kernels are asked for codes, scales and counters only (their leaner path).
inline std::string check_quantize_once(const matrix& input, bool bf16_input, const mxscope::quantize_options& options,
                                const mxscope::rotation_options& rotation, gpu::quantize_path path,
                                const mxscope::quantized_tensor& expected, int poison, bool with_dequantized) {
  const gpu::mx_plan plan = gpu::make_mx_plan(options);
  const gpu::rotation_plan rotation_plan = gpu::make_rotation_plan(rotation);
  const std::int64_t rows = input.rows, cols = input.cols;
  std::vector<std::uint16_t> bf16(static_cast<std::size_t>(input.size()));
  for (std::size_t i = 0; i < bf16.size(); ++i) bf16[i] = test_inputs::to_bf16_bits(input.values[i]);
  gpu::device_buffer source(bf16_input ? bf16.size() * 2 : input.values.size() * 4);
  source.upload(bf16_input ? static_cast<const void*>(bf16.data()) : static_cast<const void*>(input.data()),
                source.bytes());
  gpu::device_buffer codes(expected.codes.size()), scales(expected.scales.size());
  gpu::device_buffer dequantized(expected.dequantized.values.size() * 4), counters(4 * 8);
  codes.fill_bytes(poison);
  scales.fill_bytes(poison);
  dequantized.fill_bytes(poison);
  counters.fill_bytes(0);
  gpu::mx_device_output output{codes.as<std::uint8_t>(), scales.as<std::uint8_t>(),
                               with_dequantized ? dequantized.as<float>() : nullptr,
                               counters.as<unsigned long long>()};
  // The leaner request is the training layer's: codes, scales and the bf16 GEMM operand.
  gpu::device_buffer operand(with_dequantized ? 0 : static_cast<std::size_t>(rows * cols) * 2);
  if (!with_dequantized) {
    operand.fill_bytes(poison);
    output.operand_bf16 = operand.as<std::uint16_t>();
  }
  gpu::quantize_on_device(source.get(), bf16_input ? gpu::input_format::bf16 : gpu::input_format::fp32, rows, cols,
                          plan, rotation_plan, output, path);
  gpu::synchronize();
  std::vector<std::uint8_t> got_codes(expected.codes.size()), got_scales(expected.scales.size());
  matrix got_dequantized(rows, cols);
  unsigned long long got_counts[4] = {};
  codes.download(got_codes.data(), got_codes.size());
  scales.download(got_scales.data(), got_scales.size());
  dequantized.download(got_dequantized.data(), dequantized.bytes());
  counters.download(got_counts, sizeof(got_counts));

  const std::string policy = describe(options, rotation);
  const auto element_text = [&](std::int64_t r, std::int64_t c) {
    return "element (" + std::to_string(r) + ", " + std::to_string(c) + ") input " + show(input(r, c));
  };
  const std::int64_t row_bytes = gpu::mx_code_row_bytes(plan, cols);
  for (std::size_t i = 0; i < got_codes.size(); ++i) {
    if (got_codes[i] != expected.codes[i]) {
      const std::int64_t r = static_cast<std::int64_t>(i) / row_bytes;
      const std::int64_t byte = static_cast<std::int64_t>(i) % row_bytes;
      const std::int64_t c = row_bytes == cols ? byte : 2 * byte;
      return "code byte " + std::to_string(i) + " (" + element_text(r, c) + "): expected " + hex32(expected.codes[i]) +
             " got " + hex32(got_codes[i]) + " poison " + hex32(static_cast<std::uint32_t>(poison)) + "; " + policy;
    }
  }
  for (std::size_t i = 0; i < got_scales.size(); ++i) {
    if (got_scales[i] != expected.scales[i]) {
      return "scale " + std::to_string(i) + ": expected " + hex32(expected.scales[i]) + " got " + hex32(got_scales[i]) +
             " poison " + hex32(static_cast<std::uint32_t>(poison)) + "; " + policy;
    }
  }
  for (std::int64_t i = 0; with_dequantized && i < input.size(); ++i) {
    const float want = expected.dequantized.values[static_cast<std::size_t>(i)];
    const float got = got_dequantized.values[static_cast<std::size_t>(i)];
    if (!same(want, got)) {
      return "dequantized " + element_text(i / cols, i % cols) + ": expected " + show(want) + " got " + show(got) +
             " poison " + hex32(static_cast<std::uint32_t>(poison)) + "; " + policy;
    }
  }
  const std::int64_t want_counts[4] = {expected.nonzero_inputs, expected.flushed, expected.saturated,
                                       expected.nonfinite_inputs};
  const char* counter_names[4] = {"nonzero", "flushed", "saturated", "nonfinite"};
  for (int k = 0; k < 4; ++k) {
    if (static_cast<std::int64_t>(got_counts[k]) != want_counts[k]) {
      return std::string("counter ") + counter_names[k] + ": expected " + std::to_string(want_counts[k]) + " got " +
             std::to_string(got_counts[k]) + "; " + policy;
    }
  }
  if (!with_dequantized) {  // the operand: core::operand_bf16 of each expected code and its block's scale
    std::vector<std::uint16_t> got_operand(static_cast<std::size_t>(rows * cols));
    operand.download(got_operand.data(), operand.bytes());
    const bool packed = core::spec(plan.element).bits == 4;
    const std::int64_t scale_cols = gpu::mx_scale_cols(plan, rows, cols);
    for (std::int64_t r = 0; r < rows; ++r) {
      for (std::int64_t c = 0; c < cols; ++c) {
        const std::uint8_t byte = expected.codes[static_cast<std::size_t>(r * row_bytes + (packed ? c / 2 : c))];
        const std::uint32_t code = packed ? (byte >> (4 * (c & 1))) & 0x0FU : byte;
        const std::int64_t scale_index =
            plan.axis == 1 ? r * scale_cols + c / plan.block : (r / plan.block) * scale_cols + c;
        const std::uint16_t want = core::operand_bf16(plan.element, core::operand_scaling::mx, code,
                                                      expected.scales[static_cast<std::size_t>(scale_index)]);
        const std::uint16_t got = got_operand[static_cast<std::size_t>(r * cols + c)];
        if (got != want) {
          return "operand " + element_text(r, c) + ": expected " + hex32(want) + " got " + hex32(got) + " poison " +
                 hex32(static_cast<std::uint32_t>(poison)) + "; " + policy;
        }
      }
    }
  }
  return "";
}

inline std::string check_quantize(const matrix& input_in, bool bf16_input, const mxscope::quantize_options& options,
                           const mxscope::rotation_options& rotation, gpu::quantize_path path) {
  matrix input = input_in;
  if (bf16_input) {
    for (float& v : input.values) v = test_inputs::from_bf16_bits(test_inputs::to_bf16_bits(v));
  }
  matrix rotated = input;
  host_reference::rotate(rotated, options.axis, rotation);
  const mxscope::quantized_tensor expected = host_reference::quantize_mx(rotated, options);
  // Both poisons with the dequantized output, then the leaner request (codes, scales, counters).
  for (const auto& [poison, with_dequantized] :
       {std::pair{0xFF, true}, std::pair{0x00, true}, std::pair{0xFF, false}}) {
    const std::string problem =
        check_quantize_once(input, bf16_input, options, rotation, path, expected, poison, with_dequantized);
    if (!problem.empty()) return problem;
  }
  return "";
}

}  // namespace gpu_test
