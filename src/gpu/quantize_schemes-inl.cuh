// Part of quantize.cu (included there, in order, inside namespace mxscope::gpu): the quantizers of
// the other schemes (per-tensor fp8, bf16, NVFP4) and the operand energies.

namespace {

// Per-tensor fp8 (src/quantize.cpp quantize_per_tensor): amax over the finite inputs (a maximum:
// order-free, taken on the bits of |v|, whose order is the order of the values), then every element
// encoded from the fp64 quotient v / scale, dequantized as fl32(decode(code) * scale).
__global__ void per_tensor_amax_kernel(const float* input, std::int64_t count, unsigned* amax_bits) {
  unsigned local = 0;
  MXSCOPE_GRID_LOOP(i, count) {
    const float v = input[i];
    if (is_finite(v)) {
      const unsigned bits = core_ns::float_bits(v) & 0x7FFFFFFFU;
      local = bits > local ? bits : local;
    }
  }
  atomicMax(amax_bits, local);
}

// A grid-stride walk over [0, count) that loads element_batch elements a thread (i, i + stride,
// ...) before taking any, so that each thread has that many loads in flight (the bf16 rounding:
// one element at a time, each thread waited for every load in turn). take(i, input[i]) for each
// element once, in index order per thread.
constexpr int element_batch = 4;

template <class Take>
__device__ inline void batched_elements(const float* input, std::int64_t count, const Take& take) {
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t first = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; first < count;
       first += stride * element_batch) {
    float values[element_batch];
#pragma unroll
    for (int b = 0; b < element_batch; ++b) {
      const std::int64_t i = first + b * stride;
      values[b] = i < count ? input[i] : 0.0f;
    }
#pragma unroll
    for (int b = 0; b < element_batch; ++b) {
      const std::int64_t i = first + b * stride;
      if (i < count) take(i, values[b]);
    }
  }
}

// bf16 "quantization" as the CPU's quantize_bf16: each value rounded to bf16 (sr words from the
// element's flat index), the 16-bit pattern stored little-endian, and the same four counters.
__global__ void bf16_element_kernel(const float* input, std::int64_t count, core_ns::rounding_mode rounding,
                                    int sr_bits, core_ns::random_stream stream, std::uint8_t* codes,
                                    float* dequantized, unsigned long long* counters) {
  unsigned long long nonzero = 0, flushed = 0, saturated = 0, nonfinite = 0;
  const bool stochastic = rounding == core_ns::rounding_mode::sr;
  batched_elements(input, count, [&](std::int64_t i, float v) {
    const std::uint32_t word = stochastic ? stream.word(static_cast<std::uint64_t>(i)) : 0U;
    const std::uint16_t bits = core_ns::float_to_bf16(v, rounding, word, sr_bits);
    codes[2 * i] = static_cast<std::uint8_t>(bits & 0xFFU);
    codes[2 * i + 1] = static_cast<std::uint8_t>(bits >> 8);
    const float rounded = core_ns::bf16_to_float(bits);
    dequantized[i] = rounded;
    const bool finite = is_finite(v);
    nonzero += v != 0.0f;
    nonfinite += !finite;
    flushed += v != 0.0f && rounded == 0.0f;
    saturated += finite && !is_finite(rounded) && rounded == rounded;  // finite in, inf out
  });
  unsigned long long reduced[4] = {nonzero, flushed, saturated, nonfinite};
  constexpr int index[4] = {counter_nonzero, counter_flushed, counter_saturated, counter_nonfinite};
  block_reduce_to<false>(reduced, counters, index);
}

