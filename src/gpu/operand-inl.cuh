// The bf16 GEMM operand of quantized codes (core/operand.hpp), for every scheme: decoded from the
// codes and scales a quantizer wrote. Included by quantize_mx-inl.cuh after the quantizers'
// kernels, inside namespace mxscope::gpu's anonymous namespace.

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
  bool fast = false;                        // MX float format: decode through fast_encode
  fast_encode::element_constants constants{};  // its constants, made once on the host
};

// The layout's decoding constants (call once on the host before launching).
operand_layout with_constants(operand_layout layout) {
  layout.fast = layout.scaling == operand_scale::mx && fast_encode::covers(layout.kind);
  if (layout.fast) layout.constants = fast_encode::constants_of(layout.kind);
  return layout;
}

// core::operand_bf16; for the MX float formats through fast_encode::dequantize, which gives the
// same exact fp32 value with fp32 arithmetic (self_test_fast_encoder checks it), then to bf16.
__device__ inline std::uint16_t operand_value_bf16(const operand_layout& layout, std::uint32_t code,
                                                   std::uint8_t scale) {
  if (layout.fast) {
    if (scale == core_ns::scale_nan_code) return core_ns::bf16_canonical_nan;
    const float value = fast_encode::dequantize(layout.constants, code, core_ns::scale_exponent(scale));
    return core_ns::float_to_bf16(value, core_ns::rounding_mode::rne, 0U, 32);
  }
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

void launch_operand_bf16(const std::uint8_t* codes, const std::uint8_t* scales, const operand_layout& described,
                         std::uint16_t* out) {
  const operand_layout layout = with_constants(described);
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

