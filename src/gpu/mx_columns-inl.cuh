// MX quantization along axis 0 in one pass (blocks running down the columns: the Wgrad operands and
// Dgrad's weight), for the float element formats of fast_encode. Included by quantize_mx-inl.cuh
// after the generic kernels, inside namespace mxscope::gpu's anonymous namespace.
//
// A thread owns four consecutive columns of a quarter of one block of rows (a slice): it reads its
// rows once for the four amax values, the slices of the block combine them in shared memory into
// the block's scales, and the thread reads its rows again (from cache) to encode them with
// fast_encode::quantize_finite, the fused quantizer's element encoder (the core's bits, checked by
// self_test_fast_encoder), and the Philox block of each row's four elements computed once. It
// writes the codes, the scales, the optional dequantized values and the optional bf16 GEMM operand
// (core::operand_bf16, here float_to_bf16 of the exact fp32 dequantized value). Consecutive threads
// take consecutive column groups, so every load and store of a warp is contiguous. The bits are
// those of mx_scale_kernel + mx_element_kernel.

constexpr int column_group = 4;

template <class Input>
__device__ inline void load_group(const Input* input, std::int64_t index, int width, bool vector, float (&v)[column_group]) {
  if constexpr (std::is_same_v<Input, std::uint16_t>) {
    if (vector) {
      const uint2 pair = *reinterpret_cast<const uint2*>(input + index);
      v[0] = core_ns::bits_float(pair.x << 16);
      v[1] = core_ns::bits_float(pair.x & 0xffff0000U);
      v[2] = core_ns::bits_float(pair.y << 16);
      v[3] = core_ns::bits_float(pair.y & 0xffff0000U);
      return;
    }
  } else {
    if (vector) {
      const float4 four = *reinterpret_cast<const float4*>(input + index);
      v[0] = four.x;
      v[1] = four.y;
      v[2] = four.z;
      v[3] = four.w;
      return;
    }
  }
#pragma unroll
  for (int k = 0; k < column_group; ++k) v[k] = k < width ? load_input(input, index + k) : 0.0f;
}

// One row of a column group into the block's scan: the counters of nonzero and non-finite
// elements, whether a column met a non-finite value, and each column's largest finite magnitude.
__device__ inline void scan_column_row(const float (&v)[column_group], int width, float (&amax)[column_group],
                                       bool (&nonfinite)[column_group], unsigned long long (&counts)[mx_counter_count]) {
#pragma unroll
  for (int k = 0; k < column_group; ++k) {
    if (k >= width) continue;
    counts[counter_nonzero] += v[k] != 0.0f;
    const bool finite = is_finite(v[k]);
    counts[counter_nonfinite] += !finite;
    nonfinite[k] = nonfinite[k] || !finite;
    const float magnitude = fabsf(v[k]);
    if (finite && amax[k] < magnitude) amax[k] = magnitude;
  }
}

// A column's E8M0 scale code from the scan (the NaN code when it met a non-finite value).
__device__ inline std::uint8_t column_scale(const mx_plan& plan, float amax, bool nonfinite) {
  return nonfinite ? core_ns::scale_nan_code : core_ns::scale_code(core_ns::shared_exponent(plan.element, plan.rule, amax));
}

// One element of a column group: its code, its dequantized value (canonical NaN in a block with a
// non-finite member) and the flushed / saturated counters.
__device__ inline std::uint32_t encode_column_element(const fast_encode::element_constants& constants, const mx_plan& plan,
                                                      float value, bool nonfinite, int exponent, std::uint32_t word,
                                                      float& dequantized, unsigned long long (&counts)[mx_counter_count]) {
  dequantized = canonical_nan_float();
  if (nonfinite) return 0;
  const core_ns::encoded encoded = fast_encode::quantize_finite(constants, value, exponent, plan.rounding, word, plan.sr_bits);
  dequantized = fast_encode::dequantize(constants, encoded.code, exponent);
  counts[counter_flushed] += encoded.flushed;
  counts[counter_saturated] += encoded.saturated;
  return encoded.code;
}

// A column tile: column_tile_groups column groups side by side, one block of rows, split among
// column_slices threads per group (consecutive rows each). The slices meet in shared memory for
// the block's amax, so that a tile has four times the threads of one-thread-per-block: a weight of
// 1024 x 1024 is otherwise only 8,192 threads, too few to hide the loads' latency on a large GPU.
constexpr int column_slices = 4;
constexpr int column_tile_groups = threads_per_block / column_slices;

// The rows [first, last) of a column group's block that one slice owns.
__device__ inline void slice_rows(int height, int block, int slice, int& first, int& last) {
  const int per_slice = (block + column_slices - 1) / column_slices;
  first = slice * per_slice < height ? slice * per_slice : height;
  last = first + per_slice < height ? first + per_slice : height;
}