// Under rne the encoding is core::nearest_even_encoder's (the CPU's per-tensor loop: the same
// steps as core::encode, the format's constants taken once), and the decoded codes come from a
// table of the format's 256 values in shared memory: fl32(decode(code)), exact for fp8.
__global__ void per_tensor_element_kernel(const float* input, std::int64_t count, element_kind kind, float scale,
                                          core_ns::rounding_mode rounding, int sr_bits, core_ns::random_stream stream,
                                          std::uint8_t* codes, float* dequantized, unsigned long long* counters) {
  __shared__ float decoded[256];
  for (int c = static_cast<int>(threadIdx.x); c < 256; c += static_cast<int>(blockDim.x)) {
    decoded[c] = static_cast<float>(core_ns::decode(kind, static_cast<std::uint32_t>(c)));
  }
  __syncthreads();
  const bool nearest_even =
      rounding == core_ns::rounding_mode::rne && core_ns::nearest_even_encoder::covers(kind);
  const core_ns::nearest_even_encoder encode_nearest_even(nearest_even ? kind : element_kind::fp8_e4m3);
  unsigned long long nonzero = 0, flushed = 0, saturated = 0, nonfinite = 0;
  const bool stochastic = rounding == core_ns::rounding_mode::sr;
  MXSCOPE_GRID_LOOP(i, count) {
    const float v = input[i];
    if (v != 0.0f) ++nonzero;
    if (!is_finite(v)) {
      ++nonfinite;
      codes[i] = static_cast<std::uint8_t>(core_ns::nan_code(kind) | (core_ns::float_bits(v) >> 31 != 0 ? core_ns::sign_bit(kind) : 0U));
      dequantized[i] = canonical_nan_float();
      continue;
    }
    const double quotient = static_cast<double>(v) / static_cast<double>(scale);
    const std::uint32_t word = stochastic ? stream.word(static_cast<std::uint64_t>(i)) : 0U;
    const auto encoded =
        nearest_even ? encode_nearest_even(quotient) : core_ns::encode(kind, quotient, rounding, word, sr_bits);
    codes[i] = static_cast<std::uint8_t>(encoded.code);
    dequantized[i] = __fmul_rn(decoded[encoded.code], scale);
    flushed += encoded.flushed;
    saturated += encoded.saturated;
  }
  unsigned long long reduced[4] = {nonzero, flushed, saturated, nonfinite};
  constexpr int index[4] = {counter_nonzero, counter_flushed, counter_saturated, counter_nonfinite};
  block_reduce_to<false>(reduced, counters, index);
}

// NVFP4 (include/mxscope/core/nvfp4.hpp, as the CPU's quantize_nvfp4), in two passes like the
// generic MX quantizer. Tiles of tile_rows x tile_cols elements share a scale: 1 x 16 (axis 1),
// 16 x 1 (axis 0) or 16 x 16 (2-D). Pass 1: one thread per tile finds its largest finite magnitude
// and writes its ue4m3 scale code (the NaN code for a tile with a non-finite input), counting
// nonzero and non-finite inputs. Pass 2: one thread per code byte (two elements of a row) encodes
// from its tile's scale code, as the CPU does.
struct nvfp4_layout {
  std::int64_t rows, cols, tile_rows, tile_cols, grid_rows, grid_cols;
};

nvfp4_layout nvfp4_layout_of(const quantize_options& options, std::int64_t rows, std::int64_t cols) {
  const core_ns::nvfp4_tile tile = core_ns::nvfp4_tile_of(options.axis, options.nvfp4_2d);
  nvfp4_layout out{rows, cols, tile.rows, tile.cols, 0, 0};
  out.grid_rows = (rows + out.tile_rows - 1) / out.tile_rows;
  out.grid_cols = (cols + out.tile_cols - 1) / out.tile_cols;
  return out;
}

__global__ void nvfp4_scale_kernel(const float* input, nvfp4_layout layout, float global_encode, float global_decode,
                                   std::uint8_t* scales, unsigned long long* counters) {
  unsigned long long nonzero = 0, nonfinite = 0;
  MXSCOPE_GRID_LOOP(t, layout.grid_rows * layout.grid_cols) {
    const std::int64_t r0 = (t / layout.grid_cols) * layout.tile_rows;
    const std::int64_t c0 = (t % layout.grid_cols) * layout.tile_cols;
    const std::int64_t r1 = r0 + layout.tile_rows < layout.rows ? r0 + layout.tile_rows : layout.rows;
    const std::int64_t c1 = c0 + layout.tile_cols < layout.cols ? c0 + layout.tile_cols : layout.cols;
    float amax = 0.0f;
    bool finite = true;
    for (std::int64_t r = r0; r < r1; ++r) {
      for (std::int64_t c = c0; c < c1; ++c) {
        const float v = input[r * layout.cols + c];
        if (v != 0.0f) ++nonzero;
        if (!is_finite(v)) {
          finite = false;
          ++nonfinite;
        } else {
          amax = fabsf(v) > amax ? fabsf(v) : amax;
        }
      }
    }
    scales[t] = finite ? core_ns::nvfp4_block_of_amax(amax, global_encode, global_decode).scale
                       : static_cast<std::uint8_t>(core_ns::nan_code(element_kind::ue4m3));
  }
  unsigned long long reduced[2] = {nonzero, nonfinite};
  constexpr int index[2] = {counter_nonzero, counter_nonfinite};
  block_reduce_to<false>(reduced, counters, index);
}

