// mxscope quantize: quantizes one tensor of a safetensors file under one strategy and writes the
// dequantized values, the codes and the scales (plus the recipe) to a new safetensors file.
#include <fmt/format.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <ostream>

#include "validators.hpp"
#include "commands.hpp"
#include "mxscope/errors.hpp"
#include "mxscope/io/atomic_file.hpp"
#include "mxscope/io/safetensors.hpp"
#include "../backend/backend.hpp"
#include "mxscope/device.hpp"

namespace mxscope::cli {

namespace {

struct quantize_command_options {
  std::string input;
  std::string tensor;
  std::string output;
  int axis = 1;
  std::string device = "cpu";
  strategy_flags strategy;
};

// Error statistics of the dequantized tensor against its (rotated) input, in fp64.
struct error_statistics {
  std::int64_t elements = 0;
  std::int64_t excluded = 0;  // non-finite input or output: left out of the norms below
  double input_norm_squared = 0.0;
  double error_norm_squared = 0.0;
  double max_abs_error = 0.0;
};

error_statistics measure(const matrix& input, const matrix& dequantized) {
  error_statistics stats;
  stats.elements = input.size();
  for (std::size_t i = 0; i < input.values.size(); ++i) {
    const double value = input.values[i];
    const double approximation = dequantized.values[i];
    if (!std::isfinite(value) || !std::isfinite(approximation)) {
      ++stats.excluded;
      continue;
    }
    const double error = approximation - value;
    stats.input_norm_squared += value * value;
    stats.error_norm_squared += error * error;
    stats.max_abs_error = std::max(stats.max_abs_error, std::fabs(error));
  }
  return stats;
}

std::vector<std::uint8_t> float_bytes(float value) {
  std::vector<std::uint8_t> bytes(4);
  std::memcpy(bytes.data(), &value, 4);
  return bytes;
}

std::string codes_layout(const quantize_options& options) {
  switch (options.format.scheme) {
    case quant_scheme::mx:
    case quant_scheme::nvfp4:
      if (core::spec(options.format.element).bits == 4) {
        return "fp4 e2m1 codes packed two per byte along each row, element 2i in the low nibble: [rows, ceil(cols/2)]";
      }
      return fmt::format("{} codes, one per byte: [rows, cols]", core::spec(options.format.element).name);
    case quant_scheme::per_tensor:
      return fmt::format("{} codes, one per byte: [rows, cols]", core::spec(options.format.element).name);
    case quant_scheme::bf16: return "bf16 bit patterns, little-endian byte pairs: [rows, 2*cols]";
    case quant_scheme::none: break;
  }
  return "none";
}

std::string scales_layout(const quantize_options& options) {
  switch (options.format.scheme) {
    case quant_scheme::mx:
      return options.axis == 1 ? "e8m0 block scale codes: [rows, ceil(cols/block)]"
                               : "e8m0 block scale codes: [ceil(rows/block), cols]";
    case quant_scheme::nvfp4:
      return options.axis == 1 ? "ue4m3 block scale codes: [rows, ceil(cols/16)]; tensor_scale: fp32 global decode scale"
                               : "ue4m3 block scale codes: [ceil(rows/16), cols]; tensor_scale: fp32 global decode scale";
    case quant_scheme::per_tensor: return "F32 [1]: the per-tensor scale (value = code value * scale)";
    case quant_scheme::bf16: return "F32 [1]: 1.0 (bf16 has no scale)";
    case quant_scheme::none: break;
  }
  return "none";
}

// Rotates `values` in place and quantizes them on the chosen device. The GPU computes the same bits
// (docs/gpu.md), so the output file does not say where it was made.
quantized_tensor rotate_and_quantize(matrix& values, const strategy& chosen, int axis, const std::string& device,
                                     const std::string& what) {
  if (device == "gpu") return backend::rotate_and_quantize(values, axis, chosen.rotation, chosen.quantize);
  rotate(values, axis, chosen.rotation, what);
  return quantize(values, chosen.quantize);
}

int run_quantize(const quantize_command_options& options, std::ostream& out) {
  // Every flag is checked before any file is touched.
  strategy chosen = resolve_strategy(options.strategy);
  if (options.axis != 0 && options.axis != 1) {
    throw input_error(fmt::format("--axis: must be 0 or 1, got {}", options.axis));
  }
  chosen.quantize.axis = options.axis;
  io::refuse_output_over_input(options.output, options.input, "--in");
  if (options.device != "cpu" && options.device != "gpu") {
    throw input_error(fmt::format("--device: must be cpu or gpu, got '{}'", options.device));
  }
  if (options.device == "gpu") {
    if (!backend::built_with_gpu()) {
      throw input_error(
          "--device gpu: this mxscope was built without the GPU backend (configure with MXSCOPE_ENABLE_CUDA=ON on a "
          "machine with nvcc, or MXSCOPE_ENABLE_HIP=ON for AMD GPUs, see docs/gpu.md); use --device cpu");
    }
    if (!backend::quantizes_alone(chosen.quantize)) {
      throw input_error(fmt::format("--device gpu: quantizes the MX formats and NVFP4 only, not '{}' (use --device cpu)",
                                    options.strategy.format));
    }
    if (gpu_count() == 0) {
      throw input_error("--device gpu: no usable GPU (no device or no driver) on this machine; use --device cpu");
    }
  }

  const io::safetensors_reader reader(options.input);
  const io::tensor_info& tensor = reader.at(options.tensor);
  const std::string tensor_what = fmt::format("{}: tensor '{}'", reader.label(), io::printable_name(tensor.name));
  matrix values = reader.read_matrix(tensor.name);
  if (values.size() == 0) {
    throw input_error(fmt::format("{}: field 'shape': has no elements ([{}, {}]); nothing to quantize", tensor_what,
                                  values.rows, values.cols));
  }
  check_rotation_fits(chosen, options.axis, values.rows, values.cols, tensor_what);

  const core::random_role role = role_for_tensor(tensor.name);
  chosen.quantize.stream = chosen.stream_for(role);
  validate(chosen.quantize, values.rows, values.cols, tensor_what);
  const quantized_tensor quantized = rotate_and_quantize(values, chosen, options.axis, options.device, tensor_what);
  const error_statistics stats = measure(values, quantized.dequantized);

  // Output tensors.
  io::safetensors_writer writer;
  const std::string& name = tensor.name;
  writer.add_matrix(name, quantized.dequantized);
  writer.add(name + ".codes", io::dtype::u8, {quantized.rows, quantized.code_row_bytes()}, quantized.codes);
  const quant_scheme scheme = chosen.quantize.format.scheme;
  if (scheme == quant_scheme::mx || scheme == quant_scheme::nvfp4) {
    writer.add(name + ".scales", io::dtype::u8, {quantized.scale_rows, quantized.scale_cols}, quantized.scales);
  } else {
    writer.add(name + ".scales", io::dtype::f32, {1}, float_bytes(quantized.tensor_scale));
  }
  if (scheme == quant_scheme::nvfp4) writer.add(name + ".tensor_scale", io::dtype::f32, {1}, float_bytes(quantized.tensor_scale));

  // The recipe: everything needed to reproduce the output bit for bit.
  const bool blocked = scheme == quant_scheme::mx || scheme == quant_scheme::nvfp4;
  writer.set_metadata("format", std::string(options.strategy.format));
  writer.set_metadata("block", std::to_string(blocked ? quantized.block : 0));
  writer.set_metadata("axis", std::to_string(options.axis));
  writer.set_metadata("rounding", std::string(rounding_name(chosen.quantize.rounding)));
  writer.set_metadata("scale_rule", std::string(scale_rule_name(chosen.quantize.rule)));
  writer.set_metadata("rotation", chosen.rotation_text);
  writer.set_metadata("signs", std::string(sign_policy_name(chosen.rotation.signs)));
  writer.set_metadata("seed", std::to_string(options.strategy.seed));
  writer.set_metadata("step", std::to_string(options.strategy.step));
  writer.set_metadata("sr_bits", std::to_string(chosen.quantize.sr_bits));
  writer.set_metadata("layer", chosen.layer);
  writer.set_metadata("seed_policy", options.strategy.seed_policy);
  writer.set_metadata("role", std::string(role_name(role)));
  writer.set_metadata("mxscope_version", version_text());
  writer.set_metadata("source_file", reader.label());
  writer.set_metadata("source_tensor", name);
  writer.set_metadata("source_dtype", std::string(io::dtype_name(tensor.type)));
  writer.set_metadata("codes_layout", codes_layout(chosen.quantize));
  writer.set_metadata("scales_layout", scales_layout(chosen.quantize));
  if (scheme == quant_scheme::nvfp4 || scheme == quant_scheme::per_tensor) {
    writer.set_metadata("tensor_scale", fmt::format("{}", quantized.tensor_scale));
  }
  writer.set_metadata(
      "basis", chosen.rotation.size == 0
                   ? std::string("input")
                   : fmt::format("rotated: '{}' holds deq(q(Q v)) with Q = {} (signs {}) along axis {}; apply the "
                                 "inverse rotation to return to the input basis",
                                 name, chosen.rotation_text, sign_policy_name(chosen.rotation.signs), options.axis));
  writer.write(options.output);

  const double flushed_fraction =
      quantized.nonzero_inputs > 0 ? static_cast<double>(quantized.flushed) / static_cast<double>(quantized.nonzero_inputs) : 0.0;
  const double infinity = std::numeric_limits<double>::infinity();
  // 0/0 counts as no error: an all-zero input quantizes exactly.
  const double relative_error = stats.input_norm_squared > 0.0
                                    ? std::sqrt(stats.error_norm_squared / stats.input_norm_squared)
                                    : (stats.error_norm_squared > 0.0 ? infinity : 0.0);
  const double snr_db = stats.error_norm_squared > 0.0
                            ? 10.0 * std::log10(stats.input_norm_squared / stats.error_norm_squared)
                            : infinity;

  out << fmt::format("quantized {} -> {} ({} {}, block {}, axis {}, {}, {}, rotation {})\n", tensor_what, options.output,
                     format_name(chosen.quantize.format), blocked ? "blocks" : "per tensor", blocked ? quantized.block : 0,
                     options.axis, rounding_name(chosen.quantize.rounding), scale_rule_name(chosen.quantize.rule),
                     chosen.rotation_text);
  out << fmt::format("{:<16} {}\n", "metric", "value");
  out << fmt::format("{:<16} {}\n", "elements", stats.elements);
  out << fmt::format("{:<16} {}\n", "nonzero", quantized.nonzero_inputs);
  out << fmt::format("{:<16} {}\n", "flushed", quantized.flushed);
  out << fmt::format("{:<16} {:.9g}\n", "flushed_frac", flushed_fraction);
  out << fmt::format("{:<16} {}\n", "saturated", quantized.saturated);
  out << fmt::format("{:<16} {}\n", "nonfinite", quantized.nonfinite_inputs);
  out << fmt::format("{:<16} {}\n", "excluded", stats.excluded);
  out << fmt::format("{:<16} {:.9g}\n", "rel_err", relative_error);
  out << fmt::format("{:<16} {:.6f}\n", "snr_db", snr_db);
  out << fmt::format("{:<16} {:.9g}\n", "max_abs_err", stats.max_abs_error);
  return 0;
}

}  // namespace

void add_quantize_command(CLI::App& app, command_list& commands) {
  auto options = std::make_shared<quantize_command_options>();
  CLI::App* sub = app.add_subcommand("quantize", "Quantize one tensor under one strategy; write dequantized values, "
                                                 "codes, scales and the recipe");
  sub->add_option("--in", options->input, "Input safetensors file")->required();
  sub->add_option("--tensor", options->tensor, "Name of the tensor to quantize")->required();
  sub->add_option("--axis", options->axis, "Quantization (block and rotation) axis: 0 or 1")
      ->check(digits_only())
      ->capture_default_str();
  sub->add_option("--device", options->device, "Where to rotate and quantize: cpu or gpu (MX formats; same bits)")
      ->capture_default_str();
  add_strategy_flags(*sub, options->strategy, /*format_required=*/true);
  sub->add_option("-o,--out", options->output, "Output safetensors file (written atomically)")->required();
  commands.push_back({sub, [options](std::ostream& out, std::ostream&) { return run_quantize(*options, out); }});
}

}  // namespace mxscope::cli
