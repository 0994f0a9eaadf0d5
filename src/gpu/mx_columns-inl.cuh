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
// (core::operand_bf16, here float_to_bf16 of the exact fp32 dequantized value), a row of a group in
// one vector store per output. Consecutive threads take consecutive column groups, so every load
// and store of a warp is contiguous. The bits are
// those of mx_scale_kernel + mx_element_kernel.

constexpr int column_group = 4;

// core::operand_bf16 of an MX element from its exact fp32 dequantized value (canonical NaN in a
// block with a non-finite member).
__device__ inline std::uint16_t operand_half(float dequantized) {
  return core_ns::float_to_bf16(dequantized, core_ns::rounding_mode::rne, 0U, 32);
}

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

// One row of a column group out: its codes (at byte `code_at` of the row), dequantized values and
// bf16 operand `halves` (at element `flat`). A full group of an aligned tensor goes out in one store per
// output (the row's codes, values and operand then all start on their vector's boundary: cols is a
// multiple of 4 and the buffers come from a device allocator), a partial one element by element.
__device__ inline void store_column_row(const mx_device_output& output, std::uint16_t* operand, std::int64_t code_at,
                                        std::int64_t flat, std::int64_t c0, int width, bool vector, bool packed,
                                        const std::uint32_t (&codes)[column_group],
                                        const float (&dequantized)[column_group],
                                        const std::uint16_t (&halves)[column_group]) {
  if (vector) {
    if (packed) {  // c0 is a multiple of 4: columns c0, c0 + 1 share a byte, c0 + 2, c0 + 3 the next
      *reinterpret_cast<std::uint16_t*>(output.codes + code_at + c0 / 2) = static_cast<std::uint16_t>(
          (codes[0] & 0x0FU) | ((codes[1] & 0x0FU) << 4) | ((codes[2] & 0x0FU) << 8) | ((codes[3] & 0x0FU) << 12));
    } else {
      *reinterpret_cast<std::uint32_t*>(output.codes + code_at + c0) =
          (codes[0] & 0xFFU) | ((codes[1] & 0xFFU) << 8) | ((codes[2] & 0xFFU) << 16) | ((codes[3] & 0xFFU) << 24);
    }
    if (output.dequantized != nullptr) {
      *reinterpret_cast<float4*>(output.dequantized + flat) =
          make_float4(dequantized[0], dequantized[1], dequantized[2], dequantized[3]);
    }
    if (operand != nullptr) {
      *reinterpret_cast<uint2*>(operand + flat) =
          make_uint2(halves[0] | (static_cast<std::uint32_t>(halves[1]) << 16),
                     halves[2] | (static_cast<std::uint32_t>(halves[3]) << 16));
    }
    return;
  }
  if (packed) {  // c0 is even
    output.codes[code_at + c0 / 2] = static_cast<std::uint8_t>((codes[0] & 0x0FU) | ((codes[1] & 0x0FU) << 4));
    if (width > 2) {
      output.codes[code_at + c0 / 2 + 1] = static_cast<std::uint8_t>((codes[2] & 0x0FU) | ((codes[3] & 0x0FU) << 4));
    }
  } else {
#pragma unroll
    for (int k = 0; k < column_group; ++k) {
      if (k < width) output.codes[code_at + c0 + k] = static_cast<std::uint8_t>(codes[k]);
    }
  }
#pragma unroll
  for (int k = 0; k < column_group; ++k) {
    if (k >= width) continue;
    if (output.dequantized != nullptr) output.dequantized[flat + k] = dequantized[k];
    if (operand != nullptr) operand[flat + k] = halves[k];
  }
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
  // One store per output of a full group where cols is a multiple of 4 and the outputs start on
  // their vectors' boundaries.
  const auto on = [](const void* pointer, std::uintptr_t bytes) {
    return reinterpret_cast<std::uintptr_t>(pointer) % bytes == 0;
  };
  const bool outputs_aligned = cols % column_group == 0 && on(output.codes, packed ? 2 : 4) &&
                               (output.dequantized == nullptr || on(output.dequantized, 16)) &&
                               (operand == nullptr || on(operand, 8));
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
      float dequantized[column_group] = {0.0f, 0.0f, 0.0f, 0.0f};
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
        codes[k] = encode_column_element(constants, plan, v[k], nonfinite[k], exponent[k], word, dequantized[k], counts);
      }
      std::uint16_t halves[column_group];
