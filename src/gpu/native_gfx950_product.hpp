// The gfx950 (MI355X) native MX product: kernels and host functions (rules and hypotheses in
// native_gfx950.hpp). Included once by gemm_launch-inl.cuh (products.cu), inside namespace
// mxscope::gpu, after its helpers (load_code, finish_output, prepared_operand::storage). The device
// code exists only in the HIP device pass for gfx950 (__gfx950__); nvcc, the CPU simulation and
// other AMD targets see host stubs, and native_gfx950::present() (native_gfx950_quantize.hpp) is
// false there, so nothing selects this path.
#pragma once

namespace native_gfx950 {  // in mxscope::gpu

#if defined(MXSCOPE_NATIVE_GFX950)

namespace {

typedef float float4_vector __attribute__((ext_vector_type(4)));
typedef int int8_vector __attribute__((ext_vector_type(8)));

constexpr int wave = 64;  // gfx950 runs wave64

// ------------------------------------------------------------------------------------------------
// GEMM: operands padded to a multiple of 64 rows and of 128 k (zero codes, scale 2^0: their
// products are +0 and change no sum), codes [rows, k / 2] as stored by the quantizer, scale codes
// [rows, k / 32]. A thread block of 4 waves computes a 64 x 64 tile of C, each wave 32 x 32 as 2 x 2
// 16x16 MFMA tiles; every instruction consumes one 128-k step (4 MX blocks) of one A and one B tile
// and adds into the fp32 accumulator in ascending k: fp32-group:4 under H4.

constexpr int mfma_rows = 16;
constexpr int mfma_depth = 128;
constexpr int tile = 64;

__global__ void native_codes_kernel(mx_operand_view operand, std::int64_t rows, std::int64_t depth,
                                    std::int64_t padded_rows, std::int64_t row_bytes, std::uint8_t* codes) {
  const bool along_rows = operand.axis == 1;
  const std::int64_t source_row_bytes = (operand.cols + 1) / 2;
  MXSCOPE_GRID_LOOP(t, padded_rows * row_bytes) {
    const std::int64_t row = t / row_bytes;
    const std::int64_t k0 = 2 * (t % row_bytes);
    std::uint32_t byte = 0;
    for (int e = 0; e < 2; ++e) {
      const std::int64_t k = k0 + e;
      if (row >= rows || k >= depth) break;
      const std::int64_t r = along_rows ? row : k;
      const std::int64_t c = along_rows ? k : row;
      byte |= load_code(operand, true, source_row_bytes, r, c) << (4 * e);
    }
    codes[t] = static_cast<std::uint8_t>(byte);
  }
}

__global__ void native_scales_kernel(mx_operand_view operand, std::int64_t rows, std::int64_t blocks,
                                     std::int64_t padded_rows, std::int64_t scale_stride, std::uint8_t* scales) {
  const bool along_rows = operand.axis == 1;
  MXSCOPE_GRID_LOOP(t, padded_rows * scale_stride) {
    const std::int64_t row = t / scale_stride;
    const std::int64_t b = t % scale_stride;
    std::uint8_t code = core_ns::scale_code(0);
    if (row < rows && b < blocks) code = along_rows ? operand.scales[row * blocks + b] : operand.scales[b * operand.cols + row];
    scales[t] = code;
  }
}

__device__ inline int8_vector load_fragment(const std::uint8_t* source) {
  const uint4 bytes = *reinterpret_cast<const uint4*>(source);
  return int8_vector{static_cast<int>(bytes.x), static_cast<int>(bytes.y), static_cast<int>(bytes.z),
                     static_cast<int>(bytes.w), 0, 0, 0, 0};
}

__global__ void __launch_bounds__(256)
    native_product_kernel(const std::uint8_t* a_codes, const std::uint8_t* a_scales, const std::uint8_t* b_codes,
                          const std::uint8_t* b_scales, std::int64_t m, std::int64_t n, std::int64_t row_bytes,
                          std::int64_t scale_stride, output_rounding output, float* out) {
#if defined(__gfx950__)
  const int warp = threadIdx.x / wave;
  const int lane = threadIdx.x % wave;
  const int lane_row = lane % mfma_rows;  // the A row / B column this lane feeds
  const int lane_block = lane / mfma_rows;  // the 32-k block of the step this lane feeds
  const std::int64_t i0 = static_cast<std::int64_t>(blockIdx.y) * tile + (warp / 2) * 32;
  const std::int64_t j0 = static_cast<std::int64_t>(blockIdx.x) * tile + (warp % 2) * 32;
  float4_vector accumulators[2][2];
#pragma unroll
  for (int mi = 0; mi < 2; ++mi)
#pragma unroll
    for (int ni = 0; ni < 2; ++ni) accumulators[mi][ni] = float4_vector{0.0f, 0.0f, 0.0f, 0.0f};
  const std::int64_t steps = row_bytes / (mfma_depth / 2);
  for (std::int64_t step = 0; step < steps; ++step) {
    const std::int64_t byte = step * (mfma_depth / 2) + lane_block * 16;
    const std::int64_t block = step * mfma_blocks_per_instruction + lane_block;
    int8_vector a_fragments[2], b_fragments[2];
    int a_scale[2], b_scale[2];
#pragma unroll
    for (int t = 0; t < 2; ++t) {
      const std::int64_t a_row = i0 + t * mfma_rows + lane_row;
      const std::int64_t b_row = j0 + t * mfma_rows + lane_row;
      a_fragments[t] = load_fragment(a_codes + a_row * row_bytes + byte);
      b_fragments[t] = load_fragment(b_codes + b_row * row_bytes + byte);
      a_scale[t] = a_scales[a_row * scale_stride + block];
      b_scale[t] = b_scales[b_row * scale_stride + block];
    }
#pragma unroll
    for (int mi = 0; mi < 2; ++mi)
#pragma unroll
      for (int ni = 0; ni < 2; ++ni)
        accumulators[mi][ni] = __builtin_amdgcn_mfma_scale_f32_16x16x128_f8f6f4(
            a_fragments[mi], b_fragments[ni], accumulators[mi][ni], 4, 4, 0, a_scale[mi], 0, b_scale[ni]);
  }
#pragma unroll
  for (int mi = 0; mi < 2; ++mi)
#pragma unroll
    for (int ni = 0; ni < 2; ++ni)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const std::int64_t i = i0 + mi * mfma_rows + 4 * lane_block + e;
        const std::int64_t j = j0 + ni * mfma_rows + lane_row;
        if (i < m && j < n) out[i * n + j] = finish_output(accumulators[mi][ni][e] * 1.0f, output);
      }
#else
  (void)a_codes, (void)a_scales, (void)b_codes, (void)b_scales, (void)m, (void)n, (void)row_bytes, (void)scale_stride,
      (void)output, (void)out;
  __builtin_trap();  // launched only where present() saw a gfx950
#endif
}

}  // namespace

