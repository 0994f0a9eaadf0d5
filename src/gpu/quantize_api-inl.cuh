// Part of quantize.cu (included there, in order, inside namespace mxscope::gpu): the host functions
// of include/mxscope/gpu.hpp that rotate and quantize.
// ================================================================================================
// Host convenience functions.

matrix rotate(const matrix& values, int axis, const rotation_options& options) {
  const rotation_plan plan = make_rotation_plan(options);
  check_rotation(plan, values.rows, values.cols, axis, "gpu rotate");
  matrix out = values;
  if (plan.size == 0 || values.size() == 0) return out;
  device_buffer buffer = upload_vector(values.values);
  rotate_on_device(buffer.as<float>(), values.rows, values.cols, axis, plan);
  buffer.download(out.data(), buffer.bytes());
  return out;
}

namespace {

// The quantizer's four device counters into the host tensor.
void take_counters(const device_buffer& counters, quantized_tensor& out) {
  unsigned long long counts[mx_counter_count] = {};
  counters.download(counts, sizeof(counts));
  out.nonzero_inputs = static_cast<std::int64_t>(counts[counter_nonzero]);
  out.flushed = static_cast<std::int64_t>(counts[counter_flushed]);
  out.saturated = static_cast<std::int64_t>(counts[counter_saturated]);
  out.nonfinite_inputs = static_cast<std::int64_t>(counts[counter_nonfinite]);
}

}  // namespace

quantized_tensor quantize(const matrix& input, const quantize_options& options, const rotation_options& rotation,
                          quantize_path path) {
  if (options.format.scheme == quant_scheme::nvfp4) {
    // The NVFP4 kernels through quantize_with_energies (the energies are not wanted here).
    operand_energies unused;
    quantized_tensor out = quantize_with_energies(input, options, rotation, true, unused);
    out.device_codes.reset();
    out.device_scales.reset();
    return out;
  }
  const mx_plan plan = make_mx_plan(options);
  const rotation_plan rotation_resolved = make_rotation_plan(rotation);
  check_rotation(rotation_resolved, input.rows, input.cols, plan.axis, "gpu quantize");
  quantized_tensor out;
  out.rows = input.rows;
  out.cols = input.cols;
  out.options = options;
  out.block = plan.block;
  out.scale_rows = mx_scale_rows(plan, input.rows, input.cols);
  out.scale_cols = mx_scale_cols(plan, input.rows, input.cols);
  out.codes.assign(static_cast<std::size_t>(mx_code_bytes(plan, input.rows, input.cols)), 0);
  out.scales.assign(static_cast<std::size_t>(out.scale_rows * out.scale_cols), 0);
  out.dequantized = matrix(input.rows, input.cols);
  if (input.size() == 0) return out;
  const device_buffer source = upload_vector(input.values);
  device_buffer codes(out.codes.size());
  device_buffer scales(out.scales.size());
  device_buffer dequantized(out.dequantized.values.size() * sizeof(float));
  device_buffer counters(mx_counter_count * sizeof(unsigned long long));
  counters.fill_bytes(0);
  mx_device_output destination;
  destination.codes = codes.as<std::uint8_t>();
  destination.scales = scales.as<std::uint8_t>();
  destination.dequantized = dequantized.as<float>();
  destination.counters = counters.as<unsigned long long>();
  quantize_on_device(source.get(), input_format::fp32, input.rows, input.cols, plan, rotation_resolved, destination,
                     path);
  codes.download(out.codes.data(), out.codes.size());
  scales.download(out.scales.data(), out.scales.size());
  dequantized.download(out.dequantized.data(), dequantized.bytes());
  take_counters(counters, out);
  return out;
}