#pragma unroll
      for (int k = 0; k < column_group; ++k) halves[k] = operand_half(dequantized[k]);
      store_column_row(output, operand, r * row_bytes, flat, c0, width, outputs_aligned && width == column_group, packed,
                       codes, dequantized, halves);
    }
  }
  if (output.counters != nullptr) add_counters(output.counters, counts);
}

// The e2m1 magnitude of code m (0..7): 0, 0.5, 1, 1.5, 2, 3, 4, 6.
__device__ inline float fp4_magnitude(std::uint32_t m) {
  return m < 4 ? 0.5f * static_cast<float>(m) : static_cast<float>(m < 6 ? m - 2 : 2 * (m - 4));
}

// Four fp4 elements of one row of a column group, each under its column's constants: the block's
// exponent e, `power` 2^e (NaN: the column met a non-finite value) and, where `unscaled` (rne, or
// sr with 32 random bits) and the column's `one` is not 0, the unscaled grid {six, one} of
// fast_encode::fp4_unscaled_constants(e) (the staged kernel gives it for -125 <= e <= 102, where
// both fp4_nearest_even_unscaled and fp4_stochastic_unscaled hold). On that grid the code and its
// point m 2^e come from one rounding (fast_encode::fp4_*_unscaled_rounding), with the saturation
// flag |v| > 6 2^e; elsewhere from fast_encode::fp4_encode's composition on fl32(|v| 2^-e)
// (fp4_nearest_even for rne, fp4_locate and fp4_round for the other modes) with the flag
// fl32(|v| 2^-e) > 6 and the point fp4_magnitude(code) 2^e. The two are the same function where
// both apply (the fused kernel's encoders rest on it). The point is exact (at most two significant
// bits, no lower than 2^-128), as fast_encode::dequantize gives it, so the bf16 operand is its
// upper half (float_to_bf16 would round nothing; the canonical NaN's half is the canonical bf16 NaN).
__device__ inline void encode_fp4_group(const mx_plan& plan, bool unscaled, const float (&values)[column_group],
                                        const int (&exponent)[column_group], const float (&six)[column_group],
                                        const std::uint32_t (&one)[column_group], const float (&power)[column_group],
                                        const core_ns::philox_block& words, std::uint32_t random_mask,
                                        std::uint32_t (&codes)[column_group], float (&dequantized)[column_group],
                                        std::uint16_t (&halves)[column_group], unsigned& flushed,
                                        unsigned& saturated) {
#pragma unroll
  for (int k = 0; k < column_group; ++k) {
    if (power[k] != power[k]) {
      codes[k] = 0;
      dequantized[k] = canonical_nan_float();
      halves[k] = static_cast<std::uint16_t>(core_ns::float_bits(dequantized[k]) >> 16);
      continue;
    }
    const float magnitude = fabsf(values[k]);
    std::uint32_t code = 0;
    float point = 0.0f;
    if (unscaled && one[k] != 0) {
      const fast_encode::fp4_unscaled grid{six[k], one[k]};
      const float clamped = fminf(magnitude, six[k]);
      const fast_encode::fp4_unscaled_rounding rounding =
          plan.rounding == core_ns::rounding_mode::rne
              ? fast_encode::fp4_nearest_even_unscaled_rounding(clamped, grid)
              : fast_encode::fp4_stochastic_unscaled_rounding(clamped, words.word[k], grid);
      code = rounding.biased() + fast_encode::fp4_unscaled_offset(grid);
      point = rounding.point();
      saturated += magnitude > six[k] ? 1U : 0U;
    } else {
      const float scaled = magnitude * fast_encode::power_of_two(-exponent[k]);
      if (plan.rounding == core_ns::rounding_mode::rne) {
        code = fast_encode::fp4_nearest_even(scaled);
      } else {
        const fast_encode::fp4_position position = fast_encode::fp4_locate(scaled);
        code = fast_encode::fp4_round(
            position, fast_encode::fp4_round_addend(plan.rounding, position.floor_code, words.word[k], random_mask));
      }
      saturated += scaled > 6.0f ? 1U : 0U;
      point = fp4_magnitude(code) * power[k];
    }
    flushed += code == 0 && magnitude != 0.0f ? 1U : 0U;
    const std::uint32_t sign = core_ns::float_bits(values[k]) & 0x80000000U;
    dequantized[k] = core_ns::bits_float(core_ns::float_bits(point) | sign);
    halves[k] = static_cast<std::uint16_t>(core_ns::float_bits(dequantized[k]) >> 16);
    codes[k] = code | (sign >> 28);
  }
}

