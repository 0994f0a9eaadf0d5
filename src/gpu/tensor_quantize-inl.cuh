// Whole tensors in device memory under every scheme (gpu.hpp: quantize_tensor_on_device), and the
// bf16 GEMM operands decoded from their codes. Included at the end of kernels.cu, inside namespace
// mxscope::gpu, so that it uses the quantizers' kernels and launch helpers defined there and is
// compiled by every build of that file (nvcc, clang -x hip and the CPU simulation).

namespace {

using operand_scale = core_ns::operand_scaling;

// Where an element's code and block scale are: codes row-major ([rows, row_bytes], fp4 packed two
// per byte, element 2i in the low nibble), scales [.., scale_cols] with one scale per
// block_rows x block_cols tile.
struct operand_layout {
  element_kind kind;
  operand_scale scaling;
  std::int64_t rows, cols, row_bytes, scale_cols;
  int block_rows, block_cols;
  bool four_bit;
};

__device__ inline std::uint16_t operand_value_bf16(const operand_layout& layout, std::uint32_t code,
                                                   std::uint8_t scale) {
  return core_ns::operand_bf16(layout.kind, layout.scaling, code, scale);
}

__device__ inline std::uint32_t operand_code(const operand_layout& layout, const std::uint8_t* codes, std::int64_t r,
                                             std::int64_t c) {
  if (!layout.four_bit) return codes[r * layout.row_bytes + c];
  return (codes[r * layout.row_bytes + c / 2] >> (4 * (c & 1))) & 0x0FU;
}

__device__ inline std::uint8_t operand_scale_code(const operand_layout& layout, const std::uint8_t* scales,
                                                  std::int64_t r, std::int64_t c) {
  if (layout.scaling == operand_scale::none) return 0;
  return scales[(r / layout.block_rows) * layout.scale_cols + c / layout.block_cols];
}

// One thread per element.
__global__ void operand_bf16_kernel(const std::uint8_t* codes, const std::uint8_t* scales, operand_layout layout,
                                    std::uint16_t* out) {
  MXSCOPE_GRID_LOOP(i, layout.rows * layout.cols) {
    const std::int64_t r = i / layout.cols;
    const std::int64_t c = i % layout.cols;
    out[i] = operand_value_bf16(layout, operand_code(layout, codes, r, c), operand_scale_code(layout, scales, r, c));
  }
}

// One thread per 16 consecutive elements of a row (cols a multiple of 16, codes and scales 16-byte
// aligned): the row's indices computed once, the codes read as one 8- or 16-byte vector, a block's
// scale read once where the 16 elements share it, and two 16-byte stores.
constexpr int operand_group = 16;
__global__ void operand_bf16_grouped_kernel(const std::uint8_t* codes, const std::uint8_t* scales,
                                            operand_layout layout, std::uint16_t* out) {
  const std::int64_t groups_per_row = layout.cols / operand_group;
  const bool shared_scale = layout.block_cols % operand_group == 0;
  MXSCOPE_GRID_LOOP(g, layout.rows * groups_per_row) {
    const std::int64_t r = g / groups_per_row;
    const std::int64_t c0 = (g - r * groups_per_row) * operand_group;
    std::uint8_t bytes[operand_group];
    if (layout.four_bit) {
      const uint2 packed = *reinterpret_cast<const uint2*>(codes + r * layout.row_bytes + c0 / 2);
      const std::uint32_t words[2] = {packed.x, packed.y};
#pragma unroll
      for (int k = 0; k < operand_group; ++k) bytes[k] = (words[k / 8] >> (4 * (k % 8))) & 0x0FU;
    } else {
      const uint4 packed = *reinterpret_cast<const uint4*>(codes + r * layout.row_bytes + c0);
      const std::uint32_t words[4] = {packed.x, packed.y, packed.z, packed.w};
#pragma unroll
      for (int k = 0; k < operand_group; ++k) bytes[k] = (words[k / 4] >> (8 * (k % 4))) & 0xFFU;
    }
    const std::uint8_t* scale_row =
        layout.scaling == operand_scale::none ? nullptr : scales + (r / layout.block_rows) * layout.scale_cols;
    const std::uint8_t first_scale = scale_row == nullptr ? 0 : scale_row[c0 / layout.block_cols];
    std::uint32_t words[operand_group / 2];
#pragma unroll
    for (int k = 0; k < operand_group; k += 2) {
      std::uint16_t pair[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const std::int64_t c = c0 + k + h;
        const std::uint8_t scale = scale_row == nullptr || shared_scale ? first_scale
                                   : layout.block_cols == 1          ? scale_row[c]
                                                                     : scale_row[c / layout.block_cols];
        pair[h] = operand_value_bf16(layout, bytes[k + h], scale);
      }
      words[k / 2] = static_cast<std::uint32_t>(pair[0]) | (static_cast<std::uint32_t>(pair[1]) << 16);
    }
    auto* target = reinterpret_cast<uint4*>(out + r * layout.cols + c0);
    target[0] = make_uint4(words[0], words[1], words[2], words[3]);
    target[1] = make_uint4(words[4], words[5], words[6], words[7]);
  }
}

void launch_operand_bf16(const std::uint8_t* codes, const std::uint8_t* scales, const operand_layout& layout,
                         std::uint16_t* out) {
  if (layout.rows == 0 || layout.cols == 0) return;
  const auto aligned = [](const void* pointer) { return reinterpret_cast<std::uintptr_t>(pointer) % 16 == 0; };
  const bool grouped = layout.cols % operand_group == 0 && aligned(out) && aligned(codes);
  if (grouped) {
    runtime::launch(operand_bf16_grouped_kernel, grid_for(layout.rows * (layout.cols / operand_group)),
                    threads_per_block, 0, codes, scales, layout, out);
  } else {
    runtime::launch(operand_bf16_kernel, grid_for(layout.rows * layout.cols), threads_per_block, 0, codes, scales,
                    layout, out);
  }
}

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
  quantize_on_device(input, format, rows, cols, plan, rotation, destination);
  if (output.operand_bf16 != nullptr) {
    const bool along_rows = plan.axis == 1;
    const operand_layout layout{plan.element,
                                operand_scale::mx,
                                rows,
                                cols,
                                mx_code_row_bytes(plan, cols),
                                mx_scale_cols(plan, rows, cols),
                                along_rows ? 1 : plan.block,
                                along_rows ? plan.block : 1,
                                core_ns::spec(plan.element).bits == 4};
    launch_operand_bf16(output.codes, output.scales, layout, output.operand_bf16);
  }
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