__global__ void nvfp4_element_kernel(const float* input, nvfp4_layout layout, float global_decode,
                                     core_ns::rounding_mode rounding, int sr_bits, core_ns::random_stream stream,
                                     const std::uint8_t* scales, std::uint8_t* codes, float* dequantized,
                                     unsigned long long* counters) {
  unsigned long long flushed = 0, saturated = 0;
  const bool stochastic = rounding == core_ns::rounding_mode::sr;
  const std::uint8_t nan_scale = static_cast<std::uint8_t>(core_ns::nan_code(element_kind::ue4m3));
  const std::int64_t row_bytes = (layout.cols + 1) / 2;
  MXSCOPE_GRID_LOOP(unit, layout.rows * row_bytes) {
    const std::int64_t r = unit / row_bytes;
    std::uint32_t byte = 0;
    for (int e = 0; e < 2; ++e) {
      const std::int64_t c = (unit % row_bytes) * 2 + e;
      if (c >= layout.cols) break;
      const std::int64_t index = r * layout.cols + c;
      const std::uint8_t scale = scales[(r / layout.tile_rows) * layout.grid_cols + c / layout.tile_cols];
      std::uint32_t code = 0;
      if (scale == nan_scale) {
        dequantized[index] = canonical_nan_float();
      } else {
        const std::uint32_t word = stochastic ? stream.word(static_cast<std::uint64_t>(index)) : 0U;
        const core_ns::nvfp4_element element =
            core_ns::nvfp4_encode(input[index], core_ns::nvfp4_block_of_scale(scale, global_decode), global_decode,
                                  rounding, word, sr_bits);
        code = element.code.code;
        dequantized[index] = element.dequantized;
        flushed += element.flushed ? 1U : 0U;
        saturated += element.code.saturated ? 1U : 0U;
      }
      byte |= (code & 0x0FU) << (4 * e);
    }
    codes[unit] = static_cast<std::uint8_t>(byte);
  }
  unsigned long long reduced[2] = {flushed, saturated};
  constexpr int index[2] = {counter_flushed, counter_saturated};
  block_reduce_to<false>(reduced, counters, index);
}

// The largest finite magnitude of a device tensor (0 when it has none), as the per-tensor
// quantizers of the CPU take it.
float finite_amax(const float* input, std::int64_t count) {
  device_buffer amax(sizeof(unsigned));
  amax.fill_bytes(0);
  runtime::launch(per_tensor_amax_kernel, reduction_grid(count), threads_per_block, 0, input, count,
                  amax.as<unsigned>());
  unsigned amax_bits = 0;
  amax.download(&amax_bits, sizeof(amax_bits));
  return core_ns::bits_float(amax_bits);
}

// The two passes, on device buffers; returns the global decode scale (the tensor scale).
float quantize_nvfp4_on_device(const float* input, std::int64_t rows, std::int64_t cols,
                               const quantize_options& options, std::uint8_t* codes, std::uint8_t* scales,
                               float* dequantized, unsigned long long* counters) {
  const float global_encode = core_ns::nvfp4_global_encode_scale(finite_amax(input, rows * cols));
  const float global_decode = 1.0f / global_encode;
  const nvfp4_layout layout = nvfp4_layout_of(options, rows, cols);
  runtime::launch(nvfp4_scale_kernel, reduction_grid(layout.grid_rows * layout.grid_cols), threads_per_block, 0,
                  input, layout, global_encode, global_decode, scales, counters);
  runtime::launch(nvfp4_element_kernel, reduction_grid(rows * ((cols + 1) / 2)), threads_per_block, 0, input, layout,
                  global_decode, options.rounding, options.sr_bits, options.stream, scales, codes, dequantized,
                  counters);
  return global_decode;
}

// The operand energies of quantize_with_energies, per canonical chunk in fp64 (ordered_chunk_sums).
__global__ void energy_chunks_kernel(const float* input, const float* dequantized, std::int64_t count,
                                     std::int64_t chunk_count, double* partials) {
  ordered_chunk_sums<2, 4>(
      chunk_count, canonical_chunks{count},
      [&](std::int64_t i, double* t) {
        const double value = static_cast<double>(input[i]);
        const double rounded = static_cast<double>(dequantized[i]);
        if (!is_finite(value) || !is_finite(rounded)) return;  // the terms stay +0
        t[0] = value * value;
        t[1] = (value - rounded) * (value - rounded);
      },
      partials);
}

}  // namespace