// The staged column kernel, for shapes whose rows are read in 16-byte vectors (cols a multiple
// of 8, every buffer on a 16-byte boundary). A thread block takes a tile of one block of rows by
// staged_columns columns: it reads the tile into shared memory in contiguous 16-byte loads
// (as fp32), then two threads per column scan half the block's rows each and meet for the column's
// scale, then each thread encodes four column groups of one row, read from shared memory and
// written out as store_column_row writes them (a warp's quarter covers 32 contiguous columns, so
// neither the shared-memory reads nor the stores conflict). The elements, the Philox words (block
// flat / 4 of the plan's stream) and the counters are those of mx_column_kernel.
constexpr int staged_columns = 128;
constexpr int staged_rows = 32;  // the MX block along axis 0 (plan.block == 32)
static_assert(threads_per_block == 2 * staged_columns && threads_per_block == staged_rows * 8);

// One body (about 160 lines): the staging, the column scan and the encoding phases share the tile
// in shared memory and its block exponents between their barriers.
template <class Input, int Rotation>
__global__ void mx_staged_column_kernel(const Input* input, std::int64_t rows, std::int64_t cols, mx_plan plan,
                                        fast_encode::element_constants constants, mx_device_output output,
                                        std::uint16_t* operand, const float* signs) {
  static_assert(Rotation == 0 || Rotation == staged_rows / 2);
  // Declared as 16-byte vectors for their alignment, used as scalars.
  __shared__ float4 tile_vectors[staged_rows][staged_columns / 4];
  __shared__ int4 exponent_vectors[staged_columns / 4];
  __shared__ float4 six_vectors[staged_columns / 4];
  __shared__ uint4 one_vectors[staged_columns / 4];
  __shared__ float4 power_vectors[staged_columns / 4];
  __shared__ float half_amax[2][staged_columns];  // -1: that half met a non-finite value
  float(*tile)[staged_columns] = reinterpret_cast<float(*)[staged_columns]>(tile_vectors);
  int* column_exponent = reinterpret_cast<int*>(exponent_vectors);  // the block's, or 255 (non-finite)
  float* column_six = reinterpret_cast<float*>(six_vectors);          // fp4's unscaled grid (encode_fp4_group),
  std::uint32_t* column_one = reinterpret_cast<std::uint32_t*>(one_vectors);  // one 0 where it does not hold
  float* column_power = reinterpret_cast<float*>(power_vectors);      // 2^e, NaN for a non-finite column
  const bool packed = core_ns::spec(plan.element).bits == 4;
  const bool fp4 = plan.element == element_kind::fp4_e2m1;
  const bool stochastic = plan.rounding == core_ns::rounding_mode::sr;
  const std::uint32_t random_mask = stochastic ? fast_encode::fp4_random_mask(plan.sr_bits) : 0U;
  const bool unscaled = plan.rounding == core_ns::rounding_mode::rne || (stochastic && plan.sr_bits == 32);
  const std::int64_t row_bytes = packed ? cols / 2 : cols;
  const std::int64_t tiles_across = (cols + staged_columns - 1) / staged_columns;
  const std::int64_t row_blocks = (rows + staged_rows - 1) / staged_rows;
  constexpr int per_vector = 16 / static_cast<int>(sizeof(Input));
  constexpr int vectors_per_row = staged_columns / per_vector;
  // 32-bit per thread (a thread meets 32 elements per tile and far fewer than 2^27 tiles), widened
  // for the block's reduction at the end.
  unsigned counts[mx_counter_count] = {0, 0, 0, 0};
  const int t = static_cast<int>(threadIdx.x);
  // Block-uniform trip count: every thread reaches each barrier.
  for (std::int64_t index = blockIdx.x; index < tiles_across * row_blocks; index += gridDim.x) {
    const std::int64_t c_first = (index % tiles_across) * staged_columns;
    const std::int64_t r0 = (index / tiles_across) * staged_rows;
    const int height = rows - r0 < staged_rows ? static_cast<int>(rows - r0) : staged_rows;
    const int width = cols - c_first < staged_columns ? static_cast<int>(cols - c_first) : staged_columns;
    // Read: consecutive threads, consecutive vectors of a row; outside the tensor, zeros (they
    // change no amax and count as no element).
    for (int v = t; v < staged_rows * vectors_per_row; v += threads_per_block) {
      const int r = v / vectors_per_row;
      const int c = (v % vectors_per_row) * per_vector;
      float values[per_vector];
      if (r < height && c < width) {
        const uint4 piece = *reinterpret_cast<const uint4*>(input + (r0 + r) * cols + c_first + c);
        const std::uint32_t words[4] = {piece.x, piece.y, piece.z, piece.w};
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          if constexpr (std::is_same_v<Input, std::uint16_t>) {
            values[2 * k] = core_ns::bits_float(words[k] << 16);
            values[2 * k + 1] = core_ns::bits_float(words[k] & 0xffff0000U);
          } else {
            values[k] = core_ns::bits_float(words[k]);
          }
        }
      } else {
#pragma unroll
        for (int k = 0; k < per_vector; ++k) values[k] = 0.0f;
      }
#pragma unroll
      for (int k = 0; k < per_vector; k += 4) {
        *reinterpret_cast<float4*>(&tile[r][c + k]) = make_float4(values[k], values[k + 1], values[k + 2], values[k + 3]);
      }
    }
    __syncthreads();
    {  // the scan: column t % staged_columns, rows of half t / staged_columns
      const int c = t % staged_columns;
      const int half = t / staged_columns;
      if constexpr (Rotation > 0) {
        // The half is one rotation segment of the column: rotated in registers by
        // core::rotate_segment (signs, the canonical stages, the scale: rotate_kernel's bits) and
        // put back for the encoder. (rows is a multiple of Rotation: a half is whole or absent.)
        if (half * Rotation < height) {
          float segment[Rotation];
#pragma unroll
          for (int i = 0; i < Rotation; ++i) segment[i] = tile[half * Rotation + i][c];
          core_ns::rotate_segment(segment, Rotation, signs != nullptr ? signs + r0 + half * Rotation : nullptr);
#pragma unroll
          for (int i = 0; i < Rotation; ++i) tile[half * Rotation + i][c] = segment[i];
        }
      }
      float amax = 0.0f;
      bool nonfinite = false;
      const int present = c < width ? height - half * (staged_rows / 2) : 0;  // rows of this half in the tensor
#pragma unroll
      for (int i = 0; i < staged_rows / 2; ++i) {
        const float value = tile[half * (staged_rows / 2) + i][c];
        if (i >= present) continue;
        counts[counter_nonzero] += value != 0.0f ? 1U : 0U;
        const bool finite = is_finite(value);
        counts[counter_nonfinite] += finite ? 0U : 1U;
        nonfinite = nonfinite || !finite;
        const float magnitude = fabsf(value);
        if (finite && amax < magnitude) amax = magnitude;
      }
      half_amax[half][c] = nonfinite ? -1.0f : amax;
    }
    __syncthreads();
    if (t < staged_columns) {
      const float a = half_amax[0][t], b = half_amax[1][t];
      const bool nonfinite = a < 0.0f || b < 0.0f;
      const std::uint8_t scale = column_scale(plan, a > b ? a : b, nonfinite);
      if (t < width) output.scales[(r0 / staged_rows) * cols + c_first + t] = scale;
      const int exponent = core_ns::scale_exponent(scale);
      column_exponent[t] = nonfinite ? 255 : exponent;
      const bool gridded = !nonfinite && fast_encode::fp4_stochastic_covers(exponent);  // -125..102
      const fast_encode::fp4_unscaled grid = fast_encode::fp4_unscaled_constants(gridded ? exponent : 0);
      column_six[t] = grid.six;
      column_one[t] = gridded ? grid.one : 0U;
      column_power[t] = nonfinite ? canonical_nan_float() : fast_encode::power_of_two(exponent);
    }
    __syncthreads();
    {  // encode: row t / 8, column groups 4 (t % 8) + 32 m
      const int r = t / 8;
      if (r < height) {
        for (int m = 0; m < staged_columns / 32; ++m) {
          const int c = 32 * m + column_group * (t % 8);
          if (c >= width) continue;
          const std::int64_t flat = (r0 + r) * cols + c_first + c;
          const core_ns::philox_block words =
              stochastic ? plan.stream.block(static_cast<std::uint64_t>(flat) / 4) : core_ns::philox_block{};
          const float4 four = *reinterpret_cast<const float4*>(&tile[r][c]);
          const float values[column_group] = {four.x, four.y, four.z, four.w};
          std::uint32_t codes[column_group];
          float dequantized[column_group];
          std::uint16_t halves[column_group];
          const int4 exponents = *reinterpret_cast<const int4*>(&column_exponent[c]);
          const int exponent[column_group] = {exponents.x, exponents.y, exponents.z, exponents.w};
          if (fp4) {
            const float4 sixes = *reinterpret_cast<const float4*>(&column_six[c]);
            const uint4 ones = *reinterpret_cast<const uint4*>(&column_one[c]);
            const float4 powers = *reinterpret_cast<const float4*>(&column_power[c]);
            const float six[column_group] = {sixes.x, sixes.y, sixes.z, sixes.w};
            const std::uint32_t one[column_group] = {ones.x, ones.y, ones.z, ones.w};
            const float power[column_group] = {powers.x, powers.y, powers.z, powers.w};
            encode_fp4_group(plan, unscaled, values, exponent, six, one, power, words, random_mask, codes, dequantized,
                             halves, counts[counter_flushed], counts[counter_saturated]);
          } else {
            unsigned long long wide[mx_counter_count] = {0, 0, 0, 0};
#pragma unroll
            for (int k = 0; k < column_group; ++k) {
              const bool nonfinite = exponent[k] == 255;
              codes[k] = encode_column_element(constants, plan, values[k], nonfinite, nonfinite ? 0 : exponent[k],
                                               nonfinite ? 0U : words.word[k], dequantized[k], wide);
              halves[k] = operand_half(dequantized[k]);
            }
            counts[counter_flushed] += static_cast<unsigned>(wide[counter_flushed]);
            counts[counter_saturated] += static_cast<unsigned>(wide[counter_saturated]);
          }
          store_column_row(output, operand, (r0 + r) * row_bytes, flat, c_first + c, column_group, true, packed, codes,
                           dequantized, halves);
        }
      }
    }
    __syncthreads();  // the tile is read before the next one is written
  }
  if (output.counters != nullptr) {
    const unsigned long long wide[mx_counter_count] = {counts[0], counts[1], counts[2], counts[3]};
    add_counters(output.counters, wide);
  }
}