template <class Input>
__global__ void mx_column_kernel(const Input* input, std::int64_t rows, std::int64_t cols, mx_plan plan,
                                 fast_encode::element_constants constants, mx_device_output output,
                                 std::uint16_t* operand) {
  // A slice's amax of each column (-1: it met a non-finite value).
  __shared__ float slice_amax[column_slices][column_tile_groups][column_group];
  const bool packed = core_ns::spec(plan.element).bits == 4;
  const bool stochastic = plan.rounding == core_ns::rounding_mode::sr;
  const std::int64_t row_bytes = packed ? (cols + 1) / 2 : cols;
  const std::int64_t groups = (cols + column_group - 1) / column_group;
  const std::int64_t tiles_across = (groups + column_tile_groups - 1) / column_tile_groups;
  const std::int64_t row_blocks = (rows + plan.block - 1) / plan.block;
  // 4-element vectors where every group starts on a 4-element boundary of an aligned input.
  const bool aligned = cols % column_group == 0 &&
                       reinterpret_cast<std::uintptr_t>(input) % (column_group * sizeof(Input)) == 0;
  const int lane_group = static_cast<int>(threadIdx.x) % column_tile_groups;
  const int slice = static_cast<int>(threadIdx.x) / column_tile_groups;
  unsigned long long counts[mx_counter_count] = {0, 0, 0, 0};
  // Block-uniform trip count: every thread reaches each barrier.
  for (std::int64_t tile = blockIdx.x; tile < tiles_across * row_blocks; tile += gridDim.x) {
    const std::int64_t c0 = ((tile % tiles_across) * column_tile_groups + lane_group) * column_group;
    const std::int64_t r0 = (tile / tiles_across) * plan.block;
    const int width = cols - c0 <= 0 ? 0 : (cols - c0 < column_group ? static_cast<int>(cols - c0) : column_group);
    const int height = rows - r0 < plan.block ? static_cast<int>(rows - r0) : plan.block;
    const bool vector = aligned && width == column_group;
    int first = 0, last = 0;
    slice_rows(height, plan.block, slice, first, last);
    if (width == 0) last = first;
    float amax[column_group] = {0.0f, 0.0f, 0.0f, 0.0f};
    bool nonfinite[column_group] = {false, false, false, false};
#pragma unroll 4
    for (int i = first; i < last; ++i) {
      float v[column_group];
      load_group(input, (r0 + i) * cols + c0, width, vector, v);
      scan_column_row(v, width, amax, nonfinite, counts);
    }
#pragma unroll
    for (int k = 0; k < column_group; ++k) slice_amax[slice][lane_group][k] = nonfinite[k] ? -1.0f : amax[k];
    __syncthreads();
    int exponent[column_group];
#pragma unroll
    for (int k = 0; k < column_group; ++k) {
      float block_amax = 0.0f;
      bool block_nonfinite = false;
#pragma unroll
      for (int s = 0; s < column_slices; ++s) {
        const float part = slice_amax[s][lane_group][k];
        block_nonfinite = block_nonfinite || part < 0.0f;
        block_amax = part > block_amax ? part : block_amax;
      }
      nonfinite[k] = block_nonfinite;
      const std::uint8_t scale = column_scale(plan, block_amax, block_nonfinite);
      if (k < width && slice == 0) output.scales[(r0 / plan.block) * cols + c0 + k] = scale;
      exponent[k] = core_ns::scale_exponent(scale);
    }
    __syncthreads();  // the shared amax is read before the next tile writes it
    for (int i = first; i < last; ++i) {
      const std::int64_t r = r0 + i;
      const std::int64_t flat = r * cols + c0;
      float v[column_group];
      load_group(input, flat, width, vector, v);
      core_ns::philox_block words{};
      std::uint64_t words_index = ~std::uint64_t{0};
      std::uint32_t codes[column_group] = {0, 0, 0, 0};
#pragma unroll
      for (int k = 0; k < column_group; ++k) {
        if (k >= width) continue;
        std::uint32_t word = 0;
        if (stochastic && !nonfinite[k]) {
          const std::uint64_t index = static_cast<std::uint64_t>(flat + k);
          if (index / 4 != words_index) {
            words_index = index / 4;
            words = plan.stream.block(words_index);
          }
          word = words.word[index % 4];
        }
        float dequantized;
        codes[k] = encode_column_element(constants, plan, v[k], nonfinite[k], exponent[k], word, dequantized, counts);
        if (output.dequantized != nullptr) output.dequantized[flat + k] = dequantized;
        if (operand != nullptr) operand[flat + k] = core_ns::float_to_bf16(dequantized, core_ns::rounding_mode::rne, 0U, 32);
      }
      if (packed) {  // c0 is even: columns c0, c0 + 1 share a byte, c0 + 2, c0 + 3 the next
        output.codes[r * row_bytes + c0 / 2] = static_cast<std::uint8_t>((codes[0] & 0x0FU) | ((codes[1] & 0x0FU) << 4));
        if (width > 2) {
          output.codes[r * row_bytes + c0 / 2 + 1] =
              static_cast<std::uint8_t>((codes[2] & 0x0FU) | ((codes[3] & 0x0FU) << 4));
        }
      } else {
#pragma unroll
        for (int k = 0; k < column_group; ++k) {
          if (k < width) output.codes[r * row_bytes + c0 + k] = static_cast<std::uint8_t>(codes[k]);
        }
      }
    }
  }
  if (output.counters != nullptr) add_counters(output.counters, counts);
}

bool column_path_covers(const mx_plan& plan) { return plan.axis == 0 && fast_encode::covers(plan.element); }

template <class Input>
void launch_columns(const Input* input, std::int64_t rows, std::int64_t cols, const mx_plan& plan,
                    const mx_device_output& output, std::uint16_t* operand) {
  const std::int64_t groups = (cols + column_group - 1) / column_group;
  const std::int64_t tiles = ((groups + column_tile_groups - 1) / column_tile_groups) * ((rows + plan.block - 1) / plan.block);
  const unsigned grid = static_cast<unsigned>(std::clamp<std::int64_t>(tiles, 1, std::int64_t{1} << 20));
  runtime::launch(mx_column_kernel<Input>, grid, threads_per_block, 0, input, rows, cols, plan,
                  fast_encode::constants_of(plan.element), output, operand);
}