quantized_tensor quantize_with_energies(const matrix& input, const quantize_options& options,
                                        const rotation_options& rotation, bool keep_dequantized,
                                        operand_energies& energies, const device_matrix* resident,
                                        bool codes_on_device_only) {
  if (resident != nullptr && (resident->rows() != input.rows || resident->cols() != input.cols)) {
    throw std::logic_error("gpu quantize: the resident operand's shape differs from the host operand's");
  }
  const bool per_tensor = options.format.scheme == quant_scheme::per_tensor;
  const bool bf16 = options.format.scheme == quant_scheme::bf16;
  const bool nvfp4 = options.format.scheme == quant_scheme::nvfp4;
  const element_kind kind = options.format.element;
  if (per_tensor && kind != element_kind::fp8_e4m3 && kind != element_kind::fp8_e5m2) {
    throw input_error("gpu quantize: field 'format': per-tensor scaling takes fp8 e4m3 or e5m2 elements");
  }
  const std::optional<mx_plan> plan =
      per_tensor || bf16 || nvfp4 ? std::nullopt : std::optional<mx_plan>(make_mx_plan(options));
  const int axis = plan ? plan->axis : options.axis;
  const rotation_plan rotation_resolved = make_rotation_plan(rotation);
  check_rotation(rotation_resolved, input.rows, input.cols, axis, "gpu quantize");
  quantized_tensor out;
  out.rows = input.rows;
  out.cols = input.cols;
  out.options = options;
  std::size_t code_bytes = static_cast<std::size_t>(input.size());  // per-tensor fp8: one byte per element
  std::size_t scale_bytes = 0;
  if (plan) {
    out.block = plan->block;
    out.scale_rows = mx_scale_rows(*plan, input.rows, input.cols);
    out.scale_cols = mx_scale_cols(*plan, input.rows, input.cols);
    code_bytes = static_cast<std::size_t>(mx_code_bytes(*plan, input.rows, input.cols));
    scale_bytes = static_cast<std::size_t>(out.scale_rows * out.scale_cols);
  } else if (bf16) {
    out.block = options.block > 0 ? options.block : options.format.default_block;  // as quantize()
    code_bytes = static_cast<std::size_t>(input.size()) * 2;
  } else if (nvfp4) {
    const nvfp4_layout layout = nvfp4_layout_of(options, input.rows, input.cols);
    out.block = options.block > 0 ? options.block : options.format.default_block;  // as quantize()
    out.scale_rows = layout.grid_rows;
    out.scale_cols = layout.grid_cols;
    code_bytes = static_cast<std::size_t>(input.rows * ((input.cols + 1) / 2));
    scale_bytes = static_cast<std::size_t>(layout.grid_rows * layout.grid_cols);
  }
  if (!codes_on_device_only) {  // host vectors only where they are wanted (they are large)
    out.codes.resize(code_bytes);
    out.scales.resize(scale_bytes);
  }
  energies = {};
  if (keep_dequantized) out.dequantized = matrix(input.rows, input.cols);
  if (input.size() == 0) return out;
  // The operand on the device: the resident copy as it is, or a working copy the rotation changes.
  const std::int64_t count = input.size();
  device_buffer working;
  const float* operand = nullptr;
  if (resident != nullptr && rotation_resolved.size == 0) {
    operand = resident->fp32();
  } else {
    working = device_buffer(static_cast<std::size_t>(count) * sizeof(float));
    if (resident != nullptr) {
      copy_on_device(working.get(), resident->fp32(), working.bytes());
    } else {
      working.upload(input.data(), working.bytes());
    }
    if (rotation_resolved.size > 0) {
      rotate_on_device(working.as<float>(), input.rows, input.cols, axis, rotation_resolved);
    }
    operand = working.as<const float>();
  }
  auto codes_buffer = std::make_shared<device_buffer>(code_bytes);
  auto scales_buffer = std::make_shared<device_buffer>(scale_bytes);
  device_buffer& codes = *codes_buffer;
  device_buffer& scales = *scales_buffer;
  auto dequantized_matrix = std::make_shared<device_matrix>(input.rows, input.cols, device_matrix::element::fp32);
  float* const dequantized = dequantized_matrix->fp32();
  device_buffer counters(mx_counter_count * sizeof(unsigned long long));
  counters.fill_bytes(0);
  if (bf16) {
    runtime::launch(bf16_element_kernel, reduction_grid(count), threads_per_block, 0, operand, count, options.rounding,
                    options.sr_bits, options.stream, codes.as<std::uint8_t>(), dequantized,
                    counters.as<unsigned long long>());
  } else if (nvfp4) {
    out.tensor_scale = quantize_nvfp4_on_device(operand, input.rows, input.cols, options, codes.as<std::uint8_t>(),
                                                scales.as<std::uint8_t>(), dequantized,
                                                counters.as<unsigned long long>());
  } else if (plan) {
    mx_device_output destination;
    destination.codes = codes.as<std::uint8_t>();
    destination.scales = scales.as<std::uint8_t>();
    destination.dequantized = dequantized;
    destination.counters = counters.as<unsigned long long>();
    quantize_on_device(operand, input_format::fp32, input.rows, input.cols, *plan, rotation_plan{}, destination);
  } else {
    const float largest = finite_amax(operand, count);
    // As the CPU: scale = fl32(amax / max_normal), 1 for an all-zero (or all non-finite) tensor.
    out.tensor_scale = largest > 0.0f ? largest / static_cast<float>(core_ns::max_normal(kind)) : 1.0f;
    runtime::launch(per_tensor_element_kernel, reduction_grid(count), threads_per_block, 0, operand, count,
                    kind, out.tensor_scale, options.rounding, options.sr_bits, options.stream,
                    codes.as<std::uint8_t>(), dequantized, counters.as<unsigned long long>());
  }
  const std::int64_t chunk_count = (count + canonical_chunk - 1) / canonical_chunk;
  device_buffer partials(static_cast<std::size_t>(2 * chunk_count) * sizeof(double));
  runtime::launch(energy_chunks_kernel, grid_for(chunk_count, 1), ordered_sum_lanes, 0, operand,
                  dequantized, count, chunk_count, partials.as<double>());
  std::vector<double> host_partials(static_cast<std::size_t>(2 * chunk_count));
  partials.download(host_partials.data(), partials.bytes());
  energies.signal = tree_of(host_partials, 0, static_cast<std::size_t>(chunk_count));
  energies.error = tree_of(host_partials, static_cast<std::size_t>(chunk_count), static_cast<std::size_t>(chunk_count));
  if (!codes_on_device_only) {
    codes.download(out.codes.data(), out.codes.size());
    if (!out.scales.empty()) scales.download(out.scales.data(), out.scales.size());
  }
  out.device_codes = std::move(codes_buffer);
  out.device_scales = std::move(scales_buffer);
  if (keep_dequantized) out.dequantized = dequantized_matrix->download32();
  if (bf16) out.device_dequantized = std::move(dequantized_matrix);  // for the GPU's plain products
  take_counters(counters, out);
  return out;
}