void prepare(const mx_operand_view& operand, prepared_operand::storage& s) {
  const std::int64_t padded_rows = (s.rows + tile - 1) / tile * tile;
  const std::int64_t padded_depth = (s.depth + mfma_depth - 1) / mfma_depth * mfma_depth;
  s.byte_stride = padded_depth / 2;
  const std::int64_t scale_stride = padded_depth / 32;
  s.bytes = device_buffer(static_cast<std::size_t>(padded_rows * s.byte_stride));
  s.scale_codes = device_buffer(static_cast<std::size_t>(padded_rows * scale_stride));
  if (padded_rows == 0 || padded_depth == 0) return;
  runtime::launch(native_codes_kernel, grid_for(padded_rows * s.byte_stride), threads_per_block, 0, operand, s.rows,
                  s.depth, padded_rows, s.byte_stride, s.bytes.as<std::uint8_t>());
  runtime::launch(native_scales_kernel, grid_for(padded_rows * scale_stride), threads_per_block, 0, operand, s.rows,
                  s.blocks, padded_rows, scale_stride, s.scale_codes.as<std::uint8_t>());
  synchronize();
}

void multiply(const prepared_operand::storage& a, const prepared_operand::storage& b, output_rounding output,
              float* out) {
  if (!present()) throw input_error("gpu gemm: the native_mfma path needs a gfx950 device (MI355X)");
  if (a.byte_stride == 0) {  // K = 0: every entry is the empty sum, +0
    MXSCOPE_GPU_CHECK(runtime::memset(out, 0, static_cast<std::size_t>(a.rows * b.rows) * sizeof(float)));
    return;
  }
  const dim3 grid(static_cast<unsigned>((b.rows + tile - 1) / tile), static_cast<unsigned>((a.rows + tile - 1) / tile));
  runtime::launch(native_product_kernel, grid, 4 * wave, 0, a.bytes.as<const std::uint8_t>(),
                  a.scale_codes.as<const std::uint8_t>(), b.bytes.as<const std::uint8_t>(),
                  b.scale_codes.as<const std::uint8_t>(), a.rows, b.rows, a.byte_stride, a.byte_stride / 16, output,
                  out);
}

#else  // no native code in this build (nvcc, the CPU simulation)

void prepare(const mx_operand_view&, prepared_operand::storage&) {
  throw input_error("gpu gemm: the native_mfma path exists only in the HIP build for gfx950 (MI355X)");
}

void multiply(const prepared_operand::storage&, const prepared_operand::storage&, output_rounding, float*) {
  throw input_error("gpu gemm: the native_mfma path exists only in the HIP build for gfx950 (MI355X)");
}

#endif

}  // namespace native_gfx950