bool column_path_covers(const mx_plan& plan) { return plan.axis == 0 && fast_encode::covers(plan.element); }

// Whether the staged kernel takes a tensor: blocks of 32, rows read in 16-byte vectors, no rotation
// or one of 16 (rotation_size).
bool staged_columns_fit(const void* input, std::int64_t cols, const mx_plan& plan, const mx_device_output& output,
                        int rotation_size) {
  const auto on16 = [](const void* pointer) { return reinterpret_cast<std::uintptr_t>(pointer) % 16 == 0; };
  return plan.axis == 0 && fast_encode::covers(plan.element) && plan.block == staged_rows && cols % 8 == 0 &&
         (rotation_size == 0 || rotation_size == staged_rows / 2) && on16(input) && on16(output.codes) &&
         (output.dequantized == nullptr || on16(output.dequantized)) &&
         (output.operand_bf16 == nullptr || on16(output.operand_bf16));
}

// The staged kernel on a tensor it fits (staged_columns_fit), rotated along axis 0 by `rotation`
// (size 0 or 16; signs: the rotation's sign vector over the rows, or null).
template <class Input>
void launch_staged_columns(const Input* input, std::int64_t rows, std::int64_t cols, const mx_plan& plan,
                           const mx_device_output& output, int rotation, const float* signs) {
  const std::int64_t tiles = ((cols + staged_columns - 1) / staged_columns) * ((rows + staged_rows - 1) / staged_rows);
  const unsigned grid = static_cast<unsigned>(std::clamp<std::int64_t>(tiles, 1, std::int64_t{1} << 20));
  const auto kernel = rotation == 0 ? mx_staged_column_kernel<Input, 0> : mx_staged_column_kernel<Input, staged_rows / 2>;
  runtime::launch(kernel, grid, threads_per_block, 0, input, rows, cols, plan, fast_encode::constants_of(plan.element),
                  output, output.operand_bf16, signs);
}

// Along axis 0 in one pass (codes, scales, counters and output.operand_bf16 where given): the staged
// kernel where it fits, else mx_column_kernel.
template <class Input>
void launch_columns(const Input* input, std::int64_t rows, std::int64_t cols, const mx_plan& plan,
                    const mx_device_output& output) {
  if (staged_columns_fit(input, cols, plan, output, 0)) {
    launch_staged_columns(input, rows, cols, plan, output, 0, nullptr);
    return;
  }
  const std::int64_t groups = (cols + column_group - 1) / column_group;
  const std::int64_t tiles = ((groups + column_tile_groups - 1) / column_tile_groups) * ((rows + plan.block - 1) / plan.block);
  const unsigned grid = static_cast<unsigned>(std::clamp<std::int64_t>(tiles, 1, std::int64_t{1} << 20));
  runtime::launch(mx_column_kernel<Input>, grid, threads_per_block, 0, input, rows, cols, plan,
                  fast_encode::constants_of(plan.element), output, output.operand_bf16);
}
