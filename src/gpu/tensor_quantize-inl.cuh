// Whole tensors in device memory under every scheme (gpu.hpp: quantize_tensor_on_device), and the
// bf16 GEMM operands decoded from their codes. Part of quantize.cu (included there last, inside
// namespace mxscope::gpu), so that it uses the quantizers' kernels and launch helpers.

namespace {

// A device buffer the caller gave, or a temporary one of `bytes` when it gave none (the kernels
// below write their dequantized values and counters unconditionally).
template <class T>
T* given_or_temporary(T* given, device_buffer& temporary, std::size_t bytes) {
  if (given != nullptr) return given;
  temporary = device_buffer(bytes);
  if (bytes > 0) temporary.fill_bytes(0);
  return temporary.as<T>();
}

// The input as an fp32 tensor the rotation may change: the input itself where it is fp32 and
// there is no rotation, else a rotated working copy in `working`.
const float* fp32_operand(const void* input, input_format format, std::int64_t rows, std::int64_t cols, int axis,
                          const rotation_plan& rotation, device_buffer& working) {
  const std::int64_t count = rows * cols;
  if (format == input_format::fp32 && rotation.size == 0) return static_cast<const float*>(input);
  working = device_buffer(static_cast<std::size_t>(count) * sizeof(float));
  if (format == input_format::fp32) {
    copy_on_device(working.get(), input, working.bytes());
  } else {
    runtime::launch(widen_kernel<std::uint16_t>, grid_for(count), threads_per_block, 0,
                    static_cast<const std::uint16_t*>(input), working.as<float>(), count);
  }
  if (rotation.size > 0) rotate_on_device(working.as<float>(), rows, cols, axis, rotation);
  return working.as<const float>();
}

float quantize_mx_tensor(const void* input, input_format format, std::int64_t rows, std::int64_t cols,
                         const quantize_options& options, const rotation_plan& rotation,
                         const tensor_device_output& output) {
  const mx_plan plan = make_mx_plan(options, "gpu quantize");
  check_rotation(rotation, rows, cols, plan.axis, "gpu quantize");
  if (output.scales == nullptr) throw input_error("gpu quantize: field 'scales': MX formats need a scale buffer");
  mx_device_output destination;
  destination.codes = output.codes;
  destination.scales = output.scales;
  destination.dequantized = output.dequantized;
  destination.counters = output.counters;
  destination.operand_bf16 = output.operand_bf16;
  quantize_on_device(input, format, rows, cols, plan, rotation, destination);
  return 1.0f;
}

float quantize_nvfp4_tensor(const void* input, input_format format, std::int64_t rows, std::int64_t cols,
                            const quantize_options& options, const rotation_plan& rotation,
                            const tensor_device_output& output) {
  if (output.scales == nullptr) throw input_error("gpu quantize: field 'scales': nvfp4 needs a scale buffer");
  device_buffer working, dequantized_temporary, counters_temporary;
  const float* operand = fp32_operand(input, format, rows, cols, options.axis, rotation, working);
  float* dequantized = given_or_temporary(output.dequantized, dequantized_temporary,
                                          static_cast<std::size_t>(rows * cols) * sizeof(float));
  unsigned long long* counters = given_or_temporary(output.counters, counters_temporary,
                                                    mx_counter_count * sizeof(unsigned long long));
  const float tensor_scale =
      quantize_nvfp4_on_device(operand, rows, cols, options, output.codes, output.scales, dequantized, counters);
  if (output.operand_bf16 != nullptr) {
    const nvfp4_layout tiles = nvfp4_layout_of(options, rows, cols);
    const operand_layout layout{element_kind::fp4_e2m1,
                                operand_scale::nvfp4,
                                rows,
                                cols,
                                (cols + 1) / 2,
                                tiles.grid_cols,
                                static_cast<int>(tiles.tile_rows),
                                static_cast<int>(tiles.tile_cols),
                                true};
    launch_operand_bf16(output.codes, output.scales, layout, output.operand_bf16);
  }
  release_after_kernels();  // the temporaries must outlive the kernels
  return tensor_scale;
}

float quantize_unblocked_tensor(const void* input, input_format format, std::int64_t rows, std::int64_t cols,
                                const quantize_options& options, const rotation_plan& rotation,
                                const tensor_device_output& output) {
  const bool bf16 = options.format.scheme == quant_scheme::bf16;
  const element_kind kind = options.format.element;
  if (!bf16 && kind != element_kind::fp8_e4m3 && kind != element_kind::fp8_e5m2) {
    throw input_error("gpu quantize: field 'format': per-tensor scaling takes fp8 e4m3 or e5m2 elements");
  }
  const std::int64_t count = rows * cols;
  device_buffer working, dequantized_temporary, counters_temporary;
  const float* operand = fp32_operand(input, format, rows, cols, options.axis, rotation, working);
  float* dequantized =
      given_or_temporary(output.dequantized, dequantized_temporary, static_cast<std::size_t>(count) * sizeof(float));
  unsigned long long* counters = given_or_temporary(output.counters, counters_temporary,
                                                    mx_counter_count * sizeof(unsigned long long));
  float tensor_scale = 1.0f;
  if (bf16) {
    runtime::launch(bf16_element_kernel, reduction_grid(count), threads_per_block, 0, operand, count, options.rounding,
                    options.sr_bits, options.stream, output.codes, dequantized, counters);
    // The codes are the bf16 patterns, little-endian: the operand itself.
    if (output.operand_bf16 != nullptr) {
      copy_on_device(output.operand_bf16, output.codes, static_cast<std::size_t>(count) * sizeof(std::uint16_t));
    }
  } else {
    const float largest = finite_amax(operand, count);
    // As the CPU: scale = fl32(amax / max_normal), 1 for an all-zero (or all non-finite) tensor.
    tensor_scale = largest > 0.0f ? largest / static_cast<float>(core_ns::max_normal(kind)) : 1.0f;
    runtime::launch(per_tensor_element_kernel, reduction_grid(count), threads_per_block, 0, operand, count, kind,
                    tensor_scale, options.rounding, options.sr_bits, options.stream, output.codes, dequantized,
                    counters);
    if (output.operand_bf16 != nullptr) {
      const operand_layout layout{kind, operand_scale::none, rows, cols, cols, 1, 1, 1, false};
      launch_operand_bf16(output.codes, nullptr, layout, output.operand_bf16);
    }
  }
  release_after_kernels();  // the temporaries must outlive the kernels
  return tensor_scale;
}

}  // namespace

float quantize_tensor_on_device(const void* input, input_format format, std::int64_t rows, std::int64_t cols,
                                const quantize_options& options, const rotation_options& rotation,
                                const tensor_device_output& output) {
  if (rows < 0 || cols < 0) throw input_error("gpu quantize: field 'shape': negative");
  if (output.codes == nullptr) throw input_error("gpu quantize: field 'codes': a code buffer is required");
  const rotation_plan plan = make_rotation_plan(rotation);
  if (options.format.scheme == quant_scheme::none) {
    throw input_error("gpu quantize: field 'format': fp32 is no quantization");
  }
  if (options.format.scheme != quant_scheme::mx) check_rotation(plan, rows, cols, options.axis, "gpu quantize");
  if (rows == 0 || cols == 0) return 1.0f;
  switch (options.format.scheme) {
    case quant_scheme::mx: return quantize_mx_tensor(input, format, rows, cols, options, plan, output);
    case quant_scheme::nvfp4: return quantize_nvfp4_tensor(input, format, rows, cols, options, plan, output);
    default: return quantize_unblocked_tensor(input, format, rows, cols, options, plan, output);
  }
}
